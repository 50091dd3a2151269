//! pleat-backend.
