//! The serialized `Program`: it round-trips, refuses other versions, and refuses a damaged file with
//! an error rather than letting a kernel read out of bounds.

mod common;

use pleat_backend::{from_json, to_json, Instr, Kernel, FORMAT_VERSION};
use pleat_ir::model::preset::preset;

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
