//! ZeRO-3's parameter partition: each parameter's rows split over `dp`, gathered just before use.
//!
//! Runs on a sharded forward graph (after propagation): a parameter whose first dim divides over
//! `dp` (after its other splits) gets `dp` as the innermost split of that dim, and an `all_gather`
//! over `dp` just before its first use hands every user the layout it had before, so nothing else changes.
//! Differentiating then gives each gather's conjugate, a reduce-scatter of the gradient onto the
//! same rows, and `autodiff::Options { zero_stage: 3 }` gathers again in the backward instead of
//! keeping the forward's copy alive. Stages 1 and 2 change no forward value: they are the optimizer's
//! and the gradients' layouts.

use pleat_ir::{AxisName, Module, Op};

use crate::error::Result;
use crate::manager::{Pass, PassCtx};

/// Splits parameters over `dp` for ZeRO-3; a no-op at lower stages or without a `dp` axis.
pub const ZERO_PARTITION: Pass = Pass { name: "zero-partition", run: partition_params };

fn partition_params(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    if ctx.zero_stage < 3 {
        return Ok(());
    }
    let mesh = module.mesh.clone();
    let graph = &mut module.graph;
    let params: Vec<_> = graph.params().into_iter().map(|(value, name)| (value, name.to_string())).collect();
    for (value, name) in params {
        let data = graph.value(value);
        let Some(split) = data.spec.with_rows_split(&data.ty.shape, &mesh, AxisName::Dp) else { continue };
        let (ty, whole) = (data.ty.clone(), data.spec.clone());
        let dim = ty.shape.dims()[0].name;
        graph.value_mut(value).spec = split;
        // Gather just before the first use, not where the parameter is declared, so that only the
        // layer at work holds its whole parameters; before the run of broadcasts a TSP owner's
        // blocks make when the first use is one of them, so that they still travel as one message.
        let users = graph.users(value);
        let order = graph.order();
        let mut first_use = order.iter().position(|node| users.contains(node)).unwrap_or(order.len());
        if let Some(&Op::BroadcastShard { axis, root, .. }) = order.get(first_use).map(|&node| &graph.node(node).op) {
            let same_message = |node| {
                let op = &graph.node(node).op;
                matches!(*op, Op::BroadcastShard { axis: other, root: owner, .. } if other == axis && owner == root)
            };
            while first_use > 0 && same_message(order[first_use - 1]) {
                first_use -= 1;
            }
        }
        let anchor = order[first_use.saturating_sub(1)];
        let op = Op::AllGather { axis: AxisName::Dp, dim };
        let gathered = graph.insert_after(anchor, op, &[value], ty, whole, &format!("{name}.zero_gather"));
        let gather_node = graph.value(gathered).def;
        graph.replace_uses(value, gathered, gather_node);
    }
    Ok(())
}
