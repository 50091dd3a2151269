//! `pleat plan`: memory, communication and time a rank for a model on a mesh, from the cost model
//! (closed formulas only: no graph is built, so any model size answers at once).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use pleat_ir::Mesh;
use pleat_passes::cost::memory::ExpertMemory;
use pleat_passes::cost::{estimate, Estimate, HardwareSpec, Layout, Mode, ModelShape, Recompute, Workload};

use crate::compile::Strategy;
use crate::model_arg::{resolve, ModelSource};

/// Output formats of `plan`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum PlanFormat {
    Table,
    Json,
}

/// `--recompute`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum RecomputeArg {
    None,
    Selective,
    Full,
}

impl From<RecomputeArg> for Recompute {
    fn from(value: RecomputeArg) -> Recompute {
        match value {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Selective => Recompute::Selective,
            RecomputeArg::Full => Recompute::Full,
        }
    }
}

/// What `plan` and `compare` share: the model, the workload and the hardware.
#[derive(Args, Clone)]
pub struct WorkloadArgs {
    /// A preset name, a config.json, or a model directory.
    pub model: String,
    /// Sequences a micro-batch, per model replica (per dp×ep rank for a mixture of experts: ep
    /// splits the batch as dp does).
    #[arg(long, default_value_t = 1, value_parser = crate::number_flags::count::<u64>)]
    pub batch: u64,
    /// Micro-batches a step, per replica (gradient accumulation; pipeline micro-batches).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: u64,
    /// Built-in hardware: h100-sxm, h200, a100-80gb, mi300x, cpu.
    #[arg(long, default_value = "h100-sxm")]
    pub hw: String,
    /// A hardware spec as TOML or JSON (the fields of the built-in table); overrides --hw.
    #[arg(long)]
    pub hw_file: Option<PathBuf>,
    /// Training (the default): forward, backward, mixed-precision Adam.
    #[arg(long, conflicts_with = "infer")]
    pub train: bool,
    /// Inference: one forward pass keeping the KV cache.
    #[arg(long)]
    pub infer: bool,
    /// ZeRO stage (0-3), over the ranks that replicate the parameters: dp, cp and ep.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Megatron's distributed optimizer (optimizer state over dp, like ZeRO-1).
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// Activation recompute.
    #[arg(long, value_enum, default_value_t = RecomputeArg::None)]
    pub recompute: RecomputeArg,
    /// Keep gradients in the weights' dtype (16 bytes a parameter instead of Megatron's 18).
    #[arg(long)]
    pub bf16_grads: bool,
    /// Materialize the attention scores (no flash attention).
    #[arg(long)]
    pub no_flash: bool,
    /// Interleaved pipeline: model chunks a rank (`--chunks`, as `run` and `schedule` name it).
    #[arg(long, visible_alias = "chunks", default_value_t = 1)]
    pub virtual_stages: u64,
    /// TSP also shards the embedding and LM head over the tsp group.
    #[arg(long)]
    pub tsp_shard_embeddings: bool,
}

impl WorkloadArgs {
    /// The workload at sequence length `seq`.
    pub fn workload(&self, seq: u64) -> Workload {
        let mut workload =
            if self.infer { Workload::inference(seq, self.batch) } else { Workload::training(seq, self.batch) };
        workload.micro_batches = self.micro_batches;
        workload.recompute = self.recompute.into();
        workload.zero = self.zero;
        workload.distributed_optimizer = self.distributed_optimizer;
        workload.fp32_grads = !self.bf16_grads;
        workload.flash_attention = !self.no_flash;
        workload.virtual_stages = self.virtual_stages;
        workload.tsp_shards_embeddings = self.tsp_shard_embeddings;
        workload
    }

    /// The model's shape.
    pub fn model_shape(&self) -> Result<ModelShape> {
        model_shape_of(&self.model)
    }

    /// The hardware: the file when given, else the built-in name.
    pub fn hardware(&self) -> Result<HardwareSpec> {
        hardware_of(&self.hw, self.hw_file.as_deref())
    }
}

/// The shape of `model` (a preset, config.json, model or compiled directory).
pub fn model_shape_of(model: &str) -> Result<ModelShape> {
    let config = match resolve(model)? {
        ModelSource::Config { config, .. } => *config,
        ModelSource::Compiled(dir) => crate::model_arg::read_config(&dir.join("config.json"))?,
    };
    Ok(ModelShape::from_config(&config))
}

/// The hardware: `file` when given, else the built-in `name`.
pub fn hardware_of(name: &str, file: Option<&Path>) -> Result<HardwareSpec> {
    match file {
        Some(path) => read_hardware(path),
        None => Ok(HardwareSpec::builtin(name)?),
    }
}

fn read_hardware(path: &Path) -> Result<HardwareSpec> {
    let text = crate::text_file::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
    let name = path.display().to_string();
    let spec = if path.extension().is_some_and(|ext| ext == "json") {
        HardwareSpec::from_json_str(&text, &name)?
    } else {
        HardwareSpec::from_toml_str(&text, &name)?
    };
    Ok(spec)
}

/// `pleat plan --strategy`: the strategies of `run --strategy` whose layout the cost model prices
/// (`tp-sp-or-tsp` picks a layout a block as it compiles, and the cost model prices the experts'
/// all-to-all dispatcher only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum PlanStrategy {
    /// Each axis by its name: tp is Megatron tensor parallelism, tsp TSP, dp data parallelism, cp
    /// context parallelism, ep expert parallelism, pp pipeline parallelism.
    #[default]
    Auto,
    /// Megatron tensor parallelism on the tp axis.
    Tp,
    /// Megatron tensor parallelism with Korthikanti's sequence parallelism on the tp axis.
    TpSp,
    /// Tensor-and-sequence parallelism on the tsp axis.
    Tsp,
    /// Data parallelism on the dp axis.
    Dp,
    /// Context parallelism (ring attention) on the cp axis.
    Cp,
}

impl PlanStrategy {
    /// The compiler's strategy of the same name.
    fn strategy(self) -> Strategy {
        match self {
            PlanStrategy::Auto => Strategy::Auto,
            PlanStrategy::Tp => Strategy::Tp,
            PlanStrategy::TpSp => Strategy::TpSp,
            PlanStrategy::Tsp => Strategy::Tsp,
            PlanStrategy::Dp => Strategy::Dp,
            PlanStrategy::Cp => Strategy::Cp,
        }
    }
}

/// Arguments of `pleat plan`.
#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub common: WorkloadArgs,
    /// The device mesh, e.g. `tp=8`, `dp=128,pp=16,tp=8`, `tp=4,sp=2`, `tsp=8`.
    #[arg(long, default_value = "")]
    pub mesh: String,
    /// How to use the mesh's axes, as `run --strategy` (the layouts the cost model prices).
    #[arg(long, value_enum, default_value_t = PlanStrategy::Auto)]
    pub strategy: PlanStrategy,
    /// Megatron sequence parallelism on the tp axis (norms and residuals split on seq); the same
    /// as `--strategy tp-sp`.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 4096, value_parser = crate::number_flags::count::<u64>)]
    pub seq: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = PlanFormat::Table)]
    pub format: PlanFormat,
}

/// Runs `pleat plan`.
pub fn plan(args: &PlanArgs) -> Result<()> {
    let model = args.common.model_shape()?;
    let hw = args.common.hardware()?;
    let mesh = Mesh::parse(&args.mesh)?;
    args.strategy.strategy().check_axis(&mesh)?;
    let layout = Layout::from_mesh(&mesh, args.sequence_parallel || args.strategy == PlanStrategy::TpSp);
    let stages = layout.degree(pleat_ir::AxisName::Pp);
    let chunks = args.common.virtual_stages;
    if chunks > 1 && stages == 1 {
        bail!(crate::usage::UsageError::VirtualStagesWithoutPp { virtual_stages: chunks });
    }
    if chunks > 1 {
        // Cost only the interleaved schedules `run` and `schedule` build.
        let virtual_stages = stages.saturating_mul(chunks);
        if virtual_stages > model.layers {
            bail!(crate::usage::UsageError::TooFewLayersForChunks {
                model: model.name.clone(),
                stages,
                chunks,
                virtual_stages,
                layers: model.layers,
            });
        }
        // Fewer virtual stages than layers: each count fits a u32.
        let kind = pleat_passes::pipeline::ScheduleKind::Interleaved { chunks: chunks as u32 };
        let micro_batches = u32::try_from(args.common.micro_batches).unwrap_or(u32::MAX);
        pleat_passes::pipeline::Schedule::build(kind, stages as u32, micro_batches)?;
    }
    let result = estimate(&model, &layout, &args.common.workload(args.seq), &hw)?;
    let mut report = serde_json::to_value(&result)?;
    // The estimate is a pure function of the model, mesh, workload and hardware: its fingerprint
    // shows that the same inputs give the same plan.
    let hash = crate::fingerprint::Fingerprint::new().part(serde_json::to_string(&report)?.as_bytes()).hex();
    match args.format {
        PlanFormat::Json => {
            report["plan_hash"] = serde_json::Value::String(hash);
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        PlanFormat::Table => {
            print_table(&result);
            println!("plan hash {hash}");
        }
    }
    for warning in &result.warnings {
        eprintln!("warning: {warning}");
    }
    Ok(())
}

/// A mixture of experts' split of the memory line `name` (of `bytes`): weights by component, the
/// routed experts' gradients and optimizer state against the rest (ZeRO shards them over different
/// groups), the experts' kept activations.
fn expert_terms(experts: &ExpertMemory, name: &str, bytes: f64) -> Vec<(&'static str, f64)> {
    match name {
        "params" => experts.weights.iter().map(|term| (term.name, term.bytes)).collect(),
        "grads" | "optimizer" if bytes > 0.0 => {
            let routed = if name == "grads" { experts.expert_grads_bytes } else { experts.expert_optimizer_bytes };
            vec![
                ("routed experts (zero shards them over dp x cp)", routed),
                ("the rest (zero shards it over dp x cp x ep)", bytes - routed),
            ]
        }
        "activations" if bytes > 0.0 => experts.activations.iter().map(|term| (term.name, term.bytes)).collect(),
        _ => Vec::new(),
    }
}

/// A parameter count for people: `46.70B`, `1.34M`, `5120`.
fn count(params: u64) -> String {
    match params as f64 {
        billions if billions >= 1e9 => format!("{:.2}B", billions / 1e9),
        millions if millions >= 1e6 => format!("{:.2}M", millions / 1e6),
        _ => params.to_string(),
    }
}

/// Gigabytes (10^9 bytes), for people.
pub fn gb(bytes: f64) -> String {
    // `+ 0.0` turns the -0.0 of an empty sum into 0.0.
    format!("{:.2} GB", bytes / 1e9 + 0.0)
}

fn print_table(result: &Estimate) {
    let workload = &result.workload;
    println!(
        "{} on {} ({} ranks, {}), {:?}: seq {} x batch {} x {} micro-batches, recompute {}, zero {}",
        result.model,
        result.layout,
        result.world_size,
        result.hardware,
        workload.mode,
        workload.seq,
        workload.micro_batch,
        workload.micro_batches,
        workload.recompute.as_str(),
        workload.zero
    );
    if let Some(experts) = &result.experts {
        println!(
            "parameters: {}, {} active a token ({} of {} experts a layer, {} a rank)",
            count(experts.param_count),
            count(experts.active_param_count),
            experts.top_k,
            experts.experts,
            experts.experts_per_rank
        );
    }
    let memory = &result.memory;
    println!("memory a rank (stage {}):", memory.stage);
    for (name, bytes) in [
        ("params", memory.params_bytes),
        ("grads", memory.grads_bytes),
        ("optimizer", memory.optimizer_bytes),
        ("activations", memory.activations_bytes),
        ("transient", memory.transient_bytes),
        ("logits", memory.logits_bytes),
    ] {
        println!("  {name:<12} {:>12}", gb(bytes));
        if let Some(experts) = &memory.experts {
            for (term, bytes) in expert_terms(experts, name, bytes) {
                println!("    {term:<52} {:>12}", gb(bytes));
            }
        }
    }
    for term in &memory.transients {
        println!("    {:<52} {:>12}", term.name, gb(term.bytes));
    }
    println!("  {:<12} {:>12}  (device {})", "peak", gb(memory.peak_bytes), gb(memory.device_bytes));
    if result.stages.len() > 1 {
        println!("per stage (layers, in-flight micro-batches, peak):");
        for stage in &result.stages {
            println!(
                "  stage {:>3}: {:>3} layers, {:>5.2} in flight, {}",
                stage.stage,
                stage.layers,
                stage.in_flight,
                gb(stage.peak_bytes)
            );
        }
    }
    let comm = &result.comm;
    println!(
        "comm a rank: {} a layer forward ({:.3e} elements, {:.3} ms), {} a step",
        gb(comm.bytes_per_layer_fwd),
        comm.elements_per_layer_fwd,
        comm.seconds_per_layer_fwd * 1e3,
        gb(comm.bytes_per_step)
    );
    for (axis, bytes) in &comm.bytes_by_axis {
        println!("  axis {axis:<4} {:>12} a step", gb(*bytes));
    }
    if let Some(experts) = &result.experts {
        let gradients = if workload.mode == Mode::Train { ", their gradients" } else { "" };
        println!(
            "  expert all-to-all {:>12} a step, {:.4} s (dispatch and combine{gradients}, token counts)",
            gb(experts.all_to_all_bytes_per_step),
            experts.all_to_all_seconds_per_step
        );
        let load = &experts.load;
        println!(
            "expert load: {:.0} tokens an expert a layer and micro-batch, up to {:.0}; a step over all replicas \
             {:.0}, up to {:.0}",
            load.expected_tokens_per_rank,
            load.worst_tokens_per_rank,
            load.expected_tokens_per_step,
            load.worst_tokens_per_step
        );
        println!("  capacity: {}", experts.note);
    }
    let time = &result.time;
    println!(
        "time a step: compute {:.4} s + comm {:.4} s + bubble {:.4} s = {:.4} s",
        time.compute_s, time.comm_s, time.bubble_s, time.step_s
    );
    println!(
        "with overlap: compute {:.4} s + exposed comm {:.4} s + bubble {:.4} s = {:.4} s ({:.4} s of comm hidden behind compute)",
        time.compute_s,
        time.exposed_comm_s,
        time.bubble_s,
        time.overlapped_step_s,
        time.comm_s - time.exposed_comm_s
    );
    println!("throughput: {:.0} tokens/s, MFU {:.1}%", result.tokens_per_s, 100.0 * result.mfu);
}
