//! Device memory: typed buffers, weight uploads, host writes and reads, and the checked device
//! addresses of views that every launch passes.

use std::ops::Range;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::slice::HalfFloatSliceExt;
use tessera_core::dtype::{to_bf16_bits, widen_into};
use tessera_core::{DType, Error, Result, Tensor, Weights};

use super::CudaBackend;
use super::errors::drv;
use super::launch::DevPtr;
use crate::{Precision, Role, View, ViewMut};

/// Element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    Bf16,
    U32,
}

impl Elem {
    pub(super) fn size(self) -> usize {
        match self {
            Elem::Bf16 => 2,
            Elem::F32 | Elem::U32 => 4,
        }
    }
    /// Suffix of kernel names.
    pub(super) fn tag(self) -> &'static str {
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
    pub(super) ptr: DevPtr,
    pub(super) len: usize,
    pub(super) elem: Elem,
}

impl CudaBuf {
    fn new(mem: CudaSlice<u8>, stream: &CudaStream, len: usize, elem: Elem) -> Self {
        let ptr = DevPtr(mem.device_ptr(stream).0);
        CudaBuf {
            mem,
            ptr,
            len,
            elem,
        }
    }
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

/// How a weight matrix is stored on the device; the matrix product dispatches on it.
///
/// Dense, in the compute dtype; FP8 e4m3 codes as stored, with their scales (products in
/// `fp8.rs`); or GGUF blocks as stored, with their runs of rows (products in `blocks.rs`).
pub enum MatFormat {
    Dense(Elem),
    /// e4m3 codes `[out rounded up to 16, inner]`, four to a `u32` word of the buffer.
    Fp8(super::fp8::Fp8Scales),
    /// Q8_0, Q4_0, Q4_K or Q6_K blocks, the file's bytes: runs of rows each in one format (a
    /// stacked matrix may join parts in different formats), so the format is the runs'.
    Block(super::blocks::BlockRuns),
}

/// A weight matrix `[out, inner]`.
pub struct CudaMat {
    pub(super) buf: CudaBuf,
    pub(super) out: usize,
    pub(super) inner: usize,
    pub(super) format: MatFormat,
}

/// An embedding table `[rows, dim]` in the compute dtype.
pub struct CudaTable {
    pub(super) buf: CudaBuf,
    pub(super) rows: usize,
    pub(super) dim: usize,
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

/// Device address of element `offset` of `buf`.
pub(super) fn addr(buf: &CudaBuf, offset: usize) -> DevPtr {
    DevPtr(buf.ptr.0 + (offset * buf.elem.size()) as u64)
}

/// Device address of a view's first element, once the view is checked to lie in its buffer.
pub(super) fn ptr_of(v: &View<'_, CudaBackend>) -> Result<DevPtr> {
    if v.end() > v.buf.len {
        return Err(Error::backend(
            "view",
            format!("ends at {} in a buffer of {}", v.end(), v.buf.len),
        ));
    }
    Ok(addr(v.buf, v.offset))
}

pub(super) fn ptr_of_mut(v: &ViewMut<'_, CudaBackend>) -> Result<DevPtr> {
    ptr_of(&v.as_view())
}

impl CudaBackend {
    pub(super) fn compute_elem(&self) -> Elem {
        match self.precision {
            Precision::Bf16 => Elem::Bf16,
            Precision::F32 => Elem::F32,
        }
    }

    pub(super) fn alloc_buf(&self, len: usize, role: Role) -> Result<CudaBuf> {
        self.alloc_with(len, role, true)
    }

    /// A buffer of `len` elements of `role`, zero-filled or not (`Backend::alloc_scratch`).
    pub(super) fn alloc_with(&self, len: usize, role: Role, zeroed: bool) -> Result<CudaBuf> {
        let elem = match role {
            Role::Stream => Elem::F32,
            Role::Compute => self.compute_elem(),
            Role::Index => Elem::U32,
        };
        let bytes = (len * elem.size()).max(1);
        let mem = if zeroed {
            self.stream.alloc_zeros::<u8>(bytes)
        } else {
            // SAFETY: the bytes are device memory that the host never sees but through a copy,
            // and every bit pattern is a valid u8; the callers write what they read
            // (`Backend::alloc_scratch`).
            unsafe { self.stream.alloc::<u8>(bytes) }
        };
        let mem = mem.map_err(|e| {
            if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory(format!(
                    "{:.1} MB for a {role:?} buffer",
                    bytes as f64 / 1e6
                ))
            } else {
                Error::backend("alloc", e)
            }
        })?;
        Ok(CudaBuf::new(mem, &self.stream, len, elem))
    }

    fn write_bytes(&self, dst: &mut CudaBuf, bytes: &[u8]) -> Result<()> {
        self.write_bytes_at(dst, 0, bytes)
    }

    /// Copy `bytes` into `dst` from byte `at`.
    pub(super) fn write_bytes_at(&self, dst: &mut CudaBuf, at: usize, bytes: &[u8]) -> Result<()> {
        if at + bytes.len() > dst.len * dst.elem.size() {
            return Err(Error::backend("write", "source longer than the buffer"));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let mut view = dst.mem.slice_mut(at..at + bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .map_err(drv("write"))
    }

    pub(super) fn write_f32_to(&self, dst: &mut CudaBuf, src: &[f32]) -> Result<()> {
        self.write_f32_at(dst, 0, src)
    }

    /// Copy `src` into `dst` from element `start`, converted to `dst`'s element type.
    pub(super) fn write_f32_at(&self, dst: &mut CudaBuf, start: usize, src: &[f32]) -> Result<()> {
        if dst.elem == Elem::U32 {
            return Err(Error::backend("write_f32", "index buffer"));
        }
        let elem = dst.elem;
        with_device_bytes(src, elem, |bytes| {
            self.write_bytes_at(dst, start * elem.size(), bytes)
        })
    }

    /// Bytes → the device element type through a 256-entry table: the table and the bytes go
    /// up as they are, gathered in a host staging buffer kept between calls (fresh pages are
    /// slow to fault in), and `map_bytes` writes each value on the device. Looking the values
    /// up on the host took ~0.5 ms of a 512² tile before its first kernel and sent 2–4× the
    /// bytes up (run g27).
    pub(super) fn write_u8_mapped_to(
        &self,
        dst: &mut CudaBuf,
        parts: &[&[u8]],
        map: &[f32; 256],
    ) -> Result<()> {
        const OP: &str = "write_u8_mapped";
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if dst.elem == Elem::U32 {
            return Err(Error::backend(OP, "index buffer"));
        }
        if total > dst.len {
            return Err(Error::backend(
                OP,
                format!("{total} values for a buffer of {}", dst.len),
            ));
        }
        if total == 0 {
            return Ok(());
        }
        // [table: 256 f32 | the bytes, packed], in 4-byte words.
        let words = 256 + total.div_ceil(4);
        let mut stage = self.alloc_with(words, Role::Index, false)?;
        {
            let mut guard = self
                .staging
                .lock()
                .map_err(|_| Error::backend(OP, "staging lock poisoned"))?;
            let staging: &mut Vec<u32> = &mut guard;
            let len = staging.len().max(words);
            staging.resize(len, 0);
            let host: &mut [u8] = bytemuck::cast_slice_mut(&mut staging[..words]);
            let (table, mut rest) = host.split_at_mut(256 * 4);
            table.copy_from_slice(bytemuck::cast_slice(map));
            for p in parts {
                let (head, tail) = rest.split_at_mut(p.len());
                head.copy_from_slice(p);
                rest = tail;
            }
            self.write_bytes(&mut stage, &host[..256 * 4 + total])?;
        }
        super::elementwise::map_bytes(self, addr(&stage, 256), stage.ptr, dst.ptr, dst.elem, total)
    }

    pub(super) fn write_u32_to(&self, dst: &mut CudaBuf, src: &[u32]) -> Result<()> {
        if dst.elem != Elem::U32 {
            return Err(Error::backend("write_u32", "not an index buffer"));
        }
        self.write_bytes(dst, bytemuck::cast_slice(src))
    }

    /// Read the first `len` values of an index buffer after all queued work, then print the
    /// profile of that work (a greedy decoding step reads nothing else).
    pub(super) fn read_indices(&self, src: &CudaBuf, len: usize) -> Result<Vec<u32>> {
        if src.elem != Elem::U32 || src.len < len {
            return Err(Error::backend(
                "read_u32",
                format!("not an index buffer of {len} values"),
            ));
        }
        let mut out = vec![0u32; len];
        self.read_bytes(&src.mem, 0..len * 4, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Copy bytes `range` of `mem` into `dst` after all queued work, then print the profile of
    /// that work (the copy marked as its read back).
    fn read_bytes(&self, mem: &CudaSlice<u8>, range: Range<usize>, dst: &mut [u8]) -> Result<()> {
        if let Some(p) = &self.profiler {
            p.read_begins(&self.stream)?;
        }
        if !range.is_empty() {
            self.stream
                .memcpy_dtoh(&mem.slice(range), dst)
                .map_err(drv("read"))?;
        }
        if let Some(p) = &self.profiler {
            p.read_ends(&self.stream)?;
        }
        self.synchronize()?;
        if let Some(p) = &self.profiler {
            p.report(&self.stream)?;
        }
        Ok(())
    }

    /// [`crate::Backend::read_rgb8`] on the device: `rgb8_{x}` converts the view into a byte
    /// buffer whose last two words count the values that are not finite and keep the first one's
    /// index, then one copy brings back a quarter of the bytes `read_view` would.
    pub(super) fn read_rgb8_view(&self, src: View<'_, Self>, stage: &str) -> Result<Vec<u8>> {
        let n = src.rows * src.cols;
        if u32::try_from(n).is_err() || i32::try_from(src.cols).is_err() {
            return Err(Error::backend(
                "read_rgb8",
                format!("{} × {} values", src.rows, src.cols),
            ));
        }
        let words = n.div_ceil(4);
        let mut buf = self.alloc_buf(words + 2, Role::Index)?; // zeroed: no bad value counted
        self.write_bytes_at(&mut buf, (words + 1) * 4, &u32::MAX.to_le_bytes())?;
        super::elementwise::rgb8(self, &src, buf.ptr, addr(&buf, words))?;
        let back = self.read_indices(&buf, words + 2)?;
        let (count, first) = (back[words] as usize, back[words + 1] as usize);
        if count > 0 {
            return Err(Error::NonFinite {
                stage: stage.to_string(),
                count,
                len: n,
                first,
            });
        }
        Ok(bytemuck::cast_slice::<u32, u8>(&back[..words])[..n].to_vec())
    }

    /// Read a view back as `f32` after all queued work, then print the profile of that work.
    pub(super) fn read_view(&self, src: View<'_, Self>) -> Result<Vec<f32>> {
        ptr_of(&src)?; // bounds check
        let size = src.buf.elem.size();
        let (a, b) = (src.offset * size, src.end() * size);
        let span = (b - a) / size;
        // Copied into a vector of the buffer's element type, converted (and its rows packed)
        // in place where that is f32: a 1024² image's 12.6 MB cost ~18 ms of host time as
        // bytes decoded one value at a time.
        let read = |dst: &mut [u8]| self.read_bytes(&src.buf.mem, a..b, dst);
        let (rows, cols, stride) = (src.rows, src.cols, src.stride);
        let out = match src.buf.elem {
            Elem::F32 => {
                let mut v = vec![0f32; span];
                read(bytemuck::cast_slice_mut(&mut v))?;
                if stride != cols {
                    for r in 1..rows {
                        v.copy_within(r * stride..r * stride + cols, r * cols);
                    }
                    v.truncate(rows * cols);
                }
                v
            }
            Elem::Bf16 => {
                let mut v = vec![half::bf16::ZERO; span];
                read(bytemuck::cast_slice_mut(&mut v))?;
                let mut out = vec![0f32; rows * cols];
                for (r, dst) in out.chunks_exact_mut(cols.max(1)).enumerate() {
                    v[r * stride..r * stride + cols].convert_to_f32_slice(dst);
                }
                out
            }
            Elem::U32 => {
                let mut v = vec![0u32; span];
                read(bytemuck::cast_slice_mut(&mut v))?;
                (0..rows)
                    .flat_map(|r| v[r * stride..r * stride + cols].iter().map(|&x| x as f32))
                    .collect()
            }
        };
        Ok(out)
    }

    /// Weight matrices `[out_i, inner]` stacked along `out`, uploaded in the compute dtype
    /// straight from their stored bytes: a part already in that dtype is copied as it is (a bf16
    /// checkpoint under bf16), any other is converted on the host a slice at a time, so no
    /// whole-matrix host copy (least of all an `f32` one) is ever made. FP8 parts, and float
    /// parts under `--quantize fp8`, go up as FP8 codes ([`super::fp8::upload`]); GGUF
    /// block-format parts as their blocks ([`super::blocks::upload`]), as do float matrices
    /// whose rows are whole blocks under `--quantize` to a block format, quantized here as the
    /// CPU quantizes them; unless `at_load` is false (`Backend::matrix_unquantized`).
    pub(super) fn upload_matrix(&self, parts: &[Tensor<'_>], at_load: bool) -> Result<CudaMat> {
        let (out, inner) = crate::stacked_shape(parts)?;
        // Float parts that `--quantize` may quantize here.
        let quantizable = at_load && out > 0 && parts.iter().all(|t| !t.dtype.is_quantized());
        let quantize = self.fp8_at_load && quantizable;
        if quantize || parts.iter().any(|t| t.dtype == DType::F8_E4M3) {
            return super::fp8::upload(self, parts, quantize);
        }
        if let Some(q) = self
            .blocks_at_load
            .filter(|q| quantizable && q.bytes_for(inner).is_some())
        {
            let mat = crate::cpu::quant::quantize_stack(parts, q, (out, inner))?;
            let t = Tensor {
                name: parts[0].name.clone(),
                dtype: q,
                shape: vec![out, inner],
                bytes: std::borrow::Cow::Borrowed(mat.blocks()),
                path: parts[0].path,
                scale: None,
            };
            return super::blocks::upload(self, &[t]);
        }
        if super::blocks::is_block(parts) {
            return super::blocks::upload(self, parts);
        }
        let elem = self.compute_elem();
        let mut buf = self.alloc_buf(out * inner, Role::Compute)?;
        let mut at = 0;
        for t in parts {
            self.write_tensor_at(&mut buf, at, t)?;
            at += t.numel();
        }
        Ok(CudaMat {
            buf,
            out,
            inner,
            format: MatFormat::Dense(elem),
        })
    }

    /// Copy tensor `t` into `dst` from element `start`, converted to `dst`'s element type.
    fn write_tensor_at(&self, dst: &mut CudaBuf, start: usize, t: &Tensor<'_>) -> Result<()> {
        let size = dst.elem.size();
        let native = matches!(
            (dst.elem, t.dtype),
            (Elem::Bf16, DType::BF16) | (Elem::F32, DType::F32)
        );
        if native {
            return self.write_bytes_at(dst, start * size, &t.bytes);
        }
        // 4 Mi elements per slice: 16 MiB of f32 at most on the host.
        const SLICE: usize = 1 << 22;
        let Some(s) = t.dtype.size() else {
            return self.write_blocks_at(dst, start, t, SLICE);
        };
        let mut values = vec![0f32; SLICE.min(t.numel())];
        for (i, chunk) in t.bytes.chunks(SLICE * s).enumerate() {
            let n = chunk.len() / s;
            widen_into(t.dtype, chunk, &mut values[..n]);
            let at = (start + i * SLICE) * size;
            with_device_bytes(&values[..n], dst.elem, |bytes| {
                self.write_bytes_at(dst, at, bytes)
            })?;
        }
        Ok(())
    }

    /// [`Self::write_tensor_at`] for a GGUF block-format tensor (an embedding table, a vector):
    /// decoded on the host as the CPU decodes it, whole blocks of at most `slice` values at a
    /// time. Products on block-format matrices keep their blocks instead ([`super::blocks`]).
    fn write_blocks_at(
        &self,
        dst: &mut CudaBuf,
        start: usize,
        t: &Tensor<'_>,
        slice: usize,
    ) -> Result<()> {
        let Some(g) = t.dtype.ggml() else {
            return Err(Error::Device(format!(
                "`{}`: {} values cannot be read here (only as a matrix's weights)",
                t.name, t.dtype
            )));
        };
        let (bs, bb) = (g.block_size(), g.block_bytes());
        if g.bytes_for(t.numel()) != Some(t.bytes.len()) {
            return Err(Error::backend(
                "upload",
                format!(
                    "`{}`: its bytes are not {} whole {} blocks",
                    t.name,
                    t.numel(),
                    t.dtype
                ),
            ));
        }
        let per = (slice / bs).max(1);
        let mut values = vec![0f32; (per * bs).min(t.numel())];
        let size = dst.elem.size();
        for (i, chunk) in t.bytes.chunks(per * bb).enumerate() {
            let n = chunk.len() / bb * bs;
            g.dequantize(chunk, &mut values[..n])?;
            let at = (start + i * per * bs) * size;
            with_device_bytes(&values[..n], dst.elem, |bytes| {
                self.write_bytes_at(dst, at, bytes)
            })?;
        }
        Ok(())
    }

    /// A parameter vector from a 1-D tensor, in `f32`.
    pub(super) fn upload_vector(&self, t: &Tensor<'_>) -> Result<CudaBuf> {
        let mut buf = self.alloc_buf(crate::vector_len(t)?, Role::Stream)?;
        self.write_tensor_at(&mut buf, 0, t)?;
        Ok(buf)
    }

    /// A checkpoint table `[.., dim]` in the compute dtype, converted a slice at a time as
    /// [`Self::upload_matrix`] does (bf16 checkpoint bytes go up as they are).
    pub(super) fn upload_table(
        &self,
        weights: &Weights,
        name: &str,
        shape: &[usize],
    ) -> Result<CudaTable> {
        let (rows, dim) = crate::table_shape(name, shape)?;
        let t = weights.get(name, shape)?;
        let mut buf = self.alloc_buf(t.numel(), Role::Compute)?;
        self.write_tensor_at(&mut buf, 0, &t)?;
        Ok(CudaTable { buf, rows, dim })
    }
}

/// Fixed-size device workspaces that some ops use beside their operands (a product's f32
/// result before its epilogue, a convolution's column blocks, GroupNorm's partial sums). Each is
/// made on first use at its fixed size and never moved or freed before the backend, so a graph
/// that captured its address stays valid; ops work through it a block of rows at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Workspace {
    /// A product's f32 output rows, 64 MiB.
    Product,
    /// A block-format matrix's column block decoded to the activations' type for cuBLASLt,
    /// 64 MiB (apart from `Product`, which such a product may be writing into).
    Dequant,
    /// A convolution's im2col rows in the compute type, 256 MiB.
    Columns,
    /// GroupNorm's per-block partial sums (f64 pairs) and per-group statistics, 1 MiB.
    Stats,
    /// The grid-wide count of a product whose last CTA ends with a residual step (gemv.cu's
    /// `ResidualOut`): zero between launches (each launch's last CTA wraps it back), 256 bytes.
    Counts,
}

impl Workspace {
    fn role(self) -> Role {
        match self {
            Workspace::Columns => Role::Compute,
            Workspace::Product | Workspace::Dequant | Workspace::Stats => Role::Stream,
            Workspace::Counts => Role::Index,
        }
    }
    pub(super) const fn bytes(self) -> usize {
        match self {
            Workspace::Product | Workspace::Dequant => 64 << 20,
            Workspace::Columns => 256 << 20,
            Workspace::Stats => 1 << 20,
            Workspace::Counts => 256,
        }
    }
}

impl CudaBackend {
    /// Address and capacity (in elements of its role's type) of workspace `w`.
    pub(super) fn workspace(&self, w: Workspace) -> Result<(DevPtr, usize)> {
        let mut slots = self
            .workspaces
            .lock()
            .map_err(|_| Error::backend("workspace", "lock poisoned"))?;
        let elem_size = match w.role() {
            Role::Compute => self.compute_elem().size(),
            _ => 4,
        };
        let buf = match slots.entry(w) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.alloc_buf(w.bytes() / elem_size, w.role())?)
            }
        };
        Ok((buf.ptr, buf.len))
    }
}
