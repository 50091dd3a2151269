//! Inside a tsp MLP ring (`backend::lower`'s ring MLP and its backward), where a pipelined stage may
//! peak on more tokens: the points of each step, as its activations (recomputed in the backward),
//! their gradients, the shard's weight-gradient contributions and the partial sums are made.

use super::super::memory::Term;
use super::super::workload::Recompute;
use super::chunk::{Candidate, KeptWholePending};
use super::StageShape;

/// The names of a ring backward's points, by the layer it runs in.
pub(super) struct BackwardPointNames {
    down_contribution: &'static str,
    made_unreduced: &'static str,
    joins_its_sum: &'static str,
    joins_the_partial: &'static str,
    gate_output_gradient: &'static str,
    contribution: &'static str,
    input_gradient_summed: &'static str,
}

/// A ring backward's point names, each its step's name after `$ring` (which layer's ring it is).
macro_rules! backward_point_names {
    ($ring:literal) => {
        BackwardPointNames {
            down_contribution: concat!($ring, " backward: the down contribution from the SiLU product"),
            made_unreduced: concat!($ring, " backward: a weight gradient made, unreduced"),
            joins_its_sum: concat!($ring, " backward: a weight gradient joins its sum"),
            joins_the_partial: concat!($ring, " backward: a contribution joins the partial gradient received"),
            gate_output_gradient: concat!($ring, " backward: gate's output gradient"),
            contribution: concat!($ring, " backward: a contribution"),
            input_gradient_summed: concat!($ring, " backward: the input gradient's parts summed"),
        }
    };
}

/// The first layer's ring backward: a tail of the backward (zero bubble: of B).
pub(super) const FIRST_LAYER: BackwardPointNames = backward_point_names!("first layer's MLP ring");

/// The last layer's ring backward: at the head of the backward (on the last chunk after the
/// head's).
pub(super) const LAST_LAYER: BackwardPointNames = backward_point_names!("the last layer's MLP ring");

/// The first layer's shared expert's ring backward (a mixture's, Qwen2-MoE's, under tsp).
pub(super) const SHARED_FIRST_LAYER: BackwardPointNames = backward_point_names!("first layer's shared expert ring");

/// The last layer's shared expert's ring backward.
pub(super) const SHARED_LAST_LAYER: BackwardPointNames = backward_point_names!("the last layer's shared expert ring");

/// The ring's own buffers and the gradients it has made, as it goes (forward or backward).
struct RingWalk {
    /// Bytes of the ring's buffers live now (recomputed activations, their gradients, the shard
    /// in flight, contributions, the input gradient's partial sum).
    live: f64,
    /// The micro-batch's gradients made by now (the ring's outputs among them).
    so_far: f64,
    /// Everything the micro-batch holds beside the ring's buffers.
    held: Vec<Term>,
    /// Under zero bubble all the chunk's gradients B makes: on the micro-batch's first B of the
    /// chunk the running sums exist only of those made so far (none pending outside zero bubble,
    /// where the sums of the later layers' gradients exist).
    made_in_b: Option<f64>,
    points: Vec<Candidate>,
}

impl RingWalk {
    /// A point with `extra` bytes of the ring's live beside `live`, `joining` the bytes of a
    /// ring output joining its running sum there.
    fn point(&mut self, name: &'static str, extra: f64, joining: Option<f64>) {
        let mut held = self.held.clone();
        held.push(Term { name: "the MLP ring's own buffers", bytes: self.live + extra });
        self.points.push(Candidate {
            name,
            so_far: self.so_far,
            held,
            new_sum: joining.map(|bytes| Term { name: "the ring's output joining its sum, new beside old", bytes }),
            pending: KeptWholePending::NONE,
            sum_pending: self.made_in_b.map_or(0.0, |made_in_b| made_in_b - self.so_far),
        });
    }
}

/// A layer's MLP ring backward (tsp, `backend::lower::lower_ring_mlp_grad`; under zero bubble B
/// runs it whole): at each of the axis's `tsp` steps the rank recomputes
/// gate and up on its tokens with the shard it holds (in flight but at the last step, which uses
/// its own), makes the down shard's weight-gradient contribution from their SiLU product, then the
/// product's gradient, gate's and up's, and for gate and up their contributions and the input
/// gradient's parts, summed as they come. A contribution from the second step on joins the partial
/// gradient received with the shard (freed with it), and at the last step that sum is the rank's
/// own gradient of the shard, which joins its running sum at once (beside dp or cp it waits
/// unreduced to the ring's end, its reduction not modelled here). `held` is all the micro-batch
/// holds beside the ring (its inputs, its output gradient, under zero bubble what W reads),
/// `made_before` the gradients made before the ring, `made_in_b` under zero bubble all the chunk's
/// B gradients; `names` says which layer's ring it is.
pub(super) fn ring_backward(
    shape: &StageShape,
    names: &BackwardPointNames,
    held: Vec<Term>,
    made_before: f64,
    made_in_b: Option<f64>,
) -> Vec<Candidate> {
    let (element, tsp) = (shape.sizes.element, shape.tsp);
    // The rank's tokens' recomputed activations (its shard's channels), the input gradient's
    // parts, and a shard's projection (its weight-gradient contribution).
    let channels = shape.sizes.local_tokens * shape.sizes.ffn / tsp as f64 * element;
    let input_gradient = shape.sizes.gathered;
    let projection = shape.sizes.hidden * shape.sizes.ffn / tsp as f64 * element;
    let reduced = shape.reduced;
    // Under ZeRO-3 the rank's shards of the layer's MLP weights are gathered over dp again for it
    // (under full recomputation its MLP norm's too, for the ring's recomputed input).
    let mut held = held;
    let norm = if shape.recompute() == Recompute::Full { shape.norm * element } else { 0.0 };
    let regathered = shape.mlp_projections_gathered_again(projection) + shape.norms_gathered_again(norm);
    if regathered > 0.0 {
        held.push(Term { name: "the layer's MLP weights, gathered over dp again", bytes: regathered });
    }
    let mut ring = RingWalk { live: 0.0, so_far: made_before, held, made_in_b, points: Vec::new() };
    // The first step's shard comes from the next rank (the rank's own goes on).
    ring.live += 3.0 * projection;
    let mut partial_sum = false;
    for step in 0..tsp {
        let last = step + 1 == tsp;
        if last {
            // The last step uses the rank's own shard (a parameter).
            ring.live -= 3.0 * projection;
        }
        // Gate and up recomputed; the down contribution from their product.
        ring.live += 2.0 * channels;
        ring.point(names.down_contribution, channels + projection, None);
        // Each part: its contribution (the product freed for down's), then from the second step on
        // its sum with the partial gradient received, the rank's own at the last step.
        let fold = |ring: &mut RingWalk| {
            if step == 0 {
                return;
            }
            if last && reduced {
                // Beside dp (or cp) the rank's gradient waits unreduced to the ring's end.
                ring.point(names.made_unreduced, 3.0 * projection, None);
                ring.live += projection;
            } else if last {
                ring.so_far += projection;
                ring.point(names.joins_its_sum, 2.0 * projection, Some(projection));
            } else {
                ring.point(names.joins_the_partial, 3.0 * projection, None);
            }
        };
        fold(&mut ring);
        // The product's gradient, then gate's beside gate, up and it (up freed, up's gradient
        // made, gate and the product's gradient freed).
        ring.point(names.gate_output_gradient, 2.0 * channels, None);
        for _gate_then_up in 0..2 {
            // The part's contribution, folded; then its input gradient, summed into the partial
            // sum (the first becomes it).
            ring.point(names.contribution, projection, None);
            fold(&mut ring);
            if partial_sum {
                ring.point(names.input_gradient_summed, 2.0 * input_gradient, None);
            } else {
                ring.live += input_gradient;
                ring.point(names.input_gradient_summed, 0.0, None);
                partial_sum = true;
            }
            // The part's output gradient freed.
            ring.live -= channels;
        }
        // (Then the shard is freed and the next received: `live` keeps one in flight.)
    }
    ring.points
}

/// The names of a ring forward's points, by the MLP it runs.
pub(super) struct ForwardPointNames {
    product: &'static str,
    output_part: &'static str,
    parts_summed: &'static str,
    next_shard: &'static str,
}

/// A ring forward's point names, each its step's name after `$ring` (which ring it is).
macro_rules! forward_point_names {
    ($ring:literal) => {
        ForwardPointNames {
            product: concat!($ring, ": the SiLU product in a forward"),
            output_part: concat!($ring, ": a step's output part in a forward"),
            parts_summed: concat!($ring, ": the output's parts summed in a forward"),
            next_shard: concat!($ring, ": the next shard received in a forward"),
        }
    };
}

/// The last layer's dense MLP ring, in a forward.
pub(super) const LAST_LAYER_FORWARD: ForwardPointNames = forward_point_names!("the last layer's MLP ring");

/// The last layer's shared expert ring (a mixture's), in a forward.
pub(super) const SHARED_LAST_LAYER_FORWARD: ForwardPointNames =
    forward_point_names!("the last layer's shared expert ring");

/// The ring MLP's forward: at each of the axis's `tsp` steps the rank computes gate, up and their
/// SiLU product on its tokens with the shard it holds (its own at the first step, then the one
/// received from the previous rank, in flight), then the down projection's part of the output,
/// summed as they come; the next shard is received after the step's GEMMs, before the one it held
/// is freed. `held` is all the micro-batch holds beside the ring; `names` says which ring it is.
pub(super) fn ring_forward(shape: &StageShape, names: &ForwardPointNames, held: Vec<Term>) -> Vec<Candidate> {
    let (element, tsp) = (shape.sizes.element, shape.tsp);
    let channels = shape.sizes.local_tokens * shape.sizes.ffn / tsp as f64 * element;
    let output = shape.sizes.gathered;
    let shard = 3.0 * shape.sizes.hidden * shape.sizes.ffn / tsp as f64 * element;
    // Under ZeRO-3 the rank's shards of the ring's weights are gathered over dp for it.
    let mut held = held;
    let gathered = shape.mlp_projections_gathered_again(shard / 3.0);
    if gathered > 0.0 {
        held.push(Term { name: "the ring's weights, gathered over dp", bytes: gathered });
    }
    let mut ring = RingWalk { live: 0.0, so_far: 0.0, held, made_in_b: None, points: Vec::new() };
    for step in 0..tsp {
        let last = step + 1 == tsp;
        ring.point(names.product, 3.0 * channels, None);
        ring.point(names.output_part, channels + output, None);
        if step == 0 {
            ring.live += output;
        } else {
            ring.point(names.parts_summed, 2.0 * output, None);
        }
        if !last {
            if step == 0 {
                ring.live += shard;
            } else {
                ring.point(names.next_shard, shard, None);
            }
        }
    }
    ring.points
}
