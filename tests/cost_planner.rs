//! The memory planner against the executor: for every layout of `tiny` that compiles, the planner's
//! predicted peak (at the CPU runtime's 4 bytes an element, staging copies included) equals the
//! peak the executor measures on the same program, rank by rank; the planner's arena never
//! overlaps two live buffers; the planner's parameter bytes equal the cost model's closed
//! formula; and the cost model's closed-form peak plus the named terms of `cost::compiled` equals
//! the planner's peak to the byte for tp, tp with Megatron SP, tsp, cp and dp at degrees 2 and 4.
//!
//! Training: for `tiny`'s training step on tp=2, tp=2 with Megatron SP, dp=2 with ZeRO 0 to 3,
//! tsp=2, cp=2 and dp=2×tp=2, the planner's peak of each rank's program plus the rank's AdamW
//! moments (8 bytes an updated element, the one term the executor counts beside the program)
//! equals the measured peak of one step to the byte; and the closed-form training peak plus the
//! named terms of `cost::compiled` equals the planner's peak for tp (2, 4, with and without SP), dp
//! and cp.

mod common;

use std::time::Duration;

use pleat_backend::memory::{plan, ElementSize, Staging};
use pleat_backend::optimizer::{optimizer_layout, OptimizerLayout};
use pleat_backend::{BufferKind, Instr};
use pleat_ir::model::preset::preset;
use pleat_ir::{AxisName, Mesh};
use pleat_passes::cost::compiled::{
    compiled_forward_peak, compiled_training_peak, compiled_workload, differences_from_closed_form,
    training_differences_from_closed_form,
};
use pleat_passes::cost::memory::{memory_per_stage, stage_params};
use pleat_passes::cost::{Layout, ModelShape, Workload};
use pleat_passes::PassCtx;
use pleat_runtime::train::{train_on_threads, AdamWSettings, TrainOptions};
use pleat_runtime::weights::SeededWeights;

const MESHES: [&str; 9] = ["", "tp=2", "tp=4", "tp=8", "dp=2", "dp=2,tp=2", "tsp=2", "tsp=4", "dp=2,tsp=2"];
const BATCH: u64 = 2;
const SEQ: u64 = 8;

/// The tolerance the issue sets; the planner in fact matches to the byte.
const TOLERANCE: f64 = 0.01;

#[test]
fn planner_peak_equals_the_executors_measurement() {
    let config = preset("tiny").unwrap();
    let weights = SeededWeights::new(3);
    let ids = common::tokens(BATCH, SEQ, config.vocab_size);
    for mesh in MESHES {
        let (_, programs) = common::compile(&config, BATCH, SEQ, mesh);
        let (_, outcomes) = common::run(&programs, &ids, SEQ, &weights);
        for (program, outcome) in programs.iter().zip(&outcomes) {
            let predicted = plan(program, ElementSize::Fixed(4));
            let measured = outcome.peak_bytes;
            let error = (predicted.peak_bytes as f64 - measured as f64).abs() / measured as f64;
            assert!(
                error <= TOLERANCE,
                "{mesh} rank {}: planned {} measured {measured}",
                program.rank,
                predicted.peak_bytes
            );
            assert_eq!(predicted.peak_bytes, measured, "{mesh} rank {}: to the byte", program.rank);
            assert_eq!(predicted.param_bytes, outcome.param_bytes, "{mesh} rank {}: params", program.rank);
        }
    }
}

#[test]
fn staging_is_a_named_term_of_the_peak() {
    let config = preset("tiny").unwrap();
    // dp gathers the logits on batch: the peak is inside that all-gather, whose staging copy is the
    // whole logits. It stages exactly the output's size, so it never raises the peak above the
    // live bytes once the output is stored (a reduce-scatter's input-sized staging does; see
    // backend::memory's unit tests).
    let (_, programs) = common::compile(&config, BATCH, SEQ, "dp=2");
    let result = plan(&programs[0], ElementSize::Fixed(4));
    let logits_bytes = BATCH * SEQ * config.vocab_size * 4;
    assert_eq!(result.peak_staging, Some((Staging::AllGather, logits_bytes)));
    assert!(matches!(programs[0].instructions[result.peak_instr], Instr::AllGather { .. }));
    assert_eq!(result.peak_bytes, result.peak_live_bytes);
}

#[test]
fn arena_offsets_never_overlap_live_buffers() {
    let config = preset("tiny").unwrap();
    for mesh in MESHES {
        let (_, programs) = common::compile(&config, BATCH, SEQ, mesh);
        for program in &programs {
            let result = plan(program, ElementSize::Declared);
            assert!(result.arena_bytes >= result.peak_live_bytes, "{mesh}");
            // Replay liveness naively and check every pair of live buffers.
            let mut live: Vec<usize> = Vec::new();
            for instr in &program.instructions {
                match instr {
                    Instr::Free { buf } => live.retain(|&slot| slot != buf.as_u32() as usize),
                    _ => {
                        for out in instr.outs() {
                            let slot = out.as_u32() as usize;
                            let span = |slot: usize| {
                                let start = result.offsets[slot].expect("placed");
                                (start, start + program.buffers[slot].bytes())
                            };
                            let (start, end) = span(slot);
                            for &other in &live {
                                let (other_start, other_end) = span(other);
                                assert!(end <= other_start || other_end <= start, "{mesh}: b{slot} overlaps b{other}");
                            }
                            live.push(slot);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn planner_params_equal_the_closed_formula() {
    let config = preset("tiny").unwrap();
    let model = ModelShape::from_config(&config);
    // The compiler splits the embedding and LM head over tsp too (vocab-parallel).
    let workload = Workload { tsp_shards_embeddings: true, ..Workload::inference(SEQ, BATCH) };
    for mesh in MESHES {
        let (_, programs) = common::compile(&config, BATCH, SEQ, mesh);
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
        let formula = stage_params(&model, &layout, &workload, 0, model.layers) * model.dtype_bytes as f64;
        for program in &programs {
            let params: u64 = program
                .buffers
                .iter()
                .filter(|buffer| buffer.kind == BufferKind::Param)
                .map(|buffer| buffer.bytes())
                .sum();
            assert_eq!(params as f64, formula, "{mesh} rank {}", program.rank);
            assert_eq!(plan(program, ElementSize::Declared).param_bytes, params);
        }
    }
}

/// The layouts of the activation cross-check: tp, tp with Megatron SP, tsp, cp and dp, at 2 and 4.
const CROSS_CHECK: [(&str, bool); 10] = [
    ("tp=2", false),
    ("tp=4", false),
    ("tp=2", true),
    ("tp=4", true),
    ("tsp=2", false),
    ("tsp=4", false),
    ("cp=2", false),
    ("cp=4", false),
    ("dp=2", false),
    ("dp=4", false),
];

#[test]
fn closed_form_plus_named_terms_equals_the_planners_peak() {
    // Batch 4 so that dp=4 divides it; f32, the CPU runtime's 4 bytes an element.
    let batch = 4;
    let config = preset("tiny").unwrap();
    let model = ModelShape::from_config(&config);
    assert_eq!(model.dtype_bytes, 4);
    for (mesh, sequence_parallel) in CROSS_CHECK {
        let ctx = PassCtx { sequence_parallel, ..PassCtx::default() };
        let (_, programs) = common::compile_with(&config, batch, SEQ, mesh, &ctx);
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), sequence_parallel);
        // The cost model counts sequences a replica.
        let workload = compiled_workload(SEQ, batch / layout.degree(AxisName::Dp));
        let label = format!("{}", layout);
        let memory = &memory_per_stage(&model, &layout, &workload)[0];
        let compiled = compiled_forward_peak(&model, &layout, &workload);
        // The closed form's static bytes are the program's parameters, to the byte.
        assert_eq!(memory.static_bytes(), compiled.all_params, "{label}");
        let differences = differences_from_closed_form(memory, &compiled);
        let predicted = memory.peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
        for program in &programs {
            let planned = plan(program, ElementSize::Fixed(4));
            assert_eq!(planned.param_bytes as f64, compiled.all_params, "{label} rank {}", program.rank);
            assert_eq!(
                planned.peak_bytes as f64, predicted,
                "{label} rank {}: planner {} vs closed form {} + {differences:?}",
                program.rank, planned.peak_bytes, memory.peak_bytes
            );
        }
        // Where the closed form and the program hold the same buffer, the bytes are the same: the
        // logits a rank computes (a vocabulary shard under tp, a batch shard under dp).
        let phase = compiled.peak_phase();
        let term = |name: &str| phase.terms.iter().find(|term| term.name == name).map(|term| term.bytes);
        if mesh.starts_with("tp") {
            assert_eq!(term("logits, vocabulary shard"), Some(memory.logits_bytes), "{label}");
        }
        if mesh.starts_with("dp") {
            assert_eq!(term("logits, batch shard"), Some(memory.logits_bytes), "{label}");
        }
        // The phase each layout peaks in: tsp inside its MLP ring, every other layout at the logits.
        let want = if mesh.starts_with("tsp") { "tsp mlp ring" } else { "logits" };
        assert_eq!(phase.name, want, "{label}");
    }
}

#[test]
fn the_named_terms_by_hand() {
    // tiny, 32 tokens (batch 4 x 8), h 128, V 256, f 256, 4 bytes: tp=4 holds its 64-column logits
    // shard and stages the whole 256; tsp=4 holds 8 tokens' residual, norm and accumulator, and a
    // held plus an arriving MLP shard of 3·128·64 (more than a step's 3·8·64).
    let model = ModelShape::from_config(&preset("tiny").unwrap());
    let workload = compiled_workload(SEQ, 4);
    let tp = compiled_forward_peak(&model, &Layout::from_mesh(&Mesh::parse("tp=4").unwrap(), false), &workload);
    let tp_terms: Vec<f64> = tp.peak_phase().terms.iter().map(|term| term.bytes).collect();
    assert_eq!(tp_terms, vec![32.0 * 64.0 * 4.0, 32.0 * 256.0 * 4.0]);
    let tsp = compiled_forward_peak(&model, &Layout::from_mesh(&Mesh::parse("tsp=4").unwrap(), false), &workload);
    let names: Vec<&str> = tsp.peak_phase().terms.iter().map(|term| term.name).collect();
    assert_eq!(
        names,
        [
            "residual stream",
            "mlp norm output",
            "ring accumulator",
            "held mlp shard (gate, up, down)",
            "next mlp shard being received (staging)"
        ]
    );
    let bytes: f64 = tsp.peak_phase().terms.iter().map(|term| term.bytes).sum();
    assert_eq!(bytes, (3.0 * 8.0 * 128.0 + 2.0 * 3.0 * 128.0 * 64.0) * 4.0);
}

/// A training layout of `tiny`: the mesh, Megatron SP on the tp axis, and the ZeRO stage.
struct TrainingLayout {
    mesh: &'static str,
    sequence_parallel: bool,
    zero_stage: u8,
}

/// Every training strategy that has landed, at degree 2 (and dp with tp).
const TRAINING_LAYOUTS: [TrainingLayout; 9] = [
    TrainingLayout { mesh: "tp=2", sequence_parallel: false, zero_stage: 0 },
    TrainingLayout { mesh: "tp=2", sequence_parallel: true, zero_stage: 0 },
    TrainingLayout { mesh: "dp=2", sequence_parallel: false, zero_stage: 0 },
    TrainingLayout { mesh: "dp=2", sequence_parallel: false, zero_stage: 1 },
    TrainingLayout { mesh: "dp=2", sequence_parallel: false, zero_stage: 2 },
    TrainingLayout { mesh: "dp=2", sequence_parallel: false, zero_stage: 3 },
    TrainingLayout { mesh: "tsp=2", sequence_parallel: false, zero_stage: 0 },
    TrainingLayout { mesh: "cp=2", sequence_parallel: false, zero_stage: 0 },
    TrainingLayout { mesh: "dp=2,tp=2", sequence_parallel: false, zero_stage: 0 },
];

/// Builds, differentiates, shards and lowers `tiny`'s training step for `layout`, as `pleat train`
/// does without pipelining: one program and one optimizer layout a rank.
fn compile_training(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &TrainingLayout,
) -> (Vec<pleat_backend::Program>, Vec<OptimizerLayout>) {
    let mut module = pleat_ir::model::build_training(config, BATCH, SEQ).expect("build");
    module.mesh = Mesh::parse(layout.mesh).expect("mesh");
    let ctx =
        PassCtx { sequence_parallel: layout.sequence_parallel, zero_stage: layout.zero_stage, ..PassCtx::default() };
    pleat_passes::run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &ctx)
        .unwrap_or_else(|err| panic!("{}: {err}", layout.mesh));
    let programs = pleat_backend::lower(&module).expect("lower");
    pleat_backend::verify_collectives(&programs).expect("collectives match");
    let layouts = (0..programs.len() as u32)
        .map(|rank| optimizer_layout(&module, rank, layout.zero_stage).expect("optimizer layout"))
        .collect();
    (programs, layouts)
}

#[test]
fn planner_peak_equals_the_measured_training_peak() {
    // What each side counts. The executor's `peak_bytes` of a step is the most bytes its program
    // held at once (resident parameter blocks, token ids and positions, activations, gradients,
    // and the staging copies of collectives while they run, 4 bytes an element) plus the AdamW
    // moments the rank keeps (8 bytes an updated element). The planner covers the program's
    // buffers and staging only, so the moments are the one named term added to its side. The
    // optimizer step runs after the program, outside the measured peak (its ZeRO all-gather
    // writes into the resident block in place), so it is no term of either side.
    let config = preset("tiny").unwrap();
    let weights = SeededWeights::new(3);
    let tokens = common::tokens(BATCH, SEQ, config.vocab_size);
    let positions: Vec<u32> = (0..SEQ as u32).collect();
    let batches = |_step: u32| tokens.clone();
    let adamw = AdamWSettings {
        learning_rate: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: None,
    };
    for layout in &TRAINING_LAYOUTS {
        let label = format!("{} sp={} zero={}", layout.mesh, layout.sequence_parallel, layout.zero_stage);
        let (programs, optimizer_layouts) = compile_training(&config, layout);
        let options = TrainOptions {
            steps: 1,
            adamw,
            batches: &batches,
            positions: &positions,
            initial: &weights,
            moments: None,
            start_step: 0,
            timeout: Duration::from_secs(60),
        };
        let trained = train_on_threads(&programs, &optimizer_layouts, &options).expect("train");
        for ((program, optimizer), rank) in programs.iter().zip(&optimizer_layouts).zip(&trained) {
            assert_eq!(rank.rank, program.rank);
            let planned = plan(program, ElementSize::Fixed(4));
            let moments = 8 * optimizer.updated_elements();
            assert_eq!(rank.optimizer_bytes, moments, "{label} rank {}: moments", program.rank);
            let predicted = planned.peak_bytes + moments;
            let measured = rank.peak_bytes;
            let error = (predicted as f64 - measured as f64).abs() / measured as f64;
            assert!(error <= TOLERANCE, "{label} rank {}: planned {predicted} measured {measured}", program.rank);
            assert_eq!(predicted, measured, "{label} rank {}: to the byte", program.rank);
        }
    }
}

/// The training layouts of the closed-form cross-check: tp at 2 and 4, with and without Megatron SP,
/// dp and cp. (tsp and dp with tp peak elsewhere in the step; `compiled_training_peak` does not
/// model them.)
const TRAINING_CROSS_CHECK: [(&str, bool); 6] =
    [("tp=2", false), ("tp=4", false), ("tp=2", true), ("tp=4", true), ("dp=2", false), ("cp=2", false)];

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak() {
    let config = preset("tiny").unwrap();
    let model = ModelShape::from_config(&config);
    assert_eq!(model.dtype_bytes, 4);
    for (mesh, sequence_parallel) in TRAINING_CROSS_CHECK {
        let training = TrainingLayout { mesh, sequence_parallel, zero_stage: 0 };
        let (programs, optimizer_layouts) = compile_training(&config, &training);
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), sequence_parallel);
        let workload =
            Workload { tsp_shards_embeddings: true, ..Workload::training(SEQ, BATCH / layout.degree(AxisName::Dp)) };
        let label = format!("{layout}");
        let memory = &memory_per_stage(&model, &layout, &workload)[0];
        let phase = compiled_training_peak(&model, &layout, &workload);
        let differences = training_differences_from_closed_form(memory, &phase);
        // The closed form counts the program's weights and gradients to the byte.
        let otherwise = differences.iter().find(|term| term.name.contains("counts otherwise")).unwrap();
        assert_eq!(otherwise.bytes, 0.0, "{label}");
        let predicted = memory.peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
        for (program, optimizer) in programs.iter().zip(&optimizer_layouts) {
            let planned = plan(program, ElementSize::Fixed(4));
            assert_eq!(planned.param_bytes as f64, phase.params, "{label} rank {}", program.rank);
            // The closed form's optimizer state is the executor's moments (an f32 model needs no
            // master copy): the term removed from the closed form is the one added to the planner.
            assert_eq!(memory.optimizer_bytes, (8 * optimizer.updated_elements()) as f64, "{label}");
            assert_eq!(
                planned.peak_bytes as f64, predicted,
                "{label} rank {}: planner {} vs closed form {} + {differences:?}",
                program.rank, planned.peak_bytes, memory.peak_bytes
            );
        }
    }
}
