//! Native kernels (feature `llvm`) against the interpreted ones on the elementwise and row-wise work
//! of one layer of a mid-size model (hidden 1024, 16 heads of 64, 4 kv heads, MLP 2816, batch 1,
//! sequence 2048): two residual adds each followed by an RMSNorm, RoPE on queries and keys, and
//! SiLU-mul. The interpreted side calls the runtime's kernels as the bytecode executor does (a
//! fresh result each); the native side calls the generated library, the adds fused with their
//! norms, once with fresh results and once writing into buffers allocated before, as the entry
//! path writes into its planned arena (`pleat run --native`). Report the ratios: this machine is
//! shared and noisy.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use pleat_backend::llvm::{emit, Artifact, CodegenOptions};
use pleat_backend::native::native_kernels;
use pleat_backend::{Buffer, BufferId, BufferKind, Instr, Kernel, Program, FORMAT_VERSION};
use pleat_ir::entity::EntityRef;
use pleat_ir::DType;
use pleat_runtime::kernels;
use pleat_runtime::{NativeKernels, NativeOperand};

const HIDDEN: u64 = 1024;
const SEQ: u64 = 2048;
const HEADS: u64 = 16;
const KV_HEADS: u64 = 4;
const HEAD_DIM: u64 = 64;
const MLP: u64 = 2816;
const EPS: f64 = 1e-5;

/// The layer's elementwise instructions over buffers:
/// 0 x, 1 attention out, 2 norm weight, 3 sum, 4 normed, 5 q, 6 positions, 7 q rotated, 8 k,
/// 9 k rotated, 10 gate, 11 up, 12 gated, 13 mlp out, 14 norm weight 2, 15 sum 2, 16 normed 2.
fn layer() -> Program {
    let float =
        |name: &str, shape: &[u64], kind| Buffer { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), kind };
    let (param, activation) = (BufferKind::Param, BufferKind::Activation);
    let buffers = vec![
        float("x", &[SEQ, HIDDEN], param),
        float("attention", &[SEQ, HIDDEN], param),
        float("norm1", &[HIDDEN], param),
        float("sum1", &[SEQ, HIDDEN], activation),
        float("normed1", &[SEQ, HIDDEN], activation),
        float("q", &[1, SEQ, HEADS, HEAD_DIM], param),
        Buffer { name: "positions".into(), dtype: DType::I32, shape: vec![SEQ], kind: BufferKind::Input },
        float("q_rope", &[1, SEQ, HEADS, HEAD_DIM], activation),
        float("k", &[1, SEQ, KV_HEADS, HEAD_DIM], param),
        float("k_rope", &[1, SEQ, KV_HEADS, HEAD_DIM], activation),
        float("gate", &[SEQ, MLP], param),
        float("up", &[SEQ, MLP], param),
        float("gated", &[SEQ, MLP], activation),
        float("mlp", &[SEQ, HIDDEN], param),
        float("norm2", &[HIDDEN], param),
        float("sum2", &[SEQ, HIDDEN], activation),
        float("normed2", &[SEQ, HIDDEN], activation),
    ];
    let id = BufferId::new;
    let load = |out: usize| Instr::LoadParam { out: id(out), name: String::new(), shape: vec![], region: vec![] };
    let kernel = |kernel: Kernel, inputs: &[usize], out: usize| Instr::Kernel {
        kernel,
        inputs: inputs.iter().map(|&input| id(input)).collect(),
        out: id(out),
    };
    let inv_freq: Vec<f32> = (0..HEAD_DIM / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / HEAD_DIM as f32)).collect();
    let rope = |heads| Kernel::Rope { batch: 1, seq: SEQ, heads, head_dim: HEAD_DIM, inv_freq: inv_freq.clone() };
    let norm = Kernel::RmsNorm { hidden: HIDDEN, eps: EPS };
    let mut instructions: Vec<Instr> = [0, 1, 2, 5, 8, 10, 11, 13, 14].into_iter().map(load).collect();
    instructions.push(Instr::LoadPositions { out: id(6), region: vec![(0, SEQ)] });
    instructions.extend([
        kernel(Kernel::Add, &[0, 1], 3),
        kernel(norm.clone(), &[3, 2], 4),
        kernel(rope(HEADS), &[5, 6], 7),
        kernel(rope(KV_HEADS), &[8, 6], 9),
        kernel(Kernel::SiluMul, &[10, 11], 12),
        kernel(Kernel::Add, &[3, 13], 15),
        kernel(norm, &[15, 14], 16),
    ]);
    Program {
        format_version: FORMAT_VERSION,
        model: "bench-layer".into(),
        mesh: String::new(),
        rank: 0,
        world_size: 1,
        tokens_shape: vec![1, SEQ],
        buffers,
        instructions,
    }
}

fn random(count: u64, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn native_vs_interpreted(c: &mut Criterion) {
    let program = layer();
    let dir = std::env::temp_dir().join(format!("pleat-bench-native-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let paths = emit(&program, Artifact::SharedLibrary, &CodegenOptions::default(), &dir).expect("emit");
    let library = NativeKernels::open(&paths[0], &program).expect("open");
    let data: Vec<Vec<f32>> =
        program.buffers.iter().enumerate().map(|(index, buffer)| random(buffer.numel(), index as u64)).collect();
    let positions: Vec<u32> = (0..SEQ as u32).collect();
    let operand = |index: usize| {
        if index == 6 {
            NativeOperand::U32(&positions)
        } else {
            NativeOperand::F32(&data[index])
        }
    };
    let calls: Vec<(usize, Vec<usize>)> = native_kernels(&program)
        .iter()
        .map(|native| {
            let instr = native.first_instr();
            let Instr::Kernel { inputs, .. } = &program.instructions[instr] else { unreachable!("a kernel") };
            let mut operands: Vec<usize> = inputs.iter().map(|input| input.index()).collect();
            if let pleat_backend::native::NativeKernel::FusedAddRmsNorm { norm_instr, .. } = native {
                let Instr::Kernel { inputs, .. } = &program.instructions[*norm_instr] else { unreachable!("a kernel") };
                operands.push(inputs[1].index());
            }
            (instr, operands)
        })
        .collect();
    let inv_freq: Vec<f32> = (0..HEAD_DIM / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / HEAD_DIM as f32)).collect();
    let (hidden, seq) = (HIDDEN as usize, SEQ as usize);

    let mut group = c.benchmark_group("layer elementwise h=1024 seq=2048");
    group.sample_size(10);
    group.bench_function("interpreted, unfused", |b| {
        b.iter(|| {
            let fresh = |index: usize| vec![0.0f32; data[index].len()];
            let mut sum1 = fresh(3);
            kernels::add(&data[0], &data[1], &mut sum1);
            let mut normed1 = fresh(4);
            kernels::rms_norm(&sum1, &data[2], &mut normed1, hidden, EPS as f32);
            let mut q = data[5].clone();
            kernels::rope_in_place(&mut q, 1, seq, HEADS as usize, HEAD_DIM as usize, &positions, &inv_freq);
            let mut k = data[8].clone();
            kernels::rope_in_place(&mut k, 1, seq, KV_HEADS as usize, HEAD_DIM as usize, &positions, &inv_freq);
            let mut gated = fresh(12);
            kernels::silu_mul(&data[10], &data[11], &mut gated);
            let mut sum2 = fresh(15);
            kernels::add(&sum1, &data[13], &mut sum2);
            let mut normed2 = fresh(16);
            kernels::rms_norm(&sum2, &data[14], &mut normed2, hidden, EPS as f32);
            black_box((normed1, q, k, gated, normed2))
        })
    });
    group.bench_function("native, fused, fresh results", |b| {
        b.iter(|| {
            let outputs: Vec<_> = calls
                .iter()
                .map(|(instr, operands)| {
                    let operands: Vec<NativeOperand> = operands.iter().map(|&index| operand(index)).collect();
                    library.call(*instr, &operands).expect("native call")
                })
                .collect();
            black_box(outputs)
        })
    });
    // The results' buffers, allocated once: the entry path's arena slots.
    let mut slots: Vec<(Vec<f32>, Option<Vec<f32>>)> = calls
        .iter()
        .map(|(instr, _)| {
            let out = program.instructions[*instr].out().expect("a kernel's result");
            let normed = native_kernels(&program).into_iter().find_map(|native| match native {
                pleat_backend::native::NativeKernel::FusedAddRmsNorm { add_instr, norm_instr }
                    if add_instr == *instr =>
                {
                    program.instructions[norm_instr].out()
                }
                _ => None,
            });
            let buffer = |id: BufferId| vec![0.0f32; program.buffer(id).numel() as usize];
            (buffer(out), normed.map(buffer))
        })
        .collect();
    group.bench_function("native, fused, into the planned arena", |b| {
        b.iter(|| {
            for ((instr, operands), (out, normed)) in calls.iter().zip(slots.iter_mut()) {
                let operands: Vec<NativeOperand> = operands.iter().map(|&index| operand(index)).collect();
                library.call_into(*instr, &operands, out, normed.as_deref_mut()).expect("native call");
            }
            black_box(&slots);
        })
    });
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, native_vs_interpreted);
criterion_main!(benches);
