//! Builds the unsharded forward graph of a decoder-only transformer from a `ModelConfig`.
//!
//! The graph follows Hugging Face's `LlamaForCausalLM` (and its Mistral and Qwen2 siblings) op by
//! op: token embedding; per layer RMSNorm, q/k/v projections (Qwen2 adds biases), rotary embedding,
//! causal grouped-query attention, output projection, residual add, RMSNorm, gated SiLU MLP,
//! residual add; final RMSNorm and the LM head (the embedding table itself when tied). Mixtral
//! replaces each MLP with one `moe_mlp` node over its router and stacked experts. Weights keep
//! the checkpoint's layout (`[out, in]`), seen with split dims where that names heads. Each weight's
//! `param` node sits just before its first use, so liveness-based planning sees short lifetimes.

use crate::model::config::{Architecture, ConfigDtype, ModelConfig, MoeConfig};
use crate::{DType, DimName, Error, Graph, Mesh, Module, Op, Result, TensorType, ValueId};

use DimName::{Batch, Experts, Ffn, HeadDim, Heads, Hidden, KvHeads, Seq, Vocab};

/// The layer a node belongs to, from the names the builder gives (`layer3.…`), its parameters'
/// (`model.layers.3.…`) and their gradients (`grad.…`); `None` outside the layers.
pub fn layer_of(name: &str) -> Option<u64> {
    let name = name.strip_prefix("grad.").unwrap_or(name);
    let rest = name.strip_prefix("layer").or_else(|| name.strip_prefix("model.layers."))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The forward graph of `config` for `batch` sequences of `seq` tokens; its one output is the
/// logits `[batch, seq, vocab]`.
pub fn build(config: &ModelConfig, batch: u64, seq: u64) -> Result<Module> {
    let (mut graph, logits, _) = forward(config, batch, seq)?;
    graph.add_output(logits);
    Ok(Module { name: config.name.clone(), mesh: Mesh::default(), graph })
}

/// The training graph of `config` for `batch` sequences of `seq` tokens: the forward graph of
/// `build` and the loss `cross_entropy(logits, tokens)`, f32 `[]`, Hugging Face's causal-LM loss
/// with the tokens as labels; the loss (node `loss`) is its one output. `seq` must be at least 2.
/// A mixture of experts with `output_router_logits` adds Hugging Face's load-balancing loss
/// (`router_aux_loss_coef` times `load_balancing_loss_func` over every layer's router logits):
/// each layer's expert counts and summed router probabilities, summed over the layers, and their
/// `load_balancing_loss` just before the cross-entropy (node `loss.cross_entropy`); node `loss` is
/// then the sum. `pleat_passes::autodiff::differentiate` appends the backward graph.
pub fn build_training(config: &ModelConfig, batch: u64, seq: u64) -> Result<Module> {
    if seq < 2 {
        return Err(Error::UnsupportedModel {
            model: config.name.clone(),
            what: format!("seq={seq}: a next-token loss needs at least 2 tokens a sequence; use --seq 2 or more"),
        });
    }
    let aux = config.moe.as_ref().filter(|moe| moe.output_router_logits).map(|moe| {
        // load_balancing_loss_func averages the counts and the probabilities over every layer's
        // tokens and multiplies by the experts: coef · E / (L·T)² · Σ counts · probabilities.
        let rows = (config.num_layers * batch * seq) as f64;
        (moe.top_k, moe.router_aux_loss_coef * moe.num_experts as f64 / (rows * rows))
    });
    let (mut graph, logits, tokens, stats) = forward_with(config, batch, seq, aux)?;
    let scalar = TensorType::new(DType::F32, &[]);
    let Some((counts, probabilities)) =
        stats.into_iter().reduce(|(counts, probabilities), (layer_counts, layer_probabilities)| {
            let ty = graph.value(counts).ty.clone();
            let counts = graph.add(Op::Add, &[counts, layer_counts], ty.clone(), "aux.counts_sum");
            (counts, graph.add(Op::Add, &[probabilities, layer_probabilities], ty, "aux.probabilities_sum"))
        })
    else {
        let loss = graph.add(Op::CrossEntropy, &[logits, tokens], scalar, "loss");
        graph.add_output(loss);
        return Ok(Module { name: config.name.clone(), mesh: Mesh::default(), graph });
    };
    let aux_loss =
        graph.add(Op::LoadBalancingLoss, &[counts, probabilities], scalar.clone(), "aux.load_balancing_loss");
    let cross_entropy = graph.add(Op::CrossEntropy, &[logits, tokens], scalar.clone(), "loss.cross_entropy");
    let loss = graph.add(Op::Add, &[cross_entropy, aux_loss], scalar, "loss");
    graph.add_output(loss);
    Ok(Module { name: config.name.clone(), mesh: Mesh::default(), graph })
}

/// The forward graph without outputs, its logits and its tokens.
fn forward(config: &ModelConfig, batch: u64, seq: u64) -> Result<(Graph, ValueId, ValueId)> {
    forward_with(config, batch, seq, None).map(|(graph, logits, tokens, _)| (graph, logits, tokens))
}

/// The forward graph, and with `aux` (`(top_k, scale)`) each layer's scaled expert counts and
/// summed router probabilities.
#[allow(clippy::type_complexity)] // The graph and the three kinds of value a caller builds on.
fn forward_with(
    config: &ModelConfig,
    batch: u64,
    seq: u64,
    aux: Option<(u64, f64)>,
) -> Result<(Graph, ValueId, ValueId, Vec<(ValueId, ValueId)>)> {
    if batch == 0 || seq == 0 {
        return Err(Error::UnsupportedModel {
            model: config.name.clone(),
            what: format!("batch={batch} seq={seq}: both must be at least 1"),
        });
    }
    // Positions and token indices are u32 in the programs and the runtime.
    if batch.checked_mul(seq).is_none_or(|tokens| tokens > u64::from(u32::MAX)) {
        return Err(Error::UnsupportedModel {
            model: config.name.clone(),
            what: format!(
                "batch={batch} seq={seq}: more than 2^32 - 1 tokens a batch, which programs index with 32 bits; \
                 use a smaller --batch or --seq"
            ),
        });
    }
    if let Some(window) = config.sliding_window {
        if seq > window {
            return Err(Error::UnsupportedModel {
                model: config.name.clone(),
                what: format!(
                    "seq={seq} exceeds sliding_window={window}, and pleat runs full causal attention; \
                     use --seq {window} or less"
                ),
            });
        }
    }
    if config.attention_bias && !config.architecture.has_qkv_bias() {
        return Err(Error::UnsupportedModel {
            model: config.name.clone(),
            what: "attention_bias=true (biases on q/k/v/o projections) is not supported for Llama or Mistral \
                   configs; set it to false (no published Llama or Mistral checkpoint uses it)"
                .to_string(),
        });
    }
    let mut builder = Builder {
        graph: Graph::new(),
        config,
        dtype: dtype_of(config.dtype),
        batch,
        seq,
        aux,
        router_stats: Vec::new(),
    };
    let (logits, tokens) = builder.model();
    Ok((builder.graph, logits, tokens, builder.router_stats))
}

fn dtype_of(dtype: ConfigDtype) -> DType {
    match dtype {
        ConfigDtype::F32 => DType::F32,
        ConfigDtype::Bf16 => DType::Bf16,
        ConfigDtype::F16 => DType::F16,
    }
}

struct Builder<'a> {
    graph: Graph,
    config: &'a ModelConfig,
    dtype: DType,
    batch: u64,
    seq: u64,
    /// The load-balancing loss's `(top_k, scale)`, when training adds it.
    aux: Option<(u64, f64)>,
    /// Each layer's `(expert_counts, router_prob_sum)`, with `aux`.
    router_stats: Vec<(ValueId, ValueId)>,
}

impl Builder<'_> {
    fn ty(&self, dims: &[(DimName, u64)]) -> TensorType {
        TensorType::new(self.dtype, dims)
    }

    fn param(&mut self, name: &str, dims: &[(DimName, u64)]) -> ValueId {
        let ty = self.ty(dims);
        self.graph.add(Op::Param { name: name.to_string() }, &[], ty, name)
    }

    /// The logits and the tokens.
    fn model(&mut self) -> (ValueId, ValueId) {
        let config = self.config;
        let (batch, seq, hidden, vocab) = (self.batch, self.seq, config.hidden_size, config.vocab_size);
        let tokens =
            self.graph.add(Op::Tokens, &[], TensorType::new(DType::I32, &[(Batch, batch), (Seq, seq)]), "tokens");
        let positions = self.graph.add(Op::Positions, &[], TensorType::new(DType::I32, &[(Seq, seq)]), "positions");
        let table = self.param("model.embed_tokens.weight", &[(Vocab, vocab), (Hidden, hidden)]);
        let stream = self.ty(&[(Batch, batch), (Seq, seq), (Hidden, hidden)]);
        let mut residual = self.graph.add(Op::Embedding, &[table, tokens], stream.clone(), "embed");
        for layer in 0..config.num_layers {
            residual = self.layer(layer, residual, positions);
        }
        let norm_weight = self.param("model.norm.weight", &[(Hidden, hidden)]);
        let normed =
            self.graph.add(Op::RmsNorm { eps: config.rms_norm_eps }, &[residual, norm_weight], stream, "final_norm");
        let head = if config.tie_word_embeddings {
            table
        } else {
            self.param("lm_head.weight", &[(Vocab, vocab), (Hidden, hidden)])
        };
        let logits_ty = self.ty(&[(Batch, batch), (Seq, seq), (Vocab, vocab)]);
        (self.graph.add(Op::MatMul { contract: 1 }, &[normed, head], logits_ty, "lm_head"), tokens)
    }

    fn layer(&mut self, layer: u64, residual: ValueId, positions: ValueId) -> ValueId {
        let config = self.config;
        let (batch, seq, hidden) = (self.batch, self.seq, config.hidden_size);
        let (heads, kv_heads, head_dim, ffn) =
            (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size);
        let prefix = format!("model.layers.{layer}");
        let name = |part: &str| format!("layer{layer}.{part}");
        let stream = self.ty(&[(Batch, batch), (Seq, seq), (Hidden, hidden)]);
        let eps = config.rms_norm_eps;

        let norm_weight = self.param(&format!("{prefix}.input_layernorm.weight"), &[(Hidden, hidden)]);
        let x = self.graph.add(Op::RmsNorm { eps }, &[residual, norm_weight], stream.clone(), &name("attn_norm"));
        let q = self.projection(x, &prefix, "q_proj", (Heads, heads), head_dim, &name("q"));
        let k = self.projection(x, &prefix, "k_proj", (KvHeads, kv_heads), head_dim, &name("k"));
        let v = self.projection(x, &prefix, "v_proj", (KvHeads, kv_heads), head_dim, &name("v"));
        let rope = Op::Rope { rope: config.rope.clone() };
        let q_ty = self.graph.value(q).ty.clone();
        let k_ty = self.graph.value(k).ty.clone();
        let q = self.graph.add(rope.clone(), &[q, positions], q_ty.clone(), &name("q_rope"));
        let k = self.graph.add(rope, &[k, positions], k_ty, &name("k_rope"));
        let attention =
            self.graph.add(Op::Attention { causal: true }, &[q, k, v, positions, positions], q_ty, &name("attention"));
        let wo = self.param(
            &format!("{prefix}.self_attn.o_proj.weight"),
            &[(Hidden, hidden), (Heads, heads), (HeadDim, head_dim)],
        );
        let attn_out = self.graph.add(Op::MatMul { contract: 2 }, &[attention, wo], stream.clone(), &name("o_proj"));
        let residual = self.graph.add(Op::Add, &[residual, attn_out], stream.clone(), &name("attn_residual"));

        let norm_weight = self.param(&format!("{prefix}.post_attention_layernorm.weight"), &[(Hidden, hidden)]);
        let x = self.graph.add(Op::RmsNorm { eps }, &[residual, norm_weight], stream.clone(), &name("mlp_norm"));
        if let Some(moe) = &config.moe {
            let mut moe_out = self.experts(layer, x, moe);
            if let Some(width) = moe.shared_expert_intermediate_size {
                let shared = self.shared_expert(layer, x, width);
                moe_out = self.graph.add(Op::Add, &[moe_out, shared], stream.clone(), &name("moe_shared_sum"));
            }
            return self.graph.add(Op::Add, &[residual, moe_out], stream, &name("moe_residual"));
        }
        let mlp_out = self.gated_mlp(x, &format!("{prefix}.mlp"), &format!("layer{layer}."), ffn);
        self.graph.add(Op::Add, &[residual, mlp_out], stream, &name("mlp_residual"))
    }

    /// `down(silu(x·gateᵀ) * (x·upᵀ))` of width `ffn`, its weights `{weights}.gate_proj.weight` (and
    /// up, down), its nodes `{nodes}gate_proj` (and up_proj, silu_mul, down_proj).
    fn gated_mlp(&mut self, x: ValueId, weights: &str, nodes: &str, ffn: u64) -> ValueId {
        let (batch, seq, hidden) = (self.batch, self.seq, self.config.hidden_size);
        let stream = self.ty(&[(Batch, batch), (Seq, seq), (Hidden, hidden)]);
        let inner = self.ty(&[(Batch, batch), (Seq, seq), (Ffn, ffn)]);
        let w_gate = self.param(&format!("{weights}.gate_proj.weight"), &[(Ffn, ffn), (Hidden, hidden)]);
        let gate =
            self.graph.add(Op::MatMul { contract: 1 }, &[x, w_gate], inner.clone(), &format!("{nodes}gate_proj"));
        let w_up = self.param(&format!("{weights}.up_proj.weight"), &[(Ffn, ffn), (Hidden, hidden)]);
        let up = self.graph.add(Op::MatMul { contract: 1 }, &[x, w_up], inner.clone(), &format!("{nodes}up_proj"));
        let act = self.graph.add(Op::SiluMul, &[gate, up], inner, &format!("{nodes}silu_mul"));
        let w_down = self.param(&format!("{weights}.down_proj.weight"), &[(Hidden, hidden), (Ffn, ffn)]);
        self.graph.add(Op::MatMul { contract: 1 }, &[act, w_down], stream, &format!("{nodes}down_proj"))
    }

    /// The routed experts of layer `layer` on its normed stream `x`. The experts of a layer are one
    /// stacked tensor a projection, `[experts, ..]`: the name stands for Hugging Face's per-expert
    /// tensors (`experts.E.w1.weight` is entry `E` of `experts.w1.weight`).
    fn experts(&mut self, layer: u64, x: ValueId, moe: &MoeConfig) -> ValueId {
        let (experts, ffn, hidden) = (moe.num_experts, moe.expert_intermediate_size, self.config.hidden_size);
        let (block, [gate, up, down]) = match self.config.architecture {
            Architecture::Qwen2Moe => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
            _ => ("block_sparse_moe", ["w1", "w3", "w2"]),
        };
        let prefix = format!("model.layers.{layer}.{block}");
        let router = self.param(&format!("{prefix}.gate.weight"), &[(Experts, experts), (Hidden, hidden)]);
        let gate =
            self.param(&format!("{prefix}.experts.{gate}.weight"), &[(Experts, experts), (Ffn, ffn), (Hidden, hidden)]);
        let up =
            self.param(&format!("{prefix}.experts.{up}.weight"), &[(Experts, experts), (Ffn, ffn), (Hidden, hidden)]);
        let down =
            self.param(&format!("{prefix}.experts.{down}.weight"), &[(Experts, experts), (Hidden, hidden), (Ffn, ffn)]);
        let ty = self.graph.value(x).ty.clone();
        let op = Op::MoeMlp { top_k: moe.top_k, normalize: moe.normalize_top_k, dispatch: None };
        let output = self.graph.add(op, &[x, router, gate, up, down], ty, &format!("layer{layer}.moe"));
        if let Some((top_k, scale)) = self.aux {
            let stat = TensorType::new(DType::F32, &[(Experts, experts)]);
            let counts = self.graph.add(
                Op::ExpertCounts { top_k, scale },
                &[x, router],
                stat.clone(),
                &format!("layer{layer}.expert_counts"),
            );
            let sums = self.graph.add(Op::RouterProbSum, &[x, router], stat, &format!("layer{layer}.router_prob_sum"));
            self.router_stats.push((counts, sums));
        }
        output
    }

    /// Qwen2-MoE's shared expert of layer `layer`: a gated MLP of width `ffn` that every token goes
    /// through, scaled by `sigmoid(x · shared_expert_gate)`.
    fn shared_expert(&mut self, layer: u64, x: ValueId, ffn: u64) -> ValueId {
        let (batch, seq, hidden) = (self.batch, self.seq, self.config.hidden_size);
        let prefix = format!("model.layers.{layer}.mlp");
        let name = |part: &str| format!("layer{layer}.shared_expert.{part}");
        let stream = self.ty(&[(Batch, batch), (Seq, seq), (Hidden, hidden)]);
        let output =
            self.gated_mlp(x, &format!("{prefix}.shared_expert"), &format!("layer{layer}.shared_expert."), ffn);
        // The checkpoint's `[1, hidden]` gate, seen as `[hidden]`: one logit a token.
        let w_shared_gate = self.param(&format!("{prefix}.shared_expert_gate.weight"), &[(Hidden, hidden)]);
        let logits = self.ty(&[(Batch, batch), (Seq, seq)]);
        let gate_logit = self.graph.add(Op::MatMul { contract: 1 }, &[x, w_shared_gate], logits, &name("gate"));
        self.graph.add(Op::SigmoidScale, &[gate_logit, output], stream, &name("scaled"))
    }

    /// `x · Wᵀ (+ b)` for a q/k/v projection onto `heads` heads of `head_dim`.
    fn projection(
        &mut self,
        x: ValueId,
        prefix: &str,
        proj: &str,
        heads: (DimName, u64),
        head_dim: u64,
        name: &str,
    ) -> ValueId {
        let (batch, seq, hidden) = (self.batch, self.seq, self.config.hidden_size);
        let weight =
            self.param(&format!("{prefix}.self_attn.{proj}.weight"), &[heads, (HeadDim, head_dim), (Hidden, hidden)]);
        let ty = self.ty(&[(Batch, batch), (Seq, seq), heads, (HeadDim, head_dim)]);
        let projected = self.graph.add(Op::MatMul { contract: 1 }, &[x, weight], ty.clone(), name);
        if !self.has_qkv_bias() {
            return projected;
        }
        let bias = self.param(&format!("{prefix}.self_attn.{proj}.bias"), &[heads, (HeadDim, head_dim)]);
        self.graph.add(Op::Add, &[projected, bias], ty, &format!("{name}_bias"))
    }

    fn has_qkv_bias(&self) -> bool {
        self.config.architecture.has_qkv_bias()
    }
}
