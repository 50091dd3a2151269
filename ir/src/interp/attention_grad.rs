//! The gradients of grouped-query attention with respect to its queries, keys and values.
//!
//! Everything is recomputed from `q`, `k`, `v` (no saved softmax): for each query row the visible
//! keys (the same mask as the forward op), `P = softmax(scale * q · kᵀ)`, `dP = dy · vᵀ`,
//! `dS = P * (dP - sum(P * dP))`; then `dq = scale * dS · k`, `dk = scale * dSᵀ · q`, `dv = Pᵀ · dy`,
//! where `dk` and `dv` of a key/value head sum over the query heads of its group. All in f64, each
//! result element rounded once.

use super::error::OpError;
use super::ops::{indices, shape_error};
use super::tensor::Tensor;

/// Which operand of attention a gradient is taken with respect to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum AttentionOperand {
    /// The queries.
    Query,
    /// The keys.
    Key,
    /// The values.
    Value,
}

/// `(q, k, v, q_positions, k_positions, dy) -> d(operand)`, shaped as that operand.
pub(crate) fn attention_grad(operands: [&Tensor; 6], causal: bool, wrt: AttentionOperand) -> Result<Tensor, OpError> {
    let [q, k, v, q_positions, k_positions, dy] = operands;
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
            format!("[{batch}, kv_seq, kv_heads, {head_dim}] with kv_heads >= 1 dividing heads = {heads}"),
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
    if dy.shape != q.shape {
        return Err(shape_error(5, dy, format!("{:?}, the shape of operand 0", q.shape)));
    }
    let q_positions = indices(3, q_positions)?;
    let k_positions = indices(4, k_positions)?;
    let group = heads / kv_heads;
    let scale = f64::from((head_dim as f64).powf(-0.5) as f32);
    let q_offset = |b: usize, token: usize, head: usize| ((b * seq + token) * heads + head) * head_dim;
    let kv_offset = |b: usize, token: usize, head: usize| ((b * kv_seq + token) * kv_heads + head) * head_dim;
    let dot = |left: &[f32], right: &[f32]| -> f64 {
        left.iter().zip(right).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
    };

    let mut result = vec![0.0_f64; if wrt == AttentionOperand::Query { q.data.len() } else { k.data.len() }];
    for b in 0..batch {
        for head in 0..heads {
            let kv_head = head / group;
            for (query, &query_position) in q_positions.iter().enumerate() {
                let q_start = q_offset(b, query, head);
                let query_vector = &q.data[q_start..q_start + head_dim];
                let gradient = &dy.data[q_start..q_start + head_dim];
                let visible: Vec<usize> =
                    (0..kv_seq).filter(|&key| !causal || k_positions[key] <= query_position).collect();
                if visible.is_empty() {
                    continue;
                }
                let key_vector =
                    |key: usize| &k.data[kv_offset(b, key, kv_head)..kv_offset(b, key, kv_head) + head_dim];
                let value_vector =
                    |key: usize| &v.data[kv_offset(b, key, kv_head)..kv_offset(b, key, kv_head) + head_dim];
                let scores: Vec<f64> = visible.iter().map(|&key| scale * dot(query_vector, key_vector(key))).collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exponentials: Vec<f64> = scores.iter().map(|&score| (score - max).exp()).collect();
                let total: f64 = exponentials.iter().sum();
                let probabilities: Vec<f64> = exponentials.iter().map(|&exponential| exponential / total).collect();
                let d_probabilities: Vec<f64> = visible.iter().map(|&key| dot(gradient, value_vector(key))).collect();
                let mean: f64 = probabilities.iter().zip(&d_probabilities).map(|(&p, &dp)| p * dp).sum();
                for (index, &key) in visible.iter().enumerate() {
                    let d_score = probabilities[index] * (d_probabilities[index] - mean);
                    match wrt {
                        AttentionOperand::Query => {
                            let slots = &mut result[q_start..q_start + head_dim];
                            for (slot, &key_element) in slots.iter_mut().zip(key_vector(key)) {
                                *slot += scale * d_score * f64::from(key_element);
                            }
                        }
                        AttentionOperand::Key => {
                            let start = kv_offset(b, key, kv_head);
                            for (slot, &query_element) in result[start..start + head_dim].iter_mut().zip(query_vector) {
                                *slot += scale * d_score * f64::from(query_element);
                            }
                        }
                        AttentionOperand::Value => {
                            let start = kv_offset(b, key, kv_head);
                            for (slot, &gradient_element) in result[start..start + head_dim].iter_mut().zip(gradient) {
                                *slot += probabilities[index] * f64::from(gradient_element);
                            }
                        }
                    }
                }
            }
        }
    }
    let shape = if wrt == AttentionOperand::Query { q.shape.clone() } else { k.shape.clone() };
    Ok(Tensor { shape, data: result.into_iter().map(|sum| sum as f32).collect() })
}
