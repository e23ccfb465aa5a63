//! `--model`: a folder or a Hugging Face repo id in the local cache, identified by the runtime
//! (family, capability, ops); the bundled miniature model of the command's family when absent.

use tessera_core::{Error, Result};
use tessera_models::ModelFiles;
use tessera_models::zimage::ZImageFiles;
use tessera_runtime::{Capability, Family, ModelFilesOf, ModelSpec};

/// The model `spec` names for a command that needs `capability`.
pub fn open(spec: Option<&str>, capability: Capability) -> Result<ModelSpec> {
    let bundled = match capability {
        Capability::Embed => Family::EmbeddingGemma2,
        Capability::GenerateImage => Family::ZImage,
        Capability::Chat => {
            return Err(Error::input("no chat model is supported yet"));
        }
    };
    ModelSpec::open(spec, bundled)?.expect(capability)
}

/// Said once on stderr after a successful run on a bundled model.
pub fn note_if_bundled(spec: &ModelSpec) {
    if spec.is_bundled() {
        eprintln!(
            "note: no --model given: this ran the {} (random weights: for checking an install, not for use)",
            spec.family.bundled_name()
        );
    }
}

/// The files of an embedding model.
pub fn embedding_files(spec: &ModelSpec) -> Result<ModelFiles> {
    match &spec.files {
        ModelFilesOf::EmbeddingGemma2(f) => Ok(f.clone()),
        _ => Err(Error::input(format!(
            "{} is not an embedding model",
            spec.label
        ))),
    }
}

/// The files of a text-to-image model.
pub fn image_files(spec: &ModelSpec) -> Result<ZImageFiles> {
    match &spec.files {
        ModelFilesOf::ZImage(f) => Ok(f.clone()),
        _ => Err(Error::input(format!(
            "{} is not a text-to-image model",
            spec.label
        ))),
    }
}
