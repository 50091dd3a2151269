//! The static collective-matching check: the per-rank programs cannot deadlock or mismatch.
//!
//! It simulates every rank's instruction stream with blocking collectives and queued point-to-point
//! messages: a rank runs until its next collective, or a receive whose message has not been sent; a collective completes once every member of its group stands at a collective on
//! that group. If those members issued different collectives (kind, dim or size), the programs
//! mismatch; if no group can complete while some rank is unfinished, they deadlock. Both errors name
//! the ranks and the instructions.
//!
//! A program whose transfers run on two streams (`TransferStream`) is checked in its start order,
//! each transfer blocking: if that completes, so do the streams, each of which only lets a rank run
//! further ahead, and a runtime with one stream runs exactly this order. The members of a
//! collective must put it on the same stream (the stream is part of what is compared).

use crate::error::{Error, Result};
use crate::program::{Instr, Program, TransferStream};

fn describe(program: &Program, at: usize) -> String {
    let instr = &program.instructions[at];
    let (kind, dims) = match instr {
        Instr::AllReduce { .. } => ("all_reduce", String::new()),
        Instr::ReduceScatter { dims, .. } => ("reduce_scatter", format!(" on dims {dims:?}")),
        Instr::AllGather { dim, .. } => ("all_gather", format!(" on dim {dim}")),
        Instr::AllToAll { split_dim, gather_dim, .. } => {
            ("all_to_all", format!(" from dim {gather_dim} to dim {split_dim}"))
        }
        Instr::Broadcast { root, .. } => ("broadcast", format!(" from root {root}")),
        _ => ("(not a collective)", String::new()),
    };
    let elements: u64 = instr.inputs().iter().map(|&input| program.buffer(input).numel()).sum();
    let stream = match instr.transfer_stream() {
        TransferStream::Main => "",
        TransferStream::Prefetch => " on the prefetch stream",
    };
    format!("{kind}{dims} of {elements} elements{stream}")
}

/// Checks that `programs` (one a rank, indexed by rank) run to completion with matching collectives
/// and point-to-point messages. Sends never block (they are queued); receives wait for the next
/// message from their peer, which must have their size.
pub fn verify_collectives(programs: &[Program]) -> Result<()> {
    let mut cursor = vec![0usize; programs.len()];
    let mut queues = Queues::new();
    loop {
        let mut moved = false;
        for rank in 0..programs.len() {
            moved |= advance(programs, rank, &mut cursor, &mut queues)?;
        }
        let blocked: Vec<usize> =
            (0..programs.len()).filter(|&rank| cursor[rank] < programs[rank].instructions.len()).collect();
        if blocked.is_empty() {
            return Ok(());
        }
        let mut progressed = false;
        for &rank in &blocked {
            // A rank a completed collective moved on sits at a non-collective now: it runs next round.
            let Some(group) = programs[rank].instructions.get(cursor[rank]).and_then(Instr::group).cloned() else {
                continue;
            };
            let ready = group.ranks.iter().all(|&member| {
                let member = member as usize;
                member < programs.len()
                    && programs[member].instructions.get(cursor[member]).and_then(Instr::group) == Some(&group)
            });
            if !ready {
                continue;
            }
            let signatures: Vec<String> = group
                .ranks
                .iter()
                .map(|&member| describe(&programs[member as usize], cursor[member as usize]))
                .collect();
            if signatures.iter().any(|signature| *signature != signatures[0]) {
                let issued = group
                    .ranks
                    .iter()
                    .zip(&signatures)
                    .map(|(member, signature)| {
                        format!("rank {member} at instruction {}: {signature}", cursor[*member as usize])
                    })
                    .collect();
                return Err(Error::CollectiveMismatch { axis: group.axis.clone(), ranks: group.ranks.clone(), issued });
            }
            for &member in &group.ranks {
                cursor[member as usize] += 1;
            }
            progressed = true;
        }
        if !progressed && !moved {
            let waiting = blocked
                .iter()
                .map(|&rank| {
                    let at = cursor[rank];
                    match &programs[rank].instructions[at] {
                        Instr::Recv { peer, .. } | Instr::Relay { from: peer, .. } => {
                            format!("rank {rank} at instruction {at} waits for a message from rank {peer}")
                        }
                        instr => {
                            let group = instr.group().expect("blocked on a collective or a receive");
                            format!(
                                "rank {rank} at instruction {at} waits in {} over {}{:?}",
                                describe(&programs[rank], at),
                                group.axis,
                                group.ranks
                            )
                        }
                    }
                })
                .collect();
            return Err(Error::Deadlock { waiting });
        }
    }
}

type Queues = std::collections::HashMap<(u32, u32), std::collections::VecDeque<(usize, u64)>>;

/// Runs `rank` up to its next collective, or a receive with nothing to receive; reports whether it
/// moved.
fn advance(programs: &[Program], rank: usize, cursor: &mut [usize], queues: &mut Queues) -> Result<bool> {
    let program = &programs[rank];
    let start = cursor[rank];
    while let Some(instr) = program.instructions.get(cursor[rank]) {
        match instr {
            Instr::Send { bufs, peer } => {
                let elements = bufs.iter().map(|&buf| program.buffer(buf).numel()).sum();
                queues.entry((rank as u32, *peer)).or_default().push_back((cursor[rank], elements));
            }
            Instr::Recv { outs, peer } | Instr::Relay { outs, from: peer, .. } => {
                let Some((sent_at, sent)) = queues.get_mut(&(*peer, rank as u32)).and_then(|queue| queue.pop_front())
                else {
                    break;
                };
                let expected: u64 = outs.iter().map(|&buf| program.buffer(buf).numel()).sum();
                if sent != expected {
                    return Err(Error::CollectiveMismatch {
                        axis: "point-to-point".into(),
                        ranks: vec![*peer, rank as u32],
                        issued: vec![
                            format!("rank {peer} at instruction {sent_at}: send of {sent} elements"),
                            format!("rank {rank} at instruction {}: recv of {expected} elements", cursor[rank]),
                        ],
                    });
                }
                // A relay's forward is queued once its message is in.
                if let Instr::Relay { to, .. } = instr {
                    queues.entry((rank as u32, *to)).or_default().push_back((cursor[rank], expected));
                }
            }
            instr if instr.group().is_some() => break,
            _ => {}
        }
        cursor[rank] += 1;
    }
    Ok(cursor[rank] != start)
}
