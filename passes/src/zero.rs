//! ZeRO-3's parameter partition: each parameter's rows split over its data-parallel axes,
//! gathered just before use.
//!
//! Runs on a sharded forward graph (after propagation): a parameter whose first dim divides over
//! `dp` (after its other splits) gets `dp` as the innermost split of that dim, then `cp` and `ep`
//! too while the rows still divide and `ep` does not split it (`pleat_ir::ZERO_AXES`: cp's ranks
//! hold the same weights, and ep splits the batch as dp does); once a rank holds one row, the next
//! dim takes the split (`ShardSpec::with_rows_split`). An `all_gather` over each of those
//! axes, innermost first, just before its first use
//! hands every user the layout it had before, so nothing else changes.
//! Differentiating then gives each gather's conjugate, a reduce-scatter of the gradient onto the
//! same rows, and `autodiff::Options { zero_stage: 3 }` gathers again in the backward instead of
//! keeping the forward's copy alive. Stages 1 and 2 change no forward value: they are the optimizer's
//! and the gradients' layouts.

use pleat_ir::{Module, Op, ZERO_AXES};

use crate::error::Result;
use crate::manager::{Pass, PassCtx};

/// Splits parameters over their data-parallel axes for ZeRO-3; a no-op at lower stages or without
/// a `dp` or `ep` axis.
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
        let Some(split) = data.spec.with_rows_split(&data.ty.shape, &mesh, &ZERO_AXES) else { continue };
        let ty = data.ty.clone();
        let axes = split.rows_split_beyond(&data.spec);
        graph.value_mut(value).spec = split.clone();
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
        let mut anchor = order[first_use.saturating_sub(1)];
        // Each gather undoes the innermost split left (over dp × ep: ep's, then dp's); the last
        // hands the users the parameter's layout before the partition.
        let (mut gathered, mut spec) = (value, split);
        for (index, &(dim, axis)) in axes.iter().enumerate().rev() {
            spec.dims[dim].pop();
            let suffix = if index == 0 { "zero_gather".to_string() } else { format!("zero_gather.{axis}") };
            let op = Op::AllGather { axis, dim: ty.shape.dims()[dim].name };
            let next =
                graph.insert_after(anchor, op, &[gathered], ty.clone(), spec.clone(), &format!("{name}.{suffix}"));
            anchor = graph.value(next).def;
            graph.replace_uses(gathered, next, anchor);
            gathered = next;
        }
    }
    Ok(())
}
