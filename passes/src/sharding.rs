//! Sharding rules: the spec each op's output must have, given its inputs' specs.
//!
//! These are the per-op rules of the DTensor / GSPMD model. A rule either derives the output spec
//! (and then every rank may apply the op to its local blocks and get its block of the true result)
//! or says why the inputs' layouts do not fit together; propagation then inserts a collective and
//! the verifier reports the reason. Communication ops have rules too: they are the only ops whose
//! output spec differs from what their input allows locally.

use pleat_ir::{AxisName, DimName, Graph, MlpOperand, MoeOperand, NodeData, Op, Shape, ShardSpec};

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
    /// Operand `operand` is a pending sum over `axis`, and the other operand of an elementwise op
    /// splits `dim` over `axis` (innermost) where this one holds it whole: reduce-scatter it on
    /// `dim` (the combine of expert parallelism's all-gather dispatch).
    ScatterPartial {
        /// The operand index.
        operand: usize,
        /// The pending axis.
        axis: AxisName,
        /// The dim the other operand splits over `axis`.
        dim: DimName,
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
            Conflict::ScatterPartial { operand, axis, dim } => write!(
                f,
                "operand {operand} is Partial({axis}) and the other operand splits {dim} over {axis}; \
                 reduce-scatter it on {dim}"
            ),
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
        Op::CrossEntropy => {
            loss_operands(specs, shapes)?;
            // Each rank's loss is its rows' sum over the global count of targets: a pending sum over
            // the axes that split the batch.
            let mut spec = ShardSpec::replicated(out.rank());
            spec.partial = dim_axes(specs[0], shapes[0], Batch).to_vec();
            Ok(spec)
        }
        Op::CrossEntropyGrad => {
            loss_operands(specs, shapes)?;
            Ok(specs[0].clone())
        }
        Op::VocabParallelCrossEntropy { axis } => {
            vocab_parallel_loss_operands(*axis, specs, shapes)?;
            // Every rank of `axis` combines the same row statistics: the loss is whole on `axis`.
            let mut spec = ShardSpec::replicated(out.rank());
            spec.partial = dim_axes(specs[0], shapes[0], Batch).to_vec();
            Ok(spec)
        }
        Op::VocabParallelCrossEntropyGrad { axis } => {
            vocab_parallel_loss_operands(*axis, specs, shapes)?;
            Ok(specs[0].clone())
        }
        Op::MatMulGradInput { contract } => {
            // dy[F.., G..] · w[G.., C..] -> dx[F.., C..], contracting G.
            let contract = *contract as usize;
            let g = shapes[1].rank() - contract;
            let f = shapes[0].rank() - g;
            let dy_labels: Vec<Label> = (0..f).map(Label::Out).chain((0..g).map(Label::Sum)).collect();
            let w_labels: Vec<Label> = (0..g).map(Label::Sum).chain((0..contract).map(|i| Label::Out(f + i))).collect();
            contraction_spec(specs, shapes, out, [&dy_labels, &w_labels])
        }
        Op::MatMulGradWeight { contract } => {
            // dy[F.., G..] · x[F.., C..] -> dw[G.., C..], contracting F.
            let contract = *contract as usize;
            let f = shapes[1].rank() - contract;
            let g = shapes[0].rank() - f;
            let dy_labels: Vec<Label> = (0..f).map(Label::Sum).chain((0..g).map(Label::Out)).collect();
            let x_labels: Vec<Label> = (0..f).map(Label::Sum).chain((0..contract).map(|i| Label::Out(g + i))).collect();
            contraction_spec(specs, shapes, out, [&dy_labels, &x_labels])
        }
        Op::RmsNormGradInput { .. } => {
            // (x, w, dy): row-local like the forward op.
            no_partial(specs, &[0, 1, 2])?;
            replicated_dim(specs, shapes, 0, Hidden, "rms_norm reduces over hidden")?;
            replicated_dim(specs, shapes, 1, Hidden, "rms_norm's weight must be whole")?;
            same_spec(specs, (0, 2), "x and dy")?;
            Ok(specs[0].clone())
        }
        Op::RmsNormGradInputAdd { .. } => {
            // (x, w, dy, acc): the gradient's rule, and the sum laid out as the gradient.
            no_partial(specs, &[0, 1, 2, 3])?;
            replicated_dim(specs, shapes, 0, Hidden, "rms_norm reduces over hidden")?;
            replicated_dim(specs, shapes, 1, Hidden, "rms_norm's weight must be whole")?;
            same_spec(specs, (0, 2), "x and dy")?;
            same_spec(specs, (0, 3), "x and the gradient added")?;
            Ok(specs[0].clone())
        }
        Op::Sum { .. } => {
            // Elementwise over operands laid out alike: pending sums stay pending.
            if let Some(index) = specs.iter().position(|spec| *spec != specs[0]) {
                return Err(Conflict::Layout(format!(
                    "operand {index} is laid out differently from operand 0; a sum's operands share one layout"
                )));
            }
            Ok(specs[0].clone())
        }
        Op::RmsNormGradWeight { .. } => {
            // (x, dy) -> [hidden]: a sum over the rows, pending over the axes that split them.
            no_partial(specs, &[0, 1])?;
            replicated_dim(specs, shapes, 0, Hidden, "rms_norm reduces over hidden")?;
            same_spec(specs, (0, 1), "x and dy")?;
            let mut spec = ShardSpec::replicated(out.rank());
            spec.partial = specs[0].dims.iter().flatten().copied().collect();
            Ok(spec)
        }
        Op::RopeGrad { .. } => {
            no_partial(specs, &[0, 1])?;
            replicated_dim(specs, shapes, 0, HeadDim, "rope rotates pairs across head_dim")?;
            same_dim(specs, shapes, (0, 1), (Seq, Seq))?;
            Ok(specs[0].clone())
        }
        Op::AttentionGradQuery { .. } | Op::AttentionGradKey { .. } | Op::AttentionGradValue { .. } => {
            // (q, k, v, q_positions, k_positions, dy): the forward layouts, dy laid out as the output.
            let query = attention_spec(&specs[..5], &shapes[..5])?;
            no_partial(specs, &[5])?;
            if *specs[5] != query {
                return Err(Conflict::Layout("dy is laid out differently from the attention output".into()));
            }
            if matches!(node.op, Op::AttentionGradQuery { .. }) {
                return Ok(query);
            }
            // Grouped-query attention with whole kv heads on ranks that split the query heads: each
            // rank's key/value gradient holds its query heads' contributions only.
            // Likewise keys and values whole on seq (every rank's queries see all of them) while the
            // queries are split on seq: each rank's gradient holds its queries' contributions.
            let mut spec = specs[1].clone();
            spec.partial = [(Heads, KvHeads), (Seq, Seq)]
                .iter()
                .flat_map(|&(query_dim, kv_dim)| {
                    let kv = dim_axes(specs[1], shapes[1], kv_dim);
                    dim_axes(specs[0], shapes[0], query_dim).iter().filter(move |axis| !kv.contains(axis)).copied()
                })
                .collect();
            Ok(spec)
        }
        Op::SiluMulGradGate => {
            no_partial(specs, &[0, 1, 2])?;
            same_spec(specs, (0, 1), "gate and up")?;
            same_spec(specs, (0, 2), "gate and dy")?;
            Ok(specs[0].clone())
        }
        Op::EmbeddingGrad { .. } => {
            // (dy[batch, seq, hidden], tokens[batch, seq]) -> [vocab, hidden]: rows scattered by token,
            // pending over the axes that split the tokens. The whole table's gradient on every rank:
            // matching a vocab-split table is a slice of it.
            no_partial(specs, &[0, 1])?;
            same_dim(specs, shapes, (0, 1), (Batch, Batch))?;
            same_dim(specs, shapes, (0, 1), (Seq, Seq))?;
            let mut spec = ShardSpec::replicated(out.rank());
            spec.dims[1] = dim_axes(specs[0], shapes[0], Hidden).to_vec();
            spec.partial = [Batch, Seq].iter().flat_map(|&dim| dim_axes(specs[0], shapes[0], dim).to_vec()).collect();
            Ok(spec)
        }
        Op::SumLeading { keep } => {
            // Leading dims are summed away: their splits become pending sums.
            let lead = shapes[0].rank() - *keep as usize;
            let mut spec = ShardSpec::replicated(out.rank());
            spec.dims = specs[0].dims[lead..].to_vec();
            spec.partial = specs[0].partial.iter().chain(specs[0].dims[..lead].iter().flatten()).copied().collect();
            Ok(spec)
        }
        Op::ExpertCounts { .. } | Op::RouterProbSum => {
            // A sum over the rows with the whole router: pending over the axes that split them.
            no_partial(specs, &[0, 1])?;
            replicated_dim(specs, shapes, 0, Hidden, "the router contracts hidden")?;
            if specs[1].dims.iter().any(|axes| !axes.is_empty()) {
                return Err(Conflict::Layout("the router must be whole to route every row".into()));
            }
            let mut spec = ShardSpec::replicated(out.rank());
            spec.partial = specs[0].dims.iter().flatten().copied().collect();
            Ok(spec)
        }
        Op::RouterProbSumGrad { wrt } => {
            // (x, router, dy[experts]): x's rows keep their splits; the router's gradient sums them.
            let forward = NodeData { op: Op::RouterProbSum, ..node.clone() };
            let sums = output_spec(&forward, &specs[..2], &shapes[..2], shapes[2])?;
            no_partial(specs, &[2])?;
            if specs[2].dims != sums.dims {
                return Err(Conflict::Layout("dy is laid out differently from the probability sums".into()));
            }
            match wrt {
                MoeOperand::Router => {
                    Ok(ShardSpec { partial: sums.partial, ..ShardSpec::replicated(shapes[1].rank()) })
                }
                _ => Ok(specs[0].clone()),
            }
        }
        Op::LoadBalancingLoss => {
            // A product of the two sums: both must be summed first.
            no_partial(specs, &[0, 1])?;
            Ok(ShardSpec::replicated(0))
        }
        Op::SigmoidScale => {
            // Linear in y: a pending sum of y passes through; each row's gate must be whole.
            no_partial(specs, &[0])?;
            let rows = specs[1].dims.len() - 1;
            if specs[0].dims[..] != specs[1].dims[..rows] {
                return Err(Conflict::Layout("the gates are laid out differently from y's rows".into()));
            }
            Ok(specs[1].clone())
        }
        Op::SigmoidScaleGradGate => {
            // (gate, y, dy) -> [rows]: a sum over hidden of dy * y, pending where y is or where hidden is
            // split.
            no_partial(specs, &[0, 2])?;
            let rows = specs[1].dims.len() - 1;
            if specs[0].dims[..] != specs[1].dims[..rows] || specs[1].dims != specs[2].dims {
                return Err(Conflict::Layout("the gates, y and dy are laid out differently".into()));
            }
            let mut spec = specs[0].clone();
            spec.partial = specs[1].partial.iter().chain(&specs[1].dims[rows]).copied().collect();
            each_axis_once(spec)
        }
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
                if let Some(conflict) = scatter_partial(specs, shapes) {
                    return Err(conflict);
                }
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
        Op::ReduceToRoot { axis, dim, .. } => {
            // The root's sum becomes its block of `dim`; the other ranks' blocks are zero.
            let mut spec = specs[0].clone();
            let Some(position) = spec.partial.iter().position(|partial| partial == axis) else {
                return Err(Conflict::Layout(format!(
                    "reduce_to_root over {axis} needs an operand that is Partial({axis})"
                )));
            };
            spec.partial.remove(position);
            let dim_index = dim_position(shapes[0], *dim)?;
            if spec.uses_axis(*axis) {
                return Err(Conflict::Layout(format!("reduce_to_root over {axis} needs {axis} unused by the operand")));
            }
            spec.dims[dim_index].push(*axis);
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
        Op::RingGatedMlpGrad { axis, wrt } => {
            // (x, gate, up, down, dy): the forward's layouts, dy laid out as its output.
            let forward = NodeData { op: Op::RingGatedMlp { axis: *axis }, ..node.clone() };
            let output = output_spec(&forward, &specs[..4], &shapes[..4], shapes[0])?;
            no_partial(specs, &[4])?;
            if *specs[4] != output {
                return Err(Conflict::Layout("dy is laid out differently from the MLP output".into()));
            }
            if *wrt == MlpOperand::Input {
                return Ok(output);
            }
            // A shard's gradient sums the rows of every rank it visits: those rows must differ, so
            // the ring's axis splits them. Other axes splitting the rows leave a pending sum.
            let row_dims = &shapes[0].dims()[..shapes[0].rank() - 1];
            let row_axes: Vec<AxisName> =
                row_dims.iter().flat_map(|dim| dim_axes(specs[0], shapes[0], dim.name)).copied().collect();
            if !row_axes.contains(axis) {
                return Err(Conflict::Layout(format!(
                    "the ring's weight gradients sum the rows of every rank on {axis}, but x's rows are not split over {axis}"
                )));
            }
            let mut spec = specs[wrt.index()].clone();
            spec.partial = row_axes.into_iter().filter(|row_axis| row_axis != axis).collect();
            Ok(spec)
        }
        Op::RingAttention { axis, .. } => ring_attention_spec(*axis, specs, shapes),
        Op::MoeMlp { dispatch, .. } => moe_spec(specs, shapes, *dispatch),
        Op::MoeMlpGrad { wrt, dispatch, .. } => {
            // (x, router, gate, up, down, dy): the forward's layouts, dy laid out as its rows.
            let output = moe_spec(&specs[..5], &shapes[..5], *dispatch)?;
            no_partial(specs, &[5])?;
            if specs[5].dims != output.dims {
                return Err(Conflict::Layout("dy is laid out differently from the MoE output".into()));
            }
            let rows = &specs[0].dims[..shapes[0].rank() - 1];
            let row_axes = rows.iter().flatten().copied();
            match wrt {
                MoeOperand::Input => Ok(output),
                // Summed over the rows, and (linear in each expert's output) over the ranks that
                // hold different experts or ffn channels.
                MoeOperand::Router => {
                    let mut spec = ShardSpec::replicated(shapes[1].rank());
                    spec.partial = row_axes.chain(output.partial).collect();
                    Ok(spec)
                }
                // An expert's gradient sums the rows that reached it: with a dispatch, the rows of
                // every rank of its axis.
                MoeOperand::Gate | MoeOperand::Up | MoeOperand::Down => {
                    let mut spec = specs[wrt.index()].clone();
                    spec.partial = row_axes.filter(|&axis| Some(axis) != *dispatch).collect();
                    Ok(spec)
                }
            }
        }
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

/// An `Add` whose operands differ in pending sums, where one is pending over an axis that splits a
/// dim of the other (innermost) that it holds whole: that operand is reduce-scattered on the dim.
fn scatter_partial(specs: &[&ShardSpec], shapes: &[&Shape]) -> Option<Conflict> {
    if shapes[0] != shapes[1] {
        return None;
    }
    for (operand, other) in [(0, 1), (1, 0)] {
        for &axis in specs[operand].partial.iter().filter(|axis| !specs[other].partial.contains(axis)) {
            let split = specs[other].dims.iter().position(|axes| axes.last() == Some(&axis));
            if let Some(index) = split {
                let outer = &specs[other].dims[index][..specs[other].dims[index].len() - 1];
                if specs[operand].dims[index] == outer {
                    return Some(Conflict::ScatterPartial { operand, axis, dim: shapes[0].dims()[index].name });
                }
            }
        }
    }
    None
}

/// `MoeMlp`'s layout: each rank routes its own rows with the whole router and runs the experts and
/// ffn channels it holds, so the result keeps the rows' splits and is a pending sum over the axes
/// that split the experts or ffn. An axis that splits both the rows and the experts (expert
/// parallelism beside its data split) gathers the rows first, unless it is the `dispatch` axis:
/// then the rows travel to their experts and back, and the result is whole over it.
fn moe_spec(specs: &[&ShardSpec], shapes: &[&Shape], dispatch: Option<AxisName>) -> Result<ShardSpec, Conflict> {
    use DimName::*;
    no_partial(specs, &[0, 1, 2, 3, 4])?;
    replicated_dim(specs, shapes, 0, Hidden, "each expert contracts hidden")?;
    if specs[1].dims.iter().any(|axes| !axes.is_empty()) {
        return Err(Conflict::Layout(format!(
            "the router is {}, but every rank routes its rows over all experts with the whole router",
            spec_text(specs[1], shapes[1])
        )));
    }
    let experts = dim_axes(specs[2], shapes[2], Experts);
    let ffn = dim_axes(specs[2], shapes[2], Ffn);
    for operand in 2..5 {
        replicated_dim(specs, shapes, operand, Hidden, "each expert contracts hidden")?;
        if dim_axes(specs[operand], shapes[operand], Experts) != experts
            || dim_axes(specs[operand], shapes[operand], Ffn) != ffn
        {
            return Err(Conflict::Layout(format!(
                "operand {operand} splits experts or ffn differently from the gate projection ({})",
                spec_text(specs[2], shapes[2])
            )));
        }
    }
    let row_count = shapes[0].rank() - 1;
    if let Some(axis) = dispatch {
        if experts != [axis] {
            return Err(Conflict::Layout(format!(
                "the dispatch over {axis} sends rows to the experts' ranks, but the experts are split over {}",
                if experts.is_empty() { "nothing".to_string() } else { axes_text(experts) }
            )));
        }
        if !specs[0].dims[..row_count].iter().flatten().any(|&row_axis| row_axis == axis) {
            return Err(Conflict::Layout(format!(
                "the dispatch over {axis} needs the rows split over {axis}: each rank sends its own rows"
            )));
        }
    }
    let placed = |axis: &AxisName| (experts.contains(axis) || ffn.contains(axis)) && Some(*axis) != dispatch;
    for (index, axes) in specs[0].dims[..row_count].iter().enumerate() {
        if let Some(&axis) = axes.iter().find(|&axis| placed(axis)) {
            return Err(Conflict::SplitActivation { dim: shapes[0].dims()[index].name, axis });
        }
    }
    let mut spec = specs[0].clone();
    spec.partial = experts.iter().chain(ffn).copied().filter(|&axis| Some(axis) != dispatch).collect();
    each_axis_once(spec)
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
    each_axis_once(spec)
}

/// `spec`, if no axis splits two of its dims or a dim and the pending sum.
fn each_axis_once(spec: ShardSpec) -> Result<ShardSpec, Conflict> {
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

/// The loss's operands: logits with whole vocab and seq rows (each row's softmax needs every vocab
/// entry and the next position's token), tokens split as the logits' batch.
fn loss_operands(specs: &[&ShardSpec], shapes: &[&Shape]) -> Result<(), Conflict> {
    use DimName::*;
    no_partial(specs, &[0, 1])?;
    for dim in [Vocab, Seq] {
        if let Some(&axis) = dim_axes(specs[0], shapes[0], dim).last() {
            return Err(Conflict::SplitActivation { dim, axis });
        }
    }
    replicated_dim(specs, shapes, 1, Seq, "each position's target is the next token")?;
    same_dim(specs, shapes, (0, 1), (Batch, Batch))
}

/// The operands of a vocab-parallel loss: as `loss_operands`, except that the logits' vocab must be
/// split over exactly `axis` (the statistics the kernel exchanges cover one axis's shards).
fn vocab_parallel_loss_operands(axis: AxisName, specs: &[&ShardSpec], shapes: &[&Shape]) -> Result<(), Conflict> {
    use DimName::*;
    no_partial(specs, &[0, 1])?;
    if let Some(&split) = dim_axes(specs[0], shapes[0], Seq).last() {
        return Err(Conflict::SplitActivation { dim: Seq, axis: split });
    }
    let vocab_axes = dim_axes(specs[0], shapes[0], Vocab);
    if vocab_axes != [axis] {
        return Err(Conflict::Layout(format!(
            "a vocab-parallel loss over {axis} needs the logits' vocab split over {axis} alone, not {}",
            if vocab_axes.is_empty() { "whole".to_string() } else { axes_text(vocab_axes) }
        )));
    }
    replicated_dim(specs, shapes, 1, Seq, "each position's target is the next token")?;
    same_dim(specs, shapes, (0, 1), (Batch, Batch))
}

fn same_spec(specs: &[&ShardSpec], (left, right): (usize, usize), what: &str) -> Result<(), Conflict> {
    if specs[left] == specs[right] {
        Ok(())
    } else {
        Err(Conflict::Layout(format!("{what} (operands {left} and {right}) are laid out differently")))
    }
}

/// What a dim of a contraction's operand becomes: dim `i` of the result, or summed with the other
/// operand's dim of the same index.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Label {
    Out(usize),
    Sum(usize),
}

/// The spec of a two-operand contraction: result dims take their operand's splits, summed dims
/// must be split alike on both sides and make the result a pending sum over those axes, and a
/// pending sum in one operand passes through (the product is linear in each).
fn contraction_spec(
    specs: &[&ShardSpec],
    shapes: &[&Shape],
    out: &Shape,
    labels: [&[Label]; 2],
) -> Result<ShardSpec, Conflict> {
    if !specs[0].partial.is_empty() && !specs[1].partial.is_empty() {
        return Err(Conflict::PartialInput { operand: 1, axes: specs[1].partial.clone() });
    }
    let mut spec = ShardSpec::replicated(out.rank());
    spec.partial = specs[0].partial.iter().chain(&specs[1].partial).copied().collect();
    for (operand, operand_labels) in labels.iter().enumerate() {
        for (dim, label) in operand_labels.iter().enumerate() {
            let axes = specs[operand].dim_axes(dim);
            match *label {
                Label::Out(index) => spec.dims[index] = axes.to_vec(),
                Label::Sum(_) if operand == 1 => {}
                Label::Sum(_) => {
                    let other =
                        labels[1].iter().position(|other| other == label).expect("a summed dim is on both sides");
                    let other_axes = specs[1].dim_axes(other);
                    if axes != other_axes {
                        return Err(Conflict::Layout(format!(
                            "summed dim {} is {} in operand 0 but {} in operand 1",
                            shapes[0].dims()[dim].name,
                            axes_text(axes),
                            axes_text(other_axes)
                        )));
                    }
                    spec.partial.extend_from_slice(axes);
                }
            }
        }
    }
    each_axis_once(spec)
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
