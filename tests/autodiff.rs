//! The training oracle is checked twice: the reference interpreter's loss and the gradients that
//! `pleat_passes::autodiff` derives agree with central finite differences of the interpreter's own
//! loss, and with Hugging Face transformers' loss and gradients on the fixtures in
//! `tests/fixtures/hf` (`XForCausalLM(input_ids=tokens, labels=tokens).loss.backward()`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use pleat_ir::interp::{run, Inputs, Tensor};
use pleat_ir::model::config::{Architecture, ConfigDtype, ModelConfig, RopeConfig, RopeScaling};
use pleat_ir::Module;
use pleat_passes::autodiff::{differentiate, Gradients};
use pleat_runtime::weights::{SafetensorsWeights, WeightSource};

/// The training graph of `config`, differentiated and verified.
fn training_graph(config: &ModelConfig, batch: u64, seq: u64) -> (Module, Gradients) {
    let mut module = pleat_ir::model::build_training(config, batch, seq).expect("build_training");
    let loss = module.graph.outputs()[0];
    let gradients = differentiate(&mut module.graph, loss).expect("differentiate");
    pleat_passes::verify(&module).unwrap_or_else(|errors| panic!("{errors}: {:?}", errors.errors));
    (module, gradients)
}

/// Runs `module` on `tokens` with weights from `params` (keyed by checkpoint name); returns every
/// graph output (the loss first, then the gradients in `Gradients::params` order).
fn evaluate(module: &Module, tokens: &[u32], seq: u64, params: &HashMap<String, Vec<f32>>) -> Vec<Tensor> {
    let lookup = |name: &str, _shape: &[u64]| params.get(name).cloned();
    let positions: Vec<u32> = (0..seq as u32).collect();
    let inputs = Inputs { tokens, positions: &positions, params: &lookup };
    run(&module.graph, &inputs).expect("interpreter runs the training graph")
}

/// The weights of every parameter of `module`, read from `source` in the graph's shapes.
fn read_params(module: &Module, source: &dyn WeightSource) -> HashMap<String, Vec<f32>> {
    module
        .graph
        .params()
        .into_iter()
        .map(|(value, name)| {
            let shape = module.graph.value(value).ty.shape.sizes();
            let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
            (name.to_string(), source.read(name, &shape, &region).expect("weight"))
        })
        .collect()
}

// === Finite differences ===

/// A small model with every feature the gradients must handle: GQA, biases (Qwen2), tied or
/// untied embeddings, llama3 RoPE scaling.
fn small_config(architecture: Architecture, tied: bool, scaling: RopeScaling) -> ModelConfig {
    ModelConfig {
        architecture,
        vocab_size: 24,
        hidden_size: 16,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        intermediate_size: 20,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10_000.0, scaling },
        tie_word_embeddings: tied,
        dtype: ConfigDtype::F32,
        attention_bias: architecture == Architecture::Qwen2,
        max_position_embeddings: 64,
        sliding_window: None,
        moe: None,
        name: "small".to_string(),
    }
}

/// Deterministic weights in the fixtures' style: norm weights `1 + 0.1 u`, the rest `0.4 u`, with
/// `u` uniform in [-1, 1).
fn random_params(module: &Module, seed: u64) -> HashMap<String, Vec<f32>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((state >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
    };
    let mut params = HashMap::new();
    for (value, name) in module.graph.params() {
        let count = module.graph.value(value).ty.shape.numel() as usize;
        let norm = name.ends_with("norm.weight");
        let data = (0..count).map(|_| if norm { 1.0 + 0.1 * next() } else { 0.4 * next() }).collect();
        params.insert(name.to_string(), data);
    }
    params
}

/// Central differences of the interpreter's loss at three entries of every parameter (the largest
/// gradient entry, the first and the middle one) against the autodiff gradient. The loss is an f32
/// near 3 computed through f32 activations (rounding noise near 3e-7), so the step is 1e-2: the
/// noise over the step stays near 3e-5 (`NOISE`) and the truncation error `h^2 f''' / 6` is below
/// that. An entry passes within `TOLERANCE` of its parameter's largest gradient entry plus `NOISE`.
/// Returns the largest error in units of that allowance.
fn check_finite_differences(config: &ModelConfig) -> f64 {
    const STEP: f32 = 1e-2;
    const TOLERANCE: f64 = 1e-3;
    const NOISE: f64 = 3e-5;
    let (batch, seq) = (2, 6);
    let (module, gradients) = training_graph(config, batch, seq);
    let mut forward = pleat_ir::model::build_training(config, batch, seq).expect("build_training");
    // A mixture's routing is piecewise constant: a step that moves a token to another expert makes
    // the loss jump, and the difference quotient then measures the jump, not the gradient. The
    // experts' counts of every layer are outputs too, and a step that changes them is not compared.
    let counts: Vec<_> = forward
        .graph
        .order()
        .iter()
        .filter(|&&node| forward.graph.node(node).name.ends_with(".expert_counts"))
        .map(|&node| forward.graph.node(node).result)
        .collect();
    for &value in &counts {
        forward.graph.add_output(value);
    }
    let params = random_params(&module, 7);
    let tokens: Vec<u32> = (0..batch * seq).map(|index| ((index * 7 + 3) % config.vocab_size) as u32).collect();
    let outputs = evaluate(&module, &tokens, seq, &params);
    let run_forward = |params: &HashMap<String, Vec<f32>>| {
        let outputs = evaluate(&forward, &tokens, seq, params);
        let routing: Vec<f32> = outputs[1..].iter().flat_map(|counts| counts.data.clone()).collect();
        (f64::from(outputs[0].data[0]), routing)
    };
    let (loss, routing) = run_forward(&params);
    assert_eq!(loss, f64::from(outputs[0].data[0]), "the backward graph changes the loss");
    let (mut compared, mut rerouted) = (0, 0);
    let mut worst = 0.0_f64;
    for (index, param) in gradients.params.iter().enumerate() {
        let gradient = &outputs[index + 1].data;
        let (largest, scale) = gradient.iter().enumerate().fold((0, 0.0_f64), |(at, max), (entry, &g)| {
            if f64::from(g).abs() > max {
                (entry, f64::from(g).abs())
            } else {
                (at, max)
            }
        });
        assert!(scale > 0.0, "{}: the gradient is zero", param.name);
        for entry in [largest, 0, gradient.len() / 2] {
            let perturbed = |delta: f32| {
                let mut params = params.clone();
                params.get_mut(&param.name).expect("param")[entry] += delta;
                run_forward(&params)
            };
            let ((above, above_routing), (below, below_routing)) = (perturbed(STEP), perturbed(-STEP));
            if above_routing != routing || below_routing != routing {
                rerouted += 1;
                continue;
            }
            compared += 1;
            let numeric = (above - below) / (2.0 * f64::from(STEP));
            let allowed = TOLERANCE * scale + NOISE;
            let error = (numeric - f64::from(gradient[entry])).abs() / allowed;
            assert!(
                error <= 1.0,
                "{} entry {entry}: autodiff {} vs finite difference {numeric} (max |grad| {scale:e})",
                param.name,
                gradient[entry]
            );
            worst = worst.max(error);
        }
    }
    assert!(rerouted * 5 <= compared, "{rerouted} of {} steps moved a token to another expert", compared + rerouted);
    worst
}

#[test]
fn llama_gradients_match_finite_differences() {
    let worst = check_finite_differences(&small_config(Architecture::Llama, false, RopeScaling::None));
    assert!(worst <= 1.0, "{worst}");
}

#[test]
fn tied_qwen2_gradients_with_llama3_rope_match_finite_differences() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 4,
    };
    let worst = check_finite_differences(&small_config(Architecture::Qwen2, true, scaling));
    assert!(worst <= 1.0, "{worst}");
}

/// A Qwen2-MoE of the same size with the load-balancing loss at a weight that makes it count (the
/// checkpoints use 0.001 to 0.02): routed experts, a sigmoid-gated shared expert, the router's
/// gradient from both the mixture and the loss.
fn small_moe_config() -> ModelConfig {
    ModelConfig {
        moe: Some(pleat_ir::model::config::MoeConfig {
            num_experts: 4,
            top_k: 2,
            expert_intermediate_size: 12,
            normalize_top_k: false,
            shared_expert_intermediate_size: Some(8),
            router_aux_loss_coef: 0.5,
            output_router_logits: true,
        }),
        ..small_config(Architecture::Qwen2Moe, false, RopeScaling::None)
    }
}

#[test]
fn mixture_of_experts_gradients_with_the_load_balancing_loss_match_finite_differences() {
    let worst = check_finite_differences(&small_moe_config());
    assert!(worst <= 1.0, "{worst}");
}

#[test]
fn the_load_balancing_loss_of_an_untrained_router_is_top_k_times_its_weight() {
    // A zero router gives every expert probability 1/E and routes every token to experts 0..k
    // (ties to the lower index): Hugging Face's loss is E · Σ_k Σ_e tokens_per_expert[k, e] / E =
    // top_k, whatever the tokens. The total is the cross-entropy plus 0.5 · 2.
    let config = small_moe_config();
    let (batch, seq) = (2, 6);
    let module = pleat_ir::model::build_training(&config, batch, seq).expect("build_training");
    let mut params = random_params(&module, 3);
    for (name, values) in params.iter_mut() {
        if name.ends_with("mlp.gate.weight") {
            values.iter_mut().for_each(|value| *value = 0.0);
        }
    }
    let tokens: Vec<u32> = (0..batch * seq).map(|index| ((index * 5 + 1) % config.vocab_size) as u32).collect();
    let cross_entropy = module.graph.find("loss.cross_entropy").expect("the cross-entropy term");
    let mut probe = module.clone();
    probe.graph.add_output(cross_entropy);
    let outputs = evaluate(&probe, &tokens, seq, &params);
    let (total, cross_entropy) = (f64::from(outputs[0].data[0]), f64::from(outputs[1].data[0]));
    assert!((total - cross_entropy - 0.5 * 2.0).abs() < 1e-5, "total {total}, cross-entropy {cross_entropy}");
}

#[test]
fn tied_embeddings_accumulate_both_uses() {
    let (module, gradients) = training_graph(&small_config(Architecture::Llama, true, RopeScaling::None), 1, 4);
    let table = gradients.get("model.embed_tokens.weight").expect("the table has a gradient");
    assert!(gradients.get("lm_head.weight").is_none(), "tied: no separate lm_head");
    // The table's gradient sums the lm_head use and the embedding use.
    let sum = module.graph.def(table);
    assert_eq!(sum.op, pleat_ir::Op::Add, "{}", pleat_ir::text::print_graph(&module.graph));
    assert_eq!(sum.name, "grad.model.embed_tokens.weight");
    let ops: Vec<_> = sum.inputs.iter().map(|&input| module.graph.def(input).op.mnemonic()).collect();
    assert_eq!(ops, ["matmul_grad_weight", "embedding_grad"]);
}

#[test]
fn every_parameter_gets_a_named_output() {
    let (module, gradients) = training_graph(&small_config(Architecture::Qwen2, false, RopeScaling::None), 1, 4);
    let names: Vec<&str> = module.graph.params().into_iter().map(|(_, name)| name).collect();
    assert_eq!(gradients.params.len(), names.len());
    for (param, name) in gradients.params.iter().zip(names) {
        assert_eq!(param.name, name);
        assert_eq!(module.graph.def(param.grad).name, format!("grad.{name}"));
        assert_eq!(module.graph.value(param.grad).ty, module.graph.value(param.params[0]).ty);
        assert!(module.graph.outputs().contains(&param.grad));
    }
    // The text form round-trips the training graph.
    let text = pleat_ir::text::print_module(&module);
    assert_eq!(pleat_ir::text::parse_module(&text).expect("parses"), module);
}

// === Hugging Face ===

/// HF's f32 loss and ours differ in summation order only.
const LOSS_TOL: f64 = 1e-5;
/// Per gradient tensor: `|pleat - transformers|_2 / |transformers|_2`.
const GRAD_TOL: f64 = 1e-4;

fn check_hf(name: &str) -> (f64, f64) {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name);
    let config_text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let config = ModelConfig::from_json_str(&config_text, "config.json").expect("config parses");
    let rows: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).expect("tokens.json")).expect("tokens");
    let (batch, seq) = (rows.len() as u64, rows[0].len() as u64);
    let tokens: Vec<u32> = rows.into_iter().flatten().collect();
    let weights = SafetensorsWeights::open(&dir).expect("weights");
    let expected = SafetensorsWeights::open(dir.join("expected.safetensors")).expect("expected");

    let (module, gradients) = training_graph(&config, batch, seq);
    let outputs = evaluate(&module, &tokens, seq, &read_params(&module, &weights));
    let hf_loss = expected.read("loss", &[1], &[(0, 1)]).expect("loss")[0];
    let loss_error = (f64::from(outputs[0].data[0]) - f64::from(hf_loss)).abs();
    assert!(loss_error <= LOSS_TOL, "{name}: loss {} vs transformers {hf_loss}", outputs[0].data[0]);

    let mut hf_names: Vec<String> = expected.names().into_iter().filter(|key| key.starts_with("grad.")).collect();
    let mut our_names: Vec<String> = gradients.params.iter().map(|param| format!("grad.{}", param.name)).collect();
    hf_names.sort();
    our_names.sort();
    assert_eq!(our_names, hf_names, "{name}: the parameters with gradients differ");
    let mut worst = 0.0_f64;
    for (index, param) in gradients.params.iter().enumerate() {
        let shape = module.graph.value(param.grad).ty.shape.sizes();
        let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
        let want = expected.read(&format!("grad.{}", param.name), &shape, &region).expect("grad");
        let got = &outputs[index + 1].data;
        let norm = want.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>().sqrt();
        let difference = got.iter().zip(&want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum::<f64>();
        let relative = difference.sqrt() / norm;
        assert!(
            relative <= GRAD_TOL,
            "{name}: grad.{} differs from transformers by {relative:e} of its norm",
            param.name
        );
        worst = worst.max(relative);
    }
    (loss_error, worst)
}

#[test]
fn llama_gqa_loss_and_gradients_match_transformers() {
    let (loss, grad) = check_hf("llama-gqa");
    assert!(loss <= LOSS_TOL && grad <= GRAD_TOL);
}

#[test]
fn llama3_rope_tied_loss_and_gradients_match_transformers() {
    let (loss, grad) = check_hf("llama3-rope");
    assert!(loss <= LOSS_TOL && grad <= GRAD_TOL);
}

#[test]
fn qwen2_loss_and_gradients_match_transformers() {
    let (loss, grad) = check_hf("qwen2");
    assert!(loss <= LOSS_TOL && grad <= GRAD_TOL);
}
