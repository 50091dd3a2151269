//! The peak of a compiled training step (forward and backward of one rank's program), from closed
//! forms, term by term.
//!
//! The step peaks at the end of its backward, when the embedding's gradient is computed: by then
//! every activation the backward kept is freed (whatever was recomputed: recomputation changes
//! what the backward holds before this point, not at it), and live are the parameters, the gradient
//! of every parameter (each an output of the program), the loss, and the embedding's gradient over
//! the whole vocabulary `[V, h]` (the scatter-add of the token gradients), before tp slices the
//! rank's vocabulary shard from it or dp reduces it. What the layout does to that whole-vocabulary
//! gradient at the peak is the rest:
//! - **tp** (with or without Megatron SP): slices its vocabulary shard, a gradient output (counted
//!   with the gradients). **dp** and **cp**: all-reduce it into the gradient output.
//! - **dp × tp**: slices the tp shard first and all-reduces only the `[V/tp, h]` shard over dp
//!   (autodiff slices before it reduces), so it peaks as tp alone does.
//! - **ZeRO-2 and 3** over dp: reduce-scatter it instead, so the executor stages the whole input
//!   (`[V, h]` more) while the rank's `[V/dp, h]` gradient shard is not written yet. ZeRO-2 also
//!   holds only a dp shard of every other gradient, ZeRO-3 also of every parameter (nothing is
//!   gathered at this point: the embedding's backward reads no weight). ZeRO-1 changes the
//!   optimizer's layout only, so its program is plain dp's.
//!
//! [`training_differences_from_closed_form`] names every term by which the closed form of
//! [`super::memory`] differs from this, so that `closed form + differences = planner` to the byte
//! (`tests/cost_training.rs` checks tp and tp with Megatron SP at 2 and 4, dp at 2 and 4, cp,
//! dp × tp, ZeRO 1 to 3 at dp 2 and 4, and selective and full recomputation). tsp peaks inside the
//! first layer's MLP backward instead: [`compiled_tsp_training_peak`] models tsp=2, rank by rank.
//! Pipelined stages (which hold each micro-batch's gradients beside their running sums, and the
//! other micro-batches' activations) peak elsewhere too and are not modelled:
//! [`compiled_training_peak`] returns `None` for them.

use pleat_ir::AxisName;

use super::compiled::ForwardPhase;
use super::layout::Layout;
use super::memory::{stage_params, MemoryBreakdown, Term};
use super::model::ModelShape;
use super::workload::{Recompute, Workload};

/// The name of the gradients' term of [`compiled_training_peak`].
pub const GRADIENTS: &str = "gradients of every parameter";

/// The whole-vocabulary embedding gradient `[V, h]`: the scatter-add of the token gradients into
/// every row of the table, before tp slices the rank's rows from it or dp reduces it.
pub const WHOLE_EMBEDDING_GRADIENT: &str =
    "embedding gradient over the whole vocabulary (before it is sliced or reduced)";

/// ZeRO-2 and 3: the executor's staging of the reduce-scatter of the whole-vocabulary embedding
/// gradient: its whole input, `[V, h]`, held while the collective runs, which is the step's peak.
pub const ZERO_REDUCE_SCATTER_STAGING: &str = "reduce-scatter staging of the whole-vocabulary embedding gradient";

/// ZeRO-2 and 3: the rank's `[V/dp, h]` embedding gradient shard, counted with the (dp-sharded)
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

/// The peak of a compiled training step on one rank of `layout` (no pipelining; any recompute),
/// or `None` where the step peaks in a phase not modelled here: a tsp or pp axis, or ZeRO-2/3
/// with an axis beside dp. `workload` is in the cost model's terms (`micro_batch` sequences a
/// replica). The phase's `params` are the program's (a dp shard under ZeRO-3); its terms are the
/// gradients (a dp shard under ZeRO-2 and 3), the loss, the whole-vocabulary embedding gradient and
/// the layout's terms of the module doc. The optimizer's moments are not the program's: the
/// executor adds them beside it.
pub fn compiled_training_peak(model: &ModelShape, layout: &Layout, workload: &Workload) -> Option<ForwardPhase> {
    let dp = layout.degree(AxisName::Dp);
    let zero = if dp > 1 { zero_stage(workload) } else { 0 };
    let beside_dp = layout.world_size() / dp;
    if layout.degree(AxisName::Tsp) > 1 || layout.degree(AxisName::Pp) > 1 || (zero >= 2 && beside_dp > 1) {
        return None;
    }
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let element = model.dtype_bytes as f64;
    let all_params = stage_params(model, layout, &compiled, 0, model.layers) * element;
    let dp = dp as f64;
    let params = if zero >= 3 { all_params / dp } else { all_params };
    let grads = if zero >= 2 { all_params / dp } else { all_params };
    let whole = (model.vocab * model.hidden) as f64 * element;
    let mut terms = vec![
        Term { name: GRADIENTS, bytes: grads },
        Term { name: "loss", bytes: element },
        Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
    ];
    if zero >= 2 {
        terms.push(Term { name: ZERO_REDUCE_SCATTER_STAGING, bytes: whole });
        terms.push(Term { name: ZERO_EMBEDDING_SHARD_NOT_YET_WRITTEN, bytes: -whole / dp });
    }
    Some(ForwardPhase { name: "end of backward", params, terms })
}

/// tsp=2's compiled training step on `rank` (0 or 1): the larger of two phases, the end of the
/// first layer's MLP backward (below) and the end of the backward (as [`compiled_training_peak`]
/// under tp: every gradient, the loss and the whole-vocabulary embedding gradient), or `None` for
/// any other layout (tsp at other degrees, or beside other axes, is not modelled). On `tiny` the
/// MLP phase is the larger but on rank 1 with selective recompute.
///
/// Under tsp the MLP's backward runs each owner's shard in turn, the owners in reverse (owner 1,
/// then owner 0), re-receiving the owner's weights by broadcast; each rank computes its
/// contribution to the owner's weight gradients and sends it to the owner, which adds it to its
/// own (the conjugate of the broadcast). The phase's highest point is the last of these sums, the
/// down projection's of owner 0, on each rank. Live then, beside the parameters (`T` the step's
/// tokens, `D = 2`, `q` and `kv` the query and key/value widths, `f` the MLP's):
/// - the gradients finished so far: every parameter's but the first layer's and the embedding's;
/// - what the first layer's attention backward (still to run) reads: the whole batch's token ids
///   in zigzag order, the zigzag and local positions, the embedding's output (the layer's input),
///   the attention norm's output and the attention residual (`[T/D, h]` each), and for each owner
///   its q and attention output (`[T/D, q/D]`) and its gathered k and v (`[T, kv/D]`); selective
///   recompute keeps no attention output, full recompute only the input and the attention residual
///   (the rest is recomputed when the attention's backward runs, after the peak);
/// - the loss, and the gradients of the layer's output and of the MLP norm's output (`[T/D, h]`);
/// - owner 1's MLP shard gradients (gate, up, down: `3·h·f/D`), finished earlier: on rank 1 the
///   reduced sums, on rank 0 the zeros that are its share of that reduction;
/// - the rank's contributions to owner 0's gate, up and down gradients (`3·h·f/D`), kept until the
///   sums that read them are done;
/// - owner 0's down-projection gradient being written (`h·f/D`: the sum on rank 0, zeros on rank 1);
/// - on rank 0 only, rank 1's contribution to it, just received (`h·f/D`).
pub fn compiled_tsp_training_peak(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    rank: u32,
) -> Option<ForwardPhase> {
    let tsp = layout.degree(AxisName::Tsp);
    if tsp != 2 || layout.world_size() != tsp || rank >= 2 {
        return None;
    }
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let element = model.dtype_bytes as f64;
    let all_params = stage_params(model, layout, &compiled, 0, model.layers) * element;
    let first_layer = stage_params(model, layout, &compiled, 1, 1) - stage_params(model, layout, &compiled, 1, 0);
    let table = (model.vocab as f64 / tsp as f64).ceil() * model.hidden as f64;
    let owners = tsp as f64;
    let (seq, tokens) = (workload.seq as f64, (workload.seq * workload.micro_batch) as f64);
    let local = tokens / owners;
    let hidden = model.hidden as f64;
    let (query, key_value) = (model.query_width() as f64, model.kv_width() as f64);
    // One of the MLP's three matrices, one owner's shard.
    let matrix = model.mlp_weights() as f64 / 3.0 / owners * element;
    // Token ids and positions are 4-byte integers whatever the model's dtype.
    let integers = 4.0 * (tokens + seq + seq / owners);
    // What the first layer keeps for its attention backward: full recompute keeps the residual
    // stream only (the layer's input and attention residual), selective also the attention norm's
    // output and each owner's q and gathered k and v, none also each owner's attention output.
    let gathered_key_value = 2.0 * tokens * key_value / owners;
    let (kept_hidden, per_owner_attention) = match workload.recompute {
        Recompute::None => (3.0, 2.0 * local * query / owners + gathered_key_value),
        Recompute::Selective => (3.0, local * query / owners + gathered_key_value),
        Recompute::Full => (2.0, 0.0),
    };
    let mut terms = vec![
        Term { name: GRADIENTS, bytes: all_params },
        Term {
            name: "gradients of the first layer and the embedding, not finished yet (removed)",
            bytes: -(first_layer + table) * element,
        },
        Term { name: "loss", bytes: element },
        Term { name: "first layer's token ids and positions (zigzag and local)", bytes: integers },
        Term {
            name: "first layer's input and attention residual (and attention norm output, unless full recompute)",
            bytes: kept_hidden * local * hidden * element,
        },
        Term {
            name: "first layer's q and gathered k, v of every owner (and attention output, without recompute)",
            bytes: owners * per_owner_attention * element,
        },
        Term {
            name: "gradients of the layer's output and of the mlp norm's output",
            bytes: 2.0 * local * hidden * element,
        },
        Term { name: "owner 1's mlp shard gradients (reduced on the owner, zeros elsewhere)", bytes: 3.0 * matrix },
        Term { name: "this rank's contributions to owner 0's mlp shard gradients", bytes: 3.0 * matrix },
        Term { name: "owner 0's down-projection gradient being summed", bytes: matrix },
    ];
    if rank == 0 {
        terms.push(Term {
            name: "rank 1's contribution to owner 0's down-projection gradient (received)",
            bytes: matrix,
        });
    }
    let mlp = ForwardPhase { name: "tsp first layer's mlp backward", params: all_params, terms };
    // The end of the backward, as under tp: every gradient, the loss and the whole-vocabulary
    // embedding gradient before the rank's vocabulary shard is sliced from it.
    let whole = (model.vocab * model.hidden) as f64 * element;
    let end = ForwardPhase {
        name: "end of backward",
        params: all_params,
        terms: vec![
            Term { name: GRADIENTS, bytes: all_params },
            Term { name: "loss", bytes: element },
            Term { name: WHOLE_EMBEDDING_GRADIENT, bytes: whole },
        ],
    };
    Some(if end.bytes() > mlp.bytes() { end } else { mlp })
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
        // tiny on tsp=2, 2 sequences of 8: T = 16, 8 local. Parameters 180864 elements; the first
        // layer (73984) and the embedding's shard (128·128) have no gradient yet. Integers 16 + 8 +
        // 4; three [8, 128]; per owner q and attention [8, 64] and k, v [16, 32]; two [8, 128];
        // 3 + 3 + 1 (+ 1 on rank 0) matrices of 128·128.
        let model = tiny();
        let layout = Layout::new(&[(AxisName::Tsp, 2)], false);
        let workload = Workload::training(8, 2);
        let rank1 = 180864.0 * 2.0 - (73984.0 + 16384.0)
            + 1.0
            + (16.0 + 8.0 + 4.0)
            + 3.0 * 8.0 * 128.0
            + 2.0 * (2.0 * 8.0 * 64.0 + 2.0 * 16.0 * 32.0)
            + 2.0 * 8.0 * 128.0
            + 7.0 * 128.0 * 128.0;
        let peak = |rank| compiled_tsp_training_peak(&model, &layout, &workload, rank).unwrap().bytes();
        assert_eq!(peak(1), rank1 * 4.0);
        assert_eq!(peak(0), (rank1 + 128.0 * 128.0) * 4.0);
        assert_eq!(compiled_tsp_training_peak(&model, &Layout::new(&[(AxisName::Tsp, 4)], false), &workload, 0), None);
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
        // Not modelled: ZeRO-2 beside another axis, tsp and pp.
        let zero2 = Workload { zero: 2, ..Workload::training(8, 1) };
        let dp_tp = Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 2)], false);
        assert_eq!(compiled_training_peak(&model, &dp_tp, &zero2), None);
        let tsp = Layout::new(&[(AxisName::Tsp, 2)], false);
        assert_eq!(compiled_training_peak(&model, &tsp, &Workload::training(8, 1)), None);
    }
}
