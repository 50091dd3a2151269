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
    /// finished the backward of (its whole backward, or under zero bubble its `W`, as a micro-batch
    /// between its `B` and `W` still holds what `W` reads): the activations it holds at once.
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
                let missing =
                    |phase| Err(ScheduleError::MissingStep { stage, step: Step { micro_batch, chunk, phase } });
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
    let end_of =
        |forward_end: &HashMap<(u32, u32), f64>, input_grad_end: &HashMap<(u32, u32), f64>, dep: &Dependency| {
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
    // Each blocked stage with its step and the first dependency that never finished (a blocked
    // step has one, or the loop above would have run it).
    let waits: Vec<(u32, usize, Step, Dependency)> = blocked
        .iter()
        .filter_map(|&stage| {
            let index = next_index[stage as usize];
            let step = schedule.per_stage[stage as usize][index];
            let waiting = dependencies(stage, step)
                .into_iter()
                .find(|dep| end_of(&forward_end, &input_grad_end, dep).is_none())?;
            Some((stage, index, step, waiting))
        })
        .collect();
    // A stage that waits on a later step of its own list is the cause; the others wait on it.
    let cause = waits.iter().position(|(stage, _, _, dep)| dep.stage == *stage).unwrap_or(0);
    if let Some((stage, index, step, waiting)) = waits.get(cause) {
        return Err(ScheduleError::Deadlock {
            stage: *stage,
            index: *index,
            step: *step,
            waits_for: waiting.step,
            waits_on_stage: waiting.stage,
            other_blocked: blocked.iter().copied().filter(|other| other != stage).collect(),
        });
    }

    let makespan = free_at.iter().copied().fold(0.0, f64::max);
    let busy: Vec<f64> = timed.iter().map(|steps| steps.iter().map(|timed| timed.end - timed.start).sum()).collect();
    let idle = busy.iter().map(|busy| makespan - busy).collect();
    let ideal_compute = busy.iter().copied().fold(0.0, f64::max);
    let bubble = makespan - ideal_compute;
    let ratio = |numerator: f64, denominator: f64| if denominator > 0.0 { numerator / denominator } else { 0.0 };
    let peak_in_flight = schedule.per_stage.iter().map(peak_in_flight).collect();
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

/// The most forwards not yet followed by the step that finishes their backward (the whole backward,
/// or its weight part `W`), in list order: a rank runs its steps one at a time, so this does not
/// depend on the costs.
pub(crate) fn peak_in_flight<'a>(steps: impl IntoIterator<Item = &'a Step>) -> u32 {
    let mut in_flight: u32 = 0;
    let mut peak = 0;
    for step in steps {
        match step.phase {
            Phase::Forward => in_flight += 1,
            Phase::Backward | Phase::BackwardWeight => in_flight = in_flight.saturating_sub(1),
            Phase::BackwardInput => {}
        }
        peak = peak.max(in_flight);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::ScheduleKind;

    const EQUAL: StepCosts = StepCosts::EQUAL_STAGES;

    /// `"F3"` or `"B3"` on chunk 0.
    fn step_of(text: &str) -> Step {
        let phase = if text.starts_with('F') { Phase::Forward } else { Phase::Backward };
        Step::new(text[1..].parse().unwrap(), phase)
    }

    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() < 1e-12
    }

    fn timeline(kind: ScheduleKind, stages: u32, micro_batches: u32) -> Timeline {
        simulate(&Schedule::build(kind, stages, micro_batches).unwrap(), &EQUAL).unwrap()
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for stages in 1..=6u32 {
                for micro_batches in 1..=12u32 {
                    let timeline = timeline(kind, stages, micro_batches);
                    let (p, m) = (f64::from(stages), f64::from(micro_batches));
                    assert!(close(timeline.bubble_over_compute, (p - 1.0) / m), "{kind:?} p={p} m={m}: {timeline:?}");
                    assert!(close(timeline.bubble_share, (p - 1.0) / (m + p - 1.0)), "{kind:?} p={p} m={m}");
                    assert!(close(
                        timeline.bubble_over_compute,
                        kind.closed_form_bubble(stages, micro_batches, 1.0, 1.0, 1.0)
                    ));
                    // Every stage idles the same (p-1)(F+B) in total.
                    assert!(timeline.idle.iter().all(|idle| close(*idle, (p - 1.0) * 3.0)), "{:?}", timeline.idle);
                }
            }
        }
    }

    #[test]
    fn interleaved_bubble_is_p_minus_1_over_v_m() {
        for stages in 1..=5u32 {
            for chunks in 2..=4u32 {
                for groups in 1..=4u32 {
                    let micro_batches = groups * stages;
                    let timeline = timeline(ScheduleKind::Interleaved { chunks }, stages, micro_batches);
                    let want = f64::from(stages - 1) / f64::from(chunks * micro_batches);
                    assert!(
                        close(timeline.bubble_over_compute, want),
                        "p={stages} v={chunks} m={micro_batches}: {} vs {want}",
                        timeline.bubble_over_compute
                    );
                }
            }
        }
    }

    #[test]
    fn zero_bubble_h1_bubble_is_smaller_than_1f1b() {
        for stages in 2..=6u32 {
            for micro_batches in [stages, 2 * stages, 3 * stages + 1] {
                let zero_bubble = timeline(ScheduleKind::ZeroBubbleH1, stages, micro_batches);
                let one_f_one_b = timeline(ScheduleKind::OneFOneB, stages, micro_batches);
                assert!(
                    zero_bubble.bubble_over_compute < one_f_one_b.bubble_over_compute,
                    "p={stages} m={micro_batches}: {} vs {}",
                    zero_bubble.bubble_over_compute,
                    one_f_one_b.bubble_over_compute
                );
                // With F = B = W the paper's H1 bubble is a third of 1F1B's: (p-1)/(3m).
                let closed = ScheduleKind::ZeroBubbleH1.closed_form_bubble(stages, micro_batches, 1.0, 1.0, 1.0);
                assert!(
                    close(zero_bubble.bubble_over_compute, closed),
                    "p={stages} m={micro_batches}: {} vs {closed}",
                    zero_bubble.bubble_over_compute
                );
                // And its memory is 1F1B's: the first stage holds 1F1B's min(p, m) micro-batches,
                // and a later one, whose Ws wait, as many (counted until their W), never more.
                let first = one_f_one_b.peak_in_flight[0];
                assert_eq!(first, stages.min(micro_batches));
                assert_eq!(zero_bubble.peak_in_flight, vec![first; stages as usize], "p={stages} m={micro_batches}");
            }
        }
    }

    #[test]
    fn peak_in_flight_is_m_for_gpipe_and_p_minus_s_for_1f1b() {
        let gpipe = timeline(ScheduleKind::GPipe, 4, 8);
        let one_f_one_b = timeline(ScheduleKind::OneFOneB, 4, 8);
        assert_eq!(gpipe.peak_in_flight, vec![8, 8, 8, 8]);
        assert_eq!(one_f_one_b.peak_in_flight, vec![4, 3, 2, 1]);
        assert_eq!(gpipe.peak_in_flight[0] / one_f_one_b.peak_in_flight[0], 2);
        // Interleaving holds more: Megatron's warm-up plus one, in (micro-batch, chunk) units.
        let interleaved = timeline(ScheduleKind::Interleaved { chunks: 2 }, 4, 8);
        assert_eq!(interleaved.peak_in_flight, vec![11, 9, 7, 5]);
    }

    /// Counts each (micro-batch, phase, virtual stage) directly from the lists.
    fn assert_each_step_once(schedule: &Schedule) {
        let chunks = schedule.chunks();
        let phases: &[Phase] = match schedule.kind {
            ScheduleKind::ZeroBubbleH1 => &[Phase::Forward, Phase::BackwardInput, Phase::BackwardWeight],
            _ => &[Phase::Forward, Phase::Backward],
        };
        for (stage, steps) in schedule.per_stage.iter().enumerate() {
            assert_eq!(steps.len(), phases.len() * (schedule.micro_batches * chunks) as usize);
            for chunk in 0..chunks {
                for micro_batch in 0..schedule.micro_batches {
                    for &phase in phases {
                        let count = steps.iter().filter(|step| **step == Step { micro_batch, chunk, phase }).count();
                        assert_eq!(
                            count, 1,
                            "{:?} stage {stage}: {phase} of {micro_batch} chunk {chunk}",
                            schedule.kind
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_schedule_runs_each_step_once_and_completes() {
        for stages in 1..=5u32 {
            for micro_batches in 1..=10u32 {
                let mut kinds = vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1];
                if micro_batches % stages == 0 {
                    kinds.extend((2..=3).map(|chunks| ScheduleKind::Interleaved { chunks }));
                }
                for kind in kinds {
                    let schedule = Schedule::build(kind, stages, micro_batches).unwrap();
                    assert_each_step_once(&schedule);
                    let costs = StepCosts { forward: 1.0, backward_input: 1.5, backward_weight: 0.75, p2p: 0.25 };
                    let timeline = simulate(&schedule, &costs).unwrap();
                    assert!(timeline.makespan >= timeline.ideal_compute);
                }
            }
        }
    }

    #[test]
    fn p2p_cost_is_paid_between_ranks() {
        let costs = StepCosts { p2p: 0.5, ..EQUAL };
        let timeline = simulate(&Schedule::build(ScheduleKind::GPipe, 2, 1).unwrap(), &costs).unwrap();
        // F on stage 0, send, F then B on stage 1, send, B on stage 0: 1 + .5 + 1 + 2 + .5 + 2.
        assert!(close(timeline.makespan, 7.0), "{}", timeline.makespan);
    }

    #[test]
    fn a_backward_before_its_forward_is_reported_with_the_stage_and_step() {
        let mut schedule = Schedule::build(ScheduleKind::OneFOneB, 4, 8).unwrap();
        // The last stage runs F0 B0 ...; swapping them makes B0 wait on its own later F0, and the
        // stages above wait on stage 3: the report names stage 3's step 0 as the cause.
        schedule.per_stage[3].swap(0, 1);
        let err = simulate(&schedule, &EQUAL).unwrap_err();
        assert_eq!(
            err,
            ScheduleError::Deadlock {
                stage: 3,
                index: 0,
                step: Step::new(0, Phase::Backward),
                waits_for: Step::new(0, Phase::Forward),
                waits_on_stage: 3,
                other_blocked: vec![0, 1, 2],
            }
        );
        assert!(err.to_string().contains("stages 0, 1, 2 are blocked too"), "{err}");
        // A cycle across ranks: stage 0 waits for micro-batch 0's gradient before forwarding
        // micro-batch 1, and stage 1 waits for micro-batch 1 before sending that gradient back.
        let mut crossed = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
        crossed.per_stage[0] = ["F0", "B0", "F1", "B1"].map(step_of).to_vec();
        crossed.per_stage[1] = ["F0", "F1", "B0", "B1"].map(step_of).to_vec();
        assert_eq!(
            simulate(&crossed, &EQUAL).unwrap_err(),
            ScheduleError::Deadlock {
                stage: 0,
                index: 1,
                step: Step::new(0, Phase::Backward),
                waits_for: Step::new(0, Phase::Backward),
                waits_on_stage: 1,
                other_blocked: vec![1],
            }
        );
        // One stage alone.
        let mut only_last = Schedule::build(ScheduleKind::OneFOneB, 1, 2).unwrap();
        only_last.per_stage[0].swap(0, 1);
        assert_eq!(
            simulate(&only_last, &EQUAL).unwrap_err().to_string(),
            "the schedule cannot complete: stage 0 waits at step 0 (backward of micro-batch 0 on chunk 0) for forward of micro-batch 0 on chunk 0 on stage 0, which that stage's order never reaches first"
        );
    }

    #[test]
    fn incomplete_and_duplicated_schedules_are_rejected() {
        let mut schedule = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
        schedule.per_stage[1].pop();
        assert!(matches!(simulate(&schedule, &EQUAL), Err(ScheduleError::MissingStep { stage: 1, .. })));
        let mut schedule = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
        schedule.per_stage[0][1] = schedule.per_stage[0][0];
        assert!(matches!(
            simulate(&schedule, &EQUAL),
            Err(ScheduleError::DuplicateStep { stage: 0, first: 0, second: 1, .. })
        ));
        let mut schedule = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
        schedule.per_stage[0][0].micro_batch = 5;
        assert!(matches!(simulate(&schedule, &EQUAL), Err(ScheduleError::StepOutOfRange { stage: 0, index: 0, .. })));
        let bad = StepCosts { forward: f64::NAN, ..EQUAL };
        assert!(matches!(
            simulate(&Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap(), &bad),
            Err(ScheduleError::BadCost { what: "forward", .. })
        ));
    }
}
