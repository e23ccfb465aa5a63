//! Prompt → caption features, as diffusers' `ZImagePipeline._encode_prompt` does it: the
//! tokenizer's chat template rendered for one user turn with the generation prompt and
//! `enable_thinking=True`, tokenised, cut to 512 ids, and read at `hidden_states[-2]` (the
//! residual stream after all layers but the last, no final norm), real tokens only (spec §2).
//!
//! The template is the one the checkpoint ships ([`ChatTemplate`]), so a fine-tune's own template
//! gives the reference's token ids. A tokenizer folder without one gets Qwen3's template for one
//! user turn, written out ([`builtin_template`]); `tessera info` says which is used.

use minijinja::value::Value;
use tessera_core::Result;

use crate::ModelFiles;
use crate::chat_template::{ChatTemplate, Message};
use crate::qwen3::BpeTokenizer;

/// `max_sequence_length` of the pipeline: longer prompts are cut, as the reference's
/// `truncation=True` does (the end of the prompt and the assistant header are lost).
pub const MAX_PROMPT_TOKENS: usize = 512;

/// What Qwen3's chat template renders for one user turn with the generation prompt and thinking
/// enabled (which adds no `<think>` block): the format when a folder ships no template.
pub fn builtin_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// How a prompt becomes the text the tokenizer reads.
#[derive(Debug)]
pub enum PromptTemplate {
    /// The tokenizer folder's chat template.
    Shipped(Box<ChatTemplate>),
    /// No template in the folder: [`builtin_template`].
    Builtin,
}

impl PromptTemplate {
    /// The template of the tokenizer folder `files`, or the built-in format when it has none.
    pub fn load(files: &ModelFiles) -> Result<Self> {
        Ok(match ChatTemplate::load(files)? {
            Some(t) => PromptTemplate::Shipped(Box::new(t)),
            None => PromptTemplate::Builtin,
        })
    }

    /// The text the reference tokenises for `prompt`.
    pub fn render(&self, prompt: &str) -> Result<String> {
        match self {
            PromptTemplate::Shipped(t) => t.render(
                &[Message::new("user", prompt)],
                true,
                &[("enable_thinking", Value::from(true))],
            ),
            PromptTemplate::Builtin => Ok(builtin_template(prompt)),
        }
    }

    /// Which template is used, for `tessera info`.
    pub fn describe(&self) -> String {
        match self {
            PromptTemplate::Shipped(t) => {
                format!("the tokenizer's chat template ({})", t.path().display())
            }
            PromptTemplate::Builtin => {
                "Qwen3's chat format, built in (the tokenizer folder has no chat template)".into()
            }
        }
    }
}

/// A tokenised prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptIds {
    /// At most [`MAX_PROMPT_TOKENS`] ids.
    pub ids: Vec<u32>,
    /// Length before truncation.
    pub full_len: usize,
}

impl PromptIds {
    pub fn truncated(&self) -> bool {
        self.full_len > self.ids.len()
    }
}

/// Token ids of `prompt` rendered through `template`, truncated to [`MAX_PROMPT_TOKENS`].
pub fn prompt_ids(
    tok: &BpeTokenizer,
    template: &PromptTemplate,
    prompt: &str,
) -> Result<PromptIds> {
    let mut ids = tok.encode(&template.render(prompt)?)?;
    let full_len = ids.len();
    ids.truncate(MAX_PROMPT_TOKENS);
    Ok(PromptIds { ids, full_len })
}
