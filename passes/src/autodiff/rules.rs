//! The vector-Jacobian product of every differentiable op, as IR ops.
//!
//! `operand_gradient` says which op computes the gradient of one operand of a forward node from
//! the incoming gradient `dy`; the gradient always has the operand's type. Compute ops map to
//! their backward ops (`MatMul` to `MatMulGradInput`/`MatMulGradWeight`, `SiluMul`'s `up` to
//! `SiluMul(gate, dy)`, ...). Communication ops map to their conjugate collectives
//! (`conjugate`), so the same rules will differentiate a per-rank sharded graph.

use pleat_ir::{Graph, MlpOperand, MoeOperand, NodeData, Op, ValueId};

/// How the gradient of one operand is computed.
#[derive(Clone, Debug, PartialEq)]
pub enum Vjp {
    /// The operand's gradient is `dy` itself (an `Add` operand of the result's shape, an all-reduce
    /// whose gradient is already whole).
    Identity,
    /// The gradient is this op applied to these operands.
    Apply(Op, Vec<ValueId>),
}

/// Why an op has no gradient rule.
#[derive(Clone, Debug, PartialEq)]
pub struct NoRule {
    /// What is missing and how to avoid it.
    pub reason: String,
}

/// The gradient of operand `operand` of `node`, given `dy` (the gradient of its result). For a
/// communication op the conjugate depends on whether `dy`'s spec is a pending sum (`conjugate`).
pub fn operand_gradient(graph: &Graph, node: &NodeData, operand: usize, dy: ValueId) -> Result<Vjp, NoRule> {
    let inputs = &node.inputs;
    let apply = |op: Op, operands: Vec<ValueId>| Ok(Vjp::Apply(op, operands));
    match (&node.op, operand) {
        (Op::Embedding, 0) => {
            let vocab = graph.value(inputs[0]).ty.shape.dims().first().map_or(0, |dim| dim.size);
            apply(Op::EmbeddingGrad { vocab }, vec![dy, inputs[1]])
        }
        (Op::RmsNorm { eps }, 0) => apply(Op::RmsNormGradInput { eps: *eps }, vec![inputs[0], inputs[1], dy]),
        (Op::RmsNorm { eps }, 1) => apply(Op::RmsNormGradWeight { eps: *eps }, vec![inputs[0], dy]),
        (Op::MatMul { contract }, 0) => apply(Op::MatMulGradInput { contract: *contract }, vec![dy, inputs[1]]),
        (Op::MatMul { contract }, 1) => apply(Op::MatMulGradWeight { contract: *contract }, vec![dy, inputs[0]]),
        (Op::Rope { rope }, 0) => apply(Op::RopeGrad { rope: rope.clone() }, vec![dy, inputs[1]]),
        (Op::Attention { causal }, 0..=2) => {
            let causal = *causal;
            let op = match operand {
                0 => Op::AttentionGradQuery { causal },
                1 => Op::AttentionGradKey { causal },
                _ => Op::AttentionGradValue { causal },
            };
            apply(op, [&inputs[..], &[dy]].concat())
        }
        (Op::SiluMul, 0) => apply(Op::SiluMulGradGate, vec![inputs[0], inputs[1], dy]),
        // d(silu(gate) * up) / d(up) = silu(gate): the forward op on (gate, dy).
        (Op::SiluMul, 1) => apply(Op::SiluMul, vec![inputs[0], dy]),
        (Op::RouterProbSum, 0 | 1) => {
            let wrt = if operand == 0 { MoeOperand::Input } else { MoeOperand::Router };
            apply(Op::RouterProbSumGrad { wrt }, vec![inputs[0], inputs[1], dy])
        }
        (Op::SigmoidScale, 0) => apply(Op::SigmoidScaleGradGate, vec![inputs[0], inputs[1], dy]),
        // d(sigmoid(gate) * y) / dy = sigmoid(gate): the forward op on (gate, dy).
        (Op::SigmoidScale, 1) => apply(Op::SigmoidScale, vec![inputs[0], dy]),
        (Op::Add, 0) => Ok(Vjp::Identity),
        (Op::Add, 1) => {
            let (a, b) = (&graph.value(inputs[0]).ty.shape, &graph.value(inputs[1]).ty.shape);
            if a == b {
                Ok(Vjp::Identity)
            } else {
                // A bias repeated over the leading dims: its gradient sums over them.
                apply(Op::SumLeading { keep: b.rank() as u8 }, vec![dy])
            }
        }
        (Op::Zigzag { parts, inverse }, 0) => apply(Op::Zigzag { parts: *parts, inverse: !inverse }, vec![dy]),
        // The four gradients read the same operands; lowering runs them as one reverse ring.
        (Op::RingGatedMlp { axis }, operand) if operand < 4 => {
            let wrt = MlpOperand::at(operand).expect("operand < 4");
            apply(Op::RingGatedMlpGrad { axis: *axis, wrt }, [&inputs[..], &[dy]].concat())
        }
        (Op::MoeMlp { top_k, normalize, dispatch }, operand) if operand < 5 => {
            let wrt = MoeOperand::at(operand).expect("operand < 5");
            let op = Op::MoeMlpGrad { top_k: *top_k, normalize: *normalize, dispatch: *dispatch, wrt };
            apply(op, [&inputs[..], &[dy]].concat())
        }
        (Op::RingAttention { .. }, _) => Err(NoRule {
            reason: "ring_attention has no gradient rule; fold-cp writes a training graph's attention as an \
                     all-gather of the keys and values"
                .into(),
        }),
        (op, 0) if op.is_communication() || matches!(op, Op::LocalSlice { .. }) => {
            let partial = !graph.value(dy).spec.partial.is_empty();
            match conjugate(op, partial)? {
                None => Ok(Vjp::Identity),
                Some(conjugate) => apply(conjugate, vec![dy]),
            }
        }
        (op, _) => Err(NoRule {
            reason: format!(
                "{} has no gradient rule for operand {operand} (the loss and the backward ops are not differentiated \
                 again); differentiate a forward graph with one cross_entropy loss",
                op.mnemonic()
            ),
        }),
    }
}

/// The conjugate of a communication op: the collective that carries a gradient back across it.
/// `dy_partial` says whether the incoming gradient is a pending sum (each rank holds a summand), as
/// it is after a replicated value was used on every rank. `None` is the identity.
///
/// | forward (x -> y)                        | dy replicated           | dy partial              |
/// |-----------------------------------------|-------------------------|-------------------------|
/// | `all_reduce` (partial -> replicated)    | identity                | `all_reduce`            |
/// | `all_gather` (shard(dim) -> replicated) | `local_slice` of `dim`  | `reduce_scatter` on dim |
/// | `reduce_scatter` (partial -> shard)     | `all_gather` of `dim`   | (dy is never partial)   |
/// | `local_slice` (replicated -> shard)     | `all_gather` of `dim`   | (dy is never partial)   |
/// | `broadcast_shard` (root's block -> all) | (no rule)               | `reduce_to_root`        |
///
/// A broadcast block's gradient is a pending sum wherever the ranks used their copies on their own
/// tokens (TSP's projections contract the split sequence), and `reduce_to_root` sums it into the
/// owner's block. A replicated gradient of a broadcast block (every rank holding the same whole
/// gradient) does not arise from pleat's folds and has no rule.
pub fn conjugate(op: &Op, dy_partial: bool) -> Result<Option<Op>, NoRule> {
    match op {
        Op::AllReduce { axis } => Ok(dy_partial.then_some(Op::AllReduce { axis: *axis })),
        Op::AllGather { axis, dim } if dy_partial => Ok(Some(Op::ReduceScatter { axis: *axis, dim: *dim })),
        Op::AllGather { axis, dim } => Ok(Some(Op::LocalSlice { axis: *axis, dim: *dim })),
        Op::ReduceScatter { axis, dim } | Op::LocalSlice { axis, dim } => {
            Ok(Some(Op::AllGather { axis: *axis, dim: *dim }))
        }
        Op::BroadcastShard { axis, dim, root } if dy_partial => {
            Ok(Some(Op::ReduceToRoot { axis: *axis, dim: *dim, root: *root }))
        }
        Op::BroadcastShard { .. } => Err(NoRule {
            reason: "broadcast_shard's gradient is replicated, not a pending sum of the ranks' uses; reduce_to_root \
                     needs the pending sum"
                .into(),
        }),
        other => Err(NoRule { reason: format!("{} is not a communication op", other.mnemonic()) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::{AxisName, DimName};

    #[test]
    fn conjugates_follow_the_table() {
        let axis = AxisName::parse("tp").expect("tp is an axis");
        let dim = DimName::Seq;
        assert_eq!(conjugate(&Op::AllReduce { axis }, false), Ok(None));
        assert_eq!(conjugate(&Op::AllReduce { axis }, true), Ok(Some(Op::AllReduce { axis })));
        assert_eq!(conjugate(&Op::AllGather { axis, dim }, true), Ok(Some(Op::ReduceScatter { axis, dim })));
        assert_eq!(conjugate(&Op::AllGather { axis, dim }, false), Ok(Some(Op::LocalSlice { axis, dim })));
        assert_eq!(conjugate(&Op::ReduceScatter { axis, dim }, false), Ok(Some(Op::AllGather { axis, dim })));
        assert_eq!(conjugate(&Op::LocalSlice { axis, dim }, false), Ok(Some(Op::AllGather { axis, dim })));
        assert!(conjugate(&Op::BroadcastShard { axis, dim, root: 0 }, false).is_err());
        assert_eq!(
            conjugate(&Op::BroadcastShard { axis, dim, root: 1 }, true),
            Ok(Some(Op::ReduceToRoot { axis, dim, root: 1 }))
        );
        assert!(conjugate(&Op::Add, false).is_err());
    }
}
