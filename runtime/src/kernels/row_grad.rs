//! The gradients computed row by row or element by element: RMSNorm's (with respect to its input and
//! to its weight) and SwiGLU's with respect to the gate.
//!
//! Per-row quantities (`rsqrt(mean(x²) + eps)`, `mean(g·x)`) and the weight gradient's sums over rows
//! are evaluated in f64 and each result element is rounded to f32 once. The weight gradient sums the
//! local rows only: when rows are split over ranks, a later all-reduce completes it.

use super::grad::validate_rows;
use super::{check_len, expect_valid};

/// `1 / sqrt(mean(row²) + eps)` in f64.
fn inverse_rms(row: &[f32], eps: f64) -> f64 {
    let sum_of_squares: f64 = row.iter().map(|&value| f64::from(value) * f64::from(value)).sum();
    1.0 / (sum_of_squares / row.len() as f64 + eps).sqrt()
}

/// The gradient of `rms_norm(x, weight)` with respect to `x`, rows of `hidden`: per row, with
/// `r = rsqrt(mean(x²) + eps)` and `g = dy · weight`, `dx = r·g - x·r³·mean(g·x)`.
///
/// # Panics
/// If `hidden` is 0, `x.len()` is not a multiple of it, `weight` does not hold `hidden` elements, or
/// `dy` and `dx` are not as long as `x`.
pub fn rms_norm_grad_input(x: &[f32], weight: &[f32], dy: &[f32], dx: &mut [f32], hidden: usize, eps: f64) {
    expect_valid(
        validate_rows("rms_norm_grad_input", "x length", x.len(), hidden)
            .and(check_len("rms_norm_grad_input", "weight", hidden, weight.len()))
            .and(check_len("rms_norm_grad_input", "dy", x.len(), dy.len()))
            .and(check_len("rms_norm_grad_input", "dx", x.len(), dx.len())),
    );
    let mut scaled = vec![0.0f64; hidden];
    for ((row, gradient), out) in x.chunks_exact(hidden).zip(dy.chunks_exact(hidden)).zip(dx.chunks_exact_mut(hidden)) {
        let r = inverse_rms(row, eps);
        for ((slot, &g), &w) in scaled.iter_mut().zip(gradient).zip(weight) {
            *slot = f64::from(g) * f64::from(w);
        }
        let mean_gx = scaled.iter().zip(row).map(|(&g, &value)| g * f64::from(value)).sum::<f64>() / hidden as f64;
        let correction = r * r * r * mean_gx;
        for ((slot, &g), &value) in out.iter_mut().zip(&scaled).zip(row) {
            *slot = (r * g - f64::from(value) * correction) as f32;
        }
    }
}

/// The gradient of `rms_norm(x, weight)` with respect to `weight`: `dw = Σ over rows of dy · x · r`,
/// `r = rsqrt(mean(x²) + eps)` of each row.
///
/// # Panics
/// If `hidden` is 0, `x.len()` is not a multiple of it, `dy` is not as long as `x`, or `dw` does not
/// hold `hidden` elements.
pub fn rms_norm_grad_weight(x: &[f32], dy: &[f32], dw: &mut [f32], hidden: usize, eps: f64) {
    expect_valid(
        validate_rows("rms_norm_grad_weight", "x length", x.len(), hidden)
            .and(check_len("rms_norm_grad_weight", "dy", x.len(), dy.len()))
            .and(check_len("rms_norm_grad_weight", "dw", hidden, dw.len())),
    );
    let mut sums = vec![0.0f64; hidden];
    for (row, gradient) in x.chunks_exact(hidden).zip(dy.chunks_exact(hidden)) {
        let r = inverse_rms(row, eps);
        for ((sum, &g), &value) in sums.iter_mut().zip(gradient).zip(row) {
            *sum += f64::from(g) * f64::from(value) * r;
        }
    }
    for (slot, sum) in dw.iter_mut().zip(sums) {
        *slot = sum as f32;
    }
}

/// The gradient of `silu(gate) * up` with respect to `gate`, elementwise:
/// `dy · up · silu'(gate)`, `silu'(g) = s·(1 + g·(1 - s))` with `s = sigmoid(g)`.
///
/// # Panics
/// If the four slices differ in length.
pub fn silu_mul_grad_gate(gate: &[f32], up: &[f32], dy: &[f32], out: &mut [f32]) {
    expect_valid(
        check_len("silu_mul_grad_gate", "up", gate.len(), up.len())
            .and(check_len("silu_mul_grad_gate", "dy", gate.len(), dy.len()))
            .and(check_len("silu_mul_grad_gate", "out", gate.len(), out.len())),
    );
    for (((slot, &g), &u), &d) in out.iter_mut().zip(gate).zip(up).zip(dy) {
        let g = f64::from(g);
        let sigmoid = 1.0 / (1.0 + (-g).exp());
        *slot = (f64::from(d) * f64::from(u) * sigmoid * (1.0 + g * (1.0 - sigmoid))) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// `Σ dy · rms_norm(x, w)` in f64: the scalar whose gradients the kernels compute.
    fn objective(x: &[f64], w: &[f64], dy: &[f32], hidden: usize, eps: f64) -> f64 {
        let mut total = 0.0;
        for (row_index, row) in x.chunks_exact(hidden).enumerate() {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps).sqrt();
            for c in 0..hidden {
                total += dy[row_index * hidden + c] as f64 * row[c] * r * w[c];
            }
        }
        total
    }

    /// Central differences of `f` at `at`, one coordinate at a time.
    fn numeric_gradient(at: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
        (0..at.len())
            .map(|index| {
                let (mut plus, mut minus) = (at.to_vec(), at.to_vec());
                plus[index] += 1e-5;
                minus[index] -= 1e-5;
                (f(&plus) - f(&minus)) / 2e-5
            })
            .collect()
    }

    #[test]
    fn rms_norm_grads_match_finite_differences() {
        let (rows, hidden, eps) = (5, 8, 1e-5);
        let x = values(rows * hidden, 61);
        let w = values(hidden, 62);
        let dy = values(rows * hidden, 63);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let mut dx = vec![f32::NAN; x.len()];
        rms_norm_grad_input(&x, &w, &dy, &mut dx, hidden, eps);
        assert_close(&dx, &numeric_gradient(&x64, |x| objective(x, &w64, &dy, hidden, eps)), 1e-6);
        let mut dw = vec![f32::NAN; hidden];
        rms_norm_grad_weight(&x, &dy, &mut dw, hidden, eps);
        assert_close(&dw, &numeric_gradient(&w64, |w| objective(&x64, w, &dy, hidden, eps)), 1e-6);
    }

    #[test]
    fn silu_gate_grad_matches_finite_differences() {
        let gate: Vec<f32> = values(40, 71).iter().map(|v| v * 6.0).collect();
        let up = values(40, 72);
        let dy = values(40, 73);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        let want: Vec<f64> = (0..gate.len())
            .map(|i| {
                let g = gate[i] as f64;
                dy[i] as f64 * up[i] as f64 * (silu(g + 1e-6) - silu(g - 1e-6)) / 2e-6
            })
            .collect();
        let mut got = vec![f32::NAN; gate.len()];
        silu_mul_grad_gate(&gate, &up, &dy, &mut got);
        assert_close(&got, &want, 1e-6);
    }
}
