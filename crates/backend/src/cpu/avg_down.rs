//! The 2× space-to-channel shortcut of residual VAE down blocks ([`AvgDown`]), added into the
//! output.

use rayon::prelude::*;
use tessera_core::Result;

use super::{CpuBackend, rows_mut, slice};
use crate::{AvgDown, View, ViewMut};

pub(super) fn avg_down(
    x: View<'_, CpuBackend>,
    spec: &AvgDown,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    let g = spec.check((x.rows, x.cols), (out.rows, out.cols))?;
    let (cout, w, s) = (out.cols, spec.width, spec.space);
    let ow = w / s;
    // The (input channel, input pixel offset) pairs each output channel sums, computed once;
    // the zero frame's entries add nothing and are left out (the divisor stays `g`).
    let stride = x.stride;
    let taps: Vec<Vec<usize>> = (0..cout)
        .map(|o| {
            (o * g..(o + 1) * g)
                .filter_map(|e| spec.source(e))
                .map(|(c, sy, sx)| (sy * w + sx) * stride + c)
                .collect()
        })
        .collect();
    let xs = slice(&x);
    rows_mut(out).enumerate().for_each(|(p, row)| {
        let (y, xx) = (p / ow, p % ow);
        let base = (s * y * w + s * xx) * stride;
        for (v, t) in row.iter_mut().zip(&taps) {
            let sum: f32 = t.iter().map(|&i| xs[base + i]).sum();
            *v += sum / g as f32;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{AvgDown, Backend, View, ViewMut};

    /// diffusers' `AvgDown3D.forward` step by step on an NCHW-indexed image of one frame, in
    /// f64: zero frames padded in front to `frames`, the view
    /// `[in, 1, frames, h/s, s, w/s, s]`, the permute to `[in, frames, s, s, 1, h/s, w/s]`, the
    /// view `[out, g, h/s, w/s]` and the mean over `g`. Returns `[out, h/s, w/s]`.
    fn naive(
        x: &[f64],
        (h, w, cin): (usize, usize, usize),
        cout: usize,
        frames: usize,
        s: usize,
    ) -> Vec<f64> {
        let f = frames * s * s;
        let g = cin * f / cout;
        let (oh, ow) = (h / s, w / s);
        // The padded video [in, frames, h, w]: the image is the last frame.
        let video = |c: usize, t: usize, y: usize, xx: usize| {
            if t == frames - 1 {
                x[(c * h + y) * w + xx]
            } else {
                0.0
            }
        };
        // The permuted tensor viewed as [in·f, oh, ow]: channel e = ((c·frames + t)·s + sy)·s + sx.
        let expanded = |e: usize, y: usize, xx: usize| {
            let (c, r) = (e / f, e % f);
            let (t, sy, sx) = (r / (s * s), (r / s) % s, r % s);
            video(c, t, s * y + sy, s * xx + sx)
        };
        let mut out = vec![0.0; cout * oh * ow];
        for o in 0..cout {
            for y in 0..oh {
                for xx in 0..ow {
                    let sum: f64 = (0..g).map(|j| expanded(o * g + j, y, xx)).sum();
                    out[(o * oh + y) * ow + xx] = sum / g as f64;
                }
            }
        }
        out
    }

    #[test]
    fn avg_down_adds_the_reference_shortcut() {
        let be = cpu();
        // (h, w, in, out, frames, space): the release's blocks (in = out with frames 1, out =
        // 2·in with frames 2), groups spanning several channels (g = 8, 16), one sub-pixel a
        // channel (g = 1, 2), the last block's channel-group mean (space 1) and its identity.
        for &(h, w, cin, cout, f, s) in &[
            (4, 6, 6, 6, 1, 2),
            (6, 4, 6, 12, 2, 2),
            (2, 4, 8, 4, 2, 2),
            (4, 2, 12, 3, 1, 2),
            (2, 2, 3, 12, 1, 2),
            (4, 4, 3, 12, 2, 2),
            (2, 6, 4, 8, 1, 2),
            (3, 5, 8, 4, 1, 1),
            (3, 2, 5, 5, 1, 1),
        ] {
            let mut rng = Rng::new((h * w * cin * cout * f * s) as u64);
            let x = rng.vec(h * w * cin, 2.0);
            let (oh, ow) = (h / s, w / s);
            let n = oh * ow;
            let prior = rng.vec(n * cout, 1.0);
            let spec = AvgDown {
                height: h,
                width: w,
                frames: f,
                space: s,
            };
            // The input in columns 2.. of a wider buffer: the stride is honoured.
            let xstride = cin + 3;
            let mut xin = vec![f32::NAN; h * w * xstride];
            for p in 0..h * w {
                xin[p * xstride + 2..p * xstride + 2 + cin]
                    .copy_from_slice(&x[p * cin..(p + 1) * cin]);
            }
            let xb = buf(&be, &xin);
            // Output in columns 1.. of a wider buffer: column 0 must stay untouched.
            let stride = cout + 1;
            let mut init = vec![f32::NAN; n * stride];
            for p in 0..n {
                init[p * stride + 1..p * stride + 1 + cout]
                    .copy_from_slice(&prior[p * cout..(p + 1) * cout]);
            }
            let mut o = buf(&be, &init);
            be.avg_down(
                View::new(&xb, h * w, xstride).cols(2, cin),
                &spec,
                ViewMut::new(&mut o, n, stride).cols(1, cout),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, n, stride)).unwrap();
            let mut nchw = vec![0f64; x.len()];
            for p in 0..h * w {
                for c in 0..cin {
                    nchw[c * h * w + p] = x[p * cin + c] as f64;
                }
            }
            let want = naive(&nchw, (h, w, cin), cout, f, s);
            for p in 0..n {
                assert!(got[p * stride].is_nan(), "column 0 written");
                for c in 0..cout {
                    let want = prior[p * cout + c] as f64 + want[c * n + p];
                    assert_close(got[p * stride + 1 + c], want, 1e-6, "avg_down");
                }
            }
        }
    }

    #[test]
    fn avg_down_refuses_shapes_that_do_not_fit() {
        let be = cpu();
        let x = buf(&be, &[0.0; 4 * 4 * 6]);
        let mut o = buf(&be, &[0.0; 64]);
        for (spec, cout) in [
            // 6·4 is not a multiple of 5.
            ((4, 4, 1, 2), 5),
            // An odd side cannot be folded 2×2.
            ((3, 4, 1, 2), 6),
        ] {
            let (h, w, f, s) = spec;
            let spec = AvgDown {
                height: h,
                width: w,
                frames: f,
                space: s,
            };
            let (oh, ow) = spec.out_size();
            let err = be
                .avg_down(
                    View::new(&x, h * w, 6),
                    &spec,
                    ViewMut::new(&mut o, oh * ow, cout),
                )
                .unwrap_err();
            assert!(err.to_string().contains("avg_down"), "{err}");
        }
    }
}
