//! Linear layers under tensor parallelism, as equations between gathered and sharded products.
//!
//! - `row-linear-partial-sum`: a product whose contracted dim is gathered on both sides equals the
//!   all-reduce of the local products (Megatron's row-parallel linear: each rank's slice of the
//!   contraction is a summand).
//! - `column-linear-shard-out`: a product with a weight gathered on an output dim equals the product
//!   with the local weight, gathered on that dim (the column-parallel linear: no communication
//!   before the product, the output stays split).

use super::{rule, LayerRewrite};
use crate::error::Result;

/// The table's rules.
pub fn rules() -> Result<Vec<LayerRewrite>> {
    Ok(vec![
        rule(
            "row-linear-partial-sum",
            "(matmul ?c (all_gather ?a ?d ?x) (all_gather ?a ?d ?w))",
            "(all_reduce ?a (matmul ?c ?x ?w))",
            None,
        )?,
        rule(
            "column-linear-shard-out",
            "(matmul ?c ?x (all_gather ?a ?d ?w))",
            "(all_gather ?a ?d (matmul ?c ?x ?w))",
            None,
        )?,
    ])
}
