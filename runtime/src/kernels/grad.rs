//! The gradients of the linear ops: the two of a matmul, the embedding table's, and the sum over
//! leading dims (a bias's). Each works on the rank's local block and sums over the local rows only;
//! summing the ranks' blocks (a later all-reduce) is the caller's business.
//!
//! The matmul gradients are single GEMMs through `gemm` with the transposes expressed as strides
//! (no copies), like the forward [`super::matmul_nt`]. The sums accumulate in f64 and round once.

use gemm::Parallelism;

use super::matmul::{gemm_strided, StridedMatrix};
use super::{check_len, expect_valid, KernelError};

fn parallelism(threads: usize) -> Parallelism {
    if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dx[m, k] = dy[m, n] · w[n, k]`: the gradient of `x[m, k] · w[n, k]ᵀ` with respect to `x`.
///
/// `threads` of 0 or 1 runs on the calling thread; more lets `gemm` use that many Rayon threads.
///
/// # Panics
/// If `dy`, `w` or `dx` does not hold exactly `m*n`, `n*k` or `m*k` elements.
#[allow(clippy::too_many_arguments)] // Three sizes, three operands, the parallelism: a BLAS call.
pub fn matmul_grad_input(m: usize, n: usize, k: usize, dy: &[f32], w: &[f32], dx: &mut [f32], threads: usize) {
    expect_valid(
        check_len("matmul_grad_input", "dy", m.saturating_mul(n), dy.len())
            .and(check_len("matmul_grad_input", "w", n.saturating_mul(k), w.len()))
            .and(check_len("matmul_grad_input", "dx", m.saturating_mul(k), dx.len())),
    );
    let lhs = StridedMatrix { data: dy, row_stride: n, col_stride: 1 };
    let rhs = StridedMatrix { data: w, row_stride: k, col_stride: 1 };
    gemm_strided(m, k, n, dx, k, lhs, rhs, 1.0, false, parallelism(threads));
}

/// `dw[n, k] = dy[m, n]ᵀ · x[m, k]`: the gradient of `x[m, k] · w[n, k]ᵀ` with respect to `w`, summed
/// over the `m` local rows.
///
/// # Panics
/// If `dy`, `x` or `dw` does not hold exactly `m*n`, `m*k` or `n*k` elements.
#[allow(clippy::too_many_arguments)] // Three sizes, three operands, the parallelism: a BLAS call.
pub fn matmul_grad_weight(m: usize, n: usize, k: usize, dy: &[f32], x: &[f32], dw: &mut [f32], threads: usize) {
    expect_valid(
        check_len("matmul_grad_weight", "dy", m.saturating_mul(n), dy.len())
            .and(check_len("matmul_grad_weight", "x", m.saturating_mul(k), x.len()))
            .and(check_len("matmul_grad_weight", "dw", n.saturating_mul(k), dw.len())),
    );
    // dyᵀ[col, row] = dy[row * n + col]: rows of the transposed view are 1 apart, columns n apart.
    let lhs = StridedMatrix { data: dy, row_stride: 1, col_stride: n };
    let rhs = StridedMatrix { data: x, row_stride: k, col_stride: 1 };
    gemm_strided(n, k, m, dw, k, lhs, rhs, 1.0, false, parallelism(threads));
}

/// `out[w] = Σ_r x[r, w]` over rows of `width`: the sum over every leading dim, trailing ones kept.
///
/// # Panics
/// If `width` is 0, `x.len()` is not a multiple of `width`, or `out` does not hold `width` elements.
pub fn sum_leading(x: &[f32], width: usize, out: &mut [f32]) {
    expect_valid(validate_rows("sum_leading", "x length", x.len(), width).and(check_len(
        "sum_leading",
        "out",
        width,
        out.len(),
    )));
    let mut sums = vec![0.0f64; width];
    for row in x.chunks_exact(width) {
        for (sum, &value) in sums.iter_mut().zip(row) {
            *sum += f64::from(value);
        }
    }
    for (slot, sum) in out.iter_mut().zip(sums) {
        *slot = sum as f32;
    }
}

/// The gradient of a (vocab-parallel) embedding table block: `out` (`[rows, hidden]`) holds global
/// rows `[vocab_offset, vocab_offset + rows)`, and row `v` of it is the sum of the rows of `dy`
/// (`[tokens.len(), hidden]`) whose token is `vocab_offset + v`. Tokens outside the block contribute
/// nothing (another rank's block holds their rows). Everything is checked before `out` is written.
///
/// # Errors
/// [`KernelError::TokenOutOfRange`] for a token id `>= vocab_total`, [`KernelError::ShardOutOfRange`]
/// when the block reaches past `vocab_total`, [`KernelError::ZeroDim`], [`KernelError::NotDivisible`]
/// or [`KernelError::LengthMismatch`] when `hidden`, `dy` and `out` disagree.
pub fn embedding_grad(
    dy: &[f32],
    tokens: &[u32],
    hidden: usize,
    vocab_offset: usize,
    vocab_total: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    validate_rows("embedding_grad", "out length", out.len(), hidden)?;
    check_len("embedding_grad", "dy", tokens.len().saturating_mul(hidden), dy.len())?;
    let rows = out.len() / hidden;
    if vocab_offset.saturating_add(rows) > vocab_total {
        return Err(KernelError::ShardOutOfRange { vocab_offset, rows, vocab_size: vocab_total });
    }
    super::elementwise::check_token_ids(tokens, vocab_total)?;
    let mut sums = vec![0.0f64; out.len()];
    for (&token, gradient) in tokens.iter().zip(dy.chunks_exact(hidden)) {
        let Some(row) = (token as usize).checked_sub(vocab_offset).filter(|&row| row < rows) else { continue };
        for (sum, &value) in sums[row * hidden..(row + 1) * hidden].iter_mut().zip(gradient) {
            *sum += f64::from(value);
        }
    }
    for (slot, sum) in out.iter_mut().zip(sums) {
        *slot = sum as f32;
    }
    Ok(())
}

/// `Ok` when `len` (the length named `what`) is whole rows of a positive `width`.
pub(super) fn validate_rows(
    kernel: &'static str,
    what: &'static str,
    len: usize,
    width: usize,
) -> Result<(), KernelError> {
    if width == 0 {
        return Err(KernelError::ZeroDim { kernel, what: "row width" });
    }
    if len % width != 0 {
        return Err(KernelError::NotDivisible { kernel, what, count: len, divisor: width });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    #[test]
    fn matmul_grads_match_naive_sums() {
        for (m, n, k, threads) in [(1, 1, 1, 1), (3, 5, 7, 1), (17, 33, 65, 1), (64, 40, 48, 2)] {
            let x = values(m * k, 1);
            let w = values(n * k, 2);
            let dy = values(m * n, 3);
            let mut want_dx = vec![0.0f64; m * k];
            let mut want_dw = vec![0.0f64; n * k];
            for row in 0..m {
                for col in 0..n {
                    for depth in 0..k {
                        want_dx[row * k + depth] += dy[row * n + col] as f64 * w[col * k + depth] as f64;
                        want_dw[col * k + depth] += dy[row * n + col] as f64 * x[row * k + depth] as f64;
                    }
                }
            }
            let mut dx = vec![f32::NAN; m * k];
            matmul_grad_input(m, n, k, &dy, &w, &mut dx, threads);
            assert_close(&dx, &want_dx, 1e-5);
            let mut dw = vec![f32::NAN; n * k];
            matmul_grad_weight(m, n, k, &dy, &x, &mut dw, threads);
            assert_close(&dw, &want_dw, 1e-5);
        }
    }

    #[test]
    fn sum_leading_sums_rows() {
        let x = values(4 * 3 * 5, 4);
        let mut want = vec![0.0f64; 5];
        for (index, &value) in x.iter().enumerate() {
            want[index % 5] += value as f64;
        }
        let mut out = vec![f32::NAN; 5];
        sum_leading(&x, 5, &mut out);
        assert_close(&out, &want, 1e-6);
        // Width 1 sums everything; the whole width copies.
        let mut total = [0.0];
        sum_leading(&x, 1, &mut total);
        assert_close(&total, &[x.iter().map(|&value| value as f64).sum()], 1e-6);
        let mut copy = vec![0.0; x.len()];
        sum_leading(&x, x.len(), &mut copy);
        assert_eq!(copy, x);
    }

    #[test]
    fn embedding_grad_scatters_into_the_block() {
        let (hidden, vocab_total) = (3, 10);
        let tokens = [2u32, 7, 2, 9, 4, 5];
        let dy = values(tokens.len() * hidden, 5);
        // The whole table, then the block of rows 4..7 (tokens 4 and 5 land, the rest do not).
        let mut want_full = vec![0.0f64; vocab_total * hidden];
        for (position, &token) in tokens.iter().enumerate() {
            for c in 0..hidden {
                want_full[token as usize * hidden + c] += dy[position * hidden + c] as f64;
            }
        }
        let mut full = vec![f32::NAN; vocab_total * hidden];
        embedding_grad(&dy, &tokens, hidden, 0, vocab_total, &mut full).unwrap();
        assert_close(&full, &want_full, 1e-6);
        let mut block = vec![f32::NAN; 3 * hidden];
        embedding_grad(&dy, &tokens, hidden, 4, vocab_total, &mut block).unwrap();
        assert_close(&block, &want_full[4 * hidden..7 * hidden], 1e-6);
    }

    #[test]
    fn embedding_grad_rejects_bad_ids_and_blocks() {
        let mut out = [0.0; 4];
        let error = embedding_grad(&[0.0; 2], &[0, 5], 1, 0, 4, &mut out).unwrap_err();
        assert_eq!(error, KernelError::TokenOutOfRange { position: 1, token: 5, vocab_size: 4 });
        let error = embedding_grad(&[0.0; 2], &[0, 1], 1, 2, 4, &mut out).unwrap_err();
        assert_eq!(error, KernelError::ShardOutOfRange { vocab_offset: 2, rows: 4, vocab_size: 4 });
        assert!(matches!(
            embedding_grad(&[0.0; 3], &[0, 1], 1, 0, 4, &mut out),
            Err(KernelError::LengthMismatch { tensor: "dy", .. })
        ));
    }
}
