//! The peak of a pipelined training stage's compiled program, from closed forms, term by term.
//!
//! A pipelined rank (`backend::pipeline`) replays its stage's part of one micro-batch's training
//! program in its schedule's order, on each micro-batch's own copies of the buffers. What a stage
//! holds at once, beside its parameters:
//! - the **running sums** of its gradients over the micro-batches (program outputs are summed): the
//!   first micro-batch's backward creates each sum as its gradient is finished, a later one adds into
//!   it, the old sum and the new one both live for that instruction;
//! - the **gradients of the micro-batch being backwarded**, each a program output, kept until the
//!   end of its backward step;
//! - every **other micro-batch in flight** (its forward done on this stage, its backward not yet):
//!   all that its forward keeps for the backward, given by the schedule (GPipe: all of them; 1F1B:
//!   up to `p - s` on stage `s`);
//! - what the current micro-batch still holds of its forward and of its gradient chain.
//!
//! The stage peaks at the tail of a micro-batch's backward, as its last large weight gradient joins
//! the sums: on the first stage the embedding's (the last gradient of the step), on the others the
//! first layer's query projection's (only that layer's input norm follows). There the current
//! micro-batch has freed its layers' activations but for its first layer's input and gradients. The
//! candidates are each backward's tail (the in-flight count and the sums differ); the peak is the
//! largest. On somewhat more tokens a dense stage peaks inside its first layer's MLP backward, as
//! the gate projection's weight gradient joins its sum (modelled without dp, cp, tsp or full
//! recomputation), and at the head of a backward: the last stage in the loss's backward, or (a
//! dense model without dp, cp, tsp or full recomputation) as the LM head's weight gradient joins
//! its sum; another (the same, without tp) as its last layer's down projection gradient does,
//! or (with tp too) as that layer's MLP norm output's gradients are summed. The head of a
//! backward (all activations and the first gradients live) is smaller wherever the gradients
//! outweigh a micro-batch's activations, as on the models the tests compile with 8 tokens a
//! sequence; on more tokens a stage may peak at other points of it, not modelled, and the result
//! is below the planner's peak (every candidate is the live set at one point of the program, so
//! never above: `tests/cost_training.rs` checks both).
//!
//! Under dp (no ZeRO) each gradient is all-reduced before it joins its sum; at the tail the
//! joining gradient's unreduced copy is live too, and the activations that computed it are freed.
//!
//! Under tp (without SP) each rank keeps its heads' and ffn channels' share of the activations and
//! of the LM head's logits, and on the first stage the embedding's gradient over the whole
//! vocabulary is live at the tail, as the rank's rows are sliced from it into their sum.
//!
//! Megatron SP splits the residual stream on seq over tp; the norms' outputs (and their gradients)
//! are kept all-gathered, and the last layer's output is gathered whole for the final norm.
//! Selective recomputation keeps no attention output; full recomputation keeps each layer's
//! attention residual and output, and recomputes the final norm's (gathered) input and output.
//!
//! Under cp each rank keeps its zigzag share of the tokens' activations but every token's k and v
//! (all-gathered; recomputed so under recomputation, and kept so for zero bubble's W), the last
//! stage every token's logits (over its tp shard of the vocabulary), and the gradients are
//! all-reduced as under dp. Beside tp under SP, the stream is split on seq only inside each layer:
//! between layers (the embedding's output, each layer's output, what a stage sends on and the input
//! gradients it sends back) it is whole over tp, the attention norm runs on it whole and its output
//! gradient is all-reduced; full recomputation keeps that whole copy as the stream, but for the
//! last layer's on the last chunk, which only the final norm reads.
//!
//! Under tsp each rank keeps its share of the tokens' activations as under cp, and per attention
//! owner its q, output and every token's k and v; the MLP ring keeps nothing (its backward
//! recomputes from the norm's output). The embeddings are sharded, the first stage's tail holds
//! the whole-vocabulary embedding gradient with every token's ids, and the last stage keeps the
//! head's input gathered over the sequence and every token's logits. A stage's ranks may peak
//! inside its first layer's attention backward, each at its own point: the backward takes the
//! owners last first, so a rank peaks as o's weight gradient is reduced to it, beside its
//! contributions to its block, the owners' results before it and the activations of the owners
//! after it (more on each later place on the axis); the axis's last rank, whose owner goes first,
//! as o's gradient joins its sum; any rank also as o's reduce to another owner leaves zeros there,
//! beside the activations of the owners after that one (the point where the axis's last rank peaks
//! beside dp, which all-reduces o's gradient before it joins its sum). Beside dp the first stage's
//! other candidate is the embedding rows' slicing, as under dp × tp. The closed form takes the
//! rank's place on the axis. Under zero
//! bubble B runs the MLP ring's backward whole, its weight gradients too (splitting it would run
//! the ring twice): a micro-batch between B and W keeps the ring's weight gradients instead of
//! what they read, W reads only the attention's, and the peak is inside the first layer's W.
//!
//! A mixture of experts (every expert on every rank) keeps no MLP activations (its backward
//! recomputes the routed experts' from the MLP norm's output), and may peak inside its first
//! layer's backward instead of at the tail, as one of that layer's routed-expert gradients (an
//! `[E, h, f_e]` matrix) joins its sum beside the layer's attention activations: the last of the
//! three, or under dp the first, the other two waiting unreduced. Its load-balancing loss keeps
//! each layer's expert counts and router probability sums on the stages but the last (sent on)
//! and their counts' sum on the last, to each micro-batch's end, the loss itself until the
//! backward starts. The last stage sends that sum back to every other in its forward, for their
//! router probabilities' backward: the stage next to it takes those on its gradients' link in the
//! order they were sent, so under GPipe it holds them for the micro-batches in flight too. Under
//! interleaving every micro-batch holds the sum it received to its end on the stage (each chunk's
//! routers read it), and the last stage's other chunks hand their layers' statistics to its last
//! chunk on the same rank instead of sending them on. Under zero bubble B runs the experts' and
//! the router's backward, their weight gradients too (none is a W op): a micro-batch between B
//! and W keeps those gradients, W reads only the attention's inputs and the norms', and a stage
//! may peak inside a B, as its first layer's last expert gradient joins its sum beside the
//! micro-batches between B and W. The received counts' sum is freed after its last reader on the
//! first stage (where the program's free lies) and at the micro-batch's end on the others.
//!
//! Under dp × tp the whole-vocabulary gradient is freed once the rank's rows are sliced from it,
//! before their all-reduce; the first stage's other candidate is that moment (the whole gradient
//! and the rows, not yet reduced nor summed), the larger where tp > 2.
//!
//! Under Megatron's interleaving each stage holds `v` chunks of equal layers, chunk `c` of stage `s`
//! being virtual stage `c·p + s`, each with its own running sums and in-flight micro-batches; a
//! micro-batch's positions are loaded once a stage. A micro-batch's gradients are outputs of its
//! program, so a chunk's stay until the micro-batch's backward is done on every chunk of the
//! stage, and so do the buffers another rank reads last (the output sent on, the input's gradient
//! sent back, the attention norm's input gradient) and, on the last chunk, the targets and loss.
//!
//! Under zero bubble (ZB-H1) the tail is a W's (the weight gradients' part of a backward): a
//! micro-batch whose B is done and W not yet keeps what its weight gradients read, and the
//! residual gradients, which B reads too, stay to the micro-batch's end. Under full
//! recomputation B recomputes each layer's forward, and what W reads of it (q, k, v, gate and
//! up, the norms' outputs) stays with the gradients W reads until W, beside the residual stream
//! the forward kept.
//!
//! Modelled: `pp`, alone or with any of `dp`, `tp` (with or without SP) and `cp`, or with `tsp`
//! alone or beside `dp`; GPipe, 1F1B, interleaved 1F1B and zero-bubble H1, with any
//! recomputation; ZeRO-1
//! anywhere (it splits only the optimizer's state, which the programs do not hold: they are
//! dp's); ZeRO-2 beside dp, with
//! or without tp (±SP) and cp (the sums and gradients are dp's shards, each gradient is
//! reduce-scattered and staged whole, and the stage's other candidate is inside its first layer's
//! backward, as the gate gradient is scattered); ZeRO-3 as ZeRO-2 with the parameters dp's shards
//! too (each layer's gathered weights are freed by then; under full recomputation the first
//! layer's are gathered again for its recomputed forward, and the stage's other candidates are
//! inside that layer's backward, as its down and output projections' gradients are scattered
//! beside the weights they were recomputed with); an untied Llama-family model, dense, or a
//! mixture of experts (no shared expert) with every expert on every rank, beside dp and tp
//! without SP, ZeRO-1 at most, under zero bubble beside tp only.
//! [`pipelined_differences_from_closed_form`] names the terms by which [`super::memory`]'s stage
//! peak (1F1B's in-flight activations by Korthikanti's formulas) differs from it;
//! `tests/cost_training.rs` checks that closed form plus those terms equals the planner's peak to
//! the byte on every stage.

use pleat_ir::AxisName;

use super::compiled::ForwardPhase;
use super::layout::Layout;
use super::memory::{chunk_params, MemoryBreakdown, Term};
use super::model::ModelShape;
use super::step_sizes::{StepSizes, ID_BYTES};
use super::workload::{Recompute, Workload};
use crate::pipeline::{Phase, Schedule, ScheduleKind};

/// The peak of the rank at `tsp_rank` on the tsp axis (0 without one) of stage `stage` (holding
/// `layers` layers) of `schedule` for `model` on `layout`, `workload` one micro-batch
/// (`micro_batch` sequences of `seq`), elements of the model's dtype; `None` outside what is
/// modelled (see the module doc). The phase's `params` are the stage's; its terms name every other
/// buffer live at the peak. (Under tsp a stage's ranks peak apart, each as its own block's
/// gradients are reduced to it, beside the activations of the owners whose backward follows.)
pub fn compiled_stage_peak(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    schedule: &Schedule,
    stage: u32,
    tsp_rank: u64,
    layers: u64,
) -> Option<ForwardPhase> {
    let stages = schedule.stages;
    let (dp, tp, cp) = (layout.degree(AxisName::Dp), layout.degree(AxisName::Tp), layout.degree(AxisName::Cp));
    let tsp = layout.degree(AxisName::Tsp);
    let sequence_parallel = layout.sequence_parallel && tp > 1;
    let modelled = layout.degree(AxisName::Pp) == u64::from(stages)
        && layout.world_size() == u64::from(stages) * dp * tp * cp * tsp
        && stages >= 2
        // tsp beside pp, alone or with dp (ZeRO-1 at most), a dense model.
        && tsp_rank < tsp
        && (tsp == 1 || (tp * cp == 1 && workload.zero <= 1 && model.experts.is_none()))
        // ZeRO-2 and 3 beside dp (with or without tp and cp).
        && (workload.zero <= 1
            || (dp > 1 && (workload.zero == 2 || workload.zero == 3)))
        // A mixture of experts whose every rank holds every expert (no ep, no tsp), without a
        // shared expert, beside dp and tp without SP and ZeRO-1 at most; under zero bubble, not
        // beside dp (whose reductions of the experts' gradients in B are not modelled).
        && model.experts.as_ref().is_none_or(|experts| {
            !experts.shared_expert
                && layout.expert_axis().is_none()
                && workload.zero <= 1
                && !sequence_parallel
                && (schedule.kind != ScheduleKind::ZeroBubbleH1 || dp * cp == 1)
        })
        && !model.tied_embeddings;
    if !modelled {
        return None;
    }
    // tsp's programs shard the embeddings over it.
    let workload = &Workload { tsp_shards_embeddings: workload.tsp_shards_embeddings || tsp > 1, ..workload.clone() };
    let sizes = StepSizes::new(model, layout, workload);
    let StepSizes {
        element,
        tokens,
        token_split,
        local_tokens,
        vocab_split,
        split,
        hidden,
        query,
        kv,
        ffn,
        vocab,
        ids,
        positions,
        stream,
        gathered,
        boundary,
        attention_kept,
        kv_kept,
        kept_layer,
        ..
    } = sizes;
    let reduced = dp > 1 || cp > 1;
    // A mixture of experts' load-balancing loss: each layer's expert counts and router probability
    // sums (`[E]` each), sent on to the last stage, which sums them over the layers (the counts'
    // sum kept for the loss's backward, the loss itself until the backward starts).
    let statistics = match &model.experts {
        Some(experts) if experts.load_balancing_loss => experts.count as f64 * element,
        _ => 0.0,
    };
    // ZeRO-2 reduce-scatters each gradient over dp: the sums and the micro-batch's gradients are
    // its shards, and a gradient is whole (and staged whole) only while it is scattered.
    let scattered = workload.zero >= 2 && dp > 1;
    let shards = if scattered { dp as f64 } else { 1.0 };
    let chunks = schedule.kind.chunks();
    let zero_bubble = schedule.kind == ScheduleKind::ZeroBubbleH1;
    // The MLP's weight gradients B makes under zero bubble (tsp's ring, a mixture's experts and
    // router: none of them is a W op), a layer.
    let mlp_gradients_in_b = if tsp > 1 {
        Some(3.0 * model.hidden as f64 * model.ffn as f64 / tsp as f64 * element)
    } else if model.experts.is_some() {
        Some((model.routed_expert_weights() as f64 / tp as f64 + model.router_params() as f64) * element)
    } else {
        None
    };
    // Under interleaving the last stage's other chunks hand their layers' statistics to its last
    // chunk on the same rank: nothing is sent on, and they are freed once that chunk has summed them.
    let statistics_sent_on = |last: bool| !last && (chunks == 1 || stage + 1 < stages);
    // What one of the stage's chunks (the whole stage but under interleaving) holds, `first` and
    // `last` saying whether it is the model's first or last virtual stage.
    let hold = |first: bool, last: bool, layers: u64| -> ChunkHold {
        let params = chunk_params(model, layout, workload, first, last, layers) * element;
        let grads = params / shards;
        // On the last chunk the loss's backward, the head of a micro-batch's backward there, makes
        // the logits' gradient beside them (and, under tp, gathers the vocabulary-parallel loss's
        // row statistics, three f32 a row from each tp rank): the bytes it adds to the micro-batch.
        let mut loss_backward = None;
        // A micro-batch in flight on this chunk: its inputs, what its layers keep, and on the last
        // one the head's outputs (the final norm's input all-gathered under SP, its output whole);
        // its positions, which every chunk of the stage reads, are counted once a micro-batch.
        let mut in_flight = layers as f64 * kept_layer;
        // Full recomputation beside cp under SP keeps the last layer's output split on the last
        // chunk: the final norm's all-gather of it is recomputed, not kept as the stream.
        if last && workload.recompute == Recompute::Full {
            in_flight -= boundary - stream;
        }
        if first {
            // Under cp the rank's own token ids too.
            let local_ids = if cp > 1 {
                local_tokens * ID_BYTES
            } else if tsp > 1 {
                ids
            } else {
                0.0
            };
            in_flight += ids + local_ids + boundary;
        } else {
            in_flight += boundary;
        }
        if last {
            in_flight += statistics + if statistics > 0.0 { element } else { 0.0 };
        } else if statistics_sent_on(last) {
            in_flight += 2.0 * layers as f64 * statistics;
        }
        if last {
            // Full recomputation recomputes the final norm's input gathered under SP and its output;
            // tsp keeps its output gathered over the sequence (the head's input) instead.
            let final_norm = if workload.recompute == Recompute::Full {
                0.0
            } else if tsp > 1 {
                tokens * hidden * element
            } else {
                (gathered - boundary) + gathered
            };
            // cp and tsp gather every token's logits (back in order) for the loss.
            let logits = if token_split > 1 { tokens } else { local_tokens } * (vocab / vocab_split).ceil() * element;
            in_flight += ids + final_norm + logits + element;
            let rows = logits / (vocab / vocab_split).ceil() / element;
            loss_backward = Some(HeadBackward {
                loss: logits + sizes.loss_row_statistics(rows),
                logits,
                input_gradient: gathered,
                weight_gradient: (vocab / vocab_split).ceil() * hidden * element,
            });
        }
        // The tail of a backward: the gradient joining the sums, what the micro-batch still holds.
        // Under dp each gradient is all-reduced before it joins its sum, and its unreduced copy is
        // freed only after (the sum is taken right where the reduced gradient is written); by then
        // the activations and activation gradients that computed it are freed.
        // Under tp the embedding's gradient over the whole vocabulary is live as the rank's rows,
        // sliced from it, join their sum.
        // cp all-reduces the gradients as dp does; its first stage keeps the token ids to the end.
        // The last chunk keeps the targets (cp's were read in the forward) and the loss to the
        // loss's gradient, another chunk the output it sent on: to the micro-batch's end, as the
        // program outputs them or another rank reads them last.
        // A mixture's load-balancing statistics stay as the loss's are: the last chunk's sum of
        // the counts, read by the loss's backward, another chunk's layers' (sent on).
        let chunk_end = if last {
            let mut end = Vec::new();
            // (cp's and tsp's were read in the forward.)
            if token_split == 1 {
                end.push(Term { name: "token ids (targets)", bytes: ids });
            }
            end.push(Term { name: "loss", bytes: element });
            if statistics > 0.0 {
                end.push(Term { name: "expert counts summed over the layers", bytes: statistics });
            }
            end
        } else {
            let mut end = vec![Term { name: "stage output (sent on)", bytes: boundary }];
            if statistics > 0.0 && statistics_sent_on(last) {
                end.push(Term {
                    name: "each layer's expert counts and router probability sums (sent on)",
                    bytes: 2.0 * layers as f64 * statistics,
                });
            }
            end
        };
        let (joining, grads_so_far, mut held): (f64, f64, Vec<Term>) = if first {
            let whole = vocab * hidden * element;
            let mut held = chunk_end.clone();
            if cp > 1 {
                held.push(Term { name: "token ids", bytes: ids });
            }
            if vocab_split > 1.0 && !reduced {
                held.push(Term { name: "embedding gradient over the whole vocabulary", bytes: whole });
                if tsp > 1 {
                    // Scattered from every token's gradient, by their ids (the zigzag's gathered).
                    held.push(Term { name: "token ids", bytes: ids });
                }
            } else if !reduced {
                held.push(Term { name: "token ids", bytes: ids });
                held.push(Term { name: "embedding output's gradient", bytes: stream });
            }
            ((vocab / vocab_split).ceil() * hidden * element, grads * shards, held)
        } else {
            let input_norm = model.norm.params(model.hidden) as f64 * element;
            let mut held = vec![
                Term { name: "positions", bytes: positions },
                Term { name: "stage input (received)", bytes: boundary },
                Term { name: "first layer's attention residual gradient", bytes: stream },
                Term { name: "first layer's attention norm gradient", bytes: gathered },
            ];
            if !reduced {
                held.push(Term {
                    name: "first layer's attention norm output (recomputed under full)",
                    bytes: gathered,
                });
                held.push(Term { name: "first layer's q gradient", bytes: tokens * query * element });
            }
            // Under full recomputation a stage between the first and the last still holds the
            // mixture's summed counts it received from the last here, its recomputed first
            // layer's router probabilities' backward reading them after.
            // (Under interleaving every micro-batch holds them to its end: see `received` below.)
            if !last && chunks == 1 && statistics > 0.0 && workload.recompute == Recompute::Full {
                held.push(Term { name: "the expert counts summed over the layers (received)", bytes: statistics });
            }
            held.extend(chunk_end.iter().cloned());
            // (Under tsp the rank's own block of q.)
            (hidden * query * element / tsp as f64, grads * shards - input_norm, held)
        };
        // The joining gradient's reduce-scatter stages it whole (the tail only: the rows are sliced
        // before it starts).
        let joining_staging = scattered.then_some(Term { name: "its reduce-scatter's staging", bytes: joining });
        if scattered {
            held.push(Term { name: "the joining gradient before its dp reduce-scatter", bytes: joining });
        } else if reduced {
            held.push(Term { name: "the joining gradient before its dp all-reduce", bytes: joining });
        }
        // In the sums and the micro-batch's gradients, the joining gradient's dp shard.
        let (joining, grads_so_far) = (joining / shards, grads_so_far / shards);
        let biases = if model.qkv_bias { model.query_width() + 2 * model.kv_width() } else { 0 } as f64;
        let attention_weights = 2.0 * hidden * (query + kv) + biases;
        let norm = model.norm.params(model.hidden) as f64;
        let gate = hidden * ffn * element;
        let table = if first { (vocab / vocab_split).ceil() * hidden * element } else { 0.0 };
        // Inside the first layer's backward: the chunk's inputs and what its end keeps.
        let mut first_layer_held = vec![Term { name: "positions", bytes: positions }];
        if first {
            first_layer_held.push(Term { name: "token ids", bytes: ids });
            first_layer_held.push(Term { name: "embedding output (the first layer's input)", bytes: boundary });
        } else {
            first_layer_held.push(Term { name: "stage input (received)", bytes: boundary });
        }
        first_layer_held.extend(chunk_end.iter().cloned());
        // Under ZeRO-2 a stage may peak inside its first layer's backward instead, as the gate
        // projection's gradient (the largest but the embedding's) is reduce-scattered: that
        // layer's attention activations are still live, and of its gradients only the down and
        // up projections' are done (and none of the embedding's).
        // Inside the first layer's backward, before its attention's: that layer's attention
        // activations (which full recomputation recomputes only for the attention's own backward).
        let attention_live = if workload.recompute == Recompute::Full { 0.0 } else { 1.0 };
        let first_layer_attention = [
            Term { name: "first layer's attention norm output", bytes: attention_live * gathered },
            Term {
                // (Under cp every token's k and v, all-gathered.)
                name: "first layer's q, k and v after RoPE",
                bytes: attention_live * (local_tokens * query + kv_kept) * element,
            },
            Term {
                name: "first layer's attention output",
                bytes: attention_live * local_tokens * attention_kept * element,
            },
            Term { name: "first layer's attention residual", bytes: stream },
        ];
        let mid = scattered.then(|| {
            let so_far = grads - (gate + (attention_weights + 2.0 * norm) * element + table) / shards;
            let mut held = first_layer_held.clone();
            held.extend(first_layer_attention.iter().cloned());
            held.extend([
                Term { name: "first layer's output gradient", bytes: stream },
                Term { name: "first layer's MLP norm output gradient", bytes: gathered },
                Term { name: "first layer's gate gradient before its dp reduce-scatter", bytes: gate },
                Term { name: "its reduce-scatter's staging", bytes: gate },
            ]);
            (so_far, held)
        });
        // A dense stage may peak inside its first layer's MLP backward on more tokens, as the gate
        // projection's weight gradient joins its sum: the layer's attention activations and MLP
        // norm output are live, with the norm output's gradient from up, gate's output gradient
        // (its input gradient is next) and the layer's output gradient; of its gradients only the
        // down, up and gate projections' are done. (Not modelled beside dp or cp, which reduce
        // the gradient first; under tsp, whose ring makes the MLP's gradients; or under full
        // recomputation, which recomputes the MLP.)
        let gate_joining = (model.experts.is_none() && !reduced && tsp == 1 && workload.recompute != Recompute::Full)
            .then(|| {
                let so_far = grads - (attention_weights + 2.0 * norm) * element - table;
                let mut held = first_layer_held.clone();
                held.extend(first_layer_attention.iter().cloned());
                held.extend([
                    Term { name: "first layer's MLP norm output and its gradient from up", bytes: 2.0 * gathered },
                    Term { name: "first layer's gate output gradient", bytes: local_tokens * ffn * element },
                    Term { name: "first layer's output gradient", bytes: stream },
                ]);
                (gate, so_far, held)
            });
        // At the head of a micro-batch's backward on a chunk before the last, the chunk's last
        // layer's down projection's weight gradient joins its sum: the micro-batch holds all it
        // holds in flight, beside the output gradient it received and the SiLU product's
        // gradient. (Modelled as the gate's joining is, and without tp, under which the output
        // gradient has another copy there.)
        let down_joining = (gate_joining.is_some() && tp == 1).then(|| {
            let held = vec![
                Term { name: "what it holds in flight", bytes: in_flight },
                Term { name: "its output gradient (received)", bytes: boundary },
                Term { name: "its last layer's SiLU product gradient", bytes: local_tokens * ffn * element },
            ];
            (gate, held)
        });
        // Then, as that layer's MLP norm output's gradients from gate and up are summed: its
        // down and up gradients made, its gate, up and their product freed, beside the output
        // gradient, gate's output gradient (its weight gradient is next) and the two input
        // gradients and their sum.
        let mlp_norm_gradient = gate_joining.is_some().then(|| {
            let held = vec![
                Term {
                    name: "what it holds in flight but its last layer's gate, up and their product",
                    bytes: in_flight - 3.0 * local_tokens * ffn * element,
                },
                Term { name: "its output gradient (received)", bytes: boundary },
                Term { name: "its last layer's gate output gradient", bytes: local_tokens * ffn * element },
                Term {
                    name: "its last layer's MLP norm output's gradients from gate and up, and their sum",
                    bytes: 3.0 * gathered,
                },
            ];
            (2.0 * gate, held)
        });
        // A mixture of experts may peak inside its first layer's backward instead, as one of that
        // layer's routed-expert gradients (`[E, h, f_e]` matrices, larger than a dense projection)
        // joins its sum: the layer's attention activations are still live, and of its gradients
        // only the router's and the experts' are done. Without dp it is the last of the three;
        // under dp the first, reduced while the other two wait unreduced beside it (the mixture's
        // backward makes all three at once), the MLP norm's output freed.
        let experts_joining = model.experts.as_ref().map(|experts| {
            let matrix = (experts.count * model.expert_weights() / 3) as f64 / split * element;
            let waiting = if reduced { 2.0 * matrix } else { 0.0 };
            let so_far = grads - (attention_weights + 2.0 * norm) * element - table - waiting;
            let mut held = first_layer_held.clone();
            held.extend(first_layer_attention.iter().cloned());
            held.extend([
                Term {
                    name: "first layer's MLP norm output (but under dp) and its gradient",
                    bytes: if reduced { gathered } else { 2.0 * gathered },
                },
                Term { name: "first layer's output gradient", bytes: stream },
            ]);
            if reduced {
                held.push(Term { name: "the expert gradients before their dp all-reduce", bytes: 3.0 * matrix });
            }
            // A stage between the first and the last still holds the summed counts it received
            // from the last here; the first has freed them, its first layer's router
            // probabilities' backward, which runs before the experts', having read them last.
            if !first && !last && chunks == 1 && statistics > 0.0 {
                held.push(Term { name: "the expert counts summed over the layers (received)", bytes: statistics });
            }
            (matrix, so_far, held)
        });
        // Under tsp a stage may peak inside its first layer's attention backward instead. That
        // backward takes the owners in reverse (the last first): for each, the rank's
        // contributions to the owner's q, k, v and o gradients (its block: the layer's attention
        // weights over the owners), then their reduces to the owner, o's first; a reduce leaves
        // zeros on the other ranks, and the owners' results are summed as they come (the rank's
        // own gradient is its own owner's). The layer's attention norm and residual gradients are
        // live throughout. The candidates are below.
        let tsp_attention = if tsp > 1 {
            let owners = tsp as f64;
            let block = attention_weights / owners * element;
            let o_block = hidden * query / owners * element;
            let mut gradients = vec![
                Term { name: "first layer's attention norm output gradient", bytes: stream },
                Term { name: "first layer's attention residual gradient", bytes: stream },
            ];
            // Under zero bubble this is W: B made the layer's input gradients, and the first
            // layer's attention norm's (sent back) and every layer's attention residual's (which
            // B reads too) stay to the micro-batch's end.
            // Under either recomputation W still reads every layer's q, k and v (every token's k
            // and v), which B recomputed for it.
            let recomputing = workload.recompute != Recompute::None;
            if zero_bubble {
                gradients.extend([
                    Term { name: "first layer's attention norm's input gradient", bytes: boundary },
                    Term {
                        name: "the later layers' attention residual gradients",
                        bytes: (layers as f64 - 1.0) * stream,
                    },
                ]);
                if recomputing {
                    gradients.push(Term {
                        name: "every layer's q, k and v, kept or recomputed for W",
                        bytes: layers as f64 * (local_tokens * query + kv_kept) * element,
                    });
                }
            }
            // What an owner whose backward is still to come keeps: its q, attention's output and
            // every token's k and v as the forward kept them (none under full recomputation,
            // which recomputes each at its owner's turn); under zero bubble what W reads of it,
            // q's, k's and v's gradients and attention's output but under recomputation (its q,
            // k and v counted above).
            let later_owner_activations = if zero_bubble {
                let output = if recomputing { 0.0 } else { query };
                local_tokens * (output + query + 2.0 * kv) * element / owners
            } else if workload.recompute == Recompute::Full {
                0.0
            } else {
                (local_tokens * (query + attention_kept) + kv_kept) * element / owners
            };
            // As o's gradient of an owner is reduced, the rank holds the owners' results before
            // that one, summed (a block), its contributions to that owner's block, the reduce's
            // own buffers, and, with `after` owners still to come, their activations and the
            // attention norm's output they read. Of the layer's gradients only its attention's
            // and its input norm's are not done.
            let reducing_so_far = grads - block - norm * element - table;
            let reducing = |contributions: &'static str, reduce: Term, after: u64| {
                let mut held = first_layer_held.clone();
                held.extend(gradients.iter().cloned());
                held.extend([
                    Term { name: "the owners' reduced attention weight gradients before it, summed", bytes: block },
                    Term { name: contributions, bytes: block },
                    reduce,
                ]);
                if after > 0 {
                    held.push(Term { name: "first layer's attention norm output", bytes: gathered });
                    held.push(Term {
                        name: "the activations of the owners still to come",
                        bytes: after as f64 * later_owner_activations,
                    });
                }
                held
            };
            let mut candidates = Vec::new();
            for point in tsp_o_reduces(tsp, tsp_rank, o_block) {
                let name = if point.to_this_rank {
                    "first layer's o gradient reduced to this rank, its owner"
                } else {
                    "first layer's o gradient reduced to another owner"
                };
                candidates.push((name, reducing_so_far, reducing(point.contributions, point.reduce, point.after), 0.0));
            }
            // - As o's gradient joins its sum, on the axis's last rank (but beside dp, which
            //   all-reduces it first): the results summed (a block), the first owner's q, k and v
            //   contributions, o's result for the first owner (zeros but on it), and o's gradient
            //   done.
            if !reduced {
                let so_far = grads - (block - o_block) - norm * element - table;
                let mut held = first_layer_held.clone();
                held.extend(gradients);
                held.extend([
                    Term { name: "the owners' reduced attention weight gradients, summed", bytes: block },
                    Term { name: "the first owner's q, k and v contributions", bytes: block - o_block },
                    Term { name: "o's reduced gradient for the first owner", bytes: o_block },
                ]);
                candidates.push(("first layer's o gradient joins its sum", so_far, held, o_block));
            }
            candidates
        } else {
            Vec::new()
        };
        // ZeRO-3 under full recomputation gathers the first layer's weights again for its
        // recomputed forward: a stage may peak inside that layer's backward, as its down
        // projection's gradient (none of the layer's done yet) is reduce-scattered, its MLP norm's,
        // gate's and up's weights gathered whole beside the recomputed norm output, gate and up,
        // and the gradient of the SiLU product; or as its output projection's gradient is (the
        // MLP's done), its attention norm's, q's, k's and v's weights gathered beside the
        // recomputed norm output, q, k and v, and the attention output's gradient.
        let mut regathered = Vec::new();
        if scattered && workload.zero >= 3 && workload.recompute == Recompute::Full {
            let mut held = first_layer_held.clone();
            held.extend([
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
            let so_far = grads - (3.0 * gate + (attention_weights + 2.0 * norm) * element + table) / shards;
            regathered.push(("first layer's down gradient reduce-scattered, its MLP regathered", so_far, held));
            let output_projection = hidden * query * element;
            let mut held = first_layer_held.clone();
            held.extend([
                Term { name: "first layer's attention residual gradient", bytes: stream },
                Term { name: "first layer's attention output gradient", bytes: local_tokens * query * element },
                Term { name: "first layer's attention norm weight, gathered", bytes: norm * element },
                Term { name: "first layer's attention norm output, recomputed", bytes: gathered },
                Term {
                    name: "first layer's q, k and v weights, gathered",
                    bytes: hidden * (query + 2.0 * kv) * element,
                },
                Term {
                    name: "first layer's q, k and v, recomputed",
                    bytes: local_tokens * (query + 2.0 * kv) * element,
                },
                Term {
                    name: "first layer's output projection gradient before its reduce-scatter",
                    bytes: output_projection,
                },
                Term { name: "its reduce-scatter's staging", bytes: output_projection },
            ]);
            let so_far = grads - ((attention_weights + norm) * element + table) / shards;
            regathered.push(("first layer's o gradient reduce-scattered, its attention regathered", so_far, held));
        }
        // What stays after the chunk's backward until the micro-batch's backward ends on the stage:
        // the buffers whose last reader is another rank (the output sent on, the input's gradient
        // sent back and the attention norm's input gradient summed into it) or an output.
        // (Beside cp under SP both are gradients of the whole boundary, sent back whole.)
        let mut remains = vec![
            Term { name: "first layer's attention residual gradient", bytes: boundary },
            Term { name: "first layer's attention norm's input gradient", bytes: boundary },
        ];
        remains.extend(chunk_end.iter().cloned());
        // Under dp × tp (or tsp) the whole-vocabulary embedding gradient is freed once the rank's
        // rows are sliced from it, before their all-reduce (or reduce-scatter, under ZeRO-2 and 3): it is
        // live a step earlier, beside the rows but without their reduced copy in the gradients and
        // the sums (larger than the tail when tp > 2, or under ZeRO).
        let slicing = (first && vocab_split > 1.0 && reduced).then(|| {
            let mut held = held.clone();
            held.push(Term { name: "embedding gradient over the whole vocabulary", bytes: vocab * hidden * element });
            if tsp > 1 {
                // Scattered from every token's gradient, by their ids (the zigzag's gathered).
                held.push(Term { name: "token ids", bytes: ids });
            }
            held
        });
        held.extend(joining_staging);
        // Zero bubble splits each backward into B (input gradients) and W (weight gradients, later).
        // Between the two a micro-batch keeps what W reads: per layer the inputs of its weight
        // gradients (both norms' outputs and inputs, attention's output, the SiLU product) and
        // their output gradients (q, k, v, gate, up, both norms' outputs, both residuals); beside
        // them its input (the stage's, or the embedding's output), its first layer's attention
        // norm's input gradient, and on the last chunk the final norm's output and gradient, the
        // logits' gradient, the targets and the loss. The residual gradients, which B reads too,
        // stay to the micro-batch's end, so W's tail holds them as well.
        // Selective recomputation keeps q, k and v after RoPE in place of attention's output, which
        // W recomputes from them for the output projection's gradient.
        let selective = workload.recompute == Recompute::Selective;
        let attention_for_w = if selective { query + 2.0 * kv } else { query };
        let full = workload.recompute == Recompute::Full;
        // Under full recomputation, what B recomputed for W and the gradients W reads: both
        // norms' outputs and output gradients, the attention residual's gradient, gate and up
        // and their gradients, q, k and v and theirs.
        // (Beside cp under SP one of these stream-sized gradients is whole: the attention norm runs
        // on the whole boundary there, and W reads its output gradient all-reduced.)
        // Under tsp B runs the MLP ring's backward whole, and a mixture's experts' and router's
        // backward, their weight gradients too: a micro-batch between B and W keeps those
        // gradients (outputs) instead of what they read (the MLP norm's output and its gradient,
        // gate, up and their product).
        // Per layer: the attention norm's output and its gradient, the attention residual and its
        // gradient, the layer's output and the MLP's input gradient; q's, k's and v's gradients,
        // and attention's output (under either recomputation q, k and v, every token's k and v,
        // which B recomputed under full).
        let attention_for_w = if mlp_gradients_in_b.is_some() && full { query + 2.0 * kv } else { attention_for_w };
        let mut per_layer = if let Some(mlp_gradients) = mlp_gradients_in_b {
            2.0 * gathered
                + 4.0 * stream
                + local_tokens * (attention_for_w + query + 2.0 * kv) * element
                + mlp_gradients
        } else if full {
            4.0 * gathered + boundary + local_tokens * (4.0 * ffn + 2.0 * query + 4.0 * kv) * element
        } else {
            // (Beside cp under SP the layer's output and the attention norm output's gradient,
            // all-reduced over tp, are whole.)
            4.0 * gathered
                + 2.0 * stream
                + 2.0 * boundary
                + local_tokens * (attention_for_w + query + 3.0 * ffn + 2.0 * kv) * element
        };
        // Under cp the k and v kept (or recomputed) for W are every token's, all-gathered.
        if selective || full {
            per_layer += (kv_kept - 2.0 * local_tokens * kv) * element;
        }
        let mut between = layers as f64 * per_layer + 2.0 * boundary;
        // Under SP the projections' output gradients W reads are the gathered ones, and the first
        // layer's attention residual gradient is kept beside them, the last layer's output
        // gathered for the final norm.
        if sequence_parallel {
            between += boundary;
            if last {
                between += gathered - boundary;
            }
        }
        // ZeRO-3 gathers the final norm's weight again for the recomputed head, and W reads it.
        let regathered_final_norm = if full && scattered && workload.zero >= 3 && last { norm * element } else { 0.0 };
        // Full recomputation keeps beside those the residual stream its forward kept (but, under
        // SP, the last layer's output on the last chunk: only its gathered copy, counted above),
        // and each layer's output gradient (the last one's on the last chunk is the final norm's
        // input gradient, counted above).
        if full && mlp_gradients_in_b.is_none() {
            between += regathered_final_norm;
            let last_layers = f64::from(u8::from(last));
            between += layers as f64 * kept_layer + (layers as f64 - last_layers) * stream;
            if sequence_parallel {
                between -= last_layers * stream;
            }
        }
        // (The first stage runs each W right after its B, forwards apart, so no other micro-batch
        // is between there at a W's tail; its between is written by analogy, with the token ids.)
        if first {
            between += ids;
        }
        // A mixture's statistics stay to the micro-batch's end: its layers' (sent on), and on a
        // stage between the first and the last the counts' sum it received (the program frees
        // that after its last reader on the first stage, which holds the model's first layer,
        // and the pipeline releases it at the micro-batch's end elsewhere).
        if !last && statistics > 0.0 {
            let received = if stage > 0 { statistics } else { 0.0 };
            between += 2.0 * layers as f64 * statistics + received;
        }
        if last && tsp > 1 {
            // The head's input gathered over the sequence (but under full recomputation), its
            // gradient, every token's logits' gradient over the rank's vocabulary shard, the loss
            // (the targets were read in the forward).
            let logits = tokens * (vocab / vocab_split).ceil() * element;
            let head_input = if full { 0.0 } else { tokens * hidden * element };
            between += head_input + gathered + logits + element;
        } else if last {
            let logits = local_tokens * (vocab / vocab_split).ceil() * element;
            // cp's targets were read in the forward.
            let targets = if cp == 1 { ids } else { 0.0 };
            between += targets + element + logits + 2.0 * gathered;
            // A mixture's loss is two: the cross-entropy and the load-balancing loss, and the
            // latter's backward reads the counts' sum.
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
        let mut kept_for_weights = if sequence_parallel { 0.0 } else { residual_gradients * layers as f64 * stream };
        // Under selective recomputation W's tail still holds every layer's q, k and v (and the
        // positions, on the first stage too); under full recomputation every layer's recomputed
        // gate and up projections too.
        kept_for_weights += regathered_final_norm;
        if selective || full {
            // (Under cp every token's k and v, all-gathered; under tsp no gate or up, whose weight
            // gradients B made.)
            let recomputed = if full && mlp_gradients_in_b.is_none() { query + 2.0 * ffn } else { query };
            kept_for_weights += layers as f64 * (local_tokens * recomputed + kv_kept) * element;
            if first {
                kept_for_weights += positions;
            }
        }
        // Beside cp under SP, B's last step sends the first layer's input gradients back whole: the
        // attention norm's input gradient and the residual's, which W's tail holds in place of the
        // residual gradient's split sum (no other rank's B follows on the first stage).
        let input_gradients_at_w = if sequence_parallel && cp > 1 && !first { 2.0 * boundary - stream } else { 0.0 };
        ChunkHold {
            params,
            grads,
            in_flight,
            loss_backward,
            joining,
            grads_so_far,
            held,
            slicing,
            remains,
            between,
            kept_for_weights,
            input_gradients_at_w,
            experts_joining,
            gate_joining,
            down_joining: down_joining.filter(|_| !last),
            mlp_norm_gradient: mlp_norm_gradient.filter(|_| !last),
            made_in_b: mlp_gradients_in_b.map(|per_layer| layers as f64 * per_layer),
            later_w_reads: (layers as f64 - 1.0) * (per_layer - mlp_gradients_in_b.unwrap_or(0.0)),
            tsp_attention,
            mid,
            regathered,
        }
    };
    // Chunk c of stage s is virtual stage c·p + s (Megatron's interleaving), of equal layers.
    if layers % u64::from(chunks) != 0 {
        return None;
    }
    let virtual_stages = stages * chunks;
    let holds: Vec<ChunkHold> = (0..chunks)
        .map(|chunk| {
            let virtual_stage = chunk * stages + stage;
            hold(virtual_stage == 0, virtual_stage + 1 == virtual_stages, layers / u64::from(chunks))
        })
        .collect();
    // ZeRO-3 keeps the rank's dp shard of the stage's parameters; each layer's gathered weights
    // are freed by the tails modelled here.
    let param_shards = if workload.zero >= 3 && dp > 1 { dp as f64 } else { 1.0 };
    let params = holds.iter().map(|hold| hold.params).sum::<f64>() / param_shards;
    // The stage holding the model's last layers also sums the loss.
    let loss_sum = if stage + 1 == stages { element } else { 0.0 };
    let steps = schedule.per_stage.get(stage as usize)?;
    let mut best: Option<ForwardPhase> = None;
    // Where a micro-batch's last weight gradient is made: its backward, or zero bubble's W.
    let (input_phase, tail_phase) =
        if zero_bubble { (Phase::BackwardInput, Phase::BackwardWeight) } else { (Phase::Backward, Phase::Backward) };
    for (at, step) in steps.iter().enumerate() {
        // A mixture's B under zero bubble makes the experts' gradients: a candidate too.
        let in_b = zero_bubble && step.phase == input_phase && model.experts.is_some();
        if step.phase != tail_phase && !in_b {
            continue;
        }
        let done = |chunk: u32, phase: Phase| {
            steps[..at].iter().filter(|before| before.chunk == chunk && before.phase == phase).count() as f64
        };
        let current = &holds[step.chunk as usize];
        // Every other micro-batch whose forward on a chunk is done and its backward there not yet,
        // and the running sums of the chunks some backward has finished (the current one's so far).
        let (mut others, mut other_sums) = (0.0, 0.0);
        for (chunk, hold) in (0u32..).zip(&holds) {
            let current = f64::from(chunk == step.chunk);
            if zero_bubble {
                // At a W the current micro-batch's B is done: it is the one between B and W there;
                // in a B it is still in flight.
                let (in_flight_current, between_current) = if in_b { (current, 0.0) } else { (0.0, current) };
                others += (done(chunk, Phase::Forward) - done(chunk, input_phase) - in_flight_current) * hold.in_flight;
                others += (done(chunk, input_phase) - done(chunk, tail_phase) - between_current) * hold.between;
            } else {
                others += (done(chunk, Phase::Forward) - done(chunk, tail_phase) - current) * hold.in_flight;
            }
            if chunk != step.chunk && done(chunk, tail_phase) > 0.0 {
                other_sums += hold.grads;
            }
        }
        // Per micro-batch begun on the stage and not yet done: its positions (the current one's
        // are in its held buffers, but on the first chunk of an interleaved stage), and of each
        // chunk it has finished the backward of, the gradients (outputs of its program, freed once
        // its backward is done on every chunk) and what remains.
        let mut unfinished_grads = 0.0;
        let mut remains = 0.0;
        for micro_batch in 0..schedule.micro_batches {
            let of = |phase: Phase| -> Vec<u32> {
                steps[..at]
                    .iter()
                    .filter(|before| before.micro_batch == micro_batch && before.phase == phase)
                    .map(|before| before.chunk)
                    .collect()
            };
            let (forwarded, finished) = (of(Phase::Forward), of(tail_phase));
            if forwarded.is_empty() || finished.len() == chunks as usize {
                continue;
            }
            if micro_batch != step.micro_batch || (chunks > 1 && step.chunk == 0 && stage == 0) {
                others += positions;
            }
            for &chunk in &finished {
                let hold = &holds[chunk as usize];
                unfinished_grads += hold.grads;
                remains += hold.remains.iter().map(|term| term.bytes).sum::<f64>();
            }
        }
        // A mixture's expert counts summed over the layers, which the last stage sends every
        // earlier one in its forward for their router probabilities' backward: the stage next to
        // it takes them on the link its gradients come on, in the order they were sent, so as the
        // current micro-batch's backward starts it has taken those of every micro-batch the last
        // stage forwarded before that backward; the ones still in flight here hold theirs.
        // (Under zero bubble the gradients come in B: at a W the last taken is the latest B's, and
        // the micro-batches between B and W hold theirs in `between`.)
        let gradient_taken = if zero_bubble {
            steps[..=at].iter().rev().find(|before| before.phase == input_phase).map(|before| before.micro_batch)
        } else {
            Some(step.micro_batch)
        };
        if let (true, Some(taken)) = (statistics > 0.0 && chunks == 1 && stage + 2 == stages, gradient_taken) {
            let last_steps = schedule.per_stage.get(stages as usize - 1)?;
            let backward_there =
                last_steps.iter().position(|there| there.micro_batch == taken && there.phase == input_phase)?;
            for micro_batch in (0..schedule.micro_batches).filter(|&other| other != step.micro_batch) {
                let forwarded_there = last_steps[..backward_there]
                    .iter()
                    .any(|there| there.micro_batch == micro_batch && there.phase == Phase::Forward);
                let here = |phase: Phase| {
                    steps[..at].iter().any(|before| before.micro_batch == micro_batch && before.phase == phase)
                };
                if forwarded_there && here(Phase::Forward) && !here(input_phase) {
                    others += statistics;
                }
            }
        }
        // Under interleaving a stage before the last holds each micro-batch's summed counts from
        // their receipt to the micro-batch's end (every chunk's routers read them): the stage next
        // to the last takes them on its gradients' link, so it holds those sent before the
        // gradient its current step takes; another takes them at a micro-batch's first backward.
        // On the last stage, a micro-batch forwarded on another chunk and not yet on the last one
        // holds that chunk's layers' statistics.
        let mut received = 0.0;
        if statistics > 0.0 && chunks > 1 {
            let last_steps = schedule.per_stage.get(stages as usize - 1)?;
            let forwarded = |steps: &[crate::pipeline::schedule::Step], micro_batch: u32, chunk: u32| {
                steps.iter().any(|there| {
                    there.micro_batch == micro_batch && there.chunk == chunk && there.phase == Phase::Forward
                })
            };
            let gradient_sent_at = last_steps.iter().position(|there| {
                there.micro_batch == step.micro_batch && there.chunk == step.chunk && there.phase == tail_phase
            });
            for micro_batch in 0..schedule.micro_batches {
                let backwards = steps[..at]
                    .iter()
                    .filter(|before| before.micro_batch == micro_batch && before.phase == tail_phase)
                    .count();
                let begun = steps[..at].iter().any(|before| before.micro_batch == micro_batch);
                if stage + 1 == stages {
                    for chunk in 0..chunks - 1 {
                        if forwarded(&steps[..at], micro_batch, chunk)
                            && !forwarded(&steps[..at], micro_batch, chunks - 1)
                        {
                            others += 2.0 * (layers / u64::from(chunks)) as f64 * statistics;
                        }
                    }
                    continue;
                }
                let holds = if micro_batch == step.micro_batch {
                    true
                } else if !begun || backwards == chunks as usize {
                    false
                } else if stage + 2 == stages {
                    gradient_sent_at.is_some_and(|sent| forwarded(&last_steps[..sent], micro_batch, chunks - 1))
                } else {
                    backwards > 0
                };
                if holds {
                    received += statistics;
                }
            }
        }
        // Under zero bubble a W on a stage between the first and the last still holds its
        // micro-batch's received counts' sum (released at the micro-batch's end; full
        // recomputation's held terms count it already).
        if zero_bubble
            && !in_b
            && statistics > 0.0
            && stage > 0
            && stage + 1 < stages
            && workload.recompute != Recompute::Full
        {
            received += statistics;
        }
        if in_b {
            // Inside B, as the first layer's last expert gradient joins its sum: the stage's B
            // gradients all made (the later layers' and this one's) and summed, the W gradients'
            // sums if a W has run, the later layers' inputs for W, and the first layer's
            // activations and MLP gradients as the experts' backward leaves them.
            let (Some(made_in_b), Some((matrix, _, held))) = (current.made_in_b, current.experts_joining.as_ref())
            else {
                continue;
            };
            let w_sums = if done(step.chunk, tail_phase) > 0.0 { current.grads - made_in_b } else { 0.0 };
            let mut terms = vec![
                Term {
                    name: "gradient running sums (B's made, W's once a W has run)",
                    bytes: other_sums + w_sums + made_in_b + loss_sum,
                },
                Term { name: "the micro-batch's B gradients", bytes: made_in_b },
                Term { name: "other micro-batches in flight or between B and W", bytes: others },
                Term { name: "the later layers' inputs for W", bytes: current.later_w_reads },
            ];
            if received > 0.0 {
                terms.push(Term {
                    name: "the micro-batches' received expert counts summed over the layers",
                    bytes: received,
                });
            }
            terms.extend(held.iter().cloned());
            if done(step.chunk, input_phase) > 0.0 {
                terms.push(Term { name: "the joining expert gradient's new sum beside the old", bytes: *matrix });
            }
            let phase = ForwardPhase { name: "first layer's expert gradient joins its sum in B", params, terms };
            if best.as_ref().is_none_or(|best| phase.bytes() > best.bytes()) {
                best = Some(phase);
            }
            continue;
        }
        let first_backward = done(step.chunk, tail_phase) == 0.0;
        // A candidate where the current micro-batch has made `so_far` of the chunk's gradients:
        // the running sums (on its first backward of the chunk, only those made so far), the
        // micro-batches' gradients, the others in flight, what finished chunks keep, and `held`.
        let candidate = |name: &'static str, so_far: f64, held: &[Term]| {
            let sums = if first_backward {
                Term { name: "gradient running sums, created so far", bytes: other_sums + so_far + loss_sum }
            } else {
                Term { name: "gradient running sums", bytes: other_sums + current.grads + loss_sum }
            };
            let mut terms = vec![
                sums,
                Term { name: "the micro-batches' gradients so far", bytes: unfinished_grads + so_far },
                Term { name: "other micro-batches in flight", bytes: others },
                Term { name: "what finished chunks keep to the micro-batch's end", bytes: remains },
            ];
            if received > 0.0 {
                terms.push(Term {
                    name: "the micro-batches' received expert counts summed over the layers",
                    bytes: received,
                });
            }
            terms.extend(held.iter().cloned());
            ForwardPhase { name, params, terms }
        };
        // The tail: the joining gradient joins its sum. Under ZeRO-2 its shard is written where its
        // staging was (the planner counts the larger), and joins its sum after.
        let before_joining = current.grads_so_far - current.joining;
        let mut tail_held = current.held.clone();
        if !scattered && !first_backward {
            tail_held.push(Term { name: "the joining gradient's new sum beside the old", bytes: current.joining });
        }
        // W's tail, and the embedding rows' slicing in it, hold what W still reads.
        let w_reads = zero_bubble.then_some(Term {
            name: "what W still reads (residual gradients; q, k, v if recomputed; gate, up if full)",
            bytes: current.kept_for_weights,
        });
        tail_held.extend(w_reads.clone());
        if zero_bubble && current.input_gradients_at_w > 0.0 {
            tail_held.push(Term {
                name: "first layer's input gradients, sent back whole (beyond the residual gradient's split sum)",
                bytes: current.input_gradients_at_w,
            });
        }
        let joined = if scattered { 0.0 } else { current.joining };
        let mut candidates = vec![candidate("tail of a backward", before_joining + joined, &tail_held)];
        if let Some(held) = &current.slicing {
            let held: Vec<Term> = held.iter().cloned().chain(w_reads).collect();
            candidates.push(candidate("embedding rows sliced for their dp reduction", before_joining, &held));
        }
        if let Some((so_far, held)) = &current.mid {
            candidates.push(candidate("first layer's gate gradient reduce-scattered", *so_far, held));
        }
        // (Under zero bubble the experts' gradients join their sums in B, not at a W.)
        if let Some((matrix, so_far, held)) = current.experts_joining.as_ref().filter(|_| !zero_bubble) {
            let mut held = held.clone();
            if !first_backward {
                held.push(Term { name: "the joining expert gradient's new sum beside the old", bytes: *matrix });
            }
            candidates.push(candidate("first layer's expert gradient joins its sum", *so_far, &held));
        }
        // The head of the micro-batch's backward on the last chunk: all it holds in flight, its
        // positions, and the loss's backward's own buffers; none of its gradients made yet.
        if let Some(head) = current.loss_backward.filter(|_| !zero_bubble) {
            let held = [
                Term { name: "its positions", bytes: positions },
                Term { name: "what it holds in flight", bytes: current.in_flight },
                Term { name: "the logits' gradient (and under tp the loss's row statistics)", bytes: head.loss },
            ];
            candidates.push(candidate("the loss's backward", 0.0, &held));
            // Then, as the LM head's weight gradient joins its sum: the logits freed, their
            // gradient and the head's input gradient beside it. (Not modelled beside dp, which
            // reduces the gradient first; beside cp or tsp, whose logits' gradient is sliced back
            // to the rank's tokens; under full recomputation, which recomputes the final norm
            // for it; or for a mixture, whose load-balancing loss's buffers differ there.)
            if !reduced && token_split == 1 && workload.recompute != Recompute::Full && model.experts.is_none() {
                let mut held = vec![
                    Term { name: "its positions", bytes: positions },
                    Term { name: "what it holds in flight but the logits", bytes: current.in_flight - head.logits },
                    Term { name: "the logits' gradient", bytes: head.logits },
                    Term { name: "the LM head's input gradient", bytes: head.input_gradient },
                ];
                if !first_backward {
                    held.push(Term {
                        name: "the joining head gradient's new sum beside the old",
                        bytes: head.weight_gradient,
                    });
                }
                candidates.push(candidate("the LM head's weight gradient joins its sum", head.weight_gradient, &held));
            }
        }
        if let Some((matrix, held)) = current.down_joining.as_ref().filter(|_| !zero_bubble) {
            let mut held = held.clone();
            held.insert(0, Term { name: "its positions", bytes: positions });
            if !first_backward {
                held.push(Term { name: "the joining down gradient's new sum beside the old", bytes: *matrix });
            }
            candidates.push(candidate("the last layer's down gradient joins its sum", *matrix, &held));
        }
        if let Some((so_far, held)) = current.mlp_norm_gradient.as_ref().filter(|_| !zero_bubble) {
            let mut held = held.clone();
            held.insert(0, Term { name: "its positions", bytes: positions });
            candidates.push(candidate("the last layer's MLP norm output gradient", *so_far, &held));
        }
        if let Some((matrix, so_far, held)) = current.gate_joining.as_ref().filter(|_| !zero_bubble) {
            let mut held = held.clone();
            if !first_backward {
                held.push(Term { name: "the joining gate gradient's new sum beside the old", bytes: *matrix });
            }
            candidates.push(candidate("first layer's gate gradient joins its sum", *so_far, &held));
        }
        for (name, so_far, held, joining) in &current.tsp_attention {
            let mut held = held.clone();
            if *joining > 0.0 && !first_backward {
                held.push(Term { name: "the joining o gradient's new sum beside the old", bytes: *joining });
            }
            candidates.push(candidate(name, *so_far, &held));
        }
        for (name, so_far, held) in &current.regathered {
            candidates.push(candidate(name, *so_far, held));
        }
        for phase in candidates {
            if best.as_ref().is_none_or(|best| phase.bytes() > best.bytes()) {
                best = Some(phase);
            }
        }
    }
    best
}

/// A point of a tsp attention backward, which takes the owners last first, where o's weight
/// gradient is reduced to an owner and a rank may peak (see [`tsp_o_reduces`]).
pub(super) struct TspOReduce {
    /// Whether the owner is this rank (else another, whose reduce leaves zeros here).
    pub to_this_rank: bool,
    /// The name of the rank's contributions to that owner's block of attention weight gradients.
    pub contributions: &'static str,
    /// The reduce's own buffers on this rank.
    pub reduce: Term,
    /// The owners whose backward is still to come.
    pub after: u64,
}

/// Where the rank at `tsp_rank` on a tsp axis of degree `tsp` may peak as o's gradient (an
/// owner's `o_block` bytes) is reduced: to itself (but the axis's last rank, whose owner goes
/// first), its chain what it received and their sum with one peer, the partial sum, the message
/// and the next sum with more, its place on the axis the owners after it; and to another owner,
/// leaving zeros here, the latest such owner having the most after it: the second processed (the
/// third where that one is this rank).
pub(super) fn tsp_o_reduces(tsp: u64, tsp_rank: u64, o_block: f64) -> Vec<TspOReduce> {
    let mut points = Vec::new();
    if tsp_rank + 1 < tsp {
        points.push(TspOReduce {
            to_this_rank: true,
            contributions: "its contributions to its own attention weight gradients",
            reduce: Term {
                name: "o's reduce: what it received, and the partial sums beside it",
                bytes: if tsp == 2 { 2.0 * o_block } else { 3.0 * o_block },
            },
            after: tsp_rank,
        });
    }
    if let Some(other) = if tsp_rank + 2 == tsp { tsp.checked_sub(3) } else { tsp.checked_sub(2) } {
        points.push(TspOReduce {
            to_this_rank: false,
            contributions: "its contributions to that owner's attention weight gradients",
            reduce: Term { name: "o's reduce to that owner: zeros here", bytes: o_block },
            after: other,
        });
    }
    points
}

/// The head of a micro-batch's backward on the last chunk, in bytes.
#[derive(Clone, Copy)]
struct HeadBackward {
    /// What the loss's backward adds to the micro-batch: the logits' gradient, and under tp the
    /// loss's row statistics gathered over it.
    loss: f64,
    /// The logits (freed once the loss's backward has read them).
    logits: f64,
    /// The LM head's input gradient.
    input_gradient: f64,
    /// The LM head's weight gradient.
    weight_gradient: f64,
}

/// What one chunk of a stage holds (see [`compiled_stage_peak`]), in bytes.
struct ChunkHold {
    /// Its parameters.
    params: f64,
    /// Its gradients: one running sum of each.
    grads: f64,
    /// A micro-batch in flight on it.
    in_flight: f64,
    /// The last chunk: the buffers of the head of a micro-batch's backward there.
    loss_backward: Option<HeadBackward>,
    /// The last large weight gradient of its backward, which joins the sums at the tail.
    joining: f64,
    /// Its gradients finished by the tail, the joining one included.
    grads_so_far: f64,
    /// What the micro-batch still holds at the tail.
    held: Vec<Term>,
    /// Under dp × tp on the first chunk: what it holds as the embedding rows are sliced.
    slicing: Option<Vec<Term>>,
    /// What a micro-batch keeps of it after its backward there, until its backward on the stage
    /// ends (interleaving: a later chunk's backward follows).
    remains: Vec<Term>,
    /// Zero bubble: a micro-batch between its B and its W (positions apart).
    between: f64,
    /// Zero bubble: what W's tail still holds for the weight gradients: the residual gradients,
    /// under selective recomputation every layer's q, k and v, under full recomputation also its
    /// gate and up projections (all recomputed by B).
    kept_for_weights: f64,
    /// Zero bubble: what W's tail holds of the input gradients B sent back, beyond the residual
    /// gradient's split sum (beside cp under SP).
    input_gradients_at_w: f64,
    /// A mixture of experts: the joining expert gradient, the gradients done with it, and what the
    /// micro-batch holds, as the first layer's last expert gradient joins its sum.
    experts_joining: Option<(f64, f64, Vec<Term>)>,
    /// A dense chunk on more tokens: the joining gate gradient, the gradients done with it, and
    /// what the micro-batch holds, as the first layer's gate gradient joins its sum.
    gate_joining: Option<(f64, f64, Vec<Term>)>,
    /// A dense chunk before the last: the joining down projection gradient and what the
    /// micro-batch holds, as its last layer's down gradient joins its sum (the backward's head).
    down_joining: Option<(f64, Vec<Term>)>,
    /// The same chunk: the gradients made and what the micro-batch holds as its last layer's MLP
    /// norm output's gradients are summed.
    mlp_norm_gradient: Option<(f64, Vec<Term>)>,
    /// Zero bubble: the MLP weight gradients B makes over the chunk's layers (tsp's ring, a
    /// mixture's experts and router), if any.
    made_in_b: Option<f64>,
    /// Zero bubble: what the chunk's layers but the first keep for W once their B is done.
    later_w_reads: f64,
    /// tsp: the gradients done, and what the micro-batch holds, as the first layer's o weight
    /// gradient is reduced to this rank (but on the axis's last), and as it joins its sum (the
    /// gradient joining its running sum, zero where none joins).
    tsp_attention: Vec<(&'static str, f64, Vec<Term>, f64)>,
    /// ZeRO-2: the gradients done, and what the micro-batch holds, as its first layer's gate
    /// gradient is reduce-scattered.
    mid: Option<(f64, Vec<Term>)>,
    /// ZeRO-3 under full recomputation: the gradients done, and what the micro-batch holds, as
    /// its first layer's down and output projections' gradients are reduce-scattered.
    regathered: Vec<(&'static str, f64, Vec<Term>)>,
}

/// The terms by which [`super::memory`]'s peak of a pipelined stage, `memory`, differs from the
/// compiled stage's `phase` (from [`compiled_stage_peak`]): `memory.peak_bytes` plus these is
/// `phase.bytes()`. Removed: the optimizer state (the executor keeps it beside the program), the
/// closed form's activations of its in-flight micro-batches and its logits or transients, and its
/// one copy of the gradients; added: the phase's buffers, whose running sums and in-flight
/// micro-batches stand for those.
pub fn pipelined_differences_from_closed_form(memory: &MemoryBreakdown, phase: &ForwardPhase) -> Vec<Term> {
    let mut terms = vec![
        Term { name: "optimizer state (kept beside the program)", bytes: -memory.optimizer_bytes },
        Term { name: "closed form's activations of its in-flight micro-batches", bytes: -memory.activations_bytes },
        Term {
            name: "closed form's logits or layer transients",
            bytes: -f64::max(memory.logits_bytes, memory.transient_bytes),
        },
        Term { name: "closed form's gradients (the running sums stand for them)", bytes: -memory.grads_bytes },
        // Zero when the closed form's weights are the program's (the test checks).
        Term { name: "parameters the closed form counts otherwise", bytes: phase.params - memory.params_bytes },
    ];
    terms.extend(phase.terms.iter().cloned());
    terms
}
