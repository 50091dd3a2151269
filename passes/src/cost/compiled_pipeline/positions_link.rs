//! Beside cp or tsp the first stage computes every micro-batch's positions in zigzag order and
//! sends them to each later stage in its forward of the micro-batch's first chunk. A later stage
//! takes messages off its link from the first stage in order, each step those it reads and the ones
//! queued ahead of them (`backend::pipeline`), so a step reading another message on that link may
//! take positions ahead of the forward that reads them, held from there: the link also carries,
//! to the second stage, the first stage's forward outputs, and to the last stage under
//! interleaving the first stage's later chunks' input gradients.

use super::link::takes;
use super::StageShape;
use crate::pipeline::{Phase, Schedule, Step};

/// A message of a later stage's link from the first stage.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Message {
    /// A micro-batch's positions.
    Positions { micro_batch: u32 },
    /// A forward's output, the input of the stage's `chunk`.
    Output { micro_batch: u32, chunk: u32 },
    /// A backward's input gradient, the output gradient of the stage's `chunk`.
    InputGradient { micro_batch: u32, chunk: u32 },
}

/// The steps of a later stage that take each micro-batch's positions and that read them.
pub(super) struct PositionsLink {
    taken: Vec<(usize, usize)>,
    /// A micro-batch's positions, bytes.
    positions: f64,
}

impl PositionsLink {
    /// The link of `shape`'s stage of `schedule` from the first stage where it carries positions
    /// (`None` elsewhere, or where a step reads a message the link never carries), given the
    /// phase that makes a backward's input gradients.
    pub(super) fn new(shape: &StageShape, schedule: &Schedule, input_phase: Phase) -> Option<Option<PositionsLink>> {
        if shape.stage == 0 || shape.sizes.token_split == 1 {
            return Some(None);
        }
        let (stage, stages, chunks) = (shape.stage, shape.stages, shape.chunks);
        let last_stage = stage + 1 == stages;
        let mut sent = Vec::new();
        for &Step { micro_batch, chunk, phase } in schedule.per_stage.first()? {
            if phase == Phase::Forward {
                if chunk == 0 {
                    sent.push(Message::Positions { micro_batch });
                }
                // (The first stage's chunk `c` is virtual stage c·p; the next one, c·p + 1, is
                // the second stage's chunk `c`.)
                if stage == 1 {
                    sent.push(Message::Output { micro_batch, chunk });
                }
            } else if phase == input_phase && chunk > 0 && last_stage {
                // (Virtual stage c·p's input gradient goes to c·p − 1, the last stage's chunk
                // c − 1.)
                sent.push(Message::InputGradient { micro_batch, chunk: chunk - 1 });
            }
        }
        let reads = |step: &Step| {
            let Step { micro_batch, chunk, phase } = *step;
            let mut reads = Vec::new();
            if phase == Phase::Forward && chunk == 0 {
                reads.push(Message::Positions { micro_batch });
            }
            if phase == Phase::Forward && stage == 1 {
                reads.push(Message::Output { micro_batch, chunk });
            }
            if phase == input_phase && last_stage && chunk + 1 < chunks {
                reads.push(Message::InputGradient { micro_batch, chunk });
            }
            reads
        };
        let taken = takes(&sent, schedule.per_stage.get(stage as usize)?, reads)?
            .into_iter()
            .zip(&sent)
            .filter(|(_, message)| matches!(message, Message::Positions { .. }))
            .filter_map(|((at, read_at), _)| Some((at?, read_at?)))
            .collect();
        Some(Some(PositionsLink { taken, positions: shape.sizes.positions }))
    }

    /// The positions the stage holds at its step `at` that it took before the forward reading
    /// them (bytes; the reader counts its own).
    pub(super) fn taken_early(&self, at: usize) -> f64 {
        let early = self.taken.iter().filter(|&&(taken, read_at)| taken <= at && at < read_at).count();
        early as f64 * self.positions
    }
}
