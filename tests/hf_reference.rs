//! The oracle is checked too: the reference interpreter's logits equal Hugging Face transformers'
//! `LlamaForCausalLM` / `Qwen2ForCausalLM` in float32 on the fixtures in `tests/fixtures/hf`
//! (made by `generate.py` there), and so do the sharded runs.

mod common;

use std::path::{Path, PathBuf};

use pleat_ir::model::config::ModelConfig;
use pleat_runtime::weights::{SafetensorsWeights, WeightSource};

/// Transformers' float32 eager forward and ours differ in summation order only; the logits reach
/// about 4.5 in magnitude.
const HF_TOL: f32 = 2e-5;

struct Case {
    config: ModelConfig,
    batch: u64,
    seq: u64,
    tokens: Vec<u32>,
    weights: SafetensorsWeights,
    logits: Vec<f32>,
}

fn fixture(name: &str) -> Case {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name);
    let config_text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let config = ModelConfig::from_json_str(&config_text, "config.json").expect("config parses");
    let rows: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).expect("tokens.json")).expect("tokens");
    let (batch, seq) = (rows.len() as u64, rows[0].len() as u64);
    let tokens: Vec<u32> = rows.into_iter().flatten().collect();
    let weights = SafetensorsWeights::open(&dir).expect("weights");
    let expected = SafetensorsWeights::open(dir.join("expected.safetensors")).expect("expected");
    let shape = [batch, seq, config.vocab_size];
    let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
    let logits = expected.read("logits", &shape, &region).expect("logits");
    Case { config, batch, seq, tokens, weights, logits }
}

#[track_caller]
fn assert_matches_hf(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: lengths differ");
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= HF_TOL, "{label}: max |pleat - transformers| = {err:e} > {HF_TOL:e}");
}

fn check(name: &str, meshes: &[&str]) {
    let case = fixture(name);
    let reference = common::reference(&case.config, case.batch, case.seq, &case.tokens, &case.weights);
    assert_matches_hf(&format!("{name} reference"), &reference, &case.logits);
    for mesh in meshes {
        let (_, programs) = common::compile(&case.config, case.batch, case.seq, mesh);
        let (logits, _) = common::run(&programs, &case.tokens, case.seq, &case.weights);
        assert_matches_hf(&format!("{name} {mesh}"), &logits, &case.logits);
    }
}

#[test]
fn llama_gqa_matches_transformers() {
    // 8 heads over 2 kv heads: tp=2 splits kv heads, tp=4 keeps them whole.
    check("llama-gqa", &["tp=2", "tp=4", "tsp=2", "cp=2", "tp=2,cp=2"]);
}

#[test]
fn llama3_rope_scaling_and_tied_embeddings_match_transformers() {
    check("llama3-rope", &["tp=2", "tp=4", "tsp=2"]);
}

#[test]
fn qwen2_biases_match_transformers() {
    check("qwen2", &["tp=2", "dp=2", "tsp=2", "cp=2"]);
}
