//! Training checkpoints: the whole model and optimizer state, independent of the mesh.
//!
//! A checkpoint directory holds `config.json` and `model.safetensors` (so it is also a model
//! directory that `pleat run` and `--weights` read), `optimizer.safetensors` with each parameter's
//! two AdamW moments (`<name>.exp_avg`, `<name>.exp_avg_sq`, in the parameter's shape) and
//! `trainer.json` with the steps taken. Tensors are assembled from the ranks' blocks, so a run may
//! resume on another mesh or ZeRO stage: each rank reads back only its blocks. The directory is
//! written to a staging sibling and renamed into place, so a crash leaves the old checkpoint or
//! the new one, never a mix.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pleat_ir::model::config::ModelConfig;
use pleat_runtime::train::RankTraining;
use pleat_runtime::weights::{write_safetensors, SafetensorsWeights};
use pleat_runtime::OutputBlock;
use serde::{Deserialize, Serialize};

/// The version of `trainer.json` this build writes and reads.
const TRAINER_FORMAT_VERSION: u32 = 1;

/// `trainer.json`.
#[derive(Serialize, Deserialize)]
struct TrainerState {
    format_version: u32,
    model: String,
    /// Optimizer steps taken so far.
    steps: u32,
}

/// A checkpoint read back: where training resumes.
pub struct Resume {
    pub steps: u32,
    pub weights: SafetensorsWeights,
    pub moments: SafetensorsWeights,
}

/// Writes `dir` atomically: `fill` writes into a staging sibling, which then replaces `dir`.
pub fn write_dir_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = dir.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let name = dir.file_name().map(|name| name.to_string_lossy().to_string()).unwrap_or_else(|| "out".into());
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    fill(&staging)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot replace {}", dir.display()))?;
    }
    std::fs::rename(&staging, dir).with_context(|| format!("cannot move the output into {}", dir.display()))
}

/// Writes the checkpoint of a run that has taken `steps` steps in all.
pub fn write(dir: &Path, config: &ModelConfig, steps: u32, ranks: &[RankTraining]) -> Result<()> {
    let mut params: BTreeMap<&str, Vec<&OutputBlock>> = BTreeMap::new();
    let mut moments: BTreeMap<String, Vec<&OutputBlock>> = BTreeMap::new();
    for rank in ranks {
        for (name, block) in &rank.params {
            params.entry(name).or_default().push(block);
        }
        for (name, exp_avg, exp_avg_sq) in &rank.moments {
            moments.entry(format!("{name}.exp_avg")).or_default().push(exp_avg);
            moments.entry(format!("{name}.exp_avg_sq")).or_default().push(exp_avg_sq);
        }
    }
    let assemble = |name: &str, blocks: &[&OutputBlock]| {
        let (shape, data) = pleat_runtime::launch::assemble_blocks(blocks).context("a tensor without blocks")?;
        anyhow::Ok((name.to_string(), shape, data))
    };
    let params = params.iter().map(|(name, blocks)| assemble(name, blocks)).collect::<Result<Vec<_>>>()?;
    let moments = moments.iter().map(|(name, blocks)| assemble(name, blocks)).collect::<Result<Vec<_>>>()?;
    let state = TrainerState { format_version: TRAINER_FORMAT_VERSION, model: config.name.clone(), steps };
    write_dir_atomically(dir, |staging| {
        std::fs::write(staging.join("config.json"), config.to_hf_json())?;
        write_safetensors(staging.join("model.safetensors"), &params)?;
        write_safetensors(staging.join("optimizer.safetensors"), &moments)?;
        std::fs::write(staging.join("trainer.json"), serde_json::to_string_pretty(&state)?)?;
        Ok(())
    })
    .with_context(|| format!("cannot write the checkpoint {}", dir.display()))
}

/// Reads the checkpoint in `dir` for `config`.
pub fn read(dir: &Path, config: &ModelConfig) -> Result<Resume> {
    let path: PathBuf = dir.join("trainer.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}; --resume takes a directory that --save wrote", path.display()))?;
    let state: TrainerState =
        serde_json::from_str(&text).with_context(|| format!("{} is not a pleat trainer state", path.display()))?;
    if state.format_version != TRAINER_FORMAT_VERSION {
        bail!(
            "{}: trainer format {} is not {TRAINER_FORMAT_VERSION}; this pleat cannot resume it",
            path.display(),
            state.format_version
        );
    }
    if state.model != config.name {
        bail!(
            "{} holds a checkpoint of {}, not of {}; resume with that model",
            dir.display(),
            state.model,
            config.name
        );
    }
    let open = |file: &str| {
        let path = dir.join(file);
        SafetensorsWeights::open(&path).with_context(|| format!("cannot open {}", path.display()))
    };
    Ok(Resume { steps: state.steps, weights: open("model.safetensors")?, moments: open("optimizer.safetensors")? })
}
