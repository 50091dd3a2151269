//! `pleat bench`: measurements of this machine, for people and for the cost model.
//!
//! Alone, `pleat bench` measures one rank's kernels and the threads communicator's link and prints
//! the figures; `pleat bench --calibrate` writes them as a hardware spec (DESIGN.md §7's form of
//! `calibrate` below). Its subcommands:
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

/// Arguments of `pleat bench`: a subcommand, or none for this machine's figures.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: Option<BenchCommand>,
    /// Write the figures as a hardware spec for --hw-file (as `pleat bench calibrate`).
    #[arg(long)]
    pub calibrate: bool,
    /// With --calibrate: where to write the spec (JSON); without it, it is printed.
    #[arg(long, requires = "calibrate")]
    pub out: Option<std::path::PathBuf>,
    /// Small sizes: seconds less, figures that only bound the full ones from below.
    #[arg(long)]
    pub quick: bool,
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
        Some(BenchCommand::Comm(args)) => comm::comm(args),
        Some(BenchCommand::Calibrate(args)) => calibrate::run_calibrate(args),
        Some(BenchCommand::Overlap(args)) => overlap::run_overlap(args),
        Some(BenchCommand::Buckets(args)) => buckets::run_buckets(args),
        None if args.calibrate => {
            calibrate::run_calibrate(&calibrate::CalibrateArgs { out: args.out.clone(), quick: args.quick })
        }
        None => calibrate::print_figures(args.quick),
    }
}
