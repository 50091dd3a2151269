//! Gradient bucketing: the gradients' all-reduces (or, under ZeRO-2 and 3, reduce-scatters) of a
//! training step, merged into buckets of up to a size, each one message (PyTorch DDP's
//! `bucket_cap_mb`, DeepSpeed's `reduce_bucket_size`, Megatron's grad buffer buckets).
//!
//! A lowered data-parallel step reduces every gradient on its own as the backward finishes it, so
//! a step pays each collective's latency once a parameter. Here consecutive reductions of one kind
//! and group whose results only the program's outputs read are gathered, in program order, into
//! buckets of at most `cap_bytes` of operands (a larger gradient is a bucket alone). A bucket runs
//! where its last member did, so each earlier member's operand stays live until then (the frees
//! between move after the bucket), and it packs its operands into one message while it runs
//! (`memory::Staging::Bucket` for an all-reduce; a reduce-scatter stages its operands' blocks as
//! one alone does): that is the memory a bucket costs, within the cap. Nothing else moves, so the
//! overlap scheduler, which runs after, still starts each bucket as soon as its last gradient
//! exists and the backward goes on beside it.
//!
//! Summing a concatenation is concatenating the sums, and the order in which a ring adds the
//! ranks' blocks is kept too: a reduce-scatter bucket sends each member's blocks of every gradient
//! side by side, and an all-reduce bucket (whose gradients must each split into the group's equal
//! chunks to join one) travels chunk by chunk in the runtime. So a bucketed step's numbers are the
//! unbucketed ones bit for bit.

use std::collections::{HashMap, HashSet};

use crate::program::{BufferId, Group, Instr, Program};

/// The gradients' all-reduces and reduce-scatters of `program` merged into buckets of at most
/// `cap_bytes` of operands, each bucket of one kind and group; `cap_bytes = 0`, or a program with
/// waits already placed, leaves it as it is.
pub fn bucket_gradient_reductions(program: &Program, cap_bytes: u64) -> Program {
    let instructions = &program.instructions;
    if cap_bytes == 0 || instructions.iter().any(|instr| matches!(instr, Instr::Wait { .. })) {
        return program.clone();
    }
    // Where each buffer is first read other than by an output or a free.
    let mut computed_from: HashSet<BufferId> = HashSet::new();
    let mut first_output: HashMap<BufferId, usize> = HashMap::new();
    for (at, instr) in instructions.iter().enumerate() {
        match instr {
            Instr::Output { buf, .. } => {
                first_output.entry(*buf).or_insert(at);
            }
            Instr::Free { .. } => {}
            other => computed_from.extend(other.inputs()),
        }
    }
    // A reduction whose result is an output (a gradient): a dead result would be freed early. An
    // all-reduced one only when it splits into the group's equal chunks: the runtime then sends a
    // bucket chunk by chunk, each member's chunk p in the ring's chunk p, so every element is added
    // over the ranks in the order it would be alone.
    let candidate = |instr| {
        gradient_reduction(instr, &computed_from).filter(|reduction| {
            first_output.contains_key(&reduction.out)
                && (reduction.dim.is_some()
                    || program.buffer(reduction.input).numel() % reduction.group.ranks.len() as u64 == 0)
        })
    };
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut open_bytes = 0;
    for (at, instr) in instructions.iter().enumerate() {
        let Some(reduction) = candidate(instr) else { continue };
        let bytes = program.buffer(reduction.input).bytes();
        let fits = open.first().is_some_and(|&first| {
            let first = candidate(&instructions[first]).expect("a member is a candidate");
            let alike = first.group == reduction.group && first.dim.is_some() == reduction.dim.is_some();
            // The bucket runs here: every member's result must still be unread by then.
            let unread = open.iter().all(|&member| {
                let member = candidate(&instructions[member]).expect("a member is a candidate");
                first_output.get(&member.out).is_none_or(|&read| read > at)
            });
            alike && unread && open_bytes + bytes <= cap_bytes
        });
        if !fits && !open.is_empty() {
            buckets.push(std::mem::take(&mut open));
            open_bytes = 0;
        }
        open.push(at);
        open_bytes += bytes;
    }
    if !open.is_empty() {
        buckets.push(open);
    }
    // The last member of each bucket runs it; the others' operands' frees wait for it.
    let mut runs_bucket: HashMap<usize, &[usize]> = HashMap::new();
    let mut held: HashMap<BufferId, usize> = HashMap::new();
    for bucket in buckets.iter().filter(|bucket| bucket.len() > 1) {
        let last = *bucket.last().expect("a bucket has members");
        runs_bucket.insert(last, bucket);
        for &member in &bucket[..bucket.len() - 1] {
            held.insert(candidate(&instructions[member]).expect("a member is a candidate").input, last);
        }
    }
    let merged: HashSet<usize> =
        runs_bucket.values().flat_map(|bucket| bucket[..bucket.len() - 1].iter().copied()).collect();
    let mut deferred: HashMap<usize, Vec<Instr>> = HashMap::new();
    let mut out = Vec::with_capacity(instructions.len());
    for (at, instr) in instructions.iter().enumerate() {
        if merged.contains(&at) {
            continue;
        }
        if let Instr::Free { buf } = instr {
            if let Some(&bucket_at) = held.get(buf) {
                if at < bucket_at {
                    deferred.entry(bucket_at).or_default().push(instr.clone());
                    continue;
                }
            }
        }
        match runs_bucket.get(&at) {
            Some(bucket) => {
                let members: Vec<Reduction> =
                    bucket.iter().map(|&member| candidate(&instructions[member]).expect("a member")).collect();
                let (inputs, outs) = members.iter().map(|member| (member.input, member.out)).unzip();
                let group = members[0].group.clone();
                out.push(match members[0].dim {
                    None => Instr::AllReduce { inputs, outs, group },
                    Some(_) => Instr::ReduceScatter {
                        inputs,
                        outs,
                        group,
                        dims: members.iter().filter_map(|member| member.dim).collect(),
                    },
                });
                out.extend(deferred.remove(&at).unwrap_or_default());
            }
            None => out.push(instr.clone()),
        }
    }
    Program { instructions: out, ..program.clone() }
}

/// One gradient's reduction: a single all-reduce, or reduce-scatter on `dim`.
struct Reduction<'p> {
    input: BufferId,
    out: BufferId,
    group: &'p Group,
    dim: Option<usize>,
}

/// A single all-reduce or reduce-scatter whose result nothing but outputs and frees read (no
/// buffer of `computed_from`).
fn gradient_reduction<'p>(instr: &'p Instr, computed_from: &HashSet<BufferId>) -> Option<Reduction<'p>> {
    let (inputs, outs, group, dim) = match instr {
        Instr::AllReduce { inputs, outs, group } => (inputs, outs, group, None),
        Instr::ReduceScatter { inputs, outs, group, dims } => (inputs, outs, group, dims.first().copied()),
        _ => return None,
    };
    match (inputs.as_slice(), outs.as_slice()) {
        ([input], [out]) if !computed_from.contains(out) => Some(Reduction { input: *input, out: *out, group, dim }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    use super::*;
    use crate::program::{Buffer, BufferKind, Kernel};

    /// A program of `sizes.len()` gradients: each computed, all-reduced over dp and freed, then
    /// every result output.
    fn gradients(sizes: &[u64]) -> Program {
        let mut buffers = Vec::new();
        let mut instructions = Vec::new();
        let mut fresh = |name: String, numel: u64| {
            let id = BufferId::new(buffers.len());
            buffers.push(Buffer { name, dtype: DType::F32, shape: vec![numel], kind: BufferKind::Activation });
            id
        };
        let group = Group { axis: "dp".into(), ranks: vec![0, 1] };
        let mut results = Vec::new();
        for (index, &numel) in sizes.iter().enumerate() {
            let grad = fresh(format!("g{index}"), numel);
            let reduced = fresh(format!("r{index}"), numel);
            instructions.push(Instr::Kernel { kernel: Kernel::Zeros, inputs: vec![], out: grad });
            instructions.push(Instr::AllReduce { inputs: vec![grad], outs: vec![reduced], group: group.clone() });
            instructions.push(Instr::Free { buf: grad });
            results.push((reduced, numel));
        }
        for (index, (reduced, numel)) in results.into_iter().enumerate() {
            instructions.push(Instr::Output {
                buf: reduced,
                index: index as u32,
                shape: vec![numel],
                region: vec![(0, numel)],
            });
        }
        Program {
            format_version: crate::program::FORMAT_VERSION,
            model: "gradients".into(),
            mesh: "dp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![1, 1],
            buffers,
            instructions,
        }
    }

    fn all_reduces(program: &Program) -> Vec<Vec<BufferId>> {
        program
            .instructions
            .iter()
            .filter_map(|instr| match instr {
                Instr::AllReduce { inputs, .. } => Some(inputs.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn consecutive_gradients_fill_buckets_up_to_the_cap() {
        // 100, 100, 100 and 300 elements of 4 bytes against a cap of 800 bytes: the first two fit
        // (800), the third opens a bucket, and the fourth (1200 bytes) is alone.
        let program = gradients(&[100, 100, 100, 300]);
        let bucketed = bucket_gradient_reductions(&program, 800);
        let id = BufferId::new;
        assert_eq!(all_reduces(&bucketed), vec![vec![id(0), id(2)], vec![id(4)], vec![id(6)]]);
        crate::validate::validate(&bucketed).expect("a valid program");
        // The first gradient's free waits for its bucket, which runs where the second's reduce was.
        let position = |wanted: &Instr| bucketed.instructions.iter().position(|instr| instr == wanted).unwrap();
        let bucket = position(&Instr::AllReduce {
            inputs: vec![id(0), id(2)],
            outs: vec![id(1), id(3)],
            group: Group { axis: "dp".into(), ranks: vec![0, 1] },
        });
        assert!(position(&Instr::Free { buf: id(0) }) > bucket);
        assert!(position(&Instr::Kernel { kernel: Kernel::Zeros, inputs: vec![], out: id(2) }) < bucket);
        assert_eq!(bucketed.instructions.len(), program.instructions.len() - 1);
    }

    #[test]
    fn a_gradient_that_does_not_split_into_the_groups_chunks_is_reduced_alone() {
        // 101 elements do not split into two equal chunks: the ring would add some of its elements
        // in another order inside a bucket than alone, so it is reduced alone where it was; the
        // others share a bucket, which runs where the last of them did.
        let program = gradients(&[100, 101, 100, 100]);
        let bucketed = bucket_gradient_reductions(&program, 1 << 20);
        let id = BufferId::new;
        assert_eq!(all_reduces(&bucketed), vec![vec![id(2)], vec![id(0), id(4), id(6)]]);
        crate::validate::validate(&bucketed).expect("a valid program");
    }

    #[test]
    fn reduce_scatters_bucket_apart_from_all_reduces() {
        // Two reduce-scatters (ZeRO-2's gradients) then two all-reduces: two buckets, one a kind,
        // each member keeping its dim.
        let mut program = gradients(&[100, 100, 100, 100]);
        for (index, instr) in program.instructions.iter_mut().enumerate() {
            if let Instr::AllReduce { inputs, outs, group } = instr {
                if index < 6 {
                    let (inputs, outs, group) = (inputs.clone(), outs.clone(), group.clone());
                    *instr = Instr::ReduceScatter { inputs, outs, group, dims: vec![0] };
                }
            }
        }
        for out in [1, 3] {
            program.buffers[out].shape = vec![50];
        }
        crate::validate::validate(&program).expect("a valid program");
        let bucketed = bucket_gradient_reductions(&program, 1 << 20);
        crate::validate::validate(&bucketed).expect("a valid program");
        let id = BufferId::new;
        let merged: Vec<_> = bucketed.instructions.iter().filter(|instr| instr.is_transfer()).cloned().collect();
        let group = Group { axis: "dp".into(), ranks: vec![0, 1] };
        assert_eq!(
            merged,
            vec![
                Instr::ReduceScatter {
                    inputs: vec![id(0), id(2)],
                    outs: vec![id(1), id(3)],
                    group: group.clone(),
                    dims: vec![0, 0]
                },
                Instr::AllReduce { inputs: vec![id(4), id(6)], outs: vec![id(5), id(7)], group },
            ]
        );
    }

    #[test]
    fn no_cap_or_a_result_read_by_a_kernel_keeps_the_reduce_alone() {
        let program = gradients(&[100, 100]);
        assert_eq!(bucket_gradient_reductions(&program, 0), program);
        // A kernel that reads the first result (an activation, not a gradient) keeps it out.
        let mut read = program.clone();
        let reader = BufferId::new(read.buffers.len());
        read.buffers.push(read.buffers[1].clone());
        read.instructions.insert(
            2,
            Instr::Kernel { kernel: Kernel::Add, inputs: vec![BufferId::new(1), BufferId::new(1)], out: reader },
        );
        assert_eq!(all_reduces(&bucket_gradient_reductions(&read, 1 << 20)).len(), 2);
    }
}
