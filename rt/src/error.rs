//! What a rank executable can fail with.

use std::path::PathBuf;

/// Everything that ends a rank executable's run.
#[derive(Debug, thiserror::Error)]
pub enum ExeError {
    /// The command line is wrong.
    #[error("{0}")]
    Usage(String),
    /// A file could not be read or parsed.
    #[error("cannot read {path}: {reason}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The executable and the program or the job do not belong together.
    #[error("{0}")]
    Mismatch(String),
    /// MPI could not start.
    #[error("cannot start mpi ({0}); launch the ranks with mpirun, e.g. `pleat run DIR`")]
    Mpi(String),
    /// The program failed.
    #[error(transparent)]
    Run(#[from] pleat_runtime::Error),
    /// The last messages could not be delivered.
    #[error("delivering the last messages failed: {0}")]
    Flush(String),
    /// The outcome could not be written.
    #[error(transparent)]
    Outcome(#[from] pleat_runtime::outcome_file::OutcomeFileError),
}
