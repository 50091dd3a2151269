//! Transformer models: configurations (Hugging Face `config.json`, presets), RoPE frequencies and
//! the graph builder.

pub mod builder;
pub mod config;
pub mod preset;
pub mod rope;

pub use builder::{build, build_training};
