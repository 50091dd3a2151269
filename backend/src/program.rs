//! `Program`: what one rank runs, as a flat list of instructions over numbered buffers.
//!
//! The format is a promise between the compiler and the runtime: it is serde-serializable with a
//! format version (`FORMAT_VERSION`), printable as text, and the runtime loads and runs it without
//! the compiler. Every shape in it is local to the rank; every offset into a global tensor (a
//! parameter's slice, a token block, an output block) is precomputed, so the runtime does no
//! sharding arithmetic. A buffer is allocated by the instruction that writes it and released by a
//! `Free`; parameters stay resident to the end.

use serde::{Deserialize, Serialize};

use pleat_ir::DType;

/// The version of the serialized `Program` format; the runtime refuses any other.
pub const FORMAT_VERSION: u32 = 8;

/// A buffer of a `Program`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufferId(u32);
pleat_ir::entity_impl!(BufferId, "b");

/// What a buffer holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BufferKind {
    /// A weight slice, resident for the whole program.
    Param,
    /// Token ids or positions.
    Input,
    /// An intermediate value.
    Activation,
    /// Another rank's data, held while it is used: weights (TSP's broadcast blocks and ring shards)
    /// or key/value blocks with their positions (ring attention).
    InFlight,
}

/// A buffer: its local shape and element type.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// The IR value's name, for traces and errors.
    pub name: String,
    /// The declared element type (the CPU runtime computes and stores f32 regardless).
    pub dtype: DType,
    /// The local shape.
    pub shape: Vec<u64>,
    /// What it holds.
    pub kind: BufferKind,
}

impl Buffer {
    /// Elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Bytes at the declared dtype.
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size_bytes()
    }
    /// Whether it holds integers (token ids, positions) rather than floats.
    pub fn is_integer(&self) -> bool {
        self.dtype == DType::I32
    }
}

/// The ranks of one mesh-axis group, in the axis's order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Group {
    /// The mesh axis.
    pub axis: String,
    /// Global ranks.
    pub ranks: Vec<u32>,
}

/// The local sizes of a mixture-of-experts kernel and the experts the rank holds, shared by
/// `Kernel::MoeMlp` and its gradients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeDims {
    /// Local rows (tokens).
    pub rows: u64,
    /// Width of a row.
    pub hidden: u64,
    /// Every expert of the layer (the router's rows).
    pub experts: u64,
    /// The experts this rank holds.
    pub local_experts: u64,
    /// The global index of the first of them.
    pub expert_offset: u64,
    /// The ffn channels of each expert this rank holds.
    pub ffn: u64,
    /// Experts a row is sent to.
    pub top_k: u64,
    /// Whether the chosen probabilities are renormalized to sum to one.
    pub normalize: bool,
}

/// The local sizes of a router statistic: `x[rows, hidden]` routed over `experts`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterDims {
    /// Local rows.
    pub rows: u64,
    /// Width of a row.
    pub hidden: u64,
    /// Every expert of the layer.
    pub experts: u64,
}

/// The local sizes and head mapping of an attention kernel, shared by `Kernel::Attention` and its
/// gradients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionDims {
    /// Local batch.
    pub batch: u64,
    /// Local query positions.
    pub sq: u64,
    /// Local key positions.
    pub sk: u64,
    /// Local query heads.
    pub hq: u64,
    /// Local kv heads.
    pub hkv: u64,
    /// Head width.
    pub head_dim: u64,
    /// The global index of local query head 0.
    pub q_head_offset: u64,
    /// The global index of local kv head 0.
    pub kv_head_offset: u64,
    /// Query heads a kv head (global heads / global kv heads).
    pub group: u64,
    /// Mask keys after the query.
    pub causal: bool,
    /// Softmax scale.
    pub scale: f32,
}

/// A compute kernel with its local sizes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Kernel {
    /// `(table[rows, hidden], tokens) -> [tokens, hidden]`; the table holds global rows
    /// `vocab_offset..vocab_offset + rows`, other tokens read zeros.
    Embedding {
        /// Row width.
        hidden: u64,
        /// The first global row the local table holds.
        vocab_offset: u64,
        /// The global vocabulary size (larger ids are errors).
        vocab_total: u64,
    },
    /// RMSNorm over rows of `hidden`.
    RmsNorm {
        /// Row width.
        hidden: u64,
        /// Epsilon.
        eps: f64,
    },
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`.
    MatMul {
        /// Rows of x.
        m: u64,
        /// Rows of w.
        n: u64,
        /// The contracted length.
        k: u64,
    },
    /// Rotary embedding on `[batch, seq, heads, head_dim]` with these inverse frequencies.
    Rope {
        /// Local batch.
        batch: u64,
        /// Local sequence.
        seq: u64,
        /// Local heads.
        heads: u64,
        /// Head width.
        head_dim: u64,
        /// `head_dim / 2` inverse frequencies.
        inv_freq: Vec<f32>,
    },
    /// Causal grouped-query attention over local heads.
    Attention {
        /// The sizes and head mapping.
        dims: AttentionDims,
        /// Also return each row's log-sum-exp: the result is then `[batch, sq, hq, head_dim + 1]`,
        /// each row's output followed by the log-sum-exp of its scores (`-inf` when it saw no key),
        /// the state ring attention merges (`MergeAttention`).
        with_lse: bool,
    },
    /// Merges two attention states over disjoint key sets (`[rows, head_dim + 1]` each: a row's
    /// output then its log-sum-exp, as `Attention { with_lse }` writes) into the state over their
    /// union, by the log-sum-exp weights: exact online softmax across blocks.
    MergeAttention {
        /// Query rows (batch · positions · heads).
        rows: u64,
        /// Head width (each row holds `head_dim + 1` elements).
        head_dim: u64,
    },
    /// `silu(gate) * up`.
    SiluMul,
    /// `(gate[rows], y[rows, hidden]) -> sigmoid(gate) * y`, row by row.
    SigmoidScale {
        /// Row width.
        hidden: u64,
    },
    /// `(gate[rows], y[rows, hidden], dy[rows, hidden]) -> [rows]`: `sigmoid'(gate) · (dy · y)` a row.
    SigmoidScaleGradGate {
        /// Row width.
        hidden: u64,
    },
    /// `a + b`, `b` repeating over `a` when shorter (a bias).
    Add,
    /// `a + b + c + ..` over operands of one size, summed left to right (`passes::fuse`).
    Sum,
    /// Reorder dim `dim` of a local tensor of `shape`: slot `i` takes entry `order[i]`.
    Permute {
        /// The local shape.
        shape: Vec<u64>,
        /// The dim reordered.
        dim: usize,
        /// The source of each slot.
        order: Vec<u64>,
    },
    /// A zero-filled result of the output buffer's size; no operands (`reduce_to_root`'s result on
    /// every rank but the root).
    Zeros,
    /// Copy `region` out of a local tensor of `shape`.
    Slice {
        /// The input's local shape.
        shape: Vec<u64>,
        /// Per dim `(start, len)`.
        region: Vec<(u64, u64)>,
    },

    // === Training: the loss and the backward kernels ===
    /// `(logits[batch, seq, vocab], tokens[batch, seq]) -> [1]`: the next-token cross-entropy of the
    /// local rows (position `t` predicts token `t + 1`; the last position has no target), summed and
    /// divided by `terms`, the global count of targets, so the ranks' results sum to the global mean.
    CrossEntropy {
        /// Local batch.
        batch: u64,
        /// The whole sequence (the shift reads the next token in the same block).
        seq: u64,
        /// The whole vocabulary.
        vocab: u64,
        /// Global `batch · (seq - 1)`: the mean's denominator.
        terms: u64,
    },
    /// `(logits, tokens) -> [batch, seq, vocab]`: `(softmax(logits) - onehot(next token)) / terms` for
    /// each position with a target, zeros at the last position.
    CrossEntropyGrad {
        /// Local batch.
        batch: u64,
        /// The whole sequence.
        seq: u64,
        /// The whole vocabulary.
        vocab: u64,
        /// Global `batch · (seq - 1)`.
        terms: u64,
    },
    /// `(logits[batch, seq, vocab], tokens[batch, seq]) -> [1, batch·seq, 3]`: each row's maximum, sum
    /// of `exp(logit - max)` and target logit (zero when the target lies outside the shard) over the
    /// rank's vocab shard `[vocab_offset, vocab_offset + vocab)`, for a vocab-parallel loss.
    LossRowStats {
        /// Local batch.
        batch: u64,
        /// The whole sequence.
        seq: u64,
        /// The rank's vocab shard.
        vocab: u64,
        /// The global id of the shard's first entry.
        vocab_offset: u64,
        /// The whole vocabulary.
        global_vocab: u64,
    },
    /// `(tokens[batch, seq], stats[parts, batch·seq, 3]) -> [1]`: the loss of `CrossEntropy` from the
    /// row statistics of all `parts` vocab shards, gathered.
    CrossEntropyFromStats {
        /// Local batch.
        batch: u64,
        /// The whole sequence.
        seq: u64,
        /// The whole vocabulary, for checking target ids.
        global_vocab: u64,
        /// Global `batch · (seq - 1)`.
        terms: u64,
        /// Vocab shards (ranks of the split).
        parts: u64,
    },
    /// `(logits[batch, seq, vocab], tokens, stats[parts, batch·seq, 3]) -> [batch, seq, vocab]`: the
    /// rank's vocab shard of `CrossEntropyGrad`, normalised by the rows' global log-sum-exp.
    CrossEntropyGradFromStats {
        /// Local batch.
        batch: u64,
        /// The whole sequence.
        seq: u64,
        /// The rank's vocab shard.
        vocab: u64,
        /// The global id of the shard's first entry.
        vocab_offset: u64,
        /// The whole vocabulary.
        global_vocab: u64,
        /// Global `batch · (seq - 1)`.
        terms: u64,
        /// Vocab shards (ranks of the split).
        parts: u64,
    },
    /// `dx[m, k] = dy[m, n] · w[n, k]`: the gradient of `MatMul` with respect to its activation.
    MatMulGradInput {
        /// Rows of dy (the activation's rows).
        m: u64,
        /// Columns of dy, rows of w (the forward result's columns).
        n: u64,
        /// Columns of w (the forward op's contracted length).
        k: u64,
    },
    /// `dw[n, k] = dy[m, n]ᵀ · x[m, k]`: the gradient of `MatMul` with respect to its weight, summed over
    /// the local rows.
    MatMulGradWeight {
        /// Rows of dy and x (summed over).
        m: u64,
        /// Columns of dy (the weight's rows).
        n: u64,
        /// Columns of x (the forward op's contracted length).
        k: u64,
    },
    /// `(x[rows, hidden], weight[hidden], dy[rows, hidden]) -> [rows, hidden]`: per row, with
    /// `r = rsqrt(mean(x²) + eps)` and `g = dy · weight`, `r·g - x·r³·mean(g·x)`.
    RmsNormGradInput {
        /// Row width.
        hidden: u64,
        /// Epsilon.
        eps: f64,
    },
    /// `(x, weight, dy, acc) -> acc + RmsNormGradInput(x, weight, dy)`: the norm's input gradient
    /// added to the gradient already gathered (`passes::fuse`), never stored on its own.
    RmsNormGradInputAdd {
        /// Row width.
        hidden: u64,
        /// Epsilon.
        eps: f64,
    },
    /// `(x[rows, hidden], dy[rows, hidden]) -> [hidden]`: `Σ over the local rows of dy · x · r`.
    RmsNormGradWeight {
        /// Row width.
        hidden: u64,
        /// Epsilon.
        eps: f64,
    },
    /// The transpose of `Rope` on `[batch, seq, heads, head_dim]`: the rotation by the opposite angles.
    RopeGrad {
        /// Local batch.
        batch: u64,
        /// Local sequence.
        seq: u64,
        /// Local heads.
        heads: u64,
        /// Head width.
        head_dim: u64,
        /// `head_dim / 2` inverse frequencies.
        inv_freq: Vec<f32>,
    },
    /// `(q, k, v, q_pos, k_pos, dy) -> d(wrt)`: a gradient of `Attention` over the local query heads,
    /// recomputing the softmax a query row at a time. The sizes and head mapping are `Attention`'s;
    /// the key and value gradients cover the `hkv` local kv heads and sum the contributions of the
    /// local query heads only (a partial sum when the query heads are split and the kv heads are not).
    AttentionGrad {
        /// Which operand the gradient is taken with respect to.
        wrt: AttentionOperand,
        /// The forward kernel's sizes and head mapping.
        dims: AttentionDims,
    },
    /// `(gate, up, dy) -> dy · up · silu'(gate)`, elementwise.
    SiluMulGradGate,
    /// `(x[rows, hidden], router[experts, hidden], gate[local_experts, ffn, hidden], up (as gate),
    /// down[local_experts, hidden, ffn]) -> [rows, hidden]`: the rank's summand of the mixture of
    /// experts (`MoeMlp`): every row routed with the whole router, the experts the rank holds run as
    /// one grouped GEMM chain each.
    MoeMlp {
        /// Sizes and the experts held.
        dims: MoeDims,
    },
    /// `(x[rows, hidden], router[experts, hidden]) -> [experts]`: the slots top-`top_k` routing sends
    /// to each expert, times `scale`.
    ExpertCounts {
        /// Sizes.
        dims: RouterDims,
        /// Experts a row is sent to.
        top_k: u64,
        /// The factor of every count.
        scale: f64,
    },
    /// `(x, router) -> [experts]`: the rows' router probabilities, summed.
    RouterProbSum {
        /// Sizes.
        dims: RouterDims,
    },
    /// `(x, router, dy[experts]) -> x's or the router's local type`: the gradient of
    /// `RouterProbSum` with respect to `wrt` (`Input` or `Router`).
    RouterProbSumGrad {
        /// The operand differentiated.
        wrt: pleat_ir::MoeOperand,
        /// Sizes.
        dims: RouterDims,
    },
    /// `(counts[experts], probabilities[experts]) -> [1]`: their dot product.
    LoadBalancingLoss {
        /// The experts.
        experts: u64,
    },
    /// `(x, router, gate, up, down, dy[rows, hidden]) -> the operand's local type`: the rank's
    /// summand of the gradient of `MoeMlp` with respect to `wrt`.
    MoeMlpGrad {
        /// The operand differentiated.
        wrt: pleat_ir::MoeOperand,
        /// Sizes and the experts held.
        dims: MoeDims,
    },
    /// `(dy[tokens, hidden], tokens) -> [rows, hidden]`: the gradient of `Embedding`'s table block that
    /// holds global rows `vocab_offset..vocab_offset + rows`; row `v` sums dy over the tokens equal to
    /// `vocab_offset + v`, and tokens outside the block contribute nothing.
    EmbeddingGrad {
        /// Row width.
        hidden: u64,
        /// The first global row of the block.
        vocab_offset: u64,
        /// The global vocabulary size (larger ids are errors).
        vocab_total: u64,
    },
    /// `x[.., width] -> [width]`: the sum over every leading element (the trailing dims kept, flattened
    /// into `width`; `width = 1` sums everything).
    SumLeading {
        /// Elements kept: the product of the local kept dims.
        width: u64,
    },
}

impl Kernel {
    /// Multiplies the target count a loss kernel divides by (`terms`) by `factor`, and divides the
    /// load-balancing loss's count scale by it; other kernels are unchanged. Pipelining divides
    /// each micro-batch's cross-entropy by every micro-batch's targets, and takes the mean of the
    /// micro-batches' load-balancing losses.
    pub fn scale_loss_terms(&mut self, factor: u64) {
        match self {
            Kernel::CrossEntropy { terms, .. }
            | Kernel::CrossEntropyGrad { terms, .. }
            | Kernel::CrossEntropyFromStats { terms, .. }
            | Kernel::CrossEntropyGradFromStats { terms, .. } => *terms *= factor,
            // The load-balancing loss (and so its gradient) is a micro-batch's own, averaged.
            Kernel::ExpertCounts { scale, .. } => *scale /= factor as f64,
            _ => {}
        }
    }
}

/// Which operand of attention a gradient kernel differentiates with respect to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionOperand {
    /// The queries: the result is shaped as `q`.
    Query,
    /// The keys: the result is shaped as `k`.
    Key,
    /// The values: the result is shaped as `v`.
    Value,
}

/// Which of a rank's communication streams runs a transfer.
///
/// Transfers on one stream run one after another in the order they were started. A weight
/// prefetch (a broadcast or gather whose operands are only loaded parameters) may run on a second
/// stream, so that it travels while the main stream waits for the compute its next transfer needs
/// instead of queueing behind that transfer. The two share the rank's links. A runtime with one
/// stream runs both in start order, which is always safe: every rank issues its transfers in the
/// order `crate::verify_collectives` checked, each blocking.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TransferStream {
    /// Collectives, sends and receives, in program order.
    #[default]
    Main,
    /// Weight prefetches, in their own program order.
    Prefetch,
}

/// One step of a program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Instr {
    /// Reads `region` of checkpoint tensor `name` (global shape `shape`) into `out`.
    LoadParam {
        /// Destination.
        out: BufferId,
        /// Checkpoint name.
        name: String,
        /// Global shape in the model's view.
        shape: Vec<u64>,
        /// The rank's block.
        region: Vec<(u64, u64)>,
    },
    /// Reads the rank's block `[batch, seq]` of the token ids.
    LoadTokens {
        /// Destination.
        out: BufferId,
        /// The block.
        region: Vec<(u64, u64)>,
    },
    /// Reads the rank's block of the positions.
    LoadPositions {
        /// Destination.
        out: BufferId,
        /// The block.
        region: Vec<(u64, u64)>,
    },
    /// Runs a kernel.
    Kernel {
        /// The kernel.
        kernel: Kernel,
        /// Operands.
        inputs: Vec<BufferId>,
        /// Result.
        out: BufferId,
    },
    /// Sums each of `inputs` over `group` into the `outs` at the same place. More than one is a
    /// bucket (`crate::bucket`): one message for several gradients, packed while it runs.
    AllReduce {
        /// Operands.
        inputs: Vec<BufferId>,
        /// Results, one for each operand, of its shape.
        outs: Vec<BufferId>,
        /// The group.
        group: Group,
    },
    /// Sums each of `inputs` over `group` and keeps this rank's block of its dim in `dims` in the
    /// `outs` at the same place. More than one is a bucket (`crate::bucket`): one message for
    /// several gradients, each rank's blocks packed together while it runs.
    ReduceScatter {
        /// Operands.
        inputs: Vec<BufferId>,
        /// Results, one for each operand.
        outs: Vec<BufferId>,
        /// The group.
        group: Group,
        /// The dim index each operand is split on.
        dims: Vec<usize>,
    },
    /// Concatenates the group's blocks of dim `dim`.
    AllGather {
        /// Operand.
        input: BufferId,
        /// Result.
        out: BufferId,
        /// The group.
        group: Group,
        /// The dim index gathered.
        dim: usize,
        /// The stream it runs on.
        #[serde(default)]
        stream: TransferStream,
    },
    /// Re-splits a tensor over `group`: the input is this rank's block of dim `gather_dim` (whole on
    /// `split_dim`); the output is this rank's block of `split_dim` (whole on `gather_dim`). Block `j`
    /// of `split_dim` goes to member `j`, so each rank sends (D-1)/D of its input.
    AllToAll {
        /// Operand.
        input: BufferId,
        /// Result.
        out: BufferId,
        /// The group.
        group: Group,
        /// The dim index the result is split on.
        split_dim: usize,
        /// The dim index the input is split on, whole in the result.
        gather_dim: usize,
    },
    /// The mixture of experts with its rows dispatched over `group` (expert parallelism's
    /// all-to-all): every member routes its rows with the whole router, exchanges with each member
    /// how many (row, expert) pairs it sends it, sends those rows (with the gradient's rows, in
    /// the backward) to the member holding the expert, runs the rows it receives through its own
    /// `dims.local_experts` experts, and sends the results back, which it combines.
    ///
    /// Operands: `x`, router, gate, up, down, and the output's gradient when `wrts` is not empty.
    /// Results: the mixture's output (forward, `wrts` empty), or one gradient an entry of `wrts`,
    /// in that order. How many rows travel depends on the routing, so the messages are sized at
    /// run time; the staging the memory plan counts is the copy of the operands.
    ExpertDispatch {
        /// x, router, gate, up, down (and dy).
        inputs: Vec<BufferId>,
        /// The output, or the gradients.
        outs: Vec<BufferId>,
        /// The operands differentiated; empty for the forward.
        wrts: Vec<pleat_ir::MoeOperand>,
        /// The members holding the experts (member `j` holds experts `j·local_experts..`).
        group: Group,
        /// Local sizes and the experts this rank holds.
        dims: MoeDims,
    },
    /// Every member of `group` receives `root`'s buffers: on the root, `inputs[i]` is copied to
    /// `outs[i]`; elsewhere `inputs` only give the sizes. The buffers travel packed as one message.
    Broadcast {
        /// The root's buffers.
        inputs: Vec<BufferId>,
        /// Where every member puts them.
        outs: Vec<BufferId>,
        /// The group.
        group: Group,
        /// The index in `group.ranks` of the sender.
        root: usize,
        /// The stream it runs on.
        #[serde(default)]
        stream: TransferStream,
    },
    /// Starts sending `bufs`, packed as one message, to rank `peer`. It never waits: the message is
    /// queued, so the computation after it overlaps the transfer.
    Send {
        /// The buffers sent.
        bufs: Vec<BufferId>,
        /// The receiving rank.
        peer: u32,
    },
    /// Waits for the message from rank `peer` and unpacks it into `outs`.
    Recv {
        /// The buffers written.
        outs: Vec<BufferId>,
        /// The sending rank.
        peer: u32,
    },
    /// Waits for the message from rank `from`, unpacks it into `outs`, and passes the same message
    /// on to rank `to`: one hop of a ring that forwards what it receives (`crate::relay`). On a
    /// communication stream the forward follows the arrival there, so the hops go round at the
    /// link's pace whatever the compute stream is doing; its `Wait` ends once the message has
    /// arrived, and the forward, like a `Send`, is never waited for.
    Relay {
        /// The buffers written, and forwarded.
        outs: Vec<BufferId>,
        /// The sending rank.
        from: u32,
        /// The rank the message goes on to.
        to: u32,
    },
    /// Hands buffer `buf`, block `region` of graph output `index` (global shape `shape`), to the caller.
    Output {
        /// The buffer.
        buf: BufferId,
        /// Which graph output.
        index: u32,
        /// Its global shape.
        shape: Vec<u64>,
        /// The block this rank holds.
        region: Vec<(u64, u64)>,
    },
    /// Releases a buffer after its last use.
    Free {
        /// The buffer.
        buf: BufferId,
    },
    /// Waits for the transfer that an earlier transfer instruction started: the earliest one whose
    /// [`Instr::transfer_handle`] is `handle` and that no earlier `Wait` named
    /// (`crate::transfers`).
    ///
    /// A transfer instruction (a collective, `Send`, `Recv`) starts its transfer on the rank's
    /// communication stream. When a later `Wait` names it, the transfer is asynchronous: the
    /// instructions between run beside it, and none of them may read its results or free (or
    /// overwrite) what it reads or writes. A transfer no `Wait` names completes before the next
    /// instruction. The transfers of a stream ([`TransferStream`]) run one after another in
    /// program order on every rank.
    Wait {
        /// The transfer's handle: the buffers it writes, or a `Send`'s buffers.
        handle: Vec<BufferId>,
    },
}

impl Instr {
    /// Whether the instruction starts a transfer on the communication stream.
    pub fn is_transfer(&self) -> bool {
        matches!(
            self,
            Instr::AllReduce { .. }
                | Instr::ReduceScatter { .. }
                | Instr::AllGather { .. }
                | Instr::AllToAll { .. }
                | Instr::Broadcast { .. }
                | Instr::Send { .. }
                | Instr::Recv { .. }
                | Instr::Relay { .. }
                | Instr::ExpertDispatch { .. }
        )
    }

    /// The communication stream a transfer runs on (`Main` for any other instruction).
    pub fn transfer_stream(&self) -> TransferStream {
        match self {
            Instr::AllGather { stream, .. } | Instr::Broadcast { stream, .. } => *stream,
            _ => TransferStream::Main,
        }
    }

    /// The instruction with its transfer on `stream`; unchanged unless it is a broadcast or an
    /// all-gather, the transfers that prefetch weights.
    pub fn on_stream(mut self, stream: TransferStream) -> Instr {
        if let Instr::AllGather { stream: on, .. } | Instr::Broadcast { stream: on, .. } = &mut self {
            *on = stream;
        }
        self
    }

    /// The buffers a `Wait` names a transfer by: those it writes, or a `Send`'s buffers; `None`
    /// for an instruction that is not a transfer.
    pub fn transfer_handle(&self) -> Option<Vec<BufferId>> {
        match self {
            Instr::Send { bufs, .. } => Some(bufs.clone()),
            transfer if transfer.is_transfer() => Some(transfer.outs()),
            _ => None,
        }
    }

    /// The buffers the instruction writes.
    pub fn outs(&self) -> Vec<BufferId> {
        match self {
            Instr::Broadcast { outs, .. }
            | Instr::Recv { outs, .. }
            | Instr::Relay { outs, .. }
            | Instr::ExpertDispatch { outs, .. }
            | Instr::AllReduce { outs, .. }
            | Instr::ReduceScatter { outs, .. } => outs.clone(),
            other => other.out().into_iter().collect(),
        }
    }

    /// The single buffer the instruction writes, if it writes exactly one.
    pub fn out(&self) -> Option<BufferId> {
        match self {
            Instr::Broadcast { .. }
            | Instr::Send { .. }
            | Instr::Recv { .. }
            | Instr::Relay { .. }
            | Instr::ExpertDispatch { .. } => None,
            Instr::AllReduce { outs, .. } | Instr::ReduceScatter { outs, .. } => match outs.as_slice() {
                [out] => Some(*out),
                _ => None,
            },
            Instr::LoadParam { out, .. }
            | Instr::LoadTokens { out, .. }
            | Instr::LoadPositions { out, .. }
            | Instr::Kernel { out, .. }
            | Instr::AllGather { out, .. }
            | Instr::AllToAll { out, .. } => Some(*out),
            Instr::Output { .. } | Instr::Free { .. } | Instr::Wait { .. } => None,
        }
    }
    /// The buffers the instruction reads.
    pub fn inputs(&self) -> Vec<BufferId> {
        match self {
            Instr::Kernel { inputs, .. } => inputs.clone(),
            Instr::AllGather { input, .. } | Instr::AllToAll { input, .. } => vec![*input],
            Instr::Output { buf, .. } => vec![*buf],
            Instr::Broadcast { inputs, .. }
            | Instr::ExpertDispatch { inputs, .. }
            | Instr::AllReduce { inputs, .. }
            | Instr::ReduceScatter { inputs, .. } => inputs.clone(),
            Instr::Send { bufs, .. } => bufs.clone(),
            Instr::Recv { .. } | Instr::Relay { .. } => Vec::new(),
            Instr::LoadParam { .. }
            | Instr::LoadTokens { .. }
            | Instr::LoadPositions { .. }
            | Instr::Free { .. }
            | Instr::Wait { .. } => Vec::new(),
        }
    }
    /// The group of a collective.
    pub fn group(&self) -> Option<&Group> {
        match self {
            Instr::AllReduce { group, .. }
            | Instr::ReduceScatter { group, .. }
            | Instr::AllGather { group, .. }
            | Instr::AllToAll { group, .. }
            | Instr::Broadcast { group, .. }
            | Instr::ExpertDispatch { group, .. } => Some(group),
            _ => None,
        }
    }
}

/// One rank's program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// `FORMAT_VERSION` when written.
    pub format_version: u32,
    /// The model's name.
    pub model: String,
    /// The mesh, as `dp=2,tp=4`.
    pub mesh: String,
    /// This rank.
    pub rank: u32,
    /// Ranks in the mesh.
    pub world_size: u32,
    /// The global `[batch, seq]` of the token input.
    pub tokens_shape: Vec<u64>,
    /// Buffers, indexed by `BufferId`.
    pub buffers: Vec<Buffer>,
    /// The steps, in order.
    pub instructions: Vec<Instr>,
}

impl Program {
    /// The buffer `id`.
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.as_u32() as usize]
    }
}
