//! A link between two pipeline stages carries messages in the order the sender's steps send
//! them; the receiver takes them in that order, each step those it reads as it begins and with
//! each the ones queued ahead of it (`backend::pipeline`), so a step may take messages a later
//! step reads, held from there.

use crate::pipeline::Step;

/// Per message of a link, the index of the receiving stage's step that takes it and of the one
/// that reads it (`None` where no step does).
pub(super) type Takes = Vec<(Option<usize>, Option<usize>)>;

/// Which of `steps` takes each of `sent` (each step taking the messages `reads` names as it
/// begins, and with each the ones queued ahead of it), and which reads it; `None` where a step
/// reads a message never sent.
pub(super) fn takes<M: Copy + PartialEq>(sent: &[M], steps: &[Step], reads: impl Fn(&Step) -> Vec<M>) -> Option<Takes> {
    let mut takes: Takes = vec![(None, None); sent.len()];
    let mut next = 0;
    for (at, step) in steps.iter().enumerate() {
        for message in reads(step) {
            let position = sent.iter().position(|&sent| sent == message)?;
            takes[position].1.get_or_insert(at);
            while next <= position {
                takes[next].0 = Some(at);
                next += 1;
            }
        }
    }
    Some(takes)
}
