//! What a rank executable can fail with.

use std::path::PathBuf;

/// Everything that ends a rank executable's run.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ExeError {
    /// The command line is wrong.
    #[error("{0}")]
    #[diagnostic(code(E0548), help("`rank<i> --help` lists the arguments"))]
    Usage(String),
    /// A file could not be read or parsed.
    #[error("cannot read {path}: {reason}")]
    #[diagnostic(code(E0549), help("check that the file exists on this host and that the rank may read it"))]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The outcome's directory (`--out`) cannot be made.
    #[error("cannot write the outcome into {path}: {reason}")]
    #[diagnostic(code(E0554), help("give --out a directory the rank may create or write, or one that exists"))]
    Output {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The tokens file holds other than the plan's batch of ids.
    #[error("{path}: {reason}")]
    #[diagnostic(
        code(E0555),
        help("give --tokens the plan's batch: JSON rows, [[id, ...], ...], of its sequence length")
    )]
    Tokens {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The executable and the program or the job do not belong together.
    #[error("{0}")]
    #[diagnostic(
        code(E0550),
        help(
            "start each rank<i> as MPI rank i, in order (or let `pleat run DIR` start them); compile again if the \
              program changed"
        )
    )]
    Mismatch(String),
    /// MPI could not start.
    #[error("cannot start mpi ({0}); launch the ranks with mpirun, e.g. `pleat run DIR`")]
    #[diagnostic(code(E0551), help("install openmpi-bin and start the ranks with mpirun"))]
    Mpi(String),
    /// The program failed.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Run(#[from] pleat_runtime::Error),
    /// The last messages could not be delivered.
    #[error("delivering the last messages failed: {0}")]
    #[diagnostic(code(E0552), help("a peer ended before taking them; read its report"))]
    Flush(String),
    /// The outcome could not be written.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Outcome(#[from] pleat_runtime::outcome_file::OutcomeFileError),
}
