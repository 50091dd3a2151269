//! Communicators: how the ranks of one run exchange f32 tensors.
//!
//! [`Communicator`] is the interface the executor calls: the collectives (all-reduce, reduce-scatter,
//! all-gather, broadcast, all-to-all, barrier) over a [`Group`] of ranks, plus point-to-point send and
//! receive. Implementations: [`threads`] (ranks are OS threads of one process) and, with the feature
//! `mpi`, `mpi` (ranks are processes launched by `mpirun`). The algorithms are the
//! bandwidth-optimal ring ones of [`ring`], written once over a point-to-point [`ring::Transport`], so
//! the bytes each rank sends ([`CommStats`]) equal the textbook volumes exactly.
//!
//! Guarantees every implementation keeps:
//! - results of a collective are bitwise identical on every member of its group;
//! - every blocking wait is bounded by a timeout and fails with [`CommError::Timeout`];
//! - ranks that call different collectives (or different sizes) in the same slot get
//!   [`CommError::Mismatch`], never wrong data or a hang;
//! - a failed rank (explicit [`Communicator::abort`], or a panic) makes its peers' waits fail fast with
//!   [`CommError::PeerFailed`];
//! - errors are fatal: after any error the communicator is marked failed, its peers are told, and later
//!   calls return [`CommError::Aborted`].
//!
//! What this module is not: it knows nothing of meshes, shardings or programs; callers turn a mesh axis
//! into the [`Group`] of global ranks it spans.

pub mod link;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ring;
mod ring_endpoint;
pub mod threads;

#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

#[cfg(feature = "mpi")]
pub use self::mpi::{gemm_threads_per_process, MpiComm, MpiInitError};
pub use link::{LinkSpec, LinkSpecError};
pub use threads::{ThreadComm, ThreadFabric};

/// An ordered group of global ranks that a collective runs over (one mesh-axis group).
///
/// Order matters: member `i` of the group owns chunk `i` of a reduce-scatter or all-gather, and a
/// broadcast root is an index into `ranks`. Every member must pass an equal group.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    /// The global ranks of the members, in group order.
    pub ranks: Vec<u32>,
}

impl Group {
    /// A group of the given global ranks, in that order.
    pub fn new(ranks: impl Into<Vec<u32>>) -> Self {
        Self { ranks: ranks.into() }
    }

    /// The group of every rank of a world of `world_size` ranks, in rank order.
    pub fn world(world_size: u32) -> Self {
        Self { ranks: (0..world_size).collect() }
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Whether the group has no member (never valid for a collective).
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The position of global rank `rank` in the group, if it is a member.
    pub fn index_of(&self, rank: u32) -> Option<usize> {
        self.ranks.iter().position(|&member| member == rank)
    }

    /// Checks that the group is usable by `rank` in a world of `world_size` ranks for the operation
    /// described by `op`, and returns `rank`'s index in it.
    ///
    /// A group must be non-empty, hold only ranks of the world, hold each at most once, and contain
    /// `rank`.
    pub fn member_index(&self, rank: u32, world_size: u32, op: &str) -> Result<usize, CommError> {
        if self.ranks.is_empty() {
            return Err(CommError::EmptyGroup { rank, op: op.to_string() });
        }
        let mut seen = HashSet::with_capacity(self.ranks.len());
        for &member in &self.ranks {
            if member >= world_size {
                return Err(CommError::RankOutOfWorld { rank, op: op.to_string(), member, world_size });
            }
            if !seen.insert(member) {
                return Err(CommError::DuplicateRank { rank, op: op.to_string(), member });
            }
        }
        self.index_of(rank).ok_or_else(|| CommError::NotInGroup { rank, op: op.to_string(), group: self.clone() })
    }
}

/// Prints `[0,1,2,3]`.
impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (position, rank) in self.ranks.iter().enumerate() {
            if position > 0 {
                f.write_str(",")?;
            }
            write!(f, "{rank}")?;
        }
        f.write_str("]")
    }
}

/// Kinds of communication counted by the byte statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollectiveKind {
    /// Sum over the group, result everywhere.
    AllReduce,
    /// Sum over the group, each member keeps its chunk.
    ReduceScatter,
    /// Concatenation of every member's input, everywhere.
    AllGather,
    /// The root's buffer, everywhere.
    Broadcast,
    /// Point-to-point `send` / `recv`.
    SendRecv,
    /// Chunk `j` of member `i` goes to chunk `i` of member `j`.
    AllToAll,
    /// Synchronization only.
    Barrier,
}

impl CollectiveKind {
    /// Every kind, in declaration order.
    pub const ALL: [CollectiveKind; 7] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::SendRecv,
        CollectiveKind::AllToAll,
        CollectiveKind::Barrier,
    ];

    /// The snake_case name used in messages (`all_reduce`).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::SendRecv => "send_recv",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Barrier => "barrier",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes this rank sent, by kind: what actually went on the wire from this rank (payload only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    bytes_by_kind: [u64; CollectiveKind::ALL.len()],
}

impl CommStats {
    /// Bytes sent as part of operations of `kind`.
    pub fn bytes(&self, kind: CollectiveKind) -> u64 {
        self.bytes_by_kind[kind.slot()]
    }

    /// Bytes sent over all kinds.
    pub fn total(&self) -> u64 {
        self.bytes_by_kind.iter().sum()
    }

    /// Counts `bytes` more sent as part of an operation of `kind` (for implementations).
    pub fn add(&mut self, kind: CollectiveKind, bytes: u64) {
        self.bytes_by_kind[kind.slot()] += bytes;
    }

    /// Counts what `other` counted too (a rank's second stream's bytes beside its first's).
    pub fn merge(&mut self, other: &CommStats) {
        for (mine, theirs) in self.bytes_by_kind.iter_mut().zip(&other.bytes_by_kind) {
            *mine += theirs;
        }
    }
}

/// What a message belongs to. Transports attach one to every message so that a receiver can check the
/// sender is in the same operation as itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageTag {
    /// The kind of operation.
    pub kind: CollectiveKind,
    /// The group it runs over; for point-to-point, `[sender, receiver]`.
    pub group: Group,
    /// How many operations of the sender preceded this one on this group (for point-to-point: how many
    /// messages the sender sent to this receiver before).
    pub sequence: u64,
    /// The size of the whole operation in elements as the caller passed it (the buffer of all_reduce
    /// and broadcast, the input of reduce_scatter and all_to_all, the output of all_gather).
    pub op_elements: usize,
    /// The number of elements in this message.
    pub message_elements: usize,
}

/// Prints `all_reduce #3 over [0,1,2,3] of 10 elements (message of 3)`.
impl fmt::Display for MessageTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} #{} over {} of {} elements (message of {})",
            self.kind, self.sequence, self.group, self.op_elements, self.message_elements
        )
    }
}

/// Errors of communicators. Every variant names the rank that reports it (`rank`) and the operation.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum CommError {
    // === Waiting ===
    /// A blocking wait ran past the communicator's timeout.
    #[error(
        "rank {rank}: {op} timed out after {after:?} waiting for rank(s) {waiting_for:?}; make every \
         member of the group reach the same collective, or raise the timeout"
    )]
    #[diagnostic(code(E0630), help("make every group member reach the same collective, or raise --timeout"))]
    Timeout {
        /// The rank that waited.
        rank: u32,
        /// The operation, e.g. `all_reduce over [0,1,2,3]`.
        op: String,
        /// The ranks it was waiting for: the members that never reached this operation, or else the
        /// peer whose message did not come.
        waiting_for: Vec<u32>,
        /// How long it waited.
        after: Duration,
    },
    /// A rank this operation depends on failed (aborted or panicked).
    #[error("rank {rank}: {op} cannot complete because rank {peer} failed: {reason}; fix rank {peer} first")]
    #[diagnostic(code(E0631), help("fix the failed rank first; its error is reported too"))]
    PeerFailed {
        /// The rank that reports it.
        rank: u32,
        /// The rank that failed.
        peer: u32,
        /// Why it failed, as it said.
        reason: String,
        /// The operation that could not complete.
        op: String,
    },
    /// A peer sent a message of another operation, or of another size, in this slot.
    #[error(
        "rank {rank}: rank {peer} sent a message of {got} where {expected} was expected; make every \
         member of the group call the same collectives with the same sizes in the same order"
    )]
    #[diagnostic(code(E0632), help("make every member call the same collectives with the same sizes in order"))]
    Mismatch {
        /// The rank that received it.
        rank: u32,
        /// The rank that sent it.
        peer: u32,
        /// What the receiver is doing.
        expected: MessageTag,
        /// What the sender was doing.
        got: MessageTag,
    },
    /// This communicator failed earlier (an error or `abort`), so it runs nothing more.
    #[error("rank {rank}: cannot run {op}: this communicator failed earlier ({reason}); start a new run")]
    #[diagnostic(code(E0633), help("start a new run"))]
    Aborted {
        /// The rank.
        rank: u32,
        /// The operation refused.
        op: String,
        /// Why it failed earlier.
        reason: String,
    },

    // === Arguments ===
    /// The calling rank is not a member of the group.
    #[error("rank {rank}: cannot run {op}: rank {rank} is not in group {group}; call it only on members")]
    #[diagnostic(code(E0634), help("call the collective only on group members"))]
    NotInGroup {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// The group it was called on.
        group: Group,
    },
    /// The group has no member.
    #[error("rank {rank}: cannot run {op}: the group is empty; pass at least the calling rank")]
    #[diagnostic(code(E0635), help("pass at least the calling rank"))]
    EmptyGroup {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
    },
    /// The group holds a rank outside the world.
    #[error("rank {rank}: cannot run {op}: member {member} is not a rank of this world of {world_size}; use ranks 0..{world_size}")]
    #[diagnostic(code(E0636), help("use ranks of the world only"))]
    RankOutOfWorld {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// The offending member.
        member: u32,
        /// The number of ranks.
        world_size: u32,
    },
    /// The group holds a rank twice.
    #[error("rank {rank}: cannot run {op}: rank {member} appears twice in the group; list each rank once")]
    #[diagnostic(code(E0637), help("list each rank once in a group"))]
    DuplicateRank {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// The repeated member.
        member: u32,
    },
    /// A point-to-point peer is this rank itself or not a rank of the world.
    #[error("rank {rank}: cannot run {op}: peer {peer} must be another rank in 0..{world_size}")]
    #[diagnostic(code(E0638), help("send to another rank of the world"))]
    InvalidPeer {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// The peer asked for.
        peer: u32,
        /// The number of ranks.
        world_size: u32,
    },
    /// A broadcast root index is not a position in the group.
    #[error("rank {rank}: cannot run {op}: root index {root} is not below the group size {group_size}; the root is an index into the group, not a rank")]
    #[diagnostic(code(E0639), help("use a root inside the group"))]
    RootOutOfRange {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// The root index passed.
        root: usize,
        /// The number of members.
        group_size: usize,
    },
    /// A buffer that must split into one equal chunk a member does not.
    #[error("rank {rank}: cannot run {op}: {buffer} has {len} elements, not a multiple of the group size {group_size}; pad it to a multiple")]
    #[diagnostic(code(E0641), help("make the buffer a multiple of the group size"))]
    NotDivisible {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// Which buffer (`input`, `output`).
        buffer: &'static str,
        /// Its length.
        len: usize,
        /// The number of members.
        group_size: usize,
    },
    /// A buffer has the wrong length for the operation.
    #[error("rank {rank}: cannot run {op}: {buffer} has {got} elements where {expected} are needed")]
    #[diagnostic(code(E0642), help("pass buffers of the collective's size"))]
    BufferLength {
        /// The caller.
        rank: u32,
        /// The operation.
        op: String,
        /// Which buffer (`input`, `output`).
        buffer: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        got: usize,
    },
}

/// A communicator: one rank's endpoint into the group of ranks of a run.
///
/// Every member of a group must call the same collectives on it, with the same sizes, in the same
/// order. Reductions are sums. All calls block until this rank's part is done and are bounded by the
/// implementation's timeout. Any error is fatal to the communicator (see the module documentation).
pub trait Communicator: Send {
    /// This rank's global index.
    fn rank(&self) -> u32;

    /// The number of ranks of the run.
    fn world_size(&self) -> u32;

    /// Sums `buf` over the group, in place; the result is bitwise identical on every member.
    fn all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError>;

    /// `input` is D contiguous equal chunks (chunk i for group member i); `output` (length input/D)
    /// receives the sum over members of their chunk at this rank's index.
    fn reduce_scatter(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;

    /// `output` (length D * input) receives the concatenation of every member's input in group order.
    fn all_gather(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;

    /// `root` is an index into `group.ranks`; afterwards every member holds the root's `buf`.
    fn broadcast(&mut self, group: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError>;

    /// `input` is D equal chunks, chunk j goes to member j; `output` (same length) chunk i came from
    /// member i.
    fn all_to_all(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;

    /// All-to-all with sizes per member: `input` is member 0's chunk (`send_counts[0]` elements),
    /// then member 1's, ..; `output` is what each member sent this one, `recv_counts[i]` elements
    /// from member i, back to back. Every pair must agree on the sizes (exchange them first).
    fn all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[f32], &[usize]),
        receive: (&mut [f32], &[usize]),
    ) -> Result<(), CommError>;

    /// Sends `data` to global rank `peer`, which must `recv` a buffer of the same length.
    fn send(&mut self, peer: u32, data: &[f32]) -> Result<(), CommError>;

    /// Receives into `buf` the next message `peer` sent to this rank.
    fn recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError>;

    /// Returns once every member of the group has entered the barrier.
    fn barrier(&mut self, group: &Group) -> Result<(), CommError>;

    /// Bytes this rank sent since creation or the last `reset_stats`.
    fn stats(&self) -> &CommStats;

    /// Sets every byte count to zero.
    fn reset_stats(&mut self);

    /// Tells every peer this rank has failed: their waits that depend on it then fail quickly with
    /// [`CommError::PeerFailed`], naming this rank and `reason`. This communicator runs nothing more.
    fn abort(&mut self, reason: &str);

    /// This communicator, when it may be moved to another thread: a program with asynchronous
    /// transfers then runs them on a communication thread of the rank, beside its kernels. `None`
    /// (the default) runs every transfer on the rank's own thread, at its start.
    fn as_sendable(&mut self) -> Option<&mut (dyn Communicator + Send)> {
        None
    }

    /// A second endpoint of this rank, for its second communication stream
    /// (`TransferStream::Prefetch`): its collectives are sequenced and matched apart from this
    /// endpoint's (with the peers' second streams), over the same links, and it runs on its own
    /// thread beside this one. Every member of a collective must issue it on the same stream.
    /// `None` (the default, and for a second stream itself): the rank has one stream, which then
    /// runs both streams' transfers in the order they were started, always a safe order.
    fn second_stream(&mut self) -> Option<Box<dyn Communicator>> {
        None
    }
}

/// When a wait of `timeout` from now gives up: a timeout past what an `Instant` can hold (a
/// `--timeout` of 2^64 seconds) waits about a century instead of overflowing.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(u64::from(u32::MAX)))
}
