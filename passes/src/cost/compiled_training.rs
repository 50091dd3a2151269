//! The peak of a compiled training step (forward and backward of one rank's program), from closed
//! forms, term by term.
//!
//! A step's backward holds the most either at its head, where every activation the forward kept
//! is live beside the logits and their gradient, or at its end, where every gradient is; between
//! the two, activations are freed as gradients are made, and the peak moves from the head to the
//! end as the tokens shrink against the parameters. [`compiled_training_peak`] is the largest of
//! the live sets at these points (each one point of the program, term by term):
//! - **the head of the backward**: the loss's backward (the logits beside their gradient, and the
//!   vocabulary-parallel loss's row statistics under tp), the LM head's input gradient and its
//!   weight gradient (the final norm's output recomputed for them under full recomputation; under
//!   ZeRO-2 and 3 also as an untied head's is reduce-scattered, staged whole);
//! - **inside a layer's MLP backward**, the first layer's or the last's: as the down projection's
//!   weight gradient is made (and, beside dp or cp, reduced, then up's), under ZeRO-3 as gate's
//!   input gradient is made beside its weight gathered again, and as the MLP norm output's
//!   gradients from gate and up are summed;
//! - **inside a layer's attention backward** (its attention recomputed under selective
//!   recomputation, all of it under full): as o's weight gradient is made and, beside replicas,
//!   reduced (under ZeRO-2 and 3 reduce-scattered, staged whole), at the attention kernel's dv,
//!   and as the attention norm output's gradients from v, k and q are summed (under Qwen2 beside
//!   q's, k's and v's bias gradients, which are made before their inputs' gradients); where tp
//!   does not divide the kv heads, also **as v's and k's weight gradients, whole over tp, are
//!   reduced** (under ZeRO-2 and 3 reduce-scattered, staged whole);
//! - a mixture of experts' layer in place of the MLP's points, the first layer's or the last's: **as
//!   the MLP norm output's gradient is made** (the experts' input gradient, all-reduced over tp,
//!   beside the router's from the load-balancing loss; without the loss or a shared expert tp
//!   reduces it only **once the weight gradients are made and reduced**), **as the experts' last
//!   weight gradient is made** (under ZeRO-3 beside their weights gathered again), or over ep **as
//!   the dispatch's backward copies its operands** (it makes all of those gradients at once); **as
//!   dp or cp reduces the first expert gradient**, and **as the attention residual's gradient is
//!   summed** past the MLP norm's backward; a mixture's expert counts summed over the layers are
//!   live until the first layer's router backward;
//! - a mixture's **shared expert** (Qwen2-MoE), whose backward comes before the routed experts':
//!   **as its down projection's input and weight gradients are made** (and reduced over dp, cp and
//!   ep), **as up's input gradient is made**, **as gate's joins the MLP norm output's gradient**,
//!   and **as gate's weight gradient is reduced**; without SP its gate vector's backward comes
//!   first, under SP last (and, with the load-balancing loss, the router's first, each input
//!   gradient all-reduced over tp before it is summed). Past it, the routed experts' points hold
//!   its gradients and the sum of its input gradients, and not its kept activations;
//! - under cp, **the forward's end**, as every token's logits are gathered and put back in order
//!   (a mixture's per-layer statistics not yet summed);
//! - **the embedding's backward**, as the whole-vocabulary gradient is scattered from the token
//!   gradients;
//! - **the end of the backward**, below.
//!
//! Each is exact where the program peaks there; where it peaks at a point not modelled (a
//! crossover token count, a narrow MLP, dp's reduction of another gradient) the result is below
//! the planner's peak, never above (`tests/cost_training.rs` checks both).
//!
//! A tied embedding's gradient is the sum of the LM head's part, made at the head of the backward,
//! and the embedding's, made at its end. The head's part is held from one to the other
//! ([`TIED_HEAD_GRADIENT`] at the end; whole over dp under ZeRO-2 and 3, since it is reduced with
//! the table's gradient only then), and the two are summed before the rank's shard is reduced.
//!
//! At the end of the backward, when the embedding's gradient is computed, every activation the
//! backward kept is freed, and live are the parameters, the gradient of every parameter (each an
//! output of the program), the loss, and the embedding's gradient over the whole vocabulary
//! `[V, h]` (the scatter-add of the token gradients), before tp slices the rank's vocabulary
//! shard from it or dp reduces it (on one rank it is the gradient itself, written beside the
//! token ids and the embedding output's gradient it is computed from). What the layout does to
//! that whole-vocabulary gradient there is the rest:
//! - **tp** (with or without Megatron SP): slices its vocabulary shard, a gradient output (counted
//!   with the gradients). **dp** and **cp**: all-reduce it into the gradient output.
//! - **dp × tp**: slices the tp shard first and all-reduces only the `[V/tp, h]` shard over dp
//!   (autodiff slices before it reduces), so it peaks as tp alone does.
//! - **ZeRO-2 and 3** over dp: reduce-scatter it instead, so the executor stages the whole input
//!   (`[V, h]` more) while the rank's `[V/dp, h]` gradient shard is not written yet. ZeRO-2 also
//!   holds only a dp shard of every other gradient, ZeRO-3 also of every parameter (nothing is
//!   gathered at this point: the embedding's backward reads no weight). ZeRO-1 changes the
//!   optimizer's layout only, so its program is plain dp's.
//! - **ZeRO-2 and 3 beside tp**: tp's `[V/tp, h]` shard is sliced first and only it is
//!   reduce-scattered over dp (under ZeRO-3 too: autodiff brings the gathered parameter's gradient
//!   to the gathered `[V/tp, h]` layout before the gather's conjugate), so the peak is the slice,
//!   beside the whole, and the rank's `[V/(dp·tp), h]` shard is not written yet.
//! - **ZeRO beside ep**: a dense parameter's replicas are dp·ep (ep splits the batch as dp does),
//!   a routed expert's dp, and ZeRO shards each over its own (`pleat_ir::ZERO_AXES`): every dp
//!   shard above is a dp·ep shard for a dense gradient or parameter, the embedding's included (its
//!   reduce-scatter over ep follows the one over dp and peaks lower), and on ep alone the experts
//!   are neither sharded nor gathered.
//! - **ZeRO on rows that do not divide**: the executor splits a parameter's rows over each of its
//!   replicas' axes that divides them and keeps the rest whole (`super::zero_rows`), where the
//!   closed form divides every parameter by all its replicas. Every phase holds the difference as
//!   named terms: [`PARAMS_KEPT_WHOLE`] under ZeRO-3, [`GRADS_KEPT_WHOLE`] at the end under ZeRO-2
//!   and 3 (the gradients made before it, exactly), and [`optimizer_kept_whole`] beside the
//!   program. On `tiny` at dp=4 × tp=2, k and v (2 rows a rank) stay whole; at dp=2 × tp=4
//!   (one row a rank) they split over dp on head_dim, and nothing is kept whole.
//! - **ZeRO beside cp**: cp's ranks hold the same weights, so a dense parameter's replicas are
//!   dp·cp·ep and a routed expert's dp·cp; the reduce-scatter over cp follows the one over dp.
//!
//! [`training_differences_from_closed_form`] names every term by which the closed form of
//! [`super::memory`] differs from this, so that `closed form + differences = planner` to the byte
//! (`tests/cost_training.rs` checks tp and tp with Megatron SP at 2 and 4, dp at 2 and 4, cp,
//! dp × tp, ZeRO 1 to 3 at dp 2 and 4, ZeRO 1 to 3 beside tp with and without SP (also where k's
//! and v's rows do not divide: dp=4 × tp=2, dp=2 × tp=4), and selective and full recomputation,
//! each on 8, 32 and 128 tokens a sequence, with the embedding untied and tied; and a mixture of
//! experts alone, on tp (with and without SP), dp, cp, dp × tp, ZeRO 2 and 3, ep, dp × ep, ep × tp
//! and ep × cp, ZeRO 1 to 3 beside ep (on ep alone, dp × ep, ep × tp and dp × ep × tp), each
//! recomputation, on 8 to 256 tokens a sequence; the same with a shared expert of a quarter, three
//! quarters and eight times the hidden size, with and without the load-balancing loss, on 8 to
//! 512; and with Qwen2's q, k and v biases, dense and in the Qwen2-MoE fixture, on 8 to 512).
//! tsp peaks inside the first layer's MLP ring backward instead: [`compiled_tsp_training_peak`]
//! models tsp at any degree, alone or beside dp or ep (ZeRO-2 and 3 included), a dense model or a
//! mixture of experts split over it (or over ep beside it).
//! Pipelined stages (which hold each micro-batch's gradients beside their running sums, and the
//! other micro-batches' activations) peak elsewhere: [`compiled_training_peak`] returns `None`
//! for them, and [`super::compiled_pipeline`] models them.

use pleat_ir::AxisName;

use super::activation::{key_values_replicated, kv_split};
use super::compiled::ForwardPhase;
use super::compiled_pipeline::{tsp_first_owner_o_reduce, tsp_o_reduces};
use super::layout::Layout;
use super::memory::{bytes_per_param, stage_expert_params, stage_params, MemoryBreakdown, Term};
use super::model::ModelShape;
use super::step_sizes::{StepSizes, ID_BYTES};
use super::workload::{Recompute, Workload};
use super::zero_rows::ZeroRows;

/// The name of the gradients' term of [`compiled_training_peak`].
pub const GRADIENTS: &str = "gradients of every parameter";
/// ZeRO-3 beside tsp: a layer's attention weights (those ZeRO-3 splits), gathered over dp again in
/// its backward and kept until the last owner's broadcast of them: every rank passes its own to
/// each owner's broadcast.
const ATTENTION_GATHERED: &str =
    "the layer's attention weights, gathered over dp again until the last owner's broadcasts";
/// ZeRO-3 beside tsp under full recomputation: the final norm's weights gathered over dp again.
const FINAL_NORM_GATHERED: &str = "the final norm's weights, gathered over dp again for its recomputation";
/// ZeRO-3: the parameters whose rows (after tp's or tsp's split) do not divide over their replicas
/// are held whole, or split over the replicas that divide them, beyond the closed form's shards
/// (`super::zero_rows`).
pub const PARAMS_KEPT_WHOLE: &str =
    "parameters ZeRO-3 keeps whole or splits over fewer replicas (their rows do not divide), beyond their shards";
/// ZeRO-1 to 3: the same of the optimizer's state.
pub const OPTIMIZER_KEPT_WHOLE: &str =
    "optimizer state ZeRO keeps whole or splits over fewer replicas (their rows do not divide), beyond its shards";
/// ZeRO-2 and 3: the same of the finished gradients.
pub const GRADS_KEPT_WHOLE: &str =
    "finished gradients ZeRO-2 keeps whole or splits over fewer replicas (their rows do not divide), beyond their shards";

/// The whole-vocabulary embedding gradient `[V, h]`: the scatter-add of the token gradients into
/// every row of the table, before tp slices the rank's rows from it or dp reduces it.
pub const WHOLE_EMBEDDING_GRADIENT: &str =
    "embedding gradient over the whole vocabulary (before it is sliced or reduced)";

/// ZeRO-2 and 3: the executor's staging of the reduce-scatter of the whole-vocabulary embedding
/// gradient: its whole input, `[V, h]`, held while the collective runs, which is the step's peak.
pub const ZERO_REDUCE_SCATTER_STAGING: &str = "reduce-scatter staging of the whole-vocabulary embedding gradient";

/// ZeRO-2 and 3 beside tp: the rank's `[V/tp, h]` tp shard of the whole-vocabulary embedding gradient,
/// sliced before the dp reduce-scatter, live beside the whole at the step's peak.
pub const TP_SHARD_SLICED_BEFORE_DP: &str = "embedding gradient's tp shard, sliced before the dp reduce-scatter";

/// ZeRO-2 beside tsp: the rank's `[V/tsp, h]` tsp shard of the whole-vocabulary embedding
/// gradient, sliced before the dp reduce-scatter, live beside the whole at the step's end.
pub const TSP_SHARD_SLICED_BEFORE_DP: &str = "embedding gradient's tsp shard, sliced before the dp reduce-scatter";

/// A tied embedding: the LM head's `[V/tp, h]` part of the table's gradient, made at the head of
/// the backward and held, a gradient not yet summed, until the embedding's part joins it at the end.
pub const TIED_HEAD_GRADIENT: &str = "the LM head's part of the tied embedding's gradient, held until the end";

/// ZeRO-2 and 3: the rank's `[V/(dp·tp), h]` embedding gradient shard, counted with the (dp-sharded)
/// gradients but written only when the reduce-scatter ends, so negative.
pub const ZERO_EMBEDDING_SHARD_NOT_YET_WRITTEN: &str =
    "embedding gradient's dp shard, not reduce-scattered yet (removed)";

/// The ZeRO stage a workload runs (Megatron's distributed optimizer is ZeRO-1).
fn zero_stage(workload: &Workload) -> u8 {
    if workload.distributed_optimizer {
        workload.zero.max(1)
    } else {
        workload.zero
    }
}

/// The peak of a compiled training step on one rank of `layout` (no pipelining; any recompute):
/// the largest phase of the module doc, exact where the program peaks at one of them and below
/// the planner's peak otherwise; `None` for a tsp or pp axis, or ZeRO-2/3 with an axis beside dp,
/// cp and ep other than tp. `workload` is in the cost model's terms (`micro_batch` sequences a
/// replica). The phase's `params` are the program's (a ZeRO shard under ZeRO-3); its terms are
/// every gradient (a ZeRO shard under ZeRO-2 and 3), less those not made at that point, and the buffers
/// live there. The optimizer's moments are not the program's: the executor adds them beside it.
pub fn compiled_training_peak(model: &ModelShape, layout: &Layout, workload: &Workload) -> Option<ForwardPhase> {
    let end = end_of_backward(model, layout, workload)?;
    let mut phases = backward_phases(model, layout, workload, end.params);
    // Each of those names the gradients made so far; beside the step's gradients (as the end's
    // are counted, so that the closed form's stand for them) the rest are removed.
    let grads = end.terms.iter().find(|term| term.name == GRADIENTS).map_or(0.0, |term| term.bytes);
    for phase in &mut phases {
        phase.terms.splice(
            0..0,
            [
                Term { name: GRADIENTS, bytes: grads },
                Term { name: "every gradient, none made at this point (removed; those made are named)", bytes: -grads },
            ],
        );
    }
    phases.extend(embedding_backward(model, layout, workload, end.params, grads));
    let mut peak = phases.into_iter().fold(end, |best, phase| if phase.bytes() > best.bytes() { phase } else { best });
    // Every phase holds the parameters ZeRO-3 keeps whole beyond their shards, the same bytes.
    if layout.zero_replicas() > 1 && zero_stage(workload) >= 3 {
        let beyond = ZeroRows::new(model, layout).beyond_shards(model.layers, true, true);
        peak.terms.insert(0, Term { name: PARAMS_KEPT_WHOLE, bytes: beyond * model.dtype_bytes as f64 });
    }
    Some(peak)
}

/// The optimizer state a rank holds beyond the closed form's ZeRO shards (from ZeRO-1 on, and under
/// Megatron's distributed optimizer): the state of the parameters whose rows do not divide over
/// their replicas (`super::zero_rows`). Kept beside the program, as the closed form's state is.
pub fn optimizer_kept_whole(model: &ModelShape, layout: &Layout, workload: &Workload) -> Term {
    let (_, _, per_param) = bytes_per_param(model, workload);
    let bytes = if layout.zero_replicas() > 1 && zero_stage(workload) >= 1 {
        ZeroRows::new(model, layout).beyond_shards(model.layers, true, true) * per_param
    } else {
        0.0
    };
    Term { name: OPTIMIZER_KEPT_WHOLE, bytes }
}

/// The finished gradients ZeRO-2 and 3 hold beyond the closed form's shards at the end of the
/// backward, where every gradient is done (`super::zero_rows`).
fn grads_kept_whole(model: &ModelShape, layout: &Layout, workload: &Workload) -> Term {
    let bytes = if layout.zero_replicas() > 1 && zero_stage(workload) >= 2 {
        ZeroRows::new(model, layout).beyond_shards(model.layers, true, true) * model.dtype_bytes as f64
    } else {
        0.0
    };
    Term { name: GRADS_KEPT_WHOLE, bytes }
}

/// Just before the end of the backward (on more than one rank): the whole-vocabulary embedding
/// gradient being scattered from the embedding output's gradient (gathered under SP) by the token
/// ids, every other gradient done (`grads` the step's) and the rank's vocabulary shard of the
/// embedding's not sliced yet.
fn embedding_backward(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    params: f64,
    grads: f64,
) -> Option<ForwardPhase> {
    if layout.world_size() == 1 {
        return None;
    }
    let (tp, cp) = (layout.degree(AxisName::Tp), layout.degree(AxisName::Cp));
    // A dense parameter's replicas: dp, cp (whose ranks hold the same weights) and ep.
    let scattered = layout.zero_replicas() > 1 && zero_stage(workload) >= 2;
    let element = model.dtype_bytes as f64;
    let tokens = workload.tokens_per_micro_batch() as f64;
    let rows = model.vocab.div_ceil(tp);
    let shard = rows as f64 * model.hidden as f64 * element;
    let held = if scattered { ZeroRows::new(model, layout).shard(&[rows, model.hidden], shard, false) } else { shard };
    let mut terms = vec![
        Term { name: GRADIENTS, bytes: grads },
        grads_kept_whole(model, layout, workload),
        Term { name: "the embedding gradient's vocabulary shard, not sliced yet (removed)", bytes: -held },
        Term { name: "loss", bytes: element },
        Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: (model.vocab * model.hidden) as f64 * element },
        Term {
            name: "the embedding output's gradient (gathered under SP)",
            bytes: tokens / cp as f64 * model.hidden as f64 * element,
        },
        // (Under cp the rank's own: every token's, read by the loss's backward, are freed.)
        Term { name: "token ids", bytes: ID_BYTES * tokens / cp as f64 },
    ];
    if model.tied_embeddings {
        terms.push(Term { name: TIED_HEAD_GRADIENT, bytes: shard });
    }
    Some(ForwardPhase { name: "the embedding's backward", params, terms })
}

/// The phases of the backward of a step without pipelining before its end (a dense model, or a
/// mixture of experts not under tsp; none for a mixture under tsp): its head (every
/// layer's kept activations, the final norm's input and output, the token ids and positions, the
/// loss and a mixture's expert counts, beside the loss's backward and the LM head's), under cp the
/// forward's end, and the points inside a layer's MLP (or mixture) and attention backward of the
/// module doc, each with the gradients made by then.
fn backward_phases(model: &ModelShape, layout: &Layout, workload: &Workload, params: f64) -> Vec<ForwardPhase> {
    // A mixture's backward is modelled without tsp.
    if model.experts.is_some() && layout.degree(AxisName::Tsp) > 1 {
        return Vec::new();
    }
    let (dp, tp, cp) = (layout.degree(AxisName::Dp), layout.degree(AxisName::Tp), layout.degree(AxisName::Cp));
    let replicas = layout.zero_replicas();
    let zero = if replicas > 1 { zero_stage(workload) } else { 0 };
    let sizes = StepSizes::new(model, layout, workload);
    let StepSizes {
        element,
        tokens,
        local_tokens,
        sequence_parallel,
        hidden,
        query,
        kv,
        ffn,
        ids,
        positions,
        stream,
        gathered,
        kv_kept,
        kept_layer,
        statistics,
        ..
    } = sizes;
    let vocab_shard = sizes.vocab_shard;
    let local_ids = if cp > 1 { local_tokens * ID_BYTES } else { 0.0 };
    let final_norm = if workload.recompute == Recompute::Full { 0.0 } else { sizes.final_norm_buffers() };
    let logits = if cp > 1 { tokens } else { local_tokens } * vocab_shard * element;
    // The places in `base` of the kept activations, the token ids and positions, and the final
    // norm's buffers (a later phase's own terms replace them).
    const KEPT: usize = 0;
    const IDS: usize = 1;
    const FINAL_NORM: usize = 3;
    const LOSS: usize = 4;
    const STATISTICS: usize = 5;
    let base = vec![
        Term { name: "every layer's kept activations", bytes: model.layers as f64 * kept_layer },
        Term { name: "token ids and positions", bytes: ids + local_ids + positions },
        Term { name: "embedding output (the first layer's input)", bytes: stream },
        Term { name: "the final norm's input (gathered under SP) and output", bytes: final_norm },
        Term { name: "loss", bytes: element },
        Term { name: "expert counts summed over the layers", bytes: statistics },
    ];
    let mut loss_backward = base.clone();
    loss_backward
        .extend([Term { name: "logits", bytes: logits }, Term { name: "the logits' gradient", bytes: logits }]);
    if tp > 1 {
        let rows = logits / vocab_shard / element;
        loss_backward
            .push(Term { name: "the loss's row statistics, gathered over tp", bytes: sizes.loss_row_statistics(rows) });
    }
    // At the forward's end under cp, every token's logits gathered and put back in order, before
    // the loss (and a mixture's expert counts summed over the layers: each layer's counts and
    // router probability sums are live).
    let mut in_order = Vec::new();
    if cp > 1 {
        let mut ordered = base.clone();
        ordered[LOSS].bytes = 0.0;
        ordered[STATISTICS] = Term {
            name: "each layer's expert counts and router probability sums",
            bytes: 2.0 * model.layers as f64 * statistics,
        };
        ordered.extend([
            Term { name: "every token's logits, gathered over cp", bytes: logits },
            Term { name: "every token's logits, put back in order", bytes: logits },
        ]);
        in_order.push(ForwardPhase { name: "the logits put back in order (cp)", params, terms: ordered });
    }
    // Past the loss's backward, cp's logits' gradient is the rank's tokens' again, and the whole
    // sequence's token ids are freed.
    let mut past_loss = base.clone();
    if cp > 1 {
        past_loss[IDS].bytes -= ids;
    }
    // Full recomputation recomputes the final norm for the head's gradients: its output (and,
    // under SP, its input all-gathered again, the last layer's split output then freed).
    let norm_weight = model.norm.params(model.hidden) as f64 * element;
    let zero_rows = ZeroRows::new(model, layout);
    // (ZeRO-3 gathers again only the weights it split (`super::zero_rows`): a norm's whose rows do
    // not divide over the replicas stays whole.)
    let gathered_again = |dims: &[u64], bytes: f64| if zero_rows.splits(dims, false) { bytes } else { 0.0 };
    let norm_gathered = gathered_again(&[model.hidden], norm_weight);
    let mut input_gradient = past_loss.clone();
    if workload.recompute == Recompute::Full {
        let gathered_input = if sequence_parallel { gathered } else { 0.0 };
        if sequence_parallel {
            input_gradient[KEPT].bytes -= stream;
        }
        // (ZeRO-3 gathers the final norm's weight again for it.)
        if zero >= 3 && norm_gathered > 0.0 {
            input_gradient.push(Term { name: "the final norm's weight, gathered again", bytes: norm_gathered });
        }
        input_gradient[FINAL_NORM] = Term {
            name: "the final norm's input gathered (under SP) and output, recomputed",
            bytes: gathered_input + gathered,
        };
    }
    input_gradient.extend([
        Term { name: "the logits' gradient", bytes: local_tokens * vocab_shard * element },
        Term { name: "the LM head's input gradient", bytes: gathered },
    ]);
    let head_gradient = vocab_shard * hidden * element;
    let mut weight_gradient = input_gradient.clone();
    weight_gradient.push(Term { name: "the LM head's weight gradient", bytes: head_gradient });
    // Under ZeRO-2 and 3 an untied head's weight gradient is then reduce-scattered (where ZeRO
    // splits the table), staged whole, the logits' gradient and the final norm's output, which it
    // read last, freed. (A tied one is held whole to the end of the backward.)
    let head_scattered =
        (zero >= 2 && !model.tied_embeddings && zero_rows.vocabulary_table_replicas() > 1).then(|| {
            let mut scattered = weight_gradient.clone();
            scattered.extend([
                Term {
                    name: "the logits' gradient and the final norm's output, freed",
                    bytes: -(local_tokens * vocab_shard * element + gathered),
                },
                Term { name: "its reduce-scatter's staging", bytes: head_gradient },
            ]);
            ForwardPhase { name: "the LM head's weight gradient reduce-scattered", params, terms: scattered }
        });
    let mut phases = vec![
        ForwardPhase { name: "the loss's backward", params, terms: loss_backward },
        ForwardPhase { name: "the LM head's input gradient", params, terms: input_gradient },
        ForwardPhase { name: "the LM head's weight gradient", params, terms: weight_gradient },
    ];
    phases.extend(head_scattered);
    phases.extend(in_order);
    // Inside layer `l`'s MLP backward (the first layer's or the last's: kept activations shrink
    // with the layer as gradients grow): the kept activations of the layers up to it but its
    // output (freed by the backward above it), its MLP's activations (recomputed under full
    // recomputation: the MLP norm's output, gate, up and their product), the gradients of the
    // head, the final norm and the layers above (dp shards under ZeRO-2 and 3), and its output
    // gradient.
    // ZeRO-2 and 3 hold the shard of a gradient over its replicas: a dense parameter's dp·cp·ep
    // (cp's ranks hold the same weights, and ep splits the batch as dp does), a routed expert's
    // dp·cp.
    let (shards, expert_shards) =
        if zero >= 2 { (replicas as f64, layout.expert_zero_replicas() as f64) } else { (1.0, 1.0) };
    // Beyond those, what ZeRO-2 and 3 hold whole (or split over fewer replicas) of a gradient whose
    // rows do not divide over them, and ZeRO-3 gathers only what it split (`super::zero_rows`).
    let held_dense = |dims: &[u64], bytes: f64| if zero >= 2 { zero_rows.shard(dims, bytes, false) } else { bytes };
    let beyond = |elements: f64| if zero >= 2 { elements * element } else { 0.0 };
    // The local dims of a rank's q, k and v weights, its gate's and up's, and its router's.
    let kv_rows = model.kv_heads / kv_split(model, layout);
    let (query_dims, kv_dims) =
        ([model.heads / tp, model.head_dim, model.hidden], [kv_rows, model.head_dim, model.hidden]);
    let (ffn_dims, down_dims) = ([model.ffn / tp, model.hidden], [model.hidden, model.ffn / tp]);
    // A tied head's gradient is the table's gradient in part: it is reduced over dp with the
    // embedding's part at the end, so ZeRO-2 and 3 hold it whole until then.
    let head_held = if model.tied_embeddings { head_gradient * shards } else { head_gradient };
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let layer_params =
        (stage_params(model, layout, &compiled, 1, 1) - stage_params(model, layout, &compiled, 1, 0)) * element;
    let matrix = hidden * ffn * element;
    let activation = local_tokens * ffn * element;
    let full = workload.recompute == Recompute::Full;
    // A mixture's router and routed experts, a layer (its MLP's weights in place of gate, up and
    // down).
    let routed = model.routed_expert_weights() as f64 / (tp * layout.expert_degree()) as f64 * element;
    let mixture_weights = routed + model.router_params() as f64 * element;
    // A shared expert's gate, up and down matrices (split over tp as a dense MLP's are) and its
    // gate vector `[h]` (whole, and counted with the router's parameters above), a layer.
    let shared_expert = model.experts.as_ref().is_some_and(|experts| experts.shared_expert);
    let shared_matrices = if shared_expert { 3.0 * matrix } else { 0.0 };
    let shared_gate = if shared_expert { hidden * element } else { 0.0 };
    // What it keeps of a layer's forward: gate, up and their product, its output and its gate's
    // logit (none under full recomputation, whose backward recomputes them).
    let shared_kept =
        if shared_expert && !full { activation * 3.0 + local_tokens * (hidden + 1.0) * element } else { 0.0 };
    // What ZeRO-2 and 3 hold of `dense` bytes of gradients and `experts` of routed experts'.
    let held = |dense: f64, experts: f64| dense / shards + experts / expert_shards;
    for layer in [model.layers.saturating_sub(1), 0] {
        let above = (model.layers - 1 - layer) as f64;
        // The layer's MLP weight gradients, and the attention output projection's and MLP norm's,
        // which its backward makes before it reaches its attention.
        let layer_mlp = if model.experts.is_some() { mixture_weights + shared_matrices } else { 3.0 * matrix }
            + norm_weight
            + hidden * query * element;
        let mut layer_base = past_loss.clone();
        // The first layer's router backward is the last reader of the expert counts' sum.
        if layer == 0 {
            layer_base[STATISTICS].bytes = 0.0;
        }
        let mut gradients_above = layer_base.clone();
        gradients_above.push(Term {
            name: "the gradients of the head, the final norm and the layers above",
            bytes: held(head_held + norm_weight + above * (layer_params - routed), above * routed)
                + beyond(zero_rows.beyond_shards(above as u64, true, false)),
        });
        if let Some(experts) = &model.experts {
            let kept_to_it = (layer + 1) as f64 * kept_layer - stream;
            let (router_dims, expert_dims) = ([experts.count, model.hidden], ZeroRows::expert_dims(model, layout));
            // What ZeRO-2 and 3 hold of the three expert matrices' gradients, `bytes` in all.
            let held_experts = |bytes: f64| {
                let held =
                    |dims: &[u64]| if zero >= 2 { zero_rows.shard(dims, bytes / 3.0, true) } else { bytes / 3.0 };
                expert_dims.iter().map(|dims| held(dims)).sum::<f64>()
            };
            let mut mixture = gradients_above;
            mixture[FINAL_NORM] = Term { name: "its output gradient", bytes: stream };
            // The load-balancing loss's gradients of the router's input and weight.
            let statistics_gradients = if experts.load_balancing_loss {
                (experts.count as f64 * hidden + local_tokens * hidden) * element
            } else {
                0.0
            };
            let router_gradient = experts.count as f64 * hidden * element;
            // A shared expert's backward comes before the routed experts': its gradients are made
            // and its kept activations freed.
            if shared_expert {
                // (Without SP its backward comes before the router's: in the first layer, the
                // expert counts' sum is still live.)
                let mut base = mixture.clone();
                if !sequence_parallel {
                    base[STATISTICS].bytes = statistics;
                }
                let shared_gradients = SharedExpertGradients {
                    gate_vector: held_dense(&[model.hidden], shared_gate),
                    gate_or_up: held_dense(&ffn_dims, matrix),
                    down: held_dense(&down_dims, matrix),
                };
                phases.extend(shared_expert_backward(
                    base,
                    SharedExpertPoint {
                        kept: kept_to_it - shared_kept,
                        full,
                        sequence_parallel,
                        gathered,
                        activation,
                        logit_gradient: local_tokens * element,
                        statistics_gradients,
                        load_balancing_loss: experts.load_balancing_loss,
                        gradients: shared_gradients,
                        reduced: replicas > 1,
                        matrix,
                        gathered_again: if zero >= 3 {
                            SharedExpertGathered {
                                norm: norm_weight,
                                gate_and_up: gathered_again(&ffn_dims, matrix),
                                down: gathered_again(&down_dims, matrix),
                                gate_vector: gathered_again(&[model.hidden], shared_gate),
                                router: if experts.load_balancing_loss {
                                    gathered_again(&router_dims, router_gradient)
                                } else {
                                    0.0
                                },
                            }
                        } else {
                            SharedExpertGathered::default()
                        },
                    },
                    params,
                ));
                mixture.push(Term {
                    name: "its shared expert's gradients",
                    bytes: shared_gradients.gate_vector + 2.0 * shared_gradients.gate_or_up + shared_gradients.down,
                });
            }
            // Inside the mixture's backward: its MLP norm's output (the experts' input) live
            // (recomputed under full recomputation), and under ZeRO-3 its router and experts
            // gathered over dp again for it (under full recomputation its MLP norm too).
            let mut inside = mixture.clone();
            inside[KEPT] = Term {
                name: "the kept activations of the layers up to it but its output (and its shared expert's)",
                bytes: kept_to_it - shared_kept,
            };
            if full {
                inside.push(Term { name: "its MLP norm's output, recomputed", bytes: gathered });
            }
            // (Under SP the experts' output gradient is all-gathered over tp for their backward.)
            if sequence_parallel {
                inside.push(Term { name: "the experts' output gradient, all-gathered", bytes: gathered });
            }
            if zero >= 3 {
                // (The experts only beside dp: on ep alone a rank's experts have no replica.)
                let experts_gathered: f64 =
                    expert_dims.iter().map(|dims| if zero_rows.splits(dims, true) { routed / 3.0 } else { 0.0 }).sum();
                inside.push(Term {
                    name: "its router's and experts' weights, gathered again",
                    bytes: gathered_again(&router_dims, mixture_weights - routed - shared_gate) + experts_gathered,
                });
                // (And the MLP norm's, for its recomputation.)
                if full {
                    inside.push(Term { name: "its MLP norm's weight, gathered again", bytes: norm_gathered });
                }
            }
            // As the MLP norm output's gradient is made: the experts' input gradient beside (with
            // the load-balancing loss) the router's input gradient and its weight gradient from
            // that loss, and then their sum; under tp the experts' (each rank's part of every
            // expert's channels) is all-reduced first, into a new buffer.
            let expert_matrix = routed / 3.0;
            // A shared expert's input gradients are summed before the routed experts' backward
            // (the router's from the load-balancing loss join that sum, in place of their own
            // buffer).
            let shared_sum = (shared_expert && !experts.load_balancing_loss)
                .then_some(Term { name: "its shared expert's input gradients, summed", bytes: gathered });
            if layout.expert_axis().is_some() {
                // Over ep one instruction makes the experts' input, router and weight gradients
                // at once, dispatching the rows to the experts' ranks and back. It works from a
                // copy of its operands (the MLP norm's output, the router, the rank's experts and
                // the output gradient, gathered under SP), made before its results are written:
                // as the copy is made, its results are not yet live.
                let mut dispatch = inside.clone();
                dispatch.extend(shared_sum.clone());
                dispatch.extend([
                    Term {
                        name: "the router's input and weight gradients from the load-balancing loss",
                        bytes: statistics_gradients,
                    },
                    Term {
                        name: "the dispatch's copy of its operands",
                        bytes: 2.0 * gathered + router_gradient + routed,
                    },
                ]);
                phases.push(ForwardPhase { name: "a mixture's dispatched backward", params, terms: dispatch });
            } else {
                let mut router = inside.clone();
                router.extend(shared_sum);
                router.extend([
                    Term {
                        name: "the router's input and weight gradients from the load-balancing loss",
                        bytes: statistics_gradients,
                    },
                    Term { name: "the experts' input gradient", bytes: gathered },
                    Term {
                        name: "the experts' input gradient all-reduced over tp, or summed with the router's or the shared expert's",
                        bytes: if experts.load_balancing_loss || shared_expert { gathered } else { 0.0 },
                    },
                ]);
                phases.push(ForwardPhase { name: "a mixture's MLP norm output's gradient", params, terms: router });
                // As the experts' last weight gradient is made: the router's gradient done (ZeRO-3, and
                // ZeRO-2 beside tp, reduce it whole and take the rank's dp shard of it only after the
                // experts' backward), the MLP norm output's gradient.
                let mut made = inside;
                made.extend([
                    Term {
                        name: "its router's gradient",
                        bytes: if zero >= 3 || (zero >= 2 && tp > 1) {
                            router_gradient
                        } else {
                            held_dense(&router_dims, router_gradient)
                        },
                    },
                    Term { name: "its experts' gradients", bytes: 3.0 * expert_matrix },
                    Term { name: "its MLP norm output's gradient", bytes: gathered },
                ]);
                phases.push(ForwardPhase { name: "a mixture's expert gradients made", params, terms: made });
            }
            // Past the experts' backward, their MLP norm's output (their input) freed.
            mixture[KEPT] = Term {
                name: "the kept activations of the layers up to it but its output and MLP norm's output (and its shared expert's)",
                bytes: kept_to_it - shared_kept - if full { 0.0 } else { gathered },
            };
            // Without the load-balancing loss or a shared expert, whose gradients it would be
            // summed with, tp all-reduces the experts' input gradient (under SP reduce-scatters
            // it, staged whole) only once their and the router's weight gradients are made and
            // reduced, their weights (gathered again under ZeRO-3) and under SP the gathered
            // output gradient freed; under ZeRO-3 beside the MLP norm's weight, gathered for its
            // backward. (Counting it beside the weights was 0.8% above the planner at dp=2 × tp=2
            // under SP.)
            let layer_mixture_gradients = Term {
                name: "its router's and experts' gradients",
                bytes: held_dense(&router_dims, router_gradient) + held_experts(routed),
            };
            if tp > 1 && !experts.load_balancing_loss && !shared_expert {
                let mut reduced = mixture.clone();
                reduced.extend([
                    layer_mixture_gradients.clone(),
                    Term { name: "the experts' input gradient and its reduction over tp", bytes: 2.0 * gathered },
                ]);
                if zero >= 3 {
                    reduced
                        .push(Term { name: "its MLP norm's weight, gathered for its backward", bytes: norm_gathered });
                }
                phases.push(ForwardPhase {
                    name: "a mixture's experts' input gradient reduced over tp",
                    params,
                    terms: reduced,
                });
            }
            // dp and cp then all-reduce the experts' three gradients one by one, each into a new
            // buffer: the first beside the three.
            if dp > 1 || cp > 1 {
                let mut reduced = mixture.clone();
                reduced.extend([
                    Term { name: "its router's gradient", bytes: held_dense(&router_dims, router_gradient) },
                    Term {
                        name: "its experts' gradients, and the first's all-reduce result",
                        bytes: 4.0 * expert_matrix,
                    },
                    Term { name: "its MLP norm output's gradient", bytes: gathered },
                ]);
                phases.push(ForwardPhase { name: "a mixture's expert gradients reduced", params, terms: reduced });
            }
            // As the attention residual's gradient is summed, past the MLP norm's backward: the
            // router's and experts' gradients done, the MLP norm output's gradient, the norm's
            // input gradient and their sum, the attention residual's gradient.
            mixture.extend([
                layer_mixture_gradients,
                Term { name: "its MLP norm output's gradient", bytes: gathered },
                Term {
                    name: "its MLP norm's input gradient and the attention residual's gradient",
                    bytes: 2.0 * stream,
                },
            ]);
            phases.push(ForwardPhase { name: "a mixture's attention residual gradient", params, terms: mixture });
        } else {
            let mut mlp = gradients_above;
            mlp[KEPT] = Term {
                name: "the kept activations of the layers up to it but its output",
                bytes: (layer + 1) as f64 * kept_layer - stream,
            };
            mlp[FINAL_NORM] = Term { name: "its output gradient", bytes: stream };
            if full {
                mlp.push(Term {
                    name: "its MLP norm's output, gate, up and their product, recomputed",
                    bytes: gathered + 3.0 * activation,
                });
                // ZeRO-3 gathered their weights again for the recomputation.
                if zero >= 3 {
                    mlp.push(Term {
                        name: "its MLP norm's, gate's and up's weights, gathered again",
                        bytes: norm_gathered + 2.0 * gathered_again(&ffn_dims, matrix),
                    });
                }
            }
            // As the down projection's weight gradient is made: the SiLU product's gradient beside it.
            // (Under SP the down projection's output gradient is all-gathered over tp for it.)
            let mut down = mlp.clone();
            if sequence_parallel {
                down.push(Term { name: "the down projection's output gradient, all-gathered", bytes: gathered });
            }
            down.extend([
                Term { name: "the SiLU product's gradient", bytes: activation },
                Term { name: "the down projection's weight gradient", bytes: matrix },
            ]);
            phases.push(ForwardPhase { name: "an MLP's down projection weight gradient", params, terms: down.clone() });
            // dp and cp then all-reduce it into a new buffer (ZeRO-2 and 3 reduce-scatter it over dp,
            // staging it whole); the SiLU product and (under SP) the gathered output gradient, whose
            // last reader made it, are freed.
            if dp > 1 || cp > 1 {
                down.push(Term { name: "the SiLU product, freed", bytes: -activation });
                down.retain(|term| !term.name.ends_with("all-gathered"));
                let reduce = if zero >= 2 { "its reduce-scatter's staging" } else { "its all-reduce's result" };
                down.push(Term { name: reduce, bytes: matrix });
                phases.push(ForwardPhase {
                    name: "an MLP's down projection weight gradient reduced",
                    params,
                    terms: down,
                });
                // Then up's weight gradient, made after its input gradient (the MLP norm output's
                // gradient from up), is reduced the same way: gate, up and their product freed,
                // gate's output gradient live (its gradients come next), and under ZeRO-3 with full
                // recomputation up's weight, gathered again, freed by its input gradient.
                let mut up = mlp.clone();
                if let Some(regathered) = up.iter_mut().find(|term| term.name.ends_with("gathered again")) {
                    *regathered = Term {
                        name: "its MLP norm's and gate's weights, gathered again",
                        bytes: norm_gathered + gathered_again(&ffn_dims, matrix),
                    };
                }
                up.extend([
                    Term { name: "gate, up and their product, freed", bytes: -3.0 * activation },
                    Term { name: "the down projection's weight gradient", bytes: held_dense(&down_dims, matrix) },
                    Term { name: "gate's output gradient", bytes: activation },
                    Term { name: "the MLP norm output's gradient from up", bytes: gathered },
                    Term { name: "the up projection's weight gradient", bytes: matrix },
                    Term { name: reduce, bytes: matrix },
                ]);
                phases.push(ForwardPhase { name: "an MLP's up projection weight gradient reduced", params, terms: up });
            }
            // As the MLP norm output's gradient sums the gate's and up's: the down and up weight
            // gradients done, gate's output gradient (its weight gradient is next), the two input
            // gradients and their sum; gate, up and their product freed.
            let mut norm = mlp;
            // Under ZeRO-3, before, gate's input gradient is made beside its weight, gathered again
            // for it (under full recomputation the recomputed forward's copy, beside the MLP
            // norm's), and up's input gradient.
            let gate_weight = gathered_again(&ffn_dims, matrix);
            let regathered = if full { norm_gathered + gate_weight } else { gate_weight };
            let gate_input = (zero >= 3 && gate_weight > 0.0).then(|| {
                let mut gate_input: Vec<Term> =
                    norm.iter().filter(|term| !term.name.ends_with("gathered again")).cloned().collect();
                gate_input.push(Term { name: "gate's weight, gathered again (and the MLP norm's)", bytes: regathered });
                gate_input
            });
            norm.retain(|term| !term.name.ends_with("gathered again"));
            let made = [
                Term { name: "gate, up and their product, freed", bytes: -3.0 * activation },
                Term {
                    name: "the down and up projections' weight gradients",
                    bytes: held_dense(&down_dims, matrix) + held_dense(&ffn_dims, matrix),
                },
                Term { name: "gate's output gradient", bytes: activation },
            ];
            if let Some(mut gate_input) = gate_input {
                gate_input.extend(made.clone());
                gate_input.push(Term {
                    name: "the MLP norm output's gradients from up and from gate",
                    bytes: 2.0 * gathered,
                });
                phases.push(ForwardPhase {
                    name: "an MLP's gate input gradient, its weight gathered again",
                    params,
                    terms: gate_input,
                });
            }
            norm.extend(made);
            norm.push(Term {
                name: "the MLP norm output's gradients from gate and up, and their sum",
                bytes: 3.0 * gathered,
            });
            phases.push(ForwardPhase { name: "an MLP norm output's gradient", params, terms: norm });
        }
        // Inside layer `l`'s attention backward: the kept activations of the layers below and its
        // input, the gradients of its MLP, MLP norm and output projection done too, its attention
        // residual's gradient, and its attention norm's output, q, k and v (kept, or recomputed
        // from its input under full recomputation: the same buffers).
        let mut attention = layer_base.clone();
        attention[KEPT] = Term { name: "the kept activations of the layers below", bytes: layer as f64 * kept_layer };
        attention[FINAL_NORM] = Term { name: "its attention residual's gradient", bytes: stream };
        attention.extend([
            Term {
                name: "the gradients of the head, the final norm, the layers above and its MLP and output projection",
                bytes: held(
                    head_held + norm_weight + above * (layer_params - routed) + layer_mlp - routed,
                    (above + 1.0) * routed,
                ) + beyond(
                    zero_rows.beyond_shards(above as u64, true, false) + zero_rows.beyond_shards_past_attention(),
                ),
            },
            Term {
                name: if full { "its attention norm's output, recomputed" } else { "its attention norm's output" },
                bytes: gathered,
            },
        ]);
        // At the attention kernel's dv: q, k and v (cp's every token's k and v), attention's
        // output gradient, dq and dk made, dv being made (attention's output, kept or
        // recomputed, freed: the output projection's weight gradient was its last reader).
        let mut dv = attention.clone();
        dv.extend([
            Term {
                name: if full { "its q, k and v, recomputed" } else { "its q, k and v" },
                bytes: (local_tokens * query + kv_kept) * element,
            },
            Term { name: "attention's output gradient", bytes: local_tokens * query * element },
            Term { name: "dq, dk and dv", bytes: (local_tokens * query + kv_kept) * element },
        ]);
        // (ZeRO-3 gathered its attention norm's, q's, k's and v's weights again for the
        // recomputation; k's and v's are freed once their input gradients are made.)
        if full && zero >= 3 {
            dv.push(Term {
                name: "its attention norm's, q's, k's and v's weights, gathered again",
                bytes: norm_gathered
                    + gathered_again(&query_dims, hidden * query * element)
                    + 2.0 * gathered_again(&kv_dims, hidden * kv * element),
            });
        }
        // Before the kernel o's weight gradient is made, after its input gradient (attention's
        // output gradient), beside attention's output and under SP the attention residual's
        // gradient all-gathered over tp for o's backward; beside replicas (dp, cp or ep) it is
        // then reduced into a new buffer (under ZeRO-2 and 3 reduce-scattered, staged whole),
        // those two freed. Both points hold q, k and v (and their weights gathered again as at dv).
        let output_projection = hidden * query * element;
        let o_dims = [model.hidden, model.heads / tp, model.head_dim];
        let mut o_made = dv.clone();
        o_made.retain(|term| term.name != "dq, dk and dv");
        o_made.extend([
            Term {
                name: "its output projection's weight gradient, not made yet (removed)",
                bytes: -held_dense(&o_dims, output_projection),
            },
            Term { name: "its output projection's weight gradient", bytes: output_projection },
        ]);
        let mut o_reduced = o_made.clone();
        o_made.push(Term {
            name: if full || workload.recompute == Recompute::Selective {
                "attention's output, recomputed"
            } else {
                "attention's output"
            },
            bytes: local_tokens * query * element,
        });
        if sequence_parallel {
            o_made.push(Term { name: "its attention residual's gradient, all-gathered", bytes: gathered });
        }
        phases.push(ForwardPhase { name: "an output projection's weight gradient made", params, terms: o_made });
        if replicas > 1 {
            o_reduced.push(Term {
                name: if zero >= 2 { "its reduce-scatter's staging" } else { "its all-reduce's result" },
                bytes: output_projection,
            });
            phases.push(ForwardPhase {
                name: "an output projection's weight gradient reduced",
                params,
                terms: o_reduced,
            });
        }
        phases.push(ForwardPhase { name: "an attention kernel's backward", params, terms: dv });
        // As the attention norm output's gradients from v and k are summed: q's and k's
        // gradients after RoPE (their weight gradients are still to come), v's weight gradient
        // done, and the two input gradients and their sum.
        // In the first layer every token's positions were last read by the attention kernel's
        // backward and the rank's own by q's RoPE backward, which comes before this sum but
        // under SP.
        let mut norm = attention;
        if layer == 0 {
            let local_positions = if sequence_parallel { workload.seq as f64 / cp as f64 * ID_BYTES } else { 0.0 };
            norm[IDS].bytes -= positions - local_positions;
        }
        // (What v's and k's weight gradient points hold beside their own buffers.)
        let before_weights = norm.clone();
        if full && zero >= 3 {
            norm.push(Term {
                name: "its attention norm's and q's weights, gathered again",
                bytes: norm_gathered + gathered_again(&query_dims, hidden * query * element),
            });
        }
        // (Under Qwen2 q's, k's and v's bias gradients are made before their inputs' gradients.)
        let bias_gradient = |rows: u64| {
            let bytes = (rows * model.head_dim) as f64 * element;
            if model.qkv_bias {
                held_dense(&[rows, model.head_dim], bytes)
            } else {
                0.0
            }
        };
        norm.extend([
            Term { name: "its v and k projections' bias gradients", bytes: 2.0 * bias_gradient(kv_rows) },
            Term { name: "its v projection's weight gradient", bytes: held_dense(&kv_dims, hidden * kv * element) },
            Term { name: "q's and k's gradients", bytes: local_tokens * (query + kv) * element },
            Term { name: "the attention norm output's gradients from v and k, and their sum", bytes: 3.0 * gathered },
        ]);
        // Then as q's input gradient joins that sum: k's weight gradient done and k's gradient
        // freed (under ZeRO-3 q's gathered weight too, its last reader done; in the first
        // layer under SP the rank's positions, q's RoPE backward done).
        let mut with_q = norm.clone();
        if layer == 0 && sequence_parallel {
            with_q[IDS].bytes -= workload.seq as f64 / cp as f64 * ID_BYTES;
        }
        with_q.retain(|term| term.name != "its attention norm's and q's weights, gathered again");
        if full && zero >= 3 {
            with_q.push(Term { name: "its attention norm's weight, gathered again", bytes: norm_gathered });
        }
        with_q.extend([
            Term { name: "its q projection's bias gradient", bytes: bias_gradient(model.heads / tp) },
            Term { name: "its k projection's weight gradient", bytes: held_dense(&kv_dims, hidden * kv * element) },
            Term { name: "k's gradient, freed", bytes: -local_tokens * kv * element },
        ]);
        phases.push(ForwardPhase { name: "an attention norm output's gradient", params, terms: norm });
        phases.push(ForwardPhase { name: "an attention norm output's gradient from q", params, terms: with_q });
        // Where tp does not divide the kv heads, v's and k's weight gradients are whole over tp
        // (`compiled_pipeline::replicated_key_values`): v's, made after its input gradient, is
        // all-reduced over tp (under ZeRO-2 and 3 after its reduce-scatter, staged whole), and
        // then k's, made after the input gradients from v and k are summed, is reduced; beside
        // replicas the copy before their all-reduce live, without them k's gradient. (Beside cp
        // too, k's and v's gradients reduce-scattered back to the rank's tokens before; not
        // where ZeRO keeps k and v whole.)
        if key_values_replicated(model, layout) && (zero < 2 || zero_rows.beyond_key_values() == 0.0) {
            let weight = hidden * kv * element;
            let mut at_v = before_weights.clone();
            let mut at_k = before_weights;
            if full && zero >= 3 {
                at_v.push(Term {
                    name: "its attention norm's, q's and k's weights, gathered again",
                    bytes: norm_gathered
                        + gathered_again(&query_dims, hidden * query * element)
                        + gathered_again(&kv_dims, weight),
                });
                at_k.push(Term {
                    name: "its attention norm's and q's weights, gathered again",
                    bytes: norm_gathered + gathered_again(&query_dims, hidden * query * element),
                });
            }
            at_v.extend([
                Term { name: "its v projection's bias gradient", bytes: bias_gradient(kv_rows) },
                Term { name: "q's and k's gradients", bytes: local_tokens * (query + kv) * element },
                Term { name: "the attention norm output's gradient from v", bytes: gathered },
            ]);
            at_k.extend([
                Term { name: "its v and k projections' bias gradients", bytes: 2.0 * bias_gradient(kv_rows) },
                Term { name: "its v projection's weight gradient", bytes: held_dense(&kv_dims, weight) },
                Term { name: "q's gradient", bytes: local_tokens * query * element },
                Term { name: "the attention norm output's gradients from v and k, summed", bytes: gathered },
            ]);
            let (v_name, k_name) = if zero >= 2 {
                let staged =
                    |name| [Term { name, bytes: weight }, Term { name: "its reduce-scatter's staging", bytes: weight }];
                at_v.extend(staged("its v projection's weight gradient, whole, before its dp reduce-scatter"));
                at_k.extend(staged("its k projection's weight gradient, whole, before its dp reduce-scatter"));
                (
                    "a v weight gradient, whole over tp, reduce-scattered",
                    "a k weight gradient, whole over tp, reduce-scattered",
                )
            } else {
                at_v.extend([
                    Term { name: "its v projection's weight gradient", bytes: weight },
                    Term { name: "its copy before the tp all-reduce (beside replicas, before theirs)", bytes: weight },
                ]);
                at_k.extend([
                    Term { name: "its k projection's weight gradient", bytes: weight },
                    if replicas > 1 {
                        Term { name: "its copy before the all-reduce over the replicas", bytes: weight }
                    } else {
                        Term { name: "k's gradient", bytes: local_tokens * kv * element }
                    },
                ]);
                ("a v weight gradient, all-reduced over tp", "a k weight gradient, whole over tp, reduced")
            };
            phases.push(ForwardPhase { name: v_name, params, terms: at_v });
            phases.push(ForwardPhase { name: k_name, params, terms: at_k });
        }
    }
    phases
}

/// A layer's shared expert's buffers in its backward (in bytes): the kept activations up to it
/// (none of its own), the layer's sizes, and the gradients made by then.
struct SharedExpertPoint {
    /// The kept activations of the layers up to it but its output and its shared expert's.
    kept: f64,
    full: bool,
    sequence_parallel: bool,
    /// A hidden state of the rank's tokens, whole over tp (the MLP norm's output, an input
    /// gradient).
    gathered: f64,
    /// One of gate, up, their product or a gradient of those (the rank's tokens by its channels).
    activation: f64,
    /// The gate logit's gradient, a scalar a token.
    logit_gradient: f64,
    /// The load-balancing loss's router input and weight gradients (0 without the loss).
    statistics_gradients: f64,
    load_balancing_loss: bool,
    /// Its gradients as ZeRO-2 and 3 hold them (whole otherwise).
    gradients: SharedExpertGradients,
    /// Whether its gradients are reduced over their replicas (dp, cp and ep).
    reduced: bool,
    /// One of its matrices, whole (a weight gradient before its replicas reduce it).
    matrix: f64,
    gathered_again: SharedExpertGathered,
}

/// A shared expert's gradients as ZeRO-2 and 3 hold them (whole otherwise).
#[derive(Clone, Copy)]
struct SharedExpertGradients {
    gate_vector: f64,
    /// Gate's or up's (the same size).
    gate_or_up: f64,
    down: f64,
}

/// ZeRO-3: the shared expert's weights (and its MLP norm's), each as gathered over dp again where
/// it splits them (0 where it does not, and without ZeRO-3).
#[derive(Default)]
struct SharedExpertGathered {
    norm: f64,
    /// Gate's or up's (the same size).
    gate_and_up: f64,
    down: f64,
    gate_vector: f64,
    /// The router's, which under SP the load-balancing loss's backward reads before the shared
    /// expert's and the routed experts' backward reads after it (0 without the loss).
    router: f64,
}

/// The points inside a layer's shared expert's backward: as its down projection's input
/// gradient is made, as its weight gradient is (and, over the replicas, reduced), as up's input
/// gradient is made (and summed, or all-reduced), as gate's is summed into the MLP norm output's
/// gradient, and as gate's weight gradient is reduced; `mixture` is the layer's base (the
/// gradients above it, its output gradient).
///
/// Without SP, the gate vector's backward comes first (its input gradient is live until the first
/// sum, with up's). Under SP the gate vector's backward comes last (its logit's gradient is live
/// until then); with the load-balancing loss the router's backward comes first (its gradients live
/// from then on), and each input gradient is all-reduced over tp before it joins the router's
/// input gradient; without it, up's and gate's input gradients are summed.
///
/// ZeRO-3 gathers each weight again just before the backward reads it, and frees it after its
/// last reader; under full recomputation, the recomputed forward gathers them all (and the MLP
/// norm's), each live until its last reader in the backward.
fn shared_expert_backward(mut mixture: Vec<Term>, point: SharedExpertPoint, params: f64) -> Vec<ForwardPhase> {
    const KEPT: usize = 0;
    let again = &point.gathered_again;
    let (sp, lbl) = (point.sequence_parallel, point.load_balancing_loss);
    mixture[KEPT] = Term {
        name: "the kept activations of the layers up to it but its output and its shared expert's",
        bytes: point.kept,
    };
    if point.full {
        mixture.push(Term { name: "its MLP norm's output, recomputed", bytes: point.gathered });
    }
    // What of its weights ZeRO-3 holds gathered beside down's, up's and gate's: under full
    // recomputation the MLP norm's (and, under SP, the gate vector's, whose backward is last);
    // under SP with the load-balancing loss, the router's.
    let held_gathered = if point.full { again.norm + if sp { again.gate_vector } else { 0.0 } } else { 0.0 }
        + if sp && lbl { again.router } else { 0.0 };
    let gate_and_up_gathered = if point.full { again.gate_and_up } else { 0.0 };
    if sp {
        mixture.extend([
            Term { name: "the experts' output gradient, all-gathered", bytes: point.gathered },
            Term { name: "its shared expert's gate logit's gradient", bytes: point.logit_gradient },
        ]);
    } else {
        mixture.push(Term {
            name: "its shared expert's gate vector's weight gradient",
            bytes: point.gradients.gate_vector,
        });
    }
    // Before the first sum: the gate vector's input gradient (without SP), or the router's
    // gradients from the load-balancing loss (under SP).
    let before_sum = if sp {
        Term {
            name: "the router's input and weight gradients from the load-balancing loss",
            bytes: point.statistics_gradients,
        }
    } else {
        Term { name: "its shared expert's gate vector's input gradient", bytes: point.gathered }
    };
    let mut input = mixture.clone();
    input.extend([
        before_sum.clone(),
        Term {
            name: if point.full {
                "its shared expert's gate, up and their product, recomputed"
            } else {
                "its shared expert's gate, up and their product"
            },
            bytes: 3.0 * point.activation,
        },
        Term { name: "its shared expert's output gradient", bytes: point.gathered },
        Term { name: "its shared expert's SiLU product's gradient", bytes: point.activation },
    ]);
    let mut weight = input.clone();
    input.push(Term {
        name: "weights ZeRO-3 gathered again for its shared expert (its down, gate and up projections')",
        bytes: held_gathered + 2.0 * gate_and_up_gathered + again.down,
    });
    // Its down projection's weight gradient, whole until its replicas reduce it; the gathered down
    // projection's weight freed (its input gradient was the last reader).
    weight.extend([
        Term {
            name: "weights ZeRO-3 gathered again for its shared expert (its gate and up projections')",
            bytes: held_gathered + 2.0 * gate_and_up_gathered,
        },
        Term { name: "its shared expert's down projection's weight gradient, whole", bytes: point.matrix },
    ]);
    // dp, cp and ep then reduce it (all-reduced into a new buffer, or reduce-scattered by ZeRO-2
    // and 3, staged whole); its product and its output gradient are freed (it was their last
    // reader).
    let mut reduced = weight.clone();
    reduced.extend([
        Term { name: "its shared expert's SiLU product, freed", bytes: -point.activation },
        Term { name: "its shared expert's output gradient, freed", bytes: -point.gathered },
        Term { name: "its reduction's result or staging", bytes: point.matrix },
    ]);
    // Gate and up (kept or recomputed) and their product are freed once the SiLU product's two
    // gradients are made, and the gathered down and up weights once their input gradients are.
    mixture.push(Term { name: "its shared expert's down projection's weight gradient", bytes: point.gradients.down });
    let mut up = mixture.clone();
    up.extend([
        before_sum,
        Term {
            name: "weights ZeRO-3 gathered again for its shared expert (its gate projection's)",
            bytes: held_gathered + gate_and_up_gathered,
        },
        Term { name: "its shared expert's SiLU product's two gradients", bytes: 2.0 * point.activation },
        Term {
            name: match (sp, lbl) {
                (false, _) => "its shared expert's up projection's input gradient, and its sum with the gate vector's",
                (true, true) => "its shared expert's up projection's input gradient, and its all-reduce over tp",
                (true, false) => "its shared expert's up projection's input gradient",
            },
            bytes: if sp && !lbl { point.gathered } else { 2.0 * point.gathered },
        },
    ]);
    // As gate's weight gradient is reduced over the replicas (whole, beside its reduction's result
    // or staging; the SiLU product's gradient it read freed): up's weight gradient done, the MLP
    // norm output's gradient summed so far, and under SP the router's weight gradient from the
    // load-balancing loss. (Up's reduction, before it, holds gate's SiLU product's gradient in
    // place of up's held gradient, and on `tiny-moe` never peaks: below gate's, or below down's.)
    let router_weight_gradient = if sp && lbl { point.statistics_gradients - point.gathered } else { 0.0 };
    let mut gate_reduced = mixture.clone();
    gate_reduced.extend([
        Term { name: "the router's weight gradient from the load-balancing loss", bytes: router_weight_gradient },
        Term { name: "weights ZeRO-3 gathered again for its shared expert", bytes: held_gathered },
        Term { name: "its shared expert's up projection's weight gradient", bytes: point.gradients.gate_or_up },
        Term { name: "the MLP norm output's gradient summed so far", bytes: point.gathered },
        Term {
            name: "its shared expert's gate projection's weight gradient, whole, and its reduction's result or staging",
            bytes: 2.0 * point.matrix,
        },
    ]);
    // As gate's input gradient joins the sum (or, under SP with the load-balancing loss, is
    // all-reduced first): up's weight gradient done, the SiLU product's gradient for gate, the sum
    // so far, gate's input gradient and the new sum (or its all-reduce); the router's weight
    // gradient from the load-balancing loss (its input gradient was summed).
    mixture.extend([
        Term { name: "weights ZeRO-3 gathered again for its shared expert", bytes: held_gathered },
        Term { name: "its shared expert's up projection's weight gradient", bytes: point.gradients.gate_or_up },
        Term { name: "its shared expert's SiLU product's gradient for gate", bytes: point.activation },
        Term {
            name:
                "the MLP norm output's gradient summed so far, gate's input gradient and their sum (or its all-reduce)",
            bytes: 3.0 * point.gathered,
        },
    ]);
    mixture.push(Term {
        name: "the router's weight gradient from the load-balancing loss",
        bytes: router_weight_gradient,
    });
    let mut phases = vec![
        ForwardPhase { name: "a shared expert's down projection input gradient", params, terms: input },
        ForwardPhase { name: "a shared expert's down projection weight gradient", params, terms: weight },
        ForwardPhase { name: "a shared expert's up projection input gradient", params, terms: up },
        ForwardPhase { name: "a shared expert's MLP norm output's gradient", params, terms: mixture },
    ];
    if point.reduced {
        phases.extend([
            ForwardPhase { name: "a shared expert's down projection weight gradient reduced", params, terms: reduced },
            ForwardPhase {
                name: "a shared expert's gate projection weight gradient reduced",
                params,
                terms: gate_reduced,
            },
        ]);
    }
    phases
}

/// The end of the backward (see [`compiled_training_peak`]).
fn end_of_backward(model: &ModelShape, layout: &Layout, workload: &Workload) -> Option<ForwardPhase> {
    // A dense parameter's replicas: dp, cp (whose ranks hold the same weights) and ep.
    let replicas = layout.zero_replicas();
    let zero = if replicas > 1 { zero_stage(workload) } else { 0 };
    let tp = layout.degree(AxisName::Tp);
    let beside_replicas = layout.world_size() / replicas;
    if layout.degree(AxisName::Tsp) > 1 || layout.degree(AxisName::Pp) > 1 || (zero >= 2 && beside_replicas != tp) {
        return None;
    }
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let element = model.dtype_bytes as f64;
    let all_params = stage_params(model, layout, &compiled, 0, model.layers) * element;
    let experts = stage_expert_params(model, layout, model.layers) * element;
    // ZeRO shards a dense parameter over its dp·cp·ep replicas, a routed expert over dp·cp.
    let sharded = (all_params - experts) / replicas as f64 + experts / layout.expert_zero_replicas() as f64;
    let params = if zero >= 3 { sharded } else { all_params };
    let grads = if zero >= 2 { sharded } else { all_params };
    let whole = (model.vocab * model.hidden) as f64 * element;
    // A tied table's gradient is the sum of the head's part, held since the head's backward, and
    // the embedding's (`[V/tp, h]` on each rank, as is the table).
    let head_shard = (model.vocab as f64 / tp as f64).ceil() * model.hidden as f64 * element;
    let tied_head = Term { name: TIED_HEAD_GRADIENT, bytes: head_shard };
    if layout.world_size() == 1 && model.tied_embeddings {
        // One rank: the peak is as the two parts are summed into the gradient: the embedding's
        // part over the whole vocabulary beside the head's.
        let terms = vec![
            Term { name: GRADIENTS, bytes: grads },
            Term { name: "loss", bytes: element },
            Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
            tied_head,
        ];
        return Some(ForwardPhase { name: "end of backward", params, terms });
    }
    if layout.world_size() == 1 {
        // One rank: the embedding's gradient is the program's own output, written in place from
        // the token ids and the embedding output's gradient, which are live while it is.
        let tokens = workload.tokens_per_micro_batch() as f64;
        let terms = vec![
            Term { name: GRADIENTS, bytes: grads },
            Term { name: "loss", bytes: element },
            Term { name: "embedding output's gradient", bytes: tokens * model.hidden as f64 * element },
            Term { name: "token ids", bytes: tokens * 4.0 },
        ];
        return Some(ForwardPhase { name: "end of backward", params, terms });
    }
    let mut terms = vec![
        Term { name: GRADIENTS, bytes: grads },
        grads_kept_whole(model, layout, workload),
        Term { name: "loss", bytes: element },
        Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
    ];
    if zero >= 2 {
        // ZeRO-2 and 3 beside tp slice the rank's tp shard first and reduce-scatter only that
        // (the peak is the slice, beside the whole; autodiff brings a gathered parameter's
        // gradient to the gathered layout before the gather's conjugate reduce-scatters it).
        if tp > 1 {
            terms.push(Term { name: TP_SHARD_SLICED_BEFORE_DP, bytes: whole / tp as f64 });
        } else {
            terms.push(Term { name: ZERO_REDUCE_SCATTER_STAGING, bytes: whole });
        }
        let rows = model.vocab.div_ceil(tp);
        let shard = ZeroRows::new(model, layout).shard(&[rows, model.hidden], whole / tp as f64, false);
        terms.push(Term { name: ZERO_EMBEDDING_SHARD_NOT_YET_WRITTEN, bytes: -shard });
    }
    if model.tied_embeddings {
        terms.push(tied_head);
    }
    Some(ForwardPhase { name: "end of backward", params, terms })
}

/// The peak of the rank at `tsp_rank` on the tsp axis of a compiled tsp training step (tsp of
/// degree D >= 2, alone or beside dp, ep or both; a dense model or a mixture of experts split over
/// tsp, or over ep beside it, with or without a shared expert), or `None` for any other layout
/// (the compiler refuses tsp beside tp or cp): the largest of these phases, each the buffers live
/// at its highest point (`T` the step's tokens, `M` one MLP matrix's shard `h·f/D`, `A` one
/// activation `[T/D, f/D]`, `H` one hidden state `[T/D, h]`):
/// - **the loss's backward**, the backward's start: every layer's kept values, the final norm's
///   input and (but under full recompute) its output gathered over the sequence, every token's
///   logits (the rank's vocabulary shard) beside their gradient and the loss's row statistics
///   gathered over tsp, and the token ids in both orders (on a wide vocabulary the highest);
/// - **the LM head's backward**: every layer's kept values (its input,
///   attention residual, attention and mlp norms' outputs, and per owner q, attention output and
///   gathered k and v; selective recompute keeps no attention output, full recompute the input and
///   attention residual only), the final norm's input, its output gathered over the sequence, the
///   logits' gradient shard, the head's input gradient and its weight gradient being written (or,
///   under full recompute, the norm's output recomputed and gathered again);
/// - **an MLP ring's backward** (`ring_gated_mlp_grad`, docs/training.md), the first layer's or
///   the last's: the kept values of the layers up to it, the gradients of the layers above, the
///   ring's dy (and x, recomputed under full recompute), and what the ring holds at its highest
///   point (`ring_backward_highest_point`);
/// - **an attention backward**, the first layer's or the last's (which takes the owners last
///   first, each owner's block of weight gradients reduced to it): under full recompute at the
///   last owner's dv (the layer's input and recomputed attention norm and their gradients, one
///   owner's block of attention weight gradients, this owner's q/k/v weights broadcast again with
///   its q and gathered k, v recomputed, the attention output's gradient, o's weight gradient,
///   dq, dk and dv); as o's gradient is reduced to this rank or to another owner (the rank's
///   contributions to that owner's block, the owners' results before it and the activations of
///   the owners after it, which differ with the rank's place on the axis); or, without full
///   recompute, inside an owner's backward as q's input gradient is made (the last owner's, or
///   another's beside the activations of the owners still to come);
/// - a mixture's layer, the first or the last, in place of the MLP ring: **as its experts' backward
///   is dispatched over tsp** (one instruction making the layer's expert, router and input
///   gradients from a copy of its operands: the MLP norm's output, the router, the rank's experts
///   and the layer's output gradient), beside the router's gradients from the load-balancing loss
///   and the expert counts summed over the layers (live until the first layer's load-balancing
///   loss backward), under ZeRO-3 the router and the rank's experts gathered again (where ZeRO
///   splits them); under ZeRO-2 and 3 **as the first expert gradient is reduce-scattered** over
///   dp, the three made whole; over ep (tsp keeping the experts whole, each rank's gradients
///   partial sums over it) **as the first expert gradient is all-reduced over tsp**, the router's
///   done (under ZeRO-3 still whole, its reduce-scatter to come), the other two unreduced; a
///   shared expert's ring comes first in the layer (its phase holds the layer's output gradient,
///   the gate vector's input and weight gradients, its own kept output and gate logit freed), its
///   gradients made by the dispatch;
/// - **the embedding's backward**: every gradient but the embedding's, every token's gradient
///   gathered over the sequence and the whole-vocabulary gradient being scattered from them;
/// - **the end of the backward** (as [`compiled_training_peak`] under tp): every gradient, the loss
///   and the whole-vocabulary embedding gradient before the rank's shard is sliced from it.
///
/// Every phase also holds the parameters, the loss and the token ids (and positions while a
/// layer's backward still reads them). Beside dp (`workload` a replica's micro-batch) every phase
/// is tsp's alone: each gradient's dp all-reduce runs as the backward makes it, its sum replacing
/// it (the phases hold the same bytes), and the embedding gradient's vocabulary shard is sliced
/// before it is reduced, as under dp × tp. ZeRO-1 splits only the optimizer's state. ZeRO-2
/// reduce-scatters each gradient over its replicas (a dense one's dp × ep, a routed expert's dp)
/// as the backward finishes it: every phase holds the shard of each finished gradient, or what
/// stays of one whose rows (after tsp's or ep's split) do not divide over them (`ZeroSplits`), and
/// at the end the rank's tsp shard of the embedding gradient is sliced, beside the whole, before
/// its reduce-scatter writes the rank's shard. ZeRO-3 holds the shard of each parameter too, or
/// what stays of one whose rows do not divide ([`PARAMS_KEPT_WHOLE`]), and gathers the
/// parameters whole again in the backward: an MLP ring's phase holds its layer's MLP weights, an
/// attention phase the layer's attention weights while an owner's broadcast is still to come
/// (every rank passes its own to each owner's broadcast, so they stay until the last owner's; on
/// three or more ranks the second owner's dv is then a candidate), and under full recomputation
/// the norm recomputed for the phase holds its weights until its backward. The rank's own
/// attention o reduce as the first owner (the axis's last rank) and another rank's to it, with no
/// owners' results before them, are candidates too.
/// With the embedding tied to the head, every phase after the head's holds the head's part of the
/// table's gradient, `[V/D, h]`, whole over dp until the embedding's part joins it at the end
/// ([`TIED_HEAD_GRADIENT`]). `tests/cost_training.rs` checks the result against the planner to the
/// byte for every rank, each recomputation and 16 to 512 tokens, alone and beside dp (with ZeRO-2
/// and 3 at dp 2 and 4), on `tiny` and on a variant whose attention outweighs its MLP and
/// vocabulary, each also with the embedding tied, on a vocabulary of 2048, and on `tiny-moe`
/// (tied, a wide vocabulary, a shared expert a quarter of the hidden size and eight times it; over
/// ep beside tsp and dp too, ZeRO 0 to 3; with six experts, whose rows ZeRO cannot always split).
pub fn compiled_tsp_training_peak(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    tsp_rank: u64,
) -> Option<ForwardPhase> {
    let tsp = layout.degree(AxisName::Tsp);
    let (dp, ep) = (layout.degree(AxisName::Dp), layout.degree(AxisName::Ep));
    if tsp < 2 || tsp_rank >= tsp || layout.world_size() != tsp * dp * ep {
        return None;
    }
    // ZeRO-2 reduce-scatters each gradient over its replicas as the backward finishes it: a rank
    // holds its shard of every finished gradient, but of a parameter whose rows do not divide the
    // whole (`ZeroSplits`). ZeRO-3 holds the parameters so too, and gathers each whole again where
    // the backward reads it. A dense parameter's replicas are dp × ep (ep splits the batch as dp
    // does), a routed expert's dp alone (ep splits the experts).
    let zero = zero_stage(workload);
    let scattered = dp * ep > 1 && zero >= 2;
    let gathers = dp * ep > 1 && zero >= 3;
    let shards = ParamShards {
        dense: if scattered { (dp * ep) as f64 } else { 1.0 },
        expert: if zero >= 2 { dp as f64 } else { 1.0 },
    };
    let splits = ZeroSplits::new(model, layout, zero >= 2);
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let element = model.dtype_bytes as f64;
    // The rank's routed experts of one layer (`E/tsp`, or `E/ep` beside ep), elements.
    let layer_experts = model.routed_expert_weights() as f64 / layout.expert_degree() as f64;
    let all_params = stage_params(model, layout, &compiled, 0, model.layers) * element;
    let all_experts = model.layers as f64 * layer_experts * element;
    let all_grads = shards.of(all_params - all_experts, all_experts);
    let held_params = if zero >= 3 { all_grads } else { all_params };
    let first_layer = stage_params(model, layout, &compiled, 1, 1) - stage_params(model, layout, &compiled, 1, 0);
    // Bytes of the gradients of `layers` whole layers: their shards.
    let layer_grads = |layers: f64| shards.of(layers * (first_layer - layer_experts), layers * layer_experts) * element;
    let table = (model.vocab as f64 / tsp as f64).ceil() * model.hidden as f64;
    let owners = tsp as f64;
    // A tied table's gradient is the LM head's part, made at the backward's start, plus the
    // embedding's, made at its end: the head's part is held whole (over dp too) in between.
    let tied_head = if model.tied_embeddings { table * element } else { 0.0 };
    let (seq, tokens) = (workload.seq as f64, (workload.seq * workload.micro_batch) as f64);
    // A hidden state of every token of the micro-batch: the LM head's input gathered over the
    // sequence and its gradient.
    let step_sizes = StepSizes::new(model, layout, &compiled);
    let (every_token, statistics) = (step_sizes.every_token, step_sizes.statistics);
    let row_statistics = step_sizes.loss_row_statistics(tokens);
    let local = tokens / owners;
    let hidden = model.hidden as f64;
    let (query, key_value) = (model.query_width() as f64, model.kv_width() as f64);
    let ffn_shard = model.mlp_weights() as f64 / 3.0 / hidden / owners;
    let sizes = RingSizes {
        matrix: hidden * ffn_shard * element,
        activation: local * ffn_shard * element,
        hidden_state: local * hidden * element,
    };
    // Token ids and positions are 4-byte integers whatever the model's dtype.
    let integers = 4.0 * (tokens + seq + seq / owners);
    let gathered_key_value = 2.0 * tokens * key_value / owners;
    // A layer keeps its input, attention residual, attention norm and mlp norm outputs (`H` each)
    // and per owner its q, gathered k and v and attention output; selective recompute keeps no
    // attention output, full recompute the input and attention residual only (its backward
    // recomputes the ring's input x beside dy).
    let (kept_hidden, per_owner_attention, recomputed_input) = match workload.recompute {
        Recompute::None => (4.0, 2.0 * local * query / owners + gathered_key_value, 1.0),
        Recompute::Selective => (4.0, local * query / owners + gathered_key_value, 1.0),
        Recompute::Full => (2.0, 0.0, 2.0),
    };
    // (A mixture's shared expert, a ring, keeps its output and gate logit, but under full
    // recompute.)
    let shared_kept = match &model.experts {
        Some(experts) if experts.shared_expert && workload.recompute != Recompute::Full => {
            local * (hidden + 1.0) * element
        }
        _ => 0.0,
    };
    let kept_per_layer = kept_hidden * sizes.hidden_state + shared_kept;
    let (name, ring_bytes) = ring_backward_highest_point(&sizes, tsp);
    // What layer l's MLP (or mixture) backward holds beside its own buffers: the gradients of the
    // layers above it (and the head's) finished, the loss, the token ids and positions, and the
    // kept values of layers 0..=l.
    let up_to_layer = |layer: u64| {
        let below = (layer + 1) as f64;
        vec![
            Term { name: GRADIENTS, bytes: all_grads },
            Term {
                name: "gradients of the layers up to this one and the embedding, not finished yet (removed)",
                bytes: -layer_grads(below) - table * element / shards.dense,
            },
            splits.grads_term(model.layers - layer - 1, false, true),
            Term { name: TIED_HEAD_GRADIENT, bytes: tied_head },
            Term { name: "loss", bytes: element },
            Term { name: "token ids and positions (zigzag and local)", bytes: integers },
            Term {
                name: "each layer's input, attention residual (and attention and mlp norm outputs, unless full recompute) up to this one",
                bytes: below * kept_per_layer,
            },
            Term {
                name: "each layer's q and gathered k, v of every owner (and attention output, without recompute) up to this one",
                bytes: below * owners * per_owner_attention * element,
            },
        ]
    };
    // Layer l's ring runs with the kept values of layers 0..=l still live and the gradients of the
    // layers above finished: kept values grow with l and gradients shrink, so the highest is the
    // first layer's or the last's.
    let ring_phase = |layer: u64| {
        let mut terms = up_to_layer(layer);
        terms.push(Term {
            name: "the mlp ring's output gradient dy (and its input x, recomputed under full recompute)",
            bytes: recomputed_input * sizes.hidden_state,
        });
        if gathers {
            terms.push(Term {
                name: "the layer's MLP weights, gathered over their replicas again for its backward",
                bytes: splits.mlp_gathered,
            });
            if workload.recompute == Recompute::Full {
                terms.push(Term {
                    name: "its MLP norm's weights, gathered over their replicas again for its recomputation",
                    bytes: splits.norm_gathered,
                });
            }
        }
        // A mixture's shared expert is the ring, after its gate vector's backward: beside the
        // layer's output gradient, the gate vector's input and weight gradients and the expert
        // counts summed over the layers, its own kept values freed.
        if model.experts.is_some() {
            terms.extend([
                Term { name: "the layer's output gradient", bytes: sizes.hidden_state },
                Term { name: "the shared expert's gate vector's input gradient", bytes: sizes.hidden_state },
                Term { name: "the shared expert's gate vector's gradient", bytes: hidden * element / shards.dense },
                Term { name: EXPERT_COUNTS_SUMMED, bytes: statistics },
                Term { name: "the layer's shared expert's kept values, freed", bytes: -shared_kept },
            ]);
        }
        terms.push(Term { name, bytes: ring_bytes });
        ForwardPhase { name: "tsp mlp ring backward", params: held_params, terms }
    };
    // (A mixture without a shared expert has no ring.)
    let rings = if model.experts.as_ref().is_none_or(|experts| experts.shared_expert) {
        vec![ring_phase(0), ring_phase(model.layers.saturating_sub(1))]
    } else {
        Vec::new()
    };
    // Every phase but the end's, the highest taken last.
    let mut candidates = rings;
    // A mixture's routed experts, split over tsp (or over ep beside it), are dispatched over that
    // axis in the backward as in the forward: one instruction makes the layer's expert, router and
    // input gradients from a copy of its operands (the MLP norm's output, recomputed under full
    // recompute, the router, the rank's experts and the layer's output gradient), beside the kept
    // values of the layers up to it, the gradients of those above, and (with the load-balancing
    // loss) the router's gradients from it and the expert counts summed over the layers (but in the
    // first layer; without the loss, a shared expert's input gradient); under ZeRO-3 beside the
    // router and the rank's experts gathered over their replicas again (where ZeRO splits them).
    if let Some(experts) = model.experts.as_ref() {
        let router = (experts.count * model.hidden) as f64 * element;
        let local_experts = layer_experts * element;
        let full = workload.recompute == Recompute::Full;
        let shared_gradients = if experts.shared_expert { 3.0 * sizes.matrix + hidden * element } else { 0.0 };
        let dispatch_phases = |layer: u64| {
            // What both points hold: those of the layer's backward, and its output gradient.
            let mut held = up_to_layer(layer);
            held.extend([
                // (Read last by the first layer's load-balancing loss backward, before its dispatch.)
                Term { name: EXPERT_COUNTS_SUMMED, bytes: if layer > 0 { statistics } else { 0.0 } },
                Term { name: "the layer's output gradient", bytes: sizes.hidden_state },
                // A shared expert's ring backward comes first: its kept values freed, its
                // gradients made (its projections' tsp shards and its gate vector's).
                Term { name: "the layer's shared expert's kept values, freed", bytes: -shared_kept },
                Term { name: "the layer's shared expert's gradients", bytes: shared_gradients / shards.dense },
            ]);
            let mut dispatched = held.clone();
            dispatched.extend([
                Term {
                    name: "the layer's MLP norm output, recomputed",
                    bytes: if full { sizes.hidden_state } else { 0.0 },
                },
                Term {
                    name: "the router's gradients from the load-balancing loss (its input's and its weight's)",
                    bytes: if statistics > 0.0 { sizes.hidden_state + router } else { 0.0 },
                },
                // (With the loss a shared expert's input gradient joins the router's from it;
                // without, it is its own buffer, which the experts' input gradient joins next.)
                Term {
                    name: "the shared expert's input gradient",
                    bytes: if experts.shared_expert && !experts.load_balancing_loss { sizes.hidden_state } else { 0.0 },
                },
                Term {
                    name: "the dispatch's copy of its operands",
                    bytes: 2.0 * sizes.hidden_state + router + local_experts,
                },
            ]);
            if gathers {
                dispatched.push(Term {
                    name: "the layer's router and experts, gathered over their replicas again for its backward",
                    bytes: splits.router_gathered + splits.experts_gathered,
                });
                if full {
                    dispatched.push(Term {
                        name: "its MLP norm's weights, gathered over their replicas again for its recomputation",
                        bytes: splits.norm_gathered,
                    });
                }
            }
            let dispatched = ForwardPhase {
                name: "a mixture's experts' backward dispatched",
                params: held_params,
                terms: dispatched,
            };
            // Then the experts' gradients are reduced one by one: over ep beside tsp, which keeps
            // the experts whole (each tsp rank runs its own tokens through the rank's share over
            // ep), all-reduced over tsp (they are partial sums over it), the first's result beside
            // the other two; otherwise under ZeRO-2 and 3 reduce-scattered over dp, made whole,
            // the first staged whole beside the others. As the first is: the router's gradient
            // made (its gradients from the load-balancing loss summed into it and into the MLP norm
            // output's gradient), the dispatch's copy and the MLP norm's output freed. The
            // router's gradient is its shard under ZeRO-2 (whole where its rows do not divide),
            // but under ZeRO-3 beside ep still whole: there the gradient of the router gathered
            // whole is reduce-scattered after the experts' all-reduces.
            let reduction = if ep > 1 {
                Some(("a mixture's expert gradients all-reduced over tsp", "the first expert gradient, all-reduced"))
            } else if scattered {
                Some((
                    "a mixture's expert gradients reduce-scattered",
                    "the first expert gradient's reduce-scatter staging",
                ))
            } else {
                None
            };
            let router_gradient = if ep > 1 && gathers { router } else { router / shards.dense + splits.router };
            let reduced_phase = reduction.map(|(name, first)| {
                let mut terms = held;
                terms.extend([
                    Term {
                        name: "the layer's MLP norm output, freed",
                        bytes: if full { 0.0 } else { -sizes.hidden_state },
                    },
                    Term {
                        name: "the router's gradient (under ZeRO its shard, but whole under ZeRO-3 beside ep)",
                        bytes: router_gradient,
                    },
                    Term { name: "the MLP norm output's gradient", bytes: sizes.hidden_state },
                    Term { name: "the experts' gradients, whole before their reduction", bytes: local_experts },
                    Term { name: first, bytes: local_experts / 3.0 },
                ]);
                ForwardPhase { name, params: held_params, terms }
            });
            std::iter::once(dispatched).chain(reduced_phase)
        };
        candidates.extend(dispatch_phases(0).chain(dispatch_phases(model.layers.saturating_sub(1))));
    }
    // Past the loss's backward (below), the LM head's: every layer's kept values, the final norm's
    // input, its output gathered over the sequence, the logits' gradient (the rank's vocabulary
    // shard), the head's input gradient, and its weight gradient being written. Full recompute
    // gathers the norm's output again first: the recomputed output and the gather's staging copy
    // instead.
    let layers = model.layers as f64;
    let logits = tokens * table / hidden * element;
    // (What the backward's start holds: no gradient yet, the loss, every layer's kept values and
    // the final norm's input.)
    let backward_start = [
        Term { name: GRADIENTS, bytes: all_grads },
        Term { name: "gradients, none finished yet (removed)", bytes: -all_grads },
        Term { name: "loss", bytes: element },
        Term { name: EXPERT_COUNTS_SUMMED, bytes: statistics },
        Term {
            name: "every layer's kept values",
            bytes: layers * (kept_per_layer + owners * per_owner_attention * element),
        },
        Term { name: "the final norm's input", bytes: sizes.hidden_state },
    ];
    let head_phase = |last: Term| {
        let mut terms = backward_start.to_vec();
        terms.extend([
            Term { name: "token ids and positions (zigzag and local)", bytes: integers },
            Term {
                name:
                    "the final norm's output gathered over the sequence (or its staging), and the head's input gradient",
                bytes: 2.0 * every_token,
            },
            Term { name: "the logits' gradient (the rank's vocabulary shard)", bytes: logits },
            last,
        ]);
        ForwardPhase { name: "lm head backward", params: held_params, terms }
    };
    // Before it, the loss's backward: every token's logits (the rank's vocabulary shard, put back
    // in order) beside their gradient and the loss's row statistics gathered over tsp, every
    // layer's kept values, the final norm's input and (but under full recompute) its output
    // gathered over the sequence, and the token ids in both orders.
    let mut loss_backward = backward_start.to_vec();
    loss_backward.extend([
        Term { name: "token ids (in both orders) and positions (zigzag and local)", bytes: integers + 4.0 * tokens },
        Term {
            name: "the final norm's output gathered over the sequence",
            bytes: if workload.recompute == Recompute::Full { 0.0 } else { every_token },
        },
        Term { name: "every token's logits (the rank's vocabulary shard) and their gradient", bytes: 2.0 * logits },
        Term { name: "the loss's row statistics, gathered over tsp", bytes: row_statistics },
    ]);
    candidates.push(ForwardPhase { name: "the loss's backward", params: held_params, terms: loss_backward });
    let mut head = head_phase(Term { name: "the head's weight gradient being written", bytes: table * element });
    if workload.recompute == Recompute::Full {
        let mut gather = head_phase(Term { name: "the final norm's recomputed output", bytes: sizes.hidden_state });
        if gathers {
            // ZeRO-3 gathers the final norm's weights again to recompute it; its backward reads them.
            for phase in [&mut head, &mut gather] {
                phase.terms.push(Term { name: FINAL_NORM_GATHERED, bytes: splits.norm_gathered });
            }
        }
        if gather.bytes() > head.bytes() {
            head = gather;
        }
    }
    candidates.push(head);
    // A layer's attention backward takes the owners last first: for each, the rank's
    // contributions to the owner's q, k, v and o gradients (its block), then their reduces to the
    // owner, o's first; a reduce leaves zeros on the other ranks, and the owners' results are
    // summed as they come. Inside layer `layer`'s, the layers below keep what their forward kept;
    // of the gradients, theirs, the layer's attention's and input norm's, and the embedding's are
    // not done; the positions are live until the first layer's last owner no longer reads them.
    // The first layer's or the last's is the highest (kept values grow with the layer as
    // gradients shrink), at one of the points below.
    let block = (model.attention_weights() + model.attention_biases()) as f64 / owners * element;
    let o_block = hidden * query / owners * element;
    let input_norm = model.norm.params(model.hidden) as f64 * element;
    let owner_query = local * query / owners;
    let inside_attention_backward = |layer: u64, positions: bool| {
        let below = layer as f64;
        let mut terms = vec![
            Term { name: GRADIENTS, bytes: all_grads },
            Term {
                name: "the layers' below it, its attention's and input norm's, and the embedding's gradients, not finished yet (removed)",
                bytes: -layer_grads(below) - (block + input_norm + table * element) / shards.dense,
            },
            splits.grads_term(model.layers - layer - 1, true, true),
            Term { name: TIED_HEAD_GRADIENT, bytes: tied_head },
            Term { name: "loss", bytes: element },
            Term { name: EXPERT_COUNTS_SUMMED, bytes: if layer > 0 { statistics } else { 0.0 } },
            Term { name: "token ids (zigzag)", bytes: 4.0 * tokens },
            Term {
                name: "the layers' below it kept values",
                bytes: below * (kept_per_layer + owners * per_owner_attention * element),
            },
        ];
        if positions || layer > 0 {
            terms.push(Term { name: "positions (zigzag and local)", bytes: 4.0 * (seq + seq / owners) });
        }
        if gathers && workload.recompute == Recompute::Full {
            terms.push(Term {
                name: "its input norm's weights, gathered over their replicas again for its recomputation",
                bytes: splits.norm_gathered,
            });
        }
        terms
    };
    for layer in [0, model.layers.saturating_sub(1)] {
        // At the last owner's dv: one owner's block of attention weight gradients (on two ranks
        // the other owner's, awaiting its reduce; on more, the rank's own, summed from the others'
        // reduces); this owner's q and gathered k, v; the attention output's gradient, o's weight
        // gradient, dq, dk and dv; the layer's input and attention norm output (recomputed under
        // full recompute) and their gradients. Under full recompute also this owner's q, k and v
        // weights broadcast again for the recomputation; otherwise, under ZeRO-3, the layer's q, k
        // and v weights gathered again, which the last owner's input gradients still broadcast
        // (full recompute broadcast them already).
        let full = workload.recompute == Recompute::Full;
        let mut terms = inside_attention_backward(layer, true);
        terms.extend([
            Term {
                name: if full {
                    "the layer's input, its attention norm output recomputed, their gradients"
                } else {
                    "the layer's input, its attention norm output, their gradients"
                },
                bytes: 4.0 * sizes.hidden_state,
            },
            Term {
                name: "one owner's attention weight gradients (in flight to its owner, or the rank's own sum)",
                bytes: block,
            },
            Term {
                name: if full {
                    "this owner's q and gathered k, v recomputed"
                } else {
                    "this owner's q and gathered k, v"
                },
                bytes: (owner_query + gathered_key_value) * element,
            },
            Term {
                name: "the attention output's gradient and o's weight gradient",
                bytes: (owner_query + hidden * query / owners) * element,
            },
            Term { name: "dq, dk and dv", bytes: (owner_query + gathered_key_value) * element },
        ]);
        if full {
            let qkv_weights = (query + 2.0 * key_value) * hidden / owners;
            terms.push(Term { name: "this owner's q, k and v weights, broadcast again", bytes: qkv_weights * element });
            // Under ZeRO-3 the weights gathered again for the owners' broadcasts stay until the
            // last owner's: on three or more ranks the second owner's dv holds them too.
            if gathers && tsp >= 3 {
                let mut second = terms.clone();
                second.push(Term { name: ATTENTION_GATHERED, bytes: splits.attention_gathered() });
                candidates.push(ForwardPhase {
                    name: "an attention backward's second owner's dv",
                    params: held_params,
                    terms: second,
                });
            }
        } else if gathers {
            terms.push(Term {
                name: "the layer's q, k and v weights, gathered over their replicas again for the last owner's input gradients",
                bytes: splits.qkv_gathered,
            });
        }
        candidates.push(ForwardPhase { name: "an attention backward's last owner's dv", params: held_params, terms });
        // As o's gradient of an owner is reduced: the owners' results before that one, summed (a
        // block; none before the first, the axis's last, with `tsp - 1` owners after it), the
        // rank's contributions to that owner's block, the reduce's own buffers, the layer's input,
        // its attention norm's and residual's gradients, and, with `after` owners still to come,
        // the norm's output and those owners' activations.
        let reducing = |name: &'static str, contributions: &'static str, reduce: Term, after: u64| {
            let mut terms = inside_attention_backward(layer, after > 0);
            terms.extend([
                Term {
                    name: "the layer's input, its attention norm's and residual's gradients",
                    bytes: 3.0 * sizes.hidden_state,
                },
                Term { name: contributions, bytes: block },
                reduce,
            ]);
            if after + 1 < tsp {
                terms.push(Term {
                    name: "the owners' reduced attention weight gradients before it, summed",
                    bytes: block,
                });
            }
            if after > 0 {
                if gathers {
                    terms.push(Term { name: ATTENTION_GATHERED, bytes: splits.attention_gathered() });
                }
                terms.extend([
                    Term { name: "the layer's attention norm output", bytes: sizes.hidden_state },
                    Term {
                        name: "the activations of the owners still to come",
                        bytes: after as f64 * per_owner_attention * element,
                    },
                ]);
            }
            ForwardPhase { name, params: held_params, terms }
        };
        // - As o's gradient is reduced to this rank or to another owner.
        for point in tsp_o_reduces(tsp, tsp_rank, o_block) {
            let name = if point.to_this_rank {
                "an attention o gradient reduced to this rank, its owner"
            } else {
                "an attention o gradient reduced to another owner"
            };
            candidates.push(reducing(name, point.contributions, point.reduce, point.after));
        }
        let first = tsp_first_owner_o_reduce(tsp, tsp_rank, o_block);
        let name = if first.to_this_rank {
            "an attention o gradient reduced to this rank, the first owner"
        } else {
            "an attention o gradient reduced to the first owner"
        };
        candidates.push(reducing(name, first.contributions, first.reduce, first.after));
        // - Without full recompute, inside an owner's backward, as q's input gradient is made
        //   from q's gradient after RoPE and q's weights, broadcast again: the rank's
        //   contributions to that owner's k, v and o gradients so far, the layer's attention norm
        //   output (q's weight gradient reads it next) and, with `after` owners still to come,
        //   their activations; the last owner's (the axis's first) or another's.
        if workload.recompute != Recompute::Full {
            let q_weights = hidden * query / owners * element;
            for after in 0..tsp {
                let name = if after == 0 {
                    "an attention backward's last owner's q input gradient"
                } else {
                    "an attention backward's q input gradient, owners still to come"
                };
                let mut phase = reducing(
                    name,
                    "its contributions to the owner's k, v and o gradients",
                    Term { name: "q's gradient after RoPE", bytes: owner_query * element },
                    after,
                );
                for term in phase.terms.iter_mut().filter(|term| term.name.starts_with("its contributions")) {
                    term.bytes -= q_weights;
                }
                // (With owners still to come `reducing` holds the norm's output already.)
                if after == 0 {
                    phase.terms.push(Term { name: "the layer's attention norm output", bytes: sizes.hidden_state });
                }
                phase.terms.extend([
                    Term { name: "the owner's q weights, broadcast again", bytes: q_weights },
                    Term { name: "q's input gradient being made", bytes: sizes.hidden_state },
                ]);
                candidates.push(phase);
            }
        }
    }
    let highest = candidates.into_iter().reduce(|best, phase| if phase.bytes() > best.bytes() { phase } else { best });
    // The end of the backward, as under tp: every gradient, the loss and the whole-vocabulary
    // embedding gradient before the rank's vocabulary shard is sliced from it.
    let whole = (model.vocab * model.hidden) as f64 * element;
    let mut end = ForwardPhase {
        name: "end of backward",
        params: held_params,
        terms: vec![
            Term { name: GRADIENTS, bytes: all_grads },
            splits.grads_term(model.layers, false, true),
            Term { name: TIED_HEAD_GRADIENT, bytes: tied_head },
            Term { name: "loss", bytes: element },
            Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
        ],
    };
    // Under ZeRO-2 the rank's vocabulary shard is sliced first and reduce-scattered over dp (as
    // beside tp): the slice beside the whole, the rank's dp shard of it not written yet.
    if scattered {
        end.terms.extend([
            Term { name: TSP_SHARD_SLICED_BEFORE_DP, bytes: table * element },
            Term { name: ZERO_EMBEDDING_SHARD_NOT_YET_WRITTEN, bytes: -table * element / shards.dense },
        ]);
    }
    // Just before: the whole-vocabulary gradient being scattered from every token's gradient (the
    // sequence all-gathered, `[T, h]`) and the token ids, the rank's vocabulary shard not sliced.
    let scatter = ForwardPhase {
        name: "end of backward",
        params: held_params,
        terms: vec![
            Term { name: GRADIENTS, bytes: all_grads },
            Term {
                name: "embedding gradient's vocabulary shard, not sliced yet (removed)",
                bytes: -table * element / shards.dense,
            },
            splits.grads_term(model.layers, false, true),
            Term { name: TIED_HEAD_GRADIENT, bytes: tied_head },
            Term { name: "loss", bytes: element },
            Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
            Term { name: "every token's gradient, gathered for the embedding's backward", bytes: every_token },
            Term { name: "token ids (zigzag)", bytes: 4.0 * tokens },
        ],
    };
    let end = if scatter.bytes() > end.bytes() { scatter } else { end };
    let mut peak = match highest {
        Some(phase) if phase.bytes() >= end.bytes() => phase,
        _ => end,
    };
    if gathers {
        peak.terms.insert(0, splits.params_term(model.layers));
    }
    Some(peak)
}

/// The term naming a mixture's expert counts summed over the layers (with the load-balancing
/// loss), live from the forward's end until the first layer's load-balancing loss backward.
const EXPERT_COUNTS_SUMMED: &str = "the expert counts summed over the layers";

/// How ZeRO-2 and 3 split a tsp rank's tensors over their replicas (a dense one's dp, then ep; a
/// routed expert's dp): a gradient is reduce-scattered over each axis on its rows (its first dim
/// left above one, after tsp's or ep's split), and under ZeRO-3 a parameter is split so and
/// gathered whole before each use, only where the rows divide (`super::zero_rows`); otherwise it
/// stays whole, or split over fewer axes. Of one layer, on a rank of tsp `tsp` (q, k and v split
/// by heads, gate and up by channels; o, down and the norms keep `h` rows; a mixture's router its
/// `E`, its experts their rank's share), and of the head (the LM head's `V/tsp` rows and the final
/// norm's `h`).
#[derive(Default)]
struct ZeroSplits {
    /// A layer's attention and input norm, its MLP and MLP norm, and the head (the final norm and
    /// an untied LM head), bytes beyond the shards of what is kept whole.
    attention: f64,
    mlp: f64,
    head: f64,
    /// The embedding table's bytes beyond its shard (tied or not: a tied table's gradient is
    /// finished only with the embedding's part, at the end of the backward).
    embedding: f64,
    /// ZeRO-3's gathers, whole: a layer's MLP matrices, its q, k and v weights and its o weights
    /// whose rows divide over dp, and a norm's weights when `h` does.
    mlp_gathered: f64,
    qkv_gathered: f64,
    o_gathered: f64,
    norm_gathered: f64,
    /// A mixture's router's bytes beyond its shard (a part of `mlp`).
    router: f64,
    /// A mixture's router and the rank's routed experts of one layer that ZeRO-3 gathers, whole.
    router_gathered: f64,
    experts_gathered: f64,
}

/// The replicas ZeRO splits a rank's gradients (or parameters) over: a dense one's, and a routed
/// expert's (fewer: ep splits those). 1 where ZeRO does not split them.
struct ParamShards {
    dense: f64,
    expert: f64,
}

impl ParamShards {
    /// A rank's shards of `dense` and of `experts` (bytes or elements), summed.
    fn of(&self, dense: f64, experts: f64) -> f64 {
        dense / self.dense + experts / self.expert
    }
}

impl ZeroSplits {
    /// The splits of a rank of `layout` (tsp, beside dp or ep); nothing split or kept whole
    /// without ZeRO-2 (`scattered` false) or replicas.
    fn new(model: &ModelShape, layout: &Layout, scattered: bool) -> ZeroSplits {
        let (tsp, dp, ep) = (layout.degree(AxisName::Tsp), layout.degree(AxisName::Dp), layout.degree(AxisName::Ep));
        if !scattered {
            return ZeroSplits::default();
        }
        let element = model.dtype_bytes as f64;
        let zero_rows = ZeroRows::new(model, layout);
        // The bytes beyond the closed form's shard (a dense parameter's over dp × ep, an
        // expert's over dp) of a gradient of local `dims` (`copies` of them) whose rows do not
        // divide.
        let beyond_as = |dims: &[u64], copies: u64, expert: bool| {
            let elements = (copies * dims.iter().product::<u64>()) as f64;
            let replicas = if expert { dp } else { dp * ep };
            (zero_rows.shard(dims, elements, expert) - elements / replicas as f64) * element
        };
        let beyond = |dims: &[u64], copies: u64| beyond_as(dims, copies, false);
        let (hidden, head_dim) = (model.hidden, model.head_dim);
        let norms = model.norm.params(hidden) / hidden;
        let heads = |count: u64| {
            let weights = beyond(&[count / tsp, head_dim, hidden], 1);
            let biases = if model.qkv_bias { beyond(&[count / tsp, head_dim], 1) } else { 0.0 };
            weights + biases
        };
        let norm = beyond(&[hidden], norms);
        let ffn = model.ffn / tsp;
        let o_dims = [hidden, model.heads / tsp, head_dim];
        let attention = heads(model.heads) + 2.0 * heads(model.kv_heads) + beyond(&o_dims, 1) + norm;
        let projections = if model.gated_mlp { 2.0 } else { 1.0 };
        // The dense MLP (or a mixture's shared expert), and a mixture's router, shared expert's
        // gate vector and the rank's routed experts.
        let mut mlp = projections * beyond(&[ffn, hidden], 1) + beyond(&[hidden, ffn], 1) + norm;
        let expert_dims = ZeroRows::expert_dims(model, layout);
        let router_dims = model.experts.as_ref().map(|experts| [experts.count, hidden]);
        let router = router_dims.map_or(0.0, |dims| beyond(&dims, 1));
        if let Some(experts) = &model.experts {
            mlp += router;
            if experts.shared_expert {
                mlp += beyond(&[hidden], 1);
            }
            mlp += expert_dims.iter().map(|dims| beyond_as(dims, 1, true)).sum::<f64>();
        }
        let vocab = model.vocab.div_ceil(tsp);
        let table = beyond(&[vocab, hidden], 1);
        let head = if model.tied_embeddings { 0.0 } else { table } + beyond(&[hidden], norms);
        let embedding = table;
        // The bytes of a parameter of local `dims` (`copies` of them) that ZeRO-3 splits, gathered
        // whole.
        let gathered_as = |dims: &[u64], copies: u64, expert: bool| {
            if zero_rows.splits(dims, expert) {
                (copies * dims.iter().product::<u64>()) as f64 * element
            } else {
                0.0
            }
        };
        let gathered = |dims: &[u64], copies: u64| gathered_as(dims, copies, false);
        let mlp_gathered = projections * gathered(&[ffn, hidden], 1) + gathered(&[hidden, ffn], 1);
        let gathered_heads = |count: u64| {
            let weights = gathered(&[count / tsp, head_dim, hidden], 1);
            let biases = if model.qkv_bias { gathered(&[count / tsp, head_dim], 1) } else { 0.0 };
            weights + biases
        };
        let qkv_gathered = gathered_heads(model.heads) + 2.0 * gathered_heads(model.kv_heads);
        let o_gathered = gathered(&o_dims, 1);
        let norm_gathered = gathered(&[hidden], norms);
        let router_gathered = router_dims.map_or(0.0, |dims| gathered(&dims, 1));
        let experts_gathered =
            if model.experts.is_some() { expert_dims.iter().map(|dims| gathered_as(dims, 1, true)).sum() } else { 0.0 };
        ZeroSplits {
            attention,
            mlp,
            head,
            embedding,
            mlp_gathered,
            qkv_gathered,
            o_gathered,
            norm_gathered,
            router,
            router_gathered,
            experts_gathered,
        }
    }

    /// A layer's attention weights ZeRO-3 gathers, whole.
    fn attention_gathered(&self) -> f64 {
        self.qkv_gathered + self.o_gathered
    }

    /// ZeRO-3's parameters kept whole, beyond their shards: every layer's, the head's and the
    /// embedding's.
    fn params_term(&self, layers: u64) -> Term {
        Term {
            name: PARAMS_KEPT_WHOLE,
            bytes: layers as f64 * (self.attention + self.mlp) + self.head + self.embedding,
        }
    }

    /// The term of `layers` finished layers (and the MLP of one more, with `mlp`), and the head's
    /// with `head`.
    fn grads_term(&self, layers: u64, mlp: bool, head: bool) -> Term {
        let bytes = layers as f64 * (self.attention + self.mlp)
            + if mlp { self.mlp } else { 0.0 }
            + if head { self.head } else { 0.0 };
        Term { name: GRADS_KEPT_WHOLE, bytes }
    }
}

/// Bytes of one MLP matrix's shard, one activation of the rank's tokens and one hidden state.
struct RingSizes {
    matrix: f64,
    activation: f64,
    hidden_state: f64,
}

/// The most bytes the MLP ring's backward holds at once on a rank, beyond its operands, and where:
/// the largest over its steps of the points below (`M`, `A`, `H` as in
/// [`compiled_tsp_training_peak`]). A step computes down's gradient part from the recomputed
/// gate, up and their product, then the activations' gradients, then gate's and up's parts and
/// the input gradient's two parts; each weight part is added to the one received with the shard
/// (from step 1 on) and sent on, or at the last step is the owner's finished gradient.
/// - step 0 (a received shard, `3M`): down's part written beside gate, up and their product
///   (`3A + M`), the activations' gradients beside gate and up (`4A`), the input gradient's
///   first part (`2A + H`) or second part added to the first (`A + 3H`);
/// - a middle step (D >= 3; the shard, `3M`, and the input gradient so far, `H`): as step 0, or a
///   part received, the rank's own and their sum beside two activations (`2A + 3M`), or an input
///   gradient part added (`2A + 2H`);
/// - the last step (the owner's own shard, a parameter; the input gradient so far, `H`): as a
///   middle step, but each finished gradient stays (down's, then gate's: up to `A + 5M` at up's sum).
fn ring_backward_highest_point(sizes: &RingSizes, degree: u64) -> (&'static str, f64) {
    let RingSizes { matrix: m, activation: a, hidden_state: h } = *sizes;
    let mut points: Vec<(&'static str, f64)> = vec![
        ("mlp ring backward, step 0: the shard, down's part beside gate, up and their product", 3.0 * m + 3.0 * a + m),
        ("mlp ring backward, step 0: the shard, gate, up and the activations' gradients", 3.0 * m + 4.0 * a),
        ("mlp ring backward, step 0: the shard, the input gradient's first part", 3.0 * m + 2.0 * a + h),
        ("mlp ring backward, step 0: the shard, the input gradient's parts summed", 3.0 * m + a + 3.0 * h),
    ];
    if degree >= 3 {
        let middle = 3.0 * m + h;
        points.extend([
            (
                "mlp ring backward, middle step: the shard, down's part beside gate, up and their product",
                middle + 3.0 * a + m,
            ),
            (
                "mlp ring backward, middle step: the shard, a received part, the rank's and their sum",
                middle + 2.0 * a + 3.0 * m,
            ),
            ("mlp ring backward, middle step: the shard, gate, up and the activations' gradients", middle + 4.0 * a),
            ("mlp ring backward, middle step: the shard, an input gradient part added", middle + 2.0 * a + 2.0 * h),
        ]);
    }
    points.extend([
        ("mlp ring backward, last step: down's part beside gate, up and their product", h + 3.0 * a + m),
        ("mlp ring backward, last step: down's gradient finished", h + 2.0 * a + 3.0 * m),
        ("mlp ring backward, last step: down's gradient, gate, up and the activations' gradients", h + 4.0 * a + m),
        ("mlp ring backward, last step: down's gradient, gate's finished", h + 2.0 * a + 4.0 * m),
        ("mlp ring backward, last step: two gradients, an input gradient part added", h + 2.0 * a + 2.0 * h + 2.0 * m),
        ("mlp ring backward, last step: two gradients, up's finished", h + a + 5.0 * m),
        ("mlp ring backward, last step: three gradients, the input gradient's last part", h + a + 2.0 * h + 3.0 * m),
    ]);
    points.into_iter().fold(("", f64::NEG_INFINITY), |best, point| if point.1 > best.1 { point } else { best })
}

/// The terms by which the compiled training step's peak `phase` (from [`compiled_training_peak`])
/// differs from [`super::memory`]'s training peak `memory` of the same model, layout and workload:
/// `memory.peak_bytes` plus these is `phase.bytes()`. Removed (negative): the optimizer state (kept
/// beside the program), the activations kept for the backward (all freed at the peak), and the
/// closed form's larger-of-logits-and-transients; added: the phase's live buffers but the weights
/// and gradients, which the closed form counts already.
pub fn training_differences_from_closed_form(memory: &MemoryBreakdown, phase: &ForwardPhase) -> Vec<Term> {
    let grads: f64 = phase.terms.iter().filter(|term| term.name == GRADIENTS).map(|term| term.bytes).sum();
    let mut terms = vec![
        Term { name: "optimizer state (kept beside the program)", bytes: -memory.optimizer_bytes },
        Term { name: "activations kept for the backward (freed at the peak)", bytes: -memory.activations_bytes },
        Term {
            name: "closed form's logits or layer transients",
            bytes: -f64::max(memory.logits_bytes, memory.transient_bytes),
        },
        // Zero when the closed form's weights and gradients are the program's (the test checks).
        Term {
            name: "parameters and gradients the closed form counts otherwise",
            bytes: phase.params + grads - memory.params_bytes - memory.grads_bytes,
        },
    ];
    // The closed form's own gradients stand for the phase's.
    terms.extend(phase.terms.iter().filter(|term| term.name != GRADIENTS).cloned());
    terms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::memory::memory_per_stage;
    use pleat_ir::model::preset::preset;

    fn tiny() -> ModelShape {
        ModelShape::from_config(&preset("tiny").unwrap())
    }

    fn extra(phase: &ForwardPhase) -> f64 {
        phase.terms.iter().filter(|term| term.name != GRADIENTS).map(|term| term.bytes).sum()
    }

    #[test]
    fn training_peak_by_hand() {
        // tiny on tp=2: 180864 parameter elements a rank; twice that in bytes for weights and
        // gradients, the loss, and the embedding's gradient over the whole vocabulary (256·128).
        let model = tiny();
        let workload = Workload::training(8, 2);
        let layout = Layout::new(&[(AxisName::Tp, 2)], false);
        let phase = compiled_training_peak(&model, &layout, &workload).unwrap();
        assert_eq!(phase.params, 180864.0 * 4.0);
        assert_eq!(phase.bytes(), 2.0 * 180864.0 * 4.0 + 4.0 + 256.0 * 128.0 * 4.0);
        let memory = &memory_per_stage(&model, &layout, &workload)[0];
        let sum: f64 = training_differences_from_closed_form(memory, &phase).iter().map(|term| term.bytes).sum();
        assert!((memory.peak_bytes + sum - phase.bytes()).abs() < 1e-6);
    }

    #[test]
    fn head_of_backward_by_hand() {
        // tiny on one rank, four sequences of 128 (T = 512 tokens): the loss's backward peaks,
        // every activation kept and the logits beside their gradient. A layer keeps its two norms'
        // outputs, its attention residual and its output ([T, 128] each: 4·262144 bytes), q after
        // RoPE and attention's output ([T, 128] each), gate, up and their product ([T, 256] each:
        // together 512·(128 + 128 + 768)·4 = 2097152), and k and v after RoPE ([T, 64] each:
        // 262144): 3407872 bytes. Beside two of those: the weights (361088 elements), the token
        // ids (2048) and positions (512), the embedding's output (262144), the final norm's output
        // (262144), the loss (4), and the logits and their gradient ([T, 256]: 524288 each).
        let model = tiny();
        let phase = compiled_training_peak(&model, &Layout::new(&[], false), &Workload::training(128, 4)).unwrap();
        assert_eq!(phase.name, "the loss's backward");
        let expected = 361088.0 * 4.0 + 2.0 * 3407872.0 + 2048.0 + 512.0 + 2.0 * 262144.0 + 4.0 + 2.0 * 524288.0;
        assert_eq!(phase.bytes(), expected);
        // On eight tokens the gradients outweigh the activations: the end of the backward peaks.
        let few = compiled_training_peak(&model, &Layout::new(&[], false), &Workload::training(8, 1)).unwrap();
        assert_eq!(few.name, "end of backward");
    }

    #[test]
    fn dp_by_tp_peaks_as_tp_alone_by_hand() {
        // dp=2 x tp=2 slices the embedding gradient's tp shard before the dp all-reduce: the same
        // buffers as tp=2 are live at the end of the backward.
        let model = tiny();
        let workload = Workload::training(8, 1);
        let tp = compiled_training_peak(&model, &Layout::new(&[(AxisName::Tp, 2)], false), &workload).unwrap();
        let layout = Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 2)], false);
        let dp_tp = compiled_training_peak(&model, &layout, &workload).unwrap();
        assert_eq!(dp_tp.params, tp.params);
        assert_eq!(extra(&dp_tp), extra(&tp));
    }

    #[test]
    fn tsp_peak_by_hand() {
        // tiny on tsp=2 (180864 parameter elements a rank: a layer 73984, the embedding's shard
        // 128·128). Two sequences of 8 tokens: the end of the backward peaks, every gradient with
        // the loss and the whole [256, 128] embedding gradient.
        let model = tiny();
        let layout = Layout::new(&[(AxisName::Tsp, 2)], false);
        let few = compiled_tsp_training_peak(&model, &layout, &Workload::training(8, 2), 0).unwrap();
        assert_eq!((few.name, few.bytes()), ("end of backward", (2.0 * 180864.0 + 1.0 + 256.0 * 128.0) * 4.0));
        // Two of 64 (T = 128, 64 a rank): the first layer's ring peaks, at its last step as up's
        // gradient is finished. Beside the weights: the second layer's gradients and the head's
        // (180864 - 73984 - 16384), the loss, token ids and positions (128 + 64 + 32, 4 bytes),
        // the layer's input, attention norm, attention residual and mlp norm [64, 128], per owner
        // q and attention [64, 64] and k, v [128, 32], dy [64, 128]; in the ring the input
        // gradient so far [64, 128], up's gradient part [64, 128], and the part received, the
        // rank's own and the finished down, gate and up gradients (5 of [128, 128]).
        let many = compiled_tsp_training_peak(&model, &layout, &Workload::training(64, 2), 0).unwrap();
        let elements = 180864.0 * 2.0 - 73984.0 - 16384.0
            + 1.0
            + (128.0 + 64.0 + 32.0)
            + 4.0 * 64.0 * 128.0
            + 2.0 * (2.0 * 64.0 * 64.0 + 2.0 * 128.0 * 32.0)
            + 64.0 * 128.0
            + 64.0 * 128.0
            + 64.0 * 128.0
            + 5.0 * 128.0 * 128.0;
        assert_eq!(many.name, "tsp mlp ring backward");
        assert_eq!(
            many.terms.last().map(|term| term.name),
            Some("mlp ring backward, last step: two gradients, up's finished")
        );
        assert_eq!(many.bytes(), elements * 4.0);
        // Beside dp, a replica's two sequences peak as tsp's alone do; tsp beside tp is not
        // modelled.
        let beside_dp = Layout::new(&[(AxisName::Dp, 2), (AxisName::Tsp, 2)], false);
        assert_eq!(compiled_tsp_training_peak(&model, &beside_dp, &Workload::training(64, 2), 0).as_ref(), Some(&many));
        // ZeRO-2 holds the dp half of each finished gradient (every row count of tiny at tsp=2
        // divides over dp=2, so none is kept whole).
        let zero2 = Workload { zero: 2, ..Workload::training(8, 2) };
        let phase = compiled_tsp_training_peak(&model, &beside_dp, &zero2, 0).expect("ZeRO-2 is modelled");
        let term = |name: &str| phase.terms.iter().find(|term| term.name.starts_with(name)).map(|term| term.bytes);
        assert_eq!(term(GRADIENTS), Some(180864.0 * 4.0 / 2.0));
        assert_eq!(term("finished gradients ZeRO-2 keeps whole"), Some(0.0));
        // ZeRO-3 on two sequences of 64: the dp half of the weights (90432) and of the finished
        // gradients make the last layer's ring peak, with both layers' kept values and only the
        // head's gradients finished ((180864 - 2·73984 - 16384) / 2), and the layer's three MLP
        // matrices gathered whole again for its backward (3 of [128, 128]).
        let zero3 = Workload { zero: 3, ..Workload::training(64, 2) };
        let phase = compiled_tsp_training_peak(&model, &beside_dp, &zero3, 0).expect("ZeRO-3 is modelled");
        let elements = 90432.0
            + (180864.0 - 2.0 * 73984.0 - 16384.0) / 2.0
            + 1.0
            + (128.0 + 64.0 + 32.0)
            + 2.0 * 4.0 * 64.0 * 128.0
            + 2.0 * 2.0 * (2.0 * 64.0 * 64.0 + 2.0 * 128.0 * 32.0)
            + 64.0 * 128.0
            + 3.0 * 128.0 * 128.0
            + 2.0 * 64.0 * 128.0
            + 5.0 * 128.0 * 128.0;
        assert_eq!(phase.name, "tsp mlp ring backward");
        assert_eq!(phase.bytes(), elements * 4.0);
        let beside_tp = Layout::new(&[(AxisName::Tp, 2), (AxisName::Tsp, 2)], false);
        assert_eq!(compiled_tsp_training_peak(&model, &beside_tp, &Workload::training(8, 2), 0), None);
        // Under ZeRO-2 a mixture whose rank's experts (8 over tsp=4: 2 rows) do not divide over
        // dp=4 keeps their gradients whole, as q's (8 heads over tsp=4: 2 rows): at the end of
        // the backward, beyond their quarters, three quarters of each layer's three [2, 64, 128]
        // expert gradients and of its [2, 16, 128] q gradient, two layers.
        let mixture = ModelShape::from_config(&preset("tiny-moe").unwrap());
        let dp_tsp = Layout::new(&[(AxisName::Dp, 4), (AxisName::Tsp, 4)], false);
        let zero2 = Workload { zero: 2, ..Workload::training(8, 2) };
        let phase = compiled_tsp_training_peak(&mixture, &dp_tsp, &zero2, 0).expect("ZeRO-2 is modelled");
        let term = |phase: &ForwardPhase, name: &str| phase.terms.iter().find(|term| term.name == name).unwrap().bytes;
        assert_eq!(phase.name, "end of backward");
        assert_eq!(term(&phase, GRADS_KEPT_WHOLE), 2.0 * 0.75 * (3.0 * 2.0 * 64.0 * 128.0 + 2.0 * 16.0 * 128.0) * 4.0);
        // Beside ep, ZeRO-2 shards a dense gradient over dp × ep and a routed expert's over dp
        // alone: at ep=2 without dp each rank's experts (4 of 8, three [4, 64, 128] matrices a
        // layer, two layers) stay whole and the rest is halved.
        let ep_tsp = Layout::new(&[(AxisName::Ep, 2), (AxisName::Tsp, 2)], false);
        let experts = 2.0 * 3.0 * 4.0 * 64.0 * 128.0 * 4.0;
        let unsharded = compiled_tsp_training_peak(&mixture, &ep_tsp, &Workload::training(8, 1), 0).unwrap();
        let zero2 = Workload { zero: 2, ..Workload::training(8, 1) };
        let sharded = compiled_tsp_training_peak(&mixture, &ep_tsp, &zero2, 0).expect("ZeRO-2 beside ep is modelled");
        assert_eq!(term(&sharded, GRADIENTS), (term(&unsharded, GRADIENTS) - experts) / 2.0 + experts);
    }

    #[test]
    fn zero_shards_by_hand() {
        // tiny whole: 361088 elements. dp=4: ZeRO-2 keeps a quarter of the gradients (90272
        // elements), ZeRO-3 also of the weights; both stage the whole [256, 128] embedding gradient
        // (32768 elements) while its [64, 128] shard (8192) is not written yet.
        let model = tiny();
        let layout = Layout::new(&[(AxisName::Dp, 4)], false);
        for zero in [1u8, 2, 3] {
            let workload = Workload { zero, ..Workload::training(8, 1) };
            let phase = compiled_training_peak(&model, &layout, &workload).unwrap();
            let params = if zero >= 3 { 90272.0 } else { 361088.0 };
            let grads = if zero >= 2 { 90272.0 } else { 361088.0 };
            let staged = if zero >= 2 { 32768.0 - 8192.0 } else { 0.0 };
            assert_eq!(phase.bytes(), (params + grads + 1.0 + 32768.0 + staged) * 4.0, "zero {zero}");
        }
        // dp=2 x tp=2 (180864 elements a rank under tp): ZeRO-2 and 3 slice the [128, 128] tp shard
        // beside the whole [256, 128] gradient; the [64, 128] shard is not written yet.
        let dp_tp = Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 2)], false);
        for (zero, params, extra) in [(2u8, 180864.0, 16384.0), (3, 90432.0, 16384.0)] {
            let workload = Workload { zero, ..Workload::training(8, 1) };
            let phase = compiled_training_peak(&model, &dp_tp, &workload).unwrap();
            assert_eq!(phase.bytes(), (params + 90432.0 + 1.0 + 32768.0 + extra - 8192.0) * 4.0, "zero {zero}");
        }
        // Not modelled: tsp and pp.
        let tsp = Layout::new(&[(AxisName::Tsp, 2)], false);
        assert_eq!(compiled_training_peak(&model, &tsp, &Workload::training(8, 1)), None);
    }
}
