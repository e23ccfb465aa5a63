//! torch's uint8 antialiased resize (bicubic or bilinear), byte for byte.
//!
//! The reference processors resize with torchvision's `resize(uint8 image, antialias=True)`,
//! which on the CPU runs torch's `_upsample_bicubic2d_aa` / `_upsample_bilinear2d_aa` on the
//! uint8 tensor itself (ATen `UpSampleKernel.cpp`, the int16-weight path shared with its AVX2
//! kernels; torchvision takes it for bilinear only on AVX2/AVX-512/arm64 CPUs, and otherwise
//! resizes in float32 and rounds, which differs in places). Both filters share the arithmetic:
//!
//! - per axis, `scale = in / out` (f64); the filter (Keys cubic with a = −0.5, half-width 2, or
//!   the triangle, half-width 1) is stretched by `scale` when shrinking (support
//!   `half-width·scale`), not when enlarging (support = half-width);
//! - output `i` is centred at `scale·(i + ½)` and reads inputs `xmin .. xmin + xsize`; the f64
//!   weights are normalised to sum 1, then quantised to int16 with the largest fixed-point
//!   precision (< 22 bits) at which the largest weight of the axis still fits;
//! - each output byte is `clamp((2^(p−1) + Σ pixel·weight) >> p, 0, 255)` in integer arithmetic;
//! - the horizontal pass runs first, its result is rounded to uint8, then the vertical pass; an
//!   axis whose size does not change is not resampled.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::Image;

/// Most int16 weights held at once per axis (2 MiB). An axis whose weights need more is
/// resampled in chunks of outputs: shrinking `n` inputs reads about `4n` weights whatever the
/// output size, so an 89-megapixel-wide strip would otherwise hold 3 GB of them.
const MAX_WEIGHTS: usize = 1 << 20;

/// The resampling filter: what torchvision's `BICUBIC` and `BILINEAR` modes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// Keys' cubic convolution, a = −0.5 (`_upsample_bicubic2d_aa`).
    Bicubic,
    /// The triangle (`_upsample_bilinear2d_aa`).
    Bilinear,
}

impl Filter {
    /// Half the filter's width at scale 1 (ATen's `interp_size / 2`).
    fn half_width(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Bilinear => 1.0,
        }
    }

    fn eval(self, x: f64) -> f64 {
        match self {
            Filter::Bicubic => cubic(x),
            Filter::Bilinear => triangle(x),
        }
    }
}

/// One axis's resampling kernel: geometry and the fixed-point precision shared by all outputs.
struct Kernel {
    filter: Filter,
    input: usize,
    output: usize,
    scale: f64,
    support: f64,
    invscale: f64,
    taps: usize,
    precision: u32,
}

/// Quantised weights of outputs `first ..` of one axis: output `first + i` reads `size[i]`
/// inputs from `start[i]` with weights `weights[i·taps ..]`.
struct Axis {
    first: usize,
    start: Vec<usize>,
    size: Vec<usize>,
    taps: usize,
    weights: Vec<i16>,
    precision: u32,
}

/// Keys' cubic convolution kernel with a = −0.5, written as ATen writes it.
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// The triangle kernel, as ATen's `HelperInterpLinear::aa_filter` writes it.
fn triangle(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 { 1.0 - x } else { 0.0 }
}

impl Kernel {
    fn new(filter: Filter, input: usize, output: usize) -> Self {
        let scale = input as f64 / output as f64;
        let half = filter.half_width();
        let support = if scale >= 1.0 { half * scale } else { half };
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let taps = support.ceil() as usize * 2 + 1;
        let mut k = Kernel {
            filter,
            input,
            output,
            scale,
            support,
            invscale,
            taps,
            precision: 0,
        };
        // The precision depends on the largest weight of the whole axis: one sweep finds it,
        // holding one output's weights at a time.
        let mut w = vec![0f64; taps];
        let wt_max = (0..output)
            .filter_map(|i| {
                let (_, n, normalised) = k.weights(i, &mut w);
                normalised.then(|| w[..n].iter().copied().fold(0f64, f64::max))
            })
            .fold(0f64, f64::max);
        while k.precision < 22 {
            let next = (0.5 + wt_max * (1u64 << (k.precision + 1)) as f64) as i64;
            if next >= 1 << 15 {
                break;
            }
            k.precision += 1;
        }
        k
    }

    /// Output `i`'s weights into `w[..xsize]`, normalised to sum 1 unless they sum to 0;
    /// returns `(xmin, xsize, normalised)`.
    fn weights(&self, i: usize, w: &mut [f64]) -> (usize, usize, bool) {
        let center = self.scale * (i as f64 + 0.5);
        // `as i64` truncates toward zero, like the C++ `static_cast<int64_t>`.
        let xmin = ((center - self.support + 0.5) as i64).max(0);
        let xsize = ((center + self.support + 0.5) as i64)
            .min(self.input as i64)
            .saturating_sub(xmin)
            .clamp(0, self.taps as i64) as usize;
        let xmin = xmin as usize;
        let mut total = 0f64;
        for (j, wj) in w.iter_mut().enumerate().take(xsize) {
            *wj = self
                .filter
                .eval(((j + xmin) as f64 - center + 0.5) * self.invscale);
            total += *wj;
        }
        if total != 0.0 {
            for wj in w.iter_mut().take(xsize) {
                *wj /= total;
            }
        }
        (xmin, xsize, total != 0.0)
    }

    /// Ranges of outputs whose weights fit in `max_weights` together.
    fn chunks(&self, max_weights: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let n = (max_weights / self.taps).max(1);
        (0..self.output)
            .step_by(n)
            .map(move |a| a..(a + n).min(self.output))
    }

    /// The quantised weights of `outputs`.
    fn axis(&self, outputs: std::ops::Range<usize>) -> Axis {
        let taps = self.taps;
        let mut start = Vec::with_capacity(outputs.len());
        let mut size = Vec::with_capacity(outputs.len());
        let mut weights = vec![0i16; outputs.len() * taps];
        let mut w = vec![0f64; taps];
        let unit = (1u64 << self.precision) as f64;
        for (i, q) in outputs.clone().zip(weights.chunks_exact_mut(taps)) {
            w.fill(0.0);
            let (xmin, xsize, _) = self.weights(i, &mut w);
            for (q, &w) in q.iter_mut().zip(&w) {
                let v = w * unit;
                *q = (if v < 0.0 { -0.5 + v } else { 0.5 + v }) as i32 as i16;
            }
            start.push(xmin);
            size.push(xsize);
        }
        Axis {
            first: outputs.start,
            start,
            size,
            taps,
            weights,
            precision: self.precision,
        }
    }
}

impl Axis {
    /// Start, size and weights of output `i` (an index of the whole axis).
    #[inline]
    fn at(&self, i: usize) -> (usize, &[i16]) {
        let j = i - self.first;
        (
            self.start[j],
            &self.weights[j * self.taps..j * self.taps + self.size[j]],
        )
    }
}

/// Bytes [`resize_aa`] allocates besides its input (either filter): the passes' outputs, the weights
/// of one chunk of each axis, and the vertical pass's accumulator rows.
pub fn resize_bytes(in_w: usize, in_h: usize, out_w: usize, out_h: usize) -> u64 {
    let (in_w, in_h, out_w, out_h) = (in_w as u64, in_h as u64, out_w as u64, out_h as u64);
    let mut bytes = 0;
    if out_w != in_w {
        bytes += in_h * out_w * 3 + 2 * MAX_WEIGHTS as u64;
    }
    if out_h != in_h {
        let threads = rayon::current_num_threads() as u64;
        bytes += out_h * out_w * 3 + 2 * MAX_WEIGHTS as u64 + threads * out_w * 3 * 4;
    }
    bytes
}

/// The fixed-point rounding offset `2^(p−1)` every sum starts from.
fn half(precision: u32) -> i32 {
    1 << (precision.max(1) - 1)
}

/// `clamp(acc >> p, 0, 255)`: one output byte from its fixed-point sum.
#[inline]
fn finish(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Resize to `out_w × out_h` exactly as torchvision's antialiased resize of a uint8 image with
/// `filter` does. Returns a copy when the size is unchanged (the reference skips the resize).
///
/// Integer sums are exact, so the loops are ordered for speed: the horizontal pass sums the
/// three channels of a pixel together, the vertical pass adds whole source rows into a row of
/// accumulators (contiguous, vectorised), rows in parallel.
pub fn resize_aa(img: &Image, out_w: usize, out_h: usize, filter: Filter) -> Result<Image> {
    resize_chunked(img, out_w, out_h, filter, MAX_WEIGHTS)
}

/// [`resize_aa`] with the bicubic filter (torchvision `BICUBIC`, antialiased).
pub fn resize_bicubic_aa(img: &Image, out_w: usize, out_h: usize) -> Result<Image> {
    resize_aa(img, out_w, out_h, Filter::Bicubic)
}

/// [`resize_aa`] with the triangle filter (torchvision `BILINEAR`, antialiased).
pub fn resize_bilinear_aa(img: &Image, out_w: usize, out_h: usize) -> Result<Image> {
    resize_aa(img, out_w, out_h, Filter::Bilinear)
}

/// [`resize_aa`] holding at most `max_weights` weights of an axis at a time.
fn resize_chunked(
    img: &Image,
    out_w: usize,
    out_h: usize,
    filter: Filter,
    max_weights: usize,
) -> Result<Image> {
    if out_w == 0 || out_h == 0 {
        return Err(Error::input(format!("cannot resize to {out_w}×{out_h}")));
    }
    let (in_w, in_h) = (img.width(), img.height());
    // The source is read in place; only the passes' outputs are allocated.
    let mut rgb = std::borrow::Cow::Borrowed(img.rgb());
    let mut w = in_w;
    if out_w != in_w {
        let kernel = Kernel::new(filter, in_w, out_w);
        let mut out = vec![0u8; in_h * out_w * 3];
        for xs in kernel.chunks(max_weights) {
            let ax = kernel.axis(xs.clone());
            rgb.par_chunks_exact(w * 3)
                .zip(out.par_chunks_exact_mut(out_w * 3))
                .for_each(|(src, dst)| {
                    let dst = &mut dst[xs.start * 3..xs.end * 3];
                    let outputs = ax.start.iter().zip(&ax.size);
                    for ((d, (&start, &size)), k) in dst
                        .chunks_exact_mut(3)
                        .zip(outputs)
                        .zip(ax.weights.chunks_exact(ax.taps))
                    {
                        let k = &k[..size];
                        let px = &src[start * 3..(start + size) * 3];
                        let mut acc = [half(ax.precision); 3];
                        for (p, &k) in px.chunks_exact(3).zip(k) {
                            for c in 0..3 {
                                acc[c] += p[c] as i32 * k as i32;
                            }
                        }
                        for c in 0..3 {
                            d[c] = finish(acc[c], ax.precision);
                        }
                    }
                });
        }
        rgb = out.into();
        w = out_w;
    }
    if out_h != in_h {
        let kernel = Kernel::new(filter, in_h, out_h);
        let row = w * 3;
        let mut out = vec![0u8; out_h * row];
        for ys in kernel.chunks(max_weights) {
            let ax = kernel.axis(ys.clone());
            out[ys.start * row..ys.end * row]
                .par_chunks_exact_mut(row)
                .zip(ys)
                .for_each_init(
                    || vec![0i32; row],
                    |acc, (dst, y)| {
                        acc.fill(half(ax.precision));
                        let (start, k) = ax.at(y);
                        for (t, &k) in k.iter().enumerate() {
                            let r = start + t;
                            for (a, &s) in acc.iter_mut().zip(&rgb[r * row..(r + 1) * row]) {
                                *a += s as i32 * k as i32;
                            }
                        }
                        for (d, &a) in dst.iter_mut().zip(acc.iter()) {
                            *d = finish(a, ax.precision);
                        }
                    },
                );
        }
        rgb = out.into();
    }
    Image::from_rgb8(w, out_h, rgb.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILTERS: [Filter; 2] = [Filter::Bicubic, Filter::Bilinear];

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for filter in FILTERS {
            for &(i, o) in &[(7, 48), (301, 96), (48, 48), (1000, 3), (3, 1000)] {
                let kernel = Kernel::new(filter, i, o);
                let ax = kernel.axis(0..o);
                assert!(ax.precision > 8 && ax.precision <= 22, "{filter:?} {i}→{o}");
                for x in 0..o {
                    let s: i32 = ax.at(x).1.iter().map(|&w| w as i32).sum();
                    let unit = 1i32 << ax.precision;
                    assert!(
                        (s - unit).abs() <= ax.taps as i32,
                        "{filter:?} {i}→{o} at {x}: {s} vs {unit}"
                    );
                }
            }
        }
    }

    #[test]
    fn resampling_in_chunks_gives_the_same_bytes() {
        let (w, h) = (97, 61);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
        let img = Image::from_rgb8(w, h, rgb).unwrap();
        for filter in FILTERS {
            for &(ow, oh) in &[(24, 48), (300, 7), (97, 200), (5, 61)] {
                let whole = resize_aa(&img, ow, oh, filter).unwrap();
                for max in [1, 50, 333] {
                    assert_eq!(
                        resize_chunked(&img, ow, oh, filter, max).unwrap(),
                        whole,
                        "{filter:?} {ow}×{oh}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_very_wide_strip_holds_bounded_weights() {
        // 4,000,000 → 480 columns: about 33,000 taps per output, 16 M weights for the axis.
        let kernel = Kernel::new(Filter::Bicubic, 4_000_000, 480);
        assert!(kernel.taps * 480 > 8 * MAX_WEIGHTS);
        let chunks: Vec<_> = kernel.chunks(MAX_WEIGHTS).collect();
        assert!(chunks.len() > 8);
        for c in chunks {
            assert!(kernel.axis(c).weights.len() <= MAX_WEIGHTS);
        }
        let img = Image::from_rgb8(4_000_000, 1, vec![200; 12_000_000]).unwrap();
        let r = resize_bicubic_aa(&img, 480, 48).unwrap();
        assert!(r.rgb().iter().all(|&v| v == 200));
        assert!(resize_bytes(4_000_000, 1, 480, 48) < 16 << 20);
    }

    #[test]
    fn a_constant_image_stays_constant() {
        let img = Image::from_rgb8(13, 9, [17u8, 128, 250].repeat(13 * 9)).unwrap();
        for filter in FILTERS {
            for &(w, h) in &[(48, 96), (5, 4), (13, 30)] {
                let r = resize_aa(&img, w, h, filter).unwrap();
                assert_eq!((r.width(), r.height()), (w, h));
                assert!(r.rgb().chunks(3).all(|p| p == [17, 128, 250]));
            }
        }
    }

    #[test]
    fn bilinear_enlarging_is_plain_bilinear_with_half_pixel_centres() {
        // 2 → 4 columns: centres 0.25, 0.75, 1.25, 1.75 (clamped at the edges), weights ¾/¼.
        let img = Image::from_rgb8(2, 1, vec![0, 40, 200, 200, 120, 0]).unwrap();
        let r = resize_bilinear_aa(&img, 4, 1).unwrap();
        assert_eq!(
            r.rgb(),
            &[0, 40, 200, 50, 60, 150, 150, 100, 50, 200, 120, 0]
        );
    }
}
