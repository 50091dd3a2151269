//! pleat-runtime.

pub mod comm;
