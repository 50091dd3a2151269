//! Memory a rank, by component, from closed formulas.
//!
//! - **Static** (Megatron's accounting of mixed-precision Adam): weights in the model's dtype
//!   (2 bytes for bf16), gradients in fp32 (4; `fp32_grads = false` keeps them in the weights'
//!   dtype), and the optimizer's fp32 master weights and two moments (12): 18 bytes a parameter, 16
//!   with bf16 gradients. An fp32 model needs no master copy (4 + 4 + 8). The distributed optimizer
//!   and ZeRO-1 divide the optimizer's 12 by dp (Megatron's `6 + 12/dp`), ZeRO-2 also the gradients,
//!   ZeRO-3 also the weights. Inference keeps the weights only.
//! - **Parameters a rank**: a layer's matrices split by tp and tsp (k/v whole under tp when the kv
//!   heads do not divide), its norms whole; the embedding on the first stage and the LM head on the
//!   last, split on vocabulary rows by tp (padded), and by tsp only when
//!   `Workload::tsp_shards_embeddings` (see below); a tied table is copied to the last stage when
//!   pp > 1, as Megatron does.
//! - **Experts** (a mixture of experts): every layer's router (and shared-expert gate) whole on every
//!   rank; its routed experts split `E/ep` a rank, each expert's channels over tp, whole over tsp:
//!   `layers · E/ep · 3·h·f_e/tp` elements ([`stage_expert_params`]). ep splits the batch as dp
//!   does, so the dense parameters (attention, router, shared expert, norms, embeddings) have
//!   `dp·ep` replicas and the routed experts `dp`: ZeRO shards each over its own replicas. The
//!   peak stage's split by component is [`ExpertMemory`].
//! - **Activations** kept for the backward ([`super::activation`]; under sp this includes every
//!   layer's all-gathered K/V, which full recompute does not re-gather), times the micro-batches in
//!   flight on the stage: 1F1B holds `min(m, p - stage)`, the interleaved schedule Megatron's
//!   `1 + (p-1)/(p·v)` more on the first stage. Inference keeps the KV cache instead.
//! - **Transients**, live while one layer runs: the working set of a recomputed layer (full
//!   recompute) or of the inference layer, the gradients of the layer's output and input that the
//!   backward holds at once, and each strategy's buffers: TSP's gathered K/V of one
//!   owner's heads, its double-buffered packed attention weights (broadcast) and MLP shards (ring),
//!   and in the backward the travelling gradient shards and dK/dV before their reduce-scatter; the
//!   sp axis's whole-sequence dK/dV (training) or gathered K/V (inference); cp's double-buffered ring chunks; Megatron SP's all-gathered input;
//!   ZeRO-3's gathered layer (and the next, prefetched); pipeline send and receive buffers.
//! - **Logits**: the last stage's `[tokens, vocab/tp]` in the model's dtype plus the fp32 copy the
//!   loss computes in (its gradient is written in place), 6 bytes an element for bf16.
//!
//! The peak is `static + activations + max(logits, transients)`: the loss runs and is freed
//! before the first layer of the backward starts.
//!
//! Why TSP keeps the embedding whole by default: the TSP paper reports about 31.0 GB (TSP) and
//! 31.5 GB (TP) at 16K tokens on 8 GPUs and 38.8 vs 70.0 GB at 128K. The TP - TSP difference grows
//! linearly in the sequence in every accounting (activations), so at 16K it should be about an
//! eighth of the 128K difference plus a constant; the paper's figures give that constant as about
//! -3.9 GB against TSP. Replicating the 2·32000·4096 embedding and LM head parameters at 18 bytes
//! over 8 ranks costs TSP exactly 262,144,000·18·7/8 = 4.13 GB more than TP's vocab-parallel tables,
//! which accounts for it; no other term of this size exists. `tests/cost_reference.rs` shows the
//! figures term by term.
//!
//! What the TP+SP layouts hold. The paper (arXiv 2604.26294, and Zyphra's write-up) describes its
//! TP+SP baselines as TP on one mesh axis and SP on an orthogonal one, `T·S` devices, SP sharding the
//! tokens with the weights replicated, and its own TSP attention as a sequence-wise K/V exchange;
//! the text available to pleat does not say what the baselines' SP attention keeps for the backward
//! or which recompute they run. pleat's `sp` axis is the standard reading: attention over
//! all-gathered K/V, the gathered K/V saved for the attention's backward (the flash backward reads
//! the K/V it attended to), and full recompute that replays a layer's local kernels but not its
//! all-gather ([`super::activation::LayerActivations::gathered_kv`]). That keeps
//! `L·2·s·kv/t` bf16 elements a rank whatever S is: 17.2 GB at t = 4 and 34.4 GB at t = 2 for
//! `tsp-7b` at 128K, which moves both TP+SP layouts above TP, as measured. No constant is fitted:
//! the term's size follows from the shapes. Its form is checked against the one thing in the
//! figures it was not derived from: what the paper measured beyond pleat's other terms is 21.0 GB
//! for `t=4 x s=2` and 46.4 GB for `t=2 x s=4`, 2.2 times more, and the term's `1/t` gives 2.

use pleat_ir::AxisName;

use super::activation::{kv_split, layer_activations, local_tokens};
use super::layout::Layout;
use super::model::ModelShape;
use super::workload::{Mode, Recompute, Workload};

/// One named term of a breakdown, in bytes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Term {
    /// What it is.
    pub name: &'static str,
    /// Bytes.
    pub bytes: f64,
}

/// The memory of one rank of one pipeline stage.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MemoryBreakdown {
    /// The pipeline stage (0 when there is no pp).
    pub stage: u64,
    /// Layers on the stage.
    pub layers: u64,
    /// Parameters the rank holds (elements).
    pub param_count: f64,
    /// Bytes of weights.
    pub params_bytes: f64,
    /// Bytes of gradients.
    pub grads_bytes: f64,
    /// Bytes of optimizer state (fp32 master weights and Adam moments).
    pub optimizer_bytes: f64,
    /// Bytes kept for the backward (or the KV cache, for inference), all micro-batches in flight.
    pub activations_bytes: f64,
    /// Micro-batches whose activations are held.
    pub in_flight: f64,
    /// Bytes of the buffers live while one layer runs.
    pub transient_bytes: f64,
    /// The transients by name.
    pub transients: Vec<Term>,
    /// Bytes of logits and loss buffers (last stage).
    pub logits_bytes: f64,
    /// `static + activations + max(logits, transients)`.
    pub peak_bytes: f64,
    /// A mixture of experts' share of the above, by component; absent for a dense model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertMemory>,
}

/// The memory of a mixture of experts' rank by component (already counted in [`MemoryBreakdown`]'s
/// totals, which this splits).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExpertMemory {
    /// Bytes of weights by component (after ZeRO-3): attention, shared expert, router, expert
    /// weights, norms, embedding and LM head. They sum to [`MemoryBreakdown::params_bytes`].
    pub weights: Vec<Term>,
    /// Routed experts' parameters the rank holds (elements), before ZeRO: `layers · E/ep · 3·h·f_e/tp`.
    pub expert_param_count: f64,
    /// Bytes of the routed experts' gradients (ZeRO-2 shards them over dp × cp, their only
    /// replicas).
    pub expert_grads_bytes: f64,
    /// Bytes of the routed experts' optimizer state (ZeRO-1 shards it over dp × cp).
    pub expert_optimizer_bytes: f64,
    /// The experts' blocks' kept activations, every layer of the stage and micro-batch in flight,
    /// by term (part of [`MemoryBreakdown::activations_bytes`]; sized for balanced routing). Empty
    /// for inference, which keeps only the KV cache.
    pub activations: Vec<Term>,
}

impl MemoryBreakdown {
    /// Weights, gradients and optimizer state.
    pub fn static_bytes(&self) -> f64 {
        self.params_bytes + self.grads_bytes + self.optimizer_bytes
    }
}

/// Layers on each pipeline stage: `L / p`, the remainder given to the last stages (which hold the
/// fewest micro-batches in flight).
pub fn stage_layers(layers: u64, stages: u64) -> Vec<u64> {
    let stages = stages.max(1);
    let base = layers / stages;
    let extra = layers % stages;
    (0..stages).map(|stage| base + u64::from(stage >= stages - extra)).collect()
}

/// Parameters (elements) one rank of `stage` holds, before ZeRO-3.
pub fn stage_params(model: &ModelShape, layout: &Layout, workload: &Workload, stage: u64, layers: u64) -> f64 {
    let stages = layout.degree(AxisName::Pp);
    chunk_params(model, layout, workload, stage == 0, stage + 1 == stages, layers)
}

/// Parameters (elements) one rank holds of `layers` layers, with the embedding table when `first`
/// and the head when `last`, before ZeRO-3: a stage's, or one chunk's of an interleaved stage.
pub fn chunk_params(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    first: bool,
    last: bool,
    layers: u64,
) -> f64 {
    let tp = layout.degree(AxisName::Tp) as f64;
    let tsp = layout.degree(AxisName::Tsp) as f64;
    let hidden = model.hidden as f64;
    let kv_split = kv_split(model, layout) as f64;
    let query_and_output = 2.0 * hidden * model.query_width() as f64 / (tp * tsp);
    let key_and_value = 2.0 * hidden * model.kv_width() as f64 / (kv_split * tsp);
    // q, k and v's biases split with their projections (tsp splits them as tp does).
    let biases = if model.qkv_bias {
        model.query_width() as f64 / (tp * tsp) + 2.0 * model.kv_width() as f64 / (kv_split * tsp)
    } else {
        0.0
    };
    let mlp = model.mlp_weights() as f64 / (tp * tsp);
    let layer = query_and_output
        + key_and_value
        + biases
        + mlp
        + model.layer_norm_params() as f64
        + model.router_params() as f64
        + expert_layer_params(model, layout);
    let vocab_split = if workload.tsp_shards_embeddings { tp * tsp } else { tp };
    let table = (model.vocab as f64 / vocab_split).ceil() * hidden;
    let mut params = layers as f64 * layer;
    if first {
        params += table;
    }
    if last {
        params += model.final_norm_params() as f64;
        // Untied: the LM head; tied with pp > 1: Megatron's copy of the table on the last stage.
        if !model.tied_embeddings || !first {
            params += table;
        }
    }
    params
}

/// One layer's routed-expert parameters on a rank: `E/ep` experts of `3·h·f_e/tp` (`E/tsp` when
/// tsp places them, without ep). 0 for a dense model.
fn expert_layer_params(model: &ModelShape, layout: &Layout) -> f64 {
    let Some(experts) = &model.experts else { return 0.0 };
    let local_experts = (experts.count / layout.expert_degree()) as f64;
    local_experts * model.expert_weights() as f64 / layout.degree(AxisName::Tp) as f64
}

/// The routed-expert parameters (elements) one rank of a stage of `layers` layers holds, before
/// ZeRO: `layers · E/ep · 3·h·f_e/tp`. Their replicas are the dp group only (ep splits them).
pub fn stage_expert_params(model: &ModelShape, layout: &Layout, layers: u64) -> f64 {
    layers as f64 * expert_layer_params(model, layout)
}

/// [`stage_params`] by component (elements): attention, shared expert, router, expert weights,
/// norms, embedding and LM head. Only the mixture-of-experts report uses it.
fn stage_param_parts(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    stage: u64,
    layers: u64,
) -> [(&'static str, f64); 6] {
    let whole = |layers| stage_params(model, layout, workload, stage, layers);
    let outside_layers = whole(0);
    let layers = layers as f64;
    let tp = layout.degree(AxisName::Tp) as f64;
    let tsp = layout.degree(AxisName::Tsp) as f64;
    let norms = model.layer_norm_params() as f64;
    let final_norm = if stage + 1 == layout.degree(AxisName::Pp) { model.final_norm_params() as f64 } else { 0.0 };
    let shared_expert = model.mlp_weights() as f64 / (tp * tsp);
    let router = model.router_params() as f64;
    let experts = expert_layer_params(model, layout);
    let layer = whole(1) - outside_layers;
    let attention = layer - shared_expert - router - experts - norms;
    [
        ("attention", layers * attention),
        ("shared expert", layers * shared_expert),
        ("router", layers * router),
        ("expert weights", layers * experts),
        ("norms", layers * norms + final_norm),
        ("embedding and lm head", outside_layers - final_norm),
    ]
}

/// Bytes a parameter for weights, gradients and optimizer state, before any sharding.
pub fn bytes_per_param(model: &ModelShape, workload: &Workload) -> (f64, f64, f64) {
    let weight = model.dtype_bytes as f64;
    if workload.mode == Mode::Infer {
        return (weight, 0.0, 0.0);
    }
    let grad = workload.gradient_bytes(weight);
    let master = if model.dtype_bytes < 4 { 4.0 } else { 0.0 };
    (weight, grad, master + 8.0)
}

/// The memory of every pipeline stage of one rank (one entry when pp = 1).
pub fn memory_per_stage(model: &ModelShape, layout: &Layout, workload: &Workload) -> Vec<MemoryBreakdown> {
    let stages = layout.degree(AxisName::Pp);
    stage_layers(model.layers, stages)
        .into_iter()
        .enumerate()
        .map(|(stage, layers)| stage_memory(model, layout, workload, stage as u64, layers))
        .collect()
}

/// The stage with the highest peak.
pub fn peak_stage(stages: &[MemoryBreakdown]) -> Option<&MemoryBreakdown> {
    stages.iter().max_by(|a, b| a.peak_bytes.total_cmp(&b.peak_bytes))
}

fn stage_memory(model: &ModelShape, layout: &Layout, workload: &Workload, stage: u64, layers: u64) -> MemoryBreakdown {
    let tp = layout.degree(AxisName::Tp) as f64;
    let tsp = layout.degree(AxisName::Tsp) as f64;
    let stages = layout.degree(AxisName::Pp);
    let training = workload.mode == Mode::Train;
    let element = model.dtype_bytes as f64;
    let hidden = model.hidden as f64;
    let param_count = stage_params(model, layout, workload, stage, layers);
    let (weight, grad, optimizer) = bytes_per_param(model, workload);
    let zero = if workload.distributed_optimizer { workload.zero.max(1) } else { workload.zero };
    // cp's ranks hold the same weights, and ep splits the batch as dp does: the dense parameters
    // have dp·cp·ep replicas, the routed experts (split over ep) dp·cp. ZeRO shards each over its
    // replicas, as flat buffers do (the executor's rows that do not divide stay whole:
    // `zero_rows`, a named term of the compiled forms).
    let dense_replicas = layout.zero_replicas() as f64;
    let expert_replicas = layout.expert_zero_replicas() as f64;
    let expert_count = stage_expert_params(model, layout, layers);
    let dense_count = param_count - expert_count;
    let shard = |from_stage: u8, replicas: f64| if zero >= from_stage { replicas } else { 1.0 };
    let sharded = |per_param: f64, from_stage: u8| {
        (
            dense_count * per_param / shard(from_stage, dense_replicas),
            expert_count * per_param / shard(from_stage, expert_replicas),
        )
    };
    let (dense_weights, expert_weights) = sharded(weight, 3);
    let (dense_grads, expert_grads) = sharded(grad, 2);
    let (dense_optimizer, expert_optimizer) = sharded(optimizer, 1);
    let params_bytes = dense_weights + expert_weights;
    let grads_bytes = dense_grads + expert_grads;
    let optimizer_bytes = dense_optimizer + expert_optimizer;

    let tokens = local_tokens(layout, workload);
    let kv_local = model.kv_width() as f64 / kv_split(model, layout) as f64;
    let last = stage + 1 == stages;
    let first = stage == 0;

    let kept = layer_activations(model, layout, workload, workload.recompute);
    let (activations_bytes, in_flight) = if training {
        let in_flight = in_flight_micro_batches(stages, stage, workload);
        let per_layer = kept.total();
        // Token ids on the first stage; the final norm's and LM head's inputs on the last.
        let ids = if first { 4.0 * tokens } else { 0.0 };
        let head_inputs = if last { 2.0 * tokens * element * hidden } else { 0.0 };
        ((layers as f64 * per_layer + ids + head_inputs) * in_flight, in_flight)
    } else {
        // The KV cache: each rank keeps its tokens' keys and values of its kv heads.
        // Under tsp a rank computes its tokens' k/v for every owner's heads, so it caches them all.
        (layers as f64 * 2.0 * tokens * element * kv_local, 1.0)
    };

    let mut transients = Vec::new();
    let mut add = |name: &'static str, bytes: f64| {
        if bytes > 0.0 {
            transients.push(Term { name, bytes });
        }
    };
    if !training || workload.recompute == Recompute::Full {
        // The sp axis's gathered K/V are either kept (training) or a transient of their own below.
        let layer = layer_activations(model, layout, workload, Recompute::None);
        let working = layer.total() - layer.gathered_kv;
        add(if training { "recomputed layer's activations" } else { "inference layer's activations" }, working);
    }
    if training {
        // The backward holds the gradients of a layer's output and input at once.
        let split = if layout.sequence_parallel { tp } else { 1.0 };
        add("backward gradients of the layer's input and output", 2.0 * tokens * element * hidden / split);
    }
    let backward = if training { 2.0 } else { 1.0 };
    let (_, grad_bytes, _) = bytes_per_param(model, &Workload { mode: Mode::Train, ..workload.clone() });
    if tsp > 1.0 {
        // K/V of one owner's heads over the group's tokens. Training keeps every owner's with the
        // activations, and the backward's dK/dV wait here for their reduce-scatter; under full
        // recompute the backward gathers the K/V again beside them.
        // (The group's tsp·T tokens, the owner's kv/tsp of the rank's heads.)
        let owner_kv = 2.0 * tokens * element * kv_local;
        match (training, workload.recompute == Recompute::Full) {
            (false, _) => add("tsp gathered k/v (one owner's heads)", owner_kv),
            (true, false) => add("tsp dk/dv of one owner's heads before the reduce-scatter", owner_kv),
            (true, true) => add("tsp gathered k/v and dk/dv (one owner's heads)", 2.0 * owner_kv),
        }
        let attention_shard = model.attention_weights() as f64 / (tp * tsp);
        let mlp_shard = model.mlp_weights() as f64 / (tp * tsp);
        add("tsp packed attention weights (double buffer)", 2.0 * attention_shard * element);
        add("tsp mlp ring shards (double buffer)", 2.0 * mlp_shard * element);
        if training {
            add("tsp travelling mlp gradient shards (double buffer)", 2.0 * mlp_shard * grad_bytes);
            add("tsp attention weight gradients reduced to the owner", attention_shard * grad_bytes);
        }
    }
    let sp = layout.degree(AxisName::Sp) as f64;
    if sp > 1.0 {
        // Training keeps the forward's gathered K/V with the activations; the backward's dK/dV
        // of the whole group's tokens wait here for their reduce-scatter.
        let whole_kv = 2.0 * tokens * sp * element * kv_local;
        add(if training { "sp dk/dv before the reduce-scatter" } else { "sp gathered k/v" }, whole_kv);
    }
    let cp = layout.degree(AxisName::Cp) as f64;
    if cp > 1.0 {
        add("cp ring k/v chunks (double buffer)", backward * 2.0 * 2.0 * tokens * element * kv_local);
    }
    if layout.sequence_parallel {
        add("megatron sp all-gathered layer input", tokens * element * hidden);
    }
    if zero >= 3 && dense_replicas > 1.0 {
        let layer = stage_params(model, layout, workload, 1, 1) - stage_params(model, layout, workload, 1, 0);
        add("zero-3 gathered layers (current and prefetched)", 2.0 * layer * weight);
    }
    if stages > 1 {
        let boundary = tokens * element * hidden / if layout.sequence_parallel { tp } else { 1.0 };
        add("pipeline send and receive buffers", backward * 2.0 * boundary);
    }
    let transient_bytes = transients.iter().map(|term| term.bytes).sum();

    let logits_bytes = if last {
        let vocab_local = (model.vocab as f64 / tp).ceil();
        let loss_bytes = if training { element + 4.0 } else { element };
        tokens * vocab_local * loss_bytes
    } else {
        0.0
    };
    let static_bytes = params_bytes + grads_bytes + optimizer_bytes;
    let peak_bytes = static_bytes + activations_bytes + f64::max(logits_bytes, transient_bytes);
    let experts = model.experts.as_ref().map(|_| {
        let parts = stage_param_parts(model, layout, workload, stage, layers);
        let dense_shard = shard(3, dense_replicas);
        let weights = parts
            .iter()
            .filter(|(name, count)| *count > 0.0 || *name == "expert weights")
            .map(|&(name, count)| {
                let replicas = if name == "expert weights" { shard(3, expert_replicas) } else { dense_shard };
                Term { name, bytes: count * weight / replicas }
            })
            .collect();
        // Inference keeps the KV cache only; the experts' buffers are the layer's transients.
        let kept_terms = if training {
            vec![
                ("router logits", kept.router_logits),
                ("routed token copies", kept.routed_tokens),
                ("expert hidden (gate, up, product)", kept.expert_hidden),
            ]
        } else {
            Vec::new()
        };
        let activations = kept_terms
            .into_iter()
            .map(|(name, bytes)| Term { name, bytes: layers as f64 * in_flight * bytes })
            .collect();
        ExpertMemory {
            weights,
            expert_param_count: expert_count,
            expert_grads_bytes: expert_grads,
            expert_optimizer_bytes: expert_optimizer,
            activations,
        }
    });
    MemoryBreakdown {
        stage,
        layers,
        param_count,
        params_bytes,
        grads_bytes,
        optimizer_bytes,
        activations_bytes,
        in_flight,
        transient_bytes,
        transients,
        logits_bytes,
        peak_bytes,
        experts,
    }
}

/// Micro-batches whose activations a stage holds: 1F1B `min(m, p - stage)`; the interleaved
/// schedule multiplies by Megatron's `1 + (p-1)/(p·v)`; without pipelining, one.
pub fn in_flight_micro_batches(stages: u64, stage: u64, workload: &Workload) -> f64 {
    if stages <= 1 {
        return 1.0;
    }
    let plain = workload.micro_batches.min(stages - stage) as f64;
    if workload.virtual_stages > 1 {
        let penalty = 1.0 + (stages - 1) as f64 / (stages * workload.virtual_stages) as f64;
        (stages - stage) as f64 * penalty
    } else {
        plain
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    fn tsp_7b() -> ModelShape {
        ModelShape::from_config(&preset("tsp-7b").unwrap())
    }

    #[test]
    fn stage_layers_sum_to_the_model() {
        assert_eq!(stage_layers(126, 16).iter().sum::<u64>(), 126);
        assert_eq!(stage_layers(126, 16)[0], 7);
        assert_eq!(stage_layers(126, 16)[15], 8);
        assert_eq!(stage_layers(32, 1), vec![32]);
    }

    #[test]
    fn eighteen_bytes_a_parameter_and_its_variants() {
        let model = tsp_7b();
        let workload = Workload::training(4096, 1);
        assert_eq!(bytes_per_param(&model, &workload), (2.0, 4.0, 12.0));
        let bf16_grads = Workload { fp32_grads: false, ..workload.clone() };
        let (w, g, o) = bytes_per_param(&model, &bf16_grads);
        assert_eq!(w + g + o, 16.0);
        let one_rank = &memory_per_stage(&model, &Layout::new(&[], false), &workload)[0];
        assert_eq!(one_rank.param_count, model.param_count() as f64);
        assert_eq!(one_rank.static_bytes(), 18.0 * model.param_count() as f64);
        // Distributed optimizer over dp=8: 6 + 12/8 bytes a parameter.
        let distributed = Workload { distributed_optimizer: true, ..workload.clone() };
        let dp8 = &memory_per_stage(&model, &Layout::new(&[(AxisName::Dp, 8)], false), &distributed)[0];
        assert_eq!(dp8.static_bytes(), (6.0 + 12.0 / 8.0) * model.param_count() as f64);
        let zero3 = Workload { zero: 3, ..workload };
        let dp8 = &memory_per_stage(&model, &Layout::new(&[(AxisName::Dp, 8)], false), &zero3)[0];
        assert_eq!(dp8.static_bytes(), 18.0 / 8.0 * model.param_count() as f64);
    }

    #[test]
    fn tp_and_tsp_split_every_layer_matrix() {
        let model = tsp_7b();
        let workload = Workload { tsp_shards_embeddings: true, ..Workload::training(4096, 1) };
        let norms = (model.layers * model.layer_norm_params() + model.final_norm_params()) as f64;
        for axis in [AxisName::Tp, AxisName::Tsp] {
            let params = memory_per_stage(&model, &Layout::new(&[(axis, 8)], false), &workload)[0].param_count;
            assert_eq!(params - norms, (model.param_count() as f64 - norms) / 8.0, "{axis}");
        }
    }

    #[test]
    fn one_f_one_b_holds_p_micro_batches_on_the_first_stage() {
        let workload = Workload { micro_batches: 16, ..Workload::training(4096, 1) };
        assert_eq!(in_flight_micro_batches(4, 0, &workload), 4.0);
        assert_eq!(in_flight_micro_batches(4, 3, &workload), 1.0);
        let few = Workload { micro_batches: 2, ..workload.clone() };
        assert_eq!(in_flight_micro_batches(4, 0, &few), 2.0);
        let interleaved = Workload { virtual_stages: 2, ..workload };
        assert_eq!(in_flight_micro_batches(4, 0, &interleaved), 4.0 * (1.0 + 3.0 / 8.0));
    }

    #[test]
    fn peak_is_static_plus_activations_plus_the_larger_phase() {
        let model = tsp_7b();
        let workload = Workload { recompute: Recompute::Full, ..Workload::training(16384, 1) };
        let stage = &memory_per_stage(&model, &Layout::new(&[(AxisName::Tsp, 8)], false), &workload)[0];
        let want = stage.static_bytes() + stage.activations_bytes + stage.logits_bytes.max(stage.transient_bytes);
        assert_eq!(stage.peak_bytes, want);
        assert!(stage.transients.iter().any(|term| term.name.starts_with("tsp gathered")));
    }
}
