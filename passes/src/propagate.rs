//! Propagation: seeds the leaves' specs from the mesh's strategies, derives every other value's
//! spec, and inserts collectives where an op cannot take its operands' layouts.
//!
//! Walking the program in order, each op's spec comes from its sharding rule. When the rule
//! rejects an operand because it is a pending sum (`Partial`), an all-reduce over those axes is
//! inserted right after the operand's definition and every later use reads the sum: this is where
//! Megatron's two all-reduces a layer come from (after the row-parallel o and down projections) and
//! the vocab-parallel embedding's. An activation split on an axis its weight also splits is
//! all-gathered first. Graph outputs are made replicated at the end: pending sums are all-reduced
//! and split dims all-gathered (the vocab-parallel LM head's logits). These are fixed,
//! always-correct choices, the same under every strategy; choosing between collectives by cost,
//! sequence parallelism's reduce-scatters included, is `rewrite-collectives`' job.

use pleat_ir::{AxisName, DimName, Graph, Module, NodeId, Op, Shape, ShardSpec, ValueId};

use crate::error::{Error, Result};
use crate::manager::{Pass, PassCtx};
use crate::sharding::{output_spec, Conflict};

/// Completes specs and inserts the collectives they require.
pub const PROPAGATE_SPECS: Pass = Pass { name: "propagate-specs", run: propagate_specs };

fn propagate_specs(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    derive_specs(module, ctx)
}

/// Seeds the leaves, derives every spec, inserts the collectives the rules call for and makes the
/// outputs replicated. Running it again on its own result changes nothing.
pub(crate) fn derive_specs(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    crate::strategy::seed_leaves(module, ctx)?;
    // Sequence parallelism itself is egg's choice (`rewrite-collectives`); propagation only checks
    // that the sequence splits.
    sequence_parallel_axis(module, ctx)?;
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
                    all_reduce_after_def(graph, input, &axes)?;
                    // The inserted nodes sit before this one; the cursor must still point past it.
                    cursor = graph.order().iter().position(|&id| id == node).map_or(cursor, |at| at + 1);
                }
                Err(Conflict::SplitActivation { dim, axis }) => {
                    let input = data.inputs[0];
                    let dim_index = graph.value(input).ty.shape.position(dim).expect("the rule named an existing dim");
                    if graph.value(input).spec.dims[dim_index].last() != Some(&axis) {
                        return Err(Error::NoLayout {
                            node,
                            name: data.name.clone(),
                            reason: format!("its activation's {dim} is split over {axis}, but not innermost"),
                        });
                    }
                    let gather = Op::AllGather { axis, dim };
                    if matches!(data.op, Op::MoeMlp { .. }) {
                        // The all-gather dispatcher's rows are the experts' alone: a shared expert
                        // beside them runs on the rank's own rows, whose sum the experts' partial
                        // one is then reduce-scattered to meet.
                        collective_for(graph, node, 0, gather, "all_gather")?;
                    } else {
                        collective_after_def(graph, input, gather, "all_gather")?;
                    }
                    // The inserted nodes sit before this one; the cursor must still point past it.
                    cursor = graph.order().iter().position(|&id| id == node).map_or(cursor, |at| at + 1);
                }
                Err(Conflict::ScatterPartial { operand, axis, dim }) => {
                    let input = data.inputs[operand];
                    collective_after_def(graph, input, Op::ReduceScatter { axis, dim }, "reduce_scatter")?;
                    // The inserted node sits before this one; the cursor must still point past it.
                    cursor = graph.order().iter().position(|&id| id == node).map_or(cursor, |at| at + 1);
                }
                Err(Conflict::Layout(reason)) => {
                    return Err(Error::NoLayout { node, name: data.name.clone(), reason });
                }
            }
        }
    }
    for output in graph.outputs().to_vec() {
        replicate_output(graph, output)?;
    }
    Ok(())
}

/// Sequence parallelism's axis (`tp`), when it is on; checks that a rank's sequence splits over it.
fn sequence_parallel_axis(module: &Module, ctx: &PassCtx) -> Result<Option<AxisName>> {
    if !ctx.sequence_parallel {
        return Ok(None);
    }
    let Some(degree) = module.mesh.axis(AxisName::Tp).map(|axis| axis.size) else {
        return Err(Error::UnsupportedAxis { axis: "sp (tp-sp without a tp axis)".into(), available: vec!["tp"] });
    };
    let graph = &module.graph;
    let seq = graph.order().iter().find_map(|&node| {
        let value = graph.value(graph.node(node).result);
        (graph.node(node).op == Op::Tokens).then(|| value.ty.shape.size_of(DimName::Seq)).flatten()
    });
    // Beside cp the stream is split on seq over cp first (Megatron's order), so tp splits a cp
    // rank's tokens; `fold-cp` refuses a sequence that does not split over cp.
    let cp = module.mesh.degree(AxisName::Cp);
    let (seq, what) = match seq {
        Some(seq) if cp > 1 && seq % cp == 0 => (Some(seq / cp), format!("tokens a cp rank (seq={seq} over cp={cp})")),
        _ => (seq, "tokens (seq)".to_string()),
    };
    if let Some(seq) = seq.filter(|seq| seq % degree != 0) {
        return Err(Error::Ir(pleat_ir::Error::Indivisible {
            node: "tokens".into(),
            what,
            count: seq,
            axis: "tp".into(),
            degree,
            valid: pleat_ir::spec::valid_degrees(seq),
        }));
    }
    Ok(Some(AxisName::Tp))
}

/// Inserts `op` (a collective on `value`) after `value`'s definition, with the spec its rule
/// derives, points later users at its result, and returns it.
fn collective_after_def(graph: &mut Graph, value: ValueId, op: Op, suffix: &str) -> Result<ValueId> {
    let result = insert_collective(graph, value, op, suffix)?;
    graph.replace_uses(value, result, graph.value(result).def);
    Ok(result)
}

/// Inserts `op` (a collective on `value`) after `value`'s definition, with the spec its rule
/// derives, and returns its result, which nothing reads yet.
fn insert_collective(graph: &mut Graph, value: ValueId, op: Op, suffix: &str) -> Result<ValueId> {
    let def = graph.value(value).def;
    let ty = graph.value(value).ty.clone();
    let name = format!("{}.{suffix}", graph.node(def).name);
    let result = graph.insert_after(def, op, &[value], ty, graph.value(value).spec.clone(), &name);
    let node = graph.value(result).def;
    let data = graph.node(node);
    let input = graph.value(value);
    let spec = output_spec(data, &[&input.spec], &[&input.ty.shape], &input.ty.shape)
        .map_err(|conflict| Error::NoLayout { node, name: name.clone(), reason: conflict.to_string() })?;
    graph.value_mut(result).spec = spec;
    Ok(result)
}

/// Inserts `op` (a collective on operand `operand` of `node`) after that operand's definition,
/// with the spec its rule derives, and points `node` alone at its result.
fn collective_for(graph: &mut Graph, node: NodeId, operand: usize, op: Op, suffix: &str) -> Result<ValueId> {
    let result = insert_collective(graph, graph.node(node).inputs[operand], op, suffix)?;
    graph.node_mut(node).inputs[operand] = result;
    Ok(result)
}

/// Inserts `all_reduce` over each of `axes` after `value`'s definition, and points its later users
/// at the sum. Returns the summed value.
fn all_reduce_after_def(graph: &mut Graph, value: ValueId, axes: &[AxisName]) -> Result<ValueId> {
    let mut current = value;
    for &axis in axes {
        current = collective_after_def(graph, current, Op::AllReduce { axis }, "all_reduce")?;
    }
    Ok(current)
}

/// Makes graph output `value` replicated: sums pending sums, then gathers split dims innermost
/// axis first.
fn replicate_output(graph: &mut Graph, value: ValueId) -> Result<()> {
    let partial = graph.value(value).spec.partial.clone();
    let mut current = all_reduce_after_def(graph, value, &partial)?;
    loop {
        let spec = &graph.value(current).spec;
        let Some(dim_index) = spec.dims.iter().rposition(|axes| !axes.is_empty()) else { return Ok(()) };
        let axis = *spec.dims[dim_index].last().expect("a split dim has an axis");
        let dim = graph.value(current).ty.shape.dims()[dim_index].name;
        current = collective_after_def(graph, current, Op::AllGather { axis, dim }, &format!("all_gather_{axis}"))?;
    }
}
