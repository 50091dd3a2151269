//! A [`Timeline`] from measured step times (a run's instruction timings grouped by schedule step),
//! so that a real run draws with [`render_text`](crate::pipeline::render_text) like a simulation.
//!
//! Guarantee: the numbers are defined as for a simulation: busy time is the sum of a stage's step
//! durations, the makespan runs from the earliest start (time 0) to the latest end, idle time is
//! the rest, and the bubble is the makespan less the busiest stage's busy time.

use crate::pipeline::simulate::{peak_in_flight, StepCosts, TimedStep, Timeline};

/// The timeline of measured steps: `per_stage[s]` stage `s`'s steps with their start and end in
/// any one unit, in the order it ran them.
pub fn measured_timeline(mut per_stage: Vec<Vec<TimedStep>>, micro_batches: u32, chunks: u32) -> Timeline {
    let origin = per_stage.iter().flatten().map(|timed| timed.start).fold(f64::INFINITY, f64::min);
    let origin = if origin.is_finite() { origin } else { 0.0 };
    for timed in per_stage.iter_mut().flatten() {
        timed.start -= origin;
        timed.end -= origin;
    }
    let makespan = per_stage.iter().flatten().map(|timed| timed.end).fold(0.0, f64::max);
    let busy: Vec<f64> =
        per_stage.iter().map(|steps| steps.iter().map(|timed| timed.end - timed.start).sum()).collect();
    let idle = busy.iter().map(|busy| makespan - busy).collect();
    let ideal_compute = busy.iter().copied().fold(0.0, f64::max);
    let bubble = makespan - ideal_compute;
    let peak_in_flight = per_stage.iter().map(|steps| peak_in_flight(steps.iter().map(|timed| &timed.step))).collect();
    Timeline {
        stages: per_stage.len() as u32,
        chunks,
        micro_batches,
        per_stage,
        makespan,
        busy,
        idle,
        ideal_compute,
        bubble,
        bubble_over_compute: if ideal_compute > 0.0 { bubble / ideal_compute } else { 0.0 },
        bubble_share: if makespan > 0.0 { bubble / makespan } else { 0.0 },
        peak_in_flight,
    }
}

/// The costs that draw `timeline` about `columns` wide: one time unit is the makespan over as many
/// blocks as fit.
pub fn drawing_costs(timeline: &Timeline, columns: usize) -> StepCosts {
    let label =
        format!("F{}", timeline.micro_batches.saturating_sub(1)).len() + if timeline.chunks > 1 { 2 } else { 0 };
    let blocks = (columns / label.max(1)).max(1) as f64;
    let unit = if timeline.makespan > 0.0 { timeline.makespan / blocks } else { 1.0 };
    StepCosts { forward: unit, backward_input: unit, backward_weight: unit, p2p: 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::{Phase, Step};

    fn timed(micro_batch: u32, phase: Phase, start: f64, end: f64) -> TimedStep {
        TimedStep { step: Step::new(micro_batch, phase), start, end }
    }

    #[test]
    fn measured_numbers_follow_their_definitions() {
        // Stage 0 runs 10..12 and 16..20, stage 1 12..16: makespan 10, busy 6 and 4.
        let per_stage = vec![
            vec![timed(0, Phase::Forward, 10.0, 12.0), timed(0, Phase::Backward, 16.0, 20.0)],
            vec![timed(0, Phase::Forward, 12.0, 13.0), timed(0, Phase::Backward, 13.0, 16.0)],
        ];
        let timeline = measured_timeline(per_stage, 1, 1);
        assert_eq!(timeline.makespan, 10.0);
        assert_eq!(timeline.busy, vec![6.0, 4.0]);
        assert_eq!(timeline.idle, vec![4.0, 6.0]);
        assert_eq!((timeline.ideal_compute, timeline.bubble), (6.0, 4.0));
        assert!((timeline.bubble_share - 0.4).abs() < 1e-12);
        assert_eq!(timeline.peak_in_flight, vec![1, 1]);
        assert_eq!(timeline.per_stage[1][0].start, 2.0);
        let picture = crate::pipeline::render_text(&timeline, &drawing_costs(&timeline, 20));
        assert_eq!(picture, "stage 0 |F0--........B0------|\nstage 1 |....F0B0----........|\n");
    }
}
