//! `pleat bench`: measurements of this machine, for people and for the cost model.
//!
//! - `comm`: collective bandwidth over message sizes, threads or MPI ([`comm`]).
//! - `calibrate`: one rank's GEMM rate, streaming bandwidth and link speed, written as a hardware
//!   spec for `--hw-file` ([`calibrate`]).
//! - `overlap`: a plan's step time with its transfers blocking and scheduled for overlap, over an
//!   emulated link ([`overlap`]).
//! - `buckets`: a data-parallel training step with its gradients all-reduced alone and bucketed,
//!   over an emulated link ([`buckets`]).

pub mod buckets;
mod calibrate;
mod comm;
pub mod overlap;

use anyhow::Result;
use clap::{Args, Subcommand};

/// Arguments of `pleat bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

/// What `pleat bench` measures.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// All-reduce, all-gather and reduce-scatter time and bus bandwidth over message sizes.
    Comm(comm::CommBenchArgs),
    /// Measure one rank of this machine and write a hardware spec for --hw-file.
    Calibrate(calibrate::CalibrateArgs),
    /// Run a plan with its transfers blocking and as the overlap scheduler orders them, over an
    /// emulated link: step times side by side and the communication hidden.
    Overlap(overlap::OverlapArgs),
    /// Run a data-parallel training step with each gradient all-reduced alone and with the
    /// gradients bucketed, over an emulated link: step times and messages side by side.
    Buckets(buckets::BucketArgs),
}

/// The middle of `values` (the upper one of an even count; 0 for none): what a bench reports of
/// its repeated runs.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Runs `pleat bench`.
pub fn bench(args: &BenchArgs) -> Result<()> {
    match &args.what {
        BenchCommand::Comm(args) => comm::comm(args),
        BenchCommand::Calibrate(args) => calibrate::run_calibrate(args),
        BenchCommand::Overlap(args) => overlap::run_overlap(args),
        BenchCommand::Buckets(args) => buckets::run_buckets(args),
    }
}
