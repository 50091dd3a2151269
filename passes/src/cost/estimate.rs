//! One plan's estimate: memory by component, communication by kind and axis, time, tokens/s, MFU.
//!
//! The step time is `compute + communication + pipeline bubble`, with no overlap: an upper bound
//! that the scheduler's overlap will lower. With overlap, the collectives that move weights or
//! gradients ([`CollectiveCall::hides_behind_compute`]) run beside the compute and cost only what
//! exceeds it; the others stay exposed: `compute + exposed + bubble`, a lower bound on what the
//! overlap scheduler can reach. The bubble is 1F1B's `(p-1)/m` of the ideal compute
//! (`(p-1)/(v·m)` interleaved). A rank's numbers are those of its most loaded stage (the peak
//! memory's stage for memory, the stage with the most layers for time). [`Estimate`] serializes
//! to the JSON of `pleat plan --format json` (schema version [`SCHEMA_VERSION`]; a mixture of
//! experts adds the [`ExpertSummary`] under `experts` and [`ExpertMemory`] under `memory.experts`,
//! keys a dense model's JSON does not have).
//!
//! For a mixture of experts, `--batch` is the sequences of each dp×ep rank (ep splits the batch as
//! dp does), so a step's tokens are `s·b·m·dp·ep`. Its memory sizes the experts' buffers for
//! balanced routing; [`ExpertLoad`] gives the tokens an expert's rank receives then and at worst.

use std::collections::BTreeMap;

use pleat_ir::AxisName;

use super::compute::{head_time, layer_time, mfu, model_flops_per_step};
use super::hw::HardwareSpec;
use super::layout::Layout;
use super::memory::{memory_per_stage, peak_stage, ExpertMemory, MemoryBreakdown, Term};
use super::model::ModelShape;
use super::volume::{forward_elements_per_layer, layer_collectives, step_collectives, CollectiveCall, Phase};
use super::workload::{Mode, Workload};
use super::{comm, total, CostError, Result};

/// The version of the estimate's JSON.
pub const SCHEMA_VERSION: u32 = 1;

/// Memory of the most loaded rank, in bytes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MemorySummary {
    /// The stage it is on.
    pub stage: u64,
    /// Weights.
    pub params_bytes: f64,
    /// Gradients.
    pub grads_bytes: f64,
    /// Optimizer state.
    pub optimizer_bytes: f64,
    /// Kept for the backward (or KV cache).
    pub activations_bytes: f64,
    /// Live while a layer runs.
    pub transient_bytes: f64,
    /// Logits and loss buffers.
    pub logits_bytes: f64,
    /// The peak.
    pub peak_bytes: f64,
    /// The device's memory.
    pub device_bytes: f64,
    /// The transients by name.
    pub transients: Vec<Term>,
    /// A mixture of experts' split of the above by component; absent for a dense model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertMemory>,
}

/// The tokens one expert receives, under balanced routing and at worst (dropless routing: no
/// capacity factor drops a token, so nothing bounds an expert's load but the tokens routed).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExpertLoad {
    /// A step, over all replicas: `tokens · top_k / E` when every expert gets its share.
    pub expected_tokens_per_step: f64,
    /// A step, at worst: every token picks the expert, `tokens`.
    pub worst_tokens_per_step: f64,
    /// One rank's copy of an expert, a layer and micro-batch: the `T·ep` tokens of its ep group
    /// (`T` = the tokens a rank routes) times `top_k / E`. The memory's buffers are sized for this.
    pub expected_tokens_per_rank: f64,
    /// The same at worst: `T·ep`.
    pub worst_tokens_per_rank: f64,
}

/// What a mixture of experts adds to a plan.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExpertSummary {
    /// Routed experts a layer.
    pub experts: u64,
    /// Experts a token runs.
    pub top_k: u64,
    /// Experts a rank holds a layer (`E/ep`).
    pub experts_per_rank: u64,
    /// Every parameter of the model.
    pub param_count: u64,
    /// The parameters a token's forward pass reads (`top_k` experts a layer).
    pub active_param_count: u64,
    /// Bytes a rank sends a step in the expert all-to-alls (over ep, or tsp without ep): dispatch,
    /// combine, their gradients, counts.
    pub all_to_all_bytes_per_step: f64,
    /// Seconds a step of those all-to-alls.
    pub all_to_all_seconds_per_step: f64,
    /// The tokens an expert receives.
    pub load: ExpertLoad,
    /// The routing assumption behind the memory and time figures, in words.
    pub note: String,
}

/// One collective's share of a step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CallCost {
    /// The collective.
    #[serde(flatten)]
    pub call: CollectiveCall,
    /// Bytes one rank sends for it a step.
    pub bytes_per_step: f64,
    /// Seconds a step.
    pub seconds_per_step: f64,
}

/// Communication of one rank.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CommSummary {
    /// Bytes sent in the forward pass of one layer and micro-batch.
    pub bytes_per_layer_fwd: f64,
    /// Elements sent in the forward pass of one layer (the closed forms' unit).
    pub elements_per_layer_fwd: f64,
    /// Seconds of the forward collectives of one layer and micro-batch.
    pub seconds_per_layer_fwd: f64,
    /// Bytes sent a step.
    pub bytes_per_step: f64,
    /// Bytes a step by collective kind.
    pub bytes_by_kind: BTreeMap<&'static str, f64>,
    /// Bytes a step by mesh axis.
    pub bytes_by_axis: BTreeMap<&'static str, f64>,
    /// Every collective.
    pub calls: Vec<CallCost>,
}

/// Seconds of one step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TimeSummary {
    /// Compute, roofline.
    pub compute_s: f64,
    /// Communication, not overlapped.
    pub comm_s: f64,
    /// The pipeline bubble.
    pub bubble_s: f64,
    /// The sum.
    pub step_s: f64,
    /// Communication the compute cannot hide: every collective that carries activations, and
    /// what the weight and gradient collectives take beyond the compute.
    pub exposed_comm_s: f64,
    /// `compute + exposed communication + bubble`: the step with overlap.
    pub overlapped_step_s: f64,
}

/// Everything `pleat plan` reports.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Estimate {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The model's name.
    pub model: String,
    /// The layout's label.
    pub layout: String,
    /// Ranks.
    pub world_size: u64,
    /// Whether pleat compiles this layout today (otherwise the figures are the model's only).
    pub compiles_today: bool,
    /// The hardware's name.
    pub hardware: String,
    /// The workload.
    pub workload: Workload,
    /// Memory of the most loaded rank.
    pub memory: MemorySummary,
    /// Memory of each pipeline stage.
    pub stages: Vec<MemoryBreakdown>,
    /// Communication.
    pub comm: CommSummary,
    /// Time.
    pub time: TimeSummary,
    /// Tokens a step, all replicas.
    pub tokens_per_step: f64,
    /// Tokens a second.
    pub tokens_per_s: f64,
    /// Model FLOPs a step (PaLM's count).
    pub model_flops_per_step: f64,
    /// Model FLOPs utilization.
    pub mfu: f64,
    /// A mixture of experts' parameters, all-to-alls and expert load; absent for a dense model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertSummary>,
    /// What the user should know (memory over the device's, layouts the compiler lacks).
    pub warnings: Vec<String>,
}

/// Estimates one plan.
pub fn estimate(model: &ModelShape, layout: &Layout, workload: &Workload, hw: &HardwareSpec) -> Result<Estimate> {
    workload.validate()?;
    // Token counts are integers up to here and f64 after: both exact below 2^53.
    let factors = [workload.seq, workload.micro_batch, workload.micro_batches, layout.batch_split()];
    let tokens = factors.iter().try_fold(1u64, |product, &factor| product.checked_mul(factor));
    if tokens.is_none_or(|tokens| tokens > 1 << 53) {
        return Err(CostError::TooManyTokens {
            seq: workload.seq,
            micro_batch: workload.micro_batch,
            micro_batches: workload.micro_batches,
            replicas: layout.batch_split(),
        });
    }
    layout.validate(model, workload)?;
    let stages = memory_per_stage(model, layout, workload);
    let peak = peak_stage(&stages).expect("a layout has at least one stage").clone();
    let busiest = stages.iter().max_by_key(|stage| stage.layers).expect("at least one stage");
    let layers = busiest.layers as f64;
    let micro_batches = workload.micro_batches as f64;
    let pipeline = layout.degree(AxisName::Pp);

    let span = |axis: AxisName| layout.span(axis, hw.gpus_per_node);
    let mut calls = Vec::new();
    for call in layer_collectives(model, layout, workload) {
        let repeats = layers * micro_batches;
        calls.push(cost_call(call, repeats, layout, hw));
    }
    for call in step_collectives(model, layout, workload, busiest.param_count, busiest.layers) {
        calls.push(cost_call(call, 1.0, layout, hw));
    }
    let forward_calls: Vec<&CallCost> = calls.iter().filter(|cost| cost.call.phase == Phase::Forward).collect();
    let bytes_per_layer_fwd =
        total(forward_calls.iter().map(|cost| cost.call.bytes_sent(layout.degree(cost.call.axis))));
    let seconds_per_layer_fwd = total(
        forward_calls
            .iter()
            .map(|cost| cost.call.count * comm::time(cost.call.kind, cost.call.bytes, span(cost.call.axis), hw)),
    );
    let mut bytes_by_kind = BTreeMap::new();
    let mut bytes_by_axis = BTreeMap::new();
    for cost in &calls {
        *bytes_by_kind.entry(cost.call.kind.as_str()).or_insert(0.0) += cost.bytes_per_step;
        *bytes_by_axis.entry(cost.call.axis.as_str()).or_insert(0.0) += cost.bytes_per_step;
    }
    let comm_s = total(calls.iter().map(|cost| cost.seconds_per_step));
    let comm = CommSummary {
        bytes_per_layer_fwd,
        elements_per_layer_fwd: forward_elements_per_layer(model, layout, workload),
        seconds_per_layer_fwd,
        bytes_per_step: total(calls.iter().map(|cost| cost.bytes_per_step)),
        bytes_by_kind,
        bytes_by_axis,
        calls,
    };

    let head = if pipeline == 1 { head_time(model, layout, workload, hw) } else { 0.0 };
    let compute_s = micro_batches * (layers * layer_time(model, layout, workload, hw) + head);
    let bubble_s = if pipeline > 1 {
        compute_s * (pipeline - 1) as f64 / (workload.virtual_stages as f64 * micro_batches)
    } else {
        0.0
    };
    let step_s = compute_s + comm_s + bubble_s;
    let hideable_s =
        total(comm.calls.iter().filter(|cost| cost.call.hides_behind_compute()).map(|cost| cost.seconds_per_step));
    let exposed_comm_s = (comm_s - hideable_s) + (hideable_s - compute_s).max(0.0);
    let overlapped_step_s = compute_s + exposed_comm_s + bubble_s;
    let tokens_per_step = (workload.tokens_per_micro_batch() * workload.micro_batches * layout.batch_split()) as f64;
    // Every model pleat builds is a causal decoder.
    let model_flops = model_flops_per_step(model, workload, tokens_per_step, true);
    let mut warnings = Vec::new();
    if peak.peak_bytes > hw.memory_bytes as f64 {
        warnings.push(format!(
            "peak memory {:.1} GB a rank (stage {}) exceeds the {} GB of a {}; add ranks, recompute, or ZeRO",
            peak.peak_bytes / 1e9,
            peak.stage,
            format_args!("{:.1}", hw.memory_bytes as f64 / 1e9),
            hw.name
        ));
    }
    if let Some((first, second, reason)) = layout.refused_pair() {
        warnings.push(format!(
            "{layout}: pleat does not compile {first} beside {second}: {reason}; `pleat compile` refuses it (E0209), \
             and these figures come from the cost model only"
        ));
    } else if !layout.compiles_today(workload.mode) {
        warnings.push(format!(
            "{layout}: pleat cannot compile this layout yet; these figures come from the cost model only"
        ));
    }
    if workload.mode == Mode::Infer && workload.recompute != super::Recompute::None {
        warnings.push("recompute has no effect on inference".to_string());
    }
    // (ZeRO shards training state over a parameter's replicas; `pleat run` refuses it without.)
    if workload.mode == Mode::Infer && workload.zero > 0 {
        warnings.push(format!("zero {} has no effect on inference, which keeps no optimizer state", workload.zero));
    } else if workload.zero > 0 && layout.zero_replicas() == 1 {
        warnings.push(format!(
            "zero {} shards over the ranks that replicate the parameters (dp, cp or ep), and {layout} has none \
             above 1: it has no effect, and `pleat run --train` refuses it (E0719)",
            workload.zero
        ));
    }
    let experts = expert_summary(model, layout, workload, &comm.calls, tokens_per_step);
    Ok(Estimate {
        schema_version: SCHEMA_VERSION,
        model: model.name.clone(),
        layout: layout.label(),
        world_size: layout.world_size(),
        compiles_today: layout.compiles_today(workload.mode),
        hardware: hw.name.clone(),
        workload: workload.clone(),
        memory: MemorySummary {
            stage: peak.stage,
            params_bytes: peak.params_bytes,
            grads_bytes: peak.grads_bytes,
            optimizer_bytes: peak.optimizer_bytes,
            activations_bytes: peak.activations_bytes,
            transient_bytes: peak.transient_bytes,
            logits_bytes: peak.logits_bytes,
            peak_bytes: peak.peak_bytes,
            device_bytes: hw.memory_bytes as f64,
            transients: peak.transients.clone(),
            experts: peak.experts.clone(),
        },
        stages,
        comm,
        time: TimeSummary { compute_s, comm_s, bubble_s, step_s, exposed_comm_s, overlapped_step_s },
        tokens_per_step,
        tokens_per_s: tokens_per_step / step_s,
        model_flops_per_step: model_flops,
        mfu: mfu(model_flops, step_s, layout.world_size(), hw, model.dtype_bytes),
        experts,
        warnings,
    })
}

/// The mixture-of-experts part of a plan; `None` for a dense model.
fn expert_summary(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    calls: &[CallCost],
    tokens_per_step: f64,
) -> Option<ExpertSummary> {
    let experts = model.experts.as_ref()?;
    let ep = layout.expert_degree();
    let all_to_alls = || calls.iter().filter(|cost| cost.call.kind == comm::Collective::AllToAll);
    let share = experts.top_k as f64 / experts.count as f64;
    let group_tokens = super::activation::local_tokens(layout, workload) * ep as f64;
    let load = ExpertLoad {
        expected_tokens_per_step: tokens_per_step * share,
        worst_tokens_per_step: tokens_per_step,
        expected_tokens_per_rank: group_tokens * share,
        worst_tokens_per_rank: group_tokens,
    };
    let note = format!(
        "dropless top-{} routing over {} experts, costed as balanced: an expert gets {:.0} of the {:.0} tokens its {} \
         group routes a layer and micro-batch (the expert buffers and all-to-all sizes assume this); skewed routing \
         can send it all {:.0} ({:.1}x)",
        experts.top_k,
        experts.count,
        load.expected_tokens_per_rank,
        load.worst_tokens_per_rank,
        layout.expert_axis().unwrap_or(AxisName::Ep),
        load.worst_tokens_per_rank,
        load.worst_tokens_per_rank / load.expected_tokens_per_rank,
    );
    Some(ExpertSummary {
        experts: experts.count,
        top_k: experts.top_k,
        experts_per_rank: experts.count / ep,
        param_count: model.param_count(),
        active_param_count: model.active_param_count(),
        all_to_all_bytes_per_step: total(all_to_alls().map(|cost| cost.bytes_per_step)),
        all_to_all_seconds_per_step: total(all_to_alls().map(|cost| cost.seconds_per_step)),
        load,
        note,
    })
}

fn cost_call(call: CollectiveCall, repeats: f64, layout: &Layout, hw: &HardwareSpec) -> CallCost {
    let ranks = layout.degree(call.axis);
    let span = layout.span(call.axis, hw.gpus_per_node);
    let bytes_per_step = repeats * call.bytes_sent(ranks);
    let seconds_per_step = repeats * call.count * comm::time(call.kind, call.bytes, span, hw);
    CallCost { call, bytes_per_step, seconds_per_step }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    #[test]
    fn an_estimate_adds_up() {
        let model = ModelShape::from_config(&preset("llama3-8b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let layout = Layout::new(&[(AxisName::Dp, 4), (AxisName::Tp, 2)], false);
        let workload = Workload { micro_batches: 4, distributed_optimizer: true, ..Workload::training(4096, 1) };
        let estimate = estimate(&model, &layout, &workload, &hw).unwrap();
        assert_eq!(estimate.tokens_per_step, 4096.0 * 4.0 * 4.0);
        let time = &estimate.time;
        assert_eq!(time.step_s, time.compute_s + time.comm_s + time.bubble_s);
        // dp=4 × tp=2: the gradient all-reduce hides behind the compute; TP's all-reduces do not.
        let tp_s: f64 = estimate
            .comm
            .calls
            .iter()
            .filter(|cost| cost.call.axis == AxisName::Tp)
            .map(|cost| cost.seconds_per_step)
            .sum();
        let dp_s = time.comm_s - tp_s;
        assert!(dp_s > 0.0 && tp_s > 0.0 && dp_s < time.compute_s);
        assert!((time.exposed_comm_s - tp_s).abs() <= 1e-12 * time.comm_s, "{time:?}");
        assert_eq!(time.overlapped_step_s, time.compute_s + time.exposed_comm_s + time.bubble_s);
        assert!(estimate.mfu > 0.0 && estimate.mfu < 1.0, "mfu {}", estimate.mfu);
        let by_kind: f64 = estimate.comm.bytes_by_kind.values().sum();
        assert!((by_kind - estimate.comm.bytes_per_step).abs() <= 1e-9 * by_kind);
        assert!(estimate.comm.bytes_by_axis.contains_key("dp") && estimate.comm.bytes_by_axis.contains_key("tp"));
        assert!(estimate.compiles_today && estimate.warnings.is_empty(), "{:?}", estimate.warnings);
    }

    #[test]
    fn tsp_hides_its_weights_and_keeps_its_kv_gathers_exposed() {
        let model = ModelShape::from_config(&preset("tsp-7b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let layout = Layout::new(&[(AxisName::Tsp, 8)], false);
        let estimate = estimate(&model, &layout, &Workload::inference(131072, 1), &hw).unwrap();
        let seconds = |what: &str| -> f64 {
            estimate.comm.calls.iter().filter(|cost| cost.call.what == what).map(|cost| cost.seconds_per_step).sum()
        };
        let weights = seconds("tsp broadcast of packed attention weights") + seconds("tsp ring of mlp shards");
        let kv = seconds("tsp all-gather of k/v");
        let time = &estimate.time;
        assert!(weights > 0.0 && kv > 0.0);
        assert_eq!(weights + kv, time.comm_s, "inference TSP moves weights and k/v only");
        let want = kv + (weights - time.compute_s).max(0.0);
        assert!((time.exposed_comm_s - want).abs() <= 1e-12 * time.comm_s, "{time:?}");
        assert!(time.overlapped_step_s < time.step_s);
    }

    #[test]
    fn warnings_name_the_excess_and_the_analytic_layouts() {
        let model = ModelShape::from_config(&preset("llama3-70b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let layout = Layout::new(&[(AxisName::Pp, 2), (AxisName::Sp, 2)], false);
        let estimate = estimate(&model, &layout, &Workload::training(8192, 1), &hw).unwrap();
        assert!(estimate.warnings[0].starts_with("peak memory "), "{:?}", estimate.warnings);
        assert!(estimate.warnings[0].contains("exceeds the 85.5 GB of a h100-sxm"), "{}", estimate.warnings[0]);
        assert!(
            estimate.warnings[1].contains("pp=2 x sp=2: pleat cannot compile this layout yet"),
            "{:?}",
            estimate.warnings
        );
        // pp pipelines a training step, which pleat compiles; a forward pass it refuses.
        let pipelined = Layout::new(&[(AxisName::Pp, 2)], false);
        let training = super::estimate(&model, &pipelined, &Workload::training(8192, 1), &hw).unwrap();
        assert!(training.compiles_today && training.warnings.len() == 1, "{:?}", training.warnings);
        let inference = super::estimate(&model, &pipelined, &Workload::inference(8192, 1), &hw).unwrap();
        assert!(!inference.compiles_today, "{:?}", inference.warnings);
        // A pair the compiler refuses for good says so, not "yet".
        let layout = Layout::new(&[(AxisName::Pp, 2), (AxisName::Tsp, 2), (AxisName::Tp, 2)], false);
        let refused = super::estimate(&model, &layout, &Workload::training(8192, 1), &hw).unwrap();
        let warning = refused.warnings.iter().find(|warning| warning.contains("E0209")).expect("a refused pair");
        assert!(warning.contains("pleat does not compile tsp beside tp: both split the weights"), "{warning}");
        assert!(!refused.warnings.iter().any(|warning| warning.contains("yet")), "{:?}", refused.warnings);
        // ZeRO without replicas, or on inference, says it does nothing.
        let small = ModelShape::from_config(&preset("tiny").unwrap());
        let zero = |mesh: &[(AxisName, u64)], workload: Workload| {
            let workload = Workload { zero: 3, ..workload };
            super::estimate(&small, &Layout::new(mesh, false), &workload, &hw).unwrap().warnings
        };
        let unsharded = zero(&[(AxisName::Tp, 2)], Workload::training(64, 1));
        assert!(
            unsharded.iter().any(|warning| warning.contains("has none above 1: it has no effect")),
            "{unsharded:?}"
        );
        let inference = zero(&[(AxisName::Dp, 2)], Workload::inference(64, 1));
        assert!(inference.iter().any(|warning| warning.contains("no effect on inference")), "{inference:?}");
        assert!(zero(&[(AxisName::Dp, 2)], Workload::training(64, 1)).is_empty());
    }
}
