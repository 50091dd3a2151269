//! Relays: a receive whose message the rank passes on unchanged, fused into one transfer.
//!
//! A ring (TSP's MLP shards, ring attention's key/value blocks, and their backward) receives a
//! block from one neighbour and, a step later, sends the same block on to the other. Lowered as a
//! `Recv` and a `Send`, the forward can only start once the compute stream has reached the
//! receive's `Wait`, after the step's GEMMs: each hop then waits for the slowest rank's compute
//! before it, and the ring goes round at the pace of compute plus link rather than the link's.
//! [`fuse_relays`] turns such a pair into one [`Instr::Relay`], which the communication stream
//! forwards as soon as the message is in, while the kernels run: on a GPU, a receive and a send
//! queued one after the other on the same NCCL stream.
//!
//! The fusion keeps each stream's transfer order: the `Send` must be the next transfer on the
//! main stream after the `Recv`, so the relay does on that stream exactly what the two did, one
//! after the other. The numbers cannot change: the relay forwards the words it received, which
//! are the words the `Send` would have packed from the buffers it received into.

use crate::program::{Instr, Program, TransferStream};

/// Fuses every `Recv` whose buffers the next transfer on the main stream sends on, unchanged,
/// into one [`Instr::Relay`]; `trace` (an entry an instruction, as `crate::lower` keeps it) loses
/// the removed sends' entries. Returns how many relays it made. A program with a `Wait` (already
/// scheduled) is left as it is.
pub fn fuse_relays<T>(program: &mut Program, trace: &mut Vec<T>) -> usize {
    if program.instructions.iter().any(|instr| matches!(instr, Instr::Wait { .. })) {
        return 0;
    }
    let mut removed = vec![false; program.instructions.len()];
    let mut relays = 0;
    for at in 0..program.instructions.len() {
        let Instr::Recv { outs, peer: from } = &program.instructions[at] else { continue };
        let next_transfer = (at + 1..program.instructions.len()).find(|&later| {
            let instr = &program.instructions[later];
            instr.is_transfer() && instr.transfer_stream() == TransferStream::Main
        });
        let Some(send_at) = next_transfer else { continue };
        let Instr::Send { bufs, peer: to } = &program.instructions[send_at] else { continue };
        if bufs != outs {
            continue;
        }
        // Nothing between may release what is forwarded (lowering never does; a malformed program
        // keeps its instructions for `validate` to report).
        let released = program.instructions[at + 1..send_at]
            .iter()
            .any(|instr| matches!(instr, Instr::Free { buf } if outs.contains(buf)));
        if released {
            continue;
        }
        let relay = Instr::Relay { outs: outs.clone(), from: *from, to: *to };
        program.instructions[at] = relay;
        removed[send_at] = true;
        relays += 1;
    }
    drop_removed(&mut program.instructions, &removed);
    drop_removed(trace, &removed);
    relays
}

/// Keeps the items of `items` whose index `removed` does not mark.
fn drop_removed<T>(items: &mut Vec<T>, removed: &[bool]) {
    let mut index = 0;
    items.retain(|_| {
        index += 1;
        !removed.get(index - 1).copied().unwrap_or(false)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Buffer, BufferId, BufferKind, Kernel, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn id(index: usize) -> BufferId {
        BufferId::new(index)
    }

    /// Rank 1 of a three-rank ring: its own block `a` goes to rank 2, rank 0's block `b` comes in,
    /// is multiplied, and goes on to rank 2; `c` comes in last and is only used.
    fn ring(between: Vec<Instr>) -> Program {
        let buffer = |name: &str, kind| Buffer { name: name.into(), dtype: DType::F32, shape: vec![4, 4], kind };
        let mut instructions = vec![
            Instr::LoadParam { out: id(0), name: "a".into(), shape: vec![4, 4], region: vec![(0, 4), (0, 4)] },
            Instr::Send { bufs: vec![id(0)], peer: 2 },
            Instr::Recv { outs: vec![id(1)], peer: 0 },
        ];
        instructions.extend(between);
        instructions.extend([
            Instr::Send { bufs: vec![id(1)], peer: 2 },
            Instr::Kernel { kernel: Kernel::MatMul { m: 4, n: 4, k: 4 }, inputs: vec![id(0), id(1)], out: id(3) },
            Instr::Recv { outs: vec![id(2)], peer: 0 },
            Instr::Free { buf: id(1) },
            Instr::Free { buf: id(2) },
            Instr::Output { buf: id(3), index: 0, shape: vec![4, 4], region: vec![(0, 4), (0, 4)] },
        ]);
        Program {
            format_version: FORMAT_VERSION,
            model: "ring".into(),
            mesh: "tsp=3".into(),
            rank: 1,
            world_size: 3,
            tokens_shape: vec![1, 4],
            buffers: vec![
                buffer("a", BufferKind::Param),
                buffer("b", BufferKind::InFlight),
                buffer("c", BufferKind::InFlight),
                buffer("y", BufferKind::Activation),
            ],
            instructions,
        }
    }

    #[test]
    fn a_received_block_sent_on_next_becomes_one_relay() {
        let mut program = ring(vec![]);
        let mut trace: Vec<usize> = (0..program.instructions.len()).collect();
        assert_eq!(fuse_relays(&mut program, &mut trace), 1);
        assert_eq!(program.instructions[2], Instr::Relay { outs: vec![id(1)], from: 0, to: 2 });
        // The send is gone, with its trace entry; the first send and the last receive stay.
        assert_eq!(program.instructions.len(), 8);
        assert_eq!(trace, vec![0, 1, 2, 4, 5, 6, 7, 8]);
        assert_eq!(program.instructions[1], Instr::Send { bufs: vec![id(0)], peer: 2 });
        assert_eq!(program.instructions[4], Instr::Recv { outs: vec![id(2)], peer: 0 });
        crate::validate::validate(&program).expect("still valid");
    }

    #[test]
    fn a_transfer_between_the_receive_and_the_send_keeps_them_apart() {
        let reduce = Instr::AllReduce {
            inputs: vec![id(0)],
            outs: vec![id(3)],
            group: crate::program::Group { axis: "tsp".into(), ranks: vec![0, 1, 2] },
        };
        let mut program = ring(vec![reduce]);
        let before = program.clone();
        let mut trace = vec![(); program.instructions.len()];
        assert_eq!(fuse_relays(&mut program, &mut trace), 0);
        assert_eq!(program, before);
    }

    #[test]
    fn a_scheduled_program_is_left_alone() {
        let mut program = ring(vec![]);
        program.instructions.insert(3, Instr::Wait { handle: vec![id(1)] });
        let before = program.clone();
        assert_eq!(fuse_relays(&mut program, &mut Vec::<()>::new()), 0);
        assert_eq!(program, before);
    }
}
