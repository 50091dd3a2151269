//! `pleat run`: compile (or load) per-rank programs, run them on threads, and optionally check the
//! logits against the reference interpreter.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use pleat_backend::memory::{plan, ElementSize};
use pleat_backend::overlap::Prefetch;
use pleat_backend::Program;
use pleat_ir::model::config::{ConfigDtype, ModelConfig};
use pleat_ir::Mesh;
use pleat_passes::Dump;
use pleat_runtime::comm::{CollectiveKind, CommStats, LinkSpec};
use pleat_runtime::weights::{SafetensorsWeights, SeededWeights, WeightSource};
use pleat_runtime::{assemble, run_on_threads_native, NativeKernels, RankOutcome, RunInputs, ThreadRunOptions};
use serde_json::json;

use crate::compile::{compile_model, Kernels, Strategy};
use crate::compiled_dir::CompiledDir;
use crate::device::{Device, DeviceReport};
use crate::inputs::{random_tokens, read_tokens, Tokens};
use crate::model_arg::{resolve, ModelSource};
use crate::reference::{check_logits_if, LogitsCheck};
use crate::usage::UsageError;

/// The largest absolute difference from the reference that `--check` accepts, in f32.
pub const F32_TOL: f32 = 1e-4;

/// `--comm`: which communicator carries the ranks' messages (of `run` and `bench comm`).
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum CommChoice {
    /// Ranks are threads of this process.
    Threads,
    /// Ranks are the processes of an `mpirun` launch.
    #[cfg(feature = "mpi")]
    Mpi,
}

/// `--precision`: the element type of the ranks' weights, activations and gradients.
#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Mixed precision: bf16 weights, activations and gradients (computed in f32, stored rounded to
    /// bf16), the loss in f32, and in training f32 master weights and moments in the optimizer.
    Bf16,
}

impl Precision {
    /// The precision a configuration's dtype computes in (a compiled directory's config holds the
    /// one it was compiled with).
    pub fn of(config: &ModelConfig) -> Precision {
        match config.dtype {
            ConfigDtype::Bf16 => Precision::Bf16,
            ConfigDtype::F32 | ConfigDtype::F16 => Precision::F32,
        }
    }

    /// `config` with its dtype set to this precision: the graph's params and activations take it.
    pub fn apply(self, config: &ModelConfig) -> ModelConfig {
        let mut config = config.clone();
        config.dtype = match self {
            Precision::F32 => ConfigDtype::F32,
            Precision::Bf16 => ConfigDtype::Bf16,
        };
        config
    }
}

/// Output formats.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

/// Arguments of `pleat run`.
#[derive(Args)]
pub struct RunArgs {
    /// A preset name, a config.json, a model directory (config.json + weights), or a compiled directory.
    pub model: String,
    /// The device mesh, e.g. `tp=4` or `dp=2,tp=2` (a compiled directory's own, if given).
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// How to use the mesh's axes (`tp-sp` adds sequence parallelism to tp).
    #[arg(long, value_enum, default_value_t = Strategy::Auto)]
    pub strategy: Strategy,
    /// Weights: a .safetensors file, a model.safetensors.index.json, or a directory with either.
    /// Without it, a model directory's own weights, else seeded synthetic weights.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Sequence length (default 64, or the --tokens file's).
    #[arg(long)]
    pub seq: Option<u64>,
    /// Sequences a batch (default 8, or the --tokens file's).
    #[arg(long)]
    pub batch: Option<u64>,
    /// Token ids as JSON, `[[id, ...], ...]` (one row a sequence); else a seeded random batch.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Seed of the random tokens and synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the reference interpreter and report the largest logit difference.
    #[arg(long)]
    pub check: bool,
    /// Write the logits (f32 [batch, seq, vocab], tensor `logits`) to this safetensors file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Seconds a rank waits on a collective before it reports the peers that did not arrive. A
    /// message already sent but held by --emulate-link is not late: its link delay does not count.
    #[arg(long, default_value_t = 120, value_parser = crate::number_flags::count::<u64>)]
    pub timeout: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write the measured timeline of every rank as a Chrome/Perfetto trace to this JSON file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Keep every transfer blocking where lowering put it, instead of scheduling transfers to run
    /// beside compute (a compiled directory keeps the schedule it was compiled with).
    #[arg(long)]
    pub no_overlap: bool,
    /// Deliver every message no faster than a link of GBPS gigabytes a second and US microseconds of
    /// latency (e.g. `25,5`), so that communication costs time on one machine as on a network.
    #[arg(long, value_name = "GBPS,US")]
    pub emulate_link: Option<LinkSpec>,
    /// Element type of the ranks' weights, activations and gradients (a compiled directory keeps
    /// the dtype it was compiled with).
    /// [default: f32]
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Generate every rank's native code (as `pleat compile --emit so` does) and run each rank
    /// through its entry function, forward or training (a compiled directory runs the code it holds).
    #[arg(long)]
    pub native: bool,
    /// Which communicator carries the ranks' messages: `threads` (each rank a thread of this
    /// process) or, in a build with the `mpi` feature, `mpi` (each rank an MPI process that pleat
    /// starts with `mpirun -np N pleat rank`; the forward pass only).
    #[arg(long, value_enum, default_value_t = CommChoice::Threads)]
    pub comm: CommChoice,
    /// Where the ranks run: `cpu` (threads), or `cuda`, every rank on the first NVIDIA GPU (a build
    /// with `--features cuda`): GEMMs on cuBLAS, generated PTX kernels, the rest through the host.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With `--device cuda`: run the forward pass this many times first, untimed, so that the run
    /// reported finds every kernel loaded (cuBLAS and the driver load them at their first call).
    #[arg(long, default_value_t = 0)]
    pub warmup: u32,
    #[command(flatten)]
    pub training: crate::train::TrainFlags,
}

impl RunArgs {
    /// The batch and sequence length a model run compiles for: the flags', else the tokens
    /// file's, else 8 sequences of 64.
    pub fn sizes(&self, given_tokens: Option<&Tokens>) -> (u64, u64) {
        let batch = self.batch.or(given_tokens.map(|tokens| tokens.batch)).unwrap_or(8);
        let seq = self.seq.or(given_tokens.map(|tokens| tokens.seq)).unwrap_or(64);
        (batch, seq)
    }

    /// Refuses `--mesh`, `--strategy`, `--batch` or `--seq` other than a compiled directory's
    /// `plan`: the directory's programs are what runs.
    pub fn check_against_plan(&self, plan: &crate::compiled_dir::PlanFile) -> Result<()> {
        check_flags_against_plan(&self.mesh, self.strategy, (self.batch, self.seq), plan)
    }

    /// The kernels the run compiles for: native with `--native`, and on a GPU where pleat generates
    /// its kernels (the `llvm` feature).
    pub fn kernels(&self) -> Kernels {
        if self.native || (self.device == Device::Cuda && cfg!(feature = "llvm")) {
            Kernels::Native
        } else {
            Kernels::Interpreted
        }
    }
}

/// Refuses a `mesh` (unless empty), `strategy` (unless `auto`), batch or sequence length (where
/// given) other than a compiled directory's `plan`: the directory's programs are what runs.
pub fn check_flags_against_plan(
    mesh: &str,
    strategy: Strategy,
    (batch, seq): (Option<u64>, Option<u64>),
    plan: &crate::compiled_dir::PlanFile,
) -> Result<()> {
    let differs =
        |flag: &'static str, given: String, planned: String| UsageError::DiffersFromPlan { flag, given, planned };
    for (flag, given, planned) in [("--batch", batch, plan.batch), ("--seq", seq, plan.seq)] {
        if let Some(given) = given.filter(|&given| given != planned) {
            bail!(differs(flag, given.to_string(), planned.to_string()));
        }
    }
    if !mesh.trim().is_empty() {
        // Axes of size 1 change no program.
        let given = Mesh::parse(mesh)?.without_unit_axes();
        if given.to_string() != Mesh::parse(&plan.mesh)?.without_unit_axes().to_string() {
            bail!(differs("--mesh", mesh.to_string(), plan.mesh.clone()));
        }
    }
    if strategy != Strategy::Auto && strategy.name() != plan.strategy {
        bail!(differs("--strategy", strategy.name().to_string(), plan.strategy.clone()));
    }
    Ok(())
}

/// What a run produced.
pub struct RunResult {
    pub config: ModelConfig,
    pub mesh: String,
    pub tokens: Tokens,
    pub logits_shape: Vec<u64>,
    pub outcomes: Vec<RankOutcome>,
    /// The logits beside the reference's (`--check`).
    pub check: Option<LogitsCheck>,
    /// What the check's `max_abs_err` is held to.
    pub tolerance: f32,
    pub programs: Vec<Program>,
    /// Native kernels each rank called from `DIR/rank<i>.so` (empty when none were loaded).
    pub native_kernels: Vec<usize>,
    /// How each rank ran (empty when no library was loaded: every rank interpreted its program).
    pub execution: Vec<crate::native::ExecutionPath>,
    /// The GPU the ranks ran on and where their instructions ran (`--device cuda`).
    pub device: Option<DeviceReport>,
}

impl RunResult {
    /// Fails where `--check` found the logits further from the reference than their tolerance.
    pub fn ensure_within_tolerance(&self) -> Result<()> {
        if let Some(err) = self.check.and_then(|check| check.max_abs_err) {
            if err.is_nan() || err > self.tolerance {
                bail!(UsageError::LogitsMismatch { err, tolerance: self.tolerance });
            }
        }
        Ok(())
    }
}

/// Writes `--logits-out`: the logits, f32 `[batch, seq, vocab]`, as the tensor `logits`.
pub fn write_logits(path: &std::path::Path, shape: &[u64], logits: &[f32]) -> Result<()> {
    pleat_runtime::weights::write_safetensors(path, &[("logits".to_string(), shape.to_vec(), logits.to_vec())])
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Runs `pleat run`.
pub fn run(args: &RunArgs) -> Result<()> {
    check_warmup(args)?;
    check_outputs(args)?;
    #[cfg(feature = "mpi")]
    if args.comm == CommChoice::Mpi {
        return crate::run_mpi::run_under_mpi(args);
    }
    if args.training.train {
        return crate::train::run_training(args);
    }
    let result = execute(args)?;
    // Rank executables are MPI processes.
    let comm =
        if result.execution.contains(&crate::native::ExecutionPath::NativeExecutable) { "mpi" } else { "threads" };
    report(args.format, args.emulate_link, comm, &result)?;
    if let Some(path) = &args.trace {
        crate::trace::write_measured(path, &result.programs, &result.outcomes)?;
    }
    result.ensure_within_tolerance()
}

/// Checks the run's output paths before it runs: a bad one used to be found only once the run
/// (perhaps hours of training) was done.
pub fn check_outputs(args: &RunArgs) -> Result<()> {
    if let Some(path) = &args.trace {
        crate::checkpoint::check_output_file(path, "--trace")?;
    }
    if let Some(path) = &args.logits_out {
        crate::checkpoint::check_output_file(path, "--logits-out")?;
    }
    if let Some(dir) = &args.training.save {
        crate::checkpoint::check_output_dir(dir, crate::checkpoint::INDEX_FILE, "--save")?;
    }
    Ok(())
}

/// The weights of a run: the safetensors at `path`, or seeded synthetic weights.
pub fn weight_source(path: Option<&PathBuf>, seed: u64) -> Result<Box<dyn WeightSource>> {
    if let Some(path) = path {
        // A checkpoint a killed write left aside is put back first.
        crate::checkpoint::recover(path)?;
    }
    Ok(match path {
        // A training checkpoint: its blocks, assembled for any mesh.
        Some(path) if crate::checkpoint::is_checkpoint(path) => Box::new(
            crate::checkpoint::read_weights(path).with_context(|| format!("cannot open weights {}", path.display()))?,
        ),
        Some(path) => {
            Box::new(SafetensorsWeights::open(path).with_context(|| format!("cannot open weights {}", path.display()))?)
        }
        None => Box::new(SeededWeights::new(seed)),
    })
}

/// Warns (on stderr) of the tensors of the safetensors weights at `path` that no rank's program
/// loads, as transformers warns of unused weights: a layer the config does not have, a bias it
/// does not use, an `lm_head.weight` beside tied embeddings. A checkpoint's moments are not weights
/// a forward pass reads, so a checkpoint is not judged.
pub fn warn_unused_tensors(path: Option<&PathBuf>, programs: &[Program]) {
    let Some(path) = path.filter(|path| !crate::checkpoint::is_checkpoint(path)) else { return };
    let Ok(file) = SafetensorsWeights::open(path) else { return };
    // The file's names of what the ranks load: a mixture's stacked experts may be stored one
    // tensor an expert or fused.
    let loaded: std::collections::BTreeSet<String> = programs
        .iter()
        .flat_map(|program| &program.instructions)
        .filter_map(|instr| match instr {
            pleat_backend::Instr::LoadParam { name, shape, .. } => Some((name.as_str(), shape.as_slice())),
            _ => None,
        })
        .collect::<std::collections::BTreeSet<(&str, &[u64])>>()
        .into_iter()
        .flat_map(|(name, shape)| file.stored_names(name, shape))
        .collect();
    // (Older Llama files carry RoPE's inverse frequencies, which transformers also ignores.)
    let unused: Vec<String> = file
        .names()
        .into_iter()
        .filter(|name| !loaded.contains(name) && !name.ends_with("rotary_emb.inv_freq"))
        .collect();
    if let Some(first) = unused.first() {
        let more = if unused.len() > 1 { format!(" and {} more", unused.len() - 1) } else { String::new() };
        eprintln!(
            "warning: {} holds {} tensor(s) the model does not read ({first}{more}); check the config matches the \
             checkpoint",
            path.display(),
            unused.len()
        );
    }
}

/// Each rank's execution path's name (`bytecode` for every rank when no library was loaded).
fn execution_names(result: &RunResult) -> Vec<&'static str> {
    if result.device.is_some() {
        return vec!["cuda"; result.outcomes.len()];
    }
    (0..result.outcomes.len()).map(|rank| result.execution.get(rank).map_or("bytecode", |path| path.name())).collect()
}

/// Refuses `--warmup` where it warms nothing that is timed: it repeats a forward pass on a GPU.
pub fn check_warmup(args: &RunArgs) -> Result<()> {
    if args.warmup == 0 {
        return Ok(());
    }
    if args.training.train {
        bail!(UsageError::InferenceFlagWithTrain { flag: "--warmup" });
    }
    if args.device != Device::Cuda {
        bail!(UsageError::WarmupWithoutCuda);
    }
    Ok(())
}

/// Compiles or loads, runs, and checks; prints nothing.
pub fn execute(args: &RunArgs) -> Result<RunResult> {
    let cuda = args.device == Device::Cuda;
    // (Refused whatever the build: --native never combines with --device cuda.)
    if cuda && args.native {
        bail!(UsageError::CpuOnlyFlag { flag: "--native" });
    }
    if cuda && !cfg!(feature = "cuda") {
        bail!(UsageError::CudaUnavailable);
    }
    let given_tokens = args.tokens.as_ref().map(|path| read_tokens(path)).transpose()?;
    let mut native = Vec::new();
    // A compiled directory's rank executables, when it has no libraries: they run as processes.
    let mut executables = None;
    // A compiled directory, whose `--emit ptx` kernels a GPU run launches.
    let mut compiled_dir = None;
    let (config, mut programs, mesh, weights_path, batch, seq) = match resolve(&args.model)? {
        ModelSource::Compiled(dir) => {
            if args.precision.is_some() {
                bail!(UsageError::PrecisionOfCompiled { dir: dir.display().to_string() });
            }
            if args.native {
                bail!(UsageError::NativeOfCompiled { dir: dir.display().to_string() });
            }
            let compiled = CompiledDir::read_forward(&dir)?;
            let (plan, config, programs) = (compiled.plan, compiled.config, compiled.programs);
            compiled_dir = Some(dir.clone());
            if !cuda {
                native = crate::native::load(&dir, &programs)?;
            }
            if !cuda && native.iter().all(Option::is_none) {
                executables = crate::exe::executables(&dir, &programs)?.map(|paths| (dir.clone(), paths));
            }
            args.check_against_plan(&plan)?;
            crate::compiled_dir::check_schedule_flags(args.no_overlap, 2, &programs)?;
            let weights = crate::compiled_dir::weights_for(args.weights.as_deref(), &dir, &plan)?;
            (config, programs, plan.mesh, weights, plan.batch, plan.seq)
        }
        ModelSource::Config { config, weights } => {
            let (batch, seq) = args.sizes(given_tokens.as_ref());
            let mesh = Mesh::parse(&args.mesh)?;
            let compute = args.precision.unwrap_or_default().apply(&config);
            let compiled = compile_model(&compute, batch, seq, &mesh, args.strategy, Dump::Nothing, args.kernels())?;
            let mut programs =
                crate::predict::overlap_for_cpu(compiled.programs, args.no_overlap, Prefetch::OwnStream)?;
            if args.native {
                native = crate::native::build_and_load(&mut programs)?;
            }
            (*config, programs, mesh.to_string(), args.weights.clone().or(weights), batch, seq)
        }
    };
    // Refused before the batch's token ids are made.
    if !cuda && executables.is_none() {
        ensure_threads_fit(&programs)?;
    }
    let tokens = match given_tokens {
        Some(tokens) => {
            tokens.expect_shape(batch, seq)?;
            tokens.expect_ids_below(config.vocab_size)?;
            tokens
        }
        None => random_tokens(batch, seq, config.vocab_size, args.seed)?,
    };
    let weights = weight_source(weights_path.as_ref(), args.seed)?;
    warn_unused_tensors(weights_path.as_ref(), &programs);
    let options = link_options(args.timeout, args.emulate_link);
    let mut device = None;
    let (logits_shape, logits, outcomes, execution) = match &executables {
        _ if cuda => {
            let run = crate::device::run_on_cuda(
                &mut programs,
                compiled_dir.as_deref(),
                &tokens,
                weights.as_ref(),
                &options,
                args.warmup,
            )?;
            device = Some(run.report);
            (run.logits_shape, run.logits, run.outcomes, Vec::new())
        }
        Some((dir, paths)) => {
            if args.emulate_link.is_some() {
                bail!(UsageError::ExecutablesFailed {
                    dir: dir.display().to_string(),
                    reason: "--emulate-link shapes the threads communicator; the executables talk over MPI".into(),
                });
            }
            let inputs =
                crate::exe::ExeInputs { weights: weights_path.as_deref(), seed: args.seed, timeout: args.timeout };
            let outcomes = crate::exe::run_executables(dir, paths, &tokens, &inputs)?;
            let (shape, logits) = assemble(&outcomes, 0).ok_or(UsageError::NoLogits)?;
            (shape, logits, outcomes, vec![crate::native::ExecutionPath::NativeExecutable; paths.len()])
        }
        None => {
            let (shape, logits, outcomes) =
                run_programs_native(&programs, &tokens, weights.as_ref(), &options, &native)?;
            let execution = native.iter().map(|table| crate::native::ExecutionPath::of(table.as_ref())).collect();
            (shape, logits, outcomes, execution)
        }
    };
    // Empty when no rank loaded a library, as for a model run (a directory without libraries gave
    // each rank's 0).
    let native_kernels = if native.iter().all(Option::is_none) {
        Vec::new()
    } else {
        native.iter().map(|table| table.as_ref().map_or(0, NativeKernels::len)).collect()
    };
    let (check, tolerance) =
        check_logits_if(args.check, (&config, &tokens, weights.as_ref()), &programs, &logits, cuda)?;
    if let Some(path) = &args.logits_out {
        write_logits(path, &logits_shape, &logits)?;
    }
    Ok(RunResult {
        config,
        mesh,
        tokens,
        logits_shape,
        outcomes,
        check,
        tolerance,
        programs,
        native_kernels,
        execution,
        device,
    })
}

/// How ranks connect: a collective timeout of `timeout_s` seconds, over `link` if given.
pub fn link_options(timeout_s: u64, link: Option<LinkSpec>) -> ThreadRunOptions {
    ThreadRunOptions { timeout: Duration::from_secs(timeout_s), link }
}

/// Runs the programs on threads and assembles the logits.
pub fn run_programs(
    programs: &[Program],
    tokens: &Tokens,
    weights: &dyn WeightSource,
    options: &ThreadRunOptions,
) -> Result<(Vec<u64>, Vec<f32>, Vec<RankOutcome>)> {
    ensure_threads_fit(programs)?;
    run_programs_native(programs, tokens, weights, options, &[])
}

/// Refuses `programs` whose ranks, as threads of this process, need more memory than this machine
/// has available: their planned peaks (f32 buffers, weights included) add up.
pub(crate) fn ensure_threads_fit(programs: &[Program]) -> Result<()> {
    let needed =
        programs.iter().map(|program| plan(program, ElementSize::Fixed(4)).peak_bytes).fold(0u64, u64::saturating_add);
    crate::host_memory::ensure_available(&format!("running {} ranks' programs", programs.len()), needed)
}

/// As [`run_programs`], rank `i` calling `native[i]`'s kernels where it has them, for programs
/// [`ensure_threads_fit`] has let through.
fn run_programs_native(
    programs: &[Program],
    tokens: &Tokens,
    weights: &dyn WeightSource,
    options: &ThreadRunOptions,
    native: &[Option<NativeKernels>],
) -> Result<(Vec<u64>, Vec<f32>, Vec<RankOutcome>)> {
    let positions: Vec<u32> = (0..tokens.seq as u32).collect();
    let inputs = RunInputs { tokens: &tokens.ids, positions: &positions, weights, epoch: Instant::now() };
    let outcomes = run_on_threads_native(programs, &inputs, options, native)?;
    let (shape, logits) = assemble(&outcomes, 0).ok_or(UsageError::NoLogits)?;
    Ok((shape, logits, outcomes))
}

/// The larger of two errors, NaN when either is.
pub fn nan_max(left: f32, right: f32) -> f32 {
    if left.is_nan() || right.is_nan() {
        f32::NAN
    } else {
        left.max(right)
    }
}

/// The largest absolute elementwise difference (NaN if either holds a NaN).
pub fn max_abs_diff(left: &[f32], right: &[f32]) -> f32 {
    if left.len() != right.len() {
        return f32::NAN;
    }
    left.iter().zip(right).map(|(a, b)| (a - b).abs()).fold(0.0, nan_max)
}

const KINDS: [(CollectiveKind, &str); 6] = [
    (CollectiveKind::AllReduce, "all_reduce"),
    (CollectiveKind::ReduceScatter, "reduce_scatter"),
    (CollectiveKind::AllGather, "all_gather"),
    (CollectiveKind::Broadcast, "broadcast"),
    (CollectiveKind::SendRecv, "send"),
    (CollectiveKind::AllToAll, "all_to_all"),
];

/// Bytes sent by kind, averaged over ranks.
pub fn comm_bytes_mean(outcomes: &[RankOutcome]) -> BTreeMap<&'static str, u64> {
    let stats: Vec<&CommStats> = outcomes.iter().map(|outcome| &outcome.comm).collect();
    comm_stats_mean(&stats)
}

/// Bytes sent by kind, averaged over the ranks' statistics.
pub fn comm_stats_mean(stats: &[&CommStats]) -> BTreeMap<&'static str, u64> {
    KINDS
        .iter()
        .map(|&(kind, name)| {
            let total: u64 = stats.iter().map(|stats| stats.bytes(kind)).sum();
            (name, total / stats.len().max(1) as u64)
        })
        .collect()
}

/// Prints a forward run's report in `format`: `comm` names the communicator the ranks talked
/// over, `emulated_link` the link it was slowed to. `pleat rank`'s rank 0 prints the same.
pub fn report(format: Format, emulated_link: Option<LinkSpec>, comm: &str, result: &RunResult) -> Result<()> {
    let peaks: Vec<u64> = result.outcomes.iter().map(|outcome| outcome.peak_bytes).collect();
    match format {
        Format::Json => {
            let per_rank: Vec<_> = result
                .outcomes
                .iter()
                .map(|outcome| {
                    KINDS.iter().map(|&(kind, name)| (name, outcome.comm.bytes(kind))).collect::<BTreeMap<_, _>>()
                })
                .collect();
            let object = json!({
                "model": result.config.name,
                "mesh": result.mesh,
                "ranks": result.outcomes.len(),
                "batch": result.tokens.batch,
                "seq": result.tokens.seq,
                "logits_shape": result.logits_shape,
                "max_abs_err": result.check.and_then(|check| check.max_abs_err),
                "routing_ties": result.check.map(|check| check.ties_json()),
                "tolerance": result.tolerance,
                "peak_bytes_per_rank": peaks,
                "arena_bytes_per_rank": result.outcomes.iter().map(|outcome| outcome.arena_bytes).collect::<Vec<_>>(),
                "param_bytes_per_rank": result.outcomes.iter().map(|outcome| outcome.param_bytes).collect::<Vec<_>>(),
                "comm_bytes": comm_bytes_mean(&result.outcomes),
                "comm_bytes_per_rank": per_rank,
                "comm": comm,
                "emulated_link": emulated_link.map(|link| link.to_string()),
                "expert_load": expert_load(result).map(|(busiest, balanced)| json!({
                    "max_rows_per_rank": busiest,
                    "balanced_rows": balanced,
                })),
                "native_kernels_per_rank": result.native_kernels,
                "execution_per_rank": execution_names(result),
                "device": result.device.as_ref().map(DeviceReport::to_json),
            });
            crate::json_output::print(object)?;
        }
        Format::Text => {
            println!(
                "ran {} on {} {}rank(s) (mesh {}): batch {} x seq {}, logits {:?}",
                result.config.name,
                result.outcomes.len(),
                if comm == "mpi" { "MPI " } else { "" },
                if result.mesh.is_empty() { "none" } else { &result.mesh },
                result.tokens.batch,
                result.tokens.seq,
                result.logits_shape
            );
            println!(
                "peak bytes a rank: {}",
                peaks.iter().map(|peak| human_bytes(*peak)).collect::<Vec<_>>().join(", ")
            );
            if result.outcomes.iter().any(|outcome| outcome.arena_bytes > 0) {
                let arenas: Vec<String> =
                    result.outcomes.iter().map(|outcome| human_bytes(outcome.arena_bytes)).collect();
                println!("planned arena a rank (native code): {}", arenas.join(", "));
            }
            let comm: Vec<String> = comm_bytes_mean(&result.outcomes)
                .into_iter()
                .filter(|&(_, bytes)| bytes > 0)
                .map(|(name, bytes)| format!("{name} {}", human_bytes(bytes)))
                .collect();
            println!("sent a rank (mean): {}", if comm.is_empty() { "nothing".to_string() } else { comm.join(", ") });
            if result.native_kernels.iter().any(|&count| count > 0) {
                let counts: Vec<String> = result.native_kernels.iter().map(usize::to_string).collect();
                println!("native kernels (rank<i>.so) a rank: {}", counts.join(", "));
            }
            match &result.device {
                Some(report) => crate::device::describe(report).iter().for_each(|line| println!("{line}")),
                None => println!("execution a rank: {}", execution_names(result).join(", ")),
            }
            if let Some((busiest, balanced)) = expert_load(result) {
                let busiest: Vec<String> = busiest.iter().map(u64::to_string).collect();
                println!(
                    "expert load: the busiest expert a rank took {} token rows in a layer (balanced routing: {balanced:.1})",
                    busiest.join(", ")
                );
            }
            if let Some(check) = result.check {
                check.describe(result.tolerance).iter().for_each(|line| println!("{line}"));
            }
        }
    }
    Ok(())
}

/// For a mixture of experts: each rank's busiest expert's rows in one layer, and what every expert
/// would take under perfectly balanced routing (the tokens that reach one copy of an expert, times
/// top-k, over the experts).
fn expert_load(result: &RunResult) -> Option<(Vec<u64>, f64)> {
    let moe = result.config.moe.as_ref()?;
    let mesh = pleat_ir::Mesh::parse(&result.mesh).ok()?;
    // Axes that split the tokens among copies of the same experts: dp and cp, and tsp beside ep
    // (alone, tsp splits the experts themselves, and every token reaches its one copy).
    let tsp_copies = if mesh.degree(pleat_ir::AxisName::Ep) > 1 { mesh.degree(pleat_ir::AxisName::Tsp) } else { 1 };
    let copies = mesh.degree(pleat_ir::AxisName::Dp) * mesh.degree(pleat_ir::AxisName::Cp) * tsp_copies;
    let tokens = result.tokens.batch * result.tokens.seq / copies.max(1);
    let balanced = (tokens * moe.top_k) as f64 / moe.num_experts as f64;
    Some((result.outcomes.iter().map(|outcome| outcome.max_expert_rows).collect(), balanced))
}

/// Bytes in KiB/MiB/GiB, for people.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}
