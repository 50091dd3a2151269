//! The dependency-respecting simulation of a schedule: when each step starts and ends, the bubble,
//! and the micro-batches in flight.
//!
//! Rules, with virtual stage `vs = chunk · p + stage`:
//! - `F(m, vs)` starts after `F(m, vs - 1)` ends, plus the point-to-point cost when the two run on
//!   different ranks;
//! - `B(m, vs)` (the whole backward or its input part) starts after `B(m, vs + 1)` ends (plus
//!   point-to-point) and after `F(m, vs)`: the last virtual stage's backward follows its forward;
//! - `W(m, vs)` starts after `B(m, vs)`;
//! - each rank runs its steps in its list order, one at a time, as early as those rules allow.
//!
//! The bubble is the makespan minus the ideal compute time (the busiest rank's compute): what the
//! pipeline's dependencies cost over a step with no waiting. Guarantees: the simulation is exact
//! (event times follow from the rules alone, not from the order ranks are visited), terminates on
//! any input, and reports a schedule that cannot complete as [`ScheduleError::Deadlock`] naming the
//! stage and the step.

use std::collections::HashMap;

use crate::pipeline::error::{Result, ScheduleError};
use crate::pipeline::schedule::{Phase, Schedule, Step};

/// The cost of each step on one virtual stage, in seconds (or any one unit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCosts {
    /// A forward.
    pub forward: f64,
    /// The input-gradient part of a backward (ZB's `B`).
    pub backward_input: f64,
    /// The weight-gradient part of a backward (ZB's `W`).
    pub backward_weight: f64,
    /// Sending an activation or its gradient to the neighbouring rank.
    pub p2p: f64,
}

impl StepCosts {
    /// The costs pleat's picture uses: forward 1, backward 2 (input 1 + weight 1), no p2p.
    pub const EQUAL_STAGES: StepCosts = StepCosts { forward: 1.0, backward_input: 1.0, backward_weight: 1.0, p2p: 0.0 };

    /// The cost of one step of `phase`: a whole backward is its input part plus its weight part.
    pub fn of(&self, phase: Phase) -> f64 {
        match phase {
            Phase::Forward => self.forward,
            Phase::Backward => self.backward_input + self.backward_weight,
            Phase::BackwardInput => self.backward_input,
            Phase::BackwardWeight => self.backward_weight,
        }
    }

    fn check(&self) -> Result<()> {
        let named = [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("p2p", self.p2p),
        ];
        match named.into_iter().find(|(_, value)| !value.is_finite() || *value < 0.0) {
            Some((what, value)) => Err(ScheduleError::BadCost { what, value }),
            None => Ok(()),
        }
    }
}

/// One step with its simulated start and end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedStep {
    /// The step.
    pub step: Step,
    /// When it starts.
    pub start: f64,
    /// When it ends.
    pub end: f64,
}

/// The result of [`simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Pipeline stages (ranks).
    pub stages: u32,
    /// Model chunks a rank.
    pub chunks: u32,
    /// Micro-batches.
    pub micro_batches: u32,
    /// `per_stage[s]`: stage `s`'s steps with their times, in the stage's order.
    pub per_stage: Vec<Vec<TimedStep>>,
    /// When the last step ends (the first starts at 0).
    pub makespan: f64,
    /// `busy[s]`: stage `s`'s compute time.
    pub busy: Vec<f64>,
    /// `idle[s]`: `makespan - busy[s]`.
    pub idle: Vec<f64>,
    /// The busiest stage's compute: the step time with no waiting.
    pub ideal_compute: f64,
    /// `makespan - ideal_compute`.
    pub bubble: f64,
    /// `bubble / ideal_compute`: the usual `(p-1)/m` form.
    pub bubble_over_compute: f64,
    /// `bubble / makespan`: the bubble's share of the step, `(p-1)/(m+p-1)` for 1F1B.
    pub bubble_share: f64,
    /// `peak_in_flight[s]`: the most (micro-batch, chunk) pairs stage `s` has forwarded and not yet
    /// run the backward (or its input part) of: the activations it holds at once.
    pub peak_in_flight: Vec<u32>,
}

/// Checks that `schedule` runs every step the pipeline needs exactly once, and no other.
pub fn check_complete(schedule: &Schedule) -> Result<()> {
    let chunks = schedule.chunks();
    for (stage, steps) in schedule.per_stage.iter().enumerate() {
        let stage = stage as u32;
        let mut seen: HashMap<Step, usize> = HashMap::new();
        for (index, step) in steps.iter().enumerate() {
            if step.micro_batch >= schedule.micro_batches || step.chunk >= chunks {
                return Err(ScheduleError::StepOutOfRange {
                    stage,
                    index,
                    step: *step,
                    micro_batches: schedule.micro_batches,
                    chunks,
                });
            }
            if let Some(first) = seen.insert(*step, index) {
                return Err(ScheduleError::DuplicateStep { stage, step: *step, first, second: index });
            }
        }
        for chunk in 0..chunks {
            for micro_batch in 0..schedule.micro_batches {
                let has = |phase| seen.contains_key(&Step { micro_batch, chunk, phase });
                let missing = |phase| Err(ScheduleError::MissingStep { stage, step: Step { micro_batch, chunk, phase } });
                if !has(Phase::Forward) {
                    return missing(Phase::Forward);
                }
                let split = has(Phase::BackwardInput) || has(Phase::BackwardWeight);
                match (has(Phase::Backward), split) {
                    (true, true) => return Err(ScheduleError::MixedBackward { stage, micro_batch, chunk }),
                    (false, false) => return missing(Phase::Backward),
                    (false, true) if !has(Phase::BackwardInput) => return missing(Phase::BackwardInput),
                    (false, true) if !has(Phase::BackwardWeight) => return missing(Phase::BackwardWeight),
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// Where a step's input comes from: the step it waits for, on which stage, and whether the wait
/// crosses ranks (and so pays the point-to-point cost).
struct Dependency {
    step: Step,
    stage: u32,
    crosses_ranks: bool,
}

/// Simulates `schedule` with `costs` a step on each virtual stage.
pub fn simulate(schedule: &Schedule, costs: &StepCosts) -> Result<Timeline> {
    costs.check()?;
    check_complete(schedule)?;
    let stages = schedule.stages;
    let chunks = schedule.chunks();
    let virtual_stages = stages * chunks;
    let n_stages = stages as usize;
    // End times of forwards and of input gradients, keyed by (micro-batch, virtual stage).
    let mut forward_end: HashMap<(u32, u32), f64> = HashMap::new();
    let mut input_grad_end: HashMap<(u32, u32), f64> = HashMap::new();
    let mut next_index = vec![0usize; n_stages];
    let mut free_at = vec![0.0f64; n_stages];
    let mut timed: Vec<Vec<TimedStep>> = vec![Vec::new(); n_stages];

    let dependencies = |stage: u32, step: Step| -> Vec<Dependency> {
        let virtual_stage = step.chunk * stages + stage;
        let at = |virtual_stage: u32, phase| Dependency {
            step: Step { micro_batch: step.micro_batch, chunk: virtual_stage / stages, phase },
            stage: virtual_stage % stages,
            crosses_ranks: virtual_stage % stages != stage,
        };
        match step.phase {
            Phase::Forward if virtual_stage == 0 => vec![],
            Phase::Forward => vec![at(virtual_stage - 1, Phase::Forward)],
            Phase::Backward | Phase::BackwardInput => {
                let mut deps = vec![at(virtual_stage, Phase::Forward)];
                if virtual_stage + 1 < virtual_stages {
                    deps.push(at(virtual_stage + 1, Phase::Backward));
                }
                deps
            }
            Phase::BackwardWeight => vec![at(virtual_stage, Phase::BackwardInput)],
        }
    };
    let end_of = |forward_end: &HashMap<(u32, u32), f64>, input_grad_end: &HashMap<(u32, u32), f64>, dep: &Dependency| {
        let key = (dep.step.micro_batch, dep.step.chunk * stages + dep.stage);
        match dep.step.phase {
            Phase::Forward => forward_end.get(&key).copied(),
            // A whole backward or its input part both deliver the input gradient.
            _ => input_grad_end.get(&key).copied(),
        }
    };

    loop {
        let mut progressed = false;
        for stage in 0..stages {
            let rank = stage as usize;
            while let Some(&step) = schedule.per_stage[rank].get(next_index[rank]) {
                let mut ready = free_at[rank];
                let mut all_done = true;
                for dep in dependencies(stage, step) {
                    match end_of(&forward_end, &input_grad_end, &dep) {
                        Some(end) => ready = ready.max(end + if dep.crosses_ranks { costs.p2p } else { 0.0 }),
                        None => all_done = false,
                    }
                }
                if !all_done {
                    break;
                }
                let end = ready + costs.of(step.phase);
                let key = (step.micro_batch, step.chunk * stages + stage);
                match step.phase {
                    Phase::Forward => {
                        forward_end.insert(key, end);
                    }
                    Phase::Backward | Phase::BackwardInput => {
                        input_grad_end.insert(key, end);
                    }
                    Phase::BackwardWeight => {}
                }
                timed[rank].push(TimedStep { step, start: ready, end });
                free_at[rank] = end;
                next_index[rank] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }

    let blocked: Vec<u32> =
        (0..stages).filter(|&stage| next_index[stage as usize] < schedule.per_stage[stage as usize].len()).collect();
    if let Some(&stage) = blocked.first() {
        let index = next_index[stage as usize];
        let step = schedule.per_stage[stage as usize][index];
        let waiting = dependencies(stage, step)
            .into_iter()
            .find(|dep| end_of(&forward_end, &input_grad_end, dep).is_none())
            .expect("a blocked step has an unfinished dependency");
        return Err(ScheduleError::Deadlock {
            stage,
            index,
            step,
            waits_for: waiting.step,
            waits_on_stage: waiting.stage,
            other_blocked: blocked[1..].to_vec(),
        });
    }

    let makespan = free_at.iter().copied().fold(0.0, f64::max);
    let busy: Vec<f64> =
        timed.iter().map(|steps| steps.iter().map(|timed| timed.end - timed.start).sum()).collect();
    let idle = busy.iter().map(|busy| makespan - busy).collect();
    let ideal_compute = busy.iter().copied().fold(0.0, f64::max);
    let bubble = makespan - ideal_compute;
    let ratio = |numerator: f64, denominator: f64| if denominator > 0.0 { numerator / denominator } else { 0.0 };
    let peak_in_flight = schedule.per_stage.iter().map(|steps| peak_in_flight(steps)).collect();
    Ok(Timeline {
        stages,
        chunks,
        micro_batches: schedule.micro_batches,
        per_stage: timed,
        makespan,
        busy,
        idle,
        ideal_compute,
        bubble,
        bubble_over_compute: ratio(bubble, ideal_compute),
        bubble_share: ratio(bubble, makespan),
        peak_in_flight,
    })
}

/// The most forwards not yet followed by their backward (or its input part), in list order: a rank
/// runs its steps one at a time, so this does not depend on the costs.
fn peak_in_flight(steps: &[Step]) -> u32 {
    let mut in_flight: u32 = 0;
    let mut peak = 0;
    for step in steps {
        match step.phase {
            Phase::Forward => in_flight += 1,
            Phase::Backward | Phase::BackwardInput => in_flight = in_flight.saturating_sub(1),
            Phase::BackwardWeight => {}
        }
        peak = peak.max(in_flight);
    }
    peak
}
