//! The head of a micro-batch's backward on a chunk, where a stage may peak on more tokens: all
//! that the micro-batch holds in flight is still live beside the first gradients.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{received_counts, Candidate, Chunk, KeptWholePending};
use super::experts::experts_points;
use super::shared_expert::{shared_expert_kept, shared_expert_points};
use super::{tsp_ring, Place, StageShape};

/// The points at the head of a micro-batch's backward on `chunk`: on the last chunk the loss's
/// backward and the LM head's weight gradient joining its sum; on another the output gradient's
/// arrival, a dense last layer's down projection's gradient joining its sum and its MLP norm
/// output's gradients being summed (under tsp its MLP ring's backward, [`tsp_last_ring`]); a dense
/// last layer's down gradient made on either ([`down_gradient_at_the_head`]); and a mixture's last
/// layer's MLP backward on either ([`mixture_head`]).
pub(super) fn head_of_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let mut candidates = if chunk.last { last_chunk(shape, chunk) } else { other_chunk(shape, chunk) };
    // (No layer's q, k and v gradients are made yet; the points before the LM head's gradient
    // say so of the table's themselves.)
    for candidate in &mut candidates {
        candidate.pending = candidate.pending.all_layers(chunk.layers);
    }
    candidates
}

/// The loss's backward, at the head of the micro-batch's backward on the last chunk: all it holds
/// in flight (its two losses summed), its positions, and the logits' gradient beside them (and
/// under tp the vocabulary-parallel loss's row statistics, three f32 a row from each tp rank); none
/// of its gradients made yet.
pub(super) fn loss_backward(shape: &StageShape, chunk: &Chunk) -> Candidate {
    let logits = shape.logits();
    let rows = shape.logit_rows();
    // A micro-batch in flight holds its cross-entropy and load-balancing loss apart; by the loss's
    // backward they are summed into its loss, one scalar fewer.
    let summed = shape.load_balancing_loss();
    Candidate::made(
        "the loss's backward",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight, its two losses summed", bytes: chunk.in_flight - summed },
            Term {
                name: "the logits' gradient (and under tp the loss's row statistics)",
                bytes: logits + shape.sizes.loss_row_statistics(rows),
            },
        ],
    )
}

/// Under ZeRO-3 over dp and cp both, a tied table is gathered for the LM head's input gradient
/// in two steps, over cp then over dp (`passes::zero`): the stage may peak as the last runs, its
/// output staged whole beside the step before's, once the loss's backward is done. The micro-batch
/// holds all it keeps in flight but the logits and the targets, which that backward read last,
/// and the logits' gradient (under cp the rank's tokens'); none of its gradients is made yet.
pub(super) fn table_gathered_for_the_head(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, vocab_shard, hidden, ids, token_split, .. } = shape.sizes;
    let share = shape.two_step_gather_share();
    if !shape.tied || !chunk.last || share == 0.0 {
        return None;
    }
    let table = vocab_shard * hidden * element;
    let targets = if token_split > 1 { ids } else { 0.0 };
    let summed = shape.load_balancing_loss();
    Some(Candidate::made(
        "the tied table gathered for the LM head's backward, the last step",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "what it holds in flight but the logits and the targets, its two losses summed",
                bytes: chunk.in_flight - shape.logits() - targets - summed,
            },
            Term { name: "the logits' gradient, the rank's tokens'", bytes: local_tokens * vocab_shard * element },
            Term { name: "the table, gathered (staged) beside the step before's output", bytes: (1.0 + share) * table },
        ],
    ))
}

/// The head of the micro-batch's backward on the last chunk: the loss's backward
/// ([`loss_backward`]), then the LM head's weight gradient, then its last layer's MLP backward.
fn last_chunk(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, vocab_shard, hidden, gathered, .. } = shape.sizes;
    let logits = shape.logits();
    let weight_gradient = vocab_shard * hidden * element;
    // Beside a tied table the head's part of its gradient joins no sum here: it is sent back
    // and held to the micro-batch's end (reduced over dp on the first stage, or beside dp × tp at
    // the end of this stage's backward).
    let head_part = shape.tied_head_part();
    let head_sum = shape.head_gradient_summed();
    // (By the loss's backward a mixture's two losses are summed into one.)
    let summed = shape.load_balancing_loss();
    // (Where ZeRO keeps the LM head whole, the points before its gradient is reduced have made
    // none of it.)
    let mut candidates = vec![loss_backward(shape, chunk).before_the_table()];
    candidates.extend(table_gathered_for_the_head(shape, chunk).map(Candidate::before_the_table));
    // Then, as the LM head's weight gradient joins its sum: the logits freed, their gradient and
    // the head's input gradient beside it; under full recomputation the final norm's output
    // recomputed for it, and its input gathered again under SP. (Beside dp, which
    // reduces the gradient first, below; not modelled beside cp or tsp, whose logits' gradient is
    // sliced back to the rank's tokens.)
    let mixture = shape.model.experts.is_some() && shape.recompute() != Recompute::Full;
    let full = shape.recompute() == Recompute::Full;
    let recomputed_norm = full && shape.tsp == 1 && !shape.scattered;
    if shape.sizes.token_split == 1 && (shape.mlp_backward_modelled() || mixture || recomputed_norm) && !shape.reduced {
        let mut held = vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "what it holds in flight but the logits, its two losses summed",
                bytes: chunk.in_flight - logits - summed,
            },
            Term { name: "the logits' gradient", bytes: logits },
            Term { name: "the LM head's input gradient", bytes: gathered },
        ];
        if recomputed_norm {
            held.push(Term {
                name: "the final norm's output recomputed (and under SP its input gathered)",
                bytes: shape.sizes.final_norm_buffers(),
            });
        }
        held.extend(head_part.clone());
        candidates.push(Candidate {
            name: if head_part.is_some() {
                "the LM head's part of the tied table's gradient is made"
            } else {
                "the LM head's weight gradient joins its sum"
            },
            so_far: head_sum,
            held,
            new_sum: head_part
                .is_none()
                .then_some(Term { name: "the joining head gradient's new sum beside the old", bytes: weight_gradient }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
    }
    candidates.extend(tsp_final_norm_regathered(shape, chunk).map(Candidate::before_the_table));
    candidates.extend(tsp_last_chunk_ring(shape, chunk));
    candidates.extend(tsp_head_gradient_joining(shape, chunk));
    // Beside a tied table without dp, next as the last layer's down projection's weight gradient
    // joins its sum: the head's part joined none, so this may be larger. The logits, the final
    // norm's buffers and the last layer's output are freed; the SiLU product (which made the
    // gradient), the last layer's output gradient and the SiLU product's gradient are live.
    if let Some(head_part) =
        head_part.clone().filter(|_| shape.sizes.token_split == 1 && shape.mlp_backward_modelled() && !shape.reduced)
    {
        let StepSizes { local_tokens, ffn, stream, .. } = shape.sizes;
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far: shape.norm * element + shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name:
                        "what it holds in flight but the logits, the final norm's buffers and its last layer's output",
                    bytes: in_flight_past_the_head(shape, chunk),
                },
                Term { name: "its last layer's output gradient", bytes: stream },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
                head_part,
            ],
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
    }
    // (Under ZeRO-2 and 3 too, where it is reduce-scattered; a dense stage's but under tsp.)
    if shape.sizes.token_split == 1 && (shape.tsp == 1 || shape.model.experts.is_some()) && shape.reduced {
        // Beside dp the LM head's weight gradient is made before it is reduced: the logits freed,
        // their gradient, the head's input gradient (partial under tp, before its all-reduce)
        // and the unreduced weight gradient live, no gradient of the micro-batch's made yet.
        let mut held = vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "what it holds in flight but the logits, its two losses summed",
                bytes: chunk.in_flight - logits - summed,
            },
            Term { name: "the logits' gradient", bytes: logits },
            Term { name: "the LM head's input gradient", bytes: gathered },
            match &head_part {
                Some(head_part) => head_part.clone(),
                None => Term {
                    name: "the head gradient before its dp all-reduce or reduce-scatter",
                    bytes: weight_gradient,
                },
            },
        ];
        if full {
            // (Under SP its input gathered again too, in place of the last layer's output; under
            // ZeRO-3 its weight gathered again.)
            let regathered_norm = shape.norms_gathered_again(shape.norm * element);
            held.push(Term {
                name: "the final norm's output recomputed (and under SP its input gathered, under ZeRO-3 its weight)",
                bytes: shape.sizes.final_norm_buffers() + regathered_norm,
            });
        }
        candidates.push(Candidate::made("the LM head's weight gradient", 0.0, held).before_the_table());
    }
    // (Under ZeRO-2 and 3 too where they keep the head whole: it is all-reduced, as beside dp.)
    if shape.tsp == 1 && !shape.head_gradient_scattered() && shape.reduced && head_part.is_none() {
        // First as the LM head's weight gradient joins its sum: the logits' gradient and the
        // final norm's output (the head's input; recomputed for it under full recomputation)
        // freed before it was all-reduced, the head's input gradient and the unreduced copy
        // beside it, and under full recomputation with SP the norm's input gathered again for its
        // backward. (Beside cp the targets are freed too, the loss's backward done; a mixture's
        // two losses are summed by then.)
        let final_norm_output = if full { 0.0 } else { gathered };
        let targets = if shape.sizes.token_split > 1 { shape.sizes.ids } else { 0.0 };
        candidates.push(Candidate {
            name: "the LM head's weight gradient joins its sum",
            so_far: weight_gradient / shape.shards,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name:
                        "what it holds in flight but the logits and the final norm's output (and under cp the targets)",
                    bytes: chunk.in_flight - logits - final_norm_output - targets - summed,
                },
                Term { name: "the LM head's input gradient", bytes: gathered },
                Term { name: "the head gradient before its dp all-reduce", bytes: weight_gradient },
            ]
            .into_iter()
            .chain(final_norm_input_regathered(shape))
            .collect(),
            new_sum: Some(Term { name: "the joining head gradient's new sum beside the old", bytes: weight_gradient }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
    }
    // Beside dp, as the last layer's down projection's weight gradient joins its sum, reduced, its
    // unreduced copy beside it: the head's and the final norm's gradients made, the logits, the
    // final norm's buffers, the last layer's output and SiLU product freed, its output gradient
    // and the SiLU product's gradient live.
    if shape.sizes.token_split == 1 && shape.mlp_backward_modelled() && shape.reduced {
        let StepSizes { local_tokens, ffn, stream, .. } = shape.sizes;
        let so_far = head_sum + shape.norm * element + shape.gate;
        let in_flight = Term {
            name: "what it holds in flight but the logits, the final norm's buffers, its last layer's output and SiLU product",
            bytes: in_flight_past_the_head(shape, chunk) - local_tokens * ffn * element,
        };
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                in_flight.clone(),
                Term { name: "its last layer's output gradient", bytes: stream },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
                Term { name: "the down gradient before its dp all-reduce", bytes: shape.gate },
            ]
            .into_iter()
            .chain(head_part.clone())
            .collect(),
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
        // Then as gate's output gradient is made beside the SiLU product's, the unreduced down
        // gradient freed (as on a chunk before the last).
        candidates.push(Candidate::made(
            "the last layer's gate output gradient",
            so_far,
            vec![
                Term { name: "its positions", bytes: chunk.positions },
                in_flight,
                Term { name: "its last layer's output gradient", bytes: stream },
                Term {
                    name: "its last layer's SiLU product's and gate output's gradients",
                    bytes: 2.0 * local_tokens * ffn * element,
                },
            ]
            .into_iter()
            .chain(head_part.clone())
            .collect(),
        ));
    }
    // Then, as on a chunk before the last, its MLP norm output's gradients are summed.
    if shape.mlp_backward_modelled() {
        let output_gradient = Term { name: "its last layer's output gradient", bytes: shape.sizes.stream };
        let so_far = head_sum + shape.norm * element;
        let in_flight = in_flight_past_the_head(shape, chunk);
        candidates.push(mlp_norm_output_gradient(shape, chunk, in_flight, output_gradient, so_far, head_part));
    }
    candidates.extend(down_gradient_at_the_head(shape, chunk));
    candidates.extend(mixture_head(shape, chunk));
    candidates
}

/// What a micro-batch holds in flight on the last chunk once the head's and the final norm's
/// backward are done: all but the logits, the final norm's buffers (none kept under full
/// recomputation, which recomputes them), the last layer's output (which only the final norm read;
/// under full recomputation kept as the stream) and under cp the
/// targets (every token's, read by the loss's backward).
pub(super) fn in_flight_past_the_head(shape: &StageShape, chunk: &Chunk) -> f64 {
    let StepSizes { ids, stream, token_split, .. } = shape.sizes;
    let targets = if token_split > 1 { ids } else { 0.0 };
    chunk.in_flight - shape.logits() - shape.final_norm_kept() - stream - targets
}

/// The head of a micro-batch's backward on a chunk before the last, a dense one's: the output
/// gradient's arrival ([`output_gradient_received`]) and its last layer's down gradient made
/// ([`down_gradient_at_the_head`]); then (as a gate gradient's joining is modelled: not under
/// ZeRO-2 and 3 or full recomputation) that gradient joins its sum, the micro-batch holding all it
/// holds in flight beside the output gradient it received and the SiLU product's gradient (not
/// modelled under tp, under which the output gradient has another copy there; beside dp, which
/// reduces the gradient first, beside its unreduced copy, the product freed, and then as gate's
/// output gradient is made); then that layer's MLP norm output's gradients from gate and up are
/// summed, its down and up gradients made, its gate, up and their product freed, beside the
/// output gradient, gate's output gradient (its weight gradient is next) and the two input
/// gradients and their sum.
fn other_chunk(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, .. } = shape.sizes;
    if shape.model.experts.is_some() {
        return mixture_head(shape, chunk);
    }
    if shape.tsp > 1 {
        return tsp_last_ring(shape, chunk, None);
    }
    let mut candidates = vec![output_gradient_received(shape, chunk)];
    candidates.extend(down_gradient_at_the_head(shape, chunk));
    if !shape.mlp_backward_modelled() {
        return candidates;
    }
    if shape.reduced {
        // Beside dp the down gradient is all-reduced before it joins its sum, its unreduced copy
        // beside it, the SiLU product freed; then that copy is freed, and the stage may peak as
        // gate's output gradient is made beside the product's.
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far: shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name: "what it holds in flight but its last layer's SiLU product",
                    bytes: chunk.in_flight - local_tokens * ffn * element,
                },
                Term { name: "its output gradient (received)", bytes: stream },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
                Term { name: "the down gradient before its dp all-reduce", bytes: shape.gate },
            ],
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
        candidates.push(Candidate::made(
            "the last layer's gate output gradient",
            shape.gate,
            vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name: "what it holds in flight but its last layer's SiLU product",
                    bytes: chunk.in_flight - local_tokens * ffn * element,
                },
                Term { name: "its output gradient (received)", bytes: stream },
                Term {
                    name: "its last layer's SiLU product's and gate output's gradients",
                    bytes: 2.0 * local_tokens * ffn * element,
                },
            ],
        ));
    } else if shape.tp == 1 {
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far: shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term { name: "what it holds in flight", bytes: chunk.in_flight },
                Term { name: "its output gradient (received)", bytes: stream },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
            ],
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            pending: KeptWholePending::NONE,
            sum_pending: 0.0,
        });
    }
    let output_gradient = Term { name: "its output gradient (received)", bytes: stream };
    candidates.push(mlp_norm_output_gradient(shape, chunk, chunk.in_flight, output_gradient, 0.0, None));
    candidates
}

/// At the head of a backward (without recomputing the MLP, or ZeRO-2 and 3), as the last layer's
/// MLP norm output's gradients from gate and up are summed: its down and up gradients made (beside
/// `so_far` of the micro-batch's), its gate, up and their product freed (of what it holds
/// `in_flight`), beside its output gradient, gate's output gradient (its weight gradient is next)
/// and the two input gradients and their sum (and the head's part of a tied table's gradient).
fn mlp_norm_output_gradient(
    shape: &StageShape,
    chunk: &Chunk,
    in_flight: f64,
    output_gradient: Term,
    so_far: f64,
    head_part: Option<Term>,
) -> Candidate {
    let StepSizes { element, local_tokens, ffn, gathered, .. } = shape.sizes;
    let mut held = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term {
            name: "what it holds in flight but its last layer's gate, up and their product",
            bytes: in_flight - 3.0 * local_tokens * ffn * element,
        },
        output_gradient,
        Term { name: "its last layer's gate output gradient", bytes: local_tokens * ffn * element },
        Term {
            name: "its last layer's MLP norm output's gradients from gate and up, and their sum",
            bytes: 3.0 * gathered,
        },
    ];
    held.extend(head_part);
    Candidate::made("the last layer's MLP norm output gradient", so_far + 2.0 * shape.gate, held)
}

/// The head of a dense stage's backward (without tsp) is its last layer's down projection's (on
/// the last chunk after the LM head's and the final norm's gradients, the logits, the final norm's
/// buffers and the last layer's output freed): the stage may peak as its weight gradient is made
/// (whole under ZeRO-2 and 3), beside the SiLU product's gradient (made first, from the output
/// gradient and under ZeRO-3 the down weight gathered again, the same bytes, freed after; under
/// full recomputation the MLP recomputed next, under ZeRO-3 with its norm's, gate's and up's
/// weights gathered again; then, under full recomputation or ZeRO-2 and 3, as the MLP norm
/// output's gradients from gate and up are summed, the down and up weight gradients made). Under
/// ZeRO-2 and 3 also as it is reduce-scattered (staged whole), the SiLU product freed; and on the
/// last chunk, before those, as the LM head's weight gradient is reduce-scattered (staged whole;
/// beside dp × cp first over one of them), the logits, the head's input and under cp the targets
/// freed, beside the head's input gradient, or beside a tied table as the head's part of the
/// table's gradient is made (it joins no sum: [`super::TIED_HEAD_PART`], held beside the down
/// points too).
/// (Where ZeRO keeps k's and v's rows whole the walk would count them made there: not modelled.)
/// Under SP the down's backward reads the output gradient gathered over tp too. Without ZeRO or
/// replicas the stage may peak as the gradient joins its sum, what made it still live.
fn down_gradient_at_the_head(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, gathered, stream, .. } = shape.sizes;
    let full = shape.recompute() == Recompute::Full;
    let modelled = shape.model.experts.is_none() && shape.tsp == 1;
    if !modelled {
        return Vec::new();
    }
    let product = local_tokens * ffn * element;
    // Beside a tied table the last chunk makes the head's part of its gradient whole, which joins
    // no sum here: it is sent back and held to the micro-batch's end.
    let head_part = shape.tied_head_part().filter(|_| chunk.last);
    let head_sum = shape.head_gradient_summed();
    let (in_flight, output_gradient, so_far) = if chunk.last {
        (
            Term {
                name: "what it holds in flight but the logits, the final norm's buffers and its last layer's output (and under cp the targets)",
                bytes: in_flight_past_the_head(shape, chunk),
            },
            Term { name: "its last layer's output gradient", bytes: stream },
            (head_sum + shape.norm * element) / shape.shards,
        )
    } else {
        (
            Term { name: "what it holds in flight", bytes: chunk.in_flight },
            Term { name: "its output gradient (received)", bytes: stream },
            0.0,
        )
    };
    let whole = Term { name: "its down gradient, whole (under ZeRO-3 first its weight, gathered)", bytes: shape.gate };
    let beside: Vec<Term> = [
        Term { name: "its positions", bytes: chunk.positions },
        output_gradient.clone(),
        Term { name: "its last layer's SiLU product gradient", bytes: product },
    ]
    .into_iter()
    .chain(head_part.clone())
    .collect();
    // Under SP the down projection's backward reads the output gradient all-gathered over tp,
    // freed once its weight gradient is made.
    let gathered_output_gradient =
        shape.sequence_parallel().then_some(Term { name: "its output gradient, gathered over tp", bytes: gathered });
    // Under full recomputation the down gradient reads the SiLU product recomputed, with the MLP
    // norm's output, gate and up, after the product's gradient is made (under ZeRO-3 with the MLP
    // norm's, gate's and up's weights gathered again for it, which their input gradients read
    // next).
    let regathered = shape.mlp_input_weights_gathered_again();
    let recomputed = full.then_some(Term {
        name: "its last layer's MLP norm output, gate, up and SiLU product, recomputed (and their weights)",
        bytes: gathered + 3.0 * product + regathered,
    });
    // (Once it is made, it joins its sum, or is reduce-scattered, whole.)
    let joining: Vec<Term> = beside
        .iter()
        .cloned()
        .chain([in_flight.clone()])
        .chain(recomputed.clone())
        .chain(gathered_output_gradient)
        .collect();
    let made: Vec<Term> = joining.iter().cloned().chain([whole.clone()]).collect();
    // Without ZeRO the gradient joins its sum next: without replicas with what made it still live
    // (under full recomputation the recomputed MLP); beside dp or cp after its all-reduce, which
    // the input gradients precede (the points after are the head's other candidates).
    let joins = (!shape.scattered && !shape.reduced).then_some(Candidate {
        name: if full {
            "the last layer's down gradient joins its sum, its MLP recomputed"
        } else {
            "the last layer's down gradient joins its sum"
        },
        so_far: so_far + shape.gate,
        held: joining,
        new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
        pending: KeptWholePending::NONE,
        sum_pending: 0.0,
    });
    if !shape.scattered && !full {
        return [Candidate::made("the last layer's down gradient made", so_far, made)]
            .into_iter()
            .chain(joins)
            .collect();
    }
    // Under full recomputation, up's gradient made after the down's (gate's comes after), the MLP
    // norm output's gradients from gate and up are summed beside gate's output gradient and the
    // recomputed MLP norm output (gate, up and their product freed; under ZeRO-2 and 3 the two
    // weight gradients reduce-scattered by then, and under ZeRO-3 the MLP norm's weight, gathered
    // again for the recomputation, live until the norm's backward).
    // Under ZeRO-2 and 3 without recomputing the MLP the same point holds the MLP norm's output
    // kept in flight, the layer's gate, up and product freed by then.
    let regathered_norm = shape.norms_gathered_again(shape.norm * element);
    let summed = (full || shape.scattered).then(|| {
        let (name, norm_output) = if full {
            (
                "the last layer's MLP norm output gradient, its MLP recomputed",
                Term { name: "its last layer's MLP norm output, recomputed", bytes: gathered },
            )
        } else {
            (
                "the last layer's MLP norm output's gradients from gate and up summed",
                Term { name: "its last layer's gate, up and SiLU product, freed", bytes: -3.0 * product },
            )
        };
        let held = [
            Term { name: "its positions", bytes: chunk.positions },
            in_flight.clone(),
            output_gradient.clone(),
            Term { name: "its last layer's gate output gradient", bytes: product },
            norm_output,
            Term {
                name: "its last layer's MLP norm output's gradients from gate and up, and their sum",
                bytes: 3.0 * gathered,
            },
        ]
        .into_iter()
        .chain(
            (full && regathered_norm > 0.0)
                .then_some(Term { name: "its last layer's MLP norm weight, gathered again", bytes: regathered_norm }),
        )
        .chain(head_part.clone())
        .collect();
        Candidate::made(name, so_far + 2.0 * shape.gate / shape.shards, held)
    });
    if !shape.scattered {
        // Beside replicas its input gradient came first: next gate's output gradient is made,
        // the down gradient joined its sum and the SiLU product freed.
        let gate_output = shape.reduced.then(|| {
            let held = beside
                .iter()
                .cloned()
                .chain([in_flight.clone()])
                .chain(recomputed.clone())
                .chain([
                    Term { name: "its last layer's SiLU product, freed", bytes: -product },
                    Term { name: "its last layer's gate output gradient", bytes: product },
                ])
                .collect();
            Candidate::made("the last layer's gate output gradient, its MLP recomputed", so_far + shape.gate, held)
        });
        return [Candidate::made("the last layer's down gradient made, its MLP recomputed", so_far, made)]
            .into_iter()
            .chain(joins)
            .chain(gate_output)
            .chain(summed)
            .collect();
    }
    let scattered: Vec<Term> = beside
        .into_iter()
        .chain(recomputed)
        .chain([
            whole,
            in_flight,
            Term { name: "its last layer's SiLU product, freed", bytes: -product },
            Term { name: "its reduce-scatter's staging", bytes: shape.gate },
        ])
        .collect();
    // Outside full recomputation up's gradient is reduce-scattered next, staged whole, down's
    // shard made: SiLU's backward has freed the product's gradient and gate's and up's outputs for
    // gate's and up's output gradients, and up's input gradient (the MLP norm output's gradient
    // from up) is made before its weight gradient, which frees up's output gradient (at tp=4 on 32
    // tokens under ZeRO-3, 2.5% above the down gradient's point).
    let up = (!full).then(|| {
        let mut up = scattered.clone();
        up.extend([
            Term { name: "its last layer's SiLU product gradient, gate and up, freed", bytes: -3.0 * product },
            Term { name: "its last layer's gate output gradient", bytes: product },
            Term { name: "its last layer's MLP norm output's gradient from up", bytes: gathered },
        ]);
        Candidate::made("the last layer's up gradient reduce-scattered", so_far + shape.gate / shape.shards, up)
    });
    let mut points = vec![
        Candidate::made("the last layer's down gradient made, before its reduce-scatter", so_far, made),
        Candidate::made("the last layer's down gradient reduce-scattered", so_far, scattered),
    ];
    points.extend(up);
    points.extend(summed);
    points.extend(head_gradient_scattered(shape, chunk));
    points
}

/// Under ZeRO-2 and 3, on the last chunk, the LM head's weight gradient is reduce-scattered,
/// staged whole (beside a tied table the head's part is made instead, and held): the logits, their
/// gradient and the head's input freed (under full recomputation the copy recomputed for it; beside
/// cp the targets too), the head's input gradient live (partial under tp), a mixture's two losses
/// summed by then. (Under full recomputation the final norm is recomputed for its backward: under
/// SP from its input gathered over tp again, under ZeRO-3 with its weight gathered again.)
fn head_gradient_scattered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, vocab_shard, hidden, gathered, .. } = shape.sizes;
    if !(chunk.last && shape.scattered && (shape.tied || shape.head_gradient_scattered())) {
        return None;
    }
    let full = shape.recompute() == Recompute::Full;
    let targets = if shape.cp > 1 { shape.sizes.ids } else { 0.0 };
    let mut held = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term {
            name: "what it holds in flight but the logits and the head's input (and under cp the targets)",
            bytes: chunk.in_flight
                - shape.logits()
                - if full { 0.0 } else { gathered }
                - targets
                - shape.load_balancing_loss(),
        },
        Term { name: "the LM head's input gradient", bytes: gathered },
    ];
    held.extend(final_norm_input_regathered(shape));
    held.extend(final_norm_weight_regathered(shape));
    let name = if let Some(head_part) = shape.tied_head_part() {
        held.push(head_part);
        "the LM head's part of the tied table's gradient is made"
    } else {
        let weight_gradient = vocab_shard * hidden * element;
        held.extend([
            Term { name: "the LM head's weight gradient, whole", bytes: weight_gradient },
            Term { name: "its reduce-scatter's staging", bytes: weight_gradient },
        ]);
        "the LM head's weight gradient reduce-scattered"
    };
    // (Where ZeRO splits the head over some of its replicas, it is all-reduced over the rest
    // after: none of it made yet.)
    let made = Candidate::made(name, 0.0, held);
    Some(if shape.tied { made } else { made.before_the_table() })
}

/// The head of a mixture's backward on a chunk (under full recomputation beside the MLP norm's
/// output recomputed, and a shared expert's gate, up and product, which the forward did not keep):
/// its last layer's MLP backward, a shared
/// expert's ([`shared_expert_points`]) then the routed experts' ([`experts_points`]), and on a
/// chunk before the last the output gradient's arrival. The micro-batch holds all it holds in
/// flight but (on the last chunk) the logits, the final norm's buffers and its last layer's
/// output, and its last layer's shared expert's activations (its backward comes first, the
/// gradients of the head and the final norm made before it), beside that layer's output gradient
/// (on another chunk the one it received). The summed expert counts a stage before the last
/// received are live there: the first layer's router reads them last.
fn mixture_head(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, stream, .. } = shape.sizes;
    if shape.model.experts.is_none() {
        return Vec::new();
    }
    let full = shape.recompute() == Recompute::Full;
    let shared_kept = shared_expert_kept(shape);
    // Beside a tied table the head's part of its gradient joins no sum: it is held, sent back.
    let head_part = shape.tied_head_part().filter(|_| chunk.last);
    let (head_gradients, in_flight, output_gradient) = if chunk.last {
        // By the loss's backward a micro-batch's two losses are summed, one scalar fewer.
        let summed = shape.load_balancing_loss();
        (
            (shape.head_gradient_summed() + shape.norm * element) / shape.shards,
            Term {
                name: "what it holds in flight but the logits, the final norm's buffers, its last layer's output and shared expert's activations (and under cp the targets)",
                bytes: in_flight_past_the_head(shape, chunk) - summed - shared_kept,
            },
            Term { name: "its last layer's output gradient", bytes: stream },
        )
    } else {
        (
            0.0,
            Term {
                name: "what it holds in flight but its last layer's shared expert's activations",
                bytes: chunk.in_flight - shared_kept,
            },
            Term { name: "its output gradient (received)", bytes: stream },
        )
    };
    let output_gradient_name = output_gradient.name;
    let mut routed = vec![Term { name: "its positions", bytes: chunk.positions }, in_flight, output_gradient];
    routed.extend(head_part);
    // Under full recomputation the MLP norm's output, which the experts and the router read, is
    // recomputed from the attention residual kept.
    if full {
        routed.push(Term { name: "its last layer's MLP norm output, recomputed", bytes: shape.sizes.gathered });
    }
    let mut shared = routed.clone();
    // (On the first stage the first layer's router probabilities' backward, after its shared
    // expert's (under SP before it) and before its routed experts', frees them.)
    let counts = received_counts(shape, chunk, true);
    let freed_by_the_router = chunk.first && chunk.layers == 1;
    if !(freed_by_the_router && shape.sequence_parallel()) {
        shared.extend(counts.clone());
    }
    if !freed_by_the_router {
        routed.extend(counts);
    }
    let mut candidates = shared_expert_points(shape, Place::LastLayer, &shared, head_gradients);
    candidates.extend(experts_points(shape, Place::LastLayer, &routed, head_gradients));
    // (Not under tsp, whose head differs.)
    if shape.tsp == 1 {
        candidates.extend(head_gradient_scattered(shape, chunk));
    }
    // (Not under tsp, whose attention backward takes the owners in turn: its first layer's points
    // stand above its last's.)
    if !full && chunk.layers > 1 && shape.tsp == 1 {
        // (The output gradient is summed into the attention residual's gradient by then.)
        let context = routed.iter().filter(|term| term.name != output_gradient_name).cloned().collect();
        candidates.extend(kept_last_layer_attention_backward(shape, context, head_gradients, chunk.layers));
    }
    // (Above the points after it once a shared expert's activations outweigh the last layer's
    // MLP gradients.)
    if !chunk.last {
        candidates.push(output_gradient_received(shape, chunk));
    }
    candidates
}

/// On a chunk before the last the backward starts as the two parts of the output gradient the
/// next stage sent back (its first layer's attention residual gradient and attention norm's input
/// gradient) are summed: all the micro-batch holds in flight is live beside the three, none of its
/// gradients made. (Above the points after it where the last layer's MLP gradients are small
/// beside the stream: beside tp, or a mixture's shared expert's activations.)
fn output_gradient_received(shape: &StageShape, chunk: &Chunk) -> Candidate {
    let mut received = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term { name: "what it holds in flight", bytes: chunk.in_flight },
        Term { name: "its output gradient's two parts (received) and their sum", bytes: 3.0 * shape.sizes.stream },
    ];
    received.extend(received_counts(shape, chunk, true));
    Candidate::made("the output gradient received", 0.0, received)
}

/// Outside full recomputation a mixture's chunk of more than one layer may peak inside its last
/// layer's attention backward too, as the attention kernel makes v's gradient beside q's and k's:
/// the micro-batch holds what it held in the layer's MLP backward (`context`: among it the
/// attention's inputs the forward kept) but the MLP norm's output and input and the attention's
/// output, beside the attention residual's gradient, the attention output's and the kernel's three
/// gradients; of the chunk's gradients the head's (`head_gradients`), the layer's MLP's, MLP
/// norm's and output projection's are made. And after the kernel, as the attention norm output's
/// gradients are summed ([`super::first_layer::attention_input_gradients`]), q, k and v after
/// RoPE freed. None of the `layers` layers' q, k and v gradients are made yet.
fn kept_last_layer_attention_backward(
    shape: &StageShape,
    context: Vec<Term>,
    head_gradients: f64,
    layers: u64,
) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, stream, gathered, kv_kept, attention_kept, .. } = shape.sizes;
    let mut past_the_mlp = context;
    past_the_mlp.extend([
        Term { name: "its last layer's MLP norm output, freed", bytes: -gathered },
        Term { name: "its last layer's attention residual (the MLP norm's input), freed", bytes: -stream },
        // (Kept or, under selective recomputation, recomputed: freed after the output projection's
        // weight gradient.)
        Term { name: "its last layer's attention output, freed", bytes: -local_tokens * attention_kept * element },
    ]);
    let mut held = past_the_mlp.clone();
    held.extend([
        Term { name: "its last layer's attention residual gradient", bytes: stream },
        Term { name: "its last layer's attention output gradient", bytes: local_tokens * query * element },
        Term {
            name: "its last layer's attention q, k and v gradients",
            bytes: (local_tokens * query + kv_kept) * element,
        },
    ]);
    let so_far =
        head_gradients + (shape.norm + hidden * query) * element / shape.shards + shape.layer_mlp_gradient_shards();
    let mut candidates = vec![Candidate {
        name: "the last layer's attention backward, its inputs kept",
        so_far,
        held,
        new_sum: None,
        pending: KeptWholePending::LAYER,
        sum_pending: 0.0,
    }];
    // (The points count the norm's output and the attention residual's gradient themselves.)
    let mut after_the_kernel = past_the_mlp;
    after_the_kernel.extend([
        Term {
            name: "its last layer's q, k and v after RoPE, freed",
            bytes: -(local_tokens * query + kv_kept) * element,
        },
        Term { name: "its last layer's attention norm output (counted apart)", bytes: -gathered },
    ]);
    candidates.extend(super::first_layer::attention_input_gradients(
        shape,
        [
            "the last layer's attention norm output's gradients from v and k",
            "the last layer's attention norm output's gradient from q",
        ],
        after_the_kernel,
        so_far,
    ));
    // (The layers below have made no q, k and v gradients yet.)
    for candidate in &mut candidates {
        candidate.pending = candidate.pending.and_layers(layers - 1);
    }
    candidates
}

/// Under full recomputation a chunk of more than one layer may peak inside its last layer's
/// attention backward, as the attention kernel makes v's gradient beside q's and k's (recomputed
/// for it): as inside its first layer's (`first_layer::attention_backward`), but the residual
/// stream every layer below kept is still live, and of the chunk's gradients only the head's (on
/// the last chunk) and the last layer's MLP's, MLP norm's and output projection's are made. (A
/// mixture's, or a dense one's where the attention outweighs its MLP: beside cp every token's k
/// and v.)
pub(super) fn last_layer_attention_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, stream, gathered, kv_kept, kept_layer, .. } = shape.sizes;
    if shape.recompute() != Recompute::Full || chunk.layers < 2 || shape.tsp > 1 {
        return Vec::new();
    }
    let mut context = chunk.first_layer_held.clone();
    context.extend(received_counts(shape, chunk, true));
    context.push(Term {
        name: "the residual stream the layers below its last kept",
        bytes: (chunk.layers - 1) as f64 * kept_layer,
    });
    let mut held = context.clone();
    held.extend([
        Term { name: "its last layer's attention residual gradient", bytes: stream },
        Term { name: "its last layer's attention norm output, recomputed", bytes: gathered },
        Term {
            name: "its last layer's q, k and v after RoPE, recomputed",
            bytes: (local_tokens * query + kv_kept) * element,
        },
        Term { name: "its last layer's attention output gradient", bytes: local_tokens * query * element },
        Term {
            name: "its last layer's attention q, k and v gradients",
            bytes: (local_tokens * query + kv_kept) * element,
        },
    ]);
    held.extend(super::first_layer::attention_weights_regathered(shape));
    // (Beside a tied table the head's part of its gradient joins no sum: the chunk's held
    // buffers count it.)
    let head = if chunk.last { shape.head_gradient_summed() + shape.norm * element } else { 0.0 };
    let so_far = (head + (shape.norm + hidden * query) * element) / shape.shards + shape.layer_mlp_gradient_shards();
    let mut candidates = vec![Candidate {
        name: "the last layer's attention backward",
        so_far,
        held,
        new_sum: None,
        pending: KeptWholePending::LAYER,
        sum_pending: 0.0,
    }];
    candidates.extend(super::first_layer::attention_input_gradients(
        shape,
        [
            "the last layer's attention norm output's gradients from v and k",
            "the last layer's attention norm output's gradient from q",
        ],
        context,
        so_far,
    ));
    // (The layers below have made no q, k and v gradients yet.)
    for candidate in &mut candidates {
        candidate.pending = candidate.pending.and_layers(chunk.layers - 1);
    }
    candidates
}

/// Under tsp the head of the backward (zero bubble: of B) on a chunk but the last is its last
/// layer's MLP ring backward ([`tsp_ring::ring_backward`]): all the micro-batch holds in flight is
/// live beside the ring's buffers and its output gradient (received), none of its gradients made
/// before; under full recomputation beside the ring's input too ([`ring_input_recomputed`]).
/// `made_in_b`: under zero bubble all the chunk's B gradients.
pub(super) fn tsp_last_ring(shape: &StageShape, chunk: &Chunk, made_in_b: Option<f64>) -> Vec<Candidate> {
    let mut held = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term { name: "what it holds in flight", bytes: chunk.in_flight },
        Term { name: "its output gradient (received)", bytes: shape.sizes.stream },
    ];
    held.extend(ring_input_recomputed(shape));
    tsp_ring::ring_backward(shape, &tsp_ring::LAST_LAYER, held, 0.0, made_in_b)
}

/// Under full recomputation a layer's MLP ring backward recomputes the MLP norm's output (the
/// ring's input) from the attention residual the forward kept; the attention's own recomputation
/// waits for its backward.
fn ring_input_recomputed(shape: &StageShape) -> Option<Term> {
    (shape.recompute() == Recompute::Full)
        .then_some(Term { name: "the last layer's MLP norm output, recomputed", bytes: shape.sizes.gathered })
}

/// Under tsp with full recomputation (outside zero bubble) the last chunk's backward recomputes
/// the final norm's output and gathers it over the sequence for the LM head's weight gradient,
/// after the head's input gradient: the stage may peak as it does, the gathered copy staged beside
/// the rank's share, the logits' gradient and the head's input gradient (every token's), the
/// logits and the targets freed (a mixture's two losses summed).
fn tsp_final_norm_regathered(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { ids, stream, every_token, .. } = shape.sizes;
    if shape.tsp == 1 || shape.zero_bubble || shape.recompute() != Recompute::Full {
        return None;
    }
    let summed = shape.load_balancing_loss();
    Some(Candidate::made(
        "the final norm's output regathered for the LM head's gradient",
        0.0,
        vec![
            Term { name: "its positions", bytes: chunk.positions },
            // (The logits' gradient in place of the logits.)
            Term { name: "what it holds in flight but the targets", bytes: chunk.in_flight - ids - summed },
            Term { name: "the LM head's input gradient, every token's", bytes: every_token },
            Term {
                name: "the final norm's output recomputed, and its gathered copy staged",
                bytes: stream + every_token,
            },
        ]
        .into_iter()
        .chain(final_norm_weight_regathered(shape))
        .collect(),
    ))
}

/// Under full recomputation with SP the final norm's input, the last layer's output, gathered
/// over tp again to recompute the norm for its backward (the rank's share freed), live until
/// that backward.
fn final_norm_input_regathered(shape: &StageShape) -> Option<Term> {
    (shape.recompute() == Recompute::Full && shape.sequence_parallel()).then_some(Term {
        name: "the last layer's output gathered over tp for the final norm, beyond its share",
        bytes: shape.sizes.gathered - shape.sizes.stream,
    })
}

/// Under full recomputation and ZeRO-3, the final norm's weight gathered over dp again for its
/// recomputed output; its backward, past the LM head's, frees it.
fn final_norm_weight_regathered(shape: &StageShape) -> Option<Term> {
    shape.norm_regathered("the final norm's weight, gathered over dp again")
}

/// Under tsp (outside zero bubble) the stage may peak as the LM head's weight gradient joins its
/// sum: beside the head's input (gathered over the sequence; under full recomputation recomputed
/// so), the logits' gradient and the head's input gradient (every token's), the logits and the
/// targets freed. Beside dp (or cp) it may peak as that gradient is made, with those, then after
/// its all-reduce, the unreduced copy live and the logits' gradient and the head's input (under
/// full recomputation its recomputed copy) freed by then; under ZeRO-2 and 3 as it is
/// reduce-scattered instead, staged whole. (A mixture's two losses are summed by then.)
fn tsp_head_gradient_joining(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, hidden, ids, vocab_shard, every_token, .. } = shape.sizes;
    let full = shape.recompute() == Recompute::Full;
    if shape.tsp == 1 || shape.zero_bubble {
        return Vec::new();
    }
    let weight_gradient = vocab_shard * hidden * element;
    let positions = Term { name: "its positions", bytes: chunk.positions };
    let head_input_gradient = Term { name: "the LM head's input gradient, every token's", bytes: every_token };
    // (The logits' gradient in place of the logits; a mixture's two losses summed into one.)
    let summed = shape.load_balancing_loss();
    let mut made = vec![
        positions.clone(),
        Term {
            name: "what it holds in flight but the targets (a mixture's two losses summed)",
            bytes: chunk.in_flight - ids - summed,
        },
    ];
    if full {
        made.push(Term { name: "the final norm's output recomputed, gathered over the sequence", bytes: every_token });
    }
    made.push(head_input_gradient.clone());
    made.extend(final_norm_weight_regathered(shape));
    if let Some(head_part) = shape.tied_head_part() {
        // Beside a tied table the head's part of its gradient joins no sum here: it is sent back
        // to the first stage (beside dp reduced over it first, at the end of the backward).
        made.push(head_part);
        return vec![Candidate::made("the LM head's part of the tied table's gradient is made", 0.0, made)];
    }
    // (Where ZeRO keeps the head whole its shard is among the gradients made, the rest kept
    // whole.)
    let joining = |held| Candidate {
        name: "the LM head's weight gradient joins its sum",
        so_far: weight_gradient / shape.shards,
        held,
        new_sum: Some(Term { name: "the joining head gradient's new sum beside the old", bytes: weight_gradient }),
        pending: KeptWholePending::NONE,
        sum_pending: 0.0,
    };
    if !shape.reduced {
        return vec![joining(made)];
    }
    let unreduced =
        Term { name: "the LM head's weight gradient before its all-reduce or reduce-scatter", bytes: weight_gradient };
    made.push(unreduced.clone());
    // (Under full recomputation the forward kept no head input.)
    let head_input = if full { 0.0 } else { every_token };
    let mut reduced = vec![
        positions,
        Term {
            name: "what it holds in flight but the targets, the logits and the head's input",
            bytes: chunk.in_flight - ids - summed - shape.logits() - head_input,
        },
        unreduced,
        head_input_gradient,
    ];
    reduced.extend(final_norm_weight_regathered(shape));
    // (None of it made where ZeRO keeps it whole, or splits it over some replicas.)
    let made = Candidate::made("the LM head's weight gradient, before its dp reduction", 0.0, made);
    let mut candidates = vec![made.before_the_table()];
    if shape.head_gradient_scattered() {
        // Under ZeRO-2 and 3 it is reduce-scattered, staged whole; its shard is written where the
        // staging was, and joins its sum after.
        let mut held = reduced;
        held.push(Term { name: "its reduce-scatter's staging", bytes: weight_gradient });
        candidates
            .push(Candidate::made("the LM head's weight gradient reduce-scattered", 0.0, held).before_the_table());
    } else {
        candidates.push(joining(reduced));
    }
    candidates
}

/// Under tsp (outside zero bubble) the last chunk's backward next runs its last layer's MLP ring
/// backward ([`tsp_ring::ring_backward`]), the head's and the final norm's gradients made: the
/// micro-batch holds all it kept in flight but the head's (the logits, the head's input gathered
/// over the sequence but under full recomputation, the targets) and the last layer's output,
/// beside the final norm's input gradient, the ring's output gradient (and under full
/// recomputation the ring's input, [`ring_input_recomputed`]). (A dense model's.)
fn tsp_last_chunk_ring(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, ids, stream, every_token, .. } = shape.sizes;
    if shape.tsp == 1 || shape.zero_bubble || shape.model.experts.is_some() {
        return Vec::new();
    }
    // (The last layer's output too, which the final norm's backward read last.)
    let head_input = if shape.recompute() == Recompute::Full { 0.0 } else { every_token };
    let head = shape.logits() + head_input + ids + stream;
    let mut held = vec![
        Term { name: "its positions", bytes: chunk.positions },
        Term {
            name: "what it holds in flight but the head's and its last layer's output",
            bytes: chunk.in_flight - head,
        },
        Term { name: "the final norm's input gradient", bytes: stream },
    ];
    held.extend(ring_input_recomputed(shape));
    // (Beside a tied table the head's part of its gradient is held, joining no sum.)
    held.extend(shape.tied_head_part());
    let made_before = shape.sharded(shape.head_gradient_summed() + shape.norm * element, 0.0);
    tsp_ring::ring_backward(shape, &tsp_ring::LAST_LAYER, held, made_before, None)
}
