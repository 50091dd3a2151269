//! The gradients of attention with respect to its queries, keys and values, over the local heads.
//!
//! Nothing from the forward pass is stored: each query row's softmax is recomputed from `q` and `k`
//! (one row of scores at a time, flash-style), then with `P = softmax(scale·q·kᵀ)` over the keys the
//! row sees, `dP = dy·vᵀ` and `dS = P·(dP - Σ P·dP)`: `dq = scale·dS·k`, `dk = scale·dSᵀ·q`, `dv = Pᵀ·dy`.
//!
//! Heads and masking follow the forward kernel ([`super::attention`]) exactly: local query head `h`
//! reads local kv head `(q_head_offset + h) / group - kv_head_offset`, and query `i` sees key `j` when
//! `k_pos[j] <= q_pos[i]` (with `causal`), comparing absolute positions, so sequence blocks and
//! zigzag layouts need nothing special. The key and value gradients cover all `hkv` local kv heads and
//! sum over the local query heads only: when the query heads are split over ranks and the kv heads
//! are not, each rank's result is a partial sum that a later all-reduce completes. A query row that
//! sees no key contributes nothing. Row scalars (maximum, softmax sum, `Σ P·dP`) are kept in f64.

use super::attention::{validate_operands, AttentionShape};
use super::{check_len, KernelError};

/// Which operand of attention a gradient is taken with respect to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttentionGradOperand {
    /// The queries: the result has `q`'s layout, `[batch, sq, hq, head_dim]`.
    Query,
    /// The keys: the result has `k`'s layout, `[batch, sk, hkv, head_dim]`.
    Key,
    /// The values: the result has `v`'s layout, `[batch, sk, hkv, head_dim]`.
    Value,
}

/// Writes into `out` the gradient of `attention(shape, q, k, v, q_pos, k_pos)` with respect to `wrt`,
/// given `dy`, the gradient of its output (`q`'s layout).
///
/// # Errors
/// [`KernelError::LengthMismatch`] when a buffer disagrees with `shape` (`out` must have the layout
/// of the operand `wrt` names), [`KernelError::ZeroDim`] when `shape.group` is 0, and
/// [`KernelError::KvHeadNotLocal`] when a query head's kv head is not among the local ones. Nothing
/// is written on error.
#[allow(clippy::too_many_arguments)] // Attention's five operands, the output's gradient and the result.
pub fn attention_grad(
    shape: &AttentionShape,
    wrt: AttentionGradOperand,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    dy: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    validate_operands("attention_grad", shape, q, k, v, q_pos, k_pos)?;
    check_len("attention_grad", "dy", q.len(), dy.len())?;
    let result_len = if wrt == AttentionGradOperand::Query { q.len() } else { k.len() };
    check_len("attention_grad", "out", result_len, out.len())?;
    let AttentionShape { batch, sq, sk, hq, hkv, head_dim, causal, scale, .. } = *shape;
    out.fill(0.0);
    let q_row_stride = hq * head_dim;
    let kv_row_stride = hkv * head_dim;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&x, &y)| x * y).sum::<f32>();
    // One query row's visible keys, their probabilities and the gradients of their scores.
    let mut visible: Vec<usize> = Vec::with_capacity(sk);
    let mut probabilities: Vec<f64> = Vec::with_capacity(sk);
    for batch_index in 0..batch {
        for query_head in 0..hq {
            let kv_head = shape.local_kv_head(query_head)?;
            let kv_at = |key: usize| (batch_index * sk + key) * kv_row_stride + kv_head * head_dim;
            for (query, &query_position) in q_pos.iter().enumerate() {
                let q_start = (batch_index * sq + query) * q_row_stride + query_head * head_dim;
                let query_row = &q[q_start..q_start + head_dim];
                let gradient_row = &dy[q_start..q_start + head_dim];
                visible.clear();
                visible.extend((0..sk).filter(|&key| !causal || k_pos[key] <= query_position));
                if visible.is_empty() {
                    continue;
                }
                probabilities.clear();
                probabilities.extend(
                    visible.iter().map(|&key| f64::from(scale * dot(query_row, &k[kv_at(key)..kv_at(key) + head_dim]))),
                );
                let max = probabilities.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let mut total = 0.0;
                for probability in probabilities.iter_mut() {
                    *probability = (*probability - max).exp();
                    total += *probability;
                }
                probabilities.iter_mut().for_each(|probability| *probability /= total);
                if wrt == AttentionGradOperand::Value {
                    for (&key, &probability) in visible.iter().zip(&probabilities) {
                        let slots = &mut out[kv_at(key)..kv_at(key) + head_dim];
                        let weight = probability as f32;
                        slots.iter_mut().zip(gradient_row).for_each(|(slot, &g)| *slot += weight * g);
                    }
                    continue;
                }
                // dP[j] = dy · v[j]; dS[j] = P[j] (dP[j] - Σ P dP), overwriting dP.
                let mut d_scores: Vec<f64> = visible
                    .iter()
                    .map(|&key| f64::from(dot(gradient_row, &v[kv_at(key)..kv_at(key) + head_dim])))
                    .collect();
                let mean: f64 = probabilities.iter().zip(&d_scores).map(|(&p, &dp)| p * dp).sum();
                for (d_score, &probability) in d_scores.iter_mut().zip(&probabilities) {
                    *d_score = probability * (*d_score - mean);
                }
                for (&key, &d_score) in visible.iter().zip(&d_scores) {
                    let weight = scale * d_score as f32;
                    match wrt {
                        AttentionGradOperand::Query => {
                            let key_row = &k[kv_at(key)..kv_at(key) + head_dim];
                            let slots = &mut out[q_start..q_start + head_dim];
                            slots.iter_mut().zip(key_row).for_each(|(slot, &x)| *slot += weight * x);
                        }
                        _ => {
                            let slots = &mut out[kv_at(key)..kv_at(key) + head_dim];
                            slots.iter_mut().zip(query_row).for_each(|(slot, &x)| *slot += weight * x);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// The forward attention in f64 by its formula, with the forward kernel's head mapping and mask.
    fn forward(shape: &AttentionShape, q: &[f64], k: &[f64], v: &[f64], q_pos: &[u32], k_pos: &[u32]) -> Vec<f64> {
        let AttentionShape { batch, sq, sk, hq, hkv, head_dim: d, .. } = *shape;
        let mut out = vec![0.0; q.len()];
        for b in 0..batch {
            for h in 0..hq {
                let kv = (shape.q_head_offset + h) / shape.group - shape.kv_head_offset;
                for i in 0..sq {
                    let q_row = &q[((b * sq + i) * hq + h) * d..][..d];
                    let kv_row = |t: &[f64], j: usize| t[((b * sk + j) * hkv + kv) * d..][..d].to_vec();
                    let visible: Vec<usize> = (0..sk).filter(|&j| !shape.causal || k_pos[j] <= q_pos[i]).collect();
                    let scores: Vec<f64> = visible
                        .iter()
                        .map(|&j| shape.scale as f64 * q_row.iter().zip(kv_row(k, j)).map(|(a, b)| a * b).sum::<f64>())
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for (&j, w) in visible.iter().zip(&weights) {
                        for (c, value) in kv_row(v, j).iter().enumerate() {
                            out[((b * sq + i) * hq + h) * d + c] += w / total * value;
                        }
                    }
                }
            }
        }
        out
    }

    /// Seeded operands: q, k (spread so softmax rows are far from uniform), v and dy.
    fn operands(shape: &AttentionShape) -> [Vec<f32>; 4] {
        let (q_len, kv_len) =
            (shape.batch * shape.sq * shape.hq * shape.head_dim, shape.batch * shape.sk * shape.hkv * shape.head_dim);
        let spread = |data: Vec<f32>| data.iter().map(|x| x * 2.0).collect();
        [spread(values(q_len, 81)), spread(values(kv_len, 82)), values(kv_len, 83), values(q_len, 84)]
    }

    fn kernel(
        shape: &AttentionShape,
        wrt: AttentionGradOperand,
        data: &[Vec<f32>; 4],
        pos: (&[u32], &[u32]),
    ) -> Vec<f32> {
        let [q, k, v, dy] = data;
        let mut out = vec![f32::NAN; if wrt == AttentionGradOperand::Query { q.len() } else { k.len() }];
        attention_grad(shape, wrt, q, k, v, pos.0, pos.1, dy, &mut out).unwrap();
        out
    }

    /// Compares the three gradients with central differences of `Σ dy · forward(q, k, v)`.
    #[track_caller]
    fn check(shape: AttentionShape, q_pos: &[u32], k_pos: &[u32]) {
        let data = operands(&shape);
        let wide: Vec<Vec<f64>> = data.iter().map(|t| t.iter().map(|&x| x as f64).collect()).collect();
        let objective = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            forward(&shape, q, k, v, q_pos, k_pos).iter().zip(&wide[3]).map(|(o, g)| o * g).sum()
        };
        let operand_order = [AttentionGradOperand::Query, AttentionGradOperand::Key, AttentionGradOperand::Value];
        for (which, wrt) in operand_order.into_iter().enumerate() {
            let want: Vec<f64> = (0..wide[which].len())
                .map(|index| {
                    let mut shifted = [wide[0].clone(), wide[1].clone(), wide[2].clone()];
                    shifted[which][index] += 1e-4;
                    let plus = objective(&shifted[0], &shifted[1], &shifted[2]);
                    shifted[which][index] -= 2e-4;
                    let minus = objective(&shifted[0], &shifted[1], &shifted[2]);
                    (plus - minus) / 2e-4
                })
                .collect();
            assert_close(&kernel(&shape, wrt, &data, (q_pos, k_pos)), &want, 1e-5);
        }
    }

    fn natural(count: usize) -> Vec<u32> {
        (0..count as u32).collect()
    }

    fn causal(mut shape: AttentionShape) -> AttentionShape {
        shape.causal = true;
        shape
    }

    #[test]
    fn gradients_match_finite_differences() {
        check(causal(AttentionShape::new(2, 5, 5, 4, 2, 4)), &natural(5), &natural(5));
        check(AttentionShape::new(1, 3, 6, 2, 1, 8), &natural(3), &natural(6));
        check(causal(AttentionShape::new(1, 4, 4, 3, 3, 4)), &natural(4), &natural(4));
    }

    #[test]
    fn sequence_blocks_mask_by_position() {
        // A zigzag block of queries (positions 0, 1, 6, 7) against the whole sequence in gathered
        // order, and a block whose first query sees no key at all.
        let keys = [0, 1, 6, 7, 2, 3, 4, 5];
        check(causal(AttentionShape::new(1, 4, 8, 2, 1, 4)), &[0, 1, 6, 7], &keys);
        check(causal(AttentionShape::new(1, 3, 2, 2, 2, 4)), &[1, 5, 3], &[4, 2]);
    }

    #[test]
    fn split_query_heads_with_whole_kv_heads_give_partial_sums() {
        // 6 query heads over 3 kv heads (group 2) split over 2 ranks: each rank holds 3 query heads
        // and every kv head, so its key and value gradients are partial sums over its query heads.
        let (batch, seq, d) = (2, 5, 4);
        let whole = causal(AttentionShape::new(batch, seq, seq, 6, 3, d));
        let positions = natural(seq);
        let data = operands(&whole);
        // Local query heads [3·rank, 3·rank + 3) of a `[batch, seq, 6, d]` tensor.
        let heads = |tensor: &[f32], rank: usize| -> Vec<f32> {
            tensor.chunks_exact(6 * d).flat_map(|row| row[3 * rank * d..(3 * rank + 3) * d].to_vec()).collect()
        };
        let mut key_sum = vec![0.0f64; data[1].len()];
        let mut value_sum = vec![0.0f64; data[2].len()];
        for rank in 0..2 {
            let mut local = whole;
            (local.hq, local.q_head_offset) = (3, 3 * rank);
            let local_data = [heads(&data[0], rank), data[1].clone(), data[2].clone(), heads(&data[3], rank)];
            let pos = (positions.as_slice(), positions.as_slice());
            let dq = kernel(&local, AttentionGradOperand::Query, &local_data, pos);
            let want_dq = heads(&kernel(&whole, AttentionGradOperand::Query, &data, pos), rank);
            assert_close(&dq, &want_dq.iter().map(|&x| x as f64).collect::<Vec<_>>(), 1e-6);
            let dk = kernel(&local, AttentionGradOperand::Key, &local_data, pos);
            key_sum.iter_mut().zip(dk).for_each(|(sum, x)| *sum += x as f64);
            let dv = kernel(&local, AttentionGradOperand::Value, &local_data, pos);
            value_sum.iter_mut().zip(dv).for_each(|(sum, x)| *sum += x as f64);
        }
        let pos = (positions.as_slice(), positions.as_slice());
        assert_close(&kernel(&whole, AttentionGradOperand::Key, &data, pos), &key_sum, 1e-6);
        assert_close(&kernel(&whole, AttentionGradOperand::Value, &data, pos), &value_sum, 1e-6);
    }

    #[test]
    fn wrong_result_length_is_named() {
        let shape = AttentionShape::new(1, 2, 2, 2, 1, 4);
        let data = operands(&shape);
        let mut out = vec![0.0; data[0].len()];
        let error = attention_grad(
            &shape,
            AttentionGradOperand::Key,
            &data[0],
            &data[1],
            &data[2],
            &[0, 1],
            &[0, 1],
            &data[3],
            &mut out,
        )
        .unwrap_err();
        assert_eq!(
            error,
            KernelError::LengthMismatch { kernel: "attention_grad", tensor: "out", expected: 8, got: 16 }
        );
    }
}
