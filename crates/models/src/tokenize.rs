//! Text tokenisation with the `tokenizers` crate from a model's `tokenizer.json`.
//!
//! `<bos>`/`<eos>` are added by a rule that works with both kinds of Gemma tokenizer files found
//! in the wild: encode with the file's post-processor, then add `<bos>` only if the first id is
//! not already `<bos>` and `<eos>` only if the last is not `<eos>`. Their ids come from the files
//! (`tokenizer_config.json`'s `bos_token`/`eos_token` looked up in the vocabulary, else the model
//! config's ids), never from constants.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;
use tessera_core::{Error, Result};

use crate::files::ModelFiles;

#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    pub bos_id: u32,
    pub eos_id: u32,
    /// Characters in the vocabulary's longest token (added tokens included).
    longest_token: usize,
}

/// `"<bos>"` or `{"content": "<bos>", ...}` in `tokenizer_config.json`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Plain(String),
    Added { content: String },
}

impl TokenSpec {
    fn content(&self) -> &str {
        match self {
            TokenSpec::Plain(s) => s,
            TokenSpec::Added { content } => content,
        }
    }
}

#[derive(Deserialize, Default)]
struct TokenizerConfig {
    bos_token: Option<TokenSpec>,
    eos_token: Option<TokenSpec>,
}

impl TextTokenizer {
    /// Load `tokenizer.json` (and `tokenizer_config.json` if present). `fallback_bos_eos` are the
    /// model config's ids, used when the tokenizer files do not name the tokens.
    pub fn load(files: &ModelFiles, fallback_bos_eos: (Option<u32>, Option<u32>)) -> Result<Self> {
        let path = files.path("tokenizer.json");
        let json = files.read("tokenizer.json")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| Error::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let cfg_path = files.path("tokenizer_config.json");
        let cfg: TokenizerConfig = match files.read_optional("tokenizer_config.json")? {
            Some(text) => tessera_core::config::parse_json(&cfg_path, &text)?,
            None => TokenizerConfig::default(),
        };
        let resolve =
            |spec: &Option<TokenSpec>, fallback: Option<u32>, what: &str| -> Result<u32> {
                if let Some(spec) = spec {
                    return inner
                        .token_to_id(spec.content())
                        .ok_or_else(|| Error::Tokenizer {
                            path: path.clone(),
                            message: format!(
                                "{what} token {:?} (from {}) is not in the vocabulary",
                                spec.content(),
                                cfg_path.display()
                            ),
                        });
                }
                fallback.ok_or_else(|| Error::Tokenizer {
                    path: path.clone(),
                    message: format!(
                        "no {what} token: neither tokenizer_config.json nor config.json names it"
                    ),
                })
            };
        let bos_id = resolve(&cfg.bos_token, fallback_bos_eos.0, "bos")?;
        let eos_id = resolve(&cfg.eos_token, fallback_bos_eos.1, "eos")?;
        let longest_token = inner
            .get_vocab(true)
            .keys()
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(TextTokenizer {
            inner,
            path,
            bos_id,
            eos_id,
            longest_token,
        })
    }

    /// Characters in the longest token of the vocabulary. No token stands for more characters
    /// of text than its own string has (a byte-level token's string has one character per
    /// byte, which is at least one per character; a SentencePiece piece spells its text), so
    /// a text of `n` characters has at least `n / longest_token_chars()` tokens: a bound that
    /// refuses an over-long text before tokenising it, at about 190 bytes per character.
    pub fn longest_token_chars(&self) -> usize {
        self.longest_token
    }

    /// The most characters a text of at most `tokens` tokens can have (see
    /// [`longest_token_chars`](Self::longest_token_chars)).
    pub fn max_chars_for(&self, tokens: usize) -> usize {
        tokens.saturating_mul(self.longest_token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Added tokens cut out of any text whole, by content: matched on the raw text before it is
    /// normalised or split, with no whitespace or word-boundary rule (and special ones not
    /// turned back into text by `encode_special_tokens`), so that a string of them tokenises
    /// to their ids one for one — unless one is the concatenation of others, which a caller
    /// building ids this way checks against [`Self::encode_plain`] once.
    pub fn whole_added_tokens(&self) -> HashMap<String, u32> {
        let split_special = !self.inner.get_encode_special_tokens();
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| {
                !(t.single_word || t.lstrip || t.rstrip || t.normalized)
                    && (split_special || !t.special)
            })
            .map(|(id, t)| (t.content, id))
            .collect()
    }

    /// Added tokens in all, [`Self::whole_added_tokens`] or not.
    pub fn added_token_count(&self) -> usize {
        self.inner.get_added_tokens_decoder().len()
    }

    /// The file this tokenizer came from, for messages.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Token ids of `text` without any special tokens added.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`; special tokens (`<|im_end|>`, image markers, …) are left out when
    /// `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// `[<bos>] ids(text) [<eos>]`, each added exactly once whatever the file's post-processor does.
    pub fn encode_with_bos_eos(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        let mut ids = enc.get_ids().to_vec();
        if ids.first() != Some(&self.bos_id) {
            ids.insert(0, self.bos_id);
        }
        if ids.len() < 2 || ids.last() != Some(&self.eos_id) {
            ids.push(self.eos_id);
        }
        Ok(ids)
    }
}
