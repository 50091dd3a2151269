//! Vocab-parallel cross-entropy: the loss reads the LM head's vocab shards instead of gathered logits.
//!
//! Propagation leaves a column-parallel LM head's logits split on `vocab` and all-gathers them
//! before `cross_entropy`, whose rule wants the whole vocabulary: every rank then holds the full
//! `[batch, seq, vocab]` logits, the largest activation of a training step, and sends
//! `(D-1)/D` of them. This pass rewrites `cross_entropy(all_gather(vocab, A, shard), tokens)` into
//! `vocab_parallel_cross_entropy{A}(shard, tokens)` (Megatron's `VocabParallelCrossEntropy`): the
//! ranks exchange three numbers a row (max, sum of exponentials, target logit) instead of the
//! logits, and the backward (`vocab_parallel_cross_entropy_grad`) stays on the shard, so the
//! gradient needs no slice and no gather either. The gather is dropped once nothing else reads it.

use pleat_ir::{DimName, Module, Op};

use crate::error::Result;
use crate::manager::{Pass, PassCtx};

/// Makes a training graph's loss read the logits' vocab shards; a no-op when the logits are whole.
pub const VOCAB_PARALLEL_LOSS: Pass = Pass { name: "vocab-parallel-loss", run: split_loss_over_vocab };

fn split_loss_over_vocab(module: &mut Module, _ctx: &PassCtx) -> Result<()> {
    let graph = &mut module.graph;
    let Some(loss_node) = graph.loss_node() else { return Ok(()) };
    let loss = graph.node(loss_node).clone();
    if loss.op != Op::CrossEntropy {
        return Ok(());
    }
    let gathered = loss.inputs[0];
    let gather = graph.def(gathered).clone();
    let Op::AllGather { axis, dim: DimName::Vocab } = gather.op else { return Ok(()) };
    let shard = gather.inputs[0];
    let shard_data = graph.value(shard);
    let vocab = shard_data.ty.shape.position(DimName::Vocab);
    // The kernel exchanges statistics over one axis: the shard must be split on vocab by `axis`
    // alone (a gather that only undoes the innermost of several splits keeps the plain loss).
    if vocab.and_then(|dim| shard_data.spec.dims.get(dim)).map(Vec::as_slice) != Some(&[axis][..]) {
        return Ok(());
    }
    let node = graph.node_mut(loss_node);
    node.op = Op::VocabParallelCrossEntropy { axis };
    node.inputs[0] = shard;
    graph.compact();
    Ok(())
}

#[cfg(test)]
mod tests {
    use pleat_ir::model::build_training;
    use pleat_ir::model::preset::preset;
    use pleat_ir::text::print_module;
    use pleat_ir::{AxisName, Mesh};

    use crate::{run_pipeline, PassCtx};

    use super::*;

    fn sharded_training(mesh: &[(AxisName, u64)]) -> Module {
        let config = preset("tiny").expect("tiny");
        let mut module = build_training(&config, 2, 8).expect("build");
        module.mesh = Mesh::new(mesh).expect("mesh");
        let front = &crate::TRAIN_PIPELINE[..4];
        run_pipeline(front, &mut module, &PassCtx::default()).expect("shard");
        module
    }

    fn loss_op(module: &Module) -> Op {
        let graph = &module.graph;
        graph.node(graph.loss_node().expect("a loss")).op.clone()
    }

    #[test]
    fn a_column_parallel_head_feeds_the_loss_its_vocab_shard() {
        let mut module = sharded_training(&[(AxisName::Tp, 2)]);
        assert_eq!(loss_op(&module), Op::CrossEntropy, "propagation gathers the logits first");
        let before = print_module(&module);
        split_loss_over_vocab(&mut module, &PassCtx::default()).expect("pass");
        crate::verify(&module).expect("verifies");
        assert_eq!(loss_op(&module), Op::VocabParallelCrossEntropy { axis: AxisName::Tp });
        let graph = &module.graph;
        let logits = graph.node(graph.loss_node().expect("loss")).inputs[0];
        let vocab = graph.value(logits).ty.shape.position(DimName::Vocab).expect("vocab");
        assert_eq!(graph.value(logits).spec.dims[vocab], vec![AxisName::Tp]);
        let gathers_on_vocab = |module: &Module| {
            let graph = &module.graph;
            graph
                .order()
                .iter()
                .filter(|&&node| matches!(graph.node(node).op, Op::AllGather { dim: DimName::Vocab, .. }))
                .count()
        };
        assert_eq!(gathers_on_vocab(&module), 0, "the logits gather is gone");
        assert!(before.contains("dim=vocab"), "the input had the gather");
        // `explain` names it and counts each rank's row statistics: 2 · 8 rows of three f32.
        let reasons = crate::explain::explain_collectives(&module);
        let loss = reasons.iter().find(|reason| reason.rule == "vocab-parallel-loss").expect("explained");
        assert_eq!(loss.bytes_per_rank, 2 * 8 * 3 * 4);
    }

    #[test]
    fn whole_logits_keep_the_plain_loss() {
        for mesh in [vec![(AxisName::Dp, 2)], vec![]] {
            let mut module = sharded_training(&mesh);
            let before = print_module(&module);
            split_loss_over_vocab(&mut module, &PassCtx::default()).expect("pass");
            assert_eq!(print_module(&module), before, "{mesh:?}");
            assert_eq!(loss_op(&module), Op::CrossEntropy);
        }
    }
}
