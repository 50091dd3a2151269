//! The executor's dispatch of the loss and backward kernels: operands read from the rank's buffers,
//! the kernel's sizes converted to the runtime kernels' plain dimensions, errors attributed to the
//! instruction. Split from `executor.rs` to keep one concept a file; it sees the executor's private
//! `Machine`, as a child module.

use pleat_backend::{AttentionOperand, BufferId, Kernel};

use super::{attention_shape, moe_grad_operand, moe_shape, Machine};
use crate::error::{Error, Result};
use crate::kernels::{self, AttentionGradOperand, LossShape, VocabShardShape};

/// Runs the backward `kernel` on `operands` into `result` (sized to `out`); the caller has checked the
/// operand count.
pub(super) fn run_backward_kernel(
    machine: &Machine,
    kernel: &Kernel,
    operands: &[BufferId],
    out: BufferId,
    result: &mut [f32],
    gemm_threads: usize,
) -> Result<()> {
    let f32_operand = |index: usize| machine.f32(operands[index]);
    let u32_operand = |index: usize| machine.u32(operands[index]);
    let kernel_error = |source: kernels::KernelError| Error::Kernel {
        rank: machine.program.rank,
        instr: machine.instr,
        what: machine.what(out),
        source: Box::new(source),
    };
    match kernel {
        Kernel::CrossEntropy { batch, seq, vocab, terms } => {
            let shape = loss_shape(*batch, *seq, *vocab, *terms);
            let loss = kernels::cross_entropy(&shape, &f32_operand(0)?, u32_operand(1)?).map_err(kernel_error)?;
            let slot =
                result.first_mut().ok_or_else(|| machine.program_error("the loss needs a 1-element result".into()))?;
            *slot = loss;
        }
        Kernel::CrossEntropyGrad { batch, seq, vocab, terms } => {
            let shape = loss_shape(*batch, *seq, *vocab, *terms);
            kernels::cross_entropy_grad(&shape, &f32_operand(0)?, u32_operand(1)?, result).map_err(kernel_error)?;
        }
        Kernel::LossRowStats { batch, seq, vocab, vocab_offset, global_vocab } => {
            let shape = vocab_shard_shape([*batch, *seq, *vocab, *vocab_offset, *global_vocab, 1, 1]);
            kernels::loss_row_stats(&shape, &f32_operand(0)?, u32_operand(1)?, result).map_err(kernel_error)?;
        }
        Kernel::CrossEntropyFromStats { batch, seq, global_vocab, terms, parts } => {
            let shape = vocab_shard_shape([*batch, *seq, 1, 0, *global_vocab, *terms, *parts]);
            let loss =
                kernels::cross_entropy_from_stats(&shape, u32_operand(0)?, &f32_operand(1)?).map_err(kernel_error)?;
            let slot =
                result.first_mut().ok_or_else(|| machine.program_error("the loss needs a 1-element result".into()))?;
            *slot = loss;
        }
        Kernel::CrossEntropyGradFromStats { batch, seq, vocab, vocab_offset, global_vocab, terms, parts } => {
            let shape = vocab_shard_shape([*batch, *seq, *vocab, *vocab_offset, *global_vocab, *terms, *parts]);
            kernels::cross_entropy_grad_from_stats(&shape, &f32_operand(0)?, u32_operand(1)?, &f32_operand(2)?, result)
                .map_err(kernel_error)?;
        }
        Kernel::MatMulGradInput { m, n, k } => kernels::matmul_grad_input(
            *m as usize,
            *n as usize,
            *k as usize,
            &f32_operand(0)?,
            &f32_operand(1)?,
            result,
            gemm_threads,
        ),
        Kernel::MatMulGradWeight { m, n, k } => kernels::matmul_grad_weight(
            *m as usize,
            *n as usize,
            *k as usize,
            &f32_operand(0)?,
            &f32_operand(1)?,
            result,
            gemm_threads,
        ),
        Kernel::RmsNormGradInput { hidden, eps } => kernels::rms_norm_grad_input(
            &f32_operand(0)?,
            &f32_operand(1)?,
            &f32_operand(2)?,
            result,
            *hidden as usize,
            *eps,
        ),
        Kernel::RmsNormGradInputAdd { hidden, eps } => {
            kernels::rms_norm_grad_input(
                &f32_operand(0)?,
                &f32_operand(1)?,
                &f32_operand(2)?,
                result,
                *hidden as usize,
                *eps,
            );
            // Rounded as the gradient was stored and added after, as the add it replaces did: bit
            // for bit the same.
            super::round_as_stored(machine.program.buffer(out).dtype, result);
            kernels::add_in_place(result, &f32_operand(3)?);
        }
        Kernel::RmsNormGradWeight { hidden, eps } => {
            kernels::rms_norm_grad_weight(&f32_operand(0)?, &f32_operand(1)?, result, *hidden as usize, *eps)
        }
        Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq } => {
            result.copy_from_slice(&f32_operand(0)?);
            kernels::rope_grad_in_place(
                result,
                *batch as usize,
                *seq as usize,
                *heads as usize,
                *head_dim as usize,
                u32_operand(1)?,
                inv_freq,
            );
        }
        Kernel::AttentionGrad { wrt, dims } => {
            let shape = attention_shape(dims);
            let wrt = match wrt {
                AttentionOperand::Query => AttentionGradOperand::Query,
                AttentionOperand::Key => AttentionGradOperand::Key,
                AttentionOperand::Value => AttentionGradOperand::Value,
            };
            let (q, k, v) = (&f32_operand(0)?, &f32_operand(1)?, &f32_operand(2)?);
            let (q_pos, k_pos, dy) = (u32_operand(3)?, u32_operand(4)?, &f32_operand(5)?);
            kernels::attention_grad(&shape, wrt, q, k, v, q_pos, k_pos, dy, result).map_err(kernel_error)?;
        }
        Kernel::MoeMlpGrad { wrt, dims } => {
            let wrt = moe_grad_operand(*wrt);
            let operands = [&f32_operand(0)?, &f32_operand(1)?, &f32_operand(2)?, &f32_operand(3)?, &f32_operand(4)?];
            let dy = f32_operand(5)?;
            kernels::moe_mlp_grad(&moe_shape(dims), operands.map(|operand| operand.as_ref()), &dy, wrt, result);
        }
        Kernel::SiluMulGradGate => {
            kernels::silu_mul_grad_gate(&f32_operand(0)?, &f32_operand(1)?, &f32_operand(2)?, result)
        }
        Kernel::EmbeddingGrad { hidden, vocab_offset, vocab_total } => kernels::embedding_grad(
            &f32_operand(0)?,
            u32_operand(1)?,
            *hidden as usize,
            *vocab_offset as usize,
            *vocab_total as usize,
            result,
        )
        .map_err(kernel_error)?,
        Kernel::SumLeading { width } => kernels::sum_leading(&f32_operand(0)?, *width as usize, result),
        _ => return Err(machine.program_error(format!("{kernel:?} is not a backward kernel"))),
    }
    Ok(())
}

/// `[batch, seq, vocab, vocab_offset, global_vocab, terms, parts]` as the runtime kernels take them.
fn vocab_shard_shape(sizes: [u64; 7]) -> VocabShardShape {
    let [batch, seq, vocab, vocab_offset, global_vocab, terms, parts] = sizes.map(|size| size as usize);
    VocabShardShape { batch, seq, vocab, vocab_offset, global_vocab, terms, parts }
}

fn loss_shape(batch: u64, seq: u64, vocab: u64, terms: u64) -> LossShape {
    LossShape { batch: batch as usize, seq: seq as usize, vocab: vocab as usize, terms: terms as usize }
}
