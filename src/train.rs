//! `pleat run --train`: compile the training graph (forward, loss, backward) for a mesh, train on
//! threads with the sharded AdamW, and with `--check` compare against the single-device reference.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use pleat_backend::bucket::bucket_gradient_reductions;
use pleat_backend::memory::{plan, ElementSize};
use pleat_backend::optimizer::{optimizer_layout, OptimizerLayout};
use pleat_backend::overlap::Prefetch;
use pleat_backend::Program;
use pleat_ir::interp::ParamLookup;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::model::stream::synthetic_tokens;
use pleat_ir::optim::{AdamW, AdamWConfig};
use pleat_ir::{AxisName, Mesh, Module};
use pleat_passes::autodiff::reference::{train_reference, ReferenceStart};
use pleat_passes::autodiff::Recompute;
use pleat_passes::Dump;
use pleat_runtime::train::{final_state, train_on_threads, AdamWSettings, RankTraining, TrainOptions};
use pleat_runtime::weights::{BlockWeights, WeightSource};
use pleat_runtime::{NativeKernels, OutputBlock};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::compile::Strategy;
use crate::device::{Device, DeviceReport, CUDA_F32_TOL};
use crate::model_arg::{resolve, ModelSource};
use crate::reference::{routing_tie_margin, BF16_ROUTING_TIE_MARGIN, ROUTING_TIE_MARGIN};
use crate::run::{comm_stats_mean, human_bytes, nan_max, weight_source, Format, Precision, RunArgs};
use crate::schedule::ScheduleName;
use crate::usage::UsageError;

/// The largest difference from the reference `--check` accepts on the losses (absolute) and on
/// each first-step gradient (relative to that gradient's L2 norm).
pub const TRAIN_TOL: f32 = 1e-4;

/// The updates' tolerance: how far each parameter's update may be from the one the reference's
/// AdamW makes of the run's own gradients from the run's own state, relative to that update
/// (`relative_update_error` says why relative and over the whole parameter). Measured at most
/// 1.6e-5 on tiny, tiny-moe and the tiny Qwen2-MoE (tp, dp with ZeRO-3, tsp, ep, pp×dp with
/// ZeRO-2, cp×tp; learning rates 1e-3 and 1e-1, 10 steps) and 2.3e-5 over 120 random f32 configs;
/// 1.7e-6 under bf16. A wrong update (a shard not updated, a wrong bias correction or clip) is a
/// share of order one.
pub const UPDATE_REL_TOL: f32 = 1e-3;

/// The later steps' gradients' tolerance in f32, relative to each gradient's norm: as the loss
/// falls the gradients shrink beside the activations whose rounding they carry, and the bound of
/// the first step widens (tiny at tp=2, lr 3e-2: 1e-6 at the first step, up to 9.6e-6 over 150
/// steps as the loss fell to 0.02). A gradient summed over two steps (a buffer not cleared) or
/// taken at stale weights is a share of order one.
pub const LATER_GRAD_REL_TOL: f32 = 1e-2;

/// The losses' and first-step gradients' (relative) tolerance under `--precision bf16`: four times
/// bf16's unit roundoff 2^-8; the losses' relative to the largest reference loss, at least 1
/// ([`CheckTolerances::scaled_to`]). Every stored activation, weight and gradient is rounded
/// to 8 significant bits, and so is the reference's (`pleat_ir::interp::run_as_stored`), so the
/// two differ by summation order and the last bits it flips. The updates, AdamW's of the run's
/// own gradients on its f32 master weights, are held to [`UPDATE_REL_TOL`] as in f32.
pub const BF16_TOL: f32 = 8.0 / 512.0;

/// What `--check` holds a training run to.
#[derive(Clone, Copy, Debug)]
pub struct CheckTolerances {
    /// The losses, absolute (at least `loss_share` of the largest reference loss, once
    /// [`CheckTolerances::scaled_to`] it).
    pub loss: f32,
    /// The share of the largest reference loss a loss may differ by where that is more than
    /// `loss`: rounding moves a loss by a share of its own size (f32's one unit in the last
    /// place of a loss of 4064 is 4.9e-4).
    pub loss_share: f32,
    /// The first step's gradients, relative to each gradient's norm.
    pub grad_rel: f32,
    /// The later steps' gradients, relative to each gradient's norm.
    pub later_grad_rel: f32,
    /// Each parameter's update, relative to AdamW's of the run's own gradients; `None` when
    /// reported only.
    pub update_rel: Option<f32>,
    /// The router-logit gap under which a step is at a routing tie (`crate::reference`).
    pub routing_tie: f64,
    /// Whether a step at a routing tie still has its loss judged. A token sent to another expert
    /// moves the step's mean loss by its share: measured at most 2e-3 on tiny-moe under bf16 (tp,
    /// tsp, cp, dp, ep at 2 and 4, three seeds), within bf16's tolerance and far outside f32's.
    /// Its gradients and update are never judged there: a token's share of one expert's gradient
    /// measured up to 2e-2 of its norm.
    pub loss_at_tie: bool,
}

impl CheckTolerances {
    /// The tolerances of a run at `precision`.
    pub fn new(precision: Precision) -> CheckTolerances {
        match precision {
            Precision::F32 => CheckTolerances {
                loss: TRAIN_TOL,
                // As the forward's logits: 1e-5 of the largest where that is more than 1e-4.
                loss_share: 1e-5,
                grad_rel: TRAIN_TOL,
                later_grad_rel: LATER_GRAD_REL_TOL,
                update_rel: Some(UPDATE_REL_TOL),
                routing_tie: ROUTING_TIE_MARGIN,
                loss_at_tie: false,
            },
            Precision::Bf16 => CheckTolerances {
                loss: BF16_TOL,
                loss_share: BF16_TOL,
                grad_rel: BF16_TOL,
                // tiny at tsp=2 over 150 steps: up to 8.4e-3, against 2.9e-3 at the first.
                later_grad_rel: 4.0 * BF16_TOL,
                update_rel: Some(UPDATE_REL_TOL),
                routing_tie: BF16_ROUTING_TIE_MARGIN,
                loss_at_tie: true,
            },
        }
    }

    /// These tolerances for a run whose reference losses are `reference_losses`: the losses'
    /// widened to `loss_share` of the largest of them where that is more. Under bf16 every logit
    /// is rounded to 8 bits of its own size, so a loss of 26 (large synthetic logits, tied tables)
    /// was measured 8e-3 off its reference on a dense model at tp=2, and 1.8e-2 off on a mixture
    /// at a routing tie, where 2^-6 absolute would fail both for rounding alone; in f32 a loss of
    /// 4064 (a diverging `--lr 10`) was one unit in the last place off, 4.9e-4.
    pub fn scaled_to(self, reference_losses: &[f32]) -> CheckTolerances {
        let largest = reference_losses.iter().fold(0.0f32, |largest, loss| largest.max(loss.abs()));
        CheckTolerances { loss: self.loss.max(self.loss_share * largest), ..self }
    }

    /// The tolerances of the same run on a GPU: f32's widened to the forward's GPU tolerance
    /// (`CUDA_F32_TOL`: the approximate `ex2`, `sin` and `cos` of the generated kernels and
    /// cuBLAS's summation order); bf16's already hold that. The updates are reported, not judged:
    /// no GPU run has measured them against the AdamW of their own gradients yet.
    pub fn on_cuda(self) -> CheckTolerances {
        CheckTolerances {
            loss: self.loss.max(CUDA_F32_TOL),
            grad_rel: self.grad_rel.max(CUDA_F32_TOL),
            later_grad_rel: self.later_grad_rel.max(CUDA_F32_TOL),
            update_rel: None,
            routing_tie: routing_tie_margin(true, true),
            ..self
        }
    }
}

/// `--recompute`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecomputeArg {
    /// Keep every activation the backward reads.
    #[default]
    None,
    /// Recompute the attention core in the backward (Korthikanti et al.).
    Selective,
    /// Keep only each layer's residual stream; recompute the rest in the backward.
    Full,
}

impl RecomputeArg {
    /// Its name as `--recompute` takes it.
    pub fn name(self) -> &'static str {
        match self {
            RecomputeArg::None => "none",
            RecomputeArg::Selective => "selective",
            RecomputeArg::Full => "full",
        }
    }
}

impl From<RecomputeArg> for Recompute {
    fn from(arg: RecomputeArg) -> Recompute {
        match arg {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Selective => Recompute::Selective,
            RecomputeArg::Full => Recompute::Full,
        }
    }
}

/// The flags of `pleat run` that train.
#[derive(Args, Clone)]
pub struct TrainFlags {
    /// Train instead of running the forward pass: forward, loss, backward and AdamW a step.
    #[arg(long)]
    pub train: bool,
    /// Training steps.
    #[arg(long, default_value_t = 10, requires = "train", value_parser = crate::number_flags::count::<u32>)]
    pub steps: u32,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 1e-3, requires = "train", value_parser = crate::number_flags::positive)]
    pub lr: f64,
    /// Clip the gradients to this global L2 norm (0: no clipping).
    #[arg(long, default_value_t = 1.0, requires = "train", value_parser = crate::number_flags::non_negative)]
    pub max_grad_norm: f64,
    /// Token ids to train on: integers separated by whitespace or commas; each step reads the next
    /// batch·seq of them, wrapping around. Without it, a deterministic synthetic stream.
    #[arg(long, requires = "train")]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub plan: TrainPlanFlags,
    /// After the last step, write a checkpoint here: each rank's blocks of the model and of the
    /// optimizer's moments, an index of them and the steps taken (also a model directory `pleat
    /// run` reads, on any mesh).
    #[arg(long, requires = "train")]
    pub save: Option<PathBuf>,
    /// Also write the --save checkpoint every this many steps (each write replaces the last one
    /// atomically), so that a killed run resumes from the last one.
    #[arg(long, requires = "save", value_parser = crate::number_flags::count::<u32>)]
    pub save_every: Option<u32>,
    /// Continue from a checkpoint `--save` wrote (on any mesh and ZeRO stage): its weights, moments
    /// and step count; `--steps` more steps are taken.
    #[arg(long, requires = "train")]
    pub resume: Option<PathBuf>,
}

/// The training flags that shape the compiled programs, which `pleat run --train` and `pleat
/// compile --train` take; a compiled directory keeps the values it was compiled with
/// ([`TrainingPlan`]). Unset, each takes the default its doc gives.
#[derive(Args, Clone, Default)]
pub struct TrainPlanFlags {
    /// ZeRO stage over the ranks that replicate the parameters (dp, cp, and ep for a mixture's
    /// dense ones): 1 splits the optimizer state, 2 also the gradients, 3 also the parameters.
    /// [default: 0]
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3), requires = "train")]
    pub zero: Option<u8>,
    /// Which activations the backward recomputes instead of keeping.
    /// [default: none]
    #[arg(long, value_enum, requires = "train")]
    pub recompute: Option<RecomputeArg>,
    /// Gradient buckets (MiB): the gradients' all-reduces over dp (reduce-scatters under ZeRO-2
    /// and 3) are merged into messages of up to this size, each sent once its last gradient exists
    /// (PyTorch DDP's bucket_cap_mb); 0 sends each gradient alone. Not applied to pipelined steps.
    /// [default: 25]
    #[arg(long, requires = "train")]
    pub bucket_mb: Option<u64>,
    /// Micro-batches a step: the batch is split into this many, whose gradients are summed (and,
    /// with a pp axis in --mesh, which flow through the pipeline stages).
    /// [default: 1]
    #[arg(long, requires = "train", value_parser = crate::number_flags::count::<u32>)]
    pub micro_batches: Option<u32>,
    /// The pipeline schedule (with a pp axis).
    /// [default: 1f1b]
    #[arg(long, value_enum, requires = "train")]
    pub schedule: Option<ScheduleName>,
    /// Model chunks a pipeline rank, for --schedule interleaved (default 2).
    #[arg(long, requires = "train", value_parser = crate::number_flags::count::<u32>)]
    pub chunks: Option<u32>,
    /// Layers a pipeline stage, first to last, e.g. 9,8,8,7 (with --schedule interleaved, a
    /// virtual stage: pp times --chunks counts); default: balanced by the cost model, the
    /// embedding counted on the first stage and the LM head and loss on the last.
    #[arg(long, requires = "train")]
    pub pp_layers: Option<String>,
}

impl TrainPlanFlags {
    /// The training plan these flags ask for, each unset flag at its default.
    pub fn plan(&self) -> TrainingPlan {
        TrainingPlan {
            zero: self.zero.unwrap_or(0),
            recompute: self.recompute.unwrap_or_default(),
            bucket_mb: self.bucket_mb.unwrap_or(25),
            micro_batches: self.micro_batches.unwrap_or(1),
            schedule: self.schedule.unwrap_or(ScheduleName::OneFOneB),
            chunks: self.chunks,
            pp_layers: self.pp_layers.clone(),
        }
    }

    /// Refuses a flag given with a value other than the compiled directory `dir`'s `plan`.
    pub fn check_against(&self, dir: &Path, plan: &TrainingPlan) -> Result<()> {
        let wanted = self.plan();
        // An unset --chunks or --pp-layers takes its default (2 chunks; layers balanced by cost).
        let set = |value: Option<String>| value.unwrap_or_else(|| "unset".to_string());
        let layers = |value: Option<&str>| match value {
            Some(text) => text.split(',').map(str::trim).collect::<Vec<_>>().join(","),
            None => "unset (balanced by the cost model)".to_string(),
        };
        let flags: [(&'static str, bool, String, String); 7] = [
            ("--zero", self.zero.is_some(), wanted.zero.to_string(), plan.zero.to_string()),
            ("--recompute", self.recompute.is_some(), wanted.recompute.name().into(), plan.recompute.name().into()),
            ("--bucket-mb", self.bucket_mb.is_some(), wanted.bucket_mb.to_string(), plan.bucket_mb.to_string()),
            (
                "--micro-batches",
                self.micro_batches.is_some(),
                wanted.micro_batches.to_string(),
                plan.micro_batches.to_string(),
            ),
            ("--schedule", self.schedule.is_some(), wanted.schedule.name().into(), plan.schedule.name().into()),
            (
                "--chunks",
                self.chunks.is_some(),
                set(wanted.chunks.map(|chunks| chunks.to_string())),
                set(plan.chunks.map(|chunks| chunks.to_string())),
            ),
            // Compared as lists: "1, 1,1" is "1,1,1".
            (
                "--pp-layers",
                self.pp_layers.is_some(),
                layers(wanted.pp_layers.as_deref()),
                layers(plan.pp_layers.as_deref()),
            ),
        ];
        for (flag, given, wanted, planned) in flags {
            if given && wanted != planned {
                bail!(UsageError::TrainFlagDiffersFromPlan { flag, given: wanted, planned, dir: dir.to_path_buf() });
            }
        }
        Ok(())
    }
}

/// How a training step was compiled: what [`TrainPlanFlags`] asked for, each at its value.
/// A compiled directory records it in `plan.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingPlan {
    /// `--zero`.
    pub zero: u8,
    /// `--recompute`.
    pub recompute: RecomputeArg,
    /// `--bucket-mb`.
    pub bucket_mb: u64,
    /// `--micro-batches`.
    pub micro_batches: u32,
    /// `--schedule`.
    pub schedule: ScheduleName,
    /// `--chunks`, as given.
    pub chunks: Option<u32>,
    /// `--pp-layers`, as given.
    pub pp_layers: Option<String>,
}

impl TrainingPlan {
    /// How the step is split into micro-batches and pipeline stages.
    pub fn pipelining(&self) -> Pipelining {
        Pipelining {
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            chunks: self.chunks,
            layers: self.pp_layers.clone(),
        }
    }
}

/// A compiled training plan.
pub struct CompiledTraining {
    pub module: Module,
    pub programs: Vec<Program>,
    pub layouts: Vec<OptimizerLayout>,
    /// Pipelined: each program's schedule steps and where their instructions lie; else empty.
    pub step_spans: Vec<Vec<pleat_backend::pipeline::StepSpan>>,
    /// The micro-batches whose losses the step's loss averages, as `--check`'s reference must
    /// split it: `--micro-batches` when the loss has a load-balancing term (a product of
    /// statistics over each micro-batch's tokens), else 1 (the cross-entropy's mean over the
    /// micro-batches is the whole batch's).
    pub loss_micro_batches: u64,
    /// `(pass, IR text after it)` for each pass `dump` asked for.
    pub dumps: Vec<(&'static str, String)>,
}

/// How a training step is split into micro-batches and pipeline stages.
#[derive(Clone, Debug)]
pub struct Pipelining {
    /// Micro-batches a step (gradients accumulate over them).
    pub micro_batches: u32,
    /// The order of each stage's forward and backward steps.
    pub schedule: ScheduleName,
    /// `--chunks`: model chunks a rank for the interleaved schedule.
    pub chunks: Option<u32>,
    /// `--pp-layers`: layers a (virtual) stage, first to last; `None`: balanced by the cost model.
    pub layers: Option<String>,
}

/// Builds `config`'s training graph, shards and differentiates it over `mesh`, and lowers it;
/// with a `pp` axis or several micro-batches, into pipelined programs.
pub fn compile_training(
    config: &ModelConfig,
    (batch, seq): (u64, u64),
    mesh: &Mesh,
    strategy: Strategy,
    training: &TrainingPlan,
    kernels: crate::compile::Kernels,
    dump: Dump,
) -> Result<CompiledTraining> {
    let (zero, recompute) = (training.zero, Recompute::from(training.recompute));
    let pipelining = &training.pipelining();
    if strategy == Strategy::TpSpOrTsp {
        bail!(UsageError::TrainFoldedStrategy);
    }
    if zero > 0 && pleat_ir::ZERO_AXES.iter().all(|&axis| mesh.degree(axis) == 1) {
        bail!(UsageError::ZeroWithoutDp { zero });
    }
    let stages = mesh.degree(AxisName::Pp) as u32;
    if stages == 1 {
        // One stage runs its micro-batches in order (gradient accumulation): no chunks to
        // interleave, no layers to split.
        let flag = match (pipelining.chunks, pipelining.schedule, &pipelining.layers) {
            (Some(chunks), _, _) => Some(format!("--chunks {chunks}")),
            (None, ScheduleName::Interleaved, _) => Some("--schedule interleaved".to_string()),
            (None, _, Some(layers)) => Some(format!("--pp-layers {layers}")),
            _ => None,
        };
        if let Some(flag) = flag {
            bail!(UsageError::PipelineFlagWithoutPp { flag });
        }
    }
    let micro_batches = pipelining.micro_batches;
    if micro_batches == 0 || batch % u64::from(micro_batches) != 0 {
        bail!(UsageError::BatchNotSplit { batch, micro_batches, valid: pleat_ir::spec::valid_degrees(batch) });
    }
    // Each micro-batch's sequences split over dp (and ep, which splits a mixture's batch as dp
    // does). With one micro-batch, the compiler's own error names the axis.
    let batch_axes = crate::pipeline::batch_axes(mesh);
    let batch_ranks = crate::pipeline::batch_ranks(mesh);
    let sequences = batch / u64::from(micro_batches);
    if micro_batches > 1 && sequences % batch_ranks != 0 {
        let axes: Vec<String> = batch_axes.iter().map(|&axis| format!("{axis}={}", mesh.degree(axis))).collect();
        let fix = if batch % batch_ranks == 0 {
            format!("use --micro-batches in {:?}", pleat_ir::spec::valid_degrees(batch / batch_ranks))
        } else {
            format!(
                "nor does the whole batch; use a --batch that is a multiple of {}",
                batch_ranks * u64::from(micro_batches)
            )
        };
        bail!(UsageError::MicroBatchNotSplit { batch, micro_batches, sequences, axes: axes.join(","), fix });
    }
    let loss_micro_batches = loss_micro_batches(config, micro_batches);
    let inner = crate::pipeline::inner_mesh(mesh)?;
    let mut ctx = strategy.pass_ctx(&inner, dump)?;
    ctx.zero_stage = zero;
    ctx.recompute = recompute;
    let mut module = pleat_ir::model::build_training(config, batch / u64::from(micro_batches), seq)?;
    module.mesh = inner;
    let mut report = pleat_passes::run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &ctx)?;
    crate::compile::fuse_for(kernels, &mut module, &ctx, Some(&mut report))?;
    let dumps = report.dumps;
    if stages > 1 || micro_batches > 1 {
        let kind = crate::pipeline::schedule_kind(pipelining.schedule, pipelining.chunks)?;
        let virtual_stages = stages * kind.chunks();
        if kind.chunks() > 1 && u64::from(virtual_stages) > config.num_layers {
            bail!(UsageError::TooFewLayersForChunks {
                model: config.name.clone(),
                stages: stages.into(),
                chunks: kind.chunks().into(),
                virtual_stages: virtual_stages.into(),
                layers: config.num_layers,
            });
        }
        let layers = match &pipelining.layers {
            Some(text) => Some(crate::pipeline::layers_per_stage(text, config.num_layers, virtual_stages)?),
            None if u64::from(virtual_stages) <= config.num_layers => {
                let micro_batch = (batch / u64::from(micro_batches), seq);
                let sequence_parallel = strategy == Strategy::TpSp;
                Some(crate::pipeline::cost_balanced_layers(
                    config,
                    &module.mesh,
                    sequence_parallel,
                    micro_batch,
                    virtual_stages,
                )?)
            }
            // Too few layers: stage_of_nodes says so.
            None => None,
        };
        let mut stage_of =
            crate::pipeline::stage_of_nodes(&module, virtual_stages, layers.as_deref(), config.num_layers)?;
        // A parameter gathered for readers on several stages (a tied table under ZeRO-3) is
        // gathered by each of them.
        if crate::pipeline::gather_params_on_each_stage(&mut module, &stage_of) > 0 {
            stage_of = crate::pipeline::stage_of_nodes(&module, virtual_stages, layers.as_deref(), config.num_layers)?;
        }
        let schedule = crate::pipeline::schedule_steps(kind, stages, micro_batches)?;
        let plan = (micro_batches, kind.chunks());
        let (programs, layouts, step_spans) = crate::pipeline::pipelined(&module, &stage_of, &schedule, plan, zero)?;
        return Ok(CompiledTraining { module, programs, layouts, step_spans, loss_micro_batches, dumps });
    }
    let programs = pleat_backend::lower(&module)?;
    pleat_backend::verify_collectives(&programs)?;
    let layouts = (0..programs.len() as u32)
        .map(|rank| optimizer_layout(&module, rank, zero))
        .collect::<pleat_backend::Result<Vec<_>>>()?;
    Ok(CompiledTraining { module, programs, layouts, step_spans: Vec::new(), loss_micro_batches, dumps })
}

/// A training step's programs as the threads runtime runs them: the gradients' reductions in
/// buckets of up to `bucket_mb` MiB (0: each alone), then scheduled for overlap unless
/// `no_overlap`, weight prefetches where `prefetch` says.
pub fn bucket_and_schedule(
    programs: &[Program],
    bucket_mb: u64,
    no_overlap: bool,
    prefetch: Prefetch,
) -> Result<Vec<Program>> {
    let cap = bucket_mb.saturating_mul(1 << 20);
    let bucketed: Vec<Program> = programs.iter().map(|program| bucket_gradient_reductions(program, cap)).collect();
    pleat_backend::verify_collectives(&bucketed)?;
    crate::predict::overlap_for_cpu(bucketed, no_overlap, prefetch)
}

/// The most bytes of a `--data` stream (a pipe or a device, whose size is not known before) read.
const DATA_STREAM_LIMIT: u64 = 256 << 20;

/// The text of `--data`: a file whole, once this machine is known to hold it and its ids (about
/// three times its size; `/dev/zero` was read until the kernel killed pleat), or a stream up to
/// [`DATA_STREAM_LIMIT`] bytes.
fn read_data(path: &Path) -> Result<String> {
    let cannot_read = || format!("cannot read --data {}", path.display());
    let metadata = std::fs::metadata(path).with_context(cannot_read)?;
    if metadata.is_file() {
        let what = format!("reading --data {}", path.display());
        crate::host_memory::ensure_available(&what, metadata.len().saturating_mul(3))?;
        return crate::text_file::read_text(path).with_context(cannot_read);
    }
    let mut bytes = Vec::new();
    let file = std::fs::File::open(path).with_context(cannot_read)?;
    std::io::Read::read_to_end(&mut std::io::Read::take(file, DATA_STREAM_LIMIT + 1), &mut bytes)
        .with_context(cannot_read)?;
    if bytes.len() as u64 > DATA_STREAM_LIMIT {
        bail!(UsageError::DataStreamTooLarge { path: path.to_path_buf(), limit: DATA_STREAM_LIMIT });
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Each step's tokens: the synthetic stream, or consecutive windows of a token file. A run resumed
/// after `resumed` = (steps, tokens seen) continues the file where those steps stopped, whatever
/// its own batch and sequence length (step `s` starts at `seen + (s - steps)·batch·seq`).
pub fn token_batches(
    data: Option<&Path>,
    seed: u64,
    (batch, seq): (u64, u64),
    vocab: u64,
    resumed: (u32, u64),
) -> Result<Box<dyn Fn(u32) -> Vec<u32> + Sync>> {
    let Some(path) = data else {
        return Ok(Box::new(move |step| synthetic_tokens(seed, u64::from(step), batch, seq, vocab)));
    };
    let text = read_data(path)?;
    let mut ids = Vec::new();
    for (index, word) in text.split(|c: char| c.is_whitespace() || c == ',').filter(|w| !w.is_empty()).enumerate() {
        match word.parse::<u64>() {
            Ok(id) if id < vocab => ids.push(id as u32),
            _ => {
                // A long or binary word is shown in part, escaped.
                let word: String = word.chars().take(40).collect();
                bail!(UsageError::DataToken { path: path.to_path_buf(), index, word, vocab })
            }
        }
    }
    if ids.is_empty() {
        bail!(UsageError::DataEmpty { path: path.to_path_buf() });
    }
    let window = (batch * seq) as usize;
    let (steps, seen) = resumed;
    Ok(Box::new(move |step| {
        let start = seen as usize + step.saturating_sub(steps) as usize * window;
        (0..window).map(|offset| ids[(start + offset) % ids.len()]).collect()
    }))
}

/// What a training run measured and checked.
struct TrainReport {
    /// Steps taken before this run (a resumed run's checkpoint).
    start_step: u32,
    losses: Vec<f32>,
    grad_norms: Vec<f64>,
    reference_losses: Option<Vec<f32>>,
    errors: Option<CheckErrors>,
    /// The steps `--check` did not judge (`StepChecks::routing_ties`).
    routing_ties: Vec<u32>,
    peaks: Vec<u64>,
    optimizer_bytes: Vec<u64>,
    activation_peaks: Vec<u64>,
    /// Each rank's planned arena, where native code ran the steps (0 elsewhere).
    arenas: Vec<u64>,
    recv_wait_shares: Vec<f64>,
    comm_bytes: BTreeMap<&'static str, u64>,
    /// How each rank ran its steps (`bytecode`, `native-entry` or `cuda`).
    execution: Vec<&'static str>,
    /// The GPU the steps ran on, where the first step's instructions ran and the last step's
    /// compute time, of the first chunk of steps (`--save-every`'s; under `--check` one step)
    /// (`--device cuda`).
    device: Option<DeviceReport>,
}

/// What a training run trains: compiled here from a model, or read from a compiled directory.
struct TrainingTarget {
    /// The model's configuration (a checkpoint records it).
    config: ModelConfig,
    /// At the precision the ranks compute in: the reference's.
    compute: ModelConfig,
    precision: Precision,
    shape: (u64, u64),
    mesh: Mesh,
    plan: TrainingPlan,
    programs: Vec<Program>,
    layouts: Vec<OptimizerLayout>,
    /// `CompiledTraining::loss_micro_batches`.
    loss_micro_batches: u64,
    weights_path: Option<PathBuf>,
    /// Each rank's native code: `--native`'s, or a compiled directory's `rank<i>.so`.
    native: Vec<Option<NativeKernels>>,
    /// The GPU the steps run on (`--device cuda`).
    cuda: Option<crate::device::CudaTrainer>,
}

impl TrainingTarget {
    /// Compiles the model `args` name, or reads the compiled directory it names.
    fn new(args: &RunArgs) -> Result<TrainingTarget> {
        let cuda = args.device == Device::Cuda;
        if cuda && args.native {
            bail!(UsageError::CpuOnlyFlag { flag: "--native" });
        }
        match resolve(&args.model)? {
            ModelSource::Config { config, weights } => Self::compile(args, *config, args.weights.clone().or(weights)),
            ModelSource::Compiled(dir) => Self::read(args, &dir),
        }
    }

    fn compile(args: &RunArgs, config: ModelConfig, weights_path: Option<PathBuf>) -> Result<TrainingTarget> {
        let shape = (args.batch.unwrap_or(8), args.seq.unwrap_or(64));
        let mesh = Mesh::parse(&args.mesh)?;
        let plan = args.training.plan.plan();
        let precision = args.precision.unwrap_or_default();
        let compute = precision.apply(&config);
        let mut compiled =
            compile_training(&compute, shape, &mesh, args.strategy, &plan, args.kernels(), Dump::Nothing)?;
        // A pipelined step's programs are replayed by their step spans, which keep the lowered order.
        if compiled.step_spans.is_empty() {
            compiled.programs =
                bucket_and_schedule(&compiled.programs, plan.bucket_mb, args.no_overlap, Prefetch::OwnStream)?;
        }
        // On a GPU each step runs there (GEMMs on cuBLAS, the generated kernels, the rest on the
        // host), the optimizer on the host.
        let cuda = match args.device {
            Device::Cuda => Some(crate::device::CudaTrainer::open(&mut compiled.programs, None)?),
            Device::Cpu => None,
        };
        let native = if args.native { crate::native::build_and_load(&mut compiled.programs)? } else { Vec::new() };
        Ok(TrainingTarget {
            config,
            compute,
            precision,
            shape,
            mesh,
            plan,
            programs: compiled.programs,
            layouts: compiled.layouts,
            loss_micro_batches: compiled.loss_micro_batches,
            weights_path,
            native,
            cuda,
        })
    }

    /// A compiled directory's training step, run as it was compiled: the flags that would compile
    /// it differently are refused.
    fn read(args: &RunArgs, dir: &Path) -> Result<TrainingTarget> {
        let display = || dir.display().to_string();
        if args.precision.is_some() {
            bail!(UsageError::PrecisionOfCompiled { dir: display() });
        }
        if args.native {
            bail!(UsageError::NativeOfCompiled { dir: display() });
        }
        let mut compiled = crate::compiled_dir::read_compiled(dir)?;
        let plan = compiled.expect_training(dir)?.clone();
        args.training.plan.check_against(dir, &plan)?;
        args.check_against_plan(&compiled.plan)?;
        crate::compiled_dir::check_schedule_flags(args.no_overlap, 2, &compiled.programs)?;
        let weights_path = crate::compiled_dir::weights_for(args.weights.as_deref(), dir, &compiled.plan)?;
        let config = compiled.config;
        let cuda = match args.device {
            Device::Cuda => Some(crate::device::CudaTrainer::open(&mut compiled.programs, Some(dir))?),
            Device::Cpu => None,
        };
        let native = if cuda.is_none() { crate::native::load(dir, &compiled.programs)? } else { Vec::new() };
        Ok(TrainingTarget {
            compute: config.clone(),
            precision: Precision::of(&config),
            shape: (compiled.plan.batch, compiled.plan.seq),
            mesh: Mesh::parse(&compiled.plan.mesh)?,
            loss_micro_batches: loss_micro_batches(&config, plan.micro_batches),
            plan,
            programs: compiled.programs,
            layouts: compiled.layouts,
            config,
            weights_path,
            native,
            cuda,
        })
    }
}

/// The micro-batches whose losses a step's loss averages (`CompiledTraining::loss_micro_batches`).
fn loss_micro_batches(config: &ModelConfig, micro_batches: u32) -> u64 {
    let aux_loss = config.moe.as_ref().is_some_and(|moe| moe.output_router_logits);
    if aux_loss {
        u64::from(micro_batches)
    } else {
        1
    }
}

/// Runs `pleat run --train`.
pub fn run_training(args: &RunArgs) -> Result<()> {
    let flags = &args.training;
    if args.tokens.is_some() {
        bail!(UsageError::TrainWithTokens);
    }
    for (flag, given) in [("--logits-out", args.logits_out.is_some())] {
        if given {
            bail!(UsageError::InferenceFlagWithTrain { flag });
        }
    }
    let target = TrainingTarget::new(args)?;
    let (config, compute, shape) = (&target.config, &target.compute, target.shape);
    let native = &target.native;
    let resume = flags.resume.as_deref().map(|dir| crate::checkpoint::read(dir, config)).transpose()?;
    if resume.is_some() && args.weights.is_some() {
        bail!(UsageError::ResumeWithWeights);
    }
    let given_weights;
    let weights: &dyn WeightSource = match &resume {
        Some(resume) => &resume.state,
        None => {
            given_weights = weight_source(target.weights_path.as_ref(), args.seed)?;
            crate::run::warn_unused_tensors(target.weights_path.as_ref(), &target.programs);
            given_weights.as_ref()
        }
    };
    let start_step = resume.as_ref().map_or(0, |resume| resume.steps);
    // The stream's tokens the checkpoint's steps took (an older checkpoint's at this run's batch).
    let window = shape.0 * shape.1;
    let seen = resume.as_ref().map_or(0, |resume| resume.tokens_seen.unwrap_or(u64::from(resume.steps) * window));
    let batches = token_batches(flags.data.as_deref(), args.seed, shape, config.vocab_size, (start_step, seen))?;
    // The stream's tokens taken after `steps` steps in all.
    let tokens_seen = |steps: u32| seen + u64::from(steps - start_step) * window;
    let positions: Vec<u32> = (0..shape.1 as u32).collect();
    let max_grad_norm = (flags.max_grad_norm > 0.0).then_some(flags.max_grad_norm);
    let adamw = AdamWConfig { learning_rate: flags.lr, max_grad_norm, ..AdamWConfig::default() };
    let settings = AdamWSettings::from(&adamw);
    let resume_moments = resume.as_ref().map(|resume| &resume.state as &dyn WeightSource);
    // Train in chunks of --save-every steps, each starting from the last one's state in memory
    // (the same blocks, so the same numbers as one run), and save after each. Under --check every
    // step is a chunk of its own: the reference takes that step from the run's own weights and
    // moments, so f32 rounding (which training's dynamics amplify from step to step) never
    // compounds into the comparison, and every step's loss, gradients and update are checked.
    let save_every = flags.save_every.unwrap_or(flags.steps).max(1);
    let chunk_steps = if args.check { 1 } else { save_every };
    let mut done = 0;
    let mut carried: Option<(BlockWeights, BlockWeights)> = None;
    let mut ranks: Vec<RankTraining> = Vec::new();
    let mut checked: Option<StepChecks> = args.check.then(StepChecks::default);
    let mut tolerances = CheckTolerances::new(target.precision);
    if target.cuda.is_some() {
        tolerances = tolerances.on_cuda();
    }
    // The first chunk's report of where a step's instructions ran on the GPU.
    let mut device = None;
    let progress =
        crate::progress::Progress::new("training", "step", u64::from(flags.steps), args.format == Format::Text);
    let on_step = |step: u32| progress.set(u64::from(step - start_step));
    loop {
        let steps = chunk_steps.min(flags.steps - done);
        let (initial, moments) = match &carried {
            Some((params, moments)) => (params as &dyn WeightSource, Some(moments as &dyn WeightSource)),
            None => (weights, resume_moments),
        };
        let options = TrainOptions {
            steps,
            adamw: settings,
            batches: &*batches,
            positions: &positions,
            initial,
            moments,
            start_step: start_step + done,
            timeout: Duration::from_secs(args.timeout),
            link: args.emulate_link,
            native,
            on_step: Some(&on_step),
        };
        let trained = match &target.cuda {
            Some(trainer) => {
                let (trained, report) = trainer
                    .train(&target.programs, &target.layouts, &options)
                    .map_err(|error| before_any_update(error, start_step + 1))?;
                device.get_or_insert(report);
                trained
            }
            None => {
                // Every rank is a thread here: their planned peaks add up, beside AdamW's two f32
                // moments of every parameter.
                let needed = target
                    .programs
                    .iter()
                    .map(|program| {
                        let planned = plan(program, ElementSize::Fixed(4));
                        planned.peak_bytes.saturating_add(planned.param_bytes.saturating_mul(2))
                    })
                    .fold(0u64, u64::saturating_add);
                let what = format!("training {} ranks' programs", target.programs.len());
                crate::host_memory::ensure_available(&what, needed)?;
                train_on_threads(&target.programs, &target.layouts, &options)
                    .map_err(|error| before_any_update(error.into(), start_step + 1))?
            }
        };
        if let Some(checked) = &mut checked {
            let start = (start_step + done, initial, moments);
            // Every step's gradients are checked, the first one's to the tighter bound.
            let first = done == 0;
            let chunk = check_steps(
                compute,
                shape,
                steps,
                adamw.clone(),
                start,
                &*batches,
                &target,
                &trained,
                first,
                tolerances.routing_tie,
            )?;
            checked.push(chunk, tolerances.loss_at_tie);
        }
        done += steps;
        if let Some(dir) = &flags.save {
            if done % save_every == 0 || done == flags.steps {
                crate::checkpoint::write(dir, config, (start_step + done, tokens_seen(start_step + done)), &trained)?;
            }
        }
        if done < flags.steps {
            carried = Some(final_state(&trained)?);
        }
        ranks = if ranks.is_empty() { trained } else { merge_chunks(ranks, trained) };
        if done >= flags.steps {
            break;
        }
    }
    progress.finish();
    // Only the last pipeline stage computes the loss.
    let Some(with_loss) = ranks.iter().find(|rank| !rank.losses.is_empty()) else {
        bail!(UsageError::NoLossRank);
    };
    let mut report = TrainReport {
        start_step,
        losses: with_loss.losses.clone(),
        grad_norms: with_loss.grad_norms.clone(),
        reference_losses: None,
        errors: None,
        routing_ties: Vec::new(),
        peaks: ranks.iter().map(|rank| rank.peak_bytes).collect(),
        optimizer_bytes: ranks.iter().map(|rank| rank.optimizer_bytes).collect(),
        activation_peaks: ranks.iter().map(|rank| rank.activation_peak_bytes).collect(),
        arenas: ranks.iter().map(|rank| rank.arena_bytes).collect(),
        recv_wait_shares: ranks.iter().map(|rank| rank.first_recv_wait_share).collect(),
        comm_bytes: comm_stats_mean(&ranks.iter().map(|rank| &rank.first_comm).collect::<Vec<_>>()),
        execution: (0..ranks.len())
            .map(|rank| match device {
                Some(_) => "cuda",
                None => crate::native::ExecutionPath::of(native.get(rank).and_then(Option::as_ref)).name(),
            })
            .collect(),
        device,
    };
    if let Some(checked) = checked {
        report.reference_losses = Some(checked.reference_losses);
        report.errors = Some(checked.errors);
        report.routing_ties = checked.routing_ties;
    }
    let tolerances = match &report.reference_losses {
        Some(reference_losses) => tolerances.scaled_to(reference_losses),
        None => tolerances,
    };
    print_report(args, &target, &report, tolerances)?;
    if let Some(path) = &args.trace {
        let timings: Vec<(u32, &[(u64, u64)])> =
            ranks.iter().map(|rank| (rank.rank, rank.first_timings.as_slice())).collect();
        let slices = crate::trace::timed_slices(&target.programs, &timings, crate::trace::RunStreams::Two)?;
        crate::trace::write_chrome_trace(path, &slices, target.programs.len() as u32)?;
    }
    if let Some(errors) = &report.errors {
        for (name, err, tol) in [
            ("the losses' difference", errors.loss, Some(tolerances.loss)),
            ("the first-step gradients' relative difference", errors.grad_rel, Some(tolerances.grad_rel)),
            ("the later steps' gradients' relative difference", errors.later_grad_rel, Some(tolerances.later_grad_rel)),
            ("the updates' relative difference", errors.update_rel, tolerances.update_rel),
        ] {
            let (Some(err), Some(tol)) = (err, tol) else { continue };
            if err.is_nan() || err > tol {
                bail!(UsageError::TrainCheckMismatch { quantity: name, err, tolerance: tol });
            }
        }
    }
    Ok(())
}

/// One run's ranks from two consecutive chunks of it: the steps' losses and norms in order, the
/// first chunk's first-step measurements, the last chunk's state and the larger peaks.
fn merge_chunks(earlier: Vec<RankTraining>, later: Vec<RankTraining>) -> Vec<RankTraining> {
    earlier
        .into_iter()
        .zip(later)
        .map(|(mut earlier, later)| {
            earlier.losses.extend(later.losses);
            earlier.grad_norms.extend(later.grad_norms);
            earlier.params = later.params;
            earlier.moments = later.moments;
            earlier.peak_bytes = earlier.peak_bytes.max(later.peak_bytes);
            earlier.optimizer_bytes = earlier.optimizer_bytes.max(later.optimizer_bytes);
            earlier.activation_peak_bytes = earlier.activation_peak_bytes.max(later.activation_peak_bytes);
            earlier
        })
        .collect()
}

/// How far a run is from the reference, the largest over the steps checked; `None` where no
/// step was judged (each step at a routing tie, or the first one for the gradients).
#[derive(Clone, Copy, Default)]
struct CheckErrors {
    /// The largest absolute loss difference.
    loss: Option<f32>,
    /// The largest difference of a parameter's update from AdamW's of the run's own gradients,
    /// relative to that update: |w_run - w_exp| / |w_exp - w_start| in L2 over the parameter.
    update_rel: Option<f32>,
    /// The largest first-step gradient difference relative to its gradient's L2 norm.
    grad_rel: Option<f32>,
    /// The same over the later steps.
    later_grad_rel: Option<f32>,
}

impl CheckErrors {
    /// The larger of each error, NaN when either is.
    fn max(self, other: CheckErrors) -> CheckErrors {
        CheckErrors {
            loss: larger(self.loss, other.loss),
            update_rel: larger(self.update_rel, other.update_rel),
            grad_rel: larger(self.grad_rel, other.grad_rel),
            later_grad_rel: larger(self.later_grad_rel, other.later_grad_rel),
        }
    }
}

/// The larger of two errors where either may be absent, NaN when either is.
fn larger(left: Option<f32>, right: Option<f32>) -> Option<f32> {
    match (left, right) {
        (Some(left), Some(right)) => Some(nan_max(left, right)),
        (left, right) => left.or(right),
    }
}

/// The checks of a run's steps so far.
#[derive(Default)]
struct StepChecks {
    /// Each step's reference loss, computed from the run's weights at that step.
    reference_losses: Vec<f32>,
    /// The largest errors over the steps judged.
    errors: CheckErrors,
    /// The steps (counted from 1) not judged: a token's expert choice there was within rounding of
    /// a tie.
    routing_ties: Vec<u32>,
}

/// What one chunk's check found.
struct ChunkCheck {
    reference_losses: Vec<f32>,
    errors: CheckErrors,
    routing_ties: Vec<u32>,
}

impl StepChecks {
    /// Adds a chunk's check: at a routing tie only its loss, and that only with `loss_at_tie`.
    fn push(&mut self, chunk: ChunkCheck, loss_at_tie: bool) {
        self.reference_losses.extend(chunk.reference_losses);
        if chunk.routing_ties.is_empty() {
            self.errors = self.errors.max(chunk.errors);
        } else if loss_at_tie {
            self.errors.loss = larger(self.errors.loss, chunk.errors.loss);
        }
        self.routing_ties.extend(chunk.routing_ties);
    }
}

/// Checks the `steps` steps a chunk of the run took from `start` (the step count, the weights
/// and the moments the ranks began from) against the reference taking the same steps from the
/// same state: the losses (absolute), the gradients (relative to each one's norm; `first` says
/// whether they are the run's first step's), and each parameter's update (relative to AdamW's of
/// the run's own gradients).
#[allow(clippy::too_many_arguments)]
fn check_steps(
    config: &ModelConfig,
    shape: (u64, u64),
    steps: u32,
    adamw: AdamWConfig,
    (start_step, weights, moments): (u32, &dyn WeightSource, Option<&dyn WeightSource>),
    batches: &(dyn Fn(u32) -> Vec<u32> + Sync),
    target: &TrainingTarget,
    ranks: &[RankTraining],
    first: bool,
    routing_tie: f64,
) -> Result<ChunkCheck> {
    let whole = |source: &dyn WeightSource, name: &str, shape: &[u64]| {
        let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
        source.read(name, shape, &region).ok()
    };
    let initial = |name: &str, shape: &[u64]| whole(weights, name, shape);
    let initial_moments = |name: &str, shape: &[u64]| moments.and_then(|moments| whole(moments, name, shape));
    let start = ReferenceStart {
        weights: &initial,
        step: start_step,
        moments: moments.is_some().then_some(&initial_moments as &ParamLookup),
    };
    // Under bf16 the step's gradients are also taken in f32, to size each one's rounding
    // (`gradient_scale`).
    let f32_gradients = match Precision::of(config) == Precision::Bf16 {
        true => {
            let exact = Precision::F32.apply(config);
            let micro_batches = target.loss_micro_batches;
            Some(train_reference(&exact, shape, micro_batches, 1, adamw.clone(), &start, batches)?.first_grads)
        }
        false => None,
    };
    let reference = train_reference(config, shape, target.loss_micro_batches, steps, adamw.clone(), &start, batches)?;
    // Only the last pipeline stage computes the loss.
    let losses = ranks.iter().find(|rank| !rank.losses.is_empty()).map(|rank| rank.losses.as_slice());
    let loss = max_diff(losses, &reference.losses);
    // The run's gradients of the step (a checked chunk's one), by name: the optimizer layouts give
    // each one's output index (every rank's names its own parameters').
    let grad_outputs: BTreeMap<&str, u32> = target
        .layouts
        .iter()
        .flat_map(|layout| &layout.params)
        .map(|param| (param.name.as_str(), param.grad_output))
        .collect();
    let run_gradient = |name: &str| {
        let index = grad_outputs.get(name)?;
        let blocks: Vec<&OutputBlock> =
            ranks.iter().flat_map(|rank| &rank.first_outputs).filter(|block| block.index == *index).collect();
        pleat_runtime::launch::assemble_blocks(&blocks).map(|(_, data)| data)
    };
    // Each parameter's update, assembled from the ranks' blocks, beside what the reference's AdamW
    // makes of the run's own gradients from the run's own weights and moments. (Beside the
    // reference's own update instead, an element whose gradient is near Adam's eps, such as a
    // nearly zero k bias's under RoPE of a low frequency, steps as the last bits of its gradient
    // say: measured 1e-2 of a Qwen2 k bias's update off at pp=2, with the gradients 4e-7 off.)
    anyhow::ensure!(steps == 1, "a checked chunk is one step, not {steps}");
    let mut final_blocks: HashMap<&str, Vec<&OutputBlock>> = HashMap::new();
    for rank in ranks {
        for (name, block) in &rank.params {
            final_blocks.entry(name.as_str()).or_default().push(block);
        }
    }
    let names: Vec<&String> = reference.weights.keys().collect();
    let mut befores = Vec::with_capacity(names.len());
    let mut run_gradients = Vec::with_capacity(names.len());
    for &name in &names {
        let shape = reference.shapes.get(name).with_context(|| format!("the reference has no shape of {name}"))?;
        befores.push(initial(name, shape).with_context(|| format!("no starting weights for {name}"))?);
        run_gradients.push(run_gradient(name));
    }
    let mut update_rel = f32::NAN;
    if let Some(run_gradients) = run_gradients.into_iter().collect::<Option<Vec<Vec<f32>>>>() {
        let views: Vec<&[f32]> = befores.iter().map(Vec::as_slice).collect();
        let mut optimizer = AdamW::new(adamw, &views);
        optimizer.step = u64::from(start_step);
        for (&name, state) in names.iter().zip(&mut optimizer.params) {
            let shape = &reference.shapes[name];
            if let Some(exp_avg) = initial_moments(&format!("{name}.exp_avg"), shape) {
                state.exp_avg = exp_avg;
            }
            if let Some(exp_avg_sq) = initial_moments(&format!("{name}.exp_avg_sq"), shape) {
                state.exp_avg_sq = exp_avg_sq;
            }
        }
        let grads: Vec<&[f32]> = run_gradients.iter().map(Vec::as_slice).collect();
        if optimizer.step(&grads).is_ok() {
            update_rel = 0.0;
            for ((&name, state), before) in names.iter().zip(&optimizer.params).zip(&befores) {
                let blocks = final_blocks.get(name.as_str()).with_context(|| format!("no rank holds {name}"))?;
                let got = pleat_runtime::launch::assemble_blocks(blocks).map(|(_, data)| data);
                update_rel = nan_max(update_rel, relative_update_error(got.as_deref(), &state.master, before));
            }
        }
    }
    let mut grad_rel = 0.0_f32;
    // A gradient that cancels to nearly nothing (a top-1 router's when the experts' loads are
    // equal: its norm was 1e-18) is judged against the rounding of the step's largest.
    let largest = grad_outputs
        .keys()
        .filter_map(|name| reference.first_grads.get(*name))
        .map(|want| l2_norm(want))
        .fold(0.0_f32, f32::max);
    for &name in grad_outputs.keys() {
        let got = run_gradient(name);
        let want =
            reference.first_grads.get(name).with_context(|| format!("the reference has no gradient of {name}"))?;
        let exact = f32_gradients.as_ref().and_then(|grads| grads.get(name)).map(Vec::as_slice);
        let scale = gradient_scale(want, exact).max(GRADIENT_FLOOR_SHARE * largest);
        grad_rel = nan_max(grad_rel, max_diff(got.as_deref(), want) / scale);
    }
    let routing_ties = (start_step + 1..)
        .zip(&reference.routing_margins)
        .filter(|&(_, &margin)| margin < routing_tie)
        .map(|(step, _)| step)
        .collect();
    Ok(ChunkCheck {
        reference_losses: reference.losses,
        errors: CheckErrors {
            loss: Some(loss),
            update_rel: Some(update_rel),
            grad_rel: first.then_some(grad_rel),
            later_grad_rel: (!first).then_some(grad_rel),
        },
        routing_ties,
    })
}

/// What a gradient's difference from the reference is divided by: its L2 norm, and
/// under bf16 (`exact`, the f32 reference's) at least the size of the terms it was summed from,
/// `2^8 ×` the bf16 reference's own largest distance from f32's. A gradient that is a small
/// difference of large terms carries bf16's rounding of those terms: k's bias (adding one vector
/// to every key shifts each row of scores by a constant, which softmax ignores; only RoPE's
/// rotation leaves a gradient) measured 1.7e-2 of its norm off at tsp=2 on a Qwen2 config, where
/// the f32 run is 1e-6 off. Everywhere else the norm is the larger, and f32 runs always use it.
fn gradient_scale(want: &[f32], exact: Option<&[f32]>) -> f32 {
    let norm = l2_norm(want).max(1e-12);
    match exact {
        Some(exact) => norm.max(crate::run::max_abs_diff(want, exact) / BF16_UNIT_ROUNDOFF),
        None => norm,
    }
}

/// A gradient's L2 norm (summed in f64).
fn l2_norm(values: &[f32]) -> f32 {
    values.iter().map(|&value| f64::from(value) * f64::from(value)).sum::<f64>().sqrt() as f32
}

/// The share of the step's largest gradient norm below which a gradient's difference is judged
/// against that share instead of its own norm: f32's rounding (6e-8) of the largest, 16 times.
const GRADIENT_FLOOR_SHARE: f32 = 1e-6;

/// bf16's unit roundoff as pleat's tolerances count it, 2^-8.
const BF16_UNIT_ROUNDOFF: f32 = 1.0 / 256.0;

/// |got - want| / |want - before| in L2: how far a parameter's update is from the expected one,
/// relative to it. Over the whole parameter, not element by element: an element whose gradient
/// is near Adam's eps (a token absent from the batch) takes a step that the last bits of its
/// moments decide, while a wrong update (a shard left out, a wrong bias correction or clip) is a
/// large share of the whole. NaN when a side is missing or differs in length.
fn relative_update_error(got: Option<&[f32]>, want: &[f32], before: &[f32]) -> f32 {
    let Some(got) = got.filter(|got| got.len() == want.len() && before.len() == want.len()) else {
        return f32::NAN;
    };
    let norm = |pairs: &mut dyn Iterator<Item = (&f32, &f32)>| {
        pairs.map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum::<f64>().sqrt()
    };
    let diff = norm(&mut got.iter().zip(want));
    let update = norm(&mut want.iter().zip(before));
    if diff == 0.0 {
        0.0
    } else {
        (diff / update.max(f64::MIN_POSITIVE)) as f32
    }
}

/// The largest absolute difference; NaN when a side is missing, differs in length or holds a NaN.
fn max_diff(got: Option<&[f32]>, want: &[f32]) -> f32 {
    match got {
        Some(got) => crate::run::max_abs_diff(got, want),
        None => f32::NAN,
    }
}

fn print_report(
    args: &RunArgs,
    target: &TrainingTarget,
    report: &TrainReport,
    tolerances: CheckTolerances,
) -> Result<()> {
    let flags = &args.training;
    let (config, mesh, plan) = (&target.config, &target.mesh, &target.plan);
    match args.format {
        Format::Json => {
            let object = json!({
                "model": config.name,
                "mesh": mesh.to_string(),
                "ranks": report.peaks.len(),
                "steps": flags.steps,
                "start_step": report.start_step,
                "zero": plan.zero,
                "recompute": plan.recompute,
                "losses": report.losses,
                "grad_norms": report.grad_norms,
                "reference_losses": report.reference_losses,
                "max_abs_err": report.errors.as_ref().and_then(|errors| errors.loss),
                "max_loss_err": report.errors.as_ref().and_then(|errors| errors.loss),
                "max_update_rel_err": report.errors.as_ref().and_then(|errors| errors.update_rel),
                "max_grad_rel_err": report.errors.as_ref().and_then(|errors| errors.grad_rel),
                "max_later_grad_rel_err": report.errors.as_ref().and_then(|errors| errors.later_grad_rel),
                "routing_tie_steps": report.errors.as_ref().map(|_| &report.routing_ties),
                "precision": format!("{:?}", target.precision).to_lowercase(),
                "tolerances": {
                    "loss": tolerances.loss,
                    "grad_rel": tolerances.grad_rel,
                    "later_grad_rel": tolerances.later_grad_rel,
                    "update_rel": tolerances.update_rel,
                    "routing_tie_margin": tolerances.routing_tie,
                    "loss_judged_at_routing_ties": tolerances.loss_at_tie,
                },
                "peak_bytes_per_rank": report.peaks,
                "optimizer_bytes_per_rank": report.optimizer_bytes,
                "activation_peak_bytes_per_rank": report.activation_peaks,
                "arena_bytes_per_rank": report.arenas,
                "recv_wait_share_per_rank": report.recv_wait_shares,
                "comm_bytes_per_step": report.comm_bytes,
                "execution_per_rank": report.execution,
                "device": report.device.as_ref().map(DeviceReport::to_json),
            });
            crate::json_output::print(object)?;
        }
        Format::Text => {
            let mesh_text = if mesh.axes().is_empty() { "one rank".to_string() } else { mesh.to_string() };
            println!(
                "trained {} on {mesh_text} for {} steps (zero {}, recompute {})",
                config.name,
                flags.steps,
                plan.zero,
                plan.recompute.name()
            );
            for (index, loss) in report.losses.iter().enumerate() {
                let step = report.start_step as usize + index + 1;
                match &report.reference_losses {
                    Some(reference) => println!("step {step:>3}  loss {loss:.6}  reference {:.6}", reference[index]),
                    None => println!("step {step:>3}  loss {loss:.6}"),
                }
            }
            let peaks: Vec<String> = report.peaks.iter().map(|&peak| human_bytes(peak)).collect();
            println!("peak bytes a rank: {}", peaks.join(", "));
            if report.arenas.iter().any(|&arena| arena > 0) {
                let arenas: Vec<String> = report.arenas.iter().map(|&arena| human_bytes(arena)).collect();
                println!("planned arena a rank (native code): {}", arenas.join(", "));
            }
            let sent: Vec<String> = report
                .comm_bytes
                .iter()
                .filter(|&(_, &bytes)| bytes > 0)
                .map(|(name, &bytes)| format!("{name} {}", human_bytes(bytes)))
                .collect();
            let sent = if sent.is_empty() { "nothing".to_string() } else { sent.join(", ") };
            println!("sent a rank in step {}, forward and backward (mean): {sent}", report.start_step + 1);
            match &report.device {
                // (The first step's: forward, backward and the loss, the optimizer apart.)
                Some(device) => crate::device::describe(device).iter().for_each(|line| println!("{line}")),
                None => println!("execution a rank: {}", report.execution.join(", ")),
            }
            if let Some(errors) = &report.errors {
                let verdict = |err: Option<f32>, tol: Option<f32>| match (err, tol) {
                    (None, None) => "(not judged on a GPU)".to_string(),
                    (None, Some(_)) => "not judged: at a routing tie (below)".to_string(),
                    (Some(err), Some(tol)) if err <= tol => format!("= {err:.3e} (tolerance {tol:.1e}): ok"),
                    (Some(err), Some(tol)) => format!("= {err:.3e} (tolerance {tol:.1e}): FAILED"),
                    (Some(err), None) => format!("= {err:.3e} (reported, not judged on a GPU)"),
                };
                // Each step's reference starts from the run's own weights and moments.
                println!(
                    "check: max |loss - reference| (each step from the run's own state) {}",
                    verdict(errors.loss, Some(tolerances.loss))
                );
                // Under bf16 a gradient summed from larger terms is held to their size.
                let scale = match target.precision {
                    Precision::F32 => "|grad|",
                    Precision::Bf16 => "max(|grad|, its terms' size)",
                };
                println!(
                    "check: max |grad - reference| / {scale} at step {} {}",
                    report.start_step + 1,
                    verdict(errors.grad_rel, Some(tolerances.grad_rel))
                );
                if report.losses.len() > 1 {
                    println!(
                        "check: max |grad - reference| / {scale} at the later steps {}",
                        verdict(errors.later_grad_rel, Some(tolerances.later_grad_rel))
                    );
                }
                println!(
                    "check: max |update - AdamW's of the run's gradients| / |that update| a parameter {}",
                    verdict(errors.update_rel, tolerances.update_rel)
                );
                if !report.routing_ties.is_empty() {
                    let steps: Vec<String> = report.routing_ties.iter().map(u32::to_string).collect();
                    let what =
                        if tolerances.loss_at_tie { "gradients and updates" } else { "losses, gradients and updates" };
                    println!(
                        "check: {what} not judged, steps {}: a token's expert choice was within rounding of a tie \
                         (router logits {:.0e} apart, relative), so it may go to another expert than in the reference",
                        steps.join(", "),
                        tolerances.routing_tie
                    );
                }
            }
        }
    }
    Ok(())
}

/// `error`, or where it is a step that diverged at `first_step` (the run's first, before any update
/// it made) the error saying that --lr is not the cause.
fn before_any_update(error: anyhow::Error, first_step: u32) -> anyhow::Error {
    let diverged = error.chain().find_map(|cause| match cause.downcast_ref::<pleat_runtime::Error>() {
        Some(pleat_runtime::Error::Diverged { step, norm, .. }) if *step == first_step => Some(*norm),
        _ => None,
    });
    match diverged {
        Some(norm) => UsageError::DivergedBeforeUpdate { step: first_step, norm }.into(),
        None => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_a_gpu_f32_checks_widen_to_the_gpu_tolerance_and_bf16_keeps_its_own() {
        let f32_checks = CheckTolerances::new(Precision::F32).on_cuda();
        assert_eq!((f32_checks.loss, f32_checks.grad_rel, f32_checks.update_rel), (1e-3, 1e-3, None));
        let bf16_checks = CheckTolerances::new(Precision::Bf16).on_cuda();
        assert_eq!((bf16_checks.loss, bf16_checks.grad_rel, bf16_checks.update_rel), (BF16_TOL, BF16_TOL, None));
    }

    #[test]
    fn a_loss_is_held_to_a_share_of_the_largest_where_that_is_more_than_the_absolute_bound() {
        let bf16 = CheckTolerances::new(Precision::Bf16);
        // Losses below 1 keep 2^-6 absolute; larger ones 2^-6 of the largest: 26 × 2^-6.
        assert_eq!(bf16.scaled_to(&[0.5, 0.25]).loss, BF16_TOL);
        assert_eq!(bf16.scaled_to(&[4.0, -26.0]).loss, 26.0 * BF16_TOL);
        assert_eq!(bf16.scaled_to(&[26.0]).scaled_to(&[26.0]).loss, 26.0 * BF16_TOL);
        assert_eq!(bf16.scaled_to(&[26.0]).grad_rel, BF16_TOL);
        // f32: 1e-4, or 1e-5 of the largest loss (4064 × 1e-5, where one ulp is 4.9e-4).
        let f32_checks = CheckTolerances::new(Precision::F32);
        assert_eq!(f32_checks.scaled_to(&[5.0]).loss, TRAIN_TOL);
        assert_eq!(f32_checks.scaled_to(&[4064.0, 12.0]).loss, 4064.0 * 1e-5);
    }

    #[test]
    fn a_compiled_steps_flags_are_refused_only_where_given_with_another_value() {
        let dir = Path::new("d");
        let refusal = |flags: TrainPlanFlags, plan: &TrainingPlan| {
            flags.check_against(dir, plan).err().map(|error| error.to_string()).unwrap_or_default()
        };
        let plan = TrainPlanFlags { zero: Some(1), chunks: Some(3), ..TrainPlanFlags::default() }.plan();
        // Unset flags, and flags at the directory's values (a default included), are taken.
        assert_eq!(refusal(TrainPlanFlags::default(), &plan), "");
        assert_eq!(
            refusal(TrainPlanFlags { zero: Some(1), bucket_mb: Some(25), ..TrainPlanFlags::default() }, &plan),
            ""
        );
        assert_eq!(
            refusal(TrainPlanFlags { zero: Some(0), ..TrainPlanFlags::default() }, &plan),
            "--zero 0 differs from d's compiled training step (--zero 1)"
        );
        assert_eq!(
            refusal(TrainPlanFlags { chunks: Some(2), ..TrainPlanFlags::default() }, &plan),
            "--chunks 2 differs from d's compiled training step (--chunks 3)"
        );
        let unset = TrainPlanFlags::default().plan();
        assert_eq!(
            refusal(TrainPlanFlags { pp_layers: Some("3,1".into()), ..TrainPlanFlags::default() }, &unset),
            "--pp-layers 3,1 differs from d's compiled training step (--pp-layers unset (balanced by the cost model))"
        );
        assert_eq!(
            refusal(TrainPlanFlags { recompute: Some(RecomputeArg::Full), ..TrainPlanFlags::default() }, &unset),
            "--recompute full differs from d's compiled training step (--recompute none)"
        );
    }

    #[test]
    fn an_update_is_held_relative_to_the_references_over_the_whole_parameter() {
        // The reference moves [1, 1, 1, 1] by [0.1, -0.1, 0.1, -0.1] (norm 0.2); the run's last
        // element moved the other way (difference 0.2): 0.2 / 0.2 = 1.
        let before = [1.0, 1.0, 1.0, 1.0];
        let want = [1.1, 0.9, 1.1, 0.9];
        let err = relative_update_error(Some(&[1.1, 0.9, 1.1, 1.1]), &want, &before);
        assert!((err - 1.0).abs() < 1e-6, "{err}");
        assert_eq!(relative_update_error(Some(&want), &want, &before), 0.0);
        assert!(relative_update_error(None, &want, &before).is_nan());
        assert!(relative_update_error(Some(&want[..3]), &want, &before).is_nan());
    }
}
