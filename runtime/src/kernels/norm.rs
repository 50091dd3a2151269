//! RMS normalisation, as Hugging Face's `LlamaRMSNorm` computes it in f32.
//!
//! Per row: `out = weight * (x * rsqrt(mean(x^2) + eps))`, multiplying in that order as HF does. The sum
//! of squares is accumulated in f64 and rounded once to f32, which is at least as accurate as
//! PyTorch's f32 reduction, so the only differences from HF are the last-bit rounding of that sum.

use super::{check_len, expect_valid, KernelError};

/// `out = x / sqrt(mean(x^2) + eps) * weight` over rows of length `hidden`.
///
/// # Panics
/// If `hidden` is 0 while `x` is not empty, `x.len()` is not a multiple of `hidden`, `weight` does
/// not hold `hidden` elements, or `out` is not as long as `x`.
pub fn rms_norm(x: &[f32], weight: &[f32], out: &mut [f32], hidden: usize, eps: f32) {
    expect_valid(validate(x, weight, out, hidden));
    if x.is_empty() {
        return;
    }
    for (row, out_row) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let sum_of_squares: f64 = row.iter().map(|&value| value as f64 * value as f64).sum();
        let mean_square = (sum_of_squares / hidden as f64) as f32;
        let inverse_rms = 1.0 / (mean_square + eps).sqrt();
        for ((out_value, &value), &scale) in out_row.iter_mut().zip(row).zip(weight) {
            *out_value = scale * (value * inverse_rms);
        }
    }
}

fn validate(x: &[f32], weight: &[f32], out: &[f32], hidden: usize) -> Result<(), KernelError> {
    check_len("rms_norm", "out", x.len(), out.len())?;
    if x.is_empty() {
        return Ok(());
    }
    if hidden == 0 {
        return Err(KernelError::ZeroDim { kernel: "rms_norm", what: "hidden" });
    }
    if x.len() % hidden != 0 {
        return Err(KernelError::NotDivisible {
            kernel: "rms_norm",
            what: "x length",
            count: x.len(),
            divisor: hidden,
        });
    }
    check_len("rms_norm", "weight", hidden, weight.len())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Normalises `rows` rows of seeded data and compares with the formula evaluated in f64.
    #[track_caller]
    fn check(rows: usize, hidden: usize, eps: f32, input_scale: f32) {
        let x: Vec<f32> = values(rows * hidden, 7).iter().map(|v| v * input_scale).collect();
        let weight = values(hidden, 8);
        let mut want = vec![0.0f64; rows * hidden];
        for row in 0..rows {
            let slice = &x[row * hidden..(row + 1) * hidden];
            let mean: f64 = slice.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hidden as f64;
            for i in 0..hidden {
                want[row * hidden + i] = slice[i] as f64 / (mean + eps as f64).sqrt() * weight[i] as f64;
            }
        }
        let mut out = vec![f32::NAN; x.len()];
        rms_norm(&x, &weight, &mut out, hidden, eps);
        assert_close(&out, &want, 1e-6);
    }

    #[test]
    fn matches_formula() {
        check(1, 1, 1e-6, 1.0);
        check(5, 64, 1e-6, 1.0);
        check(3, 37, 1e-5, 100.0);
        check(2, 16, 1e-5, 1e-4); // eps dominates the tiny mean square
        check(0, 8, 1e-6, 1.0);
    }

    #[test]
    fn bad_row_length_is_an_error() {
        let error = validate(&[0.0; 10], &[1.0; 4], &[0.0; 10], 4).unwrap_err();
        assert_eq!(error.to_string(), "rms_norm: x length = 10 is not divisible by 4; make x length a multiple of 4");
    }
}
