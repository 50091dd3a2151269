//! The collective algorithms, written once over a point-to-point [`Transport`].
//!
//! They are the bandwidth-optimal ones, so each rank sends exactly the textbook volume (n elements in
//! the operation, D members, i this rank's index, chunk sizes from [`chunk_range`]):
//! - all_reduce: ring reduce-scatter then ring all-gather; rank i sends 2n - |chunk i| - |chunk i+1|,
//!   which sums to 2(D-1)·n over the group (2(D-1)/D·n a rank when D divides n);
//! - reduce_scatter and all_gather: ring, (D-1)·n/D a rank (n = the full, gathered length);
//! - broadcast: a pipelined chain from the root; every member but the last forwards the whole buffer
//!   once, (D-1)·n over the group;
//! - all_to_all: direct pairwise exchange, (D-1)·n/D a rank;
//! - barrier: dissemination with empty messages, no payload.
//!
//! Each chunk of an all_reduce is summed at exactly one rank and then copied to the others, so the
//! result is bitwise identical on every member. A group of one sends nothing. The functions check the
//! group and the buffer lengths and return errors, never panic.
//!
//! A transport only moves messages; it may buffer sends (the threads fabric does) or not (MPI), as long
//! as [`Transport::exchange`] does not deadlock when two ranks exchange with each other at once.

use std::ops::Range;

use super::{CollectiveKind, CommError, Group, MessageTag};

/// Elements a broadcast forwards in one message, so that a chain pipelines long buffers.
pub const BROADCAST_SEGMENT_ELEMENTS: usize = 1 << 16;

/// The operation a message belongs to, as the caller of a collective started it.
#[derive(Clone, Copy, Debug)]
pub struct OpContext<'a> {
    /// The kind of operation.
    pub kind: CollectiveKind,
    /// The group it runs over; for point-to-point, `[sender, receiver]`.
    pub group: &'a Group,
    /// The per-group sequence number of this operation on the calling rank (see [`MessageTag`]).
    pub sequence: u64,
    /// The operation's size in elements, as [`MessageTag::op_elements`] defines it.
    pub op_elements: usize,
}

impl OpContext<'_> {
    /// The tag of a message of `message_elements` elements sent as part of this operation.
    pub fn tag(&self, message_elements: usize) -> MessageTag {
        MessageTag {
            kind: self.kind,
            group: self.group.clone(),
            sequence: self.sequence,
            op_elements: self.op_elements,
            message_elements,
        }
    }

    /// Whether `tag` is the tag of a message of `message_elements` elements of this operation.
    pub fn matches(&self, tag: &MessageTag, message_elements: usize) -> bool {
        tag.kind == self.kind
            && tag.sequence == self.sequence
            && tag.op_elements == self.op_elements
            && tag.message_elements == message_elements
            && tag.group == *self.group
    }

    /// The operation as error messages name it: `all_reduce over [0,1,2,3]`, or for point-to-point
    /// `send/recv from rank 0 to rank 1`.
    pub fn describe(&self) -> String {
        match (self.kind, self.group.ranks.as_slice()) {
            (CollectiveKind::SendRecv, [sender, receiver]) => {
                format!("send/recv from rank {sender} to rank {receiver}")
            }
            (kind, _) => format!("{kind} over {}", self.group),
        }
    }
}

/// Point-to-point messaging between the ranks of one world: what the algorithms need.
pub trait Transport {
    /// This rank's global index (named apart from [`super::Communicator::rank`] so that a type can
    /// implement both without ambiguity).
    fn own_rank(&self) -> u32;

    /// The number of ranks in the world.
    fn n_ranks(&self) -> u32;

    /// Sends `data` to global rank `peer` as a message of `op`, tagged `op.tag(data.len())`, and counts
    /// its bytes under `op.kind`.
    fn send_message(&mut self, op: &OpContext<'_>, peer: u32, data: &[f32]) -> Result<(), CommError>;

    /// Receives the next message from global rank `peer` into `buf`. It must be a message of `op` of
    /// `buf.len()` elements, else [`CommError::Mismatch`].
    fn recv_message(&mut self, op: &OpContext<'_>, peer: u32, buf: &mut [f32]) -> Result<(), CommError>;

    /// Sends `send_data` to `send_peer` and receives from `recv_peer` into `recv_buf`, as one step in
    /// which the neighbours do the same. The default sends first, which is right for buffered sends.
    fn exchange(
        &mut self,
        op: &OpContext<'_>,
        send_peer: u32,
        send_data: &[f32],
        recv_peer: u32,
        recv_buf: &mut [f32],
    ) -> Result<(), CommError> {
        self.send_message(op, send_peer, send_data)?;
        self.recv_message(op, recv_peer, recv_buf)
    }
}

/// The elements of chunk `index` when `len` elements split into `parts` chunks (`parts` > 0) as evenly
/// as possible: the first `len % parts` chunks hold one element more.
pub fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    let base = len / parts;
    let remainder = len % parts;
    let start = index * base + index.min(remainder);
    let size = base + usize::from(index < remainder);
    start..start + size
}

/// Ring all-reduce (sum) of `buf` in place.
pub fn all_reduce<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    if op.group.len() == 1 {
        return Ok(());
    }
    reduce_scatter_in_place(transport, op, my_index, buf)?;
    all_gather_in_place(transport, op, my_index, buf)
}

/// Ring reduce-scatter: `output` = the sum over members of their chunk `my_index` of `input`.
pub fn reduce_scatter<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    input: &[f32],
    output: &mut [f32],
) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    let group_size = op.group.len();
    check_divisible(transport, op, "input", input.len())?;
    check_length(transport, op, "output", input.len() / group_size, output.len())?;
    if group_size == 1 {
        output.copy_from_slice(input);
        return Ok(());
    }
    // The ring of `reduce_scatter_in_place`, with the running sum in a chunk of its own rather than
    // in a copy of the whole input (a fresh buffer of the input's size costs its page faults, more
    // than the ring's own copies): what a member forwards at step s is the sum it made at step
    // s-1, and the last sum is its own chunk. Each sum is the received block plus this member's
    // own, as in place, so the results are the same bit for bit.
    let right = op.group.ranks[(my_index + 1) % group_size];
    let left = op.group.ranks[(my_index + group_size - 1) % group_size];
    let largest = chunk_range(input.len(), group_size, 0).len();
    let (mut incoming, mut sum) = (vec![0.0; largest], Vec::with_capacity(largest));
    for step in 0..group_size - 1 {
        let recv_range = chunk_range(input.len(), group_size, (my_index + 2 * group_size - step - 2) % group_size);
        let incoming = &mut incoming[..recv_range.len()];
        if step == 0 {
            let send_range = chunk_range(input.len(), group_size, (my_index + 2 * group_size - 1) % group_size);
            transport.exchange(op, right, &input[send_range], left, incoming)?;
        } else {
            transport.exchange(op, right, &sum, left, incoming)?;
        }
        sum.clear();
        sum.extend(input[recv_range].iter().zip(incoming.iter()).map(|(own, received)| own + received));
    }
    output.copy_from_slice(&sum);
    Ok(())
}

/// Ring all-gather: `output` = every member's `input`, concatenated in group order.
pub fn all_gather<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    input: &[f32],
    output: &mut [f32],
) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    let group_size = op.group.len();
    check_length(transport, op, "output", input.len() * group_size, output.len())?;
    let own = chunk_range(output.len(), group_size, my_index);
    output[own].copy_from_slice(input);
    if group_size == 1 {
        return Ok(());
    }
    all_gather_in_place(transport, op, my_index, output)
}

/// Chain broadcast from member `root`, pipelined in messages of `segment_elements` elements: member
/// k after the root (in group order, wrapping) receives from member k-1 and forwards to member k+1.
pub fn broadcast<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    root: usize,
    buf: &mut [f32],
    segment_elements: usize,
) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    let group_size = op.group.len();
    if root >= group_size {
        return Err(CommError::RootOutOfRange { rank: transport.own_rank(), op: op.describe(), root, group_size });
    }
    if group_size == 1 {
        return Ok(());
    }
    let position_in_chain = (my_index + group_size - root) % group_size;
    let previous = op.group.ranks[(my_index + group_size - 1) % group_size];
    let next = op.group.ranks[(my_index + 1) % group_size];
    let segment_elements = segment_elements.max(1);
    let mut start = 0;
    // An empty buffer still passes one empty message down the chain, so that a member that called a
    // different operation is caught rather than left waiting.
    loop {
        let end = (start + segment_elements).min(buf.len());
        if position_in_chain > 0 {
            transport.recv_message(op, previous, &mut buf[start..end])?;
        }
        if position_in_chain < group_size - 1 {
            transport.send_message(op, next, &buf[start..end])?;
        }
        start = end;
        if start >= buf.len() {
            return Ok(());
        }
    }
}

/// Direct all-to-all: chunk j of `input` goes to member j, chunk i of `output` comes from member i.
pub fn all_to_all<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    input: &[f32],
    output: &mut [f32],
) -> Result<(), CommError> {
    member_index(transport, op)?;
    check_divisible(transport, op, "input", input.len())?;
    check_length(transport, op, "output", input.len(), output.len())?;
    let counts = vec![input.len() / op.group.len(); op.group.len()];
    all_to_all_v(transport, op, (input, &counts), (output, &counts))
}

/// All-to-all with per-member sizes: `input` holds the chunks for members 0, 1, .. back to back,
/// `send_counts[j]` elements for member j; `output` receives `recv_counts[i]` elements from member i,
/// back to back. The counts must agree pairwise (member i's `send_counts[j]` is member j's
/// `recv_counts[i]`), which a message of the wrong size reports as a mismatch. At step k every member
/// sends to the member k after it and receives from the one k before it, so each pair meets in the
/// same step on both sides.
pub fn all_to_all_v<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    (input, send_counts): (&[f32], &[usize]),
    (output, recv_counts): (&mut [f32], &[usize]),
) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    let group_size = op.group.len();
    check_length(transport, op, "send counts", group_size, send_counts.len())?;
    check_length(transport, op, "receive counts", group_size, recv_counts.len())?;
    check_length(transport, op, "input", send_counts.iter().sum(), input.len())?;
    check_length(transport, op, "output", recv_counts.iter().sum(), output.len())?;
    let offsets = |counts: &[usize]| -> Vec<usize> {
        counts.iter().scan(0, |offset, &count| Some(std::mem::replace(offset, *offset + count))).collect()
    };
    let (send_at, recv_at) = (offsets(send_counts), offsets(recv_counts));
    let sent = |member: usize| send_at[member]..send_at[member] + send_counts[member];
    let received = |member: usize| recv_at[member]..recv_at[member] + recv_counts[member];
    check_length(transport, op, "own chunk", send_counts[my_index], recv_counts[my_index])?;
    output[received(my_index)].copy_from_slice(&input[sent(my_index)]);
    for distance in 1..group_size {
        let to = (my_index + distance) % group_size;
        let from = (my_index + group_size - distance) % group_size;
        transport.exchange(
            op,
            op.group.ranks[to],
            &input[sent(to)],
            op.group.ranks[from],
            &mut output[received(from)],
        )?;
    }
    Ok(())
}

/// Dissemination barrier: in round k each member signals the member 2^k after it and waits for the
/// one 2^k before it; after ceil(log2 D) rounds every member has (transitively) heard from all.
pub fn barrier<T: Transport + ?Sized>(transport: &mut T, op: &OpContext<'_>) -> Result<(), CommError> {
    let my_index = member_index(transport, op)?;
    let group_size = op.group.len();
    let mut distance = 1;
    while distance < group_size {
        let to = op.group.ranks[(my_index + distance) % group_size];
        let from = op.group.ranks[(my_index + group_size - distance) % group_size];
        transport.exchange(op, to, &[], from, &mut [])?;
        distance *= 2;
    }
    Ok(())
}

/// Ring reduce-scatter over the whole of `buf`: afterwards chunk `my_index` holds the group's sum.
///
/// At step s member i sends chunk i-s-1 and adds the incoming chunk i-s-2 into its own, so the chunk
/// that ends complete at member i started at member i+1 and went once around the ring.
fn reduce_scatter_in_place<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    my_index: usize,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let group_size = op.group.len();
    let right = op.group.ranks[(my_index + 1) % group_size];
    let left = op.group.ranks[(my_index + group_size - 1) % group_size];
    let mut incoming = vec![0.0; chunk_range(buf.len(), group_size, 0).len()];
    for step in 0..group_size - 1 {
        let send_chunk = (my_index + 2 * group_size - step - 1) % group_size;
        let recv_chunk = (my_index + 2 * group_size - step - 2) % group_size;
        let recv_range = chunk_range(buf.len(), group_size, recv_chunk);
        let incoming = &mut incoming[..recv_range.len()];
        transport.exchange(op, right, &buf[chunk_range(buf.len(), group_size, send_chunk)], left, incoming)?;
        for (accumulated, received) in buf[recv_range].iter_mut().zip(incoming.iter()) {
            *accumulated += *received;
        }
    }
    Ok(())
}

/// Ring all-gather over the whole of `buf`, where chunk `my_index` is this member's: at step s member
/// i forwards chunk i-s and receives chunk i-s-1.
fn all_gather_in_place<T: Transport + ?Sized>(
    transport: &mut T,
    op: &OpContext<'_>,
    my_index: usize,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let group_size = op.group.len();
    let right = op.group.ranks[(my_index + 1) % group_size];
    let left = op.group.ranks[(my_index + group_size - 1) % group_size];
    for step in 0..group_size - 1 {
        let send_chunk = (my_index + group_size - step) % group_size;
        let recv_chunk = (my_index + 2 * group_size - step - 1) % group_size;
        let send_range = chunk_range(buf.len(), group_size, send_chunk);
        let recv_range = chunk_range(buf.len(), group_size, recv_chunk);
        let (outgoing, incoming) = split_disjoint(buf, send_range, recv_range);
        transport.exchange(op, right, outgoing, left, incoming)?;
    }
    Ok(())
}

/// Borrows two disjoint ranges of `buf`, one to read and one to write.
fn split_disjoint(buf: &mut [f32], read: Range<usize>, write: Range<usize>) -> (&[f32], &mut [f32]) {
    if read.end <= write.start {
        let (head, tail) = buf.split_at_mut(write.start);
        (&head[read], &mut tail[..write.len()])
    } else {
        let (head, tail) = buf.split_at_mut(read.start);
        (&tail[..read.len()], &mut head[write])
    }
}

fn member_index<T: Transport + ?Sized>(transport: &T, op: &OpContext<'_>) -> Result<usize, CommError> {
    op.group.member_index(transport.own_rank(), transport.n_ranks(), &op.describe())
}

fn check_divisible<T: Transport + ?Sized>(
    transport: &T,
    op: &OpContext<'_>,
    buffer: &'static str,
    len: usize,
) -> Result<(), CommError> {
    let remainder = len % op.group.len();
    if remainder == 0 {
        return Ok(());
    }
    Err(CommError::NotDivisible {
        rank: transport.own_rank(),
        op: op.describe(),
        buffer,
        len,
        group_size: op.group.len(),
    })
}

fn check_length<T: Transport + ?Sized>(
    transport: &T,
    op: &OpContext<'_>,
    buffer: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), CommError> {
    if expected == got {
        return Ok(());
    }
    Err(CommError::BufferLength { rank: transport.own_rank(), op: op.describe(), buffer, expected, got })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Communicator, ThreadFabric};
    use std::time::Duration;

    #[test]
    fn chunks_tile_the_buffer_and_differ_by_at_most_one() {
        for len in 0..20 {
            for parts in 1..9 {
                let ranges: Vec<_> = (0..parts).map(|i| chunk_range(len, parts, i)).collect();
                // Contiguous, in order, covering 0..len.
                let mut next_start = 0;
                for range in &ranges {
                    assert_eq!(range.start, next_start, "len {len} parts {parts}");
                    next_start = range.end;
                }
                assert_eq!(next_start, len, "len {len} parts {parts}");
                let sizes: Vec<_> = ranges.iter().map(|range| range.len()).collect();
                let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(max - min <= 1, "len {len} parts {parts}: sizes {sizes:?}");
            }
        }
    }

    /// A broadcast longer than its segment goes down the chain in several messages and still arrives
    /// whole, with the same bytes as one message.
    #[test]
    fn broadcast_pipelines_in_segments() {
        let (group_size, len, segment, root) = (4u32, 11usize, 3usize, 2usize);
        let group = Group::new(vec![3, 1, 0, 2]);
        let comms = ThreadFabric::new(group_size, Duration::from_secs(30));
        let expected: Vec<f32> = (0..len).map(|j| j as f32 * 1.5 - 4.0).collect();
        let results: Vec<(u32, Vec<f32>, u64)> = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    let (group, expected) = (&group, &expected);
                    scope.spawn(move || {
                        let rank = comm.rank();
                        let mut buf =
                            if group.index_of(rank) == Some(root) { expected.clone() } else { vec![0.0; len] };
                        let op = OpContext { kind: CollectiveKind::Broadcast, group, sequence: 0, op_elements: len };
                        broadcast(&mut comm, &op, root, &mut buf, segment).unwrap();
                        (rank, buf, comm.stats().bytes(CollectiveKind::Broadcast))
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap()).collect()
        });
        for (rank, buf, bytes) in results {
            assert_eq!(buf, expected, "rank {rank}");
            let position = (group.index_of(rank).unwrap() + 4 - root) % 4;
            let forwards = if position < 3 { len as u64 * 4 } else { 0 };
            assert_eq!(bytes, forwards, "rank {rank} at chain position {position}");
        }
    }
}
