//! Device meshes: ordered, named axes with sizes.
//!
//! A mesh of axes `dp=2, tp=4` holds 8 ranks numbered row-major over the axes (the last axis varies
//! fastest, so `tp` groups are ranks that differ only in their last coordinate, which a launcher
//! places inside one node). Axis names come from a closed set: each names a parallelism strategy.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The name of a mesh axis; each stands for the parallelism that uses it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AxisName {
    /// Data parallelism: batch split, weights replicated.
    Dp,
    /// Megatron tensor parallelism: weights split, tokens replicated.
    Tp,
    /// Sequence parallelism beside `tp` (norms and residuals split on seq).
    Sp,
    /// Context parallelism: sequence split, ring attention.
    Cp,
    /// Pipeline parallelism: layers split into stages.
    Pp,
    /// Tensor-and-sequence parallelism: one axis splits both weights and tokens.
    Tsp,
    /// Expert parallelism.
    Ep,
}

impl AxisName {
    /// Every axis name.
    pub const ALL: [AxisName; 7] =
        [AxisName::Dp, AxisName::Tp, AxisName::Sp, AxisName::Cp, AxisName::Pp, AxisName::Tsp, AxisName::Ep];
    /// The spelling users type.
    pub fn as_str(self) -> &'static str {
        match self {
            AxisName::Dp => "dp",
            AxisName::Tp => "tp",
            AxisName::Sp => "sp",
            AxisName::Cp => "cp",
            AxisName::Pp => "pp",
            AxisName::Tsp => "tsp",
            AxisName::Ep => "ep",
        }
    }
    /// Parses the spelling users type.
    pub fn parse(text: &str) -> Option<AxisName> {
        Self::ALL.into_iter().find(|axis| axis.as_str() == text)
    }
}

impl std::fmt::Display for AxisName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One axis of a mesh.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    /// Its name.
    pub name: AxisName,
    /// Its degree (the number of ranks along it).
    pub size: u64,
}

/// A device mesh: ordered axes, outermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Mesh {
    axes: Vec<MeshAxis>,
}

impl Mesh {
    /// The most ranks a mesh may have: ranks are `u32`s, and a rank's groups are listed in full, so a
    /// bound far above any cluster (16,777,216) keeps every mesh computation in range.
    pub const MAX_RANKS: u64 = 1 << 24;

    /// Builds a mesh, checking that names are unique, sizes positive and the ranks at most
    /// [`Mesh::MAX_RANKS`].
    pub fn new(axes: &[(AxisName, u64)]) -> Result<Mesh> {
        let ranks = axes.iter().fold(1u64, |ranks, &(_, size)| ranks.saturating_mul(size));
        if ranks > Self::MAX_RANKS {
            return Err(Error::MeshTooLarge { ranks, max: Self::MAX_RANKS });
        }
        let mut mesh = Mesh::default();
        for &(name, size) in axes {
            if size == 0 {
                return Err(Error::MeshAxisZero { axis: name.to_string() });
            }
            if mesh.axis(name).is_some() {
                return Err(Error::MeshAxisRepeated { axis: name.to_string() });
            }
            mesh.axes.push(MeshAxis { name, size });
        }
        Ok(mesh)
    }

    /// Parses `dp=2,tsp=4` (also `dp=2 x tsp=4`); the empty string is the one-rank mesh.
    pub fn parse(text: &str) -> Result<Mesh> {
        let mut axes = Vec::new();
        // `x` separates axes only as a word of its own, so that an unknown name holding an x is
        // named whole in the error.
        for part in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|part| !part.is_empty() && *part != "x")
        {
            let Some((name, size)) = part.split_once('=') else {
                return Err(Error::MeshSyntax { text: text.to_string(), part: part.to_string() });
            };
            let axis = AxisName::parse(name.trim())
                .ok_or_else(|| Error::MeshUnknownAxis { text: text.to_string(), axis: name.trim().to_string() })?;
            let size: u64 = size
                .trim()
                .parse()
                .map_err(|_| Error::MeshSyntax { text: text.to_string(), part: part.to_string() })?;
            axes.push((axis, size));
        }
        Mesh::new(&axes)
    }

    /// The mesh without its axes of one rank, which split nothing (every rank's coordinate on
    /// them is 0, so ranks and the other axes' groups are the same).
    pub fn without_unit_axes(&self) -> Mesh {
        Mesh { axes: self.axes.iter().filter(|axis| axis.size > 1).cloned().collect() }
    }

    /// The axes, outermost first.
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }
    /// The axis called `name`, if the mesh has it.
    pub fn axis(&self, name: AxisName) -> Option<&MeshAxis> {
        self.axes.iter().find(|axis| axis.name == name)
    }
    /// The degree of axis `name`; 1 when the mesh lacks it.
    pub fn degree(&self, name: AxisName) -> u64 {
        self.axis(name).map_or(1, |axis| axis.size)
    }
    /// The number of ranks.
    pub fn world_size(&self) -> u64 {
        self.axes.iter().map(|axis| axis.size).product()
    }
    fn position(&self, name: AxisName) -> Option<usize> {
        self.axes.iter().position(|axis| axis.name == name)
    }
    /// The coordinate of `rank` along axis `name` (0 when the mesh lacks it).
    pub fn coord(&self, rank: u32, name: AxisName) -> u64 {
        let Some(position) = self.position(name) else {
            return 0;
        };
        let inner: u64 = self.axes[position + 1..].iter().map(|axis| axis.size).product();
        (u64::from(rank) / inner) % self.axes[position].size
    }
    /// The ranks of `rank`'s group along `name`, ordered by their coordinate on that axis.
    pub fn group(&self, rank: u32, name: AxisName) -> Vec<u32> {
        self.group_over(rank, &[name])
    }
    /// The ranks that share `rank`'s coordinates on every axis but `names`, ordered as a dim split
    /// over `names` (outermost first) orders its blocks: by the first axis's coordinate, then the
    /// second's. An axis the mesh lacks adds nothing.
    pub fn group_over(&self, rank: u32, names: &[AxisName]) -> Vec<u32> {
        let mut group = vec![u64::from(rank)];
        for &name in names {
            let Some(position) = self.position(name) else { continue };
            let inner: u64 = self.axes[position + 1..].iter().map(|axis| axis.size).product();
            let offset = self.coord(rank, name) * inner;
            group = group
                .iter()
                .flat_map(|&member| (0..self.axes[position].size).map(move |coord| member - offset + coord * inner))
                .collect();
        }
        group.into_iter().map(|member| member as u32).collect()
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, axis) in self.axes.iter().enumerate() {
            if index > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", axis.name, axis.size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_row_major() {
        let mesh = Mesh::parse("dp=2,tp=4").unwrap();
        assert_eq!(mesh.world_size(), 8);
        assert_eq!(mesh.group(5, AxisName::Tp), vec![4, 5, 6, 7]);
        assert_eq!(mesh.group(5, AxisName::Dp), vec![1, 5]);
        assert_eq!(mesh.coord(6, AxisName::Tp), 2);
        assert_eq!(mesh.coord(6, AxisName::Dp), 1);
        assert_eq!(mesh.group(3, AxisName::Pp), vec![3]);
        assert_eq!(mesh.to_string(), "dp=2,tp=4");
    }

    #[test]
    fn a_group_over_two_axes_orders_its_ranks_as_a_dim_split_over_both() {
        // dp=2, ep=2, tp=2: rank = 4·dp + 2·ep + tp. Rank 7 (dp 1, ep 1, tp 1) shares tp 1 with
        // 1, 3, 5, 7; split over [dp, ep], block b = 2·dp + ep, and [ep, dp] gives b = 2·ep + dp.
        let mesh = Mesh::parse("dp=2,ep=2,tp=2").unwrap();
        assert_eq!(mesh.group_over(7, &[AxisName::Dp, AxisName::Ep]), vec![1, 3, 5, 7]);
        assert_eq!(mesh.group_over(7, &[AxisName::Ep, AxisName::Dp]), vec![1, 5, 3, 7]);
        assert_eq!(mesh.group_over(2, &[AxisName::Dp, AxisName::Cp, AxisName::Ep]), vec![0, 2, 4, 6]);
        assert_eq!(mesh.group_over(2, &[]), vec![2]);
        assert_eq!(mesh.group_over(6, &[AxisName::Dp]), mesh.group(6, AxisName::Dp));
    }

    #[test]
    fn dropping_axes_of_one_rank_keeps_every_ranks_groups() {
        let mesh = Mesh::parse("pp=1,dp=2,ep=1,tp=2,cp=1").unwrap();
        let kept = mesh.without_unit_axes();
        assert_eq!(kept.to_string(), "dp=2,tp=2");
        assert_eq!(kept.world_size(), mesh.world_size());
        for rank in 0..4 {
            for axis in [AxisName::Dp, AxisName::Tp, AxisName::Ep] {
                assert_eq!(kept.group(rank, axis), mesh.group(rank, axis), "rank {rank} {axis}");
            }
        }
    }

    #[test]
    fn bad_meshes_are_named() {
        assert_eq!(
            Mesh::parse("tq=2").unwrap_err().to_string(),
            "mesh `tq=2`: unknown axis `tq`; axes are dp, tp, sp, cp, pp, tsp, ep"
        );
        // A name holding an x is named whole; a lone x still separates axes.
        assert_eq!(
            Mesh::parse("xx=2").unwrap_err().to_string(),
            "mesh `xx=2`: unknown axis `xx`; axes are dp, tp, sp, cp, pp, tsp, ep"
        );
        assert_eq!(Mesh::parse("dp=2 x\ttp=4").unwrap().to_string(), "dp=2,tp=4");
        assert_eq!(
            Mesh::parse("tp=two").unwrap_err().to_string(),
            "mesh `tp=two`: cannot read `tp=two`; write axes as name=size separated by commas, e.g. dp=2,tp=4"
        );
        assert_eq!(Mesh::parse("tp=2,tp=2").unwrap_err().to_string(), "mesh axis tp appears twice");
        assert_eq!(Mesh::parse("tp=0").unwrap_err().to_string(), "mesh axis tp has size 0; sizes are at least 1");
        // Found by tests/fuzz.rs: a huge axis made listing a rank's group allocate hundreds of GB.
        assert_eq!(
            Mesh::parse("dp=4096,tp=4096,pp=18446744073709551615").unwrap_err().to_string(),
            "a mesh of 18446744073709551615 ranks is more than pleat addresses (16777216); use fewer or smaller axes"
        );
        assert!(Mesh::parse("dp=2048,pp=16,tp=8").is_ok());
    }
}
