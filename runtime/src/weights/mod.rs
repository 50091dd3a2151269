//! Weight sources: where a rank gets the numbers for its slice of each parameter.
//!
//! A [`WeightSource`] reads a rectangular [`Region`] of a named tensor as `f32` in row-major order, so each
//! rank reads only its own shard. Three sources exist:
//!
//! - [`SafetensorsWeights`]: a memory-mapped `.safetensors` checkpoint, single-file or sharded with a
//!   Hugging Face `model.safetensors.index.json`. Reading a region copies and converts only that region.
//! - [`BlockWeights`]: blocks of global tensors (a training run's state, a sharded checkpoint), any region
//!   assembled from the blocks it spans.
//! - [`SeededWeights`]: deterministic synthetic weights, where each element depends only on the seed, the
//!   tensor name and the element's flat index, so every rank and the single-device reference agree.
//!
//! Shapes are given in the model's view, which may split dims that the file stores merged (Hugging Face
//! stores `q_proj.weight` as `[heads * head_dim, hidden]`; the model may see `[heads, head_dim, hidden]`).
//! A file tensor is accepted iff its shape is the model's shape with runs of adjacent dims merged.
//! A mixture's stacked experts are also read from one tensor an expert or from transformers 5's
//! fused `gate_up_proj` and `down_proj` (`hf_layout`).
//! [`write_safetensors`] writes `f32` tensors atomically (logits dumps, tests).

mod blocks;
mod hf_layout;
mod region;
mod safetensors_file;
mod seeded;

use std::path::PathBuf;

pub use blocks::{BlockWeights, TensorBlock};
pub use safetensors_file::{write_safetensors, SafetensorsWeights};
pub use seeded::SeededWeights;

/// A rectangular region of a tensor: per dim `(start, len)`, in the model's view of the tensor.
pub type Region = Vec<(u64, u64)>;

/// Something that can produce any rectangular region of any named tensor.
pub trait WeightSource: Send + Sync {
    /// Reads `region` of tensor `name`, whose shape in the model's view is `shape`, as `f32` row-major.
    ///
    /// `region` has one `(start, len)` per dim of `shape`; the result has `product(len)` elements, ordered
    /// row-major over the region (the last dim fastest).
    fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<Vec<f32>, WeightError>;
}

/// Everything that can go wrong finding, reading or writing weights.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum WeightError {
    // === Files ===
    /// The path given as the checkpoint does not exist.
    #[error(
        "weights file {} does not exist: pass a .safetensors file, a model.safetensors.index.json, \
         or a directory holding one of them",
        .path.display()
    )]
    #[diagnostic(
        code(E0610),
        help("pass a .safetensors file, a model.safetensors.index.json or a directory holding one")
    )]
    FileMissing {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// A directory was given that holds no checkpoint.
    #[error(
        "directory {} holds neither model.safetensors nor model.safetensors.index.json: \
         point at the checkpoint file itself or download the checkpoint into it",
        .dir.display()
    )]
    #[diagnostic(code(E0611), help("point at the checkpoint file, or put model.safetensors in the directory"))]
    NoCheckpointInDirectory {
        /// The directory that was searched.
        dir: PathBuf,
    },
    /// A file exists but cannot be read or is not a valid safetensors file or index.
    #[error(
        "cannot read weights file {}: {reason}; re-download or re-export the checkpoint",
        .path.display()
    )]
    #[diagnostic(code(E0612), help("re-download or re-export the checkpoint"))]
    Malformed {
        /// The file that could not be read.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// A sharded checkpoint's index names a shard file that is not there.
    #[error(
        "{} names shard {} in its weight_map but {} does not exist: download every shard the index lists \
         into the same directory as the index",
        .index.display(), .file, .path.display()
    )]
    #[diagnostic(code(E0613), help("download every shard the index lists next to the index"))]
    IndexedFileMissing {
        /// The index file.
        index: PathBuf,
        /// The shard's name as the index writes it.
        file: String,
        /// Where the shard was looked for.
        path: PathBuf,
    },

    // === Tensors ===
    /// The checkpoint has no tensor of this name.
    #[error(
        "tensor `{name}` is not in {}{}: the checkpoint does not match the model's architecture; \
         check the model config (architecture, num_hidden_layers, tie_word_embeddings)",
        .file.display(), similar_hint(.similar)
    )]
    #[diagnostic(code(E0614), help("use a checkpoint of the model's architecture and layer count"))]
    TensorMissing {
        /// The tensor asked for.
        name: String,
        /// The checkpoint that was opened (file or index).
        file: PathBuf,
        /// Up to three names in the checkpoint that are closest to `name`.
        similar: Vec<String>,
    },
    /// A training rank was asked for a block it does not hold.
    #[error(
        "tensor `{name}` block {region:?} is not one this rank holds between training steps; a training program \
         must read the blocks it was started with"
    )]
    #[diagnostic(code(E0615), help("read only the blocks the training rank started with"))]
    NotResident {
        /// The tensor asked for.
        name: String,
        /// The block asked for.
        region: Vec<(u64, u64)>,
    },
    /// The blocks held of a tensor do not cover a region asked for.
    #[error(
        "tensor `{name}` region {region:?} is not wholly held by the blocks in {}: the checkpoint is \
         incomplete; write it again from a run that holds every block",
        .file.display()
    )]
    #[diagnostic(code(E0622), help("save the checkpoint again from a complete run; do not remove its rank files"))]
    NotCovered {
        /// The tensor asked for.
        name: String,
        /// The region asked for.
        region: Vec<(u64, u64)>,
        /// Where the blocks came from.
        file: PathBuf,
    },
    /// The file's tensor is not the model's view with adjacent dims merged.
    #[error(
        "tensor `{name}` in {} has shape {found:?} but the model expects {expected:?} (or that shape with \
         adjacent dims merged): the checkpoint does not match the model config; check hidden_size, \
         num_attention_heads, num_key_value_heads, intermediate_size and vocab_size",
        .file.display()
    )]
    #[diagnostic(code(E0616), help("use a checkpoint whose sizes match config.json"))]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// The shape in the model's view.
        expected: Vec<u64>,
        /// The shape stored in the file.
        found: Vec<u64>,
        /// The file that holds the tensor.
        file: PathBuf,
    },
    /// The region asked for does not lie inside the tensor.
    #[error(
        "region {region:?} of tensor `{name}` does not fit its shape {shape:?}: give one (start, len) per dim \
         with start + len <= dim; a sharding whose slices miss the shape is a bug in the plan"
    )]
    #[diagnostic(code(E0617), help("this is a bug in the plan; report it"))]
    RegionOutOfBounds {
        /// The tensor.
        name: String,
        /// The region asked for, one `(start, len)` per dim.
        region: Vec<(u64, u64)>,
        /// The tensor's shape in the model's view.
        shape: Vec<u64>,
    },
    /// The tensor's element type is not one pleat converts to `f32`.
    #[error(
        "tensor `{name}` in {} has dtype {dtype}, which pleat cannot read: convert the checkpoint to \
         F32, BF16 or F16",
        .file.display()
    )]
    #[diagnostic(code(E0618), help("convert the checkpoint to F32, BF16 or F16"))]
    UnsupportedDtype {
        /// The tensor.
        name: String,
        /// The dtype as safetensors names it.
        dtype: String,
        /// The file that holds the tensor.
        file: PathBuf,
    },
    /// A weight is NaN or infinite: the checkpoint is corrupt (a model trained into NaN, or bytes
    /// damaged), and a run on it would only show NaN logits or a NaN gradient norm.
    #[error(
        "tensor `{name}` in {} holds {value} at {index:?}: a weight must be a finite number; the \
         checkpoint is corrupt or was saved from a diverged run",
        .file.display()
    )]
    #[diagnostic(code(E0624), help("re-download the checkpoint, or re-export it from a run that did not diverge"))]
    NotFinite {
        /// The tensor.
        name: String,
        /// The first such element's index in the tensor, one entry a dim (the model's view).
        index: Vec<u64>,
        /// What it holds: NaN, inf or -inf.
        value: f32,
        /// The file that holds the tensor.
        file: PathBuf,
    },

    // === Writing ===
    /// A tensor handed to [`write_safetensors`] is inconsistent.
    #[error("cannot write tensor `{name}`: {reason}; fix the caller that builds the tensor list")]
    #[diagnostic(code(E0619), help("fix the tensor list given to the writer"))]
    InvalidTensorToWrite {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing the output file failed.
    #[error(
        "cannot write {}: {reason}; check that the directory exists, is writable and has space",
        .path.display()
    )]
    #[diagnostic(code(E0621), help("check that the directory exists, is writable and has space"))]
    WriteFailed {
        /// The file being written.
        path: PathBuf,
        /// The underlying error.
        reason: String,
    },
}

/// Renders the "similar names" part of [`WeightError::TensorMissing`].
fn similar_hint(similar: &[String]) -> String {
    if similar.is_empty() {
        " (it holds no tensors)".to_string()
    } else {
        let quoted: Vec<String> = similar.iter().map(|name| format!("`{name}`")).collect();
        format!(" (similar names there: {})", quoted.join(", "))
    }
}
