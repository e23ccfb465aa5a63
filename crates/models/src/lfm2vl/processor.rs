//! LFM2-VL's image processor: transformers 5.25.0's `Lfm2VlImageProcessor` (torchvision backend)
//! and the placeholder text `Lfm2VlProcessor` puts in place of each `<image>`, reproduced exactly.
//!
//! An image is either resized whole ("smart resize": both sides multiples of patch·downsample,
//! pixels within the token budget, Python's half-to-even rounding) or, when it is too large,
//! split: the whole image is resized once to a grid of `tile_size` tiles and cut row-major, and a
//! thumbnail (the smart-resized *original*) follows the tiles. Every resize is torchvision's
//! antialiased resize on uint8 ([`resize_aa`]; bilinear unless the file asks for bicubic). Each
//! tile becomes NaFlex patches: raster order, each patch `(py, px, c)`, kept as bytes; the tower's
//! input is [`ImageProcessor::pixel_value`] of each byte.
//!
//! What the reference does that the spec (`shared/specs/qwen_image21_and_lfm2vl.md` B2, B6)
//! leaves out or gets wrong, found in the pinned code:
//! - the settings come from `preprocessor_config.json` alone; a missing key *or a JSON null*
//!   takes the class default (`use_thumbnail` on); `do_resize: false` and `max_num_patches` in
//!   the file are ignored (resizing is forced, the patch cap is recomputed); `resample`, the
//!   rescale and the normalisation are honoured;
//! - the grid candidates are `sorted(set(...), key=area)`: among grids of equal area the order is
//!   CPython 3.11's set iteration order, which decides exact aspect ties (no such tie exists among
//!   the published 2..10 grids; with `min_tiles = max_tiles = 2` a 5:4 image covering more than
//!   the two tiles' half area gets 1 row × 2 columns, a smaller one 2 rows × 1 column);
//!   `target_ratios` replays CPython's set;
//! - the spec's "3×2 grid" for 1024×771 is columns × rows: 2 rows of 3 tiles;
//! - the pixel values are `(v − 127.5) / 127.5` in f32 (rescale and normalise fused into one mean
//!   and std), which differs from [`crate::imageproc::pixel_value`] (Gemma's `2·(v/255 − ½)`) in
//!   the last bits for 207 of the 256 bytes;
//! - `do_convert_rgb` defaults to None, with which a grey or RGBA image *fails* in the reference
//!   (1 or 4 channels against a 3-channel mean); Tessera's decoder always gives RGB the way
//!   `do_convert_rgb=True` does (transparency onto white);
//! - with `min_tiles = 1` a split image may get a 1×1 grid: one full tile, no thumbnail, but the
//!   text counts the smart-resize tokens (e.g. 727×721: 240 placeholders for 256 features), which
//!   the reference model then refuses. [`ImageProcessor::plan`] refuses it up front;
//! - a piece with more patches than `max_num_patches` (a very elongated image: 10000×1 becomes
//!   51200×32) is not padded but left longer than its attention mask, which the model misreads;
//!   refused too;
//! - `use_image_special_tokens` is a call-time option of the processor (default on); 5.25 ignores
//!   it in `processor_config.json` (checked), so the caller passes it to
//!   [`ProcessedImage::placeholder_text_with`];
//! - torchvision resizes uint8 bilinear natively only on AVX2/AVX-512/arm64 CPUs (elsewhere via
//!   float32, which differs in places); the fixtures come from the native path.

use std::fmt::Write as _;
use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

use super::vision::TilePatches;
use crate::files::ModelFiles;
use crate::imageproc::resize::resize_bytes;
use crate::imageproc::{Filter, Image, MAX_PIXELS, patchify, resize_aa};

/// The file the reference reads the image settings from.
pub const CONFIG_FILE: &str = "preprocessor_config.json";

/// The placeholder token and the markers around an image (the reference takes them from the
/// tokenizer's attributes of these names; LFM2-VL's tokenizer has none, so these defaults).
pub const IMAGE_TOKEN: &str = "<image>";
pub const IMAGE_START: &str = "<|image_start|>";
pub const IMAGE_END: &str = "<|image_end|>";
pub const IMAGE_THUMBNAIL: &str = "<|img_thumbnail|>";

/// Most bytes [`ImageProcessor::process`] may hold for one image; a larger plan is refused from
/// the image's size alone (a tall 1-pixel-wide strip would otherwise ask for gigabytes).
pub const MAX_PREPROCESS_BYTES: u64 = 1 << 30;

/// Most tiles a config may allow: the candidate grids grow with it, and the published
/// tokenizer's row/column markers stop at 10×10 anyway.
const MAX_TILES: usize = 1024;

/// The image settings of `preprocessor_config.json`, with `Lfm2VlImageProcessor`'s class
/// defaults for keys that are missing or null.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(from = "RawConfig")]
pub struct PreprocessorConfig {
    pub downsample_factor: usize,
    pub do_image_splitting: bool,
    pub min_tiles: usize,
    pub max_tiles: usize,
    pub use_thumbnail: bool,
    pub min_image_tokens: usize,
    pub max_image_tokens: usize,
    pub encoder_patch_size: usize,
    pub tile_size: usize,
    pub max_pixels_tolerance: f64,
    /// Pillow's resampling enum: 2 bilinear, 3 bicubic (the others are refused).
    pub resample: u32,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    /// One value (all channels) or one per channel, as the file gives it.
    pub image_mean: Vec<f64>,
    pub image_std: Vec<f64>,
}

impl Default for PreprocessorConfig {
    fn default() -> Self {
        RawConfig::default().into()
    }
}

/// What the file may hold: every key the reference reads; `None` for missing or null.
#[derive(Deserialize, Default)]
struct RawConfig {
    downsample_factor: Option<usize>,
    do_image_splitting: Option<bool>,
    min_tiles: Option<usize>,
    max_tiles: Option<usize>,
    use_thumbnail: Option<bool>,
    min_image_tokens: Option<usize>,
    max_image_tokens: Option<usize>,
    encoder_patch_size: Option<usize>,
    tile_size: Option<usize>,
    max_pixels_tolerance: Option<f64>,
    resample: Option<u32>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<PerChannel>,
    image_std: Option<PerChannel>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PerChannel {
    One(f64),
    Each(Vec<f64>),
}

impl PerChannel {
    fn values(self) -> Vec<f64> {
        match self {
            PerChannel::One(v) => vec![v],
            PerChannel::Each(v) => v,
        }
    }
}

impl From<RawConfig> for PreprocessorConfig {
    fn from(r: RawConfig) -> Self {
        PreprocessorConfig {
            downsample_factor: r.downsample_factor.unwrap_or(2),
            do_image_splitting: r.do_image_splitting.unwrap_or(true),
            min_tiles: r.min_tiles.unwrap_or(2),
            max_tiles: r.max_tiles.unwrap_or(10),
            use_thumbnail: r.use_thumbnail.unwrap_or(true),
            min_image_tokens: r.min_image_tokens.unwrap_or(64),
            max_image_tokens: r.max_image_tokens.unwrap_or(256),
            encoder_patch_size: r.encoder_patch_size.unwrap_or(16),
            tile_size: r.tile_size.unwrap_or(512),
            max_pixels_tolerance: r.max_pixels_tolerance.unwrap_or(2.0),
            resample: r.resample.unwrap_or(2),
            do_rescale: r.do_rescale.unwrap_or(true),
            rescale_factor: r.rescale_factor.unwrap_or(1.0 / 255.0),
            do_normalize: r.do_normalize.unwrap_or(true),
            // IMAGENET_STANDARD_MEAN / _STD.
            image_mean: r.image_mean.map_or(vec![0.5; 3], PerChannel::values),
            image_std: r.image_std.map_or(vec![0.5; 3], PerChannel::values),
        }
    }
}

impl PreprocessorConfig {
    /// Parse the text of `path` (a `preprocessor_config.json`).
    pub fn from_json(path: &Path, text: &str) -> Result<Self> {
        tessera_core::config::parse_json(path, text)
    }

    /// Whether tiling can happen at all: the reference turns splitting off by setting
    /// `min_tiles = max_tiles = 1`, and never splits with those values either.
    fn splits(&self) -> bool {
        self.do_image_splitting && !(self.min_tiles == 1 && self.max_tiles == 1)
    }

    /// Refuse settings the reference fails on, that give inconsistent output, or that would make
    /// any image costly; errors name `path` and the field.
    fn validate(&self, path: &Path) -> Result<Limits> {
        let err = |field: &str, message: String| Error::config(path, field, message);
        let (p, d) = (self.encoder_patch_size, self.downsample_factor);
        if p == 0 {
            return Err(err("encoder_patch_size", "must be at least 1".into()));
        }
        if d == 0 {
            return Err(err("downsample_factor", "must be at least 1".into()));
        }
        if self.max_image_tokens == 0 {
            return Err(err(
                "max_image_tokens",
                "must be at least 1 (the reference divides by it)".into(),
            ));
        }
        // Pixels of `n` tokens, bounded so that every later product fits.
        let pixels = |field: &str, n: usize| {
            [p, p, d, d]
                .into_iter()
                .try_fold(n, |v, k| v.checked_mul(k))
                .filter(|&v| v as u64 <= MAX_PIXELS)
                .ok_or_else(|| {
                    err(
                        field,
                        format!("{n} tokens of {p}² pixels ×{d}² exceed {MAX_PIXELS} pixels"),
                    )
                })
        };
        let min_pixels = pixels("min_image_tokens", self.min_image_tokens)?;
        let max_pixels = pixels("max_image_tokens", self.max_image_tokens)?;
        let factor = p * d;
        let splits = self.splits();
        if splits {
            let t = self.tile_size;
            if t == 0 || !t.is_multiple_of(factor) {
                return Err(err(
                    "tile_size",
                    format!(
                        "{t} is not a positive multiple of encoder_patch_size × downsample_factor \
                         ({p}×{d}): tiles must cut into whole merged patches"
                    ),
                ));
            }
            if self.min_tiles == 0 {
                return Err(err("min_tiles", "must be at least 1".into()));
            }
            if self.min_tiles > self.max_tiles {
                return Err(err(
                    "min_tiles",
                    format!(
                        "{} is more than max_tiles ({})",
                        self.min_tiles, self.max_tiles
                    ),
                ));
            }
            let grid = (t as u64).saturating_mul(t as u64);
            if self.max_tiles > MAX_TILES || grid.saturating_mul(self.max_tiles as u64) > MAX_PIXELS
            {
                return Err(err(
                    "max_tiles",
                    format!(
                        "{} tiles of {t}² pixels are more than this processor allows \
                         ({MAX_TILES} tiles, {MAX_PIXELS} pixels)",
                        self.max_tiles
                    ),
                ));
            }
        }
        let filter = match self.resample {
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            r => {
                return Err(err(
                    "resample",
                    format!("{r} is not supported (2, bilinear, or 3, bicubic)"),
                ));
            }
        };
        for (field, values) in [
            ("image_mean", &self.image_mean),
            ("image_std", &self.image_std),
        ] {
            if !(values.len() == 1 || values.len() == 3) {
                return Err(err(
                    field,
                    format!("{} values for 3 channels", values.len()),
                ));
            }
            if values.iter().any(|&v| v != values[0]) {
                return Err(err(
                    field,
                    "different values per channel are not supported (the tower maps every byte \
                     through one table)"
                        .into(),
                ));
            }
        }
        if self.do_normalize && self.image_std[0] == 0.0 {
            return Err(err("image_std", "0 divides by zero".into()));
        }
        if self.do_rescale && self.do_normalize && self.rescale_factor == 0.0 {
            return Err(err(
                "rescale_factor",
                "0 divides by zero (the reference folds 1/rescale_factor into the mean and std)"
                    .into(),
            ));
        }
        // `max_num_patches` as the reference recomputes it (the file's value is ignored).
        let tile_patches = if splits {
            (self.tile_size / p).pow(2)
        } else {
            0
        };
        let max_patches = (self.max_image_tokens * d * d).max(tile_patches);
        Ok(Limits {
            filter,
            min_pixels,
            max_pixels,
            max_patches,
        })
    }

    /// The f32 the tower receives for byte `v`, computed as the reference computes it.
    fn pixel_value(&self, v: u8) -> f32 {
        let x = v as f32;
        let (mean, std) = (self.image_mean[0] as f32, self.image_std[0] as f32);
        match (self.do_rescale, self.do_normalize) {
            (true, true) => {
                // `_fuse_mean_std_and_rescale_factor`: f32 mean and std times 1/rescale_factor.
                let s = (1.0 / self.rescale_factor) as f32;
                (x - mean * s) / (std * s)
            }
            (false, true) => (x - mean) / std,
            (true, false) => x * self.rescale_factor as f32,
            (false, false) => x,
        }
    }
}

/// What follows from a validated config.
#[derive(Clone, Copy, Debug)]
struct Limits {
    filter: Filter,
    min_pixels: usize,
    max_pixels: usize,
    /// The reference's `max_num_patches`: the most patches of one tile or thumbnail.
    max_patches: usize,
}

/// How an image is cut, decided from its size alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `(rows, cols)` when the image is split into tiles.
    pub grid: Option<(usize, usize)>,
    /// Whether a thumbnail follows the tiles.
    pub thumbnail: bool,
    /// The smart-resize size `(width, height)`: the whole image's when not split, else the
    /// thumbnail's (the reference's `image_sizes`, computed either way).
    pub resized: (usize, usize),
    /// Image tokens of one grid tile.
    pub tile_tokens: usize,
    /// Image tokens of the smart-resized image (the single image, or the thumbnail).
    pub image_tokens: usize,
    /// Most bytes processing holds besides the decoded image.
    pub peak_bytes: u64,
}

impl Layout {
    /// Image tokens in all: the tiles', then the thumbnail's.
    pub fn tokens(&self) -> usize {
        match self.grid {
            Some((rows, cols)) => {
                rows * cols * self.tile_tokens + if self.thumbnail { self.image_tokens } else { 0 }
            }
            None => self.image_tokens,
        }
    }

    /// The text that replaces one `<image>` in the prompt.
    pub fn placeholder_text(&self, use_image_special_tokens: bool) -> String {
        placeholder(
            self.grid,
            self.thumbnail,
            self.tile_tokens,
            self.image_tokens,
            use_image_special_tokens,
        )
    }
}

/// `Lfm2VlProcessor._build_image_tokens`: markers only when asked, row/column markers only for
/// more than one tile, the thumbnail's only after tiles.
fn placeholder(
    grid: Option<(usize, usize)>,
    thumbnail: bool,
    tile_tokens: usize,
    image_tokens: usize,
    markers: bool,
) -> String {
    let mut s = String::new();
    if markers {
        s.push_str(IMAGE_START);
    }
    match grid {
        Some((rows, cols)) if rows > 1 || cols > 1 => {
            for r in 1..=rows {
                for c in 1..=cols {
                    if markers {
                        let _ = write!(s, "<|img_row_{r}_col_{c}|>");
                    }
                    s.push_str(&IMAGE_TOKEN.repeat(tile_tokens));
                }
            }
            if thumbnail {
                if markers {
                    s.push_str(IMAGE_THUMBNAIL);
                }
                s.push_str(&IMAGE_TOKEN.repeat(image_tokens));
            }
        }
        _ => s.push_str(&IMAGE_TOKEN.repeat(image_tokens)),
    }
    if markers {
        s.push_str(IMAGE_END);
    }
    s
}

/// One tile (or the thumbnail, or the whole resized image) as the tower's input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Size in pixels.
    pub width: usize,
    pub height: usize,
    /// Patch grid.
    pub grid_w: usize,
    pub grid_h: usize,
    /// Image tokens after the `downsample_factor`² merge.
    pub tokens: usize,
    /// `[grid_h·grid_w, patch·patch·3]`: the resized bytes in patches, raster order, each
    /// `(py, px, c)`; the tower's input value of byte `v` is [`ImageProcessor::pixel_value`].
    pub patches: Vec<u8>,
}

/// An image as the model takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessedImage {
    /// The grid tiles row-major, then the thumbnail; or the one resized image.
    pub tiles: Vec<Tile>,
    /// `(rows, cols)` when split.
    pub grid: Option<(usize, usize)>,
    /// Whether the last tile is the thumbnail.
    pub thumbnail: bool,
    /// The smart-resize size `(width, height)` (see [`Layout::resized`]).
    pub resized: (usize, usize),
}

impl ProcessedImage {
    /// Its tiles' patches, in order, as the vision tower takes them.
    pub fn patches(&self) -> impl Iterator<Item = TilePatches<'_>> {
        self.tiles.iter().map(|t| TilePatches {
            grid_w: t.grid_w,
            grid_h: t.grid_h,
            bytes: &t.patches,
        })
    }

    /// Image tokens in all, which the placeholder text holds as many `<image>` of.
    pub fn tokens(&self) -> usize {
        self.tiles.iter().map(|t| t.tokens).sum()
    }

    /// The text that replaces one `<image>` with the processor's default markers
    /// (`use_image_special_tokens` on).
    pub fn placeholder_text(&self) -> String {
        self.placeholder_text_with(true)
    }

    /// The text that replaces one `<image>`, markers as the caller's `use_image_special_tokens`.
    pub fn placeholder_text_with(&self, use_image_special_tokens: bool) -> String {
        let first = self.tiles.first().map_or(0, |t| t.tokens);
        let last = self.tiles.last().map_or(0, |t| t.tokens);
        placeholder(
            self.grid,
            self.thumbnail,
            first,
            last,
            use_image_special_tokens,
        )
    }
}

/// LFM2-VL's image processor, from a model's `preprocessor_config.json`.
#[derive(Clone, Debug)]
pub struct ImageProcessor {
    cfg: PreprocessorConfig,
    limits: Limits,
    /// Grid candidates `(cols, rows)` in the reference's order.
    ratios: Vec<(usize, usize)>,
    map: [f32; 256],
}

impl ImageProcessor {
    /// Read the model's `preprocessor_config.json`; without one, the class defaults apply.
    pub fn load(files: &ModelFiles) -> Result<Self> {
        let path = files.path(CONFIG_FILE);
        let cfg = match files.read_optional(CONFIG_FILE)? {
            Some(text) => PreprocessorConfig::from_json(&path, &text)?,
            None => PreprocessorConfig::default(),
        };
        Self::with_path(cfg, &path)
    }

    /// A processor for `cfg`, validated (errors name `preprocessor_config.json` and the field).
    pub fn new(cfg: PreprocessorConfig) -> Result<Self> {
        Self::with_path(cfg, Path::new(CONFIG_FILE))
    }

    fn with_path(cfg: PreprocessorConfig, path: &Path) -> Result<Self> {
        let limits = cfg.validate(path)?;
        let ratios = if cfg.splits() {
            target_ratios(cfg.min_tiles, cfg.max_tiles)
        } else {
            Vec::new()
        };
        let map = std::array::from_fn(|v| cfg.pixel_value(v as u8));
        Ok(ImageProcessor {
            cfg,
            limits,
            ratios,
            map,
        })
    }

    pub fn config(&self) -> &PreprocessorConfig {
        &self.cfg
    }

    /// The f32 the vision tower receives for pixel byte `v` (for LFM2-VL's settings
    /// `(v − 127.5) / 127.5` in f32).
    pub fn pixel_value(&self, v: u8) -> f32 {
        self.map[v as usize]
    }

    /// [`Self::pixel_value`] of every byte, for `Backend::write_u8_mapped`.
    pub fn pixel_map(&self) -> &[f32; 256] {
        &self.map
    }

    /// The reference's layout (`_get_split_layout`) for a `w × h` image of at most
    /// [`MAX_PIXELS`] pixels, unchecked.
    fn layout(&self, w: usize, h: usize) -> Layout {
        let cfg = &self.cfg;
        let split = cfg.splits() && self.too_large(w, h);
        let resized = self.smart_resize(w, h);
        let grid = split.then(|| {
            let (cols, rows) = self.grid(w, h);
            (rows, cols)
        });
        let thumbnail = cfg.use_thumbnail && grid.is_some_and(|(r, c)| r * c != 1);
        let merged = cfg.encoder_patch_size * cfg.downsample_factor;
        // The tile size is only validated (and used) when splitting is on.
        let tile_tokens = if cfg.splits() {
            (cfg.tile_size / merged).pow(2)
        } else {
            0
        };
        let image_tokens = (resized.0 / merged) * (resized.1 / merged);
        // Upper bound of what `process` holds: the grid's resize and its tiles (cut copy and
        // patches), then the smart resize and its patches.
        let bytes = |w: usize, h: usize| w as u64 * h as u64 * 3;
        let mut peak_bytes = 0;
        if let Some((rows, cols)) = grid {
            let (gw, gh) = (cols * cfg.tile_size, rows * cfg.tile_size);
            peak_bytes += resize_bytes(w, h, gw, gh) + bytes(gw, gh) * 2;
        }
        if grid.is_none() || thumbnail {
            peak_bytes +=
                resize_bytes(w, h, resized.0, resized.1) + bytes(resized.0, resized.1) * 2;
        }
        Layout {
            grid,
            thumbnail,
            resized,
            tile_tokens,
            image_tokens,
            peak_bytes,
        }
    }

    /// How a `width × height` image will be cut (the reference's `_get_split_layout`), known
    /// before decoding; refuses what the reference cannot give consistently and what would cost
    /// more than [`MAX_PREPROCESS_BYTES`].
    pub fn plan(&self, width: usize, height: usize) -> Result<Layout> {
        if width == 0 || height == 0 || width as u64 * height as u64 > MAX_PIXELS {
            return Err(Error::input(format!(
                "a {width}×{height} image is empty or over {MAX_PIXELS} pixels"
            )));
        }
        let l = self.layout(width, height);
        let (rw, rh) = l.resized;
        if l.grid == Some((1, 1)) {
            let t = self.cfg.tile_size;
            return Err(Error::input(format!(
                "a {width}×{height} image would be split into a 1×1 grid (min_tiles = 1): \
                 transformers then gives one {t}×{t} tile of {} tokens but {} placeholders, \
                 which its model refuses; set min_tiles to 2 or more",
                l.tile_tokens, l.image_tokens
            )));
        }
        let p = self.cfg.encoder_patch_size;
        let patches = (rw / p) * (rh / p);
        if (l.grid.is_none() || l.thumbnail) && patches > self.limits.max_patches {
            return Err(Error::input(format!(
                "a {width}×{height} image resizes to {rw}×{rh}, {patches} patches, more than the \
                 {} one image may have (the processor's max_num_patches): too elongated",
                self.limits.max_patches
            )));
        }
        if l.peak_bytes > MAX_PREPROCESS_BYTES {
            return Err(Error::input(format!(
                "a {width}×{height} image needs {} MiB to preprocess, more than the limit of {} \
                 MiB",
                l.peak_bytes.div_ceil(1 << 20),
                MAX_PREPROCESS_BYTES >> 20
            )));
        }
        Ok(l)
    }

    /// Resize, tile and patch one image as the reference does.
    pub fn process(&self, img: &Image) -> Result<ProcessedImage> {
        let l = self.plan(img.width(), img.height())?;
        let mut tiles = Vec::new();
        if let Some((rows, cols)) = l.grid {
            let t = self.cfg.tile_size;
            let whole = self.resize(img, cols * t, rows * t)?;
            let row = whole.width() * 3;
            for r in 0..rows {
                for c in 0..cols {
                    let mut rgb = Vec::with_capacity(t * t * 3);
                    for y in r * t..(r + 1) * t {
                        rgb.extend_from_slice(&whole.rgb()[y * row + c * t * 3..][..t * 3]);
                    }
                    tiles.push(self.tile(&Image::from_rgb8(t, t, rgb)?));
                }
            }
        }
        if l.grid.is_none() || l.thumbnail {
            let (w, h) = l.resized;
            tiles.push(if (w, h) == (img.width(), img.height()) {
                self.tile(img)
            } else {
                self.tile(&self.resize(img, w, h)?)
            });
        }
        Ok(ProcessedImage {
            tiles,
            grid: l.grid,
            thumbnail: l.thumbnail,
            resized: l.resized,
        })
    }

    fn resize(&self, img: &Image, w: usize, h: usize) -> Result<Image> {
        resize_aa(img, w, h, self.limits.filter)
    }

    fn tile(&self, img: &Image) -> Tile {
        let p = self.cfg.encoder_patch_size;
        let d = self.cfg.downsample_factor;
        let patches = patchify(img, p);
        Tile {
            width: img.width(),
            height: img.height(),
            grid_w: patches.width,
            grid_h: patches.height,
            tokens: (patches.width / d) * (patches.height / d),
            patches: patches.pixels,
        }
    }

    /// `smart_resize`: `(width, height)`, both multiples of patch·downsample, within the token
    /// budget, aspect kept as closely as the rounding allows.
    fn smart_resize(&self, w: usize, h: usize) -> (usize, usize) {
        let f = self.cfg.encoder_patch_size * self.cfg.downsample_factor;
        let (min_px, max_px) = (self.limits.min_pixels, self.limits.max_pixels);
        let mut hb = f.max(round_by_factor(h, f));
        let mut wb = f.max(round_by_factor(w, f));
        let (hf, wf, ff) = (h as f64, w as f64, f as f64);
        if hb * wb > max_px {
            let beta = ((h * w) as f64 / max_px as f64).sqrt();
            hb = f.max((hf / beta / ff).floor() as usize * f);
            wb = f.max((wf / beta / ff).floor() as usize * f);
        } else if hb * wb < min_px {
            let beta = (min_px as f64 / (h * w) as f64).sqrt();
            hb = (hf * beta / ff).ceil() as usize * f;
            wb = (wf * beta / ff).ceil() as usize * f;
        }
        (wb, hb)
    }

    /// `_is_image_too_large`: note the floor of one patch, not one merged patch.
    fn too_large(&self, w: usize, h: usize) -> bool {
        let cfg = &self.cfg;
        let p = cfg.encoder_patch_size;
        let f = p * cfg.downsample_factor;
        let hb = p.max(round_by_factor(h, f));
        let wb = p.max(round_by_factor(w, f));
        (hb * wb) as f64 > self.limits.max_pixels as f64 * cfg.max_pixels_tolerance
    }

    /// `find_closest_aspect_ratio`: `(cols, rows)` of the candidate nearest the aspect ratio;
    /// on an exact tie the later candidate wins if the image covers over half its area.
    fn grid(&self, w: usize, h: usize) -> (usize, usize) {
        let aspect = w as f64 / h as f64;
        let t = self.cfg.tile_size;
        let area = (w * h) as f64;
        let mut best = (1, 1);
        let mut best_diff = f64::INFINITY;
        for &(cols, rows) in &self.ratios {
            let diff = (aspect - cols as f64 / rows as f64).abs();
            if diff < best_diff {
                best_diff = diff;
                best = (cols, rows);
            } else if diff == best_diff && area > 0.5 * (t * t * cols * rows) as f64 {
                best = (cols, rows);
            }
        }
        best
    }
}

/// Python's `round(x / f) * f` for integers: halves go to the even multiple.
fn round_by_factor(x: usize, f: usize) -> usize {
    let (q, r) = (x / f, x % f);
    let up = 2 * r > f || (2 * r == f && q % 2 == 1);
    (q + up as usize) * f
}

/// `_target_ratios(min, max)`: every `(cols, rows)` with `min ≤ cols·rows ≤ max`, as
/// `sorted(set(list), key=cols·rows)` orders them: by area, and within an area in the order
/// CPython 3.11 iterates the set, replayed here (its string-free hashes are not randomised).
fn target_ratios(min_tiles: usize, max_tiles: usize) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    for w in 1..=max_tiles {
        for h in 1..=max_tiles / w {
            if w * h >= min_tiles {
                pairs.push((w, h));
            }
        }
    }
    // The list comprehension (n, then w, then h) first meets a pair at n = max(min, w, h).
    pairs.sort_by_key(|&(w, h)| (w.max(h).max(min_tiles), w, h));
    let mut set = PySet::default();
    for p in pairs {
        set.insert(p);
    }
    let mut out: Vec<_> = set.table.into_iter().flatten().map(|(_, p)| p).collect();
    out.sort_by_key(|&(w, h)| w * h); // stable, like `sorted`
    out
}

/// CPython 3.11's `set` of distinct keys (no deletions): open addressing with 9 linear probes,
/// then perturbed jumps; the table quadruples when 3/5 full.
struct PySet {
    table: Vec<Option<(u64, (usize, usize))>>,
    used: usize,
}

impl Default for PySet {
    fn default() -> Self {
        PySet {
            table: vec![None; 8],
            used: 0,
        }
    }
}

impl PySet {
    const LINEAR_PROBES: usize = 9;

    /// `hash((a, b))` for small non-negative ints (`tuplehash`, the xxHash-style lanes).
    fn hash((a, b): (usize, usize)) -> u64 {
        const P1: u64 = 11400714785074694791;
        const P2: u64 = 14029467366897019727;
        const P5: u64 = 2870177450012600261;
        let mut acc = P5;
        for lane in [a as u64, b as u64] {
            acc = acc.wrapping_add(lane.wrapping_mul(P2)).rotate_left(31);
            acc = acc.wrapping_mul(P1);
        }
        acc = acc.wrapping_add(2 ^ (P5 ^ 3527539));
        if acc == u64::MAX { 1546275796 } else { acc }
    }

    /// The first free slot on `hash`'s probe sequence (`set_add_entry`, `set_insert_clean`).
    fn slot(table: &[Option<(u64, (usize, usize))>], hash: u64) -> usize {
        let mask = table.len() - 1;
        let mut i = hash as usize & mask;
        let mut perturb = hash;
        loop {
            let probes = if i + Self::LINEAR_PROBES <= mask {
                Self::LINEAR_PROBES
            } else {
                0
            };
            if let Some(j) = (i..=i + probes).find(|&j| table[j].is_none()) {
                return j;
            }
            perturb >>= 5;
            i = (i * 5 + 1).wrapping_add(perturb as usize) & mask;
        }
    }

    fn insert(&mut self, key: (usize, usize)) {
        let hash = Self::hash(key);
        let j = Self::slot(&self.table, hash);
        self.table[j] = Some((hash, key));
        self.used += 1;
        let mask = self.table.len() - 1;
        if self.used * 5 >= mask * 3 {
            let min_used = if self.used > 50000 {
                self.used * 2
            } else {
                self.used * 4
            };
            let mut size = 8;
            while size <= min_used {
                size <<= 1;
            }
            let old = std::mem::replace(&mut self.table, vec![None; size]);
            for (hash, key) in old.into_iter().flatten() {
                let j = Self::slot(&self.table, hash);
                self.table[j] = Some((hash, key));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde::de::DeserializeOwned;
    use sha2::{Digest, Sha256};

    use super::*;

    /// `tools/fixtures/lfm2vl_processor.py`'s output.
    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lfm2vl/processor")
    }

    fn read<T: DeserializeOwned>(name: &str) -> T {
        let path = fixtures().join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The processor of one fixture config folder.
    fn processor(config: &str) -> ImageProcessor {
        ImageProcessor::load(&ModelFiles::Dir(fixtures().join(config))).unwrap()
    }

    fn load_json(json: &str) -> Result<ImageProcessor> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), json).unwrap();
        ImageProcessor::load(&ModelFiles::Dir(dir.path().to_path_buf()))
    }

    #[derive(Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
        ratios: Vec<RatioCase>,
        maps: Vec<MapCase>,
        resize: Vec<ResizeCase>,
    }

    #[derive(Deserialize)]
    struct Case {
        config: String,
        image: String,
        width: usize,
        height: usize,
        grid: Option<(usize, usize)>,
        thumbnail: bool,
        resized: (usize, usize),
        tiles: Vec<TileCase>,
        tokens: usize,
        placeholder: String,
        placeholder_plain: String,
    }

    #[derive(Deserialize)]
    struct TileCase {
        width: usize,
        height: usize,
        grid_w: usize,
        grid_h: usize,
        tokens: usize,
        sha256: String,
        sum: u64,
    }

    #[derive(Deserialize)]
    struct RatioCase {
        min: usize,
        max: usize,
        order: Vec<(usize, usize)>,
    }

    #[derive(Deserialize)]
    struct MapCase {
        settings: serde_json::Value,
        bits: Vec<i32>,
    }

    #[derive(Deserialize)]
    struct ResizeCase {
        input: (usize, usize),
        output: (usize, usize),
        sha256: String,
    }

    /// The fixture script's `pattern`: the top byte of a multiplicative hash of (x, y, c).
    fn pattern(w: usize, h: usize) -> Image {
        let mut rgb = Vec::with_capacity(w * h * 3);
        for y in 0..h as u32 {
            for x in 0..w as u32 {
                for c in 0..3u32 {
                    let v = x
                        .wrapping_mul(2654435761)
                        .wrapping_add(y.wrapping_mul(40503))
                        .wrapping_add(c * 12345);
                    rgb.push((v.wrapping_mul(2246822519) >> 24) as u8);
                }
            }
        }
        Image::from_rgb8(w, h, rgb).unwrap()
    }

    /// A tile's patches back to row-major HWC bytes, assuming the `(py, px, c)` patch order.
    fn unpatchify(t: &Tile, p: usize) -> Vec<u8> {
        let mut hwc = vec![0u8; t.width * t.height * 3];
        for (i, patch) in t.patches.chunks_exact(p * p * 3).enumerate() {
            let (gy, gx) = (i / t.grid_w, i % t.grid_w);
            for (dy, line) in patch.chunks_exact(p * 3).enumerate() {
                let start = ((gy * p + dy) * t.width + gx * p) * 3;
                hwc[start..start + p * 3].copy_from_slice(line);
            }
        }
        hwc
    }

    #[test]
    fn processed_images_match_the_reference() {
        let fx: Fixture = read("cases.json");
        assert!(fx.cases.len() >= 20);
        for c in &fx.cases {
            let name = format!("{}/{}", c.config, c.image);
            let ip = processor(&c.config);
            let img = Image::open(&fixtures().join("images").join(&c.image)).unwrap();
            assert_eq!((img.width(), img.height()), (c.width, c.height), "{name}");
            let out = ip.process(&img).unwrap();
            assert_eq!(out.grid, c.grid, "{name}: grid");
            assert_eq!(out.thumbnail, c.thumbnail, "{name}: thumbnail");
            assert_eq!(out.resized, c.resized, "{name}: resized");
            assert_eq!(out.tiles.len(), c.tiles.len(), "{name}: tiles");
            let p = ip.config().encoder_patch_size;
            for (i, (t, want)) in out.tiles.iter().zip(&c.tiles).enumerate() {
                let got = (t.width, t.height, t.grid_w, t.grid_h, t.tokens);
                let exp = (
                    want.width,
                    want.height,
                    want.grid_w,
                    want.grid_h,
                    want.tokens,
                );
                assert_eq!(got, exp, "{name}: tile {i}");
                assert_eq!(t.patches.len(), t.width * t.height * 3, "{name}: tile {i}");
                let hwc = unpatchify(t, p);
                let sum: u64 = hwc.iter().map(|&v| v as u64).sum();
                assert_eq!(sum, want.sum, "{name}: tile {i} byte sum");
                let sha = format!("{:x}", Sha256::digest(&hwc));
                assert_eq!(sha, want.sha256, "{name}: tile {i} bytes");
            }
            assert_eq!(out.tokens(), c.tokens, "{name}: tokens");
            assert!(
                out.placeholder_text() == c.placeholder,
                "{name}: placeholder"
            );
            assert!(
                out.placeholder_text_with(false) == c.placeholder_plain,
                "{name}: placeholder without markers"
            );
            let plan = ip.plan(c.width, c.height).unwrap();
            assert_eq!((plan.grid, plan.thumbnail), (c.grid, c.thumbnail), "{name}");
            assert_eq!(plan.tokens(), c.tokens, "{name}: planned tokens");
            assert!(plan.placeholder_text(true) == c.placeholder, "{name}");
        }
    }

    #[test]
    fn bilinear_resize_is_byte_exact_against_torchvision() {
        let fx: Fixture = read("cases.json");
        assert!(fx.resize.len() >= 10);
        for r in &fx.resize {
            let (w, h) = r.input;
            let out = crate::imageproc::resize_bilinear_aa(&pattern(w, h), r.output.0, r.output.1);
            let sha = format!("{:x}", Sha256::digest(out.unwrap().rgb()));
            assert_eq!(sha, r.sha256, "{:?} → {:?}", r.input, r.output);
        }
    }

    #[test]
    fn layouts_match_the_reference() {
        type Row = (String, usize, usize, bool, usize, usize, usize, usize);
        let rows: Vec<Row> = read("layouts.json");
        let mut processors = std::collections::HashMap::new();
        let (mut one_by_one, mut elongated, mut split) = (0, 0, 0);
        for (config, w, h, is_split, r, c, rw, rh) in rows {
            let ip = processors
                .entry(config.clone())
                .or_insert_with(|| processor(&config));
            let l = ip.layout(w, h);
            let grid = is_split.then_some((r, c));
            assert_eq!((l.grid, l.resized), (grid, (rw, rh)), "{config} {w}×{h}");
            split += is_split as usize;
            let plan = ip.plan(w, h);
            if grid == Some((1, 1)) {
                one_by_one += 1;
                assert!(plan.unwrap_err().to_string().contains("1×1 grid"));
            } else if let Err(e) = plan {
                elongated += 1;
                let p = ip.config().encoder_patch_size;
                assert!(
                    (rw / p) * (rh / p) > ip.limits.max_patches
                        || l.peak_bytes > MAX_PREPROCESS_BYTES,
                    "{config} {w}×{h}: {e}"
                );
            }
        }
        // Every branch is covered.
        assert!(one_by_one > 0 && elongated > 0 && split > 100);
    }

    #[test]
    fn grid_candidates_come_in_cpython_set_order() {
        let fx: Fixture = read("cases.json");
        assert_eq!(fx.ratios.len(), 78);
        for r in &fx.ratios {
            assert_eq!(
                target_ratios(r.min, r.max),
                r.order,
                "{}..={}",
                r.min,
                r.max
            );
        }
    }

    #[test]
    fn pixel_values_match_the_reference() {
        let fx: Fixture = read("cases.json");
        for m in &fx.maps {
            let cfg = PreprocessorConfig::from_json(Path::new("test"), &m.settings.to_string());
            let ip = ImageProcessor::new(cfg.unwrap()).unwrap();
            let bits: Vec<i32> = ip.pixel_map().iter().map(|v| v.to_bits() as i32).collect();
            assert_eq!(bits, m.bits, "{}", m.settings);
        }
        let ip = processor("published");
        for v in 0..=255u8 {
            assert_eq!(ip.pixel_value(v), (v as f32 - 127.5) / 127.5);
        }
    }

    #[test]
    fn smart_resize_rounds_half_to_even() {
        for (x, want) in [
            (16, 0),
            (48, 64),
            (80, 64),
            (400, 384),
            (416, 416),
            (432, 448),
        ] {
            assert_eq!(round_by_factor(x, 32), want, "{x}");
        }
        let ip = ImageProcessor::new(PreprocessorConfig::default()).unwrap();
        assert_eq!(ip.smart_resize(400, 400), (384, 384));
        assert_eq!(ip.smart_resize(20, 30), (224, 320));
        assert_eq!(ip.smart_resize(1024, 771), (576, 416));
        // The tiling test floors at one patch, smart resize at one merged patch.
        assert_eq!(ip.smart_resize(10, 5000).0, 32);
    }

    #[test]
    fn grid_ties_follow_the_reference() {
        let ip = ImageProcessor::new(PreprocessorConfig::default()).unwrap();
        // A square ties 2×2 with 3×3: the larger wins once the image covers half its area.
        assert_eq!(ip.grid(1080, 1080), (2, 2));
        assert_eq!(ip.grid(1100, 1100), (3, 3));
        assert_eq!(ip.grid(1024, 771), (3, 2));
        // 1×2 and 2×1 tie for 5:4; CPython's set puts (1, 2) first.
        let pair = ImageProcessor::new(PreprocessorConfig {
            min_tiles: 2,
            max_tiles: 2,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(target_ratios(2, 2), [(1, 2), (2, 1)]);
        assert_eq!(pair.grid(1280, 1024), (2, 1));
        assert_eq!(pair.grid(500, 400), (1, 2));
    }

    #[test]
    fn defaults_fill_missing_and_null_keys() {
        let dir = tempfile::tempdir().unwrap();
        let none = ImageProcessor::load(&ModelFiles::Dir(dir.path().to_path_buf())).unwrap();
        assert_eq!(none.config(), &PreprocessorConfig::default());
        let nulls = load_json(r#"{"use_thumbnail": null, "tile_size": null, "image_mean": 0.5}"#);
        let nulls = nulls.unwrap();
        assert!(nulls.config().use_thumbnail);
        assert_eq!(nulls.config().tile_size, 512);
        assert_eq!(nulls.pixel_map(), none.pixel_map());
        // Tiles unused: their size is not checked.
        let flat = load_json(r#"{"do_image_splitting": false, "tile_size": 500}"#).unwrap();
        assert_eq!(flat.plan(2000, 2000).unwrap().grid, None);
    }

    #[test]
    fn bad_settings_name_the_file_and_field() {
        for (json, field) in [
            (r#"{"tile_size": 500}"#, "tile_size"),
            (r#"{"min_tiles": 3, "max_tiles": 2}"#, "min_tiles"),
            (r#"{"min_tiles": 0}"#, "min_tiles"),
            (r#"{"max_tiles": 2000}"#, "max_tiles"),
            (r#"{"resample": 1}"#, "resample"),
            (r#"{"image_mean": [0.5, 0.4, 0.5]}"#, "image_mean"),
            (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
            (r#"{"image_std": 0}"#, "image_std"),
            (r#"{"max_image_tokens": 0}"#, "max_image_tokens"),
            (r#"{"max_image_tokens": 1000000000}"#, "max_image_tokens"),
            (r#"{"encoder_patch_size": 0}"#, "encoder_patch_size"),
            (r#"{"encoder_patch_size": "16"}"#, "encoder_patch_size"),
            (r#"{"rescale_factor": 0}"#, "rescale_factor"),
        ] {
            let e = load_json(json).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(CONFIG_FILE), "{json}: {e}");
        }
    }

    #[test]
    fn costly_images_are_refused_from_their_size() {
        let ip = ImageProcessor::new(PreprocessorConfig::default()).unwrap();
        let e = ip.plan(10000, 1).unwrap_err().to_string();
        assert!(
            e.contains("51200×32") && e.contains("max_num_patches"),
            "{e}"
        );
        // Without a thumbnail a 1-pixel-wide strip would resize to 10 tiles through gigabytes.
        let tiles = ImageProcessor::new(PreprocessorConfig {
            use_thumbnail: false,
            ..Default::default()
        })
        .unwrap();
        let e = tiles.plan(1, 80_000_000).unwrap_err().to_string();
        assert!(e.contains("MiB"), "{e}");
        for (w, h) in [(0, 10), (10, 0), (100_000, 100_000)] {
            assert!(ip.plan(w, h).is_err());
        }
    }
}
