//! Products on weights in GGUF block formats — Q8_0, Q4_0, Q4_K, Q6_K — kept on the device as
//! the file stores them (issue #31), so a model takes its file's size in device memory (what
//! lets Qwen-Image's Q4_K pipeline aim at 12 GiB).
//!
//! - Layout: the file's bytes unchanged, rows of blocks back to back. A stacked matrix (q|k|v,
//!   gate|up) is a list of [`BlockRun`]s: consecutive parts of one format join into one run, and
//!   a part in another format (LFM2's Q4_K_M files stack Q4_K and Q6_K parts) starts a new run,
//!   each run at a 16-byte-aligned offset of the buffer ([`layout`]). Rows are not padded: every
//!   block is an even number of bytes (34, 18, 144, 210), so every block starts 2-byte aligned
//!   and the kernels read codes with 2-byte loads (Q4_K's 144-byte super-blocks stay 16-byte
//!   aligned, and its nibbles are read 8 bytes at a time); padding rows to 16 bytes would not
//!   align Q6_K's 210-byte blocks inside a row anyway, and would cost a host copy of the file.
//! - At most [`gemv::MAX_ROWS`](super::gemv::MAX_ROWS) rows (decoding): `qgemv_{fmt}_m{M}_{x}_{out}`
//!   (kernels/blocks.cu) streams the blocks and decodes them on the fly, as gemv.cu streams bf16
//!   weights: four weight rows per CTA, f32 sums whose order depends on k alone, so a row's result
//!   does not depend on the batch. Taken where x's rows are 16-byte aligned; else, and for more
//!   rows, the next path.
//! - More rows: a column block of the run's rows is decoded into the dense workspace
//!   ([`Workspace::Dequant`], in the activations' type) by `dequant_{fmt}_{out}` and multiplied
//!   by cuBLASLt ([`super::gemm::dense`]); exact relative to the decoded weights in f32, the
//!   weights rounded to bf16 once under bf16 as a bf16 checkpoint's are.
//! - Each run is its own launch into its own output columns; the product's epilogue (bias,
//!   activation, gate, accumulate) is the dense path's ([`super::gemm::matmul`]).
//!
//! The decode is that of `tessera_core::gguf` (f16 scales widened exactly, each product of the
//! decode rounded on its own), so the weights the kernels multiply are the CPU reference's.

use tessera_core::{DType, Error, Result, Tensor};

use super::gemm::Rows;
use super::gemv::{CTA_ROWS, WIDTHS, threads, width};
use super::launch::{ByDimPair, ByElem, DevPtr, cfg, kernel_args, kernel_table};
use super::memory::Workspace;
use super::{CudaBackend, CudaMat, Elem, MatFormat};
use crate::Role;

kernel_args! {
    /// `qgemv_{fmt}_m{M}_{x}_{out}`: `out[m, n] (= or +=) α · x[m, k] · w[n, k]ᵀ` for `m ≤ M`,
    /// `w` rows of `rb` bytes; a CTA per four weight rows.
    pub(super) struct QgemvArgs {
        x: DevPtr, xs: i64, w: DevPtr, rb: i64, k: i32, n: i32, m: i32, out: DevPtr, os: i64,
        alpha: f32, accumulate: i32,
    }
}

kernel_args! {
    /// `dequant_{fmt}_{out}`: `rows` rows of `k` decoded values, row-major, into `out`.
    pub(super) struct DequantArgs {
        w: DevPtr, rb: i64, k: i32, rows: i32, out: DevPtr,
    }
}

kernel_table! {
    /// The kernels of blocks.cu: per format, the decode products by row count and (x, out)
    /// types, and the decoder into a dense matrix by output type.
    pub(super) struct BlockKernels from "blocks.cu" {
        q8_0: ByDimPair<QgemvArgs> = ("qgemv_q8_0_m{}_{}_{}", WIDTHS),
        q4_0: ByDimPair<QgemvArgs> = ("qgemv_q4_0_m{}_{}_{}", WIDTHS),
        q4_k: ByDimPair<QgemvArgs> = ("qgemv_q4_k_m{}_{}_{}", WIDTHS),
        q6_k: ByDimPair<QgemvArgs> = ("qgemv_q6_k_m{}_{}_{}", WIDTHS),
        dequant_q8_0: ByElem<DequantArgs> = "dequant_q8_0_{}",
        dequant_q4_0: ByElem<DequantArgs> = "dequant_q4_0_{}",
        dequant_q4_k: ByElem<DequantArgs> = "dequant_q4_k_{}",
        dequant_q6_k: ByElem<DequantArgs> = "dequant_q6_k_{}",
    }
}

impl BlockKernels {
    fn qgemv(&self, t: DType) -> Result<&ByDimPair<QgemvArgs>> {
        match t {
            DType::Q8_0 => Ok(&self.q8_0),
            DType::Q4_0 => Ok(&self.q4_0),
            DType::Q4_K => Ok(&self.q4_k),
            DType::Q6_K => Ok(&self.q6_k),
            _ => Err(unsupported(t)),
        }
    }

    fn dequant(&self, t: DType) -> Result<&ByElem<DequantArgs>> {
        match t {
            DType::Q8_0 => Ok(&self.dequant_q8_0),
            DType::Q4_0 => Ok(&self.dequant_q4_0),
            DType::Q4_K => Ok(&self.dequant_q4_k),
            DType::Q6_K => Ok(&self.dequant_q6_k),
            _ => Err(unsupported(t)),
        }
    }
}

/// The block formats with CUDA products.
pub(super) const FORMATS: [DType; 4] = [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K];

fn unsupported(t: DType) -> Error {
    Error::Device(format!(
        "{t} weights have no CUDA products (the block formats there are {FORMATS:?})"
    ))
}

/// Each run starts at a multiple of this many bytes of the buffer.
const RUN_ALIGN: usize = 16;

/// Rows `start..start + len` of a block-format matrix, all in `dtype`, from byte `at` of its
/// buffer, `row_bytes` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockRun {
    pub start: usize,
    pub len: usize,
    pub dtype: DType,
    pub at: usize,
    pub row_bytes: usize,
}

/// The runs of a block-format matrix on the device.
pub struct BlockRuns {
    runs: Vec<BlockRun>,
}

/// Where a block-format matrix's stacked parts lie in its buffer.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub runs: Vec<BlockRun>,
    /// Each part's first byte.
    pub parts: Vec<usize>,
    /// The buffer's size.
    pub bytes: usize,
}

/// The layout of stacked parts `(format, rows)` of `inner` values a row: consecutive parts of one
/// format join one run, each run starts 16-byte aligned.
pub(super) fn layout(parts: &[(DType, usize)], inner: usize) -> Result<Layout> {
    let mut runs: Vec<BlockRun> = Vec::new();
    let mut offsets = Vec::with_capacity(parts.len());
    let mut end = 0usize;
    let mut row = 0usize;
    for &(dtype, rows) in parts {
        if !FORMATS.contains(&dtype) {
            return Err(unsupported(dtype));
        }
        let row_bytes = dtype.bytes_for(inner).ok_or_else(|| {
            Error::backend(
                "matrix",
                format!("rows of {inner} values are not whole {dtype} blocks"),
            )
        })?;
        let bytes = rows
            .checked_mul(row_bytes)
            .ok_or_else(|| Error::backend("matrix", "size overflow"))?;
        match runs.last_mut() {
            Some(last) if last.dtype == dtype => last.len += rows,
            _ => {
                end = end.next_multiple_of(RUN_ALIGN);
                runs.push(BlockRun {
                    start: row,
                    len: rows,
                    dtype,
                    at: end,
                    row_bytes,
                });
            }
        }
        offsets.push(end);
        end += bytes;
        row += rows;
    }
    Ok(Layout {
        runs,
        parts: offsets,
        bytes: end,
    })
}

/// Whether this matrix's parts go up as blocks: any part in a block format.
pub(super) fn is_block(parts: &[Tensor<'_>]) -> bool {
    parts.iter().any(|t| FORMATS.contains(&t.dtype))
}

/// Upload `parts` (block-format tensors, stacked along their rows) as their stored bytes.
pub(super) fn upload(be: &CudaBackend, parts: &[Tensor<'_>]) -> Result<CudaMat> {
    let (out, inner) = crate::stacked_shape(parts)?;
    let mut shapes = Vec::with_capacity(parts.len());
    for t in parts {
        if !FORMATS.contains(&t.dtype) {
            return Err(Error::Device(format!(
                "`{}` is {}, stacked with block-format parts: a stacked matrix on CUDA is all in \
                 block formats ({FORMATS:?}) or all float",
                t.name, t.dtype
            )));
        }
        let (rows, _) = t.dims2_blocks()?;
        shapes.push((t.dtype, rows));
    }
    let Layout {
        runs,
        parts: at,
        bytes,
    } = layout(&shapes, inner)?;
    let mut buf = be.alloc_buf(bytes.div_ceil(4), Role::Index)?;
    for (t, &at) in parts.iter().zip(&at) {
        be.write_bytes_at(&mut buf, at, &t.bytes)?;
    }
    // Made now, at load, so that no product allocates it inside a graph capture.
    be.workspace(Workspace::Dequant)?;
    Ok(CudaMat {
        buf,
        out,
        inner,
        format: MatFormat::Block(BlockRuns { runs }),
    })
}

/// Whether the decode kernels take `rows` rows of `x` (first row at `x0`) into `into`: 1 to
/// [`super::gemv::MAX_ROWS`] float rows, x's first row and row stride 16-byte aligned, every
/// size an `int`.
fn decode_applies(x: Rows, x0: DevPtr, rows: usize, w: &CudaMat, into: Rows) -> bool {
    let fits = |v: usize| i32::try_from(v).is_ok();
    matches!(x.elem, Elem::F32 | Elem::Bf16)
        && matches!(into.elem, Elem::F32 | Elem::Bf16)
        && (1..=super::gemv::MAX_ROWS).contains(&rows)
        && x0.0.is_multiple_of(16)
        && (x.stride * x.elem.size()).is_multiple_of(16)
        && fits(w.inner)
        && fits(w.out + CTA_ROWS)
        && fits(x.stride)
}

/// Enqueue `into[0..rows] (= or +=) α · x[r0..r0+rows] · wᵀ` (β 0 or 1) on a block-format
/// matrix: run by run, on the decode kernels when they apply, else decoded a column block at a
/// time into the workspace and multiplied by cuBLASLt.
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
    be: &CudaBackend,
    x: Rows,
    r0: usize,
    rows: usize,
    w: &CudaMat,
    into: Rows,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let MatFormat::Block(b) = &w.format else {
        return Err(Error::backend("block matmul", "not a block-format matrix"));
    };
    if beta != 0.0 && beta != 1.0 {
        return Err(Error::backend(
            "block matmul",
            format!("β = {beta} (block-format products take 0 or 1)"),
        ));
    }
    if !matches!(x.elem, Elem::F32 | Elem::Bf16) {
        return Err(Error::backend(
            "block matmul",
            format!("{:?} activations", x.elem),
        ));
    }
    let k = w.inner;
    if rows == 0 || w.out == 0 || k == 0 {
        return Ok(());
    }
    let size = into.elem.size();
    let decode = be.gemm.gemv.on() && decode_applies(x, x.at(r0), rows, w, into);
    for run in &b.runs {
        let out = Rows {
            ptr: DevPtr(into.ptr.0 + (run.start * size) as u64),
            ..into
        };
        let weights = DevPtr(w.buf.ptr.0 + run.at as u64);
        if decode {
            decode_run(be, x, r0, rows, run, weights, k, out, alpha, beta == 1.0)?;
        } else {
            dequant_run(be, x, r0, rows, run, weights, k, out, alpha, beta)?;
        }
    }
    Ok(())
}

/// One run on the decode kernels.
#[allow(clippy::too_many_arguments)]
fn decode_run(
    be: &CudaBackend,
    x: Rows,
    r0: usize,
    rows: usize,
    run: &BlockRun,
    weights: DevPtr,
    k: usize,
    out: Rows,
    alpha: f32,
    accumulate: bool,
) -> Result<()> {
    let table = be.kernels.blocks.qgemv(run.dtype)?;
    let Some(kernel) = width(rows).and_then(|m| table.get(m, x.elem, out.elem)) else {
        return Err(Error::backend(
            "block gemv",
            format!(
                "no kernel for {rows} rows of {:?} into {:?}",
                x.elem, out.elem
            ),
        ));
    };
    let args = QgemvArgs {
        x: x.at(r0),
        xs: x.stride as i64,
        w: weights,
        rb: run.row_bytes as i64,
        k: k as i32,
        n: run.len as i32,
        m: rows as i32,
        out: out.ptr,
        os: out.stride as i64,
        alpha,
        accumulate: accumulate as i32,
    };
    let blocks = run.len.div_ceil(CTA_ROWS) as u32;
    be.launch("gemm", kernel, cfg((blocks, 1), threads(k), 0), &args)
}

/// Rows of a `k`-wide dense matrix of `elem` that a workspace of `bytes` holds, a multiple of 16
/// (so each block's output columns keep the output's alignment), at most `rows`.
fn block_rows(bytes: usize, k: usize, elem: Elem, rows: usize) -> usize {
    let fit = bytes / (k * elem.size()).max(1);
    (fit / 16 * 16).min(rows)
}

/// One run decoded a column block at a time into the dense workspace and multiplied there.
#[allow(clippy::too_many_arguments)]
fn dequant_run(
    be: &CudaBackend,
    x: Rows,
    r0: usize,
    rows: usize,
    run: &BlockRun,
    weights: DevPtr,
    k: usize,
    out: Rows,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let (ws, _) = be.workspace(Workspace::Dequant)?;
    let block = block_rows(Workspace::Dequant.bytes(), k, x.elem, run.len);
    if block == 0 || i32::try_from(k).is_err() {
        return Err(Error::backend(
            "block matmul",
            format!("rows of {k} values are too wide for the decode workspace"),
        ));
    }
    let kernel = be.kernels.blocks.dequant(run.dtype)?.get(x.elem)?;
    let size = out.elem.size();
    for j0 in (0..run.len).step_by(block) {
        let nb = block.min(run.len - j0);
        let args = DequantArgs {
            w: DevPtr(weights.0 + (j0 * run.row_bytes) as u64),
            rb: run.row_bytes as i64,
            k: k as i32,
            rows: nb as i32,
            out: ws,
        };
        be.launch("gemm", kernel, be.grid_stride(nb * k / 8), &args)?;
        let to = Rows {
            ptr: DevPtr(out.ptr.0 + (j0 * size) as u64),
            ..out
        };
        super::gemm::dense(be, x, r0, rows, ws, nb, k, x.elem, to, alpha, beta)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_of_one_format_join_and_others_start_aligned_runs() {
        // LFM2 Q4_K_M: q and k in Q4_K, v in Q6_K, 1024 wide (4 super-blocks a row).
        let Layout { runs, parts, bytes } = layout(
            &[(DType::Q4_K, 1024), (DType::Q4_K, 512), (DType::Q6_K, 512)],
            1024,
        )
        .unwrap();
        let q4 = 4 * 144;
        let q6 = 4 * 210;
        assert_eq!(
            runs,
            [
                BlockRun {
                    start: 0,
                    len: 1536,
                    dtype: DType::Q4_K,
                    at: 0,
                    row_bytes: q4
                },
                BlockRun {
                    start: 1536,
                    len: 512,
                    dtype: DType::Q6_K,
                    at: (1536 * q4).next_multiple_of(16),
                    row_bytes: q6
                },
            ]
        );
        assert_eq!(parts, [0, 1024 * q4, runs[1].at]);
        assert_eq!(bytes, (1536 * q4).next_multiple_of(16) + 512 * q6);
    }

    #[test]
    fn an_unaligned_run_end_pads_the_next_run() {
        // 3 rows of one Q8_0 block (34 bytes) end at 102: the Q4_0 run starts at 112.
        let Layout { runs, parts, bytes } =
            layout(&[(DType::Q8_0, 3), (DType::Q4_0, 2)], 32).unwrap();
        assert_eq!(runs[1].at, 112);
        assert_eq!(parts, [0, 112]);
        assert_eq!(runs[1].row_bytes, 18);
        assert_eq!(bytes, 112 + 36);
        // Back to Q8_0: a third run.
        let runs = layout(&[(DType::Q8_0, 3), (DType::Q4_0, 2), (DType::Q8_0, 1)], 32)
            .unwrap()
            .runs;
        assert_eq!(runs.len(), 3);
        assert_eq!((runs[2].start, runs[2].at), (5, 160));
        for r in &runs {
            assert!(r.at.is_multiple_of(RUN_ALIGN));
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_and_float_parts_are_refused() {
        assert!(layout(&[(DType::Q4_K, 2)], 128).is_err());
        assert!(layout(&[(DType::Q8_0, 2)], 48).is_err());
        assert!(layout(&[(DType::BF16, 2)], 64).is_err());
        assert!(layout(&[(DType::F8_E4M3, 2)], 64).is_err());
    }

    #[test]
    fn every_block_starts_two_byte_aligned_and_q4_k_sixteen() {
        // What the kernels' loads rest on (blocks.cu): runs 16-byte aligned, blocks even-sized.
        for t in FORMATS {
            assert!(t.block_bytes().is_multiple_of(2), "{t}");
        }
        assert!(DType::Q4_K.block_bytes().is_multiple_of(16));
    }

    #[test]
    fn workspace_blocks_are_sixteen_rows_or_every_row() {
        // Qwen-Image's widest: 12288 rows of 3072 decode to bf16 in two blocks.
        let b = block_rows(64 << 20, 3072, Elem::Bf16, 12288);
        assert_eq!(b % 16, 0);
        assert_eq!(12288_usize.div_ceil(b), 2);
        assert_eq!(block_rows(64 << 20, 1024, Elem::F32, 1000), 1000);
        // Rows too wide for sixteen in the workspace: none.
        assert_eq!(block_rows(1 << 20, 1 << 16, Elem::F32, 100), 0);
    }
}
