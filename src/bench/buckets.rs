//! `pleat bench buckets`: a data-parallel training step with every gradient reduced alone and
//! with the gradients bucketed (`pleat_backend::bucket`), side by side over an emulated link.
//!
//! Both come from one compile of the training step; each is then scheduled for overlap as `pleat
//! run --train` schedules it. Runs alternate (alone, bucketed, alone, ...) so that both see the
//! same machine, and each figure is the median over `--repeats` of one step's time: from the
//! first instruction's start to the last one's end, the slowest rank's (the optimizer's update is
//! outside it). Also reported: the reductions (all-reduce or reduce-scatter messages) a rank sends a step and the planned peak
//! of each program (a bucket holds its gradients until its last one, and packs them), and whether
//! the two give bitwise the same losses.

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use pleat_backend::memory::{plan, ElementSize};
use pleat_backend::{Instr, Program};
use pleat_ir::model::stream::synthetic_tokens;
use pleat_ir::optim::AdamWConfig;
use pleat_runtime::comm::LinkSpec;
use pleat_runtime::train::{train_on_threads, AdamWSettings, TrainOptions};
use serde_json::json;

use super::median;
use crate::compile::ModelOnMesh;
use crate::run::{weight_source, Format};
use crate::train::{bucket_and_schedule, compile_training};

/// The version of the `--format json` output.
const SCHEMA: &str = "pleat.bench.buckets/1";

/// Arguments of `pleat bench buckets`.
#[derive(Args)]
pub struct BucketArgs {
    /// The model, mesh (with a dp axis), strategy and input size (`--no-overlap` keeps both
    /// programs in their lowered order).
    #[command(flatten)]
    pub target: ModelOnMesh,
    /// The bucketed program's cap, MiB.
    #[arg(long, default_value_t = 25)]
    pub bucket_mb: u64,
    /// ZeRO stage over dp: 2 and 3 reduce-scatter the gradients instead of all-reducing them.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// The link every message is delivered over, GBPS,US (e.g. `10,200`): a latency a message
    /// is what buckets save.
    #[arg(long, value_name = "GBPS,US")]
    pub emulate_link: LinkSpec,
    /// Runs of each program (1 or more); the medians are reported.
    #[arg(long, default_value_t = 3, value_parser = crate::number_flags::count::<u32>)]
    pub repeats: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// The reductions (all-reduces and reduce-scatters) `program` sends a step.
fn reduction_messages(program: &Program) -> usize {
    program
        .instructions
        .iter()
        .filter(|instr| matches!(instr, Instr::AllReduce { .. } | Instr::ReduceScatter { .. }))
        .count()
}

/// Runs `pleat bench buckets`.
pub fn run_buckets(args: &BucketArgs) -> Result<()> {
    let config = args.target.config("bench buckets")?;
    let mesh = pleat_ir::Mesh::parse(&args.target.mesh)?;
    if mesh.degree(pleat_ir::AxisName::Dp) < 2 {
        bail!(crate::usage::UsageError::BucketsWithoutDp { mesh: mesh.to_string() });
    }
    let shape = (args.target.batch, args.target.seq);
    let training = crate::train::TrainPlanFlags { zero: Some(args.zero), ..Default::default() }.plan();
    let compiled = compile_training(
        &config,
        shape,
        &mesh,
        args.target.strategy,
        &training,
        crate::compile::Kernels::Interpreted,
        pleat_passes::Dump::Nothing,
    )?;
    let alone = bucket_and_schedule(&compiled.programs, 0, args.target.no_overlap, args.target.prefetch())?;
    let bucketed =
        bucket_and_schedule(&compiled.programs, args.bucket_mb, args.target.no_overlap, args.target.prefetch())?;
    let weights = weight_source(None, 0)?;
    let batches = |step: u32| synthetic_tokens(0, u64::from(step), shape.0, shape.1, config.vocab_size);
    let positions: Vec<u32> = (0..shape.1 as u32).collect();
    // The update is outside the timed step; no decay or clipping to perturb the losses compared.
    let adamw = AdamWSettings::from(&AdamWConfig { weight_decay: 0.0, max_grad_norm: None, ..AdamWConfig::default() });
    let options = TrainOptions {
        steps: 1,
        adamw,
        batches: &batches,
        positions: &positions,
        initial: weights.as_ref(),
        moments: None,
        start_step: 0,
        timeout: Duration::from_secs(120),
        link: Some(args.emulate_link),
        native: &[],
        on_step: None,
    };
    // One step's time and loss.
    let step = |programs: &[Program]| -> Result<(f64, Vec<f32>)> {
        let ranks = train_on_threads(programs, &compiled.layouts, &options)?;
        let mut step_s = 0.0_f64;
        for rank in &ranks {
            let first = rank.first_timings.iter().map(|&(start, _)| start).min().unwrap_or(0);
            let last = rank.first_timings.iter().map(|&(_, end)| end).max().unwrap_or(0);
            step_s = step_s.max(last.saturating_sub(first) as f64 / 1e9);
        }
        Ok((step_s, ranks.iter().flat_map(|rank| rank.losses.clone()).collect()))
    };
    let (mut alone_s, mut bucketed_s) = (Vec::new(), Vec::new());
    let mut same_losses = true;
    let repeats = args.repeats;
    let progress =
        crate::progress::Progress::new("bench buckets", "repeat", u64::from(repeats), args.format == Format::Text);
    for repeat in 0..repeats {
        progress.set(u64::from(repeat));
        let (seconds, losses_alone) = step(&alone)?;
        alone_s.push(seconds);
        let (seconds, losses_bucketed) = step(&bucketed)?;
        bucketed_s.push(seconds);
        same_losses &= losses_alone == losses_bucketed;
    }
    progress.finish();
    let (alone_step, bucketed_step) = (median(alone_s), median(bucketed_s));
    let ratio = if alone_step > 0.0 { bucketed_step / alone_step } else { 1.0 };
    let peak = |programs: &[Program]| programs.iter().map(|p| plan(p, ElementSize::Fixed(4)).peak_bytes).max();
    let rows = [
        ("alone", reduction_messages(&alone[0]), alone_step, peak(&alone).unwrap_or(0)),
        ("bucketed", reduction_messages(&bucketed[0]), bucketed_step, peak(&bucketed).unwrap_or(0)),
    ];
    match args.format {
        Format::Json => {
            let row = |(_, messages, step_s, peak): (&str, usize, f64, u64)| json!({ "reduction_messages": messages, "step_s": step_s, "planned_peak_bytes": peak });
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({
                    "schema": SCHEMA,
                    "model": config.name,
                    "mesh": mesh.to_string(),
                    "emulated_link": args.emulate_link.to_string(),
                    "bucket_mb": args.bucket_mb,
                    "repeats": args.repeats,
                    "alone": row(rows[0]),
                    "bucketed": row(rows[1]),
                    "step_ratio": ratio,
                    "same_losses": same_losses,
                }))?
            );
        }
        Format::Text => {
            println!(
                "{} on {} over an emulated {} link, one training step, median of {} runs each:",
                config.name, mesh, args.emulate_link, args.repeats
            );
            println!("  {:<10} {:>20} {:>10} {:>18}", "gradients", "reduction messages", "step ms", "planned peak MiB");
            for (name, messages, step_s, peak) in rows {
                println!("  {name:<10} {messages:>20} {:>10.2} {:>18.2}", step_s * 1e3, peak as f64 / (1 << 20) as f64);
            }
            println!(
                "  step time bucketed ({} MiB) / alone: {ratio:.3}; losses {}",
                args.bucket_mb,
                if same_losses { "bitwise equal" } else { "DIFFER" }
            );
        }
    }
    Ok(())
}
