//! Deciding an image's fate from its header, before a pixel buffer exists.
//!
//! The target size, the patch grid and the memory decoding and preprocessing will take all
//! follow from the header's width and height. [`ImageLimits::plan`] works them out and refuses an
//! image the vision tower cannot take (a grid side over its position table) or whose
//! preprocessing would exceed a memory bound, so that a small file claiming a huge or
//! absurdly elongated image costs nothing.

use std::path::Path;

use tessera_core::{Error, Result};

use super::Image;
use super::decode::{Header, read_file};
use super::patches::{ImageBudget, PatchSpec, target_size};
use super::resize::resize_bytes;

/// What an image must satisfy to reach a vision tower, known before it is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    pub spec: PatchSpec,
    pub budget: ImageBudget,
    /// Most patches along either side of the grid (the tower's `position_embedding_size`).
    pub max_grid_side: usize,
    /// Most bytes decoding and preprocessing one image may take (`u64::MAX`: no bound beyond
    /// the pixel limit).
    pub max_bytes: u64,
}

/// An image's way to the vision tower, decided from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImagePlan {
    /// The size it is resized to.
    pub target: (usize, usize),
    /// Its patch grid, `(columns, rows)`.
    pub grid: (usize, usize),
    /// The most bytes decoding and preprocessing hold at once.
    pub peak_bytes: u64,
    /// What stays once it is preprocessed: the RGB image and its patches.
    pub held_bytes: u64,
}

impl ImageLimits {
    /// Plan an image of the header's size, or refuse it with the reason.
    pub fn plan(&self, header: &Header) -> Result<ImagePlan> {
        let (w, h) = (header.width, header.height);
        let (tw, th) = target_size(w, h, self.spec, self.budget)?;
        let grid = (tw / self.spec.patch, th / self.spec.patch);
        if grid.0.max(grid.1) > self.max_grid_side {
            return Err(Error::input(format!(
                "a {w}×{h} image becomes a grid of {}×{} patches, more than the vision tower's {} \
                 positions per side (position_embedding_size); use a smaller image budget or a less \
                 elongated image",
                grid.0, grid.1, self.max_grid_side
            )));
        }
        let rgb = w as u64 * h as u64 * 3;
        let patches = tw as u64 * th as u64 * 3;
        let resize = if (tw, th) == (w, h) {
            0
        } else {
            resize_bytes(w, h, tw, th)
        };
        // Decoding holds the decoder's output and the RGB copy; preprocessing the RGB image,
        // the resize's buffers and the patches.
        let peak_bytes = (header.decode_bytes + rgb).max(rgb + resize + patches);
        if peak_bytes > self.max_bytes {
            return Err(Error::input(format!(
                "a {w}×{h} {} image needs {} MiB to decode and preprocess, more than the limit of {} MiB",
                header.format,
                peak_bytes.div_ceil(1 << 20),
                self.max_bytes >> 20
            )));
        }
        Ok(ImagePlan {
            target: (tw, th),
            grid,
            peak_bytes,
            held_bytes: rgb + patches,
        })
    }

    /// Read, plan and decode an image file: a file refused by its header is never decoded.
    /// Errors name the file.
    pub fn open(&self, path: &Path) -> Result<Image> {
        let named = |e: Error| Error::input(format!("{}: {e}", path.display()));
        let bytes = read_file(path)?;
        let header = Image::header(&bytes).map_err(named)?;
        self.plan(&header).map_err(named)?;
        Image::decode_with(&bytes, &header).map_err(named)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_bytes: u64) -> ImageLimits {
        ImageLimits {
            spec: PatchSpec { patch: 16, pool: 3 },
            budget: ImageBudget::DEFAULT,
            max_grid_side: 10240,
            max_bytes,
        }
    }

    fn grey_png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut out),
            &vec![0; (w * h) as usize],
            w,
            h,
            image::ExtendedColorType::L8,
        )
        .unwrap();
        out
    }

    #[test]
    fn the_plan_follows_from_the_header() {
        let header = Image::header(&grey_png(1980, 756)).unwrap();
        let p = limits(u64::MAX).plan(&header).unwrap();
        assert_eq!((p.target, p.grid), ((1296, 480), (81, 30)));
        let rgb = 1980 * 756 * 3;
        assert_eq!(p.held_bytes, rgb + 1296 * 480 * 3);
        assert!(p.peak_bytes >= rgb + 1980 * 756 && p.peak_bytes < rgb + (16 << 20));
        // The same image under a bound it does not fit.
        let e = limits(4 << 20).plan(&header).unwrap_err().to_string();
        assert!(
            e.contains("1980×756 PNG image needs") && e.contains("limit of 4 MiB"),
            "{e}"
        );
    }

    #[test]
    fn a_grid_wider_than_the_position_table_is_refused_from_the_header() {
        let tower = ImageLimits {
            max_grid_side: 32,
            ..limits(u64::MAX)
        };
        let header = Image::header(&grey_png(3000, 10)).unwrap();
        let e = tower.plan(&header).unwrap_err().to_string();
        assert!(
            e.contains("3000×10 image becomes a grid of 840×3 patches")
                && e.contains("position_embedding_size"),
            "{e}"
        );
    }
}
