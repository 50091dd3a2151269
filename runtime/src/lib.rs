//! pleat-runtime.

pub mod kernels;
