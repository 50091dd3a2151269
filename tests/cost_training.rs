//! The memory planner against the executor and the closed form, for training steps of `tiny`.
//!
//! (Zero bubble: ZB-H1 runs a due `W` right after its `B`, before the next forward. Several
//! forward points the sweeps below found while it ran that forward first no longer peak on their
//! layouts; they stay modelled, and those stages stay exact.)
//!
//! For the training step on tp=2, tp=2 with Megatron SP, dp=2 with ZeRO 0 to 3, tsp=2, cp=2,
//! dp=2×tp=2 (with and without SP, ZeRO 0, 2 and 3), each also with selective and with full
//! recomputation, and for pipelined steps (a four-layer `tiny` on pp=2 and pp=4 under GPipe and
//! 1F1B with 2 and 4 micro-batches, pp=2 with tp, tp with Megatron SP, tsp, cp, dp with ZeRO 0
//! and 2, selective and full recomputation, and the interleaved and zero-bubble H1 schedules),
//! the planner's peak of each rank's program plus the rank's AdamW moments (8 bytes an updated
//! element, the one term the executor counts beside the program) equals the measured peak of one
//! step to the byte. The closed-form training peak plus
//! the named terms of `cost::compiled_training` equals the planner's peak for tp (2, 4, with and
//! without SP), dp (2, 4), cp, dp×tp, ZeRO 1 to 3 (dp 2 and 4, and ZeRO-2 and 3 beside tp with
//! and without SP), selective and full recomputation, with the embedding untied and tied, for
//! `tiny-moe` (with and without its load-balancing loss: one rank, tp with and without SP, dp, cp,
//! dp×tp, ZeRO 2 and 3, ep, dp×ep, ep×tp, ep×cp, each recompute, 8 to 256 tokens a sequence,
//! where a mixture's backward peaks; and with a Qwen2-MoE shared expert of several widths, on 8 to
//! 512, where the shared expert's own backward peaks), with Qwen2's q, k and v biases (dense
//! `tiny` and the Qwen2-MoE fixture, 8 to 512 tokens), and tsp=2 and tsp=4 on every rank (from 16 to 512 tokens, each recompute,
//! full recompute's attention backward included); dp×tp's peak is traced to tp's buffers (the
//! embedding gradient is sliced before it is reduced over dp); one pipelined stage's peak is worked out by hand from its buffers; and the
//! closed form of a pipelined stage (`cost::compiled_pipeline`, and the terms by which the cost
//! model's stage peak differs from it) equals the planner on every stage of pp=2 and pp=4, alone
//! and by dp=2, cp=2 or tp=2 (with and without SP), each recomputation, GPipe and 1F1B, 2 and 4
//! micro-batches, and beside dp and cp also on 32 to 256 tokens a sequence, where the head of a
//! backward and the first layer's peak; with the embedding tied too (by hand on one stage); and
//! for `tiny-moe`'s stages, with and without a shared expert (and tied), on 8 tokens a sequence,
//! and on 64 to 1024 beside dp, cp, ep and tp outside zero bubble, where a mixture's stage peaks
//! inside a backward (under zero bubble below the planner on 1 stage in 100, never above), and on
//! tsp beside pp with the experts split over tsp or over ep beside it; and where ZeRO-2 and 3
//! keep q, k and v, a mixture's router and experts, or the vocabulary tables whole, or split them
//! over some of their replicas.

mod common;

use std::time::Duration;

use pleat_backend::bucket::bucket_gradient_reductions;
use pleat_backend::memory::{live_before, plan, ElementSize};
use pleat_backend::optimizer::{optimizer_layout, pipelined_optimizer_layout, OptimizerLayout};
use pleat_backend::pipeline::{
    gather_params_on_each_stage, pipeline_programs, schedule_steps, stage_of_nodes, PipelinePlan,
};
use pleat_backend::Instr;
use pleat_ir::model::preset::preset;
use pleat_ir::{AxisName, Mesh};
use pleat_passes::autodiff::Recompute;
use pleat_passes::cost::comm::Collective;
use pleat_passes::cost::compiled_pipeline::{
    compiled_stage_peak, pipelined_differences_from_closed_form, TIED_HEAD_PART, TIED_HEAD_PARTS_TAKEN_AHEAD,
    TIED_TABLE_RECEIVED, TIED_TABLE_RECEIVED_BEYOND_SHARD,
};
use pleat_passes::cost::compiled_training::{
    compiled_training_peak, compiled_tsp_training_peak, optimizer_kept_whole, training_differences_from_closed_form,
    GRADS_KEPT_WHOLE, OPTIMIZER_KEPT_WHOLE, PARAMS_KEPT_WHOLE, TIED_HEAD_GRADIENT, TSP_SHARD_SLICED_BEFORE_DP,
};
use pleat_passes::cost::memory::memory_per_stage;
use pleat_passes::cost::volume::layer_collectives;
use pleat_passes::cost::{Layout, ModelShape, Recompute as CostRecompute, Workload};
use pleat_passes::pipeline::{Schedule, ScheduleKind};
use pleat_passes::PassCtx;
use pleat_runtime::train::{train_on_threads, AdamWSettings, RankTraining, TrainOptions};
use pleat_runtime::weights::SeededWeights;

/// Sequences a step of the unpipelined layouts, and tokens a sequence.
const BATCH: u64 = 2;
const SEQ: u64 = 8;

/// The tolerance the issue sets; the planner in fact matches to the byte.
const TOLERANCE: f64 = 0.01;

/// A training layout of `tiny`: the mesh, Megatron SP on the tp axis, the ZeRO stage and what the
/// backward recomputes.
struct TrainingLayout {
    mesh: &'static str,
    sequence_parallel: bool,
    zero_stage: u8,
    recompute: Recompute,
}

impl TrainingLayout {
    const fn new(mesh: &'static str, sequence_parallel: bool, zero_stage: u8) -> TrainingLayout {
        TrainingLayout { mesh, sequence_parallel, zero_stage, recompute: Recompute::None }
    }

    const fn recomputing(mesh: &'static str, sequence_parallel: bool, recompute: Recompute) -> TrainingLayout {
        TrainingLayout { mesh, sequence_parallel, zero_stage: 0, recompute }
    }
}

/// Every training strategy that has landed, at degree 2 (and dp with tp).
const TRAINING_LAYOUTS: [TrainingLayout; 13] = [
    TrainingLayout::new("tp=2", false, 0),
    TrainingLayout::new("tp=2", true, 0),
    TrainingLayout::new("dp=2", false, 0),
    TrainingLayout::new("dp=2", false, 1),
    TrainingLayout::new("dp=2", false, 2),
    TrainingLayout::new("dp=2", false, 3),
    TrainingLayout::new("tsp=2", false, 0),
    TrainingLayout::new("cp=2", false, 0),
    TrainingLayout::new("dp=2,tp=2", false, 0),
    TrainingLayout::new("dp=2,tp=2", false, 2),
    TrainingLayout::new("dp=2,tp=2", false, 3),
    TrainingLayout::new("dp=2,tp=2", true, 2),
    TrainingLayout::new("dp=2,tp=2", true, 3),
];

/// Builds, differentiates, shards and lowers `tiny`'s training step of `batch` sequences for
/// `layout`, as `pleat train` does without pipelining: one program and one optimizer layout a rank.
fn compile_training(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &TrainingLayout,
    batch: u64,
) -> (Vec<pleat_backend::Program>, Vec<OptimizerLayout>) {
    compile_training_at(config, layout, batch, SEQ)
}

/// As `compile_training`, with sequences of `seq` tokens.
fn compile_training_at(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &TrainingLayout,
    batch: u64,
    seq: u64,
) -> (Vec<pleat_backend::Program>, Vec<OptimizerLayout>) {
    let ctx = PassCtx {
        sequence_parallel: layout.sequence_parallel,
        zero_stage: layout.zero_stage,
        recompute: layout.recompute,
        ..PassCtx::default()
    };
    let (module, programs) = common::compile_training(config, batch, seq, layout.mesh, &ctx);
    let layouts = (0..programs.len() as u32)
        .map(|rank| optimizer_layout(&module, rank, layout.zero_stage).expect("optimizer layout"))
        .collect();
    (programs, layouts)
}

/// A pipelined training layout of `tiny` with four layers: the mesh (with its `pp` axis), the
/// schedule, the sequences and micro-batches a step, what the backward recomputes, Megatron SP on
/// the tp axis and the ZeRO stage.
struct PipelinedLayout {
    mesh: &'static str,
    schedule: ScheduleKind,
    batch: u64,
    micro_batches: u32,
    recompute: Recompute,
    sequence_parallel: bool,
    zero_stage: u8,
}

impl PipelinedLayout {
    /// `PIPELINE_BATCH` sequences a step; no recomputation, SP or ZeRO.
    const fn new(mesh: &'static str, schedule: ScheduleKind, micro_batches: u32) -> PipelinedLayout {
        PipelinedLayout {
            mesh,
            schedule,
            batch: PIPELINE_BATCH,
            micro_batches,
            recompute: Recompute::None,
            sequence_parallel: false,
            zero_stage: 0,
        }
    }

    /// One sequence a micro-batch on each dp (and ep) rank of `mesh` (dp at 4 and 8 with ZeRO,
    /// where `PIPELINE_BATCH` would not divide), with ZeRO's `zero_stage`, `recompute` and SP.
    fn one_sequence_a_micro_batch(
        mesh: &'static str,
        schedule: ScheduleKind,
        micro_batches: u32,
        zero_stage: u8,
        recompute: Recompute,
        sequence_parallel: bool,
    ) -> PipelinedLayout {
        let parsed = Mesh::parse(mesh).unwrap();
        let batch_split = parsed.degree(AxisName::Dp) * parsed.degree(AxisName::Ep);
        PipelinedLayout {
            zero_stage,
            recompute,
            sequence_parallel,
            batch: batch_split * u64::from(micro_batches),
            ..PipelinedLayout::new(mesh, schedule, micro_batches)
        }
    }
}

/// `tiny` with four layers, so that pp=4 has a layer a stage.
fn four_layers() -> pleat_ir::model::config::ModelConfig {
    pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny").unwrap() }
}

/// [`four_layers`], the same with a vocabulary of 2048 (its LM head outweighs a layer), and with
/// its embedding tied to the head: the models the tables on more tokens compile.
fn four_layers_wide_and_tied(
) -> (pleat_ir::model::config::ModelConfig, pleat_ir::model::config::ModelConfig, pleat_ir::model::config::ModelConfig)
{
    let four = four_layers();
    let wide_vocabulary = pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..four.clone() };
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four.clone() };
    (four, wide_vocabulary, tied)
}

/// `tiny` with eight layers: several a stage or an interleaved chunk.
fn eight_layers() -> pleat_ir::model::config::ModelConfig {
    pleat_ir::model::config::ModelConfig { num_layers: 8, ..preset("tiny").unwrap() }
}

/// Compiles `config`'s training step for `layout` as `pleat run --train` does with a `pp` axis:
/// one micro-batch's graph (the layout's batch / micro-batches sequences) sharded over the mesh inside
/// a stage, each node placed in a stage by its layer, and `backend::pipeline` replaying each
/// stage's part in the schedule's order. Returns the programs in global rank order and their optimizer layouts.
fn compile_pipelined(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &PipelinedLayout,
) -> (Vec<pleat_backend::Program>, Vec<OptimizerLayout>) {
    compile_pipelined_at(config, layout, SEQ)
}

/// As `compile_pipelined`, with sequences of `seq` tokens.
fn compile_pipelined_at(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &PipelinedLayout,
    seq: u64,
) -> (Vec<pleat_backend::Program>, Vec<OptimizerLayout>) {
    let mesh = Mesh::parse(layout.mesh).expect("mesh");
    let stages = mesh.degree(AxisName::Pp) as u32;
    let inner: Vec<(AxisName, u64)> =
        mesh.axes().iter().filter(|axis| axis.name != AxisName::Pp).map(|axis| (axis.name, axis.size)).collect();
    let mut module =
        pleat_ir::model::build_training(config, layout.batch / u64::from(layout.micro_batches), seq).expect("build");
    module.mesh = Mesh::new(&inner).expect("inner mesh");
    let ctx = PassCtx {
        recompute: layout.recompute,
        sequence_parallel: layout.sequence_parallel,
        zero_stage: layout.zero_stage,
        ..PassCtx::default()
    };
    pleat_passes::run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &ctx)
        .unwrap_or_else(|err| panic!("{}: {err}", layout.mesh));
    // Interleaved: `chunks` virtual stages a rank, a layer each at least.
    let chunks = layout.schedule.chunks();
    let mut stage_of = stage_of_nodes(&module, stages * chunks, None, config.num_layers).expect("stages");
    if gather_params_on_each_stage(&mut module, &stage_of) > 0 {
        stage_of = stage_of_nodes(&module, stages * chunks, None, config.num_layers).expect("stages");
    }
    let schedule = schedule_steps(&Schedule::build(layout.schedule, stages, layout.micro_batches).expect("schedule"));
    let plan = PipelinePlan { stage_of: &stage_of, schedule: &schedule, micro_batches: layout.micro_batches, chunks };
    let programs = pipeline_programs(&module, &plan).expect("pipeline programs");
    pleat_backend::verify_collectives(&programs).expect("collectives match");
    // Each rank updates the parameters its stage loads (its dp share of them under ZeRO).
    let world_size = programs.len() as u32;
    let layouts = programs
        .iter()
        .map(|program| pipelined_optimizer_layout(&module, program, world_size, layout.zero_stage).expect("layout"))
        .collect();
    (programs, layouts)
}

/// One step of `programs` (`batch` sequences) on threads, with plain AdamW from seeded weights.
fn train_one_step(programs: &[pleat_backend::Program], layouts: &[OptimizerLayout], batch: u64) -> Vec<RankTraining> {
    train_steps(programs, layouts, batch, 1)
}

/// `steps` steps of `programs`, as [`train_one_step`] runs one.
fn train_steps(
    programs: &[pleat_backend::Program],
    layouts: &[OptimizerLayout],
    batch: u64,
    steps: u32,
) -> Vec<RankTraining> {
    let config = preset("tiny").unwrap();
    let weights = SeededWeights::new(3);
    let tokens = common::tokens(batch, SEQ, config.vocab_size);
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
    let options = TrainOptions {
        steps,
        adamw,
        batches: &batches,
        positions: &positions,
        initial: &weights,
        moments: None,
        start_step: 0,
        timeout: Duration::from_secs(60),
        link: None,
        native: &[],
        on_step: None,
    };
    train_on_threads(programs, layouts, &options).expect("train")
}

#[test]
fn a_trainings_last_step_is_timed_after_its_first() {
    // A GPU run reports the last step's times (warm), a trace the first step's: over two steps,
    // each instruction's last span starts after the first step's program has ended.
    let (programs, layouts) = compile_training(&preset("tiny").unwrap(), &TRAINING_LAYOUTS[0], BATCH);
    for (program, rank) in programs.iter().zip(train_steps(&programs, &layouts, BATCH, 2)) {
        assert_eq!(rank.first_timings.len(), program.instructions.len());
        assert_eq!(rank.last_timings.len(), program.instructions.len());
        let first_end = rank.first_timings.iter().map(|&(_, end)| end).max().unwrap();
        assert!(rank.last_timings.iter().all(|&(start, _)| start >= first_end), "rank {}", rank.rank);
    }
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
    for layout in TRAINING_LAYOUTS.iter().chain(&RECOMPUTE_LAYOUTS) {
        let label = format!(
            "{} sp={} zero={} recompute={:?}",
            layout.mesh, layout.sequence_parallel, layout.zero_stage, layout.recompute
        );
        let (programs, optimizer_layouts) = compile_training(&config, layout, BATCH);
        let trained = train_one_step(&programs, &optimizer_layouts, BATCH);
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

#[test]
fn zero_shards_a_mixtures_dense_state_over_dp_and_ep_in_the_executor_and_the_cost_model() {
    // ep splits the batch as dp does, so a mixture's dense parameters (attention, norms, router,
    // embedding) have dp·ep replicas and its experts dp: ZeRO shards each over its replicas
    // (DeepSpeed-MoE's layout). On dp=2 × ep=2 at ZeRO-1, dp alone would leave 1,452,544 bytes of
    // moments; dp × ep leaves 1,119,488.
    let config = preset("tiny-moe").unwrap();
    // Beside tp, tiny-moe's k and v (4 kv heads) have 2 rows a rank: dp=2 × ep=2 splits them over
    // dp (one row left) and then over ep on head_dim, but dp=4 leaves them whole, 2 layers × 2 ×
    // 3,072 f32 elements beyond the closed form's shards, whose state the closed form names
    // (`OPTIMIZER_KEPT_WHOLE`): 8 bytes each, 98,304.
    let layouts = [
        ("dp=2,ep=2", 1),
        ("dp=2,ep=2", 2),
        ("dp=2,ep=2", 3),
        ("ep=2", 3),
        ("ep=4", 2),
        ("dp=2,ep=2,tp=2", 2),
        ("dp=2,ep=2,tp=2", 3),
        ("dp=4,tp=2", 1),
    ];
    for (mesh, zero) in layouts {
        let (memory, kept_whole) = check_zero_state(&config, mesh, zero, 16);
        if mesh == "dp=2,ep=2" && zero == 1 {
            assert_eq!(memory.optimizer_bytes, 1_119_488.0);
        }
        assert_eq!(kept_whole.bytes, if mesh == "dp=4,tp=2" { 98_304.0 } else { 0.0 }, "{mesh}");
    }
}

#[test]
fn zero_shards_the_state_over_dp_and_cp_in_the_executor_and_the_cost_model() {
    // cp's ranks hold the same weights and sum their gradients, so ZeRO shards over dp × cp, as
    // Megatron's distributed optimizer does (and over cp alone). tiny's 361,088 parameters at
    // dp=2 × cp=2, ZeRO-1: 8 bytes of moments each over 4 ranks, 722,176 bytes (over dp alone
    // 1,444,352).
    let config = preset("tiny").unwrap();
    for (mesh, zero) in [("dp=2,cp=2", 1), ("dp=2,cp=2", 2), ("dp=2,cp=2", 3), ("cp=2", 2), ("cp=4", 3)] {
        let (memory, kept_whole) = check_zero_state(&config, mesh, zero, 1);
        if mesh == "dp=2,cp=2" && zero == 1 {
            assert_eq!(memory.optimizer_bytes, 722_176.0);
        }
        assert_eq!(kept_whole.bytes, 0.0, "{mesh}");
    }
}

/// Trains `config` one step on `mesh` under ZeRO `zero` and checks the executor against the cost
/// model on every rank: its moments are the cost model's optimizer state (with what ZeRO keeps
/// whole, `OPTIMIZER_KEPT_WHOLE`), its ZeRO-3 parameter blocks the cost model's, the planner plus
/// the moments its measured peak, and under ZeRO-2 and 3 no all-reduce but of at most
/// `all_reduced` elements (the loss, a mixture's routing statistics), every gradient being
/// reduce-scattered, unless tp's activations are all-reduced too. Returns the cost model's memory
/// and the optimizer state it names beyond its shards.
fn check_zero_state(
    config: &pleat_ir::model::config::ModelConfig,
    mesh: &'static str,
    zero: u8,
    all_reduced: u64,
) -> (pleat_passes::cost::memory::MemoryBreakdown, pleat_passes::cost::memory::Term) {
    let model = ModelShape::from_config(config);
    let batch = 4;
    let (programs, optimizer_layouts) = compile_training(config, &TrainingLayout::new(mesh, false, zero), batch);
    let trained = train_one_step(&programs, &optimizer_layouts, batch);
    let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
    let workload =
        Workload { zero, tsp_shards_embeddings: true, ..Workload::training(SEQ, batch / layout.batch_split()) };
    let memory = memory_per_stage(&model, &layout, &workload).remove(0);
    let kept_whole = optimizer_kept_whole(&model, &layout, &workload);
    assert_eq!(kept_whole.name, OPTIMIZER_KEPT_WHOLE);
    for ((program, optimizer), rank) in programs.iter().zip(&optimizer_layouts).zip(&trained) {
        let label = format!("{mesh} zero={zero} rank {}", program.rank);
        let planned = plan(program, ElementSize::Fixed(4));
        assert_eq!(rank.optimizer_bytes, 8 * optimizer.updated_elements(), "{label}");
        assert_eq!(rank.optimizer_bytes as f64, memory.optimizer_bytes + kept_whole.bytes, "{label}: moments");
        if zero == 3 {
            assert_eq!(planned.param_bytes as f64, memory.params_bytes, "{label}: parameters");
        }
        assert_eq!(planned.peak_bytes + rank.optimizer_bytes, rank.peak_bytes, "{label}: peak");
        let largest = program.instructions.iter().filter_map(|instr| match instr {
            Instr::AllReduce { inputs, .. } => Some(inputs.iter().map(|&id| program.buffer(id).numel()).sum::<u64>()),
            _ => None,
        });
        // (Beside tp its activations are all-reduced too, and k's and v's gradients where their
        // rows do not divide.)
        if zero >= 2 && !mesh.contains("tp") {
            assert!(largest.max().unwrap_or(0) <= all_reduced, "{label}");
        }
    }
    (memory, kept_whole)
}

#[test]
fn planner_peak_equals_the_measured_peak_with_gradient_buckets() {
    // Bucketed, a gradient's operand stays live until its bucket's last gradient, and the bucket
    // packs its operands while it runs (`Staging::Bucket`); the planner and the executor count
    // both, so they still agree to the byte. Caps of 256 KiB (several buckets) and 25 MiB (one).
    // ZeRO-2 and 3 bucket their reduce-scatters, which stage their operands as one alone does.
    let config = preset("tiny").unwrap();
    for (mesh, zero) in [("dp=2", 0), ("dp=4", 0), ("dp=2,tp=2", 0), ("dp=2", 2), ("dp=4", 3)] {
        let layout = TrainingLayout::new(mesh, false, zero);
        let (programs, optimizer_layouts) = compile_training(&config, &layout, 4);
        let all_reduces = |program: &pleat_backend::Program| {
            let reduction = |instr: &&Instr| matches!(instr, Instr::AllReduce { .. } | Instr::ReduceScatter { .. });
            program.instructions.iter().filter(reduction).count()
        };
        for cap in [256 << 10, 25 << 20] {
            let bucketed: Vec<_> = programs.iter().map(|program| bucket_gradient_reductions(program, cap)).collect();
            pleat_backend::verify_collectives(&bucketed).expect("collectives match");
            assert!(all_reduces(&bucketed[0]) < all_reduces(&programs[0]), "{mesh} zero {zero} cap {cap}: fewer");
            let trained = train_one_step(&bucketed, &optimizer_layouts, 4);
            for (program, rank) in bucketed.iter().zip(&trained) {
                let planned = plan(program, ElementSize::Fixed(4));
                let predicted = planned.peak_bytes + rank.optimizer_bytes;
                assert_eq!(predicted, rank.peak_bytes, "{mesh} zero {zero} cap {cap} rank {}", program.rank);
            }
        }
    }
}

/// Every recomputing layout that has landed: each strategy at degree 2 with selective and with full
/// recomputation.
const RECOMPUTE_LAYOUTS: [TrainingLayout; 12] = [
    TrainingLayout::recomputing("tp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("tp=2", false, Recompute::Full),
    TrainingLayout::recomputing("tp=2", true, Recompute::Selective),
    TrainingLayout::recomputing("tp=2", true, Recompute::Full),
    TrainingLayout::recomputing("dp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("dp=2", false, Recompute::Full),
    TrainingLayout::recomputing("tsp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("tsp=2", false, Recompute::Full),
    TrainingLayout::recomputing("cp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("cp=2", false, Recompute::Full),
    TrainingLayout::recomputing("dp=2,tp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("dp=2,tp=2", false, Recompute::Full),
];

/// Sequences a step of the pipelined layouts: four, so that 2 and 4 micro-batches divide it.
const PIPELINE_BATCH: u64 = 4;

/// The pipelined layouts: pp=2 and pp=4 under GPipe and 1F1B with 2 and 4 micro-batches, pp=2
/// with tp, tp with Megatron SP, tsp, cp, dp with ZeRO 0 and 2, and with selective and full
/// recomputation, ZeRO-3 under full recomputation, ZeRO-2 beside dp × tp and dp × cp, and the
/// interleaved (pp=2, two chunks a rank) and zero-bubble H1 (pp=2, pp=4, pp=2 by tp=2; pp=2 under
/// full recomputation) schedules.
fn pipelined_layouts() -> Vec<PipelinedLayout> {
    let mut layouts = Vec::new();
    for mesh in ["pp=2", "pp=4"] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for micro_batches in [2, 4] {
                layouts.push(PipelinedLayout::new(mesh, schedule, micro_batches));
            }
        }
    }
    let one_f_one_b = |mesh| PipelinedLayout::new(mesh, ScheduleKind::OneFOneB, 2);
    for mesh in ["pp=2,tp=2", "pp=2,tsp=2", "pp=2,cp=2", "pp=2,dp=2"] {
        layouts.push(one_f_one_b(mesh));
    }
    layouts.push(PipelinedLayout { sequence_parallel: true, ..one_f_one_b("pp=2,tp=2") });
    layouts.push(PipelinedLayout { zero_stage: 2, ..one_f_one_b("pp=2,dp=2") });
    layouts.push(PipelinedLayout { recompute: Recompute::Selective, ..one_f_one_b("pp=2") });
    layouts.push(PipelinedLayout { recompute: Recompute::Full, ..one_f_one_b("pp=2") });
    // Interleaved (two chunks a rank) and zero-bubble (the weight gradients deferred).
    layouts.push(PipelinedLayout::new("pp=2", ScheduleKind::Interleaved { chunks: 2 }, 4));
    layouts.push(PipelinedLayout::new("pp=2", ScheduleKind::ZeroBubbleH1, 4));
    layouts.push(PipelinedLayout::new("pp=4", ScheduleKind::ZeroBubbleH1, 4));
    layouts.push(PipelinedLayout::new("pp=2,tp=2", ScheduleKind::ZeroBubbleH1, 2));
    // Full recomputation under zero bubble, and under ZeRO-3 (the weights gathered again).
    let zero_bubble = PipelinedLayout::new("pp=2", ScheduleKind::ZeroBubbleH1, 4);
    layouts.push(PipelinedLayout { recompute: Recompute::Full, ..zero_bubble });
    layouts.push(PipelinedLayout { recompute: Recompute::Full, zero_stage: 3, ..one_f_one_b("pp=2,dp=2") });
    layouts.push(PipelinedLayout { zero_stage: 2, ..one_f_one_b("pp=2,dp=2,tp=2") });
    layouts.push(PipelinedLayout { zero_stage: 2, ..one_f_one_b("pp=2,dp=2,cp=2") });
    layouts
}

#[test]
fn planner_peak_equals_the_measured_pipelined_peak() {
    // `backend::pipeline` already hands each rank a flat program: the stage's parameter loads, then
    // every schedule step's instructions on that micro-batch's own copies of the buffers (the
    // sends and receives between stages, the running sums of the gradients, the frees at the end
    // of each backward). The executor runs exactly that stream, so the planner is given the same
    // program and nothing else; the moments are again the one term beside it, 8 bytes an element
    // of the parameters the stage loads that the rank updates (all of them, or its dp share under
    // ZeRO).
    let config = four_layers();
    for layout in pipelined_layouts() {
        let label = format!(
            "{} {:?} m={} {:?} sp={} zero={}",
            layout.mesh,
            layout.schedule,
            layout.micro_batches,
            layout.recompute,
            layout.sequence_parallel,
            layout.zero_stage
        );
        let (programs, optimizer_layouts) = compile_pipelined(&config, &layout);
        let trained = train_one_step(&programs, &optimizer_layouts, layout.batch);
        for (program, rank) in programs.iter().zip(&trained) {
            let planned = plan(program, ElementSize::Fixed(4));
            // Without ZeRO every loaded element is updated; ZeRO-1 and 2 update the rank's dp
            // share of them, ZeRO-3 all it loads (its share).
            // (Its replicas: dp and cp, whose ranks hold the same weights.)
            let mesh = Mesh::parse(layout.mesh).unwrap();
            let replicas = mesh.degree(AxisName::Dp) * mesh.degree(AxisName::Cp);
            let share = if matches!(layout.zero_stage, 1 | 2) { replicas } else { 1 };
            assert_eq!(rank.optimizer_bytes, 2 * planned.param_bytes / share, "{label} rank {}: moments", program.rank);
            let predicted = planned.peak_bytes + rank.optimizer_bytes;
            let measured = rank.peak_bytes;
            let error = (predicted as f64 - measured as f64).abs() / measured as f64;
            assert!(error <= TOLERANCE, "{label} rank {}: planned {predicted} measured {measured}", program.rank);
            assert_eq!(predicted, measured, "{label} rank {}: to the byte", program.rank);
        }
    }
}

/// The training layouts of the closed-form cross-check: tp at 2 and 4 with and without Megatron
/// SP, dp at 2 and 4, cp, dp × tp, ZeRO 1 to 3 at dp 2 and 4, and selective and full recomputation.
/// (tsp and pipelined stages peak elsewhere in the step; `compiled_training_peak` does not model
/// them.)
const TRAINING_CROSS_CHECK: [TrainingLayout; 37] = [
    TrainingLayout::new("", false, 0),
    TrainingLayout::new("tp=2", false, 0),
    TrainingLayout::new("tp=4", false, 0),
    TrainingLayout::new("tp=2", true, 0),
    TrainingLayout::new("tp=4", true, 0),
    TrainingLayout::new("dp=2", false, 0),
    TrainingLayout::new("dp=4", false, 0),
    TrainingLayout::new("cp=2", false, 0),
    TrainingLayout::new("dp=2,tp=2", false, 0),
    TrainingLayout::new("dp=2,tp=2", false, 2),
    TrainingLayout::new("dp=2,tp=2", false, 3),
    TrainingLayout::new("dp=2,tp=2", true, 2),
    TrainingLayout::new("dp=2,tp=2", true, 3),
    TrainingLayout::new("dp=2", false, 1),
    TrainingLayout::new("dp=2", false, 2),
    TrainingLayout::new("dp=2", false, 3),
    TrainingLayout::new("dp=4", false, 1),
    TrainingLayout::new("dp=4", false, 2),
    TrainingLayout::new("dp=4", false, 3),
    TrainingLayout::recomputing("tp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("tp=2", false, Recompute::Full),
    TrainingLayout::recomputing("tp=2", true, Recompute::Full),
    TrainingLayout::recomputing("dp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("dp=2", false, Recompute::Full),
    TrainingLayout::recomputing("cp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("cp=2", false, Recompute::Full),
    TrainingLayout::recomputing("dp=2,tp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("dp=2,tp=2", false, Recompute::Full),
    // k and v keep 4/2 = 2 rows a rank at tp=2, which dp=4 leaves whole; 1 at tp=4, which dp=2
    // splits on head_dim.
    TrainingLayout::new("dp=4,tp=2", false, 1),
    TrainingLayout::new("dp=4,tp=2", false, 2),
    TrainingLayout::new("dp=4,tp=2", true, 3),
    TrainingLayout { mesh: "dp=4,tp=2", sequence_parallel: false, zero_stage: 3, recompute: Recompute::Full },
    TrainingLayout::new("dp=2,tp=4", false, 3),
    // cp's ranks hold the same weights: ZeRO shards over dp × cp, and over cp alone.
    TrainingLayout::new("dp=2,cp=2", false, 2),
    TrainingLayout::new("cp=2", false, 3),
    TrainingLayout { mesh: "dp=2,cp=2", sequence_parallel: false, zero_stage: 3, recompute: Recompute::Full },
    TrainingLayout::new("cp=2,tp=2", true, 2),
];

/// The cost model's recompute setting for the compiler's.
fn cost_recompute(recompute: Recompute) -> CostRecompute {
    match recompute {
        Recompute::None => CostRecompute::None,
        Recompute::Selective => CostRecompute::Selective,
        Recompute::Full => CostRecompute::Full,
    }
}

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak() {
    // Four sequences, so that dp=4 divides them. On 8 tokens a sequence the gradients outweigh the
    // activations and the end of the backward peaks; on 128 the head of the backward (the loss's
    // or the LM head's gradients) or, under full recomputation, a recomputed layer's backward; 32
    // lies between, where a layer's MLP backward can peak.
    let phases = check_training_closed_form(&preset("tiny").unwrap(), &TRAINING_CROSS_CHECK, &[SEQ, 32, 128]);
    // The grid reaches both ends of the backward and the layers between.
    for name in [
        "end of backward",
        "the loss's backward",
        "the LM head's weight gradient",
        "an MLP's down projection weight gradient",
        "an MLP's down projection weight gradient reduced",
        "an MLP norm output's gradient",
        "an attention kernel's backward",
    ] {
        assert!(phases.contains_key(name), "{name} not among {phases:?}");
    }
    // dp=4 × tp=2 and dp=2 × tp=4 keep k and v whole: ZeRO-2's and 3's peaks hold them so.
    for name in [GRADS_KEPT_WHOLE, PARAMS_KEPT_WHOLE] {
        assert!(phases.values().any(|terms| terms.contains(&name)), "{name} in no peak");
    }
}

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak_with_tied_embeddings() {
    // A tied table's gradient sums the LM head's part, made at the head of the backward, and the
    // embedding's, made at its end: the head's part is held between the two (whole over dp under
    // ZeRO-2 and 3, reduced with the table's gradient at the end), a named term.
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..preset("tiny").unwrap() };
    let phases = check_training_closed_form(&tied, &TRAINING_CROSS_CHECK, &[SEQ, 32, 128]);
    for name in ["end of backward", "the loss's backward", "an MLP's down projection weight gradient"] {
        assert!(phases.contains_key(name), "{name} not among {phases:?}");
    }
    assert!(phases.values().any(|terms| terms.contains(&TIED_HEAD_GRADIENT)), "{phases:?}");
}

/// Checks that the closed form plus the named terms of `compiled_training_peak` equals the
/// planner's peak on every rank of `config`'s training step, for every one of `layouts` on each of
/// `seqs` tokens a sequence; returns each peak phase's name with the names of its terms.
fn check_training_closed_form(
    config: &pleat_ir::model::config::ModelConfig,
    layouts: &[TrainingLayout],
    seqs: &[u64],
) -> std::collections::BTreeMap<&'static str, Vec<&'static str>> {
    let batch = 4;
    let model = ModelShape::from_config(config);
    assert_eq!(model.dtype_bytes, 4);
    let mut phases = std::collections::BTreeMap::new();
    for &seq in seqs {
        for training in layouts {
            let (programs, optimizer_layouts) = compile_training_at(config, training, batch, seq);
            let layout = Layout::from_mesh(&Mesh::parse(training.mesh).unwrap(), training.sequence_parallel);
            let workload = Workload {
                tsp_shards_embeddings: true,
                zero: training.zero_stage,
                recompute: cost_recompute(training.recompute),
                ..Workload::training(seq, batch / layout.batch_split())
            };
            let label = format!("{layout} seq {seq} zero={} recompute={:?}", training.zero_stage, training.recompute);
            let memory = &memory_per_stage(&model, &layout, &workload)[0];
            let phase = compiled_training_peak(&model, &layout, &workload).expect("a modelled layout");
            let named = phases.entry(phase.name).or_insert_with(Vec::new);
            named.extend(phase.terms.iter().filter(|term| term.bytes != 0.0).map(|term| term.name));
            let differences = training_differences_from_closed_form(memory, &phase);
            // The closed form counts the program's weights and gradients to the byte.
            let otherwise = differences.iter().find(|term| term.name.contains("counts otherwise")).unwrap();
            assert_eq!(otherwise.bytes, 0.0, "{label}");
            let predicted = memory.peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
            for (program, optimizer) in programs.iter().zip(&optimizer_layouts) {
                let planned = plan(program, ElementSize::Fixed(4));
                // ZeRO-3's parameters are the closed form's shards and those it keeps whole (or
                // splits over fewer replicas) beyond them.
                let kept_whole =
                    phase.terms.iter().filter(|term| term.name == PARAMS_KEPT_WHOLE).map(|term| term.bytes);
                assert_eq!(
                    planned.param_bytes as f64,
                    phase.params + kept_whole.sum::<f64>(),
                    "{label} rank {}",
                    program.rank
                );
                // The closed form's optimizer state and what ZeRO keeps whole beyond its shards are
                // the executor's moments (an f32 model needs no master copy): the term removed
                // from the closed form is the one added to the planner.
                let state = memory.optimizer_bytes + optimizer_kept_whole(&model, &layout, &workload).bytes;
                assert_eq!(state, (8 * optimizer.updated_elements()) as f64, "{label}");
                assert_eq!(
                    planned.peak_bytes as f64, predicted,
                    "{label} rank {}: planner {} vs closed form {} + {differences:?}",
                    program.rank, planned.peak_bytes, memory.peak_bytes
                );
            }
        }
    }
    phases
}

#[test]
fn training_closed_form_is_exact_where_a_sweep_found_it_above_the_planner() {
    // A sweep found the training closed form above the planner's peak, which no point of a
    // program can be, at these points; before, by how much:
    // - a mixture without the load-balancing loss or a shared expert reduces its experts' input
    //   gradient over tp (under SP reduce-scatters it) only once their and the router's weight
    //   gradients are made and reduced, their weights gathered again and the gathered output
    //   gradient freed: counting the reduction beside them was 0.8% above at dp=2 × tp=2 under
    //   SP and ZeRO-3, on 512 tokens;
    // - a tied table ZeRO keeps whole (250 rows, 125 a rank under tsp=2, over dp=2) has no
    //   finished gradient before the end of the backward (the head's part is held whole beside):
    //   counting it finished inside the MLP ring's backward was 32,000 B above under ZeRO-3;
    // - under cp the embedding's backward reads the rank's own token ids (every token's, the
    //   loss's targets, are freed by then): counting every token's was 256 B above at cp=2 × tp=4
    //   under SP with full recomputation, on two sequences of 64 tokens (here four of 32; 776 of
    //   5,835 checks of a sweep over cp were above);
    // - a norm's weight whose rows do not divide over dp is kept whole by ZeRO-3, never gathered:
    //   counting the MLP norm's gathered again for full recomputation was 400 B above with 100
    //   rows at dp=8 (here 90 at dp=4).
    let [mixture, _] = four_layer_mixtures();
    let plain = with_routed_experts(&mixture, 8, false);
    let layouts: Vec<TrainingLayout> = [Recompute::None, Recompute::Selective, Recompute::Full]
        .into_iter()
        .map(|recompute| TrainingLayout { zero_stage: 3, ..TrainingLayout::recomputing("dp=2,tp=2", true, recompute) })
        .collect();
    check_training_closed_form(&plain, &layouts, &[128, 512]);
    let context = [TrainingLayout::recomputing("cp=2,tp=4", true, Recompute::Full)];
    let phases = check_training_closed_form(&four_layers(), &context, &[32]);
    assert!(phases.contains_key("the embedding's backward"), "{phases:?}");
    let narrow = pleat_ir::model::config::ModelConfig {
        hidden_size: 90,
        num_heads: 5,
        num_kv_heads: 5,
        head_dim: 18,
        ..four_layers()
    };
    let kept_whole = [TrainingLayout { zero_stage: 3, ..TrainingLayout::recomputing("dp=4", false, Recompute::Full) }];
    let phases = check_training_closed_form(&narrow, &kept_whole, &[32, 96]);
    assert!(phases.contains_key("an MLP's down projection weight gradient reduced"), "{phases:?}");
    let tied = pleat_ir::model::config::ModelConfig { vocab_size: 250, tie_word_embeddings: true, ..four_layers() };
    for recompute in [Recompute::None, Recompute::Full] {
        for seq in [16, 128] {
            let (_, peaks) = tsp_training_peaks(&tied, "tsp=2,dp=2", 3, recompute, 4, seq);
            for (program, phase) in &peaks {
                let planned = plan(program, ElementSize::Fixed(4));
                assert_eq!(phase.bytes(), planned.peak_bytes as f64, "{recompute:?} {seq} rank {}", program.rank);
            }
        }
    }
}

#[test]
fn tsp_training_closed_form_holds_a_shared_experts_input_gradient_at_the_dispatch() {
    // Under tsp a shared expert without the load-balancing loss makes its input gradient, its own
    // buffer, before the routed experts' backward is dispatched (with the loss it joins the
    // router's from it): the form left it out there, 2.7% below the planner at tsp=2 × dp=4 under
    // ZeRO-3 with full recomputation (212 of 2,430 checks of a sweep below; none after).
    let shared = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, false) };
    let mut names = std::collections::BTreeSet::new();
    for (mesh, zero) in [("tsp=2,dp=4", 3), ("tsp=2", 0)] {
        let (_, peaks) = tsp_training_peaks(&shared, mesh, zero, Recompute::Full, 8, 128);
        for (program, phase) in &peaks {
            let planned = plan(program, ElementSize::Fixed(4));
            assert_eq!(phase.bytes(), planned.peak_bytes as f64, "{mesh} rank {}", program.rank);
            names.insert(phase.name);
        }
    }
    assert!(names.contains("a mixture's experts' backward dispatched"), "{names:?}");
}

#[test]
fn training_closed_form_is_exact_where_a_sweep_found_it_below_the_planner() {
    // Three points a sweep found the training step peaking at, below the form before it modelled
    // them: under ZeRO-2 and 3 an untied LM head's weight gradient is reduce-scattered as soon as
    // it is made, staged whole, beside every layer's kept activations (with a vocabulary of 2048
    // at dp=4 the form was 10% below); beside dp up's weight gradient is reduced after the down
    // projection's, gate's output gradient and up's input gradient live (2.0% below at dp=2 ×
    // tp=4 on 16 tokens); and o's is reduced before the attention kernel's backward, q, k and v
    // live (a mixture's first layer at dp=4 × ep=4 under ZeRO-3 with full recomputation: 3.5%
    // below; six experts at dp=4: 0.9%).
    let (tiny, wide, _) = four_layers_wide_and_tied();
    let six = with_routed_experts(&four_layer_mixtures()[0], 6, true);
    let cases = [
        (&wide, "dp=4", "the LM head's weight gradient reduce-scattered", 64),
        (&tiny, "dp=2,tp=4", "an MLP's up projection weight gradient reduced", 16),
        (&six, "dp=4", "an output projection's weight gradient reduced", 32),
    ];
    for (config, mesh, point, seq) in cases {
        let layouts: Vec<TrainingLayout> = [(2, Recompute::None), (3, Recompute::None), (3, Recompute::Full)]
            .into_iter()
            .map(|(zero_stage, recompute)| TrainingLayout {
                zero_stage,
                ..TrainingLayout::recomputing(mesh, false, recompute)
            })
            .collect();
        let phases = check_training_closed_form(config, &layouts, &[seq]);
        assert!(phases.contains_key(point), "{mesh}: {point} is never the peak: {phases:?}");
    }
    // And under ZeRO-3 and SP: gate's input gradient, made after up's, beside gate's weight
    // gathered again for it (0.9% below with a tied table at dp=2 × tp=4, on 24 tokens); o's
    // weight gradient made, attention's output and the attention residual's gradient gathered
    // over tp still live (0.9% below with six experts at dp=2 × ep=2 × tp=2 on 96 tokens).
    let (_, _, tied) = four_layers_wide_and_tied();
    let cases = [
        (&tied, "dp=2,tp=4", Recompute::Selective, 24, "an MLP's gate input gradient, its weight gathered again"),
        (&six, "dp=2,ep=2,tp=2", Recompute::Full, 96, "an output projection's weight gradient made"),
    ];
    for (config, mesh, recompute, seq, point) in cases {
        let sequence_parallel =
            [TrainingLayout { zero_stage: 3, ..TrainingLayout::recomputing(mesh, true, recompute) }];
        let phases = check_training_closed_form(config, &sequence_parallel, &[seq]);
        assert!(phases.contains_key(point), "{mesh}: {point} is never the peak: {phases:?}");
    }
}

#[test]
fn training_closed_form_never_exceeds_the_planners_peak() {
    // Every phase of the closed form is the live set at one point of the program, so on shapes
    // whose peak falls at a point it does not model (few tokens beside a narrow MLP or a large
    // vocabulary, where dp's gradient reductions or a layer's q projection peak) it is below the
    // planner's peak, never above: checked here on six shapes (one with a tied embedding, two
    // mixtures of experts, one with a shared expert), each recomputation, from 8 to 256 tokens a
    // sequence.
    let tiny = preset("tiny").unwrap();
    let shapes = [
        pleat_ir::model::config::ModelConfig { intermediate_size: 64, vocab_size: 64, num_layers: 3, ..tiny.clone() },
        pleat_ir::model::config::ModelConfig { intermediate_size: 512, vocab_size: 128, ..tiny.clone() },
        pleat_ir::model::config::ModelConfig { intermediate_size: 128, vocab_size: 512, num_layers: 3, ..tiny.clone() },
        pleat_ir::model::config::ModelConfig {
            intermediate_size: 64,
            vocab_size: 64,
            num_layers: 3,
            tie_word_embeddings: true,
            ..tiny.clone()
        },
        pleat_ir::model::config::ModelConfig { num_layers: 3, ..preset("tiny-moe").unwrap() },
        pleat_ir::model::config::ModelConfig { num_layers: 3, ..with_a_shared_expert(96, true) },
    ];
    let layouts = [
        ("", false, 0),
        ("tp=2", true, 0),
        ("dp=2", false, 2),
        ("cp=2", false, 0),
        ("dp=2,tp=2", true, 3),
        ("cp=2,tp=2", true, 0),
    ];
    let (mut below, mut equal) = (0, 0);
    for config in &shapes {
        let model = ModelShape::from_config(config);
        for (mesh, sequence_parallel, zero_stage) in layouts {
            for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                for seq in [8, 24, 256] {
                    let training = TrainingLayout {
                        zero_stage,
                        ..TrainingLayout::recomputing(mesh, sequence_parallel, recompute)
                    };
                    let (programs, _) = compile_training_at(config, &training, 4, seq);
                    let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), sequence_parallel);
                    let workload = Workload {
                        tsp_shards_embeddings: true,
                        zero: zero_stage,
                        recompute: cost_recompute(recompute),
                        ..Workload::training(seq, 4 / layout.degree(AxisName::Dp))
                    };
                    let phase = compiled_training_peak(&model, &layout, &workload).expect("a modelled layout");
                    let planned = plan(&programs[0], ElementSize::Fixed(4)).peak_bytes as f64;
                    let label = format!(
                        "ffn {} vocab {} {layout} seq {seq} {recompute:?} zero={zero_stage}",
                        config.intermediate_size, config.vocab_size
                    );
                    assert!(
                        phase.bytes() <= planned,
                        "{label}: closed form {} ({}) above the planner's {planned}",
                        phase.bytes(),
                        phase.name
                    );
                    if phase.bytes() == planned {
                        equal += 1;
                    } else {
                        below += 1;
                    }
                }
            }
        }
    }
    // Most of them are exact even so; some are not (or the check would be idle).
    assert!(equal > below && below > 0, "{equal} exact, {below} below");
}

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak_for_experts() {
    // tiny-moe's training step (with its load-balancing loss) peaks at the end of the backward as
    // a dense model's does: the routed experts' gradients are among the gradients, ep splits the
    // batch as dp does, and the whole-vocabulary embedding gradient is all-reduced over ep.
    let config = preset("tiny-moe").unwrap();
    let model = ModelShape::from_config(&config);
    for mesh in ["", "ep=2", "ep=4", "dp=2,ep=2", "tp=2", "ep=2,tp=2"] {
        let (programs, _) = compile_training(&config, &TrainingLayout::new(mesh, false, 0), 4);
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
        let workload = Workload { tsp_shards_embeddings: true, ..Workload::training(SEQ, 4 / layout.batch_split()) };
        let memory = &memory_per_stage(&model, &layout, &workload)[0];
        let phase = compiled_training_peak(&model, &layout, &workload).expect("a modelled layout");
        let differences = training_differences_from_closed_form(memory, &phase);
        let otherwise = differences.iter().find(|term| term.name.contains("counts otherwise")).unwrap();
        assert_eq!(otherwise.bytes, 0.0, "tiny-moe {mesh}");
        let predicted = memory.peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
        for program in &programs {
            let planned = plan(program, ElementSize::Fixed(4));
            assert_eq!(planned.peak_bytes as f64, predicted, "tiny-moe {mesh} rank {}: {differences:?}", program.rank);
        }
    }
}

/// The layouts of a mixture of experts whose backward the closed form models.
const MIXTURE_CROSS_CHECK: [TrainingLayout; 41] = [
    TrainingLayout::new("", false, 0),
    TrainingLayout::new("tp=2", false, 0),
    TrainingLayout::new("dp=2", false, 0),
    TrainingLayout::new("cp=2", false, 0),
    TrainingLayout::new("dp=2,tp=2", false, 0),
    TrainingLayout::new("dp=2", false, 2),
    TrainingLayout::new("dp=2", false, 3),
    TrainingLayout::new("dp=4", false, 3),
    TrainingLayout::new("dp=2,tp=2", false, 2),
    TrainingLayout::recomputing("", false, Recompute::Selective),
    TrainingLayout::recomputing("", false, Recompute::Full),
    TrainingLayout::recomputing("tp=2", false, Recompute::Full),
    TrainingLayout::recomputing("dp=2", false, Recompute::Full),
    TrainingLayout::recomputing("cp=2", false, Recompute::Selective),
    TrainingLayout::recomputing("cp=2", false, Recompute::Full),
    TrainingLayout { mesh: "dp=2", sequence_parallel: false, zero_stage: 3, recompute: Recompute::Full },
    TrainingLayout { mesh: "dp=2,tp=2", sequence_parallel: false, zero_stage: 3, recompute: Recompute::Full },
    TrainingLayout::new("ep=2", false, 0),
    TrainingLayout::new("ep=4", false, 0),
    TrainingLayout::new("dp=2,ep=2", false, 0),
    // ZeRO shards the dense parameters' state over dp × ep (over ep alone without dp) and the
    // experts' over dp, in the cost model and the executor alike.
    TrainingLayout::new("dp=2,ep=2", false, 1),
    TrainingLayout::new("ep=2", false, 1),
    TrainingLayout::new("dp=2,ep=2", false, 2),
    TrainingLayout::new("dp=2,ep=2", false, 3),
    TrainingLayout::new("ep=2", false, 2),
    TrainingLayout::new("ep=4", false, 3),
    TrainingLayout::new("ep=2,tp=2", false, 2),
    TrainingLayout::new("ep=2,tp=2", true, 3),
    TrainingLayout { mesh: "dp=2,ep=2", sequence_parallel: false, zero_stage: 3, recompute: Recompute::Full },
    TrainingLayout::new("ep=2,tp=2", false, 0),
    TrainingLayout::new("cp=2,ep=2", false, 0),
    TrainingLayout::recomputing("ep=2", false, Recompute::Full),
    TrainingLayout::new("tp=2", true, 0),
    TrainingLayout::new("dp=2,tp=2", true, 3),
    TrainingLayout::new("ep=2,tp=2", true, 0),
    TrainingLayout::recomputing("tp=2", true, Recompute::Full),
    // k and v keep 2 rows a rank at tp=2: ZeRO splits them over dp, and then over ep on head_dim;
    // dp=4 leaves them whole.
    TrainingLayout::new("dp=4,tp=2", false, 2),
    TrainingLayout::new("dp=4,tp=2", false, 3),
    TrainingLayout::new("dp=2,ep=2,tp=2", false, 1),
    TrainingLayout::new("dp=2,ep=2,tp=2", false, 2),
    TrainingLayout { mesh: "dp=2,ep=2,tp=2", sequence_parallel: true, zero_stage: 3, recompute: Recompute::Full },
];

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak_inside_a_mixtures_backward() {
    // tiny-moe keeps no MLP activations (its backward recomputes the experts' from the MLP norm's
    // output), so on more tokens its step peaks at the head of the backward, inside a layer's
    // mixture backward (as the MLP norm output's gradient is made, as the experts' gradients are
    // made or reduced over dp, as the attention residual's gradient is summed; over ep as the
    // dispatch's backward copies its operands) or, once the experts' gradients outweigh its
    // tokens, in its attention backward. With and without the
    // load-balancing loss (whose expert counts are kept for the routers' backward, and whose
    // router gradients sit beside the experts' input gradient).
    let config = preset("tiny-moe").unwrap();
    let without_balancing = pleat_ir::model::config::ModelConfig {
        moe: config.moe.clone().map(|moe| pleat_ir::model::config::MoeConfig { output_router_logits: false, ..moe }),
        ..config.clone()
    };
    let mut phases = check_training_closed_form(&config, &MIXTURE_CROSS_CHECK, &[SEQ, 32, 128, 256]);
    phases.extend(check_training_closed_form(&without_balancing, &MIXTURE_CROSS_CHECK, &[SEQ, 32, 128, 256]));
    for name in [
        "end of backward",
        "the loss's backward",
        "a mixture's MLP norm output's gradient",
        "a mixture's expert gradients made",
        "a mixture's expert gradients reduced",
        "a mixture's attention residual gradient",
        "a mixture's dispatched backward",
        "an attention kernel's backward",
    ] {
        assert!(phases.contains_key(name), "{name} not among {:?}", phases.keys());
    }
    // dp=4 × tp=2 keeps k and v whole: ZeRO-3's peaks hold them so (ZeRO-2's peak inside a
    // mixture's backward, which holds the gradients made so far, exactly, without the term).
    assert!(phases.values().any(|terms| terms.contains(&PARAMS_KEPT_WHOLE)), "{PARAMS_KEPT_WHOLE} in no peak");
}

/// `tiny-moe` with a Qwen2-MoE shared expert of `width` channels, with or without its
/// load-balancing loss.
/// `config` with `experts` routed experts a layer, with or without the load-balancing loss.
fn with_routed_experts(
    config: &pleat_ir::model::config::ModelConfig,
    experts: u64,
    load_balancing_loss: bool,
) -> pleat_ir::model::config::ModelConfig {
    let moe = config.moe.clone().map(|moe| pleat_ir::model::config::MoeConfig {
        num_experts: experts,
        output_router_logits: load_balancing_loss,
        ..moe
    });
    pleat_ir::model::config::ModelConfig { moe, ..config.clone() }
}

fn with_a_shared_expert(width: u64, load_balancing_loss: bool) -> pleat_ir::model::config::ModelConfig {
    let config = preset("tiny-moe").unwrap();
    pleat_ir::model::config::ModelConfig {
        moe: config.moe.clone().map(|moe| pleat_ir::model::config::MoeConfig {
            shared_expert_intermediate_size: Some(width),
            output_router_logits: load_balancing_loss,
            ..moe
        }),
        ..config
    }
}

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak_with_a_shared_expert() {
    // A shared expert's forward keeps gate, up, their product, its output and its gate's logit, and
    // its backward comes before the routed experts'. It peaks as its down projection's input and
    // weight gradients are made (and reduced over the replicas), as up's input gradient is made, as
    // gate's joins the MLP norm output's gradient, and as up's and gate's weight gradients are
    // reduced; past it, the routed experts' points hold its gradients and the sum of its input
    // gradients. Without SP its gate vector's backward comes first; under SP last, and with the
    // load-balancing loss the router's backward comes first and each input gradient is all-reduced
    // over tp. Widths of a quarter, three quarters and eight times the hidden size, with and
    // without the loss, on every layout of the mixture's cross-check, 8 to 512 tokens a sequence.
    let mut phases = std::collections::BTreeMap::new();
    for width in [32, 96, 1024] {
        for load_balancing_loss in [true, false] {
            let config = with_a_shared_expert(width, load_balancing_loss);
            phases.extend(check_training_closed_form(&config, &MIXTURE_CROSS_CHECK, &[SEQ, 32, 128, 512]));
        }
    }
    for name in [
        "a shared expert's down projection input gradient",
        "a shared expert's down projection weight gradient",
        "a shared expert's down projection weight gradient reduced",
        "a shared expert's up projection input gradient",
        "a shared expert's MLP norm output's gradient",
        "a shared expert's gate projection weight gradient reduced",
        "a mixture's MLP norm output's gradient",
        "a mixture's dispatched backward",
        "a mixture's expert gradients reduced",
        "the loss's backward",
        "end of backward",
    ] {
        assert!(phases.contains_key(name), "{name} not among {:?}", phases.keys());
    }
}

#[test]
fn closed_form_plus_named_terms_equals_the_planners_training_peak_with_qkv_biases() {
    // Qwen2 adds a bias to q, k and v: their gradients are made beside the projections' weight
    // gradients (v's and k's at the attention norm's point, q's where q's weight gradient is made),
    // and under full recomputation the bias adds are recomputed with their projections, not kept.
    // A dense `tiny` with the biases on the dense cross-check, and the Qwen2-MoE fixture (biases and
    // a shared expert) on the mixture's, 8 to 512 tokens a sequence.
    let dense = pleat_ir::model::config::ModelConfig {
        architecture: pleat_ir::model::config::Architecture::Qwen2,
        attention_bias: true,
        ..preset("tiny").unwrap()
    };
    let path = "tests/fixtures/tiny-qwen2-moe/config.json";
    let text = std::fs::read_to_string(path).expect("the Qwen2-MoE fixture");
    let mixture = pleat_ir::model::config::ModelConfig::from_json_str(&text, path).expect("its config");
    assert!(mixture.attention_bias && dense.attention_bias);
    let dense_phases = check_training_closed_form(&dense, &TRAINING_CROSS_CHECK, &[SEQ, 32, 128, 512]);
    let mixture_phases = check_training_closed_form(&mixture, &MIXTURE_CROSS_CHECK, &[SEQ, 32, 128, 512]);
    for name in ["end of backward", "the loss's backward", "an attention kernel's backward"] {
        assert!(dense_phases.contains_key(name), "{name} not among {:?}", dense_phases.keys());
    }
    for name in ["end of backward", "a shared expert's MLP norm output's gradient"] {
        assert!(mixture_phases.contains_key(name), "{name} not among {:?}", mixture_phases.keys());
    }
    // Some peak holds a bias gradient.
    let bias_terms = ["its v and k projections' bias gradients", "its q projection's bias gradient"];
    let holds_a_bias_gradient = |terms: &Vec<&str>| terms.iter().any(|term| bias_terms.contains(term));
    assert!(
        dense_phases.values().chain(mixture_phases.values()).any(holds_a_bias_gradient),
        "no peak holds a bias gradient: {dense_phases:?} {mixture_phases:?}"
    );
}

#[test]
fn dp_by_tp_slices_the_embedding_gradient_before_it_reduces_over_dp() {
    // dp=2 × tp=2 peaks as tp=2 alone: the embedding's whole-vocabulary gradient ([256, 128] f32)
    // is sliced to the rank's [128, 128] tp shard first, and only the shard is all-reduced over dp,
    // so at no point are two whole-vocabulary buffers live, and the dp all-reduce of the embedding
    // gradient moves [128, 128], not [256, 128].
    let config = preset("tiny").unwrap();
    let compile = |mesh| compile_training(&config, &TrainingLayout::new(mesh, false, 0), 4).0;
    let programs = compile("dp=2,tp=2");
    let tp = plan(&compile("tp=2")[0], ElementSize::Fixed(4));
    let dp_tp = plan(&programs[0], ElementSize::Fixed(4));
    assert_eq!(tp.param_bytes, dp_tp.param_bytes);
    assert_eq!(dp_tp.peak_bytes, tp.peak_bytes);
    for at in 0..programs[0].instructions.len() {
        let whole =
            live_before(&programs[0], at).iter().filter(|&&id| programs[0].buffer(id).shape == [256, 128]).count();
        assert!(whole <= 1, "instruction {at}: {whole} whole-vocabulary buffers live");
    }
    let embedding_reduce = programs[0].instructions.iter().find_map(|instr| match instr {
        Instr::AllReduce { inputs, group, .. } if group.axis == "dp" => {
            let buffer = programs[0].buffer(inputs[0]);
            buffer.name.contains("embed").then(|| buffer.shape.clone())
        }
        _ => None,
    });
    assert_eq!(embedding_reduce, Some(vec![128, 128]));
    let model = ModelShape::from_config(&config);
    let layout = Layout::from_mesh(&Mesh::parse("dp=2,tp=2").unwrap(), false);
    let phase = compiled_training_peak(&model, &layout, &Workload::training(SEQ, 2)).unwrap();
    let tp_layout = Layout::from_mesh(&Mesh::parse("tp=2").unwrap(), false);
    let tp_phase = compiled_training_peak(&model, &tp_layout, &Workload::training(SEQ, 4)).unwrap();
    assert_eq!(phase.bytes(), tp_phase.bytes());
}

#[test]
fn zero3_beside_tp_reduce_scatters_only_the_tp_shard_of_the_embedding_gradient() {
    // Under ZeRO-3 the embedding is gathered over dp to its [128, 128] tp shard before each use;
    // its gradient is brought to that layout (sliced to the rank's tp rows) before the gather's
    // conjugate reduce-scatters it, so dp moves [128, 128], not the whole [256, 128], and no more
    // than one whole-vocabulary buffer is ever live, with and without SP.
    let config = preset("tiny").unwrap();
    for sequence_parallel in [false, true] {
        let programs = compile_training(&config, &TrainingLayout::new("dp=2,tp=2", sequence_parallel, 3), 4).0;
        let program = &programs[0];
        let embedding_scatter = program.instructions.iter().find_map(|instr| match instr {
            Instr::ReduceScatter { inputs, group, .. } if group.axis == "dp" => {
                let buffer = program.buffer(inputs[0]);
                buffer.name.contains("embed").then(|| buffer.shape.clone())
            }
            _ => None,
        });
        assert_eq!(embedding_scatter, Some(vec![128, 128]), "sp={sequence_parallel}");
        let gathers_back = program.instructions.iter().any(|instr| {
            matches!(instr, Instr::AllGather { out, group, .. }
                if group.axis == "dp" && program.buffer(*out).name.contains("embed") && program.buffer(*out).name.contains(".d0"))
        });
        assert!(!gathers_back, "sp={sequence_parallel}: the embedding's gradient is never gathered back over dp");
        for at in 0..program.instructions.len() {
            let whole = live_before(program, at).iter().filter(|&&id| program.buffer(id).shape == [256, 128]).count();
            assert!(whole <= 1, "sp={sequence_parallel} instruction {at}: {whole} whole-vocabulary buffers live");
        }
    }
}

#[test]
fn a_pipelined_stage_peak_by_hand() {
    // Stage 0 of the four-layer tiny on pp=2 under GPipe with 2 micro-batches of 2 sequences (16
    // tokens each; h 128, q 128, kv 64, f 256; 4 bytes an element). GPipe runs F0 F1 B0 B1; the
    // stage peaks at the end of B0, as the last of micro-batch 0's gradients (the embedding's) is
    // copied into its running sum. Live then, from the buffers' sizes:
    let element = 4;
    let tokens = 16;
    // - the stage's parameters: the embedding [256, 128] and two layers of 147,712 elements
    //   (q and o 2·128·128, k and v 2·128·64, the MLP 3·128·256, two norms of 128);
    let layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128;
    let params = (256 * 128 + 2 * layer) * element;
    // - twice the gradients: micro-batch 0's (each a program output, kept to the end of its
    //   backward) and their running sums over the micro-batches;
    let gradients = 2 * params;
    // - micro-batch 1's forward, kept for B1: its token ids and positions, the embedding's output,
    //   and per layer the kept values (attn_norm, attn_residual, mlp_norm and the layer's output of
    //   h; q_rope and attention of q; k_rope and v of kv; gate, up and their product of f);
    let kept_layer = tokens * (4 * 128 + 2 * 128 + 2 * 64 + 3 * 256) * element;
    let in_flight = tokens * element + 8 * element + tokens * 128 * element + 2 * kept_layer;
    // - what micro-batch 0 still holds until the end of its backward step: its token ids, the
    //   stage's output (sent to stage 1) and the embedding output's gradient.
    let leftovers = tokens * element + 2 * tokens * 128 * element;
    let config = four_layers();
    let layout = PipelinedLayout::new("pp=2", ScheduleKind::GPipe, 2);
    let (programs, _) = compile_pipelined(&config, &layout);
    let planned = plan(&programs[0], ElementSize::Fixed(4));
    assert_eq!(planned.param_bytes, params);
    assert_eq!(planned.peak_bytes, params + gradients + in_flight + leftovers);
    // The closed form names the same buffers.
    let schedule = Schedule::build(ScheduleKind::GPipe, 2, 2).unwrap();
    let model = ModelShape::from_config(&config);
    let layout = Layout::from_mesh(&Mesh::parse("pp=2").unwrap(), false);
    let phase = compiled_stage_peak(&model, &layout, &Workload::training(SEQ, 2), &schedule, 0, 0, 2).unwrap();
    assert_eq!(phase.bytes(), (params + gradients + in_flight + leftovers) as f64);
    let term = |name: &str| phase.terms.iter().find(|term| term.name == name).map(|term| term.bytes);
    assert_eq!(term("other micro-batches in flight"), Some(in_flight as f64));

    // Tied, the same stage holds at that point, instead of the token ids and the embedding
    // output's gradient (freed as the embedding's part of the table's gradient is made), that part
    // and the head's part received from stage 1, both [256, 128], beside their sum (the gradient)
    // and its running sum.
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..config };
    let table = 256 * 128 * element;
    let stage_output = tokens * 128 * element;
    let by_hand = params + gradients + in_flight + stage_output + 2 * table;
    let (programs, _) = compile_pipelined(&tied, &PipelinedLayout::new("pp=2", ScheduleKind::GPipe, 2));
    let planned = plan(&programs[0], ElementSize::Fixed(4));
    assert_eq!((planned.param_bytes, planned.peak_bytes), (params, by_hand));
    let model = ModelShape::from_config(&tied);
    let phase = compiled_stage_peak(&model, &layout, &Workload::training(SEQ, 2), &schedule, 0, 0, 2).unwrap();
    assert_eq!(phase.bytes(), by_hand as f64);
    // Stage 1 holds no head of its own: the table it reads is received, not loaded.
    let planned = plan(&programs[1], ElementSize::Fixed(4));
    assert_eq!(planned.param_bytes, (2 * layer + 128) * element);
    let phase = compiled_stage_peak(&model, &layout, &Workload::training(SEQ, 2), &schedule, 1, 0, 2).unwrap();
    assert_eq!(phase.params, planned.param_bytes as f64);
    let received = phase.terms.iter().find(|term| term.name == TIED_TABLE_RECEIVED).map(|term| term.bytes);
    assert_eq!(received, Some(table as f64));
}

#[test]
fn pipelined_stage_closed_form_equals_the_planners_peak() {
    // The four-layer tiny on pp=2 and pp=4, alone and by dp=2, cp=2, tp=2 (with and without
    // Megatron SP) or dp=2 × tp=2 and tp=4 (where the whole-vocabulary embedding gradient peaks
    // before the rows' all-reduce), with no, selective and full recomputation, GPipe, 1F1B and
    // interleaved, 2 and 4 micro-batches, and ZeRO-1, 2 and 3 beside dp: every stage's closed form
    // (the largest of its candidates) equals the planner's peak of its program.
    let config = four_layers();
    // (Four sequences a step: dp=2 takes two micro-batches of two.)
    let none = Recompute::None;
    let cases: [(&str, bool, Recompute, &[u32]); 22] = [
        ("pp=2", false, none, &[2, 4]),
        ("pp=4", false, none, &[2, 4]),
        ("pp=2,dp=2", false, none, &[2]),
        ("pp=4,dp=2", false, none, &[2]),
        ("pp=2,tp=2", false, none, &[2, 4]),
        ("pp=4,tp=2", false, none, &[2]),
        ("pp=2,tp=2", true, none, &[2, 4]),
        ("pp=2", false, Recompute::Selective, &[2, 4]),
        ("pp=4,tp=2", true, Recompute::Selective, &[2]),
        ("pp=2", false, Recompute::Full, &[2, 4]),
        ("pp=4", false, Recompute::Full, &[2, 4]),
        ("pp=2,tp=2", true, Recompute::Full, &[2, 4]),
        ("pp=2,dp=2", false, Recompute::Full, &[2]),
        ("pp=2,cp=2", false, none, &[2, 4]),
        ("pp=4,cp=2", false, none, &[2, 4]),
        ("pp=2,dp=2,tp=2", false, none, &[2]),
        ("pp=2,dp=2,tp=4", false, none, &[2]),
        ("pp=4,dp=2,tp=2", false, none, &[2]),
        ("pp=2,dp=2,tp=2", true, none, &[2]),
        ("pp=2,dp=2,tp=2", true, Recompute::Selective, &[2]),
        ("pp=2,dp=2,tp=2", false, Recompute::Full, &[2]),
        ("pp=2,dp=2,tp=2", true, Recompute::Full, &[2]),
    ];
    // ZeRO-1 splits only the optimizer's state, which the programs do not hold: dp's closed form.
    // ZeRO-2 shards the sums and reduce-scatters each gradient whole; ZeRO-3 shards the parameters
    // too, and frees each layer's gathered weights before the tails.
    let zero_cases: [(&str, bool, Recompute, &[u32], u8); 10] = [
        ("pp=2,dp=2", false, none, &[2], 1),
        ("pp=4,dp=2", false, none, &[2], 1),
        ("pp=2,dp=2", false, Recompute::Full, &[2], 1),
        ("pp=2,dp=2", false, none, &[2], 2),
        ("pp=4,dp=2", false, none, &[2], 2),
        ("pp=2,dp=2", false, Recompute::Selective, &[2], 2),
        ("pp=2,dp=2", false, Recompute::Full, &[2], 2),
        ("pp=2,dp=2", false, none, &[2], 3),
        ("pp=4,dp=2", false, none, &[2], 3),
        ("pp=2,dp=2", false, Recompute::Selective, &[2], 3),
    ];
    let all = cases.iter().map(|&(mesh, sp, recompute, counts)| (mesh, sp, recompute, counts, 0)).chain(zero_cases);
    for (mesh, sequence_parallel, recompute, micro_batch_counts, zero_stage) in all {
        let stages = Mesh::parse(mesh).unwrap().degree(AxisName::Pp) as u32;
        let mut kinds = vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB];
        // Interleaving needs a layer a virtual stage.
        if stages * 2 <= 4 {
            kinds.push(ScheduleKind::Interleaved { chunks: 2 });
        }
        for layout in layouts_of(mesh, sequence_parallel, recompute, zero_stage, &kinds, micro_batch_counts) {
            check_stage_closed_form(&config, &layout);
        }
    }
}

/// `mesh`'s pipelined layouts in each of `kinds` with each of `micro_batch_counts`.
fn layouts_of(
    mesh: &'static str,
    sequence_parallel: bool,
    recompute: Recompute,
    zero_stage: u8,
    kinds: &[ScheduleKind],
    micro_batch_counts: &[u32],
) -> Vec<PipelinedLayout> {
    let each = |&kind| {
        micro_batch_counts.iter().map(move |&micro_batches| PipelinedLayout {
            recompute,
            sequence_parallel,
            zero_stage,
            ..PipelinedLayout::new(mesh, kind, micro_batches)
        })
    };
    kinds.iter().flat_map(each).collect()
}

#[test]
fn zero_bubble_stage_closed_form_equals_the_planners_peak() {
    // ZB-H1: each micro-batch between its B and its W keeps what its weight gradients read, and W's
    // tail the residual gradients B read too; pp=2 and pp=4 on four and eight layers, beside tp=2.
    let four = four_layers();
    let eight = eight_layers();
    for (config, mesh, micro_batches) in [
        (&four, "pp=2", 2),
        (&four, "pp=2", 4),
        (&four, "pp=4", 4),
        (&four, "pp=2,tp=2", 2),
        (&four, "pp=2,tp=2", 4),
        (&eight, "pp=2", 4),
        (&eight, "pp=4", 4),
    ] {
        check_stage_closed_form(config, &PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, micro_batches));
    }
    // Beside dp, dp×tp, cp, and ZeRO-2 and 3 (their reduce-scatters at W's tail).
    for (mesh, zero) in
        [("pp=2,dp=2", 0u8), ("pp=2,dp=2,tp=2", 0), ("pp=2,cp=2", 0), ("pp=2,dp=2", 2), ("pp=2,dp=2", 3)]
    {
        let layout = PipelinedLayout { zero_stage: zero, ..PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, 2) };
        check_stage_closed_form(&four, &layout);
    }
    // Selective recomputation: W recomputes attention's output from q, k and v, kept instead.
    for (config, mesh, m) in [(&four, "pp=2", 2u32), (&four, "pp=2", 4), (&eight, "pp=4", 4), (&four, "pp=2,tp=2", 2)] {
        let layout = PipelinedLayout {
            recompute: Recompute::Selective,
            ..PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, m)
        };
        check_stage_closed_form(config, &layout);
    }
    // Full recomputation: B recomputes each layer's forward, and what W reads of it stays, beside
    // the residual stream the forward kept, until W; alone, beside tp (±SP), dp, dp×tp and ZeRO-2.
    let full = |mesh, m, sequence_parallel, zero_stage| PipelinedLayout {
        recompute: Recompute::Full,
        sequence_parallel,
        zero_stage,
        ..PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, m)
    };
    for (config, layout) in [
        (&four, full("pp=2", 2, false, 0)),
        (&four, full("pp=4", 4, false, 0)),
        (&eight, full("pp=2", 4, false, 0)),
        (&four, full("pp=2,tp=2", 4, false, 0)),
        (&four, full("pp=2,dp=2,tp=2", 2, false, 0)),
        (&four, full("pp=2,dp=2", 2, false, 2)),
        (&four, full("pp=2,tp=2", 2, true, 0)),
        (&eight, full("pp=4,tp=2", 4, true, 0)),
    ] {
        check_stage_closed_form(config, &layout);
    }
    // Beside tp with SP: the projections' output gradients W reads are the gathered ones.
    for (config, mesh, m) in
        [(&four, "pp=2,tp=2", 2u32), (&four, "pp=2,tp=2", 4), (&four, "pp=2,dp=2,tp=2", 2), (&eight, "pp=4,tp=2", 4)]
    {
        let layout =
            PipelinedLayout { sequence_parallel: true, ..PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, m) };
        check_stage_closed_form(config, &layout);
    }
}

#[test]
fn zero_bubble_zero_stages_peak_inside_w_as_the_gate_gradient_is_scattered() {
    // Under ZeRO-2 and 3 with micro-batches enough that others wait between their B and W, the
    // last stage peaks inside a W, as its first layer's gate gradient is reduce-scattered: beside
    // what W still reads (the residual gradients; q, k and v under selective recomputation), the
    // layer's attention norm's input gradient (sent back by B), q's, k's and v's gradients in
    // place of q, k and v, both norm outputs' gradients and, under SP, the attention residual's
    // gradient and its gathered copy. (Before, the form took a backward's point there, 20,480 B
    // below the planner at pp=2 × dp=4.) Under full recomputation with ZeRO-3, W gathers no weight:
    // B does, for its recomputed forward.
    let (four, eight) = (four_layers(), eight_layers());
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let mut names = std::collections::BTreeSet::new();
    for (config, mesh, zero_stage, micro_batches, recompute, sequence_parallel) in [
        (&four, "pp=2,dp=4", 2u8, 4u32, none, false),
        (&four, "pp=2,dp=4", 3, 4, none, false),
        (&four, "pp=2,dp=4", 2, 4, selective, false),
        (&four, "pp=2,dp=4", 3, 4, full, false),
        (&four, "pp=2,dp=2", 3, 8, selective, false),
        (&four, "pp=4,dp=2", 2, 8, none, false),
        (&four, "pp=4,dp=2", 3, 8, full, false),
        (&eight, "pp=2,dp=2", 2, 4, none, false),
        (&eight, "pp=2,dp=2", 3, 4, full, false),
        (&four, "pp=2,cp=2", 2, 4, none, false),
        (&four, "pp=2,cp=2", 3, 4, full, false),
        (&four, "pp=2,dp=2,tp=2", 2, 4, none, false),
        (&four, "pp=2,dp=2,tp=2", 3, 4, selective, false),
        (&four, "pp=2,dp=2,tp=2", 2, 4, selective, true),
        (&four, "pp=2,dp=2,tp=2", 3, 4, none, true),
        (&four, "pp=2,dp=2,tp=2", 3, 4, full, true),
    ] {
        let layout = PipelinedLayout::one_sequence_a_micro_batch(
            mesh,
            ScheduleKind::ZeroBubbleH1,
            micro_batches,
            zero_stage,
            recompute,
            sequence_parallel,
        );
        check_stage_closed_form(config, &layout);
        names.extend(stage_phase_names(config, &layout));
    }
    assert!(names.contains("first layer's gate gradient reduce-scattered"), "{names:?}");
    assert!(!names.iter().any(|name| name.contains("regathered")), "{names:?}");
}

#[test]
fn stages_whose_key_values_zero_keeps_whole_equal_the_planners_peak() {
    // tiny's 4 kv heads are 2 rows a rank at tp=2, which dp=4 does not divide (nor 4 rows at dp=8
    // without tp): ZeRO-2 and 3 keep k and v whole (`zero_rows`), their running sums and each
    // micro-batch's gradients (named `GRADS_KEPT_WHOLE`), and ZeRO-3 their weights
    // (`PARAMS_KEPT_WHOLE`), which it does not gather for the recomputed forward. Every schedule,
    // recomputation and SP; a tied table at dp=8.
    let (four, eight) = (four_layers(), eight_layers());
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four_layers() };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (zero_bubble, interleaved) = (ScheduleKind::ZeroBubbleH1, ScheduleKind::Interleaved { chunks: 2 });
    let mut names = std::collections::BTreeSet::new();
    for (config, mesh, zero_stage, kind, micro_batches, recompute, sequence_parallel) in [
        (&four, "pp=2,dp=4,tp=2", 2u8, one_f_one_b, 2u32, none, false),
        (&four, "pp=2,dp=4,tp=2", 3, one_f_one_b, 4, full, false),
        (&four, "pp=2,dp=4,tp=2", 3, one_f_one_b, 4, selective, true),
        (&four, "pp=2,dp=4,tp=2", 2, gpipe, 4, selective, false),
        (&four, "pp=2,dp=4,tp=2", 3, gpipe, 4, full, true),
        (&four, "pp=4,dp=4,tp=2", 2, one_f_one_b, 4, none, false),
        (&four, "pp=2,dp=4,tp=2", 2, zero_bubble, 4, none, false),
        (&four, "pp=2,dp=4,tp=2", 3, zero_bubble, 4, full, false),
        (&eight, "pp=2,dp=4,tp=2", 2, interleaved, 4, none, false),
        (&eight, "pp=2,dp=4,tp=2", 3, interleaved, 4, selective, false),
        (&four, "pp=2,dp=8", 3, one_f_one_b, 2, full, false),
        (&four, "pp=2,dp=8", 3, zero_bubble, 4, selective, false),
        (&tied, "pp=2,dp=8", 2, one_f_one_b, 2, none, false),
        (&tied, "pp=2,dp=8", 3, gpipe, 2, selective, false),
    ] {
        let dp = Mesh::parse(mesh).unwrap().degree(AxisName::Dp);
        let layout = PipelinedLayout::one_sequence_a_micro_batch(
            mesh,
            kind,
            micro_batches,
            zero_stage,
            recompute,
            sequence_parallel,
        );
        check_stage_closed_form(config, &layout);
        for stage in stage_closed_forms(config, &layout, SEQ) {
            let bytes_of = |name: &str| stage.bytes_of(name);
            // Every peak holds some k and v gradient whole; ZeRO-3 the stage's layers' k and v
            // weights, each beyond its shard by 2·16·128 − 2·16·128/4 = 3,072 elements at
            // dp=4 × tp=2 and by 4·16·128 − 4·16·128/8 = 7,168 at dp=8, 4 bytes an element.
            assert!(bytes_of(GRADS_KEPT_WHOLE) > 0.0, "{}", stage.label);
            let beyond = if dp == 8 { 7168.0 } else { 3072.0 };
            let layers = (config.num_layers / Mesh::parse(mesh).unwrap().degree(AxisName::Pp)) as f64;
            let params_kept_whole = if zero_stage == 3 { layers * 2.0 * beyond * 4.0 } else { 0.0 };
            assert_eq!(bytes_of(PARAMS_KEPT_WHOLE), params_kept_whole, "{}", stage.label);
            names.insert(stage.phase.name);
        }
    }
    for name in ["tail of a backward", "first layer's gate gradient reduce-scattered"] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
    // A mixture's first layer peaks inside its experts' backward before its attention's: none of
    // the layer's k and v gradients, kept whole, is made there (1.5% above the planner under
    // ZeRO-3 when it counted them), beside tp and beside tsp.
    for config in &four_layer_mixtures() {
        for (mesh, kind, recompute) in [
            ("pp=2,dp=4,tp=2", one_f_one_b, none),
            ("pp=2,dp=4,tp=2", gpipe, full),
            ("pp=2,dp=4,tsp=2", one_f_one_b, selective),
        ] {
            let layout = PipelinedLayout::one_sequence_a_micro_batch(mesh, kind, 2, 3, recompute, false);
            check_stage_closed_form(config, &layout);
        }
    }
}

#[test]
fn stages_whose_queries_zero_keeps_whole_equal_the_planners_peak() {
    // A model of six query heads (16 wide) over `kv` kv heads: at dp=4 q's 6 rows a rank do not
    // divide, nor its 3 at dp=2 × tp=2 (the one kv head, whole over tp, splits on head_dim), and at
    // dp=2 × cp=2 dp splits them to 3, which cp does not divide; at dp=8 × tp=2 (or tsp=2)
    // `tiny`'s 4 rows a rank do not divide either, nor its 2 at tsp=4 × dp=4. ZeRO-2 and 3 keep q
    // whole (beside k and v where 2 kv heads are 2 rows at dp=4, or at dp=8 × tp=2): a layer's
    // attention backward makes v's gradient, k's, then q's, a chunk's tail all-reduces q's in
    // place and it joins its sum whole, and ZeRO-3 never gathers it. Where q's gradient is so
    // large beside the activations, a chunk of two layers may peak inside its first layer's MLP
    // backward (or W) as the down gradient is reduce-scattered.
    let six_heads =
        |kv_heads: u64| pleat_ir::model::config::ModelConfig { num_heads: 6, num_kv_heads: kv_heads, ..four_layers() };
    let (two_kv_heads, one_kv_head) = (six_heads(2), six_heads(1));
    let biased = pleat_ir::model::config::ModelConfig {
        attention_bias: true,
        architecture: pleat_ir::model::config::Architecture::Qwen2,
        ..six_heads(1)
    };
    let four = four_layers();
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (zero_bubble, interleaved) = (ScheduleKind::ZeroBubbleH1, ScheduleKind::Interleaved { chunks: 2 });
    // Each case's elements a layer holds beyond the closed form's shards, by hand: q's 6·16·128 =
    // 12,288 over 4 shards keeps 12,288 − 3,072 = 9,216 more, k's and v's 2·16·128 = 4,096 keep
    // 3,072 more each; q's 3·16·128 = 6,144 at dp=2 × tp=2 keeps 6,144 − 3,072 = 3,072 more (its
    // bias's 3·16 = 48, 24 more); split over dp alone at dp=2 × cp=2, 12,288/2 − 12,288/4 = 3,072;
    // `tiny`'s q 4·16·128 = 8,192 at dp=8 (beside tp=2 or tsp=2) keeps 8,192 − 1,024 = 7,168,
    // its k and v 2·16·128 = 4,096 keep 3,584 each; at tsp=4 × dp=4 q's 2·16·128 = 4,096 keeps
    // 3,072 (k's and v's one row splits on head_dim).
    let cases: [(StageCase, f64); 10] = [
        ((&two_kv_heads, "pp=2,dp=4", one_f_one_b, 4, 2, selective, false, 32), 15_360.0),
        ((&two_kv_heads, "pp=2,dp=4", zero_bubble, 4, 3, full, false, 32), 15_360.0),
        ((&two_kv_heads, "pp=2,dp=4", gpipe, 4, 3, selective, false, 128), 15_360.0),
        ((&one_kv_head, "pp=2,dp=2,tp=2", gpipe, 4, 2, none, false, 32), 3_072.0),
        ((&one_kv_head, "pp=2,dp=2,tp=2", interleaved, 4, 3, full, true, 128), 3_072.0),
        ((&biased, "pp=2,dp=2,tp=2", one_f_one_b, 4, 3, selective, true, 128), 3_096.0),
        ((&one_kv_head, "pp=2,dp=2,cp=2", zero_bubble, 4, 3, none, false, 128), 3_072.0),
        ((&four, "pp=2,dp=8,tp=2", one_f_one_b, 4, 3, none, false, 64), 14_336.0),
        ((&four, "pp=2,tsp=2,dp=8", zero_bubble, 4, 3, selective, false, 64), 14_336.0),
        ((&four, "pp=2,tsp=4,dp=4", gpipe, 4, 3, none, false, 64), 3_072.0),
    ];
    let names = exact_with_params_kept_whole(&cases);
    for name in [
        "tail of a backward",
        "first layer's down gradient reduce-scattered",
        "first layer's down gradient reduce-scattered in W",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn stages_whose_router_and_experts_zero_keeps_whole_equal_the_planners_peak() {
    // Six experts at dp=4: the router's 6 rows and the experts' 6 a rank do not divide, so ZeRO-2
    // and 3 keep both whole: their gradients are all-reduced and join their sums whole, as beside
    // dp without ZeRO, and ZeRO-3 never gathers them. The same at dp=4 × tp=2 (k's and v's 2 rows
    // a rank whole too) and cp=4; at tsp=2 × dp=2 the router's 6 rows split, the experts' 3 a
    // rank do not (at tsp=2 × dp=4 neither, nor k's and v's); `tiny-moe`'s 8 experts at dp=16, or
    // their 4 a rank at ep=2 × dp=8 (where the router splits and k and v split over ep alone).
    // At dp=2 × ep=2 dp splits the router's 6 rows to 3, which ep does not divide: it is
    // reduce-scattered over dp, then all-reduced over ep, its shard dp's (the experts' 3 a rank
    // whole); at dp=2 × cp=2 the experts' 6 rows too, split over dp alone.
    // Beside whole expert gradients, points that a sharded stage never peaks at become its peak:
    // in zero bubble's forward as the last layer's v projection runs beside its gathered weight
    // (under full recomputation), and beside tp under SP as the experts' gradients are made
    // before their all-reduce.
    let [mixture, shared] = four_layer_mixtures();
    let (six, six_without_the_loss, six_shared) = (
        with_routed_experts(&mixture, 6, true),
        with_routed_experts(&mixture, 6, false),
        with_routed_experts(&shared, 6, true),
    );
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (zero_bubble, interleaved) = (ScheduleKind::ZeroBubbleH1, ScheduleKind::Interleaved { chunks: 2 });
    // Each case's elements a layer holds beyond the closed form's shards, by hand. Six experts:
    // the router's 6·128 = 768 keep 576 more at dp=4 (or cp=4); the experts' three 6·64·128 =
    // 49,152 keep 36,864 more each, 110,592; beside tp=2 three 6·32·128 = 24,576 keep 18,432
    // each, 55,296, beside tsp (3 experts a rank) the same at dp=4, and 12,288 each at dp=2,
    // 36,864; k's and v's 2·16·128 = 4,096 keep 3,072 each. `tiny-moe` at ep=2 × dp=8: three
    // 4·64·128 = 32,768 keep 28,672 each, 86,016, and k's and v's 4·16·128 = 8,192, split over
    // ep alone, 4,096 − 512 = 3,584 each. Six experts at dp=2 × ep=2 (or cp=2): the router's
    // 768/2 − 768/4 = 192 more, and the experts' three 3·64·128 = 24,576 whole (or 6·64·128 split
    // over dp alone) 12,288 more each, 36,864.
    let cases: [(StageCase, f64); 10] = [
        ((&six, "pp=2,dp=4", one_f_one_b, 4, 2, none, false, 32), 111_168.0),
        ((&six_without_the_loss, "pp=2,dp=4", zero_bubble, 4, 3, full, false, 256), 111_168.0),
        ((&six, "pp=2,dp=4,tp=2", one_f_one_b, 4, 3, none, true, 256), 62_016.0),
        ((&six, "pp=2,tsp=2,dp=2", gpipe, 4, 3, none, false, 64), 36_864.0),
        ((&six, "pp=2,tsp=2,dp=4", one_f_one_b, 4, 3, full, false, 32), 62_016.0),
        ((&six_shared, "pp=2,cp=4", interleaved, 4, 3, full, false, 64), 111_168.0),
        ((&mixture, "pp=2,ep=2,dp=8", zero_bubble, 4, 3, selective, false, 64), 93_184.0),
        ((&mixture, "pp=2,dp=16", gpipe, 4, 2, none, false, 32), 0.0),
        ((&six, "pp=2,dp=2,ep=2", zero_bubble, 4, 3, selective, false, 64), 37_056.0),
        ((&six_shared, "pp=2,dp=2,cp=2", one_f_one_b, 4, 3, full, false, 32), 37_056.0),
    ];
    let names = exact_with_params_kept_whole(&cases);
    for name in [
        "first layer's last expert gradient joins its sum, its unreduced copy live",
        "the last layer's expert gradients made, before their all-reduce",
        "first layer's o gradient reduced to this rank, the first owner",
        "first layer's expert gradients made beside their weights gathered again",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn stages_whose_vocabulary_tables_zero_keeps_whole_equal_the_planners_peak() {
    // A vocabulary of 250 rows: at dp=4 they do not divide, nor their 125 a rank at dp=2 × tp=2
    // or tsp=2 × dp=2; at dp=2 × cp=2, or over a mixture's dense replicas dp=2 × ep=2, dp splits
    // them, the other axis does not. ZeRO-2 and 3 keep the embedding whole (and an untied LM
    // head), or split them over dp alone: each gradient is all-reduced as beside dp without ZeRO
    // (or reduce-scattered over dp, then all-reduced over the other axis) and joins its sum whole,
    // ZeRO-3 never gathers them whole, and the last stage receives a tied table whole (or dp's
    // shard of it).
    let four = four_layers();
    let with_vocabulary = |config: &pleat_ir::model::config::ModelConfig| pleat_ir::model::config::ModelConfig {
        vocab_size: 250,
        ..config.clone()
    };
    let (dense, mixture) = (with_vocabulary(&four), with_vocabulary(&four_layer_mixtures()[0]));
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..dense.clone() };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (zero_bubble, interleaved) = (ScheduleKind::ZeroBubbleH1, ScheduleKind::Interleaved { chunks: 2 });
    // Each case's elements a table holds beyond the closed form's shard, by hand: 250·128 =
    // 32,000 whole against 8,000 over 4 replicas, 24,000 beyond; at dp=2 × cp=2 (or ep=2) 16,000
    // over dp alone, 8,000 beyond; 125·128 = 16,000 a rank at dp=2 × tp=2 or tsp=2 × dp=2, against
    // 8,000, 8,000 beyond (at tsp=2 × dp=4 against 4,000, 12,000). Every layer's parameters
    // divide.
    let cases: [(StageCase, f64); 12] = [
        ((&dense, "pp=2,dp=4", one_f_one_b, 4, 3, selective, false, 64), 24_000.0),
        // (Under tsp with full recomputation, where the last stage peaks as the final norm's
        // output is gathered again for the head's gradient, none of which is made yet.)
        ((&dense, "pp=2,tsp=2,dp=4", one_f_one_b, 2, 2, full, false, 1024), 12_000.0),
        ((&mixture, "pp=2,tsp=2,dp=4", zero_bubble, 2, 2, full, false, 1024), 12_000.0),
        ((&dense, "pp=2,dp=4", zero_bubble, 4, 2, none, false, 256), 24_000.0),
        ((&tied, "pp=2,dp=4", gpipe, 4, 3, full, false, 32), 24_000.0),
        ((&tied, "pp=2,dp=4", zero_bubble, 4, 3, selective, false, 128), 24_000.0),
        ((&dense, "pp=2,dp=2,tp=2", interleaved, 4, 3, none, true, 128), 8_000.0),
        ((&tied, "pp=2,dp=2,tp=2", one_f_one_b, 4, 2, full, false, 256), 8_000.0),
        ((&dense, "pp=2,dp=2,cp=2", gpipe, 4, 3, none, false, 32), 8_000.0),
        ((&tied, "pp=2,dp=2,cp=2", one_f_one_b, 4, 3, selective, false, 128), 8_000.0),
        ((&dense, "pp=2,tsp=2,dp=2", gpipe, 4, 3, full, false, 64), 8_000.0),
        ((&mixture, "pp=2,dp=2,ep=2", one_f_one_b, 4, 3, none, false, 256), 8_000.0),
    ];
    let names = exact_stages(&cases, |&(config, mesh, .., zero_stage, _, _, _), beyond, stage| {
        // Under ZeRO-3 the first stage holds its embedding beyond its shard, the last its untied
        // LM head; beside a tied table the last receives it whole (or dp's shard).
        let stages = Mesh::parse(mesh).unwrap().degree(AxisName::Pp);
        let first = stage.label.ends_with("stage 0");
        let last = stage.label.ends_with(&format!("stage {}", stages - 1));
        let tables = f64::from(u8::from(first)) + f64::from(u8::from(last && !config.tie_word_embeddings));
        let expected = if zero_stage == 3 { tables * beyond * 4.0 } else { 0.0 };
        assert_eq!(stage.bytes_of(PARAMS_KEPT_WHOLE), expected, "{}", stage.label);
        let received = if zero_stage == 3 && last && config.tie_word_embeddings { beyond * 4.0 } else { 0.0 };
        assert_eq!(stage.bytes_of(TIED_TABLE_RECEIVED_BEYOND_SHARD), received, "{}", stage.label);
    });
    // (The head's gradient whole: before its all-reduce in W, and joining its sum after; under
    // tsp none of it made as the final norm's output is gathered again for it.)
    for name in [
        "tail of a backward",
        "the LM head's weight gradient joins its sum",
        "the final norm's output regathered for the LM head's gradient",
        "the final norm's output recomputed and gathered in W",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn stage_closed_form_is_exact_where_a_sweep_found_it_below_the_planner() {
    // Points a sweep of pipelined layouts (every schedule and recomputation, 64 to 1024 tokens)
    // found the form below the planner's peak at, each now modelled; before, by how much:
    // - a mixture at dp=4 × tp=2 under ZeRO-2, whose k and v ZeRO keeps whole: as the attention
    //   norm output's gradients from v and k are summed, v's gradient made whole, k's not (2.4%);
    // - zero bubble under ZeRO-3: in a forward as the down projection's output is made beside its
    //   gathered weight (0.7%); on the last stage, W going on past the LM head's reduce-scatter to
    //   the last layer's down gradient (256 B);
    // - Qwen2's q, k and v biases beside tp, the rank's share of them, each bias gradient made
    //   before its projection's input gradient (1.8 KB);
    // - a shared expert under SP and zero bubble: its gate vector's weight gradient made last in W
    //   (256 B above, before), and under ZeRO-3 the router, gathered for the experts, kept to the
    //   layer's statistics after its output (4 KB), and the logits made in a forward (220 B);
    // - a mixture's wide vocabulary on the last stage: the LM head's weight gradient joining its
    //   sum under full recomputation (4.2% below beside tp, 11.2% beside ep, all-reduced first),
    //   or reduce-scattered under ZeRO-2 and 3 (5.6% at dp=2 × tp=2 with SP, 22.7% at
    //   cp=2 × ep=2).
    // - under tsp and zero bubble, a first stage's forward as every token's embedding is
    //   reduce-scattered over tsp, staged whole (0.8% on a tied mixture at tsp=4, 1024 tokens);
    // - a mixture's loss's backward in B, its two losses apart until W sums them (4 B);
    // - a wide shared expert beside cp, its down gradient joining its sum in W once all-reduced
    //   (0.64%).
    // And ZeRO-3 on a mesh without replicas, which splits nothing (refused before).
    let four = four_layers();
    let [mixture, shared] = four_layer_mixtures();
    let biased = pleat_ir::model::config::ModelConfig {
        architecture: pleat_ir::model::config::Architecture::Qwen2,
        attention_bias: true,
        ..four.clone()
    };
    let tied_shared = tied(shared.clone());
    let wide_mixture = pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..mixture.clone() };
    let wide_shared = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(256, true) };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1);
    let cases: [StageCase; 16] = [
        (&mixture, "pp=2,dp=4,tp=2", one_f_one_b, 2, 2, full, false, 256),
        (&four, "pp=2,dp=4,tp=2", zero_bubble, 4, 3, none, true, 64),
        (&four, "pp=2,dp=2", zero_bubble, 4, 3, full, false, 64),
        (&biased, "pp=2,dp=2,tp=2", zero_bubble, 2, 2, full, true, 64),
        (&biased, "pp=2,tp=4", gpipe, 2, 0, full, true, 64),
        (&tied_shared, "pp=2,ep=2,tp=2", zero_bubble, 2, 2, selective, true, 64),
        (&shared, "pp=2,dp=2,tp=2", zero_bubble, 4, 3, selective, true, 256),
        (&shared, "pp=2,dp=2,tp=2", zero_bubble, 4, 3, none, true, 256),
        (&wide_mixture, "pp=2,tp=2", one_f_one_b, 2, 0, full, false, 256),
        (&wide_mixture, "pp=2,ep=2", one_f_one_b, 2, 0, full, false, 64),
        (&wide_mixture, "pp=2,dp=2,tp=2", one_f_one_b, 2, 2, none, true, 64),
        (&wide_mixture, "pp=2,cp=2,ep=2", one_f_one_b, 2, 3, none, false, 64),
        (&tied(mixture.clone()), "pp=2,tsp=4", zero_bubble, 4, 0, full, false, 1024),
        (&wide_mixture, "pp=2", zero_bubble, 2, 0, none, false, 1024),
        (&wide_shared, "pp=2,cp=2", zero_bubble, 2, 0, full, false, 256),
        (&four, "pp=2,tsp=2", one_f_one_b, 2, 3, none, false, 64),
    ];
    let points = [
        "first layer's attention norm output's gradients from v and k",
        "the last layer's down gradient in W",
        "the LM head's weight gradient joins its sum",
        "the LM head's weight gradient reduce-scattered",
        "the loss's backward in B",
        "the last layer's down gradient joins its sum in W",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stage_closed_form_is_exact_where_a_second_sweep_found_it_off_the_planner() {
    // Points a second sweep (every schedule and recomputation, 64 to 1024 tokens, mixtures tied
    // and wide) found the form off the planner's peak at, each now modelled; before, by how much:
    // - 1F1B beside tsp, a tied mixture: its first layer's o gradient joining its sum counted the
    //   positions, which the last owner's RoPE backward had freed (384 B above);
    // - zero bubble without replicas: W's o gradient joins its sum before what it reads (the
    //   attention output, kept or recomputed, and under SP its gathered output gradient) is freed
    //   (0.77% below); beside replicas it is made beside them (0.6%), and q's joins its sum once
    //   all-reduced, its unreduced copy live (0.41%); a mixture's last chunk going on past its
    //   head in W to q's (1 KB);
    // - under SP and full recomputation, the logits made in a forward beside the final norm's
    //   output, its gathered input freed (220 B);
    // - ZeRO-3 gathering a step an axis in a forward: the embedding table (0.6%), the LM head's
    //   weight (220 B), a routed expert over dp × cp (1.4%);
    // - interleaving beside cp: a forward beside the gradients of the chunks an unfinished
    //   micro-batch has finished (2.2 MB left out, hidden by another point but 220 B);
    // - GPipe beside cp under full recomputation: k and v recomputed over every token (0.3%);
    // - interleaving on four stages beside a wide tied mixture under full recomputation: the first
    //   stage taking the head's part ahead of the counts' sum all-reduced again, which follows it
    //   on the link (4% below beside cp, 1.8% beside tsp);
    // - interleaving on four stages beside cp or tsp: the last stage taking positions from the
    //   first ahead of the forward reading them, queued before an input gradient it reads (two
    //   micro-batches' positions, 0.09%).
    let [mixture, _] = four_layer_mixtures();
    let eight_wide_tied_mixture =
        tied(pleat_ir::model::config::ModelConfig { num_layers: 8, vocab_size: 2048, ..preset("tiny-moe").unwrap() });
    let tied_mixture = tied(mixture.clone());
    let wide_mixture = pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..mixture.clone() };
    let wide_tied_mixture = tied(wide_mixture.clone());
    let wide_tied = tied(pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..four_layers() });
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1);
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    let eight = eight_layers();
    let cases: [StageCase; 16] = [
        (&tied_mixture, "pp=2,tsp=2", one_f_one_b, 4, 0, selective, false, 64),
        (&tied_mixture, "pp=2,tp=2", zero_bubble, 4, 0, none, true, 64),
        (&tied_mixture, "pp=2,tp=2", zero_bubble, 4, 0, full, true, 64),
        (&tied_mixture, "pp=2,dp=2,tp=2", zero_bubble, 4, 2, full, true, 64),
        (&tied_mixture, "pp=2,dp=2", zero_bubble, 4, 1, none, false, 64),
        (&tied_mixture, "pp=2", zero_bubble, 4, 0, full, false, 64),
        (&wide_mixture, "pp=2,dp=2,tp=2", zero_bubble, 4, 3, full, true, 256),
        (&wide_mixture, "pp=2,cp=2,ep=2", zero_bubble, 4, 3, full, false, 256),
        (&wide_tied_mixture, "pp=2,cp=2,ep=2", zero_bubble, 4, 3, full, false, 64),
        (&mixture, "pp=2,dp=2,cp=2", zero_bubble, 4, 3, full, false, 256),
        (&wide_mixture, "pp=2,cp=2", interleaved, 4, 1, full, false, 256),
        (&wide_tied, "pp=2,cp=2", gpipe, 4, 3, full, false, 64),
        (&eight_wide_tied_mixture, "pp=4,cp=2", interleaved, 8, 1, full, false, 64),
        (&eight_wide_tied_mixture, "pp=4,tsp=2", interleaved, 8, 0, full, false, 64),
        (&tied(eight.clone()), "pp=4,cp=2", interleaved, 8, 1, none, false, 64),
        (&eight, "pp=4,tsp=2", interleaved, 8, 0, full, false, 512),
    ];
    let points = [
        "first layer's o gradient joins its sum",
        "the last layer's o gradient joins its sum in W",
        "the last layer's q gradient joins its sum in W",
        "every token's logits gathered in a forward",
        "first layer's o gradient reduce-scattered, its attention regathered",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stage_closed_form_is_exact_where_a_mixture_on_four_stages_sends_its_statistics() {
    // Eight layers of a mixture on four stages, where a deep sweep found the form below the
    // planner's peak: every stage sends each chunk's layers' statistics to the last.
    // - A stage between the first and the last holds the counts' sum it received through its
    //   first layer's q input gradient (GPipe, ZeRO-3) and its o gradient's reduce-scatter under
    //   full recomputation (1F1B): 32 B each.
    // - Interleaved, the last stage takes the first stage's statistics ahead of the last chunk's
    //   forward reading them, queued before an input gradient it reads (up to 192 B); under SP a
    //   chunk's last layer's statistics follow its output, so the stage before's come with its
    //   next output, not this one's (64 B above, once the first was counted).
    let mixture = pleat_ir::model::config::ModelConfig { num_layers: 8, ..preset("tiny-moe").unwrap() };
    let tied_mixture = tied(mixture.clone());
    let shared = pleat_ir::model::config::ModelConfig { num_layers: 8, ..with_a_shared_expert(32, true) };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    let cases: [StageCase; 6] = [
        (&tied_mixture, "pp=4,ep=2", ScheduleKind::GPipe, 8, 3, selective, false, 64),
        (&shared, "pp=4,ep=2", ScheduleKind::OneFOneB, 8, 3, full, false, 64),
        (&shared, "pp=4,ep=2", interleaved, 8, 3, full, false, 64),
        (&shared, "pp=4", interleaved, 8, 0, full, false, 64),
        (&shared, "pp=4,tsp=2", interleaved, 8, 0, selective, false, 512),
        (&mixture, "pp=4,tp=2", interleaved, 8, 0, none, true, 512),
    ];
    let points = [
        "first layer's q input gradient, its weight gathered again",
        "first layer's o gradient reduce-scattered, its attention regathered",
        "first layer's attention backward",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stage_closed_form_is_exact_where_a_third_sweep_found_it_off_the_planner() {
    // A third sweep, at tp=4 (gate's and up's outputs half the hidden size, no longer as large as
    // the MLP's output), over dp × ep × tp and cp=4, and to 1024 tokens, found the form off the
    // planner's peak at these points; before, by how much:
    // - zero bubble under SP and full recomputation, as the MLP's output is reduce-scattered in a
    //   forward: a dense MLP's norm output was counted, freed once up's output is made (3.8%
    //   above); on the last stage the final norm in a forward, on the last layer's output
    //   gathered over tp, was no point (0.5% below);
    // - over ep beside dp under SP, as the experts' backward is dispatched: the output gradient
    //   all-gathered over tp, which the dispatch copies, was left out (3% below);
    // - a mixture's chunk of two layers outside full recomputation: its last layer's attention
    //   norm output's gradients from v and k summed was no point (1 KB, and 0.9% beside dp);
    // - a dense chunk of two layers under full recomputation: its last layer's attention backward
    //   was no point (3% below beside cp=4 under ZeRO-3 at 1024 tokens, every token's k and v
    //   gathered);
    // - zero bubble at tp=4 on 1024 tokens: the loss's row statistics all-gathered over tp in a
    //   forward was no point (0.08% below, 0.1% for a mixture);
    // - ZeRO-3 under full recomputation and SP: the first layer's o gradient made, beside the
    //   attention's output recomputed and the residual's gradient gathered over tp, before its
    //   reduce-scatter, was no point (0.2% below over ep);
    // - (a fifth sweep) ZeRO-2 and 3 at dp=2 × tp=4 on 32 tokens: the last layer's up gradient
    //   reduce-scattered, beside up's input gradient, was no point (2.5% below); zero bubble
    //   beside tsp=2 × dp=4 under ZeRO-2 and full recomputation: W counted the first layer's gate
    //   gradient reduce-scattered, which tsp's B makes in its ring (0.5% above).
    let (four, ..) = four_layers_wide_and_tied();
    let biased = pleat_ir::model::config::ModelConfig {
        attention_bias: true,
        architecture: pleat_ir::model::config::Architecture::Qwen2,
        ..four.clone()
    };
    let [mixture, shared] = four_layer_mixtures();
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (gpipe, zero_bubble) = (ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1);
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four.clone() };
    let cases: [StageCase; 11] = [
        (&four, "pp=2,tp=4", zero_bubble, 4, 0, full, true, 256),
        (&biased, "pp=2,dp=2,tp=4", zero_bubble, 4, 1, full, true, 256),
        (&mixture, "pp=2,dp=2,ep=2,tp=2", ScheduleKind::OneFOneB, 4, 0, selective, true, 256),
        (&shared, "pp=2,tp=4", gpipe, 4, 0, selective, true, 256),
        (&shared, "pp=2,dp=2,tp=4", gpipe, 4, 1, none, true, 256),
        (&four, "pp=2,cp=4", ScheduleKind::OneFOneB, 4, 3, full, false, 1024),
        (&biased, "pp=2,dp=2,tp=4", zero_bubble, 4, 3, none, false, 1024),
        (&mixture, "pp=2,dp=2,tp=4", zero_bubble, 4, 3, none, false, 1024),
        (&mixture, "pp=2,ep=2,tp=2", ScheduleKind::OneFOneB, 4, 3, full, true, 64),
        (&four, "pp=2,dp=2,tp=4", ScheduleKind::OneFOneB, 4, 3, none, false, 32),
        (&tied, "pp=2,tsp=2,dp=4", zero_bubble, 4, 2, full, false, 32),
    ];
    let points = [
        "the last layer's experts' backward dispatched",
        "the last layer's attention norm output's gradients from v and k",
        "the last layer's attention backward",
        "first layer's o gradient made, its attention regathered",
        "the last layer's up gradient reduce-scattered",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stage_closed_form_is_exact_where_a_sixth_sweep_found_it_off_the_planner() {
    // A sixth sweep, over mixtures without the load-balancing loss, six query heads over one kv
    // head, and tsp=2 × dp=8, found the form off the planner's peak at these points; before, by
    // how much:
    // - a dense stage's first layer's gate gradient joining its sum under full recomputation
    //   (beside dp, its unreduced copy live) was no point: 1.8% below at dp=2, six heads;
    // - a mixture without the loss has no layer statistics: in zero bubble's forward its MLP norm
    //   output (and under ZeRO-3 its router) is freed once the experts have run, not kept for
    //   them (3.9% above as the MLP's output is reduce-scattered under SP, 3.3% beside a shared
    //   expert's scaled output);
    // - beside tp (or over ep) that mixture's router gradient, made before the experts' (or with
    //   them), is reduced after them, its sum not made as theirs join (4 KB above); over ep under
    //   SP its experts' input gradient is reduce-scattered over tp, not all-reduced (2.4% above,
    //   counting the output gradient gathered, freed by then); and beside a shared expert, the
    //   experts' input gradient joining the shared expert's (in place of the loss's router input
    //   gradient) was no point (4% below);
    // - under tsp with ZeRO-3 the first owner's attention kernel counted the attention norm
    //   output's gradient, first made of that owner's k and v parts after it (128 B above the
    //   peak, where ZeRO keeps the experts whole at dp=8).
    let odd_heads = pleat_ir::model::config::ModelConfig { num_heads: 6, num_kv_heads: 1, ..four_layers() };
    let [mixture, _] = four_layer_mixtures();
    let plain = with_routed_experts(&mixture, 8, false);
    let shared_plain = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, false) };
    let six_experts = with_routed_experts(&mixture, 6, true);
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1);
    let six_plain = with_routed_experts(&mixture, 6, false);
    let cases: [StageCase; 8] = [
        (&odd_heads, "pp=2,dp=2", one_f_one_b, 4, 1, full, false, 32),
        (&shared_plain, "pp=2,ep=2,tp=2", ScheduleKind::Interleaved { chunks: 2 }, 4, 3, selective, true, 256),
        (&plain, "pp=2,ep=2,tp=2", gpipe, 4, 0, none, true, 256),
        (&six_plain, "pp=2,ep=2,tp=2", gpipe, 4, 3, selective, true, 256),
        (&plain, "pp=2,dp=4,tp=4", zero_bubble, 4, 2, full, true, 128),
        (&shared_plain, "pp=2,tp=4", zero_bubble, 4, 0, full, true, 256),
        (&plain, "pp=2,tp=2", gpipe, 4, 0, none, true, 256),
        (&six_experts, "pp=2,tsp=2,dp=8", gpipe, 4, 3, selective, false, 256),
    ];
    let points = [
        "first layer's gate gradient joins its sum",
        "first layer's expert gradient joins its sum",
        "the last layer's expert gradient joins its sum",
        "first layer's MLP norm output's gradients summed",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stage_closed_form_is_exact_where_a_seventh_sweep_found_it_off_the_planner() {
    // A seventh sweep, over ZeRO-3 beside ep and tp, found the form off the planner's peak at
    // these points; before, by how much:
    // - at dp=4 × ep=4 dp splits q's 8 rows to 2, which ep does not divide: q's gradient is
    //   reduce-scattered over dp, then all-reduced over ep, and the tail counted its shard beyond
    //   the closed form's made during the first (1 KB above on 8 tokens);
    // - there a mixture's stage peaks as its first layer's o gradient is reduce-scattered, staged
    //   whole, a point not modelled (1.4% below on 64 tokens);
    // - a mixture without the load-balancing loss or a shared expert all-reduces its experts'
    //   input gradient over tp (under SP reduce-scatters it) only once their and the router's
    //   weight gradients have joined their sums, their weights gathered again (and under SP the
    //   gathered output gradient) freed (1.3% above at dp=2 × tp=4, with and without SP, 4 KB
    //   over ep=2 × tp=2 and ep=4 × tp=2, counting those weights, or the router's gradient);
    // - beside a shared expert without the loss, under SP, a stage peaks as the shared expert's
    //   gate input gradient joins up's, the two and their sum live (0.7% below at dp=2 × tp=4,
    //   0.5% at pp=4 × dp=2 × tp=2);
    // - under ZeRO-3 with full recomputation, up's input gradient made frees up's weight,
    //   gathered again for the recomputed forward, and under SP the gate vector's stays to its
    //   backward, which comes last (7.5 KB above as up's input gradient is all-reduced over tp).
    let [mixture, _] = four_layer_mixtures();
    let plain = with_routed_experts(&mixture, 8, false);
    let (none, selective) = (Recompute::None, Recompute::Selective);
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let shared_plain = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, false) };
    let six_shared = with_routed_experts(&four_layer_mixtures()[1], 6, true);
    let cases: [StageCase; 10] = [
        (&shared_plain, "pp=2,dp=2,tp=4", gpipe, 2, 2, none, true, 512),
        (&shared_plain, "pp=4,dp=2,tp=2", one_f_one_b, 4, 2, none, true, 1024),
        (&six_shared, "pp=2,dp=4,tp=2", one_f_one_b, 2, 3, Recompute::Full, true, 1024),
        (&mixture, "pp=2,dp=4,ep=4", one_f_one_b, 2, 3, selective, false, 8),
        (&plain, "pp=2,dp=2,tp=4", gpipe, 2, 2, none, true, 512),
        (&mixture, "pp=2,dp=4,ep=4", gpipe, 2, 3, selective, false, 64),
        (&plain, "pp=2,dp=2,tp=4", one_f_one_b, 2, 3, none, false, 512),
        (&plain, "pp=2,ep=2,tp=2", gpipe, 4, 3, none, false, 128),
        (&plain, "pp=2,ep=4,tp=2", ScheduleKind::Interleaved { chunks: 2 }, 4, 3, selective, false, 128),
        (&mixture, "pp=2,ep=4,tp=2", gpipe, 4, 3, none, false, 512),
    ];
    let points = [
        "tail of a backward",
        "first layer's o gradient reduce-scattered",
        "first layer's last expert gradient joins its sum, its unreduced copy live",
        "the last layer's routed experts' input gradient all-reduced over tp",
        "first layer's shared expert's gate input gradient joins up's",
        "the last layer's shared expert's gate input gradient joins up's",
        "the last layer's shared expert's up input gradient all-reduced over tp",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn stages_whose_kv_heads_tp_does_not_divide_equal_the_planners_peak() {
    // `tiny` has 4 kv heads: at tp=8 every tp rank holds all of k's and v's, so their gradients
    // are partial sums over tp. k's output gradient is all-reduced over tp before its RoPE
    // backward, v's weight gradient, whole over tp, after it is made (under ZeRO-2 and 3 after its
    // dp reduce-scatter). Before the form modelled it, a stage peaked as v's or k's weight
    // gradient joined its sum or was reduce-scattered, the form up to 3.9% below the planner
    // (1,488 of 11,700 checks of a sweep; 64 after, all under zero bubble, on the first chunk or
    // a mixture's). Beside cp=2 the same points hold (6.5% below before).
    let (tiny, _, tied) = four_layers_wide_and_tied();
    let biased = pleat_ir::model::config::ModelConfig {
        architecture: pleat_ir::model::config::Architecture::Qwen2,
        attention_bias: true,
        ..tiny.clone()
    };
    let plain = with_routed_experts(&four_layer_mixtures()[0], 8, false);
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1);
    let cases: [StageCase; 10] = [
        (&biased, "pp=2,tp=8", zero_bubble, 4, 0, none, true, 32),
        (&biased, "pp=2,tp=8", one_f_one_b, 2, 1, none, false, 32),
        (&biased, "pp=2,dp=2,tp=8", zero_bubble, 2, 3, none, false, 32),
        (&tiny, "pp=2,dp=2,tp=8", one_f_one_b, 2, 2, full, false, 32),
        (&tied, "pp=2,tp=8", zero_bubble, 4, 0, none, true, 32),
        (&plain, "pp=2,tp=8", one_f_one_b, 2, 1, none, false, 32),
        (&tied, "pp=2,dp=2,tp=8", one_f_one_b, 2, 3, full, false, 32),
        (&tiny, "pp=2,dp=2,tp=8", one_f_one_b, 2, 3, selective, false, 32),
        (&tiny, "pp=2,dp=2,tp=8", one_f_one_b, 2, 1, none, false, 32),
        (&tiny, "pp=2,cp=2,tp=8", one_f_one_b, 2, 3, selective, false, 32),
    ];
    let points = [
        "first layer's v weight gradient, whole over tp, reduce-scattered",
        "first layer's k weight gradient, whole over tp, reduce-scattered",
        "first layer's v weight gradient, all-reduced over tp, joins its sum",
        "first layer's k weight gradient, whole over tp, joins its sum",
        "first layer's k weight gradient, whole over tp, reduce-scattered in W",
        "first layer's v weight gradient, all-reduced over tp, joins its sum in W",
        "first layer's k weight gradient, whole over tp, joins its sum in W",
        "the last layer's k weight gradient, whole over tp, reduce-scattered",
    ];
    assert_exact_peaking_at(&cases, &points);
}

#[test]
fn training_closed_form_is_exact_where_tp_does_not_divide_the_kv_heads() {
    // The unpipelined step of `tiny` at dp=2 × tp=8 under ZeRO-2 and 3 peaks as its last layer's
    // k weight gradient, whole over tp, is reduce-scattered over dp (staged whole), on few tokens:
    // the form was up to 1.1% below the planner before it modelled the point.
    let layouts: Vec<TrainingLayout> = [(2, Recompute::None), (3, Recompute::Selective), (2, Recompute::Selective)]
        .into_iter()
        .map(|(zero_stage, recompute)| TrainingLayout {
            zero_stage,
            ..TrainingLayout::recomputing("dp=2,tp=8", false, recompute)
        })
        .collect();
    let phases = check_training_closed_form(&four_layers(), &layouts, &[16]);
    let point = "a k weight gradient, whole over tp, reduce-scattered";
    assert!(phases.contains_key(point), "{point} is never the peak: {phases:?}");
}

#[test]
fn a_layers_tp_all_reduces_are_the_comm_models_where_tp_does_not_divide_the_kv_heads() {
    // The cost model's all-reduces of one layer over tp (`volume::layer_collectives`), forward and
    // backward, are the bytes the compiled training step all-reduces over tp for its first layer:
    // at tp=8 on `tiny`'s 4 kv heads also k's output gradient, v's weight gradient and the
    // attention's input gradient twice; at tp=4 (a kv head a rank) the backward mirrors the
    // forward.
    let config = four_layers();
    let model = ModelShape::from_config(&config);
    let (batch, seq) = (2, 16);
    for (mesh, kv_replicated) in [("tp=8", true), ("tp=4", false)] {
        let (programs, _) = compile_training_at(&config, &TrainingLayout::new(mesh, false, 0), batch, seq);
        let program = &programs[0];
        let mut compiled = 0u64;
        for instr in &program.instructions {
            if let Instr::AllReduce { outs, group, .. } = instr {
                let of_the_first_layer =
                    |name: &str| name.starts_with("layer0.") || name.starts_with("grad.model.layers.0.");
                for &out in outs.iter().filter(|&&out| of_the_first_layer(&program.buffer(out).name)) {
                    assert_eq!(group.axis, "tp", "{mesh}: {}", program.buffer(out).name);
                    compiled += program.buffer(out).numel() * 4;
                }
            }
        }
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
        let calls = layer_collectives(&model, &layout, &Workload::training(seq, batch));
        let modelled: f64 = calls
            .iter()
            .filter(|call| call.kind == Collective::AllReduce && call.axis == AxisName::Tp)
            .map(|call| call.count * call.bytes)
            .sum();
        assert_eq!(compiled as f64, modelled, "{mesh}: {calls:?}");
        let replicated = calls.iter().any(|call| call.what.contains("k and v replicated over tp"));
        assert_eq!(replicated, kv_replicated, "{mesh}");
    }
}

/// A pipelined layout of one sequence a micro-batch: the model, the mesh, the schedule, the
/// micro-batches, the ZeRO stage, the recomputation, SP, and the sequence's tokens.
type StageCase<'a> =
    (&'a pleat_ir::model::config::ModelConfig, &'static str, ScheduleKind, u32, u8, Recompute, bool, u64);

/// Asserts every stage of every case exact to the byte, and each of `points` some stage's peak.
fn assert_exact_peaking_at(cases: &[StageCase], points: &[&str]) {
    let mut names = std::collections::BTreeSet::new();
    for &(config, mesh, kind, micro_batches, zero, recompute, sp, seq) in cases {
        let layout = PipelinedLayout::one_sequence_a_micro_batch(mesh, kind, micro_batches, zero, recompute, sp);
        assert_exact_at(&mut names, config, &layout, seq);
    }
    for name in points {
        assert!(names.contains(name), "{name} is never the peak: {names:?}");
    }
}

#[test]
fn zero2_stage_closed_form_equals_the_planners_peak_on_deeper_stages() {
    // Eight layers, four a stage: under ZeRO-2 a stage peaks at its last gradient's
    // reduce-scatter or inside its first layer's backward, at the gate gradient's.
    let config = eight_layers();
    for (kind, recompute) in [
        (ScheduleKind::GPipe, Recompute::None),
        (ScheduleKind::OneFOneB, Recompute::None),
        (ScheduleKind::OneFOneB, Recompute::Full),
    ] {
        let layout = PipelinedLayout { recompute, zero_stage: 2, ..PipelinedLayout::new("pp=2,dp=2", kind, 2) };
        check_stage_closed_form(&config, &layout);
    }
}

#[test]
fn zero3_stage_closed_form_equals_the_planners_peak_under_full_recomputation() {
    // The first layer's weights are gathered again for its recomputed forward: a stage peaks as
    // its down projection's gradient is reduce-scattered beside the gathered MLP weights, or (on
    // an interleaved chunk) its output projection's beside the gathered attention weights; under
    // zero bubble the final norm's regathered weight stays to W.
    let (four, eight) = (four_layers(), eight_layers());
    for (config, kind) in [
        (&four, ScheduleKind::OneFOneB),
        (&eight, ScheduleKind::GPipe),
        (&eight, ScheduleKind::OneFOneB),
        (&eight, ScheduleKind::ZeroBubbleH1),
        (&eight, ScheduleKind::Interleaved { chunks: 2 }),
        (&eight, ScheduleKind::Interleaved { chunks: 4 }),
    ] {
        let layout =
            PipelinedLayout { recompute: Recompute::Full, zero_stage: 3, ..PipelinedLayout::new("pp=2,dp=2", kind, 2) };
        check_stage_closed_form(config, &layout);
    }
}

#[test]
fn zero_stage_closed_form_beside_tp_equals_the_planners_peak() {
    // ZeRO-2 and 3 beside dp × tp: the first stage's other candidate is the embedding rows sliced
    // from the whole-vocabulary gradient before their reduce-scatter starts (no staging yet; under
    // zero bubble beside what W still reads).
    let (four, eight) = (four_layers(), eight_layers());
    let zero = |kind, zero_stage, recompute, sequence_parallel| PipelinedLayout {
        recompute,
        sequence_parallel,
        zero_stage,
        ..PipelinedLayout::new("pp=2,dp=2,tp=2", kind, 2)
    };
    let (none, full) = (Recompute::None, Recompute::Full);
    for (config, layout) in [
        (&four, zero(ScheduleKind::OneFOneB, 2, none, false)),
        (&four, zero(ScheduleKind::GPipe, 3, none, false)),
        (&four, zero(ScheduleKind::OneFOneB, 2, none, true)),
        (&four, zero(ScheduleKind::OneFOneB, 3, full, true)),
        (&four, zero(ScheduleKind::OneFOneB, 2, Recompute::Selective, false)),
        (&four, zero(ScheduleKind::ZeroBubbleH1, 2, none, false)),
        (&four, zero(ScheduleKind::ZeroBubbleH1, 3, full, false)),
        (&eight, zero(ScheduleKind::Interleaved { chunks: 2 }, 3, none, true)),
    ] {
        check_stage_closed_form(config, &layout);
    }
}

#[test]
fn cp_stage_closed_form_equals_the_planners_peak_under_recomputation_and_beside_dp() {
    // Ring attention's k and v are every token's, all-gathered: recomputed so, and kept so for
    // zero bubble's W under selective and full recomputation.
    let (four, eight) = (four_layers(), eight_layers());
    for (config, mesh, kind, recompute, micro_batches) in [
        (&four, "pp=2,cp=2", ScheduleKind::OneFOneB, Recompute::Selective, 2u32),
        (&four, "pp=4,cp=2", ScheduleKind::OneFOneB, Recompute::Full, 4),
        (&four, "pp=2,cp=4", ScheduleKind::GPipe, Recompute::Full, 2),
        (&four, "pp=2,cp=2", ScheduleKind::ZeroBubbleH1, Recompute::Selective, 2),
        (&four, "pp=2,cp=2", ScheduleKind::ZeroBubbleH1, Recompute::Full, 4),
        (&eight, "pp=2,cp=2", ScheduleKind::Interleaved { chunks: 2 }, Recompute::Full, 2),
    ] {
        let layout = PipelinedLayout { recompute, ..PipelinedLayout::new(mesh, kind, micro_batches) };
        check_stage_closed_form(config, &layout);
    }
    // Beside dp, with ZeRO 0, 2 and 3 (the gradients reduce-scattered over dp and then over cp,
    // whose ranks hold the same weights; under zero bubble by W): the first layer's kept k and v
    // are every token's as its gate gradient is scattered. And on cp alone, ZeRO over cp.
    for (mesh, kind, recompute, zero_stage) in [
        ("pp=2,dp=2,cp=2", ScheduleKind::OneFOneB, Recompute::None, 0u8),
        ("pp=2,dp=2,cp=2", ScheduleKind::GPipe, Recompute::Full, 0),
        ("pp=2,dp=2,cp=2", ScheduleKind::OneFOneB, Recompute::None, 2),
        ("pp=2,dp=2,cp=2", ScheduleKind::GPipe, Recompute::Selective, 2),
        ("pp=2,dp=2,cp=2", ScheduleKind::OneFOneB, Recompute::None, 3),
        ("pp=2,dp=2,cp=2", ScheduleKind::Interleaved { chunks: 2 }, Recompute::None, 2),
        ("pp=2,dp=2,cp=2", ScheduleKind::ZeroBubbleH1, Recompute::Selective, 2),
        ("pp=2,dp=2,cp=2", ScheduleKind::ZeroBubbleH1, Recompute::Full, 3),
        ("pp=2,cp=2", ScheduleKind::OneFOneB, Recompute::None, 2),
        ("pp=2,cp=2", ScheduleKind::ZeroBubbleH1, Recompute::Full, 2),
        ("pp=2,cp=2", ScheduleKind::GPipe, Recompute::Full, 3),
    ] {
        let layout = PipelinedLayout { recompute, zero_stage, ..PipelinedLayout::new(mesh, kind, 2) };
        check_stage_closed_form(&four, &layout);
    }
}

#[test]
fn tp_cp_stage_closed_form_equals_the_planners_peak() {
    // tp beside cp: heads and ffn channels split over tp, tokens over cp (every token's k and v,
    // and the logits every token's over the rank's vocabulary shard). Under SP beside cp the
    // stream is split only inside each layer: the embedding's output, each layer's output and what
    // a stage sends on are whole over tp, and so are the input gradients a stage sends back.
    let (four, eight) = (four_layers(), eight_layers());
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let (one_f_one_b, gpipe, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1);
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    for sequence_parallel in [false, true] {
        let cases = [
            (&four, one_f_one_b, none, 2),
            (&four, one_f_one_b, selective, 4),
            (&four, one_f_one_b, full, 2),
            (&four, gpipe, none, 2),
            (&four, gpipe, full, 2),
            (&four, zero_bubble, none, 2),
            (&four, zero_bubble, selective, 2),
            (&four, zero_bubble, full, 4),
            (&eight, interleaved, none, 2),
            (&eight, interleaved, full, 2),
        ];
        for (config, kind, recompute, micro_batches) in cases {
            let layout = PipelinedLayout {
                recompute,
                sequence_parallel,
                ..PipelinedLayout::new("pp=2,tp=2,cp=2", kind, micro_batches)
            };
            check_stage_closed_form(config, &layout);
        }
        // Beside dp, with ZeRO 0, 2 and 3 (over dp × cp: with 8 kv heads, so that k's and v's 4 rows
        // a tp rank divide over it; 4 kv heads leave them split over dp alone, which the stage's
        // closed form declines).
        let heads = pleat_ir::model::config::ModelConfig { num_kv_heads: 8, ..four.clone() };
        for (kind, recompute, zero_stage) in
            [(one_f_one_b, none, 0u8), (one_f_one_b, none, 2), (gpipe, full, 3), (zero_bubble, selective, 0)]
        {
            let layout = PipelinedLayout {
                recompute,
                sequence_parallel,
                zero_stage,
                ..PipelinedLayout::new("pp=2,dp=2,tp=2,cp=2", kind, 2)
            };
            check_stage_closed_form(if zero_stage >= 2 { &heads } else { &four }, &layout);
        }
    }
}

/// The pipelined layouts a mixture of experts' stage closed form is checked on: layers (of
/// `tiny-moe`'s shape), mesh, schedule and micro-batches. Every expert on every rank or experts/ep
/// over ep, beside dp, cp, tp and ep; GPipe, 1F1B, interleaved and zero bubble.
const MIXTURE_STAGE_CROSS_CHECK: [(u64, &str, ScheduleKind, u32); 46] = [
    (4, "pp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2", ScheduleKind::GPipe, 2),
    (8, "pp=2", ScheduleKind::OneFOneB, 4),
    (4, "pp=2,dp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,dp=2", ScheduleKind::GPipe, 2),
    (4, "pp=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,dp=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=4", ScheduleKind::OneFOneB, 4),
    (4, "pp=4", ScheduleKind::GPipe, 4),
    (8, "pp=4", ScheduleKind::GPipe, 4),
    (4, "pp=4,dp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2", ScheduleKind::Interleaved { chunks: 2 }, 2),
    (4, "pp=2", ScheduleKind::Interleaved { chunks: 2 }, 4),
    (8, "pp=2", ScheduleKind::Interleaved { chunks: 2 }, 4),
    (8, "pp=4", ScheduleKind::Interleaved { chunks: 2 }, 4),
    (4, "pp=2,dp=2", ScheduleKind::Interleaved { chunks: 2 }, 2),
    (4, "pp=2,dp=2,tp=2", ScheduleKind::Interleaved { chunks: 2 }, 2),
    (4, "pp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2", ScheduleKind::ZeroBubbleH1, 4),
    (8, "pp=2", ScheduleKind::ZeroBubbleH1, 4),
    (4, "pp=4", ScheduleKind::ZeroBubbleH1, 4),
    (8, "pp=4", ScheduleKind::ZeroBubbleH1, 4),
    (4, "pp=2,tp=2", ScheduleKind::ZeroBubbleH1, 4),
    (8, "pp=4,tp=2", ScheduleKind::ZeroBubbleH1, 4),
    // Over ep (the dense gradients all-reduced over it as over dp, the experts' not).
    (4, "pp=2,ep=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,ep=2", ScheduleKind::GPipe, 2),
    (8, "pp=2,ep=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,ep=2", ScheduleKind::Interleaved { chunks: 2 }, 2),
    (8, "pp=2,ep=2", ScheduleKind::Interleaved { chunks: 2 }, 2),
    (4, "pp=2,ep=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2,ep=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,ep=2,tp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2,dp=2,ep=2", ScheduleKind::OneFOneB, 1),
    (4, "pp=2,dp=2,ep=2", ScheduleKind::GPipe, 1),
    (4, "pp=4,ep=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=4,ep=2", ScheduleKind::GPipe, 2),
    (4, "pp=4,ep=2", ScheduleKind::ZeroBubbleH1, 2),
    // Zero bubble beside dp: B reduces the first expert gradient while the other two wait.
    (4, "pp=2,dp=2", ScheduleKind::ZeroBubbleH1, 2),
    (8, "pp=2,dp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=4,dp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2,dp=2,tp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2,dp=2,ep=2", ScheduleKind::ZeroBubbleH1, 1),
    // Beside cp (which reduces the gradients as dp does).
    (4, "pp=2,cp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,cp=2", ScheduleKind::GPipe, 4),
    (4, "pp=2,cp=2", ScheduleKind::ZeroBubbleH1, 4),
    (4, "pp=2,dp=2,cp=2", ScheduleKind::ZeroBubbleH1, 2),
];

/// Pipelined layouts beside tp under Megatron SP on which a mixture's stage closed form is checked:
/// (layers, mesh, schedule, micro-batches).
const MIXTURE_SEQUENCE_PARALLEL_LAYOUTS: [(u64, &str, ScheduleKind, u32); 8] = [
    (4, "pp=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,tp=2", ScheduleKind::GPipe, 2),
    (8, "pp=2,tp=2", ScheduleKind::Interleaved { chunks: 2 }, 4),
    (4, "pp=2,tp=2", ScheduleKind::ZeroBubbleH1, 4),
    (4, "pp=2,tp=2", ScheduleKind::ZeroBubbleH1, 2),
    (4, "pp=2,dp=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=2,ep=2,tp=2", ScheduleKind::OneFOneB, 2),
    (4, "pp=4,tp=2", ScheduleKind::OneFOneB, 4),
];

/// `config` with its layers set to each of [`MIXTURE_SEQUENCE_PARALLEL_LAYOUTS`]'s, beside that
/// layout under SP, for each recomputation.
fn mixture_sequence_parallel_cases(
    config: &pleat_ir::model::config::ModelConfig,
) -> Vec<(pleat_ir::model::config::ModelConfig, PipelinedLayout)> {
    let mut cases = Vec::new();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (layers, mesh, kind, micro_batches) in MIXTURE_SEQUENCE_PARALLEL_LAYOUTS {
            let layout = PipelinedLayout {
                recompute,
                sequence_parallel: true,
                ..PipelinedLayout::new(mesh, kind, micro_batches)
            };
            cases.push((pleat_ir::model::config::ModelConfig { num_layers: layers, ..config.clone() }, layout));
        }
    }
    cases
}

/// Checks the stage closed form of `config` (its layers set to each of
/// [`MIXTURE_STAGE_CROSS_CHECK`]'s) on every layout there, each recomputation; returns the names
/// of the peaks.
fn check_mixture_stages(config: &pleat_ir::model::config::ModelConfig) -> std::collections::BTreeSet<&'static str> {
    let mut phases = std::collections::BTreeSet::new();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (layers, mesh, kind, micro_batches) in MIXTURE_STAGE_CROSS_CHECK {
            let config = pleat_ir::model::config::ModelConfig { num_layers: layers, ..config.clone() };
            let layout = PipelinedLayout { recompute, ..PipelinedLayout::new(mesh, kind, micro_batches) };
            check_stage_closed_form(&config, &layout);
            phases.extend(stage_phase_names(&config, &layout));
        }
    }
    phases
}

#[test]
fn experts_stage_closed_form_equals_the_planners_peak() {
    // tiny-moe (every expert on every rank, or experts/ep over ep; with its load-balancing loss)
    // on two and four stages:
    // a stage may peak inside its first layer's backward as a routed-expert gradient joins its
    // sum, with that layer's attention activations still live (under dp the other two expert
    // gradients wait unreduced beside it); the stages but the last keep their layers' expert
    // counts and router probability sums, sent on, the last their counts' sum, to each
    // micro-batch's end; the last sends that sum back in its forward, which under GPipe the stage
    // next to it takes for every micro-batch its own backward waits behind. Under interleaving
    // every micro-batch holds the sum it received to its end, and the last stage's other chunks
    // hand their statistics to its last chunk on the same rank. Under zero bubble B makes the
    // experts' gradients: a micro-batch between B and W keeps them, and a stage may peak in B as
    // one joins its sum. A stage between the first and the last keeps the counts' sum it received
    // to the end of the micro-batch's backward. Over ep the dense gradients are all-reduced over
    // it (as over dp) and the experts' not, and the router's gradients from the load-balancing
    // loss wait for the dispatch's.
    let config = preset("tiny-moe").unwrap();
    let phases = check_mixture_stages(&config);
    // Every kind of peak occurs.
    for phase in [
        "first layer's expert gradient joins its sum",
        "first layer's expert gradient joins its sum in B",
        "tail of a backward",
    ] {
        assert!(phases.contains(phase), "{phase}: {phases:?}");
    }
    // Under Megatron SP the experts read the output gradient all-gathered over tp (but beside dp,
    // where it is freed before the all-reduce).
    for (config, layout) in mixture_sequence_parallel_cases(&config) {
        check_stage_closed_form(&config, &layout);
    }
}

#[test]
fn experts_on_tsp_stage_closed_form_equals_the_planners_peak() {
    // tsp splitting a mixture's routed experts: the attention's owners as for a dense model, the
    // MoE layer dispatched over the axis as over ep (one instruction makes the layer's expert
    // gradients), but the tokens are the sequence's share, not another batch: the dense
    // gradients are the rank's blocks, not reduced over the axis, and the router's and the norms'
    // all-reduced over it; the counts' sum all-reduced over it too, so that under full
    // recomputation the last stage sends it again in each backward. A stage may peak inside its
    // first layer's MoE backward beside every owner's attention activations (past the dispatch as
    // the router's two gradients are summed, before their all-reduce), at the LM head's
    // gradient (under full recomputation as the final norm's output is regathered for it), or
    // under full recomputation in its last layer's attention backward, the residual stream of
    // the layers below live. Under zero bubble B makes the experts' gradients (a micro-batch
    // between B and W keeps them) and runs the owners' attention backward beside what W reads of
    // the head (every token's, the load-balancing loss among them); a stage may peak as a
    // forward dispatches its last layer's experts, or as the first chunk's B gathers the
    // embedding output's gradient; under ZeRO-3 the forward's dispatch holds the router and the
    // rank's experts gathered over dp for it. tsp at 2 and 4, alone and beside dp (ZeRO 0-3),
    // GPipe, 1F1B, interleaved and zero bubble, each recomputation, 8, 256 and 1024 tokens.
    let config = pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() };
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (interleaved, zero_bubble) = (ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1);
    let cases: [(&str, ScheduleKind, u32, u8); 11] = [
        ("pp=2,tsp=2", one_f_one_b, 2, 0),
        ("pp=2,tsp=2", gpipe, 4, 0),
        ("pp=2,tsp=4", interleaved, 2, 0),
        ("pp=4,tsp=2", one_f_one_b, 4, 0),
        ("pp=2,dp=2,tsp=2", interleaved, 2, 0),
        ("pp=2,dp=2,tsp=2", gpipe, 2, 2),
        ("pp=2,dp=2,tsp=4", one_f_one_b, 2, 3),
        ("pp=2,tsp=2", zero_bubble, 4, 0),
        ("pp=2,tsp=4", zero_bubble, 2, 0),
        ("pp=4,tsp=2", zero_bubble, 4, 0),
        ("pp=2,dp=2,tsp=2", zero_bubble, 2, 1),
    ];
    let mut names = std::collections::BTreeSet::new();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (mesh, kind, micro_batches, zero_stage) in cases {
            let layout = PipelinedLayout { recompute, zero_stage, ..PipelinedLayout::new(mesh, kind, micro_batches) };
            for seq in [SEQ, 256] {
                assert_exact_at(&mut names, &config, &layout, seq);
            }
        }
    }
    // On 1024 tokens under full recomputation the last layer's attention backward; under zero
    // bubble the last stage's head of B.
    for (mesh, kind, micro_batches) in
        [("pp=2,tsp=2", one_f_one_b, 4), ("pp=2,dp=2,tsp=4", one_f_one_b, 2), ("pp=2,tsp=4", zero_bubble, 2)]
    {
        let layout = PipelinedLayout { recompute: Recompute::Full, ..PipelinedLayout::new(mesh, kind, micro_batches) };
        assert_exact_at(&mut names, &config, &layout, 1024);
    }
    // Under zero bubble with ZeRO-2 and 3 beside dp, four micro-batches of a sequence: a forward
    // may peak as it dispatches its last layer's experts, under ZeRO-3 beside their weights
    // gathered over dp.
    for (zero_stage, recompute) in [(2, Recompute::Selective), (3, Recompute::None), (3, Recompute::Full)] {
        let layout = PipelinedLayout {
            batch: 8,
            recompute,
            zero_stage,
            ..PipelinedLayout::new("pp=2,dp=2,tsp=2", zero_bubble, 4)
        };
        for seq in [SEQ, 256] {
            assert_exact_at(&mut names, &config, &layout, seq);
        }
    }
    // Beside dp under zero bubble, two sequences a micro-batch on 64 tokens: the first stage peaks
    // in B as the last of the first layer's expert gradients joins its sum, the other two reduced
    // and joined, its own unreduced copy live.
    let layout = PipelinedLayout { batch: 8, ..PipelinedLayout::new("pp=2,dp=2,tsp=2", zero_bubble, 2) };
    assert_exact_at(&mut names, &config, &layout, 64);
    for name in [
        "first layer's last expert gradient joins its sum in B, its unreduced copy live",
        "first layer's MLP norm output's gradients summed",
        "first layer's router gradients summed past the dispatch",
        "the LM head's weight gradient joins its sum",
        "the final norm's output regathered for the LM head's gradient",
        "the last layer's attention kernel backward: the last owner's v gradient",
        "first layer's o gradient reduced to this rank, its owner",
        "tail of a backward",
        "first layer's experts' backward dispatched in B",
        "the embedding output's gradient gathered in B",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn experts_over_ep_beside_tsp_stage_closed_form_equals_the_planners_peak() {
    // ep placing a mixture's routed experts beside tsp, which then keeps them whole: each tsp rank
    // runs its own tokens through the rank's share over ep, so the experts' and the router's
    // gradients are partial sums over tsp, each all-reduced over it before it joins its sum, as
    // over dp (the other two expert gradients wait unreduced beside the first, the MLP norm's
    // output freed; under ZeRO-3 the router's weight gathered again freed too, the MLP norm's
    // gathered under full recomputation not). ZeRO splits the dense parameters over ep (and dp),
    // the experts over dp only: under ZeRO-3 a tsp attention's points hold the rank's own blocks
    // gathered again, each from its first broadcast (in the first owner's backward) to its last
    // (the last owner's), and a stage may peak as the first owner's q input gradient joins the
    // attention norm output's, every other owner's activations live beside them. tsp × ep in
    // either order and beside dp, GPipe, 1F1B, interleaved and zero bubble, ZeRO 0 to 3, each
    // recomputation, 8, 64 and 256 tokens, one sequence a micro-batch. Under zero bubble with
    // ZeRO-3 B's first owner's q part holds the four blocks gathered (1% below before), and under
    // full recomputation the last chunk's W the final norm's weight B gathered again for it.
    let config = pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() };
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (interleaved, zero_bubble) = (ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1);
    let cases: [(&str, ScheduleKind, u32, u8); 10] = [
        ("pp=2,ep=2,tsp=2", one_f_one_b, 2, 0),
        ("pp=2,ep=2,tsp=2", gpipe, 4, 1),
        ("pp=2,ep=2,tsp=2", interleaved, 2, 2),
        ("pp=2,ep=2,tsp=2", zero_bubble, 4, 0),
        ("pp=2,ep=2,tsp=2", one_f_one_b, 4, 3),
        ("pp=2,ep=2,tsp=2", gpipe, 2, 3),
        ("pp=2,tsp=2,ep=2", interleaved, 2, 3),
        ("pp=2,dp=2,ep=2,tsp=2", one_f_one_b, 2, 0),
        ("pp=2,dp=2,ep=2,tsp=2", zero_bubble, 4, 2),
        ("pp=2,ep=2,tsp=2", zero_bubble, 2, 3),
    ];
    let mut names = std::collections::BTreeSet::new();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (mesh, kind, micro_batches, zero_stage) in cases {
            let layout =
                PipelinedLayout::one_sequence_a_micro_batch(mesh, kind, micro_batches, zero_stage, recompute, false);
            // (The stage's parameters too, and the cost model's peak plus the named differences.)
            check_stage_closed_form(&config, &layout);
            for seq in [SEQ, 64, 256] {
                assert_exact_at(&mut names, &config, &layout, seq);
            }
        }
    }
    for name in [
        "first layer's last expert gradient joins its sum, its unreduced copy live",
        "first layer's q input gradient joins the attention norm output's, the first owner's",
        "first layer's o gradient reduced to this rank, the first owner",
        "first layer's attention backward in B: the first owner's q part of the input gradient summed",
        "the last layer's o gradient reduced to this rank, its owner, in W",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn shared_expert_on_tsp_stage_closed_form_equals_the_planners_peak() {
    // A Qwen2-MoE shared expert beside routed experts split over tsp: tsp runs it as a ring MLP,
    // as a dense layer's, whose forward keeps only its output (and the gate logit beside it), and
    // whose backward recomputes gate and up a shard at a time beside the ring output's gradient
    // and the gate vector's input gradient, the rank's own gradient of each shard joining its sum
    // at the ring's last step. Past the ring its input gradient joins the gate vector's. A stage
    // may peak inside the first layer's ring or the last layer's (at the head of a backward), and
    // the routed experts' points hold the ring's gradients, tsp's share. Under zero bubble B runs
    // the ring (its gradients B's), W reads the gate logit's gradient and the MLP norm's output
    // (kept to the micro-batch's end) for the gate vector's, and a forward may peak inside the
    // last layer's shared expert ring (under ZeRO-3 beside the ring's weights, gathered over dp);
    // under ZeRO-2 the gate vector's gradient, all-reduced over tsp, is reduce-scattered over dp
    // at W's head. A shared expert a quarter of the hidden size wide and eight times it, tsp at 2
    // and 4, alone and beside dp (ZeRO 1, 2 and 3 in each order; ZeRO-3 also at dp=4, where k's
    // and v's rows do not divide and their gradients' sums stay whole), GPipe,
    // 1F1B, interleaved and zero bubble, each recomputation, 8 and 256 tokens, one sequence a
    // micro-batch.
    let (one_f_one_b, gpipe, interleaved) =
        (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::Interleaved { chunks: 2 });
    let zero_bubble = ScheduleKind::ZeroBubbleH1;
    let cases: [(&str, ScheduleKind, u32, u8); 15] = [
        ("pp=2,tsp=2", gpipe, 4, 0),
        ("pp=2,tsp=4", interleaved, 2, 0),
        ("pp=4,tsp=2", one_f_one_b, 4, 0),
        ("pp=2,dp=2,tsp=2", interleaved, 2, 1),
        ("pp=2,dp=2,tsp=2", one_f_one_b, 2, 2),
        ("pp=2,dp=2,tsp=2", gpipe, 2, 3),
        ("pp=2,tsp=2", zero_bubble, 4, 0),
        ("pp=2,tsp=4", zero_bubble, 2, 0),
        ("pp=4,tsp=2", zero_bubble, 4, 0),
        ("pp=2,dp=2,tsp=2", zero_bubble, 2, 1),
        ("pp=2,dp=2,tsp=2", zero_bubble, 2, 2),
        ("pp=2,dp=2,tsp=2", zero_bubble, 4, 2),
        ("pp=2,dp=2,tsp=2", zero_bubble, 4, 3),
        ("pp=2,dp=4,tsp=2", zero_bubble, 2, 3),
        // (The first layer's experts' points hold none of its k and v gradients, kept whole at
        // dp=4: 1.5% above before.)
        ("pp=2,dp=4,tsp=2", one_f_one_b, 4, 3),
    ];
    let mut names = std::collections::BTreeSet::new();
    for width in [32, 1024] {
        let config = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(width, true) };
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for (mesh, kind, micro_batches, zero_stage) in cases {
                let layout = PipelinedLayout::one_sequence_a_micro_batch(
                    mesh,
                    kind,
                    micro_batches,
                    zero_stage,
                    recompute,
                    false,
                );
                for seq in [SEQ, 256] {
                    assert_exact_at(&mut names, &config, &layout, seq);
                }
            }
        }
    }
    // On 1024 tokens the last layer's ring, at the head of the backward.
    let config = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(1024, true) };
    for (mesh, kind, micro_batches, zero_stage) in [("pp=2,tsp=2", one_f_one_b, 4, 0), ("pp=2,dp=2,tsp=2", gpipe, 2, 2)]
    {
        let layout = PipelinedLayout { zero_stage, ..PipelinedLayout::new(mesh, kind, micro_batches) };
        assert_exact_at(&mut names, &config, &layout, 1024);
    }
    for name in [
        "first layer's shared expert ring backward: the down contribution from the SiLU product",
        "first layer's shared expert ring backward: a weight gradient joins its sum",
        "first layer's shared expert ring backward: a weight gradient made, unreduced",
        "the last layer's shared expert ring backward: gate's output gradient",
        "first layer's experts' backward dispatched",
    ] {
        assert!(names.contains(name), "{name}: {names:?}");
    }
}

#[test]
fn mixture_stage_closed_form_equals_the_planners_peak_on_more_tokens() {
    // On more tokens a mixture's activations outweigh its gradients, and a stage peaks inside a
    // backward rather than at its tail: at the head of a backward (the output gradient's two parts
    // received and summed, a shared expert's down, up and gate gradients made and joining their
    // sums, the experts' backward dispatched over ep or their input gradient all-reduced over tp,
    // an expert gradient joining its sum, the MLP norm output's gradients summed, the attention
    // residual's gradient), inside the first layer's attention backward (the kernel's, then the
    // attention norm output's gradients from v, k and q summed), and under full recomputation the
    // same inside the last layer's attention backward, the layers below still holding their
    // residual stream. tiny-moe, a narrow shared expert with the load-balancing loss and a wide
    // one (eight times the hidden size) without, each recomputation, 64 to 1024 tokens a
    // sequence, every layout of the stage table. Exact outside zero bubble (beside dp, cp, ep and
    // tp); under zero bubble (whose B, W's head, the last layer's q gradient in W and the forwards
    // are modelled, beside the micro-batches between their B and W) below the planner's peak,
    // never above, within 3%, and exact on 99 stages in 100.
    let configs = [preset("tiny-moe").unwrap(), with_a_shared_expert(32, true), with_a_shared_expert(1024, false)];
    let mut exact_at = std::collections::BTreeMap::<&str, usize>::new();
    let (mut zero_bubble_stages, mut zero_bubble_exact) = (0, 0);
    for config in &configs {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for (layers, mesh, kind, micro_batches) in MIXTURE_STAGE_CROSS_CHECK {
                let config = pleat_ir::model::config::ModelConfig { num_layers: layers, ..config.clone() };
                let layout = PipelinedLayout { recompute, ..PipelinedLayout::new(mesh, kind, micro_batches) };
                let zero_bubble = kind == ScheduleKind::ZeroBubbleH1;
                for seq in [64, 256, 1024] {
                    for stage in stage_closed_forms(&config, &layout, seq) {
                        let (planned, form) = (stage.planned.peak_bytes as f64, stage.phase.bytes());
                        if !zero_bubble {
                            assert_eq!(form, planned, "{}: {:?}", stage.label, stage.phase.terms);
                        } else {
                            // What is left under zero bubble is within 3% (a wide shared expert at
                            // 1024 tokens was 48% below with B's first-layer points alone).
                            assert!(
                                form <= planned && form >= 0.97 * planned,
                                "{}: closed form {form} beside the planner's {planned} at '{}'",
                                stage.label,
                                stage.phase.name
                            );
                            zero_bubble_stages += 1;
                            zero_bubble_exact += usize::from(form == planned);
                        }
                        if form == planned {
                            *exact_at.entry(stage.phase.name).or_default() += 1;
                        }
                    }
                }
            }
        }
    }
    // Each point is where some stage peaks (or the check of it would be idle).
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the output gradient received",
            "the last layer's shared expert's down gradient",
            "the last layer's shared expert's down gradient joins its sum",
            "first layer's shared expert's down gradient",
            "first layer's shared expert's up output gradient",
            "first layer's shared expert's gate gradient joins its sum",
            "the last layer's experts' backward dispatched",
            "the last layer's routed experts' input gradient all-reduced over tp",
            "the last layer's expert gradient joins its sum",
            "the last layer's MLP norm output's gradients summed",
            "the last layer's attention residual gradient",
            "the last layer's attention backward",
            "the last layer's attention norm output's gradients from v and k",
            "the LM head's weight gradient joins its sum",
            "first layer's shared expert's down gradient joins its sum",
            "first layer's attention residual gradient",
            "first layer's attention backward",
            "first layer's attention norm output's gradients from v and k",
            "first layer's attention norm output's gradient from q",
            "first layer's MLP norm output's gradients summed",
            "the loss's backward",
            "first layer's attention backward in B",
            "first layer's attention norm output's gradients summed in B",
            "first layer's shared expert's gate output gradient in B",
            "first layer's expert gradient joins its sum in B",
            "the LM head's weight gradient joins its sum in W",
            "the LM head's weight gradient in W",
            "the last layer's down gradient joins its sum in W",
            "the last layer's down gradient in W",
            "every token's logits gathered in a forward",
            "the last layer's q gradient joins its sum in W",
        ],
    );
    // Most zero-bubble stages are exact to the byte (2418 of 2430 when this was written; 2230
    // before the points of the last layer's q gradient in W, the experts' output all-reduced
    // over tp and the attention beside cp in a forward, and a shared expert's down gradient in
    // the last stage's W).
    assert!(100 * zero_bubble_exact > 99 * zero_bubble_stages, "{zero_bubble_exact} of {zero_bubble_stages} exact");
}

#[test]
fn shared_expert_stage_closed_form_equals_the_planners_peak() {
    // A Qwen2-MoE shared expert beside tiny-moe's routed experts on two and four stages: each
    // micro-batch in flight keeps its gate, up, product, output and gate logit, and a stage may
    // peak as its first layer's shared gate gradient (the last of the shared expert's, made before
    // the routed experts' and the router's backward) joins its sum, beside the MLP norm output the
    // routed experts still read; over ep, where the routed experts' gradients are a rank's share,
    // and on a wide shared expert, that point is above theirs (without replicas, on one 32 times
    // the hidden size). Under interleaving with the load-balancing loss the last stage's first
    // chunk holds its own layers' statistics and those the stage before sent with its output.
    // Widths of a quarter, three quarters, eight and 32 times the hidden size, with and without
    // the loss, each recomputation. Under zero bubble the shared expert's weight gradients are
    // W's: a micro-batch between B and W keeps the MLP norm output (to its end: B reads it too),
    // the product and the output gradients they read, and the gate gradient joins its sum in W,
    // beside the first layer's attention inputs and gradients W reads next.
    let mut phases = std::collections::BTreeSet::new();
    for width in [32, 96, 1024, 4096] {
        for load_balancing_loss in [true, false] {
            phases.extend(check_mixture_stages(&with_a_shared_expert(width, load_balancing_loss)));
        }
    }
    for phase in ["first layer's shared expert's gate gradient joins its sum", "tail of a backward"] {
        assert!(phases.contains(phase), "{phase}: {phases:?}");
    }
}

#[test]
fn tied_stage_closed_form_equals_the_planners_peak() {
    // A tied table beside pp: the last stage receives the first's table once a step and holds,
    // per micro-batch, the head's part of its gradient (sent back, no running sum of its own); the
    // first stage receives that part with the micro-batch's backward and adds it to the
    // embedding's part before the sum joins its running sum (beside dp × tp the last stage reduces
    // it over dp first, at the end of its backward). The four-layer tiny tied, with its vocabulary
    // and a wide one (2048 tokens, where the table outweighs a layer), on pp=2 and pp=4, alone and
    // by dp, tp (±SP), cp and dp × tp, each recomputation, GPipe, 1F1B, zero bubble (where the
    // first stage of two takes the last's input gradients of the B steps before the head's part,
    // made in W; beside dp × tp the last stage reduces it over dp at the W's end) and interleaved
    // where they are modelled, ZeRO-1, and ZeRO-2 and 3 beside dp or cp or both, with or without
    // tp (under ZeRO-3 the last stage gathers the table's shard itself, over dp and cp in two
    // steps; under zero bubble, without tp, the first stage sums the parts beside what its W's
    // tail still reads).
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four_layers() };
    let wide = pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..tied.clone() };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let cases: [(&str, bool, Recompute, &[u32], u8); 24] = [
        ("pp=2", false, none, &[2, 4], 0),
        ("pp=2", false, full, &[2], 0),
        ("pp=4", false, none, &[2], 0),
        ("pp=2,dp=2", false, none, &[2], 0),
        ("pp=2,dp=2", false, selective, &[2], 1),
        ("pp=4,dp=2", false, full, &[2], 0),
        ("pp=2,tp=2", false, none, &[2], 0),
        ("pp=2,tp=2", true, selective, &[2, 4], 0),
        ("pp=2,tp=2", true, full, &[2], 0),
        ("pp=2,cp=2", false, none, &[2], 0),
        ("pp=2,dp=2,tp=2", false, none, &[2], 0),
        ("pp=2,dp=2,tp=2", true, full, &[2], 1),
        ("pp=2,tp=2,cp=2", true, none, &[2], 0),
        ("pp=2,dp=2", false, none, &[2], 2),
        ("pp=4,dp=2", false, full, &[2], 2),
        ("pp=2,dp=2,cp=2", false, selective, &[2], 2),
        ("pp=2,dp=2", false, none, &[2], 3),
        ("pp=4,dp=2", false, selective, &[2], 3),
        ("pp=2,cp=2", false, none, &[2], 3),
        ("pp=2,dp=2,tp=2", false, none, &[2], 2),
        ("pp=2,dp=2,tp=2", true, full, &[2], 3),
        ("pp=2,tp=2,cp=2", true, selective, &[2], 2),
        ("pp=2,dp=2,cp=2", false, none, &[2], 3),
        ("pp=2,dp=2,cp=2", false, full, &[2], 3),
    ];
    let mut names = std::collections::BTreeSet::new();
    for config in [&tied, &wide] {
        for (mesh, sequence_parallel, recompute, micro_batch_counts, zero_stage) in cases {
            let parsed = Mesh::parse(mesh).unwrap();
            let stages = parsed.degree(AxisName::Pp) as u32;
            let mut kinds = vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1];
            // Interleaved on two stages (four would need eight layers).
            if stages == 2 {
                kinds.push(ScheduleKind::Interleaved { chunks: 2 });
            }
            for layout in layouts_of(mesh, sequence_parallel, recompute, zero_stage, &kinds, micro_batch_counts) {
                check_stage_closed_form(config, &layout);
                for stage in stage_closed_forms(config, &layout, SEQ) {
                    let last = stage.label.ends_with(&format!("stage {}", stages - 1));
                    let holds = |name: &str| stage.phase.terms.iter().any(|term| term.name == name);
                    // The last stage holds the received table at every peak, and the head's part
                    // of its gradient past the head of its backward.
                    assert_eq!(holds(TIED_TABLE_RECEIVED), last, "{}", stage.label);
                    // (Or, gathering the table for the head's backward, before that part.)
                    if holds(TIED_HEAD_PART) || stage.phase.name.starts_with("the tied table gathered") {
                        names.insert((last, stage.phase.name));
                    }
                }
            }
        }
    }
    // Both stages peak holding the head's part: the first at its backward's tail, (beside dp × tp)
    // as the embedding's rows are sliced, or (under ZeRO-2) as the two parts are summed, the last
    // at its tail or (beside dp × tp) as the head's part is reduced (under zero bubble at the end
    // of W); under ZeRO-3 over dp and cp the last may peak before it is made, as the table is
    // gathered for the head's backward.
    for expected in [
        (false, "tail of a backward"),
        (false, "embedding rows sliced for their dp reduction"),
        (false, "the embedding's and the head's parts of the tied table's gradient summed"),
        (true, "tail of a backward"),
        (true, "the LM head's part of the tied table's gradient reduced over dp"),
        (true, "the tied table gathered for the LM head's backward, the last step"),
    ] {
        assert!(names.contains(&expected), "{expected:?}: {names:?}");
    }
}

/// `config` with its embedding tied to its LM head.
fn tied(config: pleat_ir::model::config::ModelConfig) -> pleat_ir::model::config::ModelConfig {
    pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..config }
}

#[test]
fn tied_mixture_stage_closed_form_equals_the_planners_peak() {
    // A mixture of experts with a tied table: the last stage's head makes the head's part of the
    // table's gradient, which joins no sum (in its mixture's head of a backward, and under full
    // recomputation inside its last layer's attention backward, it is held, not summed); under
    // zero bubble its W makes it first (a shared expert's gate vector's gradient after). The
    // first stage takes each micro-batch's counts' sum off its link from the last stage as a
    // later message is read there: a head's part (at a backward's tail, or W's head) takes the
    // counts' sums the last stage sent before it, held until their B. Under zero bubble the
    // first stage's W may peak at its head, as the last layer's MLP norm weight gradient joins its
    // sum (beside dp or ep as it is made, reduced after its reads are freed) with the head's part
    // taken. tiny-moe tied, with a shared expert, and with a wide vocabulary, on every layout of
    // the stage table, each recomputation: exact on 8 tokens a sequence; on 64 and 256 exact
    // beside dp, cp, ep, tp and ZeRO 2 and 3, and below under zero bubble with four micro-batches
    // (within 1%: on the last stage the points inside W past the head's part, as the last layer's
    // attention weight gradients join their sums, are not modelled).
    let mixtures = [
        tied(preset("tiny-moe").unwrap()),
        tied(with_a_shared_expert(32, true)),
        tied(pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..preset("tiny-moe").unwrap() }),
    ];
    let mut phases = std::collections::BTreeSet::new();
    for config in &mixtures {
        phases.extend(check_mixture_stages(config));
    }
    // Beside routed experts split over tsp too (under zero bubble W's head on the first stage: a
    // shared expert's gate vector's gradient, all-reduced over tsp, joins its sum beside its
    // partial copy). Whether each layout is exact on 64 and 256 tokens:
    let (one_f_one_b, gpipe, interleaved) =
        (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::Interleaved { chunks: 2 });
    let zero_bubble = ScheduleKind::ZeroBubbleH1;
    let more_tokens = [
        ("pp=2", gpipe, 2, 0, true),
        ("pp=2", zero_bubble, 4, 0, false),
        ("pp=4", gpipe, 4, 0, true),
        ("pp=4", zero_bubble, 4, 0, false),
        ("pp=2,dp=2", zero_bubble, 2, 0, true),
        ("pp=2,dp=2", one_f_one_b, 2, 2, true),
        ("pp=2,dp=2", zero_bubble, 2, 3, true),
        ("pp=2,ep=2", interleaved, 2, 0, true),
        ("pp=2,ep=2", zero_bubble, 2, 0, true),
        ("pp=2,tp=2", zero_bubble, 2, 0, true),
        ("pp=2,ep=2,tp=2", one_f_one_b, 2, 0, true),
        ("pp=2,cp=2", zero_bubble, 2, 0, true),
        ("pp=2,tsp=2", gpipe, 2, 0, true),
        ("pp=2,tsp=4", one_f_one_b, 2, 0, true),
        ("pp=2,tsp=2", interleaved, 2, 0, true),
        ("pp=2,tsp=2", zero_bubble, 2, 0, true),
        ("pp=4,tsp=2", zero_bubble, 4, 0, true),
        ("pp=2,dp=2,tsp=2", zero_bubble, 2, 1, true),
        ("pp=2,dp=2,tsp=2", gpipe, 2, 3, true),
    ];
    let (mut stages, mut exact) = (0, 0);
    for config in &mixtures {
        let config = pleat_ir::model::config::ModelConfig { num_layers: 4, ..config.clone() };
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for (mesh, kind, micro_batches, zero_stage, exact_there) in more_tokens {
                let layout = PipelinedLayout::one_sequence_a_micro_batch(
                    mesh,
                    kind,
                    micro_batches,
                    zero_stage,
                    recompute,
                    false,
                );
                for seq in [64, 256] {
                    for stage in stage_closed_forms(&config, &layout, seq) {
                        let (planned, form) = (stage.planned.peak_bytes as f64, stage.phase.bytes());
                        phases.insert(stage.phase.name);
                        stages += 1;
                        exact += usize::from(form == planned);
                        if exact_there {
                            stage.assert_exact();
                        } else {
                            assert!(
                                form <= planned && form >= 0.99 * planned,
                                "{}: closed form {form} beside the planner's {planned}",
                                stage.label
                            );
                        }
                    }
                }
            }
        }
    }
    // (Where the head's part was counted a gradient with a sum, the last layer's points stood
    // above the planner: under full recomputation on a wide vocabulary by up to 8%.)
    for phase in [
        "the LM head's part of the tied table's gradient is made in W",
        "the head of W: the last layer's MLP norm weight gradient joins its sum",
        "the head of W: the last layer's MLP norm weight gradient",
        "the last layer's expert gradient joins its sum",
        "the last layer's experts' backward dispatched",
        "the head of W: the last layer's shared expert's gate vector gradient joins its sum",
        "the last layer's q gradient in W, before its all-reduce",
    ] {
        assert!(phases.contains(phase), "{phase}: {phases:?}");
    }
    // All but a few cp and zero-bubble stages are exact to the byte.
    assert!(20 * exact > 19 * stages, "{exact} of {stages} exact");
}

#[test]
fn tied_tsp_stage_closed_form_equals_the_planners_peak() {
    // A tied table beside tsp: the last stage's head makes its part of the table's gradient (the
    // vocabulary's tsp shard), which joins no sum and is not reduced there (the first stage
    // reduces the sum beside dp); the first stage holds it, once received, as it scatters the
    // embedding's gradient from every token's. Under zero bubble W makes it, so the last stage's B
    // does not hold it, and the first stage's W holds it from its head (the last layer's MLP norm
    // weight gradient, the MLP's made in B). The four-layer tiny tied, with its vocabulary and a
    // wide one, on tsp at 2 and 4, alone and beside dp (ZeRO 0, 2 and 3), each schedule and
    // recomputation, 8 and 256 tokens.
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four_layers() };
    let wide = pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..tied.clone() };
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    let cases: [(&str, Recompute, u32, u8); 7] = [
        ("pp=2,tsp=2", none, 2, 0),
        ("pp=2,tsp=2", full, 4, 0),
        ("pp=2,tsp=4", none, 2, 0),
        ("pp=4,tsp=2", selective, 4, 0),
        ("pp=2,dp=2,tsp=2", selective, 2, 0),
        ("pp=2,dp=2,tsp=2", none, 2, 2),
        ("pp=2,dp=2,tsp=4", full, 2, 3),
    ];
    let mut names = std::collections::BTreeSet::new();
    for (config, seq) in [(&tied, SEQ), (&wide, SEQ), (&tied, 256), (&wide, 256)] {
        for (mesh, recompute, micro_batches, zero_stage) in cases {
            let stages = Mesh::parse(mesh).unwrap().degree(AxisName::Pp) as u32;
            let mut kinds = vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1];
            if stages == 2 {
                kinds.push(ScheduleKind::Interleaved { chunks: 2 });
            }
            for layout in layouts_of(mesh, false, recompute, zero_stage, &kinds, &[micro_batches]) {
                for stage in stage_closed_forms(config, &layout, seq) {
                    stage.assert_exact();
                    let last = stage.label.ends_with(&format!("stage {}", stages - 1));
                    let holds = |name: &str| stage.phase.terms.iter().any(|term| term.name == name);
                    assert_eq!(holds(TIED_TABLE_RECEIVED), last, "{}", stage.label);
                    names.insert((last, stage.phase.name, holds(TIED_HEAD_PART)));
                }
            }
        }
    }
    // (Under zero bubble B's points on the last stage name the head's part among what the chunk
    // keeps to its end, and take it off again as made in W.)
    for expected in [
        (false, "the embedding's gradient scattered from every token's", true),
        (false, "embedding rows sliced to join the head's part of the tied table's gradient", true),
        (false, "embedding rows sliced for their dp reduction", true),
        (false, "the head of W: the last layer's MLP norm weight gradient", true),
        (true, "the LM head's part of the tied table's gradient is made", true),
        (true, "the LM head's part of the tied table's gradient is made in W", true),
        (true, "the LM head's part of the tied table's gradient reduced over dp", true),
    ] {
        assert!(names.contains(&expected), "{expected:?}: {names:?}");
    }
    // One sequence a micro-batch on 256 tokens at tsp=4, zero bubble: the first stage's axis's
    // last rank peaks in W's last layer as o's gradient is reduced to it, the first owner (none
    // summed before it, every other owner's activations after), beside the head's part taken.
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,tsp=4",
        ScheduleKind::ZeroBubbleH1,
        2,
        0,
        Recompute::None,
        false,
    );
    let first_owner = "the last layer's o gradient reduced to this rank, the first owner, in W";
    let stages = stage_closed_forms(&tied, &layout, 256);
    stages.iter().for_each(StageClosedForm::assert_exact);
    assert!(stages.iter().any(|stage| stage.phase.name == first_owner), "{first_owner}");
}

#[test]
fn a_tsp_stage_peaks_as_the_last_owners_q_input_gradient_is_made() {
    // Inside the first layer's attention backward, after the last owner's attention kernel and
    // its k and v input gradients: q's block broadcast again, q's gradient and the input gradient
    // beside the rank's contributions to that owner's o, k and v gradients. Interleaved on one
    // layer a chunk beside dp, the axis's last rank peaks there (the form was 0.3% below before).
    let layout = PipelinedLayout::new("pp=2,dp=2,tsp=2", ScheduleKind::Interleaved { chunks: 2 }, 2);
    let mut names = std::collections::BTreeSet::new();
    for recompute in [Recompute::None, Recompute::Selective] {
        assert_exact_at(&mut names, &four_layers(), &PipelinedLayout { recompute, ..layout }, 64);
    }
    assert!(names.contains("first layer's q input gradient, the last owner's"), "{names:?}");
}

#[test]
fn the_first_stage_holds_a_tied_heads_part_from_the_step_that_takes_it() {
    // Beside a tied table the first stage takes each micro-batch's head part of the table's
    // gradient off its link from the last stage as a step reads it or a message queued after it.
    // Interleaved beside dp × tp the last stage sends it after its input gradient, once reduced
    // over dp, so the first stage takes it only as its first chunk's backward begins (counted
    // from its last chunk's backward before: 1.1% above the planner at 256 tokens). Interleaved on
    // four stages a later forward's input comes after it, so the first stage takes it as that
    // forward begins and holds several at once (three at eight micro-batches, 1024 tokens). Both
    // layouts were refused before.
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four_layers() };
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    let beside_dp_by_tp = PipelinedLayout {
        mesh: "pp=2,dp=2,tp=2",
        schedule: interleaved,
        batch: 4,
        micro_batches: 2,
        recompute: Recompute::None,
        sequence_parallel: false,
        zero_stage: 0,
    };
    for stage in stage_closed_forms(&tied, &beside_dp_by_tp, 256) {
        stage.assert_exact();
    }
    let eight = pleat_ir::model::config::ModelConfig { num_layers: 8, ..tied };
    let four_stages = PipelinedLayout { mesh: "pp=4", batch: 8, micro_batches: 8, ..beside_dp_by_tp };
    let head_part = (eight.vocab_size * eight.hidden_size * 4) as f64;
    for stage in stage_closed_forms(&eight, &four_stages, 1024) {
        stage.assert_exact();
        let taken_ahead: f64 = stage
            .phase
            .terms
            .iter()
            .filter(|term| term.name == TIED_HEAD_PARTS_TAKEN_AHEAD)
            .map(|term| term.bytes)
            .sum();
        let first = stage.label.ends_with("stage 0");
        assert_eq!(taken_ahead, if first { 3.0 * head_part } else { 0.0 }, "{}", stage.label);
    }
}

#[test]
fn a_tied_table_under_zero3_is_gathered_by_the_last_stage_itself() {
    // The first stage sends the rank's dp shard of the table once a step; the last gathers it for
    // its head in each micro-batch's forward and again in its backward. (Gathered on the first
    // stage, the whole table went every micro-batch and stayed there to each one's end.)
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four_layers() };
    let layout = PipelinedLayout { zero_stage: 3, ..PipelinedLayout::new("pp=2,dp=2", ScheduleKind::OneFOneB, 2) };
    let (programs, _) = compile_pipelined(&tied, &layout);
    let table_shard = 128 * 128;
    let reads_table = |program: &pleat_backend::Program, instr: &Instr| {
        instr.inputs().iter().any(|&buffer| program.buffer(buffer).name.starts_with("model.embed_tokens.weight"))
    };
    for rank in [0, 1] {
        let program = &programs[rank];
        let sent: Vec<u64> = program
            .instructions
            .iter()
            .filter_map(|instr| match instr {
                Instr::Send { bufs, .. } if reads_table(program, instr) => Some(program.buffer(bufs[0]).numel()),
                _ => None,
            })
            .collect();
        assert_eq!(sent, [table_shard], "rank {rank}");
        let last = &programs[rank + 2];
        let gathers = last
            .instructions
            .iter()
            .filter(|instr| matches!(instr, Instr::AllGather { .. }) && reads_table(last, instr))
            .count();
        assert_eq!(gathers, 2 * 2, "rank {}", rank + 2);
    }
}

/// The names of the closed form's peaks of `layout`'s stages (of each place on the tsp axis).
fn stage_phase_names(config: &pleat_ir::model::config::ModelConfig, layout: &PipelinedLayout) -> Vec<&'static str> {
    let parsed = Mesh::parse(layout.mesh).unwrap();
    let (stages, dp) = (parsed.degree(AxisName::Pp) as u32, parsed.degree(AxisName::Dp));
    let schedule = Schedule::build(layout.schedule, stages, layout.micro_batches).unwrap();
    let workload = Workload {
        micro_batches: u64::from(layout.micro_batches),
        recompute: cost_recompute(layout.recompute),
        zero: layout.zero_stage,
        ..Workload::training(SEQ, layout.batch / u64::from(layout.micro_batches) / dp / parsed.degree(AxisName::Ep))
    };
    let model = ModelShape::from_config(config);
    let cost_layout = Layout::from_mesh(&parsed, layout.sequence_parallel);
    let layers = config.num_layers / u64::from(stages);
    let places = parsed.degree(AxisName::Tsp);
    (0..stages)
        .flat_map(|stage| (0..places).map(move |place| (stage, place)))
        .filter_map(|(stage, place)| {
            compiled_stage_peak(&model, &cost_layout, &workload, &schedule, stage, place, layers)
        })
        .map(|phase| phase.name)
        .collect()
}

#[test]
fn tsp_stage_closed_form_equals_the_planners_peak() {
    // tsp beside pp: tokens split as under cp (every token's k and v kept per owner), the MLP
    // ring keeping nothing, the embeddings sharded, the head's input and every token's logits
    // gathered. A stage peaks at its first backward's tail (the first: the whole-vocabulary
    // embedding gradient) or inside its first layer's attention backward, each rank apart: as o's
    // weight gradient is reduced to it, beside the activations of the owners whose backward
    // follows (more on each later place on the axis), or on the axis's last rank, whose owner
    // goes first, as o's gradient joins its sum (beside dp, which all-reduces it first, as o's
    // reduce to another owner leaves zeros there).
    let (four, eight) = (four_layers(), eight_layers());
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (interleaved, zero_bubble) = (ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1);
    let mut phases = std::collections::BTreeSet::new();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        for (config, mesh, kind, micro_batches) in [
            (&four, "pp=2,tsp=2", one_f_one_b, 2),
            (&four, "pp=2,tsp=2", gpipe, 2),
            (&four, "pp=2,tsp=2", one_f_one_b, 4),
            (&four, "pp=4,tsp=2", one_f_one_b, 4),
            (&eight, "pp=2,tsp=2", gpipe, 4),
            (&four, "pp=2,tsp=4", one_f_one_b, 2),
            (&four, "pp=2,tsp=4", gpipe, 2),
            (&four, "pp=2,tsp=4", one_f_one_b, 4),
            (&four, "pp=4,tsp=4", one_f_one_b, 4),
            (&eight, "pp=2,tsp=4", gpipe, 4),
            (&four, "pp=2,tsp=2", interleaved, 2),
            (&eight, "pp=2,tsp=2", interleaved, 4),
            (&four, "pp=2,tsp=4", interleaved, 2),
            (&eight, "pp=4,tsp=4", interleaved, 4),
            (&four, "pp=2,tsp=2", zero_bubble, 2),
            (&four, "pp=2,tsp=2", zero_bubble, 4),
            (&eight, "pp=2,tsp=2", zero_bubble, 4),
            (&four, "pp=2,tsp=4", zero_bubble, 4),
            (&eight, "pp=2,tsp=4", zero_bubble, 4),
            (&four, "pp=4,tsp=2", zero_bubble, 4),
            (&eight, "pp=4,tsp=4", zero_bubble, 4),
            (&four, "pp=2,dp=2,tsp=2", one_f_one_b, 2),
            (&four, "pp=2,dp=2,tsp=4", one_f_one_b, 2),
            (&four, "pp=2,dp=2,tsp=4", gpipe, 2),
            (&four, "pp=2,dp=2,tsp=4", zero_bubble, 2),
            (&eight, "pp=2,dp=2,tsp=4", interleaved, 2),
            (&eight, "pp=4,dp=2,tsp=2", one_f_one_b, 2),
        ] {
            let layout = PipelinedLayout { recompute, ..PipelinedLayout::new(mesh, kind, micro_batches) };
            check_stage_closed_form(config, &layout);
            phases.extend(stage_phase_names(config, &layout));
        }
    }
    for phase in [
        "first layer's o gradient reduced to this rank, its owner",
        "first layer's o gradient joins its sum",
        "first layer's o gradient reduced to another owner",
        "embedding rows sliced for their dp reduction",
        "tail of a backward",
    ] {
        assert!(phases.contains(phase), "{phase}: {phases:?}");
    }
    // tsp beside another axis than dp or ep has none; nor has a place past the axis.
    let model = ModelShape::from_config(&four);
    let workload = Workload { micro_batches: 4, ..Workload::training(SEQ, 2) };
    for (mesh, kind) in [("pp=2,tp=2,tsp=2", one_f_one_b), ("pp=2,cp=2,tsp=2", one_f_one_b)] {
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
        let schedule = Schedule::build(kind, 2, 4).unwrap();
        assert!(compiled_stage_peak(&model, &layout, &workload, &schedule, 0, 0, 2).is_none(), "{mesh} {kind:?}");
    }
    let layout = Layout::from_mesh(&Mesh::parse("pp=2,tsp=4").unwrap(), false);
    let schedule = Schedule::build(one_f_one_b, 2, 4).unwrap();
    assert!(compiled_stage_peak(&model, &layout, &workload, &schedule, 1, 3, 2).is_some());
    assert!(compiled_stage_peak(&model, &layout, &workload, &schedule, 1, 4, 2).is_none());
    // ZeRO-2 and 3 are modelled wherever rows divide or not. Where those of o, a norm or the MLP
    // do not and another's do (at dp=256 `tiny`'s 256 vocabulary rows split, its hidden size's
    // 128 do not), below the planner
    // (`zero_stage_form_where_dense_rows_do_not_divide_is_never_above_the_planner`). q's, k's and
    // v's (4 and 2 rows a rank at tp=2 or tsp=2, kept whole at dp=8), a mixture's router and
    // experts (whole with 8 experts at dp=16; the router split over dp alone with six at dp=2 ×
    // ep=2, the experts too at dp=2 × cp=2) and the tables (250 rows whole at dp=4, split over dp
    // alone at dp=2 × cp=2) are counted apart, and where no parameter's rows divide (at dp=3) the
    // programs are ZeRO-1's.
    let schedule = Schedule::build(one_f_one_b, 2, 1).unwrap();
    let mixture_config = &four_layer_mixtures()[0];
    let mixture = ModelShape::from_config(mixture_config);
    let six_experts = ModelShape::from_config(&with_routed_experts(mixture_config, 6, true));
    let odd_vocabulary =
        ModelShape::from_config(&pleat_ir::model::config::ModelConfig { vocab_size: 250, ..four.clone() });
    for (model, mesh) in [
        (&model, "pp=2,dp=256"),
        (&odd_vocabulary, "pp=2,dp=4"),
        (&odd_vocabulary, "pp=2,dp=2,cp=2"),
        (&six_experts, "pp=2,dp=2,ep=2"),
        (&six_experts, "pp=2,dp=2,cp=2"),
        (&six_experts, "pp=2,dp=4"),
        (&mixture, "pp=2,dp=16"),
        (&model, "pp=2,dp=8,tsp=2"),
        (&model, "pp=2,dp=8,tp=2"),
        (&model, "pp=2,dp=3,tp=2"),
        (&model, "pp=2,dp=4,tp=2"),
        (&model, "pp=2,dp=2,tp=2"),
    ] {
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
        let workload = Workload { zero: 2, ..Workload::training(SEQ, 1) };
        assert!(compiled_stage_peak(model, &layout, &workload, &schedule, 0, 0, 2).is_some(), "{mesh}");
        let zero3 = Workload { zero: 3, ..workload };
        assert!(compiled_stage_peak(model, &layout, &zero3, &schedule, 0, 0, 2).is_some(), "{mesh} under ZeRO-3");
    }
}

#[test]
fn zero_that_splits_no_parameter_compiles_to_zero1s_programs_on_every_stage() {
    // At dp=3 no dim of tiny's divides (128, 256, 8 heads, 4 kv heads; 8 experts): ZeRO-2 and 3
    // keep every gradient and weight whole, each gradient all-reduced, as ZeRO-1. The closed form
    // says so, and each rank's planned peak is its, to the byte.
    let (four, _, tied) = four_layers_wide_and_tied();
    let mixture = pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() };
    let (one_f_one_b, zero_bubble, interleaved) =
        (ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1, ScheduleKind::Interleaved { chunks: 2 });
    let (none, full) = (Recompute::None, Recompute::Full);
    let cases: [StageCase; 4] = [
        (&four, "pp=2,dp=3", one_f_one_b, 4, 2, none, false, 64),
        (&mixture, "pp=2,dp=3,tp=2", interleaved, 4, 3, full, true, 256),
        (&tied, "pp=2,dp=3,tsp=2", zero_bubble, 4, 3, none, false, 64),
        (&mixture, "pp=2,dp=3", zero_bubble, 4, 2, Recompute::Selective, false, 256),
    ];
    // Each rank's peak is the planner's, to the byte, and Megatron's closed form's plus the named
    // differences (under ZeRO-3, of the parameters kept whole); and it is the one the rank has
    // under ZeRO-1.
    for &(config, mesh, kind, micro_batches, zero, recompute, sp, seq) in &cases {
        let layout =
            |zero: u8| PipelinedLayout::one_sequence_a_micro_batch(mesh, kind, micro_batches, zero, recompute, sp);
        check_stage_closed_form_at(config, &layout(zero), seq);
        let peaks = |zero: u8| -> Vec<u64> {
            stage_closed_forms(config, &layout(zero), seq).iter().map(|stage| stage.planned.peak_bytes).collect()
        };
        assert_eq!(peaks(zero), peaks(1), "{mesh} {kind:?} ZeRO-{zero}");
    }
}

#[test]
fn interleaved_stage_closed_form_equals_the_planners_peak_on_deeper_chunks() {
    // Eight layers: two a chunk on pp=2 with two chunks, one a chunk with four chunks or on pp=4;
    // each finished chunk of a micro-batch keeps its gradients and the buffers another rank reads
    // last until the micro-batch's backward is done on the stage.
    let config = eight_layers();
    let none = Recompute::None;
    let cases: [(&str, bool, Recompute, u32, u32); 7] = [
        ("pp=2", false, none, 2, 2),
        ("pp=2", false, none, 2, 4),
        ("pp=2", false, none, 4, 2),
        ("pp=4", false, none, 2, 4),
        ("pp=2,tp=2", true, none, 2, 2),
        ("pp=2,dp=2", false, Recompute::Full, 2, 2),
        ("pp=2,tp=2", false, Recompute::Selective, 2, 4),
    ];
    for (mesh, sequence_parallel, recompute, chunks, micro_batches) in cases {
        let layout = PipelinedLayout {
            recompute,
            sequence_parallel,
            ..PipelinedLayout::new(mesh, ScheduleKind::Interleaved { chunks }, micro_batches)
        };
        check_stage_closed_form(&config, &layout);
    }
}

/// Checks every stage of `config` compiled for `layout`: its closed form (the largest tail of its
/// backwards) equals the planner's peak of its program, and so does [`memory_per_stage`]'s peak
/// plus the named differences.
fn check_stage_closed_form(config: &pleat_ir::model::config::ModelConfig, layout: &PipelinedLayout) {
    check_stage_closed_form_at(config, layout, SEQ);
}

/// [`check_stage_closed_form`] at `seq` tokens a sequence.
fn check_stage_closed_form_at(config: &pleat_ir::model::config::ModelConfig, layout: &PipelinedLayout, seq: u64) {
    for stage in stage_closed_forms(config, layout, seq) {
        let (label, planned) = (&stage.label, &stage.planned);
        // ZeRO-3's parameters are the closed form's shards and those it keeps whole beyond them.
        let kept_whole = stage.bytes_of(PARAMS_KEPT_WHOLE);
        assert_eq!(planned.param_bytes as f64, stage.phase.params + kept_whole, "{label}");
        assert_eq!(planned.peak_bytes as f64, stage.phase.bytes(), "{label}: {:?}", stage.phase.terms);
        // The closed form's weights are the program's, but the copy of a tied table the last stage
        // receives (a buffer to the program, a parameter to Megatron's accounting).
        let otherwise = stage.differences.iter().find(|term| term.name.contains("counts otherwise")).unwrap();
        let received = stage.bytes_of(TIED_TABLE_RECEIVED);
        // (To rounding: over three replicas a shard is a fraction of a byte.)
        assert!((otherwise.bytes + received).abs() < 1e-6, "{label}: {} vs {received}", otherwise.bytes);
        assert_eq!(planned.peak_bytes as f64, stage.predicted.round(), "{label}: {:?}", stage.differences);
    }
}

/// Asserts that every stage's closed form of `config` on `layout` at `seq` tokens a sequence is
/// the planner's peak, to the byte, and adds the names of their peaks to `names`.
fn assert_exact_at(
    names: &mut std::collections::BTreeSet<&'static str>,
    config: &pleat_ir::model::config::ModelConfig,
    layout: &PipelinedLayout,
    seq: u64,
) {
    for stage in stage_closed_forms(config, layout, seq) {
        stage.assert_exact();
        names.insert(stage.phase.name);
    }
}

/// Asserts every stage of every case exact to the byte, and under ZeRO-3 its parameters kept whole
/// beyond their shards the case's elements a layer (f32) on each of its layers; returns the names
/// of the stages' peaks.
fn exact_with_params_kept_whole(cases: &[(StageCase, f64)]) -> std::collections::BTreeSet<&'static str> {
    exact_stages(cases, |&(config, mesh, .., zero_stage, _, _, _), beyond, stage| {
        let layers = (config.num_layers / Mesh::parse(mesh).unwrap().degree(AxisName::Pp)) as f64;
        let expected = if zero_stage == 3 { layers * beyond * 4.0 } else { 0.0 };
        assert_eq!(stage.bytes_of(PARAMS_KEPT_WHOLE), expected, "{}", stage.label);
    })
}

/// Asserts every stage of every case exact to the byte (and its closed form's difference terms),
/// and `check` of each case, its figure and each of its stages; returns the names of the stages'
/// peaks.
fn exact_stages(
    cases: &[(StageCase, f64)],
    mut check: impl FnMut(&StageCase, f64, &StageClosedForm),
) -> std::collections::BTreeSet<&'static str> {
    let mut names = std::collections::BTreeSet::new();
    for (case, figure) in cases {
        let &(config, mesh, kind, micro_batches, zero_stage, recompute, sp, seq) = case;
        let layout = PipelinedLayout::one_sequence_a_micro_batch(mesh, kind, micro_batches, zero_stage, recompute, sp);
        check_stage_closed_form_at(config, &layout, seq);
        for stage in stage_closed_forms(config, &layout, seq) {
            stage.assert_exact();
            check(case, *figure, &stage);
            names.insert(stage.phase.name);
        }
    }
    names
}

/// One rank's pipelined closed form beside its program's planned peak.
struct StageClosedForm {
    label: String,
    planned: pleat_backend::memory::MemoryPlan,
    phase: pleat_passes::cost::compiled::ForwardPhase,
    differences: Vec<pleat_passes::cost::memory::Term>,
    /// [`memory_per_stage`]'s peak plus the named differences.
    predicted: f64,
}

impl StageClosedForm {
    /// The bytes of the phase's terms named `name`.
    fn bytes_of(&self, name: &str) -> f64 {
        self.phase.terms.iter().filter(|term| term.name == name).map(|term| term.bytes).sum()
    }

    /// Asserts that the closed form's peak is the planner's, to the byte.
    fn assert_exact(&self) {
        assert_eq!(
            self.phase.bytes(),
            self.planned.peak_bytes as f64,
            "{} at '{}': {:?}",
            self.label,
            self.phase.name,
            self.phase.terms
        );
    }
}

/// `tiny-moe` on four layers, and the same beside a shared expert 32 wide (with the load-balancing
/// loss): the mixtures the tests of single points run.
fn four_layer_mixtures() -> [pleat_ir::model::config::ModelConfig; 2] {
    [
        pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() },
        pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, true) },
    ]
}

/// Asserts that every stage's closed form of `layout` on `config` (sequences of `seq` tokens) is
/// the planner's peak to the byte, and counts the stages that peak at one of `points`.
fn exact_stages_peaking_at(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &PipelinedLayout,
    seq: u64,
    points: &[&str],
) -> usize {
    let mut peaking_there = 0;
    for stage in stage_closed_forms(config, layout, seq) {
        stage.assert_exact();
        peaking_there += usize::from(points.contains(&stage.phase.name));
    }
    peaking_there
}

/// Every rank's closed form of `layout` on `config` (sequences of `seq` tokens), beside its
/// program's planned peak.
fn stage_closed_forms(
    config: &pleat_ir::model::config::ModelConfig,
    layout: &PipelinedLayout,
    seq: u64,
) -> Vec<StageClosedForm> {
    let model = ModelShape::from_config(config);
    let (programs, _) = compile_pipelined_at(config, layout, seq);
    let parsed = Mesh::parse(layout.mesh).unwrap();
    let (stages, dp) = (parsed.degree(AxisName::Pp) as u32, parsed.degree(AxisName::Dp));
    let (kind, micro_batches) = (layout.schedule, layout.micro_batches);
    let schedule = Schedule::build(kind, stages, micro_batches).unwrap();
    let cost_layout = Layout::from_mesh(&parsed, layout.sequence_parallel);
    // The closed form's stages (1F1B's in-flight count), beside the compiled ones.
    let workload = Workload {
        micro_batches: u64::from(micro_batches),
        recompute: cost_recompute(layout.recompute),
        zero: layout.zero_stage,
        // As the compiled programs do.
        tsp_shards_embeddings: parsed.degree(AxisName::Tsp) > 1,
        ..Workload::training(seq, layout.batch / u64::from(micro_batches) / dp / parsed.degree(AxisName::Ep))
    };
    let memory = memory_per_stage(&model, &cost_layout, &workload);
    programs
        .iter()
        .map(|program| {
            // Global rank `stage · inner + i` (pp is the outermost axis of the meshes here).
            let inner = programs.len() as u32 / stages;
            let stage = program.rank / inner;
            let tsp_rank = parsed.coord(program.rank, AxisName::Tsp);
            let label = format!(
                "{} sp={} {:?} zero={} {kind:?} m={micro_batches} seq {seq} rank {} stage {stage}",
                layout.mesh, layout.sequence_parallel, layout.recompute, layout.zero_stage, program.rank
            );
            let layers = config.num_layers / u64::from(stages);
            let phase = compiled_stage_peak(&model, &cost_layout, &workload, &schedule, stage, tsp_rank, layers)
                .expect("a modelled layout");
            let differences = pipelined_differences_from_closed_form(&memory[stage as usize], &phase);
            let predicted = memory[stage as usize].peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
            StageClosedForm { label, planned: plan(program, ElementSize::Fixed(4)), phase, differences, predicted }
        })
        .collect()
}

#[test]
fn pipelined_stage_closed_form_beside_dp_cp_and_full_recomputation_equals_the_planners_peak_on_more_tokens() {
    // Beside dp (or cp) each gradient is all-reduced before it joins its sum, the unreduced copy
    // live beside the reduced one, and the input gradients of a projection come before its
    // weight gradient: a stage's other peaks are the LM head's and the last layer's down
    // gradients joining their sums, the last layer's gate output gradient, the first layer's gate
    // gradient, its attention norm output's gradient from q, and inside its attention backward;
    // under full recomputation inside the first layer's backward, as its down gradient joins its
    // sum beside the recomputed MLP, or as its attention kernel makes the recomputed q's, k's and
    // v's gradients. Each is modelled; on these layouts every stage matches to the byte from 32 to
    // 256 tokens (eight interleaved layers under full recomputation once counted the first chunk's
    // positions twice, 1 KB above the planner at 256 tokens).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let eight = eight_layers();
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    let mut exact_at = std::collections::BTreeMap::<&'static str, usize>::new();
    let (none, selective, full) = (Recompute::None, Recompute::Selective, Recompute::Full);
    for (config, mesh, kind, micro_batches, zero_stage, recomputes) in [
        (&four, "pp=2,dp=2", one_f_one_b, 2, 0, &[none, selective, full][..]),
        (&four, "pp=4,dp=2", one_f_one_b, 2, 0, &[none, selective, full]),
        (&wide_vocabulary, "pp=2,dp=2", gpipe, 2, 1, &[none, selective, full]),
        (&eight, "pp=2,dp=2", interleaved, 2, 0, &[none, selective, full]),
        (&four, "pp=2,cp=2", one_f_one_b, 2, 0, &[none, selective, full]),
        (&four, "pp=2,dp=2,cp=2", one_f_one_b, 1, 0, &[none, selective, full]),
        // Full recomputation alone: its first layer's recomputed MLP and attention backward.
        (&four, "pp=2", one_f_one_b, 4, 0, &[full]),
    ] {
        for &recompute in recomputes {
            let layout = PipelinedLayout { recompute, zero_stage, ..PipelinedLayout::new(mesh, kind, micro_batches) };
            for seq in [32, 128, 256] {
                for stage in stage_closed_forms(config, &layout, seq) {
                    stage.assert_exact();
                    *exact_at.entry(stage.phase.name).or_default() += 1;
                }
            }
        }
    }
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the LM head's weight gradient joins its sum",
            "the last layer's down gradient joins its sum",
            "the last layer's gate output gradient",
            "first layer's gate gradient joins its sum",
            "first layer's attention norm output gradient from q",
            "first layer's attention backward",
            "first layer's down gradient joins its sum, its MLP recomputed",
        ],
    );
}

#[test]
fn pipelined_stage_closed_form_never_exceeds_the_planners_peak_on_more_tokens() {
    // The stage forms model each backward's tail, where a stage peaks while a micro-batch's
    // gradients outweigh its activations (8 tokens a sequence in the tests above), and a dense
    // stage's first layer's gate gradient joining its sum, where it peaks on somewhat more (under
    // tp also as its attention norm output's gradients are summed), and
    // the heads of the backwards (the last stage's loss's backward and LM head gradient, another
    // stage's last layer's down gradient and MLP norm output gradient). On more still a stage
    // may peak at other points of a backward's head, which they do not model: there every
    // candidate is still the live set at one point of the program, so the form is below the
    // planner's peak, never above. (On these layouts every such point is modelled by now: each
    // stage matches; the last below was a wide shared expert's down gradient joining its sum in
    // W beside cp.)
    // Mixtures too, with and without a shared expert, from 32 to 256 tokens (where a
    // micro-batch's two losses are summed by its loss's backward, and under full recomputation
    // beside dp the last stage sends the counts' sum again in each backward).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let four_experts = pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() };
    let eight_experts = pleat_ir::model::config::ModelConfig { num_layers: 8, ..preset("tiny-moe").unwrap() };
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..four.clone() };
    let tied_wide = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..wide_vocabulary.clone() };
    let shared = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, true) };
    let shared_wide = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(1024, true) };
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (interleaved, zero_bubble) = (ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1);
    let (mut gate_joining_exact, mut head_exact, mut down_exact) = (0, 0, 0);
    let (mut mlp_norm_exact, mut tied_down_exact, mut input_gradients_exact) = (0, 0, 0);
    let mut recomputed_head_exact = 0;
    for recompute in [Recompute::None, Recompute::Full] {
        for (config, mesh, kind, micro_batches, sequence_parallel, zero_stage) in [
            (&four, "pp=2", one_f_one_b, 4, false, 0),
            (&four, "pp=4", gpipe, 4, false, 0),
            (&four, "pp=2,dp=2", one_f_one_b, 2, false, 2),
            (&four, "pp=2,dp=2", one_f_one_b, 2, false, 3),
            (&four, "pp=2,dp=2,tp=2", one_f_one_b, 2, false, 0),
            (&four, "pp=2,tp=2", zero_bubble, 2, true, 0),
            (&four, "pp=4,tp=2", one_f_one_b, 4, false, 0),
            (&four, "pp=2,cp=2", one_f_one_b, 2, false, 0),
            (&four, "pp=2,tsp=2", one_f_one_b, 2, false, 0),
            (&four, "pp=2", interleaved, 2, false, 0),
            (&wide_vocabulary, "pp=2", one_f_one_b, 4, false, 0),
            (&wide_vocabulary, "pp=2,tp=2", one_f_one_b, 2, true, 0),
            (&four_experts, "pp=2", one_f_one_b, 2, false, 0),
            (&eight_experts, "pp=2", one_f_one_b, 4, false, 0),
            (&four_experts, "pp=4", one_f_one_b, 4, false, 0),
            (&four_experts, "pp=2,ep=2", one_f_one_b, 2, false, 0),
            (&four_experts, "pp=4,ep=2", gpipe, 2, false, 0),
            (&four_experts, "pp=2,dp=2", gpipe, 2, false, 0),
            (&shared, "pp=2", one_f_one_b, 2, false, 0),
            (&shared, "pp=2,dp=2", gpipe, 2, false, 0),
            (&shared_wide, "pp=2,ep=2", one_f_one_b, 2, false, 0),
            (&shared_wide, "pp=2", interleaved, 2, false, 0),
            (&shared, "pp=4", zero_bubble, 4, false, 0),
            (&shared_wide, "pp=2,ep=2", zero_bubble, 2, false, 0),
            (&four_experts, "pp=2,dp=2", zero_bubble, 2, false, 0),
            (&four_experts, "pp=2,tp=2", one_f_one_b, 2, true, 0),
            (&eight_experts, "pp=2,dp=2,tp=2", interleaved, 2, true, 0),
            (&shared, "pp=2,cp=2", zero_bubble, 2, false, 0),
            (&shared_wide, "pp=2,dp=2", one_f_one_b, 2, false, 0),
            (&tied, "pp=2", one_f_one_b, 2, false, 0),
            (&tied, "pp=2,tp=2", interleaved, 2, true, 0),
            (&tied_wide, "pp=2,dp=2,tp=2", gpipe, 2, false, 0),
            (&tied_wide, "pp=2,cp=2", interleaved, 2, false, 0),
        ] {
            let layout = PipelinedLayout {
                recompute,
                sequence_parallel,
                zero_stage,
                ..PipelinedLayout::new(mesh, kind, micro_batches)
            };
            for seq in [32, 64, 128, 256] {
                for stage in stage_closed_forms(config, &layout, seq) {
                    let planned = stage.planned.peak_bytes as f64;
                    assert!(
                        stage.phase.bytes() <= planned,
                        "{}: closed form {} above the planner's {planned}",
                        stage.label,
                        stage.phase.bytes()
                    );
                    let exact = stage.phase.bytes() == planned;
                    gate_joining_exact +=
                        usize::from(stage.phase.name == "first layer's gate gradient joins its sum" && exact);
                    head_exact +=
                        usize::from(stage.phase.name == "the LM head's weight gradient joins its sum" && exact);
                    // (Under full recomputation beside the final norm's output recomputed.)
                    recomputed_head_exact += usize::from(
                        stage.phase.name == "the LM head's weight gradient joins its sum"
                            && recompute == Recompute::Full
                            && exact,
                    );
                    down_exact +=
                        usize::from(stage.phase.name == "the last layer's down gradient joins its sum" && exact);
                    mlp_norm_exact +=
                        usize::from(stage.phase.name == "the last layer's MLP norm output gradient" && exact);
                    // (A dense stage's: a mixture's are checked apart.)
                    input_gradients_exact += usize::from(
                        config.moe.is_none()
                            && stage.phase.name.starts_with("first layer's attention norm output's gradient")
                            && exact,
                    );
                    // Beside a tied table the head's part joins no sum, and the last stage peaks
                    // next as its last layer's down gradient does.
                    let holds_head_part = stage.phase.terms.iter().any(|term| term.name == TIED_HEAD_PART);
                    tied_down_exact += usize::from(
                        stage.phase.name == "the last layer's down gradient joins its sum" && holds_head_part && exact,
                    );
                }
            }
        }
    }
    // The head of a backward does peak on these (or the check would be idle): a dense stage's
    // first layer's gate gradient, another stage's last layer's down gradient and the last
    // stage's LM head gradient (beside a wide vocabulary, under full recomputation too) joining
    // their sums, and another stage's last layer's MLP norm output gradient, all modelled, are
    // exact where they peak.
    assert!(
        gate_joining_exact > 0
            && head_exact > 0
            && down_exact > 0
            && mlp_norm_exact > 0
            && tied_down_exact > 0
            && input_gradients_exact > 0
            && recomputed_head_exact > 0,
        "{gate_joining_exact} {head_exact} {down_exact} {mlp_norm_exact} {tied_down_exact} {input_gradients_exact} \
         {recomputed_head_exact}"
    );
}

/// Compiles `config`'s training step on the tsp `mesh` (alone or beside dp) under ZeRO-`zero` and
/// `recompute`, `batch` sequences of `seq` tokens: the cost model's workload (a dp replica's), and
/// each rank's program beside the closed form of its peak at its place on the tsp axis.
fn tsp_training_peaks(
    config: &pleat_ir::model::config::ModelConfig,
    mesh: &'static str,
    zero: u8,
    recompute: Recompute,
    batch: u64,
    seq: u64,
) -> (Workload, Vec<(pleat_backend::Program, pleat_passes::cost::compiled::ForwardPhase)>) {
    let model = ModelShape::from_config(config);
    let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
    let training = TrainingLayout { zero_stage: zero, ..TrainingLayout::recomputing(mesh, false, recompute) };
    let (programs, _) = compile_training_at(config, &training, batch, seq);
    let workload = Workload {
        tsp_shards_embeddings: true,
        recompute: cost_recompute(recompute),
        zero,
        ..Workload::training(seq, batch / layout.batch_split())
    };
    let parsed = Mesh::parse(mesh).unwrap();
    let peaks = programs
        .into_iter()
        .map(|program| {
            let tsp_rank = parsed.coord(program.rank, AxisName::Tsp);
            let phase = compiled_tsp_training_peak(&model, &layout, &workload, tsp_rank)
                .unwrap_or_else(|| panic!("{mesh}: tsp, alone or beside dp and ep, is modelled"));
            (program, phase)
        })
        .collect();
    (workload, peaks)
}

#[test]
fn tsp_closed_form_plus_named_terms_equals_the_planners_training_peak() {
    // tsp peaks at the end of the backward (the whole-vocabulary embedding gradient) on few
    // tokens, and inside the first layer's MLP ring backward on more, every rank alike (the ring
    // is symmetric); which of the ring's points is highest depends on the tokens too. With full
    // recompute on many tokens an attention backward peaks instead, at its last owner's dv. On a
    // model whose attention outweighs its MLP and vocabulary (tiny with ffn 32 and 64 tokens in
    // its vocabulary, two and three layers), an attention backward peaks, each rank at its own
    // point: as o's gradient is reduced to it or to another owner, or inside the last owner's
    // backward; the first layer's or the last's.
    let tiny = preset("tiny").unwrap();
    let attention_heavy =
        pleat_ir::model::config::ModelConfig { intermediate_size: 32, vocab_size: 64, ..tiny.clone() };
    let deeper = pleat_ir::model::config::ModelConfig { num_layers: 3, ..attention_heavy.clone() };
    // With the embedding tied to the head, the head's part of the table's gradient is held from
    // the backward's start to its end.
    let tied = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..tiny.clone() };
    let tied_heavy = pleat_ir::model::config::ModelConfig { tie_word_embeddings: true, ..attention_heavy.clone() };
    let mut phases = std::collections::BTreeSet::new();
    let mut attention_peaks = 0;
    // ZeRO-2 peaks holding a gradient kept whole, and with the embedding's tsp shard sliced;
    // ZeRO-3 holding a parameter kept whole, and a layer's attention or MLP weights gathered again.
    let (mut kept_whole_peaks, mut sliced_peaks) = (0, 0);
    let (mut params_kept_whole_peaks, mut attention_gathered_peaks, mut mlp_gathered_peaks) = (0, 0, 0);
    let mut tied_peaks = 0;
    for (config, shapes) in [
        (&tiny, &[(2, SEQ), (4, SEQ), (2, 64), (4, 128)][..]),
        (&attention_heavy, &[(2, 16), (2, 32), (2, 64), (2, 128)][..]),
        (&deeper, &[(2, 32), (2, 128)][..]),
        (&tied, &[(2, SEQ), (4, 64)][..]),
        (&tied_heavy, &[(2, 16), (4, 64)][..]),
    ] {
        let model = ModelShape::from_config(config);
        // Beside dp (ZeRO-1 splitting only the optimizer's state) a replica peaks as tsp alone
        // does on its share of the batch.
        // Under ZeRO-2 each finished gradient is its dp shard (whole where its rows do not divide
        // over dp: tiny's k and v beside tsp=4, or dp=4), and the embedding's tsp shard is sliced
        // before its reduce-scatter. ZeRO-3 holds the parameters so too (k and v whole at dp=4),
        // and gathers them again in the backward.
        let meshes = [("tsp=2", 0), ("tsp=4", 0), ("dp=2,tsp=2", 0), ("dp=2,tsp=4", 1)];
        let zero2 = [("dp=2,tsp=2", 2), ("dp=2,tsp=4", 2), ("dp=4,tsp=2", 2)];
        let zero3 = [("dp=2,tsp=2", 3), ("dp=2,tsp=4", 3), ("dp=4,tsp=2", 3)];
        for (mesh, zero) in meshes.into_iter().chain(zero2).chain(zero3) {
            let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), false);
            let dp = layout.degree(AxisName::Dp);
            for &(batch, seq) in shapes.iter().filter(|&&(batch, _)| batch % dp == 0) {
                for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                    let (workload, peaks) = tsp_training_peaks(config, mesh, zero, recompute, batch, seq);
                    let memory = &memory_per_stage(&model, &layout, &workload)[0];
                    for (program, phase) in &peaks {
                        let highest = phase.terms.last().map_or("", |term| term.name);
                        phases.insert(match phase.name {
                            "tsp mlp ring backward" => highest,
                            name => name,
                        });
                        let bytes_of = |name: &str| {
                            phase
                                .terms
                                .iter()
                                .filter(|term| term.name.starts_with(name))
                                .map(|term| term.bytes)
                                .sum::<f64>()
                        };
                        kept_whole_peaks += usize::from(bytes_of("finished gradients ZeRO-2 keeps whole") > 0.0);
                        sliced_peaks += usize::from(bytes_of(TSP_SHARD_SLICED_BEFORE_DP) > 0.0);
                        let params_kept_whole = bytes_of(PARAMS_KEPT_WHOLE);
                        params_kept_whole_peaks += usize::from(params_kept_whole > 0.0);
                        attention_gathered_peaks +=
                            usize::from(bytes_of("the layer's attention weights, gathered") > 0.0);
                        mlp_gathered_peaks += usize::from(bytes_of("the layer's MLP weights, gathered") > 0.0);
                        tied_peaks += usize::from(bytes_of(TIED_HEAD_GRADIENT) > 0.0);
                        let differences = training_differences_from_closed_form(memory, phase);
                        let otherwise = differences.iter().find(|term| term.name.contains("counts otherwise")).unwrap();
                        let predicted = memory.peak_bytes + differences.iter().map(|term| term.bytes).sum::<f64>();
                        let label = format!(
                            "{} layers {} ffn {mesh} batch {batch} seq {seq} {recompute:?} rank {}",
                            config.num_layers, config.intermediate_size, program.rank
                        );
                        assert_eq!(otherwise.bytes, 0.0, "{label}");
                        let planned = plan(program, ElementSize::Fixed(4));
                        // ZeRO-3's parameters are the dp shards the closed form counts, and the
                        // whole of those whose rows do not divide over dp.
                        assert_eq!(planned.param_bytes as f64, phase.params + params_kept_whole, "{label}");
                        // Only full recompute, or ZeRO-3 with the layer's weights gathered
                        // again, peaks in an attention kernel's backward, at an owner's dv.
                        let in_attention_backward = matches!(
                            program.instructions[planned.peak_instr],
                            Instr::Kernel { kernel: pleat_backend::Kernel::AttentionGrad { .. }, .. }
                        );
                        if in_attention_backward {
                            assert!(recompute == Recompute::Full || zero == 3, "{label}");
                            assert!(phase.name.ends_with("owner's dv"), "{label}: {}", phase.name);
                            attention_peaks += 1;
                        }
                        assert_eq!(
                            planned.peak_bytes as f64, predicted,
                            "{label}: planner vs closed form ({}, {highest}) + {differences:?}",
                            phase.name
                        );
                    }
                }
            }
        }
    }
    // Every phase, and more than one of the ring's points, was checked against the planner.
    for phase in [
        "end of backward",
        "lm head backward",
        "an attention backward's last owner's dv",
        "an attention o gradient reduced to this rank, its owner",
        "an attention o gradient reduced to another owner",
        "an attention backward's last owner's q input gradient",
        "an attention backward's second owner's dv",
        "an attention o gradient reduced to this rank, the first owner",
        "an attention o gradient reduced to the first owner",
    ] {
        assert!(phases.contains(phase), "{phase} not among {phases:?}");
    }
    assert!(phases.iter().filter(|phase| phase.starts_with("mlp ring backward")).count() >= 2, "{phases:?}");
    assert!(attention_peaks > 0, "some case peaks in the attention backward");
    assert!(kept_whole_peaks > 0 && sliced_peaks > 0, "{kept_whole_peaks} {sliced_peaks}");
    assert!(
        params_kept_whole_peaks > 0 && attention_gathered_peaks > 0 && mlp_gathered_peaks > 0,
        "{params_kept_whole_peaks} {attention_gathered_peaks} {mlp_gathered_peaks}"
    );
    assert!(tied_peaks > 0, "some tied case peaks holding the head's part of the table's gradient");
}

#[test]
fn tsp_training_closed_form_equals_the_planners_peak_for_a_mixture() {
    // A mixture's routed experts split over tsp: its backward is dispatched over the axis from a
    // copy of its operands (the MLP norm's output, the router, the rank's experts and the layer's
    // output gradient), beside the router's gradients from the load-balancing loss and the expert
    // counts summed over the layers (ZeRO-3 gathers the router and the rank's experts again for
    // it), and under ZeRO-2 and 3 its three expert gradients, made whole, are reduce-scattered one
    // by one. A shared expert is a ring MLP, run first in the layer's backward. On a wide
    // vocabulary the step peaks at the loss's backward, every token's logits (the rank's share of
    // the vocabulary) beside their gradient. tiny-moe, tied, with a vocabulary of 2048, and with
    // a shared expert a quarter of the hidden size wide (with the load-balancing loss) and eight
    // times it (without), tsp at 2 and 4 alone and beside dp (ZeRO 0 to 3), each recomputation,
    // 16 to 512 tokens: exact on every rank (up to 50% below on the dispatch, and 16% at the
    // loss's backward, before they were modelled). Over ep beside tsp, which keeps the experts
    // whole, each tsp rank runs its own tokens through the rank's share over ep, and the experts'
    // gradients are partial sums over tsp, all-reduced over it one by one, the first beside the
    // other two unreduced (3.6% below at ep=2 × tsp=4 before it was modelled); ZeRO 0 and 1,
    // beside dp too; ZeRO-2 and 3, which split the dense parameters over dp × ep and the experts
    // over dp alone (refused before), where under ZeRO-3 the router's gradient is still whole,
    // gathered, as the experts' are all-reduced.
    let moe = preset("tiny-moe").unwrap();
    let configs = [
        moe.clone(),
        tied(moe.clone()),
        pleat_ir::model::config::ModelConfig { vocab_size: 2048, ..moe.clone() },
        with_a_shared_expert(32, true),
        with_a_shared_expert(1024, false),
    ];
    let meshes = [
        ("tsp=2", 0),
        ("tsp=4", 0),
        ("dp=2,tsp=2", 1),
        ("dp=2,tsp=2", 2),
        ("dp=2,tsp=2", 3),
        ("dp=2,tsp=4", 3),
        ("ep=2,tsp=2", 0),
        ("ep=2,tsp=4", 1),
        ("ep=2,tsp=2", 2),
        ("ep=2,tsp=4", 3),
        ("dp=2,ep=2,tsp=2", 0),
        ("dp=2,ep=2,tsp=2", 3),
    ];
    let mut peaks = std::collections::BTreeSet::new();
    for config in &configs {
        for (mesh, zero) in meshes {
            for seq in [16, 128, 512] {
                for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                    for (program, phase) in tsp_training_peaks(config, mesh, zero, recompute, 4, seq).1 {
                        let planned = plan(&program, ElementSize::Fixed(4));
                        assert_eq!(
                            phase.bytes(),
                            planned.peak_bytes as f64,
                            "{} {mesh} ZeRO-{zero} {seq} tokens {recompute:?} rank {}: {:?}",
                            config.name,
                            program.rank,
                            phase.terms
                        );
                        peaks.insert(phase.name);
                    }
                }
            }
        }
    }
    for name in [
        "a mixture's experts' backward dispatched",
        "a mixture's expert gradients reduce-scattered",
        "a mixture's expert gradients all-reduced over tsp",
        "the loss's backward",
        "tsp mlp ring backward",
    ] {
        assert!(peaks.contains(name), "{name} is never the peak: {peaks:?}");
    }
}

#[test]
fn tsp_training_closed_form_keeps_whole_what_zero_cannot_split() {
    // ZeRO splits a parameter's rows over each of its replicas' axes that divides them, and keeps
    // the rest whole: with six experts at tsp=2 each rank's three experts stay whole over dp=2
    // (their gradients reduced whole, their weights never gathered under ZeRO-3); over dp=2 ×
    // ep=3 the closed form's shard of a dense parameter is a sixth, but only the router's six
    // rows divide over both: every other dense parameter's rows (or next dim) divide over dp and
    // not over ep, so a rank keeps half of it (ZeroSplits). Exact on every rank, each
    // recomputation, 16 and 256 tokens (refused before; the sixths sum to whole bytes). With a
    // shared expert at dp=4 × tsp=4 (two experts a rank, kept whole) on 64 tokens, a middle
    // owner's q input gradient is made beside the activations of the owners still to come (4 KB
    // below before it was modelled).
    let moe = preset("tiny-moe").unwrap();
    let six = pleat_ir::model::config::ModelConfig {
        moe: moe.moe.clone().map(|moe| pleat_ir::model::config::MoeConfig { num_experts: 6, ..moe }),
        ..moe
    };
    let shared = with_a_shared_expert(32, true);
    let mut peaks = std::collections::BTreeSet::new();
    for (config, mesh, zero, batch, seqs) in [
        (&six, "dp=2,tsp=2", 2, 4, &[16, 256][..]),
        (&six, "dp=2,tsp=2", 3, 4, &[16, 256]),
        (&six, "dp=2,ep=3,tsp=2", 3, 6, &[16, 256]),
        (&shared, "dp=4,tsp=4", 3, 8, &[64]),
    ] {
        for &seq in seqs {
            for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                for (program, phase) in tsp_training_peaks(config, mesh, zero, recompute, batch, seq).1 {
                    let planned = plan(&program, ElementSize::Fixed(4));
                    assert_eq!(
                        phase.bytes(),
                        planned.peak_bytes as f64,
                        "{mesh} ZeRO-{zero} {seq} tokens {recompute:?} rank {}: {:?}",
                        program.rank,
                        phase.terms
                    );
                    peaks.insert(phase.name);
                }
            }
        }
    }
    let name = "an attention backward's q input gradient, owners still to come";
    assert!(peaks.contains(name), "{name} is never the peak: {peaks:?}");
}

#[test]
fn zero_bubble_dense_stage_closed_form_on_more_tokens() {
    // Under zero bubble the micro-batches between their B and W keep what W reads, more than one
    // in flight keeps, so on more tokens a dense stage peaks beside them in a B (its first layer's
    // attention backward, then as the attention norm output's gradients from v, k and q are
    // summed, the layer's MLP inputs and output gradients kept for W), at the head of a W (as the
    // LM head's, or another chunk's last down projection's, weight gradient is made or joins its
    // sum; beside a tied table the head's part of it made, sent back and held by the first stage)
    // or, while ZB-H1 ran a forward before a due W, in a forward (as its last layer's output is
    // made; modelled still, no longer a peak here); on the last stage also as B begins
    // with the loss's backward, all the micro-batch's forward kept beside the logits' gradient.
    // At the head of a W on a chunk but the last, after down's, up's and gate's weight gradients
    // join their sums (beside dp or cp each all-reduced first), what they read freed as they go;
    // under ZeRO-2 and 3 as up's is reduce-scattered after down's; in W's first layer of a chunk,
    // as its gate gradient joins its sum before its attention's weight gradients are made (1.5%
    // below before it was modelled). Beside a tied table W goes on from the head's part to the
    // last layer's MLP, the part held (beside dp × tp reduced over dp at the W's end); under
    // ZeRO-3 over dp and cp the table is gathered in two steps for the head's backward in B.
    // Each is modelled: from 64 to 1024 tokens, tied or not, the form is never above the planner's
    // peak and within 1% below it (4% at most when this was written, down from 64%; 3.4% once B's
    // points were modelled under full recomputation and a forward's as the last layer's SiLU
    // product is made there; 1.7% once W's up and gate gradients were, until a tied table's
    // forward was: its last stage peaked under full recomputation on 1024 tokens as its last
    // layer's SiLU product was made beside two micro-batches between B and W), beside dp × tp or
    // tp × cp within 1%, under ZeRO-2 and 3 within 1% (0.01%, down from 40%; tied too; 1.9%
    // beside tp under SP until up's reduce-scatter was modelled), exact on nine stages in ten
    // (2944 of 3132; 2435 of 2628 before W's first-layer gate and a tied table's W beside dp × tp
    // were).
    let (four, wide_vocabulary, tied) = four_layers_wide_and_tied();
    let layout = |mesh, micro_batches, sequence_parallel, zero_stage| PipelinedLayout {
        sequence_parallel,
        zero_stage,
        ..PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, micro_batches)
    };
    let configs = [&four, &wide_vocabulary, &tied];
    let tallies = [
        tally_stage_closed_forms(
            &configs,
            &[
                layout("pp=2", 4, false, 0),
                layout("pp=2", 2, false, 0),
                layout("pp=4", 4, false, 0),
                layout("pp=2,dp=2", 2, false, 0),
                layout("pp=2,tp=2", 2, false, 0),
                layout("pp=2,tp=2", 2, true, 0),
                layout("pp=2,cp=2", 2, false, 0),
                layout("pp=4,tp=2", 4, false, 0),
                layout("pp=4,dp=2", 2, false, 0),
            ],
            0.99,
        ),
        // (Beside tp × cp under SP, on the first stage W's tail holds no split attention residual
        // gradient, but the rank's own token ids: the form was above the planner there.)
        tally_stage_closed_forms(
            &configs,
            &[
                layout("pp=2,dp=2,tp=2", 2, false, 0),
                layout("pp=2,dp=2,tp=2", 2, true, 0),
                layout("pp=2,tp=2,cp=2", 2, false, 0),
                layout("pp=2,tp=2,cp=2", 2, true, 0),
            ],
            0.99,
        ),
        // (ZeRO-2 and 3 beside tp under SP: W's reduce-scatter of the last down gradient comes
        // after the output gradient gathered over tp is freed, which the form had held there.)
        tally_stage_closed_forms(
            &configs,
            &[layout("pp=2,dp=2,tp=2", 2, true, 2), layout("pp=2,dp=2,tp=2", 2, true, 3)],
            0.99,
        ),
        tally_stage_closed_forms(
            &configs,
            &[layout("pp=2,dp=2", 2, false, 2), layout("pp=2,dp=2", 2, false, 3), layout("pp=2,cp=2", 2, false, 2)],
            0.99,
        ),
        // Over dp and cp both (W reduce-scatters each gradient over each).
        tally_stage_closed_forms(
            &configs,
            &[layout("pp=2,dp=2,cp=2", 1, false, 2), layout("pp=2,dp=2,cp=2", 1, false, 3)],
            0.99,
        ),
    ];
    let (stages, exact, exact_at) = merged_tallies(tallies);
    // Beside tp = 4 under SP the norms' output gradients W reads, the last layer's output gradient
    // on the last stage and the embedding output's gradient on the first are split, or whole,
    // where at tp = 2 the two are the same bytes (the form had been above the planner there): never
    // above, within 0.5% (6.9% when this was written, exact on one stage in six; 1.9% once B's
    // points held o's output gradient gathered over tp for W and under SP the positions q's RoPE
    // backward reads after v's and k's input gradients are summed, and were modelled under full
    // recomputation; 0.9% until W's first-layer gate point held o's output gradient gathered too).
    tally_stage_closed_forms(&configs, &[layout("pp=2,tp=4", 2, true, 0)], 0.995);
    // And beside cp, whose ranks' tokens SP splits over tp as it does without cp (5% below where
    // the LM head's gradient joins its sum after cp's all-reduce, until that point freed the
    // logits' gradient W read, the rank's tokens', rather than every token's logits).
    tally_stage_closed_forms(&configs, &[layout("pp=2,tp=4,cp=2", 2, true, 0)], 0.98);
    // Four micro-batches under ZeRO-2 and 3 peak beside the sums' shards as W reduce-scatters a
    // gradient (in a forward while a forward ran before a due W: 13% below on tsp, 3% beside dp,
    // before forwards were modelled under ZeRO; 1.9% beside dp=4 × tp=2 until they held the k and
    // v sums ZeRO keeps whole, and the up projection's output beside its weight gathered under
    // full recomputation): within 0.1%, 752 of 756 stages exact when this was written.
    let four_micro_batches =
        [("pp=2,dp=2", 2), ("pp=2,dp=2", 3), ("pp=2,dp=4,tp=2", 3), ("pp=2,cp=2", 3)].map(|(mesh, zero_stage)| {
            let zero_bubble = ScheduleKind::ZeroBubbleH1;
            PipelinedLayout::one_sequence_a_micro_batch(mesh, zero_bubble, 4, zero_stage, Recompute::None, false)
        });
    let (zero_stages, zero_exact, zero_exact_at) = tally_stage_closed_forms(&configs, &four_micro_batches, 0.999);
    assert!(20 * zero_exact >= 19 * zero_stages, "{zero_exact} of {zero_stages} exact");
    assert_each_is_a_peak(
        &zero_exact_at,
        &[
            "the last layer's down gradient reduce-scattered in W",
            "the LM head's weight gradient reduce-scattered in W",
        ],
    );
    assert_each_is_a_peak(
        &exact_at,
        &[
            "first layer's attention backward in B",
            "first layer's attention norm output's gradients summed in B",
            "the LM head's weight gradient in W",
            "the LM head's weight gradient joins its sum in W",
            "the last layer's down gradient in W",
            "the last layer's down gradient joins its sum in W",
            "the LM head's part of the tied table's gradient is made in W",
            "the loss's backward in B",
            "the LM head's weight gradient reduce-scattered in W",
            "the last layer's gate gradient joins its sum in W",
            "the last layer's up gradient joins its sum in W, all-reduced",
            "the last layer's up gradient reduce-scattered in W",
            "first layer's gate gradient joins its sum in W",
            "the LM head's part of the tied table's gradient reduced over dp",
        ],
    );
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact");
}

#[test]
fn mixture_stage_closed_form_under_sequence_parallelism_on_more_tokens() {
    // Under Megatron SP a mixture's experts read the layer's output gradient all-gathered over tp,
    // and their input gradient (each rank's partial sum over its share of the experts' channels,
    // every token's) is all-reduced over tp beside it: on more tokens a stage peaks there, at the
    // head of a backward (under full recomputation beside the MLP norm's output recomputed). The
    // form was 6.3% below on 1024 tokens beside dp × tp before that point was modelled under SP,
    // and 3.4% under full recomputation. Under zero bubble a forward may peak as the last layer's
    // MLP output is reduce-scattered over tp, staged whole (4.6% below before it was modelled).
    // In B (which makes the experts' gradients) it may peak as the first layer's experts' input
    // gradient is all-reduced, the last layer's output kept gathered over tp for the final norm on
    // the last stage. tiny-moe, each recomputation, 64 to 1024 tokens: exact outside zero bubble,
    // within 2% below under it (B's attention points).
    let config = preset("tiny-moe").unwrap();
    let mut exact_at = std::collections::BTreeMap::<&str, usize>::new();
    for (config, layout) in mixture_sequence_parallel_cases(&config) {
        for seq in [64, 256, 1024] {
            for stage in stage_closed_forms(&config, &layout, seq) {
                let (planned, form) = (stage.planned.peak_bytes as f64, stage.phase.bytes());
                if layout.schedule == ScheduleKind::ZeroBubbleH1 {
                    assert!(form <= planned && form >= 0.98 * planned, "{}: {form} against {planned}", stage.label);
                } else {
                    assert_eq!(form, planned, "{}: {:?}", stage.label, stage.phase.terms);
                }
                if form == planned {
                    *exact_at.entry(stage.phase.name).or_default() += 1;
                }
            }
        }
    }
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the last layer's routed experts' input gradient all-reduced over tp",
            "first layer's routed experts' input gradient all-reduced over tp in B",
        ],
    );
}

#[test]
fn shared_expert_stage_closed_form_under_sequence_parallelism() {
    // Under SP a mixture's shared expert reads the layer's output gradient all-gathered over tp,
    // the router's backward for the load-balancing loss comes before the shared expert's (its
    // gradients live, and on the first stage the received counts freed), and the gate vector's
    // backward comes last (the gate logit's gradient live until then); up's input gradient is
    // all-reduced over tp before it joins the router's. Under zero bubble W reads the scaled
    // output's gradient whole (gathered), a forward sums the routed and shared experts' outputs
    // whole before their reduce-scatter (the layer's statistics after), and under full
    // recomputation it may peak as the shared expert's output is scaled by its gate. The stage's
    // form is never above the planner's peak and within 1% below it (0.09% at most outside zero
    // bubble when this was written, 3.6% when the shared expert's points were modelled as without
    // SP; 0.56% under it, 9.6% before its SP order was modelled there), exact on more than four
    // stages in five (1116 of 1296 when this was written; 400 of 720 outside zero bubble before).
    let four =
        |config: pleat_ir::model::config::ModelConfig| pleat_ir::model::config::ModelConfig { num_layers: 4, ..config };
    let (shared, shared_wide) = (four(with_a_shared_expert(32, true)), four(with_a_shared_expert(1024, true)));
    let layout = |mesh, kind, micro_batches, zero_stage| PipelinedLayout {
        sequence_parallel: true,
        zero_stage,
        ..PipelinedLayout::new(mesh, kind, micro_batches)
    };
    let (one_f_one_b, gpipe, interleaved) =
        (ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::Interleaved { chunks: 2 });
    let zero_bubble = ScheduleKind::ZeroBubbleH1;
    let (stages, exact, exact_at) = tally_stage_closed_forms(
        &[&shared, &shared_wide],
        &[
            layout("pp=2,tp=2", one_f_one_b, 2, 0),
            layout("pp=2,tp=2", gpipe, 4, 0),
            layout("pp=2,dp=2,tp=2", interleaved, 2, 0),
            layout("pp=2,ep=2,tp=2", one_f_one_b, 2, 0),
            layout("pp=2,dp=2,tp=2", one_f_one_b, 2, 2),
            layout("pp=2,dp=2,tp=2", gpipe, 2, 3),
            layout("pp=2,tp=2", zero_bubble, 2, 0),
            layout("pp=2,tp=2", zero_bubble, 4, 0),
            layout("pp=2,ep=2,tp=2", zero_bubble, 2, 0),
            layout("pp=2,dp=2,tp=2", zero_bubble, 2, 2),
            layout("pp=2,dp=2,tp=2", zero_bubble, 2, 3),
        ],
        0.99,
    );
    assert!(5 * exact >= 4 * stages, "{exact} of {stages} exact: {exact_at:?}");
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the last layer's routed experts' input gradient all-reduced over tp",
            "the last layer's expert gradients made, before their reduce-scatter",
            "first layer's attention norm output's gradients from v and k",
            "first layer's shared expert's down gradient joins its sum",
            "first layer's shared expert's down gradient",
            "the last layer's shared expert's up input gradient all-reduced over tp",
            "first layer's shared expert's up input gradient all-reduced over tp",
            "first layer's shared expert's gate output gradient in B",
            "first layer's shared expert's gate gradient joins its sum",
            "the last layer's down gradient reduce-scattered in W",
        ],
    );
}

#[test]
fn mixture_stage_closed_form_under_zero_2_and_3() {
    // Under ZeRO-2 and 3 a mixture's stage holds its gradients' shards (a dense one's over dp × cp
    // × ep, a routed expert's over dp × cp), and each gradient is reduce-scattered where dp would
    // all-reduce it, staged whole: the routed experts' three (made at once, the MLP norm's output
    // freed before the first is scattered; under ZeRO-2 after the router's, under ZeRO-3 before it,
    // the router's gradient whole until then) and a shared expert's, one by one. Under ZeRO-3 the
    // experts' backward gathers the router's and the experts' weights again, live as their input
    // and weight gradients are made (the stage peaks as the last is, or over ep as the backward is
    // dispatched), and under full recomputation the shared expert's gate and up weights and the MLP
    // norm's too. Under zero bubble these points are B's (a shared expert's gate gradient is
    // scattered in W), and under ZeRO-3 B may peak as a shared expert's down input gradient is made
    // beside its weights gathered again, or under full recomputation as those are gathered in two
    // steps (over ep, then cp), the first's output beside the second's (8.6% below before it was
    // modelled). In B the routed experts' gradients joining their sums free the MLP norm's output
    // but beside a shared expert, whose weight gradients W reads it with (1.6% below before). Under
    // ZeRO-3 with full recomputation the attention norm's, q's, k's and v's weights gathered again
    // for the recomputed forward are live in the attention backward (3.1% below before). Over ep ×
    // tp the dispatch makes the routed experts' and the router's gradients before the experts'
    // input gradient is all-reduced over tp: a point there too (1.9% below before). Without ep,
    // under ZeRO-3, the routed experts' input gradient is summed with the router's from the
    // load-balancing loss before their weight gradients are made, the experts' weights still
    // gathered (1.5% below at 1024 tokens before). Beside replicas a chunk but the first may peak
    // as its first layer's attention norm output's gradient from q joins the sum of those from k
    // and v, as a dense one does (0.8% below before it was modelled for a mixture). Under zero
    // bubble W reduce-scatters the LM head's weight gradient as a dense stage's does (over cp and
    // ep in two steps; 0.9% below before), and B sums the first layer's MLP norm output's gradients
    // as the head does (0.9% below before). Before these points were modelled the form was up to
    // 34% above the planner's peak on these layouts. From 64 to 1024 tokens, each recomputation,
    // tiny-moe and two shared-expert variants, each schedule: never above, within 2% below (1.5% at
    // most on these layouts when this was written; 4.9% before the routed experts' input gradient's
    // all-reduce over tp was modelled beside a shared expert, and the experts' gradients made under
    // ZeRO-2, beside the MLP norm's output and under SP the output gradient gathered), exact on
    // nine stages in ten (4692 of 5112 when this was written).
    let base = preset("tiny-moe").unwrap();
    let four =
        |config: pleat_ir::model::config::ModelConfig| pleat_ir::model::config::ModelConfig { num_layers: 4, ..config };
    let (experts, shared, shared_wide) =
        (four(base), four(with_a_shared_expert(32, true)), four(with_a_shared_expert(1024, true)));
    let layout = |mesh, kind, sequence_parallel, zero_stage| PipelinedLayout {
        sequence_parallel,
        zero_stage,
        ..PipelinedLayout::new(mesh, kind, 2)
    };
    let (one_f_one_b, gpipe, interleaved, zero_bubble) = (
        ScheduleKind::OneFOneB,
        ScheduleKind::GPipe,
        ScheduleKind::Interleaved { chunks: 2 },
        ScheduleKind::ZeroBubbleH1,
    );
    let mut tallies = Vec::new();
    for zero_stage in [2, 3] {
        tallies.push(tally_stage_closed_forms(
            &[&experts, &shared, &shared_wide],
            &[
                layout("pp=2,dp=2", one_f_one_b, false, zero_stage),
                layout("pp=2,cp=2", gpipe, false, zero_stage),
                layout("pp=2,dp=2,tp=2", interleaved, false, zero_stage),
                layout("pp=2,dp=2,cp=2", one_f_one_b, false, zero_stage),
                layout("pp=2,dp=2", zero_bubble, false, zero_stage),
                layout("pp=2,dp=2,tp=2", zero_bubble, false, zero_stage),
                // Over ep ZeRO shards the dense gradients over it, not the experts'; beside cp
                // those over cp.
                layout("pp=2,ep=2", one_f_one_b, false, zero_stage),
                layout("pp=2,ep=2", gpipe, false, zero_stage),
                layout("pp=2,ep=2,tp=2", interleaved, false, zero_stage),
                layout("pp=2,ep=2", zero_bubble, false, zero_stage),
                layout("pp=2,cp=2,ep=2", gpipe, false, zero_stage),
                // (Under ZeRO-3 B's recomputed forward gathers a shared expert's weights over ep,
                // then over cp, the first step's output live beside the second's.)
                layout("pp=2,cp=2,ep=2", zero_bubble, false, zero_stage),
            ],
            0.98,
        ));
        // (A shared expert under SP: `shared_expert_stage_closed_form_under_sequence_parallelism`.)
        tallies.push(tally_stage_closed_forms(
            &[&experts],
            &[
                layout("pp=2,dp=2,tp=2", one_f_one_b, true, zero_stage),
                layout("pp=2,dp=2,tp=2", zero_bubble, true, zero_stage),
                layout("pp=2,ep=2,tp=2", one_f_one_b, true, zero_stage),
            ],
            0.98,
        ));
    }
    // Beside dp × ep (and without ZeRO, where the form was 0.9% above before the router's
    // gradients from the load-balancing loss were summed ahead of the experts' dp all-reduce
    // there too), on 8 sequences: one a micro-batch on each dp × ep rank.
    let dp_ep = |kind, zero_stage| PipelinedLayout { batch: 8, ..layout("pp=2,dp=2,ep=2", kind, false, zero_stage) };
    tallies.push(tally_stage_closed_forms(
        &[&experts, &shared, &shared_wide],
        &[0, 2, 3].map(|zero_stage| dp_ep(one_f_one_b, zero_stage)),
        0.98,
    ));
    tallies.push(tally_stage_closed_forms(&[&experts], &[dp_ep(zero_bubble, 2), dp_ep(zero_bubble, 3)], 0.98));
    let (stages, exact, exact_at) = merged_tallies(tallies);
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact: {exact_at:?}");
    assert_each_is_a_peak(
        &exact_at,
        &[
            "first layer's expert gradient joins its sum",
            "first layer's expert gradients made beside their weights gathered again",
            "the last layer's expert gradients made beside their weights gathered again",
            "first layer's shared expert's down gradient",
            "the last layer's attention residual gradient",
            "first layer's expert gradient joins its sum in B",
            "first layer's expert gradients made beside their weights gathered again in B",
            "first layer's shared expert's gate output gradient in B",
            "first layer's shared expert's gate gradient joins its sum",
            "first layer's experts' backward dispatched",
            "the last layer's routed experts' input gradient all-reduced over tp",
            "the last layer's expert gradients made, before their reduce-scatter",
            "first layer's shared down projection's input gradient in B",
            "first layer's shared down projection's weights gathered again in B, the last step",
            "first layer's experts' backward dispatched in B",
            "first layer's attention backward",
            "the last layer's attention backward",
            "first layer's routed experts' input gradient all-reduced over tp in B",
            "the last layer's MLP norm output's gradients summed",
            "first layer's attention norm output gradient from q",
            "first layer's q input gradient, its weight gathered again",
            "the LM head's weight gradient reduce-scattered in W",
            "first layer's MLP norm output's gradients summed in B",
        ],
    );
}

#[test]
fn zero_bubble_b_under_full_recomputation_holds_what_it_recomputed() {
    // Under zero bubble with full recomputation B recomputes each layer's forward, and a dense
    // stage may peak inside its first layer's B: as the attention kernel's backward makes v's
    // gradient beside q, k and v and the attention norm's output just recomputed, or as the
    // attention norm output's gradients from v and k are summed, the later layers' residual
    // stream and what W reads of them live (under SP o's output gradient gathered over tp among
    // it; under ZeRO-3 the attention norm's and q's weights, gathered again for the recomputed
    // forward, held to their input gradients). The first stage beside dp × tp = 4 under SP peaks
    // at the sum on 1024 tokens; the form was 7.0% below there when only W's points were modelled.
    let (four, _, _) = four_layers_wide_and_tied();
    for zero_stage in [0, 2, 3] {
        let layout = PipelinedLayout {
            recompute: Recompute::Full,
            sequence_parallel: true,
            zero_stage,
            ..PipelinedLayout::new("pp=2,dp=2,tp=4", ScheduleKind::ZeroBubbleH1, 2)
        };
        let forms = stage_closed_forms(&four, &layout, 1024);
        let first = forms.iter().find(|stage| stage.label.contains("stage 0")).unwrap();
        assert_eq!(first.phase.bytes(), first.planned.peak_bytes as f64, "{}: {:?}", first.label, first.phase.terms);
        assert_eq!(first.phase.name, "first layer's attention norm output's gradients summed in B", "{}", first.label);
        for stage in &forms {
            assert!(stage.phase.bytes() <= stage.planned.peak_bytes as f64, "{}", stage.label);
        }
    }
}

/// Checks that each of `names` is the point where the closed form met the planner's peak exactly
/// on some stage (`exact_at` counts the stages at each point).
fn assert_each_is_a_peak(exact_at: &std::collections::BTreeMap<&str, usize>, names: &[&str]) {
    for name in names {
        assert!(exact_at.contains_key(name), "{name} is never the peak: {exact_at:?}");
    }
}

/// The stages, exact stages and exact points of several [`tally_stage_closed_forms`], summed.
fn merged_tallies(
    tallies: impl IntoIterator<Item = (usize, usize, std::collections::BTreeMap<&'static str, usize>)>,
) -> (usize, usize, std::collections::BTreeMap<&'static str, usize>) {
    let (mut stages, mut exact) = (0, 0);
    let mut exact_at = std::collections::BTreeMap::<&'static str, usize>::new();
    for (tally_stages, tally_exact, tally_at) in tallies {
        stages += tally_stages;
        exact += tally_exact;
        for (name, count) in tally_at {
            *exact_at.entry(name).or_default() += count;
        }
    }
    (stages, exact, exact_at)
}

/// Every stage's closed form of each layout in `layouts`, for each recomputation, on each of
/// `configs` at 64, 256 and 1024 tokens, beside its planned peak: never above it and at least
/// `bound` of it. Returns the stages weighed, how many were exact, and where those peaked.
fn tally_stage_closed_forms(
    configs: &[&pleat_ir::model::config::ModelConfig],
    layouts: &[PipelinedLayout],
    bound: f64,
) -> (usize, usize, std::collections::BTreeMap<&'static str, usize>) {
    let (mut stages, mut exact) = (0, 0);
    let mut exact_at = std::collections::BTreeMap::<&'static str, usize>::new();
    for config in configs {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for layout in layouts {
                let layout = PipelinedLayout { recompute, ..*layout };
                for seq in [64, 256, 1024] {
                    for stage in stage_closed_forms(config, &layout, seq) {
                        let (planned, form) = (stage.planned.peak_bytes as f64, stage.phase.bytes());
                        assert!(form <= planned, "{}: closed form {form} above the planner's {planned}", stage.label);
                        assert!(
                            form >= bound * planned,
                            "{}: closed form {form} further below the planner's {planned} than {bound} at '{}'",
                            stage.label,
                            stage.phase.name
                        );
                        stages += 1;
                        if form == planned {
                            exact += 1;
                            *exact_at.entry(stage.phase.name).or_default() += 1;
                        }
                    }
                }
            }
        }
    }
    (stages, exact, exact_at)
}

#[test]
fn zero_bubble_tsp_stage_closed_form_on_more_tokens() {
    // Under zero bubble with tsp, B runs the MLP ring's backward whole (its weight gradients too),
    // so on more tokens a stage peaks inside a ring in B (as the input gradient's parts are summed,
    // or a shard's weight gradient joins its sum): its first layer's, beside the micro-batches
    // between B and W, or on a chunk but the last its last layer's, at the head of B; in a
    // forward, inside its last layer's ring or as the last chunk reorders every token's logits; on
    // the first stage as B gathers the embedding output's gradient over the sequence; on the last
    // as B reduce-scatters the LM head's input gradient over the sequence, or at the head of W, as
    // the LM head's weight gradient is made; and (under full recomputation, which recomputes every
    // owner's q, k and v in B for W) inside B's first layer's attention backward, as the last
    // owner's part of the input gradient is summed. W takes the layers last to first: a stage may
    // peak in its last layer's attention, as o's gradient is reduced to an owner or joins its sum,
    // what W reads of the layers before still live; or, under full recomputation, as W gathers the
    // recomputed final norm's output over the sequence. Each is modelled: from 64 to 1024 tokens,
    // tsp at 2 and 4, beside dp, the form equals the planner's peak on every stage (678 of 720
    // before W's last layer and B's last ring were modelled, 3.2% below at most; 42% before this
    // test's points were).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let layouts = [
        ("pp=2,tsp=2", 2),
        ("pp=2,tsp=2", 4),
        ("pp=2,tsp=4", 2),
        ("pp=2,tsp=4", 4),
        ("pp=4,tsp=2", 4),
        ("pp=2,dp=2,tsp=2", 2),
    ]
    .map(|(mesh, micro_batches)| PipelinedLayout::new(mesh, ScheduleKind::ZeroBubbleH1, micro_batches));
    // Under ZeRO-2 and 3 beside dp too, where four micro-batches peaked in a forward beside the
    // sums' shards while ZB-H1 ran a forward before a due W, under ZeRO-3 the ring's weights
    // gathered over dp for it (13% below before).
    let zero = [2, 3].map(|zero_stage| {
        let zero_bubble = ScheduleKind::ZeroBubbleH1;
        PipelinedLayout::one_sequence_a_micro_batch(
            "pp=2,dp=2,tsp=2",
            zero_bubble,
            4,
            zero_stage,
            Recompute::None,
            false,
        )
    });
    let layouts: Vec<PipelinedLayout> = layouts.into_iter().chain(zero).collect();
    // (A bound of 1: exact on every stage.)
    let (_, _, exact_at) = tally_stage_closed_forms(&[&four, &wide_vocabulary], &layouts, 1.0);
    assert_each_is_a_peak(
        &exact_at,
        &[
            "first layer's MLP ring backward: the input gradient's parts summed",
            "first layer's MLP ring backward: a weight gradient joins its sum",
            "first layer's MLP ring backward: a contribution joins the partial gradient received",
            "first layer's MLP ring backward: the down contribution from the SiLU product",
            "the LM head's weight gradient in W",
            "the embedding output's gradient gathered in B",
            "the LM head's weight gradient joins its sum in W",
            "the LM head's input gradient reduce-scattered in B",
            "the LM head's weight gradient joins its sum in W, all-reduced",
            "first layer's attention backward in B: v's part of the input gradient summed",
            "the last layer's o gradient reduced to this rank, its owner, in W",
            "the last layer's o gradient reduced to another owner, in W",
            "the last layer's o gradient joins its sum, in W",
            "the final norm's output recomputed and gathered in W",
            "the last layer's MLP ring backward: the input gradient's parts summed",
        ],
    );
}

#[test]
fn tsp_stage_closed_form_on_more_tokens() {
    // Outside zero bubble a tsp stage on more tokens peaks inside an MLP ring's backward: its last
    // layer's (at the head of the backward, all the micro-batch holds in flight live; on the last
    // chunk after the head's gradients; under full recomputation beside the ring's input
    // recomputed) or its first layer's (the later layers' activations freed), as the input
    // gradient's parts are summed or a shard's weight gradient joins its sum; inside the first
    // layer's attention backward, as the last owner's attention kernel makes v's gradient; on the
    // last stage in the loss's backward, or as the LM head's weight gradient joins its sum (beside
    // dp after its all-reduce), or under full recomputation as the final norm's output is
    // recomputed and gathered for it. Past the first layer's ring (beside dp its gradients reduced
    // and summed), as the MLP norm's input gradient is summed. From 64 to 1024 tokens, tsp at 2
    // and 4, beside dp, the form is exact on every stage (538 of 576, up to 0.53% below, when this
    // test was first written).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let layouts = [("pp=2,tsp=2", 2), ("pp=2,tsp=2", 4), ("pp=2,tsp=4", 4), ("pp=4,tsp=2", 4), ("pp=2,dp=2,tsp=2", 2)]
        .map(|(mesh, micro_batches)| PipelinedLayout::new(mesh, ScheduleKind::OneFOneB, micro_batches));
    // (A bound of 1: exact on every stage.)
    let (_, _, exact_at) = tally_stage_closed_forms(&[&four, &wide_vocabulary], &layouts, 1.0);
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the last layer's MLP ring backward: the input gradient's parts summed",
            "the last layer's MLP ring backward: a weight gradient joins its sum",
            "the last layer's MLP ring backward: a contribution joins the partial gradient received",
            "first layer's MLP ring backward: a contribution joins the partial gradient received",
            "first layer's MLP ring backward: a weight gradient joins its sum",
            "first layer's MLP ring backward: a weight gradient made, unreduced",
            "the final norm's output regathered for the LM head's gradient",
            "the LM head's weight gradient joins its sum",
            "first layer's attention kernel backward: the last owner's v gradient",
            "first layer's MLP norm's input gradient summed past the ring",
            "the loss's backward",
        ],
    );
}

#[test]
fn tsp_stage_closed_form_under_zero_2_and_3() {
    // Under ZeRO-2 and 3 beside tsp a stage holds its gradients' dp shards. Each gradient is
    // reduce-scattered where dp would all-reduce it, staged whole: the LM head's after it is made
    // beside the logits' gradient and the head's input (under zero bubble in W), the MLP ring's
    // three at the ring's end (they wait unreduced until then, as beside dp alone). ZeRO-3 gathers
    // the rank's shards of a layer's MLP weights over dp again for its ring's backward, and under
    // full recomputation the MLP norm's and the final norm's weights for their recomputation. On
    // the first stage the whole-vocabulary embedding gradient is scattered from every token's
    // gradient, gathered, both orders of the token ids live (beside dp alone too). At dp=4 k's and
    // v's rows are kept whole; the head of a backward (or of a W) has made none of the chunk's
    // layers' k and v gradients, the first layer's backward all but that layer's. Before these
    // points were modelled the form was up to 22% above the planner's peak on these layouts.
    // Under zero bubble B's points count the sums of the gradients kept whole too (once a W has
    // run, this chunk's; 3.8% below before). From 64 to 1024 tokens, each recomputation, tsp at 2
    // and 4: never above; within 1% below (0.94% at most when this was written: the last stage
    // under full recomputation and ZeRO-2 at dp=4 on 256 tokens); exact on nine stages in ten
    // (3448 of 3456 when this was written; 3304 when the test was first written).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let (one_f_one_b, gpipe) = (ScheduleKind::OneFOneB, ScheduleKind::GPipe);
    let (interleaved, zero_bubble) = (ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1);
    let layout = |mesh, kind, zero_stage| PipelinedLayout { zero_stage, ..PipelinedLayout::new(mesh, kind, 2) };
    // (dp=4 on 8 sequences: one a micro-batch on each dp rank.)
    let dp4 = |kind, zero_stage| PipelinedLayout { batch: 8, ..layout("pp=2,dp=4,tsp=2", kind, zero_stage) };
    let mut tallies = Vec::new();
    for zero_stage in [2, 3] {
        let configs = [&four, &wide_vocabulary];
        tallies.push(tally_stage_closed_forms(
            &configs,
            &[
                layout("pp=2,dp=2,tsp=2", one_f_one_b, zero_stage),
                layout("pp=2,dp=2,tsp=4", gpipe, zero_stage),
                layout("pp=4,dp=2,tsp=2", one_f_one_b, zero_stage),
                layout("pp=2,dp=2,tsp=2", interleaved, zero_stage),
                dp4(one_f_one_b, zero_stage),
                layout("pp=2,dp=2,tsp=4", zero_bubble, zero_stage),
                dp4(zero_bubble, zero_stage),
            ],
            0.99,
        ));
    }
    let (stages, exact, exact_at) = merged_tallies(tallies);
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact: {exact_at:?}");
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the LM head's weight gradient, before its dp reduction",
            "the LM head's weight gradient reduce-scattered",
            "the LM head's weight gradient reduce-scattered in W",
            "the last layer's MLP ring backward: a weight gradient made, unreduced",
            "first layer's MLP ring backward: a weight gradient made, unreduced",
            "the embedding's gradient scattered from every token's",
            "the final norm's output regathered for the LM head's gradient",
            "the last layer's o gradient reduced to this rank, its owner, in W",
        ],
    );
}

#[test]
fn stages_whose_key_values_zero_keeps_whole_on_more_tokens() {
    // At dp=4 × tp=2 ZeRO-2 and 3 keep k's and v's gradients whole (their rows do not divide), and
    // on more tokens a stage peaks at the head of its backward (or of a W), where no layer's k and
    // v gradients are made yet. The form had counted them all as made there: up to 6.9% above the
    // planner's peak at dp=4 × tp=2 (4.5% under 1F1B). Now never above, within 3% below
    // (2.43% at most when this was written: the first layer's down gradient made under full
    // recomputation), exact on nine stages in ten (1104 of 1152 when this was written).
    let (four, wide_vocabulary, _) = four_layers_wide_and_tied();
    let layout = |kind, zero_stage, sequence_parallel| PipelinedLayout {
        zero_stage,
        sequence_parallel,
        batch: 8,
        ..PipelinedLayout::new("pp=2,dp=4,tp=2", kind, 2)
    };
    let (one_f_one_b, zero_bubble) = (ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1);
    let (stages, exact, exact_at) = tally_stage_closed_forms(
        &[&four, &wide_vocabulary],
        &[
            layout(one_f_one_b, 2, false),
            layout(one_f_one_b, 3, true),
            layout(zero_bubble, 2, false),
            layout(zero_bubble, 3, true),
        ],
        0.97,
    );
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact: {exact_at:?}");
    assert_each_is_a_peak(
        &exact_at,
        &["the LM head's weight gradient reduce-scattered", "the LM head's weight gradient reduce-scattered in W"],
    );
}

#[test]
fn zero_stage_closed_form_on_more_tokens() {
    // Under ZeRO-2 and 3 each gradient is made whole and reduce-scattered (staged whole), so on
    // more tokens a pipelined stage peaks at the head of its backward: as its last layer's down
    // gradient is made whole beside the SiLU product's gradient (under ZeRO-3 after the down
    // weight is gathered again; under full recomputation beside the MLP recomputed for it, its
    // weights gathered again under ZeRO-3) or is reduce-scattered, and on the last stage as the LM
    // head's weight gradient is reduce-scattered (beside a tied table its part of the table's
    // gradient, made whole, joins no sum: held beside the down points). Modelled: from 64 to 1024
    // tokens, over dp, cp and both, with a wide and a tied vocabulary, the form is never above the
    // planner's peak and within 3% below it
    // (2.24% at most when this was written, down from 62%: the rest is the first layer's gate
    // gradient under full recomputation on few tokens, and a tied table's tail under ZeRO-3 on
    // deeper pipelines), exact on nine stages in ten (1374 of 1440 when this was written); inside
    // the first layer's backward under full recomputation, as its down gradient is made whole
    // beside the MLP recomputed for it, or is reduce-scattered, and as its MLP norm output's
    // gradients are summed, too; under ZeRO-3 as its q input gradient is made beside q's weight
    // gathered again (1.1% below under GPipe before); over dp × cp as the LM head's gradient is
    // reduce-scattered over dp first (the form had been 21% below there). Beside tp (and tp × cp
    // on four stages) within 2% (1.16% when this was written, down from 34%), exact on nine stages
    // in ten (2104 of 2160, from 1152: the output gradient received and its two parts summed were
    // missing, and the attention norm output's gradients from v and k, then q, summed (their
    // weight gradients' shards made), the LM head's gradient made whole before its reduce-scatter,
    // gate's input gradient made in the first layer (under ZeRO-3 beside its weight gathered
    // again), and under full recomputation the last layer's MLP norm output's gradients summed
    // (under ZeRO-3 beside its weight gathered again)), four in five in all.
    let (four, wide_vocabulary, tied) = four_layers_wide_and_tied();
    let layouts = [
        ("pp=2,dp=2", 2, 2),
        ("pp=2,dp=2", 2, 3),
        ("pp=4,dp=2", 2, 2),
        ("pp=4,dp=2", 2, 3),
        ("pp=2,cp=2", 2, 2),
        ("pp=2,cp=2", 2, 3),
        ("pp=2,dp=2,cp=2", 1, 2),
        ("pp=2,dp=2,cp=2", 2, 2),
        ("pp=2,dp=2,cp=2", 1, 3),
    ]
    .map(|(mesh, micro_batches, zero_stage)| PipelinedLayout {
        zero_stage,
        ..PipelinedLayout::new(mesh, ScheduleKind::OneFOneB, micro_batches)
    });
    let untied = tally_stage_closed_forms(&[&four, &wide_vocabulary], &layouts, 0.97);
    // Beside tp (with and without SP; its output gradient gathered over tp for the down
    // projection's backward) within 2%.
    let beside_tp = [
        ("pp=2,dp=2,tp=2", 2, false),
        ("pp=2,dp=2,tp=2", 3, false),
        ("pp=2,tp=2,cp=2", 2, false),
        ("pp=2,dp=2,tp=2", 2, true),
        ("pp=2,dp=2,tp=2", 3, true),
        ("pp=2,tp=2,cp=2", 3, true),
        ("pp=4,tp=2,cp=2", 2, true),
        ("pp=4,tp=2,cp=2", 3, true),
    ]
    .map(|(mesh, zero_stage, sequence_parallel)| PipelinedLayout {
        zero_stage,
        sequence_parallel,
        ..PipelinedLayout::new(mesh, ScheduleKind::OneFOneB, 2)
    });
    let beside_tp4 = [2, 3].map(|zero_stage| PipelinedLayout {
        zero_stage,
        sequence_parallel: true,
        ..PipelinedLayout::new("pp=2,dp=2,tp=4", ScheduleKind::OneFOneB, 2)
    });
    let (stages, exact, exact_at) = merged_tallies([
        untied,
        // (ZeRO-3 over dp × cp too, where the last stage gathers the table in two steps.)
        tally_stage_closed_forms(&[&tied], &layouts, 0.97),
        tally_stage_closed_forms(&[&four, &wide_vocabulary, &tied], &beside_tp, 0.98),
        // At tp = 4 under SP a split pair and a whole hidden state differ: within 3% (3.33% when
        // this was written, down from 7.42%, exact on 560 of 864 stages; 2.12%, 720 exact, once
        // the last layer's MLP norm output's gradients from gate and up summed was modelled
        // without recomputing the MLP too).
        tally_stage_closed_forms(&[&four, &wide_vocabulary, &tied], &beside_tp4, 0.97),
    ]);
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the last layer's down gradient made, before its reduce-scatter",
            "the last layer's down gradient reduce-scattered",
            "the LM head's weight gradient reduce-scattered",
            "first layer's down gradient made, its MLP recomputed",
            "first layer's attention norm output's gradients from v and k",
            "first layer's attention norm output gradient from q",
            "the last layer's MLP norm output gradient, its MLP recomputed",
            "the last layer's MLP norm output's gradients from gate and up summed",
            "the LM head's weight gradient",
            "first layer's gate input gradient made",
            "first layer's down gradient reduce-scattered, its MLP recomputed",
            "first layer's MLP norm output gradient, its MLP recomputed",
            "first layer's q input gradient, its weight gathered again",
        ],
    );
    assert!(5 * exact >= 4 * stages, "{exact} of {stages} exact");
    // Under full recomputation the attention norm's and q's weights gathered again stay until
    // their input gradients: an interleaved stage (a sequence a micro-batch) peaks as the norm
    // output's gradients from v and k are summed beside them (1.7% below before they were held).
    let interleaved = ScheduleKind::Interleaved { chunks: 2 };
    let interleaved =
        PipelinedLayout::one_sequence_a_micro_batch("pp=2,dp=2,tp=2", interleaved, 2, 3, Recompute::Full, true);
    for stage in stage_closed_forms(&four, &interleaved, 64) {
        assert_eq!(stage.phase.bytes(), stage.planned.peak_bytes as f64, "{}: {:?}", stage.label, stage.phase.terms);
    }
}

#[test]
fn the_final_norm_recomputed_under_sp_holds_its_input_gathered_again() {
    // Under full recomputation with SP the last stage recomputes the final norm for its backward
    // from the last layer's output gathered over tp again (the rank's share freed), and under
    // ZeRO-3 with its weight gathered again: both live as the LM head's weight gradient joins its
    // sum past its reduction over cp, or is reduce-scattered over dp. On a 2048-token vocabulary
    // and 64 tokens the stage peaks there (0.6% and 0.7% below before they were held).
    let (_, wide_vocabulary, _) = four_layers_wide_and_tied();
    let full_sp = |mesh, schedule, zero_stage| {
        PipelinedLayout::one_sequence_a_micro_batch(mesh, schedule, 2, zero_stage, Recompute::Full, true)
    };
    for layout in [
        full_sp("pp=2,tp=4,cp=2", ScheduleKind::OneFOneB, 0),
        full_sp("pp=2,tp=4,cp=2", ScheduleKind::GPipe, 0),
        full_sp("pp=2,dp=2,tp=2", ScheduleKind::OneFOneB, 3),
        full_sp("pp=2,dp=2,tp=2", ScheduleKind::GPipe, 3),
    ] {
        for stage in stage_closed_forms(&wide_vocabulary, &layout, 64) {
            stage.assert_exact();
        }
    }
}

#[test]
fn dense_stage_beside_tp_and_cp_closed_form_on_more_tokens() {
    // Without ZeRO, beside tp (with and without SP) and cp, a dense pipelined stage may peak at the
    // head of its backward: on the last stage as the LM head's weight gradient joins its sum beside
    // dp or cp (reduced, its unreduced copy beside it; under tp too, and beside cp with the targets
    // freed); as the last layer's down gradient is made (under SP beside the output gradient
    // gathered over tp) and as it joins its sum (without replicas what made it still live; 0.4%
    // below before), beside dp also after its all-reduce; under full recomputation beside the MLP
    // recomputed for it (without replicas also as it joins its sum, the MLP still live; beside
    // them, whose input gradients come first, as gate's output gradient is made), then as its MLP
    // norm output's gradients from gate and up are summed; on a stage before the last as the two
    // parts of the output gradient it received are summed. Inside the first layer's backward as its
    // down gradient is made beside the MLP recomputed for it, and (beside tp alone too, 2.3% below
    // before it was modelled) as it joins its sum, or beside replicas as gate's output gradient is
    // made, and as the MLP norm output's gradients are summed (1.3% below before); as the attention
    // norm output's gradients from v and k, then q, are summed (beside cp too, k's and v's
    // gradients reduce-scattered back to the rank's tokens by then). Under SP beside cp each cp
    // rank's tokens are split over tp, the stream between layers too, as without cp. From 64 to
    // 1024 tokens, with a wide and a tied vocabulary, the form is never above the planner's peak
    // and within 0.2% below it (1.43% when this was written, down from 23%: the first layer's down
    // gradient under full recomputation over dp × cp); at tp = 4 beside cp under SP within 0.2%
    // (2.77% when that was written: the first layer's attention norm output's gradients, and the
    // MLP recomputed at the head); exact on nine stages in ten (3346 of 3564 when this was written;
    // 4280 of 4428 with tp alone, pp=4 × dp=2 and GPipe at tp = 4 × cp, once the points under full
    // recomputation above were modelled; 4332 of 4428 once the last layer's down gradient joining
    // its sum was, and the final norm's input gathered again under full recomputation and SP).
    let (four, wide_vocabulary, tied) = four_layers_wide_and_tied();
    let layouts = [
        ("pp=2,dp=2,tp=2", 2, true),
        ("pp=4,dp=2,tp=2", 2, false),
        ("pp=4,dp=2,tp=2", 2, true),
        ("pp=2,tp=2,cp=2", 2, true),
        ("pp=4,tp=2,cp=2", 2, true),
        ("pp=2,dp=2,tp=2,cp=2", 1, false),
        ("pp=2,dp=2,tp=2,cp=2", 1, true),
        ("pp=2,cp=2", 2, false),
        ("pp=4,cp=2", 4, false),
        ("pp=2,dp=2,cp=2", 1, false),
        ("pp=2,tp=2", 2, false),
        ("pp=2,tp=2", 2, true),
        ("pp=4,dp=2", 2, false),
    ]
    .map(|(mesh, micro_batches, sequence_parallel)| PipelinedLayout {
        sequence_parallel,
        ..PipelinedLayout::new(mesh, ScheduleKind::OneFOneB, micro_batches)
    });
    let tp4_sp = [ScheduleKind::OneFOneB, ScheduleKind::GPipe]
        .map(|kind| PipelinedLayout { sequence_parallel: true, ..PipelinedLayout::new("pp=2,tp=4,cp=2", kind, 2) });
    let (stages, exact, exact_at) = merged_tallies([
        tally_stage_closed_forms(&[&four, &wide_vocabulary, &tied], &layouts, 0.998),
        tally_stage_closed_forms(&[&four, &wide_vocabulary, &tied], &tp4_sp, 0.998),
    ]);
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the LM head's weight gradient joins its sum",
            "the last layer's down gradient made, its MLP recomputed",
            "the last layer's MLP norm output gradient, its MLP recomputed",
            "the output gradient received",
            "the last layer's down gradient made",
            "the last layer's down gradient joins its sum",
            "first layer's down gradient made, its MLP recomputed",
            "first layer's attention norm output's gradients from v and k",
            "the last layer's down gradient joins its sum, its MLP recomputed",
            "first layer's down gradient joins its sum, its MLP recomputed",
            "the last layer's gate output gradient, its MLP recomputed",
            "first layer's gate output gradient made, its MLP recomputed",
            "first layer's MLP norm output gradient, its MLP recomputed",
            "the last layer's MLP norm output gradient",
        ],
    );
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact");
    // Under GPipe (a sequence a micro-batch) the last stage peaks at the head of its first
    // backward, beside every other micro-batch in flight, as its last layer's MLP norm output's
    // gradients are summed (2.9% below before that point was modelled on the last stage).
    let one_sequence = PipelinedLayout { batch: 2, ..tp4_sp[1] };
    for stage in stage_closed_forms(&four, &one_sequence, 256).iter().filter(|stage| stage.label.ends_with("stage 1")) {
        assert_eq!(stage.phase.name, "the last layer's MLP norm output gradient", "{}", stage.label);
        assert_eq!(stage.phase.bytes(), stage.planned.peak_bytes as f64, "{}", stage.label);
    }
}

#[test]
fn mixture_stage_closed_form_on_more_tokens() {
    // A mixture's pipelined stage (routed experts alone, beside a narrow shared expert, or beside
    // one wider than the routed experts) under each schedule, from 64 to 1024 tokens, over dp, ep,
    // tp (without SP) and cp: never above the planner's peak, within 3% below it (0.93% when this
    // was written, 2.62% before the head of a backward under full recomputation was modelled beside
    // a shared expert, recomputed there), exact on nine stages in ten (3522 of 3564). (Under zero
    // bubble on a stage between the first and the last, the head of W had counted the
    // micro-batch's received expert counts twice: 32 bytes above the planner on four stages.)
    let [four_experts, shared] = four_layer_mixtures();
    let shared_wide = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(1024, true) };
    let meshes =
        [("pp=2", 2), ("pp=2,dp=2", 2), ("pp=2,ep=2", 2), ("pp=2,tp=2", 2), ("pp=2,cp=2", 2), ("pp=2,dp=2,ep=2", 1)];
    let mut layouts = Vec::new();
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { chunks: 2 },
        ScheduleKind::ZeroBubbleH1,
    ] {
        let interleaved = kind == ScheduleKind::Interleaved { chunks: 2 };
        // (Interleaving takes a number of micro-batches the stages divide, and four layers two
        // chunks a rank two stages.)
        layouts.extend(
            meshes
                .iter()
                .filter(|(_, micro_batches)| !interleaved || micro_batches % 2 == 0)
                .map(|(mesh, micro_batches)| PipelinedLayout::new(mesh, kind, *micro_batches)),
        );
        if !interleaved {
            layouts.extend([PipelinedLayout::new("pp=4", kind, 4), PipelinedLayout::new("pp=4,ep=2", kind, 2)]);
        }
    }
    let (stages, exact, exact_at) = tally_stage_closed_forms(&[&four_experts, &shared, &shared_wide], &layouts, 0.97);
    assert_each_is_a_peak(
        &exact_at,
        &[
            "the last layer's down gradient joins its sum in W",
            "first layer's shared expert's gate output gradient in B",
            "first layer's expert gradient joins its sum",
            "the output gradient received",
            "the last layer's shared expert's down gradient",
        ],
    );
    assert!(10 * exact >= 9 * stages, "{exact} of {stages} exact");
}

#[test]
fn zero_bubble_mixture_stage_closed_form_under_zero_on_more_tokens() {
    // Under zero bubble with four micro-batches a mixture's stage under ZeRO-2 and 3 peaks in B, as
    // its first layer's expert gradients are made beside their weights gathered again or join
    // their sums (the running sums the rank's shards), or in W as the LM head's gradient is
    // reduce-scattered. (While ZB-H1 ran a forward before a due W it peaked in that forward, beside
    // the micro-batches between their B and W: as its last layer's routed experts ran, every
    // layer's statistics live; those points are modelled still.) tiny-moe and a narrow shared
    // expert, four layers, beside dp (ZeRO-2 and 3), dp × tp, ep and cp (ZeRO-3), each
    // recomputation, 64 to 1024 tokens.
    let mixtures = four_layer_mixtures();
    let layouts = [("pp=2,dp=2", 2), ("pp=2,dp=2", 3), ("pp=2,dp=2,tp=2", 3), ("pp=2,ep=2", 3), ("pp=2,cp=2", 3)].map(
        |(mesh, zero_stage)| {
            let zero_bubble = ScheduleKind::ZeroBubbleH1;
            PipelinedLayout::one_sequence_a_micro_batch(mesh, zero_bubble, 4, zero_stage, Recompute::None, false)
        },
    );
    // Exact on every stage but one point not modelled: over ep under ZeRO-3 with selective
    // recomputation, B on the first stage may peak as its first layer's q input gradient is made,
    // q's weight gathered again for the recomputed q still live (0.5% below, the shared expert at
    // ep=2 on 64 tokens; it stayed under a forward's peak while ZB-H1 ran a forward before a due
    // W).
    let (stages, exact, exact_at) = tally_stage_closed_forms(&[&mixtures[0], &mixtures[1]], &layouts, 0.995);
    assert!(stages - exact <= 2, "{exact} of {stages} exact");
    assert_each_is_a_peak(
        &exact_at,
        &[
            "first layer's expert gradients made beside their weights gathered again in B",
            "first layer's expert gradient joins its sum in B",
            "the LM head's weight gradient reduce-scattered in W",
        ],
    );
}

#[test]
fn a_mixture_peaks_in_its_last_layers_attention_backward_with_its_inputs_kept() {
    // Outside full recomputation a mixture's first stage beside cp may peak at the head of a
    // backward inside its last layer's attention backward, as the kernel makes v's gradient beside
    // q's and k's (every token's): the layer's MLP norm's input and output and, kept or recomputed,
    // its attention output freed by then, its output projection's weight gradient made. On 1024
    // tokens it does so with ZeRO-2, and beside a shared expert also without ZeRO (0.57% and 0.94%
    // below the planner before it was modelled).
    let [four_experts, shared] = four_layer_mixtures();
    let selective = |schedule, zero_stage| {
        PipelinedLayout::one_sequence_a_micro_batch("pp=2,cp=2", schedule, 2, zero_stage, Recompute::Selective, false)
    };
    let mut peaks_there = 0;
    for (config, zero_stages) in [(&four_experts, &[2u8][..]), (&shared, &[0, 2][..])] {
        for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            for &zero_stage in zero_stages {
                let layout = selective(schedule, zero_stage);
                let first = &stage_closed_forms(config, &layout, 1024)[0];
                first.assert_exact();
                peaks_there += usize::from(first.phase.name == "the last layer's attention backward, its inputs kept");
            }
        }
    }
    assert_eq!(peaks_there, 6);
}

#[test]
fn a_mixtures_last_expert_gradient_joins_its_sum_beside_its_unreduced_copy() {
    // Beside cp without ZeRO the three routed-expert gradients of a layer are all-reduced and join
    // their sums one after another, each unreduced copy freed once its sum is made: the last joins
    // beside the first two reduced and summed and its own unreduced copy. Without recomputation on
    // 256 tokens every stage peaks there, in its chunk's first layer (0.84% below the planner when
    // only the first join was modelled).
    let mut peaks_there = 0;
    for config in &four_layer_mixtures() {
        for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::Interleaved { chunks: 2 }] {
            let layout =
                PipelinedLayout::one_sequence_a_micro_batch("pp=2,cp=2", schedule, 2, 0, Recompute::None, false);
            peaks_there += exact_stages_peaking_at(
                config,
                &layout,
                256,
                &["first layer's last expert gradient joins its sum, its unreduced copy live"],
            );
        }
    }
    assert_eq!(peaks_there, 24);
}

#[test]
fn a_mixtures_lm_head_gradient_joins_its_sum_all_reduced_in_w() {
    // Under zero bubble beside cp without ZeRO, the last stage's W all-reduces the LM head's weight
    // gradient and then copies it into its running sum, the unreduced copy still live: with full
    // recomputation on 256 tokens the last stage peaks there, a mixture's as a dense model's
    // (0.62% below the planner when only the gradient's making was modelled for a mixture).
    let mut peaks_there = 0;
    for config in &four_layer_mixtures() {
        for (mesh, micro_batches) in [("pp=2,cp=2", 2), ("pp=4,cp=2", 4)] {
            let schedule = ScheduleKind::ZeroBubbleH1;
            let layout =
                PipelinedLayout::one_sequence_a_micro_batch(mesh, schedule, micro_batches, 0, Recompute::Full, false);
            let last_stage = stage_closed_forms(config, &layout, 256)
                .into_iter()
                .filter(|stage| stage.phase.name == "the LM head's weight gradient joins its sum in W, all-reduced");
            for stage in last_stage {
                stage.assert_exact();
                peaks_there += 1;
            }
        }
    }
    // The last stage's two ranks, in each of the four layouts (the first stage's are 512 bytes
    // below the planner, elsewhere).
    assert_eq!(peaks_there, 8);
}

#[test]
fn a_shared_experts_up_input_gradient_joins_the_gate_vectors() {
    // Without SP a shared expert's backward sums the MLP norm output's gradients from the gate
    // vector and from up, the SiLU product's two gradients still live: three `[tokens, hidden]`
    // buffers. Beside dp × tp under ZeRO-2 with full recomputation on 1024 tokens (a shared expert
    // 32 wide, 16 a tp rank) the last stage peaks there (0.46% below the planner before).
    let [_, shared] = four_layer_mixtures();
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,dp=2,tp=2",
        ScheduleKind::OneFOneB,
        2,
        2,
        Recompute::Full,
        false,
    );
    let peaks_there = exact_stages_peaking_at(
        &shared,
        &layout,
        1024,
        &["the last layer's shared expert's up input gradient joins the gate vector's"],
    );
    // The last stage's four ranks.
    assert_eq!(peaks_there, 4);
}

#[test]
fn over_ep_under_zero3_the_dispatchs_gathered_router_is_live_as_an_expert_gradient_joins_its_sum() {
    // Over ep under ZeRO-3 the dispatch reads the router's weight gathered again; the copy is freed
    // with the MLP norm's output after the layer's MLP backward, so it is live as the first expert
    // gradient joins its sum, where the last stage peaks on 64 tokens (0.22% below the planner
    // before).
    let mut peaks_there = 0;
    for config in &four_layer_mixtures() {
        for recompute in [Recompute::None, Recompute::Selective] {
            let layout = PipelinedLayout::one_sequence_a_micro_batch(
                "pp=2,ep=2,tp=2",
                ScheduleKind::OneFOneB,
                2,
                3,
                recompute,
                false,
            );
            peaks_there +=
                exact_stages_peaking_at(config, &layout, 64, &["first layer's expert gradient joins its sum"]);
        }
    }
    // The last stage's four ranks, in each of the four layouts.
    assert_eq!(peaks_there, 16);
}

#[test]
fn over_ep_under_zero2_the_routers_gradient_from_the_dispatch_is_whole_until_its_reduce_scatter() {
    // Over ep beside the load-balancing loss the dispatch makes the router's gradient with the
    // experts'; under ZeRO-2 it stays whole (not yet the rank's shard) until it is summed with the
    // loss's and reduce-scattered, after the experts' gradients join their sums. Every stage but the
    // first peaks inside that backward on 64 tokens (0.14% below the planner when the form counted
    // only the shard).
    let inside_the_experts_backward =
        ["first layer's MLP norm output's gradients summed", "first layer's expert gradient joins its sum"];
    let mut peaks_there = 0;
    for config in &four_layer_mixtures() {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let layout =
                PipelinedLayout::one_sequence_a_micro_batch("pp=4,ep=2", schedule, 4, 2, Recompute::None, false);
            peaks_there += exact_stages_peaking_at(config, &layout, 64, &inside_the_experts_backward);
        }
    }
    // The three later stages' six ranks, in each of the four layouts.
    assert_eq!(peaks_there, 24);
}

#[test]
fn under_zero_bubble_over_ep_b_sums_the_mlp_norm_output_gradients_after_the_experts_join() {
    // Over ep beside the load-balancing loss B sums the MLP norm output's gradients from the router
    // and from the dispatch after the experts' gradients join their sums, all of them still live:
    // without recomputation the first stage's B peaks there, under ZeRO-0, 2 and 3 (0.11% below the
    // planner under ZeRO-3 when only the joining was modelled under zero bubble).
    let [four_experts, _] = four_layer_mixtures();
    let mut peaks_there = 0;
    for zero_stage in [0, 2, 3] {
        for seq in [256, 1024] {
            let layout = PipelinedLayout::one_sequence_a_micro_batch(
                "pp=2,ep=2",
                ScheduleKind::ZeroBubbleH1,
                2,
                zero_stage,
                Recompute::None,
                false,
            );
            peaks_there += exact_stages_peaking_at(
                &four_experts,
                &layout,
                seq,
                &["first layer's MLP norm output's gradients summed in B"],
            );
        }
    }
    // The first stage's two ranks, in each of the six layouts.
    assert_eq!(peaks_there, 12);
}

#[test]
fn under_zero2_the_routers_gradient_is_whole_as_the_experts_weight_gradients_are_made() {
    // Under ZeRO-2 beside dp × tp a mixture's router gradient, made before the routed experts'
    // weight gradients, is all-reduced and its shard sliced out only after them: as the last is
    // made the router's is whole and its sum not yet made. Under SP on 256 tokens every schedule
    // peaks there on some stage (0.07% below the planner when its shard alone was counted).
    let [four_experts, _] = four_layer_mixtures();
    let made = [
        "first layer's expert gradients made, before their reduce-scatter",
        "the last layer's expert gradients made, before their reduce-scatter",
        "first layer's expert gradients made, before their reduce-scatter in B",
    ];
    let mut peaks_there = 0;
    for schedule in [
        ScheduleKind::OneFOneB,
        ScheduleKind::GPipe,
        ScheduleKind::Interleaved { chunks: 2 },
        ScheduleKind::ZeroBubbleH1,
    ] {
        let layout =
            PipelinedLayout::one_sequence_a_micro_batch("pp=2,dp=2,tp=2", schedule, 2, 2, Recompute::None, true);
        peaks_there += exact_stages_peaking_at(&four_experts, &layout, 256, &made);
    }
    // Every rank under 1F1B, GPipe and interleaving; the last stage's four under zero bubble.
    assert_eq!(peaks_there, 28);
}

#[test]
fn beside_cp_a_dense_first_layer_sums_its_mlp_norm_output_gradients_before_gates_weight_gradient() {
    // Beside dp or cp a dense layer's gate input gradient comes before its weight gradient: the
    // MLP norm output's gradients from gate and up are summed beside the norm's output, gate's
    // output gradient and the layer's output gradient, down's and up's weight gradients done.
    // Beside tp × cp on 256 tokens the first stage peaks there (0.06% below the planner before),
    // under GPipe without recomputation the last stage too.
    let (four, _, tied) = four_layers_wide_and_tied();
    let mut peaks_there = 0;
    for config in [&four, &tied] {
        for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            for recompute in [Recompute::None, Recompute::Selective] {
                let layout =
                    PipelinedLayout::one_sequence_a_micro_batch("pp=2,tp=2,cp=2", schedule, 2, 0, recompute, false);
                peaks_there += exact_stages_peaking_at(
                    config,
                    &layout,
                    256,
                    &["first layer's MLP norm output's gradients from gate and up summed"],
                );
            }
        }
    }
    // The first stage's four ranks in each of the eight layouts, the last stage's in two.
    assert_eq!(peaks_there, 40);
}

#[test]
fn at_the_embeddings_backward_its_gradient_over_the_whole_vocabulary_is_made_beside_the_token_ids() {
    // Under tp the embedding's backward makes its gradient over the whole vocabulary from the
    // embedding output's gradient (gathered under SP) by the token ids, before the rank's rows are
    // sliced from it: beside cp the rank's own ids are live there too, beside a tied table the
    // head's part of the table's gradient, received. The first stage peaks there (0.07% and 0.02%
    // below the planner before).
    let (_, wide, tied) = four_layers_wide_and_tied();
    let point = ["the embedding's gradient over the whole vocabulary made"];
    let beside_cp = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,tp=4,cp=2",
        ScheduleKind::OneFOneB,
        2,
        0,
        Recompute::Full,
        true,
    );
    assert_eq!(exact_stages_peaking_at(&wide, &beside_cp, 1024, &point), 8);
    let tied_table =
        PipelinedLayout::one_sequence_a_micro_batch("pp=2,tp=4", ScheduleKind::GPipe, 2, 0, Recompute::Full, true);
    assert_eq!(exact_stages_peaking_at(&tied, &tied_table, 64, &point), 4);
}

#[test]
fn under_zero_bubble_the_last_chunks_w_goes_on_from_the_lm_heads_gradient_to_the_last_layers_mlp() {
    // On the last chunk W makes the LM head's weight gradient, then the final norm's and the last
    // layer's MLP's (down's, up's, gate's), as on another chunk: after the head's gradient has
    // joined its sum, what made it freed. Beside tp × cp on 256 tokens the last stage peaks as
    // up's gradient joins its sum, all-reduced (0.02% below the planner before), as the first
    // stage does.
    let four = four_layers();
    let point = ["the last layer's up gradient joins its sum in W, all-reduced"];
    for recompute in [Recompute::None, Recompute::Selective] {
        let layout = PipelinedLayout::one_sequence_a_micro_batch(
            "pp=2,tp=2,cp=2",
            ScheduleKind::ZeroBubbleH1,
            2,
            0,
            recompute,
            false,
        );
        assert_eq!(exact_stages_peaking_at(&four, &layout, 256, &point), 8, "{recompute:?}");
    }
}

#[test]
fn under_zero_bubble_beside_cp_the_losses_sum_is_made_in_b() {
    // Beside cp each rank's loss is over every token's logits (gathered), not all-reduced: the
    // micro-batches' losses are summed in B, as without replicas (beside dp or ep, in W after
    // their all-reduce). On 1024 tokens both stages peak in the first layer's attention backward
    // in B, the last beside the losses' sum (4 bytes below the planner before).
    let four = four_layers();
    for zero_stage in [0, 2] {
        let layout = PipelinedLayout::one_sequence_a_micro_batch(
            "pp=2,cp=2",
            ScheduleKind::ZeroBubbleH1,
            2,
            zero_stage,
            Recompute::None,
            false,
        );
        let point = ["first layer's attention backward in B"];
        assert_eq!(exact_stages_peaking_at(&four, &layout, 1024, &point), 4, "ZeRO-{zero_stage}");
    }
}

#[test]
fn under_zero_bubble_a_mixtures_w_may_peak_at_its_last_layers_o_gradient() {
    // B makes a mixture's experts' and router's gradients, so on a chunk but the last W begins
    // with its last layer's MLP norm's weight gradient, then o's, the first large one to join its
    // sum (beside cp after its all-reduce, its unreduced copy live): there the first stage peaks
    // under full recomputation on 256 tokens (512 bytes below the planner before, the norm's
    // gradient and its new sum uncounted). (Under SP o's gradient frees its output gradient
    // gathered over tp; counted whole the point was 512 bytes above the planner beside ep × tp.)
    let moe = pleat_ir::model::config::ModelConfig { num_layers: 4, ..preset("tiny-moe").unwrap() };
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,cp=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        0,
        Recompute::Full,
        false,
    );
    let point = ["the last layer's o gradient joins its sum in W"];
    assert_eq!(exact_stages_peaking_at(&moe, &layout, 256, &point), 2);
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,ep=2,tp=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        0,
        Recompute::Full,
        true,
    );
    exact_stages_peaking_at(&moe, &layout, 64, &point);
    // Beside a shared expert W makes its gradients first, freeing what they read; under ZeRO-2
    // o's gradient is reduce-scattered, staged whole, where the first stage peaks beside ep (256
    // bytes below the planner before).
    let shared = pleat_ir::model::config::ModelConfig { num_layers: 4, ..with_a_shared_expert(32, true) };
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,ep=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        2,
        Recompute::Full,
        false,
    );
    let point = ["the last layer's o gradient reduce-scattered in W"];
    assert_eq!(exact_stages_peaking_at(&shared, &layout, 64, &point), 2);
}

#[test]
fn under_zero_bubble_and_zero3_a_tsp_stage_holds_the_weights_it_gathered_again_for_its_b() {
    // Under tsp beside dp with ZeRO-3, B gathers weights over dp again and holds them: under full
    // recomputation the final norm's, read again in W, where the last stage peaks inside its
    // first layer's MLP ring (512 bytes below the planner before); without it the rank's own q and
    // k blocks, which wait for their broadcasts to the last owner while its v part of the input
    // gradient is summed, where the last stage peaks at tsp=4 (0.084% below before).
    let four = four_layers();
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,dp=2,tsp=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        3,
        Recompute::Full,
        false,
    );
    let point = ["first layer's MLP ring backward: a weight gradient made, unreduced"];
    assert_eq!(exact_stages_peaking_at(&four, &layout, 64, &point), 8);
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,dp=2,tsp=4",
        ScheduleKind::ZeroBubbleH1,
        2,
        3,
        Recompute::Selective,
        false,
    );
    let point = ["first layer's attention backward in B: v's part of the input gradient summed"];
    assert_eq!(exact_stages_peaking_at(&four, &layout, 1024, &point), 8);
}

#[test]
fn under_zero_bubble_and_zero3_the_final_norms_weight_gathered_again_is_held_from_b_to_w() {
    // Under full recomputation ZeRO-3 gathers the final norm's weight again at the last chunk's
    // B, for the recomputed head, and W reads it again to recompute the final norm's output: it is
    // live from B to W, in the current micro-batch's B and in each micro-batch between B and W (a
    // dense model's and a mixture's). Both stages then peak in the first layer's B (512 and 1024
    // bytes below the planner before).
    let four = four_layers();
    let dense = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,dp=2,tp=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        3,
        Recompute::Full,
        true,
    );
    let point = ["first layer's attention norm output's gradients summed in B"];
    assert_eq!(exact_stages_peaking_at(&four, &dense, 256, &point), 8);
    let mixture = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,cp=2,ep=2",
        ScheduleKind::ZeroBubbleH1,
        2,
        3,
        Recompute::Full,
        false,
    );
    let point = ["first layer's experts' backward dispatched in B"];
    let [routed_only, _] = four_layer_mixtures();
    assert_eq!(exact_stages_peaking_at(&routed_only, &mixture, 64, &point), 8);
}

#[test]
fn under_any_schedule_beside_cp_the_last_stage_may_peak_as_a_forward_gathers_the_logits() {
    // Beside cp the last chunk's forward gathers every token's logits and reorders them out of
    // the zigzag before the loss, a mixture's every layer's statistics still unsummed: under 1F1B
    // and GPipe too (not only zero bubble) the last stage may peak there, beside the sums ZeRO-2
    // and 3 shard (220 bytes below the planner before).
    let [routed_only, shared] = four_layer_mixtures();
    let point = ["every token's logits gathered in a forward"];
    let beside_cp = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,cp=2",
        ScheduleKind::OneFOneB,
        2,
        3,
        Recompute::Selective,
        false,
    );
    assert_eq!(exact_stages_peaking_at(&routed_only, &beside_cp, 1024, &point), 2);
    let beside_cp_and_ep = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,cp=2,ep=2",
        ScheduleKind::GPipe,
        2,
        2,
        Recompute::None,
        false,
    );
    assert_eq!(exact_stages_peaking_at(&shared, &beside_cp_and_ep, 256, &point), 4);
    // Interleaved, the micro-batch's earlier chunk on the last stage holds its layers' statistics
    // in flight, which the point counts among every layer's (counted twice it was 128 bytes above
    // the planner; left out, 216 bytes below).
    let interleaved = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,cp=2",
        ScheduleKind::Interleaved { chunks: 2 },
        2,
        2,
        Recompute::None,
        false,
    );
    assert_eq!(exact_stages_peaking_at(&routed_only, &interleaved, 1024, &point), 2);
}

#[test]
fn under_zero_bubble_tsp_b_holds_the_attention_norm_gathered_again() {
    // Under zero bubble with ZeRO-3 and full recomputation B recomputes a layer's forward,
    // gathering its attention norm's weight again, live to the norm's backward: the stages between
    // the first and the last of pp=4 beside dp=2 × tsp=2 peak in B's first layer's attention
    // backward beside it (512 bytes below before it was counted).
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=4,dp=2,tsp=2",
        ScheduleKind::ZeroBubbleH1,
        4,
        3,
        Recompute::Full,
        false,
    );
    let point = ["first layer's attention backward in B: v's part of the input gradient summed"];
    assert_eq!(exact_stages_peaking_at(&four_layers(), &layout, 256, &point), 8);
}

#[test]
fn under_tsp_the_first_stages_attention_backward_holds_the_token_ids_in_zigzag_order() {
    // Under tsp the first stage keeps the token ids in zigzag order to the embedding's backward,
    // which reads them: in its first layer's attention backward too, at the last owner's kernel
    // backward, where the first stage peaks under full recomputation (1024 bytes below the planner
    // before; 0.09% at tsp=4 beside dp), as does the last on two ranks.
    let four = four_layers();
    let point = ["first layer's attention kernel backward: the last owner's v gradient"];
    for (mesh, zero_stage, seq, peaking) in [("pp=2,tsp=2", 0, 256, 4), ("pp=2,dp=2,tsp=4", 2, 256, 8)] {
        let layout = PipelinedLayout::one_sequence_a_micro_batch(
            mesh,
            ScheduleKind::OneFOneB,
            2,
            zero_stage,
            Recompute::Full,
            false,
        );
        assert_eq!(exact_stages_peaking_at(&four, &layout, seq, &point), peaking, "{mesh}");
    }
    // So too as o's gradient is reduced to its owner, where two of the first stage's ranks peak
    // beside dp under ZeRO-2 with selective recomputation (256 bytes below before).
    let layout = PipelinedLayout::one_sequence_a_micro_batch(
        "pp=2,dp=2,tsp=2",
        ScheduleKind::OneFOneB,
        2,
        2,
        Recompute::Selective,
        false,
    );
    let point = ["first layer's o gradient reduced to this rank, its owner"];
    assert_eq!(exact_stages_peaking_at(&four, &layout, 64, &point), 2);
}

#[test]
fn zero_stage_form_where_dense_rows_do_not_divide_is_never_above_the_planner() {
    // Where the rows of o, a norm, the MLP or a shared expert do not divide over ZeRO's replicas
    // (130 wide at dp=4; 258 channels at dp=4, or 129 a rank beside tp or tsp at dp=2), ZeRO-2
    // and 3 all-reduce their gradients and sum them whole, and ZeRO-3 keeps their weights whole,
    // never gathered. The form counts the gradients in the running sums and in what a micro-batch
    // has made, but not the point's own layer's nor the final norm's (a layer's MLP and o made
    // before the point are missed, but for down's and up's at the points past them), and gathers
    // only the weights whose rows divide: never above the planner, within 8% below it (14% beside
    // tsp, whose ring makes the MLP's gradients, under zero bubble). Here at most 7.4% below
    // (13.1% beside tsp), on 5,760 ranks' peaks; over 1,200 more random layouts of these kinds
    // under ZeRO-2 and 3 (widths 96 to 136, 130 to 260 channels, mixtures, tied tables, each
    // schedule and recomputation, 16 to 128 tokens) none was above.
    let four = four_layers();
    let odd_width = |config: &pleat_ir::model::config::ModelConfig| pleat_ir::model::config::ModelConfig {
        hidden_size: 130,
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 32,
        ..config.clone()
    };
    let wide_ffn = pleat_ir::model::config::ModelConfig { intermediate_size: 258, ..four.clone() };
    let narrow = pleat_ir::model::config::ModelConfig { hidden_size: 96, head_dim: 16, ..wide_ffn.clone() };
    let odd_hidden = odd_width(&four);
    let odd_both = pleat_ir::model::config::ModelConfig {
        intermediate_size: 130,
        num_heads: 8,
        head_dim: 16,
        ..odd_hidden.clone()
    };
    let [mixture, shared] = four_layer_mixtures();
    let (odd_mixture, odd_shared) = (odd_width(&mixture), odd_width(&shared));
    let schedules = [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZeroBubbleH1,
        ScheduleKind::Interleaved { chunks: 2 },
        ScheduleKind::GPipe,
    ];
    let mut kept_whole_at_peak = 0;
    for (config, mesh, sp) in [
        (&wide_ffn, "pp=2,dp=4", false),
        (&odd_hidden, "pp=2,dp=4", false),
        (&odd_both, "pp=2,dp=4", false),
        (&wide_ffn, "pp=2,dp=2,tp=2", false),
        (&wide_ffn, "pp=2,dp=2,tp=2", true),
        (&odd_hidden, "pp=2,dp=2,cp=2", false),
        (&wide_ffn, "pp=2,dp=2,tsp=2", false),
        (&narrow, "pp=2,dp=2,tsp=2", false),
        (&odd_mixture, "pp=2,dp=4", false),
        (&odd_shared, "pp=2,dp=2,ep=2", false),
    ] {
        // The layout keeps a dense parameter past the attention whole (or over fewer replicas).
        let model = ModelShape::from_config(config);
        let layout = Layout::from_mesh(&Mesh::parse(mesh).unwrap(), sp);
        let zero_rows = pleat_passes::cost::zero_rows::ZeroRows::new(&model, &layout);
        assert!(zero_rows.beyond_dense_past_attention() > 0.0, "{mesh}");
        let below = if mesh.contains("tsp") { 0.14 } else { 0.08 };
        for (kind, zero_stage) in schedules.into_iter().flat_map(|kind| [(kind, 2), (kind, 3)]) {
            for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                for (seq, micro_batches) in [(32, 4), (64, 2), (128, 4)] {
                    let layout = PipelinedLayout::one_sequence_a_micro_batch(
                        mesh,
                        kind,
                        micro_batches,
                        zero_stage,
                        recompute,
                        sp,
                    );
                    for stage in stage_closed_forms(config, &layout, seq) {
                        let (planned, form) = (stage.planned.peak_bytes as f64, stage.phase.bytes());
                        // ZeRO-3's parameters: the closed form's shards and those kept whole.
                        let params = stage.phase.params + stage.bytes_of(PARAMS_KEPT_WHOLE);
                        assert!((stage.planned.param_bytes as f64 - params).abs() < 1e-6, "{}", stage.label);
                        assert!(form <= planned, "{}: {form} above {planned}", stage.label);
                        assert!(form >= (1.0 - below) * planned, "{}: {form} below {planned}", stage.label);
                        kept_whole_at_peak += usize::from(stage.bytes_of(GRADS_KEPT_WHOLE) > 0.0);
                    }
                }
            }
        }
    }
    assert!(kept_whole_at_peak > 0);
}
