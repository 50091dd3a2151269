//! Layout copies, so that collectives always work on contiguous chunks.
//!
//! A collective such as reduce-scatter over dimension `dim` needs each rank's part contiguous.
//! [`split_dim_chunks`] reorders a row-major tensor so the `parts` equal chunks along `dim` follow one
//! another (chunk 0 first), each in its own row-major order; [`join_dim_chunks`] is its exact inverse.
//! [`slice_region`] copies a rectangular block out of a tensor. All three only move values; none
//! changes one.

use super::{check_len, expect_valid, KernelError};

/// The tensor seen as `[outer, size, inner]` around `dim`, in elements.
struct DimSplit {
    outer: usize,
    size: usize,
    inner: usize,
}

/// Checks a split of `shape` into `parts` chunks along `dim` for `kernel`, and returns its geometry.
fn dim_split(
    kernel: &'static str,
    data_len: usize,
    shape: &[usize],
    dim: usize,
    parts: usize,
) -> Result<DimSplit, KernelError> {
    if dim >= shape.len() {
        return Err(KernelError::DimOutOfRange { kernel, dim, rank: shape.len() });
    }
    if parts == 0 {
        return Err(KernelError::ZeroDim { kernel, what: "parts" });
    }
    if shape[dim] % parts != 0 {
        return Err(KernelError::NotDivisible { kernel, what: "the size of dim", count: shape[dim], divisor: parts });
    }
    check_len(kernel, "input", element_count(shape), data_len)?;
    Ok(DimSplit { outer: shape[..dim].iter().product(), size: shape[dim], inner: shape[dim + 1..].iter().product() })
}

/// Product of the dimensions, saturating so that an absurd shape fails the length check.
fn element_count(shape: &[usize]) -> usize {
    shape.iter().fold(1usize, |count, &size| count.saturating_mul(size))
}

/// Reorders `x` (row-major, `shape`) so that the `parts` equal chunks along `dim` are contiguous,
/// chunk 0 first; each chunk is the row-major tensor `shape` with `dim` divided by `parts`.
///
/// # Panics
/// If `dim` is not below `shape.len()`, `parts` is 0 or does not divide `shape[dim]`, or `x` does
/// not hold the product of `shape`.
pub fn split_dim_chunks(x: &[f32], shape: &[usize], dim: usize, parts: usize) -> Vec<f32> {
    let DimSplit { outer, size, inner } = expect_valid(dim_split("split_dim_chunks", x.len(), shape, dim, parts));
    let run = size / parts * inner;
    let mut chunks = Vec::with_capacity(x.len());
    for part in 0..parts {
        for outer_index in 0..outer {
            let start = outer_index * size * inner + part * run;
            chunks.extend_from_slice(&x[start..start + run]);
        }
    }
    chunks
}

/// The inverse of [`split_dim_chunks`]: `chunks` holds the `parts` chunks along `dim` one after
/// another, and the result is the row-major tensor of `shape`.
///
/// # Panics
/// As [`split_dim_chunks`], with `chunks` in place of `x`.
pub fn join_dim_chunks(chunks: &[f32], shape: &[usize], dim: usize, parts: usize) -> Vec<f32> {
    let DimSplit { outer, size, inner } = expect_valid(dim_split("join_dim_chunks", chunks.len(), shape, dim, parts));
    let run = size / parts * inner;
    let mut joined = vec![0.0; chunks.len()];
    for part in 0..parts {
        for outer_index in 0..outer {
            let source = (part * outer + outer_index) * run;
            let start = outer_index * size * inner + part * run;
            joined[start..start + run].copy_from_slice(&chunks[source..source + run]);
        }
    }
    joined
}

/// Copies the block `region` (per dimension: start, length) out of `x` (row-major, `shape`), as a
/// row-major tensor of the lengths.
///
/// # Panics
/// If `region` and `shape` differ in rank, a block reaches past its dimension, or `x` does not hold
/// the product of `shape`.
pub fn slice_region(x: &[f32], shape: &[usize], region: &[(usize, usize)]) -> Vec<f32> {
    expect_valid(validate_region(x, shape, region));
    let lengths: Vec<usize> = region.iter().map(|&(_, length)| length).collect();
    let total = element_count(&lengths);
    let mut block = Vec::with_capacity(total);
    if total == 0 {
        return block;
    }
    let Some((&(last_start, last_length), outer_region)) = region.split_last() else {
        return x.to_vec(); // A rank-0 tensor: its one element.
    };
    let mut strides = vec![1usize; shape.len()];
    for dim in (0..shape.len() - 1).rev() {
        strides[dim] = strides[dim + 1] * shape[dim + 1];
    }
    // Walk every index of the outer dims like an odometer; the last dim is one contiguous run.
    let mut index = vec![0usize; outer_region.len()];
    loop {
        let offset: usize = outer_region
            .iter()
            .zip(&index)
            .zip(&strides)
            .map(|((&(start, _), &position), &stride)| (start + position) * stride)
            .sum::<usize>()
            + last_start;
        block.extend_from_slice(&x[offset..offset + last_length]);
        let Some(dim) = (0..index.len()).rev().find(|&dim| index[dim] + 1 < outer_region[dim].1) else {
            return block;
        };
        index[dim] += 1;
        index[dim + 1..].fill(0);
    }
}

fn validate_region(x: &[f32], shape: &[usize], region: &[(usize, usize)]) -> Result<(), KernelError> {
    check_len("slice_region", "region", shape.len(), region.len())?;
    for (dim, (&(start, len), &size)) in region.iter().zip(shape).enumerate() {
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(KernelError::RegionOutOfBounds { dim, start, len, size });
        }
    }
    check_len("slice_region", "x", element_count(shape), x.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major multi-index of `flat` in `shape`.
    fn unflatten(mut flat: usize, shape: &[usize]) -> Vec<usize> {
        let mut index = vec![0; shape.len()];
        for dim in (0..shape.len()).rev() {
            index[dim] = flat % shape[dim];
            flat /= shape[dim];
        }
        index
    }

    fn flatten(index: &[usize], shape: &[usize]) -> usize {
        index.iter().zip(shape).fold(0, |flat, (&position, &size)| flat * size + position)
    }

    /// Splits a tensor whose values are their own flat indices, checks every chunk element against
    /// the source element it must come from, and checks that joining gives the tensor back.
    #[track_caller]
    fn check_split(shape: &[usize], dim: usize, parts: usize) {
        let total: usize = shape.iter().product();
        let x: Vec<f32> = (0..total).map(|i| i as f32).collect();
        let chunks = split_dim_chunks(&x, shape, dim, parts);
        let mut chunk_shape = shape.to_vec();
        chunk_shape[dim] /= parts;
        let chunk_len: usize = chunk_shape.iter().product();
        for (position, &value) in chunks.iter().enumerate() {
            let part = position / chunk_len;
            let mut index = unflatten(position % chunk_len, &chunk_shape);
            index[dim] += part * chunk_shape[dim];
            assert_eq!(value, flatten(&index, shape) as f32, "chunk element {position}");
        }
        assert_eq!(join_dim_chunks(&chunks, shape, dim, parts), x);
    }

    #[test]
    fn split_puts_each_chunk_contiguous_and_join_inverts_it() {
        check_split(&[6], 0, 3);
        check_split(&[2, 6, 3], 1, 2);
        check_split(&[4, 3, 5], 0, 4);
        check_split(&[2, 3, 8], 2, 4);
        check_split(&[2, 4, 3, 2], 1, 1);
        check_split(&[2, 0, 3], 1, 2);
        check_split(&[3, 4, 0], 1, 2);
    }

    #[test]
    fn split_errors_are_reported() {
        assert_eq!(
            dim_split("split_dim_chunks", 12, &[3, 4], 0, 2).err(),
            Some(KernelError::NotDivisible {
                kernel: "split_dim_chunks",
                what: "the size of dim",
                count: 3,
                divisor: 2
            })
        );
        assert_eq!(
            dim_split("join_dim_chunks", 12, &[3, 4], 2, 2).err().map(|error| error.to_string()),
            Some("join_dim_chunks: dim 2 is out of range for a tensor of rank 2; use a dim below 2".into())
        );
    }

    /// Slices a tensor of flat indices and checks each block element names its source.
    #[track_caller]
    fn check_slice(shape: &[usize], region: &[(usize, usize)]) {
        let total: usize = shape.iter().product();
        let x: Vec<f32> = (0..total).map(|i| i as f32).collect();
        let lengths: Vec<usize> = region.iter().map(|&(_, length)| length).collect();
        let block = slice_region(&x, shape, region);
        assert_eq!(block.len(), lengths.iter().product::<usize>());
        for (position, &value) in block.iter().enumerate() {
            let mut index = unflatten(position, &lengths);
            index.iter_mut().zip(region).for_each(|(i, &(start, _))| *i += start);
            assert_eq!(value, flatten(&index, shape) as f32, "block element {position}");
        }
    }

    #[test]
    fn slice_copies_the_block() {
        check_slice(&[5], &[(1, 3)]);
        check_slice(&[4, 6], &[(1, 2), (2, 3)]);
        check_slice(&[3, 4, 5], &[(0, 3), (1, 2), (0, 5)]);
        check_slice(&[2, 3, 4, 5], &[(1, 1), (0, 3), (2, 2), (1, 4)]);
        check_slice(&[3, 4], &[(1, 0), (0, 4)]);
        check_slice(&[], &[]);
    }

    #[test]
    fn slice_out_of_bounds_is_reported() {
        let error = validate_region(&[0.0; 12], &[3, 4], &[(0, 3), (2, 3)]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "slice_region: dim 1 asks for [2, 2 + 3) but the dim has size 4; keep start + len <= 4"
        );
    }
}
