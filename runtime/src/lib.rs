//! pleat-runtime.
