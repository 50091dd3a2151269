//! The rewrite rules, in topic tables, and the typing guard every rule carries.
//!
//! A rule is a named equation between two patterns of `LayerLang`, valid on global tensors and
//! on the layouts the analysis derives. Every rule is guarded by `WellTyped`: before it fires, the
//! right-hand side is typed with the same inference and sharding rules as the IR, and it fires
//! only if the result is well-typed and has the matched class's exact type and layout. So a rule
//! can never merge a class with a differently laid-out one; a rule whose meaning is wrong where
//! the types agree is caught by its numeric test (`rules::tests`). Some rules add a named side
//! condition the types cannot express (`different_dims`, `not_normalized`).
//!
//! Tables: `collectives` (always), `linear` (always), `sequence-parallel` (only when the plan asks
//! for sequence parallelism: under plain `tp` the user asked for all-reduces), and
//! `fold-tp-sp-into-tsp` (only when the plan lets the compiler move weights instead of activations
//! on the sequence-parallel axis, `--strategy tp-sp-or-tsp`).

pub mod collectives;
pub mod fold_tsp;
pub mod linear;
pub mod sequence;
#[cfg(test)]
mod tests;

use egg::{ConditionalApplier, ENodeOrVar, Id, Pattern, Rewrite, Subst, Var};

use super::analysis::{node_meta, LayerAnalysis, LayerGraph, Meta};
use super::language::LayerLang;
use crate::error::{Error, Result};

/// A rule over a layer's e-graph.
pub type LayerRewrite = Rewrite<LayerLang, LayerAnalysis>;

/// A side condition on a match's bindings.
pub type SideCondition = fn(&LayerGraph, &Subst) -> bool;

/// The rule tables, by topic.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RuleTable {
    /// Cancelling and fusing collectives: always on.
    Collectives,
    /// Linear layers' partial sums and sharded outputs: always on.
    Linear,
    /// Reduce-scatter and all-gather in place of all-reduce, norms and residuals on seq shards:
    /// only under sequence parallelism.
    SequenceParallel,
    /// Broadcast or ring the weights instead of gathering the tokens (TSP), for an axis of
    /// `degree` ranks: only when the plan allows it.
    FoldTpSpIntoTsp {
        /// The ranks of the sequence-parallel axis (the owners are unrolled).
        degree: u64,
    },
}

impl RuleTable {
    /// The kebab-case name reports use.
    pub fn name(self) -> &'static str {
        match self {
            RuleTable::Collectives => "collectives",
            RuleTable::Linear => "linear",
            RuleTable::SequenceParallel => "sequence-parallel",
            RuleTable::FoldTpSpIntoTsp { .. } => "fold-tp-sp-into-tsp",
        }
    }
    /// The table's rules.
    pub fn rules(self) -> Result<Vec<LayerRewrite>> {
        match self {
            RuleTable::Collectives => collectives::rules(),
            RuleTable::Linear => linear::rules(),
            RuleTable::SequenceParallel => sequence::rules(),
            RuleTable::FoldTpSpIntoTsp { degree } => fold_tsp::rules(degree),
        }
    }
}

/// The typing guard (and optional side condition) of one rule.
pub struct WellTyped {
    rhs: Pattern<LayerLang>,
    side: Option<SideCondition>,
}

impl egg::Condition<LayerLang, LayerAnalysis> for WellTyped {
    fn check(&self, egraph: &mut LayerGraph, eclass: Id, subst: &Subst) -> bool {
        if self.side.is_some_and(|side| !side(egraph, subst)) {
            return false;
        }
        let Some(built) = pattern_meta(&self.rhs, egraph, subst) else { return false };
        match (built.tensor(), egraph[eclass].data.tensor()) {
            (Some(built), Some(matched)) => built.ty == matched.ty && built.spec == matched.spec,
            _ => false,
        }
    }
}

/// The facts `pattern` would have once instantiated with `subst`, computed without adding it.
fn pattern_meta(pattern: &Pattern<LayerLang>, egraph: &LayerGraph, subst: &Subst) -> Option<Meta> {
    let mut metas: Vec<Meta> = Vec::with_capacity(pattern.ast.len());
    for node in pattern.ast.as_ref() {
        let meta = match node {
            ENodeOrVar::Var(var) => egraph[*subst.get(*var)?].data.clone(),
            ENodeOrVar::ENode(node) => {
                node_meta(node, |id| &metas[usize::from(id)], &egraph.analysis.leaves, &egraph.analysis.mesh)
            }
        };
        metas.push(meta);
    }
    metas.pop()
}

/// The rule `name`: `lhs => rhs`, guarded by `WellTyped` and `side`.
pub fn rule(name: &str, lhs: &str, rhs: &str, side: Option<SideCondition>) -> Result<LayerRewrite> {
    let parse = |text: &str| {
        text.parse::<Pattern<LayerLang>>()
            .map_err(|error| Error::RuleTable { rule: name.to_string(), reason: error.to_string() })
    };
    let (searcher, applier) = (parse(lhs)?, parse(rhs)?);
    let condition = WellTyped { rhs: applier.clone(), side };
    Rewrite::new(name, searcher, ConditionalApplier { condition, applier })
        .map_err(|reason| Error::RuleTable { rule: name.to_string(), reason })
}

/// The symbol bound to `var`, if it is bound to a leaf class.
pub fn bound_symbol(egraph: &LayerGraph, subst: &Subst, var: &str) -> Option<Meta> {
    let var: Var = var.parse().ok()?;
    Some(egraph[*subst.get(var)?].data.clone())
}
