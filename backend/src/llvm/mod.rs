//! Native code through LLVM 19 (inkwell, feature `llvm`) for the elementwise and row-wise kernels of
//! one rank's `Program`: residual adds, SiLU-mul, RMSNorm and RoPE, with a residual add and the
//! RMSNorm reading it fused into one loop nest (see `crate::native` for which instructions and the
//! functions' ABI). Each host module also holds the rank's entry function, `pleat_rank_main`, which
//! runs the whole program: it calls those kernels directly and the runtime's `pleat_rt_*` C ABI for
//! every other instruction, with the instruction's constants baked in (`crate::native::abi`).
//!
//! Every size is a constant of the program. Every module passes LLVM's verifier before it is
//! optimized or emitted (a failure is an [`LlvmError::Verify`], never a panic). Host code is
//! optimized with LLVM's `default<O3>` pipeline for the host CPU or [`CodegenOptions::target_cpu`],
//! and computes exactly what the runtime's interpreted kernels compute. PTX is emitted for
//! `nvptx64-nvidia-cuda` at sm_80 and sm_90, each kernel a `.entry`; a GPU also gets an attention
//! forward (one query row a thread, an online softmax), ring attention's merge and the embedding
//! lookup (`crate::native::device_kernels`), whose host builds the tests check against a reference.

mod codegen;
mod cpus;
mod entry;

pub use cpus::{check_host_target_cpu, X86_64_CPUS};

use std::path::{Path, PathBuf};
use std::process::Command;

use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;

use crate::native::{device_kernels, native_kernels, program_fingerprint, DeviceCode, DeviceKernel, NativeKernel};
use crate::program::Program;
use codegen::{Codegen, Elements, Flavor};

/// The GPU architectures `--emit ptx` targets, with the PTX ISA version each needs.
pub const PTX_ARCHES: [(&str, &str); 2] = [("sm_80", "+ptx70"), ("sm_90", "+ptx78")];

/// Everything native code generation can reject.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum LlvmError {
    /// LLVM's verifier rejected a generated module.
    #[error("llvm's verifier rejected module {module}: {message}; this is a pleat bug, report it with the program")]
    #[diagnostic(code(E0510), help("this is a pleat bug; report it with the program"))]
    Verify {
        /// The module's name.
        module: String,
        /// The verifier's report.
        message: String,
    },
    /// No target machine for a triple and CPU.
    #[error("llvm cannot target {triple} (cpu {cpu:?}): {message}")]
    #[diagnostic(code(E0511), help("pick another --target-cpu, or an LLVM 19 with that target"))]
    Target {
        /// The target triple.
        triple: String,
        /// The CPU asked for.
        cpu: String,
        /// LLVM's reason.
        message: String,
    },
    /// The IR builder failed.
    #[error("llvm's IR builder failed: {message}; this is a pleat bug, report it with the program")]
    #[diagnostic(code(E0512), help("this is a pleat bug; report it with the program"))]
    Builder {
        /// LLVM's reason.
        message: String,
    },
    /// An intrinsic LLVM does not know.
    #[error("llvm has no intrinsic {name}; build pleat against LLVM 19")]
    #[diagnostic(code(E0513), help("build pleat against LLVM 19"))]
    Intrinsic {
        /// The intrinsic's name.
        name: String,
    },
    /// A native kernel names an instruction that is not a kernel it can compile.
    #[error("instruction {instr} is not a kernel with native code; take the kernels from native::native_kernels")]
    #[diagnostic(code(E0514), help("emit native code only for kernels pleat generates"))]
    NotAKernel {
        /// The instruction's index.
        instr: usize,
    },
    /// The optimization pipeline failed.
    #[error("llvm's {passes} pipeline failed: {message}")]
    #[diagnostic(code(E0515), help("this is a pleat bug; report it with the program"))]
    Passes {
        /// The pipeline.
        passes: String,
        /// LLVM's reason.
        message: String,
    },
    /// Writing assembly, an object or a file failed.
    #[error("cannot write {path}: {message}; check the output directory is writable")]
    #[diagnostic(code(E0516), help("check that the output directory is writable"))]
    Write {
        /// The file.
        path: PathBuf,
        /// The reason.
        message: String,
    },
    /// A rank executable was asked for without the static runtime to link it with.
    #[error("a rank executable links the static runtime libpleat_rt.a, and none was given; build it with `cargo build -p pleat-rt`")]
    #[diagnostic(code(E0518), help("build the static runtime with `cargo build -p pleat-rt` (needs Open MPI)"))]
    NoRuntimeLibrary,
    /// Linking a rank executable failed.
    #[error("linking {object} with the static runtime {runtime} into a rank executable with `mpicc` failed: {message}; install Open MPI (libopenmpi-dev) and build the runtime with `cargo build -p pleat-rt`")]
    #[diagnostic(
        code(E0519),
        help("install Open MPI (libopenmpi-dev), and build the static runtime with `cargo build -p pleat-rt`")
    )]
    LinkExecutable {
        /// The object file.
        object: PathBuf,
        /// The static runtime.
        runtime: PathBuf,
        /// The linker's report.
        message: String,
    },
    /// `cc -shared` failed.
    #[error("linking {object} into a shared library with `cc -shared` failed: {message}; install a C toolchain (build-essential)")]
    #[diagnostic(code(E0517), help("install a linker (cc) or drop --emit so"))]
    Link {
        /// The object file.
        object: PathBuf,
        /// The linker's report.
        message: String,
    },
}

impl From<inkwell::builder::BuilderError> for LlvmError {
    fn from(error: inkwell::builder::BuilderError) -> Self {
        LlvmError::Builder { message: error.to_string() }
    }
}

/// What `emit` writes for one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Artifact {
    /// Optimized LLVM IR text, `rank<i>.ll`.
    LlvmIr,
    /// Host assembly, `rank<i>.s`.
    Asm,
    /// A host object file, `rank<i>.o`.
    Object,
    /// A host shared library the runtime loads, `rank<i>.so`.
    SharedLibrary,
    /// A rank executable, `rank<i>`: the rank's object linked with the static runtime
    /// ([`CodegenOptions::runtime_library`]) and MPI; mpirun starts one process a rank.
    Executable,
    /// PTX for each of [`PTX_ARCHES`], `rank<i>.<sm>.ptx`.
    Ptx,
}

/// How host code is generated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CodegenOptions {
    /// The CPU to tune and select instructions for (LLVM's names, e.g. `skylake`, `x86-64-v3`);
    /// `None`: this machine's CPU and features.
    pub target_cpu: Option<String>,
    /// The static runtime (`libpleat_rt.a`, package `pleat-rt`) that [`Artifact::Executable`]
    /// links each rank with.
    pub runtime_library: Option<PathBuf>,
}

/// Writes `artifact` for `program` into `dir`; returns the files written.
pub fn emit(
    program: &Program,
    artifact: Artifact,
    options: &CodegenOptions,
    dir: &Path,
) -> Result<Vec<PathBuf>, LlvmError> {
    let stem = dir.join(format!("rank{}", program.rank));
    let with_extension = |extension: &str| stem.with_extension(extension);
    match artifact {
        Artifact::LlvmIr => {
            let path = with_extension("ll");
            write(&path, host_ir(program, options)?.as_bytes())?;
            Ok(vec![path])
        }
        Artifact::Asm => {
            let path = with_extension("s");
            write(&path, &host_code_of(program, options, FileType::Assembly, HostModule::Library)?)?;
            Ok(vec![path])
        }
        Artifact::Object => {
            let path = with_extension("o");
            write(&path, &host_code_of(program, options, FileType::Object, HostModule::Library)?)?;
            Ok(vec![path])
        }
        Artifact::SharedLibrary => {
            let library = with_extension("so");
            link_through_object(program, options, HostModule::Library, dir, |object| link_shared(object, &library))?;
            Ok(vec![library])
        }
        Artifact::Executable => {
            let runtime = options.runtime_library.as_deref().ok_or(LlvmError::NoRuntimeLibrary)?;
            link_through_object(program, options, HostModule::Executable, dir, |object| {
                link_executable(object, runtime, &stem)
            })?;
            Ok(vec![stem])
        }
        // The PTX to read, and beside it what the CUDA runtime loads: the same module with each
        // kernel's thread count (`pleat run DIR --device cuda`).
        Artifact::Ptx => {
            let mut written = Vec::new();
            for (arch, _) in PTX_ARCHES {
                let code = device_code(program, arch)?;
                let path = with_extension(&format!("{arch}.ptx"));
                write(&path, code.ptx.as_bytes())?;
                written.push(path);
                let path = with_extension(&format!("{arch}.cuda.json"));
                let json = serde_json::to_string(&code)
                    .map_err(|error| LlvmError::Write { path: path.clone(), message: error.to_string() })?;
                write(&path, json.as_bytes())?;
                written.push(path);
            }
            Ok(written)
        }
    }
}

/// What a host module is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HostModule {
    /// A library: kernels, the fingerprint function and the entry function.
    Library,
    /// A rank executable's object: a library's functions and `main`.
    Executable,
}

/// The optimized LLVM IR of `program`'s native kernels for the host.
pub fn host_ir(program: &Program, options: &CodegenOptions) -> Result<String, LlvmError> {
    let context = Context::create();
    let (module, _machine) = optimized_host_module(&context, program, options, HostModule::Library)?;
    Ok(module.print_to_string().to_string())
}

/// The host object code or assembly of `program`'s native kernels.
pub fn host_code(program: &Program, options: &CodegenOptions, file_type: FileType) -> Result<Vec<u8>, LlvmError> {
    host_code_of(program, options, file_type, HostModule::Library)
}

/// The host object code or assembly of `program`'s module of kind `kind`.
fn host_code_of(
    program: &Program,
    options: &CodegenOptions,
    file_type: FileType,
    kind: HostModule,
) -> Result<Vec<u8>, LlvmError> {
    let context = Context::create();
    let (module, machine) = optimized_host_module(&context, program, options, kind)?;
    let buffer = machine
        .write_to_memory_buffer(&module, file_type)
        .map_err(|message| LlvmError::Write { path: PathBuf::from("<memory>"), message: message.to_string() })?;
    Ok(buffer.as_slice().to_vec())
}

/// `program`'s device kernels ([`device_kernels`]) as PTX for `arch` (one of [`PTX_ARCHES`], e.g.
/// `sm_90`), each a `.entry` named by its symbol, optimized with `default<O3>`.
pub fn ptx(program: &Program, arch: &str) -> Result<String, LlvmError> {
    device_code(program, arch).map(|code| code.ptx)
}

/// [`ptx`] with each kernel's thread count, what the CUDA runtime loads and launches.
pub fn device_code(program: &Program, arch: &str) -> Result<DeviceCode, LlvmError> {
    let features = PTX_ARCHES.iter().find(|(known, _)| *known == arch).map_or("", |(_, features)| features);
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let machine = target_machine(&triple, arch, features, RelocMode::Default)?;
    let context = Context::create();
    let module = context.create_module(&format!("rank{}.{arch}", program.rank));
    let codegen = Codegen::new(&context, &module, Flavor::Ptx, Elements::Declared);
    let mut kernels = Vec::new();
    for kernel in device_kernels(program) {
        codegen.define(program, &kernel)?;
        kernels.push(DeviceKernel { kernel, threads: codegen.items() });
    }
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    verify(&module)?;
    optimize(&module, &machine)?;
    let buffer = machine
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(|message| LlvmError::Write { path: PathBuf::from("<memory>"), message: message.to_string() })?;
    let ptx = String::from_utf8_lossy(buffer.as_slice()).into_owned();
    Ok(DeviceCode {
        fingerprint: program_fingerprint(program),
        arch: arch.to_string(),
        ptx,
        kernels,
        declared_elements: true,
    })
}

/// The unoptimized, target-independent LLVM IR of one native kernel on its own (for reading and
/// for snapshots).
pub fn kernel_ir(program: &Program, kernel: &NativeKernel) -> Result<String, LlvmError> {
    let context = Context::create();
    let module = context.create_module(&kernel.symbol());
    Codegen::new(&context, &module, Flavor::Host, Elements::Widened).define(program, kernel)?;
    verify(&module)?;
    Ok(module.print_to_string().to_string())
}

/// The unoptimized LLVM IR of `program`'s entry function, `pleat_rank_main` (for reading and for
/// snapshots; the module it is built in, with the kernels it calls, is verified first).
pub fn entry_ir(program: &Program) -> Result<String, LlvmError> {
    let context = Context::create();
    let module = kernel_module(&context, program, &format!("rank{}", program.rank))?;
    verify(&module)?;
    let entry = module
        .get_function(crate::native::abi::ENTRY_SYMBOL)
        .ok_or(LlvmError::Builder { message: "the module has no entry function".into() })?;
    Ok(inkwell::values::AnyValue::print_to_string(&entry).to_string())
}

/// Runs LLVM's verifier on `module`.
pub fn verify(module: &Module) -> Result<(), LlvmError> {
    module.verify().map_err(|message| LlvmError::Verify {
        module: module.get_name().to_string_lossy().into_owned(),
        message: message.to_string(),
    })
}

/// Builds every native kernel of `program` into one host module, with the fingerprint function and
/// the entry function that runs the whole program (`entry`).
fn kernel_module<'ctx>(context: &'ctx Context, program: &Program, name: &str) -> Result<Module<'ctx>, LlvmError> {
    let module = context.create_module(name);
    let codegen = Codegen::new(context, &module, Flavor::Host, Elements::Widened);
    codegen.define_fingerprint(program_fingerprint(program))?;
    for kernel in native_kernels(program) {
        codegen.define(program, &kernel)?;
    }
    entry::define_entry(context, &module, program)?;
    Ok(module)
}

/// The verified, `default<O3>`-optimized host module and its target machine.
fn optimized_host_module<'ctx>(
    context: &'ctx Context,
    program: &Program,
    options: &CodegenOptions,
    kind: HostModule,
) -> Result<(Module<'ctx>, TargetMachine), LlvmError> {
    Target::initialize_native(&InitializationConfig::default()).map_err(|message| LlvmError::Target {
        triple: "native".into(),
        cpu: String::new(),
        message,
    })?;
    let triple = TargetMachine::get_default_triple();
    let (cpu, features) = match &options.target_cpu {
        Some(cpu) => {
            cpus::check_target_cpu(&triple, cpu)?;
            (cpu.clone(), String::new())
        }
        None => (TargetMachine::get_host_cpu_name().to_string(), TargetMachine::get_host_cpu_features().to_string()),
    };
    let machine = target_machine(&triple, &cpu, &features, RelocMode::PIC)?;
    let module = kernel_module(context, program, &format!("rank{}", program.rank))?;
    if kind == HostModule::Executable {
        entry::define_main(context, &module, program.rank)?;
    }
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    verify(&module)?;
    optimize(&module, &machine)?;
    Ok((module, machine))
}

fn target_machine(
    triple: &TargetTriple,
    cpu: &str,
    features: &str,
    reloc_mode: RelocMode,
) -> Result<TargetMachine, LlvmError> {
    let target_error = |message: String| LlvmError::Target {
        triple: triple.as_str().to_string_lossy().into_owned(),
        cpu: cpu.to_string(),
        message,
    };
    let target = Target::from_triple(triple).map_err(|message| target_error(message.to_string()))?;
    target
        .create_target_machine(triple, cpu, features, OptimizationLevel::Aggressive, reloc_mode, CodeModel::Default)
        .ok_or_else(|| target_error("LLVM could not create the target machine".into()))
}

fn optimize(module: &Module, machine: &TargetMachine) -> Result<(), LlvmError> {
    let passes = "default<O3>";
    module
        .run_passes(passes, machine, PassBuilderOptions::create())
        .map_err(|message| LlvmError::Passes { passes: passes.into(), message: message.to_string() })?;
    // Optimization must keep the module valid; checked again before anything is emitted.
    verify(module)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), LlvmError> {
    std::fs::write(path, bytes)
        .map_err(|error| LlvmError::Write { path: path.to_path_buf(), message: error.to_string() })
}

/// Writes `program`'s host object of kind `kind` to a scratch file in `dir`, runs `link` on it and
/// removes it.
fn link_through_object(
    program: &Program,
    options: &CodegenOptions,
    kind: HostModule,
    dir: &Path,
    link: impl FnOnce(&Path) -> Result<(), LlvmError>,
) -> Result<(), LlvmError> {
    let object = dir.join(format!(".rank{}.{}.o", program.rank, std::process::id()));
    write(&object, &host_code_of(program, options, FileType::Object, kind)?)?;
    let linked = link(&object);
    let _ = std::fs::remove_file(&object);
    linked
}

/// Runs a linker command; its standard error when it fails or cannot start.
fn run_linker(command: &mut Command) -> Result<(), String> {
    let output = command.output().map_err(|error| format!("cannot run {:?}: {error}", command.get_program()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
    }
}

/// Links `object` into the shared library `library` with the system C compiler (libm for `expf`,
/// `cos` and `sin`).
fn link_shared(object: &Path, library: &Path) -> Result<(), LlvmError> {
    run_linker(Command::new("cc").arg("-shared").arg("-o").arg(library).arg(object).arg("-lm"))
        .map_err(|message| LlvmError::Link { object: object.to_path_buf(), message })
}

/// Links `object` (with its `main`) and the static runtime `runtime` into the executable
/// `executable` with Open MPI's compiler wrapper, which adds MPI's libraries; the others are those
/// a Rust static library needs on Linux (`rustc --print native-static-libs`).
fn link_executable(object: &Path, runtime: &Path, executable: &Path) -> Result<(), LlvmError> {
    run_linker(Command::new("mpicc").arg("-o").arg(executable).arg(object).arg(runtime).args([
        "-ldl",
        "-lgcc_s",
        "-lutil",
        "-lrt",
        "-lpthread",
        "-lm",
        "-Wl,--gc-sections",
        "-Wl,--strip-debug",
    ]))
    .map_err(|message| LlvmError::LinkExecutable {
        object: object.to_path_buf(),
        runtime: runtime.to_path_buf(),
        message,
    })
}

#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod tests;
