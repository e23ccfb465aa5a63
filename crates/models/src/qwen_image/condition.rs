//! Condition images for Qwen-Image-2.1 editing (spec A6), as diffusers 0.42.1's
//! `QwenImage21Pipeline.__call__` prepares them before anything runs on the device:
//!
//! - each image (converted to RGBA) is resized once to about `output_resolution²` pixels with
//!   its own aspect: [`calculate_dimensions`] (`w = √(A·r)`, `h = w / r`, each rounded to a
//!   multiple of 32 with Python's `round`, ties to even), by `VaeImageProcessor.resize`, which is
//!   Pillow's Lanczos on premultiplied RGBA ([`crate::imageproc::pil`]);
//! - the VAE reads that RGBA image, `v/255·2 − 1` per channel
//!   ([`super::vae_encoder::from_rgba8`]); the text encoder reads the same pixels pasted over white
//!   with their alpha as the mask (`_get_qwen_prompt_embeds`: the checkpoint was trained so);
//! - without an explicit size the output takes the **last** condition image's
//!   `calculate_dimensions` size, floored to multiples of 32 (a side that rounds to 0 falls back
//!   to `output_resolution`, as the pipeline's `or` does).
//!
//! What the reference showed beyond the spec: the resize is diffusers'
//! `image_processor.resize(img, width, height)` with `resample="lanczos"` and `reducing_gap=None`
//! on the PIL image, and Pillow converts RGBA to premultiplied `RGBa` itself around the resample
//! (no code in diffusers does), except when the image already has the target size: then Pillow
//! returns a copy, colours under zero alpha included. One resize feeds both copies (the VAE's
//! `preprocess` repeats the identical resize). A side of 0 (an extreme aspect ratio) makes
//! Pillow refuse the resize; here it is an input error naming the sizes.

use tessera_core::{Error, Result};

use super::vae_encoder::from_rgba8;
use crate::imageproc::Image;
use crate::imageproc::pil::{Rgba8, paste_over_white, resize_lanczos};

/// Condition and output sides are multiples of this (the VAE's 16 × one DiT slot's 2).
pub const MULTIPLE: usize = 32;

/// The pipeline's default `output_resolution`: condition images are resized to about its square.
pub const OUTPUT_RESOLUTION: usize = 1024;

/// diffusers' `calculate_dimensions(target_area, ratio)`: `(width, height)` of about
/// `target_area` pixels with `width / height ≈ ratio`, each a multiple of 32 (Python's `round`:
/// half to even). Either may be 0 for extreme ratios.
pub fn calculate_dimensions(target_area: u64, ratio: f64) -> (usize, usize) {
    let width = (target_area as f64 * ratio).sqrt();
    let height = width / ratio;
    let snap = |v: f64| ((v / MULTIPLE as f64).round_ties_even() * MULTIPLE as f64) as usize;
    (snap(width), snap(height))
}

/// The size `(width, height)` one image is resized to for `output_resolution`.
pub fn condition_size(width: usize, height: usize, output_resolution: usize) -> (usize, usize) {
    let area = (output_resolution as u64).pow(2);
    calculate_dimensions(area, width as f64 / height as f64)
}

/// The output size `(width, height)` of an edit without an explicit size: the last condition
/// image's [`condition_size`], floored to multiples of 32, a zero side replaced by
/// `output_resolution` first. `None` without images.
pub fn default_output_size(
    images: &[(usize, usize)],
    output_resolution: usize,
) -> Option<(usize, usize)> {
    let &(w, h) = images.last()?;
    let (cw, ch) = condition_size(w, h, output_resolution);
    let or = |v: usize| if v == 0 { output_resolution } else { v };
    let floor = |v: usize| v / MULTIPLE * MULTIPLE;
    Some((floor(or(cw)), floor(or(ch))))
}

/// One condition image, resized: what the VAE encoder and the vision tower read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// The resized RGBA image (the VAE's copy).
    pub rgba: Rgba8,
    /// The same pixels pasted over white, RGB `[height, width, 3]` (the text encoder's copy).
    pub rgb: Vec<u8>,
}

impl Condition {
    /// Resize `img` for `output_resolution` and make both copies.
    pub fn prepare(img: &Rgba8, output_resolution: usize) -> Result<Self> {
        let (w, h) = condition_size(img.width, img.height, output_resolution);
        if w == 0 || h == 0 {
            return Err(Error::input(format!(
                "a {}×{} condition image resizes to {w}×{h} at output resolution \
                 {output_resolution}: its aspect ratio is too extreme",
                img.width, img.height
            )));
        }
        let rgba = resize_lanczos(img, w, h)?;
        let rgb = paste_over_white(&rgba);
        Ok(Condition { rgba, rgb })
    }

    pub fn width(&self) -> usize {
        self.rgba.width
    }

    pub fn height(&self) -> usize {
        self.rgba.height
    }

    /// The text encoder's copy as the image its processor reads
    /// ([`super::vision::ImageProcessorConfig::preprocess`]).
    pub fn vl_image(&self) -> Result<Image> {
        Image::from_rgb8(self.width(), self.height(), self.rgb.clone())
    }

    /// The VAE encoder's input `[height·width, 4]` in [−1, 1].
    pub fn vae_pixels(&self) -> Vec<f32> {
        from_rgba8(&self.rgba.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_aspect_ratios_are_refused_with_the_sizes() {
        let img = Rgba8::new(400, 1, vec![255; 1600]).unwrap();
        let e = Condition::prepare(&img, 64).unwrap_err().to_string();
        assert!(e.contains("400×1") && e.contains("×0"), "{e}");
        // The output size falls back to the resolution where the pipeline's `or` does.
        assert_eq!(default_output_size(&[(400, 1)], 64), Some((1280, 64)));
        assert_eq!(default_output_size(&[], 64), None);
    }
}
