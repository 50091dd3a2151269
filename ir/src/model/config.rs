//! Model configurations read from Hugging Face `config.json` files.
//!
//! [`ModelConfig::from_json_str`] reads the Llama family (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`) and its mixture-of-experts siblings (`MixtralForCausalLM`, `Qwen2MoeForCausalLM`)
//! in both styles found in the wild: transformers 4 (top-level `rope_theta`,
//! `rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`). Optional fields take
//! the defaults of the matching transformers config class, per architecture.
//!
//! Guarantees: a returned config has every size at least 1, `num_attention_heads` a multiple of
//! `num_key_value_heads`, an even `head_dim`, a RoPE the crate can compute ([`super::rope::inv_freq`]) and
//! a parameter count that fits in a `u64`. Every error names the file and the field. The JSON is walked as
//! a `serde_json::Value` rather than derived, so that each message can say which field was wrong.
//!
//! Not here: the graph builder (which decides what to do with, for example, `sliding_window`) and file IO
//! (callers pass the text and a file name for messages).

/// A result whose error is a [`ConfigError`].
pub type Result<T> = std::result::Result<T, ConfigError>;

/// The model families pleat builds; each is a Llama-style decoder (GQA, RoPE, RMSNorm, gated SiLU MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `LlamaForCausalLM` (`model_type` `llama`).
    Llama,
    /// `MistralForCausalLM` (`model_type` `mistral`): Llama plus an optional sliding window.
    Mistral,
    /// `Qwen2ForCausalLM` (`model_type` `qwen2`): Llama plus biases on the q, k and v projections.
    Qwen2,
    /// `MixtralForCausalLM` (`model_type` `mixtral`): Mistral with every MLP replaced by routed experts.
    Mixtral,
    /// `Qwen2MoeForCausalLM` (`model_type` `qwen2_moe`): Qwen2 with routed experts beside a shared expert
    /// behind a sigmoid gate.
    Qwen2Moe,
}

impl Architecture {
    /// Every supported architecture, in the order error messages list them.
    pub const ALL: [Architecture; 5] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Mixtral,
        Architecture::Qwen2Moe,
    ];

    /// The Hugging Face class names of [`Architecture::ALL`], as `architectures` spells them.
    pub const CLASS_NAMES: &'static [&'static str] =
        &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"];

    /// The Hugging Face class name, as it appears in `architectures`.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }

    /// The Hugging Face `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen2Moe => "qwen2_moe",
        }
    }

    /// Whether the family replaces the dense MLP with routed experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Architecture::Mixtral | Architecture::Qwen2Moe)
    }

    /// Whether the q, k and v projections carry biases (the Qwen2 families).
    pub fn has_qkv_bias(self) -> bool {
        matches!(self, Architecture::Qwen2 | Architecture::Qwen2Moe)
    }

    /// The architecture whose class name or `model_type` is `name`, if any.
    pub fn from_hf_name(name: &str) -> Option<Architecture> {
        Architecture::ALL
            .into_iter()
            .find(|architecture| architecture.class_name() == name || architecture.model_type() == name)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.class_name())
    }
}

/// The dtype a checkpoint is stored in (`torch_dtype` in transformers 4, `dtype` in 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigDtype {
    /// `float32`, also what transformers uses when the config names no dtype.
    F32,
    /// `bfloat16`.
    Bf16,
    /// `float16`.
    F16,
}

impl ConfigDtype {
    /// The dtype names accepted in `torch_dtype` / `dtype`.
    pub const NAMES: &'static [&'static str] = &["float32", "bfloat16", "float16"];

    /// The name Hugging Face writes for this dtype.
    pub fn hf_name(self) -> &'static str {
        match self {
            ConfigDtype::F32 => "float32",
            ConfigDtype::Bf16 => "bfloat16",
            ConfigDtype::F16 => "float16",
        }
    }

    /// Bytes per element.
    pub fn size_in_bytes(self) -> u64 {
        match self {
            ConfigDtype::F32 => 4,
            ConfigDtype::Bf16 | ConfigDtype::F16 => 2,
        }
    }

    fn from_hf_name(name: &str) -> Option<ConfigDtype> {
        match name {
            "float32" => Some(ConfigDtype::F32),
            "bfloat16" => Some(ConfigDtype::Bf16),
            "float16" => Some(ConfigDtype::F16),
            _ => None,
        }
    }
}

impl std::fmt::Display for ConfigDtype {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.hf_name())
    }
}

/// Rotary position embedding settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeConfig {
    /// The base period (`rope_theta`).
    pub theta: f64,
    /// How the frequencies are rescaled for long contexts.
    pub scaling: RopeScaling,
}

/// The RoPE frequency rescaling (`rope_type`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// `default`: the original RoPE frequencies.
    None,
    /// `llama3` (Llama 3.1 and later): low frequencies divided by `factor`, high ones kept, a smooth
    /// interpolation between.
    Llama3 {
        /// The divisor applied to low frequencies (8 for Llama 3.1).
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length of pretraining (8192 for Llama 3.1).
        original_max_position_embeddings: u64,
    },
}

impl RopeScaling {
    /// The `rope_type` values pleat computes.
    pub const SUPPORTED_TYPES: &'static [&'static str] = &["default", "llama3"];
}

/// The routed experts that replace the dense MLP of every layer of a mixture-of-experts model.
///
/// Routing is Hugging Face's, dropless (no capacity factor): each token's router logits go through a
/// softmax over all experts, the `top_k` largest probabilities pick its experts (ties to the lower
/// index), optionally renormalized to sum to one, and the token's output is the weighted sum of those
/// experts' gated SiLU MLPs.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts a layer (`num_local_experts` for Mixtral, `num_experts` for Qwen2-MoE).
    pub num_experts: u64,
    /// Experts a token is sent to (`num_experts_per_tok`).
    pub top_k: u64,
    /// Width of each expert's gated MLP (Mixtral's `intermediate_size`, Qwen2-MoE's
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: u64,
    /// Whether the top-k probabilities are renormalized to sum to one (always for Mixtral,
    /// `norm_topk_prob` for Qwen2-MoE).
    pub normalize_top_k: bool,
    /// Width of Qwen2-MoE's shared expert, a gated MLP every token goes through, scaled by
    /// `sigmoid(x · shared_expert_gate)`; `None` for Mixtral.
    pub shared_expert_intermediate_size: Option<u64>,
    /// The weight of the load-balancing loss in the training loss (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether training adds the load-balancing loss (`output_router_logits`; Hugging Face adds it
    /// only then).
    pub output_router_logits: bool,
}

/// A decoder-only Llama-family model, as read from a `config.json` or a preset.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The model family.
    pub architecture: Architecture,
    /// Rows of the embedding table (`vocab_size`).
    pub vocab_size: u64,
    /// Width of the residual stream (`hidden_size`).
    pub hidden_size: u64,
    /// Decoder layers (`num_hidden_layers`).
    pub num_layers: u64,
    /// Query heads (`num_attention_heads`).
    pub num_heads: u64,
    /// Key/value heads (`num_key_value_heads`); divides `num_heads`.
    pub num_kv_heads: u64,
    /// Channels per head; `hidden_size / num_heads` unless the config sets `head_dim`. Always even.
    pub head_dim: u64,
    /// Width of the gated MLP (`intermediate_size`).
    pub intermediate_size: u64,
    /// Epsilon of every RMSNorm (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// Rotary position embeddings.
    pub rope: RopeConfig,
    /// Whether `lm_head` reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// The dtype the checkpoint is stored in.
    pub dtype: ConfigDtype,
    /// Whether the q, k and v projections carry biases (always for Qwen2; the o projection never does).
    pub attention_bias: bool,
    /// The longest sequence the model was configured for.
    pub max_position_embeddings: u64,
    /// Mistral's (and Qwen2's, when `use_sliding_window` is set) attention window, in tokens; `None` for
    /// full causal attention. The builder decides whether a window wider than the sequence matters.
    pub sliding_window: Option<u64>,
    /// The routed experts of a mixture-of-experts model (Mixtral, Qwen2-MoE); `None` for a dense one.
    pub moe: Option<MoeConfig>,
    /// A display name: `_name_or_path` when the file has one, otherwise taken from the source name.
    pub name: String,
}

/// Why a configuration could not be read. Every variant names the file it came from.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum ConfigError {
    // === Syntax ===
    /// The text is not JSON.
    #[error("{file}:{line}:{column}: malformed json: {message}; fix the syntax at that position")]
    #[diagnostic(
        code(E0101),
        help("fix the JSON syntax at the line and column shown (a missing comma, quote or brace)")
    )]
    MalformedJson {
        /// The source name given by the caller.
        file: String,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// serde_json's description, without its position.
        message: String,
    },
    /// The JSON is not an object.
    #[error("{file}: the top level must be a json object {{...}}, found {found}")]
    #[diagnostic(code(E0102), help("config.json must hold one JSON object {{\"hidden_size\": ..., ...}}"))]
    NotAnObject {
        /// The source name given by the caller.
        file: String,
        /// The top-level value, abbreviated.
        found: String,
    },

    // === Fields ===
    /// A required field is absent.
    #[error("{file}: missing required field `{field}`; add it as Hugging Face's config.json spells it")]
    #[diagnostic(code(E0103), help("add the field with the value from the model's Hugging Face config.json"))]
    MissingField {
        /// The source name given by the caller.
        file: String,
        /// The field's path, e.g. `hidden_size` or `rope_scaling.factor`.
        field: String,
    },
    /// A field has the wrong JSON type.
    #[error("{file}: field `{field}` must be {expected}, found {found}")]
    #[diagnostic(code(E0104), help("give the field the JSON type named in the message"))]
    BadField {
        /// The source name given by the caller.
        file: String,
        /// The field's path.
        field: String,
        /// What the field must hold, e.g. `a non-negative integer`.
        expected: &'static str,
        /// The value found, abbreviated.
        found: String,
    },
    /// A field has the right type but an impossible value.
    #[error("{file}: field `{field}` = {value} is out of range; it must be {requirement}")]
    #[diagnostic(code(E0105), help("change the field to a value within the stated range"))]
    BadValue {
        /// The source name given by the caller.
        file: String,
        /// The field's path.
        field: String,
        /// The value found.
        value: String,
        /// The condition it breaks, e.g. `at least 1`.
        requirement: &'static str,
    },

    // === Support ===
    /// `architectures[0]` (or `model_type`) names a model pleat does not build.
    #[error("{file}: architecture `{architecture}` in `{field}` is not supported; use one of {}", supported.join(", "))]
    #[diagnostic(
        code(E0106),
        help("use a Llama-family config (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM)")
    )]
    UnknownArchitecture {
        /// The source name given by the caller.
        file: String,
        /// `architectures` or `model_type`.
        field: String,
        /// The name found.
        architecture: String,
        /// The supported names.
        supported: &'static [&'static str],
    },
    /// The RoPE scaling type is one pleat does not compute.
    #[error("{file}: rope type `{rope_type}` in `{field}` is not supported; pleat computes only {}", supported.join(", "))]
    #[diagnostic(code(E0107), help("drop rope_scaling or use a rope type pleat computes"))]
    UnsupportedRopeType {
        /// The source name given by the caller.
        file: String,
        /// `rope_scaling` or `rope_parameters`.
        field: String,
        /// The type found.
        rope_type: String,
        /// The supported types.
        supported: &'static [&'static str],
    },
    /// A valid Hugging Face setting that the Llama-style graph cannot express.
    #[error("{file}: `{field}` = {value} is not supported: {reason}")]
    #[diagnostic(code(E0108), help("use a config without this setting"))]
    Unsupported {
        /// The source name given by the caller.
        file: String,
        /// The field's path.
        field: String,
        /// The value found.
        value: String,
        /// What pleat supports instead.
        reason: &'static str,
    },

    // === Consistency ===
    /// Grouped-query attention needs whole groups.
    #[error("{file}: num_attention_heads = {num_heads} is not a multiple of num_key_value_heads = {num_kv_heads}; every key/value head must serve the same number of query heads")]
    #[diagnostic(code(E0109), help("make num_attention_heads a multiple of num_key_value_heads"))]
    HeadsNotDivisible {
        /// The source name given by the caller.
        file: String,
        /// `num_attention_heads`.
        num_heads: u64,
        /// `num_key_value_heads`.
        num_kv_heads: u64,
    },
    /// `head_dim` is absent and cannot be derived.
    #[error("{file}: hidden_size = {hidden_size} is not divisible by num_attention_heads = {num_heads}; set `head_dim` explicitly or fix the sizes")]
    #[diagnostic(code(E0110), help("set head_dim, or make hidden_size a multiple of num_attention_heads"))]
    HeadDimNotDerivable {
        /// The source name given by the caller.
        file: String,
        /// `hidden_size`.
        hidden_size: u64,
        /// `num_attention_heads`.
        num_heads: u64,
    },
    /// RoPE rotates channel pairs, so a head needs an even width.
    #[error(
        "{file}: head_dim = {head_dim} is odd; rotary embeddings rotate pairs of channels, so use an even head_dim"
    )]
    #[diagnostic(code(E0111), help("use an even head_dim (rotary embeddings rotate channel pairs)"))]
    OddHeadDim {
        /// The source name given by the caller.
        file: String,
        /// The (given or derived) head width.
        head_dim: u64,
    },
    /// The sizes multiply past what a `u64` can count.
    #[error("{file}: the model would have more than 2^64 parameters; check the sizes")]
    #[diagnostic(code(E0112), help("check the sizes in config.json for a typo"))]
    TooManyParameters {
        /// The source name given by the caller.
        file: String,
    },

    // === Presets ===
    /// No preset has that name.
    #[error("unknown preset `{name}`; use one of {} or a path to a config.json", known.join(", "))]
    #[diagnostic(code(E0113), help("give a preset name from the list, or a path to a config.json"))]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The preset names.
        known: &'static [&'static str],
    },
}

impl ModelConfig {
    /// This configuration as a transformers-4 style `config.json` that `from_json_str` reads back to
    /// an equal `ModelConfig`.
    pub fn to_hf_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_hf_value()).expect("a JSON value always prints")
    }

    /// [`Self::to_hf_json`]'s object, field by field.
    pub fn to_hf_value(&self) -> serde_json::Value {
        let rope_scaling = match &self.rope.scaling {
            RopeScaling::None => serde_json::Value::Null,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                })
            }
        };
        let mut object = serde_json::json!({
            "_name_or_path": self.name,
            "architectures": [self.architecture.class_name()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype.hf_name(),
            "max_position_embeddings": self.max_position_embeddings,
        });
        if !self.architecture.has_qkv_bias() {
            object["attention_bias"] = serde_json::Value::Bool(self.attention_bias);
        }
        if self.architecture != Architecture::Llama {
            object["sliding_window"] = self.sliding_window.map_or(serde_json::Value::Null, serde_json::Value::from);
        }
        if let Some(moe) = &self.moe {
            object["num_experts_per_tok"] = moe.top_k.into();
            object["router_aux_loss_coef"] = moe.router_aux_loss_coef.into();
            object["output_router_logits"] = moe.output_router_logits.into();
            match self.architecture {
                Architecture::Qwen2Moe => {
                    object["num_experts"] = moe.num_experts.into();
                    object["moe_intermediate_size"] = moe.expert_intermediate_size.into();
                    object["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size.unwrap_or(0).into();
                    object["norm_topk_prob"] = moe.normalize_top_k.into();
                    object["decoder_sparse_step"] = 1.into();
                    object["mlp_only_layers"] = serde_json::json!([]);
                }
                _ => {
                    object["num_local_experts"] = moe.num_experts.into();
                    object["intermediate_size"] = moe.expert_intermediate_size.into();
                }
            }
        }
        object
    }

    /// Reads a Hugging Face `config.json`; `source` names the file in error messages.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let config = json::read_config(text, source)?;
        config.validate(source)?;
        Ok(config)
    }

    /// The exact number of parameters: embedding; per layer q, k, v, o (plus q/k/v biases when
    /// `attention_bias`), the MLP (gate, up, down; or for a mixture of experts the router, every
    /// expert's gate, up and down, and the shared expert with its gate) and two norms; the final norm;
    /// `lm_head` unless tied. Saturates at `u64::MAX`, which no parsed config reaches.
    pub fn param_count(&self) -> u64 {
        self.checked_param_count(self.moe.as_ref().map_or(0, |moe| moe.num_experts)).unwrap_or(u64::MAX)
    }

    /// The parameters one token's forward pass reads: [`ModelConfig::param_count`] with only `top_k`
    /// routed experts a layer (what Mixtral's "12.9B active" counts). Equal to the total for a dense
    /// model.
    pub fn active_param_count(&self) -> u64 {
        self.checked_param_count(self.moe.as_ref().map_or(0, |moe| moe.top_k)).unwrap_or(u64::MAX)
    }

    /// The parameters of one layer's MLP block with `experts` routed experts counted (the router and
    /// the shared expert always count), or `None` past `u64`.
    fn checked_mlp_params(&self, experts: u64) -> Option<u64> {
        let hidden = self.hidden_size;
        let Some(moe) = &self.moe else {
            return hidden.checked_mul(self.intermediate_size)?.checked_mul(3);
        };
        let router = moe.num_experts.checked_mul(hidden)?;
        let routed = experts.checked_mul(hidden)?.checked_mul(moe.expert_intermediate_size)?.checked_mul(3)?;
        let shared = match moe.shared_expert_intermediate_size {
            Some(width) => hidden.checked_mul(width)?.checked_mul(3)?.checked_add(hidden)?,
            None => 0,
        };
        router.checked_add(routed)?.checked_add(shared)
    }

    /// [`ModelConfig::param_count`] with `experts` routed experts a layer, or `None` when it does not
    /// fit in a `u64`.
    fn checked_param_count(&self, experts: u64) -> Option<u64> {
        let hidden = self.hidden_size;
        let query_width = self.num_heads.checked_mul(self.head_dim)?;
        let key_value_width = self.num_kv_heads.checked_mul(self.head_dim)?;
        let attention_weights = hidden.checked_mul(query_width.checked_add(key_value_width)?)?.checked_mul(2)?;
        let attention_biases = match self.attention_bias {
            true => query_width.checked_add(key_value_width.checked_mul(2)?)?,
            false => 0,
        };
        let mlp = self.checked_mlp_params(experts)?;
        let norms = hidden.checked_mul(2)?;
        let per_layer = attention_weights.checked_add(attention_biases)?.checked_add(mlp)?.checked_add(norms)?;
        let embedding = self.vocab_size.checked_mul(hidden)?;
        let lm_head = if self.tie_word_embeddings { 0 } else { embedding };
        embedding.checked_add(self.num_layers.checked_mul(per_layer)?)?.checked_add(hidden)?.checked_add(lm_head)
    }

    /// The most decoder layers a config may have.
    pub const MAX_LAYERS: u64 = 1 << 16;

    /// Checks the invariants the module promises, naming `source` in errors.
    fn validate(&self, source: &str) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, size) in sizes {
            if size == 0 {
                return Err(bad_value(source, field, "0", "at least 1"));
            }
        }
        // (Far above any model trained, below a graph that exhausts memory as it is built: 10^12
        // layers of a tiny width were killed for it.)
        if self.num_layers > Self::MAX_LAYERS {
            let value = self.num_layers.to_string();
            return Err(bad_value(source, "num_hidden_layers", &value, "at most 65536 (2^16)"));
        }
        if self.sliding_window == Some(0) {
            return Err(bad_value(source, "sliding_window", "0", "at least 1, or null for full attention"));
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(ConfigError::HeadsNotDivisible {
                file: source.to_owned(),
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads,
            });
        }
        if self.head_dim % 2 != 0 {
            return Err(ConfigError::OddHeadDim { file: source.to_owned(), head_dim: self.head_dim });
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            let value = self.rms_norm_eps.to_string();
            return Err(bad_value(source, "rms_norm_eps", &value, "a finite number >= 0"));
        }
        if let Some(moe) = &self.moe {
            self.validate_moe(moe, source)?;
        }
        let experts = self.moe.as_ref().map_or(0, |moe| moe.num_experts);
        if self.checked_param_count(experts).is_none() {
            return Err(ConfigError::TooManyParameters { file: source.to_owned() });
        }
        Ok(())
    }
}

impl ModelConfig {
    fn validate_moe(&self, moe: &MoeConfig, source: &str) -> Result<()> {
        let (experts_field, width_field) = match self.architecture {
            Architecture::Qwen2Moe => ("num_experts", "moe_intermediate_size"),
            _ => ("num_local_experts", "intermediate_size"),
        };
        for (field, size) in [(experts_field, moe.num_experts), (width_field, moe.expert_intermediate_size)] {
            if size == 0 {
                return Err(bad_value(source, field, "0", "at least 1"));
            }
        }
        if moe.top_k == 0 || moe.top_k > moe.num_experts {
            let value = moe.top_k.to_string();
            return Err(bad_value(
                source,
                "num_experts_per_tok",
                &value,
                "at least 1 and at most the number of experts",
            ));
        }
        if moe.shared_expert_intermediate_size == Some(0) {
            return Err(bad_value(source, "shared_expert_intermediate_size", "0", "at least 1"));
        }
        if !(moe.router_aux_loss_coef.is_finite() && moe.router_aux_loss_coef >= 0.0) {
            let value = moe.router_aux_loss_coef.to_string();
            return Err(bad_value(source, "router_aux_loss_coef", &value, "a finite number >= 0"));
        }
        Ok(())
    }
}

fn bad_value(file: &str, field: &str, value: &str, requirement: &'static str) -> ConfigError {
    ConfigError::BadValue { file: file.to_owned(), field: field.to_owned(), value: value.to_owned(), requirement }
}

#[path = "config_json.rs"]
mod json;

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "config_props.rs"]
mod props;
