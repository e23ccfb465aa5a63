//! Products on weights kept in ggml's block formats (Q8_0, Q4_0, Q4_K, Q6_K) or in FP8 e4m3fn
//! with a scale per row: the matrix holds its blocks (codes) as stored — no `f32` copy of the
//! model — and each product decodes them a panel of rows at a time.
//!
//! The exact mode decodes a panel of [`PANEL`] weight rows to `f32` (bit-exactly as the GGUF
//! decoders, `tessera_core::gguf`; FP8 as torch's `float8_e4m3fn → float32`, times the row's
//! scale in `f32`) and multiplies it with the `f32` activations as the dense `f32` path does, so
//! its result is the `f32` product on the dequantized weights.

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;
use tessera_core::dtype::widen_into;
use tessera_core::{DType, Error, Result, Tensor};

use super::panels::Out;

/// Weight rows decoded per task: 64 rows of a 4096-wide matrix are 1 MiB of `f32`, which stays
/// in L2 while the activation rows pass.
const PANEL: usize = 64;

/// A weight matrix `[out, inner]` in one block format, rows back to back.
pub struct QuantMat {
    dtype: DType,
    blocks: Vec<u8>,
    /// FP8: each row's scale (a file's, per tensor repeated over its rows or per row, or
    /// `--quantize fp8`'s own per row); empty for the ggml formats, whose scales are in-block.
    scales: Vec<f32>,
    /// Bytes per row: `inner / block size` blocks.
    row_bytes: usize,
    /// Products take int8 activations (`int8.rs`) rather than decoding the weights to f32.
    int8: bool,
    /// FP8 only: products first round their activations as CUDA's FP8 products do
    /// ([`round_e4m3`]), for the floor reference of the CUDA tests.
    e4m3: bool,
}

impl QuantMat {
    /// Stack `parts` (2-D tensors in block format `dtype`, each row a whole number of blocks)
    /// along their rows, copying their blocks as they are. Returns the matrix and its
    /// `(out, inner)`; a part in another format or of another width is an error naming it.
    pub fn stack(parts: &[Tensor<'_>]) -> Result<(QuantMat, usize, usize)> {
        let dtype = parts.first().map_or(DType::Q8_0, |t| t.dtype);
        let (out, inner) = crate::stacked_shape(parts)?;
        let mut blocks = Vec::new();
        let mut scales = Vec::new();
        for t in parts {
            if t.dtype != dtype {
                return Err(Error::backend(
                    "matrix",
                    format!(
                        "`{}` is {}, the matrices stacked with it {dtype}: stacked parts share \
                         one format",
                        t.name, t.dtype
                    ),
                ));
            }
            let (rows, _) = t.dims2_blocks()?;
            blocks.extend_from_slice(&t.bytes);
            if dtype == DType::F8_E4M3 {
                scales.extend((0..rows).map(|r| t.scale.as_ref().map_or(1.0, |s| s.row(r))));
            }
        }
        let row_bytes = dtype
            .bytes_for(inner)
            .ok_or_else(|| Error::backend("matrix", "block size overflow"))?;
        Ok((
            QuantMat {
                dtype,
                blocks,
                scales,
                row_bytes,
                int8: false,
                e4m3: false,
            },
            out,
            inner,
        ))
    }

    /// A matrix from blocks laid out row after row.
    #[cfg(test)]
    pub(super) fn from_blocks(dtype: DType, blocks: Vec<u8>, row_bytes: usize) -> Self {
        QuantMat {
            dtype,
            blocks,
            scales: Vec::new(),
            row_bytes,
            int8: false,
            e4m3: false,
        }
    }

    /// The same matrix, multiplied with int8 activations when `int8` and its format has that
    /// path (`int8::supports`), else exactly.
    pub(super) fn with_int8(self, int8: bool) -> Self {
        QuantMat {
            int8: int8 && super::int8::supports(self.dtype),
            ..self
        }
    }

    /// Whether products take int8 activations.
    pub fn int8(&self) -> bool {
        self.int8
    }

    /// The same matrix, its products rounding their activations to e4m3 first when `e4m3` and
    /// it is FP8 ([`round_e4m3`]); exact otherwise.
    pub(super) fn with_e4m3_activations(self, e4m3: bool) -> Self {
        QuantMat {
            e4m3: e4m3 && self.dtype == DType::F8_E4M3,
            ..self
        }
    }

    /// Whether products round their activations to e4m3 first.
    pub fn e4m3_activations(&self) -> bool {
        self.e4m3
    }

    /// Every row's blocks (FP8: codes), row after row.
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    /// Row `j`'s blocks.
    pub fn row(&self, j: usize) -> &[u8] {
        &self.blocks[j * self.row_bytes..(j + 1) * self.row_bytes]
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes the blocks and row scales take.
    pub fn bytes(&self) -> usize {
        self.blocks.len() + 4 * self.scales.len()
    }

    /// Each row's scale (FP8 only; empty otherwise).
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Rows `rows` decoded into `out` (`rows.len() × inner`, row-major).
    pub fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let bytes = &self.blocks[rows.start * self.row_bytes..rows.end * self.row_bytes];
        if self.dtype == DType::F8_E4M3 {
            let k = self.row_bytes;
            for ((codes, o), &s) in bytes
                .chunks_exact(k)
                .zip(out.chunks_exact_mut(k))
                .zip(&self.scales[rows])
            {
                tessera_core::fp8::decode_into(codes, s, o);
            }
            return;
        }
        widen_into(self.dtype, bytes, out);
    }
}

/// Quantize float `parts` (`(out, inner)` stacked, `inner` a whole number of blocks of `q`) to
/// blocks of `q` a row at a time, as llama.cpp's reference quantizers round
/// (`tessera_core::gguf::quantize`), or to FP8 with a scale per row; no `f32` copy of the
/// matrix is made.
pub(crate) fn quantize_stack(
    parts: &[Tensor<'_>],
    q: DType,
    (out, inner): (usize, usize),
) -> Result<QuantMat> {
    if q == DType::F8_E4M3 {
        return quantize_fp8(parts, (out, inner));
    }
    let Some(g) = q.ggml() else {
        return Err(Error::backend("matrix", format!("cannot quantize to {q}")));
    };
    let row_bytes = q
        .bytes_for(inner)
        .ok_or_else(|| Error::backend("matrix", format!("rows of {inner} are not {q} blocks")))?;
    let mut blocks = vec![0u8; out * row_bytes];
    let mut rest = blocks.as_mut_slice();
    for t in parts {
        let rows = t.numel() / inner.max(1);
        let (dst, tail) = rest.split_at_mut(rows * row_bytes);
        rest = tail;
        dst.par_chunks_mut(row_bytes)
            .enumerate()
            .try_for_each_init(Vec::new, |row, (r, b)| {
                row.resize(inner, 0.0);
                t.read_f32_range(r * inner, row);
                tessera_core::gguf::quantize(g, row, b).map_err(|e| {
                    Error::backend("matrix", format!("quantizing `{}` to {q}: {e}", t.name))
                })
            })?;
    }
    Ok(QuantMat {
        dtype: q,
        blocks,
        scales: Vec::new(),
        row_bytes,
        int8: false,
        e4m3: false,
    })
}

/// FP8 e4m3fn codes with one scale per row, `amax / 448` (`tessera_core::fp8::row_scale`),
/// rounded as torch's `(w / scale).to(float8_e4m3fn)`. Per row rather than per tensor: a row
/// of small weights beside one of large ones keeps its own three mantissa bits of relative
/// precision instead of falling into the subnormals, and stacked q|k|v keep their own scales;
/// a per-row scale is an output column's factor, so a GPU applies it after the product.
fn quantize_fp8(parts: &[Tensor<'_>], (out, inner): (usize, usize)) -> Result<QuantMat> {
    let mut blocks = vec![0u8; out * inner];
    let mut scales = vec![0f32; out];
    let (mut rest, mut rest_s) = (blocks.as_mut_slice(), scales.as_mut_slice());
    for t in parts {
        let rows = t.numel() / inner.max(1);
        let (dst, tail) = rest.split_at_mut(rows * inner);
        let (dst_s, tail_s) = rest_s.split_at_mut(rows);
        (rest, rest_s) = (tail, tail_s);
        dst.par_chunks_mut(inner.max(1))
            .zip(dst_s.par_iter_mut())
            .enumerate()
            .try_for_each_init(Vec::new, |row, (r, (b, s))| {
                row.resize(inner, 0.0);
                t.read_f32_range(r * inner, row);
                *s = tessera_core::fp8::row_scale(row).ok_or_else(|| {
                    Error::backend(
                        "matrix",
                        format!(
                            "quantizing `{}` in {} to FP8: row {r} holds a NaN or an infinity",
                            t.name,
                            t.path.display()
                        ),
                    )
                })?;
                tessera_core::fp8::quantize_row(row, *s, b);
                Ok::<(), Error>(())
            })?;
    }
    Ok(QuantMat {
        dtype: DType::F8_E4M3,
        blocks,
        scales,
        row_bytes: inner,
        int8: false,
        e4m3: false,
    })
}

/// `m` rows of `k` of `x` (at stride `xs`) as CUDA's FP8 products see them, packed: each value
/// rounded to bf16 (a CUDA compute buffer), then to e4m3 with one scale for the whole product,
/// `s = amax / 448` (1 when every value is 0), and multiplied back by `s`. The CPU's exact
/// products never do this; it is the floor reference the CUDA FP8 tests judge against.
pub(super) fn round_e4m3(x: &[f32], xs: usize, m: usize, k: usize) -> Vec<f32> {
    let mut out: Vec<f32> = (0..m)
        .flat_map(|r| x[r * xs..r * xs + k].iter())
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let amax = out.iter().fold(0f32, |a, v| a.max(v.abs()));
    let s = if amax == 0.0 {
        1.0
    } else {
        amax / tessera_core::fp8::E4M3_MAX
    };
    for v in &mut out {
        *v = tessera_core::fp8::to_f32(tessera_core::fp8::from_f32(*v / s)) * s;
    }
    out
}

thread_local! {
    /// The decoded panel of a product, kept between products so a forward does not fault in
    /// fresh pages for every panel.
    static PANEL_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `dst = alpha · x · wᵀ` (or `+=` when `accumulate`) for `m` rows of `x` (`k` wide at stride
/// `xs`) into `m` rows of `dst` (`n` wide at stride `ds`), `w` being `n × k`: each panel of
/// [`PANEL`] weight rows decoded to `f32` and multiplied as the dense `f32` product does (the
/// `gemm` crate, one thread per panel). Panels run on every thread when `par`. Shapes were
/// checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(super) fn product_exact(
    x: &[f32],
    xs: usize,
    m: usize,
    w: &QuantMat,
    (n, k): (usize, usize),
    dst: &mut [f32],
    ds: usize,
    alpha: f32,
    accumulate: bool,
    par: bool,
) {
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(ds.max(1)).take(m).for_each(|r| {
                let len = n.min(r.len());
                r[..len].fill(0.0);
            });
        }
        return;
    }
    let out = Out {
        ptr: dst.as_mut_ptr(),
        stride: ds,
        alpha,
        accumulate,
    };
    let panel = |p: usize| {
        let rows = p * PANEL..((p + 1) * PANEL).min(n);
        let run = |buf: &mut Vec<f32>| {
            buf.resize(rows.len() * k, 0.0);
            w.dequantize_rows(rows.clone(), buf);
            // SAFETY: `out` addresses `m` rows of `n` columns at `ds` (the caller's `dst`,
            // borrowed mutably for this call); this panel writes only its columns `rows`, which
            // no other panel writes. `x` holds `m` rows of `k` at `xs`; `buf` is `rows × k`.
            unsafe {
                gemm::gemm(
                    m,
                    rows.len(),
                    k,
                    out.at(0, rows.start),
                    1,
                    ds as isize,
                    accumulate,
                    x.as_ptr(),
                    1,
                    xs as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    if accumulate { 1.0 } else { 0.0 },
                    alpha,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        };
        PANEL_F32.with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => run(&mut buf),
            Err(_) => run(&mut Vec::new()),
        });
    };
    let panels = n.div_ceil(PANEL);
    if par && panels > 1 {
        (0..panels).into_par_iter().for_each(panel);
    } else {
        (0..panels).for_each(panel);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::testutil::*;
    use super::super::{CpuBackend, CpuBuf};
    use crate::{Backend, Epilogue, View, ViewMut};
    use std::borrow::Cow;
    use std::path::Path;
    use tessera_core::{DType, Scale, Tensor};

    /// Random but valid blocks of `dtype` for `n` rows of `k`: random quantized values with
    /// f16 scales that put the values in about [-1, 1], as a trained layer's are (random scale
    /// bytes could be NaN or huge).
    pub(crate) fn random_blocks(dtype: DType, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut rng = Rng::new(seed);
        let mut bytes: Vec<u8> = (0..dtype.bytes_for(n * k).unwrap())
            .map(|_| ((rng.next_f32() + 1.0) * 128.0) as u8)
            .collect();
        // The largest |quantized value| each format multiplies its scale by.
        let top = match dtype {
            DType::Q8_0 => 127.0,
            DType::Q4_0 => 8.0,
            DType::Q4_K => 63.0 * 15.0,
            DType::Q6_K => 128.0 * 32.0,
            _ => unreachable!(),
        };
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for b in bytes.chunks_exact_mut(dtype.block_bytes()) {
            let d = (0.5 + 0.5 * rng.next_f32().abs()) / top;
            match dtype {
                DType::Q8_0 | DType::Q4_0 => b[..2].copy_from_slice(&f16(d)),
                DType::Q4_K => {
                    b[..2].copy_from_slice(&f16(d));
                    b[2..4].copy_from_slice(&f16(0.5 * d * 15.0));
                }
                DType::Q6_K => b[208..].copy_from_slice(&f16(d)),
                _ => unreachable!(),
            }
        }
        bytes
    }

    fn tensor(dtype: DType, shape: [usize; 2], bytes: Vec<u8>) -> Tensor<'static> {
        Tensor {
            name: format!("w.{dtype}"),
            dtype,
            shape: shape.to_vec(),
            bytes: Cow::Owned(bytes),
            path: Path::new("<test>"),
            scale: None,
        }
    }

    fn product(be: &CpuBackend, mat: &super::super::CpuMat, x: &[f32], m: usize) -> Vec<f32> {
        let (n, k) = (mat.out, mat.inner);
        let xb = buf(be, x);
        let mut o = CpuBuf::F32(vec![0.0; m * n]);
        be.matmul(
            View::new(&xb, m, k),
            mat,
            ViewMut::new(&mut o, m, n),
            &Epilogue::scaled(0.5),
        )
        .unwrap();
        be.read_f32(View::new(&o, m, n)).unwrap()
    }

    /// The exact mode is the product on the decoded weights: within 1e-5 of a float64 product
    /// on them, and of the dense f32 product on a copy of them, for every block format, at
    /// sizes off the panel width, with two parts stacked.
    #[test]
    fn exact_products_equal_the_product_on_the_decoded_weights() {
        let be = cpu();
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K] {
            let k = 2 * dtype.block_size().max(64);
            for &(m, n) in &[(1usize, 1usize), (3, 70), (17, 130), (64, 64)] {
                let seed = (m * 1000 + n) as u64;
                let (n1, n2) = (n.div_ceil(2), n / 2);
                let parts = [
                    tensor(dtype, [n1, k], random_blocks(dtype, n1, k, seed)),
                    tensor(dtype, [n2, k], random_blocks(dtype, n2, k, seed + 1)),
                ];
                let parts: Vec<_> = parts.into_iter().filter(|t| t.shape[0] > 0).collect();
                let mat = be.matrix(&parts).unwrap();
                let w: Vec<f32> = parts.iter().flat_map(|t| t.to_f32()).collect();
                let dense = be.matrix_f32(&[(&w, n)], k).unwrap();
                let x = Rng::new(seed + 2).vec(m * k, 2.0);
                let got = product(&be, &mat, &x, m);
                let f32_path = product(&be, &dense, &x, m);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = 0.5
                            * (0..k)
                                .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                                .sum::<f64>();
                        let what = format!("{dtype} {m}×{k}×{n} [{i},{j}]");
                        assert_close(got[i * n + j], want, 1e-5, &what);
                        assert_close(got[i * n + j], f32_path[i * n + j] as f64, 1e-5, &what);
                    }
                }
            }
        }
    }

    /// With `rounding_fp8_activations` (the CUDA tests' floor reference), products on FP8
    /// weights take the activations rounded to bf16 and then to e4m3 with one scale for the
    /// whole product, amax / 448: within 1e-5 of a float64 product on activations rounded so
    /// here, and clearly off the exact product; other matrices are untouched.
    #[test]
    fn e4m3_activations_round_once_per_product_as_cuda_does() {
        use tessera_core::fp8;
        let (n, k, m) = (70, 96, 9);
        let mut rng = Rng::new(3);
        let w = rng.vec(n * k, 0.1);
        let scales: Vec<f32> = w.chunks(k).map(|r| fp8::row_scale(r).unwrap()).collect();
        let mut codes = vec![0u8; n * k];
        for ((r, c), &s) in w.chunks(k).zip(codes.chunks_mut(k)).zip(&scales) {
            fp8::quantize_row(r, s, c);
        }
        let mut t = tensor(DType::F8_E4M3, [n, k], codes);
        t.scale = Some(Scale::Rows(scales));
        let decoded = t.to_f32();
        let x: Vec<f32> = Rng::new(4).vec(m * k, 3.0);
        let floor_be = CpuBackend::new().rounding_fp8_activations();
        let got = product(
            &floor_be,
            &floor_be.matrix(std::slice::from_ref(&t)).unwrap(),
            &x,
            m,
        );
        let exact = product(
            &cpu(),
            &cpu().matrix(std::slice::from_ref(&t)).unwrap(),
            &x,
            m,
        );
        // Rounded here independently: bf16, then e4m3 with s = amax / 448 over all m rows.
        let bf: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let s = fp8::row_scale(&bf).unwrap();
        let xr: Vec<f64> = bf
            .iter()
            .map(|&v| fp8::to_f32(fp8::from_f32(v / s)) as f64 * s as f64)
            .collect();
        let mut off = 0f64;
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|t| xr[i * k + t] * decoded[j * k + t] as f64)
                    .sum();
                let what = format!("e4m3 activations [{i},{j}]");
                assert_close(got[i * n + j], 0.5 * dot, 1e-5, &what);
                off = off.max((got[i * n + j] - exact[i * n + j]).abs() as f64);
            }
        }
        assert!(
            off > 1e-3,
            "rounding the activations changed nothing ({off:e})"
        );
        // A dense matrix's product is not rounded.
        let dense = floor_be.matrix_f32(&[(&w, n)], k).unwrap();
        assert_eq!(
            product(&floor_be, &dense, &x, m),
            product(&cpu(), &cpu().matrix_f32(&[(&w, n)], k).unwrap(), &x, m)
        );
    }

    /// FP8 matrices with per-tensor and per-row scales, stacked (q|k|v-like), give
    /// the product on their decoded values (code · scale in f32), within 1e-5 of float64; and
    /// `--quantize fp8` keeps one scale per row, the matrix at a quarter of f32's bytes.
    #[test]
    fn fp8_products_equal_the_product_on_the_decoded_weights() {
        let be = cpu();
        let k = 96;
        let (n1, n2) = (70, 5);
        let mut rng = Rng::new(8);
        // Random finite codes (0x7F and 0xFF are NaN).
        let mut codes = |n: usize| -> Vec<u8> {
            (0..n * k)
                .map(|_| ((rng.next_f32() + 1.0) * 127.99) as u8)
                .map(|c| if c & 0x7F == 0x7F { 0x7E } else { c })
                .collect()
        };
        let mut a = tensor(DType::F8_E4M3, [n1, k], codes(n1));
        a.scale = Some(Scale::Tensor(0.0123));
        let mut b = tensor(DType::F8_E4M3, [n2, k], codes(n2));
        b.scale = Some(Scale::Rows((0..n2).map(|r| 0.5 + r as f32).collect()));
        let parts = [a, b];
        let mat = be.matrix(&parts).unwrap();
        let w: Vec<f32> = parts.iter().flat_map(|t| t.to_f32()).collect();
        let n = n1 + n2;
        for m in [1usize, 9] {
            let x = Rng::new(m as u64).vec(m * k, 2.0);
            let got = product(&be, &mat, &x, m);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = 0.5
                        * (0..k)
                            .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                            .sum::<f64>();
                    assert_close(
                        got[i * n + j],
                        want,
                        1e-5,
                        &format!("fp8 {m}×{k}×{n} [{i},{j}]"),
                    );
                }
            }
        }
        // Quantized at load: per-row scales, rows decoded back within e4m3's half step (2⁻⁴
        // relative to the row's largest value).
        let dense: Vec<f32> = Rng::new(5).vec(n * k, 1.0);
        let t = Tensor::from_f32("dense", vec![n, k], &dense).unwrap();
        let q = super::quantize_stack(&[t], DType::F8_E4M3, (n, k)).unwrap();
        assert_eq!((q.scales().len(), q.bytes()), (n, n * k + 4 * n));
        let mut back = vec![0f32; n * k];
        q.dequantize_rows(0..n, &mut back);
        for (r, (row, got)) in dense.chunks(k).zip(back.chunks(k)).enumerate() {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (v, g) in row.iter().zip(got) {
                assert!((v - g).abs() <= amax / 16.0, "row {r}: {v} → {g}");
            }
        }
    }

    /// Parts in different formats (llama-quantize's Q4_K_M: Q4_K queries and keys beside Q6_K
    /// values) stack as runs of one format: exactly and with int8 activations, the stack's
    /// product is each run's product alone, bit for bit, side by side.
    #[test]
    fn mixed_format_stacks_compute_each_run_as_alone() {
        let k = 256;
        let parts = [
            tensor(DType::Q4_K, [5, k], random_blocks(DType::Q4_K, 5, k, 1)),
            tensor(DType::Q4_K, [3, k], random_blocks(DType::Q4_K, 3, k, 2)),
            tensor(DType::Q6_K, [4, k], random_blocks(DType::Q6_K, 4, k, 3)),
            tensor(DType::Q8_0, [2, k], random_blocks(DType::Q8_0, 2, k, 4)),
        ];
        let n = 14;
        for int8 in [false, true] {
            let be = cpu().quantizing(crate::Quantization {
                int8,
                ..Default::default()
            });
            let mat = be.matrix(&parts).unwrap();
            assert_eq!((mat.out, mat.quantized()), (n, Some(DType::Q4_K)));
            for m in [1usize, 7] {
                let x = Rng::new(m as u64).vec(m * k, 2.0);
                let got = product(&be, &mat, &x, m);
                let mut col = 0;
                for run in [&parts[..2], &parts[2..3], &parts[3..]] {
                    let alone = be.matrix(run).unwrap();
                    let w = alone.out;
                    let want = product(&be, &alone, &x, m);
                    for i in 0..m {
                        assert_eq!(
                            got[i * n + col..i * n + col + w],
                            want[i * w..(i + 1) * w],
                            "int8 {int8}, {m} rows, row {i}, columns from {col}"
                        );
                    }
                    col += w;
                }
            }
        }
    }

    /// Blocks that do not fit the shape and rows that are not whole blocks are refused, naming
    /// the tensor.
    #[test]
    fn bad_blocks_name_the_tensor() {
        let be = cpu();
        let short = tensor(DType::Q8_0, [2, 64], vec![0; 3 * 34]);
        let e = be.matrix(&[short]).err().unwrap().to_string();
        assert!(e.contains("`w.Q8_0`") && e.contains("2×64"), "{e}");
        let ragged = tensor(DType::Q4_K, [1, 100], vec![0; 144]);
        let e = be.matrix(&[ragged]).err().unwrap().to_string();
        assert!(e.contains("`w.Q4_K`") && e.contains("whole number"), "{e}");
        // A vector of a block format that is not whole blocks.
        let v = Tensor {
            shape: vec![16],
            ..tensor(DType::Q8_0, [1, 32], vec![0; 34])
        };
        let e = be.vector(&v).err().unwrap().to_string();
        assert!(
            e.contains("`w.Q8_0`") && e.contains("whole Q8_0 blocks"),
            "{e}"
        );
    }
}
