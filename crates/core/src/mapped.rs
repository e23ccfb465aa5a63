//! Checkpoint files mapped read-only into memory (safetensors and GGUF alike).

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// Map `path` read-only; a missing file is [`Error::MissingFile`], any other failure names it.
pub(crate) fn map_readonly(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile {
                path: path.to_path_buf(),
                hint: String::new(),
            }
        } else {
            Error::io(path, e)
        }
    })?;
    // SAFETY: the map is read-only, and its owners (`Weights`, `Gguf`) hand out borrows of it
    // only. Tessera never writes the file; another process truncating it while we run could
    // fault, the usual caveat of mmap-based weight loading shared by every safetensors and GGUF
    // reader.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}
