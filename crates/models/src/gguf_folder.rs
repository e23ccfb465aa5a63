//! A model folder of GGUF files, as llama.cpp and Ollama take them: one language model and,
//! for a vision model, its projector (`mmproj-*.gguf`, `general.architecture = "clip"`). Each
//! file is told apart by its metadata, not its name.

use std::path::{Path, PathBuf};

use tessera_core::gguf::Gguf;
use tessera_core::{Error, Result};

/// The `.gguf` files of a folder, by role.
#[derive(Debug)]
pub struct GgufFolder {
    pub dir: PathBuf,
    /// Language models: each file with its `general.architecture`.
    pub models: Vec<(PathBuf, String)>,
    /// Vision (or audio) projectors.
    pub projectors: Vec<PathBuf>,
}

/// The file name of `p`, for messages.
pub fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

impl GgufFolder {
    /// Whether `dir` holds any `*.gguf` file.
    pub fn holds_gguf(dir: &Path) -> bool {
        gguf_files(dir).is_ok_and(|f| !f.is_empty())
    }

    /// Read the metadata of every `*.gguf` file of `dir` (sorted by name).
    pub fn scan(dir: &Path) -> Result<Self> {
        let mut models = Vec::new();
        let mut projectors = Vec::new();
        for path in gguf_files(dir)? {
            let g = Gguf::open(&path)?;
            let arch = g.get_str("general.architecture")?.to_string();
            let is_projector = arch == "clip"
                || g.get("general.type").is_some() && g.get_str("general.type")? == "mmproj";
            if is_projector {
                projectors.push(path);
            } else {
                models.push((path, arch));
            }
        }
        Ok(GgufFolder {
            dir: dir.to_path_buf(),
            models,
            projectors,
        })
    }

    /// The one language model of the folder, or why there is not exactly one.
    pub fn model(&self) -> Result<(&Path, &str)> {
        let dir = self.dir.display();
        match &self.models[..] {
            [(p, arch)] => Ok((p, arch)),
            [] if !self.projectors.is_empty() => Err(Error::input(format!(
                "{dir} holds only a vision projector ({}), no language model: put the model's \
                 own GGUF file (e.g. LFM2-VL-450M-Q8_0.gguf, from the same repository) beside it",
                self.projector_names()
            ))),
            [] => Err(Error::input(format!("{dir} holds no GGUF file"))),
            many => {
                let names: Vec<String> = many.iter().map(|(p, _)| file_name(p)).collect();
                Err(Error::input(format!(
                    "{dir} holds {} language-model GGUF files ({}): a model folder holds one \
                     (with its mmproj file); move the others out or give each its own folder",
                    many.len(),
                    names.join(", ")
                )))
            }
        }
    }

    fn projector_names(&self) -> String {
        let names: Vec<String> = self.projectors.iter().map(|p| file_name(p)).collect();
        names.join(", ")
    }

    /// The one projector of the folder, or why there is not exactly one; `model` names the
    /// language model it belongs to, for the message.
    pub fn projector(&self, model: &str) -> Result<&Path> {
        let dir = self.dir.display();
        match &self.projectors[..] {
            [p] => Ok(p),
            [] => Err(Error::input(format!(
                "{dir}: {model} is a vision-language model, but the folder has no projector \
                 file (mmproj-*.gguf) beside it: download the mmproj GGUF from the same \
                 repository into the folder"
            ))),
            _ => Err(Error::input(format!(
                "{dir} holds {} projector files ({}): keep the one that belongs to {model}",
                self.projectors.len(),
                self.projector_names()
            ))),
        }
    }
}

fn gguf_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir.to_path_buf(), e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    files.sort();
    Ok(files)
}
