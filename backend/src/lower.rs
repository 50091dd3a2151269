//! Lowering: one `Program` per rank from a sharded, verified module.
//!
//! Each IR value becomes one buffer holding the rank's block of it (local shape from its spec);
//! each node becomes one instruction whose sizes, slice offsets and groups are fixed here, so the
//! runtime needs no knowledge of meshes or specs. Values are freed right after their last use;
//! parameters stay resident.

use pleat_ir::entity::EntityRef;
use pleat_ir::model::rope::inv_freq;
use pleat_ir::op::{inverse_order, zigzag_order};
use pleat_ir::{DimName, Module, Op, ValueId};

use crate::error::{Error, Result};
use crate::program::{
    AttentionDims, AttentionOperand, Buffer, BufferId, BufferKind, Group, Instr, Kernel, MoeDims, Program, RouterDims,
    TransferStream, FORMAT_VERSION,
};

/// Lowers `module` (verified) into one program a rank of its mesh.
pub fn lower(module: &Module) -> Result<Vec<Program>> {
    let world_size = module.mesh.world_size() as u32;
    (0..world_size).map(|rank| lower_rank(module, rank)).collect()
}

/// Lowers `module` for one rank.
pub fn lower_rank(module: &Module, rank: u32) -> Result<Program> {
    lower_rank_traced(module, rank).map(|(program, _)| program)
}

/// As `lower_rank`, also returning for each instruction the position in the module's program
/// order of the node it was lowered from (`None` for the trailing outputs).
pub fn lower_rank_traced(module: &Module, rank: u32) -> Result<(Program, Vec<Option<usize>>)> {
    let mut trace: Vec<Option<usize>> = Vec::new();
    let graph = &module.graph;
    let mesh = &module.mesh;
    let order = graph.order();
    let mut last_use = vec![None; graph.value_count()];
    for (index, &node) in order.iter().enumerate() {
        for &input in &graph.node(node).inputs {
            last_use[input.as_u32() as usize] = Some(index);
        }
    }
    let tokens_shape = order
        .iter()
        .find(|&&node| graph.node(node).op == Op::Tokens)
        .map(|&node| graph.value(graph.node(node).result).ty.shape.sizes())
        .unwrap_or_default();
    let mut program = Program {
        format_version: FORMAT_VERSION,
        model: module.name.clone(),
        mesh: mesh.to_string(),
        rank,
        world_size: mesh.world_size() as u32,
        tokens_shape,
        buffers: Vec::new(),
        instructions: Vec::new(),
    };
    // Value index -> buffer; every value in the order gets exactly one.
    let mut buffer_of: Vec<Option<BufferId>> = vec![None; graph.value_count()];
    // Ring MLP gradients computed by an earlier sibling's ring.
    let mut ring_gradients_lowered: Vec<ValueId> = Vec::new();
    let mut moe_gradients_lowered: Vec<ValueId> = Vec::new();
    let local = |value: ValueId| -> Result<Vec<u64>> {
        let data = graph.value(value);
        data.spec.local_sizes(&data.ty.shape, mesh).map_err(|(dim, degree)| Error::Indivisible {
            value: graph.def(value).name.clone(),
            dim: data.ty.shape.dims()[dim].name.to_string(),
            size: data.ty.shape.dims()[dim].size,
            degree,
        })
    };
    let region = |value: ValueId| {
        let data = graph.value(value);
        data.spec.region(&data.ty.shape, mesh, rank)
    };
    for (index, &node) in order.iter().enumerate() {
        // Every instruction pushed since the previous node started belongs to that node.
        trace.resize(program.instructions.len(), index.checked_sub(1));
        let data = graph.node(node);
        let value = data.result;
        let kind = match data.op {
            Op::Param { .. } => BufferKind::Param,
            Op::Tokens | Op::Positions => BufferKind::Input,
            Op::BroadcastShard { .. } => BufferKind::InFlight,
            _ => BufferKind::Activation,
        };
        // A ring MLP gradient's siblings were given their buffers by the first of them.
        let out = match buffer_of[value.as_u32() as usize] {
            Some(out) => out,
            None => {
                let out = BufferId::new(program.buffers.len());
                program.buffers.push(Buffer {
                    name: data.name.clone(),
                    dtype: graph.value(value).ty.dtype,
                    shape: local(value)?,
                    kind,
                });
                buffer_of[value.as_u32() as usize] = Some(out);
                out
            }
        };
        let inputs: Vec<BufferId> = data
            .inputs
            .iter()
            .map(|input| buffer_of[input.as_u32() as usize].expect("verified: defined before use"))
            .collect();
        let input_local = |operand: usize| local(data.inputs[operand]);
        let group = |axis: pleat_ir::AxisName| Group { axis: axis.to_string(), ranks: mesh.group(rank, axis) };
        let dim_index =
            |dim: DimName| graph.value(data.inputs[0]).ty.shape.position(dim).expect("verified: dim exists");
        // The sizes and head mapping of an attention kernel on this node's local blocks (q, k as
        // operands 0 and 1).
        let attention_dims = |causal: bool| -> Result<AttentionDims> {
            let (q, k) = (input_local(0)?, input_local(1)?);
            let global_heads = graph.value(data.inputs[0]).ty.shape.dims()[2].size;
            let global_kv_heads = graph.value(data.inputs[1]).ty.shape.dims()[2].size;
            Ok(AttentionDims {
                batch: q[0],
                sq: q[1],
                sk: k[1],
                hq: q[2],
                hkv: k[2],
                head_dim: q[3],
                q_head_offset: region(data.inputs[0])[2].0,
                kv_head_offset: region(data.inputs[1])[2].0,
                group: global_heads / global_kv_heads,
                causal,
                scale: 1.0 / (q[3] as f32).sqrt(),
            })
        };
        // Buffers the node's own instructions need only until its last one (vocab-parallel loss).
        let mut scratch: Vec<BufferId> = Vec::new();
        let instr = match &data.op {
            Op::Tokens => Instr::LoadTokens { out, region: region(value) },
            Op::Positions => Instr::LoadPositions { out, region: region(value) },
            Op::Param { name } => Instr::LoadParam {
                out,
                name: name.clone(),
                shape: graph.value(value).ty.shape.sizes(),
                region: region(value),
            },
            Op::Embedding => {
                let table = data.inputs[0];
                let kernel = Kernel::Embedding {
                    hidden: input_local(0)?[1],
                    vocab_offset: region(table)[0].0,
                    vocab_total: graph.value(table).ty.shape.dims()[0].size,
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::RmsNorm { eps } => {
                let hidden = *input_local(1)?.first().unwrap_or(&1);
                Instr::Kernel { kernel: Kernel::RmsNorm { hidden, eps: *eps }, inputs, out }
            }
            Op::MatMul { contract } => {
                let (x, w) = (input_local(0)?, input_local(1)?);
                let contract = *contract as usize;
                let k: u64 = x[x.len() - contract..].iter().product();
                let m: u64 = x[..x.len() - contract].iter().product();
                let n: u64 = w[..w.len() - contract].iter().product();
                Instr::Kernel { kernel: Kernel::MatMul { m, n, k }, inputs, out }
            }
            Op::Rope { rope } => {
                let x = input_local(0)?;
                let kernel = Kernel::Rope {
                    batch: x[0],
                    seq: x[1],
                    heads: x[2],
                    head_dim: x[3],
                    inv_freq: inv_freq(rope, x[3]),
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::Attention { causal } => {
                let kernel = Kernel::Attention { dims: attention_dims(*causal)?, with_lse: false };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::RingAttention { axis, causal } => {
                let dims = attention_dims(*causal)?;
                lower_ring_attention(&mut program, &data.name, &inputs, out, &mesh.group(rank, *axis), rank, dims);
                free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
                free_unused_result(&mut program, graph, &last_use, value, out);
                continue;
            }
            Op::SiluMul => Instr::Kernel { kernel: Kernel::SiluMul, inputs, out },
            Op::ExpertCounts { .. } | Op::RouterProbSum | Op::RouterProbSumGrad { .. } => {
                let x = input_local(0)?;
                let dims = RouterDims {
                    rows: x[..x.len() - 1].iter().product(),
                    hidden: *x.last().unwrap_or(&1),
                    experts: input_local(1)?[0],
                };
                let kernel = match data.op {
                    Op::ExpertCounts { top_k, scale } => Kernel::ExpertCounts { dims, top_k, scale },
                    Op::RouterProbSumGrad { wrt } => Kernel::RouterProbSumGrad { wrt, dims },
                    _ => Kernel::RouterProbSum { dims },
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::LoadBalancingLoss => {
                Instr::Kernel { kernel: Kernel::LoadBalancingLoss { experts: input_local(0)?[0] }, inputs, out }
            }
            Op::SigmoidScale | Op::SigmoidScaleGradGate => {
                let hidden = *input_local(1)?.last().unwrap_or(&1);
                let kernel = match data.op {
                    Op::SigmoidScale => Kernel::SigmoidScale { hidden },
                    _ => Kernel::SigmoidScaleGradGate { hidden },
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::Add => Instr::Kernel { kernel: Kernel::Add, inputs, out },
            Op::Sum { .. } => Instr::Kernel { kernel: Kernel::Sum, inputs, out },
            Op::AllReduce { axis } => {
                Instr::AllReduce { inputs: vec![inputs[0]], outs: vec![out], group: group(*axis) }
            }
            Op::ReduceScatter { axis, dim } => Instr::ReduceScatter {
                inputs: vec![inputs[0]],
                outs: vec![out],
                group: group(*axis),
                dims: vec![dim_index(*dim)],
            },
            Op::AllGather { axis, dim } => Instr::AllGather {
                input: inputs[0],
                out,
                group: group(*axis),
                dim: dim_index(*dim),
                stream: TransferStream::Main,
            },
            Op::AllToAll { axis, split_dim, gather_dim } => Instr::AllToAll {
                input: inputs[0],
                out,
                group: group(*axis),
                split_dim: dim_index(*split_dim),
                gather_dim: dim_index(*gather_dim),
            },
            Op::Zigzag { parts, inverse } => {
                let shape = input_local(0)?;
                let dim = dim_index(DimName::Seq);
                let order = zigzag_order(shape[dim], *parts);
                let order = if *inverse { inverse_order(&order) } else { order };
                Instr::Kernel { kernel: Kernel::Permute { shape, dim, order }, inputs, out }
            }
            Op::BroadcastShard { axis, root, .. } => {
                let group = group(*axis);
                let root = *root as usize;
                // One owner's blocks travel as one packed message: join the broadcast just emitted
                // (past the frees of the blocks it was the last reader of, such as ZeRO-3's
                // gathered weights), and free this block too where the message is its last reader.
                let last_emitted =
                    program.instructions.iter_mut().rev().find(|instr| !matches!(instr, Instr::Free { .. }));
                if let Some(Instr::Broadcast { inputs: packed, outs, group: last_group, root: last_root, .. }) =
                    last_emitted
                {
                    if *last_group == group && *last_root == root {
                        packed.push(inputs[0]);
                        outs.push(out);
                        free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
                        continue;
                    }
                }
                Instr::Broadcast { inputs, outs: vec![out], group, root, stream: TransferStream::Main }
            }
            Op::RingGatedMlp { axis } => {
                let x = input_local(0)?;
                let shapes = RingShapes {
                    rows: x[..x.len() - 1].iter().product(),
                    hidden: *x.last().unwrap_or(&1),
                    ffn: input_local(1)?[0],
                };
                lower_ring_mlp(&mut program, &data.name, &inputs, out, &mesh.group(rank, *axis), rank, shapes);
                free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
                free_unused_result(&mut program, graph, &last_use, value, out);
                continue;
            }
            Op::RingGatedMlpGrad { axis, wrt } => {
                // The first of an MLP's gradients lowers the ring that computes all of them.
                if !ring_gradients_lowered.contains(&value) {
                    let mut outs = [None; 4];
                    outs[wrt.index()] = Some(out);
                    for sibling in gradient_siblings(graph, &order[index + 1..], data) {
                        let sibling_data = graph.node(sibling);
                        let Op::RingGatedMlpGrad { wrt: sibling_wrt, .. } = sibling_data.op else { continue };
                        let buffer = sibling_buffer(&mut program, graph, sibling_data, local(sibling_data.result)?);
                        buffer_of[sibling_data.result.as_u32() as usize] = Some(buffer);
                        ring_gradients_lowered.push(sibling_data.result);
                        outs[sibling_wrt.index()] = Some(buffer);
                    }
                    let x = input_local(0)?;
                    let shapes = RingShapes {
                        rows: x[..x.len() - 1].iter().product(),
                        hidden: *x.last().unwrap_or(&1),
                        ffn: input_local(1)?[0],
                    };
                    let group = mesh.group(rank, *axis);
                    lower_ring_mlp_grad(&mut program, &data.name, &inputs, outs, &group, rank, shapes);
                }
                free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
                free_unused_result(&mut program, graph, &last_use, value, out);
                continue;
            }
            Op::CrossEntropy | Op::CrossEntropyGrad => {
                let kernel =
                    loss_kernel(&data.op, &data.name, &input_local(0)?, &graph.value(data.inputs[0]).ty.shape.sizes())?;
                Instr::Kernel { kernel, inputs, out }
            }
            Op::VocabParallelCrossEntropy { axis } | Op::VocabParallelCrossEntropyGrad { axis } => {
                let logits = data.inputs[0];
                let shard = VocabShard {
                    local: input_local(0)?,
                    global: graph.value(logits).ty.shape.sizes(),
                    vocab_offset: region(logits)[2].0,
                    parts: mesh.degree(*axis),
                };
                let stats = lower_loss_row_stats(&mut program, &data.op, &data.name, &inputs, group(*axis), &shard)?;
                scratch.push(stats);
                vocab_parallel_loss_instr(&data.op, &data.name, &inputs, stats, out, &shard)?
            }
            Op::MatMulGradInput { contract } => {
                let (dy, w) = (input_local(0)?, input_local(1)?);
                let w_free = w.len().saturating_sub(*contract as usize);
                let kernel = Kernel::MatMulGradInput {
                    m: dy[..dy.len().saturating_sub(w_free)].iter().product(),
                    n: w[..w_free].iter().product(),
                    k: w[w_free..].iter().product(),
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::MatMulGradWeight { contract } => {
                let (dy, x) = (input_local(0)?, input_local(1)?);
                let x_free = x.len().saturating_sub(*contract as usize);
                let kernel = Kernel::MatMulGradWeight {
                    m: x[..x_free].iter().product(),
                    n: dy[x_free.min(dy.len())..].iter().product(),
                    k: x[x_free..].iter().product(),
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::RmsNormGradInput { eps } => {
                let hidden = *input_local(0)?.last().unwrap_or(&1);
                Instr::Kernel { kernel: Kernel::RmsNormGradInput { hidden, eps: *eps }, inputs, out }
            }
            Op::RmsNormGradInputAdd { eps } => {
                let hidden = *input_local(0)?.last().unwrap_or(&1);
                Instr::Kernel { kernel: Kernel::RmsNormGradInputAdd { hidden, eps: *eps }, inputs, out }
            }
            Op::RmsNormGradWeight { eps } => {
                let hidden = *input_local(0)?.last().unwrap_or(&1);
                Instr::Kernel { kernel: Kernel::RmsNormGradWeight { hidden, eps: *eps }, inputs, out }
            }
            Op::RopeGrad { rope } => {
                let dy = input_local(0)?;
                let kernel = Kernel::RopeGrad {
                    batch: dy[0],
                    seq: dy[1],
                    heads: dy[2],
                    head_dim: dy[3],
                    inv_freq: inv_freq(rope, dy[3]),
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::AttentionGradQuery { causal } | Op::AttentionGradKey { causal } | Op::AttentionGradValue { causal } => {
                let wrt = match data.op {
                    Op::AttentionGradQuery { .. } => AttentionOperand::Query,
                    Op::AttentionGradKey { .. } => AttentionOperand::Key,
                    _ => AttentionOperand::Value,
                };
                let kernel = Kernel::AttentionGrad { wrt, dims: attention_dims(*causal)? };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::SiluMulGradGate => Instr::Kernel { kernel: Kernel::SiluMulGradGate, inputs, out },
            Op::MoeMlp { top_k, normalize, dispatch } | Op::MoeMlpGrad { top_k, normalize, dispatch, .. } => {
                let (x, gate) = (input_local(0)?, input_local(2)?);
                let dims = MoeDims {
                    rows: x[..x.len() - 1].iter().product(),
                    hidden: *x.last().unwrap_or(&1),
                    experts: input_local(1)?[0],
                    local_experts: gate[0],
                    expert_offset: region(data.inputs[2])[0].0,
                    ffn: gate[1],
                    top_k: *top_k,
                    normalize: *normalize,
                };
                if let Some(axis) = dispatch {
                    // The gradients of one mixture share their dispatch: the first lowers it for
                    // all of them.
                    if moe_gradients_lowered.contains(&value) {
                        free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
                        free_unused_result(&mut program, graph, &last_use, value, out);
                        continue;
                    }
                    let (mut outs, mut wrts) = (vec![out], Vec::new());
                    if let Op::MoeMlpGrad { wrt, .. } = data.op {
                        wrts.push(wrt);
                        for sibling in gradient_siblings(graph, &order[index + 1..], data) {
                            let sibling_data = graph.node(sibling);
                            let Op::MoeMlpGrad { wrt: sibling_wrt, .. } = sibling_data.op else { continue };
                            let buffer = sibling_buffer(&mut program, graph, sibling_data, local(sibling_data.result)?);
                            buffer_of[sibling_data.result.as_u32() as usize] = Some(buffer);
                            moe_gradients_lowered.push(sibling_data.result);
                            outs.push(buffer);
                            wrts.push(sibling_wrt);
                        }
                    }
                    Instr::ExpertDispatch { inputs, outs, wrts, group: group(*axis), dims }
                } else {
                    let kernel = match data.op {
                        Op::MoeMlpGrad { wrt, .. } => Kernel::MoeMlpGrad { wrt, dims },
                        _ => Kernel::MoeMlp { dims },
                    };
                    Instr::Kernel { kernel, inputs, out }
                }
            }
            Op::EmbeddingGrad { vocab } => {
                let table = local(value)?;
                let kernel = Kernel::EmbeddingGrad {
                    hidden: *table.get(1).unwrap_or(&1),
                    vocab_offset: region(value)[0].0,
                    vocab_total: *vocab,
                };
                Instr::Kernel { kernel, inputs, out }
            }
            Op::SumLeading { .. } => {
                Instr::Kernel { kernel: Kernel::SumLeading { width: local(value)?.iter().product() }, inputs, out }
            }
            Op::ReduceToRoot { axis, root, .. } => {
                let group = mesh.group(rank, *axis);
                lower_reduce_to_root(&mut program, &data.name, inputs[0], out, &group, rank, *root as usize);
                let input = data.inputs[0];
                let resident = graph.outputs().contains(&input);
                if last_use[input.as_u32() as usize] == Some(index) && !resident {
                    program.instructions.push(Instr::Free { buf: inputs[0] });
                }
                continue;
            }
            Op::LocalSlice { axis, dim } => {
                let shape = input_local(0)?;
                let split = dim_index(*dim);
                let parts = mesh.degree(*axis);
                let coord = mesh.coord(rank, *axis);
                let region = shape
                    .iter()
                    .enumerate()
                    .map(|(at, &len)| if at == split { (coord * (len / parts), len / parts) } else { (0, len) })
                    .collect();
                Instr::Kernel { kernel: Kernel::Slice { shape, region }, inputs, out }
            }
        };
        program.instructions.push(instr);
        free_dead_operands(&mut program, graph, data, index, &last_use, &buffer_of);
        program.instructions.extend(scratch.into_iter().map(|buf| Instr::Free { buf }));
        free_unused_result(&mut program, graph, &last_use, value, out);
    }
    trace.resize(program.instructions.len(), order.len().checked_sub(1));
    for (index, &output) in graph.outputs().iter().enumerate() {
        program.instructions.push(Instr::Output {
            buf: buffer_of[output.as_u32() as usize].expect("verified: outputs exist"),
            index: index as u32,
            shape: graph.value(output).ty.shape.sizes(),
            region: region(output),
        });
    }
    trace.resize(program.instructions.len(), None);
    crate::relay::fuse_relays(&mut program, &mut trace);
    // What the runtimes trust of a program read from a file holds of every lowered one: sizes
    // agree, transfers pair, nothing is left allocated.
    crate::validate::validate(&program)?;
    Ok((program, trace))
}

/// Frees the operands of `data` (the node at `index` of the program order) whose last use it is,
/// unless they stay resident (parameters, graph outputs). An operand read twice dies once.
fn free_dead_operands(
    program: &mut Program,
    graph: &pleat_ir::Graph,
    data: &pleat_ir::NodeData,
    index: usize,
    last_use: &[Option<usize>],
    buffer_of: &[Option<BufferId>],
) {
    let mut freed: Vec<ValueId> = Vec::new();
    for &input in &data.inputs {
        if freed.contains(&input) {
            continue;
        }
        freed.push(input);
        let buffer = buffer_of[input.as_u32() as usize].expect("verified: defined before use");
        let dies_here = last_use[input.as_u32() as usize] == Some(index);
        let resident = program.buffer(buffer).kind == BufferKind::Param || graph.outputs().contains(&input);
        if dies_here && !resident {
            program.instructions.push(Instr::Free { buf: buffer });
        }
    }
}

/// Frees `out`, the buffer of `value`, right away when nothing reads it and it is not a graph
/// output or a parameter (resident).
fn free_unused_result(
    program: &mut Program,
    graph: &pleat_ir::Graph,
    last_use: &[Option<usize>],
    value: ValueId,
    out: BufferId,
) {
    let unused = last_use[value.as_u32() as usize].is_none() && !graph.outputs().contains(&value);
    if unused && program.buffer(out).kind != BufferKind::Param {
        program.instructions.push(Instr::Free { buf: out });
    }
}

/// Which operand a gradient op that lowers with its siblings differentiates, and what its siblings
/// share besides the operands: the op kind and its axis.
fn sibling_gradient_of(op: &Op) -> Option<(usize, u8, Option<pleat_ir::AxisName>)> {
    match op {
        Op::RingGatedMlpGrad { axis, wrt } => Some((wrt.index(), 0, Some(*axis))),
        Op::MoeMlpGrad { dispatch, wrt, .. } => Some((wrt.index(), 1, *dispatch)),
        _ => None,
    }
}

/// The other gradients of the same ring MLP or dispatched mixture as `data` among `later` nodes:
/// same op and axis, same operands, another operand differentiated. The first of them lowers one
/// instruction (or ring) that computes them all.
fn gradient_siblings(
    graph: &pleat_ir::Graph,
    later: &[pleat_ir::NodeId],
    data: &pleat_ir::NodeData,
) -> Vec<pleat_ir::NodeId> {
    let Some((wrt, kind, axis)) = sibling_gradient_of(&data.op) else { return Vec::new() };
    let mut seen = vec![wrt];
    later
        .iter()
        .copied()
        .filter(|&node| {
            let other = graph.node(node);
            match sibling_gradient_of(&other.op) {
                Some((other_wrt, other_kind, other_axis))
                    if (other_kind, other_axis) == (kind, axis)
                        && other.inputs == data.inputs
                        && !seen.contains(&other_wrt) =>
                {
                    seen.push(other_wrt);
                    true
                }
                _ => false,
            }
        })
        .collect()
}

/// A new activation buffer of `shape` for a sibling gradient's result.
fn sibling_buffer(
    program: &mut Program,
    graph: &pleat_ir::Graph,
    sibling: &pleat_ir::NodeData,
    shape: Vec<u64>,
) -> BufferId {
    let buffer = BufferId::new(program.buffers.len());
    program.buffers.push(Buffer {
        name: sibling.name.clone(),
        dtype: graph.value(sibling.result).ty.dtype,
        shape,
        kind: BufferKind::Activation,
    });
    buffer
}

/// A rank's vocab shard of a vocab-parallel loss's logits.
struct VocabShard {
    /// The local logits' sizes, `[batch, seq, vocab shard]`.
    local: Vec<u64>,
    /// The global logits' sizes.
    global: Vec<u64>,
    /// The global id of the shard's first vocab entry.
    vocab_offset: u64,
    /// The ranks the vocabulary is split over.
    parts: u64,
}

impl VocabShard {
    /// `(batch, seq, vocab shard, global batch, global seq, global vocab)`, or the error naming a
    /// sequence that is not whole.
    fn sizes(&self, op: &Op, value: &str) -> Result<[u64; 6]> {
        let (&[batch, seq, vocab], &[global_batch, global_seq, global_vocab]) = (&self.local[..], &self.global[..])
        else {
            unreachable!("verified: logits are [batch, seq, vocab]")
        };
        if seq != global_seq {
            return Err(Error::SplitLossDim {
                value: value.to_string(),
                op: op.mnemonic(),
                dim: "seq".to_string(),
                local: seq,
                global: global_seq,
            });
        }
        Ok([batch, seq, vocab, global_batch, global_seq, global_vocab])
    }
}

/// Emits the row statistics of the rank's vocab shard (`inputs`: logits, tokens) and their
/// all-gather over `group`; returns the gathered `[parts, rows, 3]` buffer (f32 whatever the
/// logits' dtype: the exchanged sums must not round to bf16).
fn lower_loss_row_stats(
    program: &mut Program,
    op: &Op,
    name: &str,
    inputs: &[BufferId],
    group: Group,
    shard: &VocabShard,
) -> Result<BufferId> {
    let [batch, seq, vocab, _, _, global_vocab] = shard.sizes(op, name)?;
    let rows = batch * seq;
    let mut stats_buffer = |suffix: &str, parts: u64| {
        let id =
            new_buffer(program, format!("{name}.{suffix}"), vec![parts, rows, 3], BufferKind::Activation, inputs[0]);
        program.buffers[id.as_u32() as usize].dtype = pleat_ir::DType::F32;
        id
    };
    let local = stats_buffer("row_stats", 1);
    let gathered = stats_buffer("row_stats_gathered", shard.parts);
    program.instructions.push(Instr::Kernel {
        kernel: Kernel::LossRowStats { batch, seq, vocab, vocab_offset: shard.vocab_offset, global_vocab },
        inputs: inputs.to_vec(),
        out: local,
    });
    program.instructions.push(Instr::AllGather {
        input: local,
        out: gathered,
        group,
        dim: 0,
        stream: TransferStream::Main,
    });
    program.instructions.push(Instr::Free { buf: local });
    Ok(gathered)
}

/// The instruction that turns the gathered row statistics into the loss or its gradient shard.
fn vocab_parallel_loss_instr(
    op: &Op,
    name: &str,
    inputs: &[BufferId],
    stats: BufferId,
    out: BufferId,
    shard: &VocabShard,
) -> Result<Instr> {
    let [batch, seq, vocab, global_batch, global_seq, global_vocab] = shard.sizes(op, name)?;
    let terms = global_batch * global_seq.saturating_sub(1);
    let (parts, vocab_offset) = (shard.parts, shard.vocab_offset);
    Ok(match op {
        Op::VocabParallelCrossEntropy { .. } => Instr::Kernel {
            kernel: Kernel::CrossEntropyFromStats { batch, seq, global_vocab, terms, parts },
            inputs: vec![inputs[1], stats],
            out,
        },
        _ => Instr::Kernel {
            kernel: Kernel::CrossEntropyGradFromStats { batch, seq, vocab, vocab_offset, global_vocab, terms, parts },
            inputs: vec![inputs[0], inputs[1], stats],
            out,
        },
    })
}

/// The kernel of `CrossEntropy` or `CrossEntropyGrad` (`op`) on local logits `[batch, seq, vocab]` of
/// the global `global` logits: the sequence and the vocabulary must be whole locally (the shift and
/// the softmax read across them), the batch may be split; the mean divides by the global target count.
fn loss_kernel(op: &Op, value: &str, local: &[u64], global: &[u64]) -> Result<Kernel> {
    let (&[batch, seq, vocab], &[global_batch, global_seq, global_vocab]) = (local, global) else {
        unreachable!("verified: logits are [batch, seq, vocab]")
    };
    for (dim, local, global) in [("seq", seq, global_seq), ("vocab", vocab, global_vocab)] {
        if local != global {
            return Err(Error::SplitLossDim {
                value: value.to_string(),
                op: op.mnemonic(),
                dim: dim.to_string(),
                local,
                global,
            });
        }
    }
    let terms = global_batch * global_seq.saturating_sub(1);
    Ok(match op {
        Op::CrossEntropy => Kernel::CrossEntropy { batch, seq, vocab, terms },
        _ => Kernel::CrossEntropyGrad { batch, seq, vocab, terms },
    })
}

/// Local sizes of a ring MLP: `x` is `[rows, hidden]`, each ffn shard `ffn` wide.
#[derive(Clone, Copy)]
struct RingShapes {
    rows: u64,
    hidden: u64,
    ffn: u64,
}

fn new_buffer(program: &mut Program, name: String, shape: Vec<u64>, kind: BufferKind, like: BufferId) -> BufferId {
    let dtype = program.buffer(like).dtype;
    let id = BufferId::new(program.buffers.len());
    program.buffers.push(Buffer { name, dtype, shape, kind });
    id
}

/// The ranks after and before `rank` in the ring of `group` (itself on a ring of one).
fn ring_neighbours(group: &[u32], rank: u32) -> (u32, u32) {
    let steps = group.len();
    let me = group.iter().position(|&member| member == rank).expect("a rank is in its own groups");
    (group[(me + 1) % steps], group[(me + steps - 1) % steps])
}

/// Expands a reduce-to-root: every member but the root sends its operand to the root and writes
/// zeros; the root receives the others' operands in group order and sums them into its own.
fn lower_reduce_to_root(
    program: &mut Program,
    name: &str,
    input: BufferId,
    out: BufferId,
    group: &[u32],
    rank: u32,
    root: usize,
) {
    let root_rank = group[root];
    if rank != root_rank {
        program.instructions.push(Instr::Send { bufs: vec![input], peer: root_rank });
        program.instructions.push(Instr::Kernel { kernel: Kernel::Zeros, inputs: Vec::new(), out });
        return;
    }
    let shape = program.buffer(input).shape.clone();
    let others: Vec<u32> = group.iter().copied().filter(|&member| member != rank).collect();
    if others.is_empty() {
        let region = shape.iter().map(|&len| (0, len)).collect();
        program.instructions.push(Instr::Kernel { kernel: Kernel::Slice { shape, region }, inputs: vec![input], out });
        return;
    }
    let mut sum = input;
    for (index, &peer) in others.iter().enumerate() {
        let received = new_buffer(program, format!("{name}.from{peer}"), shape.clone(), BufferKind::InFlight, input);
        program.instructions.push(Instr::Recv { outs: vec![received], peer });
        let total = if index + 1 == others.len() {
            out
        } else {
            new_buffer(program, format!("{name}.sum{index}"), shape.clone(), BufferKind::Activation, input)
        };
        program.instructions.push(Instr::Kernel { kernel: Kernel::Add, inputs: vec![sum, received], out: total });
        program.instructions.push(Instr::Free { buf: received });
        if sum != input {
            program.instructions.push(Instr::Free { buf: sum });
        }
        sum = total;
    }
}

/// Expands a ring MLP: in step s the rank computes with the ffn shard it holds (its own at s = 0)
/// while that shard is on its way to the next rank and the previous rank's is on its way here. The
/// send is posted before the step's GEMMs and the receive waited for after them, so the transfer
/// runs under the compute; the last step sends nothing.
fn lower_ring_mlp(
    program: &mut Program,
    name: &str,
    inputs: &[BufferId],
    out: BufferId,
    group: &[u32],
    rank: u32,
    shapes: RingShapes,
) {
    let RingShapes { rows, hidden, ffn } = shapes;
    let steps = group.len();
    let (next, previous) = ring_neighbours(group, rank);
    let x = inputs[0];
    let mut shard = [inputs[1], inputs[2], inputs[3]];
    let mut sum: Option<BufferId> = None;
    let matmul = |m, n, k| Kernel::MatMul { m, n, k };
    for step in 0..steps {
        let last = step + 1 == steps;
        if !last {
            program.instructions.push(Instr::Send { bufs: shard.to_vec(), peer: next });
        }
        let act = |program: &mut Program, part: &str| {
            new_buffer(program, format!("{name}.step{step}.{part}"), vec![rows, ffn], BufferKind::Activation, x)
        };
        let gate = act(program, "gate");
        program.instructions.push(Instr::Kernel {
            kernel: matmul(rows, ffn, hidden),
            inputs: vec![x, shard[0]],
            out: gate,
        });
        let up = act(program, "up");
        program.instructions.push(Instr::Kernel {
            kernel: matmul(rows, ffn, hidden),
            inputs: vec![x, shard[1]],
            out: up,
        });
        let hidden_act = act(program, "silu_mul");
        program.instructions.push(Instr::Kernel { kernel: Kernel::SiluMul, inputs: vec![gate, up], out: hidden_act });
        program.instructions.push(Instr::Free { buf: gate });
        program.instructions.push(Instr::Free { buf: up });
        let partial = match (last, sum) {
            (true, None) => out,
            _ => new_buffer(program, format!("{name}.step{step}.down"), vec![rows, hidden], BufferKind::Activation, x),
        };
        program.instructions.push(Instr::Kernel {
            kernel: matmul(rows, hidden, ffn),
            inputs: vec![hidden_act, shard[2]],
            out: partial,
        });
        program.instructions.push(Instr::Free { buf: hidden_act });
        sum = Some(match sum {
            None => partial,
            Some(previous_sum) => {
                let total = if last {
                    out
                } else {
                    new_buffer(program, format!("{name}.step{step}.sum"), vec![rows, hidden], BufferKind::Activation, x)
                };
                program.instructions.push(Instr::Kernel {
                    kernel: Kernel::Add,
                    inputs: vec![previous_sum, partial],
                    out: total,
                });
                program.instructions.push(Instr::Free { buf: previous_sum });
                program.instructions.push(Instr::Free { buf: partial });
                total
            }
        });
        if !last {
            let received = [("gate", vec![ffn, hidden]), ("up", vec![ffn, hidden]), ("down", vec![hidden, ffn])].map(
                |(part, shape)| {
                    new_buffer(program, format!("{name}.shard{}.{part}", step + 1), shape, BufferKind::InFlight, x)
                },
            );
            program.instructions.push(Instr::Recv { outs: received.to_vec(), peer: previous });
            if step > 0 {
                for buf in shard {
                    program.instructions.push(Instr::Free { buf });
                }
            }
            shard = received;
        }
    }
    if steps > 1 {
        for buf in shard {
            program.instructions.push(Instr::Free { buf });
        }
    }
}

/// Expands the gradients of a ring MLP (`inputs`: x, gate, up, down, dy; `outs`: the buffers of
/// the gradients wanted, by operand) into the forward's ring run in reverse order: in step t the
/// rank holds the weight shard of the rank t + 1 after it, so the shards travel the other way
/// round and each rank's own shard comes last. The rank recomputes the held shard's activations on
/// its own tokens (never kept from the forward), adds the shard's part to its input gradient and
/// its tokens' part to the shard's weight gradients. **The gradient travels with its weight:** the
/// rank before the owner creates it at step 0, every rank adds its part and hands it on with the
/// shard, and at the last step it reaches the owner, whose own part completes it. Weights make
/// D-1 hops, as in the forward (the owner uses its own copy at the end), and so do the gradients
/// (one message a part: down, gate, up, in the order they are computed). Step 0's shard is
/// received before its GEMMs; every later shard is sent on before the step's GEMMs and received
/// after them, and a gradient part is sent as soon as it is complete and received just before it
/// is added to, so those transfers run under the compute and at most one gradient part in flight
/// is live beside the shard.
fn lower_ring_mlp_grad(
    program: &mut Program,
    name: &str,
    inputs: &[BufferId],
    outs: [Option<BufferId>; 4],
    group: &[u32],
    rank: u32,
    shapes: RingShapes,
) {
    let RingShapes { rows, hidden, ffn } = shapes;
    let steps = group.len();
    // Reversed: the shards come from the next rank and go on to the previous one.
    let (from, to) = ring_neighbours(group, rank);
    let (x, dy) = (inputs[0], inputs[4]);
    let own = [inputs[1], inputs[2], inputs[3]];
    let [dx_out, weight_outs @ ..] = outs;
    let weight_shape = |part: usize| if part == 2 { vec![hidden, ffn] } else { vec![ffn, hidden] };
    let part_name = ["gate", "up", "down"];
    let kernel = |program: &mut Program, kernel: Kernel, operands: Vec<BufferId>, out: BufferId| {
        program.instructions.push(Instr::Kernel { kernel, inputs: operands, out });
    };
    let free = |program: &mut Program, bufs: &[BufferId]| {
        program.instructions.extend(bufs.iter().map(|&buf| Instr::Free { buf }));
    };
    let receive_shard = |program: &mut Program, step: usize| {
        let shard = [0, 1, 2].map(|part| {
            let buffer_name = format!("{name}.shard{step}.{}", part_name[part]);
            new_buffer(program, buffer_name, weight_shape(part), BufferKind::InFlight, x)
        });
        program.instructions.push(Instr::Recv { outs: shard.to_vec(), peer: from });
        shard
    };
    let mut shard = own;
    if steps > 1 {
        program.instructions.push(Instr::Send { bufs: own.to_vec(), peer: to });
        shard = receive_shard(program, 0);
    }
    let mut dx_sum: Option<BufferId> = None;
    for step in 0..steps {
        let last = step + 1 == steps;
        // The shard goes on unless the next rank owns it.
        if step + 2 < steps {
            program.instructions.push(Instr::Send { bufs: shard.to_vec(), peer: to });
        }
        let new = |program: &mut Program, part: &str, shape: Vec<u64>| {
            new_buffer(program, format!("{name}.step{step}.{part}"), shape, BufferKind::Activation, x)
        };
        // Recompute the shard's activations on the rank's tokens.
        let gate = new(program, "gate", vec![rows, ffn]);
        kernel(program, Kernel::MatMul { m: rows, n: ffn, k: hidden }, vec![x, shard[0]], gate);
        let up = new(program, "up", vec![rows, ffn]);
        kernel(program, Kernel::MatMul { m: rows, n: ffn, k: hidden }, vec![x, shard[1]], up);
        // With one rank the contributions are the gradients themselves.
        let contribution_buffer = |program: &mut Program, part: usize| match (steps, weight_outs[part]) {
            (1, Some(out)) => out,
            _ => new(program, &format!("grad_{}", part_name[part]), weight_shape(part)),
        };
        // Each contribution joins the gradient that came with the shard (received just now) as soon
        // as it is computed, and the sum goes on at once, so at most one part is live beside the
        // shard; at the last step the sum is the owner's complete gradient.
        let fold = |program: &mut Program, part: usize, contribution: BufferId| {
            if steps == 1 {
                return;
            }
            let total = if step == 0 {
                contribution
            } else {
                let received_name = format!("{name}.grad{step}.{}", part_name[part]);
                let received = new_buffer(program, received_name, weight_shape(part), BufferKind::InFlight, x);
                program.instructions.push(Instr::Recv { outs: vec![received], peer: from });
                let total = match (last, weight_outs[part]) {
                    (true, Some(out)) => out,
                    _ => new(program, &format!("grad_{}_sum", part_name[part]), weight_shape(part)),
                };
                kernel(program, Kernel::Add, vec![received, contribution], total);
                free(program, &[received, contribution]);
                total
            };
            if !last {
                program.instructions.push(Instr::Send { bufs: vec![total], peer: to });
                free(program, &[total]);
            }
        };
        if weight_outs[2].is_some() {
            let act = new(program, "silu_mul", vec![rows, ffn]);
            kernel(program, Kernel::SiluMul, vec![gate, up], act);
            let contribution = contribution_buffer(program, 2);
            kernel(program, Kernel::MatMulGradWeight { m: rows, n: hidden, k: ffn }, vec![dy, act], contribution);
            free(program, &[act]);
            fold(program, 2, contribution);
        }
        let d_act = new(program, "d_silu_mul", vec![rows, ffn]);
        kernel(program, Kernel::MatMulGradInput { m: rows, n: hidden, k: ffn }, vec![dy, shard[2]], d_act);
        let d_gate = new(program, "d_gate", vec![rows, ffn]);
        kernel(program, Kernel::SiluMulGradGate, vec![gate, up, d_act], d_gate);
        free(program, &[up]);
        let d_up = new(program, "d_up", vec![rows, ffn]);
        kernel(program, Kernel::SiluMul, vec![gate, d_act], d_up);
        free(program, &[gate, d_act]);
        for (part, d_projection) in [(0, d_gate), (1, d_up)] {
            if weight_outs[part].is_some() {
                let contribution = contribution_buffer(program, part);
                let grad_weight = Kernel::MatMulGradWeight { m: rows, n: ffn, k: hidden };
                kernel(program, grad_weight, vec![d_projection, x], contribution);
                fold(program, part, contribution);
            }
            if let Some(dx_out) = dx_out {
                let finishes = last && part == 1;
                let target = if finishes && dx_sum.is_none() { dx_out } else { new(program, "dx", vec![rows, hidden]) };
                let grad_input = Kernel::MatMulGradInput { m: rows, n: ffn, k: hidden };
                kernel(program, grad_input, vec![d_projection, shard[part]], target);
                dx_sum = Some(match dx_sum {
                    None => target,
                    Some(sum) => {
                        let total = if finishes { dx_out } else { new(program, "dx_sum", vec![rows, hidden]) };
                        kernel(program, Kernel::Add, vec![sum, target], total);
                        free(program, &[sum, target]);
                        total
                    }
                });
            }
            free(program, &[d_projection]);
        }
        if !last {
            // Done with the shard (sent on already): the next one, or the rank's own at the end.
            free(program, &shard);
            shard = if step + 2 < steps { receive_shard(program, step + 1) } else { own };
        }
    }
}

/// Expands ring attention over `group`: in step s the rank attends its queries against the key/value
/// block it holds (its own at s = 0, then the block of the rank s places before it), with that
/// block's positions, and merges the result into its running state (output and log-sum-exp a row)
/// while the block travels on to the next rank; the previous rank's block is received after the
/// step's attention, so the transfer runs under the compute. The last step sends nothing: D - 1
/// hops. No block is skipped: in the zigzag layout every block holds an early and a late chunk, so
/// each block has keys that some local query sees; the kernel itself skips fully masked key tiles.
/// On one rank this is the plain attention kernel.
fn lower_ring_attention(
    program: &mut Program,
    name: &str,
    inputs: &[BufferId],
    out: BufferId,
    group: &[u32],
    rank: u32,
    dims: AttentionDims,
) {
    let AttentionDims { batch, sq, hq, head_dim, .. } = dims;
    let steps = group.len();
    if steps == 1 {
        let kernel = Kernel::Attention { dims, with_lse: false };
        program.instructions.push(Instr::Kernel { kernel, inputs: inputs.to_vec(), out });
        return;
    }
    // Each step's partial result carries its rows' log-sum-exp, for the merges.
    let attend = Kernel::Attention { dims, with_lse: true };
    let (next, previous) = ring_neighbours(group, rank);
    let (q, q_pos) = (inputs[0], inputs[3]);
    let mut block = [inputs[1], inputs[2], inputs[4]];
    let state_shape = vec![batch, sq, hq, head_dim + 1];
    let rows = batch * sq * hq;
    let mut state: Option<BufferId> = None;
    for step in 0..steps {
        let last = step + 1 == steps;
        if !last {
            program.instructions.push(Instr::Send { bufs: block.to_vec(), peer: next });
        }
        let partial =
            new_buffer(program, format!("{name}.step{step}.attention"), state_shape.clone(), BufferKind::Activation, q);
        program.instructions.push(Instr::Kernel {
            kernel: attend.clone(),
            inputs: vec![q, block[0], block[1], q_pos, block[2]],
            out: partial,
        });
        state = Some(match state {
            None => partial,
            Some(running) => {
                let merged = new_buffer(
                    program,
                    format!("{name}.step{step}.merged"),
                    state_shape.clone(),
                    BufferKind::Activation,
                    q,
                );
                program.instructions.push(Instr::Kernel {
                    kernel: Kernel::MergeAttention { rows, head_dim },
                    inputs: vec![running, partial],
                    out: merged,
                });
                program.instructions.push(Instr::Free { buf: running });
                program.instructions.push(Instr::Free { buf: partial });
                merged
            }
        });
        if !last {
            let shapes = [program.buffer(block[0]).shape.clone(), program.buffer(block[1]).shape.clone()];
            let [k_shape, v_shape] = shapes;
            let pos_shape = program.buffer(block[2]).shape.clone();
            let k_next =
                new_buffer(program, format!("{name}.block{}.k", step + 1), k_shape, BufferKind::InFlight, block[0]);
            let v_next =
                new_buffer(program, format!("{name}.block{}.v", step + 1), v_shape, BufferKind::InFlight, block[1]);
            let pos_next = new_buffer(
                program,
                format!("{name}.block{}.k_pos", step + 1),
                pos_shape,
                BufferKind::InFlight,
                block[2],
            );
            let received = [k_next, v_next, pos_next];
            program.instructions.push(Instr::Recv { outs: received.to_vec(), peer: previous });
            if step > 0 {
                for buf in block {
                    program.instructions.push(Instr::Free { buf });
                }
            }
            block = received;
        }
    }
    for buf in block {
        program.instructions.push(Instr::Free { buf });
    }
    let state = state.expect("a ring has at least one step");
    let region = vec![(0, batch), (0, sq), (0, hq), (0, head_dim)];
    program.instructions.push(Instr::Kernel {
        kernel: Kernel::Slice { shape: vec![batch, sq, hq, head_dim + 1], region },
        inputs: vec![state],
        out,
    });
    program.instructions.push(Instr::Free { buf: state });
}

#[cfg(test)]
#[path = "lower_tests.rs"]
mod tests;
