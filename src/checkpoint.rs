//! Training checkpoints, sharded as the ranks hold them, and the atomic writes every artifact uses.
//!
//! A checkpoint directory (format 2) holds:
//!
//! - `rank<i>.safetensors`: the blocks rank `i` holds of the parameters and of their AdamW moments
//!   (`<name>.exp_avg`, `<name>.exp_avg_sq`, blocks of the parameter's shape). A block replicated on
//!   several ranks (dp without ZeRO) is written once, by the lowest rank holding it; a rank left
//!   with no block of its own writes no file. Each block is stored under the key
//!   `<tensor>@<start>,<start>,...` in the block's own shape.
//! - `index.json`: `format_version`, the `model`'s name, the `steps` taken, and for each global
//!   tensor its `shape` and `blocks`, each `{file, key, offsets, shape}`: which file holds which
//!   region. Its `content_hash` is an FNV-1a hash (the plan hash's, `crate::fingerprint`) over
//!   `config.json`, every block file and the index itself without the hash; reading checks it, so a
//!   changed file is an error, never a wrong run.
//! - `config.json`: the model, so the directory is also a model directory `pleat run` reads.
//!
//! Any region of any tensor is assembled from the blocks it spans ([`BlockWeights`]), so a run may
//! resume on another mesh or ZeRO stage, and inference reads the parameters. Format 1 (whole
//! tensors in `model.safetensors` and `optimizer.safetensors`) is not read: save it again.
//!
//! Every directory or file pleat writes goes to a staging sibling first and is renamed into place
//! ([`write_dir_atomically`], [`write_atomically_with`]): a process killed at any moment leaves the
//! old artifact or the new one (a directory: or none, briefly, with the old one kept aside and put
//! back by the next write or read), never a torn one. Staging siblings of killed processes are
//! removed by the next write.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pleat_ir::model::config::ModelConfig;
use pleat_runtime::train::RankTraining;
use pleat_runtime::weights::{write_safetensors, BlockWeights, SafetensorsWeights, WeightSource};
use serde::{Deserialize, Serialize};

use crate::fingerprint::Fingerprint;
use crate::usage::UsageError;

/// The version of the checkpoint format this build writes and reads.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 2;

/// The name of a checkpoint's index inside its directory.
pub const INDEX_FILE: &str = "index.json";

/// `index.json`.
#[derive(Serialize, Deserialize, Clone)]
struct Index {
    format_version: u32,
    model: String,
    /// Optimizer steps taken so far.
    steps: u32,
    /// Tokens the steps took from the token stream (`--data`), so that a run resumed at another
    /// batch or sequence length continues where this one stopped; absent in older checkpoints
    /// (then steps times the resumed run's batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens_seen: Option<u64>,
    /// FNV-1a over `config.json`, the block files and this index with this field empty.
    content_hash: String,
    tensors: BTreeMap<String, IndexedTensor>,
}

/// A global tensor in `index.json`.
#[derive(Serialize, Deserialize, Clone)]
struct IndexedTensor {
    shape: Vec<u64>,
    blocks: Vec<IndexedBlock>,
}

/// Where one block of a tensor is stored.
#[derive(Serialize, Deserialize, Clone)]
struct IndexedBlock {
    /// The file, in the checkpoint directory.
    file: String,
    /// The block's tensor name in that file.
    key: String,
    /// The block's first element, per dim.
    offsets: Vec<u64>,
    /// The block's shape.
    shape: Vec<u64>,
}

/// A tensor to write: its key, shape and elements.
type NamedTensor = (String, Vec<u64>, Vec<f32>);

/// A checkpoint read back: where training resumes.
pub struct Resume {
    /// Steps taken before the checkpoint.
    pub steps: u32,
    /// Tokens those steps took from the stream, where the checkpoint says.
    pub tokens_seen: Option<u64>,
    /// The parameters and their moments (`<name>.exp_avg`, `<name>.exp_avg_sq`).
    pub state: BlockWeights,
}

/// Whether `path` is a checkpoint directory this module writes (it holds `index.json`).
pub fn is_checkpoint(path: &Path) -> bool {
    path.join(INDEX_FILE).is_file()
}

/// Writes the checkpoint of a run that has taken `steps` steps in all, `tokens_seen` tokens of its
/// stream, from its ranks' final state.
pub fn write(dir: &Path, config: &ModelConfig, (steps, tokens_seen): (u32, u64), ranks: &[RankTraining]) -> Result<()> {
    let mut order: Vec<&RankTraining> = ranks.iter().collect();
    order.sort_by_key(|training| training.rank);
    // Each rank's blocks, keyed in its file; the index of where they went.
    let mut files: BTreeMap<u32, Vec<NamedTensor>> = BTreeMap::new();
    let mut tensors: BTreeMap<String, IndexedTensor> = BTreeMap::new();
    for training in order {
        let moments = training.moments.iter().flat_map(|(name, exp_avg, exp_avg_sq)| {
            [(format!("{name}.exp_avg"), exp_avg), (format!("{name}.exp_avg_sq"), exp_avg_sq)]
        });
        let params = training.params.iter().map(|(name, block)| (name.clone(), block));
        for (name, block) in params.chain(moments) {
            if block.data.is_empty() {
                continue;
            }
            let offsets: Vec<u64> = block.region.iter().map(|&(start, _)| start).collect();
            let shape: Vec<u64> = block.region.iter().map(|&(_, len)| len).collect();
            let starts: Vec<String> = offsets.iter().map(u64::to_string).collect();
            let key = format!("{name}@{}", starts.join(","));
            let file = format!("rank{}.safetensors", training.rank);
            let tensor =
                tensors.entry(name).or_insert_with(|| IndexedTensor { shape: block.shape.clone(), blocks: Vec::new() });
            // A replica of a block a lower rank holds.
            if tensor.blocks.iter().any(|held| held.offsets == offsets && held.shape == shape) {
                continue;
            }
            tensor.blocks.push(IndexedBlock { file, key: key.clone(), offsets, shape: shape.clone() });
            files.entry(training.rank).or_default().push((key, shape, block.data.clone()));
        }
    }
    let mut index = Index {
        format_version: CHECKPOINT_FORMAT_VERSION,
        model: config.name.clone(),
        steps,
        tokens_seen: Some(tokens_seen),
        content_hash: String::new(),
        tensors,
    };
    write_dir_atomically(dir, INDEX_FILE, |staging| {
        std::fs::write(staging.join("config.json"), config.to_hf_json())?;
        for (rank, blocks) in &files {
            write_safetensors(staging.join(format!("rank{rank}.safetensors")), blocks)?;
        }
        index.content_hash = content_hash(staging, &index)?;
        std::fs::write(staging.join(INDEX_FILE), serde_json::to_string_pretty(&index)?)?;
        Ok(())
    })
    .with_context(|| format!("cannot write the checkpoint {}", dir.display()))
}

/// The hash `index.json` records: over `config.json`, each block file (by name, in order) and the
/// index with an empty `content_hash`.
fn content_hash(dir: &Path, index: &Index) -> Result<String> {
    let mut hash = Fingerprint::new();
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))
    };
    hash.part(&read("config.json")?);
    let files: std::collections::BTreeSet<&str> =
        index.tensors.values().flat_map(|tensor| &tensor.blocks).map(|block| block.file.as_str()).collect();
    for file in files {
        hash.part(file.as_bytes()).part(&read(file)?);
    }
    let mut unhashed = index.clone();
    unhashed.content_hash.clear();
    hash.part(serde_json::to_string(&unhashed)?.as_bytes());
    Ok(hash.hex())
}

/// Reads and verifies the checkpoint in `dir`: its format version and content hash.
fn read_index(dir: &Path) -> Result<Index> {
    recover(dir)?;
    let path: PathBuf = dir.join(INDEX_FILE);
    let text = crate::text_file::read_text(&path)
        .with_context(|| format!("cannot read {}; --resume takes a directory that --save wrote", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|error| UsageError::NotACheckpoint { path: path.clone(), reason: error.to_string() })?;
    let version = value.get("format_version").and_then(serde_json::Value::as_u64);
    if version != Some(u64::from(CHECKPOINT_FORMAT_VERSION)) {
        bail!(UsageError::CheckpointFormatVersion {
            path,
            found: version.map_or_else(|| "(none)".to_string(), |version| version.to_string()),
            expected: CHECKPOINT_FORMAT_VERSION,
        });
    }
    let index: Index = serde_json::from_value(value)
        .map_err(|error| UsageError::NotACheckpoint { path, reason: error.to_string() })?;
    let hash = content_hash(dir, &index)?;
    if hash != index.content_hash {
        bail!(UsageError::CheckpointHashMismatch {
            dir: dir.to_path_buf(),
            actual: hash,
            recorded: index.content_hash,
        });
    }
    Ok(index)
}

/// Reads every block of the checkpoint in `dir` (verified) into memory.
fn read_blocks(dir: &Path, index: &Index) -> Result<BlockWeights> {
    let mut opened: BTreeMap<&str, SafetensorsWeights> = BTreeMap::new();
    let mut state = BlockWeights::new(dir.join(INDEX_FILE));
    for (name, tensor) in &index.tensors {
        for block in &tensor.blocks {
            if !opened.contains_key(block.file.as_str()) {
                let path = dir.join(&block.file);
                let file =
                    SafetensorsWeights::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
                opened.insert(&block.file, file);
            }
            let whole: Vec<(u64, u64)> = block.shape.iter().map(|&len| (0, len)).collect();
            let data = opened[block.file.as_str()].read(&block.key, &block.shape, &whole)?;
            let region: Vec<(u64, u64)> = block.offsets.iter().copied().zip(block.shape.iter().copied()).collect();
            state.insert(name, &tensor.shape, &region, data)?;
        }
    }
    Ok(state)
}

/// Reads the checkpoint in `dir` for `config`: one saved from a model of the same configuration,
/// whatever its name (its `config.json` is compared, not the name, which a copied config changes
/// and an edited one keeps).
pub fn read(dir: &Path, config: &ModelConfig) -> Result<Resume> {
    let index = read_index(dir)?;
    let path = dir.join("config.json");
    let text = crate::text_file::read_text(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let saved = ModelConfig::from_json_str(&text, &path.display().to_string())?;
    let differences = config_differences(&saved, config);
    if !differences.is_empty() {
        bail!(UsageError::CheckpointOfAnotherModel {
            dir: dir.to_path_buf(),
            saved: index.model,
            model: config.name.clone(),
            differences: differences.join(", "),
        });
    }
    Ok(Resume { steps: index.steps, tokens_seen: index.tokens_seen, state: read_blocks(dir, &index)? })
}

/// The `config.json` fields in which `saved` and `config` differ, each as `field saved -> config`:
/// their names aside, and their `torch_dtype` (a precision the run chooses with `--precision`,
/// which a compiled directory's config records; the weights are converted as they load).
fn config_differences(saved: &ModelConfig, config: &ModelConfig) -> Vec<String> {
    let fields = |config: &ModelConfig| -> BTreeMap<String, serde_json::Value> {
        let json = config.to_hf_value();
        json.as_object().into_iter().flatten().map(|(key, value)| (key.clone(), value.clone())).collect()
    };
    let (saved, config) = (fields(saved), fields(config));
    let keys: std::collections::BTreeSet<&String> = saved.keys().chain(config.keys()).collect();
    let absent = serde_json::Value::Null;
    keys.into_iter()
        .filter(|key| !matches!(key.as_str(), "_name_or_path" | "torch_dtype"))
        .filter_map(|key| {
            let (before, after) = (saved.get(key).unwrap_or(&absent), config.get(key).unwrap_or(&absent));
            (before != after).then(|| format!("{key} {before} -> {after}"))
        })
        .collect()
}

/// The parameters of the checkpoint in `dir` (verified), as a weight source for any mesh.
pub fn read_weights(dir: &Path) -> Result<BlockWeights> {
    let index = read_index(dir)?;
    read_blocks(dir, &index)
}

/// `path`'s parent (`.` for a bare name) and file name.
fn parent_and_name(path: &Path) -> Result<(PathBuf, String)> {
    let parent = path.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Some(name) = path.file_name() else {
        bail!(UsageError::PathWithoutName { path: path.to_path_buf() });
    };
    Ok((parent.to_path_buf(), name.to_string_lossy().to_string()))
}

/// The siblings of `parent/name` that a process (by id) left with `tag`: `.name.<tag>-<pid>`.
fn tagged_siblings(parent: &Path, name: &str, tag: &str) -> Vec<(PathBuf, u32)> {
    let prefix = format!(".{name}.{tag}-");
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let pid = entry.file_name().to_str()?.strip_prefix(&prefix)?.parse().ok()?;
            Some((entry.path(), pid))
        })
        .collect()
}

/// Whether the process `pid` has certainly ended (it is not this one and, where `/proc` lists
/// processes, is not listed); elsewhere nothing is known to have ended.
fn has_ended(pid: u32) -> bool {
    let proc = Path::new("/proc");
    pid != std::process::id() && proc.join("self").exists() && !proc.join(pid.to_string()).exists()
}

/// Puts back a directory that a write killed between its two renames left aside, and removes the
/// staging siblings of writers that have ended. Every read of a pleat output calls it.
pub fn recover(dir: &Path) -> Result<()> {
    let (parent, name) = parent_and_name(dir)?;
    for (staging, pid) in tagged_siblings(&parent, &name, "tmp") {
        if has_ended(pid) {
            // Best effort: a leftover staging sibling only costs disk space.
            let _ = std::fs::remove_dir_all(&staging).or_else(|_| std::fs::remove_file(&staging));
        }
    }
    for (aside, pid) in tagged_siblings(&parent, &name, "old") {
        if !has_ended(pid) {
            continue;
        }
        if dir.exists() {
            let _ = std::fs::remove_dir_all(&aside);
        } else {
            std::fs::rename(&aside, dir).with_context(|| format!("cannot put back {}", dir.display()))?;
        }
    }
    Ok(())
}

/// Writes `dir` atomically: `fill` writes into a staging sibling, which then replaces `dir`.
/// `marker` is the file `fill` writes that says what pleat output `dir` is (`plan.json`,
/// `index.json`): an existing `dir` is replaced only if it is empty or holds that file, so that
/// a mistyped `--out` never deletes a directory pleat did not write.
pub fn write_dir_atomically(dir: &Path, marker: &str, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let (parent, name) = parent_and_name(dir)?;
    std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
    recover(dir)?;
    refuse_to_replace_foreign(dir, marker)?;
    let pid = std::process::id();
    let staging = parent.join(format!(".{name}.tmp-{pid}"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    if let Err(error) = fill(&staging) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(error);
    }
    // A directory cannot be renamed over a full one: move the old one aside first, and remove it
    // only once the new one is in place (`recover` puts it back if this process dies in between).
    let aside = parent.join(format!(".{name}.old-{pid}"));
    let replaced = dir.exists();
    if replaced {
        std::fs::rename(dir, &aside).with_context(|| format!("cannot replace {}", dir.display()))?;
    }
    std::fs::rename(&staging, dir).with_context(|| format!("cannot move the output into {}", dir.display()))?;
    if replaced {
        std::fs::remove_dir_all(&aside).with_context(|| format!("cannot remove {}", aside.display()))?;
    }
    Ok(())
}

/// Checks, before the work whose output it is, that [`write_dir_atomically`] could write `dir`
/// with `marker`: its nearest existing ancestor is a directory, and `dir` is absent, empty or
/// pleat's. (A long training run used to find out only at its first save.)
pub fn check_output_dir(dir: &Path, marker: &str, flag: &'static str) -> Result<()> {
    let (parent, _) = parent_and_name(dir)?;
    check_creatable(dir, &parent, flag)?;
    refuse_to_replace_foreign(dir, marker)
}

/// Checks, before the work, that `dir` is a directory or can be made one (files are written
/// into it, beside any already there).
pub fn check_output_files_dir(dir: &Path, flag: &'static str) -> Result<()> {
    check_creatable(dir, dir, flag)
}

/// Checks that the nearest existing one of `within` and its ancestors is a directory, so that
/// `output` under it can be created.
fn check_creatable(output: &Path, within: &Path, flag: &'static str) -> Result<()> {
    if let Some(ancestor) = within.ancestors().find(|ancestor| ancestor.exists()) {
        if !ancestor.is_dir() {
            let problem = format!("{} is not a directory", ancestor.display());
            bail!(UsageError::OutputPath { path: output.to_path_buf(), flag, problem });
        }
    }
    Ok(())
}

/// Checks, before the work whose output it is, that a file could be written at `path`: it is
/// not a directory, and its directory exists and takes a new file (the temporary sibling the
/// output is written through, created and removed here).
pub fn check_output_file(path: &Path, flag: &'static str) -> Result<()> {
    // A device or a pipe (`/dev/stdout`) is written in place, as `write_file_atomically` does.
    if std::fs::metadata(path).is_ok_and(|metadata| !metadata.is_file() && !metadata.is_dir()) {
        return Ok(());
    }
    let problem = if path.is_dir() {
        "it is a directory; give a file's path".to_string()
    } else {
        let (parent, name) = parent_and_name(path)?;
        if !parent.is_dir() {
            format!("its directory {} does not exist", parent.display())
        } else {
            let probe = parent.join(format!(".{name}.probe-{}", std::process::id()));
            match std::fs::File::create(&probe) {
                Ok(_) => {
                    let _ = std::fs::remove_file(&probe);
                    return Ok(());
                }
                Err(error) => format!("pleat cannot create a file in {}: {error}", parent.display()),
            }
        }
    };
    bail!(UsageError::OutputPath { path: path.to_path_buf(), flag, problem })
}

/// Refuses to replace `dir` unless it is absent, an empty directory, or one holding `marker`.
fn refuse_to_replace_foreign(dir: &Path, marker: &str) -> Result<()> {
    let metadata = match std::fs::symlink_metadata(dir) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error).with_context(|| format!("cannot read {}", dir.display())),
    };
    let what = if !metadata.is_dir() {
        "is not a directory".to_string()
    } else if dir.join(marker).is_file() {
        return Ok(());
    } else if std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?.next().is_some() {
        format!("holds files but no {marker}, so pleat did not write it")
    } else {
        return Ok(());
    };
    bail!(UsageError::OutputOccupied { path: dir.to_path_buf(), what })
}

/// [`write_atomically_with`] of `bytes`.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with(path, |writer| writer.write_all(bytes))
}

/// Writes the file `path` atomically: what `write` writes goes to a staging sibling, which is
/// renamed over it. It is streamed through a buffer, never held whole (a trace of hundreds of
/// ranks is gigabytes of text). A path that is not a regular file (a link such as `/dev/stdout`,
/// a pipe, a device) is written through instead: renaming over it would replace the link or node
/// itself.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
) -> Result<()> {
    if let Ok(metadata) = std::fs::symlink_metadata(path) {
        if !metadata.is_file() && !metadata.is_dir() {
            return stream_to(path, write).with_context(|| format!("cannot write {}", path.display()));
        }
    }
    let (parent, name) = parent_and_name(path)?;
    for (staging, pid) in tagged_siblings(&parent, &name, "tmp") {
        if has_ended(pid) {
            let _ = std::fs::remove_file(staging);
        }
    }
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if let Err(error) = stream_to(&staging, write) {
        let _ = std::fs::remove_file(&staging);
        return Err(error).with_context(|| {
            format!("cannot write {} (through the temporary file {})", path.display(), staging.display())
        });
    }
    std::fs::rename(&staging, path).with_context(|| format!("cannot move the output into {}", path.display()))
}

/// Creates `target` and writes to it through a buffer what `write` writes.
fn stream_to(target: &Path, write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>) -> std::io::Result<()> {
    let mut writer = std::io::BufWriter::new(std::fs::File::create(target)?);
    write(&mut writer)?;
    std::io::Write::flush(&mut writer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pleat-checkpoint-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_directory_left_aside_by_a_dead_writer_is_put_back_and_its_staging_removed() {
        let root = scratch("recover");
        let dir = root.join("out");
        // No process has id u32::MAX - 1: both siblings belong to an ended writer.
        let dead = u32::MAX - 1;
        std::fs::create_dir_all(root.join(format!(".out.old-{dead}"))).unwrap();
        std::fs::write(root.join(format!(".out.old-{dead}/b")), "old").unwrap();
        std::fs::write(root.join(format!(".out.old-{dead}/a")), "old").unwrap();
        std::fs::create_dir_all(root.join(format!(".out.tmp-{dead}"))).unwrap();
        recover(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("a")).unwrap(), "old");
        write_dir_atomically(&dir, "b", |staging| Ok(std::fs::write(staging.join("b"), "new")?)).unwrap();
        assert!(!dir.join("a").exists());
        assert_eq!(std::fs::read_to_string(dir.join("b")).unwrap(), "new");
        let names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(names, vec!["out".to_string()]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_failed_fill_keeps_the_old_directory() {
        let root = scratch("failed");
        let dir = root.join("out");
        write_dir_atomically(&dir, "a", |staging| Ok(std::fs::write(staging.join("a"), "old")?)).unwrap();
        let failed = write_dir_atomically(&dir, "a", |staging| {
            std::fs::write(staging.join("a"), "new")?;
            bail!("stopped")
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read_to_string(dir.join("a")).unwrap(), "old");
        write_file_atomically(&root.join("f.json"), b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(root.join("f.json")).unwrap(), "{}");
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 2);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
