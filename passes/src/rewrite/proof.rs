//! Proofs: egg's explanation, rule by rule, of how a value's chosen form follows from its
//! propagated form.
//!
//! The explanation is a chain of terms, each one rule application away from the previous. Whole
//! terms of a layer are long, so each step is shown as the rule's name and the subterm it
//! rewrote, before and after, printed a few levels deep (`…` below).

use egg::FlatTerm;
use pleat_ir::Module;

use super::cost::{CostModel, LayerCostFunction};
use super::extract::DagExtractor;
use super::language::LayerLang;
use super::template::layer_template;
use super::{changed, saturate, RewriteOptions, Saturated};
use crate::error::{Error, Result};
use crate::manager::PassCtx;

/// How deep a step's subterms are printed.
const DEPTH: usize = 3;

/// egg's explanation of how the value named `value_name` (a node of the first layer, e.g.
/// `layer0.attn_residual`) gets from its form in `module` to the form the pass chooses with the
/// rule tables `ctx` enables: one line a rule application, naming the rule.
pub fn proof(module: &Module, ctx: &PassCtx, value_name: &str) -> Result<String> {
    let options = RewriteOptions { explain: true, ..RewriteOptions::default() };
    let unknown = || Error::UnknownValue { name: value_name.to_string(), example: "layer0.attn_residual".to_string() };
    let template = layer_template(module)?.ok_or_else(unknown)?;
    let suffix = value_name.split_once('.').map(|(_, suffix)| suffix).ok_or_else(unknown)?;
    let &id = template.named.get(suffix).ok_or_else(unknown)?;
    let Saturated { mut runner, class_of, report, stream } = saturate(&template, module, ctx, &options)?;
    let model = CostModel { hardware: options.hardware.clone() };
    let class = class_of[usize::from(id)];
    let (best, is_changed) = {
        let egraph = &runner.egraph;
        // Under sequence parallelism the pass keeps the stream split: explain the form that reads the
        // layer input's shard.
        let cost_fn = LayerCostFunction::new(egraph, &model).without_leaf(stream.map(|stream| stream.input));
        let extractor = DagExtractor::new(egraph, &cost_fn);
        let is_changed =
            changed(&template, egraph, &class_of, &[class], &|class| extractor.find_best_node(class).clone());
        (extractor.best_expr(class), is_changed)
    };
    let start = template.sub_expr(id);
    let tables = report.tables.join(", ");
    if !is_changed {
        return Ok(format!(
            "{value_name}: no rule of the tables {tables} gives a cheaper form; it stays as propagated\n"
        ));
    }
    let mut explanation = runner.explain_equivalence(&start, &best);
    let steps = explanation.make_flat_explanation().clone();
    let mut text = format!(
        "{value_name}: {} rule applications from the propagated form to the chosen one (tables {tables})\n",
        steps.len().saturating_sub(1)
    );
    if let Some(first) = steps.first() {
        text.push_str(&format!("  from: {}\n", shallow(first, DEPTH)));
    }
    for (index, pair) in steps.windows(2).enumerate() {
        let (before, after) = (&pair[0], &pair[1]);
        let Some(path) = rewrite_path(after) else { continue };
        let (old, new) = (at_path(before, &path), at_path(after, &path));
        let rule = new
            .forward_rule
            .map(|rule| rule.to_string())
            .or_else(|| new.backward_rule.map(|rule| format!("{rule} (right to left)")));
        text.push_str(&format!(
            "  {:>2}. {}: {} => {}\n",
            index + 1,
            rule.unwrap_or_default(),
            shallow(old, DEPTH),
            shallow(new, DEPTH)
        ));
    }
    if let Some(last) = steps.last() {
        text.push_str(&format!("  to:   {}\n", shallow(last, DEPTH)));
    }
    Ok(text)
}

/// The child indices leading to the subterm a rule rewrote in this step.
fn rewrite_path(term: &FlatTerm<LayerLang>) -> Option<Vec<usize>> {
    if term.forward_rule.is_some() || term.backward_rule.is_some() {
        return Some(Vec::new());
    }
    term.children.iter().enumerate().find_map(|(index, child)| {
        let mut path = rewrite_path(child)?;
        path.insert(0, index);
        Some(path)
    })
}

fn at_path<'a>(term: &'a FlatTerm<LayerLang>, path: &[usize]) -> &'a FlatTerm<LayerLang> {
    path.iter().fold(term, |term, &index| term.children.get(index).unwrap_or(term))
}

/// A term printed `depth` levels deep, deeper subterms as `…`.
fn shallow(term: &FlatTerm<LayerLang>, depth: usize) -> String {
    if term.children.is_empty() {
        return term.node.to_string();
    }
    if depth == 0 {
        return "…".to_string();
    }
    let children: Vec<String> = term.children.iter().map(|child| shallow(child, depth - 1)).collect();
    format!("({} {})", term.node, children.join(" "))
}
