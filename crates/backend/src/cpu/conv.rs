//! "Same" 2-D convolution over a channels-last image as an implicit GEMM: blocks of output
//! pixels gather their `k × k × in` input patches into a small column matrix (zeros outside the
//! image; with `upsample`, each upsampled pixel reads its nearest source pixel; with `downsample`,
//! output pixel `(y, x)` reads from `(2y, 2x)` on, zeros past the bottom and right), which one GEMM
//! multiplies by the `[out, k·k·in]` weight. Blocks run in parallel; no full im2col is stored.
//! An input activation is applied to the gathered values (each input value once per tap: a small
//! cost beside the product's `out` multiply-adds per gathered value).

use rayon::prelude::*;
use tessera_core::Result;

use super::{CpuBackend, CpuMat, slice, vmath};
use crate::{Conv2d, View, ViewMut};

/// Column-matrix budget per block, in floats (about 1 MiB): big enough for efficient GEMMs,
/// small enough to stay in cache and to parallelise small images.
const BLOCK_FLOATS: usize = 1 << 18;

pub(super) fn conv2d(
    x: View<'_, CpuBackend>,
    w: &CpuMat,
    bias: &[f32],
    spec: &Conv2d,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    let (cin, cout, k) = (x.cols, out.cols, spec.kernel);
    let ow = spec.out_size().1;
    let kk = k * k * cin;
    spec.check(
        (x.rows, x.cols),
        (w.out, w.inner),
        bias.len(),
        (out.rows, out.cols),
    )?;
    if out.rows == 0 || cout == 0 {
        return Ok(());
    }
    let xs = slice(&x);
    let xstride = x.stride;
    let up = if spec.upsample { 2 } else { 1 };
    // Output pixel `o` reads virtual input pixels `stride·o + k − pad`; the virtual input is the
    // (upsampled) image, zero outside `vh × vw`.
    let (pad, stride) = if spec.downsample {
        (0, 2)
    } else {
        ((k / 2) as isize, 1)
    };
    let (ih, iw) = (spec.height, spec.width);
    let (vh, vw) = ((ih * up) as isize, (iw * up) as isize);
    let block = (BLOCK_FLOATS / kk.max(1)).clamp(16, 1024);
    let (ostride, off, end) = (out.stride, out.offset, out.end());
    let dst = &mut out.buf.f32_mut()[off..end];
    dst.par_chunks_mut(block * ostride)
        .enumerate()
        .for_each_init(
            Default::default,
            |(col, sums): &mut (Vec<f32>, Vec<f32>), (bi, chunk)| {
                let p0 = bi * block;
                // Rows in this block: the slice's last row ends after `cout` columns, not at the stride.
                let n = (chunk.len() + ostride - cout) / ostride;
                col.clear();
                col.resize(n * kk, 0.0);
                for (r, crow) in col.chunks_mut(kk).enumerate() {
                    let p = p0 + r;
                    let (oy, ox) = ((p / ow) as isize, (p % ow) as isize);
                    let (oy, ox) = (oy * stride, ox * stride);
                    for ky in 0..k {
                        let uy = oy + ky as isize - pad;
                        if uy < 0 || uy >= vh {
                            continue;
                        }
                        let iy = uy as usize / up;
                        for kx in 0..k {
                            let ux = ox + kx as isize - pad;
                            if ux < 0 || ux >= vw {
                                continue;
                            }
                            let ix = ux as usize / up;
                            debug_assert!(iy < ih && ix < iw);
                            let src = (iy * iw + ix) * xstride;
                            let at = (ky * k + kx) * cin;
                            let dst = &mut crow[at..at + cin];
                            dst.copy_from_slice(&xs[src..src + cin]);
                            if let Some(act) = spec.act {
                                vmath::activate(dst, act);
                            }
                        }
                    }
                }
                // The convolution's rows: in the output, or (`accumulate`: out += conv + bias)
                // in `sums` first and then added, as an unfused residual would round them.
                let (rows, ld) = if spec.accumulate {
                    sums.resize(n * cout, 0.0);
                    (&mut sums[..], cout)
                } else {
                    (&mut chunk[..], ostride)
                };
                for r in 0..n {
                    rows[r * ld..r * ld + cout].copy_from_slice(bias);
                }
                // The product is added to the bias rows in place.
                super::matmul::product_rows(col, kk, n, w, rows, ld, 1.0, true, false);
                if spec.accumulate {
                    for (r, s) in sums.chunks_exact(cout).enumerate() {
                        for (o, &v) in chunk[r * ostride..r * ostride + cout].iter_mut().zip(s) {
                            *o += v;
                        }
                    }
                }
            },
        );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::CpuBackend;
    use super::super::testutil::*;
    use crate::{Activation, Backend, Conv2d, Precision, View, ViewMut};

    /// SiLU in f64, applied to the naive convolution's input.
    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    /// PyTorch's definition on an NCHW-indexed weight `[out, in, k, k]`, in f64.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        x: &[f32],
        (h, w, cin): (usize, usize, usize),
        wt: &[f32],
        bias: &[f32],
        cout: usize,
        k: usize,
        (up, down): (bool, bool),
        act: Option<fn(f64) -> f64>,
        bf16: bool,
    ) -> Vec<f64> {
        // Under bf16 the product's inputs (the activated input as f32, and the weights) are
        // rounded to bf16.
        let r = |v: f64| {
            if bf16 {
                half::bf16::from_f32(v as f32).to_f32() as f64
            } else {
                v
            }
        };
        let s = if up { 2 } else { 1 };
        // Downsampling: stride 2 over the image padded by one zero row and column after.
        let (vh, vw) = (h * s, w * s);
        let (oh, ow, pad, st) = if down {
            (h / 2, w / 2, 0, 2)
        } else {
            (vh, vw, (k / 2) as isize, 1)
        };
        let mut out = vec![0f64; oh * ow * cout];
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..cout {
                    let mut acc = bias[co] as f64;
                    for ci in 0..cin {
                        for ky in 0..k {
                            for kx in 0..k {
                                let (uy, ux) = (
                                    (st * oy) as isize + ky as isize - pad,
                                    (st * ox) as isize + kx as isize - pad,
                                );
                                if uy < 0 || ux < 0 || uy >= vh as isize || ux >= vw as isize {
                                    continue;
                                }
                                let (iy, ix) = (uy as usize / s, ux as usize / s);
                                let v = x[(iy * w + ix) * cin + ci] as f64;
                                let v = r(act.map_or(v, |f| f(v) as f32 as f64));
                                acc += v * r(wt[((co * cin + ci) * k + ky) * k + kx] as f64);
                            }
                        }
                    }
                    out[(oy * ow + ox) * cout + co] = acc;
                }
            }
        }
        out
    }

    #[test]
    fn same_conv_with_and_without_resampling_matches_naive() {
        for p in [Precision::F32, Precision::Bf16] {
            same_conv_matches_naive(p);
        }
    }

    fn same_conv_matches_naive(precision: Precision) {
        let be = CpuBackend::with_precision(precision);
        // (h, w, in, out, kernel, (upsample, downsample), SiLU input): odd sizes, 1×1
        // shortcuts, blocks cut mid-row, pre-activated inputs, stride-2 downsampling (the
        // smallest image, one output pixel reading the padding, and blocks cut mid-row).
        let (no, up, down) = ((false, false), (true, false), (false, true));
        for &(h, w, cin, cout, k, mode, pre) in &[
            (1, 1, 1, 1, 3, no, false),
            (5, 7, 3, 4, 3, no, false),
            (6, 3, 5, 2, 1, no, false),
            (4, 5, 6, 7, 3, up, false),
            (23, 41, 8, 5, 3, no, false),
            (9, 13, 19, 33, 3, up, false),
            (5, 7, 3, 4, 3, no, true),
            (6, 3, 5, 2, 1, no, true),
            (9, 13, 19, 33, 3, up, true),
            (2, 2, 3, 5, 3, down, false),
            (6, 10, 7, 4, 3, down, false),
            (40, 34, 9, 6, 3, down, false),
            (8, 6, 5, 7, 3, down, true),
        ] {
            let seed = (h * w * cin * cout * k) as u64 + mode.0 as u64 + 2 * mode.1 as u64;
            let mut rng = Rng::new(seed + pre as u64);
            let x = rng.vec(h * w * cin, 2.0);
            let wt = rng.vec(cout * cin * k * k, 1.0);
            let bias = rng.vec(cout, 1.0);
            // PyTorch's [out, in, ky, kx] to the op's [out, ky, kx, in].
            let mut wr = vec![0f32; wt.len()];
            for co in 0..cout {
                for ci in 0..cin {
                    for t in 0..k * k {
                        wr[(co * k * k + t) * cin + ci] = wt[(co * cin + ci) * k * k + t];
                    }
                }
            }
            let mut spec = Conv2d::same(h, w, k);
            if mode.0 {
                spec = spec.upsampled();
            }
            if mode.1 {
                spec = spec.downsampled();
            }
            if pre {
                spec = spec.of_activated(Activation::Silu);
            }
            let (oh, ow) = spec.out_size();
            let xb = buf(&be, &x);
            let mat = be.matrix_f32(&[(&wr, cout)], k * k * cin).unwrap();
            let bv = be.vector_f32(&bias).unwrap();
            // Output in columns 1.. of a wider buffer: column 0 must stay untouched.
            let stride = cout + 1;
            let mut o = buf(&be, &vec![f32::NAN; oh * ow * stride]);
            be.conv2d(
                View::new(&xb, h * w, cin),
                &mat,
                &bv,
                &spec,
                ViewMut::new(&mut o, oh * ow, stride).cols(1, cout),
            )
            .unwrap();
            let all = be.read_f32(View::new(&o, oh * ow, stride)).unwrap();
            let act = pre.then_some(silu as fn(f64) -> f64);
            let bf16 = precision == Precision::Bf16;
            let want = naive(&x, (h, w, cin), &wt, &bias, cout, k, mode, act, bf16);
            for p in 0..oh * ow {
                assert!(all[p * stride].is_nan(), "column 0 written");
                for c in 0..cout {
                    let what = format!("conv2d {precision}");
                    assert_close(all[p * stride + 1 + c], want[p * cout + c], 1e-5, &what);
                }
            }
        }
    }

    /// `accumulate` gives the bits of the convolution stored alone and then added to the output,
    /// the unfused residual it replaces, and leaves the columns outside the view alone.
    #[test]
    fn an_accumulated_conv_equals_the_conv_added_after() {
        for precision in [Precision::F32, Precision::Bf16] {
            let be = CpuBackend::with_precision(precision);
            for &(h, w, cin, cout, k, up) in &[(5, 7, 3, 4, 3, false), (9, 13, 19, 33, 3, true)] {
                let mut rng = Rng::new((h * w * cin * cout) as u64);
                let x = buf(&be, &rng.vec(h * w * cin, 2.0));
                let mat = be
                    .matrix_f32(&[(&rng.vec(cout * k * k * cin, 1.0), cout)], k * k * cin)
                    .unwrap();
                let bias = be.vector_f32(&rng.vec(cout, 1.0)).unwrap();
                let mut spec = Conv2d::same(h, w, k);
                if up {
                    spec = spec.upsampled();
                }
                let (oh, ow) = spec.out_size();
                let (px, stride) = (oh * ow, cout + 2);
                let start = rng.vec(px * stride, 3.0);
                let mut alone = buf(&be, &vec![0.0; px * cout]);
                let mut added = buf(&be, &start);
                be.conv2d(
                    View::new(&x, h * w, cin),
                    &mat,
                    &bias,
                    &spec,
                    ViewMut::new(&mut alone, px, cout),
                )
                .unwrap();
                be.conv2d(
                    View::new(&x, h * w, cin),
                    &mat,
                    &bias,
                    &spec.added_to_output(),
                    ViewMut::new(&mut added, px, stride).cols(1, cout),
                )
                .unwrap();
                let alone = be.read_f32(View::new(&alone, px, cout)).unwrap();
                let added = be.read_f32(View::new(&added, px, stride)).unwrap();
                for p in 0..px {
                    for c in 0..stride {
                        let want = match c {
                            0 => start[p * stride],
                            c if c > cout => start[p * stride + c],
                            c => start[p * stride + c] + alone[p * cout + c - 1],
                        };
                        assert_eq!(
                            added[p * stride + c].to_bits(),
                            want.to_bits(),
                            "{precision} {h}×{w} pixel {p} column {c}"
                        );
                    }
                }
            }
        }
    }
}
