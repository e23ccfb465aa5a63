//! Products on FP8 e4m3 weights (issue #31): cuBLASLt's FP8 GEMMs on Hopper, weights kept as
//! their stored codes.
//!
//! - Weights: the codes `[n, k]` as stored (row-major, one byte each; rows padded with zero codes
//!   to a multiple of 16 so every operand is 16-byte aligned), and their scales: one for the
//!   tensor, which cuBLASLt applies as A's scale; one per stacked part of a per-tensor file
//!   (q|k|v, gate|up), each part then its own product with its scale as A's; or one per row
//!   (per-channel files, `--quantize fp8`), applied to the output columns by the epilogue kernel
//!   (`epilogue_scaled_*`) with A's scale 1 — both unless outer-vector scales take them (below).
//! - Activations (bf16) are rounded to e4m3 on the device with one scale per product,
//!   `amax / 448` (kernels/fp8.cu: a block-max pass, then scale-and-convert), which cuBLASLt
//!   applies as B's scale. A product larger than the activation buffer ([`ACT_BYTES`]) takes a
//!   scale per block of rows.
//! - Scales that differ by row (per-row ones, or stacked parts') go to cuBLASLt as an outer-vector
//!   A scale where it takes one (CUDA 12.9+; probed once, [`Fp8Gemm::outer`]): each output column
//!   times its row's scale inside one product, B's scale then a vector of `m` copies of the
//!   activation scale (outer-vector scaling is both operands' or neither's), so a product with
//!   nothing after it writes bf16 straight into its output instead of a product per part, or f32
//!   into the workspace and back through the epilogue.
//! - One cuBLASLt matmul, "TN" as FP8 requires (the weight is the transposed operand, both
//!   operands' `k` contiguous, `k` a multiple of 16), f32 compute with fast accumulation off so
//!   every partial sum is f32, into the output (a per-tensor scale, no epilogue, aligned output)
//!   or into the f32 product workspace a block of rows at a time, then the epilogue.
//!
//! Under [`Precision::F32`] (the exact mode) FP8 weights are decoded to f32 at upload (code ×
//! scale, as the CPU decodes them), so products equal the CPU's; FP8 products run under bf16.
//! A matrix whose rows are not a multiple of 16 wide cannot be an FP8 operand; under bf16 it is
//! decoded to bf16 at upload.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, CudaStream};
use tessera_core::{DType, Error, Result, Tensor};

use super::cublaslt::{
    Alignments, Handle, Layouts, WORKSPACE_BYTES, check, device_bytes, set_attr,
};
use super::elementwise::ScaledEpilogueArgs;
use super::gemm::{Post, Rows};
use super::launch::{DevPtr, Kernel, cfg, kernel_args, kernel_table};
use super::memory::Workspace;
use super::{CudaBackend, CudaBuf, CudaMat, Elem, MatFormat};
use crate::cpu::quant::{QuantMat, quantize_stack};
use crate::op::check_product;
use crate::{Epilogue, Precision, Role, View, ViewMut};

kernel_args! {
    /// `fp8_amax_bf16`: each block's largest |x| into `part[block]` (`v8`: eight values a load).
    pub(super) struct AmaxArgs {
        x: DevPtr, xs: i64, rows: i64, cols: i32, v8: i32, part: DevPtr,
    }
}

kernel_args! {
    /// `fp8_quantize_bf16`: `s = max(part) / 448`, `q = e4m3(x / s)` packed, `scale[..nscale] = s`.
    pub(super) struct QuantizeArgs {
        x: DevPtr, xs: i64, rows: i64, cols: i32, v8: i32, part: DevPtr, parts: i32, q: DevPtr,
        scale: DevPtr, nscale: i32,
    }
}

kernel_table! {
    /// The kernels of fp8.cu (sm_90a).
    pub(super) struct Fp8Kernels from "fp8.cu" {
        amax: Kernel<AmaxArgs> = "fp8_amax_bf16",
        quantize: Kernel<QuantizeArgs> = "fp8_quantize_bf16",
    }
}

/// The activation codes of one product (or block of rows): 64 MiB, a 1024² Z-Image step's
/// widest input (≈4,600 tokens × 10,240) in one piece.
const ACT_BYTES: usize = 64 << 20;

/// Blocks of the amax pass at most (each leaves one partial maximum).
const PARTS: usize = 1024;

/// FP8 operands need 16-byte rows and 16-byte-aligned addresses.
const ALIGN: usize = 16;

/// Rows of one outer-vector product at most: the length of its B scale vector (256 KiB).
const OUTER_ROWS: usize = 1 << 16;

/// Runs of rows with one scale each at most this many are multiplied run by run, each with its
/// scale as A's: stacked per-tensor parts (q|k|v, gate|up) need no epilogue then.
const MAX_RUNS: usize = 8;

/// Rows `start..start + len` of an FP8 matrix sharing one scale (one f32 on the device).
struct Run {
    start: usize,
    len: usize,
    scale: CudaBuf,
}

/// An FP8 matrix's scales on the device.
pub struct Fp8Scales {
    /// Runs of rows sharing a scale: one for a per-tensor scale, one per stacked part of a
    /// per-tensor file; none when there are more than [`MAX_RUNS`] (per-row scales).
    runs: Vec<Run>,
    /// A's scale when one product covers every row: the single run's scale, else 1 (with `rows`).
    whole: CudaBuf,
    /// One scale per row (output column) when they differ: cuBLASLt's outer-vector A scale, or
    /// the epilogue's column scales.
    rows: Option<CudaBuf>,
    /// Rows in the code buffer: `out` rounded up to a multiple of 16 (zero codes after `out`).
    padded: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Fp8PlanKey {
    m: u64,
    n: u64,
    k: u64,
    ldd: i64,
    d: Elem,
    accumulate: bool,
    /// Outer-vector scales: A's one per weight row (`n`), B's one per activation row (`m`).
    outer: bool,
    /// The operands' address alignments: the weight rows' own; the codes and the workspace are
    /// allocations; a direct run's output columns are 16-byte aligned (checked before that path).
    align: Alignments,
}

struct Plan {
    lay: Layouts,
    algo: lt::cublasLtMatmulAlgo_t,
}

/// cuBLASLt state and device buffers of the FP8 products, made with the first FP8 matrix (at
/// load, never inside a graph capture) and kept until the backend goes: graphs captured with
/// their addresses stay valid.
pub(super) struct Fp8Gemm {
    lt: Handle,
    /// The activation codes, [`ACT_BYTES`].
    _act: CudaSlice<u8>,
    act: u64,
    /// The amax pass's block maxima, [`PARTS`] f32.
    _parts: CudaSlice<u8>,
    parts: u64,
    /// The activation scale (one f32), B's scale pointer in every scalar-scaled plan.
    _scale: CudaSlice<u8>,
    scale: u64,
    /// The activation scale once per row ([`OUTER_ROWS`] f32), B's in every outer-vector plan.
    _row_scales: CudaSlice<u8>,
    row_scales: u64,
    /// Whether this cuBLASLt multiplies with outer-vector scales (asked once, in [`Fp8Gemm::new`]).
    outer: bool,
    /// Each shape's plan, or why cuBLASLt has none (kept, so a shape is asked about once).
    plans: Mutex<HashMap<Fp8PlanKey, std::result::Result<Plan, String>>>,
}

// SAFETY: as for the dense products' `Gemm`: plain cuBLASLt handles, every use of the plans
// under the `plans` lock (which also orders setting A's scale pointer before its launch).
unsafe impl Send for Fp8Gemm {}
unsafe impl Sync for Fp8Gemm {}

fn out_type(e: Elem) -> Result<lt::cudaDataType> {
    match e {
        Elem::Bf16 => Ok(lt::cudaDataType::CUDA_R_16BF),
        Elem::F32 => Ok(lt::cudaDataType::CUDA_R_32F),
        Elem::U32 => Err(Error::backend(
            "fp8 matmul",
            "an index buffer as the output",
        )),
    }
}

impl Fp8Gemm {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let lt = Handle::new(stream)?;
        let (_act, act) = device_bytes(stream, ACT_BYTES)?;
        let (_parts, parts) = device_bytes(stream, PARTS * 4)?;
        let (_scale, scale) = device_bytes(stream, 4)?;
        let (_row_scales, row_scales) = device_bytes(stream, OUTER_ROWS * 4)?;
        let mut g = Fp8Gemm {
            lt,
            _act,
            act,
            _parts,
            parts,
            _scale,
            scale,
            _row_scales,
            row_scales,
            outer: false,
            plans: Mutex::new(HashMap::new()),
        };
        g.outer = g.takes_outer_vectors(stream);
        Ok(g)
    }

    /// Whether cuBLASLt runs an outer-vector-scaled FP8 product here: an algorithm for a 16³
    /// product, and its launch accepted (cuBLASLt can offer one and still refuse the scale mode
    /// when called). The probe multiplies whatever the activation buffer holds into the amax
    /// pass's partial maxima, scratch that every quantization writes before it reads.
    fn takes_outer_vectors(&self, stream: &CudaStream) -> bool {
        let key = Fp8PlanKey {
            m: 16,
            n: 16,
            k: 16,
            ldd: 16,
            d: Elem::Bf16,
            accumulate: false,
            outer: true,
            align: Alignments::of(0, 0, 0),
        };
        self.has_plan(key)
            && self
                .run(stream, key, self.act, self.row_scales, self.parts, 1.0)
                .is_ok()
    }

    fn plan(&self, key: Fp8PlanKey) -> Result<Plan> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        let e4m3 = lt::cudaDataType::CUDA_R_8F_E4M3;
        // Column-major: A = W viewed as [k, n] (ld k), B = the activation codes as [k, m]
        // (ld k), C = D = outᵀ as [n, m].
        let lay = Layouts::tn(
            (key.n, key.m, key.k),
            (e4m3, key.k as i64),
            (e4m3, key.k as i64),
            (out_type(key.d)?, key.ldd),
        )?;
        // Every partial sum in f32 (Hopper's fast FP8 accumulation keeps fewer bits).
        set_attr(lay.desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &0i8)?;
        let x_scale = if key.outer {
            let mode = lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
            set_attr(lay.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode)?;
            set_attr(lay.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode)?;
            self.row_scales
        } else {
            self.scale
        };
        // B's is always the activation scale(s); A's is set per launch (each weight's own), this
        // only a placeholder until then.
        set_attr(lay.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &x_scale)?;
        set_attr(lay.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale)?;
        let algo = lay.algorithms(&self.lt, 1, key.align, &key)?[0];
        Ok(Plan { lay, algo })
    }

    /// Enqueue `d[m, n] (= or +=) α · s_w · s_x · codes(x) · codes(w)ᵀ`, the activation codes
    /// being those [`quantize`] left in the activation buffer.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        stream: &CudaStream,
        key: Fp8PlanKey,
        w: u64,
        w_scale: u64,
        d: u64,
        alpha: f32,
    ) -> Result<()> {
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::backend("fp8 gemm", "plan cache poisoned"))?;
        let p = match plans
            .entry(key)
            .or_insert_with(|| self.plan(key).map_err(|e| e.to_string()))
        {
            Ok(p) => p,
            Err(e) => return Err(Error::backend("fp8 gemm", e.clone())),
        };
        // The pointer is read when the launch is enqueued (and captured with it in a graph); the
        // scale it addresses lives as long as its matrix, which outlives every forward.
        set_attr(
            p.lay.desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &w_scale,
        )?;
        let beta = key.accumulate as u8 as f32;
        // SAFETY: from `w` lie `key.n` rows of `k` codes (a run's rows, or all padded rows, of
        // a live matrix), the activation buffer holds m × k codes (m · k ≤ ACT_BYTES, as the
        // caller blocks rows), `d` covers m rows of ldd elements from its first column (a view
        // checked by the caller, or the product workspace, whose capacity bounds m · ldd); the
        // scales are live f32 device values; the plan's layouts describe exactly these extents
        // and the workspace is ours.
        let s = unsafe {
            lt::cublasLtMatmul(
                self.lt.raw,
                p.lay.desc,
                (&alpha as *const f32).cast(),
                w as *const c_void,
                p.lay.a,
                self.act as *const c_void,
                p.lay.b,
                (&beta as *const f32).cast(),
                d as *const c_void,
                p.lay.d,
                d as *mut c_void,
                p.lay.d,
                &p.algo,
                self.lt.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as lt::cudaStream_t,
            )
        };
        check("FP8 matmul", s)
    }
}

impl Fp8Gemm {
    /// Whether cuBLASLt has an algorithm for `key` (its plan made and kept on first ask).
    fn has_plan(&self, key: Fp8PlanKey) -> bool {
        let Ok(mut plans) = self.plans.lock() else {
            return false;
        };
        plans
            .entry(key)
            .or_insert_with(|| self.plan(key).map_err(|e| e.to_string()))
            .is_ok()
    }
}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        // The plans before the handle (a field, dropped after this).
        if let Ok(mut p) = self.plans.lock() {
            p.clear();
        }
    }
}

impl CudaBackend {
    /// The FP8 product state, made on first call (an FP8 matrix's upload).
    pub(super) fn fp8_gemm(&self) -> Result<Arc<Fp8Gemm>> {
        let mut slot = self
            .fp8
            .lock()
            .map_err(|_| Error::backend("fp8", "lock poisoned"))?;
        if let Some(g) = slot.as_ref() {
            return Ok(g.clone());
        }
        let g = Arc::new(Fp8Gemm::new(&self.stream)?);
        *slot = Some(g.clone());
        Ok(g)
    }

    /// Whether this device runs FP8 products (sm_90a: the e4m3 conversion and cuBLASLt's FP8).
    pub(super) fn has_fp8(&self) -> bool {
        self.kernels.fp8.is_some()
    }
}

/// Upload FP8 weights: `parts` as stored (F8_E4M3 with their scales), or float parts quantized
/// here with a scale per row (`quantize`: `--quantize fp8`, rounded as the CPU rounds them).
pub(super) fn upload(be: &CudaBackend, parts: &[Tensor<'_>], quantize: bool) -> Result<CudaMat> {
    let (out, inner) = crate::stacked_shape(parts)?;
    let q = if quantize {
        quantize_stack(parts, DType::F8_E4M3, (out, inner))?
    } else {
        QuantMat::stack(parts)?.0
    };
    if be.precision == Precision::F32 || !inner.is_multiple_of(ALIGN) {
        return decoded(be, &q, out, inner);
    }
    if !be.has_fp8() {
        return Err(Error::Device(format!(
            "FP8 products need cuBLASLt's FP8 GEMMs on Hopper (sm_90a); this device is {}",
            be.arch
        )));
    }
    let padded = out.next_multiple_of(ALIGN);
    // Codes four to a u32 word (`padded · inner` is a multiple of 256), zero past `out` rows.
    let mut buf = be.alloc_buf(padded * inner / 4, Role::Index)?;
    be.write_bytes_at(&mut buf, 0, q.blocks())?;
    let scales = q.scales();
    let scalar = |v: f32| -> Result<CudaBuf> {
        let mut b = be.alloc_buf(1, Role::Stream)?;
        be.write_f32_to(&mut b, &[v])?;
        Ok(b)
    };
    let spans: Vec<(usize, usize, f32)> = scales
        .chunk_by(|a, b| a == b)
        .scan(0, |start, c| {
            let span = (*start, c.len(), c[0]);
            *start += c.len();
            Some(span)
        })
        .collect();
    let runs = if spans.len() <= MAX_RUNS {
        spans
            .iter()
            .map(|&(start, len, s)| {
                Ok(Run {
                    start,
                    len,
                    scale: scalar(s)?,
                })
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let uniform = spans.len() <= 1;
    let whole = scalar(if uniform {
        spans.first().map_or(1.0, |s| s.2)
    } else {
        1.0
    })?;
    let rows = if uniform {
        None
    } else {
        let mut b = be.alloc_buf(out, Role::Stream)?;
        be.write_f32_to(&mut b, scales)?;
        Some(b)
    };
    // Made now, at load, so that no product makes it inside a graph capture.
    be.fp8_gemm()?;
    Ok(CudaMat {
        buf,
        out,
        inner,
        format: MatFormat::Fp8(Fp8Scales {
            runs,
            whole,
            rows,
            padded,
        }),
    })
}

/// `q` decoded (code × row scale, in f32 as the CPU decodes it) into a dense matrix of the
/// compute type, a slice of rows at a time.
fn decoded(be: &CudaBackend, q: &QuantMat, out: usize, inner: usize) -> Result<CudaMat> {
    let elem = be.compute_elem();
    let mut buf = be.alloc_buf(out * inner, Role::Compute)?;
    let step = ((1 << 22) / inner.max(1)).max(1);
    let mut values = vec![0f32; step.min(out) * inner];
    for r0 in (0..out).step_by(step) {
        let r1 = (r0 + step).min(out);
        let v = &mut values[..(r1 - r0) * inner];
        q.dequantize_rows(r0..r1, v);
        be.write_f32_at(&mut buf, r0 * inner, v)?;
    }
    Ok(CudaMat {
        buf,
        out,
        inner,
        format: MatFormat::Dense(elem),
    })
}

/// Where [`quantize`] leaves the activation scale: B's scalar, or B's outer vector (one per row).
#[derive(Clone, Copy)]
enum XScale {
    Scalar,
    PerRow,
}

/// Round `rows` rows of `x` (bf16, `cols` a multiple of 16) to e4m3 codes in the activation
/// buffer, with the scale `amax / 448` left where `to` says.
fn quantize(
    be: &CudaBackend,
    g: &Fp8Gemm,
    x: Rows,
    rows: usize,
    cols: usize,
    to: XScale,
) -> Result<()> {
    let k = be
        .kernels
        .fp8
        .as_ref()
        .ok_or_else(|| Error::backend("fp8 matmul", "no FP8 kernels on this device"))?;
    if x.elem != Elem::Bf16 {
        return Err(Error::backend(
            "fp8 matmul",
            format!("{:?} activations (FP8 products take bf16)", x.elem),
        ));
    }
    let n = rows * cols;
    let parts = n.div_ceil(256).clamp(1, PARTS);
    let (xs, rows_i, cols_i) = (x.stride as i64, rows as i64, cols as i32);
    // Eight bf16 a load where every row starts on 16 bytes.
    let v8 = x.ptr.0.is_multiple_of(16) && (x.stride * 2).is_multiple_of(16);
    let (scale, nscale) = match to {
        XScale::Scalar => (g.scale, 1),
        XScale::PerRow => (g.row_scales, rows),
    };
    be.launch(
        "fp8",
        &k.amax,
        cfg((parts as u32, 1), 256, 0),
        &AmaxArgs {
            x: x.ptr,
            xs,
            rows: rows_i,
            cols: cols_i,
            v8: v8 as i32,
            part: DevPtr(g.parts),
        },
    )?;
    be.launch(
        "fp8",
        &k.quantize,
        be.grid_stride(n / if v8 { 8 } else { 2 }),
        &QuantizeArgs {
            x: x.ptr,
            xs,
            rows: rows_i,
            cols: cols_i,
            v8: v8 as i32,
            part: DevPtr(g.parts),
            parts: parts as i32,
            q: DevPtr(g.act),
            scale: DevPtr(scale),
            nscale: nscale as i32,
        },
    )
}

/// `into[0..m] (= or +=) post(α · x[0..m] · wᵀ)` on an FP8 matrix: a block of rows at a time,
/// each rounded to e4m3 with its own scale (one block unless `m · k` exceeds [`ACT_BYTES`]),
/// multiplied straight into `into` when nothing follows the product (in one product with
/// outer-vector scales where they differ by row and cuBLASLt takes them, else run by run), else
/// in one product into the f32 product workspace and through the scaled epilogue.
#[allow(clippy::too_many_arguments)]
fn run(
    be: &CudaBackend,
    x: Rows,
    m: usize,
    w: &CudaMat,
    into: Rows,
    alpha: f32,
    accumulate: bool,
    post: Post,
) -> Result<()> {
    let MatFormat::Fp8(f) = &w.format else {
        return Err(Error::backend("fp8 matmul", "not an FP8 matrix"));
    };
    let (n, k) = (w.out, w.inner);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let g = be.fp8_gemm()?;
    let size = into.elem.size();
    let into_aligned =
        into.ptr.0.is_multiple_of(ALIGN as u64) && (into.stride * size).is_multiple_of(ALIGN);
    // Straight into the output, run by run, when nothing follows the product and every run's
    // rows and output columns keep cuBLASLt's 16-byte alignment.
    let direct = post.is_none()
        && !f.runs.is_empty()
        && into_aligned
        && f.runs
            .iter()
            .all(|r| r.len.is_multiple_of(ALIGN) && (r.start * size).is_multiple_of(ALIGN));
    let act_rows = (ACT_BYTES / k).max(1);
    let shape = be.profiler.as_ref().map(|_| format!("{m}x{n}x{k}"));
    // `out_align`: the output's (16 bytes for a direct run's columns, 256 for the workspace); the
    // codes' buffer (B) is an allocation, 256-aligned (`Alignments::of` reads address 0 so).
    let plan_key = |rows: usize,
                    n: usize,
                    ldd: usize,
                    d: Elem,
                    accumulate: bool,
                    w_at: u64,
                    out_align: u32| {
        Fp8PlanKey {
            m: rows as u64,
            n: n as u64,
            k: k as u64,
            ldd: ldd as i64,
            d,
            accumulate,
            outer: false,
            align: Alignments {
                d: out_align,
                ..Alignments::of(w_at, 0, 0)
            },
        }
    };
    // Scales differing by row as outer vectors: every row of the weight in one product straight
    // into the output, blocks of at most OUTER_ROWS rows (B's scale vector).
    if let Some(row_scales) = f
        .rows
        .as_ref()
        .filter(|_| g.outer && post.is_none() && into_aligned)
    {
        let block = act_rows.min(OUTER_ROWS);
        let outer_key = |rows: usize| Fp8PlanKey {
            outer: true,
            ..plan_key(
                rows,
                n,
                into.stride,
                into.elem,
                accumulate,
                w.buf.ptr.0,
                ALIGN as u32,
            )
        };
        if block_shapes(m, block).all(|rows| g.has_plan(outer_key(rows))) {
            for r0 in (0..m).step_by(block) {
                let rows = block.min(m - r0);
                quantize(be, &g, x_at(x, r0), rows, k, XScale::PerRow)?;
                let (key, d_at) = (outer_key(rows), into.at(r0).0);
                be.timed("gemm", shape.as_deref(), || {
                    g.run(&be.stream, key, w.buf.ptr.0, row_scales.ptr.0, d_at, alpha)
                })?;
            }
            return Ok(());
        }
    }
    let run_w = |run: &Run| w.buf.ptr.0 + (run.start * k) as u64;
    // A run's product straight into the output: its columns there are 16-byte aligned.
    let direct_key = |rows: usize, run: &Run| {
        plan_key(
            rows,
            run.len,
            into.stride,
            into.elem,
            accumulate,
            run_w(run),
            ALIGN as u32,
        )
    };
    // Every shape the direct path takes (a full block of rows and the last one) must have an
    // algorithm; where cuBLASLt has none, the workspace path runs instead.
    let direct = direct
        && block_shapes(m, act_rows)
            .all(|rows| f.runs.iter().all(|run| g.has_plan(direct_key(rows, run))));
    if direct {
        for r0 in (0..m).step_by(act_rows) {
            let rows = act_rows.min(m - r0);
            quantize(be, &g, x_at(x, r0), rows, k, XScale::Scalar)?;
            for run in &f.runs {
                let (w_at, key) = (run_w(run), direct_key(rows, run));
                let d_at = into.at(r0).0 + (run.start * size) as u64;
                be.timed("gemm", shape.as_deref(), || {
                    g.run(&be.stream, key, w_at, run.scale.ptr.0, d_at, alpha)
                })?;
            }
        }
        return Ok(());
    }
    let (ws, capacity) = be.workspace(Workspace::Product)?;
    let block = (capacity / f.padded).min(act_rows).max(1);
    let kernel = be
        .kernels
        .elementwise
        .epilogue_scaled
        .get(Elem::F32, into.elem)?;
    for r0 in (0..m).step_by(block) {
        let rows = block.min(m - r0);
        quantize(be, &g, x_at(x, r0), rows, k, XScale::Scalar)?;
        let key = plan_key(rows, f.padded, f.padded, Elem::F32, false, w.buf.ptr.0, 256);
        be.timed("gemm", shape.as_deref(), || {
            g.run(&be.stream, key, w.buf.ptr.0, f.whole.ptr.0, ws.0, alpha)
        })?;
        let args = ScaledEpilogueArgs {
            y: ws,
            ys: f.padded as i64,
            o: into.at(r0),
            os: into.stride as i64,
            rows: rows as i64,
            cols: n as i32,
            cs: f.rows.as_ref().map_or(DevPtr::NULL, |b| b.ptr),
            bias: post.bias,
            act: post.act,
            g: post.gate_from(r0),
            gs: post.gate_stride as i64,
            tanh: post.tanh,
            accumulate: accumulate as i32,
        };
        be.launch("elementwise", kernel, be.grid_stride(rows * n), &args)?;
    }
    Ok(())
}

/// The row counts of `m` rows taken `block` at a time: a full block's and the last one's (each
/// needs its cuBLASLt plan before a path is chosen).
fn block_shapes(m: usize, block: usize) -> impl Iterator<Item = usize> {
    [block.min(m), m % block]
        .into_iter()
        .filter(|&rows| rows > 0)
}

/// Rows of `x` from row `r0`.
fn x_at(x: Rows, r0: usize) -> Rows {
    Rows { ptr: x.at(r0), ..x }
}

/// [`super::gemm::product`] on an FP8 matrix: `into[0..rows] (= or +=) α · x[r0..r0+rows] · wᵀ`
/// (β 0 or 1), as a convolution's column blocks need.
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
    run(
        be,
        x_at(x, r0),
        rows,
        w,
        into,
        alpha,
        beta != 0.0,
        Post::NONE,
    )
}

/// The `matmul` op on an FP8 matrix: `out = ep(x · wᵀ)`.
pub(super) fn matmul(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: &CudaMat,
    out: ViewMut<'_, CudaBackend>,
    ep: &Epilogue<'_, CudaBackend>,
) -> Result<()> {
    check_product(&x, (w.out, w.inner), &out)?;
    let post = Post::of(ep, out.rows, out.cols)?;
    let (xr, outr) = (Rows::of(&x)?, Rows::of_mut(&out)?);
    run(be, xr, x.rows, w, outr, ep.alpha, ep.accumulate, post)
}
