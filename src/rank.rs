//! `pleat rank DIR` (feature `mpi`): run one rank of a compiled directory as an MPI process.
//!
//! Launched as `mpirun -np N pleat rank DIR`: every process reads the directory, takes its MPI
//! world rank as its pleat rank, checks that the world has as many ranks as the plan (else every
//! rank reports both numbers), runs its program over [`MpiComm`], and sends its output blocks to rank
//! 0, which assembles the logits, prints `pleat run`'s report and, with `--check`, compares them
//! with the reference interpreter. A rank that fails, before its program (a file its host lacks)
//! or in it, reports its error and ends the whole job (`MPI_Abort`), so no rank is left waiting.
//!
//! Test hook: `PLEAT_TEST_EXIT_AT_COMM=<rank>:<call>` makes rank `<rank>` exit abruptly with status 3
//! when its program reaches its `<call>`-th communication call (counted from 0), as a crashed process
//! would. It exists for the fault tests and is read only here.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pleat_runtime::comm::mpi::{bytes_to_words, words_to_bytes};
use pleat_runtime::comm::{
    gemm_threads_per_process, CollectiveKind, CommError, CommStats, Communicator, Group, MpiComm,
};
use pleat_runtime::{assemble, execute, OutputBlock, RankOutcome, RunInputs};
use serde::{Deserialize, Serialize};

use crate::compiled_dir::CompiledDir;
use crate::inputs::{random_tokens, read_tokens};
use crate::reference::check_logits_if;
use crate::run::{weight_source, Format, RunResult};
use crate::usage::UsageError;

/// The environment variable of the crash test hook (see the module documentation).
const EXIT_HOOK_ENV: &str = "PLEAT_TEST_EXIT_AT_COMM";
/// The exit status of a rank the hook stops.
const EXIT_HOOK_STATUS: i32 = 3;

/// Arguments of `pleat rank`.
#[derive(Args)]
pub struct RankArgs {
    /// A directory written by `pleat compile`.
    pub dir: PathBuf,
    /// Weights: a .safetensors file, a model.safetensors.index.json, or a directory with either;
    /// else seeded synthetic weights.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Seed of the random tokens and synthetic weights (as `pleat run`'s).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Token ids as JSON, `[[id, ...], ...]`, of the directory's batch and sequence length (every
    /// rank reads the file); else a seeded random batch.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Rank 0 also runs the reference interpreter and reports the largest logit difference.
    #[arg(long)]
    pub check: bool,
    /// Seconds a rank waits on a message before it reports the peer that did not send it.
    #[arg(long, default_value_t = 120, value_parser = crate::number_flags::count::<u64>)]
    pub timeout: u64,
    /// Output format (rank 0 prints).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Rank 0 writes every rank's measured timeline as a Chrome/Perfetto trace to this JSON file
    /// (as `pleat run --trace`; the ranks start their clocks together, after a barrier).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Rank 0 writes the logits (f32 [batch, seq, vocab], tensor `logits`) to this safetensors file
    /// (as `pleat run --logits-out`).
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

/// What a rank sends rank 0 besides its blocks' data.
#[derive(Serialize, Deserialize)]
struct RankSummary {
    peak_bytes: u64,
    param_bytes: u64,
    /// Bytes sent, by `CollectiveKind::ALL` order.
    comm_bytes: Vec<u64>,
    /// Each output block without its data, which follows in a message of its own, in this order.
    blocks: Vec<BlockPlace>,
    /// The busiest expert's rows in one layer.
    max_expert_rows: u64,
    /// Each instruction's start and end, nanoseconds since the rank's epoch.
    timings: Vec<(u64, u64)>,
    /// Whether its prefetches ran on a stream of their own.
    prefetch_stream: bool,
}

/// Where an output block lies: its graph output, that output's global shape, and its region.
#[derive(Serialize, Deserialize)]
struct BlockPlace {
    index: u32,
    shape: Vec<u64>,
    region: Vec<(u64, u64)>,
}

/// What a rank reads before it runs: the directory's plan, config and programs, the tokens and the
/// weights.
struct RankInputs {
    plan: crate::compiled_dir::PlanFile,
    config: pleat_ir::model::config::ModelConfig,
    programs: Vec<pleat_backend::Program>,
    tokens: crate::inputs::Tokens,
    weights: Box<dyn pleat_runtime::weights::WeightSource>,
}

/// Reads what rank `rank` of a world of `world` ranks runs, checking the outputs' paths first.
fn read_inputs(args: &RankArgs, rank: u32, world: u32) -> Result<RankInputs> {
    let compiled = CompiledDir::read_forward(&args.dir)?;
    let (plan, config, programs) = (compiled.plan, compiled.config, compiled.programs);
    if world != plan.ranks {
        bail!(UsageError::MpiWorldSize { rank, world, dir: args.dir.clone(), ranks: plan.ranks });
    }
    if rank == 0 {
        if let Some(path) = &args.trace {
            crate::checkpoint::check_output_file(path, "--trace")?;
        }
        if let Some(path) = &args.logits_out {
            crate::checkpoint::check_output_file(path, "--logits-out")?;
        }
    }
    // This rank's own program, before it allocates (ranks sharing a host each check their own).
    if let Some(program) = programs.get(rank as usize) {
        crate::run::ensure_threads_fit(std::slice::from_ref(program))?;
    }
    let tokens = match &args.tokens {
        Some(path) => {
            let tokens = read_tokens(path)?;
            tokens.expect_shape(plan.batch, plan.seq)?;
            tokens.expect_ids_below(config.vocab_size)?;
            tokens
        }
        None => random_tokens(plan.batch, plan.seq, config.vocab_size, args.seed)?,
    };
    // The weights the directory was compiled beside, as `pleat run DIR` loads them.
    let weights_path = crate::compiled_dir::weights_for(args.weights.as_deref(), &args.dir, &plan)?;
    let weights = weight_source(weights_path.as_ref(), args.seed)?;
    if rank == 0 {
        crate::run::warn_unused_tensors(weights_path.as_ref(), &programs);
    }
    Ok(RankInputs { plan, config, programs, tokens, weights })
}

/// Reports `error` in the run's error format and ends the whole job: peers may be blocked where
/// only `MPI_Abort` reaches them, or, when this rank failed before its first message, would wait
/// for it until their timeout.
fn end_job(comm: &mut MpiComm, error: anyhow::Error, format: Format) -> ! {
    let error_format =
        if format == Format::Json { crate::report::ErrorFormat::Json } else { crate::report::ErrorFormat::Text };
    crate::report::print(&error, error_format);
    comm.abort_job(&format!("{error:#}"), 1)
}

/// Runs `pleat rank`.
pub fn rank(args: &RankArgs) -> Result<()> {
    let mut comm = MpiComm::init(Duration::from_secs(args.timeout))
        .context("cannot start mpi; launch pleat rank with mpirun -np N")?;
    let rank = comm.rank();
    let RankInputs { plan, config, programs, tokens, weights } = match read_inputs(args, rank, comm.world_size()) {
        Ok(inputs) => inputs,
        // A world of the wrong size is every rank's error alike: each reports it and MPI
        // finalizes normally.
        Err(error) if matches!(error.downcast_ref(), Some(UsageError::MpiWorldSize { .. })) => return Err(error),
        // Another (a file one host lacks, say) may be this rank's alone.
        Err(error) => end_job(&mut comm, error.context(format!("rank {rank} cannot start")), args.format),
    };
    let positions: Vec<u32> = (0..plan.seq as u32).collect();
    if args.trace.is_some() {
        // One epoch for every rank's clock, to within a barrier's latency.
        comm.barrier(&Group::world(comm.world_size())).with_context(|| format!("rank {rank}"))?;
    }
    let inputs =
        RunInputs { tokens: &tokens.ids, positions: &positions, weights: weights.as_ref(), epoch: Instant::now() };
    let program = &programs[rank as usize];
    let exit_at = exit_hook(rank)?;
    let outcome = {
        let mut hooked = ExitAtCall { inner: &mut comm, exit_at, calls: 0 };
        execute(program, &mut hooked, &inputs, gemm_threads_per_process())
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => end_job(&mut comm, anyhow::Error::new(err).context(format!("rank {rank} failed")), args.format),
    };
    let outcomes = match gather_outcomes(&mut comm, outcome) {
        Ok(outcomes) => outcomes,
        Err(err) => end_job(&mut comm, err.context(format!("rank {rank} failed to gather the outputs")), args.format),
    };
    comm.flush().with_context(|| format!("rank {rank}"))?;
    drop(comm);
    let Some(outcomes) = outcomes else { return Ok(()) };
    if let Some(path) = &args.trace {
        crate::trace::write_measured(path, &programs, &outcomes)?;
    }
    let (logits_shape, logits) = assemble(&outcomes, 0).ok_or(UsageError::NoLogits)?;
    if let Some(path) = &args.logits_out {
        crate::run::write_logits(path, &logits_shape, &logits)?;
    }
    // Held to the same tolerance as `pleat run DIR --check`: f32's, or bf16's for a bf16 plan.
    let (check, tolerance) =
        check_logits_if(args.check, (&config, &tokens, weights.as_ref()), &programs, &logits, false)?;
    let result = RunResult {
        config,
        mesh: plan.mesh,
        tokens,
        logits_shape,
        outcomes,
        check,
        tolerance,
        programs,
        native_kernels: Vec::new(),
        execution: Vec::new(),
        device: None,
    };
    // The report `pleat run` prints, from the same outcomes.
    crate::run::report(args.format, None, "mpi", &result)?;
    result.ensure_within_tolerance()
}

/// The communication call at which the test hook stops this rank, if it names this rank.
fn exit_hook(rank: u32) -> Result<Option<u64>> {
    let Ok(value) = std::env::var(EXIT_HOOK_ENV) else { return Ok(None) };
    let parsed = value
        .split_once(':')
        .and_then(|(hook_rank, call)| Some((hook_rank.parse::<u32>().ok()?, call.parse::<u64>().ok()?)));
    match parsed {
        Some((hook_rank, call)) => Ok((hook_rank == rank).then_some(call)),
        None => bail!(UsageError::ExitHookSyntax { name: EXIT_HOOK_ENV, value }),
    }
}

/// Sends every rank's outcome to rank 0 over `comm`: `Some(all outcomes)` on rank 0, `None` elsewhere.
/// Each rank sends two sizes, its summary (JSON bytes packed in f32 words) and its blocks' data.
fn gather_outcomes(comm: &mut MpiComm, outcome: RankOutcome) -> Result<Option<Vec<RankOutcome>>> {
    let rank = comm.rank();
    if rank != 0 {
        let summary = RankSummary {
            peak_bytes: outcome.peak_bytes,
            param_bytes: outcome.param_bytes,
            comm_bytes: CollectiveKind::ALL.iter().map(|&kind| outcome.comm.bytes(kind)).collect(),
            max_expert_rows: outcome.max_expert_rows,
            timings: outcome.timings.clone(),
            prefetch_stream: outcome.prefetch_stream,
            blocks: outcome
                .outputs
                .iter()
                .map(|block| BlockPlace {
                    index: block.index,
                    shape: block.shape.clone(),
                    region: block.region.clone(),
                })
                .collect(),
        };
        let summary_words = bytes_to_words(&serde_json::to_vec(&summary)?);
        let data: Vec<f32> = outcome.outputs.iter().flat_map(|block| block.data.iter().copied()).collect();
        comm.send(0, &[f32::from_bits(summary_words.len() as u32), f32::from_bits(data.len() as u32)])?;
        comm.send(0, &summary_words)?;
        comm.send(0, &data)?;
        return Ok(None);
    }
    let mut outcomes = vec![outcome];
    for peer in 1..comm.world_size() {
        let mut sizes = [0.0f32; 2];
        comm.recv(peer, &mut sizes)?;
        let mut summary_words = vec![0.0; sizes[0].to_bits() as usize];
        comm.recv(peer, &mut summary_words)?;
        let mut data = vec![0.0; sizes[1].to_bits() as usize];
        comm.recv(peer, &mut data)?;
        let summary: RankSummary = serde_json::from_slice(&words_to_bytes(&summary_words))
            .with_context(|| format!("rank {peer} sent a summary rank {rank} cannot read"))?;
        let mut comm_stats = CommStats::default();
        for (&kind, &bytes) in CollectiveKind::ALL.iter().zip(&summary.comm_bytes) {
            comm_stats.add(kind, bytes);
        }
        let mut offset = 0;
        let mut outputs = Vec::with_capacity(summary.blocks.len());
        for BlockPlace { index, shape, region } in summary.blocks {
            let len = region.iter().map(|&(_, len)| len as usize).product::<usize>();
            let block_data = data.get(offset..offset + len).with_context(|| {
                format!("rank {peer} sent {} output elements, fewer than its blocks' regions hold", data.len())
            })?;
            offset += len;
            outputs.push(OutputBlock { index, shape, region, data: block_data.to_vec() });
        }
        outcomes.push(RankOutcome {
            rank: peer,
            outputs,
            peak_bytes: summary.peak_bytes,
            param_bytes: summary.param_bytes,
            comm: comm_stats,
            activation_bytes: Vec::new(),
            in_flight_peak_bytes: 0,
            timings: summary.timings,
            max_expert_rows: summary.max_expert_rows,
            arena_bytes: 0,
            prefetch_stream: summary.prefetch_stream,
        });
    }
    Ok(Some(outcomes))
}

/// A communicator that ends the process abruptly at one call (the test hook), else passes through.
struct ExitAtCall<'a> {
    inner: &'a mut MpiComm,
    exit_at: Option<u64>,
    calls: u64,
}

impl ExitAtCall<'_> {
    fn count(&mut self) {
        if self.exit_at == Some(self.calls) {
            // Abrupt on purpose: no MPI_Finalize, no notice to peers, as a crashed process.
            std::process::exit(EXIT_HOOK_STATUS);
        }
        self.calls += 1;
    }
}

impl Communicator for ExitAtCall<'_> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn world_size(&self) -> u32 {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.all_reduce(group, buf)
    }
    fn reduce_scatter(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.reduce_scatter(group, input, output)
    }
    fn all_gather(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.all_gather(group, input, output)
    }
    fn broadcast(&mut self, group: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.broadcast(group, root, buf)
    }
    fn all_to_all(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.all_to_all(group, input, output)
    }
    fn all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[f32], &[usize]),
        receive: (&mut [f32], &[usize]),
    ) -> Result<(), CommError> {
        self.count();
        self.inner.all_to_all_v(group, send, receive)
    }
    fn send(&mut self, peer: u32, data: &[f32]) -> Result<(), CommError> {
        self.count();
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        self.count();
        self.inner.recv(peer, buf)
    }
    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.count();
        self.inner.barrier(group)
    }
    fn stats(&self) -> &CommStats {
        self.inner.stats()
    }
    fn reset_stats(&mut self) {
        self.inner.reset_stats();
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason);
    }
    fn as_sendable(&mut self) -> Option<&mut (dyn Communicator + Send)> {
        // As `MpiComm`'s: the hook then counts, and exits at, the calls the communication thread makes.
        Some(self)
    }
    fn second_stream(&mut self) -> Option<Box<dyn Communicator>> {
        // The hook counts the main stream's calls only: the two streams' calls interleave in no
        // fixed order, so a count over both would not name one call.
        self.inner.second_stream()
    }
}
