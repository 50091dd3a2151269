//! The readable form of a `Program` (`rank<i>.txt`): one line a buffer, then one line an instruction.

use std::fmt::Write;

use pleat_ir::entity::EntityRef;

use crate::program::{
    AttentionDims, AttentionOperand, BufferId, Instr, Kernel, MoeDims, Program, RouterDims, TransferStream,
};

/// An attention kernel's sizes and head mapping, as the text form lists them.
fn attention_dims_text(dims: &AttentionDims) -> String {
    let AttentionDims { batch, sq, sk, hq, hkv, head_dim, q_head_offset, kv_head_offset, group, causal, .. } = dims;
    format!(
        "batch={batch} sq={sq} sk={sk} hq={hq} hkv={hkv} head_dim={head_dim} q_head_offset={q_head_offset} \
         kv_head_offset={kv_head_offset} group={group} causal={causal}"
    )
}

/// A transfer's stream, after its group: nothing for the main stream.
fn stream_text(stream: TransferStream) -> &'static str {
    match stream {
        TransferStream::Main => "",
        TransferStream::Prefetch => " on prefetch",
    }
}

fn region_text(region: &[(u64, u64)]) -> String {
    let dims: Vec<String> = region.iter().map(|(start, len)| format!("{start}..{}", start + len)).collect();
    format!("[{}]", dims.join(", "))
}

fn list(buffers: &[BufferId]) -> String {
    buffers.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

fn kernel_text(kernel: &Kernel) -> String {
    match kernel {
        Kernel::Embedding { hidden, vocab_offset, vocab_total } => {
            format!("embedding hidden={hidden} vocab_offset={vocab_offset} vocab_total={vocab_total}")
        }
        Kernel::RmsNorm { hidden, eps } => format!("rms_norm hidden={hidden} eps={eps}"),
        Kernel::MatMul { m, n, k } => format!("matmul m={m} n={n} k={k}"),
        Kernel::Rope { batch, seq, heads, head_dim, .. } => {
            format!("rope batch={batch} seq={seq} heads={heads} head_dim={head_dim}")
        }
        Kernel::Attention { dims, with_lse } => {
            let lse = if *with_lse { " with_lse" } else { "" };
            format!("attention {}{lse}", attention_dims_text(dims))
        }
        Kernel::MergeAttention { rows, head_dim } => format!("merge_attention rows={rows} head_dim={head_dim}"),
        Kernel::SiluMul => "silu_mul".to_string(),
        Kernel::ExpertCounts { dims, top_k, scale } => {
            format!("expert_counts {} top_k={top_k} scale={scale}", router_dims_text(dims))
        }
        Kernel::RouterProbSum { dims } => format!("router_prob_sum {}", router_dims_text(dims)),
        Kernel::RouterProbSumGrad { wrt, dims } => {
            format!("router_prob_sum_grad_{} {}", wrt.as_str(), router_dims_text(dims))
        }
        Kernel::LoadBalancingLoss { experts } => format!("load_balancing_loss experts={experts}"),
        Kernel::SigmoidScale { hidden } => format!("sigmoid_scale hidden={hidden}"),
        Kernel::SigmoidScaleGradGate { hidden } => format!("sigmoid_scale_grad_gate hidden={hidden}"),
        Kernel::Add => "add".to_string(),
        Kernel::Sum => "sum".to_string(),
        Kernel::CrossEntropy { batch, seq, vocab, terms } => {
            format!("cross_entropy batch={batch} seq={seq} vocab={vocab} terms={terms}")
        }
        Kernel::CrossEntropyGrad { batch, seq, vocab, terms } => {
            format!("cross_entropy_grad batch={batch} seq={seq} vocab={vocab} terms={terms}")
        }
        Kernel::LossRowStats { batch, seq, vocab, vocab_offset, global_vocab } => format!(
            "loss_row_stats batch={batch} seq={seq} vocab={vocab} vocab_offset={vocab_offset} global_vocab={global_vocab}"
        ),
        Kernel::CrossEntropyFromStats { batch, seq, global_vocab, terms, parts } => format!(
            "cross_entropy_from_stats batch={batch} seq={seq} global_vocab={global_vocab} terms={terms} parts={parts}"
        ),
        Kernel::CrossEntropyGradFromStats { batch, seq, vocab, vocab_offset, global_vocab, terms, parts } => format!(
            "cross_entropy_grad_from_stats batch={batch} seq={seq} vocab={vocab} vocab_offset={vocab_offset} \
             global_vocab={global_vocab} terms={terms} parts={parts}"
        ),
        Kernel::MatMulGradInput { m, n, k } => format!("matmul_grad_input m={m} n={n} k={k}"),
        Kernel::MatMulGradWeight { m, n, k } => format!("matmul_grad_weight m={m} n={n} k={k}"),
        Kernel::RmsNormGradInput { hidden, eps } => format!("rms_norm_grad_input hidden={hidden} eps={eps}"),
        Kernel::RmsNormGradInputAdd { hidden, eps } => format!("rms_norm_grad_input_add hidden={hidden} eps={eps}"),
        Kernel::RmsNormGradWeight { hidden, eps } => format!("rms_norm_grad_weight hidden={hidden} eps={eps}"),
        Kernel::RopeGrad { batch, seq, heads, head_dim, .. } => {
            format!("rope_grad batch={batch} seq={seq} heads={heads} head_dim={head_dim}")
        }
        Kernel::AttentionGrad { wrt, dims } => {
            let wrt = match wrt {
                AttentionOperand::Query => "query",
                AttentionOperand::Key => "key",
                AttentionOperand::Value => "value",
            };
            format!("attention_grad_{wrt} {}", attention_dims_text(dims))
        }
        Kernel::SiluMulGradGate => "silu_mul_grad_gate".to_string(),
        Kernel::MoeMlp { dims } => format!("moe_mlp {}", moe_dims_text(dims)),
        Kernel::MoeMlpGrad { wrt, dims } => format!("moe_mlp_grad_{} {}", wrt.as_str(), moe_dims_text(dims)),
        Kernel::EmbeddingGrad { hidden, vocab_offset, vocab_total } => {
            format!("embedding_grad hidden={hidden} vocab_offset={vocab_offset} vocab_total={vocab_total}")
        }
        Kernel::SumLeading { width } => format!("sum_leading width={width}"),
        Kernel::Zeros => "zeros".to_string(),
        Kernel::Slice { region, .. } => format!("slice {}", region_text(region)),
        Kernel::Permute { dim, .. } => format!("permute dim={dim}"),
    }
}

/// The program as text.
pub fn print_program(program: &Program) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "; program {} rank {} of {} mesh={} format={}",
        program.model, program.rank, program.world_size, program.mesh, program.format_version
    );
    for (index, buffer) in program.buffers.iter().enumerate() {
        let shape: Vec<String> = buffer.shape.iter().map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "{}: {}[{}] {:?} {}   ; {} bytes",
            BufferId::new(index),
            buffer.dtype,
            shape.join(", "),
            buffer.kind,
            buffer.name,
            buffer.bytes()
        );
    }
    for instr in &program.instructions {
        let line = match instr {
            Instr::LoadParam { out, name, region, .. } => {
                format!("{out} = load_param \"{name}\" {}", region_text(region))
            }
            Instr::LoadTokens { out, region } => format!("{out} = load_tokens {}", region_text(region)),
            Instr::LoadPositions { out, region } => format!("{out} = load_positions {}", region_text(region)),
            Instr::Kernel { kernel, inputs, out } => format!("{out} = {}({})", kernel_text(kernel), list(inputs)),
            Instr::AllReduce { inputs, outs, group } => {
                format!("{} = all_reduce({}) {}{:?}", list(outs), list(inputs), group.axis, group.ranks)
            }
            Instr::ReduceScatter { inputs, outs, group, dims } => {
                let dims = dims.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
                format!("{} = reduce_scatter({}) dim={dims} {}{:?}", list(outs), list(inputs), group.axis, group.ranks)
            }
            Instr::AllGather { input, out, group, dim, stream } => {
                format!("{out} = all_gather({input}) dim={dim} {}{:?}{}", group.axis, group.ranks, stream_text(*stream))
            }
            Instr::AllToAll { input, out, group, split_dim, gather_dim } => format!(
                "{out} = all_to_all({input}) split_dim={split_dim} gather_dim={gather_dim} {}{:?}",
                group.axis, group.ranks
            ),
            Instr::Output { buf, index, region, .. } => format!("output {index} = {buf} {}", region_text(region)),
            Instr::Free { buf } => format!("free {buf}"),
            Instr::Broadcast { inputs, outs, group, root, stream } => format!(
                "{} = broadcast({}) root={root} {}{:?}{}",
                list(outs),
                list(inputs),
                group.axis,
                group.ranks,
                stream_text(*stream)
            ),
            Instr::Send { bufs, peer } => format!("send({}) to rank {peer}", list(bufs)),
            Instr::Recv { outs, peer } => format!("{} = recv from rank {peer}", list(outs)),
            Instr::Relay { outs, from, to } => format!("{} = relay from rank {from} to rank {to}", list(outs)),
            Instr::Wait { handle } => format!("wait({})", list(handle)),
            Instr::ExpertDispatch { inputs, outs, wrts, group, dims } => {
                let what = match wrts.as_slice() {
                    [] => "expert_dispatch".to_string(),
                    wrts => {
                        let names: Vec<&str> = wrts.iter().map(|wrt| wrt.as_str()).collect();
                        format!("expert_dispatch_grad[{}]", names.join(","))
                    }
                };
                format!(
                    "{} = {what}({}) {} {}{:?}",
                    list(outs),
                    list(inputs),
                    moe_dims_text(dims),
                    group.axis,
                    group.ranks
                )
            }
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

fn router_dims_text(RouterDims { rows, hidden, experts }: &RouterDims) -> String {
    format!("rows={rows} hidden={hidden} experts={experts}")
}

fn moe_dims_text(dims: &MoeDims) -> String {
    let MoeDims { rows, hidden, experts, local_experts, expert_offset, ffn, top_k, normalize } = dims;
    format!(
        "rows={rows} hidden={hidden} experts={experts} local_experts={local_experts} expert_offset={expert_offset} \
         ffn={ffn} top_k={top_k} normalize={normalize}"
    )
}
