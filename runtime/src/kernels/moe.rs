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

/// Every row's routing: softmax probabilities, and its chosen experts with their weights. Slot
/// `row · top_k + k` is the row's `k`-th choice.
pub struct Routing {
    /// `[rows, experts]`.
    pub probabilities: Vec<f32>,
    /// The global expert of each slot.
    pub chosen: Vec<usize>,
    /// Each slot's weight in its row's sum.
    pub weights: Vec<f32>,
    /// Each row's renormalization divisor (1 without renormalization).
    pub divisors: Vec<f32>,
}

/// Routes every row of `x[rows, hidden]` with `router[experts, hidden]`.
pub fn route(shape: &MoeShape, x: &[f32], router: &[f32]) -> Routing {
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

/// The slots routed to local expert `local` (global `expert_offset + local`), in slot order.
fn expert_slots(shape: &MoeShape, routing: &Routing, local: usize) -> Vec<usize> {
    let expert = shape.expert_offset + local;
    (0..routing.chosen.len()).filter(|&slot| routing.chosen[slot] == expert).collect()
}

/// The rows of `data` (rows of `width`) that `slots` come from, back to back.
fn gather_rows(data: &[f32], width: usize, slots: &[usize], top_k: usize) -> Vec<f32> {
    let mut block = Vec::with_capacity(slots.len() * width);
    for &slot in slots {
        let row = slot / top_k;
        block.extend_from_slice(&data[row * width..(row + 1) * width]);
    }
    block
}

/// The experts' projections this rank holds: gate and up `[local_experts, ffn, hidden]`, down
/// `[local_experts, hidden, ffn]`.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// Gate projections.
    pub gate: &'a [f32],
    /// Up projections.
    pub up: &'a [f32],
    /// Down projections.
    pub down: &'a [f32],
}

impl ExpertWeights<'_> {
    fn expert(&self, shape: &MoeShape, local: usize) -> (&[f32], &[f32], &[f32]) {
        let size = shape.ffn * shape.hidden;
        let range = local * size..(local + 1) * size;
        (&self.gate[range.clone()], &self.up[range.clone()], &self.down[range])
    }
}

/// One expert's activations for a block of rows: the gate and up projections and their product.
struct Activations {
    gate: Vec<f32>,
    up: Vec<f32>,
    inner: Vec<f32>,
}

fn activations(shape: &MoeShape, x: &[f32], weights: (&[f32], &[f32])) -> Activations {
    let (count, ffn, hidden) = (x.len() / shape.hidden, shape.ffn, shape.hidden);
    let (mut gate, mut up, mut inner) = (vec![0.0; count * ffn], vec![0.0; count * ffn], vec![0.0; count * ffn]);
    matmul_nt(count, ffn, hidden, x, weights.0, &mut gate, false, 1);
    matmul_nt(count, ffn, hidden, x, weights.1, &mut up, false, 1);
    silu_mul(&gate, &up, &mut inner);
    Activations { gate, up, inner }
}

/// Local expert `local`'s output for the rows of `x` (`[count, hidden]`), unweighted.
pub fn expert_forward(shape: &MoeShape, local: usize, x: &[f32], weights: ExpertWeights<'_>) -> Vec<f32> {
    let (gate, up, down) = weights.expert(shape, local);
    let block = activations(shape, x, (gate, up));
    let count = x.len() / shape.hidden;
    let mut output = vec![0.0; count * shape.hidden];
    matmul_nt(count, shape.hidden, shape.ffn, &block.inner, down, &mut output, false, 1);
    output
}

/// What the backward of one expert on a block of rows gives back to the rows' owners.
pub struct ExpertBackward {
    /// Each row's `dy · output`: the gradient of its routing weight.
    pub weight_grads: Vec<f32>,
    /// Each row's gradient through the expert (of `weight · output`), `[count, hidden]`.
    pub input_grads: Vec<f32>,
}

/// Where an expert's parameter gradients go: its slices of the gate, up and down gradients, when
/// asked for.
#[derive(Default)]
pub struct ExpertGrads<'a> {
    /// `[ffn, hidden]`.
    pub gate: Option<&'a mut [f32]>,
    /// `[ffn, hidden]`.
    pub up: Option<&'a mut [f32]>,
    /// `[hidden, ffn]`.
    pub down: Option<&'a mut [f32]>,
}

/// The backward of local expert `local` on the rows of `x` with their output gradients `dy` and
/// routing weights: each row's routing-weight gradient and input gradient, and the expert's
/// parameter gradients (summed over the rows) into `grads`.
pub fn expert_backward(
    shape: &MoeShape,
    local: usize,
    (x, dy, row_weights): (&[f32], &[f32], &[f32]),
    weights: ExpertWeights<'_>,
    grads: ExpertGrads<'_>,
) -> ExpertBackward {
    let (hidden, ffn, count) = (shape.hidden, shape.ffn, row_weights.len());
    let (gate_w, up_w, down_w) = weights.expert(shape, local);
    let block = activations(shape, x, (gate_w, up_w));
    let mut output = vec![0.0; count * hidden];
    matmul_nt(count, hidden, ffn, &block.inner, down_w, &mut output, false, 1);
    let weight_grads = output
        .chunks_exact(hidden)
        .zip(dy.chunks_exact(hidden))
        .map(|(out, grad)| out.iter().zip(grad).map(|(a, b)| a * b).sum())
        .collect();
    let d_out: Vec<f32> = dy
        .chunks_exact(hidden)
        .zip(row_weights)
        .flat_map(|(grad, &weight)| grad.iter().map(move |g| g * weight))
        .collect();
    if let Some(down) = grads.down {
        matmul_grad_weight(count, hidden, ffn, &d_out, &block.inner, down, 1);
    }
    let mut d_inner = vec![0.0; count * ffn];
    matmul_grad_input(count, hidden, ffn, &d_out, down_w, &mut d_inner, 1);
    let (mut d_gate, mut d_up) = (vec![0.0; count * ffn], vec![0.0; count * ffn]);
    silu_mul_grad_gate(&block.gate, &block.up, &d_inner, &mut d_gate);
    silu_mul(&block.gate, &d_inner, &mut d_up);
    if let Some(gate) = grads.gate {
        matmul_grad_weight(count, ffn, hidden, &d_gate, x, gate, 1);
    }
    if let Some(up) = grads.up {
        matmul_grad_weight(count, ffn, hidden, &d_up, x, up, 1);
    }
    let (mut input_grads, mut through_up) = (vec![0.0; count * hidden], vec![0.0; count * hidden]);
    matmul_grad_input(count, ffn, hidden, &d_gate, gate_w, &mut input_grads, 1);
    matmul_grad_input(count, ffn, hidden, &d_up, up_w, &mut through_up, 1);
    input_grads.iter_mut().zip(&through_up).for_each(|(total, value)| *total += value);
    ExpertBackward { weight_grads, input_grads }
}

/// `out[rows, hidden]`: this rank's summand of the mixture for every row. Operands: `x[rows, hidden]`,
/// `router[experts, hidden]`, `gate` and `up` `[local_experts, ffn, hidden]`, `down[local_experts,
/// hidden, ffn]`. Returns how many rows each local expert received (its load).
pub fn moe_mlp(shape: &MoeShape, operands: [&[f32]; 5], out: &mut [f32]) -> Vec<usize> {
    let [x, router, gate, up, down] = operands;
    let routing = route(shape, x, router);
    let weights = ExpertWeights { gate, up, down };
    out.fill(0.0);
    let hidden = shape.hidden;
    let mut loads = vec![0; shape.local_experts];
    for (local, load) in loads.iter_mut().enumerate() {
        let slots = expert_slots(shape, &routing, local);
        *load = slots.len();
        if slots.is_empty() {
            continue;
        }
        let result = expert_forward(shape, local, &gather_rows(x, hidden, &slots, shape.top_k), weights);
        for (row_result, &slot) in result.chunks_exact(hidden).zip(&slots) {
            let row = slot / shape.top_k;
            let weight = routing.weights[slot];
            out[row * hidden..(row + 1) * hidden]
                .iter_mut()
                .zip(row_result)
                .for_each(|(total, &value)| *total += weight * value);
        }
    }
    loads
}

/// This rank's summand of the gradient of `moe_mlp` with respect to `wrt`, given `dy[rows,
/// hidden]`; `out` has that operand's local size.
pub fn moe_mlp_grad(shape: &MoeShape, operands: [&[f32]; 5], dy: &[f32], wrt: MoeGradOperand, out: &mut [f32]) {
    let [x, router, gate, up, down] = operands;
    let routing = route(shape, x, router);
    let weights = ExpertWeights { gate, up, down };
    let (hidden, expert_size) = (shape.hidden, shape.ffn * shape.hidden);
    out.fill(0.0);
    // d loss / d (chosen weight) of every slot this rank's experts serve (zero elsewhere).
    let mut weight_grads = vec![0.0f32; routing.chosen.len()];
    for local in 0..shape.local_experts {
        let slots = expert_slots(shape, &routing, local);
        if slots.is_empty() {
            continue;
        }
        let row_weights: Vec<f32> = slots.iter().map(|&slot| routing.weights[slot]).collect();
        let block =
            (&gather_rows(x, hidden, &slots, shape.top_k)[..], &gather_rows(dy, hidden, &slots, shape.top_k)[..]);
        let mut grads = ExpertGrads::default();
        let expert = local * expert_size..(local + 1) * expert_size;
        match wrt {
            MoeGradOperand::Gate => grads.gate = Some(&mut out[expert]),
            MoeGradOperand::Up => grads.up = Some(&mut out[expert]),
            MoeGradOperand::Down => grads.down = Some(&mut out[expert]),
            MoeGradOperand::Input | MoeGradOperand::Router => {}
        }
        let backward = expert_backward(shape, local, (block.0, block.1, &row_weights), weights, grads);
        for (index, &slot) in slots.iter().enumerate() {
            weight_grads[slot] = backward.weight_grads[index];
            if wrt == MoeGradOperand::Input {
                let row = slot / shape.top_k;
                out[row * hidden..(row + 1) * hidden]
                    .iter_mut()
                    .zip(&backward.input_grads[index * hidden..(index + 1) * hidden])
                    .for_each(|(total, value)| *total += value);
            }
        }
    }
    route_backward(shape, &routing, &weight_grads, (x, router), wrt, out);
}

/// Adds the routing's part of the gradient with respect to `x` (`wrt` Input) or sets the router's
/// gradient (`wrt` Router), from each slot's routing-weight gradient; nothing for the experts'
/// weights.
pub fn route_backward(
    shape: &MoeShape,
    routing: &Routing,
    weight_grads: &[f32],
    (x, router): (&[f32], &[f32]),
    wrt: MoeGradOperand,
    out: &mut [f32],
) {
    if matches!(wrt, MoeGradOperand::Input | MoeGradOperand::Router) {
        let d_logits = logit_gradients(shape, routing, weight_grads);
        logits_backward(shape, &d_logits, (x, router), wrt, out);
    }
}

/// Back through `logits = x · routerᵀ` from `d_logits[rows, experts]`: adds `d_logits · router` to
/// `out` (`wrt` Input) or sets `out` to `d_logitsᵀ · x` (`wrt` Router).
fn logits_backward(
    shape: &MoeShape,
    d_logits: &[f32],
    (x, router): (&[f32], &[f32]),
    wrt: MoeGradOperand,
    out: &mut [f32],
) {
    let (rows, experts, hidden) = (shape.rows, shape.experts, shape.hidden);
    match wrt {
        MoeGradOperand::Input => {
            let mut through_router = vec![0.0; rows * hidden];
            matmul_grad_input(rows, experts, hidden, d_logits, router, &mut through_router, 1);
            out.iter_mut().zip(&through_router).for_each(|(total, value)| *total += value);
        }
        MoeGradOperand::Router => matmul_grad_weight(rows, experts, hidden, d_logits, x, out, 1),
        MoeGradOperand::Gate | MoeGradOperand::Up | MoeGradOperand::Down => {}
    }
}

/// One row's gradient with respect to its logits from the one with respect to its softmax
/// probabilities: `p * (d - p·d)`.
fn softmax_backward(probabilities: &[f32], d_probabilities: &[f32], d_logits: &mut [f32]) {
    let inner: f32 = probabilities.iter().zip(d_probabilities).map(|(p, d)| p * d).sum();
    for ((d_logit, p), d) in d_logits.iter_mut().zip(probabilities).zip(d_probabilities) {
        *d_logit = p * (d - inner);
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
        let span = row * experts..(row + 1) * experts;
        softmax_backward(&routing.probabilities[span.clone()], &d_probabilities, &mut d_logits[span]);
    }
    d_logits
}

/// `out[experts]`: the slots top-`top_k` routing sends to each expert, times `scale`.
pub fn expert_counts(shape: &MoeShape, x: &[f32], router: &[f32], scale: f64, out: &mut [f32]) {
    let routing = route(shape, x, router);
    let mut counts = vec![0u64; shape.experts];
    for &expert in &routing.chosen {
        counts[expert] += 1;
    }
    out.iter_mut().zip(&counts).for_each(|(value, &count)| *value = (count as f64 * scale) as f32);
}

/// `out[experts]`: every row's router probabilities, summed.
pub fn router_prob_sum(shape: &MoeShape, x: &[f32], router: &[f32], out: &mut [f32]) {
    let routing = route(&MoeShape { top_k: 0, ..*shape }, x, router);
    out.fill(0.0);
    for row in routing.probabilities.chunks_exact(shape.experts) {
        out.iter_mut().zip(row).for_each(|(sum, &p)| *sum += p);
    }
}

/// The gradient of [`router_prob_sum`] with respect to `x` (`wrt` Input, `[rows, hidden]`) or the
/// router (`[experts, hidden]`), given `dy[experts]`.
pub fn router_prob_sum_grad(
    shape: &MoeShape,
    x: &[f32],
    router: &[f32],
    dy: &[f32],
    wrt: MoeGradOperand,
    out: &mut [f32],
) {
    let routing = route(&MoeShape { top_k: 0, ..*shape }, x, router);
    let experts = shape.experts;
    let mut d_logits = vec![0.0f32; shape.rows * experts];
    for (probabilities, row_d_logits) in
        routing.probabilities.chunks_exact(experts).zip(d_logits.chunks_exact_mut(experts))
    {
        softmax_backward(probabilities, dy, row_d_logits);
    }
    out.fill(0.0);
    logits_backward(shape, &d_logits, (x, router), wrt, out);
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
