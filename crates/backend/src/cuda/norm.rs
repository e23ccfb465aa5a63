//! Row norms (kernels/norm.cu): RMSNorm, the residual add fused with the next norm, and the
//! per-head q/k norm with RoPE. Rows of 128·k columns (k ≤ 8) take the warp-per-row kernels.

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

use super::launch::{ByElem, ByPair, DevPtr, cfg, kernel_args, kernel_table, row_blocks};
use super::memory::{ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaBuf, Elem};
use crate::view::same_shape;
use crate::{After, QkvNorm, Residual, RopeStyle, RopeTable, View, ViewMut};

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
        v_norm: i32, eps: f32, rope: DevPtr, rope_len: i32, tbl_half: i32, pos: DevPtr,
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
        /// Axial 2-D RoPE, any head width.
        qkv_norm_rope_axial: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_axial_{}",
        /// Split-half RoPE on aligned heads of 256 or 512, 4-wide.
        qkv_norm_rope_vec: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_vec_{}",
        /// Axial 2-D RoPE on aligned heads of 64, 8 lanes a head.
        qkv_norm_rope_axial64: ByElem<QkvNormRopeArgs> = "qkv_norm_rope_axial64_{}",
    }
}

/// Every row start of each `(pointer, stride, element size)` is aligned for 4-element accesses,
/// and each f32 vector (null = none) for 16-byte ones: what the 4-wide norm kernels need.
fn vec4_aligned(rows: &[(DevPtr, usize, usize)], vectors: &[DevPtr]) -> bool {
    rows.iter().all(|&(ptr, stride, size)| {
        let align = 4 * size as u64;
        ptr.0.is_multiple_of(align) && ((stride * size) as u64).is_multiple_of(align)
    }) && vectors.iter().all(|v| v.0.is_multiple_of(16))
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

pub(super) fn rms_norm(
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

/// `h = (h + N_post(y)) · scale`, then `after`. The caller checked the shape of the step
/// ([`CudaBackend::check`]): an RMS post-norm, no gate, a weighted RMS next norm.
pub(super) fn residual_norm(
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
    let (optr, ostride, oe) = match out {
        Some(o) => {
            same_shape("residual_norm", (h.rows, h.cols), (o.rows, o.cols))?;
            (ptr_of_mut(o)?, o.stride, o.buf.elem)
        }
        None => (DevPtr::NULL, 0, Elem::F32),
    };
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

pub(super) fn qkv_norm_rope(
    be: &CudaBackend,
    qkv: ViewMut<'_, CudaBackend>,
    norm: &QkvNorm<'_, CudaBackend>,
    rope: Option<(&RopeTable<CudaBackend>, &CudaBuf)>,
) -> Result<()> {
    let QkvNorm {
        layout,
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
    let (table, tlen, thalf, axial, pos) = match rope {
        Some((t, p)) => {
            if t.style == RopeStyle::Interleaved {
                return Err(Error::backend("qkv_norm_rope", "interleaved RoPE"));
            }
            let per_row = t.positions_per_row(hd)?;
            if p.len < per_row * qkv.rows {
                return Err(Error::backend("qkv_norm_rope", "fewer positions than rows"));
            }
            (t.buf.ptr, t.len, t.half, per_row == 2, p.ptr)
        }
        None => (DevPtr::NULL, 0, 0, false, DevPtr::NULL),
    };
    let e = qkv.buf.elem;
    let qkv_ptr = ptr_of_mut(&qkv)?;
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
    let kernel = if axial64 {
        &k.qkv_norm_rope_axial64
    } else if axial {
        &k.qkv_norm_rope_axial
    } else if wide {
        &k.qkv_norm_rope_vec
    } else {
        &k.qkv_norm_rope
    };
    let heads = layout.heads_q + 2 * layout.heads_kv;
    if qkv.rows * heads > u32::MAX as usize {
        return Err(Error::backend(
            "qkv_norm_rope",
            format!("{} rows × {heads} heads exceed 2^32 per launch", qkv.rows),
        ));
    }
    // A warp per head, or per four heads in the 8-lane kernel.
    let warps = (qkv.rows * heads).div_ceil(if axial64 { 4 } else { 1 }) as u32;
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
        eps,
        rope: table,
        rope_len: tlen as i32,
        tbl_half: thalf as i32,
        pos,
    };
    be.launch(
        "norm",
        kernel.get(e)?,
        cfg((warps.div_ceil(8), 1), 256, 0),
        &args,
    )
}
