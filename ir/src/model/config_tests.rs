//! Tests of the `config.json` reader: both transformers styles, per-architecture defaults and the
//! rendered message of every error.

use super::*;
use serde_json::{json, Value};

const FILE: &str = "models/test/config.json";

/// The smallest config the reader accepts: the required sizes and an architecture.
fn minimal(architecture: &str) -> Value {
    json!({
        "architectures": [architecture],
        "vocab_size": 1000,
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "intermediate_size": 512,
    })
}

/// `base` with each `(key, value)` set at the top level (`Value::Null` included) or, for a key
/// written `parent.child`, inside the object `parent`.
fn with(mut base: Value, edits: &[(&str, Value)]) -> String {
    for (key, value) in edits {
        match key.split_once('.') {
            Some((parent, child)) => base[parent][child] = value.clone(),
            None => base[*key] = value.clone(),
        }
    }
    base.to_string()
}

/// `base` without the top-level `key`.
fn without(mut base: Value, key: &str) -> String {
    base.as_object_mut().unwrap().remove(key);
    base.to_string()
}

fn parse(text: &str) -> ModelConfig {
    ModelConfig::from_json_str(text, FILE).unwrap_or_else(|error| panic!("{error}"))
}

/// Parses `text`, expecting the error whose rendered message is `expected`.
#[track_caller]
fn check_error(text: &str, expected: &str) {
    match ModelConfig::from_json_str(text, FILE) {
        Ok(config) => panic!("expected `{expected}`, parsed {config:?}"),
        Err(error) => assert_eq!(error.to_string(), expected),
    }
}

/// Llama 3.1 405B written the transformers 5 way: `rope_parameters` holds theta and scaling, `dtype`.
const LLAMA31_405B_TRANSFORMERS_5: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 16384,
  "intermediate_size": 53248,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 128,
  "num_hidden_layers": 126,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.0.0",
  "vocab_size": 128256
}"#;

#[test]
fn both_transformers_styles_read_the_same() {
    let version_4 = include_str!("../../../examples/llama3-405b/config.json");
    let from_4 = ModelConfig::from_json_str(version_4, "llama3-405b.json").unwrap();
    let from_5 = ModelConfig::from_json_str(LLAMA31_405B_TRANSFORMERS_5, "llama3-405b.json").unwrap();
    assert_eq!(from_4, from_5);
    assert_eq!(from_5.rope.theta, 500000.0);
    assert_eq!(from_5.dtype, ConfigDtype::Bf16);
    // transformers 5 default rope: `{"rope_theta": ..., "rope_type": "default"}`.
    let default_5 =
        with(minimal("LlamaForCausalLM"), &[("rope_parameters", json!({"rope_theta": 1e6, "rope_type": "default"}))]);
    let default_4 = with(minimal("LlamaForCausalLM"), &[("rope_theta", json!(1e6)), ("rope_scaling", Value::Null)]);
    assert_eq!(parse(&default_5), parse(&default_4));
}

#[test]
fn rope_type_may_be_spelled_type() {
    let scaling = json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192});
    let config = parse(&with(minimal("LlamaForCausalLM"), &[("rope_scaling", scaling)]));
    let expected = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    assert_eq!(config.rope.scaling, expected);
}

#[test]
fn llama_defaults_follow_transformers() {
    let config = parse(&minimal("LlamaForCausalLM").to_string());
    assert_eq!(config.architecture, Architecture::Llama);
    assert_eq!((config.num_kv_heads, config.head_dim), (8, 32));
    assert_eq!(config.rms_norm_eps, 1e-6);
    assert_eq!(config.rope, RopeConfig { theta: 10000.0, scaling: RopeScaling::None });
    assert!(!config.tie_word_embeddings && !config.attention_bias);
    assert_eq!(config.dtype, ConfigDtype::F32);
    assert_eq!(config.max_position_embeddings, 2048);
    assert_eq!(config.sliding_window, None);
    assert_eq!(config.name, "test");
}

#[test]
fn mistral_defaults_follow_transformers() {
    let config = parse(&minimal("MistralForCausalLM").to_string());
    assert_eq!(config.architecture, Architecture::Mistral);
    // MistralConfig defaults num_key_value_heads to 8 and sliding_window to 4096 when absent.
    assert_eq!((config.num_kv_heads, config.sliding_window), (8, Some(4096)));
    assert_eq!(config.max_position_embeddings, 131072);
    assert!(!config.attention_bias);
    // An explicit null means "heads" for KV heads and "no window" for the window.
    let nulls =
        [("num_attention_heads", json!(16)), ("num_key_value_heads", Value::Null), ("sliding_window", Value::Null)];
    let config = parse(&with(minimal("MistralForCausalLM"), &nulls));
    assert_eq!((config.num_kv_heads, config.sliding_window), (16, None));
    let window = parse(&with(minimal("MistralForCausalLM"), &[("sliding_window", json!(1024))]));
    assert_eq!(window.sliding_window, Some(1024));
    // Mistral's attention has no biases whatever the file says.
    assert!(!parse(&with(minimal("MistralForCausalLM"), &[("attention_bias", json!(true))])).attention_bias);
}

#[test]
fn qwen2_has_qkv_biases_and_its_defaults() {
    let config = parse(&with(minimal("Qwen2ForCausalLM"), &[("num_attention_heads", json!(32))]));
    assert_eq!(config.architecture, Architecture::Qwen2);
    assert!(config.attention_bias);
    // Qwen2Config defaults num_key_value_heads to 32 when absent.
    assert_eq!((config.num_kv_heads, config.head_dim), (32, 8));
    assert_eq!(config.max_position_embeddings, 32768);
    assert_eq!(config.sliding_window, None);
    // A window configured but not switched on is ignored, as transformers does.
    let unused = with(
        minimal("Qwen2ForCausalLM"),
        &[("num_key_value_heads", json!(2)), ("use_sliding_window", json!(false)), ("sliding_window", json!(4096))],
    );
    assert_eq!(parse(&unused).sliding_window, None);
    // Switched on but covering no layer (3 layers, the first 28 full) is full attention too.
    let no_layer =
        with(minimal("Qwen2ForCausalLM"), &[("num_key_value_heads", json!(2)), ("use_sliding_window", json!(true))]);
    assert_eq!(parse(&no_layer).sliding_window, None);
}

#[test]
fn qwen2_param_count_includes_qkv_biases() {
    // Qwen2-0.5B: vocab 151936, hidden 896, 24 layers, 14 heads, 2 KV heads (head_dim 64), ffn 4864, tied.
    let text = with(
        minimal("Qwen2ForCausalLM"),
        &[
            ("vocab_size", json!(151936)),
            ("hidden_size", json!(896)),
            ("num_hidden_layers", json!(24)),
            ("num_attention_heads", json!(14)),
            ("num_key_value_heads", json!(2)),
            ("intermediate_size", json!(4864)),
            ("tie_word_embeddings", json!(true)),
        ],
    );
    let config = parse(&text);
    // Per layer: q 896*896 + 896, k and v 896*128 + 128 each, o 896*896, mlp 3*896*4864, norms 2*896.
    let per_layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896;
    let expected = 151936 * 896 + 24 * per_layer + 896;
    assert_eq!(expected, 494_032_768, "Qwen2-0.5B's published total");
    assert_eq!(config.param_count(), expected);
}

#[test]
fn explicit_head_dim_may_differ_from_hidden_over_heads() {
    let text = with(
        minimal("MistralForCausalLM"),
        &[("head_dim", json!(128)), ("hidden_size", json!(5120)), ("num_attention_heads", json!(32))],
    );
    let config = parse(&text);
    assert_eq!((config.hidden_size, config.num_heads, config.head_dim), (5120, 32, 128));
}

#[test]
fn name_comes_from_name_or_path_or_source() {
    let named = with(minimal("LlamaForCausalLM"), &[("_name_or_path", json!("meta-llama/Llama-2-7b-hf"))]);
    assert_eq!(parse(&named).name, "meta-llama/Llama-2-7b-hf");
    let text = minimal("LlamaForCausalLM").to_string();
    for (source, name) in
        [("a/b/config.json", "b"), ("my-model.json", "my-model"), ("config.json", "config.json"), ("x", "x")]
    {
        assert_eq!(ModelConfig::from_json_str(&text, source).unwrap().name, name, "{source}");
    }
}

#[test]
fn architecture_falls_back_to_model_type() {
    let mut base = minimal("unused");
    base.as_object_mut().unwrap().remove("architectures");
    assert_eq!(parse(&with(base, &[("model_type", json!("mistral"))])).architecture, Architecture::Mistral);
}

#[test]
fn dtype_names() {
    for (key, name, dtype) in [
        ("torch_dtype", "float16", ConfigDtype::F16),
        ("dtype", "bfloat16", ConfigDtype::Bf16),
        ("torch_dtype", "float32", ConfigDtype::F32),
    ] {
        assert_eq!(parse(&with(minimal("LlamaForCausalLM"), &[(key, json!(name))])).dtype, dtype);
    }
}

// === Errors, each with its rendered message ===

#[test]
fn malformed_json_reports_line_and_column() {
    check_error(
        "{\n  \"vocab_size\": 10,\n  oops\n}",
        "models/test/config.json:3:3: malformed json: key must be a string; fix the syntax at that position",
    );
    check_error(
        "",
        "models/test/config.json:1:0: malformed json: EOF while parsing a value; fix the syntax at that position",
    );
}

#[test]
fn top_level_must_be_an_object() {
    check_error("[1, 2]", "models/test/config.json: the top level must be a json object {...}, found [1,2]");
}

#[test]
fn missing_required_fields() {
    for field in ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"] {
        check_error(
            &without(minimal("LlamaForCausalLM"), field),
            &format!("models/test/config.json: missing required field `{field}`; add it as Hugging Face's config.json spells it"),
        );
    }
    check_error(
        &without(minimal("LlamaForCausalLM"), "architectures"),
        "models/test/config.json: missing required field `architectures`; add it as Hugging Face's config.json spells it",
    );
    let scaling = json!({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("rope_scaling", scaling.clone())]),
        "models/test/config.json: missing required field `rope_scaling.factor`; add it as Hugging Face's config.json spells it",
    );
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("rope_parameters", scaling)]),
        "models/test/config.json: missing required field `rope_parameters.factor`; add it as Hugging Face's config.json spells it",
    );
}

#[test]
fn fields_of_the_wrong_type() {
    let cases = [
        ("hidden_size", json!("4096"), "`hidden_size` must be a non-negative integer, found \"4096\""),
        ("vocab_size", json!(-5), "`vocab_size` must be a non-negative integer, found -5"),
        ("intermediate_size", json!(512.0), "`intermediate_size` must be a non-negative integer, found 512.0"),
        ("num_hidden_layers", Value::Null, "`num_hidden_layers` must be a non-negative integer, found null"),
        ("rms_norm_eps", json!("1e-5"), "`rms_norm_eps` must be a number, found \"1e-5\""),
        ("tie_word_embeddings", json!(1), "`tie_word_embeddings` must be true or false, found 1"),
        ("hidden_act", json!(["silu"]), "`hidden_act` must be a string, found [\"silu\"]"),
        (
            "architectures",
            json!("LlamaForCausalLM"),
            "`architectures` must be an array of class names, found \"LlamaForCausalLM\"",
        ),
        ("architectures", json!([]), "`architectures` must be a non-empty array of class names, found []"),
        ("architectures", json!([7]), "`architectures[0]` must be a class name string, found 7"),
        ("rope_scaling", json!(8.0), "`rope_scaling` must be an object or null, found 8.0"),
        ("rope_scaling", json!({"rope_type": 3}), "`rope_scaling.rope_type` must be a string, found 3"),
        (
            "torch_dtype",
            json!({"name": "a very long value that the message cuts short"}),
            "`torch_dtype` must be a string, found {\"name\":\"a very long value that the mess...",
        ),
    ];
    for (field, value, message) in cases {
        check_error(
            &with(minimal("LlamaForCausalLM"), &[(field, value)]),
            &format!("models/test/config.json: field {message}"),
        );
    }
}

#[test]
fn values_out_of_range() {
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let cases = [
        (vec![("vocab_size", json!(0))], "`vocab_size` = 0 is out of range; it must be at least 1"),
        (vec![("num_hidden_layers", json!(0))], "`num_hidden_layers` = 0 is out of range; it must be at least 1"),
        (
            vec![("num_hidden_layers", json!(1_000_000_000_000u64))],
            "`num_hidden_layers` = 1000000000000 is out of range; it must be at most 65536 (2^16)",
        ),
        (vec![("num_attention_heads", json!(0))], "`num_attention_heads` = 0 is out of range; it must be at least 1"),
        (vec![("num_key_value_heads", json!(0))], "`num_key_value_heads` = 0 is out of range; it must be at least 1"),
        (vec![("head_dim", json!(0))], "`head_dim` = 0 is out of range; it must be at least 1"),
        (
            vec![("max_position_embeddings", json!(0))],
            "`max_position_embeddings` = 0 is out of range; it must be at least 1",
        ),
        (
            vec![("rms_norm_eps", json!(-1e-5))],
            "`rms_norm_eps` = -0.00001 is out of range; it must be a finite number >= 0",
        ),
        (vec![("rope_theta", json!(0.0))], "`rope_theta` = 0 is out of range; it must be a finite number > 0"),
        (
            vec![("rope_parameters", json!({"rope_theta": -1.0}))],
            "`rope_parameters.rope_theta` = -1 is out of range; it must be a finite number > 0",
        ),
        (
            vec![("rope_scaling", llama3.clone()), ("rope_scaling.factor", json!(0.0))],
            "`rope_scaling.factor` = 0 is out of range; it must be a finite number > 0",
        ),
        (
            vec![("rope_scaling", llama3.clone()), ("rope_scaling.high_freq_factor", json!(1.0))],
            "`rope_scaling.high_freq_factor` = 1 is out of range; it must be finite and greater than low_freq_factor",
        ),
        (
            vec![("rope_scaling", llama3), ("rope_scaling.original_max_position_embeddings", json!(0))],
            "`rope_scaling.original_max_position_embeddings` = 0 is out of range; it must be at least 1",
        ),
    ];
    for (edits, message) in cases {
        check_error(&with(minimal("LlamaForCausalLM"), &edits), &format!("models/test/config.json: field {message}"));
    }
    check_error(
        &with(minimal("MistralForCausalLM"), &[("sliding_window", json!(0))]),
        "models/test/config.json: field `sliding_window` = 0 is out of range; it must be at least 1, or null for full attention",
    );
}

#[test]
fn unknown_architectures_list_the_supported_ones() {
    check_error(
        &minimal("GPT2LMHeadModel").to_string(),
        "models/test/config.json: architecture `GPT2LMHeadModel` in `architectures` is not supported; use one of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM",
    );
    let mut base = minimal("unused");
    base.as_object_mut().unwrap().remove("architectures");
    check_error(
        &with(base, &[("model_type", json!("gemma"))]),
        "models/test/config.json: architecture `gemma` in `model_type` is not supported; use one of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM",
    );
}

#[test]
fn unsupported_rope_types_are_named() {
    for rope_type in ["linear", "dynamic", "yarn", "longrope"] {
        check_error(
            &with(minimal("LlamaForCausalLM"), &[("rope_scaling", json!({"rope_type": rope_type, "factor": 2.0}))]),
            &format!("models/test/config.json: rope type `{rope_type}` in `rope_scaling.rope_type` is not supported; pleat computes only default, llama3"),
        );
    }
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("rope_scaling", json!({"type": "linear", "factor": 2.0}))]),
        "models/test/config.json: rope type `linear` in `rope_scaling.type` is not supported; pleat computes only default, llama3",
    );
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("rope_parameters", json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}))]),
        "models/test/config.json: rope type `yarn` in `rope_parameters.rope_type` is not supported; pleat computes only default, llama3",
    );
}

#[test]
fn unsupported_settings_say_what_to_use() {
    let cases = [
        ("LlamaForCausalLM", "hidden_act", json!("gelu"), "`hidden_act` = \"gelu\" is not supported: pleat builds gated SiLU MLPs (hidden_act \"silu\")"),
        ("LlamaForCausalLM", "attention_bias", json!(true), "`attention_bias` = true is not supported: Llama's attention_bias also adds an o_proj bias, which pleat does not build; use false"),
        ("LlamaForCausalLM", "mlp_bias", json!(true), "`mlp_bias` = true is not supported: pleat builds MLPs without biases; use false"),
        ("LlamaForCausalLM", "torch_dtype", json!("float64"), "`torch_dtype` = \"float64\" is not supported: pleat reads float32, bfloat16 and float16 checkpoints"),
        ("LlamaForCausalLM", "partial_rotary_factor", json!(0.5), "`partial_rotary_factor` = 0.5 is not supported: pleat applies rotary embeddings to whole heads; use 1.0"),
        ("LlamaForCausalLM", "rope_parameters", json!({"full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "`rope_parameters.full_attention` = {...} is not supported: per-layer-type rope parameters are not built by pleat; give one flat set of rope parameters"),
    ];
    for (architecture, field, value, message) in cases {
        check_error(&with(minimal(architecture), &[(field, value)]), &format!("models/test/config.json: {message}"));
    }
    let qwen2_window =
        [("num_key_value_heads", json!(2)), ("use_sliding_window", json!(true)), ("max_window_layers", json!(2))];
    check_error(
        &with(minimal("Qwen2ForCausalLM"), &qwen2_window),
        "models/test/config.json: `use_sliding_window` = true is not supported: Qwen2's sliding window on the layers from max_window_layers on is not built by pleat; use false, or max_window_layers >= num_hidden_layers",
    );
    // transformers 5 reads the windowed layers from layer_types (it ran with full attention).
    let layer_types = [
        ("num_key_value_heads", json!(2)),
        ("use_sliding_window", json!(true)),
        ("sliding_window", json!(4)),
        ("layer_types", json!(["full_attention", "sliding_attention"])),
    ];
    check_error(
        &with(minimal("Qwen2ForCausalLM"), &layer_types),
        "models/test/config.json: `layer_types` = [.., \"sliding_attention\", ..] is not supported: Qwen2's sliding window on the layers layer_types marks is not built by pleat; use use_sliding_window false, or only \"full_attention\" layers",
    );
    let mut full = layer_types.clone();
    full[3].1 = json!(["full_attention", "full_attention", "full_attention"]);
    assert!(crate::model::config::ModelConfig::from_json_str(&with(minimal("Qwen2ForCausalLM"), &full), "c").is_ok());
}

#[test]
fn inconsistent_sizes() {
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("num_key_value_heads", json!(3))]),
        "models/test/config.json: num_attention_heads = 8 is not a multiple of num_key_value_heads = 3; every key/value head must serve the same number of query heads",
    );
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("hidden_size", json!(100))]),
        "models/test/config.json: hidden_size = 100 is not divisible by num_attention_heads = 8; set `head_dim` explicitly or fix the sizes",
    );
    check_error(
        &with(minimal("LlamaForCausalLM"), &[("head_dim", json!(33))]),
        "models/test/config.json: head_dim = 33 is odd; rotary embeddings rotate pairs of channels, so use an even head_dim",
    );
    check_error(
        &with(
            minimal("LlamaForCausalLM"),
            &[("vocab_size", json!(u64::MAX)), ("hidden_size", json!(1u64 << 40)), ("num_attention_heads", json!(1))],
        ),
        "models/test/config.json: the model would have more than 2^64 parameters; check the sizes",
    );
}

#[test]
fn written_configs_read_back_equal() {
    for name in crate::model::preset::PRESET_NAMES {
        let config = crate::model::preset::preset(name).expect("preset");
        let text = config.to_hf_json();
        assert_eq!(ModelConfig::from_json_str(&text, "written.json").expect("reads back"), config, "{name}");
    }
}

/// `Qwen/Qwen1.5-MoE-A2.7B`'s config.json as published.
const QWEN15_MOE_A27B: &str = r#"{
  "architectures": ["Qwen2MoeForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 8192,
  "max_window_layers": 21,
  "model_type": "qwen2_moe",
  "moe_intermediate_size": 1408,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts": 60,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 16,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "shared_expert_intermediate_size": 5632,
  "sliding_window": 32768,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.39.0.dev0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

#[test]
fn reads_qwen2_moe_with_its_shared_expert() {
    let config = parse(QWEN15_MOE_A27B);
    assert_eq!(config.architecture, Architecture::Qwen2Moe);
    assert!(config.attention_bias);
    let moe = config.moe.clone().expect("a mixture of experts");
    assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate_size), (60, 4, 1408));
    assert_eq!(moe.shared_expert_intermediate_size, Some(5632));
    assert!(!moe.normalize_top_k);
    // Qwen's name says 2.7B active; the model card gives 14.3B in all (both rounded to 0.1B).
    assert!((config.param_count() as f64 - 14.3e9).abs() < 0.05e9, "{}", config.param_count());
    assert!((config.active_param_count() as f64 - 2.7e9).abs() < 0.05e9, "{}", config.active_param_count());
    // It survives a round trip through the writer.
    assert_eq!(parse(&config.to_hf_json()), config);
}

#[test]
fn a_qwen2_moe_without_a_shared_expert_reads_back() {
    // Written with a width of 0, which used to be refused on reading.
    let mut config = parse(QWEN15_MOE_A27B);
    config.moe.as_mut().expect("a mixture").shared_expert_intermediate_size = None;
    let text = config.to_hf_json();
    assert!(text.contains("\"shared_expert_intermediate_size\": 0"), "{text}");
    assert_eq!(parse(&text), config);
}

#[test]
fn mixtral_takes_its_class_defaults() {
    let config = parse(&minimal("MixtralForCausalLM").to_string());
    let moe = config.moe.clone().expect("a mixture of experts");
    assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate_size), (8, 2, 512));
    assert!(moe.normalize_top_k && moe.shared_expert_intermediate_size.is_none() && !moe.output_router_logits);
    assert_eq!((config.num_kv_heads, config.rope.theta, config.rms_norm_eps), (8, 1e6, 1e-5));
    assert_eq!(config.sliding_window, None);
    assert_eq!(parse(&config.to_hf_json()), config);
}

#[test]
fn moe_settings_pleat_cannot_build_are_named() {
    let cases = [
        (
            with(minimal("MixtralForCausalLM"), &[("num_experts_per_tok", json!(9))]),
            "field `num_experts_per_tok` = 9 is out of range; it must be at least 1 and at most the number of experts",
        ),
        (
            with(minimal("MixtralForCausalLM"), &[("num_local_experts", json!(0))]),
            "field `num_local_experts` = 0 is out of range; it must be at least 1",
        ),
        (
            with(minimal("MixtralForCausalLM"), &[("router_jitter_noise", json!(0.1))]),
            "`router_jitter_noise` = 0.1 is not supported: pleat routes deterministically; use 0.0",
        ),
        (
            with(minimal("Qwen2MoeForCausalLM"), &[("decoder_sparse_step", json!(2))]),
            "`decoder_sparse_step` = 2 is not supported: pleat builds routed experts in every layer; use 1",
        ),
        (
            with(minimal("Qwen2MoeForCausalLM"), &[("mlp_only_layers", json!([0, 3]))]),
            "`mlp_only_layers` = [0,3] is not supported: pleat builds routed experts in every layer; use []",
        ),
    ];
    for (text, message) in cases {
        check_error(&text, &format!("models/test/config.json: {message}"));
    }
}
