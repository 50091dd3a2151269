//! RoPE inverse frequencies, computed in `f32` the way Hugging Face transformers computes them.
//!
//! transformers builds `inv_freq` once per model with float32 tensor ops (`modeling_rope_utils.py`:
//! `_compute_default_rope_parameters` and `_compute_llama3_parameters`). To give the same numbers, this
//! module repeats those ops one by one, in the same order and precision as PyTorch's CPU kernels run them:
//!
//! - a Python number meeting a float32 tensor is first rounded to `f32` (it does not promote the tensor);
//! - `number / tensor` is `tensor.reciprocal() * number` (PyTorch's `Tensor.__rtruediv__`);
//! - `tensor / number` is a true `f32` division on the CPU (CUDA multiplies by the reciprocal instead, which
//!   differs only when the divisor is not a power of two).
//!
//! The one op not reproduced bit for bit is `pow`: PyTorch calls a vectorized `powf` (SLEEF, error at most
//! 1 ulp), while [`inv_freq`] rounds an `f64` power to `f32`, the correctly rounded result. The two agree
//! except where SLEEF itself misrounds, so a value may then differ in its last bit.

use super::config::{RopeConfig, RopeScaling};

/// The `head_dim.div_ceil(2)` inverse frequencies of `rope` for heads `head_dim` wide.
///
/// Default RoPE: `inv_freq[i] = 1 / theta^(2i / head_dim)`. Llama 3 scaling then divides the low
/// frequencies (wavelength above `original_max_position_embeddings / low_freq_factor`) by `factor`, keeps
/// the high ones (wavelength below `original_max_position_embeddings / high_freq_factor`) and blends the
/// ones between. Odd `head_dim` gives `head_dim.div_ceil(2)` entries, as `torch.arange(0, dim, 2)` does.
pub fn inv_freq(rope: &RopeConfig, head_dim: u64) -> Vec<f32> {
    let default = default_inv_freq(rope.theta, head_dim);
    match rope.scaling {
        RopeScaling::None => default,
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let scaling = Llama3Scaling {
                factor,
                low_freq_factor,
                high_freq_factor,
                old_context_len: original_max_position_embeddings,
            };
            default.into_iter().map(|frequency| scaling.apply(frequency)).collect()
        }
    }
}

/// `1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))`.
fn default_inv_freq(theta: f64, head_dim: u64) -> Vec<f32> {
    let base = theta as f32;
    let dim = head_dim as f32;
    (0..head_dim)
        .step_by(2)
        .map(|channel| {
            let exponent = channel as f32 / dim;
            // Rounding the f64 power gives the correctly rounded f32 power; see the module comment.
            let power = f64::from(base).powf(f64::from(exponent)) as f32;
            1.0 / power
        })
        .collect()
}

/// The numbers of `_compute_llama3_parameters`, kept in the Python types it computes them in.
struct Llama3Scaling {
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    old_context_len: u64,
}

impl Llama3Scaling {
    /// One element of `inv_freq_llama`, following the tensor expressions of transformers step by step.
    fn apply(&self, inv_freq: f32) -> f32 {
        // Python floats, computed in f64 before they meet the tensor.
        let low_freq_wavelen = self.old_context_len as f64 / self.low_freq_factor;
        let high_freq_wavelen = self.old_context_len as f64 / self.high_freq_factor;
        let two_pi = 2.0 * std::f64::consts::PI;
        let factor_span = self.high_freq_factor - self.low_freq_factor;
        // Each scalar is rounded to f32 where it meets a float32 tensor.
        let (factor, low_freq_factor) = (self.factor as f32, self.low_freq_factor as f32);
        let (low_freq_wavelen, high_freq_wavelen) = (low_freq_wavelen as f32, high_freq_wavelen as f32);

        // wavelen = 2 * math.pi / inv_freq
        let wavelen = (1.0 / inv_freq) * two_pi as f32;
        // inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        let inv_freq_llama = if wavelen > low_freq_wavelen { inv_freq / factor } else { inv_freq };
        // smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        let smooth_factor = ((1.0 / wavelen) * self.old_context_len as f32 - low_freq_factor) / factor_span as f32;
        // smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        let smoothed_inv_freq = (1.0 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
        // is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        // Same as transformers' negations for every wavelength that is not NaN, and none is: validated
        // configs have a finite theta and positive factors.
        let is_medium_freq = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
        if is_medium_freq {
            smoothed_inv_freq
        } else {
            inv_freq_llama
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default_rope(theta: f64) -> RopeConfig {
        RopeConfig { theta, scaling: RopeScaling::None }
    }

    fn llama31_rope() -> RopeConfig {
        RopeConfig {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        }
    }

    /// Checks every entry against a naive f64 evaluation of the paper's formula, to `f32` precision.
    #[track_caller]
    fn check_close(actual: &[f32], expected: &[f64]) {
        assert_eq!(actual.len(), expected.len(), "number of frequencies");
        for (index, (&got, &want)) in actual.iter().zip(expected).enumerate() {
            let relative = ((f64::from(got) - want) / want).abs();
            assert!(relative < 4.0 * f64::from(f32::EPSILON), "inv_freq[{index}] = {got}, expected {want}");
        }
    }

    /// `1 / theta^(2i/d)` in f64, written independently of the code under test.
    fn naive_default(theta: f64, head_dim: u64) -> Vec<f64> {
        (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64)).collect()
    }

    /// Llama 3.1's reference (Meta's `apply_scaling`) in f64.
    fn naive_llama31(head_dim: u64) -> Vec<f64> {
        let (factor, low, high, old_context_len) = (8.0, 1.0, 4.0, 8192.0);
        naive_default(500000.0, head_dim)
            .into_iter()
            .map(|frequency| {
                let wavelen = 2.0 * std::f64::consts::PI / frequency;
                if wavelen < old_context_len / high {
                    frequency
                } else if wavelen > old_context_len / low {
                    frequency / factor
                } else {
                    let smooth = (old_context_len / wavelen - low) / (high - low);
                    (1.0 - smooth) * frequency / factor + smooth * frequency
                }
            })
            .collect()
    }

    #[test]
    fn default_matches_the_formula() {
        for (theta, head_dim) in [(10000.0, 16), (10000.0, 128), (500000.0, 128), (1_000_000.0, 64)] {
            check_close(&inv_freq(&default_rope(theta), head_dim), &naive_default(theta, head_dim));
        }
    }

    #[test]
    fn default_hand_computed_values() {
        // theta 10000, head_dim 16: exponents 0, 1/8, ..., 7/8, so inv_freq[i] = 10^(-i/2).
        let frequencies = inv_freq(&default_rope(10000.0), 16);
        assert_eq!(frequencies.len(), 8);
        assert_eq!(frequencies[0], 1.0);
        assert_eq!(frequencies[2], 0.1);
        assert_eq!(frequencies[4], 0.01);
        assert_eq!(frequencies[6], 0.001);
        assert_eq!(frequencies[1], (1.0 / 10f64.sqrt()) as f32);
    }

    #[test]
    fn odd_head_dim_gives_arange_length() {
        // torch.arange(0, 5, 2) = [0, 2, 4]: three frequencies, exponents 0, 2/5, 4/5. The exponent is a
        // float32 tensor, so 4/5 is rounded to f32 (0.800000011920929) before the power.
        let frequencies = inv_freq(&default_rope(10000.0), 5);
        assert_eq!(frequencies.len(), 3);
        assert_eq!(frequencies[0], 1.0);
        let power = 10000f64.powf(0.800000011920929) as f32;
        assert_eq!(frequencies[2], 1.0 / power);
        assert_ne!(frequencies[2], (1.0 / 10000f64.powf(0.8)) as f32, "exponent was not rounded to f32");
    }

    #[test]
    fn llama3_matches_the_reference_formula() {
        check_close(&inv_freq(&llama31_rope(), 128), &naive_llama31(128));
    }

    /// Llama 3.1's 64 frequencies (head_dim 128) as f32 bit patterns, computed independently with numpy
    /// float32 arrays that repeat transformers' tensor expressions op for op.
    #[rustfmt::skip]
    const LLAMA31_HEAD_DIM_128_BITS: [u32; 64] = [
        0x3f800000, 0x3f508ac1, 0x3f29e1c6, 0x3f0a6384, 0x3ee177bc, 0x3eb7ab7d, 0x3e959ee3, 0x3e73c461,
        0x3e4693b0, 0x3e21c3a0, 0x3e03c6a0, 0x3dd6b19c, 0x3daee4ad, 0x3d8e7898, 0x3d681e67, 0x3d3d1684,
        0x3d1a08c8, 0x3cfaf53f, 0x3ccc6f49, 0x3ca68939, 0x3c87a9c3, 0x3c5d06ec, 0x3c340d6d, 0x3c12ac7f,
        0x3beef74f, 0x3bc2aa76, 0x3b9e9402, 0x3b812e35, 0x3b527720, 0x3b0dfd06, 0x3ab3d11d, 0x3a60979e,
        0x3a0995d2, 0x39a3f108, 0x393b2dd2, 0x38c86886, 0x38a3418d, 0x3884fdbf, 0x3858ac81, 0x38308199,
        0x380fc8f8, 0x37ea426f, 0x37bed4f4, 0x379b7475, 0x377d45c3, 0x374e51f5, 0x3728126b, 0x3708ea0f,
        0x36df10c4, 0x36b5b687, 0x369406cb, 0x36712b80, 0x36447610, 0x36200a69, 0x36025f34, 0x35d46808,
        0x35ad07a7, 0x358cf400, 0x3565a54d, 0x353b12c7, 0x351864a7, 0x34f848c2, 0x34ca41b0, 0x34a4c2ff,
    ];

    #[test]
    fn llama3_matches_float32_reference_bits() {
        let bits: Vec<u32> = inv_freq(&llama31_rope(), 128).iter().map(|frequency| frequency.to_bits()).collect();
        assert_eq!(bits, LLAMA31_HEAD_DIM_128_BITS);
    }

    #[test]
    fn llama3_regions() {
        // Llama 3.1, head_dim 128: wavelen_i = 2*pi*500000^(i/64). It stays below 2048 for i <= 28
        // (2*pi*500000^(28/64) ~ 1956.5), so those are unchanged; it exceeds 8192 from i = 35 on
        // (~ 8218.7), so those are divided by 8, exactly since 8 is a power of two; i = 29..=34 are blended.
        let default = inv_freq(&default_rope(500000.0), 128);
        let scaled = inv_freq(&llama31_rope(), 128);
        assert_eq!(scaled[..29], default[..29]);
        for index in 35..64 {
            assert_eq!(scaled[index], default[index] / 8.0, "low frequency {index}");
        }
        for index in 29..35 {
            assert!(scaled[index] < default[index] && scaled[index] > default[index] / 8.0, "medium {index}");
        }
    }

    #[test]
    fn llama3_hand_computed_medium_value() {
        // i = 32: inv = 500000^(-1/2), wavelen = 2*pi*sqrt(500000) ~ 4442.9, between 2048 and 8192, so
        // smooth = (8192/4442.9 - 1)/3 ~ 0.28128 and the result blends inv/8 and inv.
        let scaled = inv_freq(&llama31_rope(), 128);
        let inv = 1.0 / 500000f64.sqrt();
        let smooth = (8192.0 / (2.0 * std::f64::consts::PI / inv) - 1.0) / 3.0;
        assert!((smooth - 0.28128).abs() < 1e-4);
        let expected = (1.0 - smooth) * inv / 8.0 + smooth * inv;
        assert!(((f64::from(scaled[32]) - expected) / expected).abs() < 1e-6, "{} vs {expected}", scaled[32]);
    }
}
