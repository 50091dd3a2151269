//! The failure modes of the threads fabric: mismatched calls, timeouts, panics, aborts and bad
//! arguments. Each must end in an error that names the rank, the operation and the culprit, quickly.

use super::{run_ranks, run_ranks_catching, GENEROUS, SHORT};
use crate::comm::{CollectiveKind, CommError, Communicator, Group, ThreadComm, ThreadFabric};

#[test]
fn ranks_calling_different_collectives_get_a_mismatch() {
    let results = run_ranks(2, GENEROUS, |comm| {
        let group = Group::world(2);
        if comm.rank() == 0 {
            comm.all_reduce(&group, &mut [1.0; 4])
        } else {
            comm.all_gather(&group, &[1.0; 2], &mut [0.0; 4])
        }
    });
    let kinds = [CollectiveKind::AllReduce, CollectiveKind::AllGather];
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(CommError::Mismatch { rank: reporter, peer, expected, got }) => {
                assert_eq!((reporter, peer), (rank as u32, 1 - rank as u32));
                assert_eq!((expected.kind, got.kind), (kinds[rank], kinds[1 - rank]));
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn ranks_passing_different_sizes_get_a_mismatch() {
    let results = run_ranks(2, GENEROUS, |comm| {
        let mut buf = vec![1.0; 4 + 2 * comm.rank() as usize];
        comm.all_reduce(&Group::world(2), &mut buf)
    });
    let error = results[0].as_ref().unwrap_err();
    assert_eq!(
        error.to_string(),
        "rank 0: rank 1 sent a message of all_reduce #0 over [0,1] of 6 elements (message of 3) \
         where all_reduce #0 over [0,1] of 4 elements (message of 2) was expected; make every member \
         of the group call the same collectives with the same sizes in the same order"
    );
    assert!(matches!(results[1], Err(CommError::Mismatch { rank: 1, peer: 0, .. })), "{:?}", results[1]);
}

#[test]
fn recv_of_another_length_than_sent_is_a_mismatch() {
    let results = run_ranks(2, GENEROUS, |comm| {
        if comm.rank() == 0 {
            comm.send(1, &[1.0, 2.0, 3.0])
        } else {
            comm.recv(0, &mut [0.0; 4])
        }
    });
    assert_eq!(results[0], Ok(()));
    match &results[1] {
        Err(CommError::Mismatch { rank: 1, peer: 0, expected, got }) => {
            assert_eq!((expected.message_elements, got.message_elements), (4, 3));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// Rank 3 never calls the all-reduce: the ranks that wait report it, whichever of them times out
/// first; the others may instead learn of that first timeout as a failed peer.
#[test]
fn timeout_names_the_rank_that_never_arrived() {
    let group = Group::world(4);
    let results = run_ranks(4, SHORT, |comm| {
        if comm.rank() == 3 {
            return Ok(());
        }
        comm.all_reduce(&group, &mut [1.0; 8])
    });
    assert_eq!(results[3], Ok(()));
    let mut timeouts = 0;
    for (rank, result) in results[..3].iter().enumerate() {
        match result {
            Err(CommError::Timeout { rank: reporter, op, waiting_for, after }) => {
                assert_eq!(*reporter, rank as u32);
                assert_eq!(op, "all_reduce over [0,1,2,3]");
                assert_eq!(waiting_for, &vec![3]);
                assert_eq!(*after, SHORT);
                timeouts += 1;
            }
            Err(CommError::PeerFailed { reason, .. }) => {
                assert!(reason.contains("waiting for rank(s) [3]"), "rank {rank}: {reason}");
            }
            other => panic!("rank {rank}: expected a timeout, got {other:?}"),
        }
    }
    assert!(timeouts >= 1, "{results:?}");
}

/// Rank 2 is stuck in a loop (it holds its endpoint and never calls, until the test lets it go once
/// the others have returned): every other rank's all-reduce fails by the deadline, naming rank 2,
/// and a receive from the stuck rank fails naming it too.
#[test]
fn a_rank_stuck_in_a_loop_makes_the_others_fail_naming_it() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let group = Group::world(4);
    let returned = AtomicU32::new(0);
    let results = run_ranks(4, SHORT, |comm| {
        if comm.rank() == 2 {
            // Spins, like a rank in an infinite loop, until the three others have given up.
            while returned.load(Ordering::SeqCst) < 3 {
                std::hint::spin_loop();
                std::thread::yield_now();
            }
            return Ok(());
        }
        let result = comm.all_reduce(&group, &mut [1.0; 4]);
        returned.fetch_add(1, Ordering::SeqCst);
        result
    });
    for rank in [0, 1, 3] {
        match &results[rank] {
            Err(CommError::Timeout { waiting_for, .. }) => assert_eq!(waiting_for, &vec![2], "rank {rank}"),
            Err(CommError::PeerFailed { reason, .. }) => {
                assert!(reason.contains("waiting for rank(s) [2]"), "rank {rank}: {reason}")
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
    }
    let returned = AtomicU32::new(0);
    let results = run_ranks(2, SHORT, |comm| {
        if comm.rank() == 1 {
            while returned.load(Ordering::SeqCst) < 1 {
                std::thread::yield_now();
            }
            return Ok(());
        }
        let result = comm.recv(1, &mut [0.0; 2]);
        returned.fetch_add(1, Ordering::SeqCst);
        result
    });
    let error = results[0].as_ref().unwrap_err();
    assert!(matches!(error, CommError::Timeout { rank: 0, waiting_for, .. } if waiting_for == &vec![1]), "{error:?}");
}

#[test]
fn recv_timeout_names_the_silent_peer() {
    let results = run_ranks(2, SHORT, |comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.recv(1, &mut [0.0; 2])
    });
    let error = results[0].as_ref().unwrap_err();
    assert!(matches!(error, CommError::Timeout { rank: 0, waiting_for, .. } if waiting_for == &vec![1]), "{error:?}");
    assert_eq!(
        error.to_string(),
        "rank 0: send/recv from rank 1 to rank 0 timed out after 200ms waiting for rank(s) [1]; \
         make every member of the group reach the same collective, or raise the timeout"
    );
}

/// Rank 2 panics before the all-reduce; with a timeout of 30 s, the others can only return
/// `PeerFailed` (rather than `Timeout`) if they were told of the panic.
#[test]
fn a_panicking_rank_makes_its_peers_fail_naming_it() {
    let results = run_ranks_catching(4, GENEROUS, |comm| {
        if comm.rank() == 2 {
            // `resume_unwind` unwinds like a panic without printing a panic message.
            std::panic::resume_unwind(Box::new("rank 2 gives up"));
        }
        comm.all_reduce(&Group::world(4), &mut [1.0; 8])
    });
    assert!(results[2].is_err(), "rank 2 should have panicked");
    for rank in [0, 1, 3] {
        match results[rank].as_ref().expect("only rank 2 panics") {
            Err(CommError::PeerFailed { rank: reporter, peer: 2, reason, op }) => {
                assert_eq!(*reporter, rank as u32);
                assert_eq!(reason, "the thread of rank 2 panicked");
                assert_eq!(op, "all_reduce over [0,1,2,3]");
            }
            other => panic!("rank {rank}: expected PeerFailed naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn an_abort_reaches_the_peers_and_stops_the_aborting_rank() {
    let results = run_ranks(3, GENEROUS, |comm| {
        let group = Group::world(3);
        if comm.rank() == 1 {
            comm.abort("out of memory on rank 1");
        }
        comm.all_reduce(&group, &mut [1.0; 3])
    });
    assert_eq!(
        results[1].as_ref().unwrap_err().to_string(),
        "rank 1: cannot run all_reduce over [0,1,2]: this communicator failed earlier (out of memory \
         on rank 1); start a new run"
    );
    for rank in [0, 2] {
        let error = results[rank].as_ref().unwrap_err();
        assert!(
            matches!(error, CommError::PeerFailed { peer: 1, reason, .. } if reason == "out of memory on rank 1"),
            "rank {rank}: {error:?}"
        );
        assert!(error
            .to_string()
            .starts_with(&format!("rank {rank}: all_reduce over [0,1,2] cannot complete because rank 1 failed")));
    }
}

/// Errors in the arguments of one rank, reported before it sends anything.
#[test]
fn bad_arguments_are_errors_that_name_the_problem() {
    fn first_error(body: impl FnOnce(&mut ThreadComm) -> Result<(), CommError>) -> CommError {
        let mut comms = ThreadFabric::new(4, SHORT);
        body(&mut comms[0]).unwrap_err()
    }
    let pair = Group::new(vec![0, 1]);
    assert!(matches!(
        first_error(|comm| comm.all_reduce(&Group::new(vec![1, 2]), &mut [0.0; 2])),
        CommError::NotInGroup { rank: 0, group, .. } if group == Group::new(vec![1, 2])
    ));
    assert!(matches!(
        first_error(|comm| comm.all_reduce(&Group::new(vec![0, 7]), &mut [0.0; 2])),
        CommError::RankOutOfWorld { member: 7, world_size: 4, .. }
    ));
    assert!(matches!(
        first_error(|comm| comm.barrier(&Group::new(vec![0, 1, 0]))),
        CommError::DuplicateRank { member: 0, .. }
    ));
    assert!(matches!(first_error(|comm| comm.barrier(&Group::new(vec![]))), CommError::EmptyGroup { rank: 0, .. }));
    assert!(matches!(
        first_error(|comm| comm.reduce_scatter(&pair, &[0.0; 5], &mut [0.0; 2])),
        CommError::NotDivisible { buffer: "input", len: 5, group_size: 2, .. }
    ));
    assert!(matches!(
        first_error(|comm| comm.all_gather(&pair, &[0.0; 2], &mut [0.0; 5])),
        CommError::BufferLength { buffer: "output", expected: 4, got: 5, .. }
    ));
    assert!(matches!(
        first_error(|comm| comm.all_to_all(&pair, &[0.0; 4], &mut [0.0; 2])),
        CommError::BufferLength { buffer: "output", expected: 4, got: 2, .. }
    ));
    assert!(matches!(first_error(|comm| comm.send(0, &[1.0])), CommError::InvalidPeer { peer: 0, world_size: 4, .. }));
    assert!(matches!(first_error(|comm| comm.recv(9, &mut [0.0])), CommError::InvalidPeer { peer: 9, .. }));
    let error = first_error(|comm| comm.broadcast(&pair, 2, &mut [0.0; 3]));
    assert_eq!(
        error.to_string(),
        "rank 0: cannot run broadcast over [0,1]: root index 2 is not below the group size 2; the \
         root is an index into the group, not a rank"
    );
}

/// Rank 3 calls another collective than ranks 0 to 2. Whoever receives from it reports the mismatch;
/// every other rank learns of that failure at once, so that no rank is left to wait for the 30 s
/// timeout.
#[test]
fn a_mismatch_on_one_rank_fails_the_whole_group() {
    let results = run_ranks(4, GENEROUS, |comm| {
        let group = Group::world(4);
        if comm.rank() == 3 {
            comm.broadcast(&group, 0, &mut [1.0; 8])
        } else {
            comm.all_reduce(&group, &mut [1.0; 8])
        }
    });
    let mut mismatches = 0;
    for (rank, result) in results.iter().enumerate() {
        match result {
            Err(CommError::Mismatch { .. }) => mismatches += 1,
            Err(CommError::PeerFailed { .. }) => {}
            other => panic!("rank {rank}: expected a mismatch or a failed peer, got {other:?}"),
        }
    }
    assert!(mismatches >= 1, "{results:?}");
}
