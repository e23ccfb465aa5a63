//! Where a model's files come from: a folder on disk, files compiled into the binary (the
//! bundled miniature models), or files derived from another format (a GGUF model's metadata
//! written as the Hugging Face files it came from). Models read their files through this so all
//! work the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_core::{Error, Result, Weights};

#[derive(Clone, Debug)]
pub enum ModelFiles {
    Dir(PathBuf),
    /// `(file name, contents)` pairs compiled into the binary, under a display label.
    Embedded {
        label: &'static str,
        files: &'static [(&'static str, &'static [u8])],
    },
    /// A folder in another format, seen as the Hugging Face files a loader reads.
    Derived(Arc<Derived>),
}

/// The text files and weights made from a folder of another format (see
/// [`crate::lfm2vl::gguf`]).
pub struct Derived {
    /// The folder, for messages.
    pub dir: PathBuf,
    /// `(file name, the file it was made from, text)`.
    pub texts: Vec<(String, PathBuf, String)>,
    /// The tensors under the checkpoint's names (`model` is the only stem).
    pub weights: Weights,
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.texts.iter().map(|t| t.0.as_str()).collect();
        f.debug_struct("Derived")
            .field("dir", &self.dir)
            .field("texts", &names)
            .finish()
    }
}

impl ModelFiles {
    /// Where the files are, for messages.
    pub fn location(&self) -> String {
        match self {
            ModelFiles::Dir(p) => p.display().to_string(),
            ModelFiles::Embedded { label, .. } => format!("<{label}>"),
            ModelFiles::Derived(d) => d.dir.display().to_string(),
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
            // Errors about a derived file name the file it came from.
            ModelFiles::Derived(d) => match d.texts.iter().find(|t| t.0 == name) {
                Some((_, from, _)) => PathBuf::from(format!("{} (as {name})", from.display())),
                None => d.dir.join(name),
            },
        }
    }

    fn embedded(&self, name: &str) -> Option<&'static [u8]> {
        match self {
            ModelFiles::Dir(_) | ModelFiles::Derived(_) => None,
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
            ModelFiles::Derived(d) => Ok(d.texts.iter().find(|t| t.0 == name).map(|t| t.2.clone())),
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
            ModelFiles::Derived(d) if stem == "model" => Ok(d.weights.clone()),
            ModelFiles::Derived(d) => Err(Error::MissingFile {
                path: d.dir.join(format!("{stem}.safetensors")),
                hint: " (a folder of GGUF files holds only the model's weights)".into(),
            }),
        }
    }
}
