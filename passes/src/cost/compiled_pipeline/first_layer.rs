//! Points inside a micro-batch's backward of a chunk's first layer, where a stage may peak
//! instead of at the backward's tail: as a large weight gradient of that layer joins its sum (a
//! dense gate's, a mixture's experts', tsp's o) or is reduce-scattered (ZeRO-2 and 3), beside the
//! layer's attention activations.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{Candidate, Chunk, RECEIVED_COUNTS};
use super::{tsp_o_reduces, StageShape};

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
    let StepSizes { element, local_tokens, query, kv, stream, gathered, boundary, .. } = shape.sizes;
    let live = if shape.recompute() == Recompute::None { 1.0 } else { 0.0 };
    [
        w_reads,
        Term { name: "first layer's attention norm's input gradient (sent back)", bytes: boundary },
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
pub(super) fn gate_scattered(shape: &StageShape, chunk: &Chunk, w_reads: Option<Term>) -> Option<Candidate> {
    if !shape.scattered {
        return None;
    }
    let StepSizes { element, stream, gathered, .. } = shape.sizes;
    let (gate, norm) = (shape.gate, shape.norm);
    let staged = [
        Term { name: "first layer's gate gradient before its dp reduce-scatter", bytes: gate },
        Term { name: "its reduce-scatter's staging", bytes: gate },
    ];
    let held = if let Some(w_reads) = w_reads {
        let mut held = chunk.first_layer_held.clone();
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
    };
    Some(Candidate {
        name: "first layer's gate gradient reduce-scattered",
        so_far: chunk.grads - (gate + (shape.attention_weights + 2.0 * norm) * element + chunk.table) / shape.shards,
        held,
        new_sum: None,
        key_values_pending: true,
    })
}

/// A dense stage may peak inside its first layer's MLP backward on more tokens, as the gate
/// projection's weight gradient joins its sum: the layer's attention activations and MLP norm
/// output are live, with the norm output's gradient from up, gate's output gradient (its input
/// gradient is next) and the layer's output gradient; of its gradients only the down, up and gate
/// projections' are done. Beside dp (or cp) the gate's input gradient comes first, the norm
/// output's gradients summed, and its weight gradient last, the norm output and gate's output
/// gradient freed before it is all-reduced: its unreduced copy is live beside the reduced one.
/// (Not under ZeRO-2 and 3, which scatter it; under tsp, whose ring makes the MLP's gradients; or
/// under full recomputation, which recomputes the MLP.)
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
    shape.mlp_backward_modelled().then(|| Candidate {
        name: "first layer's gate gradient joins its sum",
        so_far: chunk.grads - (shape.attention_weights + 2.0 * shape.norm) * element - chunk.table,
        held: before_attention(shape, chunk, mlp),
        new_sum: Some(Term { name: "the joining gate gradient's new sum beside the old", bytes: shape.gate }),
        key_values_pending: false,
    })
}

/// Beside dp (or cp) a chunk but the first may peak as its first layer's attention norm output's
/// gradient from q joins the sum of those from k and v: q's weight gradient, whose all-reduce ends
/// the chunk's backward, is not yet made, and the norm's output and q's output gradient it reads
/// are live beside q's input gradient and the two sums (the norm's output recomputed under full
/// recomputation). (Not under tp, ZeRO-2 and 3, tsp, or for a mixture.)
pub(super) fn attention_norm_gradient(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, positions, stream, gathered, boundary, .. } = shape.sizes;
    let dense = shape.model.experts.is_none() && shape.tsp == 1 && !shape.scattered;
    if chunk.first || !shape.reduced || shape.tp > 1 || !dense {
        return None;
    }
    let mut held = vec![
        Term { name: "positions", bytes: positions },
        Term { name: "stage input (received)", bytes: boundary },
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's q output gradient", bytes: local_tokens * query * element },
        Term { name: "first layer's q input gradient", bytes: gathered },
        Term {
            name: "first layer's attention norm output gradients from k and v, and with q's",
            bytes: 2.0 * gathered,
        },
    ];
    held.extend(chunk.end.iter().cloned());
    Some(Candidate {
        name: "first layer's attention norm output gradient from q",
        so_far: chunk.grads - (shape.norm + hidden * query) * element,
        held,
        new_sum: None,
        key_values_pending: false,
    })
}

/// A chunk may peak inside its first layer's attention backward, as the attention kernel makes
/// v's gradient beside q's and k's: every gradient of the layer but q's, k's, v's and its input
/// norm's is made, attention's output freed (its gradient live), and its inputs (the norm's output,
/// q, and every token's k and v under cp) live beside the kernel's three gradients (k's and v's
/// every token's under cp, before their reduce-scatter). (Not under full recomputation, which
/// recomputes them; or for a mixture or under tsp, whose attention backwards differ.)
pub(super) fn attention_backward(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, stream, gathered, kv_kept, .. } = shape.sizes;
    if shape.model.experts.is_some() || shape.tsp > 1 {
        return None;
    }
    let mut held = chunk.first_layer_held.clone();
    held.extend([
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's q, k and v after RoPE", bytes: (local_tokens * query + kv_kept) * element },
        Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
        Term {
            name: "first layer's attention q, k and v gradients",
            bytes: (local_tokens * query + kv_kept) * element,
        },
    ]);
    let not_made = (shape.attention_weights - hidden * query + shape.norm) * element + chunk.table;
    Some(Candidate {
        name: "first layer's attention backward",
        so_far: chunk.grads - not_made / shape.shards,
        held,
        new_sum: None,
        key_values_pending: true,
    })
}

/// Under full recomputation a chunk may peak inside its first layer's backward as the down
/// projection's gradient joins its sum (none of the layer's others made), beside the layer's
/// recomputed MLP norm output, gate, up and (but beside dp, which frees it before the all-reduce)
/// SiLU product, the product's gradient and the layer's output gradient; beside dp the unreduced
/// copy is live too. (Not under ZeRO-2 and 3, modelled apart; or for a mixture or under tsp, whose
/// MLPs differ.)
pub(super) fn recomputed_down_joining(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    if shape.recompute() != Recompute::Full
        || shape.scattered
        || shape.model.experts.is_some()
        || shape.tsp > 1
        || shape.tp > 1
    {
        return None;
    }
    let mut held = chunk.first_layer_held.clone();
    held.extend([
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's output gradient", bytes: stream },
        Term { name: "first layer's SiLU product's gradient", bytes: local_tokens * ffn * element },
        Term { name: "first layer's MLP norm output, recomputed", bytes: gathered },
        Term { name: "first layer's gate and up, recomputed", bytes: 2.0 * local_tokens * ffn * element },
    ]);
    if shape.reduced {
        held.push(Term { name: "first layer's down gradient before its dp all-reduce", bytes: shape.gate });
    } else {
        held.push(Term { name: "first layer's SiLU product, recomputed", bytes: local_tokens * ffn * element });
    }
    Some(Candidate {
        name: "first layer's down gradient joins its sum, its MLP recomputed",
        so_far: chunk.grads - (2.0 * shape.gate + (shape.attention_weights + 2.0 * shape.norm) * element + chunk.table),
        held,
        new_sum: Some(Term { name: "the joining down gradient's new sum beside the old", bytes: shape.gate }),
        key_values_pending: false,
    })
}

/// Under dp (or cp) the two routed-expert gradients of the first layer that wait unreduced while
/// the first is reduced and joins its sum (bytes; else 0).
pub(super) fn experts_waiting(shape: &StageShape) -> f64 {
    let StepSizes { element, split, .. } = shape.sizes;
    match &shape.model.experts {
        Some(experts) if shape.experts_reduced => {
            let matrix =
                (experts.count * shape.model.expert_weights() / 3) as f64 / split / shape.layout.expert_degree() as f64
                    * element;
            2.0 * matrix
        }
        _ => 0.0,
    }
}

/// A mixture of experts may peak inside its first layer's backward, as one of that layer's
/// routed-expert gradients (`[E, h, f_e]` matrices, larger than a dense projection) joins its sum:
/// the layer's attention activations are still live, and of its gradients only the router's and
/// the experts' are done. Without dp it is the last of the three; under dp the first, reduced
/// while the other two wait unreduced beside it (the mixture's backward makes all three at once),
/// the MLP norm's output freed.
pub(super) fn experts_joining(shape: &StageShape, chunk: &Chunk) -> Option<Candidate> {
    let StepSizes { element, split, stream, gathered, .. } = shape.sizes;
    let experts = shape.model.experts.as_ref()?;
    let reduced = shape.experts_reduced;
    let matrix =
        (experts.count * shape.model.expert_weights() / 3) as f64 / split / shape.layout.expert_degree() as f64
            * element;
    let waiting = experts_waiting(shape);
    let mut held = before_attention(
        shape,
        chunk,
        [
            Term {
                name: "first layer's MLP norm output (but under dp) and its gradient",
                bytes: if reduced { gathered } else { 2.0 * gathered },
            },
            Term { name: "first layer's output gradient", bytes: stream },
        ],
    );
    if reduced {
        held.push(Term { name: "the expert gradients before their dp all-reduce", bytes: 3.0 * matrix });
    }
    // Under SP the experts read the output gradient all-gathered over tp (their output's
    // reduce-scatter's backward), freed with the MLP norm's output before dp's all-reduce.
    if shape.sequence_parallel() && !reduced {
        held.push(Term { name: "first layer's output gradient, all-gathered", bytes: gathered });
    }
    // A stage between the first and the last still holds the summed counts it received from the
    // last here; the first has freed them, its first layer's router probabilities' backward,
    // which runs before the experts', having read them last.
    if !chunk.first && !chunk.last && shape.chunks == 1 && shape.statistics > 0.0 {
        held.push(Term { name: RECEIVED_COUNTS, bytes: shape.statistics });
    }
    // Over ep one instruction makes the experts' input, router and weight gradients; the router's
    // input and weight gradients from the load-balancing loss, made before it, are summed with
    // its results after them.
    if shape.ep > 1 && experts.load_balancing_loss {
        let StepSizes { local_tokens, hidden, .. } = shape.sizes;
        held.push(Term {
            name: "the router's input and weight gradients from the load-balancing loss",
            bytes: (experts.count as f64 + local_tokens) * hidden * element,
        });
    }
    Some(Candidate {
        name: "first layer's expert gradient joins its sum",
        so_far: chunk.grads - (shape.attention_weights + 2.0 * shape.norm) * element - chunk.table - waiting,
        held,
        new_sum: Some(Term { name: "the joining expert gradient's new sum beside the old", bytes: matrix }),
        key_values_pending: false,
    })
}

/// A mixture with a shared expert (Qwen2-MoE) may peak inside its first layer's backward as the
/// shared expert's gate projection gradient, the last of its three, joins its sum: the shared
/// expert's backward comes before the routed experts' (and, with the load-balancing loss, the
/// router's), so the layer's attention activations, the MLP norm output the routed experts still
/// read and its gradient's running sum are live beside the layer's output gradient; of the layer's
/// gradients the shared expert's (and its gate vector's) are done. Beside dp, cp or ep (its
/// replicas) the input gradient comes first and the weight gradient is all-reduced: its unreduced
/// copy is live beside the reduced one; otherwise the weight gradient comes first, beside the gate
/// output's gradient and the norm output's gradient from up. A stage but the last still holds the
/// expert counts it received, which the router's backward reads.
///
/// Under zero bubble the shared expert's weight gradients are W's, made before the layer's
/// attention's and norms': `w_reads` is what W's tail still reads, and beside it the layer's
/// attention inputs and gradients, both norm outputs' gradients and gate's output gradient are
/// live (the attention norm's input gradient sent back by B).
pub(super) fn shared_expert_gate_joining(
    shape: &StageShape,
    chunk: &Chunk,
    w_reads: Option<Term>,
) -> Option<Candidate> {
    let StepSizes { element, local_tokens, ffn, stream, gathered, .. } = shape.sizes;
    let experts = shape.model.experts.as_ref().filter(|experts| experts.shared_expert)?;
    let unreduced = shape
        .reduced
        .then_some(Term { name: "first layer's shared gate gradient before its all-reduce", bytes: shape.gate });
    let gate_output_gradient =
        Term { name: "first layer's shared gate output gradient", bytes: local_tokens * ffn * element };
    // (Under zero bubble B made the routed experts' and the router's gradients.)
    let in_w = w_reads.is_some();
    let routed = shape.model.routed_expert_weights() as f64 / (shape.tp * shape.layout.expert_degree()) as f64;
    let routing = if in_w { 0.0 } else { routed + (experts.count * shape.model.hidden) as f64 };
    let held = if let Some(w_reads) = w_reads {
        let full = shape.recompute() == Recompute::Full;
        // (The first stage's B read its positions last, but where W recomputes: `w_reads` then.)
        let mut held: Vec<Term> =
            chunk.first_layer_held.iter().filter(|term| !chunk.first || term.name != "positions").cloned().collect();
        held.extend(read_by_w(shape, w_reads));
        // Beside its replicas gate's output gradient is freed before its weight gradient's
        // all-reduce.
        held.push(unreduced.unwrap_or(gate_output_gradient));
        // Under full recomputation a stage between the first and the last still holds the
        // counts' sum it received, as at W's tail.
        if full && !chunk.first && !chunk.last && shape.chunks == 1 && shape.statistics > 0.0 {
            held.push(Term { name: RECEIVED_COUNTS, bytes: shape.statistics });
        }
        held
    } else {
        let mut mlp = vec![
            Term {
                name: "first layer's MLP norm output and its gradient from the shared expert",
                bytes: 2.0 * gathered,
            },
            Term { name: "first layer's output gradient", bytes: stream },
        ];
        mlp.push(unreduced.unwrap_or(gate_output_gradient));
        if !chunk.last && shape.chunks == 1 && shape.statistics > 0.0 {
            mlp.push(Term { name: RECEIVED_COUNTS, bytes: shape.statistics });
        }
        before_attention(shape, chunk, mlp)
    };
    Some(Candidate {
        name: "first layer's shared expert's gate gradient joins its sum",
        so_far: chunk.grads - (shape.attention_weights + 2.0 * shape.norm + routing) * element - chunk.table,
        held,
        new_sum: Some(Term { name: "the joining shared gate gradient's new sum beside the old", bytes: shape.gate }),
        key_values_pending: false,
    })
}

/// Under tsp a stage may peak inside its first layer's attention backward. That backward takes
/// the owners in reverse (the last first): for each, the rank's contributions to the owner's q,
/// k, v and o gradients (its block: the layer's attention weights over the owners), then their
/// reduces to the owner, o's first; a reduce leaves zeros on the other ranks, and the owners'
/// results are summed as they come (the rank's own gradient is its own owner's). The layer's
/// attention norm and residual gradients are live throughout. The points: as o's gradient is
/// reduced to an owner ([`tsp_o_reduces`]), and on the axis's last rank (but beside dp, which
/// all-reduces it first) as it joins its sum.
pub(super) fn tsp_attention(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, stream, gathered, boundary, .. } = shape.sizes;
    let StepSizes { attention_kept, kv_kept, .. } = shape.sizes;
    if shape.tsp == 1 {
        return Vec::new();
    }
    let (layers, recompute) = (chunk.layers as f64, shape.recompute());
    let owners = shape.tsp as f64;
    let block = shape.attention_weights / owners * element;
    let o_block = hidden * query / owners * element;
    let mut gradients = vec![
        Term { name: "first layer's attention norm output gradient", bytes: stream },
        Term { name: "first layer's attention residual gradient", bytes: stream },
    ];
    // Under zero bubble this is W: B made the layer's input gradients, and the first layer's
    // attention norm's (sent back) and every layer's attention residual's (which B reads too) stay
    // to the micro-batch's end. Under either recomputation W still reads every layer's q, k and v
    // (every token's k and v), which B recomputed for it.
    let recomputing = recompute != Recompute::None;
    if shape.zero_bubble {
        gradients.extend([
            Term { name: "first layer's attention norm's input gradient", bytes: boundary },
            Term { name: "the later layers' attention residual gradients", bytes: (layers - 1.0) * stream },
        ]);
        if recomputing {
            gradients.push(Term {
                name: "every layer's q, k and v, kept or recomputed for W",
                bytes: layers * (local_tokens * query + kv_kept) * element,
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
    let reducing_so_far = chunk.grads - block - shape.norm * element - chunk.table;
    let mut candidates: Vec<Candidate> = tsp_o_reduces(shape.tsp, shape.tsp_rank, o_block)
        .into_iter()
        .map(|point| {
            let mut held = chunk.first_layer_held.clone();
            held.extend(gradients.iter().cloned());
            held.extend([
                Term { name: "the owners' reduced attention weight gradients before it, summed", bytes: block },
                Term { name: point.contributions, bytes: block },
                point.reduce,
            ]);
            if point.after > 0 {
                held.push(Term { name: "first layer's attention norm output", bytes: gathered });
                held.push(Term {
                    name: "the activations of the owners still to come",
                    bytes: point.after as f64 * later_owner_activations,
                });
            }
            Candidate {
                name: if point.to_this_rank {
                    "first layer's o gradient reduced to this rank, its owner"
                } else {
                    "first layer's o gradient reduced to another owner"
                },
                so_far: reducing_so_far,
                held,
                new_sum: None,
                key_values_pending: false,
            }
        })
        .collect();
    // As o's gradient joins its sum, on the axis's last rank: the results summed (a block), the
    // first owner's q, k and v contributions, o's result for the first owner (zeros but on it),
    // and o's gradient done.
    if !shape.reduced {
        let mut held = chunk.first_layer_held.clone();
        held.extend(gradients);
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
            key_values_pending: false,
        });
    }
    candidates
}

/// ZeRO-3 under full recomputation gathers the first layer's weights again for its recomputed
/// forward: a stage may peak inside that layer's backward, as its down projection's gradient
/// (none of the layer's done yet) is reduce-scattered, its MLP norm's, gate's and up's weights
/// gathered whole beside the recomputed norm output, gate and up, and the gradient of the SiLU
/// product; or as its output projection's gradient is (the MLP's done), its attention norm's,
/// q's, k's and v's weights gathered beside the recomputed norm output, q, k and v, and the
/// attention output's gradient. (Not under zero bubble: B recomputes the forward, gathering the
/// weights, and W, which makes the weight gradients, reads what B kept, no weight.)
pub(super) fn regathered(shape: &StageShape, chunk: &Chunk) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, hidden, query, kv, ffn, stream, gathered, .. } = shape.sizes;
    if !(shape.scattered && shape.workload.zero >= 3 && shape.recompute() == Recompute::Full) || shape.zero_bubble {
        return Vec::new();
    }
    let (gate, norm, attention_weights, shards) = (shape.gate, shape.norm, shape.attention_weights, shape.shards);
    let mut mlp = chunk.first_layer_held.clone();
    mlp.extend([
        Term { name: "first layer's attention residual", bytes: stream },
        Term { name: "first layer's output gradient", bytes: stream },
        Term { name: "first layer's SiLU product's gradient", bytes: local_tokens * ffn * element },
        Term { name: "first layer's MLP norm weight, gathered", bytes: norm * element },
        Term { name: "first layer's MLP norm output, recomputed", bytes: gathered },
        Term { name: "first layer's gate and up weights, gathered", bytes: 2.0 * gate },
        Term { name: "first layer's gate and up, recomputed", bytes: 2.0 * local_tokens * ffn * element },
        Term { name: "first layer's down gradient before its dp reduce-scatter", bytes: gate },
        Term { name: "its reduce-scatter's staging", bytes: gate },
    ]);
    let output_projection = hidden * query * element;
    let mut attention = chunk.first_layer_held.clone();
    attention.extend([
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
        Term { name: "first layer's attention norm weight, gathered", bytes: norm * element },
        Term { name: "first layer's attention norm output, recomputed", bytes: gathered },
        Term {
            // (But k and v where ZeRO keeps them whole.)
            name: "first layer's q, k and v weights, gathered",
            bytes: hidden * (query + if shape.key_values_gathered { 2.0 * kv } else { 0.0 }) * element,
        },
        Term { name: "first layer's q, k and v, recomputed", bytes: local_tokens * (query + 2.0 * kv) * element },
        Term { name: "first layer's output projection gradient before its reduce-scatter", bytes: output_projection },
        Term { name: "its reduce-scatter's staging", bytes: output_projection },
    ]);
    vec![
        Candidate {
            name: "first layer's down gradient reduce-scattered, its MLP regathered",
            so_far: chunk.grads - (3.0 * gate + (attention_weights + 2.0 * norm) * element + chunk.table) / shards,
            held: mlp,
            new_sum: None,
            key_values_pending: true,
        },
        Candidate {
            name: "first layer's o gradient reduce-scattered, its attention regathered",
            so_far: chunk.grads - ((attention_weights + norm) * element + chunk.table) / shards,
            held: attention,
            new_sum: None,
            key_values_pending: true,
        },
    ]
}
