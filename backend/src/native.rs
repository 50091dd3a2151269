//! The contract between native kernel code (`backend::llvm`, feature `llvm`) and the runtime that
//! calls it: which instructions of a `Program` have native code, under which symbol names, and the
//! program fingerprint a native library carries so that it is never called for another program.
//!
//! This module needs no LLVM, so the runtime reads the same contract whether or not pleat was built
//! with the `llvm` feature. Guarantees:
//! - [`native_kernels`] selects only kernels whose operand and result sizes agree with their
//!   parameters (checked here, from the buffer table), so generated code with constant sizes never
//!   reads or writes past a buffer of the program it was generated for.
//! - A fused residual add + RMSNorm ([`NativeKernel::FusedAddRmsNorm`]) computes exactly what the
//!   two kernels compute one after the other, and still writes the add's result.
//!
//! ABI of the generated functions (C calling convention):
//! - `void pleat_kernel_<instr>(const float* const* inputs, float* out)`: the kernel of instruction
//!   `instr`; `inputs[i]` is the instruction's `i`-th operand (a RoPE's positions are `uint32_t`).
//! - `void pleat_fused_<add>(const float* const* inputs, float* sum, float* normed)`: the add at
//!   instruction `add` and the RMSNorm after it; `inputs` are the add's two operands and the norm's
//!   weight, `sum` the add's result and `normed` the norm's.
//! - `uint64_t pleat_program_fingerprint(void)`: [`program_fingerprint`] of the program.
//! - `int32_t pleat_rank_main(void* ctx)`: the whole program, in order, calling the functions above
//!   directly and the runtime's `pleat_rt_*` C ABI for everything else ([`abi`]).

use crate::program::{AttentionDims, AttentionOperand, BufferId, Instr, Kernel, Program};

pub mod abi;

/// The symbol of the function that returns the program fingerprint a native library was built for.
pub const FINGERPRINT_SYMBOL: &str = "pleat_program_fingerprint";

/// One native function of a program's library.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NativeKernel {
    /// The kernel of one instruction: `Add`, `SiluMul`, `RmsNorm` or `Rope` on every machine, and
    /// on a GPU also `Attention`, `AttentionGrad`, `MergeAttention`, `Embedding`, `EmbeddingGrad`,
    /// `Sum`, `CrossEntropyGrad`, `RopeGrad`, `SiluMulGradGate`, `RmsNormGradInput` and
    /// `RmsNormGradInputAdd` ([`device_kernels`]).
    Single {
        /// The instruction's index.
        instr: usize,
    },
    /// A residual add and the RMSNorm that reads its result, in one loop nest a row; only `Free`
    /// instructions lie between them.
    FusedAddRmsNorm {
        /// The add's instruction index.
        add_instr: usize,
        /// The norm's instruction index.
        norm_instr: usize,
    },
}

impl NativeKernel {
    /// The exported symbol name.
    pub fn symbol(&self) -> String {
        match self {
            NativeKernel::Single { instr } => format!("pleat_kernel_{instr}"),
            NativeKernel::FusedAddRmsNorm { add_instr, .. } => format!("pleat_fused_{add_instr}"),
        }
    }

    /// The buffers the function reads, in the order of its `inputs` array, and those it writes
    /// (`out`, or a fused kernel's `sum` and `normed`), as [`Self`]'s instructions in `program` name
    /// them; `None` when one of those instructions is not a kernel.
    pub fn buffers(&self, program: &Program) -> Option<(Vec<BufferId>, Vec<BufferId>)> {
        let kernel_at = |instr: usize| match program.instructions.get(instr) {
            Some(Instr::Kernel { inputs, out, .. }) => Some((inputs.clone(), *out)),
            _ => None,
        };
        match *self {
            NativeKernel::Single { instr } => {
                let (inputs, out) = kernel_at(instr)?;
                Some((inputs, vec![out]))
            }
            NativeKernel::FusedAddRmsNorm { add_instr, norm_instr } => {
                let (add_inputs, sum) = kernel_at(add_instr)?;
                let (norm_inputs, normed) = kernel_at(norm_instr)?;
                let inputs = add_inputs.into_iter().chain(norm_inputs.get(1).copied()).collect();
                Some((inputs, vec![sum, normed]))
            }
        }
    }

    /// The instructions it computes, first to last (two for a fused add and norm).
    pub fn instrs(&self) -> Vec<usize> {
        match *self {
            NativeKernel::Single { instr } => vec![instr],
            NativeKernel::FusedAddRmsNorm { add_instr, norm_instr } => vec![add_instr, norm_instr],
        }
    }

    /// The instruction at which the runtime calls it.
    pub fn first_instr(&self) -> usize {
        match self {
            NativeKernel::Single { instr } => *instr,
            NativeKernel::FusedAddRmsNorm { add_instr, .. } => *add_instr,
        }
    }
}

/// A program's native kernels compiled for a GPU (`backend::llvm::device_code`, feature `llvm`):
/// what the CUDA runtime loads and launches. Each kernel has the ABI above, its `inputs` a device
/// array of device pointers, and runs one thread an item (a row or an element); threads past
/// `threads` return at once, so any launch of at least that many threads computes the kernel.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceCode {
    /// [`program_fingerprint`] of the program the kernels were generated for: the runtime launches
    /// them for that program only.
    pub fingerprint: u64,
    /// The GPU architecture the PTX targets (`sm_80`, `sm_90`).
    pub arch: String,
    /// The PTX module, each kernel a `.entry` named by [`NativeKernel::symbol`].
    pub ptx: String,
    /// Every kernel of the module, in program order.
    pub kernels: Vec<DeviceKernel>,
    /// Whether the kernels read and write each buffer at its declared dtype (a bf16 buffer as
    /// bf16: widened when read, rounded to nearest even when written, as the host runtime stores
    /// it). Code written before bf16 was generated says no: it reads every float as f32, so a
    /// runtime launches its kernels on f32 buffers only.
    #[serde(default)]
    pub declared_elements: bool,
}

/// One kernel of a [`DeviceCode`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceKernel {
    /// Which instructions it computes.
    pub kernel: NativeKernel,
    /// The threads it needs: one a row or element; 0 when it has no work.
    pub threads: u64,
}

/// FNV-1a (64-bit) over the program's serialized form: equal programs, equal fingerprints.
pub fn program_fingerprint(program: &Program) -> u64 {
    crate::to_json(program)
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The instructions, in program order, that get native code on the host: fused add + norm pairs
/// where the program allows it, each other eligible kernel on its own.
pub fn native_kernels(program: &Program) -> Vec<NativeKernel> {
    let mut kernels = Vec::new();
    let mut fused_norms = Vec::new();
    for (index, instr) in program.instructions.iter().enumerate() {
        if fused_norms.contains(&index) {
            continue;
        }
        if let Some(norm_instr) = fusable_norm(program, index) {
            fused_norms.push(norm_instr);
            kernels.push(NativeKernel::FusedAddRmsNorm { add_instr: index, norm_instr });
        } else if let Instr::Kernel { kernel, inputs, out } = instr {
            if eligible(program, kernel, inputs, *out) {
                kernels.push(NativeKernel::Single { instr: index });
            }
        }
    }
    kernels
}

/// The instructions, in program order, that get generated code on a GPU: [`native_kernels`], and
/// each attention forward (one query row a thread, an online softmax), merge of ring attention's
/// states (one row a thread) and embedding lookup (one element a thread), and the training step's
/// attention gradients (q's one query row a thread, k's and v's one key row), sums of gradients
/// (one element a thread), embedding gradient (one table row a thread), cross-entropy gradient (one
/// logits row a thread), RoPE gradient, SwiGLU
/// gate gradient (one element a thread) and RMSNorm input gradient (one row a thread, alone or
/// added to a gathered gradient), whose buffers agree with its parameters. On the host these stay with the runtime's kernels (its attention's tiled GEMMs
/// are faster there, and the host's generated code must equal the runtime's bit for bit); on a GPU
/// they spare the copies of their operands to the host (the embedding's whole table, attention's
/// q, k and v) that running them there costs.
pub fn device_kernels(program: &Program) -> Vec<NativeKernel> {
    let mut kernels = native_kernels(program);
    for (index, instr) in program.instructions.iter().enumerate() {
        if let Instr::Kernel { kernel, inputs, out } = instr {
            if device_eligible(program, kernel, inputs, *out) {
                kernels.push(NativeKernel::Single { instr: index });
            }
        }
    }
    kernels.sort_by_key(NativeKernel::first_instr);
    kernels
}

/// Moves the `LoadParam` of each RMSNorm's weight that lies between a residual add and the norm
/// reading it to just before the add, so that the two can fuse ([`native_kernels`]), then moves
/// the frees between each fused pair after the norm: the fused kernel writes both results while
/// the add's operands are still live, and the program (so the memory planner's arena and the
/// executor's measured peak) must say so. Only `LoadParam` and `Free` instructions may lie between
/// them; loading a weight a few steps earlier or freeing a buffer one step later changes no value.
/// Returns the number of loads moved.
pub fn schedule_for_fusion(program: &mut Program) -> usize {
    let moved = hoist_norm_weights(program);
    for add_at in 0..program.instructions.len() {
        if let Some(norm_at) = fusable_norm(program, add_at) {
            program.instructions[add_at + 1..=norm_at].rotate_right(1);
        }
    }
    moved
}

/// The first step of [`schedule_for_fusion`]: the weight loads hoisted before their adds.
fn hoist_norm_weights(program: &mut Program) -> usize {
    let mut moved = 0;
    let mut index = 0;
    while index < program.instructions.len() {
        if let Some(load_at) = weight_load_to_hoist(program, index) {
            let load = program.instructions.remove(load_at);
            program.instructions.insert(index, load);
            moved += 1;
            // The add is now one further on.
            index += 1;
        }
        index += 1;
    }
    moved
}

/// For an add at `add_at` followed, across only loads and frees, by an RMSNorm of its result whose
/// weight is loaded in between: the index of that load.
fn weight_load_to_hoist(program: &Program, add_at: usize) -> Option<usize> {
    let Instr::Kernel { kernel: Kernel::Add, out: sum, .. } = &program.instructions[add_at] else {
        return None;
    };
    for (offset, instr) in program.instructions[add_at + 1..].iter().enumerate() {
        match instr {
            Instr::Free { buf } if buf != sum => {}
            Instr::LoadParam { .. } => {}
            Instr::Kernel { kernel: Kernel::RmsNorm { .. }, inputs, .. } if inputs.first() == Some(sum) => {
                let weight = *inputs.get(1)?;
                return program.instructions[add_at + 1..add_at + 1 + offset]
                    .iter()
                    .position(|between| matches!(between, Instr::LoadParam { out, .. } if *out == weight))
                    .map(|position| add_at + 1 + position);
            }
            _ => return None,
        }
    }
    None
}

/// The RMSNorm instruction that fuses with the add at `add_at`, if the program allows: the add is
/// eligible and not a bias add, only frees (of neither the sum nor the weight) lie between, the
/// norm reads the sum and is eligible, and its weight is written before the add.
fn fusable_norm(program: &Program, add_at: usize) -> Option<usize> {
    let Instr::Kernel { kernel: Kernel::Add, inputs: add_inputs, out: sum } = &program.instructions[add_at] else {
        return None;
    };
    if !eligible(program, &Kernel::Add, add_inputs, *sum)
        || program.buffer(add_inputs[0]).numel() != program.buffer(add_inputs[1]).numel()
    {
        return None;
    }
    let mut norm_at = add_at + 1;
    loop {
        match program.instructions.get(norm_at)? {
            Instr::Free { .. } => norm_at += 1,
            Instr::Kernel { kernel: kernel @ Kernel::RmsNorm { .. }, inputs, out } => {
                let weight = *inputs.get(1)?;
                let frees_between = program.instructions[add_at + 1..norm_at]
                    .iter()
                    .any(|instr| matches!(instr, Instr::Free { buf } if *buf == weight || buf == sum));
                let weight_ready = program.instructions[..add_at].iter().any(|instr| instr.outs().contains(&weight));
                let fits = inputs[0] == *sum && eligible(program, kernel, inputs, *out);
                return (fits && weight_ready && !frees_between).then_some(norm_at);
            }
            _ => return None,
        }
    }
}

/// Whether `kernel` has native code and its buffers agree with its parameters.
fn eligible(program: &Program, kernel: &Kernel, inputs: &[crate::program::BufferId], out: crate::BufferId) -> bool {
    let in_range = |id: crate::BufferId| (id.as_u32() as usize) < program.buffers.len();
    if inputs.len() != 2 || !inputs.iter().copied().chain([out]).all(in_range) {
        return false;
    }
    let numel = |id: crate::BufferId| program.buffer(id).numel();
    let is_float = |id: crate::BufferId| !program.buffer(id).is_integer();
    let (first, second) = (inputs[0], inputs[1]);
    let floats = is_float(first) && is_float(out);
    match kernel {
        Kernel::Add => {
            floats
                && is_float(second)
                && numel(first) == numel(out)
                && numel(second) > 0
                && numel(first) % numel(second) == 0
        }
        Kernel::SiluMul => floats && is_float(second) && numel(first) == numel(out) && numel(second) == numel(out),
        Kernel::RmsNorm { hidden, .. } => {
            floats
                && is_float(second)
                && *hidden > 0
                && numel(first) == numel(out)
                && numel(first) % hidden == 0
                && numel(second) == *hidden
        }
        Kernel::Rope { batch, seq, heads, head_dim, inv_freq } => {
            floats
                && program.buffer(second).is_integer()
                && head_dim % 2 == 0
                && inv_freq.len() as u64 == head_dim / 2
                && numel(first) == batch * seq * heads * head_dim
                && numel(out) == numel(first)
                && numel(second) == *seq
        }
        _ => false,
    }
}

/// Whether `kernel` has generated code on a GPU only ([`device_kernels`]) and its buffers agree
/// with its parameters: an attention forward or gradient whose query heads all read local kv heads,
/// a merge of two attention states, an embedding lookup whose table shard lies inside the
/// vocabulary or its gradient, a sum, a cross-entropy gradient, a RoPE gradient, a SwiGLU gate gradient, an RMSNorm
/// input gradient.
fn device_eligible(program: &Program, kernel: &Kernel, inputs: &[BufferId], out: BufferId) -> bool {
    let in_range = |id: BufferId| (id.as_u32() as usize) < program.buffers.len();
    if !inputs.iter().copied().chain([out]).all(in_range) {
        return false;
    }
    let numel = |id: BufferId| program.buffer(id).numel();
    let is_float = |id: BufferId| !program.buffer(id).is_integer();
    let is_integer = |id: BufferId| program.buffer(id).is_integer();
    match kernel {
        Kernel::Attention { dims, with_lse } => {
            let [q, ..] = inputs else { return false };
            let row_width = dims.head_dim + u64::from(*with_lse);
            attention_operands_agree(program, dims, inputs)
                && is_float(out)
                && numel(out) == numel(*q) / dims.head_dim * row_width
        }
        Kernel::AttentionGrad { wrt, dims } => {
            let [q, k, _, _, _, dy] = inputs else { return false };
            let result = if *wrt == AttentionOperand::Query { *q } else { *k };
            attention_operands_agree(program, dims, &inputs[..5])
                && is_float(*dy)
                && is_float(out)
                && numel(*dy) == numel(*q)
                && numel(out) == numel(result)
        }
        Kernel::EmbeddingGrad { hidden, vocab_offset, vocab_total } => {
            let [dy, tokens] = inputs else { return false };
            *hidden > 0
                && is_float(*dy)
                && is_integer(*tokens)
                && is_float(out)
                && numel(out) % hidden == 0
                && vocab_offset + numel(out) / hidden <= *vocab_total
                && numel(*dy) == numel(*tokens) * hidden
        }
        Kernel::Sum => {
            inputs.len() >= 2 && inputs.iter().copied().chain([out]).all(|id| is_float(id) && numel(id) == numel(out))
        }
        Kernel::CrossEntropyGrad { batch, seq, vocab, terms } => {
            let [logits, tokens] = inputs else { return false };
            *seq > 0
                && *terms > 0
                && is_float(*logits)
                && is_float(out)
                && is_integer(*tokens)
                && numel(*logits) == batch * seq * vocab
                && numel(*tokens) == batch * seq
                && numel(out) == numel(*logits)
        }
        Kernel::MergeAttention { rows, head_dim } => {
            let [first, second] = inputs else { return false };
            let state = rows * (head_dim + 1);
            [*first, *second, out].into_iter().all(|id| is_float(id) && numel(id) == state)
        }
        Kernel::Embedding { hidden, vocab_offset, vocab_total } => {
            let [table, tokens] = inputs else { return false };
            *hidden > 0
                && is_float(*table)
                && is_integer(*tokens)
                && is_float(out)
                && numel(*table) % hidden == 0
                && vocab_offset + numel(*table) / hidden <= *vocab_total
                && numel(out) == numel(*tokens) * hidden
        }
        Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq } => {
            let [dy, positions] = inputs else { return false };
            is_float(*dy)
                && is_float(out)
                && is_integer(*positions)
                && head_dim % 2 == 0
                && inv_freq.len() as u64 == head_dim / 2
                && numel(*dy) == batch * seq * heads * head_dim
                && numel(out) == numel(*dy)
                && numel(*positions) == *seq
        }
        Kernel::SiluMulGradGate => {
            inputs.len() == 3 && inputs.iter().copied().chain([out]).all(|id| is_float(id) && numel(id) == numel(out))
        }
        Kernel::RmsNormGradInput { hidden, .. } | Kernel::RmsNormGradInputAdd { hidden, .. } => {
            let accumulates = matches!(kernel, Kernel::RmsNormGradInputAdd { .. });
            let (x, weight, dy) = match inputs {
                [x, weight, dy] if !accumulates => (*x, *weight, *dy),
                [x, weight, dy, accumulated] if accumulates && numel(*accumulated) == numel(out) => (*x, *weight, *dy),
                _ => return false,
            };
            *hidden > 0
                && inputs.iter().copied().chain([out]).all(is_float)
                && numel(x) % hidden == 0
                && numel(weight) == *hidden
                && numel(dy) == numel(x)
                && numel(out) == numel(x)
        }
        _ => false,
    }
}

/// Whether attention's operands `(q, k, v, q_pos, k_pos)` agree with `dims`, and every local query
/// head reads a local kv head: the generated attention kernels index only the rank's kv heads.
fn attention_operands_agree(program: &Program, dims: &AttentionDims, operands: &[BufferId]) -> bool {
    let AttentionDims { batch, sq, sk, hq, hkv, head_dim, q_head_offset, kv_head_offset, group, .. } = *dims;
    let [q, k, v, q_pos, k_pos] = operands else { return false };
    let (buffer, numel) = (|id: &BufferId| program.buffer(*id), |id: &BufferId| program.buffer(*id).numel());
    let kv_local =
        |head: u64| ((q_head_offset + head) / group).checked_sub(kv_head_offset).is_some_and(|local| local < hkv);
    [q, k, v].into_iter().all(|id| !buffer(id).is_integer())
        && buffer(q_pos).is_integer()
        && buffer(k_pos).is_integer()
        && group > 0
        && head_dim > 0
        && (0..hq).all(kv_local)
        && numel(q) == batch * sq * hq * head_dim
        && numel(k) == batch * sk * hkv * head_dim
        && numel(v) == numel(k)
        && numel(q_pos) == sq
        && numel(k_pos) == sk
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::program::{Buffer, BufferId, BufferKind, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn buffer(name: &str, shape: &[u64], kind: BufferKind) -> Buffer {
        Buffer { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), kind }
    }

    fn load(out: u32, name: &str) -> Instr {
        Instr::LoadParam { out: BufferId::new(out as usize), name: name.into(), shape: vec![8], region: vec![(0, 8)] }
    }

    fn kernel(kernel: Kernel, inputs: &[u32], out: u32) -> Instr {
        Instr::Kernel {
            kernel,
            inputs: inputs.iter().map(|&id| BufferId::new(id as usize)).collect(),
            out: BufferId::new(out as usize),
        }
    }

    /// `sum = a + b; free a; load w; normed = rms_norm(sum, w)`, then a bias add and a silu-mul.
    pub(crate) fn residual_program() -> Program {
        let activation = BufferKind::Activation;
        Program {
            format_version: FORMAT_VERSION,
            model: "test".into(),
            mesh: String::new(),
            rank: 0,
            world_size: 1,
            tokens_shape: vec![],
            buffers: vec![
                buffer("a", &[2, 8], BufferKind::Param),
                buffer("b", &[2, 8], BufferKind::Param),
                buffer("sum", &[2, 8], activation),
                buffer("w", &[8], BufferKind::Param),
                buffer("normed", &[2, 8], activation),
                buffer("biased", &[2, 8], activation),
                buffer("gated", &[2, 8], activation),
            ],
            instructions: vec![
                load(0, "a"),
                load(1, "b"),
                kernel(Kernel::Add, &[0, 1], 2),
                Instr::Free { buf: BufferId::new(0) },
                load(3, "w"),
                kernel(Kernel::RmsNorm { hidden: 8, eps: 1e-5 }, &[2, 3], 4),
                kernel(Kernel::Add, &[4, 3], 5),
                kernel(Kernel::SiluMul, &[5, 2], 6),
            ],
        }
    }

    #[test]
    fn loads_move_up_and_the_pair_fuses() {
        let mut program = residual_program();
        // The weight's load sits between the add and the norm: nothing fuses yet.
        assert_eq!(native_kernels(&program)[0], NativeKernel::Single { instr: 2 });
        assert_eq!(schedule_for_fusion(&mut program), 1);
        assert!(matches!(program.instructions[2], Instr::LoadParam { ref name, .. } if name == "w"));
        // The free between the pair moved after the norm: both results are written while `a` lives.
        assert!(matches!(program.instructions[4], Instr::Kernel { kernel: Kernel::RmsNorm { .. }, .. }));
        assert_eq!(program.instructions[5], Instr::Free { buf: BufferId::new(0) });
        assert_eq!(
            native_kernels(&program),
            vec![
                NativeKernel::FusedAddRmsNorm { add_instr: 3, norm_instr: 4 },
                NativeKernel::Single { instr: 6 },
                NativeKernel::Single { instr: 7 },
            ]
        );
        assert_eq!(schedule_for_fusion(&mut program), 0);
        assert_eq!(native_kernels(&program)[0].symbol(), "pleat_fused_3");
    }

    #[test]
    fn a_fused_kernel_reads_the_adds_operands_and_the_norms_weight_and_writes_both_results() {
        let mut program = residual_program();
        schedule_for_fusion(&mut program);
        let id = |index: usize| BufferId::new(index);
        let fused = NativeKernel::FusedAddRmsNorm { add_instr: 3, norm_instr: 4 };
        assert_eq!(fused.buffers(&program), Some((vec![id(0), id(1), id(3)], vec![id(2), id(4)])));
        assert_eq!(fused.instrs(), vec![3, 4]);
        let silu = NativeKernel::Single { instr: 7 };
        assert_eq!(silu.buffers(&program), Some((vec![id(5), id(2)], vec![id(6)])));
        // A load is no kernel.
        assert_eq!(NativeKernel::Single { instr: 0 }.buffers(&program), None);
    }

    #[test]
    fn inconsistent_sizes_stay_interpreted() {
        let mut program = residual_program();
        program.instructions[5] = kernel(Kernel::RmsNorm { hidden: 5, eps: 1e-5 }, &[2, 3], 4);
        schedule_for_fusion(&mut program);
        assert_eq!(
            native_kernels(&program),
            vec![
                NativeKernel::Single { instr: 3 },
                NativeKernel::Single { instr: 6 },
                NativeKernel::Single { instr: 7 },
            ]
        );
    }

    /// The residual program with an embedding lookup and an attention after it: the table
    /// `[4, 8]` holds rows 4..8 of 8; attention over `[1, 2, hq = 2, 4]` with one local kv head.
    fn program_with_device_kernels(kv_head_offset: u64) -> Program {
        let mut program = residual_program();
        let first = program.buffers.len() as u32;
        let input = BufferKind::Input;
        let integer = |name: &str, shape: &[u64]| Buffer { dtype: DType::I32, ..buffer(name, shape, input) };
        program.buffers.extend([
            buffer("table", &[4, 8], BufferKind::Param),
            integer("tokens", &[1, 2]),
            buffer("embedded", &[1, 2, 8], BufferKind::Activation),
            buffer("q", &[1, 2, 2, 4], input),
            buffer("kv", &[1, 2, 1, 4], input),
            integer("positions", &[2]),
            buffer("attended", &[1, 2, 2, 4], BufferKind::Activation),
        ]);
        let embedding = Kernel::Embedding { hidden: 8, vocab_offset: 4, vocab_total: 8 };
        program.instructions.push(kernel(embedding, &[first, first + 1], first + 2));
        let dims = AttentionDims {
            batch: 1,
            sq: 2,
            sk: 2,
            hq: 2,
            hkv: 1,
            head_dim: 4,
            q_head_offset: 0,
            kv_head_offset,
            group: 2,
            causal: true,
            scale: 0.5,
        };
        let [q, kv, positions] = [first + 3, first + 4, first + 5];
        program.instructions.push(kernel(
            Kernel::Attention { dims, with_lse: false },
            &[q, kv, kv, positions, positions],
            first + 6,
        ));
        program
    }

    #[test]
    fn attention_and_the_embedding_are_generated_for_a_gpu_only() {
        let program = program_with_device_kernels(0);
        let host = native_kernels(&program);
        let device = device_kernels(&program);
        assert_eq!(host.len(), 4, "{host:?}");
        let added: Vec<&NativeKernel> = device.iter().filter(|kernel| !host.contains(kernel)).collect();
        assert_eq!(added, [&NativeKernel::Single { instr: 8 }, &NativeKernel::Single { instr: 9 }]);
        assert!(device.windows(2).all(|pair| pair[0].first_instr() < pair[1].first_instr()), "{device:?}");
    }

    #[test]
    fn a_device_kernel_whose_buffers_disagree_stays_on_the_host() {
        // The query heads read global kv head 0, which a kv head offset of 1 says is elsewhere.
        assert_eq!(device_kernels(&program_with_device_kernels(1)).len(), 5);
        // A table shard reaching past the vocabulary.
        let mut program = program_with_device_kernels(0);
        let Instr::Kernel { kernel: Kernel::Embedding { vocab_offset, .. }, .. } = &mut program.instructions[8] else {
            panic!("the embedding is instruction 8");
        };
        *vocab_offset = 5;
        assert_eq!(device_kernels(&program).len(), 5);
        // Positions that are floats.
        let mut program = program_with_device_kernels(0);
        let positions = program.buffers.len() - 2;
        program.buffers[positions].dtype = DType::F32;
        assert_eq!(device_kernels(&program).len(), 5);
    }

    #[test]
    fn fingerprint_follows_the_program() {
        let program = residual_program();
        let mut changed = program.clone();
        changed.rank = 1;
        assert_eq!(program_fingerprint(&program), program_fingerprint(&program.clone()));
        assert_ne!(program_fingerprint(&program), program_fingerprint(&changed));
    }
}
