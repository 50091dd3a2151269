//! What a step does: sequence length, micro-batches, training or inference, and the memory options
//! (activation recompute, ZeRO, the distributed optimizer, flash attention).

use super::{CostError, Result};

/// Training (forward, backward, optimizer step) or inference (one forward pass).
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Mode {
    /// Forward, backward and a mixed-precision Adam step.
    Train,
    /// A prefill forward pass that keeps the KV cache.
    Infer,
}

/// What the forward pass keeps for the backward (Korthikanti et al. 2022, section 5).
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute the attention core (softmax, its dropout, scores times V): drops the `5as/h` term.
    Selective,
    /// Keep only each layer's input; recompute the whole layer in the backward.
    Full,
}

impl Recompute {
    /// The CLI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// One step's work and memory options.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Workload {
    /// Tokens a sequence s.
    pub seq: u64,
    /// Sequences a micro-batch b, per model replica (a data-parallel rank sees b sequences).
    pub micro_batch: u64,
    /// Micro-batches a step m, per replica (gradient accumulation, pipeline micro-batches).
    pub micro_batches: u64,
    /// Training or inference.
    pub mode: Mode,
    /// Activation recompute.
    pub recompute: Recompute,
    /// ZeRO stage over the parameters' replicas (dp, cp, ep): 0 none, 1 optimizer state,
    /// 2 + gradients, 3 + parameters.
    pub zero: u8,
    /// Megatron's distributed optimizer (`--use-distributed-optimizer`): optimizer state and fp32
    /// master weights sharded over dp, 6 + 12/dp bytes a parameter. The same as ZeRO-1.
    pub distributed_optimizer: bool,
    /// Gradients kept in fp32 (Megatron's main grads: 18 bytes a parameter); false keeps them in
    /// the weights' dtype (16 bytes a parameter).
    pub fp32_grads: bool,
    /// Flash-style attention: no `s × s` score matrix is stored (the `5as/h` term vanishes).
    pub flash_attention: bool,
    /// Interleaved pipeline: model chunks a rank (Megatron's virtual pipeline size); 1 is plain 1F1B.
    pub virtual_stages: u64,
    /// TSP shards the embedding and LM head too (rows over the tsp group). False keeps them whole
    /// on every rank, the accounting that reproduces the TSP paper's 16K figures (see `memory`).
    pub tsp_shards_embeddings: bool,
}

impl Workload {
    /// Bytes of a gradient element for weights of `weight_bytes` an element: 4 (fp32) under
    /// `fp32_grads`, else the weights' own.
    pub fn gradient_bytes(&self, weight_bytes: f64) -> f64 {
        if self.fp32_grads {
            4.0
        } else {
            weight_bytes
        }
    }

    /// Training with Megatron's defaults: fp32 gradients, flash attention, no recompute, no ZeRO.
    pub fn training(seq: u64, micro_batch: u64) -> Workload {
        Workload {
            seq,
            micro_batch,
            micro_batches: 1,
            mode: Mode::Train,
            recompute: Recompute::None,
            zero: 0,
            distributed_optimizer: false,
            fp32_grads: true,
            flash_attention: true,
            virtual_stages: 1,
            tsp_shards_embeddings: false,
        }
    }

    /// Inference (prefill) of `micro_batch` sequences of `seq` tokens.
    pub fn inference(seq: u64, micro_batch: u64) -> Workload {
        Workload { mode: Mode::Infer, ..Workload::training(seq, micro_batch) }
    }

    /// Tokens a micro-batch of one replica.
    pub fn tokens_per_micro_batch(&self) -> u64 {
        self.seq * self.micro_batch
    }

    /// Checks sizes and the ZeRO stage.
    pub fn validate(&self) -> Result<()> {
        for (what, value) in [
            ("seq", self.seq),
            ("batch", self.micro_batch),
            ("micro-batches", self.micro_batches),
            ("virtual stages", self.virtual_stages),
        ] {
            if value == 0 {
                return Err(CostError::Zero { what });
            }
        }
        if self.zero > 3 {
            return Err(CostError::ZeroStage { stage: self.zero });
        }
        Ok(())
    }
}
