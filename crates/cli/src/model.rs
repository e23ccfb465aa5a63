//! `--model`: a folder or a Hugging Face repo id (downloaded into the cache on first use),
//! identified by the runtime (family, capability, ops); the bundled miniature model of the
//! command's family when absent.

use tessera_core::{Error, Result};
use tessera_models::{ModelFiles, egemma2};
use tessera_runtime::{Capability, Family, ModelFilesOf, ModelSpec};

/// The model `spec` names for a command that needs `capability`.
pub fn open(spec: Option<&str>, capability: Capability) -> Result<ModelSpec> {
    let bundled = match capability {
        Capability::Embed => Family::EmbeddingGemma2,
        Capability::GenerateImage => Family::ZImage,
        Capability::Chat => Family::Lfm2Vl,
    };
    crate::pull::ensure_local(spec)?;
    ModelSpec::open(spec, bundled)?.expect(capability)
}

/// Said once on stderr after a successful run on a bundled model; `given` is what `--model`
/// said (`bundled:NAME` asks for a miniature by name, and is not told it gave none).
pub fn note_if_bundled(spec: &ModelSpec, given: Option<&str>) {
    if spec.is_bundled() {
        let how = if given.is_some() {
            ""
        } else {
            "no --model given: "
        };
        eprintln!(
            "note: {how}this ran the {} (random weights: for checking an install, not for use)",
            spec.family.bundled_name()
        );
    }
}

/// The error for a model of another kind than the command needs (`expect` has already ruled it
/// out for models opened through [`open`]).
fn not_a(spec: &ModelSpec, kind: &str) -> Error {
    Error::input(format!("{} is not {kind}", spec.label))
}

/// The files of an embedding model and its config as `spec` read it.
pub fn embedding_model(spec: &ModelSpec) -> Result<(ModelFiles, &egemma2::Config)> {
    match &spec.files {
        ModelFilesOf::EmbeddingGemma2(f, c) => Ok((f.clone(), c)),
        _ => Err(not_a(spec, "an embedding model")),
    }
}
