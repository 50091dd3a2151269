//! The errors of `pleat-ir`.

/// `Result` with this crate's `Error`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in `pleat-ir`.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum Error {
    // === Mesh ===
    /// A mesh string part that is not `name=size`.
    #[error("mesh `{text}`: cannot read `{part}`; write axes as name=size separated by commas, e.g. dp=2,tp=4")]
    #[diagnostic(code(E0201), help("write the mesh as name=size pairs separated by commas, e.g. --mesh dp=2,tp=4"))]
    MeshSyntax {
        /// The whole mesh string.
        text: String,
        /// The part that did not parse.
        part: String,
    },
    /// An axis name outside the known set.
    #[error("mesh `{text}`: unknown axis `{axis}`; axes are dp, tp, sp, cp, pp, tsp, ep")]
    #[diagnostic(code(E0202), help("use the axes dp, tp, sp, cp, pp, tsp or ep"))]
    MeshUnknownAxis {
        /// The whole mesh string.
        text: String,
        /// The unknown name.
        axis: String,
    },
    /// A mesh with more ranks than pleat addresses.
    #[error("a mesh of {ranks} ranks is more than pleat addresses ({max}); use fewer or smaller axes")]
    #[diagnostic(code(E0203), help("use fewer or smaller axes"))]
    MeshTooLarge {
        /// The ranks asked for (saturating at `u64::MAX`).
        ranks: u64,
        /// The most a mesh may have.
        max: u64,
    },
    /// The same axis twice.
    #[error("mesh axis {axis} appears twice")]
    #[diagnostic(code(E0204), help("name each axis once, e.g. --mesh dp=2,tp=4"))]
    MeshAxisRepeated {
        /// The axis.
        axis: String,
    },
    /// A zero-sized axis.
    #[error("mesh axis {axis} has size 0; sizes are at least 1")]
    #[diagnostic(code(E0205), help("give every axis a size of at least 1"))]
    MeshAxisZero {
        /// The axis.
        axis: String,
    },

    // === Sharding ===
    /// A model dimension that a mesh axis must split evenly, and does not.
    #[error("{node}: {count} {what} are not divisible by {axis}={degree}; use {axis} in {{{}}}", join(valid))]
    #[diagnostic(code(E0206), help("pick an axis degree from the listed divisors, or change the size that does not divide (--batch, --seq, or the model's)"))]
    Indivisible {
        /// The node (or model part) whose dim it is.
        node: String,
        /// What is being split (`heads`, `kv_heads`, `ffn`, `vocab`, `seq`, `batch`).
        what: String,
        /// Its size.
        count: u64,
        /// The splitting axis.
        axis: String,
        /// The axis degree.
        degree: u64,
        /// The degrees that would work.
        valid: Vec<u64>,
    },

    // === Model ===
    /// A model setting this build does not support for the requested run.
    #[error("{model}: {what}")]
    #[diagnostic(code(E0114), help("use a model setting this build supports for the run"))]
    UnsupportedModel {
        /// The model.
        model: String,
        /// What is unsupported and what to do instead.
        what: String,
    },
}

fn join(values: &[u64]) -> String {
    values.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}
