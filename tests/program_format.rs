//! The serialized `Program`: it round-trips, refuses other versions, and refuses a damaged file with
//! an error rather than letting a kernel read out of bounds.

mod common;

use pleat_backend::{from_json, to_json, Instr, Kernel, FORMAT_VERSION};
use pleat_ir::model::preset::preset;
use pleat_passes::autodiff::Recompute;
use pleat_passes::PassCtx;

#[test]
fn every_lowered_program_validates_and_round_trips() {
    let config = preset("tiny").expect("tiny");
    for mesh in ["", "tp=4", "dp=2,tp=2", "tsp=2", "dp=2,tsp=2", "cp=2", "dp=2,tp=2,cp=2"] {
        let (_, programs) = common::compile(&config, 2, 16, mesh);
        for program in programs {
            pleat_backend::validate::validate(&program).unwrap_or_else(|err| panic!("{mesh}: {err}"));
            assert_eq!(from_json(&to_json(&program)).expect("reads back"), program, "{mesh}");
        }
    }
}

#[test]
fn every_lowered_training_program_validates() {
    // Training programs free every buffer they write but the gradients and the loss: ZeRO-3's
    // gathered weights too, on every rank, where a TSP owner's broadcast is their last reader.
    let config = preset("tiny").expect("tiny");
    let recomputes = [Recompute::None, Recompute::Selective, Recompute::Full];
    for (mesh, sequence_parallel, zero_stage) in [
        ("tp=2", true, 0),
        ("dp=2,tp=2", false, 3),
        ("cp=2", false, 0),
        ("dp=2,tsp=2", false, 2),
        ("dp=2,tsp=2", false, 3),
        ("dp=4,tsp=2", false, 3),
        ("dp=2,tsp=4", false, 3),
    ] {
        for recompute in recomputes {
            let ctx = PassCtx { sequence_parallel, zero_stage, recompute, ..PassCtx::default() };
            let (_, programs) = common::compile_training(&config, 4, 16, mesh, &ctx);
            for program in programs {
                pleat_backend::validate::validate(&program)
                    .unwrap_or_else(|err| panic!("{mesh} zero {zero_stage} {recompute:?}: {err}"));
            }
        }
    }
}

#[test]
fn a_buffer_left_allocated_is_an_error() {
    let config = preset("tiny").expect("tiny");
    let (_, programs) = common::compile(&config, 2, 16, "tp=2");
    let mut program = programs[0].clone();
    let at = program.instructions.iter().position(|instr| matches!(instr, Instr::Free { .. })).expect("a free");
    let Instr::Free { buf } = program.instructions.remove(at) else { unreachable!() };
    let name = program.buffer(buf).name.clone();
    let message = from_json(&to_json(&program)).expect_err("leaks").to_string();
    assert!(message.contains(&format!("{buf} ({name}) is written here and never freed")), "{message}");
}

#[test]
fn damaged_programs_are_errors() {
    let config = preset("tiny").expect("tiny");
    let (_, programs) = common::compile(&config, 2, 16, "tp=2");
    let mut program = programs[0].clone();
    let at = program
        .instructions
        .iter()
        .position(|instr| matches!(instr, Instr::Kernel { kernel: Kernel::MatMul { .. }, .. }))
        .expect("a matmul");
    if let Instr::Kernel { kernel: Kernel::MatMul { k, .. }, .. } = &mut program.instructions[at] {
        *k += 1;
    }
    let message = from_json(&to_json(&program)).expect_err("damaged").to_string();
    assert!(
        message.starts_with(&format!("the program is inconsistent at instruction {at}: the activation has")),
        "{message}"
    );

    let mut program = programs[0].clone();
    program.format_version += 1;
    let message = from_json(&to_json(&program)).expect_err("future version").to_string();
    assert_eq!(
        message,
        format!("program format version {} is not {FORMAT_VERSION}; recompile with this pleat", program.format_version)
    );
    assert!(from_json(&format!("{{\"format_version\": {FORMAT_VERSION}}}"))
        .expect_err("truncated")
        .to_string()
        .starts_with("cannot read the program"));
}
