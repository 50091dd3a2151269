//! The errors of `pleat-runtime`.

use crate::comm::CommError;
use crate::kernels::KernelError;
use crate::weights::WeightError;

/// `Result` with this crate's `Error`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything running a program can fail with.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum Error {
    /// A kernel rejected its operands.
    #[error("rank {rank}, instruction {instr} ({what}): {source}")]
    #[diagnostic(code(E0601), help("check the program and inputs; recompile if the directory was edited"))]
    Kernel {
        /// The rank.
        rank: u32,
        /// The instruction index.
        instr: usize,
        /// The buffer being computed.
        what: String,
        /// The kernel's error.
        source: Box<KernelError>,
    },
    /// A collective failed (timeout, dead peer, mismatch).
    #[error("rank {rank}, instruction {instr} ({what}): {source}")]
    #[diagnostic(code(E0602), help("make every rank run the same program; raise --timeout for slow links"))]
    Comm {
        /// The rank.
        rank: u32,
        /// The instruction index.
        instr: usize,
        /// The buffer being computed.
        what: String,
        /// The communicator's error.
        source: Box<CommError>,
    },
    /// A weight could not be read: the loader's error, with its own code and help (a missing
    /// tensor, a shape that differs, a NaN).
    #[error("rank {rank}: {source}")]
    #[diagnostic(forward(source))]
    Weight {
        /// The rank.
        rank: u32,
        /// The loader's error.
        source: Box<WeightError>,
    },
    /// The program is inconsistent with the inputs or itself.
    #[error("rank {rank}, instruction {instr}: {reason}")]
    #[diagnostic(code(E0604), help("recompile the directory with this pleat"))]
    Program {
        /// The rank.
        rank: u32,
        /// The instruction index.
        instr: usize,
        /// What is wrong.
        reason: String,
    },
    /// The inputs do not fit the programs.
    #[error("{reason}")]
    #[diagnostic(code(E0605), help("give inputs of the program's batch and sequence"))]
    Inputs {
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// More ranks than the threads communicator connects in one process.
    #[error(
        "{ranks} ranks as threads of one process is more than the threads communicator connects ({max}): \
         each rank keeps a mailbox for every other"
    )]
    #[diagnostic(
        code(E0623),
        help("use a mesh of fewer ranks, or run across processes with --comm mpi (a build with the mpi feature)")
    )]
    TooManyThreadRanks {
        /// The ranks asked for.
        ranks: u64,
        /// [`crate::comm::ThreadFabric::MAX_RANKS`].
        max: u32,
    },
    /// A training step diverged: its gradient norm over every rank is NaN or infinite.
    #[error("rank {rank}: optimizer step {step}: the gradient norm is {norm}; the step diverged")]
    #[diagnostic(code(E0609), help("lower --lr (a NaN or infinite gradient cannot be clipped by --max-grad-norm)"))]
    Diverged {
        /// The rank.
        rank: u32,
        /// The optimizer step (1-based).
        step: u32,
        /// The gradient norm.
        norm: f64,
    },
    /// No CUDA device could be opened (`--device cuda`).
    #[error("no CUDA device: {reason}")]
    #[diagnostic(
        code(E0607),
        help(
            "run on the CPU (drop --device cuda), or on a machine with an NVIDIA GPU, its driver and CUDA 12's cuBLAS"
        )
    )]
    NoCudaDevice {
        /// Why, naming the library or device missing.
        reason: String,
    },
    /// A CUDA driver or cuBLAS call failed while a rank ran on a device.
    #[error("rank {rank}, instruction {instr}: CUDA's {call} failed: {message}")]
    #[diagnostic(code(E0608), help("check the device with nvidia-smi; run with --device cpu to compare"))]
    Cuda {
        /// The rank.
        rank: u32,
        /// The instruction index.
        instr: usize,
        /// The driver or cuBLAS call.
        call: &'static str,
        /// CUDA's error.
        message: String,
    },
    /// A rank's thread panicked (a bug in pleat).
    #[error("rank {rank} panicked: {message}")]
    #[diagnostic(code(E0606), help("this is a pleat bug; report it with the command line"))]
    Panicked {
        /// The rank.
        rank: u32,
        /// The panic message.
        message: String,
    },
}
