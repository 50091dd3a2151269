//! `pleat bench comm`: collective bandwidth on this machine, in the nccl-tests convention.
//!
//! For each message size and each of all-reduce, all-gather and reduce-scatter, every rank runs the
//! collective over all ranks a number of times and rank 0 reports the mean time, the algorithm
//! bandwidth `algbw = size / time` and the bus bandwidth `busbw = algbw · 2(n-1)/n` (all-reduce) or
//! `algbw · (n-1)/n` (all-gather, reduce-scatter), where size is the whole buffer (the all-reduce
//! buffer, the all-gather output, the reduce-scatter input) and GB are 10^9 bytes. busbw is what the
//! cost model's link bandwidth means, so its figures calibrate it. Each size is also run once on
//! known inputs and checked against a naive computation, so a broken communicator cannot report a
//! fast number. `--comm threads` runs the ranks as threads of this process; `--comm mpi` (feature
//! `mpi`) must itself be launched by `mpirun -np N`, one process a rank.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pleat_runtime::comm::{Communicator, Group, ThreadFabric};
use serde_json::json;

#[cfg(feature = "mpi")]
use crate::report::ErrorFormat;
use crate::run::{CommChoice, Format};

/// The version of the `--format json` output.
const SCHEMA: &str = "pleat.bench.comm/1";
/// A size's timed iterations move about this many bytes, within the bounds below.
const BYTES_PER_SIZE: u64 = 16 << 20;
const MIN_ITERATIONS: u32 = 3;
const MAX_ITERATIONS: u32 = 50;

/// Arguments of `pleat bench comm`.
#[derive(Args)]
pub struct CommBenchArgs {
    /// The communicator.
    #[arg(long, value_enum, default_value_t = CommChoice::Threads)]
    pub comm: CommChoice,
    /// Ranks (threads: default 4; mpi: the mpirun world size, which this must equal if given).
    #[arg(long)]
    pub ranks: Option<u32>,
    /// Message sizes: `LO..HI` doubling from LO to HI, or a comma list; units B, KiB, MiB, GiB.
    #[arg(long, default_value = "1KiB..1MiB")]
    pub sizes: String,
    /// Timed iterations a size (default: about 16 MiB of traffic, 3 to 50).
    #[arg(long)]
    pub iters: Option<u32>,
    /// Seconds a rank waits on a message before it reports the peer that did not send it.
    #[arg(long, default_value_t = 60, value_parser = crate::number_flags::count::<u64>)]
    pub timeout: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// The collectives measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl Op {
    const ALL: [Op; 3] = [Op::AllReduce, Op::AllGather, Op::ReduceScatter];

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
        }
    }

    /// busbw / algbw for `n` ranks (nccl-tests' factors).
    fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug)]
struct Measurement {
    op: Op,
    /// The whole buffer's bytes.
    bytes: u64,
    iterations: u32,
    /// Mean time of one collective on rank 0.
    seconds: f64,
    /// Bytes rank 0 sent in one collective.
    bytes_sent: u64,
}

/// Runs `pleat bench comm`.
pub fn comm(args: &CommBenchArgs) -> Result<()> {
    let sizes = parse_sizes(&args.sizes)?;
    if args.iters == Some(0) {
        bail!(crate::usage::UsageError::ZeroFlag { flag: "--iters", what: "iteration" });
    }
    let timeout = Duration::from_secs(args.timeout);
    match args.comm {
        CommChoice::Threads => {
            let n_ranks = args.ranks.unwrap_or(4);
            if n_ranks == 0 {
                bail!(crate::usage::UsageError::ZeroFlag { flag: "--ranks", what: "rank" });
            }
            pleat_runtime::check_thread_ranks(u64::from(n_ranks))?;
            // Each rank holds a message, its chunk and the copies in flight: about three messages.
            let largest = sizes.iter().copied().max().unwrap_or(0);
            let needed = largest.saturating_mul(3).saturating_mul(u64::from(n_ranks));
            crate::host_memory::ensure_available(&format!("--sizes up to {largest} B on {n_ranks} ranks"), needed)?;
            let measurements = on_threads(n_ranks, &sizes, args.iters, timeout)?;
            report(args, "threads", n_ranks, &measurements)
        }
        #[cfg(feature = "mpi")]
        CommChoice::Mpi => on_mpi(args, &sizes, timeout),
    }
}

fn on_threads(n_ranks: u32, sizes: &[u64], iters: Option<u32>, timeout: Duration) -> Result<Vec<Measurement>> {
    let comms = ThreadFabric::new(n_ranks, timeout);
    let results: Vec<Result<Vec<Measurement>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || {
                    let result = measure(&mut comm, sizes, iters);
                    if let Err(err) = &result {
                        comm.abort(&err.to_string());
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|_| bail!(crate::usage::UsageError::RankPanicked)))
            .collect()
    });
    let mut rank_zero = None;
    for (rank, result) in results.into_iter().enumerate() {
        let measurements = result.with_context(|| format!("rank {rank}"))?;
        rank_zero.get_or_insert(measurements);
    }
    rank_zero.context("no rank ran")
}

#[cfg(feature = "mpi")]
fn on_mpi(args: &CommBenchArgs, sizes: &[u64], timeout: Duration) -> Result<()> {
    let mut comm = pleat_runtime::comm::MpiComm::init(timeout)
        .context("cannot start mpi; launch pleat bench comm --comm mpi with mpirun -np N")?;
    let n_ranks = comm.world_size();
    if args.ranks == Some(0) {
        bail!(crate::usage::UsageError::ZeroFlag { flag: "--ranks", what: "rank" });
    }
    if let Some(asked) = args.ranks.filter(|&asked| asked != n_ranks) {
        bail!(crate::usage::UsageError::RanksDifferFromWorld { asked, world: n_ranks });
    }
    // This process's message, chunk and copies in flight, as each thread's above; a rank short of
    // memory ends the job (its peers would wait for it).
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let what = format!("--sizes up to {largest} B on rank {}", comm.rank());
    if let Err(error) = crate::host_memory::ensure_available(&what, largest.saturating_mul(3)) {
        let format = if args.format == Format::Json { ErrorFormat::Json } else { ErrorFormat::Text };
        crate::report::print(&error, format);
        comm.abort_job(&format!("{error:#}"), 1)
    }
    let measurements = match measure(&mut comm, sizes, args.iters) {
        Ok(measurements) => measurements,
        Err(err) => {
            let message = format!("rank {}: {err:#}", comm.rank());
            eprintln!("error: {message}");
            comm.abort_job(&message, 1)
        }
    };
    let rank = comm.rank();
    comm.flush()?;
    drop(comm);
    if rank == 0 {
        report(args, "mpi", n_ranks, &measurements)?;
    }
    Ok(())
}

/// Every rank's part: for each size and collective, one checked run, then the timed ones.
fn measure(comm: &mut dyn Communicator, sizes: &[u64], iters: Option<u32>) -> Result<Vec<Measurement>> {
    let n_ranks = comm.world_size();
    let world = Group::world(n_ranks);
    let mut measurements = Vec::new();
    for &size in sizes {
        // Whole elements, a multiple of the ranks so that every chunk is equal.
        let chunk = ((size / 4) / u64::from(n_ranks)).max(1) as usize;
        let elements = chunk * n_ranks as usize;
        let iterations = iters.unwrap_or_else(|| {
            (BYTES_PER_SIZE / (elements as u64 * 4)).clamp(u64::from(MIN_ITERATIONS), u64::from(MAX_ITERATIONS)) as u32
        });
        for op in Op::ALL {
            check(comm, &world, op, chunk)?;
            let mut whole = vec![0.0f32; elements];
            let mut part = vec![0.0f32; chunk];
            comm.barrier(&world)?;
            comm.reset_stats();
            let start = Instant::now();
            for _ in 0..iterations {
                run_op(comm, &world, op, &mut whole, &mut part)?;
            }
            let seconds = start.elapsed().as_secs_f64() / f64::from(iterations);
            let bytes_sent = comm.stats().total() / u64::from(iterations);
            measurements.push(Measurement { op, bytes: elements as u64 * 4, iterations, seconds, bytes_sent });
        }
    }
    Ok(measurements)
}

/// One collective over `whole` (all elements) and `part` (this rank's chunk).
fn run_op(comm: &mut dyn Communicator, world: &Group, op: Op, whole: &mut [f32], part: &mut [f32]) -> Result<()> {
    match op {
        Op::AllReduce => comm.all_reduce(world, whole)?,
        Op::AllGather => comm.all_gather(world, part, whole)?,
        Op::ReduceScatter => comm.reduce_scatter(world, whole, part)?,
    }
    Ok(())
}

/// Rank `rank`'s input element `index`: small integers, so that sums are exact.
fn input_value(rank: u32, index: usize) -> f32 {
    ((rank as usize * 7 + index * 3) % 11) as f32
}

/// Runs `op` once on known inputs and compares with the naive result.
fn check(comm: &mut dyn Communicator, world: &Group, op: Op, chunk: usize) -> Result<()> {
    let (rank, n_ranks) = (comm.rank(), comm.world_size());
    let elements = chunk * n_ranks as usize;
    let sum = |index: usize| (0..n_ranks).map(|member| input_value(member, index)).sum::<f32>();
    let (got, expected): (Vec<f32>, Vec<f32>) = match op {
        Op::AllReduce => {
            let mut buf: Vec<f32> = (0..elements).map(|index| input_value(rank, index)).collect();
            comm.all_reduce(world, &mut buf)?;
            (buf, (0..elements).map(sum).collect())
        }
        Op::AllGather => {
            let input: Vec<f32> = (0..chunk).map(|index| input_value(rank, index)).collect();
            let mut output = vec![0.0; elements];
            comm.all_gather(world, &input, &mut output)?;
            let expected =
                (0..n_ranks).flat_map(|member| (0..chunk).map(move |index| input_value(member, index))).collect();
            (output, expected)
        }
        Op::ReduceScatter => {
            let input: Vec<f32> = (0..elements).map(|index| input_value(rank, index)).collect();
            let mut output = vec![0.0; chunk];
            comm.reduce_scatter(world, &input, &mut output)?;
            let own = rank as usize * chunk;
            (output, (own..own + chunk).map(sum).collect())
        }
    };
    if got != expected {
        let first = got.iter().zip(&expected).position(|(a, b)| a != b).unwrap_or(0);
        bail!(crate::usage::UsageError::CollectiveWrongResult {
            op: op.name(),
            elements,
            element: first,
            rank,
            got: got.get(first).copied().unwrap_or(f32::NAN),
            expected: expected.get(first).copied().unwrap_or(f32::NAN)
        });
    }
    Ok(())
}

/// Parses `LO..HI` (doubling) or `A,B,C`; units B, KiB, MiB, GiB (or none: bytes).
fn parse_sizes(text: &str) -> Result<Vec<u64>> {
    let sizes = if let Some((low, high)) = text.split_once("..") {
        let (low, high) = (parse_size(low)?, parse_size(high)?);
        if low == 0 || low > high {
            bail!(crate::usage::UsageError::SizesRange { text: text.to_string() });
        }
        std::iter::successors(Some(low), |&size| size.checked_mul(2)).take_while(|&size| size <= high).collect()
    } else {
        text.split(',').map(parse_size).collect::<Result<Vec<_>>>()?
    };
    // Under one f32 a rank's share is padded to one: `1B` and `3B` measured what `4B` does.
    if sizes.iter().any(|&size| size < 4) {
        bail!(crate::usage::UsageError::SizesZero { text: text.to_string() });
    }
    Ok(sizes)
}

fn parse_size(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text.find(|character: char| !character.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        other => bail!(crate::usage::UsageError::SizeUnit { text: text.to_string(), unit: other.to_string() }),
    };
    let number: u64 = number.parse().map_err(|_| crate::usage::UsageError::SizeNumber { text: text.to_string() })?;
    Ok(number.checked_mul(scale).ok_or_else(|| crate::usage::UsageError::SizeTooLarge { text: text.to_string() })?)
}

fn report(args: &CommBenchArgs, comm: &str, n_ranks: u32, measurements: &[Measurement]) -> Result<()> {
    let gbps = |measurement: &Measurement| measurement.bytes as f64 / measurement.seconds / 1e9;
    match args.format {
        Format::Json => {
            let rows: Vec<_> = measurements
                .iter()
                .map(|measurement| {
                    let algbw = gbps(measurement);
                    json!({
                        "op": measurement.op.name(),
                        "bytes": measurement.bytes,
                        "elements": measurement.bytes / 4,
                        "iterations": measurement.iterations,
                        "time_us": measurement.seconds * 1e6,
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * measurement.op.bus_factor(n_ranks),
                        "bytes_sent_rank0": measurement.bytes_sent,
                    })
                })
                .collect();
            let object = json!({ "schema": SCHEMA, "comm": comm, "ranks": n_ranks, "results": rows });
            println!("{}", serde_json::to_string_pretty(&object)?);
        }
        Format::Text => {
            println!("collectives over {n_ranks} rank(s), {comm} communicator (GB = 1e9 bytes; busbw as nccl-tests)");
            println!(
                "{:<15} {:>12} {:>6} {:>12} {:>12} {:>12} {:>14}",
                "op", "size", "iters", "time (us)", "algbw GB/s", "busbw GB/s", "sent by rank 0"
            );
            for measurement in measurements {
                let algbw = gbps(measurement);
                println!(
                    "{:<15} {:>12} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>14}",
                    measurement.op.name(),
                    crate::run::human_bytes(measurement.bytes),
                    measurement.iterations,
                    measurement.seconds * 1e6,
                    algbw,
                    algbw * measurement.op.bus_factor(n_ranks),
                    crate::run::human_bytes(measurement.bytes_sent)
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_doubling_ranges_and_lists() {
        assert_eq!(parse_sizes("1KiB..8KiB").unwrap(), vec![1024, 2048, 4096, 8192]);
        assert_eq!(parse_sizes("4,1MiB").unwrap(), vec![4, 1 << 20]);
        assert_eq!(parse_sizes("1KiB..256MiB").unwrap().len(), 19);
        assert!(parse_sizes("8KiB..1KiB").is_err());
        assert!(parse_sizes("3furlongs").is_err());
        assert!(parse_sizes("0").is_err());
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Op::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Op::AllGather.bus_factor(4), 0.75);
        assert_eq!(Op::ReduceScatter.bus_factor(1), 0.0);
    }

    /// Every collective is checked and rank 0's bytes are the ring's: 2(n-1)/n of the buffer for
    /// all-reduce, (n-1)/n for the others.
    #[test]
    fn threads_bench_checks_results_and_counts_ring_bytes() {
        let measurements = on_threads(4, &[4096], Some(2), Duration::from_secs(30)).unwrap();
        let sent: Vec<(Op, u64)> =
            measurements.iter().map(|measurement| (measurement.op, measurement.bytes_sent)).collect();
        assert_eq!(sent, vec![(Op::AllReduce, 6144), (Op::AllGather, 3072), (Op::ReduceScatter, 3072)]);
    }
}
