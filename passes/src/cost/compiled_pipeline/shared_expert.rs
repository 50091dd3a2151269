//! The points of a shared expert's backward (Qwen2-MoE) where a stage may peak: its backward comes
//! before the routed experts' in each layer's, and on more tokens or a wide shared expert its
//! `[tokens, ffn]` buffers outweigh the rest of the MLP's.
//!
//! The order: the gate logit's gradient, the output and the logit freed; the scaled output's
//! gradient; the gate vector's input and weight gradients; down's input gradient and weight
//! gradient. Without replicas (dp, cp or ep, which all-reduce its weight gradients) down's weight
//! gradient joins its sum there (the first point: gate, up and their product still live); then
//! the product is freed, gate's and up's output gradients made, gate and up freed, up's and
//! gate's input gradients summed with the gate vector's (up's joining it is a point: three
//! `[tokens, hidden]` buffers live) and their weight gradients made, gate's joining its sum last
//! (the last point: gate's output gradient still live). Beside replicas each weight gradient is
//! all-reduced before it joins its sum, its unreduced copy live as it does, and the buffers it was
//! made from are freed before the all-reduce: a stage may peak as down's weight gradient is made
//! (the scaled output's gradient and the product still live), as it joins its sum, as up's output
//! gradient is made (beside gate, down's input gradient and gate's output gradient: down's is
//! freed only then), and as gate's joins its sum (gate's output gradient freed). (Up's weight
//! gradient joining its sum, between, is below the point before it wherever a micro-batch has as
//! many tokens as the hidden size: two or three `[tokens, ffn]` buffers fewer there, one or two
//! `[hidden, ffn]` gradients more; not modelled.) Under ZeRO-2 and 3 each is reduce-scattered
//! there instead, staged whole, its shard joining its sum after.
//!
//! Under SP the shared expert reads the layer's output gradient all-gathered over tp; the gate
//! vector's backward comes last (the gate logit's gradient live until then), and with the
//! load-balancing loss the router's backward comes first (its weight gradient live from then on,
//! its input gradient until up's, all-reduced over tp, joins it: a point too); without the loss
//! up's input gradient is the first of the MLP norm output's, and gate's joining it is a point
//! (three `[tokens, hidden]` buffers live, gate's output gradient beside). Under ZeRO-3 with full
//! recomputation the MLP norm's, gate's and up's weights gathered again for the recomputed
//! forward are freed as their readers finish: up's once its input gradient is made; under SP the
//! gate vector's, gathered to recompute the logit, stays to its backward.
//!
//! Under tsp the shared expert is a ring MLP, as a dense layer's: its points are the ring's, step
//! by step (`ring_points`).

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{Candidate, KeptWholePending};
use super::{tsp_ring, Place, StageShape};

impl Place {
    /// The names of the shared expert's points there: down's weight gradient made and joining its
    /// sum, up's output gradient made, up's input gradient all-reduced over tp (under SP) or
    /// joining the gate vector's (without SP), gate's input gradient joining up's (under SP
    /// without the load-balancing loss), and gate's weight gradient joining its sum.
    fn shared_expert_names(self) -> [&'static str; 7] {
        match self {
            Place::FirstLayer => [
                "first layer's shared expert's down gradient",
                "first layer's shared expert's down gradient joins its sum",
                "first layer's shared expert's up output gradient",
                "first layer's shared expert's up input gradient all-reduced over tp",
                "first layer's shared expert's up input gradient joins the gate vector's",
                "first layer's shared expert's gate input gradient joins up's",
                "first layer's shared expert's gate gradient joins its sum",
            ],
            Place::LastLayer => [
                "the last layer's shared expert's down gradient",
                "the last layer's shared expert's down gradient joins its sum",
                "the last layer's shared expert's up output gradient",
                "the last layer's shared expert's up input gradient all-reduced over tp",
                "the last layer's shared expert's up input gradient joins the gate vector's",
                "the last layer's shared expert's gate input gradient joins up's",
                "the last layer's shared expert's gate gradient joins its sum",
            ],
        }
    }
}

/// The points of a shared expert's backward at `place`: `beside` is what the micro-batch holds
/// there beyond the shared expert's own buffers (the MLP norm's output, which the routed experts
/// still read, and the layer's output gradient among them), `made_before` the chunk's gradients
/// made before it. Empty for a model without a shared expert.
pub(super) fn shared_expert_points(
    shape: &StageShape,
    place: Place,
    beside: &[Term],
    made_before: f64,
) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, hidden, gathered, .. } = shape.sizes;
    let Some(experts) = shape.model.experts.as_ref().filter(|experts| experts.shared_expert) else {
        return Vec::new();
    };
    if shape.tsp > 1 {
        return ring_points(shape, place, beside, made_before, None);
    }
    let [down_made, down_joins, up_output_gradient, up_input_reduced, up_input_joins, gate_input_joins, gate_joins] =
        place.shared_expert_names();
    let intermediate = local_tokens * ffn * element;
    // Without SP the gate vector's backward comes first: its weight gradient is made and its input
    // gradient live until the first sum (up's). Under SP it comes last, after gate's, the gate
    // logit's gradient live until then beside the layer's output gradient all-gathered over tp;
    // with the load-balancing loss the router's backward comes before the shared expert's, its
    // weight gradient live from then on and its input gradient until up's joins it.
    let sequence_parallel = shape.sequence_parallel();
    let (gate_vector, gate_vector_input) = if sequence_parallel {
        (0.0, None)
    } else {
        (hidden * element, Some(Term { name: "the gate vector's input gradient", bytes: gathered }))
    };
    let logit_gradient =
        sequence_parallel.then_some(Term { name: "the gate logit's gradient", bytes: local_tokens * element });
    let new_sum = |name| Some(Term { name, bytes: shape.gate });
    let point = |name, so_far, own: Vec<Term>, new_sum, first_sum_made: bool| {
        let mut held = beside.to_vec();
        held.extend(beside_under_sequence_parallelism(shape, first_sum_made));
        held.extend(logit_gradient.clone());
        held.extend(own);
        Candidate { name, so_far, held, new_sum, pending: KeptWholePending::NONE, sum_pending: 0.0 }
    };
    // Under ZeRO-2 and 3 each weight gradient is reduce-scattered where it would be all-reduced,
    // staged whole beside itself: its shard, written where the staging was (the planner counts the
    // larger), joins its sum after, below that point.
    let shards = shape.shards;
    let staging = |name| shape.scattered.then_some(Term { name, bytes: shape.gate });
    let before_reduction = |all_reduced, scattered| Term {
        name: if shape.scattered { scattered } else { all_reduced },
        bytes: shape.gate,
    };
    let gate_point = point(
        gate_joins,
        made_before + (gate_vector + if shape.scattered { 2.0 } else { 3.0 } * shape.gate) / shards,
        [
            Term { name: "the MLP norm output's gradient from the shared expert", bytes: gathered },
            // Beside its replicas gate's output gradient is freed before its weight gradient's
            // all-reduce.
            if shape.reduced {
                before_reduction(
                    "the shared gate gradient before its all-reduce",
                    "the shared gate gradient before its reduce-scatter",
                )
            } else {
                Term { name: "the shared gate output gradient", bytes: intermediate }
            },
        ]
        .into_iter()
        .chain(staging("the shared gate gradient's reduce-scatter staging"))
        .collect(),
        new_sum("the joining shared gate gradient's new sum beside the old").filter(|_| !shape.scattered),
        true,
    );
    // As down's weight gradient is made: gate, up and their product (kept) still live, beside the
    // scaled output's gradient, the gate vector's input gradient (without SP) and down's input
    // gradient.
    let mut down_gradient_made = vec![
        Term { name: "the shared expert's gate, up and their product (kept)", bytes: 3.0 * intermediate },
        Term { name: "the shared expert's scaled output's gradient", bytes: gathered },
    ];
    down_gradient_made.extend(gate_vector_input.clone());
    down_gradient_made.push(Term { name: "the shared down projection's input gradient", bytes: intermediate });
    let regathered = weights_regathered(shape);
    // Past down's weight gradient, as up's input gradient is made: gate and up freed, the SiLU
    // product's two gradients live, down's weight gradient made (without SP the gate vector's too).
    let up_input_point = |name, own: Vec<Term>| {
        point(
            name,
            made_before + (gate_vector + shape.gate) / shards,
            std::iter::once(Term { name: "the SiLU product's two gradients", bytes: 2.0 * intermediate })
                .chain(own)
                .chain(weights_regathered_past_up(shape))
                .collect(),
            None,
            false,
        )
    };
    // Under SP with the load-balancing loss up's input gradient (a partial sum over tp's share of
    // the channels) is all-reduced over tp before it joins the router's.
    let up_input_reduced = (sequence_parallel && experts.load_balancing_loss).then(|| {
        up_input_point(
            up_input_reduced,
            vec![Term { name: "up's input gradient and its all-reduce over tp", bytes: 2.0 * gathered }],
        )
    });
    // Without SP it joins the gate vector's, the MLP norm output's first gradient sum (down's input
    // gradient freed too). On more tokens than the shared expert is wide its three
    // `[tokens, hidden]` buffers outweigh the points before.
    let up_input_joins = gate_vector_input.clone().map(|gate_vector_input| {
        up_input_point(
            up_input_joins,
            vec![
                gate_vector_input,
                Term { name: "up's input gradient and its sum with the gate vector's", bytes: 2.0 * gathered },
            ],
        )
    });
    // Under SP without the loss, up's input gradient is the MLP norm output's first from the shared
    // expert: gate's joins it, the two and their sum live beside gate's output gradient (which
    // gate's weight gradient reads next), down's and up's weight gradients made and reduced, and
    // the weights gathered again for them freed. (Below the planner by 0.7% at dp=2 × tp=4 before
    // it was modelled.)
    let gate_input_joins = (sequence_parallel && !experts.load_balancing_loss).then(|| {
        point(
            gate_input_joins,
            made_before + (gate_vector + 2.0 * shape.gate) / shards,
            vec![
                Term { name: "the shared gate output gradient", bytes: intermediate },
                Term { name: "up's and gate's input gradients and their sum", bytes: 3.0 * gathered },
            ],
            None,
            true,
        )
    });
    if shape.reduced {
        let unreduced = || {
            before_reduction(
                "the shared down gradient before its all-reduce",
                "the shared down gradient before its reduce-scatter",
            )
        };
        return [
            point(
                down_made,
                made_before + gate_vector / shards,
                [down_gradient_made, vec![unreduced()]].concat().into_iter().chain(regathered.clone()).collect(),
                None,
                false,
            ),
            point(
                down_joins,
                made_before + (gate_vector + if shape.scattered { 0.0 } else { shape.gate }) / shards,
                [Term { name: "the shared expert's gate and up (kept)", bytes: 2.0 * intermediate }]
                    .into_iter()
                    .chain(gate_vector_input.clone())
                    .chain([
                        Term { name: "the shared down projection's input gradient", bytes: intermediate },
                        unreduced(),
                    ])
                    .chain(staging("the shared down gradient's reduce-scatter staging"))
                    .chain(regathered.clone())
                    .collect(),
                new_sum("the joining shared down gradient's new sum beside the old").filter(|_| !shape.scattered),
                false,
            ),
            point(
                up_output_gradient,
                made_before + (gate_vector + shape.gate) / shards,
                [Term { name: "the shared expert's gate (kept)", bytes: intermediate }]
                    .into_iter()
                    .chain(gate_vector_input)
                    .chain([Term {
                        name: "the shared down projection's input gradient, gate's and up's output gradients",
                        bytes: 3.0 * intermediate,
                    }])
                    .chain(regathered)
                    .collect(),
                None,
                false,
            ),
            gate_point,
        ]
        .into_iter()
        .chain(up_input_reduced)
        .chain(up_input_joins)
        .chain(gate_input_joins)
        .collect();
    }
    [
        point(
            down_joins,
            made_before + gate_vector + shape.gate,
            down_gradient_made,
            new_sum("the joining shared down gradient's new sum beside the old"),
            false,
        ),
        gate_point,
    ]
    .into_iter()
    .chain(up_input_reduced)
    .chain(up_input_joins)
    .chain(gate_input_joins)
    .collect()
}

/// Under tsp a shared expert is a ring MLP like a dense layer's ([`tsp_ring::ring_backward`]),
/// its output scaled by the gate: its backward makes the gate logit's gradient (the ring's output
/// and the logit freed), the ring output's gradient, then the gate vector's input and weight
/// gradients (the latter joins its sum at once; under zero bubble it is W's), and runs the ring
/// beside the two. Past the ring its input gradient joins the gate vector's (three `[tokens,
/// hidden]` buffers live), the ring's gradients made. `made_in_b`: under zero bubble, where B runs
/// the ring, all the chunk's B gradients (the sums of those not made yet do not exist on the
/// micro-batch's first B of the chunk).
pub(super) fn ring_points(
    shape: &StageShape,
    place: Place,
    beside: &[Term],
    made_before: f64,
    made_in_b: Option<f64>,
) -> Vec<Candidate> {
    let StepSizes { element, hidden, gathered, .. } = shape.sizes;
    let (names, summed) = match place {
        Place::FirstLayer => {
            (&tsp_ring::SHARED_FIRST_LAYER, "first layer's shared expert ring's input gradient joins the gate vector's")
        }
        Place::LastLayer => (
            &tsp_ring::SHARED_LAST_LAYER,
            "the last layer's shared expert ring's input gradient joins the gate vector's",
        ),
    };
    let gate_vector_input = Term { name: "the gate vector's input gradient", bytes: gathered };
    let mut held = beside.to_vec();
    held.extend([
        Term { name: "the shared expert ring output's gradient", bytes: gathered },
        gate_vector_input.clone(),
    ]);
    let gate_vector = if made_in_b.is_some() { 0.0 } else { hidden * element / shape.shards };
    let made_before = made_before + gate_vector;
    let mut points = tsp_ring::ring_backward(shape, names, held, made_before, made_in_b);
    let mut held = beside.to_vec();
    held.extend([
        gate_vector_input,
        Term { name: "the ring's input gradient and its sum with the gate vector's", bytes: 2.0 * gathered },
    ]);
    let so_far = made_before + shape.sharded(shape.shared_ring_gradients(), 0.0);
    points.push(Candidate {
        name: summed,
        so_far,
        held,
        new_sum: None,
        pending: KeptWholePending::NONE,
        sum_pending: made_in_b.map_or(0.0, |made_in_b| made_in_b - so_far),
    });
    points
}

/// What a layer's forward keeps of a shared expert for its backward (bytes): gate, up and their
/// product (but under tsp, whose ring keeps none), its output and the gate logit; nothing under
/// full recomputation or without a shared expert.
pub(super) fn shared_expert_kept(shape: &StageShape) -> f64 {
    let StepSizes { element, local_tokens, ffn, hidden, .. } = shape.sizes;
    let shared_expert = shape.shared_expert();
    if !shared_expert || shape.recompute() == Recompute::Full {
        return 0.0;
    }
    let ring = if shape.tsp > 1 { 0.0 } else { 3.0 * ffn };
    local_tokens * (ring + hidden + 1.0) * element
}

/// A layer's shared expert's gradients, as the rank holds them: its gate vector's and its three
/// projections' (tp's or tsp's shard).
pub(super) fn shared_expert_gradients(shape: &StageShape) -> f64 {
    (shape.sizes.hidden * shape.sizes.element + 3.0 * shape.gate / shape.tsp as f64) / shape.shards
}

/// Under SP what a shared expert's backward holds beside its own buffers: the layer's output
/// gradient all-gathered over tp, and with the load-balancing loss the router's gradients from it
/// (its backward comes first): its weight gradient, and its input gradient until up's input
/// gradient joins it (`first_sum_made`). Empty outside SP.
pub(super) fn beside_under_sequence_parallelism(shape: &StageShape, first_sum_made: bool) -> Vec<Term> {
    let gathered = shape.sizes.gathered;
    let Some(experts) = shape.model.experts.as_ref().filter(|_| shape.sequence_parallel()) else {
        return Vec::new();
    };
    let mut terms = vec![Term { name: "the layer's output gradient, all-gathered", bytes: gathered }];
    if experts.load_balancing_loss {
        terms.push(Term { name: "the router's weight gradient from the load-balancing loss", bytes: shape.router() });
        if !first_sum_made {
            terms.push(Term { name: "the router's input gradient from the load-balancing loss", bytes: gathered });
        }
    }
    terms
}

/// Under ZeRO-3 with full recomputation the MLP norm's, the shared gate's and up's weights, gathered
/// again to recompute the forward, stay until gate's and up's input gradients (down's is freed with
/// its own input gradient, made before its weight gradient there, of equal size); else none.
pub(super) fn weights_regathered(shape: &StageShape) -> Option<Term> {
    Some(Term {
        name: "the MLP norm's, the shared gate's and up's weights, gathered again",
        bytes: shape.mlp_input_weights_gathered_again(),
    })
    .filter(|term| shape.recompute() == Recompute::Full && term.bytes > 0.0)
}

/// [`weights_regathered`] once up's input gradient is made, which frees up's: the MLP norm's and
/// the shared gate's, and under SP the gate vector's, gathered again to recompute the gate logit
/// and read by its backward, which comes last there.
fn weights_regathered_past_up(shape: &StageShape) -> Option<Term> {
    let gate_vector = if shape.sequence_parallel() { shape.sizes.hidden } else { 0.0 };
    Some(Term {
        name: "the MLP norm's, the shared gate's (and under SP the gate vector's) weights, gathered again",
        bytes: shape.gate_up_gathered_again(shape.gate)
            + shape.norms_gathered_again((shape.norm + gate_vector) * shape.sizes.element),
    })
    .filter(|term| shape.recompute() == Recompute::Full && term.bytes > 0.0)
}
