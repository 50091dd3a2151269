//! The cost model: memory, communication and time a rank, from closed formulas.
//!
//! Everything here is arithmetic over a model's sizes ([`ModelShape`]), a parallel layout
//! ([`Layout`]: the degree of each mesh axis), a workload ([`Workload`]: sequence, micro-batch,
//! training or inference, recompute, ZeRO) and a device ([`HardwareSpec`]). Nothing builds a graph,
//! so a plan for a 405B model on 16,384 GPUs takes microseconds, and layouts the compiler cannot
//! compile yet are modelled too: [`Layout::compiles_today`] says which.
//!
//! - [`hw`]: the hardware table and its TOML/JSON override.
//! - [`model`]: the model's sizes and its parameter counts by part (a mixture of experts' routed
//!   experts, router and shared expert; total and active counts).
//! - [`layout`]: the degrees of the mesh axes, their validation and where each axis's links run.
//! - [`activation`]: activation bytes a layer, term by term (Korthikanti et al. 2022).
//! - [`memory`]: parameters, gradients, optimizer state, activations, transients, logits a rank.
//! - [`compiled`]: the peak of a compiled forward program, term by term, and how it differs from
//!   [`memory`]'s (checked against the backend's liveness planner).
//! - [`compiled_training`]: the same for a training step's program (dp, tp, cp, dp × tp, ZeRO,
//!   recompute), with every term by which it differs from [`memory`]'s training peak named;
//!   [`compiled_pipeline`] for a pipelined stage's; `step_sizes` the rank's buffer sizes both
//!   read; [`zero_rows`] which of a rank's parameters ZeRO splits, and over how many replicas.
//! - [`megatron`]: Megatron-LM's `theoretical_memory_usage.py` and Korthikanti's Table 2, verbatim,
//!   as the published reference the general model is checked against.
//! - [`comm`]: alpha-beta costs of collectives (ring, tree, hierarchical).
//! - [`volume`]: the collectives each strategy issues a layer and a step.
//! - [`compute`]: roofline time of a layer, model FLOPs, MFU.
//! - [`mod@estimate`]: all of it together for one plan (`pleat plan`, `pleat compare`).
//!
//! A mixture of experts is costed as pleat runs it: `ep` holds `E/ep` experts of every layer and
//! splits the batch as dp does; tokens reach their experts by all-to-alls with variable counts
//! (costed for balanced routing, with the worst case reported beside it); expert tensor
//! parallelism splits each expert's channels over tp; tsp keeps experts whole.
//!
//! Guarantees: every function is deterministic and total over validated inputs; bad inputs (an
//! axis that does not divide the heads, a zero sequence) are [`CostError`]s, never panics.

pub mod activation;
pub mod comm;
pub mod compiled;
pub mod compiled_pipeline;
pub mod compiled_training;
pub mod compute;
pub mod estimate;
pub mod hw;
pub mod layout;
pub mod megatron;
pub mod memory;
pub mod model;
mod step_sizes;
pub mod volume;
mod workload;
pub mod zero_rows;

/// The sum of `values`, 0 when there are none. `Iterator::sum` of f64 starts from -0.0 (the IEEE
/// identity of addition), so an empty sum, a layout without forward collectives, reached `pleat plan`
/// and `pleat compare` as "-0".
pub(crate) fn total(values: impl IntoIterator<Item = f64>) -> f64 {
    values.into_iter().fold(0.0, |sum, value| sum + value)
}

pub use estimate::{estimate, Estimate};
pub use hw::HardwareSpec;
pub use layout::{compiled_axes, Layout};
pub use model::ModelShape;
pub use workload::{Mode, Recompute, Workload};

/// Everything the cost model can reject.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum CostError {
    // === Layout ===
    /// A model dimension an axis must split evenly, and does not.
    #[error("{count} {what} are not divisible by {axis}={degree}; use {axis} in {{{}}}", join(valid))]
    #[diagnostic(code(E0210), help("pick an axis degree from the listed divisors"))]
    Indivisible {
        /// What is split (`heads`, `ffn channels`, `tokens (seq)`, ...).
        what: String,
        /// Its size.
        count: u64,
        /// The splitting axis.
        axis: String,
        /// The axis degree.
        degree: u64,
        /// The degrees that would divide it.
        valid: Vec<u64>,
    },
    /// An axis the model cannot use.
    #[error("mesh axis {axis}={degree}: {reason}")]
    #[diagnostic(code(E0211), help("drop the axis or use the alternative the message names"))]
    UnusableAxis {
        /// The axis.
        axis: String,
        /// Its degree.
        degree: u64,
        /// Why, and what to do instead.
        reason: String,
    },
    /// More pipeline stages than layers.
    #[error("pp={stages} is more than the model's {layers} layers; use pp <= {layers}")]
    #[diagnostic(code(E0212), help("use a pp degree of at most the model's layers"))]
    TooManyStages {
        /// The pipeline degree.
        stages: u64,
        /// The model's layers.
        layers: u64,
    },

    // === Workload ===
    /// A workload size that must be at least 1.
    #[error("{what} = 0; it must be at least 1")]
    #[diagnostic(code(E0242), help("give the workload setting a value of at least 1"))]
    Zero {
        /// The setting.
        what: &'static str,
    },
    /// A ZeRO stage outside 0..=3.
    #[error("zero stage {stage} does not exist; use 0, 1, 2 or 3")]
    #[diagnostic(code(E0243), help("use --zero 0, 1, 2 or 3"))]
    ZeroStage {
        /// The stage given.
        stage: u8,
    },

    // === Hardware ===
    /// No built-in hardware has that name.
    #[error("unknown hardware `{name}`; use one of {} or --hw-file", .known.join(", "))]
    #[diagnostic(code(E0244), help("use a built-in hardware name or --hw-file"))]
    UnknownHardware {
        /// The name asked for.
        name: String,
        /// The built-in names.
        known: Vec<&'static str>,
    },
    /// A hardware file that does not parse.
    #[error("{file}: {reason}; write the fields of `pleat plan --help`'s hardware spec")]
    #[diagnostic(code(E0245), help("fix the hardware file's fields (see `pleat bench calibrate`)"))]
    HardwareFile {
        /// The file name given by the caller.
        file: String,
        /// The parser's message.
        reason: String,
    },
    /// A step of more tokens than the cost model counts exactly.
    #[error("{seq} tokens a sequence x {micro_batch} a micro-batch x {micro_batches} micro-batches x {replicas} replicas is more than the 2^53 tokens a step the cost model counts exactly")]
    #[diagnostic(code(E0247), help("use a shorter --seq, a smaller --batch or fewer micro-batches or replicas"))]
    TooManyTokens {
        /// Tokens a sequence.
        seq: u64,
        /// Sequences a micro-batch.
        micro_batch: u64,
        /// Micro-batches a step.
        micro_batches: u64,
        /// Replicas (dp·ep).
        replicas: u64,
    },
    /// A hardware number that makes no sense (zero bandwidth, zero memory, an efficiency above 1).
    #[error("hardware {name}: {field} = {value} must be {must}")]
    #[diagnostic(code(E0246), help("give the hardware field a value in its range"))]
    HardwareValue {
        /// The hardware's name.
        name: String,
        /// The field.
        field: &'static str,
        /// The value found.
        value: f64,
        /// The range it must lie in, in words.
        must: &'static str,
    },
}

/// `Result` with [`CostError`].
pub type Result<T> = std::result::Result<T, CostError>;

fn join(values: &[u64]) -> String {
    values.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_like_the_ir_errors() {
        let error = CostError::Indivisible {
            what: "heads".into(),
            count: 32,
            axis: "tp".into(),
            degree: 3,
            valid: pleat_ir::spec::valid_degrees(32),
        };
        assert_eq!(error.to_string(), "32 heads are not divisible by tp=3; use tp in {1,2,4,8,16,32}");
    }
}
