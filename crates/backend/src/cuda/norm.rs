//! Row norms (kernels/norm.cu): RMSNorm, the residual add fused with the next norm, and the
//! per-head q/k norm with RoPE. Rows of 128·k columns (k ≤ 8) take the warp-per-row kernels.

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

use super::gemm::act_code;
use super::launch::{
    ByElem, ByPair, DevPtr, cfg, kernel_args, kernel_table, row_blocks, vec4_aligned,
};
use super::memory::{Workspace, ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaBuf, Elem};
use crate::view::same_shape;
use crate::{
    After, CacheWrite, NormKind, QkvNorm, Residual, RopeStyle, RopeTable, RowNorm, ThenResidual,
    View, ViewMut,
};

kernel_args! {
    /// What both RMSNorm kernels take first: input rows, weight (null = none), output rows.
    pub(super) struct RmsNormRows {
        x: DevPtr, xs: i64, w: DevPtr, out: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `rms_norm_{x}_{out}`: one block per row.
    pub(super) struct RmsNormArgs { io: RmsNormRows, cols: i32, eps: f32 }
}

kernel_args! {
    /// `rms_norm_warp_{x}_{out}`: a warp per row.
    pub(super) struct RmsNormWarpArgs { io: RmsNormRows, rows: i64, cols: i32, eps: f32 }
}

kernel_args! {
    /// What both residual kernels take first: `h = (h + N_post(y)) · scale` (`N_post` the
    /// RMSNorm by `post`, none when null), then by `mode` 0 nothing more, 1 `out = N_next(h)`,
    /// 2 `out = h`.
    pub(super) struct ResidualRows {
        h: DevPtr, hs: i64, y: DevPtr, ys: i64, post: DevPtr, scale: f32, mode: i32,
        next: DevPtr, out: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `residual_norm_{y}_{out}`: one block per row.
    pub(super) struct ResidualNormArgs { io: ResidualRows, cols: i32, eps: f32 }
}

kernel_args! {
    /// `residual_norm_warp_{y}_{out}`: a warp per row.
    pub(super) struct ResidualNormWarpArgs { io: ResidualRows, rows: i64, cols: i32, eps: f32 }
}

kernel_args! {
    /// Every `qkv_norm_rope*_{t}`: a warp per head (four heads in the axial-64 kernel).
    pub(super) struct QkvNormRopeArgs {
        qkv: DevPtr, stride: i64, rows: i32, hq: i32, hkv: i32, hd: i32, qw: DevPtr, kw: DevPtr,
        v_norm: i32, qk_norm: i32, eps: f32, rope: DevPtr, rope_len: i32, tbl_half: i32, pos: DevPtr,
    }
}

kernel_args! {
    /// `qkv_norm_rope_cached_{t}`: the split-half kernel's arguments, then the cache rows `at` and
    /// the key and value caches with their row strides.
    pub(super) struct QkvNormRopeCachedArgs {
        base: QkvNormRopeArgs, at: DevPtr, kc: DevPtr, ks: i64, vc: DevPtr, vs: i64,
    }
}

kernel_args! {
    /// One norm's parameters in the general kernels: `kind` 0 RMS, 1 layer (−1: no norm);
    /// weight, bias and modulation row (null = none).
    pub(super) struct NormParams { kind: i32, w: DevPtr, b: DevPtr, s: DevPtr, eps: f32 }
}

kernel_args! {
    /// The residual step a product's kernel ends with (`ResidualOut` in gemv.cu): the stream
    /// `h`, the scale, what follows (`mode` 0 nothing, 1 the next norm, 2 a copy) into bf16
    /// `out`, the threads of a row and the grid-wide count ([`Workspace::Counts`]).
    pub(super) struct ResidualTail {
        h: DevPtr, hs: i64, scale: f32, mode: i32, next: NormParams, out: DevPtr, os: i64,
        cols: i32, row_threads: i32, counter: DevPtr,
    }
}

kernel_args! {
    /// `row_norm_{x}_{out}`: any [`RowNorm`], one block per row; `act` −1 none, else the
    /// activation's code (`image_act`).
    pub(super) struct RowNormArgs {
        x: DevPtr, xs: i64, norm: NormParams, out: DevPtr, os: i64, cols: i32, act: i32,
    }
}

kernel_args! {
    /// `row_norm_warps_{x}_{out}`: [`RowNormArgs`] over `rows` rows, one warp each.
    pub(super) struct RowNormWarpsArgs { base: RowNormArgs, rows: i64 }
}

kernel_args! {
    /// `residual_any_{y}_{out}`: `h = (h + tanh(g) ⊙ N_post(y)) · scale`, then by `mode` 0
    /// nothing, 1 `out = N_next(h)`, 2 `out = h`; one block per row.
    pub(super) struct ResidualAnyArgs {
        h: DevPtr, hs: i64, y: DevPtr, ys: i64, post: NormParams, g: DevPtr, scale: f32,
        mode: i32, next: NormParams, out: DevPtr, os: i64, cols: i32,
    }
}

kernel_table! {
    /// The kernels of norm.cu.
    pub(super) struct NormKernels from "norm.cu" {
        rms_norm: ByPair<RmsNormArgs> = "rms_norm_{}_{}",
        residual_norm: ByPair<ResidualNormArgs> = "residual_norm_{}_{}",
        rms_norm_warp: ByPair<RmsNormWarpArgs> = "rms_norm_warp_{}_{}",
        residual_norm_warp: ByPair<ResidualNormWarpArgs> = "residual_norm_warp_{}_{}",
        /// Split-half RoPE, any even head width.
        qkv_norm_rope: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_{}",
        /// The same, also writing the keys and values to a cache.
        qkv_norm_rope_cached: ByElem<QkvNormRopeCachedArgs> = "qkv_norm_rope_cached_{}",
        /// Axial 2-D RoPE, any head width.
        qkv_norm_rope_axial: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_axial_{}",
        /// Split-half RoPE on aligned heads of 256 or 512, 4-wide.
        qkv_norm_rope_vec: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_vec_{}",
        /// Interleaved (complex-pair) RoPE, any even head width.
        qkv_norm_rope_pairs: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_pairs_{}",
        /// Any row norm (layer norms, biases, modulation).
        row_norm: ByPair<RowNormArgs> = "row_norm_{}_{}",
        /// Any residual step (no or any post-norm, tanh gates, any next norm).
        residual_any: ByPair<ResidualAnyArgs> = "residual_any_{}_{}",
        /// The same two, rows held in registers 4-wide ([`vec_threads`]).
        row_norm_vec: ByPair<RowNormArgs> = "row_norm_vec_{}_{}",
        /// The vector row norm for rows one warp holds, a warp per row and several per block.
        row_norm_warps: ByPair<RowNormWarpsArgs> = "row_norm_warps_{}_{}",
        /// The same for rows of at most 512, 256 and 128 columns, two, four and eight a warp.
        row_norm_warps2: ByPair<RowNormWarpsArgs> = "row_norm_warps2_{}_{}",
        row_norm_warps4: ByPair<RowNormWarpsArgs> = "row_norm_warps4_{}_{}",
        row_norm_warps8: ByPair<RowNormWarpsArgs> = "row_norm_warps8_{}_{}",
        residual_any_vec: ByPair<ResidualAnyArgs> = "residual_any_vec_{}_{}",
        /// Interleaved RoPE on aligned heads of 128·m (m ≤ 4), 4-wide.
        qkv_norm_rope_pairs_vec: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_pairs_vec_{}",
        /// Axial 2-D RoPE on aligned heads of 64, 8 lanes a head.
        qkv_norm_rope_axial64: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_axial64_{}",
    }
}

/// Rows of `cols` fit the warp-per-row norm kernels (`*_norm_warp_*`): 128·k columns with k ≤ 8,
/// rows and weight vectors aligned.
fn warp_norm_fits(cols: usize, rows: &[(DevPtr, usize, usize)], weights: &[DevPtr]) -> bool {
    cols.is_multiple_of(128) && (128..=1024).contains(&cols) && vec4_aligned(rows, weights)
}

/// Launch shape of the warp-per-row norm kernels: eight rows per 256-thread block.
fn warp_rows_cfg(rows: usize) -> LaunchConfig {
    cfg((rows.div_ceil(8) as u32, 1), 256, 0)
}

/// The widest row the block-per-row general kernels stage in shared memory (48 KiB of f32).
const MAX_STAGED_COLS: usize = 12 * 1024;

impl NormParams {
    /// No norm (a residual step without a post-norm).
    const NONE: NormParams = NormParams {
        kind: -1,
        w: DevPtr::NULL,
        b: DevPtr::NULL,
        s: DevPtr::NULL,
        eps: 0.0,
    };

    /// The general kernels' view of `n` over rows of `cols`, its vectors and modulation row
    /// checked. Only [`norm`] passes an activation on (as its own argument): a residual step's
    /// norms refuse one.
    fn of(op: &str, n: &RowNorm<'_, CudaBackend>, cols: usize) -> Result<Self> {
        if let Some(a) = n.act {
            return Err(Error::backend(
                op,
                format!("a residual step's norm takes no activation ({a:?})"),
            ));
        }
        let vector = |v: Option<&CudaBuf>, what: &str| match v {
            Some(v) if v.len != cols => Err(Error::backend(
                op,
                format!("norm {what} of {} for rows of {cols}", v.len),
            )),
            Some(v) => Ok(v.ptr),
            None => Ok(DevPtr::NULL),
        };
        let s = match &n.scale {
            Some(s) => f32_row(op, "modulation scale", s, cols)?,
            None => DevPtr::NULL,
        };
        Ok(NormParams {
            kind: match n.kind {
                NormKind::Rms => 0,
                NormKind::Layer => 1,
            },
            w: vector(n.weight, "weight")?,
            b: vector(n.bias, "bias")?,
            s,
            eps: n.eps,
        })
    }
}

/// The address of one broadcast f32 row `[1, cols]` (adaLN scales and gates).
pub(super) fn f32_row(
    op: &str,
    what: &str,
    v: &View<'_, CudaBackend>,
    cols: usize,
) -> Result<DevPtr> {
    if v.rows != 1 || v.cols != cols || v.buf.elem != Elem::F32 {
        return Err(Error::backend(
            op,
            format!(
                "{what} is {}×{} {:?}, expected one f32 row of {cols}",
                v.rows, v.cols, v.buf.elem
            ),
        ));
    }
    ptr_of(v)
}

/// Column chunks of 4 each thread of the vector kernels holds (`RN_CHUNKS` in norm.cu).
const RN_CHUNKS: usize = 8;

/// Rows a block of `row_norm_warps` takes, one a warp: 256 threads, so a multiprocessor fills up
/// before its limit of blocks does.
const WARP_ROWS: usize = 8;

/// Rows a warp of `row_norm_warps{R}` takes for rows of `cols` (at most 4·32·`RN_CHUNKS`): as
/// many as keep its 32 registers of values full (8 rows of 128 columns, 4 of 256, 2 of 512), so
/// a narrow row's loads are not alone in flight.
fn warp_rows_per_warp(cols: usize) -> usize {
    let chunks = cols.div_ceil(4 * 32).next_power_of_two();
    (RN_CHUNKS / chunks).max(1)
}

/// Threads per row of the vector row-norm kernels for rows of `cols`, when those kernels take
/// them (4·m columns, at most 32,768) and every row and vector is aligned for 4-wide accesses.
fn vec_threads(cols: usize, rows: &[(DevPtr, usize, usize)], vectors: &[DevPtr]) -> Option<u32> {
    let threads = cols.div_ceil(4 * RN_CHUNKS).next_multiple_of(32);
    (cols.is_multiple_of(4) && threads <= 1024 && vec4_aligned(rows, vectors))
        .then_some(threads as u32)
}

/// Check that rows of `cols` fit the general kernels' shared-memory staging.
fn staged(op: &str, cols: usize) -> Result<u32> {
    if cols > MAX_STAGED_COLS {
        return Err(Error::backend(
            op,
            format!("rows of {cols} columns (the kernel stages at most {MAX_STAGED_COLS})"),
        ));
    }
    Ok((cols * 4) as u32)
}

/// `out = N(x)` for any [`RowNorm`]: the RMS kernels where they apply, else the general one.
pub(super) fn norm(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    n: &RowNorm<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    if plain_rms(n) {
        return rms_norm(be, x, n.weight, n.eps, out);
    }
    same_shape("norm", (x.rows, x.cols), (out.rows, out.cols))?;
    // The erf GELU, which `image_act` lacks, is declined on entry (`supports`).
    let act = n.act.map_or(-1, act_code);
    let args = RowNormArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        norm: NormParams::of("norm", &RowNorm { act: None, ..*n }, x.cols)?,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
        cols: x.cols as i32,
        act,
    };
    let (xe, oe) = (x.buf.elem, out.buf.elem);
    let rows = [
        (args.x, x.stride, xe.size()),
        (args.out, out.stride, oe.size()),
    ];
    let k = &be.kernels.norm;
    match vec_threads(x.cols, &rows, &[args.norm.w, args.norm.b, args.norm.s]) {
        Some(32) => {
            let per_warp = warp_rows_per_warp(x.cols);
            let table = match per_warp {
                8 => &k.row_norm_warps8,
                4 => &k.row_norm_warps4,
                2 => &k.row_norm_warps2,
                _ => &k.row_norm_warps,
            };
            let blocks = u32::try_from(x.rows.div_ceil(WARP_ROWS * per_warp))
                .map_err(|_| Error::backend("norm", format!("{} rows", x.rows)))?;
            let launch = cfg((blocks, 1), 32 * WARP_ROWS as u32, 0);
            let args = RowNormWarpsArgs {
                base: args,
                rows: x.rows as i64,
            };
            be.launch("norm", table.get(xe, oe)?, launch, &args)
        }
        Some(threads) => {
            let launch = cfg((x.rows as u32, 1), threads, 0);
            be.launch("norm", k.row_norm_vec.get(xe, oe)?, launch, &args)
        }
        None => {
            let launch = row_blocks(x.rows, x.cols, staged("norm", x.cols)?);
            be.launch("norm", k.row_norm.get(xe, oe)?, launch, &args)
        }
    }
}

/// Address, row stride and element type of a residual step's output besides the stream
/// (`None`: a null pointer, stride 0 and f32, which every alignment test passes), its shape
/// checked against the stream's.
fn second_output(
    op: &str,
    h: &ViewMut<'_, CudaBackend>,
    out: Option<&ViewMut<'_, CudaBackend>>,
) -> Result<(DevPtr, usize, Elem)> {
    match out {
        Some(o) => {
            same_shape(op, (h.rows, h.cols), (o.rows, o.cols))?;
            Ok((ptr_of_mut(o)?, o.stride, o.buf.elem))
        }
        None => Ok((DevPtr::NULL, 0, Elem::F32)),
    }
}

/// What the general residual kernels do after the step: `mode` (0 nothing, 1 the next norm, 2 a
/// copy), the next norm's parameters (checked against rows of `cols`) and the second output.
fn after_params<'v, 'a>(
    op: &str,
    after: &'v After<'a, CudaBackend>,
    cols: usize,
) -> Result<(i32, NormParams, Option<&'v ViewMut<'a, CudaBackend>>)> {
    Ok(match after {
        After::Nothing => (0, NormParams::NONE, None),
        After::Norm(n, o) => (1, NormParams::of(op, n, cols)?, Some(o)),
        After::Copy(o) => (2, NormParams::NONE, Some(o)),
    })
}

/// A plain weighted-or-not RMS norm, the only kind the RMS kernels compute.
fn plain_rms(n: &RowNorm<'_, CudaBackend>) -> bool {
    n.kind == NormKind::Rms && n.bias.is_none() && n.scale.is_none() && n.act.is_none()
}

/// The residual step: the RMS kernels for Gemma's sandwich step (an RMS post-norm, no gate, a
/// weighted RMS next norm of the same eps), the general kernel for the rest.
pub(super) fn residual(
    be: &CudaBackend,
    h: ViewMut<'_, CudaBackend>,
    y: View<'_, CudaBackend>,
    res: &Residual<'_, CudaBackend>,
    after: After<'_, CudaBackend>,
) -> Result<()> {
    let rms_step = res.tanh_gate.is_none()
        && res.post.as_ref().is_some_and(|p| {
            plain_rms(p)
                && match &after {
                    After::Norm(n, _) => plain_rms(n) && n.weight.is_some() && n.eps == p.eps,
                    _ => true,
                }
        });
    if rms_step {
        residual_norm(be, h, y, res, after)
    } else {
        residual_any(be, h, y, res, after)
    }
}

/// The residual step `then` after a product of `cta_threads` threads a CTA into bf16 rows `y`
/// (which the fused kernel never writes), as that kernel's tail: `Some` where [`residual`] would
/// run it on the vector kernel (no post-norm, no gate, an f32 stream, a bf16 second output) with a
/// row's threads dividing the CTA into at most 8 groups, so that the tail gives its bits.
pub(super) fn residual_tail(
    be: &CudaBackend,
    then: &ThenResidual<'_, CudaBackend>,
    y: &ViewMut<'_, CudaBackend>,
    cta_threads: u32,
) -> Result<Option<ResidualTail>> {
    const OP: &str = "residual";
    let (h, res) = (&then.h, &then.res);
    same_shape(OP, (h.rows, h.cols), (y.rows, y.cols))?;
    if res.post.is_some() || res.tanh_gate.is_some() || h.buf.elem != Elem::F32 {
        return Ok(None);
    }
    let cols = h.cols;
    let (mode, next, out) = after_params(OP, &then.after, cols)?;
    let (optr, os, oe) = second_output(OP, h, out)?;
    if y.buf.elem != Elem::Bf16 || (out.is_some() && oe != Elem::Bf16) {
        return Ok(None);
    }
    let hp = ptr_of_mut(h)?;
    let rows = [
        (hp, h.stride, 4),
        (ptr_of_mut(y)?, y.stride, 2),
        (optr, os, oe.size()),
    ];
    let vectors = [next.w, next.b, next.s];
    let Some(row_threads) = vec_threads(cols, &rows, &vectors) else {
        return Ok(None);
    };
    if !cta_threads.is_multiple_of(row_threads) || cta_threads / row_threads > 8 {
        return Ok(None);
    }
    let (counter, _) = be.workspace(Workspace::Counts)?;
    Ok(Some(ResidualTail {
        h: hp,
        hs: h.stride as i64,
        scale: res.scale,
        mode,
        next,
        out: optr,
        os: os as i64,
        cols: cols as i32,
        row_threads: row_threads as i32,
        counter,
    }))
}

fn residual_any(
    be: &CudaBackend,
    h: ViewMut<'_, CudaBackend>,
    y: View<'_, CudaBackend>,
    res: &Residual<'_, CudaBackend>,
    after: After<'_, CudaBackend>,
) -> Result<()> {
    const OP: &str = "residual";
    same_shape(OP, (h.rows, h.cols), (y.rows, y.cols))?;
    if h.buf.elem != Elem::F32 {
        return Err(Error::backend(OP, "the residual stream must be f32"));
    }
    let cols = h.cols;
    let post = match &res.post {
        Some(p) if p.scale.is_some() => {
            return Err(Error::backend(OP, "the post-norm cannot be modulated"));
        }
        Some(p) => NormParams::of(OP, p, cols)?,
        None => NormParams::NONE,
    };
    let g = match &res.tanh_gate {
        Some(g) => f32_row(OP, "gate", g, cols)?,
        None => DevPtr::NULL,
    };
    let (mode, next, out) = after_params(OP, &after, cols)?;
    let (optr, os, oe) = second_output(OP, &h, out)?;
    let args = ResidualAnyArgs {
        h: ptr_of_mut(&h)?,
        hs: h.stride as i64,
        y: ptr_of(&y)?,
        ys: y.stride as i64,
        post,
        g,
        scale: res.scale,
        mode,
        next,
        out: optr,
        os: os as i64,
        cols: cols as i32,
    };
    let ye = y.buf.elem;
    // Without an output, its null pointer and zero stride pass the alignment test.
    let rows = [
        (args.h, h.stride, 4),
        (args.y, y.stride, ye.size()),
        (optr, os, oe.size()),
    ];
    let vectors = [
        args.post.w,
        args.post.b,
        g,
        args.next.w,
        args.next.b,
        args.next.s,
    ];
    let k = &be.kernels.norm;
    match vec_threads(cols, &rows, &vectors) {
        Some(threads) => {
            let launch = cfg((h.rows as u32, 1), threads, 0);
            be.launch("norm", k.residual_any_vec.get(ye, oe)?, launch, &args)
        }
        None => {
            let launch = row_blocks(h.rows, cols, staged(OP, cols)?);
            be.launch("norm", k.residual_any.get(ye, oe)?, launch, &args)
        }
    }
}

fn rms_norm(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: Option<&CudaBuf>,
    eps: f32,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    same_shape("rms_norm", (x.rows, x.cols), (out.rows, out.cols))?;
    if w.is_some_and(|w| w.len != x.cols) {
        return Err(Error::backend(
            "rms_norm",
            "weight length differs from the row width",
        ));
    }
    let (xp, op) = (ptr_of(&x)?, ptr_of_mut(&out)?);
    let (xe, oe) = (x.buf.elem, out.buf.elem);
    let w = w.map_or(DevPtr::NULL, |w| w.ptr);
    let rows = [(xp, x.stride, xe.size()), (op, out.stride, oe.size())];
    let io = RmsNormRows {
        x: xp,
        xs: x.stride as i64,
        w,
        out: op,
        os: out.stride as i64,
    };
    let (cols, k) = (x.cols as i32, &be.kernels.norm);
    if warp_norm_fits(x.cols, &rows, &[w]) {
        let args = RmsNormWarpArgs {
            io,
            rows: x.rows as i64,
            cols,
            eps,
        };
        be.launch(
            "norm",
            k.rms_norm_warp.get(xe, oe)?,
            warp_rows_cfg(x.rows),
            &args,
        )
    } else {
        let args = RmsNormArgs { io, cols, eps };
        let launch = row_blocks(x.rows, x.cols, 0);
        be.launch("norm", k.rms_norm.get(xe, oe)?, launch, &args)
    }
}

/// `h = (h + N_post(y)) · scale`, then `after`, for an RMS post-norm, no gate and a weighted RMS
/// next norm ([`residual`] picks it).
fn residual_norm(
    be: &CudaBackend,
    h: ViewMut<'_, CudaBackend>,
    y: View<'_, CudaBackend>,
    res: &Residual<'_, CudaBackend>,
    after: After<'_, CudaBackend>,
) -> Result<()> {
    same_shape("residual_norm", (h.rows, h.cols), (y.rows, y.cols))?;
    let Some(post_norm) = res.post else {
        return Err(Error::backend("residual_norm", "no post-norm"));
    };
    let (post, scale, eps) = (post_norm.weight, res.scale, post_norm.eps);
    if h.buf.elem != Elem::F32 {
        return Err(Error::backend(
            "residual_norm",
            "the residual stream must be f32",
        ));
    }
    let (mode, next, out) = match &after {
        After::Nothing => (0, DevPtr::NULL, None),
        After::Norm(n, o) => {
            let Some(w) = n.weight else {
                return Err(Error::backend(
                    "residual_norm",
                    "the next norm has no weight",
                ));
            };
            if n.eps != eps {
                return Err(Error::backend(
                    "residual_norm",
                    format!(
                        "the post-norm's eps {eps} and the next norm's {} differ",
                        n.eps
                    ),
                ));
            }
            if w.len != h.cols {
                return Err(Error::backend(
                    "residual_norm",
                    "next-norm weight length differs from the row width",
                ));
            }
            (1, w.ptr, Some(o))
        }
        After::Copy(o) => (2, DevPtr::NULL, Some(o)),
    };
    let (optr, ostride, oe) = second_output("residual_norm", &h, out)?;
    let (hp, yp) = (ptr_of_mut(&h)?, ptr_of(&y)?);
    let post = post.map_or(DevPtr::NULL, |p| p.ptr);
    let ye = y.buf.elem;
    // Without an output, its null pointer and zero stride pass the alignment test.
    let rows = [
        (hp, h.stride, 4),
        (yp, y.stride, ye.size()),
        (optr, ostride, oe.size()),
    ];
    let io = ResidualRows {
        h: hp,
        hs: h.stride as i64,
        y: yp,
        ys: y.stride as i64,
        post,
        scale,
        mode,
        next,
        out: optr,
        os: ostride as i64,
    };
    let (cols, k) = (h.cols as i32, &be.kernels.norm);
    if warp_norm_fits(h.cols, &rows, &[post, next]) {
        let args = ResidualNormWarpArgs {
            io,
            rows: h.rows as i64,
            cols,
            eps,
        };
        be.launch(
            "norm",
            k.residual_norm_warp.get(ye, oe)?,
            warp_rows_cfg(h.rows),
            &args,
        )
    } else {
        let args = ResidualNormArgs { io, cols, eps };
        let launch = row_blocks(h.rows, h.cols, (h.cols * 4) as u32);
        be.launch("norm", k.residual_norm.get(ye, oe)?, launch, &args)
    }
}

/// One `qkv_norm_rope*` launch: the kernel chosen for the call, its arguments and grid.
struct QkvLaunch<'k> {
    kernel: &'k ByElem<QkvNormRopeArgs>,
    /// Whether it is the scalar split-half kernel, which has a cache-writing twin.
    split_half: bool,
    elem: Elem,
    args: QkvNormRopeArgs,
    grid: LaunchConfig,
}

impl QkvLaunch<'_> {
    fn run(&self, be: &CudaBackend) -> Result<()> {
        be.launch("norm", self.kernel.get(self.elem)?, self.grid, &self.args)
    }
}

pub(super) fn qkv_norm_rope(
    be: &CudaBackend,
    qkv: ViewMut<'_, CudaBackend>,
    norm: &QkvNorm<'_, CudaBackend>,
    rope: Option<(&RopeTable<CudaBackend>, &CudaBuf)>,
) -> Result<()> {
    qkv_launch(be, &qkv, norm, rope)?.run(be)
}

/// `qkv_norm_rope`, then the new keys and values into their cache rows: one launch on the
/// split-half kernel when the caches hold the compute type, else the norm's launch and two
/// `scatter_rows`.
pub(super) fn qkv_norm_rope_cached(
    be: &CudaBackend,
    qkv: ViewMut<'_, CudaBackend>,
    norm: &QkvNorm<'_, CudaBackend>,
    rope: Option<(&RopeTable<CudaBackend>, &CudaBuf)>,
    cache: CacheWrite<'_, CudaBackend>,
) -> Result<()> {
    let launch = qkv_launch(be, &qkv, norm, rope)?;
    let (qc, kc) = (norm.layout.q_cols(), norm.layout.kv_cols());
    let fits = |c: &ViewMut<'_, CudaBackend>| c.cols == kc && c.buf.elem == launch.elem;
    let rows_ok = cache.rows.elem == Elem::U32 && cache.rows.len >= qkv.rows;
    if !(be.fuse.kv && launch.split_half && rows_ok && fits(&cache.k) && fits(&cache.v)) {
        launch.run(be)?;
        let done = qkv.as_view();
        super::rows::scatter_rows(be, done.cols(qc, kc), cache.rows, cache.k)?;
        return super::rows::scatter_rows(be, done.cols(qc + kc, kc), cache.rows, cache.v);
    }
    let args = QkvNormRopeCachedArgs {
        base: launch.args,
        at: cache.rows.ptr,
        kc: ptr_of_mut(&cache.k)?,
        ks: cache.k.stride as i64,
        vc: ptr_of_mut(&cache.v)?,
        vs: cache.v.stride as i64,
    };
    be.launch(
        "norm",
        be.kernels.norm.qkv_norm_rope_cached.get(launch.elem)?,
        launch.grid,
        &args,
    )
}

/// The checks, kernel choice and arguments of a `qkv_norm_rope` call.
fn qkv_launch<'k>(
    be: &'k CudaBackend,
    qkv: &ViewMut<'_, CudaBackend>,
    norm: &QkvNorm<'_, CudaBackend>,
    rope: Option<(&RopeTable<CudaBackend>, &CudaBuf)>,
) -> Result<QkvLaunch<'k>> {
    let QkvNorm {
        layout,
        qk_norm,
        q_weight: q_w,
        k_weight: k_w,
        v_norm,
        eps,
    } = *norm;
    let hd = layout.head_dim;
    if qkv.cols != layout.width() || hd == 0 || !hd.is_multiple_of(2) || hd > 512 {
        return Err(Error::backend(
            "qkv_norm_rope",
            format!(
                "{} columns for layout {layout:?} (head_dim even, ≤ 512)",
                qkv.cols
            ),
        ));
    }
    if !qk_norm && (q_w.is_some() || k_w.is_some()) {
        return Err(Error::backend(
            "qkv_norm_rope",
            "q/k norm weights given with the q/k norms off",
        ));
    }
    let (table, tlen, thalf, axial, pos) = match rope {
        Some((t, p)) => {
            let per_row = t.positions_per_row(hd)?;
            if p.len < per_row * qkv.rows {
                return Err(Error::backend("qkv_norm_rope", "fewer positions than rows"));
            }
            (t.buf.ptr, t.len, t.half, per_row == 2, p.ptr)
        }
        None => (DevPtr::NULL, 0, 0, false, DevPtr::NULL),
    };
    let e = qkv.buf.elem;
    let qkv_ptr = ptr_of_mut(qkv)?;
    let (qw, kw) = (
        q_w.map_or(DevPtr::NULL, |w| w.ptr),
        k_w.map_or(DevPtr::NULL, |w| w.ptr),
    );
    // The vector kernels need rows, weights and table aligned: the 4-wide one takes
    // split-half heads of 256·m (m ≤ 2), the 8-lane one axial heads of 64 (the vision tower).
    let aligned = vec4_aligned(&[(qkv_ptr, qkv.stride, e.size())], &[qw, kw, table]);
    let wide = aligned && !axial && (hd == 256 || hd == 512);
    let axial64 = aligned && axial && hd == 64;
    let k = &be.kernels.norm;
    let pairs = rope.is_some_and(|(t, _)| t.style == RopeStyle::Interleaved);
    let pairs_vec = pairs && aligned && hd.is_multiple_of(128) && thalf.is_multiple_of(2);
    let kernel = if pairs_vec {
        &k.qkv_norm_rope_pairs_vec
    } else if pairs {
        &k.qkv_norm_rope_pairs
    } else if axial64 {
        &k.qkv_norm_rope_axial64
    } else if axial {
        &k.qkv_norm_rope_axial
    } else if wide {
        &k.qkv_norm_rope_vec
    } else {
        &k.qkv_norm_rope
    };
    let heads = layout.heads_q + 2 * layout.heads_kv;
    // The kernels count heads in 32 bits (the interleaved 4-wide one in signed ints, a warp's
    // four heads past the last included).
    if qkv.rows * heads > (i32::MAX - 4) as usize {
        return Err(Error::backend(
            "qkv_norm_rope",
            format!("{} rows × {heads} heads exceed 2^31 per launch", qkv.rows),
        ));
    }
    // A warp per head, or per four heads in the 8-lane kernel and in the interleaved 4-wide one
    // at 128 columns a head (its loads all issued before its first sum).
    let per_warp = if axial64 || (pairs_vec && hd == 128) {
        4
    } else {
        1
    };
    let warps = (qkv.rows * heads).div_ceil(per_warp) as u32;
    let args = QkvNormRopeArgs {
        qkv: qkv_ptr,
        stride: qkv.stride as i64,
        rows: qkv.rows as i32,
        hq: layout.heads_q as i32,
        hkv: layout.heads_kv as i32,
        hd: hd as i32,
        qw,
        kw,
        v_norm: v_norm as i32,
        qk_norm: qk_norm as i32,
        eps,
        rope: table,
        rope_len: tlen as i32,
        tbl_half: thalf as i32,
        pos,
    };
    Ok(QkvLaunch {
        kernel,
        split_half: std::ptr::eq(kernel, &k.qkv_norm_rope),
        elem: e,
        args,
        grid: cfg((warps.div_ceil(8), 1), 256, 0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A warp's rows fill its 8 chunks of 4 values a lane: 8 rows up to 128 columns, 4 up to
    /// 256, 2 up to 512, 1 up to 1,024 (the kernels the table names).
    #[test]
    fn narrow_rows_go_several_to_a_warp() {
        for (cols, rows) in [
            (4, 8),
            (128, 8),
            (129, 4),
            (144, 4),
            (256, 4),
            (288, 2),
            (512, 2),
        ] {
            assert_eq!(warp_rows_per_warp(cols), rows, "{cols} columns");
        }
        for cols in [513, 576, 1024] {
            assert_eq!(warp_rows_per_warp(cols), 1, "{cols} columns");
        }
    }
}
