//! Dense f32 matrix multiplication through the `gemm` crate.
//!
//! [`matmul_nt`] is the public kernel (the `nn.Linear` convention, weights stored `[out, in]`).
//! [`gemm_strided`] is the one place this crate calls `gemm`'s unsafe entry point: it checks that every
//! element the strides reach lies inside the slices, so the rest of the crate (attention's tiles)
//! multiplies strided views safely. Transposes are expressed through strides, never through copies.

use gemm::Parallelism;

use super::{check_len, expect_valid};

/// A read-only view of a matrix inside a slice: element `(row, col)` is
/// `data[row * row_stride + col * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StridedMatrix<'a> {
    /// The elements the view reads; it may hold more than the view reaches.
    pub data: &'a [f32],
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
}

impl StridedMatrix<'_> {
    /// One past the largest index a `rows` x `cols` view reaches (0 for an empty view).
    fn extent(&self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * self.row_stride + (cols - 1) * self.col_stride + 1
        }
    }
}

/// `dst[m, n] = (accumulate ? dst : 0) + scale * lhs[m, k] · rhs[k, n]`, where `dst` has columns
/// contiguous and rows `dst_row_stride` apart.
///
/// # Panics
/// If a view reaches past its slice or the rows of `dst` overlap. Callers validate their public
/// inputs first, so a panic here is a bug in this crate.
#[allow(clippy::too_many_arguments)] // Mirrors a BLAS call: three shapes, three operands, and how to combine.
pub(crate) fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_row_stride: usize,
    lhs: StridedMatrix<'_>,
    rhs: StridedMatrix<'_>,
    scale: f32,
    accumulate: bool,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(m == 1 || dst_row_stride >= n, "gemm_strided: rows of dst overlap");
    assert!((m - 1) * dst_row_stride + n <= dst.len(), "gemm_strided: dst too short");
    if k == 0 {
        // An empty sum: gemm is not asked to handle this edge, and the answer is plain.
        if !accumulate {
            for row in 0..m {
                dst[row * dst_row_stride..row * dst_row_stride + n].fill(0.0);
            }
        }
        return;
    }
    assert!(lhs.extent(m, k) <= lhs.data.len(), "gemm_strided: lhs too short");
    assert!(rhs.extent(k, n) <= rhs.data.len(), "gemm_strided: rhs too short");
    // SAFETY: the asserts above keep every element gemm reads or writes inside its slice; rows of
    // dst do not overlap, so parallel workers write disjoint elements; `dst` is a unique borrow, so
    // it aliases neither operand. Strides fit in isize because they index within slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_row_stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `C[m, n] (+)= A[m, k] · B[n, k]^T`: the `nn.Linear` convention, with `b` a weight stored `[out, in]`.
///
/// `accumulate` adds into `c` instead of overwriting it. `threads` of 0 or 1 runs on the calling
/// thread (ranks already run as threads); more lets `gemm` split the work over that many Rayon threads.
///
/// # Panics
/// If `a`, `b` or `c` does not hold exactly `m*k`, `n*k` or `m*n` elements.
#[allow(clippy::too_many_arguments)] // The signature the executor calls; shapes are plain dimensions.
pub fn matmul_nt(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32], accumulate: bool, threads: usize) {
    expect_valid(
        check_len("matmul_nt", "a", m.saturating_mul(k), a.len())
            .and(check_len("matmul_nt", "b", n.saturating_mul(k), b.len()))
            .and(check_len("matmul_nt", "c", m.saturating_mul(n), c.len())),
    );
    let parallelism = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
    // B^T[depth, col] = b[col * k + depth]: rows of the transposed view are 1 apart, columns k apart.
    let lhs = StridedMatrix { data: a, row_stride: k, col_stride: 1 };
    let rhs = StridedMatrix { data: b, row_stride: 1, col_stride: k };
    gemm_strided(m, n, k, c, n, lhs, rhs, 1.0, accumulate, parallelism);
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Runs `matmul_nt` on seeded data and compares it with a triple loop in f64.
    #[track_caller]
    fn check(m: usize, n: usize, k: usize, accumulate: bool, threads: usize) {
        let a = values(m * k, 1);
        let b = values(n * k, 2);
        let start = values(m * n, 3);
        let mut want = vec![0.0f64; m * n];
        for row in 0..m {
            for col in 0..n {
                let dot: f64 = (0..k).map(|d| a[row * k + d] as f64 * b[col * k + d] as f64).sum();
                let base = if accumulate { start[row * n + col] as f64 } else { 0.0 };
                want[row * n + col] = base + dot;
            }
        }
        let mut c = start.clone();
        matmul_nt(m, n, k, &a, &b, &mut c, accumulate, threads);
        assert_close(&c, &want, 1e-5);
    }

    #[test]
    fn matches_naive_loop() {
        for (m, n, k) in [(1, 1, 1), (3, 5, 7), (1, 64, 33), (17, 33, 65), (64, 48, 100), (130, 7, 3)] {
            for accumulate in [false, true] {
                check(m, n, k, accumulate, 1);
            }
        }
    }

    #[test]
    fn threaded_matches_naive_loop() {
        check(96, 80, 128, false, 2);
        check(96, 80, 128, true, 2);
    }

    #[test]
    fn empty_inner_dimension_zeroes_or_keeps() {
        check(4, 3, 0, false, 1);
        check(4, 3, 0, true, 1);
        check(0, 3, 5, false, 1);
    }

    #[test]
    fn wrong_length_names_the_buffer() {
        let result = std::panic::catch_unwind(|| {
            let mut c = vec![0.0; 6];
            matmul_nt(2, 3, 4, &[0.0; 8], &[0.0; 11], &mut c, false, 1);
        });
        let message = *result.unwrap_err().downcast::<String>().unwrap();
        assert_eq!(
            message,
            "matmul_nt: b has 11 elements but the dimensions given need 12; \
             pass a buffer sized to the kernel's dimensions"
        );
    }
}
