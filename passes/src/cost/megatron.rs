//! The published reference formulas, written as their authors wrote them, to check the general
//! model against.
//!
//! [`theoretical_memory`] follows Megatron-LM's `megatron/training/theoretical_memory_usage.py`
//! (dense models, no MoE, no MTP, no MLA): the weight-and-optimizer bytes of the most loaded shard
//! (the first pipeline stage) at 18 bytes a parameter, or `6 + 12/dp` with the distributed
//! optimizer, and the activation bytes of the first stage: with sequence parallelism and selective
//! recompute, Table 2's `sbh(18 + 4f/h)` a layer plus the embedding's and the output layer's terms,
//! all over tp; otherwise Megatron's "without SP" branch, `sbh(10 + 24/t)` a layer, the logits in
//! 16 bits, and a 5 % allowance. Its quirks are kept, because reproducing it is the point: the
//! final norm is spread over the pipeline stages, linear biases are not counted, a gated MLP
//! counts as 3/2 of its width in parameters but not in activations.
//!
//! [`korthikanti_layer`] is Table 2 of Korthikanti et al. 2022 ("Reducing Activation
//! Recomputation in Large Transformer Models"), bytes a layer.

/// The Megatron arguments the formulas read (names as Megatron spells them).
#[derive(Clone, Debug, PartialEq)]
pub struct MegatronArgs {
    /// `--num-layers`.
    pub num_layers: u64,
    /// `--hidden-size`.
    pub hidden_size: u64,
    /// `--ffn-hidden-size`.
    pub ffn_hidden_size: u64,
    /// `--num-attention-heads`.
    pub num_attention_heads: u64,
    /// `--num-query-groups` (equal to the heads without GQA).
    pub num_query_groups: u64,
    /// `--kv-channels` (head dim).
    pub kv_channels: u64,
    /// `--swiglu`.
    pub swiglu: bool,
    /// `--normalization RMSNorm` (else LayerNorm).
    pub rms_norm: bool,
    /// The padded vocabulary.
    pub padded_vocab_size: u64,
    /// `--untie-embeddings-and-output-weights`.
    pub untie_embeddings_and_output_weights: bool,
    /// `--seq-length`.
    pub seq_length: u64,
    /// `--micro-batch-size`.
    pub micro_batch_size: u64,
    /// `--tensor-model-parallel-size`.
    pub tensor_model_parallel_size: u64,
    /// `--pipeline-model-parallel-size`.
    pub pipeline_model_parallel_size: u64,
    /// `--num-layers-per-virtual-pipeline-stage` turned into the virtual size, if interleaved.
    pub virtual_pipeline_model_parallel_size: Option<u64>,
    /// The data-parallel size.
    pub data_parallel_size: u64,
    /// `--use-distributed-optimizer`.
    pub use_distributed_optimizer: bool,
    /// `--sequence-parallel`.
    pub sequence_parallel: bool,
    /// `--recompute-granularity selective`.
    pub selective_recompute: bool,
}

/// Megatron's result, in bytes (its function reports MB; these are before that division).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct TheoreticalMemory {
    /// `compute_weight_and_optimizer_memory`.
    pub weight_and_optimizer_bytes: f64,
    /// `compute_activation_memory` or `compute_activation_memory_without_sp`.
    pub activation_bytes: f64,
}

/// Parameters of the most loaded shard, as Megatron counts them.
pub fn most_loaded_shard_params(args: &MegatronArgs) -> f64 {
    let hidden = args.hidden_size as f64;
    let query_projection = (args.kv_channels * args.num_attention_heads) as f64;
    let query_ratio = query_projection / hidden;
    let gated = if args.swiglu { 1.5 } else { 1.0 };
    let norm_size = if args.rms_norm { 1.0 } else { 2.0 };
    let self_attention =
        2.0 * hidden * hidden * ((1.0 + args.num_query_groups as f64 / args.num_attention_heads as f64) * query_ratio);
    let layer = 2.0 * hidden * (args.ffn_hidden_size as f64 * gated + norm_size) + self_attention;
    let embedding = hidden * args.padded_vocab_size as f64;
    let final_norm = norm_size * hidden;
    let block = layer * args.num_layers as f64 + final_norm;
    let tp = args.tensor_model_parallel_size as f64;
    let pp = args.pipeline_model_parallel_size as f64;
    let mut shard = (block / pp + embedding) / tp;
    if args.untie_embeddings_and_output_weights && args.pipeline_model_parallel_size == 1 {
        shard += embedding / tp;
    }
    shard
}

/// `report_theoretical_memory`'s two numbers, in bytes.
pub fn theoretical_memory(args: &MegatronArgs, num_microbatches: Option<u64>) -> TheoreticalMemory {
    let bytes_per_param =
        if args.use_distributed_optimizer { 6.0 + 12.0 / args.data_parallel_size as f64 } else { 18.0 };
    let weight_and_optimizer_bytes = most_loaded_shard_params(args) * bytes_per_param;
    let activation_bytes = if args.sequence_parallel && args.selective_recompute {
        activation_with_sp(args, num_microbatches)
    } else {
        activation_without_sp(args, num_microbatches)
    };
    TheoreticalMemory { weight_and_optimizer_bytes, activation_bytes }
}

fn pipeline_factor(args: &MegatronArgs, num_microbatches: Option<u64>) -> f64 {
    let pp = args.pipeline_model_parallel_size as f64;
    match args.virtual_pipeline_model_parallel_size {
        Some(virtual_size) => 1.0 + (pp - 1.0) / (pp * virtual_size as f64),
        None if args.pipeline_model_parallel_size > 1 => match num_microbatches {
            Some(micro_batches) => f64::min(1.0, micro_batches as f64 / pp),
            None => 1.0,
        },
        None => 1.0,
    }
}

fn activation_with_sp(args: &MegatronArgs, num_microbatches: Option<u64>) -> f64 {
    let (s, b, h) = (args.seq_length as f64, args.micro_batch_size as f64, args.hidden_size as f64);
    let pp = args.pipeline_model_parallel_size as f64;
    let mut memory = s * b * h * (18.0 + 4.0 * (args.ffn_hidden_size as f64 / h));
    memory *= args.num_layers as f64;
    memory += 8.0 * s * b * pp;
    memory += s * b * h * pp;
    memory *= pipeline_factor(args, num_microbatches);
    if args.pipeline_model_parallel_size == 1 {
        memory += s * b * h * 4.0 * (1.0 + args.padded_vocab_size as f64 / h);
    }
    memory / args.tensor_model_parallel_size as f64
}

fn activation_without_sp(args: &MegatronArgs, num_microbatches: Option<u64>) -> f64 {
    let (s, b, h) = (args.seq_length as f64, args.micro_batch_size as f64, args.hidden_size as f64);
    let tp = args.tensor_model_parallel_size as f64;
    let pp = args.pipeline_model_parallel_size as f64;
    let mut memory = s * b * h * (10.0 + 24.0 / tp) * args.num_layers as f64;
    memory += 8.0 * s * b * pp;
    memory += s * b * h * pp;
    memory *= pipeline_factor(args, num_microbatches);
    if args.pipeline_model_parallel_size == 1 {
        let logits = s * b * args.padded_vocab_size as f64 / tp;
        memory += (logits + s * b * h) * 2.0;
    }
    memory * 1.05
}

/// The rows of Korthikanti et al. 2022, Table 2.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Table2Row {
    /// No parallelism: `sbh(34 + 5as/h)`.
    NoParallelism,
    /// Tensor parallel: `sbh(10 + 24/t + 5as/(ht))`.
    TensorParallel,
    /// Tensor and sequence parallel: `sbh/t · (34 + 5as/h)`.
    TensorSequenceParallel,
    /// Tensor parallel, selective recompute: `sbh(10 + 24/t)`.
    TensorParallelSelective,
    /// Tensor and sequence parallel, selective recompute: `sbh·34/t`.
    TensorSequenceParallelSelective,
    /// Full recompute: `2sbh`.
    FullRecompute,
}

/// Bytes of activations a layer, Table 2 row `row`.
pub fn korthikanti_layer(row: Table2Row, s: f64, b: f64, h: f64, a: f64, t: f64) -> f64 {
    let sbh = s * b * h;
    match row {
        Table2Row::NoParallelism => sbh * (34.0 + 5.0 * a * s / h),
        Table2Row::TensorParallel => sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
        Table2Row::TensorSequenceParallel => sbh / t * (34.0 + 5.0 * a * s / h),
        Table2Row::TensorParallelSelective => sbh * (10.0 + 24.0 / t),
        Table2Row::TensorSequenceParallelSelective => sbh * 34.0 / t,
        Table2Row::FullRecompute => 2.0 * sbh,
    }
}
