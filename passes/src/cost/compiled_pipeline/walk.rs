//! The walk over a stage's schedule: at each step that makes a micro-batch's gradients, what the
//! stage holds besides (the running sums, the other micro-batches in flight or unfinished, the
//! load-balancing statistics received), and the largest of the step's points.

use super::super::compiled::ForwardPhase;
use super::super::compiled_training::GRADS_KEPT_WHOLE;
use super::super::memory::Term;
use super::super::workload::Recompute;
use super::chunk::{Candidate, ChunkHold};
use super::head_link::{HeadLink, TakenEarly};
use super::incoming_link::IncomingLink;
use super::{StageShape, TIED_HEAD_PARTS_TAKEN_AHEAD};
use crate::pipeline::{Phase, Schedule, Step};
use pleat_ir::AxisName;

/// The stage's peak over its schedule: the largest of the points of each step that makes a
/// micro-batch's gradients (a backward, or zero bubble's W and B) and of each forward (under zero
/// bubble; under another schedule the last chunk's beside cp), `params` the stage's parameters.
pub(super) fn stage_peak(
    shape: &StageShape,
    schedule: &Schedule,
    holds: &[ChunkHold],
    params: f64,
) -> Option<ForwardPhase> {
    let steps = schedule.per_stage.get(shape.stage as usize)?;
    // Where a micro-batch's last weight gradient is made: its backward, or zero bubble's W.
    let (input_phase, tail_phase) = if shape.zero_bubble {
        (Phase::BackwardInput, Phase::BackwardWeight)
    } else {
        (Phase::Backward, Phase::Backward)
    };
    let head_link = HeadLink::new(shape, schedule, (input_phase, tail_phase))?;
    let incoming_links = IncomingLink::into_stage(shape, schedule, input_phase, holds.first()?.layers)?;
    let mut best: Option<ForwardPhase> = None;
    for (at, step) in steps.iter().enumerate() {
        let kind = if step.phase == tail_phase {
            StepKind::Tail
        } else if shape.zero_bubble && step.phase == input_phase {
            // Under zero bubble a B runs beside the micro-batches between their B and W (and a
            // mixture's makes the experts' gradients).
            StepKind::InB
        } else if step.phase == Phase::Forward {
            // Under zero bubble a forward runs beside the micro-batches between their B and W;
            // under any schedule the last chunk's forward may peak as it gathers the logits.
            StepKind::Forward
        } else {
            continue;
        };
        let head_link = head_link.as_ref().map(|link| link.taken_early(at));
        let taken_early_in = incoming_links.iter().map(|link| link.taken_early(at)).sum();
        let point = Point {
            shape,
            schedule,
            holds,
            before: &steps[..at],
            step,
            kind,
            input_phase,
            tail_phase,
            head_link,
            taken_early_in,
        };
        let beside = point.beside()?;
        let phases = match kind {
            StepKind::Tail => point.backward(&beside, params),
            StepKind::InB => point.in_b(&beside, params),
            StepKind::Forward => point.forward(&beside, params),
        };
        for phase in phases {
            if best.as_ref().is_none_or(|best| phase.bytes() > best.bytes()) {
                best = Some(phase);
            }
        }
    }
    best
}

/// A step of the stage's schedule where a micro-batch's gradients are made.
struct Point<'a> {
    shape: &'a StageShape<'a>,
    schedule: &'a Schedule,
    holds: &'a [ChunkHold],
    /// The stage's steps before it.
    before: &'a [Step],
    step: &'a Step,
    kind: StepKind,
    /// The phase that makes the input gradients, and the one that makes the last weight gradient.
    input_phase: Phase,
    tail_phase: Phase,
    /// Beside a tied table, on the first stage: what it holds that it took from the stage holding
    /// the LM head before the step reading it.
    head_link: Option<TakenEarly>,
    /// On a later stage: the positions (beside cp or tsp) and on the last a mixture's statistics
    /// it took from the first stage and the one before before the forward reading them (bytes).
    taken_early_in: f64,
}

/// Which step a point lies in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StepKind {
    /// A backward, or zero bubble's W: where a micro-batch's last weight gradient is made.
    Tail,
    /// Zero bubble: a B (a mixture's makes its experts' gradients).
    InB,
    /// Zero bubble: a forward.
    Forward,
}

/// What the stage holds at a point beside the current micro-batch's own buffers, in bytes.
struct Beside {
    /// The running sums of the chunks but the current one that some backward has finished.
    other_sums: f64,
    /// Of those and of `unfinished_grads`, the gradients ZeRO keeps whole beyond their shards.
    other_sums_kept_whole: f64,
    unfinished_kept_whole: f64,
    /// Every other micro-batch in flight (or, under zero bubble, between its B and its W), the
    /// positions of each begun and not done (and on a later stage those taken early from the
    /// first), and the statistics they hold.
    others: f64,
    /// The gradients of the chunks the unfinished micro-batches have finished (program outputs,
    /// freed once a micro-batch's backward is done on every chunk), and what those chunks keep.
    unfinished_grads: f64,
    remains: f64,
    /// A mixture's expert counts summed over the layers, which the micro-batches received.
    received: f64,
    /// Beside a tied table, on the first stage: the head's parts of its gradient taken before the
    /// step reading them.
    head_parts: f64,
    /// The loss's sum over the micro-batches, on the stage holding the model's last layers.
    loss_sum: f64,
}

impl Point<'_> {
    /// How many steps before this one ran `phase` on `chunk`.
    fn done(&self, chunk: u32, phase: Phase) -> f64 {
        self.before.iter().filter(|before| before.chunk == chunk && before.phase == phase).count() as f64
    }

    fn beside(&self) -> Option<Beside> {
        let shape = self.shape;
        let (others, other_sums, other_sums_kept_whole) = self.in_flight_and_sums();
        let (positions, unfinished_grads, unfinished_kept_whole, remains) = self.unfinished();
        let (last_stage_statistics, mut received) = self.interleaved_counts()?;
        let taken_early = self.head_link.unwrap_or(TakenEarly { head_parts: 0.0, others: 0.0 });
        // Under zero bubble a W on a stage between the first and the last still holds its
        // micro-batch's received counts' sum (released at the micro-batch's end; full
        // recomputation's held terms count it already).
        if shape.zero_bubble
            && self.kind == StepKind::Tail
            && shape.statistics > 0.0
            && shape.stage > 0
            && shape.stage + 1 < shape.stages
            && shape.recompute() != Recompute::Full
        {
            received += shape.statistics;
        }
        Some(Beside {
            other_sums,
            other_sums_kept_whole,
            unfinished_kept_whole,
            others: others
                + positions
                + self.taken_early_in
                + self.counts_taken()?
                + last_stage_statistics
                + taken_early.others,
            unfinished_grads,
            remains,
            received,
            head_parts: taken_early.head_parts,
            loss_sum: if shape.stage + 1 == shape.stages { shape.sizes.element } else { 0.0 },
        })
    }

    /// Every other micro-batch whose forward on a chunk is done and its backward there not yet,
    /// and the running sums of the chunks some backward has finished (but the current one's), and
    /// of those the gradients kept whole.
    fn in_flight_and_sums(&self) -> (f64, f64, f64) {
        let (mut others, mut other_sums, mut kept_whole) = (0.0, 0.0, 0.0);
        for (chunk, hold) in (0u32..).zip(self.holds) {
            let current = f64::from(chunk == self.step.chunk);
            if self.shape.zero_bubble {
                // At a W the current micro-batch's B is done: it is the one between B and W there;
                // in a B it is still in flight; in a forward it is neither yet.
                let (in_flight_current, between_current) = match self.kind {
                    StepKind::Tail => (0.0, current),
                    StepKind::InB => (current, 0.0),
                    StepKind::Forward => (0.0, 0.0),
                };
                others += (self.done(chunk, Phase::Forward) - self.done(chunk, self.input_phase) - in_flight_current)
                    * hold.in_flight;
                others += (self.done(chunk, self.input_phase) - self.done(chunk, self.tail_phase) - between_current)
                    * hold.between_b_and_w.between;
            } else {
                // (In a forward the current micro-batch is not yet among them.)
                let in_flight_current = if self.kind == StepKind::Forward { 0.0 } else { current };
                others += (self.done(chunk, Phase::Forward) - self.done(chunk, self.tail_phase) - in_flight_current)
                    * hold.in_flight;
            }
            if chunk != self.step.chunk && self.done(chunk, self.tail_phase) > 0.0 {
                other_sums += hold.grads;
                kept_whole += hold.grads_kept_whole;
            }
        }
        (others, other_sums, kept_whole)
    }

    /// Per micro-batch begun on the stage and not yet done: its positions (the current one's are
    /// in its held buffers, but on the first chunk of an interleaved stage), and of each chunk it
    /// has finished the backward of, the gradients (and of them those kept whole) and what remains.
    fn unfinished(&self) -> (f64, f64, f64, f64) {
        let (mut positions, mut grads, mut kept_whole, mut remains) = (0.0, 0.0, 0.0, 0.0);
        let (chunks, step) = (self.shape.chunks, self.step);
        for micro_batch in 0..self.schedule.micro_batches {
            let of = |phase: Phase| -> Vec<u32> {
                self.before
                    .iter()
                    .filter(|before| before.micro_batch == micro_batch && before.phase == phase)
                    .map(|before| before.chunk)
                    .collect()
            };
            let (forwarded, finished) = (of(Phase::Forward), of(self.tail_phase));
            if forwarded.is_empty() || finished.len() == chunks as usize {
                continue;
            }
            let freed_in_b = self.shape.positions_freed_in_b() && !of(self.input_phase).is_empty();
            if (micro_batch != step.micro_batch || (chunks > 1 && step.chunk == 0 && self.shape.stage == 0))
                && !freed_in_b
            {
                positions += self.shape.sizes.positions;
            }
            for &chunk in &finished {
                let hold = &self.holds[chunk as usize];
                grads += hold.grads;
                kept_whole += hold.grads_kept_whole;
                remains += hold.remains;
            }
        }
        (positions, grads, kept_whole, remains)
    }

    /// A mixture's expert counts summed over the layers, which the last stage sends every earlier
    /// one in its forward for their router probabilities' backward: the stage next to it takes
    /// them on the link its gradients come on, in the order they were sent, so as the current
    /// micro-batch's backward starts it has taken those of every micro-batch the last stage
    /// forwarded before that backward; the ones still in flight here hold theirs. (Under zero
    /// bubble the gradients come in B: at a W the last taken is the latest B's, and the
    /// micro-batches between B and W hold theirs in `between`.) Without interleaving.
    fn counts_taken(&self) -> Option<f64> {
        let (shape, step) = (self.shape, self.step);
        // (Over dp, cp, ep or tsp under full recomputation the last stage all-reduces the sum over
        // them again in each backward and sends that: a micro-batch takes it only as its own
        // backward starts.)
        if (shape.reduced || shape.tsp > 1) && shape.recompute() == Recompute::Full {
            return Some(0.0);
        }
        let taken = if shape.zero_bubble {
            let at_and_before = self.before.iter().chain(std::iter::once(step));
            at_and_before.rev().find(|before| before.phase == self.input_phase).map(|before| before.micro_batch)
        } else {
            Some(step.micro_batch)
        };
        let Some(taken) =
            taken.filter(|_| shape.statistics > 0.0 && shape.chunks == 1 && shape.stage + 2 == shape.stages)
        else {
            return Some(0.0);
        };
        let last_steps = self.schedule.per_stage.get(shape.stages as usize - 1)?;
        let backward_there =
            last_steps.iter().position(|there| there.micro_batch == taken && there.phase == self.input_phase)?;
        let mut held = 0.0;
        for micro_batch in (0..self.schedule.micro_batches).filter(|&other| other != step.micro_batch) {
            let forwarded_there = last_steps[..backward_there]
                .iter()
                .any(|there| there.micro_batch == micro_batch && there.phase == Phase::Forward);
            let here = |phase: Phase| {
                self.before.iter().any(|before| before.micro_batch == micro_batch && before.phase == phase)
            };
            if forwarded_there && here(Phase::Forward) && !here(self.input_phase) {
                held += shape.statistics;
            }
        }
        Some(held)
    }

    /// Under interleaving a stage before the last holds each micro-batch's summed counts from
    /// their receipt to the micro-batch's end (every chunk's routers read them): the stage next to
    /// the last takes them on its gradients' link, so it holds those sent before the gradient its
    /// current step takes; another takes them at a micro-batch's first backward (the second
    /// figure). On the last stage, a micro-batch forwarded on another chunk and not yet on the last
    /// one holds that chunk's layers' statistics (the first; those it took from other stages are
    /// the links' in, `incoming_link`).
    fn interleaved_counts(&self) -> Option<(f64, f64)> {
        let (shape, step) = (self.shape, self.step);
        let (mut last_stage, mut received) = (0.0, 0.0);
        if shape.statistics == 0.0 || shape.chunks == 1 {
            return Some((last_stage, received));
        }
        let chunks = shape.chunks;
        let last_steps = self.schedule.per_stage.get(shape.stages as usize - 1)?;
        let forwarded = |steps: &[Step], micro_batch: u32, chunk: u32| {
            steps
                .iter()
                .any(|there| there.micro_batch == micro_batch && there.chunk == chunk && there.phase == Phase::Forward)
        };
        let gradient_sent_at = last_steps.iter().position(|there| {
            there.micro_batch == step.micro_batch && there.chunk == step.chunk && there.phase == self.tail_phase
        });
        for micro_batch in 0..self.schedule.micro_batches {
            let backwards = self
                .before
                .iter()
                .filter(|before| before.micro_batch == micro_batch && before.phase == self.tail_phase)
                .count();
            let begun = self.before.iter().any(|before| before.micro_batch == micro_batch);
            if shape.stage + 1 == shape.stages {
                // (The last chunk's forward points count every layer's statistics themselves.)
                if micro_batch == step.micro_batch && self.kind == StepKind::Forward && step.chunk + 1 == chunks {
                    continue;
                }
                // (Its own chunk's layers; the links in count those the stage took.)
                for (chunk, hold) in (0..chunks - 1).zip(self.holds) {
                    if forwarded(self.before, micro_batch, chunk) && !forwarded(self.before, micro_batch, chunks - 1) {
                        last_stage += 2.0 * hold.layers as f64 * shape.statistics;
                    }
                }
                continue;
            }
            let holds = if micro_batch == step.micro_batch {
                true
            } else if !begun || backwards == chunks as usize {
                false
            } else if shape.stage + 2 == shape.stages {
                gradient_sent_at.is_some_and(|sent| forwarded(&last_steps[..sent], micro_batch, chunks - 1))
            } else {
                backwards > 0
            };
            if holds {
                received += shape.statistics;
            }
        }
        Some((last_stage, received))
    }

    /// Under zero bubble, outside the chunk's W, the gradient sums ZeRO keeps whole beyond their
    /// shards: the other chunks' and, once a W of this one has run (`w_done`), its own (B makes no
    /// k or v gradient). `None` when there are none.
    fn sums_kept_whole(&self, beside: &Beside, w_done: bool) -> Option<Term> {
        let current = &self.holds[self.step.chunk as usize];
        let bytes = beside.other_sums_kept_whole + if w_done { current.grads_kept_whole } else { 0.0 };
        (bytes > 0.0).then_some(Term { name: GRADS_KEPT_WHOLE, bytes })
    }

    /// Inside B, at the points of its first layer's backward ([`ChunkHold::in_b`]) and of its head
    /// ([`ChunkHold::head_of_b`]): the stage's B gradients made by then (each point's `so_far`) and
    /// their sums (on the micro-batch's first B of the chunk but those not yet made,
    /// `sum_pending`), the W gradients' sums if a W has run, the later layers' inputs for W (but at
    /// the head), and what the micro-batch holds at each point.
    fn in_b(&self, beside: &Beside, params: f64) -> Vec<ForwardPhase> {
        let current = &self.holds[self.step.chunk as usize];
        let made_in_b = current.between_b_and_w.made_in_b.unwrap_or(0.0);
        let w_done = self.done(self.step.chunk, self.tail_phase) > 0.0;
        let w_sums = if w_done { current.grads - made_in_b } else { 0.0 };
        let b_done_before = self.done(self.step.chunk, self.input_phase) > 0.0;
        let loss_sum = self.zero_bubble_loss_sum(beside, true);
        let phase = |point: &Candidate, later_w_reads: f64| {
            let mut terms = vec![
                // (On the micro-batch's first B of the chunk, the sums of the B gradients not yet
                // made do not exist.)
                Term {
                    name: "gradient running sums (B's made, W's once a W has run)",
                    bytes: beside.other_sums + w_sums + made_in_b + loss_sum
                        - if b_done_before { 0.0 } else { point.sum_pending },
                },
                Term { name: "the micro-batch's B gradients", bytes: point.so_far },
                Term { name: "other micro-batches in flight or between B and W", bytes: beside.others },
                Term { name: "the later layers' inputs for W", bytes: later_w_reads },
            ];
            terms.extend(self.sums_kept_whole(beside, w_done));
            terms.extend(received(beside));
            terms.extend(point.held.iter().cloned());
            if b_done_before {
                terms.extend(point.new_sum.clone());
            }
            ForwardPhase { name: point.name, params, terms }
        };
        // (At the head of B none of them is made yet.)
        let later_w_reads = current.between_b_and_w.later_w_reads;
        let inside = current.in_b.iter().map(|point| phase(point, later_w_reads));
        inside.chain(current.head_of_b.iter().map(|point| phase(point, 0.0))).collect()
    }

    /// Under zero bubble, the loss's sum over the micro-batches, if the stage has made it by this
    /// point (`b_made` whether the current micro-batch's B has made its loss's part): a
    /// micro-batch's loss joins it in W where W makes it (beside dp or ep, which all-reduce it
    /// there; beside the load-balancing loss, added to the cross-entropy there), else in B (under
    /// cp too: each cp rank's loss is over every token's logits, gathered, and is not reduced).
    fn zero_bubble_loss_sum(&self, beside: &Beside, b_made: bool) -> f64 {
        let (shape, chunk) = (self.shape, self.step.chunk);
        let loss_reduced = shape.layout.degree(AxisName::Dp) > 1 || shape.ep > 1;
        let loss_in_w = loss_reduced || shape.statistics > 0.0;
        let made = self.done(chunk, self.tail_phase) > 0.0
            || (!loss_in_w && (b_made || self.done(chunk, self.input_phase) > 0.0));
        if made {
            beside.loss_sum
        } else {
            0.0
        }
    }

    /// Inside a forward ([`ChunkHold::forward`]): the running sums made so far
    /// (the chunk's B gradients' once a B has run, all its gradients' once a W has), the other
    /// micro-batches in flight or between B and W, the gradients (and what they keep) of the
    /// chunks the unfinished micro-batches have finished (interleaved), and what the forwarded
    /// micro-batch holds there.
    fn forward(&self, beside: &Beside, params: f64) -> Vec<ForwardPhase> {
        let chunk = self.step.chunk;
        let current = &self.holds[chunk as usize];
        let w_done = self.done(chunk, self.tail_phase) > 0.0;
        let sums = if w_done {
            current.grads
        } else if self.done(chunk, self.input_phase) > 0.0 {
            current.between_b_and_w.made_in_b.unwrap_or(0.0)
        } else {
            0.0
        };
        let sums_kept_whole = self.sums_kept_whole(beside, w_done).map_or(0.0, |term| term.bytes);
        let kept_whole = sums_kept_whole + beside.unfinished_kept_whole;
        let phase = |point: &Candidate| {
            let mut terms = vec![
                Term {
                    name: "gradient running sums, created so far",
                    bytes: beside.other_sums + sums + self.zero_bubble_loss_sum(beside, false),
                },
                Term { name: "other micro-batches in flight or between B and W", bytes: beside.others },
                Term { name: "the unfinished micro-batches' gradients", bytes: beside.unfinished_grads },
                Term { name: "what finished chunks keep to the micro-batch's end", bytes: beside.remains },
            ];
            if kept_whole > 0.0 {
                terms.push(Term { name: GRADS_KEPT_WHOLE, bytes: kept_whole });
            }
            terms.extend(received(beside));
            terms.extend(point.held.iter().cloned());
            ForwardPhase { name: point.name, params, terms }
        };
        current.forward.iter().map(phase).collect()
    }

    /// The chunk's points of a backward (or W): at each the running sums (on the micro-batch's
    /// first backward of the chunk, only those made so far), the micro-batches' gradients, the
    /// others in flight, what finished chunks keep, and what the point holds.
    fn backward(&self, beside: &Beside, params: f64) -> Vec<ForwardPhase> {
        let current = &self.holds[self.step.chunk as usize];
        let first_backward = self.done(self.step.chunk, self.tail_phase) == 0.0;
        let phase = |candidate: &Candidate| {
            let sums = if first_backward {
                Term {
                    name: "gradient running sums, created so far",
                    bytes: beside.other_sums + candidate.so_far - candidate.sum_pending + beside.loss_sum,
                }
            } else {
                Term { name: "gradient running sums", bytes: beside.other_sums + current.grads + beside.loss_sum }
            };
            // The gradients kept whole beyond their shards, in the sums and the micro-batches'.
            let pending = self.shape.kept_whole_pending(candidate.pending, current);
            let so_far_kept_whole = current.grads_kept_whole - pending;
            let sums_kept_whole = beside.other_sums_kept_whole
                + if first_backward { so_far_kept_whole } else { current.grads_kept_whole };
            let mut terms = vec![
                sums,
                Term { name: "the micro-batches' gradients so far", bytes: beside.unfinished_grads + candidate.so_far },
                Term { name: "other micro-batches in flight", bytes: beside.others },
                Term { name: "what finished chunks keep to the micro-batch's end", bytes: beside.remains },
            ];
            let kept_whole = sums_kept_whole + beside.unfinished_kept_whole + so_far_kept_whole;
            if kept_whole > 0.0 {
                terms.push(Term { name: GRADS_KEPT_WHOLE, bytes: kept_whole });
            }
            terms.extend(received(beside));
            terms.extend(candidate.held.iter().cloned());
            if !first_backward {
                terms.extend(candidate.new_sum.clone());
            }
            ForwardPhase { name: candidate.name, params, terms }
        };
        current.backward.iter().map(phase).collect()
    }
}

/// The micro-batches' received expert counts, and beside a tied table the head's parts taken ahead
/// of their reader, where they hold any.
fn received(beside: &Beside) -> impl Iterator<Item = Term> {
    let statistics = (beside.received > 0.0).then_some(Term {
        name: "the micro-batches' received expert counts summed over the layers",
        bytes: beside.received,
    });
    let head_parts =
        (beside.head_parts > 0.0).then_some(Term { name: TIED_HEAD_PARTS_TAKEN_AHEAD, bytes: beside.head_parts });
    statistics.into_iter().chain(head_parts)
}
