//! Reading the text files pleat takes (configs, plans, token lists, hardware specs, checkpoint
//! indexes): a file that is not UTF-8 is read with its bad bytes replaced by U+FFFD, so that the
//! file's own parser says where it goes wrong, under that file's code, rather than an I/O error
//! whose help is to check the path and its permissions.

use std::path::Path;

/// The text of the file at `path`; an error only where the operating system refuses the read.
pub fn read_text(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => String::from_utf8_lossy(error.as_bytes()).into_owned(),
    })
}
