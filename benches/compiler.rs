//! Compile-time and cost-model benchmarks: how long pleat takes to shard and lower a model, and to
//! cost a plan for the largest preset. Report ratios and orders of magnitude, not absolute goals:
//! this machine is noisy.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use pleat_ir::model::preset::preset;
use pleat_ir::Mesh;
use pleat_passes::cost::hw::HardwareSpec;
use pleat_passes::cost::{estimate, Layout, Mode, ModelShape, Workload};
use pleat_passes::rewrite::{rewrite_collectives, RewriteOptions};
use pleat_passes::search::{search, SearchSpace, MODELLED_AXES};
use pleat_passes::{propagate, run_pipeline, tsp, PassCtx, SHARD_PIPELINE};

fn compile(config: &pleat_ir::model::config::ModelConfig, mesh: &str) -> usize {
    let mut module = pleat_ir::model::build(config, 8, 64).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(SHARD_PIPELINE, &mut module, &PassCtx::default()).expect("passes");
    pleat_backend::lower(&module).expect("lower").len()
}

fn compile_benches(c: &mut Criterion) {
    let tiny = preset("tiny").expect("tiny");
    for mesh in ["tp=4", "tsp=4"] {
        c.bench_function(&format!("compile tiny {mesh}"), |b| b.iter(|| compile(black_box(&tiny), mesh)));
    }
}

fn plan_benches(c: &mut Criterion) {
    // The cost model answers from closed formulas; `pleat plan llama3-405b --mesh dp=128,pp=16,tp=8`.
    let config = preset("llama3-405b").expect("preset");
    let model = ModelShape::from_config(&config);
    let layout = Layout::from_mesh(&Mesh::parse("dp=128,pp=16,tp=8").expect("mesh"), false);
    let hw = HardwareSpec::builtin("h100-sxm").expect("hw");
    let workload = Workload::training(8192, 1);
    c.bench_function("plan llama3-405b dp=128,pp=16,tp=8", |b| {
        b.iter(|| estimate(black_box(&model), &layout, &workload, &hw).expect("estimate"))
    });
}

fn search_benches(c: &mut Criterion) {
    // `pleat search llama3-405b --gpus 16384 --hw h100 --seq 8192 --global-batch 2048`.
    let model = ModelShape::from_config(&preset("llama3-405b").expect("preset"));
    let hw = HardwareSpec::builtin("h100-sxm").expect("hw");
    let space = SearchSpace::new(16384, 8192, 2048, Mode::Train, hw.memory_bytes as f64);
    let costed = search(&model, &hw, &space).expect("a plan fits").costed;
    c.bench_function(&format!("search llama3-405b on 16384 h100 ({costed} plans costed)"), |b| {
        b.iter(|| search(black_box(&model), &hw, &space).expect("a plan fits"))
    });
    // `--all-axes`: pipelines and the sp axis too, the cost model's whole space.
    let wide = SearchSpace { axes: MODELLED_AXES.to_vec(), ..space };
    let costed = search(&model, &hw, &wide).expect("a plan fits").costed;
    c.bench_function(&format!("search llama3-405b on 16384 h100, all axes ({costed} plans costed)"), |b| {
        b.iter(|| search(black_box(&model), &hw, &wide).expect("a plan fits"))
    });
}

/// `config` on `mesh`, propagated without sequence parallelism: the form `rewrite-collectives` starts
/// from (with sequence parallelism on, it derives Korthikanti's layout from it: the heaviest case).
fn tp_form(config: &pleat_ir::model::config::ModelConfig, mesh: &str) -> pleat_ir::Module {
    let mut module = pleat_ir::model::build(config, 1, 8192).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(&[tsp::FOLD_TSP, propagate::PROPAGATE_SPECS], &mut module, &PassCtx::default()).expect("passes");
    module
}

fn rewrite_benches(c: &mut Criterion) {
    // The egg pass saturates one layer template whatever the depth: one layer of llama3-405b, then
    // the whole 126 layers (one e-graph, the chosen form written into every layer).
    let mut one_layer = preset("llama3-405b").expect("preset");
    one_layer.num_layers = 1;
    let whole = preset("llama3-405b").expect("preset");
    for (label, config) in [("one layer", &one_layer), ("126 layers", &whole)] {
        let module = tp_form(config, "tp=8");
        for (strategy, sequence_parallel) in [("tp", false), ("tp-sp", true)] {
            let ctx = PassCtx { sequence_parallel, ..PassCtx::default() };
            let options = RewriteOptions::default();
            c.bench_function(&format!("rewrite-collectives llama3-405b {label} tp=8 {strategy}"), |b| {
                b.iter_batched(
                    || module.clone(),
                    |mut module| rewrite_collectives(&mut module, &ctx, &options).expect("rewrite"),
                    criterion::BatchSize::LargeInput,
                )
            });
        }
    }
}

fn overlap_benches(c: &mut Criterion) {
    // The overlap scheduler on one rank of a deep model (`pleat compile llama3-8b --mesh tsp=8
    // --seq 16`): every weight load is a candidate at every step, so its cost grows with depth.
    let mut module = pleat_ir::model::build(&preset("llama3-8b").expect("preset"), 1, 16).expect("build");
    module.mesh = Mesh::parse("tsp=8").expect("mesh");
    run_pipeline(SHARD_PIPELINE, &mut module, &PassCtx::default()).expect("passes");
    let program = pleat_backend::lower(&module).expect("lower").swap_remove(0);
    let seconds =
        |_: &pleat_backend::Program, instr: &pleat_backend::Instr| if instr.is_transfer() { 2e-4 } else { 1e-4 };
    let options = pleat_backend::overlap::OverlapOptions {
        seconds: &seconds,
        memory_budget: None,
        sizing: pleat_backend::memory::ElementSize::Declared,
        prefetch: pleat_backend::overlap::Prefetch::OwnStream,
    };
    let instructions = program.instructions.len();
    c.bench_function(&format!("overlap schedule llama3-8b tsp=8, one rank ({instructions} instructions)"), |b| {
        b.iter(|| pleat_backend::overlap::schedule(black_box(&program), &options).expect("schedule"))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = compile_benches, plan_benches, search_benches, overlap_benches
}
criterion_group! {
    name = rewrite;
    config = Criterion::default().sample_size(10);
    targets = rewrite_benches
}
criterion_main!(benches, rewrite);
