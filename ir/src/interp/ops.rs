//! The compute ops as plain functions of their operand tensors.
//!
//! `eval` is the op table: it checks arity and tensor consistency, then calls one function per op.
//! Each function checks its operands' shapes and returns an `OpError` instead of panicking. The
//! functions see only tensors, never the graph, so a multi-rank simulation can call them on each
//! rank's local blocks. Elements are f32 as in Hugging Face's f32 forward pass; sums (dot products,
//! mean squares) accumulate in f64 and round once, so the oracle's own rounding error is far below
//! any test tolerance and does not depend on loop order.

use super::attention::attention;
use super::attention_grad::{attention_grad, AttentionOperand};
use super::error::OpError;
use super::grad;
use super::moe;
use super::rope::rope;
use super::tensor::{element_count, exact_index, unravel, Tensor};
use crate::{MlpOperand, Op};

/// Applies compute op `op` to `operands`. Ops that read the run's inputs, parameters or other
/// ranks (`Tokens`, `Positions`, `Param`, communication) are `OpError::NotLocal`.
pub fn eval(op: &Op, operands: &[&Tensor]) -> Result<Tensor, OpError> {
    if operands.len() != op.arity() {
        return Err(OpError::Arity { expected: op.arity(), got: operands.len() });
    }
    for (operand, tensor) in operands.iter().enumerate() {
        if !tensor.is_consistent() {
            return Err(OpError::Inconsistent { operand, shape: tensor.shape.clone(), len: tensor.data.len() });
        }
    }
    match op {
        Op::Embedding => embedding(operands[0], operands[1]),
        Op::RmsNorm { eps } => rms_norm(operands[0], operands[1], *eps),
        Op::MatMul { contract } => matmul(operands[0], operands[1], usize::from(*contract)),
        Op::Rope { rope: config } => rope(operands[0], operands[1], config),
        Op::Attention { causal } => attention(operands[0], operands[1], operands[2], operands[3], operands[4], *causal),
        // On one rank the ring has one step: the local blocks are the whole sequence.
        Op::RingAttention { causal, .. } => {
            attention(operands[0], operands[1], operands[2], operands[3], operands[4], *causal)
        }
        Op::SiluMul => silu_mul(operands[0], operands[1]),
        Op::SigmoidScale => sigmoid_scale(operands[0], operands[1]),
        Op::SigmoidScaleGradGate => sigmoid_scale_grad_gate(operands[0], operands[1], operands[2]),
        Op::Add => add(operands[0], operands[1]),
        Op::Sum { .. } => sum(operands),
        Op::RingGatedMlp { .. } => gated_mlp(operands[0], operands[1], operands[2], operands[3]),
        Op::RingGatedMlpGrad { wrt, .. } => gated_mlp_grad(operands, *wrt),
        // The dispatch moves rows between ranks; on one rank it is the plain mixture.
        Op::MoeMlp { top_k, normalize, .. } => moe::moe_mlp(operands, *top_k, *normalize),
        Op::ExpertCounts { top_k, scale } => moe::expert_counts(operands[0], operands[1], *top_k, *scale),
        Op::RouterProbSum => moe::router_prob_sum(operands[0], operands[1]),
        Op::RouterProbSumGrad { wrt } => moe::router_prob_sum_grad(operands[0], operands[1], operands[2], *wrt),
        Op::LoadBalancingLoss => moe::load_balancing_loss(operands[0], operands[1]),
        Op::MoeMlpGrad { top_k, normalize, wrt, .. } => moe::moe_mlp_grad(operands, *top_k, *normalize, *wrt),
        Op::CrossEntropy | Op::VocabParallelCrossEntropy { .. } => grad::cross_entropy(operands[0], operands[1]),
        Op::CrossEntropyGrad | Op::VocabParallelCrossEntropyGrad { .. } => {
            grad::cross_entropy_grad(operands[0], operands[1])
        }
        Op::MatMulGradInput { contract } => grad::matmul_grad_input(operands[0], operands[1], usize::from(*contract)),
        Op::MatMulGradWeight { contract } => grad::matmul_grad_weight(operands[0], operands[1], usize::from(*contract)),
        Op::RmsNormGradInput { eps } => grad::rms_norm_grad_input(operands[0], operands[1], operands[2], *eps),
        Op::RmsNormGradInputAdd { eps } => {
            let gradient = grad::rms_norm_grad_input(operands[0], operands[1], operands[2], *eps)?;
            if operands[3].shape != gradient.shape {
                return Err(shape_error(3, operands[3], format!("{:?}, the shape of operand 0", gradient.shape)));
            }
            add(operands[3], &gradient)
        }
        Op::RmsNormGradWeight { eps } => grad::rms_norm_grad_weight(operands[0], operands[1], *eps),
        Op::RopeGrad { rope: config } => grad::rope_grad(operands[0], operands[1], config),
        Op::AttentionGradQuery { causal } => attention_grad(six(operands), *causal, AttentionOperand::Query),
        Op::AttentionGradKey { causal } => attention_grad(six(operands), *causal, AttentionOperand::Key),
        Op::AttentionGradValue { causal } => attention_grad(six(operands), *causal, AttentionOperand::Value),
        Op::SiluMulGradGate => grad::silu_mul_grad_gate(operands[0], operands[1], operands[2]),
        Op::EmbeddingGrad { vocab } => {
            let vocab = usize::try_from(*vocab).map_err(|_| shape_error(0, operands[0], "a vocab that fits memory"))?;
            grad::embedding_grad(operands[0], operands[1], vocab)
        }
        Op::SumLeading { keep } => grad::sum_leading(operands[0], usize::from(*keep)),
        // The driver permutes, since which dim is `seq` is in the graph's types, not the tensors.
        Op::Zigzag { .. } => Err(OpError::NotLocal),
        Op::Tokens
        | Op::Positions
        | Op::Param { .. }
        | Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::LocalSlice { .. }
        | Op::BroadcastShard { .. }
        | Op::ReduceToRoot { .. }
        | Op::AllToAll { .. } => Err(OpError::NotLocal),
    }
}

/// The six operands of an attention gradient (the arity was checked).
fn six<'a>(operands: &[&'a Tensor]) -> [&'a Tensor; 6] {
    [operands[0], operands[1], operands[2], operands[3], operands[4], operands[5]]
}

/// An `OperandShape` error for `tensor` as operand `operand`.
pub(crate) fn shape_error(operand: usize, tensor: &Tensor, expected: impl Into<String>) -> OpError {
    OpError::OperandShape { operand, shape: tensor.shape.clone(), expected: expected.into() }
}

/// Reads every element of `tensor` (operand `operand`) as an index: token ids, positions.
pub(crate) fn indices(operand: usize, tensor: &Tensor) -> Result<Vec<usize>, OpError> {
    tensor
        .data
        .iter()
        .enumerate()
        .map(|(flat, &value)| {
            exact_index(value).ok_or_else(|| OpError::NotAnIndex { operand, index: tensor.unravel(flat), value })
        })
        .collect()
}

/// The dot product of two equal-length slices, accumulated in f64 and rounded once.
pub(crate) fn dot(left: &[f32], right: &[f32]) -> f32 {
    left.iter().zip(right).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32
}

/// `(table[vocab, hidden], tokens[..]) -> [.., hidden]`: row `tokens[i]` of the table for each token.
fn embedding(table: &Tensor, tokens: &Tensor) -> Result<Tensor, OpError> {
    let &[vocab, hidden] = table.shape.as_slice() else {
        return Err(shape_error(0, table, "[vocab, hidden]"));
    };
    let ids = indices(1, tokens)?;
    let mut data = Vec::with_capacity(ids.len() * hidden);
    for (flat, &token) in ids.iter().enumerate() {
        if token >= vocab {
            return Err(OpError::TokenOutOfRange { index: unravel(&tokens.shape, flat), token, vocab });
        }
        data.extend_from_slice(&table.data[token * hidden..(token + 1) * hidden]);
    }
    let mut shape = tokens.shape.clone();
    shape.push(hidden);
    Ok(Tensor { shape, data })
}

/// `(x[.., hidden], weight[hidden]) -> weight * (x * rsqrt(mean(x^2) + eps))` over the last dim, in
/// the order Hugging Face's `LlamaRMSNorm` multiplies (eps is added in f32, as torch adds a Python
/// float to an f32 tensor).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor, OpError> {
    let Some((&hidden, leading)) = x.shape.split_last() else {
        return Err(shape_error(0, x, "[.., hidden] with at least one dim"));
    };
    if weight.shape != [hidden] {
        return Err(shape_error(1, weight, format!("[hidden] with hidden = {hidden}, the last dim of operand 0")));
    }
    let rows = element_count(leading);
    let mut data = Vec::with_capacity(x.data.len());
    for row in 0..rows {
        let values = &x.data[row * hidden..(row + 1) * hidden];
        let sum_of_squares: f64 = values.iter().map(|&value| f64::from(value) * f64::from(value)).sum();
        let mean_square = (sum_of_squares / hidden as f64) as f32;
        let inverse_rms = (1.0 / f64::from(mean_square + eps as f32).sqrt()) as f32;
        data.extend(values.iter().zip(&weight.data).map(|(&value, &scale)| scale * (value * inverse_rms)));
    }
    Ok(Tensor { shape: x.shape.clone(), data })
}

/// `(x[F.., C..], w[G.., C..]) -> [F.., G..]`: for every row of `x` and row of `w` (each flattened
/// over the `contract` trailing dims), their dot product.
fn matmul(x: &Tensor, w: &Tensor, contract: usize) -> Result<Tensor, OpError> {
    if x.rank() < contract {
        return Err(shape_error(0, x, format!("at least {contract} dims to contract")));
    }
    if w.rank() < contract {
        return Err(shape_error(1, w, format!("at least {contract} dims to contract")));
    }
    let (x_free, x_contracted) = x.shape.split_at(x.rank() - contract);
    let (w_free, w_contracted) = w.shape.split_at(w.rank() - contract);
    if x_contracted != w_contracted {
        return Err(shape_error(1, w, format!("[.., {x_contracted:?}]: its last {contract} dims equal operand 0's")));
    }
    let (rows, columns, inner) = (element_count(x_free), element_count(w_free), element_count(x_contracted));
    let mut data = Vec::with_capacity(rows * columns);
    for row in 0..rows {
        let x_row = &x.data[row * inner..(row + 1) * inner];
        for column in 0..columns {
            data.push(dot(x_row, &w.data[column * inner..(column + 1) * inner]));
        }
    }
    Ok(Tensor { shape: [x_free, w_free].concat(), data })
}

/// `(gate, up) -> silu(gate) * up` elementwise, with `silu(g) = g / (1 + exp(-g))` rounded to f32
/// before the product, as torch computes `act_fn(gate) * up`.
fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor, OpError> {
    if up.shape != gate.shape {
        return Err(shape_error(1, up, format!("{:?}, the shape of operand 0", gate.shape)));
    }
    let data = gate
        .data
        .iter()
        .zip(&up.data)
        .map(|(&gate, &up)| {
            let gate = f64::from(gate);
            let silu = (gate / (1.0 + (-gate).exp())) as f32;
            silu * up
        })
        .collect();
    Ok(Tensor { shape: gate.shape.clone(), data })
}

/// The sigmoid of `value`, in f64.
fn sigmoid(value: f32) -> f64 {
    1.0 / (1.0 + (-f64::from(value)).exp())
}

/// Checks that `y` (operand 1) is `gate`'s shape plus a trailing dim; returns that dim's size.
fn gated_rows(gate: &Tensor, y: &Tensor) -> Result<usize, OpError> {
    match y.shape.split_last() {
        Some((&hidden, leading)) if leading == gate.shape.as_slice() => Ok(hidden),
        _ => Err(shape_error(1, y, format!("{:?} plus a trailing hidden dim", gate.shape))),
    }
}

/// `(gate[..], y[.., hidden]) -> sigmoid(gate) * y`, the sigmoid rounded to f32 first, as torch
/// computes `F.sigmoid(gate) * y`.
fn sigmoid_scale(gate: &Tensor, y: &Tensor) -> Result<Tensor, OpError> {
    let hidden = gated_rows(gate, y)?;
    let data = y
        .data
        .iter()
        .enumerate()
        .map(|(flat, &value)| sigmoid(gate.data[flat / hidden.max(1)]) as f32 * value)
        .collect();
    Ok(Tensor { shape: y.shape.clone(), data })
}

/// `(gate, y, dy) -> sigmoid'(gate) · sum over hidden of dy * y`, a value a row.
fn sigmoid_scale_grad_gate(gate: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Tensor, OpError> {
    let hidden = gated_rows(gate, y)?;
    if dy.shape != y.shape {
        return Err(shape_error(2, dy, format!("{:?}, the shape of operand 1", y.shape)));
    }
    let data = gate
        .data
        .iter()
        .enumerate()
        .map(|(row, &gate)| {
            let span = row * hidden..(row + 1) * hidden;
            let inner: f64 =
                y.data[span.clone()].iter().zip(&dy.data[span]).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            let s = sigmoid(gate);
            (s * (1.0 - s) * inner) as f32
        })
        .collect();
    Ok(Tensor { shape: gate.shape.clone(), data })
}

/// `(a, b) -> a + b`, where `b`'s dims are a trailing run of `a`'s (all of them, or a bias that is
/// repeated over `a`'s leading dims).
fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, OpError> {
    if b.rank() > a.rank() || a.shape[a.rank() - b.rank()..] != b.shape[..] {
        return Err(shape_error(1, b, format!("a trailing run of operand 0's dims {:?}", a.shape)));
    }
    // When `b` is empty so is `a`, and the loop never divides by its zero length.
    let data = a.data.iter().enumerate().map(|(flat, &value)| value + b.data[flat % b.data.len()]).collect();
    Ok(Tensor { shape: a.shape.clone(), data })
}

/// `a + b + c + ..` over operands of one shape, summed left to right.
fn sum(operands: &[&Tensor]) -> Result<Tensor, OpError> {
    let mut total = operands[0].clone();
    for (operand, term) in operands.iter().enumerate().skip(1) {
        if term.shape != total.shape {
            return Err(shape_error(operand, term, format!("{:?}, the shape of operand 0", total.shape)));
        }
        total = add(&total, term)?;
    }
    Ok(total)
}

/// The gated SiLU MLP on one device: `down(silu(x·gateᵀ) * (x·upᵀ))`, the meaning of the ring op.
fn gated_mlp(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor, OpError> {
    let hidden = matmul(&silu_mul(&matmul(x, gate, 1)?, &matmul(x, up, 1)?)?, down, 1)?;
    Ok(hidden)
}

/// The gradient of the gated MLP with respect to `wrt`, from its operands and `dy` (operand 4),
/// composed of the single ops' gradients (the chain rule through `gated_mlp`).
fn gated_mlp_grad(operands: &[&Tensor], wrt: MlpOperand) -> Result<Tensor, OpError> {
    let [x, gate, up, down, dy] = [operands[0], operands[1], operands[2], operands[3], operands[4]];
    if dy.shape != x.shape {
        return Err(shape_error(4, dy, format!("{:?}, the shape of operand 0", x.shape)));
    }
    let (gated, upped) = (matmul(x, gate, 1)?, matmul(x, up, 1)?);
    if wrt == MlpOperand::Down {
        return grad::matmul_grad_weight(dy, &silu_mul(&gated, &upped)?, 1);
    }
    let d_hidden = grad::matmul_grad_input(dy, down, 1)?;
    let d_gated = grad::silu_mul_grad_gate(&gated, &upped, &d_hidden)?;
    let d_upped = silu_mul(&gated, &d_hidden)?;
    match wrt {
        MlpOperand::Gate => grad::matmul_grad_weight(&d_gated, x, 1),
        MlpOperand::Up => grad::matmul_grad_weight(&d_upped, x, 1),
        _ => add(&grad::matmul_grad_input(&d_gated, gate, 1)?, &grad::matmul_grad_input(&d_upped, up, 1)?),
    }
}

/// Reorders dim `dim` of `x` so that slot `i` holds entry `order[i]`.
pub(crate) fn permute_dim(x: &Tensor, dim: usize, order: &[u64]) -> Tensor {
    let outer: usize = x.shape[..dim].iter().product();
    let inner: usize = x.shape[dim + 1..].iter().product();
    let len = x.shape[dim];
    let mut data = Vec::with_capacity(x.data.len());
    for block in 0..outer {
        for &source in order {
            let start = (block * len + source as usize) * inner;
            data.extend_from_slice(&x.data[start..start + inner]);
        }
    }
    Tensor { shape: x.shape.clone(), data }
}

#[cfg(test)]
mod tests {
    use std::f32::consts::FRAC_1_SQRT_2;

    use super::*;
    use crate::interp::tensor::assert_close;

    fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
        Tensor::new(shape.to_vec(), data.to_vec()).expect("test tensor is consistent")
    }

    /// Runs `op` on `operands` and compares with `expected` to 1e-6 (relative).
    #[track_caller]
    fn check(op: Op, operands: &[&Tensor], expected: &Tensor) {
        let actual = eval(&op, operands).expect("op succeeds");
        assert_close(&actual, expected, 1e-6);
    }

    #[track_caller]
    fn check_error(op: Op, operands: &[&Tensor], expected: &str) {
        assert_eq!(eval(&op, operands).expect_err("op fails").to_string(), expected);
    }

    #[test]
    fn embedding_picks_rows() {
        let table = tensor(&[3, 2], &[0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        let tokens = tensor(&[2, 2], &[2.0, 0.0, 1.0, 1.0]);
        let expected = tensor(&[2, 2, 2], &[20.0, 21.0, 0.0, 1.0, 10.0, 11.0, 10.0, 11.0]);
        check(Op::Embedding, &[&table, &tokens], &expected);
    }

    #[test]
    fn embedding_names_the_position_of_a_bad_token() {
        let table = tensor(&[3, 2], &[0.0; 6]);
        check_error(
            Op::Embedding,
            &[&table, &tensor(&[2, 2], &[2.0, 0.0, 3.0, 1.0])],
            "token 3 at index [1, 0] is outside the vocabulary of 3; check that the tokenizer matches the model",
        );
        check_error(
            Op::Embedding,
            &[&table, &tensor(&[1, 2], &[0.0, 1.5])],
            "operand 1 element [0, 1] is 1.5, not an integer in 0..16777216; token ids and positions must be exact \
             non-negative integers",
        );
    }

    #[test]
    fn rms_norm_of_three_four() {
        // x = [3, 4], eps = 0: mean(x^2) = (9 + 16) / 2 = 12.5, rms = sqrt(12.5) = 3.5355339;
        // x / rms = [0.8485281, 1.1313708]; weight [1, 2] gives [0.8485281, 2.2627417].
        let x = tensor(&[1, 2], &[3.0, 4.0]);
        let weight = tensor(&[2], &[1.0, 2.0]);
        check(Op::RmsNorm { eps: 0.0 }, &[&x, &weight], &tensor(&[1, 2], &[0.848_528_1, 2.262_741_7]));
        // Rows are independent; eps = 1 on [1, 1]: mean = 1, 1 / sqrt(2) = 0.70710678.
        let x = tensor(&[2, 2], &[3.0, 4.0, 1.0, 1.0]);
        let ones = tensor(&[2], &[1.0, 1.0]);
        check(
            Op::RmsNorm { eps: 1.0 },
            &[&x, &ones],
            // Row 0 with eps 1: mean 12.5 + 1 = 13.5, sqrt = 3.6742346; [0.8164966, 1.0886621].
            &tensor(&[2, 2], &[0.816_496_6, 1.088_662_1, FRAC_1_SQRT_2, FRAC_1_SQRT_2]),
        );
        check_error(
            Op::RmsNorm { eps: 0.0 },
            &[&x, &tensor(&[3], &[1.0; 3])],
            "operand 1 has shape [3], expected [hidden] with hidden = 2, the last dim of operand 0; fix the graph's types",
        );
    }

    #[test]
    fn matmul_contracts_trailing_dims() {
        // x [2, 2] · w [3, 2]ᵀ: rows x0 = [1, 2], x1 = [3, 4]; w rows [1, 0], [0, 1], [1, 1].
        // out[0] = [1, 2, 3], out[1] = [3, 4, 7].
        let x = tensor(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let w = tensor(&[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        check(Op::MatMul { contract: 1 }, &[&x, &w], &tensor(&[2, 3], &[1.0, 2.0, 3.0, 3.0, 4.0, 7.0]));
        // Two contracted dims, as o_proj contracts [heads, head_dim]: x [1, 2, 2], w [2, 2, 2].
        // w0 = [[1, 0], [0, 0]] picks x[0][0] = 1; w1 = [[1, 1], [1, 1]] sums 1 + 2 + 3 + 4 = 10.
        let x = tensor(&[1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let w = tensor(&[2, 2, 2], &[1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        check(Op::MatMul { contract: 2 }, &[&x, &w], &tensor(&[1, 2], &[1.0, 10.0]));
        // Contracting nothing is the outer product.
        let a = tensor(&[2], &[1.0, 2.0]);
        let b = tensor(&[2], &[3.0, 5.0]);
        check(Op::MatMul { contract: 0 }, &[&a, &b], &tensor(&[2, 2], &[3.0, 5.0, 6.0, 10.0]));
        check_error(
            Op::MatMul { contract: 1 },
            &[&x, &tensor(&[2, 3], &[0.0; 6])],
            "operand 1 has shape [2, 3], expected [.., [2]]: its last 1 dims equal operand 0's; fix the graph's types",
        );
    }

    #[test]
    fn silu_mul_gates() {
        // silu(0) = 0; silu(1) = 1 / (1 + e^-1) = 0.7310586; silu(-2) = -2 / (1 + e^2) = -0.2384058.
        let gate = tensor(&[3], &[0.0, 1.0, -2.0]);
        let up = tensor(&[3], &[5.0, 2.0, 3.0]);
        check(Op::SiluMul, &[&gate, &up], &tensor(&[3], &[0.0, 1.462_117_2, -0.715_217_4]));
    }

    #[test]
    fn sum_adds_left_to_right_over_one_shape() {
        let a = tensor(&[2], &[1.0, 1e8]);
        let b = tensor(&[2], &[2.0, -1e8]);
        let c = tensor(&[2], &[3.0, 1.0]);
        // (1e8 + -1e8) + 1 = 1; a right-to-left sum would give 1e8 + (-1e8 + 1) = 0 in f32.
        check(Op::Sum { terms: 3 }, &[&a, &b, &c], &tensor(&[2], &[6.0, 1.0]));
        check_error(
            Op::Sum { terms: 3 },
            &[&a, &b, &tensor(&[1], &[0.0])],
            "operand 2 has shape [1], expected [2], the shape of operand 0; fix the graph's types",
        );
    }

    #[test]
    fn a_norm_gradient_with_its_add_is_the_two_ops() {
        let x = tensor(&[2, 2], &[1.0, -2.0, 0.5, 3.0]);
        let weight = tensor(&[2], &[0.5, 2.0]);
        let dy = tensor(&[2, 2], &[0.25, -1.0, 2.0, 1.5]);
        let acc = tensor(&[2, 2], &[10.0, 20.0, 30.0, 40.0]);
        let gradient = grad::rms_norm_grad_input(&x, &weight, &dy, 1e-5).expect("gradient");
        let expected = add(&acc, &gradient).expect("sum");
        check(Op::RmsNormGradInputAdd { eps: 1e-5 }, &[&x, &weight, &dy, &acc], &expected);
        check_error(
            Op::RmsNormGradInputAdd { eps: 1e-5 },
            &[&x, &weight, &dy, &weight],
            "operand 3 has shape [2], expected [2, 2], the shape of operand 0; fix the graph's types",
        );
    }

    #[test]
    fn add_broadcasts_a_trailing_bias() {
        let a = tensor(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        check(Op::Add, &[&a, &a], &tensor(&[2, 2], &[2.0, 4.0, 6.0, 8.0]));
        let bias = tensor(&[2], &[10.0, 20.0]);
        check(Op::Add, &[&a, &bias], &tensor(&[2, 2], &[11.0, 22.0, 13.0, 24.0]));
        check_error(
            Op::Add,
            &[&a, &tensor(&[3], &[0.0; 3])],
            "operand 1 has shape [3], expected a trailing run of operand 0's dims [2, 2]; fix the graph's types",
        );
    }

    #[test]
    fn bad_operands_are_errors() {
        let a = tensor(&[2], &[1.0, 2.0]);
        check_error(Op::Add, &[&a], "takes 2 operands, got 1; fix the node's inputs");
        let broken = Tensor { shape: vec![3], data: vec![1.0] };
        check_error(
            Op::Add,
            &[&a, &broken],
            "operand 1 has shape [3] but 1 elements; build tensors with one element per index",
        );
        check_error(
            Op::Tokens,
            &[],
            "is not a function of its operand tensors; evaluate it in the interpreter's driver",
        );
    }

    #[test]
    fn permute_dim_moves_whole_slices() {
        // A [2, 4, 1] tensor whose dim 1 is reordered by the zigzag order of 4 slots over 1 rank
        // (unchanged) and of 4 slots over 2 ranks: chunks 0, 3, 1, 2.
        let x = Tensor { shape: vec![2, 4, 1], data: vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0] };
        assert_eq!(permute_dim(&x, 1, &crate::op::zigzag_order(4, 1)).data, x.data);
        let order = crate::op::zigzag_order(4, 2);
        assert_eq!(order, vec![0, 3, 1, 2]);
        let permuted = permute_dim(&x, 1, &order);
        assert_eq!(permuted.data, vec![0.0, 3.0, 1.0, 2.0, 10.0, 13.0, 11.0, 12.0]);
        assert_eq!(permute_dim(&permuted, 1, &crate::op::inverse_order(&order)).data, x.data);
    }

    #[test]
    fn ring_gated_mlp_on_one_device_is_the_gated_mlp() {
        // x = [1, 2]; gate rows [1, 0] and [0, 1]; up rows [1, 1] and [2, 0]; down = identity.
        // x·gateᵀ = [1, 2], x·upᵀ = [3, 2]; silu(1)·3 = 2.1931757, silu(2)·2 = 3.5231884.
        let x = Tensor { shape: vec![1, 2], data: vec![1.0, 2.0] };
        let gate = Tensor { shape: vec![2, 2], data: vec![1.0, 0.0, 0.0, 1.0] };
        let up = Tensor { shape: vec![2, 2], data: vec![1.0, 1.0, 2.0, 0.0] };
        let down = Tensor { shape: vec![2, 2], data: vec![1.0, 0.0, 0.0, 1.0] };
        let expected = Tensor { shape: vec![1, 2], data: vec![2.193_175_7, 3.523_188_3] };
        check(Op::RingGatedMlp { axis: crate::AxisName::Tsp }, &[&x, &gate, &up, &down], &expected);
    }

    #[test]
    fn ring_attention_on_one_device_is_attention() {
        // One query head over two keys at positions 0 and 1; the query at position 1 sees both.
        // Scores q·k/sqrt(2): [0, 1/sqrt(2)·2] = [0, 1.4142135]; softmax weights 0.19557, 0.80443.
        let q = Tensor { shape: vec![1, 2, 1, 2], data: vec![1.0, 1.0, 1.0, 1.0] };
        let k = Tensor { shape: vec![1, 2, 1, 2], data: vec![0.0, 0.0, 1.0, 1.0] };
        let v = Tensor { shape: vec![1, 2, 1, 2], data: vec![1.0, 0.0, 0.0, 1.0] };
        let positions = Tensor { shape: vec![2], data: vec![0.0, 1.0] };
        let second = 1.0 / (1.0 + (2.0f64.sqrt()).exp());
        let expected = Tensor { shape: vec![1, 2, 1, 2], data: vec![1.0, 0.0, second as f32, (1.0 - second) as f32] };
        let op = Op::RingAttention { axis: crate::AxisName::Cp, causal: true };
        check(op.clone(), &[&q, &k, &v, &positions, &positions], &expected);
        let plain = eval(&Op::Attention { causal: true }, &[&q, &k, &v, &positions, &positions]).unwrap();
        assert_eq!(eval(&op, &[&q, &k, &v, &positions, &positions]).unwrap(), plain);
    }
}
