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
//! Guarantees: every rule is typed before it fires (the e-graph never merges differently laid-out
//! values), the written-back graph passes the verifier, and every rule is checked numerically by
//! the multi-rank simulator (`simulate`).

pub mod analysis;
pub mod cost;
pub mod language;
mod proof;
pub mod rules;
pub mod simulate;
pub mod template;

use std::collections::BTreeMap;
use std::time::Duration;

use egg::{Extractor, Id, Language, Runner};
use pleat_ir::Module;

use self::analysis::{LayerAnalysis, LayerGraph};
use self::cost::{CostModel, LayerCostFunction};
use self::language::LayerLang;
pub use self::proof::proof;
use self::rules::{LayerRewrite, RuleTable};
use self::template::{layer_template, LayerTemplate};
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
}

/// A saturated layer e-graph.
struct Saturated {
    runner: Runner<LayerLang, LayerAnalysis>,
    class_of: Vec<Id>,
    report: RewriteReport,
}

/// The rule tables `ctx` enables.
pub fn enabled_tables(ctx: &PassCtx) -> Vec<RuleTable> {
    let mut tables = vec![RuleTable::Collectives, RuleTable::Linear];
    if ctx.sequence_parallel {
        tables.push(RuleTable::SequenceParallel);
    }
    tables
}

fn saturate(template: &LayerTemplate, module: &Module, ctx: &PassCtx, options: &RewriteOptions) -> Result<Saturated> {
    let tables = enabled_tables(ctx);
    let mut rules: Vec<LayerRewrite> = Vec::new();
    for table in &tables {
        rules.extend(table.rules()?);
    }
    let analysis = LayerAnalysis::new(module.mesh.clone(), template.leaves.clone());
    let mut egraph = LayerGraph::new(analysis);
    if options.explain {
        egraph = egraph.with_explanations_enabled();
    }
    let mut class_of: Vec<Id> = Vec::with_capacity(template.expr.len());
    for node in template.expr.as_ref() {
        let node = node.clone().map_children(|child| class_of[usize::from(child)]);
        class_of.push(egraph.add(node));
    }
    egraph.rebuild();
    let mut runner = Runner::new(LayerAnalysis::new(module.mesh.clone(), template.leaves.clone()))
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
    };
    Ok(Saturated { runner, class_of, report })
}

/// Runs the pass with `options` and reports what it did.
pub fn rewrite_collectives(module: &mut Module, ctx: &PassCtx, options: &RewriteOptions) -> Result<RewriteReport> {
    let Some(template) = layer_template(module)? else {
        return Ok(RewriteReport {
            tables: enabled_tables(ctx).iter().map(|table| table.name()).collect(),
            stop: StopReason::Other("the module has no layer0 nodes".into()),
            iterations: 0,
            enodes: 0,
            eclasses: 0,
            rules_fired: BTreeMap::new(),
            seconds_before: 0.0,
            seconds_after: 0.0,
            layers_rewritten: 0,
        });
    };
    let Saturated { runner, class_of, mut report } = saturate(&template, module, ctx, options)?;
    let egraph = &runner.egraph;
    let model = CostModel { hardware: options.hardware.clone() };
    let extractor = Extractor::new(egraph, LayerCostFunction::new(egraph, &model));
    let cost_fn = LayerCostFunction::new(egraph, &model);
    report.seconds_before =
        template.roots.iter().map(|(_, id)| original_seconds(&template, &class_of, &cost_fn, *id)).sum();
    report.seconds_after =
        template.roots.iter().map(|(_, id)| extractor.find_best_cost(class_of[usize::from(*id)]).seconds).sum();
    let roots: Vec<Id> = template.roots.iter().map(|(_, id)| class_of[usize::from(*id)]).collect();
    if !changed(&template, egraph, &class_of, &roots, &|class| extractor.find_best_node(class).clone()) {
        return Ok(report);
    }
    template.write_back(module, egraph, &class_of, &|class| extractor.find_best_node(class).clone())?;
    report.layers_rewritten = template.layers.len();
    Ok(report)
}

/// Predicted seconds of template node `id` as propagated, counted as a tree like egg's extraction.
fn original_seconds(template: &LayerTemplate, class_of: &[Id], cost_fn: &LayerCostFunction<'_>, id: Id) -> f64 {
    let node = &template.expr[id];
    let own = cost_fn.node_seconds(&node.clone().map_children(|child| class_of[usize::from(child)]));
    let children: f64 = node.children().iter().map(|&child| original_seconds(template, class_of, cost_fn, child)).sum();
    own.unwrap_or(f64::INFINITY) + children
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
