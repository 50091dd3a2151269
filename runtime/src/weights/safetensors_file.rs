//! Checkpoints in the safetensors format, memory-mapped, read one region at a time.
//!
//! [`SafetensorsWeights::open`] maps every file of a single-file or sharded checkpoint and parses only the
//! headers; tensor bytes stay in the page cache until a region is read. A read copies and converts exactly
//! the elements of the region (F32, BF16 and F16 become `f32`), one contiguous run at a time, so a rank
//! touches only the pages of its own shard. [`write_safetensors`] writes `f32` tensors to a temporary
//! sibling and renames it into place, so readers never see a half-written file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use super::hf_layout::{stored_as, StoredAs};
use super::region::{check_finite, check_region, element_count, for_each_run, is_merged_view};
use super::{WeightError, WeightSource};

/// File name of a single-file Hugging Face checkpoint inside its directory.
const SINGLE_FILE_NAME: &str = "model.safetensors";
/// File name of a sharded Hugging Face checkpoint's index inside its directory.
const INDEX_FILE_NAME: &str = "model.safetensors.index.json";
/// How many similar names a [`WeightError::TensorMissing`] lists.
const MAX_SIMILAR_NAMES: usize = 3;

/// A memory-mapped safetensors checkpoint: one file, or the shards of a Hugging Face index.
#[derive(Debug)]
pub struct SafetensorsWeights {
    /// What was opened: the `.safetensors` file or the index file. Errors about missing tensors name it.
    origin: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
}

/// One mapped file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// Where one tensor's bytes live.
#[derive(Debug, Clone)]
struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<u64>,
    /// Byte range of the tensor inside the shard's mapping (header included in the offsets).
    byte_start: usize,
    byte_end: usize,
}

impl SafetensorsWeights {
    /// Opens a checkpoint: a `.safetensors` file, a `model.safetensors.index.json`, or a directory holding
    /// `model.safetensors` (preferred when both exist) or `model.safetensors.index.json`.
    ///
    /// Shard files named in an index are resolved relative to the index's directory. Only headers are
    /// parsed here; no tensor data is read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, WeightError> {
        let path = path.as_ref();
        let metadata = fs::metadata(path).map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => WeightError::FileMissing { path: path.to_path_buf() },
            _ => WeightError::Malformed { path: path.to_path_buf(), reason: error.to_string() },
        })?;
        if metadata.is_dir() {
            let single = path.join(SINGLE_FILE_NAME);
            let index = path.join(INDEX_FILE_NAME);
            if single.is_file() {
                Self::open_single(&single)
            } else if index.is_file() {
                Self::open_index(&index)
            } else {
                Err(WeightError::NoCheckpointInDirectory { dir: path.to_path_buf() })
            }
        } else if path.extension().is_some_and(|extension| extension == "json") {
            Self::open_index(path)
        } else {
            Self::open_single(path)
        }
    }

    /// Names of all tensors in the checkpoint, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// Shape of tensor `name` as stored in the file, or `None` when the checkpoint lacks it.
    pub fn shape(&self, name: &str) -> Option<Vec<u64>> {
        self.tensors.get(name).map(|entry| entry.shape.clone())
    }

    fn open_single(path: &Path) -> Result<Self, WeightError> {
        let (shard, entries) = map_shard(path, 0)?;
        Ok(Self { origin: path.to_path_buf(), shards: vec![shard], tensors: entries })
    }

    fn open_index(index: &Path) -> Result<Self, WeightError> {
        let malformed = |reason: String| WeightError::Malformed { path: index.to_path_buf(), reason };
        let text = fs::read_to_string(index).map_err(|error| malformed(error.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|error| malformed(format!("invalid JSON: {error}")))?;
        let weight_map = json
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| malformed("it has no \"weight_map\" object".to_string()))?;
        // Group by shard file; BTreeMap keeps shard order deterministic.
        let mut tensors_by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in weight_map {
            let file =
                file.as_str().ok_or_else(|| malformed(format!("weight_map entry `{tensor}` is not a file name")))?;
            tensors_by_file.entry(file).or_default().push(tensor);
        }
        let directory = index.parent().unwrap_or_else(|| Path::new(""));
        let mut shards = Vec::with_capacity(tensors_by_file.len());
        let mut tensors = BTreeMap::new();
        for (shard_index, (file, listed)) in tensors_by_file.into_iter().enumerate() {
            let shard_path = directory.join(file);
            if !shard_path.is_file() {
                return Err(WeightError::IndexedFileMissing {
                    index: index.to_path_buf(),
                    file: file.to_string(),
                    path: shard_path,
                });
            }
            let (shard, mut entries) = map_shard(&shard_path, shard_index)?;
            for tensor in listed {
                let entry = entries.remove(tensor).ok_or_else(|| {
                    malformed(format!("weight_map puts `{tensor}` in {file}, which has no such tensor"))
                })?;
                tensors.insert(tensor.to_string(), entry);
            }
            shards.push(shard);
        }
        Ok(Self { origin: index.to_path_buf(), shards, tensors })
    }

    /// The checkpoint's tensors that hold the graph's parameter `name`, of global `shape`: itself,
    /// or where it has no such tensor, a mixture's per-expert tensors (those of its `shape[0]`
    /// experts the file holds) or transformers 5's fused ones; empty when none is there.
    pub fn stored_names(&self, name: &str, shape: &[u64]) -> Vec<String> {
        if self.tensors.contains_key(name) {
            return vec![name.to_string()];
        }
        self.stored_elsewhere(name, shape).map(|(_, held)| held).unwrap_or_default()
    }

    /// The first way of storing the parameter `name`, of global `shape`, under other names
    /// (`hf_layout`) that the checkpoint holds, with the tensors of it that it holds.
    fn stored_elsewhere(&self, name: &str, shape: &[u64]) -> Option<(StoredAs, Vec<String>)> {
        stored_as(name)
            .into_iter()
            .map(|way| {
                let held: Vec<String> = match &way {
                    StoredAs::PerExpert { prefix, projection } => (0..shape.first().copied().unwrap_or(0))
                        .map(|expert| format!("{prefix}.experts.{expert}.{projection}"))
                        .filter(|expert_name| self.tensors.contains_key(expert_name))
                        .collect(),
                    StoredAs::FusedHalf { source, .. } | StoredAs::Renamed { source } => {
                        [source.clone()].into_iter().filter(|source| self.tensors.contains_key(source)).collect()
                    }
                };
                (way, held)
            })
            .find(|(_, held)| !held.is_empty())
    }

    /// The graph's parameter `name`, of `shape`, read where the checkpoint stores it under other
    /// names ([`Self::stored_elsewhere`]): the region's experts one after another from their own
    /// tensors (one missing is named), or the region of a fused tensor. `None` when the checkpoint
    /// has none of those names.
    fn read_stored_elsewhere(
        &self,
        name: &str,
        shape: &[u64],
        region: &[(u64, u64)],
    ) -> Result<Option<Vec<f32>>, WeightError> {
        let Some((way, _)) = self.stored_elsewhere(name, shape) else { return Ok(None) };
        match way {
            StoredAs::PerExpert { prefix, projection } => {
                let (Some(&(first, count)), Some(inner_shape), Some(inner_region)) =
                    (region.first(), shape.get(1..), region.get(1..))
                else {
                    return Ok(None);
                };
                let mut values = Vec::new();
                for expert in first..first + count {
                    values.extend(self.read(
                        &format!("{prefix}.experts.{expert}.{projection}"),
                        inner_shape,
                        inner_region,
                    )?);
                }
                Ok(Some(values))
            }
            StoredAs::FusedHalf { source, half } => {
                let ([experts, rows, columns], [experts_region, (row, count), columns_region]) = (shape, region) else {
                    return Ok(None);
                };
                let fused_region = [*experts_region, (half * rows + row, *count), *columns_region];
                self.read(&source, &[*experts, 2 * rows, *columns], &fused_region).map(Some)
            }
            StoredAs::Renamed { source } => self.read(&source, shape, region).map(Some),
        }
    }

    /// Up to [`MAX_SIMILAR_NAMES`] tensor names closest to `name` by edit distance.
    fn similar_names(&self, name: &str) -> Vec<String> {
        let mut ranked: Vec<(usize, &String)> =
            self.tensors.keys().map(|candidate| (edit_distance(name, candidate), candidate)).collect();
        ranked.sort();
        ranked.into_iter().take(MAX_SIMILAR_NAMES).map(|(_, candidate)| candidate.clone()).collect()
    }
}

impl WeightSource for SafetensorsWeights {
    fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<Vec<f32>, WeightError> {
        if !self.tensors.contains_key(name) {
            if let Some(values) = self.read_stored_elsewhere(name, shape, region)? {
                return Ok(values);
            }
        }
        let entry = self.tensors.get(name).ok_or_else(|| WeightError::TensorMissing {
            name: name.to_string(),
            file: self.origin.clone(),
            similar: self.similar_names(name),
        })?;
        let shard = &self.shards[entry.shard];
        let bytes_per_element = match entry.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(WeightError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: other.to_string(),
                    file: shard.path.clone(),
                })
            }
        };
        if !is_merged_view(shape, &entry.shape) {
            return Err(WeightError::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
                file: shard.path.clone(),
            });
        }
        let count = check_region(name, shape, region)?;
        // Merged dims keep row-major order, so flat indices of the model's view index the file directly.
        let data = &shard.mmap[entry.byte_start..entry.byte_end];
        let mut values = Vec::with_capacity(count);
        for_each_run(shape, region, |flat_start, run_len| {
            let start = flat_start as usize * bytes_per_element;
            let end = (flat_start + run_len) as usize * bytes_per_element;
            convert_into(entry.dtype, &data[start..end], &mut values);
        });
        check_finite(name, region, &values, &shard.path)?;
        Ok(values)
    }
}

/// Appends the little-endian elements in `bytes` to `out` as `f32`. `dtype` is F32, BF16 or F16.
fn convert_into(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        Dtype::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|pair| half::bf16::from_le_bytes([pair[0], pair[1]]).to_f32()))
        }
        Dtype::F16 => {
            out.extend(bytes.chunks_exact(2).map(|pair| half::f16::from_le_bytes([pair[0], pair[1]]).to_f32()))
        }
        _ => out.extend(bytes.chunks_exact(4).map(|quad| f32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]))),
    }
}

/// Maps `path` and parses its header into tensor entries tagged with `shard_index`.
fn map_shard(path: &Path, shard_index: usize) -> Result<(Shard, BTreeMap<String, TensorEntry>), WeightError> {
    let malformed = |reason: String| WeightError::Malformed { path: path.to_path_buf(), reason };
    let file = fs::File::open(path).map_err(|error| match error.kind() {
        std::io::ErrorKind::NotFound => WeightError::FileMissing { path: path.to_path_buf() },
        _ => malformed(error.to_string()),
    })?;
    // SAFETY: the mapping is read-only and private to this process. Another process truncating or
    // rewriting the checkpoint while it is mapped is outside what any mmap-based loader can guard against;
    // `write_safetensors` itself replaces files by rename, which leaves existing mappings intact.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|error| malformed(format!("cannot map it: {error}")))?;
    // read_metadata checks that the offsets tile the data section and match each shape and dtype, and that
    // the data section ends exactly at the end of the file, so every entry's byte range lies in the mapping.
    let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|error| {
        // The crate does not say which tensor's size is wrong, nor by how much; the header does.
        let problem = match error {
            SafeTensorError::TensorInvalidInfo
            | SafeTensorError::ValidationOverflow
            | SafeTensorError::MisalignedSlice
            | SafeTensorError::MetadataIncompleteBuffer => size_problem(&mmap),
            _ => None,
        };
        malformed(format!("not a safetensors file: {}", problem.unwrap_or_else(|| error.to_string())))
    })?;
    let data_start = std::mem::size_of::<u64>() + header_len;
    let entries = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let entry = TensorEntry {
                shard: shard_index,
                dtype: info.dtype,
                shape: info.shape.iter().map(|&dim| dim as u64).collect(),
                byte_start: data_start + info.data_offsets.0,
                byte_end: data_start + info.data_offsets.1,
            };
            (name, entry)
        })
        .collect();
    Ok((Shard { path: path.to_path_buf(), mmap }, entries))
}

/// Where a safetensors file that `read_metadata` refused for its sizes goes wrong, naming the
/// tensor: the first (by offset) whose byte range does not hold its shape of its dtype, or the
/// data section's length against the tensors' end. `None` where the header does not parse (the
/// crate's own error says why).
fn size_problem(file: &[u8]) -> Option<String> {
    let header_len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header = file.get(8..8usize.checked_add(header_len)?)?;
    let entries: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut tensors: Vec<(String, TensorInfo)> = entries
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, value)| Some((name, serde_json::from_value(value).ok()?)))
        .collect::<Option<_>>()?;
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    for (name, info) in &tensors {
        let (start, end) = info.data_offsets;
        let elements = info.shape.iter().try_fold(1u128, |count, &dim| count.checked_mul(dim as u128));
        let bits = elements.and_then(|count| count.checked_mul(info.dtype.bitsize() as u128));
        let holds = end.checked_sub(start).map(|bytes| bytes as u128 * 8);
        if bits != holds {
            let needs = bits.map_or("more than 2^128 bits".to_string(), |bits| format!("{} bytes", bits as f64 / 8.0));
            return Some(format!(
                "tensor `{name}` is {:?} {:?}, {needs}, but its data_offsets [{start}, {end}] hold {}",
                info.dtype,
                info.shape,
                holds.map_or("a negative span".to_string(), |bits| format!("{} bytes", bits / 8))
            ));
        }
    }
    let end = tensors.iter().map(|(_, info)| info.data_offsets.1).max().unwrap_or(0);
    let data = file.len() - 8 - header_len;
    (end != data).then(|| {
        let what = if end > data { "the file is truncated" } else { "bytes follow the last tensor" };
        format!("the tensors' data ends at byte {end} of the data section, which holds {data} bytes: {what}")
    })
}

/// Levenshtein distance between two names, counted in chars.
fn edit_distance(left: &str, right: &str) -> usize {
    let right: Vec<char> = right.chars().collect();
    let mut previous: Vec<usize> = (0..=right.len()).collect();
    let mut current = vec![0; right.len() + 1];
    for (i, left_char) in left.chars().enumerate() {
        current[0] = i + 1;
        for (j, &right_char) in right.iter().enumerate() {
            let substitution = previous[j] + usize::from(left_char != right_char);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[right.len()]
}

/// Writes `(name, shape, data)` tensors as an F32 safetensors file at `path`, atomically.
///
/// The file is written to a temporary sibling (`.NAME.tmp.PID`), flushed to disk and renamed over `path`,
/// so a reader sees either the old file or the complete new one. Each `data` must hold exactly the
/// shape's element count in row-major order, and names must be unique and not `__metadata__`.
pub fn write_safetensors(path: impl AsRef<Path>, tensors: &[(String, Vec<u64>, Vec<f32>)]) -> Result<(), WeightError> {
    let path = path.as_ref();
    let write_failed = |reason: String| WeightError::WriteFailed { path: path.to_path_buf(), reason };
    let mut seen = BTreeSet::new();
    let mut encoded = Vec::with_capacity(tensors.len());
    for (name, shape, data) in tensors {
        let invalid = |reason: String| WeightError::InvalidTensorToWrite { name: name.clone(), reason };
        if name == "__metadata__" {
            return Err(invalid("`__metadata__` is reserved by the safetensors format".to_string()));
        }
        if !seen.insert(name.as_str()) {
            return Err(invalid("two tensors have this name".to_string()));
        }
        let expected = element_count(shape);
        if expected != Some(data.len() as u64) {
            return Err(invalid(format!(
                "shape {shape:?} holds {} elements but {} values were given",
                expected.map_or_else(|| "more than 2^64".to_string(), |count| count.to_string()),
                data.len()
            )));
        }
        let shape_usize = shape
            .iter()
            .map(|&dim| usize::try_from(dim))
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|_| invalid(format!("shape {shape:?} does not fit in memory")))?;
        let bytes: Vec<u8> = data.iter().flat_map(|value| value.to_le_bytes()).collect();
        encoded.push((name.as_str(), shape_usize, bytes));
    }
    let mut views = Vec::with_capacity(encoded.len());
    for (name, shape, bytes) in &encoded {
        let view = TensorView::new(Dtype::F32, shape.clone(), bytes)
            .map_err(|error| WeightError::InvalidTensorToWrite { name: name.to_string(), reason: error.to_string() })?;
        views.push((*name, view));
    }
    let serialized = safetensors::serialize(views, None).map_err(|error| write_failed(error.to_string()))?;

    // A link (`/dev/stdout`), a pipe or a device is written through: renaming over it would
    // replace the link or the node itself.
    if fs::symlink_metadata(path).is_ok_and(|metadata| !metadata.is_file() && !metadata.is_dir()) {
        return fs::write(path, &serialized).map_err(|error| write_failed(error.to_string()));
    }
    let file_name =
        path.file_name().ok_or_else(|| write_failed("the path names no file".to_string()))?.to_string_lossy();
    let temporary = path.with_file_name(format!(".{file_name}.tmp.{}", std::process::id()));
    let written = fs::File::create(&temporary)
        .and_then(|mut file| {
            file.write_all(&serialized)?;
            file.sync_all()
        })
        .and_then(|()| fs::rename(&temporary, path));
    written.map_err(|error| {
        // Best effort: the write already failed, and a leftover temporary is harmless beyond the disk it uses.
        let _ = fs::remove_file(&temporary);
        write_failed(error.to_string())
    })
}

#[cfg(test)]
mod tests;
