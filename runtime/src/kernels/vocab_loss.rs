//! The vocab-parallel causal-LM loss (Megatron's `VocabParallelCrossEntropy`), on one rank's vocab shard.
//!
//! Each of `parts` ranks holds the logits of the same rows for a contiguous run of the vocabulary.
//! [`loss_row_stats`] reduces the rank's shard of every row to three numbers: the shard's maximum
//! `m`, `s = Σ exp(logit - m)` over the shard, and the target's logit when the target falls in the
//! shard (zero otherwise). After the ranks all-gather these statistics, every rank holds the same
//! `parts` triples a row and [`cross_entropy_from_stats`] combines them exactly:
//! `M = max_j m_j`, `logsumexp = M + ln Σ_j s_j·exp(m_j - M)`, target logit `= Σ_j t_j`.
//! [`cross_entropy_grad_from_stats`] needs only the row's global log-sum-exp to write its shard of
//! `(softmax - onehot) / terms`. Rows are `[batch, seq]` row-major; the last position of a sequence
//! has no target, as in `loss`.

use super::loss::next_token_targets;
use super::{check_len, KernelError};

/// The values a row keeps in the exchanged statistics: max, sum of exponentials, target logit.
pub const STATS_PER_ROW: usize = 3;

/// The sizes of a rank's vocab shard of a loss block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShardShape {
    /// Sequences in the block.
    pub batch: usize,
    /// Positions a sequence (whole).
    pub seq: usize,
    /// Logits a position on this rank (its shard of the vocabulary).
    pub vocab: usize,
    /// The global id of the shard's first entry.
    pub vocab_offset: usize,
    /// The whole vocabulary, for checking target ids.
    pub global_vocab: usize,
    /// The global count of targets, `global batch · (seq - 1)`: the mean's denominator.
    pub terms: usize,
    /// Ranks the vocabulary is split over (statistics triples a row after the exchange).
    pub parts: usize,
}

impl VocabShardShape {
    fn rows(&self) -> usize {
        self.batch.saturating_mul(self.seq)
    }
}

/// Each row's global target id, `None` at a sequence's last position, after checking the sizes.
fn targets(kernel: &'static str, shape: &VocabShardShape, tokens: &[u32]) -> Result<Vec<Option<usize>>, KernelError> {
    for (what, size) in [("seq", shape.seq), ("vocab", shape.vocab), ("terms", shape.terms), ("parts", shape.parts)] {
        if size == 0 {
            return Err(KernelError::ZeroDim { kernel, what });
        }
    }
    next_token_targets(kernel, shape.rows(), shape.seq, shape.global_vocab, tokens)
}

/// The target's index in the shard, if the shard holds it.
fn local_target(shape: &VocabShardShape, target: usize) -> Option<usize> {
    target.checked_sub(shape.vocab_offset).filter(|&local| local < shape.vocab)
}

/// Each row's `(max, Σ exp(logit - max), target logit or 0)` over the rank's vocab shard, written
/// to `out` (`rows · 3`). Rows without a target get `0` as their target logit.
///
/// # Errors
/// [`KernelError::LengthMismatch`] when a buffer disagrees with `shape`, [`KernelError::ZeroDim`]
/// for a zero size, [`KernelError::TargetOutOfRange`] for a target id `>= global_vocab`.
pub fn loss_row_stats(
    shape: &VocabShardShape,
    logits: &[f32],
    tokens: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    const KERNEL: &str = "loss_row_stats";
    let targets = targets(KERNEL, shape, tokens)?;
    check_len(KERNEL, "logits", shape.rows().saturating_mul(shape.vocab), logits.len())?;
    check_len(KERNEL, "out", shape.rows() * STATS_PER_ROW, out.len())?;
    for (row, target) in targets.iter().enumerate() {
        let logits_row = &logits[row * shape.vocab..(row + 1) * shape.vocab];
        let max = logits_row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits_row.iter().map(|&logit| f64::from(logit - max).exp()).sum();
        let target_logit = target.and_then(|target| local_target(shape, target)).map_or(0.0, |local| logits_row[local]);
        out[row * STATS_PER_ROW..][..STATS_PER_ROW].copy_from_slice(&[max, sum as f32, target_logit]);
    }
    Ok(())
}

/// Each row's global log-sum-exp and target logit from the gathered statistics
/// (`[parts, rows, 3]`, rank `j`'s triples at `j · rows · 3`).
fn combine(stats: &[f32], rows: usize, parts: usize, row: usize) -> (f64, f64) {
    let triple = |part: usize| &stats[(part * rows + row) * STATS_PER_ROW..][..STATS_PER_ROW];
    let max = (0..parts).map(|part| triple(part)[0]).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = (0..parts).map(|part| f64::from(triple(part)[1]) * f64::from(triple(part)[0] - max).exp()).sum();
    let target: f64 = (0..parts).map(|part| f64::from(triple(part)[2])).sum();
    (f64::from(max) + sum.ln(), target)
}

/// `Σ over rows with a target of (logsumexp - target logit) / terms` from the gathered statistics;
/// the same on every rank of the split.
///
/// # Errors
/// As [`loss_row_stats`] for the sizes and tokens; [`KernelError::LengthMismatch`] when `stats` is
/// not `parts · rows · 3` long.
pub fn cross_entropy_from_stats(shape: &VocabShardShape, tokens: &[u32], stats: &[f32]) -> Result<f32, KernelError> {
    const KERNEL: &str = "cross_entropy_from_stats";
    let targets = targets(KERNEL, shape, tokens)?;
    let rows = shape.rows();
    check_len(KERNEL, "stats", shape.parts * rows * STATS_PER_ROW, stats.len())?;
    let total: f64 = (0..rows)
        .filter(|&row| targets[row].is_some())
        .map(|row| {
            let (log_sum_exp, target) = combine(stats, rows, shape.parts, row);
            log_sum_exp - target
        })
        .sum();
    Ok((total / shape.terms as f64) as f32)
}

/// The rank's vocab shard of the global mean loss's gradient, `(softmax - onehot(target)) / terms`
/// for a row with a target and zeros for a row without, the softmax normalised by the row's global
/// log-sum-exp from the gathered statistics.
///
/// # Errors
/// As [`cross_entropy_from_stats`], and [`KernelError::LengthMismatch`] when `logits` or `out`
/// disagree with `shape`. Nothing is written on error.
pub fn cross_entropy_grad_from_stats(
    shape: &VocabShardShape,
    logits: &[f32],
    tokens: &[u32],
    stats: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    const KERNEL: &str = "cross_entropy_grad_from_stats";
    let targets = targets(KERNEL, shape, tokens)?;
    let (rows, vocab) = (shape.rows(), shape.vocab);
    check_len(KERNEL, "logits", rows.saturating_mul(vocab), logits.len())?;
    check_len(KERNEL, "stats", shape.parts * rows * STATS_PER_ROW, stats.len())?;
    check_len(KERNEL, "out", logits.len(), out.len())?;
    let terms = shape.terms as f64;
    for (row, target) in targets.iter().enumerate() {
        let out_row = &mut out[row * vocab..(row + 1) * vocab];
        let Some(target) = *target else {
            out_row.fill(0.0);
            continue;
        };
        let (log_sum_exp, _) = combine(stats, rows, shape.parts, row);
        let target = local_target(shape, target);
        for (index, (slot, &logit)) in out_row.iter_mut().zip(&logits[row * vocab..]).enumerate() {
            let probability = (f64::from(logit) - log_sum_exp).exp();
            let one_hot = if Some(index) == target { 1.0 } else { 0.0 };
            *slot = ((probability - one_hot) / terms) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::super::{cross_entropy, cross_entropy_grad, LossShape};
    use super::*;

    /// Logits `[batch, seq, vocab]` and targets spread over the whole vocabulary.
    fn data(batch: usize, seq: usize, vocab: usize) -> (Vec<f32>, Vec<u32>) {
        let logits = values(batch * seq * vocab, 7).iter().map(|x| x * 6.0).collect();
        let tokens = (0..batch * seq).map(|index| ((index * 7 + 3) % vocab) as u32).collect();
        (logits, tokens)
    }

    /// Rank `part`'s shard (columns `[part·vocab/parts, ...)`) of every row.
    fn shard(logits: &[f32], vocab: usize, parts: usize, part: usize) -> Vec<f32> {
        let width = vocab / parts;
        logits.chunks(vocab).flat_map(|row| row[part * width..(part + 1) * width].to_vec()).collect()
    }

    /// The statistics every rank would hold after the all-gather, and each rank's shape.
    fn gathered(
        logits: &[f32],
        tokens: &[u32],
        batch: usize,
        seq: usize,
        vocab: usize,
        parts: usize,
    ) -> (Vec<f32>, Vec<VocabShardShape>) {
        let terms = batch * (seq - 1);
        let shapes: Vec<VocabShardShape> = (0..parts)
            .map(|part| VocabShardShape {
                batch,
                seq,
                vocab: vocab / parts,
                vocab_offset: part * vocab / parts,
                global_vocab: vocab,
                terms,
                parts,
            })
            .collect();
        let mut stats = Vec::new();
        for (part, shape) in shapes.iter().enumerate() {
            let mut part_stats = vec![f32::NAN; batch * seq * STATS_PER_ROW];
            loss_row_stats(shape, &shard(logits, vocab, parts, part), tokens, &mut part_stats).unwrap();
            stats.extend(part_stats);
        }
        (stats, shapes)
    }

    #[test]
    fn shards_give_the_whole_vocabulary_loss_and_gradient() {
        let (batch, seq, vocab) = (2, 5, 12);
        let (logits, tokens) = data(batch, seq, vocab);
        let whole = LossShape { batch, seq, vocab, terms: batch * (seq - 1) };
        let want_loss = cross_entropy(&whole, &logits, &tokens).unwrap();
        let mut want_grad = vec![f32::NAN; logits.len()];
        cross_entropy_grad(&whole, &logits, &tokens, &mut want_grad).unwrap();
        for parts in [1, 2, 3, 4] {
            let (stats, shapes) = gathered(&logits, &tokens, batch, seq, vocab, parts);
            for (part, shape) in shapes.iter().enumerate() {
                let loss = cross_entropy_from_stats(shape, &tokens, &stats).unwrap();
                assert_close(&[loss], &[f64::from(want_loss)], 1e-6);
                let mut grad = vec![f32::NAN; batch * seq * shape.vocab];
                cross_entropy_grad_from_stats(shape, &shard(&logits, vocab, parts, part), &tokens, &stats, &mut grad)
                    .unwrap();
                let want: Vec<f64> =
                    shard(&want_grad, vocab, parts, part).iter().map(|&value| f64::from(value)).collect();
                assert_close(&grad, &want, 1e-7);
            }
        }
    }

    #[test]
    fn a_target_outside_every_shard_is_named_with_the_whole_vocabulary() {
        let shape =
            VocabShardShape { batch: 1, seq: 2, vocab: 2, vocab_offset: 2, global_vocab: 4, terms: 1, parts: 2 };
        let mut out = [0.0; 6];
        let error = loss_row_stats(&shape, &[0.0; 4], &[0, 4], &mut out).unwrap_err();
        assert_eq!(
            error,
            KernelError::TargetOutOfRange { kernel: "loss_row_stats", position: 1, token: 4, vocab_size: 4 }
        );
        assert!(matches!(
            cross_entropy_from_stats(&shape, &[0, 1], &[0.0; 5]),
            Err(KernelError::LengthMismatch { tensor: "stats", .. })
        ));
    }
}
