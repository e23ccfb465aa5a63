//! The edit prompt's tokens: the pipeline's image template with each image's pad run, and the
//! multimodal RoPE positions Qwen3-VL gives them (diffusers 0.42.1 `_get_qwen_prompt_embeds`,
//! transformers 5.25.0 `Qwen3VLProcessor` and `Qwen3VLModel.get_rope_index`).
//!
//! The template puts `<image1><|vision_start|><|image_pad|><|vision_end|>` before the prompt and
//! ` <imageN><|vision_start|><|image_pad|><|vision_end|>` for each further image (`<imageN>` is
//! plain text). The processor then repeats each `<|image_pad|>` `grid_h·grid_w / merge²` times.
//! Positions: a text run continues from the position after what precedes it on all three axes;
//! an image's tokens take `(p, p + row, p + column)` over its merged grid, `p` the position where
//! it starts, and the text after it continues at `p + max(rows, columns)`.

use tessera_core::{Error, Result};

use super::processor::VisionImage;
use crate::qwen_image::text::{PromptIds, SYSTEM_PROMPT, system_turn};
use crate::qwen3::BpeTokenizer;

/// The placeholder each image's tokens replace.
pub const IMAGE_PAD: &str = "<|image_pad|>";

/// Most condition images a prompt takes (the pipeline's limit).
pub const MAX_IMAGES: usize = 10;

/// The text the processor receives for `prompt` with `images` condition images, before it
/// expands the pads (the pipeline's `prompt_template_ti2i` with its images' markers).
pub fn edit_template(prompt: &str, images: usize) -> String {
    let prompt = if prompt.is_empty() { " " } else { prompt };
    let mut markers = String::new();
    for i in 1..=images {
        if i > 1 {
            markers.push(' ');
        }
        markers.push_str(&format!(
            "<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>"
        ));
    }
    debug_assert!(system_turn().contains(SYSTEM_PROMPT));
    format!(
        "{}<|im_start|>user\n{markers}{prompt}<|im_end|>\n<|im_start|>assistant\n",
        system_turn()
    )
}

/// Where one image's tokens sit in the prompt and the merged grid they cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSpan {
    /// Index of its first pad token in the prompt's ids.
    pub start: usize,
    /// Merged grid rows and columns (`grid_h / merge`, `grid_w / merge`).
    pub rows: usize,
    pub cols: usize,
}

impl ImageSpan {
    pub fn tokens(&self) -> usize {
        self.rows * self.cols
    }
}

/// A prompt with condition images: its ids (system rows to drop included) and each image's span.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EditPrompt {
    pub ids: PromptIds,
    pub images: Vec<ImageSpan>,
}

impl EditPrompt {
    /// Tokenise `prompt` with `images` (already processed) as the pipeline and processor do.
    pub fn new(
        tok: &BpeTokenizer,
        prompt: &str,
        images: &[VisionImage],
        merge: usize,
    ) -> Result<Self> {
        if images.is_empty() || images.len() > MAX_IMAGES {
            return Err(Error::input(format!(
                "{} condition images: an edit takes 1 to {MAX_IMAGES}",
                images.len()
            )));
        }
        if prompt.contains(IMAGE_PAD) {
            return Err(Error::input(format!(
                "the prompt contains {IMAGE_PAD}, which only the images' tokens may use"
            )));
        }
        let pad = tok.token_to_id(IMAGE_PAD).ok_or_else(|| {
            Error::input(format!(
                "the tokenizer has no {IMAGE_PAD} token: is this Qwen-Image's tokenizer?"
            ))
        })?;
        let template = edit_template(prompt, images.len());
        let mut text = String::with_capacity(template.len());
        let mut parts = template.split(IMAGE_PAD);
        text.push_str(parts.next().unwrap_or_default());
        for (img, part) in images.iter().zip(parts) {
            if !img.grid_h.is_multiple_of(merge) || !img.grid_w.is_multiple_of(merge) {
                return Err(Error::input(format!(
                    "a {}×{} patch grid is not whole {merge}×{merge} blocks",
                    img.grid_w, img.grid_h
                )));
            }
            text.push_str(&IMAGE_PAD.repeat(img.tokens(merge)));
            text.push_str(part);
        }
        let ids = tok.encode(&text)?;
        let turn = tok.encode(&system_turn())?;
        let drop = turn.len();
        if ids.len() <= drop || ids[..drop] != turn[..] {
            return Err(Error::input(
                "the tokenizer splits the edit template's system turn differently from the turn alone; is this Qwen-Image's tokenizer?",
            ));
        }
        // Each image's pads are one run, in order.
        let mut spans = Vec::with_capacity(images.len());
        let mut at = 0;
        for img in images {
            let start = ids[at..]
                .iter()
                .position(|&t| t == pad)
                .map(|i| at + i)
                .ok_or_else(|| Error::input("an image's pad tokens are missing"))?;
            let n = img.tokens(merge);
            if ids
                .get(start..start + n)
                .is_none_or(|r| r.iter().any(|&t| t != pad))
            {
                return Err(Error::input("an image's pad tokens are not one run"));
            }
            spans.push(ImageSpan {
                start,
                rows: img.grid_h / merge,
                cols: img.grid_w / merge,
            });
            at = start + n;
        }
        if ids[at..].contains(&pad) {
            return Err(Error::input("more pad tokens than the images take"));
        }
        Ok(EditPrompt {
            ids: PromptIds { ids, drop },
            images: spans,
        })
    }

    /// Multimodal RoPE positions `[temporal, height, width]`, one per token each (module docs).
    pub fn positions(&self) -> [Vec<u32>; 3] {
        mrope_positions(self.ids.ids.len(), &self.images)
    }
}

/// [`EditPrompt::positions`] for `len` tokens with images at `spans` (in order, not overlapping).
pub fn mrope_positions(len: usize, spans: &[ImageSpan]) -> [Vec<u32>; 3] {
    let mut out: [Vec<u32>; 3] = std::array::from_fn(|_| Vec::with_capacity(len));
    let (mut i, mut next) = (0usize, 0u32);
    let text_until = |out: &mut [Vec<u32>; 3], i: &mut usize, next: &mut u32, end: usize| {
        for _ in *i..end {
            for axis in out.iter_mut() {
                axis.push(*next);
            }
            *next += 1;
        }
        *i = end;
    };
    for s in spans {
        text_until(&mut out, &mut i, &mut next, s.start);
        for r in 0..s.rows {
            for c in 0..s.cols {
                out[0].push(next);
                out[1].push(next + r as u32);
                out[2].push(next + c as u32);
            }
        }
        i = s.start + s.tokens();
        next += s.rows.max(s.cols) as u32;
    }
    text_until(&mut out, &mut i, &mut next, len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn further_images_are_marked_after_a_space() {
        let t = edit_template("", 2);
        assert!(t.contains(
            "user\n<image1><|vision_start|><|image_pad|><|vision_end|> <image2><|vision_start|><|image_pad|><|vision_end|> <|im_end|>"
        ));
    }

    #[test]
    fn text_after_an_image_continues_past_its_longer_side() {
        let spans = [ImageSpan {
            start: 2,
            rows: 1,
            cols: 3,
        }];
        let [t, h, w] = mrope_positions(6, &spans);
        assert_eq!(t, [0, 1, 2, 2, 2, 5]);
        assert_eq!(h, [0, 1, 2, 2, 2, 5]);
        assert_eq!(w, [0, 1, 2, 3, 4, 5]);
    }
}
