//! Small descriptors passed to ops, so launchers take a struct rather than a row of integers.

use crate::{Backend, ViewMut};

/// Extra work folded into a GEMM.
#[derive(Clone, Copy, Debug)]
pub struct Epilogue {
    /// Multiplies the product.
    pub alpha: f32,
}

impl Default for Epilogue {
    fn default() -> Self {
        Epilogue { alpha: 1.0 }
    }
}

impl Epilogue {
    pub fn scaled(alpha: f32) -> Self {
        Epilogue { alpha }
    }
}

/// Gate activations for `gated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `x·σ(x)`.
    Silu,
}

/// How rotary embeddings pair a head's channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Channel `j` pairs with `j + half` (`rotate_half`: Gemma, Qwen3).
    SplitHalf,
    /// Axial 2-D (Gemma 4 vision): positions are `(x, y)` pairs, two `u32` per row. The first
    /// half of each head rotates by x, the second half by y, each half split-half
    /// (`rotate_half` within the half: channel `j` pairs with `j + head_dim/4`). The table holds
    /// `head_dim/4` frequencies, shared by both axes.
    Axial2d,
}

/// The column layout of a packed q|k|v row: `heads_q` q heads, then `heads_kv` k heads, then
/// `heads_kv` v heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvLayout {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

impl QkvLayout {
    pub fn q_cols(&self) -> usize {
        self.heads_q * self.head_dim
    }
    pub fn kv_cols(&self) -> usize {
        self.heads_kv * self.head_dim
    }
    pub fn width(&self) -> usize {
        self.q_cols() + 2 * self.kv_cols()
    }
}

/// Attention parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnSpec {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Multiplies `q·kᵀ` (1.0 for Gemma 4-style models, which norm q and k instead).
    pub scale: f32,
    /// Sliding window as an inclusive radius: key `j` is visible to query `i` iff `|i − j| ≤ w`.
    pub window: Option<usize>,
    /// Key `j` visible to query `i` only if `j ≤ i`.
    pub causal: bool,
}

/// Packed sequences: segment `s` covers rows `offsets[s]..offsets[s + 1]`.
///
/// Allocated once for a capacity and refilled per pass, so its device copy stays at one address
/// (work captured into a CUDA graph keeps pointing at it).
pub struct Segments<B: Backend> {
    /// Host copy (`count + 1` entries, starting at 0).
    pub offsets: Vec<u32>,
    /// Device copy of the offsets, followed by backend-specific work items (CUDA: query tiles).
    pub dev: B::Buf,
    /// Capacity the device buffer was sized for.
    pub max_rows: usize,
    pub max_segs: usize,
    /// Number of backend-specific work items stored after the offsets.
    pub tiles: usize,
}

impl<B: Backend> Segments<B> {
    pub fn count(&self) -> usize {
        self.offsets.len() - 1
    }
    pub fn total(&self) -> usize {
        *self.offsets.last().unwrap_or(&0) as usize
    }
    pub fn max_len(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }
    /// `(start, end)` row ranges.
    pub fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.offsets
            .windows(2)
            .map(|w| (w[0] as usize, w[1] as usize))
    }
}

/// Offsets `[0, l0, l0 + l1, …]` of `lens`, checked against a capacity.
pub fn offsets_of(
    lens: &[usize],
    max_rows: usize,
    max_segs: usize,
) -> tessera_core::Result<Vec<u32>> {
    let total: usize = lens.iter().sum();
    if lens.len() > max_segs || total > max_rows || total > u32::MAX as usize {
        return Err(tessera_core::Error::backend(
            "segments",
            format!(
                "{} segments of {total} rows exceed the capacity of {max_segs} segments / {max_rows} rows",
                lens.len()
            ),
        ));
    }
    let mut offsets = Vec::with_capacity(lens.len() + 1);
    let mut acc = 0u32;
    offsets.push(0);
    for &l in lens {
        acc += l as u32;
        offsets.push(acc);
    }
    Ok(offsets)
}

/// What `residual_norm` writes besides the updated residual stream.
pub enum After<'a, B: Backend> {
    Nothing,
    /// `out = N_w(h)`: the next block's pre-norm.
    Norm(&'a B::Vector, ViewMut<'a, B>),
    /// `out = h`, in `out`'s element type.
    Copy(ViewMut<'a, B>),
}

/// Images packed back to back, each a row-major grid of patches (patch `(x, y)` of image `i` is
/// row `first_i + y·width_i + x`), for per-image pooling.
pub struct Grids<B: Backend> {
    /// Host copy: `(width, height)` of each image in patches.
    pub dims: Vec<(usize, usize)>,
    /// Side of the square pooling window; every width and height is a multiple of it.
    pub kernel: usize,
    /// Device copy: four `u32` per image: first patch row, width, height, first pooled row.
    pub dev: B::Buf,
}

impl<B: Backend> Grids<B> {
    /// `(first patch row, width, height, first pooled row)` of each image.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let k2 = self.kernel * self.kernel;
        self.dims.iter().scan((0, 0), move |(p, o), &(w, h)| {
            let item = (*p, w, h, *o);
            *p += w * h;
            *o += w * h / k2;
            Some(item)
        })
    }
    /// Patch rows in all images.
    pub fn patches(&self) -> usize {
        self.dims.iter().map(|&(w, h)| w * h).sum()
    }
    /// Pooled rows in all images.
    pub fn pooled(&self) -> usize {
        self.patches() / (self.kernel * self.kernel)
    }
}
