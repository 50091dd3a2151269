//! Propagation: seeds the leaves' specs from the mesh's strategies, derives every other value's
//! spec, and inserts collectives where an op cannot take its operands' layouts.
//!
//! Walking the program in order, each op's spec comes from its sharding rule. When the rule
//! rejects an operand because it is a pending sum (`Partial`), an all-reduce over those axes is
//! inserted right after the operand's definition and every later use reads the sum: this is where
//! Megatron's two all-reduces a layer come from (after the row-parallel o and down projections) and
//! the vocab-parallel embedding's. Graph outputs are made replicated at the end: pending sums are
//! all-reduced and split dims all-gathered (the vocab-parallel LM head's logits). Cost-driven choices
//! between collectives (reduce-scatter, moving weights instead of activations) belong to the
//! rewriting pass; this one makes the plain, always-correct choice.

use pleat_ir::{AxisName, Graph, Module, NodeId, Op, Shape, ShardSpec, ValueId};

use crate::error::{Error, Result};
use crate::manager::{Pass, PassCtx};
use crate::sharding::{output_spec, Conflict};

/// Completes specs and inserts the collectives they require.
pub const PROPAGATE_SPECS: Pass = Pass { name: "propagate-specs", run: propagate_specs };

fn propagate_specs(module: &mut Module, _ctx: &PassCtx) -> Result<()> {
    derive_specs(module)
}

/// Seeds the leaves, derives every spec, inserts the collectives the rules call for and makes the
/// outputs replicated. Running it again on its own result changes nothing.
pub(crate) fn derive_specs(module: &mut Module) -> Result<()> {
    crate::strategy::seed_leaves(module)?;
    let graph = &mut module.graph;
    let mut cursor = 0;
    while cursor < graph.order().len() {
        let node = graph.order()[cursor];
        cursor += 1;
        if graph.node(node).op.arity() == 0 {
            continue;
        }
        loop {
            let data = graph.node(node);
            let specs: Vec<&ShardSpec> = data.inputs.iter().map(|&input| &graph.value(input).spec).collect();
            let shapes: Vec<&Shape> = data.inputs.iter().map(|&input| &graph.value(input).ty.shape).collect();
            match output_spec(data, &specs, &shapes, &graph.value(data.result).ty.shape) {
                Ok(spec) => {
                    let result = data.result;
                    graph.value_mut(result).spec = spec;
                    break;
                }
                Err(Conflict::PartialInput { operand, axes }) => {
                    let input = data.inputs[operand];
                    all_reduce_after_def(graph, input, &axes);
                    // The inserted nodes sit before this one; the cursor must still point past it.
                    cursor = graph.order().iter().position(|&id| id == node).map_or(cursor, |at| at + 1);
                }
                Err(Conflict::Layout(reason)) => {
                    return Err(Error::NoLayout { node, name: data.name.clone(), reason });
                }
            }
        }
    }
    for output in graph.outputs().to_vec() {
        replicate_output(graph, output);
    }
    Ok(())
}

/// Inserts `all_reduce` over each of `axes` after `value`'s definition, and points its later users at
/// the sum. Returns the summed value.
fn all_reduce_after_def(graph: &mut Graph, value: ValueId, axes: &[AxisName]) -> ValueId {
    let mut current = value;
    for &axis in axes {
        let def = graph.value(current).def;
        let ty = graph.value(current).ty.clone();
        let mut spec = graph.value(current).spec.clone();
        spec.partial.retain(|&partial| partial != axis);
        let name = format!("{}.all_reduce", graph.node(graph.value(value).def).name);
        let summed = graph.insert_after(def, Op::AllReduce { axis }, &[current], ty, spec, &name);
        let summing_node: NodeId = graph.value(summed).def;
        graph.replace_uses(current, summed, summing_node);
        current = summed;
    }
    current
}

/// Makes graph output `value` replicated: sums pending sums, then gathers split dims innermost
/// axis first.
fn replicate_output(graph: &mut Graph, value: ValueId) {
    let partial = graph.value(value).spec.partial.clone();
    let mut current = all_reduce_after_def(graph, value, &partial);
    loop {
        let spec = graph.value(current).spec.clone();
        let Some(dim_index) = spec.dims.iter().rposition(|axes| !axes.is_empty()) else { break };
        let axis = *spec.dims[dim_index].last().expect("a split dim has an axis");
        let dim = graph.value(current).ty.shape.dims()[dim_index].name;
        let mut gathered = spec;
        gathered.dims[dim_index].pop();
        let def = graph.value(current).def;
        let ty = graph.value(current).ty.clone();
        let name = format!("{}.all_gather_{}", graph.node(def).name, axis);
        let next = graph.insert_after(def, Op::AllGather { axis, dim }, &[current], ty, gathered, &name);
        let gathering_node = graph.value(next).def;
        graph.replace_uses(current, next, gathering_node);
        current = next;
    }
}
