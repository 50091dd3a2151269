//! The communication stream: a rank's transfers detached from its buffers, and the thread that
//! runs them beside the rank's kernels.
//!
//! A program's transfer instruction packs what it sends into a [`Transfer`] (its own copy of the
//! operands, so the kernels after it may run while it is in flight) and hands it to the stream;
//! the matching `Wait` takes the result back and unpacks it into the program's buffers. The stream
//! runs transfers one after another in the order they were started, which is the order every
//! rank's program issues them, so the collectives of a group still meet in the same order on
//! every member. With the threads communicator's link emulation, a receive on the stream waits
//! for the emulated wire while the rank's kernels keep running: that is the overlap the
//! scheduler (`pleat_backend::overlap`) plans.
//!
//! [`CommStreams`] are a rank's streams: the main one, and a second for the weight prefetches
//! (`TransferStream::Prefetch`) when the communicator gives one (`Communicator::second_stream`:
//! the threads fabric does, and MPI does at `MPI_THREAD_MULTIPLE`, each stream's thread then
//! making its own MPI calls and progressing its own messages); without it, the main stream runs
//! the prefetches too, in the order they were started.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Instant;

use pleat_backend::TransferStream;

use crate::comm::{CommError, Communicator, Group};
use crate::expert_dispatch::{expert_dispatch, DispatchOperands};
use crate::kernels::{ExpertWeights, MoeGradOperand, MoeShape};

/// A transfer's data, detached from the program's buffers.
pub(crate) enum Transfer {
    /// Sum over the group.
    AllReduce { group: Group, data: Vec<f32> },
    /// Sum over the group, keeping this member's chunk of `output_len` elements.
    ReduceScatter { group: Group, chunks: Vec<f32>, output_len: usize },
    /// Every member's input, member by member.
    AllGather { group: Group, input: Vec<f32> },
    /// Chunk `j` to member `j`, chunk `i` of each member back.
    AllToAll { group: Group, chunks: Vec<f32> },
    /// The root's packed buffers to every member (zeros of the right size elsewhere).
    Broadcast { group: Group, root: usize, packed: Vec<f32> },
    /// One packed message to `peer`.
    Send { peer: u32, packed: Vec<f32> },
    /// One packed message of `len` elements from `peer`.
    Recv { peer: u32, len: usize },
    /// One packed message of `len` elements from `from`, passed on to `to`.
    Relay { from: u32, to: u32, len: usize },
    /// The mixture of experts over `group` (`crate::expert_dispatch`): its operands `x`, router,
    /// gate, up, down (and dy), and the gradients asked for (none: the forward).
    ExpertDispatch { group: Group, shape: MoeShape, operands: Vec<Vec<f32>>, wrts: Vec<MoeGradOperand> },
}

impl Transfer {
    /// Runs the transfer on `comm`; returns what it delivers (nothing for a send).
    pub(crate) fn run(self, comm: &mut dyn Communicator) -> Result<Vec<f32>, CommError> {
        match self {
            Transfer::AllReduce { group, mut data } => {
                comm.all_reduce(&group, &mut data)?;
                Ok(data)
            }
            Transfer::ReduceScatter { group, chunks, output_len } => {
                let mut data = vec![0.0; output_len];
                comm.reduce_scatter(&group, &chunks, &mut data)?;
                Ok(data)
            }
            Transfer::AllGather { group, input } => {
                let mut chunks = vec![0.0; input.len() * group.len()];
                comm.all_gather(&group, &input, &mut chunks)?;
                Ok(chunks)
            }
            Transfer::AllToAll { group, chunks } => {
                let mut received = vec![0.0; chunks.len()];
                comm.all_to_all(&group, &chunks, &mut received)?;
                Ok(received)
            }
            Transfer::Broadcast { group, root, mut packed } => {
                comm.broadcast(&group, root, &mut packed)?;
                Ok(packed)
            }
            Transfer::Send { peer, packed } => {
                comm.send(peer, &packed)?;
                Ok(Vec::new())
            }
            Transfer::Recv { peer, len } => {
                let mut packed = vec![0.0; len];
                comm.recv(peer, &mut packed)?;
                Ok(packed)
            }
            Transfer::Relay { from, to, len } => {
                let mut packed = vec![0.0; len];
                comm.recv(from, &mut packed)?;
                comm.send(to, &packed)?;
                Ok(packed)
            }
            Transfer::ExpertDispatch { group, shape, operands, wrts } => {
                let [x, router, gate, up, down] = [0, 1, 2, 3, 4].map(|index| operands[index].as_slice());
                let dispatch = DispatchOperands {
                    x,
                    router,
                    weights: ExpertWeights { gate, up, down },
                    dy: operands.get(5).map(Vec::as_slice),
                };
                let results = expert_dispatch(comm, &group, &shape, &dispatch, &wrts)?;
                Ok(results.concat())
            }
        }
    }
}

/// A transfer the stream has run.
pub(crate) struct Done {
    /// The instruction that started it.
    pub instr: usize,
    /// What it delivered, or why it failed.
    pub result: Result<Vec<f32>, CommError>,
    /// When the stream began and ended it, in nanoseconds since the run's epoch.
    pub span_ns: (u64, u64),
}

/// The rank's side of its communication stream.
pub(crate) struct CommStream {
    jobs: Sender<(usize, Transfer)>,
    done: Receiver<Done>,
    /// Transfers that ended before their wait asked for them.
    ended: HashMap<usize, Done>,
}

impl CommStream {
    /// A stream and the loop its thread runs: `run_stream(comm, epoch)` runs every transfer
    /// started, in order, until the stream is dropped.
    pub(crate) fn new() -> (CommStream, impl FnOnce(&mut dyn Communicator, Instant)) {
        let (jobs, job_queue) = channel::<(usize, Transfer)>();
        let (ended, done) = channel::<Done>();
        let run_stream = move |comm: &mut dyn Communicator, epoch: Instant| {
            // A relay's forward that failed: the stream's next transfer reports it, not running.
            let mut forward_failed: Option<CommError> = None;
            for (instr, transfer) in job_queue {
                let begin = crate::executor::nanos_since(epoch);
                let mut forward = None;
                let result = match (forward_failed.take(), transfer) {
                    (Some(error), _) => Err(error),
                    // The wait ends once the message is in; the forward follows on this stream.
                    (None, Transfer::Relay { from, to, len }) => {
                        let mut packed = vec![0.0; len];
                        let received = comm.recv(from, &mut packed);
                        if received.is_ok() {
                            forward = Some((to, packed.clone()));
                        }
                        received.map(|()| packed)
                    }
                    (None, transfer) => transfer.run(comm),
                };
                let span_ns = (begin, crate::executor::nanos_since(epoch));
                if ended.send(Done { instr, result, span_ns }).is_err() {
                    break;
                }
                if let Some((to, packed)) = forward {
                    forward_failed = comm.send(to, &packed).err();
                }
            }
        };
        (CommStream { jobs, done, ended: HashMap::new() }, run_stream)
    }

    /// Starts `transfer`, the transfer of instruction `instr`.
    pub(crate) fn start(&mut self, instr: usize, transfer: Transfer) {
        // The stream's thread only stops when this side is dropped; a send cannot fail before.
        let _ = self.jobs.send((instr, transfer));
    }

    /// Blocks until the transfer of instruction `instr` has ended; `None` if the stream's thread
    /// is gone (it panicked).
    pub(crate) fn finish(&mut self, instr: usize) -> Option<Done> {
        loop {
            if let Some(done) = self.ended.remove(&instr) {
                return Some(done);
            }
            let done = self.done.recv().ok()?;
            self.ended.insert(done.instr, done);
        }
    }
}

/// A rank's communication streams.
pub(crate) struct CommStreams {
    main: CommStream,
    /// The prefetch stream; `None`: the main stream runs its transfers.
    prefetch: Option<CommStream>,
    /// The transfers started and not yet finished, and whether each went to the prefetch stream.
    started: HashMap<usize, bool>,
}

impl CommStreams {
    /// The main stream, and the prefetch stream if there is one.
    pub(crate) fn new(main: CommStream, prefetch: Option<CommStream>) -> CommStreams {
        CommStreams { main, prefetch, started: HashMap::new() }
    }

    /// Starts `transfer`, the transfer of instruction `instr`, on `stream` (the main one if the
    /// rank has no other).
    pub(crate) fn start(&mut self, instr: usize, stream: TransferStream, transfer: Transfer) {
        let on_prefetch = stream == TransferStream::Prefetch && self.prefetch.is_some();
        self.started.insert(instr, on_prefetch);
        match &mut self.prefetch {
            Some(prefetch) if on_prefetch => prefetch.start(instr, transfer),
            _ => self.main.start(instr, transfer),
        }
    }

    /// Blocks until the transfer of instruction `instr` has ended, on the stream it was started
    /// on; `None` if it was never started or that stream's thread is gone.
    pub(crate) fn finish(&mut self, instr: usize) -> Option<Done> {
        match (self.started.remove(&instr)?, &mut self.prefetch) {
            (true, Some(prefetch)) => prefetch.finish(instr),
            _ => self.main.finish(instr),
        }
    }
}
