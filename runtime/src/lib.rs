//! pleat-runtime: runs per-rank `Program`s.
//!
//! It holds the CPU kernels (`kernels`, on the `gemm` crate), the communicators (`comm`: the
//! `Communicator` trait and its threads implementation), weight sources (`weights`: safetensors
//! checkpoints read slice by slice, and seeded synthetic weights), the executor that runs one
//! rank's program and measures its memory, and the launcher that runs all ranks as threads. It sees
//! only the `Program` format of `pleat-backend`; it knows nothing of passes or of the reference
//! interpreter, which stays independent as the oracle.

mod arena;
pub mod calibrate;
pub mod capi;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod executor;
mod expert_dispatch;
pub mod kernels;
pub mod launch;
pub mod native;
pub mod outcome_file;
mod stream;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
pub use executor::{execute, execute_native, OutputBlock, RankOutcome, RunInputs};
pub use launch::{
    assemble, check_thread_ranks, run_on_threads, run_on_threads_native, run_on_threads_with, ThreadRunOptions,
};
pub use native::{NativeError, NativeKernels, NativeOperand, NativeOutput};
