//! The synthetic token stream training runs on when no data is given: deterministic, different at
//! every step, and learnable.
//!
//! Sequence `b` of step `s` starts at a pseudo-random token drawn from `(seed, s, b)` and then
//! follows `next = (5·token + 3) mod vocab`: every token after the first is a fixed function of the
//! one before, so a model that learns the map drives the loss of those positions towards zero, while
//! the first token of each sequence stays unpredictable. The stream is a pure function of its
//! arguments: every rank, and the reference, see the same tokens.

/// Tokens `[batch, seq]` row-major of step `step`.
pub fn synthetic_tokens(seed: u64, step: u64, batch: u64, seq: u64, vocab: u64) -> Vec<u32> {
    let vocab = vocab.max(1);
    let mut tokens = Vec::with_capacity((batch * seq) as usize);
    for sequence in 0..batch {
        let mut token = mix(seed ^ mix(step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ sequence)) % vocab;
        for _ in 0..seq {
            tokens.push(token as u32);
            token = (5 * token + 3) % vocab;
        }
    }
    tokens
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash.
fn mix(mut value: u64) -> u64 {
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_in_range_and_following_the_map() {
        let tokens = synthetic_tokens(7, 3, 4, 16, 256);
        assert_eq!(tokens, synthetic_tokens(7, 3, 4, 16, 256));
        assert_ne!(tokens, synthetic_tokens(7, 4, 4, 16, 256), "another step, other tokens");
        assert!(tokens.iter().all(|&token| token < 256));
        for row in tokens.chunks(16) {
            assert!(row.windows(2).all(|pair| pair[1] == (5 * pair[0] + 3) % 256));
        }
        let starts: std::collections::HashSet<u32> = tokens.chunks(16).map(|row| row[0]).collect();
        assert!(starts.len() > 1, "sequences start at different tokens");
    }
}
