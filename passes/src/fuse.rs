//! Fusion: chains of elementwise and row-wise ops become one op, so that the values between them
//! are never stored (the memory planner sees fewer intermediates, and each kernel reads its
//! operands once).
//!
//! Two rewrites, each only where the value it removes has no reader but the op that absorbs it and
//! is not a graph output, and only over operands of one type and one layout (no bias broadcast):
//! - a chain of adds becomes one `sum`: `add(add(a, b), c)` is `sum(a, b, c)`, and a `sum` whose
//!   first operand is such an add or sum takes that one's operands in its place. The terms are
//!   summed left to right in the order the chain did (an add's operands commute exactly), so the
//!   result is the chain's bit for bit;
//! - an RMSNorm's input gradient added to the gradient already gathered (the residual stream's,
//!   twice a layer in the backward) becomes one `rms_norm_grad_input_add`, which adds after
//!   computing the gradient, as the add did.
//!
//! The pass runs when native code is asked for (`pleat compile --emit`, `pleat run --native`): the
//! cost model's closed forms describe the unfused programs.

use pleat_ir::{Graph, Module, NodeId, Op, ValueId};

use crate::error::Result;
use crate::manager::{Pass, PassCtx};

/// Fuses add chains into sums and norm gradients into the adds that read them.
pub const FUSE: Pass = Pass { name: "fuse", run: fuse };

fn fuse(module: &mut Module, _ctx: &PassCtx) -> Result<()> {
    let graph = &mut module.graph;
    // Each rewrite leaves the absorbed node unread; compacting drops it before the next sweep, so
    // that its reads do not count as readers of its operands.
    while fuse_once(graph) > 0 {
        graph.compact();
    }
    Ok(())
}

/// One sweep over the program order; the number of rewrites.
fn fuse_once(graph: &mut Graph) -> usize {
    let mut rewrites = 0;
    for node in graph.order().to_vec() {
        let data = graph.node(node);
        let rewritten = match data.op {
            Op::Add => fused_norm_gradient(graph, node).or_else(|| flattened_sum(graph, node)),
            Op::Sum { .. } => flattened_sum(graph, node),
            _ => None,
        };
        if let Some((op, inputs)) = rewritten {
            let data = graph.node_mut(node);
            data.op = op;
            data.inputs = inputs;
            rewrites += 1;
        }
    }
    rewrites
}

/// Whether `value` is read only by `reader` and is not a graph output.
fn only_read_by(graph: &Graph, value: ValueId, reader: NodeId) -> bool {
    graph.users(value) == [reader] && !graph.outputs().contains(&value)
}

/// Whether every value in `values` has `node`'s result type and layout.
fn alike(graph: &Graph, node: NodeId, values: &[ValueId]) -> bool {
    let result = graph.value(graph.node(node).result);
    values.iter().all(|&value| {
        let data = graph.value(value);
        data.ty == result.ty && data.spec == result.spec
    })
}

/// `add(acc, rms_norm_grad_input(x, w, dy))` (either order) as `rms_norm_grad_input_add(x, w, dy, acc)`.
fn fused_norm_gradient(graph: &Graph, add: NodeId) -> Option<(Op, Vec<ValueId>)> {
    let inputs = &graph.node(add).inputs;
    [(inputs[1], inputs[0]), (inputs[0], inputs[1])].into_iter().find_map(|(gradient, acc)| {
        let Op::RmsNormGradInput { eps } = graph.def(gradient).op else { return None };
        if !only_read_by(graph, gradient, add) || !alike(graph, add, &[gradient, acc]) {
            return None;
        }
        let operands = &graph.def(gradient).inputs;
        Some((Op::RmsNormGradInputAdd { eps }, vec![operands[0], operands[1], operands[2], acc]))
    })
}

/// An add or sum whose first operand (either operand of an add) is an add or sum read by it alone,
/// as one sum of that one's operands and its own others.
fn flattened_sum(graph: &Graph, outer: NodeId) -> Option<(Op, Vec<ValueId>)> {
    let data = graph.node(outer);
    if !alike(graph, outer, &data.inputs) {
        return None;
    }
    let candidates: &[usize] = if data.op == Op::Add { &[0, 1] } else { &[0] };
    candidates.iter().find_map(|&position| {
        let inner = data.inputs[position];
        let inner_data = graph.def(inner);
        if !matches!(inner_data.op, Op::Add | Op::Sum { .. })
            || !only_read_by(graph, inner, outer)
            || !alike(graph, outer, &inner_data.inputs)
        {
            return None;
        }
        let mut inputs = inner_data.inputs.clone();
        inputs.extend(data.inputs.iter().enumerate().filter(|&(index, _)| index != position).map(|(_, &value)| value));
        let terms = u8::try_from(inputs.len()).ok()?;
        Some((Op::Sum { terms }, inputs))
    })
}

#[cfg(test)]
mod tests {
    use pleat_ir::model::build_training;
    use pleat_ir::model::preset::preset;
    use pleat_ir::{AxisName, Mesh};

    use super::*;
    use crate::{run_pipeline, TRAIN_PIPELINE};

    fn trained(mesh: &[(AxisName, u64)]) -> Module {
        let config = preset("tiny").expect("tiny");
        let mut module = build_training(&config, 2, 8).expect("build");
        module.mesh = Mesh::new(mesh).expect("mesh");
        run_pipeline(TRAIN_PIPELINE, &mut module, &PassCtx::default()).expect("train pipeline");
        module
    }

    fn count(module: &Module, matches: impl Fn(&Op) -> bool) -> usize {
        module.graph.order().iter().filter(|&&node| matches(&module.graph.node(node).op)).count()
    }

    #[test]
    fn norm_gradients_fold_into_their_adds_and_add_chains_into_sums() {
        for mesh in [&[][..], &[(AxisName::Tp, 2)][..], &[(AxisName::Tsp, 2)][..]] {
            let mut module = trained(mesh);
            let nodes = module.graph.node_count();
            let norm_gradients = count(&module, |op| matches!(op, Op::RmsNormGradInput { .. }));
            run_pipeline(&[FUSE], &mut module, &PassCtx::default()).expect("fuse verifies");
            let fused = count(&module, |op| matches!(op, Op::RmsNormGradInputAdd { .. }));
            let sums = count(&module, |op| matches!(op, Op::Sum { .. }));
            // The final norm's gradient has nothing to add to; each layer's two norms do.
            assert_eq!(fused, norm_gradients - 1, "{mesh:?}");
            assert!(sums > 0, "{mesh:?}: the gradients summed over q, k, v and over gate, up");
            assert!(module.graph.node_count() < nodes, "{mesh:?}");
            // Nothing is left to fuse.
            assert_eq!(fuse_once(&mut module.graph), 0, "{mesh:?}");
        }
    }

    #[test]
    fn a_value_read_twice_or_returned_is_kept() {
        let mut module = trained(&[]);
        let graph = &mut module.graph;
        // Every add whose operand is an add read elsewhere too stays an add.
        let before = graph.clone();
        fuse_once(graph);
        for &node in before.order() {
            let data = before.node(node);
            if data.op != Op::Add {
                continue;
            }
            let shared = data.inputs.iter().all(|&input| {
                before.users(input).len() > 1 || before.outputs().contains(&input) || {
                    let op = &before.def(input).op;
                    !matches!(op, Op::Add | Op::Sum { .. } | Op::RmsNormGradInput { .. })
                }
            });
            if shared {
                assert_eq!(graph.node(node).op, Op::Add, "{} fused an operand read elsewhere", data.name);
            }
        }
    }
}
