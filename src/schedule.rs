//! `pleat schedule`: a pipeline schedule as a picture (one row a stage, F/B/W blocks on a time
//! axis), its simulated bubble beside the closed form, and the peak micro-batches in flight.
//!
//! Planning only: nothing here executes a pipelined program. The costs are equal stages with a
//! backward twice a forward (for ZB-H1, input and weight gradients one forward each) and free
//! point-to-point transfers, the assumptions under which the closed forms hold.

use anyhow::Result;
use clap::{Args, ValueEnum};
use pleat_passes::pipeline::{render_text, simulate, Schedule, ScheduleKind, StepCosts, Timeline};
use serde_json::{json, Value};

/// The schedules `--schedule` takes.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleName {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward one backward after a warm-up (PipeDream-flush).
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B with --chunks model chunks a rank.
    Interleaved,
    /// Zero-bubble H1: the backward split, weight gradients filling the bubble.
    #[value(name = "zb-h1")]
    #[serde(rename = "zb-h1")]
    ZbH1,
}

impl ScheduleName {
    /// Its name as `--schedule` takes it.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleName::Gpipe => "gpipe",
            ScheduleName::OneFOneB => "1f1b",
            ScheduleName::Interleaved => "interleaved",
            ScheduleName::ZbH1 => "zb-h1",
        }
    }
}

/// Output formats of `schedule`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum ScheduleFormat {
    Text,
    Json,
}

/// The pipeline flags `pleat explain` and `pleat trace` share, read when the mesh has a pp axis.
#[derive(Args, Clone)]
pub struct PipelineFlags {
    /// With a pp axis in --mesh: micro-batches a step (default 2·pp, or the largest count below it
    /// that splits --batch).
    #[arg(long, value_parser = crate::number_flags::count::<u32>)]
    pub micro_batches: Option<u32>,
    /// With a pp axis in --mesh: the pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleName::OneFOneB)]
    pub schedule: ScheduleName,
    /// Model chunks a rank, for --schedule interleaved (default 2).
    #[arg(long, value_parser = crate::number_flags::count::<u32>)]
    pub chunks: Option<u32>,
}

impl PipelineFlags {
    /// The micro-batches a step of `batch` sequences over `stages` stages, each split over
    /// `batch_ranks` ranks: --micro-batches, or the default
    /// (`crate::pipeline::default_micro_batches`).
    pub fn micro_batches_or_default(&self, batch: u64, stages: u32, batch_ranks: u64) -> u32 {
        self.micro_batches.unwrap_or_else(|| crate::pipeline::default_micro_batches(batch, stages, batch_ranks))
    }
}

/// Arguments of `pleat schedule`.
#[derive(Args)]
pub struct ScheduleArgs {
    /// Pipeline stages.
    #[arg(long)]
    pub pp: u32,
    /// Micro-batches a step.
    #[arg(long)]
    pub micro_batches: u32,
    /// The schedule.
    #[arg(long, value_enum, default_value_t = ScheduleName::OneFOneB)]
    pub schedule: ScheduleName,
    /// Model chunks a rank, for --schedule interleaved (default 2).
    #[arg(long)]
    pub chunks: Option<u32>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ScheduleFormat::Text)]
    pub format: ScheduleFormat,
}

/// The costs the picture and the numbers use: a forward is one unit on every virtual stage.
const COSTS: StepCosts = StepCosts::EQUAL_STAGES;

/// The schedule `args` ask for.
pub fn kind_of(args: &ScheduleArgs) -> Result<ScheduleKind> {
    crate::pipeline::schedule_kind(args.schedule, args.chunks)
}

/// The closed form's formula, in words, and its value as bubble over ideal compute: `None` where
/// it does not hold (ZB-H1's assumes a steady state, at least as many micro-batches as stages).
fn closed_form(kind: ScheduleKind, stages: u32, micro_batches: u32) -> (&'static str, Option<f64>) {
    let formula = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => "(p-1)/m",
        ScheduleKind::Interleaved { .. } => "(p-1)/(v*m)",
        ScheduleKind::ZeroBubbleH1 => "(p-1)(F+B-W)/(m(F+B+W))",
    };
    if kind == ScheduleKind::ZeroBubbleH1 && micro_batches < stages {
        return (formula, None);
    }
    let value =
        kind.closed_form_bubble(stages, micro_batches, COSTS.forward, COSTS.backward_input, COSTS.backward_weight);
    (formula, Some(value))
}

/// The schedule, simulated.
pub fn build(args: &ScheduleArgs) -> Result<(ScheduleKind, Timeline)> {
    let kind = kind_of(args)?;
    let schedule = Schedule::build(kind, args.pp, args.micro_batches)?;
    Ok((kind, simulate(&schedule, &COSTS)?))
}

/// The text report.
pub fn text(args: &ScheduleArgs) -> Result<String> {
    schedule_text(kind_of(args)?, args.pp, args.micro_batches)
}

/// `kind`'s report on `stages` ranks and `micro_batches` micro-batches: a title, the costs, the
/// picture, the simulated bubble beside the closed form, the peak in flight (what `pleat schedule`
/// prints, and `pleat explain` for a mesh with pp).
pub fn schedule_text(kind: ScheduleKind, stages: u32, micro_batches: u32) -> Result<String> {
    let timeline = simulate(&Schedule::build(kind, stages, micro_batches)?, &COSTS)?;
    let chunks = match kind {
        ScheduleKind::Interleaved { chunks } => format!(", chunks={chunks}"),
        _ => String::new(),
    };
    let mut out = format!("{} schedule: pp={stages}, micro-batches={micro_batches}{chunks}\n", kind.name());
    out.push_str(
        "costs a step on every stage, in units of one forward: forward 1, backward 2 \
         (input gradient 1 + weight gradient 1), p2p 0\n\n",
    );
    out.push_str(&render_text(&timeline, &COSTS));
    let blocks = if kind == ScheduleKind::ZeroBubbleH1 {
        "F forward, B input gradient, W weight gradient"
    } else {
        "F forward, B backward"
    };
    let chunk_note = if timeline.chunks > 1 { " (:c the chunk)" } else { "" };
    out.push_str(&format!("{blocks}, each with its micro-batch{chunk_note}; . idle\n\n"));
    let (formula, closed) = closed_form(kind, stages, micro_batches);
    out.push_str(&format!(
        "bubble: simulated {:.4} of ideal compute ({:.2}% of the step)\n",
        timeline.bubble_over_compute,
        100.0 * timeline.bubble_share
    ));
    out.push_str(&match closed {
        Some(closed) => {
            format!(
                "        closed form {formula} = {closed:.4} ({:.2}% of the step)\n",
                100.0 * closed / (1.0 + closed)
            )
        }
        None => format!("        closed form {formula} holds for m >= p only, not m={micro_batches} < p={stages}\n"),
    });
    out.push_str(&format!(
        "step: {} units, ideal compute {} a stage, bubble {}\n",
        timeline.makespan, timeline.ideal_compute, timeline.bubble
    ));
    let peaks: Vec<String> =
        timeline.peak_in_flight.iter().enumerate().map(|(stage, peak)| format!("stage {stage}: {peak}")).collect();
    let unit = if timeline.chunks > 1 { "(micro-batch, chunk) pairs" } else { "micro-batches" };
    let until = if kind == ScheduleKind::ZeroBubbleH1 { "weight gradient not yet run" } else { "not yet backward" };
    out.push_str(&format!("peak in flight ({unit} forwarded, {until}): {}\n", peaks.join(", ")));
    Ok(out)
}

/// The JSON report: the same numbers and every step's times.
pub fn json(args: &ScheduleArgs) -> Result<Value> {
    let (kind, timeline) = build(args)?;
    let (formula, closed) = closed_form(kind, args.pp, args.micro_batches);
    let stages: Vec<Value> = timeline
        .per_stage
        .iter()
        .enumerate()
        .map(|(stage, steps)| {
            json!({
                "stage": stage,
                "busy": timeline.busy[stage],
                "idle": timeline.idle[stage],
                "peak_in_flight": timeline.peak_in_flight[stage],
                "steps": steps.iter().map(|timed| json!({
                    "phase": timed.step.phase.name(),
                    "micro_batch": timed.step.micro_batch,
                    "chunk": timed.step.chunk,
                    "start": timed.start,
                    "end": timed.end,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    Ok(json!({
        "schedule": kind.name(),
        "pp": args.pp,
        "micro_batches": args.micro_batches,
        "chunks": timeline.chunks,
        "costs": {
            "forward": COSTS.forward,
            "backward_input": COSTS.backward_input,
            "backward_weight": COSTS.backward_weight,
            "p2p": COSTS.p2p,
        },
        "makespan": timeline.makespan,
        "ideal_compute": timeline.ideal_compute,
        "bubble": timeline.bubble,
        "bubble_over_compute": timeline.bubble_over_compute,
        "bubble_share": timeline.bubble_share,
        // Null figures where the formula does not hold (ZB-H1 with m < p).
        "closed_form": {
            "formula": formula,
            "holds": closed.is_some(),
            "bubble_over_compute": closed,
            "bubble_share": closed.map(|closed| closed / (1.0 + closed)),
        },
        "peak_in_flight": timeline.peak_in_flight,
        "stages": stages,
    }))
}

/// Runs `pleat schedule`.
pub fn schedule(args: &ScheduleArgs) -> Result<()> {
    match args.format {
        ScheduleFormat::Text => print!("{}", text(args)?),
        ScheduleFormat::Json => crate::json_output::print(json(args)?)?,
    }
    Ok(())
}
