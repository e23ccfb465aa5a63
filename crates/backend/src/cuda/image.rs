//! The VAE decoders' image ops (kernels/image.cu, kernels/conv_sm90.cu) over channels-last images:
//! a convolution as an implicit GEMM on the tensor cores (bf16 with input channels a multiple of
//! 8: each CTA gathers its pixels' taps straight from the image, the input activation and the bias
//! fused; `conv_wgmma` on Hopper, `conv_implicit` on mma.sync elsewhere) or else as blocks of
//! im2col rows times the weight (cuBLASLt; the activation applied as the columns are gathered),
//! GroupNorm in three passes (partial sums per block of pixels, per-group statistics, the
//! normalisation with its activation, four channels a thread where rows allow), and the DupUp
//! channel-to-space shortcut and its encoder mirror AvgDown added into their outputs (one thread
//! an output element). The encoder's stride-2 convolution is either path with a stride.

use tessera_core::{Error, Result};

use super::gemm::{Post, Rows, act_code, epilogue, product};
use super::launch::{
    ByElem, ByPair, DevPtr, Kernel, TensorMap, cfg, kernel_args, kernel_table, vec4_aligned,
};
use super::memory::{Workspace, ptr_of, ptr_of_mut};
use super::tma;
use super::{CudaBackend, CudaBuf, CudaMat, Elem, MatFormat};
use crate::view::same_shape;
use crate::{AvgDown, Conv2d, DupUp, GroupNorm, View, ViewMut};

kernel_args! {
    /// `im2col[4]_{x}_{cols}`: the column rows of output pixels `p0 .. p0 + n`, grid-stride;
    /// `up` 2 upsamples, `down` 2 strides ([`Conv2d::downsample`]); `act` −1 none, else the input
    /// activation's code.
    pub(super) struct Im2colArgs {
        x: DevPtr, xs: i64, h: i32, w: i32, c: i32, k: i32, up: i32, down: i32, act: i32, p0: i64,
        n: i64, cols: DevPtr,
    }
}

kernel_args! {
    /// `conv_implicit[64]_{out}`: the convolution as an implicit GEMM, one CTA per 128 output
    /// pixels × 128 (64) output channels; `act` −1 none, else the input activation's code; `add`
    /// 1 adds to the output ([`Conv2d::accumulate`]).
    pub(super) struct ConvArgs {
        x: DevPtr, xs: i64, h: i32, w: i32, cin: i32, k: i32, up: i32, down: i32, act: i32,
        wt: DevPtr, cout: i32, bias: DevPtr, pixels: i64, out: DevPtr, os: i64, add: i32,
    }
}

kernel_args! {
    /// `conv_ws{BN}_{out}`: `conv_implicit`'s arguments (no input activation), then the weight's
    /// tensor map ([`tma::matrix_bf16`], boxes of `BN` rows), which its producer loads through.
    pub(super) struct ConvWsArgs {
        conv: ConvArgs, wmap: TensorMap,
    }
}

kernel_args! {
    /// `group_stats_{x}`: per-group f64 sums of one block of pixels per CUDA block.
    pub(super) struct GroupStatsArgs {
        x: DevPtr, xs: i64, pixels: i64, c: i32, groups: i32, bdx: i32, partial: DevPtr,
    }
}

kernel_args! {
    /// `group_finish`: per-group mean and inverse deviation, a warp per group.
    pub(super) struct GroupFinishArgs {
        partial: DevPtr, blocks: i32, groups: i32, count: i64, eps: f32, stats: DevPtr,
    }
}

kernel_args! {
    /// `group_apply_{x}_{out}`: the normalisation, affine and activation, grid-stride.
    pub(super) struct GroupApplyArgs {
        x: DevPtr, xs: i64, pixels: i64, c: i32, groups: i32, stats: DevPtr, w: DevPtr,
        b: DevPtr, act: i32, out: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `dup_up[_vec]_{x}_{out}`: `out += DupUp(x)`, one thread an output element (`_vec`: four
    /// consecutive channels of one, `n` counting those vectors), grid-stride.
    pub(super) struct DupUpArgs {
        x: DevPtr, xs: i64, w: i32, cout: i32, frames: i32, repeats: i32, n: i64, out: DevPtr,
        os: i64,
    }
}

kernel_args! {
    /// `avg_down_{x}_{out}`: `out += AvgDown(x)`, one thread an output element, grid-stride;
    /// `g` input channels (of the expanded `in · frames · space²`) average into each output one.
    pub(super) struct AvgDownArgs {
        x: DevPtr, xs: i64, w: i32, space: i32, frames: i32, cout: i32, g: i32, n: i64,
        out: DevPtr, os: i64,
    }
}

kernel_table! {
    /// The kernels of image.cu.
    pub(super) struct ImageKernels from "image.cu" {
        im2col: ByPair<Im2colArgs> = "im2col_{}_{}",
        /// Four channels a thread, for channel counts of 4·m and aligned rows.
        im2col4: ByPair<Im2colArgs> = "im2col4_{}_{}",
        /// Eight bf16 channels a thread (16-byte copies), for channel counts of 8·m.
        im2col8: Kernel<Im2colArgs> = "im2col8_bf16_bf16",
        /// The tensor-core implicit GEMM, 128 output channels a CTA, by output type.
        conv_implicit: ByElem<ConvArgs> = "conv_implicit_{}",
        /// The same, 64 output channels a CTA (for at most 64 output channels).
        conv_implicit64: ByElem<ConvArgs> = "conv_implicit64_{}",
        group_stats: ByElem<GroupStatsArgs> = "group_stats_{}",
        group_finish: Kernel<GroupFinishArgs> = "group_finish",
        group_apply: ByPair<GroupApplyArgs> = "group_apply_{}_{}",
        /// Four channels of one group a thread (aligned rows, 4 | channels per group).
        group_apply4: ByPair<GroupApplyArgs> = "group_apply4_{}_{}",
        dup_up: ByPair<DupUpArgs> = "dup_up_{}_{}",
        dup_up_vec: ByPair<DupUpArgs> = "dup_up_vec_{}_{}",
        avg_down: ByPair<AvgDownArgs> = "avg_down_{}_{}",
    }
}

kernel_table! {
    /// The kernels of conv_sm90.cu (sm_90a alone): the implicit GEMM on wgmma, by output type, for
    /// tiles of 128, 144, 256 and 64 output channels ([`wgmma_tile`]).
    pub(super) struct Sm90ConvKernels from "conv_sm90.cu" {
        conv_wgmma: ByElem<ConvArgs> = "conv_wgmma_{}",
        conv_wgmma144: ByElem<ConvArgs> = "conv_wgmma144_{}",
        conv_wgmma256: ByElem<ConvArgs> = "conv_wgmma256_{}",
        conv_wgmma64: ByElem<ConvArgs> = "conv_wgmma64_{}",
        conv_ws128: ByElem<ConvWsArgs> = "conv_ws128_{}",
        conv_ws144: ByElem<ConvWsArgs> = "conv_ws144_{}",
        conv_ws256: ByElem<ConvWsArgs> = "conv_ws256_{}",
    }
}

/// Dynamic shared memory of `conv_wgmma{BN}` (`CwCfg::SMEM` in conv_sm90.cu): its stages (three
/// for 128- and 144-channel tiles, else four) of a 128-pixel tile and a `BN`-channel weight
/// tile, 128 bytes a row, and 1 KB to align them.
const fn conv_wgmma_smem(bn: usize) -> usize {
    let stages = if bn == 128 || bn == 144 { 3 } else { 4 };
    stages * (128 * 128 + bn * 128) + 1024
}

/// One shape of `conv_ws` (`WsConvCfg` in conv_sm90.cu): `bn` output channels × 64·`mt` pixels
/// per consumer warpgroup, gathered by `pwg` producer warpgroups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WsShape {
    bn: usize,
    mt: usize,
    pwg: usize,
}

impl WsShape {
    /// The pixels of one CTA's tile.
    const fn pixels(self) -> usize {
        128 * self.mt
    }

    const fn threads(self) -> usize {
        128 * (self.pwg + 2)
    }

    /// Dynamic shared memory (`WsConvCfg::SMEM`): as many stages of a pixel tile and a weight
    /// tile (128 bytes a row) as 227 KB hold, at most eight, their two mbarriers each, and 1 KB
    /// to align them.
    const fn smem(self) -> usize {
        let stage = (self.pixels() + self.bn) * 128;
        let fit = (232448 - 1024 - 128) / stage;
        let stages = if fit > 8 { 8 } else { fit };
        stages * stage + 16 * stages + 1024
    }
}

/// The tile widths `conv_ws` is built for (more than 64 output channels: [`wgmma_tile`]'s others).
const WS_TILES: [usize; 3] = [256, 144, 128];

/// The `conv_ws` kernels of `bn`-channel tiles (launched in [`ws_shape`]).
fn ws_kernel(t: &Sm90ConvKernels, bn: usize) -> &ByElem<ConvWsArgs> {
    match bn {
        256 => &t.conv_ws256,
        144 => &t.conv_ws144,
        _ => &t.conv_ws128,
    }
}

/// The shape of `conv_ws` for `bn`-channel tiles: 256-channel tiles take 128 pixels a CTA and one
/// producer warpgroup; 128- and 144-channel tiles 256 pixels, gathered by two (run g17: one
/// producer warpgroup, or 128 pixels, ran them 10–30% slower).
const fn ws_shape(bn: usize) -> WsShape {
    match bn {
        256 => WsShape { bn, mt: 1, pwg: 1 },
        _ => WsShape { bn, mt: 2, pwg: 2 },
    }
}

/// The output-channel tile of `conv_wgmma` for `cout` channels: 64 up to 64, else whichever of
/// 128, 144 and 256 pads `cout` the least (the wider on a tie: fewer pixel gathers per product).
/// 144 is Qwen-Image-2.1's decoder at full resolution, which 256-wide tiles ran 44% empty.
fn wgmma_tile(cout: usize) -> usize {
    if cout <= 64 {
        return 64;
    }
    [256, 144, 128]
        .into_iter()
        .min_by_key(|&bn| cout.next_multiple_of(bn))
        .unwrap_or(128)
}

/// Let the wgmma convolutions use the shared memory their stages take (more than the 48 KB a
/// launch gets without asking).
pub(super) fn reserve_shared_memory(hopper: Option<&Sm90ConvKernels>) -> Result<()> {
    let Some(t) = hopper else { return Ok(()) };
    let tiles = [
        (&t.conv_wgmma, 128),
        (&t.conv_wgmma144, 144),
        (&t.conv_wgmma256, 256),
        (&t.conv_wgmma64, 64),
    ];
    let kernels = tiles
        .into_iter()
        .flat_map(|(by, bn)| by.all().map(move |k| (k, conv_wgmma_smem(bn))));
    for (k, smem) in kernels {
        k.allow_shared_memory(smem)?;
    }
    for bn in WS_TILES {
        for k in ws_kernel(t, bn).all() {
            k.allow_shared_memory(ws_shape(bn).smem())?;
        }
    }
    Ok(())
}

/// Which convolution kernel runs (tests and `tessera bench conv` force one; the op picks by
/// [`ConvPath::Auto`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvPath {
    /// As [`ConvRoute::from_env`] says: on Hopper the wgmma implicit GEMM where it applies and
    /// is the faster ([`wgmma_pays`]); elsewhere the mma.sync one where it is the faster
    /// ([`IMPLICIT_MAX_COUT`]); else im2col.
    #[default]
    Auto,
    /// The wgmma implicit GEMM (`conv_wgmma`, Hopper); an error where it does not apply.
    Wgmma,
    /// The warp-specialized wgmma implicit GEMM (`conv_ws`, Hopper: weight tiles by the
    /// tensor-memory accelerator, more than 64 output channels, no input activation); an error
    /// where it does not apply.
    Ws,
    /// The mma.sync implicit GEMM (`conv_implicit`); an error where it does not apply.
    Implicit,
    /// Blocks of im2col columns times the weight on cuBLASLt (any type, any shape).
    Im2col,
}

impl ConvPath {
    /// Whether [`ConvPath::Ws`] takes a convolution of this spec into `cout` channels (besides
    /// the implicit GEMMs' conditions on types and alignment): no input activation, since its
    /// producer only copies, and more than 64 output channels, since its tiles are 128, 144 or
    /// 256 wide. The op table and `tessera bench conv` ask it before forcing the kernel.
    pub fn ws_takes(spec: &Conv2d, cout: usize) -> bool {
        spec.act.is_none() && cout > 64
    }
}

/// The most output channels [`ConvPath::Auto`] sends to the mma.sync implicit GEMM. Measured on
/// an H100 (run g6, `tessera bench conv`): the kernel runs at 100–180 TFLOP/s on every decoder
/// shape, where im2col + cuBLASLt reaches 350–500 once the product is wide (e.g. 1152 → 1152 at
/// 256²: 11.6 ms against 3.2) but wastes its tiles on narrow outputs and pays for its columns at
/// 1024² (128 → 128: 1.9 ms against 2.8; the 3- and 4-channel `conv_out`: 1.2 and 2.1 ms against
/// 3.5 and 3.4). At 144 and 256 outputs im2col already wins, so up to 128 it is.
const IMPLICIT_MAX_COUT: usize = 128;

/// Whether [`ConvPath::Auto`] sends a convolution to `conv_wgmma` rather than im2col. Measured
/// on an H100 (`tessera bench conv`, run g15, gathers by shift): the kernel (330–430 TFLOP/s)
/// beats im2col + cuBLASLt wherever the output has at most 576 channels (Qwen-Image-2.1's 144-,
/// 288- and 576-channel layers: 144 → 144 at 1024² 1.17 against 3.20 ms, 576 → 288 at 512² 1.87
/// against 3.12, 576 → 576 at 256² 0.95 against 1.02, 1152 → 576 1.81 against 1.94), but not on
/// 1152-wide products, where cuBLASLt's columns run at 510–530 (1152 → 1152 at 256²: 3.62 against
/// 3.04 ms). An input activation costs it a SiLU per gathered value, nine times each input
/// (run g10: 4.5 against 3.6 ms at 144 → 144), so activated inputs take it only into at most 64
/// channels (`conv_out`: 0.6–0.7 against 3.0–3.5 ms). What `conv_ws` runs faster goes to it first
/// ([`ws_pays`]).
fn wgmma_pays(cout: usize, spec: &Conv2d) -> bool {
    cout <= 576 && (spec.act.is_none() || cout <= 64)
}

/// Whether [`ConvPath::Auto`] sends a convolution `conv_ws` takes ([`ConvPath::ws_takes`]) from
/// `cin` into `cout` channels to it. Measured on an H100 (`bench conv`, run g17, both `conv_ws`
/// shapes [`ws_shape`]): on 256-channel tiles ([`wgmma_tile`]) 460–550 TFLOP/s against 350–390
/// for `conv_wgmma` and 210–370 for im2col (Z-Image's 256- and 512-channel layers: 512 → 512 at
/// 512² upsampled 2.35 against 3.23 and 3.25 ms, 512 → 256 at 512² 1.14 against 1.59 and 2.62);
/// on 144-channel tiles with a long reduction, 576 or more input channels into at most 576, 440–490
/// against 415–430 (Qwen-Image-2.1: 1152 → 576 at 256² 1.61 against 1.81 and 1.92 ms, 576 → 576
/// 0.89 against 0.94, 576 → 288 at 512² 1.75 against 1.87). Level with `conv_wgmma` from 256 or
/// 288 channels (288 → 144 at 1024²: 1.98 against 1.99; 256 → 128: 1.59 against 1.62), slower
/// from 128 or 144 (144 → 144: 1.28 against 1.18), and into 1,152 channels behind im2col
/// (1152 → 1152 at 256²: 3.20 against 2.97).
fn ws_pays(cin: usize, cout: usize) -> bool {
    wgmma_tile(cout) == 256 || (cin >= 512 && cout <= 576)
}

/// The kernels [`ConvPath::Auto`] may take, from `TESSERA_CONV` (read once): unset or `auto` all
/// of them, `ws` the warp-specialized one wherever it applies (else as `auto`), `mma` not the
/// wgmma ones, `im2col` only im2col — for A/B measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConvRoute {
    Auto,
    Ws,
    Mma,
    Im2col,
}

impl ConvRoute {
    fn from_env() -> ConvRoute {
        static ROUTE: std::sync::OnceLock<ConvRoute> = std::sync::OnceLock::new();
        *ROUTE.get_or_init(|| match std::env::var("TESSERA_CONV").as_deref() {
            Ok("im2col") => ConvRoute::Im2col,
            Ok("mma") => ConvRoute::Mma,
            Ok("ws") => ConvRoute::Ws,
            _ => ConvRoute::Auto,
        })
    }
}

impl CudaBackend {
    /// Which kernels run this backend's convolutions (`tessera info` says it).
    pub fn conv_route(&self) -> String {
        let hopper = self.kernels.conv_sm90.is_some();
        match (self.compute_elem(), ConvRoute::from_env()) {
            (Elem::Bf16, ConvRoute::Auto) if hopper => {
                "from a multiple of 8 input channels, the warp-specialized wgmma implicit GEMM \
                 (conv_ws) into 256-channel tiles, and from 512 or more channels into at most \
                 576, of an input without activation, the wgmma one (conv_wgmma) into other \
                 tiles up to 576 output channels (64 from an activated input), else im2col \
                 columns on cuBLASLt"
                    .to_string()
            }
            (Elem::Bf16, ConvRoute::Ws) if hopper => {
                "the warp-specialized wgmma implicit GEMM (conv_ws) into more than 64 output \
                 channels from an input without activation (TESSERA_CONV=ws), else as by default"
                    .to_string()
            }
            (Elem::Bf16, ConvRoute::Auto | ConvRoute::Ws | ConvRoute::Mma) => format!(
                "the mma.sync implicit GEMM (conv_implicit) for at most {IMPLICIT_MAX_COUT} \
                 output channels from a multiple of 8 input channels, else im2col columns on \
                 cuBLASLt{}",
                if hopper { " (TESSERA_CONV=mma)" } else { "" }
            ),
            (Elem::Bf16, ConvRoute::Im2col) => {
                "im2col columns on cuBLASLt (TESSERA_CONV=im2col)".to_string()
            }
            _ => "im2col columns on cuBLASLt (f32: the exact path)".to_string(),
        }
    }
}

/// Whether the implicit GEMMs (`conv_implicit`, `conv_wgmma`) take this convolution: bf16
/// compute, a bf16 image and dense bf16 weight, an f32 or bf16 output, input channels a multiple
/// of 8 (16-byte copies), the image, its row stride and the weight 16-byte aligned, and every
/// size an `int`.
fn implicit_applies(
    be: &CudaBackend,
    x: &View<'_, CudaBackend>,
    xp: DevPtr,
    w: &CudaMat,
    out: Elem,
) -> bool {
    let fits = |v: usize| i32::try_from(v).is_ok();
    be.compute_elem() == Elem::Bf16
        && matches!(w.format, MatFormat::Dense(Elem::Bf16))
        && x.buf.elem == Elem::Bf16
        && matches!(out, Elem::F32 | Elem::Bf16)
        && x.cols.is_multiple_of(8)
        && x.stride.is_multiple_of(8)
        && xp.0.is_multiple_of(16)
        && w.buf.ptr.0.is_multiple_of(16)
        && fits(w.inner)
        && fits(w.out)
        && fits(x.rows)
}

pub(super) fn conv2d(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    w: &CudaMat,
    bias: &CudaBuf,
    spec: &Conv2d,
    out: ViewMut<'_, CudaBackend>,
    path: ConvPath,
) -> Result<()> {
    let (cin, cout, k) = (x.cols, out.cols, spec.kernel);
    let (oh, ow) = spec.out_size();
    let kk = k * k * cin;
    spec.check(
        (x.rows, x.cols),
        (w.out, w.inner),
        bias.len,
        (out.rows, out.cols),
    )?;
    let pixels = oh * ow;
    if pixels == 0 || cout == 0 {
        return Ok(());
    }
    // FP8 weights take columns in the compute type (bf16), rounded to e4m3 by their product;
    // block-format weights too, decoded by theirs.
    let ab = match w.format {
        MatFormat::Dense(ab) => ab,
        MatFormat::Fp8(_) | MatFormat::Block(_) => be.compute_elem(),
    };
    let to = Rows::of_mut(&out)?;
    let post = Post::bias(bias.ptr);
    // The products through cuBLASLt add to the output with β = 1 (`accumulate`), the bias after:
    // (out + conv) + bias, where the implicit GEMMs sum out + (conv + bias).
    let beta = if spec.accumulate { 1.0 } else { 0.0 };
    let xr = Rows::of(&x)?;
    let xp = xr.ptr;
    let implicit = implicit_applies(be, &x, xp, w, to.elem);
    let hopper = be.kernels.conv_sm90.as_ref();
    let declined = |why: &str| {
        Err(Error::backend(
            "conv2d",
            format!(
                "the implicit GEMM does not take {cin} {:?} input channels into {:?} under {} \
                 precision{why}",
                x.buf.elem, to.elem, be.precision
            ),
        ))
    };
    let gemm = ImplicitGemm {
        x: &x,
        xp,
        w,
        bias,
        spec,
        to,
        pixels,
    };
    match path {
        ConvPath::Implicit | ConvPath::Wgmma | ConvPath::Ws if !implicit => {
            return declined(" (or unaligned rows)");
        }
        ConvPath::Implicit => return gemm.on_mma(be),
        ConvPath::Wgmma | ConvPath::Ws => {
            let Some(t) = hopper else {
                return declined(" on a GPU without wgmma");
            };
            if path == ConvPath::Wgmma {
                return gemm.on_wgmma(be, t);
            }
            if !gemm.ws_applies() {
                return declined(
                    " (the warp-specialized kernel takes more than 64 output channels of an \
                     input without activation)",
                );
            }
            return gemm.on_ws(be, t);
        }
        ConvPath::Im2col => {}
        ConvPath::Auto => {
            // A 1×1 convolution of an image already in the weight's type is the product itself.
            if k == 1
                && !spec.upsample
                && !spec.downsample
                && spec.act.is_none()
                && x.buf.elem == ab
            {
                product(be, xr, 0, pixels, w, to, 1.0, beta)?;
                return epilogue(be, &post, to, to, 0, pixels, cout, false);
            }
            match (implicit, ConvRoute::from_env(), hopper) {
                (true, ConvRoute::Ws, Some(t)) if gemm.ws_applies() => return gemm.on_ws(be, t),
                (true, ConvRoute::Auto, Some(t)) if gemm.ws_applies() && ws_pays(cin, cout) => {
                    return gemm.on_ws(be, t);
                }
                (true, ConvRoute::Auto | ConvRoute::Ws, Some(t))
                    if gemm.wgmma_fits() && wgmma_pays(cout, spec) =>
                {
                    return gemm.on_wgmma(be, t);
                }
                (true, ConvRoute::Auto | ConvRoute::Mma, _) if cout <= IMPLICIT_MAX_COUT => {
                    return gemm.on_mma(be);
                }
                _ => {}
            }
        }
    }
    if ab != be.compute_elem() {
        return Err(Error::backend(
            "conv2d",
            format!("a {ab:?} weight under {} precision", be.precision),
        ));
    }
    let (ws, capacity) = be.workspace(Workspace::Columns)?;
    let block = (capacity / kk).clamp(1, pixels);
    let size = x.buf.elem.size();
    let aligned = |v: usize| {
        cin.is_multiple_of(v)
            && xp.0.is_multiple_of((v * size) as u64)
            && (x.stride * size).is_multiple_of(v * size)
    };
    let table = &be.kernels.image;
    let (kernel, per_thread) = if x.buf.elem == Elem::Bf16 && ab == Elem::Bf16 && aligned(8) {
        (&table.im2col8, 8)
    } else if aligned(4) {
        (table.im2col4.get(x.buf.elem, ab)?, 4)
    } else {
        (table.im2col.get(x.buf.elem, ab)?, 1)
    };
    let columns = Rows {
        ptr: ws,
        stride: kk,
        elem: ab,
    };
    for p0 in (0..pixels).step_by(block) {
        let n = block.min(pixels - p0);
        let args = Im2colArgs {
            x: xp,
            xs: x.stride as i64,
            h: spec.height as i32,
            w: spec.width as i32,
            c: cin as i32,
            k: k as i32,
            up: if spec.upsample { 2 } else { 1 },
            down: if spec.downsample { 2 } else { 1 },
            act: spec.act.map_or(-1, act_code),
            p0: p0 as i64,
            n: n as i64,
            cols: ws,
        };
        be.launch("conv", kernel, be.grid_stride(n * kk / per_thread), &args)?;
        let into = Rows {
            ptr: to.at(p0),
            ..to
        };
        product(be, columns, 0, n, w, into, 1.0, beta)?;
    }
    epilogue(be, &post, to, to, 0, pixels, cout, false)
}

/// One convolution for the implicit GEMMs, checked by [`implicit_applies`].
struct ImplicitGemm<'a> {
    x: &'a View<'a, CudaBackend>,
    xp: DevPtr,
    w: &'a CudaMat,
    bias: &'a CudaBuf,
    spec: &'a Conv2d,
    to: Rows,
    pixels: usize,
}

impl ImplicitGemm<'_> {
    fn args(&self) -> ConvArgs {
        let spec = self.spec;
        ConvArgs {
            x: self.xp,
            xs: self.x.stride as i64,
            h: spec.height as i32,
            w: spec.width as i32,
            cin: self.x.cols as i32,
            k: spec.kernel as i32,
            up: if spec.upsample { 2 } else { 1 },
            down: if spec.downsample { 2 } else { 1 },
            act: spec.act.map_or(-1, act_code),
            wt: self.w.buf.ptr,
            cout: self.w.out as i32,
            bias: self.bias.ptr,
            pixels: self.pixels as i64,
            out: self.to.ptr,
            os: self.to.stride as i64,
            add: spec.accumulate as i32,
        }
    }

    /// On `conv_implicit` (kernels/image.cu): one CTA per 128 output pixels × 128 output
    /// channels (64 where there are at most 64), the bias added in its epilogue.
    fn on_mma(&self, be: &CudaBackend) -> Result<()> {
        let (cout, table) = (self.w.out, &be.kernels.image);
        let (kernel, bn) = if cout <= 64 {
            (table.conv_implicit64.get(self.to.elem)?, 64)
        } else {
            (table.conv_implicit.get(self.to.elem)?, 128)
        };
        let grid = (
            u32::try_from(self.pixels.div_ceil(128))
                .map_err(|_| Error::backend("conv2d", "too many output pixels"))?,
            cout.div_ceil(bn) as u32,
        );
        be.launch("conv", kernel, cfg(grid, 256, 0), &self.args())
    }

    /// Whether `conv_wgmma` takes the image's sides: each below 2^15 once upsampled (the
    /// kernel packs a pixel's two coordinates into one register).
    fn wgmma_fits(&self) -> bool {
        let up = if self.spec.upsample { 2 } else { 1 };
        self.spec.height * up < 1 << 15 && self.spec.width * up < 1 << 15
    }

    /// On `conv_wgmma` (kernels/conv_sm90.cu): one CTA per 128 output pixels × [`wgmma_tile`]
    /// output channels, numbered channel tile fastest.
    fn on_wgmma(&self, be: &CudaBackend, table: &Sm90ConvKernels) -> Result<()> {
        if !self.wgmma_fits() {
            return Err(Error::backend(
                "conv2d",
                "the wgmma convolution takes image sides below 32768",
            ));
        }
        let cout = self.w.out;
        let bn = wgmma_tile(cout);
        let kernel = match bn {
            64 => &table.conv_wgmma64,
            144 => &table.conv_wgmma144,
            256 => &table.conv_wgmma256,
            _ => &table.conv_wgmma,
        }
        .get(self.to.elem)?;
        let ctas = u32::try_from(self.pixels.div_ceil(128) * cout.div_ceil(bn))
            .ok()
            .filter(|&n| n < i32::MAX as u32)
            .ok_or_else(|| Error::backend("conv2d", "too many output tiles"))?;
        let smem = conv_wgmma_smem(bn) as u32;
        be.launch("conv", kernel, cfg((ctas, 1), 256, smem), &self.args())
    }

    /// Whether `conv_ws` takes this convolution: besides `conv_wgmma`'s conditions, no input
    /// activation (its producer only copies) and more than 64 output channels (its tiles are
    /// 128, 144 or 256 wide).
    fn ws_applies(&self) -> bool {
        self.wgmma_fits() && ConvPath::ws_takes(self.spec, self.w.out)
    }

    /// On `conv_ws` (kernels/conv_sm90.cu): one CTA per 256 output pixels × 128 or 144 output
    /// channels (four warpgroups), or 128 pixels × 256 (three) ([`wgmma_tile`], [`ws_shape`]),
    /// numbered channel tile fastest; the weight read through a tensor map.
    fn on_ws(&self, be: &CudaBackend, table: &Sm90ConvKernels) -> Result<()> {
        let cout = self.w.out;
        let bn = wgmma_tile(cout);
        let shape = ws_shape(bn);
        let kernel = ws_kernel(table, bn).get(self.to.elem)?;
        let ctas = u32::try_from(self.pixels.div_ceil(shape.pixels()) * cout.div_ceil(shape.bn))
            .ok()
            .filter(|&n| n < i32::MAX as u32)
            .ok_or_else(|| Error::backend("conv2d", "too many output tiles"))?;
        let wmap = tma::matrix_bf16(self.w.buf.ptr, cout, self.w.inner, shape.bn as u32)?;
        let args = ConvWsArgs {
            conv: self.args(),
            wmap,
        };
        let (threads, smem) = (shape.threads() as u32, shape.smem() as u32);
        be.launch("conv", kernel, cfg((ctas, 1), threads, smem), &args)
    }
}

impl CudaBackend {
    /// Whether this GPU has the kernels of a forced convolution path (the wgmma one needs
    /// Hopper; every path needs bf16 precision but im2col).
    pub fn conv_path_available(&self, path: ConvPath) -> Result<()> {
        let why = match path {
            ConvPath::Auto | ConvPath::Im2col => return Ok(()),
            _ if self.compute_elem() != Elem::Bf16 => "the implicit GEMMs run under bf16 only",
            ConvPath::Wgmma | ConvPath::Ws if self.kernels.conv_sm90.is_none() => {
                "the wgmma convolutions need a Hopper GPU (sm_90a)"
            }
            _ => return Ok(()),
        };
        Err(Error::Device(why.to_string()))
    }

    /// The convolution op on a forced kernel path, for tests and `tessera bench conv`
    /// ([`ConvPath::Implicit`] fails where that kernel does not apply).
    pub fn conv2d_with(
        &self,
        x: View<'_, Self>,
        w: &CudaMat,
        bias: &CudaBuf,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
        path: ConvPath,
    ) -> Result<()> {
        self.enter(&spec.op())?;
        conv2d(self, x, w, bias, spec, out, path)
    }
}

pub(super) fn group_norm(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    weight: &CudaBuf,
    bias: &CudaBuf,
    spec: &GroupNorm,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    same_shape("group_norm", (x.rows, x.cols), (out.rows, out.cols))?;
    let (c, groups, pixels) = (x.cols, spec.groups, x.rows);
    if groups == 0 || c % groups != 0 || weight.len != c || bias.len != c {
        return Err(Error::backend(
            "group_norm",
            format!(
                "{c} channels in {groups} groups with weight {} and bias {}",
                weight.len, bias.len
            ),
        ));
    }
    if pixels == 0 {
        return Ok(());
    }
    // The workspace (f32 words) holds `blocks × groups` f64 pairs, then `groups` f32 pairs.
    let (ws, capacity) = be.workspace(Workspace::Stats)?;
    let per_block = 4 * groups;
    let max_blocks = capacity.saturating_sub(2 * groups) / per_block;
    // Shared memory of the statistics kernel: one f64 pair per group.
    if max_blocks == 0 || groups * 16 > 48 << 10 {
        return Err(Error::backend(
            "group_norm",
            format!("{groups} groups (the kernels take at most 3072)"),
        ));
    }
    let blocks = pixels
        .div_ceil(64)
        .min(be.sm_count as usize * 4)
        .min(max_blocks)
        .max(1);
    let stats = DevPtr(ws.0 + (blocks * per_block * 4) as u64);
    let xp = ptr_of(&x)?;
    let k = &be.kernels.image;
    let bdx = c.min(256).next_multiple_of(32);
    be.launch(
        "norm",
        k.group_stats.get(x.buf.elem)?,
        cfg((blocks as u32, 1), 256, (groups * 16) as u32),
        &GroupStatsArgs {
            x: xp,
            xs: x.stride as i64,
            pixels: pixels as i64,
            c: c as i32,
            groups: groups as i32,
            bdx: bdx as i32,
            partial: ws,
        },
    )?;
    be.launch(
        "norm",
        &k.group_finish,
        cfg((groups.div_ceil(8) as u32, 1), 256, 0), // a warp per group
        &GroupFinishArgs {
            partial: ws,
            blocks: blocks as i32,
            groups: groups as i32,
            count: (pixels * (c / groups)) as i64,
            eps: spec.eps,
            stats,
        },
    )?;
    let op = ptr_of_mut(&out)?;
    // Four channels a thread where they share a group, every row is aligned to them and the
    // quads fit a 32-bit index.
    let quads = (c / groups).is_multiple_of(4)
        && [x.stride, out.stride].iter().all(|s| s.is_multiple_of(4))
        && xp.0.is_multiple_of(4 * x.buf.elem.size() as u64)
        && op.0.is_multiple_of(4 * out.buf.elem.size() as u64)
        && u32::try_from(pixels * c / 4).is_ok();
    let (apply, per_thread) = if quads {
        (&k.group_apply4, 4)
    } else {
        (&k.group_apply, 1)
    };
    be.launch(
        "norm",
        apply.get(x.buf.elem, out.buf.elem)?,
        be.grid_stride(pixels * c / per_thread),
        &GroupApplyArgs {
            x: xp,
            xs: x.stride as i64,
            pixels: pixels as i64,
            c: c as i32,
            groups: groups as i32,
            stats,
            w: weight.ptr,
            b: bias.ptr,
            act: spec.act.map_or(-1, act_code),
            out: op,
            os: out.stride as i64,
        },
    )
}

pub(super) fn dup_up(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    spec: &DupUp,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    let repeats = spec.check((x.rows, x.cols), (out.rows, out.cols))?;
    let n = out.rows * out.cols;
    if n == 0 {
        return Ok(());
    }
    let out_ptr = ptr_of_mut(&out)?;
    // Four channels a thread where 4-vectors tile the output's aligned rows.
    let vec = out.cols.is_multiple_of(4)
        && vec4_aligned(&[(out_ptr, out.stride, out.buf.elem.size())], &[]);
    let (table, items) = if vec {
        (&be.kernels.image.dup_up_vec, n / 4)
    } else {
        (&be.kernels.image.dup_up, n)
    };
    let args = DupUpArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        w: spec.width as i32,
        cout: out.cols as i32,
        frames: spec.frames as i32,
        repeats: repeats as i32,
        n: items as i64,
        out: out_ptr,
        os: out.stride as i64,
    };
    let kernel = table.get(x.buf.elem, out.buf.elem)?;
    be.launch("conv", kernel, be.grid_stride(items), &args)
}

pub(super) fn avg_down(
    be: &CudaBackend,
    x: View<'_, CudaBackend>,
    spec: &AvgDown,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    let g = spec.check((x.rows, x.cols), (out.rows, out.cols))?;
    let n = out.rows * out.cols;
    if n == 0 {
        return Ok(());
    }
    let kernel = be.kernels.image.avg_down.get(x.buf.elem, out.buf.elem)?;
    let args = AvgDownArgs {
        x: ptr_of(&x)?,
        xs: x.stride as i64,
        w: spec.width as i32,
        space: spec.space as i32,
        frames: spec.frames as i32,
        cout: out.cols as i32,
        g: g as i32,
        n: n as i64,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
    };
    be.launch("conv", kernel, be.grid_stride(n), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile pads the output channels the least: the decoders' 3, 128, 144, 256, 288, 512,
    /// 576 and 1152.
    #[test]
    fn wgmma_tiles_pad_the_output_channels_least() {
        let cases = [
            (3, 64),
            (64, 64),
            (65, 128),
            (128, 128),
            (136, 144),
            (144, 144),
            (192, 256),
            (256, 256),
            (288, 144),
            (384, 128),
            (512, 256),
            (576, 144),
            (768, 256),
            (1152, 144),
        ];
        for (cout, tile) in cases {
            assert_eq!(wgmma_tile(cout), tile, "{cout} output channels");
        }
    }

    #[test]
    fn wgmma_shared_memory_fits_its_multiprocessor_share() {
        // 227 KB a multiprocessor on Hopper; 64-, 128- and 144-channel tiles run two CTAs on one.
        assert!(2 * conv_wgmma_smem(64) <= 227 << 10);
        assert!(2 * conv_wgmma_smem(128) <= 227 << 10);
        assert!(2 * conv_wgmma_smem(144) <= 227 << 10);
        assert!(conv_wgmma_smem(256) <= 227 << 10);
        let shapes = [
            (256, 1, 1),
            (144, 2, 1),
            (128, 2, 1),
            (144, 1, 1),
            (128, 1, 1),
        ];
        for (bn, mt, pwg) in shapes.into_iter().chain([(144, 2, 2), (128, 2, 2)]) {
            let shape = WsShape { bn, mt, pwg };
            assert!(shape.smem() <= 227 << 10, "{shape:?}");
            // At least four stages: the producer stays three steps ahead.
            assert!(shape.smem() >= 4 * (shape.pixels() + bn) * 128, "{shape:?}");
        }
    }
}
