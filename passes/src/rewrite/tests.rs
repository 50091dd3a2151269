//! The pass on real layers: sequence parallelism derived from the tensor-parallel form (checked
//! by the verifier and numerically by the simulator), plain `tp` left alone, limits reported, and
//! proofs that name the rules.

use pleat_ir::model::preset::preset;
use pleat_ir::{Mesh, Module, Op};

use super::simulate::{global, random_inputs, simulate};
use super::template::layer_template;
use super::*;
use crate::{propagate, run_pipeline, tsp, verify, SHARD_PIPELINE};

/// `tiny` with `layers` layers on `mesh`, propagated without sequence parallelism (the tp form).
fn tp_form(mesh: &str, layers: u64) -> Module {
    let mut config = preset("tiny").unwrap();
    config.num_layers = layers;
    let mut module = pleat_ir::model::build(&config, 2, 8).unwrap();
    module.mesh = Mesh::parse(mesh).unwrap();
    run_pipeline(&[tsp::FOLD_TSP, propagate::PROPAGATE_SPECS], &mut module, &PassCtx::default()).unwrap();
    module
}

fn sequence_parallel() -> PassCtx {
    PassCtx { sequence_parallel: true, ..PassCtx::default() }
}

fn count(module: &Module, mnemonic: &str) -> usize {
    let graph = &module.graph;
    graph.order().iter().filter(|&&node| graph.node(node).op.mnemonic() == mnemonic).count()
}

#[test]
fn sequence_parallelism_is_derived_from_the_tp_form() {
    // At tp=4 a tree all-reduce (2·log2(4) latencies) is predicted cheaper on tiny than a
    // reduce-scatter and an all-gather (2·3): the plan's sequence parallelism is taken anyway.
    for mesh in ["tp=2", "tp=4"] {
        derives_sequence_parallelism(mesh);
    }
}

fn derives_sequence_parallelism(mesh: &str) {
    let mut module = tp_form(mesh, 2);
    let before = layer_template(&module).unwrap().unwrap();
    let report = rewrite_collectives(&mut module, &sequence_parallel(), &RewriteOptions::default()).unwrap();
    verify(&module).unwrap();
    assert_eq!(report.layers_rewritten, 2, "{report:?}");
    assert!(report.stream_split, "{report:?}");
    // Each layer: the two all-reduces become reduce-scatters onto seq, and the norms and residuals
    // run on seq shards; the stream stays split between layers, so the embedding's sum is
    // reduce-scattered too and gathered once after the last layer.
    assert_eq!(count(&module, "reduce_scatter"), 1 + 2 * 2);
    assert_eq!(count(&module, "all_reduce"), 0);
    assert_eq!(count(&module, "all_gather"), 2 * 2 + 1 + 1, "before q/k/v and gate/up, after the stack, the logits");
    for layer in 0..2 {
        for value in ["attn_norm", "attn_residual", "mlp_norm", "mlp_residual"] {
            let name = format!("layer{layer}.{value}");
            let text = pleat_ir::text::print_module(&module);
            let node = module.graph.find(&name).unwrap_or_else(|| panic!("no {name} in\n{text}"));
            let spec = &module.graph.value(node).spec;
            assert_eq!(spec.dims[1], vec![pleat_ir::AxisName::Tp], "{name} is not on a seq shard");
        }
    }
    // Numerically: the rewritten layer maps the input's shards to the shards of what the tp
    // layer computes.
    let after = layer_template(&module).unwrap().unwrap();
    let root = |template: &template::LayerTemplate| {
        assert_eq!(template.roots.len(), 1, "a layer has one output");
        template.sub_expr(template.roots[0].1)
    };
    let (input, _) = before.stream_input().unwrap();
    let (shard, _) = after.stream_input().unwrap();
    let slice: egg::RecExpr<LayerLang> = format!("(local_slice tp seq {input})").parse().unwrap();
    for seed in 0..2 {
        let mut inputs = random_inputs(&before.leaves, &module.mesh, seed);
        let (old, old_meta) = simulate(&root(&before), &before.leaves, &module.mesh, &inputs).unwrap();
        let (shards, _) = simulate(&slice, &before.leaves, &module.mesh, &inputs).unwrap();
        inputs.insert(shard, shards);
        let (new, new_meta) = simulate(&root(&after), &after.leaves, &module.mesh, &inputs).unwrap();
        let (old, new) = (global(&old, &old_meta).unwrap(), global(&new, &new_meta).unwrap());
        let (at, diff) = old.max_abs_diff(&new).unwrap();
        assert!(diff <= 1e-5, "the rewritten layer differs by {diff} at {at}");
    }
}

#[test]
fn plain_tensor_parallelism_keeps_its_all_reduces() {
    for mesh in ["tp=2", "dp=2,tp=2", "dp=2"] {
        let propagated = tp_form(mesh, 2);
        let mut module = propagated.clone();
        let report = rewrite_collectives(&mut module, &PassCtx::default(), &RewriteOptions::default()).unwrap();
        assert_eq!(report.layers_rewritten, 0, "{mesh}: {report:?}");
        assert_eq!(module, propagated, "{mesh}");
        assert!(!report.tables.contains(&"sequence-parallel"));
    }
}

#[test]
fn the_pipeline_verifies_on_every_strategy() {
    for (mesh, sequence_parallel) in [("tp=2", false), ("tp=2", true), ("dp=2,tp=2", false), ("tsp=2", false)] {
        let mut config = preset("tiny").unwrap();
        config.num_layers = 2;
        let mut module = pleat_ir::model::build(&config, 2, 8).unwrap();
        module.mesh = Mesh::parse(mesh).unwrap();
        let ctx = PassCtx { sequence_parallel, ..PassCtx::default() };
        run_pipeline(SHARD_PIPELINE, &mut module, &ctx).unwrap();
    }
}

#[test]
fn hitting_a_limit_is_a_reported_outcome() {
    let mut module = tp_form("tp=2", 1);
    let options = RewriteOptions { iterations: 1, ..RewriteOptions::default() };
    let report = rewrite_collectives(&mut module, &sequence_parallel(), &options).unwrap();
    assert_eq!(report.stop, StopReason::IterationLimit(1));
    verify(&module).unwrap();
    let mut module = tp_form("tp=2", 1);
    let options = RewriteOptions { nodes: 10, ..RewriteOptions::default() };
    let report = rewrite_collectives(&mut module, &sequence_parallel(), &options).unwrap();
    assert!(matches!(report.stop, StopReason::NodeLimit(nodes) if nodes >= 10), "{report:?}");
    verify(&module).unwrap();
}

#[test]
fn a_module_without_layers_is_left_alone() {
    let mut module = tp_form("tp=2", 1);
    let graph = &mut module.graph;
    for node in graph.order().to_vec() {
        let name = graph.node(node).name.replace("layer0.", "block.");
        graph.node_mut(node).name = name;
    }
    let before = module.clone();
    let report = rewrite_collectives(&mut module, &sequence_parallel(), &RewriteOptions::default()).unwrap();
    assert_eq!(report.iterations, 0);
    assert_eq!(module, before);
}

#[test]
fn the_proof_names_the_rules() {
    let module = tp_form("tp=2", 1);
    let text = proof(&module, &sequence_parallel(), "layer0.mlp_residual").unwrap();
    assert!(text.contains("stream-is-the-gather-of-its-shard"), "{text}");
    assert!(text.contains("partial-then-reduce-scatter"), "{text}");
    let text = proof(&module, &PassCtx::default(), "layer0.mlp_residual").unwrap();
    assert!(text.contains("no rule"), "{text}");
    assert!(matches!(proof(&module, &PassCtx::default(), "layer0.nope"), Err(Error::UnknownValue { .. })));
    let _ = Op::Add;
}

#[test]
fn a_mixtures_layer_under_sequence_parallelism_computes_its_attention_once() {
    // The experts' op is not in the e-graph's language: a leaf of the layer's expression. Its
    // operand (the MLP norm's output) is built in the chosen form too, here gathered from the
    // norm's seq shard, so the propagated form (the attention behind an all-reduce) does not stay
    // alive beside the split one.
    let mut config = preset("tiny-moe").unwrap();
    config.num_layers = 2;
    let mut module = pleat_ir::model::build(&config, 2, 8).unwrap();
    module.mesh = Mesh::parse("tp=2").unwrap();
    run_pipeline(&[tsp::FOLD_TSP, propagate::PROPAGATE_SPECS], &mut module, &PassCtx::default()).unwrap();
    let report = rewrite_collectives(&mut module, &sequence_parallel(), &RewriteOptions::default()).unwrap();
    verify(&module).unwrap();
    assert!(report.stream_split, "{report:?}");
    let text = pleat_ir::text::print_module(&module);
    assert_eq!(count(&module, "attention"), 2, "one attention a layer:\n{text}");
    assert_eq!(count(&module, "all_reduce"), 0, "{text}");
    assert_eq!(count(&module, "reduce_scatter"), 1 + 2 * 2, "{text}");
    for layer in 0..2 {
        let graph = &module.graph;
        let moe = graph.find(&format!("layer{layer}.moe")).unwrap();
        let input = graph.def(moe).inputs[0];
        assert!(
            matches!(graph.def(input).op, Op::AllGather { .. }),
            "layer{layer}'s experts read {}:\n{text}",
            graph.def(input).name
        );
    }
}
