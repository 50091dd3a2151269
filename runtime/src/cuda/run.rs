//! One rank's program on the device, and every rank of a world as threads sharing one device.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::time::Instant;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as driver, sys};
use half::bf16;
use pleat_backend::native::{DeviceCode, NativeKernel};
use pleat_backend::{BufferId, BufferKind, DType, Instr, Kernel, Program};

use super::device::CudaDevice;
use super::memory::DeviceMemory;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::executor::{nanos_since, HostData, RankOutcome, Run, RunInputs};
use crate::kernels;
use crate::launch::{on_rank_threads, ThreadRunOptions};

/// Threads a block of a generated kernel.
const BLOCK_THREADS: u64 = 256;

/// What one rank's run on the device produced, measured and where its instructions ran.
#[derive(Clone, Debug)]
pub struct DeviceRankOutcome {
    /// Outputs, device memory (`peak_bytes`: the most bytes of device buffers live at once, at
    /// their declared sizes), bytes sent and each instruction's span (the stream synchronized at
    /// its end, so a span is the instruction's own time).
    pub outcome: RankOutcome,
    /// Instructions run on the GPU: cuBLAS GEMMs and generated kernels (a fused add and norm
    /// count as two).
    pub on_device: usize,
    /// Instructions run on the host, by kind (`load_param`, `all_reduce`, `Attention`, ...); frees
    /// and waits are counted in neither.
    pub on_host: BTreeMap<String, usize>,
}

/// Runs `programs` (one a rank, in rank order) as threads sharing `device`, rank `i` launching
/// `code[i]`'s kernels where it has them; the ranks' collectives go over the threads communicator
/// `options` describe, through the host. Errors as [`crate::run_on_threads`]'s: the first rank's own
/// failure, never a hang past `options.timeout`.
pub fn run_on_device(
    programs: &[Program],
    inputs: &RunInputs,
    options: &ThreadRunOptions,
    device: &CudaDevice,
    code: &[Option<DeviceCode>],
) -> Result<Vec<DeviceRankOutcome>> {
    on_rank_threads(programs, options, |program, comm, gemm_threads| {
        let code = code.get(program.rank as usize).and_then(Option::as_ref);
        execute_on_device(program, comm, inputs, gemm_threads, device, code)
    })
}

/// Runs `program` on `device` from the calling thread.
pub(super) fn execute_on_device(
    program: &Program,
    comm: &mut dyn Communicator,
    inputs: &RunInputs,
    gemm_threads: usize,
    device: &CudaDevice,
    code: Option<&DeviceCode>,
) -> Result<DeviceRankOutcome> {
    let rank = program.rank;
    device.bind().map_err(|error| cuda_error(rank, 0, "cuCtxSetCurrent", error))?;
    let host = Run::new(program, comm, inputs, gemm_threads)?;
    let mut run = DeviceRun::new(program, host, code, inputs.epoch)?;
    run.run_all()?;
    run.finish()
}

fn cuda_error(rank: u32, instr: usize, call: &'static str, error: impl std::fmt::Display) -> Error {
    Error::Cuda { rank, instr, call, message: error.to_string() }
}

/// The rank's CUDA stream; synchronized before it is destroyed, so nothing still runs when the
/// memory it uses is freed.
struct Stream(sys::CUstream);

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by this rank and is destroyed once. Errors at the end of a
        // run (the device already failed) leave nothing to recover.
        unsafe {
            let _ = driver::stream::synchronize(self.0);
            let _ = driver::stream::destroy(self.0);
        }
    }
}

/// The rank's cuBLAS handle, on its stream.
struct Blas(blas_sys::cublasHandle_t);

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by `blas::create_handle`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// A generated kernel ready to launch.
struct Launch {
    function: sys::CUfunction,
    threads: u64,
    /// The device array of its operands' addresses.
    table: sys::CUdeviceptr,
    /// The buffers it writes.
    outs: Vec<BufferId>,
    /// The instructions it computes (two for a fused add and norm).
    instrs: Vec<usize>,
}

/// The rank's loaded PTX module and its kernels, by the first instruction each computes.
struct Kernels {
    module: Option<sys::CUmodule>,
    launches: HashMap<usize, Launch>,
    /// Instructions a launch at an earlier one already computed.
    computed_earlier: HashSet<usize>,
    /// The operand tables (one allocation).
    tables: sys::CUdeviceptr,
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module and the tables were made by `Kernels::load` and are released once,
        // after the stream (dropped first) finished every launch.
        unsafe {
            if let Some(module) = self.module {
                let _ = driver::module::unload(module);
            }
            if self.tables != 0 {
                let _ = driver::free_sync(self.tables);
            }
        }
    }
}

impl Kernels {
    /// Loads `code`'s module and sets up each kernel whose buffers the device can run it on
    /// ([`launch_buffers`]: f32 floats, or bf16 where the code reads them so; a fused pair only
    /// where nothing is freed between the add and the norm, as
    /// `pleat_backend::native::schedule_for_fusion` leaves it). Others run on the host.
    fn load(program: &Program, memory: &DeviceMemory, code: Option<&DeviceCode>) -> Result<Kernels> {
        let rank = program.rank;
        let mut kernels =
            Kernels { module: None, launches: HashMap::new(), computed_earlier: HashSet::new(), tables: 0 };
        let Some(code) = code.filter(|code| !code.kernels.is_empty()) else { return Ok(kernels) };
        let expected = pleat_backend::native::program_fingerprint(program);
        if code.fingerprint != expected {
            return Err(Error::Program {
                rank,
                instr: 0,
                reason: format!(
                    "its device code was generated for another program (fingerprint {:016x}, this one's is \
                     {expected:016x}); compile the directory again with --emit ptx",
                    code.fingerprint
                ),
            });
        }
        let ptx = CString::new(code.ptx.as_str())
            .map_err(|_| cuda_error(rank, 0, "cuModuleLoadData", "the PTX holds a NUL byte"))?;
        // SAFETY: `ptx` is a NUL-terminated PTX module that lives across the call.
        let module = unsafe { driver::module::load_data(ptx.as_ptr().cast()) }
            .map_err(|error| cuda_error(rank, 0, "cuModuleLoadData", format!("{error} (the {} PTX)", code.arch)))?;
        kernels.module = Some(module);
        let mut tables: Vec<u64> = Vec::new();
        let mut pending = Vec::new();
        for device_kernel in &code.kernels {
            let Some((operands, outs, instrs)) = launch_buffers(program, &device_kernel.kernel, code.declared_elements)
            else {
                continue;
            };
            let symbol = device_kernel.kernel.symbol();
            let name = CString::new(symbol.clone()).map_err(|_| cuda_error(rank, 0, "cuModuleGetFunction", &symbol))?;
            // SAFETY: `module` is loaded; `name` is NUL-terminated.
            let function = unsafe { driver::module::get_function(module, name) }
                .map_err(|error| cuda_error(rank, instrs[0], "cuModuleGetFunction", format!("{symbol}: {error}")))?;
            pending.push((tables.len(), Launch { function, threads: device_kernel.threads, table: 0, outs, instrs }));
            tables.extend(operands.iter().map(|&operand| memory.address(operand)));
        }
        if tables.is_empty() {
            return Ok(kernels);
        }
        let bytes = std::mem::size_of_val(tables.as_slice());
        // SAFETY: allocates and fills the table, synchronously, before any launch reads it.
        kernels.tables = unsafe { driver::malloc_sync(bytes) }
            .map_err(|error| cuda_error(rank, 0, "cuMemAlloc", format!("{bytes} bytes: {error}")))?;
        unsafe { driver::memcpy_htod_sync(kernels.tables, &tables) }
            .map_err(|error| cuda_error(rank, 0, "cuMemcpyHtoD", error))?;
        for (first, mut launch) in pending {
            launch.table = kernels.tables + (first * std::mem::size_of::<u64>()) as u64;
            kernels.computed_earlier.extend(&launch.instrs[1..]);
            kernels.launches.insert(launch.instrs[0], launch);
        }
        Ok(kernels)
    }
}

/// A generated kernel's operands (what its `inputs` array holds), results and instructions, when
/// the device can run it: every float it reads or writes is f32, or bf16 where the code reads
/// each buffer at its declared dtype (`declared_elements`).
fn launch_buffers(
    program: &Program,
    kernel: &NativeKernel,
    declared_elements: bool,
) -> Option<(Vec<BufferId>, Vec<BufferId>, Vec<usize>)> {
    let (operands, outs) = kernel.buffers(program)?;
    if let NativeKernel::FusedAddRmsNorm { add_instr, norm_instr } = *kernel {
        // The kernel writes the norm's result at the add: nothing may be freed in between, or the
        // norm's slot could still be an operand's.
        let frees_between =
            program.instructions[add_instr + 1..norm_instr].iter().any(|instr| matches!(instr, Instr::Free { .. }));
        if frees_between {
            return None;
        }
    }
    let instrs = kernel.instrs();
    let device_ready = |id: &BufferId| {
        let buffer = program.buffer(*id);
        buffer.is_integer() || buffer.dtype == DType::F32 || (declared_elements && buffer.dtype == DType::Bf16)
    };
    (operands.iter().all(device_ready) && outs.iter().all(device_ready)).then_some((operands, outs, instrs))
}

/// Memory a run counts, at the buffers' declared sizes.
#[derive(Default)]
struct LiveBytes {
    live: Vec<bool>,
    bytes: u64,
    peak: u64,
    activations: u64,
    in_flight: u64,
    in_flight_peak: u64,
}

impl LiveBytes {
    fn written(&mut self, program: &Program, id: BufferId) {
        let index = id.as_u32() as usize;
        if self.live.get(index).copied().unwrap_or(true) {
            return;
        }
        self.live[index] = true;
        self.count(program, id, true);
    }
    fn freed(&mut self, program: &Program, id: BufferId) {
        let index = id.as_u32() as usize;
        if !self.live.get(index).copied().unwrap_or(false) {
            return;
        }
        self.live[index] = false;
        self.count(program, id, false);
    }
    fn count(&mut self, program: &Program, id: BufferId, add: bool) {
        let buffer = program.buffer(id);
        let bytes = buffer.bytes();
        let change = |total: &mut u64| *total = if add { *total + bytes } else { total.saturating_sub(bytes) };
        change(&mut self.bytes);
        match buffer.kind {
            BufferKind::Activation => change(&mut self.activations),
            BufferKind::InFlight => change(&mut self.in_flight),
            _ => {}
        }
        self.peak = self.peak.max(self.bytes);
        self.in_flight_peak = self.in_flight_peak.max(self.in_flight);
    }
}

/// One rank's run in progress on the device. Fields drop in order: cuBLAS, then the stream (which
/// waits for every launch), then the kernels and the memory they used.
struct DeviceRun<'a> {
    program: &'a Program,
    blas: Blas,
    stream: Stream,
    kernels: Kernels,
    memory: DeviceMemory,
    /// The CPU executor's run, where the host's instructions run on operands copied out.
    host: Run<'a>,
    live: LiveBytes,
    activation_trace: Vec<u64>,
    timings: Vec<(u64, u64)>,
    on_device: usize,
    on_host: BTreeMap<String, usize>,
    epoch: Instant,
}

impl<'a> DeviceRun<'a> {
    fn new(program: &'a Program, host: Run<'a>, code: Option<&DeviceCode>, epoch: Instant) -> Result<Self> {
        let rank = program.rank;
        // SAFETY: the device's context is current on this thread (`execute_on_device`).
        let stream = Stream(
            driver::stream::create(driver::stream::StreamKind::NonBlocking)
                .map_err(|error| cuda_error(rank, 0, "cuStreamCreate", error))?,
        );
        let blas = Blas(blas::create_handle().map_err(|error| cuda_error(rank, 0, "cublasCreate", error))?);
        // SAFETY: both handles are live; cuBLAS then runs every GEMM on the rank's stream.
        unsafe { blas::set_stream(blas.0, stream.0.cast()) }
            .map_err(|error| cuda_error(rank, 0, "cublasSetStream", error))?;
        let memory = DeviceMemory::new(program).map_err(|message| cuda_error(rank, 0, "cuMemAlloc", message))?;
        let kernels = Kernels::load(program, &memory, code)?;
        Ok(DeviceRun {
            program,
            blas,
            stream,
            kernels,
            memory,
            host,
            live: LiveBytes { live: vec![false; program.buffers.len()], ..LiveBytes::default() },
            activation_trace: Vec::with_capacity(program.instructions.len()),
            timings: Vec::with_capacity(program.instructions.len()),
            on_device: 0,
            on_host: BTreeMap::new(),
            epoch,
        })
    }

    fn error(&self, instr: usize, call: &'static str, error: impl std::fmt::Display) -> Error {
        cuda_error(self.program.rank, instr, call, error)
    }

    fn run_all(&mut self) -> Result<()> {
        let program = self.program;
        for (index, instr) in program.instructions.iter().enumerate() {
            let start = nanos_since(self.epoch);
            self.step(index, instr)?;
            // SAFETY: the rank's stream is live.
            unsafe { driver::stream::synchronize(self.stream.0) }
                .map_err(|error| self.error(index, "cuStreamSynchronize", error))?;
            self.timings.push((start, nanos_since(self.epoch)));
            self.activation_trace.push(self.live.activations);
        }
        Ok(())
    }

    fn step(&mut self, index: usize, instr: &Instr) -> Result<()> {
        let program = self.program;
        match instr {
            Instr::Free { buf } => self.live.freed(program, *buf),
            // Transfers run to completion at their start here.
            Instr::Wait { .. } => {}
            _ if self.kernels.computed_earlier.contains(&index) => self.on_device += 1,
            Instr::Kernel { kernel, inputs, .. } if self.kernels.launches.contains_key(&index) => {
                // The generated lookup and loss gradient cannot fail: the ids are checked here
                // first, as the CPU kernels check them (a few bytes a token, copied back).
                let vocabulary = match kernel {
                    Kernel::Embedding { vocab_total, .. } | Kernel::EmbeddingGrad { vocab_total, .. } => {
                        Some(*vocab_total)
                    }
                    Kernel::CrossEntropyGrad { vocab, .. } => Some(*vocab),
                    _ => None,
                };
                if let (Some(vocabulary), Some(&tokens)) = (vocabulary, inputs.get(1)) {
                    self.check_token_ids(index, tokens, vocabulary)?;
                }
                self.launch(index)?;
            }
            Instr::Kernel { kernel, inputs, out } if gemm_on_device(program, kernel, inputs, *out) => {
                self.gemm(index, kernel, inputs, *out)?;
            }
            other => self.on_the_host(index, other)?,
        }
        Ok(())
    }

    /// Launches the generated kernel that computes instruction `index` (and the norm fused with
    /// it).
    fn launch(&mut self, index: usize) -> Result<()> {
        let Some(launch) = self.kernels.launches.get(&index) else { return Ok(()) };
        let (program, stream) = (self.program, self.stream.0);
        // Results are not zeroed first: every generated kernel stores each element of its results
        // (`native_kernels` takes only kernels whose sizes agree, RoPE's head width even).
        let mut addresses: Vec<u64> = launch.outs.iter().map(|&out| self.memory.address(out)).collect();
        let blocks = launch.threads.div_ceil(BLOCK_THREADS);
        if blocks > 0 {
            let mut table = launch.table;
            let mut parameters: Vec<*mut c_void> = std::iter::once(std::ptr::from_mut(&mut table).cast())
                .chain(addresses.iter_mut().map(|address| std::ptr::from_mut(address).cast()))
                .collect();
            let grid = u32::try_from(blocks).map_err(|_| self.error(index, "cuLaunchKernel", "too many blocks"))?;
            // SAFETY: the kernel's parameters are `(ptr inputs, ptr out...)` (`pleat_backend::native`),
            // given as the addresses of the table and of each result; every operand address in the
            // table is its buffer's allocation, whose sizes `native_kernels` checked.
            unsafe {
                driver::launch_kernel(
                    launch.function,
                    (grid, 1, 1),
                    (BLOCK_THREADS as u32, 1, 1),
                    0,
                    stream,
                    &mut parameters,
                )
            }
            .map_err(|error| self.error(index, "cuLaunchKernel", error))?;
        }
        for out in launch.outs.clone() {
            self.live.written(program, out);
        }
        // The later instruction of a fused launch counts when it comes.
        self.on_device += 1;
        Ok(())
    }

    /// A GEMM on cuBLAS: the row-major products as column-major ones with the operands swapped.
    fn gemm(&mut self, index: usize, kernel: &Kernel, inputs: &[BufferId], out: BufferId) -> Result<()> {
        let address = |id: BufferId| self.memory.address(id);
        let (a, b, c) = (address(inputs[0]), address(inputs[1]), address(out));
        let int = |value: u64| i32::try_from(value).map_err(|_| self.error(index, "cublasGemmEx", "a size past i32"));
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        // (op_a, op_b, rows, cols, depth, first, lda, second, ldb, ldc) of C = op(first)·op(second).
        let call = match *kernel {
            // out[m, n] = x[m, k]·w[n, k]ᵀ: outᵀ (n × m) = w (n × k) · xᵀ.
            Kernel::MatMul { m, n, k } => (T, N, int(n)?, int(m)?, int(k)?, b, int(k)?, a, int(k)?, int(n)?),
            // dx[m, k] = dy[m, n]·w[n, k]: dxᵀ (k × m) = wᵀ (k × n) · dyᵀ.
            Kernel::MatMulGradInput { m, n, k } => (N, N, int(k)?, int(m)?, int(n)?, b, int(k)?, a, int(n)?, int(k)?),
            // dw[n, k] = dy[m, n]ᵀ·x[m, k]: dwᵀ (k × n) = xᵀ (k × m) · dy.
            Kernel::MatMulGradWeight { m, n, k } => (N, T, int(k)?, int(n)?, int(m)?, b, int(k)?, a, int(n)?, int(k)?),
            _ => return Err(self.error(index, "cublasGemmEx", "not a GEMM")),
        };
        let (op_a, op_b, rows, cols, depth, first, lda, second, ldb, ldc) = call;
        // f32 or bf16 as each buffer is declared (`gemm_on_device` took the pairs cuBLAS has),
        // accumulated in f32 (not TF32), a bf16 result rounded once at the end, as the host
        // runtime's GEMM on widened operands stores it.
        let element = |id: BufferId| match self.program.buffer(id).dtype {
            DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            _ => blas_sys::cudaDataType::CUDA_R_32F,
        };
        // `first` is the column-major product's first operand: the instruction's second.
        let (first_type, second_type, c_type) = (element(inputs[1]), element(inputs[0]), element(out));
        let (one, zero) = (1.0f32, 0.0f32);
        // SAFETY: the three addresses are the operands' and the result's allocations, of the sizes
        // and element types the kernel's dimensions and the buffer table give (lowering checked the
        // sizes); alpha and beta are host f32 values, cuBLAS's default pointer mode, as the f32
        // compute type asks.
        unsafe {
            blas::gemm_ex(
                self.blas.0,
                op_a,
                op_b,
                rows,
                cols,
                depth,
                std::ptr::from_ref(&one).cast(),
                first as *const c_void,
                first_type,
                lda,
                second as *const c_void,
                second_type,
                ldb,
                std::ptr::from_ref(&zero).cast(),
                c as *mut c_void,
                c_type,
                ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|error| self.error(index, "cublasGemmEx", error))?;
        self.live.written(self.program, out);
        self.on_device += 1;
        Ok(())
    }

    /// Runs `instr` on the host: its operands copied out of device memory into the CPU executor's
    /// run, its step run there, its results copied back.
    fn on_the_host(&mut self, index: usize, instr: &Instr) -> Result<()> {
        let program = self.program;
        let mut operands = instr.inputs();
        operands.dedup();
        for &operand in &operands {
            if !self.host.holds(operand) {
                let data = self.download(index, operand)?;
                self.host.stage_in(operand, data)?;
            }
        }
        self.host.step(index, instr, None)?;
        for out in instr.outs() {
            if let Some(data) = self.host.stage_out(out) {
                self.upload(index, out, &data)?;
                self.live.written(program, out);
            }
        }
        for operand in operands {
            self.host.stage_out(operand);
        }
        *self.on_host.entry(kind_name(instr)).or_default() += 1;
        Ok(())
    }

    /// Refuses a token id in buffer `tokens` past the vocabulary, as the CPU kernel does, naming
    /// the instruction's result.
    fn check_token_ids(&self, index: usize, tokens: BufferId, vocab_total: u64) -> Result<()> {
        let HostData::U32(ids) = self.download(index, tokens)? else {
            return Err(self.error(index, "cuMemcpyDtoH", format!("{tokens} holds no token ids")));
        };
        kernels::check_token_ids(&ids, vocab_total as usize).map_err(|source| Error::Kernel {
            rank: self.program.rank,
            instr: index,
            what: self.program.instructions[index]
                .outs()
                .first()
                .map_or_else(String::new, |&out| self.program.buffer(out).name.clone()),
            source: Box::new(source),
        })
    }

    /// Buffer `id`'s elements, copied from the device.
    fn download(&self, index: usize, id: BufferId) -> Result<HostData> {
        let buffer = self.program.buffer(id);
        let (address, len, stream) = (self.memory.address(id), buffer.numel() as usize, self.stream.0);
        let copied = |result: std::result::Result<(), cudarc::driver::DriverError>| {
            result.and_then(|()| unsafe { driver::stream::synchronize(stream) })
        };
        // SAFETY: `address` is `id`'s allocation of `len` elements of the type read; the stream is
        // synchronized before the host reads the data.
        let data = unsafe {
            if buffer.is_integer() {
                let mut data = vec![0u32; len];
                copied(driver::memcpy_dtoh_async(&mut data, address, stream)).map(|()| HostData::U32(data))
            } else if buffer.dtype == DType::Bf16 {
                let mut data = vec![bf16::ZERO; len];
                copied(driver::memcpy_dtoh_async(&mut data, address, stream)).map(|()| HostData::Bf16(data))
            } else {
                let mut data = vec![0f32; len];
                copied(driver::memcpy_dtoh_async(&mut data, address, stream)).map(|()| HostData::F32(data))
            }
        };
        data.map_err(|error| self.error(index, "cuMemcpyDtoH", error))
    }

    /// Copies `data` into buffer `id`'s device memory.
    fn upload(&self, index: usize, id: BufferId, data: &HostData) -> Result<()> {
        let (address, stream) = (self.memory.address(id), self.stream.0);
        let expected = self.program.buffer(id).numel() as usize;
        let len = match data {
            HostData::F32(data) => data.len(),
            HostData::Bf16(data) => data.len(),
            HostData::U32(data) => data.len(),
        };
        if len != expected {
            return Err(self.error(index, "cuMemcpyHtoD", format!("{id} holds {expected} elements, not {len}")));
        }
        // SAFETY: `address` is `id`'s allocation, of `expected` elements at the declared size, which
        // is the size of `data`'s elements (the host run stores each buffer at its declared type).
        // The copy from pageable memory has read `data` when the call returns.
        unsafe {
            match data {
                HostData::F32(data) => driver::memcpy_htod_async(address, data, stream),
                HostData::Bf16(data) => driver::memcpy_htod_async(address, data, stream),
                HostData::U32(data) => driver::memcpy_htod_async(address, data, stream),
            }
        }
        .map_err(|error| self.error(index, "cuMemcpyHtoD", error))
    }

    fn finish(self) -> Result<DeviceRankOutcome> {
        let DeviceRun { host, live, activation_trace, timings, on_device, on_host, memory, .. } = self;
        let mut outcome = host.finish();
        outcome.peak_bytes = live.peak;
        outcome.activation_bytes = activation_trace;
        outcome.in_flight_peak_bytes = live.in_flight_peak;
        outcome.timings = timings;
        outcome.arena_bytes = memory.arena_bytes() as u64;
        Ok(DeviceRankOutcome { outcome, on_device, on_host })
    }
}

/// Whether `kernel` is a GEMM cuBLAS runs here.
fn gemm_on_device(program: &Program, kernel: &Kernel, inputs: &[BufferId], out: BufferId) -> bool {
    let dtype = |id: &BufferId| program.buffer(*id).dtype;
    // The type pairs cublasGemmEx computes in f32: f32 throughout, or bf16 operands into a bf16
    // or f32 result.
    let types = match inputs {
        [x, w] => matches!(
            (dtype(x), dtype(w), dtype(&out)),
            (DType::F32, DType::F32, DType::F32) | (DType::Bf16, DType::Bf16, DType::Bf16 | DType::F32)
        ),
        _ => false,
    };
    types && matches!(kernel, Kernel::MatMul { .. } | Kernel::MatMulGradInput { .. } | Kernel::MatMulGradWeight { .. })
}

/// An instruction's kind, as reports count them: the kernel's name, or the instruction's.
fn kind_name(instr: &Instr) -> String {
    let debug = match instr {
        Instr::Kernel { kernel, .. } => format!("{kernel:?}"),
        other => format!("{other:?}"),
    };
    debug.chars().take_while(char::is_ascii_alphanumeric).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_backend::Buffer;
    use pleat_ir::entity::EntityRef;

    /// `sum = a + b`, then (after `between`) `normed = rms_norm(sum, w)`, every buffer of `dtype`.
    fn add_then_norm(dtype: DType, between: Vec<Instr>) -> Program {
        let buffer = |name: &str, shape: &[u64]| Buffer {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            kind: BufferKind::Activation,
        };
        let id = BufferId::new;
        let mut instructions = vec![Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(0), id(1)], out: id(2) }];
        instructions.extend(between);
        instructions.push(Instr::Kernel {
            kernel: Kernel::RmsNorm { hidden: 4, eps: 1e-5 },
            inputs: vec![id(2), id(3)],
            out: id(4),
        });
        Program {
            format_version: pleat_backend::FORMAT_VERSION,
            model: "test".into(),
            mesh: String::new(),
            rank: 0,
            world_size: 1,
            tokens_shape: Vec::new(),
            buffers: vec![
                buffer("a", &[2, 4]),
                buffer("b", &[2, 4]),
                buffer("sum", &[2, 4]),
                buffer("w", &[4]),
                buffer("normed", &[2, 4]),
            ],
            instructions,
        }
    }

    #[test]
    fn a_fused_launch_reads_the_adds_operands_and_the_norms_weight_and_writes_both_results() {
        let program = add_then_norm(DType::F32, Vec::new());
        let fused = NativeKernel::FusedAddRmsNorm { add_instr: 0, norm_instr: 1 };
        let id = BufferId::new;
        assert_eq!(
            launch_buffers(&program, &fused, true),
            Some((vec![id(0), id(1), id(3)], vec![id(2), id(4)], vec![0, 1]))
        );
    }

    #[test]
    fn a_free_between_the_fused_pair_leaves_it_to_the_host() {
        // Its slot could be the norm's: writing the norm at the add would overwrite a live operand.
        let program = add_then_norm(DType::F32, vec![Instr::Free { buf: BufferId::new(0) }]);
        let fused = NativeKernel::FusedAddRmsNorm { add_instr: 0, norm_instr: 2 };
        assert_eq!(launch_buffers(&program, &fused, true), None);
    }

    #[test]
    fn bf16_buffers_are_launched_only_where_the_code_reads_them_as_bf16() {
        let program = add_then_norm(DType::Bf16, Vec::new());
        let add = NativeKernel::Single { instr: 0 };
        let id = BufferId::new;
        assert_eq!(launch_buffers(&program, &add, true), Some((vec![id(0), id(1)], vec![id(2)], vec![0])));
        // Code from before bf16 was generated reads every float as f32.
        assert_eq!(launch_buffers(&program, &add, false), None);
        assert!(launch_buffers(&add_then_norm(DType::F32, Vec::new()), &add, false).is_some());
    }

    #[test]
    fn gemms_run_on_cublas_for_the_type_pairs_it_has() {
        let id = BufferId::new;
        let gemm = Kernel::MatMul { m: 2, n: 4, k: 4 };
        let [x, w, out] = [id(0), id(1), id(2)];
        assert!(gemm_on_device(&add_then_norm(DType::F32, Vec::new()), &gemm, &[x, w], out));
        let mut program = add_then_norm(DType::Bf16, Vec::new());
        assert!(gemm_on_device(&program, &gemm, &[x, w], out));
        // bf16 operands into an f32 result.
        program.buffers[2].dtype = DType::F32;
        assert!(gemm_on_device(&program, &gemm, &[x, w], out));
        // One operand f32, the other bf16: no cuBLAS type pair; the host runs it.
        program.buffers[0].dtype = DType::F32;
        assert!(!gemm_on_device(&program, &gemm, &[x, w], out));
        // Not a GEMM.
        assert!(!gemm_on_device(&add_then_norm(DType::F32, Vec::new()), &Kernel::Add, &[x, w], out));
    }

    #[test]
    fn kinds_are_the_kernels_or_the_instructions_names() {
        let program = add_then_norm(DType::F32, vec![Instr::Free { buf: BufferId::new(0) }]);
        let kinds: Vec<String> = program.instructions.iter().map(kind_name).collect();
        assert_eq!(kinds, ["Add", "Free", "RmsNorm"]);
    }
}
