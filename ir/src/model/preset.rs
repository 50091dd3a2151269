//! Named model configurations, so that tests and the CLI need no `config.json` at hand.
//!
//! Each preset equals what [`ModelConfig::from_json_str`] reads from `examples/<name>/config.json`
//! (a test checks this), and the Llama ones carry the values Meta published on the Hugging Face Hub.
//! `tiny` is the model every test and snapshot runs; `tsp-7b` is the model of the TSP paper.

use super::config::{Architecture, ConfigDtype, ConfigError, ModelConfig, MoeConfig, RopeConfig, RopeScaling};

/// Every preset name, in the order error messages list them.
pub const PRESET_NAMES: &[&str] =
    &["tiny", "tiny-moe", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "tsp-7b", "mixtral-8x7b"];

/// The preset called `name`, or [`ConfigError::UnknownPreset`] listing [`PRESET_NAMES`].
pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
    match name {
        "tiny" => Ok(tiny()),
        "llama2-7b" => Ok(llama2_7b()),
        "llama3-8b" => Ok(llama3(name, 4096, 32, 32, 14336, 8192, RopeScaling::None)),
        "llama3-70b" => Ok(llama3(name, 8192, 80, 64, 28672, 8192, RopeScaling::None)),
        "llama3-405b" => Ok(llama3(name, 16384, 126, 128, 53248, 131072, llama31_rope_scaling())),
        "tsp-7b" => Ok(tsp_7b()),
        "tiny-moe" => Ok(tiny_moe()),
        "mixtral-8x7b" => Ok(mixtral_8x7b()),
        _ => Err(ConfigError::UnknownPreset { name: name.to_owned(), known: PRESET_NAMES }),
    }
}

/// A two-layer GQA model small enough for the reference interpreter: 8 query heads share 4 KV heads.
fn tiny() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 256,
        hidden_size: 128,
        num_layers: 2,
        num_heads: 8,
        num_kv_heads: 4,
        head_dim: 16,
        intermediate_size: 256,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        dtype: ConfigDtype::F32,
        attention_bias: false,
        max_position_embeddings: 512,
        sliding_window: None,
        moe: None,
        name: "tiny".to_owned(),
    }
}

/// `tiny` with a Mixtral block in place of each MLP: 8 experts of width 64, each token routed to 2;
/// training adds the load-balancing loss (`output_router_logits`, coefficient 0.02).
fn tiny_moe() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Mixtral,
        intermediate_size: 64,
        moe: Some(MoeConfig {
            num_experts: 8,
            top_k: 2,
            expert_intermediate_size: 64,
            normalize_top_k: true,
            shared_expert_intermediate_size: None,
            router_aux_loss_coef: 0.02,
            output_router_logits: true,
        }),
        name: "tiny-moe".to_owned(),
        ..tiny()
    }
}

/// `mistralai/Mixtral-8x7B-v0.1`: Mistral 7B's attention (32 heads, 8 KV heads, RoPE theta 10^6) with
/// 8 experts of width 14336 a layer and 2 a token, bfloat16; 46.7B parameters, 12.9B active.
fn mixtral_8x7b() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Mixtral,
        vocab_size: 32000,
        hidden_size: 4096,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        intermediate_size: 14336,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 1e6, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        dtype: ConfigDtype::Bf16,
        attention_bias: false,
        max_position_embeddings: 32768,
        sliding_window: None,
        moe: Some(MoeConfig {
            num_experts: 8,
            top_k: 2,
            expert_intermediate_size: 14336,
            normalize_top_k: true,
            shared_expert_intermediate_size: None,
            router_aux_loss_coef: 0.02,
            output_router_logits: false,
        }),
        name: "mixtral-8x7b".to_owned(),
    }
}

/// `meta-llama/Llama-2-7b-hf`: multi-head attention, RoPE theta 10000, stored in float16.
fn llama2_7b() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 32000,
        hidden_size: 4096,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 32,
        head_dim: 128,
        intermediate_size: 11008,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        dtype: ConfigDtype::F16,
        attention_bias: false,
        max_position_embeddings: 4096,
        sliding_window: None,
        moe: None,
        name: "llama2-7b".to_owned(),
    }
}

/// `meta-llama/Meta-Llama-3-8B`, `-70B` and `Llama-3.1-405B`: 8 KV heads, head_dim 128, a 128256-token
/// vocabulary, RoPE theta 500000, bfloat16. Only 3.1 rescales RoPE.
fn llama3(
    name: &str,
    hidden_size: u64,
    num_layers: u64,
    num_heads: u64,
    intermediate_size: u64,
    max_position_embeddings: u64,
    scaling: RopeScaling,
) -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 128256,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads: 8,
        head_dim: 128,
        intermediate_size,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 500000.0, scaling },
        tie_word_embeddings: false,
        dtype: ConfigDtype::Bf16,
        attention_bias: false,
        max_position_embeddings,
        sliding_window: None,
        moe: None,
        name: name.to_owned(),
    }
}

/// Llama 3.1's `rope_scaling`: `{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
/// "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}`.
fn llama31_rope_scaling() -> RopeScaling {
    RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    }
}

/// The TSP paper's model: h = 4096, 32 layers, 32 heads (no GQA), a gated MLP of width 4h, bfloat16.
fn tsp_7b() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 32000,
        hidden_size: 4096,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 32,
        head_dim: 128,
        intermediate_size: 4 * 4096,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        dtype: ConfigDtype::Bf16,
        attention_bias: false,
        max_position_embeddings: 4096,
        sliding_window: None,
        moe: None,
        name: "tsp-7b".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `config.json` of each preset, as shipped in `examples/`.
    fn example_file(name: &str) -> Option<&'static str> {
        match name {
            "tiny" => Some(include_str!("../../../examples/tiny/config.json")),
            "llama2-7b" => Some(include_str!("../../../examples/llama2-7b/config.json")),
            "llama3-8b" => Some(include_str!("../../../examples/llama3-8b/config.json")),
            "llama3-70b" => Some(include_str!("../../../examples/llama3-70b/config.json")),
            "llama3-405b" => Some(include_str!("../../../examples/llama3-405b/config.json")),
            "tsp-7b" => Some(include_str!("../../../examples/tsp-7b/config.json")),
            "tiny-moe" => Some(include_str!("../../../examples/tiny-moe/config.json")),
            "mixtral-8x7b" => Some(include_str!("../../../examples/mixtral-8x7b/config.json")),
            _ => None,
        }
    }

    #[test]
    fn every_preset_equals_its_example_file() {
        for &name in PRESET_NAMES {
            let text = example_file(name).unwrap_or_else(|| panic!("no example file for preset {name}"));
            let source = format!("examples/{name}/config.json");
            let parsed = ModelConfig::from_json_str(text, &source).unwrap_or_else(|error| panic!("{error}"));
            assert_eq!(preset(name).unwrap(), parsed, "preset {name}");
        }
    }

    /// Parameters of a Llama-style model without biases, counted tensor by tensor.
    #[allow(clippy::too_many_arguments)]
    fn naive_count(vocab: u64, hidden: u64, layers: u64, heads: u64, kv_heads: u64, head_dim: u64, ffn: u64) -> u64 {
        let q_proj = hidden * heads * head_dim;
        let k_proj = hidden * kv_heads * head_dim;
        let v_proj = k_proj;
        let o_proj = heads * head_dim * hidden;
        let (gate_proj, up_proj, down_proj) = (hidden * ffn, hidden * ffn, ffn * hidden);
        let (input_layernorm, post_attention_layernorm) = (hidden, hidden);
        let layer = q_proj + k_proj + v_proj + o_proj + gate_proj + up_proj + down_proj;
        let embed_tokens = vocab * hidden;
        let (final_norm, lm_head) = (hidden, vocab * hidden);
        embed_tokens + layers * (layer + input_layernorm + post_attention_layernorm) + final_norm + lm_head
    }

    #[test]
    fn param_counts_match_published_totals() {
        // Totals published for the Hugging Face checkpoints (sum of tensor sizes in the safetensors).
        let published = [
            ("llama2-7b", 6_738_415_616, (32000, 4096, 32, 32, 32, 128, 11008)),
            ("llama3-8b", 8_030_261_248, (128256, 4096, 32, 32, 8, 128, 14336)),
            ("llama3-70b", 70_553_706_496, (128256, 8192, 80, 64, 8, 128, 28672)),
            ("llama3-405b", 405_853_388_800, (128256, 16384, 126, 128, 8, 128, 53248)),
        ];
        for (name, total, (vocab, hidden, layers, heads, kv_heads, head_dim, ffn)) in published {
            assert_eq!(naive_count(vocab, hidden, layers, heads, kv_heads, head_dim, ffn), total, "{name} by hand");
            assert_eq!(preset(name).unwrap().param_count(), total, "{name}");
        }
    }

    #[test]
    fn param_counts_of_tiny_and_tsp() {
        // tiny: embed 256*128 = 32768; per layer q 128*128 + k, v 2*128*64 + o 128*128 = 49152, mlp
        // 3*128*256 = 98304, norms 256, so 147712; two layers 295424; final norm 128; lm_head 32768.
        assert_eq!(preset("tiny").unwrap().param_count(), 32768 + 295424 + 128 + 32768);
        assert_eq!(naive_count(256, 128, 2, 8, 4, 16, 256), 361_088);
        // tsp-7b: 4 * 4096^2 + 3 * 4096 * 16384 + 2 * 4096 = 268,443,648 per layer.
        let tsp = 2 * 32000 * 4096 + 32 * 268_443_648 + 4096;
        assert_eq!(preset("tsp-7b").unwrap().param_count(), tsp);
        assert_eq!(naive_count(32000, 4096, 32, 32, 32, 128, 16384), tsp);
    }

    #[test]
    fn mixtral_counts_match_the_published_totals() {
        // Mixtral 8x7B, tensor by tensor: embed and lm_head 32000*4096 each; per layer q and o
        // 4096*4096, k and v 4096*1024, the router 8*4096, each expert's w1, w3 14336*4096 and w2
        // 4096*14336, two norms 4096; the final norm 4096.
        let (embed, attention, router, expert, norms) =
            (32000 * 4096, 2 * 4096 * 4096 + 2 * 4096 * 1024, 8 * 4096, 3 * 14336 * 4096, 2 * 4096);
        let total = 2 * embed + 32 * (attention + router + 8 * expert + norms) + 4096;
        let active = 2 * embed + 32 * (attention + router + 2 * expert + norms) + 4096;
        let mixtral = preset("mixtral-8x7b").unwrap();
        assert_eq!(mixtral.param_count(), total);
        assert_eq!(mixtral.active_param_count(), active);
        // Mistral AI's figures: 46.7B parameters, 12.9B used a token; within 0.5%.
        assert!((total as f64 / 46.7e9 - 1.0).abs() < 0.005, "total {total}");
        assert!((active as f64 / 12.9e9 - 1.0).abs() < 0.005, "active {active}");
        // A dense model's active count is its total.
        let llama = preset("llama3-8b").unwrap();
        assert_eq!(llama.active_param_count(), llama.param_count());
    }

    #[test]
    fn tiny_is_exactly_as_specified() {
        let tiny = preset("tiny").unwrap();
        let sizes = [tiny.vocab_size, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads];
        assert_eq!(sizes, [256, 128, 2, 8, 4]);
        assert_eq!((tiny.head_dim, tiny.intermediate_size), (16, 256));
        assert_eq!((tiny.rope.theta, tiny.rms_norm_eps), (10000.0, 1e-5));
        assert_eq!(tiny.rope.scaling, RopeScaling::None);
        assert!(!tiny.tie_word_embeddings);
        assert_eq!(tiny.dtype, ConfigDtype::F32);
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let error = preset("llama4").unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown preset `llama4`; use one of tiny, tiny-moe, llama2-7b, llama3-8b, llama3-70b, llama3-405b, \
             tsp-7b, mixtral-8x7b or a path to a config.json"
        );
    }
}
