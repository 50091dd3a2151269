//! The `pleat` command line: compile transformer models into per-rank programs and run them.
//!
//! This is the only layer that talks to the world: it reads files, prints, and turns library
//! errors into messages (`anyhow` lives here only).
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "the binary is the layer that prints")]

mod bench;
mod checkpoint;
mod compare;
mod compile;
mod demo;
mod explain;
mod fingerprint;
mod inputs;
mod model_arg;
mod native;
mod pipeline;
mod plan;
mod predict;
#[cfg(feature = "mpi")]
mod rank;
mod run;
mod schedule;
mod search;
mod trace;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// pleat compiles a transformer model and a device mesh into one program per rank, and runs them.
#[derive(Parser)]
#[command(name = "pleat", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile MODEL for a mesh and run every rank's program on threads.
    Run(run::RunArgs),
    /// Compile MODEL for a mesh into a directory of per-rank programs.
    Compile(compile::CompileArgs),
    /// Show every value's layout in one layer, and every collective with the reason it is there.
    Explain(explain::ExplainArgs),
    /// Memory, communication and time a rank for MODEL on a mesh, from the cost model.
    Plan(plan::PlanArgs),
    /// Every one- and two-axis layout of --ranks ranks side by side, sorted by peak memory.
    Compare(compare::CompareArgs),
    /// The best plans for a model on N GPUs under a memory cap, ranked by predicted step time.
    Search(search::SearchArgs),
    /// A pipeline schedule as a picture, with its simulated bubble and peak micro-batches in flight.
    Schedule(schedule::ScheduleArgs),
    /// Write the cost model's predicted timeline of every rank as a Chrome/Perfetto trace.
    Trace(trace::TraceArgs),
    /// Build the tiny model, compile it for tp=4, run it on 4 threads and check it against the reference.
    Demo,
    /// Run one rank of a compiled directory as an MPI process: `mpirun -np N pleat rank DIR`.
    #[cfg(feature = "mpi")]
    Rank(rank::RankArgs),
    /// Measure this machine: collective bandwidth (`comm`), a hardware spec for --hw-file (`calibrate`).
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    // A reader that stops early (`pleat run ... | head`) should end pleat quietly, as it ends other
    // Unix tools, instead of making `println!` panic on the closed pipe.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(&args),
        Command::Compile(args) => compile::compile(&args),
        Command::Explain(args) => explain::explain(&args),
        Command::Demo => demo::demo(),
        Command::Plan(args) => plan::plan(&args),
        Command::Compare(args) => compare::compare(&args),
        Command::Trace(args) => trace::trace(&args),
        Command::Schedule(args) => schedule::schedule(&args),
        Command::Bench(args) => bench::bench(&args),
        Command::Search(args) => search::run_search(&args),
        #[cfg(feature = "mpi")]
        Command::Rank(args) => rank::rank(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}
