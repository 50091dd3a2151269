//! The sizes of a decoder-only transformer as the cost model sees them, and its parameter counts.
//!
//! [`ModelShape`] holds only numbers: the Llama family's sizes from a [`ModelConfig`], and the two
//! switches that separate it from the GPT layers of the published formulas (a gated MLP or not,
//! LayerNorm with dropout or RMSNorm without). [`ModelShape::param_count`] equals
//! `ModelConfig::param_count` for every config (a test checks the presets).

use pleat_ir::model::config::ModelConfig;

/// The normalization of a layer: what it stores and how many parameters it has.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Norm {
    /// RMSNorm: a scale vector.
    RmsNorm,
    /// LayerNorm: a scale and a bias vector.
    LayerNorm,
}

impl Norm {
    /// Parameters a norm of width `hidden`.
    pub fn params(self, hidden: u64) -> u64 {
        match self {
            Norm::RmsNorm => hidden,
            Norm::LayerNorm => 2 * hidden,
        }
    }
}

/// The sizes of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelShape {
    /// A display name.
    pub name: String,
    /// The (padded) vocabulary.
    pub vocab: u64,
    /// The residual width h.
    pub hidden: u64,
    /// Decoder layers L.
    pub layers: u64,
    /// Query heads a.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Channels a head.
    pub head_dim: u64,
    /// MLP width f.
    pub ffn: u64,
    /// A gated MLP (SwiGLU: gate, up, down) rather than two matrices.
    pub gated_mlp: bool,
    /// The layers' normalization.
    pub norm: Norm,
    /// Dropout after attention scores, attention output and MLP (stores a 1-byte mask each).
    pub dropout: bool,
    /// Biases on q, k and v (Qwen2).
    pub qkv_bias: bool,
    /// The LM head reuses the embedding table.
    pub tied_embeddings: bool,
    /// Bytes an element of weights and activations (2 for bf16 and f16, 4 for f32).
    pub dtype_bytes: u64,
}

impl ModelShape {
    /// A GPT as Megatron and Korthikanti et al. count it: multi-head attention, a plain MLP of width
    /// 4h, LayerNorm, dropout, tied embeddings, 16-bit.
    pub fn gpt(name: &str, vocab: u64, hidden: u64, layers: u64, heads: u64) -> ModelShape {
        ModelShape {
            name: name.into(),
            vocab,
            hidden,
            layers,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            ffn: 4 * hidden,
            gated_mlp: false,
            norm: Norm::LayerNorm,
            dropout: true,
            qkv_bias: false,
            tied_embeddings: true,
            dtype_bytes: 2,
        }
    }

    /// The shape of a Llama-family config: gated MLP, RMSNorm, no dropout.
    pub fn from_config(config: &ModelConfig) -> ModelShape {
        ModelShape {
            name: config.name.clone(),
            vocab: config.vocab_size,
            hidden: config.hidden_size,
            layers: config.num_layers,
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            ffn: config.intermediate_size,
            gated_mlp: true,
            norm: Norm::RmsNorm,
            dropout: false,
            qkv_bias: config.attention_bias,
            tied_embeddings: config.tie_word_embeddings,
            dtype_bytes: config.dtype.size_in_bytes(),
        }
    }

    /// Width of the query projection (`heads · head_dim`).
    pub fn query_width(&self) -> u64 {
        self.heads * self.head_dim
    }
    /// Width of the key (or value) projection (`kv_heads · head_dim`).
    pub fn kv_width(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
    /// Weights of q, k, v and o in one layer (no biases).
    pub fn attention_weights(&self) -> u64 {
        2 * self.hidden * self.query_width() + 2 * self.hidden * self.kv_width()
    }
    /// Biases of q, k and v in one layer.
    pub fn attention_biases(&self) -> u64 {
        if self.qkv_bias {
            self.query_width() + 2 * self.kv_width()
        } else {
            0
        }
    }
    /// Matrices of the MLP: gate, up, down (or in, out).
    pub fn mlp_matrices(&self) -> u64 {
        if self.gated_mlp {
            3
        } else {
            2
        }
    }
    /// Weights of the MLP in one layer.
    pub fn mlp_weights(&self) -> u64 {
        self.mlp_matrices() * self.hidden * self.ffn
    }
    /// Parameters of the two norms of a layer.
    pub fn layer_norm_params(&self) -> u64 {
        2 * self.norm.params(self.hidden)
    }
    /// Every parameter of one decoder layer.
    pub fn layer_params(&self) -> u64 {
        self.attention_weights() + self.attention_biases() + self.mlp_weights() + self.layer_norm_params()
    }
    /// The layer's matrix parameters (what tensor parallelism splits).
    pub fn layer_matrix_params(&self) -> u64 {
        self.attention_weights() + self.mlp_weights()
    }
    /// Rows times width of the embedding table.
    pub fn embedding_params(&self) -> u64 {
        self.vocab * self.hidden
    }
    /// The LM head's own parameters (0 when tied).
    pub fn lm_head_params(&self) -> u64 {
        if self.tied_embeddings {
            0
        } else {
            self.embedding_params()
        }
    }
    /// The final norm's parameters.
    pub fn final_norm_params(&self) -> u64 {
        self.norm.params(self.hidden)
    }
    /// Every parameter of the model.
    pub fn param_count(&self) -> u64 {
        self.embedding_params() + self.layers * self.layer_params() + self.final_norm_params() + self.lm_head_params()
    }
    /// The parameters that multiply activations: every matrix of the layers and the LM head (the
    /// input embedding is a lookup). This is the `N` of the `6·N·tokens` model-FLOPs formula.
    pub fn matmul_params(&self) -> u64 {
        self.layers * self.layer_matrix_params() + self.embedding_params()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::{preset, PRESET_NAMES};

    #[test]
    fn param_count_equals_the_configs() {
        for &name in PRESET_NAMES {
            let config = preset(name).unwrap();
            assert_eq!(ModelShape::from_config(&config).param_count(), config.param_count(), "{name}");
        }
    }

    #[test]
    fn tsp_7b_layer_is_16h_squared() {
        // 4h² of attention (MHA) and 3·h·4h of gated MLP: the 16h² of the TSP volume formula.
        let shape = ModelShape::from_config(&preset("tsp-7b").unwrap());
        let h = 4096;
        assert_eq!(shape.layer_matrix_params(), 16 * h * h);
        assert_eq!(shape.matmul_params(), 32 * 16 * h * h + 32000 * h);
    }
}
