//! Element types of tensors.
//!
//! The reference interpreter computes in f32 whatever the declared type (and, run as stored,
//! rounds each bf16 value as the runtime does). The CPU runtime stores a
//! bf16 buffer as bf16 (computing in f32 and rounding when it stores) and every other float buffer
//! as f32; the declared type sets the bytes the cost model and memory planner count.

use serde::{Deserialize, Serialize};

/// The element type of a value.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 32-bit integer: token ids and positions.
    I32,
}

impl DType {
    /// Bytes an element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
    /// The spelling in the text format.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
        }
    }
    /// Every dtype, for parsers and generators.
    pub const ALL: [DType; 4] = [DType::F32, DType::Bf16, DType::F16, DType::I32];
    /// Parses the text spelling.
    pub fn parse(text: &str) -> Option<DType> {
        Self::ALL.into_iter().find(|dtype| dtype.as_str() == text)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
