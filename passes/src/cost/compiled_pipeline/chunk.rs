//! What one chunk of a stage (the whole stage but under interleaving) holds: a micro-batch in
//! flight on it, what it keeps to the micro-batch's end, and the points of a backward on it where
//! the stage may peak.

use super::super::memory::{chunk_params, Term};
use super::super::step_sizes::{StepSizes, ID_BYTES};
use super::super::workload::Recompute;
use super::zero_bubble::BetweenBAndW;
use super::{first_layer, forward, head, replicated_key_values, zero_bubble, StageShape};

/// What one chunk of a stage holds (see [`super::compiled_stage_peak`]), in bytes.
pub(super) struct ChunkHold {
    /// Its layers.
    pub layers: u64,
    /// Its parameters, but a tied table's copy received for the LM head.
    pub params: f64,
    /// The last chunk beside a tied embedding: the first stage's table, received for the LM
    /// head (bytes; else 0).
    pub received_table: f64,
    /// Its gradients: one running sum of each (ZeRO-2 and 3: their shards).
    pub grads: f64,
    /// Of its gradients, those ZeRO-2 and 3 keep whole, beyond their shards (its layers' q, k and
    /// v, their norms, o and MLP, and its vocabulary table, where their rows do not divide): the
    /// sum and the micro-batch's gradient of each.
    pub grads_kept_whole: f64,
    /// Of those, its vocabulary table's (the embedding's on the first chunk, an untied LM head's
    /// on the last).
    pub table_kept_whole: f64,
    /// A micro-batch in flight on it.
    pub in_flight: f64,
    /// What a micro-batch keeps of it after its backward there, until its backward on the stage
    /// ends (interleaving: a later chunk's backward follows).
    pub remains: f64,
    /// Zero bubble: what a micro-batch between its B and its W holds, and what B made.
    pub between_b_and_w: BetweenBAndW,
    /// The points of a micro-batch's backward on it (zero bubble: of its W) where the stage may
    /// peak, in the order they are weighed (the first of equals wins).
    pub backward: Vec<Candidate>,
    /// Under zero bubble, the points of a micro-batch's B inside its first layer's backward
    /// (`so_far` the stage's B gradients made by then, a mixture's experts' and routers') where
    /// the stage may peak ([`first_layer::in_b`]).
    pub in_b: Vec<Candidate>,
    /// Under zero bubble, the points at the head of a micro-batch's B on the last chunk, before
    /// any of its B gradients or what its W reads of the later layers is made.
    pub head_of_b: Vec<Candidate>,
    /// Under zero bubble, the points of a micro-batch's forward on it where the stage may peak.
    pub forward: Vec<Candidate>,
}

/// A point of a micro-batch's backward on a chunk where the stage may peak.
#[derive(Clone)]
pub(super) struct Candidate {
    pub name: &'static str,
    /// The chunk's gradients the micro-batch has made by then.
    pub so_far: f64,
    /// What the micro-batch holds there beside its gradients.
    pub held: Vec<Term>,
    /// The gradient joining its running sum there: its new sum is live beside the old one once
    /// an earlier micro-batch has created the sum.
    pub new_sum: Option<Term>,
    /// Of the gradients ZeRO keeps whole ([`ChunkHold::grads_kept_whole`]), those the
    /// micro-batch has not made there.
    pub pending: KeptWholePending,
    /// The bytes whose running sum is made later in the backward: on a micro-batch's first
    /// backward of the chunk their sums do not exist yet. Of `so_far` at a backward's point (over
    /// ep beside the load-balancing loss, the router's gradient from the experts' backward, not
    /// yet summed with its gradient from the loss); of all the chunk's B gradients at a B's (those
    /// not made yet).
    pub sum_pending: f64,
}

/// Of the gradients ZeRO keeps whole beyond their shards (a layer's k and v, q's weight and q's
/// bias, its attention norm and its dense parameters past the attention, where their
/// rows do not divide over the replicas, and the chunk's vocabulary table, the embedding's on the
/// first chunk, an untied LM head's on the last), those a micro-batch has not made at a point, in
/// layers of the chunk (and tables): at the head of its backward every layer's; inside a layer's
/// backward that layer's until its attention backward makes v's, then k's (and q's bias), then
/// q's weight (`StageShape::kept_whole_pending`), its attention norm's to its end, its down's and
/// up's until the MLP backward's points past them, and (counted as not yet made: a point there
/// is below the planner) its gate's, MLP norm's and o's until its attention's points; the
/// embedding's until the tail of the first chunk's backward, the LM head's until it is made and
/// reduced.
#[derive(Clone, Copy)]
pub(super) struct KeptWholePending {
    pub key_values: f64,
    pub query_weights: f64,
    pub query_biases: f64,
    pub attention_norms: f64,
    pub outputs_and_mlp_norms: f64,
    pub downs: f64,
    pub ups: f64,
    pub gates: f64,
    pub table: f64,
}

impl KeptWholePending {
    /// None: every gradient kept whole is made (or none is kept whole where the point lies).
    pub const NONE: KeptWholePending = KeptWholePending::layers(0);
    /// All of one layer's: inside its backward, before its attention's weight gradients (its o's
    /// and MLP's counted as not yet made, though some may be: a lower bound there).
    pub const LAYER: KeptWholePending = KeptWholePending::layers(1);
    /// All of one layer's but its down projection's: inside its MLP backward, down's made.
    pub const PAST_DOWN: KeptWholePending = KeptWholePending { downs: 0.0, ..KeptWholePending::LAYER };
    /// All of one layer's but its down and up projections': inside its MLP backward, gate's next.
    pub const PAST_UP: KeptWholePending = KeptWholePending { ups: 0.0, ..KeptWholePending::PAST_DOWN };
    /// One layer's k and q gradients: v's made (k's and v's each half of the two's), and its o's
    /// and MLP's before them; its attention norm's still to come.
    pub const K_AND_Q: KeptWholePending = KeptWholePending {
        key_values: 0.5,
        query_weights: 1.0,
        query_biases: 1.0,
        attention_norms: 1.0,
        outputs_and_mlp_norms: 0.0,
        downs: 0.0,
        ups: 0.0,
        gates: 0.0,
        table: 0.0,
    };
    /// One layer's q weight and bias gradients: k's and v's made.
    pub const Q: KeptWholePending = KeptWholePending { key_values: 0.0, ..KeptWholePending::K_AND_Q };
    /// One layer's q weight gradient: k's, v's and q's bias's made.
    pub const Q_WEIGHT: KeptWholePending = KeptWholePending { query_biases: 0.0, ..KeptWholePending::Q };

    /// All of `layers` layers'.
    pub const fn layers(layers: u64) -> KeptWholePending {
        let layers = layers as f64;
        KeptWholePending {
            key_values: layers,
            query_weights: layers,
            query_biases: layers,
            attention_norms: layers,
            outputs_and_mlp_norms: layers,
            downs: layers,
            ups: layers,
            gates: layers,
            table: 0.0,
        }
    }

    /// These and all of `layers` more layers' (the layers below the one a point lies in).
    pub fn and_layers(self, layers: u64) -> KeptWholePending {
        let more = KeptWholePending::layers(layers);
        KeptWholePending {
            key_values: self.key_values + more.key_values,
            query_weights: self.query_weights + more.query_weights,
            query_biases: self.query_biases + more.query_biases,
            attention_norms: self.attention_norms + more.attention_norms,
            outputs_and_mlp_norms: self.outputs_and_mlp_norms + more.outputs_and_mlp_norms,
            downs: self.downs + more.downs,
            ups: self.ups + more.ups,
            gates: self.gates + more.gates,
            table: self.table,
        }
    }

    /// All of `layers` layers', and the table's where these hold it.
    pub fn all_layers(self, layers: u64) -> KeptWholePending {
        KeptWholePending { table: self.table, ..KeptWholePending::layers(layers) }
    }

    /// These and the chunk's vocabulary table's.
    pub fn and_table(self) -> KeptWholePending {
        KeptWholePending { table: 1.0, ..self }
    }
}

impl Candidate {
    /// A point where the micro-batch has made `so_far` of the chunk's gradients and none joins a
    /// sum.
    pub(super) fn made(name: &'static str, so_far: f64, held: Vec<Term>) -> Candidate {
        Candidate { name, so_far, held, new_sum: None, pending: KeptWholePending::NONE, sum_pending: 0.0 }
    }

    /// A point inside a chunk's first layer's backward, before its attention's weight gradients,
    /// where the micro-batch has made `so_far` of the chunk's gradients and none joins a sum: of
    /// those ZeRO keeps whole, the layer's are still to come.
    pub(super) fn before_first_attention(name: &'static str, so_far: f64, held: Vec<Term>) -> Candidate {
        Candidate { pending: KeptWholePending::LAYER, ..Candidate::made(name, so_far, held) }
    }

    /// The same point, where none of the chunk's vocabulary table's gradient is made yet (where
    /// ZeRO keeps it whole; see [`KeptWholePending`]).
    pub(super) fn before_the_table(self) -> Candidate {
        Candidate { pending: self.pending.and_table(), ..self }
    }

    /// A point where a gradient of `joins` bytes joins its sum: `so_far` counts it, and past the
    /// chunk's first backward its new sum is live beside the old.
    pub(super) fn joining(name: &'static str, so_far: f64, held: Vec<Term>, joins: f64) -> Candidate {
        let new_sum = Term { name: "the joining gradient's new sum beside the old", bytes: joins };
        Candidate { new_sum: Some(new_sum), ..Candidate::made(name, so_far, held) }
    }
}

/// A chunk's place in the model and what its points share.
pub(super) struct Chunk {
    /// Whether it is the model's first or last virtual stage, and its layers.
    pub first: bool,
    pub last: bool,
    pub layers: u64,
    /// Its gradients (dp's shard of them under ZeRO-2 and 3).
    pub grads: f64,
    /// On the first chunk, the rank's rows of the embedding table (bytes; else 0).
    pub table: f64,
    /// The micro-batch's positions where its points hold them: on the first chunk of an
    /// interleaved stage the walk counts them instead (0 there).
    pub positions: f64,
    /// A micro-batch in flight on it.
    pub in_flight: f64,
    /// What the micro-batch keeps of it to its end: the last chunk the targets and the loss,
    /// another the output it sent on (and a mixture's statistics).
    pub end: Vec<Term>,
    /// Inside the first layer's backward: the chunk's inputs and what its end keeps.
    pub first_layer_held: Vec<Term>,
}

/// What one of the stage's chunks holds, `first` and `last` saying whether it is the model's
/// first or last virtual stage.
pub(super) fn chunk_hold(shape: &StageShape, first: bool, last: bool, layers: u64) -> ChunkHold {
    let StepSizes { element, local_tokens, vocab_shard, hidden, ids, positions, stream, .. } = shape.sizes;
    // The head reads a tied table received from the first stage, which sums its gradient.
    let received_table = if shape.tied && last && !first { vocab_shard * hidden * element } else { 0.0 };
    let params =
        chunk_params(shape.model, shape.layout, shape.workload, first, last, layers) * element - received_table;
    let grads =
        shape.sharded(params, layers as f64 * shape.layer_routed_experts()) + layers as f64 * shape.router_kept_whole;
    let end = chunk_end(shape, last, layers);
    let positions = if first && shape.chunks > 1 { 0.0 } else { positions };
    let mut first_layer_held = vec![Term { name: POSITIONS, bytes: positions }];
    if first {
        first_layer_held.push(Term { name: "token ids", bytes: ids });
        if shape.cp > 1 {
            first_layer_held.push(Term { name: "the rank's own token ids", bytes: local_tokens * ID_BYTES });
        }
        first_layer_held.push(Term { name: "embedding output (the first layer's input)", bytes: stream });
    } else {
        first_layer_held.push(Term { name: "stage input (received)", bytes: stream });
    }
    first_layer_held.extend(end.iter().cloned());
    let chunk = Chunk {
        first,
        last,
        layers,
        grads,
        table: if first { vocab_shard * hidden * element } else { 0.0 },
        positions,
        in_flight: in_flight(shape, first, last, layers),
        end,
        first_layer_held,
    };
    let between_b_and_w = zero_bubble::between_b_and_w(shape, &chunk);
    // W's tail, and the embedding rows' slicing in it, hold what W still reads.
    let w_reads = shape.zero_bubble.then_some(Term {
        name: "what W still reads (residual gradients; q, k, v if recomputed; gate, up if full)",
        bytes: between_b_and_w.kept_for_weights,
    });
    let mut backward = tail(shape, &chunk, w_reads.clone());
    let mut in_b = if shape.zero_bubble { first_layer::in_b(shape, &chunk) } else { Vec::new() };
    in_b.extend(zero_bubble::tsp_embedding_gradient_gathered(shape, &chunk, &between_b_and_w));
    let head_of_b = zero_bubble::head_of_b(shape, &chunk, &between_b_and_w);
    let tail_points = backward.len();
    backward.extend(first_layer::gate_scattered(shape, &chunk, w_reads.clone()));
    backward.extend(first_layer::gate_input_gradient_scattered(shape, &chunk));
    backward.extend(first_layer::down_and_up_gradients_scattered(shape, &chunk));
    // (Under zero bubble a shared expert's gate gradient joins its sum in W.)
    if let Some(w_reads) = w_reads.clone() {
        backward.extend(zero_bubble::first_layer_gate_joining_in_w(shape, &chunk, &w_reads));
        backward.extend(first_layer::down_scattered_in_w(shape, &chunk, w_reads.clone()));
        backward.extend(first_layer::shared_expert_gate_joining_in_w(shape, &chunk, w_reads.clone()));
        backward.extend(replicated_key_values::first_layer_weight_gradients_in_w(shape, &chunk, w_reads));
    }
    // (At the head of W no layer's q, k and v weight gradients are made yet.)
    let head_of_w = zero_bubble::head_of_w(shape, &chunk, &between_b_and_w);
    backward
        .extend(head_of_w.into_iter().map(|point| Candidate { pending: point.pending.all_layers(layers), ..point }));
    // (Under zero bubble the experts' gradients join their sums in B, not at a W; and the head of
    // a backward is a B's.)
    if !shape.zero_bubble {
        backward.extend(first_layer::mixture_mlp_backward(shape, &chunk));
        backward.extend(head::head_of_backward(shape, &chunk));
        backward.extend(first_layer::gate_joining(shape, &chunk));
        backward.extend(first_layer::mlp_norm_gradients_summed(shape, &chunk));
        backward.extend(first_layer::attention_norm_gradient(shape, &chunk));
        backward.extend(first_layer::attention_backward(shape, &chunk));
        backward.extend(first_layer::o_gradient_scattered(shape, &chunk));
        backward.extend(head::last_layer_attention_backward(shape, &chunk));
        backward.extend(first_layer::first_layer_attention_input_gradients(shape, &chunk));
        backward.extend(replicated_key_values::first_layer_weight_gradients(shape, &chunk));
        backward.extend(replicated_key_values::last_layer_weight_gradients(shape, &chunk));
        backward.extend(first_layer::recomputed_mlp_backward(shape, &chunk));
    }
    backward.extend(first_layer::tsp_attention(shape, &chunk, between_b_and_w.later_w_reads));
    backward.extend(first_layer::tsp_ring_backward(shape, &chunk));
    backward.extend(first_layer::regathered(shape, &chunk));
    // Beside a tied table the first chunk's backward (zero bubble: W) reads the head's part of
    // its gradient, taken by its start at the latest, at its tail (whose points count it
    // themselves); the walk counts it where an earlier step took it (`head_link`).
    if let Some(head_part) = shape.tied_head_part().filter(|_| first && !last) {
        for candidate in &mut backward[tail_points..] {
            candidate.held.push(head_part.clone());
        }
    }
    // Beside dp × tp the last chunk reduces the head's part over dp at the end of its backward,
    // to send it back.
    if shape.tied && last && shape.reduced && shape.sizes.vocab_split > 1.0 {
        backward.push(head_part_reduced(shape, &chunk, w_reads.clone()));
    }
    // On the first chunk the embedding's gradient is made at the tail of the backward, the last
    // gradient: before it, where ZeRO keeps it whole, every point holds only its running sum.
    if first && shape.table_kept_whole > 0.0 {
        for candidate in backward.iter_mut().filter(|candidate| ![TAIL, SHARD_ALL_REDUCED].contains(&candidate.name)) {
            candidate.pending = candidate.pending.and_table();
        }
    }
    // What stays after the chunk's backward until the micro-batch's backward ends on the stage:
    // the buffers whose last reader is another rank (the output sent on, the input's gradient
    // sent back and the attention norm's input gradient summed into it) or an output.
    let mut remains = vec![
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm's input gradient", bytes: stream },
    ];
    remains.extend(chunk.end.iter().cloned());
    ChunkHold {
        layers,
        params,
        received_table,
        grads,
        grads_kept_whole: layers as f64 * shape.layer_kept_whole() + shape.chunk_table_kept_whole(first, last),
        table_kept_whole: shape.chunk_table_kept_whole(first, last),
        in_flight: chunk.in_flight,
        remains: remains.iter().map(|term| term.bytes).sum(),
        between_b_and_w,
        backward,
        in_b,
        head_of_b,
        forward: forward::forward_points(shape, &chunk),
    }
}

/// A micro-batch in flight on a chunk: its inputs, what its layers keep, and on the last one the
/// head's outputs (the final norm's input all-gathered under SP, its output whole); its positions,
/// which every chunk of the stage reads, are counted once a micro-batch.
fn in_flight(shape: &StageShape, first: bool, last: bool, layers: u64) -> f64 {
    let StepSizes { element, local_tokens, ids, stream, kept_layer, .. } = shape.sizes;
    let statistics = shape.statistics;
    let mut in_flight = layers as f64 * kept_layer;
    if first {
        // Under cp the rank's own token ids too.
        let local_ids = if shape.cp > 1 {
            local_tokens * ID_BYTES
        } else if shape.tsp > 1 {
            ids
        } else {
            0.0
        };
        in_flight += ids + local_ids + stream;
    } else {
        in_flight += stream;
    }
    if last {
        in_flight += statistics + shape.load_balancing_loss();
    } else if shape.statistics_sent_on(last) {
        in_flight += 2.0 * layers as f64 * statistics;
    }
    if last {
        in_flight += ids + shape.final_norm_kept() + shape.logits() + element;
    }
    in_flight
}

/// The name of the micro-batch's positions among a chunk's `first_layer_held`, by which a
/// point that no longer holds them (a first stage's W) leaves them out.
pub(super) const POSITIONS: &str = "positions";

impl Chunk {
    /// `first_layer_held` once the first layer's RoPE backward has run: on the first chunk it read
    /// the positions last (a W that recomputes holds them again, in its `w_reads`).
    pub(super) fn first_layer_held_after_rope_backward(&self) -> Vec<Term> {
        self.first_layer_held.iter().filter(|term| !self.first || term.name != POSITIONS).cloned().collect()
    }

    /// On the first chunk under SP, the positions live as the first layer's attention norm
    /// output's gradients from v and k are summed: there the program's order puts q's RoPE
    /// backward, which reads them last, after that sum (without SP both RoPE backwards come
    /// first), under cp the rank's own positions (the zigzag order's were read last by the
    /// attention kernel's backward).
    pub(super) fn positions_read_by_q_rope_backward(&self, shape: &StageShape) -> Option<Term> {
        if !(self.first && shape.sequence_parallel()) {
            return None;
        }
        let token_split = shape.sizes.token_split as f64;
        let own = if token_split > 1.0 { self.positions / (token_split + 1.0) } else { self.positions };
        Some(Term { name: POSITIONS, bytes: own })
    }
}

/// The term naming the expert counts summed over the layers that a stage between the first and
/// the last received from the last.
pub(super) const RECEIVED_COUNTS: &str = "the expert counts summed over the layers (received)";

/// The expert counts summed over the layers that a stage before the last received for its routers'
/// backward, where a point of `chunk`'s backward still holds them: on a stage between the first and
/// the last, or (`on_the_first`) on the first too, before its first layer's router backward frees
/// them. (Not under interleaving, where the walk counts them; not on the last stage, which makes
/// the sum.)
pub(super) fn received_counts(shape: &StageShape, chunk: &Chunk, on_the_first: bool) -> Option<Term> {
    ((!chunk.first || on_the_first) && !chunk.last && shape.chunks == 1 && shape.statistics > 0.0)
        .then_some(Term { name: RECEIVED_COUNTS, bytes: shape.statistics })
}

/// What a micro-batch keeps of a chunk to its end. The last chunk keeps the targets (cp's and
/// tsp's were read in the forward) and the loss to the loss's gradient, another chunk the output
/// it sent on: to the micro-batch's end, as the program outputs them or another rank reads them
/// last. A mixture's load-balancing statistics stay as the loss's do: the last chunk's sum of the
/// counts, read by the loss's backward, another chunk's layers' (sent on).
fn chunk_end(shape: &StageShape, last: bool, layers: u64) -> Vec<Term> {
    let StepSizes { element, token_split, ids, stream, .. } = shape.sizes;
    let statistics = shape.statistics;
    if last {
        let mut end = Vec::new();
        if token_split == 1 {
            end.push(Term { name: "token ids (targets)", bytes: ids });
        }
        end.push(Term { name: "loss", bytes: element });
        // Made at the head of its backward, sent back to the first stage, freed at the end.
        end.extend(shape.tied_head_part());
        if statistics > 0.0 {
            end.push(Term { name: "expert counts summed over the layers", bytes: statistics });
        }
        end
    } else {
        let mut end = vec![Term { name: "stage output (sent on)", bytes: stream }];
        if statistics > 0.0 && shape.statistics_sent_on(last) {
            end.push(Term {
                name: "each layer's expert counts and router probability sums (sent on)",
                bytes: 2.0 * layers as f64 * statistics,
            });
        }
        end
    }
}

/// The tail of a backward, where its last large weight gradient joins the sums (the embedding's
/// on the first chunk, the first layer's query projection's on another), and on the first chunk
/// beside dp (or cp) and a split vocabulary the embedding rows' slicing just before it; before
/// that, under a split vocabulary, the whole-vocabulary gradient's making (under tsp its scattering
/// from every token's gradient). `w_reads` is what a W's tail still reads under zero bubble.
///
/// Under dp each gradient is all-reduced before it joins its sum, and its unreduced copy is freed
/// only after (the sum is taken right where the reduced gradient is written); by then the
/// activations and activation gradients that computed it are freed. Under tp the embedding's
/// gradient over the whole vocabulary is live as the rank's rows, sliced from it, join their sum.
/// cp all-reduces the gradients as dp does; its first stage keeps the token ids to the end.
fn tail(shape: &StageShape, chunk: &Chunk, w_reads: Option<Term>) -> Vec<Candidate> {
    let StepSizes { element, tokens, vocab, vocab_split, vocab_shard, hidden, query, ids, positions, .. } = shape.sizes;
    let StepSizes { stream, gathered, .. } = shape.sizes;
    let (reduced, scattered, shards) = (shape.reduced, shape.scattered, shape.shards);
    let (joining, grads_so_far, mut held): (f64, f64, Vec<Term>) = if chunk.first {
        let whole = vocab * hidden * element;
        let mut held = chunk.end.clone();
        if shape.cp > 1 {
            held.push(Term { name: "token ids", bytes: ids });
        }
        let head_part = shape.tied_head_part().filter(|_| !reduced && !chunk.last);
        if let Some(head_part) = head_part {
            // Beside a tied table the embedding's part of its gradient (the rank's rows, sliced
            // from the whole vocabulary's under tp, which is freed) is added to the head's part:
            // both are live as their sum joins the running sum, the token ids and the embedding
            // output's gradient freed before.
            held.push(Term {
                name: "the embedding's part of the tied table's gradient",
                bytes: vocab_shard * hidden * element,
            });
            held.push(head_part);
        } else if vocab_split > 1.0 && !reduced {
            held.push(Term { name: "embedding gradient over the whole vocabulary", bytes: whole });
            if shape.tsp > 1 {
                // Scattered from every token's gradient, by their ids (the zigzag's gathered).
                held.push(Term { name: "token ids", bytes: ids });
            }
        } else if !reduced {
            held.push(Term { name: "token ids", bytes: ids });
            held.push(Term { name: "embedding output's gradient", bytes: stream });
        }
        (vocab_shard * hidden * element, chunk.grads * shards, held)
    } else {
        let input_norm = shape.norm * element;
        let mut held =
            vec![Term { name: "positions", bytes: positions }, Term { name: "stage input (received)", bytes: stream }];
        // (Under tsp outside zero bubble the first layer's input gradients are sent back by then.)
        if shape.tsp == 1 || shape.zero_bubble {
            held.push(Term { name: "first layer's attention residual gradient", bytes: stream });
            // (At zero bubble's W under SP, B has reduce-scattered the norm output's gradient,
            // which W reads for the norm's weight, beside the norm's input gradient: split, a
            // stream each.)
            let norm_gradients = if shape.zero_bubble && shape.sequence_parallel() { 2.0 * stream } else { gathered };
            held.push(Term { name: "first layer's attention norm gradient", bytes: norm_gradients });
        }
        if !reduced && shape.tsp > 1 {
            // Under tsp q's weight gradient is made as a contribution to each owner's block, the
            // attention norm's output and q's gradient freed after the last; of the
            // contributions, the rank's own is still live at the tail (with tsp = 2 the other
            // owner's too: not counted).
            held.push(Term {
                name: "first layer's q weight-gradient contribution to the rank's own block",
                bytes: hidden * query * element / shape.tsp as f64,
            });
        } else if !reduced {
            held.push(Term { name: "first layer's attention norm output (recomputed under full)", bytes: gathered });
            held.push(Term { name: "first layer's q gradient", bytes: tokens * query * element });
        }
        // A stage between the first and the last still holds the mixture's summed counts it
        // received from the last here: to the end of the micro-batch's backward, or under zero
        // bubble to B's end, where under full recomputation its recomputed first layer's router
        // probabilities' backward reads them after the tail. (Under interleaving every
        // micro-batch holds them to its end: see the walk's `received`.)
        let full = shape.recompute() == Recompute::Full;
        if full || !shape.zero_bubble {
            held.extend(received_counts(shape, chunk, true));
        }
        held.extend(chunk.end.iter().cloned());
        // (Under tsp the rank's own block of q.)
        (hidden * query * element / shape.tsp as f64, chunk.grads * shards - input_norm, held)
    };
    // Beside dp (or cp) without tp, a tied table's two parts are summed before the sum is
    // reduced: first the two parts and their sum are live (under ZeRO-2 more than the
    // reduce-scatter after; beside an all-reduce as much as the tail after).
    let parts_summed = (shape.tied && chunk.first && !chunk.last && reduced && vocab_split == 1.0).then(|| {
        let mut held = held.clone();
        let part = vocab_shard * hidden * element;
        held.push(Term { name: "the embedding's part of the tied table's gradient", bytes: part });
        held.extend(shape.tied_head_part());
        held.push(Term { name: "the parts' sum, before its dp reduction", bytes: part });
        // (Under zero bubble beside what W's tail still reads.)
        held.extend(w_reads.clone());
        held
    });
    // At the embedding's backward itself (outside tsp), before any slicing: the gradient over the
    // whole vocabulary made from the embedding output's gradient (gathered under SP) by the token
    // ids (under cp the rank's own, freed after it, beside every id), beside a tied table the
    // head's part received.
    let tied_first = shape.tied && chunk.first && !chunk.last;
    let embedding_backward = (chunk.first && vocab_split > 1.0 && shape.tsp == 1).then(|| {
        let mut held = chunk.end.clone();
        held.push(Term { name: "token ids", bytes: ids });
        if shape.cp > 1 {
            held.push(Term { name: "the rank's own token ids", bytes: shape.sizes.local_tokens * ID_BYTES });
        }
        held.extend(shape.tied_head_part().filter(|_| tied_first));
        held.push(Term { name: "embedding output's gradient", bytes: gathered });
        held.push(Term { name: "embedding gradient over the whole vocabulary", bytes: vocab * hidden * element });
        held.extend(w_reads.clone());
        held
    });
    // On a chunk but the first the joining gradient is q's: where ZeRO keeps it whole it is
    // all-reduced in place, as beside dp alone, and joins its sum whole (on the micro-batch's first
    // backward of the chunk the sum is its copy).
    // The same on the first chunk of the embedding's, where ZeRO keeps the table whole.
    let joins_whole = scattered && if chunk.first { !shape.tables_gathered } else { !shape.query_gathered };
    let joining_scattered = scattered && !joins_whole;
    // Where ZeRO splits the joining gradient's rows over some of its replicas but not all (the
    // embedding's or q's over dp, not cp or ep), the reduce-scatter's shard is then all-reduced
    // over the rest and joins its sum: the shard and its reduced copy live, the whole freed (and
    // the micro-batch's gradient made only then).
    let beyond_shard = if chunk.first { shape.table_kept_whole } else { shape.query_weight_kept_whole };
    let split_over_some = joining_scattered && beyond_shard > 0.0;
    let all_reduced_after = split_over_some.then(|| {
        let mut held = held.clone();
        held.push(Term {
            name: "the joining gradient's shard before its all-reduce over the other replicas",
            bytes: joining / shards + beyond_shard,
        });
        held.extend(w_reads.clone());
        held
    });
    if joining_scattered {
        held.push(Term { name: "the joining gradient before its dp reduce-scatter", bytes: joining });
    } else if reduced {
        held.push(Term { name: "the joining gradient before its dp all-reduce", bytes: joining });
    }
    // Under dp × tp (or tsp) the whole-vocabulary embedding gradient is freed once the rank's rows
    // are sliced from it, before their all-reduce (or reduce-scatter, under ZeRO-2 and 3): it is
    // live a step earlier, beside the rows but without their reduced copy in the gradients and the
    // sums (larger than the tail when tp > 2, or under ZeRO).
    // Beside a tied table (without dp, the whole vocabulary's gradient beside both parts) the
    // rows are sliced before they are added to the head's part of its gradient.
    let slicing = (chunk.first && vocab_split > 1.0 && (reduced || tied_first)).then(|| {
        let mut held = held.clone();
        if reduced {
            held.extend(shape.tied_head_part().filter(|_| tied_first));
        }
        held.push(Term { name: "embedding gradient over the whole vocabulary", bytes: vocab * hidden * element });
        if shape.tsp > 1 {
            // Scattered from every token's gradient, by their ids (the zigzag's gathered).
            held.push(Term { name: "token ids", bytes: ids });
        }
        held.extend(w_reads.clone());
        held
    });
    // Under tsp, before that: the whole-vocabulary gradient being scattered from every token's
    // gradient (gathered over the axis) by their ids, both orders' (the zigzag's read there),
    // beside a tied table the head's part received.
    let scattering = (chunk.first && shape.tsp > 1).then(|| {
        let mut held = chunk.end.clone();
        held.extend(shape.tied_head_part().filter(|_| tied_first));
        held.extend([
            Term { name: "embedding gradient over the whole vocabulary", bytes: vocab * hidden * element },
            Term {
                name: "every token's gradient, gathered for the embedding's backward",
                bytes: shape.sizes.every_token,
            },
            Term { name: "token ids, in order and in zigzag order", bytes: 2.0 * ids },
        ]);
        held.extend(w_reads.clone());
        held
    });
    // The joining gradient's reduce-scatter stages it whole (the tail only: the rows are sliced
    // before it starts).
    if joining_scattered {
        held.push(Term { name: "its reduce-scatter's staging", bytes: joining });
    }
    held.extend(w_reads);
    // In the sums and the micro-batch's gradients, the joining gradient's dp shard. Under ZeRO-2
    // its shard is written where its staging was (the planner counts the larger), and joins its
    // sum after.
    let new_sum = if joins_whole { joining } else { joining / shards };
    let (joining, grads_so_far) = (joining / shards, grads_so_far / shards);
    let before_joining = grads_so_far - joining;
    let mut candidates = vec![Candidate {
        name: TAIL,
        so_far: if joining_scattered { before_joining } else { before_joining + joining },
        held,
        new_sum: (!joining_scattered)
            .then_some(Term { name: "the joining gradient's new sum beside the old", bytes: new_sum }),
        pending: match (split_over_some, chunk.first) {
            (true, true) => KeptWholePending::NONE.and_table(),
            (true, false) => KeptWholePending::Q_WEIGHT,
            (false, _) => KeptWholePending::NONE,
        },
        sum_pending: 0.0,
    }];
    if let Some(held) = all_reduced_after {
        candidates.push(Candidate::joining(SHARD_ALL_REDUCED, before_joining + joining, held, joining + beyond_shard));
    }
    if let Some(held) = parts_summed {
        candidates.push(Candidate::made(
            "the embedding's and the head's parts of the tied table's gradient summed",
            before_joining,
            held,
        ));
    }
    if let Some(held) = slicing {
        candidates.push(Candidate::made(
            if reduced {
                "embedding rows sliced for their dp reduction"
            } else {
                "embedding rows sliced to join the head's part of the tied table's gradient"
            },
            before_joining,
            held,
        ));
    }
    if let Some(held) = embedding_backward {
        candidates.push(Candidate::made(
            "the embedding's gradient over the whole vocabulary made",
            before_joining,
            held,
        ));
    }
    if let Some(held) = scattering {
        candidates.push(Candidate::made("the embedding's gradient scattered from every token's", before_joining, held));
    }
    candidates
}

/// The name of the tail of a backward ([`tail`]'s first point).
const TAIL: &str = "tail of a backward";

/// The name of [`tail`]'s point where the joining gradient (the embedding's or q's), split over
/// some of its replicas, is all-reduced over the rest.
const SHARD_ALL_REDUCED: &str = "the joining gradient's shard all-reduced over the other replicas";

/// Beside dp × tp, at the end of the last chunk's backward, as the head's part of a tied table's
/// gradient is reduced over dp to be sent back: every gradient of the chunk made and summed, its
/// input's gradients sent back but kept, the head's part and its reduced copy. (Under zero bubble
/// at the end of W, beside what W's tail still reads: without SP every layer's residual gradients,
/// the first layer's attention residual's among them, which stay to the micro-batch's end.)
fn head_part_reduced(shape: &StageShape, chunk: &Chunk, w_reads: Option<Term>) -> Candidate {
    let StepSizes { element, vocab_shard, hidden, stream, .. } = shape.sizes;
    let mut held = vec![
        Term { name: "positions", bytes: chunk.positions },
        Term { name: "first layer's attention residual gradient", bytes: stream },
        Term { name: "first layer's attention norm's input gradient", bytes: stream },
    ];
    let counted_above = if shape.sequence_parallel() { 0.0 } else { stream };
    held.extend(w_reads.map(|w_reads| Term { bytes: w_reads.bytes - counted_above, ..w_reads }));
    held.extend(chunk.end.iter().cloned());
    held.push(Term { name: "the head's part, reduced over dp", bytes: vocab_shard * hidden * element });
    Candidate::made("the LM head's part of the tied table's gradient reduced over dp", chunk.grads, held)
}
