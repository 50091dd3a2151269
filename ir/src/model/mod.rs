//! Decoder-only transformer models: configurations read from Hugging Face `config.json`, presets and RoPE.

pub mod config;
pub mod preset;
pub mod rope;
