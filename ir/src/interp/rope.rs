//! Rotary position embedding, as Hugging Face's Llama applies it.
//!
//! The inverse frequencies follow `transformers.modeling_rope_utils` (`_compute_default_rope_parameters`
//! and `_compute_llama3_parameters`) operation by operation in f32, including torch's habits: a
//! Python float meeting an f32 tensor is first rounded to f32, and `scalar / tensor` is computed as
//! `tensor.reciprocal() * scalar` (torch's `Tensor.__rtruediv__`). The angle of frequency `i` at
//! position `p` is the f32 product `inv_freq[i] * p`, and each head's pair `(x[i], x[i + half])` is
//! rotated by it (the rotate-half layout, `q * cos + rotate_half(q) * sin`). Transcendentals (`pow`,
//! `cos`, `sin`) are evaluated in f64 and rounded once, the correctly rounded f32 result that torch's
//! own f32 kernels approximate to within an ulp.

use super::error::OpError;
use super::ops::{indices, shape_error};
use super::tensor::Tensor;
use crate::model::config::{RopeConfig, RopeScaling};

/// `(x[batch, seq, heads, head_dim], positions[seq]) -> same`: rotates each head of each token by
/// the angles of its absolute position.
pub(crate) fn rope(x: &Tensor, positions: &Tensor, config: &RopeConfig) -> Result<Tensor, OpError> {
    let &[batch, seq, heads, head_dim] = x.shape.as_slice() else {
        return Err(shape_error(0, x, "[batch, seq, heads, head_dim]"));
    };
    if head_dim % 2 != 0 {
        return Err(shape_error(0, x, "an even head_dim, which rotary embedding splits into halves"));
    }
    if positions.shape != [seq] {
        return Err(shape_error(1, positions, format!("[seq] with seq = {seq}, dim 1 of operand 0")));
    }
    let positions = indices(1, positions)?;
    let inverse_frequencies = inv_freq(config, head_dim)?;
    let half = head_dim / 2;
    let mut data = vec![0.0_f32; x.data.len()];
    for (token, &position) in positions.iter().enumerate() {
        // Hugging Face: `freqs = position_ids.float() * inv_freq`, then `emb.cos()`, `emb.sin()`.
        let angles: Vec<f32> = inverse_frequencies.iter().map(|&frequency| frequency * position as f32).collect();
        let cosines: Vec<f32> = angles.iter().map(|&angle| f64::from(angle).cos() as f32).collect();
        let sines: Vec<f32> = angles.iter().map(|&angle| f64::from(angle).sin() as f32).collect();
        for batch_index in 0..batch {
            for head in 0..heads {
                let start = ((batch_index * seq + token) * heads + head) * head_dim;
                let input = &x.data[start..start + head_dim];
                let output = &mut data[start..start + head_dim];
                for i in 0..half {
                    let (first, second) = (input[i], input[i + half]);
                    output[i] = first * cosines[i] - second * sines[i];
                    output[i + half] = second * cosines[i] + first * sines[i];
                }
            }
        }
    }
    Ok(Tensor { shape: x.shape.clone(), data })
}

/// The `head_dim / 2` inverse frequencies of `config`, bit for bit as Hugging Face computes them
/// in f32 (up to the last ulp of `pow`).
fn inv_freq(config: &RopeConfig, head_dim: usize) -> Result<Vec<f32>, OpError> {
    positive("rope_theta", config.theta)?;
    // `1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))`: the base is rounded to f32 and the
    // exponent is an f32 quotient.
    let base = config.theta as f32;
    let default: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|index| {
            let exponent = index as f32 / head_dim as f32;
            let power = f64::from(base).powf(f64::from(exponent)) as f32;
            1.0 / power
        })
        .collect();
    match config.scaling {
        RopeScaling::None => Ok(default),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            positive("factor", factor)?;
            positive("low_freq_factor", low_freq_factor)?;
            positive("high_freq_factor", high_freq_factor)?;
            positive("original_max_position_embeddings", original_max_position_embeddings as f64)?;
            // Python computes these scalars in f64; torch rounds them to f32 where they meet a tensor.
            let old_context = original_max_position_embeddings as f64;
            let low_freq_wavelen = (old_context / low_freq_factor) as f32;
            let high_freq_wavelen = (old_context / high_freq_factor) as f32;
            let band = (high_freq_factor - low_freq_factor) as f32;
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            let (factor, low_freq_factor, old_context) = (factor as f32, low_freq_factor as f32, old_context as f32);
            let scaled = default
                .into_iter()
                .map(|frequency| {
                    // `wavelen = 2 * math.pi / inv_freq`, that is `inv_freq.reciprocal() * 2π`.
                    let wavelen = (1.0 / frequency) * two_pi;
                    let long = if wavelen > low_freq_wavelen { frequency / factor } else { frequency };
                    // `smooth = (old_context_len / wavelen - low_freq_factor) / (high - low)`.
                    let smooth = ((1.0 / wavelen) * old_context - low_freq_factor) / band;
                    let smoothed = (1.0 - smooth) * long / factor + smooth * long;
                    // HF's `~(wavelen < high) * ~(wavelen > low)`; the same, as wavelen is never NaN.
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if medium {
                        smoothed
                    } else {
                        long
                    }
                })
                .collect();
            Ok(scaled)
        }
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), OpError> {
    if value > 0.0 && value.is_finite() {
        Ok(())
    } else {
        Err(OpError::RopeSetting { field, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::tensor::assert_close;

    fn default_rope(theta: f64) -> RopeConfig {
        RopeConfig { theta, scaling: RopeScaling::None }
    }

    fn llama3_rope(
        theta: f64,
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    ) -> RopeConfig {
        RopeConfig {
            theta,
            scaling: RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            },
        }
    }

    /// Compares frequencies to `expected` within `tolerance`, relative.
    #[track_caller]
    fn check(actual: &[f32], expected: &[f32], tolerance: f32) {
        assert_eq!(actual.len(), expected.len());
        for (index, (&got, &want)) in actual.iter().zip(expected).enumerate() {
            assert!((got - want).abs() <= tolerance * want.abs(), "frequency {index}: got {got:e}, expected {want:e}");
        }
    }

    #[test]
    fn default_frequencies_are_powers_of_theta() {
        // theta^(-i/8) for i = 0, 2, 4, 6 with theta = 10^4: 1, 10^-1, 10^-2, 10^-3.
        check(&inv_freq(&default_rope(10_000.0), 8).unwrap(), &[1.0, 0.1, 0.01, 0.001], 1e-6);
    }

    #[test]
    fn llama3_frequencies_by_hand() {
        // theta = 10^4, head_dim = 8, factor = 8, low = 1, high = 4, original context = 1024. Then
        // low_freq_wavelen = 1024 / 1 = 1024 and high_freq_wavelen = 1024 / 4 = 256, and the default
        // frequencies 1, 0.1, 0.01, 0.001 have wavelengths 2π / f = 6.283, 62.83, 628.3, 6283.2.
        //   f = 1, 0.1: wavelength < 256, high frequency, kept: 1, 0.1.
        //   f = 0.01: 256 <= 628.3 <= 1024, medium: smooth = (1024 / 628.3185 - 1) / (4 - 1)
        //     = (1.6297466 - 1) / 3 = 0.2099155, and (1 - smooth) * f / 8 + smooth * f
        //     = 0.01 * (0.125 + 0.875 * 0.2099155) = 0.01 * 0.3086761 = 0.003086761.
        //   f = 0.001: wavelength 6283.2 > 1024, low frequency, divided by 8: 0.000125.
        let frequencies = inv_freq(&llama3_rope(10_000.0, 8.0, 1.0, 4.0, 1024), 8).unwrap();
        check(&frequencies, &[1.0, 0.1, 0.003_086_761, 0.000_125], 1e-6);
    }

    #[test]
    fn llama3_frequencies_match_transformers_bit_for_bit() {
        // Llama 3.1 8B's settings (rope_theta 500000, head_dim 128, factor 8, low 1, high 4, original
        // 8192). Expected bits from transformers 5.24 / torch 2.9.1 on CPU:
        //   cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
        //       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        //       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        //   inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        //   [hex(inv.view(torch.int32)[i].item()) for i in (0, 20, 28, 29, 31, 34, 35, 63)]
        // Before scaling, indices 0..=28 have wavelengths below 8192 / 4 = 2048 (kept), 29..=34 between
        // 2048 and 8192 (smoothed), 35.. above 8192 (divided by 8). All 64 matched when this was written.
        let frequencies = inv_freq(&llama3_rope(500_000.0, 8.0, 1.0, 4.0, 8192), 128).unwrap();
        let expected: [(usize, u32); 8] = [
            (0, 0x3f80_0000),
            (20, 0x3c87_a9c3),
            (28, 0x3b52_7720),
            (29, 0x3b0d_fd06),
            (31, 0x3a60_979e),
            (34, 0x393b_2dd2),
            (35, 0x38c8_6886),
            (63, 0x34a4_c2ff),
        ];
        for (index, bits) in expected {
            assert_eq!(
                frequencies[index].to_bits(),
                bits,
                "frequency {index}: got {:e}, transformers gives {:e}",
                frequencies[index],
                f32::from_bits(bits)
            );
        }
    }

    #[test]
    fn bad_settings_are_named() {
        let error = inv_freq(&llama3_rope(10_000.0, 0.0, 1.0, 4.0, 1024), 8).unwrap_err();
        assert_eq!(
            error.to_string(),
            "rope setting factor is 0; it must be positive and finite, fix rope_theta or rope_scaling in config.json"
        );
        assert!(inv_freq(&default_rope(f64::NAN), 8).is_err());
    }

    /// Runs rope on `x` at `positions` with theta 10^4 and compares with `expected` to 1e-6.
    #[track_caller]
    fn check_rope(x: &[f32], shape: &[usize], positions: &[f32], expected: &[f32]) {
        let x = Tensor::new(shape.to_vec(), x.to_vec()).unwrap();
        let positions = Tensor::new(vec![positions.len()], positions.to_vec()).unwrap();
        let actual = rope(&x, &positions, &default_rope(10_000.0)).unwrap();
        assert_close(&actual, &Tensor::new(shape.to_vec(), expected.to_vec()).unwrap(), 1e-6);
    }

    #[test]
    fn rope_rotates_halves_by_position() {
        // head_dim 4, theta 10^4: frequencies 1 and 10^4^(-1/2) = 0.01. x = [1, 2, 3, 4] pairs
        // (x0, x2) = (1, 3) at frequency 1 and (x1, x3) = (2, 4) at frequency 0.01.
        // Position 0: angle 0, x unchanged.
        // Position 1: angles 1 and 0.01; cos 1 = 0.5403023, sin 1 = 0.8414710, cos 0.01 = 0.99995,
        // sin 0.01 = 0.0099998:
        //   out0 = 1 cos1 - 3 sin1 = -1.9841106     out2 = 3 cos1 + 1 sin1 = 2.4623779
        //   out1 = 2 cos.01 - 4 sin.01 = 1.9599007  out3 = 4 cos.01 + 2 sin.01 = 4.0197997
        // Position 2: angles 2 and 0.02; cos 2 = -0.4161468, sin 2 = 0.9092974:
        //   out0 = cos2 - 3 sin2 = -3.1440391       out2 = 3 cos2 + sin2 = -0.3391431
        //   out1 = 2 cos.02 - 4 sin.02 = 1.9196053  out3 = 4 cos.02 + 2 sin.02 = 4.0391974
        let x = [1.0, 2.0, 3.0, 4.0];
        check_rope(&x, &[1, 1, 1, 4], &[0.0], &x);
        check_rope(&x, &[1, 1, 1, 4], &[1.0], &[-1.984_110_6, 1.959_900_7, 2.462_377_9, 4.019_799_7]);
        check_rope(&x, &[1, 1, 1, 4], &[2.0], &[-3.144_039_1, 1.919_605_3, -0.339_143_1, 4.039_197_4]);
        // Two tokens and two heads: each token uses its own position, every head the same angles.
        let two = [x, x, x, x].concat();
        let expected = [
            [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0],
            [
                -3.144_039_1,
                1.919_605_3,
                -0.339_143_1,
                4.039_197_4,
                -3.144_039_1,
                1.919_605_3,
                -0.339_143_1,
                4.039_197_4,
            ],
        ]
        .concat();
        check_rope(&two, &[1, 2, 2, 4], &[0.0, 2.0], &expected);
    }

    #[test]
    fn rope_checks_its_operands() {
        let x = Tensor::zeros(vec![1, 2, 1, 4]);
        let error = rope(&x, &Tensor::zeros(vec![3]), &default_rope(10_000.0)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "operand 1 has shape [3], expected [seq] with seq = 2, dim 1 of operand 0; fix the graph's types"
        );
        assert!(rope(&Tensor::zeros(vec![1, 2, 1, 3]), &Tensor::zeros(vec![2]), &default_rope(10_000.0)).is_err());
    }
}
