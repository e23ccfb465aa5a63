//! `--model`: a folder or a Hugging Face repo id in the local cache; the bundled miniature model
//! when absent.

use tessera_core::{Result, model_dir};
use tessera_models::ModelFiles;

/// The files `--model` names (or the bundled model) and a label for output.
pub struct ModelChoice {
    pub files: ModelFiles,
    pub label: String,
}

impl ModelChoice {
    /// Said once on stderr after a successful run on the bundled model.
    pub fn note_if_bundled(&self) {
        if self.files.is_embedded() {
            eprintln!(
                "note: no --model given: this ran the bundled egemma2-mini (random weights: for checking an install, not for use)"
            );
        }
    }
}

impl ModelChoice {
    pub fn egemma2(spec: Option<&str>) -> Result<Self> {
        match spec {
            Some(spec) => Ok(ModelChoice {
                files: ModelFiles::Dir(model_dir::resolve(spec, "config.json")?),
                label: spec.to_string(),
            }),
            None => Ok(ModelChoice {
                files: tessera_models::egemma2::BUNDLED,
                label: "egemma2-mini (bundled, random weights)".to_string(),
            }),
        }
    }
}
