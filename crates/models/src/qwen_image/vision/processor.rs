//! Qwen3-VL's image processor as Qwen-Image-2.1's text encoder runs it (transformers 5.25.0
//! `Qwen2VLImageProcessor`, its default torchvision backend): RGB bytes in, patch rows out.
//!
//! - [`smart_resize`]: each side rounded to a multiple of `patch · merge` (Python's `round`), then
//!   scaled into `[min_pixels, max_pixels]` keeping the aspect; the image is resized only when
//!   that size differs from its own (torch's uint8 antialiased bicubic,
//!   [`crate::imageproc::resize_bicubic_aa`]). The pipeline's condition copies already have sides
//!   that are multiples of 32, so they pass through unless their area is outside the range.
//! - Rescale and normalise fused as the torchvision backend fuses them: `(v − m') / s'` in f32 with
//!   `m' = mean · (1 / rescale)` and `s' = std · (1 / rescale)` rounded to f32, so a byte maps to
//!   one float ([`ImageProcessorConfig::pixel_map`]).
//! - Patchify: rows in 2×2-merge-block order (block row, block column, then the block's 2×2
//!   patches row-major), each row `C·T·P·P` values, channel-major, the one frame repeated
//!   `temporal_patch_size` times; `grid_thw = [1, h/P, w/P]`.
//!
//! The rows stay bytes ([`VisionImage::bytes`]); the map turns them into floats as they are
//! uploaded (`Backend::write_u8_mapped`).

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

use crate::files::ModelFiles;
use crate::imageproc::{Image, resize_bicubic_aa};

/// Largest long-to-short side ratio `smart_resize` takes (it raises above it).
pub const MAX_ASPECT: f64 = 200.0;

/// PIL's `BICUBIC`, the only resample filter implemented here.
const BICUBIC: u32 = 3;

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: usize,
    longest_edge: usize,
}

#[derive(Deserialize)]
struct RawImageProcessor {
    #[serde(default = "yes")]
    do_resize: bool,
    #[serde(default = "yes")]
    do_rescale: bool,
    #[serde(default = "yes")]
    do_normalize: bool,
    image_mean: [f64; 3],
    image_std: [f64; 3],
    #[serde(default = "bicubic")]
    resample: u32,
    rescale_factor: f64,
    size: RawSize,
    patch_size: usize,
    temporal_patch_size: usize,
    merge_size: usize,
}

#[derive(Deserialize)]
struct RawProcessor {
    image_processor: RawImageProcessor,
}

fn yes() -> bool {
    true
}

fn bicubic() -> u32 {
    BICUBIC
}

/// The image processor's settings (`processor_config.json`'s `image_processor`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessorConfig {
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub mean: [f64; 3],
    pub std: [f64; 3],
    pub rescale: f64,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch: usize,
    pub temporal: usize,
    pub merge: usize,
}

impl ImageProcessorConfig {
    /// Parse `processor_config.json` (a saved `Qwen3VLProcessor`), rejecting what is not
    /// implemented (a resample filter other than bicubic, per-channel normalisation) by name.
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawProcessor = tessera_core::config::parse_json(path, json)?;
        let r = raw.image_processor;
        let field = |name: &str| format!("image_processor.{name}");
        if r.do_resize && r.resample != BICUBIC {
            return Err(Error::config(
                path,
                field("resample"),
                format!("{} is not implemented (only 3, bicubic)", r.resample),
            ));
        }
        for (name, v) in [
            ("patch_size", r.patch_size),
            ("temporal_patch_size", r.temporal_patch_size),
            ("merge_size", r.merge_size),
        ] {
            if v == 0 || v > 64 {
                return Err(Error::config(
                    path,
                    field(name),
                    format!("{v} is not in 1..=64"),
                ));
            }
        }
        if r.size.shortest_edge > r.size.longest_edge || r.size.longest_edge == 0 {
            return Err(Error::config(
                path,
                field("size"),
                format!(
                    "shortest_edge {} must be at most longest_edge {} (pixel counts)",
                    r.size.shortest_edge, r.size.longest_edge
                ),
            ));
        }
        let bad = |v: &f64| !v.is_finite();
        if r.image_mean.iter().any(bad)
            || r.image_std.iter().any(|v| bad(v) || *v == 0.0)
            || bad(&r.rescale_factor)
            || r.rescale_factor == 0.0
        {
            return Err(Error::config(
                path,
                field("image_std"),
                "mean, std and rescale_factor must be finite, std and rescale_factor non-zero",
            ));
        }
        if r.image_mean.iter().any(|&m| m != r.image_mean[0])
            || r.image_std.iter().any(|&s| s != r.image_std[0])
        {
            return Err(Error::config(
                path,
                field("image_mean"),
                "per-channel normalisation is not implemented (every channel must share mean and std)",
            ));
        }
        Ok(ImageProcessorConfig {
            do_resize: r.do_resize,
            do_rescale: r.do_rescale,
            do_normalize: r.do_normalize,
            mean: r.image_mean,
            std: r.image_std,
            rescale: r.rescale_factor,
            min_pixels: r.size.shortest_edge,
            max_pixels: r.size.longest_edge,
            patch: r.patch_size,
            temporal: r.temporal_patch_size,
            merge: r.merge_size,
        })
    }

    /// Read `processor_config.json` from the processor folder.
    pub fn load(files: &ModelFiles) -> Result<Self> {
        let name = "processor_config.json";
        Self::parse(&files.path(name), &files.read(name)?)
    }

    /// Sides are multiples of this: a merge block of patches.
    pub fn factor(&self) -> usize {
        self.patch * self.merge
    }

    /// Values per patch row, `C·T·P·P`.
    pub fn row_width(&self) -> usize {
        3 * self.temporal * self.patch * self.patch
    }

    /// The float each byte becomes, as the processor computes it in f32 (module docs).
    pub fn pixel_map(&self) -> [f32; 256] {
        let (mean, std) = (self.mean[0] as f32, self.std[0] as f32);
        let inv = (1.0 / self.rescale) as f32;
        let mut map = [0f32; 256];
        for (v, m) in map.iter_mut().enumerate() {
            let x = v as f32;
            *m = match (self.do_rescale, self.do_normalize) {
                (true, true) => (x - mean * inv) / (std * inv),
                (false, true) => (x - mean) / std,
                (true, false) => x * self.rescale as f32,
                (false, false) => x,
            };
        }
        map
    }

    /// The size (width, height) an image of `width × height` is processed at.
    pub fn target_size(&self, width: usize, height: usize) -> Result<(usize, usize)> {
        if !self.do_resize {
            let f = self.factor();
            if !width.is_multiple_of(f) || !height.is_multiple_of(f) {
                return Err(Error::input(format!(
                    "a {width}×{height} image needs sides that are multiples of {f} when the \
                     processor does not resize"
                )));
            }
            return Ok((width, height));
        }
        let (h, w) = smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )?;
        Ok((w, h))
    }

    /// Resize (if needed) and patchify one RGB image.
    pub fn preprocess(&self, img: &Image) -> Result<VisionImage> {
        let (w, h) = self.target_size(img.width(), img.height())?;
        if (w, h) == (img.width(), img.height()) {
            Ok(self.patchify(img.rgb(), w, h))
        } else {
            let resized = resize_bicubic_aa(img, w, h)?;
            Ok(self.patchify(resized.rgb(), w, h))
        }
    }

    /// Patch rows of `rgb` (`[h, w, 3]`, sides multiples of [`factor`](Self::factor)).
    fn patchify(&self, rgb: &[u8], w: usize, h: usize) -> VisionImage {
        let (p, m, t) = (self.patch, self.merge, self.temporal);
        let (gh, gw) = (h / p, w / p);
        let mut bytes = Vec::with_capacity(gh * gw * self.row_width());
        for by in 0..gh / m {
            for bx in 0..gw / m {
                for my in 0..m {
                    for mx in 0..m {
                        let (y0, x0) = ((by * m + my) * p, (bx * m + mx) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for py in 0..p {
                                    let row = ((y0 + py) * w + x0) * 3 + c;
                                    bytes.extend((0..p).map(|px| rgb[row + 3 * px]));
                                }
                            }
                        }
                    }
                }
            }
        }
        VisionImage {
            grid_h: gh,
            grid_w: gw,
            bytes,
        }
    }
}

/// One image's patch rows: `grid_h · grid_w` rows (`grid_t` is 1 for an image), in merge-block
/// order, of `C·T·P·P` bytes each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionImage {
    pub grid_h: usize,
    pub grid_w: usize,
    pub bytes: Vec<u8>,
}

impl VisionImage {
    pub fn patches(&self) -> usize {
        self.grid_h * self.grid_w
    }

    /// `image_grid_thw`.
    pub fn grid_thw(&self) -> [usize; 3] {
        [1, self.grid_h, self.grid_w]
    }

    /// Tokens the image takes in the prompt: its patches over `merge²`.
    pub fn tokens(&self, merge: usize) -> usize {
        self.patches() / (merge * merge)
    }
}

/// `smart_resize(height, width, factor, min_pixels, max_pixels)` → `(height, width)`, as
/// transformers computes it in f64 (Python's `round` ties to even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(Error::input(format!(
            "zero-sized image ({width}×{height}) or factor {factor}"
        )));
    }
    let (hf, wf, f) = (height as f64, width as f64, factor as f64);
    let aspect = hf.max(wf) / hf.min(wf);
    if aspect > MAX_ASPECT {
        return Err(Error::input(format!(
            "a {width}×{height} image has an aspect ratio of {aspect}; the Qwen3-VL processor \
             takes at most {MAX_ASPECT}"
        )));
    }
    let round = |v: f64| v.round_ties_even() as usize * factor;
    let (mut h_bar, mut w_bar) = (round(hf / f), round(wf / f));
    if h_bar * w_bar > max_pixels {
        let beta = (hf * wf / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / f).floor() as usize * factor);
        w_bar = factor.max((wf / beta / f).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h_bar = (hf * beta / f).ceil() as usize * factor;
        w_bar = (wf * beta / f).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ImageProcessorConfig {
        let json = include_str!("../../../assets/qwen-image-mini/processor/processor_config.json");
        ImageProcessorConfig::parse(Path::new("processor_config.json"), json).unwrap()
    }

    #[test]
    fn patch_rows_are_merge_block_ordered_and_repeat_the_frame() {
        let cfg = config();
        // A 64×32 image: 4×2 patches, two merge blocks stacked; each byte says where it is.
        let (w, h) = (32, 64);
        let rgb: Vec<u8> = (0..h * w * 3)
            .map(|i| {
                let (y, x, c) = (i / 3 / w, i / 3 % w, i % 3);
                ((y / 16) * 16 + (x / 16) * 4 + c) as u8
            })
            .collect();
        let img = cfg.patchify(&rgb, w, h);
        assert_eq!(img.grid_thw(), [1, 4, 2]);
        let rw = cfg.row_width();
        // Row 2 is block 0's bottom-left patch (patch row 1, column 0); its second frame repeats
        // the first, channel by channel.
        let row = &img.bytes[2 * rw..3 * rw];
        assert!(row[..512].iter().all(|&b| b == 16));
        assert!(row[512..1024].iter().all(|&b| b == 17));
        // Row 4 opens the second block: patch row 2, column 0.
        assert_eq!(img.bytes[4 * rw], 32);
        assert_eq!(img.tokens(cfg.merge), 2);
    }

    #[test]
    fn the_pixel_map_is_the_fused_normalisation() {
        let map = config().pixel_map();
        assert_eq!((map[0], map[255]), (-1.0, 1.0));
        assert_eq!(map[128], 0.5 / 127.5);
    }

    #[test]
    fn unimplemented_settings_are_refused_by_name() {
        let json = include_str!("../../../assets/qwen-image-mini/processor/processor_config.json");
        let lanczos = json.replacen("\"resample\": 3", "\"resample\": 1", 1);
        let e = ImageProcessorConfig::parse(Path::new("p.json"), &lanczos).unwrap_err();
        assert!(e.to_string().contains("image_processor.resample"), "{e}");
        assert!(smart_resize(10, 2500, 32, 4096, 1 << 20).is_err());
    }
}
