//! `pleat compile`: shard a model over a mesh and write one program a rank: a forward pass, or with
//! `--train` a training step (`crate::compiled_dir` is the directory it writes).

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use pleat_backend::overlap::Prefetch;
use pleat_backend::Program;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::{Mesh, Module};
use pleat_passes::{Dump, PassCtx, PipelineReport};

use crate::compiled_dir::{write_compiled, CompiledFiles};
use crate::model_arg::{resolve, ModelSource};
use crate::train::{TrainPlanFlags, TrainingPlan};
use crate::usage::UsageError;

/// How the mesh's axes are used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Strategy {
    /// Each axis by its name: tp is Megatron tensor parallelism, tsp TSP, dp data parallelism, cp
    /// context parallelism (ring attention), ep expert parallelism (tokens sent to their experts'
    /// ranks by all-to-all).
    #[default]
    Auto,
    /// Megatron tensor parallelism on the tp axis.
    Tp,
    /// Megatron tensor parallelism with Korthikanti's sequence parallelism on the tp axis.
    TpSp,
    /// Sequence parallelism on the tp axis, and each block folded into TSP (weights broadcast or
    /// passed around a ring instead of tokens gathered) where the cost model finds it cheaper:
    /// egg's `fold-tp-sp-into-tsp` rules. Inference only.
    TpSpOrTsp,
    /// Tensor-and-sequence parallelism on the tsp axis.
    Tsp,
    /// Data parallelism on the dp axis.
    Dp,
    /// Context parallelism (ring attention over a zigzag sequence split) on the cp axis.
    Cp,
    /// Expert parallelism (on ep, or on tsp without ep) with the all-gather token dispatcher: each
    /// rank's tokens all-gathered over that axis before the experts, their partial sums reduce-scattered after, instead
    /// of the default all-to-all that sends each token only to its experts' ranks.
    EpAllGather,
}

impl Strategy {
    /// Checks the mesh has the strategy's axis and says what the passes should do.
    pub fn pass_ctx(self, mesh: &Mesh, dump: Dump) -> Result<PassCtx> {
        self.check_axis(mesh)?;
        Ok(PassCtx {
            dump,
            sequence_parallel: matches!(self, Strategy::TpSp | Strategy::TpSpOrTsp),
            fold_into_tsp: self == Strategy::TpSpOrTsp,
            expert_all_gather: self == Strategy::EpAllGather,
            ..PassCtx::default()
        })
    }

    /// Checks that `mesh` has an axis the strategy works on.
    pub fn check_axis(self, mesh: &Mesh) -> Result<()> {
        // The axes that can carry the strategy; the first is the one the error suggests.
        let axes: &[&'static str] = match self {
            Strategy::Auto => &[],
            Strategy::Tp | Strategy::TpSp | Strategy::TpSpOrTsp => &["tp"],
            Strategy::Tsp => &["tsp"],
            Strategy::Dp => &["dp"],
            Strategy::Cp => &["cp"],
            // Experts are placed over ep, or over tsp when the mesh has no ep.
            Strategy::EpAllGather => &["ep", "tsp"],
        };
        if let Some(&axis) = axes.first() {
            if !mesh.axes().iter().any(|mesh_axis| axes.contains(&mesh_axis.name.as_str())) {
                anyhow::bail!(UsageError::StrategyNeedsAxis { strategy: self.name(), axis });
            }
        }
        Ok(())
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Tp => "tp",
            Strategy::TpSp => "tp-sp",
            Strategy::TpSpOrTsp => "tp-sp-or-tsp",
            Strategy::Tsp => "tsp",
            Strategy::Dp => "dp",
            Strategy::Cp => "cp",
            Strategy::EpAllGather => "ep-all-gather",
        }
    }
}

/// `--seq` when none is given.
pub const DEFAULT_SEQ: u64 = 64;
/// `--batch` when none is given.
pub const DEFAULT_BATCH: u64 = 8;

/// What to compile: a model, the mesh and how to use it, and the input size. Shared by the
/// commands that compile before they work (`compile`, `explain`, `trace`).
#[derive(Args)]
pub struct ModelOnMesh {
    /// A preset name, a config.json, or a model directory.
    pub model: String,
    /// The device mesh, e.g. `tp=4`, `tsp=2`, `cp=4` or `dp=2,tp=2`.
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// How to use the mesh's axes.
    #[arg(long, value_enum, default_value_t = Strategy::Auto)]
    pub strategy: Strategy,
    /// Sequence length.
    #[arg(long, default_value_t = DEFAULT_SEQ)]
    pub seq: u64,
    /// Sequences a batch.
    #[arg(long, default_value_t = DEFAULT_BATCH)]
    pub batch: u64,
    /// Keep every transfer blocking where lowering put it, instead of scheduling transfers to run
    /// beside compute (`pleat_backend::overlap`).
    #[arg(long)]
    pub no_overlap: bool,
    /// The communication streams a rank of the runtime the programs are for has: 2 (the threads
    /// runtime, and MPI with `MPI_THREAD_MULTIPLE`) prefetches weights on a second stream beside
    /// the first; 1 (an MPI library that only serializes calls) prefetches them on the one stream
    /// while it is idle, since a prefetch queued ahead of a transfer there would delay it.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub comm_streams: u8,
}

impl ModelOnMesh {
    /// Where the overlap scheduler puts weight prefetches, for `--comm-streams`.
    pub fn prefetch(&self) -> Prefetch {
        if self.comm_streams == 2 {
            Prefetch::OwnStream
        } else {
            Prefetch::MainStream
        }
    }

    /// The model's configuration; `command` names who refuses a compiled directory.
    pub fn config(&self, command: &str) -> Result<ModelConfig> {
        Ok(self.config_and_weights(command)?.0)
    }

    /// The model's configuration and the weights beside it (a model directory's, as an absolute
    /// path, which `plan.json` records); `command` names who refuses a compiled directory.
    pub fn config_and_weights(&self, command: &str) -> Result<(ModelConfig, Option<std::path::PathBuf>)> {
        match resolve(&self.model)? {
            ModelSource::Config { config, weights } => {
                Ok((*config, weights.map(|path| std::fs::canonicalize(&path).unwrap_or(path))))
            }
            ModelSource::Compiled(_) => {
                anyhow::bail!(UsageError::CompiledNotAccepted {
                    model: self.model.clone(),
                    command: command.to_string()
                })
            }
        }
    }

    /// Compiles `config` as these arguments say.
    pub fn compile(&self, config: &ModelConfig, dump: Dump, kernels: Kernels) -> Result<Compiled> {
        let mesh = Mesh::parse(&self.mesh)?;
        let mut compiled = compile_model(config, self.batch, self.seq, &mesh, self.strategy, dump, kernels)?;
        compiled.programs = crate::predict::overlap_for_cpu(compiled.programs, self.no_overlap, self.prefetch())?;
        Ok(compiled)
    }
}

/// Arguments of `pleat compile`.
#[derive(Args)]
pub struct CompileArgs {
    /// The model, mesh, strategy and input size.
    #[command(flatten)]
    pub target: ModelOnMesh,
    /// The directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Print the IR after this pass (repeatable): fold-tsp, fold-cp, propagate-specs,
    /// rewrite-collectives; with --train also vocab-parallel-loss, zero-partition, differentiate.
    #[arg(long)]
    pub dump_after: Vec<String>,
    /// A plan from `pleat search --emit-plan`: its mesh, strategy, sequence length and one
    /// micro-batch of every replica replace --mesh, --strategy, --seq and --batch.
    /// With --train, its micro-batches, ZeRO stage and recomputation replace those flags too,
    /// and the batch is every micro-batch's.
    #[arg(long, conflicts_with_all = ["mesh", "strategy", "seq", "batch", "zero", "recompute", "micro_batches"])]
    pub plan: Option<PathBuf>,
    /// Also write native code for each rank (repeatable), as `DIR/rank<i>.<ext>`: its elementwise and
    /// row-wise kernels and an entry function that runs the whole program; `so` is what
    /// `pleat run DIR` and `pleat launch DIR` load. Needs the `llvm` feature.
    #[arg(long, value_enum)]
    pub emit: Vec<crate::native::Emit>,
    /// The CPU native code is generated for, in LLVM's names (e.g. `skylake`, `x86-64-v3`);
    /// default: this machine's.
    #[arg(long, requires = "emit")]
    pub target_cpu: Option<String>,
    /// The element type of the ranks' weights, activations and gradients, as `pleat run
    /// --precision` takes it (default f32, whatever the config's `torch_dtype`), so that `pleat run
    /// DIR` runs what `pleat run MODEL` would.
    #[arg(long, value_enum)]
    pub precision: Option<crate::run::Precision>,
    /// Compile a training step instead of the forward pass: forward, next-token cross-entropy and
    /// backward a step, the gradients reduced as the mesh needs, and each rank's optimizer layout
    /// (which blocks its AdamW updates and keeps moments for). `pleat run DIR --train` trains it.
    #[arg(long)]
    pub train: bool,
    /// The training step's ZeRO stage, recomputation, buckets, micro-batches and pipeline schedule.
    #[command(flatten)]
    pub training: TrainPlanFlags,
}

/// A sharded module and its programs.
pub struct Compiled {
    pub sharded: Module,
    pub programs: Vec<Program>,
    pub report: PipelineReport,
}

/// Which kernels the programs are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// The runtime's interpreted kernels, one an op: the programs the cost model describes.
    Interpreted,
    /// Native code (`--emit`, `--native`): the graph is fused first (`pleat_passes::fuse`).
    Native,
}

/// Runs `fuse` on a sharded module when the programs are for native code; its dumps join `report`'s.
pub fn fuse_for(
    kernels: Kernels,
    module: &mut pleat_ir::Module,
    ctx: &pleat_passes::PassCtx,
    report: Option<&mut pleat_passes::PipelineReport>,
) -> Result<()> {
    if kernels == Kernels::Native {
        let fused = pleat_passes::run_pipeline(&[pleat_passes::fuse::FUSE], module, ctx)?;
        if let Some(report) = report {
            report.dumps.extend(fused.dumps);
        }
    }
    Ok(())
}

/// Builds `config`'s forward graph, shards it over `mesh` (fusing it for native `kernels`) and
/// lowers it to per-rank programs, every transfer blocking (`crate::predict::overlap_programs`
/// schedules them).
pub fn compile_model(
    config: &ModelConfig,
    batch: u64,
    seq: u64,
    mesh: &Mesh,
    strategy: Strategy,
    dump: Dump,
    kernels: Kernels,
) -> Result<Compiled> {
    let ctx = strategy.pass_ctx(mesh, dump)?;
    let mut module = pleat_ir::model::build(config, batch, seq)?;
    module.mesh = mesh.clone();
    let mut report = pleat_passes::run_pipeline(pleat_passes::SHARD_PIPELINE, &mut module, &ctx)?;
    fuse_for(kernels, &mut module, &ctx, Some(&mut report))?;
    let programs = pleat_backend::lower(&module)?;
    pleat_backend::verify_collectives(&programs)?;
    Ok(Compiled { sharded: module, programs, report })
}

/// Runs `pleat compile`.
pub fn compile(args: &CompileArgs) -> Result<()> {
    crate::checkpoint::check_output_dir(&args.out, "plan.json", "--out")?;
    let planned = args.plan.as_deref().map(|plan| planned_target(&args.target.model, plan, args.train)).transpose()?;
    let target = planned.as_ref().unwrap_or(&args.target);
    let (model_config, weights) = target.config_and_weights("compile")?;
    let config = args.precision.unwrap_or_default().apply(&model_config);
    if args.train && args.emit.contains(&crate::native::Emit::Exe) {
        anyhow::bail!(UsageError::ExecutablesOfTraining);
    }
    crate::native::check_available(&args.emit)?;
    crate::native::check_target_cpu(args.target_cpu.as_deref())?;
    let dump = if args.dump_after.is_empty() { Dump::Nothing } else { Dump::After(args.dump_after.clone()) };
    let kernels = if args.emit.is_empty() { Kernels::Interpreted } else { Kernels::Native };
    if args.train {
        return compile_training_dir(args, target, (&config, weights), dump, kernels);
    }
    let mut compiled = target.compile(&config, dump, kernels)?;
    if !args.emit.is_empty() {
        crate::native::schedule(&mut compiled.programs);
    }
    for (pass, text) in &compiled.report.dumps {
        println!("; after {pass}\n{text}");
    }
    let files = CompiledFiles {
        weights,
        ..CompiledFiles::forward(&config, &compiled, (target.batch, target.seq), target.strategy.name())
    };
    let written = write_compiled(&args.out, &files, emit_for(args, &compiled.programs))?;
    report_compiled(args, &config, &files, &written, "rank programs")
}

/// `pleat compile --train`: compiles a training step and writes it with each rank's optimizer
/// layout, the programs bucketed and scheduled as `pleat run --train` runs them.
fn compile_training_dir(
    args: &CompileArgs,
    target: &ModelOnMesh,
    (config, weights): (&ModelConfig, Option<std::path::PathBuf>),
    dump: Dump,
    kernels: Kernels,
) -> Result<()> {
    let training = match &args.plan {
        Some(path) => planned_training(&args.training, path)?,
        None => args.training.plan(),
    };
    let mesh = Mesh::parse(&target.mesh)?;
    let shape = (target.batch, target.seq);
    let mut compiled = crate::train::compile_training(config, shape, &mesh, target.strategy, &training, kernels, dump)?;
    // A pipelined step's programs keep the lowered order its step spans describe.
    if compiled.step_spans.is_empty() {
        compiled.programs = crate::train::bucket_and_schedule(
            &compiled.programs,
            training.bucket_mb,
            target.no_overlap,
            target.prefetch(),
        )?;
    }
    if !args.emit.is_empty() {
        crate::native::schedule(&mut compiled.programs);
    }
    for (pass, text) in &compiled.dumps {
        println!("; after {pass}\n{text}");
    }
    let files = CompiledFiles {
        config,
        module: &compiled.module,
        programs: &compiled.programs,
        mesh: mesh.to_string(),
        batch: target.batch,
        seq: target.seq,
        strategy: target.strategy.name(),
        training: Some((&training, &compiled.layouts)),
        weights,
    };
    let written = write_compiled(&args.out, &files, emit_for(args, &compiled.programs))?;
    report_compiled(args, config, &files, &written, "rank training programs")
}

/// What writes `args`' `--emit` artifacts of `programs` into a directory (the compiled one's
/// staging), returning their file names.
fn emit_for<'a>(args: &'a CompileArgs, programs: &'a [Program]) -> impl FnOnce(&Path) -> Result<Vec<String>> + 'a {
    move |dir| crate::native::emit(programs, &args.emit, args.target_cpu.as_deref(), dir)
}

/// Prints what `compile` wrote: the plan's hash and the `--emit` artifacts.
fn report_compiled(
    args: &CompileArgs,
    config: &ModelConfig,
    files: &CompiledFiles,
    (plan_hash, emitted): &(String, Vec<String>),
    what: &str,
) -> Result<()> {
    println!(
        "compiled {} for {} into {}: {} {what}, plan hash {}",
        config.name,
        if files.mesh.is_empty() { "one rank" } else { &files.mesh },
        args.out.display(),
        files.programs.len(),
        plan_hash
    );
    if !args.emit.is_empty() {
        println!("native kernels: {}", emitted.join(", "));
    }
    Ok(())
}

/// `model` on the mesh, strategy and input size the search plan file at `path` names (the model
/// comes from the command line, so that a small stand-in can be compiled for a large model's plan).
/// With `training`, the batch is every micro-batch's.
fn planned_target(model: &str, path: &Path, training: bool) -> Result<ModelOnMesh> {
    let choice = crate::search::PlanChoice::read(path)?;
    let strategy = <Strategy as clap::ValueEnum>::from_str(&choice.strategy, true)
        .map_err(|_| UsageError::UnknownPlanStrategy { path: path.to_path_buf(), strategy: choice.strategy.clone() })?;
    Ok(ModelOnMesh {
        model: model.to_string(),
        mesh: choice.mesh,
        strategy,
        seq: choice.seq,
        batch: choice.micro_batch * choice.dp * if training { choice.micro_batches } else { 1 },
        no_overlap: false,
        comm_streams: 2,
    })
}

/// The training plan of a search plan file at `path`: its micro-batches, ZeRO stage and
/// recomputation, the rest from `flags`.
fn planned_training(flags: &TrainPlanFlags, path: &Path) -> Result<TrainingPlan> {
    let choice = crate::search::PlanChoice::read(path)?;
    let recompute =
        <crate::train::RecomputeArg as clap::ValueEnum>::from_str(&choice.recompute, true).map_err(|_| {
            UsageError::NotAPlan {
                path: path.to_path_buf(),
                what: "search plan",
                reason: format!("unknown recompute mode {:?}", choice.recompute),
            }
        })?;
    let micro_batches = u32::try_from(choice.micro_batches).map_err(|_| UsageError::NotAPlan {
        path: path.to_path_buf(),
        what: "search plan",
        reason: format!("{} micro-batches", choice.micro_batches),
    })?;
    Ok(TrainingPlan { zero: choice.zero, recompute, micro_batches, ..flags.plan() })
}
