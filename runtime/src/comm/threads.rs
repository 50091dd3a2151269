//! The threads communicator: every rank is an OS thread of one process.
//!
//! [`ThreadFabric::new`] makes one [`ThreadComm`] per rank; move each into its thread. Messages go
//! through one mailbox per receiving rank, holding two FIFO queues per sender, one for the
//! messages of collectives and one for point-to-point messages (`lane`), so that messages between
//! a (sender, receiver) pair arrive in the order they were sent, and a message sent point to point
//! is never taken for a collective's, nor the other way round, whichever of the two the receiver
//! runs first. That is the order `pleat_backend::verify_collectives` checks programs against:
//! point-to-point messages queue, collectives complete by group. Sends are buffered and never
//! block; receives block on the mailbox's condition variable, bounded by the fabric's timeout.
//!
//! Every message carries a [`MessageTag`] (kind, group, per-group sequence number, sizes); a receiver
//! whose own operation differs reports [`CommError::Mismatch`] instead of taking the data. Failures are
//! recorded in the fabric in the order they happen: when a rank aborts (explicitly, on any error, or
//! when its `ThreadComm` is dropped during a panic), every waiting rank is woken, and a wait whose
//! group holds a failed rank returns [`CommError::PeerFailed`] naming the earliest such rank, so the
//! root cause is reported rather than the ranks that failed because of it. A `ThreadComm` dropped
//! normally is not a failure: its peers' waits on it time out.
//!
//! With a [`LinkSpec`] ([`ThreadFabric::with_link`]) every message is held back until the emulated
//! link would have delivered it (see [`super::link`]), so communication costs time as on a network.
//!
//! A rank may open a second stream ([`Communicator::second_stream`]): an endpoint of its own, with
//! its own mailboxes and sequence numbers so that its collectives match only the peers' second
//! streams, over the same links as the first. Once a rank has two, its sends are paced: a stream's
//! sender waits until its message has left the emulated wire before handing over the next, so the
//! two streams' messages interleave on a link (each gets about half of it while both send) instead
//! of one transfer's whole backlog going first.
//!
//! The collectives are those of [`super::ring`], run over this fabric as their [`Transport`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::link::{LinkClock, LinkSpec};
use super::ring::{OpContext, Transport};
use super::ring_endpoint::{PointToPoint, RingEndpoint};
use super::{CollectiveKind, CommError, CommStats, Communicator, Group, MessageTag};

/// Builds the connected endpoints of a world of ranks that are threads of this process.
#[derive(Debug)]
pub struct ThreadFabric;

impl ThreadFabric {
    /// The most ranks a fabric connects: every rank keeps mailboxes, counters and link clocks for
    /// every other (about 200·n² bytes; 2,000 ranks took a gigabyte, 100,000 exhausted memory).
    pub const MAX_RANKS: u32 = 1024;

    /// One connected [`ThreadComm`] per rank of a world of `world_size` ranks, in rank order. Every
    /// blocking wait of every rank gives up after `timeout`.
    #[allow(
        clippy::new_ret_no_self,
        reason = "a fabric is only the set of its endpoints; there is no fabric value to return"
    )]
    pub fn new(world_size: u32, timeout: Duration) -> Vec<ThreadComm> {
        Self::with_link(world_size, timeout, None)
    }

    /// As [`ThreadFabric::new`]; with `link`, every message arrives no sooner than that link would
    /// carry it.
    pub fn with_link(world_size: u32, timeout: Duration, link: Option<LinkSpec>) -> Vec<ThreadComm> {
        let n_ranks = world_size as usize;
        let shared = Arc::new(Shared {
            mailboxes: (0..STREAMS * n_ranks)
                .map(|_| Mailbox {
                    queues: Mutex::new((0..LANES * n_ranks).map(|_| VecDeque::new()).collect()),
                    arrived: Condvar::new(),
                })
                .collect(),
            failures: Mutex::new(Vec::new()),
            arrivals: (0..STREAMS * n_ranks).map(|_| Mutex::new(HashMap::new())).collect(),
            point_to_point: (0..STREAMS * n_ranks).map(|_| Mutex::new(PointToPoint::new(n_ranks))).collect(),
            links: (0..n_ranks)
                .map(|_| Mutex::new(Links { clocks: vec![LinkClock::default(); n_ranks], paced: false }))
                .collect(),
            n_ranks,
        });
        (0..world_size)
            .map(|rank| ThreadComm {
                rank,
                world_size,
                timeout,
                shared: Arc::clone(&shared),
                stats: CommStats::default(),
                failed: None,
                link,
                stream: 0,
            })
            .collect()
    }
}

/// One rank's endpoint of a [`ThreadFabric`].
pub struct ThreadComm {
    rank: u32,
    world_size: u32,
    timeout: Duration,
    shared: Arc<Shared>,
    stats: CommStats,
    /// Why this endpoint failed, once it has.
    failed: Option<String>,
    /// The emulated link, if any.
    link: Option<LinkSpec>,
    /// Which of the rank's streams this endpoint is: 0, or 1 for [`Communicator::second_stream`].
    stream: usize,
}

/// The streams a rank may have.
const STREAMS: usize = 2;

/// One rank's outgoing links, which its streams share.
struct Links {
    /// Indexed by receiving rank: the clock of this rank's link to it.
    clocks: Vec<LinkClock>,
    /// Whether a sender waits until its message has left the wire (once the rank has two streams).
    paced: bool,
}

/// What the endpoints of one fabric share.
struct Shared {
    /// Indexed by stream and receiving rank: `stream · n_ranks + rank`.
    mailboxes: Vec<Mailbox>,
    /// Failed ranks, in the order they failed.
    failures: Mutex<Vec<Failure>>,
    /// Indexed by stream and rank (`stream · n_ranks + rank`, as `mailboxes`): how many
    /// collectives the rank's stream has entered on each group. A member has reached operation `s`
    /// of a group when its count is above `s`; timeouts use it to say who never came.
    arrivals: Vec<Mutex<HashMap<Group, u64>>>,
    /// Indexed as `arrivals`.
    point_to_point: Vec<Mutex<PointToPoint>>,
    /// Indexed by rank.
    links: Vec<Mutex<Links>>,
    n_ranks: usize,
}

/// The queues a sender has in each mailbox: one for collectives' messages, one for point-to-point.
const LANES: usize = 2;

/// The queue of a mailbox that messages of `kind` from `sender` go through.
fn lane(sender: u32, kind: CollectiveKind) -> usize {
    LANES * sender as usize + usize::from(kind == CollectiveKind::SendRecv)
}

struct Mailbox {
    /// Indexed by [`lane`]: the sending rank and the kind of message.
    queues: Mutex<Vec<VecDeque<Message>>>,
    /// Signalled on every delivery and every failure.
    arrived: Condvar,
}

struct Message {
    tag: MessageTag,
    data: Vec<f32>,
    /// When an emulated link delivers it; `None`: at once.
    arrives_at: Option<Instant>,
}

struct Failure {
    rank: u32,
    reason: String,
}

/// Locks `mutex` even if a thread panicked while holding it: every critical section here leaves the
/// data consistent, and a panicking rank is reported through the failure list instead.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn record_failure(&self, rank: u32, reason: &str) {
        {
            let mut failures = lock(&self.failures);
            if failures.iter().all(|failure| failure.rank != rank) {
                failures.push(Failure { rank, reason: reason.to_string() });
            }
        }
        // Taking each mailbox lock before notifying means a receiver that checked the failure list
        // just before the push is already waiting, so it cannot miss the wake-up.
        for mailbox in &self.mailboxes {
            let _queues = lock(&mailbox.queues);
            mailbox.arrived.notify_all();
        }
    }

    /// The earliest failure of a rank other than `me` that `op` depends on: `peer` or a group member.
    fn failure_affecting(&self, me: u32, peer: u32, group: &Group) -> Option<(u32, String)> {
        lock(&self.failures)
            .iter()
            .find(|failure| failure.rank != me && (failure.rank == peer || group.ranks.contains(&failure.rank)))
            .map(|failure| (failure.rank, failure.reason.clone()))
    }

    /// Where `rank`'s state for `stream` is in the per-stream vectors (`mailboxes`, `arrivals`,
    /// `point_to_point`).
    fn slot(&self, stream: usize, rank: u32) -> usize {
        stream * self.n_ranks + rank as usize
    }

    /// The members of `op`'s group, other than `me`, whose `stream` has not yet entered `op`.
    fn missing_members(&self, me: u32, stream: usize, op: &OpContext<'_>) -> Vec<u32> {
        op.group
            .ranks
            .iter()
            .copied()
            .filter(|&member| member != me)
            .filter(|&member| {
                let entered = lock(&self.arrivals[self.slot(stream, member)]).get(op.group).copied().unwrap_or(0);
                entered <= op.sequence
            })
            .collect()
    }
}

impl ThreadComm {
    /// Where `rank`'s state for this endpoint's stream is, in `Shared`'s per-stream vectors.
    fn slot(&self, rank: u32) -> usize {
        self.shared.slot(self.stream, rank)
    }

    fn fail(&mut self, reason: &str) {
        if self.failed.is_none() {
            self.failed = Some(reason.to_string());
            self.shared.record_failure(self.rank, reason);
        }
    }

    /// Blocks until a message from `peer` is queued for this rank, a rank `op` depends on fails, or
    /// the timeout passes.
    fn wait_for_message(&self, op: &OpContext<'_>, peer: u32) -> Result<Message, CommError> {
        let deadline = super::deadline_after(self.timeout);
        let mailbox = &self.shared.mailboxes[self.slot(self.rank)];
        let mut queues = lock(&mailbox.queues);
        loop {
            // A message already delivered is taken even if its sender failed since, so that a
            // mismatch is reported as such and not as the failure it caused.
            if let Some(message) = queues[lane(peer, op.kind)].pop_front() {
                // Held on the emulated wire: the sender is done with it, so this wait is bounded by
                // the link's own delay, not by the timeout.
                if let Some(wait) = message.arrives_at.and_then(|at| at.checked_duration_since(Instant::now())) {
                    drop(queues);
                    std::thread::sleep(wait);
                }
                return Ok(message);
            }
            if let Some((failed, reason)) = self.shared.failure_affecting(self.rank, peer, op.group) {
                return Err(CommError::PeerFailed { rank: self.rank, peer: failed, reason, op: op.describe() });
            }
            let now = Instant::now();
            if now >= deadline {
                drop(queues);
                let mut waiting_for = match op.kind {
                    CollectiveKind::SendRecv => Vec::new(),
                    _ => self.shared.missing_members(self.rank, self.stream, op),
                };
                if waiting_for.is_empty() {
                    waiting_for.push(peer);
                }
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op: op.describe(),
                    waiting_for,
                    after: self.timeout,
                });
            }
            queues = mailbox.arrived.wait_timeout(queues, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Transport for ThreadComm {
    fn own_rank(&self) -> u32 {
        self.rank
    }

    fn n_ranks(&self) -> u32 {
        self.world_size
    }

    fn send_message(&mut self, op: &OpContext<'_>, peer: u32, data: &[f32]) -> Result<(), CommError> {
        self.check_peer(op, peer)?;
        // Sending to a failed rank is pointless; name the earliest failure, the likely root cause.
        if let Some((failed, reason)) = self.shared.failure_affecting(self.rank, peer, op.group) {
            return Err(CommError::PeerFailed { rank: self.rank, peer: failed, reason, op: op.describe() });
        }
        let bytes = std::mem::size_of_val(data) as u64;
        let (arrives_at, paced) = match self.link {
            Some(link) => {
                let mut links = lock(&self.shared.links[self.rank as usize]);
                let arrives_at = links.clocks[peer as usize].schedule(&link, Instant::now(), bytes);
                (Some(arrives_at), links.paced.then(|| arrives_at - link.latency))
            }
            None => (None, None),
        };
        let message = Message { tag: op.tag(data.len()), data: data.to_vec(), arrives_at };
        let mailbox = &self.shared.mailboxes[self.slot(peer)];
        lock(&mailbox.queues)[lane(self.rank, op.kind)].push_back(message);
        mailbox.arrived.notify_all();
        self.stats.add(op.kind, bytes);
        // Paced: the next message of this stream is handed over once this one has left the wire,
        // so that a message of the rank's other stream handed over meanwhile goes between.
        if let Some(wait) = paced.and_then(|left| left.checked_duration_since(Instant::now())) {
            std::thread::sleep(wait);
        }
        Ok(())
    }

    fn recv_message(&mut self, op: &OpContext<'_>, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        self.check_peer(op, peer)?;
        let message = self.wait_for_message(op, peer)?;
        if !op.matches(&message.tag, buf.len()) || message.data.len() != buf.len() {
            return Err(CommError::Mismatch { rank: self.rank, peer, expected: op.tag(buf.len()), got: message.tag });
        }
        buf.copy_from_slice(&message.data);
        Ok(())
    }
}

impl RingEndpoint for ThreadComm {
    fn guarded(
        &mut self,
        op: &OpContext<'_>,
        body: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if let Some(reason) = &self.failed {
            return Err(CommError::Aborted { rank: self.rank, op: op.describe(), reason: reason.clone() });
        }
        let result = body(self);
        if let Err(error) = &result {
            self.fail(&error.to_string());
        }
        result
    }

    fn enter(&mut self, group: &Group) -> u64 {
        let mut entered = lock(&self.shared.arrivals[self.slot(self.rank)]);
        if let Some(count) = entered.get_mut(group) {
            *count += 1;
            return *count - 1;
        }
        entered.insert(group.clone(), 1);
        0
    }

    fn point_to_point<T>(&self, with: impl FnOnce(&mut PointToPoint) -> T) -> T {
        with(&mut lock(&self.shared.point_to_point[self.slot(self.rank)]))
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn as_sendable(&mut self) -> Option<&mut (dyn Communicator + Send)> {
        Some(self)
    }

    fn second_stream(&mut self) -> Option<Box<dyn Communicator>> {
        if self.stream != 0 {
            return None;
        }
        lock(&self.shared.links[self.rank as usize]).paced = true;
        Some(Box::new(ThreadComm {
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.timeout,
            shared: Arc::clone(&self.shared),
            stats: CommStats::default(),
            failed: None,
            link: self.link,
            stream: 1,
        }))
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        self.ring_all_reduce(group, buf)
    }

    fn reduce_scatter(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.ring_reduce_scatter(group, input, output)
    }

    fn all_gather(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.ring_all_gather(group, input, output)
    }

    fn broadcast(&mut self, group: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.ring_broadcast(group, root, buf)
    }

    fn all_to_all(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.ring_all_to_all(group, input, output)
    }

    fn all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[f32], &[usize]),
        receive: (&mut [f32], &[usize]),
    ) -> Result<(), CommError> {
        self.ring_all_to_all_v(group, send, receive)
    }

    fn send(&mut self, peer: u32, data: &[f32]) -> Result<(), CommError> {
        self.sequenced_send(peer, data)
    }

    fn recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        self.sequenced_recv(peer, buf)
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.ring_barrier(group)
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = CommStats::default();
    }

    fn abort(&mut self, reason: &str) {
        self.fail(reason);
    }
}

/// A rank whose thread panics fails: its peers are told, so they stop waiting for it.
impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.fail(&format!("the thread of rank {} panicked", self.rank));
        }
    }
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("stats", &self.stats)
            .field("failed", &self.failed)
            .field("link", &self.link)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}
