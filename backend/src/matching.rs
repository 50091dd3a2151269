//! The static collective-matching check: the per-rank programs cannot deadlock or mismatch.
//!
//! It simulates every rank's instruction stream with blocking collectives: a rank runs until its
//! next collective; a collective completes once every member of its group stands at a collective on
//! that group. If those members issued different collectives (kind, dim or size), the programs
//! mismatch; if no group can complete while some rank is unfinished, they deadlock. Both errors name
//! the ranks and the instructions.

use crate::error::{Error, Result};
use crate::program::{Instr, Program};

fn describe(program: &Program, at: usize) -> String {
    let instr = &program.instructions[at];
    let (kind, dim) = match instr {
        Instr::AllReduce { .. } => ("all_reduce", None),
        Instr::ReduceScatter { dim, .. } => ("reduce_scatter", Some(*dim)),
        Instr::AllGather { dim, .. } => ("all_gather", Some(*dim)),
        _ => ("(not a collective)", None),
    };
    let elements = instr.inputs().first().map_or(0, |&input| program.buffer(input).numel());
    let dim = dim.map(|dim| format!(" on dim {dim}")).unwrap_or_default();
    format!("{kind}{dim} of {elements} elements")
}

/// Checks that `programs` (one a rank, indexed by rank) run to completion with matching collectives.
pub fn verify_collectives(programs: &[Program]) -> Result<()> {
    let mut cursor = vec![0usize; programs.len()];
    let advance = |rank: usize, cursor: &mut [usize]| {
        let instructions = &programs[rank].instructions;
        while cursor[rank] < instructions.len() && instructions[cursor[rank]].group().is_none() {
            cursor[rank] += 1;
        }
    };
    loop {
        for rank in 0..programs.len() {
            advance(rank, &mut cursor);
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
        if !progressed {
            let waiting = blocked
                .iter()
                .map(|&rank| {
                    let at = cursor[rank];
                    let group = programs[rank].instructions[at].group().expect("blocked on a collective");
                    format!(
                        "rank {rank} at instruction {at} waits in {} over {}{:?}",
                        describe(&programs[rank], at),
                        group.axis,
                        group.ranks
                    )
                })
                .collect();
            return Err(Error::Deadlock { waiting });
        }
    }
}
