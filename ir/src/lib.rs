//! pleat-ir: the typed transformer graph IR.

pub mod model;
