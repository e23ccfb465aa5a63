//! The CUDA backend: the same ops as the CPU reference, fast.
//!
//! - Libraries are loaded at run time (cudarc `dynamic-loading`); [`open`] checks each one first,
//!   because cudarc panics on a missing library ([`device`]).
//! - Our kernels are CUDA C++ embedded in the binary and compiled by NVRTC for the device's arch
//!   on first use ([`nvrtc`]); dense GEMMs go through cuBLASLt ([`gemm`]), but for products of
//!   at most 16 bf16 rows (decoding), which stream the weight on our own kernel ([`gemv`]).
//! - One module per op family beside its kernel source — [`norm`] (kernels/norm.cu),
//!   [`elementwise`], [`rows`], [`image`] (im2col and GroupNorm), [`short_conv`] (LFM2's gated
//!   convolution), [`attention`] (attention.cu, attention_sm90.cu) — each declaring
//!   its kernels in a typed table with typed argument structs ([`launch`]): every table is
//!   resolved when the backend opens ([`tables`]), and CI checks the tables against NVRTC's output.
//! - bf16 attention: `flash_ws_d{D}` (64, 128; segments of 256 rows or more) and
//!   `flash_wgmma_d{D}` (64, 128, 256, 512) on Hopper (kernels/attention_sm90.cu, warpgroup
//!   MMA), else the portable `flash_bf16_d{D}` (kernels/attention.cu, mma.sync; 72-wide heads
//!   too); every mask, per-row key limits included; all split a tile's keys into chunks when that
//!   fills the GPU better (`attention/flash.rs`). Attention over cached key ranges (decoding) has its own kernel in
//!   both precisions, `attn_cached_{T}_d{D}`, a CTA per (query row, kv head, key chunk) with a
//!   combine pass after a split launch (`attention/cached.rs`).
//! - Precision [`Precision::Bf16`]: bf16 weights and GEMM inputs (`Role::Compute` buffers), f32
//!   accumulation, f32 residual stream and statistics. [`Precision::F32`]: everything f32, the exact
//!   mode for debugging.
//! - One stream; no host synchronisation inside a forward; repeated shapes replay a CUDA graph
//!   ([`graph`]).
//! - `TESSERA_PROFILE=1` prints GPU milliseconds per op class after each forward (graphs off);
//!   `TESSERA_PROFILE=kernels` per class and kernel name.

pub mod attention;
mod bench;
mod blocks;
mod cublaslt;
mod device;
mod elementwise;
mod errors;
mod fp8;
mod fusion;
mod gemm;
mod gemv;
mod graph;
mod image;
mod launch;
mod memory;
mod norm;
pub mod nvrtc;
mod profile;
mod rows;
mod short_conv;
mod support;
mod tables;
mod tma;

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use tessera_core::{Result, Tensor, Weights};

use crate::{
    Activation, After, AttnSpec, AvgDown, Backend, CacheWrite, Conv2d, DupUp, Epilogue, Grids,
    GroupNorm, Op, Precision, QkvNorm, Residual, Role, RopeTable, RowNorm, Segments, ShortConv,
    ThenResidual, View, ViewMut,
};
pub use attention::{FlashChoice, FlashKernel};
pub use device::{check_libraries, open};
use gemm::Gemm;
use graph::Graphs;
pub use image::ConvPath;
pub use launch::{Param, Signature};
pub use memory::{CudaBuf, CudaMat, CudaTable, Elem, MatFormat};
use profile::Profiler;
use tables::Kernels;
pub use tables::kernel_tables;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    precision: Precision,
    kernels: Kernels,
    gemm: Gemm,
    graphs: Mutex<Graphs>,
    /// Split-key attention workspace (`attention::PART_ELEMS` f32), made on first use.
    flash_part: Mutex<Option<CudaBuf>>,
    /// Fixed workspaces of the ops that need one, made on first use ([`memory::Workspace`]).
    workspaces: Mutex<std::collections::HashMap<memory::Workspace, CudaBuf>>,
    /// Host staging for byte uploads (`write_u8_mapped`: its table and bytes), 4-byte words, reused.
    staging: Mutex<Vec<u32>>,
    profiler: Option<Profiler>,
    /// `--quantize fp8`: float matrices go up as FP8 codes with a scale per row.
    fp8_at_load: bool,
    /// `--quantize` to a GGUF block format: float matrices whose rows are whole blocks go up as
    /// blocks of it ([`blocks`]).
    blocks_at_load: Option<tessera_core::DType>,
    /// `--precision int8` asked for the CPU's int8 activations on block-format products, which
    /// this backend does not make: those products are declined ([`support`]).
    int8_products: bool,
    /// The FP8 products' cuBLASLt state, made with the first FP8 matrix.
    fp8: Mutex<Option<Arc<fp8::Fp8Gemm>>>,
    name: String,
    arch: String,
    sm_count: u32,
    /// Launch kernels with programmatic dependent launch (compute capability 9.0 and newer,
    /// unless `TESSERA_PDL=0`): see `launch_overlapped`.
    overlap_launches: bool,
    /// Kernels this backend has launched itself (not cuBLASLt's, not graph replays): what a
    /// fused op saves, checked by the tests ([`CudaBackend::kernel_launches`]).
    launches: std::sync::atomic::AtomicU64,
    /// The fused decode ops it takes (`TESSERA_FUSE`).
    fuse: fusion::Fusions,
}

/// The op a `qkv_norm_rope` call enters.
fn qkv_op(n: &QkvNorm<'_, CudaBackend>, rope: Option<(&RopeTable<CudaBackend>, &CudaBuf)>) -> Op {
    Op::QkvNormRope {
        head_dim: n.layout.head_dim,
        rope: rope.map(|r| r.0.style),
        qk_norm: n.qk_norm,
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Mat = CudaMat;
    type Vector = CudaBuf;
    type Table = CudaTable;

    fn describe(&self) -> String {
        self.describe_device()
    }

    fn supports(&self, op: &Op) -> Result<()> {
        self.check(op)
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc(&self, len: usize, role: Role) -> Result<CudaBuf> {
        self.alloc_buf(len, role)
    }

    fn alloc_scratch(&self, len: usize, role: Role) -> Result<CudaBuf> {
        self.alloc_with(len, role, false)
    }

    fn write_f32(&self, dst: &mut CudaBuf, src: &[f32]) -> Result<()> {
        self.write_f32_to(dst, src)
    }

    fn write_u8_mapped(&self, dst: &mut CudaBuf, parts: &[&[u8]], map: &[f32; 256]) -> Result<()> {
        self.write_u8_mapped_to(dst, parts, map)
    }

    fn write_u32(&self, dst: &mut CudaBuf, src: &[u32]) -> Result<()> {
        self.write_u32_to(dst, src)
    }

    fn read_f32(&self, src: View<'_, Self>) -> Result<Vec<f32>> {
        self.read_view(src)
    }

    fn read_u32(&self, src: &CudaBuf, len: usize) -> Result<Vec<u32>> {
        self.read_indices(src, len)
    }

    fn read_rgb8(&self, src: View<'_, Self>, stage: &str) -> Result<Vec<u8>> {
        self.read_rgb8_view(src, stage)
    }

    fn matrix(&self, parts: &[Tensor<'_>]) -> Result<CudaMat> {
        self.upload_matrix(parts, true)
    }

    fn matrix_unquantized(&self, parts: &[Tensor<'_>]) -> Result<CudaMat> {
        self.upload_matrix(parts, false)
    }

    fn vector(&self, t: &Tensor<'_>) -> Result<CudaBuf> {
        self.upload_vector(t)
    }

    fn table(&self, weights: &Weights, name: &str, shape: &[usize]) -> Result<CudaTable> {
        self.upload_table(weights, name, shape)
    }

    fn alloc_segments(&self, max_rows: usize, max_segs: usize) -> Result<Segments<Self>> {
        attention::alloc_segments(self, max_rows, max_segs)
    }

    fn set_segments(&self, segs: &mut Segments<Self>, lens: &[usize]) -> Result<()> {
        attention::set_segments(self, segs, lens)
    }

    fn run_graph(&self, key: u64, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.replay(key, work)
    }

    fn memory_available(&self) -> Result<Option<usize>> {
        self.available_memory().map(Some)
    }

    fn release_unused_memory(&self) -> Result<()> {
        self.trim_pool()
    }

    fn embed(
        &self,
        table: &CudaTable,
        ids: &CudaBuf,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::Embed)?;
        elementwise::embed(self, table, ids, scale, out)
    }

    fn cast(&self, x: View<'_, Self>, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(&Op::Cast)?;
        elementwise::cast(self, x, out)
    }

    fn matmul(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        out: ViewMut<'_, Self>,
        ep: &Epilogue<'_, Self>,
    ) -> Result<()> {
        self.enter(&ep.op())?;
        gemm::matmul(self, x, w, out, ep)
    }

    fn norm(&self, x: View<'_, Self>, n: &RowNorm<'_, Self>, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(&Op::Norm(n.shape()))?;
        norm::norm(self, x, n, out)
    }

    fn residual(
        &self,
        h: ViewMut<'_, Self>,
        y: View<'_, Self>,
        res: &Residual<'_, Self>,
        after: After<'_, Self>,
    ) -> Result<()> {
        self.enter(&res.op(&after))?;
        norm::residual(self, h, y, res, after)
    }

    fn qkv_norm_rope(
        &self,
        qkv: ViewMut<'_, Self>,
        n: &QkvNorm<'_, Self>,
        rope: Option<(&RopeTable<Self>, &CudaBuf)>,
    ) -> Result<()> {
        self.enter(&qkv_op(n, rope))?;
        norm::qkv_norm_rope(self, qkv, n, rope)
    }

    fn qkv_norm_rope_cached(
        &self,
        qkv: ViewMut<'_, Self>,
        n: &QkvNorm<'_, Self>,
        rope: Option<(&RopeTable<Self>, &CudaBuf)>,
        cache: CacheWrite<'_, Self>,
    ) -> Result<()> {
        self.enter(&qkv_op(n, rope))?;
        self.enter(&Op::ScatterRows)?;
        norm::qkv_norm_rope_cached(self, qkv, n, rope, cache)
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
        self.enter(&spec.op())?;
        attention::attention(self, q, k, v, out, spec, segs)
    }

    fn gated(
        &self,
        gate: View<'_, Self>,
        up: View<'_, Self>,
        out: ViewMut<'_, Self>,
        act: Activation,
    ) -> Result<()> {
        self.enter(&Op::Gated(act))?;
        elementwise::gated(self, gate, up, out, act)
    }

    fn matmul_gated(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        mut gu: ViewMut<'_, Self>,
        act: Activation,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        let bare = Epilogue::default();
        self.enter(&bare.op())?;
        self.enter(&Op::Gated(act))?;
        if self.fuse.gated && gemm::matmul_gated(self, x, w, &gu, act, &out)? {
            return Ok(());
        }
        gemm::matmul(self, x, w, gu.reborrow(), &bare)?;
        let (half, both) = (gu.cols / 2, gu.as_view());
        elementwise::gated(self, both.cols(0, half), both.cols(half, half), out, act)
    }

    fn matmul_residual(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        mut y: ViewMut<'_, Self>,
        ep: &Epilogue<'_, Self>,
        then: ThenResidual<'_, Self>,
    ) -> Result<()> {
        self.enter(&ep.op())?;
        self.enter(&then.res.op(&then.after))?;
        if self.fuse.residual && gemm::matmul_residual(self, x, w, &y, ep, &then)? {
            return Ok(());
        }
        gemm::matmul(self, x, w, y.reborrow(), ep)?;
        norm::residual(self, then.h, y.as_view(), &then.res, then.after)
    }

    fn segment_mean(
        &self,
        x: View<'_, Self>,
        segs: &Segments<Self>,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::SegmentMean)?;
        elementwise::segment_mean(self, x, segs, out)
    }

    fn add_positions_2d(
        &self,
        table: &CudaTable,
        axis_rows: usize,
        pos: &CudaBuf,
        x: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::AddPositions2d)?;
        rows::add_positions_2d(self, table, axis_rows, pos, x)
    }

    fn avg_pool2d(
        &self,
        x: View<'_, Self>,
        grids: &Grids<Self>,
        scale: f32,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::AvgPool2d)?;
        rows::avg_pool2d(self, x, grids, scale, out)
    }

    fn scatter_rows(
        &self,
        src: View<'_, Self>,
        rows: &CudaBuf,
        dst: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::ScatterRows)?;
        rows::scatter_rows(self, src, rows, dst)
    }

    fn argmax_rows(&self, x: View<'_, Self>, out: &mut CudaBuf) -> Result<()> {
        self.enter(&Op::ArgmaxRows)?;
        rows::argmax_rows(self, x, out)
    }

    fn conv2d(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        bias: &CudaBuf,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.conv2d_with(x, w, bias, spec, out, image::ConvPath::Auto)
    }

    fn dup_up(&self, x: View<'_, Self>, spec: &DupUp, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(&Op::DupUp)?;
        image::dup_up(self, x, spec, out)
    }

    fn avg_down(&self, x: View<'_, Self>, spec: &AvgDown, out: ViewMut<'_, Self>) -> Result<()> {
        self.enter(&Op::AvgDown)?;
        image::avg_down(self, x, spec, out)
    }

    fn group_norm(
        &self,
        x: View<'_, Self>,
        weight: &CudaBuf,
        bias: &CudaBuf,
        spec: &GroupNorm,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&Op::GroupNorm { act: spec.act })?;
        image::group_norm(self, x, weight, bias, spec, out)
    }

    fn short_conv(
        &self,
        bcx: View<'_, Self>,
        conv: &ShortConv<'_, Self>,
        segs: &Segments<Self>,
        state: &mut CudaBuf,
        out: ViewMut<'_, Self>,
    ) -> Result<()> {
        self.enter(&conv.op())?;
        short_conv::short_conv(self, bcx, conv, segs, state, out)
    }
}
