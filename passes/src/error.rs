//! The errors of `pleat-passes`.

use pleat_ir::NodeId;

use crate::verify::VerifierErrors;

/// `Result` with this crate's `Error`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything a pass can fail with.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum Error {
    // === Pass manager ===
    /// The verifier rejected the module after a pass: a bug in that pass.
    #[error("the IR is invalid after pass {pass}: {errors}")]
    #[diagnostic(code(E0401), help("this is a pleat bug in the named pass; report it with the command line"))]
    Verify {
        /// The pass that ran last.
        pass: &'static str,
        /// What the verifier found.
        errors: VerifierErrors,
    },
    /// `--dump-after` named a pass the pipeline does not have.
    #[error("--dump-after {pass}: the pipeline has no such pass; passes are {}", .known.join(", "))]
    #[diagnostic(code(E0402), help("name one of the listed passes in --dump-after"))]
    UnknownPass {
        /// The requested name.
        pass: String,
        /// The pipeline's pass names.
        known: Vec<&'static str>,
    },

    // === Strategy ===
    /// A model dimension that the mesh cannot split.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Ir(#[from] pleat_ir::Error),
    /// The backward graph could not be built.
    #[error("differentiate: {0}")]
    #[diagnostic(transparent)]
    Autodiff(#[from] crate::autodiff::AutodiffError),
    /// A mesh axis this build has no strategy for.
    #[error("mesh axis {axis} has no strategy in this build; use the axes {}", .available.join(", "))]
    #[diagnostic(
        code(E0207),
        help("use those axes, and pp with --train; sp is known to the cost model alone (pleat plan)")
    )]
    UnsupportedAxis {
        /// The axis.
        axis: String,
        /// The axes that work.
        available: Vec<&'static str>,
    },
    /// A pp axis on an inference (forward-only) graph: pleat pipelines training steps.
    #[error(
        "mesh axis pp pipelines training steps, and this is a forward pass; add --train, or drop pp from the mesh"
    )]
    #[diagnostic(
        code(E0215),
        help("pipeline a training step with --train, or run the forward pass on the other axes")
    )]
    PipelineInference,
    /// Expert parallelism on a model without routed experts.
    #[error("mesh axis ep places routed experts, and model {model} has none; use a mixture-of-experts model (tiny-moe, mixtral-8x7b) or drop ep")]
    #[diagnostic(code(E0214), help("drop ep from the mesh, or compile a mixture-of-experts model"))]
    NoExperts {
        /// The module's name.
        model: String,
    },
    /// A sequence the zigzag layout cannot cut into `2·degree` chunks.
    #[error(
        "seq={seq} does not split into 2x{axis}={} zigzag chunks; use a --seq that is a multiple of {}{}{}",
        2 * degree, 2 * degree, next_multiple(*seq, 2 * degree), zigzag_degrees(valid, axis)
    )]
    #[diagnostic(code(E0208), help("make --seq a multiple of 2 x the degree of the axis that splits it (cp or tsp)"))]
    ZigzagSeq {
        /// The sequence length.
        seq: u64,
        /// The axis.
        axis: String,
        /// Its degree.
        degree: u64,
        /// The degrees of the axis that split it, and pass every other check on the axis.
        valid: Vec<u64>,
    },
    /// Two mesh axes whose strategies cannot share one mesh.
    #[error("mesh axes {first} and {second} cannot be combined: {reason}; use one of them")]
    #[diagnostic(code(E0209), help("use one of the two axes"))]
    ConflictingAxes {
        /// The first axis.
        first: String,
        /// The second axis.
        second: String,
        /// Why they clash.
        reason: String,
    },
    /// The graph lacks a node a structural pass rewrites.
    #[error("{pass}: the graph has no node `{node}`; this pass rewrites graphs of pleat's model builder")]
    #[diagnostic(code(E0403), help("compile graphs built by pleat's model builder"))]
    UnexpectedGraph {
        /// The pass.
        pass: &'static str,
        /// The node name it looked for.
        node: String,
    },
    /// Propagation met two layouts it cannot reconcile.
    #[error("{node} {name}: no collective makes its operands fit: {reason}")]
    #[diagnostic(code(E0404), help("change the mesh or strategy so the node's operands agree, or report the node"))]
    NoLayout {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// Why.
        reason: String,
    },

    // === Rewrite (egg) ===
    /// A rule's pattern does not parse: a bug in a rule table.
    #[error("rewrite rule {rule} is malformed: {reason}; fix its pattern in passes/src/rewrite/rules")]
    #[diagnostic(code(E0405), help("this is a pleat bug in a rewrite rule table; report it"))]
    RuleTable {
        /// The rule's name.
        rule: String,
        /// egg's complaint.
        reason: String,
    },
    /// Two e-classes that disagree on type or layout were merged: an unsound rule.
    #[error("rewrite merged a value laid out as {left} with one laid out as {right}; a rule's typing is unsound")]
    #[diagnostic(code(E0406), help("this is a pleat bug in a rewrite rule; report it"))]
    RewriteConflict {
        /// One side's type and layout.
        left: String,
        /// The other side's.
        right: String,
    },
    /// `--proof` named no value of the first layer.
    #[error("no value `{name}` in the first layer; name a node of layer0, e.g. {example}")]
    #[diagnostic(code(E0407), help("name a value of layer0, as `pleat explain` lists them"))]
    UnknownValue {
        /// The name asked for.
        name: String,
        /// A name that exists.
        example: String,
    },
}

/// " (e.g. N)": the next multiple of `chunks` above `seq`, where one fits in a `u64`.
fn next_multiple(seq: u64, chunks: u64) -> String {
    (seq / chunks)
        .checked_add(1)
        .and_then(|count| count.checked_mul(chunks))
        .map_or(String::new(), |next| format!(" (e.g. {next})"))
}

/// ", or AXIS in {..}": the degrees offered, when there are any.
fn zigzag_degrees(valid: &[u64], axis: &str) -> String {
    if valid.is_empty() {
        String::new()
    } else {
        let degrees: Vec<String> = valid.iter().map(u64::to_string).collect();
        format!(", or {axis} in {{{}}}", degrees.join(","))
    }
}

/// The degrees whose `2·degree` zigzag chunks split `seq`.
pub(crate) fn zigzag_valid_degrees(seq: u64) -> Vec<u64> {
    if seq % 2 == 0 {
        pleat_ir::spec::valid_degrees(seq / 2)
    } else {
        Vec::new()
    }
}
