//! The prompt's features: Qwen-Image-2.1's raw prompt template, tokenised, run through the
//! Qwen3-VL language model, read **before its final norm**, with the system turn's rows dropped
//! (spec A6; diffusers' `_get_qwen_prompt_embeds`).
//!
//! The pipeline formats a raw string rather than applying the chat template (the two tokenise
//! differently and the checkpoint expects this one); the rows it drops are the tokens of the
//! system turn alone, which Qwen3-VL's template renders as `<|im_start|>system\n…<|im_end|>\n`
//! (the fixture generator checks that for the miniature's template). Qwen has no BOS token, so
//! an empty prompt is encoded as `" "`. For text alone Qwen3-VL's multimodal RoPE is the 1-D
//! one; a prompt with condition images ([`TextEncoder::features_with_images`]) takes the vision
//! tower's rows at its pad tokens, DeepStack rows added after the first layers, and the
//! interleaved multimodal RoPE of its positions ([`super::vision::prompt`]).

use tessera_backend::{Backend, RopeStyle, RopeTable};
use tessera_core::{Error, Result, Weights};

use super::vision::{EditPrompt, VisionFeatures};
use crate::blocks::rope::{inv_freq, mrope_interleaved_angles};
use crate::qwen3::model::Media;
use crate::qwen3::{BpeTokenizer, Qwen3Config, Qwen3TextModel};

/// transformers' sections when a Qwen3-VL file gives none (`Qwen3VLTextRotaryEmbedding`).
const DEFAULT_MROPE_SECTION: [usize; 3] = [24, 20, 20];

/// The pipeline's system prompt.
pub const SYSTEM_PROMPT: &str = "Comprehend and analyze the provided prompt.";

/// The system turn, whose rows are dropped from the features.
pub fn system_turn() -> String {
    format!("<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")
}

/// The text the tokenizer reads for `prompt` (text-to-image template).
pub fn template(prompt: &str) -> String {
    let prompt = if prompt.is_empty() { " " } else { prompt };
    format!(
        "{}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
        system_turn()
    )
}

/// A prompt's tokens and how many of them (the system turn) the features leave out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptIds {
    pub ids: Vec<u32>,
    pub drop: usize,
}

impl PromptIds {
    /// Rows of features the prompt gives the DiT.
    pub fn rows(&self) -> usize {
        self.ids.len() - self.drop
    }
}

/// Tokenise `prompt` as the pipeline does.
pub fn prompt_ids(tok: &BpeTokenizer, prompt: &str) -> Result<PromptIds> {
    let ids = tok.encode(&template(prompt))?;
    let drop = tok.encode(&system_turn())?.len();
    if ids.len() <= drop || ids[..drop] != tok.encode(&system_turn())?[..] {
        return Err(Error::input(
            "the tokenizer splits the prompt template's system turn differently from the turn alone; is this Qwen-Image's tokenizer?",
        ));
    }
    Ok(PromptIds { ids, drop })
}

/// The text encoder's language model, under its checkpoint prefix.
fn language_model_root(w: &Weights) -> Result<Weights> {
    for p in ["model.language_model", "language_model.model", "model"] {
        if w.contains(&format!("{p}.embed_tokens.weight")) {
            return Ok(w.pp(p));
        }
    }
    Err(Error::MissingTensor {
        name: "model.language_model.embed_tokens.weight".into(),
        location: "the text encoder checkpoint: is this Qwen3-VL?".into(),
    })
}

/// Qwen3-VL's language model, run over every layer (features before the final norm).
pub struct TextEncoder<B: Backend> {
    model: Qwen3TextModel<B>,
}

impl<B: Backend> TextEncoder<B> {
    pub fn load(be: &B, cfg: &Qwen3Config, weights: &Weights) -> Result<Self> {
        let root = language_model_root(weights)?;
        Ok(TextEncoder {
            model: Qwen3TextModel::load(be, cfg, &root, cfg.num_layers)?,
        })
    }

    pub fn config(&self) -> &Qwen3Config {
        self.model.config()
    }

    /// The features of each prompt, `[rows, hidden]` each, system rows dropped.
    pub fn features(&mut self, be: &B, prompts: &[PromptIds]) -> Result<Vec<Vec<f32>>> {
        let seqs: Vec<&[u32]> = prompts.iter().map(|p| p.ids.as_slice()).collect();
        let hidden = self.model.forward(be, &seqs)?;
        let mut out = Vec::with_capacity(prompts.len());
        let mut off = 0;
        for p in prompts {
            out.push(be.read_f32(hidden.rows(off + p.drop, p.rows()))?);
            off += p.ids.len();
        }
        Ok(out)
    }

    /// The features of one prompt with condition images, `[rows, hidden]`, system rows dropped:
    /// `images` are the vision tower's outputs for the prompt's images, in order.
    pub fn features_with_images(
        &mut self,
        be: &B,
        prompt: &EditPrompt,
        images: &VisionFeatures<'_, B>,
    ) -> Result<Vec<f32>> {
        let cfg = self.model.config();
        let sections = match cfg.mrope_section.as_deref() {
            None => DEFAULT_MROPE_SECTION,
            Some(&[t, h, w]) => [t, h, w],
            Some(other) => {
                return Err(Error::input(format!(
                    "the text encoder's mrope_section {other:?} does not have the three axes images need"
                )));
            }
        };
        let inv = inv_freq(cfg.rope_theta, cfg.head_dim);
        let n = prompt.ids.ids.len();
        let angles = mrope_interleaved_angles(&inv, sections, &prompt.positions());
        let rope = RopeTable::from_angles(be, &angles, n, inv.len(), RopeStyle::SplitHalf)?;
        let rows: Vec<u32> = prompt
            .images
            .iter()
            .flat_map(|s| (s.start..s.start + s.tokens()).map(|r| r as u32))
            .collect();
        let media = Media {
            rows: &rows,
            embeds: images.merged,
            deepstack: &images.deepstack,
            rope: &rope,
        };
        let hidden = self.model.forward_with_media(be, &prompt.ids.ids, &media)?;
        be.read_f32(hidden.rows(prompt.ids.drop, prompt.ids.rows()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_prompt_is_a_space() {
        assert!(template("").contains("<|im_start|>user\n <|im_end|>"));
        assert!(template("a fox").starts_with(&system_turn()));
    }
}
