//! Byte-level BPE tokenisation (Qwen2 / Qwen3 `tokenizer.json`) with the `tokenizers` crate.
//!
//! The file's own normaliser (NFC), pre-tokeniser and added tokens are used as they are; nothing
//! is added around the text (Qwen has no BOS), so callers build the exact string the reference
//! tokenises, chat-template markers included (added tokens are matched inside the text).

use std::path::PathBuf;

use tessera_core::{Error, Result};

use crate::files::ModelFiles;

pub struct BpeTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl BpeTokenizer {
    /// Load `tokenizer.json` from `files`.
    pub fn load(files: &ModelFiles) -> Result<Self> {
        let path = files.path("tokenizer.json");
        let json = files.read("tokenizer.json")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| Error::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        Ok(BpeTokenizer { inner, path })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token ids of `text`, with no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }
}
