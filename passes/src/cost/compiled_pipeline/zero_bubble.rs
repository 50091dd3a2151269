//! Zero bubble (ZB-H1) splits each backward into B (input gradients) and W (weight gradients,
//! later): what a micro-batch holds between its B and its W on a chunk, and what a W still reads.

use super::super::memory::Term;
use super::super::step_sizes::StepSizes;
use super::super::workload::Recompute;
use super::chunk::{Candidate, Chunk, KeptWholePending};
use super::{head, StageShape};

/// What a micro-batch holds of a chunk between its B and its W, in bytes.
pub(super) struct BetweenBAndW {
    /// All of it (positions apart).
    pub between: f64,
    /// What W's tail still holds for the weight gradients: the residual gradients, under selective
    /// recomputation every layer's q, k and v, under full recomputation also its gate and up
    /// projections (all recomputed by B).
    pub kept_for_weights: f64,
    /// The MLP weight gradients B makes over the chunk's layers (tsp's ring, a mixture's experts
    /// and router), if any.
    pub made_in_b: Option<f64>,
    /// What the chunk's layers but the first keep for W once their B is done.
    pub later_w_reads: f64,
}

/// Between B and W a micro-batch keeps what W reads: per layer the inputs of its weight gradients
/// (both norms' outputs and inputs, attention's output, the SiLU product) and their output
/// gradients (q, k, v, gate, up, both norms' outputs, both residuals); beside them its input (the
/// stage's, or the embedding's output), its first layer's attention norm's input gradient, and on
/// the last chunk the final norm's output and gradient, the logits' gradient, the targets and the
/// loss. The residual gradients, which B reads too, stay to the micro-batch's end, so W's tail
/// holds them as well. Selective recomputation keeps q, k and v after RoPE in place of attention's
/// output, which W recomputes from them for the output projection's gradient.
pub(super) fn between_b_and_w(shape: &StageShape, chunk: &Chunk) -> BetweenBAndW {
    let StepSizes { element, tokens, local_tokens, vocab_shard, query, kv, ffn, .. } = shape.sizes;
    let StepSizes { ids, positions, stream, gathered, kv_kept, kept_layer, every_token, .. } = shape.sizes;
    let (first, last, layers) = (chunk.first, chunk.last, chunk.layers as f64);
    let (sequence_parallel, statistics) = (shape.sequence_parallel(), shape.statistics);
    let mlp_gradients_in_b = shape.mlp_gradients_in_b();
    let selective = shape.recompute() == Recompute::Selective;
    let full = shape.recompute() == Recompute::Full;
    let attention_for_w = if selective { query + 2.0 * kv } else { query };
    // Under full recomputation, what B recomputed for W and the gradients W reads: both norms'
    // outputs and output gradients, the attention residual's gradient, gate and up and their
    // gradients, q, k and v and theirs.
    // Under tsp B runs the MLP ring's backward whole, and a mixture's experts' and router's
    // backward, their weight gradients too: a micro-batch between B and W keeps those gradients
    // (outputs) instead of what they read (the MLP norm's output and its gradient, gate, up and
    // their product). Per layer: the attention norm's output and its gradient, the attention
    // residual and its gradient, the layer's output and the MLP's input gradient; q's, k's and v's
    // gradients, and attention's output (under either recomputation q, k and v, every token's k
    // and v, which B recomputed under full).
    let attention_for_w = if mlp_gradients_in_b.is_some() && full { query + 2.0 * kv } else { attention_for_w };
    let mut per_layer = if let Some(mlp_gradients) = mlp_gradients_in_b {
        2.0 * gathered + 4.0 * stream + local_tokens * (attention_for_w + query + 2.0 * kv) * element + mlp_gradients
    } else if full {
        4.0 * gathered + stream + local_tokens * (4.0 * ffn + 2.0 * query + 4.0 * kv) * element
    } else {
        4.0 * gathered + 4.0 * stream + local_tokens * (attention_for_w + query + 3.0 * ffn + 2.0 * kv) * element
    };
    // A shared expert's weight gradients are W's: it keeps what they read, the MLP norm's output
    // and the product, and their output gradients (the gate logit's, the scaled output's, gate's
    // and up's).
    // (Under tsp B runs its ring's backward, making the projections' gradients: W reads only
    // the MLP norm's output and the gate logit's gradient, for the gate vector's.)
    let shared_expert = shape.shared_expert();
    if shared_expert && shape.tsp > 1 {
        per_layer += gathered + local_tokens * element;
    } else if shared_expert {
        per_layer += 2.0 * gathered + local_tokens * (3.0 * ffn + 1.0) * element;
    }
    // Under cp the k and v kept (or recomputed) for W are every token's, all-gathered.
    if selective || full {
        per_layer += (kv_kept - 2.0 * local_tokens * kv) * element;
    }
    let mut between = layers * per_layer + 2.0 * stream;
    // Under SP the projections' output gradients W reads are the gathered ones, and the first
    // layer's attention residual gradient is kept beside them (but on the first stage, where B's
    // last step sums it into the embedding output's gradient, which is whole there), the last
    // layer's output gathered for the final norm.
    if sequence_parallel {
        between += if first { gathered - stream } else { stream };
        if last {
            between += gathered - stream;
        }
    }
    // ZeRO-3 gathers the final norm's weight again for the recomputed head, and W reads it.
    let regathered_final_norm = if full && last { shape.norms_gathered_again(shape.norm * element) } else { 0.0 };
    between += regathered_final_norm;
    // Full recomputation keeps beside those the residual stream its forward kept (but, under SP,
    // the last layer's output on the last chunk: only its gathered copy, counted above), and each
    // layer's output gradient (the last one's on the last chunk is the final norm's input gradient,
    // counted above).
    if full && mlp_gradients_in_b.is_none() {
        let last_layers = f64::from(u8::from(last));
        between += layers * kept_layer + (layers - last_layers) * stream;
        if sequence_parallel {
            // Under SP, on the last chunk, the stream's split and the rest counted above make the
            // last layer's output gathered for the final norm; the final norm's input gradient,
            // counted whole with the head's, is split (reduce-scattered over tp).
            between -= last_layers * (gathered - stream);
        }
    }
    // (The first stage runs each W right after its B, forwards apart, so no other micro-batch is
    // between there at a W's tail; its between is written by analogy, with the token ids.)
    // (Under tsp in zigzag order too, and W reads the embedding output's gradient gathered over
    // the sequence in place of the first layer's attention norm's input gradient.)
    // (Under cp the rank's own ids too.)
    if first {
        between += if shape.tsp > 1 {
            2.0 * ids + every_token - stream
        } else {
            ids + if shape.cp > 1 { ids / shape.cp as f64 } else { 0.0 }
        };
    }
    // A mixture's statistics stay to the micro-batch's end: its layers' (sent on), and on a stage
    // between the first and the last the counts' sum it received (the program frees that after its
    // last reader on the first stage, which holds the model's first layer, and the pipeline
    // releases it at the micro-batch's end elsewhere).
    if !last && statistics > 0.0 {
        let received = if shape.stage > 0 { statistics } else { 0.0 };
        between += 2.0 * layers * statistics + received;
    }
    if last && shape.tsp > 1 {
        // The head's input gathered over the sequence (but under full recomputation), its
        // gradient, every token's logits' gradient over the rank's vocabulary shard, the loss (the
        // targets were read in the forward).
        let logits = tokens * vocab_shard * element;
        let head_input = if full { 0.0 } else { every_token };
        between += head_input + gathered + logits + element;
        // (A mixture's loss is two, and the counts' sum, as below.)
        if statistics > 0.0 {
            between += element + statistics;
        }
    } else if last {
        let logits = local_tokens * vocab_shard * element;
        // cp's targets were read in the forward.
        let targets = if shape.cp == 1 { ids } else { 0.0 };
        between += targets + element + logits + 2.0 * gathered;
        // A mixture's loss is two: the cross-entropy and the load-balancing loss, and the latter's
        // backward reads the counts' sum.
        if statistics > 0.0 {
            between += element + statistics;
        }
        // When B made the MLP's gradients, full recomputation leaves W the final norm's input
        // gradient but not its recomputed output (W reads only the head's input).
        if full && mlp_gradients_in_b.is_some() {
            between -= gathered;
        }
    }
    // (Under SP W reads their gathered copies, freed as it goes, instead.)
    // (Under tsp only the attention residual's: B made the MLP ring's weight gradients.)
    let residual_gradients = if mlp_gradients_in_b.is_some() { 1.0 } else { 2.0 };
    let mut kept_for_weights = if sequence_parallel { 0.0 } else { residual_gradients * layers * stream };
    // B reads a shared expert's MLP norm output too (the routed experts' backward): it stays to
    // the micro-batch's end.
    if shared_expert {
        kept_for_weights += layers * gathered;
    }
    // Under selective recomputation W's tail still holds every layer's q, k and v (and the
    // positions, on the first stage too); under full recomputation every layer's recomputed gate
    // and up projections too.
    kept_for_weights += regathered_final_norm;
    if selective || full {
        // (Under cp every token's k and v, all-gathered; under tsp no gate or up, whose weight
        // gradients B made.)
        let recomputed = if full && mlp_gradients_in_b.is_none() { query + 2.0 * ffn } else { query };
        kept_for_weights += layers * (local_tokens * recomputed + kv_kept) * element;
        if first {
            kept_for_weights += positions;
        }
    }
    // Under full recomputation (a dense MLP's) each later layer also keeps the residual stream its
    // forward kept (its attention residual, and the output of the layer before it) and its output
    // gradient, which `per_layer` leaves to the terms above.
    let mut later_w_reads = (layers - 1.0) * (per_layer - mlp_gradients_in_b.unwrap_or(0.0));
    if full && mlp_gradients_in_b.is_none() {
        later_w_reads += (layers - 1.0) * (kept_layer + stream);
    }
    BetweenBAndW {
        between,
        kept_for_weights,
        made_in_b: mlp_gradients_in_b.map(|per_layer| layers * per_layer),
        later_w_reads,
    }
}

/// The head of W, where a stage may peak on more tokens: W's first weight gradient joins its sum
/// beside all the micro-batch held between B and W (its B gradients among its gradients). On the
/// last chunk W first sums the micro-batch's two losses (a mixture's) and makes the LM head's
/// weight gradient, under full recomputation from the final norm's output it recomputes; on another
/// the last layer's down projection's (a dense MLP's, or a shared expert's: a mixture's routed
/// experts' are B's), and on a mixture's the last layer's o projection's after its MLP's
/// ([`mixture_o_joining_in_w`]). Beside dp, cp or ep (which all-reduce the loss before it joins its sum, and
/// the gradient) as the gradient is made, before its all-reduce (under ZeRO-2 and 3 its
/// reduce-scatter, the sums the rank's shards), and the LM head's as it joins its sum after it.
/// Beside a tied table, on the last chunk as the head's part of its gradient is made (it joins no
/// sum), and on the first stage beside the head's parts received (`chunk_hold` adds them). A dense
/// chunk's last layer's up and gate gradients then join their sums too; on a dense model's last
/// chunk, or a mixture's with a shared expert (outside tsp, ZeRO-2 and 3), W goes on so, once the
/// LM head's gradient has joined its sum and what made it is freed, through the final norm's (and
/// a shared expert's gate vector's) to the last layer's down projection's. Under tsp with full
/// recomputation, also as the recomputed final norm's output is gathered. (Under tsp only on the
/// last chunk: B makes the MLP's gradients.)
pub(super) fn head_of_w(shape: &StageShape, chunk: &Chunk, between_b_and_w: &BetweenBAndW) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, vocab_shard, hidden, ffn, stream, gathered, every_token, .. } = shape.sizes;
    if !shape.zero_bubble {
        return Vec::new();
    }
    let made_in_b = between_b_and_w.made_in_b.unwrap_or(0.0);
    let shared_expert = shape.shared_expert();
    if shape.tsp > 1 && !chunk.last {
        // Under tsp B made the MLP's gradients: W's first is the last layer's MLP norm weight's
        // (a shared expert's gate vector's before it), partial before its all-reduce over the
        // axis, beside all the micro-batch holds between B and W (and on the first chunk beside a
        // tied table the head's part of its gradient, taken by then: `chunk_hold` adds it).
        let positions = if shape.positions_freed_in_b() { 0.0 } else { chunk.positions };
        let held = [
            Term { name: "its positions", bytes: positions },
            Term {
                name: "what it holds between B and W but its B gradients",
                bytes: between_b_and_w.between - made_in_b,
            },
        ];
        let norm = Term { name: "the last layer's MLP norm weight gradient, partial", bytes: shape.norm * element };
        let mut points = vec![Candidate::made(
            "the head of W: the last layer's MLP norm weight gradient",
            made_in_b,
            held.iter().cloned().chain([norm]).collect(),
        )];
        // The gate vector's gradient frees the gate logit's gradient it reads; all-reduced over
        // tsp, it joins its sum beside its partial copy (under ZeRO-2 and 3 is reduce-scattered
        // over dp, its all-reduced copy whole beside the partial one).
        if shared_expert {
            let gate_vector = hidden * element;
            let joining = [
                Term { name: "the shared expert's gate vector gradient, partial", bytes: gate_vector },
                Term { name: "the gate logit's gradient, freed", bytes: -local_tokens * element },
            ];
            if shape.scattered {
                let whole = Term { name: "its all-reduced copy, before its reduce-scatter", bytes: gate_vector };
                points.push(Candidate::made(
                    "the head of W: the last layer's shared expert's gate vector gradient all-reduced over tsp",
                    made_in_b,
                    held.iter().cloned().chain(joining).chain([whole]).collect(),
                ));
                return points;
            }
            points.push(Candidate::joining(
                "the head of W: the last layer's shared expert's gate vector gradient joins its sum",
                made_in_b + gate_vector,
                held.iter().cloned().chain(joining).collect(),
                gate_vector,
            ));
        }
        return points;
    }
    // W's first gradient to join a sum: on the last chunk the LM head's, but a tied table's part
    // (which joins none); else, and after that part, the last layer's down projection's.
    let lm_head = chunk.last && !shape.tied;
    // What the LM head's weight gradient (or a tied table's part) reads, freed after it: the
    // logits' gradient (under cp the rank's tokens'; under tsp every token's) and the head's input
    // (under tsp gathered over the sequence; under full recomputation the copy W recomputed).
    let head_reads =
        if shape.tsp > 1 { shape.logits() + every_token } else { local_tokens * vocab_shard * element + gathered };
    let dense = shape.model.experts.is_none();
    let head_gradient = vocab_shard * hidden * element;
    // (A shared expert's W first makes its gate vector's weight gradient, the gate logit's
    // gradient freed after; under SP, whose forward makes the logit before the expert, last.)
    let gate_vector_first = shared_expert && !shape.sequence_parallel();
    let (made_before, freed_before) = if chunk.last || dense {
        (0.0, 0.0)
    } else if shared_expert {
        if gate_vector_first {
            (hidden * element / shape.shards, local_tokens * element)
        } else {
            (0.0, 0.0)
        }
    } else {
        return mixture_o_joining_in_w(shape, chunk, between_b_and_w);
    };
    let mixture_o = if dense { Vec::new() } else { mixture_o_joining_in_w(shape, chunk, between_b_and_w) };
    let positions = if shape.positions_freed_in_b() { 0.0 } else { chunk.positions };
    let summed = if chunk.last { shape.load_balancing_loss() } else { 0.0 };
    let received = counts_received_at_w(shape, chunk);
    let mut held = vec![
        Term { name: "its positions", bytes: positions },
        Term {
            name: "what it holds between B and W but its B gradients (on the last chunk its two losses summed)",
            bytes: between_b_and_w.between - made_in_b - summed - freed_before - received,
        },
    ];
    let mut made_in_b = made_in_b + made_before;
    let mut points = Vec::new();
    // (Under tsp gathered over the sequence: the head's input.)
    if chunk.last && shape.recompute() == Recompute::Full {
        let recomputed = if shape.tsp > 1 { every_token } else { gathered };
        // Under tsp, as W gathers it over the sequence the rank's copy is live beside.
        if shape.tsp > 1 {
            let mut gathering = held.clone();
            gathering.push(Term {
                name: "the final norm's output, recomputed, and its gathered copy",
                bytes: stream + recomputed,
            });
            // (Before the LM head's weight gradient: none of it made where ZeRO keeps it whole.)
            let name = "the final norm's output recomputed and gathered in W";
            points.push(Candidate::made(name, made_in_b, gathering).before_the_table());
        }
        held.push(Term { name: "the final norm's output, recomputed", bytes: recomputed });
    }
    // Beside a tied table the head's part of its gradient joins no sum here: it is sent back to
    // the first stage (beside dp × tp reduced first, at the end of the W), held to the
    // micro-batch's end. What made it is freed (the logits' gradient and the head's input, under
    // full recomputation the copy W recomputed); W then makes the final norm's weight gradient,
    // which frees what it reads (the norm's input and output gradient, under SP gathered), and
    // goes on to the last layer's MLP, a dense one's from the SiLU product (under full
    // recomputation recomputed).
    if let Some(head_part) = shape.tied_head_part().filter(|_| chunk.last) {
        held.push(head_part);
        points.push(Candidate::made(
            "the LM head's part of the tied table's gradient is made in W",
            made_in_b,
            held.clone(),
        ));
        // (Under tsp B made the MLP's gradients.)
        if shape.tsp > 1 {
            return points;
        }
    } else if lm_head {
        let names = ["the LM head's weight gradient in W", "the LM head's weight gradient joins its sum in W"];
        let head = FirstJoin { gradient: head_gradient, names, lm_head: true, head_reads };
        points.extend(first_join_points(shape, &head, held.clone(), made_in_b));
        // (Under tsp B made the MLP's gradients.)
        if shape.tsp > 1 {
            return points;
        }
        // The LM head's gradient has joined its sum (beside replicas all-reduced, its unreduced
        // copy freed; under ZeRO-2 and 3 reduce-scattered, the rank's shard kept to the W's end,
        // as every gradient W makes).
        made_in_b += head_gradient / shape.shards;
    }
    if chunk.last {
        held.push(Term { name: "the logits' gradient and the head's input, freed", bytes: -head_reads });
        held.push(Term { name: "the final norm's input and output gradient, freed", bytes: -2.0 * gathered });
        made_in_b += shape.norm * element / shape.shards;
        // A shared expert's gate vector's gradient next, which frees the gate logit's gradient.
        if gate_vector_first {
            held.push(Term { name: "the gate logit's gradient, freed", bytes: -local_tokens * element });
            made_in_b += hidden * element / shape.shards;
        }
    }
    // A mixture's last chunk without a shared expert: B made its MLP's gradients, so W goes on to
    // its last layer's MLP norm and attention.
    if !dense && !shared_expert {
        points.extend(mixture_w_past_the_mlp(shape, chunk, held, made_in_b));
        return points;
    }
    // (A dense MLP's under full recomputation from the SiLU product W recomputes from gate and up.)
    if dense && shape.recompute() == Recompute::Full {
        held.push(Term { name: "the last layer's SiLU product, recomputed", bytes: local_tokens * ffn * element });
    }
    let down = FirstJoin {
        gradient: shape.gate,
        names: ["the last layer's down gradient in W", "the last layer's down gradient joins its sum in W"],
        lm_head: false,
        head_reads,
    };
    points.extend(first_join_points(shape, &down, held, made_in_b));
    points.extend(mixture_o);
    points
}

/// A mixture's counts' sum, received, that a micro-batch holds between B and W and the walk counts
/// at a W itself (on a stage between the first and the last, outside full recomputation): not
/// twice.
fn counts_received_at_w(shape: &StageShape, chunk: &Chunk) -> f64 {
    if !chunk.last && shape.stage > 0 && shape.recompute() != Recompute::Full {
        shape.statistics
    } else {
        0.0
    }
}

/// On a mixture's chunk but the last B made the experts' and the router's gradients, so W begins
/// with its last layer's shared expert's weight gradients, if it has one, and the MLP norm's
/// ([`mixture_w_past_the_mlp`], beside all the micro-batch holds between B and W).
fn mixture_o_joining_in_w(shape: &StageShape, chunk: &Chunk, between_b_and_w: &BetweenBAndW) -> Vec<Candidate> {
    if chunk.last || shape.tsp > 1 {
        return Vec::new();
    }
    let made_in_b = between_b_and_w.made_in_b.unwrap_or(0.0);
    let positions = if shape.positions_freed_in_b() { 0.0 } else { chunk.positions };
    let received = counts_received_at_w(shape, chunk);
    let between = vec![
        Term { name: "its positions", bytes: positions },
        Term {
            name: "what it holds between B and W but its B gradients",
            bytes: between_b_and_w.between - made_in_b - received,
        },
    ];
    mixture_w_past_the_mlp(shape, chunk, between, made_in_b)
}

/// A mixture's W once its MLP's gradients are made (by B; on the last chunk W made the head's
/// first), from what the micro-batch holds there (`between`) and the gradients made by then
/// (`made_in_b`): its last layer's shared expert's weight gradients, if it has one (freeing what
/// they read but the MLP norm's output, which B read too), and the MLP norm's weight gradient,
/// which frees what it read (the norm's input and its output gradient): without a shared expert a
/// point as it is made (where the first stage beside a tied table peaks, the head's part taken by
/// then). Then o's, made from o's output gradient (under SP gathered over tp, and so freed after
/// it) and attention's output (which W recomputes under recomputation; freed after it, and without
/// replicas after it joins): the first large gradient to join its sum, beside dp, cp or ep
/// all-reduced first, its unreduced copy live beside, or under ZeRO-2 and 3 reduce-scattered
/// first, staged whole.
fn mixture_w_past_the_mlp(shape: &StageShape, chunk: &Chunk, between: Vec<Term>, made_in_b: f64) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, query, kv, hidden, ffn, stream, gathered, .. } = shape.sizes;
    let attention_output = if shape.recompute() == Recompute::None { local_tokens * query * element } else { 0.0 };
    let o_gradient = hidden * query * element;
    let mut held = between.clone();
    held.extend([
        Term { name: "the last layer's MLP norm's input and output gradient, freed", bytes: -2.0 * stream },
        Term { name: "the last layer's attention output, freed", bytes: -attention_output },
    ]);
    // Under SP o's weight gradient reads its output gradient gathered over tp, which it frees.
    if shape.sequence_parallel() {
        held.push(Term { name: "o's output gradient gathered over tp, freed", bytes: -gathered });
    }
    let shared_expert = shape.shared_expert();
    let mut points = Vec::new();
    if !shared_expert {
        // (Beside replicas, or under SP all-reduced over tp, its reads are freed before it is
        // reduced, below this point; else it joins its sum first.)
        let norm = shape.norm * element;
        let names = if chunk.last {
            [
                "the last layer's MLP norm weight gradient in W",
                "the last layer's MLP norm weight gradient joins its sum in W",
            ]
        } else {
            [
                "the head of W: the last layer's MLP norm weight gradient",
                "the head of W: the last layer's MLP norm weight gradient joins its sum",
            ]
        };
        points.push(if shape.reduced || shape.scattered || shape.sequence_parallel() {
            let gradient = Term { name: "the last layer's MLP norm weight gradient", bytes: norm };
            let held = between.iter().cloned().chain([gradient]).collect();
            Candidate::made(names[0], made_in_b, held)
        } else {
            Candidate::joining(names[1], made_in_b + norm, between, norm)
        });
    }
    let mut made = made_in_b + shape.norm * element / shape.shards;
    // A shared expert's gradients (its gate vector's and three projections') are made by then,
    // and what they read freed: the gate logit's gradient, the product, gate's and up's output
    // gradients and the scaled output's gradient.
    if shared_expert {
        made += (hidden * element + 3.0 * shape.gate) / shape.shards;
        held.push(Term {
            name: "what the shared expert's weight gradients read, freed",
            bytes: -(local_tokens * (3.0 * ffn + 1.0) * element + gathered),
        });
    }
    // What o's weight gradient reads (attention's output, kept or recomputed in W, and under SP
    // its output gradient gathered over tp): beside replicas freed before the gradient is reduced,
    // so live only as it is made; else live as it joins its sum, freed after.
    let reads = local_tokens * query * element + if shape.sequence_parallel() { gathered } else { 0.0 };
    if shape.reduced {
        let gradient = Term { name: "the gradient, whole", bytes: o_gradient };
        let read = Term { name: "what it reads", bytes: reads };
        let held = held.iter().cloned().chain([gradient, read]).collect();
        points.push(Candidate::made("the last layer's o gradient made in W, beside what it reads", made, held));
    }
    if shape.scattered {
        held.extend([
            Term { name: "the gradient, whole", bytes: o_gradient },
            Term { name: "its reduce-scatter's staging", bytes: o_gradient },
        ]);
        points.push(Candidate::made("the last layer's o gradient reduce-scattered in W", made, held));
        return points;
    }
    // Then the last layer's v, k and q gradients, each from its output gradient, which it frees,
    // and the attention norm's output: a chunk of more than one layer (whose tail is its first
    // layer's) may peak as q's joins its sum, beside dp, cp or ep all-reduced first, its unreduced
    // copy live beside. (Not under SP, where W reads the output gradients gathered over tp.)
    if chunk.layers > 1 && !shape.sequence_parallel() {
        let q_gradient = hidden * query * element;
        let mut held = held.clone();
        held.push(Term { name: "v's and k's output gradients, freed", bytes: -2.0 * local_tokens * kv * element });
        let so_far = made + o_gradient + 2.0 * hidden * kv * element;
        let name = if shape.reduced {
            // (As it is made beside what it reads, q's output gradient and the attention norm's
            // output; as it joins its sum those freed.)
            held.push(Term { name: "q's gradient before its all-reduce", bytes: q_gradient });
            points.push(Candidate::made(
                "the last layer's q gradient in W, before its all-reduce",
                so_far,
                held.clone(),
            ));
            held.push(Term {
                name: "q's output gradient and the attention norm's output, freed",
                bytes: -(local_tokens * query * element + gathered),
            });
            "the last layer's q gradient joins its sum in W, its unreduced copy live"
        } else {
            "the last layer's q gradient joins its sum in W"
        };
        points.push(Candidate::joining(name, so_far + q_gradient, held, q_gradient));
    }
    if shape.reduced {
        held.push(Term { name: "the gradient before its all-reduce", bytes: o_gradient });
    } else {
        held.push(Term { name: "what o's weight gradient read, freed after it joins", bytes: reads });
    }
    points.push(Candidate::joining(
        "the last layer's o gradient joins its sum in W",
        made + o_gradient,
        held,
        o_gradient,
    ));
    points
}

/// W's first weight gradient to join a sum: the LM head's or the last layer's down projection's.
struct FirstJoin {
    /// Its bytes.
    gradient: f64,
    /// Its points as it is made and as it joins its sum.
    names: [&'static str; 2],
    /// Whether it is the LM head's.
    lm_head: bool,
    /// What the LM head's gradient reads, freed after it.
    head_reads: f64,
}

/// The points of [`head_of_w`] as `first` is made and joins its sum (a dense MLP's up and gate
/// gradients after down's), beside `held`, with `made_in_b` of the micro-batch's gradients made.
fn first_join_points(shape: &StageShape, first: &FirstJoin, held: Vec<Term>, made_in_b: f64) -> Vec<Candidate> {
    let StepSizes { element, local_tokens, ffn, gathered, .. } = shape.sizes;
    let FirstJoin { gradient, names, lm_head, head_reads } = *first;
    let shared_expert = shape.shared_expert();
    let mut points = Vec::new();
    let joining = |name, held| Candidate::joining(name, made_in_b + gradient, held, gradient);
    // A dense MLP's up and gate gradients join their sums after down's, each made from its
    // output gradient and the MLP norm's output, the SiLU product and down's output gradient
    // (under SP the gathered copy) freed. Beside replicas (dp or cp, outside ZeRO-2 and 3) each
    // is all-reduced first, its output gradient freed before, its unreduced copy live beside; as
    // up's joins, then gate's; without them gate's, up's output gradient freed. (Under full
    // recomputation the product W recomputed, gate and up kept to the micro-batch's end.)
    let later_mlp_joins = |reduced: bool| -> Vec<Candidate> {
        let dense = !lm_head && shape.model.experts.is_none();
        if !dense || shape.scattered {
            return Vec::new();
        }
        let intermediate = local_tokens * ffn * element;
        let output_gradient_gathered = if shape.sequence_parallel() { gathered } else { 0.0 };
        // Each join: the gradients W has made by then, and whether the MLP norm's output is freed
        // (beside replicas gate's weight gradient, its last reader, frees it before the join).
        let joins: &[(&'static str, f64, bool)] = if reduced {
            &[
                ("the last layer's up gradient joins its sum in W, all-reduced", 2.0, false),
                ("the last layer's gate gradient joins its sum in W, all-reduced", 3.0, true),
            ]
        } else {
            &[("the last layer's gate gradient joins its sum in W", 3.0, false)]
        };
        joins
            .iter()
            .map(|&(name, made, norm_output_freed)| {
                let output_gradients_freed = if reduced { made - 1.0 } else { made - 2.0 };
                let norm_output = if norm_output_freed { gathered } else { 0.0 };
                let mut held = held.clone();
                held.push(Term {
                    name: "what the MLP's weight gradients so far read, freed",
                    bytes: -((1.0 + output_gradients_freed) * intermediate + output_gradient_gathered + norm_output),
                });
                if reduced {
                    held.push(Term { name: "the gradient before its all-reduce", bytes: gradient });
                }
                Candidate { so_far: made_in_b + made * gradient, ..joining(name, held) }
            })
            .collect()
    };
    if !shape.reduced {
        points.extend(later_mlp_joins(false));
        points.push(joining(names[1], held));
        return points;
    }
    points.extend(later_mlp_joins(true));
    let mut before = held.clone();
    before.push(Term { name: "the gradient before its all-reduce (or reduce-scatter)", bytes: gradient });
    // (Where ZeRO keeps the LM head whole, none of it is made before its all-reduce.)
    let made = Candidate::made(names[0], made_in_b, before);
    points.push(if lm_head { made.before_the_table() } else { made });
    // What made the gradient, freed once it is made: the LM head's logits' gradient (under cp the
    // rank's tokens', which W reads; under tsp every token's) and input (under full recomputation
    // the copy W recomputed), or the last layer's SiLU product (under full recomputation
    // recomputed) and under SP its output gradient gathered over tp, which W read last there (a
    // shared expert's scaled output's gradient, whole).
    let freed = if lm_head {
        head_reads
    } else {
        let gathered_output_gradient = if shape.sequence_parallel() || shared_expert { gathered } else { 0.0 };
        local_tokens * ffn * element + gathered_output_gradient
    };
    // Beside replicas (outside ZeRO-2 and 3) a shared expert's down gradient then joins its sum,
    // reduced, its unreduced copy beside, what made it freed.
    if shared_expert && !lm_head && !shape.scattered {
        let mut joined = held.clone();
        joined.extend([
            Term { name: "what made it, freed", bytes: -freed },
            Term { name: "the gradient before its all-reduce", bytes: gradient },
        ]);
        points.push(joining(names[1], joined));
    }
    // Under ZeRO-2 and 3 a dense stage's gradient (a mixture's LM head's, or a shared expert's) is
    // then reduce-scattered, staged whole, what made it freed.
    let scattered = if lm_head { shape.head_gradient_scattered() } else { shape.scattered };
    if scattered && (shape.model.experts.is_none() || lm_head || shared_expert) {
        let name = if lm_head {
            "the LM head's weight gradient reduce-scattered in W"
        } else {
            "the last layer's down gradient reduce-scattered in W"
        };
        let mut scattered = held.clone();
        scattered.extend([
            Term { name: "what made it, freed", bytes: -freed },
            Term { name: "the gradient, whole", bytes: gradient },
            Term { name: "its reduce-scatter's staging", bytes: gradient },
        ]);
        // A dense MLP's up gradient is reduce-scattered next, down's shard made and joined, what
        // made up freed too (its output gradient; the MLP norm's output stays for gate's).
        if !lm_head && shape.model.experts.is_none() {
            let mut up = scattered.clone();
            up.push(Term { name: "up's output gradient, freed", bytes: -local_tokens * ffn * element });
            points.push(Candidate::made(
                "the last layer's up gradient reduce-scattered in W",
                made_in_b + gradient / shape.shards,
                up,
            ));
        }
        // (Where ZeRO splits the LM head over some of its replicas, it is all-reduced over the
        // rest after: none of it made yet.)
        let made = Candidate::made(name, made_in_b, scattered);
        points.push(if lm_head { made.before_the_table() } else { made });
    }
    // Beside dp (or cp) the LM head's gradient then joins its sum once all-reduced, its unreduced
    // copy live and what made it (the logits' gradient and the head's input, gathered over the
    // sequence under tsp; under full recomputation the copy W recomputed) freed. (Not where ZeRO-2
    // and 3 reduce-scatter it; where they keep it whole, its shard is among the gradients made,
    // the rest kept whole.)
    if lm_head && !scattered {
        let mut after = held;
        after.push(Term { name: "the logits' gradient and the head's input, freed", bytes: -head_reads });
        after.push(Term { name: "the gradient before its all-reduce", bytes: gradient });
        let name = "the LM head's weight gradient joins its sum in W, all-reduced";
        points.push(Candidate::joining(name, made_in_b + gradient / shape.shards, after, gradient));
    }
    points
}

/// Under tsp the first chunk's B ends by gathering the embedding output's gradient over the
/// sequence (the embedding's weight gradient, a W op, reads every token's): the stage may peak as
/// it does, the gathered copy staged beside the rank's share (the first layer's input gradient,
/// which the micro-batch holds between B and W) and all else it holds there (its positions but
/// where B frees them).
pub(super) fn tsp_embedding_gradient_gathered(
    shape: &StageShape,
    chunk: &Chunk,
    between_b_and_w: &BetweenBAndW,
) -> Option<Candidate> {
    let stream = shape.sizes.stream;
    if !shape.zero_bubble || shape.tsp == 1 || !chunk.first {
        return None;
    }
    let made_in_b = between_b_and_w.made_in_b.unwrap_or(0.0);
    let positions = if shape.positions_freed_in_b() { 0.0 } else { chunk.positions };
    Some(Candidate::made(
        "the embedding output's gradient gathered in B",
        made_in_b,
        vec![
            Term { name: "its positions", bytes: positions },
            // (The gathered copy among them, staged.)
            Term {
                name: "what it holds between B and W but its B gradients and the later layers' inputs for W",
                bytes: between_b_and_w.between - made_in_b - between_b_and_w.later_w_reads,
            },
            Term { name: "the embedding output's gradient, the rank's share", bytes: stream },
        ],
    ))
}

/// Under zero bubble the last chunk's B begins with the loss's backward ([`head::loss_backward`]):
/// the micro-batch holds all its forward kept (a mixture's two losses apart: W sums them) and the
/// logits' gradient beside the micro-batches between B and W, none of its B gradients made (on
/// its first B of the chunk none of their sums exist), nor yet what its W reads of the later
/// layers. Under tsp B next makes the LM head's
/// input gradient, every token's, and reduce-scatters it over the sequence (staged whole), the
/// logits (their gradient in their place) and the targets freed. Under
/// tsp a dense model's B on another chunk begins with its last layer's MLP ring backward, as a
/// backward does outside zero bubble ([`head::tsp_last_ring`]).
pub(super) fn head_of_b(shape: &StageShape, chunk: &Chunk, between_b_and_w: &BetweenBAndW) -> Vec<Candidate> {
    let StepSizes { ids, every_token, .. } = shape.sizes;
    if !shape.zero_bubble {
        return Vec::new();
    }
    if !chunk.last {
        return if shape.tsp > 1 && shape.model.experts.is_none() {
            head::tsp_last_ring(shape, chunk, between_b_and_w.made_in_b)
        } else {
            Vec::new()
        };
    }
    let mut points = vec![Candidate { name: "the loss's backward in B", ..head::loss_backward(shape, chunk) }];
    points.extend(head::table_gathered_for_the_head(shape, chunk));
    // (A mixture's two losses are summed in W: in B they are apart.)
    for point in &mut points {
        point.held.push(Term { name: "its two losses, apart until W sums them", bytes: shape.load_balancing_loss() });
    }
    if shape.tsp > 1 {
        points.push(Candidate::made(
            "the LM head's input gradient reduce-scattered in B",
            0.0,
            vec![
                Term { name: "its positions", bytes: chunk.positions },
                // (The logits' gradient in place of the logits.)
                Term { name: "what it holds in flight but the targets", bytes: chunk.in_flight - ids },
                Term { name: "the LM head's input gradient, every token's, and its staging", bytes: 2.0 * every_token },
            ],
        ));
    }
    let pending = between_b_and_w.made_in_b.unwrap_or(0.0);
    points.into_iter().map(|point| Candidate { sum_pending: pending, ..point }).collect()
}

/// W takes a chunk's layers last to first, and a layer's MLP weight gradients before its
/// attention's: a chunk may peak as its first layer's gate gradient joins its sum, every gradient
/// of the chunk made but the layer's attention weights' and its two norms' (and on the first chunk
/// the embedding's). What those read is live beside what the tail holds (the attention norm's
/// output and gradients, q's gradient, the chunk's input): attention's output (but where W
/// recomputes it), k's and v's gradients, the attention residual (the MLP norm's input), under SP
/// the attention residual's gradient gathered over tp (o's weight gradient reads it), and the MLP
/// norm's output and gradient; and gate's output gradient, which its weight gradient read. Beside
/// replicas (dp or cp) the gradient is all-reduced first, its unreduced copy live beside, what it
/// read freed (gate's output gradient, and the MLP norm's output, whose last reader it is). (A
/// dense chunk's, without tsp or ZeRO-2 and 3.)
pub(super) fn first_layer_gate_joining_in_w(shape: &StageShape, chunk: &Chunk, w_reads: &Term) -> Option<Candidate> {
    let StepSizes { element, local_tokens, query, kv, ffn, stream, gathered, .. } = shape.sizes;
    let dense = shape.model.experts.is_none() && shape.tsp == 1;
    if !shape.zero_bubble || !dense || shape.scattered {
        return None;
    }
    let norm_gradients = if shape.sequence_parallel() { 2.0 * stream } else { gathered };
    let mut held = chunk.first_layer_held_after_rope_backward();
    held.extend([
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm gradient", bytes: norm_gradients },
        Term { name: "first layer's attention norm output", bytes: gathered },
        Term { name: "first layer's q gradient", bytes: local_tokens * query * element },
        Term { name: "first layer's k and v gradients", bytes: 2.0 * local_tokens * kv * element },
        Term { name: "first layer's attention residual", bytes: stream },
        w_reads.clone(),
    ]);
    if shape.reduced {
        held.extend([
            Term { name: "first layer's MLP norm output gradient", bytes: stream },
            Term { name: "the gate gradient before its all-reduce", bytes: shape.gate },
        ]);
    } else {
        held.extend([
            Term { name: "first layer's MLP norm output and its gradient", bytes: gathered + stream },
            Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
        ]);
    }
    // (Under either recomputation W recomputes attention's output for o's weight gradient, later.)
    if shape.recompute() == Recompute::None {
        held.push(Term { name: "first layer's attention output", bytes: local_tokens * query * element });
    }
    // Under SP o's weight gradient reads its output gradient gathered over tp.
    if shape.sequence_parallel() {
        held.push(Term {
            name: "first layer's attention residual gradient, gathered over tp (for W)",
            bytes: gathered,
        });
    }
    Some(Candidate {
        name: "first layer's gate gradient joins its sum in W",
        so_far: chunk.grads - (shape.attention_weights + 2.0 * shape.norm) * element - chunk.table,
        held,
        new_sum: Some(Term { name: "the joining gate gradient's new sum beside the old", bytes: shape.gate }),
        pending: KeptWholePending::LAYER,
        sum_pending: 0.0,
    })
}
