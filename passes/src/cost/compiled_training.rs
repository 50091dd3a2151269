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
//! first layer's MLP ring backward instead: [`compiled_tsp_training_peak`] models tsp at any degree.
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

/// A compiled tsp training step (tsp of degree D >= 2 the only axis; every rank peaks alike): the
/// largest of the first layer's MLP-ring backward at its highest points (below) and the end of the
/// backward (as [`compiled_training_peak`] under tp: every gradient, the loss and the
/// whole-vocabulary embedding gradient), or `None` for any other layout (tsp beside other axes is
/// not modelled). On `tiny` the ring's phase is the larger but with full recompute on few tokens.
///
/// The MLP's backward runs the ring again (`ring_gated_mlp_grad`, docs/training.md): in step s the
/// rank holds the shard of the rank s before it, recomputes its activations on its own tokens and
/// adds the shard's part to its input gradient and its tokens' part to the shard's gradient, which
/// travels on with the shard. Beside the parameters, at any point of a step s >= 1 (`T` the step's
/// tokens, `q` and `kv` the query and key/value widths, `f` the MLP's, `M` one MLP matrix's shard
/// `h·f/D`, `A` one activation `[T/D, f/D]`, `H` one hidden state `[T/D, h]`):
/// - the gradients finished so far: every parameter's but the first layer's and the embedding's
///   (the ring writes the layer's MLP gradients at its end);
/// - what the first layer's attention backward (still to run) reads: the whole batch's token ids
///   in zigzag order, the zigzag and local positions, the layer's input, the attention norm's output
///   and the attention residual (`H` each), and for each owner its q and attention output
///   (`[T/D, q/D]`) and its gathered k and v (`[T, kv/D]`); selective recompute keeps no attention
///   output, full recompute only the input and the attention residual;
/// - the loss, the ring's operand x and its output's gradient dy (`H` each);
/// - the owner's own tokens' part of its shard's gradients, kept from step 0 (`3M`), the shard held
///   (`3M`), and the input gradient summed so far (`H`);
/// - and what the step holds at its highest point, the largest of: the recomputed gate, up and
///   their product with down's gradient part being written (`3A + M`); for D >= 3, a part received
///   with the shard, the rank's own and their sum (`2A + 3M`, gate and up still live); the
///   activations' gradients beside gate and up (`4A`); and a part of the input gradient added to the
///   sum (`2A + 2H`).
pub fn compiled_tsp_training_peak(model: &ModelShape, layout: &Layout, workload: &Workload) -> Option<ForwardPhase> {
    let tsp = layout.degree(AxisName::Tsp);
    if tsp < 2 || layout.world_size() != tsp {
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
    let ffn_shard = model.mlp_weights() as f64 / 3.0 / hidden / owners;
    // One of the MLP's three matrices, one owner's shard; one activation; one hidden state.
    let (matrix, activation, hidden_state) =
        (hidden * ffn_shard * element, local * ffn_shard * element, local * hidden * element);
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
    let common = [
        Term { name: GRADIENTS, bytes: all_params },
        Term {
            name: "gradients of the first layer and the embedding, not finished yet (removed)",
            bytes: -(first_layer + table) * element,
        },
        Term { name: "loss", bytes: element },
        Term { name: "first layer's token ids and positions (zigzag and local)", bytes: integers },
        Term {
            name: "first layer's input and attention residual (and attention norm output, unless full recompute)",
            bytes: kept_hidden * hidden_state,
        },
        Term {
            name: "first layer's q and gathered k, v of every owner (and attention output, without recompute)",
            bytes: owners * per_owner_attention * element,
        },
        Term { name: "the mlp ring's input x and its output's gradient dy", bytes: 2.0 * hidden_state },
        Term { name: "the owner's own tokens' part of its shard's gradients (kept from step 0)", bytes: 3.0 * matrix },
        Term { name: "the mlp shard held (received)", bytes: 3.0 * matrix },
        Term { name: "the ring's input gradient summed so far", bytes: hidden_state },
    ];
    let mut highest_points = vec![
        ("recomputed gate, up and their product, down's part being written", 3.0 * activation + matrix),
        ("gate and up with the activations' gradients", 4.0 * activation),
        (
            "two activations' gradients and a part of the input gradient being added",
            2.0 * activation + 2.0 * hidden_state,
        ),
    ];
    if tsp >= 3 {
        highest_points.push((
            "gate and up, a gradient part received, the rank's own and their sum",
            2.0 * activation + 3.0 * matrix,
        ));
    }
    // The first of the largest, as the planner reports the first instruction at its peak.
    let (name, bytes) = highest_points
        .into_iter()
        .fold(None::<(&'static str, f64)>, |best, point| match best {
            Some(best) if best.1 >= point.1 => Some(best),
            _ => Some(point),
        })
        .expect("candidates");
    let mut terms = common.to_vec();
    terms.push(Term { name, bytes });
    let ring = ForwardPhase { name: "tsp first layer's mlp ring backward", params: all_params, terms };
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
    Some(if end.bytes() > ring.bytes() { end } else { ring })
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
        // 4; three [8, 128] kept for the attention; per owner q and attention [8, 64] and k, v
        // [16, 32]; x, dy and the input gradient's sum [8, 128]; the ring's 3 + 3 matrices of
        // 128·128 and, at the highest point, gate, up and their product [8, 128] with down's
        // part, one more matrix.
        let model = tiny();
        let workload = Workload::training(8, 2);
        let common = 180864.0 * 2.0 - (73984.0 + 16384.0)
            + 1.0
            + (16.0 + 8.0 + 4.0)
            + 3.0 * 8.0 * 128.0
            + 2.0 * (2.0 * 8.0 * 64.0 + 2.0 * 16.0 * 32.0)
            + 3.0 * 8.0 * 128.0;
        let tsp2 = compiled_tsp_training_peak(&model, &Layout::new(&[(AxisName::Tsp, 2)], false), &workload).unwrap();
        assert_eq!(tsp2.bytes(), (common + 6.0 * 128.0 * 128.0 + 3.0 * 8.0 * 128.0 + 128.0 * 128.0) * 4.0);
        // tsp=4: 90752 parameter elements, the first layer 37120 and the embedding's 64·128; T/4 =
        // 4 local; integers 16 + 8 + 2; per owner q and attention [4, 32], k and v [16, 16]; the
        // matrices 128·64, activations [4, 64]; at the highest point a received part, the rank's
        // own and their sum beside gate and up.
        let common = 90752.0 * 2.0 - (37120.0 + 8192.0)
            + 1.0
            + (16.0 + 8.0 + 2.0)
            + 3.0 * 4.0 * 128.0
            + 4.0 * (2.0 * 4.0 * 32.0 + 2.0 * 16.0 * 16.0)
            + 3.0 * 4.0 * 128.0;
        let tsp4 = compiled_tsp_training_peak(&model, &Layout::new(&[(AxisName::Tsp, 4)], false), &workload).unwrap();
        assert_eq!(tsp4.bytes(), (common + 6.0 * 128.0 * 64.0 + 2.0 * 4.0 * 64.0 + 3.0 * 128.0 * 64.0) * 4.0);
        let beside = Layout::new(&[(AxisName::Dp, 2), (AxisName::Tsp, 2)], false);
        assert_eq!(compiled_tsp_training_peak(&model, &beside, &workload), None);
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
