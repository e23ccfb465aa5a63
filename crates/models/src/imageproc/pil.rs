//! Pillow's `Image.resize` with the Lanczos filter on 8-bit RGBA, and `paste` over white, byte for
//! byte as Pillow 13.0.0 computes them (what diffusers' `VaeImageProcessor.resize` runs on a PIL
//! image). Checked against Pillow on the fixtures of `tools/fixtures/qwen_image_condition.py`.
//!
//! - An image already at the target size is copied untouched (Pillow returns a copy, so its
//!   transparent pixels keep their colours); otherwise RGBA is converted to premultiplied `RGBa`
//!   (`c·a/255` rounded: `t = c·a + 128`, `(t + (t >> 8)) >> 8`), resampled, and converted back
//!   (`min(255, ⌊255·c / a⌋)`, colours kept where `a` is 0 or 255).
//! - Each axis whose size changes is resampled on its own: per output `i`, centre
//!   `(i + ½)·in/out`; the Lanczos-3 window (`sinc(x)·sinc(x/3)` for `−3 ≤ x < 3`) stretched by
//!   `max(in/out, 1)`, over inputs `⌊centre − support + ½⌋ .. ⌊centre + support + ½⌋` (clamped);
//!   f64 weights normalised to sum 1, then rounded half away from zero to 22 fraction bits; each
//!   output byte is `clamp(⌊(2²¹ + Σ pixel·weight) / 2²²⌋, 0, 255)`.
//! - The horizontal pass runs first and the vertical pass reads its bytes, except that Pillow 13
//!   runs the vertical pass first when the height shrinks by more than twice as many pixels as the
//!   width (`H − h > 0` and `H − h > 2·(W − w)`; older Pillow always went horizontal first).
//! - `paste(image, mask=alpha)` onto opaque white blends each colour `c` with alpha `a` as
//!   `t = 255·(255 − a) + c·a + 128`, `(t + (t >> 8)) >> 8`.
//!
//! Memory: a pass holds its output and `out · window` weights, the window being at most
//! `2·⌈3·in/out⌉ + 1` taps, so about six weights per input pixel of the axis.

use rayon::prelude::*;
use tessera_core::{Error, Result};

/// Fraction bits of the fixed-point weights (Pillow's `PRECISION_BITS`, `32 − 8 − 2`).
const PRECISION: u32 = 22;

/// Lanczos-3's half width.
const SUPPORT: f64 = 3.0;

/// An 8-bit RGBA image, row-major `[height, width, 4]`, alpha straight (not premultiplied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgba8 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl Rgba8 {
    /// Wrap RGBA bytes, checking their count.
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Result<Self> {
        let want = width.checked_mul(height).and_then(|p| p.checked_mul(4));
        if width == 0 || height == 0 || want != Some(data.len()) {
            return Err(Error::input(format!(
                "an RGBA image of {width}×{height} pixels needs {} bytes, got {}",
                want.map_or("too many".to_string(), |n| n.to_string()),
                data.len()
            )));
        }
        Ok(Rgba8 {
            width,
            height,
            data,
        })
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

fn lanczos(x: f64) -> f64 {
    if (-SUPPORT..SUPPORT).contains(&x) {
        sinc(x) * sinc(x / SUPPORT)
    } else {
        0.0
    }
}

/// One axis's fixed-point weights: output `i` reads `count[i]` inputs from `first[i]` with
/// weights `weights[i·taps ..]`.
struct Axis {
    first: Vec<usize>,
    count: Vec<usize>,
    taps: usize,
    weights: Vec<i32>,
}

impl Axis {
    fn new(input: usize, output: usize) -> Self {
        let scale = input as f64 / output as f64;
        let filterscale = scale.max(1.0);
        let support = SUPPORT * filterscale;
        let taps = support.ceil() as usize * 2 + 1;
        let (mut first, mut count) = (Vec::with_capacity(output), Vec::with_capacity(output));
        let mut weights = vec![0i32; output * taps];
        let mut k = vec![0f64; taps];
        for (i, row) in weights.chunks_exact_mut(taps).enumerate() {
            let center = (i as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; a negative start is clamped to 0 anyway.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let n = hi.saturating_sub(lo).min(taps);
            let mut total = 0.0;
            for (x, w) in k[..n].iter_mut().enumerate() {
                *w = lanczos((x as f64 + lo as f64 - center + 0.5) / filterscale);
                total += *w;
            }
            for (w, q) in k[..n].iter_mut().zip(row.iter_mut()) {
                if total != 0.0 {
                    *w /= total;
                }
                let v = *w * (1u32 << PRECISION) as f64;
                *q = if v < 0.0 {
                    (v - 0.5) as i32
                } else {
                    (v + 0.5) as i32
                };
            }
            first.push(lo);
            count.push(n);
        }
        Axis {
            first,
            count,
            taps,
            weights,
        }
    }
}

/// Pillow's `clip8`: the accumulator's integer part, clamped to a byte.
#[inline]
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION).clamp(0, 255) as u8
}

/// Resample the rows of a `w × h × 4` image to `out_w` columns.
fn horizontal(src: &[u8], w: usize, out_w: usize) -> Vec<u8> {
    let axis = Axis::new(w, out_w);
    let mut out = vec![0u8; src.len() / w * out_w];
    out.par_chunks_mut(out_w * 4)
        .zip(src.par_chunks(w * 4))
        .for_each(|(orow, irow)| {
            for (i, px) in orow.chunks_exact_mut(4).enumerate() {
                let k = &axis.weights[i * axis.taps..i * axis.taps + axis.count[i]];
                let mut acc = [1i64 << (PRECISION - 1); 4];
                for (j, &wt) in k.iter().enumerate() {
                    let p = &irow[(axis.first[i] + j) * 4..][..4];
                    for c in 0..4 {
                        acc[c] += p[c] as i64 * wt as i64;
                    }
                }
                for c in 0..4 {
                    px[c] = clip8(acc[c]);
                }
            }
        });
    out
}

/// Resample the columns of a `w × h × 4` image to `out_h` rows.
fn vertical(src: &[u8], w: usize, h: usize, out_h: usize) -> Vec<u8> {
    let axis = Axis::new(h, out_h);
    let row = w * 4;
    let mut out = vec![0u8; out_h * row];
    out.par_chunks_mut(row).enumerate().for_each(|(i, orow)| {
        let k = &axis.weights[i * axis.taps..i * axis.taps + axis.count[i]];
        for (x, o) in orow.iter_mut().enumerate() {
            let mut acc = 1i64 << (PRECISION - 1);
            for (j, &wt) in k.iter().enumerate() {
                acc += src[(axis.first[i] + j) * row + x] as i64 * wt as i64;
            }
            *o = clip8(acc);
        }
    });
    out
}

/// RGBA → Pillow's premultiplied `RGBa`.
fn premultiply(data: &mut [u8]) {
    for p in data.chunks_exact_mut(4) {
        let a = p[3] as u32;
        for c in &mut p[..3] {
            let t = *c as u32 * a + 128;
            *c = ((t + (t >> 8)) >> 8) as u8;
        }
    }
}

/// Pillow's `RGBa` → RGBA.
fn unpremultiply(data: &mut [u8]) {
    for p in data.chunks_exact_mut(4) {
        let a = p[3] as u32;
        if a != 0 && a != 255 {
            for c in &mut p[..3] {
                *c = (255 * *c as u32 / a).min(255) as u8;
            }
        }
    }
}

/// `img.resize((out_w, out_h), Image.LANCZOS)` on an RGBA image, as Pillow 13 computes it.
pub fn resize_lanczos(img: &Rgba8, out_w: usize, out_h: usize) -> Result<Rgba8> {
    if out_w == 0 || out_h == 0 {
        return Err(Error::input(format!(
            "cannot resize a {}×{} image to {out_w}×{out_h}",
            img.width, img.height
        )));
    }
    let (w, h) = (img.width, img.height);
    if (w, h) == (out_w, out_h) {
        return Ok(img.clone());
    }
    let mut data = img.data.clone();
    premultiply(&mut data);
    let shrink_h = h as i64 - out_h as i64;
    let vertical_first = shrink_h > 0 && shrink_h > 2 * (w as i64 - out_w as i64);
    if vertical_first {
        if out_h != h {
            data = vertical(&data, w, h, out_h);
        }
        if out_w != w {
            data = horizontal(&data, w, out_w);
        }
    } else {
        if out_w != w {
            data = horizontal(&data, w, out_w);
        }
        if out_h != h {
            data = vertical(&data, out_w, h, out_h);
        }
    }
    unpremultiply(&mut data);
    Rgba8::new(out_w, out_h, data)
}

/// `Image.new("RGB", size, white).paste(img, mask=img.getchannel("A"))`: RGB bytes
/// `[height, width, 3]`.
pub fn paste_over_white(img: &Rgba8) -> Vec<u8> {
    img.data
        .chunks_exact(4)
        .flat_map(|p| {
            let a = p[3] as u32;
            [p[0], p[1], p[2]].map(|c| {
                let t = 255 * (255 - a) + c as u32 * a + 128;
                ((t + (t >> 8)) >> 8) as u8
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for &(i, o) in &[(37, 64), (203, 160), (300, 256), (7, 300), (1000, 3)] {
            let a = Axis::new(i, o);
            for r in 0..o {
                let s: i64 = a.weights[r * a.taps..r * a.taps + a.count[r]]
                    .iter()
                    .map(|&w| w as i64)
                    .sum();
                assert!(
                    (s - (1 << PRECISION)).abs() <= a.count[r] as i64,
                    "{i}→{o}: {s}"
                );
                assert!(a.first[r] + a.count[r] <= i);
            }
        }
    }

    #[test]
    fn a_constant_opaque_image_stays_constant() {
        let img = Rgba8::new(13, 29, [10, 200, 77, 255].repeat(13 * 29)).unwrap();
        for (w, h) in [(32, 64), (5, 7), (13, 3), (40, 29)] {
            let out = resize_lanczos(&img, w, h).unwrap();
            assert!(out.data.chunks_exact(4).all(|p| p == [10, 200, 77, 255]));
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(Rgba8::new(2, 2, vec![0; 15]).is_err());
        assert!(Rgba8::new(0, 2, vec![]).is_err());
        let img = Rgba8::new(2, 2, vec![0; 16]).unwrap();
        assert!(resize_lanczos(&img, 0, 4).is_err());
    }
}
