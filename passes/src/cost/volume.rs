//! The collectives each strategy issues, a layer and a step, with their sizes (DESIGN.md section 4).
//!
//! Forward, a layer, on one rank (`T` = the tokens of the group: `s·b/(sp·cp)`, or `/tsp` for the
//! other axes' groups; `W_attn`, `W_mlp` = the layer's attention and MLP matrices, already split by
//! tp where another axis is present):
//! - tp (Megatron): an all-reduce of `[T, h]` after attention and after the MLP, `2·2(D-1)/D·T·h`
//!   elements sent; with Megatron SP an all-gather and a reduce-scatter in place of each, the same
//!   volume;
//! - tsp: each owner broadcasts its packed `[Wq, Wk, Wv, Wo]` shard (`D` broadcasts of `W_attn/D`),
//!   the K/V of each owner's heads are all-gathered (`D` all-gathers of `2·T·kv/D`), the MLP shards
//!   ring-rotate (`D-1` send/recv of `W_mlp/D`): `(D-1)/D·(W_attn + W_mlp + 2·T·kv)` elements, which
//!   for MHA with a gated MLP of width 4h is the paper's `(D-1)/D·(16h² + 2BSh)`;
//! - cp (ring attention): `D-1` send/recv of the K/V chunk `2·(T/D)·kv`: `2(D-1)/D·T·kv`;
//! - sp (sequence split, weights replicated): an all-gather of K/V, `(D-1)/D·2·T·kv`;
//! - ep (a mixture of experts): the token counts each rank sends each other (`D` 8-byte integers:
//!   an all-to-all that is all latency), then two all-to-alls with variable counts, dispatch (each
//!   token's hidden vector to the ranks of its `top_k` experts) and combine (the experts' outputs
//!   back), each sending `(D-1)/D·top_k·T·h` elements a rank when routing is balanced. With tp the
//!   tp ranks dispatch the same tokens to their own tp peers, and the tp all-reduce after the MLP
//!   follows the combine (which is linear, so each tp rank combines its partial sums first);
//! - dp, pp: nothing inside a layer.
//!
//! Backward: the conjugate of each forward collective moves the same bytes (all-reduce stays,
//! all-gather becomes reduce-scatter, broadcast becomes a reduce to the owner; where tp does not
//! divide the kv heads, so that every tp rank holds all of k's and v's, k's output gradient and
//! v's weight gradient are all-reduced over tp too, and the attention's input gradient twice in
//! place of its conjugate), and the strategies
//! that move weights move them again plus their gradients (tsp), or move K/V again plus dK/dV
//! (cp), and ep sends the gradients of the combine and of the dispatch back the same ways (two more
//! all-to-alls; the routing, and so the counts, are the forward's). Full recompute repeats the
//! forward's collectives, except the sp axis's K/V all-gather, whose output is kept (see
//! `activation`). Megatron SP adds two all-gathers a layer to the backward: it saves the qkv and
//! MLP inputs split over tp (Korthikanti's `34/t`, which `activation` counts) and gathers them
//! again for the weight gradients. (pleat's own programs keep the gathered inputs instead, more
//! memory and no regather; the liveness planner gives their figure.) A step adds, once, the
//! gradient synchronization over the axes that replicate weights (dp, sp, cp, and for a mixture
//! ep for the dense parameters and tsp for the experts and
//! routers, which tsp keeps whole: an all-reduce, or with ZeRO a reduce-scatter of gradients and an
//! all-gather of weights over ep and dp, the dense parameters' `dp·ep` replicas and the experts'
//! `dp`), ZeRO-3's per-layer weight gathers, and the pipeline's activation and gradient sends.

use pleat_ir::AxisName;

use super::activation::{key_values_replicated, kv_split, local_tokens};
use super::comm::{bytes_sent, Collective};
use super::layout::Layout;
use super::memory::stage_expert_params;
use super::model::ModelShape;
use super::workload::{Mode, Recompute, Workload};

/// Forward or backward.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass (including a recomputed forward's collectives).
    Backward,
    /// Once a step (gradient synchronization).
    Step,
}

/// `count` collectives of one kind on one axis, each of `bytes` (comm's size convention).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CollectiveCall {
    /// What it moves.
    pub what: &'static str,
    /// The kind.
    pub kind: Collective,
    /// The mesh axis whose groups run it.
    pub axis: AxisName,
    /// Bytes of one call.
    pub bytes: f64,
    /// Calls (a layer and micro-batch for forward/backward; a step for `Phase::Step`).
    pub count: f64,
    /// When.
    pub phase: Phase,
}

impl CollectiveCall {
    /// Whether the overlap scheduler can run this collective beside compute: it moves weights (a
    /// TSP owner's block, a ring shard, a ZeRO-3 gather), key/value blocks around ring attention's
    /// ring, or gradients whose readers come later (a weight gradient's reduction); no compute is
    /// waiting for it. The rest carry activations the next kernel reads (TP's all-reduces, SP's
    /// gathers, K/V all-gathers, pipeline sends) and stay on the critical path.
    pub fn hides_behind_compute(&self) -> bool {
        HIDDEN_BEHIND_COMPUTE.contains(&self.what)
    }

    /// Bytes one rank sends for all `count` calls, in a group of `ranks`.
    pub fn bytes_sent(&self, ranks: u64) -> f64 {
        self.count * bytes_sent(self.kind, self.bytes, ranks)
    }
}

/// The collectives [`CollectiveCall::hides_behind_compute`] says the scheduler can hide.
const HIDDEN_BEHIND_COMPUTE: [&str; 10] = [
    "tsp broadcast of packed attention weights",
    "tsp ring of mlp shards",
    "tsp reduce of attention weight gradients",
    "tsp ring of mlp gradient shards",
    "cp ring of k/v chunks",
    "cp ring of dk/dv chunks",
    "gradient reduce-scatter",
    "zero-3 weight all-gather (forward and backward)",
    "updated weight all-gather",
    "gradient all-reduce",
];

/// What Megatron tp's all-reduces after attention and the MLP are called (under SP, the all-gathers
/// before them): the backward's conjugates reduce the two blocks' input gradients.
const TP_ALL_REDUCES: &str = "all-reduce after attention and mlp";
const SP_ALL_GATHERS: &str = "sp all-gather before qkv and mlp";

/// What Megatron SP's backward all-gathers of the inputs it saved split are called.
pub const SP_REGATHERS: &str =
    "sp all-gather of the qkv and mlp inputs again, for their weight gradients (saved split)";
/// What the ep axis's token all-to-alls are called.
pub const EP_DISPATCH_COMBINE: &str =
    "expert all-to-all: tokens to the ranks of their experts (dispatch) and back (combine)";
/// What the ep axis's exchange of token counts is called.
pub const EP_COUNTS: &str = "expert all-to-all of token counts (before the dispatch)";

/// The collectives of one layer for one micro-batch, forward then backward.
pub fn layer_collectives(model: &ModelShape, layout: &Layout, workload: &Workload) -> Vec<CollectiveCall> {
    let element = model.dtype_bytes as f64;
    let hidden = model.hidden as f64;
    let tp = layout.degree(AxisName::Tp) as f64;
    let tsp = layout.degree(AxisName::Tsp);
    let local = local_tokens(layout, workload);
    let kv_local = model.kv_width() as f64 / kv_split(model, layout) as f64;
    let training = workload.mode == Mode::Train;
    let mut calls = Vec::new();
    let mut forward = Vec::new();
    let push = |list: &mut Vec<CollectiveCall>, what, kind, axis, bytes: f64, count: f64, phase| {
        list.push(CollectiveCall { what, kind, axis, bytes, count, phase });
    };

    if tp > 1.0 {
        // The tp group holds the same tokens: the local ones.
        let activation = local * hidden * element;
        if layout.sequence_parallel {
            push(&mut forward, SP_ALL_GATHERS, Collective::AllGather, AxisName::Tp, activation, 2.0, Phase::Forward);
            push(
                &mut forward,
                "sp reduce-scatter after o and down",
                Collective::ReduceScatter,
                AxisName::Tp,
                activation,
                2.0,
                Phase::Forward,
            );
        } else {
            push(&mut forward, TP_ALL_REDUCES, Collective::AllReduce, AxisName::Tp, activation, 2.0, Phase::Forward);
        }
    }
    if tsp > 1 {
        let degree = tsp as f64;
        let group_tokens = local * degree;
        let attention = model.attention_weights() as f64 / tp * element;
        let mlp = model.mlp_weights() as f64 / tp * element;
        let kv = 2.0 * group_tokens * kv_local * element;
        // Weight gradients travel as they are kept: fp32 under mixed precision (as the
        // gradients' memory counts them), in the weights' dtype with `--bf16-grads`.
        let grad_scale = workload.gradient_bytes(element) / element;
        push(
            &mut forward,
            "tsp broadcast of packed attention weights",
            Collective::Broadcast,
            AxisName::Tsp,
            attention / degree,
            degree,
            Phase::Forward,
        );
        push(
            &mut forward,
            "tsp all-gather of k/v",
            Collective::AllGather,
            AxisName::Tsp,
            kv / degree,
            degree,
            Phase::Forward,
        );
        push(
            &mut forward,
            "tsp ring of mlp shards",
            Collective::SendRecv,
            AxisName::Tsp,
            mlp / degree,
            degree - 1.0,
            Phase::Forward,
        );
        if training {
            push(
                &mut calls,
                "tsp broadcast of packed attention weights",
                Collective::Broadcast,
                AxisName::Tsp,
                attention / degree,
                degree,
                Phase::Backward,
            );
            push(
                &mut calls,
                "tsp reduce of attention weight gradients",
                Collective::ReduceScatter,
                AxisName::Tsp,
                attention * grad_scale,
                1.0,
                Phase::Backward,
            );
            push(
                &mut calls,
                "tsp reduce-scatter of dk/dv",
                Collective::ReduceScatter,
                AxisName::Tsp,
                kv / degree,
                degree,
                Phase::Backward,
            );
            push(
                &mut calls,
                "tsp ring of mlp shards",
                Collective::SendRecv,
                AxisName::Tsp,
                mlp / degree,
                degree - 1.0,
                Phase::Backward,
            );
            push(
                &mut calls,
                "tsp ring of mlp gradient shards",
                Collective::SendRecv,
                AxisName::Tsp,
                mlp / degree * grad_scale,
                degree,
                Phase::Backward,
            );
        }
    }
    let cp = layout.degree(AxisName::Cp);
    if cp > 1 {
        let chunk = 2.0 * local * kv_local * element;
        push(
            &mut forward,
            "cp ring of k/v chunks",
            Collective::SendRecv,
            AxisName::Cp,
            chunk,
            (cp - 1) as f64,
            Phase::Forward,
        );
        if training {
            push(
                &mut calls,
                "cp ring of k/v chunks",
                Collective::SendRecv,
                AxisName::Cp,
                chunk,
                (cp - 1) as f64,
                Phase::Backward,
            );
            push(
                &mut calls,
                "cp ring of dk/dv chunks",
                Collective::SendRecv,
                AxisName::Cp,
                chunk,
                cp as f64,
                Phase::Backward,
            );
        }
    }
    let sp = layout.degree(AxisName::Sp);
    if sp > 1 {
        let gathered = 2.0 * local * sp as f64 * kv_local * element;
        push(&mut forward, "sp all-gather of k/v", Collective::AllGather, AxisName::Sp, gathered, 1.0, Phase::Forward);
        if training {
            push(
                &mut calls,
                "sp reduce-scatter of dk/dv",
                Collective::ReduceScatter,
                AxisName::Sp,
                gathered,
                1.0,
                Phase::Backward,
            );
        }
    }
    if let (Some(experts), Some(axis)) = (&model.experts, layout.expert_axis()) {
        // Balanced routing: `top_k` copies of each local token, `1/ep` of which stay on the rank.
        // Without ep the experts sit on tsp, whose ranks hold their own tokens as ep's do.
        let ep = layout.degree(axis);
        let routed = experts.top_k as f64 * local * hidden * element;
        push(&mut forward, EP_COUNTS, Collective::AllToAll, axis, 8.0 * ep as f64, 1.0, Phase::Forward);
        push(&mut forward, EP_DISPATCH_COMBINE, Collective::AllToAll, axis, routed, 2.0, Phase::Forward);
        if training {
            push(
                &mut calls,
                "expert all-to-all of gradients: the combine's back to the experts, the dispatch's back to the tokens",
                Collective::AllToAll,
                axis,
                routed,
                2.0,
                Phase::Backward,
            );
        }
    }
    let key_values_replicated = key_values_replicated(model, layout);
    if training {
        // The conjugates of tp's collectives move the same bytes; with k and v replicated the
        // attention's input gradient is reduced as below in place of its conjugate.
        for call in forward.iter().filter(|call| call.axis == AxisName::Tp) {
            let input_gradients = matches!(call.what, TP_ALL_REDUCES | SP_ALL_GATHERS);
            let count = if key_values_replicated && input_gradients { call.count - 1.0 } else { call.count };
            calls.push(CollectiveCall { phase: Phase::Backward, count, ..call.clone() });
        }
        if key_values_replicated {
            calls.extend(replicated_key_value_collectives(model, layout, workload));
        }
        if layout.sequence_parallel && tp > 1.0 {
            // Megatron SP keeps the linear layers' inputs split (Korthikanti's 34/t, which the
            // activations count) and gathers them again for the weight gradients.
            push(
                &mut calls,
                SP_REGATHERS,
                Collective::AllGather,
                AxisName::Tp,
                local * hidden * element,
                2.0,
                Phase::Backward,
            );
        }
        if workload.recompute == Recompute::Full {
            // The sp axis's gathered K/V are kept, not re-gathered (see `activation`).
            calls.extend(
                forward
                    .iter()
                    .filter(|call| call.axis != AxisName::Sp)
                    .map(|call| CollectiveCall { phase: Phase::Backward, ..call.clone() }),
            );
        }
    }
    forward.extend(calls);
    forward
}

/// The backward's collectives of one layer over tp where tp does not divide the kv heads, so that
/// every tp rank holds all of k's and v's (`activation::kv_split`): k's output gradient is
/// all-reduced before its RoPE backward, v's weight gradient (and bias's) once it is made (under
/// ZeRO-2 and 3 its shard, after the reduce-scatter over the replicas), and the attention's input
/// gradient twice, v's part and then q's as it joins k's (whole once k's output gradient is),
/// where it is otherwise reduced once (all-reduced, or under SP reduce-scattered).
fn replicated_key_value_collectives(model: &ModelShape, layout: &Layout, workload: &Workload) -> Vec<CollectiveCall> {
    let element = model.dtype_bytes as f64;
    let grad = workload.gradient_bytes(element);
    let (hidden, kv) = (model.hidden as f64, model.kv_width() as f64);
    let local = local_tokens(layout, workload);
    let bias = if model.qkv_bias { kv } else { 0.0 };
    let shards = if workload.zero >= 2 { layout.zero_replicas() as f64 } else { 1.0 };
    let call = |what, bytes, count| CollectiveCall {
        what,
        kind: Collective::AllReduce,
        axis: AxisName::Tp,
        bytes,
        count,
        phase: Phase::Backward,
    };
    vec![
        call("tp all-reduce of k's output gradient (k and v replicated over tp)", local * kv * element, 1.0),
        call(
            "tp all-reduce of v's weight gradient (k and v replicated over tp)",
            (hidden * kv + bias) * grad / shards,
            1.0,
        ),
        call(
            "tp all-reduce of the attention's input gradient, v's part and q's (k and v replicated over tp)",
            local * hidden * element,
            2.0,
        ),
    ]
}

/// Elements one rank sends in the forward pass of one layer (one micro-batch): the quantity of the
/// published closed forms.
pub fn forward_elements_per_layer(model: &ModelShape, layout: &Layout, workload: &Workload) -> f64 {
    let forward = layer_collectives(model, layout, workload);
    let bytes = forward
        .iter()
        .filter(|call| call.phase == Phase::Forward)
        .map(|call| call.bytes_sent(layout.degree(call.axis)));
    super::total(bytes) / model.dtype_bytes as f64
}

/// The collectives of a step outside the layers: gradient synchronization, ZeRO-3 gathers, and
/// pipeline sends. `params_on_rank` is the parameters the rank holds before ZeRO sharding;
/// `layers` those on its stage.
pub fn step_collectives(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    params_on_rank: f64,
    layers: u64,
) -> Vec<CollectiveCall> {
    let mut calls = Vec::new();
    let element = model.dtype_bytes as f64;
    if workload.mode == Mode::Train {
        let grad = workload.gradient_bytes(element);
        let zero = if workload.distributed_optimizer { workload.zero.max(1) } else { workload.zero };
        // A mixture's routed experts are split over ep, the rest replicated over it; tsp keeps the
        // routers whole (each tsp rank routes its own tokens), and the experts too unless it is
        // the axis that splits them (no ep). All zero when dense.
        let experts = stage_expert_params(model, layout, layers);
        let dense = params_on_rank - experts;
        let routers = layers as f64 * model.router_params() as f64;
        let whole_under_tsp = if layout.expert_axis() == Some(AxisName::Tsp) { routers } else { experts + routers };
        let ep = layout.degree(AxisName::Ep) as f64;
        // Under ZeRO cp reduce-scatters first: the later axes scatter its shard.
        let cp_scattered = if zero >= 1 { layout.degree(AxisName::Cp) as f64 } else { 1.0 };
        for axis in [AxisName::Sp, AxisName::Cp, AxisName::Tsp, AxisName::Ep, AxisName::Dp] {
            if layout.degree(axis) == 1 {
                continue;
            }
            // The parameters this axis replicates, and (under ZeRO, over cp, ep then dp) the share
            // of them the earlier axes of the data-parallel group have not yet scattered.
            let params = match axis {
                AxisName::Tsp if model.experts.is_some() => whole_under_tsp,
                AxisName::Tsp => continue,
                AxisName::Ep => dense / cp_scattered,
                AxisName::Dp if zero >= 1 => (dense / ep + experts) / cp_scattered,
                _ => params_on_rank,
            };
            if zero >= 1 && matches!(axis, AxisName::Dp | AxisName::Cp | AxisName::Ep) {
                let rs = CollectiveCall {
                    what: "gradient reduce-scatter",
                    kind: Collective::ReduceScatter,
                    axis,
                    bytes: params * grad,
                    count: 1.0,
                    phase: Phase::Step,
                };
                calls.push(rs);
                let gather = if zero >= 3 {
                    // ZeRO-3 gathers each layer's weights in the forward and again in the backward.
                    CollectiveCall {
                        what: "zero-3 weight all-gather (forward and backward)",
                        kind: Collective::AllGather,
                        axis,
                        bytes: params * element / layers.max(1) as f64,
                        count: 2.0 * layers as f64 * workload.micro_batches as f64,
                        phase: Phase::Step,
                    }
                } else {
                    CollectiveCall {
                        what: "updated weight all-gather",
                        kind: Collective::AllGather,
                        axis,
                        bytes: params * element,
                        count: 1.0,
                        phase: Phase::Step,
                    }
                };
                calls.push(gather);
            } else {
                calls.push(CollectiveCall {
                    what: "gradient all-reduce",
                    kind: Collective::AllReduce,
                    axis,
                    bytes: params * grad,
                    count: 1.0,
                    phase: Phase::Step,
                });
            }
        }
    }
    let stages = layout.degree(AxisName::Pp);
    if stages > 1 {
        let tp = if layout.sequence_parallel { layout.degree(AxisName::Tp) as f64 } else { 1.0 };
        let boundary = local_tokens(layout, workload) * model.hidden as f64 * element / tp;
        let directions = if workload.mode == Mode::Train { 2.0 } else { 1.0 };
        calls.push(CollectiveCall {
            what: "pipeline activations (and gradients)",
            kind: Collective::SendRecv,
            axis: AxisName::Pp,
            bytes: boundary,
            count: directions * workload.micro_batches as f64,
            phase: Phase::Step,
        });
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    fn tsp_7b() -> ModelShape {
        ModelShape::from_config(&preset("tsp-7b").unwrap())
    }

    #[test]
    fn published_closed_forms() {
        let model = tsp_7b();
        let h = 4096.0;
        for degree in [2u64, 4, 8] {
            for seq in [4096u64, 32768, 131072] {
                let workload = Workload::training(seq, 1);
                let share = (degree - 1) as f64 / degree as f64;
                let bsh = seq as f64 * h;
                let tsp =
                    forward_elements_per_layer(&model, &Layout::new(&[(AxisName::Tsp, degree)], false), &workload);
                assert!((tsp - share * (16.0 * h * h + 2.0 * bsh)).abs() < 1e-6 * tsp, "tsp D={degree} s={seq}");
                let tp = forward_elements_per_layer(&model, &Layout::new(&[(AxisName::Tp, degree)], false), &workload);
                assert!((tp - share * 4.0 * bsh).abs() < 1e-6 * tp, "tp D={degree} s={seq}");
                let tp_sp =
                    forward_elements_per_layer(&model, &Layout::new(&[(AxisName::Tp, degree)], true), &workload);
                assert!((tp_sp - tp).abs() < 1e-6 * tp);
                let cp = forward_elements_per_layer(&model, &Layout::new(&[(AxisName::Cp, degree)], false), &workload);
                assert!((cp - 2.0 * share * bsh).abs() < 1e-6 * cp, "cp");
            }
        }
    }

    #[test]
    fn tsp_beats_tp_exactly_when_bs_exceeds_8h() {
        let model = tsp_7b();
        let (tsp, tp) = (Layout::new(&[(AxisName::Tsp, 8)], false), Layout::new(&[(AxisName::Tp, 8)], false));
        // 8h = 32768 tokens: equal there, TSP cheaper above, dearer below.
        for (seq, batch) in [(16384u64, 1u64), (32768, 1), (65536, 1), (16384, 2), (16384, 4)] {
            let workload = Workload::training(seq, batch);
            let (tsp, tp) = (
                forward_elements_per_layer(&model, &tsp, &workload),
                forward_elements_per_layer(&model, &tp, &workload),
            );
            let tokens = seq * batch;
            match tokens.cmp(&(8 * 4096)) {
                std::cmp::Ordering::Less => assert!(tsp > tp, "{tokens}"),
                std::cmp::Ordering::Equal => assert!((tsp - tp).abs() < 1e-9 * tp, "{tokens}"),
                std::cmp::Ordering::Greater => assert!(tsp < tp, "{tokens}"),
            }
        }
    }

    #[test]
    fn backward_doubles_tp_and_recompute_repeats_the_forward() {
        let model = tsp_7b();
        let layout = Layout::new(&[(AxisName::Tp, 8)], false);
        let sent = |workload: &Workload, phase: Phase| -> f64 {
            layer_collectives(&model, &layout, workload)
                .iter()
                .filter(|c| c.phase == phase)
                .map(|c| c.bytes_sent(8))
                .sum()
        };
        let plain = Workload::training(4096, 1);
        assert_eq!(sent(&plain, Phase::Backward), sent(&plain, Phase::Forward));
        let full = Workload { recompute: Recompute::Full, ..plain.clone() };
        assert_eq!(sent(&full, Phase::Backward), 2.0 * sent(&plain, Phase::Forward));
        let infer = Workload::inference(4096, 1);
        assert_eq!(sent(&infer, Phase::Backward), 0.0);
    }

    #[test]
    fn megatron_sp_gathers_its_saved_inputs_again_in_the_backward() {
        // tsp-7b at tp=8 with SP on 16384 tokens: [16384, 4096] in bf16 is 134,217,728 bytes.
        // Forward: two all-gathers and two reduce-scatters of it. Backward: their conjugates, and
        // the qkv and MLP inputs (saved split) gathered again: four all-gathers in all, each
        // sending 7/8 of it (Megatron's LinearWithGradAccumulationAndAsyncCommunication).
        let model = tsp_7b();
        let layout = Layout::new(&[(AxisName::Tp, 8)], true);
        let activation = 134_217_728.0;
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let workload = Workload { recompute, ..Workload::training(16384, 1) };
            let calls = layer_collectives(&model, &layout, &workload);
            let again = calls.iter().find(|call| call.what == SP_REGATHERS).expect("the regathers");
            assert_eq!((again.bytes, again.count, again.phase), (activation, 2.0, Phase::Backward));
            let sent: f64 = calls
                .iter()
                .filter(|call| call.phase == Phase::Backward && call.kind == Collective::AllGather)
                .map(|call| call.bytes_sent(8))
                .sum();
            let recomputed = if recompute == Recompute::Full { 2.0 } else { 0.0 };
            assert_eq!(sent, (4.0 + recomputed) * activation * 7.0 / 8.0, "{recompute:?}");
        }
        // Without SP (all-reduces) and in inference, none.
        let tp = Layout::new(&[(AxisName::Tp, 8)], false);
        assert!(layer_collectives(&model, &tp, &Workload::training(16384, 1)).iter().all(|c| c.what != SP_REGATHERS));
        let infer = layer_collectives(&model, &layout, &Workload::inference(16384, 1));
        assert!(infer.iter().all(|call| call.what != SP_REGATHERS));
    }

    #[test]
    fn tsp_weight_gradients_travel_in_the_gradients_dtype() {
        // tsp-7b at tsp=8: a layer's MLP is 3·4096·16384 parameters and its attention 4·4096²,
        // so a ring hop carries an eighth of the MLP's gradients and the owner's reduce all of
        // the attention's: 4 bytes an element under mixed precision, 2 with bf16 gradients (as
        // the gradients' memory counts them); the weights themselves travel in bf16 either way.
        let model = tsp_7b();
        let layout = Layout::new(&[(AxisName::Tsp, 8)], false);
        let bytes = |workload: &Workload, what: &str| -> f64 {
            let calls = layer_collectives(&model, &layout, workload);
            calls.iter().find(|call| call.what == what).map(|call| call.bytes).unwrap()
        };
        let (mlp, attention) = (3.0 * 4096.0 * 16384.0, 4.0 * 4096.0 * 4096.0);
        let fp32 = Workload::training(4096, 1);
        let bf16 = Workload { fp32_grads: false, ..fp32.clone() };
        assert_eq!(bytes(&fp32, "tsp ring of mlp gradient shards"), mlp / 8.0 * 4.0);
        assert_eq!(bytes(&bf16, "tsp ring of mlp gradient shards"), mlp / 8.0 * 2.0);
        assert_eq!(bytes(&fp32, "tsp reduce of attention weight gradients"), attention * 4.0);
        assert_eq!(bytes(&bf16, "tsp reduce of attention weight gradients"), attention * 2.0);
        assert_eq!(bytes(&fp32, "tsp ring of mlp shards"), mlp / 8.0 * 2.0);
    }

    #[test]
    fn key_values_replicated_over_tp_add_all_reduces_to_the_backward() {
        // Llama-3-70B has 8 kv heads (h = 8192, kv width 8·128 = 1024, bf16): at tp=16 every tp
        // rank holds all of them. On 4096 tokens, by hand: an activation [4096, 8192] is
        // 67,108,864 bytes, k's output gradient [4096, 1024] 8,388,608, v's weight gradient
        // [8192, 1024] in f32 33,554,432.
        let model = ModelShape::from_config(&preset("llama3-70b").unwrap());
        let workload = Workload::training(4096, 1);
        let summed = |layout: &Layout, workload: &Workload, phase: Phase, kind: Collective| -> f64 {
            layer_collectives(&model, layout, workload)
                .iter()
                .filter(|call| call.phase == phase && call.kind == kind)
                .map(|call| call.count * call.bytes)
                .sum()
        };
        let (activation, key_gradient, value_weight) = (67_108_864.0, 8_388_608.0, 33_554_432.0);
        let tp16 = Layout::new(&[(AxisName::Tp, 16)], false);
        assert_eq!(summed(&tp16, &workload, Phase::Forward, Collective::AllReduce), 2.0 * activation);
        // The MLP's input gradient once, the attention's twice, k's output gradient, v's weight's.
        assert_eq!(
            summed(&tp16, &workload, Phase::Backward, Collective::AllReduce),
            3.0 * activation + key_gradient + value_weight
        );
        // Under SP the attention's input gradient is all-reduced twice in place of its
        // reduce-scatter (the conjugate of the all-gather before q, k and v).
        // (And Megatron SP gathers the qkv and MLP inputs again for their weight gradients.)
        let sp16 = Layout::new(&[(AxisName::Tp, 16)], true);
        assert_eq!(summed(&sp16, &workload, Phase::Backward, Collective::AllGather), 3.0 * activation);
        assert_eq!(summed(&sp16, &workload, Phase::Backward, Collective::ReduceScatter), 2.0 * activation);
        assert_eq!(
            summed(&sp16, &workload, Phase::Backward, Collective::AllReduce),
            2.0 * activation + key_gradient + value_weight
        );
        // Under ZeRO-2 over dp=4 v's weight gradient is reduce-scattered first: its shard.
        let zero = Workload { zero: 2, ..workload.clone() };
        let dp4 = Layout::new(&[(AxisName::Dp, 4), (AxisName::Tp, 16)], false);
        assert_eq!(
            summed(&dp4, &zero, Phase::Backward, Collective::AllReduce),
            3.0 * activation + key_gradient + value_weight / 4.0
        );
        // At tp=8 each rank holds one kv head: the backward mirrors the forward.
        let tp8 = Layout::new(&[(AxisName::Tp, 8)], false);
        assert_eq!(
            summed(&tp8, &workload, Phase::Backward, Collective::AllReduce),
            summed(&tp8, &workload, Phase::Forward, Collective::AllReduce)
        );
    }

    #[test]
    fn gradient_sync_covers_the_replicating_axes() {
        let model = tsp_7b();
        let layout = Layout::new(&[(AxisName::Dp, 2), (AxisName::Cp, 2), (AxisName::Tp, 2)], false);
        let calls = step_collectives(&model, &layout, &Workload::training(4096, 1), 1e9, 32);
        let axes: Vec<_> = calls.iter().map(|call| call.axis).collect();
        assert_eq!(axes, vec![AxisName::Cp, AxisName::Dp]);
        assert!(calls.iter().all(|call| call.bytes == 4e9 && call.kind == Collective::AllReduce));
        // ZeRO shards over dp × cp: cp reduce-scatters the gradients and gathers the updated
        // weights, then dp its shard of them.
        let zero = Workload { zero: 1, ..Workload::training(4096, 1) };
        let calls = step_collectives(&model, &layout, &zero, 1e9, 32);
        let kinds: Vec<_> = calls.iter().map(|call| (call.axis, call.kind, call.bytes)).collect();
        let (rs, ag) = (Collective::ReduceScatter, Collective::AllGather);
        let (cp, dp) = (AxisName::Cp, AxisName::Dp);
        assert_eq!(kinds, vec![(cp, rs, 4e9), (cp, ag, 2e9), (dp, rs, 2e9), (dp, ag, 1e9)]);
    }
}
