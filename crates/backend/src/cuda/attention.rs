//! Attention over packed segments (kernels/attention.cu, kernels/attention_sm90.cu): the exact
//! f32 row kernel, and for bf16 the tensor-core flash kernels — `flash_ws_d{D}` or
//! `flash_wgmma_d{D}` on Hopper where they exist, else `flash_bf16_d{D}` (72-wide heads
//! included, q·kᵀ zero-padded to 80 columns) — under every mask of a sequence's own rows,
//! per-row key limits (block-causal masks) included, with `flash_combine` after a split-key
//! launch. Launch planning (shapes, key chunks, workspace) is in [`flash`]. Attention over
//! cached key ranges (decoding) has its own kernel in both precisions, [`cached`], which also
//! takes f32 self-attention wider than the row kernel ([`self_kernel`] decides;
//! `TESSERA_FLASH_LIMITS=0` sends bf16 limits back to it).

mod cached;
mod flash;

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

pub use flash::{
    FLASH_HEAD_DIMS, FlashChoice, FlashConfig, FlashKernel, QUERY_TILE, WGMMA_BN, WGMMA_HEAD_DIMS,
    WIDE_TILE, WS_HEAD_DIMS, WS_MIN_LEN, flash_config, wgmma_applies, wgmma_config, ws_applies,
    ws_bn, ws_config,
};
use flash::{MAX_KV_SPLITS, PART_ELEMS, kv_splits, part_elems};

pub use cached::{CACHED_HEAD_DIMS, MAX_CACHED_SPLITS, cached_splits, heads_per_cta};

use super::errors::drv;
use super::launch::{ByDim, ByElem, DevPtr, Kernel, TensorMap, cfg, kernel_args, kernel_table};
use super::memory::{addr, ptr_of, ptr_of_mut};
use super::tma;
use super::{CudaBackend, Elem};
use crate::{AttnSpec, Backend, Mask, Precision, Role, Segments, View, ViewMut, offsets_of};

kernel_args! {
    /// What every attention kernel takes first: q, k, v and the output, each as (address, row
    /// stride).
    pub(super) struct Operands {
        q: DevPtr, qs: i64, k: DevPtr, ks: i64, v: DevPtr, vs: i64, o: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `attn_rows_f32` and `attn_rows_bf16`: a warp per (query row, head).
    pub(super) struct AttnRowsArgs {
        ops: Operands, offsets: DevPtr, nseg: i32, rows: i32, hq: i32, group: i32, d: i32,
        scale: f32, window: i32, causal: i32, limits: DevPtr,
    }
}

kernel_args! {
    /// `flash_bf16_d{D}` and `flash_wgmma_d{D}`: a CTA per (query tile part, head, key chunk);
    /// `limits` are the per-row key limits (null without), `part` the split-key workspace (null
    /// when the launch is not split).
    pub(super) struct FlashArgs {
        ops: Operands, tiles: DevPtr, group: i32, scale_log2: f32, window: i32, causal: i32,
        limits: DevPtr, part: DevPtr, rows: i32, kv_splits: i32,
    }
}

kernel_args! {
    /// `flash_ws_d{D}`: the flash kernels' arguments, then the tensor maps its producer loads K
    /// and V blocks through ([`tma::head_rows_bf16`], boxes of [`ws_bn`] rows).
    pub(super) struct FlashWsArgs {
        flash: FlashArgs, tk: TensorMap, tv: TensorMap,
    }
}

kernel_args! {
    /// `flash_combine`: a warp per (row, head) weighs the key chunks into the bf16 output.
    pub(super) struct FlashCombineArgs {
        part: DevPtr, o: DevPtr, os: i64, rows: i32, heads: i32, d: i32, kv_splits: i32,
    }
}

kernel_args! {
    /// `attn_cached_{T}_d{D}`: a CTA per (query row, block of q heads of one kv head — up to
    /// [`heads_per_cta`] — key chunk); `ranges` is null over each segment's own rows, `limits`
    /// without per-row limits, `part` when the launch is not split.
    pub(super) struct CachedArgs {
        ops: Operands, offsets: DevPtr, nseg: i32, ranges: DevPtr, limits: DevPtr, hq: i32,
        group: i32, scale_log2: f32, window: i32, causal: i32, part: DevPtr,
    }
}

kernel_args! {
    /// `attn_cached_combine_{T}`: a warp per (row, head) weighs the key chunks into the output.
    pub(super) struct CachedCombineArgs {
        part: DevPtr, o: DevPtr, os: i64, rows: i32, heads: i32, d: i32, splits: i32,
    }
}

kernel_table! {
    /// The kernels of attention.cu.
    pub(super) struct AttentionKernels from "attention.cu" {
        flash: ByDim<FlashArgs> = ("flash_bf16_d{}", &FLASH_HEAD_DIMS),
        flash_combine: Kernel<FlashCombineArgs> = "flash_combine",
        attn_rows: ByElem<AttnRowsArgs> = "attn_rows_{}",
        cached_f32: ByDim<CachedArgs> = ("attn_cached_f32_d{}", &CACHED_HEAD_DIMS),
        cached_bf16: ByDim<CachedArgs> = ("attn_cached_bf16_d{}", &CACHED_HEAD_DIMS),
        cached_combine: ByElem<CachedCombineArgs> = "attn_cached_combine_{}",
    }
}

kernel_table! {
    /// The kernels of attention_sm90.cu (sm_90a alone).
    pub(super) struct Sm90Kernels from "attention_sm90.cu" {
        flash_wgmma: ByDim<FlashArgs> = ("flash_wgmma_d{}", &WGMMA_HEAD_DIMS),
        flash_ws: ByDim<FlashWsArgs> = ("flash_ws_d{}", &WS_HEAD_DIMS),
    }
}

/// Let each flash kernel use the dynamic shared memory its launch shape takes (more than the
/// 48 KB a launch gets without asking).
pub(super) fn reserve_shared_memory(
    portable: &AttentionKernels,
    hopper: Option<&Sm90Kernels>,
) -> Result<()> {
    let mma = portable
        .flash
        .iter()
        .map(|(d, k)| (k, flash_config(d).smem));
    let wgmma = hopper
        .into_iter()
        .flat_map(|t| t.flash_wgmma.iter())
        .map(|(d, k)| (k, wgmma_config(d).smem));
    for (k, smem) in mma.chain(wgmma) {
        k.allow_shared_memory(smem as usize)?;
    }
    // Another argument type, so a loop of its own.
    for (d, k) in hopper.into_iter().flat_map(|t| t.flash_ws.iter()) {
        k.allow_shared_memory(ws_config(d).smem as usize)?;
    }
    Ok(())
}

/// An attention spec's mask as the flash and row kernels take it over `rows` query rows: the
/// window radius (-1 for none), whether it is causal, and the per-row key limits (null for
/// none). Key ranges go to [`cached`] before this.
fn mask_args(spec: &AttnSpec<'_, CudaBackend>, rows: usize) -> Result<(i32, i32, DevPtr)> {
    match spec.mask {
        _ if spec.kv.is_some() => Err(Error::backend("attention", "key ranges")),
        Mask::Full => Ok((-1, 0, DevPtr::NULL)),
        Mask::Window(w) => Ok((w.min(i32::MAX as usize) as i32, 0, DevPtr::NULL)),
        Mask::Causal => Ok((-1, 1, DevPtr::NULL)),
        Mask::Limits(l) => {
            if l.elem != Elem::U32 || l.len < rows {
                return Err(Error::backend(
                    "attention",
                    format!("{} key limits ({:?}) for {rows} query rows", l.len, l.elem),
                ));
            }
            Ok((-1, 0, l.ptr))
        }
    }
}

impl Operands {
    fn of(
        q: &View<'_, CudaBackend>,
        k: &View<'_, CudaBackend>,
        v: &View<'_, CudaBackend>,
        out: &ViewMut<'_, CudaBackend>,
    ) -> Result<Self> {
        Ok(Operands {
            q: ptr_of(q)?,
            qs: q.stride as i64,
            k: ptr_of(k)?,
            ks: k.stride as i64,
            v: ptr_of(v)?,
            vs: v.stride as i64,
            o: ptr_of_mut(out)?,
            os: out.stride as i64,
        })
    }
}

/// Widest head `attn_rows_{f32,bf16}` take (a lane holds 16 of a head's columns).
pub const ROWS_MAX_HEAD_DIM: usize = 512;

/// The kernel that runs self-attention (no key ranges) over heads of one width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelfKernel {
    /// bf16 on the tensor cores ([`FLASH_HEAD_DIMS`]), under every mask of a sequence's own
    /// rows, per-row key limits included.
    Flash,
    /// A warp per (row, head), up to [`ROWS_MAX_HEAD_DIM`]: f32's exact kernel, and bf16's for
    /// widths neither kernel above is built for (slow, but no model is refused for its width).
    Rows,
    /// The key-range kernel over each segment's own rows ([`CACHED_HEAD_DIMS`]), slower: f32
    /// widths beyond the row kernel (1152), and with `TESSERA_FLASH_LIMITS=0` bf16 under per-row
    /// key limits.
    Cached,
}

/// Which kernel runs self-attention at `head_dim` under `precision`, if any, with per-row key
/// limits (`limits`: block-causal masks) or without: the one place that decides, asked by
/// [`CudaBackend::check`] and by [`attention`]. bf16 runs on the flash kernels at their widths,
/// limits or not; `TESSERA_FLASH_LIMITS=0` sends limits to the key-range or row kernel as before
/// the flash kernels read them (an A/B switch).
pub fn self_kernel(precision: Precision, head_dim: usize, limits: bool) -> Option<SelfKernel> {
    self_kernel_with(precision, head_dim, limits, flash_limits())
}

/// [`self_kernel`], with `flash_limits` saying whether the flash kernels take per-row limits.
fn self_kernel_with(
    precision: Precision,
    head_dim: usize,
    limits: bool,
    flash_limits: bool,
) -> Option<SelfKernel> {
    match precision {
        Precision::Bf16 if (flash_limits || !limits) && FLASH_HEAD_DIMS.contains(&head_dim) => {
            Some(SelfKernel::Flash)
        }
        Precision::F32 if head_dim <= ROWS_MAX_HEAD_DIM => Some(SelfKernel::Rows),
        _ if CACHED_HEAD_DIMS.contains(&head_dim) => Some(SelfKernel::Cached),
        Precision::Bf16 if head_dim <= ROWS_MAX_HEAD_DIM => Some(SelfKernel::Rows),
        _ => None,
    }
}

/// Whether bf16 self-attention under per-row key limits runs on the flash kernels: yes unless
/// `TESSERA_FLASH_LIMITS=0`, which keeps the key-range kernel (128: 2,972 ms for the Qwen-Image
/// edit's block-causal prefix on an H100) for A/B measurement.
fn flash_limits() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_FLASH_LIMITS").map_or(true, |v| v != "0"))
}

/// The attention op: over key ranges the cached kernel ([`cached`]); else the kernel
/// [`self_kernel`] picks for the head width and precision.
pub(super) fn attention(
    be: &CudaBackend,
    q: View<'_, CudaBackend>,
    k: View<'_, CudaBackend>,
    v: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
    spec: &AttnSpec<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
) -> Result<()> {
    if spec.kv.is_some() {
        return cached::attention(be, q, k, v, out, spec, segs, None).map(|_| ());
    }
    let limits = matches!(spec.mask, Mask::Limits(_));
    match self_kernel(be.precision, spec.head_dim, limits) {
        // The tensor-core kernel checks its own operands.
        Some(SelfKernel::Flash) => {
            flash(be, q, k, v, out, spec, segs, FlashChoice::default()).map(|_| ())
        }
        Some(SelfKernel::Cached) => {
            cached::attention(be, q, k, v, out, spec, segs, None).map(|_| ())
        }
        Some(SelfKernel::Rows) => rows(be, q, k, v, out, spec, segs),
        None => Err(Error::backend(
            "attention",
            format!(
                "no {:?} self-attention kernel for head_dim {}",
                be.precision, spec.head_dim
            ),
        )),
    }
}

/// Attention a warp per (query row, head): `attn_rows_f32` (the exact mode) or `attn_rows_bf16`,
/// by the operands' element type; every mask of a sequence's own rows.
fn rows(
    be: &CudaBackend,
    q: View<'_, CudaBackend>,
    k: View<'_, CudaBackend>,
    v: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
    spec: &AttnSpec<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
) -> Result<()> {
    let hd = spec.head_dim;
    let total = segs.total();
    spec.check(&q, &k, &v, &out, segs)?;
    let (window, causal, limits) = mask_args(spec, total)?;
    let elem = q.buf.elem;
    if [k.buf.elem, v.buf.elem, out.buf.elem]
        .iter()
        .any(|&e| e != elem)
        || hd > ROWS_MAX_HEAD_DIM
    {
        return Err(Error::backend(
            "attention",
            format!(
                "row attention needs operands of one element type and head_dim ≤ {ROWS_MAX_HEAD_DIM}"
            ),
        ));
    }
    let kernel = be.kernels.attention.attn_rows.get(elem)?;
    let warps = (total * spec.heads_q) as u32;
    let args = AttnRowsArgs {
        ops: Operands::of(&q, &k, &v, &out)?,
        offsets: segs.dev.ptr,
        nseg: segs.count() as i32,
        rows: total as i32,
        hq: spec.heads_q as i32,
        group: (spec.heads_q / spec.heads_kv) as i32,
        d: hd as i32,
        scale: spec.scale,
        window,
        causal,
        limits,
    };
    be.launch(
        "attention",
        kernel,
        cfg((warps.div_ceil(4), 1), 128, 0),
        &args,
    )
}

/// bf16 attention on the tensor cores over the query tiles of `segs` — `flash_ws_d{D}` or
/// `flash_wgmma_d{D}` on Hopper where they exist, else `flash_bf16_d{D}`; every mask of the
/// segments' own rows, per-row key limits included — with the keys split into chunks and
/// `flash_combine` after it when that fills the GPU better. `force` fixes either choice
/// (tests, benchmarks); returns the chunk count used.
#[allow(clippy::too_many_arguments)]
pub(super) fn flash(
    be: &CudaBackend,
    q: View<'_, CudaBackend>,
    k: View<'_, CudaBackend>,
    v: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
    spec: &AttnSpec<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
    force: FlashChoice,
) -> Result<usize> {
    let hd = spec.head_dim;
    let total = segs.total();
    spec.check(&q, &k, &v, &out, segs)?;
    let (window, causal, limits) = mask_args(spec, total)?;
    for view in [&q, &k, &v] {
        if view.buf.elem != Elem::Bf16
            || !view.offset.is_multiple_of(8)
            || !view.stride.is_multiple_of(8)
        {
            return Err(Error::backend(
                "attention",
                "bf16 attention needs bf16 operands at 16-byte-aligned rows",
            ));
        }
    }
    if out.buf.elem != Elem::Bf16 {
        return Err(Error::backend(
            "attention",
            "bf16 attention writes a bf16 output",
        ));
    }
    let hopper = wgmma_applies(&be.arch, hd);
    let wide = ws_applies(&be.arch, hd);
    let choice = match force.kernel {
        Some(FlashKernel::Wgmma) if !hopper => {
            return Err(Error::backend(
                "attention",
                format!(
                    "the wgmma kernel needs sm_90a and head_dim in {WGMMA_HEAD_DIMS:?} (here {}, head_dim {hd})",
                    be.arch
                ),
            ));
        }
        Some(FlashKernel::Ws) if !wide => {
            return Err(Error::backend(
                "attention",
                format!(
                    "the warp-specialized kernel needs sm_90a and head_dim in {WS_HEAD_DIMS:?} (here {}, head_dim {hd})",
                    be.arch
                ),
            ));
        }
        Some(k) => k,
        None if wide && segs.max_len() >= WS_MIN_LEN && ws_default() => FlashKernel::Ws,
        None if hopper => FlashKernel::Wgmma,
        None => FlashKernel::Mma,
    };
    // The kernel tables hold a kernel for exactly the head widths it is built for.
    let found = match choice {
        FlashKernel::Mma => be
            .kernels
            .attention
            .flash
            .get(hd)
            .map(|k| (Picked::Flash(k), flash_config(hd))),
        FlashKernel::Wgmma => be
            .kernels
            .sm90
            .as_ref()
            .and_then(|t| t.flash_wgmma.get(hd))
            .map(|k| (Picked::Flash(k), wgmma_config(hd))),
        FlashKernel::Ws => be
            .kernels
            .sm90
            .as_ref()
            .and_then(|t| t.flash_ws.get(hd))
            .map(|k| (Picked::Ws(k), ws_config(hd))),
    };
    // The warp-specialized kernel walks the wide tiles listed after the 64-row ones.
    let (tiles, tile_list) = match choice {
        FlashKernel::Ws => (segs.wide_tiles, addr(&segs.dev, wide_tiles_at(segs))),
        _ => (segs.tiles, addr(&segs.dev, segs.max_segs + 1)),
    };
    let (kernel, fc) = found.ok_or_else(|| {
        Error::backend(
            "attention",
            format!("head_dim {hd} has no tensor-core kernel (supported: {FLASH_HEAD_DIMS:?})"),
        )
    })?;
    let splits = match force.splits {
        Some(s) => s.clamp(1, MAX_KV_SPLITS),
        None => {
            let per_sm = kernel
                .func()
                .occupancy_max_active_blocks_per_multiprocessor(fc.threads, fc.smem as usize, None)
                .map_err(drv("occupancy"))? as usize;
            // The most keys one tile walks: its segment, or its rows plus the window each side.
            let keys = match spec.mask {
                Mask::Window(w) => segs.max_len().min(QUERY_TILE + 2 * w),
                _ => segs.max_len(),
            };
            let ctas = tiles * spec.heads_q * fc.splits as usize;
            kv_splits(ctas, per_sm * be.sm_count as usize, keys, fc.bn)
        }
    };
    let part = if splits > 1 && part_elems(splits, total, spec.heads_q, hd) <= PART_ELEMS {
        Some(flash_workspace(be)?)
    } else {
        None
    };
    let splits = if part.is_some() { splits } else { 1 };
    let args = FlashArgs {
        ops: Operands::of(&q, &k, &v, &out)?,
        tiles: tile_list,
        group: (spec.heads_q / spec.heads_kv) as i32,
        scale_log2: spec.scale * std::f32::consts::LOG2_E,
        window,
        causal,
        limits,
        part: part.unwrap_or(DevPtr::NULL),
        rows: total as i32,
        kv_splits: splits as i32,
    };
    let config = LaunchConfig {
        grid_dim: (tiles as u32, spec.heads_q as u32, fc.splits * splits as u32),
        block_dim: (fc.threads, 1, 1),
        shared_mem_bytes: fc.smem,
    };
    let (o, os) = (args.ops.o, args.ops.os);
    match kernel {
        Picked::Flash(kernel) => be.launch("attention", kernel, config, &args)?,
        Picked::Ws(kernel) => {
            let map = |ptr, view: &View<'_, CudaBackend>| {
                tma::head_rows_bf16(ptr, view.stride, total, spec.heads_kv, hd, ws_bn(hd) as u32)
            };
            let args = FlashWsArgs {
                tk: map(args.ops.k, &k)?,
                tv: map(args.ops.v, &v)?,
                flash: args,
            };
            be.launch("attention", kernel, config, &args)?
        }
    }
    if let Some(part) = part {
        let warps = (total * spec.heads_q) as u32;
        let args = FlashCombineArgs {
            part,
            o,
            os,
            rows: total as i32,
            heads: spec.heads_q as i32,
            d: hd as i32,
            kv_splits: splits as i32,
        };
        be.launch(
            "attention",
            &be.kernels.attention.flash_combine,
            cfg((warps.div_ceil(8), 1), 256, 0),
            &args,
        )?;
    }
    Ok(splits)
}

/// The flash kernel a launch takes, by its argument list.
enum Picked<'a> {
    Flash(&'a Kernel<FlashArgs>),
    Ws(&'a Kernel<FlashWsArgs>),
}

impl Picked<'_> {
    fn func(&self) -> &cudarc::driver::CudaFunction {
        match self {
            Picked::Flash(k) => k.func(),
            Picked::Ws(k) => k.func(),
        }
    }
}

/// Address of the split-key workspace, allocated on first use and never moved.
fn flash_workspace(be: &CudaBackend) -> Result<DevPtr> {
    let mut part = be
        .flash_part
        .lock()
        .map_err(|_| Error::backend("attention", "workspace lock poisoned"))?;
    if part.is_none() {
        *part = Some(be.alloc(PART_ELEMS, Role::Stream)?);
    }
    Ok(part.as_ref().map_or(DevPtr::NULL, |p| p.ptr))
}

impl CudaBackend {
    /// The bf16 attention op with its kernel and/or key-chunk count fixed, for tests and
    /// benchmarks of each path; returns the chunk count used (1 when the split would not fit the
    /// workspace). Over key ranges only the chunk count can be fixed (per query row, up to
    /// [`MAX_CACHED_SPLITS`]): the cached kernel is the one kernel there.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec<'_, Self>,
        segs: &Segments<Self>,
        choice: FlashChoice,
    ) -> Result<usize> {
        if spec.kv.is_some() {
            if let Some(kernel) = choice.kernel {
                return Err(Error::backend(
                    "attention",
                    format!("the {kernel:?} flash kernel does not take key ranges"),
                ));
            }
            return cached::attention(self, q, k, v, out, spec, segs, choice.splits);
        }
        flash(self, q, k, v, out, spec, segs, choice)
    }
}

/// Most query tiles of `rows` rows that `max_rows` rows in `max_segs` segments can make.
fn max_tiles(max_rows: usize, max_segs: usize, rows: usize) -> usize {
    max_rows.div_ceil(rows) + max_segs
}

/// Where the wide tiles start in a segment buffer: after the offsets and the room for every
/// 64-row tile.
fn wide_tiles_at(segs: &Segments<CudaBackend>) -> usize {
    segs.max_segs + 1 + 4 * max_tiles(segs.max_rows, segs.max_segs, QUERY_TILE)
}

/// Segment storage with room for the query tiles the flash kernels walk.
pub(super) fn alloc_segments(
    be: &CudaBackend,
    max_rows: usize,
    max_segs: usize,
) -> Result<Segments<CudaBackend>> {
    let tiles =
        max_tiles(max_rows, max_segs, QUERY_TILE) + max_tiles(max_rows, max_segs, WIDE_TILE);
    Ok(Segments {
        offsets: vec![0],
        dev: be.alloc(max_segs + 1 + 4 * tiles, Role::Index)?,
        max_rows,
        max_segs,
        tiles: 0,
        wide_tiles: 0,
    })
}

/// Query tiles `(q0, q1, s0, s1)` of at most `rows` rows, none crossing a segment.
fn push_tiles(data: &mut Vec<u32>, offsets: &[u32], rows: usize) -> usize {
    let mut tiles = 0;
    for w in offsets.windows(2) {
        let (s0, s1) = (w[0], w[1]);
        let mut q0 = s0;
        while q0 < s1 {
            let q1 = (q0 + rows as u32).min(s1);
            data.extend_from_slice(&[q0, q1, s0, s1]);
            tiles += 1;
            q0 = q1;
        }
    }
    tiles
}

/// Offsets, then the query tiles of `QUERY_TILE` rows the flash kernels walk (from element
/// `max_segs + 1`), then the `WIDE_TILE`-row tiles of `flash_ws_d{D}` (from [`wide_tiles_at`]).
pub(super) fn set_segments(
    be: &CudaBackend,
    segs: &mut Segments<CudaBackend>,
    lens: &[usize],
) -> Result<()> {
    let offsets = offsets_of(lens, segs.max_rows, segs.max_segs)?;
    let mut data = offsets.clone();
    data.resize(segs.max_segs + 1, 0);
    let tiles = push_tiles(&mut data, &offsets, QUERY_TILE);
    // Only a GPU with `flash_ws_d{D}` walks wide tiles: elsewhere the upload stays as short as
    // the 64-row tiles (this runs every pass, every decode step included).
    let wide_tiles = if be.kernels.sm90.is_some() {
        data.resize(wide_tiles_at(segs), 0);
        push_tiles(&mut data, &offsets, WIDE_TILE)
    } else {
        0
    };
    be.write_u32(&mut segs.dev, &data)?;
    segs.offsets = offsets;
    segs.tiles = tiles;
    segs.wide_tiles = wide_tiles;
    Ok(())
}

/// Whether the op picks `flash_ws_d{D}` by itself where it applies: yes, since it was measured
/// on an H200 (BENCHMARKS.md, run g1: 450 TFLOP/s against flash_wgmma's 290 at the DiT's shape,
/// a Z-Image step 99 ms instead of 110, the op table and both DiT miniatures within their
/// bounds). `TESSERA_FLASH_WS=0` keeps flash_wgmma, for A/B measurement.
fn ws_default() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_FLASH_WS").map_or(true, |v| v != "0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_width_runs_in_both_precisions() {
        for d in FLASH_HEAD_DIMS.iter().chain(&CACHED_HEAD_DIMS) {
            for p in [Precision::F32, Precision::Bf16] {
                for on in [true, false] {
                    assert!(
                        self_kernel_with(p, *d, false, on).is_some(),
                        "head_dim {d} under {p:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn no_bf16_width_up_to_the_row_kernels_is_refused() {
        for d in 1..=ROWS_MAX_HEAD_DIM {
            assert!(
                self_kernel_with(Precision::Bf16, d, false, true).is_some(),
                "head_dim {d} under bf16"
            );
        }
        let bf16 = |d| self_kernel_with(Precision::Bf16, d, false, true);
        assert_eq!(bf16(24), Some(SelfKernel::Rows));
        assert_eq!(bf16(128), Some(SelfKernel::Flash));
        // SigLIP2's and Qwen3-VL's vision towers: on the tensor cores, padded to 80 for q·kᵀ.
        assert_eq!(bf16(72), Some(SelfKernel::Flash));
        assert_eq!(bf16(80), Some(SelfKernel::Cached));
    }

    #[test]
    fn wide_single_heads_take_the_tensor_cores_in_bf16() {
        let kernel = |p, d| self_kernel_with(p, d, false, true);
        // Qwen-Image-2.1's VAE mid-block: one head of 1152.
        assert_eq!(kernel(Precision::Bf16, 1152), Some(SelfKernel::Flash));
        assert_eq!(kernel(Precision::F32, 1152), Some(SelfKernel::Cached));
        assert_eq!(heads_per_cta(1152), 1);
        // The encoder's mid-block: one head of 768, the same kernels.
        assert_eq!(kernel(Precision::Bf16, 768), Some(SelfKernel::Flash));
        assert_eq!(kernel(Precision::F32, 768), Some(SelfKernel::Cached));
        // Unchanged: f32 up to the row kernel's 512, nothing wider but the two above.
        assert_eq!(kernel(Precision::F32, 512), Some(SelfKernel::Rows));
        assert_eq!(kernel(Precision::F32, 72), Some(SelfKernel::Rows));
        assert_eq!(heads_per_cta(256), 4);
        assert_eq!(kernel(Precision::F32, 1024), None);
        assert_eq!(kernel(Precision::Bf16, 1024), None);
    }

    #[test]
    fn per_row_limits_take_the_flash_kernels_at_their_widths() {
        for d in 1..=ROWS_MAX_HEAD_DIM {
            for on in [true, false] {
                assert_eq!(
                    self_kernel_with(Precision::F32, d, true, on),
                    self_kernel_with(Precision::F32, d, false, on),
                    "f32 head_dim {d}"
                );
            }
            // The flash kernels read the limits: bf16 picks what it picks without them.
            assert_eq!(
                self_kernel_with(Precision::Bf16, d, true, true),
                self_kernel_with(Precision::Bf16, d, false, true),
                "bf16 head_dim {d}"
            );
        }
        // Qwen-Image's 128-wide heads (the edit's block-causal prefix) and the VAE's 1152.
        for d in [64, 72, 128, 1152] {
            assert_eq!(
                self_kernel_with(Precision::Bf16, d, true, true),
                Some(SelfKernel::Flash),
                "head_dim {d}"
            );
        }
        assert_eq!(
            self_kernel_with(Precision::Bf16, 24, true, true),
            Some(SelfKernel::Rows)
        );
        assert_eq!(self_kernel_with(Precision::Bf16, 1024, true, true), None);
    }

    #[test]
    fn the_switch_off_keeps_limits_off_the_flash_kernels() {
        // TESSERA_FLASH_LIMITS=0: the choice before the flash kernels read limits.
        for d in 1..=ROWS_MAX_HEAD_DIM {
            let bf16 = self_kernel_with(Precision::Bf16, d, true, false);
            assert!(
                matches!(bf16, Some(SelfKernel::Cached | SelfKernel::Rows)),
                "bf16 head_dim {d}: {bf16:?}"
            );
            assert_eq!(
                self_kernel_with(Precision::Bf16, d, false, false),
                self_kernel_with(Precision::Bf16, d, false, true),
                "without limits the switch changes nothing: head_dim {d}"
            );
        }
        let off = |d| self_kernel_with(Precision::Bf16, d, true, false);
        assert_eq!(off(128), Some(SelfKernel::Cached));
        assert_eq!(off(72), Some(SelfKernel::Cached));
        assert_eq!(off(1152), Some(SelfKernel::Cached));
        assert_eq!(off(24), Some(SelfKernel::Rows));
        assert_eq!(off(1024), None);
    }
}
