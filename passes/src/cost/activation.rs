//! Activation bytes one layer keeps for the backward, term by term (Korthikanti et al. 2022).
//!
//! "Reducing Activation Recomputation in Large Transformer Models", section 4, counts what a GPT
//! layer stores in 16-bit elements (and 1-byte dropout masks), per token:
//! - attention: the QKV input (2h), Q and K (4h), the softmax (2as), its dropout mask (as) and
//!   output (2as), V (2h), the output projection's input (2h), the dropout mask (h): 11h + 5as;
//! - MLP: its input (2h), the GeLU input and output (2f each, f = 4h gives 16h), the mask (h);
//! - the two LayerNorms' inputs (4h).
//!
//! That is `sbh(34 + 5as/h)` for f = 4h (Table 2, no parallelism). Tensor parallelism splits
//! everything but the norms' and linear layers' inputs and the masks (`10 + 24/t`); sequence
//! parallelism splits those too (`34/t`); selective recompute drops the `5as` softmax terms; full
//! recompute keeps only the layer's input, `2sbh`. [`LayerActivations`] computes the same terms for
//! any width: grouped-query K/V, a gated MLP (three `f`-wide tensors: gate, up and their product),
//! RMSNorm without dropout, flash attention (no score matrix; its fp32 log-sum-exp, 4 bytes a head
//! and a token, is kept instead), and the tokens a rank holds under sp, cp or tsp. With the GPT
//! settings it equals Table 2 to the byte (tests below and `tests/cost_reference.rs`).
//!
//! The sp axis (sequence split, weights replicated, attention over all-gathered K/V) adds one term
//! Table 2 has no axis for, [`LayerActivations::gathered_kv`]: the attention kernel's backward reads
//! the K and V it attended to, which under sp are the whole sequence's, not the rank's own. The
//! gathered buffer is what is saved. Full recompute replays the layer from its input but not the
//! all-gather (recomputation re-runs local kernels; re-gathering would add a collective to every
//! layer's backward), so the gathered K/V of every layer stay saved next to the layer inputs. This
//! is pleat's reading of the TSP paper's TP+SP baselines; see `memory`'s docs for the evidence.
//! TSP's attention gathers K/V too, one owner's heads over the group's tokens at a time, and its
//! backward reads every owner's: without full recompute they stay, the whole sequence's K/V of
//! every head (the rank's own tokens' part is in `qkv`); full recompute gathers each owner's again
//! in the layer's backward, as its programs do.
//!
//! A mixture of experts keeps three more terms a layer, sized for balanced routing (every expert
//! gets `top_k·T/E` of the `T` tokens a rank routes; with ep the rank's `E/ep` experts receive the
//! same `top_k·T` copies from the whole ep group): the router's logits `[T, E]`, the routed token
//! copies the rank's experts take as input `[top_k·T, h]`, and those experts' gated-MLP tensors
//! (gate, up and their product, as for a dense gated MLP) `3·[top_k·T, f_e/tp]`. Skewed routing
//! sends an expert's rank up to every token of its group (`memory` reports that bound); the
//! buffers here are not sized for it.

use pleat_ir::AxisName;

use super::layout::Layout;
use super::model::ModelShape;
use super::workload::{Recompute, Workload};

/// One layer's saved activations on one rank, for one micro-batch, by term (bytes).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LayerActivations {
    /// Inputs of the two norms.
    pub norm_inputs: f64,
    /// Inputs of the QKV and the first MLP projections (the norms' outputs).
    pub linear_inputs: f64,
    /// Q, K and V.
    pub qkv: f64,
    /// Softmax, its dropout mask and output (the `5as/h` term), or flash attention's log-sum-exp.
    pub scores: f64,
    /// Input of the output projection (the attention's result).
    pub attention_output: f64,
    /// The MLP's `f`-wide tensors (gate, up, product; or GeLU input and output).
    pub mlp_hidden: f64,
    /// Dropout masks after attention and MLP.
    pub dropout_masks: f64,
    /// Under full recompute, the layer's input replaces all of the above.
    pub layer_input: f64,
    /// The sp axis's all-gathered K/V (the whole group's tokens, the rank's kv heads), kept for the
    /// attention's backward: `2·s·b/(cp·tsp)·kv/t` elements under full recompute, the remote
    /// `(sp-1)/sp` of it otherwise (the rank's own K/V are in [`Self::qkv`]). With tsp and without
    /// full recompute, also every owner's gathered K/V: `2·s·b/cp·kv/t` elements less the rank's
    /// own tokens' `1/tsp`. Zero without sp or tsp.
    pub gathered_kv: f64,
    /// A mixture's router logits, `[T, E]`. Zero for a dense model.
    pub router_logits: f64,
    /// The token copies the rank's experts receive (balanced routing), `[top_k·T, h]`.
    pub routed_tokens: f64,
    /// The rank's experts' gate, up and product tensors, `3·[top_k·T, f_e/tp]`.
    pub expert_hidden: f64,
}

impl LayerActivations {
    /// The bytes the layer keeps.
    pub fn total(&self) -> f64 {
        self.norm_inputs
            + self.linear_inputs
            + self.qkv
            + self.scores
            + self.attention_output
            + self.mlp_hidden
            + self.dropout_masks
            + self.layer_input
            + self.gathered_kv
            + self.router_logits
            + self.routed_tokens
            + self.expert_hidden
    }

    /// The mixture-of-experts block's terms ([`Self::router_logits`], [`Self::routed_tokens`],
    /// [`Self::expert_hidden`]).
    pub fn experts(&self) -> f64 {
        self.router_logits + self.routed_tokens + self.expert_hidden
    }
}

/// The tokens of one micro-batch a rank holds: `s·b` divided by the sp, cp and tsp degrees.
pub fn local_tokens(layout: &Layout, workload: &Workload) -> f64 {
    (workload.seq * workload.micro_batch) as f64 / layout.sequence_split() as f64
}

/// How many ways the K/V heads are split by tp: whole on every rank when they do not divide
/// (strategy.rs keeps k/v replicated then).
pub fn kv_split(model: &ModelShape, layout: &Layout) -> u64 {
    let tp = layout.degree(AxisName::Tp);
    if model.kv_heads % tp == 0 {
        tp
    } else {
        1
    }
}

/// Whether tp does not divide the K/V heads, so that every tp rank holds all of k's and v's, read
/// by its share of q's heads: their gradients are partial sums over tp.
pub fn key_values_replicated(model: &ModelShape, layout: &Layout) -> bool {
    layout.degree(AxisName::Tp) > 1 && kv_split(model, layout) == 1
}

/// The activations a layer keeps with `recompute` (the workload's own setting is ignored, so that
/// the working set of a recomputed layer can be asked for with `Recompute::None`).
pub fn layer_activations(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    recompute: Recompute,
) -> LayerActivations {
    let tokens = local_tokens(layout, workload);
    let tp = layout.degree(AxisName::Tp) as f64;
    let element = model.dtype_bytes as f64;
    let hidden = model.hidden as f64;
    // Megatron SP splits what tensor parallelism replicates.
    let replicated_split = if layout.sequence_parallel { tp } else { 1.0 };
    let kv_split = kv_split(model, layout) as f64;
    let sp = layout.degree(AxisName::Sp) as f64;
    let gathered_kv_elements = 2.0 * tokens * sp * model.kv_width() as f64 / kv_split;
    let tsp = layout.degree(AxisName::Tsp) as f64;
    let owners_kv_elements = 2.0 * tokens * tsp * model.kv_width() as f64 / kv_split;
    if recompute == Recompute::Full {
        return LayerActivations {
            norm_inputs: 0.0,
            linear_inputs: 0.0,
            qkv: 0.0,
            scores: 0.0,
            attention_output: 0.0,
            mlp_hidden: 0.0,
            dropout_masks: 0.0,
            layer_input: tokens * element * hidden / replicated_split,
            gathered_kv: if sp > 1.0 { gathered_kv_elements * element } else { 0.0 },
            router_logits: 0.0,
            routed_tokens: 0.0,
            expert_hidden: 0.0,
        };
    }
    // Every query attends to the whole sequence of the keys (Table 2 counts s × s; causal
    // kernels that skip the masked half still allocate it).
    let keys = workload.seq as f64;
    let heads_local = model.heads as f64 / tp;
    let scores = if workload.flash_attention {
        tokens * heads_local * 4.0
    } else if recompute == Recompute::Selective {
        0.0
    } else {
        let dropout_bytes = if model.dropout { 1.0 + element } else { 0.0 };
        tokens * heads_local * keys * (element + dropout_bytes)
    };
    let mlp_tensors = if model.gated_mlp { 3.0 } else { 2.0 };
    let (router_logits, routed_tokens, expert_hidden) = match &model.experts {
        Some(experts) => {
            let copies = experts.top_k as f64 * tokens;
            (
                tokens * experts.count as f64 * element,
                copies * hidden * element,
                3.0 * copies * experts.ffn as f64 / tp * element,
            )
        }
        None => (0.0, 0.0, 0.0),
    };
    LayerActivations {
        norm_inputs: 2.0 * tokens * element * hidden / replicated_split,
        linear_inputs: 2.0 * tokens * element * hidden / replicated_split,
        qkv: tokens * element * (model.query_width() as f64 / tp + 2.0 * model.kv_width() as f64 / kv_split),
        scores,
        attention_output: tokens * element * model.query_width() as f64 / tp,
        mlp_hidden: tokens * element * mlp_tensors * model.ffn as f64 / tp,
        dropout_masks: if model.dropout { 2.0 * tokens * hidden / replicated_split } else { 0.0 },
        layer_input: 0.0,
        gathered_kv: (gathered_kv_elements * (sp - 1.0) / sp + owners_kv_elements * (tsp - 1.0) / tsp) * element,
        router_logits,
        routed_tokens,
        expert_hidden,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::model::Norm;

    /// A GPT layer as Korthikanti counts it: MHA, f = 4h, LayerNorm, dropout, 16-bit.
    fn gpt(hidden: u64, heads: u64) -> ModelShape {
        ModelShape::gpt("gpt", 51200, hidden, 1, heads)
    }

    fn materialized(seq: u64, batch: u64) -> Workload {
        Workload { flash_attention: false, ..Workload::training(seq, batch) }
    }

    fn check(layout: Layout, recompute: Recompute, per_layer: impl Fn(f64, f64, f64, f64, f64) -> f64) {
        let (s, b, h, a) = (2048u64, 2u64, 1024u64, 16u64);
        let got = layer_activations(&gpt(h, a), &layout, &materialized(s, b), recompute).total();
        let t = layout.degree(AxisName::Tp) as f64;
        let want = per_layer(s as f64, b as f64, h as f64, a as f64, t);
        assert_eq!(got, want, "{layout} {recompute:?}");
    }

    #[test]
    fn korthikanti_table_2() {
        let none = Layout::new(&[], false);
        let tp = Layout::new(&[(AxisName::Tp, 8)], false);
        let tp_sp = Layout::new(&[(AxisName::Tp, 8)], true);
        check(none.clone(), Recompute::None, |s, b, h, a, _| s * b * h * (34.0 + 5.0 * a * s / h));
        check(tp.clone(), Recompute::None, |s, b, h, a, t| s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)));
        check(tp_sp.clone(), Recompute::None, |s, b, h, a, t| s * b * h / t * (34.0 + 5.0 * a * s / h));
        check(tp.clone(), Recompute::Selective, |s, b, h, _, t| s * b * h * (10.0 + 24.0 / t));
        check(tp_sp, Recompute::Selective, |s, b, h, _, t| s * b * h * 34.0 / t);
        check(tp, Recompute::Full, |s, b, h, _, _| 2.0 * s * b * h);
        check(none, Recompute::Full, |s, b, h, _, _| 2.0 * s * b * h);
    }

    #[test]
    fn flash_attention_keeps_only_the_log_sum_exp() {
        let model = gpt(1024, 16);
        let layout = Layout::new(&[(AxisName::Tp, 4)], false);
        let flash = layer_activations(&model, &layout, &Workload::training(2048, 1), Recompute::None);
        assert_eq!(flash.scores, 2048.0 * 4.0 * 4.0);
        let selective = layer_activations(&model, &layout, &materialized(2048, 1), Recompute::Selective);
        assert_eq!(flash.total() - flash.scores, selective.total());
    }

    #[test]
    fn sp_keeps_the_gathered_kv_with_or_without_recompute() {
        // tiny-like GQA: 8 heads, 4 kv heads of 16 channels; tp = 2 splits the kv heads.
        let model = ModelShape { kv_heads: 4, head_dim: 16, ..gpt(128, 8) };
        let layout = Layout::new(&[(AxisName::Sp, 4), (AxisName::Tp, 2)], false);
        let workload = Workload::training(64, 2);
        // The whole group's tokens (64 · 2), K and V of 2 kv heads of 16 channels, 2 bytes.
        let whole = 2.0 * 128.0 * 32.0 * 2.0;
        let full = layer_activations(&model, &layout, &workload, Recompute::Full);
        assert_eq!(full.gathered_kv, whole);
        assert_eq!(full.total(), full.layer_input + whole);
        // Without recompute the rank's own quarter is in qkv already.
        let none = layer_activations(&model, &layout, &workload, Recompute::None);
        assert_eq!(none.gathered_kv, whole * 3.0 / 4.0);
        let local_kv = 2.0 * 32.0 * 32.0 * 2.0;
        assert_eq!(none.gathered_kv + local_kv, whole);
        // No sp axis, no term.
        let tp = Layout::new(&[(AxisName::Tp, 2)], false);
        assert_eq!(layer_activations(&model, &tp, &workload, Recompute::Full).gathered_kv, 0.0);
        assert_eq!(layer_activations(&model, &tp, &workload, Recompute::None).gathered_kv, 0.0);
    }

    #[test]
    fn tsp_keeps_every_owners_gathered_kv_unless_it_recomputes_the_layer() {
        // tiny-like GQA at tsp=4: 4 kv heads of 16 channels, 64·2 tokens, 16·2 a rank. Each
        // owner's K/V are gathered over the group's 128 tokens for its one kv head; the backward
        // reads all four owners', 2·128·64 elements, of which the rank's own tokens' quarter is
        // in qkv.
        let model = ModelShape { kv_heads: 4, head_dim: 16, ..gpt(128, 8) };
        let layout = Layout::new(&[(AxisName::Tsp, 4)], false);
        let workload = Workload::training(64, 2);
        let whole = 2.0 * 128.0 * 64.0 * 2.0;
        for recompute in [Recompute::None, Recompute::Selective] {
            let kept = layer_activations(&model, &layout, &workload, recompute);
            assert_eq!(kept.gathered_kv, whole * 3.0 / 4.0, "{recompute:?}");
            assert_eq!(kept.qkv - 32.0 * 128.0 * 2.0, whole / 4.0, "the own tokens' k and v");
        }
        // Full recompute gathers each owner's again in the layer's backward.
        assert_eq!(layer_activations(&model, &layout, &workload, Recompute::Full).gathered_kv, 0.0);
    }

    #[test]
    fn experts_keep_logits_routed_copies_and_their_hidden_tensors() {
        // tiny-moe (f32): 8 experts of 64 channels, top-2, no dense MLP. ep=2 x tp=2, 16 tokens a
        // rank: logits 16·8, copies 2·16·128, hidden 3·2·16·64/2, 4 bytes each.
        let model = ModelShape::from_config(&pleat_ir::model::preset::preset("tiny-moe").unwrap());
        let layout = Layout::new(&[(AxisName::Ep, 2), (AxisName::Tp, 2)], false);
        let kept = layer_activations(&model, &layout, &Workload::training(16, 1), Recompute::None);
        assert_eq!(kept.router_logits, 16.0 * 8.0 * 4.0);
        assert_eq!(kept.routed_tokens, 2.0 * 16.0 * 128.0 * 4.0);
        assert_eq!(kept.expert_hidden, 3.0 * 2.0 * 16.0 * 32.0 * 4.0);
        assert_eq!(kept.mlp_hidden, 0.0, "no dense MLP");
        let full = layer_activations(&model, &layout, &Workload::training(16, 1), Recompute::Full);
        assert_eq!(full.experts(), 0.0, "full recompute keeps the layer input only");
    }

    #[test]
    fn tsp_keeps_one_dth_of_the_tokens_at_full_width() {
        // Gated MLP, no dropout, flash: per token 4h (norms) + 4h (linear inputs) + 6h (q, k, v)
        // + 2h (attention output) + 3·2·f (f = 4h: 24h) = 40h bytes, plus 4 bytes a head; and
        // the other seven eighths of every owner's gathered K/V (MHA: 2h a token of the group,
        // 8 of the rank's), 28h.
        let h = 4096u64;
        let model = ModelShape { gated_mlp: true, norm: Norm::RmsNorm, dropout: false, ffn: 4 * h, ..gpt(h, 32) };
        let layout = Layout::new(&[(AxisName::Tsp, 8)], false);
        let got = layer_activations(&model, &layout, &Workload::training(131072, 1), Recompute::None).total();
        let tokens = 131072.0 / 8.0;
        assert_eq!(got, tokens * (68.0 * h as f64 + 4.0 * 32.0));
    }
}
