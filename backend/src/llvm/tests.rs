//! Tests of code generation that need no runtime: the verifier, the emitted artifacts' symbols.

use inkwell::context::Context;

use super::*;
use crate::native::tests::residual_program;
use crate::native::{native_kernels, schedule_for_fusion};
use crate::program::{Buffer, BufferKind, Instr, Kernel};
use pleat_ir::entity::EntityRef;
use pleat_ir::DType;

/// The residual program, scheduled for fusion, with a RoPE of `[1, 2, 2, 4]` at positions `[2]`.
fn program_with_rope() -> Program {
    let mut program = residual_program();
    schedule_for_fusion(&mut program);
    let first = program.buffers.len();
    program.buffers.push(Buffer {
        name: "x".into(),
        dtype: DType::F32,
        shape: vec![1, 2, 2, 4],
        kind: BufferKind::Param,
    });
    program.buffers.push(Buffer {
        name: "positions".into(),
        dtype: DType::I32,
        shape: vec![2],
        kind: BufferKind::Input,
    });
    program.buffers.push(Buffer {
        name: "rotated".into(),
        dtype: DType::F32,
        shape: vec![1, 2, 2, 4],
        kind: BufferKind::Activation,
    });
    let id = |offset: usize| crate::BufferId::new(first + offset);
    program.instructions.push(Instr::LoadPositions { out: id(1), region: vec![(0, 2)] });
    program.instructions.push(Instr::Kernel {
        kernel: Kernel::Rope { batch: 1, seq: 2, heads: 2, head_dim: 4, inv_freq: vec![1.0, 0.01] },
        inputs: vec![id(0), id(1)],
        out: id(2),
    });
    program
}

#[test]
fn a_function_without_terminator_fails_verification() {
    let context = Context::create();
    let module = context.create_module("broken");
    let function = module.add_function("pleat_broken", context.void_type().fn_type(&[], false), None);
    // A block with no terminator: invalid IR the verifier must reject.
    context.append_basic_block(function, "entry");
    let error = verify(&module).unwrap_err();
    let LlvmError::Verify { module: name, message } = &error else { panic!("expected a verifier error, got {error}") };
    assert_eq!(name, "broken");
    assert!(message.contains("terminator"), "{message}");
    assert!(error.to_string().starts_with("llvm's verifier rejected module broken: "));
}

#[test]
fn host_ir_defines_every_kernel_and_the_fingerprint() {
    let program = program_with_rope();
    let kernels = native_kernels(&program);
    assert_eq!(kernels.len(), 4, "{kernels:?}");
    let text = host_ir(&program, &CodegenOptions { target_cpu: Some("x86-64".into()), ..Default::default() }).unwrap();
    for kernel in &kernels {
        assert!(text.contains(&format!("@{}(", kernel.symbol())), "{} missing from\n{text}", kernel.symbol());
    }
    let fingerprint = crate::native::program_fingerprint(&program) as i64;
    assert!(text.contains(&format!("ret i64 {fingerprint}")), "{text}");
}

#[test]
fn ptx_declares_an_entry_per_kernel_for_each_arch() {
    let program = program_with_rope();
    for (arch, _) in PTX_ARCHES {
        let text = ptx(&program, arch).unwrap();
        assert!(text.contains(&format!(".target {arch}")), "{text}");
        let entries: Vec<&str> = text.lines().filter_map(|line| line.trim().strip_prefix(".visible .entry ")).collect();
        let mut names: Vec<String> =
            entries.iter().map(|entry| entry.split('(').next().unwrap_or("").to_string()).collect();
        names.sort();
        let mut want: Vec<String> = native_kernels(&program).iter().map(|kernel| kernel.symbol()).collect();
        want.sort();
        assert_eq!(names, want, "{text}");
        // Each kernel reads its index from the thread registers.
        assert!(text.contains("%tid.x") && text.contains("%ctaid.x"), "{text}");
    }
}

#[test]
fn device_code_gives_each_kernel_a_thread_a_row_or_element() {
    let program = program_with_rope();
    let code = device_code(&program, "sm_90").unwrap();
    assert_eq!(code.fingerprint, crate::native::program_fingerprint(&program));
    assert_eq!(code.ptx, ptx(&program, "sm_90").unwrap());
    let threads: Vec<(String, u64)> =
        code.kernels.iter().map(|kernel| (kernel.kernel.symbol(), kernel.threads)).collect();
    // The fused add + norm and the bias add a row of 8 (2 rows), the SiLU-mul an element (2 x 8),
    // the RoPE a (batch, position, head) row (1 x 2 x 2).
    let expected = [("pleat_fused_3", 2), ("pleat_kernel_6", 2), ("pleat_kernel_7", 16), ("pleat_kernel_9", 4)];
    assert_eq!(threads, expected.map(|(symbol, threads)| (symbol.to_string(), threads)));
}

#[test]
fn every_artifact_is_written() {
    let program = program_with_rope();
    let dir = std::env::temp_dir().join(format!("pleat-llvm-artifacts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let options = CodegenOptions::default();
    for (artifact, names) in [
        (Artifact::LlvmIr, vec!["rank0.ll"]),
        (Artifact::Asm, vec!["rank0.s"]),
        (Artifact::Object, vec!["rank0.o"]),
        (Artifact::SharedLibrary, vec!["rank0.so"]),
        (Artifact::Ptx, vec!["rank0.sm_80.ptx", "rank0.sm_80.cuda.json", "rank0.sm_90.ptx", "rank0.sm_90.cuda.json"]),
    ] {
        let written = emit(&program, artifact, &options, &dir).unwrap();
        let written: Vec<String> =
            written.iter().map(|path| path.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(written, names);
        for name in names {
            assert!(std::fs::metadata(dir.join(name)).unwrap().len() > 0, "{name} is empty");
        }
    }
    let assembly = std::fs::read_to_string(dir.join("rank0.s")).unwrap();
    assert!(assembly.contains("pleat_fused_3:"), "{assembly}");
    // Only the artifacts: the temporary object is gone.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 8);
    // What the CUDA runtime loads is the PTX written beside it, with the thread counts.
    let code: crate::native::DeviceCode =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rank0.sm_90.cuda.json")).unwrap()).unwrap();
    assert_eq!(code.ptx, std::fs::read_to_string(dir.join("rank0.sm_90.ptx")).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_non_kernel_instruction_is_refused() {
    let program = program_with_rope();
    let error = kernel_ir(&program, &crate::native::NativeKernel::Single { instr: 0 }).unwrap_err();
    assert_eq!(error, LlvmError::NotAKernel { instr: 0 });
}
