//! Pipeline schedules as data: each stage's ordered list of (micro-batch, chunk, phase) steps.
//!
//! - **GPipe**: every forward, then every backward.
//! - **1F1B** (PipeDream-flush): stage `s` of `p` runs `p - s - 1` warm-up forwards, then alternates
//!   one forward and one backward, then drains the remaining backwards. At most `p - s` micro-batches
//!   are in flight on stage `s`, against `m` for GPipe.
//! - **Interleaved 1F1B** (Megatron-LM's `forward_backward_pipelining_with_interleaving`): each rank
//!   holds `v` chunks; chunk `c` of stage `s` is virtual stage `c·p + s`. Forwards walk the chunks in
//!   groups of `p` micro-batches (chunk 0 for micro-batches 0..p, then chunk 1 for the same ones...),
//!   backwards walk them in reverse chunk order; the warm-up is `2(p - s - 1) + (v - 1)p` forwards
//!   (all of them when `m = p`). Megatron requires `m` divisible by `p`, and so do we.
//! - **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and
//!   backwards, with each backward split into its input-gradient part `B` (on the critical path) and
//!   its weight-gradient part `W` (not needed by any other stage). Stage `s` defers its `W`s by `s`
//!   backwards, so the last stages, which wait longest at the end of 1F1B, fill that wait with `W`s
//!   while their `B`s hurry upstream. A `W` that is due runs right after its `B`, before the next
//!   forward (1F-1B-1W, as sail-sg's Megatron pops its weight-gradient store after each backward),
//!   so a micro-batch releases what its `W` reads before the next one is forwarded: the first stage
//!   holds `min(p, m)` micro-batches at once, 1F1B's peak, and a later stage, whose `B`s release
//!   early but whose `W`s wait, holds as many, never more.
//!
//! Guarantees: [`Schedule::build`] returns, for every valid input, a schedule in which every
//! micro-batch appears exactly once per phase per virtual stage, in an order that completes.

use std::fmt;

use crate::pipeline::error::{Result, ScheduleError};

/// What a step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// The forward of one micro-batch through one chunk.
    Forward,
    /// The whole backward: input gradient and weight gradient together.
    Backward,
    /// The input-gradient part of the backward (ZB's `B`), which the previous stage waits for.
    BackwardInput,
    /// The weight-gradient part of the backward (ZB's `W`), which no other stage waits for.
    BackwardWeight,
}

impl Phase {
    /// The letter pictures use: `F`, `B` (whole or input part), `W`.
    pub fn letter(self) -> char {
        match self {
            Phase::Forward => 'F',
            Phase::Backward | Phase::BackwardInput => 'B',
            Phase::BackwardWeight => 'W',
        }
    }

    /// The kebab-case name (`forward`, `backward`, `backward-input`, `backward-weight`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::BackwardInput => "backward-input",
            Phase::BackwardWeight => "backward-weight",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One step of a stage: a phase of one micro-batch on one of the stage's chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Step {
    /// The micro-batch, from 0.
    pub micro_batch: u32,
    /// The stage's model chunk, from 0 (always 0 without interleaving).
    pub chunk: u32,
    /// What the step computes.
    pub phase: Phase,
}

impl Step {
    /// A step on chunk 0.
    pub fn new(micro_batch: u32, phase: Phase) -> Step {
        Step { micro_batch, chunk: 0, phase }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of micro-batch {} on chunk {}", self.phase, self.micro_batch, self.chunk)
    }
}

/// Which schedule to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward one backward after a warm-up (PipeDream-flush).
    OneFOneB,
    /// Megatron's interleaved 1F1B with `chunks` model chunks a rank.
    Interleaved {
        /// Model chunks a rank (`v`, at least 2).
        chunks: u32,
    },
    /// Zero-bubble H1: 1F1B with the backward split and the weight gradients deferred.
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// Model chunks a rank (1 unless interleaved).
    pub fn chunks(self) -> u32 {
        match self {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        }
    }

    /// The kebab-case name the CLI takes (`gpipe`, `1f1b`, `interleaved`, `zb-h1`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved { .. } => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        }
    }
}

impl ScheduleKind {
    /// The published closed form of the bubble as bubble time over ideal compute time, for `stages`
    /// ranks, `micro_batches` micro-batches and step costs `forward`, `backward_input`,
    /// `backward_weight` with no point-to-point cost: `(p-1)/m` for GPipe and 1F1B, `(p-1)/(v·m)`
    /// interleaved, and ZB-H1's `(p-1)(F + B - W) / (m(F + B + W))` (Qi et al., section 3).
    pub fn closed_form_bubble(
        self,
        stages: u32,
        micro_batches: u32,
        forward: f64,
        backward_input: f64,
        backward_weight: f64,
    ) -> f64 {
        let (p, m) = (f64::from(stages), f64::from(micro_batches));
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => (p - 1.0) / m,
            ScheduleKind::Interleaved { chunks } => (p - 1.0) / (f64::from(chunks) * m),
            ScheduleKind::ZeroBubbleH1 => {
                let step = forward + backward_input + backward_weight;
                (p - 1.0) * (forward + backward_input - backward_weight) / (m * step)
            }
        }
    }
}

/// A pipeline schedule: every stage's steps, in the order the stage runs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The schedule it was built as.
    pub kind: ScheduleKind,
    /// Pipeline stages (ranks), `p`.
    pub stages: u32,
    /// Micro-batches a step, `m`.
    pub micro_batches: u32,
    /// `per_stage[s]`: stage `s`'s steps in order.
    pub per_stage: Vec<Vec<Step>>,
}

/// The most cells `stages · (micro_batches · chunks + stages)` a schedule is built for: each
/// stage runs its steps and waits out the fill and drain, so its timeline (and `pleat schedule`'s
/// picture row) spans about that many steps. Above any pipeline trained (pp=64 with 4,000
/// micro-batches of 4 chunks is 2^20, built and drawn in seconds), far below what exhausts memory
/// or time (100,000 stages of one micro-batch ran for minutes when the cap counted only steps).
pub const MAX_SCHEDULE_CELLS: u64 = 1 << 20;

impl Schedule {
    /// Builds `kind` for `stages` ranks and `micro_batches` micro-batches.
    pub fn build(kind: ScheduleKind, stages: u32, micro_batches: u32) -> Result<Schedule> {
        if stages == 0 {
            return Err(ScheduleError::Zero { what: "stages" });
        }
        if micro_batches == 0 {
            return Err(ScheduleError::Zero { what: "micro-batches" });
        }
        let chunks = kind.chunks();
        let steps = u64::from(micro_batches) * u64::from(chunks.max(1));
        let cells = u64::from(stages) * (steps + u64::from(stages));
        if cells > MAX_SCHEDULE_CELLS {
            return Err(ScheduleError::TooLarge { stages, micro_batches, chunks, cells });
        }
        let per_stage = match kind {
            ScheduleKind::GPipe => (0..stages).map(|_| gpipe(micro_batches)).collect(),
            ScheduleKind::OneFOneB => (0..stages).map(|stage| one_f_one_b(stages, stage, micro_batches)).collect(),
            ScheduleKind::Interleaved { chunks } => {
                if chunks == 0 {
                    return Err(ScheduleError::Zero { what: "chunks" });
                }
                if chunks < 2 {
                    return Err(ScheduleError::TooFewChunks { chunks });
                }
                if micro_batches % stages != 0 {
                    return Err(ScheduleError::MicroBatchesNotDivisible { micro_batches, stages });
                }
                (0..stages).map(|stage| interleaved(stages, stage, micro_batches, chunks)).collect()
            }
            ScheduleKind::ZeroBubbleH1 => {
                (0..stages).map(|stage| zero_bubble_h1(stages, stage, micro_batches)).collect()
            }
        };
        Ok(Schedule { kind, stages, micro_batches, per_stage })
    }

    /// Model chunks a rank.
    pub fn chunks(&self) -> u32 {
        self.kind.chunks()
    }

    /// Virtual stages: `stages · chunks`.
    pub fn virtual_stages(&self) -> u32 {
        self.stages * self.chunks()
    }
}

fn gpipe(micro_batches: u32) -> Vec<Step> {
    let forwards = (0..micro_batches).map(|mb| Step::new(mb, Phase::Forward));
    let backwards = (0..micro_batches).map(|mb| Step::new(mb, Phase::Backward));
    forwards.chain(backwards).collect()
}

fn one_f_one_b(stages: u32, stage: u32, micro_batches: u32) -> Vec<Step> {
    let warmup = (stages - stage - 1).min(micro_batches);
    let mut steps: Vec<Step> = (0..warmup).map(|mb| Step::new(mb, Phase::Forward)).collect();
    for steady in 0..micro_batches - warmup {
        steps.push(Step::new(warmup + steady, Phase::Forward));
        steps.push(Step::new(steady, Phase::Backward));
    }
    steps.extend((micro_batches - warmup..micro_batches).map(|mb| Step::new(mb, Phase::Backward)));
    steps
}

/// Megatron's interleaved order: the k-th forward (or backward) of a rank, in the numbering of
/// `get_model_chunk_id` and `get_microbatch_id_in_model_chunk`.
fn interleaved_step(stages: u32, chunks: u32, k: u32, phase: Phase) -> Step {
    let in_group = k % (stages * chunks);
    let forward_chunk = in_group / stages;
    let chunk = if phase == Phase::Forward { forward_chunk } else { chunks - 1 - forward_chunk };
    let micro_batch = (k / (stages * chunks)) * stages + k % stages;
    Step { micro_batch, chunk, phase }
}

fn interleaved(stages: u32, stage: u32, micro_batches: u32, chunks: u32) -> Vec<Step> {
    let total = micro_batches * chunks;
    let warmup =
        if micro_batches == stages { total } else { (2 * (stages - stage - 1) + (chunks - 1) * stages).min(total) };
    let forward = |k| interleaved_step(stages, chunks, k, Phase::Forward);
    let backward = |k| interleaved_step(stages, chunks, k, Phase::Backward);
    let mut steps: Vec<Step> = (0..warmup).map(forward).collect();
    for steady in 0..total - warmup {
        steps.push(forward(warmup + steady));
        steps.push(backward(steady));
    }
    steps.extend((total - warmup..total).map(backward));
    steps
}

fn zero_bubble_h1(stages: u32, stage: u32, micro_batches: u32) -> Vec<Step> {
    // The W of a micro-batch waits until `stage` more backwards have run, and then runs right after
    // the B that releases it, before the next forward; the Ws still pending after the last backward
    // close the list.
    let lag = stage;
    let mut steps = Vec::with_capacity(3 * micro_batches as usize);
    let mut next_weight = 0;
    for step in one_f_one_b(stages, stage, micro_batches) {
        if step.phase != Phase::Backward {
            steps.push(step);
            continue;
        }
        steps.push(Step::new(step.micro_batch, Phase::BackwardInput));
        if step.micro_batch >= lag {
            steps.push(Step::new(next_weight, Phase::BackwardWeight));
            next_weight += 1;
        }
    }
    steps.extend((next_weight..micro_batches).map(|mb| Step::new(mb, Phase::BackwardWeight)));
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letters(steps: &[Step]) -> String {
        steps.iter().map(|step| format!("{}{}", step.phase.letter(), step.micro_batch)).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn one_f_one_b_warms_up_p_minus_s_minus_1_forwards() {
        let schedule = Schedule::build(ScheduleKind::OneFOneB, 4, 8).unwrap();
        assert_eq!(letters(&schedule.per_stage[0]), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
        assert_eq!(letters(&schedule.per_stage[3]), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
    }

    #[test]
    fn one_f_one_b_with_fewer_micro_batches_than_stages_is_gpipe() {
        let schedule = Schedule::build(ScheduleKind::OneFOneB, 4, 2).unwrap();
        assert_eq!(letters(&schedule.per_stage[0]), "F0 F1 B0 B1");
        assert_eq!(letters(&schedule.per_stage[2]), "F0 F1 B0 B1");
        assert_eq!(letters(&schedule.per_stage[3]), "F0 B0 F1 B1");
    }

    #[test]
    fn gpipe_runs_every_forward_first() {
        let schedule = Schedule::build(ScheduleKind::GPipe, 2, 3).unwrap();
        assert_eq!(letters(&schedule.per_stage[1]), "F0 F1 F2 B0 B1 B2");
    }

    #[test]
    fn zero_bubble_h1_defers_weights_by_the_stage_index() {
        let schedule = Schedule::build(ScheduleKind::ZeroBubbleH1, 4, 6).unwrap();
        // The first stage keeps W right behind its B, before the next forward (1F-1B-1W); the last
        // one defers three.
        assert_eq!(letters(&schedule.per_stage[0]), "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5");
        assert_eq!(letters(&schedule.per_stage[3]), "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5");
    }

    #[test]
    fn interleaved_follows_megatrons_chunk_order() {
        let schedule = Schedule::build(ScheduleKind::Interleaved { chunks: 2 }, 2, 4).unwrap();
        let chunked = |steps: &[Step]| {
            steps
                .iter()
                .map(|step| format!("{}{}.{}", step.phase.letter(), step.micro_batch, step.chunk))
                .collect::<Vec<_>>()
                .join(" ")
        };
        // Stage 0: warm-up 2·(2-0-1) + (2-1)·2 = 4 forwards: micro-batches 0, 1 on chunk 0, then on chunk 1.
        assert_eq!(
            chunked(&schedule.per_stage[0]),
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
        );
    }

    #[test]
    fn interleaved_rejects_micro_batches_not_divisible_by_stages() {
        let err = Schedule::build(ScheduleKind::Interleaved { chunks: 2 }, 4, 6).unwrap_err();
        assert_eq!(
            err.to_string(),
            "interleaved 1F1B needs micro-batches divisible by the stages, as Megatron requires: 6 is not a multiple of pp=4; use --micro-batches in {4, 8, 12, 16, ...}"
        );
        let err = Schedule::build(ScheduleKind::Interleaved { chunks: 1 }, 4, 8).unwrap_err();
        assert!(err.to_string().contains("use --schedule 1f1b"), "{err}");
        assert_eq!(Schedule::build(ScheduleKind::GPipe, 0, 8).unwrap_err(), ScheduleError::Zero { what: "stages" });
        // A schedule past the cap is refused before any step is built (100,000 stages and
        // micro-batches exhausted memory); one chunk more than the cap's count is refused too.
        let err = Schedule::build(ScheduleKind::OneFOneB, 100_000, 100_000).unwrap_err();
        assert!(matches!(err, ScheduleError::TooLarge { cells: 20_000_000_000, .. }), "{err}");
        // Many stages and one micro-batch: the fill and drain count (this ran for minutes).
        let err = Schedule::build(ScheduleKind::OneFOneB, 100_000, 1).unwrap_err();
        assert!(matches!(err, ScheduleError::TooLarge { cells: 10_000_100_000, .. }), "{err}");
        let stages = 1 << 10;
        let micro_batches = (MAX_SCHEDULE_CELLS / stages) as u32;
        let err = Schedule::build(ScheduleKind::Interleaved { chunks: 2 }, stages as u32, micro_batches).unwrap_err();
        assert!(err.to_string().contains("use fewer micro-batches or stages"), "{err}");
        assert_eq!(Schedule::build(ScheduleKind::GPipe, 2, 8).unwrap().per_stage.len(), 2);
    }
}
