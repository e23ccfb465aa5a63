//! torch's uint8 antialiased bicubic resize, byte for byte.
//!
//! The reference resizes with torchvision's `resize(uint8 image, antialias=True, BICUBIC)`, which
//! on the CPU runs torch's `_upsample_bicubic2d_aa` on the uint8 tensor itself (ATen
//! `UpSampleKernel.cpp`, the int16-weight path shared with its AVX2 kernels). Its arithmetic:
//!
//! - per axis, `scale = in / out` (f64); the Keys cubic (a = −0.5) is stretched by `scale` when
//!   shrinking (support `2·scale`), not when enlarging (support 2);
//! - output `i` is centred at `scale·(i + ½)` and reads inputs `xmin .. xmin + xsize`; the f64
//!   weights are normalised to sum 1, then quantised to int16 with the largest fixed-point
//!   precision (< 22 bits) at which the largest weight of the axis still fits;
//! - each output byte is `clamp((2^(p−1) + Σ pixel·weight) >> p, 0, 255)` in integer arithmetic;
//! - the horizontal pass runs first, its result is rounded to uint8, then the vertical pass; an
//!   axis whose size does not change is not resampled.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::Image;

/// Quantised weights of one axis: output `i` reads `size[i]` inputs from `start[i]` with
/// weights `weights[i·taps ..]`.
struct Axis {
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

fn axis(input: usize, output: usize) -> Axis {
    let scale = input as f64 / output as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let taps = support.ceil() as usize * 2 + 1;
    let mut start = Vec::with_capacity(output);
    let mut size = Vec::with_capacity(output);
    let mut wf = vec![0f64; output * taps];
    let mut wt_max = 0f64;
    for i in 0..output {
        let center = scale * (i as f64 + 0.5);
        // `as i64` truncates toward zero, like the C++ `static_cast<int64_t>`.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xsize = ((center + support + 0.5) as i64)
            .min(input as i64)
            .saturating_sub(xmin)
            .clamp(0, taps as i64) as usize;
        let xmin = xmin as usize;
        let w = &mut wf[i * taps..(i + 1) * taps];
        let mut total = 0f64;
        for (j, wj) in w.iter_mut().enumerate().take(xsize) {
            *wj = cubic(((j + xmin) as f64 - center + 0.5) * invscale);
            total += *wj;
        }
        if total != 0.0 {
            for wj in w.iter_mut().take(xsize) {
                *wj /= total;
                wt_max = wt_max.max(*wj);
            }
        }
        start.push(xmin);
        size.push(xsize);
    }
    let mut precision = 0u32;
    while precision < 22 {
        let next = (0.5 + wt_max * (1u64 << (precision + 1)) as f64) as i64;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let unit = (1u64 << precision) as f64;
    let weights = wf
        .iter()
        .map(|&w| {
            let v = w * unit;
            (if v < 0.0 { -0.5 + v } else { 0.5 + v }) as i32 as i16
        })
        .collect();
    Axis {
        start,
        size,
        taps,
        weights,
        precision,
    }
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

/// Resize to `out_w × out_h` exactly as torchvision's antialiased bicubic resize of a uint8
/// image does. Returns a copy when the size is unchanged (the reference skips the resize).
///
/// Integer sums are exact, so the loops are ordered for speed: the horizontal pass sums the
/// three channels of a pixel together, the vertical pass adds whole source rows into a row of
/// accumulators (contiguous, vectorised), rows in parallel.
pub fn resize_bicubic_aa(img: &Image, out_w: usize, out_h: usize) -> Result<Image> {
    if out_w == 0 || out_h == 0 {
        return Err(Error::input(format!("cannot resize to {out_w}×{out_h}")));
    }
    let (in_w, in_h) = (img.width(), img.height());
    // The source is read in place; only the passes' outputs are allocated.
    let mut rgb = std::borrow::Cow::Borrowed(img.rgb());
    let mut w = in_w;
    if out_w != in_w {
        let ax = axis(in_w, out_w);
        let mut out = vec![0u8; in_h * out_w * 3];
        rgb.par_chunks_exact(w * 3)
            .zip(out.par_chunks_exact_mut(out_w * 3))
            .for_each(|(src, dst)| {
                for (x, d) in dst.chunks_exact_mut(3).enumerate() {
                    let k = &ax.weights[x * ax.taps..x * ax.taps + ax.size[x]];
                    let px = &src[ax.start[x] * 3..(ax.start[x] + ax.size[x]) * 3];
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
        rgb = out.into();
        w = out_w;
    }
    if out_h != in_h {
        let ax = axis(in_h, out_h);
        let row = w * 3;
        let mut out = vec![0u8; out_h * row];
        out.par_chunks_exact_mut(row).enumerate().for_each_init(
            || vec![0i32; row],
            |acc, (y, dst)| {
                acc.fill(half(ax.precision));
                let k = &ax.weights[y * ax.taps..y * ax.taps + ax.size[y]];
                for (t, &k) in k.iter().enumerate() {
                    let r = ax.start[y] + t;
                    for (a, &s) in acc.iter_mut().zip(&rgb[r * row..(r + 1) * row]) {
                        *a += s as i32 * k as i32;
                    }
                }
                for (d, &a) in dst.iter_mut().zip(acc.iter()) {
                    *d = finish(a, ax.precision);
                }
            },
        );
        rgb = out.into();
    }
    Image::from_rgb8(w, out_h, rgb.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for &(i, o) in &[(7, 48), (301, 96), (48, 48), (1000, 3), (3, 1000)] {
            let ax = axis(i, o);
            assert!(ax.precision > 8 && ax.precision <= 22, "{i}→{o}");
            for x in 0..o {
                let s: i32 = ax.weights[x * ax.taps..x * ax.taps + ax.size[x]]
                    .iter()
                    .map(|&w| w as i32)
                    .sum();
                let unit = 1i32 << ax.precision;
                assert!(
                    (s - unit).abs() <= ax.taps as i32,
                    "{i}→{o} at {x}: {s} vs {unit}"
                );
            }
        }
    }

    #[test]
    fn a_constant_image_stays_constant() {
        let img = Image::from_rgb8(13, 9, [17u8, 128, 250].repeat(13 * 9)).unwrap();
        for &(w, h) in &[(48, 96), (5, 4), (13, 30)] {
            let r = resize_bicubic_aa(&img, w, h).unwrap();
            assert_eq!((r.width(), r.height()), (w, h));
            assert!(r.rgb().chunks(3).all(|p| p == [17, 128, 250]));
        }
    }
}
