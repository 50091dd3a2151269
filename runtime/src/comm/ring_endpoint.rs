//! What the threads and MPI communicators share: each stream of a rank runs every collective as a
//! ring algorithm over its own point-to-point messages, numbers each operation (a collective by
//! its group, a send or receive by its peer) so that the peers' messages match, and fails for good
//! at its first error. The communicators give the guard and the counters; the operations are here
//! once, so that both number and check them alike.

use super::ring::{self, OpContext, Transport};
use super::{CollectiveKind, CommError, Group};

/// One stream's point-to-point sequence numbers: the next message to or from each rank.
pub(crate) struct PointToPoint {
    /// Messages sent to each rank so far.
    pub(crate) sends_to: Vec<u64>,
    /// Messages received from each rank so far.
    pub(crate) recvs_from: Vec<u64>,
}

impl PointToPoint {
    /// No message yet, in a world of `world_size` ranks.
    pub(crate) fn new(world_size: usize) -> PointToPoint {
        PointToPoint { sends_to: vec![0; world_size], recvs_from: vec![0; world_size] }
    }
}

/// One stream of a rank whose collectives are ring algorithms over its [`Transport`].
pub(crate) trait RingEndpoint: Transport + Sized {
    /// Runs `body` unless this endpoint already failed; any error it returns makes it fail.
    fn guarded(
        &mut self,
        op: &OpContext<'_>,
        body: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError>;

    /// Counts one more operation of this stream on `group` and returns its sequence number.
    fn enter(&mut self, group: &Group) -> u64;

    /// Runs `with` on this stream's point-to-point sequence numbers.
    fn point_to_point<T>(&self, with: impl FnOnce(&mut PointToPoint) -> T) -> T;

    /// Runs a collective of `kind` on `group` as this stream's next operation on that group.
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &Group,
        op_elements: usize,
        body: impl FnOnce(&mut Self, &OpContext<'_>) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let unsequenced = OpContext { kind, group, sequence: 0, op_elements };
        self.guarded(&unsequenced, |endpoint| {
            let op = OpContext { sequence: endpoint.enter(group), ..unsequenced };
            body(endpoint, &op)
        })
    }

    /// An error unless `peer` is another rank of the world.
    fn check_peer(&self, op: &OpContext<'_>, peer: u32) -> Result<(), CommError> {
        let (rank, world_size) = (self.own_rank(), self.n_ranks());
        if peer < world_size && peer != rank {
            return Ok(());
        }
        Err(CommError::InvalidPeer { rank, op: op.describe(), peer, world_size })
    }

    /// [`super::Communicator::all_reduce`].
    fn ring_all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllReduce, group, buf.len(), |endpoint, op| ring::all_reduce(endpoint, op, buf))
    }

    /// [`super::Communicator::reduce_scatter`].
    fn ring_reduce_scatter(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::ReduceScatter, group, input.len(), |endpoint, op| {
            ring::reduce_scatter(endpoint, op, input, output)
        })
    }

    /// [`super::Communicator::all_gather`].
    fn ring_all_gather(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllGather, group, output.len(), |endpoint, op| {
            ring::all_gather(endpoint, op, input, output)
        })
    }

    /// [`super::Communicator::broadcast`].
    fn ring_broadcast(&mut self, group: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::Broadcast, group, buf.len(), |endpoint, op| {
            ring::broadcast(endpoint, op, root, buf, ring::BROADCAST_SEGMENT_ELEMENTS)
        })
    }

    /// [`super::Communicator::all_to_all`].
    fn ring_all_to_all(&mut self, group: &Group, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.collective(CollectiveKind::AllToAll, group, input.len(), |endpoint, op| {
            ring::all_to_all(endpoint, op, input, output)
        })
    }

    /// [`super::Communicator::all_to_all_v`].
    fn ring_all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[f32], &[usize]),
        receive: (&mut [f32], &[usize]),
    ) -> Result<(), CommError> {
        // The sizes differ between members; the operation's tag names none.
        self.collective(CollectiveKind::AllToAll, group, 0, |endpoint, op| {
            ring::all_to_all_v(endpoint, op, send, receive)
        })
    }

    /// [`super::Communicator::barrier`].
    fn ring_barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.collective(CollectiveKind::Barrier, group, 0, ring::barrier)
    }

    /// [`super::Communicator::send`]: this stream's next message to `peer`.
    fn sequenced_send(&mut self, peer: u32, data: &[f32]) -> Result<(), CommError> {
        let pair = Group::new(vec![self.own_rank(), peer]);
        let sequence = self.point_to_point(|counts| counts.sends_to.get(peer as usize).copied().unwrap_or(0));
        let op = OpContext { kind: CollectiveKind::SendRecv, group: &pair, sequence, op_elements: data.len() };
        self.guarded(&op, |endpoint| {
            endpoint.check_peer(&op, peer)?;
            endpoint.point_to_point(|counts| counts.sends_to[peer as usize] += 1);
            endpoint.send_message(&op, peer, data)
        })
    }

    /// [`super::Communicator::recv`]: this stream's next message from `peer`.
    fn sequenced_recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        let pair = Group::new(vec![peer, self.own_rank()]);
        let sequence = self.point_to_point(|counts| counts.recvs_from.get(peer as usize).copied().unwrap_or(0));
        let op = OpContext { kind: CollectiveKind::SendRecv, group: &pair, sequence, op_elements: buf.len() };
        self.guarded(&op, |endpoint| {
            endpoint.check_peer(&op, peer)?;
            endpoint.point_to_point(|counts| counts.recvs_from[peer as usize] += 1);
            endpoint.recv_message(&op, peer, buf)
        })
    }
}
