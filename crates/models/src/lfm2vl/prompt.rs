//! Prompts as `Lfm2VlProcessor` builds them: the conversation rendered with the model's chat
//! template, each `<image>` it writes replaced by that image's placeholder text (markers and one
//! `<image>` token per image token; transformers 5.25 takes `use_image_special_tokens` only as a
//! call argument and ignores it in `processor_config.json`, so the markers are always on), then
//! tokenised without special tokens added (the template
//! writes BOS itself).

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::config::Lfm2VlConfig;
use super::processor::{ImageProcessor, ProcessedImage};
use super::vision::TilePatches;
use crate::ModelFiles;
use crate::chat_template::{ChatTemplate, Message};
use crate::generation::SamplingDefaults;
use crate::imageproc::Image;
use crate::tokenize::TextTokenizer;
use crate::tokenize_pieces::PieceTokenizer;

/// The placeholder an image content item renders as.
const IMAGE: &str = "<image>";

/// A prompt ready for the model.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub ids: Vec<u32>,
    /// The rendered conversation, before the images' placeholders were expanded.
    pub text: String,
    pub images: Vec<ProcessedImage>,
    /// Each image's token range `[start, end)` in `ids`, markers included.
    pub spans: Vec<(usize, usize)>,
}

impl Prompt {
    /// The index of the first image that starts at or after token `n`, when no image straddles
    /// `n` (a cache holding the first `n` tokens then holds whole images only).
    pub fn first_image_after(&self, n: usize) -> Option<usize> {
        if self.spans.iter().any(|&(a, b)| a < n && n < b) {
            return None;
        }
        Some(self.spans.iter().filter(|&&(_, b)| b <= n).count())
    }

    /// The tiles of images `from..`, in order, as the tower takes them.
    pub fn tiles(&self, from: usize) -> Vec<TilePatches<'_>> {
        self.images
            .iter()
            .skip(from)
            .flat_map(ProcessedImage::patches)
            .collect()
    }
}

/// The tokenizer, chat template and image processor of a checkpoint.
pub struct Prompter {
    tokenizer: TextTokenizer,
    template: ChatTemplate,
    processor: ImageProcessor,
    image_token: u32,
    /// The rendered conversation's text and each image's placeholder tokenised between their
    /// added tokens, the pieces kept: a follow-up turn tokenises only its new messages, and a
    /// placeholder (markers and `<image>` tokens only) takes no tokenising at all (~1 µs a
    /// token: 0.26 ms of a 512² image's prompt, 1.1 ms of a tiled 1024×768 one).
    pieces: PieceTokenizer,
    defaults: SamplingDefaults,
}

impl Prompter {
    pub fn load(files: &ModelFiles, cfg: &Lfm2VlConfig) -> Result<Self> {
        let tokenizer = TextTokenizer::load(files, (cfg.text.bos, cfg.text.eos.first().copied()))?;
        let template = ChatTemplate::load(files)?.ok_or_else(|| Error::MissingFile {
            path: files.path("chat_template.jinja"),
            hint:
                " (nor a chat_template in tokenizer_config.json): LFM2-VL needs its chat template"
                    .into(),
        })?;
        let image_token = tokenizer
            .token_to_id(IMAGE)
            .ok_or_else(|| Error::Tokenizer {
                path: tokenizer.path().to_path_buf(),
                message: format!("the image token {IMAGE:?} is not in the vocabulary"),
            })?;
        if image_token != cfg.image_token {
            return Err(Error::Tokenizer {
                path: tokenizer.path().to_path_buf(),
                message: format!(
                    "{IMAGE:?} is token {image_token}, but config.json says image_token_id {}",
                    cfg.image_token
                ),
            });
        }
        Ok(Prompter {
            pieces: PieceTokenizer::new(&tokenizer),
            tokenizer,
            template,
            processor: ImageProcessor::load(files)?,
            image_token,
            defaults: SamplingDefaults::load(files)?,
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn processor(&self) -> &ImageProcessor {
        &self.processor
    }

    /// What `generation_config.json` asks for.
    pub fn generation_defaults(&self) -> SamplingDefaults {
        self.defaults
    }

    /// Refuse `messages` whose text could not fit `context` tokens, judged from its length in
    /// characters before anything is rendered or tokenised (tokenising costs about 190 bytes
    /// of memory per character; a 16 MiB message took 3 GB to be refused by its token count).
    pub fn check_length(&self, messages: &[Message], context: usize) -> Result<()> {
        let chars: usize = messages.iter().map(Message::text_chars).sum();
        let max = self.max_text_chars(context);
        if chars > max {
            return Err(Error::input(format!(
                "the messages hold {chars} characters of text; a context of {context} tokens holds at most {max} (the longest token of {} is {} characters)",
                self.tokenizer.path().display(),
                self.tokenizer.longest_token_chars()
            )));
        }
        Ok(())
    }

    /// The most characters of text that can fit `context` tokens.
    pub fn max_text_chars(&self, context: usize) -> usize {
        self.tokenizer.max_chars_for(context)
    }

    /// The prompt for `messages`, whose image parts are `images` in order.
    pub fn build(
        &self,
        messages: &[Message],
        images: &[Image],
        add_generation_prompt: bool,
    ) -> Result<Prompt> {
        let parts: usize = messages.iter().map(Message::images).sum();
        if parts != images.len() {
            return Err(Error::input(format!(
                "the messages have {parts} image parts but {} images were given",
                images.len()
            )));
        }
        let text = self.template.render(messages, add_generation_prompt, &[])?;
        let pieces: Vec<&str> = text.split(IMAGE).collect();
        if pieces.len() - 1 != images.len() {
            return Err(Error::input(format!(
                "the chat template wrote {} {IMAGE} placeholders for {} images",
                pieces.len() - 1,
                images.len()
            )));
        }
        let processed = images
            .par_iter()
            .enumerate()
            .map(|(i, im)| {
                self.processor
                    .process(im)
                    .map_err(|e| Error::input(format!("image {}: {e}", i + 1)))
            })
            .collect::<Result<Vec<_>>>()?;
        // Tokenise piece by piece so that each image's span is known; the special markers are
        // whole tokens, so the pieces tokenise as the whole text does.
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(images.len());
        for (i, piece) in pieces.iter().enumerate() {
            ids.extend(self.pieces.encode(&self.tokenizer, piece)?);
            if let Some(im) = processed.get(i) {
                let start = ids.len();
                ids.extend(
                    self.pieces
                        .encode(&self.tokenizer, &im.placeholder_text())?,
                );
                spans.push((start, ids.len()));
            }
        }
        for (im, &(a, b)) in processed.iter().zip(&spans) {
            let n = ids[a..b].iter().filter(|&&t| t == self.image_token).count();
            if n != im.tokens() {
                return Err(Error::backend(
                    "prompt",
                    format!(
                        "an image of {} tokens tokenised to {n} image tokens",
                        im.tokens()
                    ),
                ));
            }
        }
        Ok(Prompt {
            ids,
            text,
            images: processed,
            spans,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lfm2vl::BUNDLED;

    #[test]
    fn placeholders_cut_at_their_markers_are_the_tokenizers_ids() {
        let p = Prompter::load(&BUNDLED, &Lfm2VlConfig::read(&BUNDLED).unwrap()).unwrap();
        assert!(
            p.pieces.cuts(),
            "the bundled tokenizer's markers are whole added tokens"
        );
        // One image, a grid with its thumbnail, a wide grid: every kind of piece.
        let mut grids = 0;
        for (w, h) in [(64, 64), (300, 200), (600, 300), (900, 260)] {
            let rgb = (0..w * h * 3).map(|i| (i % 251) as u8).collect();
            let im = p
                .processor()
                .process(&Image::from_rgb8(w, h, rgb).unwrap())
                .unwrap();
            grids += usize::from(im.grid.is_some_and(|(r, c)| r * c > 1));
            let text = im.placeholder_text();
            let slow = p.tokenizer().encode_plain(&text).unwrap();
            assert_eq!(
                p.pieces.encode(&p.tokenizer, &text).unwrap(),
                slow,
                "{w}×{h}"
            );
            assert_eq!(
                slow.iter().filter(|&&t| t == p.image_token).count(),
                im.tokens()
            );
        }
        assert!(grids >= 2, "the sizes cover tiled images");
    }
}
