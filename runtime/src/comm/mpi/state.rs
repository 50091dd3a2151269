//! What a rank's endpoints share: its first stream's [`MpiComm`](super::MpiComm) and every second
//! stream's. Kept apart from the endpoints so that a second stream opened for each run continues
//! the counts of the one before, and so that a failure on either stream is the rank's.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};

use ::mpi::topology::SimpleCommunicator;

use super::super::ring_endpoint::PointToPoint;
use super::super::Group;

/// The streams a rank has: the first on `MPI_COMM_WORLD`, the second on its duplicate.
const STREAMS: usize = 2;

/// One stream's sequence numbers: its operations so far on each group and with each peer.
pub(super) struct StreamCounts {
    /// Collectives the stream has entered on each group: the sequence number of the next one.
    pub(super) group_sequences: HashMap<Group, u64>,
    /// Point-to-point messages to and from each rank so far.
    pub(super) point_to_point: PointToPoint,
}

/// What a rank's endpoints share: the first stream's [`MpiComm`](super::MpiComm) and every second
/// stream's.
pub(super) struct RankState {
    /// Whether MPI is still initialized. An endpoint holds a read lock for each of its operations
    /// (and while it completes its sends when dropped); the first stream's endpoint takes the write
    /// lock to finalize, so that it waits for a second stream's operation in progress, and a second
    /// stream's later operations find MPI gone instead of calling into it.
    pub(super) mpi_open: RwLock<bool>,
    /// The duplicate of `MPI_COMM_WORLD` the second stream's data messages go on. Never freed by
    /// pleat: `MPI_Finalize` releases it, and freeing it from whichever endpoint is dropped last
    /// could come after finalize.
    pub(super) second_world: ManuallyDrop<SimpleCommunicator>,
    /// Whether the library lets several threads call MPI at once (`MPI_THREAD_MULTIPLE`): only
    /// then does the rank have a second stream.
    pub(super) concurrent_calls: bool,
    /// Indexed by stream.
    pub(super) counts: [Mutex<StreamCounts>; STREAMS],
    /// Why this rank failed, on either stream, once it has: its peers were told, and neither
    /// stream runs anything more.
    pub(super) failed: Mutex<Option<String>>,
    /// Failure notices received from peers, by either stream, in arrival order.
    pub(super) peer_failures: Mutex<Vec<(u32, String)>>,
}

// SAFETY: the only field that is not `Send` and `Sync` by itself is `second_world`, an MPI
// communicator handle. The rank's second endpoint, the only user of it, exists only when MPI was
// initialized with MPI_THREAD_MULTIPLE (`concurrent_calls`), which allows any thread to use any
// communicator at any time; `mpi_open` keeps every use between `MPI_Init_thread` and
// `MPI_Finalize`.
unsafe impl Send for RankState {}
// SAFETY: as for `Send`.
unsafe impl Sync for RankState {}

/// Locks `mutex` even if a thread panicked while holding it: every critical section here leaves the
/// data consistent, and a panicking rank is reported through its failure notices instead.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RankState {
    /// The state of a rank of a world of `world_size` ranks, before any operation.
    pub(super) fn new(world_size: u32, second_world: SimpleCommunicator, concurrent_calls: bool) -> RankState {
        let counts = || {
            Mutex::new(StreamCounts {
                group_sequences: HashMap::new(),
                point_to_point: PointToPoint::new(world_size as usize),
            })
        };
        RankState {
            mpi_open: RwLock::new(true),
            second_world: ManuallyDrop::new(second_world),
            concurrent_calls,
            counts: [counts(), counts()],
            failed: Mutex::new(None),
            peer_failures: Mutex::new(Vec::new()),
        }
    }
}
