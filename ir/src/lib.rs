//! pleat-ir: the typed transformer graph IR.
//!
//! It holds the data every other part of pleat works on: typed entity ids and arenas (`entity`),
//! element types, named-dim shapes, device meshes, sharding specs (`ShardSpec`: replicate, shard,
//! partial, the DTensor/GSPMD model), the closed `Op` enum, the `Graph` and `Module`, the model
//! builder for Hugging Face Llama-family configs (`model`), the text format and the reference
//! interpreter. It does no IO: callers hand it strings and tensors. It knows nothing of passes,
//! egg, per-rank programs or kernels.
#![deny(missing_docs)]

pub mod dtype;
pub mod entity;
pub mod error;
pub mod graph;
pub mod interp;
pub mod mesh;
pub mod model;
pub mod op;
pub mod optim;
pub mod shape;
pub mod spec;
pub mod text;

pub use dtype::DType;
pub use error::{Error, Result};
pub use graph::{Graph, Module, NodeData, NodeId, ValueData, ValueId};
pub use mesh::{AxisName, Mesh, MeshAxis};
pub use op::{MlpOperand, MoeOperand, Op};
pub use shape::{Dim, DimName, Shape, TensorType};
pub use spec::{ShardSpec, ZERO_AXES};
