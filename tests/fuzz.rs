//! Fuzzing on the stable toolchain: every input parser pleat exposes to users, fed random
//! mutations of a checked-in corpus (`tests/fuzz/corpus/<target>/`) plus seeds generated from the
//! current compiler, must return a result or an error and never panic.
//!
//! Each target replays its corpus, then runs `arbtest` for a time budget (one second each by
//! default; set `ARBTEST_BUDGET_MS=600000` for ten minutes). A mutation is one to eight edits
//! chosen by the random bytes `arbtest` supplies: bit flips, byte overwrites, deleted or duplicated
//! ranges, splices from another corpus entry, and insertions of tokens that break parsers (huge and
//! negative numbers, NaN, unbalanced brackets, quotes). A failure prints arbtest's seed; rerun it
//! with `arbtest::arbtest(..).seed(SEED)` to reproduce.
//!
//! Run `cargo test --release --test fuzz -- --nocapture` to see the executions of each target.

#![allow(clippy::print_stderr, reason = "reports the executions of a long local run")]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arbtest::arbitrary::{self, Unstructured};
use pleat_ir::model::config::ModelConfig;
use pleat_ir::Mesh;
use pleat_runtime::weights::{SafetensorsWeights, WeightSource};

/// Edits that break parsers: numbers at and past the integer limits, non-finite floats,
/// structure and string delimiters.
const TOKENS: [&[u8]; 18] = [
    b"0",
    b"-1",
    b"4294967296",
    b"18446744073709551615",
    b"18446744073709551616",
    b"1e309",
    b"NaN",
    b"-0.0",
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b",",
    b":",
    b"=",
    b"\n",
    b"\\u0000",
];

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(target);
    let mut paths: Vec<PathBuf> =
        std::fs::read_dir(&dir).expect("the corpus directory").map(|entry| entry.expect("an entry").path()).collect();
    paths.sort();
    paths.into_iter().map(|path| std::fs::read(path).expect("a corpus file")).collect()
}

fn range(u: &mut Unstructured<'_>, len: usize) -> arbitrary::Result<(usize, usize)> {
    if len == 0 {
        return Ok((0, 0));
    }
    let start = u.choose_index(len)?;
    let end = u.int_in_range(start..=len.min(start + 64))?;
    Ok((start, end))
}

/// One to eight random edits of a random corpus entry.
fn mutate(u: &mut Unstructured<'_>, seeds: &[Vec<u8>]) -> arbitrary::Result<Vec<u8>> {
    let mut input = u.choose(seeds)?.clone();
    for _ in 0..u.int_in_range(1..=8)? {
        let at = if input.is_empty() { 0 } else { u.choose_index(input.len() + 1)? };
        match u.int_in_range(0..=5)? {
            0 if at < input.len() => input[at] ^= 1 << u.int_in_range(0..=7)?,
            1 if at < input.len() => input[at] = u.arbitrary()?,
            2 => {
                let (start, end) = range(u, input.len())?;
                input.drain(start..end);
            }
            3 => {
                let (start, end) = range(u, input.len())?;
                let copy = input[start..end].to_vec();
                input.splice(at..at, copy);
            }
            4 => {
                let other = u.choose(seeds)?;
                let (start, end) = range(u, other.len())?;
                input.splice(at..at, other[start..end].iter().copied());
            }
            _ => {
                let token = u.choose(&TOKENS)?;
                input.splice(at..at, token.iter().copied());
            }
        }
    }
    Ok(input)
}

/// One second a target, or `ARBTEST_BUDGET_MS`.
fn budget() -> Duration {
    let ms = std::env::var("ARBTEST_BUDGET_MS").ok().and_then(|ms| ms.parse().ok()).unwrap_or(1000);
    Duration::from_millis(ms)
}

/// Replays `seeds`, then fuzzes `target` with mutations of them for the budget.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, target: fn(&[u8])) {
    for seed in &seeds {
        target(seed);
    }
    let executions = AtomicU64::new(0);
    arbtest::arbtest(|u| {
        let input = mutate(u, &seeds)?;
        target(&input);
        executions.fetch_add(1, Ordering::Relaxed);
        Ok(())
    })
    .budget(budget());
    eprintln!("fuzz {name}: {} corpus entries, {} mutated inputs", seeds.len(), executions.load(Ordering::Relaxed));
}

fn config_target(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(config) = ModelConfig::from_json_str(text, "fuzz") else { return };
    let _ = config.param_count();
    let _ = pleat_passes::cost::ModelShape::from_config(&config);
    let _ = config.to_hf_json();
    // Building is linear in the layers; a few are enough to reach every builder path.
    if config.num_layers <= 4 {
        let _ = pleat_ir::model::build(&config, 1, 4);
    }
}

fn mesh_target(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(mesh) = Mesh::parse(text) else { return };
    let ranks = mesh.world_size().min(64) as u32;
    for rank in 0..ranks {
        for axis in mesh.axes() {
            let _ = mesh.coord(rank, axis.name);
            let _ = mesh.group(rank, axis.name);
        }
    }
}

fn ir_target(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(module) = pleat_ir::text::parse_module(text) else { return };
    // What parses prints back to text that parses to the same module.
    let printed = pleat_ir::text::print_module(&module);
    let reparsed = pleat_ir::text::parse_module(&printed).expect("printed text parses");
    assert_eq!(reparsed, module, "print/parse round trip");
    let _ = pleat_passes::verify(&module);
}

fn program_target(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(program) = pleat_backend::from_json(text) else { return };
    let _ = pleat_backend::memory::plan(&program, pleat_backend::memory::ElementSize::Declared);
    let _ = pleat_backend::text::print_program(&program);
    let _ = pleat_backend::verify_collectives(std::slice::from_ref(&program));
}

fn safetensors_target(bytes: &[u8]) {
    // One file per test thread: targets run in parallel.
    let path = std::env::temp_dir().join(format!(
        "pleat-fuzz-{}-{:?}.safetensors",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, bytes).expect("the scratch file");
    if let Ok(weights) = SafetensorsWeights::open(&path) {
        for name in weights.names() {
            let Some(shape) = weights.shape(&name) else { continue };
            if shape.iter().try_fold(1u64, |count, &size| count.checked_mul(size)).is_some_and(|count| count <= 1 << 20)
            {
                let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
                let _ = weights.read(&name, &shape, &region);
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// Seeds from the compiler as it is now, beside the checked-in ones (which may predate a format
/// change).
fn fresh_seeds(what: &str) -> Vec<Vec<u8>> {
    let config = pleat_ir::model::preset::preset("tiny").expect("tiny");
    let mut seeds = Vec::new();
    for mesh in ["tp=2", "dp=2,tsp=2"] {
        let mut module = pleat_ir::model::build(&config, 2, 8).expect("builds");
        module.mesh = Mesh::parse(mesh).expect("mesh");
        pleat_passes::run_pipeline(pleat_passes::SHARD_PIPELINE, &mut module, &pleat_passes::PassCtx::default())
            .expect("shards");
        match what {
            "ir" => seeds.push(pleat_ir::text::print_module(&module).into_bytes()),
            _ => {
                let programs = pleat_backend::lower(&module).expect("lowers");
                seeds.push(pleat_backend::to_json(&programs[0]).into_bytes());
            }
        }
    }
    seeds
}

#[test]
fn fuzz_config_loader() {
    fuzz("config", corpus("config"), config_target);
}

#[test]
fn fuzz_mesh_strings() {
    fuzz("mesh", corpus("mesh"), mesh_target);
}

#[test]
fn fuzz_text_ir_parser() {
    let mut seeds = corpus("ir");
    seeds.extend(fresh_seeds("ir"));
    fuzz("ir", seeds, ir_target);
}

#[test]
fn fuzz_program_reader() {
    let mut seeds = corpus("program");
    seeds.extend(fresh_seeds("program"));
    fuzz("program", seeds, program_target);
}

#[test]
fn fuzz_safetensors_loader() {
    fuzz("safetensors", corpus("safetensors"), safetensors_target);
}
