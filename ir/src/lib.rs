//! pleat-ir: the typed transformer graph IR.
