//! The links into a later stage from the first stage and from the stage before it. A stage takes
//! messages off a link in order, each step those it reads and the ones queued ahead of them
//! (`backend::pipeline`), so a step reading one message may take others ahead of the step that
//! reads them, held from there.
//!
//! What they carry: beside cp or tsp the first stage computes every micro-batch's positions in
//! zigzag order and sends them to each later stage in its forward of the micro-batch's first
//! chunk; the stage before sends each forward's output; of a mixture every stage sends each
//! chunk's layers' load-balancing statistics to the last stage in its forward of the chunk, read by
//! the last chunk's forward there (the loss sums them). Under SP a chunk's last layer's statistics
//! follow its output (the scheduler issues the output's reduce-scatter first), the others' precede
//! it. Under interleaving the first stage's later chunks' input gradients go to the last stage.
//! (A stage between the first and the one before sends only statistics, taken as they are read.)

use super::link::takes;
use super::StageShape;
use crate::pipeline::{Phase, Schedule, Step};

/// A message of a link into a later stage.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Message {
    /// A micro-batch's positions.
    Positions { micro_batch: u32 },
    /// Of the sender's `chunk`, the statistics of the layers sent ahead of its output (`ahead`)
    /// or after it.
    Statistics { micro_batch: u32, chunk: u32, ahead: bool },
    /// A forward's output, the input of the stage's `chunk`.
    Output { micro_batch: u32, chunk: u32 },
    /// A backward's input gradient, the output gradient of the stage's `chunk`.
    InputGradient { micro_batch: u32, chunk: u32 },
}

/// The steps of a later stage that take and that read each message of positions or statistics
/// on one link, and its bytes.
pub(super) struct IncomingLink {
    taken: Vec<(usize, usize, f64)>,
}

impl IncomingLink {
    /// The links into `shape`'s stage of `schedule` from the first stage and from the stage before
    /// (one link on the second stage) that carry positions or statistics (`None` where a step reads
    /// a message a link never carries), given the phase that makes a backward's input gradients
    /// and the layers of a chunk.
    pub(super) fn into_stage(
        shape: &StageShape,
        schedule: &Schedule,
        input_phase: Phase,
        chunk_layers: u64,
    ) -> Option<Vec<IncomingLink>> {
        let senders = match shape.stage {
            0 => Vec::new(),
            1 => vec![0],
            stage => vec![0, stage - 1],
        };
        let mut links = Vec::new();
        for from in senders {
            links.extend(IncomingLink::new(shape, schedule, input_phase, chunk_layers, from)?);
        }
        Some(links)
    }

    /// The link from stage `from`, where it carries positions or statistics.
    fn new(
        shape: &StageShape,
        schedule: &Schedule,
        input_phase: Phase,
        chunk_layers: u64,
        from: u32,
    ) -> Option<Option<IncomingLink>> {
        let (stage, stages, chunks) = (shape.stage, shape.stages, shape.chunks);
        let last_stage = stage + 1 == stages;
        let positions = from == 0 && shape.sizes.token_split > 1;
        let statistics = last_stage && shape.statistics > 0.0;
        if !(positions || statistics) {
            return Some(None);
        }
        let outputs = from + 1 == stage;
        let input_gradients = from == 0 && last_stage;
        // (Each layer's expert counts and router probability sums; under SP the last layer's
        // follow the output.)
        let layer_statistics = 2.0 * shape.statistics;
        let behind = if shape.sequence_parallel() { 1 } else { 0 };
        let bytes_of = |ahead: bool| {
            let layers = if ahead { chunk_layers - behind } else { behind };
            layers as f64 * layer_statistics
        };
        let mut sent = Vec::new();
        for &Step { micro_batch, chunk, phase } in schedule.per_stage.get(from as usize)? {
            if phase == Phase::Forward {
                if chunk == 0 && positions {
                    sent.push(Message::Positions { micro_batch });
                }
                if statistics && bytes_of(true) > 0.0 {
                    sent.push(Message::Statistics { micro_batch, chunk, ahead: true });
                }
                // (The sender's chunk `c` is virtual stage c·p + from; the next one is this
                // stage's chunk `c`.)
                if outputs {
                    sent.push(Message::Output { micro_batch, chunk });
                }
                if statistics && bytes_of(false) > 0.0 {
                    sent.push(Message::Statistics { micro_batch, chunk, ahead: false });
                }
            } else if phase == input_phase && chunk > 0 && input_gradients {
                // (Virtual stage c·p's input gradient goes to c·p − 1, the last stage's chunk
                // c − 1.)
                sent.push(Message::InputGradient { micro_batch, chunk: chunk - 1 });
            }
        }
        let reads = |step: &Step| {
            let Step { micro_batch, chunk, phase } = *step;
            let mut reads = Vec::new();
            if phase == Phase::Forward && chunk == 0 && positions {
                reads.push(Message::Positions { micro_batch });
            }
            if phase == Phase::Forward && outputs {
                reads.push(Message::Output { micro_batch, chunk });
            }
            if phase == Phase::Forward && statistics && chunk + 1 == chunks {
                for chunk in 0..chunks {
                    for ahead in [true, false].into_iter().filter(|&ahead| bytes_of(ahead) > 0.0) {
                        reads.push(Message::Statistics { micro_batch, chunk, ahead });
                    }
                }
            }
            if phase == input_phase && input_gradients && chunk + 1 < chunks {
                reads.push(Message::InputGradient { micro_batch, chunk });
            }
            reads
        };
        let taken = takes(&sent, schedule.per_stage.get(stage as usize)?, reads)?
            .into_iter()
            .zip(&sent)
            .filter_map(|((at, read_at), message)| {
                let bytes = match *message {
                    Message::Positions { .. } => shape.sizes.positions,
                    Message::Statistics { ahead, .. } => bytes_of(ahead),
                    Message::Output { .. } | Message::InputGradient { .. } => return None,
                };
                Some((at?, read_at?, bytes))
            })
            .collect();
        Some(Some(IncomingLink { taken }))
    }

    /// The positions and statistics the stage holds at its step `at` that it took before the
    /// forward reading them (bytes; the reader counts its own).
    pub(super) fn taken_early(&self, at: usize) -> f64 {
        let early = self.taken.iter().filter(|&&(taken, read_at, _)| taken <= at && at < read_at);
        early.map(|&(_, _, bytes)| bytes).sum()
    }
}
