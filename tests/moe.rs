//! Mixture of experts (`tiny-moe`, Mixtral-style: 8 experts, top-2) against the reference
//! interpreter: the forward logits on every mesh that places the experts (ep, dp×ep, tsp×ep, expert
//! tensor parallelism), training checked step by step, the errors of meshes that cannot place
//! them, and the parameters `pleat plan` counts.

mod common;

#[path = "support/cli.rs"]
mod cli;

use cli::{assert_matches_reference, error_of, json_of};
use common::check_equivalence;
use pleat_ir::model::preset::preset;

fn tiny_moe() -> pleat_ir::model::config::ModelConfig {
    preset("tiny-moe").expect("tiny-moe preset")
}

#[test]
fn expert_parallel_forward_matches_the_reference() {
    for mesh in ["", "ep=2", "ep=4", "ep=8", "dp=2,ep=2", "ep=2,dp=2", "tsp=2,ep=2", "tp=2", "ep=2,tp=2"] {
        check_equivalence(&tiny_moe(), 8, 16, mesh);
    }
}

#[test]
fn expert_parallel_training_matches_the_reference() {
    for mesh in ["ep=2", "ep=4", "dp=2,ep=2", "tsp=2,ep=2", "ep=2,tp=2", "pp=2,ep=2"] {
        let report = json_of(&[
            "run", "tiny-moe", "--train", "--mesh", mesh, "--batch", "4", "--seq", "16", "--steps", "5", "--lr",
            "1e-3", "--check", "--format", "json",
        ]);
        assert_matches_reference(&report, mesh);
    }
}

#[test]
fn each_expert_parallel_rank_holds_its_share_of_the_experts() {
    // The experts' projections split over ep; the router, attention and norms stay whole.
    let (module, programs) = common::compile(&tiny_moe(), 8, 16, "ep=4");
    let gate = module.graph.find("model.layers.0.block_sparse_moe.experts.w1.weight").expect("gate");
    assert_eq!(
        pleat_passes::sharding::spec_text(&module.graph.value(gate).spec, &module.graph.value(gate).ty.shape),
        "[experts/ep, ffn, hidden]"
    );
    for program in &programs {
        let experts = program
            .instructions
            .iter()
            .find_map(|instr| match instr {
                pleat_backend::Instr::Kernel { kernel: pleat_backend::Kernel::MoeMlp { dims }, .. } => {
                    Some(dims.clone())
                }
                _ => None,
            })
            .expect("a moe kernel");
        assert_eq!((experts.local_experts, experts.expert_offset), (2, 2 * u64::from(program.rank)));
        // Every rank routes all 8 sequences' tokens after the all-gather.
        assert_eq!(experts.rows, 8 * 16);
    }
}

#[test]
fn meshes_that_cannot_place_experts_say_why() {
    let error = error_of(&["run", "tiny", "--mesh", "ep=2"]);
    assert!(error.contains("mesh axis ep places routed experts, and model tiny has none"), "{error}");
    let error = error_of(&["run", "tiny-moe", "--mesh", "ep=3"]);
    assert!(error.contains("experts.w1.weight: 8 experts are not divisible by ep=3; use ep in {1,2,4,8}"), "{error}");
}

#[test]
fn the_cost_model_counts_the_experts() {
    // The plan's figures are checked by hand in tests/cost_moe.rs; here, that the model the
    // compiler runs is the one the cost model counts.
    let plan = json_of(&["plan", "mixtral-8x7b", "--mesh", "ep=8,tp=2", "--format", "json"]);
    assert_eq!(plan["experts"]["param_count"], 46_702_792_704u64);
    assert_eq!(plan["experts"]["active_param_count"], 12_879_925_248u64);
}
