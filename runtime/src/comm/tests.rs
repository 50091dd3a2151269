//! Tests of the communicator contract on the threads fabric: results against naive computations,
//! exact byte counts, overlapping groups, and the failure modes (mismatch, timeout, panic, abort).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{CollectiveKind, CommError, Communicator, Group, ThreadComm, ThreadFabric};

mod failures;

/// For runs expected to succeed: long enough never to fire on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(30);
/// For runs expected to time out.
const SHORT: Duration = Duration::from_millis(200);

/// The collectives under test. For the gathering and scattering ones, `len` in [`check`] is the
/// per-member chunk; for all_reduce and broadcast it is the whole buffer.
#[derive(Clone, Copy, Debug)]
enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast { root: usize },
    AllToAll,
}

impl Collective {
    fn kind(self) -> CollectiveKind {
        match self {
            Collective::AllReduce => CollectiveKind::AllReduce,
            Collective::ReduceScatter => CollectiveKind::ReduceScatter,
            Collective::AllGather => CollectiveKind::AllGather,
            Collective::Broadcast { .. } => CollectiveKind::Broadcast,
            Collective::AllToAll => CollectiveKind::AllToAll,
        }
    }

    /// The input length a member passes.
    fn input_len(self, group_size: usize, len: usize) -> usize {
        match self {
            Collective::AllReduce | Collective::Broadcast { .. } | Collective::AllGather => len,
            Collective::ReduceScatter | Collective::AllToAll => group_size * len,
        }
    }
}

/// Small integers, so that sums are exact in any order and results compare with `==`.
fn values(rank: u32, len: usize, salt: u32) -> Vec<f32> {
    (0..len).map(|j| ((rank as usize * 31 + j * 7 + salt as usize * 13) % 17) as f32 - 8.0).collect()
}

/// Runs `collective` on `comm` and returns its output.
fn call(comm: &mut ThreadComm, collective: Collective, group: &Group, input: &[f32]) -> Result<Vec<f32>, CommError> {
    let group_size = group.len();
    match collective {
        Collective::AllReduce => {
            let mut buf = input.to_vec();
            comm.all_reduce(group, &mut buf).map(|()| buf)
        }
        Collective::Broadcast { root } => {
            let mut buf = input.to_vec();
            comm.broadcast(group, root, &mut buf).map(|()| buf)
        }
        Collective::ReduceScatter => {
            let mut output = vec![f32::NAN; input.len() / group_size];
            comm.reduce_scatter(group, input, &mut output).map(|()| output)
        }
        Collective::AllGather => {
            let mut output = vec![f32::NAN; input.len() * group_size];
            comm.all_gather(group, input, &mut output).map(|()| output)
        }
        Collective::AllToAll => {
            let mut output = vec![f32::NAN; input.len()];
            comm.all_to_all(group, input, &mut output).map(|()| output)
        }
    }
}

/// The outputs of `collective` computed directly from every member's input (both in group order).
fn naive(collective: Collective, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let group_size = inputs.len();
    let elementwise_sum = |range: std::ops::Range<usize>| -> Vec<f32> {
        range.map(|j| inputs.iter().map(|input| input[j]).sum()).collect()
    };
    (0..group_size)
        .map(|member| match collective {
            Collective::AllReduce => elementwise_sum(0..inputs[0].len()),
            Collective::Broadcast { root } => inputs[root].clone(),
            Collective::ReduceScatter => {
                let chunk = inputs[0].len() / group_size;
                elementwise_sum(member * chunk..(member + 1) * chunk)
            }
            Collective::AllGather => inputs.concat(),
            Collective::AllToAll => {
                let chunk = inputs[0].len() / group_size;
                (0..group_size)
                    .flat_map(|source| inputs[source][member * chunk..(member + 1) * chunk].to_vec())
                    .collect()
            }
        })
        .collect()
}

/// Elements member `index` of a group of `group_size` sends, by the textbook algorithms, in an
/// operation on `len` elements (the whole buffer, or the gathered / scattered full length).
fn expected_elements_sent(collective: Collective, group_size: usize, index: usize, len: usize) -> usize {
    if group_size == 1 {
        return 0;
    }
    // Uneven split: the first len % D chunks hold one element more.
    let chunk_size = |chunk: usize| len / group_size + usize::from(chunk < len % group_size);
    match collective {
        // Reduce-scatter sends every chunk but the one it keeps, all-gather every chunk but the one
        // its right neighbour keeps.
        Collective::AllReduce => 2 * len - chunk_size(index) - chunk_size((index + 1) % group_size),
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (group_size - 1) * len / group_size,
        Collective::Broadcast { root } => {
            let last_in_chain = (root + group_size - 1) % group_size;
            if index == last_in_chain {
                0
            } else {
                len
            }
        }
    }
}

/// Runs one thread per rank of a world of `world_size`, each calling `body` with its endpoint.
fn run_ranks<R: Send>(world_size: u32, timeout: Duration, body: impl Fn(&mut ThreadComm) -> R + Sync) -> Vec<R> {
    run_ranks_catching(world_size, timeout, body)
        .into_iter()
        .enumerate()
        .map(|(rank, result)| result.unwrap_or_else(|_| panic!("rank {rank} panicked")))
        .collect()
}

/// Like [`run_ranks`], but a rank's panic is its result instead of failing the test.
fn run_ranks_catching<R: Send>(
    world_size: u32,
    timeout: Duration,
    body: impl Fn(&mut ThreadComm) -> R + Sync,
) -> Vec<std::thread::Result<R>> {
    let comms = ThreadFabric::new(world_size, timeout);
    std::thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = comms.into_iter().map(|mut comm| scope.spawn(move || body(&mut comm))).collect();
        handles.into_iter().map(|handle| handle.join()).collect()
    })
}

/// Runs `collective` on `group` in a world of `world_size` and checks every member's output against
/// [`naive`] and its byte count against [`expected_elements_sent`], and that non-members sent nothing.
#[track_caller]
fn check(world_size: u32, group: &Group, collective: Collective, len: usize) {
    let group_size = group.len();
    let input_len = collective.input_len(group_size, len);
    let inputs: Vec<Vec<f32>> = group.ranks.iter().map(|&rank| values(rank, input_len, 0)).collect();
    let results = run_ranks(world_size, GENEROUS, |comm| {
        let rank = comm.rank();
        let output = group.index_of(rank).map(|index| call(comm, collective, group, &inputs[index]).unwrap());
        (output, comm.stats().clone())
    });
    let expected = naive(collective, &inputs);
    let textbook_len = match collective {
        Collective::AllReduce | Collective::Broadcast { .. } => len,
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => group_size * len,
    };
    let mut group_bytes = 0;
    for (rank, (output, stats)) in results.into_iter().enumerate() {
        let context = format!("{collective:?} over {group}, len {len}, rank {rank}");
        let Some(index) = group.index_of(rank as u32) else {
            assert!(output.is_none(), "{context}");
            assert_eq!(stats.total(), 0, "{context}: a non-member sent bytes");
            continue;
        };
        assert_eq!(output.as_ref(), Some(&expected[index]), "{context}");
        let bytes = 4 * expected_elements_sent(collective, group_size, index, textbook_len) as u64;
        assert_eq!(stats.bytes(collective.kind()), bytes, "{context}");
        assert_eq!(stats.total(), bytes, "{context}: bytes counted under another kind");
        group_bytes += bytes;
    }
    // The textbook volume over the whole group: 2(D-1)·n for all-reduce, (D-1)·n for the others.
    let factor = if matches!(collective, Collective::AllReduce) { 2 } else { 1 };
    let textbook = 4 * factor * (group_size as u64 - 1) * textbook_len as u64;
    assert_eq!(group_bytes, textbook, "{collective:?} over {group}, len {len}");
}

/// A group of `size` ranks listed out of rank order, so that group order and rank order differ.
fn scrambled_group(size: u32) -> Group {
    Group::new((0..size).map(|i| (size + 1 - i) % size).collect::<Vec<_>>())
}

#[test]
fn every_collective_matches_naive_for_group_sizes_1_2_3_4_8() {
    for group_size in [1u32, 2, 3, 4, 8] {
        let group =
            if group_size == 3 || group_size == 8 { scrambled_group(group_size) } else { Group::world(group_size) };
        for len in [1, 3, 5, 7, 13] {
            for collective in
                [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::AllToAll]
            {
                check(group_size, &group, collective, len);
            }
            let roots = [0, group_size as usize / 2, group_size as usize - 1];
            for root in roots {
                check(group_size, &group, Collective::Broadcast { root }, len);
            }
        }
    }
}

#[test]
fn empty_buffers_and_fewer_elements_than_members_work() {
    let group = Group::world(4);
    for len in [0, 1, 2] {
        check(4, &group, Collective::AllReduce, len);
        check(4, &group, Collective::Broadcast { root: 2 }, len);
    }
    check(4, &group, Collective::AllGather, 0);
}

#[test]
fn collectives_on_a_subgroup_leave_the_other_ranks_alone() {
    let group = Group::new(vec![6, 1, 4]);
    for collective in [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::AllToAll,
        Collective::Broadcast { root: 1 },
    ] {
        check(8, &group, collective, 5);
    }
}

/// Every rank of a rows x columns mesh alternates between its row group and its column group, so
/// collectives of different groups are in flight at once on overlapping ranks.
#[test]
fn overlapping_row_and_column_groups_run_concurrently() {
    for (rows, columns) in [(2u32, 2u32), (2, 4), (4, 2)] {
        let world_size = rows * columns;
        let row_of = |rank: u32| Group::new((0..columns).map(|c| rank / columns * columns + c).collect::<Vec<_>>());
        let column_of = |rank: u32| Group::new((0..rows).map(|r| r * columns + rank % columns).collect::<Vec<_>>());
        // (collective, whether it runs over the row, per-member chunk or buffer length, salt)
        let plan = [
            (Collective::AllReduce, true, 6),
            (Collective::AllReduce, false, 5),
            (Collective::AllGather, false, 2),
            (Collective::ReduceScatter, true, 3),
            (Collective::Broadcast { root: 1 }, false, 4),
            (Collective::AllToAll, true, 2),
            (Collective::AllReduce, false, 7),
        ];
        let results = run_ranks(world_size, GENEROUS, |comm| {
            let rank = comm.rank();
            plan.iter()
                .enumerate()
                .map(|(step, &(collective, over_row, len))| {
                    let group = if over_row { row_of(rank) } else { column_of(rank) };
                    let input = values(rank, collective.input_len(group.len(), len), step as u32);
                    call(comm, collective, &group, &input).unwrap()
                })
                .collect::<Vec<_>>()
        });
        for (step, &(collective, over_row, len)) in plan.iter().enumerate() {
            for rank in 0..world_size {
                let group = if over_row { row_of(rank) } else { column_of(rank) };
                let inputs: Vec<Vec<f32>> = group
                    .ranks
                    .iter()
                    .map(|&member| values(member, collective.input_len(group.len(), len), step as u32))
                    .collect();
                let expected = &naive(collective, &inputs)[group.index_of(rank).unwrap()];
                assert_eq!(
                    &results[rank as usize][step], expected,
                    "{rows}x{columns} mesh, step {step} ({collective:?} over {group}), rank {rank}"
                );
            }
        }
    }
}

/// Non-integer data, where the order of additions changes the last bits: every member must still
/// hold the very same bits, and they must be close to the exact sum.
#[test]
fn all_reduce_results_are_bitwise_identical_on_every_member() {
    for group_size in [2u32, 3, 5, 8] {
        let len: usize = 29;
        let inputs: Vec<Vec<f32>> = (0..group_size)
            .map(|rank| {
                (0..len)
                    .map(|j| {
                        let mixed = (rank as u64 * 2_654_435_761 + j as u64 * 40_503 + 12_345) % 1_000_003;
                        (mixed as f32 / 1_000_003.0 - 0.5) * 10f32.powi((j % 7) as i32 - 3)
                    })
                    .collect()
            })
            .collect();
        let results = run_ranks(group_size, GENEROUS, |comm| {
            let mut buf = inputs[comm.rank() as usize].clone();
            comm.all_reduce(&scrambled_group(group_size), &mut buf).unwrap();
            buf
        });
        for (rank, result) in results.iter().enumerate() {
            let bits: Vec<u32> = result.iter().map(|x| x.to_bits()).collect();
            let first_bits: Vec<u32> = results[0].iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, first_bits, "D={group_size}: rank {rank} differs from rank 0");
            for (j, &got) in result.iter().enumerate() {
                let exact: f64 = inputs.iter().map(|input| f64::from(input[j])).sum();
                let scale: f64 = inputs.iter().map(|input| f64::from(input[j]).abs()).sum();
                assert!((f64::from(got) - exact).abs() <= 1e-6 * scale, "D={group_size} j={j}: {got} vs {exact}");
            }
        }
    }
}

/// All-reduce of 10 elements over 4 ranks: chunks of 3, 3, 2, 2 elements, so rank i sends
/// 20 - |chunk i| - |chunk i+1| elements, and 2·3·10 = 60 over the group.
#[test]
fn all_reduce_byte_counts_with_uneven_chunks() {
    let stats = run_ranks(4, GENEROUS, |comm| {
        let mut buf = values(comm.rank(), 10, 0);
        comm.all_reduce(&Group::world(4), &mut buf).unwrap();
        comm.stats().clone()
    });
    let bytes: Vec<u64> = stats.iter().map(|stats| stats.bytes(CollectiveKind::AllReduce)).collect();
    assert_eq!(bytes, vec![56, 60, 64, 60]);
    assert_eq!(bytes.iter().sum::<u64>(), 4 * 60);
}

#[test]
fn stats_count_by_kind_and_reset() {
    let stats = run_ranks(2, GENEROUS, |comm| {
        let group = Group::world(2);
        let mut buf = vec![1.0; 6];
        comm.all_reduce(&group, &mut buf).unwrap();
        let mut gathered = vec![0.0; 4];
        comm.all_gather(&group, &[1.0, 2.0], &mut gathered).unwrap();
        comm.barrier(&group).unwrap();
        let before_reset = comm.stats().clone();
        comm.reset_stats();
        (before_reset, comm.stats().clone())
    });
    for (rank, (before_reset, after_reset)) in stats.into_iter().enumerate() {
        assert_eq!(before_reset.bytes(CollectiveKind::AllReduce), 4 * 6, "rank {rank}");
        assert_eq!(before_reset.bytes(CollectiveKind::AllGather), 4 * 2, "rank {rank}");
        assert_eq!(before_reset.bytes(CollectiveKind::Barrier), 0, "rank {rank}");
        assert_eq!(before_reset.total(), 4 * 8, "rank {rank}");
        assert_eq!(after_reset.total(), 0, "rank {rank}");
    }
}

#[test]
fn send_and_recv_rotate_data_around_a_ring() {
    let world_size = 5u32;
    let len = 3;
    let results = run_ranks(world_size, GENEROUS, |comm| {
        let rank = comm.rank();
        let (right, left) = ((rank + 1) % world_size, (rank + world_size - 1) % world_size);
        let mut held = values(rank, len, 0);
        let mut history = Vec::new();
        for _ in 0..world_size {
            comm.send(right, &held).unwrap();
            comm.recv(left, &mut held).unwrap();
            history.push(held.clone());
        }
        (history, comm.stats().bytes(CollectiveKind::SendRecv))
    });
    for (rank, (history, bytes)) in results.into_iter().enumerate() {
        for (round, held) in history.iter().enumerate() {
            // After k+1 rotations a rank holds the data of the rank k+1 places to its left.
            let source = (rank as u32 + world_size * 2 - round as u32 - 1) % world_size;
            assert_eq!(held, &values(source, len, 0), "rank {rank}, round {round}");
        }
        assert_eq!(bytes, 4 * (len * world_size as usize) as u64, "rank {rank}");
    }
}

#[test]
fn barrier_returns_only_after_every_member_entered() {
    for group_size in [1u32, 2, 3, 5, 8] {
        let rounds = 4;
        let entered: Vec<AtomicU32> = (0..rounds).map(|_| AtomicU32::new(0)).collect();
        let seen = run_ranks(group_size, GENEROUS, |comm| {
            (0..rounds)
                .map(|round| {
                    entered[round].fetch_add(1, Ordering::SeqCst);
                    comm.barrier(&scrambled_group(group_size)).unwrap();
                    entered[round].load(Ordering::SeqCst)
                })
                .collect::<Vec<_>>()
        });
        for (rank, seen) in seen.into_iter().enumerate() {
            assert_eq!(seen, vec![group_size; rounds], "D={group_size}, rank {rank}");
        }
    }
}

#[test]
fn group_prints_and_finds_members() {
    let group = Group::new(vec![4, 0, 2]);
    assert_eq!(group.to_string(), "[4,0,2]");
    assert_eq!(group.index_of(2), Some(2));
    assert_eq!(group.index_of(1), None);
    assert_eq!(Group::world(3), Group::new(vec![0, 1, 2]));
}

/// Over an emulated link a message is never delivered before the link could have carried it, and
/// the collectives built on such messages still compute the same sums.
#[test]
fn emulated_link_holds_messages_back_and_keeps_results() {
    use super::LinkSpec;
    use std::time::Instant;
    // 1 GB/s and 2 ms: 250,000 floats (1 MB) take 1 ms on the wire, 3 ms in all.
    let link = LinkSpec { bytes_per_s: 1e9, latency: Duration::from_millis(2) };
    let floor = link.serialization(1_000_000) + link.latency;
    let mut comms = ThreadFabric::with_link(2, GENEROUS, Some(link));
    let mut receiver = comms.pop().expect("rank 1");
    let mut sender = comms.pop().expect("rank 0");
    let data: Vec<f32> = (0..250_000).map(|i| i as f32).collect();
    let sent_at = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| sender.send(1, &data).expect("sends"));
        let mut buf = vec![0.0; data.len()];
        receiver.recv(0, &mut buf).expect("receives");
        // A lower bound the emulation enforces by construction, not a timing measurement.
        assert!(sent_at.elapsed() >= floor, "delivered after {:?}, before the link's {floor:?}", sent_at.elapsed());
        assert_eq!(buf, data);
    });

    let comms = ThreadFabric::with_link(3, GENEROUS, Some(link));
    let sums: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || {
                    let mut buf: Vec<f32> = (0..7).map(|i| (i * (comm.rank() + 1)) as f32).collect();
                    comm.all_reduce(&Group::world(3), &mut buf).expect("all_reduce");
                    buf
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("joins")).collect()
    });
    let expected: Vec<f32> = (0..7).map(|i| (i * 6) as f32).collect();
    assert!(sums.iter().all(|sum| *sum == expected), "{sums:?}");
}

/// Member i sends `(i + j) % 3` elements to member j, each naming the pair; every member receives
/// what the others addressed to it, in member order, and sends exactly the elements that leave it.
#[test]
fn all_to_all_with_sizes_per_member_delivers_each_pair_its_chunk() {
    let group = scrambled_group(4);
    let count = |from: usize, to: usize| (from + to) % 3;
    let results = run_ranks(4, GENEROUS, |comm| {
        let me = group.index_of(comm.rank()).expect("member");
        let send_counts: Vec<usize> = (0..4).map(|to| count(me, to)).collect();
        let recv_counts: Vec<usize> = (0..4).map(|from| count(from, me)).collect();
        let input: Vec<f32> =
            (0..4).flat_map(|to| (0..count(me, to)).map(move |k| (me * 100 + to * 10 + k) as f32)).collect();
        let mut output = vec![f32::NAN; recv_counts.iter().sum()];
        comm.all_to_all_v(&group, (&input, &send_counts), (&mut output, &recv_counts)).expect("all_to_all_v");
        let sent: usize = send_counts.iter().enumerate().filter(|&(to, _)| to != me).map(|(_, &n)| n).sum();
        (me, output, comm.stats().bytes(CollectiveKind::AllToAll), sent)
    });
    for (me, output, bytes, sent) in results {
        let expected: Vec<f32> =
            (0..4).flat_map(|from| (0..count(from, me)).map(move |k| (from * 100 + me * 10 + k) as f32)).collect();
        assert_eq!(output, expected, "member {me}");
        assert_eq!(bytes, 4 * sent as u64, "member {me}");
    }
}

/// A message sent point to point before a collective between the same pair, and received after
/// it, is not taken for the collective's (nor the collective's for it): the receiver gets the
/// broadcast's data and then the message, as `verify_collectives` assumes. A TSP rank under one
/// communication stream passes its ring shard on before its next owner's broadcast, which its
/// neighbour, behind, runs before receiving the shard.
#[test]
fn a_message_sent_before_a_collective_is_received_after_it() {
    let group = Group::world(3);
    let results = run_ranks(3, GENEROUS, |comm| {
        let rank = comm.rank();
        // The broadcast's chain from root 0 runs 0 → 1 → 2, as the messages do.
        comm.send((rank + 1) % 3, &values(rank, 5, 1)).unwrap();
        let mut buf = if rank == 0 { values(0, 70_000, 2) } else { vec![0.0; 70_000] };
        comm.broadcast(&group, 0, &mut buf).unwrap();
        let mut received = vec![0.0; 5];
        comm.recv((rank + 2) % 3, &mut received).unwrap();
        (buf, received)
    });
    for (rank, (broadcast, received)) in results.into_iter().enumerate() {
        assert_eq!(broadcast, values(0, 70_000, 2), "rank {rank}'s broadcast");
        assert_eq!(received, values((rank as u32 + 2) % 3, 5, 1), "rank {rank}'s message");
    }
}

/// A member that expects more than its peer sends gets an error naming the operation, not a hang.
#[test]
fn all_to_all_with_disagreeing_sizes_is_an_error() {
    let group = Group::world(2);
    let results = run_ranks(2, SHORT, |comm| {
        let me = comm.rank() as usize;
        // Member 0 sends 1 element to member 1, which expects 2.
        let send_counts = [1, 1];
        let recv_counts = if me == 1 { [1, 2] } else { [1, 1] };
        let input = vec![1.0; 2];
        let mut output = vec![0.0; recv_counts.iter().sum()];
        comm.all_to_all_v(&group, (&input, &send_counts), (&mut output, &recv_counts))
    });
    let error = results[1].as_ref().expect_err("member 1 sees the mismatch");
    assert!(error.to_string().contains("all_to_all"), "{error}");
}

/// A rank's second stream runs its own collectives beside the first's, on the same group, at the
/// same time: each matches only the peers' same stream, so both deliver their own results; a
/// member that issues a collective on the other stream is not taken for a peer: the wait times
/// out, naming who never came.
#[test]
fn a_second_stream_matches_only_the_peers_second_streams() {
    let group = Group::world(3);
    let results = run_ranks(3, GENEROUS, |comm| {
        let rank = comm.rank();
        let mut second = comm.second_stream().expect("the threads fabric has a second stream");
        assert!(second.second_stream().is_none(), "a second stream has no third");
        std::thread::scope(|scope| {
            let prefetch = scope.spawn(|| {
                let mut block = if rank == 2 { values(2, 5, 1) } else { vec![0.0; 5] };
                second.broadcast(&group, 2, &mut block).expect("broadcast");
                let mut gathered = vec![0.0; 6];
                second.all_gather(&group, &values(rank, 2, 2), &mut gathered).expect("all_gather");
                (block, gathered)
            });
            let mut sum = values(rank, 4, 3);
            comm.all_reduce(&group, &mut sum).expect("all_reduce");
            let mut gathered = vec![0.0; 3];
            comm.all_gather(&group, &values(rank, 1, 4), &mut gathered).expect("all_gather");
            (sum, gathered, prefetch.join().expect("the second stream's thread"))
        })
    });
    let inputs = |len: usize, salt: u32| (0..3).map(|rank| values(rank, len, salt)).collect::<Vec<_>>();
    for (sum, gathered, (block, prefetch_gathered)) in &results {
        assert_eq!(*sum, naive(Collective::AllReduce, &inputs(4, 3))[0]);
        assert_eq!(*gathered, inputs(1, 4).concat());
        assert_eq!(*block, values(2, 5, 1));
        assert_eq!(*prefetch_gathered, inputs(2, 2).concat());
    }

    let pair = Group::world(2);
    let outcomes = run_ranks(2, SHORT, |comm| {
        let mut buf = vec![1.0; 3];
        if comm.rank() == 0 {
            let mut second = comm.second_stream().expect("a second stream");
            second.all_reduce(&pair, &mut buf)
        } else {
            comm.all_reduce(&pair, &mut buf)
        }
    });
    // Whichever times out first names the other; the other then fails for it or times out too.
    for (rank, outcome) in outcomes.iter().enumerate() {
        let peer = 1 - rank as u32;
        match outcome {
            Err(CommError::Timeout { waiting_for, .. }) => assert_eq!(*waiting_for, vec![peer]),
            Err(CommError::PeerFailed { peer: failed, .. }) => assert_eq!(*failed, peer),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    assert!(outcomes.iter().any(|outcome| matches!(outcome, Err(CommError::Timeout { .. }))), "{outcomes:?}");
}

#[test]
fn a_timeout_past_what_an_instant_holds_waits_instead_of_overflowing() {
    let deadline = super::deadline_after(Duration::from_secs(u64::MAX));
    assert!(deadline > std::time::Instant::now() + Duration::from_secs(86_400 * 365 * 100));
}
