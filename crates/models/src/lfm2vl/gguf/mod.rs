//! LFM2-VL from the GGUF files its authors publish (`LFM2-VL-450M-Q8_0.gguf` and
//! `mmproj-LFM2-VL-450M-Q8_0.gguf`, as llama.cpp and Ollama run them): the folder is seen as the
//! Hugging Face checkpoint it was converted from ([`ModelFiles::Derived`]), so the config, the
//! prompt builder, the image processor and both loaders read it unchanged.
//!
//! - [`config`](self::config) writes `config.json` from `lfm2.*` and `clip.vision.*`, and
//!   `preprocessor_config.json` from `clip.vision.*`;
//! - [`tokenizer`](self::tokenizer) writes `tokenizer.json`, `tokenizer_config.json` and
//!   `chat_template.jinja` from `tokenizer.*`;
//! - [`names`] maps llama.cpp's tensor names and layouts to the checkpoint's. Tensors are read
//!   in place from both files in their stored dtype (Q8_0, Q4_0, Q4_K, Q6_K blocks included),
//!   except the patch embedding, which is re-laid-out once.

mod config;
mod names;
mod tokenizer;

use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use tessera_core::gguf::Gguf;
use tessera_core::{Error, Result, Weights};

use crate::files::{Derived, ModelFiles};
use crate::gguf_folder::{GgufFolder, file_name};

/// `general.architecture` of LFM2's language model.
pub const ARCHITECTURE: &str = "lfm2";

/// The LFM2-VL checkpoint of the GGUF folder `dir`: one LFM2 language model and its projector.
pub fn files(dir: &Path) -> Result<ModelFiles> {
    let folder = GgufFolder::scan(dir)?;
    let (lm_path, arch) = folder.model()?;
    if arch != ARCHITECTURE {
        return Err(Error::input(format!(
            "{}: {} is a GGUF of architecture {arch:?}, which Tessera does not run as --model \
             (it runs LFM2-VL's, {ARCHITECTURE:?}, with its mmproj file)",
            dir.display(),
            file_name(lm_path)
        )));
    }
    let proj_path = folder.projector(&file_name(lm_path))?;
    let lm = Gguf::open(lm_path)?;
    let proj = Gguf::open(proj_path)?;
    let kind = ["clip.projector_type", "clip.vision.projector_type"]
        .into_iter()
        .find(|k| proj.get(k).is_some())
        .map(|k| proj.get_str(k))
        .transpose()?;
    if kind != Some("lfm2") {
        return Err(Error::input(format!(
            "{}: {} is a projector of type {}, not LFM2-VL's (\"lfm2\"): use the mmproj file \
             published with {}",
            dir.display(),
            file_name(proj_path),
            kind.map_or("(none given)".to_string(), |k| format!("{k:?}")),
            file_name(lm_path)
        )));
    }
    let tok = tokenizer::make(&lm)?;
    let made = config::config(&lm, &proj, tok.image_token, tok.bos, tok.eos)?;
    let preprocessor = config::preprocessor(&proj)?;
    let generation = json!({
        "bos_token_id": tok.bos,
        "eos_token_id": tok.eos,
        "pad_token_id": tok.pad,
    });
    let dims = made.dims;
    let weights = Weights::open_gguf_as(&[lm_path, proj_path], &|n| names::view(n, dims))?;
    let text = |v: &serde_json::Value| v.to_string();
    let texts = vec![
        (
            "config.json".into(),
            lm_path.to_path_buf(),
            text(&made.config),
        ),
        (
            "tokenizer.json".into(),
            lm_path.to_path_buf(),
            text(&tok.tokenizer),
        ),
        (
            "tokenizer_config.json".into(),
            lm_path.to_path_buf(),
            text(&tok.tokenizer_config),
        ),
        (
            "chat_template.jinja".into(),
            lm_path.to_path_buf(),
            tok.chat_template,
        ),
        (
            "generation_config.json".into(),
            lm_path.to_path_buf(),
            text(&generation),
        ),
        (
            crate::lfm2vl::processor::CONFIG_FILE.into(),
            proj_path.to_path_buf(),
            text(&preprocessor),
        ),
    ];
    Ok(ModelFiles::Derived(Arc::new(Derived {
        dir: dir.to_path_buf(),
        texts,
        weights,
    })))
}
