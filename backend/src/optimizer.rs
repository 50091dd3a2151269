//! The optimizer's layout: which elements of each parameter a rank updates, and how the updated
//! blocks are shared again.
//!
//! A training module's outputs are the loss and one `grad.<name>` a parameter, each laid out as
//! the backward graph left it: as the parameter, or (ZeRO-2) further split on the first dim over
//! its data-parallel axes (`pleat_ir::ZERO_AXES`: `dp`, `cp`, and `ep` where `ep` does not split
//! it).
//! `optimizer_layout` turns that, and the ZeRO stage, into one `ParamUpdate` a parameter for a
//! rank: the rows of the rank's parameter block it updates (and keeps optimizer state for), the
//! gradient output that covers them, and the group that all-gathers the updated rows when the rank
//! holds more of the parameter than it updates (ZeRO-1 and 2). ZeRO splits a parameter on its first
//! dim, so a rank's rows are contiguous in its row-major block. The runtime applies it without
//! knowing meshes or specs.

use pleat_ir::{Module, Op, ZERO_AXES};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::program::Group;

/// How one rank updates one parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamUpdate {
    /// The checkpoint name.
    pub name: String,
    /// The graph output holding its gradient (this rank's block of it).
    pub grad_output: u32,
    /// The element range of the rank's parameter block that it updates; the gradient block holds
    /// exactly these elements when `grad_is_slice`, the whole parameter block otherwise.
    pub update: (u64, u64),
    /// Whether the gradient block is already the update range (reduce-scattered, or a ZeRO-3
    /// parameter) rather than the whole parameter block.
    pub grad_is_slice: bool,
    /// Whether this rank counts the range in the global gradient norm: of the ranks updating the
    /// same elements, only the lowest does, so each element is counted once.
    pub counts_in_norm: bool,
    /// The group that all-gathers the updated ranges back into every member's whole block, in
    /// member order; `None` when the rank updates its whole block.
    pub gather: Option<Group>,
}

/// A rank's optimizer layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerLayout {
    /// One entry a parameter, in the order of the gradient outputs.
    pub params: Vec<ParamUpdate>,
    /// Every rank, for the gradient norm's all-reduce.
    pub world: Group,
}

impl OptimizerLayout {
    /// The elements of optimizer state this rank keeps (two moments an updated element).
    pub fn updated_elements(&self) -> u64 {
        self.params.iter().map(|param| param.update.1).sum()
    }
}

/// The optimizer layout of `rank` for a differentiated, sharded training module.
pub fn optimizer_layout(module: &Module, rank: u32, zero_stage: u8) -> Result<OptimizerLayout> {
    let graph = &module.graph;
    let mesh = &module.mesh;
    let world = Group { axis: "world".into(), ranks: (0..mesh.world_size() as u32).collect() };
    let mut params = Vec::new();
    for (index, &output) in graph.outputs().iter().enumerate() {
        let Some(name) = graph.def(output).name.strip_prefix("grad.") else { continue };
        let param = graph
            .order()
            .iter()
            .map(|&node| graph.node(node))
            .find(|node| matches!(&node.op, Op::Param { name: param } if param == name))
            .map(|node| node.result)
            .ok_or_else(|| Error::Malformed {
                reason: format!("gradient output grad.{name} has no parameter {name}"),
            })?;
        let shape = &graph.value(param).ty.shape;
        let param_spec = &graph.value(param).spec;
        let grad_spec = &graph.value(output).spec;
        let block = param_spec.region(shape, mesh, rank);
        let block_len: u64 = block.iter().map(|&(_, len)| len).product();
        let update_spec = if grad_spec != param_spec {
            Some(grad_spec.clone())
        } else {
            (zero_stage >= 1).then(|| param_spec.with_rows_split(shape, mesh, &ZERO_AXES)).flatten()
        };
        let (update, gather) = match &update_spec {
            None => ((0, block_len), None),
            Some(spec) => {
                let Some(update) = contiguous_part(&block, &spec.region(shape, mesh, rank)) else {
                    return Err(Error::Malformed {
                        reason: format!("grad.{name} is not a contiguous part of its parameter's block"),
                    });
                };
                let axes: Vec<_> = spec.rows_split_beyond(param_spec).into_iter().map(|(_, axis)| axis).collect();
                let axis = axes.iter().map(|axis| axis.as_str()).collect::<Vec<_>>().join(",");
                let group = Group { axis, ranks: mesh.group_over(rank, &axes) };
                (update, Some(group))
            }
        };
        let region_of = |other: u32| match &update_spec {
            None => param_spec.region(shape, mesh, other),
            Some(spec) => spec.region(shape, mesh, other),
        };
        let mine = region_of(rank);
        let counts_in_norm = (0..rank).all(|other| region_of(other) != mine);
        params.push(ParamUpdate {
            name: name.to_string(),
            grad_output: index as u32,
            update,
            grad_is_slice: grad_spec != param_spec,
            counts_in_norm,
            gather,
        });
    }
    Ok(OptimizerLayout { params, world })
}

/// The optimizer layout of one rank's pipelined `program` (`pipeline::pipeline_programs`) for
/// `module`, the micro-batch's graph sharded over the mesh inside a stage: the inner rank's layout
/// kept to the parameters the rank's stage loads, its ZeRO gathers over the stage's own ranks (in
/// global ranks), and the world of every stage's ranks, `world_size` of them.
pub fn pipelined_optimizer_layout(
    module: &Module,
    program: &crate::Program,
    world_size: u32,
    zero_stage: u8,
) -> Result<OptimizerLayout> {
    let inner = module.mesh.world_size() as u32;
    let (stage, inner_rank) = (program.rank / inner, program.rank % inner);
    let loaded: Vec<&str> = program
        .instructions
        .iter()
        .filter_map(|instr| match instr {
            crate::Instr::LoadParam { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    let mut layout = optimizer_layout(module, inner_rank, zero_stage)?;
    layout.params.retain(|param| loaded.contains(&param.name.as_str()));
    for param in &mut layout.params {
        if let Some(group) = &mut param.gather {
            group.ranks = group.ranks.iter().map(|&rank| stage * inner + rank).collect();
        }
    }
    layout.world = Group { axis: "world".into(), ranks: (0..world_size).collect() };
    Ok(layout)
}

/// Whether `inner` is `outer` with only its first dim narrowed.
/// Where `inner` (per dim, `(start, len)` of the global tensor) lies in the row-major block `outer`,
/// as `(offset, len)` in elements, when it is one contiguous run of it: whole in every dim after
/// its last partial one, one element wide in every dim before that. `None` otherwise.
fn contiguous_part(outer: &[(u64, u64)], inner: &[(u64, u64)]) -> Option<(u64, u64)> {
    if outer.len() != inner.len() {
        return None;
    }
    let inside = outer.iter().zip(inner).all(|(&(o, olen), &(i, ilen))| i >= o && i + ilen <= o + olen);
    let last_partial = outer.iter().zip(inner).rposition(|(o, i)| o != i).unwrap_or(0);
    if !inside || inner[..last_partial].iter().any(|&(_, len)| len != 1) {
        return None;
    }
    let offset = outer.iter().zip(inner).fold(0, |offset, (&(o, olen), &(i, _))| offset * olen + (i - o));
    Some((offset, inner.iter().map(|&(_, len)| len).product()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::text::parse_module;

    /// A parameter `w` [ffn=8/tp, hidden=4] and its gradient laid out as `grad_spec`, on dp=2,tp=2
    /// (rank = 2·dp + tp), with `param_spec` for the parameter.
    fn module(param_spec: &str, grad_spec: &str) -> Module {
        module_on("dp=2,tp=2", param_spec, grad_spec)
    }

    fn module_on(mesh: &str, param_spec: &str, grad_spec: &str) -> Module {
        parse_module(&format!(
            "; module m mesh={mesh}\n\
             v0: f32[{param_spec}, hidden=4] = param() name=\"w\"   # n0 w\n\
             v1: f32[{grad_spec}, hidden=4] = sum_leading(v0) keep=2   # n1 grad.w\n\
             outputs(v1)\n"
        ))
        .expect("the case parses")
    }

    fn update(module: &Module, rank: u32, stage: u8) -> ParamUpdate {
        optimizer_layout(module, rank, stage).expect("a layout").params.remove(0)
    }

    #[test]
    fn stage_zero_updates_whole_blocks_and_counts_each_once() {
        let module = module("ffn=8/tp", "ffn=8/tp");
        for rank in 0..4 {
            let param = update(&module, rank, 0);
            assert_eq!((param.update, param.grad_is_slice, param.gather.is_none()), ((0, 16), false, true));
            // Ranks 0 and 2 (dp 0 and 1, tp 0) hold the same block: only rank 0 counts it.
            assert_eq!(param.counts_in_norm, rank < 2, "rank {rank}");
        }
    }

    #[test]
    fn zero_stages_update_the_dp_share_of_the_rows() {
        // Stage 1: the gradient is whole; the rank updates its dp half of its 4 rows (8 elements).
        let module1 = module("ffn=8/tp", "ffn=8/tp");
        // Stage 2: the gradient is already that half.
        let module2 = module("ffn=8/tp", "ffn=8/tp/dp");
        for rank in 0..4 {
            let dp = u64::from(rank / 2);
            let one = update(&module1, rank, 1);
            assert_eq!((one.update, one.grad_is_slice, one.counts_in_norm), ((dp * 8, 8), false, true));
            let two = update(&module2, rank, 2);
            assert_eq!((two.update, two.grad_is_slice), ((dp * 8, 8), true));
            for param in [one, two] {
                let group = param.gather.expect("the dp group gathers");
                assert_eq!(group.ranks, vec![rank % 2, rank % 2 + 2]);
            }
        }
        // Stage 3: the parameter is the share; nothing to gather.
        let module3 = module("ffn=8/tp/dp", "ffn=8/tp/dp");
        let three = update(&module3, 3, 3);
        assert_eq!((three.update, three.gather.is_none(), three.counts_in_norm), ((0, 8), true, true));
    }

    #[test]
    fn zero_shares_a_dense_parameter_over_dp_and_ep_and_an_expert_over_dp() {
        // dp=2, ep=2 (rank = 2·dp + ep). A dense `w` [8, 4] has four replicas: rank r updates rows
        // 2r and 2r+1 and gathers over all four, in block order. An expert weight ep splits
        // (rows 4·ep..) has two, over dp: the rank updates its dp half of its 4 rows.
        for (stage, grad) in [(1, "ffn=8"), (2, "ffn=8/dp/ep")] {
            let dense = module_on("dp=2,ep=2", "ffn=8", grad);
            for rank in 0..4 {
                let param = update(&dense, rank, stage);
                assert_eq!(
                    (param.update, param.grad_is_slice, param.counts_in_norm),
                    ((8 * u64::from(rank), 8), stage == 2, true)
                );
                let group = param.gather.expect("dp and ep gather");
                assert_eq!((group.axis.as_str(), group.ranks), ("dp,ep", vec![0, 1, 2, 3]), "rank {rank}");
            }
        }
        let expert = module_on("dp=2,ep=2", "ffn=8/ep", "ffn=8/ep");
        for rank in 0..4 {
            let param = update(&expert, rank, 1);
            assert_eq!(param.update, (8 * u64::from(rank / 2), 8), "rank {rank}");
            let group = param.gather.expect("dp gathers");
            assert_eq!((group.axis.as_str(), group.ranks), ("dp", vec![rank % 2, rank % 2 + 2]));
        }
    }

    #[test]
    fn a_gradient_that_is_not_a_row_block_is_an_error() {
        let module = module("ffn=8/tp", "ffn=8");
        let error = optimizer_layout(&module, 0, 0).unwrap_err();
        assert!(error.to_string().contains("grad.w is not a contiguous part"), "{error}");
    }

    #[test]
    fn a_contiguous_part_is_rows_or_a_run_inside_one_row() {
        // A rank's block of k: 2 heads, head_dim 16, hidden 128.
        let block = [(0, 2), (0, 16), (0, 128)];
        // Its second head: rows; half of its first head's head_dim: a run inside one row.
        assert_eq!(contiguous_part(&block, &[(1, 1), (0, 16), (0, 128)]), Some((16 * 128, 16 * 128)));
        assert_eq!(contiguous_part(&block, &[(0, 1), (8, 8), (0, 128)]), Some((8 * 128, 8 * 128)));
        // Half of head_dim in both heads is two runs; a part outside the block none.
        assert_eq!(contiguous_part(&block, &[(0, 2), (0, 8), (0, 128)]), None);
        assert_eq!(contiguous_part(&block, &[(2, 1), (0, 16), (0, 128)]), None);
    }
}
