//! Insta snapshots of the IR, as text, before and after every pass, for each strategy on `tiny`.

use pleat_ir::model::preset::preset;
use pleat_ir::Mesh;
use pleat_passes::{run_pipeline, PassCtx, SHARD_PIPELINE};

/// The preset `model` with one layer: the snapshots of a layer's passes stay short.
fn one_layer(model: &str) -> pleat_ir::model::config::ModelConfig {
    pleat_ir::model::config::ModelConfig { num_layers: 1, ..preset(model).expect("preset") }
}

fn snapshot_pipeline(mesh: &str, suffix: &str) {
    snapshot_model(&preset("tiny").expect("tiny"), mesh, suffix);
}

fn snapshot_model(config: &pleat_ir::model::config::ModelConfig, mesh: &str, suffix: &str) {
    snapshot_with(config, mesh, suffix, &PassCtx::for_tests());
}

fn snapshot_with(config: &pleat_ir::model::config::ModelConfig, mesh: &str, suffix: &str, ctx: &PassCtx) {
    // A short sequence keeps the snapshots readable; the structure does not depend on it.
    let mut module = pleat_ir::model::build(config, 8, 16).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    let before = pleat_ir::text::print_module(&module);
    let report = run_pipeline(SHARD_PIPELINE, &mut module, ctx).expect("pipeline");
    insta::with_settings!({ snapshot_suffix => suffix, prepend_module_to_snapshot => false }, {
        insta::assert_snapshot!("before", before);
        for (pass, text) in report.dumps {
            insta::assert_snapshot!(format!("after_{pass}"), text);
        }
    });
}

#[test]
fn tensor_parallel_tp2() {
    snapshot_pipeline("tp=2", "tp2");
}

#[test]
fn data_parallel_dp2() {
    snapshot_pipeline("dp=2", "dp2");
}

#[test]
fn data_times_tensor_parallel() {
    snapshot_pipeline("dp=2,tp=2", "dp2-tp2");
}

#[test]
fn tensor_and_sequence_parallel_one_layer_tsp2() {
    let config = one_layer("tiny");
    snapshot_model(&config, "tsp=2", "tsp2-one-layer");
}

#[test]
fn tensor_parallel_with_sequence_parallelism_tp2() {
    let ctx = PassCtx { sequence_parallel: true, ..PassCtx::for_tests() };
    snapshot_with(&preset("tiny").expect("tiny"), "tp=2", "tp2-sp", &ctx);
}

#[test]
fn context_parallel_one_layer_cp2() {
    let config = one_layer("tiny");
    snapshot_model(&config, "cp=2", "cp2-one-layer");
}

#[test]
fn sequence_parallel_beside_context_parallel_one_layer_tp2_cp2() {
    // SP splits each cp rank's tokens over tp: the stream is split on seq over cp × tp.
    let config = one_layer("tiny");
    let ctx = PassCtx { sequence_parallel: true, ..PassCtx::for_tests() };
    snapshot_with(&config, "tp=2,cp=2", "tp2-cp2-sp-one-layer", &ctx);
}

/// The training pipeline on a one-layer `tiny`: the forward passes, then `zero-partition` and
/// `differentiate` (the backward graph with its conjugate collectives).
fn snapshot_training(mesh: &str, suffix: &str, ctx: &PassCtx) {
    snapshot_training_of("tiny", mesh, suffix, ctx);
}

fn snapshot_training_of(model: &str, mesh: &str, suffix: &str, ctx: &PassCtx) {
    let config = one_layer(model);
    let mut module = pleat_ir::model::build_training(&config, 8, 16).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    let before = pleat_ir::text::print_module(&module);
    let report = run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, ctx).expect("pipeline");
    insta::with_settings!({ snapshot_suffix => suffix, prepend_module_to_snapshot => false }, {
        insta::assert_snapshot!("before", before);
        for (pass, text) in report.dumps {
            insta::assert_snapshot!(format!("after_{pass}"), text);
        }
    });
}

#[test]
fn training_tensor_parallel_one_layer_tp2() {
    snapshot_training("tp=2", "train-tp2-one-layer", &PassCtx::for_tests());
}

#[test]
fn training_sequence_parallel_with_full_recompute_one_layer_tp2() {
    let ctx =
        PassCtx { sequence_parallel: true, recompute: pleat_passes::autodiff::Recompute::Full, ..PassCtx::for_tests() };
    snapshot_training("tp=2", "train-tp2-sp-full-one-layer", &ctx);
}

#[test]
fn training_zero3_one_layer_dp2() {
    let ctx = PassCtx { zero_stage: 3, ..PassCtx::for_tests() };
    snapshot_training("dp=2", "train-dp2-zero3-one-layer", &ctx);
}

/// ZeRO-3 beside TSP: each parameter's rows split over dp too, gathered before the run of
/// broadcasts of its owner's blocks (so that they still travel as one message), and gathered again
/// in the backward.
#[test]
fn training_zero3_beside_tsp_one_layer_dp2_tsp2() {
    let ctx = PassCtx { zero_stage: 3, ..PassCtx::for_tests() };
    snapshot_training("dp=2,tsp=2", "train-dp2-tsp2-zero3-one-layer", &ctx);
}

#[test]
fn training_tensor_and_sequence_parallel_one_layer_tsp2() {
    snapshot_training("tsp=2", "train-tsp2-one-layer", &PassCtx::for_tests());
}

#[test]
fn training_context_parallel_one_layer_cp2() {
    snapshot_training("cp=2", "train-cp2-one-layer", &PassCtx::for_tests());
}

/// Expert parallelism on a one-layer `tiny-moe`: the mixture dispatches its rows over `ep` (the
/// all-to-all dispatcher), so nothing is gathered but the logits.
#[test]
fn expert_parallel_one_layer_ep2() {
    let config = one_layer("tiny-moe");
    snapshot_model(&config, "ep=2", "moe-ep2-one-layer");
}

/// A mixture under Megatron SP: the norms and residuals on seq shards, and the experts (which the
/// e-graph cannot express) reading their input gathered from the MLP norm's shard, their pending
/// sum reduce-scattered back onto it; the attention is computed once.
#[test]
fn mixture_with_sequence_parallelism_one_layer_tp2() {
    let config = one_layer("tiny-moe");
    let ctx = PassCtx { sequence_parallel: true, ..PassCtx::for_tests() };
    snapshot_with(&config, "tp=2", "moe-tp2-sp-one-layer", &ctx);
}

/// The all-gather dispatcher: the tokens all-gathered over `ep` before the experts, their pending
/// sum reduce-scattered back onto the batch.
#[test]
fn expert_parallel_all_gather_one_layer_ep2() {
    let config = one_layer("tiny-moe");
    let ctx = PassCtx { expert_all_gather: true, ..PassCtx::for_tests() };
    snapshot_with(&config, "ep=2", "moe-ep2-all-gather-one-layer", &ctx);
}

/// Qwen2-MoE under tsp and ep: attention folded into TSP, the shared expert on the TSP ring, the
/// routed experts dispatched over ep, the shared expert's sigmoid gate on each rank's tokens.
#[test]
fn qwen2_moe_one_layer_tsp2_ep2() {
    let path = "tests/fixtures/tiny-qwen2-moe/config.json";
    let text = std::fs::read_to_string(path).expect("fixture");
    let mut config = pleat_ir::model::config::ModelConfig::from_json_str(&text, path).expect("config");
    config.num_layers = 1;
    snapshot_model(&config, "tsp=2,ep=2", "qwen2-moe-tsp2-ep2-one-layer");
}

/// Expert parallelism on the tsp axis itself (no ep): attention folded into TSP, the routed
/// experts split over tsp and each rank's tokens dispatched to them over tsp.
#[test]
fn moe_one_layer_tsp2_experts_on_tsp() {
    let config = one_layer("tiny-moe");
    snapshot_model(&config, "tsp=2", "moe-tsp2-one-layer");
}

/// ZeRO-3 beside ep: a dense parameter's rows split over dp and then ep (ep splits the batch as dp
/// does), gathered over ep and then over dp before the first use and again in the backward; an
/// expert's over dp alone. A dense gradient reduce-scatters over dp and then over ep.
#[test]
fn training_zero3_over_dp_and_ep_one_layer_dp2_ep2() {
    let ctx = PassCtx { zero_stage: 3, ..PassCtx::for_tests() };
    snapshot_training_of("tiny-moe", "dp=2,ep=2", "train-moe-dp2-ep2-zero3-one-layer", &ctx);
}

/// ZeRO-3 over dp × cp (cp's ranks hold the same weights) at tp=4, where a rank holds one of the
/// 4 kv heads: k and v split over dp and cp on head_dim, gathered over cp and then dp on head_dim;
/// q's 2 heads a rank over dp on heads and then over cp on head_dim.
#[test]
fn training_zero3_over_dp_and_cp_one_head_a_rank_dp2_cp2_tp4() {
    let ctx = PassCtx { zero_stage: 3, ..PassCtx::for_tests() };
    snapshot_training_of("tiny", "dp=2,cp=2,tp=4", "train-dp2-cp2-tp4-zero3-one-layer", &ctx);
}

/// The expert-parallel backward: the gradient all-gathered before the experts' gradients, the
/// input's pending sum reduce-scattered, the router's gradient summed over `ep`.
#[test]
fn training_expert_parallel_one_layer_ep2() {
    snapshot_training_of("tiny-moe", "ep=2", "train-moe-ep2-one-layer", &PassCtx::for_tests());
}

/// `fuse` after the training pipeline on a one-layer `tiny` at tp=2 and tsp=2: the gradients
/// summed over q, k, v (and gate, up) become one `sum`, each norm's input gradient and the add
/// after it one `rms_norm_grad_input_add`.
#[test]
fn fusing_a_training_step_one_layer() {
    for (mesh, suffix) in [("tp=2", "fuse-train-tp2-one-layer"), ("tsp=2", "fuse-train-tsp2-one-layer")] {
        let config = one_layer("tiny");
        let mut module = pleat_ir::model::build_training(&config, 8, 16).expect("build");
        module.mesh = Mesh::parse(mesh).expect("mesh");
        let ctx = PassCtx::for_tests();
        run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &ctx).expect("pipeline");
        let before = pleat_ir::text::print_module(&module);
        let report = run_pipeline(&[pleat_passes::fuse::FUSE], &mut module, &ctx).expect("fuse");
        insta::with_settings!({ snapshot_suffix => suffix, prepend_module_to_snapshot => false }, {
            insta::assert_snapshot!("before", before);
            for (pass, text) in report.dumps {
                insta::assert_snapshot!(format!("after_{pass}"), text);
            }
        });
    }
}
