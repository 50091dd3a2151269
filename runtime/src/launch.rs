//! Runs every rank's program as a thread of this process, over the threads communicator, and
//! assembles the ranks' output blocks into whole tensors.

use std::time::Duration;

use pleat_backend::Program;

use crate::comm::{Communicator, LinkSpec, ThreadComm, ThreadFabric};
use crate::error::{Error, Result};
use crate::executor::{execute_native, OutputBlock, RankOutcome, RunInputs};
use crate::native::NativeKernels;

/// Runs `programs` (one a rank, in rank order) on threads; every collective wait gives up after
/// `timeout`. When a rank fails, the others are told and fail fast; the error returned is the first
/// rank's own failure rather than its peers' reports of it.
pub fn run_on_threads(programs: &[Program], inputs: &RunInputs, timeout: Duration) -> Result<Vec<RankOutcome>> {
    run_on_threads_with(programs, inputs, &ThreadRunOptions { timeout, link: None })
}

/// How [`run_on_threads_with`] connects the ranks.
#[derive(Clone, Copy, Debug)]
pub struct ThreadRunOptions {
    /// How long any collective wait may take.
    pub timeout: Duration,
    /// The link every message is delivered over (`--emulate-link`); `None`: memory speed.
    pub link: Option<LinkSpec>,
}

/// As [`run_on_threads`], over the communicator `options` describe.
pub fn run_on_threads_with(
    programs: &[Program],
    inputs: &RunInputs,
    options: &ThreadRunOptions,
) -> Result<Vec<RankOutcome>> {
    run_on_threads_native(programs, inputs, options, &[])
}

/// As [`run_on_threads_with`], rank `i` calling `native[i]`'s kernels where it has them (ranks past
/// the end of `native`, or with `None`, interpret every kernel).
pub fn run_on_threads_native(
    programs: &[Program],
    inputs: &RunInputs,
    options: &ThreadRunOptions,
    native: &[Option<NativeKernels>],
) -> Result<Vec<RankOutcome>> {
    on_rank_threads(programs, options, |program, comm, gemm_threads| {
        let table = native.get(program.rank as usize).and_then(Option::as_ref);
        execute_native(program, comm, inputs, gemm_threads, table)
    })
}

/// Runs `work(program, comm, gemm_threads)` for every rank of `programs` (checked to be one a rank,
/// in rank order) on a thread of its own, over the threads communicator `options` describe, as
/// [`on_threads`] does; `gemm_threads` is the parallelism a rank's host kernels may take.
pub(crate) fn on_rank_threads<T: Send>(
    programs: &[Program],
    options: &ThreadRunOptions,
    work: impl Fn(&Program, &mut ThreadComm, usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    check_ranks(programs)?;
    let world_size = programs.len() as u32;
    // Ranks already run in parallel; give GEMMs the cores only when there is one rank.
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let gemm_threads = if world_size == 1 { cores } else { 1 };
    let comms = ThreadFabric::with_link(world_size, options.timeout, options.link);
    on_threads(comms, |rank, comm| work(&programs[rank as usize], comm, gemm_threads))
}

/// Refuses a world of `ranks` threads larger than the threads communicator connects.
pub fn check_thread_ranks(ranks: u64) -> Result<()> {
    if ranks > u64::from(ThreadFabric::MAX_RANKS) {
        return Err(Error::TooManyThreadRanks { ranks, max: ThreadFabric::MAX_RANKS });
    }
    Ok(())
}

/// Checks that `programs` are one a rank of one world, in rank order, and few enough for threads.
fn check_ranks(programs: &[Program]) -> Result<()> {
    check_thread_ranks(programs.len() as u64)?;
    let world_size = programs.len() as u32;
    for (rank, program) in programs.iter().enumerate() {
        if program.rank != rank as u32 || program.world_size != world_size {
            return Err(Error::Inputs {
                reason: format!(
                    "program {rank} is for rank {} of {}, but {world_size} programs were given",
                    program.rank, program.world_size
                ),
            });
        }
    }
    Ok(())
}

/// Runs `work` for every rank on a thread of its own, with that rank's communicator. A rank that
/// fails tells its peers, which then fail fast; the error returned is the first rank's own failure
/// rather than its peers' reports of it, and a panic is an error naming the rank.
pub(crate) fn on_threads<T: Send>(
    comms: Vec<ThreadComm>,
    work: impl Fn(u32, &mut ThreadComm) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let work = &work;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                scope.spawn(move || {
                    let outcome = work(rank as u32, &mut comm);
                    if let Err(err) = &outcome {
                        comm.abort(&err.to_string());
                    }
                    outcome
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, handle)| {
                handle.join().unwrap_or_else(|payload| {
                    let message = payload
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| payload.downcast_ref::<&str>().map(|text| text.to_string()))
                        .unwrap_or_else(|| "unknown panic".to_string());
                    Err(Error::Panicked { rank: rank as u32, message })
                })
            })
            .collect()
    });
    let mut outcomes = Vec::new();
    let mut first_error: Option<Error> = None;
    for result in results {
        match result {
            Ok(outcome) => outcomes.push(outcome),
            // A peer's report of a failure only stands in until the failing rank's own error arrives.
            Err(err) if first_error.as_ref().is_none_or(|first| is_peer_report(first) && !is_peer_report(&err)) => {
                first_error = Some(err);
            }
            Err(_) => {}
        }
    }
    match first_error {
        Some(err) => Err(err),
        None => Ok(outcomes),
    }
}

/// Assembles graph output `index` from the ranks' blocks into a whole row-major tensor.
/// Replicated blocks simply overwrite one another with equal data.
pub fn assemble(outcomes: &[RankOutcome], index: u32) -> Option<(Vec<u64>, Vec<f32>)> {
    let blocks: Vec<&OutputBlock> =
        outcomes.iter().flat_map(|outcome| &outcome.outputs).filter(|block| block.index == index).collect();
    assemble_blocks(&blocks)
}

/// Assembles one tensor from blocks of it (all of one global shape) into a whole row-major tensor;
/// `None` when there are none.
pub fn assemble_blocks(blocks: &[&OutputBlock]) -> Option<(Vec<u64>, Vec<f32>)> {
    let shape = blocks.first()?.shape.clone();
    let mut data = vec![0.0f32; shape.iter().product::<u64>() as usize];
    for block in blocks {
        let block_shape: Vec<usize> = block.region.iter().map(|&(_, len)| len as usize).collect();
        for (flat, &value) in block.data.iter().enumerate() {
            // Decompose the block-local index and offset it into the global tensor.
            let mut remaining = flat;
            let mut global = 0usize;
            let mut stride = 1usize;
            let mut coords = vec![0usize; block_shape.len()];
            for dim in (0..block_shape.len()).rev() {
                coords[dim] = remaining % block_shape[dim];
                remaining /= block_shape[dim];
            }
            for dim in (0..block_shape.len()).rev() {
                global += (coords[dim] + block.region[dim].0 as usize) * stride;
                stride *= shape[dim] as usize;
            }
            data[global] = value;
        }
    }
    Some((shape, data))
}

fn is_peer_report(err: &Error) -> bool {
    matches!(err, Error::Comm { source, .. } if matches!(**source, crate::comm::CommError::PeerFailed { .. }))
}
