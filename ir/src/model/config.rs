//! TEMPORARY: replaced by the model-config work on merge.
/// Rotary embedding settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeConfig {
    /// Base.
    pub theta: f64,
    /// Scaling.
    pub scaling: RopeScaling,
}
/// Scaling.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// None.
    None,
    /// Llama 3.1.
    Llama3 {
        /// f.
        factor: f64,
        /// l.
        low_freq_factor: f64,
        /// h.
        high_freq_factor: f64,
        /// o.
        original_max_position_embeddings: u64,
    },
}
/// Arch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// L.
    Llama,
    /// M.
    Mistral,
    /// Q.
    Qwen2,
}
/// Dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigDtype {
    /// F32.
    F32,
    /// Bf16.
    Bf16,
    /// F16.
    F16,
}
/// Config.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub intermediate_size: u64,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    pub dtype: ConfigDtype,
    pub attention_bias: bool,
    pub max_position_embeddings: u64,
    pub sliding_window: Option<u64>,
    pub name: String,
}
