//! Checks that a `Program` is internally consistent before a runtime trusts it: every buffer an
//! instruction names exists, and every kernel's sizes agree with its operands' and result's sizes.
//! Lowering produces consistent programs by construction; this guards programs read from files.
//! Asynchronous transfers are checked too (`crate::transfers`): nothing between a start and its
//! wait reads the results or overwrites or frees what the transfer touches.

use crate::error::{Error, Result};
use crate::program::{AttentionDims, AttentionOperand, BufferId, Instr, Kernel, MoeDims, Program};

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
            Kernel::SiluMul => {
                operands(2)?;
                expect("up", sizes[1], sizes[0])?;
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
            Kernel::RmsNormGradInput { hidden, .. } => {
                operands(3)?;
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
                let MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, .. } = *dims;
                let grad = matches!(kernel, Kernel::MoeMlpGrad { .. });
                operands(if grad { 6 } else { 5 })?;
                if top_k == 0 || top_k > experts || expert_offset + local_experts > experts {
                    return Err(bad(
                        index,
                        format!(
                            "top_k={top_k} and experts {expert_offset}..{} do not fit the {experts} experts",
                            expert_offset + local_experts
                        ),
                    ));
                }
                let weights = local_experts * ffn * hidden;
                expect("the rows", sizes[0], rows * hidden)?;
                expect("the router", sizes[1], experts * hidden)?;
                expect("the gate projections", sizes[2], weights)?;
                expect("the up projections", sizes[3], weights)?;
                expect("the down projections", sizes[4], weights)?;
                if grad {
                    expect("the output's gradient", sizes[5], rows * hidden)?;
                }
                let result = match kernel {
                    Kernel::MoeMlpGrad { wrt, .. } => sizes[wrt.index()],
                    _ => rows * hidden,
                };
                expect("the result", out, result)?;
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

/// The shapes a collective's input and output must have: the executor splits and joins blocks along
/// the named dims, so a dim outside the shape or a block that does not divide would be a crash there.
fn check_collective_shapes(program: &Program, index: usize, instr: &Instr) -> Result<()> {
    let shape = |buffer: BufferId| program.buffer(buffer).shape.clone();
    let (input, out, parts, split, join) = match instr {
        Instr::ReduceScatter { input, out, group, dim } => (*input, *out, group.ranks.len() as u64, Some(*dim), None),
        Instr::AllReduce { input, out, group } => (*input, *out, group.ranks.len() as u64, None, None),
        Instr::AllGather { input, out, group, dim } => (*input, *out, group.ranks.len() as u64, None, Some(*dim)),
        Instr::AllToAll { input, out, group, split_dim, gather_dim } => {
            (*input, *out, group.ranks.len() as u64, Some(*split_dim), Some(*gather_dim))
        }
        _ => return Ok(()),
    };
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
