//! Where a model's files come from: a folder on disk, or files compiled into the binary (the
//! bundled miniature models). Models read their files through this so both work the same way.

use std::path::{Path, PathBuf};

use tessera_core::{Error, Result, Weights};

#[derive(Clone, Debug)]
pub enum ModelFiles {
    Dir(PathBuf),
    /// `(file name, contents)` pairs compiled into the binary, under a display label.
    Embedded {
        label: &'static str,
        files: &'static [(&'static str, &'static [u8])],
    },
}

impl ModelFiles {
    /// Where the files are, for messages.
    pub fn location(&self) -> String {
        match self {
            ModelFiles::Dir(p) => p.display().to_string(),
            ModelFiles::Embedded { label, .. } => format!("<{label}>"),
        }
    }

    pub fn is_embedded(&self) -> bool {
        matches!(self, ModelFiles::Embedded { .. })
    }

    /// The display path of file `name` (a real path for folders).
    pub fn path(&self, name: &str) -> PathBuf {
        match self {
            ModelFiles::Dir(d) => d.join(name),
            ModelFiles::Embedded { label, .. } => Path::new(&format!("<{label}>")).join(name),
        }
    }

    fn embedded(&self, name: &str) -> Option<&'static [u8]> {
        match self {
            ModelFiles::Dir(_) => None,
            ModelFiles::Embedded { files, .. } => {
                files.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
            }
        }
    }

    /// The text of file `name`; `Ok(None)` when it does not exist.
    pub fn read_optional(&self, name: &str) -> Result<Option<String>> {
        match self {
            ModelFiles::Dir(d) => {
                let p = d.join(name);
                match std::fs::read_to_string(&p) {
                    Ok(s) => Ok(Some(s)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io(p, e)),
                }
            }
            ModelFiles::Embedded { .. } => self
                .embedded(name)
                .map(|b| {
                    String::from_utf8(b.to_vec())
                        .map_err(|_| Error::io(self.path(name), std::io::Error::other("not UTF-8")))
                })
                .transpose(),
        }
    }

    /// The text of file `name`, which must exist.
    pub fn read(&self, name: &str) -> Result<String> {
        self.read_optional(name)?.ok_or_else(|| Error::MissingFile {
            path: self.path(name),
            hint: String::new(),
        })
    }

    /// The checkpoint `{stem}.safetensors` (or its sharded index) in this folder.
    pub fn weights(&self, stem: &str) -> Result<Weights> {
        match self {
            ModelFiles::Dir(d) => Weights::open_dir(d, stem),
            ModelFiles::Embedded { label, .. } => {
                let name = format!("{stem}.safetensors");
                let bytes = self.embedded(&name).ok_or_else(|| Error::MissingFile {
                    path: self.path(&name),
                    hint: String::new(),
                })?;
                Weights::from_static(&format!("<{label}>/{name}"), bytes)
            }
        }
    }
}
