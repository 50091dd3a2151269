//! `passes::fuse` on whole training steps: the fused graph computes the unfused one's loss and
//! gradients bit for bit (reference interpreter, one rank), and its lowered programs hold fewer
//! buffers and no higher peak (memory planner, sharded).

use pleat_backend::memory::{plan, ElementSize};
use pleat_ir::model::preset::preset;
use pleat_ir::{Mesh, Module, Op};
use pleat_passes::{run_pipeline, PassCtx, TRAIN_PIPELINE};
use pleat_runtime::weights::SeededWeights;

mod common;

fn training(model: &str, mesh: &str) -> Module {
    let config = preset(model).expect("preset");
    let mut module = pleat_ir::model::build_training(&config, 2, 16).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(TRAIN_PIPELINE, &mut module, &PassCtx::default()).expect("train pipeline");
    module
}

fn fused(module: &Module) -> Module {
    let mut module = module.clone();
    run_pipeline(&[pleat_passes::fuse::FUSE], &mut module, &PassCtx::default()).expect("fuse verifies");
    module
}

fn outputs(model: &str, module: &Module) -> Vec<Vec<u32>> {
    let config = preset(model).expect("preset");
    let tokens = common::tokens(2, 16, config.vocab_size);
    let outputs = common::interpret(&module.graph, 16, &tokens, &SeededWeights::new(3));
    outputs.iter().map(|tensor| tensor.data.iter().map(|value| value.to_bits()).collect()).collect()
}

#[test]
fn a_fused_step_has_the_unfused_loss_and_gradients_bit_for_bit() {
    for model in ["tiny", "tiny-moe"] {
        let module = training(model, "");
        let fused = fused(&module);
        let fused_ops = fused
            .graph
            .order()
            .iter()
            .filter(|&&node| matches!(fused.graph.node(node).op, Op::Sum { .. } | Op::RmsNormGradInputAdd { .. }))
            .count();
        assert!(fused_ops > 0, "{model}: something fused");
        assert_eq!(outputs(model, &module), outputs(model, &fused), "{model}");
    }
}

#[test]
fn the_memory_planner_sees_fewer_intermediates() {
    for mesh in ["tp=2", "tsp=2", "dp=2", "cp=2"] {
        let module = training("tiny", mesh);
        let unfused = pleat_backend::lower(&module).expect("lower");
        let fused = pleat_backend::lower(&fused(&module)).expect("lower fused");
        for (unfused, fused) in unfused.iter().zip(&fused) {
            assert!(fused.buffers.len() < unfused.buffers.len(), "{mesh} rank {}", fused.rank);
            let (before, after) = (plan(unfused, ElementSize::Declared), plan(fused, ElementSize::Declared));
            assert!(after.peak_bytes <= before.peak_bytes, "{mesh} rank {}: {after:?} > {before:?}", fused.rank);
        }
    }
}
