//! Property tests of the `config.json` reader: random valid configs, written as transformers 4 and 5
//! would write them, read back equal; damaged files give errors, never panics.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

const FILE: &str = "models/random/config.json";

/// A valid config of random sizes, written as transformers 4 or 5 would write it.
fn arbitrary_config() -> impl Strategy<Value = ModelConfig> {
    let sizes = (1u64..5000, 1u64..64, 1u64..6, 1u64..8, 1u64..40, 1u64..5000);
    let rope = prop_oneof![
        (1.0f64..1e7).prop_map(|theta| RopeConfig { theta, scaling: RopeScaling::None }),
        (1.0f64..1e7, 1.0f64..16.0, 0.5f64..2.0, 0.1f64..8.0, 1u64..100_000).prop_map(
            |(theta, factor, low, span, original)| RopeConfig {
                theta,
                scaling: RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: low + span,
                    original_max_position_embeddings: original,
                },
            }
        ),
    ];
    let flags = (any::<bool>(), 0usize..3, 0usize..3, 1u64..1_000_000, 1e-7f64..1e-3);
    (sizes, rope, flags).prop_map(|((vocab, hidden, layers, kv_heads, half_head_dim, ffn), rope, flags)| {
        let (tie, dtype_index, architecture_index, max_positions, eps) = flags;
        let architecture = Architecture::ALL[architecture_index];
        ModelConfig {
            architecture,
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: kv_heads * 2,
            num_kv_heads: kv_heads,
            head_dim: half_head_dim * 2,
            intermediate_size: ffn,
            rms_norm_eps: eps,
            rope,
            tie_word_embeddings: tie,
            dtype: [ConfigDtype::F32, ConfigDtype::Bf16, ConfigDtype::F16][dtype_index],
            attention_bias: architecture == Architecture::Qwen2,
            max_position_embeddings: max_positions,
            sliding_window: (architecture == Architecture::Mistral).then_some(4096),
            moe: None,
            name: "random".to_owned(),
        }
    })
}

/// Writes `config` as a transformers 4 (`version_5 == false`) or 5 `config.json`.
fn write_hf_json(config: &ModelConfig, version_5: bool) -> String {
    let mut object = json!({
        "architectures": [config.architecture.class_name()],
        "model_type": config.architecture.model_type(),
        "_name_or_path": config.name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
    });
    if let Some(window) = config.sliding_window {
        object["sliding_window"] = json!(window);
    }
    let mut rope = match config.rope.scaling {
        RopeScaling::None => json!({"rope_type": "default"}),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => json!({
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original_max_position_embeddings,
        }),
    };
    if version_5 {
        rope["rope_theta"] = json!(config.rope.theta);
        object["rope_parameters"] = rope;
        object["dtype"] = json!(config.dtype.hf_name());
    } else {
        object["rope_theta"] = json!(config.rope.theta);
        object["rope_scaling"] = if config.rope.scaling == RopeScaling::None { Value::Null } else { rope };
        object["torch_dtype"] = json!(config.dtype.hf_name());
    }
    serde_json::to_string_pretty(&object).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn written_configs_read_back_equal_in_both_styles(config in arbitrary_config()) {
        for version_5 in [false, true] {
            let read = ModelConfig::from_json_str(&write_hf_json(&config, version_5), FILE);
            prop_assert_eq!(read.as_ref(), Ok(&config), "transformers {}", if version_5 { 5 } else { 4 });
        }
    }

    #[test]
    fn damaged_configs_are_errors_not_panics(config in arbitrary_config(), cut in 0usize..2000, junk in "[\\[\\]{}\",:0-9a-z -]{0,3}") {
        let text = write_hf_json(&config, cut % 2 == 0);
        let cut = (0..=cut.min(text.len())).rev().find(|&index| text.is_char_boundary(index)).unwrap_or(0);
        let damaged = format!("{}{junk}{}", &text[..cut], &text[cut..]);
        // Either reading succeeds or it names the file; it never panics.
        if let Err(error) = ModelConfig::from_json_str(&damaged, FILE) {
            let message = error.to_string();
            prop_assert!(message.starts_with(FILE), "{}", message);
        }
    }
}
