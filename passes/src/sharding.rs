//! Sharding rules: the spec each op's output must have, given its inputs' specs.
//!
//! These are the per-op rules of the DTensor / GSPMD model. A rule either derives the output spec
//! (and then every rank may apply the op to its local blocks and get its block of the true result)
//! or says why the inputs' layouts do not fit together; propagation then inserts a collective and
//! the verifier reports the reason. Communication ops have rules too: they are the only ops whose
//! output spec differs from what their input allows locally.

use pleat_ir::{AxisName, DimName, Graph, NodeData, Op, Shape, ShardSpec};

/// Why an op cannot run locally on its inputs' layouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conflict {
    /// Operand `operand` is a pending sum over `axes`, which the op cannot take (it is not linear
    /// in that operand); an all-reduce must come first.
    PartialInput {
        /// The operand index.
        operand: usize,
        /// The pending axes.
        axes: Vec<AxisName>,
    },
    /// The activation (operand 0) of a product is split on `dim` over `axis`, which the weight also
    /// splits: the activation must be all-gathered on `dim` first (sequence parallelism's gather
    /// before a column-parallel projection).
    SplitActivation {
        /// The activation's split dim.
        dim: DimName,
        /// The axis both sides use.
        axis: AxisName,
    },
    /// Any other mismatch, in words.
    Layout(String),
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conflict::PartialInput { operand, axes } => {
                let axes: Vec<&str> = axes.iter().map(|axis| axis.as_str()).collect();
                write!(f, "operand {operand} is Partial({}) and this op needs it summed first", axes.join(","))
            }
            Conflict::SplitActivation { dim, axis } => {
                write!(
                    f,
                    "the activation's {dim} is split over {axis}, which the weight also splits; all-gather it first"
                )
            }
            Conflict::Layout(reason) => f.write_str(reason),
        }
    }
}

fn axes_text(axes: &[AxisName]) -> String {
    if axes.is_empty() {
        "replicated".to_string()
    } else {
        axes.iter().map(|axis| axis.as_str()).collect::<Vec<_>>().join("/")
    }
}

fn dim_axes<'a>(spec: &'a ShardSpec, shape: &Shape, name: DimName) -> &'a [AxisName] {
    shape.position(name).map_or(&[], |position| spec.dim_axes(position))
}

fn no_partial(specs: &[&ShardSpec], operands: &[usize]) -> Result<(), Conflict> {
    for &operand in operands {
        if !specs[operand].partial.is_empty() {
            return Err(Conflict::PartialInput { operand, axes: specs[operand].partial.clone() });
        }
    }
    Ok(())
}

fn same_dim(
    specs: &[&ShardSpec],
    shapes: &[&Shape],
    (left, right): (usize, usize),
    (left_dim, right_dim): (DimName, DimName),
) -> Result<(), Conflict> {
    let left_axes = dim_axes(specs[left], shapes[left], left_dim);
    let right_axes = dim_axes(specs[right], shapes[right], right_dim);
    if left_axes == right_axes {
        Ok(())
    } else {
        Err(Conflict::Layout(format!(
            "operand {left} {left_dim} is {} but operand {right} {right_dim} is {}",
            axes_text(left_axes),
            axes_text(right_axes)
        )))
    }
}

fn replicated_dim(
    specs: &[&ShardSpec],
    shapes: &[&Shape],
    operand: usize,
    dim: DimName,
    why: &str,
) -> Result<(), Conflict> {
    let axes = dim_axes(specs[operand], shapes[operand], dim);
    if axes.is_empty() {
        Ok(())
    } else {
        Err(Conflict::Layout(format!("operand {operand} {dim} is split over {} but {why}", axes_text(axes))))
    }
}

/// The output spec of `node` given its operands' specs and shapes, or the conflict.
/// Leaf ops (inputs and params) have no rule: their specs are seeded by a strategy.
pub fn output_spec(
    node: &NodeData,
    specs: &[&ShardSpec],
    shapes: &[&Shape],
    out: &Shape,
) -> Result<ShardSpec, Conflict> {
    use DimName::*;
    match &node.op {
        Op::Tokens | Op::Positions | Op::Param { .. } => Err(Conflict::Layout("a leaf has no sharding rule".into())),
        Op::Embedding => {
            // (table[vocab, hidden], tokens[batch, seq]): a vocab-split table gives each rank the rows
            // it owns and zeros elsewhere, so the result is a pending sum (Megatron's
            // VocabParallelEmbedding).
            no_partial(specs, &[0, 1])?;
            let mut spec = ShardSpec::replicated(out.rank());
            spec.dims[0] = dim_axes(specs[1], shapes[1], Batch).to_vec();
            spec.dims[1] = dim_axes(specs[1], shapes[1], Seq).to_vec();
            spec.dims[2] = dim_axes(specs[0], shapes[0], Hidden).to_vec();
            spec.partial = dim_axes(specs[0], shapes[0], Vocab).to_vec();
            Ok(spec)
        }
        Op::RmsNorm { .. } => {
            no_partial(specs, &[0, 1])?;
            replicated_dim(specs, shapes, 0, Hidden, "rms_norm reduces over hidden")?;
            replicated_dim(specs, shapes, 1, Hidden, "rms_norm's weight must be whole")?;
            Ok(specs[0].clone())
        }
        Op::MatMul { contract } => matmul_spec(*contract as usize, specs, shapes, out),
        Op::Rope { .. } => {
            no_partial(specs, &[0, 1])?;
            replicated_dim(specs, shapes, 0, HeadDim, "rope rotates pairs across head_dim")?;
            same_dim(specs, shapes, (0, 1), (Seq, Seq))?;
            Ok(specs[0].clone())
        }
        Op::Attention { .. } => attention_spec(specs, shapes),
        // The loss and the backward ops have rules only for whole operands until sharded training
        // derives theirs; a sharded operand is a conflict, never a silent wrong layout.
        Op::CrossEntropy
        | Op::CrossEntropyGrad
        | Op::MatMulGradInput { .. }
        | Op::MatMulGradWeight { .. }
        | Op::RmsNormGradInput { .. }
        | Op::RmsNormGradWeight { .. }
        | Op::RopeGrad { .. }
        | Op::AttentionGradQuery { .. }
        | Op::AttentionGradKey { .. }
        | Op::AttentionGradValue { .. }
        | Op::SiluMulGradGate
        | Op::EmbeddingGrad { .. }
        | Op::SumLeading { .. } => match specs.iter().position(|spec| !spec.is_replicated()) {
            None => Ok(ShardSpec::replicated(out.rank())),
            Some(operand) => Err(Conflict::Layout(format!(
                "operand {operand} is sharded, and {} has a rule for replicated operands only; differentiate \
                 the unsharded graph",
                node.op.mnemonic()
            ))),
        },
        Op::SiluMul => {
            no_partial(specs, &[0, 1])?;
            if specs[0] != specs[1] {
                return Err(Conflict::Layout("gate and up are laid out differently".into()));
            }
            Ok(specs[0].clone())
        }
        Op::Add => {
            // Pending sums first: summing one (all-reduce or reduce-scatter) may fix the layout too.
            if specs[0].partial != specs[1].partial {
                if specs[0].partial.is_empty() {
                    return Err(Conflict::PartialInput { operand: 1, axes: specs[1].partial.clone() });
                }
                return Err(Conflict::PartialInput { operand: 0, axes: specs[0].partial.clone() });
            }
            // A bias (trailing dims of the first operand) must be laid out as those dims are.
            let offset = shapes[0].rank() - shapes[1].rank();
            for (index, axes) in specs[1].dims.iter().enumerate() {
                if *axes != specs[0].dims[offset + index] {
                    return Err(Conflict::Layout(format!(
                        "operand 0 {} is {} but operand 1 has it {}",
                        shapes[1].dims()[index].name,
                        axes_text(&specs[0].dims[offset + index]),
                        axes_text(axes)
                    )));
                }
            }
            Ok(specs[0].clone())
        }
        Op::AllReduce { axis } => {
            let mut spec = specs[0].clone();
            let Some(position) = spec.partial.iter().position(|partial| partial == axis) else {
                return Err(Conflict::Layout(format!(
                    "all_reduce over {axis} needs an operand that is Partial({axis})"
                )));
            };
            spec.partial.remove(position);
            Ok(spec)
        }
        Op::ReduceScatter { axis, dim } => {
            let mut spec = specs[0].clone();
            let Some(position) = spec.partial.iter().position(|partial| partial == axis) else {
                return Err(Conflict::Layout(format!(
                    "reduce_scatter over {axis} needs an operand that is Partial({axis})"
                )));
            };
            spec.partial.remove(position);
            let dim_index = dim_position(shapes[0], *dim)?;
            spec.dims[dim_index].push(*axis);
            Ok(spec)
        }
        Op::AllGather { axis, dim } => {
            let mut spec = specs[0].clone();
            let dim_index = dim_position(shapes[0], *dim)?;
            if spec.dims[dim_index].last() != Some(axis) {
                return Err(Conflict::Layout(format!(
                    "all_gather over {axis} needs {dim} split over {axis} innermost, but it is {}",
                    axes_text(&spec.dims[dim_index])
                )));
            }
            spec.dims[dim_index].pop();
            Ok(spec)
        }
        Op::BroadcastShard { axis, dim, .. } => {
            no_partial(specs, &[0])?;
            let mut spec = specs[0].clone();
            let dim_index = dim_position(shapes[0], *dim)?;
            if spec.dims[dim_index].last() != Some(axis) {
                return Err(Conflict::Layout(format!(
                    "broadcast_shard over {axis} needs {dim} split over {axis} innermost, but it is {}",
                    axes_text(&spec.dims[dim_index])
                )));
            }
            spec.dims[dim_index].pop();
            Ok(spec)
        }
        Op::Zigzag { .. } => {
            replicated_dim(specs, shapes, 0, Seq, "zigzag reorders the whole sequence")?;
            Ok(specs[0].clone())
        }
        Op::RingGatedMlp { axis } => {
            no_partial(specs, &[0, 1, 2, 3])?;
            replicated_dim(specs, shapes, 0, Hidden, "the MLP contracts hidden")?;
            for operand in 1..4 {
                replicated_dim(specs, shapes, operand, Hidden, "the ring moves whole rows of hidden")?;
                let ffn = dim_axes(specs[operand], shapes[operand], Ffn);
                if ffn != [*axis] {
                    return Err(Conflict::Layout(format!(
                        "operand {operand} ffn is {} but the ring over {axis} needs it split over {axis} alone",
                        axes_text(ffn)
                    )));
                }
            }
            Ok(specs[0].clone())
        }
        Op::RingAttention { axis, .. } => ring_attention_spec(*axis, specs, shapes),
        Op::LocalSlice { axis, dim } => {
            let mut spec = specs[0].clone();
            if spec.uses_axis(*axis) {
                return Err(Conflict::Layout(format!(
                    "local_slice over {axis} needs an operand replicated over {axis}"
                )));
            }
            let dim_index = dim_position(shapes[0], *dim)?;
            spec.dims[dim_index].push(*axis);
            Ok(spec)
        }
        Op::AllToAll { axis, split_dim, gather_dim } => {
            no_partial(specs, &[0])?;
            let mut spec = specs[0].clone();
            let gather_index = dim_position(shapes[0], *gather_dim)?;
            let split_index = dim_position(shapes[0], *split_dim)?;
            if spec.dims[gather_index].last() != Some(axis) {
                return Err(Conflict::Layout(format!(
                    "all_to_all over {axis} needs {gather_dim} split over {axis} innermost, but it is {}",
                    axes_text(&spec.dims[gather_index])
                )));
            }
            spec.dims[gather_index].pop();
            if spec.uses_axis(*axis) {
                return Err(Conflict::Layout(format!(
                    "all_to_all over {axis} needs {split_dim} and every other dim free of {axis}"
                )));
            }
            spec.dims[split_index].push(*axis);
            Ok(spec)
        }
    }
}

fn dim_position(shape: &Shape, dim: DimName) -> Result<usize, Conflict> {
    shape.position(dim).ok_or_else(|| Conflict::Layout(format!("the operand has no dim {dim}")))
}

/// `x[F.., C..] · w[G.., C..]`: contracted dims split the same way on both sides make the result a
/// pending sum over those axes; free dims keep their splits; a pending sum in one operand passes
/// through (the product is linear in each operand).
fn matmul_spec(contract: usize, specs: &[&ShardSpec], shapes: &[&Shape], out: &Shape) -> Result<ShardSpec, Conflict> {
    let (x_rank, w_rank) = (shapes[0].rank(), shapes[1].rank());
    if !specs[0].partial.is_empty() && !specs[1].partial.is_empty() {
        return Err(Conflict::PartialInput { operand: 1, axes: specs[1].partial.clone() });
    }
    let mut spec = ShardSpec::replicated(out.rank());
    spec.partial = specs[0].partial.iter().chain(&specs[1].partial).copied().collect();
    for index in 0..contract {
        let x_axes = specs[0].dim_axes(x_rank - contract + index);
        let w_axes = specs[1].dim_axes(w_rank - contract + index);
        if x_axes != w_axes {
            return Err(Conflict::Layout(format!(
                "contracted dim {} is {} in the activation but {} in the weight",
                shapes[0].dims()[x_rank - contract + index].name,
                axes_text(x_axes),
                axes_text(w_axes)
            )));
        }
        spec.partial.extend_from_slice(x_axes);
    }
    let free: Vec<&Vec<AxisName>> =
        specs[0].dims[..x_rank - contract].iter().chain(&specs[1].dims[..w_rank - contract]).collect();
    for (index, axes) in free.into_iter().enumerate() {
        spec.dims[index] = axes.clone();
    }
    let weight_axes: Vec<AxisName> =
        specs[1].dims.iter().flatten().chain(&specs[1].partial).chain(spec.partial.iter()).copied().collect();
    for (index, axes) in specs[0].dims[..x_rank - contract].iter().enumerate() {
        if let Some(&axis) = axes.iter().find(|axis| weight_axes.contains(axis)) {
            return Err(Conflict::SplitActivation { dim: shapes[0].dims()[index].name, axis });
        }
    }
    let mut seen: Vec<AxisName> = Vec::new();
    for &axis in spec.dims.iter().flatten().chain(&spec.partial) {
        if seen.contains(&axis) {
            return Err(Conflict::Layout(format!(
                "axis {axis} would split two dims of the product at once; all-gather one operand first"
            )));
        }
        seen.push(axis);
    }
    Ok(spec)
}

/// Queries may be split on batch, seq and heads; keys and values must hold every position of the
/// sequences their queries see, and either the kv heads those query heads read (split on the same
/// axes) or all of them (replicated, as grouped-query attention needs when an axis outnumbers the
/// kv heads).
fn attention_spec(specs: &[&ShardSpec], shapes: &[&Shape]) -> Result<ShardSpec, Conflict> {
    use DimName::*;
    no_partial(specs, &[0, 1, 2, 3, 4])?;
    if specs[1] != specs[2] {
        return Err(Conflict::Layout("keys and values are laid out differently".into()));
    }
    for operand in 0..3 {
        replicated_dim(specs, shapes, operand, HeadDim, "attention contracts head_dim")?;
    }
    same_dim(specs, shapes, (0, 1), (Batch, Batch))?;
    same_dim(specs, shapes, (0, 3), (Seq, Seq))?;
    same_dim(specs, shapes, (1, 4), (Seq, Seq))?;
    replicated_dim(specs, shapes, 1, Seq, "every query needs all keys; all-gather keys and values on seq first")?;
    let kv_axes = dim_axes(specs[1], shapes[1], KvHeads);
    if !kv_axes.is_empty() {
        same_dim(specs, shapes, (0, 1), (Heads, KvHeads))?;
    }
    Ok(specs[0].clone())
}

/// Ring attention: queries, keys, values and both position lists split on seq over `axis` alone
/// (each rank holds one block of the sequence and the ring brings it every other block); batch and
/// heads split as plain attention allows (data and tensor parallelism around it).
fn ring_attention_spec(axis: AxisName, specs: &[&ShardSpec], shapes: &[&Shape]) -> Result<ShardSpec, Conflict> {
    use DimName::*;
    no_partial(specs, &[0, 1, 2, 3, 4])?;
    if specs[1] != specs[2] {
        return Err(Conflict::Layout("keys and values are laid out differently".into()));
    }
    for operand in 0..3 {
        replicated_dim(specs, shapes, operand, HeadDim, "attention contracts head_dim")?;
    }
    same_dim(specs, shapes, (0, 1), (Batch, Batch))?;
    for (operand, dim) in [(0, Seq), (1, Seq), (3, Seq), (4, Seq)] {
        let axes = dim_axes(specs[operand], shapes[operand], dim);
        if axes != [axis] {
            return Err(Conflict::Layout(format!(
                "operand {operand} seq is {} but the ring over {axis} needs it split over {axis} alone",
                axes_text(axes)
            )));
        }
    }
    for operand in 0..5 {
        let split_elsewhere = specs[operand]
            .dims
            .iter()
            .zip(shapes[operand].dims())
            .any(|(axes, dim)| dim.name != Seq && axes.contains(&axis));
        if split_elsewhere {
            return Err(Conflict::Layout(format!("operand {operand} uses {axis} on a dim other than seq")));
        }
    }
    let kv_axes = dim_axes(specs[1], shapes[1], KvHeads);
    if !kv_axes.is_empty() {
        same_dim(specs, shapes, (0, 1), (Heads, KvHeads))?;
    }
    Ok(specs[0].clone())
}

/// Checks `graph`'s stored spec of `node`'s result against its rule; leaves always pass.
pub fn check_node(graph: &Graph, node: &NodeData) -> Result<(), String> {
    if node.op.arity() == 0 {
        return Ok(());
    }
    let specs: Vec<&ShardSpec> = node.inputs.iter().map(|&input| &graph.value(input).spec).collect();
    let shapes: Vec<&Shape> = node.inputs.iter().map(|&input| &graph.value(input).ty.shape).collect();
    let result = graph.value(node.result);
    match output_spec(node, &specs, &shapes, &result.ty.shape) {
        Ok(expected) if expected == result.spec => Ok(()),
        Ok(expected) => Err(format!(
            "its spec should be {} by the {} rule",
            spec_text(&expected, &result.ty.shape),
            node.op.mnemonic()
        )),
        Err(conflict) => Err(conflict.to_string()),
    }
}

/// A spec in words, for messages: `[batch, seq/tp, hidden] partial(dp)`.
pub fn spec_text(spec: &ShardSpec, shape: &Shape) -> String {
    let dims: Vec<String> = shape
        .dims()
        .iter()
        .zip(&spec.dims)
        .map(|(dim, axes)| {
            let mut text = dim.name.to_string();
            for axis in axes {
                text.push('/');
                text.push_str(axis.as_str());
            }
            text
        })
        .collect();
    let mut text = format!("[{}]", dims.join(", "));
    if !spec.partial.is_empty() {
        text.push_str(&format!(" partial({})", axes_text(&spec.partial).replace('/', ",")));
    }
    text
}
