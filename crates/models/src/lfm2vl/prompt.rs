//! Prompts as `Lfm2VlProcessor` builds them: the conversation rendered with the model's chat
//! template, each `<image>` it writes replaced by that image's placeholder text (markers and one
//! `<image>` token per image token; transformers 5.25 takes `use_image_special_tokens` only as a
//! call argument and ignores it in `processor_config.json`, so the markers are always on), then
//! tokenised without special tokens added (the template
//! writes BOS itself).

use std::collections::HashMap;

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::config::Lfm2VlConfig;
use super::processor::{
    IMAGE_END, IMAGE_START, IMAGE_THUMBNAIL, ImageProcessor, PlaceholderPiece, ProcessedImage,
};
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
    /// The ids of the added tokens an image's placeholder is made of, when the tokenizer gives
    /// them one for one ([`markers_tokenise_whole`]): the placeholder's ids are then built
    /// without tokenising its text (~1 µs a token: 0.26 ms of a 512² image's prompt, 1.1 ms
    /// of a tiled 1024×768 one). `None`: tokenise the text.
    markers: Option<HashMap<String, u32>>,
    /// The rendered conversation's text tokenised between its added tokens, the pieces kept:
    /// a follow-up turn tokenises only its new messages.
    pieces: PieceTokenizer,
    defaults: SamplingDefaults,
}

/// The ids of `pieces` from `markers` (`<image>` among them), or `None` if one is missing.
fn placeholder_ids(
    pieces: &[PlaceholderPiece],
    markers: &HashMap<String, u32>,
) -> Option<Vec<u32>> {
    let image = *markers.get(IMAGE)?;
    let mut ids = Vec::new();
    for p in pieces {
        match p {
            PlaceholderPiece::Marker(m) => ids.push(*markers.get(m)?),
            PlaceholderPiece::Images(n) => ids.extend(std::iter::repeat_n(image, *n)),
        }
    }
    Some(ids)
}

/// Whether a placeholder built from `markers` gives the tokenizer's ids for its text: checked
/// once on a placeholder holding every kind of piece next to each other (a tokenizer with an
/// added token that joins two markers, or one that splits them otherwise, fails it).
fn markers_tokenise_whole(tokenizer: &TextTokenizer, markers: &HashMap<String, u32>) -> bool {
    use PlaceholderPiece::{Images, Marker};
    let probe: Vec<PlaceholderPiece> = [
        Marker(IMAGE_START.into()),
        Marker("<|img_row_1_col_1|>".into()),
        Images(2),
        Marker("<|img_row_1_col_2|>".into()),
        Images(1),
        Marker(IMAGE_THUMBNAIL.into()),
        Images(3),
        Marker(IMAGE_END.into()),
    ]
    .into_iter()
    .filter(|p| matches!(p, Images(_)) || matches!(p, Marker(m) if markers.contains_key(m)))
    .collect();
    let text: String = probe
        .iter()
        .map(|p| match p {
            Marker(m) => m.clone(),
            Images(n) => IMAGE.repeat(*n),
        })
        .collect();
    match (
        placeholder_ids(&probe, markers),
        tokenizer.encode_plain(&text),
    ) {
        (Some(fast), Ok(slow)) => fast == slow,
        _ => false,
    }
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
        let markers = Some(tokenizer.whole_added_tokens())
            .filter(|m| m.get(IMAGE) == Some(&image_token))
            .filter(|m| markers_tokenise_whole(&tokenizer, m));
        Ok(Prompter {
            pieces: PieceTokenizer::new(&tokenizer),
            tokenizer,
            template,
            processor: ImageProcessor::load(files)?,
            image_token,
            markers,
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

    /// The ids of `im`'s placeholder, as tokenising its text gives them.
    fn placeholder_ids(&self, im: &ProcessedImage) -> Result<Vec<u32>> {
        let fast = self
            .markers
            .as_ref()
            .and_then(|m| placeholder_ids(&im.placeholder_pieces(true), m));
        match fast {
            Some(ids) => Ok(ids),
            None => self.tokenizer.encode_plain(&im.placeholder_text()),
        }
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
                ids.extend(self.placeholder_ids(im)?);
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

    fn prompter() -> Prompter {
        Prompter::load(&BUNDLED, &Lfm2VlConfig::read(&BUNDLED).unwrap()).unwrap()
    }

    #[test]
    fn placeholders_built_from_marker_ids_are_the_tokenizers_ids() {
        let p = prompter();
        assert!(
            p.markers.is_some(),
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
            let slow = p.tokenizer().encode_plain(&im.placeholder_text()).unwrap();
            assert_eq!(p.placeholder_ids(&im).unwrap(), slow, "{w}×{h}");
            assert_eq!(
                slow.iter().filter(|&&t| t == p.image_token).count(),
                im.tokens()
            );
        }
        assert!(grids >= 2, "the sizes cover tiled images");
    }

    #[test]
    fn markers_that_do_not_tokenise_one_for_one_are_not_used() {
        let p = prompter();
        let mut wrong = p.markers.clone().unwrap();
        assert!(markers_tokenise_whole(&p.tokenizer, &wrong));
        // A marker whose id is not what the tokenizer gives for its text.
        *wrong.get_mut(IMAGE_END).unwrap() += 1;
        assert!(!markers_tokenise_whole(&p.tokenizer, &wrong));
        // A row marker given the id of another token.
        let mut row = p.markers.clone().unwrap();
        let image = row[IMAGE];
        row.insert("<|img_row_1_col_1|>".into(), image);
        assert!(!markers_tokenise_whole(&p.tokenizer, &row));
        // Without `<image>` among them, nothing is built from markers.
        let mut none = p.markers.clone().unwrap();
        none.remove(IMAGE);
        assert_eq!(placeholder_ids(&[PlaceholderPiece::Images(1)], &none), None);
    }
}
