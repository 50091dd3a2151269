//! Property tests of lowering: random small models on random meshes and strategies that shard
//! successfully lower to one program a rank, the static collective-matching check passes for all
//! ranks together, and every program reads back equal from its serialised form. Training graphs
//! (any ZeRO stage, any recomputation) either lower with the same guarantees or are refused with
//! an error; neither ever panics.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pleat_ir::model::config::{Architecture, ConfigDtype, ModelConfig, RopeConfig, RopeScaling};
use pleat_ir::{AxisName, Mesh, Module};
use pleat_passes::autodiff::Recompute;
use pleat_passes::{run_pipeline, PassCtx, SHARD_PIPELINE, TRAIN_PIPELINE};
use proptest::prelude::*;

use crate::{from_json, lower, to_json, verify_collectives, Program};

/// A model whose every split dim is a multiple of `ranks` (the sequence of `2 · ranks`, for
/// context parallelism's zigzag halves), so that it shards on any mesh of that many ranks, with
/// its batch and sequence length.
fn dividing_model(ranks: u64) -> impl Strategy<Value = (ModelConfig, u64, u64)> {
    (
        (1u64..=2, 1u64..=2, 1u64..=2, 1u64..=2, 1u64..=2, 1u64..=2),
        (1u64..=2, 1u64..=2, 1u64..=2, any::<bool>(), any::<bool>()),
    )
        .prop_map(
            move |((vocab, hidden, layers, kv_heads, group, half_head_dim), (ffn, batch, seq, qwen2, tie))| {
                let config = ModelConfig {
                    architecture: if qwen2 { Architecture::Qwen2 } else { Architecture::Llama },
                    vocab_size: vocab * ranks,
                    hidden_size: hidden * ranks,
                    num_layers: layers,
                    num_heads: kv_heads * ranks * group,
                    num_kv_heads: kv_heads * ranks,
                    head_dim: 2 * half_head_dim,
                    intermediate_size: ffn * ranks,
                    rms_norm_eps: 1e-5,
                    rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None },
                    tie_word_embeddings: tie,
                    dtype: ConfigDtype::F32,
                    attention_bias: qwen2,
                    max_position_embeddings: 4096,
                    sliding_window: None,
                    moe: None,
                    name: "random".to_owned(),
                };
                (config, batch * ranks, seq * 2 * ranks)
            },
        )
}

const AXES: [AxisName; 4] = [AxisName::Tp, AxisName::Dp, AxisName::Cp, AxisName::Tsp];

/// One axis of degree 1 to 8 or two distinct axes of degree 1 to 4, never `tsp` beside `cp` or
/// `tp` (pairs the shard pipeline refuses), and whether `tp` runs with sequence parallelism
/// (`--strategy tp-sp`).
fn meshes() -> impl Strategy<Value = (Mesh, bool)> {
    let one = (0..AXES.len(), 1u64..=8).prop_map(|(axis, degree)| vec![(AXES[axis], degree)]);
    let two = (0..AXES.len(), 1..AXES.len(), 1u64..=4, 1u64..=4)
        .prop_map(|(first, offset, first_degree, second_degree)| {
            vec![(AXES[first], first_degree), (AXES[(first + offset) % AXES.len()], second_degree)]
        })
        .prop_filter("tsp shares a mesh with neither cp nor tp", |axes| {
            let has = |name: AxisName| axes.iter().any(|(axis, _)| *axis == name);
            !(has(AxisName::Tsp) && (has(AxisName::Cp) || has(AxisName::Tp)))
        });
    (prop_oneof![one, two], any::<bool>()).prop_map(|(axes, sequence_parallel)| {
        let mesh = Mesh::new(&axes).expect("distinct axes of positive degree");
        let sequence_parallel = sequence_parallel && mesh.axis(AxisName::Tp).is_some();
        (mesh, sequence_parallel)
    })
}

/// A mesh, a model that divides by its ranks, its batch and sequence length, and sequence
/// parallelism on or off.
fn planned_models() -> impl Strategy<Value = (Mesh, bool, ModelConfig, u64, u64)> {
    meshes().prop_flat_map(|(mesh, sequence_parallel)| {
        let ranks = mesh.world_size();
        (Just(mesh), Just(sequence_parallel), dividing_model(ranks))
            .prop_map(|(mesh, sequence_parallel, (config, batch, seq))| (mesh, sequence_parallel, config, batch, seq))
    })
}

/// Runs `work`, turning a panic into `Err` with its message.
fn no_panic<T>(work: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    catch_unwind(AssertUnwindSafe(work)).map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
            .unwrap_or_default();
        TestCaseError::fail(format!("panicked: {message}"))
    })
}

/// The lowering guarantees on `programs`: one a rank, in rank order; the collectives match across
/// all of them; each reads back equal from its JSON.
fn check_programs(module: &Module, programs: &[Program]) -> Result<(), TestCaseError> {
    prop_assert_eq!(programs.len() as u64, module.mesh.world_size());
    for (rank, program) in programs.iter().enumerate() {
        prop_assert_eq!(program.rank as usize, rank);
    }
    let matched = no_panic(|| verify_collectives(programs))?;
    prop_assert!(
        matched.is_ok(),
        "the collectives do not match: {}",
        matched.err().map(|error| error.to_string()).unwrap_or_default()
    );
    for program in programs {
        let read = no_panic(|| from_json(&to_json(program)))?
            .map_err(|error| TestCaseError::fail(format!("rank {} does not read back: {error}", program.rank)))?;
        prop_assert_eq!(&read, program, "rank {} reads back different", program.rank);
    }
    check_scheduled(programs)
}

/// The overlap scheduler's guarantees on `programs`: every rank's scheduled program holds the same
/// instructions (frees aside) with every transfer a start and a wait, passes the hazard checks,
/// keeps to its memory budget, and the ranks' collectives still match.
fn check_scheduled(programs: &[Program]) -> Result<(), TestCaseError> {
    use crate::memory::ElementSize;
    use crate::overlap::{schedule, OverlapOptions, Prefetch};
    use crate::Instr;
    // Bytes stand in for seconds: a transfer or kernel costs what it writes.
    let seconds = |program: &Program, instr: &Instr| -> f64 {
        instr.outs().iter().map(|&out| program.buffer(out).bytes() as f64).sum::<f64>() * 1e-9
    };
    let options = OverlapOptions {
        seconds: &seconds,
        memory_budget: None,
        sizing: ElementSize::Fixed(4),
        prefetch: Prefetch::Off,
    };
    let mut scheduled = Vec::new();
    for program in programs {
        let (after, report) = no_panic(|| schedule(program, &options))?
            .map_err(|error| TestCaseError::fail(format!("rank {} does not schedule: {error}", program.rank)))?;
        let work = |program: &Program| {
            let mut lines: Vec<String> = program
                .instructions
                .iter()
                .filter(|instr| !matches!(instr, Instr::Free { .. } | Instr::Wait { .. }))
                .map(|instr| format!("{instr:?}"))
                .collect();
            lines.sort();
            lines
        };
        prop_assert_eq!(work(&after), work(program), "rank {} lost or gained an instruction", program.rank);
        let transfers = program.instructions.iter().filter(|instr| instr.is_transfer()).count();
        // Every transfer has a wait, unless no schedule kept to the budget and the program stayed
        // as lowered.
        prop_assert!(report.transfers == transfers || &after == program, "rank {}: {report:?}", program.rank);
        prop_assert!(
            report.peak_after_bytes <= report.budget_bytes,
            "rank {}: peak {} over the budget {}",
            program.rank,
            report.peak_after_bytes,
            report.budget_bytes
        );
        let read = from_json(&to_json(&after))
            .map_err(|error| TestCaseError::fail(format!("scheduled rank {} is refused: {error}", program.rank)))?;
        prop_assert_eq!(&read, &after);
        scheduled.push(after);
    }
    let matched = verify_collectives(&scheduled);
    prop_assert!(
        matched.is_ok(),
        "scheduled collectives do not match: {}",
        matched.err().map(|e| e.to_string()).unwrap_or_default()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Forward graphs, as `pleat compile` builds them: sharding succeeds (the sizes divide), so
    /// lowering must too, with matching collectives and programs that round-trip.
    #[test]
    fn sharded_forward_graphs_lower_to_matching_programs(
        (mesh, sequence_parallel, config, batch, seq) in planned_models()
    ) {
        let mut module = pleat_ir::model::build(&config, batch, seq)
            .map_err(|error| TestCaseError::fail(error.to_string()))?;
        module.mesh = mesh;
        let ctx = PassCtx { sequence_parallel, ..PassCtx::default() };
        no_panic(|| run_pipeline(SHARD_PIPELINE, &mut module, &ctx))?
            .map_err(|error| TestCaseError::fail(format!("sharding failed: {error}")))?;
        let programs = no_panic(|| lower(&module))?
            .map_err(|error| TestCaseError::fail(format!("lowering failed: {error}")))?;
        check_programs(&module, &programs)?;
    }

    /// Training graphs with a random ZeRO stage (over a dp axis) and recomputation: the training
    /// pipeline and lowering either refuse with an error or give matching, round-tripping programs.
    #[test]
    fn training_graphs_lower_to_matching_programs_or_are_refused(
        (mesh, sequence_parallel, config, batch, seq) in planned_models(),
        zero_stage in 0u8..=3,
        recompute in prop::sample::select(vec![Recompute::None, Recompute::Selective, Recompute::Full]),
    ) {
        let zero_stage = if mesh.degree(AxisName::Dp) > 1 { zero_stage } else { 0 };
        let Ok(mut module) = pleat_ir::model::build_training(&config, batch, seq) else { return Ok(()) };
        module.mesh = mesh;
        let ctx = PassCtx { sequence_parallel, zero_stage, recompute, ..PassCtx::default() };
        let trained = no_panic(|| run_pipeline(TRAIN_PIPELINE, &mut module, &ctx))?;
        if let Err(error) = trained {
            let message = error.to_string();
            prop_assert!(!message.contains("the IR is invalid after pass"), "a pass broke the IR: {}", message);
            return Ok(());
        }
        if let Ok(programs) = no_panic(|| lower(&module))? {
            check_programs(&module, &programs)?;
        }
    }
}
