//! The memory planner: liveness over a compiled `Program`, its exact peak, and an arena layout.
//!
//! A buffer is live from the instruction that writes it to its `Free` (parameters and outputs to
//! the end), exactly as the executor holds it. [`plan`] walks the instructions once and returns:
//! - the peak of the live bytes, and the peak including the **staging copies** collectives make
//!   while they run (an asynchronous transfer's from its start to its `Wait`), named by kind: an all-gather stages its whole output before it joins the
//!   blocks, a reduce-scatter stages its whole input split into chunks (the executor counts both;
//!   a real NCCL collective runs in place and has neither, so they are kept apart);
//! - an offset for every buffer in one arena, first fit (the lowest hole that holds it, holes
//!   merged on free), each buffer aligned to [`ALIGNMENT`] bytes, and the arena's size, which
//!   fragmentation can make larger than the live peak.
//!
//! Bytes an element are either the declared dtype's ([`ElementSize::Declared`], what a device
//! runtime stores) or a fixed size ([`ElementSize::Fixed`]; the CPU runtime stores every element in
//! 4 bytes, f32 or u32). Guarantees: with `Fixed(4)` the peak equals the executor's measured
//! `peak_bytes` for the same program (tested on every layout of `tiny` that compiles), and no two
//! buffers live at once overlap in the arena.

use std::collections::HashMap;

use crate::program::{BufferId, Instr, Program};
use pleat_ir::entity::EntityRef;

/// Offsets are multiples of this many bytes (a cache line; also cudaMalloc's minimum is larger).
pub const ALIGNMENT: u64 = 64;

/// How many bytes an element takes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ElementSize {
    /// The buffer's declared dtype (bf16: 2, f32 and i32: 4).
    Declared,
    /// The same size for every element (4 for the CPU runtime).
    Fixed(u64),
}

/// A collective's staging copy, live only during its instruction.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Staging {
    /// An all-gather's gathered blocks before they are joined: the output's size.
    AllGather,
    /// A reduce-scatter's inputs split into chunks: the inputs' size.
    ReduceScatter,
    /// An all-to-all's outgoing chunks and incoming chunks: twice the input's size.
    AllToAll,
    /// A packed broadcast message (TSP's owner blocks): the outputs' total size.
    Broadcast,
    /// A packed point-to-point message being received (the TSP ring): the outputs' total size.
    Message,
    /// A bucket of gradients all-reduced as one message: the operands' total size.
    Bucket,
}

impl Staging {
    /// The name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Staging::AllGather => "all_gather staging",
            Staging::ReduceScatter => "reduce_scatter staging",
            Staging::AllToAll => "all_to_all staging",
            Staging::Broadcast => "broadcast staging",
            Staging::Message => "received message",
            Staging::Bucket => "all_reduce bucket",
        }
    }
}

/// The planner's result for one program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The most bytes live at once, staging included.
    pub peak_bytes: u64,
    /// The instruction at which `peak_bytes` is reached.
    pub peak_instr: usize,
    /// The staging copy live at the peak, if the peak is inside a collective: its kind and bytes.
    pub peak_staging: Option<(Staging, u64)>,
    /// The most bytes of buffers live at once (no staging).
    pub peak_live_bytes: u64,
    /// Bytes of parameters (resident throughout).
    pub param_bytes: u64,
    /// Each buffer's offset in the arena, by `BufferId`; `None` for buffers never written.
    pub offsets: Vec<Option<u64>>,
    /// The arena's size: the end of the highest buffer ever placed.
    pub arena_bytes: u64,
}

/// The bytes of `buffer` with elements of `sizing`.
pub(crate) fn element_bytes(program: &Program, buffer: BufferId, sizing: ElementSize) -> u64 {
    let buffer = program.buffer(buffer);
    match sizing {
        ElementSize::Declared => buffer.bytes(),
        ElementSize::Fixed(size) => buffer.numel() * size,
    }
}

/// The staging copy an instruction makes while it runs (while it is in flight, for an
/// asynchronous transfer).
pub fn staging_of(program: &Program, instr: &Instr, sizing: ElementSize) -> Option<(Staging, u64)> {
    match instr {
        Instr::AllGather { out, .. } => Some((Staging::AllGather, element_bytes(program, *out, sizing))),
        Instr::ReduceScatter { inputs, .. } => {
            Some((Staging::ReduceScatter, inputs.iter().map(|&input| element_bytes(program, input, sizing)).sum()))
        }
        // A single all-reduce works in place; a bucket packs its operands into one message.
        Instr::AllReduce { inputs, .. } if inputs.len() > 1 => {
            Some((Staging::Bucket, inputs.iter().map(|&input| element_bytes(program, input, sizing)).sum()))
        }
        Instr::AllToAll { input, .. } => Some((Staging::AllToAll, 2 * element_bytes(program, *input, sizing))),
        Instr::Broadcast { outs, .. } => {
            Some((Staging::Broadcast, outs.iter().map(|&out| element_bytes(program, out, sizing)).sum()))
        }
        Instr::Recv { outs, .. } | Instr::Relay { outs, .. } => {
            Some((Staging::Message, outs.iter().map(|&out| element_bytes(program, out, sizing)).sum()))
        }
        // The operands' copy the dispatch works from; its messages' sizes depend on the routing.
        Instr::ExpertDispatch { inputs, .. } => {
            Some((Staging::Message, inputs.iter().map(|&input| element_bytes(program, input, sizing)).sum()))
        }
        _ => None,
    }
}

/// First-fit placement in one arena.
struct Arena {
    /// Free holes `(offset, size)`, sorted by offset, merged.
    holes: Vec<(u64, u64)>,
    end: u64,
}

impl Arena {
    fn place(&mut self, size: u64) -> u64 {
        let size = size.div_ceil(ALIGNMENT).max(1) * ALIGNMENT;
        if let Some(index) = self.holes.iter().position(|&(_, hole)| hole >= size) {
            let (offset, hole) = self.holes[index];
            if hole == size {
                self.holes.remove(index);
            } else {
                self.holes[index] = (offset + size, hole - size);
            }
            return offset;
        }
        // Grow the arena, absorbing a hole that ends at the top.
        let offset = match self.holes.last() {
            Some(&(offset, hole)) if offset + hole == self.end => {
                self.holes.pop();
                offset
            }
            _ => self.end,
        };
        self.end = offset + size;
        offset
    }

    fn release(&mut self, offset: u64, size: u64) {
        let size = size.div_ceil(ALIGNMENT).max(1) * ALIGNMENT;
        let index = self.holes.partition_point(|&(start, _)| start < offset);
        self.holes.insert(index, (offset, size));
        // Merge with the next hole, then with the previous.
        if index + 1 < self.holes.len() && self.holes[index].0 + self.holes[index].1 == self.holes[index + 1].0 {
            self.holes[index].1 += self.holes[index + 1].1;
            self.holes.remove(index + 1);
        }
        if index > 0 && self.holes[index - 1].0 + self.holes[index - 1].1 == self.holes[index].0 {
            self.holes[index - 1].1 += self.holes[index].1;
            self.holes.remove(index);
        }
    }
}

/// Plans `program`'s memory with elements of `sizing`.
pub fn plan(program: &Program, sizing: ElementSize) -> MemoryPlan {
    let mut live = vec![false; program.buffers.len()];
    let mut offsets = vec![None; program.buffers.len()];
    let mut arena = Arena { holes: Vec::new(), end: 0 };
    let mut live_bytes = 0u64;
    let mut result = MemoryPlan {
        peak_bytes: 0,
        peak_instr: 0,
        peak_staging: None,
        peak_live_bytes: 0,
        param_bytes: 0,
        offsets: Vec::new(),
        arena_bytes: 0,
    };
    // An asynchronous transfer's staging copy lives from its start to its wait, beside the
    // instructions between; a blocking one's only during its instruction.
    let pairs = crate::transfers::pair_transfers(program).unwrap_or_default();
    let mut in_flight_staging = 0u64;
    let mut staging_until_wait: HashMap<usize, u64> = HashMap::new();
    for (index, instr) in program.instructions.iter().enumerate() {
        if let Some(staging) = staging_of(program, instr, sizing) {
            if let Some(&wait) = pairs.wait_of.get(&index) {
                in_flight_staging += staging.1;
                staging_until_wait.insert(wait, staging.1);
            } else if live_bytes + in_flight_staging + staging.1 > result.peak_bytes {
                // The executor stages while the operand is live and before the result exists.
                result.peak_bytes = live_bytes + in_flight_staging + staging.1;
                result.peak_instr = index;
                result.peak_staging = Some(staging);
            }
        }
        match instr {
            Instr::Free { buf } => {
                let slot = buf.as_u32() as usize;
                if live.get(slot).copied().unwrap_or(false) {
                    live[slot] = false;
                    let bytes = element_bytes(program, *buf, sizing);
                    live_bytes -= bytes;
                    if let Some(offset) = offsets[slot] {
                        arena.release(offset, bytes);
                    }
                }
            }
            Instr::Wait { .. } => in_flight_staging -= staging_until_wait.remove(&index).unwrap_or(0),
            _ => {
                for out in instr.outs() {
                    let slot = out.as_u32() as usize;
                    if slot >= live.len() || live[slot] {
                        continue;
                    }
                    let bytes = element_bytes(program, out, sizing);
                    live[slot] = true;
                    live_bytes += bytes;
                    offsets[slot] = Some(arena.place(bytes));
                    if matches!(instr, Instr::LoadParam { .. }) {
                        result.param_bytes += bytes;
                    }
                    result.peak_live_bytes = result.peak_live_bytes.max(live_bytes);
                    if live_bytes + in_flight_staging > result.peak_bytes {
                        result.peak_bytes = live_bytes + in_flight_staging;
                        result.peak_instr = index;
                        result.peak_staging = None;
                    }
                }
            }
        }
    }
    result.offsets = offsets;
    result.arena_bytes = arena.end;
    result
}

/// The buffers live when instruction `at` of `program` starts (every write before it counted,
/// every `Free` before it applied), in buffer order; `at == instructions.len()` gives those live at
/// the end. With [`MemoryPlan::peak_instr`] this names what the peak holds: a peak inside a
/// collective (`peak_staging` set) is `live_before(peak_instr)` plus the staging copy, any other
/// peak is `live_before(peak_instr + 1)` (the peak instruction's outputs stored, nothing freed yet,
/// since frees are instructions of their own).
pub fn live_before(program: &Program, at: usize) -> Vec<BufferId> {
    let mut live = vec![false; program.buffers.len()];
    for instr in program.instructions.iter().take(at) {
        match instr {
            Instr::Free { buf } => {
                if let Some(slot) = live.get_mut(buf.as_u32() as usize) {
                    *slot = false;
                }
            }
            _ => {
                for out in instr.outs() {
                    if let Some(slot) = live.get_mut(out.as_u32() as usize) {
                        *slot = true;
                    }
                }
            }
        }
    }
    live.iter().enumerate().filter(|(_, &is_live)| is_live).map(|(slot, _)| BufferId::new(slot)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Buffer, BufferKind, Group, Kernel, TransferStream, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn buffer(name: &str, dtype: DType, shape: &[u64], kind: BufferKind) -> Buffer {
        Buffer { name: name.into(), dtype, shape: shape.to_vec(), kind }
    }

    /// w (param, 16 bf16), x (tokens, 8 i32), y = x·w (32 bf16), z = all_gather(y) (64 bf16), free y,
    /// output z.
    fn small_program() -> Program {
        let b = BufferId::new;
        let group = Group { axis: "tp".into(), ranks: vec![0, 1] };
        Program {
            format_version: FORMAT_VERSION,
            model: "t".into(),
            mesh: "tp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![1, 8],
            buffers: vec![
                buffer("w", DType::Bf16, &[4, 4], BufferKind::Param),
                buffer("x", DType::I32, &[1, 8], BufferKind::Input),
                buffer("y", DType::Bf16, &[8, 4], BufferKind::Activation),
                buffer("z", DType::Bf16, &[8, 8], BufferKind::Activation),
            ],
            instructions: vec![
                Instr::LoadParam { out: b(0), name: "w".into(), shape: vec![4, 8], region: vec![(0, 4), (0, 4)] },
                Instr::LoadTokens { out: b(1), region: vec![(0, 1), (0, 8)] },
                Instr::Kernel { kernel: Kernel::MatMul { m: 8, n: 4, k: 4 }, inputs: vec![b(1), b(0)], out: b(2) },
                Instr::Free { buf: b(1) },
                Instr::AllGather { input: b(2), out: b(3), group, dim: 1, stream: TransferStream::Main },
                Instr::Free { buf: b(2) },
                Instr::Output { buf: b(3), index: 0, shape: vec![8, 8], region: vec![(0, 8), (0, 8)] },
            ],
        }
    }

    #[test]
    fn peaks_by_hand() {
        let program = small_program();
        // Declared: w 32 + x 32 + y 64 = 128; free x: 96; the all-gather stages z's 128 bytes: 224;
        // then z is stored: 96 + 128 = 224 as well (the staging came first, so it holds the peak).
        let declared = plan(&program, ElementSize::Declared);
        assert_eq!(declared.peak_bytes, 224);
        assert_eq!(declared.peak_live_bytes, 224);
        assert_eq!(declared.peak_instr, 4);
        assert_eq!(declared.peak_staging, Some((Staging::AllGather, 128)));
        assert_eq!(declared.param_bytes, 32);
        // Fixed 4 bytes: w 64 + x 32 + y 128 = 224; free x: 192; staging 256: 448.
        let fixed = plan(&program, ElementSize::Fixed(4));
        assert_eq!(fixed.peak_bytes, 448);
        assert_eq!(fixed.peak_live_bytes, 448);
    }

    #[test]
    fn reduce_scatter_stages_its_whole_input() {
        let mut program = small_program();
        let b = BufferId::new;
        let group = Group { axis: "tp".into(), ranks: vec![0, 1] };
        // z = reduce_scatter(y) keeps half of y: [8, 2].
        program.buffers[3].shape = vec![8, 2];
        program.instructions[4] = Instr::ReduceScatter { inputs: vec![b(2)], outs: vec![b(3)], group, dims: vec![1] };
        let result = plan(&program, ElementSize::Declared);
        // Before: w 32 + y 64 = 96; staging y's 64 bytes: 160; storing z (32): 128.
        assert_eq!(result.peak_bytes, 160);
        assert_eq!(result.peak_live_bytes, 128);
        assert_eq!(result.peak_staging, Some((Staging::ReduceScatter, 64)));
    }

    #[test]
    fn first_fit_reuses_freed_holes_without_overlap() {
        let program = small_program();
        let result = plan(&program, ElementSize::Declared);
        // w at 0, x at 64, y at 128; x's hole (64..128) is too small for z (128 bytes): z at 192.
        assert_eq!(result.offsets, vec![Some(0), Some(64), Some(128), Some(192)]);
        assert_eq!(result.arena_bytes, 320);
    }

    #[test]
    fn live_before_names_the_peak() {
        let program = small_program();
        let b = BufferId::new;
        // The peak is the all-gather (instruction 4) staging z: live then are w and y (x was freed).
        let result = plan(&program, ElementSize::Declared);
        assert_eq!(live_before(&program, result.peak_instr), vec![b(0), b(2)]);
        let live: u64 = live_before(&program, result.peak_instr).iter().map(|&id| program.buffer(id).bytes()).sum();
        assert_eq!(live + result.peak_staging.unwrap().1, result.peak_bytes);
        // At the end: w and z (y freed after the gather).
        assert_eq!(live_before(&program, program.instructions.len()), vec![b(0), b(3)]);
        assert_eq!(live_before(&program, 0), Vec::<BufferId>::new());
    }

    #[test]
    fn arena_merges_holes() {
        let mut arena = Arena { holes: Vec::new(), end: 0 };
        let a = arena.place(64);
        let b = arena.place(64);
        let c = arena.place(64);
        arena.release(a, 64);
        arena.release(c, 64);
        // c's hole merges into the top: the arena shrinks back to its end for growth.
        arena.release(b, 64);
        assert_eq!(arena.holes, vec![(0, 192)]);
        assert_eq!(arena.place(128), 0);
        assert_eq!(arena.place(128), 128);
        assert_eq!(arena.end, 256);
    }
}
