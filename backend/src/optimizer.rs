//! The optimizer's layout: which elements of each parameter a rank updates, and how the updated
//! blocks are shared again.
//!
//! A training module's outputs are the loss and one `grad.<name>` a parameter, each laid out as
//! the backward graph left it: as the parameter, or (ZeRO-2) further split over `dp` on the first
//! dim. `optimizer_layout` turns that, and the ZeRO stage, into one `ParamUpdate` a parameter for a
//! rank: the rows of the rank's parameter block it updates (and keeps optimizer state for), the
//! gradient output that covers them, and the group that all-gathers the updated rows when the rank
//! holds more of the parameter than it updates (ZeRO-1 and 2). ZeRO splits a parameter on its first
//! dim, so a rank's rows are contiguous in its row-major block. The runtime applies it without
//! knowing meshes or specs.

use pleat_ir::{AxisName, Module, Op};
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
        let row_len = block_len / block[0].1.max(1);
        let update_spec = if grad_spec != param_spec {
            Some(grad_spec.clone())
        } else {
            let value = graph.value(param);
            (zero_stage >= 1).then(|| value.spec.with_rows_split(&value.ty.shape, mesh, AxisName::Dp)).flatten()
        };
        let (update, gather) = match &update_spec {
            None => ((0, block_len), None),
            Some(spec) => {
                let rows = spec.region(shape, mesh, rank)[0];
                if !is_row_slice(&block, &spec.region(shape, mesh, rank)) {
                    return Err(Error::Malformed {
                        reason: format!("grad.{name} is not a block of rows of its parameter's block"),
                    });
                }
                let start = (rows.0 - block[0].0) * row_len;
                let group = Group { axis: AxisName::Dp.to_string(), ranks: mesh.group(rank, AxisName::Dp) };
                ((start, rows.1 * row_len), Some(group))
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

/// Whether `inner` is `outer` with only its first dim narrowed.
fn is_row_slice(outer: &[(u64, u64)], inner: &[(u64, u64)]) -> bool {
    outer.len() == inner.len()
        && outer[1..] == inner[1..]
        && inner[0].0 >= outer[0].0
        && inner[0].0 + inner[0].1 <= outer[0].0 + outer[0].1
}
