//! The `pleat` command line: compile transformer models into per-rank programs and run them.
//!
//! This is the only layer that talks to the world: it reads files, prints, and turns library
//! errors into messages (`anyhow` lives here only). Every error is reported with a stable code
//! (`report`, docs/errors.md): `error[E0xxx]: message` as text, or one JSON object under `--format json`.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "the binary is the layer that prints")]

mod bench;
mod checkpoint;
mod compare;
mod compile;
mod compiled_dir;
mod demo;
mod device;
mod exe;
mod explain;
mod fingerprint;
mod host_memory;
mod inputs;
mod json_output;
mod launch;
mod model_arg;
mod native;
mod number_flags;
mod pipeline;
mod plan;
mod predict;
mod progress;
#[cfg(feature = "mpi")]
mod rank;
mod reference;
mod report;
mod run;
#[cfg(feature = "mpi")]
mod run_mpi;
mod schedule;
mod scratch;
mod search;
mod text_file;
mod trace;
mod train;
mod usage;

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
    /// Compile MODEL for a mesh and run every rank's program on threads (or, in a build with the mpi
    /// feature, as MPI processes: --comm mpi).
    Run(run::RunArgs),
    /// Compile MODEL for a mesh into a directory of per-rank programs.
    Compile(compile::CompileArgs),
    /// Run a compiled directory's ranks on threads, each by calling its library's entry function
    /// (`pleat compile --emit so`); takes `run`'s flags.
    Launch(run::RunArgs),
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
    /// Write the cost model's predicted timeline of every rank as a Chrome/Perfetto trace (for a
    /// pipelined training mesh, the measured timeline of one step: the schedule as it ran).
    Trace(trace::TraceArgs),
    /// Build the tiny model, compile it for tp=4, run it on 4 threads and check it against the reference.
    Demo,
    /// Run one rank of a compiled directory as an MPI process: `mpirun -np N pleat rank DIR`.
    #[cfg(feature = "mpi")]
    Rank(rank::RankArgs),
    /// Measure this machine: alone its kernel and link figures (with --calibrate a hardware spec
    /// for --hw-file, as `calibrate`), collective bandwidth (`comm`), the communication the overlap
    /// scheduler hides (`overlap`), bucketed gradients (`buckets`).
    Bench(bench::BenchArgs),
}

impl Command {
    /// Whether the command was asked for JSON output, so that its error is JSON too.
    fn error_format(&self) -> report::ErrorFormat {
        let json = match self {
            Command::Run(args) | Command::Launch(args) => args.format == run::Format::Json,
            Command::Explain(args) => matches!(args.format, explain::ExplainFormat::Json),
            Command::Plan(args) => matches!(args.format, plan::PlanFormat::Json),
            Command::Compare(args) => matches!(args.format, compare::CompareFormat::Json),
            Command::Search(args) => matches!(args.format, search::SearchFormat::Json),
            Command::Schedule(args) => matches!(args.format, schedule::ScheduleFormat::Json),
            #[cfg(feature = "mpi")]
            Command::Rank(args) => args.format == run::Format::Json,
            Command::Bench(args) => match &args.what {
                Some(bench::BenchCommand::Comm(args)) => args.format == run::Format::Json,
                Some(bench::BenchCommand::Overlap(args)) => args.format == run::Format::Json,
                Some(bench::BenchCommand::Buckets(args)) => args.format == run::Format::Json,
                Some(bench::BenchCommand::Calibrate(_)) | None => false,
            },
            Command::Compile(_) | Command::Trace(_) | Command::Demo => false,
        };
        if json {
            report::ErrorFormat::Json
        } else {
            report::ErrorFormat::Text
        }
    }
}

/// Keeps the memory of freed buffers in this process for the next ones, as a GPU runtime's caching
/// allocator keeps its blocks.
///
/// The CPU runtime allocates each buffer as an instruction writes it and frees it at its `Free`.
/// glibc gives a freed block above its adaptive mmap threshold back to the system, and trims the
/// heap's top past its trim threshold, so the next buffer of that size faults every page in again,
/// with every rank thread of the process contending for its address space. On `examples/small` at
/// tp-sp=4 that was 677K page faults in one `pleat bench overlap` and about a tenth of each step;
/// with blocks up to 32 MiB (glibc's largest threshold) kept in the heap, 62K.
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn main() -> ExitCode {
    // A reader that stops early (`pleat run ... | head`) should end pleat quietly, as it ends other
    // Unix tools, instead of making `println!` panic on the closed pipe.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version are not errors; clap prints them and exits 0.
        Err(err) if !err.use_stderr() => err.exit(),
        Err(err) => {
            let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
            if report::asks_for_json(&args) {
                eprintln!("{}", report::clap_json(&err, &args));
            } else {
                eprint!("{}", report::clap_text(&err, &args));
            }
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    let format = cli.command.error_format();
    let result = match cli.command {
        Command::Run(args) => run::run(&args),
        Command::Compile(args) => compile::compile(&args),
        Command::Launch(args) => launch::launch(&args),
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
            report::print(&err, format);
            ExitCode::FAILURE
        }
    }
}
