//! Causal grouped-query attention, as Hugging Face's eager Llama attention computes it.
//!
//! For query head `h` the key/value head is `h / (heads / kv_heads)` (HF's `repeat_kv`). Scores are
//! `q · k` times `head_dim^-0.5` in f32; with `causal`, a query at absolute position `p` sees exactly
//! the keys at positions `<= p`, whatever order the sequence is stored in, so a permuted (zigzag)
//! sequence with its positions permuted alike gives the same per-position results. Masked keys are
//! left out of the softmax entirely (HF adds the most negative float, whose exponential is 0). A query
//! that sees no key at all (possible only when query and key positions differ) gets zeros: the empty
//! weighted sum.

use super::error::OpError;
use super::ops::{dot, indices, shape_error};
use super::tensor::Tensor;

/// `(q[batch, seq, heads, head_dim], k[batch, kv_seq, kv_heads, head_dim], v (as k), q_positions[seq],
/// k_positions[kv_seq]) -> [batch, seq, heads, head_dim]`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_positions: &Tensor,
    k_positions: &Tensor,
    causal: bool,
) -> Result<Tensor, OpError> {
    let &[batch, seq, heads, head_dim] = q.shape.as_slice() else {
        return Err(shape_error(0, q, "[batch, seq, heads, head_dim]"));
    };
    let &[k_batch, kv_seq, kv_heads, k_head_dim] = k.shape.as_slice() else {
        return Err(shape_error(1, k, "[batch, kv_seq, kv_heads, head_dim]"));
    };
    if k_batch != batch || k_head_dim != head_dim || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(shape_error(
            1,
            k,
            format!(
                "[{batch}, kv_seq, kv_heads, {head_dim}] with kv_heads >= 1 dividing heads = {heads} (batch and \
                 head_dim of operand 0)"
            ),
        ));
    }
    if v.shape != k.shape {
        return Err(shape_error(2, v, format!("{:?}, the shape of operand 1", k.shape)));
    }
    if q_positions.shape != [seq] {
        return Err(shape_error(3, q_positions, format!("[seq] with seq = {seq}, dim 1 of operand 0")));
    }
    if k_positions.shape != [kv_seq] {
        return Err(shape_error(4, k_positions, format!("[kv_seq] with kv_seq = {kv_seq}, dim 1 of operand 1")));
    }
    let q_positions = indices(3, q_positions)?;
    let k_positions = indices(4, k_positions)?;
    let group = heads / kv_heads;
    // HF: `scaling = head_dim ** -0.5`, a Python float that torch rounds to f32.
    let scale = (head_dim as f64).powf(-0.5) as f32;
    let q_offset = |b: usize, token: usize, head: usize| ((b * seq + token) * heads + head) * head_dim;
    let kv_offset = |b: usize, token: usize, head: usize| ((b * kv_seq + token) * kv_heads + head) * head_dim;

    let mut data = vec![0.0_f32; q.data.len()];
    for b in 0..batch {
        for head in 0..heads {
            let kv_head = head / group;
            for (query, &query_position) in q_positions.iter().enumerate() {
                let start = q_offset(b, query, head);
                let query_vector = &q.data[start..start + head_dim];
                let visible: Vec<usize> =
                    (0..kv_seq).filter(|&key| !causal || k_positions[key] <= query_position).collect();
                if visible.is_empty() {
                    continue;
                }
                let scores: Vec<f32> = visible
                    .iter()
                    .map(|&key| {
                        let start = kv_offset(b, key, kv_head);
                        dot(query_vector, &k.data[start..start + head_dim]) * scale
                    })
                    .collect();
                // Softmax in f64 after subtracting the max, rounded to f32 probabilities as HF's
                // `softmax(dtype=float32)` gives them; then the probability-weighted sum of values.
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exponentials: Vec<f64> = scores.iter().map(|&score| f64::from(score - max).exp()).collect();
                let total: f64 = exponentials.iter().sum();
                let mut weighted = vec![0.0_f64; head_dim];
                for (&key, &exponential) in visible.iter().zip(&exponentials) {
                    let probability = f64::from((exponential / total) as f32);
                    let start = kv_offset(b, key, kv_head);
                    for (sum, &value) in weighted.iter_mut().zip(&v.data[start..start + head_dim]) {
                        *sum += probability * f64::from(value);
                    }
                }
                for (slot, sum) in data[start..start + head_dim].iter_mut().zip(weighted) {
                    *slot = sum as f32;
                }
            }
        }
    }
    Ok(Tensor { shape: q.shape.clone(), data })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::tensor::assert_close;

    fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
        Tensor::new(shape.to_vec(), data.to_vec()).expect("test tensor is consistent")
    }

    fn positions(values: &[usize]) -> Tensor {
        tensor(&[values.len()], &values.iter().map(|&p| p as f32).collect::<Vec<_>>())
    }

    /// Attention straight from its definition, written apart from the op: the key/value heads are
    /// first repeated to one per query head (HF's `repeat_kv`), then for every query the full score
    /// row gets -inf on masked keys and softmax is `exp(s) / sum(exp(s))`, all in f64.
    fn direct(q: &Tensor, k: &Tensor, v: &Tensor, q_pos: &[usize], k_pos: &[usize], causal: bool) -> Tensor {
        let (batch, seq, heads, dim) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
        let (kv_seq, kv_heads) = (k.shape[1], k.shape[2]);
        let repeat = |t: &Tensor| -> Vec<f64> {
            let mut out = Vec::new();
            for b in 0..batch {
                for s in 0..kv_seq {
                    for h in 0..heads {
                        let kv = h / (heads / kv_heads);
                        let start = ((b * kv_seq + s) * kv_heads + kv) * dim;
                        out.extend(t.data[start..start + dim].iter().map(|&x| f64::from(x)));
                    }
                }
            }
            out
        };
        let (keys, values) = (repeat(k), repeat(v));
        let mut out = vec![0.0_f32; q.data.len()];
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..seq {
                    let qi = &q.data[((b * seq + i) * heads + h) * dim..][..dim];
                    let scores: Vec<f64> = (0..kv_seq)
                        .map(|j| {
                            if causal && k_pos[j] > q_pos[i] {
                                return f64::NEG_INFINITY;
                            }
                            let kj = &keys[((b * kv_seq + j) * heads + h) * dim..][..dim];
                            qi.iter().zip(kj).map(|(&a, &c)| f64::from(a) * c).sum::<f64>() / (dim as f64).sqrt()
                        })
                        .collect();
                    let total: f64 = scores.iter().map(|s| s.exp()).sum();
                    for d in 0..dim {
                        let value: f64 = (0..kv_seq)
                            .map(|j| scores[j].exp() / total * values[((b * kv_seq + j) * heads + h) * dim + d])
                            .sum();
                        out[((b * seq + i) * heads + h) * dim + d] = value as f32;
                    }
                }
            }
        }
        Tensor { shape: q.shape.clone(), data: out }
    }

    /// Deterministic pseudo-random values in [-1, 1).
    fn pseudo_random(count: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Runs the op and the direct formula on random q, k, v of the given sizes and compares them.
    #[track_caller]
    fn check(batch: usize, heads: usize, kv_heads: usize, dim: usize, q_pos: &[usize], k_pos: &[usize], causal: bool) {
        let (seq, kv_seq) = (q_pos.len(), k_pos.len());
        let q = tensor(&[batch, seq, heads, dim], &pseudo_random(batch * seq * heads * dim, 1));
        let k = tensor(&[batch, kv_seq, kv_heads, dim], &pseudo_random(batch * kv_seq * kv_heads * dim, 2));
        let v = tensor(&[batch, kv_seq, kv_heads, dim], &pseudo_random(batch * kv_seq * kv_heads * dim, 3));
        let actual = attention(&q, &k, &v, &positions(q_pos), &positions(k_pos), causal).unwrap();
        assert_close(&actual, &direct(&q, &k, &v, q_pos, k_pos, causal), 1e-6);
    }

    #[test]
    fn one_head_by_hand() {
        // head_dim 2, scale 1/sqrt(2). Keys k0 = [1, 0] (position 0), k1 = [0, 1] (position 1);
        // values v0 = [1, 2], v1 = [3, 4]; both queries are [1, 0].
        // Query at position 0 sees k0 only: output v0 = [1, 2].
        // Query at position 1 sees both: scores [1/sqrt(2), 0] = [0.7071068, 0]; e^0.7071068 = 2.0281150,
        // so the weights are [2.0281150, 1] / 3.0281150 = [0.6697615, 0.3302385] and the output is
        // [0.6697615 + 3 * 0.3302385, 2 * 0.6697615 + 4 * 0.3302385] = [1.6604770, 2.6604770].
        let q = tensor(&[1, 2, 1, 2], &[1.0, 0.0, 1.0, 0.0]);
        let k = tensor(&[1, 2, 1, 2], &[1.0, 0.0, 0.0, 1.0]);
        let v = tensor(&[1, 2, 1, 2], &[1.0, 2.0, 3.0, 4.0]);
        let actual = attention(&q, &k, &v, &positions(&[0, 1]), &positions(&[0, 1]), true).unwrap();
        assert_close(&actual, &tensor(&[1, 2, 1, 2], &[1.0, 2.0, 1.660_477, 2.660_477]), 1e-6);
        // Without the mask the first query also sees k1: the same weights, the same output.
        let actual = attention(&q, &k, &v, &positions(&[0, 1]), &positions(&[0, 1]), false).unwrap();
        assert_close(&actual, &tensor(&[1, 2, 1, 2], &[1.660_477, 2.660_477, 1.660_477, 2.660_477]), 1e-6);
    }

    #[test]
    fn grouped_heads_read_their_kv_head() {
        // Two query heads share one kv head: with identical queries they give identical outputs.
        let q = tensor(&[1, 1, 2, 2], &[1.0, 0.0, 1.0, 0.0]);
        let k = tensor(&[1, 1, 1, 2], &[1.0, 0.0]);
        let v = tensor(&[1, 1, 1, 2], &[5.0, 6.0]);
        let actual = attention(&q, &k, &v, &positions(&[0]), &positions(&[0]), true).unwrap();
        assert_eq!(actual.data, vec![5.0, 6.0, 5.0, 6.0]);
        // 1 and 2 heads, GQA 4:2 and 4:1, batches, causal or not: the op agrees with the formula.
        check(1, 1, 1, 4, &[0, 1, 2, 3, 4], &[0, 1, 2, 3, 4], true);
        check(2, 2, 2, 8, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 4, 5], true);
        check(2, 4, 2, 8, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 4, 5], true);
        check(1, 4, 1, 4, &[0, 1, 2], &[0, 1, 2], false);
        // Queries against a longer, shifted key range (a context-parallel block).
        check(1, 2, 1, 4, &[4, 5], &[0, 1, 2, 3, 4, 5, 6, 7], true);
    }

    #[test]
    fn zigzag_order_gives_the_natural_per_position_outputs() {
        // Zigzag for cp = 2 over 8 tokens in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks
        // 1 and 2, so the stored order is positions [0, 1, 6, 7, 2, 3, 4, 5].
        let order = [0, 1, 6, 7, 2, 3, 4, 5];
        check(1, 4, 2, 4, &order, &order, true);
        let (heads, kv_heads, dim) = (4, 2, 4);
        let q = tensor(&[1, 8, heads, dim], &pseudo_random(8 * heads * dim, 7));
        let k = tensor(&[1, 8, kv_heads, dim], &pseudo_random(8 * kv_heads * dim, 8));
        let v = tensor(&[1, 8, kv_heads, dim], &pseudo_random(8 * kv_heads * dim, 9));
        let natural =
            attention(&q, &k, &v, &positions(&[0, 1, 2, 3, 4, 5, 6, 7]), &positions(&[0, 1, 2, 3, 4, 5, 6, 7]), true)
                .unwrap();
        let permute = |t: &Tensor| {
            let row = t.shape[2] * t.shape[3];
            let data = order.iter().flat_map(|&p| t.data[p * row..(p + 1) * row].to_vec()).collect();
            Tensor { shape: t.shape.clone(), data }
        };
        let zigzag =
            attention(&permute(&q), &permute(&k), &permute(&v), &positions(&order), &positions(&order), true).unwrap();
        // Slot i of the zigzag result holds position order[i]: un-permute and compare.
        let row = heads * dim;
        let mut unpermuted = vec![0.0; zigzag.data.len()];
        for (slot, &position) in order.iter().enumerate() {
            unpermuted[position * row..(position + 1) * row]
                .copy_from_slice(&zigzag.data[slot * row..(slot + 1) * row]);
        }
        assert_close(&Tensor { shape: natural.shape.clone(), data: unpermuted }, &natural, 1e-6);
    }

    #[test]
    fn a_query_that_sees_no_key_gets_zeros() {
        let q = tensor(&[1, 1, 1, 2], &[1.0, 1.0]);
        let k = tensor(&[1, 1, 1, 2], &[1.0, 1.0]);
        let actual = attention(&q, &k, &k, &positions(&[0]), &positions(&[3]), true).unwrap();
        assert_eq!(actual.data, vec![0.0, 0.0]);
    }

    #[test]
    fn bad_shapes_are_named() {
        let q = Tensor::zeros(vec![1, 2, 3, 4]);
        let k = Tensor::zeros(vec![1, 2, 2, 4]);
        let error = attention(&q, &k, &k, &positions(&[0, 1]), &positions(&[0, 1]), true).unwrap_err();
        assert_eq!(
            error.to_string(),
            "operand 1 has shape [1, 2, 2, 4], expected [1, kv_seq, kv_heads, 4] with kv_heads >= 1 dividing heads = 3 \
             (batch and head_dim of operand 0); fix the graph's types"
        );
    }
}
