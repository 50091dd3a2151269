//! A small multi-rank simulator of `LayerLang` expressions, the oracle of the rules' numeric tests.
//!
//! It holds one local tensor per rank of a one-axis mesh. Compute ops run on each rank's local
//! blocks with the reference interpreter's `pleat_ir::interp::eval`; collectives are computed
//! across the ranks' tensors directly (sums, concatenations, blocks). `global` turns a value's
//! local tensors back into the global tensor its layout describes, and checks that replicated
//! copies agree, so two expressions can be compared whatever their layouts.

use std::collections::BTreeMap;

use egg::{Id, RecExpr, Symbol};
use pleat_ir::interp::{eval, Tensor};
use pleat_ir::{DType, Mesh, Op};

use super::analysis::{node_meta, Meta, TensorMeta};
use super::language::{to_op, ChildKind, LayerLang, LeafTable};

/// Why a simulation failed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimulateError {
    /// The mesh is not one axis.
    #[error("the simulator runs one-axis meshes; got {axes} axes")]
    MeshAxes {
        /// The number of axes.
        axes: usize,
    },
    /// A node is ill-typed.
    #[error("node {index} is ill-typed: {reason}")]
    IllTyped {
        /// Its index in the expression.
        index: usize,
        /// Why.
        reason: String,
    },
    /// A tensor leaf has no input.
    #[error("no input for leaf {symbol}; give one tensor per rank")]
    MissingInput {
        /// The leaf.
        symbol: String,
    },
    /// An op the simulator does not run.
    #[error("the simulator cannot run {op}; test it with the interpreter")]
    Unsupported {
        /// The op's mnemonic.
        op: &'static str,
    },
    /// A local op failed.
    #[error("{op} failed on rank {rank}: {reason}")]
    Local {
        /// The op.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// The interpreter's error.
        reason: String,
    },
    /// Copies of a replicated value differ between ranks.
    #[error("rank {rank}'s copy of a replicated value differs from rank 0's by {diff}")]
    Diverged {
        /// The rank.
        rank: usize,
        /// The largest difference.
        diff: f32,
    },
}

/// A deterministic generator of values in `[-1, 1)` (a 64-bit LCG): tests need no `rand`.
pub struct Lcg(u64);

impl Lcg {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Lcg {
        Lcg(seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407))
    }
    /// The next value.
    pub fn next_value(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random local inputs for every tensor leaf of `leaves`: blocks of one random global tensor,
/// or for a pending sum one independent random summand a rank. `i32` leaves count up from 0
/// (positions).
pub fn random_inputs(leaves: &LeafTable, mesh: &Mesh, seed: u64) -> BTreeMap<Symbol, Vec<Tensor>> {
    let mut random = Lcg::new(seed);
    let ranks = mesh.world_size() as usize;
    let mut inputs = BTreeMap::new();
    for (symbol, ty, spec) in leaves.tensors() {
        let shape: Vec<usize> = ty.shape.sizes().iter().map(|&size| size as usize).collect();
        let numel: usize = shape.iter().product();
        let fill = |random: &mut Lcg, count: usize| -> Vec<f32> {
            if ty.dtype == DType::I32 {
                (0..count).map(|index| index as f32).collect()
            } else {
                (0..count).map(|_| random.next_value()).collect()
            }
        };
        let locals = if spec.partial.is_empty() {
            let global = Tensor { shape: shape.clone(), data: fill(&mut random, numel) };
            (0..ranks)
                .map(|rank| {
                    let region = spec.region(&ty.shape, mesh, rank as u32);
                    block(&global, &region)
                })
                .collect()
        } else {
            let local: Vec<usize> = spec
                .local_sizes(&ty.shape, mesh)
                .map(|sizes| sizes.iter().map(|&size| size as usize).collect())
                .unwrap_or_else(|_| shape.clone());
            let count = local.iter().product();
            (0..ranks).map(|_| Tensor { shape: local.clone(), data: fill(&mut random, count) }).collect()
        };
        inputs.insert(symbol, locals);
    }
    inputs
}

/// Runs `expr` on every rank of the one-axis `mesh`; returns the root's local tensors and facts.
pub fn simulate(
    expr: &RecExpr<LayerLang>,
    leaves: &LeafTable,
    mesh: &Mesh,
    inputs: &BTreeMap<Symbol, Vec<Tensor>>,
) -> Result<(Vec<Tensor>, TensorMeta), SimulateError> {
    if mesh.axes().len() != 1 {
        return Err(SimulateError::MeshAxes { axes: mesh.axes().len() });
    }
    let ranks = mesh.axes()[0].size as usize;
    let mut metas: Vec<Meta> = Vec::with_capacity(expr.len());
    let mut values: Vec<Vec<Tensor>> = Vec::with_capacity(expr.len());
    for (index, node) in expr.as_ref().iter().enumerate() {
        let meta = node_meta(node, |id| &metas[usize::from(id)], leaves, mesh);
        let locals = match (&meta, node) {
            (Meta::Invalid(reason), _) => return Err(SimulateError::IllTyped { index, reason: reason.clone() }),
            (Meta::Tensor(_), LayerLang::Symbol(symbol)) => inputs
                .get(symbol)
                .filter(|locals| locals.len() == ranks)
                .cloned()
                .ok_or_else(|| SimulateError::MissingInput { symbol: symbol.to_string() })?,
            (Meta::Tensor(_), _) => {
                let kind = |id: Id| match &metas[usize::from(id)] {
                    Meta::Axis(axis) => ChildKind::Axis(*axis),
                    Meta::Dim(dim) => ChildKind::Dim(*dim),
                    Meta::Attribute(op) => ChildKind::Attribute(op.clone()),
                    Meta::Tensor(_) => ChildKind::Tensor,
                    Meta::Invalid(_) => ChildKind::Other,
                };
                let (op, operands) = to_op(node, kind)
                    .ok_or_else(|| SimulateError::IllTyped { index, reason: "children of the wrong kinds".into() })?;
                let position =
                    |dim| metas[usize::from(operands[0])].tensor().and_then(|tensor| tensor.ty.shape.position(dim));
                let operand_values: Vec<&Vec<Tensor>> =
                    operands.iter().map(|&operand| &values[usize::from(operand)]).collect();
                run_op(&op, &operand_values, ranks, position)?
            }
            _ => Vec::new(),
        };
        metas.push(meta);
        values.push(locals);
    }
    let root = metas.pop().and_then(|meta| meta.tensor().cloned());
    match (values.pop(), root) {
        (Some(locals), Some(meta)) => Ok((locals, meta)),
        _ => Err(SimulateError::IllTyped { index: expr.len(), reason: "the root is not a tensor".into() }),
    }
}

/// One op on every rank. `position` finds a dim in operand 0.
fn run_op(
    op: &Op,
    operands: &[&Vec<Tensor>],
    ranks: usize,
    position: impl Fn(pleat_ir::DimName) -> Option<usize>,
) -> Result<Vec<Tensor>, SimulateError> {
    let x = operands[0];
    let dim = |name| position(name).ok_or(SimulateError::Unsupported { op: op.mnemonic() });
    Ok(match op {
        Op::AllReduce { .. } => vec![sum(x); ranks],
        Op::ReduceScatter { dim: name, .. } => {
            let total = sum(x);
            let at = dim(*name)?;
            (0..ranks).map(|rank| chunk(&total, at, ranks, rank)).collect()
        }
        Op::AllGather { dim: name, .. } => vec![concat(x, dim(*name)?); ranks],
        Op::LocalSlice { dim: name, .. } => {
            let at = dim(*name)?;
            (0..ranks).map(|rank| chunk(&x[rank], at, ranks, rank)).collect()
        }
        Op::AllToAll { split_dim, gather_dim, .. } => {
            let (split, gather) = (dim(*split_dim)?, dim(*gather_dim)?);
            (0..ranks)
                .map(|rank| {
                    let pieces: Vec<Tensor> = x.iter().map(|local| chunk(local, split, ranks, rank)).collect();
                    concat(&pieces, gather)
                })
                .collect()
        }
        Op::BroadcastShard { root, .. } => vec![x[*root as usize].clone(); ranks],
        Op::RingGatedMlp { .. } => {
            // Every shard passes every rank once: the whole weights (gate and up are [ffn, hidden],
            // down [hidden, ffn]) applied to the rank's own tokens.
            let whole = [concat(operands[1], 0), concat(operands[2], 0), concat(operands[3], 1)];
            (0..ranks)
                .map(|rank| {
                    eval(op, &[&x[rank], &whole[0], &whole[1], &whole[2]]).map_err(|error| SimulateError::Local {
                        op: op.mnemonic(),
                        rank,
                        reason: error.to_string(),
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Op::Zigzag { .. } | Op::Tokens | Op::Positions | Op::Param { .. } => {
            return Err(SimulateError::Unsupported { op: op.mnemonic() })
        }
        compute => (0..ranks)
            .map(|rank| {
                let locals: Vec<&Tensor> = operands.iter().map(|values| &values[rank]).collect();
                eval(compute, &locals).map_err(|error| SimulateError::Local {
                    op: compute.mnemonic(),
                    rank,
                    reason: error.to_string(),
                })
            })
            .collect::<Result<_, _>>()?,
    })
}

/// The global tensor of a value from its ranks' local tensors (one-axis mesh).
pub fn global(locals: &[Tensor], meta: &TensorMeta) -> Result<Tensor, SimulateError> {
    if !meta.spec.partial.is_empty() {
        return Ok(sum(locals));
    }
    if let Some(at) = meta.spec.dims.iter().position(|axes| !axes.is_empty()) {
        return Ok(concat(locals, at));
    }
    for (rank, local) in locals.iter().enumerate().skip(1) {
        let diff = local.max_abs_diff(&locals[0]).map_or(f32::INFINITY, |(_, diff)| diff);
        if diff > 1e-6 {
            return Err(SimulateError::Diverged { rank, diff });
        }
    }
    Ok(locals[0].clone())
}

/// The elementwise sum of the ranks' tensors, accumulated in f64.
fn sum(locals: &[Tensor]) -> Tensor {
    let mut total = vec![0.0_f64; locals[0].data.len()];
    for local in locals {
        for (acc, &value) in total.iter_mut().zip(&local.data) {
            *acc += f64::from(value);
        }
    }
    Tensor { shape: locals[0].shape.clone(), data: total.into_iter().map(|value| value as f32).collect() }
}

/// The sub-tensor `region` (per dim: start, len) of `tensor`.
fn block(tensor: &Tensor, region: &[(u64, u64)]) -> Tensor {
    let shape: Vec<usize> = region.iter().map(|&(_, len)| len as usize).collect();
    let numel: usize = shape.iter().product();
    let mut data = Vec::with_capacity(numel);
    for flat in 0..numel {
        let mut rest = flat;
        let mut source = 0;
        let mut stride = 1;
        let mut index = vec![0; shape.len()];
        for dim in (0..shape.len()).rev() {
            index[dim] = rest % shape[dim];
            rest /= shape[dim];
        }
        for dim in (0..shape.len()).rev() {
            source += (index[dim] + region[dim].0 as usize) * stride;
            stride *= tensor.shape[dim];
        }
        data.push(tensor.data[source]);
    }
    Tensor { shape, data }
}

/// Block `index` of `parts` equal blocks of `tensor` along `dim`.
fn chunk(tensor: &Tensor, dim: usize, parts: usize, index: usize) -> Tensor {
    let len = tensor.shape[dim] / parts;
    let region: Vec<(u64, u64)> = tensor
        .shape
        .iter()
        .enumerate()
        .map(|(at, &size)| if at == dim { ((index * len) as u64, len as u64) } else { (0, size as u64) })
        .collect();
    block(tensor, &region)
}

/// `tensors` side by side along `dim`.
fn concat(tensors: &[Tensor], dim: usize) -> Tensor {
    let mut shape = tensors[0].shape.clone();
    shape[dim] = tensors.iter().map(|tensor| tensor.shape[dim]).sum();
    let outer: usize = shape[..dim].iter().product();
    let mut data = Vec::with_capacity(shape.iter().product());
    for row in 0..outer {
        for tensor in tensors {
            let inner: usize = tensor.shape[dim..].iter().product();
            data.extend_from_slice(&tensor.data[row * inner..(row + 1) * inner]);
        }
    }
    Tensor { shape, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_concatenate_back() {
        let tensor = Tensor { shape: vec![2, 4, 3], data: (0..24).map(|value| value as f32).collect() };
        for dim in 0..2 {
            let parts: Vec<Tensor> = (0..2).map(|index| chunk(&tensor, dim, 2, index)).collect();
            assert_eq!(concat(&parts, dim), tensor);
        }
        // An independent reading: block 1 of dim 1 is rows 2..4 of each outer slice.
        assert_eq!(chunk(&tensor, 1, 2, 1).data, vec![6., 7., 8., 9., 10., 11., 18., 19., 20., 21., 22., 23.]);
    }
}
