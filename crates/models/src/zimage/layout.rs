//! Token layout of one DiT item (spec §3.2–3.3; diffusers `patchify_and_embed`,
//! `_pad_with_ids`, `RopeEmbedder`): patchify/unpatchify, 32-multiple padding, the 3-axis
//! position ids and their RoPE angles.
//!
//! An item's joint sequence is `[image (n_img_p rows) | caption (cap_p rows)]`. Positions:
//! caption row `j` (pad rows included) is `(1 + j, 0, 0)`; image token `(r, c)` is
//! `(cap_p + 1, r, c)` — so the image RoPE depends on the padded caption length; image pad rows
//! are `(0, 0, 0)`.

use tessera_core::{Error, Result};

use super::config::{PATCH, SEQ_MULTIPLE, TransformerConfig};

/// Round up to diffusers' `SEQ_MULTI_OF`.
pub fn pad_to_multiple(n: usize) -> usize {
    n.div_ceil(SEQ_MULTIPLE) * SEQ_MULTIPLE
}

/// Rows of one item in the DiT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemLayout {
    /// Patch grid `(rows, cols)` = latent size / 2.
    pub grid: (usize, usize),
    pub n_img: usize,
    pub n_img_p: usize,
    pub cap_len: usize,
    pub cap_p: usize,
}

impl ItemLayout {
    /// The layout for a latent of `latent_hw` pixels and a caption of `cap_len` tokens, checked
    /// against the position tables' lengths (`axes_lens`).
    pub fn new(cfg: &TransformerConfig, latent_hw: (usize, usize), cap_len: usize) -> Result<Self> {
        let (h, w) = latent_hw;
        if h == 0 || w == 0 || h % PATCH != 0 || w % PATCH != 0 {
            return Err(Error::input(format!(
                "latent of {h}×{w}: both sides must be positive multiples of {PATCH}"
            )));
        }
        if cap_len == 0 {
            return Err(Error::input("the caption has no tokens"));
        }
        let grid = (h / PATCH, w / PATCH);
        let n_img = grid.0 * grid.1;
        let cap_p = pad_to_multiple(cap_len);
        let [len0, len1, len2] = cfg.axes_lens;
        if cap_p + 1 >= len0 {
            return Err(Error::input(format!(
                "a caption of {cap_len} tokens needs RoPE position {} on axis 0, beyond the model's {len0}",
                cap_p + 1
            )));
        }
        if grid.0 > len1 || grid.1 > len2 {
            return Err(Error::input(format!(
                "a {}×{} latent is larger than the model's {}×{} position tables",
                h,
                w,
                len1 * PATCH,
                len2 * PATCH
            )));
        }
        Ok(ItemLayout {
            grid,
            n_img,
            n_img_p: pad_to_multiple(n_img),
            cap_len,
            cap_p,
        })
    }

    /// Rows of the joint sequence.
    pub fn seq_len(&self) -> usize {
        self.n_img_p + self.cap_p
    }

    /// `(axis0, axis1, axis2)` of every joint row, image rows first.
    pub fn positions(&self) -> Vec<[u32; 3]> {
        let mut p = Vec::with_capacity(self.seq_len());
        let start = (self.cap_p + 1) as u32;
        for r in 0..self.grid.0 {
            for c in 0..self.grid.1 {
                p.push([start, r as u32, c as u32]);
            }
        }
        p.resize(self.n_img_p, [0, 0, 0]);
        p.extend((0..self.cap_p).map(|j| [1 + j as u32, 0, 0]));
        p
    }
}

/// `latent[c, 2r+dy, 2c+dx]` → `patches[r·gw + c][(dy·2 + dx)·C + ch]` for a `[channels, h, w]`
/// latent.
pub fn patchify(latent: &[f32], channels: usize, (h, w): (usize, usize)) -> Vec<f32> {
    let (gh, gw) = (h / PATCH, w / PATCH);
    let dim = PATCH * PATCH * channels;
    let mut out = vec![0f32; gh * gw * dim];
    for r in 0..gh {
        for c in 0..gw {
            let row = &mut out[(r * gw + c) * dim..(r * gw + c + 1) * dim];
            for dy in 0..PATCH {
                for dx in 0..PATCH {
                    for ch in 0..channels {
                        row[(dy * PATCH + dx) * channels + ch] =
                            latent[(ch * h + PATCH * r + dy) * w + PATCH * c + dx];
                    }
                }
            }
        }
    }
    out
}

/// The inverse of [`patchify`] on the first `gh·gw` rows.
pub fn unpatchify(patches: &[f32], channels: usize, (h, w): (usize, usize)) -> Vec<f32> {
    let (gh, gw) = (h / PATCH, w / PATCH);
    let dim = PATCH * PATCH * channels;
    let mut out = vec![0f32; channels * h * w];
    for r in 0..gh {
        for c in 0..gw {
            let row = &patches[(r * gw + c) * dim..(r * gw + c + 1) * dim];
            for dy in 0..PATCH {
                for dx in 0..PATCH {
                    for ch in 0..channels {
                        out[(ch * h + PATCH * r + dy) * w + PATCH * c + dx] =
                            row[(dy * PATCH + dx) * channels + ch];
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patchify_round_trips_and_orders_features_dy_dx_channel() {
        let (ch, h, w) = (3, 4, 6);
        let latent: Vec<f32> = (0..ch * h * w).map(|i| i as f32).collect();
        let p = patchify(&latent, ch, (h, w));
        // Token (r=1, c=2), feature (dy=1, dx=0, ch=2) = latent[2, 3, 4].
        assert_eq!(p[(3 + 2) * 12 + 2 * 3 + 2], latent[(2 * h + 3) * w + 4]);
        assert_eq!(unpatchify(&p, ch, (h, w)), latent);
    }
}
