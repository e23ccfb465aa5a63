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
pub mod op;
mod view;

pub use device::{AnyBackend, BackendFn, DeviceRequest};
pub use op::{
    Activation, After, AttnSpec, AvgDown, CacheWrite, Conv2d, ConvSeq, DupUp, Epilogue, Gate,
    Grids, GroupNorm, KvRanges, Mask, NormKind, Op, OpKind, QkvLayout, QkvNorm, Residual,
    RopeStyle, RopeTable, RowNorm, Run, Segments, ShortConv, ThenResidual, block_causal_limits,
    offsets_of,
};
pub use tessera_core::{Error, Result, Tensor};
pub use view::{View, ViewMut};

/// Bytes of host memory available to a new allocation (`MemAvailable` of `/proc/meminfo`), or
/// `None` where the system does not say: what a buffer on the CPU, whose backend keeps no
/// budget, is checked against before it is allocated (an allocation that fails aborts).
pub fn host_memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What [`Backend::argmax_rows`] gives a row holding a NaN.
pub const NAN_ROW: u32 = u32::MAX;

/// The index of the first largest value of `row` (the first `i` with `row[i] > ` every earlier
/// value, starting from −∞: 0 when no value is above −∞), or [`NAN_ROW`] if `row` holds a NaN:
/// greedy decoding's rule, the reference of [`Backend::argmax_rows`].
pub fn first_argmax(row: &[f32]) -> u32 {
    if row.iter().any(|v| v.is_nan()) {
        return NAN_ROW;
    }
    let best =
        row.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        );
    best.0 as u32
}

/// The call [`Backend::argmax_rows`] takes: rows of at least one value, whose indices and
/// [`NAN_ROW`] fit a `u32`, into an index buffer of `out_len` values.
pub(crate) fn check_argmax_rows(rows: usize, cols: usize, out_len: usize) -> Result<()> {
    if cols == 0 || cols >= NAN_ROW as usize || out_len < rows {
        return Err(Error::backend(
            "argmax_rows",
            format!("{rows}×{cols} rows into {out_len} indices"),
        ));
    }
    Ok(())
}

/// The shape `(out, inner)` of matrices `[out_i, inner]` stacked along `out` (what
/// [`Backend::matrix`] takes), checking that every part is 2-D and that they share `inner`.
pub fn stacked_shape(parts: &[Tensor<'_>]) -> Result<(usize, usize)> {
    let mut inner = None;
    let mut out = 0;
    for t in parts {
        let (rows, cols) = t.dims2()?;
        if *inner.get_or_insert(cols) != cols {
            return Err(Error::backend(
                "matrix",
                format!(
                    "`{}` is {rows}×{cols}; the matrices stacked with it are {}-wide",
                    t.name,
                    inner.unwrap_or(0)
                ),
            ));
        }
        out += rows;
    }
    Ok((out, inner.unwrap_or(0)))
}

/// The length of parameter vector `t`, which must have exactly one axis.
pub(crate) fn vector_len(t: &Tensor<'_>) -> Result<usize> {
    match t.shape[..] {
        [n] => Ok(n),
        _ => Err(Error::backend(
            "vector",
            format!("`{}` has shape {:?}, not one axis", t.name, t.shape),
        )),
    }
}

/// `(rows, dim)` of table `name` of `shape` `[.., dim]`: rows of the last axis's width.
pub(crate) fn table_shape(name: &str, shape: &[usize]) -> Result<(usize, usize)> {
    let (&dim, lead) = shape
        .split_last()
        .ok_or_else(|| Error::backend("table", format!("`{name}`: empty shape")))?;
    Ok((lead.iter().product(), dim))
}

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

/// Quantized weights on a backend: the block format float matrices are quantized to as they
/// load (`--quantize`) or that the files store, and how products on block-format weights take
/// their activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Quantization {
    /// Quantize every float matrix whose rows are whole blocks of this format as it loads
    /// (embedding tables, norms and biases are not matrices and stay as stored).
    pub at_load: Option<tessera_core::DType>,
    /// The block format of weights the model's files already store quantized (a GGUF
    /// transformer), so its products are asked for on that format before anything loads.
    pub stored: Option<tessera_core::DType>,
    /// Products on Q8_0, Q4_0, Q4_K and Q6_K weights round their activations to int8 per block of
    /// 32 and sum in integers (`--precision int8`, the CPU's fast mode); otherwise they are exact: f32
    /// on the decoded weights.
    pub int8: bool,
}

impl Quantization {
    /// The block format the model's products will see, if any.
    pub fn products(&self) -> Option<tessera_core::DType> {
        self.at_load.or(self.stored)
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
/// `[out, in]` as in the checkpoints, and `matmul` computes `x · Wᵀ`. Every op checks its call
/// with [`supports`](Backend::supports) first, so an op a backend cannot run fails with the same
/// reason it gives when asked before a model loads.
pub trait Backend: Send + Sync {
    /// An activation buffer.
    type Buf: Send + Sync;
    /// A weight matrix `[out, in]`, uploaded once in the format the backend computes with;
    /// several matrices sharing an input may be stacked along `out` (q|k|v, gate|up) so one GEMM
    /// computes them all.
    type Mat: Send + Sync;
    /// A parameter vector (norm weights, biases), kept in `f32`.
    type Vector: Send + Sync;
    /// An embedding table read by row.
    type Table: Send + Sync;

    /// One line: device, precision.
    fn describe(&self) -> String;
    fn precision(&self) -> Precision;

    /// Whether this backend runs `op`; the error says why not. Models check every op they will
    /// call before loading (so `--device auto` can decline with the reason); each op checks its
    /// own call on entry.
    fn supports(&self, op: &Op) -> Result<()>;

    // ---- memory -------------------------------------------------------------------------
    fn alloc(&self, len: usize, role: Role) -> Result<Self::Buf>;
    /// A buffer whose values are undefined until written, for activations that every op writes
    /// before anything reads them: a VAE pass's 2-3 GB of stages, whose zero fill took ~1 ms of
    /// GPU time a decode (run g20). The CPU fills it with NaN in debug builds (the tests'), so a
    /// read before a write shows there as a non-finite value; by default it is [`Backend::alloc`].
    fn alloc_scratch(&self, len: usize, role: Role) -> Result<Self::Buf> {
        self.alloc(len, role)
    }
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
    /// Read a view of a VAE's output back as 8-bit values, rows packed
    /// ([`tessera_core::pixels::to_rgb8`]), failing as [`tessera_core::check_finite`] does under
    /// `stage` where a value is not finite; waits for queued work. By default the `f32` read, the
    /// check and the conversion on the host; the CUDA backend converts and checks on the device
    /// and copies back a quarter of the bytes (a 1024² image's read-back, check and conversion
    /// took several milliseconds of host time after its decode).
    fn read_rgb8(&self, src: View<'_, Self>, stage: &str) -> Result<Vec<u8>>
    where
        Self: Sized,
    {
        let values = self.read_f32(src)?;
        tessera_core::check_finite(stage, &values)?;
        Ok(tessera_core::pixels::to_rgb8(&values))
    }
    /// Read the first `len` values of an index buffer ([`Role::Index`]); waits for queued work.
    /// (`read_f32` of an index buffer rounds values above 2^24.)
    fn read_u32(&self, src: &Self::Buf, len: usize) -> Result<Vec<u32>>;

    // ---- weights ------------------------------------------------------------------------

    /// Upload weight matrices stacked along `out`: each part is a 2-D tensor `[out_i, inner]` in
    /// its stored dtype (bf16 and f16 checkpoints reach the backend as they are stored; the
    /// backend converts to what it computes with, never through a host copy of the whole model
    /// in `f32`).
    fn matrix(&self, parts: &[Tensor<'_>]) -> Result<Self::Mat>;
    /// [`matrix`](Backend::matrix), but never quantized at load (`--quantize`): the VAEs'
    /// convolutions, small beside the transformers (ComfyUI and stable-diffusion.cpp keep them
    /// unquantized too), whose products on CUDA want dense weights (the implicit GEMM; FP8 ones
    /// would also round the VAE's activations to e4m3). Weights stored quantized stay so.
    fn matrix_unquantized(&self, parts: &[Tensor<'_>]) -> Result<Self::Mat>;
    /// A parameter vector from a 1-D tensor, kept in `f32`.
    fn vector(&self, t: &Tensor<'_>) -> Result<Self::Vector>;
    /// The embedding table `name` of a checkpoint, `shape` checked against it and read as rows of
    /// its last axis (`[∏ shape[..n−1], shape[n−1]]`; the vision position table `[2, P, H]`:
    /// rows `0..P` are the x table, `P..2P` the y table). The CPU keeps it memory-mapped in its
    /// stored dtype and converts rows on lookup.
    fn table(
        &self,
        weights: &tessera_core::Weights,
        name: &str,
        shape: &[usize],
    ) -> Result<Self::Table>;

    /// [`matrix`](Backend::matrix) from host `f32` values: `parts` are `(values, rows)` of
    /// `[rows, inner]` each (tests, benchmarks, weights computed on the host).
    fn matrix_f32(&self, parts: &[(&[f32], usize)], inner: usize) -> Result<Self::Mat> {
        let tensors: Vec<Tensor<'_>> = parts
            .iter()
            .map(|&(v, rows)| Tensor::from_f32("host matrix", vec![rows, inner], v))
            .collect::<Result<_>>()?;
        self.matrix(&tensors)
    }
    /// [`vector`](Backend::vector) from host `f32` values.
    fn vector_f32(&self, v: &[f32]) -> Result<Self::Vector> {
        self.vector(&Tensor::from_f32("host vector", vec![v.len()], v)?)
    }

    // ---- sequences ----------------------------------------------------------------------

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
            wide_tiles: 0,
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

    /// Key ranges `(first row, rows)`, one per segment (see [`KvRanges`]).
    fn kv_ranges(&self, ranges: &[(usize, usize)]) -> Result<KvRanges<Self>>
    where
        Self: Sized,
    {
        let host = ranges
            .iter()
            .map(|&(s, n)| {
                let end = s.checked_add(n).filter(|&e| e <= u32::MAX as usize);
                end.map(|_| (s as u32, n as u32))
                    .ok_or_else(|| Error::backend("kv_ranges", "a key range beyond 2^32 rows"))
            })
            .collect::<Result<Vec<_>>>()?;
        let flat: Vec<u32> = host.iter().flat_map(|&(s, n)| [s, n]).collect();
        let mut dev = self.alloc(flat.len().max(1), Role::Index)?;
        self.write_u32(&mut dev, &flat)?;
        Ok(KvRanges { ranges: host, dev })
    }

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

    /// Bytes of device memory this process can still allocate (free on the device plus what its
    /// own pool holds unused), or `None` where the backend does not budget memory (the CPU).
    fn memory_available(&self) -> Result<Option<usize>> {
        Ok(None)
    }

    /// Hand the memory that dropped buffers left in this backend's pool back to the device, so
    /// that allocations of any size (the next component's weights, when a pipeline loads its
    /// parts one at a time) can take it; waits for queued work first. By default there is
    /// nothing to hand back (the CPU frees at once).
    fn release_unused_memory(&self) -> Result<()> {
        Ok(())
    }

    /// Bytes of one element of a buffer of `role`: what sizing a buffer before allocating it
    /// (a cache that must fit the device) needs. By default `f32`, `u32`, and bf16 for
    /// [`Role::Compute`] under [`Precision::Bf16`].
    fn element_bytes(&self, role: Role) -> usize {
        match (role, self.precision()) {
            (Role::Compute, Precision::Bf16) => 2,
            _ => 4,
        }
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

    /// `out = x`, converted to `out`'s element type (a `Stream` value becoming a GEMM input).
    fn cast(&self, x: View<'_, Self>, out: ViewMut<'_, Self>) -> Result<()>
    where
        Self: Sized;

    /// `out = ep(x · wᵀ)` for `w` `[out.cols, x.cols]` (see [`Epilogue`]).
    fn matmul(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        out: ViewMut<'_, Self>,
        ep: &Epilogue<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = N(x)` row by row (see [`RowNorm`]).
    fn norm(
        &self,
        x: View<'_, Self>,
        norm: &RowNorm<'_, Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// The residual step of pre-norm and sandwich-norm blocks, fused:
    /// `h = (h + g ⊙ post(y)) · scale` (see [`Residual`]), then `after`: the next sub-block's
    /// pre-norm of `h`, or a copy of `h` as a GEMM input.
    fn residual(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        res: &Residual<'_, Self>,
        after: After<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// In place on a packed `[tokens, q|k|v]` buffer: the per-head norms of `norm`, then RoPE on
    /// q and k at `positions` (rows of the table).
    fn qkv_norm_rope(
        &self,
        qkv: ViewMut<'_, Self>,
        norm: &QkvNorm<'_, Self>,
        rope: Option<(&RopeTable<Self>, &Self::Buf)>,
    ) -> Result<()>
    where
        Self: Sized;

    /// [`qkv_norm_rope`](Backend::qkv_norm_rope), then every row's k and v heads into a cache
    /// (see [`CacheWrite`]) as [`scatter_rows`](Backend::scatter_rows) writes them. A backend may
    /// do both in one pass (CUDA: one launch instead of three).
    fn qkv_norm_rope_cached(
        &self,
        mut qkv: ViewMut<'_, Self>,
        norm: &QkvNorm<'_, Self>,
        rope: Option<(&RopeTable<Self>, &Self::Buf)>,
        cache: CacheWrite<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        self.qkv_norm_rope(qkv.reborrow(), norm, rope)?;
        let (qc, kc) = (norm.layout.q_cols(), norm.layout.kv_cols());
        let done = qkv.as_view();
        self.scatter_rows(done.cols(qc, kc), cache.rows, cache.k)?;
        self.scatter_rows(done.cols(qc + kc, kc), cache.rows, cache.v)
    }

    /// Attention of the packed query segments `segs` (see [`AttnSpec`] for keys and masks):
    /// `out = softmax(scale · q kᵀ + mask) v` per head.
    fn attention(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec<'_, Self>,
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

    /// A gated MLP's first half, `out = act(x · W_gateᵀ) ⊙ (x · W_upᵀ)` for `w` = [gate; up]
    /// stacked (`[2·inner, cols]`): [`matmul`](Backend::matmul) into the scratch rows `gu`
    /// (`[rows, 2·inner]`), then [`gated`](Backend::gated) of its halves into `out`. A backend
    /// may gate the product's columns as it stores them, with the same values (`gu` then left as
    /// it was; CUDA, for decoding's few rows: one launch instead of two).
    fn matmul_gated(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        mut gu: ViewMut<'_, Self>,
        act: Activation,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        self.matmul(x, w, gu.reborrow(), &Epilogue::default())?;
        let (half, both) = (gu.cols / 2, gu.as_view());
        self.gated(both.cols(0, half), both.cols(half, half), out, act)
    }

    /// [`matmul`](Backend::matmul) into `y`, then the residual step `then` of it. A backend may
    /// end the product with the residual step, with the same values (`y` then left as it was;
    /// CUDA, for decoding's few rows: one launch instead of two).
    fn matmul_residual(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        mut y: ViewMut<'_, Self>,
        ep: &Epilogue<'_, Self>,
        then: ThenResidual<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        self.matmul(x, w, y.reborrow(), ep)?;
        self.residual(then.h, y.as_view(), &then.res, then.after)
    }

    /// `out[s] = mean of x's rows in segment s`.
    fn segment_mean(
        &self,
        x: View<'_, Self>,
        segs: &Segments<Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

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
    /// the other rows of `dst` are untouched. Media soft tokens replace their placeholder rows;
    /// new keys and values go into a cache.
    fn scatter_rows(
        &self,
        src: View<'_, Self>,
        rows: &Self::Buf,
        dst: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out = conv(act(x)) + bias` over one channels-last image (see [`Conv2d`] for the layouts
    /// and the optional input activation): `x` `[height · width, in]`, `w` `[out, k · k · in]`,
    /// `out` `[out_h · out_w, out]`.
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

    /// `out += DupUp(x)`, the 2× channel-to-space shortcut of residual VAE up blocks (see
    /// [`DupUp`]): `x` `[height · width, in]`, `out` `[2·height · 2·width, out]`.
    fn dup_up(&self, x: View<'_, Self>, spec: &DupUp, out: ViewMut<'_, Self>) -> Result<()>
    where
        Self: Sized;

    /// `out += AvgDown(x)`, the space-to-channel shortcut of residual VAE down blocks (see
    /// [`AvgDown`]): `x` `[height · width, in]`, `out` `[height/space · width/space, out]`.
    fn avg_down(&self, x: View<'_, Self>, spec: &AvgDown, out: ViewMut<'_, Self>) -> Result<()>
    where
        Self: Sized;

    /// LFM2's gated short convolution of packed segments `segs` (see [`ShortConv`]): `bcx`
    /// `[rows, b|c|x]`, `out` `[rows, channels]`, each segment continuing from its slot of
    /// `state` (`Role::Stream`, whole slots of [`ShortConv::slot_len`]) and refreshing it.
    fn short_conv(
        &self,
        bcx: View<'_, Self>,
        conv: &ShortConv<'_, Self>,
        segs: &Segments<Self>,
        state: &mut Self::Buf,
        out: ViewMut<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized;

    /// `out[r]` = the index of the first largest value of row `r` of `x`, for every row
    /// (`out` a [`Role::Index`] buffer of at least `x.rows`): greedy decoding's token, so only
    /// one `u32` per sequence comes back to the host instead of its logits. The rule is
    /// [`first_argmax`]'s: 0 for a row with no value above −∞, and [`NAN_ROW`] for a row
    /// holding a NaN (the caller reads that row to name the token).
    fn argmax_rows(&self, x: View<'_, Self>, out: &mut Self::Buf) -> Result<()>
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
