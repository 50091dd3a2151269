//! Chrome trace-event JSON (what ui.perfetto.dev and chrome://tracing open) of a run's timeline,
//! and `pleat trace`, which writes the cost model's predicted timeline, or with a pp axis the
//! measured one of a pipelined training step and its picture (one row of F/B/W blocks a stage).
//!
//! One process a rank (`rank N`), two threads a process: `compute` (tid 0: kernels and loads) and
//! `comm` (tid 1: collectives, broadcasts, sends, receives). Each instruction is one complete
//! (`"ph": "X"`) slice named by its op and buffer (`matmul layer0.q`), with its bytes, flops and
//! instruction index in `args`. Bookkeeping instructions (`Output`, `Free`) are left out. Files
//! are written to a temporary sibling and renamed, so a reader never sees half a trace.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use pleat_backend::Program;
use pleat_ir::model::stream::synthetic_tokens;
use pleat_ir::{AxisName, Mesh};
use pleat_passes::cost::HardwareSpec;
use pleat_passes::pipeline::{drawing_costs, measured_timeline, render_text, TimedStep};
use pleat_passes::Dump;
use pleat_runtime::{run_on_threads, RankOutcome, RunInputs};
use serde_json::{json, Value};

use crate::compile::ModelOnMesh;
use crate::compile::{DEFAULT_BATCH, DEFAULT_SEQ};
use crate::compiled_dir::read_compiled;
use crate::model_arg::{resolve, ModelSource};
use crate::predict::{describe, overlap_programs, predict, summarize, Stream, Work};

/// Arguments of `pleat trace`.
#[derive(Args)]
pub struct TraceArgs {
    /// The model, mesh, strategy and input size (MODEL may also be a compiled directory, whose
    /// own mesh and sizes then apply).
    #[command(flatten)]
    pub target: ModelOnMesh,
    /// Built-in hardware the prediction is for: h100-sxm, h200, a100-80gb, mi300x, cpu.
    #[arg(long, default_value = "h100-sxm")]
    pub hw: String,
    /// The trace file to write (Chrome trace-event JSON).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub pipeline: crate::schedule::PipelineFlags,
}

/// One slice of a trace: what ran, on which rank, when (microseconds).
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    /// The rank (the trace's process).
    pub rank: u32,
    /// The instruction's index in the rank's program.
    pub instr: usize,
    /// What it did (its stream is the trace's thread).
    pub work: Work,
    /// Start, microseconds.
    pub start_us: f64,
    /// Duration, microseconds.
    pub duration_us: f64,
}

/// The measured slices of a run: `programs` in rank order, `outcomes` their ranks' outcomes. Each
/// rank's prefetches show on the track of the stream they ran on, as its outcome says.
pub fn measured_slices(programs: &[Program], outcomes: &[RankOutcome]) -> Result<Vec<Slice>> {
    let mut slices = Vec::new();
    for outcome in outcomes {
        let streams = if outcome.prefetch_stream { RunStreams::Two } else { RunStreams::One };
        slices.extend(timed_slices(programs, &[(outcome.rank, outcome.timings.as_slice())], streams)?);
    }
    Ok(slices)
}

/// The communication streams the ranks of a measured run had, which decides the track of a
/// program's prefetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStreams {
    /// Two (the threads communicator, and MPI with `MPI_THREAD_MULTIPLE`): prefetches ran on a
    /// thread of their own.
    Two,
    /// One (an MPI library that only serializes calls, or transfers run on the rank's own thread,
    /// as the CUDA runtime runs them): prefetches ran in the order they were started, among the
    /// other transfers, and show on the comm track.
    One,
}

/// The slices of each rank's instruction timings (`(rank, timings)`, nanoseconds since one epoch),
/// from a run whose ranks had `streams`.
pub fn timed_slices(programs: &[Program], ranks: &[(u32, &[(u64, u64)])], streams: RunStreams) -> Result<Vec<Slice>> {
    let mut slices = Vec::new();
    for &(rank, timings) in ranks {
        let Some(program) = programs.get(rank as usize) else {
            bail!(crate::usage::UsageError::RankWithoutProgram { rank, programs: programs.len() });
        };
        for (index, (instr, &(start_ns, end_ns))) in program.instructions.iter().zip(timings).enumerate() {
            if let Some(mut work) = describe(program, instr) {
                if streams == RunStreams::One && work.stream == Stream::Prefetch {
                    work.stream = Stream::Comm;
                }
                slices.push(Slice {
                    rank,
                    instr: index,
                    work,
                    start_us: start_ns as f64 / 1e3,
                    duration_us: end_ns.saturating_sub(start_ns) as f64 / 1e3,
                });
            }
        }
    }
    Ok(slices)
}

/// The cost model's predicted slices of `programs` on `hw`.
pub fn predicted_slices(programs: &[Program], hw: &HardwareSpec) -> Result<Vec<Slice>> {
    let timelines = predict(programs, hw)?;
    Ok(programs
        .iter()
        .zip(timelines)
        .flat_map(|(program, timeline)| {
            timeline.into_iter().map(move |predicted| Slice {
                rank: program.rank,
                instr: predicted.instr,
                work: predicted.work,
                start_us: predicted.start_s * 1e6,
                duration_us: (predicted.end_s - predicted.start_s).max(0.0) * 1e6,
            })
        })
        .collect())
}

/// The trace-event document of `slices` over `ranks` ranks: metadata naming every process and its
/// threads (compute, comm, and prefetch where it has prefetches), then one complete event a slice.
#[cfg(test)]
fn chrome_trace(slices: &[Slice], ranks: u32) -> Value {
    let mut events = metadata_events(slices, ranks);
    events.extend(slices.iter().map(slice_event));
    json!({"traceEvents": events, "displayTimeUnit": "ns"})
}

/// The metadata events of a Chrome trace: each rank's process and its tracks' names (the
/// prefetch stream's where `slices` use it).
fn metadata_events(slices: &[Slice], ranks: u32) -> Vec<Value> {
    let mut events = Vec::with_capacity(3 * ranks as usize);
    // The prefetch stream's track only where the rank has one.
    let with_prefetches: std::collections::HashSet<u32> =
        slices.iter().filter(|slice| slice.work.stream == Stream::Prefetch).map(|slice| slice.rank).collect();
    for rank in 0..ranks {
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": format!("rank {rank}")}}),
        );
        events.push(
            json!({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}),
        );
        let prefetches = with_prefetches.contains(&rank);
        let tracks = [(Stream::Compute, "compute"), (Stream::Comm, "comm"), (Stream::Prefetch, "prefetch")];
        for (stream, name) in tracks.into_iter().filter(|&(stream, _)| stream != Stream::Prefetch || prefetches) {
            events.push(
                json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": stream as u32, "args": {"name": name}}),
            );
        }
    }
    events
}

/// A slice as a Chrome trace complete event.
fn slice_event(slice: &Slice) -> Value {
    json!({
        "ph": "X",
        "name": slice.work.name(),
        "cat": slice.work.op,
        "pid": slice.rank,
        "tid": slice.work.stream as u32,
        "ts": slice.start_us,
        "dur": slice.duration_us,
        "args": {"bytes": slice.work.bytes, "flops": slice.work.flops, "instr": slice.instr},
    })
}

/// Writes the Chrome trace of `slices` over `ranks` ranks to `path`, through a temporary sibling
/// and a rename, one event at a time: the trace of 256 ranks of a 32-layer model is 140 MB of
/// text, and built as one JSON value first it took several times that in memory.
pub fn write_chrome_trace(path: &Path, slices: &[Slice], ranks: u32) -> Result<()> {
    crate::checkpoint::write_atomically_with(path, |writer| {
        writer.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[")?;
        let metadata = metadata_events(slices, ranks).into_iter();
        for (index, event) in metadata.chain(slices.iter().map(slice_event)).enumerate() {
            if index > 0 {
                writer.write_all(b",")?;
            }
            serde_json::to_writer(&mut *writer, &event)?;
        }
        writer.write_all(b"]}")
    })
}

/// Writes the measured trace of a run.
pub fn write_measured(path: &Path, programs: &[Program], outcomes: &[RankOutcome]) -> Result<()> {
    let slices = measured_slices(programs, outcomes)?;
    write_chrome_trace(path, &slices, programs.len() as u32)
}

/// With a pp axis: runs one pipelined training step on threads, writes its measured trace, and
/// prints its timeline as one row of F/B/W blocks a stage (inner rank 0 of each stage).
fn trace_pipeline(args: &TraceArgs, mesh: &Mesh) -> Result<()> {
    let config = args.target.config("trace")?;
    let stages = mesh.degree(AxisName::Pp) as u32;
    let batch_ranks = crate::pipeline::batch_ranks(mesh);
    let micro_batches = args.pipeline.micro_batches_or_default(args.target.batch, stages, batch_ranks);
    let training = crate::train::TrainPlanFlags {
        micro_batches: Some(micro_batches),
        schedule: Some(args.pipeline.schedule),
        chunks: args.pipeline.chunks,
        ..Default::default()
    }
    .plan();
    let shape = (args.target.batch, args.target.seq);
    let compiled = crate::train::compile_training(
        &config,
        shape,
        mesh,
        args.target.strategy,
        &training,
        crate::compile::Kernels::Interpreted,
        pleat_passes::Dump::Nothing,
    )?;
    let tokens = synthetic_tokens(0, 0, shape.0, shape.1, config.vocab_size);
    let positions: Vec<u32> = (0..shape.1 as u32).collect();
    let weights = crate::run::weight_source(None, 0)?;
    let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: weights.as_ref(), epoch: Instant::now() };
    // The step runs for real, so a model too large for this machine is refused, as `pleat run` is.
    crate::run::ensure_threads_fit(&compiled.programs)?;
    let outcomes = run_on_threads(&compiled.programs, &inputs, Duration::from_secs(600))?;
    write_measured(&args.out, &compiled.programs, &outcomes)?;
    let inner = compiled.programs.len() as u32 / stages;
    let mut per_stage = Vec::with_capacity(stages as usize);
    for stage in 0..stages {
        let rank = stage * inner;
        let Some(outcome) = outcomes.iter().find(|outcome| outcome.rank == rank) else {
            bail!(crate::usage::UsageError::RankWithoutProgram { rank, programs: compiled.programs.len() });
        };
        let spans = compiled.step_spans.get(rank as usize).map_or(&[][..], Vec::as_slice);
        let steps: Vec<TimedStep> = spans
            .iter()
            .filter_map(|span| {
                // A step starts its compute once its receives are in: waiting for them is idle.
                let program = &compiled.programs[rank as usize];
                let first = span
                    .instructions
                    .clone()
                    .find(|&at| !matches!(program.instructions[at], pleat_backend::Instr::Recv { .. }))?;
                let (start, _) = *outcome.timings.get(first)?;
                let (_, end) = *outcome.timings.get(span.instructions.end.checked_sub(1)?)?;
                let step = pleat_passes::pipeline::Step::from(span.step);
                Some(TimedStep { step, start: start as f64 / 1e3, end: end as f64 / 1e3 })
            })
            .collect();
        per_stage.push(steps);
    }
    let chunks = compiled.step_spans.iter().flatten().map(|span| span.step.chunk + 1).max().unwrap_or(1);
    let timeline = measured_timeline(per_stage, micro_batches, chunks);
    let kind = crate::pipeline::schedule_kind(args.pipeline.schedule, args.pipeline.chunks)?;
    println!(
        "wrote the measured trace of one {} training step of {} on {mesh} ({micro_batches} micro-batches) to {}",
        kind.name(),
        config.name,
        args.out.display()
    );
    println!("measured timeline, one row a stage (its inner rank 0), step {:.0} us:\n", timeline.makespan);
    print!("{}", render_text(&timeline, &drawing_costs(&timeline, 100)));
    let blocks = if kind == pleat_passes::pipeline::ScheduleKind::ZeroBubbleH1 {
        "F forward, B input gradient, W weight gradient"
    } else {
        "F forward, B backward"
    };
    let chunk_note = if chunks > 1 { " (:c the chunk)" } else { "" };
    println!("{blocks}, each with its micro-batch{chunk_note}, from its first instruction after its receives; . idle");
    let idle: Vec<String> = timeline
        .idle
        .iter()
        .enumerate()
        .map(|(stage, idle)| format!("stage {stage}: {:.1}%", 100.0 * idle / timeline.makespan.max(f64::MIN_POSITIVE)))
        .collect();
    println!("idle share of the step: {}", idle.join(", "));
    println!("bubble: {:.4} of the busiest stage's compute", timeline.bubble_over_compute);
    Ok(())
}

/// Runs `pleat trace`.
pub fn trace(args: &TraceArgs) -> Result<()> {
    crate::checkpoint::check_output_file(&args.out, "--out")?;
    let mesh = Mesh::parse(&args.target.mesh)?;
    if mesh.degree(AxisName::Pp) > 1 && !matches!(resolve(&args.target.model)?, ModelSource::Compiled(_)) {
        return trace_pipeline(args, &mesh);
    }
    let hw = HardwareSpec::builtin(&args.hw)?;
    // The programs as lowered (every transfer blocking) and as the overlap scheduler orders them
    // for `hw`; a compiled directory is traced as it was compiled.
    let (blocking, programs) = match resolve(&args.target.model)? {
        ModelSource::Compiled(dir) => {
            let compiled = read_compiled(&dir)?;
            let target = &args.target;
            // `--seq` and `--batch` have defaults: only a value other than the default is known
            // to be asked for.
            let asked = |value: u64, default: u64| (value != default).then_some(value);
            let sizes = (asked(target.batch, DEFAULT_BATCH), asked(target.seq, DEFAULT_SEQ));
            crate::run::check_flags_against_plan(&target.mesh, target.strategy, sizes, &compiled.plan)?;
            crate::compiled_dir::check_schedule_flags(target.no_overlap, target.comm_streams, &compiled.programs)?;
            let pipeline = &args.pipeline;
            let given = crate::train::TrainPlanFlags {
                micro_batches: pipeline.micro_batches,
                // `--schedule` has a default: only another value is known to be asked for.
                schedule: (pipeline.schedule != crate::schedule::ScheduleName::OneFOneB).then_some(pipeline.schedule),
                chunks: pipeline.chunks,
                ..Default::default()
            };
            match &compiled.plan.training {
                Some(training) => given.check_against(&dir, training)?,
                None => {
                    let flag = [
                        ("--micro-batches", given.micro_batches.is_some()),
                        ("--schedule", given.schedule.is_some()),
                        ("--chunks", given.chunks.is_some()),
                    ]
                    .into_iter()
                    .find(|(_, given)| *given);
                    if let Some((flag, _)) = flag {
                        bail!(crate::usage::UsageError::PipelineFlagWithoutPp { flag: flag.to_string() });
                    }
                }
            }
            (None, compiled.programs)
        }
        ModelSource::Config { config, .. } => {
            let mesh = Mesh::parse(&args.target.mesh)?;
            let target = &args.target;
            let lowered = crate::compile::compile_model(
                &config,
                target.batch,
                target.seq,
                &mesh,
                target.strategy,
                Dump::Nothing,
                crate::compile::Kernels::Interpreted,
            )?
            .programs;
            let scheduled =
                if target.no_overlap { lowered.clone() } else { overlap_programs(&lowered, &hw, target.prefetch())? };
            (Some(lowered), scheduled)
        }
    };
    let slices = predicted_slices(&programs, &hw)?;
    write_chrome_trace(&args.out, &slices, programs.len() as u32)?;
    let step_us = slices.iter().map(|slice| slice.start_us + slice.duration_us).fold(0.0, f64::max);
    println!(
        "wrote the predicted trace of {} rank(s) on {} to {}: {} slices, step {:.1} us",
        programs.len(),
        hw.name,
        args.out.display(),
        slices.len(),
        step_us
    );
    let traced = summarize(&predict(&programs, &hw)?);
    if let Some(blocking) = blocking.filter(|_| !args.target.no_overlap) {
        let before = summarize(&predict(&blocking, &hw)?);
        println!(
            "predicted step: {:.1} us with overlap, {:.1} us with every transfer blocking; exposed communication {:.1} us of {:.1} us (blocking: {:.1} us)",
            traced.step_s * 1e6,
            before.step_s * 1e6,
            traced.exposed_comm_s * 1e6,
            traced.comm_s * 1e6,
            before.exposed_comm_s * 1e6
        );
    } else {
        println!(
            "predicted step: {:.1} us; exposed communication {:.1} us of {:.1} us",
            traced.step_s * 1e6,
            traced.exposed_comm_s * 1e6,
            traced.comm_s * 1e6
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(stream: Stream, op: &'static str, what: &str) -> Work {
        Work { stream, op, what: what.into(), bytes: 64, flops: 0, collective: None, ranks: Vec::new() }
    }

    #[test]
    fn every_rank_gets_a_process_two_threads_and_its_slices() {
        let slices = vec![
            Slice {
                rank: 1,
                instr: 3,
                work: work(Stream::Comm, "all_reduce", "layer0.o"),
                start_us: 2.0,
                duration_us: 1.5,
            },
            Slice {
                rank: 0,
                instr: 0,
                work: work(Stream::Compute, "add", "layer0.x"),
                start_us: 0.0,
                duration_us: 0.5,
            },
        ];
        let trace = chrome_trace(&slices, 2);
        let events = trace["traceEvents"].as_array().unwrap();
        // 4 metadata events a rank, then one complete event a slice, in order.
        assert_eq!(events.len(), 2 * 4 + 2);
        let thread_names: Vec<(u64, u64, &str)> = events
            .iter()
            .filter(|event| event["name"] == "thread_name")
            .map(|event| {
                (
                    event["pid"].as_u64().unwrap(),
                    event["tid"].as_u64().unwrap(),
                    event["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(thread_names, vec![(0, 0, "compute"), (0, 1, "comm"), (1, 0, "compute"), (1, 1, "comm")]);
        let first = &events[8];
        assert_eq!(first["ph"], "X");
        assert_eq!(first["name"], "all_reduce layer0.o");
        assert_eq!((first["pid"].as_u64(), first["tid"].as_u64()), (Some(1), Some(1)));
        assert_eq!((first["ts"].as_f64(), first["dur"].as_f64()), (Some(2.0), Some(1.5)));
        assert_eq!(first["args"]["bytes"], 64);
        assert_eq!(events[9]["tid"], 0);
    }

    #[test]
    fn written_traces_parse_and_leave_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("pleat-trace-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        write_chrome_trace(&path, &[], 1).unwrap();
        let parsed: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(parsed["traceEvents"].as_array().unwrap().len(), 4);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // Streamed event by event, the file holds what `chrome_trace` builds as one value.
        let slices = [Slice {
            rank: 1,
            instr: 3,
            work: work(Stream::Prefetch, "all_gather", "w"),
            start_us: 1.0,
            duration_us: 2.0,
        }];
        write_chrome_trace(&path, &slices, 2).unwrap();
        let parsed: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(parsed, chrome_trace(&slices, 2));
        assert_eq!(parsed["traceEvents"].as_array().unwrap().len(), 2 * 4 + 1 + 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
