//! `fold-cp`: context parallelism (ring attention) on the `cp` mesh axis.
//!
//! One axis of degree D splits the sequence: every rank holds the tokens (and positions) of two of
//! the sequence's 2·D chunks in the zigzag layout that balances causal attention, and keeps every
//! weight whole. All per-token ops (embedding, norms, projections, rope, MLP, residuals) then run on
//! the local tokens unchanged; only attention needs other ranks' tokens, so each layer's attention
//! becomes a `ring_attention` over `cp`: the key/value blocks (with their positions) travel around
//! the ring while each rank keeps its queries. The final logits are all-gathered on seq and put
//! back in the original token order.
//!
//! A training graph (one with a `cross_entropy` loss) keeps plain attention instead of the ring:
//! each layer all-gathers k and v (and attends with the whole zigzag position list), so the
//! backward is the all-gathers' conjugates, reduce-scatters of dk and dv onto their owners (the
//! all-gather form of context parallelism that Llama 3's training uses). It sends the same k and v
//! a layer as the ring; what it gives up is the ring's overlap and its O(S/D) key/value memory.
//!
//! The rewrite composes with `dp` (batch split) and `tp` (heads and ffn split, Megatron's
//! all-reduces stay, inserted by propagation). A mesh with both `tsp` and `cp` is refused: both
//! would claim the sequence dim.
//!
//! Per layer and rank the forward pass sends (D-1) messages, each one block of k and v and its
//! positions: (D-1)/D·(2·B·S·h_kv + S) elements, h_kv = kv_heads·head_dim of the rank's kv heads.

use pleat_ir::{AxisName, DimName, Graph, Module, Op, ShardSpec, ValueId};

use crate::error::{Error, Result};
use crate::manager::{Pass, PassCtx};
use crate::propagate::derive_specs;

/// Rewrites the graph for the `cp` axis, when the mesh has one, and derives every spec.
pub const FOLD_CP: Pass = Pass { name: "fold-cp", run: fold_cp };

const AXIS: AxisName = AxisName::Cp;

fn fold_cp(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    let Some(degree) = module.mesh.axis(AXIS).map(|axis| axis.size) else { return Ok(()) };
    crate::strategy::conflict(&module.mesh, AxisName::Tsp, AXIS)?;
    let graph = &mut module.graph;
    let find = |graph: &Graph, name: &str| {
        graph.find(name).ok_or_else(|| Error::UnexpectedGraph { pass: FOLD_CP.name, node: name.to_string() })
    };
    let tokens = find(graph, "tokens")?;
    let positions = find(graph, "positions")?;
    let lm_head = find(graph, "lm_head")?;
    let seq = graph.value(tokens).ty.shape.size_of(DimName::Seq).unwrap_or(0);
    if seq % (2 * degree) != 0 {
        return Err(Error::ZigzagSeq {
            seq,
            axis: AXIS.to_string(),
            degree,
            valid: crate::error::zigzag_valid_degrees(seq),
        });
    }
    let loss = graph.loss_node();
    let zigzag = Op::Zigzag { parts: degree, inverse: false };
    let local = Op::LocalSlice { axis: AXIS, dim: DimName::Seq };
    let mut all_positions = positions;
    for (input, name) in [(tokens, "tokens"), (positions, "positions")] {
        let reordered = wrap(graph, input, zigzag.clone(), &format!("{name}.zigzag"));
        wrap(graph, reordered, local.clone(), &format!("{name}.local"));
        all_positions = reordered;
    }
    // The loss compares the logits, put back in token order below, with the tokens in order.
    if let Some(loss) = loss {
        graph.node_mut(loss).inputs[1] = tokens;
    }
    let attention_nodes: Vec<_> =
        graph.order().iter().copied().filter(|&node| matches!(graph.node(node).op, Op::Attention { .. })).collect();
    for node in attention_nodes {
        let Op::Attention { causal } = graph.node(node).op else { unreachable!("filtered on attention") };
        if loss.is_none() {
            graph.node_mut(node).op = Op::RingAttention { axis: AXIS, causal };
            continue;
        }
        let gather = Op::AllGather { axis: AXIS, dim: DimName::Seq };
        let name = graph.node(node).name.clone();
        let position = graph.order().iter().position(|&id| id == node).expect("a node of the order");
        let anchor = graph.order()[position - 1];
        let [key, value] = [1, 2].map(|operand| graph.node(node).inputs[operand]);
        let mut gathered = Vec::new();
        for (input, part) in [(key, "k_all"), (value, "v_all")] {
            let ty = graph.value(input).ty.clone();
            let spec = ShardSpec::replicated(ty.shape.rank());
            let anchor = gathered.last().map_or(anchor, |&last: &ValueId| graph.value(last).def);
            gathered.push(graph.insert_after(anchor, gather.clone(), &[input], ty, spec, &format!("{name}.{part}")));
        }
        let inputs = &mut graph.node_mut(node).inputs;
        inputs[1] = gathered[0];
        inputs[2] = gathered[1];
        inputs[4] = all_positions;
    }
    let gathered = wrap(graph, lm_head, Op::AllGather { axis: AXIS, dim: DimName::Seq }, "logits.all_gather_cp");
    wrap(graph, gathered, Op::Zigzag { parts: degree, inverse: true }, "logits.unzigzag");
    derive_specs(module, ctx)
}

/// Inserts `op` on `value` right after its definition and makes every other user of `value` (and
/// the graph outputs) read the result, which it returns.
fn wrap(graph: &mut Graph, value: ValueId, op: Op, name: &str) -> ValueId {
    let ty = graph.value(value).ty.clone();
    let spec = ShardSpec::replicated(ty.shape.rank());
    let anchor = graph.value(value).def;
    let wrapped = graph.insert_after(anchor, op, &[value], ty, spec, name);
    let node = graph.value(wrapped).def;
    graph.replace_uses(value, wrapped, node);
    wrapped
}

#[cfg(test)]
mod tests {
    use pleat_ir::model::preset::preset;
    use pleat_ir::{Mesh, Op};

    use super::*;

    fn folded(mesh: &str, seq: u64) -> Result<Module> {
        let config = preset("tiny").expect("tiny");
        let mut module = pleat_ir::model::build(&config, 2, seq).expect("builds");
        module.mesh = Mesh::parse(mesh).expect("mesh");
        crate::run_pipeline(crate::SHARD_PIPELINE, &mut module, &PassCtx::default())?;
        Ok(module)
    }

    #[test]
    fn every_attention_becomes_a_ring_over_cp() {
        let module = folded("dp=2,cp=2", 16).unwrap();
        let graph = &module.graph;
        let ops: Vec<&Op> = graph.order().iter().map(|&node| &graph.node(node).op).collect();
        assert!(!ops.iter().any(|op| matches!(op, Op::Attention { .. })));
        let rings =
            ops.iter().filter(|op| matches!(op, Op::RingAttention { axis: AxisName::Cp, causal: true })).count();
        assert_eq!(rings, preset("tiny").unwrap().num_layers as usize);
        // No weight is split over cp, and no collective but the logits' gather runs over it.
        for &node in graph.order() {
            let data = graph.node(node);
            if matches!(data.op, Op::Param { .. }) {
                assert!(!graph.value(data.result).spec.uses_axis(AxisName::Cp), "{}", data.name);
            }
            if matches!(data.op, Op::AllReduce { .. } | Op::AllGather { .. } | Op::ReduceScatter { .. }) {
                assert!(data.op.axis() != Some(AxisName::Cp) || data.name == "logits.all_gather_cp", "{}", data.name);
            }
        }
    }

    #[test]
    fn bad_meshes_and_sequences_are_errors() {
        let message = folded("cp=4", 12).unwrap_err().to_string();
        assert!(message.starts_with("seq=12 does not split into 2xcp=8 zigzag chunks"), "{message}");
        assert!(message.contains("cp in {1,2,3,6}"), "{message}");
        let message = folded("tsp=2,cp=2", 16).unwrap_err().to_string();
        assert_eq!(message, "mesh axes tsp and cp cannot be combined: both split the sequence; use one of them");
    }
}
