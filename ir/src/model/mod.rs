//! Transformer models: configurations (Hugging Face `config.json`, presets), RoPE frequencies, the
//! graph builder, and the synthetic token stream training uses without data.

pub mod builder;
pub mod config;
pub mod preset;
pub mod rope;
pub mod stream;

pub use builder::{build, build_training};
