//! Collectives that cancel, fuse or turn into a cheaper one.
//!
//! - `ag-then-slice-cancels`: gathering a dim and keeping one's own block of it is the identity.
//!   (The gather-then-reduce-scatter pair of the brief cannot occur in a forward graph: a gather's
//!   result is never a pending sum; the pair that cancels is gather then local slice.)
//! - `replicate-then-slice-is-noop`: slicing a replicated value and gathering it back is the identity.
//! - `reshard-via-all-to-all`: gathering one dim and slicing another is one all-to-all.
//! - `allreduce-of-sum-commutes`: `all_reduce(a) + all_reduce(b) = all_reduce(a + b)` (the sum is linear).

use super::{bound_symbol, rule, LayerGraph, LayerRewrite};
use crate::error::Result;
use crate::rewrite::analysis::Meta;

/// The table's rules.
pub fn rules() -> Result<Vec<LayerRewrite>> {
    Ok(vec![
        rule("ag-then-slice-cancels", "(local_slice ?a ?d (all_gather ?a ?d ?x))", "?x", None)?,
        rule("replicate-then-slice-is-noop", "(all_gather ?a ?d (local_slice ?a ?d ?x))", "?x", None)?,
        rule(
            "reshard-via-all-to-all",
            "(local_slice ?a ?split (all_gather ?a ?gather ?x))",
            "(all_to_all ?a ?split ?gather ?x)",
            Some(different_dims),
        )?,
        rule(
            "allreduce-of-sum-commutes",
            "(add (all_reduce ?a ?x) (all_reduce ?a ?y))",
            "(all_reduce ?a (add ?x ?y))",
            None,
        )?,
    ])
}

/// `?split` and `?gather` are different dims (one dim is `ag-then-slice-cancels`).
pub fn different_dims(egraph: &LayerGraph, subst: &egg::Subst) -> bool {
    match (bound_symbol(egraph, subst, "?split"), bound_symbol(egraph, subst, "?gather")) {
        (Some(Meta::Dim(split)), Some(Meta::Dim(gather))) => split != gather,
        _ => false,
    }
}
