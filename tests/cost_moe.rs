//! The cost model of a mixture of experts (`mixtral-8x7b`, `tiny-moe`) against hand computations:
//! each expected figure below is written out from the model's sizes, not taken from the functions
//! under test. Memory by component, the ep all-to-all volume, the gradient synchronization over ep
//! and dp, the active FLOPs, the expert load, and `pleat plan` end to end.

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, stdout_of};
use pleat_ir::model::preset::preset;
use pleat_ir::AxisName;
use pleat_passes::cost::comm::Collective;
use pleat_passes::cost::memory::memory_per_stage;
use pleat_passes::cost::volume::{layer_collectives, step_collectives, Phase};
use pleat_passes::cost::{estimate, HardwareSpec, Layout, ModelShape, Workload};

fn shape(name: &str) -> ModelShape {
    ModelShape::from_config(&preset(name).unwrap())
}

fn layout(axes: &[(AxisName, u64)]) -> Layout {
    Layout::new(axes, false)
}

/// Mixtral's parameters on one rank of ep=8 x tp=2, by hand. A layer: q and o `2·4096·4096/2`, k
/// and v `2·4096·1024/2` (8 kv heads split by tp=2), the router `8·4096` and two norms `2·4096`
/// whole, one expert of `3·4096·14336/2`. Outside the layers: the embedding and the LM head,
/// `16000·4096` rows each (vocab-parallel over tp), and the final norm.
const MIXTRAL_ATTENTION: f64 = 2.0 * 4096.0 * 4096.0 / 2.0 + 2.0 * 4096.0 * 1024.0 / 2.0;
const MIXTRAL_EXPERT: f64 = 3.0 * 4096.0 * 14336.0 / 2.0;
const MIXTRAL_LAYER: f64 = MIXTRAL_ATTENTION + 8.0 * 4096.0 + 2.0 * 4096.0 + MIXTRAL_EXPERT;
const MIXTRAL_OUTSIDE: f64 = 2.0 * 16000.0 * 4096.0 + 4096.0;

#[test]
fn mixtral_expert_weights_a_rank_at_ep8_tp2() {
    let memory = &memory_per_stage(
        &shape("mixtral-8x7b"),
        &layout(&[(AxisName::Ep, 8), (AxisName::Tp, 2)]),
        &Workload::training(4096, 1),
    )[0];
    let experts = memory.experts.as_ref().expect("a mixture reports its experts");
    // 32 layers x 1 expert a rank x 3·4096·14336 / tp=2, bf16.
    let expert_bytes = 32.0 * 1.0 * 3.0 * 4096.0 * 14336.0 / 2.0 * 2.0;
    assert_eq!(expert_bytes, 5_637_144_576.0);
    let by_name = |name: &str| experts.weights.iter().find(|term| term.name == name).map(|term| term.bytes);
    assert_eq!(by_name("expert weights"), Some(expert_bytes));
    assert_eq!(by_name("router"), Some(32.0 * 8.0 * 4096.0 * 2.0));
    assert_eq!(by_name("attention"), Some(32.0 * MIXTRAL_ATTENTION * 2.0));
    assert_eq!(by_name("embedding and lm head"), Some(2.0 * 16000.0 * 4096.0 * 2.0));
    assert_eq!(by_name("shared expert"), None, "Mixtral has no shared expert");
    let params = 32.0 * MIXTRAL_LAYER + MIXTRAL_OUTSIDE;
    assert_eq!(memory.param_count, params);
    assert_eq!(memory.params_bytes, 2.0 * params);
    assert_eq!(experts.weights.iter().map(|term| term.bytes).sum::<f64>(), memory.params_bytes);
    // fp32 gradients, 12 bytes of Adam state and master weights, no ZeRO.
    assert_eq!(experts.expert_param_count, 32.0 * MIXTRAL_EXPERT);
    assert_eq!(experts.expert_grads_bytes, 4.0 * 32.0 * MIXTRAL_EXPERT);
    assert_eq!(memory.grads_bytes, 4.0 * params);
    assert_eq!(memory.optimizer_bytes, 12.0 * params);
}

#[test]
fn zero_shards_experts_over_dp_and_the_rest_over_dp_times_ep() {
    let model = shape("mixtral-8x7b");
    let mesh = layout(&[(AxisName::Dp, 2), (AxisName::Ep, 8), (AxisName::Tp, 2)]);
    let experts = 32.0 * MIXTRAL_EXPERT;
    let dense = 32.0 * MIXTRAL_LAYER + MIXTRAL_OUTSIDE - experts;
    let zero = |stage: u8| Workload { zero: stage, ..Workload::training(4096, 1) };
    let one = &memory_per_stage(&model, &mesh, &zero(1))[0];
    assert_eq!(one.optimizer_bytes, 12.0 * experts / 2.0 + 12.0 * dense / 16.0);
    assert_eq!(one.experts.as_ref().unwrap().expert_optimizer_bytes, 12.0 * experts / 2.0);
    assert_eq!(one.grads_bytes, 4.0 * (experts + dense));
    let three = &memory_per_stage(&model, &mesh, &zero(3))[0];
    assert_eq!(three.params_bytes, 2.0 * experts / 2.0 + 2.0 * dense / 16.0);
    assert_eq!(three.grads_bytes, 4.0 * experts / 2.0 + 4.0 * dense / 16.0);
}

#[test]
fn mixtral_moe_activations_by_hand() {
    // 4096 tokens a rank, 32 layers, bf16: router logits [4096, 8], two routed copies of each token
    // [2·4096, 4096], and their gate, up and product [2·4096, 14336/2] each.
    let memory = &memory_per_stage(
        &shape("mixtral-8x7b"),
        &layout(&[(AxisName::Ep, 8), (AxisName::Tp, 2)]),
        &Workload::training(4096, 1),
    )[0];
    let terms = &memory.experts.as_ref().unwrap().activations;
    let bytes = |name: &str| terms.iter().find(|term| term.name == name).expect(name).bytes;
    assert_eq!(bytes("router logits"), 32.0 * 4096.0 * 8.0 * 2.0);
    assert_eq!(bytes("routed token copies"), 32.0 * 2.0 * 4096.0 * 4096.0 * 2.0);
    assert_eq!(bytes("expert hidden (gate, up, product)"), 32.0 * 3.0 * 2.0 * 4096.0 * 7168.0 * 2.0);
}

#[test]
fn tiny_moe_all_to_all_volume_by_hand() {
    // tiny-moe (f32, h = 128, top-2) on ep=4, 2 sequences of 16 a rank: 32 tokens, 64 routed copies
    // of 128 floats = 32768 bytes; a rank keeps the quarter bound for its own experts and sends
    // 24576 bytes in each of dispatch and combine. The counts: 4 integers of 8 bytes, 24 sent.
    let model = shape("tiny-moe");
    let mesh = layout(&[(AxisName::Ep, 4)]);
    let calls = layer_collectives(&model, &mesh, &Workload::training(16, 2));
    let sent = |phase: Phase| -> f64 {
        calls
            .iter()
            .filter(|call| call.phase == phase && call.axis == AxisName::Ep)
            .map(|call| call.bytes_sent(4))
            .sum()
    };
    assert!(calls.iter().all(|call| call.kind == Collective::AllToAll && call.axis == AxisName::Ep), "{calls:?}");
    assert_eq!(sent(Phase::Forward), 2.0 * 24576.0 + 24.0);
    assert_eq!(sent(Phase::Backward), 2.0 * 24576.0);
    let dispatch = calls.iter().find(|call| call.what.starts_with("expert all-to-all: tokens")).expect("dispatch");
    assert_eq!((dispatch.bytes, dispatch.count), (32768.0, 2.0));
    // Inference: the forward's only.
    let infer = layer_collectives(&model, &mesh, &Workload::inference(16, 2));
    assert_eq!(infer.iter().map(|call| call.bytes_sent(4)).sum::<f64>(), 2.0 * 24576.0 + 24.0);

    // The step, on an h100 node (ep=4 inside one node: 3 NVLink peers a step): 2 layers.
    let hw = HardwareSpec::builtin("h100-sxm").unwrap();
    let plan = estimate(&model, &mesh, &Workload::training(16, 2), &hw).unwrap();
    let summary = plan.experts.as_ref().unwrap();
    assert_eq!(summary.all_to_all_bytes_per_step, 2.0 * (4.0 * 24576.0 + 24.0));
    let beta = 450e9 * hw.efficiency.link;
    let exchange = |bytes: f64| 3.0 * (3e-6 + bytes / 4.0 / beta);
    let seconds = 2.0 * (4.0 * exchange(32768.0) + exchange(32.0));
    assert!((summary.all_to_all_seconds_per_step - seconds).abs() <= 1e-12 * seconds, "{summary:?}");
}

#[test]
fn dense_gradients_sync_over_ep_and_experts_over_dp_only() {
    let model = shape("mixtral-8x7b");
    let mesh = layout(&[(AxisName::Dp, 2), (AxisName::Ep, 8), (AxisName::Tp, 2)]);
    let experts = 32.0 * MIXTRAL_EXPERT;
    let all = 32.0 * MIXTRAL_LAYER + MIXTRAL_OUTSIDE;
    let dense = all - experts;
    let plain = step_collectives(&model, &mesh, &Workload::training(4096, 1), all, 32);
    let summary: Vec<_> = plain.iter().map(|call| (call.axis, call.kind, call.bytes)).collect();
    assert_eq!(
        summary,
        vec![(AxisName::Ep, Collective::AllReduce, 4.0 * dense), (AxisName::Dp, Collective::AllReduce, 4.0 * all)]
    );
    // ZeRO-1: scatter the dense gradients over ep, then what is left of them and the experts over dp.
    let zero = Workload { zero: 1, ..Workload::training(4096, 1) };
    let scattered = step_collectives(&model, &mesh, &zero, all, 32);
    let summary: Vec<_> = scattered.iter().map(|call| (call.axis, call.kind, call.bytes)).collect();
    assert_eq!(
        summary,
        vec![
            (AxisName::Ep, Collective::ReduceScatter, 4.0 * dense),
            (AxisName::Ep, Collective::AllGather, 2.0 * dense),
            (AxisName::Dp, Collective::ReduceScatter, 4.0 * (dense / 8.0 + experts)),
            (AxisName::Dp, Collective::AllGather, 2.0 * (dense / 8.0 + experts)),
        ]
    );
    // tsp keeps experts and routers whole: their gradients are summed over it.
    let tiny = shape("tiny-moe");
    let tsp = layout(&[(AxisName::Tsp, 2), (AxisName::Ep, 2)]);
    let whole = 2.0 * (4.0 * 3.0 * 128.0 * 64.0 + 8.0 * 128.0);
    let calls = step_collectives(&tiny, &tsp, &Workload::training(16, 1), 1e6, 2);
    let over_tsp = calls.iter().find(|call| call.axis == AxisName::Tsp).expect("a tsp gradient all-reduce");
    assert_eq!((over_tsp.kind, over_tsp.bytes), (Collective::AllReduce, 4.0 * whole));
}

#[test]
fn tsp_alone_splits_the_experts_and_dispatches_over_tsp() {
    // tiny-moe (f32, h = 128, 8 experts of 64 channels, top-2, 2 layers) on tsp=4, 2 sequences of
    // 16: each rank holds 8/4 = 2 experts a layer and routes its own 2·16/4 = 8 tokens, 16 copies
    // of 128 floats = 8192 bytes, three quarters of which (6144) leave it in each of dispatch and
    // combine; the counts are 4 integers of 8 bytes, 24 sent.
    let model = shape("tiny-moe");
    let mesh = layout(&[(AxisName::Tsp, 4)]);
    let workload = Workload::training(16, 2);
    let calls = layer_collectives(&model, &mesh, &workload);
    let all_to_alls: Vec<_> = calls.iter().filter(|call| call.kind == Collective::AllToAll).collect();
    assert!(all_to_alls.iter().all(|call| call.axis == AxisName::Tsp), "{all_to_alls:?}");
    let sent = |phase: Phase| -> f64 {
        all_to_alls.iter().filter(|call| call.phase == phase).map(|call| call.bytes_sent(4)).sum()
    };
    assert_eq!(sent(Phase::Forward), 2.0 * 6144.0 + 24.0);
    assert_eq!(sent(Phase::Backward), 2.0 * 6144.0);
    // Memory: 2 layers x 2 experts x 3·128·64 weights a rank.
    let memory = &memory_per_stage(&model, &mesh, &workload)[0];
    let experts = memory.experts.as_ref().expect("a mixture reports its experts");
    assert_eq!(experts.expert_param_count, 2.0 * 2.0 * 3.0 * 128.0 * 64.0);
    // The experts' gradients are whole on their one tsp rank; only the routers' (2 layers of
    // 8·128, fp32) are summed over tsp.
    let step = step_collectives(&model, &mesh, &workload, 1e6, 2);
    let over_tsp: Vec<_> = step.iter().filter(|call| call.axis == AxisName::Tsp).collect();
    assert_eq!(over_tsp.len(), 1, "{over_tsp:?}");
    assert_eq!((over_tsp[0].kind, over_tsp[0].bytes), (Collective::AllReduce, 4.0 * 2.0 * 8.0 * 128.0));
    // Mixtral on tsp=8: one whole expert a rank and layer (32 · 3·4096·14336, bf16).
    let mixtral = &memory_per_stage(&shape("mixtral-8x7b"), &layout(&[(AxisName::Tsp, 8)]), &workload)[0];
    let weights = &mixtral.experts.as_ref().unwrap().weights;
    let expert_bytes = weights.iter().find(|term| term.name == "expert weights").map(|term| term.bytes);
    assert_eq!(expert_bytes, Some(32.0 * 3.0 * 4096.0 * 14336.0 * 2.0));
}

#[test]
fn model_flops_count_active_parameters() {
    // Mixtral's matmul parameters a token reads: 32 layers of attention (q, o 4096², k, v 4096·1024),
    // router 8·4096 and two experts of 3·4096·14336; the LM head 32000·4096.
    let active = 32.0 * (2.0 * 4096.0 * 4096.0 + 2.0 * 4096.0 * 1024.0 + 8.0 * 4096.0 + 2.0 * 3.0 * 4096.0 * 14336.0)
        + 32000.0 * 4096.0;
    // ep=8 x tp=2 with one sequence of 4096 a dp·ep rank: 8 sequences a step.
    let tokens = 8.0 * 4096.0;
    let causal_attention = 0.5 * 12.0 * 32.0 * 4096.0 * 4096.0;
    let hw = HardwareSpec::builtin("h100-sxm").unwrap();
    let mesh = layout(&[(AxisName::Ep, 8), (AxisName::Tp, 2)]);
    let plan = estimate(&shape("mixtral-8x7b"), &mesh, &Workload::training(4096, 1), &hw).unwrap();
    assert_eq!(plan.tokens_per_step, tokens);
    assert_eq!(plan.model_flops_per_step, (6.0 * active + causal_attention) * tokens);
    // Not the 46.7B of all experts: six idle experts a layer do no work.
    assert!(active < 46_702_792_704.0 / 3.0, "{active}");
}

#[test]
fn expert_load_expected_and_worst() {
    // dp=2 x ep=8 x tp=2, one sequence of 4096 a dp·ep rank: 16 sequences, 65536 tokens a step.
    let hw = HardwareSpec::builtin("h100-sxm").unwrap();
    let mesh = layout(&[(AxisName::Dp, 2), (AxisName::Ep, 8), (AxisName::Tp, 2)]);
    let plan = estimate(&shape("mixtral-8x7b"), &mesh, &Workload::training(4096, 1), &hw).unwrap();
    let load = &plan.experts.as_ref().unwrap().load;
    assert_eq!((load.expected_tokens_per_step, load.worst_tokens_per_step), (65536.0 * 2.0 / 8.0, 65536.0));
    // An expert's rank takes tokens from its ep group: 8 ranks of 4096.
    assert_eq!((load.expected_tokens_per_rank, load.worst_tokens_per_rank), (8.0 * 4096.0 * 2.0 / 8.0, 8.0 * 4096.0));
}

#[test]
fn plan_of_mixtral_on_ep8_tp2_prints_the_totals() {
    let table = stdout_of(&["plan", "mixtral-8x7b", "--mesh", "ep=8,tp=2", "--seq", "4096", "--batch", "1"]);
    assert!(table.contains("parameters: 46.70B, 12.88B active a token (2 of 8 experts a layer, 1 a rank)"), "{table}");
    // 32·3·4096·14336/2·2 bytes = 5.64 GB; 32·8·4096·2 = 2.1 MB of router.
    let line = |name: &str| {
        table.lines().find(|line| line.trim_start().starts_with(name)).unwrap_or_else(|| panic!("{name} in\n{table}"))
    };
    assert!(line("expert weights").ends_with(" 5.64 GB"), "{table}");
    assert!(line("router ").ends_with(" 0.00 GB"), "{table}");
    assert!(line("attention").ends_with(" 1.34 GB"), "{table}");
    assert!(line("routed experts (zero shards them over dp x cp)").ends_with("11.27 GB"), "{table}");
    // 32 layers x (4 exchanges x 7/8 x 2·4096·4096·2 bytes + 7/8 x 64 bytes of counts) = 7.52 GB.
    assert!(line("expert all-to-all").contains(" 7.52 GB a step"), "{table}");
    assert!(line("capacity:").contains("costed as balanced: an expert gets 8192 of the 32768 tokens"), "{table}");
    let load = "expert load: 8192 tokens an expert a layer and micro-batch, up to 32768";
    assert!(line("expert load:").starts_with(load), "{table}");

    let json =
        json_of(&["plan", "mixtral-8x7b", "--mesh", "ep=8,tp=2", "--seq", "4096", "--batch", "1", "--format", "json"]);
    let experts = &json["experts"];
    assert_eq!(experts["param_count"], 46_702_792_704u64);
    assert_eq!(experts["active_param_count"], 12_879_925_248u64);
    assert_eq!(experts["all_to_all_bytes_per_step"], 32.0 * (4.0 * 0.875 * 67_108_864.0 + 0.875 * 64.0));
    let weights = json["memory"]["experts"]["weights"].as_array().unwrap();
    let expert_weights = weights.iter().find(|term| term["name"] == "expert weights").unwrap();
    assert_eq!(expert_weights["bytes"], 5_637_144_576.0);
    assert!(json["memory"]["experts"]["activations"].as_array().is_some_and(|terms| terms.len() == 3));
}

#[test]
fn plan_of_tiny_moe_on_ep2_runs() {
    let json = json_of(&["plan", "tiny-moe", "--mesh", "ep=2", "--format", "json"]);
    assert_eq!(json["experts"]["experts_per_rank"], 4);
    assert_eq!(json["world_size"], 2);
    // 2 layers x 4 experts x 3·128·64 floats.
    let weights = json["memory"]["experts"]["weights"].as_array().unwrap();
    let expert_weights = weights.iter().find(|term| term["name"] == "expert weights").unwrap();
    assert_eq!(expert_weights["bytes"], 2.0 * 4.0 * 3.0 * 128.0 * 64.0 * 4.0);
    let table = stdout_of(&["plan", "tiny-moe", "--mesh", "ep=2"]);
    assert!(table.contains("expert all-to-all"), "{table}");
}

#[test]
fn dense_plans_carry_no_expert_keys() {
    let json = json_of(&["plan", "llama3-8b", "--mesh", "dp=2,tp=4", "--format", "json"]);
    assert!(json.get("experts").is_none() && json["memory"].get("experts").is_none(), "{json}");
    assert!(json["stages"][0].get("experts").is_none());
    let table = stdout_of(&["plan", "llama3-8b", "--mesh", "dp=2,tp=4"]);
    assert!(!table.contains("parameters:") && !table.contains("expert all-to-all"), "{table}");
}

#[test]
fn ep_errors_name_the_model_and_the_valid_degrees() {
    let first_line = |args: &[&str]| error_of(args).lines().next().unwrap_or_default().to_string();
    assert_eq!(
        first_line(&["plan", "tiny", "--mesh", "ep=2"]),
        "error[E0211]: mesh axis ep=2: tiny has no experts (a dense MLP); drop ep or use dp"
    );
    assert_eq!(
        first_line(&["plan", "mixtral-8x7b", "--mesh", "ep=3"]),
        "error[E0210]: 8 experts are not divisible by ep=3; use ep in {1,2,4,8}"
    );
}
