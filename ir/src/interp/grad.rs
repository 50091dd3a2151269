//! The loss and the backward ops (all but attention's), as plain functions of their operand tensors.
//!
//! Each function is the textbook derivative of its forward op written out with loops, so it can be
//! read against the formula in `Op`'s docs. Sums and transcendentals are evaluated in f64 and each
//! result element is rounded to f32 once. The cross-entropy loss follows Hugging Face's
//! `ForCausalLMLoss`: position `t` predicts token `t + 1`, the mean runs over `batch * (seq - 1)`
//! terms. Shapes are checked and reported as `OpError`s, never panics.

use super::error::OpError;
use super::ops::{indices, shape_error};
use super::rope::rope;
use super::tensor::{element_count, Tensor};
use crate::model::config::RopeConfig;

/// Checks `logits[batch, seq, vocab]` and `tokens[batch, seq]` with `seq >= 2`; returns the sizes
/// and the next-token targets (`tokens[b, t + 1]` at `b * (seq - 1) + t`), each below `vocab`.
fn next_token_targets(logits: &Tensor, tokens: &Tensor) -> Result<(usize, usize, usize, Vec<usize>), OpError> {
    let &[batch, seq, vocab] = logits.shape.as_slice() else {
        return Err(shape_error(0, logits, "[batch, seq, vocab]"));
    };
    if seq < 2 {
        return Err(shape_error(0, logits, "[batch, seq, vocab] with seq >= 2, so some position has a next token"));
    }
    if tokens.shape != [batch, seq] {
        return Err(shape_error(1, tokens, format!("[{batch}, {seq}], the batch and seq of operand 0")));
    }
    let ids = indices(1, tokens)?;
    let mut targets = Vec::with_capacity(batch * (seq - 1));
    for b in 0..batch {
        for t in 0..seq - 1 {
            let token = ids[b * seq + t + 1];
            if token >= vocab {
                return Err(OpError::TokenOutOfRange { index: vec![b, t + 1], token, vocab });
            }
            targets.push(token);
        }
    }
    Ok((batch, seq, vocab, targets))
}

/// The softmax of one row of logits, in f64.
fn softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exponentials: Vec<f64> = row.iter().map(|&logit| f64::from(logit - max).exp()).collect();
    let total: f64 = exponentials.iter().sum();
    exponentials.into_iter().map(|exponential| exponential / total).collect()
}

/// `(logits[batch, seq, vocab], tokens[batch, seq]) -> []`: the mean next-token cross-entropy.
pub(crate) fn cross_entropy(logits: &Tensor, tokens: &Tensor) -> Result<Tensor, OpError> {
    let (batch, seq, vocab, targets) = next_token_targets(logits, tokens)?;
    let mut total = 0.0_f64;
    for b in 0..batch {
        for t in 0..seq - 1 {
            let start = (b * seq + t) * vocab;
            let row = &logits.data[start..start + vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&logit| f64::from(logit - max).exp()).sum();
            let log_sum_exp = f64::from(max) + sum.ln();
            total += log_sum_exp - f64::from(row[targets[b * (seq - 1) + t]]);
        }
    }
    let terms = (batch * (seq - 1)) as f64;
    Ok(Tensor { shape: vec![], data: vec![(total / terms) as f32] })
}

/// `(logits, tokens) -> [batch, seq, vocab]`: `(softmax - onehot(next token)) / terms`, zero at the
/// last position of each row.
pub(crate) fn cross_entropy_grad(logits: &Tensor, tokens: &Tensor) -> Result<Tensor, OpError> {
    let (batch, seq, vocab, targets) = next_token_targets(logits, tokens)?;
    let terms = (batch * (seq - 1)) as f64;
    let mut data = vec![0.0_f32; logits.data.len()];
    for b in 0..batch {
        for t in 0..seq - 1 {
            let start = (b * seq + t) * vocab;
            let probabilities = softmax(&logits.data[start..start + vocab]);
            let target = targets[b * (seq - 1) + t];
            for (index, (slot, probability)) in data[start..start + vocab].iter_mut().zip(probabilities).enumerate() {
                let one_hot = if index == target { 1.0 } else { 0.0 };
                *slot = ((probability - one_hot) / terms) as f32;
            }
        }
    }
    Ok(Tensor { shape: logits.shape.clone(), data })
}

/// `(dy[F.., G..], w[G.., C..]) -> [F.., C..]`: `dx[f, c] = sum_g dy[f, g] * w[g, c]`.
pub(crate) fn matmul_grad_input(dy: &Tensor, w: &Tensor, contract: usize) -> Result<Tensor, OpError> {
    if w.rank() < contract {
        return Err(shape_error(1, w, format!("at least {contract} dims to contract")));
    }
    let (w_free, w_contracted) = w.shape.split_at(w.rank() - contract);
    if dy.rank() < w_free.len() || dy.shape[dy.rank() - w_free.len()..] != *w_free {
        return Err(shape_error(0, dy, format!("[.., {w_free:?}]: ending in operand 1's leading dims")));
    }
    let dy_free = &dy.shape[..dy.rank() - w_free.len()];
    let (rows, columns, inner) = (element_count(dy_free), element_count(w_free), element_count(w_contracted));
    let mut data = vec![0.0_f32; rows * inner];
    let mut sums = vec![0.0_f64; inner];
    for row in 0..rows {
        sums.iter_mut().for_each(|sum| *sum = 0.0);
        for column in 0..columns {
            let gradient = f64::from(dy.data[row * columns + column]);
            for (sum, &weight) in sums.iter_mut().zip(&w.data[column * inner..(column + 1) * inner]) {
                *sum += gradient * f64::from(weight);
            }
        }
        for (slot, &sum) in data[row * inner..(row + 1) * inner].iter_mut().zip(&sums) {
            *slot = sum as f32;
        }
    }
    Ok(Tensor { shape: [dy_free, w_contracted].concat(), data })
}

/// `(dy[F.., G..], x[F.., C..]) -> [G.., C..]`: `dw[g, c] = sum_f dy[f, g] * x[f, c]`.
pub(crate) fn matmul_grad_weight(dy: &Tensor, x: &Tensor, contract: usize) -> Result<Tensor, OpError> {
    if x.rank() < contract {
        return Err(shape_error(1, x, format!("at least {contract} dims to contract")));
    }
    let (x_free, x_contracted) = x.shape.split_at(x.rank() - contract);
    if dy.rank() < x_free.len() || dy.shape[..x_free.len()] != *x_free {
        return Err(shape_error(0, dy, format!("[{x_free:?}, ..]: starting with operand 1's leading dims")));
    }
    let dy_free = &dy.shape[x_free.len()..];
    let (rows, columns, inner) = (element_count(x_free), element_count(dy_free), element_count(x_contracted));
    let mut sums = vec![0.0_f64; columns * inner];
    for row in 0..rows {
        let x_row = &x.data[row * inner..(row + 1) * inner];
        for column in 0..columns {
            let gradient = f64::from(dy.data[row * columns + column]);
            for (sum, &input) in sums[column * inner..(column + 1) * inner].iter_mut().zip(x_row) {
                *sum += gradient * f64::from(input);
            }
        }
    }
    Ok(Tensor { shape: [dy_free, x_contracted].concat(), data: sums.into_iter().map(|sum| sum as f32).collect() })
}

/// Checks `x[.., hidden]` and a same-shaped `dy` (operand `dy_operand`); returns `hidden` and the rows.
fn rows_of(x: &Tensor, dy: &Tensor, dy_operand: usize) -> Result<(usize, usize), OpError> {
    let Some(&hidden) = x.shape.last() else {
        return Err(shape_error(0, x, "[.., hidden] with at least one dim"));
    };
    if dy.shape != x.shape {
        return Err(shape_error(dy_operand, dy, format!("{:?}, the shape of operand 0", x.shape)));
    }
    Ok((hidden, element_count(&x.shape[..x.rank() - 1])))
}

/// `1 / sqrt(mean(row^2) + eps)` in f64.
fn inverse_rms(row: &[f32], eps: f64) -> f64 {
    let mean_square = row.iter().map(|&value| f64::from(value) * f64::from(value)).sum::<f64>() / row.len() as f64;
    1.0 / (mean_square + eps).sqrt()
}

/// `(x[.., hidden], weight[hidden], dy[.., hidden]) -> [.., hidden]`: per row, with
/// `r = rsqrt(mean(x^2) + eps)` and `g = dy * weight`, `dx = r * g - x * r^3 * mean(g * x)`.
pub(crate) fn rms_norm_grad_input(x: &Tensor, weight: &Tensor, dy: &Tensor, eps: f64) -> Result<Tensor, OpError> {
    let (hidden, rows) = rows_of(x, dy, 2)?;
    if weight.shape != [hidden] {
        return Err(shape_error(1, weight, format!("[hidden] with hidden = {hidden}, the last dim of operand 0")));
    }
    let mut data = Vec::with_capacity(x.data.len());
    for row in 0..rows {
        let values = &x.data[row * hidden..(row + 1) * hidden];
        let gradients = &dy.data[row * hidden..(row + 1) * hidden];
        let r = inverse_rms(values, eps);
        let scaled: Vec<f64> = gradients.iter().zip(&weight.data).map(|(&g, &w)| f64::from(g) * f64::from(w)).collect();
        let mean_gx = scaled.iter().zip(values).map(|(&g, &x)| g * f64::from(x)).sum::<f64>() / hidden as f64;
        data.extend(scaled.iter().zip(values).map(|(&g, &x)| (r * g - f64::from(x) * r * r * r * mean_gx) as f32));
    }
    Ok(Tensor { shape: x.shape.clone(), data })
}

/// `(x[.., hidden], dy[.., hidden]) -> [hidden]`: `dweight = sum over rows of dy * x * r`.
pub(crate) fn rms_norm_grad_weight(x: &Tensor, dy: &Tensor, eps: f64) -> Result<Tensor, OpError> {
    let (hidden, rows) = rows_of(x, dy, 1)?;
    let mut sums = vec![0.0_f64; hidden];
    for row in 0..rows {
        let values = &x.data[row * hidden..(row + 1) * hidden];
        let r = inverse_rms(values, eps);
        for ((sum, &g), &x) in sums.iter_mut().zip(&dy.data[row * hidden..(row + 1) * hidden]).zip(values) {
            *sum += f64::from(g) * f64::from(x) * r;
        }
    }
    Ok(Tensor { shape: vec![hidden], data: sums.into_iter().map(|sum| sum as f32).collect() })
}

/// Negates the second half of every head: the reflection `R` with `R · rot(a) · R = rot(-a)`.
fn negate_second_halves(x: &Tensor) -> Tensor {
    let head_dim = x.shape.last().copied().unwrap_or(0);
    let half = head_dim / 2;
    let data = x.data.iter().enumerate().map(|(flat, &value)| if flat % head_dim >= half { -value } else { value });
    Tensor { shape: x.shape.clone(), data: data.collect() }
}

/// `(dy, positions) -> dx`: rotary embedding's transpose, the rotation by the opposite angles,
/// computed as `R · rope(R · dy)` with the (exact) reflection `R` that negates each second half.
pub(crate) fn rope_grad(dy: &Tensor, positions: &Tensor, config: &RopeConfig) -> Result<Tensor, OpError> {
    if dy.rank() != 4 || dy.shape[3] % 2 != 0 {
        return Err(shape_error(0, dy, "[batch, seq, heads, head_dim] with an even head_dim"));
    }
    Ok(negate_second_halves(&rope(&negate_second_halves(dy), positions, config)?))
}

/// `(gate, up, dy) -> dy * up * silu'(gate)` with `silu'(g) = s * (1 + g * (1 - s))`, `s = sigmoid(g)`.
pub(crate) fn silu_mul_grad_gate(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<Tensor, OpError> {
    for (operand, tensor) in [(1, up), (2, dy)] {
        if tensor.shape != gate.shape {
            return Err(shape_error(operand, tensor, format!("{:?}, the shape of operand 0", gate.shape)));
        }
    }
    let data = gate
        .data
        .iter()
        .zip(&up.data)
        .zip(&dy.data)
        .map(|((&gate, &up), &dy)| {
            let gate = f64::from(gate);
            let sigmoid = 1.0 / (1.0 + (-gate).exp());
            let derivative = sigmoid * (1.0 + gate * (1.0 - sigmoid));
            (f64::from(dy) * f64::from(up) * derivative) as f32
        })
        .collect();
    Ok(Tensor { shape: gate.shape.clone(), data })
}

/// `(dy[.., hidden], tokens[..]) -> [vocab, hidden]`: row `v` sums `dy` over the tokens equal to `v`.
pub(crate) fn embedding_grad(dy: &Tensor, tokens: &Tensor, vocab: usize) -> Result<Tensor, OpError> {
    let Some((&hidden, leading)) = dy.shape.split_last() else {
        return Err(shape_error(0, dy, "[.., hidden] with at least one dim"));
    };
    if leading != tokens.shape.as_slice() {
        return Err(shape_error(1, tokens, format!("{leading:?}, the leading dims of operand 0")));
    }
    let ids = indices(1, tokens)?;
    let mut sums = vec![0.0_f64; vocab * hidden];
    for (flat, &token) in ids.iter().enumerate() {
        if token >= vocab {
            return Err(OpError::TokenOutOfRange { index: tokens.unravel(flat), token, vocab });
        }
        for (sum, &gradient) in sums[token * hidden..(token + 1) * hidden].iter_mut().zip(&dy.data[flat * hidden..]) {
            *sum += f64::from(gradient);
        }
    }
    Ok(Tensor { shape: vec![vocab, hidden], data: sums.into_iter().map(|sum| sum as f32).collect() })
}

/// `x[L.., T..] -> [T..]`: the sum over every dim but the trailing `keep`.
pub(crate) fn sum_leading(x: &Tensor, keep: usize) -> Result<Tensor, OpError> {
    if keep > x.rank() {
        return Err(shape_error(0, x, format!("at least {keep} dims to keep")));
    }
    let kept = &x.shape[x.rank() - keep..];
    let width = element_count(kept);
    let mut sums = vec![0.0_f64; width];
    for (flat, &value) in x.data.iter().enumerate() {
        sums[flat % width.max(1)] += f64::from(value);
    }
    Ok(Tensor { shape: kept.to_vec(), data: sums.into_iter().map(|sum| sum as f32).collect() })
}
