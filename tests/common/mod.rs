//! Shared test plumbing: compile a model for a mesh, run it on threads, and run the reference.

#![allow(dead_code, reason = "each test binary uses a different part")]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pleat_backend::overlap::Prefetch;
use pleat_backend::Program;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::{Mesh, Module};
use pleat_passes::{run_pipeline, PassCtx, SHARD_PIPELINE, TRAIN_PIPELINE};
use pleat_runtime::weights::{SeededWeights, WeightSource};
use pleat_runtime::{assemble, run_on_threads, RankOutcome, RunInputs};

/// The one tolerance of f32 equivalence tests: max abs error of the logits.
pub const F32_TOL: f32 = 1e-4;

/// Builds, shards and lowers `config` for `mesh`.
pub fn compile(config: &ModelConfig, batch: u64, seq: u64, mesh: &str) -> (Module, Vec<Program>) {
    compile_with(config, batch, seq, mesh, &PassCtx::default())
}

/// `compile` with sequence parallelism on the tp axis (`--strategy tp-sp`).
pub fn compile_sp(config: &ModelConfig, batch: u64, seq: u64, mesh: &str) -> (Module, Vec<Program>) {
    compile_with(config, batch, seq, mesh, &PassCtx { sequence_parallel: true, ..PassCtx::default() })
}

/// Builds, shards and lowers `config` for `mesh` with the given pass options.
pub fn compile_with(config: &ModelConfig, batch: u64, seq: u64, mesh: &str, ctx: &PassCtx) -> (Module, Vec<Program>) {
    let mut module = pleat_ir::model::build(config, batch, seq).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(SHARD_PIPELINE, &mut module, ctx).unwrap_or_else(|err| panic!("{mesh}: {err}"));
    let programs = pleat_backend::lower(&module).expect("lower");
    pleat_backend::verify_collectives(&programs).expect("collectives match");
    (module, programs)
}

/// Builds, differentiates, shards and lowers `config`'s training step for `mesh`, as `pleat run
/// --train` does without pipelining.
pub fn compile_training(
    config: &ModelConfig,
    batch: u64,
    seq: u64,
    mesh: &str,
    ctx: &PassCtx,
) -> (Module, Vec<Program>) {
    let mut module = pleat_ir::model::build_training(config, batch, seq).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(TRAIN_PIPELINE, &mut module, ctx).unwrap_or_else(|err| panic!("{mesh}: {err}"));
    let programs = pleat_backend::lower(&module).expect("lower");
    pleat_backend::verify_collectives(&programs).expect("collectives match");
    (module, programs)
}

/// Deterministic token ids.
pub fn tokens(batch: u64, seq: u64, vocab: u64) -> Vec<u32> {
    (0..batch * seq).map(|index| ((index * 7919 + 13) % vocab) as u32).collect()
}

/// The reference interpreter's logits for the unsharded model.
pub fn reference(config: &ModelConfig, batch: u64, seq: u64, tokens: &[u32], weights: &dyn WeightSource) -> Vec<f32> {
    let module = pleat_ir::model::build(config, batch, seq).expect("build");
    interpret(&module.graph, seq, tokens, weights).remove(0).data
}

/// Every output of `graph` by the reference interpreter, its parameters read whole from `weights`.
pub fn interpret(
    graph: &pleat_ir::Graph,
    seq: u64,
    tokens: &[u32],
    weights: &dyn WeightSource,
) -> Vec<pleat_ir::interp::Tensor> {
    let mut params = HashMap::new();
    for (value, name) in graph.params() {
        let shape = graph.value(value).ty.shape.sizes();
        let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
        params.insert(name.to_string(), weights.read(name, &shape, &region).expect("weights"));
    }
    let lookup = |name: &str, _shape: &[u64]| params.get(name).cloned();
    let positions: Vec<u32> = (0..seq as u32).collect();
    let inputs = pleat_ir::interp::Inputs { tokens, positions: &positions, params: &lookup };
    pleat_ir::interp::run(graph, &inputs).expect("interp")
}

/// Runs `programs` on threads; returns the assembled logits and every rank's outcome.
pub fn run(programs: &[Program], tokens: &[u32], seq: u64, weights: &dyn WeightSource) -> (Vec<f32>, Vec<RankOutcome>) {
    let positions: Vec<u32> = (0..seq as u32).collect();
    let inputs = RunInputs { tokens, positions: &positions, weights, epoch: Instant::now() };
    let outcomes = run_on_threads(programs, &inputs, Duration::from_secs(60)).expect("run");
    let (_, logits) = assemble(&outcomes, 0).expect("logits");
    (logits, outcomes)
}

/// Asserts `got` equals `want` within `F32_TOL`, naming the worst element.
#[track_caller]
pub fn assert_close(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: lengths differ");
    let (worst, err) =
        got.iter().zip(want).map(|(a, b)| (a - b).abs()).enumerate().fold((0, 0.0f32), |(at, worst), (index, diff)| {
            if diff > worst || diff.is_nan() {
                (index, diff)
            } else {
                (at, worst)
            }
        });
    assert!(
        err <= F32_TOL,
        "{label}: max abs error {err:e} at element {worst}: got {} want {}",
        got[worst],
        want[worst]
    );
}

/// Compiles `config` for `mesh`, runs it, and checks the logits against the reference.
pub fn check_equivalence(config: &ModelConfig, batch: u64, seq: u64, mesh: &str) -> Vec<RankOutcome> {
    check_programs(config, batch, seq, mesh, compile(config, batch, seq, mesh).1)
}

/// Runs `programs` (compiled from `config` for `mesh`) and checks the logits against the reference.
pub fn check_programs(
    config: &ModelConfig,
    batch: u64,
    seq: u64,
    mesh: &str,
    programs: Vec<Program>,
) -> Vec<RankOutcome> {
    let weights = SeededWeights::new(7);
    let ids = tokens(batch, seq, config.vocab_size);
    let (logits, outcomes) = run(&programs, &ids, seq, &weights);
    let want = reference(config, batch, seq, &ids, &weights);
    assert_close(&format!("{} {mesh}", config.name), &logits, &want);
    // The same programs scheduled for overlap compute the same numbers, bit for bit, with the
    // weight prefetches on a second communication stream or on the one (a runtime with one).
    for prefetch in [Prefetch::OwnStream, Prefetch::MainStream] {
        let (scheduled_logits, _) = run(&overlapped_with(&programs, prefetch), &ids, seq, &weights);
        assert!(
            scheduled_logits == logits,
            "{} {mesh}: the scheduled programs' logits differ ({prefetch:?})",
            config.name
        );
    }
    outcomes
}

/// `programs` scheduled for overlap (`pleat_backend::overlap`), a transfer's or kernel's cost
/// standing in as the bytes it writes, weight broadcasts prefetched on their own stream when
/// every rank schedules them alike.
pub fn overlapped(programs: &[Program]) -> Vec<Program> {
    overlapped_with(programs, Prefetch::OwnStream)
}

/// As [`overlapped`], the weight broadcasts prefetched as `prefetch` says.
pub fn overlapped_with(programs: &[Program], prefetch: Prefetch) -> Vec<Program> {
    use pleat_backend::memory::ElementSize;
    use pleat_backend::overlap::{schedule_ranks, OverlapOptions};
    let seconds = |program: &Program, instr: &pleat_backend::Instr| -> f64 {
        instr.outs().iter().map(|&out| program.buffer(out).bytes() as f64).sum::<f64>() * 1e-9
    };
    let options = OverlapOptions { seconds: &seconds, memory_budget: None, sizing: ElementSize::Declared, prefetch };
    schedule_ranks(programs, &options).expect("the programs schedule").into_iter().map(|(program, _)| program).collect()
}
