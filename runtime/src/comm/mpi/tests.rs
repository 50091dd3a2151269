//! Tests of the MPI communicator. MPI needs one process a rank, so each test re-runs this test
//! binary under `mpirun` (the child runs only that test, as one rank) and checks that every rank's
//! copy passed. The children compare their results and byte counts with the same script run on the
//! threads fabric in-process, and check the sums and gathers against naive computations.

use std::process::Command;
use std::time::Duration;

use super::MpiComm;
use crate::comm::{CollectiveKind, CommError, CommStats, Communicator, Group, ThreadFabric};

/// Set in the children that `mpirun` starts.
const CHILD_ENV: &str = "PLEAT_MPI_TEST_CHILD";
const RANKS: u32 = 4;
static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Runs test `name` of this binary as `RANKS` MPI ranks and checks that all of them passed it.
fn run_ranks(name: &str) {
    // One job at a time: each starts several busy ranks, and the machine may have 2 cores.
    let _one_at_a_time = JOBS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let test_binary = std::env::current_exe().expect("the test binary's path");
    let output = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &RANKS.to_string()])
        .arg(test_binary)
        .args([&format!("comm::mpi::tests::{name}"), "--exact", "--test-threads=1", "--color=never"])
        .env(CHILD_ENV, "1")
        // Containers often forbid the cross-process memory copy Open MPI's shared-memory transport
        // prefers; plain copies work everywhere and the messages here are small.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .expect("mpirun runs (install openmpi-bin)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "mpirun failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", output.status);
    // The ranks share one stdout, and libtest writes "test result: ", "ok" and ". 1 passed; ..." in
    // separate writes that other ranks' output can split; the last piece is written whole.
    let passed = stdout.matches(". 1 passed; 0 failed").count();
    assert_eq!(passed, RANKS as usize, "every rank runs the test once\nstdout:\n{stdout}\nstderr:\n{stderr}");
}

/// Small integers, so that sums are exact in any order and results compare with `==`.
fn values(rank: u32, len: usize, salt: u32) -> Vec<f32> {
    (0..len).map(|j| ((rank as usize * 31 + j * 7 + salt as usize * 13) % 17) as f32 - 8.0).collect()
}

/// Every operation of the communicator, on the world and on sub-groups in unusual orders; returns
/// each output in order.
fn script(comm: &mut dyn Communicator) -> Result<Vec<Vec<f32>>, CommError> {
    let rank = comm.rank();
    let world = Group::world(comm.world_size());
    let pair_a = Group::new(vec![3, 1]);
    let pair_b = Group::new(vec![2, 0]);
    let shuffled = Group::new(vec![3, 1, 0, 2]);
    let mut outputs = Vec::new();

    let mut buf = values(rank, 10, 0);
    comm.all_reduce(&world, &mut buf)?;
    outputs.push(buf);
    for group in [&pair_a, &pair_b] {
        if group.index_of(rank).is_some() {
            let mut buf = values(rank, 7, 1);
            comm.all_reduce(group, &mut buf)?;
            outputs.push(buf);
        }
    }
    let input = values(rank, 4 * 5, 2);
    let mut output = vec![0.0; 5];
    comm.reduce_scatter(&shuffled, &input, &mut output)?;
    outputs.push(output);
    let input = values(rank, 3, 3);
    let mut output = vec![0.0; 12];
    comm.all_gather(&shuffled, &input, &mut output)?;
    outputs.push(output);
    // Longer than a broadcast segment, so the chain pipelines.
    let mut buf = if rank == 0 { values(rank, 70_000, 4) } else { vec![0.0; 70_000] };
    comm.broadcast(&shuffled, 2, &mut buf)?;
    outputs.push(buf);
    let input = values(rank, 4 * 2, 5);
    let mut output = vec![0.0; 8];
    comm.all_to_all(&world, &input, &mut output)?;
    outputs.push(output);
    // A ring of sends before receives: buffered sends must not deadlock.
    let size = comm.world_size();
    comm.send((rank + 1) % size, &values(rank, 6, 6))?;
    let mut received = vec![0.0; 6];
    comm.recv((rank + size - 1) % size, &mut received)?;
    outputs.push(received);
    // A message sent before a collective between the same pair and received after it (a TSP ring
    // shard passed on while the next owner's weights are broadcast): the broadcast, whose chain
    // runs 1 → 2 → 3 → 0 as the messages do, must not take it.
    comm.send((rank + 1) % size, &values(rank, 5, 7))?;
    let mut buf = if rank == 1 { values(rank, 9, 8) } else { vec![0.0; 9] };
    comm.broadcast(&world, 1, &mut buf)?;
    outputs.push(buf);
    let mut received = vec![0.0; 5];
    comm.recv((rank + size - 1) % size, &mut received)?;
    outputs.push(received);
    comm.barrier(&world)?;
    Ok(outputs)
}

/// The script on the threads fabric: each rank's outputs and byte counts.
fn script_on_threads() -> Vec<(Vec<Vec<f32>>, CommStats)> {
    let comms = ThreadFabric::new(RANKS, Duration::from_secs(60));
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || {
                    let outputs = script(&mut comm).expect("the threads fabric runs the script");
                    (outputs, comm.stats().clone())
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("a thread rank")).collect()
    })
}

#[test]
fn collectives_match_threads_and_naive_sums() {
    if !in_child() {
        run_ranks("collectives_match_threads_and_naive_sums");
        return;
    }
    let mut comm = MpiComm::init(Duration::from_secs(60)).expect("mpi starts");
    assert_eq!(comm.world_size(), RANKS, "launched with -np {RANKS}");
    let rank = comm.rank();
    let outputs = script(&mut comm).expect("the script runs over mpi");
    let stats = comm.stats().clone();
    let (thread_outputs, thread_stats) = script_on_threads().swap_remove(rank as usize);
    assert_eq!(outputs, thread_outputs, "rank {rank}: the same results as the threads fabric");
    assert_eq!(stats, thread_stats, "rank {rank}: the same bytes as the threads fabric");
    assert!(stats.bytes(CollectiveKind::AllReduce) > 0);
    // Independent of both fabrics: the world all-reduce is the elementwise sum, the all-gather the
    // concatenation in group order, the broadcast the root's buffer, the ring receive the left
    // neighbour's message.
    let sum: Vec<f32> = (0..10).map(|j| (0..RANKS).map(|member| values(member, 10, 0)[j]).sum()).collect();
    assert_eq!(outputs[0], sum, "rank {rank}: all_reduce");
    let gathered: Vec<f32> = [3, 1, 0, 2].iter().flat_map(|&member| values(member, 3, 3)).collect();
    assert_eq!(outputs[outputs.len() - 6], gathered, "rank {rank}: all_gather");
    assert_eq!(outputs[outputs.len() - 5], values(0, 70_000, 4), "rank {rank}: broadcast");
    assert_eq!(outputs[outputs.len() - 3], values((rank + RANKS - 1) % RANKS, 6, 6), "rank {rank}: recv");
    assert_eq!(outputs[outputs.len() - 2], values(1, 9, 8), "rank {rank}: the broadcast between a send and its recv");
    assert_eq!(outputs[outputs.len() - 1], values((rank + RANKS - 1) % RANKS, 5, 7), "rank {rank}: that recv");
}

#[test]
fn different_sizes_are_a_mismatch_and_peers_fail_fast() {
    if !in_child() {
        run_ranks("different_sizes_are_a_mismatch_and_peers_fail_fast");
        return;
    }
    let mut comm = MpiComm::init(Duration::from_secs(60)).expect("mpi starts");
    let rank = comm.rank();
    let world = Group::world(RANKS);
    let mut buf = vec![1.0; if rank == 3 { 9 } else { 8 }];
    let error = comm.all_reduce(&world, &mut buf).expect_err("sizes differ");
    match (rank, &error) {
        // Rank 0 receives from rank 3 first; rank 3 from rank 2, unless rank 0's failure notice
        // reaches it first (a loaded machine delays rank 2).
        (0, CommError::Mismatch { peer: 3, expected, got, .. }) => {
            assert_eq!((expected.op_elements, got.op_elements), (8, 9), "{error}");
        }
        (3, CommError::Mismatch { peer: 2, .. } | CommError::PeerFailed { .. }) => {}
        (1 | 2, CommError::Mismatch { .. } | CommError::PeerFailed { .. }) => {}
        _ => panic!("rank {rank}: unexpected error {error}"),
    }
    let later = comm.barrier(&world).expect_err("a failed communicator runs nothing more");
    assert!(matches!(later, CommError::Aborted { .. }), "rank {rank}: {later}");
}

#[test]
fn a_missing_rank_is_a_timeout_that_names_it() {
    if !in_child() {
        run_ranks("a_missing_rank_is_a_timeout_that_names_it");
        return;
    }
    let mut comm = MpiComm::init(Duration::from_secs(30)).expect("mpi starts");
    let rank = comm.rank();
    // Only rank 2, which waits on rank 1 directly, gives up soon; the others hear of it from rank 2.
    if rank == 2 {
        comm.set_timeout(Duration::from_secs(1));
    }
    if rank == 1 {
        // Never joins; stays alive past the others' timeout.
        std::thread::sleep(Duration::from_secs(3));
        return;
    }
    let mut buf = vec![1.0; 8];
    let error = comm.all_reduce(&Group::world(RANKS), &mut buf).expect_err("rank 1 never comes");
    match (rank, &error) {
        // Rank 2 receives from rank 1; the ranks downstream hear of rank 2's failure.
        (2, CommError::Timeout { waiting_for, op, .. }) => {
            assert_eq!(waiting_for, &vec![1], "{error}");
            assert_eq!(op, "all_reduce over [0,1,2,3]");
        }
        (0 | 3, CommError::PeerFailed { peer: 2 | 3, .. }) => {}
        _ => panic!("rank {rank}: unexpected error {error}"),
    }
}

/// What [`two_streams`] returns: every output in order, then the bytes each stream sent.
type TwoStreamRun = (Vec<Vec<f32>>, CommStats, CommStats);

/// The main stream's part of [`two_streams`]: an all-reduce and an all-gather over `group`.
fn main_stream_part(comm: &mut dyn Communicator, group: &Group) -> Result<Vec<Vec<f32>>, CommError> {
    let rank = comm.rank();
    let mut sum = values(rank, 4, 3);
    comm.all_reduce(group, &mut sum)?;
    let mut gathered = vec![0.0; group.len()];
    comm.all_gather(group, &values(rank, 1, 4), &mut gathered)?;
    Ok(vec![sum, gathered])
}

/// The second stream's part of [`two_streams`], on the same group: a broadcast longer than a
/// segment (so that its chain pipelines while the main stream's ring runs) and an all-gather.
fn second_stream_part(second: &mut dyn Communicator, group: &Group) -> Result<Vec<Vec<f32>>, CommError> {
    let rank = second.rank();
    let mut block = if rank == 2 { values(2, 70_000, 1) } else { vec![0.0; 70_000] };
    second.broadcast(group, 2, &mut block)?;
    let mut gathered = vec![0.0; 2 * group.len()];
    second.all_gather(group, &values(rank, 2, 2), &mut gathered)?;
    Ok(vec![block, gathered])
}

/// The two streams of a rank at once, as `a_second_stream_matches_only_the_peers_second_streams`
/// runs them on threads, then one more broadcast on the second stream, which ranks 0 and 2 open
/// anew for it: it matches the other ranks' only if a new endpoint continues the counts.
fn two_streams(comm: &mut dyn Communicator) -> Result<TwoStreamRun, CommError> {
    let rank = comm.rank();
    let world = Group::world(comm.world_size());
    let mut second = comm.second_stream().expect("a second stream");
    assert!(second.second_stream().is_none(), "a second stream has no third");
    let (main_outputs, second_outputs) = std::thread::scope(|scope| {
        let prefetch = scope.spawn(|| second_stream_part(&mut *second, &world));
        let main_outputs = main_stream_part(&mut *comm, &world);
        (main_outputs, prefetch.join().expect("the second stream's thread"))
    });
    let mut outputs = main_outputs?;
    outputs.extend(second_outputs?);
    let mut second_stats = second.stats().clone();
    if rank % 2 == 0 {
        drop(second);
        second = comm.second_stream().expect("a second stream again");
    }
    let mut buf = if rank == 1 { values(1, 9, 5) } else { vec![0.0; 9] };
    second.broadcast(&world, 1, &mut buf)?;
    outputs.push(buf);
    second_stats.merge(second.stats());
    Ok((outputs, comm.stats().clone(), second_stats))
}

#[test]
fn a_second_stream_matches_only_the_peers_second_streams() {
    if !in_child() {
        run_ranks("a_second_stream_matches_only_the_peers_second_streams");
        return;
    }
    let mut comm = MpiComm::init(Duration::from_secs(60)).expect("mpi starts");
    let rank = comm.rank();
    let (outputs, main_stats, second_stats) = two_streams(&mut comm).expect("both streams run over mpi");
    let comms = ThreadFabric::new(RANKS, Duration::from_secs(60));
    let on_threads: Vec<TwoStreamRun> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| scope.spawn(move || two_streams(&mut comm).expect("the threads fabric runs both streams")))
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("a thread rank")).collect()
    });
    let (thread_outputs, thread_main_stats, thread_second_stats) = &on_threads[rank as usize];
    assert_eq!(&outputs, thread_outputs, "rank {rank}: the same results as the threads fabric");
    assert_eq!(&main_stats, thread_main_stats, "rank {rank}: the main stream sends what it sends on threads");
    assert_eq!(&second_stats, thread_second_stats, "rank {rank}: the second stream sends what it sends on threads");
    assert!(second_stats.bytes(CollectiveKind::Broadcast) > 0 && main_stats.bytes(CollectiveKind::Broadcast) == 0);
    let inputs = |len: usize, salt: u32| (0..RANKS).map(|member| values(member, len, salt)).collect::<Vec<_>>();
    let sum: Vec<f32> = (0..4).map(|j| inputs(4, 3).iter().map(|input| input[j]).sum()).collect();
    assert_eq!(outputs[0], sum, "rank {rank}: the main stream's all_reduce");
    assert_eq!(outputs[1], inputs(1, 4).concat(), "rank {rank}: the main stream's all_gather");
    assert_eq!(outputs[2], values(2, 70_000, 1), "rank {rank}: the second stream's broadcast");
    assert_eq!(outputs[3], inputs(2, 2).concat(), "rank {rank}: the second stream's all_gather");
    assert_eq!(outputs[4], values(1, 9, 5), "rank {rank}: the broadcast on a reopened second stream");
}

#[test]
fn a_failure_on_a_second_stream_fails_the_peers_waits_on_both_streams() {
    if !in_child() {
        run_ranks("a_failure_on_a_second_stream_fails_the_peers_waits_on_both_streams");
        return;
    }
    const REASON: &str = "rank 1's prefetch stream failed on purpose";
    // Long enough that only the failure notice, never the timeout, can end the peers' waits.
    let mut comm = MpiComm::init(Duration::from_secs(60)).expect("mpi starts");
    let rank = comm.rank();
    let world = Group::world(RANKS);
    let mut second = comm.second_stream().expect("MPI_THREAD_MULTIPLE gives a second stream");
    if rank == 1 {
        second.abort(REASON);
        let mut buf = vec![1.0; 8];
        let error = comm.all_reduce(&world, &mut buf).expect_err("a rank that failed runs nothing more");
        assert!(matches!(&error, CommError::Aborted { reason, .. } if reason == REASON), "{error}");
        return;
    }
    // Both streams wait on rank 1 at once; whichever hears of its failure first fails this rank,
    // and the other then fails for it or refuses to start: either way rank 1's reason is named.
    let (on_main, on_second) = std::thread::scope(|scope| {
        let prefetch = scope.spawn(|| {
            let mut gathered = vec![0.0; 2 * RANKS as usize];
            second.all_gather(&world, &values(rank, 2, 2), &mut gathered)
        });
        let mut buf = vec![1.0; 8];
        (comm.all_reduce(&world, &mut buf), prefetch.join().expect("the second stream's thread"))
    });
    let mut peer_failed = 0;
    for (stream, outcome) in [("main", &on_main), ("second", &on_second)] {
        match outcome {
            Err(CommError::PeerFailed { reason, .. }) if reason.contains(REASON) => peer_failed += 1,
            Err(CommError::Aborted { reason, .. }) if reason.contains(REASON) => {}
            other => panic!("rank {rank}: the {stream} stream: {other:?}"),
        }
    }
    assert!(peer_failed >= 1, "rank {rank}: some stream hears of rank 1's failure: {on_main:?}, {on_second:?}");
}
