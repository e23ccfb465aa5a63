//! Rotary position embeddings as the backends apply them: how a head's channels pair up, and the
//! cos/sin table indexed by per-row positions. How the angles are computed (1-D, 2-D axial,
//! multi-axis) is model knowledge: `tessera_models::blocks::rope`.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use crate::{Backend, Role};

/// How rotary embeddings pair a head's channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Channel `j` pairs with `j + half` (`rotate_half`: Gemma, Qwen3).
    SplitHalf,
    /// Axial 2-D (Gemma 4 vision): positions are `(x, y)` pairs, two `u32` per row. The first
    /// half of each head rotates by x, the second half by y, each half split-half
    /// (`rotate_half` within the half: channel `j` pairs with `j + head_dim/4`). The table holds
    /// `head_dim/4` frequencies, shared by both axes.
    Axial2d,
    /// Channels `2j` and `2j + 1` form one complex number rotated by angle `j` (`view_as_complex`:
    /// Z-Image, Qwen-Image). Multi-axis RoPE is this style with a table whose rows are tokens and
    /// whose angle columns come from different position axes (see `RopeTable::from_angles`).
    Interleaved,
}

/// Rotary-embedding angles for positions `0..len`: `cos` then `sin`, each `[len, half]`
/// (for [`RopeStyle::Axial2d`], `half` is the pairs per axis, `head_dim / 4`).
pub struct RopeTable<B: Backend> {
    pub buf: B::Buf,
    pub len: usize,
    /// Rotated pairs per head (`head_dim / 2` for a full rotation).
    pub half: usize,
    pub style: RopeStyle,
}

impl<B: Backend> RopeTable<B> {
    /// Build the table for `inv_freq` (computed by the caller exactly as the reference does) and
    /// positions `0..len`. The angle is `pos · inv_freq` rounded to `f32` like the reference's
    /// `f32` product; its cosine and sine are then taken in `f64` and rounded once.
    pub fn new(backend: &B, inv_freq: &[f32], len: usize, style: RopeStyle) -> Result<Self> {
        let angles: Vec<f32> = (0..len)
            .flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        Self::from_angles(backend, &angles, len, inv_freq.len(), style)
    }

    /// Positions each row takes (one; an `(x, y)` pair for [`RopeStyle::Axial2d`]), after checking
    /// that the table rotates exactly the pairs a head of `head_dim` has per position axis.
    pub fn positions_per_row(&self, head_dim: usize) -> Result<usize> {
        let (per_row, pairs) = match self.style {
            RopeStyle::SplitHalf | RopeStyle::Interleaved => (1, head_dim / 2),
            RopeStyle::Axial2d => (2, head_dim / 4),
        };
        if self.half != pairs || pairs * 2 * per_row != head_dim {
            return Err(Error::backend(
                "qkv_norm_rope",
                format!(
                    "{:?} rope table of {} pairs for head_dim {head_dim}",
                    self.style, self.half
                ),
            ));
        }
        Ok(per_row)
    }

    /// A table from explicit `f32` angles `[len, half]` (row `r`, pair `j`), for RoPEs whose
    /// angle depends on more than one position (multi-axis: each pair's angle is computed from
    /// its own axis's position by the caller). Cosine and sine are taken in `f64` and rounded once,
    /// as in [`RopeTable::new`].
    pub fn from_angles(
        backend: &B,
        angles: &[f32],
        len: usize,
        half: usize,
        style: RopeStyle,
    ) -> Result<Self> {
        if angles.len() != len * half {
            return Err(Error::backend(
                "rope table",
                format!("{} angles for {len} rows of {half} pairs", angles.len()),
            ));
        }
        let mut host = vec![0f32; 2 * len * half];
        let (cos, sin) = host.split_at_mut(len * half);
        // On every core: a 1,024-position table of EmbeddingGemma 2 is 393,216 f64 sincos, ~15 ms
        // on one core, which a first query used to pay.
        const CHUNK: usize = 1 << 14;
        cos.par_chunks_mut(CHUNK)
            .zip(sin.par_chunks_mut(CHUNK))
            .zip(angles.par_chunks(CHUNK))
            .for_each(|((cos, sin), angles)| {
                for ((c, s), &a) in cos.iter_mut().zip(sin.iter_mut()).zip(angles) {
                    let (sa, ca) = (a as f64).sin_cos();
                    *c = ca as f32;
                    *s = sa as f32;
                }
            });
        let mut buf = backend.alloc(host.len(), Role::Stream)?;
        backend.write_f32(&mut buf, &host)?;
        Ok(RopeTable {
            buf,
            len,
            half,
            style,
        })
    }
}
