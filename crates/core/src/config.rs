//! Reading JSON configuration files with errors that name the file and, where possible, the field.

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Read and deserialize a JSON file. A missing file, invalid JSON and a field of the wrong type or
/// a missing required field each produce an error naming the file (and the field, via serde's
/// path in the message).
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = read_text(path)?;
    parse_json(path, &text)
}

/// Deserialize JSON text that came from `path` (used for configs embedded in the binary too).
/// A type error or a missing field names the field's full path (`text_config.hidden_size`).
pub fn parse_json<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner().to_string();
        if field == "." {
            Error::Json {
                path: path.to_path_buf(),
                message: inner,
            }
        } else {
            Error::config(path, field, inner)
        }
    })
}

/// Read a UTF-8 text file, mapping "not found" to [`Error::MissingFile`].
pub fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile {
                path: path.to_path_buf(),
                hint: String::new(),
            }
        } else {
            Error::io(path, e)
        }
    })
}
