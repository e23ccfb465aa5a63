//! The CUDA backend: the same ops as the CPU reference, fast.
//!
//! - Libraries are loaded at run time (cudarc `dynamic-loading`); [`open`] checks each one first,
//!   because cudarc panics on a missing library.
//! - Our kernels are CUDA C++ embedded in the binary and compiled by NVRTC for the device's arch
//!   on first use ([`nvrtc`]); dense GEMMs go through cuBLASLt ([`gemm`]).
//! - bf16 attention: `flash_wgmma_d{D}` (kernels/attention_sm90.cu, warpgroup MMA) on Hopper for
//!   head widths 64, 256 and 512, else the portable `flash_bf16_d{D}` (kernels/attention.cu,
//!   mma.sync); both split a tile's keys into chunks when that fills the GPU better (`flash.rs`).
//! - Precision [`Precision::Bf16`]: bf16 weights and GEMM inputs (`Role::Compute` buffers), f32
//!   accumulation, f32 residual stream and statistics. [`Precision::F32`]: everything f32, the exact
//!   mode for debugging.
//! - One stream; no host synchronisation inside a forward; repeated shapes replay a CUDA graph.
//! - `TESSERA_PROFILE=1` prints GPU milliseconds per op class after each forward (graphs off).

mod flash;
mod gemm;
pub mod kernels;
pub mod nvrtc;
mod profile;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg,
};
use tessera_core::dtype::to_bf16_bits;
use tessera_core::{DType, Error, Result, Weights};

use crate::{
    Activation, After, AttnSpec, Backend, Conv2d, Epilogue, Grids, GroupNorm, Precision, QkvLayout,
    Residual, Role, RopeStyle, RopeTable, RowNorm, Segments, View, ViewMut, offsets_of,
};
pub use flash::{FlashChoice, FlashKernel};
use gemm::{Gemm, GemmArgs};
use kernels::Kernels;
use profile::Profiler;

/// Element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    Bf16,
    U32,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::Bf16 => 2,
            Elem::F32 | Elem::U32 => 4,
        }
    }
    /// Suffix of kernel names.
    fn tag(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::U32 => "u32",
        }
    }
}

/// Device memory with its element type.
pub struct CudaBuf {
    mem: CudaSlice<u8>,
    ptr: u64,
    len: usize,
    elem: Elem,
}

impl CudaBuf {
    pub fn elem(&self) -> Elem {
        self.elem
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A weight matrix `[out, inner]` in the compute dtype.
pub struct CudaMat {
    buf: CudaBuf,
    out: usize,
    inner: usize,
}

/// An embedding table `[rows, dim]` in the compute dtype.
pub struct CudaTable {
    buf: CudaBuf,
    rows: usize,
    dim: usize,
}

/// A replayable graph. CUDA graph executables may be launched from any thread once created.
struct Graph(CudaGraph);
// SAFETY: the executable graph is only launched while holding the `graphs` mutex, on the
// backend's own stream; CUDA permits launching it from any host thread.
unsafe impl Send for Graph {}

#[derive(Default)]
struct Graphs {
    ready: HashMap<u64, Graph>,
    seen: HashSet<u64>,
}

/// Graphs kept at most; a workload with ever-new shapes must not grow memory without bound.
const MAX_GRAPHS: usize = 64;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    precision: Precision,
    kernels: Kernels,
    gemm: Gemm,
    graphs: Mutex<Graphs>,
    /// Split-key attention workspace (`flash::PART_ELEMS` f32), made on first use.
    flash_part: Mutex<Option<CudaBuf>>,
    /// Host staging for converted uploads (`write_u8_mapped`), 4-byte words, reused.
    staging: Mutex<Vec<u32>>,
    profiler: Option<Profiler>,
    name: String,
    arch: String,
    sm_count: u32,
}

fn drv(op: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| {
        if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory(op.to_string())
        } else {
            Error::backend(op, e)
        }
    }
}

/// Why CUDA cannot be used here, or `Ok` if the libraries Tessera needs can be loaded.
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only probe whether each shared library can be loaded.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(Error::Device(
            "no NVIDIA driver library (libcuda.so.1) found".into(),
        ));
    }
    nvrtc::check_library()?;
    // SAFETY: as above.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(Error::Device(
            "libcublasLt (CUDA 13) not found: install the CUDA 13 toolkit or the nvidia-cublas wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// Open CUDA device `ordinal` at `precision`: check the libraries, compile or load the kernels,
/// create the cuBLASLt handle. Every failure is an [`Error::Device`] or [`Error::Backend`] with the
/// reason; nothing panics (cudarc's internal panics are caught and reported).
pub fn open(ordinal: usize, precision: Precision) -> Result<CudaBackend> {
    check_libraries()?;
    match std::panic::catch_unwind(|| open_checked(ordinal, precision)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown failure".into());
            Err(Error::Device(format!("CUDA initialisation failed: {msg}")))
        }
    }
}

fn open_checked(ordinal: usize, precision: Precision) -> Result<CudaBackend> {
    let count =
        CudaContext::device_count().map_err(|e| Error::Device(format!("CUDA driver: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::Device(if count == 0 {
            "no CUDA device found".to_string()
        } else {
            format!("no CUDA device {ordinal} (found {count})")
        }));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| Error::Device(format!("CUDA device {ordinal}: {e}")))?;
    // SAFETY: Tessera uses one stream per backend and synchronises explicitly before every host
    // read, so cudarc's per-buffer events are not needed; they would also break graph capture.
    unsafe { ctx.disable_event_tracking() };
    let (major, minor) = ctx
        .compute_capability()
        .map_err(drv("compute capability"))?;
    if major < 8 {
        return Err(Error::Device(format!(
            "CUDA device {ordinal} has compute capability {major}.{minor}; Tessera's kernels need 8.0 or newer"
        )));
    }
    let arch = if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    };
    // A non-default stream: the legacy default stream cannot be captured into graphs.
    let stream = ctx.new_stream().map_err(drv("stream"))?;
    let kernels = Kernels::load(&ctx, &arch)?;
    let gemm = Gemm::new(&stream)?;
    let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
    let sm_count = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap_or(1) as u32;
    let profiler = Profiler::from_env(&ctx)?;
    Ok(CudaBackend {
        ctx,
        stream,
        precision,
        kernels,
        gemm,
        graphs: Mutex::new(Graphs::default()),
        flash_part: Mutex::new(None),
        staging: Mutex::new(Vec::new()),
        profiler,
        name,
        arch,
        sm_count,
    })
}

/// The image-generation ops (Z-Image) have CPU implementations only so far; asking for them on
/// CUDA is an error that says so, never a silent move to the CPU.
fn not_yet(op: &str) -> Error {
    Error::Device(format!(
        "{op} is not implemented on CUDA yet: image generation runs on the CPU (--device cpu)"
    ))
}

/// `f(bytes)` with `values` laid out as the device stores `elem` (f32 as is; bf16 rounded to
/// nearest even, converted on all cores when large, such as an image's patches). Hosts are
/// little-endian, as the device is.
fn with_device_bytes<R>(
    values: &[f32],
    elem: Elem,
    f: impl FnOnce(&[u8]) -> Result<R>,
) -> Result<R> {
    match elem {
        Elem::F32 => f(bytemuck::cast_slice(values)),
        Elem::Bf16 => {
            use rayon::prelude::*;
            const CHUNK: usize = 1 << 16;
            let mut bits = vec![0u16; values.len()];
            bits.par_chunks_mut(CHUNK)
                .zip(values.par_chunks(CHUNK))
                .for_each(|(out, vals)| out.copy_from_slice(&to_bf16_bits(vals)));
            f(bytemuck::cast_slice(&bits))
        }
        Elem::U32 => Err(Error::backend("upload", "f32 values for an index buffer")),
    }
}

/// An attention spec's window as the kernels take it: the radius, or -1 for none.
fn window_arg(spec: &AttnSpec) -> i64 {
    spec.window.map_or(-1, |w| w.min(i32::MAX as usize) as i64)
}

/// `len` benchmark operands uniform in [-½, ½) from an xorshift stream at `seed` (advanced).
fn bench_values(seed: &mut u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The first kernel arguments of every attention kernel: q, k, v and the output, each as
/// (address, row stride).
fn attention_operands(
    q: &View<'_, CudaBackend>,
    k: &View<'_, CudaBackend>,
    v: &View<'_, CudaBackend>,
    out: &ViewMut<'_, CudaBackend>,
) -> Result<[u64; 8]> {
    Ok([
        ptr_of(q)?,
        i(q.stride as i64),
        ptr_of(k)?,
        i(k.stride as i64),
        ptr_of(v)?,
        i(v.stride as i64),
        ptr_of_mut(out)?,
        i(out.stride as i64),
    ])
}

/// Byte address of a view's first element.
fn addr(buf: &CudaBuf, offset: usize) -> u64 {
    buf.ptr + (offset * buf.elem.size()) as u64
}

fn ptr_of(v: &View<'_, CudaBackend>) -> Result<u64> {
    if v.end() > v.buf.len {
        return Err(Error::backend(
            "view",
            format!("ends at {} in a buffer of {}", v.end(), v.buf.len),
        ));
    }
    Ok(addr(v.buf, v.offset))
}

fn ptr_of_mut(v: &ViewMut<'_, CudaBackend>) -> Result<u64> {
    ptr_of(&v.as_view())
}

fn same_shape(op: &str, a: (usize, usize), b: (usize, usize)) -> Result<()> {
    if a != b {
        return Err(Error::backend(
            op,
            format!("shape mismatch: {}×{} vs {}×{}", a.0, a.1, b.0, b.1),
        ));
    }
    Ok(())
}

fn f(v: f32) -> u64 {
    v.to_bits() as u64
}
fn i(v: i64) -> u64 {
    v as u64
}

fn cfg(grid: (u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

fn row_block(cols: usize) -> u32 {
    if cols <= 1024 { 128 } else { 256 }
}

/// Every row start of each `(pointer, stride, element size)` is aligned for 4-element accesses,
/// and each f32 vector (0 = none) for 16-byte ones: what the 4-wide norm kernels in norm.cu need.
fn vec4_aligned(rows: &[(u64, usize, usize)], vectors: &[u64]) -> bool {
    rows.iter().all(|&(ptr, stride, size)| {
        let align = 4 * size as u64;
        ptr.is_multiple_of(align) && ((stride * size) as u64).is_multiple_of(align)
    }) && vectors.iter().all(|v| v.is_multiple_of(16))
}

/// Rows of `cols` fit the warp-per-row norm kernels (`*_norm_warp_*` in norm.cu): 128·k columns
/// with k ≤ 8, rows and weight vectors aligned.
fn warp_norm_fits(cols: usize, rows: &[(u64, usize, usize)], weights: &[u64]) -> bool {
    cols.is_multiple_of(128) && (128..=1024).contains(&cols) && vec4_aligned(rows, weights)
}

/// Launch shape of the warp-per-row norm kernels: eight rows per 256-thread block.
fn warp_rows_cfg(rows: usize) -> LaunchConfig {
    cfg((rows.div_ceil(8) as u32, 1), 256, 0)
}

impl CudaBackend {
    pub fn device_name(&self) -> &str {
        &self.name
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("memory info"))
    }

    /// `cuda:N NAME (ARCH, PRECISION)`.
    pub fn describe_device(&self) -> String {
        self.describe()
    }

    /// TFLOP/s of a `size³` GEMM (`x · wᵀ`, operands in this backend's compute dtype, random
    /// values), median of `iters` runs timed with events after warm-up.
    pub fn bench_gemm(&self, size: usize, iters: usize) -> Result<f64> {
        let ms = self.bench_gemm_shape((size, size, size), 1, iters)?;
        Ok(2.0 * (size as f64).powi(3) / (ms / 1e3) / 1e12)
    }

    /// Median GPU ms of one `[m, k] · [n, k]ᵀ` product on random data, timed over `reps`
    /// back-to-back launches (so small products are not hidden behind the timing events).
    pub fn bench_gemm_shape(
        &self,
        (m, n, k): (usize, usize, usize),
        reps: usize,
        iters: usize,
    ) -> Result<f64> {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut x = self.alloc(m * k, Role::Compute)?;
        self.write_f32(&mut x, &bench_values(&mut seed, m * k))?;
        let w = self.matrix(&[(&bench_values(&mut seed, n * k), n)], k)?;
        let mut out = self.alloc(m * n, Role::Compute)?;
        let reps = reps.max(1);
        let mut run = || {
            for _ in 0..reps {
                self.matmul(
                    View::new(&x, m, k),
                    &w,
                    ViewMut::new(&mut out, m, n),
                    Epilogue::default(),
                )?;
            }
            Ok(())
        };
        for _ in 0..3 {
            run()?;
        }
        Ok(self.median_ms(iters, &mut run)? / reps as f64)
    }

    /// Median GPU ms of the bf16 attention op over packed segments of `lens` (random q, k, v),
    /// timed with events after warm-up, and the key-chunk count it used; `choice` fixes the
    /// kernel and/or the count (default: the op's own choices, as in a forward).
    pub fn bench_attention(
        &self,
        lens: &[usize],
        spec: &AttnSpec,
        iters: usize,
        choice: FlashChoice,
    ) -> Result<(f64, usize)> {
        let total: usize = lens.iter().sum();
        let (qc, kc) = (spec.heads_q * spec.head_dim, spec.heads_kv * spec.head_dim);
        let width = qc + 2 * kc;
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let host: Vec<f32> = bench_values(&mut seed, total * width)
            .into_iter()
            .map(|v| v * 0.25)
            .collect();
        let mut qkv = self.alloc(total * width, Role::Compute)?;
        self.write_f32(&mut qkv, &host)?;
        let mut out = self.alloc(total * qc, Role::Compute)?;
        let segs = self.segments(lens)?;
        let all = View::new(&qkv, total, width);
        let mut run = || {
            self.flash(
                all.cols(0, qc),
                all.cols(qc, kc),
                all.cols(qc + kc, kc),
                ViewMut::new(&mut out, total, qc),
                spec,
                &segs,
                choice,
            )
        };
        let mut used = 1;
        for _ in 0..3 {
            used = run()?;
        }
        let ms = self.median_ms(iters, &mut || run().map(|_| ()))?;
        Ok((ms, used))
    }

    /// Median GPU milliseconds of `run` over `iters` calls, each bracketed by timing events.
    fn median_ms(&self, iters: usize, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let start = self.ctx.new_event(flags).map_err(drv("event"))?;
            let end = self.ctx.new_event(flags).map_err(drv("event"))?;
            start.record(&self.stream).map_err(drv("event"))?;
            run()?;
            end.record(&self.stream).map_err(drv("event"))?;
            times.push(start.elapsed_ms(&end).map_err(drv("event"))? as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn compute_elem(&self) -> Elem {
        match self.precision {
            Precision::Bf16 => Elem::Bf16,
            Precision::F32 => Elem::F32,
        }
    }

    /// Launch kernel `name`; every argument is passed as an 8-byte slot (pointers, `long`) of
    /// which `int`/`float` parameters read the low 4 bytes (little-endian).
    fn launch(&self, name: &str, config: LaunchConfig, args: &[u64]) -> Result<()> {
        if config.grid_dim.0 == 0 || config.grid_dim.1 == 0 {
            return Ok(());
        }
        let func = self.kernels.get(name)?;
        if let Some(p) = &self.profiler {
            p.launched(name)?;
        }
        let mut b = self.stream.launch_builder(func);
        for a in args {
            b.arg(a);
        }
        // SAFETY: `args` matches the kernel's parameter list (checked by the op wrappers, which
        // own the only calls), every pointer addresses a live buffer whose extent was checked
        // against the launch's index range, and the slots outlive the launch call.
        unsafe { b.launch(config) }.map_err(drv(name))?;
        Ok(())
    }

    /// Run `op` under the profiler's class `class` when profiling.
    fn timed(&self, class: &'static str, op: impl FnOnce() -> Result<()>) -> Result<()> {
        match &self.profiler {
            Some(p) => p.time(&self.stream, class, op),
            None => op(),
        }
    }

    fn upload_bytes(&self, bytes: &[u8], elem: Elem, len: usize) -> Result<CudaBuf> {
        let mut mem = self
            .stream
            .alloc_zeros::<u8>(bytes.len().max(1))
            .map_err(drv("upload"))?;
        self.stream
            .memcpy_htod(bytes, &mut mem)
            .map_err(drv("upload"))?;
        let ptr = mem.device_ptr(&self.stream).0;
        Ok(CudaBuf {
            mem,
            ptr,
            len,
            elem,
        })
    }

    fn upload_f32_as(&self, values: &[f32], elem: Elem) -> Result<CudaBuf> {
        with_device_bytes(values, elem, |bytes| {
            self.upload_bytes(bytes, elem, values.len())
        })
    }

    fn write_bytes(&self, dst: &mut CudaBuf, bytes: &[u8]) -> Result<()> {
        if bytes.len() > dst.len * dst.elem.size() {
            return Err(Error::backend("write", "source longer than the buffer"));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let mut view = dst.mem.slice_mut(0..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .map_err(drv("write"))
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Mat = CudaMat;
    type Vector = CudaBuf;
    type Table = CudaTable;

    fn describe(&self) -> String {
        format!(
            "cuda:{} {} ({}, {})",
            self.ctx.ordinal(),
            self.name,
            self.arch,
            self.precision
        )
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc(&self, len: usize, role: Role) -> Result<CudaBuf> {
        let elem = match role {
            Role::Stream => Elem::F32,
            Role::Compute => self.compute_elem(),
            Role::Index => Elem::U32,
        };
        let bytes = (len * elem.size()).max(1);
        let mem = self.stream.alloc_zeros::<u8>(bytes).map_err(|e| {
            if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory(format!(
                    "{:.1} MB for a {role:?} buffer",
                    bytes as f64 / 1e6
                ))
            } else {
                Error::backend("alloc", e)
            }
        })?;
        let ptr = mem.device_ptr(&self.stream).0;
        Ok(CudaBuf {
            mem,
            ptr,
            len,
            elem,
        })
    }

    fn write_f32(&self, dst: &mut CudaBuf, src: &[f32]) -> Result<()> {
        if dst.elem == Elem::U32 {
            return Err(Error::backend("write_f32", "index buffer"));
        }
        let elem = dst.elem;
        with_device_bytes(src, elem, |bytes| self.write_bytes(dst, bytes))
    }

    /// Bytes → the device element type through a 256-entry table, each part on its own core,
    /// into a host staging buffer kept between calls (fresh pages are slow to fault in, and an
    /// image pass is ~100 MB): an image pass goes up without an `f32` copy of its pixels.
    fn write_u8_mapped(&self, dst: &mut CudaBuf, parts: &[&[u8]], map: &[f32; 256]) -> Result<()> {
        use rayon::prelude::*;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut guard = self
            .staging
            .lock()
            .map_err(|_| Error::backend("write_u8_mapped", "staging lock poisoned"))?;
        let staging: &mut Vec<u32> = &mut guard;
        fn fill<T: Copy + Send + Sync>(out: &mut [T], parts: &[&[u8]], table: &[T]) {
            let mut slices = Vec::with_capacity(parts.len());
            let mut rest = out;
            for p in parts {
                let (head, tail) = rest.split_at_mut(p.len());
                slices.push((head, *p));
                rest = tail;
            }
            slices.into_par_iter().for_each(|(out, bytes)| {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = table[b as usize];
                }
            });
        }
        let bytes = match dst.elem {
            Elem::Bf16 => {
                let words = total.div_ceil(2);
                let len = staging.len().max(words);
                staging.resize(len, 0);
                let bits: &mut [u16] =
                    &mut bytemuck::cast_slice_mut(&mut staging[..words])[..total];
                fill(bits, parts, &to_bf16_bits(map));
                bytemuck::cast_slice::<u16, u8>(bits)
            }
            Elem::F32 => {
                let len = staging.len().max(total);
                staging.resize(len, 0);
                let values: &mut [f32] = bytemuck::cast_slice_mut(&mut staging[..total]);
                fill(values, parts, map);
                bytemuck::cast_slice::<f32, u8>(values)
            }
            Elem::U32 => return Err(Error::backend("write_u8_mapped", "index buffer")),
        };
        self.write_bytes(dst, bytes)
    }

    fn write_u32(&self, dst: &mut CudaBuf, src: &[u32]) -> Result<()> {
        if dst.elem != Elem::U32 {
            return Err(Error::backend("write_u32", "not an index buffer"));
        }
        self.write_bytes(dst, bytemuck::cast_slice(src))
    }

    fn read_f32(&self, src: View<'_, Self>) -> Result<Vec<f32>> {
        ptr_of(&src)?; // bounds check
        let size = src.buf.elem.size();
        let (a, b) = (src.offset * size, src.end() * size);
        let mut host = vec![0u8; b - a];
        if b > a {
            self.stream
                .memcpy_dtoh(&src.buf.mem.slice(a..b), &mut host)
                .map_err(drv("read"))?;
        }
        self.synchronize()?;
        if let Some(p) = &self.profiler {
            p.report()?;
        }
        let mut out = Vec::with_capacity(src.rows * src.cols);
        for r in 0..src.rows {
            let row = &host[r * src.stride * size..(r * src.stride + src.cols) * size];
            match src.buf.elem {
                Elem::F32 => out.extend(
                    row.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
                Elem::Bf16 => out.extend(
                    row.chunks_exact(2)
                        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
                ),
                Elem::U32 => out.extend(
                    row.chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32),
                ),
            }
        }
        Ok(out)
    }

    fn matrix(&self, parts: &[(&[f32], usize)], inner: usize) -> Result<CudaMat> {
        let (out, data) = crate::stack_rows(parts, inner)?;
        let buf = self.upload_f32_as(&data, self.compute_elem())?;
        Ok(CudaMat { buf, out, inner })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaBuf> {
        self.upload_f32_as(v, Elem::F32)
    }

    fn table(&self, weights: &Weights, name: &str, shape: [usize; 2]) -> Result<CudaTable> {
        self.table_nd(weights, name, &shape)
    }

    fn alloc_segments(&self, max_rows: usize, max_segs: usize) -> Result<Segments<Self>> {
        let max_tiles = max_rows.div_ceil(kernels::QUERY_TILE) + max_segs;
        Ok(Segments {
            offsets: vec![0],
            dev: self.alloc(max_segs + 1 + 4 * max_tiles, Role::Index)?,
            max_rows,
            max_segs,
            tiles: 0,
        })
    }

    /// Offsets, then the query tiles `(q0, q1, s0, s1)` of `QUERY_TILE` rows the flash kernels
    /// walk; the tiles start at element `max_segs + 1`.
    fn set_segments(&self, segs: &mut Segments<Self>, lens: &[usize]) -> Result<()> {
        let offsets = offsets_of(lens, segs.max_rows, segs.max_segs)?;
        let mut data = offsets.clone();
        data.resize(segs.max_segs + 1, 0);
        let mut tiles = 0;
        for w in offsets.windows(2) {
            let (s0, s1) = (w[0], w[1]);
            let mut q0 = s0;
            while q0 < s1 {
                let q1 = (q0 + kernels::QUERY_TILE as u32).min(s1);
                data.extend_from_slice(&[q0, q1, s0, s1]);
                tiles += 1;
                q0 = q1;
            }
        }
        self.write_u32(&mut segs.dev, &data)?;
        segs.offsets = offsets;
        segs.tiles = tiles;
        Ok(())
    }

    fn run_graph(&self, key: u64, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.profiler.is_some() {
            return work(); // events inside a graph would not time anything
        }
        let mut g = self
            .graphs
            .lock()
            .map_err(|_| Error::backend("graphs", "lock poisoned"))?;
        if let Some(graph) = g.ready.get(&key) {
            return graph.0.launch().map_err(drv("graph launch"));
        }
        // First sight of a shape: run it directly; capture it the second time it comes.
        if g.seen.insert(key) {
            drop(g);
            return work();
        }
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin capture"))?;
        let worked = work();
        let captured = self
            .stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        worked?;
        let graph = captured
            .map_err(drv("graph capture"))?
            .ok_or_else(|| Error::backend("graph capture", "nothing was captured"))?;
        graph.launch().map_err(drv("graph launch"))?;
        if g.ready.len() >= MAX_GRAPHS {
            g.ready.clear();
        }
        g.ready.insert(key, Graph(graph));
        Ok(())
    }

    fn embed(
        &self,
        table: &CudaTable,
        ids: &CudaBuf,
        scale: f32,
        out: ViewMut<'_, Self>,
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
        let _ = table.rows; // ids are checked against the vocabulary by the model before upload
        let name = format!("embed_{}_f32", table.buf.elem.tag());
        let args = [
            table.buf.ptr,
            i(table.dim as i64),
            ids.ptr,
            f(scale),
            ptr_of_mut(&out)?,
            i(out.stride as i64),
        ];
        self.timed("elementwise", || {
            self.launch(&name, cfg((out.rows as u32, 1), 128, 0), &args)
        })
    }

    fn matmul(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        out: ViewMut<'_, Self>,
        ep: Epilogue,
    ) -> Result<()> {
        if x.cols != w.inner || out.rows != x.rows || out.cols != w.out {
            return Err(Error::backend(
                "matmul",
                format!(
                    "x {}×{} · wᵀ ({}×{}) → out {}×{}",
                    x.rows, x.cols, w.out, w.inner, out.rows, out.cols
                ),
            ));
        }
        if x.buf.elem != w.buf.elem {
            return Err(Error::backend(
                "matmul",
                format!("x is {:?} but the weight is {:?}", x.buf.elem, w.buf.elem),
            ));
        }
        if x.rows == 0 || w.out == 0 {
            return Ok(());
        }
        let args = GemmArgs {
            m: x.rows,
            n: w.out,
            k: w.inner,
            x: ptr_of(&x)?,
            x_stride: x.stride,
            w: w.buf.ptr,
            ab: w.buf.elem,
            out: ptr_of_mut(&out)?,
            out_stride: out.stride,
            out_elem: out.buf.elem,
            alpha: ep.alpha,
        };
        self.timed("gemm", || self.gemm.run(&self.stream, &args))
    }

    fn rms_norm(
        &self,
        x: View<'_, Self>,
        w: Option<&CudaBuf>,
        eps: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        same_shape("rms_norm", (x.rows, x.cols), (out.rows, out.cols))?;
        if w.is_some_and(|w| w.len != x.cols) {
            return Err(Error::backend(
                "rms_norm",
                "weight length differs from the row width",
            ));
        }
        let (xp, op) = (ptr_of(&x)?, ptr_of_mut(&out)?);
        let (xt, ot) = (x.buf.elem.tag(), out.buf.elem.tag());
        let w = w.map_or(0, |w| w.ptr);
        let mut args = vec![xp, i(x.stride as i64), w, op, i(out.stride as i64)];
        let rows = [
            (xp, x.stride, x.buf.elem.size()),
            (op, out.stride, out.buf.elem.size()),
        ];
        let (name, launch) = if warp_norm_fits(x.cols, &rows, &[w]) {
            args.push(i(x.rows as i64));
            (format!("rms_norm_warp_{xt}_{ot}"), warp_rows_cfg(x.rows))
        } else {
            let block = cfg((x.rows as u32, 1), row_block(x.cols), 0);
            (format!("rms_norm_{xt}_{ot}"), block)
        };
        args.extend([i(x.cols as i64), f(eps)]);
        self.timed("norm", || self.launch(&name, launch, &args))
    }

    fn cast(&self, x: View<'_, Self>, out: ViewMut<'_, Self>) -> Result<()> {
        same_shape("cast", (x.rows, x.cols), (out.rows, out.cols))?;
        let name = format!("cast_{}_{}", x.buf.elem.tag(), out.buf.elem.tag());
        let args = [
            ptr_of(&x)?,
            i(x.stride as i64),
            ptr_of_mut(&out)?,
            i(out.stride as i64),
            i(x.cols as i64),
        ];
        self.timed("elementwise", || {
            self.launch(&name, cfg((x.rows as u32, 1), row_block(x.cols), 0), &args)
        })
    }

    fn residual_norm(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        post: Option<&CudaBuf>,
        scale: f32,
        after: After<'_, Self>,
        eps: f32,
    ) -> Result<()> {
        same_shape("residual_norm", (h.rows, h.cols), (y.rows, y.cols))?;
        if h.buf.elem != Elem::F32 {
            return Err(Error::backend(
                "residual_norm",
                "the residual stream must be f32",
            ));
        }
        let (mode, next, out) = match &after {
            After::Nothing => (0, 0, None),
            After::Norm(w, o) => {
                if w.len != h.cols {
                    return Err(Error::backend(
                        "residual_norm",
                        "next-norm weight length differs from the row width",
                    ));
                }
                (1, w.ptr, Some(o))
            }
            After::Copy(o) => (2, 0, Some(o)),
        };
        if let Some(o) = out {
            same_shape("residual_norm", (h.rows, h.cols), (o.rows, o.cols))?;
        }
        let out_tag = out.map_or("f32", |o| o.buf.elem.tag());
        let (optr, ostride) = match out {
            Some(o) => (ptr_of_mut(o)?, o.stride),
            None => (0, 0),
        };
        let (hp, yp, pp) = (ptr_of_mut(&h)?, ptr_of(&y)?, post.map_or(0, |p| p.ptr));
        let mut args = vec![
            hp,
            i(h.stride as i64),
            yp,
            i(y.stride as i64),
            pp,
            f(scale),
            i(mode),
            next,
            optr,
            i(ostride as i64),
        ];
        let mut rows = vec![(hp, h.stride, 4), (yp, y.stride, y.buf.elem.size())];
        if let Some(o) = out {
            rows.push((optr, o.stride, o.buf.elem.size()));
        }
        let tags = format!("{}_{}", y.buf.elem.tag(), out_tag);
        let (name, launch) = if warp_norm_fits(h.cols, &rows, &[pp, next]) {
            args.push(i(h.rows as i64));
            (format!("residual_norm_warp_{tags}"), warp_rows_cfg(h.rows))
        } else {
            let smem = (h.cols * 4) as u32;
            let block = cfg((h.rows as u32, 1), row_block(h.cols), smem);
            (format!("residual_norm_{tags}"), block)
        };
        args.extend([i(h.cols as i64), f(eps)]);
        self.timed("norm", || self.launch(&name, launch, &args))
    }

    fn qkv_norm_rope(
        &self,
        qkv: ViewMut<'_, Self>,
        layout: QkvLayout,
        q_w: Option<&CudaBuf>,
        k_w: Option<&CudaBuf>,
        v_norm: bool,
        eps: f32,
        rope: Option<(&RopeTable<Self>, &CudaBuf)>,
    ) -> Result<()> {
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
                let (per_row, pairs) = match t.style {
                    RopeStyle::SplitHalf => (1, hd / 2),
                    RopeStyle::Axial2d => (2, hd / 4),
                    RopeStyle::Interleaved => return Err(not_yet("interleaved RoPE")),
                };
                if t.half != pairs || pairs * 2 * per_row != hd || p.len < per_row * qkv.rows {
                    return Err(Error::backend(
                        "qkv_norm_rope",
                        "rope table does not fit the heads",
                    ));
                }
                (t.buf.ptr, t.len, t.half, (per_row == 2) as i64, p.ptr)
            }
            None => (0, 0, 0, 0, 0),
        };
        let (tag, size) = (qkv.buf.elem.tag(), qkv.buf.elem.size());
        let qkv_ptr = ptr_of_mut(&qkv)?;
        // The vector kernels need rows, weights and table aligned: the 4-wide one takes
        // split-half heads of 256·m (m ≤ 2), the 8-lane one axial heads of 64 (the vision tower).
        let aligned = vec4_aligned(
            &[(qkv_ptr, qkv.stride, size)],
            &[q_w.map_or(0, |w| w.ptr), k_w.map_or(0, |w| w.ptr), table],
        );
        let wide = aligned && axial == 0 && (hd == 256 || hd == 512);
        let axial64 = aligned && axial == 1 && hd == 64;
        let name = if axial64 {
            format!("qkv_norm_rope_axial64_{tag}")
        } else if axial == 1 {
            format!("qkv_norm_rope_axial_{tag}")
        } else if wide {
            format!("qkv_norm_rope_vec_{tag}")
        } else {
            format!("qkv_norm_rope_{tag}")
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
        let args = [
            qkv_ptr,
            i(qkv.stride as i64),
            i(qkv.rows as i64),
            i(layout.heads_q as i64),
            i(layout.heads_kv as i64),
            i(hd as i64),
            q_w.map_or(0, |w| w.ptr),
            k_w.map_or(0, |w| w.ptr),
            i(v_norm as i64),
            f(eps),
            table,
            i(tlen as i64),
            i(thalf as i64),
            pos,
        ];
        self.timed("norm", || {
            self.launch(&name, cfg((warps.div_ceil(8), 1), 256, 0), &args)
        })
    }

    fn attention(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec,
        segs: &Segments<Self>,
    ) -> Result<()> {
        if self.precision == Precision::Bf16 {
            // The tensor-core kernel checks its own operands.
            return self
                .flash(q, k, v, out, spec, segs, FlashChoice::default())
                .map(|_| ());
        }
        let hd = spec.head_dim;
        let total = segs.total();
        spec.check(&q, &k, &v, &out, total)?;
        if [q.buf.elem, k.buf.elem, v.buf.elem, out.buf.elem]
            .iter()
            .any(|&e| e != Elem::F32)
            || hd > 512
        {
            return Err(Error::backend(
                "attention",
                "f32 attention needs f32 operands and head_dim ≤ 512",
            ));
        }
        let warps = (total * spec.heads_q) as u32;
        let mut args = attention_operands(&q, &k, &v, &out)?.to_vec();
        args.extend([
            segs.dev.ptr,
            i(segs.count() as i64),
            i(total as i64),
            i(spec.heads_q as i64),
            i((spec.heads_q / spec.heads_kv) as i64),
            i(hd as i64),
            f(spec.scale),
            i(window_arg(spec)),
            i(spec.causal as i64),
        ]);
        self.timed("attention", || {
            self.launch("attn_rows_f32", cfg((warps.div_ceil(4), 1), 128, 0), &args)
        })
    }

    fn gated(
        &self,
        gate: View<'_, Self>,
        up: View<'_, Self>,
        out: ViewMut<'_, Self>,
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
        let act = match act {
            Activation::GeluTanh => "gelu",
            Activation::Silu => "silu",
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
        let name = if vec {
            format!("gated_vec_{act}_{}", e.tag())
        } else {
            format!("gated_{act}_{}", e.tag())
        };
        let n = gate.rows * gate.cols / if vec { v } else { 1 };
        let blocks = n.div_ceil(256).min(self.sm_count as usize * 16).max(1) as u32;
        let args = [
            ptr_of(&gate)?,
            i(gate.stride as i64),
            ptr_of(&up)?,
            i(up.stride as i64),
            ptr_of_mut(&out)?,
            i(out.stride as i64),
            i(gate.rows as i64),
            i(gate.cols as i64),
        ];
        if n == 0 {
            return Ok(());
        }
        self.timed("elementwise", || {
            self.launch(&name, cfg((blocks, 1), 256, 0), &args)
        })
    }

    fn segment_mean(
        &self,
        x: View<'_, Self>,
        segs: &Segments<Self>,
        out: ViewMut<'_, Self>,
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
        let name = format!("segment_mean_{}", x.buf.elem.tag());
        let args = [
            ptr_of(&x)?,
            i(x.stride as i64),
            segs.dev.ptr,
            ptr_of_mut(&out)?,
            i(out.stride as i64),
            i(x.cols as i64),
        ];
        let grid = (out.rows as u32, x.cols.div_ceil(128) as u32);
        self.timed("pool", || self.launch(&name, cfg(grid, 128, 0), &args))
    }

    // ---- vision ----

    fn table_nd(&self, weights: &Weights, name: &str, shape: &[usize]) -> Result<CudaTable> {
        let t = weights.get(name, shape)?;
        let dim = *shape
            .last()
            .ok_or_else(|| Error::backend("table", "empty shape"))?;
        let rows = shape[..shape.len() - 1].iter().product();
        let buf = match (self.compute_elem(), t.dtype) {
            // The checkpoint's bf16 bytes go up as they are.
            (Elem::Bf16, DType::BF16) => self.upload_bytes(t.bytes, Elem::Bf16, t.numel())?,
            (e, _) => self.upload_f32_as(&t.to_f32(), e)?,
        };
        Ok(CudaTable { buf, rows, dim })
    }

    fn add_positions_2d(
        &self,
        table: &CudaTable,
        axis_rows: usize,
        pos: &CudaBuf,
        x: ViewMut<'_, Self>,
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
        let name = format!(
            "add_positions_2d_{}_{}",
            table.buf.elem.tag(),
            x.buf.elem.tag()
        );
        let args = [
            table.buf.ptr,
            i(table.dim as i64),
            i(axis_rows as i64),
            pos.ptr,
            ptr_of_mut(&x)?,
            i(x.stride as i64),
        ];
        self.timed("elementwise", || {
            self.launch(&name, cfg((x.rows as u32, 1), row_block(x.cols), 0), &args)
        })
    }

    fn avg_pool2d(
        &self,
        x: View<'_, Self>,
        grids: &Grids<Self>,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        let k = grids.kernel;
        grids.check((x.rows, x.cols), (out.rows, out.cols))?;
        let name = format!("avg_pool2d_{}_{}", x.buf.elem.tag(), out.buf.elem.tag());
        let args = [
            ptr_of(&x)?,
            i(x.stride as i64),
            grids.dev.ptr,
            i(grids.dims.len() as i64),
            i(k as i64),
            f(scale),
            ptr_of_mut(&out)?,
            i(out.stride as i64),
            i(x.cols as i64),
        ];
        let grid = (out.rows as u32, x.cols.div_ceil(128) as u32);
        self.timed("pool", || self.launch(&name, cfg(grid, 128, 0), &args))
    }

    fn scatter_rows(
        &self,
        src: View<'_, Self>,
        rows: &CudaBuf,
        dst: ViewMut<'_, Self>,
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
        let name = format!("scatter_rows_{}_{}", src.buf.elem.tag(), dst.buf.elem.tag());
        let args = [
            ptr_of(&src)?,
            i(src.stride as i64),
            rows.ptr,
            ptr_of_mut(&dst)?,
            i(dst.stride as i64),
            i(src.cols as i64),
        ];
        self.timed("elementwise", || {
            self.launch(
                &name,
                cfg((src.rows as u32, 1), row_block(src.cols), 0),
                &args,
            )
        })
    }

    // ---- image generation (Z-Image): CPU only for now ----

    fn linear(
        &self,
        _x: View<'_, Self>,
        _w: &CudaMat,
        _b: Option<&CudaBuf>,
        _a: Option<Activation>,
        _o: ViewMut<'_, Self>,
    ) -> Result<()> {
        Err(not_yet("linear"))
    }

    fn norm(
        &self,
        _x: View<'_, Self>,
        _n: &RowNorm<'_, Self>,
        _o: ViewMut<'_, Self>,
    ) -> Result<()> {
        Err(not_yet("norm"))
    }

    fn residual_add(
        &self,
        _h: ViewMut<'_, Self>,
        _y: View<'_, Self>,
        _r: &Residual<'_, Self>,
        _n: Option<(&RowNorm<'_, Self>, ViewMut<'_, Self>)>,
    ) -> Result<()> {
        Err(not_yet("residual_add"))
    }

    fn conv2d(
        &self,
        _x: View<'_, Self>,
        _w: &CudaMat,
        _b: &CudaBuf,
        _s: &Conv2d,
        _o: ViewMut<'_, Self>,
    ) -> Result<()> {
        Err(not_yet("conv2d"))
    }

    fn group_norm(
        &self,
        _x: View<'_, Self>,
        _w: &CudaBuf,
        _b: &CudaBuf,
        _s: &GroupNorm,
        _o: ViewMut<'_, Self>,
    ) -> Result<()> {
        Err(not_yet("group_norm"))
    }
}
