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

    /// Refuse a tokenizer with more tokens than the text encoder it feeds has embeddings for (an
    /// id past the table would be out of bounds), naming the tokenizer's file.
    pub fn check_fits(&self, vocab_size: usize) -> Result<()> {
        if self.vocab_size() <= vocab_size {
            return Ok(());
        }
        Err(Error::config(
            self.path.clone(),
            "vocab",
            format!(
                "{} tokens, more than the text encoder's vocab_size {vocab_size}",
                self.vocab_size()
            ),
        ))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint whose tokenizer has ids past the text encoder's embedding table is refused,
    /// naming the tokenizer's file; one that fits passes.
    #[test]
    fn a_tokenizer_larger_than_the_embedding_table_is_refused() {
        let t = BpeTokenizer::load(&crate::qwen_image::BUNDLED.processor).expect("bundled");
        let n = t.vocab_size();
        assert!(t.check_fits(n).is_ok());
        let e = t
            .check_fits(n - 1)
            .expect_err("one embedding short")
            .to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains(&format!("{n} tokens")),
            "{e}"
        );
    }
}
