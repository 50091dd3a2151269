//! `pleat compile`: shard a model over a mesh and write one program a rank.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use pleat_backend::overlap::Prefetch;
use pleat_backend::Program;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::{Mesh, Module};
use pleat_passes::{Dump, PassCtx, PipelineReport};
use serde::{Deserialize, Serialize};

use crate::model_arg::{resolve, ModelSource};
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
    #[arg(long, default_value_t = 64)]
    pub seq: u64,
    /// Sequences a batch.
    #[arg(long, default_value_t = 8)]
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
        match resolve(&self.model)? {
            ModelSource::Config { config, .. } => Ok(*config),
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
    /// Print the IR after this pass (repeatable): fold-tsp, fold-cp, propagate-specs.
    #[arg(long)]
    pub dump_after: Vec<String>,
    /// A plan from `pleat search --emit-plan`: its mesh, strategy, sequence length and one
    /// micro-batch of every replica replace --mesh, --strategy, --seq and --batch.
    #[arg(long, conflicts_with_all = ["mesh", "strategy", "seq", "batch"])]
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
}

/// The version of `plan.json`.
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// `plan.json`: what a compiled directory holds, for `pleat run DIR`.
#[derive(Serialize, Deserialize)]
pub struct PlanFile {
    /// `PLAN_FORMAT_VERSION`.
    pub format_version: u32,
    /// The model's name.
    pub model: String,
    /// The mesh.
    pub mesh: String,
    /// The `--strategy` it was compiled with.
    pub strategy: String,
    /// Ranks (one `rank<i>.program` each).
    pub ranks: u32,
    /// Sequences a batch.
    pub batch: u64,
    /// Sequence length.
    pub seq: u64,
    /// `program format` of the rank files.
    pub program_format_version: u32,
    /// The plan's fingerprint: the sharded module's text and every rank's program (`write_compiled`);
    /// reading the directory checks it.
    pub plan_hash: String,
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
    let planned = args.plan.as_deref().map(|plan| planned_target(&args.target.model, plan)).transpose()?;
    let target = planned.as_ref().unwrap_or(&args.target);
    let config = args.precision.unwrap_or_default().apply(&target.config("compile")?);
    crate::native::check_available(&args.emit)?;
    crate::native::check_target_cpu(args.target_cpu.as_deref())?;
    let dump = if args.dump_after.is_empty() { Dump::Nothing } else { Dump::After(args.dump_after.clone()) };
    let kernels = if args.emit.is_empty() { Kernels::Interpreted } else { Kernels::Native };
    let mut compiled = target.compile(&config, dump, kernels)?;
    if !args.emit.is_empty() {
        crate::native::schedule(&mut compiled.programs);
    }
    for (pass, text) in &compiled.report.dumps {
        println!("; after {pass}\n{text}");
    }
    let plan_hash = write_compiled(&args.out, &config, &compiled, target.batch, target.seq, target.strategy.name())?;
    let mesh = &compiled.sharded.mesh;
    println!(
        "compiled {} for {} into {}: {} rank programs, plan hash {}",
        config.name,
        if mesh.axes().is_empty() { "one rank".to_string() } else { mesh.to_string() },
        args.out.display(),
        compiled.programs.len(),
        plan_hash
    );
    if !args.emit.is_empty() {
        let written = crate::native::emit(&compiled.programs, &args.emit, args.target_cpu.as_deref(), &args.out)?;
        println!("native kernels: {}", written.join(", "));
    }
    Ok(())
}

/// `model` on the mesh, strategy and input size the search plan file at `path` names (the model
/// comes from the command line, so that a small stand-in can be compiled for a large model's plan).
fn planned_target(model: &str, path: &Path) -> Result<ModelOnMesh> {
    let choice = crate::search::PlanChoice::read(path)?;
    let strategy = <Strategy as clap::ValueEnum>::from_str(&choice.strategy, true)
        .map_err(|_| UsageError::UnknownPlanStrategy { path: path.to_path_buf(), strategy: choice.strategy.clone() })?;
    Ok(ModelOnMesh {
        model: model.to_string(),
        mesh: choice.mesh,
        strategy,
        seq: choice.seq,
        batch: choice.micro_batch * choice.dp,
        no_overlap: false,
        comm_streams: 2,
    })
}

/// Writes the compiled directory into a temporary sibling, then renames it into place, so an
/// interrupted compile never leaves a half-written directory. Returns the plan's fingerprint:
/// FNV-1a over the bytes of `module.pleat` and of every `rank<i>.program` as written, which
/// `read_compiled` checks. Equal plans, byte for byte, have equal hashes.
pub(crate) fn write_compiled(
    out: &Path,
    config: &ModelConfig,
    compiled: &Compiled,
    batch: u64,
    seq: u64,
    strategy_name: &str,
) -> Result<String> {
    let module_text = pleat_ir::text::print_module(&compiled.sharded);
    let program_texts: Vec<String> = compiled.programs.iter().map(pleat_backend::to_json).collect();
    let mut fingerprint = crate::fingerprint::Fingerprint::new();
    fingerprint.part(module_text.as_bytes());
    for text in &program_texts {
        fingerprint.part(text.as_bytes());
    }
    let plan_hash = fingerprint.hex();
    let plan = PlanFile {
        format_version: PLAN_FORMAT_VERSION,
        model: config.name.clone(),
        mesh: compiled.sharded.mesh.to_string(),
        strategy: strategy_name.to_string(),
        ranks: compiled.programs.len() as u32,
        batch,
        seq,
        program_format_version: pleat_backend::FORMAT_VERSION,
        plan_hash: plan_hash.clone(),
    };
    crate::checkpoint::write_dir_atomically(out, "plan.json", |staging| {
        std::fs::write(staging.join("plan.json"), serde_json::to_string_pretty(&plan)?)?;
        std::fs::write(staging.join("config.json"), config.to_hf_json())?;
        std::fs::write(staging.join("module.pleat"), module_text)?;
        for (program, text) in compiled.programs.iter().zip(program_texts) {
            std::fs::write(staging.join(format!("rank{}.program", program.rank)), text)?;
            std::fs::write(
                staging.join(format!("rank{}.txt", program.rank)),
                pleat_backend::text::print_program(program),
            )?;
        }
        Ok(())
    })?;
    Ok(plan_hash)
}

/// Reads a compiled directory back: its plan, config and programs.
pub fn read_compiled(dir: &Path) -> Result<(PlanFile, ModelConfig, Vec<Program>)> {
    let plan_path = dir.join("plan.json");
    let plan: PlanFile = serde_json::from_str(
        &std::fs::read_to_string(&plan_path).with_context(|| format!("cannot read {}", plan_path.display()))?,
    )
    .map_err(|error| UsageError::NotAPlan { path: plan_path.clone(), what: "plan", reason: error.to_string() })?;
    if plan.format_version != PLAN_FORMAT_VERSION {
        anyhow::bail!(UsageError::PlanFormatVersion {
            path: plan_path,
            found: plan.format_version,
            expected: PLAN_FORMAT_VERSION
        });
    }
    let config = crate::model_arg::read_config(&dir.join("config.json"))?;
    // The hash covers the files as written (`write_compiled`): a damaged or edited directory is
    // refused before anything runs.
    let mut fingerprint = crate::fingerprint::Fingerprint::new();
    let module_path = dir.join("module.pleat");
    let unreadable = |path: &Path, error: std::io::Error| UsageError::CompiledFileUnreadable {
        path: path.to_path_buf(),
        reason: error.to_string(),
    };
    fingerprint.part(&std::fs::read(&module_path).map_err(|error| unreadable(&module_path, error))?);
    let programs = (0..plan.ranks)
        .map(|rank| {
            let path = dir.join(format!("rank{rank}.program"));
            let text = std::fs::read_to_string(&path).map_err(|error| unreadable(&path, error))?;
            fingerprint.part(text.as_bytes());
            pleat_backend::from_json(&text).with_context(|| format!("{}", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    if fingerprint.hex() != plan.plan_hash {
        anyhow::bail!(UsageError::PlanHashMismatch {
            path: plan_path,
            recorded: plan.plan_hash,
            actual: fingerprint.hex()
        });
    }
    Ok((plan, config, programs))
}
