//! Native kernels through LLVM (feature `llvm`) against the interpreter: every generated kernel of
//! the tiny model's rank programs on random inputs, whole runs with and without the libraries, the
//! CLI's `--emit so` then `run DIR --check`, and a snapshot of one fused kernel's IR. Without the
//! feature, `--emit` must say that it is off.

#[path = "support/cli.rs"]
mod cli;
mod common;

#[cfg(feature = "llvm")]
use cli::stdout_of;
use cli::{error_of, tempdir};

#[cfg(feature = "llvm")]
mod with_llvm {
    use std::time::{Duration, Instant};

    use pleat_backend::llvm::{emit, kernel_ir, Artifact, CodegenOptions};
    use pleat_backend::native::{native_kernels, schedule_for_fusion, NativeKernel};
    use pleat_backend::{Buffer, BufferId, BufferKind, Instr, Kernel, Program, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::model::preset::preset;
    use pleat_ir::DType;
    use pleat_runtime::kernels;
    use pleat_runtime::weights::SeededWeights;
    use pleat_runtime::{assemble, run_on_threads_native, NativeKernels, NativeOperand, RunInputs, ThreadRunOptions};

    use super::common;
    use super::tempdir;

    /// Pseudo-random values in [-scale, scale) (a 64-bit LCG).
    fn random(count: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// The tiny model's rank programs for `mesh`, scheduled for fusion, and each rank's library.
    fn compiled(mesh: &str, label: &str) -> (Vec<Program>, Vec<Option<NativeKernels>>) {
        let config = preset("tiny").expect("tiny");
        let (_, mut programs) = common::compile(&config, 2, 16, mesh);
        let dir = tempdir(label);
        let libraries = programs
            .iter_mut()
            .map(|program| {
                schedule_for_fusion(program);
                let paths = emit(program, Artifact::SharedLibrary, &CodegenOptions::default(), &dir).expect("emit");
                Some(NativeKernels::open(&paths[0], program).expect("open"))
            })
            .collect();
        (programs, libraries)
    }

    /// The interpreted result of `kernel` (the executor's dispatch) on `operands`.
    fn interpreted(kernel: &Kernel, operands: &[Vec<f32>], positions: &[u32], out_len: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; out_len];
        match kernel {
            Kernel::Add if operands[0].len() == operands[1].len() => kernels::add(&operands[0], &operands[1], &mut out),
            Kernel::Add => {
                out.copy_from_slice(&operands[0]);
                for row in out.chunks_mut(operands[1].len()) {
                    kernels::add_in_place(row, &operands[1]);
                }
            }
            Kernel::SiluMul => kernels::silu_mul(&operands[0], &operands[1], &mut out),
            Kernel::RmsNorm { hidden, eps } => {
                kernels::rms_norm(&operands[0], &operands[1], &mut out, *hidden as usize, *eps as f32)
            }
            Kernel::Rope { batch, seq, heads, head_dim, inv_freq } => {
                out.copy_from_slice(&operands[0]);
                let dims = [*batch, *seq, *heads, *head_dim].map(|size| size as usize);
                kernels::rope_in_place(&mut out, dims[0], dims[1], dims[2], dims[3], positions, inv_freq);
            }
            other => panic!("{other:?} has no native code"),
        }
        out
    }

    #[track_caller]
    fn assert_bitwise(label: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{label}: lengths differ");
        for (index, (got_value, want_value)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                got_value.to_bits(),
                want_value.to_bits(),
                "{label}: element {index}: {got_value} vs {want_value}"
            );
        }
    }

    /// Calls every native kernel of every rank on random inputs and compares with the interpreter.
    fn check_every_kernel(mesh: &str, label: &str) {
        let (programs, libraries) = compiled(mesh, label);
        let mut seen = (0, 0);
        for (program, library) in programs.iter().zip(&libraries) {
            let library = library.as_ref().expect("a library");
            let kernel_at = |instr: usize| match &program.instructions[instr] {
                Instr::Kernel { kernel, inputs, out } => (kernel.clone(), inputs.clone(), *out),
                other => panic!("{other:?} is not a kernel"),
            };
            for (seed, native) in native_kernels(program).into_iter().enumerate() {
                let instr = native.first_instr();
                let (kernel, inputs, out) = kernel_at(instr);
                let mut operand_ids = inputs.clone();
                if let NativeKernel::FusedAddRmsNorm { norm_instr, .. } = native {
                    operand_ids.push(kernel_at(norm_instr).1[1]);
                }
                // Residual streams and activations of a few units; positions up to 4096.
                let floats: Vec<Vec<f32>> = operand_ids
                    .iter()
                    .enumerate()
                    .map(|(index, &id)| random(program.buffer(id).numel() as usize, (seed * 8 + index) as u64, 6.0))
                    .collect();
                let positions: Vec<u32> =
                    random(program.buffer(*operand_ids.last().unwrap()).numel() as usize, 99, 1.0)
                        .iter()
                        .map(|value| ((value + 1.0) * 2048.0) as u32)
                        .collect();
                let operands: Vec<NativeOperand> = operand_ids
                    .iter()
                    .zip(&floats)
                    .map(|(&id, data)| {
                        if program.buffer(id).is_integer() {
                            NativeOperand::U32(&positions)
                        } else {
                            NativeOperand::F32(data)
                        }
                    })
                    .collect();
                let produced = library.call(instr, &operands).expect("native call");
                let out_len = program.buffer(out).numel() as usize;
                let want = interpreted(&kernel, &floats, &positions, out_len);
                assert_bitwise(&format!("{mesh} rank {} {}", program.rank, native.symbol()), &produced.out, &want);
                match native {
                    NativeKernel::FusedAddRmsNorm { norm_instr, .. } => {
                        let (norm, _, normed) = kernel_at(norm_instr);
                        let (at, data) = produced.fused.expect("the norm's result");
                        assert_eq!(at, norm_instr);
                        let weight = floats[2].clone();
                        let want = interpreted(&norm, &[want, weight], &[], program.buffer(normed).numel() as usize);
                        assert_bitwise(&format!("{mesh} rank {} fused norm", program.rank), &data, &want);
                        seen.1 += 1;
                    }
                    NativeKernel::Single { .. } => seen.0 += 1,
                }
            }
        }
        assert!(seen.0 > 0 && seen.1 > 0, "{mesh}: {} single and {} fused kernels checked", seen.0, seen.1);
    }

    #[test]
    fn every_native_kernel_equals_the_interpreter_tp2() {
        check_every_kernel("tp=2", "native-kernels-tp2");
    }

    #[test]
    fn every_native_kernel_equals_the_interpreter_tsp2() {
        check_every_kernel("tsp=2", "native-kernels-tsp2");
    }

    #[test]
    fn whole_runs_match_with_and_without_native_kernels() {
        let config = preset("tiny").expect("tiny");
        for mesh in ["tp=2", "tsp=2"] {
            let (programs, libraries) = compiled(mesh, &format!("native-runs-{}", mesh.replace('=', "")));
            let tokens = common::tokens(2, 16, config.vocab_size);
            let weights = SeededWeights::new(7);
            let positions: Vec<u32> = (0..16).collect();
            let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: Instant::now() };
            let options = ThreadRunOptions { timeout: Duration::from_secs(60), link: None };
            let native = run_on_threads_native(&programs, &inputs, &options, &libraries).expect("native run");
            let interpreted = run_on_threads_native(&programs, &inputs, &options, &[]).expect("interpreted run");
            let (_, native_logits) = assemble(&native, 0).expect("logits");
            let (_, interpreted_logits) = assemble(&interpreted, 0).expect("logits");
            assert_bitwise(mesh, &native_logits, &interpreted_logits);
            let reference = common::reference(&config, 2, 16, &tokens, &weights);
            common::assert_close(mesh, &native_logits, &reference);
        }
    }

    /// `sum = a + b; normed = rms_norm(sum, w)` over `[4, 8]`.
    fn add_norm_program() -> Program {
        let buffer = |name: &str, shape: &[u64], kind| Buffer {
            name: name.into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            kind,
        };
        let load = |out: usize, name: &str, shape: Vec<u64>| Instr::LoadParam {
            out: BufferId::new(out),
            name: name.into(),
            region: shape.iter().map(|&size| (0, size)).collect(),
            shape,
        };
        Program {
            format_version: FORMAT_VERSION,
            model: "add-norm".into(),
            mesh: String::new(),
            rank: 0,
            world_size: 1,
            tokens_shape: vec![],
            buffers: vec![
                buffer("a", &[4, 8], BufferKind::Param),
                buffer("b", &[4, 8], BufferKind::Param),
                buffer("w", &[8], BufferKind::Param),
                buffer("sum", &[4, 8], BufferKind::Activation),
                buffer("normed", &[4, 8], BufferKind::Activation),
            ],
            instructions: vec![
                load(0, "a", vec![4, 8]),
                load(1, "b", vec![4, 8]),
                load(2, "w", vec![8]),
                Instr::Kernel {
                    kernel: Kernel::Add,
                    inputs: vec![BufferId::new(0), BufferId::new(1)],
                    out: BufferId::new(3),
                },
                Instr::Kernel {
                    kernel: Kernel::RmsNorm { hidden: 8, eps: 1e-5 },
                    inputs: vec![BufferId::new(3), BufferId::new(2)],
                    out: BufferId::new(4),
                },
            ],
        }
    }

    #[test]
    fn fused_add_rms_norm_ir() {
        let program = add_norm_program();
        let kernels = native_kernels(&program);
        assert_eq!(kernels, vec![NativeKernel::FusedAddRmsNorm { add_instr: 3, norm_instr: 4 }]);
        insta::assert_snapshot!(kernel_ir(&program, &kernels[0]).expect("ir"));
    }
}

#[cfg(feature = "llvm")]
#[test]
fn compiled_native_kernels_pass_the_check() {
    for mesh in ["tp=2", "tsp=2"] {
        let dir = tempdir(&format!("native-cli-{}", mesh.replace('=', "")));
        let out = dir.join("d");
        let out_str = out.to_str().expect("utf-8 path");
        let compiled = stdout_of(&["compile", "tiny", "--mesh", mesh, "--emit", "so", "--out", out_str]);
        assert!(compiled.contains("native kernels: rank0.so, rank1.so"), "{compiled}");
        let ran = stdout_of(&["run", out_str, "--check"]);
        assert!(ran.contains("native kernels (rank<i>.so) a rank: "), "{ran}");
        assert!(ran.contains(": ok"), "{ran}");
        // A library is refused for another rank's program.
        std::fs::copy(out.join("rank0.so"), out.join("rank1.so")).expect("copy");
        let error = error_of(&["run", out_str, "--check"]);
        assert!(error.contains("was generated for another program"), "{error}");
    }
}

#[cfg(feature = "llvm")]
#[test]
fn every_emit_kind_writes_its_files() {
    let dir = tempdir("native-emit-kinds");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    let args = ["compile", "tiny", "--mesh", "tp=2", "--out", out_str, "--target-cpu", "x86-64-v2"];
    let emits = ["--emit", "llvm-ir", "--emit", "asm", "--emit", "obj", "--emit", "ptx"];
    stdout_of(&[&args[..], &emits[..]].concat());
    for rank in 0..2 {
        for extension in ["ll", "s", "o", "sm_80.ptx", "sm_90.ptx"] {
            let path = out.join(format!("rank{rank}.{extension}"));
            assert!(
                std::fs::metadata(&path).map(|meta| meta.len() > 0).unwrap_or(false),
                "{} is missing",
                path.display()
            );
        }
    }
    let ptx = std::fs::read_to_string(out.join("rank0.sm_90.ptx")).expect("ptx");
    assert!(ptx.contains(".visible .entry pleat_fused_"), "{ptx}");
    // Without a library, `run` interprets and says nothing of native kernels.
    let ran = stdout_of(&["run", out_str, "--check"]);
    assert!(!ran.contains("native kernels"), "{ran}");
}

#[cfg(not(feature = "llvm"))]
#[test]
fn emit_says_the_llvm_feature_is_off() {
    let dir = tempdir("native-off");
    let out = dir.join("d");
    let error =
        error_of(&["compile", "tiny", "--mesh", "tp=2", "--emit", "so", "--out", out.to_str().expect("utf-8 path")]);
    assert!(error.contains("built without the `llvm` feature"), "{error}");
    assert!(!out.exists(), "nothing is written when --emit is refused");
}
