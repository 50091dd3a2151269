//! Compute: a roofline per op class, model FLOPs a step, and MFU.
//!
//! Each op's time is `max(flops / (peak · efficiency), bytes / (HBM bandwidth · efficiency))`,
//! with the efficiency of its class ([`super::hw::Efficiency`]). A layer's forward on one rank:
//! - the matrices: `2·n·W/tp` FLOPs for the `n` tokens the rank holds (tsp moves weights to the
//!   tokens, so every shard meets the rank's tokens once: no division by tsp), reading the weights
//!   and the activations once;
//! - causal attention: `2·n·s·h_q/tp` FLOPs (`QKᵀ` and `AV` at 2 FLOPs a multiply-add over the
//!   `s/2` keys a query sees on average, which zigzag balances across ranks);
//! - the memory-bound ops (two norms, rope, the gated activation, two residual adds), by bytes;
//! - a mixture of experts' block, two more ops: its matrices, the router on every token
//!   (`2·n·h·E`, whole on every tp rank) and, under balanced routing, the `top_k` experts of each
//!   token (`top_k·6·n·h·f_e/tp`: gate, up and down), reading the rank's `E/ep` experts once; and
//!   its memory-bound ops (the router's softmax, the experts' gated activation, the weighted
//!   combine). Its shared expert, if any, is the dense MLP above.
//!
//! The backward costs twice the forward; full recompute adds one forward, selective recompute the
//! attention core. Model FLOPs (what MFU counts, recompute excluded) follow PaLM (Chowdhery et al.
//! 2022, appendix B): `6·N` a token for the `N` matmul parameters (for a mixture of experts the
//! active ones: the router and `top_k` experts a layer, [`ModelShape::matmul_params`]) plus
//! `12·L·h_q·s` a token for attention (forward and backward, scores and values, without the causal
//! halving), the same
//! count as Megatron's `72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L))` (Narayanan et al. 2021, eq. 3)
//! for a GPT with f = 4h, without recompute. For the causal decoders pleat compiles, the estimate
//! halves the attention term, as Megatron-LM's current `num_floating_point_operations` does for
//! causal self-attention: the compute model times causal attention at half the FLOPs, and counting
//! the full term in MFU would let MFU pass 100% at long sequences.

use pleat_ir::AxisName;

use super::activation::local_tokens;
use super::hw::HardwareSpec;
use super::layout::Layout;
use super::model::ModelShape;
use super::workload::{Mode, Recompute, Workload};

/// The classes of ops, each with its own efficiency.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum OpClass {
    /// GEMMs.
    MatMul,
    /// Fused (flash) attention.
    Attention,
    /// Elementwise and reductions.
    MemoryBound,
}

/// FLOPs and bytes of one op (or one class of ops) and its roofline time.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OpCost {
    /// What it is.
    pub what: &'static str,
    /// Its class.
    pub class: OpClass,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written in HBM.
    pub bytes: f64,
}

impl OpCost {
    /// Seconds on `hw` for elements of `dtype_bytes`: the roofline's max of compute and memory.
    pub fn time(&self, hw: &HardwareSpec, dtype_bytes: u64) -> f64 {
        let efficiency = match self.class {
            OpClass::MatMul => hw.efficiency.matmul,
            OpClass::Attention => hw.efficiency.attention,
            OpClass::MemoryBound => hw.efficiency.memory_bound,
        };
        let compute = self.flops / (hw.peak_flops(dtype_bytes) * efficiency);
        let memory = self.bytes / (hw.hbm_bytes_per_s * hw.efficiency.memory_bound);
        compute.max(memory)
    }
}

/// The ops of one layer's forward pass on one rank, for one micro-batch.
pub fn layer_forward_ops(model: &ModelShape, layout: &Layout, workload: &Workload) -> Vec<OpCost> {
    let tokens = local_tokens(layout, workload);
    let tp = layout.degree(AxisName::Tp) as f64;
    let element = model.dtype_bytes as f64;
    let hidden = model.hidden as f64;
    let weights = model.layer_matrix_params() as f64 / tp;
    let query = model.query_width() as f64 / tp;
    let kv = model.kv_width() as f64 / tp;
    let ffn = model.ffn as f64 / tp;
    let mlp_outputs = if model.gated_mlp { 2.0 } else { 1.0 };
    // Activations in and out of the matrices: qkv in h, out q+2kv; o in q, out h; mlp in h, out
    // gate/up; down in f, out h.
    let matmul_activations =
        tokens * element * (hidden + query + 2.0 * kv + query + hidden + hidden + mlp_outputs * ffn + ffn + hidden);
    let seq = workload.seq as f64;
    let attention_flops = 2.0 * tokens * seq * model.query_width() as f64 / tp;
    let attention_bytes = tokens * element * (2.0 * query + 2.0 * kv);
    // Two norms (read, write h), rope on q and k, the gated activation (read 2f, write f), two adds.
    let elementwise = tokens * element * (4.0 * hidden + 2.0 * (query + kv) + (mlp_outputs + 1.0) * ffn + 6.0 * hidden);
    let mut ops = vec![
        OpCost {
            what: "matmuls",
            class: OpClass::MatMul,
            flops: 2.0 * tokens * weights,
            bytes: weights * element + matmul_activations,
        },
        OpCost { what: "attention", class: OpClass::Attention, flops: attention_flops, bytes: attention_bytes },
        OpCost { what: "norms, rope, activation, adds", class: OpClass::MemoryBound, flops: 0.0, bytes: elementwise },
    ];
    if let Some(experts) = &model.experts {
        let count = experts.count as f64;
        let copies = experts.top_k as f64 * tokens;
        let expert_ffn = experts.ffn as f64 / tp;
        let local_experts = count / layout.expert_degree() as f64;
        let expert_weights = local_experts * 3.0 * hidden * expert_ffn + model.router_params() as f64;
        // The router reads the tokens and writes their logits; each routed copy goes in (h), out of
        // gate and up (2·f_e/tp), into down (f_e/tp) and out (h).
        let moe_activations = tokens * (hidden + count) + copies * (2.0 * hidden + 3.0 * expert_ffn);
        ops.push(OpCost {
            what: "router and routed experts",
            class: OpClass::MatMul,
            flops: 2.0 * tokens * hidden * count + copies * 6.0 * hidden * expert_ffn,
            bytes: element * (expert_weights + moe_activations),
        });
        // Softmax over the logits (read, write), the gated activation (read 2·f_e, write f_e), and
        // the weighted combine (read the copies, write the tokens).
        let routing = tokens * 2.0 * count + copies * 3.0 * expert_ffn + copies * hidden + tokens * hidden;
        ops.push(OpCost {
            what: "routing softmax, experts' activation, combine",
            class: OpClass::MemoryBound,
            flops: 0.0,
            bytes: element * routing,
        });
    }
    ops
}

/// The LM head's forward on the last stage: `[tokens, h] · [h, V/tp]`.
pub fn head_forward_op(model: &ModelShape, layout: &Layout, workload: &Workload) -> OpCost {
    let tokens = local_tokens(layout, workload);
    let vocab = (model.vocab as f64 / layout.degree(AxisName::Tp) as f64).ceil();
    let element = model.dtype_bytes as f64;
    let hidden = model.hidden as f64;
    OpCost {
        what: "lm head",
        class: OpClass::MatMul,
        flops: 2.0 * tokens * hidden * vocab,
        bytes: element * (hidden * vocab + tokens * (hidden + vocab)),
    }
}

/// Seconds of one layer for one micro-batch: forward, backward and recompute.
pub fn layer_time(model: &ModelShape, layout: &Layout, workload: &Workload, hw: &HardwareSpec) -> f64 {
    let ops = layer_forward_ops(model, layout, workload);
    let forward: f64 = ops.iter().map(|op| op.time(hw, model.dtype_bytes)).sum();
    if workload.mode == Mode::Infer {
        return forward;
    }
    let recompute = match workload.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => {
            ops.iter().filter(|op| op.class == OpClass::Attention).map(|op| op.time(hw, model.dtype_bytes)).sum()
        }
        Recompute::Full => forward,
    };
    3.0 * forward + recompute
}

/// Seconds of the LM head (and loss) for one micro-batch on the last stage.
pub fn head_time(model: &ModelShape, layout: &Layout, workload: &Workload, hw: &HardwareSpec) -> f64 {
    let forward = head_forward_op(model, layout, workload).time(hw, model.dtype_bytes);
    if workload.mode == Mode::Infer {
        forward
    } else {
        3.0 * forward
    }
}

/// Model FLOPs of one step over all replicas (PaLM, appendix B): per token `6·N + 12·L·h_q·s`
/// for training, a third of it for a forward-only pass; with `causal`, the attention term is halved
/// (the keys after a query are never computed).
pub fn model_flops_per_step(model: &ModelShape, workload: &Workload, global_tokens: f64, causal: bool) -> f64 {
    let attention_share = if causal { 0.5 } else { 1.0 };
    let per_token = 6.0 * model.matmul_params() as f64
        + attention_share * 12.0 * model.layers as f64 * model.query_width() as f64 * workload.seq as f64;
    match workload.mode {
        Mode::Train => per_token * global_tokens,
        Mode::Infer => per_token * global_tokens / 3.0,
    }
}

/// Model FLOPs utilization: model FLOPs over what `ranks` devices could do in `step_s`.
pub fn mfu(model_flops: f64, step_s: f64, ranks: u64, hw: &HardwareSpec, dtype_bytes: u64) -> f64 {
    model_flops / (step_s * ranks as f64 * hw.peak_flops(dtype_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    #[test]
    fn roofline_takes_the_slower_bound() {
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let gemm = OpCost { what: "gemm", class: OpClass::MatMul, flops: 989.4e12, bytes: 1.0 };
        assert!((gemm.time(&hw, 2) - 1.0 / hw.efficiency.matmul).abs() < 1e-12);
        let copy = OpCost { what: "copy", class: OpClass::MemoryBound, flops: 0.0, bytes: 3.35e12 };
        assert!((copy.time(&hw, 2) - 1.0 / hw.efficiency.memory_bound).abs() < 1e-12);
    }

    #[test]
    fn model_flops_equal_megatrons_formula_for_gpt() {
        // GPT-3 175B (Narayanan et al. 2021): 72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L)).
        let (h, layers, seq, vocab, batch) = (12288.0, 96.0, 2048.0, 51200.0, 1536.0);
        let gpt = ModelShape::gpt("gpt3", vocab as u64, h as u64, layers as u64, 96);
        let workload = Workload::training(seq as u64, 1);
        let got = model_flops_per_step(&gpt, &workload, batch * seq, false);
        let megatron = 72.0 * batch * seq * layers * h * h * (1.0 + seq / (6.0 * h) + vocab / (12.0 * h * layers));
        assert!((got - megatron).abs() < 1e-9 * megatron, "{got} vs {megatron}");
    }

    #[test]
    fn tsp_and_tp_do_the_same_matmul_flops_a_rank() {
        let model = ModelShape::from_config(&preset("tsp-7b").unwrap());
        let workload = Workload::training(16384, 1);
        let flops = |layout: Layout| layer_forward_ops(&model, &layout, &workload)[0].flops;
        let tsp = flops(Layout::new(&[(AxisName::Tsp, 8)], false));
        let tp = flops(Layout::new(&[(AxisName::Tp, 8)], false));
        assert_eq!(tsp, tp);
        assert_eq!(tp, 2.0 * 16384.0 * model.layer_matrix_params() as f64 / 8.0);
    }

    #[test]
    fn experts_cost_the_router_and_top_k_experts_a_token() {
        // Mixtral at ep=8 x tp=2, 4096 tokens a rank: router 2·4096·4096·8, then 2 experts a token
        // of 6·4096·(14336/2) FLOPs (gate, up, down), forward.
        let model = ModelShape::from_config(&preset("mixtral-8x7b").unwrap());
        let layout = Layout::new(&[(AxisName::Ep, 8), (AxisName::Tp, 2)], false);
        let ops = layer_forward_ops(&model, &layout, &Workload::training(4096, 1));
        let moe = ops.iter().find(|op| op.what == "router and routed experts").expect("an experts op");
        let (n, h) = (4096.0, 4096.0);
        assert_eq!(moe.flops, 2.0 * n * h * 8.0 + 2.0 * 6.0 * n * h * 7168.0);
        // Model FLOPs: 6 a token for each active matmul parameter (32 layers of attention, router
        // and two experts; the LM head), plus the causal attention term.
        let active = 32.0 * (2.0 * h * h + 2.0 * h * 1024.0 + 8.0 * h + 2.0 * 3.0 * h * 14336.0) + 32000.0 * h;
        let attention = 0.5 * 12.0 * 32.0 * h * 4096.0;
        let got = model_flops_per_step(&model, &Workload::training(4096, 1), 4096.0, true);
        assert_eq!(got, (6.0 * active + attention) * 4096.0);
    }

    #[test]
    fn backward_is_twice_the_forward() {
        let model = ModelShape::from_config(&preset("llama3-8b").unwrap());
        let hw = HardwareSpec::builtin("h100-sxm").unwrap();
        let layout = Layout::new(&[(AxisName::Tp, 8)], false);
        let train = layer_time(&model, &layout, &Workload::training(4096, 1), &hw);
        let infer = layer_time(&model, &layout, &Workload::inference(4096, 1), &hw);
        assert!((train - 3.0 * infer).abs() < 1e-12 * train);
        let full = Workload { recompute: Recompute::Full, ..Workload::training(4096, 1) };
        assert!((layer_time(&model, &layout, &full, &hw) - 4.0 * infer).abs() < 1e-12 * train);
    }
}
