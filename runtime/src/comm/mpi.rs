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
//! MPI is initialized with `MPI_THREAD_SERIALIZED`; this type is the only user of MPI in the process
//! and needs `&mut self` for every call, so calls never overlap. A program scheduled for overlap
//! lends it to the rank's communication thread for the run ([`Communicator::as_sendable`]): every
//! MPI call of the run is then made there, polling its messages beside the rank's kernels.
//! Dropping it completes the pending sends (bounded by the timeout) and finalizes MPI.

use std::fmt;
use std::time::{Duration, Instant};

use ::mpi::datatype::Equivalence;
use ::mpi::environment::{Threading, Universe};
use ::mpi::point_to_point::{Destination, Source, Status};
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::{Communicator as _, SimpleCommunicator};

use super::ring::{self, OpContext, Transport};
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
/// The first header word of every data message, to catch a message that is not pleat's.
const MAGIC: u32 = 0x706c_6174;
/// Header words before the group's ranks: magic, kind, sequence (2), op elements (2), message
/// elements (2), group length.
const FIXED_HEADER_WORDS: usize = 9;
/// Failure notices are cut to this many bytes, so that they go eagerly even to a rank that never
/// receives them.
const MAX_REASON_BYTES: usize = 1024;
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

/// One rank's endpoint of a job launched by `mpirun`.
pub struct MpiComm {
    /// Dropped last: finalizes MPI.
    universe: Option<Universe>,
    world: SimpleCommunicator,
    rank: u32,
    world_size: u32,
    timeout: Duration,
    stats: CommStats,
    /// Collectives this rank has entered on each group: the sequence number of the next one.
    group_sequences: std::collections::HashMap<Group, u64>,
    /// Point-to-point messages sent to each rank so far.
    sends_to: Vec<u64>,
    /// Point-to-point messages received from each rank so far.
    recvs_from: Vec<u64>,
    pending_sends: Vec<PendingSend>,
    /// Why this endpoint failed, once it has.
    failed: Option<String>,
    /// Failure notices received from peers, in arrival order.
    peer_failures: Vec<(u32, String)>,
}

/// The GEMM threads each process of this node may use: the cores shared by the ranks mpirun placed
/// here (Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`; all cores when it is unset).
pub fn gemm_threads_per_process() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let local_ranks =
        std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|value| value.parse::<usize>().ok()).unwrap_or(1);
    (cores / local_ranks.max(1)).max(1)
}

// SAFETY: MPI is initialized with MPI_THREAD_SERIALIZED, which allows MPI calls from any thread as
// long as no two overlap. `MpiComm` is the only user of MPI in the process (a second `init` fails),
// and every MPI call it makes needs `&mut self` or happens in `drop`, so moving it to another thread
// cannot make calls overlap. The raw buffer pointers it holds are owned by it alone.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initializes MPI and returns this process's endpoint; every wait gives up after `timeout`.
    pub fn init(timeout: Duration) -> Result<MpiComm, MpiInitError> {
        let (universe, provided) =
            ::mpi::initialize_with_threading(Threading::Serialized).ok_or(MpiInitError::AlreadyInitialized)?;
        if !matches!(provided, Threading::Serialized | Threading::Multiple) {
            return Err(MpiInitError::ThreadLevel {
                required: format!("{:?}", Threading::Serialized),
                provided: format!("{provided:?}"),
            });
        }
        let world = universe.world();
        let rank = world.rank() as u32;
        let world_size = world.size() as u32;
        Ok(MpiComm {
            universe: Some(universe),
            world,
            rank,
            world_size,
            timeout,
            stats: CommStats::default(),
            group_sequences: std::collections::HashMap::new(),
            sends_to: vec![0; world_size as usize],
            recvs_from: vec![0; world_size as usize],
            pending_sends: Vec::new(),
            failed: None,
            peer_failures: Vec::new(),
        })
    }

    /// How long any wait may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long any later wait may take.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Waits (bounded by the timeout) until every buffered send has been delivered, so that the
    /// process may exit or finalize MPI.
    pub fn flush(&mut self) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
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

    /// Ends the whole job at once (`MPI_Abort`) with `exit_code`, after telling the peers why (as
    /// [`Communicator::abort`] does). Use it when this rank cannot go on: the other ranks may be
    /// blocked in MPI where no timeout of this process reaches them.
    pub fn abort_job(&mut self, reason: &str, exit_code: i32) -> ! {
        self.fail(reason);
        // Give the notices a moment to leave, so that peers can report the cause if they are polling.
        let deadline = Instant::now() + Duration::from_millis(200);
        while !self.pending_sends.is_empty() && Instant::now() < deadline {
            self.progress_sends();
            std::thread::yield_now();
        }
        self.world.abort(exit_code)
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

    /// Sends `message` to `peer` with `tag` without blocking; the send completes in later polls.
    fn post_send(&mut self, peer: u32, message: Vec<f32>, tag: i32) {
        let leaked: &'static mut [f32] = Box::leak(message.into_boxed_slice());
        let buffer: *mut [f32] = leaked;
        // SAFETY: the request only reads the buffer, which stays alive until the request completes
        // (`progress_sends` frees it then) or forever if it never does.
        let shared: &'static [f32] = unsafe { &*buffer };
        let request = self.world.process_at_rank(peer as i32).immediate_send_with_tag(StaticScope, shared, tag);
        self.pending_sends.push(PendingSend { request, buffer, peer });
    }

    /// Records this rank's failure and tells every other rank, once.
    fn fail(&mut self, reason: &str) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(reason.to_string());
        let mut cut = reason.len().min(MAX_REASON_BYTES);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let bytes = &reason.as_bytes()[..cut];
        // The notice travels as f32 words like every message: the byte length, then the bytes.
        let mut words = vec![f32::from_bits(bytes.len() as u32)];
        words.extend(bytes.chunks(4).map(|chunk| {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            f32::from_bits(u32::from_le_bytes(word))
        }));
        let rank = self.rank;
        for peer in (0..self.world_size).filter(|&peer| peer != rank) {
            self.post_send(peer, words.clone(), FAILURE_TAG);
        }
    }

    /// Takes every failure notice that has arrived.
    fn receive_failure_notices(&mut self) {
        while let Some((message, status)) = self.world.any_process().immediate_matched_probe_with_tag(FAILURE_TAG) {
            let (words, _) = ::mpi::point_to_point::MatchedReceiveVec::matched_receive_vec::<f32>((message, status));
            let length = words.first().map_or(0, |word| word.to_bits() as usize);
            let bytes: Vec<u8> = words.iter().skip(1).flat_map(|word| word.to_bits().to_le_bytes()).collect();
            let reason = String::from_utf8_lossy(&bytes[..length.min(bytes.len())]).into_owned();
            self.peer_failures.push((status.source_rank() as u32, reason));
        }
    }

    /// The earliest failure of `peer` or of a member of `op`'s group.
    fn failure_affecting(&self, op: &OpContext<'_>, peer: u32) -> Option<CommError> {
        self.peer_failures.iter().find(|(failed, _)| *failed == peer || op.group.ranks.contains(failed)).map(
            |(failed, reason)| CommError::PeerFailed {
                rank: self.rank,
                peer: *failed,
                reason: reason.clone(),
                op: op.describe(),
            },
        )
    }

    /// Polls `attempt` until it gives a value, a peer that `op` depends on fails, or the timeout
    /// passes; sends in flight progress meanwhile.
    fn poll<T>(
        &mut self,
        op: &OpContext<'_>,
        peer: u32,
        mut attempt: impl FnMut(&mut Self) -> Option<T>,
    ) -> Result<T, CommError> {
        let deadline = Instant::now() + self.timeout;
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

    /// Runs `body` unless this endpoint already failed; any error it returns makes the endpoint fail.
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

    /// Runs a collective of `kind` on `group` as this rank's next operation on that group.
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &Group,
        op_elements: usize,
        body: impl FnOnce(&mut Self, &OpContext<'_>) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let unsequenced = OpContext { kind, group, sequence: 0, op_elements };
        self.guarded(&unsequenced, |comm| {
            let counter = comm.group_sequences.entry(group.clone()).or_insert(0);
            let sequence = *counter;
            *counter += 1;
            body(comm, &OpContext { sequence, ..unsequenced })
        })
    }

    fn check_peer(&self, op: &OpContext<'_>, peer: u32) -> Result<(), CommError> {
        if peer < self.world_size && peer != self.rank {
            return Ok(());
        }
        Err(CommError::InvalidPeer { rank: self.rank, op: op.describe(), peer, world_size: self.world_size })
    }
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

fn push_u64(words: &mut Vec<f32>, value: u64) {
    words.push(f32::from_bits(value as u32));
    words.push(f32::from_bits((value >> 32) as u32));
}

fn read_u64(words: &[f32], at: usize) -> u64 {
    u64::from(words[at].to_bits()) | (u64::from(words[at + 1].to_bits()) << 32)
}

/// A data message: the tag's words, then the payload.
fn encode_message(tag: &MessageTag, payload: &[f32]) -> Vec<f32> {
    let mut words = Vec::with_capacity(FIXED_HEADER_WORDS + tag.group.len() + payload.len());
    words.push(f32::from_bits(MAGIC));
    let kind = CollectiveKind::ALL.iter().position(|&kind| kind == tag.kind).unwrap_or(0);
    words.push(f32::from_bits(kind as u32));
    push_u64(&mut words, tag.sequence);
    push_u64(&mut words, tag.op_elements as u64);
    push_u64(&mut words, tag.message_elements as u64);
    words.push(f32::from_bits(tag.group.len() as u32));
    words.extend(tag.group.ranks.iter().map(|&rank| f32::from_bits(rank)));
    words.extend_from_slice(payload);
    words
}

/// The tag and the offset of the payload of a data message; `None` if it is not one of pleat's.
fn decode_header(words: &[f32]) -> Option<(MessageTag, usize)> {
    if words.len() < FIXED_HEADER_WORDS || words[0].to_bits() != MAGIC {
        return None;
    }
    let kind = *CollectiveKind::ALL.get(words[1].to_bits() as usize)?;
    let group_len = words[8].to_bits() as usize;
    let payload_start = FIXED_HEADER_WORDS.checked_add(group_len)?;
    let ranks = words.get(FIXED_HEADER_WORDS..payload_start)?.iter().map(|word| word.to_bits()).collect::<Vec<_>>();
    let tag = MessageTag {
        kind,
        group: Group::new(ranks),
        sequence: read_u64(words, 2),
        op_elements: read_u64(words, 4) as usize,
        message_elements: read_u64(words, 6) as usize,
    };
    Some((tag, payload_start))
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
        let (message, status): (::mpi::point_to_point::Message, Status) =
            self.poll(op, peer, |comm| comm.world.process_at_rank(peer as i32).immediate_matched_probe_with_tag(tag))?;
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

impl Communicator for MpiComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllReduce, group, buf.len(), |comm, op| ring::all_reduce(comm, op, buf))
    }

    fn reduce_scatter(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::ReduceScatter, group, input.len(), |comm, op| {
            ring::reduce_scatter(comm, op, input, output)
        })
    }

    fn all_gather(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllGather, group, output.len(), |comm, op| {
            ring::all_gather(comm, op, input, output)
        })
    }

    fn broadcast(&mut self, group: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::Broadcast, group, buf.len(), |comm, op| {
            ring::broadcast(comm, op, root, buf, ring::BROADCAST_SEGMENT_ELEMENTS)
        })
    }

    fn all_to_all(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllToAll, group, input.len(), |comm, op| {
            ring::all_to_all(comm, op, input, output)
        })
    }

    fn all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[f32], &[usize]),
        receive: (&mut [f32], &[usize]),
    ) -> Result<(), CommError> {
        // The sizes differ between members; the operation's tag names none.
        self.collective(CollectiveKind::AllToAll, group, 0, |comm, op| ring::all_to_all_v(comm, op, send, receive))
    }

    fn send(&mut self, peer: u32, data: &[f32]) -> Result<(), CommError> {
        let pair = Group::new(vec![self.rank, peer]);
        let sequence = self.sends_to.get(peer as usize).copied().unwrap_or(0);
        let op = OpContext { kind: CollectiveKind::SendRecv, group: &pair, sequence, op_elements: data.len() };
        self.guarded(&op, |comm| {
            comm.check_peer(&op, peer)?;
            comm.sends_to[peer as usize] += 1;
            comm.send_message(&op, peer, data)
        })
    }

    fn recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        let pair = Group::new(vec![peer, self.rank]);
        let sequence = self.recvs_from.get(peer as usize).copied().unwrap_or(0);
        let op = OpContext { kind: CollectiveKind::SendRecv, group: &pair, sequence, op_elements: buf.len() };
        self.guarded(&op, |comm| {
            comm.check_peer(&op, peer)?;
            comm.recvs_from[peer as usize] += 1;
            comm.recv_message(&op, peer, buf)
        })
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.collective(CollectiveKind::Barrier, group, 0, ring::barrier)
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

    /// A scheduled program's transfers then run on the rank's communication thread
    /// (`crate::stream`), which makes every MPI call of the run while the rank's own thread runs the
    /// kernels: that thread is the progress thread Open MPI needs for a transfer to advance beside
    /// compute (it does not progress messages in the background).
    fn as_sendable(&mut self) -> Option<&mut (dyn Communicator + Send)> {
        Some(self)
    }
}

/// A rank that panics tells its peers first, as one that fails does. Then the buffered sends are
/// completed (bounded by the timeout) and MPI is finalized. Sends that never
/// complete are left to the process's end rather than freed under MPI.
impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.fail(&format!("rank {} panicked", self.rank));
        }
        if self.flush().is_err() {
            for pending in self.pending_sends.drain(..) {
                std::mem::forget(pending.request);
            }
        }
        drop(self.universe.take());
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
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
