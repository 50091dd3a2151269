//! The sizes of one rank's buffers in a compiled training step, in bytes (or elements where
//! named so), shared by the closed forms of [`super::compiled_training`] and
//! [`super::compiled_pipeline`]: the token split, the residual stream and its gathered copy, and
//! what each layer's forward keeps for the backward.

use pleat_ir::AxisName;

use super::activation::kv_split;
use super::layout::Layout;
use super::model::ModelShape;
use super::workload::{Recompute, Workload};

/// Token ids and positions are `u32`.
pub(super) const ID_BYTES: f64 = 4.0;

/// One rank's buffer sizes for `model` on `layout`, `workload` one micro-batch.
#[derive(Clone, Copy)]
pub(super) struct StepSizes {
    /// Bytes an element of the model's dtype.
    pub element: f64,
    /// The micro-batch's tokens.
    pub tokens: f64,
    /// How many ways cp and tsp split the tokens (zigzag).
    pub token_split: u64,
    /// The rank's tokens.
    pub local_tokens: f64,
    /// How many ways tp and tsp split the vocabulary.
    pub vocab_split: f64,
    /// The rank's rows of the vocabulary (of the embedding, the LM head and the logits).
    pub vocab_shard: f64,
    /// How many ways tp splits heads, kv heads (when they divide) and ffn channels.
    pub split: f64,
    /// Whether Megatron SP splits the residual stream on seq over tp.
    pub sequence_parallel: bool,
    /// The hidden size, the rank's query width, kv width and ffn channels, and the vocabulary
    /// (elements).
    pub hidden: f64,
    pub query: f64,
    pub kv: f64,
    pub ffn: f64,
    pub vocab: f64,
    /// The micro-batch's token ids.
    pub ids: f64,
    /// Under cp and tsp the zigzag order's positions and the rank's own; otherwise the one copy.
    pub positions: f64,
    /// The residual stream between layers and inside them (the embedding's output, each
    /// residual, what a stage sends on): split on seq over tp under Megatron SP.
    pub stream: f64,
    /// A hidden state of the rank's tokens, whole: the norms' outputs, all-gathered before the
    /// projections read them.
    pub gathered: f64,
    /// A hidden state of every token of the micro-batch, whole: under tsp the LM head's input,
    /// gathered over the sequence, and its gradient.
    pub every_token: f64,
    /// The attention output a layer keeps (none under selective recomputation), a token (elements).
    pub attention_kept: f64,
    /// The k and v a layer keeps after RoPE: under cp and tsp every token's, all-gathered (elements).
    pub kv_kept: f64,
    /// What one layer's forward keeps for the backward.
    pub kept_layer: f64,
    /// A mixture's load-balancing loss: one layer's expert counts, or its router probability sums
    /// (`[E]` each); 0 without the loss.
    pub statistics: f64,
}

impl StepSizes {
    pub(super) fn new(model: &ModelShape, layout: &Layout, workload: &Workload) -> StepSizes {
        let (tp, cp, tsp) = (layout.degree(AxisName::Tp), layout.degree(AxisName::Cp), layout.degree(AxisName::Tsp));
        let sequence_parallel = layout.sequence_parallel && tp > 1;
        let element = model.dtype_bytes as f64;
        let tokens = workload.tokens_per_micro_batch() as f64;
        let token_split = cp * tsp;
        let local_tokens = tokens / token_split as f64;
        let split = tp as f64;
        let (hidden, query) = (model.hidden as f64, model.query_width() as f64 / split);
        let kv = model.kv_width() as f64 / kv_split(model, layout) as f64;
        let positions =
            workload.seq as f64 * ID_BYTES * if token_split > 1 { 1.0 + 1.0 / token_split as f64 } else { 1.0 };
        let stream = local_tokens * hidden * element / if sequence_parallel { split } else { 1.0 };
        let gathered = local_tokens * hidden * element;
        let ffn = model.ffn as f64 / split;
        // Per layer, what the forward keeps for the backward: the two norms' outputs, the two
        // residuals (one the layer's output), q after RoPE and attention's output (selective
        // recomputation keeps no attention output), v and k after RoPE, and gate, up and their
        // product (tsp's MLP ring keeps nothing: its backward recomputes from the norm's output).
        // Full recomputation keeps only the residual stream: each layer's attention residual and
        // output.
        let attention_kept = if workload.recompute == Recompute::Selective { 0.0 } else { query };
        let kv_kept = if token_split > 1 { 2.0 * tokens * kv } else { 2.0 * local_tokens * kv };
        // A mixture's shared expert (beside gate, up and their product, counted as a dense MLP's)
        // keeps its output and its gate's logit, which its sigmoid scale's backward reads.
        let shared_expert = model.experts.as_ref().is_some_and(|experts| experts.shared_expert);
        let mlp_kept = if tsp > 1 { 0.0 } else { 3.0 * ffn } + if shared_expert { hidden + 1.0 } else { 0.0 };
        let kept_layer = if workload.recompute == Recompute::Full {
            2.0 * stream
        } else {
            2.0 * gathered + 2.0 * stream + (local_tokens * (query + attention_kept + mlp_kept) + kv_kept) * element
        };
        StepSizes {
            element,
            tokens,
            token_split,
            local_tokens,
            vocab_split: (tp * tsp) as f64,
            vocab_shard: (model.vocab as f64 / (tp * tsp) as f64).ceil(),
            split,
            sequence_parallel,
            hidden,
            query,
            kv,
            ffn,
            vocab: model.vocab as f64,
            ids: tokens * ID_BYTES,
            positions,
            stream,
            gathered,
            every_token: tokens * hidden * element,
            attention_kept,
            kv_kept,
            kept_layer,
            statistics: match &model.experts {
                Some(experts) if experts.load_balancing_loss => experts.count as f64 * element,
                _ => 0.0,
            },
        }
    }

    /// The final norm's buffers beyond the last layer's output: its input all-gathered over tp
    /// under SP (beside the split output it came from) and its output, whole.
    pub(super) fn final_norm_buffers(&self) -> f64 {
        (self.gathered - self.stream) + self.gathered
    }

    /// The vocabulary-parallel loss's row statistics for `rows` rows, gathered over the
    /// vocabulary's split: three f32 a row from each part (none when the vocabulary is whole).
    pub(super) fn loss_row_statistics(&self, rows: f64) -> f64 {
        if self.vocab_split > 1.0 {
            3.0 * 4.0 * self.vocab_split * rows
        } else {
            0.0
        }
    }
}
