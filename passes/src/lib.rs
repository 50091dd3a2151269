//! pleat-passes: the pass manager, the verifier and the parallelism strategies.
//!
//! Passes transform a `pleat_ir::Module` in place. The manager (`manager`) runs them by name and
//! verifies the IR after each (`verify`). Strategies (`strategy`) seed sharding specs on the
//! leaves from the mesh's axes; propagation (`propagate`) completes the specs with the per-op rules
//! of `sharding` and inserts the collectives they call for; `rewrite` then chooses between
//! equivalent collectives by cost with equality saturation (egg). This crate knows nothing of per-rank
//! programs, kernels or communicators.

pub mod autodiff;
pub mod cost;
pub mod cp;
pub mod degrees;
pub mod error;
pub mod explain;
pub mod fuse;
pub mod manager;
pub mod pipeline;
pub mod propagate;
#[cfg(test)]
mod propagate_props;
pub mod rewrite;
pub mod search;
pub mod sharding;
pub mod strategy;
pub mod tsp;
pub mod verify;
pub mod vocab_loss;
pub mod zero;

pub use error::{Error, Result};
pub use manager::{run_pipeline, Dump, Pass, PassCtx, PipelineReport};
pub use verify::{verify, VerifierError, VerifierErrors};

/// The pipeline that shards a forward graph over its module's mesh.
pub const SHARD_PIPELINE: &[Pass] =
    &[tsp::FOLD_TSP, cp::FOLD_CP, propagate::PROPAGATE_SPECS, rewrite::REWRITE_COLLECTIVES];

/// The pipeline that shards a training graph (`pleat_ir::model::build_training`) and appends its
/// backward graph: every parameter's gradient, laid out as the parameter, is an output.
pub const TRAIN_PIPELINE: &[Pass] = &[
    tsp::FOLD_TSP,
    cp::FOLD_CP,
    propagate::PROPAGATE_SPECS,
    rewrite::REWRITE_COLLECTIVES,
    vocab_loss::VOCAB_PARALLEL_LOSS,
    zero::ZERO_PARTITION,
    autodiff::DIFFERENTIATE,
];
