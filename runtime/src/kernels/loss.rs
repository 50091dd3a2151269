//! The causal-LM loss (Hugging Face's shifted cross-entropy) and its gradient, on a block of rows.
//!
//! Position `t` of a sequence predicts token `t + 1`; the last position has no target. The block
//! holds whole sequences and the whole vocabulary (the shift and the softmax read across them), but
//! may hold only some of the batch: both kernels divide by `terms`, the global count of targets,
//! so the blocks' losses sum to the global mean and their gradients are the global mean's. Each
//! row's log-sum-exp is summed in f64 from the row's f32 maximum, and the loss total is kept in f64.

use super::{check_len, KernelError};

/// The sizes of a loss block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossShape {
    /// Sequences in the block.
    pub batch: usize,
    /// Positions a sequence (whole).
    pub seq: usize,
    /// Logits a position (the whole vocabulary).
    pub vocab: usize,
    /// The global count of targets, `global batch · (seq - 1)`: the mean's denominator.
    pub terms: usize,
}

/// Checks the buffers against `shape`; returns each row's target (`None` at a sequence's last position).
fn targets(
    kernel: &'static str,
    shape: &LossShape,
    logits: &[f32],
    tokens: &[u32],
) -> Result<Vec<Option<usize>>, KernelError> {
    let LossShape { batch, seq, vocab, terms } = *shape;
    for (what, size) in [("seq", seq), ("vocab", vocab), ("terms", terms)] {
        if size == 0 {
            return Err(KernelError::ZeroDim { kernel, what });
        }
    }
    let rows = batch.saturating_mul(seq);
    check_len(kernel, "logits", rows.saturating_mul(vocab), logits.len())?;
    next_token_targets(kernel, rows, seq, vocab, tokens)
}

/// Each of `rows` rows' target (the next token of its sequence of `seq`; `None` at a sequence's
/// last position), after checking `tokens` holds `rows` ids below `vocab_size`.
pub(super) fn next_token_targets(
    kernel: &'static str,
    rows: usize,
    seq: usize,
    vocab_size: usize,
    tokens: &[u32],
) -> Result<Vec<Option<usize>>, KernelError> {
    check_len(kernel, "tokens", rows, tokens.len())?;
    (0..rows)
        .map(|row| {
            if row % seq + 1 == seq {
                return Ok(None);
            }
            let token = tokens[row + 1];
            if token as usize >= vocab_size {
                return Err(KernelError::TargetOutOfRange { kernel, position: row + 1, token, vocab_size });
            }
            Ok(Some(token as usize))
        })
        .collect()
}

/// The row's maximum and `ln Σ exp(logit - max)`, the sum in f64.
fn log_sum_exp(row: &[f32]) -> (f32, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&logit| f64::from(logit - max).exp()).sum();
    (max, sum.ln())
}

/// `Σ over the block's rows with a target of (logsumexp(logits[row]) - logits[row, target]) / terms`,
/// `logits` `[batch, seq, vocab]` and `tokens` `[batch, seq]` row-major.
///
/// # Errors
/// [`KernelError::LengthMismatch`] when a buffer disagrees with `shape`, [`KernelError::ZeroDim`]
/// when `seq`, `vocab` or `terms` is 0, [`KernelError::TargetOutOfRange`] for a target id `>= vocab`.
pub fn cross_entropy(shape: &LossShape, logits: &[f32], tokens: &[u32]) -> Result<f32, KernelError> {
    let targets = targets("cross_entropy", shape, logits, tokens)?;
    let mut total = 0.0f64;
    for (row, target) in targets.iter().enumerate() {
        let Some(target) = *target else { continue };
        let logits_row = &logits[row * shape.vocab..(row + 1) * shape.vocab];
        let (max, log_sum) = log_sum_exp(logits_row);
        total += f64::from(max) + log_sum - f64::from(logits_row[target]);
    }
    Ok((total / shape.terms as f64) as f32)
}

/// The gradient of [`cross_entropy`]'s global mean with respect to the block's logits:
/// `(softmax(logits[row]) - onehot(target)) / terms` for a row with a target, zeros for a row without.
///
/// # Errors
/// As [`cross_entropy`], and [`KernelError::LengthMismatch`] when `out` is not as long as `logits`.
/// Nothing is written on error.
pub fn cross_entropy_grad(
    shape: &LossShape,
    logits: &[f32],
    tokens: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let targets = targets("cross_entropy_grad", shape, logits, tokens)?;
    check_len("cross_entropy_grad", "out", logits.len(), out.len())?;
    let vocab = shape.vocab;
    let terms = shape.terms as f64;
    for (row, target) in targets.iter().enumerate() {
        let out_row = &mut out[row * vocab..(row + 1) * vocab];
        let Some(target) = *target else {
            out_row.fill(0.0);
            continue;
        };
        let logits_row = &logits[row * vocab..(row + 1) * vocab];
        let (max, log_sum) = log_sum_exp(logits_row);
        for (index, (slot, &logit)) in out_row.iter_mut().zip(logits_row).enumerate() {
            let probability = (f64::from(logit - max) - log_sum).exp();
            let one_hot = if index == target { 1.0 } else { 0.0 };
            *slot = ((probability - one_hot) / terms) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Seeded logits (spread so softmax rows are far from uniform) and tokens below `vocab`.
    fn data(batch: usize, seq: usize, vocab: usize) -> (Vec<f32>, Vec<u32>) {
        let logits = values(batch * seq * vocab, 41).iter().map(|x| x * 4.0).collect();
        let tokens =
            values(batch * seq, 42).iter().map(|x| ((x + 1.0) / 2.0 * vocab as f32) as u32 % vocab as u32).collect();
        (logits, tokens)
    }

    /// The naive loss over the whole batch: the mean of `-ln softmax(row)[next token]`, in f64.
    fn naive_loss(logits: &[f32], tokens: &[u32], batch: usize, seq: usize, vocab: usize) -> f64 {
        let mut total = 0.0;
        for b in 0..batch {
            for t in 0..seq - 1 {
                let row: Vec<f64> = logits[(b * seq + t) * vocab..][..vocab].iter().map(|&x| x as f64).collect();
                let denominator: f64 = row.iter().map(|x| x.exp()).sum();
                total -= (row[tokens[b * seq + t + 1] as usize].exp() / denominator).ln();
            }
        }
        total / (batch * (seq - 1)) as f64
    }

    #[test]
    fn loss_matches_naive_mean() {
        let (batch, seq, vocab) = (3, 5, 11);
        let (logits, tokens) = data(batch, seq, vocab);
        let shape = LossShape { batch, seq, vocab, terms: batch * (seq - 1) };
        let got = cross_entropy(&shape, &logits, &tokens).unwrap();
        assert_close(&[got], &[naive_loss(&logits, &tokens, batch, seq, vocab)], 1e-6);
    }

    #[test]
    fn batch_blocks_sum_to_the_global_mean() {
        let (batch, seq, vocab) = (4, 3, 7);
        let (logits, tokens) = data(batch, seq, vocab);
        let terms = batch * (seq - 1);
        let block = |start: usize| {
            let shape = LossShape { batch: 2, seq, vocab, terms };
            let logits_block = &logits[start * seq * vocab..(start + 2) * seq * vocab];
            cross_entropy(&shape, logits_block, &tokens[start * seq..(start + 2) * seq]).unwrap()
        };
        let sum = block(0) as f64 + block(2) as f64;
        assert_close(&[sum as f32], &[naive_loss(&logits, &tokens, batch, seq, vocab)], 1e-6);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (batch, seq, vocab) = (2, 4, 6);
        let (logits, tokens) = data(batch, seq, vocab);
        let shape = LossShape { batch, seq, vocab, terms: batch * (seq - 1) };
        let mut got = vec![f32::NAN; logits.len()];
        cross_entropy_grad(&shape, &logits, &tokens, &mut got).unwrap();
        // Central differences of the f64 loss: exact to ~1e-9 for a smooth function at step 1e-4.
        let want: Vec<f64> = (0..logits.len())
            .map(|index| {
                let mut plus = logits.clone();
                let mut minus = logits.clone();
                plus[index] += 1e-3;
                minus[index] -= 1e-3;
                let step = (plus[index] - minus[index]) as f64;
                (naive_loss(&plus, &tokens, batch, seq, vocab) - naive_loss(&minus, &tokens, batch, seq, vocab)) / step
            })
            .collect();
        assert_close(&got, &want, 1e-5);
        // The last position of each sequence has no target: exact zeros.
        assert!(got[(seq - 1) * vocab..seq * vocab].iter().all(|&value| value == 0.0));
    }

    #[test]
    fn target_out_of_range_is_named() {
        let shape = LossShape { batch: 1, seq: 2, vocab: 3, terms: 1 };
        let error = cross_entropy(&shape, &[0.0; 6], &[0, 3]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cross_entropy: target at position 1 has id 3 but the vocabulary has 3 entries; \
             check the tokenizer matches the model"
        );
        let mut out = [0.0; 5];
        assert!(matches!(
            cross_entropy_grad(&shape, &[0.0; 6], &[0, 1], &mut out),
            Err(KernelError::LengthMismatch { tensor: "out", .. })
        ));
    }
}
