//! `rewrite-collectives`: equality saturation (egg) chooses a layer's collectives by cost.
//!
//! Propagation places collectives by fixed rules. This pass takes one layer template (`layer0`;
//! layers are identical, and the whole model is never saturated), puts it in an e-graph whose
//! analysis types every class (`analysis`), grows it with the rule tables the plan enables
//! (`rules`) under explicit limits, extracts the cheapest form by an alpha-beta and roofline cost
//! (`cost`), and writes that form into every layer (`template`). Hitting a limit is an outcome in
//! the `RewriteReport`, not an error. When the cheapest form is the propagated one the module is
//! left untouched. `proof` gives egg's explanation of how a value's form was derived.
//!
//! Extraction counts a value read twice once (`extract`). Under sequence parallelism the layer
//! input also enters the e-graph as the all-gather of a seq-shard leaf, and a second extraction,
//! which may not read the whole input, finds the layer that maps shards to shards: that form is
//! written back with the residual stream split between layers (the strategy's seed), and cost
//! chooses the collectives inside it. The values the layer's inexpressible nodes read (a mixture's
//! input) are extracted and costed beside its roots.
//!
//! Guarantees: every rule is typed before it fires (the e-graph never merges differently laid-out
//! values), the written-back graph passes the verifier, and every rule is checked numerically by
//! the multi-rank simulator (`simulate`).

pub mod analysis;
pub mod cost;
pub mod extract;
pub mod language;
mod proof;
pub mod rules;
pub mod simulate;
pub mod template;

use std::collections::BTreeMap;
use std::time::Duration;

use egg::{Id, Language, Runner, Symbol};
use pleat_ir::{AxisName, DimName, Module};

use self::analysis::{LayerAnalysis, LayerGraph, Meta};
use self::cost::{CostModel, LayerCostFunction};
use self::extract::DagExtractor;
use self::language::{LayerLang, Leaf, LeafTable};
pub use self::proof::proof;
use self::rules::{LayerRewrite, RuleTable};
use self::template::{layer_template, LayerTemplate, StreamSplit};
use crate::cost::hw::HardwareSpec;
use crate::error::{Error, Result};
use crate::manager::{Pass, PassCtx};

/// Chooses collectives by cost over one layer template and writes the choice into every layer.
pub const REWRITE_COLLECTIVES: Pass = Pass { name: "rewrite-collectives", run: run_pass };

fn run_pass(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    rewrite_collectives(module, ctx, &RewriteOptions::default()).map(|_| ())
}

/// The runner's limits and the cost model's hardware.
#[derive(Clone, Debug)]
pub struct RewriteOptions {
    /// At most this many iterations.
    pub iterations: usize,
    /// Stop once the e-graph has this many e-nodes.
    pub nodes: usize,
    /// Stop after this long.
    pub time: Duration,
    /// Record explanations (slower; `proof` turns it on).
    pub explain: bool,
    /// The hardware of the cost model.
    pub hardware: HardwareSpec,
}

impl Default for RewriteOptions {
    fn default() -> Self {
        RewriteOptions {
            iterations: 30,
            nodes: 20_000,
            time: Duration::from_secs(5),
            explain: false,
            hardware: HardwareSpec::builtin("h100-sxm").expect("h100-sxm is a built-in hardware spec"),
        }
    }
}

/// Why the runner stopped.
#[derive(Clone, Debug, PartialEq)]
pub enum StopReason {
    /// No rule adds anything: every equivalent form the rules reach is in the e-graph.
    Saturated,
    /// The iteration limit: the iterations run.
    IterationLimit(usize),
    /// The e-node limit: the e-nodes when it was hit.
    NodeLimit(usize),
    /// The time limit: the seconds spent.
    TimeLimit(f64),
    /// Anything else egg reports.
    Other(String),
}

/// What the pass did.
#[derive(Clone, Debug, PartialEq)]
pub struct RewriteReport {
    /// The rule tables that were on.
    pub tables: Vec<&'static str>,
    /// Why saturation stopped.
    pub stop: StopReason,
    /// Iterations run.
    pub iterations: usize,
    /// E-nodes at the end.
    pub enodes: usize,
    /// E-classes at the end.
    pub eclasses: usize,
    /// How often each rule fired, by name.
    pub rules_fired: BTreeMap<String, usize>,
    /// Predicted seconds of one layer as propagated.
    pub seconds_before: f64,
    /// Predicted seconds of one layer in the chosen form.
    pub seconds_after: f64,
    /// Layers rewritten (0 when the propagated form was already the cheapest).
    pub layers_rewritten: usize,
    /// Whether the residual stream is left split on seq between layers (sequence parallelism).
    pub stream_split: bool,
}

/// A saturated layer e-graph.
struct Saturated {
    runner: Runner<LayerLang, LayerAnalysis>,
    class_of: Vec<Id>,
    report: RewriteReport,
    stream: Option<StreamLeaves>,
}

/// Under sequence parallelism, the layer input as a leaf and as the gather of a shard leaf.
#[derive(Clone, Copy, Debug)]
struct StreamLeaves {
    /// The layer input, whole.
    input: Symbol,
    /// Its shard on seq over tp.
    shard: Symbol,
}

/// The axis and dim sequence parallelism splits the residual stream over.
const STREAM_AXIS: AxisName = AxisName::Tp;
const STREAM_DIM: DimName = DimName::Seq;

/// Declares the shard of the layer's stream input on seq over tp, when tp does not split it yet
/// (beside cp it is split on seq over cp already: tp splits each cp rank's tokens, as Megatron does).
fn stream_shard_leaf(template: &LayerTemplate, leaves: &mut LeafTable) -> Option<(StreamLeaves, Id)> {
    let (input, id) = template.stream_input()?;
    let Some(Leaf::Tensor { ty, spec }) = leaves.get(input).cloned() else { return None };
    let dim = ty.shape.position(STREAM_DIM)?;
    if spec.uses_axis(STREAM_AXIS) || !spec.partial.is_empty() {
        return None;
    }
    let mut shard_spec = spec;
    shard_spec.dims[dim].push(STREAM_AXIS);
    let name = format!("{}.seq_shard", input.as_str().trim_start_matches('%'));
    let shard = leaves.tensor(&name, ty, shard_spec);
    Some((StreamLeaves { input, shard }, id))
}

/// The rule tables `ctx` enables on `module`'s mesh.
pub fn enabled_tables(module: &Module, ctx: &PassCtx) -> Vec<RuleTable> {
    let mut tables = vec![RuleTable::Collectives, RuleTable::Linear];
    if ctx.sequence_parallel {
        tables.push(RuleTable::SequenceParallel);
        // Autodiff has no rule for the ring MLP, so a training graph keeps the tensor-parallel form.
        if ctx.fold_into_tsp && module.graph.loss_node().is_none() {
            if let Some(axis) = module.mesh.axis(STREAM_AXIS) {
                tables.push(RuleTable::FoldTpSpIntoTsp { degree: axis.size });
            }
        }
    }
    tables
}

fn saturate(template: &LayerTemplate, module: &Module, ctx: &PassCtx, options: &RewriteOptions) -> Result<Saturated> {
    let tables = enabled_tables(module, ctx);
    let mut rules: Vec<LayerRewrite> = Vec::new();
    let mut leaves = template.leaves.clone();
    for table in &tables {
        rules.extend(table.rules()?);
        if let RuleTable::FoldTpSpIntoTsp { degree } = table {
            rules::fold_tsp::declare_roots(&mut leaves, *degree)?;
        }
    }
    // Under sequence parallelism the layer input is also the gather of its seq shard, so that egg
    // can find a form of the layer that reads and writes shards: the stream split between layers.
    let stream = if tables.contains(&RuleTable::SequenceParallel) && module.mesh.axis(STREAM_AXIS).is_some() {
        stream_shard_leaf(template, &mut leaves)
    } else {
        None
    };
    let analysis = LayerAnalysis::new(module.mesh.clone(), leaves.clone());
    let mut egraph = LayerGraph::new(analysis);
    if options.explain {
        egraph = egraph.with_explanations_enabled();
    }
    let mut class_of: Vec<Id> = Vec::with_capacity(template.expr.len());
    for node in template.expr.as_ref() {
        let node = node.clone().map_children(|child| class_of[usize::from(child)]);
        class_of.push(egraph.add(node));
    }
    if let Some((leaves, input)) = &stream {
        let axis = egraph.add(LayerLang::Symbol(Symbol::from(STREAM_AXIS.as_str())));
        let dim = egraph.add(LayerLang::Symbol(Symbol::from(STREAM_DIM.as_str())));
        let shard = egraph.add(LayerLang::Symbol(leaves.shard));
        let gathered = egraph.add(LayerLang::AllGather([axis, dim, shard]));
        egraph.union_trusted(class_of[usize::from(*input)], gathered, "stream-is-the-gather-of-its-shard");
    }
    egraph.rebuild();
    let mut runner = Runner::new(LayerAnalysis::new(module.mesh.clone(), leaves))
        .with_egraph(egraph)
        .with_iter_limit(options.iterations)
        .with_node_limit(options.nodes)
        .with_time_limit(options.time);
    if options.explain {
        runner = runner.with_explanations_enabled();
    }
    let runner = runner.run(&rules);
    if let Some(conflict) = runner.egraph.analysis.conflicts.first() {
        return Err(Error::RewriteConflict { left: conflict.left.clone(), right: conflict.right.clone() });
    }
    let stop = match &runner.stop_reason {
        Some(egg::StopReason::Saturated) => StopReason::Saturated,
        Some(egg::StopReason::IterationLimit(limit)) => StopReason::IterationLimit(*limit),
        Some(egg::StopReason::NodeLimit(limit)) => StopReason::NodeLimit(*limit),
        Some(egg::StopReason::TimeLimit(seconds)) => StopReason::TimeLimit(*seconds),
        Some(egg::StopReason::Other(reason)) => StopReason::Other(reason.clone()),
        None => StopReason::Other("the runner did not say why it stopped".into()),
    };
    let mut rules_fired: BTreeMap<String, usize> = BTreeMap::new();
    for iteration in &runner.iterations {
        for (rule, count) in &iteration.applied {
            *rules_fired.entry(rule.to_string()).or_default() += count;
        }
    }
    let report = RewriteReport {
        tables: tables.iter().map(|table| table.name()).collect(),
        stop,
        iterations: runner.iterations.len(),
        enodes: runner.egraph.total_number_of_nodes(),
        eclasses: runner.egraph.number_of_classes(),
        rules_fired,
        seconds_before: 0.0,
        seconds_after: 0.0,
        layers_rewritten: 0,
        stream_split: false,
    };
    Ok(Saturated { runner, class_of, report, stream: stream.map(|(leaves, _)| leaves) })
}

/// Runs the pass with `options` and reports what it did.
pub fn rewrite_collectives(module: &mut Module, ctx: &PassCtx, options: &RewriteOptions) -> Result<RewriteReport> {
    let Some(template) = layer_template(module)? else {
        return Ok(RewriteReport {
            tables: enabled_tables(module, ctx).iter().map(|table| table.name()).collect(),
            stop: StopReason::Other("the module has no layer0 nodes".into()),
            iterations: 0,
            enodes: 0,
            eclasses: 0,
            rules_fired: BTreeMap::new(),
            seconds_before: 0.0,
            seconds_after: 0.0,
            layers_rewritten: 0,
            stream_split: false,
        });
    };
    let Saturated { runner, class_of, mut report, stream } = saturate(&template, module, ctx, options)?;
    let egraph = &runner.egraph;
    let model = CostModel { hardware: options.hardware.clone() };
    // The whole-input form may not read the shard leaf, which exists only in the split form.
    let cost_fn = LayerCostFunction::new(egraph, &model).without_leaf(stream.map(|stream| stream.shard));
    let extractor = DagExtractor::new(egraph, &cost_fn);
    let roots: Vec<Id> = template.roots.iter().map(|(_, id)| class_of[usize::from(*id)]).collect();
    // What the layer computes: its roots, and what its inexpressible nodes read.
    let mut computed = roots.clone();
    computed.extend(opaque_operands(&template, &class_of));
    report.seconds_before = original_seconds(&template, &class_of, &cost_fn);
    report.seconds_after = extractor.seconds_of(&computed);
    // The split form: the layer reads its input's shard and writes its output's, so the stream
    // stays split between layers (sequence parallelism's norms and residuals on seq shards). The
    // plan asked for sequence parallelism, so this layout of the stream is its seed and is taken
    // whenever egg derives it; cost chooses the collectives within it.
    // The layer's output is its one root gathered from a shard; the others (values read outside
    // the layers, such as a mixture's router statistics) and what its inexpressible nodes read
    // are computed beside it.
    let gathered: Vec<(Id, Id)> =
        roots.iter().filter_map(|&root| Some((egraph.find(root), gathered_shard(egraph, root)?))).collect();
    if let (Some(stream), &[(output, output_shard)]) = (stream, gathered.as_slice()) {
        let split_fn = LayerCostFunction::new(egraph, &model).without_leaf(Some(stream.input));
        let split = DagExtractor::new(egraph, &split_fn);
        let mut needed = vec![output_shard];
        needed.extend(computed.iter().filter(|&&class| egraph.find(class) != output));
        let seconds = split.seconds_of(&needed);
        if seconds.is_finite() {
            report.seconds_after = seconds;
            let layout =
                StreamSplit { shard_leaf: stream.shard, output, output_shard, axis: STREAM_AXIS, dim: STREAM_DIM };
            let choose = |class: Id| split.find_best_node(class).clone();
            template.write_back(module, egraph, &class_of, &choose, Some(layout))?;
            report.layers_rewritten = template.layers.len();
            report.stream_split = true;
            return Ok(report);
        }
    }
    // The propagated form stays unless the chosen one is strictly cheaper (a tie keeps it).
    let cheaper = report.seconds_after < report.seconds_before;
    if !cheaper || !changed(&template, egraph, &class_of, &computed, &|class| extractor.find_best_node(class).clone()) {
        return Ok(report);
    }
    template.write_back(module, egraph, &class_of, &|class| extractor.find_best_node(class).clone(), None)?;
    report.layers_rewritten = template.layers.len();
    Ok(report)
}

/// The e-classes read by the layer's nodes the e-graph cannot express (leaves of the template
/// whose operands are rebuilt in the chosen form).
fn opaque_operands(template: &LayerTemplate, class_of: &[Id]) -> Vec<Id> {
    template.opaque_operands().map(|id| class_of[usize::from(id)]).collect()
}

/// The shard `c` of a class holding `all_gather(tp, seq, c)`, if it holds one.
fn gathered_shard(egraph: &LayerGraph, class: Id) -> Option<Id> {
    egraph[class].nodes.iter().find_map(|node| match node {
        LayerLang::AllGather([axis, dim, shard])
            if egraph[*axis].data == Meta::Axis(STREAM_AXIS) && egraph[*dim].data == Meta::Dim(STREAM_DIM) =>
        {
            Some(egraph.find(*shard))
        }
        _ => None,
    })
}

/// Predicted seconds of the layer as propagated: every template node below the roots and the
/// inexpressible nodes' operands, once.
fn original_seconds(template: &LayerTemplate, class_of: &[Id], cost_fn: &LayerCostFunction<'_>) -> f64 {
    let mut seen = std::collections::BTreeSet::new();
    let mut stack: Vec<Id> = template.roots.iter().map(|(_, id)| *id).chain(template.opaque_operands()).collect();
    let mut seconds = 0.0;
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        let node = &template.expr[id];
        let own = cost_fn.node_seconds(&node.clone().map_children(|child| class_of[usize::from(child)]));
        seconds += own.unwrap_or(f64::INFINITY);
        stack.extend(node.children().iter().copied());
    }
    seconds
}

/// Whether the chosen form differs from the template anywhere below `roots` (e-classes).
fn changed(
    template: &LayerTemplate,
    egraph: &LayerGraph,
    class_of: &[Id],
    roots: &[Id],
    choose: &dyn Fn(Id) -> LayerLang,
) -> bool {
    let mut original: BTreeMap<Id, LayerLang> = BTreeMap::new();
    for (index, node) in template.expr.as_ref().iter().enumerate() {
        let node = node.clone().map_children(|child| egraph.find(class_of[usize::from(child)]));
        original.entry(egraph.find(class_of[index])).or_insert(node);
    }
    let mut stack: Vec<Id> = roots.iter().map(|&root| egraph.find(root)).collect();
    let mut seen = std::collections::BTreeSet::new();
    while let Some(class) = stack.pop() {
        if !seen.insert(class) {
            continue;
        }
        let chosen = choose(class).map_children(|child| egraph.find(child));
        if original.get(&class) != Some(&chosen) {
            return true;
        }
        stack.extend(chosen.children().iter().copied());
    }
    false
}

#[cfg(test)]
mod rules_props;
#[cfg(test)]
mod tests;
