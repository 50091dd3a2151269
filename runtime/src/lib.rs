//! pleat-runtime.

pub mod weights;
