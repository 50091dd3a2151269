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
