//! Small descriptors passed to ops, so launchers take a struct rather than a row of integers.

use crate::{Backend, View, ViewMut};

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
    /// Channels `2j` and `2j + 1` form one complex number rotated by angle `j` (`view_as_complex`:
    /// Z-Image, Qwen-Image). Multi-axis RoPE is this style with a table whose rows are tokens and
    /// whose angle columns come from different position axes (see `RopeTable::from_angles`).
    Interleaved,
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

impl AttnSpec {
    /// Every backend's shape check: q/out `[total, heads_q·head_dim]`, k/v `[total,
    /// heads_kv·head_dim]`, whole groups of q heads per kv head.
    pub fn check<B: Backend>(
        &self,
        q: &View<'_, B>,
        k: &View<'_, B>,
        v: &View<'_, B>,
        out: &ViewMut<'_, B>,
        total: usize,
    ) -> tessera_core::Result<()> {
        let hd = self.head_dim;
        let ok = self.heads_kv > 0
            && self.heads_q.is_multiple_of(self.heads_kv)
            && q.cols == self.heads_q * hd
            && out.cols == q.cols
            && k.cols == self.heads_kv * hd
            && v.cols == k.cols
            && [q.rows, k.rows, v.rows, out.rows]
                .iter()
                .all(|&r| r == total);
        if ok {
            return Ok(());
        }
        Err(tessera_core::Error::backend(
            "attention",
            format!(
                "q {}×{}, k {}×{}, v {}×{}, out {}×{} for {} q heads / {} kv heads of {hd} over {total} rows",
                q.rows,
                q.cols,
                k.rows,
                k.cols,
                v.rows,
                v.cols,
                out.rows,
                out.cols,
                self.heads_q,
                self.heads_kv
            ),
        ))
    }
}

/// Weight matrices `[out_i, inner]` stacked along `out` (q|k|v, gate|up), as every backend's
/// `matrix` takes them; checks each part's size. Returns the rows and the stacked values.
pub fn stack_rows(
    parts: &[(&[f32], usize)],
    inner: usize,
) -> tessera_core::Result<(usize, Vec<f32>)> {
    let out: usize = parts.iter().map(|p| p.1).sum();
    let mut data = Vec::with_capacity(out * inner);
    for (values, rows) in parts {
        if values.len() != rows * inner {
            return Err(tessera_core::Error::backend(
                "matrix",
                format!("part has {} values, expected {rows}×{inner}", values.len()),
            ));
        }
        data.extend_from_slice(values);
    }
    Ok((out, data))
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

    /// Every backend's shape check for `avg_pool2d`: `x` `[patches, cols]` into `out`
    /// `[pooled, cols]`, every grid side a multiple of the kernel.
    pub fn check(&self, x: (usize, usize), out: (usize, usize)) -> tessera_core::Result<()> {
        let k = self.kernel;
        if k == 0
            || x.0 != self.patches()
            || out.0 != self.pooled()
            || out.1 != x.1
            || self
                .dims
                .iter()
                .any(|&(w, h)| !w.is_multiple_of(k) || !h.is_multiple_of(k))
        {
            return Err(tessera_core::Error::backend(
                "avg_pool2d",
                format!(
                    "{}×{} patches into {}×{} for grids {:?} pooled {k}×{k}",
                    x.0, x.1, out.0, out.1, self.dims
                ),
            ));
        }
        Ok(())
    }
}

// ---- image generation (Z-Image) ----

/// Which statistic a [`RowNorm`] removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `x · (mean(x²) + eps)^-½`.
    Rms,
    /// `(x − mean(x)) · (var(x) + eps)^-½`, the biased variance (`nn.LayerNorm`).
    Layer,
}

/// A per-row normalisation with an optional weight and an optional adaLN modulation:
/// `N(x) · w · (1 + scale)`.
pub struct RowNorm<'a, B: Backend> {
    pub kind: NormKind,
    /// Per-column weight (`None`: no affine weight).
    pub weight: Option<&'a B::Vector>,
    pub eps: f32,
    /// One row `[1, cols]` of raw adaLN scales `s`, broadcast over all rows and applied as
    /// `(1 + s)` — the form DiTs without shift terms use. `None`: no modulation.
    pub scale: Option<View<'a, B>>,
}

impl<B: Backend> Clone for RowNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for RowNorm<'_, B> {}

impl<'a, B: Backend> RowNorm<'a, B> {
    /// RMSNorm with a weight and no modulation.
    pub fn rms(weight: &'a B::Vector, eps: f32) -> Self {
        RowNorm {
            kind: NormKind::Rms,
            weight: Some(weight),
            eps,
            scale: None,
        }
    }

    /// The same norm followed by `(1 + scale)`.
    pub fn modulated(self, scale: View<'a, B>) -> Self {
        RowNorm {
            scale: Some(scale),
            ..self
        }
    }
}

/// How `residual_add` folds a branch output `y` into the residual stream `h`:
/// `h += tanh(gate) · post(y)`.
pub struct Residual<'a, B: Backend> {
    /// Normalise the branch output before adding it (the "sandwich" post-norm); `None` adds `y`
    /// as is. Its `scale` must be `None`.
    pub post: Option<RowNorm<'a, B>>,
    /// One row `[1, cols]` of raw adaLN gates `g`, broadcast over all rows and applied as
    /// `tanh(g)`. `None`: a gate of 1.
    pub tanh_gate: Option<View<'a, B>>,
}

impl<B: Backend> Residual<'_, B> {
    /// `h += y`.
    pub fn plain() -> Self {
        Residual {
            post: None,
            tanh_gate: None,
        }
    }
}

/// A "same" 2-D convolution (stride 1, zero padding `kernel / 2`) over one channels-last image
/// stored as a `[height · width, channels]` view (row `y · width + x`).
///
/// The weight is a matrix `[out_channels, kernel · kernel · in_channels]` whose columns run over
/// `(ky, kx, c_in)` with `c_in` fastest — PyTorch's `[out, in, kh, kw]` weight transposed to
/// `[out, kh, kw, in]` at load — so that the convolution is an implicit GEMM over the input's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2d {
    /// Input image size in pixels.
    pub height: usize,
    pub width: usize,
    /// Square kernel side: 1 or an odd number.
    pub kernel: usize,
    /// Upsample the input 2× by nearest neighbour first (fused: the upsampled image is never
    /// stored), so the output is `2·height × 2·width`. This is `Upsample2D`'s interpolate + conv.
    pub upsample: bool,
}

impl Conv2d {
    /// Output size in pixels.
    pub fn out_size(&self) -> (usize, usize) {
        let s = if self.upsample { 2 } else { 1 };
        (self.height * s, self.width * s)
    }
}

/// `nn.GroupNorm` over one channels-last image `[pixels, channels]`: statistics per group of
/// `channels / groups` consecutive channels over all pixels, then the affine weight and bias,
/// then an optional activation (the VAE's GroupNorm → SiLU pairs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNorm {
    pub groups: usize,
    pub eps: f32,
    pub act: Option<Activation>,
}
