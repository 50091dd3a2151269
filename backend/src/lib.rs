//! pleat-backend: per-rank lowering to `Program`, its serialized and text forms, and the static
//! collective-matching check.
//!
//! `lower` turns a sharded, verified `pleat_ir::Module` into one `Program` a rank: buffers with
//! local shapes and instructions with every size, slice offset and communication group resolved.
//! The runtime loads programs without the compiler. This crate declares what the runtime must do;
//! it knows nothing of how communicators or kernels work.

pub mod bucket;
pub mod error;
#[cfg(feature = "llvm")]
pub mod llvm;
pub mod lower;
#[cfg(test)]
mod lower_props;
pub mod matching;
pub mod memory;
pub mod native;
pub mod optimizer;
pub mod overlap;
pub mod pipeline;
pub mod program;
mod range_max;
pub mod relay;
pub mod text;
pub mod transfers;
pub mod validate;

pub use error::{Error, Result};
pub use lower::lower;
pub use matching::verify_collectives;
/// The element types buffers declare (the IR's).
pub use pleat_ir::DType;
pub use program::{
    AttentionDims, AttentionOperand, Buffer, BufferId, BufferKind, Group, Instr, Kernel, MoeDims, Program, RouterDims,
    TransferStream, FORMAT_VERSION,
};

/// Serializes a program (JSON, versioned).
pub fn to_json(program: &Program) -> String {
    serde_json::to_string(program).expect("a Program always serializes")
}

/// Reads a serialized program, refusing other format versions.
pub fn from_json(text: &str) -> Result<Program> {
    #[derive(serde::Deserialize)]
    struct Version {
        format_version: u32,
    }
    let version: Version = serde_json::from_str(text).map_err(|err| Error::Malformed { reason: err.to_string() })?;
    if version.format_version != FORMAT_VERSION {
        return Err(Error::FormatVersion { found: version.format_version, expected: FORMAT_VERSION });
    }
    let program: Program = serde_json::from_str(text).map_err(|err| Error::Malformed { reason: err.to_string() })?;
    validate::validate(&program)?;
    Ok(program)
}
