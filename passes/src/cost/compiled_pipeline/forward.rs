//! Under zero bubble a stage may peak inside a forward: the micro-batches between their B and
//! their W keep what their W reads (more than a micro-batch in flight keeps for its backward), and
//! a forward runs beside them as soon as the schedule allows, the forwarded micro-batch holding all
//! it keeps for its backward beside its last layer's transient outputs. Under any schedule,
//! beside cp, a stage may also peak as the last chunk's forward gathers every token's logits.

use super::super::memory::Term;
use super::super::step_sizes::{StepSizes, ID_BYTES};
use super::super::workload::Recompute;
use super::chunk::{Candidate, Chunk};
use super::shared_expert::shared_expert_kept;
use super::{tsp_ring, StageShape};

/// The points of a micro-batch's forward on a chunk, at its last layer's MLP: as the MLP's output
/// is added to its residual (the layer's output made beside it); as a mixture's routed experts run
/// (over ep or tsp their dispatch's copy of its operands, else their output being made; under
/// ZeRO-3 beside the router and experts gathered for them, and gathered over dp × cp a step an
/// axis, as their last matrix's last step runs); or beside a shared expert as the
/// routed experts' output and the shared expert's scaled output are summed (the layer's output not
/// yet made), and under full recomputation as the shared expert's product, its down projection's
/// output and its scaled output are made; under SP as the MLP's output is reduce-scattered over
/// tp, and without SP as a mixture's routed experts' output is all-reduced over it (under SP and
/// ZeRO-3 the router, gathered for the experts, is kept to the layer's statistics, made after its
/// output); under ZeRO-3 as a dense MLP's down projection's output is made beside its gathered
/// weight; under SP with full recomputation, on the last chunk, as the final norm runs on the
/// last layer's output gathered over tp; under full recomputation beside cp (without tp) as the
/// last layer's attention runs on every token's k and v, gathered. The micro-batch holds all it
/// keeps in flight there but what
/// the rest of its forward makes (on the last chunk the head's buffers, and a mixture's counts'
/// sum over the layers, whose statistics are all live instead). On the last chunk beside cp also
/// [`logits_gathered`], under ZeRO-3 [`head_weight_gathered`], and under tp
/// [`loss_row_statistics_gathered`]; on the first chunk under ZeRO-3
/// [`embedding_gathered`]; under tsp only [`tsp_logits_reordered`], and on the first chunk
/// [`tsp_embedding_scattered`]. (Under zero bubble only, ZeRO-2 and 3 included, whose
/// running sums are the rank's shards; under ZeRO-3 a tsp ring's weights, and the router and
/// experts of a mixture's dispatch over tsp, are gathered over dp beside it. Under another
/// schedule only [`logits_gathered`], every
/// micro-batch before it in flight or finished; under interleaving the micro-batch's earlier
/// chunks on the stage hold their layers' statistics in flight too, which the walk leaves to this
/// point.)
pub(super) fn forward_points(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, query, kv, kv_kept, ffn, stream, gathered, .. } = shape.sizes;
    if !shape.zero_bubble {
        return if chunk.last { logits_gathered(shape, chunk).into_iter().collect() } else { Vec::new() };
    }
    let statistics = shape.statistics;
    let full = shape.recompute() == Recompute::Full;
    // On the last chunk the head is still to run: the final norm's buffers (recomputed under full
    // recomputation, not kept; under tsp its output gathered over the sequence), the logits and
    // the loss, and a mixture's counts' sum and load-balancing loss, in place of which every
    // layer's statistics are live (the earlier stages' received).
    let kept = if chunk.last {
        chunk.in_flight - shape.final_norm_kept() - shape.logits() - element - mixture_head(shape)
    } else {
        chunk.in_flight
    };
    // (None of the micro-batch's gradients made.)
    let point = |name, held| Candidate::made(name, 0.0, held);
    let positions = Term { name: "its positions", bytes: chunk.positions };
    let before_layer_output =
        Term { name: "what it holds in flight by then but its last layer's output", bytes: kept - stream };
    let mut points = vec![point(
        "the last layer's output in a forward",
        vec![
            positions.clone(),
            Term { name: "what it holds in flight by then", bytes: kept },
            Term { name: "its last layer's MLP output", bytes: stream },
        ],
    )];
    // A mixture's routed experts run before the layer's statistics and output (and its shared
    // expert's, which the forward keeps) are made (under full recomputation beside the MLP norm's
    // output, not kept): over ep or tsp dispatched from a copy of their operands (the MLP norm's
    // output, the router and the rank's experts), else as one kernel making their output; under
    // ZeRO-3 beside the router and (where ZeRO splits them) the experts, gathered for it.
    let before_experts = vec![
        positions.clone(),
        Term {
            name: "what it holds in flight by then but its last layer's output, statistics and shared expert's",
            bytes: kept - stream - 2.0 * statistics - shared_expert_kept(shape),
        },
        Term { name: "its last layer's MLP norm output, not kept", bytes: if full { gathered } else { 0.0 } },
    ];
    if shape.model.experts.is_some() {
        let (name, own) = if shape.dispatched() {
            let operands = gathered + shape.router() + shape.layer_routed_experts();
            (
                "the last layer's experts dispatched in a forward",
                Term { name: "the dispatch's copy of its operands", bytes: operands },
            )
        } else {
            (
                "the last layer's routed experts in a forward",
                Term { name: "its last layer's routed experts' output", bytes: gathered },
            )
        };
        let routed = if shape.experts_scattered() { shape.layer_routed_experts() } else { 0.0 };
        let gathered_for_it = Term {
            name: "its last layer's router and experts, gathered",
            bytes: shape.router_gathered_again() + shape.weights_gathered_again(routed),
        };
        // (Gathered a step an axis, its last matrix's step before is live as the last runs.)
        let last_step = shape.expert_two_step_gather_share() * shape.layer_routed_experts() / 3.0;
        if last_step > 0.0 {
            let step_before = Term { name: "its last expert matrix's share, gathered a step before", bytes: last_step };
            points.push(point(
                "the last layer's experts gathered in a forward",
                before_experts.iter().cloned().chain([gathered_for_it.clone(), step_before]).collect(),
            ));
        }
        points.push(point(name, before_experts.iter().cloned().chain([own, gathered_for_it]).collect()));
    }
    // Under tsp the last layer's MLP is a ring, its output not yet made; beside a mixture's routed
    // experts a shared expert is a ring after them, beside their output and the layer's statistics.
    if shape.tsp > 1 {
        if shape.model.experts.is_some() {
            if shape.shared_expert() {
                let mut before_ring = before_experts;
                before_ring.extend([
                    Term { name: "its last layer's routed experts' output", bytes: gathered },
                    Term { name: "its last layer's statistics", bytes: 2.0 * statistics },
                ]);
                points.extend(tsp_ring::ring_forward(shape, &tsp_ring::SHARED_LAST_LAYER_FORWARD, before_ring));
            }
            points.extend(tsp_logits_reordered(shape, chunk));
            points.extend(tsp_embedding_scattered(shape, chunk));
            return points;
        }
        // (Under full recomputation the forward keeps none of the ring's input, live as it runs.)
        let ring_input = if full { gathered } else { 0.0 };
        let before_ring = vec![
            positions,
            before_layer_output.clone(),
            Term { name: "its last layer's MLP norm output (the ring's input), not kept", bytes: ring_input },
        ];
        points.extend(tsp_ring::ring_forward(shape, &tsp_ring::LAST_LAYER_FORWARD, before_ring));
        points.extend(tsp_logits_reordered(shape, chunk));
        points.extend(tsp_embedding_scattered(shape, chunk));
        return points;
    }
    let shared_expert = shape.shared_expert();
    // (A mixture's layer statistics are made after its experts' output.)
    let before_output = Term {
        name: "what it holds in flight by then but its last layer's output and statistics",
        bytes: kept - stream - 2.0 * statistics,
    };
    // Under SP the MLP's output, each rank's partial sum over its share of the channels (a
    // mixture's routed experts'), is reduce-scattered over tp, staged whole, before the layer's
    // output is made; under full recomputation beside a mixture's MLP norm output, not kept but
    // live until the statistics read it (a dense MLP's is freed once up's output is made, a point
    // below). (Beside a shared expert the two outputs, each whole, are summed first.)
    let sequence_parallel = shape.sequence_parallel();
    // (Under full recomputation a mixture's MLP norm output, not kept, is live until its layer's
    // statistics read it; without the load-balancing loss it has none, and the output is freed
    // once the routed experts have run.)
    let norm_output_to_statistics = full && shape.model.experts.is_some() && statistics > 0.0;
    // Under ZeRO-3 a mixture's router, gathered for its routed experts, stays until the layer's
    // statistics: under SP made after the layer's output, so live at every point past the experts.
    let statistics_after_output = sequence_parallel && shape.model.experts.is_some() && statistics > 0.0;
    let router_kept = Term {
        name: "its last layer's router, gathered, read next by its statistics",
        bytes: if statistics_after_output { shape.router_gathered_again() } else { 0.0 },
    };
    points[0].held.push(router_kept.clone());
    if sequence_parallel {
        let norm_output = if norm_output_to_statistics { gathered } else { 0.0 };
        points.push(point(
            "the last layer's MLP output reduce-scattered in a forward",
            vec![
                positions.clone(),
                before_output.clone(),
                Term { name: "its last layer's MLP norm output, not kept", bytes: norm_output },
                Term {
                    name: "its last layer's MLP output, whole, and its reduce-scatter's staging",
                    bytes: 2.0 * gathered,
                },
                router_kept.clone(),
            ],
        ));
    }
    let before_attention = Term {
        name: "what it holds in flight by then but its last layer's attention residual, output and statistics",
        bytes: kept - 2.0 * stream - 2.0 * statistics,
    };
    // Beside cp under full recomputation the forward keeps none of the last layer's attention
    // buffers, live as its kernel runs: q after RoPE and every token's k and v, all-gathered over
    // cp, beside its output, the layer's attention residual, statistics and output not yet made.
    if full && shape.cp > 1 && shape.tp == 1 {
        points.push(point(
            "the last layer's attention in a forward",
            vec![
                positions.clone(),
                before_attention.clone(),
                Term {
                    name: "its last layer's q, every token's k and v, and the attention's output",
                    bytes: (2.0 * local_tokens * query + kv_kept) * element,
                },
            ],
        ));
    }
    // Under full recomputation (without cp or tsp) the forward keeps none of the last layer's
    // attention buffers: as its v projection runs, the attention norm's output, q and k are live
    // beside v being made, under ZeRO-3 beside v's weight, gathered for it (k's and q's freed).
    if full && shape.cp == 1 && shape.tsp == 1 {
        points.push(point(
            "the last layer's v projection in a forward",
            vec![
                positions.clone(),
                before_attention.clone(),
                Term { name: "its last layer's attention norm output, not kept", bytes: gathered },
                Term { name: "its last layer's q, k and v", bytes: local_tokens * (query + 2.0 * kv) * element },
                Term {
                    name: "its last layer's v weight, gathered",
                    bytes: shape.key_value_weights_gathered_again() / 2.0,
                },
            ],
        ));
    }
    // Beside tp without SP a mixture's routed experts' output, each rank's partial sum over its
    // share of the channels, is all-reduced over tp before the layer's statistics and output are
    // made (under full recomputation beside the MLP norm's output, not kept but live until then).
    if shape.tp > 1 && !sequence_parallel && shape.model.experts.is_some() && !shared_expert {
        points.push(point(
            "the last layer's routed experts' output all-reduced over tp in a forward",
            vec![
                positions.clone(),
                before_output.clone(),
                Term {
                    name: "its last layer's MLP norm output, not kept",
                    bytes: if norm_output_to_statistics { gathered } else { 0.0 },
                },
                Term { name: "its last layer's routed experts' output, partial and all-reduced", bytes: 2.0 * stream },
                // (Under ZeRO-3 the router, gathered for the experts, stays for the statistics.)
                Term {
                    name: "its last layer's router, gathered",
                    bytes: if statistics > 0.0 { shape.router_gathered_again() } else { 0.0 },
                },
            ],
        ));
    }
    // Under full recomputation the forward keeps none of the last layer's MLP activations, which
    // are live as it runs: a dense MLP's as up's output is made beside the MLP norm's output and
    // gate's (under ZeRO-3 beside up's weight, gathered over dp for it), and as its SiLU product is
    // made beside gate and up (the MLP norm's output freed, the layer's output not yet made).
    if full && shape.model.experts.is_none() {
        points.push(point(
            "the last layer's up projection in a forward",
            vec![
                positions.clone(),
                before_layer_output.clone(),
                Term { name: "its last layer's MLP norm output, not kept", bytes: gathered },
                Term { name: "its last layer's gate and up outputs", bytes: 2.0 * local_tokens * ffn * element },
                Term { name: "its last layer's up weight, gathered", bytes: shape.gate_up_gathered_again(shape.gate) },
            ],
        ));
        points.push(point(
            "the last layer's SiLU product in a forward",
            vec![
                positions.clone(),
                before_layer_output.clone(),
                Term { name: "its last layer's gate, up and product", bytes: 3.0 * local_tokens * ffn * element },
            ],
        ));
    }
    // Under SP with full recomputation the last chunk's forward then runs the final norm on the
    // last layer's output all-gathered over tp, neither kept: both live beside all the micro-batch
    // holds in flight by then (its last layer's output among it; under ZeRO-3 beside the norm's
    // weight, gathered over dp for it). Above the MLP's points once tp splits its channels finer
    // than the hidden size.
    if full && sequence_parallel && chunk.last && shape.model.experts.is_none() {
        points.push(point(
            "the final norm in a forward",
            vec![
                positions.clone(),
                Term { name: "what it holds in flight by then", bytes: kept },
                Term {
                    name: "its last layer's output all-gathered, and the final norm's output",
                    bytes: 2.0 * gathered,
                },
                Term {
                    name: "the final norm's weight, gathered",
                    bytes: shape.norms_gathered_again(shape.norm * element),
                },
            ],
        ));
    }
    // Under ZeRO-3 a dense MLP's down projection reads its weight gathered over dp for it, freed
    // once the projection's output (whole under SP, before its reduce-scatter) is made beside it
    // and the SiLU product (kept, or under full recomputation not kept).
    let down_gathered = shape.down_gathered_again(shape.gate);
    if shape.model.experts.is_none() && down_gathered > 0.0 {
        points.push(point(
            "the last layer's down projection in a forward",
            vec![
                positions.clone(),
                before_layer_output.clone(),
                Term {
                    name: "its last layer's SiLU product, not kept",
                    bytes: if full { local_tokens * ffn * element } else { 0.0 },
                },
                Term {
                    name: "its last layer's MLP output (whole under SP)",
                    bytes: if sequence_parallel { gathered } else { stream },
                },
                Term { name: "its last layer's down weight, gathered", bytes: down_gathered },
            ],
        ));
    }
    // Under full recomputation the forward keeps none of a shared expert's activations either,
    // live as it runs beside the MLP norm's output and the routed experts' output (the layer's
    // output not yet made): as its product is made beside gate and up, as its down projection's
    // output is made beside the product, and as that output is scaled by the gate. Outside SP the
    // layer's statistics are made before the shared expert runs, and its gate logit after down
    // (the MLP norm's output freed by it); under SP the logit comes first, and the statistics
    // after the layer's output (the norm's output live until then; without the load-balancing
    // loss, whose statistics they are, freed once up has read it).
    let expert_output = if sequence_parallel { gathered } else { stream };
    let norm_output_after_up = !sequence_parallel || statistics > 0.0;
    if shared_expert && full {
        let intermediate = local_tokens * ffn * element;
        let logit = Term { name: "its last layer's shared expert's gate logit", bytes: local_tokens * element };
        let (before, logit_before_down) = if sequence_parallel {
            (before_output.clone(), Some(logit.clone()))
        } else {
            (before_layer_output.clone(), None)
        };
        let beside = |own: Vec<Term>, norm_output: bool| {
            let mut held = vec![positions.clone(), before.clone()];
            if norm_output {
                held.push(Term { name: "its last layer's MLP norm output", bytes: gathered });
            }
            held.push(Term { name: "its last layer's routed experts' output", bytes: expert_output });
            held.push(router_kept.clone());
            held.extend(own);
            held
        };
        points.push(point(
            "the last layer's shared expert's product in a forward",
            beside(
                logit_before_down
                    .iter()
                    .cloned()
                    .chain([Term {
                        name: "its last layer's shared expert's gate, up and product",
                        bytes: 3.0 * intermediate,
                    }])
                    .collect(),
                norm_output_after_up,
            ),
        ));
        points.push(point(
            "the last layer's shared expert's down output in a forward",
            beside(
                logit_before_down
                    .iter()
                    .cloned()
                    .chain([
                        Term { name: "its last layer's shared expert's product", bytes: intermediate },
                        Term { name: "its last layer's shared expert's down output", bytes: expert_output },
                        Term {
                            name: "its last layer's shared expert's down weight, gathered",
                            bytes: shape.down_gathered_again(shape.gate),
                        },
                    ])
                    .collect(),
                norm_output_after_up,
            ),
        ));
        points.push(point(
            "the last layer's shared expert's output scaled in a forward",
            beside(
                vec![
                    logit,
                    Term {
                        name: "its last layer's shared expert's output, scaled and not",
                        bytes: 2.0 * expert_output,
                    },
                ],
                sequence_parallel && statistics > 0.0,
            ),
        ));
    }
    // (Outside SP the layer's statistics are made before the two outputs are summed.)
    if shared_expert {
        points.push(point(
            "the last layer's routed and shared experts' outputs summed in a forward",
            vec![
                positions,
                if sequence_parallel { before_output } else { before_layer_output },
                Term {
                    name: "its last layer's routed and shared experts' outputs and their sum",
                    bytes: 3.0 * expert_output,
                },
                router_kept,
            ],
        ));
    }
    if chunk.last {
        points.extend(logits_gathered(shape, chunk));
        points.extend(head_weight_gathered(shape, chunk, kept));
        points.extend(loss_row_statistics_gathered(shape, chunk));
    }
    points.extend(embedding_gathered(shape, chunk));
    points
}

/// Under ZeRO-3 the last chunk's forward gathers the LM head's weight (or the tied table) over its
/// replicas, a step an axis, once the final norm has run: the stage may peak as the last step
/// runs, beside the final norm's output (under full recomputation not kept, its input gathered
/// under SP freed by then), before the logits. `kept`: what the micro-batch holds in flight
/// before the head.
fn head_weight_gathered(shape: &StageShape, chunk: &Chunk, kept: f64) -> Option<Candidate> {
    let gathered = shape.sizes.gathered;
    let head = shape.table_gathered_again();
    if head == 0.0 {
        return None;
    }
    let final_norm = if shape.recompute() == Recompute::Full { gathered } else { shape.final_norm_kept() };
    Some(Candidate::made(
        "the LM head's weight gathered in a forward",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight before the head", bytes: kept },
            Term { name: "the final norm's output (and what it keeps)", bytes: final_norm },
            Term {
                name: "the LM head's weight gathered, beside the step before's share of it",
                bytes: head * (1.0 + shape.two_step_gather_share()),
            },
        ],
    ))
}

/// Under tp the last chunk's forward computes the vocabulary-parallel loss from each row's
/// statistics over the rank's vocabulary shard (three f32), all-gathered over tp: the stage may
/// peak as the gather runs, beside all the micro-batch holds in flight (its logits and the final
/// norm's buffers kept; a mixture's counts' sum and load-balancing loss made before, every layer's
/// statistics freed) but its cross-entropy, on many tokens of a small vocabulary shard. (Outside
/// full recomputation, cp and tsp, whose heads differ.)
fn loss_row_statistics_gathered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let element = shape.sizes.element;
    let gathered = shape.sizes.loss_row_statistics(shape.logit_rows());
    if gathered == 0.0 || shape.recompute() == Recompute::Full || shape.cp > 1 || shape.tsp > 1 {
        return None;
    }
    Some(Candidate::made(
        "the loss's row statistics all-gathered over tp in a forward",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight but its cross-entropy", bytes: chunk.in_flight - element },
            Term { name: "its rows' statistics", bytes: gathered / shape.sizes.vocab_split },
            Term { name: "every tp rank's, gathered (the all-gather's staging)", bytes: gathered },
        ],
    ))
}

/// Under ZeRO-3 the first chunk's forward begins by gathering the embedding table over its
/// replicas (a step an axis): the stage may peak as the last step runs, beside the micro-batches
/// between their B and W, the forwarded one holding only its token ids (under cp its own too) and
/// positions. (Without tsp, whose embedding is [`tsp_embedding_scattered`].)
fn embedding_gathered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { local_tokens, ids, .. } = shape.sizes;
    let table = shape.table_gathered_again();
    if !chunk.first || table == 0.0 {
        return None;
    }
    let own_ids = if shape.cp > 1 { local_tokens * ID_BYTES } else { 0.0 };
    Some(Candidate::made(
        "the embedding table gathered in a forward",
        0.0,
        vec![
            Term { name: "its token ids", bytes: ids + own_ids },
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "the embedding table gathered, beside the step before's share of it",
                bytes: table * (1.0 + shape.two_step_gather_share()),
            },
        ],
    ))
}

/// Beside cp the last chunk's forward gathers every token's logits over cp and reorders them out
/// of the zigzag: the stage may peak as it does, the gathered copy beside the reordered one (the
/// logits the micro-batch keeps), before the loss, and a mixture's counts' sum and load-balancing
/// loss, are made (every layer's statistics, the earlier stages' received, still live). Without
/// cp a mixture's stage under zero bubble may peak as the logits are made, so (under full
/// recomputation beside the final norm's output, under ZeRO-3 the LM head's weight gathered).
fn logits_gathered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, token_split, .. } = shape.sizes;
    // (Without cp, where the logits are made in place: a mixture's stage under zero bubble, whose
    // every layer's statistics are live there.)
    let gathered = token_split > 1 && shape.cp > 1;
    let full = shape.recompute() == Recompute::Full;
    let made_in_place = shape.zero_bubble && shape.statistics > 0.0;
    if !(gathered || made_in_place) {
        return None;
    }
    let statistics = shape.statistics;
    let not_made = element + if statistics > 0.0 { element + statistics } else { 0.0 };
    let mut held = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term { name: "what it holds in flight but its losses and counts' sum", bytes: chunk.in_flight - not_made },
        Term {
            name: "every layer's expert counts and router probability sums",
            bytes: 2.0 * shape.model.layers as f64 * statistics,
        },
    ];
    if !gathered {
        // (Under full recomputation beside the final norm's output, whole, not kept: under SP its
        // input gathered over tp is freed by then; under ZeRO-3 beside the LM head's weight,
        // gathered over dp for it.)
        held.extend([
            Term { name: "the final norm's output, not kept", bytes: if full { shape.sizes.gathered } else { 0.0 } },
            Term { name: "the LM head's weight, gathered", bytes: shape.table_gathered_again() },
        ]);
        return Some(Candidate::made("every token's logits made in a forward", 0.0, held));
    }
    held.push(Term { name: "every token's logits, gathered before their reordering", bytes: shape.logits() });
    Some(Candidate::made("every token's logits gathered in a forward", 0.0, held))
}

/// Under tsp the first chunk's forward begins by embedding every token (in zigzag order) and
/// reduce-scattering the result over tsp to the rank's tokens, staged whole: the stage may peak
/// there beside the micro-batches between their B and W, the forwarded one holding nothing else
/// but its token ids (in both orders) and positions.
fn tsp_embedding_scattered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { ids, every_token, .. } = shape.sizes;
    (chunk.first && shape.tsp > 1).then(|| {
        Candidate::made(
            "every token's embedding reduce-scattered over tsp in a forward",
            0.0,
            vec![
                Term { name: "its token ids, in both orders", bytes: 2.0 * ids },
                Term { name: "its positions", bytes: chunk.positions },
                Term { name: "every token's embedding, and its reduce-scatter's staging", bytes: 2.0 * every_token },
            ],
        )
    })
}

/// Under tsp the last chunk's forward makes every token's logits over the rank's vocabulary shard
/// from the head's input gathered over the sequence, and reorders them out of the zigzag: the stage
/// may peak as it does, the logits beside their reordered copy (which the micro-batch keeps),
/// before the loss is made. (A dense model's.)
fn tsp_logits_reordered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    if !chunk.last {
        return None;
    }
    // (A mixture's counts' sum and load-balancing loss are not made yet: [`mixture_head`].)
    let element = shape.sizes.element;
    Some(Candidate::made(
        "every token's logits reordered in a forward",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "what it holds in flight but its loss (a mixture's statistics apart)",
                bytes: chunk.in_flight - element - mixture_head(shape),
            },
            Term { name: "every token's logits, before their reordering", bytes: shape.logits() },
        ],
    ))
}

/// What a micro-batch in flight on the last chunk keeps of a mixture's head (its counts' sum and
/// load-balancing loss) beyond every layer's statistics, which are live in their place until the
/// head runs, the earlier stages' received (bytes; negative where the statistics outweigh them, 0
/// for a dense model).
fn mixture_head(shape: &StageShape) -> f64 {
    let statistics = shape.statistics;
    statistics + shape.load_balancing_loss() - 2.0 * shape.model.layers as f64 * statistics
}
