//! Which part of a pipelined training step each node belongs to: the forward, or the backward, or
//! (for zero-bubble schedules) the backward's input-gradient part `B` and weight-gradient part `W`.
//!
//! `W` is the weight-gradient nodes (`matmul_grad_weight`, `rms_norm_grad_weight`,
//! `embedding_grad`, `sum_leading` of a bias), everything computed from them (the parameter
//! gradients' relayout, reduction and accumulation), and the backward nodes off the gradient chain
//! that only `W` reads (a relayout or recomputation of a forward value that only a weight gradient
//! needs). Everything else after the loss is `B`, including TSP's ring MLP gradients: one ring
//! computes the input and the weight gradients together (splitting it would run the ring, and
//! move its weights, twice).
//!
//! Guarantee: no `B` node reads a `W` node's value (a node is `W` only when every reader is), so a
//! stage may run a micro-batch's `W` at any time after its `B`, and every value a stage sends to
//! the previous one (an activation's gradient) is `B`.

use std::collections::HashMap;

use pleat_ir::{Module, Op};

use super::Phase;

/// Whether `op` computes a parameter's gradient from an activation and an output gradient.
fn is_weight_gradient(op: &Op) -> bool {
    matches!(
        op,
        Op::MatMulGradWeight { .. } | Op::RmsNormGradWeight { .. } | Op::EmbeddingGrad { .. } | Op::SumLeading { .. }
    )
}

/// Whether `op` seeds the backward: the loss's gradient, where the gradient chain starts.
fn is_loss_gradient(op: &Op) -> bool {
    matches!(op, Op::CrossEntropyGrad | Op::VocabParallelCrossEntropyGrad { .. })
}

/// The phase of every node of `module`, in program order. Nodes up to `loss` (its position in the
/// order) are `Forward`; the rest are `Backward`, or with `split` `BackwardInput` and
/// `BackwardWeight`.
pub(super) fn node_phases(module: &Module, loss: usize, split: bool) -> Vec<Phase> {
    let graph = &module.graph;
    let order = graph.order();
    let mut phases: Vec<Phase> =
        (0..order.len()).map(|at| if at <= loss { Phase::Forward } else { Phase::Backward }).collect();
    if !split {
        return phases;
    }
    let position: HashMap<_, usize> = order.iter().enumerate().map(|(at, &node)| (node, at)).collect();
    let producer: HashMap<_, usize> =
        order.iter().enumerate().map(|(at, &node)| (graph.node(node).result, at)).collect();
    // The gradient chain: what the loss's gradient flows through. Weight side: what a weight
    // gradient flows into.
    let mut on_chain = vec![false; order.len()];
    let mut weight_side = vec![false; order.len()];
    for (at, &node) in order.iter().enumerate().skip(loss + 1) {
        let data = graph.node(node);
        let from = |marks: &[bool]| data.inputs.iter().any(|input| producer.get(input).is_some_and(|&p| marks[p]));
        on_chain[at] = is_loss_gradient(&data.op) || from(&on_chain);
        weight_side[at] = is_weight_gradient(&data.op) || from(&weight_side);
    }
    // A candidate is W when every reader is W (readers come later in the order).
    let mut weight = vec![false; order.len()];
    for at in (loss + 1..order.len()).rev() {
        // On the gradient chain and not fed by a weight gradient: B.
        if on_chain[at] && !weight_side[at] {
            continue;
        }
        let users = graph.users(graph.node(order[at]).result);
        weight[at] = users.iter().all(|user| position.get(user).is_some_and(|&p| weight[p]));
    }
    for at in loss + 1..order.len() {
        phases[at] = if weight[at] { Phase::BackwardWeight } else { Phase::BackwardInput };
    }
    phases
}

#[cfg(test)]
mod tests {
    use pleat_ir::model::preset::preset;
    use pleat_passes::{run_pipeline, PassCtx, TRAIN_PIPELINE};

    use super::*;

    fn trained_tiny() -> (Module, usize) {
        let config = preset("tiny").expect("tiny");
        let mut module = pleat_ir::model::build_training(&config, 1, 8).expect("builds");
        run_pipeline(TRAIN_PIPELINE, &mut module, &PassCtx::default()).expect("differentiates");
        let graph = &module.graph;
        let loss = graph.order().iter().position(|&node| graph.node(node).op.is_loss()).expect("a loss");
        (module, loss)
    }

    #[test]
    fn weight_gradients_are_w_and_input_gradients_b() {
        let (module, loss) = trained_tiny();
        let phases = node_phases(&module, loss, true);
        let graph = &module.graph;
        for (at, &node) in graph.order().iter().enumerate() {
            let data = graph.node(node);
            let expected = match data.op {
                _ if at <= loss => Phase::Forward,
                Op::MatMulGradWeight { .. } | Op::RmsNormGradWeight { .. } | Op::EmbeddingGrad { .. } => {
                    Phase::BackwardWeight
                }
                Op::MatMulGradInput { .. }
                | Op::RmsNormGradInput { .. }
                | Op::RmsNormGradInputAdd { .. }
                | Op::AttentionGradQuery { .. }
                | Op::CrossEntropyGrad
                | Op::VocabParallelCrossEntropyGrad { .. } => Phase::BackwardInput,
                _ => continue,
            };
            assert_eq!(phases[at], expected, "{} ({})", data.name, data.op.mnemonic());
        }
    }

    #[test]
    fn no_input_gradient_reads_a_weight_gradient() {
        // Checked edge by edge, independently of how the split was found.
        let (module, loss) = trained_tiny();
        let phases = node_phases(&module, loss, true);
        let graph = &module.graph;
        let phase_of: HashMap<_, Phase> =
            graph.order().iter().zip(&phases).map(|(&node, &phase)| (graph.node(node).result, phase)).collect();
        for (at, &node) in graph.order().iter().enumerate() {
            if phases[at] == Phase::BackwardWeight {
                continue;
            }
            for input in &graph.node(node).inputs {
                assert_ne!(phase_of[input], Phase::BackwardWeight, "{} reads a W value", graph.node(node).name);
            }
        }
        assert!(phases.contains(&Phase::BackwardWeight) && phases.contains(&Phase::BackwardInput));
        let whole = node_phases(&module, loss, false);
        assert!(whole.iter().skip(loss + 1).all(|&phase| phase == Phase::Backward));
    }
}
