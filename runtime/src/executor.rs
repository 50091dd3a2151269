//! The executor: runs one rank's `Program` on the CPU kernels and a communicator.
//!
//! Buffers are allocated when an instruction writes them and dropped at their `Free`; the executor
//! counts the bytes it actually holds (f32 and u32 storage, 4 bytes an element, bf16 storage 2,
//! plus the staging copies collectives need while they run, in f32: the communicators carry f32
//! words), so `peak_bytes` is a measurement of this runtime, not a prediction. Each instruction's
//! start and end are read from the monotonic clock against the run's shared epoch
//! (`RunInputs::epoch`), so the ranks' timelines line up in one trace.

use std::borrow::Cow;
use std::time::Instant;

use half::bf16;
use pleat_backend::memory::{staging_of, ElementSize};
use pleat_backend::transfers::{pair_transfers, TransferPairs};
use pleat_backend::{
    AttentionDims, BufferId, BufferKind, DType, Instr, Kernel, MoeDims, Program, RouterDims, TransferStream,
};
use pleat_ir::MoeOperand;

use crate::arena::{Arena, Element};
use crate::comm::{CommStats, Communicator, Group as CommGroup};
use crate::error::{Error, Result};
use crate::kernels::{self, AttentionShape, MoeGradOperand, MoeShape};
use crate::native::{NativeKernels, NativeOperand};
use crate::stream::{CommStream, CommStreams, Transfer};
use crate::weights::WeightSource;

#[path = "executor_backward.rs"]
mod backward;

/// What every rank reads: the global token ids and positions, and the weights.
#[derive(Clone, Copy)]
pub struct RunInputs<'a> {
    /// Token ids, `[batch, seq]` row-major, global.
    pub tokens: &'a [u32],
    /// Positions, `[seq]`, global.
    pub positions: &'a [u32],
    /// Where weights come from.
    pub weights: &'a dyn WeightSource,
    /// The instant every rank's instruction timings count from (one for the whole run).
    pub epoch: Instant,
}

/// A block of a graph output that a rank returned.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputBlock {
    /// Which graph output.
    pub index: u32,
    /// Its global shape.
    pub shape: Vec<u64>,
    /// The block, per dim `(start, len)`.
    pub region: Vec<(u64, u64)>,
    /// The block's data, row-major.
    pub data: Vec<f32>,
}

/// What one rank's run produced and measured.
#[derive(Clone, Debug)]
pub struct RankOutcome {
    /// The rank.
    pub rank: u32,
    /// Its output blocks.
    pub outputs: Vec<OutputBlock>,
    /// The most bytes it held at once.
    pub peak_bytes: u64,
    /// The bytes of its resident weights.
    pub param_bytes: u64,
    /// Bytes it sent, by collective kind.
    pub comm: CommStats,
    /// After each instruction, in program order, the bytes it held in activation buffers
    /// (intermediate values; not weights, inputs, or other ranks' weights in flight).
    pub activation_bytes: Vec<u64>,
    /// The most bytes of other ranks' data it held at once (TSP broadcast blocks and ring shards,
    /// ring attention's key/value blocks).
    pub in_flight_peak_bytes: u64,
    /// For each instruction, in program order, its start and end in nanoseconds since
    /// `RunInputs::epoch`.
    pub timings: Vec<(u64, u64)>,
    /// The most token rows one of its experts received in one forward mixture-of-experts layer
    /// (0 for a dense model): the load imbalance a dropless router lets through.
    pub max_expert_rows: u64,
    /// The size of the planned arena its buffers were stored in (the entry path); 0 when each
    /// buffer had an allocation of its own.
    pub arena_bytes: u64,
    /// Whether its weight prefetches (`TransferStream::Prefetch`) ran on a communication stream of
    /// their own, beside the main one; `false`: they ran on the main stream in the order they were
    /// started (a communicator with one stream), or the program has none. Where a measured trace
    /// shows them.
    pub prefetch_stream: bool,
}

/// A buffer's elements as the rank holds them: at the buffer's declared dtype, so that the measured
/// bytes are the program's. bf16 buffers are computed on in f32 (kernels read a widened copy that
/// lives only for the kernel, as a device kernel's registers would) and rounded to nearest-even when
/// stored, like a GEMM with f32 accumulation writing a bf16 result.
/// With a planned arena (the entry path), a buffer's elements live in its slot there instead.
enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    U32(Vec<u32>),
    /// `len` elements of `element` in the machine's arena at byte `offset`.
    Placed {
        element: Element,
        offset: usize,
        len: usize,
    },
}

/// bf16 elements as f32 (exact).
fn widen(data: &[bf16]) -> Vec<f32> {
    data.iter().map(|value| value.to_f32()).collect()
}

/// A stored buffer's elements, wherever they are.
enum View<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    U32(&'a [u32]),
}

impl Storage {
    fn len(&self) -> usize {
        match self {
            Storage::F32(data) => data.len(),
            Storage::Bf16(data) => data.len(),
            Storage::U32(data) => data.len(),
            Storage::Placed { len, .. } => *len,
        }
    }
    fn bytes(&self) -> u64 {
        let element = match self {
            Storage::Bf16(_) | Storage::Placed { element: Element::Bf16, .. } => 2,
            _ => 4,
        };
        element * self.len() as u64
    }
    /// Floats as `dtype` holds them: bf16 rounds, every other float type keeps f32.
    fn floats(data: Vec<f32>, dtype: DType) -> Storage {
        match dtype {
            DType::Bf16 => Storage::Bf16(data.into_iter().map(bf16::from_f32).collect()),
            _ => Storage::F32(data),
        }
    }
}

struct Machine<'a> {
    program: &'a Program,
    buffers: Vec<Option<Storage>>,
    live_bytes: u64,
    peak_bytes: u64,
    activation_bytes: u64,
    in_flight_bytes: u64,
    in_flight_peak_bytes: u64,
    /// The busiest expert's rows in one forward mixture layer (a cell: kernels see the machine
    /// shared).
    max_expert_rows: std::cell::Cell<u64>,
    instr: usize,
    /// The planned arena the buffers are stored in (the entry path); `None`: each its own vector.
    arena: Option<Arena>,
}

impl Machine<'_> {
    /// Records that one of the rank's experts received `rows` rows in a layer.
    fn note_expert_rows(&self, rows: u64) {
        self.max_expert_rows.set(self.max_expert_rows.get().max(rows));
    }

    fn program_error(&self, reason: String) -> Error {
        Error::Program { rank: self.program.rank, instr: self.instr, reason }
    }
    /// Buffer `id`'s elements; `None` when it is not live.
    fn view(&self, id: BufferId) -> Option<View<'_>> {
        Some(match self.buffers.get(id.as_u32() as usize)?.as_ref()? {
            Storage::F32(data) => View::F32(data),
            Storage::Bf16(data) => View::Bf16(data),
            Storage::U32(data) => View::U32(data),
            &Storage::Placed { element, offset, len } => {
                let arena = self.arena.as_ref()?;
                // SAFETY: a placed buffer's slot was taken for it (`store`) and is given back only
                // when the buffer is freed, which also removes it from `buffers`.
                unsafe {
                    match element {
                        Element::F32 => View::F32(arena.slice(offset, len)),
                        Element::Bf16 => View::Bf16(arena.slice(offset, len)),
                        Element::U32 => View::U32(arena.slice(offset, len)),
                    }
                }
            }
        })
    }
    /// The error of reading buffer `id`, which is not live.
    fn not_live(&self, id: BufferId) -> Error {
        self.program_error(format!("{id} is read before it is written or after it is freed"))
    }
    fn f32(&self, id: BufferId) -> Result<Cow<'_, [f32]>> {
        match self.view(id) {
            Some(View::F32(data)) => Ok(Cow::Borrowed(data)),
            Some(View::Bf16(data)) => Ok(Cow::Owned(widen(data))),
            Some(View::U32(_)) => Err(self.program_error(format!("{id} holds integers, an f32 operand is needed"))),
            None => Err(self.not_live(id)),
        }
    }
    /// An f32 copy of a bf16 buffer; `None` for any other buffer.
    fn widened(&self, id: BufferId) -> Option<Vec<f32>> {
        match self.view(id) {
            Some(View::Bf16(data)) => Some(widen(data)),
            _ => None,
        }
    }
    fn native_operand(&self, id: BufferId) -> Result<NativeOperand<'_>> {
        match self.view(id) {
            Some(View::F32(data)) => Ok(NativeOperand::F32(data)),
            Some(View::U32(data)) => Ok(NativeOperand::U32(data)),
            _ => Err(self.not_live(id)),
        }
    }
    fn u32(&self, id: BufferId) -> Result<&[u32]> {
        match self.view(id) {
            Some(View::U32(data)) => Ok(data),
            Some(View::F32(_) | View::Bf16(_)) => {
                Err(self.program_error(format!("{id} holds floats, an integer operand is needed")))
            }
            None => Err(self.not_live(id)),
        }
    }
    /// Stores computed floats at `id`'s declared dtype.
    fn store_floats(&mut self, id: BufferId, data: Vec<f32>) -> Result<()> {
        let dtype = self.program.buffers.get(id.as_u32() as usize).map_or(DType::F32, |buffer| buffer.dtype);
        self.store(id, Storage::floats(data, dtype))
    }
    fn store(&mut self, id: BufferId, storage: Storage) -> Result<()> {
        let expected = self.program.buffers.get(id.as_u32() as usize).map(|buffer| buffer.numel());
        let got = storage.len() as u64;
        if expected != Some(got) {
            return Err(self.program_error(format!("{id} should hold {expected:?} elements, got {got}")));
        }
        let storage = self.place(id, storage)?;
        self.live_bytes += storage.bytes();
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.count_kind(id, storage.bytes() as i64);
        self.buffers[id.as_u32() as usize] = Some(storage);
        Ok(())
    }
    /// `storage` moved into buffer `id`'s slot of the arena, when there is an arena and the buffer
    /// has a slot.
    fn place(&mut self, id: BufferId, storage: Storage) -> Result<Storage> {
        let (element, len) = match &storage {
            Storage::F32(data) => (Element::F32, data.len()),
            Storage::Bf16(data) => (Element::Bf16, data.len()),
            Storage::U32(data) => (Element::U32, data.len()),
            Storage::Placed { .. } => return Ok(storage),
        };
        let Some(offset) = self.take_slot(id, element, len)? else { return Ok(storage) };
        let Some(arena) = self.arena.as_mut() else { return Ok(storage) };
        // SAFETY: `take_slot` reserved `offset..offset + len * element.bytes()` for this buffer.
        unsafe {
            match &storage {
                Storage::F32(data) => arena.slice_mut(offset, len).copy_from_slice(data),
                Storage::Bf16(data) => arena.slice_mut(offset, len).copy_from_slice(data),
                Storage::U32(data) => arena.slice_mut(offset, len).copy_from_slice(data),
                Storage::Placed { .. } => {}
            }
        }
        Ok(Storage::Placed { element, offset, len })
    }
    /// Takes buffer `id`'s slot of the arena for `len` elements of `element`, giving back
    /// the one it holds if it is stored again while live; `None` without an arena or a slot.
    fn take_slot(&mut self, id: BufferId, element: Element, len: usize) -> Result<Option<usize>> {
        let held = match self.buffers.get(id.as_u32() as usize) {
            Some(Some(Storage::Placed { offset, .. })) => Some(*offset),
            _ => None,
        };
        let Some(arena) = self.arena.as_mut() else { return Ok(None) };
        if let Some(offset) = held {
            arena.give_back(offset);
        }
        let taken = arena.take(id, element, len);
        taken.map_err(|reason| self.program_error(reason))
    }
    /// Frees buffer `id`: its storage dropped, its slot of the arena given back, its bytes no
    /// longer counted.
    fn free(&mut self, id: BufferId) {
        self.take(id);
    }
    /// Buffer `id`'s data, stored as zeroed f32 of its declared size, for generated code to write:
    /// in its slot of the arena when there is one.
    fn store_zeroed_f32(&mut self, id: BufferId) -> Result<*mut f32> {
        let numel = self.program.buffer(id).numel() as usize;
        let storage = match self.take_slot(id, Element::F32, numel)? {
            Some(offset) => Storage::Placed { element: Element::F32, offset, len: numel },
            None => Storage::F32(vec![0.0; numel]),
        };
        self.store(id, storage)?;
        match (self.buffers.get_mut(id.as_u32() as usize), self.arena.as_mut()) {
            (Some(Some(Storage::F32(data))), _) => Ok(data.as_mut_ptr()),
            // SAFETY: the slot was taken for this buffer just now.
            (Some(Some(Storage::Placed { offset, len, .. })), Some(arena)) => {
                let data = unsafe { arena.slice_mut::<f32>(*offset, *len) };
                // The slot holds whatever its last buffer left; generated code may accumulate.
                data.fill(0.0);
                Ok(data.as_mut_ptr())
            }
            _ => Err(self.program_error(format!("{id} was not stored"))),
        }
    }
    /// Takes buffer `id`'s storage out of the machine (its slot of the arena given back, its bytes
    /// no longer counted) and returns it; `None` when it is not live.
    fn take(&mut self, id: BufferId) -> Option<Storage> {
        let storage = self.buffers.get_mut(id.as_u32() as usize).and_then(Option::take)?;
        if let (Storage::Placed { offset, .. }, Some(arena)) = (&storage, self.arena.as_mut()) {
            arena.give_back(*offset);
        }
        self.live_bytes -= storage.bytes();
        self.count_kind(id, -(storage.bytes() as i64));
        Some(storage)
    }
    fn count_kind(&mut self, id: BufferId, bytes: i64) {
        match self.program.buffers.get(id.as_u32() as usize).map(|buffer| buffer.kind) {
            Some(BufferKind::Activation) => self.activation_bytes = self.activation_bytes.saturating_add_signed(bytes),
            Some(BufferKind::InFlight) => {
                self.in_flight_bytes = self.in_flight_bytes.saturating_add_signed(bytes);
                self.in_flight_peak_bytes = self.in_flight_peak_bytes.max(self.in_flight_bytes);
            }
            _ => {}
        }
    }
    /// Counts `bytes` held by a transfer in flight, from its start.
    fn reserve(&mut self, bytes: u64) {
        self.live_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
    }
    /// Releases what [`Machine::reserve`] counted, at the transfer's wait.
    fn release(&mut self, bytes: u64) {
        self.live_bytes = self.live_bytes.saturating_sub(bytes);
    }
    /// Counts a staging copy that lives only during the current instruction.
    fn transient(&mut self, bytes: u64) {
        self.peak_bytes = self.peak_bytes.max(self.live_bytes + bytes);
    }
    fn what(&self, id: BufferId) -> String {
        self.program.buffers.get(id.as_u32() as usize).map_or_else(|| id.to_string(), |buffer| buffer.name.clone())
    }
}

/// A buffer's elements at its stored type, as a device runtime moves them to and from the host
/// (`crate::cuda`): the host run holds a device program's operands only while it runs one of its
/// instructions here.
#[cfg(feature = "cuda")]
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum HostData {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
    /// Token ids and positions.
    U32(Vec<u32>),
}

/// The row-major indices, in a tensor of `shape`, of the elements of `region`, in order.
fn region_indices(shape: &[u64], region: &[(u64, u64)]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for dim in (0..shape.len().saturating_sub(1)).rev() {
        strides[dim] = strides[dim + 1] * shape[dim + 1] as usize;
    }
    let mut indices = vec![0usize];
    for (&(start, len), &stride) in region.iter().zip(&strides) {
        indices =
            indices.iter().flat_map(|&base| (start..start + len).map(move |at| base + at as usize * stride)).collect();
    }
    indices
}

/// Runs `program` on this thread with `comm`; `gemm_threads` is the GEMM parallelism.
pub fn execute(
    program: &Program,
    comm: &mut dyn Communicator,
    inputs: &RunInputs,
    gemm_threads: usize,
) -> Result<RankOutcome> {
    execute_native(program, comm, inputs, gemm_threads, None)
}

/// As [`execute`], calling `native`'s function instead of the interpreted kernel for each
/// instruction it covers; when `native`'s library has an entry function (`pleat_rank_main`), the
/// whole program runs by calling it (`crate::capi`).
pub fn execute_native(
    program: &Program,
    comm: &mut dyn Communicator,
    inputs: &RunInputs,
    gemm_threads: usize,
    native: Option<&NativeKernels>,
) -> Result<RankOutcome> {
    if let Some(library) = native.filter(|library| library.entry().is_some()) {
        return crate::capi::execute_entry(program, comm, inputs, gemm_threads, library);
    }
    if is_asynchronous(program) {
        if let Some(comm) = comm.as_sendable() {
            return execute_streamed(program, comm, inputs, gemm_threads, native);
        }
    }
    let mut run = Run::new(program, comm, inputs, gemm_threads)?;
    run.run_all(native)?;
    Ok(run.finish())
}

/// As [`execute_native`] without an entry function, the transfers running on a communication
/// thread of the rank (`crate::stream`) while this thread runs the kernels; the weight prefetches
/// on a second one when the program has some and `comm` gives a second stream.
fn execute_streamed(
    program: &Program,
    comm: &mut (dyn Communicator + Send),
    inputs: &RunInputs,
    gemm_threads: usize,
    native: Option<&NativeKernels>,
) -> Result<RankOutcome> {
    run_streamed(program, comm, inputs, gemm_threads, |mut run| {
        run.run_all(native)?;
        Ok(run.finish())
    })
}

/// Makes a run of `program` whose transfers go to the rank's communication streams, each a thread
/// running its transfers on `comm` (the prefetch stream on `comm`'s second stream, when the
/// program has prefetches and `comm` has one), and has `drive` run it on this thread: the bytecode
/// loop, or a native entry function (`crate::capi`). The outcome counts the bytes of both streams.
pub(crate) fn run_streamed<'a>(
    program: &'a Program,
    comm: &mut (dyn Communicator + Send),
    inputs: &'a RunInputs<'a>,
    gemm_threads: usize,
    drive: impl FnOnce(Run<'a>) -> Result<RankOutcome>,
) -> Result<RankOutcome> {
    comm.reset_stats();
    let prefetches = program.instructions.iter().any(|instr| instr.transfer_stream() == TransferStream::Prefetch);
    let mut second = if prefetches { comm.second_stream() } else { None };
    let (main, run_main) = CommStream::new();
    let (prefetch, run_prefetch) = CommStream::new();
    let epoch = inputs.epoch;
    let outcome = std::thread::scope(|scope| {
        let mut threads = vec![scope.spawn(|| run_main(&mut *comm, epoch))];
        let prefetch = second.as_mut().map(|second| {
            threads.push(scope.spawn(move || run_prefetch(&mut **second, epoch)));
            prefetch
        });
        let streams = CommStreams::new(main, prefetch);
        let outcome = Run::with_channel(program, Channel::Stream(streams), inputs, gemm_threads).and_then(drive);
        // The run (and with it the streams' sending sides) is gone: the threads end once the
        // transfers already started have.
        if threads.into_iter().map(|thread| thread.join()).any(|joined| joined.is_err()) {
            return Err(Error::Panicked { rank: program.rank, message: "a communication stream panicked".into() });
        }
        outcome
    });
    let mut outcome = outcome?;
    outcome.comm = comm.stats().clone();
    if let Some(second) = &second {
        outcome.comm.merge(second.stats());
        outcome.prefetch_stream = true;
    }
    Ok(outcome)
}

/// Whether `program` has transfers a `Wait` ends (and so something to run beside its kernels).
pub(crate) fn is_asynchronous(program: &Program) -> bool {
    pair_transfers(program).is_ok_and(|pairs| !pairs.is_empty())
}

/// Where a run's transfers go.
enum Channel<'a> {
    /// Run on the rank's thread, each at its start; a `Wait` finds it ended.
    Inline(&'a mut dyn Communicator),
    /// Run on the rank's communication streams, each from its start to its `Wait`.
    Stream(CommStreams),
}

/// One rank's run in progress: the buffers, the communicator and what is measured. The bytecode
/// loop ([`execute_native`]) and the runtime's C ABI (`crate::capi`) both drive it, an instruction at
/// a time, so that the two paths compute the same values.
pub(crate) struct Run<'a> {
    machine: Machine<'a>,
    channel: Channel<'a>,
    /// The program's asynchronous transfers: which wait ends which start.
    pairs: TransferPairs,
    inputs: &'a RunInputs<'a>,
    gemm_threads: usize,
    tokens_shape: Vec<u64>,
    seq: u64,
    outputs: Vec<OutputBlock>,
    param_bytes: u64,
    activation_bytes: Vec<u64>,
    timings: Vec<(u64, u64)>,
    /// The start of the instruction in progress.
    start_ns: u64,
    /// A fused native kernel's second result, stored when its instruction comes.
    precomputed: Option<(usize, Vec<f32>)>,
}

impl<'a> Run<'a> {
    /// Checks the inputs against `program` and starts a run with no buffer written.
    pub(crate) fn new(
        program: &'a Program,
        comm: &'a mut dyn Communicator,
        inputs: &'a RunInputs<'a>,
        gemm_threads: usize,
    ) -> Result<Self> {
        comm.reset_stats();
        Self::with_channel(program, Channel::Inline(comm), inputs, gemm_threads)
    }

    /// As [`Run::new`], with the transfers going to `channel`.
    fn with_channel(
        program: &'a Program,
        channel: Channel<'a>,
        inputs: &'a RunInputs<'a>,
        gemm_threads: usize,
    ) -> Result<Self> {
        let pairs = pair_transfers(program).map_err(|error| Error::Program {
            rank: program.rank,
            instr: 0,
            reason: error.to_string(),
        })?;
        let tokens_shape = program.tokens_shape.clone();
        let seq = *tokens_shape.get(1).unwrap_or(&0);
        // A program that reads no tokens (no `tokens` node: an empty shape) expects none.
        let token_count = if tokens_shape.is_empty() { 0 } else { tokens_shape.iter().product::<u64>() };
        if inputs.tokens.len() as u64 != token_count || inputs.positions.len() as u64 != seq {
            return Err(Error::Inputs {
                reason: format!(
                    "the program expects tokens {:?} and {seq} positions, got {} tokens and {} positions",
                    tokens_shape,
                    inputs.tokens.len(),
                    inputs.positions.len()
                ),
            });
        }
        Ok(Run {
            machine: Machine {
                program,
                buffers: (0..program.buffers.len()).map(|_| None).collect(),
                live_bytes: 0,
                activation_bytes: 0,
                in_flight_bytes: 0,
                in_flight_peak_bytes: 0,
                max_expert_rows: std::cell::Cell::new(0),
                peak_bytes: 0,
                instr: 0,
                arena: None,
            },
            channel,
            pairs,
            inputs,
            gemm_threads,
            tokens_shape,
            seq,
            outputs: Vec::new(),
            param_bytes: 0,
            activation_bytes: Vec::with_capacity(program.instructions.len()),
            timings: Vec::with_capacity(program.instructions.len()),
            start_ns: 0,
            precomputed: None,
        })
    }

    /// Stores the buffers in the arena the program's memory plan lays out
    /// (`pleat_backend::memory::plan`): each in its slot, so that the rank's buffers take one
    /// allocation of the planned size.
    pub(crate) fn with_planned_arena(mut self) -> Self {
        self.machine.arena = Arena::planned(self.machine.program);
        self
    }

    /// Runs every instruction in order.
    fn run_all(&mut self, native: Option<&NativeKernels>) -> Result<()> {
        let program = self.machine.program;
        for (index, instr) in program.instructions.iter().enumerate() {
            self.begin(index);
            self.step(index, instr, native)?;
            self.end();
        }
        Ok(())
    }

    /// The program run.
    pub(crate) fn program(&self) -> &'a Program {
        self.machine.program
    }

    /// Starts instruction `index`: its timing, and the index errors name.
    pub(crate) fn begin(&mut self, index: usize) {
        self.machine.instr = index;
        self.start_ns = nanos_since(self.inputs.epoch);
    }

    /// Ends the instruction begun last: records its timing and the activation bytes held after it.
    pub(crate) fn end(&mut self) {
        self.activation_bytes.push(self.machine.activation_bytes);
        self.timings.push((self.start_ns, nanos_since(self.inputs.epoch)));
    }

    /// An error at the instruction in progress.
    pub(crate) fn program_error(&self, reason: String) -> Error {
        self.machine.program_error(reason)
    }

    /// The data of written buffer `id`, for generated code: f32 elements, or u32 for token ids and
    /// positions (bf16 buffers are refused: generated code reads f32).
    pub(crate) fn operand_pointer(&self, id: BufferId) -> Result<*const std::ffi::c_void> {
        match self.machine.view(id) {
            Some(View::F32(data)) => Ok(data.as_ptr().cast()),
            Some(View::U32(data)) => Ok(data.as_ptr().cast()),
            Some(View::Bf16(_)) => {
                Err(self.program_error(format!("{id} holds bf16; generated code reads only f32 buffers")))
            }
            None => Err(self.machine.not_live(id)),
        }
    }

    /// Writes zeros of buffer `id`'s declared size and kind (u32 for integer buffers), unless it
    /// holds data already: a stand-in operand when instructions are checked, not run.
    pub(crate) fn zero_if_unwritten(&mut self, id: BufferId) -> Result<()> {
        if matches!(self.machine.buffers.get(id.as_u32() as usize), Some(Some(_))) {
            return Ok(());
        }
        let buffer = self
            .machine
            .program
            .buffers
            .get(id.as_u32() as usize)
            .ok_or_else(|| self.program_error(format!("{id} is not a buffer of the program")))?;
        let numel = buffer.numel() as usize;
        let storage = if buffer.is_integer() { Storage::U32(vec![0; numel]) } else { Storage::F32(vec![0.0; numel]) };
        self.machine.store(id, storage)
    }

    /// Allocates buffer `id` (zeroed f32 of its declared size) for generated code to write, and
    /// returns its data. The data stays put until the buffer is freed: buffers are never moved.
    pub(crate) fn result_pointer(&mut self, id: BufferId) -> Result<*mut f32> {
        let declared = self.machine.program.buffers.get(id.as_u32() as usize).map(|buffer| buffer.dtype);
        if matches!(declared, Some(DType::Bf16 | DType::I32) | None) {
            return Err(self.program_error(format!("{id} is not an f32 buffer; generated code writes only f32")));
        }
        self.machine.store_zeroed_f32(id)
    }

    /// Whether buffer `id` is live in the run.
    #[cfg(feature = "cuda")]
    pub(crate) fn holds(&self, id: BufferId) -> bool {
        matches!(self.machine.buffers.get(id.as_u32() as usize), Some(Some(_)))
    }

    /// Stores `data` as buffer `id` (its size checked against the program's).
    #[cfg(feature = "cuda")]
    pub(crate) fn stage_in(&mut self, id: BufferId, data: HostData) -> Result<()> {
        let storage = match data {
            HostData::F32(data) => Storage::F32(data),
            HostData::Bf16(data) => Storage::Bf16(data),
            HostData::U32(data) => Storage::U32(data),
        };
        self.machine.store(id, storage)
    }

    /// Takes buffer `id` out of the run (it is no longer live here) and returns its elements;
    /// `None` when it is not live.
    #[cfg(feature = "cuda")]
    pub(crate) fn stage_out(&mut self, id: BufferId) -> Option<HostData> {
        let storage = self.machine.take(id)?;
        Some(match storage {
            Storage::F32(data) => HostData::F32(data),
            Storage::Bf16(data) => HostData::Bf16(data),
            Storage::U32(data) => HostData::U32(data),
            Storage::Placed { element, offset, len } => {
                let arena = self.machine.arena.as_ref()?;
                // SAFETY: the slot was this buffer's until `take` gave it back just now, and nothing
                // has been stored since.
                unsafe {
                    match element {
                        Element::F32 => HostData::F32(arena.slice(offset, len).to_vec()),
                        Element::Bf16 => HostData::Bf16(arena.slice(offset, len).to_vec()),
                        Element::U32 => HostData::U32(arena.slice(offset, len).to_vec()),
                    }
                }
            }
        })
    }

    /// What the run produced and measured.
    pub(crate) fn finish(self) -> RankOutcome {
        RankOutcome {
            rank: self.machine.program.rank,
            outputs: self.outputs,
            peak_bytes: self.machine.peak_bytes,
            param_bytes: self.param_bytes,
            comm: match &self.channel {
                Channel::Inline(comm) => comm.stats().clone(),
                // The stream's communicator is read once its thread has ended (`execute_streamed`).
                Channel::Stream(_) => CommStats::default(),
            },
            activation_bytes: self.activation_bytes,
            in_flight_peak_bytes: self.machine.in_flight_peak_bytes,
            max_expert_rows: self.machine.max_expert_rows.get(),
            timings: self.timings,
            arena_bytes: self.machine.arena.as_ref().map_or(0, |arena| arena.bytes() as u64),
            // Set by `run_streamed`, which alone knows whether the communicator gave a second stream.
            prefetch_stream: false,
        }
    }

    /// Runs `instr`, the program's instruction `index`, calling `native`'s function instead of the
    /// interpreted kernel where it has one.
    pub(crate) fn step(&mut self, index: usize, instr: &Instr, native: Option<&NativeKernels>) -> Result<()> {
        let Run {
            machine,
            channel,
            pairs,
            inputs,
            gemm_threads,
            tokens_shape,
            seq,
            outputs,
            param_bytes,
            precomputed,
            timings,
            ..
        } = self;
        let (program, rank, gemm_threads, seq) = (machine.program, machine.program.rank, *gemm_threads, *seq);
        match instr {
            Instr::LoadParam { out, name, shape, region } => {
                let data = inputs
                    .weights
                    .read(name, shape, region)
                    .map_err(|source| Error::Weight { rank, source: Box::new(source) })?;
                *param_bytes += program.buffer(*out).bytes();
                machine.store_floats(*out, data)?;
            }
            Instr::LoadTokens { out, region } => {
                let block = gather(inputs.tokens, &region_indices(tokens_shape, region)).ok_or_else(|| {
                    machine.program_error(format!("token block {region:?} lies outside {tokens_shape:?}"))
                })?;
                machine.store(*out, Storage::U32(block))?;
            }
            Instr::LoadPositions { out, region } => {
                let block = gather(inputs.positions, &region_indices(&[seq], region))
                    .ok_or_else(|| machine.program_error(format!("position block {region:?} lies outside [{seq}]")))?;
                machine.store(*out, Storage::U32(block))?;
            }
            Instr::Kernel {
                kernel: kernel @ (Kernel::Slice { .. } | Kernel::Permute { .. }),
                inputs: operands,
                out,
            } => {
                // Layout kernels move token ids and positions as well as floats.
                let sources = source_indices(kernel);
                let input = operands
                    .first()
                    .copied()
                    .ok_or_else(|| machine.program_error("a layout kernel needs an operand".into()))?;
                let too_small = || machine.program_error(format!("{input} is smaller than the layout reads"));
                let storage = match machine.view(input) {
                    Some(View::F32(data)) => Storage::F32(gather(data, &sources).ok_or_else(too_small)?),
                    Some(View::Bf16(data)) => Storage::Bf16(gather(data, &sources).ok_or_else(too_small)?),
                    Some(View::U32(data)) => Storage::U32(gather(data, &sources).ok_or_else(too_small)?),
                    None => return Err(machine.not_live(input)),
                };
                machine.store(*out, storage)?;
            }
            Instr::Kernel { kernel, inputs: operands, out } => {
                let data =
                    match (precomputed.take_if(|(at, _)| *at == index), native.filter(|table| table.covers(index))) {
                        (Some((_, data)), _) => data,
                        (None, Some(table)) => {
                            // Native kernels take f32: bf16 operands are widened for the call.
                            let ids = table.operand_buffers(index);
                            let widened: Vec<Option<Vec<f32>>> = ids.iter().map(|&id| machine.widened(id)).collect();
                            let operands = ids
                                .iter()
                                .zip(&widened)
                                .map(|(&id, copy)| match copy {
                                    Some(data) => Ok(NativeOperand::F32(data)),
                                    None => machine.native_operand(id),
                                })
                                .collect::<Result<Vec<_>>>()?;
                            let produced = table
                                .call(index, &operands)
                                .map_err(|error| machine.program_error(error.to_string()))?;
                            *precomputed = produced.fused;
                            produced.out
                        }
                        (None, None) => run_kernel(machine, kernel, operands, *out, gemm_threads)?,
                    };
                machine.store_floats(*out, data)?;
            }
            Instr::Output { buf, index: output, shape, region } => {
                outputs.push(OutputBlock {
                    index: *output,
                    shape: shape.clone(),
                    region: region.clone(),
                    data: machine.f32(*buf)?.to_vec(),
                });
            }
            Instr::Free { buf } => {
                machine.free(*buf);
            }
            Instr::Wait { .. } => {
                // Inline, the transfer ended at its start.
                if let Channel::Stream(stream) = channel {
                    let start = *pairs
                        .start_of
                        .get(&index)
                        .ok_or_else(|| machine.program_error("the wait names no transfer in flight".into()))?;
                    let transfer = &program.instructions[start];
                    let done = finish(stream, machine, start, transfer)?;
                    machine.release(transfer_bytes(program, transfer));
                    complete(machine, transfer, done.0)?;
                    timings[start] = done.1;
                }
            }
            transfer => {
                let staging = staging_of(program, transfer, ElementSize::Fixed(4)).map_or(0, |(_, bytes)| bytes);
                let detached = detach(machine, transfer)?;
                match channel {
                    Channel::Inline(comm) => {
                        machine.transient(staging);
                        let data = detached.run(&mut **comm).map_err(|source| Error::Comm {
                            rank,
                            instr: index,
                            what: transfer_what(machine, transfer),
                            source: Box::new(source),
                        })?;
                        complete(machine, transfer, data)?;
                    }
                    Channel::Stream(stream) if pairs.wait_of.contains_key(&index) => {
                        // In flight until its wait: its results and staging count from now.
                        machine.reserve(transfer_bytes(program, transfer));
                        stream.start(index, transfer.transfer_stream(), detached);
                    }
                    Channel::Stream(stream) => {
                        machine.transient(staging);
                        stream.start(index, transfer.transfer_stream(), detached);
                        let (data, _) = finish(stream, machine, index, transfer)?;
                        complete(machine, transfer, data)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Nanoseconds from `epoch` to now (zero if `epoch` is in the future; saturating past 584 years).
pub(crate) fn nanos_since(epoch: Instant) -> u64 {
    u64::try_from(Instant::now().saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// Splits a packed message into `outs`, `sizes[i]` elements each.
/// `buffers` as f32, one after another: what a transfer of several buffers sends.
fn pack(machine: &Machine, buffers: &[BufferId]) -> Result<Vec<f32>> {
    let mut packed = Vec::new();
    for &buffer in buffers {
        packed.extend_from_slice(&machine.f32(buffer)?);
    }
    Ok(packed)
}

fn unpack(machine: &mut Machine, outs: &[BufferId], sizes: &[usize], packed: &[f32]) -> Result<()> {
    let mut offset = 0;
    for (&out, &size) in outs.iter().zip(sizes) {
        let part = &packed[offset..offset + size];
        // Integer buffers (positions) travel as their bits; see `Instr::Send`.
        let storage = if machine.program.buffer(out).is_integer() {
            Storage::U32(part.iter().map(|value| value.to_bits()).collect())
        } else {
            Storage::floats(part.to_vec(), machine.program.buffer(out).dtype)
        };
        machine.store(out, storage)?;
        offset += size;
    }
    Ok(())
}

/// How many chunks an all-reduce bucket of buffers of `sizes` elements travels in over a group of
/// `members`: one a member when there are several buffers and each splits into that many equal
/// chunks. The message is then laid out chunk by chunk (chunk p of every buffer side by side, see
/// [`chunk_major`]), so the ring's chunk p is every buffer's own chunk p and each element is added
/// over the ranks in the order it would be were its buffer all-reduced alone: a bucket's sums are
/// the unbucketed ones bit for bit. `None`: one buffer after another.
fn bucket_chunks(sizes: &[usize], members: usize) -> Option<usize> {
    (sizes.len() > 1 && members > 1 && sizes.iter().all(|&size| size % members == 0)).then_some(members)
}

/// The runs of a message of buffers of `sizes` one after another, in the order a chunk-by-chunk
/// layout of `chunks` chunks holds them: chunk 0 of every buffer in turn, then chunk 1, ...
fn chunk_runs(sizes: &[usize], chunks: usize) -> Vec<std::ops::Range<usize>> {
    let starts: Vec<usize> =
        sizes.iter().scan(0, |offset, &size| Some(std::mem::replace(offset, *offset + size))).collect();
    (0..chunks)
        .flat_map(|chunk| {
            starts.iter().zip(sizes).map(move |(&start, &size)| {
                let run = size / chunks;
                start + chunk * run..start + (chunk + 1) * run
            })
        })
        .collect()
}

/// `packed` (buffers of `sizes` one after another) laid out chunk by chunk ([`chunk_runs`]).
fn chunk_major(packed: &[f32], sizes: &[usize], chunks: usize) -> Vec<f32> {
    chunk_runs(sizes, chunks).into_iter().flat_map(|run| packed[run].iter().copied()).collect()
}

/// The inverse of [`chunk_major`]: buffers of `sizes` one after another.
fn member_major(laid: &[f32], sizes: &[usize], chunks: usize) -> Vec<f32> {
    let mut packed = vec![0.0; laid.len()];
    let mut at = 0;
    for run in chunk_runs(sizes, chunks) {
        let len = run.len();
        packed[run].copy_from_slice(&laid[at..at + len]);
        at += len;
    }
    packed
}

/// The bytes a transfer in flight holds from its start to its wait, as the memory planner counts
/// them: its results and its staging copy.
fn transfer_bytes(program: &Program, transfer: &Instr) -> u64 {
    // Results as `Storage` holds them (bf16 in 2 bytes); staging in f32, as the communicators carry.
    let stored = |out: BufferId| {
        let buffer = program.buffer(out);
        buffer.numel() * if buffer.dtype == DType::Bf16 { 2 } else { 4 }
    };
    let results: u64 = transfer.outs().into_iter().map(stored).sum();
    results + staging_of(program, transfer, ElementSize::Fixed(4)).map_or(0, |(_, bytes)| bytes)
}

/// What errors name a transfer by: the first buffer of its handle.
fn transfer_what(machine: &Machine, transfer: &Instr) -> String {
    match transfer.transfer_handle().and_then(|handle| handle.first().copied()) {
        Some(buffer) => machine.what(buffer),
        None => "a transfer".to_string(),
    }
}

/// Copies what `transfer` sends out of the rank's buffers.
fn detach(machine: &Machine, transfer: &Instr) -> Result<Transfer> {
    let program = machine.program;
    let group = |group: &pleat_backend::Group| CommGroup { ranks: group.ranks.clone() };
    Ok(match transfer {
        Instr::AllReduce { inputs, group: members, .. } => {
            let sizes: Vec<usize> = inputs.iter().map(|&input| program.buffer(input).numel() as usize).collect();
            let packed = pack(machine, inputs)?;
            let data = match bucket_chunks(&sizes, members.ranks.len()) {
                Some(chunks) => chunk_major(&packed, &sizes, chunks),
                None => packed,
            };
            Transfer::AllReduce { group: group(members), data }
        }
        Instr::ReduceScatter { inputs, outs, group: members, dims } => {
            // Each member's blocks; a bucket sends each rank its blocks of every member, packed.
            let parts = members.ranks.len();
            let mut split = Vec::with_capacity(inputs.len());
            for (&input, &dim) in inputs.iter().zip(dims) {
                let shape = local_shape(program, input);
                split.push(kernels::split_dim_chunks(&machine.f32(input)?, &shape, dim, parts));
            }
            let mut chunks = Vec::with_capacity(split.iter().map(Vec::len).sum());
            for part in 0..parts {
                for member in &split {
                    let run = member.len() / parts;
                    chunks.extend_from_slice(&member[part * run..(part + 1) * run]);
                }
            }
            let output_len = outs.iter().map(|&out| program.buffer(out).numel() as usize).sum();
            Transfer::ReduceScatter { group: group(members), chunks, output_len }
        }
        Instr::AllGather { input, group: members, .. } => {
            Transfer::AllGather { group: group(members), input: machine.f32(*input)?.to_vec() }
        }
        Instr::AllToAll { input, group: members, split_dim, .. } => {
            let shape = local_shape(program, *input);
            let chunks = kernels::split_dim_chunks(&machine.f32(*input)?, &shape, *split_dim, members.ranks.len());
            Transfer::AllToAll { group: group(members), chunks }
        }
        Instr::Broadcast { inputs: sources, outs, group: members, root, .. } => {
            let packed = if members.ranks.get(*root) == Some(&program.rank) {
                pack(machine, sources)?
            } else {
                vec![0.0; outs.iter().map(|&out| program.buffer(out).numel() as usize).sum()]
            };
            Transfer::Broadcast { group: group(members), root: *root, packed }
        }
        Instr::Send { bufs, peer } => {
            let mut packed = Vec::new();
            for &buf in bufs {
                match machine.view(buf) {
                    Some(View::F32(data)) => packed.extend_from_slice(data),
                    // The threads and MPI communicators carry f32 words; a bf16 value is exact in one.
                    Some(View::Bf16(data)) => packed.extend(data.iter().map(|value| value.to_f32())),
                    // Positions travel with ring attention's key blocks, bit for bit.
                    Some(View::U32(data)) => packed.extend(data.iter().map(|&value| f32::from_bits(value))),
                    None => return Err(machine.not_live(buf)),
                }
            }
            Transfer::Send { peer: *peer, packed }
        }
        Instr::Recv { outs, peer } => {
            Transfer::Recv { peer: *peer, len: outs.iter().map(|&out| program.buffer(out).numel() as usize).sum() }
        }
        Instr::Relay { outs, from, to } => Transfer::Relay {
            from: *from,
            to: *to,
            len: outs.iter().map(|&out| program.buffer(out).numel() as usize).sum(),
        },
        Instr::ExpertDispatch { inputs, wrts, group: members, dims, .. } => Transfer::ExpertDispatch {
            group: group(members),
            shape: moe_shape(dims),
            operands: inputs
                .iter()
                .map(|&input| machine.f32(input).map(|data| data.to_vec()))
                .collect::<Result<_>>()?,
            wrts: wrts.iter().map(|&wrt| moe_grad_operand(wrt)).collect(),
        },
        other => return Err(machine.program_error(format!("{other:?} is not a transfer"))),
    })
}

/// Stores what `transfer` delivered, `data`, into its results.
fn complete(machine: &mut Machine, transfer: &Instr, data: Vec<f32>) -> Result<()> {
    let program = machine.program;
    match transfer {
        Instr::AllGather { out, group, dim, .. } => {
            let joined = kernels::join_dim_chunks(&data, &local_shape(program, *out), *dim, group.ranks.len());
            machine.store_floats(*out, joined)
        }
        Instr::AllToAll { out, group, gather_dim, .. } => {
            let joined = kernels::join_dim_chunks(&data, &local_shape(program, *out), *gather_dim, group.ranks.len());
            machine.store_floats(*out, joined)
        }
        // A forward dispatch's experts' loads follow its output.
        Instr::ExpertDispatch { outs, wrts, .. } if wrts.is_empty() => {
            let size = program.buffer(outs[0]).numel() as usize;
            let loads = data.get(size..).unwrap_or_default();
            machine.note_expert_rows(loads.iter().fold(0.0f32, |max, &rows| max.max(rows)) as u64);
            unpack(machine, outs, &[size], &data[..size.min(data.len())])
        }
        Instr::AllReduce { outs, group, .. } => {
            let sizes: Vec<usize> = outs.iter().map(|&out| program.buffer(out).numel() as usize).collect();
            match bucket_chunks(&sizes, group.ranks.len()) {
                Some(chunks) => unpack(machine, outs, &sizes, &member_major(&data, &sizes, chunks)),
                None => unpack(machine, outs, &sizes, &data),
            }
        }
        Instr::Broadcast { outs, .. }
        | Instr::Recv { outs, .. }
        | Instr::Relay { outs, .. }
        | Instr::ExpertDispatch { outs, .. }
        | Instr::ReduceScatter { outs, .. } => {
            let sizes: Vec<usize> = outs.iter().map(|&out| program.buffer(out).numel() as usize).collect();
            unpack(machine, outs, &sizes, &data)
        }
        _ => Ok(()),
    }
}

/// Waits on `stream` for the transfer of instruction `start`; returns its data and its span.
fn finish(
    stream: &mut CommStreams,
    machine: &Machine,
    start: usize,
    transfer: &Instr,
) -> Result<(Vec<f32>, (u64, u64))> {
    let rank = machine.program.rank;
    let done = stream.finish(start).ok_or_else(|| Error::Panicked {
        rank,
        message: "the communication stream stopped, or never ran this transfer".into(),
    })?;
    let data = done.result.map_err(|source| Error::Comm {
        rank,
        instr: start,
        what: transfer_what(machine, transfer),
        source: Box::new(source),
    })?;
    Ok((data, done.span_ns))
}

/// For each element of a layout kernel's output, the index of the input element it copies.
fn source_indices(kernel: &Kernel) -> Vec<usize> {
    let to_usize = |values: &[u64]| values.iter().map(|&value| value as usize).collect::<Vec<_>>();
    match kernel {
        Kernel::Slice { shape, region } => region_indices(shape, region),
        Kernel::Permute { shape, dim, order } => {
            let shape = to_usize(shape);
            let outer: usize = shape[..*dim].iter().product();
            let inner: usize = shape[dim + 1..].iter().product();
            let len = shape[*dim];
            (0..outer)
                .flat_map(|block| {
                    order
                        .iter()
                        .flat_map(move |&source| (0..inner).map(move |at| (block * len + source as usize) * inner + at))
                })
                .collect()
        }
        _ => Vec::new(),
    }
}

/// Rounds `values` as a buffer of `dtype` stores them (a bf16 one to nearest even; others keep
/// f32), so that a fused kernel's intermediate is the value the instruction it replaces stored.
pub(super) fn round_as_stored(dtype: DType, values: &mut [f32]) {
    if dtype == DType::Bf16 {
        values.iter_mut().for_each(|value| *value = bf16::from_f32(*value).to_f32());
    }
}

fn local_shape(program: &Program, id: BufferId) -> Vec<usize> {
    program.buffer(id).shape.iter().map(|&size| size as usize).collect()
}

fn run_kernel(
    machine: &Machine,
    kernel: &Kernel,
    operands: &[BufferId],
    out: BufferId,
    gemm_threads: usize,
) -> Result<Vec<f32>> {
    let numel = machine.program.buffer(out).numel() as usize;
    let mut result = vec![0.0f32; numel];
    // A sum takes as many operands as it sums.
    let operand_count = if matches!(kernel, Kernel::Sum) { operands.len().max(3) } else { kernel_arity(kernel) };
    if operands.len() != operand_count {
        return Err(machine.program_error(format!("the kernel takes {operand_count} operands, got {}", operands.len())));
    }
    let f32_operand = |index: usize| machine.f32(operands[index]);
    let u32_operand = |index: usize| machine.u32(operands[index]);
    let kernel_error = |source: kernels::KernelError| Error::Kernel {
        rank: machine.program.rank,
        instr: machine.instr,
        what: machine.what(out),
        source: Box::new(source),
    };
    match kernel {
        Kernel::Embedding { hidden, vocab_offset, vocab_total } => kernels::embedding(
            &f32_operand(0)?,
            *hidden as usize,
            *vocab_offset as usize,
            *vocab_total as usize,
            u32_operand(1)?,
            &mut result,
        )
        .map_err(kernel_error)?,
        Kernel::RmsNorm { hidden, eps } => {
            kernels::rms_norm(&f32_operand(0)?, &f32_operand(1)?, &mut result, *hidden as usize, *eps as f32)
        }
        Kernel::MatMul { m, n, k } => kernels::matmul_nt(
            *m as usize,
            *n as usize,
            *k as usize,
            &f32_operand(0)?,
            &f32_operand(1)?,
            &mut result,
            false,
            gemm_threads,
        ),
        Kernel::Rope { batch, seq, heads, head_dim, inv_freq } => {
            result.copy_from_slice(&f32_operand(0)?);
            kernels::rope_in_place(
                &mut result,
                *batch as usize,
                *seq as usize,
                *heads as usize,
                *head_dim as usize,
                u32_operand(1)?,
                inv_freq,
            );
        }
        Kernel::Attention { dims, with_lse } => {
            let shape = attention_shape(dims);
            let (q, k, v, q_pos, k_pos) =
                (&f32_operand(0)?, &f32_operand(1)?, &f32_operand(2)?, u32_operand(3)?, u32_operand(4)?);
            if *with_lse {
                // The state ring attention merges: each row's output followed by its log-sum-exp.
                let head_dim = shape.head_dim;
                let mut out = vec![0.0f32; q.len()];
                let mut lse = vec![0.0f32; shape.batch * shape.sq * shape.hq];
                kernels::attention_with_lse(&shape, q, k, v, q_pos, k_pos, &mut out, &mut lse).map_err(kernel_error)?;
                pack_rows(&out, &lse, head_dim, &mut result);
            } else {
                kernels::attention(&shape, q, k, v, q_pos, k_pos, &mut result).map_err(kernel_error)?;
            }
        }
        Kernel::MergeAttention { rows, head_dim } => {
            let (rows, head_dim) = (*rows as usize, *head_dim as usize);
            let (a, b) = (&f32_operand(0)?, &f32_operand(1)?);
            if a.len() != rows * (head_dim + 1) || b.len() != a.len() {
                return Err(machine.program_error(format!(
                    "merge_attention states of {} and {} elements are not {rows} rows of {}",
                    a.len(),
                    b.len(),
                    head_dim + 1
                )));
            }
            let (out_a, lse_a) = unpack_rows(a, head_dim);
            let (out_b, lse_b) = unpack_rows(b, head_dim);
            let (mut out, mut lse) = (vec![0.0f32; rows * head_dim], vec![0.0f32; rows]);
            kernels::merge_attention(head_dim, (&out_a, &lse_a), (&out_b, &lse_b), &mut out, &mut lse)
                .map_err(kernel_error)?;
            pack_rows(&out, &lse, head_dim, &mut result);
        }
        Kernel::SiluMul => kernels::silu_mul(&f32_operand(0)?, &f32_operand(1)?, &mut result),
        Kernel::ExpertCounts { dims, scale, top_k } => {
            let shape = MoeShape { top_k: *top_k as usize, ..router_shape(dims) };
            kernels::expert_counts(&shape, &f32_operand(0)?, &f32_operand(1)?, *scale, &mut result);
        }
        Kernel::RouterProbSum { dims } => {
            kernels::router_prob_sum(&router_shape(dims), &f32_operand(0)?, &f32_operand(1)?, &mut result)
        }
        Kernel::RouterProbSumGrad { wrt, dims } => kernels::router_prob_sum_grad(
            &router_shape(dims),
            &f32_operand(0)?,
            &f32_operand(1)?,
            &f32_operand(2)?,
            moe_grad_operand(*wrt),
            &mut result,
        ),
        Kernel::LoadBalancingLoss { .. } => {
            let (counts, probabilities) = (&f32_operand(0)?, &f32_operand(1)?);
            result[0] =
                counts.iter().zip(probabilities.iter()).map(|(c, p)| f64::from(*c) * f64::from(*p)).sum::<f64>() as f32;
        }
        Kernel::SigmoidScale { hidden } => {
            kernels::sigmoid_scale(&f32_operand(0)?, &f32_operand(1)?, *hidden as usize, &mut result)
        }
        Kernel::SigmoidScaleGradGate { hidden } => kernels::sigmoid_scale_grad_gate(
            &f32_operand(0)?,
            &f32_operand(1)?,
            &f32_operand(2)?,
            *hidden as usize,
            &mut result,
        ),
        Kernel::MoeMlp { dims } => {
            let operands = [&f32_operand(0)?, &f32_operand(1)?, &f32_operand(2)?, &f32_operand(3)?, &f32_operand(4)?];
            let loads = kernels::moe_mlp(&moe_shape(dims), operands.map(|operand| operand.as_ref()), &mut result);
            machine.note_expert_rows(loads.into_iter().max().unwrap_or(0) as u64);
        }
        Kernel::Sum => {
            // Left to right, as the chain of adds it replaces, each partial sum rounded as that
            // add stored it: bit for bit the same.
            let dtype = machine.program.buffer(out).dtype;
            kernels::add(&f32_operand(0)?, &f32_operand(1)?, &mut result);
            for index in 2..operands.len() {
                round_as_stored(dtype, &mut result);
                kernels::add_in_place(&mut result, &f32_operand(index)?);
            }
        }
        Kernel::Add => {
            let (a, b) = (&f32_operand(0)?, &f32_operand(1)?);
            if a.len() == b.len() {
                kernels::add(a, b, &mut result);
            } else {
                // A bias repeats over the leading dims.
                result.copy_from_slice(a);
                for row in result.chunks_mut(b.len()) {
                    kernels::add_in_place(row, b);
                }
            }
        }
        Kernel::CrossEntropy { .. }
        | Kernel::CrossEntropyGrad { .. }
        | Kernel::LossRowStats { .. }
        | Kernel::CrossEntropyFromStats { .. }
        | Kernel::CrossEntropyGradFromStats { .. }
        | Kernel::MatMulGradInput { .. }
        | Kernel::MatMulGradWeight { .. }
        | Kernel::RmsNormGradInput { .. }
        | Kernel::RmsNormGradInputAdd { .. }
        | Kernel::RmsNormGradWeight { .. }
        | Kernel::RopeGrad { .. }
        | Kernel::AttentionGrad { .. }
        | Kernel::SiluMulGradGate
        | Kernel::MoeMlpGrad { .. }
        | Kernel::EmbeddingGrad { .. }
        | Kernel::SumLeading { .. } => {
            backward::run_backward_kernel(machine, kernel, operands, out, &mut result, gemm_threads)?
        }
        // The result starts zeroed.
        Kernel::Zeros => {}
        Kernel::Slice { .. } | Kernel::Permute { .. } => {
            return Err(machine.program_error("layout kernels run through `source_indices`".into()));
        }
    }
    Ok(result)
}

/// A mixture-of-experts kernel's local sizes as the runtime's kernels take them.
pub(crate) fn moe_shape(dims: &MoeDims) -> MoeShape {
    let to_usize = |size: u64| size as usize;
    MoeShape {
        rows: to_usize(dims.rows),
        hidden: to_usize(dims.hidden),
        experts: to_usize(dims.experts),
        local_experts: to_usize(dims.local_experts),
        expert_offset: to_usize(dims.expert_offset),
        ffn: to_usize(dims.ffn),
        top_k: to_usize(dims.top_k),
        normalize: dims.normalize,
    }
}

/// A router statistic's sizes as the mixture kernels' shape (all experts local, no routing choice).
fn router_shape(dims: &RouterDims) -> MoeShape {
    MoeShape {
        rows: dims.rows as usize,
        hidden: dims.hidden as usize,
        experts: dims.experts as usize,
        local_experts: dims.experts as usize,
        expert_offset: 0,
        ffn: 0,
        top_k: 0,
        normalize: false,
    }
}

/// The runtime kernels' name for a mixture operand.
pub(crate) fn moe_grad_operand(wrt: MoeOperand) -> MoeGradOperand {
    match wrt {
        MoeOperand::Input => MoeGradOperand::Input,
        MoeOperand::Router => MoeGradOperand::Router,
        MoeOperand::Gate => MoeGradOperand::Gate,
        MoeOperand::Up => MoeGradOperand::Up,
        MoeOperand::Down => MoeGradOperand::Down,
    }
}

/// An attention kernel's local sizes as the runtime's kernels take them.
pub(crate) fn attention_shape(dims: &AttentionDims) -> AttentionShape {
    let to_usize = |size: u64| size as usize;
    AttentionShape {
        batch: to_usize(dims.batch),
        sq: to_usize(dims.sq),
        sk: to_usize(dims.sk),
        hq: to_usize(dims.hq),
        hkv: to_usize(dims.hkv),
        head_dim: to_usize(dims.head_dim),
        q_head_offset: to_usize(dims.q_head_offset),
        kv_head_offset: to_usize(dims.kv_head_offset),
        group: to_usize(dims.group),
        causal: dims.causal,
        scale: dims.scale,
    }
}

/// Interleaves rows of `head_dim` outputs with their log-sum-exp: `[rows, head_dim + 1]`.
fn pack_rows(out: &[f32], lse: &[f32], head_dim: usize, packed: &mut [f32]) {
    for ((row, &row_lse), packed_row) in out.chunks_exact(head_dim).zip(lse).zip(packed.chunks_exact_mut(head_dim + 1))
    {
        packed_row[..head_dim].copy_from_slice(row);
        packed_row[head_dim] = row_lse;
    }
}

/// `pack_rows` undone.
fn unpack_rows(packed: &[f32], head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let rows = packed.len() / (head_dim + 1);
    let (mut out, mut lse) = (Vec::with_capacity(rows * head_dim), Vec::with_capacity(rows));
    for row in packed.chunks_exact(head_dim + 1) {
        out.extend_from_slice(&row[..head_dim]);
        lse.push(row[head_dim]);
    }
    (out, lse)
}

fn kernel_arity(kernel: &Kernel) -> usize {
    match kernel {
        Kernel::Zeros => 0,
        Kernel::Slice { .. } | Kernel::Permute { .. } | Kernel::SumLeading { .. } => 1,
        Kernel::RmsNormGradInput { .. }
        | Kernel::SiluMulGradGate
        | Kernel::SigmoidScaleGradGate { .. }
        | Kernel::RouterProbSumGrad { .. }
        | Kernel::CrossEntropyGradFromStats { .. } => 3,
        Kernel::RmsNormGradInputAdd { .. } => 4,
        Kernel::Attention { .. } | Kernel::MoeMlp { .. } => 5,
        Kernel::AttentionGrad { .. } | Kernel::MoeMlpGrad { .. } => 6,
        _ => 2,
    }
}

/// `data[sources[i]]` for each i, or `None` when an index is out of range.
fn gather<T: Copy>(data: &[T], sources: &[usize]) -> Option<Vec<T>> {
    sources.iter().map(|&source| data.get(source).copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_travels_chunk_by_chunk_and_comes_back_member_by_member() {
        let packed: Vec<f32> = (0..12).map(|value| value as f32).collect();
        // Buffers of 4 and 8 over 2 members: each buffer's first half, then each one's second half.
        let laid = chunk_major(&packed, &[4, 8], 2);
        assert_eq!(laid, [0.0, 1.0, 4.0, 5.0, 6.0, 7.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0]);
        assert_eq!(member_major(&laid, &[4, 8], 2), packed);
        // The ring's chunk 1 of the message (elements 6..12) is chunk 1 of each buffer.
        assert_eq!(crate::comm::ring::chunk_range(12, 2, 1), 6..12);
    }

    #[test]
    fn only_buckets_of_buffers_that_split_evenly_travel_chunk_by_chunk() {
        assert_eq!(bucket_chunks(&[4, 8], 2), Some(2));
        assert_eq!(bucket_chunks(&[4, 6], 4), None, "6 does not split into 4 chunks");
        assert_eq!(bucket_chunks(&[8], 4), None, "one buffer is its own layout");
        assert_eq!(bucket_chunks(&[4, 8], 1), None, "a group of one sends nothing");
    }
}
