//! Tensors held as blocks: a weight source over rectangular pieces of global tensors.
//!
//! Training ranks hold blocks of each parameter (a tensor-parallel shard, a ZeRO share of rows), and
//! a sharded checkpoint stores exactly those blocks. [`BlockWeights`] collects them and serves any
//! region of a global tensor by copying from every block that intersects it, so a run restarted on
//! another mesh or ZeRO stage reads its own blocks from the old run's. A block already held (same
//! tensor, same region) is not stored twice: the first one inserted wins, which is how a block
//! replicated on several ranks is kept once (the lowest rank's). A read fails unless the blocks
//! together cover every element of the region.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::region::{check_finite, check_region};
use super::{Region, WeightError, WeightSource};

/// One global tensor: its shape and the blocks held of it.
#[derive(Debug, Clone, Default)]
struct BlockedTensor {
    shape: Vec<u64>,
    blocks: Vec<(Region, Vec<f32>)>,
}

/// Blocks of global tensors, readable by any region (see the module documentation).
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// Where the blocks came from (a checkpoint's index, or a description); errors name it.
    origin: PathBuf,
    tensors: BTreeMap<String, BlockedTensor>,
}

/// A block of a global tensor as [`BlockWeights::blocks`] lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorBlock<'a> {
    /// The global tensor's name.
    pub name: &'a str,
    /// The global tensor's shape.
    pub shape: &'a [u64],
    /// The block: per dim `(start, len)`.
    pub region: &'a [(u64, u64)],
    /// The block's elements, row-major over the region.
    pub data: &'a [f32],
}

impl BlockWeights {
    /// No blocks yet; `origin` names where they come from in errors.
    pub fn new(origin: impl Into<PathBuf>) -> Self {
        Self { origin: origin.into(), tensors: BTreeMap::new() }
    }

    /// Adds a block of `name` (global shape `shape`). Returns `false`, keeping the block already
    /// there, when the same region of the same tensor was inserted before. Fails when the region
    /// does not fit the shape, `data` is not the region's size, or `name` was given another shape.
    pub fn insert(
        &mut self,
        name: &str,
        shape: &[u64],
        region: &[(u64, u64)],
        data: Vec<f32>,
    ) -> Result<bool, WeightError> {
        let count = check_region(name, shape, region)?;
        if data.len() != count {
            return Err(WeightError::InvalidTensorToWrite {
                name: name.to_string(),
                reason: format!("block {region:?} holds {count} elements but {} values were given", data.len()),
            });
        }
        let tensor = self
            .tensors
            .entry(name.to_string())
            .or_insert_with(|| BlockedTensor { shape: shape.to_vec(), blocks: Vec::new() });
        check_shape(name, shape, &tensor.shape, &self.origin)?;
        if tensor.blocks.iter().any(|(held, _)| held == region) {
            return Ok(false);
        }
        tensor.blocks.push((region.to_vec(), data));
        Ok(true)
    }

    /// Every block, by tensor name, then in insertion order.
    pub fn blocks(&self) -> impl Iterator<Item = TensorBlock<'_>> {
        self.tensors.iter().flat_map(|(name, tensor)| {
            tensor.blocks.iter().map(move |(region, data)| TensorBlock { name, shape: &tensor.shape, region, data })
        })
    }

    /// The global shape of `name`, if any block of it is held.
    pub fn shape(&self, name: &str) -> Option<&[u64]> {
        self.tensors.get(name).map(|tensor| tensor.shape.as_slice())
    }
}

impl WeightSource for BlockWeights {
    fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> Result<Vec<f32>, WeightError> {
        let tensor = self.tensors.get(name).ok_or_else(|| WeightError::TensorMissing {
            name: name.to_string(),
            file: self.origin.clone(),
            similar: Vec::new(),
        })?;
        check_shape(name, shape, &tensor.shape, &self.origin)?;
        let count = check_region(name, shape, region)?;
        let mut values = vec![0.0_f32; count];
        let mut covered = vec![false; count];
        for (block_region, data) in &tensor.blocks {
            copy_intersection(block_region, data, region, &mut values, &mut covered);
        }
        if covered.iter().any(|&held| !held) {
            return Err(WeightError::NotCovered {
                name: name.to_string(),
                region: region.to_vec(),
                file: self.origin.clone(),
            });
        }
        check_finite(name, region, &values, &self.origin)?;
        Ok(values)
    }
}

/// Row-major strides of a box with these per-dim lengths.
fn strides(lens: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; lens.len()];
    for dim in (0..lens.len().saturating_sub(1)).rev() {
        strides[dim] = strides[dim + 1] * lens[dim + 1];
    }
    strides
}

/// Copies the elements of `block` (row-major over `block_region`) that lie in `region` into
/// `out` (row-major over `region`), marking them in `covered`.
fn copy_intersection(
    block_region: &[(u64, u64)],
    block: &[f32],
    region: &[(u64, u64)],
    out: &mut [f32],
    covered: &mut [bool],
) {
    let mut starts = Vec::with_capacity(region.len());
    let mut lens = Vec::with_capacity(region.len());
    for (&(block_start, block_len), &(start, len)) in block_region.iter().zip(region) {
        let low = block_start.max(start);
        let high = (block_start + block_len).min(start + len);
        if high <= low {
            return;
        }
        starts.push(low);
        lens.push(high - low);
    }
    let block_lens: Vec<u64> = block_region.iter().map(|&(_, len)| len).collect();
    let region_lens: Vec<u64> = region.iter().map(|&(_, len)| len).collect();
    let (block_strides, region_strides) = (strides(&block_lens), strides(&region_lens));
    let n_dims = lens.len();
    // A scalar, or one contiguous row along the last dim at a time.
    let (row_len, outer_dims) = match lens.last() {
        Some(&last) => (last as usize, n_dims - 1),
        None => (1, 0),
    };
    let mut index = vec![0u64; outer_dims];
    loop {
        let mut source = 0u64;
        let mut target = 0u64;
        for dim in 0..n_dims {
            let coordinate = starts[dim] + if dim < outer_dims { index[dim] } else { 0 };
            source += (coordinate - block_region[dim].0) * block_strides[dim];
            target += (coordinate - region[dim].0) * region_strides[dim];
        }
        let (source, target) = (source as usize, target as usize);
        out[target..target + row_len].copy_from_slice(&block[source..source + row_len]);
        covered[target..target + row_len].iter_mut().for_each(|held| *held = true);
        // Odometer over the outer dims, last fastest.
        let mut dim = outer_dims;
        loop {
            if dim == 0 {
                return;
            }
            dim -= 1;
            index[dim] += 1;
            if index[dim] < lens[dim] {
                break;
            }
            index[dim] = 0;
        }
    }
}

/// `held` is the shape `shape` asked for, or a mismatch naming the tensor and where it came from.
fn check_shape(name: &str, shape: &[u64], held: &[u64], origin: &std::path::Path) -> Result<(), WeightError> {
    if held == shape {
        return Ok(());
    }
    Err(WeightError::ShapeMismatch {
        name: name.to_string(),
        expected: shape.to_vec(),
        found: held.to_vec(),
        file: origin.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4x6 tensor whose element (i, j) is 10·i + j.
    fn element(i: u64, j: u64) -> f32 {
        (10 * i + j) as f32
    }

    fn block_of(region: &[(u64, u64)]) -> Vec<f32> {
        let mut data = Vec::new();
        for i in region[0].0..region[0].0 + region[0].1 {
            for j in region[1].0..region[1].0 + region[1].1 {
                data.push(element(i, j));
            }
        }
        data
    }

    #[test]
    fn any_region_is_assembled_from_the_blocks_it_spans() {
        // Column halves, the right one split into row halves: a region spanning all three blocks.
        let mut weights = BlockWeights::new("test");
        for region in [[(0, 4), (0, 3)], [(0, 2), (3, 3)], [(2, 2), (3, 3)]] {
            assert!(weights.insert("w", &[4, 6], &region, block_of(&region)).unwrap());
        }
        let shape = [4, 6];
        for first in (0..=4u64).flat_map(|start| (1..=4 - start).map(move |len| (start, len))) {
            for second in (0..=6u64).flat_map(|start| (1..=6 - start).map(move |len| (start, len))) {
                let region = [first, second];
                assert_eq!(weights.read("w", &shape, &region).unwrap(), block_of(&region), "{region:?}");
            }
        }
    }

    #[test]
    fn a_repeated_block_is_kept_once_and_gaps_are_errors() {
        let mut weights = BlockWeights::new("test");
        let left = [(0, 4), (0, 3)];
        assert!(weights.insert("w", &[4, 6], &left, block_of(&left)).unwrap());
        assert!(!weights.insert("w", &[4, 6], &left, vec![0.0; 12]).unwrap());
        assert_eq!(weights.blocks().count(), 1);
        assert_eq!(weights.read("w", &[4, 6], &left).unwrap(), block_of(&left));
        let error = weights.read("w", &[4, 6], &[(0, 1), (2, 2)]).unwrap_err();
        assert!(matches!(error, WeightError::NotCovered { .. }), "{error:?}");
        assert!(matches!(weights.read("w", &[6, 4], &left), Err(WeightError::ShapeMismatch { .. })));
        assert!(matches!(weights.read("v", &[4, 6], &left), Err(WeightError::TensorMissing { .. })));
        assert!(weights.insert("w", &[4, 6], &[(0, 1), (0, 1)], vec![1.0, 2.0]).is_err());
        assert!(weights.insert("w", &[4, 7], &[(0, 1), (0, 1)], vec![1.0]).is_err());
    }

    #[test]
    fn scalars_and_vectors_read_back() {
        let mut weights = BlockWeights::new("test");
        weights.insert("s", &[], &[], vec![7.0]).unwrap();
        weights.insert("v", &[5], &[(0, 2)], vec![0.0, 1.0]).unwrap();
        weights.insert("v", &[5], &[(2, 3)], vec![2.0, 3.0, 4.0]).unwrap();
        assert_eq!(weights.read("s", &[], &[]).unwrap(), vec![7.0]);
        assert_eq!(weights.read("v", &[5], &[(1, 3)]).unwrap(), vec![1.0, 2.0, 3.0]);
    }
}
