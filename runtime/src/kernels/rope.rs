//! Rotary position embedding, Hugging Face's rotate-half convention, applied in place.
//!
//! Angles follow HF's float32 path exactly: `angle = (position as f32) * inv_freq[i]`, one f32
//! product. The cosine and sine of that f32 angle are taken in f64 and rounded once, so they are the
//! correctly rounded f32 values (PyTorch's f32 `cos`/`sin` are within an ulp of them). The rotation
//! then rounds each product before the sum, as PyTorch's `q * cos + rotate_half(q) * sin` does.

use super::{check_len, expect_valid, KernelError};

/// Rotates `x`, laid out `[batch, seq, heads, head_dim]`, in place.
///
/// `positions[s]` is the absolute position of local sequence index `s` (the same for every batch
/// entry); `inv_freq` has `head_dim / 2` entries. For each pair `i < head_dim / 2`, with
/// `x1 = x[i]`, `x2 = x[i + head_dim/2]`: `x[i] = x1*cos - x2*sin`, `x[i + head_dim/2] = x2*cos + x1*sin`.
///
/// # Panics
/// If `head_dim` is odd, `x` does not hold `batch*seq*heads*head_dim` elements, `positions` does not
/// hold `seq`, or `inv_freq` does not hold `head_dim / 2`.
pub fn rope_in_place(
    x: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f32],
) {
    rotate_in_place(x, batch, seq, heads, head_dim, positions, inv_freq, 1.0);
}

/// The gradient of [`rope_in_place`]: rotates `dy` (same layout) by the opposite angles, in place.
/// The rotation is orthogonal, so its transpose is its inverse: `x[i] = x1*cos + x2*sin`,
/// `x[i + head_dim/2] = x2*cos - x1*sin`, with the same f32 angles as the forward rotation.
///
/// # Panics
/// As [`rope_in_place`].
pub fn rope_grad_in_place(
    dy: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f32],
) {
    rotate_in_place(dy, batch, seq, heads, head_dim, positions, inv_freq, -1.0);
}

/// Rotates by the angles times `direction` (1 forward, -1 backward): `sin(-a) = -sin(a)` exactly.
#[allow(clippy::too_many_arguments)] // rope's operands and the direction.
fn rotate_in_place(
    x: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f32],
    direction: f32,
) {
    expect_valid(validate(x, batch, seq, heads, head_dim, positions, inv_freq));
    let half = head_dim / 2;
    if x.is_empty() || half == 0 {
        return;
    }
    // One table of cos and sin per local position, shared by every batch entry and head.
    let mut cos_table = vec![0.0f32; seq * half];
    let mut sin_table = vec![0.0f32; seq * half];
    for (position_index, &position) in positions.iter().enumerate() {
        for (i, &frequency) in inv_freq.iter().enumerate() {
            let angle = position as f32 * frequency;
            cos_table[position_index * half + i] = (angle as f64).cos() as f32;
            sin_table[position_index * half + i] = direction * (angle as f64).sin() as f32;
        }
    }
    let position_stride = heads * head_dim;
    for (row_index, row) in x.chunks_exact_mut(position_stride).enumerate() {
        let position_index = row_index % seq;
        let cos_row = &cos_table[position_index * half..(position_index + 1) * half];
        let sin_row = &sin_table[position_index * half..(position_index + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            let (first, second) = head.split_at_mut(half);
            for (((x1, x2), &cos), &sin) in first.iter_mut().zip(second).zip(cos_row).zip(sin_row) {
                let (old1, old2) = (*x1, *x2);
                *x1 = old1 * cos - old2 * sin;
                *x2 = old2 * cos + old1 * sin;
            }
        }
    }
}

fn validate(
    x: &[f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f32],
) -> Result<(), KernelError> {
    if head_dim % 2 != 0 {
        return Err(KernelError::NotDivisible {
            kernel: "rope_in_place",
            what: "head_dim",
            count: head_dim,
            divisor: 2,
        });
    }
    let elements = batch.saturating_mul(seq).saturating_mul(heads).saturating_mul(head_dim);
    check_len("rope_in_place", "x", elements, x.len())?;
    check_len("rope_in_place", "positions", seq, positions.len())?;
    check_len("rope_in_place", "inv_freq", head_dim / 2, inv_freq.len())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Rotates seeded data and compares with the formula applied element by element.
    #[track_caller]
    fn check(batch: usize, seq: usize, heads: usize, head_dim: usize, positions: &[u32]) {
        let half = head_dim / 2;
        // Llama's frequencies: base^(-2i/d).
        let inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / head_dim as f32)).collect();
        let x = values(batch * seq * heads * head_dim, 11);
        let mut want = vec![0.0f64; x.len()];
        for b in 0..batch {
            for (s, &position) in positions.iter().enumerate() {
                for h in 0..heads {
                    let base = ((b * seq + s) * heads + h) * head_dim;
                    for (i, &frequency) in inv_freq.iter().enumerate() {
                        let angle = (position as f32 * frequency) as f64;
                        let (x1, x2) = (x[base + i] as f64, x[base + i + half] as f64);
                        want[base + i] = x1 * angle.cos() - x2 * angle.sin();
                        want[base + i + half] = x2 * angle.cos() + x1 * angle.sin();
                    }
                }
            }
        }
        let mut got = x.clone();
        rope_in_place(&mut got, batch, seq, heads, head_dim, positions, &inv_freq);
        assert_close(&got, &want, 1e-6);
    }

    #[test]
    fn matches_formula() {
        check(1, 4, 1, 8, &[0, 1, 2, 3]);
        check(2, 3, 4, 16, &[5, 100, 4095]);
        check(2, 4, 2, 64, &[7, 0, 6, 1]); // zigzag shard: positions out of order
    }

    #[test]
    fn known_rotation() {
        // Position 1, frequency 1: (1, 0) rotates by one radian, (0, 1) rotates to (-sin 1, cos 1).
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        rope_in_place(&mut x, 1, 1, 2, 2, &[1], &[1.0]);
        let want = [1f64.cos(), 1f64.sin(), -(1f64.sin()), 1f64.cos()];
        assert_close(&x, &want, 1e-7);
        // Position 0 leaves x unchanged.
        let mut y = vec![0.5, -2.0];
        rope_in_place(&mut y, 1, 1, 1, 2, &[0], &[1.0]);
        assert_eq!(y, [0.5, -2.0]);
    }

    #[test]
    fn grad_is_the_transpose() {
        // <rope(x), y> = <x, rope_grad(y)> for every x, y: the gradient is the adjoint.
        let (batch, seq, heads, head_dim) = (2, 3, 2, 8);
        let positions = [9, 0, 4];
        let inv_freq: Vec<f32> = (0..head_dim / 2).map(|i| 1.0 / 100f32.powf(2.0 * i as f32 / 8.0)).collect();
        let x = values(batch * seq * heads * head_dim, 21);
        let y = values(x.len(), 22);
        let mut rotated = x.clone();
        rope_in_place(&mut rotated, batch, seq, heads, head_dim, &positions, &inv_freq);
        let mut back = y.clone();
        rope_grad_in_place(&mut back, batch, seq, heads, head_dim, &positions, &inv_freq);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>();
        assert!((dot(&rotated, &y) - dot(&x, &back)).abs() < 1e-5);
        // And it undoes the rotation.
        rope_grad_in_place(&mut rotated, batch, seq, heads, head_dim, &positions, &inv_freq);
        assert_close(&rotated, &x.iter().map(|&value| value as f64).collect::<Vec<_>>(), 1e-6);
    }

    #[test]
    fn odd_head_dim_is_an_error() {
        let error = validate(&[0.0; 3], 1, 1, 1, 3, &[0], &[1.0]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "rope_in_place: head_dim = 3 is not divisible by 2; make head_dim a multiple of 2"
        );
    }
}
