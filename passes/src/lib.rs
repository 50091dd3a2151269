//! pleat-passes.
