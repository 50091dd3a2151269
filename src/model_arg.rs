//! Resolves the MODEL argument: a preset name, a `config.json` (or a directory holding one, with
//! its weights), or a directory written by `pleat compile`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pleat_ir::model::config::ModelConfig;
use pleat_ir::model::preset::{preset, PRESET_NAMES};

use crate::usage::UsageError;

/// What MODEL named.
pub enum ModelSource {
    /// A model configuration, with the weights found beside it, if any.
    Config { config: Box<ModelConfig>, weights: Option<PathBuf> },
    /// A compiled directory.
    Compiled(PathBuf),
}

/// The weights in a model directory: a pleat training checkpoint (the directory itself), or a
/// Hugging Face `model.safetensors` or its sharded index.
fn weights_beside(dir: &Path) -> Option<PathBuf> {
    if crate::checkpoint::is_checkpoint(dir) {
        return Some(dir.to_path_buf());
    }
    ["model.safetensors", "model.safetensors.index.json"].iter().map(|name| dir.join(name)).find(|path| path.exists())
}

/// Reads a `config.json`.
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    let text = crate::text_file::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(ModelConfig::from_json_str(&text, &path.display().to_string())?)
}

/// Resolves MODEL.
pub fn resolve(model: &str) -> Result<ModelSource> {
    let path = Path::new(model);
    if !PRESET_NAMES.contains(&model) {
        // A checkpoint or compiled directory a killed write left aside is put back first.
        crate::checkpoint::recover(path)?;
    }
    if path.is_dir() {
        if path.join("plan.json").exists() {
            return Ok(ModelSource::Compiled(path.to_path_buf()));
        }
        // A checkpoint without its index would run on seeded weights.
        if path.join("rank0.safetensors").is_file() && !crate::checkpoint::is_checkpoint(path) {
            bail!(UsageError::CheckpointWithoutIndex { dir: path.to_path_buf() });
        }
        if path.join("config.json").exists() {
            let config = read_config(&path.join("config.json"))?;
            return Ok(ModelSource::Config { config: Box::new(config), weights: weights_beside(path) });
        }
        bail!(UsageError::DirectoryNotAModel { model: model.to_string(), presets: PRESET_NAMES.join(", ") });
    }
    if path.is_file() {
        let config = read_config(path)?;
        return Ok(ModelSource::Config { config: Box::new(config), weights: None });
    }
    if PRESET_NAMES.contains(&model) {
        return Ok(ModelSource::Config { config: Box::new(preset(model)?), weights: None });
    }
    bail!(UsageError::UnknownModel { model: model.to_string(), presets: PRESET_NAMES.join(", ") })
}
