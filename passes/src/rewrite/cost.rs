//! Extraction by cost: the alpha-beta time of collectives plus a roofline time of compute.
//!
//! A collective costs what `cost::comm::time` says for its kind, its bytes (from the analysis,
//! with the convention of `cost::comm`: the buffer for all-reduce and all-to-all, the whole input
//! for reduce-scatter, the whole output for all-gather, the block for a broadcast) and the span
//! of its axis on the hardware's nodes. A compute op costs the larger of its FLOPs at peak and its
//! bytes at HBM bandwidth (the efficiencies of `HardwareSpec`), on the local blocks: so a norm on
//! a `1/D` sequence shard costs `1/D` of one on the whole sequence. A local slice costs a copy of
//! its block. The ring MLP costs D steps of its GEMMs, each at least one shard's point-to-point hop
//! (the hop is double-buffered under the step). Ties break on the number of e-nodes, then on the
//! fixed order of a class's nodes, so the choice is deterministic.

use std::cmp::Ordering;
use std::ops::Add;

use egg::{CostFunction, Id, Language};
use pleat_ir::{DimName, Op};

use super::analysis::{node_meta, LayerGraph, Meta, TensorMeta};
use super::language::{to_op, ChildKind, LayerLang};
use crate::cost::comm::{time, Collective};
use crate::cost::hw::HardwareSpec;
use crate::cost::layout::AxisSpan;

/// The cost of an expression: seconds, then e-nodes for ties.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LayerCost {
    /// Predicted seconds on one rank.
    pub seconds: f64,
    /// E-nodes (ties).
    pub nodes: u64,
}

impl LayerCost {
    /// The cost of something that cannot be built: never chosen.
    pub const INFINITE: LayerCost = LayerCost { seconds: f64::INFINITY, nodes: u64::MAX };
}

impl Add for LayerCost {
    type Output = LayerCost;
    fn add(self, other: LayerCost) -> LayerCost {
        LayerCost { seconds: self.seconds + other.seconds, nodes: self.nodes.saturating_add(other.nodes) }
    }
}

impl PartialOrd for LayerCost {
    fn partial_cmp(&self, other: &LayerCost) -> Option<Ordering> {
        // total_cmp: infinite costs compare, and no NaN can reach egg's `unwrap`.
        Some(self.seconds.total_cmp(&other.seconds).then(self.nodes.cmp(&other.nodes)))
    }
}

/// The cost model: the hardware the alpha-beta and roofline terms come from.
#[derive(Clone, Debug)]
pub struct CostModel {
    /// The hardware.
    pub hardware: HardwareSpec,
}

impl CostModel {
    /// Seconds of `op` producing `out` from `operands` on one rank, on a mesh axis of `degree`.
    pub fn op_seconds(&self, op: &Op, operands: &[&TensorMeta], out: &TensorMeta, degree: u64) -> f64 {
        let hw = &self.hardware;
        let span = AxisSpan {
            ranks_per_node: degree.min(hw.gpus_per_node.max(1)),
            nodes: degree.div_ceil(hw.gpus_per_node.max(1)),
        };
        let input_bytes = operands.first().map_or(0, |operand| operand.local_bytes) as f64;
        let output_bytes = out.local_bytes as f64;
        let memory = |bytes: f64| bytes / (hw.hbm_bytes_per_s * hw.efficiency.memory_bound);
        let dtype_bytes = out.ty.dtype.size_bytes();
        let flops = |flops: f64, efficiency: f64| flops / (hw.peak_flops(dtype_bytes) * efficiency);
        match op {
            Op::AllReduce { .. } => time(Collective::AllReduce, input_bytes, span, hw),
            Op::ReduceScatter { .. } => time(Collective::ReduceScatter, input_bytes, span, hw),
            Op::AllGather { .. } => time(Collective::AllGather, output_bytes, span, hw),
            Op::AllToAll { .. } => time(Collective::AllToAll, input_bytes, span, hw),
            Op::BroadcastShard { .. } => time(Collective::Broadcast, output_bytes, span, hw),
            Op::LocalSlice { .. } => memory(2.0 * output_bytes),
            Op::MatMul { .. } => {
                let element_bytes = dtype_bytes.max(1) as f64;
                // x[F, C] · w[G, C] -> [F, G]: C = sqrt(|x|·|w| / |out|), all local.
                let contracted = operands.first().zip(operands.get(1)).map_or(1.0, |(x, w)| {
                    ((x.local_bytes as f64 / element_bytes) * (w.local_bytes as f64 / element_bytes)
                        / (output_bytes / element_bytes).max(1.0))
                    .sqrt()
                });
                let work = 2.0 * (output_bytes / element_bytes) * contracted.max(1.0);
                flops(work, hw.efficiency.matmul).max(memory(input_bytes + output_bytes))
            }
            Op::Attention { .. } => {
                let element_bytes = dtype_bytes.max(1) as f64;
                let keys = operands.get(1).map_or(1.0, |k| {
                    let position = k.ty.shape.position(DimName::Seq);
                    let split = position.is_some_and(|at| !k.spec.dims[at].is_empty());
                    k.ty.shape.size_of(DimName::Seq).unwrap_or(1) as f64 / if split { degree as f64 } else { 1.0 }
                });
                flops(4.0 * (output_bytes / element_bytes) * keys, hw.efficiency.attention)
            }
            Op::RingGatedMlp { .. } => {
                let element_bytes = dtype_bytes.max(1) as f64;
                let weights: f64 = operands.iter().skip(1).map(|w| w.local_bytes as f64 / element_bytes).sum();
                let tokens = output_bytes / element_bytes / out.ty.shape.size_of(DimName::Hidden).unwrap_or(1) as f64;
                // D steps of one shard's GEMMs; each of the D-1 hops moves a shard and is
                // double-buffered under a step, so a step takes the longer of the two.
                let step = flops(2.0 * tokens * weights, hw.efficiency.matmul);
                let shard_bytes: f64 = operands.iter().skip(1).map(|w| w.local_bytes as f64).sum();
                let hop = time(Collective::SendRecv, shard_bytes, span, hw);
                step + (degree.saturating_sub(1)) as f64 * step.max(hop)
            }
            // Streaming ops: read the operands, write the result.
            _ => {
                let read: f64 = operands.iter().map(|operand| operand.local_bytes as f64).sum();
                memory(read + output_bytes)
            }
        }
    }
}

/// egg's cost function over a layer's e-graph: each e-node's time from its class facts.
pub struct LayerCostFunction<'a> {
    egraph: &'a LayerGraph,
    model: &'a CostModel,
    /// A leaf the extracted form may not read (a layer input that does not exist in this form).
    unavailable: Option<egg::Symbol>,
}

impl<'a> LayerCostFunction<'a> {
    /// The cost function of `model` over `egraph`.
    pub fn new(egraph: &'a LayerGraph, model: &'a CostModel) -> LayerCostFunction<'a> {
        LayerCostFunction { egraph, model, unavailable: None }
    }
    /// The same, with leaf `symbol` unavailable: no form that reads it can be chosen.
    pub fn without_leaf(self, symbol: Option<egg::Symbol>) -> LayerCostFunction<'a> {
        LayerCostFunction { unavailable: symbol, ..self }
    }
    /// Seconds of one e-node, or `None` when it is ill-typed or reads an unavailable leaf.
    pub fn node_seconds(&self, node: &LayerLang) -> Option<f64> {
        if let LayerLang::Symbol(symbol) = node {
            return (Some(*symbol) != self.unavailable).then_some(0.0);
        }
        let analysis = &self.egraph.analysis;
        let child = |id: Id| &self.egraph[id].data;
        let out = node_meta(node, child, &analysis.leaves, &analysis.mesh);
        let out = out.tensor()?;
        let kind = |id: Id| match child(id) {
            Meta::Axis(axis) => ChildKind::Axis(*axis),
            Meta::Dim(dim) => ChildKind::Dim(*dim),
            Meta::Attribute(op) => ChildKind::Attribute(op.clone()),
            Meta::Tensor(_) => ChildKind::Tensor,
            Meta::Invalid(_) => ChildKind::Other,
        };
        let (op, operands) = to_op(node, kind)?;
        let operands: Vec<&TensorMeta> = operands.iter().filter_map(|&id| child(id).tensor()).collect();
        let degree = op.axis().map_or(1, |axis| analysis.mesh.degree(axis));
        Some(self.model.op_seconds(&op, &operands, out, degree))
    }
}

impl CostFunction<LayerLang> for LayerCostFunction<'_> {
    type Cost = LayerCost;
    fn cost<C>(&mut self, enode: &LayerLang, mut costs: C) -> LayerCost
    where
        C: FnMut(Id) -> LayerCost,
    {
        let Some(seconds) = self.node_seconds(enode) else { return LayerCost::INFINITE };
        enode.fold(LayerCost { seconds, nodes: 1 }, |sum, id| sum + costs(id))
    }
}
