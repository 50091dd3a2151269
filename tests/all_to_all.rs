//! `all_to_all` in per-rank programs: a tensor split on one dim over the group comes out split on
//! another, every rank sends (D-1)/D of its block, the memory planner predicts the executor's peak to
//! the byte, and programs whose shapes cannot re-split are refused before they run.

use std::time::{Duration, Instant};

use pleat_backend::memory::{plan, ElementSize};
use pleat_backend::validate::validate;
use pleat_backend::{verify_collectives, Buffer, BufferId, BufferKind, Group, Instr, Program, FORMAT_VERSION};
use pleat_ir::entity::EntityRef;
use pleat_ir::DType;
use pleat_runtime::comm::CollectiveKind;
use pleat_runtime::weights::{SeededWeights, WeightSource};
use pleat_runtime::{assemble, run_on_threads, RunInputs};

const ROWS_PER_RANK: u64 = 2;
const COLS_PER_RANK: u64 = 3;

fn buffer(name: &str, shape: &[u64], kind: BufferKind) -> Buffer {
    Buffer { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), kind }
}

/// Rank `rank` of `ranks` loads its rows of weight `w` ([2D, 3D], split on dim 0), re-splits it onto
/// the columns with one all-to-all, and returns its column block.
fn program(rank: u32, ranks: u32) -> Program {
    let b = BufferId::new;
    let d = u64::from(ranks);
    let (rows, cols) = (ROWS_PER_RANK * d, COLS_PER_RANK * d);
    Program {
        format_version: FORMAT_VERSION,
        model: "all-to-all".into(),
        mesh: format!("tp={ranks}"),
        rank,
        world_size: ranks,
        tokens_shape: vec![1, 1],
        buffers: vec![
            buffer("w.rows", &[ROWS_PER_RANK, cols], BufferKind::Param),
            buffer("w.cols", &[rows, COLS_PER_RANK], BufferKind::Activation),
        ],
        instructions: vec![
            Instr::LoadParam {
                out: b(0),
                name: "w".into(),
                shape: vec![rows, cols],
                region: vec![(ROWS_PER_RANK * u64::from(rank), ROWS_PER_RANK), (0, cols)],
            },
            Instr::AllToAll {
                input: b(0),
                out: b(1),
                group: Group { axis: "tp".into(), ranks: (0..ranks).collect() },
                split_dim: 1,
                gather_dim: 0,
            },
            Instr::Output {
                buf: b(1),
                index: 0,
                shape: vec![rows, cols],
                region: vec![(0, rows), (COLS_PER_RANK * u64::from(rank), COLS_PER_RANK)],
            },
            Instr::Free { buf: b(1) },
        ],
    }
}

#[test]
fn all_to_all_moves_rows_to_columns_on_every_degree() {
    for ranks in [1u32, 2, 4] {
        let programs: Vec<Program> = (0..ranks).map(|rank| program(rank, ranks)).collect();
        for program in &programs {
            validate(program).unwrap_or_else(|err| panic!("{ranks} ranks: {err}"));
        }
        verify_collectives(&programs).expect("the all-to-alls match");
        let weights = SeededWeights::new(7);
        let inputs = RunInputs { tokens: &[0], positions: &[0], weights: &weights, epoch: Instant::now() };
        let outcomes = run_on_threads(&programs, &inputs, Duration::from_secs(20)).expect("runs");

        let d = u64::from(ranks);
        let shape = [ROWS_PER_RANK * d, COLS_PER_RANK * d];
        let whole = weights.read("w", &shape, &[(0, shape[0]), (0, shape[1])]).expect("reads");
        let (assembled_shape, assembled) = assemble(&outcomes, 0).expect("output 0");
        assert_eq!(assembled_shape, shape);
        assert_eq!(assembled, whole, "{ranks} ranks: the column blocks put together are the weight");

        let block_bytes = 4 * ROWS_PER_RANK * COLS_PER_RANK * d;
        for (outcome, program) in outcomes.iter().zip(&programs) {
            // D blocks of the input: all but the rank's own leave it.
            assert_eq!(outcome.comm.bytes(CollectiveKind::AllToAll), block_bytes * (d - 1) / d);
            assert_eq!(outcome.comm.total(), outcome.comm.bytes(CollectiveKind::AllToAll));
            assert_eq!(plan(program, ElementSize::Fixed(4)).peak_bytes, outcome.peak_bytes, "{ranks} ranks");
        }
    }
}

#[test]
fn all_to_all_with_shapes_that_cannot_re_split_is_refused() {
    let mut damaged = program(0, 2);
    damaged.buffers[1].shape = vec![4, 6];
    let message = validate(&damaged).expect_err("the result keeps the whole columns").to_string();
    assert!(message.contains("instruction 1") && message.contains("[4, 3] is needed"), "{message}");

    let mut damaged = program(0, 2);
    if let Instr::AllToAll { split_dim, .. } = &mut damaged.instructions[1] {
        *split_dim = 2;
    }
    let message = validate(&damaged).expect_err("dim 2 does not exist").to_string();
    assert!(message.contains("dim 2 is outside the input's shape [2, 6]"), "{message}");
}

/// The IR's `all_to_all` lowers to the instruction: a weight split on seq is re-split on hidden, and
/// gathered back it equals the weight, on 2 and 4 ranks.
#[test]
fn the_ir_all_to_all_lowers_and_runs() {
    for ranks in [2u32, 4] {
        let text = format!(
            "; module m mesh=tp={ranks}\n\
             v0: f32[seq=8/tp, hidden=12] = param() name=\"w\"   # n0 w\n\
             v1: f32[seq=8, hidden=12/tp] = all_to_all(v0) axis=tp split_dim=hidden gather_dim=seq   # n1 w.all_to_all\n\
             v2: f32[seq=8, hidden=12] = all_gather(v1) axis=tp dim=hidden   # n2 w.all_gather\n\
             outputs(v2)\n"
        );
        let module = pleat_ir::text::parse_module(&text).expect("parses");
        pleat_passes::verify(&module).unwrap_or_else(|errors| panic!("{errors}"));
        let programs = pleat_backend::lower(&module).expect("lowers");
        assert!(programs[0].instructions.iter().any(|instr| matches!(instr, Instr::AllToAll { .. })));
        verify_collectives(&programs).expect("the all-to-alls match");
        let weights = SeededWeights::new(3);
        // The module reads no tokens: an empty batch.
        let inputs = RunInputs { tokens: &[], positions: &[], weights: &weights, epoch: Instant::now() };
        let outcomes = run_on_threads(&programs, &inputs, Duration::from_secs(20)).expect("runs");
        let (_, assembled) = assemble(&outcomes, 0).expect("output 0");
        assert_eq!(assembled, weights.read("w", &[8, 12], &[(0, 8), (0, 12)]).expect("reads"), "{ranks} ranks");
    }
}
