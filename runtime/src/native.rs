//! Native kernels: a shared library that `pleat compile --emit so` generated for one rank's program
//! (through `pleat_backend::llvm`), opened with `libloading`, as a table from instruction index to
//! function. The executor calls a table's function instead of its interpreted kernel for those
//! instructions (`executor::execute_native`). A library with an entry function (`pleat_rank_main`)
//! runs the whole program instead, calling back into the runtime's C ABI (`crate::capi`).
//!
//! Guarantees: a library is accepted only for the program it was generated for (its
//! `pleat_program_fingerprint` must equal `pleat_backend::native::program_fingerprint` of the
//! program) and only if it exports every function `pleat_backend::native::native_kernels` selects;
//! every call checks each operand's element count and kind against the program before it passes
//! raw pointers, so a call never reads or writes past a buffer. Every symbol is bound at load, so a
//! library that needs `pleat_rt_*` functions this process lacks is refused there. Loading needs no
//! LLVM.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use libloading::Library;
use pleat_backend::native::abi::ENTRY_SYMBOL;
use pleat_backend::native::{native_kernels, program_fingerprint, NativeKernel, FINGERPRINT_SYMBOL};
use pleat_backend::{BufferId, Program};

/// `void pleat_kernel_<i>(const float* const* inputs, float* out)`.
type KernelFunction = unsafe extern "C" fn(*const *const f32, *mut f32);
/// `void pleat_fused_<i>(const float* const* inputs, float* sum, float* normed)`.
type FusedFunction = unsafe extern "C" fn(*const *const f32, *mut f32, *mut f32);
/// `uint64_t pleat_program_fingerprint(void)`.
pub type FingerprintFunction = unsafe extern "C" fn() -> u64;
/// `int32_t pleat_rank_main(void* ctx)`: a rank library's entry function, which runs the whole
/// program through the `pleat_rt_*` C ABI (`crate::capi`); 0 on success.
pub type EntryFunction = unsafe extern "C" fn(*mut std::ffi::c_void) -> i32;

/// Everything loading or calling native kernels can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum NativeError {
    /// The library could not be opened.
    #[error("cannot load native kernels from {path}: {message}; compile again with `pleat compile --emit so`")]
    #[diagnostic(code(E0530), help("compile again with `pleat compile --emit so`"))]
    Open {
        /// The library.
        path: PathBuf,
        /// The loader's reason.
        message: String,
    },
    /// The library lacks a function the program needs.
    #[error("{path} has no function {symbol}: {message}; compile again with `pleat compile --emit so`")]
    #[diagnostic(code(E0531), help("compile again with `pleat compile --emit so`"))]
    MissingSymbol {
        /// The library.
        path: PathBuf,
        /// The missing symbol.
        symbol: String,
        /// The loader's reason.
        message: String,
    },
    /// The library was generated for another program.
    #[error(
        "{path} was generated for another program (fingerprint {found:#018x}, this program's is \
         {expected:#018x}); compile again with `pleat compile --emit so`"
    )]
    #[diagnostic(code(E0532), help("compile again with `pleat compile --emit so`"))]
    Stale {
        /// The library.
        path: PathBuf,
        /// This program's fingerprint.
        expected: u64,
        /// The library's.
        found: u64,
    },
    /// The library calls the runtime's C ABI, but this executable does not export it.
    #[error(
        "{path} calls the runtime's pleat_rt_* functions, which this executable does not export ({message}); \
         link the executable with `-Wl,--export-dynamic-symbol=pleat_rt_*` (pleat's build.rs does)"
    )]
    #[diagnostic(code(E0535), help("link the executable with -Wl,--export-dynamic-symbol=pleat_rt_*"))]
    RuntimeNotExported {
        /// The library.
        path: PathBuf,
        /// The loader's reason.
        message: String,
    },
    /// No native function starts at this instruction.
    #[error("instruction {instr} has no native kernel; call only instructions the table covers")]
    #[diagnostic(code(E0533), help("call only instructions the native table covers"))]
    NoKernel {
        /// The instruction.
        instr: usize,
    },
    /// An operand's size or kind differs from the program's.
    #[error(
        "native kernel of instruction {instr}: operand {operand} holds {got} {got_kind} elements, the \
         program declares {expected} {expected_kind}; pass the instruction's own buffers"
    )]
    #[diagnostic(code(E0534), help("pass the instruction's own buffers"))]
    Operand {
        /// The instruction.
        instr: usize,
        /// The operand's position.
        operand: usize,
        /// Elements the program declares.
        expected: usize,
        /// Elements passed.
        got: usize,
        /// `f32` or `u32`, as declared.
        expected_kind: &'static str,
        /// `f32` or `u32`, as passed.
        got_kind: &'static str,
    },
}

/// An operand passed to a native kernel.
#[derive(Clone, Copy, Debug)]
pub enum NativeOperand<'a> {
    /// Floats.
    F32(&'a [f32]),
    /// Token ids or positions.
    U32(&'a [u32]),
}

impl NativeOperand<'_> {
    fn len(&self) -> usize {
        match self {
            NativeOperand::F32(data) => data.len(),
            NativeOperand::U32(data) => data.len(),
        }
    }
    fn kind(&self) -> &'static str {
        match self {
            NativeOperand::F32(_) => "f32",
            NativeOperand::U32(_) => "u32",
        }
    }
    fn pointer(&self) -> *const f32 {
        match self {
            NativeOperand::F32(data) => data.as_ptr(),
            NativeOperand::U32(data) => data.as_ptr().cast(),
        }
    }
}

/// What one native call produced.
#[derive(Clone, Debug, PartialEq)]
pub struct NativeOutput {
    /// The result of the instruction called.
    pub out: Vec<f32>,
    /// For a fused add + RMSNorm: the norm's instruction index and its result, which the executor
    /// stores when it reaches that instruction.
    pub fused: Option<(usize, Vec<f32>)>,
}

#[derive(Clone, Copy)]
enum Function {
    Single(KernelFunction),
    Fused { function: FusedFunction, norm_instr: usize, norm_len: usize },
}

struct Entry {
    function: Function,
    /// The buffers passed, in order.
    buffers: Vec<BufferId>,
    /// Each operand's element count and whether it holds integers.
    operands: Vec<(usize, bool)>,
    /// Elements of the (first) result.
    out_len: usize,
}

/// A rank's native kernels: instruction index to function, with the library kept open.
pub struct NativeKernels {
    path: PathBuf,
    entries: HashMap<usize, Entry>,
    entry: Option<EntryFunction>,
    /// The fingerprint of the program the library was generated for.
    fingerprint: u64,
    // The function pointers above point into the library: it lives as long as the table.
    _library: Library,
}

impl std::fmt::Debug for NativeKernels {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("NativeKernels")
            .field("path", &self.path)
            .field("kernels", &self.entries.len())
            .field("entry", &self.entry.is_some())
            .finish()
    }
}

impl NativeKernels {
    /// Opens the library at `path` for `program`: checks its fingerprint and finds every function.
    pub fn open(path: &Path, program: &Program) -> Result<Self, NativeError> {
        let open_error = |message: String| NativeError::Open { path: path.to_path_buf(), message };
        // SAFETY: loading runs the library's initializers; pleat's generated libraries have none
        // (they hold only the kernel functions, the fingerprint function and the entry function).
        // Every symbol is bound now (RTLD_NOW), so a library whose `pleat_rt_*` calls this process
        // cannot satisfy fails here, not at its first call.
        let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
        let library: Library = unsafe { libloading::os::unix::Library::open(Some(path), flags) }
            .map_err(|error| {
                let message = error.to_string();
                if message.contains("pleat_rt_") {
                    NativeError::RuntimeNotExported { path: path.to_path_buf(), message }
                } else {
                    open_error(message)
                }
            })?
            .into();
        let lookup = |symbol: &str| -> Result<*const (), NativeError> {
            // SAFETY: the symbol is read as an address; it is called only through the type
            // `pleat_backend::native` documents for that name.
            unsafe { library.get::<*const ()>(symbol.as_bytes()) }.map(|symbol| *symbol).map_err(|error| {
                NativeError::MissingSymbol {
                    path: path.to_path_buf(),
                    symbol: symbol.to_string(),
                    message: error.to_string(),
                }
            })
        };
        // SAFETY: `pleat_program_fingerprint` has this signature in every library pleat generates.
        let fingerprint: FingerprintFunction = unsafe { std::mem::transmute(lookup(FINGERPRINT_SYMBOL)?) };
        // SAFETY: as above; the function only returns a constant.
        let found = unsafe { fingerprint() };
        let expected = program_fingerprint(program);
        if found != expected {
            return Err(NativeError::Stale { path: path.to_path_buf(), expected, found });
        }
        let shape = |id: BufferId| {
            let buffer = program.buffer(id);
            (buffer.numel() as usize, buffer.is_integer())
        };
        let mut entries = HashMap::new();
        for kernel in native_kernels(program) {
            let address = lookup(&kernel.symbol())?;
            let (buffers, outs) =
                kernel.buffers(program).ok_or(NativeError::NoKernel { instr: kernel.first_instr() })?;
            let function = match kernel {
                // SAFETY: `pleat_kernel_<i>` has this signature (see `pleat_backend::native`).
                NativeKernel::Single { .. } => {
                    Function::Single(unsafe { std::mem::transmute::<*const (), KernelFunction>(address) })
                }
                NativeKernel::FusedAddRmsNorm { norm_instr, .. } => Function::Fused {
                    // SAFETY: `pleat_fused_<i>` has this signature (see `pleat_backend::native`).
                    function: unsafe { std::mem::transmute::<*const (), FusedFunction>(address) },
                    norm_instr,
                    norm_len: shape(outs[1]).0,
                },
            };
            let entry = Entry {
                operands: buffers.iter().copied().map(shape).collect(),
                buffers,
                function,
                out_len: shape(outs[0]).0,
            };
            entries.insert(kernel.first_instr(), entry);
        }
        let entry = match lookup(ENTRY_SYMBOL) {
            // SAFETY: `pleat_rank_main` has this signature in every library pleat generates.
            Ok(address) => Some(unsafe { std::mem::transmute::<*const (), EntryFunction>(address) }),
            // Libraries from before the entry function hold only kernels; the executor calls those.
            Err(_) => None,
        };
        Ok(NativeKernels { path: path.to_path_buf(), entries, entry, fingerprint: found, _library: library })
    }

    /// The library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many native functions the table holds (a fused pair counts once).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The library's entry function, which runs the whole program (`crate::capi`), if it has one.
    pub fn entry(&self) -> Option<EntryFunction> {
        self.entry
    }

    /// Whether the library was generated for `program` (its fingerprint is `program`'s).
    pub fn is_for(&self, program: &Program) -> bool {
        program_fingerprint(program) == self.fingerprint
    }

    /// Whether the table holds no function.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a native function starts at instruction `instr`.
    pub fn covers(&self, instr: usize) -> bool {
        self.entries.contains_key(&instr)
    }

    /// The buffers the native function at instruction `instr` reads, in the order [`Self::call`]
    /// takes them: the instruction's operands, or for a fused add + RMSNorm the add's two operands
    /// then the norm's weight. Empty when no function starts there.
    pub fn operand_buffers(&self, instr: usize) -> &[BufferId] {
        self.entries.get(&instr).map_or(&[], |entry| &entry.buffers)
    }

    /// Runs the native function of instruction `instr` on the contents of
    /// [`Self::operand_buffers`].
    pub fn call(&self, instr: usize, operands: &[NativeOperand]) -> Result<NativeOutput, NativeError> {
        let entry = self.entries.get(&instr).ok_or(NativeError::NoKernel { instr })?;
        let mut out = vec![0.0f32; entry.out_len];
        match entry.function {
            Function::Single(_) => {
                self.call_into(instr, operands, &mut out, None)?;
                Ok(NativeOutput { out, fused: None })
            }
            Function::Fused { norm_instr, norm_len, .. } => {
                let mut normed = vec![0.0f32; norm_len];
                self.call_into(instr, operands, &mut out, Some(&mut normed))?;
                Ok(NativeOutput { out, fused: Some((norm_instr, normed)) })
            }
        }
    }

    /// As [`Self::call`], writing the result into `out` (and a fused kernel's norm into `normed`)
    /// instead of fresh vectors, as the entry path writes into its planned arena.
    pub fn call_into(
        &self,
        instr: usize,
        operands: &[NativeOperand],
        out: &mut [f32],
        normed: Option<&mut [f32]>,
    ) -> Result<(), NativeError> {
        let entry = self.entries.get(&instr).ok_or(NativeError::NoKernel { instr })?;
        check_operands(entry, instr, operands)?;
        let wrong_result = |operand: usize, expected: usize, got: usize| NativeError::Operand {
            instr,
            operand,
            expected,
            got,
            expected_kind: "f32 result",
            got_kind: "f32 result",
        };
        if out.len() != entry.out_len {
            return Err(wrong_result(operands.len(), entry.out_len, out.len()));
        }
        let pointers: Vec<*const f32> = operands.iter().map(NativeOperand::pointer).collect();
        match (entry.function, normed) {
            (Function::Single(function), None) => {
                // SAFETY: the library was generated for this program (fingerprint checked at open);
                // its function reads exactly the operands' declared sizes, checked above, and writes
                // `out_len` elements to `out`.
                unsafe { function(pointers.as_ptr(), out.as_mut_ptr()) };
                Ok(())
            }
            (Function::Fused { function, norm_len, .. }, Some(normed)) if normed.len() == norm_len => {
                // SAFETY: as above; the fused function writes `out_len` sums and `norm_len` norms.
                unsafe { function(pointers.as_ptr(), out.as_mut_ptr(), normed.as_mut_ptr()) };
                Ok(())
            }
            (Function::Fused { norm_len, .. }, normed) => {
                Err(wrong_result(operands.len() + 1, norm_len, normed.map_or(0, |normed| normed.len())))
            }
            (Function::Single(_), Some(normed)) => Err(wrong_result(operands.len() + 1, 0, normed.len())),
        }
    }
}

/// Checks `operands` against what instruction `instr`'s function (`entry`) reads: their number,
/// each one's element count and kind.
fn check_operands(entry: &Entry, instr: usize, operands: &[NativeOperand]) -> Result<(), NativeError> {
    let kind_name = |integer: bool| if integer { "u32" } else { "f32" };
    for (operand, (&(expected, integer), given)) in entry.operands.iter().zip(operands.iter()).enumerate() {
        if given.len() != expected || given.kind() != kind_name(integer) {
            return Err(NativeError::Operand {
                instr,
                operand,
                expected,
                got: given.len(),
                expected_kind: kind_name(integer),
                got_kind: given.kind(),
            });
        }
    }
    if operands.len() != entry.operands.len() {
        let operand = operands.len().min(entry.operands.len());
        let (expected, integer) = entry.operands.get(operand).copied().unwrap_or((0, false));
        return Err(NativeError::Operand {
            instr,
            operand,
            expected,
            got: 0,
            expected_kind: kind_name(integer),
            got_kind: "no",
        });
    }
    Ok(())
}
