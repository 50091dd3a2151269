//! Alpha-beta costs of collectives: bytes a rank sends and seconds they take.
//!
//! A message of `n` bytes over a link costs `α + n/β`. For a group of `D` ranks (Thakur,
//! Rabenseifner and Gropp 2005; the NCCL bus-bandwidth conventions of nccl-tests):
//! - ring all-reduce of an `n`-byte buffer: `2(D-1)/D · n/β + 2(D-1)·α`;
//! - tree all-reduce (NCCL's double binary tree): `2·n/β + 2·log2(D)·α`;
//! - reduce-scatter (`n` = the whole input) and all-gather (`n` = the whole output):
//!   `(D-1)/D · n/β + (D-1)·α`;
//! - broadcast of `n` bytes, pipelined along a chain: `n/β + (D-1)·α`;
//! - all-to-all of an `n`-byte buffer a rank, as a pairwise exchange (`D-1` steps, each sending
//!   the `n/D` block of one peer): `(D-1)/D · n/β + (D-1)·α`; with variable counts (ep's token
//!   dispatch) `n` is the mean buffer, which balanced routing makes every rank's;
//! - send/recv of `n` bytes: `n/β + α`.
//!
//! When a group spans nodes (`AxisSpan::nodes > 1`) the collective is hierarchical: reduce-scatter
//! inside the node, the inter-node part over `1/ranks_per_node` of the data (each GPU has its own
//! NIC, so the node's GPUs cross in parallel), all-gather inside the node. An all-to-all keeps its
//! pairwise steps: of the `D-1` peers, the `r-1` on the rank's node (`r` = ranks a node) cost
//! `α + n/(D·β)` on the intra-node link and the other `D-r` the same on the inter-node link (each
//! step one peer, one NIC a GPU). The bytes a rank sends are
//! the same either way; only the time changes. `β` is the link's bandwidth times the hardware's link
//! efficiency.

use super::hw::{HardwareSpec, LinkSpec};
use super::layout::AxisSpan;

/// The kinds of collectives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Collective {
    /// Sum over the group, everyone gets the result.
    AllReduce,
    /// Sum over the group, everyone keeps one block.
    ReduceScatter,
    /// Concatenate everyone's block.
    AllGather,
    /// One rank's buffer to all.
    Broadcast,
    /// Point to point.
    SendRecv,
    /// Everyone sends a distinct block to everyone.
    AllToAll,
}

impl Collective {
    /// The name in reports (`all_reduce`, ...), as `pleat run` spells the measured ones.
    pub fn as_str(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast => "broadcast",
            Collective::SendRecv => "send",
            Collective::AllToAll => "all_to_all",
        }
    }
}

/// The algorithm of an all-reduce.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Bandwidth-optimal ring.
    Ring,
    /// Latency-optimal double binary tree.
    Tree,
    /// Whichever is faster for the size (what NCCL's tuner does, roughly).
    Auto,
}

/// Bytes one rank sends for a collective of `bytes` over `ranks` (the convention above: the
/// buffer for all-reduce and all-to-all, the whole input for reduce-scatter, the whole output for
/// all-gather, the message for broadcast and send/recv). Broadcast counts the mean over the chain.
pub fn bytes_sent(kind: Collective, bytes: f64, ranks: u64) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let share = (ranks - 1) as f64 / ranks as f64;
    match kind {
        Collective::AllReduce => 2.0 * share * bytes,
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll | Collective::Broadcast => {
            share * bytes
        }
        Collective::SendRecv => bytes,
    }
}

/// Seconds of a collective on one link class, flat (every hop on `link`).
pub fn flat_time(
    kind: Collective,
    bytes: f64,
    ranks: u64,
    link: &LinkSpec,
    efficiency: f64,
    algorithm: Algorithm,
) -> f64 {
    if ranks <= 1 && kind != Collective::SendRecv {
        return 0.0;
    }
    let beta = link.bandwidth_bytes_per_s * efficiency;
    let alpha = link.latency_s;
    let steps = (ranks - 1) as f64;
    let share = steps / ranks as f64;
    match kind {
        Collective::AllReduce => {
            let ring = 2.0 * share * bytes / beta + 2.0 * steps * alpha;
            let tree = 2.0 * bytes / beta + 2.0 * (ranks as f64).log2().ceil() * alpha;
            match algorithm {
                Algorithm::Ring => ring,
                Algorithm::Tree => tree,
                Algorithm::Auto => ring.min(tree),
            }
        }
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => {
            share * bytes / beta + steps * alpha
        }
        Collective::Broadcast => bytes / beta + steps * alpha,
        Collective::SendRecv => bytes / beta + alpha,
    }
}

/// Seconds of a collective over a group placed as `span`, hierarchical when it spans nodes.
pub fn time(kind: Collective, bytes: f64, span: AxisSpan, hw: &HardwareSpec) -> f64 {
    let efficiency = hw.efficiency.link;
    let ranks = span.ranks_per_node * span.nodes;
    if span.nodes <= 1 {
        return flat_time(kind, bytes, ranks, &hw.intra_node, efficiency, Algorithm::Auto);
    }
    if span.ranks_per_node <= 1 {
        return flat_time(kind, bytes, ranks, &hw.inter_node, efficiency, Algorithm::Auto);
    }
    let intra = |kind: Collective, bytes: f64| {
        flat_time(kind, bytes, span.ranks_per_node, &hw.intra_node, efficiency, Algorithm::Ring)
    };
    let inter =
        |kind: Collective, bytes: f64| flat_time(kind, bytes, span.nodes, &hw.inter_node, efficiency, Algorithm::Auto);
    let slice = bytes / span.ranks_per_node as f64;
    match kind {
        Collective::AllReduce => {
            intra(Collective::ReduceScatter, bytes)
                + inter(Collective::AllReduce, slice)
                + intra(Collective::AllGather, bytes)
        }
        Collective::ReduceScatter => intra(Collective::ReduceScatter, bytes) + inter(Collective::ReduceScatter, slice),
        Collective::AllGather => inter(Collective::AllGather, slice) + intra(Collective::AllGather, bytes),
        Collective::AllToAll => {
            let block = bytes / ranks as f64;
            let step = |link: &LinkSpec| link.latency_s + block / (link.bandwidth_bytes_per_s * efficiency);
            let same_node = (span.ranks_per_node - 1) as f64;
            let other_nodes = (ranks - span.ranks_per_node) as f64;
            same_node * step(&hw.intra_node) + other_nodes * step(&hw.inter_node)
        }
        // No hierarchical form is modelled: the slowest hop sets the pace.
        Collective::Broadcast | Collective::SendRecv => {
            flat_time(kind, bytes, ranks, &hw.inter_node, efficiency, Algorithm::Auto)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINK: LinkSpec = LinkSpec { bandwidth_bytes_per_s: 100e9, latency_s: 5e-6 };

    fn close(got: f64, want: f64) {
        assert!((got - want).abs() <= 1e-12 * want.abs().max(1e-30), "got {got}, want {want}");
    }

    #[test]
    fn ring_formulas_by_hand() {
        // 8 ranks, 1 GB: ring all-reduce 2·7/8·1e9/1e11 + 14·5e-6 = 0.0175 + 0.00007 s.
        close(flat_time(Collective::AllReduce, 1e9, 8, &LINK, 1.0, Algorithm::Ring), 0.0175 + 14.0 * 5e-6);
        close(flat_time(Collective::AllReduce, 1e9, 8, &LINK, 1.0, Algorithm::Tree), 0.02 + 6.0 * 5e-6);
        close(flat_time(Collective::ReduceScatter, 1e9, 8, &LINK, 1.0, Algorithm::Ring), 0.00875 + 7.0 * 5e-6);
        close(flat_time(Collective::AllGather, 1e9, 8, &LINK, 1.0, Algorithm::Ring), 0.00875 + 7.0 * 5e-6);
        close(flat_time(Collective::Broadcast, 1e9, 8, &LINK, 1.0, Algorithm::Ring), 0.01 + 7.0 * 5e-6);
        close(flat_time(Collective::SendRecv, 1e9, 2, &LINK, 1.0, Algorithm::Ring), 0.01 + 5e-6);
        close(flat_time(Collective::AllToAll, 8e9, 8, &LINK, 0.5, Algorithm::Ring), 7.0 / 8.0 * 8e9 / 5e10 + 35e-6);
        assert_eq!(flat_time(Collective::AllReduce, 1e9, 1, &LINK, 1.0, Algorithm::Ring), 0.0);
    }

    #[test]
    fn small_messages_take_the_tree() {
        let small = flat_time(Collective::AllReduce, 1e3, 64, &LINK, 1.0, Algorithm::Auto);
        close(small, flat_time(Collective::AllReduce, 1e3, 64, &LINK, 1.0, Algorithm::Tree));
        let large = flat_time(Collective::AllReduce, 1e10, 64, &LINK, 1.0, Algorithm::Auto);
        close(large, flat_time(Collective::AllReduce, 1e10, 64, &LINK, 1.0, Algorithm::Ring));
    }

    #[test]
    fn bytes_sent_follow_the_bus_bandwidth_convention() {
        assert_eq!(bytes_sent(Collective::AllReduce, 800.0, 8), 1400.0);
        assert_eq!(bytes_sent(Collective::AllGather, 800.0, 8), 700.0);
        assert_eq!(bytes_sent(Collective::SendRecv, 800.0, 2), 800.0);
        assert_eq!(bytes_sent(Collective::AllReduce, 800.0, 1), 0.0);
    }

    #[test]
    fn hierarchical_all_reduce_crosses_nodes_with_a_slice() {
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let span = AxisSpan { ranks_per_node: 8, nodes: 4 };
        let bytes = 4e9;
        let beta_intra = 450e9 * hw.efficiency.link;
        let beta_inter = 50e9 * hw.efficiency.link;
        let intra_rs = 7.0 / 8.0 * bytes / beta_intra + 7.0 * 3e-6;
        let inter_ar = 2.0 * 3.0 / 4.0 * (bytes / 8.0) / beta_inter + 6.0 * 6e-6;
        close(time(Collective::AllReduce, bytes, span, &hw), 2.0 * intra_rs + inter_ar);
        // Within a node the flat ring on NVLink.
        let node = AxisSpan { ranks_per_node: 8, nodes: 1 };
        close(time(Collective::AllGather, bytes, node, &hw), intra_rs);
        // One rank a node: the flat ring on the NICs.
        let spread = AxisSpan { ranks_per_node: 1, nodes: 4 };
        close(time(Collective::AllGather, bytes, spread, &hw), 3.0 / 4.0 * bytes / beta_inter + 3.0 * 6e-6);
    }

    #[test]
    fn all_to_all_across_nodes_pairs_up_by_link() {
        // ep=8 over two nodes of 4: 3 peers on NVLink, 4 over the NICs, an eighth of 8 GB each.
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let span = AxisSpan { ranks_per_node: 4, nodes: 2 };
        let (beta_intra, beta_inter) = (450e9 * hw.efficiency.link, 50e9 * hw.efficiency.link);
        let want = 3.0 * (3e-6 + 1e9 / beta_intra) + 4.0 * (6e-6 + 1e9 / beta_inter);
        close(time(Collective::AllToAll, 8e9, span, &hw), want);
        // One node, or one rank a node: the flat exchange on that link.
        let node = AxisSpan { ranks_per_node: 8, nodes: 1 };
        close(time(Collective::AllToAll, 8e9, node, &hw), 7.0 * (3e-6 + 1e9 / beta_intra));
        let spread = AxisSpan { ranks_per_node: 1, nodes: 8 };
        close(time(Collective::AllToAll, 8e9, spread, &hw), 7.0 * (6e-6 + 1e9 / beta_inter));
        assert_eq!(bytes_sent(Collective::AllToAll, 8e9, 8), 7e9);
    }
}
