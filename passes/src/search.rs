//! `search`: the best plans for a model on a cluster under a memory cap, from the cost model.
//!
//! The space: every way to write the GPU count as a product of the mesh axes the compiler has
//! strategies for ([`crate::strategy::SUPPORTED_AXES`]; it grows as strategies land), Megatron
//! sequence parallelism on or off when there is a tp axis, every ZeRO stage when there is a dp
//! axis, every recompute mode when training, and every micro-batch size (a power of two up to
//! [`SearchSpace::max_micro_batch`]) that divides the sequences a replica sees in a step; a wider
//! search may take every axis the cost model knows ([`MODELLED_AXES`], pipelines included). Placement
//! follows practice: the axes are ordered dp, pp, ep, cp, sp, tsp, tp from the outside in (ranks are
//! numbered row-major, so the weight-splitting axis is packed inside a node; ep sits outside the
//! sequence and weight splits, as in Megatron-LM's expert groups), the weight-splitting axis must
//! fit in a node, and tsp is combined neither with tp (both split the weights) nor with cp (both
//! split the sequence). Only a mixture of experts takes ep, at the degrees that divide its experts
//! (ep splits the batch as dp does, so a step's sequences divide over dp·ep). Layouts the model
//! cannot take (heads, kv heads, vocabulary or sequence that do not divide) and plans over the cap
//! are counted and dropped. The rest are ranked by predicted step time, then peak memory, then
//! name, so the order is deterministic.
//!
//! Every plan is one closed-form [`estimate()`] (layers are identical, so the model costs one layer
//! and multiplies), which is why the largest models answer in milliseconds.

use pleat_ir::{AxisName, Mesh};

use crate::cost::memory::{memory_per_stage, peak_stage};
use crate::cost::{estimate, CostError, Estimate, HardwareSpec, Layout, Mode, ModelShape, Recompute, Workload};

/// What to search over.
#[derive(Clone, Debug)]
pub struct SearchSpace {
    /// GPUs (ranks) in all.
    pub gpus: u64,
    /// Tokens a sequence.
    pub seq: u64,
    /// Sequences a step, over all data-parallel replicas.
    pub global_batch: u64,
    /// Training or inference.
    pub mode: Mode,
    /// The most bytes a GPU may hold.
    pub mem_cap_bytes: f64,
    /// The largest micro-batch (sequences) tried.
    pub max_micro_batch: u64,
    /// The mesh axes plans may use.
    pub axes: Vec<AxisName>,
    /// How many of the best plans to keep.
    pub keep: usize,
}

impl SearchSpace {
    /// The space over every axis the compiler builds in `mode` (pp for training), micro-batches
    /// up to 8.
    pub fn new(gpus: u64, seq: u64, global_batch: u64, mode: Mode, mem_cap_bytes: f64) -> Self {
        SearchSpace {
            gpus,
            seq,
            global_batch,
            mode,
            mem_cap_bytes,
            max_micro_batch: 8,
            axes: crate::cost::compiled_axes(mode),
            keep: 10,
        }
    }
}

/// A costed plan.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The mesh.
    pub layout: Layout,
    /// Micro-batching, ZeRO and recompute.
    pub workload: Workload,
    /// The cost model's figures.
    pub estimate: Estimate,
}

impl Plan {
    /// The mesh as `--mesh` takes it (`dp=2,tp=4`; empty for one rank).
    pub fn mesh(&self) -> String {
        self.layout.axes().iter().map(|(axis, degree)| format!("{axis}={degree}")).collect::<Vec<_>>().join(",")
    }

    /// Whether it uses only one mesh axis (or none).
    pub fn is_single_axis(&self) -> bool {
        self.layout.axes().len() <= 1
    }
}

/// What a search found.
#[derive(Clone, Debug)]
pub struct SearchOutcome {
    /// The best [`SearchSpace::keep`] plans under the cap, best first.
    pub plans: Vec<Plan>,
    /// Plans under the cap in all.
    pub feasible: u64,
    /// For each single-axis layout (and one rank) that fits: its plan of least memory, and its
    /// fastest plan.
    pub single_axis: Vec<(Plan, Plan)>,
    /// Plans costed (feasible or not).
    pub costed: u64,
    /// Plans dropped for exceeding the memory cap.
    pub over_memory: u64,
    /// Layouts the model cannot take (a dim that does not divide).
    pub indivisible: u64,
    /// Meshes whose dp·ep degree does not divide the global batch.
    pub batch_mismatch: u64,
    /// Plans not costed because a variant of them that needs less memory was already over the cap.
    pub pruned: u64,
}

/// Errors of the search's inputs.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum SearchError {
    /// A count that must be positive is zero.
    #[error("--{what} 0: give at least 1")]
    #[diagnostic(code(E0240), help("give the flag a value of at least 1"))]
    Zero {
        /// The flag.
        what: &'static str,
    },
    /// More GPUs than a mesh may have.
    #[error("--gpus {gpus} is more than pleat addresses ({max}); search at most {max} GPUs")]
    #[diagnostic(code(E0235), help("give --gpus at most 16777216 (2^24)"))]
    TooManyGpus {
        /// GPUs asked for.
        gpus: u64,
        /// [`pleat_ir::Mesh::MAX_RANKS`].
        max: u64,
    },
    /// No plan fits.
    #[error(
        "no plan of {gpus} GPUs fits in {cap_gb:.1} GB a GPU: {costed} costed, {over_memory} over the cap, \
         {pruned} skipped as surely over it, {indivisible} indivisible layouts"
    )]
    #[diagnostic(code(E0241), help("add GPUs, raise --mem-cap, or shorten --seq"))]
    NothingFits {
        /// GPUs.
        gpus: u64,
        /// The cap, GB.
        cap_gb: f64,
        /// Plans costed.
        costed: u64,
        /// Over the cap.
        over_memory: u64,
        /// Plans not costed: larger micro-batches of a setting already over the cap.
        pruned: u64,
        /// Indivisible layouts.
        indivisible: u64,
    },
    /// No layout of the GPUs divides the model and the batch: memory is not what stops them.
    #[error(
        "no layout of {gpus} GPUs divides the model and the batch ({indivisible} tried, each with a size an \
         axis does not divide: heads, layers, experts, the sequence or --global-batch)"
    )]
    #[diagnostic(
        code(E0236),
        help("use a GPU count whose factors divide the model's heads and layers, a longer --seq, or a larger --global-batch")
    )]
    NoLayoutDivides {
        /// GPUs.
        gpus: u64,
        /// Indivisible layouts.
        indivisible: u64,
    },
}

/// The placement order, outermost first.
const PLACEMENT: [AxisName; 7] =
    [AxisName::Dp, AxisName::Pp, AxisName::Ep, AxisName::Cp, AxisName::Sp, AxisName::Tsp, AxisName::Tp];

/// Every axis the cost model knows, for searches that may propose plans the compiler cannot build
/// yet ([`Layout::compiles_today`] marks them).
pub const MODELLED_AXES: [AxisName; 7] = PLACEMENT;

/// Every assignment of degrees to `axes` (in placement order) whose product is `gpus`.
fn factorizations(gpus: u64, axes: &[AxisName]) -> Vec<Vec<(AxisName, u64)>> {
    let Some((&first, rest)) = axes.split_first() else {
        return if gpus == 1 { vec![Vec::new()] } else { Vec::new() };
    };
    let mut all = Vec::new();
    for degree in pleat_ir::spec::divisors(gpus) {
        for mut tail in factorizations(gpus / degree, rest) {
            tail.insert(0, (first, degree));
            all.push(tail);
        }
    }
    all
}

/// The meshes of the space: placement order, weight splits inside a node, tp and tsp apart, and
/// Megatron SP as a variant of every tp layout.
pub fn layouts(space: &SearchSpace, gpus_per_node: u64) -> Vec<Layout> {
    let axes: Vec<AxisName> = PLACEMENT.iter().copied().filter(|axis| space.axes.contains(axis)).collect();
    let mut layouts = Vec::new();
    for degrees in factorizations(space.gpus, &axes) {
        let layout = Layout::new(&degrees, false);
        let (tp, tsp, cp) = (layout.degree(AxisName::Tp), layout.degree(AxisName::Tsp), layout.degree(AxisName::Cp));
        // tp and tsp split the same weights, tsp and cp the same sequence: pleat composes neither.
        if (tsp > 1 && (tp > 1 || cp > 1)) || tp * tsp > gpus_per_node.max(1) {
            continue;
        }
        if tp > 1 {
            layouts.push(Layout::new(&degrees, true));
        }
        layouts.push(layout);
    }
    layouts
}

/// The workloads tried on `layout` (whose batch splits dp·ep ways; ZeRO stages where dp, cp or ep
/// replicates the parameters), one group a micro-batch size, smallest first.
/// For a fixed ZeRO stage and recompute mode, memory never falls as the micro-batch grows (its
/// activations, logits and transients grow with it, and with pipelines the in-flight micro-batches
/// hold `b·min(m, p)` sequences, `b·m` being fixed), so once a whole group is over the cap the
/// search skips the larger ones. (Within a group it is not monotone: ZeRO-3's gathered layers and
/// full recompute's working set are transients the other settings do not have.)
fn workloads(space: &SearchSpace, layout: &Layout) -> Vec<Vec<Workload>> {
    let per_replica = space.global_batch / layout.batch_split();
    let recomputes: &[Recompute] = match space.mode {
        Mode::Train => &[Recompute::None, Recompute::Selective, Recompute::Full],
        Mode::Infer => &[Recompute::None],
    };
    // ZeRO shards over a parameter's replicas: dp, cp and ep.
    let zero_stages: &[u8] = if layout.zero_replicas() > 1 && space.mode == Mode::Train { &[0, 1, 2, 3] } else { &[0] };
    let micro_batches = (0..).map(|power| 1u64 << power).take_while(|&size| size <= space.max_micro_batch);
    micro_batches
        .filter(|size| per_replica % size == 0)
        .map(|micro_batch| {
            let base = match space.mode {
                Mode::Train => Workload::training(space.seq, micro_batch),
                Mode::Infer => Workload::inference(space.seq, micro_batch),
            };
            let mut group = Vec::new();
            for &recompute in recomputes {
                for &zero in zero_stages {
                    group.push(Workload {
                        micro_batches: per_replica / micro_batch,
                        recompute,
                        zero,
                        // pleat's TSP keeps the embedding and LM head vocab-parallel over the tsp group.
                        tsp_shards_embeddings: true,
                        ..base.clone()
                    });
                }
            }
            group
        })
        .collect()
}

/// Searches `space` for `model` on `hw`.
pub fn search(model: &ModelShape, hw: &HardwareSpec, space: &SearchSpace) -> Result<SearchOutcome, SearchError> {
    for (what, value) in [("gpus", space.gpus), ("seq", space.seq), ("global-batch", space.global_batch)] {
        if value == 0 {
            return Err(SearchError::Zero { what });
        }
    }
    if space.gpus > Mesh::MAX_RANKS {
        return Err(SearchError::TooManyGpus { gpus: space.gpus, max: Mesh::MAX_RANKS });
    }
    // Only a mixture of experts can use ep, and only at degrees that divide its experts.
    let space = &match &model.experts {
        Some(_) => space.clone(),
        None => SearchSpace {
            axes: space.axes.iter().copied().filter(|&axis| axis != AxisName::Ep).collect(),
            ..space.clone()
        },
    };
    let mut outcome = SearchOutcome {
        plans: Vec::new(),
        feasible: 0,
        single_axis: Vec::new(),
        costed: 0,
        over_memory: 0,
        indivisible: 0,
        batch_mismatch: 0,
        pruned: 0,
    };
    let keep = space.keep.max(1);
    for layout in layouts(space, hw.gpus_per_node) {
        let experts = model.experts.as_ref().map_or(1, |experts| experts.count);
        if experts % layout.degree(AxisName::Ep) != 0 {
            continue;
        }
        let replicas = layout.batch_split();
        if space.global_batch % replicas != 0 {
            outcome.batch_mismatch += 1;
            continue;
        }
        let groups = workloads(space, &layout);
        'layout: for (index, group) in groups.iter().enumerate() {
            let mut any_fits = false;
            for workload in group {
                outcome.costed += 1;
                match peak_then_estimate(model, &layout, workload, hw, space.mem_cap_bytes) {
                    Ok(Some(estimate)) => {
                        any_fits = true;
                        outcome.feasible += 1;
                        let plan = Plan { layout: layout.clone(), workload: workload.clone(), estimate };
                        if plan.is_single_axis() {
                            keep_single_axis_best(&mut outcome.single_axis, &plan);
                        }
                        outcome.plans.push(plan);
                        // Only the best few are kept: a large search costs tens of thousands.
                        if outcome.plans.len() >= 8 * keep {
                            rank(&mut outcome.plans);
                            outcome.plans.truncate(keep);
                        }
                    }
                    Ok(None) => outcome.over_memory += 1,
                    Err(
                        CostError::Indivisible { .. }
                        | CostError::UnusableAxis { .. }
                        | CostError::TooManyStages { .. },
                    ) => {
                        // The layout itself does not fit the model: no workload will.
                        outcome.indivisible += 1;
                        break 'layout;
                    }
                    Err(_) => outcome.indivisible += 1,
                }
            }
            if !any_fits {
                // Larger micro-batches need at least as much memory, setting for setting.
                outcome.pruned += groups[index + 1..].iter().map(Vec::len).sum::<usize>() as u64;
                break;
            }
        }
    }
    if outcome.plans.is_empty() && outcome.over_memory == 0 && outcome.pruned == 0 {
        return Err(SearchError::NoLayoutDivides { gpus: space.gpus, indivisible: outcome.indivisible });
    }
    if outcome.plans.is_empty() {
        return Err(SearchError::NothingFits {
            gpus: space.gpus,
            cap_gb: space.mem_cap_bytes / 1e9,
            costed: outcome.costed,
            over_memory: outcome.over_memory,
            pruned: outcome.pruned,
            indivisible: outcome.indivisible,
        });
    }
    rank(&mut outcome.plans);
    outcome.plans.truncate(keep);
    outcome.single_axis.sort_by(|a, b| a.0.estimate.memory.peak_bytes.total_cmp(&b.0.estimate.memory.peak_bytes));
    Ok(outcome)
}

/// The plan's estimate if its peak memory fits under `cap`; `None` if not. Memory is costed first,
/// alone: most of a large space is over the cap, and the time model is the larger part of an
/// estimate.
fn peak_then_estimate(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    hw: &HardwareSpec,
    cap: f64,
) -> Result<Option<Estimate>, CostError> {
    workload.validate()?;
    layout.validate(model, workload)?;
    let stages = memory_per_stage(model, layout, workload);
    if peak_stage(&stages).is_some_and(|peak| peak.peak_bytes > cap) {
        return Ok(None);
    }
    let estimate = estimate(model, layout, workload, hw)?;
    Ok((estimate.memory.peak_bytes <= cap).then_some(estimate))
}

/// Best first: step time, then peak memory, then names (a total, deterministic order).
fn rank(plans: &mut [Plan]) {
    plans.sort_by(|a, b| {
        a.estimate
            .time
            .step_s
            .total_cmp(&b.estimate.time.step_s)
            .then(a.estimate.memory.peak_bytes.total_cmp(&b.estimate.memory.peak_bytes))
            .then_with(|| a.estimate.layout.cmp(&b.estimate.layout))
            .then_with(|| describe_workload(&a.workload).cmp(&describe_workload(&b.workload)))
    });
}

/// Records `plan` if it is its layout's least-memory or fastest plan so far.
fn keep_single_axis_best(best: &mut Vec<(Plan, Plan)>, plan: &Plan) {
    let Some((least_memory, fastest)) =
        best.iter_mut().find(|(chosen, _)| chosen.estimate.layout == plan.estimate.layout)
    else {
        best.push((plan.clone(), plan.clone()));
        return;
    };
    let memory_then_time = |plan: &Plan| (plan.estimate.memory.peak_bytes, plan.estimate.time.step_s);
    let time_then_memory = |plan: &Plan| (plan.estimate.time.step_s, plan.estimate.memory.peak_bytes);
    if memory_then_time(plan) < memory_then_time(least_memory) {
        *least_memory = plan.clone();
    }
    if time_then_memory(plan) < time_then_memory(fastest) {
        *fastest = plan.clone();
    }
}

/// `b=1 x m=8, zero 1, recompute full`.
pub fn describe_workload(workload: &Workload) -> String {
    format!(
        "b={} x m={}, zero {}, recompute {}",
        workload.micro_batch,
        workload.micro_batches,
        workload.zero,
        workload.recompute.as_str()
    )
}

/// Why `winner` beats `runner_up`: the term of the step time whose difference is the largest, or
/// memory when the step times tie.
pub fn why_first(winner: &Plan, runner_up: &Plan) -> String {
    let (a, b) = (&winner.estimate.time, &runner_up.estimate.time);
    if b.step_s - a.step_s <= 1e-9 * b.step_s {
        return format!(
            "{} ({}) ties {} ({}) at {:.4} s a step and needs less memory: {:.1} vs {:.1} GB a GPU",
            winner.estimate.layout,
            describe_workload(&winner.workload),
            runner_up.estimate.layout,
            describe_workload(&runner_up.workload),
            a.step_s,
            winner.estimate.memory.peak_bytes / 1e9,
            runner_up.estimate.memory.peak_bytes / 1e9,
        );
    }
    let terms = [
        ("compute", a.compute_s, b.compute_s),
        ("communication", a.comm_s, b.comm_s),
        ("pipeline bubble", a.bubble_s, b.bubble_s),
    ];
    let (term, ours, theirs) =
        terms.into_iter().max_by(|x, y| (x.2 - x.1).abs().total_cmp(&(y.2 - y.1).abs())).expect("three terms");
    format!(
        "{} ({}) beats {} ({}) by {:.3} s a step ({:.1}%); the largest difference is {term}: {:.3} vs {:.3} s; \
         memory {:.1} vs {:.1} GB a GPU",
        winner.estimate.layout,
        describe_workload(&winner.workload),
        runner_up.estimate.layout,
        describe_workload(&runner_up.workload),
        b.step_s - a.step_s,
        100.0 * (b.step_s - a.step_s) / b.step_s,
        ours,
        theirs,
        winner.estimate.memory.peak_bytes / 1e9,
        runner_up.estimate.memory.peak_bytes / 1e9,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    #[test]
    fn factorizations_are_every_ordered_product() {
        let pairs = factorizations(8, &[AxisName::Dp, AxisName::Tp]);
        let degrees: Vec<Vec<u64>> = pairs.iter().map(|axes| axes.iter().map(|&(_, d)| d).collect()).collect();
        assert_eq!(degrees, vec![vec![1, 8], vec![2, 4], vec![4, 2], vec![8, 1]]);
        // 12 = 2^2 * 3 over three axes: C(4,2) ways for the 2s times 3 for the 3.
        assert_eq!(factorizations(12, &[AxisName::Dp, AxisName::Cp, AxisName::Tp]).len(), 18);
        assert!(factorizations(5, &[]).is_empty());
    }

    #[test]
    fn layouts_keep_weight_splits_in_a_node_and_apart() {
        let space = SearchSpace::new(16, 1024, 16, Mode::Train, 1e12);
        for layout in layouts(&space, 4) {
            let (tp, tsp) = (layout.degree(AxisName::Tp), layout.degree(AxisName::Tsp));
            assert!(tp * tsp <= 4 && (tp == 1 || tsp == 1), "{}", layout.label());
            assert!(tsp == 1 || layout.degree(AxisName::Cp) == 1, "{}", layout.label());
            let order: Vec<usize> = layout
                .axes()
                .iter()
                .map(|(axis, _)| PLACEMENT.iter().position(|placed| placed == axis).expect("placed"))
                .collect();
            assert!(order.windows(2).all(|pair| pair[0] < pair[1]), "{}", layout.label());
        }
    }

    /// The pruning only skips plans that are over the cap: the same search costing every plan finds
    /// the same number that fit and the same best plan.
    #[test]
    fn pruning_loses_no_plan() {
        let model = ModelShape::from_config(&preset("llama3-8b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let mut space = SearchSpace::new(32, 8192, 32, Mode::Train, 40e9);
        space.axes = MODELLED_AXES.to_vec();
        let outcome = search(&model, &hw, &space).unwrap();
        assert!(outcome.pruned > 0, "the case must exercise the pruning");
        let mut feasible = 0;
        let mut best = f64::INFINITY;
        for layout in layouts(&space, hw.gpus_per_node) {
            if space.global_batch % layout.batch_split() != 0 {
                continue;
            }
            for workload in workloads(&space, &layout).into_iter().flatten() {
                if let Ok(estimate) = estimate(&model, &layout, &workload, &hw) {
                    if estimate.memory.peak_bytes <= space.mem_cap_bytes {
                        feasible += 1;
                        best = best.min(estimate.time.step_s);
                    }
                }
            }
        }
        assert_eq!(outcome.feasible, feasible);
        assert_eq!(outcome.plans[0].estimate.time.step_s, best);
    }

    #[test]
    fn only_a_mixture_searches_ep_at_degrees_that_divide_its_experts() {
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let mut space = SearchSpace::new(16, 64, 16, Mode::Train, 1e12);
        space.keep = usize::MAX / 16;
        let ep_degrees = |name: &str| -> Vec<u64> {
            let outcome = search(&ModelShape::from_config(&preset(name).unwrap()), &hw, &space).unwrap();
            let mut degrees: Vec<u64> = outcome.plans.iter().map(|plan| plan.layout.degree(AxisName::Ep)).collect();
            degrees.sort_unstable();
            degrees.dedup();
            degrees
        };
        // tiny-moe has 8 experts: ep=16 is not in the space; ep=8 x dp=2 and ep=2 x tp=8 are.
        assert_eq!(ep_degrees("tiny-moe"), vec![1, 2, 4, 8]);
        assert_eq!(ep_degrees("tiny"), vec![1]);
        // ep splits the batch: ep=8 x dp=2 sees one sequence a rank of the 16.
        let outcome = search(&ModelShape::from_config(&preset("tiny-moe").unwrap()), &hw, &space).unwrap();
        let plan = outcome.plans.iter().find(|plan| plan.mesh() == "dp=2,ep=8").expect("a dp=2 x ep=8 plan");
        assert_eq!(plan.workload.micro_batch * plan.workload.micro_batches, 1);
        assert_eq!(plan.estimate.tokens_per_step, 16.0 * 64.0);
    }

    #[test]
    fn nothing_fits_says_what_was_tried() {
        let model = ModelShape::from_config(&preset("llama3-70b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let space = SearchSpace::new(8, 8192, 8, Mode::Train, 1e9);
        let message = search(&model, &hw, &space).unwrap_err().to_string();
        assert!(message.starts_with("no plan of 8 GPUs fits in 1.0 GB a GPU: "), "{message}");
        assert!(message.contains(" over the cap, ") && message.ends_with(" indivisible layouts"), "{message}");
        // Where no layout divides (tiny's 2 layers, 8 heads and 16 tokens, one sequence, over 1024
        // GPUs), memory is not what stops the search.
        let tiny = ModelShape::from_config(&preset("tiny").unwrap());
        let indivisible = SearchSpace::new(1024, 16, 1, Mode::Train, 1e12);
        let message = search(&tiny, &hw, &indivisible).unwrap_err().to_string();
        assert!(message.starts_with("no layout of 1024 GPUs divides the model and the batch"), "{message}");
        let zero = SearchSpace::new(0, 8192, 8, Mode::Train, 1e9);
        assert_eq!(search(&model, &hw, &zero).unwrap_err().to_string(), "--gpus 0: give at least 1");
    }
}
