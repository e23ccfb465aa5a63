//! The CPU backend: every op in `f32`, the reference every other backend is tested against.
//!
//! Matrix products go through the panel kernels (`panels.rs`) where the CPU has AVX-512, else
//! the `gemm` crate; either way a row's result does not depend on the rows it comes with, so
//! work batched with other work (a server's requests through one forward) equals the same work
//! alone, bit for bit. Row-wise ops are parallel over rows with rayon. Nothing here trades
//! accuracy for speed: statistics are accumulated in `f64` where a long sum would lose digits,
//! so the CPU path tracks the float64 PyTorch reference to ~1e-6.
//!
//! Under [`Precision::Bf16`] the matrices are kept in bf16 and every product, attention's
//! included, takes bf16 inputs with f32 accumulation (`bf16.rs`: `vdpbf16ps` where the CPU has
//! AVX512_BF16); everything else stays as in f32.

#[cfg(target_arch = "x86_64")]
pub mod aligned;
pub mod amx;
mod attention;
mod avg_down;
pub mod bf16;
mod conv;
pub mod denormals;
mod dup_up;
mod elementwise;
mod group_norm;
pub mod int8;
mod matmul;
mod norm;
pub mod panels;
pub mod peak;
mod prefetch;
pub mod quant;
mod rope;
mod rows;
mod short_conv;
mod vmath;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tessera_core::{Error, Result, Tensor, Weights};

use crate::view::same_shape;
use crate::{
    Activation, After, AttnSpec, AvgDown, Backend, Conv2d, DupUp, Epilogue, Grids, GroupNorm, Op,
    Precision, QkvNorm, Quantization, Residual, Role, RopeTable, RowNorm, Segments, ShortConv,
    View, ViewMut,
};

/// The CPU backend: `f32` by default, bf16 products with [`CpuBackend::with_precision`].
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    /// `Bf16`: matrices kept in bf16, products and attention with bf16 inputs.
    precision: Precision,
    /// Every op called, when recording (see [`CpuBackend::recording`]).
    record: Option<Arc<Mutex<HashSet<Op>>>>,
    /// Memory reported as available, when budgeted (see [`CpuBackend::budgeted`]).
    budget: Option<usize>,
    /// Quantization at load (`--quantize`) and the products on quantized weights.
    quant: Quantization,
    /// Products on FP8 weights round their activations as CUDA's do (tests' floor reference).
    e4m3_activations: bool,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// A backend computing at `precision`: under [`Precision::Bf16`] matrices are kept in bf16
    /// and products take bf16 inputs with f32 sums, everything else as in f32.
    pub fn with_precision(precision: Precision) -> Self {
        CpuBackend {
            precision,
            ..CpuBackend::default()
        }
    }

    /// The same backend with `quant`: float matrices whose rows are whole blocks of
    /// `quant.at_load` quantized as they load ([`quant::quantize_stack`]), and products on
    /// block-format weights exact or with int8 activations ([`Quantization::int8`]).
    pub fn quantizing(self, quant: Quantization) -> Self {
        CpuBackend { quant, ..self }
    }

    /// The same backend with products on FP8 weights first rounding their activations as
    /// CUDA's FP8 products do: to bf16, then to e4m3 with one scale `amax / 448` per product
    /// (`quant::round_e4m3`). Never a mode of the engine: the floor reference that CUDA's FP8
    /// runs are judged against (with [`Precision::Bf16`], every other rounding of a bf16 device).
    pub fn rounding_fp8_activations(self) -> Self {
        CpuBackend {
            e4m3_activations: true,
            ..self
        }
    }

    /// A backend that also records every op it runs, so a test can check that a model's
    /// declared op list covers what its forward calls.
    pub fn recording() -> Self {
        CpuBackend {
            record: Some(Arc::default()),
            ..CpuBackend::default()
        }
    }

    /// A backend that reports `bytes` of memory available, as a GPU does, so that a model's
    /// memory checks can be tested without one. It allocates as the plain CPU backend does.
    pub fn budgeted(bytes: usize) -> Self {
        CpuBackend {
            budget: Some(bytes),
            ..CpuBackend::default()
        }
    }

    /// The ops run so far (recording backends only), in no particular order.
    pub fn recorded(&self) -> Vec<Op> {
        self.record.as_ref().map_or_else(Vec::new, |r| {
            r.lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .copied()
                .collect()
        })
    }

    /// Every op's entry: denormals flushed on this thread and the pool's (`denormals.rs`), the
    /// call noted when recording. The CPU runs every op.
    fn enter(&self, op: Op) -> Result<()> {
        denormals::flush_here();
        if let Some(r) = &self.record {
            r.lock().unwrap_or_else(|p| p.into_inner()).insert(op);
        }
        Ok(())
    }
}

/// A CPU buffer: `f32` activations or `u32` indices.
#[derive(Debug)]
pub enum CpuBuf {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

impl CpuBuf {
    fn f32(&self) -> &[f32] {
        match self {
            CpuBuf::F32(v) => v,
            CpuBuf::U32(_) => panic!("CPU backend: expected an f32 buffer, got an index buffer"),
        }
    }
    fn f32_mut(&mut self) -> &mut [f32] {
        match self {
            CpuBuf::F32(v) => v,
            CpuBuf::U32(_) => panic!("CPU backend: expected an f32 buffer, got an index buffer"),
        }
    }
    fn u32(&self) -> &[u32] {
        match self {
            CpuBuf::U32(v) => v,
            CpuBuf::F32(_) => panic!("CPU backend: expected an index buffer, got an f32 buffer"),
        }
    }
}

/// A weight matrix `[out, inner]`.
pub struct CpuMat {
    store: MatStore,
    out: usize,
    inner: usize,
}

/// How a [`CpuMat`] holds its values.
enum MatStore {
    /// Row-major `f32`, for the `gemm` crate (CPUs without AVX-512).
    F32(Vec<f32>),
    /// `f32` panels for the panel products (`panels.rs`; CPUs with AVX-512).
    F32Panels(panels::Panels<f32>),
    /// bf16 panels for the bf16 products (under [`Precision::Bf16`]).
    Bf16(panels::Panels<u32>),
    /// ggml blocks (Q8_0, Q4_0, Q4_K, Q6_K) as stored, decoded a panel at a time (`quant.rs`).
    Quant(quant::QuantMat),
    /// Parts stored in different formats, each run of one format a matrix of its own whose
    /// product fills its columns of the output: llama-quantize's mixes (Q4_K_M keeps an
    /// attention's values in Q6_K beside Q4_K queries and keys) stacked as the model asks.
    Stacked(Vec<CpuMat>),
}

impl CpuMat {
    /// The block format of a quantized matrix, `None` for a dense one (of a mixed stack, its
    /// first part's block format).
    pub fn quantized(&self) -> Option<tessera_core::DType> {
        match &self.store {
            MatStore::Quant(q) => Some(q.dtype()),
            MatStore::Stacked(parts) => parts.iter().find_map(CpuMat::quantized),
            _ => None,
        }
    }
}

/// An embedding table left in the checkpoint's memory map, rows widened on lookup.
pub struct CpuTable {
    weights: Weights,
    name: String,
    dim: usize,
    rows: usize,
    /// Values rounded to bf16 as they are read (under [`Precision::Bf16`], where every parameter
    /// but the vectors is bf16, as on the GPU; exact for a bf16 checkpoint).
    bf16: bool,
}

impl CpuTable {
    /// Row values from element `at` into `out`, as the backend's precision stores them.
    fn read(&self, t: &Tensor<'_>, at: usize, out: &mut [f32]) {
        t.read_f32_range(at, out);
        if self.bf16 {
            out.iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
    }
}

/// Borrow the `f32` slice a view covers, after checking it lies inside the buffer.
fn slice<'a>(v: &View<'a, CpuBackend>) -> &'a [f32] {
    let data = v.buf.f32();
    assert!(
        v.end() <= data.len() && v.cols <= v.stride.max(v.cols),
        "view out of bounds"
    );
    &data[v.offset..v.end()]
}

/// Elements of row work per parallel job: a row op over fewer stays on the calling thread, as
/// waking another costs more than the work (a 17-token query's norms and activations spent a
/// fifth of its time in thread hand-offs).
const ROW_JOB: usize = 1 << 14;

/// Rows per parallel job for rows of `cols`.
fn rows_per_job(cols: usize) -> usize {
    (ROW_JOB / cols.max(1)).max(1)
}

/// Split a mutable view into its rows (each `cols` long), a job's worth of rows per thread.
fn rows_mut<'a>(
    v: ViewMut<'a, CpuBackend>,
) -> impl rayon::iter::IndexedParallelIterator<Item = &'a mut [f32]> {
    use rayon::prelude::*;
    let (offset, end, stride, cols) = (v.offset, v.end(), v.stride.max(1), v.cols);
    let data = v.buf.f32_mut();
    assert!(end <= data.len(), "view out of bounds");
    data[offset..end]
        .par_chunks_mut(stride)
        .with_min_len(rows_per_job(cols))
        .map(move |r| &mut r[..cols])
}

/// Iterate a view's rows, a job's worth of rows per thread.
fn rows<'a>(
    v: View<'a, CpuBackend>,
) -> impl rayon::iter::IndexedParallelIterator<Item = &'a [f32]> {
    use rayon::prelude::*;
    let cols = v.cols;
    slice(&v)
        .par_chunks(v.stride.max(1))
        .with_min_len(rows_per_job(cols))
        .map(move |r| &r[..cols])
}

/// Stacked matrix parts: which part, and which of its byte rows, row `j` of the stack is.
struct Stack<'p, 't> {
    parts: &'p [Tensor<'t>],
    /// First stacked row of each part.
    starts: Vec<usize>,
    out: usize,
    inner: usize,
}

impl<'p, 't> Stack<'p, 't> {
    fn new(parts: &'p [Tensor<'t>]) -> Result<Self> {
        let (out, inner) = crate::stacked_shape(parts)?;
        let starts = parts
            .iter()
            .scan(0, |row, t| {
                let first = *row;
                *row += t.numel() / inner.max(1);
                Some(first)
            })
            .collect();
        Ok(Stack {
            parts,
            starts,
            out,
            inner,
        })
    }

    /// Row `j`: its part's dtype and stored bytes (float parts only: block formats are stacked
    /// by `quant::QuantMat::stack`).
    fn row(&self, j: usize) -> (tessera_core::DType, &[u8]) {
        let p = self.starts.partition_point(|&s| s <= j) - 1;
        let t = &self.parts[p];
        let len = self.inner * t.dtype.size().unwrap_or(0);
        let at = (j - self.starts[p]) * len;
        (t.dtype, &t.bytes[at..at + len])
    }
}

/// Widen every part to `f32` and stack the parts along `out`: in panels where the CPU runs the
/// panel products, else row-major.
fn stack_f32(parts: &[Tensor<'_>]) -> Result<CpuMat> {
    use rayon::prelude::*;
    let stack = Stack::new(parts)?;
    let (out, inner) = (stack.out, stack.inner);
    if panels::f32_native() {
        let p = panels::Panels::<f32>::from_rows(out, inner, |j, dst| {
            let (dtype, bytes) = stack.row(j);
            tessera_core::dtype::widen_into(dtype, bytes, dst);
        });
        return Ok(CpuMat {
            store: MatStore::F32Panels(p),
            out,
            inner,
        });
    }
    // Elements widened per task: loading uses every core, which also splits the page faults of
    // the fresh f32 buffer and of the mapped checkpoint (most of a warm load's time).
    const SLICE: usize = 1 << 18;
    let mut data = vec![0f32; out * inner];
    let mut rest = data.as_mut_slice();
    for t in parts {
        let (dst, tail) = rest.split_at_mut(t.numel());
        rest = tail;
        dst.par_chunks_mut(SLICE)
            .zip(t.bytes.par_chunks(SLICE * t.dtype.size().unwrap_or(1)))
            .for_each(|(d, b)| tessera_core::dtype::widen_into(t.dtype, b, d));
    }
    Ok(CpuMat {
        store: MatStore::F32(data),
        out,
        inner,
    })
}

/// Round every part to bf16 (a bf16 part's bits are taken as they are) and stack the parts along
/// `out`, in panels.
fn stack_bf16(parts: &[Tensor<'_>]) -> Result<CpuMat> {
    use tessera_core::DType;
    let stack = Stack::new(parts)?;
    let (out, inner) = (stack.out, stack.inner);
    let panels = panels::Panels::<u32>::from_rows(out, inner, |j, dst| {
        let (dtype, bytes) = stack.row(j);
        if dtype == DType::BF16 {
            // Two bf16 values little-endian are the pair as one u32; an odd row's last is alone.
            for (d, b) in dst.iter_mut().zip(bytes.chunks(4)) {
                *d = match *b {
                    [a, b, c, e] => u32::from_le_bytes([a, b, c, e]),
                    [a, b] => u16::from_le_bytes([a, b]) as u32,
                    _ => unreachable!("bf16 bytes come in pairs"),
                };
            }
        } else {
            let mut row = vec![0f32; inner];
            tessera_core::dtype::widen_into(dtype, bytes, &mut row);
            bf16::round_row(&row, dst);
        }
    });
    Ok(CpuMat {
        store: MatStore::Bf16(panels),
        out,
        inner,
    })
}

/// Check that runs of `n` values of `t` are whole blocks of its format (always, for a float
/// type), naming the tensor.
fn whole_blocks(t: &Tensor<'_>, n: usize) -> Result<()> {
    let bs = t.dtype.block_size();
    if n.is_multiple_of(bs) {
        return Ok(());
    }
    Err(Error::backend(
        "load",
        format!(
            "`{}` in {}: runs of {n} values are not whole {} blocks of {bs}",
            t.name,
            t.path.display(),
            t.dtype
        ),
    ))
}

/// How bf16 products run on this machine and whether that beats f32, for `describe`: on AMX
/// tiles where the CPU has them (`amx.rs`), else with `vdpbf16ps` at its measured rate against the
/// f32 FMA ([`peak::bf16_dot_vs_fma`]), or converted to f32 in a portable loop. Every route keeps
/// the bf16 rule (bf16 inputs, exact products, f32 sums), and the weights take half the memory of
/// f32's.
fn bf16_products() -> String {
    #[cfg(target_arch = "x86_64")]
    if amx::enabled() {
        return "bf16 products on AMX tiles (tdpbf16ps), attention's included".to_string();
    }
    match peak::bf16_dot_vs_fma() {
        Some(r) if r >= peak::BF16_PAYS => {
            format!("bf16 products with AVX512_BF16, vdpbf16ps at {r:.1}× the f32 FMA's rate here")
        }
        Some(r) => format!(
            "bf16 products with AVX512_BF16, but vdpbf16ps runs at only {r:.1}× the f32 FMA's \
             rate here: no faster than f32 where compute bounds them, and bf16 halves the \
             weights' memory"
        ),
        None => "bf16 products converted to f32 in a portable loop: this CPU lacks AVX512_BF16, \
                 so f32 is faster and bf16 only halves the weights' memory"
            .to_string(),
    }
}

/// How the int8 products run here, for `describe`.
fn int8_isa() -> &'static str {
    match int8::kernel() {
        int8::Kernel::Portable => "a portable loop",
        k => k.name(),
    }
}

impl CpuBackend {
    /// A block-format or FP8 matrix with this backend's product settings.
    fn quant_mat(&self, q: quant::QuantMat, out: usize, inner: usize) -> CpuMat {
        CpuMat {
            store: MatStore::Quant(
                q.with_int8(self.quant.int8)
                    .with_e4m3_activations(self.e4m3_activations),
            ),
            out,
            inner,
        }
    }

    /// [`Backend::matrix`], quantizing at load (`--quantize`) only when `quantize`.
    fn load_matrix(&self, parts: &[Tensor<'_>], quantize: bool) -> Result<CpuMat> {
        let (out, inner) = crate::stacked_shape(parts)?;
        let at_load = self
            .quant
            .at_load
            .filter(|q| quantize && inner.is_multiple_of(q.block_size()) && out > 0);
        if let Some(q) = at_load
            && parts.iter().all(|t| !t.dtype.is_quantized())
        {
            return Ok(self.quant_mat(quant::quantize_stack(parts, q, (out, inner))?, out, inner));
        }
        if parts.iter().any(|t| t.dtype.is_quantized()) {
            if parts.iter().any(|t| t.dtype != parts[0].dtype) {
                let runs = parts
                    .chunk_by(|a, b| a.dtype == b.dtype)
                    .map(|run| self.load_matrix(run, quantize))
                    .collect::<Result<_>>()?;
                return Ok(CpuMat {
                    store: MatStore::Stacked(runs),
                    out,
                    inner,
                });
            }
            let (q, out, inner) = quant::QuantMat::stack(parts)?;
            return Ok(self.quant_mat(q, out, inner));
        }
        match self.precision {
            Precision::F32 => stack_f32(parts),
            Precision::Bf16 => stack_bf16(parts),
        }
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type Mat = CpuMat;
    type Vector = Vec<f32>;
    type Table = CpuTable;

    fn describe(&self) -> String {
        let threads = rayon::current_num_threads();
        if let Some(q) = self.quant.at_load {
            let products = match (self.quant.int8, int8::supports(q)) {
                (false, _) => "exact products: f32 on the decoded weights".to_string(),
                (true, true) => format!("products with int8 activations ({})", int8_isa()),
                (true, false) => {
                    format!("exact products: {q} has no int8 path yet, f32 on the decoded weights")
                }
            };
            let rest = match self.precision {
                Precision::F32 => "",
                Precision::Bf16 => "; other products and attention with bf16 inputs",
            };
            return format!(
                "cpu ({q} weights quantized at load, {products}{rest}; {threads} threads)"
            );
        }
        if self.quant.int8 {
            return format!(
                "cpu (f32; products on Q8_0/Q4_0/Q4_K/Q6_K weights with int8 activations ({}), on \
                 other block formats exact; {threads} threads)",
                int8_isa()
            );
        }
        match self.precision {
            Precision::F32 => format!("cpu (f32, {threads} threads)"),
            Precision::Bf16 => format!("cpu ({}; {threads} threads)", bf16_products()),
        }
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    /// The CPU is the reference: it runs every op.
    fn supports(&self, _op: &Op) -> Result<()> {
        Ok(())
    }

    fn memory_available(&self) -> Result<Option<usize>> {
        Ok(self.budget)
    }

    fn element_bytes(&self, role: Role) -> usize {
        // Activations are f32 here under either precision (bf16 changes the products' inputs).
        let _ = role;
        4
    }

    fn alloc(&self, len: usize, role: Role) -> Result<CpuBuf> {
        Ok(match role {
            Role::Index => CpuBuf::U32(vec![0; len]),
            Role::Stream | Role::Compute => CpuBuf::F32(vec![0.0; len]),
        })
    }

    fn alloc_scratch(&self, len: usize, role: Role) -> Result<CpuBuf> {
        // Zeros in release builds (pages the OS hands out zeroed, untouched until written);
        // NaN where the tests run, so no op can depend on values the GPU would not have.
        if cfg!(debug_assertions) && role != Role::Index {
            return Ok(CpuBuf::F32(vec![f32::NAN; len]));
        }
        self.alloc(len, role)
    }

    fn write_f32(&self, dst: &mut CpuBuf, src: &[f32]) -> Result<()> {
        let d = dst.f32_mut();
        if src.len() > d.len() {
            return Err(Error::backend("write_f32", "source longer than buffer"));
        }
        d[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn write_u32(&self, dst: &mut CpuBuf, src: &[u32]) -> Result<()> {
        match dst {
            CpuBuf::U32(d) if d.len() >= src.len() => {
                d[..src.len()].copy_from_slice(src);
                Ok(())
            }
            _ => Err(Error::backend(
                "write_u32",
                "not an index buffer of that length",
            )),
        }
    }

    fn read_f32(&self, src: View<'_, Self>) -> Result<Vec<f32>> {
        use rayon::prelude::*;
        Ok(rows(src).flat_map_iter(|r| r.iter().copied()).collect())
    }

    fn read_u32(&self, src: &CpuBuf, len: usize) -> Result<Vec<u32>> {
        match src {
            CpuBuf::U32(v) if v.len() >= len => Ok(v[..len].to_vec()),
            _ => Err(Error::backend(
                "read_u32",
                format!("not an index buffer of {len} values"),
            )),
        }
    }

    fn matrix(&self, parts: &[Tensor<'_>]) -> Result<CpuMat> {
        self.load_matrix(parts, true)
    }

    fn matrix_unquantized(&self, parts: &[Tensor<'_>]) -> Result<CpuMat> {
        self.load_matrix(parts, false)
    }

    fn vector(&self, t: &Tensor<'_>) -> Result<Vec<f32>> {
        let n = crate::vector_len(t)?;
        whole_blocks(t, n)?;
        Ok(t.to_f32())
    }

    fn table(&self, weights: &Weights, name: &str, shape: &[usize]) -> Result<CpuTable> {
        let (rows, dim) = crate::table_shape(name, shape)?;
        // Rows are read one at a time: in a block format each must be whole blocks.
        whole_blocks(&weights.get(name, shape)?, dim)?;
        Ok(CpuTable {
            weights: weights.clone(),
            name: name.to_string(),
            rows,
            dim,
            bf16: self.precision == Precision::Bf16,
        })
    }

    fn embed(
        &self,
        table: &CpuTable,
        ids: &CpuBuf,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::Embed)?;
        elementwise::embed(table, ids.u32(), scale, out)
    }

    fn cast(&self, x: View<'_, Self>, out: ViewMut<'_, Self>) -> Result<()> {
        use rayon::prelude::*;
        self.enter(Op::Cast)?;
        same_shape("cast", (x.rows, x.cols), (out.rows, out.cols))?;
        rows_mut(out)
            .zip(rows(x))
            .for_each(|(o, r)| o.copy_from_slice(r));
        Ok(())
    }

    fn matmul(
        &self,
        x: View<'_, Self>,
        w: &CpuMat,
        out: ViewMut<'_, Self>,
        ep: &Epilogue<'_, Self>,
    ) -> Result<()> {
        self.enter(ep.op().with_weights(w.quantized()))?;
        matmul::matmul(x, w, out, ep)
    }

    fn norm(&self, x: View<'_, Self>, n: &RowNorm<'_, Self>, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(Op::Norm(n.shape()))?;
        norm::norm(x, n, out)
    }

    fn residual(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        res: &Residual<'_, Self>,
        after: After<'_, Self>,
    ) -> Result<()> {
        self.enter(res.op(&after))?;
        norm::residual(h, y, res, after)
    }

    fn qkv_norm_rope(
        &self,
        qkv: ViewMut<'_, Self>,
        n: &QkvNorm<'_, Self>,
        rope: Option<(&RopeTable<Self>, &CpuBuf)>,
    ) -> Result<()> {
        self.enter(Op::QkvNormRope {
            head_dim: n.layout.head_dim,
            rope: rope.map(|r| r.0.style),
            qk_norm: n.qk_norm,
        })?;
        rope::qkv_norm_rope(qkv, n, rope.map(|(t, p)| (t, p.u32())))
    }

    fn attention(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec<'_, Self>,
        segs: &Segments<Self>,
    ) -> Result<()> {
        self.enter(spec.op())?;
        let kernel = attention::Kernel::for_cpu(self.precision == Precision::Bf16);
        attention::attention(q, k, v, out, spec, segs, kernel)
    }

    fn gated(
        &self,
        gate: View<'_, Self>,
        up: View<'_, Self>,
        out: ViewMut<'_, Self>,
        act: Activation,
    ) -> Result<()> {
        self.enter(Op::Gated(act))?;
        // bf16 mode computes the activation in f32: its product rounds it to bf16 next.
        elementwise::gated(gate, up, out, act, self.precision == Precision::Bf16)
    }

    fn segment_mean(
        &self,
        x: View<'_, Self>,
        segs: &Segments<Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::SegmentMean)?;
        elementwise::segment_mean(x, &segs.offsets, out)
    }

    fn add_positions_2d(
        &self,
        table: &CpuTable,
        axis_rows: usize,
        pos: &CpuBuf,
        x: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::AddPositions2d)?;
        rows::add_positions_2d(table, axis_rows, pos.u32(), x)
    }

    fn avg_pool2d(
        &self,
        x: View<'_, Self>,
        grids: &Grids<Self>,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::AvgPool2d)?;
        rows::avg_pool2d(x, grids, scale, out)
    }

    fn scatter_rows(
        &self,
        src: View<'_, Self>,
        rows: &CpuBuf,
        dst: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::ScatterRows)?;
        rows::scatter_rows(src, rows.u32(), dst)
    }

    fn conv2d(
        &self,
        x: View<'_, Self>,
        w: &CpuMat,
        bias: &Vec<f32>,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(spec.op())?;
        conv::conv2d(x, w, bias, spec, out)
    }

    fn dup_up(&self, x: View<'_, Self>, spec: &DupUp, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(Op::DupUp)?;
        dup_up::dup_up(x, spec, out)
    }

    fn avg_down(&self, x: View<'_, Self>, spec: &AvgDown, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(Op::AvgDown)?;
        avg_down::avg_down(x, spec, out)
    }

    fn argmax_rows(&self, x: View<'_, Self>, out: &mut CpuBuf) -> Result<()> {
        use rayon::prelude::*;
        self.enter(Op::ArgmaxRows)?;
        let CpuBuf::U32(out) = out else {
            return Err(Error::backend("argmax_rows", "out is not an index buffer"));
        };
        crate::check_argmax_rows(x.rows, x.cols, out.len())?;
        out[..x.rows]
            .par_iter_mut()
            .zip(rows(x))
            .for_each(|(o, r)| *o = crate::first_argmax(r));
        Ok(())
    }

    fn short_conv(
        &self,
        bcx: View<'_, Self>,
        conv: &ShortConv<'_, Self>,
        segs: &Segments<Self>,
        state: &mut CpuBuf,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(conv.op())?;
        short_conv::short_conv(bcx, conv, segs, state.f32_mut(), out)
    }

    fn group_norm(
        &self,
        x: View<'_, Self>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        spec: &GroupNorm,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(Op::GroupNorm { act: spec.act })?;
        group_norm::group_norm(x, weight, bias, spec, out)
    }
}

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_rgb8` (the trait's host default) packs a view's rows into bytes as `to_rgb8` does,
    /// and names the stage, count and first index of non-finite values as `check_finite` does.
    #[test]
    fn rgb8_read_back_packs_rows_and_fails_on_non_finite_values() {
        let be = CpuBackend::new();
        let mut buf = be.alloc(8, Role::Stream).unwrap();
        be.write_f32(
            &mut buf,
            &[-1.0, 0.0, 1.0, f32::NAN, 0.5, 2.0, -3.0, f32::INFINITY],
        )
        .unwrap();
        let rgb = be
            .read_rgb8(View::new(&buf, 2, 4).cols(0, 3), "image")
            .unwrap();
        assert_eq!(rgb, [0, 128, 255, 191, 255, 0]);
        match be.read_rgb8(View::new(&buf, 2, 4), "image") {
            Err(Error::NonFinite {
                stage,
                count,
                len,
                first,
            }) => assert_eq!((stage.as_str(), count, len, first), ("image", 2, 8, 3)),
            other => panic!("expected NonFinite, got {other:?}"),
        }
    }

    /// Hardware-dependent: `describe` under bf16 names the way this CPU multiplies bf16 and
    /// says where that is no faster than f32 (the output says which branch ran).
    #[test]
    fn bf16_describe_says_how_products_run_and_whether_they_beat_f32() {
        let d = CpuBackend::with_precision(Precision::Bf16).describe();
        eprintln!("{d}");
        #[cfg(target_arch = "x86_64")]
        let amx = amx::enabled();
        #[cfg(not(target_arch = "x86_64"))]
        let amx = false;
        match peak::bf16_dot_vs_fma() {
            _ if amx => assert!(d.contains("AMX tiles"), "{d}"),
            Some(r) => {
                assert!(
                    d.contains("AVX512_BF16") && d.contains(&format!("{r:.1}×")),
                    "{d}"
                );
                assert_eq!(d.contains("no faster than f32"), r < peak::BF16_PAYS, "{d}");
            }
            None => assert!(
                d.contains("portable loop") && d.contains("f32 is faster"),
                "{d}"
            ),
        }
        let f32 = CpuBackend::new().describe();
        assert!(
            f32.starts_with("cpu (f32,") && !f32.contains("bf16"),
            "{f32}"
        );
    }

    /// Each row's first largest value, by rows written out with their answers: ties go to the
    /// first, −∞ rows to 0, a NaN anywhere flags the row; a strided column window is read, and
    /// the indices past the rows are left alone.
    #[test]
    fn argmax_rows_takes_the_first_largest_and_flags_nan() {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let rows: [([f32; 5], u32); 8] = [
            ([1.0, 3.0, 3.0, 2.0, 3.0], 1),
            ([-inf; 5], 0),
            ([-inf, -inf, -inf, -inf, -7.0], 4),
            ([0.5, inf, 9.0, inf, -inf], 1),
            ([-0.0, 0.0, -1.0, -2.0, -0.0], 0),
            ([5.0, 1.0, nan, 6.0, 2.0], crate::NAN_ROW),
            ([nan; 5], crate::NAN_ROW),
            ([-2.0, -1.0, -1.5, -1.0, -3.0], 1),
        ];
        // Each row between a guard column holding the largest value and a NaN.
        let host: Vec<f32> = rows
            .iter()
            .flat_map(|(r, _)| std::iter::once(100.0).chain(*r).chain([nan]))
            .collect();
        let be = CpuBackend::recording();
        let mut x = be.alloc(host.len(), Role::Stream).unwrap();
        be.write_f32(&mut x, &host).unwrap();
        let view = View {
            buf: &x,
            offset: 1,
            rows: rows.len(),
            cols: 5,
            stride: 7,
        };
        let mut out = be.alloc(rows.len() + 2, Role::Index).unwrap();
        be.write_u32(&mut out, &[7; 10]).unwrap();
        be.argmax_rows(view, &mut out).unwrap();
        let want: Vec<u32> = rows.iter().map(|r| r.1).chain([7, 7]).collect();
        assert_eq!(be.read_u32(&out, rows.len() + 2).unwrap(), want);
        assert_eq!(be.recorded(), vec![Op::ArgmaxRows]);
        // Rows without values, and fewer indices than rows, are refused.
        assert!(be.argmax_rows(view.cols(0, 0), &mut out).is_err());
        let mut short = be.alloc(rows.len() - 1, Role::Index).unwrap();
        assert!(be.argmax_rows(view, &mut short).is_err());
        assert!(be.read_u32(&out, rows.len() + 3).is_err());
        assert!(be.read_u32(&x, 1).is_err());
    }
}
