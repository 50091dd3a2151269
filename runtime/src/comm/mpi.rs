//! The MPI communicator (feature `mpi`): every rank is a process, launched by `mpirun`.
//!
//! [`MpiComm::init`] initializes MPI (Open MPI through the `mpi` crate) and becomes this process's
//! endpoint of `MPI_COMM_WORLD`; the MPI rank is the pleat rank. The collectives are the ring
//! algorithms of [`super::ring`], run over MPI point-to-point messages as their [`Transport`], rather
//! than MPI's own collectives. Why: the bytes each rank sends ([`CommStats`]) are then those of the
//! threads communicator exactly, results are bitwise identical on every member (each chunk is summed
//! at one rank), every message carries its [`MessageTag`] so that mismatched collectives are
//! reported as [`CommError::Mismatch`], and every wait can be bounded. It also means no
//! sub-communicator is needed: a [`Group`] is only an ordered list of world ranks, so any group works
//! without a collective `MPI_Comm_split` that all ranks would have to agree on in advance.
//!
//! Guarantees, as the [`Communicator`] trait asks:
//! - sends are buffered (the payload is copied and sent with `MPI_Isend`) and never block, like the
//!   threads fabric's, so pipelines that send before they receive cannot deadlock;
//! - every wait polls (`MPI_Improbe`, `MPI_Test`) against a deadline and fails with
//!   [`CommError::Timeout`] naming the operation and the peer, never hangs;
//! - a rank that fails (any error, or [`Communicator::abort`]) sends a notice to every other rank;
//!   a peer waiting on an operation that depends on it fails with [`CommError::PeerFailed`];
//! - a process that dies abruptly is noticed by `mpirun`, which ends the job and names it.
//!
//! A rank has two communication streams, as on the threads fabric ([`Communicator::second_stream`]):
//! the first sends its data messages on `MPI_COMM_WORLD`, the second on a duplicate of it that every
//! rank makes in `init` (`MPI_Comm_dup` is collective, so all ranks make it there, in the same
//! order). MPI never matches a message of one communicator to a receive on another, so the two
//! streams' messages cannot take each other's places whatever order they arrive in, and each stream
//! keeps its own sequence numbers (in the rank's shared state, so that a second stream opened for
//! each run continues the counts of the one before). Failure notices travel on `MPI_COMM_WORLD` for
//! both streams and whichever of a rank's streams takes one records it for both, so a failure on
//! either stream of a rank fails the waits of both streams of its peers; a rank that fails on one
//! stream runs nothing more on the other either.
//!
//! MPI is initialized with `MPI_THREAD_MULTIPLE`, so that the two streams' threads may call MPI at
//! the same time. A library that gives only `MPI_THREAD_SERIALIZED` still runs every program: the
//! rank then has one stream (`second_stream` is `None`), which runs the prefetches too, in the
//! order they were started, as before the second stream existed; refusing instead would lose runs
//! that work for a speed-up. Less than that is refused ([`MpiInitError::ThreadLevel`]), since a
//! program scheduled for overlap lends the endpoint to the rank's communication thread
//! ([`Communicator::as_sendable`]), which then makes every MPI call of its stream there, polling its
//! messages beside the rank's kernels.
//!
//! The first stream's endpoint owns MPI: dropping it completes its pending sends (bounded by the
//! timeout) and finalizes MPI, on the thread that initialized it, as MPI asks. A second stream's
//! endpoint completes its own pending sends when it is dropped; every MPI call it makes holds the
//! rank's state open, so finalizing waits for a call in progress, and a second endpoint that
//! outlives the first fails its later calls instead of calling into a finalized library.

mod message;
mod state;

use std::fmt;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use ::mpi::datatype::Equivalence;
use ::mpi::environment::{Threading, Universe};
use ::mpi::point_to_point::{Destination, Source, Status};
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::{Communicator as _, SimpleCommunicator};

pub use self::message::{bytes_to_words, words_to_bytes};
use self::message::{decode_header, decode_notice, encode_message, encode_notice};
use self::state::{lock, RankState};
use super::ring::{OpContext, Transport};
use super::ring_endpoint::{PointToPoint, RingEndpoint};
use super::{CollectiveKind, CommError, CommStats, Communicator, Group, MessageTag};

/// The MPI tag of collectives' data messages.
const DATA_TAG: i32 = 1;
/// The MPI tag of point-to-point data messages: MPI matches a receive to the next message of its
/// source and tag, so the two kinds never take each other's messages, whichever the receiver runs
/// first, as on the threads fabric (point-to-point messages queue, collectives complete by group:
/// what `pleat_backend::verify_collectives` checks programs against).
const POINT_TO_POINT_TAG: i32 = 3;
/// The MPI tag of failure notices (a rank's reason, as UTF-8 bytes).
const FAILURE_TAG: i32 = 2;
/// Polls that only yield the processor before waits start sleeping between polls.
const SPIN_POLLS: u32 = 2000;

/// Errors starting the MPI communicator.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum MpiInitError {
    /// MPI was initialized before in this process.
    #[error("mpi is already initialized in this process; create one MpiComm a process")]
    #[diagnostic(code(E0643), help("create one MpiComm a process"))]
    AlreadyInitialized,
    /// The MPI library cannot serialize calls from several threads.
    #[error("the mpi library provides thread level {provided}, pleat needs {required}; use an Open MPI built with thread support")]
    #[diagnostic(code(E0644), help("use an Open MPI built with thread support"))]
    ThreadLevel {
        /// What pleat asked for.
        required: String,
        /// What the library gave.
        provided: String,
    },
}

/// The MPI tag data messages of `kind` are sent with.
fn data_tag(kind: CollectiveKind) -> i32 {
    if kind == CollectiveKind::SendRecv {
        POINT_TO_POINT_TAG
    } else {
        DATA_TAG
    }
}

/// A buffered send in flight: the request and the heap copy of the message it reads.
struct PendingSend {
    request: Request<'static, [f32]>,
    /// The leaked message buffer; freed when the request completes.
    buffer: *mut [f32],
    /// The receiving rank, for messages.
    peer: u32,
}

/// One rank's endpoint of a job launched by `mpirun`: its first stream ([`MpiComm::init`]), or
/// its second ([`Communicator::second_stream`]).
pub struct MpiComm {
    /// The first stream's endpoint owns MPI: dropping it finalizes. `None` for the second stream.
    universe: Option<Universe>,
    state: Arc<RankState>,
    /// Which of the rank's streams this endpoint is: 0 (data on `MPI_COMM_WORLD`), or 1 (data on
    /// `state.second_world`).
    stream: usize,
    /// `MPI_COMM_WORLD`: the first stream's data messages and both streams' failure notices.
    world: SimpleCommunicator,
    rank: u32,
    world_size: u32,
    timeout: Duration,
    stats: CommStats,
    pending_sends: Vec<PendingSend>,
}

/// The GEMM threads each process of this node may use: the cores shared by the ranks mpirun placed
/// here (Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`; all cores when it is unset).
pub fn gemm_threads_per_process() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let local_ranks =
        std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|value| value.parse::<usize>().ok()).unwrap_or(1);
    (cores / local_ranks.max(1)).max(1)
}

// SAFETY: an endpoint's MPI calls need `&mut self` or happen in `drop`, so one endpoint never makes
// two at once. With MPI_THREAD_MULTIPLE, MPI allows calls from any thread at any time, so moving an
// endpoint to another thread, and the rank's two endpoints calling at once, are both allowed. With
// MPI_THREAD_SERIALIZED the rank has one endpoint (`second_stream` gives none), so calls never
// overlap, which is all that level asks. The raw buffer pointers it holds are owned by it alone.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initializes MPI and returns this process's endpoint; every wait gives up after `timeout`.
    pub fn init(timeout: Duration) -> Result<MpiComm, MpiInitError> {
        let (universe, provided) =
            ::mpi::initialize_with_threading(Threading::Multiple).ok_or(MpiInitError::AlreadyInitialized)?;
        let concurrent_calls = match provided {
            Threading::Multiple => true,
            Threading::Serialized => false,
            Threading::Single | Threading::Funneled => {
                return Err(MpiInitError::ThreadLevel {
                    required: format!("{:?}", Threading::Serialized),
                    provided: format!("{provided:?}"),
                })
            }
        };
        let world = universe.world();
        // Collective: every rank makes it here, whatever thread level its library gave, so that the
        // ranks' calls match.
        let second_world = world.duplicate();
        let rank = world.rank() as u32;
        let world_size = world.size() as u32;
        let state = RankState::new(world_size, second_world, concurrent_calls);
        Ok(MpiComm {
            universe: Some(universe),
            state: Arc::new(state),
            stream: 0,
            world,
            rank,
            world_size,
            timeout,
            stats: CommStats::default(),
            pending_sends: Vec::new(),
        })
    }

    /// How long any wait may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long any later wait may take (of this endpoint, and of second streams opened
    /// after).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Waits (bounded by the timeout) until every buffered send has been delivered, so that the
    /// process may exit or finalize MPI.
    pub fn flush(&mut self) -> Result<(), CommError> {
        let rank = self.rank;
        self.while_mpi_open(Self::flush_open).unwrap_or_else(|| {
            Err(CommError::Aborted {
                rank,
                op: "delivering buffered sends".to_string(),
                reason: finalized_reason(rank),
            })
        })
    }

    /// Ends the whole job at once (`MPI_Abort`) with `exit_code`, after telling the peers why (as
    /// [`Communicator::abort`] does). Use it when this rank cannot go on: the other ranks may be
    /// blocked in MPI where no timeout of this process reaches them.
    pub fn abort_job(&mut self, reason: &str, exit_code: i32) -> ! {
        self.abort(reason);
        // Give the notices a moment to leave, so that peers can report the cause if they are polling.
        let deadline = Instant::now() + Duration::from_millis(200);
        while !self.pending_sends.is_empty() && Instant::now() < deadline {
            if self.while_mpi_open(Self::progress_sends).is_none() {
                break;
            }
            std::thread::yield_now();
        }
        // Callable whether or not MPI is still initialized: a second stream has no `abort_job`, and
        // the first keeps MPI initialized as long as it exists.
        self.world.abort(exit_code)
    }

    /// Runs `with` while MPI stays initialized, or returns `None` if the rank's first endpoint has
    /// finalized it. Every MPI call of an endpoint happens inside.
    fn while_mpi_open<T>(&mut self, with: impl FnOnce(&mut Self) -> T) -> Option<T> {
        let state = Arc::clone(&self.state);
        let open = state.mpi_open.read().unwrap_or_else(PoisonError::into_inner);
        (*open).then(|| with(self))
    }

    /// [`MpiComm::flush`], MPI being open.
    fn flush_open(&mut self) -> Result<(), CommError> {
        let deadline = super::deadline_after(self.timeout);
        let mut polls = 0;
        while !self.pending_sends.is_empty() {
            self.progress_sends();
            if self.pending_sends.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let mut waiting_for: Vec<u32> = self.pending_sends.iter().map(|pending| pending.peer).collect();
                waiting_for.sort_unstable();
                waiting_for.dedup();
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op: "delivering buffered sends".to_string(),
                    waiting_for,
                    after: self.timeout,
                });
            }
            back_off(&mut polls);
        }
        Ok(())
    }

    /// Completes whatever buffered sends have been delivered and frees their buffers.
    fn progress_sends(&mut self) {
        let mut still_pending = Vec::with_capacity(self.pending_sends.len());
        for pending in self.pending_sends.drain(..) {
            match pending.request.test() {
                Ok(_) => {
                    // SAFETY: `buffer` came from `Box::leak` in `post_send` and MPI is done with it.
                    drop(unsafe { Box::from_raw(pending.buffer) });
                }
                Err(request) => still_pending.push(PendingSend { request, ..pending }),
            }
        }
        self.pending_sends = still_pending;
    }

    /// The communicator this endpoint's data messages go on.
    fn data_world(&self) -> &SimpleCommunicator {
        if self.stream == 0 {
            &self.world
        } else {
            &self.state.second_world
        }
    }

    /// Sends `message` to `peer` with `tag` without blocking; the send completes in later polls.
    /// Failure notices go on `MPI_COMM_WORLD`, where either of the peer's streams takes them; data
    /// messages on this stream's communicator.
    fn post_send(&mut self, peer: u32, message: Vec<f32>, tag: i32) {
        let leaked: &'static mut [f32] = Box::leak(message.into_boxed_slice());
        let buffer: *mut [f32] = leaked;
        // SAFETY: the request only reads the buffer, which stays alive until the request completes
        // (`progress_sends` frees it then) or forever if it never does.
        let shared: &'static [f32] = unsafe { &*buffer };
        let communicator = if tag == FAILURE_TAG { &self.world } else { self.data_world() };
        let request = communicator.process_at_rank(peer as i32).immediate_send_with_tag(StaticScope, shared, tag);
        self.pending_sends.push(PendingSend { request, buffer, peer });
    }

    /// Records this rank's failure and tells every other rank, once for both streams. MPI must be
    /// open ([`MpiComm::while_mpi_open`]).
    fn fail(&mut self, reason: &str) {
        if !self.record_failure(reason) {
            return;
        }
        let words = encode_notice(reason);
        let rank = self.rank;
        for peer in (0..self.world_size).filter(|&peer| peer != rank) {
            self.post_send(peer, words.clone(), FAILURE_TAG);
        }
    }

    /// Records `reason` as this rank's failure unless one is recorded already; whether it was.
    fn record_failure(&self, reason: &str) -> bool {
        let mut failed = lock(&self.state.failed);
        if failed.is_some() {
            return false;
        }
        *failed = Some(reason.to_string());
        true
    }

    /// Takes every failure notice that has arrived, for both of the rank's streams.
    fn receive_failure_notices(&mut self) {
        while let Some((message, status)) = self.world.any_process().immediate_matched_probe_with_tag(FAILURE_TAG) {
            let (words, _) = ::mpi::point_to_point::MatchedReceiveVec::matched_receive_vec::<f32>((message, status));
            lock(&self.state.peer_failures).push((status.source_rank() as u32, decode_notice(&words)));
        }
    }

    /// The earliest failure of `peer` or of a member of `op`'s group.
    fn failure_affecting(&self, op: &OpContext<'_>, peer: u32) -> Option<CommError> {
        lock(&self.state.peer_failures)
            .iter()
            .find(|(failed, _)| *failed == peer || op.group.ranks.contains(failed))
            .map(|(failed, reason)| CommError::PeerFailed {
                rank: self.rank,
                peer: *failed,
                reason: reason.clone(),
                op: op.describe(),
            })
    }

    /// Polls `attempt` until it gives a value, a peer that `op` depends on fails, or the timeout
    /// passes; sends in flight progress meanwhile.
    fn poll<T>(
        &mut self,
        op: &OpContext<'_>,
        peer: u32,
        mut attempt: impl FnMut(&mut Self) -> Option<T>,
    ) -> Result<T, CommError> {
        let deadline = super::deadline_after(self.timeout);
        let mut polls = 0;
        loop {
            self.progress_sends();
            if let Some(value) = attempt(self) {
                return Ok(value);
            }
            self.receive_failure_notices();
            if let Some(error) = self.failure_affecting(op, peer) {
                // A message that arrived before the notice is taken even so, so that a mismatch is
                // reported as such and not as the failure it caused.
                return attempt(self).ok_or(error);
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op: op.describe(),
                    waiting_for: vec![peer],
                    after: self.timeout,
                });
            }
            back_off(&mut polls);
        }
    }
}

/// Why a second stream's endpoint refuses to run once MPI is finalized.
fn finalized_reason(rank: u32) -> String {
    format!("mpi is finalized: rank {rank}'s first MpiComm was dropped before this second stream")
}

/// Yields the processor while a wait is young, then sleeps a little between polls, so that ranks
/// oversubscribed on few cores let their peers run.
fn back_off(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    if *polls < SPIN_POLLS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl Transport for MpiComm {
    fn own_rank(&self) -> u32 {
        self.rank
    }

    fn n_ranks(&self) -> u32 {
        self.world_size
    }

    fn send_message(&mut self, op: &OpContext<'_>, peer: u32, data: &[f32]) -> Result<(), CommError> {
        self.check_peer(op, peer)?;
        self.receive_failure_notices();
        if let Some(error) = self.failure_affecting(op, peer) {
            return Err(error);
        }
        self.post_send(peer, encode_message(&op.tag(data.len()), data), data_tag(op.kind));
        self.stats.add(op.kind, std::mem::size_of_val(data) as u64);
        Ok(())
    }

    fn recv_message(&mut self, op: &OpContext<'_>, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        self.check_peer(op, peer)?;
        let tag = data_tag(op.kind);
        let (message, status): (::mpi::point_to_point::Message, Status) = self.poll(op, peer, |comm| {
            comm.data_world().process_at_rank(peer as i32).immediate_matched_probe_with_tag(tag)
        })?;
        let words = status.count(f32::equivalent_datatype()).max(0) as usize;
        let leaked: &'static mut [f32] = Box::leak(vec![0.0f32; words].into_boxed_slice());
        let buffer: *mut [f32] = leaked;
        let mut request = Some(message.immediate_matched_receive_into(StaticScope, leaked));
        let received = self.poll(op, peer, |_| match request.take().map(Request::test) {
            Some(Ok(_)) | None => Some(()),
            Some(Err(unfinished)) => {
                request = Some(unfinished);
                None
            }
        });
        if let Err(error) = received {
            // MPI may still write into the buffer: leave both to the process's end.
            std::mem::forget(request);
            return Err(error);
        }
        // SAFETY: `buffer` came from `Box::leak` above and the receive into it has completed.
        let words = unsafe { Box::from_raw(buffer) };
        let expected = op.tag(buf.len());
        let Some((tag, payload_start)) = decode_header(&words) else {
            let got = MessageTag { group: Group::new(Vec::new()), message_elements: words.len(), ..expected.clone() };
            return Err(CommError::Mismatch { rank: self.rank, peer, expected, got });
        };
        let payload = &words[payload_start..];
        if !op.matches(&tag, buf.len()) || payload.len() != buf.len() {
            return Err(CommError::Mismatch { rank: self.rank, peer, expected, got: tag });
        }
        buf.copy_from_slice(payload);
        Ok(())
    }
}

impl RingEndpoint for MpiComm {
    /// Runs `body` with MPI open, unless this rank already failed (on either stream) or MPI was
    /// finalized; any error it returns makes the rank fail.
    fn guarded(
        &mut self,
        op: &OpContext<'_>,
        body: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let rank = self.rank;
        let outcome = self.while_mpi_open(|comm| {
            if let Some(reason) = lock(&comm.state.failed).clone() {
                return Err(CommError::Aborted { rank, op: op.describe(), reason });
            }
            let result = body(comm);
            if let Err(error) = &result {
                comm.fail(&error.to_string());
            }
            result
        });
        outcome.unwrap_or_else(|| Err(CommError::Aborted { rank, op: op.describe(), reason: finalized_reason(rank) }))
    }

    fn enter(&mut self, group: &Group) -> u64 {
        let mut counts = lock(&self.state.counts[self.stream]);
        let counter = counts.group_sequences.entry(group.clone()).or_insert(0);
        *counter += 1;
        *counter - 1
    }

    fn point_to_point<T>(&self, with: impl FnOnce(&mut PointToPoint) -> T) -> T {
        with(&mut lock(&self.state.counts[self.stream]).point_to_point)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> u32 {
        self.rank
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
        // Once MPI is finalized the peers cannot be told; the rank still runs nothing more.
        if self.while_mpi_open(|comm| comm.fail(reason)).is_none() {
            self.record_failure(reason);
        }
    }

    /// A scheduled program's transfers then run on the rank's communication thread
    /// (`crate::stream`), which makes every MPI call of the run while the rank's own thread runs the
    /// kernels: that thread is the progress thread Open MPI needs for a transfer to advance beside
    /// compute (it does not progress messages in the background).
    fn as_sendable(&mut self) -> Option<&mut (dyn Communicator + Send)> {
        Some(self)
    }

    /// An endpoint of the rank's second stream, over the duplicate of `MPI_COMM_WORLD` made in
    /// `init`: its messages never match the first stream's, its sequence numbers continue those of
    /// the second streams opened before, and it runs on a thread of its own beside the first
    /// (the prefetch stream of `crate::stream`, its own progress thread). `None` for a second
    /// stream itself, and when the library gave less than `MPI_THREAD_MULTIPLE`.
    fn second_stream(&mut self) -> Option<Box<dyn Communicator>> {
        if self.stream != 0 || !self.state.concurrent_calls {
            return None;
        }
        Some(Box::new(MpiComm {
            universe: None,
            state: Arc::clone(&self.state),
            stream: 1,
            world: SimpleCommunicator::world(),
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.timeout,
            stats: CommStats::default(),
            pending_sends: Vec::new(),
        }))
    }
}

/// A rank that panics tells its peers first, as one that fails does. Then the endpoint's buffered
/// sends are completed (bounded by the timeout), and the first stream's endpoint finalizes MPI once
/// no second stream's operation is in progress. Sends that never complete are left to the process's
/// end rather than freed under MPI.
impl Drop for MpiComm {
    fn drop(&mut self) {
        let panicked = std::thread::panicking().then(|| format!("rank {} panicked", self.rank));
        let delivered = self.while_mpi_open(|comm| {
            if let Some(reason) = &panicked {
                comm.fail(reason);
            }
            comm.flush_open().is_ok()
        });
        if delivered != Some(true) {
            for pending in self.pending_sends.drain(..) {
                std::mem::forget(pending.request);
            }
        }
        if let Some(universe) = self.universe.take() {
            let mut open = self.state.mpi_open.write().unwrap_or_else(PoisonError::into_inner);
            *open = false;
            drop(universe);
        }
    }
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("stats", &self.stats)
            .field("pending_sends", &self.pending_sends.len())
            .field("stream", &self.stream)
            .field("failed", &*lock(&self.state.failed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
