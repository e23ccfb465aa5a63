//! Dense GEMMs through cuBLASLt, and the `matmul` op on them: bf16 (or f32) operands, f32
//! accumulation, bf16 or f32 output.
//!
//! Row-major `out[m, n] = α · x[m, k] · w[n, k]ᵀ` is computed as the column-major product
//! `outᵀ = op(W) · xᵀ` with `op = transpose` on the weight, so no operand is ever copied. Each
//! distinct shape gets a plan (descriptors + the heuristic's algorithm) made once and cached.
//!
//! For products of at least [`TUNE_MIN_ROWS`] rows the plan keeps the heuristic's first
//! [`CANDIDATES`] algorithms and, on the shape's first run, times each on the real operands and
//! keeps the fastest: the heuristic's first choice leaves most multiprocessors idle on the
//! narrow products of one long input (2,208 tokens × 512 outputs is 72 tiles of 128×128 on 132
//! multiprocessors). Smaller products (short queries) keep the first choice, since their shapes
//! vary from request to request and are launch-bound. Timing makes the choice, and so the last
//! bits of bf16 results, vary between processes; `TESSERA_GEMM_TUNE=0` keeps the heuristic's
//! first choice everywhere, for runs that must repeat bit for bit.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys as lt;
use cudarc::driver::CudaStream;
use tessera_core::{Error, Result};

use super::cublaslt::{Alignments, Handle, Layouts, WORKSPACE_BYTES, check};
use super::elementwise::EpilogueArgs;
use super::launch::{DevPtr, vec4_aligned};
use super::memory::{Workspace, ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaMat, Elem, MatFormat};
use super::{gemv, norm};
use crate::op::check_product;
use crate::{Activation, Epilogue, ThenResidual, View, ViewMut};

/// Algorithms a tuned plan times.
pub const CANDIDATES: usize = 8;

/// Products with fewer rows are not timed.
pub const TUNE_MIN_ROWS: usize = 1024;

/// Timed launches per candidate, after one warm-up.
const TUNE_REPS: usize = 3;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct PlanKey {
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldd: i64,
    ab: Elem,
    d: Elem,
    /// `β = 1`: adds to what the output holds, so its plan is never timed on live operands.
    accumulate: bool,
    /// The operands' address alignments: the algorithms offered depend on them.
    align: Alignments,
}

struct Plan {
    lay: Layouts,
    /// The heuristic's algorithms, best guess first.
    algos: Vec<lt::cublasLtMatmulAlgo_t>,
    /// The one in use: the first until a tuning run picks another.
    chosen: usize,
    /// Whether the candidates still have to be timed.
    untuned: bool,
}

pub(super) struct Gemm {
    lt: Handle,
    plans: Mutex<HashMap<PlanKey, Plan>>,
    /// Time candidate algorithms (`TESSERA_GEMM_TUNE` unset or not `0`).
    tune: bool,
    /// Which kernels take products of a few bf16 rows ([`super::gemv`], `TESSERA_GEMV`); unless
    /// off, those on block-format weights take their decode kernels ([`super::blocks`]).
    pub(super) gemv: gemv::Mode,
}

// SAFETY: the cuBLASLt handle and plan descriptors are plain handles that cuBLASLt allows to be
// used from any thread; every use goes through `&self` methods that lock `plans` first, so no two
// threads configure or launch through them at once.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

fn data_type(e: Elem) -> lt::cudaDataType {
    match e {
        Elem::Bf16 => lt::cudaDataType::CUDA_R_16BF,
        Elem::F32 | Elem::U32 => lt::cudaDataType::CUDA_R_32F,
    }
}

/// Operands of one product (device pointers are byte addresses of the first element).
struct GemmArgs {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: u64,
    pub x_stride: usize,
    pub w: u64,
    pub ab: Elem,
    pub out: u64,
    pub out_stride: usize,
    pub out_elem: Elem,
    pub alpha: f32,
    /// 0 (overwrite) or 1 (accumulate into the output).
    pub beta: f32,
}

impl Gemm {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Gemm {
            lt: Handle::new(stream)?,
            plans: Mutex::new(HashMap::new()),
            tune: std::env::var("TESSERA_GEMM_TUNE").map_or(true, |v| v != "0"),
            gemv: gemv::Mode::from_env(),
        })
    }

    fn plan(&self, key: PlanKey) -> Result<Plan> {
        // Column-major: A = W viewed as [k, n] (ld k), B = xᵀ as [k, m] (ld x_stride),
        // D = outᵀ as [n, m] (ld out_stride).
        let lay = Layouts::tn(
            (key.n, key.m, key.k),
            (data_type(key.ab), key.lda),
            (data_type(key.ab), key.ldb),
            (data_type(key.d), key.ldd),
        )?;
        let wanted = if self.tune && !key.accumulate && key.m as usize >= TUNE_MIN_ROWS {
            CANDIDATES
        } else {
            1
        };
        let algos = lay.algorithms(&self.lt, wanted, key.align, &key)?;
        Ok(Plan {
            untuned: algos.len() > 1,
            lay,
            algos,
            chosen: 0,
        })
    }

    /// Launch `a` with algorithm `algo` of plan `p`.
    fn launch(
        &self,
        stream: &CudaStream,
        p: &Plan,
        algo: &lt::cublasLtMatmulAlgo_t,
        a: &GemmArgs,
    ) -> Result<()> {
        // SAFETY: pointers address device buffers that the caller checked to cover the operand
        // extents; the plan's layouts describe exactly those extents; the workspace is ours.
        let s = unsafe {
            lt::cublasLtMatmul(
                self.lt.raw,
                p.lay.desc,
                (&a.alpha as *const f32).cast(),
                a.w as *const c_void,
                p.lay.a,
                a.x as *const c_void,
                p.lay.b,
                (&a.beta as *const f32).cast(),
                a.out as *const c_void,
                p.lay.d,
                a.out as *mut c_void,
                p.lay.d,
                algo,
                self.lt.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as lt::cudaStream_t,
            )
        };
        check("matmul", s)
    }

    /// Time every candidate of `p` on `a`'s operands (which the real launch then overwrites) and
    /// keep the fastest. Not while `stream` is being captured into a graph: timing needs the
    /// host to wait, so such a plan keeps its first choice until a direct run.
    fn tune(&self, stream: &CudaStream, p: &mut Plan, a: &GemmArgs) -> Result<()> {
        let capturing = stream
            .capture_status()
            .map_err(|e| Error::backend("gemm tuning", e))?;
        if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        let ctx = stream.context();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ev = |e| Error::backend("gemm tuning", e);
        let mut best: Option<(f32, usize)> = None;
        for (i, algo) in p.algos.iter().enumerate() {
            // A candidate that fails to launch (workspace, alignment) is skipped.
            if self.launch(stream, p, algo, a).is_err() {
                continue;
            }
            let (start, end) = (
                ctx.new_event(flags).map_err(ev)?,
                ctx.new_event(flags).map_err(ev)?,
            );
            start.record(stream).map_err(ev)?;
            for _ in 0..TUNE_REPS {
                self.launch(stream, p, algo, a)?;
            }
            end.record(stream).map_err(ev)?;
            let ms = start.elapsed_ms(&end).map_err(ev)?;
            if best.is_none_or(|(b, _)| ms < b) {
                best = Some((ms, i));
            }
        }
        p.chosen = best.map_or(0, |(_, i)| i);
        p.untuned = false;
        Ok(())
    }

    /// Enqueue `out = α · x · wᵀ` on `stream`.
    fn run(&self, stream: &CudaStream, a: &GemmArgs) -> Result<()> {
        let key = PlanKey {
            m: a.m as u64,
            n: a.n as u64,
            k: a.k as u64,
            lda: a.k as i64,
            ldb: a.x_stride as i64,
            ldd: a.out_stride as i64,
            ab: a.ab,
            d: a.out_elem,
            accumulate: a.beta != 0.0,
            align: Alignments::of(a.w, a.x, a.out),
        };
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::backend("gemm", "plan cache poisoned"))?;
        let p = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(key)?),
        };
        if p.untuned {
            self.tune(stream, p, a)?;
        }
        self.launch(stream, p, &p.algos[p.chosen], a)
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // The plans before the handle (a field, dropped after this).
        if let Ok(mut p) = self.plans.lock() {
            p.clear();
        }
    }
}

/// Rows of a matrix on the device: the address of row 0, the row stride and element type.
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub ptr: DevPtr,
    pub stride: usize,
    pub elem: Elem,
}

impl Rows {
    /// The rows of `v` (its bounds checked).
    pub fn of(v: &View<'_, CudaBackend>) -> Result<Rows> {
        Ok(Rows {
            ptr: ptr_of(v)?,
            stride: v.stride,
            elem: v.buf.elem,
        })
    }

    /// The rows of `v` (its bounds checked).
    pub fn of_mut(v: &ViewMut<'_, CudaBackend>) -> Result<Rows> {
        Ok(Rows {
            ptr: ptr_of_mut(v)?,
            stride: v.stride,
            elem: v.buf.elem,
        })
    }

    /// The address of row `r`.
    pub fn at(self, r: usize) -> DevPtr {
        DevPtr(self.ptr.0 + (r * self.stride * self.elem.size()) as u64)
    }
}

/// What the epilogue kernel applies after the product (null pointers: none); the FP8 products'
/// scaled epilogue ([`super::fp8`]) applies the same after its column scales.
#[derive(Clone, Copy)]
pub(super) struct Post {
    pub bias: DevPtr,
    /// −1 none, 0 GELU (tanh), 1 SiLU: the kernels' codes.
    pub act: i32,
    gate: DevPtr,
    /// 0: one broadcast gate row.
    pub gate_stride: usize,
    pub tanh: i32,
}

impl Post {
    /// Nothing after the product.
    pub const NONE: Post = Post {
        bias: DevPtr::NULL,
        act: -1,
        gate: DevPtr::NULL,
        gate_stride: 0,
        tanh: 0,
    };

    /// Only `bias` (a convolution's).
    pub fn bias(bias: DevPtr) -> Post {
        Post { bias, ..Post::NONE }
    }

    /// Whether it applies nothing.
    pub fn is_none(&self) -> bool {
        self.bias == DevPtr::NULL && self.act < 0 && self.gate == DevPtr::NULL
    }

    /// `ep`'s bias, activation and gate, checked against an output of `rows × cols`.
    pub fn of(ep: &Epilogue<'_, CudaBackend>, rows: usize, cols: usize) -> Result<Post> {
        let bias = match ep.bias {
            Some(b) if b.len != cols => {
                return Err(Error::backend(
                    "matmul",
                    format!("bias of {} for {cols} outputs", b.len),
                ));
            }
            Some(b) => b.ptr,
            None => DevPtr::NULL,
        };
        let (gate, gate_stride, tanh) = match &ep.gate {
            Some(g) => {
                let v = &g.values;
                let rows_ok = v.rows == 1 || v.rows == rows;
                if !rows_ok || v.cols != cols || v.buf.elem != Elem::F32 {
                    return Err(Error::backend(
                        "matmul",
                        format!(
                            "gate {}×{} {:?} for a {rows}×{cols} output (one f32 row or one per row)",
                            v.rows, v.cols, v.buf.elem
                        ),
                    ));
                }
                let stride = if g.broadcast() { 0 } else { v.stride };
                (ptr_of(v)?, stride, g.tanh as i32)
            }
            None => (DevPtr::NULL, 0, 0),
        };
        Ok(Post {
            bias,
            act: ep.act.map_or(-1, act_code),
            gate,
            gate_stride,
            tanh,
        })
    }

    /// The gate's row `g0` (null without a gate; the one row of a broadcast gate).
    pub fn gate_from(&self, g0: usize) -> DevPtr {
        if self.gate == DevPtr::NULL {
            DevPtr::NULL
        } else {
            DevPtr(self.gate.0 + (g0 * self.gate_stride * 4) as u64)
        }
    }
}

/// An activation's code in the element-wise kernels.
pub(super) fn act_code(a: Activation) -> i32 {
    match a {
        Activation::GeluTanh => 0,
        Activation::Silu => 1,
        Activation::Gelu => 2,
    }
}

/// Enqueue `into[0..rows] (= or +=) α · x[r0..r0+rows] · wᵀ` (β 0 or 1): on the GEMV kernel
/// when [`gemv::applies`] (a few bf16 rows, aligned), else through cuBLASLt.
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
    let ab = match w.format {
        MatFormat::Dense(ab) => ab,
        MatFormat::Fp8(_) => return super::fp8::product(be, x, r0, rows, w, into, alpha, beta),
        MatFormat::Block(_) => {
            return super::blocks::product(be, x, r0, rows, w, into, alpha, beta);
        }
    };
    if x.elem != ab {
        return Err(Error::backend(
            "matmul",
            format!("x is {:?} but the weight is {ab:?}", x.elem),
        ));
    }
    if be.gemm.gemv.on()
        && (beta == 0.0 || beta == 1.0)
        && gemv::applies(x, x.at(r0), rows, w, into)
    {
        return gemv::gemv(be, x, r0, rows, w, into, alpha, beta == 1.0);
    }
    dense(
        be, x, r0, rows, w.buf.ptr, w.out, w.inner, ab, into, alpha, beta,
    )
}

/// Enqueue the cuBLASLt product `into[0..rows] (= or +=) α · x[r0..r0+rows] · wᵀ` for a dense
/// `w [n, k]` of `ab` at `w` (contiguous rows), as [`product`] and the block-format products
/// (on their decoded column blocks) do.
#[allow(clippy::too_many_arguments)]
pub(super) fn dense(
    be: &CudaBackend,
    x: Rows,
    r0: usize,
    rows: usize,
    w: DevPtr,
    n: usize,
    k: usize,
    ab: Elem,
    into: Rows,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let args = GemmArgs {
        m: rows,
        n,
        k,
        x: x.at(r0).0,
        x_stride: x.stride,
        w: w.0,
        ab,
        out: into.ptr.0,
        out_stride: into.stride,
        out_elem: into.elem,
        alpha,
        beta,
    };
    // Under TESSERA_PROFILE=kernels, products are told apart by shape (m×n×k).
    let shape = be.profiler.as_ref().map(|_| format!("{rows}x{n}x{k}"));
    be.timed("gemm", shape.as_deref(), || be.gemm.run(&be.stream, &args))
}

/// `out[i] (= or +=) post(y[i])` for `rows` rows of `cols`, whose gate rows start at `g0`.
#[allow(clippy::too_many_arguments)]
pub(super) fn epilogue(
    be: &CudaBackend,
    post: &Post,
    y: Rows,
    out: Rows,
    g0: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) -> Result<()> {
    let args = EpilogueArgs {
        y: y.ptr,
        ys: y.stride as i64,
        o: out.ptr,
        os: out.stride as i64,
        rows: rows as i64,
        cols: cols as i32,
        bias: post.bias,
        act: post.act,
        g: post.gate_from(g0),
        gs: post.gate_stride as i64,
        tanh: post.tanh,
        accumulate: accumulate as i32,
    };
    // Four columns a thread where 4-vectors tile every row at aligned starts (the gate rows' and
    // the bias's too), in 32-bit vector indices.
    let rows_of = [
        (y.ptr, y.stride, y.elem.size()),
        (out.ptr, out.stride, out.elem.size()),
        (args.g, post.gate_stride, 4),
    ];
    let vec = cols.is_multiple_of(4)
        && rows * cols / 4 <= u32::MAX as usize
        && vec4_aligned(&rows_of, &[args.bias]);
    let k = &be.kernels.elementwise;
    let (table, items) = if vec {
        (&k.epilogue_vec, rows * cols / 4)
    } else {
        (&k.epilogue, rows * cols)
    };
    be.launch(
        "elementwise",
        table.get(y.elem, out.elem)?,
        be.grid_stride(items),
        &args,
    )
}

/// A gated MLP's gate|up product gated as it is stored, `out = act(x · W_gateᵀ) ⊙ (x · W_upᵀ)`,
/// in one launch where the fused GEMV applies (a few bf16 rows, a dense weight; see
/// [`gemv::glu_product`]): `Ok(true)` once enqueued, `Ok(false)` (nothing enqueued) for
/// [`matmul`] into `gu` then the gated kernel.
pub(super) fn matmul_gated(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: &CudaMat,
    gu: &ViewMut<'_, CudaBackend>,
    act: Activation,
    out: &ViewMut<'_, CudaBackend>,
) -> Result<bool> {
    if !matches!(w.format, MatFormat::Dense(_)) || !be.gemm.gemv.on() {
        return Ok(false);
    }
    check_product(&x, (w.out, w.inner), gu)?;
    if (out.rows, 2 * out.cols) != (gu.rows, gu.cols) {
        return Err(Error::backend(
            "gated matmul",
            format!(
                "{}×{} gated rows from {}×{} products",
                out.rows, out.cols, gu.rows, gu.cols
            ),
        ));
    }
    if x.rows == 0 || w.out == 0 {
        return Ok(false);
    }
    let (xr, gr, or) = (Rows::of(&x)?, Rows::of_mut(gu)?, Rows::of_mut(out)?);
    gemv::glu_product(be, xr, x.rows, act, w, gr, or, 1.0)
}

/// `y = ep(x · wᵀ)` ended by the residual step `then` in one launch where the tensor-core GEMV
/// takes the product (a few bf16 rows, a dense weight, a bare product) and the residual kernel
/// would be the vector one ([`norm::residual_tail`]): `Ok(true)` once enqueued, `Ok(false)`
/// (nothing enqueued) for [`matmul`] then the residual op.
pub(super) fn matmul_residual(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: &CudaMat,
    y: &ViewMut<'_, CudaBackend>,
    ep: &Epilogue<'_, CudaBackend>,
    then: &ThenResidual<'_, CudaBackend>,
) -> Result<bool> {
    if !matches!(w.format, MatFormat::Dense(_)) || !be.gemm.gemv.on() {
        return Ok(false);
    }
    check_product(&x, (w.out, w.inner), y)?;
    if !Post::of(ep, y.rows, y.cols)?.is_none() || ep.accumulate || x.rows == 0 || w.out == 0 {
        return Ok(false);
    }
    let Some(tail) = norm::residual_tail(be, then, y, gemv::tc_threads(w.inner))? else {
        return Ok(false);
    };
    gemv::product_then_residual(
        be,
        Rows::of(&x)?,
        x.rows,
        w,
        Rows::of_mut(y)?,
        ep.alpha,
        tail,
    )
}

/// The `matmul` op: `out = ep(x · wᵀ)`.
///
/// A bare product, or one adding to `out`, is one cuBLASLt call (`β = 1` to accumulate). Bias,
/// activation and gate follow it in the epilogue kernel, in place on an f32 `out`; when such an
/// epilogue also accumulates (`out += g ⊙ act(x·wᵀ + b)`), or `out` is bf16 (so that `x·wᵀ` is
/// not rounded to bf16 before its bias and activation: one rounding, of the finished value), the
/// product goes to the f32 product workspace a block of rows at a time and the kernel writes (or
/// adds) each finished block to `out`. A bias alone with accumulation is `β = 1` then the bias in
/// place: the sum is the same.
pub(super) fn matmul(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: &CudaMat,
    out: ViewMut<'_, CudaBackend>,
    ep: &Epilogue<'_, CudaBackend>,
) -> Result<()> {
    if matches!(w.format, MatFormat::Fp8(_)) {
        return super::fp8::matmul(be, x, w, out, ep);
    }
    check_product(&x, (w.out, w.inner), &out)?;
    // A bare (or accumulating) product has no epilogue.
    let post = Some(Post::of(ep, out.rows, out.cols)?).filter(|p| !p.is_none());
    if x.rows == 0 || w.out == 0 {
        return Ok(());
    }
    let (xr, outr) = (Rows::of(&x)?, Rows::of_mut(&out)?);
    let (m, n) = (x.rows, w.out);
    match post {
        None => product(be, xr, 0, m, w, outr, ep.alpha, ep.accumulate as u8 as f32),
        Some(p)
            if (!ep.accumulate && outr.elem == Elem::F32)
                || (ep.accumulate && ep.act.is_none() && ep.gate.is_none()) =>
        {
            product(be, xr, 0, m, w, outr, ep.alpha, ep.accumulate as u8 as f32)?;
            epilogue(be, &p, outr, outr, 0, m, n, false)
        }
        Some(p) => {
            let (ws, capacity) = be.workspace(Workspace::Product)?;
            let block = (capacity / n).max(1);
            let tmp = Rows {
                ptr: ws,
                stride: n,
                elem: Elem::F32,
            };
            for r0 in (0..m).step_by(block) {
                let rows = block.min(m - r0);
                product(be, xr, r0, rows, w, tmp, ep.alpha, 0.0)?;
                epilogue(
                    be,
                    &p,
                    tmp,
                    Rows {
                        ptr: outr.at(r0),
                        ..outr
                    },
                    r0,
                    rows,
                    n,
                    ep.accumulate,
                )?;
            }
            Ok(())
        }
    }
}
