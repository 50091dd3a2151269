//! Points inside a micro-batch's backward of a chunk's first layer, where a stage may peak
//! instead of at the backward's tail: as a large weight gradient of that layer joins its sum (a
//! dense gate's, a mixture's experts', tsp's o) or is reduce-scattered (ZeRO-2 and 3), beside the
//! layer's attention activations.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{received_counts, Candidate, Chunk, KeptWholePending, RECEIVED_COUNTS};
use super::experts::{self, experts_points};
use super::shared_expert::{self, shared_expert_points};
use super::{tsp_first_owner_o_reduce, tsp_o_reduces, tsp_ring, Place, StageShape, TspBlock};

/// Inside the first layer's backward, before its attention's: that layer's attention activations
/// (which full recomputation recomputes only for the attention's own backward), and its attention
/// residual.
fn attention_activations(shape: &StageShape) -> [Term; 4] {
    let StepSizes { element, local_tokens, query, stream, gathered, attention_kept, kv_kept, .. } = shape.sizes;
    let live = if shape.recompute() == Recompute::Full { 0.0 } else { 1.0 };
    [
        Term { name: "first layer's attention norm output", bytes: live * gathered },
        Term {
            // (Under cp every token's k and v, all-gathered.)
            name: "first layer's q, k and v after RoPE",
            bytes: live * (local_tokens * query + kv_kept) * element,
        },
        Term { name: "first layer's attention output", bytes: live * local_tokens * attention_kept * element },
        Term { name: "first layer's attention residual", bytes: stream },
    ]
}

/// What the micro-batch holds inside its first layer's backward before the attention's: the
/// chunk's inputs, what its end keeps, the layer's attention activations, and `more`.
fn before_attention(shape: &StageShape, chunk: &Chunk, more: impl IntoIterator<Item = Term>) -> Vec<Term> {
    let mut held = chunk.first_layer_held.clone();
    held.extend(attention_activations(shape));
    held.extend(more);
    held
}

/// Inside the first layer's W, before its attention's weight gradients: `w_reads` (what W's tail
/// still reads), the attention norm's input gradient B sent back, and what the attention's and
/// the norms' weight gradients read (the attention norm's output, attention's output but where it
/// is recomputed, the attention residual, q's, k's and v's gradients, both norm outputs'
/// gradients).
fn read_by_w(shape: &StageShape, w_reads: Term) -> [Term; 7] {
    let StepSizes { element, local_tokens, query, kv, stream, gathered, .. } = shape.sizes;
    let live = if shape.recompute() == Recompute::None { 1.0 } else { 0.0 };
    [
        w_reads,
        Term { name: "first layer's attention norm's input gradient (sent back)", bytes: stream },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's attention output", bytes: live * local_tokens * query * element },
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's q, k and v gradients", bytes: local_tokens * (query + 2.0 * kv) * element },
        Term { name: "first layer's attention and MLP norm outputs' gradients", bytes: 2.0 * stream },
    ]
}

/// Under ZeRO-2 a stage may peak inside its first layer's backward, as the gate projection's
/// gradient (the largest but the embedding's) is reduce-scattered: that layer's attention
/// activations are still live, and of its gradients only the down and up projections' are done
/// (and none of the embedding's). Under zero bubble this is inside W, `w_reads` what W's tail
/// still reads: B has made the input gradients, so the layer's attention norm's input gradient
/// (sent back) is live, and in place of q, k and v the gradients W reads for their weights
/// (under selective recomputation q, k and v themselves, in `w_reads`, attention's output not
/// yet recomputed), with both norm outputs' gradients (under SP their reduce-scattered shards).
/// (A dense stage's: a shared expert's gate is scattered inside its MLP backward,
/// [`shared_expert_points`]; not under tsp, whose MLP ring makes the MLP's gradients, in B under
/// zero bubble: counting it in W was 0.5% above the planner at dp=4 × tsp=2.)
pub(super) fn gate_scattered(shape: &StageShape, chunk: &Chunk, w_reads: Option<Term>) -> Option<Candidate> {
    if !shape.scattered || shape.model.experts.is_some() || shape.tsp > 1 {
        return None;
    }
    let (gate, norm) = (shape.gate, shape.norm);
    let point = Candidate::before_first_attention(
        "first layer's gate gradient reduce-scattered",
        chunk.grads
            - (gate + (shape.attention_weights + 2.0 * norm) * shape.sizes.element + chunk.table) / shape.shards,
        scattered_before_attention(shape, chunk, w_reads, "first layer's gate gradient before its dp reduce-scatter"),
    );
    // (Of those ZeRO keeps whole, down's and up's are made; gate's is the one staged.)
    Some(Candidate { pending: KeptWholePending::PAST_UP, ..point })
}

/// What [`gate_scattered`] holds, the gradient staged named `staged` (of gate's size).
fn scattered_before_attention(
    shape: &StageShape,
    chunk: &Chunk,
    w_reads: Option<Term>,
    staged: &'static str,
) -> Vec<Term> {
    let StepSizes { stream, gathered, .. } = shape.sizes;
    let staged =
        [Term { name: staged, bytes: shape.gate }, Term { name: "its reduce-scatter's staging", bytes: shape.gate }];
    if let Some(w_reads) = w_reads {
        let mut held = chunk.first_layer_held_after_rope_backward();
        held.extend(read_by_w(shape, w_reads));
        // Under SP W reads the residual gradients' gathered copies, not kept in `w_reads`: the
        // attention residual's gradient and its copy gathered for o's weight gradient are live.
        if shape.sequence_parallel() {
            held.push(Term {
                name: "first layer's attention residual gradient, and gathered for o's",
                bytes: stream + gathered,
            });
        }
        held.extend(staged);
        held
    } else {
        before_attention(
            shape,
            chunk,
            [
                Term { name: "first layer's output gradient", bytes: stream },
                Term { name: "first layer's MLP norm output gradient", bytes: gathered },
            ]
            .into_iter()
            .chain(staged),
        )
    }
}

/// Under zero bubble a chunk of more than one layer may also peak inside its first layer's W as
/// the down projection's gradient is reduce-scattered, before up's and gate's: as at gate's
/// ([`gate_scattered`] in W), but what those two read is still live (the MLP norm's output,
/// gate's and up's output gradients) and their shards not made. It outweighs the tail where ZeRO
/// keeps q whole (at dp=4 on 32 tokens of a 6-head model under full recomputation, 0.3% above it).
/// (A one-layer chunk's is the head of its W's; not for a mixture, or under tsp, whose B makes the
/// MLP's gradients: counting it there was 3.2% above the planner at dp=4 × tsp=2.)
pub(super) fn down_scattered_in_w(shape: &StageShape, chunk: &Chunk, w_reads: Term) -> Option<Candidate> {
    if !shape.scattered || shape.model.experts.is_some() || shape.tsp > 1 || chunk.layers < 2 {
        return None;
    }
    let StepSizes { element, local_tokens, ffn, gathered, .. } = shape.sizes;
    let mut held = scattered_before_attention(
        shape,
        chunk,
        Some(w_reads),
        "first layer's down gradient before its dp reduce-scatter",
    );
    held.extend([
        Term { name: "first layer's MLP norm output", bytes: gathered },
        Term { name: "first layer's gate and up output gradients", bytes: 2.0 * local_tokens * ffn * element },
    ]);
    Some(Candidate::before_first_attention(
        "first layer's down gradient reduce-scattered in W",
        made_before_first_mlp(shape, chunk),
        held,
    ))
}

/// Under ZeRO-2 and 3 (outside zero bubble, without full recomputation) a stage may also peak
/// inside its first layer's MLP backward as gate's input gradient is made, before its weight
/// gradient: the down's and up's weight gradients' shards made, the layer's output gradient, the
/// MLP norm output (which gate's weight gradient reads next), up's input gradient, gate's output
/// and input gradients live beside the attention activations; under ZeRO-3 also gate's weight,
/// gathered again for it. (Not for a mixture or under tsp, whose MLPs differ.)
pub(super) fn gate_input_gradient_scattered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let full = shape.recompute() == Recompute::Full;
    if !shape.scattered || shape.zero_bubble || full || shape.model.experts.is_some() || shape.tsp > 1 {
        return None;
    }
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    let regathered = shape.gate_up_gathered_again(shape.gate);
    let held = before_attention(
        shape,
        chunk,
        [
            Term { name: "first layer's output gradient", bytes: stream },
            Term { name: "first layer's MLP norm output", bytes: gathered },
            Term { name: "first layer's MLP norm output's gradient from up", bytes: gathered },
            Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
            Term { name: "first layer's MLP norm output's gradient from gate", bytes: gathered },
        ]
        .into_iter()
        .chain(
            (regathered > 0.0).then_some(Term { name: "first layer's gate weight, gathered again", bytes: regathered }),
        ),
    );
    let (gate, norm) = (shape.gate, shape.norm);
    Some(Candidate::before_first_attention(
        "first layer's gate input gradient made",
        chunk.grads - (gate + (shape.attention_weights + 2.0 * norm) * element + chunk.table) / shape.shards,
        held,
    ))
}

/// Under ZeRO-2 and 3 (outside zero bubble, without full recomputation) a chunk of more than one
/// layer may also peak inside its first layer's MLP backward as the down projection's gradient is
/// reduce-scattered, staged whole: none of the layer's gradients made, its MLP norm output, gate's
/// and up's outputs, the SiLU product's gradient and the layer's output gradient live beside the
/// attention activations (the product freed: the down gradient was its last reader); and then
/// as up's is. They outweigh the tail where ZeRO keeps q whole, whose gradients the tail holds and
/// these points not yet (at dp=4 on 32 tokens of a 6-head model, 0.3% above it). (A one-layer
/// chunk's are its head's; not for a mixture or under tsp, whose MLPs differ.)
pub(super) fn down_and_up_gradients_scattered(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let full = shape.recompute() == Recompute::Full;
    if !shape.scattered
        || shape.zero_bubble
        || full
        || shape.model.experts.is_some()
        || shape.tsp > 1
        || chunk.layers < 2
    {
        return Vec::new();
    }
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    let product = local_tokens * ffn * element;
    let scattered = |name, mlp: Vec<Term>| {
        let staged =
            [Term { name, bytes: shape.gate }, Term { name: "its reduce-scatter's staging", bytes: shape.gate }];
        let output_gradient = Term { name: "first layer's output gradient", bytes: stream };
        let norm_output = Term { name: "first layer's MLP norm output", bytes: gathered };
        before_attention(shape, chunk, [output_gradient, norm_output].into_iter().chain(mlp).chain(staged))
    };
    let down = scattered(
        "first layer's down gradient before its dp reduce-scatter",
        vec![
            Term { name: "first layer's gate output", bytes: product },
            Term { name: "first layer's up output", bytes: product },
            Term { name: "first layer's SiLU product's gradient", bytes: product },
        ],
    );
    // Up's next, down's shard made: SiLU's backward has freed the product's gradient and gate's
    // and up's outputs for their output gradients, and up's input gradient (the MLP norm output's
    // from up) is made before its weight gradient, which frees up's output gradient (at dp=2 ×
    // tp=4 under SP on 32 tokens, 0.07% above the down gradient's point).
    let up = scattered(
        "first layer's up gradient before its dp reduce-scatter",
        vec![
            Term { name: "first layer's gate output gradient", bytes: product },
            Term { name: "first layer's MLP norm output's gradient from up", bytes: gathered },
        ],
    );
    let so_far = made_before_first_mlp(shape, chunk);
    vec![
        Candidate::before_first_attention("first layer's down gradient reduce-scattered", so_far, down),
        Candidate {
            pending: KeptWholePending::PAST_DOWN,
            ..Candidate::before_first_attention(
                "first layer's up gradient reduce-scattered",
                so_far + shape.gate / shape.shards,
                up,
            )
        },
    ]
}

/// A dense stage may peak inside its first layer's MLP backward on more tokens, as the gate
/// projection's weight gradient joins its sum: the layer's attention activations and MLP norm
/// output are live, with the norm output's gradient from up, gate's output gradient (its input
/// gradient is next) and the layer's output gradient; of its gradients only the down, up and gate
/// projections' are done. Beside dp (or cp) the gate's input gradient comes first, the norm
/// output's gradients summed, and its weight gradient last, the norm output and gate's output
/// gradient freed before it is all-reduced: its unreduced copy is live beside the reduced one.
/// (Not under ZeRO-2 and 3, which scatter it, or under tsp, whose ring makes the MLP's gradients;
/// under full recomputation the attention's activations are not recomputed yet, and the MLP's
/// recomputed buffers are those a kept MLP holds here.)
pub(super) fn gate_joining(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    let mlp = if shape.reduced {
        [
            Term { name: "first layer's MLP norm output's gradient", bytes: gathered },
            Term { name: "first layer's output gradient", bytes: stream },
            Term { name: "first layer's gate gradient before its dp all-reduce", bytes: shape.gate },
        ]
    } else {
        [
            Term { name: "first layer's MLP norm output and its gradient from up", bytes: 2.0 * gathered },
            Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
            Term { name: "first layer's output gradient", bytes: stream },
        ]
    };
    shape.first_layer_mlp_backward_modelled().then(|| Candidate {
        name: "first layer's gate gradient joins its sum",
        so_far: chunk.grads - (shape.attention_weights + 2.0 * shape.norm) * element - chunk.table,
        held: before_attention(shape, chunk, mlp),
        new_sum: Some(Term { name: "the joining gate gradient's new sum beside the old", bytes: shape.gate }),
        pending: KeptWholePending::LAYER,
        sum_pending: 0.0,
    })
}

/// Beside dp (or cp), whose gate input gradient comes before its weight gradient, a dense stage
/// may peak as its first layer's MLP norm output's gradients from gate and up are summed: the
/// layer's attention activations, MLP norm output, gate's output gradient and output gradient
/// live, of its gradients the down and up projections' done (up's unreduced copy and output
/// gradient freed). (Not under ZeRO-2 and 3 or tsp, as [`gate_joining`].)
pub(super) fn mlp_norm_gradients_summed(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    (shape.reduced && shape.first_layer_mlp_backward_modelled()).then(|| {
        let mlp = [
            Term { name: "first layer's MLP norm output", bytes: gathered },
            Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
            Term { name: "first layer's output gradient", bytes: stream },
            Term {
                name: "first layer's MLP norm output's gradients from gate and up, and their sum",
                bytes: 3.0 * gathered,
            },
        ];
        Candidate::before_first_attention(
            "first layer's MLP norm output's gradients from gate and up summed",
            chunk.grads - shape.gate - (shape.attention_weights + 2.0 * shape.norm) * element - chunk.table,
            before_attention(shape, chunk, mlp),
        )
    })
}

/// Beside dp (or cp) a chunk but the first may peak as its first layer's attention norm output's
/// gradient from q joins the sum of those from k and v: q's weight gradient, whose all-reduce ends
/// the chunk's backward, is not yet made, and the norm's output and q's output gradient it reads
/// are live beside q's input gradient and the two sums (the norm's output recomputed under full
/// recomputation; under ZeRO-2 and 3 the gradients made are their shards), and on a stage between
/// the first and the last a mixture's summed expert counts it received. Under ZeRO-3 also as
/// q's input gradient is made, beside q's weight gathered again for it and the sum from k and v.
/// (Not under tsp.)
pub(super) fn attention_norm_gradient(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, positions, stream, gathered, .. } = shape.sizes;
    if chunk.first || !shape.reduced || shape.tsp > 1 {
        return Vec::new();
    }
    let mut held = vec![
        Term { name: "positions", bytes: positions },
        Term { name: "stage input (received)", bytes: stream },
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's q output gradient", bytes: local_tokens * query * element },
        Term { name: "first layer's q input gradient", bytes: gathered },
    ];
    held.extend(chunk.end.iter().cloned());
    held.extend(received_counts(shape, chunk, false));
    let so_far = chunk.grads - (shape.norm + hidden * query) * element / shape.shards;
    let sums = Term {
        name: "first layer's attention norm output gradients from k and v, and with q's",
        bytes: 2.0 * gathered,
    };
    // (Of the gradients ZeRO keeps whole, q's weight's is still to come.)
    let made = |name, held| Candidate { pending: KeptWholePending::Q_WEIGHT, ..Candidate::made(name, so_far, held) };
    let mut points =
        vec![made("first layer's attention norm output gradient from q", held.iter().cloned().chain([sums]).collect())];
    let q_weight = shape.query_weight_gathered_again();
    if q_weight > 0.0 {
        held.extend([
            Term { name: "first layer's attention norm output gradients from k and v", bytes: gathered },
            Term { name: "first layer's q weight, gathered again", bytes: q_weight },
        ]);
        points.push(made("first layer's q input gradient, its weight gathered again", held));
    }
    points
}

/// A chunk may peak inside its first layer's attention backward, as the attention kernel makes
/// v's gradient beside q's and k's: every gradient of the layer but q's, k's, v's and its input
/// norm's is made, attention's output freed (its gradient live), and its inputs (the norm's output,
/// q, and every token's k and v under cp) live beside the kernel's three gradients (k's and v's
/// every token's under cp, before their reduce-scatter; under ZeRO-3 with full recomputation
/// beside the weights gathered again, [`attention_weights_regathered`]); a stage between the
/// first and the last still holds a mixture's summed expert counts it received. (Not under tsp,
/// whose attention backward differs.)
pub(super) fn attention_backward(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, query, kv_kept, .. } = shape.sizes;
    if shape.tsp > 1 {
        return None;
    }
    let mut held = attention_backward_inputs(shape, chunk);
    held.push(Term {
        name: "first layer's attention q, k and v gradients",
        bytes: (local_tokens * query + kv_kept) * element,
    });
    held.extend(attention_weights_regathered(shape));
    Some(Candidate::before_first_attention(
        "first layer's attention backward",
        made_before_first_attention_inputs(shape, chunk),
        held,
    ))
}

/// What the micro-batch holds in its first layer's attention backward, past the MLP's, beside what
/// the backward makes: the chunk's inputs and what its end keeps (and the received expert counts
/// where still live), the attention residual's gradient, the attention norm's output, q, k and v
/// (every token's k and v under cp) and the attention output's gradient.
fn attention_backward_inputs(shape: &StageShape, chunk: &Chunk) -> Vec<Term> {
    let StepSizes { element, local_tokens, query, stream, gathered, kv_kept, .. } = shape.sizes;
    let mut held = chunk.first_layer_held.clone();
    held.extend(received_counts(shape, chunk, false));
    held.extend([
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's q, k and v after RoPE", bytes: (local_tokens * query + kv_kept) * element },
        Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
    ]);
    held
}

/// Under ZeRO-2 and 3 a chunk may peak inside its first layer's attention backward as the output
/// projection's weight gradient is reduce-scattered, staged whole (over dp then ep or cp, a step
/// an axis; the first step's is the larger): the layer's MLP backward done (a mixture's experts'
/// gradients made, whose all-reduce left no copy), its attention residual's gradient, its
/// attention norm output and q, k and v (every token's k and v under cp) live beside the
/// attention output's gradient (o's input gradient, made before it), the attention output freed
/// (under selective recomputation recomputed for it, under SP its gathered output gradient too).
/// (Outside full recomputation, which [`regathered`] covers under ZeRO-3, zero bubble, whose W
/// makes it, and tsp.)
pub(super) fn o_gradient_scattered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, hidden, query, .. } = shape.sizes;
    if !shape.scattered || shape.recompute() == Recompute::Full || shape.zero_bubble || shape.tsp > 1 {
        return None;
    }
    let output_projection = hidden * query * element;
    let mut held = attention_backward_inputs(shape, chunk);
    held.extend([
        Term { name: "first layer's o gradient before its dp reduce-scatter", bytes: output_projection },
        Term { name: "its reduce-scatter's staging", bytes: output_projection },
    ]);
    Some(Candidate::before_first_attention(
        "first layer's o gradient reduce-scattered",
        made_before_first_attention_weights(shape, chunk),
        held,
    ))
}

/// The chunk's gradients a micro-batch has made as its first layer's attention backward begins
/// its weight gradients (ZeRO-2 and 3's shards): all but that layer's attention and attention
/// norm weights' and, on the first chunk, the embedding's.
fn made_before_first_attention_weights(shape: &StageShape, chunk: &Chunk) -> f64 {
    let not_made = (shape.attention_weights + shape.norm) * shape.sizes.element + chunk.table;
    chunk.grads - not_made / shape.shards
}

/// The same once the output projection's weight gradient is made too, as the attention kernel's
/// backward begins: all but q's, k's and v's, the attention norm's and, on the first chunk, the
/// embedding's.
pub(super) fn made_before_first_attention_inputs(shape: &StageShape, chunk: &Chunk) -> f64 {
    let StepSizes { element, hidden, query, .. } = shape.sizes;
    let not_made = (shape.attention_weights - hidden * query + shape.norm) * element + chunk.table;
    chunk.grads - not_made / shape.shards
}

/// Under ZeRO-3 with full recomputation a layer's recomputed forward gathers its attention norm's,
/// q's, k's and v's weights again (but those ZeRO keeps whole), live until their
/// input gradients in its attention backward; else none.
pub(super) fn attention_weights_regathered(shape: &StageShape) -> Option<Term> {
    let weights = shape.attention_input_weights_gathered_again();
    (shape.recompute() == Recompute::Full && weights > 0.0)
        .then_some(Term { name: "the layer's attention norm, q, k and v weights, gathered again", bytes: weights })
}

/// The first layer's [`attention_input_gradients`].
pub(super) fn first_layer_attention_input_gradients(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let mut context = chunk.first_layer_held_after_rope_backward();
    context.extend(received_counts(shape, chunk, false));
    let mut points = attention_input_gradients(
        shape,
        [
            "first layer's attention norm output's gradients from v and k",
            "first layer's attention norm output's gradient from q",
        ],
        context,
        made_before_first_attention_inputs(shape, chunk),
    );
    if let Some(from_v_and_k) = points.first_mut() {
        from_v_and_k.held.extend(chunk.positions_read_by_q_rope_backward(shape));
    }
    points
}

/// After the attention kernel's backward (not under tsp; under ZeRO-2 and 3 the weight gradients
/// made are their shards; beside cp k's and v's gradients, every token's, are reduce-scattered back
/// to the rank's tokens first), the attention norm output's gradients from v, k and q are summed as
/// they are made, each of the whole hidden size (under tp partial, before their all-reduce), the
/// attention residual's gradient and the norm's output live: a stage may peak as the gradients
/// from v and k are summed (v's weight gradient made and summed, whole where ZeRO keeps k and v
/// whole, and k's bias gradient; q's and k's gradients, RoPE's backward done, live beside the two
/// and their sum), or as the one from q joins them (k's weight gradient and q's bias gradient made
/// too, k's gradient freed; q's weight gradient, whole where ZeRO keeps q whole, still to come);
/// under ZeRO-3 with full recomputation beside the weights
/// gathered again whose input gradients are still to come. `context` is what the micro-batch holds
/// beside the layer's attention buffers, `attention_so_far` the gradients made by its attention
/// kernel's backward, `names` the two points'.
pub(super) fn attention_input_gradients(
    shape: &StageShape,
    names: [&'static str; 2],
    context: Vec<Term>,
    attention_so_far: f64,
) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, stream, gathered, .. } = shape.sizes;
    if shape.tsp > 1 {
        return Vec::new();
    }
    let mut common = context;
    common.extend([
        Term { name: "the layer's attention residual gradient", bytes: stream },
        Term { name: "the layer's attention norm output", bytes: gathered },
    ]);
    let mut from_v_and_k = common.clone();
    from_v_and_k.extend([
        Term { name: "the layer's q and k gradients", bytes: local_tokens * (query + kv) * element },
        Term { name: "the attention norm output's gradients from v and k, and their sum", bytes: 3.0 * gathered },
    ]);
    let mut from_q = common;
    from_q.extend([
        Term { name: "the layer's q gradient", bytes: local_tokens * query * element },
        Term {
            name: "the attention norm output's gradients from v and k summed, from q, and the three's sum",
            bytes: 3.0 * gathered,
        },
    ]);
    // Under ZeRO-3 with full recomputation the weights the recomputed forward gathered again stay
    // until their input gradients ([`attention_weights_regathered`]): q's and the norm's, then the
    // norm's.
    if shape.recompute() == Recompute::Full {
        let norm = shape.norms_gathered_again(shape.norm * element);
        let q = shape.query_weight_gathered_again();
        if norm + q > 0.0 {
            from_v_and_k
                .push(Term { name: "the layer's attention norm and q weights, gathered again", bytes: norm + q });
            from_q.push(Term { name: "the layer's attention norm weight, gathered again", bytes: norm });
        }
    }
    // A k or v projection's weight and bias gradient (under ZeRO-2 and 3 its shard); a bias's
    // gradient is made before its projection's input gradient, the weight's after.
    let bias = |width: f64| if shape.model.qkv_bias { width * element / shape.shards } else { 0.0 };
    let key_value = hidden * kv * element / shape.shards + bias(kv);
    vec![
        // (Where ZeRO keeps k's and v's rows whole, v's is made whole and k's is still to come.)
        Candidate {
            name: names[0],
            so_far: attention_so_far + key_value + bias(kv),
            held: from_v_and_k,
            new_sum: None,
            pending: KeptWholePending::K_AND_Q,
            sum_pending: 0.0,
        },
        Candidate {
            pending: KeptWholePending::Q_WEIGHT,
            ..Candidate::made(names[1], attention_so_far + 2.0 * key_value + bias(query), from_q)
        },
    ]
}

/// Under full recomputation a chunk may peak inside its first layer's MLP backward: as the down
/// projection's gradient is made (none of the layer's others made), beside the layer's recomputed
/// MLP norm output, gate, up and SiLU product, the product's gradient and the layer's output
/// gradient (under SP beside the output gradient gathered over tp); under ZeRO-2 and 3 it is made
/// whole before its reduce-scatter (under ZeRO-3 beside the MLP norm's, gate's and up's weights,
/// gathered again for the recomputation and read next by their input gradients), and may peak as
/// it is scattered, staged whole, what made it freed. Without ZeRO, also as it joins its sum,
/// beside the product (but beside dp, which frees it before the all-reduce, and holds the
/// unreduced copy instead; not modelled beside dp × tp); beside dp (or cp), whose input gradients
/// come first, as gate's output gradient is made after it; and as the MLP norm output's gradients
/// from gate and up are summed. (Not for a mixture or under tsp, whose MLPs differ.)
pub(super) fn recomputed_mlp_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    if shape.recompute() != Recompute::Full || shape.model.experts.is_some() || shape.tsp > 1 {
        return Vec::new();
    }
    let mut context = chunk.first_layer_held.clone();
    context.extend([
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's output gradient", bytes: stream },
        Term { name: "first layer's MLP norm output, recomputed", bytes: gathered },
    ]);
    // (Before the layer's attention backward: none of its gradients ZeRO keeps whole is made.)
    let mut points: Vec<Candidate> = down_gradient_points(shape, chunk, &context)
        .into_iter()
        .map(|point| Candidate { pending: KeptWholePending::LAYER, ..point })
        .collect();
    // After up's gradient (gate's comes after) the MLP norm output's gradients from gate and up
    // are summed beside gate's output gradient, gate, up and their product freed (under ZeRO-3
    // beside the MLP norm's weight, gathered again for the recomputation).
    let mut summed = context;
    summed.extend([
        Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
        Term {
            name: "first layer's MLP norm output's gradients from gate and up, and their sum",
            bytes: 3.0 * gathered,
        },
    ]);
    let regathered_norm = shape.norms_gathered_again(shape.norm * element);
    if regathered_norm > 0.0 {
        summed.push(Term { name: "first layer's MLP norm weight, gathered again", bytes: regathered_norm });
    }
    let unmade = shape.gate + (shape.attention_weights + 2.0 * shape.norm) * element + chunk.table;
    points.push(Candidate {
        pending: KeptWholePending::PAST_UP,
        ..Candidate::before_first_attention(
            "first layer's MLP norm output gradient, its MLP recomputed",
            chunk.grads - unmade / shape.shards,
            summed,
        )
    });
    points
}

/// [`recomputed_mlp_backward`]'s points as the down gradient is made, joins its sum or is
/// reduce-scattered, and gate's output gradient is made after it; `context` what the layer holds
/// throughout (the chunk's inputs, the attention residual, the output gradient and the recomputed
/// MLP norm output).
fn down_gradient_points(shape: &StageShape, chunk: &Chunk, context: &[Term]) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, gathered, .. } = shape.sizes;
    let mut held = context.to_vec();
    held.extend([
        Term { name: "first layer's SiLU product's gradient", bytes: local_tokens * ffn * element },
        Term { name: "first layer's gate and up, recomputed", bytes: 2.0 * local_tokens * ffn * element },
    ]);
    // As the gradient is made (under ZeRO-2 and 3 whole, before its reduce-scatter; beside dp
    // before its all-reduce) the SiLU product is still live, and without replicas as it joins its
    // sum. (Under SP the output gradient all-gathered over tp for it.)
    let mut joining = held.clone();
    joining.push(Term { name: "first layer's SiLU product, recomputed", bytes: local_tokens * ffn * element });
    if shape.sequence_parallel() {
        joining.push(Term { name: "first layer's output gradient, gathered over tp", bytes: gathered });
    }
    let mut made = joining.clone();
    made.push(Term { name: "first layer's down gradient, whole", bytes: shape.gate });
    let layer = 3.0 * shape.gate + (shape.attention_weights + 2.0 * shape.norm) * element;
    if shape.scattered {
        let mut held = made;
        if shape.workload.zero >= 3 {
            held.push(Term {
                name: "first layer's MLP norm, gate and up weights, gathered again",
                bytes: shape.mlp_input_weights_gathered_again(),
            });
        }
        let made = Candidate::before_first_attention(
            "first layer's down gradient made, its MLP recomputed",
            chunk.grads - (layer + chunk.table) / shape.shards,
            held,
        );
        // Then it is reduce-scattered, staged whole, what made it freed (the SiLU product, and
        // under SP the output gradient gathered over tp).
        let gathered_output_gradient = if shape.sequence_parallel() { gathered } else { 0.0 };
        let mut scattered = made.held.clone();
        scattered.extend([
            Term { name: "what made it, freed", bytes: -(local_tokens * ffn * element + gathered_output_gradient) },
            Term { name: "its reduce-scatter's staging", bytes: shape.gate },
        ]);
        let scattered = Candidate {
            name: "first layer's down gradient reduce-scattered, its MLP recomputed",
            held: scattered,
            ..made.clone()
        };
        return vec![made, scattered];
    }
    // The chunk's gradients made before the down gradient (none of the layer's).
    let before_down = chunk.grads - layer - chunk.table;
    // Beside replicas its input gradient came first: next gate's output gradient is made, the
    // down gradient joined its sum and the SiLU product freed.
    let gate_output = shape.reduced.then(|| {
        let mut gate_output = held.clone();
        gate_output.push(Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element });
        Candidate::made(
            "first layer's gate output gradient made, its MLP recomputed",
            before_down + shape.gate,
            gate_output,
        )
    });
    // As it joins its sum: beside replicas its unreduced copy beside the reduced one, else all
    // that made it. (Beside tp and replicas the joining is not modelled.)
    let joins = !(shape.tp > 1 && shape.reduced);
    let joins = joins.then(|| {
        let held = if shape.reduced {
            held.into_iter()
                .chain([Term { name: "first layer's down gradient before its dp all-reduce", bytes: shape.gate }])
                .collect()
        } else {
            joining
        };
        Candidate {
            name: "first layer's down gradient joins its sum, its MLP recomputed",
            so_far: before_down + shape.gate,
            held,
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        }
    });
    [Candidate::made("first layer's down gradient made, its MLP recomputed", before_down, made)]
        .into_iter()
        .chain(gate_output)
        .chain(joins)
        .collect()
}

/// What a micro-batch holds inside its first layer's backward beside the layer's MLP buffers: the
/// chunk's inputs, what its end keeps, the layer's attention activations, the MLP norm's output and
/// the layer's output gradient; and on a stage between the first and the last the expert counts
/// it received (`with_counts_on_the_first`: on the first stage too, before the router's backward,
/// which reads them last there).
fn mlp_context(shape: &StageShape, chunk: &Chunk, with_counts_on_the_first: bool) -> Vec<Term> {
    let StepSizes { stream, gathered, .. } = shape.sizes;
    let mut mlp = vec![
        Term { name: "first layer's MLP norm output", bytes: gathered },
        Term { name: "first layer's output gradient", bytes: stream },
    ];
    mlp.extend(received_counts(shape, chunk, with_counts_on_the_first));
    // (Under tsp on the first chunk the token ids in zigzag order, which the embedding's backward
    // reads.)
    if shape.tsp > 1 && chunk.first {
        mlp.push(Term { name: "token ids in zigzag order", bytes: shape.sizes.ids });
    }
    before_attention(shape, chunk, mlp)
}

/// The chunk's gradients made before its first layer's MLP backward: all but that layer's (under
/// ZeRO-2 and 3 their shards).
fn made_before_first_mlp(shape: &StageShape, chunk: &Chunk) -> f64 {
    // (Under tsp the rank's block of the attention weights.)
    let attention = shape.attention_weights / shape.tsp as f64;
    let outside_mlp = (attention + 2.0 * shape.norm) * shape.sizes.element + chunk.table;
    chunk.grads - outside_mlp / shape.shards - shape.layer_mlp_gradient_shards()
}

/// A mixture may peak inside its first layer's MLP backward: in a shared expert's (Qwen2-MoE,
/// [`shared_expert_points`]), which comes first, the received expert counts still live on every
/// stage but the last (but under SP, where the router's backward comes before the shared
/// expert's); then in the routed experts' ([`experts_points`]), the router's backward having freed
/// the counts on the first stage.
pub(super) fn mixture_mlp_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let made_before = made_before_first_mlp(shape, chunk);
    let shared_context = mlp_context(shape, chunk, !shape.sequence_parallel());
    let mut points = shared_expert_points(shape, Place::FirstLayer, &shared_context, made_before);
    points.extend(experts_points(shape, Place::FirstLayer, &mlp_context(shape, chunk, false), made_before));
    // (The layer's q, k and v gradients, which ZeRO keeps whole at dp=4 beside tp=2 or tsp=2 (k
    // and v) or at dp=8 beside tp=2 (q too), are not made yet: counting k's and v's was 1.5% above
    // the planner under ZeRO-3.)
    for point in &mut points {
        point.pending = KeptWholePending::LAYER;
    }
    points
}

/// As one of the first layer's routed-expert gradients joins its sum ([`experts::joining`]).
pub(super) fn experts_joining(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    experts::joining(shape, Place::FirstLayer, &mlp_context(shape, chunk, false), made_before_first_mlp(shape, chunk))
}

/// As the first layer's routed experts' input gradient is all-reduced over tp
/// ([`experts::input_gradient_reduced`]).
fn experts_input_gradient_reduced(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let context = mlp_context(shape, chunk, false);
    experts::input_gradient_reduced(shape, Place::FirstLayer, &context, made_before_first_mlp(shape, chunk))
}

/// Under zero bubble a mixture's B (which makes its experts' and router's weight gradients, none a
/// W op) may peak inside its first layer's backward: in its shared expert's backward
/// ([`shared_expert_in_b`]), as its routed experts' backward begins (dispatched over ep; without
/// ep as their input gradient is all-reduced over tp, or summed with the MLP norm output's gradient
/// so far), as an expert gradient joins its sum ([`experts_joining`]; beside dp or cp also as
/// the last of the three joins, the other two reduced and joined, its unreduced copy live), and
/// on more tokens in its attention kernel's backward, as v's gradient is made beside q's and k's,
/// then as the attention norm output's gradients are summed
/// ([`attention_input_gradients_in_b`]). At the kernel the MLP norm's output is freed (but beside
/// a shared expert, whose weight gradients read it in W), but its gradient, which the norm's weight
/// gradient (a W op) reads, stays, as do the attention's output and residual (o's and the MLP
/// norm's weight gradients read them), beside the attention residual's gradient, attention's
/// output gradient and the kernel's three gradients (under cp k's and v's every token's, before
/// their reduce-scatter). A dense stage's B may peak at the same attention points, its first
/// layer's MLP inputs and output gradients kept for W (under full recomputation the MLP norm's
/// output, gate and up it recomputed, and the attention norm's output and q, k and v, under
/// ZeRO-3 from their weights gathered again).
pub(super) fn in_b(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, query, stream, gathered, kv_kept, .. } = shape.sizes;
    let mixture = shape.model.experts.is_some();
    if shape.tsp > 1 && !mixture {
        let mut points = tsp_ring_in_b(shape, chunk);
        points.extend(tsp_attention_in_b(shape, chunk));
        return points;
    }
    // (A dense stage's B makes no weight gradient; its points are modelled without tsp, whose B
    // runs the MLP ring's.)
    if !mixture && shape.tsp > 1 {
        return Vec::new();
    }
    // The stage's B gradients (its layers' experts' and routers'), all made by then; under dp two
    // of the first layer's wait unreduced as the first joins its sum (`joining.held` counts them).
    let made_in_b = shape.mlp_gradients_in_b().unwrap_or(0.0) * chunk.layers as f64;
    // What W reads beyond the later layers' inputs: the first layer's output, which the next
    // layer's attention norm's weight gradient reads, or on a chunk of one layer the final norm's
    // (on another chunk its output sent on, counted apart), and on the last chunk the head's:
    // the final norm's output (but under full recomputation, where W recomputes it) and its
    // gradient, the logits' gradient and the load-balancing loss beside the cross-entropy.
    let mut for_w = Vec::new();
    if chunk.last && shape.tsp > 1 {
        // (Under tsp the head's reads are every token's: [`tsp_head_read_by_w`].)
        for_w.extend(tsp_head_read_by_w(shape, chunk));
    } else if chunk.last {
        for_w.push(Term {
            name: "first layer's output (the next layer's or the final norm's input, for W)",
            bytes: stream,
        });
        let final_norm_output = if shape.recompute() == Recompute::Full { 0.0 } else { gathered };
        for_w.push(Term {
            name: "the final norm's output and its gradient, the logits' gradient (for W)",
            bytes: final_norm_output + gathered + local_tokens * shape.sizes.vocab_shard * element,
        });
        if shape.statistics > 0.0 {
            for_w.push(Term { name: "the load-balancing loss beside the cross-entropy", bytes: element });
        }
        for_w.extend(final_norm_regathered_for_w(shape));
        // Under SP the last layer's output is kept gathered over tp for the final norm, in place of
        // the rank's share.
        if shape.sequence_parallel() {
            for_w.push(Term {
                name: "the last layer's output gathered over tp for the final norm, beyond its share",
                bytes: gathered - stream,
            });
        }
        // (Beside a tied table the head's part of its gradient, which the chunk's end holds, is
        // made in W.)
        if let Some(head_part) = shape.tied_head_part() {
            for_w.push(Term {
                name: "the LM head's part of the tied table's gradient, made in W",
                bytes: -head_part.bytes,
            });
        }
    }
    let mut points = shared_expert_in_b(shape, chunk, &for_w, made_in_b);
    // Past the first layer's shared expert's B, W also reads what its weight gradients read; past
    // the routed experts' backward, the MLP norm's output among them.
    let for_w_past_shared: Vec<Term> = shared_expert_read_by_w(shape, false).into_iter().chain(for_w.clone()).collect();
    let mut for_w: Vec<Term> = shared_expert_read_by_w(shape, true).into_iter().chain(for_w).collect();
    // Under tp B all-reduces the first layer's routed experts' input gradient before it makes
    // their weight gradients (on the micro-batch's first B of the chunk their sums not made yet).
    if let Some(mut reduced) = experts_input_gradient_reduced(shape, chunk) {
        // (Over ep the dispatch made the routed experts' gradients first.)
        let routed = if shape.dispatched() { shape.layer_routed_experts() } else { 0.0 };
        let pending = shape.mlp_gradients_in_b().unwrap_or(0.0) - routed;
        reduced.held.extend(for_w_past_shared.iter().cloned());
        points.push(Candidate {
            name: "first layer's routed experts' input gradient all-reduced over tp in B",
            so_far: made_in_b - pending,
            sum_pending: pending,
            ..reduced
        });
    }
    let context = mlp_context(shape, chunk, false);
    // Before the routed experts' weight gradients none of the layer's B gradients is made (on the
    // micro-batch's first B of the chunk their sums do not exist): over ep as B dispatches the
    // experts' backward; without ep as it sums their input gradient with the MLP norm output's
    // gradient so far.
    let layer = shape.mlp_gradients_in_b().unwrap_or(0.0);
    let dispatched = experts::dispatched(shape, "first layer's experts' backward dispatched in B", &context, 0.0);
    let router_summed = experts::router_gradients_summed(
        shape,
        "first layer's router gradients summed past the dispatch in B",
        &context,
        0.0,
    );
    let summed = experts::input_gradients_summed(shape, Place::FirstLayer, &context, 0.0)
        .map(|summed| Candidate { name: "first layer's MLP norm output's gradients summed in B", ..summed });
    // (Under tsp the layer's shared expert's ring, B's too, ran first: its gradients are made.)
    let shared_ring = shape.sharded(shape.shared_ring_gradients(), 0.0);
    for mut point in dispatched.into_iter().chain(router_summed).chain(summed) {
        point.held.extend(for_w_past_shared.iter().cloned());
        points.push(Candidate { so_far: made_in_b - layer + shared_ring, sum_pending: layer - shared_ring, ..point });
    }
    // (On the micro-batch's first B of the chunk the sums of those not yet made do not exist.)
    let not_yet = experts::not_yet_among_the_gradients(shape);
    let unreduced = experts::unreduced_beyond_waiting(shape);
    let mut made_point = None;
    if let Some(mut made) = experts::made_before_scattered(shape, Place::FirstLayer, &context, 0.0) {
        made.held.extend(for_w_past_shared.iter().cloned());
        // (Where they are all-reduced instead, the router's gradient is reduced and summed by
        // then: of B's gradients only the experts' three are not made.)
        let router = if unreduced > 0.0 { 0.0 } else { experts::router_whole_as_experts_are_made(shape) };
        let name = if unreduced > 0.0 {
            "first layer's expert gradients made, before their all-reduce in B"
        } else if shape.weights_gathered_again(1.0) > 0.0 {
            "first layer's expert gradients made beside their weights gathered again in B"
        } else {
            "first layer's expert gradients made, before their reduce-scatter in B"
        };
        let not_yet = not_yet + unreduced;
        made_point = Some(Candidate {
            name,
            so_far: made_in_b - not_yet + router - shape.router_shard(router),
            sum_pending: not_yet + shape.router_shard(router),
            ..made
        });
    }
    // (Where they are all-reduced, listed after their joining, with which it may tie.)
    if unreduced == 0.0 {
        points.extend(made_point.take());
    }
    // (Where the experts' gradients are reduced over dp or cp the joining frees the MLP norm's
    // output: but W reads it beside a shared expert.)
    if let Some(mut joining) = experts_joining(shape, chunk) {
        let norm_output_freed = shape.experts_scattered() || shape.experts_reduced;
        joining.held.extend(if norm_output_freed { for_w.clone() } else { for_w_past_shared });
        // (Over ep under ZeRO-2 the router's gradient from the dispatch is whole among the B
        // gradients, but its sum, not made yet, is its shard's.)
        let router_whole = experts::router_whole_beyond_its_shard(shape);
        let joining = Candidate {
            name: "first layer's expert gradient joins its sum in B",
            so_far: made_in_b - not_yet + router_whole,
            sum_pending: joining.sum_pending - router_whole + not_yet,
            ..joining
        };
        // Over ep beside the load-balancing loss B then sums the MLP norm output's gradients from
        // the router and from the experts, every buffer of the joining live.
        points.extend(experts::summed(shape, "first layer's MLP norm output's gradients summed in B", &joining));
        // Beside dp or cp the last of the three joins after the other two, their sums made.
        let last_name = "first layer's last expert gradient joins its sum in B, its unreduced copy live";
        if let Some(last) = experts::last_joining(shape, last_name, &joining) {
            let joined = last.so_far - joining.so_far;
            points.push(Candidate { sum_pending: last.sum_pending - joined, ..last });
        }
        points.push(joining);
    }
    points.extend(made_point);
    // Under tsp B's attention backward is the owners' ([`tsp_attention_in_b`]).
    if shape.tsp > 1 {
        points.extend(tsp_attention_in_b(shape, chunk));
        return points;
    }
    // A dense first layer's MLP weight gradients are W's: it reads the MLP norm's output, the
    // SiLU product (under full recomputation gate and up, which B recomputed with the norm's
    // output), and the layer's output gradient (under SP gathered over tp) and gate's and up's
    // output gradients.
    if !mixture && shape.recompute() == Recompute::Full {
        for_w.push(Term {
            name: "first layer's MLP norm output, gate and up (recomputed) and output gradients (for W)",
            bytes: 2.0 * gathered + 4.0 * local_tokens * ffn * element,
        });
    } else if !mixture {
        for_w.push(Term {
            name: "first layer's MLP norm output, SiLU product and output gradients (for W)",
            bytes: 2.0 * gathered + 3.0 * local_tokens * ffn * element,
        });
    }
    // Under SP o's weight gradient (W's) reads its output gradient gathered over tp, which its
    // input gradient read first.
    if shape.sequence_parallel() {
        for_w.push(Term {
            name: "first layer's attention residual gradient, gathered over tp (for W)",
            bytes: gathered,
        });
    }
    let mut held = before_attention(
        shape,
        chunk,
        [
            Term { name: "first layer's MLP norm output's gradient (for W)", bytes: stream },
            Term { name: "first layer's attention residual gradient", bytes: stream },
            Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
            Term {
                name: "first layer's attention q, k and v gradients",
                bytes: (local_tokens * query + kv_kept) * element,
            },
        ],
    );
    held.extend(received_counts(shape, chunk, false));
    held.extend(for_w.iter().cloned());
    // Under full recomputation B recomputed the attention norm's output and q, k and v (under
    // ZeRO-3 from the norm's and the projections' weights, gathered again and held to their input
    // gradients).
    if shape.recompute() == Recompute::Full {
        held.extend([
            Term {
                name: "first layer's attention norm output and q, k and v after RoPE, recomputed",
                bytes: gathered + (local_tokens * query + kv_kept) * element,
            },
            Term {
                name: "first layer's attention norm, q, k and v weights, gathered again",
                bytes: shape.attention_input_weights_gathered_again(),
            },
        ]);
    }
    points.push(Candidate::made("first layer's attention backward in B", made_in_b, held));
    points.push(attention_input_gradients_in_b(shape, chunk, for_w, made_in_b));
    points
}

/// What the micro-batch holds beside a tsp stage's first layer's MLP ring backward: its chunk's
/// inputs and end, the layer's attention activations, the MLP norm's output (the ring's input,
/// recomputed under full recomputation) and the MLP's output gradient, and on the first chunk the
/// token ids in zigzag order too (the embedding's backward reads them).
fn beside_tsp_first_ring(shape: &StageShape, chunk: &Chunk) -> Vec<Term> {
    let StepSizes { stream, gathered, .. } = shape.sizes;
    beside_tsp_first_layer(
        shape,
        chunk,
        [
            Term { name: "first layer's MLP norm output (the ring's input)", bytes: gathered },
            Term { name: "first layer's MLP output gradient", bytes: stream },
        ],
    )
}

/// Inside a tsp stage's first layer's backward: [`before_attention`] with `more`, and on the first
/// chunk the token ids in zigzag order (the embedding's backward reads them).
fn beside_tsp_first_layer(shape: &StageShape, chunk: &Chunk, more: [Term; 2]) -> Vec<Term> {
    let mut held = before_attention(shape, chunk, more);
    if chunk.first {
        held.push(Term { name: "token ids in zigzag order", bytes: shape.sizes.ids });
    }
    held
}

/// What a tsp stage's last chunk holds in B for its W beyond the later layers' inputs: the first
/// layer's output (the next layer's attention norm's input, or the final norm's), the head's
/// input gathered over the sequence (but under full recomputation), the final norm output's
/// gradient and every token's logits' gradient, and under ZeRO-3 with full recomputation the final
/// norm's weight gathered again; beside a tied table less the head's part of its gradient, which
/// W makes. (On another chunk the stage's output sent on,
/// which its end keeps, stands for the first layer's: the later layers' inputs for W count the
/// last layer's output.)
fn tsp_head_read_by_w(shape: &StageShape, chunk: &Chunk) -> Vec<Term> {
    let StepSizes { element, tokens, vocab_shard, gathered, stream, every_token, .. } = shape.sizes;
    if !chunk.last {
        return Vec::new();
    }
    let head_input = if shape.recompute() == Recompute::Full { 0.0 } else { every_token };
    let mut terms = vec![
        Term { name: "first layer's output (the next layer's or the final norm's input, for W)", bytes: stream },
        Term {
            name: "the head's input gathered, the final norm output's and the logits' gradients (for W)",
            bytes: head_input + gathered + tokens * vocab_shard * element,
        },
    ];
    terms.extend(final_norm_regathered_for_w(shape));
    if shape.statistics > 0.0 {
        terms.push(Term { name: "the load-balancing loss beside the cross-entropy", bytes: shape.sizes.element });
    }
    // (Beside a tied table the head's part of its gradient, which the chunk's end holds, is
    // made in W.)
    if let Some(head_part) = shape.tied_head_part() {
        terms
            .push(Term { name: "the LM head's part of the tied table's gradient, made in W", bytes: -head_part.bytes });
    }
    terms
}

/// Under full recomputation ZeRO-3 gathers the final norm's weight again at the last chunk's B's
/// head, for the recomputed head; W reads it again, to recompute the final norm's output.
fn final_norm_regathered_for_w(shape: &StageShape) -> Option<Term> {
    shape.norm_regathered("the final norm's weight, gathered again (for W)")
}

/// Under zero bubble a tsp stage's B may peak inside its first layer's MLP ring backward
/// ([`tsp_ring::ring_backward`]), the later layers' ring gradients made: beside the ring's
/// buffers the micro-batch holds [`beside_tsp_first_ring`] and what W reads of the head
/// ([`tsp_head_read_by_w`]).
fn tsp_ring_in_b(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let per_layer = shape.mlp_gradients_in_b().unwrap_or(0.0);
    let mut held = beside_tsp_first_ring(shape, chunk);
    held.extend(tsp_head_read_by_w(shape, chunk));
    let layers = chunk.layers as f64;
    tsp_ring::ring_backward(shape, &tsp_ring::FIRST_LAYER, held, (layers - 1.0) * per_layer, Some(layers * per_layer))
}

/// Under zero bubble a tsp stage's B may then peak inside its first layer's attention backward
/// (the input gradients'; W makes the weight gradients), which takes the owners last first: for
/// each, o's block broadcast again and attention's output gradient, under full recomputation q,
/// k and v recomputed with their blocks broadcast again (the attention norm's output once, for all
/// owners), the attention kernel's backward, k's and v's gradients reduce-scattered over the
/// sequence, and the attention norm output's gradient from each of v, k and q summed as it comes.
/// What W reads of an owner stays: q's, k's and v's gradients, and q, k and v (every token's k and
/// v) where W recomputes attention's output from them (freed without recomputation, where the
/// forward kept that output). The point: as the last owner's v's (or, the same bytes, k's) part of
/// the gradient joins the sum, beside the earlier owners' gradients for W, the last owner's
/// gradients and (recomputed) q and k blocks (else under ZeRO-3 the rank's own, gathered over dp,
/// wait for their broadcasts), the part and the sum before and after it; and without
/// recomputation as the first owner's k part joins its v part, the other owners' q, k and v (every
/// token's k and v) still live in place of their gradients (under ZeRO-3 the rank's own o, v and
/// k blocks gathered by then, and next, as its q part joins, q's too). Beside both
/// the MLP ring's input gradient (the MLP norm's weight gradient reads it in W), the attention
/// residual's gradient, and the layer's and the head's activations W reads (beside a shared
/// expert the MLP norm's output and the gate logit's gradient, for its gate vector's).
fn tsp_attention_in_b(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, stream, gathered, kv_kept, .. } = shape.sizes;
    let owners = shape.tsp as f64;
    let recompute = shape.recompute();
    let mut held = beside_tsp_first_layer(
        shape,
        chunk,
        [
            Term { name: "first layer's MLP ring's input gradient (for W)", bytes: gathered },
            Term { name: "first layer's attention residual gradient", bytes: stream },
        ],
    );
    held.extend(tsp_head_read_by_w(shape, chunk));
    held.extend(received_counts(shape, chunk, false));
    // (Beside a shared expert what its gate vector's weight gradient reads: the MLP norm's output
    // and the gate logit's gradient.)
    held.extend(shared_expert_read_by_w(shape, true));
    let every_owner_qkv = (local_tokens * query + kv_kept) * element;
    let gradients_for_w = local_tokens * (query + 2.0 * kv) * element;
    if recompute == Recompute::Full {
        held.extend([
            Term { name: "first layer's attention norm output, recomputed", bytes: gathered },
            Term { name: "every owner's q, k and v, recomputed (for W)", bytes: every_owner_qkv },
            Term {
                name: "the last owner's q and k blocks, broadcast again",
                bytes: hidden * (query + kv) / owners * element,
            },
        ]);
        // (Under ZeRO-3 the attention norm's weight, gathered again to recompute its output, to
        // the norm's backward.)
        held.extend(shape.norm_regathered(ATTENTION_NORM_REGATHERED));
    } else if recompute == Recompute::None {
        held.push(Term {
            name: "every owner's q, k and v, freed (the forward kept attention's output)",
            bytes: -every_owner_qkv,
        });
    }
    // Under ZeRO-3 the rank's own q and k blocks, gathered over dp again for the owners' input
    // gradients, wait for their broadcasts for the last owner's q and k parts, after v's (under
    // full recomputation the blocks broadcast again above).
    const OWN_Q_AND_K_BLOCKS: &str = "the rank's q and k blocks, gathered over dp again";
    let own_blocks = shape.tsp_blocks_gathered_again(&[TspBlock::Q, TspBlock::K]);
    if own_blocks > 0.0 && recompute != Recompute::Full {
        held.push(Term { name: OWN_Q_AND_K_BLOCKS, bytes: own_blocks });
    }
    held.extend([
        Term {
            name: "the earlier owners' q, k and v gradients (for W)",
            bytes: (owners - 1.0) / owners * gradients_for_w,
        },
        Term { name: "the last owner's q gradient, and k's and v's reduce-scattered", bytes: gradients_for_w / owners },
        Term {
            name: "v's part of the attention norm output's gradient, and the sum before and after it",
            bytes: 3.0 * gathered,
        },
    ]);
    let made_in_b = shape.mlp_gradients_in_b().unwrap_or(0.0) * chunk.layers as f64;
    let mut points = Vec::new();
    // Without recomputation, as the first owner's (the axis's last) k part joins its v part, the
    // other owners' q, k and v are live as the forward kept them, none of their gradients made.
    if recompute == Recompute::None && owners > 1.0 {
        let mut first_owner = held.clone();
        first_owner.push(Term {
            name: "the other owners' q, k and v in place of their gradients",
            bytes: (owners - 1.0) / owners * (every_owner_qkv - gradients_for_w),
        });
        // Under ZeRO-3 the first owner's broadcasts gather the rank's own blocks as they come,
        // each held for the owners after it: o's, v's and k's by its k part, q's next, for its q
        // part (which joins the sum as k's did, its gradients made).
        let gathered_by_k = shape.tsp_blocks_gathered_again(&[TspBlock::O, TspBlock::V, TspBlock::K]);
        let mut q_part = None;
        if gathered_by_k > 0.0 {
            first_owner.retain(|term| term.name != OWN_Q_AND_K_BLOCKS);
            first_owner.push(Term { name: "the rank's o, v and k blocks, gathered again", bytes: gathered_by_k });
            let mut held = first_owner.clone();
            let q_block = shape.tsp_blocks_gathered_again(&[TspBlock::Q]);
            held.extend((q_block > 0.0).then_some(Term { name: "the rank's q block, gathered again", bytes: q_block }));
            q_part = Some(Candidate::made(
                "first layer's attention backward in B: the first owner's q part of the input gradient summed",
                made_in_b,
                held,
            ));
        }
        points.push(Candidate::made(
            "first layer's attention backward in B: the first owner's k part of the input gradient summed",
            made_in_b,
            first_owner,
        ));
        points.extend(q_part);
    }
    points.push(Candidate::made(
        "first layer's attention backward in B: v's part of the input gradient summed",
        made_in_b,
        held,
    ));
    points
}

/// Outside zero bubble a tsp stage may peak inside its first layer's MLP ring backward too
/// ([`tsp_ring::ring_backward`]), the later layers' gradients made and their activations freed,
/// the micro-batch holding [`beside_tsp_first_ring`], or just past it, as the MLP norm's input
/// gradient is summed. (A dense model's.)
pub(super) fn tsp_ring_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    if shape.tsp == 1 || shape.zero_bubble || shape.model.experts.is_some() {
        return Vec::new();
    }
    let held = beside_tsp_first_ring(shape, chunk);
    // All the chunk's gradients but the first layer's (the rank's blocks of its attention and MLP
    // weights, both norms) and the embedding's.
    let element = shape.sizes.element;
    let blocks = shape.attention_weights * element / shape.tsp as f64 + shape.layer_mlp_gradients();
    let made_before = chunk.grads - shape.sharded(blocks + 2.0 * shape.norm * element + chunk.table, 0.0);
    let mut points = tsp_ring::ring_backward(shape, &tsp_ring::FIRST_LAYER, held, made_before, None);
    // Past the ring (beside dp its gradients reduced and summed, their unreduced copies freed),
    // the MLP norm's input gradient is summed into the attention residual's, beside the ring's
    // input gradient (the norm's weight gradient reads it next) and the layer's output gradient.
    let StepSizes { stream, gathered, .. } = shape.sizes;
    let mut held = beside_tsp_first_layer(
        shape,
        chunk,
        [
            Term { name: "first layer's MLP output gradient", bytes: stream },
            Term { name: "first layer's MLP ring's input gradient", bytes: gathered },
        ],
    );
    held.push(Term {
        name: "first layer's MLP norm's input gradient, and its sum with the output's",
        bytes: 2.0 * stream,
    });
    points.push(Candidate::made(
        "first layer's MLP norm's input gradient summed past the ring",
        made_before + shape.sharded(shape.layer_mlp_gradients(), 0.0),
        held,
    ));
    // (The layer's q, k and v gradients, which ZeRO keeps whole at dp=4 beside tp=2 or tsp=2 (k
    // and v) or at dp=8 beside tp=2 (q too), are not made yet: counting k's and v's was 1.5% above
    // the planner under ZeRO-3.)
    for point in &mut points {
        point.pending = KeptWholePending::LAYER;
    }
    points
}

/// Under zero bubble, what W reads of a layer's shared expert once its B is done (its weight
/// gradients are W's): the product and the gradients of the gate logit, the scaled output, gate
/// and up (under tsp, whose B ring makes the projections' gradients, the gate logit's alone), and
/// (`with_input`: once the routed experts' backward, which reads it too, is done) the MLP norm's
/// output. Empty without a shared expert.
fn shared_expert_read_by_w(shape: &StageShape, with_input: bool) -> Vec<Term> {
    let StepSizes { element, local_tokens, ffn, gathered, .. } = shape.sizes;
    if !shape.shared_expert() {
        return Vec::new();
    }
    // (The scaled output's gradient is whole over tp: under SP from the output gradient gathered.
    // Under tsp B's ring made the projections' weight gradients: W reads the gate logit's
    // gradient only, for the gate vector's.)
    let mut terms = vec![if shape.tsp > 1 {
        Term { name: "first layer's shared expert's gate logit's gradient (for W)", bytes: local_tokens * element }
    } else {
        Term {
            name: "first layer's shared expert's product and its projections' output gradients (for W)",
            bytes: gathered + local_tokens * (3.0 * ffn + 1.0) * element,
        }
    }];
    if with_input {
        terms.push(Term { name: "first layer's MLP norm output (the shared expert's input, for W)", bytes: gathered });
    }
    terms
}

/// Under zero bubble B runs the first layer's shared expert's backward first (its weight
/// gradients are W's), before the routed experts' and the router's: the stage may peak as gate's
/// output gradient is made, beside gate, up and their product (W reads the product), down's
/// input gradient, the gate logit's and the scaled output's gradients (for W) and the gate
/// vector's input gradient. Of the stage's B gradients only the later layers' are made. (Under
/// full recomputation B has recomputed the layer's MLP norm output, gate, up and product from the
/// attention residual kept, its attention not yet; under ZeRO-3 beside the weights it gathered
/// again for that.) Under ZeRO-3 also as down's input gradient is made, beside down's weights
/// gathered again (of a wide shared expert larger than the tokens' product), and under full
/// recomputation, where they are gathered in steps (over several of dp, cp and ep), as their last
/// step runs in the recomputed forward, beside the gate vector's weights and the gate logit.
/// (Under tsp its ring's: [`shared_expert::ring_points`].)
fn shared_expert_in_b(shape: &StageShape, chunk: &Chunk, for_w: &[Term], made_in_b: f64) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, ffn, gathered, .. } = shape.sizes;
    if !shape.shared_expert() {
        return Vec::new();
    }
    let intermediate = local_tokens * ffn * element;
    let layer = shape.mlp_gradients_in_b().unwrap_or(0.0);
    // (Under tsp B runs its ring whole, beside what W reads: the gate logit's gradient among it.)
    if shape.tsp > 1 {
        let mut held = mlp_context(shape, chunk, true);
        held.extend(for_w.iter().cloned());
        held.extend(shared_expert_read_by_w(shape, false));
        return shared_expert::ring_points(shape, Place::FirstLayer, &held, made_in_b - layer, Some(made_in_b));
    }
    // (Under SP the router's backward comes first, freeing the received counts on the first stage,
    // and the gate vector's last.)
    let sequence_parallel = shape.sequence_parallel();
    let point = |name, more: Vec<Term>| {
        let mut held = mlp_context(shape, chunk, !sequence_parallel);
        held.push(Term { name: "first layer's shared expert's gate, up and their product", bytes: 3.0 * intermediate });
        held.extend(more);
        held.extend(shared_expert::weights_regathered(shape));
        held.extend(shared_expert::beside_under_sequence_parallelism(shape, false));
        held.extend(for_w.iter().cloned());
        Candidate {
            name,
            so_far: made_in_b - layer,
            held,
            new_sum: None,
            pending: KeptWholePending::NONE,
            sum_pending: layer,
        }
    };
    let gradients = Term {
        name:
            "first layer's shared expert's gate logit's and scaled output's gradients, the gate vector's input gradient",
        bytes: local_tokens * element + if sequence_parallel { gathered } else { 2.0 * gathered },
    };
    let mut points = vec![point(
        "first layer's shared expert's gate output gradient in B",
        vec![
            gradients.clone(),
            Term {
                name: "first layer's shared down projection's input gradient and gate's output gradient",
                bytes: 2.0 * intermediate,
            },
        ],
    )];
    let down_weights = shape.down_gathered_again(shape.gate);
    if down_weights > 0.0 {
        points.push(point(
            "first layer's shared down projection's input gradient in B",
            vec![
                gradients,
                Term { name: "first layer's shared down projection's input gradient", bytes: intermediate },
                Term { name: "its weights, gathered again", bytes: down_weights },
            ],
        ));
    }
    let share = shape.two_step_gather_share();
    if share > 0.0 && down_weights > 0.0 && shape.recompute() == Recompute::Full {
        points.push(point(
            "first layer's shared down projection's weights gathered again in B, the last step",
            vec![
                Term {
                    name: "first layer's shared expert's gate vector weights (gathered again) and gate logit",
                    bytes: shape.norms_gathered_again(hidden * element) + local_tokens * element,
                },
                Term {
                    name: "its weights, gathered (staged) beside the step before's output",
                    bytes: (1.0 + share) * down_weights,
                },
            ],
        ));
    }
    points
}

/// Under zero bubble B next makes the first layer's attention norm output's gradients from v, k
/// and q (each of the whole hidden size, under tp partial) and sums them as they come: the stage
/// may peak as the gradients from v and k are summed (the one from q joining them is as large: the
/// three projections' gradients all stay for W, which makes their weight gradients). The kernel's
/// inputs and the attention output's gradient are freed by then; what W reads of the attention
/// (its output, or under either recomputation q, k and v after RoPE, which B recomputed) is live
/// beside the norm's output (recomputed by B under full recomputation), the attention residual and
/// the gradients W reads (under cp k's and v's reduce-scattered to the rank's tokens by then).
fn attention_input_gradients_in_b(shape: &StageShape, chunk: &Chunk, for_w: Vec<Term>, made_in_b: f64) -> Candidate {
    let StepSizes { element, local_tokens, query, kv, stream, gathered, attention_kept, kv_kept, .. } = shape.sizes;
    // (Under either recomputation B recomputed q, k and v for W, under full recomputation the
    // attention norm's output too.)
    let recomputed = shape.recompute() != Recompute::None;
    let mut held: Vec<Term> = if shape.positions_freed_in_b() {
        let mut held = chunk.first_layer_held_after_rope_backward();
        // (Under SP q's RoPE backward, which reads them last, comes after this point.)
        held.extend(chunk.positions_read_by_q_rope_backward(shape));
        held
    } else {
        chunk.first_layer_held.clone()
    };
    held.extend(received_counts(shape, chunk, false));
    let read_of_attention = if recomputed {
        Term {
            name: "first layer's q, k and v after RoPE, recomputed (for W)",
            bytes: (local_tokens * query + kv_kept) * element,
        }
    } else {
        Term { name: "first layer's attention output (for W)", bytes: local_tokens * attention_kept * element }
    };
    held.extend([
        Term { name: "first layer's attention norm output", bytes: gathered },
        read_of_attention,
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's MLP norm output's gradient (for W)", bytes: stream },
        Term { name: "first layer's attention residual gradient", bytes: stream },
        // (Under cp k's and v's reduce-scattered to the rank's tokens.)
        Term {
            name: "first layer's attention q, k and v gradients (for W)",
            bytes: local_tokens * (query + 2.0 * kv) * element,
        },
        Term { name: "the attention norm output's gradients from v and k, and their sum", bytes: 3.0 * gathered },
    ]);
    held.extend(for_w);
    // Under full recomputation ZeRO-3 gathered the attention norm's and q's weights again for the
    // recomputed forward, and B holds them to the norm's and q's input gradients.
    if shape.recompute() == Recompute::Full {
        held.push(Term {
            name: "first layer's attention norm and q weights, gathered again",
            bytes: shape.norms_gathered_again(shape.norm * shape.sizes.element) + shape.query_weight_gathered_again(),
        });
    }
    Candidate::made("first layer's attention norm output's gradients summed in B", made_in_b, held)
}

/// Under zero bubble a shared expert's weight gradients (its gate vector's too) are W's, made
/// before the layer's attention's and norms', and a stage may peak as the first layer's shared
/// gate projection gradient, the last of its three, joins its sum: `w_reads` is what W's tail
/// still reads, and beside it the layer's attention inputs and gradients, both norm outputs'
/// gradients and gate's output gradient are live (the attention norm's input gradient sent back
/// by B). Beside its replicas (dp, cp or ep) the weight gradient is all-reduced, gate's output
/// gradient freed before: the unreduced copy is live beside the reduced one (under ZeRO-2 and 3
/// reduce-scattered, staged whole). (Not under tsp, whose B ring makes gate's gradient.)
pub(super) fn shared_expert_gate_joining_in_w(shape: &StageShape, chunk: &Chunk, w_reads: Term) -> Option<Candidate> {
    let StepSizes { element, local_tokens, ffn, .. } = shape.sizes;
    // (Under tsp B's ring made gate's gradient.)
    if !shape.shared_expert() || shape.tsp > 1 {
        return None;
    }
    let full = shape.recompute() == Recompute::Full;
    let mut held = chunk.first_layer_held_after_rope_backward();
    held.extend(read_by_w(shape, w_reads));
    held.push(if shape.scattered {
        Term { name: "first layer's shared gate gradient before its reduce-scatter", bytes: shape.gate }
    } else if shape.reduced {
        Term { name: "first layer's shared gate gradient before its all-reduce", bytes: shape.gate }
    } else {
        Term { name: "first layer's shared gate output gradient", bytes: local_tokens * ffn * element }
    });
    // Under ZeRO-2 and 3 it is reduce-scattered, staged whole: its shard joins its sum after.
    held.extend(shape.scattered.then_some(Term { name: "its reduce-scatter's staging", bytes: shape.gate }));
    // Under full recomputation a stage between the first and the last still holds the counts'
    // sum it received, as at W's tail.
    if full {
        held.extend(received_counts(shape, chunk, false));
    }
    // (B made the routed experts' and the router's gradients.)
    let mut not_made = (shape.attention_weights + 2.0 * shape.norm) * element + chunk.table;
    // Under SP the gate vector's weight gradient comes after gate's, reading the gate logit's
    // gradient; o's weight gradient reads the attention residual's gradient gathered over tp, and
    // on the first chunk the embedding output's gradient is whole (gathered) for the embedding's.
    if shape.sequence_parallel() {
        let StepSizes { hidden, stream, gathered, .. } = shape.sizes;
        not_made += hidden * element;
        held.extend([
            Term { name: "first layer's shared expert's gate logit's gradient", bytes: local_tokens * element },
            Term { name: "first layer's attention residual gradient, gathered over tp (for W)", bytes: gathered },
        ]);
        if chunk.first {
            held.push(Term {
                name: "the embedding output's gradient whole, beyond the attention norm's input gradient",
                bytes: gathered - stream,
            });
        }
    }
    let joining = if shape.scattered { shape.gate } else { 0.0 };
    Some(Candidate {
        name: "first layer's shared expert's gate gradient joins its sum",
        so_far: chunk.grads - (not_made + joining) / shape.shards,
        held,
        new_sum: (!shape.scattered)
            .then_some(Term { name: "the joining shared gate gradient's new sum beside the old", bytes: shape.gate }),
        pending: KeptWholePending::LAYER,
        sum_pending: 0.0,
    })
}

/// The first layer's attention norm output's gradient, under tsp the sum of the owners' input
/// gradient parts so far.
const ATTENTION_NORM_OUTPUT_GRADIENT: &str = "first layer's attention norm output gradient";

/// Under tsp a stage may peak inside its first layer's attention backward. That backward takes
/// the owners in reverse (the last first): for each, the rank's contributions to the owner's q,
/// k, v and o gradients (its block: the layer's attention weights over the owners), then their
/// reduces to the owner, o's first; a reduce leaves zeros on the other ranks, and the owners'
/// results are summed as they come (the rank's own gradient is its own owner's). The layer's
/// attention norm and residual gradients are live throughout. The points: as o's gradient is
/// reduced to an owner ([`tsp_o_reduces`]; to the first, [`tsp_first_owner_o_reduce`], none
/// summed before it), on the axis's last rank (but beside dp, which all-reduces it first) as it
/// joins its sum, and outside zero bubble (whose W runs no kernel) as the last owner's attention
/// kernel makes v's gradient (for a mixture's chunk under full recomputation in its last layer
/// too) and then as its q input gradient is made. Under zero bubble W's last layer has the same
/// points as its first, beside `later_w_reads` (what B's first layer holds of the later layers
/// for W: by symmetry, what W's last holds of the layers before). Beside a shared expert every
/// layer's MLP norm output stays to the micro-batch's end (its gate vector's weight gradient, W's
/// first of the layer, reads it).
pub(super) fn tsp_attention(shape: &StageShape, chunk: &Chunk, later_w_reads: f64) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, stream, gathered, every_token, .. } = shape.sizes;
    let StepSizes { attention_kept, kv_kept, .. } = shape.sizes;
    if shape.tsp == 1 {
        return Vec::new();
    }
    let (layers, recompute) = (chunk.layers as f64, shape.recompute());
    let owners = shape.tsp as f64;
    let block = shape.attention_weights / owners * element;
    let o_block = hidden * query / owners * element;
    let mut gradients = vec![
        Term { name: ATTENTION_NORM_OUTPUT_GRADIENT, bytes: stream },
        Term { name: "first layer's attention residual gradient", bytes: stream },
    ];
    // (A stage between the first and the last still holds a mixture's summed expert counts it
    // received; under zero bubble, but under full recomputation, the walk counts them beside W.)
    if !shape.zero_bubble || recompute == Recompute::Full {
        gradients.extend(received_counts(shape, chunk, false));
    }
    // Under zero bubble this is W: B made the layer's input gradients, and the first layer's
    // attention norm's (sent back) and every layer's attention residual's (which B reads too) stay
    // to the micro-batch's end. Under either recomputation W still reads every layer's q, k and v
    // (every token's k and v), which B recomputed for it.
    let recomputing = recompute != Recompute::None;
    // Under zero bubble, what each layer keeps to the micro-batch's end for W: its attention
    // residual's gradient, and under either recomputation its q, k and v.
    let layer_qkv_for_w = if recomputing { (local_tokens * query + kv_kept) * element } else { 0.0 };
    // (And beside a shared expert its MLP norm output, which its gate vector's weight gradient
    // reads in W.)
    let shared_expert = shape.shared_expert();
    let shared_expert_input = if shared_expert { gathered } else { 0.0 };
    if shape.zero_bubble {
        // (On the first chunk B summed the attention norm's input gradient into the embedding
        // output's and gathered that over the sequence for the embedding's gradient, W's last.)
        if chunk.first {
            gradients.extend([
                Term { name: "the embedding output's gradient, gathered over the sequence", bytes: every_token },
                Term { name: "token ids in zigzag order", bytes: shape.sizes.ids },
            ]);
        } else {
            gradients.push(Term { name: "first layer's attention norm's input gradient", bytes: stream });
        }
        gradients.push(Term { name: "the later layers' attention residual gradients", bytes: (layers - 1.0) * stream });
        // (Beside a shared expert every layer's MLP norm output, which its gate vector's weight
        // gradient read in W, stays too.)
        gradients.push(Term { name: "every layer's MLP norm output", bytes: layers * shared_expert_input });
        if recomputing {
            gradients.push(Term {
                name: "every layer's q, k and v, kept or recomputed for W",
                bytes: layers * layer_qkv_for_w,
            });
        }
    }
    // What an owner whose backward is still to come keeps: its q, attention's output and every
    // token's k and v as the forward kept them (none under full recomputation, which recomputes
    // each at its owner's turn); under zero bubble what W reads of it, q's, k's and v's gradients
    // and attention's output but under recomputation (its q, k and v counted above).
    let later_owner_activations = if shape.zero_bubble {
        let output = if recomputing { 0.0 } else { query };
        local_tokens * (output + query + 2.0 * kv) * element / owners
    } else if recompute == Recompute::Full {
        0.0
    } else {
        (local_tokens * (query + attention_kept) + kv_kept) * element / owners
    };
    // As o's gradient of an owner is reduced, the rank holds the owners' results before that one,
    // summed (a block), its contributions to that owner's block, the reduce's own buffers, and,
    // with `after` owners still to come, their activations and the attention norm's output they
    // read. Of the layer's gradients only its attention's and its input norm's are not done.
    let reducing_so_far = chunk.grads - shape.sharded(block + shape.norm * element + chunk.table, 0.0);
    // (On the first chunk the token ids in zigzag order, which the embedding's backward reads;
    // under zero bubble its between B and W counts them.)
    let zigzag_ids = (chunk.first && !shape.zero_bubble)
        .then_some(Term { name: "token ids in zigzag order", bytes: shape.sizes.ids });
    // Under ZeRO-3 every rank passes its own blocks, gathered over its replicas again, to each
    // owner's broadcasts, so they stay until the last owner's (outside zero bubble, where B and W
    // broadcast them apart); under full recomputation the attention norm's weight too, gathered
    // to recompute its output, live to its backward.
    let own_block = if shape.zero_bubble {
        0.0
    } else {
        shape.tsp_blocks_gathered_again(&[TspBlock::Q, TspBlock::K, TspBlock::V, TspBlock::O])
    };
    let norm_gathered = if shape.zero_bubble { None } else { shape.norm_regathered(ATTENTION_NORM_REGATHERED) };
    // (On the first chunk the last owner's RoPE backward read the positions last: outside zero
    // bubble they are freed by its reduce; under it B ran that backward, and a W without
    // recomputation reads none.)
    let held_from = |rope_done: bool| {
        let mut held =
            if rope_done { chunk.first_layer_held_after_rope_backward() } else { chunk.first_layer_held.clone() };
        held.extend(gradients.iter().cloned());
        held.extend(zigzag_ids.clone());
        held.extend(norm_gathered.clone());
        // (Under zero bubble the last chunk's W holds the final norm's weight B gathered again
        // for it, as the micro-batches waiting for theirs do.)
        if shape.zero_bubble && chunk.last {
            held.extend(final_norm_regathered_for_w(shape));
        }
        held
    };
    let w_without_rope = shape.zero_bubble && !recomputing;
    let own_blocks_gathered = |after: u64| {
        (after > 0 && own_block > 0.0).then_some(Term {
            name: "the rank's own attention blocks, gathered again for the owners still to come",
            bytes: own_block,
        })
    };
    // Each point's counterpart in W's last layer, by index (under zero bubble).
    let mut in_w_last_layer = Vec::new();
    let mut candidates = Vec::new();
    let mut last_layer_points = Vec::new();
    // (And as it is reduced to the first owner, the axis's last, none summed before it.)
    let first_owner = tsp_first_owner_o_reduce(shape.tsp, shape.tsp_rank, o_block);
    for point in tsp_o_reduces(shape.tsp, shape.tsp_rank, o_block).into_iter().chain([first_owner]) {
        let mut held = held_from(w_without_rope || (!shape.zero_bubble && point.after == 0));
        if point.after + 1 < shape.tsp {
            held.push(Term { name: "the owners' reduced attention weight gradients before it, summed", bytes: block });
        }
        held.extend([Term { name: point.contributions, bytes: block }, point.reduce]);
        if point.after > 0 {
            held.push(Term { name: "first layer's attention norm output", bytes: gathered });
            held.push(Term {
                name: "the activations of the owners still to come",
                bytes: point.after as f64 * later_owner_activations,
            });
            held.extend(own_blocks_gathered(point.after));
        }
        let (name, in_w) = match (point.to_this_rank, point.after + 1 == shape.tsp) {
            (true, false) => (
                "first layer's o gradient reduced to this rank, its owner",
                "the last layer's o gradient reduced to this rank, its owner, in W",
            ),
            (false, false) => (
                "first layer's o gradient reduced to another owner",
                "the last layer's o gradient reduced to another owner, in W",
            ),
            (true, true) => (
                "first layer's o gradient reduced to this rank, the first owner",
                "the last layer's o gradient reduced to this rank, the first owner, in W",
            ),
            (false, true) => (
                "first layer's o gradient reduced to the first owner",
                "the last layer's o gradient reduced to the first owner, in W",
            ),
        };
        in_w_last_layer.push((candidates.len(), in_w));
        candidates.push(Candidate::made(name, reducing_so_far, held));
    }
    // Outside zero bubble, at each owner's attention kernel backward as v's gradient is made: the
    // earlier owners' results summed (a block; none before the first), the attention norm's
    // output, o's contribution and attention's output gradient, the owner's q, k and v (every
    // token's k and v; recomputed under full recomputation with their blocks, which the input
    // gradients read next), and the kernel's three gradients (k's and v's every token's, before
    // their reduce-scatter); with owners still to come, their activations, and under ZeRO-3 the
    // rank's own blocks gathered again (at the last owner's, o's freed after its broadcast, q's,
    // k's and v's still to be broadcast).
    if !shape.zero_bubble {
        let owner_qkv = (local_tokens * query + kv_kept) * element / owners;
        let q_block = hidden * query / owners * element;
        let own_qkv_blocks = shape.tsp_blocks_gathered_again(&[TspBlock::Q, TspBlock::K, TspBlock::V]);
        // (The last owner's points first, so that where an earlier owner's hold the same bytes, as
        // under full recomputation without ZeRO-3, the peak is named for the last.)
        for after in 0..shape.tsp {
            let names = TspOwnerPoints::at(after, shape.tsp);
            // What the owner's points hold for its place on the axis.
            let mut place = Vec::new();
            if after + 1 < shape.tsp {
                place.push(Term {
                    name: "the owners' reduced attention weight gradients before it, summed",
                    bytes: block,
                });
            }
            place.push(Term { name: "first layer's attention norm output", bytes: gathered });
            if after > 0 {
                place.push(Term {
                    name: "the activations of the owners still to come",
                    bytes: after as f64 * later_owner_activations,
                });
            }
            let mut held = chunk.first_layer_held.clone();
            // (The first owner's kernel runs before any input gradient part is made: the
            // attention norm output's gradient is first made of its k and v parts.)
            let first_owner = after + 1 == shape.tsp;
            held.extend(
                gradients.iter().filter(|term| !(first_owner && term.name == ATTENTION_NORM_OUTPUT_GRADIENT)).cloned(),
            );
            held.extend(place.iter().cloned());
            held.extend([
                Term { name: "the owner's attention output gradient", bytes: local_tokens * query / owners * element },
                Term { name: "its contribution to o's gradient", bytes: o_block },
                Term { name: "its q, k and v (every token's k and v)", bytes: owner_qkv },
                Term { name: "their gradients, made by the attention kernel's backward", bytes: owner_qkv },
            ]);
            // (Each block is gathered at its first broadcast, in the first owner's backward: o's
            // before the kernel's, the others' after it.)
            let gathered_blocks = match (after == 0, after + 1 == shape.tsp) {
                // (Under full recomputation q's, k's and v's last broadcasts recompute them, at
                // the owner's start, and o's follows.)
                (true, _) if recompute == Recompute::Full => 0.0,
                (true, _) => own_qkv_blocks,
                (false, true) if recompute != Recompute::Full => own_block - own_qkv_blocks,
                _ => own_block,
            };
            if gathered_blocks > 0.0 {
                held.push(Term {
                    name: "the rank's own attention blocks gathered again so far",
                    bytes: gathered_blocks,
                });
            }
            held.extend(norm_gathered.clone());
            if recompute == Recompute::Full {
                held.push(Term {
                    name: "its q, k and v blocks, broadcast again to recompute them",
                    bytes: hidden * (query + 2.0 * kv) / owners * element,
                });
            }
            held.extend(zigzag_ids.clone());
            // Under full recomputation a mixture's chunk of more than one layer may peak at the
            // same point of its last layer's attention backward, the last owner's: the residual
            // stream every layer below kept is still live (on the first stage the received counts
            // too: the first layer's router has not read them yet), and of the chunk's gradients
            // only the head's (on the last chunk) and the last layer's MLP's and MLP norm's are
            // made.
            if after == 0 && recompute == Recompute::Full && chunk.layers > 1 && shape.model.experts.is_some() {
                let mut last_layer: Vec<Term> = held
                    .iter()
                    .filter(|term| term.name != RECEIVED_COUNTS)
                    .cloned()
                    .chain(received_counts(shape, chunk, true))
                    .collect();
                last_layer.push(Term {
                    name: "the residual stream the layers below its last kept",
                    bytes: (layers - 1.0) * shape.sizes.kept_layer,
                });
                // (Beside a tied table the head's part joins no sum: the chunk's held buffers
                // count it.)
                let head = if chunk.last { shape.head_gradient_summed() + shape.norm * element } else { 0.0 };
                let so_far = (head + shape.norm * element) / shape.shards + shape.layer_mlp_gradient_shards();
                last_layer_points.push(Candidate {
                    pending: KeptWholePending::layers(chunk.layers),
                    ..Candidate::made(
                        "the last layer's attention kernel backward: the last owner's v gradient",
                        so_far,
                        last_layer,
                    )
                });
            }
            candidates.push(Candidate::made(names.v_gradient, reducing_so_far, held));
            // Then, its RoPE backward done (the last owner's frees the positions on the first
            // chunk), as q's input gradient is made (k's and v's first): the rank's contributions
            // to the owner's o, k and v gradients, q's block broadcast again, q's gradient, and the
            // input gradient beside them; then as that joins the attention norm output's gradient,
            // q's block freed.
            let mut held = held_from(after == 0);
            held.extend(place);
            held.extend(own_blocks_gathered(after));
            held.extend([
                Term { name: "its contributions to the owner's o, k and v gradients", bytes: block - q_block },
                Term { name: "the owner's q gradient", bytes: local_tokens * query / owners * element },
                Term { name: "its q input gradient", bytes: stream },
            ]);
            let mut joined = held.clone();
            joined.push(Term { name: "the attention norm output's gradient, summed with it", bytes: stream });
            held.push(Term { name: "the owner's q block, broadcast again", bytes: q_block });
            candidates.push(Candidate::made(names.q_input_gradient, reducing_so_far, held));
            candidates.push(Candidate::made(names.q_input_gradient_joined, reducing_so_far, joined));
        }
    }
    // As o's gradient joins its sum, on the axis's last rank: the results summed (a block), the
    // first owner's q, k and v contributions, o's result for the first owner (zeros but on it),
    // and o's gradient done (outside zero bubble the last owner's RoPE backward done by then).
    if !shape.reduced {
        let mut held = held_from(w_without_rope || !shape.zero_bubble);
        held.extend([
            Term { name: "the owners' reduced attention weight gradients, summed", bytes: block },
            Term { name: "the first owner's q, k and v contributions", bytes: block - o_block },
            Term { name: "o's reduced gradient for the first owner", bytes: o_block },
        ]);
        candidates.push(Candidate {
            name: "first layer's o gradient joins its sum",
            so_far: chunk.grads - (block - o_block) - shape.norm * element - chunk.table,
            held,
            new_sum: Some(Term { name: "the joining o gradient's new sum beside the old", bytes: o_block }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
        in_w_last_layer.push((candidates.len() - 1, "the last layer's o gradient joins its sum, in W"));
    }
    // (Every point comes before the layer's k and v gradients are reduced to their owners.)
    for candidate in &mut candidates {
        candidate.pending = KeptWholePending::LAYER;
    }
    candidates.extend(last_layer_points);
    // Zero bubble's W takes the chunk's layers last to first: at its last layer's points the
    // micro-batch holds the same as at the first layer's and what W reads of the layers before
    // (but what they keep to its end, counted above), none of whose attention or norm weight
    // gradients is made yet, nor any layer's k and v.
    if shape.zero_bubble && chunk.layers > 1 {
        // (Nor, beside a shared expert, its gate vector's, W's first of the layer.)
        let gate_vector = if shared_expert { hidden * element } else { 0.0 };
        let not_made = shape.sharded((layers - 1.0) * (block + 2.0 * shape.norm * element + gate_vector), 0.0);
        let read_before = later_w_reads - (layers - 1.0) * (stream + layer_qkv_for_w + shared_expert_input);
        for (index, name) in in_w_last_layer {
            let first_layer = &candidates[index];
            let mut held = first_layer.held.clone();
            held.push(Term { name: "what W reads of the layers before", bytes: read_before });
            candidates.push(Candidate {
                name,
                so_far: first_layer.so_far - not_made,
                held,
                pending: KeptWholePending::layers(chunk.layers),
                ..first_layer.clone()
            });
        }
    }
    candidates
}

/// ZeRO-3 under full recomputation gathers the first layer's weights again for its recomputed
/// forward: a stage may peak inside that layer's backward, as its down projection's gradient
/// (none of the layer's done yet) is reduce-scattered, its MLP norm's, gate's and up's weights
/// gathered whole beside the recomputed norm output, gate and up, and the gradient of the SiLU
/// product; or as its output projection's gradient is (the MLP's done), its attention norm's,
/// q's, k's and v's weights gathered beside the recomputed norm output, q, k and v, and the
/// attention output's gradient (and on a stage between the first and the last, a mixture's summed
/// expert counts it received), or just before, as that gradient is made beside the attention's
/// output recomputed for it (under SP beside the attention residual's gradient gathered over tp).
/// (Not under zero bubble: B recomputes the forward, gathering the weights, and W, which makes the
/// weight gradients, reads what B kept, no weight; nor under tsp, whose MLP ring and attention
/// owners are modelled apart, `tsp_ring`. For a mixture only the attention's points: its MLP's
/// are its experts' and shared expert's.)
pub(super) fn regathered(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv_kept, ffn, stream, gathered, .. } = shape.sizes;
    if !(shape.scattered && shape.workload.zero >= 3 && shape.recompute() == Recompute::Full)
        || shape.zero_bubble
        || shape.tsp > 1
    {
        return Vec::new();
    }
    let (gate, norm, attention_weights, shards) = (shape.gate, shape.norm, shape.attention_weights, shape.shards);
    let mut mlp = chunk.first_layer_held.clone();
    mlp.extend([
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's output gradient", bytes: stream },
        Term { name: "first layer's SiLU product's gradient", bytes: local_tokens * ffn * element },
        Term { name: "first layer's MLP norm weight, gathered", bytes: shape.norms_gathered_again(norm * element) },
        Term { name: "first layer's MLP norm output, recomputed", bytes: gathered },
        Term { name: "first layer's gate and up weights, gathered", bytes: shape.gate_up_gathered_again(2.0 * gate) },
        Term { name: "first layer's gate and up, recomputed", bytes: 2.0 * local_tokens * ffn * element },
        Term { name: "first layer's down gradient before its dp reduce-scatter", bytes: gate },
        Term { name: "its reduce-scatter's staging", bytes: gate },
    ]);
    let output_projection = hidden * query * element;
    let mut attention = chunk.first_layer_held.clone();
    attention.extend([
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
        Term {
            name: "first layer's attention norm weight, gathered",
            bytes: shape.norms_gathered_again(norm * element),
        },
        Term { name: "first layer's attention norm output, recomputed", bytes: gathered },
        Term {
            // (But q or k and v where ZeRO keeps them whole.)
            name: "first layer's q, k and v weights, gathered",
            bytes: shape.query_weight_gathered_again() + shape.key_value_weights_gathered_again(),
        },
        // (Beside cp k and v over every token, gathered.)
        Term { name: "first layer's q, k and v, recomputed", bytes: (local_tokens * query + kv_kept) * element },
        Term { name: "first layer's output projection gradient before its reduce-scatter", bytes: output_projection },
    ]);
    attention.extend(received_counts(shape, chunk, false));
    // As o's weight gradient is made, the attention's output recomputed for it and (under SP) the
    // attention residual's gradient gathered over tp are live; both are freed before the
    // reduce-scatter, which stages the gradient whole.
    let mut made = attention.clone();
    made.push(Term { name: "first layer's attention output, recomputed", bytes: local_tokens * query * element });
    if shape.sequence_parallel() {
        made.push(Term { name: "first layer's attention residual gradient, gathered over tp", bytes: gathered });
    }
    attention.push(Term { name: "its reduce-scatter's staging", bytes: output_projection });
    let so_far = made_before_first_attention_weights(shape, chunk);
    let point = |name, held| Candidate::before_first_attention(name, so_far, held);
    let attention_points = [
        point("first layer's o gradient made, its attention regathered", made),
        point("first layer's o gradient reduce-scattered, its attention regathered", attention),
    ];
    let mut points = Vec::new();
    if shape.model.experts.is_none() {
        points.push(Candidate::before_first_attention(
            "first layer's down gradient reduce-scattered, its MLP regathered",
            chunk.grads - (3.0 * gate + (attention_weights + 2.0 * norm) * element + chunk.table) / shards,
            mlp,
        ));
    }
    points.extend(attention_points);
    points
}

/// Under ZeRO-3 with full recomputation, a tsp attention backward's term for the attention norm's
/// weight, gathered again to recompute its output, live to the norm's backward.
const ATTENTION_NORM_REGATHERED: &str = "the attention norm's weight, gathered again to recompute its output";

/// The names of an owner's points in a tsp attention backward, by its place (the owners go last
/// first: the first processed has every other owner still to come).
struct TspOwnerPoints {
    v_gradient: &'static str,
    q_input_gradient: &'static str,
    q_input_gradient_joined: &'static str,
}

impl TspOwnerPoints {
    /// The names for the owner with `after` owners still to come on an axis of `tsp` ranks.
    fn at(after: u64, tsp: u64) -> TspOwnerPoints {
        if after == 0 {
            TspOwnerPoints {
                v_gradient: "first layer's attention kernel backward: the last owner's v gradient",
                q_input_gradient: "first layer's q input gradient, the last owner's",
                q_input_gradient_joined:
                    "first layer's q input gradient joins the attention norm output's, the last owner's",
            }
        } else if after + 1 == tsp {
            TspOwnerPoints {
                v_gradient: "first layer's attention kernel backward: the first owner's v gradient",
                q_input_gradient: "first layer's q input gradient, the first owner's",
                q_input_gradient_joined:
                    "first layer's q input gradient joins the attention norm output's, the first owner's",
            }
        } else {
            TspOwnerPoints {
                v_gradient: "first layer's attention kernel backward: a middle owner's v gradient",
                q_input_gradient: "first layer's q input gradient, a middle owner's",
                q_input_gradient_joined:
                    "first layer's q input gradient joins the attention norm output's, a middle owner's",
            }
        }
    }
}
