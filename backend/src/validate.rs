//! Checks that a `Program` is internally consistent before a runtime trusts it: every buffer an
//! instruction names exists, and every kernel's sizes agree with its operands' and result's sizes.
//! It guards programs read from files, and `lower` checks each program it makes with it too.
//! Asynchronous transfers are checked too (`crate::transfers`): nothing between a start and its
//! wait reads the results or overwrites or frees what the transfer touches. Nothing but the
//! parameters and the outputs is left allocated at the end.

use crate::error::{Error, Result};
use crate::program::{
    AttentionDims, AttentionOperand, BufferId, BufferKind, Group, Instr, Kernel, MoeDims, Program, RouterDims,
};
use pleat_ir::MoeOperand;

fn bad(index: usize, reason: String) -> Error {
    Error::Inconsistent { instr: index, reason }
}

/// Checks `program`; the error names the instruction and what disagrees.
pub fn validate(program: &Program) -> Result<()> {
    let numel = |index: usize, buffer: BufferId| -> Result<u64> {
        program.buffers.get(buffer.as_u32() as usize).map(|data| data.numel()).ok_or_else(|| {
            bad(index, format!("{buffer} is not a buffer of this program ({} buffers)", program.buffers.len()))
        })
    };
    crate::transfers::check_transfers(program)?;
    check_nothing_left_allocated(program)?;
    for (index, instr) in program.instructions.iter().enumerate() {
        let mut sizes = Vec::new();
        for buffer in instr.inputs() {
            sizes.push(numel(index, buffer)?);
        }
        let mut out_sizes = Vec::new();
        for buffer in instr.outs() {
            out_sizes.push(numel(index, buffer)?);
        }
        if let Instr::Free { buf } = instr {
            numel(index, *buf)?;
        }
        check_collective_shapes(program, index, instr)?;
        if let Instr::ExpertDispatch { wrts, group, dims, .. } = instr {
            check_expert_dispatch(program, index, (wrts, group, dims), &sizes, &out_sizes)?;
            continue;
        }
        let Instr::Kernel { kernel, .. } = instr else { continue };
        let out = out_sizes.first().copied().unwrap_or(0);
        let expect = |what: &str, got: u64, want: u64| -> Result<()> {
            if got == want {
                Ok(())
            } else {
                Err(bad(index, format!("{what} has {got} elements, the kernel's sizes need {want}")))
            }
        };
        let operands = |count: usize| -> Result<()> {
            if sizes.len() == count {
                Ok(())
            } else {
                Err(bad(index, format!("the kernel takes {count} operands, the instruction gives {}", sizes.len())))
            }
        };
        match kernel {
            Kernel::Embedding { hidden, .. } => {
                operands(2)?;
                expect("the result", out, sizes[1] * hidden)?;
                if *hidden == 0 || sizes[0] % hidden != 0 {
                    return Err(bad(index, format!("the table's {} elements are not rows of {hidden}", sizes[0])));
                }
            }
            Kernel::RmsNorm { hidden, .. } => {
                operands(2)?;
                expect("the weight", sizes[1], *hidden)?;
                expect("the result", out, sizes[0])?;
                if *hidden == 0 || sizes[0] % hidden != 0 {
                    return Err(bad(index, format!("the input's {} elements are not rows of {hidden}", sizes[0])));
                }
            }
            Kernel::MatMul { m, n, k } => {
                operands(2)?;
                expect("the activation", sizes[0], m * k)?;
                expect("the weight", sizes[1], n * k)?;
                expect("the result", out, m * n)?;
            }
            Kernel::Rope { batch, seq, heads, head_dim, inv_freq } => {
                operands(2)?;
                expect("the input", sizes[0], batch * seq * heads * head_dim)?;
                expect("the positions", sizes[1], *seq)?;
                expect("the inverse frequencies", inv_freq.len() as u64, head_dim / 2)?;
                expect("the result", out, sizes[0])?;
            }
            Kernel::Attention { dims: AttentionDims { batch, sq, sk, hq, hkv, head_dim, .. }, with_lse } => {
                operands(5)?;
                expect("the queries", sizes[0], batch * sq * hq * head_dim)?;
                expect("the keys", sizes[1], batch * sk * hkv * head_dim)?;
                expect("the values", sizes[2], batch * sk * hkv * head_dim)?;
                expect("the query positions", sizes[3], *sq)?;
                expect("the key positions", sizes[4], *sk)?;
                let row_width = head_dim + u64::from(*with_lse);
                expect("the result", out, batch * sq * hq * row_width)?;
            }
            Kernel::MergeAttention { rows, head_dim } => {
                operands(2)?;
                expect("the first state", sizes[0], rows * (head_dim + 1))?;
                expect("the second state", sizes[1], rows * (head_dim + 1))?;
                expect("the result", out, rows * (head_dim + 1))?;
            }
            Kernel::ExpertCounts { dims, .. }
            | Kernel::RouterProbSum { dims }
            | Kernel::RouterProbSumGrad { dims, .. } => {
                let RouterDims { rows, hidden, experts } = *dims;
                let grad = matches!(kernel, Kernel::RouterProbSumGrad { .. });
                operands(if grad { 3 } else { 2 })?;
                expect("the rows", sizes[0], rows * hidden)?;
                expect("the router", sizes[1], experts * hidden)?;
                let result = match kernel {
                    Kernel::RouterProbSumGrad { wrt: MoeOperand::Input, .. } => rows * hidden,
                    Kernel::RouterProbSumGrad { wrt: MoeOperand::Router, .. } => experts * hidden,
                    Kernel::RouterProbSumGrad { wrt, .. } => {
                        return Err(bad(index, format!("router_prob_sum has no operand {}", wrt.as_str())))
                    }
                    _ => experts,
                };
                if grad {
                    expect("the sums' gradient", sizes[2], experts)?;
                }
                expect("the result", out, result)?;
            }
            Kernel::LoadBalancingLoss { experts } => {
                operands(2)?;
                expect("the counts", sizes[0], *experts)?;
                expect("the probabilities", sizes[1], *experts)?;
                expect("the result", out, 1)?;
            }
            Kernel::SigmoidScale { hidden } | Kernel::SigmoidScaleGradGate { hidden } => {
                let grad = matches!(kernel, Kernel::SigmoidScaleGradGate { .. });
                operands(if grad { 3 } else { 2 })?;
                expect("y", sizes[1], sizes[0] * hidden)?;
                if grad {
                    expect("the result's gradient", sizes[2], sizes[1])?;
                }
                expect("the result", out, if grad { sizes[0] } else { sizes[1] })?;
            }
            Kernel::SiluMul => {
                operands(2)?;
                expect("up", sizes[1], sizes[0])?;
                expect("the result", out, sizes[0])?;
            }
            Kernel::Sum => {
                if sizes.len() < 3 {
                    return Err(bad(index, format!("a sum takes at least 3 operands, got {}", sizes.len())));
                }
                for (operand, &size) in sizes.iter().enumerate().skip(1) {
                    expect(&format!("operand {operand}"), size, sizes[0])?;
                }
                expect("the result", out, sizes[0])?;
            }
            Kernel::Add => {
                operands(2)?;
                if sizes[1] == 0 || sizes[0] % sizes[1] != 0 {
                    return Err(bad(index, format!("a bias of {} elements does not tile {}", sizes[1], sizes[0])));
                }
                expect("the result", out, sizes[0])?;
            }
            Kernel::CrossEntropy { batch, seq, vocab, terms }
            | Kernel::CrossEntropyGrad { batch, seq, vocab, terms } => {
                operands(2)?;
                expect("the logits", sizes[0], batch * seq * vocab)?;
                expect("the tokens", sizes[1], batch * seq)?;
                let result = if matches!(kernel, Kernel::CrossEntropy { .. }) { 1 } else { batch * seq * vocab };
                expect("the result", out, result)?;
                if *terms == 0 {
                    return Err(bad(index, "the loss averages over 0 targets".to_string()));
                }
            }
            Kernel::LossRowStats { batch, seq, vocab, vocab_offset, global_vocab } => {
                operands(2)?;
                expect("the logits", sizes[0], batch * seq * vocab)?;
                expect("the tokens", sizes[1], batch * seq)?;
                expect("the result", out, batch * seq * 3)?;
                if vocab_offset + vocab > *global_vocab {
                    return Err(bad(
                        index,
                        format!(
                            "the vocab shard [{vocab_offset}, {}) lies outside {global_vocab}",
                            vocab_offset + vocab
                        ),
                    ));
                }
            }
            Kernel::CrossEntropyFromStats { batch, seq, terms, parts, .. } => {
                operands(2)?;
                expect("the tokens", sizes[0], batch * seq)?;
                expect("the statistics", sizes[1], parts * batch * seq * 3)?;
                expect("the result", out, 1)?;
                if *terms == 0 {
                    return Err(bad(index, "the loss averages over 0 targets".to_string()));
                }
            }
            Kernel::CrossEntropyGradFromStats { batch, seq, vocab, vocab_offset, global_vocab, terms, parts } => {
                operands(3)?;
                expect("the logits", sizes[0], batch * seq * vocab)?;
                expect("the tokens", sizes[1], batch * seq)?;
                expect("the statistics", sizes[2], parts * batch * seq * 3)?;
                expect("the result", out, batch * seq * vocab)?;
                if *terms == 0 || vocab_offset + vocab > *global_vocab {
                    return Err(bad(index, format!("terms={terms} or the vocab shard lies outside {global_vocab}")));
                }
            }
            Kernel::MatMulGradInput { m, n, k } => {
                operands(2)?;
                expect("the result's gradient", sizes[0], m * n)?;
                expect("the weight", sizes[1], n * k)?;
                expect("the result", out, m * k)?;
            }
            Kernel::MatMulGradWeight { m, n, k } => {
                operands(2)?;
                expect("the result's gradient", sizes[0], m * n)?;
                expect("the activation", sizes[1], m * k)?;
                expect("the result", out, n * k)?;
            }
            Kernel::RmsNormGradInput { hidden, .. } | Kernel::RmsNormGradInputAdd { hidden, .. } => {
                operands(if matches!(kernel, Kernel::RmsNormGradInput { .. }) { 3 } else { 4 })?;
                if let Some(&acc) = sizes.get(3) {
                    expect("the gradient added", acc, sizes[0])?;
                }
                expect("the weight", sizes[1], *hidden)?;
                expect("the result's gradient", sizes[2], sizes[0])?;
                expect("the result", out, sizes[0])?;
                if *hidden == 0 || sizes[0] % hidden != 0 {
                    return Err(bad(index, format!("the input's {} elements are not rows of {hidden}", sizes[0])));
                }
            }
            Kernel::RmsNormGradWeight { hidden, .. } => {
                operands(2)?;
                expect("the result's gradient", sizes[1], sizes[0])?;
                expect("the result", out, *hidden)?;
                if *hidden == 0 || sizes[0] % hidden != 0 {
                    return Err(bad(index, format!("the input's {} elements are not rows of {hidden}", sizes[0])));
                }
            }
            Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq } => {
                operands(2)?;
                expect("the gradient", sizes[0], batch * seq * heads * head_dim)?;
                expect("the positions", sizes[1], *seq)?;
                expect("the inverse frequencies", inv_freq.len() as u64, head_dim / 2)?;
                expect("the result", out, sizes[0])?;
            }
            Kernel::AttentionGrad { wrt, dims: AttentionDims { batch, sq, sk, hq, hkv, head_dim, .. } } => {
                operands(6)?;
                let (queries, keys) = (batch * sq * hq * head_dim, batch * sk * hkv * head_dim);
                expect("the queries", sizes[0], queries)?;
                expect("the keys", sizes[1], keys)?;
                expect("the values", sizes[2], keys)?;
                expect("the query positions", sizes[3], *sq)?;
                expect("the key positions", sizes[4], *sk)?;
                expect("the output's gradient", sizes[5], queries)?;
                let result = if *wrt == AttentionOperand::Query { queries } else { keys };
                expect("the result", out, result)?;
            }
            Kernel::MoeMlp { dims } | Kernel::MoeMlpGrad { dims, .. } => {
                let wrts = match kernel {
                    Kernel::MoeMlpGrad { wrt, .. } => vec![*wrt],
                    _ => Vec::new(),
                };
                check_moe_sizes(index, dims, &wrts, &sizes, &[out])?;
            }
            Kernel::SiluMulGradGate => {
                operands(3)?;
                expect("up", sizes[1], sizes[0])?;
                expect("the result's gradient", sizes[2], sizes[0])?;
                expect("the result", out, sizes[0])?;
            }
            Kernel::EmbeddingGrad { hidden, .. } => {
                operands(2)?;
                expect("the gradient", sizes[0], sizes[1] * hidden)?;
                if *hidden == 0 || out % hidden != 0 {
                    return Err(bad(index, format!("the table's {out} elements are not rows of {hidden}")));
                }
            }
            Kernel::SumLeading { width } => {
                operands(1)?;
                expect("the result", out, *width)?;
                if *width == 0 || sizes[0] % width != 0 {
                    return Err(bad(index, format!("the input's {} elements are not rows of {width}", sizes[0])));
                }
            }
            Kernel::Zeros => operands(0)?,
            Kernel::Slice { shape, region } => {
                operands(1)?;
                expect("the input", sizes[0], shape.iter().product())?;
                if region.len() != shape.len()
                    || region
                        .iter()
                        .zip(shape)
                        .any(|(&(start, len), &size)| start.checked_add(len).is_none_or(|end| end > size))
                {
                    return Err(bad(index, format!("the region {region:?} does not fit the shape {shape:?}")));
                }
                expect("the result", out, region.iter().map(|&(_, len)| len).product())?;
            }
            Kernel::Permute { shape, dim, order } => {
                operands(1)?;
                expect("the input", sizes[0], shape.iter().product())?;
                let len =
                    shape.get(*dim).copied().ok_or_else(|| bad(index, format!("dim {dim} is outside {shape:?}")))?;
                if order.len() as u64 != len || order.iter().any(|&source| source >= len) {
                    return Err(bad(index, format!("the order does not permute dim {dim} of {shape:?}")));
                }
                expect("the result", out, sizes[0])?;
            }
        }
    }
    Ok(())
}

/// Checks that every buffer the program writes, but for a parameter or an output, is freed by its
/// end: one left allocated would stay live for the rest of the step, above every peak the memory
/// planner and the cost model predict.
fn check_nothing_left_allocated(program: &Program) -> Result<()> {
    let mut written = vec![None; program.buffers.len()];
    let mut released = vec![false; program.buffers.len()];
    for (index, instr) in program.instructions.iter().enumerate() {
        for buffer in instr.outs() {
            if let Some(slot) = written.get_mut(buffer.as_u32() as usize) {
                slot.get_or_insert(index);
            }
        }
        if let Instr::Free { buf } | Instr::Output { buf, .. } = instr {
            if let Some(slot) = released.get_mut(buf.as_u32() as usize) {
                *slot = true;
            }
        }
    }
    let leaked = written.iter().enumerate().find(|&(buffer, first)| {
        first.is_some() && !released[buffer] && program.buffers[buffer].kind != BufferKind::Param
    });
    match leaked {
        Some((buffer, &Some(index))) => Err(bad(
            index,
            format!(
                "b{buffer} ({}) is written here and never freed: free it after its last reader, or make it an output",
                program.buffers[buffer].name
            ),
        )),
        _ => Ok(()),
    }
}

/// The shapes a collective's input and output must have: the executor splits and joins blocks along
/// the named dims, so a dim outside the shape or a block that does not divide would be a crash there.
/// A bucket's members (several operands) are each checked as if alone.
fn check_collective_shapes(program: &Program, index: usize, instr: &Instr) -> Result<()> {
    let members: Vec<Member> = match instr {
        Instr::ReduceScatter { inputs, outs, group, dims } => {
            if inputs.is_empty() || inputs.len() != outs.len() || inputs.len() != dims.len() {
                let counts = format!("{} operands, {} results and {} dims", inputs.len(), outs.len(), dims.len());
                return Err(bad(index, format!("{counts}; each operand needs one of each")));
            }
            let parts = group.ranks.len() as u64;
            inputs
                .iter()
                .zip(outs)
                .zip(dims)
                .map(|((&input, &out), &dim)| Member { input, out, parts, split: Some(dim), join: None })
                .collect()
        }
        Instr::AllReduce { inputs, outs, group } => {
            if inputs.is_empty() || inputs.len() != outs.len() {
                let counts = format!("{} operands and {} results", inputs.len(), outs.len());
                return Err(bad(index, format!("{counts}; each operand needs one")));
            }
            let parts = group.ranks.len() as u64;
            inputs
                .iter()
                .zip(outs)
                .map(|(&input, &out)| Member { input, out, parts, split: None, join: None })
                .collect()
        }
        Instr::AllGather { input, out, group, dim, .. } => {
            vec![Member { input: *input, out: *out, parts: group.ranks.len() as u64, split: None, join: Some(*dim) }]
        }
        Instr::AllToAll { input, out, group, split_dim, gather_dim } => vec![Member {
            input: *input,
            out: *out,
            parts: group.ranks.len() as u64,
            split: Some(*split_dim),
            join: Some(*gather_dim),
        }],
        _ => return Ok(()),
    };
    members.iter().try_for_each(|member| check_member_shapes(program, index, member))
}

/// One operand of a collective and its result: `out` must be `input` with dim `split` divided
/// and dim `join` multiplied by `parts` (the group's size).
struct Member {
    input: BufferId,
    out: BufferId,
    parts: u64,
    split: Option<usize>,
    join: Option<usize>,
}

fn check_member_shapes(program: &Program, index: usize, member: &Member) -> Result<()> {
    let &Member { input, out, parts, split, join } = member;
    let shape = |buffer: BufferId| program.buffer(buffer).shape.clone();
    let (input_shape, out_shape) = (shape(input), shape(out));
    let mut expected = input_shape.clone();
    for (dim, grow) in split.map(|dim| (dim, false)).into_iter().chain(join.map(|dim| (dim, true))) {
        let Some(size) = expected.get_mut(dim) else {
            return Err(bad(index, format!("dim {dim} is outside the input's shape {input_shape:?}")));
        };
        if grow {
            *size *= parts;
        } else if parts == 0 || *size % parts != 0 {
            return Err(bad(index, format!("dim {dim} of {input_shape:?} does not split into {parts} blocks")));
        } else {
            *size /= parts;
        }
    }
    if out_shape != expected {
        return Err(bad(index, format!("the result has shape {out_shape:?} where {expected:?} is needed")));
    }
    Ok(())
}

/// The operand and result sizes of a mixture of experts (a kernel, or a dispatch with several
/// gradients): `x`, router, gate, up, down and, for gradients, dy; one result a gradient in `wrts`
/// (the output when `wrts` is empty).
fn check_moe_sizes(index: usize, dims: &MoeDims, wrts: &[MoeOperand], sizes: &[u64], results: &[u64]) -> Result<()> {
    let MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, .. } = *dims;
    if top_k == 0 || top_k > experts || expert_offset + local_experts > experts {
        return Err(bad(
            index,
            format!(
                "top_k={top_k} and experts {expert_offset}..{} do not fit the {experts} experts",
                expert_offset + local_experts
            ),
        ));
    }
    let operands = if wrts.is_empty() { 5 } else { 6 };
    if sizes.len() != operands || results.len() != wrts.len().max(1) {
        return Err(bad(
            index,
            format!(
                "a mixture of experts takes {operands} operands and gives {} results, the instruction has {} and {}",
                wrts.len().max(1),
                sizes.len(),
                results.len()
            ),
        ));
    }
    let weights = local_experts * ffn * hidden;
    let wants = [
        ("the rows", rows * hidden),
        ("the router", experts * hidden),
        ("the gate projections", weights),
        ("the up projections", weights),
        ("the down projections", weights),
        ("the output's gradient", rows * hidden),
    ];
    for (&(what, want), &got) in wants.iter().zip(sizes) {
        if got != want {
            return Err(bad(index, format!("{what} has {got} elements, the mixture's sizes need {want}")));
        }
    }
    let result_sizes: Vec<u64> =
        if wrts.is_empty() { vec![rows * hidden] } else { wrts.iter().map(|wrt| sizes[wrt.index()]).collect() };
    if results != result_sizes {
        return Err(bad(
            index,
            format!("the results have {results:?} elements, the mixture's sizes need {result_sizes:?}"),
        ));
    }
    Ok(())
}

/// An expert dispatch: the mixture's sizes, and experts that the group's members hold in order
/// (member `j` holds experts `j·local_experts..`), this rank among them.
fn check_expert_dispatch(
    program: &Program,
    index: usize,
    (wrts, group, dims): (&[MoeOperand], &Group, &MoeDims),
    sizes: &[u64],
    results: &[u64],
) -> Result<()> {
    check_moe_sizes(index, dims, wrts, sizes, results)?;
    let Some(member) = group.ranks.iter().position(|&rank| rank == program.rank) else {
        return Err(bad(index, format!("rank {} is not in the dispatch group {:?}", program.rank, group.ranks)));
    };
    let members = group.ranks.len() as u64;
    if dims.local_experts * members != dims.experts || dims.expert_offset != member as u64 * dims.local_experts {
        return Err(bad(
            index,
            format!(
                "member {member} of {members} holds experts {}..{} of {}; a dispatch needs member j to hold experts \
                 j*{}..",
                dims.expert_offset,
                dims.expert_offset + dims.local_experts,
                dims.experts,
                dims.local_experts
            ),
        ));
    }
    Ok(())
}
