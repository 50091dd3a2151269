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
use pleat_ir::{AxisName, Mesh};
use pleat_passes::pipeline::{self as planner, Schedule, ScheduleKind, StepCosts};
use pleat_runtime::comm::{link::LinkClock, LinkSpec};
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

/// The plan options a user types, one `option=value` a line (`mesh=dp=2,pp=4`, `layers=32`,
/// `pp-layers=9,8,8,7`, `schedule=1f1b`, `chunks=2`, `micro-batches=8`, `emulate-link=25,5`), read
/// by the library parsers behind the flags and then used as the commands use them: the pipeline
/// stages a mesh's `pp` axis asks for, the stage layers, the schedule and its simulation, and the
/// emulated link's timing. `--strategy`, `--zero` and `--recompute` are clap enums of the binary,
/// with no library parser to fuzz.
fn plan_target(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let (mut stages, mut layers, mut micro_batches, mut chunks) = (1u32, 1u32, 1u32, 2u32);
    let (mut pp_layers, mut schedule) = (None, None);
    for line in text.lines() {
        let Some((option, value)) = line.split_once('=') else { continue };
        let number = || value.trim().parse::<u32>().ok();
        match option.trim() {
            "mesh" => {
                if let Ok(mesh) = Mesh::parse(value) {
                    stages = u32::try_from(mesh.degree(AxisName::Pp)).unwrap_or(u32::MAX);
                }
            }
            "layers" => layers = number().unwrap_or(layers),
            "micro-batches" => micro_batches = number().unwrap_or(micro_batches),
            "chunks" => chunks = number().unwrap_or(chunks),
            "pp-layers" => pp_layers = Some(value.to_string()),
            "schedule" => schedule = Some(value.trim().to_string()),
            "emulate-link" => {
                if let Ok(link) = value.parse::<LinkSpec>() {
                    let _ = link.to_string();
                    let now = std::time::Instant::now();
                    let mut clock = LinkClock::default();
                    for bytes in [0, 1, 1 << 20, 1 << 40] {
                        let _ = link.serialization(bytes);
                        let _ = clock.schedule(&link, now, bytes);
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(text) = &pp_layers {
        let _ = planner::parse_pp_layers(text, layers, stages);
    }
    // Planning is linear in the layers and quadratic in stages times micro-batches: keep each run
    // short.
    if layers <= 1024 && stages <= 64 {
        let _ = planner::balance(&vec![1.0; layers as usize], 0.5, 0.5, stages);
    }
    let kinds =
        [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved { chunks }, ScheduleKind::ZeroBubbleH1];
    let kind = schedule.and_then(|name| kinds.into_iter().find(|kind| kind.name() == name));
    if let Some(kind) = kind.filter(|_| stages <= 32 && micro_batches <= 64 && chunks <= 8) {
        if let Ok(schedule) = Schedule::build(kind, stages, micro_batches) {
            let _ = planner::check_complete(&schedule);
            if let Ok(timeline) = planner::simulate(&schedule, &StepCosts::EQUAL_STAGES) {
                let _ = planner::render_text(&timeline, &StepCosts::EQUAL_STAGES);
            }
        }
    }
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
fn fuzz_plan_strings() {
    fuzz("plan", corpus("plan"), plan_target);
}

#[test]
fn fuzz_safetensors_loader() {
    fuzz("safetensors", corpus("safetensors"), safetensors_target);
}
