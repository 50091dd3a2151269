//! Transfers as start/wait pairs: which `Wait` ends which transfer, and the hazards a program must
//! not have while a transfer is in flight.
//!
//! A transfer instruction (a collective, `Send`, `Recv`) starts a transfer on the rank's
//! communication stream; the `Wait` that names its handle ([`Instr::transfer_handle`]) ends it. A
//! `Wait` pairs with the earliest earlier transfer of that handle that no `Wait` has ended yet.
//! Between a start and its wait the transfer reads its operands and writes its results
//! concurrently with the instructions between, so none of those may read the results, write
//! either, or free either; [`check_transfers`] refuses a program that does, naming the instruction.
//! A transfer that no `Wait` names is blocking: it ends before the next instruction.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::program::{BufferId, Instr, Program};

/// The start/wait pairs of a program, by instruction index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferPairs {
    /// For each transfer that a `Wait` ends: the wait's index.
    pub wait_of: HashMap<usize, usize>,
    /// For each `Wait`: the index of the transfer it ends.
    pub start_of: HashMap<usize, usize>,
}

impl TransferPairs {
    /// Whether the program has any asynchronous transfer.
    pub fn is_empty(&self) -> bool {
        self.wait_of.is_empty()
    }
}

fn bad(index: usize, reason: String) -> Error {
    Error::Inconsistent { instr: index, reason }
}

/// Pairs every `Wait` of `program` with the transfer it ends; a `Wait` that names no transfer
/// in flight is an error.
pub fn pair_transfers(program: &Program) -> Result<TransferPairs> {
    let mut in_flight: HashMap<Vec<BufferId>, Vec<usize>> = HashMap::new();
    let mut pairs = TransferPairs::default();
    for (index, instr) in program.instructions.iter().enumerate() {
        if let Some(handle) = instr.transfer_handle() {
            in_flight.entry(handle).or_default().push(index);
        } else if let Instr::Wait { handle } = instr {
            let starts = in_flight
                .get_mut(handle)
                .filter(|starts| !starts.is_empty())
                .ok_or_else(|| bad(index, format!("wait({}) names no transfer in flight", names(handle))))?;
            let start = starts.remove(0);
            pairs.wait_of.insert(start, index);
            pairs.start_of.insert(index, start);
        }
    }
    Ok(pairs)
}

fn names(handle: &[BufferId]) -> String {
    handle.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Checks that no instruction between a transfer's start and its wait reads the transfer's
/// results, or writes or frees what the transfer reads or writes.
pub fn check_transfers(program: &Program) -> Result<TransferPairs> {
    let pairs = pair_transfers(program)?;
    for (&start, &wait) in &pairs.wait_of {
        let transfer = &program.instructions[start];
        let results = transfer.outs();
        let operands = transfer.inputs();
        let touched = |buffer: &BufferId| results.contains(buffer) || operands.contains(buffer);
        for (index, instr) in program.instructions.iter().enumerate().take(wait).skip(start + 1) {
            let conflict = match instr {
                Instr::Free { buf } if touched(buf) => Some(format!("frees {buf}")),
                _ => instr
                    .inputs()
                    .into_iter()
                    .find(|buffer| results.contains(buffer))
                    .map(|buffer| format!("reads {buffer}"))
                    .or_else(|| instr.outs().into_iter().find(touched).map(|buffer| format!("writes {buffer}"))),
            };
            if let Some(conflict) = conflict {
                return Err(bad(
                    index,
                    format!(
                        "it {conflict} while the transfer started at instruction {start} is in flight \
                         (its wait is instruction {wait}); move the instruction after the wait"
                    ),
                ));
            }
        }
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Buffer, BufferKind, Group, Kernel, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn id(index: usize) -> BufferId {
        BufferId::new(index)
    }

    fn program(instructions: Vec<Instr>) -> Program {
        let buffer =
            |name: &str| Buffer { name: name.into(), dtype: DType::F32, shape: vec![4], kind: BufferKind::Activation };
        Program {
            format_version: FORMAT_VERSION,
            model: "hand".into(),
            mesh: "tp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![],
            buffers: vec![buffer("x"), buffer("x.sum"), buffer("y"), buffer("z")],
            instructions,
        }
    }

    fn all_reduce() -> Instr {
        Instr::AllReduce {
            inputs: vec![id(0)],
            outs: vec![id(1)],
            group: Group { axis: "tp".into(), ranks: vec![0, 1] },
        }
    }

    fn add(inputs: [usize; 2], out: usize) -> Instr {
        Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(inputs[0]), id(inputs[1])], out: id(out) }
    }

    #[test]
    fn a_wait_pairs_with_the_earliest_transfer_of_its_handle() {
        let send = || Instr::Send { bufs: vec![id(0)], peer: 1 };
        let wait = || Instr::Wait { handle: vec![id(0)] };
        let pairs = pair_transfers(&program(vec![send(), send(), wait(), all_reduce(), wait()])).unwrap();
        assert_eq!(pairs.start_of, HashMap::from([(2, 0), (4, 1)]));
        assert_eq!(pairs.wait_of, HashMap::from([(0, 2), (1, 4)]));
        assert!(pair_transfers(&program(vec![all_reduce()])).unwrap().is_empty(), "a blocking transfer has no wait");
    }

    #[test]
    fn a_wait_without_a_transfer_is_refused() {
        let err = pair_transfers(&program(vec![Instr::Wait { handle: vec![id(1)] }])).unwrap_err();
        assert!(err.to_string().contains("wait(b1) names no transfer in flight"), "{err}");
    }

    #[test]
    fn independent_work_may_run_beside_a_transfer() {
        let wait = Instr::Wait { handle: vec![id(1)] };
        let ok = program(vec![all_reduce(), add([2, 2], 3), wait, add([1, 3], 2)]);
        assert_eq!(check_transfers(&ok).unwrap().wait_of, HashMap::from([(0, 2)]));
    }

    #[test]
    fn reading_a_result_or_freeing_an_operand_in_flight_is_refused() {
        let wait = || Instr::Wait { handle: vec![id(1)] };
        let cases = [
            (add([1, 2], 3), "reads b1"),
            (Instr::Free { buf: id(0) }, "frees b0"),
            (add([2, 2], 0), "writes b0"),
            (Instr::Output { buf: id(1), index: 0, shape: vec![4], region: vec![(0, 4)] }, "reads b1"),
        ];
        for (conflict, says) in cases {
            let err = check_transfers(&program(vec![all_reduce(), conflict, wait()])).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("instruction 1") && text.contains(says), "{text}");
            assert!(text.contains("transfer started at instruction 0"), "{text}");
        }
    }
}
