//! Element-wise ops (kernels/elementwise.cu): embedding lookup, casts, gated activations and
//! per-segment means.

use tessera_core::{Error, Result};

use super::launch::{
    ByElem, ByPair, DevPtr, cfg, kernel_args, kernel_table, row_blocks, vec4_aligned,
};
use super::memory::{ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaBuf, CudaTable, Elem};
use crate::view::same_shape;
use crate::{Activation, Segments, View, ViewMut};

kernel_args! {
    /// `embed_{table}_f32`: one block per row.
    pub(super) struct EmbedArgs {
        table: DevPtr, dim: i32, ids: DevPtr, scale: f32, out: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `cast_{x}_{y}`: one block per row; `cast_vec_{x}_{y}`: four values a thread, grid-stride.
    pub(super) struct CastArgs {
        x: DevPtr, xs: i64, y: DevPtr, ys: i64, rows: i64, cols: i32,
    }
}

kernel_args! {
    /// `gated[_vec]_{act}_{t}`: a grid-stride loop over elements (or 16-byte vectors).
    pub(super) struct GatedArgs {
        g: DevPtr, gs: i64, u: DevPtr, us: i64, o: DevPtr, os: i64, rows: i64, cols: i32,
    }
}

kernel_args! {
    /// `segment_mean_{x}`: a block per (segment, 128 columns).
    pub(super) struct SegmentMeanArgs {
        x: DevPtr, xs: i64, offsets: DevPtr, out: DevPtr, os: i64, cols: i32,
    }
}

kernel_args! {
    /// `epilogue[_vec]_{y}_{o}`: `o (= or +=) g ⊙ act(y + bias)` after a product, grid-stride
    /// (`_vec`: four columns a thread).
    pub(super) struct EpilogueArgs {
        y: DevPtr, ys: i64, o: DevPtr, os: i64, rows: i64, cols: i32, bias: DevPtr, act: i32,
        g: DevPtr, gs: i64, tanh: i32, accumulate: i32,
    }
}

kernel_args! {
    /// `epilogue_scaled_{y}_{o}`: the epilogue with each column first multiplied by `cs[c]` (an
    /// FP8 weight's per-row scales).
    pub(super) struct ScaledEpilogueArgs {
        y: DevPtr, ys: i64, o: DevPtr, os: i64, rows: i64, cols: i32, cs: DevPtr, bias: DevPtr,
        act: i32, g: DevPtr, gs: i64, tanh: i32, accumulate: i32,
    }
}

kernel_args! {
    /// `rgb8_{x}`: a grid-stride loop over the view's values, packed into bytes at `out`, the
    /// count and least index of those not finite into `bad[0..2]`.
    pub(super) struct Rgb8Args {
        x: DevPtr, xs: i64, rows: i64, cols: i32, out: DevPtr, bad: DevPtr,
    }
}

kernel_args! {
    /// `map_bytes_{t}`: a grid-stride loop over `n` bytes, each written as `table[byte]`.
    pub(super) struct MapBytesArgs {
        src: DevPtr, table: DevPtr, dst: DevPtr, n: i64,
    }
}

kernel_table! {
    /// The kernels of elementwise.cu.
    pub(super) struct ElementwiseKernels from "elementwise.cu" {
        embed: ByElem<EmbedArgs> = "embed_{}_f32",
        cast: ByPair<CastArgs> = "cast_{}_{}",
        cast_vec: ByPair<CastArgs> = "cast_vec_{}_{}",
        gated_gelu: ByElem<GatedArgs> = "gated_gelu_{}",
        gated_silu: ByElem<GatedArgs> = "gated_silu_{}",
        gated_vec_gelu: ByElem<GatedArgs> = "gated_vec_gelu_{}",
        gated_vec_silu: ByElem<GatedArgs> = "gated_vec_silu_{}",
        segment_mean: ByElem<SegmentMeanArgs> = "segment_mean_{}",
        /// A product's bias, activation, gate and accumulation (`y` may be `o`: in place).
        epilogue: ByPair<EpilogueArgs> = "epilogue_{}_{}",
        /// The same four columns a thread (aligned rows and vectors, 4 | columns).
        epilogue_vec: ByPair<EpilogueArgs> = "epilogue_vec_{}_{}",
        /// The same after a product on FP8 weights with a scale per row.
        epilogue_scaled: ByPair<ScaledEpilogueArgs> = "epilogue_scaled_{}_{}",
        rgb8: ByElem<Rgb8Args> = "rgb8_{}",
        map_bytes: ByElem<MapBytesArgs> = "map_bytes_{}",
    }
}

pub(super) fn embed(
    be: &CudaBackend,
    table: &CudaTable,
    ids: &CudaBuf,
    scale: f32,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    if out.cols != table.dim
        || ids.len < out.rows
        || ids.elem != Elem::U32
        || out.buf.elem != Elem::F32
    {
        return Err(Error::backend(
            "embed",
            format!(
                "{} ids into {}×{} (f32) from a table of width {}",
                ids.len, out.rows, out.cols, table.dim
            ),
        ));
    }
    // The ids were checked against the table's rows (the vocabulary) by the model before upload.
    let args = EmbedArgs {
        table: table.buf.ptr,
        dim: table.dim as i32,
        ids: ids.ptr,
        scale,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
    };
    be.launch(
        "elementwise",
        be.kernels.elementwise.embed.get(table.buf.elem)?,
        cfg((out.rows as u32, 1), 128, 0),
        &args,
    )
}

pub(super) fn cast(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    same_shape("cast", (x.rows, x.cols), (out.rows, out.cols))?;
    if x.rows == 0 || x.cols == 0 {
        return Ok(());
    }
    let args = CastArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        y: ptr_of_mut(&out)?,
        ys: out.stride as i64,
        rows: x.rows as i64,
        cols: x.cols as i32,
    };
    // Four values a thread where whole 4-vectors tile every row at aligned starts, in 32-bit
    // vector indices; else a block a row.
    let rows = [
        (args.x, x.stride, x.buf.elem.size()),
        (args.y, out.stride, out.buf.elem.size()),
    ];
    let vec = x.cols.is_multiple_of(4)
        && x.rows * x.cols / 4 <= u32::MAX as usize
        && vec4_aligned(&rows, &[]);
    let k = &be.kernels.elementwise;
    let (table, launch) = if vec {
        (&k.cast_vec, be.grid_stride(x.rows * x.cols / 4))
    } else {
        (&k.cast, row_blocks(x.rows, x.cols, 0))
    };
    be.launch(
        "elementwise",
        table.get(x.buf.elem, out.buf.elem)?,
        launch,
        &args,
    )
}

/// A VAE's output `x` as 8-bit values at `out` (rows packed), with the count and least packed
/// index of the values that are not finite at `bad` (which must hold 0 and `u32::MAX`).
pub(super) fn rgb8(
    be: &CudaBackend,
    x: &View<'_, CudaBackend>,
    out: DevPtr,
    bad: DevPtr,
) -> Result<()> {
    let args = Rgb8Args {
        x: ptr_of(x)?,
        xs: x.stride as i64,
        rows: x.rows as i64,
        cols: x.cols as i32,
        out,
        bad,
    };
    let kernel = be.kernels.elementwise.rgb8.get(x.buf.elem)?;
    be.launch(
        "elementwise",
        kernel,
        be.grid_stride(x.rows * x.cols),
        &args,
    )
}

pub(super) fn gated(
    be: &CudaBackend,
    gate: View<'_, CudaBackend>,
    up: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
    act: Activation,
) -> Result<()> {
    same_shape("gated", (gate.rows, gate.cols), (up.rows, up.cols))?;
    same_shape("gated", (gate.rows, gate.cols), (out.rows, out.cols))?;
    let e = gate.buf.elem;
    if up.buf.elem != e || out.buf.elem != e {
        return Err(Error::backend(
            "gated",
            "gate, up and out must share one element type",
        ));
    }
    let k = &be.kernels.elementwise;
    let (scalar, vector) = match act {
        Activation::GeluTanh => (&k.gated_gelu, &k.gated_vec_gelu),
        Activation::Silu => (&k.gated_silu, &k.gated_vec_silu),
        Activation::Gelu => return Err(Error::Device("gated erf GELU: no CUDA kernel".into())),
    };
    // 16-byte vectors when every row start is 16-byte aligned and whole vectors tile a row
    // (and there are fewer than 2^32 vectors: the kernel indexes them in 32 bits).
    let v = 16 / e.size();
    let aligned = |off: usize, stride: usize| off.is_multiple_of(v) && stride.is_multiple_of(v);
    let vec = gate.cols.is_multiple_of(v)
        && gate.rows * gate.cols / v <= u32::MAX as usize
        && aligned(gate.offset, gate.stride)
        && aligned(up.offset, up.stride)
        && aligned(out.offset, out.stride);
    let kernel = if vec { vector } else { scalar };
    let n = gate.rows * gate.cols / if vec { v } else { 1 };
    let args = GatedArgs {
        g: ptr_of(&gate)?,
        gs: gate.stride as i64,
        u: ptr_of(&up)?,
        us: up.stride as i64,
        o: ptr_of_mut(&out)?,
        os: out.stride as i64,
        rows: gate.rows as i64,
        cols: gate.cols as i32,
    };
    if n == 0 {
        return Ok(());
    }
    be.launch("elementwise", kernel.get(e)?, be.grid_stride(n), &args)
}

pub(super) fn segment_mean(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    if out.rows != segs.count()
        || out.cols != x.cols
        || segs.total() != x.rows
        || out.buf.elem != Elem::F32
    {
        return Err(Error::backend(
            "segment_mean",
            format!(
                "{} segments over {} rows into {}×{}",
                segs.count(),
                x.rows,
                out.rows,
                out.cols
            ),
        ));
    }
    let args = SegmentMeanArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        offsets: segs.dev.ptr,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
        cols: x.cols as i32,
    };
    let grid = (out.rows as u32, x.cols.div_ceil(128) as u32);
    be.launch(
        "pool",
        be.kernels.elementwise.segment_mean.get(x.buf.elem)?,
        cfg(grid, 128, 0),
        &args,
    )
}

/// `dst[i] = table[src[i]]` for `n` bytes at `src`, rounded to `elem` (`dst`'s element type).
pub(super) fn map_bytes(
    be: &CudaBackend,
    src: DevPtr,
    table: DevPtr,
    dst: DevPtr,
    elem: Elem,
    n: usize,
) -> Result<()> {
    let args = MapBytesArgs {
        src,
        table,
        dst,
        n: n as i64,
    };
    let k = &be.kernels.elementwise;
    be.launch(
        "elementwise",
        k.map_bytes.get(elem)?,
        be.grid_stride(n),
        &args,
    )
}
