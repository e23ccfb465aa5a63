//! LFM2-VL as a [`ChatFamily`]: prompts through its processor and template, images as prefill
//! content (encoded by the tower in the step that prefills their tokens), and a forward over
//! the language model's cache slots, whose convolution states are kept where asked.

use std::sync::Arc;

use tessera_backend::{Backend, NAN_ROW, Role};
use tessera_core::{Error, Result};

use super::config::Lfm2VlConfig;
use super::model::{Lfm2Vl, SlotTurn};
use super::processor::{IMAGE_TOKEN, ProcessedImage};
use super::prompt::{Prompt, Prompter};
use super::text::CacheShape;
use super::vision::TilePatches;
use crate::ModelFiles;
use crate::chat_family::{ChatFamily, ChatPrompt, ChatPrompter, Chunk, Media, nan_logit};
use crate::chat_template::Message;
use crate::generation::SamplingDefaults;
use crate::imageproc::Image;

impl Prompt {
    /// The prompt as the scheduler takes it: each image with its span and a digest of what the
    /// tower will see (its tiles' sizes and patch bytes).
    pub fn into_chat(self) -> ChatPrompt {
        let media = self
            .images
            .into_iter()
            .zip(&self.spans)
            .map(|(im, &(start, end))| Media {
                start,
                end,
                digest: image_digest(&im),
                bytes: im.tiles.iter().map(|t| t.patches.len() as u64).sum(),
                input: Arc::new(im),
            })
            .collect();
        ChatPrompt {
            ids: self.ids,
            text: self.text,
            media,
        }
    }
}

/// BLAKE3 of the tiles' shapes and patch bytes: the prefix cache's key for the image. It runs on
/// every prompt with an image, before its first token (a 512² tile is 768 KiB; SHA-256 took
/// ~0.7 ms of it on the build machine). One thread: spread over a 16-thread pool
/// (`update_rayon`), waking the workers cost more than the hash and doubled a 512² prompt's
/// preprocessing on the GPU machine (1.34 → 2.71 ms, run g27).
fn image_digest(im: &ProcessedImage) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for t in &im.tiles {
        for v in [t.grid_w, t.grid_h, t.tokens, t.patches.len()] {
            h.update(&(v as u64).to_le_bytes());
        }
        h.update(&t.patches);
    }
    h.finalize().into()
}

impl ChatPrompter for Prompter {
    fn check_length(&self, messages: &[Message], context: usize) -> Result<()> {
        Prompter::check_length(self, messages, context)
    }
    fn max_text_chars(&self, context: usize) -> usize {
        Prompter::max_text_chars(self, context)
    }
    fn image_peak_bytes(&self, width: usize, height: usize) -> Result<u64> {
        Ok(self.processor().plan(width, height)?.peak_bytes)
    }
    fn reserved_text(&self) -> &[&'static str] {
        &[IMAGE_TOKEN]
    }
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<ChatPrompt> {
        Ok(self.build(messages, images, true)?.into_chat())
    }
    fn sampling(&self) -> SamplingDefaults {
        self.generation_defaults()
    }
    fn detokenize(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer().decode(ids, true)
    }
}

/// LFM2-VL on its device with its prompt builder.
pub struct Lfm2VlChat<B: Backend> {
    be: B,
    model: Lfm2Vl<B>,
    prompter: Arc<Prompter>,
    eos: Vec<u32>,
    /// Greedy tokens, one a slot ([`ChatFamily::forward_greedy`]).
    greedy: B::Buf,
}

impl<B: Backend> Lfm2VlChat<B> {
    /// Load from `files` with a cache of `cache` (its context capped at the model's positions)
    /// and room for `places` kept states.
    pub fn load(
        be: B,
        files: &ModelFiles,
        cfg: &Lfm2VlConfig,
        cache: CacheShape,
        places: usize,
    ) -> Result<Self> {
        let ctx = cache.ctx.min(cfg.text.max_positions);
        let cache = CacheShape { ctx, ..cache };
        let prompter = Prompter::load(files, cfg)?;
        let mut eos = cfg.text.eos.clone();
        eos.push(prompter.tokenizer().eos_id);
        eos.sort_unstable();
        eos.dedup();
        let mut model = Lfm2Vl::load(&be, files, cfg, cache)?;
        model.text.keep_states(&be, places)?;
        let greedy = be.alloc(cache.slots.max(1), Role::Index)?;
        Ok(Lfm2VlChat {
            be,
            model,
            prompter: Arc::new(prompter),
            eos,
            greedy,
        })
    }

    fn ctx(&self) -> usize {
        self.model.text.cache_shape().ctx
    }
}

/// Each chunk's image tiles, as the vision tower takes them.
fn tiles_of<'a>(chunks: &[Chunk<'a>]) -> Result<Vec<Vec<TilePatches<'a>>>> {
    chunks.iter().map(|c| media_tiles(c.media)).collect()
}

/// The tiles of `media`'s images, in order, as the vision tower takes them.
fn media_tiles(media: &[Media]) -> Result<Vec<TilePatches<'_>>> {
    media
        .iter()
        .map(|m| {
            m.input
                .downcast_ref::<ProcessedImage>()
                .ok_or_else(|| Error::backend("lfm2vl", "media that is not an image"))
        })
        .collect::<Result<Vec<_>>>()
        .map(|ims| ims.into_iter().flat_map(ProcessedImage::patches).collect())
}

/// The model's turns of `chunks`, with their `tiles`.
fn turns_of<'a>(chunks: &[Chunk<'a>], tiles: &'a [Vec<TilePatches<'a>>]) -> Vec<SlotTurn<'a>> {
    chunks
        .iter()
        .zip(tiles)
        .map(|(c, tiles)| SlotTurn {
            slot: c.slot,
            held: c.held,
            tokens: c.tokens,
            tiles,
            keep: c.keep,
        })
        .collect()
}

impl<B: Backend> ChatFamily for Lfm2VlChat<B> {
    fn describe(&self) -> String {
        self.be.describe()
    }
    fn slots(&self) -> usize {
        self.model.text.cache_shape().slots
    }
    fn context_len(&self) -> usize {
        self.ctx()
    }
    fn end_tokens(&self) -> &[u32] {
        &self.eos
    }
    fn prompter(&self) -> Arc<dyn ChatPrompter> {
        self.prompter.clone()
    }

    fn snapshot_places(&self) -> usize {
        self.model.text.kept_places()
    }

    fn keep_window(&self) -> usize {
        self.model.text.keep_window()
    }

    fn forward(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<f32>> {
        let tiles = tiles_of(chunks)?;
        let logits = self
            .model
            .extend_slots(&self.be, &turns_of(chunks, &tiles))?;
        self.be.read_f32(logits)
    }

    /// The tokens picked on the device: one `u32` a chunk comes back, and a row flagged NaN is
    /// read to name its token.
    fn forward_greedy(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<Result<u32>>> {
        let tiles = tiles_of(chunks)?;
        let logits = self
            .model
            .extend_slots(&self.be, &turns_of(chunks, &tiles))?;
        self.be.argmax_rows(logits, &mut self.greedy)?;
        self.be
            .read_u32(&self.greedy, logits.rows)?
            .into_iter()
            .enumerate()
            .map(|(i, t)| match t {
                NAN_ROW => Ok(Err(nan_logit(&self.be.read_f32(logits.rows(i, 1))?))),
                t => Ok(Ok(t)),
            })
            .collect()
    }

    fn restore(&mut self, slot: usize, place: usize) -> Result<()> {
        self.model.text.restore(&self.be, slot, place)
    }

    fn copy_prefix(&mut self, from: usize, to: usize, n: usize) -> Result<()> {
        self.model.text.copy_prefix(&self.be, from, to, n)
    }

    fn encode_media(&mut self, media: &[Media]) -> Result<()> {
        let tiles = media_tiles(media)?;
        self.model.encode_images(&self.be, &tiles)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lfm2vl::processor::Tile;

    fn image(tiles: &[(usize, usize, Vec<u8>)]) -> ProcessedImage {
        ProcessedImage {
            tiles: tiles
                .iter()
                .map(|(gw, gh, patches)| Tile {
                    width: gw * 16,
                    height: gh * 16,
                    grid_w: *gw,
                    grid_h: *gh,
                    tokens: gw * gh / 4,
                    patches: patches.clone(),
                })
                .collect(),
            grid: None,
            thumbnail: false,
            resized: (0, 0),
        }
    }

    #[test]
    fn image_digests_tell_apart_bytes_and_shapes() {
        for len in [1 << 16, 3 << 18] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let base = image_digest(&image(&[(32, 32, bytes.clone())]));
            assert_eq!(base, image_digest(&image(&[(32, 32, bytes.clone())])));
            // The shapes, then the bytes.
            let mut one = blake3::Hasher::new();
            for v in [32u64, 32, 256, len as u64] {
                one.update(&v.to_le_bytes());
            }
            let want: [u8; 32] = one.update(&bytes).finalize().into();
            assert_eq!(base, want, "{len} bytes");
            for at in [0, len / 2, len - 1] {
                let mut other = bytes.clone();
                other[at] ^= 1;
                assert_ne!(base, image_digest(&image(&[(32, 32, other)])), "byte {at}");
            }
            // The same bytes cut into another grid are another image.
            assert_ne!(base, image_digest(&image(&[(16, 64, bytes.clone())])));
            // Bytes moved from one tile into the next are another image too.
            let (a, b) = bytes.split_at(len / 2);
            let two = image(&[(32, 32, a.to_vec()), (32, 32, b.to_vec())]);
            assert_ne!(base, image_digest(&two));
        }
    }
}
