//! The Gemma 4 image processor (transformers 5.25 `Gemma4ImageProcessor`, spec
//! `shared/specs/egemma2.md` §2.1): the aspect-preserving target size for a soft-token budget,
//! the resize, rescaling, and the patches in row-major order with their (x, y) positions.

use std::str::FromStr;
use std::sync::Arc;

use tessera_core::{Error, Result};

use super::{Image, resize_bicubic_aa};

/// Soft tokens an image may become (`max_soft_tokens`): one of 70, 140, 280, 560, 1120.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ImageBudget(usize);

impl ImageBudget {
    /// The budgets the reference processor accepts.
    pub const ALLOWED: [usize; 5] = [70, 140, 280, 560, 1120];
    /// The image processor's class default (and the release `processor_config.json`'s value).
    pub const DEFAULT: ImageBudget = ImageBudget(280);

    pub fn new(soft_tokens: usize) -> Result<Self> {
        if Self::ALLOWED.contains(&soft_tokens) {
            Ok(ImageBudget(soft_tokens))
        } else {
            Err(Error::input(format!(
                "image budget {soft_tokens} is not one of 70, 140, 280, 560, 1120 soft tokens"
            )))
        }
    }

    /// The largest number of soft tokens an image may produce.
    pub fn soft_tokens(self) -> usize {
        self.0
    }
}

impl FromStr for ImageBudget {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let n = s.trim().parse().map_err(|_| {
            Error::input(format!(
                "image budget {s:?} is not one of 70, 140, 280, 560, 1120"
            ))
        })?;
        Self::new(n)
    }
}

impl std::fmt::Display for ImageBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The vision tower's patch geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatchSpec {
    /// Side of a square patch in pixels (16 in the release).
    pub patch: usize,
    /// Side of the square of patches pooled into one soft token (3 in the release).
    pub pool: usize,
}

/// The size `(width, height)` an image of `width × height` is resized to (transformers
/// `get_aspect_ratio_preserving_size`): the largest size with sides multiples of `pool·patch`
/// and at most `9·budget` patches, preserving the aspect ratio; a side that rounds to zero
/// becomes one block and the other is capped at `budget` blocks. Images are scaled up or down.
pub fn target_size(
    width: usize,
    height: usize,
    spec: PatchSpec,
    budget: ImageBudget,
) -> Result<(usize, usize)> {
    let max_patches = budget.soft_tokens() * spec.pool * spec.pool;
    let target_px = max_patches * spec.patch * spec.patch;
    let side = spec.pool * spec.patch;
    let factor = (target_px as f64 / (height * width) as f64).sqrt();
    let mut th = ((factor * height as f64) / side as f64).floor() as usize * side;
    let mut tw = ((factor * width as f64) / side as f64).floor() as usize * side;
    if th == 0 && tw == 0 {
        return Err(Error::input(format!(
            "a {width}×{height} image would be resized to 0×0"
        )));
    }
    let max_side = (max_patches / (spec.pool * spec.pool)) * side;
    if th == 0 {
        th = side;
        tw = ((width as f64 / height as f64).floor() as usize * side).min(max_side);
    } else if tw == 0 {
        tw = side;
        th = ((height as f64 / width as f64).floor() as usize * side).min(max_side);
    }
    if th * tw > target_px {
        return Err(Error::input(format!(
            "a {width}×{height} image resized to {tw}×{th} exceeds {max_patches} patches"
        )));
    }
    Ok((tw, th))
}

/// One image as the vision tower's input.
#[derive(Clone, Debug)]
pub struct Patches {
    /// Grid size in patches.
    pub width: usize,
    pub height: usize,
    /// `[width·height, 3·patch²]`: the resized image's bytes in patches, row-major
    /// (`y·width + x`), each flattened `(dy, dx, channel)`. The tower's input value of byte `v`
    /// is [`pixel_value`]`(v)`; bytes keep a pass's host memory a quarter of its values'.
    pub pixels: Vec<u8>,
}

impl Patches {
    pub fn len(&self) -> usize {
        self.width * self.height
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Soft tokens after `pool × pool` pooling.
    pub fn soft_tokens(&self, pool: usize) -> usize {
        (self.width / pool) * (self.height / pool)
    }
    /// `(x, y)` of every patch, in order.
    pub fn positions(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0..self.height).flat_map(move |y| (0..self.width).map(move |x| (x as u32, y as u32)))
    }
}

/// The processor's `rescale_factor`, rounded to `f32` as torch does for `uint8 · 1/255`.
const RESCALE: f32 = (1.0f64 / 255.0) as f32;

/// The vision tower's input value of pixel byte `v`: `2·(v·(1/255) − ½)` in `f32`, the
/// processor's rescale followed by the patch embedder's `2·(x − 0.5)`, in the reference's order.
pub fn pixel_value(v: u8) -> f32 {
    2.0 * (v as f32 * RESCALE - 0.5)
}

/// [`pixel_value`] of every byte.
pub fn pixel_values() -> [f32; 256] {
    std::array::from_fn(|v| pixel_value(v as u8))
}

/// Cut an image whose sides are multiples of `patch` into patches, one row of patches per task
/// (serially a 912×672 image took 0.6 ms on the 2-core build machine, mostly first-touching the
/// output's pages; the one-image path waits for it).
pub fn patchify(img: &Image, patch: usize) -> Patches {
    use rayon::prelude::*;
    let (pw, ph) = (img.width() / patch, img.height() / patch);
    let (row, rgb) = (img.width() * 3, img.rgb());
    let (line, one) = (patch * 3, patch * patch * 3);
    let mut pixels = vec![0u8; ph * pw * one];
    if !pixels.is_empty() {
        pixels
            .par_chunks_exact_mut(pw * one)
            .enumerate()
            .for_each(|(py, out)| {
                for (px, dst) in out.chunks_exact_mut(one).enumerate() {
                    for (dy, d) in dst.chunks_exact_mut(line).enumerate() {
                        let start = (py * patch + dy) * row + px * line;
                        d.copy_from_slice(&rgb[start..start + line]);
                    }
                }
            });
    }
    Patches {
        width: pw,
        height: ph,
        pixels,
    }
}

/// Resize to the budget's target size and cut into patches (or share the patches
/// [`Image::prepare`] made, without a copy).
pub fn preprocess(img: &Image, spec: PatchSpec, budget: ImageBudget) -> Result<Arc<Patches>> {
    if let Some(p) = img.prepared(spec, budget) {
        return Ok(Arc::clone(p));
    }
    let (tw, th) = target_size(img.width(), img.height(), spec, budget)?;
    if (tw, th) == (img.width(), img.height()) {
        return Ok(Arc::new(patchify(img, spec.patch)));
    }
    Ok(Arc::new(patchify(
        &resize_bicubic_aa(img, tw, th)?,
        spec.patch,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELEASE: PatchSpec = PatchSpec { patch: 16, pool: 3 };

    #[test]
    fn spec_examples() {
        // shared/specs/egemma2.md §2.1, from the reference processor.
        for (b, side) in [(70, 384), (140, 528), (280, 768), (560, 1104), (1120, 1584)] {
            let budget = ImageBudget::new(b).unwrap();
            assert_eq!(
                target_size(512, 512, RELEASE, budget).unwrap(),
                (side, side)
            );
        }
        let b280 = ImageBudget::DEFAULT;
        assert_eq!(target_size(1980, 756, RELEASE, b280).unwrap(), (1296, 480));
        assert_eq!(target_size(530, 941, RELEASE, b280).unwrap(), (576, 1056));
        let b140 = ImageBudget::new(140).unwrap();
        assert_eq!(target_size(640, 360, RELEASE, b140).unwrap(), (720, 384));
    }

    #[test]
    fn budgets_outside_the_set_are_refused() {
        for bad in ["0", "71", "281", "-1", "lots", "2240"] {
            let e = bad.parse::<ImageBudget>().unwrap_err().to_string();
            assert!(e.contains("70, 140, 280, 560, 1120"), "{e}");
        }
        assert_eq!("560".parse::<ImageBudget>().unwrap().soft_tokens(), 560);
    }

    #[test]
    fn prepared_patches_are_reused_for_their_settings_only() {
        let rgb: Vec<u8> = (0..100 * 60 * 3).map(|i| (i % 253) as u8).collect();
        let spec = PatchSpec { patch: 4, pool: 3 };
        let (b70, b140) = (
            ImageBudget::new(70).unwrap(),
            ImageBudget::new(140).unwrap(),
        );
        let mut img = Image::from_rgb8(100, 60, rgb).unwrap();
        let want = preprocess(&img, spec, b70).unwrap();
        img.prepare(spec, b70).unwrap();
        assert_eq!(
            img.prepared(spec, b70).map(|p| &p.pixels),
            Some(&want.pixels)
        );
        assert!(img.prepared(spec, b140).is_none());
        assert_eq!(preprocess(&img, spec, b70).unwrap().pixels, want.pixels);
        // Shared, not copied.
        let shared = preprocess(&img, spec, b70).unwrap();
        assert!(Arc::ptr_eq(&shared, img.prepared(spec, b70).unwrap()));
        assert_ne!(preprocess(&img, spec, b140).unwrap().len(), want.len());
    }

    #[test]
    fn patches_are_row_major_and_rescaled() {
        let (w, h) = (8, 4);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 256) as u8).collect();
        let img = Image::from_rgb8(w, h, rgb.clone()).unwrap();
        let p = patchify(&img, 2);
        assert_eq!((p.width, p.height, p.pixels.len()), (4, 2, 8 * 12));
        let (px, py, dx, dy, c) = (3, 1, 0, 1, 2);
        let idx = (py * 4 + px) * 12 + (dy * 2 + dx) * 3 + c;
        let v = rgb[(py * 2 + dy) * w * 3 + (px * 2 + dx) * 3 + c];
        assert_eq!(p.pixels[idx], v);
        assert_eq!(pixel_value(v), 2.0 * (v as f32 * RESCALE - 0.5));
        assert_eq!(pixel_values()[v as usize], pixel_value(v));
        assert_eq!(p.positions().nth(7), Some((3, 1)));
    }
}
