//! Tests for safetensors reading and writing: round trips, dtypes, sharded indexes and every error message.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::*;

/// A fresh directory under the system temp dir, removed when dropped.
struct TestDir {
    path: PathBuf,
}

impl TestDir {
    fn new(label: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("pleat-weights-{label}-{}-{unique}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        Self { path }
    }

    fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Distinct values, exactly representable in f32, BF16 and F16 for the sizes used here.
fn ramp(count: usize) -> Vec<f32> {
    (0..count).map(|index| (index as f32 - 20.0) * 0.125).collect()
}

/// The region of a row-major tensor by brute force over every multi-index (independent of `for_each_run`).
fn naive_slice(full: &[f32], shape: &[u64], region: &[(u64, u64)]) -> Vec<f32> {
    let mut out = Vec::new();
    for (flat, &value) in full.iter().enumerate() {
        let mut rest = flat as u64;
        let mut inside = true;
        for dim in (0..shape.len()).rev() {
            let coordinate = rest % shape[dim];
            rest /= shape[dim];
            inside &= coordinate >= region[dim].0 && coordinate < region[dim].0 + region[dim].1;
        }
        if inside {
            out.push(value);
        }
    }
    out
}

fn full(shape: &[u64]) -> Vec<(u64, u64)> {
    shape.iter().map(|&dim| (0, dim)).collect()
}

/// Writes raw tensors of any dtype with the safetensors crate directly.
fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| (*name, TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn tensor(name: &str, shape: &[u64]) -> (String, Vec<u64>, Vec<f32>) {
    let count = shape.iter().product::<u64>() as usize;
    (name.to_string(), shape.to_vec(), ramp(count))
}

#[test]
fn write_then_read_full_tensors_and_regions() {
    let dir = TestDir::new("round-trip");
    let path = dir.join("model.safetensors");
    let tensors = vec![tensor("cube", &[3, 4, 5]), tensor("matrix", &[6, 7]), tensor("scalar", &[])];
    write_safetensors(&path, &tensors).unwrap();

    let weights = SafetensorsWeights::open(&path).unwrap();
    assert_eq!(weights.names(), vec!["cube", "matrix", "scalar"]);
    assert_eq!(weights.shape("cube"), Some(vec![3, 4, 5]));
    assert_eq!(weights.shape("absent"), None);
    for (name, shape, data) in &tensors {
        assert_eq!(&weights.read(name, shape, &full(shape)).unwrap(), data, "{name}");
    }
    let cube = &tensors[0].2;
    for region in [
        vec![(1, 1), (0, 4), (0, 5)],
        vec![(0, 3), (1, 2), (0, 5)],
        vec![(1, 2), (1, 3), (2, 2)],
        vec![(2, 1), (3, 1), (4, 1)],
        vec![(0, 3), (0, 4), (1, 0)],
    ] {
        let got = weights.read("cube", &[3, 4, 5], &region).unwrap();
        assert_eq!(got, naive_slice(cube, &[3, 4, 5], &region), "{region:?}");
    }
    let matrix = &tensors[1].2;
    let columns = weights.read("matrix", &[6, 7], &[(0, 6), (3, 4)]).unwrap();
    assert_eq!(columns, naive_slice(matrix, &[6, 7], &[(0, 6), (3, 4)]));
}

#[test]
fn merged_dims_in_the_file_are_read_through_the_model_view() {
    let dir = TestDir::new("merged");
    let path = dir.join("model.safetensors");
    let name = "model.layers.0.self_attn.q_proj.weight";
    let file_tensor = tensor(name, &[128, 128]);
    write_safetensors(&path, std::slice::from_ref(&file_tensor)).unwrap();
    let weights = SafetensorsWeights::open(&path).unwrap();

    let model_shape = [8u64, 16, 128];
    assert_eq!(weights.read(name, &model_shape, &full(&model_shape)).unwrap(), file_tensor.2);
    // Heads 2..5 (a tensor-parallel shard), then a cut through heads, head_dim and hidden at once.
    for region in [vec![(2, 3), (0, 16), (0, 128)], vec![(1, 2), (4, 8), (100, 28)]] {
        let got = weights.read(name, &model_shape, &region).unwrap();
        assert_eq!(got, naive_slice(&file_tensor.2, &model_shape, &region), "{region:?}");
    }
    // Heads 2..5 are rows 32..80 of the file's merged view.
    let heads = weights.read(name, &model_shape, &[(2, 3), (0, 16), (0, 128)]).unwrap();
    assert_eq!(heads, weights.read(name, &[128, 128], &[(32, 48), (0, 128)]).unwrap());
}

#[test]
fn bf16_and_f16_convert_to_f32() {
    let dir = TestDir::new("half");
    let path = dir.join("half.safetensors");
    let exact = ramp(24);
    let inexact = [0.1f32, -3.3, 1.0e-3, 65000.0];
    let bf16_bytes: Vec<u8> = exact.iter().flat_map(|&value| half::bf16::from_f32(value).to_le_bytes()).collect();
    let f16_bytes: Vec<u8> = exact.iter().flat_map(|&value| half::f16::from_f32(value).to_le_bytes()).collect();
    let bf16_inexact: Vec<u8> = inexact.iter().flat_map(|&value| half::bf16::from_f32(value).to_le_bytes()).collect();
    let f16_inexact: Vec<u8> = inexact.iter().flat_map(|&value| half::f16::from_f32(value).to_le_bytes()).collect();
    write_raw(
        &path,
        &[
            ("bf16", Dtype::BF16, vec![4, 6], bf16_bytes),
            ("f16", Dtype::F16, vec![4, 6], f16_bytes),
            ("bf16_inexact", Dtype::BF16, vec![4], bf16_inexact),
            ("f16_inexact", Dtype::F16, vec![4], f16_inexact),
        ],
    );
    let weights = SafetensorsWeights::open(&path).unwrap();
    for name in ["bf16", "f16"] {
        assert_eq!(weights.read(name, &[4, 6], &full(&[4, 6])).unwrap(), exact, "{name}");
        let region = [(0, 2), (1, 1), (2, 3)];
        let got = weights.read(name, &[2, 2, 6], &region).unwrap();
        assert_eq!(got, naive_slice(&exact, &[2, 2, 6], &region), "{name}");
    }
    let bf16_expected: Vec<f32> = inexact.iter().map(|&value| half::bf16::from_f32(value).to_f32()).collect();
    let f16_expected: Vec<f32> = inexact.iter().map(|&value| half::f16::from_f32(value).to_f32()).collect();
    assert_eq!(weights.read("bf16_inexact", &[4], &[(0, 4)]).unwrap(), bf16_expected);
    assert_eq!(weights.read("f16_inexact", &[4], &[(0, 4)]).unwrap(), f16_expected);
    // The conversions round, so the checks above would pass vacuously if they did not.
    assert_ne!(bf16_expected[0], 0.1);
    assert_ne!(f16_expected[0], 0.1);
}

/// Writes a two-shard checkpoint with its index into `dir` and returns the tensors.
fn write_sharded(dir: &TestDir) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let embed = tensor("model.embed_tokens.weight", &[10, 4]);
    let norm = tensor("model.norm.weight", &[4]);
    let head = tensor("lm_head.weight", &[10, 4]);
    write_safetensors(dir.join("model-00001-of-00002.safetensors"), &[embed.clone(), norm.clone()]).unwrap();
    write_safetensors(dir.join("model-00002-of-00002.safetensors"), std::slice::from_ref(&head)).unwrap();
    let index = r#"{
        "metadata": {"total_size": 336},
        "weight_map": {
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00001-of-00002.safetensors"
        }
    }"#;
    fs::write(dir.join(INDEX_FILE_NAME), index).unwrap();
    vec![embed, norm, head]
}

#[test]
fn sharded_checkpoints_open_from_the_directory_or_the_index() {
    let dir = TestDir::new("sharded");
    let tensors = write_sharded(&dir);
    for opened in [dir.path.clone(), dir.join(INDEX_FILE_NAME)] {
        let weights = SafetensorsWeights::open(&opened).unwrap();
        assert_eq!(weights.names(), vec!["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]);
        for (name, shape, data) in &tensors {
            assert_eq!(&weights.read(name, shape, &full(shape)).unwrap(), data, "{name}");
        }
        let rows = weights.read("lm_head.weight", &[10, 4], &[(5, 5), (1, 2)]).unwrap();
        assert_eq!(rows, naive_slice(&tensors[2].2, &[10, 4], &[(5, 5), (1, 2)]));
        // Usable behind the trait object the executor holds.
        let source: &dyn WeightSource = &weights;
        assert_eq!(source.read("model.norm.weight", &[4], &[(1, 2)]).unwrap(), tensors[1].2[1..3].to_vec());
    }
}

#[test]
fn a_directory_with_a_single_file_opens_it() {
    let dir = TestDir::new("single-dir");
    write_safetensors(dir.join(SINGLE_FILE_NAME), &[tensor("w", &[2, 2])]).unwrap();
    let weights = SafetensorsWeights::open(&dir.path).unwrap();
    assert_eq!(weights.read("w", &[2, 2], &full(&[2, 2])).unwrap(), ramp(4));
}

#[test]
fn writing_replaces_the_file_atomically_and_leaves_no_temporary() {
    let dir = TestDir::new("overwrite");
    let path = dir.join("logits.safetensors");
    write_safetensors(&path, &[tensor("logits", &[2, 3])]).unwrap();
    let before = SafetensorsWeights::open(&path).unwrap();
    write_safetensors(&path, &[("logits".to_string(), vec![1, 2], vec![7.0, 8.0])]).unwrap();
    // A mapping taken before the rename still sees the old, complete file.
    assert_eq!(before.read("logits", &[2, 3], &full(&[2, 3])).unwrap(), ramp(6));
    let after = SafetensorsWeights::open(&path).unwrap();
    assert_eq!(after.read("logits", &[1, 2], &full(&[1, 2])).unwrap(), vec![7.0, 8.0]);
    let entries: Vec<_> = fs::read_dir(&dir.path).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("logits.safetensors")]);
}

fn message(error: WeightError) -> String {
    error.to_string()
}

#[test]
fn opening_errors_say_what_to_do() {
    let dir = TestDir::new("open-errors");
    let missing = dir.join("nope.safetensors");
    assert_eq!(
        message(SafetensorsWeights::open(&missing).unwrap_err()),
        format!(
            "weights file {} does not exist: pass a .safetensors file, a model.safetensors.index.json, \
             or a directory holding one of them",
            missing.display()
        )
    );
    assert_eq!(
        message(SafetensorsWeights::open(&dir.path).unwrap_err()),
        format!(
            "directory {} holds neither model.safetensors nor model.safetensors.index.json: \
             point at the checkpoint file itself or download the checkpoint into it",
            dir.path.display()
        )
    );

    let garbage = dir.join("garbage.safetensors");
    fs::write(&garbage, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!").unwrap();
    let error = SafetensorsWeights::open(&garbage).unwrap_err();
    let WeightError::Malformed { ref path, ref reason } = error else { panic!("{error:?}") };
    assert_eq!(path, &garbage);
    assert!(reason.starts_with("not a safetensors file: invalid JSON in header"), "{reason}");
    assert_eq!(
        message(error.clone()),
        format!("cannot read weights file {}: {reason}; re-download or re-export the checkpoint", garbage.display())
    );
    // A tensor whose bytes do not hold its shape, and a file cut short, are named with their sizes
    // (the crate's own error named neither).
    let file_of = |header: &str, data: usize| {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(vec![0u8; data]);
        bytes
    };
    let reason_of = |name: &str, bytes: Vec<u8>| {
        let path = dir.join(name);
        fs::write(&path, bytes).unwrap();
        let error = SafetensorsWeights::open(&path).unwrap_err();
        let WeightError::Malformed { reason, .. } = error else { panic!("{error:?}") };
        reason
    };
    let misshapen = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2,3],"data_offsets":[8,24]}}"#;
    assert_eq!(
        reason_of("misshapen.safetensors", file_of(misshapen, 24)),
        "not a safetensors file: tensor `b` is F32 [2, 3], 24 bytes, but its data_offsets [8, 24] hold 16 bytes"
    );
    let whole = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    assert_eq!(
        reason_of("truncated.safetensors", file_of(whole, 5)),
        "not a safetensors file: the tensors' data ends at byte 8 of the data section, which holds 5 bytes: the file \
         is truncated"
    );
    let empty = dir.join("empty.safetensors");
    fs::write(&empty, b"").unwrap();
    assert!(matches!(SafetensorsWeights::open(&empty), Err(WeightError::Malformed { .. })));

    let bad_index = dir.join("bad.index.json");
    fs::write(&bad_index, r#"{"metadata": {}}"#).unwrap();
    assert_eq!(
        message(SafetensorsWeights::open(&bad_index).unwrap_err()),
        format!(
            "cannot read weights file {}: it has no \"weight_map\" object; re-download or re-export the checkpoint",
            bad_index.display()
        )
    );
}

#[test]
fn index_errors_name_the_shard() {
    let dir = TestDir::new("index-errors");
    write_sharded(&dir);
    let second = dir.join("model-00002-of-00002.safetensors");
    fs::remove_file(&second).unwrap();
    assert_eq!(
        message(SafetensorsWeights::open(&dir.path).unwrap_err()),
        format!(
            "{} names shard model-00002-of-00002.safetensors in its weight_map but {} does not exist: \
             download every shard the index lists into the same directory as the index",
            dir.join(INDEX_FILE_NAME).display(),
            second.display()
        )
    );
    // The shard exists but lacks the tensor the index puts in it.
    write_safetensors(&second, &[tensor("other", &[1])]).unwrap();
    assert_eq!(
        message(SafetensorsWeights::open(&dir.path).unwrap_err()),
        format!(
            "cannot read weights file {}: weight_map puts `lm_head.weight` in model-00002-of-00002.safetensors, \
             which has no such tensor; re-download or re-export the checkpoint",
            dir.join(INDEX_FILE_NAME).display()
        )
    );
}

#[test]
fn reading_errors_say_what_to_do() {
    let dir = TestDir::new("read-errors");
    let path = dir.join("model.safetensors");
    write_safetensors(
        &path,
        &[
            tensor("model.layers.0.mlp.up_proj.weight", &[8, 4]),
            tensor("model.layers.0.mlp.down_proj.weight", &[4, 8]),
            tensor("model.layers.0.mlp.gate_proj.weight", &[8, 4]),
            tensor("model.norm.weight", &[4]),
        ],
    )
    .unwrap();
    let weights = SafetensorsWeights::open(&path).unwrap();

    assert_eq!(
        message(weights.read("model.layers.0.mlp.up_proj.bias", &[8], &[(0, 8)]).unwrap_err()),
        format!(
            "tensor `model.layers.0.mlp.up_proj.bias` is not in {} (similar names there: \
             `model.layers.0.mlp.up_proj.weight`, `model.layers.0.mlp.down_proj.weight`, \
             `model.layers.0.mlp.gate_proj.weight`): the checkpoint does not match the model's architecture; \
             check the model config (architecture, num_hidden_layers, tie_word_embeddings)",
            path.display()
        )
    );
    assert_eq!(
        message(weights.read("model.layers.0.mlp.up_proj.weight", &[4, 8], &[(0, 4), (0, 8)]).unwrap_err()),
        format!(
            "tensor `model.layers.0.mlp.up_proj.weight` in {} has shape [8, 4] but the model expects [4, 8] \
             (or that shape with adjacent dims merged): the checkpoint does not match the model config; \
             check hidden_size, num_attention_heads, num_key_value_heads, intermediate_size and vocab_size",
            path.display()
        )
    );
    assert_eq!(
        message(weights.read("model.norm.weight", &[4], &[(2, 3)]).unwrap_err()),
        "region [(2, 3)] of tensor `model.norm.weight` does not fit its shape [4]: give one (start, len) per dim \
         with start + len <= dim; a sharding whose slices miss the shape is a bug in the plan"
    );

    let empty = dir.join("empty-checkpoint.safetensors");
    write_safetensors(&empty, &[]).unwrap();
    assert_eq!(
        message(SafetensorsWeights::open(&empty).unwrap().read("w", &[1], &[(0, 1)]).unwrap_err()),
        format!(
            "tensor `w` is not in {} (it holds no tensors): the checkpoint does not match the model's \
             architecture; check the model config (architecture, num_hidden_layers, tie_word_embeddings)",
            empty.display()
        )
    );
}

#[test]
fn a_weight_that_is_not_finite_is_named_by_its_index() {
    // (A NaN weight used to run: NaN logits, a --check "failure", or a diverged step that blamed
    // --lr.) Its index is the tensor's, whatever region a rank reads, in F32 and in BF16 alike.
    let dir = TestDir::new("not-finite");
    let path = dir.join("nan.safetensors");
    let mut values = ramp(12);
    values[7] = f32::NAN;
    let mut halves: Vec<u8> = ramp(12).iter().flat_map(|&value| half::bf16::from_f32(value).to_le_bytes()).collect();
    halves[2 * 5..2 * 6].copy_from_slice(&half::bf16::NEG_INFINITY.to_le_bytes());
    let bytes: Vec<u8> = values.iter().flat_map(|value| value.to_le_bytes()).collect();
    write_raw(&path, &[("w", Dtype::F32, vec![3, 4], bytes), ("h", Dtype::BF16, vec![3, 4], halves)]);
    let weights = SafetensorsWeights::open(&path).unwrap();
    let not_finite = |name: &str, region: &[(u64, u64)]| match weights.read(name, &[3, 4], region) {
        Err(WeightError::NotFinite { index, value, .. }) => Some((index, value.to_string())),
        Ok(_) => None,
        Err(other) => panic!("{other}"),
    };
    assert_eq!(not_finite("w", &[(0, 3), (0, 4)]), Some((vec![1, 3], "NaN".to_string())));
    assert_eq!(not_finite("w", &[(1, 2), (2, 2)]), Some((vec![1, 3], "NaN".to_string())));
    assert_eq!(not_finite("w", &[(0, 3), (0, 2)]), None);
    assert_eq!(not_finite("h", &[(1, 1), (0, 4)]), Some((vec![1, 1], "-inf".to_string())));
    assert_eq!(
        message(weights.read("w", &[3, 4], &[(0, 3), (0, 4)]).unwrap_err()),
        format!(
            "tensor `w` in {} holds NaN at [1, 3]: a weight must be a finite number; the checkpoint is corrupt \
             or was saved from a diverged run",
            path.display()
        )
    );
}

#[test]
fn unsupported_dtypes_are_named() {
    let dir = TestDir::new("dtype");
    let path = dir.join("ints.safetensors");
    write_raw(&path, &[("model.ids", Dtype::I32, vec![2], vec![1, 0, 0, 0, 2, 0, 0, 0])]);
    let weights = SafetensorsWeights::open(&path).unwrap();
    assert_eq!(
        message(weights.read("model.ids", &[2], &[(0, 2)]).unwrap_err()),
        format!(
            "tensor `model.ids` in {} has dtype I32, which pleat cannot read: convert the checkpoint to \
             F32, BF16 or F16",
            path.display()
        )
    );
}

#[test]
fn writing_errors_say_what_to_do() {
    let dir = TestDir::new("write-errors");
    let path = dir.join("out.safetensors");
    let short = ("w".to_string(), vec![2, 3], vec![0.0; 5]);
    assert_eq!(
        message(write_safetensors(&path, &[short]).unwrap_err()),
        "cannot write tensor `w`: shape [2, 3] holds 6 elements but 5 values were given; \
         fix the caller that builds the tensor list"
    );
    assert_eq!(
        message(write_safetensors(&path, &[tensor("w", &[1]), tensor("w", &[2])]).unwrap_err()),
        "cannot write tensor `w`: two tensors have this name; fix the caller that builds the tensor list"
    );
    assert_eq!(
        message(write_safetensors(&path, &[tensor("__metadata__", &[1])]).unwrap_err()),
        "cannot write tensor `__metadata__`: `__metadata__` is reserved by the safetensors format; \
         fix the caller that builds the tensor list"
    );
    let nowhere = dir.join("no-such-dir").join("out.safetensors");
    let error = write_safetensors(&nowhere, &[tensor("w", &[1])]).unwrap_err();
    let WeightError::WriteFailed { ref reason, .. } = error else { panic!("{error:?}") };
    assert_eq!(
        message(error.clone()),
        format!(
            "cannot write {}: {reason}; check that the directory exists, is writable and has space",
            nowhere.display()
        )
    );
    assert!(!path.exists(), "failed writes must not create the file");
}

#[test]
fn edit_distance_matches_known_values() {
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("abc", "abc"), 0);
    assert_eq!(edit_distance("q_proj", "k_proj"), 1);
}
