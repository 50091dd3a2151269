//! The e-graph language of one transformer layer, and its translation to and from IR ops.
//!
//! Every IR op of a layer has an e-node of the same spelling. Attributes are leaf children, so
//! rules can match and bind them like operands: a mesh axis is the symbol `tp`, a dim is `seq`,
//! and the attributes of compute ops are one symbol each (`eps=0.00001`, `contract=1`,
//! `causal=true`) that the leaf table maps back to the exact `Op`. Tensor leaves (the layer's
//! input, its parameters, the positions) are symbols starting with `%`. The translation is exact:
//! `to_op` of `push_op`'s node gives back the op it was given.

use std::collections::BTreeMap;

use egg::{define_language, Id, Symbol};
use pleat_ir::{AxisName, DimName, Op, ShardSpec, TensorType};

define_language! {
    /// One layer's ops as e-nodes. Children come attributes first, in the IR op's field order,
    /// then the tensor operands in the IR op's operand order:
    /// `(all_reduce AXIS x)`, `(reduce_scatter AXIS DIM x)`, `(all_gather AXIS DIM x)`,
    /// `(local_slice AXIS DIM x)`, `(all_to_all AXIS SPLIT_DIM GATHER_DIM x)`,
    /// `(broadcast_shard AXIS DIM ROOT x)`, `(ring_gated_mlp AXIS x gate up down)`,
    /// `(embedding table tokens)`, `(rms_norm ATTR x weight)`, `(matmul ATTR x weight)`,
    /// `(rope ATTR x positions)`, `(attention ATTR q k v q_positions k_positions)`,
    /// `(silu_mul gate up)`, `(add a b)`, `(zigzag ATTR x)`; leaves are symbols.
    pub enum LayerLang {
        "all_reduce" = AllReduce([Id; 2]),
        "reduce_scatter" = ReduceScatter([Id; 3]),
        "all_gather" = AllGather([Id; 3]),
        "local_slice" = LocalSlice([Id; 3]),
        "all_to_all" = AllToAll([Id; 4]),
        "broadcast_shard" = BroadcastShard([Id; 4]),
        "ring_gated_mlp" = RingGatedMlp([Id; 5]),
        "embedding" = Embedding([Id; 2]),
        "rms_norm" = RmsNorm([Id; 3]),
        "matmul" = MatMul([Id; 3]),
        "rope" = Rope([Id; 3]),
        "attention" = Attention([Id; 6]),
        "silu_mul" = SiluMul([Id; 2]),
        "add" = Add([Id; 2]),
        "zigzag" = Zigzag([Id; 2]),
        Symbol(Symbol),
    }
}

/// What a leaf symbol stands for.
#[derive(Clone, Debug, PartialEq)]
pub enum Leaf {
    /// A tensor defined outside the layer, with its type and layout.
    Tensor {
        /// Element type and global shape.
        ty: TensorType,
        /// Layout over the mesh.
        spec: ShardSpec,
    },
    /// The attributes of a compute op (or a broadcast's root): the whole op they came from.
    Attribute(Op),
}

/// The meaning of every non-axis, non-dim leaf symbol of a layer's e-graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeafTable {
    leaves: BTreeMap<Symbol, Leaf>,
}

impl LeafTable {
    /// An empty table.
    pub fn new() -> LeafTable {
        LeafTable::default()
    }
    /// Declares tensor leaf `name` (a `%` is prepended) and returns its symbol.
    pub fn tensor(&mut self, name: &str, ty: TensorType, spec: ShardSpec) -> Symbol {
        let symbol = Symbol::from(format!("%{}", sanitize(name)));
        self.leaves.insert(symbol, Leaf::Tensor { ty, spec });
        symbol
    }
    /// The leaf `symbol` stands for, if the table declares it.
    pub fn get(&self, symbol: Symbol) -> Option<&Leaf> {
        self.leaves.get(&symbol)
    }
    /// The tensor leaves, in symbol order.
    pub fn tensors(&self) -> impl Iterator<Item = (Symbol, &TensorType, &ShardSpec)> + '_ {
        self.leaves.iter().filter_map(|(&symbol, leaf)| match leaf {
            Leaf::Tensor { ty, spec } => Some((symbol, ty, spec)),
            Leaf::Attribute(_) => None,
        })
    }
    /// The symbol of `op`'s attributes, declared on first use. Two different ops never share one:
    /// a clash of spellings gets a `#n` suffix.
    pub fn attribute(&mut self, op: &Op) -> Symbol {
        let base = attribute_text(op);
        let mut text = base.clone();
        let mut suffix = 1;
        loop {
            let symbol = Symbol::from(text.as_str());
            match self.leaves.get(&symbol) {
                Some(Leaf::Attribute(existing)) if existing == op => return symbol,
                None => {
                    self.leaves.insert(symbol, Leaf::Attribute(op.clone()));
                    return symbol;
                }
                Some(_) => {
                    text = format!("{base}#{suffix}");
                    suffix += 1;
                }
            }
        }
    }
}

/// Names from the graph as symbols: no spaces or parentheses, which s-expressions reserve.
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_whitespace() || c == '(' || c == ')' { '_' } else { c }).collect()
}

/// The readable spelling of a compute op's attributes.
fn attribute_text(op: &Op) -> String {
    match op {
        Op::RmsNorm { eps } => format!("eps={eps}"),
        Op::MatMul { contract } => format!("contract={contract}"),
        Op::Rope { rope } => format!("theta={}", rope.theta),
        Op::Attention { causal } => format!("causal={causal}"),
        Op::Zigzag { parts, inverse } => format!("parts={parts},inverse={inverse}"),
        Op::BroadcastShard { root, .. } => format!("root={root}"),
        other => other.mnemonic().to_string(),
    }
}

/// What a child of an e-node resolves to, as `to_op` needs it.
#[derive(Clone, Debug, PartialEq)]
pub enum ChildKind {
    /// A mesh axis symbol.
    Axis(AxisName),
    /// A dim symbol.
    Dim(DimName),
    /// An attribute symbol and the op it stands for.
    Attribute(Op),
    /// A tensor (a leaf or any op's result).
    Tensor,
    /// Something no op takes.
    Other,
}

/// The IR op an e-node stands for and its tensor operands, given what each child is; `None` when
/// a child is not of the kind its position needs.
pub fn to_op(node: &LayerLang, kind: impl Fn(Id) -> ChildKind) -> Option<(Op, Vec<Id>)> {
    let axis = |id: Id| match kind(id) {
        ChildKind::Axis(axis) => Some(axis),
        _ => None,
    };
    let dim = |id: Id| match kind(id) {
        ChildKind::Dim(dim) => Some(dim),
        _ => None,
    };
    // The attribute symbol must stand for an op of the node's kind.
    let attribute = |id: Id, mnemonic: &str| match kind(id) {
        ChildKind::Attribute(op) if op.mnemonic() == mnemonic => Some(op),
        _ => None,
    };
    let (op, operands): (Op, &[Id]) = match node {
        LayerLang::AllReduce([a, x]) => (Op::AllReduce { axis: axis(*a)? }, std::slice::from_ref(x)),
        LayerLang::ReduceScatter([a, d, x]) => {
            (Op::ReduceScatter { axis: axis(*a)?, dim: dim(*d)? }, std::slice::from_ref(x))
        }
        LayerLang::AllGather([a, d, x]) => (Op::AllGather { axis: axis(*a)?, dim: dim(*d)? }, std::slice::from_ref(x)),
        LayerLang::LocalSlice([a, d, x]) => {
            (Op::LocalSlice { axis: axis(*a)?, dim: dim(*d)? }, std::slice::from_ref(x))
        }
        LayerLang::AllToAll([a, split, gather, x]) => (
            Op::AllToAll { axis: axis(*a)?, split_dim: dim(*split)?, gather_dim: dim(*gather)? },
            std::slice::from_ref(x),
        ),
        LayerLang::BroadcastShard([a, d, root, x]) => {
            let Op::BroadcastShard { root, .. } = attribute(*root, "broadcast_shard")? else { return None };
            (Op::BroadcastShard { axis: axis(*a)?, dim: dim(*d)?, root }, std::slice::from_ref(x))
        }
        LayerLang::RingGatedMlp([a, rest @ ..]) => (Op::RingGatedMlp { axis: axis(*a)? }, rest),
        LayerLang::Embedding(operands) => (Op::Embedding, operands),
        LayerLang::RmsNorm([attr, rest @ ..]) => (attribute(*attr, "rms_norm")?, rest),
        LayerLang::MatMul([attr, rest @ ..]) => (attribute(*attr, "matmul")?, rest),
        LayerLang::Rope([attr, rest @ ..]) => (attribute(*attr, "rope")?, rest),
        LayerLang::Attention([attr, rest @ ..]) => (attribute(*attr, "attention")?, rest),
        LayerLang::SiluMul(operands) => (Op::SiluMul, operands),
        LayerLang::Add(operands) => (Op::Add, operands),
        LayerLang::Zigzag([attr, rest @ ..]) => (attribute(*attr, "zigzag")?, rest),
        LayerLang::Symbol(_) => return None,
    };
    if operands.iter().any(|&operand| kind(operand) != ChildKind::Tensor) {
        return None;
    }
    Some((op, operands.to_vec()))
}

/// Appends the e-node of `op` on `operands` (already in `expr`) to `expr`, with its attribute
/// leaves, declaring attribute symbols in `leaves`. `None` for the leaf ops (tokens, positions,
/// params) and the ops no rule rewrites, which are tensor leaves instead.
pub fn push_op(expr: &mut egg::RecExpr<LayerLang>, leaves: &mut LeafTable, op: &Op, operands: &[Id]) -> Option<Id> {
    let symbol = |expr: &mut egg::RecExpr<LayerLang>, text: &str| expr.add(LayerLang::Symbol(Symbol::from(text)));
    let x = |index: usize| operands[index];
    let node = match op {
        Op::Tokens | Op::Positions | Op::Param { .. } => return None,
        // Ops no rule rewrites are fixed values of the template: context parallelism's ring (its
        // schedule is chosen by `fold-cp`), the routed experts, and the backward ops (training graphs are not rewritten).
        Op::RingAttention { .. }
        | Op::RingGatedMlpGrad { .. }
        | Op::MoeMlp { .. }
        | Op::MoeMlpGrad { .. }
        | Op::SigmoidScale
        | Op::SigmoidScaleGradGate
        | Op::ExpertCounts { .. }
        | Op::RouterProbSum
        | Op::RouterProbSumGrad { .. }
        | Op::LoadBalancingLoss
        | Op::CrossEntropy
        | Op::CrossEntropyGrad
        | Op::VocabParallelCrossEntropy { .. }
        | Op::VocabParallelCrossEntropyGrad { .. }
        | Op::MatMulGradInput { .. }
        | Op::MatMulGradWeight { .. }
        | Op::RmsNormGradInput { .. }
        | Op::RmsNormGradInputAdd { .. }
        | Op::Sum { .. }
        | Op::RmsNormGradWeight { .. }
        | Op::RopeGrad { .. }
        | Op::AttentionGradQuery { .. }
        | Op::AttentionGradKey { .. }
        | Op::AttentionGradValue { .. }
        | Op::SiluMulGradGate
        | Op::EmbeddingGrad { .. }
        | Op::SumLeading { .. }
        | Op::ReduceToRoot { .. } => return None,
        Op::AllReduce { axis } => LayerLang::AllReduce([symbol(expr, axis.as_str()), x(0)]),
        Op::ReduceScatter { axis, dim } => {
            LayerLang::ReduceScatter([symbol(expr, axis.as_str()), symbol(expr, dim.as_str()), x(0)])
        }
        Op::AllGather { axis, dim } => {
            LayerLang::AllGather([symbol(expr, axis.as_str()), symbol(expr, dim.as_str()), x(0)])
        }
        Op::LocalSlice { axis, dim } => {
            LayerLang::LocalSlice([symbol(expr, axis.as_str()), symbol(expr, dim.as_str()), x(0)])
        }
        Op::AllToAll { axis, split_dim, gather_dim } => LayerLang::AllToAll([
            symbol(expr, axis.as_str()),
            symbol(expr, split_dim.as_str()),
            symbol(expr, gather_dim.as_str()),
            x(0),
        ]),
        Op::BroadcastShard { axis, dim, .. } => {
            let root = leaves.attribute(op);
            LayerLang::BroadcastShard([
                symbol(expr, axis.as_str()),
                symbol(expr, dim.as_str()),
                expr.add(LayerLang::Symbol(root)),
                x(0),
            ])
        }
        Op::RingGatedMlp { axis } => LayerLang::RingGatedMlp([symbol(expr, axis.as_str()), x(0), x(1), x(2), x(3)]),
        Op::Embedding => LayerLang::Embedding([x(0), x(1)]),
        Op::SiluMul => LayerLang::SiluMul([x(0), x(1)]),
        Op::Add => LayerLang::Add([x(0), x(1)]),
        Op::RmsNorm { .. } | Op::MatMul { .. } | Op::Rope { .. } | Op::Attention { .. } | Op::Zigzag { .. } => {
            let attr = expr.add(LayerLang::Symbol(leaves.attribute(op)));
            match op {
                Op::RmsNorm { .. } => LayerLang::RmsNorm([attr, x(0), x(1)]),
                Op::MatMul { .. } => LayerLang::MatMul([attr, x(0), x(1)]),
                Op::Rope { .. } => LayerLang::Rope([attr, x(0), x(1)]),
                Op::Attention { .. } => LayerLang::Attention([attr, x(0), x(1), x(2), x(3), x(4)]),
                _ => LayerLang::Zigzag([attr, x(0)]),
            }
        }
    };
    Some(expr.add(node))
}

/// What leaf `symbol` is: an axis, a dim, or an entry of `leaves`.
pub fn classify_symbol(symbol: Symbol, leaves: &LeafTable) -> ChildKind {
    match leaves.get(symbol) {
        Some(Leaf::Tensor { .. }) => ChildKind::Tensor,
        Some(Leaf::Attribute(op)) => ChildKind::Attribute(op.clone()),
        None => {
            let text = symbol.as_str();
            if let Some(axis) = AxisName::parse(text) {
                ChildKind::Axis(axis)
            } else if let Some(dim) = DimName::parse(text) {
                ChildKind::Dim(dim)
            } else {
                ChildKind::Other
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::config::{RopeConfig, RopeScaling};
    use pleat_ir::DType;

    #[test]
    fn every_layer_op_translates_back_to_itself() {
        let mut leaves = LeafTable::new();
        let mut expr = egg::RecExpr::default();
        let ty = TensorType::new(DType::F32, &[(DimName::Seq, 4)]);
        let x = leaves.tensor("x", ty.clone(), ShardSpec::replicated(1));
        let x = expr.add(LayerLang::Symbol(x));
        let rope = RopeConfig { theta: 10000.0, scaling: RopeScaling::None };
        let ops = [
            (Op::AllReduce { axis: AxisName::Tp }, 1),
            (Op::ReduceScatter { axis: AxisName::Tp, dim: DimName::Seq }, 1),
            (Op::AllGather { axis: AxisName::Dp, dim: DimName::Batch }, 1),
            (Op::LocalSlice { axis: AxisName::Tsp, dim: DimName::Heads }, 1),
            (Op::AllToAll { axis: AxisName::Tp, split_dim: DimName::Seq, gather_dim: DimName::Heads }, 1),
            (Op::BroadcastShard { axis: AxisName::Tsp, dim: DimName::Heads, root: 3 }, 1),
            (Op::RingGatedMlp { axis: AxisName::Tsp }, 4),
            (Op::Embedding, 2),
            (Op::RmsNorm { eps: 1e-5 }, 2),
            (Op::RmsNorm { eps: 1e-6 }, 2),
            (Op::MatMul { contract: 2 }, 2),
            (Op::Rope { rope }, 2),
            (Op::Attention { causal: true }, 5),
            (Op::SiluMul, 2),
            (Op::Add, 2),
            (Op::Zigzag { parts: 2, inverse: true }, 1),
        ];
        for (op, arity) in ops {
            let operands = vec![x; arity];
            let id = push_op(&mut expr, &mut leaves, &op, &operands).unwrap();
            let kind = |child: Id| match &expr[child] {
                LayerLang::Symbol(symbol) => classify_symbol(*symbol, &leaves),
                _ => ChildKind::Tensor,
            };
            assert_eq!(to_op(&expr[id], kind), Some((op.clone(), operands)), "{op:?}");
        }
        assert!(push_op(&mut expr, &mut leaves, &Op::Tokens, &[]).is_none());
    }
}
