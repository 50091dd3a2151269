//! Transformer models: configurations (Hugging Face `config.json`, presets) and the graph builder.

pub mod builder;
pub mod config;

pub use builder::build;
