//! The head of a micro-batch's backward on a chunk, where a stage may peak on more tokens: all
//! that the micro-batch holds in flight is still live beside the first gradients.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{Candidate, Chunk};
use super::StageShape;

/// The points at the head of a micro-batch's backward on `chunk`: on the last chunk the loss's
/// backward and the LM head's weight gradient joining its sum; on another its last layer's down
/// projection's gradient joining its sum and its MLP norm output's gradients being summed.
pub(super) fn head_of_backward(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    if chunk.last {
        last_chunk(shape, chunk)
    } else {
        other_chunk(shape, chunk)
    }
}

/// The head of the micro-batch's backward on the last chunk: all it holds in flight, its
/// positions, and the loss's backward's own buffers (the logits' gradient beside them, and under
/// tp the vocabulary-parallel loss's row statistics, three f32 a row from each tp rank); none of
/// its gradients made yet.
fn last_chunk(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, vocab_shard, hidden, gathered, .. } = shape.sizes;
    let logits = shape.logits();
    let rows = logits / vocab_shard / element;
    let weight_gradient = vocab_shard * hidden * element;
    // Beside a tied table the head's part of its gradient joins no sum here: it is sent back
    // and held to the micro-batch's end (reduced over dp on the first stage, or beside dp × tp at
    // the end of this stage's backward).
    let head_part = shape.tied_head_part();
    let head_sum = if head_part.is_some() { 0.0 } else { weight_gradient };
    // A micro-batch in flight holds its cross-entropy and load-balancing loss apart; by the loss's
    // backward they are summed into its loss, one scalar fewer.
    let summed = if shape.statistics > 0.0 { element } else { 0.0 };
    let mut candidates = vec![Candidate {
        name: "the loss's backward",
        so_far: 0.0,
        held: vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight, its two losses summed", bytes: chunk.in_flight - summed },
            Term {
                name: "the logits' gradient (and under tp the loss's row statistics)",
                bytes: logits + shape.sizes.loss_row_statistics(rows),
            },
        ],
        new_sum: None,
        key_values_pending: false,
    }];
    // Then, as the LM head's weight gradient joins its sum: the logits freed, their gradient and
    // the head's input gradient beside it. (Beside dp, which reduces the gradient first, below;
    // not modelled beside cp or tsp, whose logits' gradient is sliced back to the rank's tokens;
    // under full recomputation, which recomputes the final norm for it; or for a mixture, whose
    // load-balancing loss's buffers differ there.)
    if shape.sizes.token_split == 1 && shape.mlp_backward_modelled() && !shape.reduced {
        let mut held = vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight but the logits", bytes: chunk.in_flight - logits },
            Term { name: "the logits' gradient", bytes: logits },
            Term { name: "the LM head's input gradient", bytes: gathered },
        ];
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
            key_values_pending: false,
        });
    }
    // Beside a tied table without dp, next as the last layer's down projection's weight gradient
    // joins its sum: the head's part joined none, so this may be larger. The logits, the final
    // norm's buffers and the last layer's output are freed; the SiLU product (which made the
    // gradient), the last layer's output gradient and the SiLU product's gradient are live.
    if let Some(head_part) =
        head_part.clone().filter(|_| shape.sizes.token_split == 1 && shape.mlp_backward_modelled() && !shape.reduced)
    {
        let StepSizes { local_tokens, ffn, stream, boundary, .. } = shape.sizes;
        let final_norm = (gathered - boundary) + gathered;
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far: shape.norm * element + shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name:
                        "what it holds in flight but the logits, the final norm's buffers and its last layer's output",
                    bytes: chunk.in_flight - logits - final_norm - boundary,
                },
                Term { name: "its last layer's output gradient", bytes: stream },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
                head_part,
            ],
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            key_values_pending: false,
        });
    }
    let dense = shape.model.experts.is_none() && shape.tsp == 1 && !shape.scattered;
    let full = shape.recompute() == Recompute::Full;
    if shape.sizes.token_split == 1 && dense && shape.reduced {
        // Beside dp the LM head's weight gradient is made before it is reduced: the logits freed,
        // their gradient, the head's input gradient (partial under tp, before its all-reduce)
        // and the unreduced weight gradient live, no gradient of the micro-batch's made yet.
        let mut held = vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term { name: "what it holds in flight but the logits", bytes: chunk.in_flight - logits },
            Term { name: "the logits' gradient", bytes: logits },
            Term { name: "the LM head's input gradient", bytes: gathered },
            match &head_part {
                Some(head_part) => head_part.clone(),
                None => Term { name: "the head gradient before its dp all-reduce", bytes: weight_gradient },
            },
        ];
        if full {
            held.push(Term { name: "the final norm's output, recomputed", bytes: gathered });
        }
        candidates.push(Candidate {
            name: "the LM head's weight gradient",
            so_far: 0.0,
            held,
            new_sum: None,
            key_values_pending: false,
        });
    }
    if shape.sizes.token_split == 1 && dense && shape.reduced && shape.tp == 1 && head_part.is_none() {
        // First as the LM head's weight gradient joins its sum: the logits' gradient and the
        // final norm's output (the head's input; recomputed for it under full recomputation)
        // freed before it was all-reduced, the head's input gradient and the unreduced copy
        // beside it.
        let final_norm_output = if full { 0.0 } else { gathered };
        candidates.push(Candidate {
            name: "the LM head's weight gradient joins its sum",
            so_far: weight_gradient,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name: "what it holds in flight but the logits and the final norm's output",
                    bytes: chunk.in_flight - logits - final_norm_output,
                },
                Term { name: "the LM head's input gradient", bytes: gathered },
                Term { name: "the head gradient before its dp all-reduce", bytes: weight_gradient },
            ],
            new_sum: Some(Term { name: "the joining head gradient's new sum beside the old", bytes: weight_gradient }),
            key_values_pending: false,
        });
    }
    // Beside dp, as the last layer's down projection's weight gradient joins its sum, reduced, its
    // unreduced copy beside it: the head's and the final norm's gradients made, the logits, the
    // final norm's buffers, the last layer's output and SiLU product freed, its output gradient
    // and the SiLU product's gradient live.
    if shape.sizes.token_split == 1 && shape.mlp_backward_modelled() && shape.reduced {
        let StepSizes { local_tokens, ffn, stream, boundary, .. } = shape.sizes;
        let final_norm = (gathered - boundary) + gathered;
        let so_far = head_sum + shape.norm * element + shape.gate;
        let in_flight = Term {
            name: "what it holds in flight but the logits, the final norm's buffers, its last layer's output and SiLU product",
            bytes: chunk.in_flight - logits - final_norm - boundary - local_tokens * ffn * element,
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
            key_values_pending: false,
        });
        // Then as gate's output gradient is made beside the SiLU product's, the unreduced down
        // gradient freed (as on a chunk before the last).
        candidates.push(Candidate {
            name: "the last layer's gate output gradient",
            so_far,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                in_flight,
                Term { name: "its last layer's output gradient", bytes: stream },
                Term {
                    name: "its last layer's SiLU product's and gate output's gradients",
                    bytes: 2.0 * local_tokens * ffn * element,
                },
            ]
            .into_iter()
            .chain(head_part)
            .collect(),
            new_sum: None,
            key_values_pending: false,
        });
    }
    candidates
}

/// The head of a micro-batch's backward on a chunk before the last, a dense one's (as a gate
/// gradient's joining is modelled): first its last layer's down projection's weight gradient
/// joins its sum, the micro-batch holding all it holds in flight beside the output gradient it
/// received and the SiLU product's gradient (not modelled under tp, under which the output
/// gradient has another copy there; beside dp, which reduces the gradient first, as gate's output
/// gradient is made instead, the product freed); then that layer's MLP norm output's gradients
/// from gate and up are summed, its down and up gradients made, its gate, up and their product
/// freed, beside the output gradient, gate's output gradient (its weight gradient is next) and the
/// two input gradients and their sum.
fn other_chunk(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, gathered, boundary, .. } = shape.sizes;
    if !shape.mlp_backward_modelled() {
        return Vec::new();
    }
    let mut candidates = Vec::new();
    if shape.reduced {
        // Beside dp the down gradient is all-reduced before it joins its sum and its unreduced
        // copy freed; the SiLU product is freed by then, and the stage may peak as gate's output
        // gradient is made beside the product's.
        candidates.push(Candidate {
            name: "the last layer's gate output gradient",
            so_far: shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term {
                    name: "what it holds in flight but its last layer's SiLU product",
                    bytes: chunk.in_flight - local_tokens * ffn * element,
                },
                Term { name: "its output gradient (received)", bytes: boundary },
                Term {
                    name: "its last layer's SiLU product's and gate output's gradients",
                    bytes: 2.0 * local_tokens * ffn * element,
                },
            ],
            new_sum: None,
            key_values_pending: false,
        });
    } else if shape.tp == 1 {
        candidates.push(Candidate {
            name: "the last layer's down gradient joins its sum",
            so_far: shape.gate,
            held: vec![
                Term { name: "its positions", bytes: chunk.positions },
                Term { name: "what it holds in flight", bytes: chunk.in_flight },
                Term { name: "its output gradient (received)", bytes: boundary },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
            ],
            new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
            key_values_pending: false,
        });
    }
    candidates.push(Candidate {
        name: "the last layer's MLP norm output gradient",
        so_far: 2.0 * shape.gate,
        held: vec![
            Term { name: "its positions", bytes: chunk.positions },
            Term {
                name: "what it holds in flight but its last layer's gate, up and their product",
                bytes: chunk.in_flight - 3.0 * local_tokens * ffn * element,
            },
            Term { name: "its output gradient (received)", bytes: boundary },
            Term { name: "its last layer's gate output gradient", bytes: local_tokens * ffn * element },
            Term {
                name: "its last layer's MLP norm output's gradients from gate and up, and their sum",
                bytes: 3.0 * gathered,
            },
        ],
        new_sum: None,
        key_values_pending: false,
    });
    candidates
}
