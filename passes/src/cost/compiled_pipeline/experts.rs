//! The points of a layer's routed experts' backward (a mixture of experts) where a stage may peak,
//! in a chunk's first layer or at the head of its backward ([`Place`]).
//!
//! A layer's MLP backward (after a shared expert's, [`super::shared_expert`]) runs the router's
//! backward for the load-balancing loss (its input and weight gradients), then the routed experts':
//! over ep one instruction dispatching the rows to the experts' ranks and back, else one kernel a
//! gradient, the input gradient first (under tp each rank's partial sum over its share of the
//! experts' channels, all-reduced over tp; then summed with the MLP norm output's gradient so far),
//! then the router's, then the three `[E, h, f_e]` weight gradients; beside dp or cp (or over ep
//! beside tsp) each weight gradient is all-reduced before it joins its sum, the MLP norm's output
//! freed first. Then the MLP norm's backward, whose input gradient is summed into the attention
//! residual's gradient.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::chunk::{Candidate, KeptWholePending};
use super::shared_expert::shared_expert_gradients;
use super::{Place, StageShape};

impl Place {
    /// The names of the routed experts' points there.
    fn experts_names(self) -> ExpertsNames {
        match self {
            Place::FirstLayer => ExpertsNames {
                dispatched: "first layer's experts' backward dispatched",
                router_summed: "first layer's router gradients summed past the dispatch",
                made: "first layer's expert gradients made beside their weights gathered again",
                made_whole: "first layer's expert gradients made, before their reduce-scatter",
                made_unreduced: "first layer's expert gradients made, before their all-reduce",
                input_gradient_reduced: "first layer's routed experts' input gradient all-reduced over tp",
                joining: "first layer's expert gradient joins its sum",
                last_joining: "first layer's last expert gradient joins its sum, its unreduced copy live",
                summed: "first layer's MLP norm output's gradients summed",
                residual_gradient: "first layer's attention residual gradient",
            },
            Place::LastLayer => ExpertsNames {
                dispatched: "the last layer's experts' backward dispatched",
                router_summed: "the last layer's router gradients summed past the dispatch",
                made: "the last layer's expert gradients made beside their weights gathered again",
                made_whole: "the last layer's expert gradients made, before their reduce-scatter",
                made_unreduced: "the last layer's expert gradients made, before their all-reduce",
                input_gradient_reduced: "the last layer's routed experts' input gradient all-reduced over tp",
                joining: "the last layer's expert gradient joins its sum",
                last_joining: "the last layer's last expert gradient joins its sum, its unreduced copy live",
                summed: "the last layer's MLP norm output's gradients summed",
                residual_gradient: "the last layer's attention residual gradient",
            },
        }
    }
}

struct ExpertsNames {
    dispatched: &'static str,
    router_summed: &'static str,
    made: &'static str,
    made_whole: &'static str,
    made_unreduced: &'static str,
    input_gradient_reduced: &'static str,
    joining: &'static str,
    last_joining: &'static str,
    summed: &'static str,
    residual_gradient: &'static str,
}

/// The points of a mixture's routed experts' backward at `place`, in order: `context` is what the
/// micro-batch holds there beyond the MLP's own buffers (the MLP norm's output and the layer's
/// output gradient among them; and the received expert counts where they are still live),
/// `made_before` the chunk's gradients made before the layer's MLP backward. Empty for a dense
/// model.
pub(super) fn experts_points(shape: &StageShape, place: Place, context: &[Term], made_before: f64) -> Vec<Candidate> {
    let StepSizes { stream, gathered, .. } = shape.sizes;
    if shape.model.experts.is_none() {
        return Vec::new();
    }
    let names = place.experts_names();
    let mut points: Vec<Candidate> = dispatched(shape, names.dispatched, context, made_before)
        .into_iter()
        .chain(router_gradients_summed(shape, names.router_summed, context, made_before))
        .chain(input_gradient_reduced(shape, place, context, made_before))
        .chain(input_gradients_summed(shape, place, context, made_before))
        .collect();
    // (Where the experts' gradients are all-reduced, the point where they are made may tie with
    // their joining: listed after it, the peak keeps the joining's name.)
    let made = made_before_scattered(shape, place, context, made_before);
    let (made_first, made_last) = if unreduced_beyond_waiting(shape) > 0.0 { (None, made) } else { (made, None) };
    points.extend(made_first);
    if let Some(joining) = joining(shape, place, context, made_before) {
        let summed = summed(shape, names.summed, &joining);
        points.extend(last_joining(shape, names.last_joining, &joining));
        points.push(joining);
        points.extend(summed);
    }
    points.extend(made_last);
    // As the attention residual's gradient is summed, past the MLP norm's backward: the router's
    // and experts' gradients made, reduced and summed, the MLP norm's output freed, its output's
    // gradient live beside the norm's input gradient and their sum.
    let mut held = context.to_vec();
    held.extend([
        Term { name: "the MLP norm output's gradient", bytes: gathered },
        Term { name: "the MLP norm output, freed", bytes: -gathered },
        Term { name: "the MLP norm's input gradient and the attention residual's gradient", bytes: 2.0 * stream },
    ]);
    points.push(Candidate::made(names.residual_gradient, made_before + shape.layer_mlp_gradient_shards(), held));
    points
}

/// As one of the routed-expert gradients (`[E, h, f_e]` matrices, larger than a dense projection)
/// joins its sum, the router's and the experts' gradients made: without dp the last of the three;
/// under dp or cp (or over ep beside tsp) the first, reduced while the other two wait unreduced
/// beside it (the mixture's backward makes all three at once; [`last_joining`] is the last), the
/// MLP norm's output freed. Under SP the experts read the output gradient all-gathered over tp
/// (their output's reduce-scatter's backward), freed with the MLP norm's output before dp's
/// all-reduce. Over ep the router's input and weight gradients from the load-balancing loss, made
/// before the dispatch, are summed with its results after them (beside dp or cp, or tsp, before
/// the experts' gradients are reduced).
pub(super) fn joining(shape: &StageShape, place: Place, context: &[Term], made_before: f64) -> Option<Candidate> {
    let gathered = shape.sizes.gathered;
    let experts = shape.model.experts.as_ref()?;
    let reduced = shape.experts_reduced;
    let matrix = expert_matrix(shape);
    let mut held = context.to_vec();
    held.push(Term { name: "the MLP norm output's gradient", bytes: gathered });
    if shape.experts_scattered() {
        held.push(Term { name: "the MLP norm output, freed", bytes: -gathered });
        held.push(Term { name: "the expert gradients before their reduce-scatter", bytes: 3.0 * matrix });
        held.push(Term { name: "its reduce-scatter's staging", bytes: matrix });
    } else if reduced {
        held.push(Term { name: "the MLP norm output, freed", bytes: -gathered });
        held.push(Term { name: UNREDUCED_EXPERT_GRADIENTS, bytes: 3.0 * matrix });
    }
    if shape.sequence_parallel() && !reduced {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: gathered });
    }
    // (Beside dp or cp the router's gradients are summed and its weight gradient reduced before
    // the experts' are.)
    if shape.dispatched() && experts.load_balancing_loss && !reduced {
        held.push(load_balancing_gradients(shape));
    } else if shape.dispatched() && experts.shared_expert && !reduced {
        // (Without the loss, the shared expert's input gradients, which the experts' joins next.)
        held.push(Term { name: SHARED_EXPERT_INPUT_GRADIENTS, bytes: shape.sizes.gathered });
    }
    // Under ZeRO-2 the router's gradient's shard has joined its sum (under ZeRO-3 the router's
    // gradient is scattered after the experts', whole until then); the joining one's is written
    // where its staging was (the planner counts the larger), and joins its sum after.
    held.extend(router_gradient_whole(shape));
    // Over ep under ZeRO-3 the weights the dispatch read, gathered again, are freed with the MLP
    // norm's output, after the layer's MLP backward (beside cp, which shards the experts too, the
    // gathered copies are freed before their gradients join); beside tsp, or beside dp or cp
    // where ZeRO keeps the experts whole, the router's before the gradients' all-reduces, the MLP
    // norm's (gathered under full recomputation) after its backward.
    if !shape.experts_scattered() {
        if reduced {
            held.extend(shape.norm_regathered(MLP_NORM_REGATHERED));
        } else {
            held.extend(weights_gathered_again(shape));
        }
    }
    // (Over ep under ZeRO-2 the router's gradient from the dispatch is among them whole.)
    let so_far = made_before + shape.layer_mlp_gradient_shards() - not_yet_among_the_gradients(shape)
        + router_whole_beyond_its_shard(shape);
    Some(Candidate {
        name: place.experts_names().joining,
        so_far,
        held,
        new_sum: (!shape.experts_scattered())
            .then_some(Term { name: "the joining expert gradient's new sum beside the old", bytes: matrix }),
        pending: KeptWholePending::NONE,
        sum_pending: router_sum_pending(shape),
    })
}

/// Under ZeRO-3 with full recomputation the MLP norm's weight, gathered again to recompute its
/// output, live to its backward.
const MLP_NORM_REGATHERED: &str = "the MLP norm's weight, gathered again to recompute its output";

/// The term of [`joining`] for the routed-expert gradients that wait unreduced beside dp or cp (or
/// over ep beside tsp).
const UNREDUCED_EXPERT_GRADIENTS: &str = "the expert gradients before their all-reduce (over dp, cp or tsp)";

/// Beside dp or cp (or over ep beside tsp) without ZeRO-2 or 3 the three routed-expert gradients
/// are reduced and join their sums one after another, each unreduced copy freed once its sum is
/// made: as the last joins, the first two are among the micro-batch's gradients, only its own
/// unreduced copy beside it (`first`: the first's [`joining`]).
pub(super) fn last_joining(shape: &StageShape, name: &'static str, first: &Candidate) -> Option<Candidate> {
    if !shape.experts_reduced || shape.experts_scattered() {
        return None;
    }
    let mut last = first.clone();
    last.name = name;
    last.so_far += experts_waiting(shape);
    for term in &mut last.held {
        if term.name == UNREDUCED_EXPERT_GRADIENTS {
            *term = Term { name: "the last expert gradient before its all-reduce", bytes: expert_matrix(shape) };
        }
    }
    Some(last)
}

/// Under ZeRO-3 the router's gradient, whole: its reduce-scatter follows the experts' (autodiff
/// reaches the gathers' conjugates in reverse), under ZeRO-2 it precedes them.
fn router_gradient_whole(shape: &StageShape) -> Option<Term> {
    // (Not a shared expert's gate vector, scattered in its own backward.)
    let router = shape.router();
    (shape.router_gathered_again() > 0.0)
        .then_some(Term { name: "the router's gradient, whole before its reduce-scatter", bytes: router })
}

/// Under ZeRO-3 the router's and the experts' weights gathered again for the experts' backward
/// (their input gradient first), and under full recomputation the MLP norm's, gathered to recompute
/// its output.
fn weights_gathered_again(shape: &StageShape) -> Option<Term> {
    let router = router_gradient_whole(shape).map_or(0.0, |term| term.bytes);
    let norm = shape.norm_regathered(MLP_NORM_REGATHERED).map_or(0.0, |term| term.bytes);
    // (Over ep alone, or where their rows do not divide, ZeRO does not shard the experts.)
    let experts =
        if shape.experts_scattered() { shape.weights_gathered_again(3.0 * expert_matrix(shape)) } else { 0.0 };
    let bytes = router + experts + norm;
    (bytes > 0.0).then_some(Term {
        name: "the router's and the experts' weights (under full recomputation the MLP norm's), gathered again",
        bytes,
    })
}

/// Under ZeRO-2 and 3, as the routed experts' last weight gradient is made: the three gradients,
/// whole before their reduce-scatters, beside the MLP norm's output (not yet freed) and its
/// gradient, and under SP the output gradient all-gathered over tp; under ZeRO-3 also the router's
/// and the three experts' weights gathered again for the backward and the router's gradient
/// whole, held apart (under ZeRO-2 whole among the micro-batch's gradients, its sum not made).
pub(super) fn made_before_scattered(
    shape: &StageShape,
    place: Place,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    shape.model.experts.as_ref()?;
    let router_whole = router_gradient_whole(shape);
    // (Over ep one instruction makes every gradient of the experts' backward, [`dispatched`].)
    if shape.dispatched() {
        return None;
    }
    let names = place.experts_names();
    if !(shape.experts_scattered() || router_whole.is_some()) {
        return made_before_reduced(shape, names.made_unreduced, context, made_before);
    }
    let name = if router_whole.is_some() { names.made } else { names.made_whole };
    let matrix = expert_matrix(shape);
    let mut held = context.to_vec();
    held.extend(weights_gathered_again(shape));
    held.extend([
        Term { name: "the MLP norm output's gradient", bytes: shape.sizes.gathered },
        Term { name: "the expert gradients before their reduce-scatter", bytes: 3.0 * matrix },
    ]);
    let router_among_them = router_whole_as_experts_are_made(shape);
    held.extend(router_whole);
    if shape.sequence_parallel() {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: shape.sizes.gathered });
    }
    let so_far = made_before + shape.layer_mlp_gradient_shards() - not_yet_among_the_gradients(shape)
        + router_among_them
        - shape.router_shard(router_among_them);
    Some(Candidate { sum_pending: router_among_them, ..Candidate::made(name, so_far, held) })
}

/// Of the routed experts' gradients, those [`made_before_scattered`] holds unreduced beyond
/// [`not_yet_among_the_gradients`] where they are all-reduced ([`made_before_reduced`]): the
/// first, whose reduction [`joining`] counts (bytes; else 0).
pub(super) fn unreduced_beyond_waiting(shape: &StageShape) -> f64 {
    let all_reduced = shape.experts_reduced && !shape.experts_scattered() && router_gradient_whole(shape).is_none();
    if all_reduced && !shape.dispatched() {
        expert_matrix(shape)
    } else {
        0.0
    }
}

/// Beside dp or cp where ZeRO does not shard the routed experts (without ZeRO, or where their rows
/// do not divide), as their last weight gradient is made: the three gradients, whole before their
/// all-reduces, beside the MLP norm's output (not yet freed) and its gradient, and under SP the
/// output gradient all-gathered over tp; the router's gradient reduced and summed before them
/// (under ZeRO-3 with full recomputation also the MLP norm's weight, gathered again).
fn made_before_reduced(
    shape: &StageShape,
    name: &'static str,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    if unreduced_beyond_waiting(shape) == 0.0 {
        return None;
    }
    let matrix = expert_matrix(shape);
    let mut held = context.to_vec();
    held.extend(weights_gathered_again(shape));
    held.extend([
        Term { name: "the MLP norm output's gradient", bytes: shape.sizes.gathered },
        Term { name: UNREDUCED_EXPERT_GRADIENTS, bytes: 3.0 * matrix },
    ]);
    if shape.sequence_parallel() {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: shape.sizes.gathered });
    }
    let so_far = made_before + shape.layer_mlp_gradient_shards() - 3.0 * matrix;
    Some(Candidate::made(name, so_far, held))
}

/// Under ZeRO-2, as the routed experts' weight gradients are made ([`made_before_scattered`]), the
/// router's gradient (made before them) is among the micro-batch's gradients whole, its sum not
/// made yet: it is reduce-scattered after them, or under tp all-reduced and its shard sliced out
/// (bytes; 0 under ZeRO-3, which holds it whole apart, [`router_gradient_whole`]).
pub(super) fn router_whole_as_experts_are_made(shape: &StageShape) -> f64 {
    if router_gradient_whole(shape).is_none() {
        shape.router()
    } else {
        0.0
    }
}

/// Over ep beside the load-balancing loss, next as the MLP norm output's gradients from the router
/// (made before the experts' backward) and from the experts are summed (without the loss, beside
/// a shared expert, from the shared expert and the experts): every buffer of the experts'
/// `joining` point is live, and the sum beside them. (Not beside dp or cp, which reduce the
/// experts' gradients first.)
pub(super) fn summed(shape: &StageShape, name: &'static str, joining: &Candidate) -> Option<Candidate> {
    let experts = shape.model.experts.as_ref()?;
    let summed_with = experts.load_balancing_loss || experts.shared_expert;
    if !shape.dispatched() || !summed_with || shape.experts_reduced {
        return None;
    }
    let mut held = joining.held.clone();
    held.push(Term {
        name: "the MLP norm output's gradients from the router and the experts, summed",
        bytes: shape.sizes.gathered,
    });
    Some(Candidate { name, new_sum: None, held, ..joining.clone() })
}

/// Under tp the routed experts' input gradient, each rank's partial sum over its share of their
/// channels, is all-reduced over tp before it joins the MLP norm output's gradient: a stage may
/// peak there, beside what [`routed_experts_operands`] holds and under SP the output gradient
/// all-gathered over tp, which the experts read, none of the layer's routed-expert and router
/// weight gradients made yet (over ep, without replicas of the experts, the dispatch made the
/// experts' gradients and the router's from them first).
pub(super) fn input_gradient_reduced(
    shape: &StageShape,
    place: Place,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    let name = place.experts_names().input_gradient_reduced;
    let gathered = shape.sizes.gathered;
    // (Over ep, without replicas of the experts, the dispatch made the layer's routed-expert
    // gradients, whole, and the router's from them before the all-reduce.)
    let over_ep = shape.dispatched();
    if shape.tp == 1 || (over_ep && (shape.experts_reduced || shape.experts_scattered())) {
        return None;
    }
    // (Over ep under SP without the load-balancing loss, whose input gradient it would be summed
    // with whole, the experts' input gradient is reduce-scattered over tp instead, after their
    // and the router's gradients joined their sums and the output gradient was freed: less than
    // the dispatch held.)
    let load_balancing_loss = shape.model.experts.as_ref().is_some_and(|experts| experts.load_balancing_loss);
    if over_ep && shape.sequence_parallel() && !load_balancing_loss {
        return None;
    }
    // (Without the loss or a shared expert, whose gradients it would be summed with, the
    // all-reduce (under SP a reduce-scatter, staged whole) comes after the experts' and the
    // router's weight gradients are made, reduced and summed, their weights (gathered again under
    // ZeRO-3), the MLP norm's output and under SP the gathered output gradient freed, under ZeRO-3
    // the MLP norm's weight gathered for its backward: counting the experts' weights there was
    // 1.3% above the planner at dp=2 × tp=4, the router's gradient and weight 4 KB above over ep.)
    let weight_gradients_first = !load_balancing_loss && !shape.shared_expert();
    let (mut held, mut so_far) = if weight_gradients_first {
        let mut held = context.to_vec();
        held.extend([
            Term { name: "the MLP norm output, freed", bytes: -gathered },
            Term {
                name: "the MLP norm's weight, gathered for its backward",
                bytes: shape.norms_gathered_again(shape.norm * shape.sizes.element),
            },
        ]);
        (held, made_before + shape.layer_mlp_gradient_shards())
    } else {
        routed_experts_operands(shape, context, made_before)?
    };
    if shape.sequence_parallel() && !weight_gradients_first {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: gathered });
    }
    held.push(Term { name: "the routed experts' input gradient and its all-reduce over tp", bytes: 2.0 * gathered });
    if over_ep && !weight_gradients_first {
        so_far += shape.layer_routed_experts();
        held.push(Term { name: "the router's gradient from the experts' backward", bytes: shape.router() });
    }
    Some(Candidate::made(name, so_far, held))
}

/// Without ep, next (under tp once it is all-reduced) the routed experts' input gradient is summed
/// with the MLP norm output's gradient so far (the router's input gradient from the load-balancing
/// loss, or a shared expert's input gradients' sum, which that joined), before the experts' and
/// the router's weight gradients are made: the stage may peak there beside what
/// [`routed_experts_operands`] holds, under ZeRO-3 the experts' weights still gathered for their
/// weight gradients. (Over ep the dispatch comes first: [`summed`].)
pub(super) fn input_gradients_summed(
    shape: &StageShape,
    place: Place,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    let experts = shape.model.experts.as_ref()?;
    if shape.dispatched() || !(experts.load_balancing_loss || experts.shared_expert) {
        return None;
    }
    let gathered = shape.sizes.gathered;
    let (mut held, so_far) = routed_experts_operands(shape, context, made_before)?;
    if shape.sequence_parallel() {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: gathered });
    }
    held.push(Term {
        name: "the routed experts' input gradient and the MLP norm output's gradients' sum",
        bytes: 2.0 * gathered,
    });
    Some(Candidate::made(place.experts_names().summed, so_far, held))
}

/// What a layer's MLP backward holds as its routed experts' backward begins, beyond `context`,
/// and the chunk's gradients made by then (`made_before` and a shared expert's, whose backward
/// comes first): the router's gradients from the load-balancing loss, made just before, and a
/// shared expert's input gradients' sum (with the loss, the router's input gradient joined that
/// sum); under ZeRO-3 the router's and the experts' weights gathered again.
fn routed_experts_operands(shape: &StageShape, context: &[Term], made_before: f64) -> Option<(Vec<Term>, f64)> {
    let experts = shape.model.experts.as_ref()?;
    let mut held = context.to_vec();
    let mut so_far = made_before;
    if experts.shared_expert {
        so_far += shared_expert_gradients(shape);
        if !experts.load_balancing_loss {
            held.push(Term { name: SHARED_EXPERT_INPUT_GRADIENTS, bytes: shape.sizes.gathered });
        }
    }
    if experts.load_balancing_loss {
        held.push(load_balancing_gradients(shape));
    }
    held.extend(weights_gathered_again(shape));
    Some((held, so_far))
}

/// A shared expert's input gradients, summed: without the load-balancing loss, what the routed
/// experts' input gradient joins.
const SHARED_EXPERT_INPUT_GRADIENTS: &str = "the shared expert's input gradients, summed";

/// The router's input and weight gradients from the load-balancing loss (the rank's tokens').
fn load_balancing_gradients(shape: &StageShape) -> Term {
    Term {
        name: "the router's input and weight gradients from the load-balancing loss",
        bytes: shape.router() + shape.sizes.gathered,
    }
}

/// Over ep one instruction makes the routed experts' input, router and weight gradients at once,
/// dispatching the rows to the experts' ranks and back, from a copy of its operands (the MLP
/// norm's output, the router, the rank's experts and the output gradient, gathered under SP) made
/// before its results are written: a stage may peak as it makes that copy, beside what
/// [`routed_experts_operands`] holds.
pub(super) fn dispatched(
    shape: &StageShape,
    name: &'static str,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    let StepSizes { element, gathered, .. } = shape.sizes;
    if !shape.dispatched() {
        return None;
    }
    let router = shape.router();
    let (mut held, so_far) = routed_experts_operands(shape, context, made_before)?;
    let routed = shape.model.routed_expert_weights() as f64 / (shape.tp * shape.layout.expert_degree()) as f64;
    // (Under SP the output gradient it copies is the one all-gathered over tp, live beside.)
    if shape.sequence_parallel() {
        held.push(Term { name: "the layer's output gradient, all-gathered", bytes: gathered });
    }
    held.push(Term { name: "the dispatch's copy of its operands", bytes: 2.0 * gathered + router + routed * element });
    Some(Candidate::made(name, so_far, held))
}

/// Under tsp beside the load-balancing loss, past the dispatch: the MLP norm output's gradients
/// from the router and from the experts summed (both freed), then the router's two weight
/// gradients summed, before their all-reduce over the axis (the tokens' share of it): the
/// dispatch's router and expert gradients live beside that sum, the router's gradient from the
/// loss and the input gradients' sum (and under ZeRO-3 the weights gathered again).
pub(super) fn router_gradients_summed(
    shape: &StageShape,
    name: &'static str,
    context: &[Term],
    made_before: f64,
) -> Option<Candidate> {
    let experts = shape.model.experts.as_ref()?;
    if shape.tsp == 1 || !shape.dispatched() || !experts.load_balancing_loss {
        return None;
    }
    let (router, gathered) = (shape.router(), shape.sizes.gathered);
    let mut held = context.to_vec();
    held.extend(weights_gathered_again(shape));
    held.extend([
        Term { name: "the router's weight gradient from the load-balancing loss", bytes: router },
        Term { name: "the dispatch's router and expert gradients", bytes: router + shape.layer_routed_experts() },
        Term { name: "the MLP norm output's gradients from the router and the experts, summed", bytes: gathered },
        Term { name: "the router's two gradients, summed", bytes: router },
    ]);
    Some(Candidate::made(name, made_before, held))
}

/// Of a layer's routed-expert and router gradients, the bytes not among the micro-batch's
/// gradients as one joins its sum ([`joining`]; as the last is made under ZeRO-2 and 3,
/// [`made_before_scattered`]): under ZeRO-2 and 3 the three experts' shards (each held
/// whole) and under ZeRO-3 the router's too; under dp the two waiting unreduced.
pub(super) fn not_yet_among_the_gradients(shape: &StageShape) -> f64 {
    let router = shape.router_shard(router_gradient_whole(shape).map_or(0.0, |term| term.bytes));
    if shape.experts_scattered() {
        3.0 * expert_matrix(shape) / shape.expert_shards + router
    } else {
        experts_waiting(shape) + router
    }
}

/// Under dp (or cp) the two routed-expert gradients of a layer that wait unreduced while the first
/// is reduced and joins its sum (bytes; else 0).
fn experts_waiting(shape: &StageShape) -> f64 {
    if shape.experts_reduced {
        2.0 * expert_matrix(shape)
    } else {
        0.0
    }
}

/// One of a layer's three routed-expert weight gradients on the rank (an `[E, h, f_e]` matrix, its
/// tp and ep share), in bytes; 0 for a dense model.
fn expert_matrix(shape: &StageShape) -> f64 {
    let StepSizes { element, split, .. } = shape.sizes;
    (shape.model.routed_expert_weights() / 3) as f64 / split / shape.layout.expert_degree() as f64 * element
}

/// Over ep beside the load-balancing loss, the router's gradient from the experts' backward, made
/// with the experts' and summed with its gradient from the loss only after them, or without the
/// loss beside tp or over ep, reduced after them: its running sum is made then (bytes; else 0).
/// Under ZeRO-3 it is held whole apart ([`router_gradient_whole`]), none of it among the
/// micro-batch's gradients (0 here).
fn router_sum_pending(shape: &StageShape) -> f64 {
    match &shape.model.experts {
        Some(experts)
            if shape.dispatched()
                && experts.load_balancing_loss
                && !shape.experts_reduced
                && router_gradient_whole(shape).is_none() =>
        {
            shape.router()
        }
        // (Without the loss, beside tp or over ep without replicas, the router's gradient, made
        // before the experts' or with them, is reduced over those after them, and joins its sum
        // then.)
        Some(experts)
            if (shape.tp > 1 || shape.dispatched())
                && !experts.load_balancing_loss
                && !shape.experts_reduced
                && router_gradient_whole(shape).is_none() =>
        {
            shape.router()
        }
        _ => 0.0,
    }
}

/// Of that gradient ([`router_sum_pending`]), the bytes beyond the rank's shard under ZeRO-2:
/// whole until it is summed with the loss's and reduce-scattered, after the experts' gradients
/// join their sums, it is among the micro-batch's gradients whole.
pub(super) fn router_whole_beyond_its_shard(shape: &StageShape) -> f64 {
    let pending = router_sum_pending(shape);
    pending - shape.router_shard(pending)
}
