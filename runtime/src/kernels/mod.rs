//! The CPU compute kernels of pleat's runtime: the fast path that executes a rank's program.
//!
//! Every kernel works on f32 data in row-major, contiguous slices, and knows nothing of the IR, of
//! sharding specs or of other pleat crates: callers pass plain dimensions. Kernels are single-threaded
//! unless they take a `threads` argument, because ranks already run as threads of one process.
//!
//! Guarantees:
//! - Results match a plain loop over the same formula to f32 rounding (each module's tests check this
//!   against a naive, independent computation).
//! - Kernels whose failure depends on data (token ids, head layout, buffer sizes given with the call)
//!   return [`KernelError`]. Kernels with no `Result` treat buffer lengths that disagree with their
//!   dimensions as a broken caller (the executor sizes buffers from a verified program) and panic
//!   with the same message [`KernelError`] would render; each documents this under `# Panics`.
//!
//! What this module is not: an oracle. The reference interpreter (`ir::interp`) stays independent.

mod attention;
mod attention_grad;
mod elementwise;
mod grad;
mod layout;
mod loss;
mod matmul;
mod moe;
mod norm;
mod rope;
mod row_grad;
mod vocab_loss;

pub use attention::{attention, attention_with_lse, merge_attention, AttentionShape};
pub use attention_grad::{attention_grad, AttentionGradOperand};
pub use elementwise::{
    add, add_in_place, check_token_ids, embedding, sigmoid_scale, sigmoid_scale_grad_gate, silu_mul,
};
pub use grad::{embedding_grad, matmul_grad_input, matmul_grad_weight, sum_leading};
pub use layout::{join_dim_chunks, slice_region, split_dim_chunks};
pub use loss::{cross_entropy, cross_entropy_grad, LossShape};
pub use matmul::matmul_nt;
pub use moe::{
    expert_backward, expert_counts, expert_forward, moe_mlp, moe_mlp_grad, route, route_backward, router_prob_sum,
    router_prob_sum_grad, ExpertBackward, ExpertGrads, ExpertWeights, MoeGradOperand, MoeShape, Routing,
};
pub use norm::rms_norm;
pub use rope::{rope_grad_in_place, rope_in_place};
pub use row_grad::{rms_norm_grad_input, rms_norm_grad_weight, silu_mul_grad_gate};
pub use vocab_loss::{
    cross_entropy_from_stats, cross_entropy_grad_from_stats, loss_row_stats, VocabShardShape, STATS_PER_ROW,
};

/// Everything a kernel can reject. Messages name the kernel and the offending tensor or index.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum KernelError {
    // === Buffers ===
    /// A buffer's length disagrees with the dimensions passed with it.
    #[error(
        "{kernel}: {tensor} has {got} elements but the dimensions given need {expected}; \
         pass a buffer sized to the kernel's dimensions"
    )]
    #[diagnostic(code(E0650), help("pass a buffer sized to the kernel's dimensions"))]
    LengthMismatch {
        /// The kernel that checked the buffer.
        kernel: &'static str,
        /// Which argument is wrong.
        tensor: &'static str,
        /// Elements implied by the dimensions.
        expected: usize,
        /// Elements in the buffer.
        got: usize,
    },
    /// A count that must split evenly does not.
    #[error("{kernel}: {what} = {count} is not divisible by {divisor}; make {what} a multiple of {divisor}")]
    #[diagnostic(code(E0651), help("make the count a multiple of the divisor"))]
    NotDivisible {
        /// The kernel that checked the count.
        kernel: &'static str,
        /// What the count measures.
        what: &'static str,
        /// The count.
        count: usize,
        /// What it must divide by.
        divisor: usize,
    },
    /// A dimension or count that must be positive is zero.
    #[error("{kernel}: {what} is 0; it must be at least 1")]
    #[diagnostic(code(E0652), help("give the dimension a size of at least 1"))]
    ZeroDim {
        /// The kernel that checked it.
        kernel: &'static str,
        /// Which dimension.
        what: &'static str,
    },

    // === Layout ===
    /// A dimension index past the tensor's rank.
    #[error("{kernel}: dim {dim} is out of range for a tensor of rank {rank}; use a dim below {rank}")]
    #[diagnostic(code(E0653), help("name a dimension within the tensor's rank"))]
    DimOutOfRange {
        /// The kernel that checked it.
        kernel: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// A region that reaches past the end of a dimension.
    #[error(
        "slice_region: dim {dim} asks for [{start}, {start} + {len}) but the dim has size {size}; \
         keep start + len <= {size}"
    )]
    #[diagnostic(code(E0654), help("keep the region inside the tensor"))]
    RegionOutOfBounds {
        /// The dimension.
        dim: usize,
        /// First index of the region.
        start: usize,
        /// Length of the region.
        len: usize,
        /// Size of the dimension.
        size: usize,
    },

    // === Embedding ===
    /// A token id outside the vocabulary.
    #[error(
        "embedding: token at position {position} has id {token} but the vocabulary has {vocab_size} \
         entries; check the tokenizer matches the model"
    )]
    #[diagnostic(code(E0655), help("use token ids below the vocabulary size"))]
    TokenOutOfRange {
        /// Index of the token in the input.
        position: usize,
        /// Its id.
        token: u32,
        /// Size of the global vocabulary.
        vocab_size: usize,
    },
    /// A vocabulary shard that reaches past the global vocabulary.
    #[error(
        "embedding: the table shard holds rows [{vocab_offset}, {vocab_offset} + {rows}) but the \
         vocabulary has {vocab_size} entries; shard the table within the vocabulary"
    )]
    #[diagnostic(code(E0656), help("use a shard index below the shard count"))]
    ShardOutOfRange {
        /// First global row held.
        vocab_offset: usize,
        /// Rows held.
        rows: usize,
        /// Size of the global vocabulary.
        vocab_size: usize,
    },

    /// A next-token target outside the vocabulary (the loss kernels).
    #[error(
        "{kernel}: target at position {position} has id {token} but the vocabulary has {vocab_size} \
         entries; check the tokenizer matches the model"
    )]
    #[diagnostic(code(E0657), help("use target ids below the vocabulary size"))]
    TargetOutOfRange {
        /// The kernel that read the target.
        kernel: &'static str,
        /// Index of the token in the block.
        position: usize,
        /// Its id.
        token: u32,
        /// Size of the vocabulary.
        vocab_size: usize,
    },

    // === Attention ===
    /// A query head whose kv head lives on another rank.
    #[error(
        "attention: query head {query_head} needs kv head {kv_head}, but this rank holds kv heads \
         [{kv_head_offset}, {kv_head_offset} + {local_kv_heads}); shard query and kv heads together"
    )]
    #[diagnostic(code(E0658), help("split heads so each rank holds its key/value heads"))]
    KvHeadNotLocal {
        /// Global index of the query head.
        query_head: usize,
        /// Global index of the kv head it reads.
        kv_head: usize,
        /// First global kv head held locally.
        kv_head_offset: usize,
        /// Number of kv heads held locally.
        local_kv_heads: usize,
    },
}

/// Returns `Ok` when `got == expected`, else a [`KernelError::LengthMismatch`].
fn check_len(kernel: &'static str, tensor: &'static str, expected: usize, got: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { kernel, tensor, expected, got })
    }
}

/// Unwraps, panicking with the error's message: for kernels whose signature has no `Result` (see
/// the module docs).
#[track_caller]
fn expect_valid<T>(result: Result<T, KernelError>) -> T {
    match result {
        Ok(value) => value,
        Err(error) => panic!("{error}"),
    }
}

/// Deterministic test data and comparison shared by the kernels' tests.
#[cfg(test)]
mod test_util {
    /// Pseudo-random values in [-1, 1) from a fixed seed (a 64-bit LCG), so tests need no crate.
    pub fn values(count: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Asserts `got` is within `tolerance * (1 + |want|)` of `want` everywhere, naming the worst element.
    #[track_caller]
    pub fn assert_close(got: &[f32], want: &[f64], tolerance: f64) {
        assert_eq!(got.len(), want.len(), "length differs");
        let mut worst: Option<(usize, f64)> = None;
        for (index, (&got_value, &want_value)) in got.iter().zip(want).enumerate() {
            let excess = (got_value as f64 - want_value).abs() / (1.0 + want_value.abs());
            // A NaN anywhere is the worst possible error.
            let excess = if excess.is_nan() { f64::INFINITY } else { excess };
            if excess > tolerance && worst.is_none_or(|(_, worst_excess)| excess > worst_excess) {
                worst = Some((index, excess));
            }
        }
        if let Some((index, excess)) = worst {
            panic!(
                "element {index}: got {}, want {} (relative error {excess:e} > {tolerance:e})",
                got[index], want[index]
            );
        }
    }
}
