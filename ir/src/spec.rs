//! Sharding specs: how a value's global tensor is laid out over the mesh.
//!
//! This is the DTensor / GSPMD model. Each dim is either replicated or split over one or more mesh
//! axes (outer axis first: `batch` over `[dp, cp]` puts dp's blocks outside cp's); in addition the
//! whole value may be `Partial` over some axes, meaning each rank holds a summand and the true value
//! is the sum over that axis's group. A rank's local block along a sharded dim is the contiguous
//! range selected by its coordinates on the sharding axes.

use serde::{Deserialize, Serialize};

use crate::{AxisName, Mesh, Shape};

/// The layout of one value over the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct ShardSpec {
    /// For each dim of the value's shape, the axes that split it, outer first (empty: replicated).
    pub dims: Vec<Vec<AxisName>>,
    /// Axes over which the value is a pending sum.
    pub partial: Vec<AxisName>,
}

impl ShardSpec {
    /// The fully replicated spec of a value with `rank` dims.
    pub fn replicated(rank: usize) -> ShardSpec {
        ShardSpec { dims: vec![Vec::new(); rank], partial: Vec::new() }
    }
    /// Whether every dim is replicated and nothing is partial.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.dims.iter().all(Vec::is_empty)
    }
    /// This spec with dim `dim` also split over `axis` (innermost).
    pub fn with_shard(mut self, dim: usize, axis: AxisName) -> ShardSpec {
        self.dims[dim].push(axis);
        self
    }
    /// This spec with a pending sum over `axis`.
    pub fn with_partial(mut self, axis: AxisName) -> ShardSpec {
        self.partial.push(axis);
        self
    }
    /// The axes splitting dim `dim`.
    pub fn dim_axes(&self, dim: usize) -> &[AxisName] {
        &self.dims[dim]
    }
    /// The dim split over `axis`, if any.
    pub fn dim_sharded_by(&self, axis: AxisName) -> Option<usize> {
        self.dims.iter().position(|axes| axes.contains(&axis))
    }
    /// Whether `axis` appears anywhere in the spec.
    pub fn uses_axis(&self, axis: AxisName) -> bool {
        self.partial.contains(&axis) || self.dim_sharded_by(axis).is_some()
    }
    /// The product of the degrees of the axes splitting `dim`.
    pub fn dim_degree(&self, dim: usize, mesh: &Mesh) -> u64 {
        self.dims[dim].iter().map(|&axis| mesh.degree(axis)).product()
    }
    /// The local size of each dim on any rank, or the first dim that does not divide:
    /// `(dim index, product of its axes' degrees)`.
    pub fn local_sizes(&self, shape: &Shape, mesh: &Mesh) -> Result<Vec<u64>, (usize, u64)> {
        shape
            .dims()
            .iter()
            .enumerate()
            .map(|(index, dim)| {
                let degree = self.dim_degree(index, mesh);
                if dim.size % degree == 0 {
                    Ok(dim.size / degree)
                } else {
                    Err((index, degree))
                }
            })
            .collect()
    }
    /// This spec with its rows also split over each of `axes` in turn (innermost last) that the mesh
    /// has with a degree above 1 and that the spec does not use yet; `None` when no axis is added.
    /// An axis splits the first dim whose local size is above one, when that size divides by its
    /// degree (dim 0, or once a rank holds one row of it, the next: k's one head a tp rank of a GQA
    /// model splits on head_dim), so that a rank's part is contiguous in its row-major block. It is
    /// ZeRO's partition of a parameter over its data-parallel ranks ([`ZERO_AXES`]).
    pub fn with_rows_split(&self, shape: &Shape, mesh: &Mesh, axes: &[AxisName]) -> Option<ShardSpec> {
        let mut sizes = self.local_sizes(shape, mesh).ok()?;
        let mut spec = self.clone();
        for &axis in axes {
            let degree = mesh.degree(axis);
            if degree == 1 || spec.uses_axis(axis) {
                continue;
            }
            let Some(dim) = sizes.iter().position(|&size| size != 1) else { continue };
            if sizes[dim] % degree == 0 {
                spec.dims[dim].push(axis);
                sizes[dim] /= degree;
            }
        }
        (spec != *self).then_some(spec)
    }
    /// The axes `self` splits beyond `outer`'s, each with its dim, in the order
    /// [`Self::with_rows_split`] adds them, when `self` is `outer` split further (ZeRO's partition
    /// of a parameter): the group that gathers the rows back.
    pub fn rows_split_beyond(&self, outer: &ShardSpec) -> Vec<(usize, AxisName)> {
        let mut beyond = Vec::new();
        for (dim, (mine, theirs)) in self.dims.iter().zip(&outer.dims).enumerate() {
            if !mine.starts_with(theirs) {
                return Vec::new();
            }
            beyond.extend(mine[theirs.len()..].iter().map(|&axis| (dim, axis)));
        }
        beyond
    }
    /// The block of the global tensor `rank` holds: per dim, `(start, len)`.
    /// The caller has checked divisibility (`local_sizes`).
    pub fn region(&self, shape: &Shape, mesh: &Mesh, rank: u32) -> Vec<(u64, u64)> {
        shape
            .dims()
            .iter()
            .enumerate()
            .map(|(index, dim)| {
                let mut block = 0;
                for &axis in &self.dims[index] {
                    block = block * mesh.degree(axis) + mesh.coord(rank, axis);
                }
                let len = dim.size / self.dim_degree(index, mesh);
                (block * len, len)
            })
            .collect()
    }
}

/// The axes ZeRO shards a parameter's rows over, outermost first: its data-parallel replicas.
/// `dp`; `cp`, whose ranks hold the same weights and sum their gradients (Megatron's distributed
/// optimizer shards over dp × cp); and `ep` for every parameter `ep` does not split: `ep` splits
/// the batch as `dp` does, so the dense parameters have `dp·cp·ep` replicas and the routed experts
/// `dp·cp` (DeepSpeed-MoE's layout).
pub const ZERO_AXES: [AxisName; 3] = [AxisName::Dp, AxisName::Cp, AxisName::Ep];

/// The largest degree an error suggests: no mesh axis is larger, and a count near 2^64 would
/// otherwise take minutes to factor.
pub const MAX_SUGGESTED_DEGREE: u64 = 1 << 16;

/// Every divisor of `count`, smallest first, found in O(sqrt(count)) steps (a layout search over
/// 2^24 ranks asks for them at every axis).
pub fn divisors(count: u64) -> Vec<u64> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut divisor = 1u64;
    while divisor.saturating_mul(divisor) <= count {
        if count % divisor == 0 {
            small.push(divisor);
            if divisor != count / divisor {
                large.push(count / divisor);
            }
        }
        divisor += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The degrees up to [`MAX_SUGGESTED_DEGREE`] that divide `count`: what an error offers instead
/// of a bad degree.
pub fn valid_degrees(count: u64) -> Vec<u64> {
    (1..=count.min(MAX_SUGGESTED_DEGREE)).filter(|degree| count % degree == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DimName;

    #[test]
    fn divisors_are_every_divisor_in_order() {
        for count in 0..=400u64 {
            let by_hand: Vec<u64> = (1..=count).filter(|divisor| count % divisor == 0).collect();
            assert_eq!(divisors(count), by_hand, "{count}");
        }
        assert_eq!(divisors(1 << 24).len(), 25);
        // 2^24 - 3 is prime.
        assert_eq!(divisors((1 << 24) - 3), [1, (1 << 24) - 3]);
    }

    #[test]
    fn regions_follow_axis_order() {
        let mesh = Mesh::parse("dp=2,cp=2").unwrap();
        let shape = Shape::new(&[(DimName::Batch, 8), (DimName::Seq, 4)]);
        let spec = ShardSpec::replicated(2).with_shard(0, AxisName::Dp).with_shard(0, AxisName::Cp);
        assert_eq!(spec.local_sizes(&shape, &mesh), Ok(vec![2, 4]));
        let starts: Vec<u64> = (0..4).map(|rank| spec.region(&shape, &mesh, rank)[0].0).collect();
        assert_eq!(starts, vec![0, 2, 4, 6]);
        let bad = ShardSpec::replicated(2).with_shard(1, AxisName::Dp).with_shard(1, AxisName::Cp);
        assert_eq!(bad.local_sizes(&Shape::new(&[(DimName::Batch, 8), (DimName::Seq, 6)]), &mesh), Err((1, 4)));
        assert_eq!(valid_degrees(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(valid_degrees(0), Vec::<u64>::new());
        // u64::MAX = 3·5·17·257·641·65537·6700417: its divisors up to 2^16, at once.
        let small = [1, 3, 5, 15, 17, 51, 85, 255, 257, 641, 771, 1285, 1923, 3205, 3855, 4369, 9615, 10897, 13107];
        let large = [21845, 32691, 54485, 65535];
        assert_eq!(valid_degrees(u64::MAX), [&small[..], &large[..]].concat());
    }

    #[test]
    fn zero_splits_rows_over_each_data_parallel_axis_the_spec_leaves_free() {
        let mesh = Mesh::parse("dp=2,ep=2,tp=2").unwrap();
        let shape = Shape::new(&[(DimName::Hidden, 8), (DimName::Ffn, 6)]);
        // A dense weight split over tp on its rows: [tp] then dp, then ep (8/2/2/2 = 1 row a rank).
        let dense = ShardSpec::replicated(2).with_shard(0, AxisName::Tp);
        let split = dense.with_rows_split(&shape, &mesh, &ZERO_AXES).unwrap();
        assert_eq!(split.dims[0], [AxisName::Tp, AxisName::Dp, AxisName::Ep]);
        assert_eq!(split.rows_split_beyond(&dense), [(0, AxisName::Dp), (0, AxisName::Ep)]);
        assert_eq!(split.region(&shape, &mesh, 7)[0], (7, 1));
        // An expert weight ep already splits: dp alone.
        let expert = ShardSpec::replicated(2).with_shard(0, AxisName::Ep);
        assert_eq!(expert.with_rows_split(&shape, &mesh, &ZERO_AXES).unwrap().dims[0], [AxisName::Ep, AxisName::Dp]);
        // Rows that divide by dp but not by dp·ep: dp alone; by neither, or no free axis: none.
        let odd = Shape::new(&[(DimName::Hidden, 6), (DimName::Ffn, 6)]);
        assert_eq!(ShardSpec::replicated(2).with_rows_split(&odd, &mesh, &ZERO_AXES).unwrap().dims[0], [AxisName::Dp]);
        let odder = Shape::new(&[(DimName::Hidden, 3), (DimName::Ffn, 6)]);
        assert_eq!(ShardSpec::replicated(2).with_rows_split(&odder, &mesh, &ZERO_AXES), None);
        assert_eq!(ShardSpec::replicated(2).with_rows_split(&shape, &Mesh::parse("tp=2").unwrap(), &ZERO_AXES), None);
        assert_eq!(dense.rows_split_beyond(&expert), []);
        // cp's ranks hold the same weights: dp, then cp; an expert's too, beside ep.
        let mesh = Mesh::parse("dp=2,cp=2,ep=2").unwrap();
        let split = ShardSpec::replicated(2).with_rows_split(&shape, &mesh, &ZERO_AXES).unwrap();
        assert_eq!(split.dims[0], [AxisName::Dp, AxisName::Cp, AxisName::Ep]);
        assert_eq!(
            expert.with_rows_split(&shape, &mesh, &ZERO_AXES).unwrap().dims[0],
            [AxisName::Ep, AxisName::Dp, AxisName::Cp]
        );
        // Once a rank holds one row, the next dim splits: k's one head a tp rank on head_dim, so a
        // rank's part is still contiguous; rows that neither divide nor are one stop the split.
        let mesh = Mesh::parse("dp=2,ep=2,tp=2").unwrap();
        let heads = Shape::new(&[(DimName::KvHeads, 2), (DimName::HeadDim, 8), (DimName::Hidden, 4)]);
        let one_head = ShardSpec::replicated(3).with_shard(0, AxisName::Tp);
        let split = one_head.with_rows_split(&heads, &mesh, &ZERO_AXES).unwrap();
        assert_eq!(
            (split.dims[0].as_slice(), split.dims[1].as_slice()),
            (&[AxisName::Tp][..], &[AxisName::Dp, AxisName::Ep][..])
        );
        assert_eq!(split.rows_split_beyond(&one_head), [(1, AxisName::Dp), (1, AxisName::Ep)]);
        assert_eq!(split.region(&heads, &mesh, 7), [(1, 1), (6, 2), (0, 4)]);
        let two_rows = ShardSpec::replicated(3).with_rows_split(&heads, &mesh, &ZERO_AXES).unwrap();
        assert_eq!(
            (two_rows.dims[0].as_slice(), two_rows.dims[1].as_slice()),
            (&[AxisName::Dp][..], &[AxisName::Ep][..])
        );
        let three = Shape::new(&[(DimName::KvHeads, 3), (DimName::HeadDim, 8)]);
        assert_eq!(ShardSpec::replicated(2).with_rows_split(&three, &mesh, &ZERO_AXES), None);
    }
}
