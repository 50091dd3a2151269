//! The IR verifier.
//!
//! It checks every invariant a pass may rely on and reports all violations at once, each naming the
//! node and saying what is wrong. Invariants:
//! 1. **Order**: the program order lists every node exactly once; each node's result value is
//!    defined by that node; graph outputs exist.
//! 2. **Def before use**: every operand is defined earlier in the program order.
//! 3. **Arity and types**: each op has its number of operands, and its result type is the one its
//!    typing rule derives from the operands (named dims, sizes, dtypes).
//! 4. **Spec/shape agreement**: a spec has one entry a dim, names only axes of the mesh, uses an
//!    axis at most once, and every split dim divides by the product of its axes' degrees.
//! 5. **Sharding rules**: each result's spec is the one its op's rule derives from the operands'
//!    specs (`sharding::output_spec`), so running the op on local blocks is correct on every rank.
//! 6. **Outputs** are replicated, so every rank can return the whole result.
//!
//! Collective matching across ranks (every member of a group issues the same collectives in the
//! same order with the same sizes) is a property of the per-rank programs, checked after lowering
//! by `pleat_backend::verify_collectives`.

use pleat_ir::{DType, DimName, Graph, Mesh, Module, NodeData, NodeId, Op, Shape, TensorType};

use crate::sharding;

/// One verifier finding.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
#[error("{node} {name} ({op}): {message}")]
#[diagnostic(code(E0408), help("fix the named node; if a pleat pass produced it, report it"))]
pub struct VerifierError {
    /// The node at fault.
    pub node: NodeId,
    /// Its name.
    pub name: String,
    /// Its op's mnemonic.
    pub op: &'static str,
    /// What is wrong.
    pub message: String,
}

/// Every finding of one verification.
#[derive(Debug, Clone, Default, PartialEq, thiserror::Error, miette::Diagnostic)]
#[error("{} verifier error(s); first: {}", .errors.len(), .errors.first().map(ToString::to_string).unwrap_or_default())]
#[diagnostic(code(E0409), help("fix the first finding's node; the rest often follow from it"))]
pub struct VerifierErrors {
    /// The findings, in program order.
    pub errors: Vec<VerifierError>,
}

struct Verifier<'a> {
    module: &'a Module,
    errors: Vec<VerifierError>,
}

impl Verifier<'_> {
    fn report(&mut self, node: NodeId, message: String) {
        let data = self.module.graph.node(node);
        self.errors.push(VerifierError { node, name: data.name.clone(), op: data.op.mnemonic(), message });
    }
}

/// Verifies `module`, returning every violation found.
pub fn verify(module: &Module) -> Result<(), VerifierErrors> {
    let mut verifier = Verifier { module, errors: Vec::new() };
    let graph = &module.graph;
    let mut position = vec![None; graph.node_count()];
    for (index, &node) in graph.order().iter().enumerate() {
        if !graph.has_node(node) {
            // Without the node there is nothing to attach the error to but the neighbourhood.
            verifier.errors.push(VerifierError {
                node,
                name: String::new(),
                op: "?",
                message: "the program order names a node that does not exist".into(),
            });
            return Err(VerifierErrors { errors: verifier.errors });
        }
        if position[node.as_u32() as usize].is_some() {
            verifier.report(node, "appears twice in the program order".into());
        }
        position[node.as_u32() as usize] = Some(index);
    }
    for (index, slot) in position.iter().enumerate() {
        if slot.is_none() {
            let node = <NodeId as pleat_ir::entity::EntityRef>::new(index);
            verifier.report(node, "is missing from the program order".into());
        }
    }
    if !verifier.errors.is_empty() {
        return Err(VerifierErrors { errors: verifier.errors });
    }
    for (index, &node) in graph.order().iter().enumerate() {
        verify_node(&mut verifier, graph, node, index, &position);
    }
    for &output in graph.outputs() {
        if !graph.has_value(output) {
            let last = *graph.order().last().expect("a graph with outputs has nodes");
            verifier.report(last, format!("graph output {output} does not exist"));
        } else if !graph.value(output).spec.partial.is_empty() {
            // A split output is assembled from the ranks' blocks (a gradient laid out as its
            // parameter); a pending sum has no block to assemble.
            let def = graph.value(output).def;
            let spec = sharding::spec_text(&graph.value(output).spec, &graph.value(output).ty.shape);
            verifier.report(def, format!("is a graph output but laid out {spec}; outputs must be summed first"));
        }
    }
    if verifier.errors.is_empty() {
        Ok(())
    } else {
        Err(VerifierErrors { errors: verifier.errors })
    }
}

fn verify_node(verifier: &mut Verifier, graph: &Graph, node: NodeId, index: usize, position: &[Option<usize>]) {
    let data = graph.node(node);
    if !graph.has_value(data.result) || graph.value(data.result).def != node {
        verifier.report(node, format!("its result {} is not defined by it", data.result));
        return;
    }
    if data.inputs.len() != data.op.arity() {
        verifier.report(node, format!("takes {} operand(s), has {}", data.op.arity(), data.inputs.len()));
        return;
    }
    for &input in &data.inputs {
        let defined_before =
            graph.has_value(input) && position[graph.value(input).def.as_u32() as usize].is_some_and(|at| at < index);
        if !defined_before {
            verifier.report(node, format!("operand {input} is not defined before its use"));
            return;
        }
    }
    let types: Vec<&TensorType> = data.inputs.iter().map(|&input| &graph.value(input).ty).collect();
    let result = graph.value(data.result);
    if data.op.arity() == 0 {
        if let Err(message) = check_leaf(&data.op, &result.ty) {
            verifier.report(node, message);
            return;
        }
    } else {
        match infer_type(data, &types, &verifier.module.mesh) {
            Ok(expected) if expected.dtype == result.ty.dtype => {
                if expected.shape != result.ty.shape {
                    let message = format!(
                        "result shape {} should be {}",
                        shape_text(&result.ty.shape),
                        shape_text(&expected.shape)
                    );
                    verifier.report(node, message);
                    return;
                }
            }
            Ok(expected) => {
                verifier.report(node, format!("result dtype {} should be {}", result.ty.dtype, expected.dtype));
                return;
            }
            Err(message) => {
                verifier.report(node, message);
                return;
            }
        }
    }
    if let Err(message) = check_spec_shape(verifier.module, data) {
        verifier.report(node, message);
        return;
    }
    if let Err(message) = sharding::check_node(graph, data) {
        verifier.report(node, message);
    }
}

fn shape_text(shape: &Shape) -> String {
    let dims: Vec<String> = shape.dims().iter().map(|dim| format!("{}={}", dim.name, dim.size)).collect();
    format!("[{}]", dims.join(", "))
}

fn check_spec_shape(module: &Module, data: &NodeData) -> Result<(), String> {
    let value = module.graph.value(data.result);
    let spec = &value.spec;
    if spec.dims.len() != value.ty.shape.rank() {
        return Err(format!("its spec has {} dim entries for a rank-{} value", spec.dims.len(), value.ty.shape.rank()));
    }
    let mut seen = Vec::new();
    for &axis in spec.dims.iter().flatten().chain(&spec.partial) {
        if module.mesh.axis(axis).is_none() {
            return Err(format!("its spec uses axis {axis}, which the mesh {} lacks", module.mesh));
        }
        if seen.contains(&axis) {
            return Err(format!("its spec uses axis {axis} twice"));
        }
        seen.push(axis);
    }
    spec.local_sizes(&value.ty.shape, &module.mesh).map(|_| ()).map_err(|(dim, degree)| {
        let dim = value.ty.shape.dims()[dim];
        format!("{}={} does not divide by the {degree} ranks splitting it", dim.name, dim.size)
    })
}

/// The result type the op derives from its operand types.
pub fn infer_type(node: &NodeData, inputs: &[&TensorType], mesh: &Mesh) -> Result<TensorType, String> {
    use DimName::*;
    let expect_dims = |operand: usize, names: &[DimName]| -> Result<(), String> {
        let got = inputs[operand].shape.names();
        if got == names {
            Ok(())
        } else {
            let want: Vec<&str> = names.iter().map(|name| name.as_str()).collect();
            Err(format!(
                "operand {operand} has dims {} but {} wants [{}]",
                shape_text(&inputs[operand].shape),
                node.op.mnemonic(),
                want.join(", ")
            ))
        }
    };
    let size = |operand: usize, name: DimName| inputs[operand].shape.size_of(name).unwrap_or(0);
    let same_size = |left: (usize, DimName), right: (usize, DimName)| -> Result<(), String> {
        if size(left.0, left.1) == size(right.0, right.1) {
            Ok(())
        } else {
            Err(format!(
                "operand {} {}={} differs from operand {} {}={}",
                left.0,
                left.1,
                size(left.0, left.1),
                right.0,
                right.1,
                size(right.0, right.1)
            ))
        }
    };
    let int_operand = |operand: usize| -> Result<(), String> {
        if inputs[operand].dtype == DType::I32 {
            Ok(())
        } else {
            Err(format!("operand {operand} must be i32, is {}", inputs[operand].dtype))
        }
    };
    match &node.op {
        Op::Tokens | Op::Positions | Op::Param { .. } => Err("leaves have no typing rule".into()),
        Op::Embedding => {
            expect_dims(0, &[Vocab, Hidden])?;
            expect_dims(1, &[Batch, Seq])?;
            int_operand(1)?;
            let shape = Shape::new(&[(Batch, size(1, Batch)), (Seq, size(1, Seq)), (Hidden, size(0, Hidden))]);
            Ok(TensorType { dtype: inputs[0].dtype, shape })
        }
        Op::RmsNorm { .. } => {
            expect_dims(1, &[Hidden])?;
            if inputs[0].shape.dims().last().map(|dim| dim.name) != Some(Hidden) {
                return Err("operand 0 must end in hidden".into());
            }
            same_size((0, Hidden), (1, Hidden))?;
            Ok(inputs[0].clone())
        }
        Op::MatMul { contract } => {
            let contract = *contract as usize;
            let (x, w) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            if contract == 0 || contract > x.len() || contract > w.len() {
                return Err(format!("contract={contract} does not fit operands of rank {} and {}", x.len(), w.len()));
            }
            if x[x.len() - contract..] != w[w.len() - contract..] {
                return Err(format!(
                    "contracted dims differ: {} vs {}",
                    shape_text(&Shape(x[x.len() - contract..].to_vec())),
                    shape_text(&Shape(w[w.len() - contract..].to_vec()))
                ));
            }
            let dims: Vec<_> = x[..x.len() - contract].iter().chain(&w[..w.len() - contract]).copied().collect();
            let shape = Shape(dims);
            if shape.names().iter().enumerate().any(|(index, name)| shape.names()[..index].contains(name)) {
                return Err(format!("the product {} repeats a dim name", shape_text(&shape)));
            }
            Ok(TensorType { dtype: inputs[0].dtype, shape })
        }
        Op::Rope { .. } => {
            let heads = inputs[0].shape.dims().get(2).map_or(Heads, |dim| dim.name);
            expect_dims(0, &[Batch, Seq, if heads == KvHeads { KvHeads } else { Heads }, HeadDim])?;
            expect_dims(1, &[Seq])?;
            int_operand(1)?;
            same_size((0, Seq), (1, Seq))?;
            if size(0, HeadDim) % 2 != 0 {
                return Err(format!("head_dim={} must be even for rope", size(0, HeadDim)));
            }
            Ok(inputs[0].clone())
        }
        Op::Attention { .. } | Op::RingAttention { .. } => {
            expect_dims(0, &[Batch, Seq, Heads, HeadDim])?;
            expect_dims(1, &[Batch, Seq, KvHeads, HeadDim])?;
            expect_dims(2, &[Batch, Seq, KvHeads, HeadDim])?;
            expect_dims(3, &[Seq])?;
            expect_dims(4, &[Seq])?;
            int_operand(3)?;
            int_operand(4)?;
            if inputs[1].shape != inputs[2].shape {
                return Err("keys and values differ in shape".into());
            }
            same_size((0, Batch), (1, Batch))?;
            same_size((0, HeadDim), (1, HeadDim))?;
            same_size((0, Seq), (3, Seq))?;
            same_size((1, Seq), (4, Seq))?;
            if let Op::RingAttention { axis, .. } = &node.op {
                // The ring moves whole key/value blocks: queries and keys cover the same sequence.
                same_size((0, Seq), (1, Seq))?;
                if mesh.axis(*axis).is_none() {
                    return Err(format!("ring_attention over {axis}, which the mesh does not have"));
                }
            }
            if size(1, KvHeads) == 0 || size(0, Heads) % size(1, KvHeads) != 0 {
                return Err(format!("heads={} is not a multiple of kv_heads={}", size(0, Heads), size(1, KvHeads)));
            }
            Ok(inputs[0].clone())
        }
        Op::SiluMul => {
            if inputs[0] != inputs[1] {
                return Err("gate and up differ in type".into());
            }
            Ok(inputs[0].clone())
        }
        Op::Sum { terms } => {
            if *terms < 3 {
                return Err(format!("sum takes at least 3 operands, not {terms}; two are an add"));
            }
            if let Some(index) = inputs.iter().position(|input| *input != inputs[0]) {
                return Err(format!(
                    "operand {index} {} differs from operand 0 {}; a sum's operands have one type",
                    shape_text(&inputs[index].shape),
                    shape_text(&inputs[0].shape)
                ));
            }
            Ok(inputs[0].clone())
        }
        Op::Add => {
            let (a, b) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            if b.len() > a.len() || a[a.len() - b.len()..] != *b {
                return Err(format!(
                    "operand 1 {} must equal operand 0 {} or a trailing run of its dims",
                    shape_text(&inputs[1].shape),
                    shape_text(&inputs[0].shape)
                ));
            }
            Ok(inputs[0].clone())
        }
        Op::CrossEntropy
        | Op::CrossEntropyGrad
        | Op::VocabParallelCrossEntropy { .. }
        | Op::VocabParallelCrossEntropyGrad { .. }
        | Op::MatMulGradInput { .. }
        | Op::MatMulGradWeight { .. }
        | Op::RmsNormGradInput { .. }
        | Op::RmsNormGradInputAdd { .. }
        | Op::RmsNormGradWeight { .. }
        | Op::RopeGrad { .. }
        | Op::AttentionGradQuery { .. }
        | Op::AttentionGradKey { .. }
        | Op::AttentionGradValue { .. }
        | Op::SiluMulGradGate
        | Op::EmbeddingGrad { .. }
        | Op::SumLeading { .. }
        | Op::RingGatedMlpGrad { .. }
        | Op::MoeMlpGrad { .. }
        | Op::SigmoidScaleGradGate
        | Op::RouterProbSumGrad { .. } => infer_training_type(node, inputs, mesh),
        Op::AllReduce { .. } => Ok(inputs[0].clone()),
        Op::BroadcastShard { axis, dim, root } => {
            let Some(position) = inputs[0].shape.position(*dim) else {
                return Err(format!("operand 0 {} has no dim {dim}", shape_text(&inputs[0].shape)));
            };
            let degree = mesh.degree(*axis);
            if *root >= degree {
                return Err(format!("root={root} is not a coordinate of {axis}={degree}"));
            }
            let mut block = inputs[0].clone();
            block.shape.0[position].size /= degree;
            Ok(block)
        }
        Op::ReduceToRoot { axis, dim, root } => {
            let Some(position) = inputs[0].shape.position(*dim) else {
                return Err(format!("operand 0 {} has no dim {dim}", shape_text(&inputs[0].shape)));
            };
            let degree = mesh.degree(*axis);
            if *root >= degree {
                return Err(format!("root={root} is not a coordinate of {axis}={degree}"));
            }
            let mut whole = inputs[0].clone();
            whole.shape.0[position].size *= degree;
            Ok(whole)
        }
        Op::Zigzag { parts, .. } => {
            let seq =
                inputs[0].shape.size_of(Seq).ok_or_else(|| "zigzag needs an operand with a seq dim".to_string())?;
            if *parts == 0 || seq % (2 * parts) != 0 {
                return Err(format!(
                    "seq={seq} is not divisible into 2x{parts} zigzag chunks; use a seq divisible by {}",
                    2 * parts
                ));
            }
            Ok(inputs[0].clone())
        }
        Op::RingGatedMlp { .. } => {
            expect_dims(1, &[Ffn, Hidden])?;
            expect_dims(2, &[Ffn, Hidden])?;
            expect_dims(3, &[Hidden, Ffn])?;
            if inputs[0].shape.dims().last().map(|dim| dim.name) != Some(Hidden) {
                return Err("operand 0 must end in hidden".into());
            }
            same_size((0, Hidden), (1, Hidden))?;
            if inputs[1] != inputs[2] || size(1, Ffn) != size(3, Ffn) || size(3, Hidden) != size(0, Hidden) {
                return Err("gate, up and down disagree on ffn or hidden".into());
            }
            Ok(inputs[0].clone())
        }
        Op::ExpertCounts { .. } | Op::RouterProbSum => {
            expect_dims(1, &[Experts, Hidden])?;
            if inputs[0].shape.dims().last().map(|dim| dim.name) != Some(Hidden) {
                return Err("operand 0 must end in hidden".into());
            }
            same_size((0, Hidden), (1, Hidden))?;
            Ok(TensorType::new(DType::F32, &[(Experts, size(1, Experts))]))
        }
        Op::LoadBalancingLoss => {
            if inputs[0].shape.names() != [Experts] || inputs[1] != inputs[0] {
                return Err(format!(
                    "operands {} and {} must both be [experts]",
                    shape_text(&inputs[0].shape),
                    shape_text(&inputs[1].shape)
                ));
            }
            Ok(TensorType::new(DType::F32, &[]))
        }
        Op::SigmoidScale => {
            let (gate, y) = (inputs[0], inputs[1]);
            if y.shape.dims().split_last().map(|(_, leading)| leading) != Some(gate.shape.dims()) {
                return Err(format!(
                    "operand 1 {} must be operand 0 {} plus a trailing dim",
                    shape_text(&y.shape),
                    shape_text(&gate.shape)
                ));
            }
            Ok(y.clone())
        }
        Op::MoeMlp { top_k, .. } => {
            expect_dims(1, &[Experts, Hidden])?;
            expect_dims(2, &[Experts, Ffn, Hidden])?;
            expect_dims(3, &[Experts, Ffn, Hidden])?;
            expect_dims(4, &[Experts, Hidden, Ffn])?;
            if inputs[0].shape.dims().last().map(|dim| dim.name) != Some(Hidden) {
                return Err("operand 0 must end in hidden".into());
            }
            same_size((0, Hidden), (1, Hidden))?;
            let experts = size(1, Experts);
            if inputs[2] != inputs[3]
                || size(2, Experts) != experts
                || size(4, Experts) != experts
                || size(2, Ffn) != size(4, Ffn)
                || size(2, Hidden) != size(0, Hidden)
                || size(4, Hidden) != size(0, Hidden)
            {
                return Err("the router, gate, up and down disagree on experts, ffn or hidden".into());
            }
            if *top_k == 0 || *top_k > experts {
                return Err(format!("top_k={top_k} must be from 1 to the {experts} experts"));
            }
            Ok(inputs[0].clone())
        }
        Op::ReduceScatter { dim, .. } | Op::AllGather { dim, .. } | Op::LocalSlice { dim, .. } => {
            if inputs[0].shape.position(*dim).is_none() {
                return Err(format!("operand 0 {} has no dim {dim}", shape_text(&inputs[0].shape)));
            }
            Ok(inputs[0].clone())
        }
        Op::AllToAll { split_dim, gather_dim, .. } => {
            for dim in [split_dim, gather_dim] {
                if inputs[0].shape.position(*dim).is_none() {
                    return Err(format!("operand 0 {} has no dim {dim}", shape_text(&inputs[0].shape)));
                }
            }
            if split_dim == gather_dim {
                return Err(format!("all_to_all splits and gathers the same dim {split_dim}; use two different dims"));
            }
            Ok(inputs[0].clone())
        }
    }
}

/// The result type of the loss and the backward ops. A gradient has its forward operand's type, so
/// the rules reuse the forward op's rule where one exists and check the incoming gradient against it.
fn infer_training_type(node: &NodeData, inputs: &[&TensorType], mesh: &Mesh) -> Result<TensorType, String> {
    use DimName::*;
    let mnemonic = node.op.mnemonic();
    let forward = |op: Op, operands: usize| {
        let data =
            NodeData { op, inputs: node.inputs[..operands].to_vec(), result: node.result, name: node.name.clone() };
        infer_type(&data, &inputs[..operands], mesh)
    };
    let same_type = |operand: usize, like: &TensorType, what: &str| {
        if inputs[operand] == like {
            Ok(())
        } else {
            Err(format!(
                "operand {operand} {} {} must have {what}'s type {} {}",
                inputs[operand].dtype,
                shape_text(&inputs[operand].shape),
                like.dtype,
                shape_text(&like.shape)
            ))
        }
    };
    let token_operand = |logits: &TensorType| {
        let tokens = inputs[1];
        let (batch, seq) = (logits.shape.size_of(Batch), logits.shape.size_of(Seq));
        let expected = Shape::new(&[(Batch, batch.unwrap_or(0)), (Seq, seq.unwrap_or(0))]);
        if tokens.dtype != DType::I32 || tokens.shape != expected {
            return Err(format!(
                "operand 1 must be the tokens i32{}, is {} {}",
                shape_text(&expected),
                tokens.dtype,
                shape_text(&tokens.shape)
            ));
        }
        Ok(())
    };
    match &node.op {
        Op::CrossEntropy
        | Op::CrossEntropyGrad
        | Op::VocabParallelCrossEntropy { .. }
        | Op::VocabParallelCrossEntropyGrad { .. } => {
            let logits = inputs[0];
            if logits.shape.names() != [Batch, Seq, Vocab] {
                return Err(format!("operand 0 {} must be logits [batch, seq, vocab]", shape_text(&logits.shape)));
            }
            token_operand(logits)?;
            if logits.shape.size_of(Seq) < Some(2) {
                return Err("seq must be at least 2 for a next-token loss; use a longer sequence".into());
            }
            if let Some(axis) = node.op.axis().filter(|&axis| mesh.axis(axis).is_none()) {
                return Err(format!("{} over {axis}, which the mesh does not have", node.op.mnemonic()));
            }
            if node.op.is_loss() {
                Ok(TensorType::new(DType::F32, &[]))
            } else {
                Ok(logits.clone())
            }
        }
        Op::MatMulGradInput { contract } | Op::MatMulGradWeight { contract } => {
            let contract = *contract as usize;
            let (dy, other) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            if contract == 0 || contract > other.len() {
                return Err(format!("contract={contract} does not fit operand 1 of rank {}", other.len()));
            }
            let free = other.len() - contract;
            let dims: Vec<_> = if matches!(node.op, Op::MatMulGradInput { .. }) {
                // (dy[F.., G..], w[G.., C..]) -> [F.., C..]
                if dy.len() < free || dy[dy.len() - free..] != other[..free] {
                    return Err(format!(
                        "operand 0 {} must end in operand 1's leading dims {}",
                        shape_text(&inputs[0].shape),
                        shape_text(&Shape(other[..free].to_vec()))
                    ));
                }
                dy[..dy.len() - free].iter().chain(&other[free..]).copied().collect()
            } else {
                // (dy[F.., G..], x[F.., C..]) -> [G.., C..]
                if dy.len() < free || dy[..free] != other[..free] {
                    return Err(format!(
                        "operand 0 {} must start with operand 1's leading dims {}",
                        shape_text(&inputs[0].shape),
                        shape_text(&Shape(other[..free].to_vec()))
                    ));
                }
                dy[free..].iter().chain(&other[free..]).copied().collect()
            };
            let shape = Shape(dims);
            if shape.names().iter().enumerate().any(|(index, name)| shape.names()[..index].contains(name)) {
                return Err(format!("the gradient {} repeats a dim name", shape_text(&shape)));
            }
            Ok(TensorType { dtype: inputs[0].dtype, shape })
        }
        Op::RmsNormGradInput { eps } => {
            let x = forward(Op::RmsNorm { eps: *eps }, 2)?;
            same_type(2, &x, "operand 0")?;
            Ok(x)
        }
        Op::RmsNormGradInputAdd { eps } => {
            let x = forward(Op::RmsNorm { eps: *eps }, 2)?;
            same_type(2, &x, "operand 0")?;
            same_type(3, &x, "operand 0")?;
            Ok(x)
        }
        Op::RmsNormGradWeight { .. } => {
            let x = inputs[0];
            let Some(hidden) = x.shape.dims().last().filter(|dim| dim.name == Hidden) else {
                return Err(format!("operand 0 {} must end in hidden", shape_text(&x.shape)));
            };
            same_type(1, x, "operand 0")?;
            Ok(TensorType { dtype: x.dtype, shape: Shape(vec![*hidden]) })
        }
        Op::RopeGrad { rope } => forward(Op::Rope { rope: rope.clone() }, 2),
        Op::AttentionGradQuery { causal } | Op::AttentionGradKey { causal } | Op::AttentionGradValue { causal } => {
            let output = forward(Op::Attention { causal: *causal }, 5)?;
            same_type(5, &output, "the attention output")?;
            Ok(if matches!(node.op, Op::AttentionGradQuery { .. }) { output } else { inputs[1].clone() })
        }
        Op::RingGatedMlpGrad { axis, wrt } => {
            let output = forward(Op::RingGatedMlp { axis: *axis }, 4)?;
            same_type(4, &output, "the MLP output")?;
            Ok(inputs[wrt.index()].clone())
        }
        Op::MoeMlpGrad { top_k, normalize, dispatch, wrt } => {
            let output = forward(Op::MoeMlp { top_k: *top_k, normalize: *normalize, dispatch: *dispatch }, 5)?;
            same_type(5, &output, "the MoE output")?;
            Ok(inputs[wrt.index()].clone())
        }
        Op::RouterProbSumGrad { wrt } => {
            let sums = forward(Op::RouterProbSum, 2)?;
            same_type(2, &sums, "the probability sums")?;
            match wrt {
                pleat_ir::MoeOperand::Input | pleat_ir::MoeOperand::Router => Ok(inputs[wrt.index()].clone()),
                other => Err(format!("wrt={} is not an operand of router_prob_sum; use x or router", other.as_str())),
            }
        }
        Op::SigmoidScaleGradGate => {
            let y = forward(Op::SigmoidScale, 2)?;
            same_type(2, &y, "operand 1")?;
            Ok(inputs[0].clone())
        }
        Op::SiluMulGradGate => {
            same_type(1, inputs[0], "operand 0")?;
            same_type(2, inputs[0], "operand 0")?;
            Ok(inputs[0].clone())
        }
        Op::EmbeddingGrad { vocab } => {
            let dy = inputs[0];
            if dy.shape.names() != [Batch, Seq, Hidden] {
                return Err(format!("operand 0 {} must be [batch, seq, hidden]", shape_text(&dy.shape)));
            }
            token_operand(dy)?;
            if *vocab == 0 {
                return Err("vocab=0: the table needs at least one row".into());
            }
            let hidden = dy.shape.size_of(Hidden).unwrap_or(0);
            Ok(TensorType::new(dy.dtype, &[(Vocab, *vocab), (Hidden, hidden)]))
        }
        Op::SumLeading { keep } => {
            let dims = inputs[0].shape.dims();
            let keep = *keep as usize;
            if keep > dims.len() {
                return Err(format!("keep={keep} exceeds the rank {} of operand 0", dims.len()));
            }
            Ok(TensorType { dtype: inputs[0].dtype, shape: Shape(dims[dims.len() - keep..].to_vec()) })
        }
        _ => Err(format!("{mnemonic} is not a training op")),
    }
}

/// Leaves declare their own type; this checks its form.
fn check_leaf(op: &Op, ty: &TensorType) -> Result<(), String> {
    use DimName::*;
    let names = ty.shape.names();
    match op {
        Op::Tokens if ty.dtype == DType::I32 && names == [Batch, Seq] => Ok(()),
        Op::Tokens => Err(format!("tokens must be i32[batch, seq], is {} {}", ty.dtype, shape_text(&ty.shape))),
        Op::Positions if ty.dtype == DType::I32 && names == [Seq] => Ok(()),
        Op::Positions => Err(format!("positions must be i32[seq], is {} {}", ty.dtype, shape_text(&ty.shape))),
        _ if ty.dtype == DType::I32 => Err("a param must have a float dtype".into()),
        _ => Ok(()),
    }
}
