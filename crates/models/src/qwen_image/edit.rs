//! Editing with Qwen-Image-2.1: condition images into the prefix of the joint sequence
//! (diffusers 0.42.1 `QwenImage21Pipeline.__call__` with `image=`, spec A6–A8).
//!
//! Each condition image is resized once ([`Condition`]); its RGBA copy goes through the VAE
//! encoder to normalised latent tokens, its copy over white through the Qwen3-VL processor and
//! vision tower into the text encoder's prompt (the edit template's pad tokens). The DiT's
//! sequence is then the prompt's feature rows with each image's pad run replaced by that
//! image's latent block: a pad token stands for 2×2 latent tokens (32×32 pixels), so the block
//! of an `H × W` image is `H/16 × W/16` rows where its `H/32 · W/32` pads were. The text rows
//! keep their order; positions and the block-causal mask follow [`Layout`]. The prefix (text
//! and condition blocks, modulated at `t = 0`) is computed once per prompt branch and every
//! step runs the target rows only, as for text-to-image.
//!
//! What the reference showed beyond the spec: the processor must leave each condition copy at
//! its size (the pipeline passes the copy at a multiple of 32, and the transformer refuses pad
//! runs that do not match the VAE's blocks), so a copy outside the processor's pixel range
//! (`min_pixels`, `max_pixels`: an output resolution above 1024 for the release) cannot be
//! edited with; it is refused here before any compute. The negative prompt of true CFG is
//! encoded with the same images.

use tessera_backend::op::{AttentionOp, MaskKind};
use tessera_backend::{Backend, Op};
use tessera_core::{Error, Result, Weights};

use super::QwenImageFiles;
use super::condition::Condition;
use super::layout::{Layout, Part};
use super::pipeline::QwenImageConfigs;
use super::vae::VaeConfig;
use super::vae_encoder::{self, VaeEncoder};
use super::vision::{
    self, EditPrompt, ImageProcessorConfig, VisionConfig, VisionImage, VisionTower,
};
use crate::qwen3::BpeTokenizer;
use crate::text_to_image::{Edit, MAX_EDIT_IMAGES};

/// The smallest and largest `output_resolution` an edit takes: a condition copy needs a whole
/// 32-pixel block, and the processor's pixel range ends near 1024² for the release.
pub const MIN_RESOLUTION: usize = 32;
pub const MAX_RESOLUTION: usize = 4096;

/// The ops an edit calls beyond text-to-image's ([`super::ops`]): the vision tower, the VAE
/// encoder, the tower's rows written over the prompt's pad tokens, and the prefix's
/// block-causal self-attention (per-row key limits).
pub fn ops(cfg: &QwenImageConfigs, vision: &VisionConfig) -> Vec<Op> {
    let mut ops = vision::ops(vision);
    ops.push(Op::ScatterRows);
    ops.extend(vae_encoder::ops(&cfg.vae));
    ops.push(Op::Attention(AttentionOp {
        head_dim: cfg.transformer.head_dim,
        mask: MaskKind::Limits,
        cached: false,
    }));
    ops.dedup();
    ops
}

/// The vision tower's settings in the text encoder's config, if it has any.
pub fn vision_config(files: &QwenImageFiles) -> Result<VisionConfig> {
    let f = &files.text_encoder;
    VisionConfig::parse(&f.path("config.json"), &f.read("config.json")?)
}

/// The device parts editing adds to a loaded model: the vision tower and the VAE encoder (the
/// image processor's settings stay with the pipeline, which plans edits without them).
pub struct Editor<B: Backend> {
    pub tower: VisionTower<B>,
    pub encoder: VaeEncoder<B>,
}

impl<B: Backend> Editor<B> {
    /// The tower from the text encoder's checkpoint, the encoder from the VAE's.
    pub fn load(
        be: &B,
        vision: &VisionConfig,
        vae: &VaeConfig,
        text_encoder: &Weights,
        vae_weights: &Weights,
    ) -> Result<Self> {
        Ok(Editor {
            tower: VisionTower::load(be, vision, text_encoder)?,
            encoder: VaeEncoder::load(be, vae, vae_weights)?,
        })
    }
}

/// A checked edit: the condition images prepared on the host and each prompt branch's tokens
/// and sequence.
#[derive(Clone, Debug)]
pub struct EditPlan {
    pub conditions: Vec<Condition>,
    /// The processor's rows of each condition's copy over white.
    pub vision: Vec<VisionImage>,
    /// Each prompt branch (the prompt, then the negative prompt under true CFG).
    pub prompts: Vec<EditPrompt>,
    pub layouts: Vec<Layout>,
}

impl EditPlan {
    /// Prepare `edit`'s images and tokenise `prompts` with them for an `target` (h, w) latent
    /// target; `scale` is the VAE's.
    pub fn new(
        edit: &Edit,
        prompts: &[&str],
        tok: &BpeTokenizer,
        processor: &ImageProcessorConfig,
        scale: usize,
        target: (usize, usize),
    ) -> Result<Self> {
        let n = edit.images.len();
        if n == 0 || n > MAX_EDIT_IMAGES {
            return Err(Error::input(format!(
                "{n} condition images: an edit takes 1 to {MAX_EDIT_IMAGES}"
            )));
        }
        let res = edit.output_resolution;
        if !(MIN_RESOLUTION..=MAX_RESOLUTION).contains(&res) {
            return Err(Error::input(format!(
                "output resolution {res}: use {MIN_RESOLUTION} to {MAX_RESOLUTION} pixels"
            )));
        }
        let mut conditions = Vec::with_capacity(n);
        let mut vision = Vec::with_capacity(n);
        for (i, img) in edit.images.iter().enumerate() {
            let c = Condition::prepare(img, res)
                .map_err(|e| Error::input(format!("condition image {}: {e}", i + 1)))?;
            let (w, h) = (c.width(), c.height());
            let fits = processor.target_size(w, h).ok() == Some((w, h));
            if !fits || !w.is_multiple_of(2 * scale) || !h.is_multiple_of(2 * scale) {
                return Err(Error::input(format!(
                    "condition image {}: its {w}×{h} copy (output resolution {res}) is outside \
                     the text encoder's image range of {} to {} pixels; use a smaller output \
                     resolution",
                    i + 1,
                    processor.min_pixels,
                    processor.max_pixels
                )));
            }
            vision.push(processor.preprocess(&c.vl_image()?)?);
            conditions.push(c);
        }
        let blocks: Vec<(usize, usize)> = conditions
            .iter()
            .map(|c| (c.height() / scale, c.width() / scale))
            .collect();
        let mut eps = Vec::with_capacity(prompts.len());
        let mut layouts = Vec::with_capacity(prompts.len());
        for p in prompts {
            let ep = EditPrompt::new(tok, p, &vision, processor.merge)?;
            layouts.push(layout(&ep, &blocks, target)?);
            eps.push(ep);
        }
        Ok(EditPlan {
            conditions,
            vision,
            prompts: eps,
            layouts,
        })
    }
}

/// The DiT's sequence for `prompt`: its feature rows (system rows dropped), each image's pad
/// run replaced by that image's `(h, w)` latent block, then the target.
pub fn layout(
    prompt: &EditPrompt,
    blocks: &[(usize, usize)],
    target: (usize, usize),
) -> Result<Layout> {
    if prompt.images.len() != blocks.len() {
        return Err(Error::input(format!(
            "{} images in the prompt, {} condition latents",
            prompt.images.len(),
            blocks.len()
        )));
    }
    let drop = prompt.ids.drop;
    let mut parts = Vec::with_capacity(2 * blocks.len() + 2);
    let mut at = 0;
    for (s, &(h, w)) in prompt.images.iter().zip(blocks) {
        let start = s
            .start
            .checked_sub(drop)
            .ok_or_else(|| Error::input("an image sits in the system turn"))?;
        if s.tokens() * 4 != h * w || s.rows * 2 != h || s.cols * 2 != w {
            return Err(Error::input(format!(
                "an image's {}×{} pad tokens do not cover its {h}×{w} latent block",
                s.rows, s.cols
            )));
        }
        if start > at {
            parts.push(Part::Text(start - at));
        }
        parts.push(Part::Image { h, w });
        at = start + s.tokens();
    }
    let rows = prompt.ids.rows();
    if rows > at {
        parts.push(Part::Text(rows - at));
    }
    parts.push(Part::Image {
        h: target.0,
        w: target.1,
    });
    Layout::new(parts)
}

/// The text rows of `features` (`[rows, hidden]`, the prompt's rows after the system turn):
/// every row but the images' pad tokens, in order.
pub fn text_rows(prompt: &EditPrompt, features: &[f32], hidden: usize) -> Vec<f32> {
    let drop = prompt.ids.drop;
    let mut pad = vec![false; prompt.ids.rows()];
    for s in &prompt.images {
        let start = s.start.saturating_sub(drop).min(pad.len());
        let end = (start + s.tokens()).min(pad.len());
        pad[start..end].fill(true);
    }
    features
        .chunks_exact(hidden)
        .zip(&pad)
        .filter(|(_, p)| !**p)
        .flat_map(|(r, _)| r.iter().copied())
        .collect()
}
