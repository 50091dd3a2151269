//! Deterministic synthetic weights for runs without a checkpoint.
//!
//! Each element is a pure function of `(seed, tensor name, flat index in the model's view)`, computed with a
//! counter-based hash, so any rank can produce any slice on its own and the single-device reference sees the
//! same numbers. The result is bit-identical on every platform: the hash is integer arithmetic and the
//! uniform sample is a 24-bit integer scaled exactly into `f32`.
//!
//! Exactly: `key = splitmix64(seed ^ fnv1a64(name))`, `bits = splitmix64(key + flat_index)` (wrapping),
//! `u = 2 * (bits >> 40) / 2^24 - 1`, with splitmix64 including its `+ 0x9e3779b97f4a7c15` step.
//!
//! Distribution, chosen by name (with `u` uniform in `[-1, 1)`):
//!
//! | name | value | why |
//! | --- | --- | --- |
//! | ends with `norm.weight` (`model.norm.weight`, `...input_layernorm.weight`) | `1 + 0.1 u` | RMSNorm gains near 1 |
//! | contains `embed_tokens` | `u sqrt(3)` | unit variance embeddings |
//! | anything else (linear weights) | `u sqrt(3) / sqrt(fan_in)` | unit variance outputs for unit variance inputs |
//!
//! `fan_in` is the last dim of the shape given to [`WeightSource::read`] (Hugging Face stores linear weights
//! as `[out, in]`), or 1 for a scalar or an empty last dim. Reading the same tensor with a view of a
//! different last dim therefore gives different numbers; views that only split leading dims agree.

use super::region::{check_region, for_each_run};
use super::{WeightError, WeightSource};

/// Synthetic weights drawn from a seed; see the module documentation for the distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeededWeights {
    seed: u64,
}

impl SeededWeights {
    /// Weights drawn from `seed`. Two instances with the same seed produce the same numbers.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// The seed these weights are drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl WeightSource for SeededWeights {
    fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<Vec<f32>, WeightError> {
        let count = check_region(name, shape, region)?;
        let (offset, scale) = distribution(name, shape);
        let tensor_key = splitmix64(self.seed ^ fnv1a(name));
        let mut values = Vec::with_capacity(count);
        for_each_run(shape, region, |flat_start, run_len| {
            values.extend(
                (flat_start..flat_start + run_len)
                    .map(|flat_index| offset + scale * uniform_sample(tensor_key, flat_index)),
            );
        });
        Ok(values)
    }
}

/// `(offset, scale)` such that an element is `offset + scale * u`.
fn distribution(name: &str, shape: &[u64]) -> (f32, f32) {
    if name.ends_with("norm.weight") {
        (1.0, 0.1)
    } else if name.contains("embed_tokens") {
        (0.0, 3f64.sqrt() as f32)
    } else {
        let fan_in = shape.last().copied().unwrap_or(1).max(1);
        (0.0, (3f64.sqrt() / (fan_in as f64).sqrt()) as f32)
    }
}

/// Uniform in `[-1, 1)` from the tensor's key and an element's flat index.
fn uniform_sample(tensor_key: u64, flat_index: u64) -> f32 {
    let bits = splitmix64(tensor_key.wrapping_add(flat_index));
    // The top 24 bits fit f32's mantissa exactly, so the scaling and the shift below round nowhere.
    let unit = (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
    2.0 * unit - 1.0
}

/// splitmix64 (Steele, Lea and Flood 2014): a bijective 64-bit mixer, used as a counter-based generator.
fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of the name's bytes: a fixed, platform-independent hash (std's hasher is not).
fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q_PROJ: &str = "model.layers.0.self_attn.q_proj.weight";

    /// The region of a full read, sliced by explicit multi-index loops (independent of `for_each_run`).
    fn slice_2d(full: &[f32], columns: u64, region: &[(u64, u64)]) -> Vec<f32> {
        let mut out = Vec::new();
        for row in region[0].0..region[0].0 + region[0].1 {
            for column in region[1].0..region[1].0 + region[1].1 {
                out.push(full[(row * columns + column) as usize]);
            }
        }
        out
    }

    fn full_region(shape: &[u64]) -> Vec<(u64, u64)> {
        shape.iter().map(|&dim| (0, dim)).collect()
    }

    #[test]
    fn a_region_equals_the_same_slice_of_the_full_tensor() {
        let weights = SeededWeights::new(7);
        let shape = [12u64, 10];
        let full = weights.read(Q_PROJ, &shape, &full_region(&shape)).unwrap();
        for region in [vec![(0, 6), (0, 10)], vec![(6, 6), (0, 10)], vec![(3, 4), (2, 5)], vec![(11, 1), (9, 1)]] {
            let part = weights.read(Q_PROJ, &shape, &region).unwrap();
            assert_eq!(part, slice_2d(&full, 10, &region), "{region:?}");
        }
    }

    #[test]
    fn split_leading_dims_read_the_same_numbers() {
        let weights = SeededWeights::new(3);
        let merged = weights.read(Q_PROJ, &[128, 16], &[(0, 128), (0, 16)]).unwrap();
        let split = weights.read(Q_PROJ, &[8, 16, 16], &[(0, 8), (0, 16), (0, 16)]).unwrap();
        assert_eq!(merged, split);
        // Head 2, dims 4..12 of head_dim: rows 2*16+4 .. 2*16+12 of the merged view.
        let head = weights.read(Q_PROJ, &[8, 16, 16], &[(2, 1), (4, 8), (0, 16)]).unwrap();
        assert_eq!(head, slice_2d(&merged, 16, &[(36, 8), (0, 16)]));
    }

    #[test]
    fn same_seed_same_numbers_other_seed_or_name_other_numbers() {
        let shape = [4u64, 8];
        let region = full_region(&shape);
        let first = SeededWeights::new(42).read(Q_PROJ, &shape, &region).unwrap();
        let second = SeededWeights::new(42).read(Q_PROJ, &shape, &region).unwrap();
        assert_eq!(first, second);
        let other_seed = SeededWeights::new(43).read(Q_PROJ, &shape, &region).unwrap();
        let other_name = SeededWeights::new(42).read("model.layers.0.self_attn.k_proj.weight", &shape, &region);
        assert_ne!(first, other_seed);
        assert_ne!(first, other_name.unwrap());
    }

    #[test]
    fn values_follow_the_documented_distribution() {
        let weights = SeededWeights::new(1);
        let fan_in = 64u64;
        let linear = weights.read(Q_PROJ, &[256, fan_in], &[(0, 256), (0, fan_in)]).unwrap();
        let bound = 3f32.sqrt() / (fan_in as f32).sqrt();
        assert!(linear.iter().all(|&value| (-bound..bound).contains(&value)));
        let variance = linear.iter().map(|&value| f64::from(value).powi(2)).sum::<f64>() / linear.len() as f64;
        assert!((variance * fan_in as f64 - 1.0).abs() < 0.1, "variance {variance}");

        for name in ["model.norm.weight", "model.layers.3.post_attention_layernorm.weight"] {
            let gains = weights.read(name, &[512], &[(0, 512)]).unwrap();
            assert!(gains.iter().all(|&value| (0.9..1.1).contains(&value)), "{name}");
        }

        let embedding = weights.read("model.embed_tokens.weight", &[64, 64], &[(0, 64), (0, 64)]).unwrap();
        assert!(embedding.iter().all(|&value| (-3f32.sqrt()..3f32.sqrt()).contains(&value)));
        let mean_square = embedding.iter().map(|&value| f64::from(value).powi(2)).sum::<f64>() / 4096.0;
        assert!((mean_square - 1.0).abs() < 0.1, "mean square {mean_square}");
    }

    #[test]
    fn values_are_pinned_for_a_known_seed() {
        // Independent recomputation of the documented formula for element 5 of a norm and a linear weight.
        let key = |name: &str| splitmix64(9 ^ fnv1a(name));
        let expected_u = |name: &str, index: u64| {
            let bits = splitmix64(key(name).wrapping_add(index));
            (bits >> 40) as f64 / 16_777_216.0 * 2.0 - 1.0
        };
        let norm = SeededWeights::new(9).read("model.norm.weight", &[8], &[(5, 1)]).unwrap();
        assert!((f64::from(norm[0]) - (1.0 + 0.1 * expected_u("model.norm.weight", 5))).abs() < 1e-6);
        let linear = SeededWeights::new(9).read("lm_head.weight", &[2, 4], &[(1, 1), (1, 1)]).unwrap();
        let want = expected_u("lm_head.weight", 5) * 3f64.sqrt() / 2.0;
        assert!((f64::from(linear[0]) - want).abs() < 1e-6);
        // FNV-1a's published test vector, so the hash is the standard one.
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn out_of_bounds_region_is_an_error() {
        let error = SeededWeights::new(0).read(Q_PROJ, &[4, 4], &[(2, 3), (0, 4)]).unwrap_err();
        assert_eq!(
            error,
            WeightError::RegionOutOfBounds {
                name: Q_PROJ.to_string(),
                region: vec![(2, 3), (0, 4)],
                shape: vec![4, 4],
            }
        );
    }
}
