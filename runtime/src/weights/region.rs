//! Region and view arithmetic shared by every weight source.
//!
//! A [`Region`](super::Region) is a box inside a row-major tensor. This module checks that a region fits a
//! shape, checks that a file's tensor shape is the model's view with some adjacent dims merged, and walks a
//! region as maximal contiguous runs of flat (row-major) indices. Merging adjacent dims never changes the
//! row-major order of elements, so a flat index in the model's view is the same flat index in the file, and
//! a source can read a region of the model's view straight from the file's flat buffer.

use std::path::Path;

use super::WeightError;

/// Number of elements of `shape`, or `None` when the product overflows `u64`.
pub(crate) fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |product, &dim| product.checked_mul(dim))
}

/// Whether `file_shape` is `model_shape` with runs of adjacent dims merged into one (their product).
///
/// Size-1 dims are ignored on both sides because inserting or removing them never changes element order.
/// Tensors with no elements match only tensors with no elements.
pub(crate) fn is_merged_view(model_shape: &[u64], file_shape: &[u64]) -> bool {
    let (Some(model_count), Some(file_count)) = (element_count(model_shape), element_count(file_shape)) else {
        return false;
    };
    if model_count != file_count {
        return false;
    }
    if model_count == 0 {
        return true;
    }
    let mut model_dims = model_shape.iter().copied().filter(|&dim| dim != 1);
    for file_dim in file_shape.iter().copied().filter(|&dim| dim != 1) {
        // Every dim here is >= 2, so the product grows strictly and either hits `file_dim` or passes it.
        let mut product = 1u64;
        while product < file_dim {
            match model_dims.next() {
                Some(dim) => product = product.saturating_mul(dim),
                None => return false,
            }
        }
        if product != file_dim {
            return false;
        }
    }
    model_dims.next().is_none()
}

/// Checks that every value read of `region` (`(start, len)` a dim, row-major) of tensor `name`
/// in `file` is finite, naming the first that is not by its index in the tensor.
pub(crate) fn check_finite(name: &str, region: &[(u64, u64)], values: &[f32], file: &Path) -> Result<(), WeightError> {
    let Some(at) = values.iter().position(|value| !value.is_finite()) else { return Ok(()) };
    let mut index = vec![0; region.len()];
    let mut rest = at as u64;
    for (dim, &(start, len)) in region.iter().enumerate().rev() {
        index[dim] = start + rest % len;
        rest /= len;
    }
    Err(WeightError::NotFinite { name: name.to_string(), index, value: values[at], file: file.to_path_buf() })
}

/// Checks that `region` has one `(start, len)` per dim of `shape` and lies inside it, and that the
/// tensor's element count fits in `u64`. Returns the number of elements in the region.
pub(crate) fn check_region(name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<usize, WeightError> {
    let out_of_bounds =
        || WeightError::RegionOutOfBounds { name: name.to_string(), region: region.to_vec(), shape: shape.to_vec() };
    if region.len() != shape.len() || element_count(shape).is_none() {
        return Err(out_of_bounds());
    }
    for (&(start, len), &dim) in region.iter().zip(shape) {
        match start.checked_add(len) {
            Some(end) if end <= dim => {}
            _ => return Err(out_of_bounds()),
        }
    }
    let region_count =
        element_count(&region.iter().map(|&(_, len)| len).collect::<Vec<_>>()).ok_or_else(out_of_bounds)?;
    usize::try_from(region_count).map_err(|_| out_of_bounds())
}

/// Calls `visit(flat_start, run_len)` for each maximal contiguous run of `region` in row-major order.
///
/// The caller must have checked the region with [`check_region`]. The runs, concatenated, list the
/// region's elements in row-major order of the region; a region with no elements yields no run.
pub(crate) fn for_each_run(shape: &[u64], region: &[(u64, u64)], mut visit: impl FnMut(u64, u64)) {
    if region.iter().any(|&(_, len)| len == 0) {
        return;
    }
    let n_dims = shape.len();
    if n_dims == 0 {
        visit(0, 1);
        return;
    }
    let mut strides = vec![1u64; n_dims];
    for dim in (0..n_dims - 1).rev() {
        strides[dim] = strides[dim + 1] * shape[dim + 1];
    }
    // Dims after `split` are covered whole, so one run spans them and `region[split]`'s length.
    let mut split = n_dims - 1;
    while split > 0 && region[split] == (0, shape[split]) {
        split -= 1;
    }
    let run_len = region[split].1 * strides[split];
    let mut outer_index = vec![0u64; split];
    loop {
        let flat_start = outer_index
            .iter()
            .zip(region)
            .zip(&strides)
            .map(|((&offset, &(start, _)), &stride)| (start + offset) * stride)
            .sum::<u64>()
            + region[split].0 * strides[split];
        visit(flat_start, run_len);
        // Odometer over the outer dims, last dim fastest.
        let mut dim = split;
        loop {
            if dim == 0 {
                return;
            }
            dim -= 1;
            outer_index[dim] += 1;
            if outer_index[dim] < region[dim].1 {
                break;
            }
            outer_index[dim] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flat indices of `region` by brute force: every multi-index of `shape`, kept if inside the region.
    fn naive_flat_indices(shape: &[u64], region: &[(u64, u64)]) -> Vec<u64> {
        let total = element_count(shape).unwrap();
        (0..total)
            .filter(|&flat| {
                let mut rest = flat;
                let mut inside = true;
                for dim in (0..shape.len()).rev() {
                    let coordinate = rest % shape[dim];
                    rest /= shape[dim];
                    let (start, len) = region[dim];
                    inside &= coordinate >= start && coordinate < start + len;
                }
                inside
            })
            .collect()
    }

    fn runs(shape: &[u64], region: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut collected = Vec::new();
        for_each_run(shape, region, |start, len| collected.push((start, len)));
        collected
    }

    fn check_runs(shape: &[u64], region: &[(u64, u64)], expected_runs: &[(u64, u64)]) {
        let count = check_region("t", shape, region).unwrap();
        let got = runs(shape, region);
        assert_eq!(got, expected_runs, "runs of {region:?} in {shape:?}");
        let flattened: Vec<u64> = got.iter().flat_map(|&(start, len)| start..start + len).collect();
        assert_eq!(flattened, naive_flat_indices(shape, region));
        assert_eq!(flattened.len(), count);
    }

    #[test]
    fn runs_cover_region_in_row_major_order() {
        check_runs(&[4, 6], &[(0, 4), (0, 6)], &[(0, 24)]);
        check_runs(&[4, 6], &[(1, 2), (0, 6)], &[(6, 12)]);
        check_runs(&[4, 6], &[(1, 2), (2, 3)], &[(8, 3), (14, 3)]);
        check_runs(&[2, 3, 4], &[(0, 2), (1, 2), (0, 4)], &[(4, 8), (16, 8)]);
        check_runs(&[2, 3, 4], &[(1, 1), (0, 3), (1, 2)], &[(13, 2), (17, 2), (21, 2)]);
        check_runs(&[5], &[(2, 3)], &[(2, 3)]);
        check_runs(&[], &[], &[(0, 1)]);
        check_runs(&[3, 4], &[(1, 0), (0, 4)], &[]);
    }

    #[test]
    fn runs_match_brute_force_on_every_region_of_a_small_shape() {
        let shape = [3u64, 2, 4];
        let ranges = |dim: u64| (0..=dim).flat_map(move |start| (0..=dim - start).map(move |len| (start, len)));
        for first in ranges(3) {
            for second in ranges(2) {
                for third in ranges(4) {
                    let region = [first, second, third];
                    let flattened: Vec<u64> =
                        runs(&shape, &region).iter().flat_map(|&(start, len)| start..start + len).collect();
                    assert_eq!(flattened, naive_flat_indices(&shape, &region), "{region:?}");
                }
            }
        }
    }

    #[test]
    fn regions_outside_the_shape_are_rejected() {
        assert_eq!(check_region("t", &[4, 6], &[(1, 2), (2, 3)]).unwrap(), 6);
        assert!(check_region("t", &[4, 6], &[(3, 2), (0, 6)]).is_err());
        assert!(check_region("t", &[4, 6], &[(0, 4)]).is_err());
        assert!(check_region("t", &[4, 6], &[(0, 4), (0, 6), (0, 1)]).is_err());
        assert!(check_region("t", &[4, 6], &[(u64::MAX, 2), (0, 6)]).is_err());
        assert!(check_region("t", &[u64::MAX, 4], &[(0, 1), (0, 1)]).is_err());
    }

    #[test]
    fn merged_views_are_accepted_and_others_rejected() {
        assert!(is_merged_view(&[8, 16, 128], &[128, 128]));
        assert!(is_merged_view(&[8, 16, 128], &[8, 16, 128]));
        assert!(is_merged_view(&[8, 16, 128], &[16384]));
        assert!(is_merged_view(&[8, 16, 128], &[8, 2048]));
        assert!(is_merged_view(&[1, 8, 16], &[128]));
        assert!(is_merged_view(&[8, 16], &[8, 1, 16]));
        assert!(is_merged_view(&[0, 16], &[0]));
        assert!(!is_merged_view(&[8, 16, 128], &[16, 1024]));
        assert!(!is_merged_view(&[8, 16, 128], &[128, 64]));
        assert!(!is_merged_view(&[128, 128], &[8, 16, 128]));
        assert!(!is_merged_view(&[4, 6], &[6, 4]));
        assert!(!is_merged_view(&[u64::MAX, 4], &[4]));
    }
}
