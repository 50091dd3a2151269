//! The mixture-of-experts MLP on one rank: routing, then one grouped GEMM chain an expert.
//!
//! Every row is routed with the whole router (softmax over all experts, top-k, optional
//! renormalization); the rows sent to each expert this rank holds are gathered into one block, run
//! through that expert's gated MLP as three GEMMs, and scattered back weighted by their
//! probabilities. Experts held elsewhere (expert parallelism) or ffn channels held elsewhere (expert
//! tensor parallelism) contribute on their own ranks: this rank's result is its summand.
//!
//! The backward kernel recomputes the same blocks and returns one operand's gradient.

use super::elementwise::silu_mul;
use super::grad::{matmul_grad_input, matmul_grad_weight};
use super::matmul::matmul_nt;
use super::row_grad::silu_mul_grad_gate;

/// The local sizes of a mixture-of-experts kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeShape {
    /// Rows (tokens) of `x`.
    pub rows: usize,
    /// Width of `x` and of each expert's output.
    pub hidden: usize,
    /// Every expert of the layer (the router's rows).
    pub experts: usize,
    /// The experts this rank holds.
    pub local_experts: usize,
    /// The global index of the first of them.
    pub expert_offset: usize,
    /// The ffn channels of each expert this rank holds.
    pub ffn: usize,
    /// Experts a row is sent to.
    pub top_k: usize,
    /// Whether the chosen probabilities are renormalized to sum to one.
    pub normalize: bool,
}

/// The operand a backward kernel differentiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeGradOperand {
    /// `x`.
    Input,
    /// The router.
    Router,
    /// The experts' gate projections.
    Gate,
    /// The experts' up projections.
    Up,
    /// The experts' down projections.
    Down,
}

/// Every row's routing: softmax probabilities, and its chosen experts with their weights.
struct Routing {
    probabilities: Vec<f32>,
    chosen: Vec<usize>,
    weights: Vec<f32>,
    divisors: Vec<f32>,
}

fn route(shape: &MoeShape, x: &[f32], router: &[f32]) -> Routing {
    let (rows, experts, top_k) = (shape.rows, shape.experts, shape.top_k);
    let mut probabilities = vec![0.0f32; rows * experts];
    matmul_nt(rows, experts, shape.hidden, x, router, &mut probabilities, false, 1);
    let (mut chosen, mut weights, mut divisors) = (Vec::with_capacity(rows * top_k), Vec::new(), Vec::new());
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in probabilities.chunks_exact_mut(experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f32;
        for value in row.iter_mut() {
            *value = (*value - max).exp();
            total += *value;
        }
        row.iter_mut().for_each(|value| *value /= total);
        order.clear();
        order.extend(0..experts);
        // Stable: equal probabilities keep the lower index first, as the reference does.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let picked = &order[..top_k];
        let divisor = if shape.normalize { picked.iter().map(|&expert| row[expert]).sum() } else { 1.0 };
        chosen.extend_from_slice(picked);
        weights.extend(picked.iter().map(|&expert| row[expert] / divisor));
        divisors.push(divisor);
    }
    Routing { probabilities, chosen, weights, divisors }
}

/// The rows one local expert receives, with the slot (`row * top_k + k`) each came from.
fn expert_slots(shape: &MoeShape, routing: &Routing, local: usize) -> Vec<usize> {
    let expert = shape.expert_offset + local;
    (0..routing.chosen.len()).filter(|&slot| routing.chosen[slot] == expert).collect()
}

/// One local expert's recomputed block: its rows of `x`, the gate and up projections, and
/// `silu(gate) * up`.
struct ExpertBlock {
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    inner: Vec<f32>,
}

fn expert_block(shape: &MoeShape, slots: &[usize], local: usize, operands: [&[f32]; 4]) -> ExpertBlock {
    let [x, gate_w, up_w, _] = operands;
    let (hidden, ffn, count) = (shape.hidden, shape.ffn, slots.len());
    let mut block = Vec::with_capacity(count * hidden);
    for &slot in slots {
        let row = slot / shape.top_k;
        block.extend_from_slice(&x[row * hidden..(row + 1) * hidden]);
    }
    let expert = local * ffn * hidden..(local + 1) * ffn * hidden;
    let (mut gate, mut up, mut inner) = (vec![0.0; count * ffn], vec![0.0; count * ffn], vec![0.0; count * ffn]);
    matmul_nt(count, ffn, hidden, &block, &gate_w[expert.clone()], &mut gate, false, 1);
    matmul_nt(count, ffn, hidden, &block, &up_w[expert], &mut up, false, 1);
    silu_mul(&gate, &up, &mut inner);
    ExpertBlock { x: block, gate, up, inner }
}

fn down_weights<'a>(shape: &MoeShape, down: &'a [f32], local: usize) -> &'a [f32] {
    let size = shape.hidden * shape.ffn;
    &down[local * size..(local + 1) * size]
}

/// `out[rows, hidden]`: this rank's summand of the mixture for every row. Operands: `x[rows, hidden]`,
/// `router[experts, hidden]`, `gate` and `up` `[local_experts, ffn, hidden]`, `down[local_experts,
/// hidden, ffn]`.
pub fn moe_mlp(shape: &MoeShape, operands: [&[f32]; 5], out: &mut [f32]) {
    let [x, router, gate, up, down] = operands;
    let routing = route(shape, x, router);
    out.fill(0.0);
    let hidden = shape.hidden;
    for local in 0..shape.local_experts {
        let slots = expert_slots(shape, &routing, local);
        if slots.is_empty() {
            continue;
        }
        let block = expert_block(shape, &slots, local, [x, gate, up, down]);
        let mut result = vec![0.0; slots.len() * hidden];
        matmul_nt(
            slots.len(),
            hidden,
            shape.ffn,
            &block.inner,
            down_weights(shape, down, local),
            &mut result,
            false,
            1,
        );
        for (index, &slot) in slots.iter().enumerate() {
            let row = slot / shape.top_k;
            let weight = routing.weights[slot];
            for (total, &value) in out[row * hidden..(row + 1) * hidden].iter_mut().zip(&result[index * hidden..]) {
                *total += weight * value;
            }
        }
    }
}

/// This rank's summand of the gradient of `moe_mlp` with respect to `wrt`, given `dy[rows,
/// hidden]`; `out` has that operand's local size.
pub fn moe_mlp_grad(shape: &MoeShape, operands: [&[f32]; 5], dy: &[f32], wrt: MoeGradOperand, out: &mut [f32]) {
    let [x, router, gate, up, down] = operands;
    let routing = route(shape, x, router);
    let (hidden, ffn) = (shape.hidden, shape.ffn);
    out.fill(0.0);
    // d loss / d (chosen weight) of every slot this rank's experts serve (zero elsewhere).
    let mut weight_grads = vec![0.0f32; routing.chosen.len()];
    for local in 0..shape.local_experts {
        let slots = expert_slots(shape, &routing, local);
        if slots.is_empty() {
            continue;
        }
        let count = slots.len();
        let block = expert_block(shape, &slots, local, [x, gate, up, down]);
        let down_w = down_weights(shape, down, local);
        let mut d_out = Vec::with_capacity(count * hidden);
        for &slot in &slots {
            let row = slot / shape.top_k;
            d_out.extend(dy[row * hidden..(row + 1) * hidden].iter().map(|&value| value * routing.weights[slot]));
        }
        if matches!(wrt, MoeGradOperand::Input | MoeGradOperand::Router) {
            let mut result = vec![0.0; count * hidden];
            matmul_nt(count, hidden, ffn, &block.inner, down_w, &mut result, false, 1);
            for (index, &slot) in slots.iter().enumerate() {
                let row = slot / shape.top_k;
                let dy_row = &dy[row * hidden..(row + 1) * hidden];
                weight_grads[slot] = dy_row.iter().zip(&result[index * hidden..]).map(|(a, b)| a * b).sum();
            }
        }
        let expert_size = ffn * hidden;
        let expert_range = local * expert_size..(local + 1) * expert_size;
        if wrt == MoeGradOperand::Down {
            matmul_grad_weight(count, hidden, ffn, &d_out, &block.inner, &mut out[expert_range], 1);
            continue;
        }
        if wrt == MoeGradOperand::Router {
            continue;
        }
        let mut d_inner = vec![0.0; count * ffn];
        matmul_grad_input(count, hidden, ffn, &d_out, down_w, &mut d_inner, 1);
        let (mut d_gate, mut d_up) = (vec![0.0; count * ffn], vec![0.0; count * ffn]);
        silu_mul_grad_gate(&block.gate, &block.up, &d_inner, &mut d_gate);
        silu_mul(&block.gate, &d_inner, &mut d_up);
        match wrt {
            MoeGradOperand::Gate => {
                matmul_grad_weight(count, ffn, hidden, &d_gate, &block.x, &mut out[expert_range], 1)
            }
            MoeGradOperand::Up => matmul_grad_weight(count, ffn, hidden, &d_up, &block.x, &mut out[expert_range], 1),
            _ => {
                let (mut through_gate, mut through_up) = (vec![0.0; count * hidden], vec![0.0; count * hidden]);
                matmul_grad_input(count, ffn, hidden, &d_gate, &gate[expert_range.clone()], &mut through_gate, 1);
                matmul_grad_input(count, ffn, hidden, &d_up, &up[expert_range], &mut through_up, 1);
                for (index, &slot) in slots.iter().enumerate() {
                    let row = slot / shape.top_k;
                    let span = index * hidden..(index + 1) * hidden;
                    for ((total, a), b) in out[row * hidden..(row + 1) * hidden]
                        .iter_mut()
                        .zip(&through_gate[span.clone()])
                        .zip(&through_up[span])
                    {
                        *total += a + b;
                    }
                }
            }
        }
    }
    if !matches!(wrt, MoeGradOperand::Input | MoeGradOperand::Router) {
        return;
    }
    let d_logits = logit_gradients(shape, &routing, &weight_grads);
    match wrt {
        // d router[experts, hidden] = d_logitsᵀ · x.
        MoeGradOperand::Router => matmul_grad_weight(shape.rows, shape.experts, hidden, &d_logits, x, out, 1),
        _ => {
            let mut through_router = vec![0.0; shape.rows * hidden];
            matmul_grad_input(shape.rows, shape.experts, hidden, &d_logits, router, &mut through_router, 1);
            out.iter_mut().zip(&through_router).for_each(|(total, value)| *total += value);
        }
    }
}

/// `[rows, experts]`: each row's gradient with respect to its router logits, back through the
/// renormalization and the softmax.
fn logit_gradients(shape: &MoeShape, routing: &Routing, weight_grads: &[f32]) -> Vec<f32> {
    let (experts, top_k) = (shape.experts, shape.top_k);
    let mut d_logits = vec![0.0f32; shape.rows * experts];
    let mut d_probabilities = vec![0.0f32; experts];
    for row in 0..shape.rows {
        let slots = row * top_k..(row + 1) * top_k;
        let mean: f32 = match shape.normalize {
            true => slots.clone().map(|slot| routing.weights[slot] * weight_grads[slot]).sum(),
            false => 0.0,
        };
        d_probabilities.fill(0.0);
        for slot in slots {
            d_probabilities[routing.chosen[slot]] = (weight_grads[slot] - mean) / routing.divisors[row];
        }
        let probabilities = &routing.probabilities[row * experts..(row + 1) * experts];
        let inner: f32 = probabilities.iter().zip(&d_probabilities).map(|(p, d)| p * d).sum();
        for ((d_logit, p), d) in d_logits[row * experts..].iter_mut().zip(probabilities).zip(&d_probabilities) {
            *d_logit = p * (d - inner);
        }
    }
    d_logits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::values;

    /// The whole mixture computed by a rank holding every expert equals the sum of two ranks' halves
    /// (expert parallelism) and of two ranks' ffn halves (expert tensor parallelism), and a row's
    /// output is its top-2 experts' outputs weighted by renormalized probabilities, by hand.
    #[test]
    fn halves_of_experts_and_ffn_sum_to_the_whole() {
        let shape = MoeShape {
            rows: 5,
            hidden: 4,
            experts: 4,
            local_experts: 4,
            expert_offset: 0,
            ffn: 6,
            top_k: 2,
            normalize: true,
        };
        let x = values(20, 1);
        let router: Vec<f32> = values(16, 2).iter().map(|value| value * 3.0).collect();
        let (gate, up, down) = (values(96, 3), values(96, 4), values(96, 5));
        let mut whole = vec![0.0; 20];
        moe_mlp(&shape, [&x, &router, &gate, &up, &down], &mut whole);
        let mut by_experts = vec![0.0f32; 20];
        for half in 0..2 {
            let local = MoeShape { local_experts: 2, expert_offset: 2 * half, ..shape };
            let range = half * 48..(half + 1) * 48;
            let mut part = vec![0.0; 20];
            moe_mlp(&local, [&x, &router, &gate[range.clone()], &up[range.clone()], &down[range]], &mut part);
            by_experts.iter_mut().zip(&part).for_each(|(total, value)| *total += value);
        }
        let mut by_ffn = vec![0.0f32; 20];
        for half in 0..2 {
            let local = MoeShape { ffn: 3, ..shape };
            // Each expert's channels half*3..half*3+3 of gate/up ([ffn, hidden] rows) and of down's columns.
            let rows = |w: &[f32]| -> Vec<f32> {
                (0..4).flat_map(|e| w[e * 24 + half * 12..e * 24 + half * 12 + 12].to_vec()).collect()
            };
            let columns: Vec<f32> = (0..4)
                .flat_map(|e| (0..4).flat_map(move |o| (0..3).map(move |c| (e, o, c))))
                .map(|(e, o, c)| down[e * 24 + o * 6 + half * 3 + c])
                .collect();
            let mut part = vec![0.0; 20];
            moe_mlp(&local, [&x, &router, &rows(&gate), &rows(&up), &columns], &mut part);
            by_ffn.iter_mut().zip(&part).for_each(|(total, value)| *total += value);
        }
        for ((a, b), c) in whole.iter().zip(&by_experts).zip(&by_ffn) {
            assert!((a - b).abs() < 1e-5 && (a - c).abs() < 1e-5, "{a} {b} {c}");
        }
        // Row 0 by hand.
        let logits: Vec<f64> =
            (0..4).map(|e| (0..4).map(|i| f64::from(x[i]) * f64::from(router[e * 4 + i])).sum()).collect();
        let mut order: Vec<usize> = (0..4).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let total: f64 = order[..2].iter().map(|&e| logits[e].exp()).sum();
        let silu = |value: f64| value / (1.0 + (-value).exp());
        let mut expected = [0.0f64; 4];
        for &e in &order[..2] {
            let inner: Vec<f64> = (0..6)
                .map(|c| {
                    let dot =
                        |w: &[f32]| (0..4).map(|i| f64::from(x[i]) * f64::from(w[e * 24 + c * 4 + i])).sum::<f64>();
                    silu(dot(&gate)) * dot(&up)
                })
                .collect();
            for (o, value) in expected.iter_mut().enumerate() {
                let projected: f64 = (0..6).map(|c| f64::from(down[e * 24 + o * 6 + c]) * inner[c]).sum();
                *value += logits[e].exp() / total * projected;
            }
        }
        for (o, value) in expected.iter().enumerate() {
            assert!((f64::from(whole[o]) - value).abs() < 1e-5, "channel {o}: {} vs {value}", whole[o]);
        }
    }
}
