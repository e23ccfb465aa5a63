//! Row gathers, scatters and pooling (kernels/rows.cu): 2-D position rows added by index,
//! k×k average pooling of packed grids, rows scattered to listed places, and each row's first
//! largest value (greedy decoding's token).

use tessera_core::{Error, Result};

use super::launch::{ByElem, ByPair, DevPtr, cfg, kernel_args, kernel_table, row_blocks};
use super::memory::{ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaBuf, CudaTable, Elem};
use crate::{Grids, View, ViewMut};

kernel_args! {
    /// `add_positions_2d_{table}_{x}`: one block per row.
    pub(super) struct AddPositionsArgs {
        table: DevPtr, dim: i32, axis_rows: i32, pos: DevPtr, x: DevPtr, xs: i64,
    }
}

kernel_args! {
    /// `avg_pool2d_{x}_{out}`: a block per (pooled row, 128 columns).
    pub(super) struct AvgPoolArgs {
        x: DevPtr, xs: i64, grids: DevPtr, images: i32, k: i32, scale: f32, out: DevPtr, os: i64,
        cols: i32,
    }
}

kernel_args! {
    /// `scatter_rows_{src}_{dst}`: one block per source row.
    pub(super) struct ScatterRowsArgs {
        src: DevPtr, ss: i64, at: DevPtr, dst: DevPtr, ds: i64, cols: i32,
    }
}

kernel_args! {
    /// `argmax_rows_{x}`: one block per row.
    pub(super) struct ArgmaxRowsArgs {
        x: DevPtr, xs: i64, cols: i32, out: DevPtr,
    }
}

kernel_table! {
    /// The kernels of rows.cu.
    pub(super) struct RowsKernels from "rows.cu" {
        add_positions_2d: ByPair<AddPositionsArgs> = "add_positions_2d_{}_{}",
        avg_pool2d: ByPair<AvgPoolArgs> = "avg_pool2d_{}_{}",
        scatter_rows: ByPair<ScatterRowsArgs> = "scatter_rows_{}_{}",
        argmax_rows: ByElem<ArgmaxRowsArgs> = "argmax_rows_{}",
    }
}

pub(super) fn add_positions_2d(
    be: &CudaBackend,
    table: &CudaTable,
    axis_rows: usize,
    pos: &CudaBuf,
    x: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    if x.cols != table.dim
        || 2 * axis_rows > table.rows
        || pos.len < 2 * x.rows
        || pos.elem != Elem::U32
    {
        return Err(Error::backend(
            "add_positions_2d",
            format!(
                "{} positions for {}×{} rows from a {}×{} table ({axis_rows} per axis)",
                pos.len / 2,
                x.rows,
                x.cols,
                table.rows,
                table.dim
            ),
        ));
    }
    let args = AddPositionsArgs {
        table: table.buf.ptr,
        dim: table.dim as i32,
        axis_rows: axis_rows as i32,
        pos: pos.ptr,
        x: ptr_of_mut(&x)?,
        xs: x.stride as i64,
    };
    be.launch(
        "elementwise",
        be.kernels
            .rows
            .add_positions_2d
            .get(table.buf.elem, x.buf.elem)?,
        row_blocks(x.rows, x.cols, 0),
        &args,
    )
}

pub(super) fn avg_pool2d(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    grids: &Grids<CudaBackend>,
    scale: f32,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    grids.check((x.rows, x.cols), (out.rows, out.cols))?;
    let args = AvgPoolArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        grids: grids.dev.ptr,
        images: grids.dims.len() as i32,
        k: grids.kernel as i32,
        scale,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
        cols: x.cols as i32,
    };
    let grid = (out.rows as u32, x.cols.div_ceil(128) as u32);
    be.launch(
        "pool",
        be.kernels.rows.avg_pool2d.get(x.buf.elem, out.buf.elem)?,
        cfg(grid, 128, 0),
        &args,
    )
}

pub(super) fn scatter_rows(
    be: &CudaBackend,
    src: View<'_, CudaBackend>,
    rows: &CudaBuf,
    dst: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    if src.cols != dst.cols || rows.len < src.rows || rows.elem != Elem::U32 {
        return Err(Error::backend(
            "scatter_rows",
            format!(
                "{}×{} rows to {} places in {}×{}",
                src.rows, src.cols, rows.len, dst.rows, dst.cols
            ),
        ));
    }
    // Destination rows are checked on the host by the caller's contract; read them back
    // would cost a synchronisation, so the kernel trusts `rows` (built by the model).
    let args = ScatterRowsArgs {
        src: ptr_of(&src)?,
        ss: src.stride as i64,
        at: rows.ptr,
        dst: ptr_of_mut(&dst)?,
        ds: dst.stride as i64,
        cols: src.cols as i32,
    };
    be.launch(
        "elementwise",
        be.kernels
            .rows
            .scatter_rows
            .get(src.buf.elem, dst.buf.elem)?,
        row_blocks(src.rows, src.cols, 0),
        &args,
    )
}

pub(super) fn argmax_rows(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    out: &mut CudaBuf,
) -> Result<()> {
    if out.elem != Elem::U32 {
        return Err(Error::backend("argmax_rows", "out is not an index buffer"));
    }
    crate::check_argmax_rows(x.rows, x.cols, out.len)?;
    if x.cols > i32::MAX as usize {
        return Err(Error::backend(
            "argmax_rows",
            format!("rows of {} values", x.cols),
        ));
    }
    let args = ArgmaxRowsArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        cols: x.cols as i32,
        out: out.ptr,
    };
    // A vocabulary row (tens of thousands of logits) is one block's read: as many loads in
    // flight as a block holds; short rows need few threads.
    let block = if x.cols >= 16384 { 1024 } else { 128 };
    be.launch(
        "elementwise",
        be.kernels.rows.argmax_rows.get(x.buf.elem)?,
        cfg((x.rows as u32, 1), block, 0),
        &args,
    )
}
