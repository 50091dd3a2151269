//! The sizes of a decoder-only transformer as the cost model sees them, and its parameter counts.
//!
//! [`ModelShape`] holds only numbers: the Llama family's sizes from a [`ModelConfig`], and the two
//! switches that separate it from the GPT layers of the published formulas (a gated MLP or not,
//! LayerNorm with dropout or RMSNorm without). [`ModelShape::param_count`] equals
//! `ModelConfig::param_count`, and [`ModelShape::active_param_count`] equals
//! `ModelConfig::active_param_count`, for every config (a test checks the presets).
//!
//! A mixture of experts (Mixtral, Qwen2-MoE) carries [`Experts`]: every layer's MLP is a router
//! (`[experts, h]`, whole on every rank) and `experts` gated MLPs of width `f_e`, of which each token
//! runs `top_k`. Qwen2-MoE's shared expert, a gated MLP every token goes through, is the shape's
//! dense MLP ([`ModelShape::ffn`] is its width, 0 for Mixtral), so tensor parallelism and TSP split
//! and cost it as they do a dense model's MLP; its `[h]` gate vector counts with the router.

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

/// The routed experts that replace the MLP of every layer of a mixture of experts.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Experts {
    /// Routed experts a layer E.
    pub count: u64,
    /// Experts a token is sent to k.
    pub top_k: u64,
    /// Width of each expert's gated MLP f_e.
    pub ffn: u64,
    /// Whether a shared expert (Qwen2-MoE) runs beside the routed ones; its width is the shape's
    /// [`ModelShape::ffn`], and its sigmoid gate adds an `[h]` vector a layer.
    pub shared_expert: bool,
    /// Whether training adds the router's load-balancing loss (`output_router_logits`): each
    /// layer's expert counts and router probability sums are then kept for it.
    pub load_balancing_loss: bool,
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
    /// MLP width f: the dense MLP's, or for a mixture of experts the shared expert's (0 without one).
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
    /// The routed experts of a mixture of experts; `None` for a dense model.
    pub experts: Option<Experts>,
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
            experts: None,
        }
    }

    /// The shape of a Llama-family config: gated MLP, RMSNorm, no dropout; routed experts in place
    /// of the MLP for a mixture of experts (its shared expert, if any, as the dense MLP).
    pub fn from_config(config: &ModelConfig) -> ModelShape {
        let experts = config.moe.as_ref().map(|moe| Experts {
            count: moe.num_experts,
            top_k: moe.top_k,
            ffn: moe.expert_intermediate_size,
            shared_expert: moe.shared_expert_intermediate_size.is_some(),
            load_balancing_loss: moe.output_router_logits,
        });
        // A mixture's `intermediate_size` is not a layer's dense MLP: Mixtral's is the experts'
        // width, Qwen2-MoE's belongs to dense layers pleat does not build.
        let ffn = match &config.moe {
            Some(moe) => moe.shared_expert_intermediate_size.unwrap_or(0),
            None => config.intermediate_size,
        };
        ModelShape {
            name: config.name.clone(),
            vocab: config.vocab_size,
            hidden: config.hidden_size,
            layers: config.num_layers,
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            ffn,
            gated_mlp: true,
            norm: Norm::RmsNorm,
            dropout: false,
            qkv_bias: config.attention_bias,
            tied_embeddings: config.tie_word_embeddings,
            dtype_bytes: config.dtype.size_in_bytes(),
            experts,
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
    /// Weights of one routed expert (gate, up, down): `3·h·f_e`; 0 for a dense model.
    pub fn expert_weights(&self) -> u64 {
        self.experts.as_ref().map_or(0, |experts| 3 * self.hidden * experts.ffn)
    }
    /// Weights of every routed expert of one layer: `E·3·h·f_e`.
    pub fn routed_expert_weights(&self) -> u64 {
        self.experts.as_ref().map_or(0, |experts| experts.count * self.expert_weights())
    }
    /// The routing parameters of one layer, whole on every rank: the router `[E, h]`, and the shared
    /// expert's `[h]` gate vector when there is one; 0 for a dense model.
    pub fn router_params(&self) -> u64 {
        self.experts.as_ref().map_or(0, |experts| {
            let shared_gate = if experts.shared_expert { self.hidden } else { 0 };
            experts.count * self.hidden + shared_gate
        })
    }
    /// Every parameter of one decoder layer.
    pub fn layer_params(&self) -> u64 {
        self.attention_weights()
            + self.attention_biases()
            + self.mlp_weights()
            + self.layer_norm_params()
            + self.router_params()
            + self.routed_expert_weights()
    }
    /// The parameters of one layer a token's forward pass reads: [`Self::layer_params`] with only
    /// `top_k` routed experts.
    pub fn active_layer_params(&self) -> u64 {
        let idle = self.experts.as_ref().map_or(0, |experts| experts.count - experts.top_k);
        self.layer_params() - idle * self.expert_weights()
    }
    /// The layer's dense matrix parameters (what tensor parallelism splits, routed experts aside).
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
    /// Every parameter a token's forward pass reads (only `top_k` routed experts a layer); equal to
    /// [`Self::param_count`] for a dense model.
    pub fn active_param_count(&self) -> u64 {
        self.embedding_params()
            + self.layers * self.active_layer_params()
            + self.final_norm_params()
            + self.lm_head_params()
    }
    /// The parameters that multiply a token's activations: every matrix of the layers and the LM
    /// head (the input embedding is a lookup); for a mixture of experts, the router and the `top_k`
    /// experts a token runs (active parameters). This is the `N` of the `6·N·tokens` model-FLOPs
    /// formula.
    pub fn matmul_params(&self) -> u64 {
        let routed =
            self.experts.as_ref().map_or(0, |experts| self.router_params() + experts.top_k * self.expert_weights());
        self.layers * (self.layer_matrix_params() + routed) + self.embedding_params()
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

    /// `tiny-moe` with a Qwen2-MoE shared expert of width 96 beside its routed experts.
    fn tiny_moe_with_a_shared_expert() -> ModelConfig {
        let mut config = preset("tiny-moe").unwrap();
        config.moe.as_mut().unwrap().shared_expert_intermediate_size = Some(96);
        config.name = "tiny-moe-shared".into();
        config
    }

    #[test]
    fn active_param_count_equals_the_configs() {
        let shared = tiny_moe_with_a_shared_expert();
        let shape = ModelShape::from_config(&shared);
        assert_eq!(shape.param_count(), shared.param_count());
        // The shared expert (3·128·96) and its gate (128) are the dense part of the layer.
        assert_eq!((shape.ffn, shape.mlp_weights(), shape.router_params()), (96, 3 * 128 * 96, 8 * 128 + 128));
        for config in PRESET_NAMES.iter().map(|name| preset(name).unwrap()).chain([shared]) {
            let name = config.name.clone();
            let shape = ModelShape::from_config(&config);
            assert_eq!(shape.active_param_count(), config.active_param_count(), "{name}");
            if config.moe.is_none() {
                assert_eq!(shape.active_param_count(), shape.param_count(), "{name}");
            }
        }
    }

    #[test]
    fn mixtral_counts_by_hand() {
        // Per layer: attention 2·4096·4096 + 2·4096·1024, router 8·4096, 8 experts of 3·4096·14336,
        // two norms; embedding and LM head 32000·4096 each, the final norm.
        let shape = ModelShape::from_config(&preset("mixtral-8x7b").unwrap());
        let (h, f, layers) = (4096u64, 14336u64, 32u64);
        let attention = 2 * h * h + 2 * h * 1024;
        let expert = 3 * h * f;
        let outside = 2 * 32000 * h + h;
        let total = outside + layers * (attention + 8 * h + 8 * expert + 2 * h);
        let active = outside + layers * (attention + 8 * h + 2 * expert + 2 * h);
        assert_eq!((shape.param_count(), total), (46_702_792_704, 46_702_792_704));
        assert_eq!((shape.active_param_count(), active), (12_879_925_248, 12_879_925_248));
        // Model FLOPs count the router and two experts a token, not the idle six.
        assert_eq!(shape.matmul_params(), layers * (attention + 8 * h + 2 * expert) + 32000 * h);
        assert_eq!(shape.ffn, 0, "no dense MLP beside Mixtral's experts");
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
