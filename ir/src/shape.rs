//! Shapes with named dimensions.
//!
//! Every dimension of every value carries a name from a closed set. Names make sharding specs,
//! collectives and error messages read like the model (`seq`, `heads`) rather than like indices, and
//! the verifier checks that ops see the dims they expect. A name appears at most once in a shape.

use serde::{Deserialize, Serialize};

/// The name of a dimension.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DimName {
    /// Sequences in a batch.
    Batch,
    /// Tokens in a sequence.
    Seq,
    /// The model (residual stream) width.
    Hidden,
    /// Query attention heads.
    Heads,
    /// Key/value attention heads (fewer than `Heads` under grouped-query attention).
    KvHeads,
    /// The width of one attention head.
    HeadDim,
    /// The MLP's inner width.
    Ffn,
    /// The vocabulary.
    Vocab,
    /// The routed experts of a mixture-of-experts layer.
    Experts,
}

impl DimName {
    /// Every name, in a fixed order.
    pub const ALL: [DimName; 9] = [
        DimName::Batch,
        DimName::Seq,
        DimName::Hidden,
        DimName::Heads,
        DimName::KvHeads,
        DimName::HeadDim,
        DimName::Ffn,
        DimName::Vocab,
        DimName::Experts,
    ];
    /// The spelling in the text format.
    pub fn as_str(self) -> &'static str {
        match self {
            DimName::Batch => "batch",
            DimName::Seq => "seq",
            DimName::Hidden => "hidden",
            DimName::Heads => "heads",
            DimName::KvHeads => "kv_heads",
            DimName::HeadDim => "head_dim",
            DimName::Ffn => "ffn",
            DimName::Vocab => "vocab",
            DimName::Experts => "experts",
        }
    }
    /// Parses the text spelling.
    pub fn parse(text: &str) -> Option<DimName> {
        Self::ALL.into_iter().find(|name| name.as_str() == text)
    }
}

impl std::fmt::Display for DimName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dimension: its name and global (unsharded) size.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Dim {
    /// What the dimension indexes.
    pub name: DimName,
    /// Its global size.
    pub size: u64,
}

/// A shape: dims outermost first (row-major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    /// Builds a shape from (name, size) pairs.
    pub fn new(dims: &[(DimName, u64)]) -> Shape {
        Shape(dims.iter().map(|&(name, size)| Dim { name, size }).collect())
    }
    /// The dims.
    pub fn dims(&self) -> &[Dim] {
        &self.0
    }
    /// The number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// The position of dim `name`, if present.
    pub fn position(&self, name: DimName) -> Option<usize> {
        self.0.iter().position(|dim| dim.name == name)
    }
    /// The size of dim `name`, if present.
    pub fn size_of(&self, name: DimName) -> Option<u64> {
        self.0.iter().find(|dim| dim.name == name).map(|dim| dim.size)
    }
    /// The number of elements.
    pub fn numel(&self) -> u64 {
        self.0.iter().map(|dim| dim.size).product()
    }
    /// The sizes, outermost first.
    pub fn sizes(&self) -> Vec<u64> {
        self.0.iter().map(|dim| dim.size).collect()
    }
    /// The names, outermost first.
    pub fn names(&self) -> Vec<DimName> {
        self.0.iter().map(|dim| dim.name).collect()
    }
}

/// A value's type: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// The element type.
    pub dtype: crate::DType,
    /// The global shape.
    pub shape: Shape,
}

impl TensorType {
    /// Builds a type.
    pub fn new(dtype: crate::DType, dims: &[(DimName, u64)]) -> TensorType {
        TensorType { dtype, shape: Shape::new(dims) }
    }
    /// Global bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.numel() * self.dtype.size_bytes()
    }
}
