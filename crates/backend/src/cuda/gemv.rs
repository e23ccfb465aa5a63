//! Products of at most [`MAX_ROWS`] bf16 rows (kernels/gemv.cu): decoding's products, which read
//! the whole weight for one to a few rows, where cuBLASLt reaches a fraction of HBM bandwidth.
//!
//! A CTA owns four weight rows and reads them once in 16-byte loads spread over its threads along
//! k, for every input row at once. Each row's f32 sum order depends on k alone, so a row gives
//! the same bits in a batch of decode rows as alone; it differs from cuBLASLt's order, so bf16
//! results move within rounding against the cuBLASLt path. Taken where the operands allow 16-byte
//! loads (bf16, k a multiple of 8, aligned x rows and weight); anything else stays on cuBLASLt,
//! as does f32 mode (whose products are compared with the CPU at 1e-5). `TESSERA_GEMV=0` sends
//! every product to cuBLASLt, for A/B measurement.
//!
//! Where k is a multiple of 32 the default is the tensor-core variant (`gemv_tc_m{8,16}`, also for
//! one row): at 8 and 16 rows the CUDA-core kernels pay M FMAs per weight element and read x once
//! per four weight rows. LFM2-VL-450M decode on an H100 (run g7, A B B A): 8 streams 8,615 tokens/s
//! against 6,838 on the CUDA-core kernels, 16 streams 14,935 against 10,153, one stream 1,163
//! against 1,246 (0.93×). `TESSERA_GEMV=cuda` takes the CUDA-core kernels for every k. Each
//! family's sum order depends on k alone, so batches stay invariant; the two orders differ, which
//! is why one mode is chosen per process, never per row count.

use tessera_core::Result;

use super::gemm::Rows;
use super::launch::{ByDim, DevPtr, cfg, kernel_args, kernel_table};
use super::norm::ResidualTail;
use super::{CudaBackend, CudaMat, Elem, MatFormat};
use crate::Activation;

kernel_args! {
    /// The operands every GEMV kernel takes first: `x[m, k]` (row stride `xs`) and `w[n, k]`.
    pub(super) struct GemvOperands { x: DevPtr, xs: i64, w: DevPtr, k: i32, n: i32, m: i32 }
}

impl GemvOperands {
    /// `rows` rows of `x` times `w`.
    fn of(x: Rows, rows: usize, w: &CudaMat) -> Self {
        GemvOperands {
            x: x.ptr,
            xs: x.stride as i64,
            w: w.buf.ptr,
            k: w.inner as i32,
            n: w.out as i32,
            m: rows as i32,
        }
    }
}

kernel_args! {
    /// `gemv_m{M}_{out}`: `out[m, n] (= or +=) α · x[m, k] · w[n, k]ᵀ` for `m ≤ M`; a CTA per
    /// four weight rows.
    pub(super) struct GemvArgs {
        ops: GemvOperands, out: DevPtr, os: i64, alpha: f32, accumulate: i32,
    }
}

kernel_args! {
    /// `gemv_tc_{act}_glu_m{M}`: a gated MLP's gate|up product `w = [gate; up]` (`n` rows) with
    /// the gating in its store, `out = act(x · W_gateᵀ) ⊙ (x · W_upᵀ)` in bf16.
    pub(super) struct GemvGluArgs { ops: GemvOperands, out: DevPtr, os: i64, alpha: f32 }
}

kernel_args! {
    /// `gemv_tc_res_m{M}`: `y = α · x · wᵀ` (bf16, never written) ended by the residual step
    /// `tail` (gemv.cu's `ResidualOut`).
    pub(super) struct GemvResArgs { ops: GemvOperands, alpha: f32, tail: ResidualTail }
}

/// The row counts the kernels (and blocks.rs's decode kernels) are built for; a product takes
/// the smallest that holds its rows ([`width`]).
pub(super) const WIDTHS: &[usize] = &[1, 2, 4, 8, 16];

/// The row counts of the tensor-core kernels (8 input rows an MMA column tile).
const TC_WIDTHS: &[usize] = &[8, 16];

kernel_table! {
    /// The kernels of gemv.cu, by the row count they are built for.
    pub(super) struct GemvKernels from "gemv.cu" {
        to_f32: ByDim<GemvArgs> = ("gemv_m{}_f32", WIDTHS),
        to_bf16: ByDim<GemvArgs> = ("gemv_m{}_bf16", WIDTHS),
        tc_to_f32: ByDim<GemvArgs> = ("gemv_tc_m{}_f32", TC_WIDTHS),
        tc_to_bf16: ByDim<GemvArgs> = ("gemv_tc_m{}_bf16", TC_WIDTHS),
        tc_gelu_glu: ByDim<GemvGluArgs> = ("gemv_tc_gelu_glu_m{}", TC_WIDTHS),
        tc_silu_glu: ByDim<GemvGluArgs> = ("gemv_tc_silu_glu_m{}", TC_WIDTHS),
        tc_res: ByDim<GemvResArgs> = ("gemv_tc_res_m{}", TC_WIDTHS),
    }
}

/// Which kernels take products of a few bf16 rows (`TESSERA_GEMV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// `0`: cuBLASLt (and the block formats' dequantize-then-product path).
    Off,
    /// `cuda`: the CUDA-core kernels `gemv_m{M}`.
    CudaCores,
    /// Unset (or anything else): `gemv_tc_m{M}` where k is a multiple of 32, else the CUDA-core
    /// kernels.
    TensorCores,
}

impl Mode {
    /// From `TESSERA_GEMV`.
    pub(super) fn from_env() -> Self {
        match std::env::var("TESSERA_GEMV").as_deref() {
            Ok("0") => Mode::Off,
            Ok("cuda") => Mode::CudaCores,
            _ => Mode::TensorCores,
        }
    }

    pub(super) fn on(self) -> bool {
        self != Mode::Off
    }
}

impl CudaBackend {
    /// Which kernels run decoding's products of a few rows (`tessera info` says it).
    pub fn decode_route(&self) -> String {
        let rows = format!("products of up to {MAX_ROWS} bf16 rows");
        match (self.compute_elem(), self.gemm.gemv) {
            (Elem::F32, _) => "cuBLASLt (f32: the exact path)".to_string(),
            (_, Mode::Off) => format!("{rows} on cuBLASLt (TESSERA_GEMV=0)"),
            (_, Mode::CudaCores) => format!(
                "{rows} on the GEMV kernel (CUDA cores, TESSERA_GEMV=cuda); block-format weights \
                 on their decode kernels"
            ),
            (_, Mode::TensorCores) => format!(
                "{rows} on the tensor-core GEMV where the inner width is a multiple of 32, \
                 else the CUDA-core one; block-format weights on their decode kernels; {}",
                self.fuse.describe()
            ),
        }
    }
}

/// Weight rows per CTA of the tensor-core kernels (one MMA's 16).
const TC_CTA_ROWS: usize = 16;

/// Whether a product of inner width `k` takes the tensor-core kernel under `mode`: a function of
/// `k` alone, so the choice never depends on the row count.
fn tensor_cores(mode: Mode, k: usize) -> bool {
    mode == Mode::TensorCores && k.is_multiple_of(32)
}

/// Threads per CTA of the tensor-core kernels for inner width `k`: a warp per four 32-wide steps,
/// one to eight warps. A function of `k` alone (the sum order depends on it).
pub(super) fn tc_threads(k: usize) -> u32 {
    (32 * (k / 32 / 4).clamp(1, 8)) as u32
}

/// The most input rows a product takes this path with.
pub(super) const MAX_ROWS: usize = 16;

/// Weight rows per CTA (`GEMV_ROWS` in gemv.cuh, for these kernels and blocks.cu's).
pub(super) const CTA_ROWS: usize = 4;

/// Threads per CTA for inner width `k`: one 8-wide chunk each across the row where that takes
/// 32 to 256 threads, so short rows leave no warp idle and long ones loop. A function of `k`
/// alone: the sum order may depend on it, never on the row count.
pub(super) fn threads(k: usize) -> u32 {
    (k / 8).next_multiple_of(32).clamp(32, 256) as u32
}

/// The kernel width for `rows` rows: the smallest of [`WIDTHS`] that holds them.
pub(super) fn width(rows: usize) -> Option<usize> {
    WIDTHS.iter().copied().find(|&m| m >= rows)
}

/// Whether `rows` rows of `x` times `w` into `into` can take the kernel: bf16 operands (a dense
/// weight), 1 to
/// [`MAX_ROWS`] rows, k a positive multiple of 8, x's first row, its row stride and the weight
/// 16-byte aligned, and every size an `int`.
pub(super) fn applies(x: Rows, x0: DevPtr, rows: usize, w: &CudaMat, into: Rows) -> bool {
    let MatFormat::Dense(ab) = w.format else {
        return false;
    };
    let aligned = |p: DevPtr| p.0.is_multiple_of(16);
    let fits = |v: usize| i32::try_from(v).is_ok();
    ab == Elem::Bf16
        && x.elem == Elem::Bf16
        && matches!(into.elem, Elem::F32 | Elem::Bf16)
        && (1..=MAX_ROWS).contains(&rows)
        && w.inner >= 8
        && w.inner.is_multiple_of(8)
        && x.stride.is_multiple_of(8)
        && aligned(x0)
        && aligned(w.buf.ptr)
        && fits(w.inner)
        && fits(w.out + TC_CTA_ROWS) // the last CTA's row indices
        && fits(x.stride)
}

/// Enqueue `into[0..rows] (= or +=) α · x[r0..r0+rows] · wᵀ` (`accumulate`: β = 1), where
/// [`applies`] holds.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv(
    be: &CudaBackend,
    x: Rows,
    r0: usize,
    rows: usize,
    w: &CudaMat,
    into: Rows,
    alpha: f32,
    accumulate: bool,
) -> Result<()> {
    let k = w.inner;
    let kernels = &be.kernels.gemv;
    // The family (its tables by output type, row widths, CTA rows and threads), then the output.
    let ((to_f32, to_bf16), built_for, cta_rows, block) = if tensor_cores(be.gemm.gemv, k) {
        let tables = (&kernels.tc_to_f32, &kernels.tc_to_bf16);
        (tables, tc_width(rows), TC_CTA_ROWS, tc_threads(k))
    } else {
        let tables = (&kernels.to_f32, &kernels.to_bf16);
        (tables, width(rows), CTA_ROWS, threads(k))
    };
    let table = if into.elem == Elem::Bf16 {
        to_bf16
    } else {
        to_f32
    };
    let Some(kernel) = built_for.and_then(|m| table.get(m)) else {
        return Err(tessera_core::Error::backend(
            "gemv",
            format!("no kernel for {rows} rows"),
        ));
    };
    let from_r0 = Rows { ptr: x.at(r0), ..x };
    let args = GemvArgs {
        ops: GemvOperands::of(from_r0, rows, w),
        out: into.ptr,
        os: into.stride as i64,
        alpha,
        accumulate: accumulate as i32,
    };
    let blocks = w.out.div_ceil(cta_rows) as u32;
    be.launch("gemm", kernel, cfg((blocks, 1), block, 0), &args)
}

/// Enqueue a gated MLP's gate|up product with the gating in its store, `out[0..rows] =
/// act(x · W_gateᵀ) ⊙ (x · W_upᵀ)` for `w = [gate; up]`, where the product into the bf16 rows `gu`
/// (`[rows, 2·inner]`, never written) would run on the tensor-core kernel: the fused kernel sums
/// and rounds each half as that kernel does and gates as the gated kernels do, so it gives the
/// same bits in one launch instead of two. `Ok(false)`, with nothing enqueued, where it would not.
#[allow(clippy::too_many_arguments)]
pub(super) fn glu_product(
    be: &CudaBackend,
    x: Rows,
    rows: usize,
    act: Activation,
    w: &CudaMat,
    gu: Rows,
    out: Rows,
    alpha: f32,
) -> Result<bool> {
    let k = w.inner;
    let fits = gu.elem == Elem::Bf16 && out.elem == Elem::Bf16 && w.out.is_multiple_of(2);
    if !(fits && tensor_cores(be.gemm.gemv, k) && applies(x, x.ptr, rows, w, gu)) {
        return Ok(false);
    }
    let table = match act {
        Activation::GeluTanh => &be.kernels.gemv.tc_gelu_glu,
        Activation::Silu => &be.kernels.gemv.tc_silu_glu,
        Activation::Gelu => return Ok(false),
    };
    let Some(kernel) = tc_width(rows).and_then(|m| table.get(m)) else {
        return Ok(false);
    };
    let args = GemvGluArgs {
        ops: GemvOperands::of(x, rows, w),
        out: out.ptr,
        os: out.stride as i64,
        alpha,
    };
    // Eight gate rows and their eight up rows a CTA.
    let blocks = (w.out / 2).div_ceil(TC_CTA_ROWS / 2) as u32;
    be.launch("gemm", kernel, cfg((blocks, 1), tc_threads(k), 0), &args)?;
    Ok(true)
}

/// Enqueue `y = α · x · wᵀ` (bf16 rows `y`, never written) ended by the residual step `tail` in
/// the same kernel, where the product would take the tensor-core kernel: the same bits as the
/// product into `y` then the residual kernel, in one launch. `Ok(false)`, with nothing enqueued,
/// where it would not.
pub(super) fn product_then_residual(
    be: &CudaBackend,
    x: Rows,
    rows: usize,
    w: &CudaMat,
    y: Rows,
    alpha: f32,
    tail: ResidualTail,
) -> Result<bool> {
    let k = w.inner;
    if y.elem != Elem::Bf16 || !(tensor_cores(be.gemm.gemv, k) && applies(x, x.ptr, rows, w, y)) {
        return Ok(false);
    }
    let Some(kernel) = tc_width(rows).and_then(|m| be.kernels.gemv.tc_res.get(m)) else {
        return Ok(false);
    };
    let args = GemvResArgs {
        ops: GemvOperands::of(x, rows, w),
        alpha,
        tail,
    };
    let blocks = w.out.div_ceil(TC_CTA_ROWS) as u32;
    be.launch("gemm", kernel, cfg((blocks, 1), tc_threads(k), 0), &args)?;
    Ok(true)
}

/// The tensor-core kernel width for `rows` rows.
fn tc_width(rows: usize) -> Option<usize> {
    TC_WIDTHS.iter().copied().find(|&m| m >= rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk of 8 has a thread where a row takes at most 256 of them, in whole warps.
    #[test]
    fn threads_cover_a_row_in_whole_warps() {
        for k in (8..=16384).step_by(8) {
            let t = threads(k) as usize;
            assert!(
                t.is_multiple_of(32) && (32..=256).contains(&t),
                "k = {k}: {t}"
            );
            if k / 8 <= 256 {
                assert!(t >= k / 8 && t < k / 8 + 32, "k = {k}: {t}");
            } else {
                assert_eq!(t, 256, "k = {k}");
            }
        }
    }

    #[test]
    fn every_row_count_has_a_kernel() {
        for rows in 1..=MAX_ROWS {
            assert!(width(rows).is_some(), "{rows} rows");
            assert!(tc_width(rows).is_some(), "{rows} rows (tensor cores)");
        }
        assert_eq!(WIDTHS.last(), Some(&MAX_ROWS));
        assert_eq!(TC_WIDTHS.last(), Some(&MAX_ROWS));
    }

    /// Whole warps, one to eight, and a warp never without a 32-wide step of k.
    #[test]
    fn tensor_core_threads_cover_k_in_whole_warps() {
        for k in (32..=16384).step_by(32) {
            let t = tc_threads(k) as usize;
            assert!(
                t.is_multiple_of(32) && (32..=256).contains(&t),
                "k = {k}: {t}"
            );
            assert!(
                t / 32 <= (k / 32).max(1),
                "k = {k}: {t} threads, {} steps",
                k / 32
            );
        }
        assert!(!tensor_cores(Mode::TensorCores, 1000));
        assert!(tensor_cores(Mode::TensorCores, 1024));
        assert!(!tensor_cores(Mode::CudaCores, 1024));
    }
}
