//! Sequence parallelism (Korthikanti et al.): all-reduces become a reduce-scatter onto `seq`
//! and an all-gather, and the ops between them (residual adds, norms) run on `seq` shards.
//!
//! - `all-reduce-is-rs-then-ag`: `all_reduce = all_gather(seq) ∘ reduce_scatter(seq)`.
//! - `partial-then-reduce-scatter`: summing then keeping one's block is a reduce-scatter.
//! - `gather-commutes-with-norm`: `rms_norm(all_gather(x)) = all_gather(rms_norm(x))` when the
//!   gathered dim is not the normalized one (`not_normalized`).
//! - `gather-commutes-with-add`: `all_gather(a) + all_gather(b) = all_gather(a + b)`.
//! - `slice-residual-to-meet-gather` (both operand orders): `r + all_gather(y) =
//!   all_gather(local_slice(r) + y)` for a replicated residual `r`.

use super::{bound_symbol, rule, LayerGraph, LayerRewrite};
use crate::error::Result;
use crate::rewrite::analysis::Meta;
use pleat_ir::DimName;

/// The table's rules.
pub fn rules() -> Result<Vec<LayerRewrite>> {
    Ok(vec![
        rule("all-reduce-is-rs-then-ag", "(all_reduce ?a ?x)", "(all_gather ?a seq (reduce_scatter ?a seq ?x))", None)?,
        rule(
            "partial-then-reduce-scatter",
            "(local_slice ?a ?d (all_reduce ?a ?x))",
            "(reduce_scatter ?a ?d ?x)",
            None,
        )?,
        rule(
            "gather-commutes-with-norm",
            "(rms_norm ?e (all_gather ?a ?d ?x) ?w)",
            "(all_gather ?a ?d (rms_norm ?e ?x ?w))",
            Some(not_normalized),
        )?,
        rule(
            "gather-commutes-with-add",
            "(add (all_gather ?a ?d ?x) (all_gather ?a ?d ?y))",
            "(all_gather ?a ?d (add ?x ?y))",
            None,
        )?,
        rule(
            "slice-residual-to-meet-gather",
            "(add ?r (all_gather ?a ?d ?y))",
            "(all_gather ?a ?d (add (local_slice ?a ?d ?r) ?y))",
            None,
        )?,
        rule(
            "slice-residual-to-meet-gather-rev",
            "(add (all_gather ?a ?d ?y) ?r)",
            "(all_gather ?a ?d (add ?y (local_slice ?a ?d ?r)))",
            None,
        )?,
    ])
}

/// The gathered dim `?d` is not `hidden`, the dim `rms_norm` reduces over.
pub fn not_normalized(egraph: &LayerGraph, subst: &egg::Subst) -> bool {
    matches!(bound_symbol(egraph, subst, "?d"), Some(Meta::Dim(dim)) if dim != DimName::Hidden)
}
