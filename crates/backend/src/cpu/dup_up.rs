//! The 2× channel-to-space shortcut of residual VAE up blocks ([`DupUp`]), added into the output.

use rayon::prelude::*;
use tessera_core::Result;

use super::{CpuBackend, rows_mut, slice};
use crate::{DupUp, View, ViewMut};

pub(super) fn dup_up(
    x: View<'_, CpuBackend>,
    spec: &DupUp,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    let r = spec.check((x.rows, x.cols), (out.rows, out.cols))?;
    let (cout, w, ow) = (out.cols, spec.width, 2 * spec.width);
    // The source channel of each (sub-pixel, output channel), computed once.
    let src: Vec<usize> = (0..4)
        .flat_map(|s| (0..cout).map(move |o| (s, o)))
        .map(|(s, o)| spec.source(r, o, s / 2, s % 2))
        .collect();
    let (xs, stride) = (slice(&x), x.stride);
    rows_mut(out).enumerate().for_each(|(p, row)| {
        let (oy, ox) = (p / ow, p % ow);
        let (y, sx) = (oy / 2, ox % 2);
        let s = (oy % 2) * 2 + sx;
        let base = (y * w + ox / 2) * stride;
        for (o, v) in row.iter_mut().enumerate() {
            *v += xs[base + src[s * cout + o]];
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Backend, DupUp, View, ViewMut};

    /// diffusers' `DupUp3D.forward(x, first_chunk=True)` step by step on an NCHW-indexed image
    /// of one frame, in f64: `repeat_interleave` over channels, the view
    /// `[out, frames, 2, 2, T=1, h, w]`, the permute to `[out, T, frames, h, 2, w, 2]`, the view
    /// `[out, frames, 2h, 2w]`, then `[:, frames − 1:]`. Returns `[out, 2h, 2w]`.
    fn naive(
        x: &[f64],
        (h, w, cin): (usize, usize, usize),
        cout: usize,
        frames: usize,
    ) -> Vec<f64> {
        let r = cout * 4 * frames / cin;
        // Repeated channels: [cin·r, h, w], channel j from input channel j / r.
        let rep = |j: usize, y: usize, xx: usize| x[((j / r) * h + y) * w + xx];
        let (oh, ow) = (2 * h, 2 * w);
        // The permuted, reshaped tensor [out, frames·1, 2h, 2w].
        let full = |o: usize, t: usize, yy: usize, xx: usize| {
            let (y, sy, x0, sx) = (yy / 2, yy % 2, xx / 2, xx % 2);
            // Element (o, t, sy, sx) of the view over the repeated channels.
            let j = ((o * frames + t) * 2 + sy) * 2 + sx;
            rep(j, y, x0)
        };
        let mut out = vec![0.0; cout * oh * ow];
        for o in 0..cout {
            for yy in 0..oh {
                for xx in 0..ow {
                    out[(o * oh + yy) * ow + xx] = full(o, frames - 1, yy, xx);
                }
            }
        }
        out
    }

    #[test]
    fn dup_up_adds_the_reference_shortcut() {
        let be = cpu();
        // (h, w, in, out, frames): the release's ratios (in = out with frames 2, in = 2·out with
        // frames 2 and 1), in = 4·out, in = 8·out (one input channel per output pixel), and
        // more output than input channels.
        for &(h, w, cin, cout, f) in &[
            (3, 5, 6, 6, 2),
            (4, 3, 12, 6, 2),
            (5, 2, 10, 5, 1),
            (2, 3, 16, 4, 1),
            (3, 3, 16, 2, 2),
            (1, 1, 3, 6, 1),
            (2, 7, 4, 16, 2),
        ] {
            let mut rng = Rng::new((h * w * cin * cout * f) as u64);
            let x = rng.vec(h * w * cin, 2.0);
            let prior = rng.vec(4 * h * w * cout, 1.0);
            let spec = DupUp {
                height: h,
                width: w,
                frames: f,
            };
            let xb = buf(&be, &x);
            // Output in columns 1.. of a wider buffer: column 0 must stay untouched.
            let stride = cout + 1;
            let mut init = vec![f32::NAN; 4 * h * w * stride];
            for p in 0..4 * h * w {
                init[p * stride + 1..p * stride + 1 + cout]
                    .copy_from_slice(&prior[p * cout..(p + 1) * cout]);
            }
            let mut o = buf(&be, &init);
            be.dup_up(
                View::new(&xb, h * w, cin),
                &spec,
                ViewMut::new(&mut o, 4 * h * w, stride).cols(1, cout),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, 4 * h * w, stride)).unwrap();
            // NCHW input for the naive version.
            let mut nchw = vec![0f64; x.len()];
            for p in 0..h * w {
                for c in 0..cin {
                    nchw[c * h * w + p] = x[p * cin + c] as f64;
                }
            }
            let want = naive(&nchw, (h, w, cin), cout, f);
            for p in 0..4 * h * w {
                assert!(got[p * stride].is_nan(), "column 0 written");
                for c in 0..cout {
                    let want = prior[p * cout + c] as f64 + want[c * 4 * h * w + p];
                    assert_close(got[p * stride + 1 + c], want, 1e-6, "dup_up");
                }
            }
        }
    }

    #[test]
    fn dup_up_refuses_channel_counts_that_do_not_fit() {
        let be = cpu();
        let spec = DupUp {
            height: 2,
            width: 2,
            frames: 1,
        };
        for (cin, cout) in [(6, 4), (20, 4), (0, 4)] {
            let xb = buf(&be, &vec![0.0; 4 * cin.max(1)]);
            let mut o = buf(&be, &vec![0.0; 16 * cout]);
            let e = be
                .dup_up(
                    View::new(&xb, 4, cin),
                    &spec,
                    ViewMut::new(&mut o, 16, cout),
                )
                .unwrap_err()
                .to_string();
            assert!(e.contains("dup_up") && e.contains("multiple of in"), "{e}");
        }
    }
}
