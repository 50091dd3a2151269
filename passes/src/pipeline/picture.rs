//! The text picture of a [`Timeline`]: one row a stage, F/B/W blocks on a time axis.
//!
//! Each block is its phase letter and micro-batch number (`F3`, `B3`, `W3`; with chunks, `F3:1` is
//! micro-batch 3 on chunk 1), then `-` to the block's length; idle time is `.`. One time unit
//! (the smallest step cost) is as many columns as the widest label, so every block shows its label
//! whole when the costs are multiples of that unit.

use crate::pipeline::schedule::Phase;
use crate::pipeline::simulate::{StepCosts, Timeline};

/// Draws `timeline` (simulated with `costs`) as text, one line a stage, ending with a newline.
pub fn render_text(timeline: &Timeline, costs: &StepCosts) -> String {
    // The widest label: the last micro-batch on the last chunk.
    let label_width =
        label(timeline, timeline.micro_batches.saturating_sub(1), timeline.chunks.saturating_sub(1), Phase::Forward)
            .len();
    let unit = [costs.forward, costs.backward_input, costs.backward_weight, costs.p2p]
        .into_iter()
        .filter(|cost| *cost > 0.0)
        .fold(f64::INFINITY, f64::min);
    let unit = if unit.is_finite() { unit } else { 1.0 };
    let column = |time: f64| (time / unit * label_width as f64).round() as usize;
    let width = column(timeline.makespan);
    let name_width = format!("stage {}", timeline.stages.saturating_sub(1)).len();
    let mut text = String::new();
    for (stage, steps) in timeline.per_stage.iter().enumerate() {
        let mut row = vec!['.'; width];
        for timed in steps {
            let (start, end) = (column(timed.start), column(timed.end).min(width));
            let block = label(timeline, timed.step.micro_batch, timed.step.chunk, timed.step.phase);
            for (offset, cell) in row[start.min(end)..end].iter_mut().enumerate() {
                *cell = block.chars().nth(offset).unwrap_or('-');
            }
        }
        let name = format!("stage {stage}");
        text.push_str(&format!("{name:<name_width$} |{}|\n", row.into_iter().collect::<String>()));
    }
    text
}

/// A block's label: `F3`, or `F3:1` when the stages hold several chunks.
fn label(timeline: &Timeline, micro_batch: u32, chunk: u32, phase: Phase) -> String {
    if timeline.chunks > 1 {
        format!("{}{micro_batch}:{chunk}", phase.letter())
    } else {
        format!("{}{micro_batch}", phase.letter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::{Schedule, ScheduleKind};
    use crate::pipeline::simulate::simulate;

    #[test]
    fn gpipe_picture_shows_the_bubble() {
        let schedule = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
        let costs = StepCosts::EQUAL_STAGES;
        let timeline = simulate(&schedule, &costs).unwrap();
        // Forwards take one column, backwards two; stage 1 starts one forward late, stage 0 waits
        // for stage 1's first backward.
        assert_eq!(render_text(&timeline, &costs), "stage 0 |F0F1......B0--B1--|\nstage 1 |..F0F1B0--B1--....|\n");
    }

    #[test]
    fn chunk_labels_name_the_chunk() {
        let schedule = Schedule::build(ScheduleKind::Interleaved { chunks: 2 }, 2, 2).unwrap();
        let costs = StepCosts::EQUAL_STAGES;
        let picture = render_text(&simulate(&schedule, &costs).unwrap(), &costs);
        assert!(picture.starts_with("stage 0 |F0:0F1:0F0:1F1:1"), "{picture}");
    }
}
