//! The op set every Tessera model is written against, and its implementations.
//!
//! Model code (crate `tessera-models`) is written once, generic over [`Backend`]; the CPU backend
//! ([`cpu::CpuBackend`]) computes every op in `f32` and is the reference; faster backends
//! implement the same ops and are tested op by op against it.
//!
//! Ops are deliberately coarse (fused norms, fused q|k|v, flash-style attention) so that a model
//! stays one readable file per block type while a GPU backend can still run near the hardware's
//! limit. Ops never allocate: they read and write caller-owned buffers through [`View`] /
//! [`ViewMut`] (row-major 2-D windows with a row stride), so models keep their activations in a
//! workspace sized once per shape.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod spec;
mod view;

pub use device::{AnyBackend, DeviceRequest};
pub use spec::{
    Activation, After, AttnSpec, Conv2d, Epilogue, Grids, GroupNorm, NormKind, QkvLayout, Residual,
    RopeStyle, RowNorm, Segments, offsets_of, stack_rows,
};
pub use tessera_core::{Error, Result};
pub use view::{View, ViewMut};

/// Numeric precision of a backend's activations and GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in `f32`: the exact mode.
    #[default]
    F32,
    /// bf16 weights and GEMM inputs, `f32` accumulation, residual stream and statistics.
    Bf16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(Error::input(format!(
                "unknown precision {s:?} (expected f32 or bf16)"
            ))),
        }
    }
}

/// What an activation buffer holds; the backend chooses the element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Residual stream and other values kept in `f32` whatever the precision.
    Stream,
    /// GEMM inputs and attention operands: bf16 under [`Precision::Bf16`], else `f32`.
    Compute,
    /// Token ids, positions and segment offsets (`u32`).
    Index,
}

/// One forward's worth of fused ops on one device.
///
/// Shapes are in elements. Matrices are row-major `[rows, cols]`; a weight matrix `W` is stored
/// `[out, in]` as in the checkpoints, and `matmul` computes `x · Wᵀ`.
pub trait Backend: Send + Sync {
    /// An activation buffer.
    type Buf: Send + Sync;
    /// A weight matrix `[out, in]`, uploaded once; several matrices sharing an input may be
    /// stacked along `out` (q|k|v, gate|up) so one GEMM computes them all.
    type Mat: Send + Sync;
    /// A parameter vector (norm weights), kept in `f32`.
    type Vector: Send + Sync;
    /// An embedding table read by row.
    type Table: Send + Sync;

    /// One line: device, precision.
    fn describe(&self) -> String;
    fn precision(&self) -> Precision;

    // ---- memory -------------------------------------------------------------------------
    fn alloc(&self, len: usize, role: Role) -> Result<Self::Buf>;
    /// Copy `src` into the start of `dst` (converted to `dst`'s element type).
    fn write_f32(&self, dst: &mut Self::Buf, src: &[f32]) -> Result<()>;
    fn write_u32(&self, dst: &mut Self::Buf, src: &[u32]) -> Result<()>;
    /// Copy the bytes of `parts`, one after another, into the start of `dst` as the values
    /// `map[byte]` (image pixels: a quarter of the host memory of their `f32` values, which a
    /// backend need never build).
    fn write_u8_mapped(
        &self,
        dst: &mut Self::Buf,
        parts: &[&[u8]],
        map: &[f32; 256],
    ) -> Result<()> {
        let values: Vec<f32> = parts
            .iter()
            .flat_map(|p| p.iter().map(|&b| map[b as usize]))
            .collect();
        self.write_f32(dst, &values)
    }
    /// Read a view back as `f32`; waits for queued work.
    fn read_f32(&self, src: View<'_, Self>) -> Result<Vec<f32>>
    where
        Self: Sized;

    /// Upload weight matrices stacked along `out`: each part is `[out_i, inner]` row-major `f32`.
    fn matrix(&self, parts: &[(&[f32], usize)], inner: usize) -> Result<Self::Mat>;
    fn vector(&self, v: &[f32]) -> Result<Self::Vector>;
    /// The embedding table `name` `[rows, dim]` of a checkpoint (the CPU keeps it memory-mapped
    /// in its stored dtype and converts rows on lookup).
    fn table(
        &self,
        weights: &tessera_core::Weights,
        name: &str,
        shape: [usize; 2],
    ) -> Result<Self::Table>;
    /// Segment storage for up to `max_rows` rows in up to `max_segs` segments (see [`Segments`]).
    fn alloc_segments(&self, max_rows: usize, max_segs: usize) -> Result<Segments<Self>>
    where
        Self: Sized,
    {
        Ok(Segments {
            offsets: vec![0],
            dev: self.alloc(max_segs + 1, Role::Index)?,
            max_rows,
            max_segs,
            tiles: 0,
        })
    }

    /// Refill `segs` for sequences of `lens` rows, packed back to back.
    fn set_segments(&self, segs: &mut Segments<Self>, lens: &[usize]) -> Result<()>
    where
        Self: Sized,
    {
        let offsets = offsets_of(lens, segs.max_rows, segs.max_segs)?;
        self.write_u32(&mut segs.dev, &offsets)?;
        segs.offsets = offsets;
        Ok(())
    }

    /// Segments sized exactly for `lens` (tests and one-off passes).
    fn segments(&self, lens: &[usize]) -> Result<Segments<Self>>
    where
        Self: Sized,
    {
        let mut s = self.alloc_segments(lens.iter().sum(), lens.len())?;
        self.set_segments(&mut s, lens)?;
        Ok(s)
    }

    /// Run `work`, which only enqueues device work on buffers that stay where they are (no
    /// allocation, no host reads). A backend may capture it into a graph under `key` and replay
    /// that graph when the same key comes again; the default just runs it.
    fn run_graph(&self, key: u64, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = key;
        work()
    }

    // ---- ops ----------------------------------------------------------------------------

    /// `out[r] = table[ids[r]] · scale` for `out.rows` ids.
    fn embed(
        &self,
        table: &Self::Table,
        ids: &Self::Buf,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = ep.alpha · x · wᵀ` for `w` `[out.cols, x.cols]`.
    fn matmul(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        out: ViewMut<'_, Self>,
        ep: Epilogue,
    ) -> Result<()>
    where
        Self: Sized;

    /// Row-wise RMSNorm: `out = x · (mean(x²) + eps)^-½ · w` (no `w`: weightless).
    fn rms_norm(
        &self,
        x: View<'_, Self>,
        w: Option<&Self::Vector>,
        eps: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = x`, converted to `out`'s element type (a `Stream` value becoming a GEMM input).
    fn cast(&self, x: View<'_, Self>, out: ViewMut<'_, Self>) -> Result<()>
    where
        Self: Sized;

    /// The sandwich-norm residual step, fused: `h = (h + N_post(y)) · scale`, then `after`
    /// (the next block's pre-norm of `h`, or a copy of `h` as a GEMM input).
    fn residual_norm(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        post: Option<&Self::Vector>,
        scale: f32,
        after: After<'_, Self>,
        eps: f32,
    ) -> Result<()>
    where
        Self: Sized;

    /// In place on a packed `[tokens, q|k|v]` buffer: per-head RMSNorm of q and k (with weights
    /// `[head_dim]`), of v when `v_norm` (weightless), then RoPE on q and k at `positions`.
    #[allow(clippy::too_many_arguments)]
    fn qkv_norm_rope(
        &self,
        qkv: ViewMut<'_, Self>,
        layout: QkvLayout,
        q_w: Option<&Self::Vector>,
        k_w: Option<&Self::Vector>,
        v_norm: bool,
        eps: f32,
        rope: Option<(&RopeTable<Self>, &Self::Buf)>,
    ) -> Result<()>
    where
        Self: Sized;

    /// Attention within each segment of a packed batch (no padding):
    /// `out = softmax(scale · q kᵀ + mask) v` per head, K/V heads shared by groups of q heads.
    fn attention(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec,
        segs: &Segments<Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = act(gate) ⊙ up`.
    fn gated(
        &self,
        gate: View<'_, Self>,
        up: View<'_, Self>,
        out: ViewMut<'_, Self>,
        act: Activation,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out[s] = mean of x's rows in segment s`.
    fn segment_mean(
        &self,
        x: View<'_, Self>,
        segs: &Segments<Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    // ---- vision -------------------------------------------------------------------------

    /// An embedding table stored with leading axes, read as rows of its last axis: `shape`
    /// (checked against the checkpoint) is seen as `[∏ shape[..n−1], shape[n−1]]`. For the
    /// vision position table `[2, P, H]`: rows `0..P` are the x table, `P..2P` the y table.
    fn table_nd(
        &self,
        weights: &tessera_core::Weights,
        name: &str,
        shape: &[usize],
    ) -> Result<Self::Table>;

    /// Learned 2-D positions, in place: `x[r] += table[pos[2r]] + table[axis_rows + pos[2r+1]]`
    /// (the two table rows summed first), for `pos` holding `(x, y)` pairs, two `u32` per row.
    /// Every `x` and `y` must be below `axis_rows`.
    fn add_positions_2d(
        &self,
        table: &Self::Table,
        axis_rows: usize,
        pos: &Self::Buf,
        x: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `k × k` average pooling of each image's patch grid (`k = grids.kernel`), times `scale`:
    /// pooled cell `(cx, cy)` of image `i` is row `first_pooled_i + cy·(width_i/k) + cx` of
    /// `out`, the mean of patches `(cx·k + dx, cy·k + dy)` for `dx, dy < k`, then `· scale`.
    /// `x` has `grids.patches()` rows, `out` `grids.pooled()`.
    fn avg_pool2d(
        &self,
        x: View<'_, Self>,
        grids: &Grids<Self>,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `dst[rows[i]] = src[i]` for every row `i` of `src` (converted to `dst`'s element type);
    /// the other rows of `dst` are untouched. Media soft tokens replace their placeholder rows.
    fn scatter_rows(
        &self,
        src: View<'_, Self>,
        rows: &Self::Buf,
        dst: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// Grid descriptors for images of `dims` `(width, height)` patches pooled `kernel × kernel`.
    fn grids(&self, dims: &[(usize, usize)], kernel: usize) -> Result<Grids<Self>>
    where
        Self: Sized,
    {
        if kernel == 0 {
            return Err(Error::input("pooling kernel of 0"));
        }
        let mut host = Vec::with_capacity(dims.len() * 4);
        let (mut first, mut pooled) = (0usize, 0usize);
        for &(w, h) in dims {
            if w % kernel != 0 || h % kernel != 0 {
                return Err(Error::input(format!(
                    "a {w}×{h} patch grid cannot be pooled {kernel}×{kernel}"
                )));
            }
            for v in [first, w, h, pooled] {
                host.push(u32::try_from(v).map_err(|_| Error::input("too many patches"))?);
            }
            first += w * h;
            pooled += w * h / (kernel * kernel);
        }
        let mut dev = self.alloc(host.len().max(1), Role::Index)?;
        self.write_u32(&mut dev, &host)?;
        Ok(Grids {
            dims: dims.to_vec(),
            kernel,
            dev,
        })
    }

    // ---- image generation (Z-Image) ----

    /// A whole `nn.Linear`, optionally followed by an activation: `out = act(x · wᵀ + bias)` for
    /// `w` `[out.cols, x.cols]` and `bias` `[out.cols]` broadcast over rows. Used where biases
    /// exist (DiT embedders, adaLN, timestep MLP, VAE attention).
    fn linear(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        bias: Option<&Self::Vector>,
        act: Option<Activation>,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// Row normalisation with adaLN modulation: `out = N(x) · w · (1 + scale)` (see [`RowNorm`];
    /// statistics in at least `f32`).
    fn norm(
        &self,
        x: View<'_, Self>,
        norm: &RowNorm<'_, Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// The residual step of pre-norm and sandwich-norm blocks, fused:
    /// `h += tanh(gate) · post(y)` (see [`Residual`]), then, if `next` is given,
    /// `out = next(h)` — the following sub-block's (modulated) pre-norm.
    fn residual_add(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        res: &Residual<'_, Self>,
        next: Option<(&RowNorm<'_, Self>, ViewMut<'_, Self>)>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = conv(x) + bias` over one channels-last image (see [`Conv2d`] for the layouts):
    /// `x` `[height · width, in]`, `w` `[out, k · k · in]`, `out` `[out_h · out_w, out]`.
    fn conv2d(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        bias: &Self::Vector,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = act(GroupNorm(x) · weight + bias)` over one channels-last image `[pixels, channels]`
    /// (see [`GroupNorm`]; statistics accumulated in at least `f32`).
    fn group_norm(
        &self,
        x: View<'_, Self>,
        weight: &Self::Vector,
        bias: &Self::Vector,
        spec: &GroupNorm,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;
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
        let half = inv_freq.len();
        let mut host = vec![0f32; 2 * len * half];
        let (cos, sin) = host.split_at_mut(len * half);
        for p in 0..len {
            for (j, &f) in inv_freq.iter().enumerate() {
                let angle = (p as f32 * f) as f64;
                cos[p * half + j] = angle.cos() as f32;
                sin[p * half + j] = angle.sin() as f32;
            }
        }
        let mut buf = backend.alloc(host.len(), Role::Stream)?;
        backend.write_f32(&mut buf, &host)?;
        Ok(RopeTable {
            buf,
            len,
            half,
            style,
        })
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
        for ((c, s), &a) in cos.iter_mut().zip(sin.iter_mut()).zip(angles) {
            let a = a as f64;
            *c = a.cos() as f32;
            *s = a.sin() as f32;
        }
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
