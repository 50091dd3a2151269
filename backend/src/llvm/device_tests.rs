//! The GPU-only kernels' code ([`crate::native::device_kernels`]: attention and its gradients, the
//! merge of ring attention's states, the embedding lookup, the sum of gradients, and the
//! embedding, cross-entropy, RoPE, SwiGLU gate and RMSNorm input gradients), built for the host and
//! run here, against a direct computation (attention's, the embedding's and the cross-entropy's
//! gradients against their definitions in f64, the others against central differences or the rotation's transpose): the PTX is the same IR
//! but for the thread index and the approximate `exp` and `ln`, so this checks the indexing, the
//! mask, the grouped heads and the online softmax without a GPU.

use inkwell::context::Context;
use inkwell::execution_engine::JitFunction;
use inkwell::OptimizationLevel;

use super::codegen::{Codegen, Elements, Flavor};
use super::*;
use crate::native::{device_kernels, native_kernels, NativeKernel};
use crate::program::{AttentionDims, AttentionOperand, Buffer, BufferId, BufferKind, Instr, Kernel, FORMAT_VERSION};
use pleat_ir::entity::EntityRef;
use pleat_ir::DType;

type KernelFunction = unsafe extern "C" fn(*const *const u8, *mut u8);
type FusedFunction = unsafe extern "C" fn(*const *const u8, *mut u8, *mut u8);

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

/// Runs the host build of `kernel` of `program`, its operands laid out as `elements` says, on
/// `inputs` (each operand's bytes), returning the bytes of each of its results.
fn run_kernel(program: &Program, kernel: &NativeKernel, elements: Elements, inputs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    Target::initialize_native(&InitializationConfig::default()).unwrap();
    let context = Context::create();
    let module = context.create_module("device_kernel_on_host");
    Codegen::new(&context, &module, Flavor::Host, elements).define(program, kernel).unwrap();
    verify(&module).unwrap();
    let engine = module.create_jit_execution_engine(OptimizationLevel::Default).unwrap();
    let (operands, results) = kernel.buffers(program).unwrap();
    assert_eq!(operands.len(), inputs.len());
    for (id, bytes) in operands.iter().zip(inputs) {
        assert_eq!(bytes.len(), stored_bytes(program, *id, elements), "{id}'s bytes");
    }
    // NaN-filled: every element a kernel writes is checked, so an unwritten one shows.
    let mut outs: Vec<Vec<u8>> = results.iter().map(|&id| vec![0xff; stored_bytes(program, id, elements)]).collect();
    let pointers: Vec<*const u8> = inputs.iter().map(|bytes| bytes.as_ptr()).collect();
    // SAFETY: the function has the ABI of `crate::native` and reads each operand and writes each
    // result within the sizes checked against the buffers above.
    unsafe {
        match outs.as_mut_slice() {
            [out] => {
                let function: JitFunction<KernelFunction> = engine.get_function(&kernel.symbol()).unwrap();
                function.call(pointers.as_ptr(), out.as_mut_ptr());
            }
            [sum, normed] => {
                let function: JitFunction<FusedFunction> = engine.get_function(&kernel.symbol()).unwrap();
                function.call(pointers.as_ptr(), sum.as_mut_ptr(), normed.as_mut_ptr());
            }
            _ => panic!("a kernel writes one or two results"),
        }
    }
    outs
}

/// The bytes buffer `id` takes laid out as `elements` says.
fn stored_bytes(program: &Program, id: BufferId, elements: Elements) -> usize {
    let buffer = program.buffer(id);
    let width = if elements == Elements::Declared && buffer.dtype == DType::Bf16 { 2 } else { 4 };
    buffer.numel() as usize * width
}

/// Runs the program's one device kernel (f32 words in and out).
fn run_on_host(program: &Program, inputs: &[&[u32]], out_len: usize) -> Vec<f32> {
    let kernels = device_kernels(program);
    assert_eq!(kernels.len(), 1, "the kernel is generated for a GPU: {kernels:?}");
    assert!(native_kernels(program).is_empty(), "it stays with the runtime on the host");
    let inputs: Vec<Vec<u8>> =
        inputs.iter().map(|words| words.iter().flat_map(|word| word.to_le_bytes()).collect()).collect();
    let out = run_kernel(program, &kernels[0], Elements::Declared, &inputs).remove(0);
    assert_eq!(out.len(), out_len * 4);
    out.chunks_exact(4).map(|bytes| f32::from_le_bytes(bytes.try_into().unwrap())).collect()
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

/// Four local query heads with offsets on two local kv heads: global query heads 2..6 read kv heads
/// 1 and 2, local 0 and 1.
fn offset_grouped_heads() -> AttentionDims {
    AttentionDims {
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
    }
}

#[test]
fn generated_attention_equals_the_softmax_by_definition() {
    // Grouped heads with offsets (global query heads 2..6 read kv heads 1 and 2, local 0 and 1),
    // zigzag key positions, and a query at position 0 before every key but one: it sees one key;
    // with the key at 0 removed (`k_pos` from 1) that row sees none.
    let base = offset_grouped_heads();
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

/// Attention's gradients by their definition, in f64: for each query row its softmax `P` over the
/// keys it sees, `dP = dy·vᵀ` and `dS = P (dP - Σ P·dP)`; `dq = scale·dS·k`, `dk = scale·dSᵀ·q`
/// (summed over the local query heads), `dv = Pᵀ·dy`. Returns `[dq, dk, dv]`.
fn direct_attention_gradients(
    dims: &AttentionDims,
    tensors: [&[f32]; 4],
    q_pos: &[u32],
    k_pos: &[u32],
) -> [Vec<f64>; 3] {
    let AttentionDims { batch, sq, sk, hq, hkv, head_dim, q_head_offset, kv_head_offset, group, causal, scale } = *dims;
    let [q, k, v, dy] = tensors;
    let (batch, sq, sk, hq, hkv, d) =
        (batch as usize, sq as usize, sk as usize, hq as usize, hkv as usize, head_dim as usize);
    let scale = f64::from(scale);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let dot = |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum() };
    for b in 0..batch {
        for (i, &query_position) in q_pos.iter().enumerate().take(sq) {
            for h in 0..hq {
                let kv_head = ((q_head_offset as usize + h) / group as usize) - kv_head_offset as usize;
                let row = ((b * sq + i) * hq + h) * d;
                let at = |j: usize| ((b * sk + j) * hkv + kv_head) * d;
                let seen: Vec<usize> = (0..sk).filter(|&j| !causal || k_pos[j] <= query_position).collect();
                if seen.is_empty() {
                    continue;
                }
                let scores: Vec<f64> = seen.iter().map(|&j| scale * dot(&q[row..][..d], &k[at(j)..][..d])).collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|score| (score - max).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|score| (score - max).exp() / total).collect();
                let dp: Vec<f64> = seen.iter().map(|&j| dot(&dy[row..][..d], &v[at(j)..][..d])).collect();
                let mean: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for (index, &j) in seen.iter().enumerate() {
                    let ds = p[index] * (dp[index] - mean);
                    for e in 0..d {
                        dq[row + e] += scale * ds * f64::from(k[at(j) + e]);
                        dk[at(j) + e] += scale * ds * f64::from(q[row + e]);
                        dv[at(j) + e] += p[index] * f64::from(dy[row + e]);
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

#[test]
fn generated_attention_gradients_equal_their_definition() {
    // The forward's cases: grouped heads with offsets, zigzag positions, a query that sees one key
    // and (with the key at 0 removed) none, unmasked, and one head.
    let base = offset_grouped_heads();
    let unmasked = AttentionDims { causal: false, ..base.clone() };
    let single_head = AttentionDims { hq: 1, hkv: 1, q_head_offset: 0, kv_head_offset: 0, group: 1, ..base.clone() };
    let cases: [(&AttentionDims, &[u32], &[u32]); 4] = [
        (&base, &[4, 0, 2], &[0, 5, 1, 4, 2]),
        (&base, &[4, 0, 2], &[3, 5, 1, 4, 2]),
        (&unmasked, &[4, 0, 2], &[3, 5, 1, 4, 2]),
        (&single_head, &[9, 1, 6], &[7, 3, 8, 1, 2]),
    ];
    let operands = [AttentionOperand::Query, AttentionOperand::Key, AttentionOperand::Value];
    for (case, (dims, q_pos, k_pos)) in cases.into_iter().enumerate() {
        let q_shape = vec![dims.batch, dims.sq, dims.hq, dims.head_dim];
        let kv_shape = vec![dims.batch, dims.sk, dims.hkv, dims.head_dim];
        let (q_len, kv_len) = (q_shape.iter().product::<u64>() as usize, kv_shape.iter().product::<u64>() as usize);
        // Scaled up so that the softmax is far from uniform.
        let scaled = |len, seed| values(len, seed).iter().map(|x| 3.0 * x).collect::<Vec<f32>>();
        let (q, k, v, dy) = (scaled(q_len, 1), scaled(kv_len, 2), scaled(kv_len, 3), scaled(q_len, 4));
        let expected = direct_attention_gradients(dims, [&q, &k, &v, &dy], q_pos, k_pos);
        for (wrt, want) in operands.into_iter().zip(&expected) {
            let out_shape = if wrt == AttentionOperand::Query { q_shape.clone() } else { kv_shape.clone() };
            let program = one_kernel_program(
                Kernel::AttentionGrad { wrt, dims: dims.clone() },
                &[
                    ("q", DType::F32, q_shape.clone()),
                    ("k", DType::F32, kv_shape.clone()),
                    ("v", DType::F32, kv_shape.clone()),
                    ("q_pos", DType::I32, vec![dims.sq]),
                    ("k_pos", DType::I32, vec![dims.sk]),
                    ("dy", DType::F32, q_shape.clone()),
                ],
                out_shape,
            );
            let inputs = [&words(&q)[..], &words(&k), &words(&v), q_pos, k_pos, &words(&dy)];
            let generated = run_on_host(&program, &inputs, want.len());
            let largest = want.iter().fold(0.0_f64, |max, x| max.max(x.abs()));
            assert!(largest > 0.1, "case {case} {wrt:?}: the gradient is not trivial");
            for (index, (&got, &want)) in generated.iter().zip(want).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() <= 1e-5 * largest.max(1.0),
                    "case {case} {wrt:?}: element {index} is {got}, the definition gives {want}"
                );
            }
            if case == 1 && wrt == AttentionOperand::Query {
                // Query 1 (position 0) sees no key: its gradient rows are zeros.
                let width = dims.head_dim as usize;
                for row in [4, 5, 6, 7, 16, 17, 18, 19] {
                    assert!(generated[row * width..][..width].iter().all(|&x| x == 0.0), "row {row}: {generated:?}");
                }
            }
        }
    }
}

#[test]
fn a_generated_sum_adds_left_to_right_as_the_runtime() {
    // Three operands whose order matters in f32: (1e8 + 1) - 1e8 is 0, 1e8 + (1 - 1e8) is not.
    let (a, b, c) = ([1e8_f32, 0.5, 3.0], [1.0_f32, 0.25, -7.0], [-1e8_f32, 0.125, 2.0]);
    let program = one_kernel_program(
        Kernel::Sum,
        &[("a", DType::F32, vec![3]), ("b", DType::F32, vec![3]), ("c", DType::F32, vec![3])],
        vec![3],
    );
    let generated = run_on_host(&program, &[&words(&a), &words(&b), &words(&c)], 3);
    let want: Vec<f32> = (0..3).map(|i| (a[i] + b[i]) + c[i]).collect();
    assert_eq!(generated, want);
    assert_eq!(generated[0], 0.0, "left to right");
}

#[test]
fn the_generated_loss_gradient_is_softmax_minus_the_next_token() {
    // Two sequences of 3 positions over a vocabulary of 5; each row's gradient is
    // (softmax - onehot(next token)) / terms, the last position's zeros.
    let (batch, seq, vocab, terms) = (2_u64, 3_u64, 5_u64, 4_u64);
    let logits: Vec<f32> = values((batch * seq * vocab) as usize, 7).iter().map(|x| 4.0 * x).collect();
    let tokens: Vec<u32> = vec![1, 4, 0, 3, 3, 2];
    let program = one_kernel_program(
        Kernel::CrossEntropyGrad { batch, seq, vocab, terms },
        &[("logits", DType::F32, vec![batch, seq, vocab]), ("tokens", DType::I32, vec![batch, seq])],
        vec![batch, seq, vocab],
    );
    let generated = run_on_host(&program, &[&words(&logits), &tokens], logits.len());
    for row in 0..(batch * seq) as usize {
        let got = &generated[row * vocab as usize..][..vocab as usize];
        if row % seq as usize == seq as usize - 1 {
            assert!(got.iter().all(|&x| x == 0.0), "row {row}: {got:?}");
            continue;
        }
        let row_logits = &logits[row * vocab as usize..][..vocab as usize];
        let max = row_logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = row_logits.iter().map(|&x| f64::from(x - max).exp()).sum();
        for (column, &got) in got.iter().enumerate() {
            let probability = f64::from(row_logits[column] - max).exp() / total;
            let one_hot = if column == tokens[row + 1] as usize { 1.0 } else { 0.0 };
            let want = (probability - one_hot) / terms as f64;
            assert!((f64::from(got) - want).abs() <= 1e-6, "row {row} column {column}: {got} against {want}");
        }
    }
}

#[test]
fn the_generated_embedding_gradient_sums_each_rows_tokens_and_zeros_the_rest() {
    // Rows 4..8 of a vocabulary of 10, rows of 3: tokens 4 (twice) and 5 land, 2, 7 (once), 9 and
    // 0 do not, and row 6 is named by no token.
    let (hidden, vocab_offset, rows) = (3_u64, 4_u64, 4_u64);
    let tokens: Vec<u32> = vec![4, 2, 7, 4, 9, 5, 0];
    let dy = values(tokens.len() * hidden as usize, 11);
    let program = one_kernel_program(
        Kernel::EmbeddingGrad { hidden, vocab_offset, vocab_total: 10 },
        &[("dy", DType::F32, vec![tokens.len() as u64, hidden]), ("tokens", DType::I32, vec![tokens.len() as u64])],
        vec![rows, hidden],
    );
    let generated = run_on_host(&program, &[&words(&dy), &tokens], (rows * hidden) as usize);
    for row in 0..rows as usize {
        for column in 0..hidden as usize {
            let want: f64 = tokens
                .iter()
                .enumerate()
                .filter(|&(_, &token)| token as usize == vocab_offset as usize + row)
                .map(|(position, _)| f64::from(dy[position * hidden as usize + column]))
                .sum();
            let got = generated[row * hidden as usize + column];
            assert!((f64::from(got) - want).abs() <= 1e-6, "row {row} column {column}: {got} against {want}");
        }
    }
    assert!(generated[2 * hidden as usize..3 * hidden as usize].iter().all(|&x| x == 0.0), "row 6: {generated:?}");
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

/// Causal attention of 2 sequences of `seq` positions, two query heads of 8 reading one kv head.
fn two_heads_on_one_kv_head(seq: u64) -> AttentionDims {
    AttentionDims {
        batch: 2,
        sq: seq,
        sk: seq,
        hq: 2,
        hkv: 1,
        head_dim: 8,
        q_head_offset: 0,
        kv_head_offset: 0,
        group: 2,
        causal: true,
        scale: 0.35,
    }
}

#[test]
fn device_code_launches_attention_its_gradients_and_merges_a_row_a_thread_and_the_embedding_an_element_a_thread() {
    let dims = two_heads_on_one_kv_head(4);
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
    let norm_gradient = one_kernel_program(
        Kernel::RmsNormGradInput { hidden: 8, eps: 1e-5 },
        &[("x", DType::F32, vec![6, 8]), ("w", DType::F32, vec![8]), ("dy", DType::F32, vec![6, 8])],
        vec![6, 8],
    );
    let gate_gradient = one_kernel_program(
        Kernel::SiluMulGradGate,
        &[("gate", DType::F32, vec![3, 7]), ("up", DType::F32, vec![3, 7]), ("dy", DType::F32, vec![3, 7])],
        vec![3, 7],
    );
    let rope_gradient = one_kernel_program(
        Kernel::RopeGrad { batch: 2, seq: 3, heads: 4, head_dim: 4, inv_freq: vec![1.0, 0.1] },
        &[("dy", DType::F32, vec![2, 3, 4, 4]), ("positions", DType::I32, vec![3])],
        vec![2, 3, 4, 4],
    );
    let attention_gradient = |wrt: AttentionOperand| {
        let out = if wrt == AttentionOperand::Query { vec![2, 4, 2, 8] } else { vec![2, 4, 1, 8] };
        one_kernel_program(
            Kernel::AttentionGrad { wrt, dims: two_heads_on_one_kv_head(4) },
            &[
                ("q", DType::F32, vec![2, 4, 2, 8]),
                ("k", DType::F32, vec![2, 4, 1, 8]),
                ("v", DType::F32, vec![2, 4, 1, 8]),
                ("q_pos", DType::I32, vec![4]),
                ("k_pos", DType::I32, vec![4]),
                ("dy", DType::F32, vec![2, 4, 2, 8]),
            ],
            out,
        )
    };
    let sum = one_kernel_program(
        Kernel::Sum,
        &[("a", DType::F32, vec![3, 5]), ("b", DType::F32, vec![3, 5]), ("c", DType::F32, vec![3, 5])],
        vec![3, 5],
    );
    let embedding_gradient = one_kernel_program(
        Kernel::EmbeddingGrad { hidden: 8, vocab_offset: 0, vocab_total: 16 },
        &[("dy", DType::F32, vec![2, 3, 8]), ("tokens", DType::I32, vec![2, 3])],
        vec![16, 8],
    );
    let loss_gradient = one_kernel_program(
        Kernel::CrossEntropyGrad { batch: 2, seq: 3, vocab: 7, terms: 4 },
        &[("logits", DType::F32, vec![2, 3, 7]), ("tokens", DType::I32, vec![2, 3])],
        vec![2, 3, 7],
    );
    // A row, an element, a head's row a thread; attention's gradients a query row (q's) or a key
    // row (k's and v's); the loss gradient a logits row, the embedding's a table row.
    let cases = [
        (sum, 15),
        (embedding_gradient, 16),
        (loss_gradient, 6),
        (attention, 2 * 4 * 2),
        (attention_gradient(AttentionOperand::Query), 2 * 4 * 2),
        (attention_gradient(AttentionOperand::Key), 2 * 4),
        (attention_gradient(AttentionOperand::Value), 2 * 4),
        (embedding, 2 * 3 * 8),
        (merge, 5),
        (norm_gradient, 6),
        (gate_gradient, 21),
        (rope_gradient, 2 * 3 * 4),
    ];
    for (program, threads) in cases {
        for (arch, _) in PTX_ARCHES {
            let code = device_code(&program, arch).unwrap();
            assert_eq!(code.kernels.len(), 1);
            assert_eq!(code.kernels[0].threads, threads);
            assert!(code.ptx.contains(".visible .entry pleat_kernel_0("), "{}", code.ptx);
        }
    }
}

/// `Σ dy · rms_norm(x, w)` in f64: the scalar whose gradient with respect to `x` the RMSNorm input
/// gradient is.
fn norm_objective(x: &[f64], w: &[f32], dy: &[f32], hidden: usize, eps: f64) -> f64 {
    let mut total = 0.0;
    for (row_index, row) in x.chunks_exact(hidden).enumerate() {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps).sqrt();
        for (column, value) in row.iter().enumerate() {
            total += f64::from(dy[row_index * hidden + column]) * value * r * f64::from(w[column]);
        }
    }
    total
}

#[test]
fn generated_rms_norm_input_gradient_equals_central_differences() {
    // Three rows of 8; with the accumulating form, the gathered gradient added.
    let (rows, hidden, eps) = (3usize, 8usize, 1e-5);
    let (x, w, dy, gathered) =
        (values(rows * hidden, 11), values(hidden, 12), values(rows * hidden, 13), values(rows * hidden, 14));
    let wide: Vec<f64> = x.iter().map(|&value| f64::from(value)).collect();
    let numeric: Vec<f64> = (0..wide.len())
        .map(|index| {
            let (mut plus, mut minus) = (wide.clone(), wide.clone());
            plus[index] += 1e-4;
            minus[index] -= 1e-4;
            (norm_objective(&plus, &w, &dy, hidden, eps) - norm_objective(&minus, &w, &dy, hidden, eps)) / 2e-4
        })
        .collect();
    let shape = vec![rows as u64, hidden as u64];
    let operands = [
        ("x", DType::F32, shape.clone()),
        ("w", DType::F32, vec![hidden as u64]),
        ("dy", DType::F32, shape.clone()),
        ("gathered", DType::F32, shape.clone()),
    ];
    let alone = one_kernel_program(Kernel::RmsNormGradInput { hidden: 8, eps }, &operands[..3], shape.clone());
    let added = one_kernel_program(Kernel::RmsNormGradInputAdd { hidden: 8, eps }, &operands, shape);
    let inputs = [words(&x), words(&w), words(&dy), words(&gathered)];
    let inputs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let gradient = run_on_host(&alone, &inputs[..3], rows * hidden);
    let summed = run_on_host(&added, &inputs, rows * hidden);
    for index in 0..rows * hidden {
        assert!(
            (f64::from(gradient[index]) - numeric[index]).abs() < 1e-5,
            "{index}: {} {}",
            gradient[index],
            numeric[index]
        );
        // Added after the gradient is rounded to f32, as the runtime's fused kernel adds it.
        assert_eq!(summed[index], gradient[index] + gathered[index], "{index}");
    }
}

#[test]
fn generated_silu_mul_gate_gradient_equals_its_derivative() {
    // d/dg of dy · up · silu(g), by its definition in f64, and by central differences.
    let len = 40;
    let gate: Vec<f32> = values(len, 21).iter().map(|value| 6.0 * value).collect();
    let (up, dy) = (values(len, 22), values(len, 23));
    let program = one_kernel_program(
        Kernel::SiluMulGradGate,
        &[
            ("gate", DType::F32, vec![len as u64]),
            ("up", DType::F32, vec![len as u64]),
            ("dy", DType::F32, vec![len as u64]),
        ],
        vec![len as u64],
    );
    let generated = run_on_host(&program, &[&words(&gate), &words(&up), &words(&dy)], len);
    let silu = |g: f64| g / (1.0 + (-g).exp());
    for index in 0..len {
        let g = f64::from(gate[index]);
        let numeric = (silu(g + 1e-5) - silu(g - 1e-5)) / 2e-5 * f64::from(dy[index]) * f64::from(up[index]);
        assert!((f64::from(generated[index]) - numeric).abs() < 1e-5, "{index}: {} {numeric}", generated[index]);
    }
}

#[test]
fn generated_rope_gradient_is_the_rotation_by_the_opposite_angles() {
    // Two positions out of order, two heads of 6 (three pairs at their own frequencies): each pair
    // (x1, x2) goes to (x1·cos + x2·sin, x2·cos - x1·sin) with the forward's f32 angle.
    let (batch, seq, heads, head_dim) = (2u64, 2u64, 2u64, 6u64);
    let inv_freq = vec![1.0f32, 0.1, 0.01];
    let positions = [7u32, 3];
    let len = (batch * seq * heads * head_dim) as usize;
    let dy = values(len, 31);
    let program = one_kernel_program(
        Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq: inv_freq.clone() },
        &[("dy", DType::F32, vec![batch, seq, heads, head_dim]), ("positions", DType::I32, vec![seq])],
        vec![batch, seq, heads, head_dim],
    );
    let generated = run_on_host(&program, &[&words(&dy), &positions], len);
    let half = (head_dim / 2) as usize;
    for row in 0..(batch * seq * heads) as usize {
        let position = positions[row / heads as usize % seq as usize];
        for (pair, &frequency) in inv_freq.iter().enumerate() {
            let angle = f64::from(position as f32 * frequency);
            let (cos, sin) = (angle.cos(), angle.sin());
            let (first, second) = (row * head_dim as usize + pair, row * head_dim as usize + pair + half);
            let (x1, x2) = (f64::from(dy[first]), f64::from(dy[second]));
            assert!((f64::from(generated[first]) - (x1 * cos + x2 * sin)).abs() < 1e-6, "{row} {pair}");
            assert!((f64::from(generated[second]) - (x2 * cos - x1 * sin)).abs() < 1e-6, "{row} {pair}");
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

/// `program` with every f32 buffer bf16.
fn as_bf16(program: &Program) -> Program {
    let mut program = program.clone();
    for buffer in &mut program.buffers {
        if buffer.dtype == DType::F32 {
            buffer.dtype = DType::Bf16;
        }
    }
    program
}

/// Runs `kernel` of `program` with its float buffers bf16 in memory (`Elements::Declared`) and
/// checks each result bit for bit against the f32 kernel run on the same (widened) values with its
/// results rounded by `half`'s `bf16::from_f32`, the host runtime's bf16 storage. `integers` are
/// the integer operands' values, by operand index; the floats are drawn from `seed`.
fn check_bf16_is_f32_rounded(program: &Program, kernel: &NativeKernel, integers: &[(usize, Vec<u32>)], seed: u64) {
    let (operands, _) = kernel.buffers(program).unwrap();
    let (mut wide, mut narrow) = (Vec::new(), Vec::new());
    for (index, &id) in operands.iter().enumerate() {
        if let Some((_, ids)) = integers.iter().find(|(at, _)| *at == index) {
            let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
            wide.push(bytes.clone());
            narrow.push(bytes);
            continue;
        }
        let values: Vec<half::bf16> = values(program.buffer(id).numel() as usize, seed + index as u64)
            .into_iter()
            .map(|value| half::bf16::from_f32(3.0 * value))
            .collect();
        wide.push(values.iter().flat_map(|value| value.to_f32().to_le_bytes()).collect());
        narrow.push(values.iter().flat_map(|value| value.to_bits().to_le_bytes()).collect());
    }
    let expected = run_kernel(program, kernel, Elements::Declared, &wide);
    let got = run_kernel(&as_bf16(program), kernel, Elements::Declared, &narrow);
    for (result, (expected, got)) in expected.iter().zip(&got).enumerate() {
        let rounded: Vec<u16> = expected
            .chunks_exact(4)
            .map(|bytes| half::bf16::from_f32(f32::from_le_bytes(bytes.try_into().unwrap())).to_bits())
            .collect();
        let got: Vec<u16> = got.chunks_exact(2).map(|bytes| u16::from_le_bytes(bytes.try_into().unwrap())).collect();
        assert_eq!(got, rounded, "{kernel:?} result {result}");
    }
}

#[test]
fn bf16_buffers_are_widened_when_read_and_rounded_to_nearest_even_when_written() {
    let dims = two_heads_on_one_kv_head(3);
    let positions = vec![2, 0, 1];
    let f32_buffer = |name, shape: Vec<u64>| (name, DType::F32, shape);
    let integer = |name, shape: Vec<u64>| (name, DType::I32, shape);
    let single = NativeKernel::Single { instr: 0 };
    // Each program, with its integer operands' values by operand index.
    type Case = (Program, Vec<(usize, Vec<u32>)>);
    // (The fused `Sum` and `RmsNormGradInputAdd` round each partial result as the instructions they
    // replace stored it: `fused_bf16_kernels_round_as_the_instructions_they_replace`.)
    let cases: Vec<Case> = vec![
        (
            one_kernel_program(Kernel::Add, &[f32_buffer("a", vec![4, 8]), f32_buffer("b", vec![4, 8])], vec![4, 8]),
            vec![],
        ),
        (
            one_kernel_program(Kernel::Add, &[f32_buffer("a", vec![4, 8]), f32_buffer("bias", vec![8])], vec![4, 8]),
            vec![],
        ),
        (
            one_kernel_program(Kernel::SiluMul, &[f32_buffer("g", vec![32]), f32_buffer("u", vec![32])], vec![32]),
            vec![],
        ),
        (
            one_kernel_program(
                Kernel::RmsNorm { hidden: 8, eps: 1e-5 },
                &[f32_buffer("x", vec![4, 8]), f32_buffer("w", vec![8])],
                vec![4, 8],
            ),
            vec![],
        ),
        (
            one_kernel_program(
                Kernel::Rope { batch: 1, seq: 3, heads: 2, head_dim: 4, inv_freq: vec![1.0, 0.01] },
                &[f32_buffer("x", vec![1, 3, 2, 4]), integer("positions", vec![3])],
                vec![1, 3, 2, 4],
            ),
            vec![(1, positions.clone())],
        ),
        (
            one_kernel_program(
                Kernel::Attention { dims, with_lse: true },
                &[
                    f32_buffer("q", vec![2, 3, 2, 8]),
                    f32_buffer("k", vec![2, 3, 1, 8]),
                    f32_buffer("v", vec![2, 3, 1, 8]),
                    integer("q_pos", vec![3]),
                    integer("k_pos", vec![3]),
                ],
                vec![2, 3, 2, 9],
            ),
            vec![(3, positions.clone()), (4, positions.clone())],
        ),
        (
            one_kernel_program(
                Kernel::AttentionGrad { wrt: AttentionOperand::Key, dims: two_heads_on_one_kv_head(3) },
                &[
                    f32_buffer("q", vec![2, 3, 2, 8]),
                    f32_buffer("k", vec![2, 3, 1, 8]),
                    f32_buffer("v", vec![2, 3, 1, 8]),
                    integer("q_pos", vec![3]),
                    integer("k_pos", vec![3]),
                    f32_buffer("dy", vec![2, 3, 2, 8]),
                ],
                vec![2, 3, 1, 8],
            ),
            vec![(3, positions.clone()), (4, positions)],
        ),
        (
            one_kernel_program(
                Kernel::EmbeddingGrad { hidden: 8, vocab_offset: 2, vocab_total: 8 },
                &[f32_buffer("dy", vec![6, 8]), integer("tokens", vec![6])],
                vec![5, 8],
            ),
            vec![(1, vec![3, 7, 3, 0, 2, 5])],
        ),
        (
            one_kernel_program(
                Kernel::CrossEntropyGrad { batch: 2, seq: 3, vocab: 8, terms: 4 },
                &[f32_buffer("logits", vec![2, 3, 8]), integer("tokens", vec![2, 3])],
                vec![2, 3, 8],
            ),
            vec![(1, vec![1, 7, 0, 3, 5, 2])],
        ),
        (
            one_kernel_program(
                Kernel::MergeAttention { rows: 3, head_dim: 4 },
                &[f32_buffer("first", vec![3, 5]), f32_buffer("second", vec![3, 5])],
                vec![3, 5],
            ),
            vec![],
        ),
        (
            one_kernel_program(
                Kernel::Embedding { hidden: 8, vocab_offset: 2, vocab_total: 8 },
                &[f32_buffer("table", vec![4, 8]), integer("tokens", vec![1, 5])],
                vec![1, 5, 8],
            ),
            vec![(1, vec![0, 2, 5, 7, 3])],
        ),
        (
            one_kernel_program(
                Kernel::RopeGrad { batch: 1, seq: 3, heads: 2, head_dim: 4, inv_freq: vec![1.0, 0.01] },
                &[f32_buffer("dy", vec![1, 3, 2, 4]), integer("positions", vec![3])],
                vec![1, 3, 2, 4],
            ),
            vec![(1, vec![2, 0, 1])],
        ),
        (
            one_kernel_program(
                Kernel::SiluMulGradGate,
                &[f32_buffer("g", vec![32]), f32_buffer("u", vec![32]), f32_buffer("dy", vec![32])],
                vec![32],
            ),
            vec![],
        ),
    ];
    for (seed, (program, integers)) in cases.iter().enumerate() {
        check_bf16_is_f32_rounded(program, &single, integers, 100 * seed as u64);
    }
}

/// bf16 operands of `count` elements for the seed.
fn bf16_bytes(count: usize, seed: u64) -> Vec<u8> {
    values(count, seed)
        .into_iter()
        .flat_map(|value| half::bf16::from_f32(3.0 * value).to_bits().to_le_bytes())
        .collect()
}

/// The single kernel `kernel` on bf16 operands of `shapes`, into a bf16 result of `out`.
fn bf16_kernel(kernel: Kernel, shapes: &[Vec<u64>], out: Vec<u64>, inputs: &[Vec<u8>]) -> Vec<u8> {
    let operands: Vec<(&str, DType, Vec<u64>)> = shapes.iter().map(|shape| ("x", DType::Bf16, shape.clone())).collect();
    let program = as_bf16(&one_kernel_program(kernel, &operands, out));
    run_kernel(&program, &NativeKernel::Single { instr: 0 }, Elements::Declared, inputs).remove(0)
}

#[test]
fn fused_bf16_kernels_round_as_the_instructions_they_replace() {
    // `passes::fuse` replaces a chain of adds with one `Sum`, and an RMSNorm input gradient and the
    // add after it with one `RmsNormGradInputAdd`; apart, each instruction stores its result in
    // bf16, so the fused kernel rounds each partial result as they did: bit for bit the same.
    let shape = vec![4u64, 8];
    let (a, b, c) = (bf16_bytes(32, 1), bf16_bytes(32, 2), bf16_bytes(32, 3));
    let fused = bf16_kernel(
        Kernel::Sum,
        &[shape.clone(), shape.clone(), shape.clone()],
        shape.clone(),
        &[a.clone(), b.clone(), c.clone()],
    );
    let first = bf16_kernel(Kernel::Add, &[shape.clone(), shape.clone()], shape.clone(), &[a, b]);
    let chained = bf16_kernel(Kernel::Add, &[shape.clone(), shape.clone()], shape.clone(), &[first, c]);
    assert_eq!(fused, chained, "Sum");

    let eps = 1e-5;
    let (x, weight, dy, gathered) = (bf16_bytes(32, 4), bf16_bytes(8, 5), bf16_bytes(32, 6), bf16_bytes(32, 7));
    let norm_shapes = [shape.clone(), vec![8], shape.clone()];
    let fused = bf16_kernel(
        Kernel::RmsNormGradInputAdd { hidden: 8, eps },
        &[shape.clone(), vec![8], shape.clone(), shape.clone()],
        shape.clone(),
        &[x.clone(), weight.clone(), dy.clone(), gathered.clone()],
    );
    let gradient =
        bf16_kernel(Kernel::RmsNormGradInput { hidden: 8, eps }, &norm_shapes, shape.clone(), &[x, weight, dy]);
    let chained = bf16_kernel(Kernel::Add, &[shape.clone(), shape.clone()], shape, &[gradient, gathered]);
    assert_eq!(fused, chained, "RmsNormGradInputAdd");
}

#[test]
fn a_fused_bf16_add_and_norm_normalizes_the_sum_as_stored() {
    // The two kernels apart store the sum rounded and the norm reads that: the fused kernel must
    // too, on a GPU and in the host's native library alike, or its normed output would differ in
    // the last bit.
    let mut fused = crate::native::tests::residual_program();
    crate::native::schedule_for_fusion(&mut fused);
    let pair = NativeKernel::FusedAddRmsNorm { add_instr: 3, norm_instr: 4 };
    assert_eq!(native_kernels(&fused)[0], pair);
    let bf16 =
        |values: Vec<f32>| -> Vec<half::bf16> { values.into_iter().map(|x| half::bf16::from_f32(3.0 * x)).collect() };
    let (a, b, weight) = (bf16(values(16, 1)), bf16(values(16, 2)), bf16(values(8, 3)));
    let as_words = |values: &[half::bf16]| values.iter().flat_map(|x| x.to_f32().to_le_bytes()).collect::<Vec<u8>>();
    let as_halves = |values: &[half::bf16]| values.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect::<Vec<u8>>();
    let round = |bytes: &[u8]| -> Vec<half::bf16> {
        bytes.chunks_exact(4).map(|word| half::bf16::from_f32(f32::from_le_bytes(word.try_into().unwrap()))).collect()
    };
    // The add, then the norm of its rounded sum, each as the f32 kernel and rounded.
    let add = NativeKernel::Single { instr: 3 };
    let sum = round(&run_kernel(&fused, &add, Elements::Declared, &[as_words(&a), as_words(&b)])[0]);
    let norm = NativeKernel::Single { instr: 4 };
    let normed = round(&run_kernel(&fused, &norm, Elements::Declared, &[as_words(&sum), as_words(&weight)])[0]);
    let got =
        run_kernel(&as_bf16(&fused), &pair, Elements::Declared, &[as_halves(&a), as_halves(&b), as_halves(&weight)]);
    assert_eq!(got[0], as_halves(&sum));
    assert_eq!(got[1], as_halves(&normed));
    // The host's native library gets the same buffers widened and returns f32 results, which the
    // runtime rounds as it stores them: the same values.
    let got = run_kernel(&as_bf16(&fused), &pair, Elements::Widened, &[as_words(&a), as_words(&b), as_words(&weight)]);
    assert_eq!(round(&got[0]), sum);
    assert_eq!(round(&got[1]), normed);
}

#[test]
fn bf16_rounding_is_halfs_on_ties_overflow_and_nan() {
    // Each case goes through `a + 0` from f32 operands into a bf16 result.
    let program =
        one_kernel_program(Kernel::Add, &[("a", DType::F32, vec![10]), ("zero", DType::F32, vec![10])], vec![10]);
    let mut narrow_out = as_bf16(&program);
    // Inputs stay f32; only the result is bf16.
    narrow_out.buffers[0].dtype = DType::F32;
    narrow_out.buffers[1].dtype = DType::F32;
    let cases: [f32; 10] = [
        f32::from_bits(0x3f80_8000), // a tie, even below: stays
        f32::from_bits(0x3f81_8000), // a tie, odd below: up
        f32::from_bits(0x3f80_8001), // past the tie: up
        f32::from_bits(0x3f80_7fff), // below the tie: down
        f32::MAX,                    // rounds up to infinity
        f32::from_bits(0x7f80_0001), // a signalling NaN: quieted
        f32::from_bits(0xffc1_2345), // a negative NaN
        -0.0,
        f32::from_bits(0x0000_8001), // a subnormal past the tie
        f32::INFINITY,
    ];
    let words: Vec<u8> = cases.iter().flat_map(|x| x.to_le_bytes()).collect();
    let zeros = vec![0u8; 40];
    let got = run_kernel(&narrow_out, &NativeKernel::Single { instr: 0 }, Elements::Declared, &[words, zeros]);
    let got: Vec<u16> = got[0].chunks_exact(2).map(|bytes| u16::from_le_bytes(bytes.try_into().unwrap())).collect();
    // x + 0 is x (-0 + 0 is +0), then `half`'s rounding.
    let expected: Vec<u16> = cases.iter().map(|&x| half::bf16::from_f32(x + 0.0).to_bits()).collect();
    assert_eq!(got, expected);
    assert_eq!(&got[..5], &[0x3f80, 0x3f82, 0x3f81, 0x3f80, 0x7f80]);
}
