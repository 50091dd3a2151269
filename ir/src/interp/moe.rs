//! The mixture-of-experts MLP (`MoeMlp`) and its gradients, token by token.
//!
//! The forward pass follows Hugging Face's `MixtralSparseMoeBlock`: router logits, a softmax over
//! every expert, the `top_k` largest probabilities (ties to the lower index, as `torch.topk` on CPU
//! returns them), renormalized when asked, and each chosen expert's gated SiLU MLP weighted by its
//! probability. Every row is computed on its own with f64 sums; nothing is grouped or batched, so
//! that this oracle shares no structure with the runtime's grouped kernels.
//!
//! The gradients are the chain rule through that computation. The routing choice is piecewise
//! constant; gradients reach the router through the chosen probabilities only.

use super::error::OpError;
use super::ops::{dot, shape_error};
use super::tensor::{element_count, Tensor};
use crate::MoeOperand;

/// The sizes an `MoeMlp` reads from its operands, checked against each other.
struct MoeDims {
    rows: usize,
    hidden: usize,
    experts: usize,
    ffn: usize,
}

fn moe_dims(operands: &[&Tensor]) -> Result<MoeDims, OpError> {
    let [x, router, gate, up, down] = [operands[0], operands[1], operands[2], operands[3], operands[4]];
    let Some((&hidden, leading)) = x.shape.split_last() else {
        return Err(shape_error(0, x, "[.., hidden] with at least one dim"));
    };
    let &[experts, router_hidden] = router.shape.as_slice() else {
        return Err(shape_error(1, router, "[experts, hidden]"));
    };
    if router_hidden != hidden {
        return Err(shape_error(1, router, format!("[experts, hidden] with hidden = {hidden}")));
    }
    let &[gate_experts, ffn, gate_hidden] = gate.shape.as_slice() else {
        return Err(shape_error(2, gate, "[experts, ffn, hidden]"));
    };
    if gate_experts != experts || gate_hidden != hidden {
        return Err(shape_error(
            2,
            gate,
            format!("[experts, ffn, hidden] with experts = {experts}, hidden = {hidden}"),
        ));
    }
    if up.shape != gate.shape {
        return Err(shape_error(3, up, format!("{:?}, the shape of operand 2", gate.shape)));
    }
    if down.shape != [experts, hidden, ffn] {
        return Err(shape_error(4, down, format!("[experts, hidden, ffn] = {:?}", [experts, hidden, ffn])));
    }
    Ok(MoeDims { rows: element_count(leading), hidden, experts, ffn })
}

/// One row's routing: the softmax over every expert and the chosen experts with their weights.
struct Route {
    probabilities: Vec<f64>,
    chosen: Vec<usize>,
    weights: Vec<f64>,
    /// The sum of the chosen probabilities (the renormalization's divisor, or 1).
    divisor: f64,
}

fn route(x_row: &[f32], router: &Tensor, dims: &MoeDims, top_k: usize, normalize: bool) -> Route {
    let hidden = dims.hidden;
    let logits: Vec<f64> = (0..dims.experts)
        .map(|expert| f64::from(dot(x_row, &router.data[expert * hidden..(expert + 1) * hidden])))
        .collect();
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exponentials: Vec<f64> = logits.iter().map(|&logit| (logit - max).exp()).collect();
    let total: f64 = exponentials.iter().sum();
    let probabilities: Vec<f64> = exponentials.iter().map(|&value| value / total).collect();
    let mut order: Vec<usize> = (0..dims.experts).collect();
    // Stable: equal probabilities keep the lower expert first.
    order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
    let chosen: Vec<usize> = order[..top_k.min(dims.experts)].to_vec();
    let divisor = if normalize { chosen.iter().map(|&expert| probabilities[expert]).sum() } else { 1.0 };
    let weights = chosen.iter().map(|&expert| probabilities[expert] / divisor).collect();
    Route { probabilities, chosen, weights, divisor }
}

/// One expert's activations for one row: the gate and up projections and `silu(gate) * up`.
struct ExpertActivations {
    gate: Vec<f64>,
    up: Vec<f64>,
    inner: Vec<f64>,
}

fn silu(value: f64) -> f64 {
    value / (1.0 + (-value).exp())
}

fn expert_activations(x_row: &[f32], operands: &[&Tensor], dims: &MoeDims, expert: usize) -> ExpertActivations {
    let (ffn, hidden) = (dims.ffn, dims.hidden);
    let weights = |tensor: &Tensor, channel: usize| {
        let start = (expert * ffn + channel) * hidden;
        f64::from(dot(x_row, &tensor.data[start..start + hidden]))
    };
    let gate: Vec<f64> = (0..ffn).map(|channel| weights(operands[2], channel)).collect();
    let up: Vec<f64> = (0..ffn).map(|channel| weights(operands[3], channel)).collect();
    let inner = gate.iter().zip(&up).map(|(&gate, &up)| silu(gate) * up).collect();
    ExpertActivations { gate, up, inner }
}

/// `down_e · inner` for expert `expert`, one value a hidden channel.
fn expert_output(inner: &[f64], down: &Tensor, dims: &MoeDims, expert: usize) -> Vec<f64> {
    let (ffn, hidden) = (dims.ffn, dims.hidden);
    (0..hidden)
        .map(|channel| {
            let start = (expert * hidden + channel) * ffn;
            down.data[start..start + ffn].iter().zip(inner).map(|(&weight, &value)| f64::from(weight) * value).sum()
        })
        .collect()
}

/// The `MoeMlp` forward pass (operands as the op documents).
pub(super) fn moe_mlp(operands: &[&Tensor], top_k: u64, normalize: bool) -> Result<Tensor, OpError> {
    let dims = moe_dims(operands)?;
    let top_k = usize::try_from(top_k).unwrap_or(usize::MAX);
    let x = operands[0];
    let mut data = Vec::with_capacity(x.data.len());
    for row in 0..dims.rows {
        let x_row = &x.data[row * dims.hidden..(row + 1) * dims.hidden];
        let routing = route(x_row, operands[1], &dims, top_k, normalize);
        let mut sum = vec![0.0f64; dims.hidden];
        for (&expert, &weight) in routing.chosen.iter().zip(&routing.weights) {
            let activations = expert_activations(x_row, operands, &dims, expert);
            for (total, value) in sum.iter_mut().zip(expert_output(&activations.inner, operands[4], &dims, expert)) {
                *total += weight * value;
            }
        }
        data.extend(sum.iter().map(|&value| value as f32));
    }
    Ok(Tensor { shape: x.shape.clone(), data })
}

/// The gradient of `MoeMlp` with respect to `wrt`; operand 5 is `dy`, shaped as `x`.
pub(super) fn moe_mlp_grad(
    operands: &[&Tensor],
    top_k: u64,
    normalize: bool,
    wrt: MoeOperand,
) -> Result<Tensor, OpError> {
    let dims = moe_dims(&operands[..5])?;
    let (x, dy) = (operands[0], operands[5]);
    if dy.shape != x.shape {
        return Err(shape_error(5, dy, format!("{:?}, the shape of operand 0", x.shape)));
    }
    let top_k = usize::try_from(top_k).unwrap_or(usize::MAX);
    let (hidden, ffn) = (dims.hidden, dims.ffn);
    let target = operands[wrt.index()];
    let mut gradient = vec![0.0f64; target.data.len()];
    for row in 0..dims.rows {
        let x_row = &x.data[row * hidden..(row + 1) * hidden];
        let dy_row: Vec<f64> =
            dy.data[row * hidden..(row + 1) * hidden].iter().map(|&value| f64::from(value)).collect();
        let routing = route(x_row, operands[1], &dims, top_k, normalize);
        // d loss / d (chosen weight) = dy · expert output.
        let mut weight_grads = Vec::with_capacity(routing.chosen.len());
        for (&expert, &weight) in routing.chosen.iter().zip(&routing.weights) {
            let activations = expert_activations(x_row, operands, &dims, expert);
            let output = expert_output(&activations.inner, operands[4], &dims, expert);
            weight_grads.push(output.iter().zip(&dy_row).map(|(a, b)| a * b).sum::<f64>());
            // Through the expert, with the upstream gradient `weight · dy`.
            let d_inner: Vec<f64> = (0..ffn)
                .map(|channel| {
                    (0..hidden)
                        .map(|out| f64::from(operands[4].data[(expert * hidden + out) * ffn + channel]) * dy_row[out])
                        .sum::<f64>()
                        * weight
                })
                .collect();
            let sigmoid = |value: f64| 1.0 / (1.0 + (-value).exp());
            let d_gate: Vec<f64> = (0..ffn)
                .map(|channel| {
                    let (g, u) = (activations.gate[channel], activations.up[channel]);
                    let s = sigmoid(g);
                    d_inner[channel] * u * (s + g * s * (1.0 - s))
                })
                .collect();
            let d_up: Vec<f64> = (0..ffn).map(|channel| d_inner[channel] * silu(activations.gate[channel])).collect();
            match wrt {
                MoeOperand::Down => {
                    for out in 0..hidden {
                        for channel in 0..ffn {
                            gradient[(expert * hidden + out) * ffn + channel] +=
                                weight * dy_row[out] * activations.inner[channel];
                        }
                    }
                }
                MoeOperand::Gate | MoeOperand::Up => {
                    let d_projection = if wrt == MoeOperand::Gate { &d_gate } else { &d_up };
                    for channel in 0..ffn {
                        for input in 0..hidden {
                            gradient[(expert * ffn + channel) * hidden + input] +=
                                d_projection[channel] * f64::from(x_row[input]);
                        }
                    }
                }
                MoeOperand::Input => {
                    for input in 0..hidden {
                        gradient[row * hidden + input] += (0..ffn)
                            .map(|channel| {
                                let at = (expert * ffn + channel) * hidden + input;
                                d_gate[channel] * f64::from(operands[2].data[at])
                                    + d_up[channel] * f64::from(operands[3].data[at])
                            })
                            .sum::<f64>();
                    }
                }
                MoeOperand::Router => {}
            }
        }
        if !matches!(wrt, MoeOperand::Input | MoeOperand::Router) {
            continue;
        }
        let d_logits = logit_gradient(&routing, &weight_grads, normalize, dims.experts);
        for (expert, &d_logit) in d_logits.iter().enumerate() {
            for input in 0..hidden {
                match wrt {
                    MoeOperand::Router => {
                        gradient[expert * hidden + input] += d_logit * f64::from(x_row[input]);
                    }
                    _ => {
                        gradient[row * hidden + input] +=
                            d_logit * f64::from(operands[1].data[expert * hidden + input]);
                    }
                }
            }
        }
    }
    Ok(Tensor { shape: target.shape.clone(), data: gradient.iter().map(|&value| value as f32).collect() })
}

/// The gradient with respect to one row's router logits, given the gradient with respect to each
/// chosen weight: back through the renormalization (when on) and the softmax.
fn logit_gradient(routing: &Route, weight_grads: &[f64], normalize: bool, experts: usize) -> Vec<f64> {
    let mut d_probabilities = vec![0.0f64; experts];
    // w_j = p_j / s with s the sum of the chosen p: d p_j = (g_j - sum_k w_k g_k) / s.
    let mean: f64 = match normalize {
        true => routing.weights.iter().zip(weight_grads).map(|(w, g)| w * g).sum(),
        false => 0.0,
    };
    for (&expert, &grad) in routing.chosen.iter().zip(weight_grads) {
        d_probabilities[expert] = (grad - mean) / routing.divisor;
    }
    let inner: f64 = routing.probabilities.iter().zip(&d_probabilities).map(|(p, d)| p * d).sum();
    routing.probabilities.iter().zip(&d_probabilities).map(|(p, d)| p * (d - inner)).collect()
}

/// The row count and routing sizes of a router statistic's operands `x[.., hidden]` and
/// `router[experts, hidden]`.
fn router_dims(x: &Tensor, router: &Tensor) -> Result<MoeDims, OpError> {
    let Some((&hidden, leading)) = x.shape.split_last() else {
        return Err(shape_error(0, x, "[.., hidden] with at least one dim"));
    };
    match router.shape.as_slice() {
        &[experts, router_hidden] if router_hidden == hidden => {
            Ok(MoeDims { rows: element_count(leading), hidden, experts, ffn: 0 })
        }
        _ => Err(shape_error(1, router, format!("[experts, hidden] with hidden = {hidden}"))),
    }
}

/// `(x, router) -> [experts]`: the slots each expert receives under top-`top_k` routing, times
/// `scale`.
pub(super) fn expert_counts(x: &Tensor, router: &Tensor, top_k: u64, scale: f64) -> Result<Tensor, OpError> {
    let dims = router_dims(x, router)?;
    let top_k = usize::try_from(top_k).unwrap_or(usize::MAX);
    let mut counts = vec![0u64; dims.experts];
    for row in 0..dims.rows {
        let routing = route(&x.data[row * dims.hidden..(row + 1) * dims.hidden], router, &dims, top_k, false);
        for expert in routing.chosen {
            counts[expert] += 1;
        }
    }
    Ok(Tensor { shape: vec![dims.experts], data: counts.iter().map(|&count| (count as f64 * scale) as f32).collect() })
}

/// How near `top_k` routing of `(x, router)` is to choosing differently: the smallest of
/// [`routing_margins`] over the rows (infinite without rows).
pub fn routing_margin(x: &Tensor, router: &Tensor, top_k: u64) -> Result<f64, OpError> {
    Ok(routing_margins(x, router, top_k)?.into_iter().fold(f64::INFINITY, f64::min))
}

/// How near `top_k` routing of each row of `(x, router)` is to choosing differently: the gap
/// between the router logit of the row's last chosen expert and that of its first expert left
/// out, relative to the magnitudes summed into them (infinite when every expert, or none, is
/// chosen). Routing is piecewise constant, so where this gap is within rounding two runs of the
/// same weights can route the row differently and the mixture's output for it jumps: an
/// elementwise comparison with another implementation is not meaningful there.
pub fn routing_margins(x: &Tensor, router: &Tensor, top_k: u64) -> Result<Vec<f64>, OpError> {
    let dims = router_dims(x, router)?;
    let top_k = usize::try_from(top_k).unwrap_or(usize::MAX);
    if top_k == 0 || top_k >= dims.experts {
        return Ok(vec![f64::INFINITY; dims.rows]);
    }
    let margin = |row: &[f32]| {
        // Each logit with the sum of its products' magnitudes, the scale of its rounding error.
        let mut logits: Vec<(f64, f64)> = router
            .data
            .chunks_exact(dims.hidden)
            .map(|weights| {
                let products = row.iter().zip(weights).map(|(&x, &w)| f64::from(x) * f64::from(w));
                products.fold((0.0, 0.0), |(sum, scale), product| (sum + product, scale + product.abs()))
            })
            .collect();
        logits.sort_by(|a, b| b.0.total_cmp(&a.0));
        let ((kept, kept_scale), (left, left_scale)) = (logits[top_k - 1], logits[top_k]);
        (kept - left) / kept_scale.max(left_scale).max(f64::MIN_POSITIVE)
    };
    Ok(x.data.chunks_exact(dims.hidden).map(margin).collect())
}

/// `(x, router) -> [experts]`: every row's softmax probabilities, summed.
pub(super) fn router_prob_sum(x: &Tensor, router: &Tensor) -> Result<Tensor, OpError> {
    let dims = router_dims(x, router)?;
    let mut sums = vec![0.0f64; dims.experts];
    for row in 0..dims.rows {
        let routing = route(&x.data[row * dims.hidden..(row + 1) * dims.hidden], router, &dims, 0, false);
        sums.iter_mut().zip(&routing.probabilities).for_each(|(sum, p)| *sum += p);
    }
    Ok(Tensor { shape: vec![dims.experts], data: sums.iter().map(|&sum| sum as f32).collect() })
}

/// The gradient of `router_prob_sum` with respect to `x` or the router, given `dy[experts]`: each
/// row's logits get `p * (dy - p·dy)`, then back through `x · routerᵀ`.
pub(super) fn router_prob_sum_grad(
    x: &Tensor,
    router: &Tensor,
    dy: &Tensor,
    wrt: MoeOperand,
) -> Result<Tensor, OpError> {
    let dims = router_dims(x, router)?;
    if dy.shape != [dims.experts] {
        return Err(shape_error(2, dy, format!("[experts] with experts = {}", dims.experts)));
    }
    let hidden = dims.hidden;
    let target = match wrt {
        MoeOperand::Input => x,
        MoeOperand::Router => router,
        _ => return Err(shape_error(2, dy, "a gradient with respect to x or the router")),
    };
    let mut gradient = vec![0.0f64; target.data.len()];
    for row in 0..dims.rows {
        let x_row = &x.data[row * hidden..(row + 1) * hidden];
        let routing = route(x_row, router, &dims, 0, false);
        let inner: f64 = routing.probabilities.iter().zip(&dy.data).map(|(p, &d)| p * f64::from(d)).sum();
        for (expert, p) in routing.probabilities.iter().enumerate() {
            let d_logit = p * (f64::from(dy.data[expert]) - inner);
            for input in 0..hidden {
                match wrt {
                    MoeOperand::Router => gradient[expert * hidden + input] += d_logit * f64::from(x_row[input]),
                    _ => gradient[row * hidden + input] += d_logit * f64::from(router.data[expert * hidden + input]),
                }
            }
        }
    }
    Ok(Tensor { shape: target.shape.clone(), data: gradient.iter().map(|&value| value as f32).collect() })
}

/// `(counts[experts], probabilities[experts]) -> []`: their dot product.
pub(super) fn load_balancing_loss(counts: &Tensor, probabilities: &Tensor) -> Result<Tensor, OpError> {
    if counts.rank() != 1 || probabilities.shape != counts.shape {
        return Err(shape_error(1, probabilities, format!("{:?}, the shape of operand 0", counts.shape)));
    }
    Ok(Tensor { shape: Vec::new(), data: vec![dot(&counts.data, &probabilities.data)] })
}
