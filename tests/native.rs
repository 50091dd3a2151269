//! Native code through LLVM (feature `llvm`) against the interpreter: every generated kernel of
//! the tiny model's rank programs on random inputs, whole runs through each rank's entry function
//! against the bytecode path (bit for bit), a failing peer surfacing as errors, the CLI's
//! `--emit so` then `run DIR --check`, and snapshots of one fused kernel's IR and of an entry
//! function's IR. Without the feature, `--emit` must say that it is off.

#[path = "support/cli.rs"]
mod cli;
mod common;

use cli::{error_of, tempdir};
#[cfg(feature = "llvm")]
use cli::{json_of, stdout_of};

#[cfg(feature = "llvm")]
mod with_llvm {
    use std::time::{Duration, Instant};

    use pleat_backend::llvm::{device_code, emit, entry_ir, kernel_ir, Artifact, CodegenOptions, PTX_ARCHES};
    use pleat_backend::native::abi::{runtime_call, INSTRUCTION_SYMBOLS};
    use pleat_backend::native::{device_kernels, native_kernels, schedule_for_fusion, NativeKernel};
    use pleat_backend::{Buffer, BufferId, BufferKind, Group, Instr, Kernel, Program, TransferStream, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::model::preset::preset;
    use pleat_ir::DType;
    use pleat_runtime::capi::verify_entry;
    use pleat_runtime::comm::{CommError, Communicator, ThreadFabric};
    use pleat_runtime::kernels;
    use pleat_runtime::weights::{SeededWeights, WeightError, WeightSource};
    use pleat_runtime::{
        assemble, execute_native, run_on_threads_native, Error, NativeKernels, NativeOperand, RunInputs,
        ThreadRunOptions,
    };

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
    fn entry_functions_give_the_bytecode_logits_bit_for_bit() {
        let config = preset("tiny").expect("tiny");
        for mesh in ["tp=2", "tsp=2"] {
            let (programs, libraries) = compiled(mesh, &format!("native-runs-{}", mesh.replace('=', "")));
            // Every library has an entry function, so every rank runs through it.
            assert!(libraries.iter().flatten().all(|library| library.entry().is_some()), "{mesh}");
            let tokens = common::tokens(2, 16, config.vocab_size);
            let weights = SeededWeights::new(7);
            let positions: Vec<u32> = (0..16).collect();
            let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: Instant::now() };
            let options = ThreadRunOptions { timeout: Duration::from_secs(60), link: None };
            let native = run_on_threads_native(&programs, &inputs, &options, &libraries).expect("native run");
            let interpreted = run_on_threads_native(&programs, &inputs, &options, &[]).expect("interpreted run");
            for (native_rank, interpreted_rank) in native.iter().zip(&interpreted) {
                // The entry function walked every instruction, and moved the same bytes.
                assert_eq!(native_rank.timings.len(), programs[native_rank.rank as usize].instructions.len());
                assert_eq!(native_rank.comm, interpreted_rank.comm, "{mesh} rank {}", native_rank.rank);
                assert_eq!(native_rank.param_bytes, interpreted_rank.param_bytes);
                // Its buffers lived in the arena the memory planner laid out, of the planned size.
                let plan = pleat_backend::memory::plan(
                    &programs[native_rank.rank as usize],
                    pleat_backend::memory::ElementSize::Declared,
                );
                assert_eq!(native_rank.arena_bytes, plan.arena_bytes.next_multiple_of(8), "{mesh}");
                assert!(native_rank.arena_bytes > 0 && interpreted_rank.arena_bytes == 0, "{mesh}");
            }
            let (_, native_logits) = assemble(&native, 0).expect("logits");
            let (_, interpreted_logits) = assemble(&interpreted, 0).expect("logits");
            assert_bitwise(mesh, &native_logits, &interpreted_logits);
            let reference = common::reference(&config, 2, 16, &tokens, &weights);
            common::assert_close(mesh, &native_logits, &reference);
        }
    }

    /// A scheduled program's entry function starts each transfer on the rank's communication
    /// streams and waits for it at its `pleat_rt_wait`, as the bytecode loop does: over a slow
    /// emulated link, some transfer is in flight while a kernel runs, and the logits are the
    /// bytecode's bit for bit.
    #[test]
    fn scheduled_entry_functions_run_their_transfers_beside_their_kernels() {
        let config = preset("tiny").expect("tiny");
        let (_, programs) = common::compile(&config, 2, 16, "tsp=2");
        // Scheduled, then ordered for fusion, as `pleat compile --emit so` does.
        let mut programs = common::overlapped(&programs);
        for program in &mut programs {
            schedule_for_fusion(program);
        }
        assert!(programs
            .iter()
            .all(|program| program.instructions.iter().any(|instr| matches!(instr, Instr::Wait { .. }))));
        let dir = tempdir("native-scheduled-tsp2");
        let libraries: Vec<Option<NativeKernels>> = programs
            .iter()
            .map(|program| {
                let paths = emit(program, Artifact::SharedLibrary, &CodegenOptions::default(), &dir).expect("emit");
                Some(NativeKernels::open(&paths[0], program).expect("open"))
            })
            .collect();
        let tokens = common::tokens(2, 16, config.vocab_size);
        let weights = SeededWeights::new(5);
        let positions: Vec<u32> = (0..16).collect();
        let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: Instant::now() };
        let link = pleat_runtime::comm::LinkSpec { bytes_per_s: 0.2e9, latency: Duration::from_micros(50) };
        let options = ThreadRunOptions { timeout: Duration::from_secs(60), link: Some(link) };
        let native = run_on_threads_native(&programs, &inputs, &options, &libraries).expect("native run");
        let interpreted = run_on_threads_native(&programs, &inputs, &options, &[]).expect("interpreted run");
        let (_, native_logits) = assemble(&native, 0).expect("logits");
        let (_, interpreted_logits) = assemble(&interpreted, 0).expect("logits");
        assert_bitwise("scheduled tsp=2", &native_logits, &interpreted_logits);
        // A transfer's span (start to end on its stream) meets a kernel's on the same rank.
        let overlaps = native.iter().any(|outcome| {
            let program = &programs[outcome.rank as usize];
            let spans = |keep: fn(&Instr) -> bool| {
                program
                    .instructions
                    .iter()
                    .zip(&outcome.timings)
                    .filter(move |(instr, _)| keep(instr))
                    .map(|(_, &span)| span)
            };
            let kernel = |instr: &Instr| matches!(instr, Instr::Kernel { .. });
            spans(Instr::is_transfer).any(|(start, end)| spans(kernel).any(|(from, to)| from.max(start) < to.min(end)))
        });
        assert!(overlaps, "no transfer of the entry functions ran beside a kernel");
    }

    /// Seeded weights, except that every read of a block not starting at the origin (only rank 1
    /// of a tp=2 program reads one) fails.
    struct FailingOffOrigin(SeededWeights);

    impl WeightSource for FailingOffOrigin {
        fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<Vec<f32>, WeightError> {
            if region.iter().any(|&(start, _)| start > 0) {
                return Err(WeightError::NotResident { name: name.to_string(), region: region.to_vec() });
            }
            self.0.read(name, shape, region)
        }
    }

    #[test]
    fn a_failing_peer_is_an_error_from_the_entry_function_not_a_hang() {
        let config = preset("tiny").expect("tiny");
        let (programs, libraries) = compiled("tp=2", "native-failing-peer");
        let tokens = common::tokens(2, 16, config.vocab_size);
        let weights = FailingOffOrigin(SeededWeights::new(7));
        let positions: Vec<u32> = (0..16).collect();
        let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: Instant::now() };
        let started = Instant::now();
        // Each rank on its own thread, as `pleat run` runs them: the failing rank tells its peer.
        let results: Vec<Result<_, Error>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ThreadFabric::new(2, Duration::from_secs(60))
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    let (program, library, inputs) = (&programs[rank], libraries[rank].as_ref(), &inputs);
                    scope.spawn(move || {
                        let outcome = execute_native(program, &mut comm, inputs, 1, library);
                        if let Err(error) = &outcome {
                            comm.abort(&error.to_string());
                        }
                        outcome
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().expect("no panic crosses the entry function")).collect()
        });
        // Well before the 60 s collective timeout: the abort reached rank 0's collective.
        assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
        match &results[1] {
            Err(Error::Weight { rank: 1, .. }) => {}
            other => panic!("rank 1 should fail reading its weight block, got {other:?}"),
        }
        match &results[0] {
            Err(Error::Comm { rank: 0, source, .. }) if matches!(**source, CommError::PeerFailed { .. }) => {}
            other => panic!("rank 0's collective should report its failed peer, got {other:?}"),
        }
    }

    /// A program of every runtime call the tiny model's inference uses, sized small: loads, a RoPE
    /// (generated), a matmul, an all-reduce over two ranks, a free and an output.
    fn entry_program() -> Program {
        let buffer = |name: &str, dtype: DType, shape: &[u64], kind| Buffer {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            kind,
        };
        let id = BufferId::new;
        Program {
            format_version: FORMAT_VERSION,
            model: "entry".into(),
            mesh: "tp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![1, 2],
            buffers: vec![
                buffer("x", DType::F32, &[1, 2, 1, 4], BufferKind::Param),
                buffer("positions", DType::I32, &[2], BufferKind::Input),
                buffer("rotated", DType::F32, &[1, 2, 1, 4], BufferKind::Activation),
                buffer("w", DType::F32, &[3, 4], BufferKind::Param),
                buffer("partial", DType::F32, &[2, 3], BufferKind::Activation),
                buffer("summed", DType::F32, &[2, 3], BufferKind::Activation),
            ],
            instructions: vec![
                Instr::LoadParam {
                    out: id(0),
                    name: "x".into(),
                    shape: vec![1, 2, 1, 4],
                    region: vec![(0, 1), (0, 2), (0, 1), (0, 4)],
                },
                Instr::LoadPositions { out: id(1), region: vec![(0, 2)] },
                Instr::Kernel {
                    kernel: Kernel::Rope { batch: 1, seq: 2, heads: 1, head_dim: 4, inv_freq: vec![1.0, 0.01] },
                    inputs: vec![id(0), id(1)],
                    out: id(2),
                },
                Instr::LoadParam { out: id(3), name: "w".into(), shape: vec![6, 4], region: vec![(0, 3), (0, 4)] },
                Instr::Kernel { kernel: Kernel::MatMul { m: 2, n: 3, k: 4 }, inputs: vec![id(2), id(3)], out: id(4) },
                Instr::Free { buf: id(2) },
                Instr::AllReduce {
                    inputs: vec![id(4)],
                    outs: vec![id(5)],
                    group: Group { axis: "tp".into(), ranks: vec![0, 1] },
                },
                Instr::Output { buf: id(5), index: 0, shape: vec![2, 6], region: vec![(0, 2), (0, 3)] },
            ],
        }
    }

    /// One instruction of every kind and one kernel of every kind (sizes need only agree where a
    /// generated kernel reads them: nothing else runs), for checking that every `pleat_rt_*` call
    /// carries its instruction whole. The runtime-called add, norm, RoPE and SiLU-mul write bf16.
    fn every_kind_program() -> Program {
        let mut buffers = Vec::new();
        let mut fresh = |dtype: DType, shape: &[u64]| {
            buffers.push(Buffer {
                name: format!("b{}", buffers.len()),
                dtype,
                shape: shape.to_vec(),
                kind: BufferKind::Activation,
            });
            BufferId::new(buffers.len() - 1)
        };
        let float = fresh(DType::F32, &[2, 4]);
        let tokens = fresh(DType::I32, &[1, 2]);
        let positions = fresh(DType::I32, &[2]);
        let group = Group { axis: "tp".into(), ranks: vec![0, 1] };
        let dims = pleat_backend::AttentionDims {
            batch: 1,
            sq: 2,
            sk: 2,
            hq: 2,
            hkv: 1,
            head_dim: 2,
            q_head_offset: 2,
            kv_head_offset: 1,
            group: 2,
            causal: true,
            scale: 0.7,
        };
        let moe = pleat_backend::MoeDims {
            rows: 2,
            hidden: 4,
            experts: 4,
            local_experts: 2,
            expert_offset: 2,
            ffn: 3,
            top_k: 2,
            normalize: true,
        };
        let router = pleat_backend::RouterDims { rows: 2, hidden: 4, experts: 2 };
        let mut instructions = vec![
            Instr::LoadParam { out: float, name: "f".into(), shape: vec![4, 4], region: vec![(2, 2), (0, 4)] },
            Instr::LoadTokens { out: tokens, region: vec![(0, 1), (0, 2)] },
            Instr::LoadPositions { out: positions, region: vec![(0, 2)] },
            Instr::AllReduce { inputs: vec![float], outs: vec![fresh(DType::F32, &[2, 4])], group: group.clone() },
            Instr::ReduceScatter {
                inputs: vec![float],
                outs: vec![fresh(DType::F32, &[2, 2])],
                group: group.clone(),
                dims: vec![1],
            },
            Instr::AllGather {
                input: float,
                out: fresh(DType::F32, &[4, 4]),
                group: group.clone(),
                dim: 0,
                stream: TransferStream::Main,
            },
            Instr::AllToAll {
                input: float,
                out: fresh(DType::F32, &[4, 2]),
                group: group.clone(),
                split_dim: 1,
                gather_dim: 0,
            },
            Instr::Broadcast {
                inputs: vec![float, positions],
                outs: vec![fresh(DType::F32, &[2, 4]), fresh(DType::I32, &[2])],
                group: group.clone(),
                root: 1,
                stream: TransferStream::Main,
            },
            Instr::Send { bufs: vec![float, positions], peer: 1 },
            Instr::Wait { handle: vec![float, positions] },
            Instr::Recv { outs: vec![fresh(DType::F32, &[2, 4]), fresh(DType::I32, &[2])], peer: 1 },
            Instr::Relay { outs: vec![fresh(DType::F32, &[2, 4]), fresh(DType::I32, &[2])], from: 1, to: 1 },
            Instr::Output { buf: float, index: 3, shape: vec![4, 4], region: vec![(2, 2), (0, 4)] },
            Instr::ExpertDispatch {
                inputs: vec![float; 6],
                outs: vec![fresh(DType::F32, &[2, 4]), fresh(DType::F32, &[2, 4])],
                wrts: vec![pleat_ir::MoeOperand::Input, pleat_ir::MoeOperand::Down],
                group: group.clone(),
                dims: moe.clone(),
            },
        ];
        let inv_freq = vec![1.0, 0.5];
        let kernels: Vec<(Kernel, Vec<BufferId>, DType)> = vec![
            (Kernel::Embedding { hidden: 4, vocab_offset: 8, vocab_total: 16 }, vec![float, tokens], DType::F32),
            (Kernel::RmsNorm { hidden: 4, eps: 1e-6 }, vec![float, float], DType::Bf16),
            (Kernel::MatMul { m: 2, n: 2, k: 4 }, vec![float, float], DType::F32),
            (
                Kernel::Rope { batch: 1, seq: 2, heads: 2, head_dim: 2, inv_freq: vec![0.25] },
                vec![float, positions],
                DType::Bf16,
            ),
            (
                Kernel::Attention { dims: dims.clone(), with_lse: true },
                vec![float, float, float, positions, positions],
                DType::F32,
            ),
            (Kernel::MergeAttention { rows: 2, head_dim: 3 }, vec![float, float], DType::F32),
            (Kernel::SiluMul, vec![float, float], DType::Bf16),
            (Kernel::Add, vec![float, float], DType::Bf16),
            (Kernel::Add, vec![float, float], DType::F32),
            (Kernel::Permute { shape: vec![2, 4], dim: 1, order: vec![3, 2, 1, 0] }, vec![float], DType::F32),
            (Kernel::Zeros, vec![], DType::F32),
            (Kernel::Slice { shape: vec![2, 4], region: vec![(0, 2), (1, 3)] }, vec![float], DType::F32),
            (Kernel::CrossEntropy { batch: 1, seq: 2, vocab: 4, terms: 3 }, vec![float, tokens], DType::F32),
            (Kernel::CrossEntropyGrad { batch: 1, seq: 2, vocab: 4, terms: 3 }, vec![float, tokens], DType::F32),
            (
                Kernel::LossRowStats { batch: 1, seq: 2, vocab: 4, vocab_offset: 4, global_vocab: 8 },
                vec![float, tokens],
                DType::F32,
            ),
            (
                Kernel::CrossEntropyFromStats { batch: 1, seq: 2, global_vocab: 8, terms: 3, parts: 2 },
                vec![tokens, float],
                DType::F32,
            ),
            (
                Kernel::CrossEntropyGradFromStats {
                    batch: 1,
                    seq: 2,
                    vocab: 4,
                    vocab_offset: 4,
                    global_vocab: 8,
                    terms: 3,
                    parts: 2,
                },
                vec![float, tokens, float],
                DType::F32,
            ),
            (Kernel::MatMulGradInput { m: 2, n: 4, k: 2 }, vec![float, float], DType::F32),
            (Kernel::MatMulGradWeight { m: 2, n: 4, k: 2 }, vec![float, float], DType::F32),
            (Kernel::RmsNormGradInput { hidden: 4, eps: 1e-5 }, vec![float, float, float], DType::F32),
            (Kernel::RmsNormGradInputAdd { hidden: 4, eps: 1e-5 }, vec![float; 4], DType::F32),
            (Kernel::Sum, vec![float; 3], DType::F32),
            (Kernel::RmsNormGradWeight { hidden: 4, eps: 1e-5 }, vec![float, float], DType::F32),
            (
                Kernel::RopeGrad { batch: 1, seq: 2, heads: 2, head_dim: 2, inv_freq: inv_freq.clone() },
                vec![float, positions],
                DType::F32,
            ),
            (
                Kernel::AttentionGrad { wrt: pleat_backend::AttentionOperand::Key, dims },
                vec![float, float, float, positions, positions, float],
                DType::F32,
            ),
            (Kernel::SiluMulGradGate, vec![float, float, float], DType::F32),
            (Kernel::EmbeddingGrad { hidden: 4, vocab_offset: 8, vocab_total: 16 }, vec![float, tokens], DType::F32),
            (Kernel::SumLeading { width: 4 }, vec![float], DType::F32),
            (Kernel::MoeMlp { dims: moe.clone() }, vec![float; 5], DType::F32),
            (Kernel::MoeMlpGrad { wrt: pleat_ir::MoeOperand::Router, dims: moe.clone() }, vec![float; 6], DType::F32),
            (Kernel::SigmoidScale { hidden: 4 }, vec![float, float], DType::F32),
            (Kernel::SigmoidScaleGradGate { hidden: 4 }, vec![float, float, float], DType::F32),
            (Kernel::ExpertCounts { dims: router.clone(), top_k: 1, scale: 0.25 }, vec![float, float], DType::F32),
            (Kernel::RouterProbSum { dims: router.clone() }, vec![float, float], DType::F32),
            (
                Kernel::RouterProbSumGrad { wrt: pleat_ir::MoeOperand::Input, dims: router },
                vec![float, float, float],
                DType::F32,
            ),
            (Kernel::LoadBalancingLoss { experts: 2 }, vec![float, float], DType::F32),
        ];
        for (kernel, inputs, dtype) in kernels {
            instructions.push(Instr::Kernel { kernel, inputs, out: fresh(dtype, &[2, 4]) });
        }
        instructions.push(Instr::Free { buf: float });
        Program {
            format_version: FORMAT_VERSION,
            model: "every-kind".into(),
            mesh: "tp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![1, 2],
            buffers,
            instructions,
        }
    }

    #[test]
    fn every_runtime_call_rebuilds_its_instruction() {
        let program = every_kind_program();
        // Kernels writing bf16 go through the runtime (which rounds as the bytecode path does).
        let generated: Vec<usize> = native_kernels(&program)
            .iter()
            .map(NativeKernel::first_instr)
            .filter(|&index| {
                program.instructions[index].out().is_some_and(|out| program.buffer(out).dtype == DType::F32)
            })
            .collect();
        // The f32 add is generated code; every other instruction is a runtime call, one of each symbol.
        assert_eq!(generated.len(), 1, "{generated:?}");
        let mut symbols: Vec<&str> = program
            .instructions
            .iter()
            .enumerate()
            .filter(|(index, _)| !generated.contains(index))
            .map(|(_, instr)| runtime_call(instr).symbol)
            .collect();
        symbols.sort_unstable();
        symbols.dedup();
        let mut listed = INSTRUCTION_SYMBOLS.to_vec();
        listed.sort_unstable();
        assert_eq!(symbols, listed);
        let dir = tempdir("native-every-kind");
        let paths = emit(&program, Artifact::SharedLibrary, &CodegenOptions::default(), &dir).expect("emit");
        let library = NativeKernels::open(&paths[0], &program).expect("open");
        assert_eq!(
            verify_entry(&program, &library).expect("every call rebuilds its instruction"),
            program.instructions.len()
        );
        // A program that differs in one constant is refused before the library runs anything.
        let mut changed = program.clone();
        let matmul_at = changed
            .instructions
            .iter()
            .position(|instr| matches!(instr, Instr::Kernel { kernel: Kernel::MatMul { .. }, .. }))
            .expect("a matmul");
        if let Instr::Kernel { kernel: Kernel::MatMul { k, .. }, .. } = &mut changed.instructions[matmul_at] {
            *k = 3;
        }
        match verify_entry(&changed, &library) {
            Err(Error::Program { instr: 0, reason, .. }) => {
                assert!(reason.contains("was generated for another program"), "{reason}");
            }
            other => panic!("a changed constant must be refused, got {other:?}"),
        }
    }

    #[test]
    fn entry_function_ir() {
        let text = entry_ir(&entry_program()).expect("ir");
        // The RoPE is generated code, called directly; everything else calls the runtime.
        assert!(text.contains("call void @pleat_kernel_2("), "{text}");
        assert!(!text.contains("@pleat_rt_rope("), "{text}");
        insta::assert_snapshot!(text);
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

    #[test]
    fn a_training_step_gets_device_code_for_its_backward_kernels() {
        // tiny's training step, fused as `pleat run --train --device cuda` compiles it, in f32 and
        // bf16, on one rank and at tp=2: PTX builds for every architecture, and attention's three
        // gradients and the RoPE, SwiGLU gate and RMSNorm input gradients are among the kernels it
        // launches (the last added to the gathered gradient, as `fuse` leaves it).
        let f32_config = preset("tiny").expect("tiny");
        let bf16_config = pleat_ir::model::config::ModelConfig {
            dtype: pleat_ir::model::config::ConfigDtype::Bf16,
            ..f32_config.clone()
        };
        for (config, mesh) in [(&f32_config, ""), (&f32_config, "tp=2"), (&bf16_config, "")] {
            let mut module = pleat_ir::model::build_training(config, 2, 8).expect("build");
            module.mesh = pleat_ir::Mesh::parse(mesh).expect("mesh");
            let ctx = pleat_passes::PassCtx::default();
            pleat_passes::run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &ctx).expect("differentiates");
            pleat_passes::run_pipeline(&[pleat_passes::fuse::FUSE], &mut module, &ctx).expect("fuses");
            for program in pleat_backend::lower(&module).expect("lower") {
                let kinds: std::collections::BTreeSet<&str> = device_kernels(&program)
                    .iter()
                    .filter_map(|kernel| match &program.instructions[kernel.first_instr()] {
                        Instr::Kernel { kernel: Kernel::RopeGrad { .. }, .. } => Some("rope_grad"),
                        Instr::Kernel { kernel: Kernel::SiluMulGradGate, .. } => Some("silu_mul_grad_gate"),
                        Instr::Kernel { kernel: Kernel::RmsNormGradInputAdd { .. }, .. } => Some("rms_norm_grad_input"),
                        Instr::Kernel { kernel: Kernel::RmsNormGradInput { .. }, .. } => Some("rms_norm_grad_input"),
                        Instr::Kernel { kernel: Kernel::AttentionGrad { wrt, .. }, .. } => Some(match wrt {
                            pleat_backend::AttentionOperand::Query => "attention_grad_q",
                            pleat_backend::AttentionOperand::Key => "attention_grad_k",
                            pleat_backend::AttentionOperand::Value => "attention_grad_v",
                        }),
                        _ => None,
                    })
                    .collect();
                assert_eq!(kinds.len(), 6, "mesh '{mesh}' rank {}: {kinds:?}", program.rank);
                for (arch, _) in PTX_ARCHES {
                    let code = device_code(&program, arch).expect("device code");
                    assert_eq!(code.kernels.len(), device_kernels(&program).len(), "{arch}");
                    assert!(code.ptx.contains(".visible .entry"), "{arch}");
                }
            }
        }
    }
}

#[cfg(feature = "llvm")]
#[test]
fn a_mixture_of_experts_runs_through_the_entry_functions() {
    // The token dispatch and the routed experts are runtime calls of the entry function.
    let dir = tempdir("native-moe");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    stdout_of(&["compile", "tiny-moe", "--mesh", "ep=2", "--emit", "so", "--out", out_str]);
    let ran = stdout_of(&["run", out_str, "--check"]);
    assert!(ran.contains("execution a rank: native-entry, native-entry"), "{ran}");
    assert!(ran.contains(": ok"), "{ran}");
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
        assert!(ran.contains("execution a rank: native-entry, native-entry"), "{ran}");
        assert!(ran.contains(": ok"), "{ran}");
        // `launch` runs the same entry functions and reports as `run` does.
        let launched = stdout_of(&["launch", out_str, "--check"]);
        assert!(launched.contains("execution a rank: native-entry, native-entry"), "{launched}");
        assert!(launched.contains(": ok"), "{launched}");
        // A library is refused for another rank's program: the directory's hash of it first, and
        // the library's own program fingerprint once it is loaded (a directory written by hand).
        std::fs::copy(out.join("rank0.so"), out.join("rank1.so")).expect("copy");
        let error = error_of(&["run", out_str, "--check"]);
        assert!(error.contains("error[E0553]") && error.contains("rank1.so"), "{error}");
        let programs: Vec<pleat_backend::Program> = (0..2)
            .map(|rank| {
                let text = std::fs::read_to_string(out.join(format!("rank{rank}.program"))).expect("a program");
                pleat_backend::from_json(&text).expect("a program")
            })
            .collect();
        let library = std::path::absolute(out.join("rank1.so")).expect("a path");
        let error = pleat_runtime::NativeKernels::open(&library, &programs[1]).expect_err("refused");
        assert!(error.to_string().contains("was generated for another program"), "{error}");
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
    assert!(ran.contains("execution a rank: bytecode, bytecode"), "{ran}");
    // Without libraries there is nothing to launch.
    let error = error_of(&["launch", out_str]);
    assert!(error.contains("E0528") && error.contains("rank 0 has no library rank0.so"), "{error}");
}

/// A CPU LLVM does not know is refused before anything is compiled or written: LLVM itself would
/// fall back to a 32-bit subtarget and abort the process halfway through emitting.
#[cfg(all(feature = "llvm", target_arch = "x86_64"))]
#[test]
fn an_unknown_target_cpu_is_refused_before_anything_is_written() {
    let dir = tempdir("native-bad-cpu");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    for cpu in ["bogus", "i686"] {
        let error =
            error_of(&["compile", "tiny", "--mesh", "tp=2", "--out", out_str, "--emit", "obj", "--target-cpu", cpu]);
        assert!(error.contains("E0511") && error.contains(cpu) && error.contains("x86-64-v3"), "{error}");
        assert!(!out.exists(), "{cpu}: nothing is written");
    }
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

#[cfg(feature = "llvm")]
#[test]
fn training_steps_run_through_the_entry_functions_bit_for_bit() {
    // Every instruction of a training step (the backward kernels, the losses, the optimizer's
    // gathers under ZeRO, a pipeline's sends) is a runtime call or a generated kernel of the entry
    // function; the losses and gradient norms equal the bytecode path's exactly.
    // Under bf16 the fused sums of gradients round each partial sum as the adds they replace
    // stored it (the step-2 loss was 6.110417 natively against 6.111316).
    let runs: [&[&str]; 7] = [
        &["tiny", "--mesh", "tp=2"],
        &["tiny", "--mesh", "tsp=2"],
        &["tiny", "--mesh", "pp=2", "--micro-batches", "2"],
        &["tiny", "--mesh", "dp=2", "--zero", "3"],
        &["tiny-moe", "--mesh", "ep=2"],
        &["tiny", "--precision", "bf16"],
        &["tiny", "--mesh", "tp=2", "--precision", "bf16"],
    ];
    let common = ["--train", "--steps", "2", "--batch", "4", "--seq", "16", "--format", "json"];
    for run in runs {
        let args = |extra: &[&'static str]| [&["run"][..], run, &common, extra].concat();
        let native = json_of(&args(&["--native", "--check"]));
        let ranks = native["ranks"].as_u64().expect("ranks") as usize;
        assert_eq!(native["execution_per_rank"], serde_json::json!(vec!["native-entry"; ranks]), "{run:?}");
        // (A bf16 run is held to bf16's tolerances by its own `--check`, which exits non-zero.)
        if !run.contains(&"bf16") {
            cli::assert_matches_reference(&native, &format!("{run:?}"));
        }
        let bytecode = json_of(&args(&[]));
        assert_eq!(bytecode["execution_per_rank"], serde_json::json!(vec!["bytecode"; ranks]), "{run:?}");
        // The native steps' buffers live in the planned arena, reported as a forward run's are.
        let arenas = |report: &serde_json::Value| -> Vec<u64> {
            report["arena_bytes_per_rank"].as_array().expect("arenas").iter().filter_map(|a| a.as_u64()).collect()
        };
        assert!(arenas(&native).len() == ranks && arenas(&native).iter().all(|&arena| arena > 0), "{run:?}");
        assert!(arenas(&bytecode).iter().all(|&arena| arena == 0), "{run:?}");
        assert_eq!(native["losses"], bytecode["losses"], "{run:?}");
        assert_eq!(native["grad_norms"], bytecode["grad_norms"], "{run:?}");
    }
}

#[cfg(feature = "llvm")]
#[test]
fn a_compiled_training_directory_runs_its_libraries_entry_functions() {
    // `pleat compile --train --emit so` writes each rank's training step as native code;
    // `pleat run DIR --train` runs it through the entry functions, as `--native` does.
    let dir = tempdir("native-training-dir");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    let layout = ["--mesh", "pp=2", "--micro-batches", "2", "--batch", "4", "--seq", "16"];
    let compiled =
        stdout_of(&[&["compile", "tiny", "--train", "--emit", "so", "--out", out_str][..], &layout].concat());
    assert!(compiled.contains("native kernels: rank0.so, rank1.so"), "{compiled}");
    let steps = ["--train", "--steps", "2", "--format", "json"];
    let from_dir = json_of(&[&["run", out_str, "--check"][..], &steps].concat());
    assert_eq!(from_dir["execution_per_rank"], serde_json::json!(["native-entry", "native-entry"]));
    cli::assert_matches_reference(&from_dir, "compiled pp=2");
    let generated = json_of(&[&["run", "tiny", "--native"][..], &layout, &steps].concat());
    assert_eq!(from_dir["losses"], generated["losses"]);
    assert_eq!(from_dir["grad_norms"], generated["grad_norms"]);
    let error = error_of(&["run", out_str, "--train", "--native"]);
    assert!(error.contains("E0544"), "{error}");
}

#[cfg(feature = "llvm")]
#[test]
fn a_compiled_training_directorys_device_code_is_for_its_programs() {
    // `pleat run DIR --train --device cuda` launches the kernels `--emit ptx` wrote beside each
    // program; the GPU runtime refuses code whose fingerprint is another program's, so each file
    // must carry its own program's, with the backward's kernels among them.
    let dir = tempdir("native-training-ptx");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    let args = ["compile", "tiny", "--train", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--emit", "ptx"];
    stdout_of(&[&args[..], &["--precision", "bf16", "--out", out_str]].concat());
    for rank in 0..2 {
        let read = |name: String| std::fs::read_to_string(out.join(&name)).unwrap_or_else(|_| panic!("{name}"));
        let program = pleat_backend::from_json(&read(format!("rank{rank}.program"))).expect("a program");
        let backward = program
            .instructions
            .iter()
            .filter(|instr| {
                matches!(instr, pleat_backend::Instr::Kernel { kernel: pleat_backend::Kernel::RopeGrad { .. }, .. })
            })
            .count();
        assert!(backward > 0, "rank {rank}: a training program has the RoPE gradient");
        for (arch, _) in pleat_backend::llvm::PTX_ARCHES {
            let code: pleat_backend::native::DeviceCode =
                serde_json::from_str(&read(format!("rank{rank}.{arch}.cuda.json"))).expect("device code");
            assert_eq!(code.fingerprint, pleat_backend::native::program_fingerprint(&program), "rank {rank} {arch}");
            assert_eq!(code.kernels.len(), pleat_backend::native::device_kernels(&program).len(), "{arch}");
            assert!(code.declared_elements, "bf16 buffers read as bf16");
        }
    }
}

#[cfg(feature = "llvm")]
#[test]
fn native_forward_runs_generate_their_code_and_compiled_directories_refuse_the_flag() {
    let ran = stdout_of(&["run", "tiny", "--mesh", "tsp=2", "--batch", "2", "--seq", "16", "--native", "--check"]);
    assert!(ran.contains("execution a rank: native-entry, native-entry"), "{ran}");
    assert!(ran.contains(": ok"), "{ran}");
    let dir = tempdir("native-flag-compiled");
    let out = dir.join("d");
    let out_str = out.to_str().expect("utf-8 path");
    stdout_of(&["compile", "tiny", "--mesh", "tp=2", "--out", out_str]);
    let error = error_of(&["run", out_str, "--native"]);
    assert!(error.contains("E0544") && error.contains("--emit so"), "{error}");
}

#[cfg(feature = "llvm")]
#[test]
fn a_compiled_directorys_artifacts_are_checked_and_a_failed_emit_writes_nothing() {
    let dir = tempdir("native-files");
    let out = dir.join("so");
    let out_str = out.to_str().expect("utf-8");
    let args = ["compile", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--emit", "so", "--emit", "so"];
    let compiled = stdout_of(&[&args[..], &["--out", out_str]].concat());
    // The kind asked twice is built once.
    assert!(compiled.contains("native kernels: rank0.so, rank1.so\n"), "{compiled}");
    // A truncated library would crash the loader (SIGBUS); it is refused before it is loaded.
    let truncated = dir.join("truncated");
    copy_dir(&out, &truncated);
    let library = std::fs::read(truncated.join("rank0.so")).expect("rank0.so");
    std::fs::write(truncated.join("rank0.so"), &library[..5000]).expect("truncate");
    let error = error_of(&["launch", truncated.to_str().expect("utf-8")]);
    assert!(error.contains("error[E0553]") && error.contains("rank0.so: plan.json records hash"), "{error}");
    // An edited config.json is part of the plan's hash (it was a "pleat bug" E0720).
    let edited = dir.join("edited");
    copy_dir(&out, &edited);
    let config = std::fs::read_to_string(edited.join("config.json")).expect("config");
    std::fs::write(edited.join("config.json"), config.replace("\"rms_norm_eps\"", "\"rms_norm_eps\": 0.5, \"x\""))
        .expect("edit");
    let error = error_of(&["run", edited.to_str().expect("utf-8")]);
    assert!(error.contains("error[E0521]"), "{error}");
    // A library pleat compile did not write is refused as such; the files written for people to
    // read (.ll, .s, .o, .ptx) are never loaded, and editing one blocks nothing.
    let added = dir.join("added");
    let plain = ["compile", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--emit", "llvm-ir"];
    stdout_of(&[&plain[..], &["--out", added.to_str().expect("utf-8")]].concat());
    std::fs::write(added.join("rank0.ll"), "; edited by hand\n").expect("edit");
    stdout_of(&["run", added.to_str().expect("utf-8")]);
    std::fs::copy(out.join("rank1.so"), added.join("rank1.so")).expect("copy");
    let error = error_of(&["run", added.to_str().expect("utf-8")]);
    assert!(error.contains("rank1.so: `pleat compile` did not write it"), "{error}");
    // Artifacts are emitted into the staging directory: one that fails leaves no directory that
    // would run without the code asked for.
    let failed = dir.join("failed");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_pleat"))
        .args(["compile", "tiny", "--mesh", "tp=2", "--emit", "exe", "--out", failed.to_str().expect("utf-8")])
        .env("PLEAT_RUNTIME_LIB", "/etc/passwd")
        .output()
        .expect("pleat runs");
    assert!(!output.status.success(), "{}", String::from_utf8_lossy(&output.stdout));
    assert!(!failed.exists(), "a failed --emit left {}", failed.display());
}

/// Copies the files of `from` into a new directory `to`.
#[cfg(feature = "llvm")]
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("a directory");
    for entry in std::fs::read_dir(from).expect("listable") {
        let entry = entry.expect("an entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copied");
    }
}
