//! The whole LFM2-VL model: images through the encoder, their tokens into the language model.

use tessera_backend::{Backend, View};
use tessera_core::Result;

use super::config::Lfm2VlConfig;
use super::processor::ImageProcessor;
use super::text::{CacheShape, Extend, Lfm2Text, SlotExtend};
use super::vision::{ImageEncoder, TilePatches};
use crate::ModelFiles;

/// One sequence's part of a call: the tokens it appends and the tiles of the images whose
/// placeholder tokens are among them (in order).
pub struct Turn<'a> {
    pub seq: u64,
    pub tokens: &'a [u32],
    pub tiles: &'a [TilePatches<'a>],
}

/// One slot's part of a call (see [`Lfm2Vl::extend_slots`]).
pub struct SlotTurn<'a> {
    pub slot: usize,
    pub held: usize,
    pub tokens: &'a [u32],
    pub tiles: &'a [TilePatches<'a>],
    pub keep: &'a [(usize, usize)],
}

pub struct Lfm2Vl<B: Backend> {
    cfg: Lfm2VlConfig,
    /// The tower's input value of each pixel byte, as the checkpoint's processor computes it.
    pixels: [f32; 256],
    pub encoder: ImageEncoder<B>,
    pub text: Lfm2Text<B>,
}

impl<B: Backend> Lfm2Vl<B> {
    /// Load `model.safetensors` (or its shards) from `files` with a cache of `cache`.
    pub fn load(be: &B, files: &ModelFiles, cfg: &Lfm2VlConfig, cache: CacheShape) -> Result<Self> {
        let w = files.weights("model")?;
        Ok(Lfm2Vl {
            cfg: cfg.clone(),
            pixels: *ImageProcessor::load(files)?.pixel_map(),
            encoder: ImageEncoder::load(be, cfg, &w)?,
            text: Lfm2Text::load(be, &cfg.text, &w, cache)?,
        })
    }

    pub fn config(&self) -> &Lfm2VlConfig {
        &self.cfg
    }

    /// The tower's input value of each pixel byte.
    pub fn pixel_map(&self) -> &[f32; 256] {
        &self.pixels
    }

    /// Encode `tiles` through the tower and projector alone and wait for the device (the tower
    /// timed by itself; nothing is kept).
    pub fn encode_images(&mut self, be: &B, tiles: &[TilePatches<'_>]) -> Result<()> {
        if tiles.is_empty() {
            return Ok(());
        }
        let feats = self.encoder.forward(be, tiles, &self.pixels)?;
        be.read_f32(feats.rows(feats.rows - 1, 1)).map(drop)
    }

    /// Extend each turn's sequence (see [`Lfm2Text::extend`]), the images of every turn encoded
    /// together first. Returns the logits of each turn's last row, or with `all_rows` of every
    /// row.
    pub fn extend(&mut self, be: &B, turns: &[Turn<'_>], all_rows: bool) -> Result<View<'_, B>> {
        let tiles: Vec<_> = turns.iter().map(|t| t.tiles).collect();
        let media = turn_media(
            &mut self.encoder,
            &self.pixels,
            self.cfg.image_token,
            be,
            &tiles,
        )?;
        let parts: Vec<Extend<'_, B>> = turns
            .iter()
            .zip(media)
            .map(|(t, media)| Extend {
                seq: t.seq,
                tokens: t.tokens,
                media,
            })
            .collect();
        self.text.extend(be, &parts, all_rows)
    }

    /// Extend slots the caller keeps track of (see [`Lfm2Text::extend_slots`]), the images of
    /// every turn encoded together first. Returns the logits of each turn's last row.
    pub fn extend_slots(&mut self, be: &B, turns: &[SlotTurn<'_>]) -> Result<View<'_, B>> {
        let tiles: Vec<_> = turns.iter().map(|t| t.tiles).collect();
        let media = turn_media(
            &mut self.encoder,
            &self.pixels,
            self.cfg.image_token,
            be,
            &tiles,
        )?;
        let parts: Vec<SlotExtend<'_, B>> = turns
            .iter()
            .zip(media)
            .map(|(t, media)| SlotExtend {
                slot: t.slot,
                held: t.held,
                tokens: t.tokens,
                media,
                keep: t.keep,
            })
            .collect();
        self.text.extend_slots(be, &parts)
    }
}

/// The image token whose rows a turn's features replace, and those rows.
type Media<'a, B> = (u32, View<'a, B>);

/// Encode the tiles of every turn (`tiles[i]` for turn `i`) in one pass of the tower and give
/// each turn its rows of the features, as the text model's media part: `(image token, rows)`
/// for a turn with images, `None` for one without.
fn turn_media<'a, B: Backend>(
    encoder: &'a mut ImageEncoder<B>,
    pixels: &[f32; 256],
    image_token: u32,
    be: &B,
    tiles: &[&[TilePatches<'_>]],
) -> Result<Vec<Option<Media<'a, B>>>> {
    let all: Vec<TilePatches<'_>> = tiles.iter().flat_map(|t| t.iter().copied()).collect();
    let feats = if all.is_empty() {
        None
    } else {
        Some(encoder.forward(be, &all, pixels)?)
    };
    let mut at = 0;
    Ok(tiles
        .iter()
        .map(|t| {
            let n: usize = t.iter().map(TilePatches::tokens).sum();
            let media = feats
                .filter(|_| n > 0)
                .map(|f| (image_token, f.rows(at, n)));
            at += n;
            media
        })
        .collect())
}
