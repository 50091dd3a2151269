//! The closed set of operations a graph node can perform.
//!
//! Every op has a fixed arity and a documented meaning on global tensors. Under sharding each rank
//! applies the same op to its local blocks; the specs on the inputs and output (checked by the
//! verifier) say why that is correct. Communication ops are the only ones whose per-rank meaning
//! involves other ranks: they change a value's spec, never its global contents.

use serde::{Deserialize, Serialize};

use crate::model::config::RopeConfig;
use crate::{AxisName, DimName};

/// An operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // === Inputs ===
    /// The token ids, `i32[batch, seq]`.
    Tokens,
    /// The absolute position of each sequence slot, `i32[seq]`. Layouts that permute the sequence
    /// (zigzag) permute this input with it, so position-dependent ops stay correct.
    Positions,
    /// A weight, named as Hugging Face checkpoints name it; the shape may split the checkpoint's
    /// dims (`q_proj.weight` [heads*head_dim, hidden] is seen as [heads, head_dim, hidden]).
    Param {
        /// The checkpoint tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        name: String,
    },

    // === Compute ===
    /// `(table[vocab, hidden], tokens[batch, seq]) -> [batch, seq, hidden]`: row lookup.
    Embedding,
    /// `(x[.., hidden], weight[hidden]) -> x / sqrt(mean(x^2) + eps) * weight` over `hidden`.
    RmsNorm {
        /// Added to the mean square.
        eps: f64,
    },
    /// `(x[F.., C..], w[G.., C..]) -> [F.., G..]`: the sum over the trailing `contract` dims that both
    /// share (the `nn.Linear` convention, `x · wᵀ`, with weights stored `[out.., in..]`).
    MatMul {
        /// How many trailing dims are contracted.
        contract: u8,
    },
    /// `(x[batch, seq, heads|kv_heads, head_dim], positions[seq]) -> same`: rotary embedding, Hugging
    /// Face's rotate-half convention.
    Rope {
        /// Base frequency and scaling.
        rope: RopeConfig,
    },
    /// `(q[batch, seq, heads, head_dim], k[batch, seq, kv_heads, head_dim], v (as k), q_pos[seq],
    /// k_pos[seq]) -> [batch, seq, heads, head_dim]`: softmax(q·kᵀ/sqrt(head_dim))·v, query head `h`
    /// reading key/value head `h / (heads / kv_heads)`; with `causal`, query at position p sees keys at
    /// positions <= p.
    Attention {
        /// Whether to mask keys after the query's position.
        causal: bool,
    },
    /// `(gate, up) -> silu(gate) * up`, elementwise.
    SiluMul,
    /// `(x[batch, seq, hidden], gate[ffn, hidden], up[ffn, hidden], down[hidden, ffn]) -> [batch, seq,
    /// hidden]`: the gated SiLU MLP `down(silu(x·gateᵀ) * (x·upᵀ))`, computed as a ring over `axis`:
    /// each rank starts with its ffn shard of the three weights and, in as many steps as the axis
    /// has ranks, adds the contribution of the shard it holds to its own tokens while passing that
    /// shard on to the next rank (Zyphra's TSP MLP). On one rank it is the plain MLP.
    RingGatedMlp {
        /// The axis the weight shards travel around.
        axis: AxisName,
    },
    /// `(x, gate, up, down, dy[batch, seq, hidden]) -> the type of operand `wrt``: the gradient of
    /// `RingGatedMlp` with respect to one operand, computed as a ring over `axis` in reverse: each
    /// weight shard travels around the ring again, every rank adds its own tokens' contribution to
    /// the shard's gradient, which travels with the shard and arrives home complete. The four
    /// gradients of one MLP share their operands, and lowering computes them in one ring (the
    /// hidden activations are recomputed a step at a time, never kept). On one rank it is the
    /// plain MLP's gradient.
    RingGatedMlpGrad {
        /// The axis the weight shards travel around.
        axis: AxisName,
        /// The operand the gradient is taken with respect to.
        wrt: MlpOperand,
    },
    /// `(x[.., hidden], router[experts, hidden], gate[experts, ffn, hidden], up[experts, ffn, hidden],
    /// down[experts, hidden, ffn]) -> [.., hidden]`: a mixture of gated SiLU experts with Hugging
    /// Face's dropless top-k routing. Each row's router logits `x · routerᵀ` go through a softmax
    /// over all experts; the `top_k` largest probabilities (ties to the lower index) pick the row's
    /// experts, renormalized to sum to one when `normalize`; the row's result is the sum over its
    /// experts `e` of `weight_e · down_e(silu(x·gate_eᵀ) * (x·up_eᵀ))`.
    ///
    /// Under sharding each rank routes its rows with the whole router. Without `dispatch` it
    /// computes only the experts (and ffn channels) it holds on its own rows: the result is a
    /// pending sum over the axes that split the experts or ffn (expert parallelism with the
    /// all-gather dispatcher, expert tensor parallelism). With `dispatch`, the rows and the experts
    /// are both split over that axis: each rank sends each row to the ranks that hold its experts
    /// (an all-to-all with variable counts, the counts exchanged first), they run it through those
    /// experts and send the results back (the reverse all-to-all), and the rank combines them
    /// (expert parallelism with the all-to-all dispatcher). On one rank both are the plain mixture.
    MoeMlp {
        /// Experts a row is sent to.
        top_k: u64,
        /// Whether the chosen probabilities are renormalized to sum to one.
        normalize: bool,
        /// The axis the rows travel over to their experts, if any.
        dispatch: Option<AxisName>,
    },
    /// `(x, router, gate, up, down, dy[.., hidden]) -> the type of operand `wrt``: the gradient of
    /// `MoeMlp` with respect to one operand, recomputing the routing and the experts' activations.
    /// The routing is piecewise constant, so the router's gradient flows through the chosen
    /// probabilities only (as in PyTorch's autograd of `topk`).
    MoeMlpGrad {
        /// The forward op's top-k.
        top_k: u64,
        /// The forward op's renormalization.
        normalize: bool,
        /// The forward op's dispatch axis: the rows and their gradients travel to the experts'
        /// ranks and the input's gradient travels back.
        dispatch: Option<AxisName>,
        /// The operand the gradient is taken with respect to.
        wrt: MoeOperand,
    },
    /// `(x[.., hidden], router[experts, hidden]) -> f32[experts]`: how many (row, choice) pairs the
    /// `top_k` routing of `MoeMlp` sends to each expert, times `scale`. Piecewise constant in its
    /// operands: no gradient flows through it.
    ExpertCounts {
        /// Experts a row is sent to.
        top_k: u64,
        /// The factor every count is multiplied by (the load-balancing loss's constant).
        scale: f64,
    },
    /// `(x[.., hidden], router[experts, hidden]) -> f32[experts]`: the router's softmax
    /// probabilities summed over the rows.
    RouterProbSum,
    /// `(x, router, dy[experts]) -> the type of operand `wrt``: the gradient of `RouterProbSum`
    /// with respect to `x` or the router.
    RouterProbSumGrad {
        /// `Input` or `Router`.
        wrt: MoeOperand,
    },
    /// `(counts[experts], probabilities[experts]) -> f32[]`: Switch Transformer's load-balancing loss
    /// as Hugging Face's `load_balancing_loss_func` computes it, the dot product of the (scaled)
    /// expert counts and the summed router probabilities of every layer. A term of the training
    /// loss beside the cross-entropy; its gradient with respect to the probabilities is the counts
    /// (the counts carry none).
    LoadBalancingLoss,
    /// The operands and meaning of `Attention`, computed as a ring over `axis` (context parallelism,
    /// ring attention): q, k, v and both position lists are split on `seq` over `axis` (zigzag
    /// layout). Each rank keeps its queries while the key/value blocks, with their positions, travel
    /// around the ring in as many steps as the axis has ranks; the partial results merge by online
    /// softmax (running log-sum-exp). On one rank it is plain attention.
    RingAttention {
        /// The axis the key/value blocks travel around.
        axis: AxisName,
        /// Whether to mask keys after the query's position.
        causal: bool,
    },
    /// `x -> x` with its `seq` dim reordered into the zigzag layout of `parts` ranks (or back, with
    /// `inverse`): the sequence is cut into `2·parts` chunks and chunk pairs `(r, 2·parts-1-r)` are
    /// placed side by side, so that contiguous blocks of the result balance causal attention.
    Zigzag {
        /// The ranks the layout balances over.
        parts: u64,
        /// Undo the reordering.
        inverse: bool,
    },
    /// `(gate[..], y[.., hidden]) -> sigmoid(gate) * y`, each row of `y` scaled by its gate's sigmoid
    /// (Qwen2-MoE's gate on its shared expert).
    SigmoidScale,
    /// `(a, b) -> a + b`, elementwise; `b`'s dims equal `a`'s or are a trailing run of them (a bias),
    /// and then `b` is broadcast over `a`'s leading dims.
    Add,
    /// `(a, b, c, ..) -> a + b + c + ..`, elementwise over `terms` operands of one type, summed in
    /// operand order (`(a + b) + c`, so that it equals the chain of adds it replaces bit for bit).
    /// `passes::fuse` makes it from a chain of `Add`s whose inner sums have no other reader.
    Sum {
        /// The number of operands (at least 3).
        terms: u8,
    },

    // === Training: the loss and the backward ops ===
    // `passes::autodiff` emits the backward ops. A node defines one value, so an op with several
    // gradients is one op per gradient (each recomputes what it needs from the forward operands):
    // every result keeps a single type, a single sharding rule and its own liveness.
    /// `(logits[batch, seq, vocab], tokens[batch, seq]) -> f32[]`: Hugging Face's causal-LM loss, the
    /// mean over the `batch * (seq - 1)` positions `t < seq - 1` of `logsumexp(logits[b, t]) -
    /// logits[b, t, tokens[b, t + 1]]` (position `t` predicts token `t + 1`).
    CrossEntropy,
    /// `(logits, tokens) -> [batch, seq, vocab]`: the gradient of `CrossEntropy` seeded with 1 (the
    /// loss is the root of the backward graph): `(softmax(logits[b, t]) - onehot(tokens[b, t + 1])) /
    /// (batch * (seq - 1))`, zero at the last position.
    CrossEntropyGrad,
    /// The operands and meaning of `CrossEntropy`, computed with the logits split on `vocab` over
    /// `axis` (Megatron's vocab-parallel cross-entropy): each rank reduces its vocab shard of every
    /// row to (max, sum of exponentials, target logit if the target is in the shard), the ranks
    /// exchange those three numbers a row, and each combines them into the loss. The full-vocab
    /// logits never exist on one rank. On one rank it is the plain loss.
    VocabParallelCrossEntropy {
        /// The axis the vocabulary is split over.
        axis: AxisName,
    },
    /// The operands and meaning of `CrossEntropyGrad`, computed on the rank's vocab shard of the
    /// logits after the same exchange of row statistics as `VocabParallelCrossEntropy` (the
    /// gradient needs each row's global log-sum-exp); the result stays split on `vocab`.
    VocabParallelCrossEntropyGrad {
        /// The axis the vocabulary is split over.
        axis: AxisName,
    },
    /// `(dy[F.., G..], w[G.., C..]) -> [F.., C..]`: the gradient of `MatMul { contract }` with respect
    /// to `x`, `dy · w` summed over the `G..` dims (`w.rank - contract` of them).
    MatMulGradInput {
        /// The forward op's contracted dims.
        contract: u8,
    },
    /// `(dy[F.., G..], x[F.., C..]) -> [G.., C..]`: the gradient of `MatMul { contract }` with respect
    /// to `w`, `dyᵀ · x` summed over the `F..` dims (`x.rank - contract` of them).
    MatMulGradWeight {
        /// The forward op's contracted dims.
        contract: u8,
    },
    /// `(x[.., hidden], weight[hidden], dy[.., hidden]) -> [.., hidden]`: the gradient of `RmsNorm`
    /// with respect to `x`, per row `r = rsqrt(mean(x^2) + eps)`, `g = dy * weight`:
    /// `r * g - x * r^3 * mean(g * x)`.
    RmsNormGradInput {
        /// The forward op's eps.
        eps: f64,
    },
    /// `(x, weight, dy, acc) -> acc + RmsNormGradInput(x, weight, dy)`: an RMSNorm's input gradient
    /// added to the gradient already gathered for `x` (the residual stream's). `passes::fuse` makes
    /// it from the pair, so that the norm's own input gradient is never stored.
    RmsNormGradInputAdd {
        /// The forward op's eps.
        eps: f64,
    },
    /// `(x[.., hidden], dy[.., hidden]) -> [hidden]`: the gradient of `RmsNorm` with respect to its
    /// weight, `sum over rows of dy * x * rsqrt(mean(x^2) + eps)`.
    RmsNormGradWeight {
        /// The forward op's eps.
        eps: f64,
    },
    /// `(dy[batch, seq, heads|kv_heads, head_dim], positions[seq]) -> same`: the gradient of `Rope`,
    /// the inverse rotation (rotary embedding is orthogonal, so its transpose is its inverse).
    RopeGrad {
        /// The forward op's base frequency and scaling.
        rope: RopeConfig,
    },
    /// `(q, k, v, q_pos, k_pos, dy[batch, seq, heads, head_dim]) -> [batch, seq, heads, head_dim]`: the
    /// gradient of `Attention` with respect to `q`, recomputing the softmax from `q`, `k`, `v`.
    AttentionGradQuery {
        /// The forward op's mask.
        causal: bool,
    },
    /// As `AttentionGradQuery`, with respect to `k`: `[batch, seq, kv_heads, head_dim]`, summed over
    /// the query heads of each key/value head's group.
    AttentionGradKey {
        /// The forward op's mask.
        causal: bool,
    },
    /// As `AttentionGradQuery`, with respect to `v`: `[batch, seq, kv_heads, head_dim]`, summed over
    /// the query heads of each key/value head's group.
    AttentionGradValue {
        /// The forward op's mask.
        causal: bool,
    },
    /// `(gate, up, dy) -> dy * up * silu'(gate)`, elementwise: the gradient of `SiluMul` with respect
    /// to `gate` (the one with respect to `up` is `SiluMul(gate, dy)`).
    SiluMulGradGate,
    /// `(gate[..], y[.., hidden], dy[.., hidden]) -> [..]`: the gradient of `SigmoidScale` with respect
    /// to `gate`, `sigmoid'(gate) · sum over hidden of dy * y` (the one with respect to `y` is
    /// `SigmoidScale(gate, dy)`).
    SigmoidScaleGradGate,
    /// `(dy[batch, seq, hidden], tokens[batch, seq]) -> [vocab, hidden]`: the gradient of `Embedding`
    /// with respect to its table: row `v` is the sum of `dy` over the tokens equal to `v`.
    EmbeddingGrad {
        /// The table's rows.
        vocab: u64,
    },
    /// `x[L.., T..] -> [T..]`: sums over every dim but the trailing `keep` ones (the gradient of the
    /// broadcast operand of `Add`, a bias).
    SumLeading {
        /// How many trailing dims remain.
        keep: u8,
    },

    // === Communication ===
    /// Sums a value that is `Partial` over `axis`; the result is replicated over `axis`.
    AllReduce {
        /// The axis whose groups sum.
        axis: AxisName,
    },
    /// Sums a value that is `Partial` over `axis` and leaves each rank its block of `dim`.
    ReduceScatter {
        /// The axis whose groups sum.
        axis: AxisName,
        /// The dim the result is split on.
        dim: DimName,
    },
    /// Concatenates the blocks of `dim` split over `axis` (the innermost axis of that dim).
    AllGather {
        /// The axis to gather over.
        axis: AxisName,
        /// The dim to gather.
        dim: DimName,
    },
    /// Every rank receives block `root` of `dim` (split over `axis`) from the rank that holds it: the
    /// result is that block, replicated over `axis`, with `dim` of the block's size.
    BroadcastShard {
        /// The axis to broadcast over.
        axis: AxisName,
        /// The split dim.
        dim: DimName,
        /// The coordinate on `axis` of the rank that owns the block.
        root: u64,
    },
    /// The conjugate of `broadcast_shard`: sums a pending sum over `axis` into the rank at coordinate
    /// `root`, as that rank's block of `dim`; every other rank's block is zero. The result's `dim` is
    /// the operand's times the degree of `axis` (the operand is one block's size).
    ReduceToRoot {
        /// The axis to reduce over.
        axis: AxisName,
        /// The dim the result is split on.
        dim: DimName,
        /// The coordinate on `axis` of the rank that receives the sum.
        root: u64,
    },
    /// Keeps each rank's block of `dim` of a value replicated over `axis`: no communication.
    LocalSlice {
        /// The axis that will split the dim.
        axis: AxisName,
        /// The dim to split.
        dim: DimName,
    },
    /// Reshards a value from split on `gather_dim` to split on `split_dim`, both over `axis`: each
    /// rank cuts its block into as many pieces along `split_dim` as `axis` has ranks, sends piece
    /// `j` to rank `j`, and concatenates what it receives along `gather_dim` in rank order. Equal
    /// to `local_slice(all_gather(x, gather_dim), split_dim)` with `(D-1)/D` of one block's bytes
    /// sent instead of a whole gathered tensor.
    AllToAll {
        /// The axis whose groups exchange pieces.
        axis: AxisName,
        /// The dim the result is split on (replicated over `axis` in the operand).
        split_dim: DimName,
        /// The dim the operand is split on (innermost over `axis`); whole in the result.
        gather_dim: DimName,
    },
}

impl Op {
    /// The op's spelling in the text format.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Tokens => "tokens",
            Op::Positions => "positions",
            Op::Param { .. } => "param",
            Op::Embedding => "embedding",
            Op::RmsNorm { .. } => "rms_norm",
            Op::MatMul { .. } => "matmul",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::SiluMul => "silu_mul",
            Op::SigmoidScale => "sigmoid_scale",
            Op::SigmoidScaleGradGate => "sigmoid_scale_grad_gate",
            Op::Add => "add",
            Op::Sum { .. } => "sum",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyGrad => "cross_entropy_grad",
            Op::VocabParallelCrossEntropy { .. } => "vocab_parallel_cross_entropy",
            Op::VocabParallelCrossEntropyGrad { .. } => "vocab_parallel_cross_entropy_grad",
            Op::MatMulGradInput { .. } => "matmul_grad_input",
            Op::MatMulGradWeight { .. } => "matmul_grad_weight",
            Op::RmsNormGradInput { .. } => "rms_norm_grad_input",
            Op::RmsNormGradInputAdd { .. } => "rms_norm_grad_input_add",
            Op::RmsNormGradWeight { .. } => "rms_norm_grad_weight",
            Op::RopeGrad { .. } => "rope_grad",
            Op::AttentionGradQuery { .. } => "attention_grad_query",
            Op::AttentionGradKey { .. } => "attention_grad_key",
            Op::AttentionGradValue { .. } => "attention_grad_value",
            Op::SiluMulGradGate => "silu_mul_grad_gate",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::SumLeading { .. } => "sum_leading",
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::LocalSlice { .. } => "local_slice",
            Op::BroadcastShard { .. } => "broadcast_shard",
            Op::ReduceToRoot { .. } => "reduce_to_root",
            Op::RingGatedMlp { .. } => "ring_gated_mlp",
            Op::RingGatedMlpGrad { .. } => "ring_gated_mlp_grad",
            Op::RingAttention { .. } => "ring_attention",
            Op::Zigzag { .. } => "zigzag",
            Op::AllToAll { .. } => "all_to_all",
            Op::MoeMlp { .. } => "moe_mlp",
            Op::ExpertCounts { .. } => "expert_counts",
            Op::RouterProbSum => "router_prob_sum",
            Op::RouterProbSumGrad { .. } => "router_prob_sum_grad",
            Op::LoadBalancingLoss => "load_balancing_loss",
            Op::MoeMlpGrad { .. } => "moe_mlp_grad",
        }
    }
    /// The number of inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Tokens | Op::Positions | Op::Param { .. } => 0,
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::LocalSlice { .. }
            | Op::BroadcastShard { .. }
            | Op::ReduceToRoot { .. }
            | Op::AllToAll { .. }
            | Op::Zigzag { .. } => 1,
            Op::RingGatedMlp { .. } => 4,
            Op::MoeMlp { .. } => 5,
            Op::ExpertCounts { .. } | Op::RouterProbSum | Op::LoadBalancingLoss => 2,
            Op::RouterProbSumGrad { .. } => 3,
            Op::MoeMlpGrad { .. } => 6,
            Op::RingGatedMlpGrad { .. } => 5,
            Op::Embedding
            | Op::RmsNorm { .. }
            | Op::MatMul { .. }
            | Op::Rope { .. }
            | Op::SiluMul
            | Op::SigmoidScale
            | Op::Add => 2,
            Op::SigmoidScaleGradGate => 3,
            Op::Attention { .. } => 5,
            Op::SumLeading { .. } => 1,
            Op::CrossEntropy
            | Op::CrossEntropyGrad
            | Op::VocabParallelCrossEntropy { .. }
            | Op::VocabParallelCrossEntropyGrad { .. }
            | Op::MatMulGradInput { .. }
            | Op::MatMulGradWeight { .. }
            | Op::RmsNormGradWeight { .. }
            | Op::RopeGrad { .. }
            | Op::EmbeddingGrad { .. } => 2,
            Op::RmsNormGradInput { .. } | Op::SiluMulGradGate => 3,
            Op::RmsNormGradInputAdd { .. } => 4,
            Op::Sum { terms } => usize::from(*terms),
            Op::AttentionGradQuery { .. } | Op::AttentionGradKey { .. } | Op::AttentionGradValue { .. } => 6,
            Op::RingAttention { .. } => 5,
        }
    }
    /// Whether the op moves data between ranks.
    pub fn is_communication(&self) -> bool {
        matches!(
            self,
            Op::AllReduce { .. }
                | Op::ReduceScatter { .. }
                | Op::AllGather { .. }
                | Op::BroadcastShard { .. }
                | Op::ReduceToRoot { .. }
                | Op::RingGatedMlp { .. }
                | Op::RingGatedMlpGrad { .. }
                | Op::RingAttention { .. }
                | Op::VocabParallelCrossEntropy { .. }
                | Op::VocabParallelCrossEntropyGrad { .. }
                | Op::AllToAll { .. }
                | Op::MoeMlp { dispatch: Some(_), .. }
                | Op::MoeMlpGrad { dispatch: Some(_), .. }
        )
    }
    /// Whether the op is the training loss (the root of the backward graph).
    pub fn is_loss(&self) -> bool {
        matches!(self, Op::CrossEntropy | Op::VocabParallelCrossEntropy { .. })
    }
    /// Whether the op is a term added to the training loss besides it (its gradient is seeded
    /// with 1 as the loss's is).
    pub fn is_loss_term(&self) -> bool {
        matches!(self, Op::LoadBalancingLoss)
    }
    /// The mesh axis a communication or layout op works over.
    pub fn axis(&self) -> Option<AxisName> {
        match self {
            Op::AllReduce { axis } => Some(*axis),
            Op::ReduceScatter { axis, .. }
            | Op::AllGather { axis, .. }
            | Op::LocalSlice { axis, .. }
            | Op::BroadcastShard { axis, .. }
            | Op::ReduceToRoot { axis, .. }
            | Op::AllToAll { axis, .. }
            | Op::RingGatedMlp { axis }
            | Op::RingGatedMlpGrad { axis, .. } => Some(*axis),
            Op::RingAttention { axis, .. } => Some(*axis),
            Op::VocabParallelCrossEntropy { axis } | Op::VocabParallelCrossEntropyGrad { axis } => Some(*axis),
            Op::MoeMlp { dispatch, .. } | Op::MoeMlpGrad { dispatch, .. } => *dispatch,
            _ => None,
        }
    }
}

/// An operand of the gated MLP (`RingGatedMlp`), as a gradient names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MlpOperand {
    /// The tokens' hidden states `x`.
    Input,
    /// The gate projection.
    Gate,
    /// The up projection.
    Up,
    /// The down projection.
    Down,
}

impl MlpOperand {
    /// Every operand, in the forward op's operand order.
    pub const ALL: [MlpOperand; 4] = [MlpOperand::Input, MlpOperand::Gate, MlpOperand::Up, MlpOperand::Down];

    /// The operand's position among `RingGatedMlp`'s operands.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The operand at `index` of `RingGatedMlp`'s operands.
    pub fn at(index: usize) -> Option<MlpOperand> {
        MlpOperand::ALL.get(index).copied()
    }

    /// The operand's spelling in the text format.
    pub fn as_str(self) -> &'static str {
        match self {
            MlpOperand::Input => "x",
            MlpOperand::Gate => "gate",
            MlpOperand::Up => "up",
            MlpOperand::Down => "down",
        }
    }

    /// The operand spelled `text`.
    pub fn parse(text: &str) -> Option<MlpOperand> {
        MlpOperand::ALL.into_iter().find(|operand| operand.as_str() == text)
    }
}

/// An operand of the mixture-of-experts MLP (`MoeMlp`), as a gradient names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MoeOperand {
    /// The tokens' hidden states `x`.
    Input,
    /// The router (`[experts, hidden]`).
    Router,
    /// The experts' gate projections.
    Gate,
    /// The experts' up projections.
    Up,
    /// The experts' down projections.
    Down,
}

impl MoeOperand {
    /// Every operand, in the forward op's operand order.
    pub const ALL: [MoeOperand; 5] =
        [MoeOperand::Input, MoeOperand::Router, MoeOperand::Gate, MoeOperand::Up, MoeOperand::Down];

    /// The operand's position among `MoeMlp`'s operands.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The operand at `index` of `MoeMlp`'s operands.
    pub fn at(index: usize) -> Option<MoeOperand> {
        MoeOperand::ALL.get(index).copied()
    }

    /// The operand's spelling in the text format.
    pub fn as_str(self) -> &'static str {
        match self {
            MoeOperand::Input => "x",
            MoeOperand::Router => "router",
            MoeOperand::Gate => "gate",
            MoeOperand::Up => "up",
            MoeOperand::Down => "down",
        }
    }

    /// The operand spelled `text`.
    pub fn parse(text: &str) -> Option<MoeOperand> {
        MoeOperand::ALL.into_iter().find(|operand| operand.as_str() == text)
    }
}

/// The zigzag layout of a sequence of `seq` slots over `parts` ranks: entry `i` is the original
/// position that lands at slot `i`. The sequence is cut into `2·parts` equal chunks and slot block
/// `r` (of `seq / parts` slots) holds chunks `r` and `2·parts - 1 - r`, so every rank's block sees
/// the same amount of causal attention work. The caller has checked that `2·parts` divides `seq`.
pub fn zigzag_order(seq: u64, parts: u64) -> Vec<u64> {
    let chunk = seq / (2 * parts);
    (0..parts)
        .flat_map(|rank| [rank, 2 * parts - 1 - rank])
        .flat_map(|piece| piece * chunk..(piece + 1) * chunk)
        .collect()
}

/// `order` undone: entry `p` is the slot where original position `p` sits.
pub fn inverse_order(order: &[u64]) -> Vec<u64> {
    let mut inverse = vec![0; order.len()];
    for (slot, &position) in order.iter().enumerate() {
        inverse[position as usize] = slot as u64;
    }
    inverse
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_pairs_early_and_late_chunks() {
        assert_eq!(zigzag_order(8, 2), vec![0, 1, 6, 7, 2, 3, 4, 5]);
        assert_eq!(zigzag_order(4, 1), vec![0, 1, 2, 3]);
        let order = zigzag_order(24, 3);
        let inverse = inverse_order(&order);
        assert!((0..24).all(|position| order[inverse[position] as usize] == position as u64));
    }
}
