//! `pleat bench overlap`: the same plan run with its transfers blocking and as the overlap
//! scheduler orders them, side by side over an emulated link, and what the scheduler hid.
//!
//! Both programs come from one compile: the lowered ones (every transfer blocking) and the same
//! scheduled by `pleat_backend::overlap`, its costs from the `cpu` spec with the emulated link as
//! its link. Runs alternate (blocking, scheduled, blocking, ...) so that both see the same machine,
//! and each figure is the median over `--repeats`. Measured, a rank a run:
//! - the step: from its first instruction's start to its last one's end, the slowest rank's;
//! - the exposed communication: the time its compute stream was held by communication (every
//!   blocking transfer but a send, which never waits, and every `Wait`), the most of any rank.
//!
//! DESIGN's convention is reported too, from step times alone: each program is also run without
//! the emulated link (communication at memory speed, nearly switched off); the link's cost to the
//! blocking program is its serial communication, to the scheduled one its exposed communication,
//! and the fraction hidden is `1 - exposed / serial`.
//!
//! Beside each measured step is the cost model's prediction of the same programs
//! (`crate::predict`) on the spec the scheduler used (`--hw-file`, e.g. from `pleat bench
//! calibrate`, with the emulated link), and its error: the predicted timeline's end, or the
//! core-seconds its kernels and message copies need over this machine's cores if more.
//!
//! The fraction hidden is `1 - exposed(scheduled) / exposed(blocking)`: of the communication the
//! blocking program waits for, the share the scheduled one no longer waits for. It is also given
//! for the weights that move (broadcasts and point-to-point messages: TSP's owner blocks and ring
//! shards), the part of TSP's communication that exists to be hidden.

use anyhow::{bail, Context, Result};
use clap::Args;
use pleat_backend::{Instr, Program};
use pleat_passes::cost::HardwareSpec;
use pleat_passes::Dump;
use pleat_runtime::comm::LinkSpec;
use pleat_runtime::RankOutcome;
use serde_json::json;

use super::median;
use crate::compile::ModelOnMesh;
use crate::run::{link_options, run_programs, weight_source, Format};
use crate::usage::UsageError;

/// The version of the `--format json` output.
const SCHEMA: &str = "pleat.bench.overlap/1";

/// Arguments of `pleat bench overlap`.
#[derive(Args)]
pub struct OverlapArgs {
    /// The model, mesh, strategy and input size (`--no-overlap` is refused: both are run).
    #[command(flatten)]
    pub target: ModelOnMesh,
    /// The link every message is delivered over, GBPS,US (e.g. `1,20`); pick one under which
    /// communication takes about as long as compute (the report prints both).
    #[arg(long, value_name = "GBPS,US")]
    pub emulate_link: LinkSpec,
    /// Runs of each program (1 or more); the medians are reported.
    #[arg(long, default_value_t = 3, value_parser = crate::number_flags::count::<u32>)]
    pub repeats: u32,
    /// A hardware spec (`pleat bench calibrate --out`) for the scheduler's costs and the
    /// predicted step beside the measured one; its link is replaced by the emulated one.
    /// Default: the built-in `cpu` entry.
    #[arg(long)]
    pub hw_file: Option<std::path::PathBuf>,
    /// Write into this directory the measured and the predicted trace of each program (the last
    /// run over the emulated link): `blocking-measured.json`, `blocking-predicted.json`,
    /// `scheduled-measured.json`, `scheduled-predicted.json`, to see where the prediction differs.
    #[arg(long, value_name = "DIR")]
    pub traces: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// One run's measurements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// The step, seconds.
    pub step_s: f64,
    /// The most seconds any rank's compute stream waited for communication.
    pub exposed_s: f64,
    /// Of those, on the same rank, the seconds waited for weights moving: broadcasts (TSP's
    /// owner blocks) and point-to-point messages (TSP's ring, ring attention's blocks).
    pub exposed_weights_s: f64,
}

/// What a run of `programs` measured (`outcomes` in rank order).
pub fn measure(programs: &[Program], outcomes: &[RankOutcome]) -> Measured {
    let mut measured = Measured { step_s: 0.0, exposed_s: 0.0, exposed_weights_s: 0.0 };
    for (program, outcome) in programs.iter().zip(outcomes) {
        let first = outcome.timings.iter().map(|&(start, _)| start).min().unwrap_or(0);
        let last = outcome.timings.iter().map(|&(_, end)| end).max().unwrap_or(0);
        measured.step_s = measured.step_s.max(last.saturating_sub(first) as f64 / 1e9);
        let pairs = pleat_backend::transfers::pair_transfers(program).unwrap_or_default();
        let (mut held, mut held_weights) = (0u64, 0u64);
        for (index, (instr, &(start, end))) in program.instructions.iter().zip(&outcome.timings).enumerate() {
            // The transfer the compute stream waits for here, if it waits.
            let transfer = match instr {
                Instr::Wait { .. } => pairs.start_of.get(&index).map(|&start| &program.instructions[start]),
                Instr::Send { .. } => None,
                transfer if transfer.is_transfer() && !pairs.wait_of.contains_key(&index) => Some(transfer),
                _ => None,
            };
            let Some(transfer) = transfer else { continue };
            held += end.saturating_sub(start);
            if matches!(transfer, Instr::Broadcast { .. } | Instr::Recv { .. } | Instr::Relay { .. }) {
                held_weights += end.saturating_sub(start);
            }
        }
        if held as f64 / 1e9 > measured.exposed_s {
            measured.exposed_s = held as f64 / 1e9;
            measured.exposed_weights_s = held_weights as f64 / 1e9;
        }
    }
    measured
}

/// The core-seconds `timelines` keep this machine's cores busy: every kernel's time at the rank's
/// `share` of a core, and every transfer's copies (the threads communicator's own link, `own`,
/// without its latency, at a whole core), a point-to-point message's split between its sender and
/// its receiver. The emulated wire's delay and a wait's stall cost none.
fn cores_bound_s(timelines: &[Vec<crate::predict::Predicted>], share: f64, own: &HardwareSpec) -> f64 {
    use crate::predict::Stream;
    use pleat_passes::cost::comm::Collective;
    timelines
        .iter()
        .flatten()
        .map(|slice| match (slice.work.stream, slice.work.collective) {
            (Stream::Compute, _) if slice.work.op == "wait" => 0.0,
            (Stream::Compute, _) => (slice.end_s - slice.start_s) * share,
            // A relay copies its message in and its forward out: a whole message's copies.
            (_, Some(Collective::SendRecv)) if slice.work.op != "relay" => {
                crate::predict::seconds(&slice.work, own, 4) / 2.0
            }
            (Stream::Comm | Stream::Prefetch, _) => crate::predict::seconds(&slice.work, own, 4),
        })
        .sum()
}

/// The link a message of the threads communicator sees over the `emulated` wire, `own_bytes_per_s`
/// and `own_latency_s` the communicator's own (the spec's link, measured by `pleat bench
/// calibrate` between two ranks: the message copied out on one side and in on the other, each
/// copy half of it). The wire's clock starts as the message is handed over, so it carries the
/// message while the sender copies it out, and the receiver copies it in once it has arrived: a
/// byte takes the longer of the wire and the copy out, then the copy in.
fn message_link(emulated: &LinkSpec, own_bytes_per_s: f64, own_latency_s: f64) -> pleat_passes::cost::hw::LinkSpec {
    let copy_s_per_byte = 0.5 / own_bytes_per_s;
    let wire_s_per_byte = 1.0 / emulated.bytes_per_s;
    pleat_passes::cost::hw::LinkSpec {
        bandwidth_bytes_per_s: 1.0 / (wire_s_per_byte.max(copy_s_per_byte) + copy_s_per_byte),
        latency_s: emulated.latency.as_secs_f64() + own_latency_s,
    }
}

/// Runs `pleat bench overlap`.
pub fn run_overlap(args: &OverlapArgs) -> Result<()> {
    if args.target.no_overlap {
        bail!(UsageError::OverlapBenchFlag { flag: "--no-overlap" });
    }
    if let Some(dir) = &args.traces {
        crate::checkpoint::check_output_files_dir(dir, "--traces")?;
    }
    let config = args.target.config("bench overlap")?;
    let mesh = pleat_ir::Mesh::parse(&args.target.mesh)?;
    let (batch, seq) = (args.target.batch, args.target.seq);
    let compiled = crate::compile::compile_model(
        &config,
        batch,
        seq,
        &mesh,
        args.target.strategy,
        Dump::Nothing,
        crate::compile::Kernels::Interpreted,
    )?;
    let mut hw = crate::plan::hardware_of("cpu", args.hw_file.as_deref())?;
    // The ranks are threads of this machine: when there are more than cores, they share them, for
    // their kernels and for the copies their messages cost.
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let share = (cores / compiled.programs.len().max(1) as f64).min(1.0);
    hw.peak_f32_flops *= share;
    hw.peak_bf16_flops *= share;
    hw.hbm_bytes_per_s *= share;
    let own = hw.intra_node;
    let own_bytes_per_s = own.bandwidth_bytes_per_s * hw.efficiency.link * share;
    hw.intra_node = message_link(&args.emulate_link, own_bytes_per_s, own.latency_s);
    hw.efficiency.link = 1.0;
    // Every rank is a thread of this process: whatever node size the spec gives, no group here
    // crosses nodes, and its collectives run over the one (emulated) link.
    hw.gpus_per_node = hw.gpus_per_node.max(compiled.programs.len() as u64);
    hw.inter_node = hw.intra_node;
    let blocking = compiled.programs;
    let prefetch = args.target.prefetch();
    let reported = crate::predict::overlap_programs_reported(&blocking, &hw, prefetch)?;
    let overlapped: usize = reported.iter().map(|(_, report)| report.overlapped).sum();
    let transfers: usize = reported.iter().map(|(_, report)| report.transfers).sum();
    if transfers == 0 {
        bail!(UsageError::OverlapBenchWithoutTransfers { mesh: args.target.mesh.clone() });
    }
    let scheduled: Vec<Program> = reported.into_iter().map(|(program, _)| program).collect();
    let tokens = crate::inputs::random_tokens(batch, seq, config.vocab_size, 0)?;
    let weights = weight_source(None, 0)?;
    let options = link_options(120, Some(args.emulate_link));
    let local = link_options(120, None);
    let (mut off, mut on, mut off_local, mut on_local) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut same_logits = true;
    let mut last_outcomes = (Vec::new(), Vec::new());
    let repeats = args.repeats;
    let progress =
        crate::progress::Progress::new("bench overlap", "repeat", u64::from(repeats), args.format == Format::Text);
    for repeat in 0..repeats {
        progress.set(u64::from(repeat));
        let (_, logits_off, outcomes_off) = run_programs(&blocking, &tokens, weights.as_ref(), &options)?;
        off.push(measure(&blocking, &outcomes_off));
        let (_, logits_on, outcomes_on) = run_programs(&scheduled, &tokens, weights.as_ref(), &options)?;
        on.push(measure(&scheduled, &outcomes_on));
        same_logits &= logits_off == logits_on;
        last_outcomes = (outcomes_off, outcomes_on);
        // Without the emulated link communication costs a memory copy: nearly switched off.
        let (_, _, outcomes) = run_programs(&blocking, &tokens, weights.as_ref(), &local)?;
        off_local.push(measure(&blocking, &outcomes));
        let (_, _, outcomes) = run_programs(&scheduled, &tokens, weights.as_ref(), &local)?;
        on_local.push(measure(&scheduled, &outcomes));
    }
    progress.finish();
    let step = |runs: &[Measured]| median(runs.iter().map(|run| run.step_s).collect());
    let exposed = |runs: &[Measured]| median(runs.iter().map(|run| run.exposed_s).collect());
    let weights = |runs: &[Measured]| median(runs.iter().map(|run| run.exposed_weights_s).collect());
    let (step_off, step_on, exposed_off, exposed_on) = (step(&off), step(&on), exposed(&off), exposed(&on));
    // The cores bound the step too: a scheduled rank copies messages on its communication thread
    // while its kernels run, two busy threads a rank, so what the timeline overlaps still shares
    // the cores (only the emulated wire's delay costs none).
    let mut own_link = hw.clone();
    let full_core = pleat_passes::cost::hw::LinkSpec { bandwidth_bytes_per_s: own_bytes_per_s / share, latency_s: 0.0 };
    (own_link.intra_node, own_link.inter_node) = (full_core, full_core);
    // (An expert dispatch's GEMMs, costed with its messages, at a whole core too.)
    own_link.peak_f32_flops /= share;
    own_link.peak_bf16_flops /= share;
    let predicted = |programs: &[Program]| -> Result<f64> {
        let timelines = crate::predict::predict(programs, &hw)?;
        let timeline_s = crate::predict::summarize(&timelines).step_s;
        Ok(timeline_s.max(cores_bound_s(&timelines, share, &own_link) / cores))
    };
    let (predicted_off, predicted_on) = (predicted(&blocking)?, predicted(&scheduled)?);
    if let Some(dir) = &args.traces {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for (name, programs, outcomes) in
            [("blocking", &blocking, &last_outcomes.0), ("scheduled", &scheduled, &last_outcomes.1)]
        {
            crate::trace::write_measured(&dir.join(format!("{name}-measured.json")), programs, outcomes)?;
            let slices = crate::trace::predicted_slices(programs, &hw)?;
            crate::trace::write_chrome_trace(
                &dir.join(format!("{name}-predicted.json")),
                &slices,
                programs.len() as u32,
            )?;
        }
    }
    let hidden_share = |off: f64, on: f64| if off > 0.0 { 1.0 - on / off } else { 0.0 };
    let hidden = hidden_share(exposed_off, exposed_on);
    let (weights_off, weights_on) = (weights(&off), weights(&on));
    let hidden_weights = hidden_share(weights_off, weights_on);
    let ratio = if step_off > 0.0 { step_on / step_off } else { 1.0 };
    // By step times alone: the link's cost to the blocking program is its serial communication,
    // to the scheduled one its exposed communication.
    let serial_by_steps = step_off - step(&off_local);
    let exposed_by_steps = step_on - step(&on_local);
    let hidden_by_steps = hidden_share(serial_by_steps, exposed_by_steps);
    match args.format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "schema": SCHEMA,
                "model": config.name,
                "mesh": mesh.to_string(),
                "emulated_link": args.emulate_link.to_string(),
                "repeats": args.repeats,
                "comm_streams": args.target.comm_streams,
                "transfers": transfers,
                "overlapped_transfers": overlapped,
                "hardware": hw.name,
                "blocking": { "step_s": step_off, "exposed_comm_s": exposed_off, "exposed_weights_s": weights_off, "predicted_step_s": predicted_off },
                "scheduled": { "step_s": step_on, "exposed_comm_s": exposed_on, "exposed_weights_s": weights_on, "predicted_step_s": predicted_on },
                "step_ratio": ratio,
                "hidden_fraction": hidden,
                "hidden_weights_fraction": hidden_weights,
                "link_cost_s": { "blocking": serial_by_steps, "scheduled": exposed_by_steps },
                "hidden_fraction_by_steps": hidden_by_steps,
                "same_logits": same_logits,
            }))?
        ),
        Format::Text => {
            println!(
                "{} on {} over an emulated {} link, median of {} runs each:",
                config.name, mesh, args.emulate_link, args.repeats
            );
            println!(
                "  {:<10} {:>10} {:>16} {:>20} {:>11} {:>13} {:>7}",
                "program", "step ms", "exposed comm ms", "of it bcast+p2p ms", "compute ms", "predicted ms", "error"
            );
            for (name, step_s, exposed_s, weights_s, predicted_s) in [
                ("blocking", step_off, exposed_off, weights_off, predicted_off),
                ("scheduled", step_on, exposed_on, weights_on, predicted_on),
            ] {
                println!(
                    "  {name:<10} {:>10.2} {:>16.2} {:>20.2} {:>11.2} {:>13.2} {:>6.1}%",
                    step_s * 1e3,
                    exposed_s * 1e3,
                    weights_s * 1e3,
                    (step_s - exposed_s) * 1e3,
                    predicted_s * 1e3,
                    100.0 * (predicted_s - step_s) / step_s
                );
            }
            println!("  predicted on {}", hw.name);
            println!(
                "  by step times: the link costs the blocking program {:.2} ms and the scheduled one {:.2} ms over no link: {:.1}% hidden",
                serial_by_steps * 1e3,
                exposed_by_steps * 1e3,
                hidden_by_steps * 100.0
            );
            println!(
                "  step time scheduled / blocking: {ratio:.3}; communication hidden: {:.1}% (broadcasts and point-to-point: {:.1}%); {overlapped} of {transfers} transfers overlapped; logits {}",
                hidden * 100.0,
                hidden_weights * 100.0,
                if same_logits { "bitwise equal" } else { "DIFFER" }
            );
        }
    }
    if !same_logits {
        anyhow::bail!(crate::usage::UsageError::OverlapChangedNumbers);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::{Predicted, Stream, Work};
    use pleat_passes::cost::comm::Collective;
    use pleat_passes::cost::hw::LinkSpec;

    fn slice(
        stream: Stream,
        op: &'static str,
        collective: Option<Collective>,
        bytes: u64,
        span: (f64, f64),
    ) -> Predicted {
        let work = Work { stream, op, what: "x".into(), bytes, flops: 0, collective, ranks: vec![0, 1] };
        Predicted { instr: 0, work, start_s: span.0, end_s: span.1, exposed_s: 0.0 }
    }

    #[test]
    fn cores_are_kept_busy_by_kernels_at_their_share_and_by_copies_at_a_whole_core() {
        let mut own = HardwareSpec::builtin("cpu").unwrap();
        let link = LinkSpec { bandwidth_bytes_per_s: 1e9, latency_s: 0.0 };
        (own.intra_node, own.inter_node, own.efficiency.link) = (link, link, 1.0);
        // Each of two ranks: a 1 s kernel at half a core (0.5 core-s), a 2 s stall (none), and one
        // side of a 1 GB message (0.5 s of its 1 s of copies); rank 0 also a 2-rank all-gather
        // of 2 GB (1 GB sent and 1 GB received: 1 s).
        let rank = |extra: Vec<Predicted>| {
            let mut slices = vec![
                slice(Stream::Compute, "matmul", None, 0, (0.0, 1.0)),
                slice(Stream::Compute, "wait", None, 0, (1.0, 3.0)),
                slice(Stream::Comm, "send", Some(Collective::SendRecv), 1_000_000_000, (3.0, 9.0)),
            ];
            slices.extend(extra);
            slices
        };
        let gather = slice(Stream::Comm, "all_gather", Some(Collective::AllGather), 2_000_000_000, (9.0, 20.0));
        let timelines = [rank(vec![gather]), rank(Vec::new())];
        let busy = cores_bound_s(&timelines, 0.5, &own);
        assert!((busy - (2.0 * (0.5 + 0.5) + 1.0)).abs() < 1e-9, "{busy}");
    }
    #[test]
    fn a_message_takes_the_longer_of_the_wire_and_its_copy_out_then_its_copy_in() {
        let wire = |gbps: f64| pleat_runtime::comm::LinkSpec {
            bytes_per_s: gbps * 1e9,
            latency: std::time::Duration::from_micros(20),
        };
        // The communicator's own link at 1 GB/s: each copy 0.5 ns a byte.
        // A 1 GB/s wire (1 ns a byte) outlasts the copy out: 1 + 0.5 ns a byte.
        let slow = message_link(&wire(1.0), 1e9, 4e-6);
        assert!((slow.bandwidth_bytes_per_s - 1e9 / 1.5).abs() < 1.0, "{slow:?}");
        assert!((slow.latency_s - 24e-6).abs() < 1e-12, "{slow:?}");
        // A 10 GB/s wire (0.1 ns a byte) hides behind the copy out: 0.5 + 0.5 ns a byte, the
        // communicator's own link.
        let fast = message_link(&wire(10.0), 1e9, 4e-6);
        assert!((fast.bandwidth_bytes_per_s - 1e9).abs() < 1.0, "{fast:?}");
        // Where the two are equal (2 GB/s, 0.5 ns a byte), the same.
        let even = message_link(&wire(2.0), 1e9, 0.0);
        assert!((even.bandwidth_bytes_per_s - 1e9).abs() < 1.0, "{even:?}");
    }
}
