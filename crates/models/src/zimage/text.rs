//! Prompt → caption features, as diffusers' `ZImagePipeline._encode_prompt` does it: the Qwen3
//! chat template with one user turn and the generation prompt (thinking enabled, which adds no
//! `<think>` block), tokenised, cut to 512 ids, and read at `hidden_states[-2]` (the residual
//! stream after all layers but the last, no final norm), real tokens only (spec §2).
//!
//! The template is written out rather than rendered from the tokenizer's Jinja file: for a single
//! user message Qwen3's template reduces to exactly this string.

use tessera_core::Result;

use crate::qwen3::BpeTokenizer;

/// `max_sequence_length` of the pipeline: longer prompts are cut, as the reference's
/// `truncation=True` does (the end of the prompt and the assistant header are lost).
pub const MAX_PROMPT_TOKENS: usize = 512;

/// The string the reference tokenises for `prompt`.
pub fn chat_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
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

/// Token ids of the templated `prompt`, truncated to [`MAX_PROMPT_TOKENS`].
pub fn prompt_ids(tok: &BpeTokenizer, prompt: &str) -> Result<PromptIds> {
    let mut ids = tok.encode(&chat_template(prompt))?;
    let full_len = ids.len();
    ids.truncate(MAX_PROMPT_TOKENS);
    Ok(PromptIds { ids, full_len })
}
