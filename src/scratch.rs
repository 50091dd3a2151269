//! A scratch directory of this process under the system's temporary directory, removed when it is
//! dropped: where `--native` writes the libraries it loads and `pleat run DIR` the rank
//! executables' tokens and outcomes.

use std::path::{Path, PathBuf};

/// A fresh directory, removed (with what it holds) on drop.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `pleat-<purpose>-<pid>-<nanoseconds>` in the temporary directory.
    pub fn new(purpose: &str) -> std::io::Result<ScratchDir> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_nanos());
        let path = std::env::temp_dir().join(format!("pleat-{purpose}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(ScratchDir(path))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
