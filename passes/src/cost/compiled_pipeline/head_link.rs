//! Beside a tied table, the first stage's link from the stage holding the LM head, which sends it
//! each micro-batch's part of the table's gradient: which of the first stage's steps takes each
//! message of that link, and so what the first stage holds that it took before the step reading
//! it.
//!
//! The link carries, in the order the last stage's steps send them: under interleaving each
//! forward's output of a chunk but the last (the first stage's next chunk's input); on two stages
//! each backward's (zero bubble: B's) input gradient (the first stage's same chunk's output
//! gradient, its two parts); and each micro-batch's head part, made in its last chunk's backward
//! (zero bubble: W) and sent as it is made, ahead of the input gradient, or beside dp (or cp) × tp
//! after it, reduced over dp at the backward's end; and a mixture's counts' sum, sent in each
//! forward of the last chunk (under full recomputation over dp, cp, ep or tsp, all-reduced again in
//! each backward, and sent after the head part) and read by the micro-batch's first backward (zero
//! bubble: B) here.
//! A step of the first stage takes the messages it reads as it begins, and with each the ones
//! queued ahead of it (`backend::pipeline`): a head part as a later message is read, or at the
//! latest by its reader, the first chunk's backward (or W), which may so take messages of later
//! steps early.

use super::super::workload::Recompute;
use super::link::takes;
use super::StageShape;
use crate::pipeline::{Phase, Schedule, Step};

/// A message of the link.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Message {
    /// A forward's output, the input of the first stage's `chunk`.
    Output { micro_batch: u32, chunk: u32 },
    /// A backward's input gradient, the output gradient of the first stage's `chunk`.
    InputGradient { micro_batch: u32, chunk: u32 },
    /// The head's part of the tied table's gradient.
    HeadPart { micro_batch: u32 },
    /// A mixture's expert counts summed over the layers, for the routers' backward.
    CountsSum { micro_batch: u32 },
}

/// One message as the first stage takes it.
struct Taken {
    /// The index of the first stage's step that takes it, and of the one that reads it (of a
    /// counts' sum, the one from which the rest of the stage's accounting holds it).
    at: usize,
    read_at: usize,
    /// Whether it is a head part, and its bytes.
    head_part: bool,
    bytes: f64,
}

/// The first stage's messages from the stage holding the LM head, as it takes them.
pub(super) struct HeadLink {
    taken: Vec<Taken>,
}

/// What the first stage holds at a step of the messages it took before the step reading them,
/// bytes.
#[derive(Clone, Copy)]
pub(super) struct TakenEarly {
    /// Micro-batches' head parts.
    pub head_parts: f64,
    /// Every other message.
    pub others: f64,
}

impl HeadLink {
    /// The link of the first stage of `schedule` beside a tied table (`None` elsewhere, or where
    /// a step reads a message the link never carries), given the phases that make a backward's
    /// input gradients and its last weight gradient.
    pub(super) fn new(
        shape: &StageShape,
        schedule: &Schedule,
        (input_phase, tail_phase): (Phase, Phase),
    ) -> Option<Option<HeadLink>> {
        if !shape.tied || shape.stage != 0 {
            return Some(None);
        }
        let (chunks, two_stages) = (shape.chunks, shape.stages == 2);
        let last_chunk = chunks - 1;
        // Beside dp (or cp) × tp the head's part is reduced over dp at the backward's end.
        let head_part_last = shape.reduced && shape.sizes.vocab_split > 1.0;
        // A mixture's counts' sum is sent in the last chunk's forward; under full recomputation
        // over dp, cp, ep or tsp, all-reduced again, in its backward after the head part (where
        // that is sent first) and ahead of the rest.
        let statistics = shape.statistics > 0.0;
        let counts_in_backward = (shape.reduced || shape.tsp > 1) && shape.recompute() == Recompute::Full;
        let mut sent = Vec::new();
        for &Step { micro_batch, chunk, phase } in schedule.per_stage.get(shape.stages as usize - 1)? {
            let head_part = Message::HeadPart { micro_batch };
            let counts_sum = Message::CountsSum { micro_batch };
            if phase == Phase::Forward && chunk < last_chunk {
                sent.push(Message::Output { micro_batch, chunk: chunk + 1 });
            } else if phase == Phase::Forward && statistics && !counts_in_backward {
                sent.push(counts_sum);
            } else if phase == input_phase {
                let makes_head_part = chunk == last_chunk && !shape.zero_bubble;
                if makes_head_part && !head_part_last {
                    sent.push(head_part);
                }
                if chunk == last_chunk && statistics && counts_in_backward {
                    sent.push(counts_sum);
                }
                if two_stages {
                    sent.push(Message::InputGradient { micro_batch, chunk });
                }
                if makes_head_part && head_part_last {
                    sent.push(head_part);
                }
            } else if phase == tail_phase && chunk == last_chunk {
                sent.push(head_part);
            }
        }
        let steps = schedule.per_stage.first()?;
        let reads = |step: &Step, head_parts: bool| {
            let Step { micro_batch, chunk, phase } = *step;
            let mut reads = Vec::new();
            if phase == Phase::Forward && chunk > 0 {
                reads.push(Message::Output { micro_batch, chunk });
            }
            if phase == input_phase && two_stages {
                reads.push(Message::InputGradient { micro_batch, chunk });
            }
            // (Every chunk's routers read the counts' sum; the micro-batch's first backward on
            // the stage, the last chunk's, takes it.)
            if phase == input_phase && chunk == last_chunk && statistics {
                reads.push(Message::CountsSum { micro_batch });
            }
            if phase == tail_phase && chunk == 0 && head_parts {
                reads.push(Message::HeadPart { micro_batch });
            }
            reads
        };
        let with_head_parts = takes(&sent, steps, |step| reads(step, true))?;
        // Without the head parts on the link (as beside an untied table) a counts' sum is taken
        // when the rest of the stage's accounting begins to hold it (its reader, or an input
        // gradient read on two stages): only its steps held before that are the link's.
        let others: Vec<Message> =
            sent.iter().copied().filter(|message| !matches!(message, Message::HeadPart { .. })).collect();
        let without_head_parts = takes(&others, steps, |step| reads(step, false))?;
        let mut counts_taken = without_head_parts
            .iter()
            .zip(&others)
            .filter_map(|(&(at, _), message)| matches!(message, Message::CountsSum { .. }).then_some(at));
        let stream = shape.sizes.stream;
        let head_part = shape.tied_head_part().map_or(0.0, |term| term.bytes);
        let taken = sent
            .iter()
            .zip(with_head_parts)
            .filter_map(|(&message, (at, read_at))| {
                let (head_part, bytes, read_at) = match message {
                    Message::Output { .. } => (false, stream, read_at),
                    Message::InputGradient { .. } => (false, 2.0 * stream, read_at),
                    Message::HeadPart { .. } => (true, head_part, read_at),
                    Message::CountsSum { .. } => (false, shape.statistics, counts_taken.next()?),
                };
                Some(Taken { at: at?, read_at: read_at?, head_part, bytes })
            })
            .collect();
        Some(Some(HeadLink { taken }))
    }

    /// What the first stage holds at its step `at` of the messages it took before the step that
    /// reads them (the reader counts its own).
    pub(super) fn taken_early(&self, at: usize) -> TakenEarly {
        let mut held = TakenEarly { head_parts: 0.0, others: 0.0 };
        for taken in self.taken.iter().filter(|taken| taken.at <= at && at < taken.read_at) {
            if taken.head_part {
                held.head_parts += taken.bytes;
            } else {
                held.others += taken.bytes;
            }
        }
        held
    }
}
