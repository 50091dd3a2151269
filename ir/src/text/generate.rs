//! A generator of random well-formed modules, for the round-trip properties.
//!
//! Like cranelift's fuzzgen it builds valid programs rather than random bytes: ops see the named dims
//! they expect, every dim size divides by every mesh axis (so any spec is valid), each axis appears at
//! most once in a spec, and nodes are inserted into the program order right after their latest
//! operand, so the order stays topological. Every decision reads a number from a proptest vector; a
//! shrunk (shorter, smaller) vector gives a smaller module.

use proptest::prelude::*;

use crate::entity::EntityRef;
use crate::model::config::{RopeConfig, RopeScaling};
use crate::{
    AxisName, DType, DimName, Graph, Mesh, MlpOperand, Module, NodeData, NodeId, Op, ShardSpec, TensorType, ValueId,
};

use DimName::{Batch, Ffn, HeadDim, Heads, Hidden, KvHeads, Seq, Vocab};

/// Random well-formed modules; their floats may be infinite.
pub fn modules() -> impl Strategy<Value = Module> {
    prop::collection::vec(any::<u32>(), 0..400)
        .prop_map(|choices| build(&mut Choices { choices, next: 0, finite: false }))
}

/// Random well-formed modules whose floats are all finite (what JSON can hold).
pub fn modules_with_finite_floats() -> impl Strategy<Value = Module> {
    prop::collection::vec(any::<u32>(), 0..400)
        .prop_map(|choices| build(&mut Choices { choices, next: 0, finite: true }))
}

/// A stream of decisions; reads past its end give 0, the simplest choice.
struct Choices {
    choices: Vec<u32>,
    next: usize,
    /// Whether floats must be finite.
    finite: bool,
}

impl Choices {
    fn take(&mut self) -> u32 {
        let choice = self.choices.get(self.next).copied().unwrap_or(0);
        self.next += 1;
        choice
    }
    /// A number in `0..count` (`count` > 0).
    fn below(&mut self, count: usize) -> usize {
        self.take() as usize % count
    }
    fn flip(&mut self) -> bool {
        self.take() % 2 == 1
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
    /// Any `f64` except NaN (which equals nothing, itself included): infinities (unless `finite`),
    /// zeros of both signs, subnormals, and often a plain value like a real model's.
    fn float(&mut self) -> f64 {
        if self.flip() {
            return self.pick(&[1e-5, 1e-6, 10000.0, 500000.0, 0.5, 8.0]);
        }
        let bits = (u64::from(self.take()) << 32) | u64::from(self.take());
        let value = f64::from_bits(bits);
        if value.is_nan() || (self.finite && value.is_infinite()) {
            1.0
        } else {
            value
        }
    }
    /// A name: usually dotted like `layer3.attn_norm`, sometimes with characters the printer must escape.
    fn name(&mut self) -> String {
        const PLAIN: &[&str] = &["layer0", "attn", "mlp", "q_proj", "weight", "model", "7", "all_reduce"];
        const ODD: &[&str] = &[" ", "#", "\\", "\"", "\n", "\r", "\t", "é", "=", "; ", "\\n", "# n3", " mesh=", "v1"];
        let parts = self.below(4);
        let mut name = String::new();
        for index in 0..parts {
            if index > 0 {
                name.push('.');
            }
            if self.below(5) == 0 {
                name.push_str(self.pick(ODD));
            }
            name.push_str(self.pick(PLAIN));
        }
        if self.below(6) == 0 {
            name.push_str(self.pick(ODD));
        }
        name
    }
}

/// Builds one module from `choices`.
fn build(choices: &mut Choices) -> Module {
    let mut axes = AxisName::ALL.to_vec();
    let mut mesh_axes = Vec::new();
    for _ in 0..choices.below(4) {
        let axis = axes.remove(choices.below(axes.len()));
        mesh_axes.push((axis, choices.pick(&[1, 2, 4])));
    }
    let mesh = Mesh::new(&mesh_axes).unwrap_or_default();
    let world = mesh.world_size();
    let size = |choices: &mut Choices| world * (1 + choices.below(3) as u64);
    let sizes: Vec<(DimName, u64)> = DimName::ALL.iter().map(|&name| (name, size(choices))).collect();
    let mut builder =
        Builder { graph: Graph::new(), mesh, sizes, dtype: choices.pick(&[DType::F32, DType::Bf16, DType::F16]) };
    builder.populate(choices);
    let graph = detach_some(builder.graph, choices);
    Module { name: choices.name(), mesh: builder.mesh, graph }
}

struct Builder {
    graph: Graph,
    mesh: Mesh,
    sizes: Vec<(DimName, u64)>,
    dtype: DType,
}

impl Builder {
    fn ty(&self, names: &[DimName]) -> TensorType {
        self.typed(self.dtype, names)
    }

    fn typed(&self, dtype: DType, names: &[DimName]) -> TensorType {
        let dims: Vec<(DimName, u64)> = names
            .iter()
            .map(|&name| *self.sizes.iter().find(|(known, _)| *known == name).unwrap_or(&(name, 1)))
            .collect();
        TensorType::new(dtype, &dims)
    }

    /// The values whose dim names are exactly `names`.
    fn values_shaped(&self, names: &[DimName]) -> Vec<ValueId> {
        self.graph
            .order()
            .iter()
            .map(|&node| self.graph.node(node).result)
            .filter(|&value| self.graph.value(value).ty.shape.names() == names)
            .collect()
    }

    /// A spec for a value of `rank` dims: each mesh axis splits some dim, is partial, or is unused.
    fn spec(&self, rank: usize, choices: &mut Choices) -> ShardSpec {
        let mut spec = ShardSpec::replicated(rank);
        for axis in self.mesh.axes() {
            match choices.below(4) {
                0 if rank > 0 => spec.dims[choices.below(rank)].push(axis.name),
                1 => spec.partial.push(axis.name),
                _ => {}
            }
        }
        spec
    }

    /// Adds a node at the end, or right after the latest of its operands; gives it a random spec.
    fn node(&mut self, op: Op, inputs: &[ValueId], ty: TensorType, choices: &mut Choices) -> ValueId {
        let spec = self.spec(ty.shape.rank(), choices);
        let name = choices.name();
        let order = self.graph.order();
        let latest_input =
            inputs.iter().filter_map(|&input| order.iter().position(|&node| node == self.graph.value(input).def)).max();
        match latest_input {
            Some(position) if choices.flip() => {
                let anchor = order[position];
                self.graph.insert_after(anchor, op, inputs, ty, spec, &name)
            }
            _ => {
                let value = self.graph.add(op, inputs, ty, &name);
                self.graph.value_mut(value).spec = spec;
                value
            }
        }
    }

    fn param(&mut self, names: &[DimName], choices: &mut Choices) -> ValueId {
        let ty = self.ty(names);
        let name = choices.name();
        self.node(Op::Param { name }, &[], ty, choices)
    }

    fn populate(&mut self, choices: &mut Choices) {
        let tokens_ty = self.typed(DType::I32, &[Batch, Seq]);
        let tokens = self.node(Op::Tokens, &[], tokens_ty, choices);
        let positions_ty = self.typed(DType::I32, &[Seq]);
        let positions = self.node(Op::Positions, &[], positions_ty, choices);
        let table = self.param(&[Vocab, Hidden], choices);
        self.node(Op::Embedding, &[table, tokens], self.ty(&[Batch, Seq, Hidden]), choices);
        for _ in 0..choices.below(24) {
            self.step(positions, choices);
        }
        for _ in 0..choices.below(3) {
            let values = self.graph.value_count();
            self.graph.add_output(ValueId::new(choices.below(values)));
        }
    }

    /// Adds one random op on existing values of the shapes it needs.
    fn step(&mut self, positions: ValueId, choices: &mut Choices) {
        const STREAM: &[DimName] = &[Batch, Seq, Hidden];
        const Q: &[DimName] = &[Batch, Seq, Heads, HeadDim];
        const KV: &[DimName] = &[Batch, Seq, KvHeads, HeadDim];
        let stream = self.values_shaped(STREAM);
        let (queries, keys) = (self.values_shaped(Q), self.values_shaped(KV));
        let Some(&x) = stream.get(choices.below(stream.len().max(1))) else { return };
        match choices.below(10) {
            0 => {
                let weight = self.param(&[Hidden], choices);
                self.node(Op::RmsNorm { eps: choices.float() }, &[x, weight], self.ty(STREAM), choices);
            }
            1 => {
                let (weight_dims, out): (&[DimName], &[DimName]) = match choices.below(4) {
                    0 => (&[Heads, HeadDim, Hidden], Q),
                    1 => (&[KvHeads, HeadDim, Hidden], KV),
                    2 => (&[Ffn, Hidden], &[Batch, Seq, Ffn]),
                    _ => (&[Vocab, Hidden], &[Batch, Seq, Vocab]),
                };
                let weight = self.param(weight_dims, choices);
                self.node(Op::MatMul { contract: 1 }, &[x, weight], self.ty(out), choices);
            }
            2 if !queries.is_empty() => {
                let attention = choices.pick(&queries);
                let weight = self.param(&[Hidden, Heads, HeadDim], choices);
                self.node(Op::MatMul { contract: 2 }, &[attention, weight], self.ty(STREAM), choices);
            }
            3 if !queries.is_empty() || !keys.is_empty() => {
                let (pool, names) = if keys.is_empty() || (!queries.is_empty() && choices.flip()) {
                    (&queries, Q)
                } else {
                    (&keys, KV)
                };
                let input = choices.pick(pool);
                let scaling = match choices.flip() {
                    false => RopeScaling::None,
                    true => RopeScaling::Llama3 {
                        factor: choices.float(),
                        low_freq_factor: choices.float(),
                        high_freq_factor: choices.float(),
                        original_max_position_embeddings: u64::from(choices.take()) << choices.below(32),
                    },
                };
                let rope = RopeConfig { theta: choices.float(), scaling };
                self.node(Op::Rope { rope }, &[input, positions], self.ty(names), choices);
            }
            4 if !queries.is_empty() && !keys.is_empty() => {
                let (q, k, v) = (choices.pick(&queries), choices.pick(&keys), choices.pick(&keys));
                let causal = choices.flip();
                let op = match self.mesh.axes().first().filter(|_| choices.flip()) {
                    Some(axis) => Op::RingAttention { axis: axis.name, causal },
                    None => Op::Attention { causal },
                };
                self.node(op, &[q, k, v, positions, positions], self.ty(Q), choices);
            }
            5 => {
                let other = choices.pick(&stream);
                let op = if choices.flip() { Op::SiluMul } else { Op::Add };
                self.node(op, &[x, other], self.ty(STREAM), choices);
            }
            6 if !self.mesh.axes().is_empty() => {
                let axis = self.mesh.axes()[choices.below(self.mesh.axes().len())].name;
                let dim = choices.pick(STREAM);
                let op = match choices.below(9) {
                    0 => Op::AllReduce { axis },
                    8 => Op::ReduceToRoot { axis, dim, root: u64::from(choices.take()) },
                    7 => Op::AllToAll { axis, split_dim: dim, gather_dim: choices.pick(STREAM) },
                    1 => Op::ReduceScatter { axis, dim },
                    2 => Op::AllGather { axis, dim },
                    3 => Op::BroadcastShard { axis, dim, root: u64::from(choices.take()) },
                    4 => Op::Zigzag { parts: u64::from(choices.take()), inverse: choices.flip() },
                    5 => {
                        let weights = [self.param(&[Ffn, Hidden], choices), self.param(&[Ffn, Hidden], choices)];
                        let down = self.param(&[Hidden, Ffn], choices);
                        let op = Op::RingGatedMlp { axis };
                        self.node(op, &[x, weights[0], weights[1], down], self.ty(STREAM), choices);
                        return;
                    }
                    _ => Op::LocalSlice { axis, dim },
                };
                self.node(op, &[x], self.ty(STREAM), choices);
            }
            7 => {
                let bias = self.param(&[Hidden], choices);
                self.node(Op::Add, &[x, bias], self.ty(STREAM), choices);
            }
            8 => self.training_step(x, positions, choices),
            _ => {
                self.param(&[Ffn, Hidden], choices);
            }
        }
    }

    /// A mesh axis for a vocab-parallel loss, or `None` for the plain one.
    fn vocab_axis(&self, choices: &mut Choices) -> Option<AxisName> {
        let axes = self.mesh.axes();
        let pick = choices.below(axes.len() + 1);
        axes.get(pick).map(|axis| axis.name)
    }

    /// Adds one loss or backward op; `x` is a `[batch, seq, hidden]` value.
    fn training_step(&mut self, x: ValueId, positions: ValueId, choices: &mut Choices) {
        const STREAM: &[DimName] = &[Batch, Seq, Hidden];
        const Q: &[DimName] = &[Batch, Seq, Heads, HeadDim];
        const KV: &[DimName] = &[Batch, Seq, KvHeads, HeadDim];
        let Some(tokens) = self.values_shaped(&[Batch, Seq]).first().copied() else { return };
        let stream = self.values_shaped(STREAM);
        let other = choices.pick(&stream);
        let vocab = self.sizes.iter().find(|(name, _)| *name == Vocab).map_or(1, |&(_, size)| size);
        let (op, inputs, names): (Op, Vec<ValueId>, &[DimName]) = match choices.below(14) {
            0 => {
                let logits = self.param(&[Batch, Seq, Vocab], choices);
                let ty = self.typed(DType::F32, &[]);
                let op = match self.vocab_axis(choices) {
                    Some(axis) => Op::VocabParallelCrossEntropy { axis },
                    None => Op::CrossEntropy,
                };
                self.node(op, &[logits, tokens], ty, choices);
                return;
            }
            1 => {
                let logits = self.param(&[Batch, Seq, Vocab], choices);
                let op = match self.vocab_axis(choices) {
                    Some(axis) => Op::VocabParallelCrossEntropyGrad { axis },
                    None => Op::CrossEntropyGrad,
                };
                (op, vec![logits, tokens], &[Batch, Seq, Vocab])
            }
            2 => {
                let weight = self.param(&[Hidden, Ffn], choices);
                (Op::MatMulGradInput { contract: 1 }, vec![x, weight], &[Batch, Seq, Ffn])
            }
            3 => {
                let dy = self.param(&[Batch, Seq, Ffn], choices);
                (Op::MatMulGradWeight { contract: 1 }, vec![dy, x], &[Ffn, Hidden])
            }
            4 => {
                let weight = self.param(&[Hidden], choices);
                (Op::RmsNormGradInput { eps: choices.float() }, vec![x, weight, other], STREAM)
            }
            5 => (Op::RmsNormGradWeight { eps: choices.float() }, vec![x, other], &[Hidden]),
            6 => {
                let rope = RopeConfig { theta: choices.float(), scaling: RopeScaling::None };
                let input = self.param(Q, choices);
                (Op::RopeGrad { rope }, vec![input, positions], Q)
            }
            index @ 7..=9 => {
                let (q, k, v) = (self.param(Q, choices), self.param(KV, choices), self.param(KV, choices));
                let dy = self.param(Q, choices);
                let causal = choices.flip();
                let (op, names): (Op, &[DimName]) = match index {
                    7 => (Op::AttentionGradQuery { causal }, Q),
                    8 => (Op::AttentionGradKey { causal }, KV),
                    _ => (Op::AttentionGradValue { causal }, KV),
                };
                (op, vec![q, k, v, positions, positions, dy], names)
            }
            10 => (Op::SiluMulGradGate, vec![x, other, x], STREAM),
            11 => (Op::EmbeddingGrad { vocab }, vec![x, tokens], &[Vocab, Hidden]),
            12 if !self.mesh.axes().is_empty() => {
                let axis = self.mesh.axes()[choices.below(self.mesh.axes().len())].name;
                let weights = [self.param(&[Ffn, Hidden], choices), self.param(&[Ffn, Hidden], choices)];
                let down = self.param(&[Hidden, Ffn], choices);
                let wrt = MlpOperand::ALL[choices.below(4)];
                let names: &[DimName] = match wrt {
                    MlpOperand::Input => STREAM,
                    MlpOperand::Gate | MlpOperand::Up => &[Ffn, Hidden],
                    MlpOperand::Down => &[Hidden, Ffn],
                };
                (Op::RingGatedMlpGrad { axis, wrt }, vec![x, weights[0], weights[1], down, other], names)
            }
            _ => (Op::SumLeading { keep: 1 }, vec![x], &[Hidden]),
        };
        let ty = self.ty(names);
        self.node(op, &inputs, ty, choices);
    }
}

/// Sometimes takes a few nodes out of the program order (as a pass that drops dead nodes would).
fn detach_some(graph: Graph, choices: &mut Choices) -> Graph {
    // Exhausted choices read 0, and then nothing is detached: small inputs give plain graphs.
    if choices.below(4) != 1 {
        return graph;
    }
    let nodes: Vec<NodeData> = (0..graph.node_count()).map(|index| graph.node(NodeId::new(index)).clone()).collect();
    let values = (0..graph.value_count()).map(|index| graph.value(ValueId::new(index)).clone()).collect();
    let order = graph.order().iter().copied().filter(|_| choices.below(5) != 1).collect();
    Graph::from_parts(nodes, values, order, graph.outputs().to_vec())
}
