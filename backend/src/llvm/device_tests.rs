//! The GPU-only kernels' code ([`crate::native::device_kernels`]: attention, the merge of ring
//! attention's states and the embedding lookup), built for the host and run here, against a direct computation: the PTX is the same IR
//! but for the thread index and the approximate `exp` and `ln`, so this checks the indexing, the
//! mask, the grouped heads and the online softmax without a GPU.

use inkwell::context::Context;
use inkwell::execution_engine::JitFunction;
use inkwell::OptimizationLevel;

use super::codegen::{Codegen, Flavor};
use super::*;
use crate::native::{device_kernels, native_kernels};
use crate::program::{AttentionDims, Buffer, BufferId, BufferKind, Instr, Kernel, FORMAT_VERSION};
use pleat_ir::entity::EntityRef;
use pleat_ir::DType;

type KernelFunction = unsafe extern "C" fn(*const *const f32, *mut f32);

/// A program of one kernel over `operands` (name, dtype, shape) into `out_shape`.
fn one_kernel_program(kernel: Kernel, operands: &[(&str, DType, Vec<u64>)], out_shape: Vec<u64>) -> Program {
    let mut buffers: Vec<Buffer> = operands
        .iter()
        .map(|(name, dtype, shape)| Buffer {
            name: (*name).into(),
            dtype: *dtype,
            shape: shape.clone(),
            kind: BufferKind::Input,
        })
        .collect();
    buffers.push(Buffer { name: "out".into(), dtype: DType::F32, shape: out_shape, kind: BufferKind::Activation });
    Program {
        format_version: FORMAT_VERSION,
        model: "test".into(),
        mesh: String::new(),
        rank: 0,
        world_size: 1,
        tokens_shape: vec![],
        instructions: vec![Instr::Kernel {
            kernel,
            inputs: (0..operands.len()).map(BufferId::new).collect(),
            out: BufferId::new(operands.len()),
        }],
        buffers,
    }
}

/// Runs the host build of the program's one device kernel on `inputs` (each as raw 4-byte words),
/// returning its result of `out_len` elements.
fn run_on_host(program: &Program, inputs: &[&[u32]], out_len: usize) -> Vec<f32> {
    let kernels = device_kernels(program);
    assert_eq!(kernels.len(), 1, "the kernel is generated for a GPU: {kernels:?}");
    assert!(native_kernels(program).is_empty(), "it stays with the runtime on the host");
    Target::initialize_native(&InitializationConfig::default()).unwrap();
    let context = Context::create();
    let module = context.create_module("device_kernel_on_host");
    Codegen::new(&context, &module, Flavor::Host).define(program, &kernels[0]).unwrap();
    verify(&module).unwrap();
    let engine = module.create_jit_execution_engine(OptimizationLevel::Default).unwrap();
    let mut out = vec![f32::NAN; out_len];
    let pointers: Vec<*const f32> = inputs.iter().map(|words| words.as_ptr().cast::<f32>()).collect();
    // SAFETY: the function has the ABI of `crate::native` and reads each operand and writes the
    // result within the sizes `device_kernels` checked against the buffers, which these match.
    unsafe {
        let function: JitFunction<KernelFunction> = engine.get_function(&kernels[0].symbol()).unwrap();
        function.call(pointers.as_ptr(), out.as_mut_ptr());
    }
    out
}

/// Deterministic values in [-1, 1).
fn values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn words(values: &[f32]) -> Vec<u32> {
    values.iter().map(|value| value.to_bits()).collect()
}

/// Attention by its definition, in f64: each row's softmax over the keys it sees, then the
/// weighted values; the row's output then (with `with_lse`) its log-sum-exp.
fn direct_attention(
    dims: &AttentionDims,
    with_lse: bool,
    tensors: [&[f32]; 3],
    q_pos: &[u32],
    k_pos: &[u32],
) -> Vec<f64> {
    let AttentionDims { batch, sq, sk, hq, hkv, head_dim, q_head_offset, kv_head_offset, group, causal, scale } = *dims;
    let [q, k, v] = tensors;
    let (batch, sq, sk, hq, hkv, d) =
        (batch as usize, sq as usize, sk as usize, hq as usize, hkv as usize, head_dim as usize);
    let mut out = Vec::new();
    for b in 0..batch {
        for i in 0..sq {
            for h in 0..hq {
                let kv_head = ((q_head_offset as usize + h) / group as usize) - kv_head_offset as usize;
                let query = &q[((b * sq + i) * hq + h) * d..][..d];
                let at = |j: usize| ((b * sk + j) * hkv + kv_head) * d;
                let seen: Vec<usize> = (0..sk).filter(|&j| !causal || k_pos[j] <= q_pos[i]).collect();
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        let dot: f64 = (0..d).map(|e| f64::from(query[e]) * f64::from(k[at(j) + e])).sum();
                        dot * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|score| (score - max).exp()).sum();
                for e in 0..d {
                    let weighted: f64 =
                        seen.iter().zip(&scores).map(|(&j, score)| (score - max).exp() * f64::from(v[at(j) + e])).sum();
                    out.push(if seen.is_empty() { 0.0 } else { weighted / total });
                }
                if with_lse {
                    out.push(if seen.is_empty() { f64::NEG_INFINITY } else { max + total.ln() });
                }
            }
        }
    }
    out
}

#[test]
fn generated_attention_equals_the_softmax_by_definition() {
    // Grouped heads with offsets (global query heads 2..6 read kv heads 1 and 2, local 0 and 1),
    // zigzag key positions, and a query at position 0 before every key but one: it sees one key;
    // with the key at 0 removed (`k_pos` from 1) that row sees none.
    let base = AttentionDims {
        batch: 2,
        sq: 3,
        sk: 5,
        hq: 4,
        hkv: 2,
        head_dim: 6,
        q_head_offset: 2,
        kv_head_offset: 1,
        group: 2,
        causal: true,
        scale: 0.4,
    };
    let unmasked = AttentionDims { causal: false, ..base.clone() };
    let single_head = AttentionDims { hq: 1, hkv: 1, q_head_offset: 0, kv_head_offset: 0, group: 1, ..base.clone() };
    let cases: [(&AttentionDims, bool, &[u32], &[u32]); 5] = [
        (&base, false, &[4, 0, 2], &[0, 5, 1, 4, 2]),
        (&base, true, &[4, 0, 2], &[0, 5, 1, 4, 2]),
        (&base, true, &[4, 0, 2], &[3, 5, 1, 4, 2]),
        (&unmasked, true, &[4, 0, 2], &[3, 5, 1, 4, 2]),
        (&single_head, false, &[9, 1, 6], &[7, 3, 8, 1, 2]),
    ];
    for (case, (dims, with_lse, q_pos, k_pos)) in cases.into_iter().enumerate() {
        let q_len = (dims.batch * dims.sq * dims.hq * dims.head_dim) as usize;
        let kv_len = (dims.batch * dims.sk * dims.hkv * dims.head_dim) as usize;
        // Scaled up so that the softmax is far from uniform.
        let scaled = |seed| values(kv_len.max(q_len), seed).iter().map(|x| 3.0 * x).collect::<Vec<f32>>();
        let (q, k, v) = (scaled(1)[..q_len].to_vec(), scaled(2)[..kv_len].to_vec(), scaled(3)[..kv_len].to_vec());
        let row_width = dims.head_dim + u64::from(with_lse);
        let out_len = (dims.batch * dims.sq * dims.hq * row_width) as usize;
        let shape = |dims: &[u64]| dims.to_vec();
        let program = one_kernel_program(
            Kernel::Attention { dims: dims.clone(), with_lse },
            &[
                ("q", DType::F32, shape(&[dims.batch, dims.sq, dims.hq, dims.head_dim])),
                ("k", DType::F32, shape(&[dims.batch, dims.sk, dims.hkv, dims.head_dim])),
                ("v", DType::F32, shape(&[dims.batch, dims.sk, dims.hkv, dims.head_dim])),
                ("q_pos", DType::I32, shape(&[dims.sq])),
                ("k_pos", DType::I32, shape(&[dims.sk])),
            ],
            vec![dims.batch, dims.sq, dims.hq, row_width],
        );
        let generated = run_on_host(&program, &[&words(&q), &words(&k), &words(&v), q_pos, k_pos], out_len);
        let expected = direct_attention(dims, with_lse, [&q, &k, &v], q_pos, k_pos);
        assert_eq!(generated.len(), expected.len());
        for (index, (&got, &want)) in generated.iter().zip(&expected).enumerate() {
            let close = if want.is_infinite() { f64::from(got) == want } else { (f64::from(got) - want).abs() <= 1e-5 };
            assert!(close, "case {case}: element {index} is {got}, the definition gives {want}");
        }
        if case == 2 {
            // Query 1 (position 0) sees no key, on every head and batch entry: zeros, and -inf.
            let width = row_width as usize;
            for row in [4, 5, 6, 7, 16, 17, 18, 19] {
                let (output, lse) = generated[row * width..(row + 1) * width].split_at(width - 1);
                assert!(output.iter().all(|&x| x == 0.0) && lse == [f32::NEG_INFINITY], "row {row}: {generated:?}");
            }
        }
    }
}

#[test]
fn generated_embedding_copies_the_rows_its_shard_holds_and_zeros_the_others() {
    // Rows 2..5 of a vocabulary of 8, rows of 3.
    let (hidden, vocab_offset, rows) = (3u64, 2u64, 3u64);
    let table: Vec<f32> = (0..rows * hidden).map(|x| x as f32 + 0.5).collect();
    let tokens: [u32; 6] = [0, 2, 4, 7, 3, 1];
    let program = one_kernel_program(
        Kernel::Embedding { hidden, vocab_offset, vocab_total: 8 },
        &[("table", DType::F32, vec![rows, hidden]), ("tokens", DType::I32, vec![1, tokens.len() as u64])],
        vec![1, tokens.len() as u64, hidden],
    );
    let generated = run_on_host(&program, &[&words(&table), &tokens], tokens.len() * hidden as usize);
    let row = |local: usize| table[local * 3..local * 3 + 3].to_vec();
    let zeros = vec![0.0; 3];
    let expected: Vec<f32> = [zeros.clone(), row(0), row(2), zeros.clone(), row(1), zeros].concat();
    assert_eq!(generated, expected);
}

#[test]
fn device_code_launches_attention_and_merges_a_row_a_thread_and_the_embedding_an_element_a_thread() {
    let dims = AttentionDims {
        batch: 2,
        sq: 4,
        sk: 4,
        hq: 2,
        hkv: 1,
        head_dim: 8,
        q_head_offset: 0,
        kv_head_offset: 0,
        group: 2,
        causal: true,
        scale: 0.35,
    };
    let attention = one_kernel_program(
        Kernel::Attention { dims, with_lse: false },
        &[
            ("q", DType::F32, vec![2, 4, 2, 8]),
            ("k", DType::F32, vec![2, 4, 1, 8]),
            ("v", DType::F32, vec![2, 4, 1, 8]),
            ("q_pos", DType::I32, vec![4]),
            ("k_pos", DType::I32, vec![4]),
        ],
        vec![2, 4, 2, 8],
    );
    let embedding = one_kernel_program(
        Kernel::Embedding { hidden: 8, vocab_offset: 0, vocab_total: 16 },
        &[("table", DType::F32, vec![16, 8]), ("tokens", DType::I32, vec![2, 3])],
        vec![2, 3, 8],
    );
    let merge = one_kernel_program(
        Kernel::MergeAttention { rows: 5, head_dim: 8 },
        &[("first", DType::F32, vec![5, 9]), ("second", DType::F32, vec![5, 9])],
        vec![5, 9],
    );
    for (program, threads) in [(attention, 2 * 4 * 2), (embedding, 2 * 3 * 8), (merge, 5)] {
        for (arch, _) in PTX_ARCHES {
            let code = device_code(&program, arch).unwrap();
            assert_eq!(code.kernels.len(), 1);
            assert_eq!(code.kernels[0].threads, threads);
            assert!(code.ptx.contains(".visible .entry pleat_kernel_0("), "{}", code.ptx);
        }
    }
}

#[test]
fn generated_merge_weighs_two_attention_states_by_their_log_sum_exp() {
    // Rows of 2 outputs then the lse: both sides seen, one side only (either), neither.
    let neg = f32::NEG_INFINITY;
    let first: [f32; 12] = [1.0, -2.0, 0.5, 3.0, 4.0, -1.5, 0.25, 0.5, neg, 7.0, 8.0, neg];
    let second: [f32; 12] = [-3.0, 6.0, 1.5, 2.0, 1.0, neg, 5.0, -4.0, 2.0, 0.0, 0.0, neg];
    let program = one_kernel_program(
        Kernel::MergeAttention { rows: 4, head_dim: 2 },
        &[("first", DType::F32, vec![4, 3]), ("second", DType::F32, vec![4, 3])],
        vec![4, 3],
    );
    let generated = run_on_host(&program, &[&words(&first), &words(&second)], 12);
    for row in 0..4 {
        let (a, b) = (f64::from(first[row * 3 + 2]), f64::from(second[row * 3 + 2]));
        let (output, lse) = (&generated[row * 3..row * 3 + 2], generated[row * 3 + 2]);
        if a == f64::NEG_INFINITY && b == f64::NEG_INFINITY {
            assert_eq!((output, lse), (&[0.0, 0.0][..], neg), "row {row}");
            continue;
        }
        // exp(lse) is each side's softmax denominator: the union's is their sum.
        let (weight_a, weight_b) = (a.exp(), b.exp());
        let union = weight_a + weight_b;
        for dim in 0..2 {
            let want =
                (weight_a * f64::from(first[row * 3 + dim]) + weight_b * f64::from(second[row * 3 + dim])) / union;
            assert!(
                (f64::from(output[dim]) - want).abs() < 1e-6,
                "row {row} dim {dim}: {} against {want}",
                output[dim]
            );
        }
        assert!((f64::from(lse) - union.ln()).abs() < 1e-6, "row {row}: lse {lse} against {}", union.ln());
    }
}
