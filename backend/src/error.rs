//! The errors of `pleat-backend`.

/// `Result` with this crate's `Error`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything lowering and program checks can fail with.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum Error {
    // === Lowering ===
    /// A value whose split dim does not divide (the verifier rejects these first).
    #[error("{value}: {dim}={size} does not divide by the {degree} ranks splitting it")]
    #[diagnostic(code(E0501), help("use a mesh whose degrees divide the value's dims"))]
    Indivisible {
        /// The value's name.
        value: String,
        /// The dim.
        dim: String,
        /// Its global size.
        size: u64,
        /// The ranks splitting it.
        degree: u64,
    },
    /// A loss whose operands are split on a dim its kernel needs whole on every rank: the sequence
    /// (position `t` reads token `t + 1`) or the vocabulary (each row's softmax).
    #[error(
        "{value}: op {op} needs {dim} whole on every rank, but this rank holds {local} of {global}; \
         keep {dim} unsplit for the loss (split batch instead)"
    )]
    #[diagnostic(code(E0502), help("keep the loss's seq and vocab unsplit (split batch instead)"))]
    SplitLossDim {
        /// The value's name.
        value: String,
        /// The op's mnemonic.
        op: &'static str,
        /// The dim that must be whole.
        dim: String,
        /// Its local size.
        local: u64,
        /// Its global size.
        global: u64,
    },

    // === Collective matching ===
    /// Members of a group reached different collectives at the same point.
    #[error("collective mismatch in group {axis}{ranks:?}: {}", .issued.join("; "))]
    #[diagnostic(code(E0503), help("recompile; if it persists, report the plan"))]
    CollectiveMismatch {
        /// The group's axis.
        axis: String,
        /// The group's ranks.
        ranks: Vec<u32>,
        /// What each member issued: `rank 1 at instruction 7: all_reduce of 4096 elements`.
        issued: Vec<String>,
    },
    /// No rank can make progress: every unfinished rank waits on a collective some member never reaches.
    #[error("the programs deadlock: {}", .waiting.join("; "))]
    #[diagnostic(code(E0504), help("recompile; if it persists, report the plan"))]
    Deadlock {
        /// What each blocked rank waits for.
        waiting: Vec<String>,
    },

    // === Format ===
    /// A serialized program of another format version.
    #[error("program format version {found} is not {expected}; recompile with this pleat")]
    #[diagnostic(code(E0505), help("recompile the directory with this pleat"))]
    FormatVersion {
        /// What the file says.
        found: u32,
        /// What this build reads.
        expected: u32,
    },
    /// A program whose instructions disagree with its buffers (a damaged or hand-edited file).
    #[error("the program is inconsistent at instruction {instr}: {reason}; recompile it")]
    #[diagnostic(code(E0506), help("recompile the directory; do not edit program files"))]
    Inconsistent {
        /// The instruction index.
        instr: usize,
        /// What disagrees.
        reason: String,
    },
    /// A pipeline plan that cannot be built: a stage split, a schedule or a graph it does not fit.
    #[error("pipeline: {reason}")]
    #[diagnostic(code(E0507), help("change --pp, --pp-layers or --schedule as the message says"))]
    Pipeline {
        /// What is wrong, and how to fix it.
        reason: String,
    },
    /// A serialized program that does not parse.
    #[error("cannot read the program: {reason}")]
    #[diagnostic(code(E0508), help("recompile the directory; the program file is damaged"))]
    Malformed {
        /// The serde error.
        reason: String,
    },
}
