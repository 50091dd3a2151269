//! The `pleat_rt_*` functions that run one instruction each (see `crate::capi` for the discipline and
//! `pleat_backend::native::abi::runtime_call` for the argument order): each rebuilds its instruction
//! from the call's constants and runs it through the executor's step.
//!
//! Every function shares one safety contract: `ctx` is the context the entry function received, and
//! each pointer argument points to its count of initialized elements (or the count is 0).

use std::ffi::c_void;

use super::*;

/// Reads `region` of checkpoint tensor `name` (global `shape`) into `out`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_load_param(
    ctx: *mut c_void,
    instr: u64,
    out: u32,
    name: *const u8,
    name_length: u64,
    shape: *const u64,
    shape_count: u64,
    region_data: *const u64,
    region_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::LoadParam {
                out: buffer(out),
                name: text(name, name_length),
                shape: slice(shape, shape_count).to_vec(),
                region: region(region_data, region_count),
            })
        })
    }
}

/// Reads the rank's block of the token ids into `out`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_load_tokens(
    ctx: *mut c_void,
    instr: u64,
    out: u32,
    region_data: *const u64,
    region_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::LoadTokens { out: buffer(out), region: region(region_data, region_count) })
        })
    }
}

/// Reads the rank's block of the positions into `out`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_load_positions(
    ctx: *mut c_void,
    instr: u64,
    out: u32,
    region_data: *const u64,
    region_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::LoadPositions { out: buffer(out), region: region(region_data, region_count) })
        })
    }
}

/// Sums each of `inputs` over the group into the matching `outs` (several: one bucket).
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_all_reduce(
    ctx: *mut c_void,
    instr: u64,
    inputs: *const u32,
    input_count: u64,
    outs: *const u32,
    out_count: u64,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::AllReduce {
                inputs: buffers(inputs, input_count),
                outs: buffers(outs, out_count),
                group: group(axis, axis_length, ranks, rank_count),
            })
        })
    }
}

/// Sums `input` over the group and keeps this rank's block of dim `dim` in `out`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_reduce_scatter(
    ctx: *mut c_void,
    instr: u64,
    inputs: *const u32,
    input_count: u64,
    outs: *const u32,
    out_count: u64,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
    dims: *const u64,
    dim_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::ReduceScatter {
                inputs: buffers(inputs, input_count),
                outs: buffers(outs, out_count),
                group: group(axis, axis_length, ranks, rank_count),
                dims: slice(dims, dim_count).iter().map(|&dim| dim as usize).collect(),
            })
        })
    }
}

/// Concatenates the group's blocks of dim `dim` into `out`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_all_gather(
    ctx: *mut c_void,
    instr: u64,
    input: u32,
    out: u32,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
    dim: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::AllGather {
                input: buffer(input),
                out: buffer(out),
                group: group(axis, axis_length, ranks, rank_count),
                dim: dim as usize,
                // The ABI carries no stream; the runtime runs the program's own instruction,
                // which names it (`RankContext::run_instruction`).
                stream: TransferStream::Main,
            })
        })
    }
}

/// Re-splits `input` over the group from dim `gather_dim` to dim `split_dim`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_all_to_all(
    ctx: *mut c_void,
    instr: u64,
    input: u32,
    out: u32,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
    split_dim: u64,
    gather_dim: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::AllToAll {
                input: buffer(input),
                out: buffer(out),
                group: group(axis, axis_length, ranks, rank_count),
                split_dim: split_dim as usize,
                gather_dim: gather_dim as usize,
            })
        })
    }
}

/// Every member of the group receives the root's `inputs` into `outs`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_broadcast(
    ctx: *mut c_void,
    instr: u64,
    inputs: *const u32,
    input_count: u64,
    outs: *const u32,
    out_count: u64,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
    root: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::Broadcast {
                inputs: buffers(inputs, input_count),
                outs: buffers(outs, out_count),
                group: group(axis, axis_length, ranks, rank_count),
                root: root as usize,
                stream: TransferStream::Main,
            })
        })
    }
}

/// The mixture of experts dispatched over the group (`Instr::ExpertDispatch`): the operands, the
/// results, the operands differentiated (0 x, 1 router, 2 gate, 3 up, 4 down; none for the
/// forward), the group, then `MoeDims` in order.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_expert_dispatch(
    ctx: *mut c_void,
    instr: u64,
    inputs: *const u32,
    input_count: u64,
    outs: *const u32,
    out_count: u64,
    wrts: *const u64,
    wrt_count: u64,
    axis: *const u8,
    axis_length: u64,
    ranks: *const u32,
    rank_count: u64,
    rows: u64,
    hidden: u64,
    experts: u64,
    local_experts: u64,
    expert_offset: u64,
    ffn: u64,
    top_k: u64,
    normalize: u64,
) -> i32 {
    let dims = MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, normalize: normalize != 0 };
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            let wrts = slice(wrts, wrt_count)
                .iter()
                .map(|&wrt| pleat_ir::MoeOperand::at(usize::try_from(wrt).ok()?))
                .collect::<Option<Vec<_>>>()?;
            Some(Instr::ExpertDispatch {
                inputs: buffers(inputs, input_count),
                outs: buffers(outs, out_count),
                wrts,
                group: group(axis, axis_length, ranks, rank_count),
                dims,
            })
        })
    }
}

/// Starts sending `bufs`, packed, to rank `peer`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_send(ctx: *mut c_void, instr: u64, bufs: *const u32, count: u64, peer: u64) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::Send { bufs: buffers(bufs, count), peer: u32::try_from(peer).unwrap_or(u32::MAX) })
        })
    }
}

/// Waits for rank `peer`'s message and unpacks it into `outs`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_recv(ctx: *mut c_void, instr: u64, outs: *const u32, count: u64, peer: u64) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::Recv { outs: buffers(outs, count), peer: u32::try_from(peer).unwrap_or(u32::MAX) })
        })
    }
}

/// Waits for rank `from`'s message, unpacks it into `outs`, and passes it on to rank `to`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_relay(
    ctx: *mut c_void,
    instr: u64,
    outs: *const u32,
    count: u64,
    from: u64,
    to: u64,
) -> i32 {
    let rank = |peer: u64| u32::try_from(peer).unwrap_or(u32::MAX);
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || Some(Instr::Relay { outs: buffers(outs, count), from: rank(from), to: rank(to) }))
    }
}

/// Hands `buf`, block `region` of graph output `index` (global `shape`), to the caller.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_output(
    ctx: *mut c_void,
    instr: u64,
    buf: u32,
    index: u64,
    shape: *const u64,
    shape_count: u64,
    region_data: *const u64,
    region_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::Output {
                buf: buffer(buf),
                index: u32::try_from(index).unwrap_or(u32::MAX),
                shape: slice(shape, shape_count).to_vec(),
                region: region(region_data, region_count),
            })
        })
    }
}

/// Releases `buf`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_free(ctx: *mut c_void, instr: u64, buf: u32) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(Instr::Free { buf: buffer(buf) })) }
}

/// Waits for the transfer named by `handle`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_wait(ctx: *mut c_void, instr: u64, handle: *const u32, count: u64) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe { instruction(ctx, instr, || Some(Instr::Wait { handle: buffers(handle, count) })) }
}

/// `Kernel::Embedding`: rows of `table` for `tokens`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_embedding(
    ctx: *mut c_void,
    instr: u64,
    table: u32,
    tokens: u32,
    out: u32,
    hidden: u64,
    vocab_offset: u64,
    vocab_total: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::Embedding { hidden, vocab_offset, vocab_total }, &[table, tokens], out))
        })
    }
}

/// `Kernel::RmsNorm`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rms_norm(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    weight: u32,
    out: u32,
    hidden: u64,
    eps: f64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::RmsNorm { hidden, eps }, &[x, weight], out))) }
}

/// `Kernel::MatMul`: `out[m, n] = x[m, k] · w[n, k]ᵀ`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_matmul(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    w: u32,
    out: u32,
    m: u64,
    n: u64,
    k: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::MatMul { m, n, k }, &[x, w], out))) }
}

/// `Kernel::Rope` with `inv_freq_count` inverse frequencies.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rope(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    positions: u32,
    out: u32,
    batch: u64,
    seq: u64,
    heads: u64,
    head_dim: u64,
    inv_freq: *const f32,
    inv_freq_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::Rope { batch, seq, heads, head_dim, inv_freq: slice(inv_freq, inv_freq_count).to_vec() },
                &[x, positions],
                out,
            ))
        })
    }
}

/// `Kernel::Attention` (sizes in `AttentionDims` order).
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_attention(
    ctx: *mut c_void,
    instr: u64,
    q: u32,
    k: u32,
    v: u32,
    q_pos: u32,
    k_pos: u32,
    out: u32,
    batch: u64,
    sq: u64,
    sk: u64,
    hq: u64,
    hkv: u64,
    head_dim: u64,
    q_head_offset: u64,
    kv_head_offset: u64,
    group: u64,
    causal: u32,
    scale: f32,
    with_lse: u32,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::Attention {
                    dims: AttentionDims {
                        batch,
                        sq,
                        sk,
                        hq,
                        hkv,
                        head_dim,
                        q_head_offset,
                        kv_head_offset,
                        group,
                        causal: causal != 0,
                        scale,
                    },
                    with_lse: with_lse != 0,
                },
                &[q, k, v, q_pos, k_pos],
                out,
            ))
        })
    }
}

/// `Kernel::MergeAttention`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_merge_attention(
    ctx: *mut c_void,
    instr: u64,
    a: u32,
    b: u32,
    out: u32,
    rows: u64,
    head_dim: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::MergeAttention { rows, head_dim }, &[a, b], out))) }
}

/// `Kernel::SiluMul`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_silu_mul(ctx: *mut c_void, instr: u64, gate: u32, up: u32, out: u32) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::SiluMul, &[gate, up], out))) }
}

/// `Kernel::SigmoidScale`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_sigmoid_scale(
    ctx: *mut c_void,
    instr: u64,
    gate: u32,
    y: u32,
    out: u32,
    hidden: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::SigmoidScale { hidden }, &[gate, y], out))) }
}

/// `Kernel::SigmoidScaleGradGate`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_sigmoid_scale_grad_gate(
    ctx: *mut c_void,
    instr: u64,
    gate: u32,
    y: u32,
    dy: u32,
    out: u32,
    hidden: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::SigmoidScaleGradGate { hidden }, &[gate, y, dy], out))) }
}

/// `Kernel::ExpertCounts`: `RouterDims` in order, `top_k`, `scale`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_expert_counts(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    router: u32,
    out: u32,
    rows: u64,
    hidden: u64,
    experts: u64,
    top_k: u64,
    scale: f64,
) -> i32 {
    let dims = RouterDims { rows, hidden, experts };
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::ExpertCounts { dims, top_k, scale }, &[x, router], out))) }
}

/// `Kernel::RouterProbSum`: `RouterDims` in order.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_router_prob_sum(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    router: u32,
    out: u32,
    rows: u64,
    hidden: u64,
    experts: u64,
) -> i32 {
    let dims = RouterDims { rows, hidden, experts };
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::RouterProbSum { dims }, &[x, router], out))) }
}

/// `Kernel::RouterProbSumGrad`: `wrt` (0 x, 1 router), then `RouterDims` in order.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_router_prob_sum_grad(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    router: u32,
    dy: u32,
    out: u32,
    wrt: u64,
    rows: u64,
    hidden: u64,
    experts: u64,
) -> i32 {
    let dims = RouterDims { rows, hidden, experts };
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            let wrt = pleat_ir::MoeOperand::at(usize::try_from(wrt).ok()?)?;
            Some(kernel(Kernel::RouterProbSumGrad { wrt, dims }, &[x, router, dy], out))
        })
    }
}

/// `Kernel::LoadBalancingLoss`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_load_balancing_loss(
    ctx: *mut c_void,
    instr: u64,
    counts: u32,
    probabilities: u32,
    out: u32,
    experts: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || Some(kernel(Kernel::LoadBalancingLoss { experts }, &[counts, probabilities], out)))
    }
}

/// `Kernel::Add`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_add(ctx: *mut c_void, instr: u64, a: u32, b: u32, out: u32) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::Add, &[a, b], out))) }
}

/// `Kernel::Sum` over the `count` buffers at `inputs`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_sum(ctx: *mut c_void, instr: u64, inputs: *const u32, count: u64, out: u32) -> i32 {
    // SAFETY: the module's contract; the pointer is read with its count.
    unsafe {
        instruction(ctx, instr, || {
            Some(Instr::Kernel { kernel: Kernel::Sum, inputs: buffers(inputs, count), out: buffer(out) })
        })
    }
}

/// `Kernel::Permute`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_permute(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    out: u32,
    shape: *const u64,
    shape_count: u64,
    dim: u64,
    order: *const u64,
    order_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::Permute {
                    shape: slice(shape, shape_count).to_vec(),
                    dim: dim as usize,
                    order: slice(order, order_count).to_vec(),
                },
                &[x],
                out,
            ))
        })
    }
}

/// `Kernel::Zeros`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_zeros(ctx: *mut c_void, instr: u64, out: u32) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::Zeros, &[], out))) }
}

/// `Kernel::Slice`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_slice(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    out: u32,
    shape: *const u64,
    shape_count: u64,
    region_data: *const u64,
    region_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::Slice { shape: slice(shape, shape_count).to_vec(), region: region(region_data, region_count) },
                &[x],
                out,
            ))
        })
    }
}

/// `Kernel::CrossEntropy`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_cross_entropy(
    ctx: *mut c_void,
    instr: u64,
    logits: u32,
    tokens: u32,
    out: u32,
    batch: u64,
    seq: u64,
    vocab: u64,
    terms: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::CrossEntropy { batch, seq, vocab, terms }, &[logits, tokens], out))
        })
    }
}

/// `Kernel::CrossEntropyGrad`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_cross_entropy_grad(
    ctx: *mut c_void,
    instr: u64,
    logits: u32,
    tokens: u32,
    out: u32,
    batch: u64,
    seq: u64,
    vocab: u64,
    terms: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::CrossEntropyGrad { batch, seq, vocab, terms }, &[logits, tokens], out))
        })
    }
}

/// `Kernel::LossRowStats`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_loss_row_stats(
    ctx: *mut c_void,
    instr: u64,
    logits: u32,
    tokens: u32,
    out: u32,
    batch: u64,
    seq: u64,
    vocab: u64,
    vocab_offset: u64,
    global_vocab: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::LossRowStats { batch, seq, vocab, vocab_offset, global_vocab }, &[logits, tokens], out))
        })
    }
}

/// `Kernel::CrossEntropyFromStats`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_cross_entropy_from_stats(
    ctx: *mut c_void,
    instr: u64,
    tokens: u32,
    stats: u32,
    out: u32,
    batch: u64,
    seq: u64,
    global_vocab: u64,
    terms: u64,
    parts: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::CrossEntropyFromStats { batch, seq, global_vocab, terms, parts },
                &[tokens, stats],
                out,
            ))
        })
    }
}

/// `Kernel::CrossEntropyGradFromStats`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_cross_entropy_grad_from_stats(
    ctx: *mut c_void,
    instr: u64,
    logits: u32,
    tokens: u32,
    stats: u32,
    out: u32,
    batch: u64,
    seq: u64,
    vocab: u64,
    vocab_offset: u64,
    global_vocab: u64,
    terms: u64,
    parts: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::CrossEntropyGradFromStats { batch, seq, vocab, vocab_offset, global_vocab, terms, parts },
                &[logits, tokens, stats],
                out,
            ))
        })
    }
}

/// `Kernel::MatMulGradInput`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_matmul_grad_input(
    ctx: *mut c_void,
    instr: u64,
    dy: u32,
    w: u32,
    out: u32,
    m: u64,
    n: u64,
    k: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::MatMulGradInput { m, n, k }, &[dy, w], out))) }
}

/// `Kernel::MatMulGradWeight`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_matmul_grad_weight(
    ctx: *mut c_void,
    instr: u64,
    dy: u32,
    x: u32,
    out: u32,
    m: u64,
    n: u64,
    k: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::MatMulGradWeight { m, n, k }, &[dy, x], out))) }
}

/// `Kernel::RmsNormGradInput`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rms_norm_grad_input(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    weight: u32,
    dy: u32,
    out: u32,
    hidden: u64,
    eps: f64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::RmsNormGradInput { hidden, eps }, &[x, weight, dy], out))) }
}

/// `Kernel::RmsNormGradInputAdd`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rms_norm_grad_input_add(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    weight: u32,
    dy: u32,
    acc: u32,
    out: u32,
    hidden: u64,
    eps: f64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::RmsNormGradInputAdd { hidden, eps }, &[x, weight, dy, acc], out))
        })
    }
}

/// `Kernel::RmsNormGradWeight`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rms_norm_grad_weight(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    dy: u32,
    out: u32,
    hidden: u64,
    eps: f64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::RmsNormGradWeight { hidden, eps }, &[x, dy], out))) }
}

/// `Kernel::RopeGrad`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_rope_grad(
    ctx: *mut c_void,
    instr: u64,
    dy: u32,
    positions: u32,
    out: u32,
    batch: u64,
    seq: u64,
    heads: u64,
    head_dim: u64,
    inv_freq: *const f32,
    inv_freq_count: u64,
) -> i32 {
    // SAFETY: the module's contract; the pointers are read with their counts.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(
                Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq: slice(inv_freq, inv_freq_count).to_vec() },
                &[dy, positions],
                out,
            ))
        })
    }
}

/// `Kernel::AttentionGrad`: `wrt` 0 (query), 1 (key) or 2 (value), then the sizes.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_attention_grad(
    ctx: *mut c_void,
    instr: u64,
    q: u32,
    k: u32,
    v: u32,
    q_pos: u32,
    k_pos: u32,
    dy: u32,
    out: u32,
    wrt: u64,
    batch: u64,
    sq: u64,
    sk: u64,
    hq: u64,
    hkv: u64,
    head_dim: u64,
    q_head_offset: u64,
    kv_head_offset: u64,
    group: u64,
    causal: u32,
    scale: f32,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            attention_operand(wrt).map(|wrt| {
                kernel(
                    Kernel::AttentionGrad {
                        wrt,
                        dims: AttentionDims {
                            batch,
                            sq,
                            sk,
                            hq,
                            hkv,
                            head_dim,
                            q_head_offset,
                            kv_head_offset,
                            group,
                            causal: causal != 0,
                            scale,
                        },
                    },
                    &[q, k, v, q_pos, k_pos, dy],
                    out,
                )
            })
        })
    }
}

/// `Kernel::SiluMulGradGate`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_silu_mul_grad_gate(
    ctx: *mut c_void,
    instr: u64,
    gate: u32,
    up: u32,
    dy: u32,
    out: u32,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::SiluMulGradGate, &[gate, up, dy], out))) }
}

/// `Kernel::MoeMlp`: the operands, the result, then `MoeDims` in order (`normalize` 0 or 1).
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_moe_mlp(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    router: u32,
    gate: u32,
    up: u32,
    down: u32,
    out: u32,
    rows: u64,
    hidden: u64,
    experts: u64,
    local_experts: u64,
    expert_offset: u64,
    ffn: u64,
    top_k: u64,
    normalize: u64,
) -> i32 {
    let dims = MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, normalize: normalize != 0 };
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::MoeMlp { dims }, &[x, router, gate, up, down], out))) }
}

/// `Kernel::MoeMlpGrad`: `wrt` the operand's index (0 x, 1 router, 2 gate, 3 up, 4 down), then
/// `MoeDims` in order.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_moe_mlp_grad(
    ctx: *mut c_void,
    instr: u64,
    x: u32,
    router: u32,
    gate: u32,
    up: u32,
    down: u32,
    dy: u32,
    out: u32,
    wrt: u64,
    rows: u64,
    hidden: u64,
    experts: u64,
    local_experts: u64,
    expert_offset: u64,
    ffn: u64,
    top_k: u64,
    normalize: u64,
) -> i32 {
    let dims = MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, normalize: normalize != 0 };
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            let wrt = pleat_ir::MoeOperand::at(usize::try_from(wrt).ok()?)?;
            Some(kernel(Kernel::MoeMlpGrad { wrt, dims }, &[x, router, gate, up, down, dy], out))
        })
    }
}

/// `Kernel::EmbeddingGrad`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_embedding_grad(
    ctx: *mut c_void,
    instr: u64,
    dy: u32,
    tokens: u32,
    out: u32,
    hidden: u64,
    vocab_offset: u64,
    vocab_total: u64,
) -> i32 {
    // SAFETY: the module's contract.
    unsafe {
        instruction(ctx, instr, || {
            Some(kernel(Kernel::EmbeddingGrad { hidden, vocab_offset, vocab_total }, &[dy, tokens], out))
        })
    }
}

/// `Kernel::SumLeading`.
///
/// # Safety
/// See the module's contract.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pleat_rt_sum_leading(ctx: *mut c_void, instr: u64, x: u32, out: u32, width: u64) -> i32 {
    // SAFETY: the module's contract.
    unsafe { instruction(ctx, instr, || Some(kernel(Kernel::SumLeading { width }, &[x], out))) }
}

/// `AttentionGrad`'s operand from its number; `None` for a number that names none.
fn attention_operand(wrt: u64) -> Option<AttentionOperand> {
    match wrt {
        0 => Some(AttentionOperand::Query),
        1 => Some(AttentionOperand::Key),
        2 => Some(AttentionOperand::Value),
        _ => None,
    }
}
