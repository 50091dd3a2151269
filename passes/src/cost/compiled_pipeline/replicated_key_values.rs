//! The points of a chunk's attention backward where tp does not divide the kv heads: every tp
//! rank holds all of k's and v's heads (`activation::kv_split` is 1), and its share of q's heads
//! reads them, so k's and v's gradients are partial sums over tp.
//!
//! The program all-reduces k's output gradient over tp before its RoPE backward (k's weight and
//! input gradients are whole sums from then on), v's weight and bias gradients once they are made
//! (under ZeRO-2 and 3 their dp shards, after the reduce-scatter), and v's and q's input gradients
//! each before it joins the attention norm output's gradient. v's and k's weight gradients are
//! whole over tp, tp times the size of a split one's, and a stage may peak as v's, made after its
//! input gradient, joins its sum beside its copy before the tp all-reduce (beside replicas, whose
//! all-reduce follows tp's, the copy tp reduced), or under ZeRO-2 and 3 as it is reduce-scattered,
//! staged whole; then as k's, made after the input gradients from v and k are summed, does the
//! same (no tp all-reduce: beside replicas its copy before theirs, without them k's gradient,
//! freed just after). It may peak so in the chunk's first layer, where the micro-batch has made
//! the most gradients, and (outside full recomputation, on a dense chunk of more than one layer)
//! in its last, where it still holds the most of its forward. Under zero bubble W makes the weight
//! gradients in the same order, B having made the input gradients: W's first layer holds what
//! its tail does, and k's and q's gradients. Beside cp the same points hold, k's and v's
//! gradients reduce-scattered back to the rank's tokens before. (Not under tsp, whose attention
//! backward differs; not where ZeRO keeps k and v whole; under zero bubble not on the first
//! chunk, whose W ends with the embedding's gradient.)

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{received_counts, Candidate, Chunk, KeptWholePending};
use super::first_layer::made_before_first_attention_inputs;
use super::head::in_flight_past_the_head;
use super::StageShape;

/// The first layer's points as v's and then k's weight gradient, whole over tp, joins its sum or
/// is reduce-scattered over dp (see the module doc); not under zero bubble.
pub(super) fn first_layer_weight_gradients(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, stream, gathered, .. } = shape.sizes;
    if !modelled(shape) || shape.zero_bubble {
        return Vec::new();
    }
    let mut context = chunk.first_layer_held_after_rope_backward();
    context.extend(received_counts(shape, chunk, false));
    // (Under SP q's RoPE backward comes after both weight gradients.)
    context.extend(chunk.positions_read_by_q_rope_backward(shape));
    context.extend([
        Term { name: "the layer's attention residual gradient", bytes: stream },
        Term { name: "the layer's attention norm output", bytes: gathered },
    ]);
    let mut at_v = context.clone();
    at_v.push(Term { name: "the attention norm output's gradient from v", bytes: gathered });
    // Under ZeRO-3 with full recomputation the weights the recomputed forward gathered again stay
    // until their input gradients: v's is made, k's and q's are not.
    let full = shape.recompute() == Recompute::Full;
    let regathered = shape.attention_input_weights_gathered_again() - shape.key_value_weights_gathered_again() / 2.0;
    if full && regathered > 0.0 {
        at_v.push(Term { name: "the layer's attention norm, q and k weights, gathered again", bytes: regathered });
    }
    let mut at_k = context;
    at_k.push(Term { name: "the attention norm output's gradients from v and k, summed", bytes: gathered });
    let regathered = shape.norms_gathered_again(shape.norm * element) + shape.query_weight_gathered_again();
    if full && regathered > 0.0 {
        at_k.push(Term { name: "the layer's attention norm and q weights, gathered again", bytes: regathered });
    }
    weight_gradient_points(
        shape,
        [at_v, at_k],
        [
            "first layer's v weight gradient, whole over tp, reduce-scattered",
            "first layer's k weight gradient, whole over tp, reduce-scattered",
            "first layer's v weight gradient, all-reduced over tp, joins its sum",
            "first layer's k weight gradient, whole over tp, joins its sum",
        ],
        made_before_first_attention_inputs(shape, chunk),
        0,
    )
}

/// Outside full recomputation, a dense chunk of more than one layer's points as its last layer's v
/// and k weight gradients are made (see the module doc): the micro-batch holds what it holds in
/// flight (on the last chunk but the head's buffers and the last layer's output, beside a tied
/// table the head's part of its gradient) but what the last layer kept beyond its input; of the
/// chunk's gradients the head's (on the last chunk), the last layer's MLP's, MLP norm's and output
/// projection's are made.
pub(super) fn last_layer_weight_gradients(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, hidden, query, stream, gathered, kept_layer, .. } = shape.sizes;
    if !modelled(shape)
        || shape.zero_bubble
        || shape.recompute() == Recompute::Full
        || chunk.layers < 2
        || shape.model.experts.is_some()
    {
        return Vec::new();
    }
    let (in_flight, head_gradients) = if chunk.last {
        (in_flight_past_the_head(shape, chunk), (shape.head_gradient_summed() + shape.norm * element) / shape.shards)
    } else {
        (chunk.in_flight, 0.0)
    };
    let mut context = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term {
            name: "what it holds in flight but the head's buffers and what its last layer kept beyond its input",
            bytes: in_flight - kept_layer + stream,
        },
        Term { name: "the layer's attention residual gradient", bytes: stream },
        Term { name: "the layer's attention norm output", bytes: gathered },
    ];
    context.extend(shape.tied_head_part().filter(|_| chunk.last));
    let mut at_v = context.clone();
    at_v.push(Term { name: "the attention norm output's gradient from v", bytes: gathered });
    context.push(Term { name: "the attention norm output's gradients from v and k, summed", bytes: gathered });
    weight_gradient_points(
        shape,
        [at_v, context],
        [
            "the last layer's v weight gradient, whole over tp, reduce-scattered",
            "the last layer's k weight gradient, whole over tp, reduce-scattered",
            "the last layer's v weight gradient, all-reduced over tp, joins its sum",
            "the last layer's k weight gradient, whole over tp, joins its sum",
        ],
        head_gradients + (shape.norm + hidden * query) * element / shape.shards + shape.layer_mlp_gradient_shards(),
        chunk.layers - 1,
    )
}

/// Under zero bubble, the same points in W's first layer (see the module doc), `w_reads` what W
/// still reads at its tail.
pub(super) fn first_layer_weight_gradients_in_w(shape: &StageShape, chunk: &Chunk, w_reads: Term) -> Vec<Candidate> {
    let StepSizes { stream, gathered, .. } = shape.sizes;
    if !modelled(shape) || !shape.zero_bubble || chunk.first {
        return Vec::new();
    }
    let mut context = chunk.first_layer_held.clone();
    // (At W under SP, B has reduce-scattered the norm output's gradient, which W reads for the
    // norm's weight, beside the norm's input gradient: split, a stream each.)
    let norm_gradients = if shape.sequence_parallel() { 2.0 * stream } else { gathered };
    context.extend([
        Term { name: "the layer's attention residual gradient", bytes: stream },
        Term { name: "the layer's attention norm gradient", bytes: norm_gradients },
        Term { name: "the layer's attention norm output", bytes: gathered },
        w_reads,
    ]);
    // (Under full recomputation the counts a stage between the first and the last received are
    // read after W's tail.)
    if shape.recompute() == Recompute::Full {
        context.extend(received_counts(shape, chunk, true));
    }
    weight_gradient_points(
        shape,
        [context.clone(), context],
        [
            "first layer's v weight gradient, whole over tp, reduce-scattered in W",
            "first layer's k weight gradient, whole over tp, reduce-scattered in W",
            "first layer's v weight gradient, all-reduced over tp, joins its sum in W",
            "first layer's k weight gradient, whole over tp, joins its sum in W",
        ],
        made_before_first_attention_inputs(shape, chunk),
        0,
    )
}

/// Whether the points are modelled: k and v replicated over tp, no tsp, and ZeRO splitting k's and
/// v's rows where it shards.
fn modelled(shape: &StageShape) -> bool {
    shape.key_values_replicated && shape.tsp == 1 && shape.key_values_kept_whole == 0.0
}

/// The points as v's and k's weight gradients are made, `held` what the layer holds at each beside
/// its q, k and v gradients and the weight gradient's copies, `names` v's and k's points under
/// ZeRO-2 and 3, then beside (or without) all-reduces.
fn weight_gradient_points(
    shape: &StageShape,
    held: [Vec<Term>; 2],
    names: [&'static str; 4],
    attention_so_far: f64,
    layers_below: u64,
) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, .. } = shape.sizes;
    let [mut at_v, mut at_k] = held;
    at_v.push(Term { name: "the layer's q and k gradients", bytes: local_tokens * (query + kv) * element });
    at_k.push(Term { name: "the layer's q gradient", bytes: local_tokens * query * element });
    let weight = hidden * kv * element;
    let bias = if shape.model.qkv_bias { kv * element / shape.shards } else { 0.0 };
    // v's bias gradient is made before v's weight gradient, k's before k's.
    let before_v = attention_so_far + bias;
    let before_k = before_v + weight / shape.shards + bias;
    // (The layers below have made none of their q, k and v gradients.)
    let v_pending = |point| Candidate { pending: KeptWholePending::LAYER.and_layers(layers_below), ..point };
    let q_pending = |point| Candidate { pending: KeptWholePending::Q.and_layers(layers_below), ..point };
    if shape.scattered {
        // The reduce-scatter stages the whole gradient; its shard is written once the staging is
        // freed (the planner counts the larger).
        let staged =
            |name| [Term { name, bytes: weight }, Term { name: "its reduce-scatter's staging", bytes: weight }];
        at_v.extend(staged("v's weight gradient, whole, before its dp reduce-scatter"));
        at_k.extend(staged("k's weight gradient, whole, before its dp reduce-scatter"));
        return vec![
            v_pending(Candidate::made(names[0], before_v, at_v)),
            q_pending(Candidate::made(names[1], before_k, at_k)),
        ];
    }
    at_v.push(Term {
        name: "v's weight gradient before its tp all-reduce (beside replicas, before theirs)",
        bytes: weight,
    });
    // Beside replicas k's gradient is freed before the all-reduce, its unreduced copy live as it
    // joins; without, it joins at once, k's gradient still live.
    at_k.push(if shape.reduced {
        Term { name: "k's weight gradient before its all-reduce over the replicas", bytes: weight }
    } else {
        Term { name: "the layer's k gradient", bytes: local_tokens * kv * element }
    });
    vec![
        v_pending(Candidate::joining(names[2], before_v + weight, at_v, weight)),
        q_pending(Candidate::joining(names[3], before_k + weight, at_k, weight)),
    ]
}
