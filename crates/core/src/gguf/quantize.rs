//! Quantizers: `f32` values to ggml blocks, rounding exactly as llama.cpp's reference quantizers
//! (`quantize_row_*_ref` in ggml-quants.c, which the `gguf` Python package's numpy quantizers
//! reproduce bit for bit): what `--quantize` makes of a checkpoint's matrices at load.
//!
//! Every step is the reference's `f32` arithmetic in its order (no fused multiply-add, as the
//! reference compiles for x86-64 without `-mfma`), so the bytes equal the reference's for finite
//! input. Q4_K and Q6_K are the reference's search for the best sub-block scales without an
//! importance matrix (`quantize_row_q4_K_ref`, `quantize_row_q6_K_ref`).

use half::f16;

mod lanes;

use super::GgmlType;
use super::k_quants::{Q4_K_BLOCK, Q6_K_BLOCK, scale_min};

/// Quantize `x` into `out` as blocks of `t`: `x` must be a whole number of blocks and `out` hold
/// exactly their bytes. Fails (with a message for the caller to put a tensor's name to) on a
/// type without a quantizer or a length that is not whole blocks.
pub fn quantize(t: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), String> {
    if t.bytes_for(x.len()) != Some(out.len()) {
        return Err(format!(
            "{} values do not fill whole {t} blocks of {} (or {} bytes do not hold them)",
            x.len(),
            t.block_size(),
            out.len()
        ));
    }
    let blocks = x
        .chunks_exact(t.block_size())
        .zip(out.chunks_exact_mut(t.block_bytes()));
    match t {
        GgmlType::Q8_0 => blocks.for_each(|(x, b)| q8_0(x, b)),
        GgmlType::Q4_0 => blocks.for_each(|(x, b)| q4_0(x, b)),
        GgmlType::Q4_K => lanes::q4_k(x, out),
        GgmlType::Q6_K => lanes::q6_k(x, out),
        _ => {
            return Err(format!(
                "no quantizer for {t}: Tessera quantizes to Q8_0, Q4_0, Q4_K and Q6_K"
            ));
        }
    }
    Ok(())
}

/// `1 / d`, or 0 for a zero scale (an all-zero block), as the reference writes it.
fn inverse(d: f32) -> f32 {
    if d == 0.0 { 0.0 } else { 1.0 / d }
}

/// Q8_0: `d = max|x| / 127`, `q = round(x / d)` (halves away from zero, C's `roundf`).
fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, &v) in b[2..].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}

/// Q4_0: `d = −m / 8` for `m` the value of largest magnitude (the first, on ties), and
/// `q = min(15, trunc(x / d + 8.5))`; element `j` in the low nibble of byte `j`, `j + 16` in
/// the high one.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = inverse(d);
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as i8).clamp(0, 15) as u8;
    let (lo, hi) = x.split_at(x.len() / 2);
    for ((o, &l), &h) in b[2..].iter_mut().zip(lo).zip(hi) {
        *o = q(l) | (q(h) << 4);
    }
}

/// Round to nearest, ties to even, as ggml's `nearest_int` does it: adding 1.5·2²³ leaves the
/// rounded integer in the low mantissa bits (exact for |v| ≤ 2²² − 1, which the callers' ratios
/// are for finite input).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// The reference's `make_qkx2_quants` for Q4_K: levels `0..=nmax` with a scale and a min (an
/// offset ≤ 0) for the sub-block `x`, searching 21 trial scales for the least `weights`-weighted
/// squared error. Writes the levels to `l`; returns `(scale, −min)`.
#[cfg(test)]
fn scale_and_min(x: &[f32], weights: &[f32], l: &mut [u8], nmax: i32) -> (f32, f32) {
    const RMIN: f32 = -1.0;
    const RDELTA: f32 = 0.1;
    const NSTEP: i32 = 20;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let level = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for ((q, &v), &w) in l.iter_mut().zip(x).zip(weights) {
        *q = level(iscale, v, min) as u8;
        let diff = scale * f32::from(*q) + min - v;
        best_error += w * (diff * diff);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..x.len()];
    for is in 0..=NSTEP {
        iscale = (RMIN + RDELTA * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((q, &v), &w) in aux.iter_mut().zip(x).zip(weights) {
            let lv = level(iscale, v, min);
            *q = lv as u8;
            let lf = lv as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * v;
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for ((&q, &v), &w) in aux.iter().zip(x).zip(weights) {
                let diff = this_scale * f32::from(q) + this_min - v;
                cur_error += w * (diff * diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K, one sub-block at a time: per sub-block of 32 a scale and a min by [`scale_and_min`]
/// (weighted by the sub-block's RMS plus each |x|), then [`q4_k_finish`]. The reference the
/// lane-parallel search ([`lanes::q4_k`]) is checked against.
#[cfg(test)]
fn q4_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0u8; Q4_K_BLOCK];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for (j, (xs, ls)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
        let sum_x2 = xs.iter().fold(0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        (scales[j], mins[j]) = scale_and_min(xs, &weights, ls, 15);
    }
    q4_k_finish(x, &mut l, &scales, &mins, b);
}

/// Q4_K's second half for one super-block, given each sub-block's searched levels `l`, scale
/// and (negated) min: both quantized to 6 bits against the super-block's f16 `d` and `dmin`,
/// the levels recomputed against the rounded scales, and the block packed.
fn q4_k_finish(
    x: &[f32],
    l: &mut [u8; Q4_K_BLOCK],
    scales: &[f32; 8],
    mins: &[f32; 8],
    b: &mut [u8],
) {
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (&scale, &min) in scales.iter().zip(mins) {
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    b[..2].copy_from_slice(&d.to_le_bytes());
    b[2..4].copy_from_slice(&dmin.to_le_bytes());
    let (sc, qs) = b[4..].split_at_mut(12);
    sc.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    for (j, (xs, ls)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
        let (s, m) = scale_min(sc, j);
        let dj = d.to_f32() * f32::from(s);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * f32::from(m);
        for (q, &v) in ls.iter_mut().zip(xs) {
            *q = nearest_int((v + dm) / dj).clamp(0, 15) as u8;
        }
    }
    // Each 32 bytes hold two sub-blocks: the first in the low nibbles, the next in the high.
    for (run, pair) in qs.chunks_exact_mut(32).zip(l.chunks_exact(64)) {
        for (i, o) in run.iter_mut().enumerate() {
            *o = pair[i] | (pair[i + 32] << 4);
        }
    }
}

/// The reference's `make_qx_quants` for Q6_K (squared-value weights, no importance matrix):
/// the scale of the signed levels `−nmax..nmax` (stored `+ nmax` in `l`) for sub-block `x`,
/// the best of 19 trial scales by weighted least squares.
#[cfg(test)]
fn signed_scale(x: &[f32], l: &mut [u8], nmax: i32) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0f32, 0f32), |(sumlx, suml2), &v| {
            let lf = level(iscale, v) as f32;
            let w = v * v;
            (sumlx + w * v * lf, suml2 + w * lf * lf)
        })
    };
    let mut iscale = -(nmax as f32) / max;
    for (q, &v) in l.iter_mut().zip(x) {
        *q = (level(iscale, v) + nmax) as u8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K, one sub-block at a time: per sub-block of 16 a signed scale by [`signed_scale`], then
/// [`q6_k_finish`]. The reference the lane-parallel search ([`lanes::q6_k`]) is checked against.
#[cfg(test)]
fn q6_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0u8; Q6_K_BLOCK];
    let mut scales = [0f32; 16];
    for (ib, (xs, ls)) in x.chunks_exact(16).zip(l.chunks_exact_mut(16)).enumerate() {
        scales[ib] = signed_scale(xs, ls, 32);
    }
    q6_k_finish(x, &mut l, &scales, b);
}

/// Q6_K's second half for one super-block, given each sub-block's searched levels `l` and
/// signed scale: the scales quantized to int8 against the super-block's f16 `d` (the largest in
/// magnitude to −128), the 6-bit levels recomputed against the rounded scales, and the block
/// packed.
#[inline(always)]
fn q6_k_finish(x: &[f32], l: &mut [u8; Q6_K_BLOCK], scales: &[f32; 16], b: &mut [u8]) {
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for &scale in scales {
        if scale.abs() > max_abs {
            max_abs = scale.abs();
            max_scale = scale;
        }
    }
    b.fill(0);
    if max_abs < 1e-15 {
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let (ql, rest) = b.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (sc, db) = rest.split_at_mut(16);
    db.copy_from_slice(&d.to_le_bytes());
    for (s, &scale) in sc.iter_mut().zip(scales) {
        *s = nearest_int(iscale * scale).min(127) as i8 as u8;
    }
    for (j, (xs, ls)) in x.chunks_exact(16).zip(l.chunks_exact_mut(16)).enumerate() {
        let dj = d.to_f32() * f32::from(sc[j] as i8);
        if dj == 0.0 {
            continue;
        }
        for (q, &v) in ls.iter_mut().zip(xs) {
            *q = (nearest_int(v / dj).clamp(-32, 31) + 32) as u8;
        }
    }
    // Per half of 128: low nibbles of values 0..32 and 64..96 share `ql` bytes 0..32, those of
    // 32..64 and 96..128 bytes 32..64; the top two bits of the four quarters fill `qh`.
    for ((ql, qh), l) in ql
        .chunks_exact_mut(64)
        .zip(qh.chunks_exact_mut(32))
        .zip(l.chunks_exact(128))
    {
        for i in 0..32 {
            let [a, b, c, e] = [l[i], l[i + 32], l[i + 64], l[i + 96]];
            ql[i] = (a & 0x0f) | ((c & 0x0f) << 4);
            ql[i + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
            qh[i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::k_quants::{Q4_K_BYTES, Q6_K_BYTES};

    /// Quantizing what a block decodes to gives the block back (the values are on its grid).
    #[test]
    fn decoded_blocks_quantize_to_themselves() {
        for t in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let x: Vec<f32> = (0..64)
                .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.1)
                .collect();
            let mut b = vec![0u8; t.bytes_for(64).unwrap()];
            quantize(t, &x, &mut b).unwrap();
            let mut y = vec![0f32; 64];
            t.dequantize(&b, &mut y).unwrap();
            let mut again = vec![0u8; b.len()];
            quantize(t, &y, &mut again).unwrap();
            assert_eq!(b, again, "{t}");
        }
        assert!(quantize(GgmlType::Q8_0, &[0.0; 33], &mut [0; 34]).is_err());
        assert!(quantize(GgmlType::F16, &[0.0; 2], &mut [0; 4]).is_err());
    }

    /// xorshift64*: a seeded stream, so a failure names a reproducible case.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// 16 values of one of many kinds: uniform and bell-shaped at magnitudes from subnormal to
    /// near `f32::MAX`, one-signed, coarse grids full of rounding ties, constants (zero among
    /// them), sparse spikes, raw subnormals, and (with `non_finite`) NaN and infinities.
    fn run(rng: &mut Rng, non_finite: bool, out: &mut Vec<f32>) {
        const SCALES: [f32; 9] = [1e-40, 1e-30, 1e-8, 1e-3, 1.0, 7.5, 1e4, 1e20, 3e37];
        let scale = SCALES[rng.below(SCALES.len() as u64) as usize];
        let kind = rng.below(if non_finite { 10 } else { 9 });
        let c = rng.unit() * scale;
        for _ in 0..16 {
            let v = match kind {
                0 => rng.unit() * scale,
                1 => (rng.unit() + rng.unit() + rng.unit()) * scale,
                2 => rng.unit().abs() * scale,
                3 => -rng.unit().abs() * scale,
                4 => (rng.unit() * 8.0).round() * 0.5 * scale,
                5 => c,
                6 => 0.0,
                7 => {
                    if rng.below(8) == 0 {
                        rng.unit() * scale
                    } else {
                        0.0
                    }
                }
                8 => f32::from_bits(rng.next() as u32 & 0x807f_ffff),
                _ => [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0][rng.below(4) as usize],
            };
            out.push(v);
        }
    }

    /// Rows of 1 to 5 super-blocks, each sub-block of 16 its own kind of values ([`run`]) or a
    /// whole super-block of one kind, so the lanes of one search meet different cases at once.
    fn random_rows(seed: u64, rows: usize, non_finite: bool) -> Vec<Vec<f32>> {
        let mut rng = Rng(seed);
        (0..rows)
            .map(|_| {
                let blocks = 1 + rng.below(5) as usize;
                let mut x = Vec::with_capacity(blocks * 256);
                for _ in 0..blocks {
                    if rng.below(4) == 0 {
                        let mut one = Vec::new();
                        run(&mut rng, non_finite, &mut one);
                        let state = rng.0;
                        for _ in 0..16 {
                            rng.0 = state;
                            one.clear();
                            run(&mut rng, non_finite, &mut one);
                            x.extend_from_slice(&one);
                        }
                    } else {
                        for _ in 0..16 {
                            run(&mut rng, non_finite, &mut x);
                        }
                    }
                }
                x
            })
            .collect()
    }

    /// The lane-parallel Q4_K and Q6_K searches (as `quantize` dispatches them, and every
    /// build of them this CPU runs: portable, AVX2, AVX-512) write the one-sub-block-at-a-time
    /// reference's bytes on every row, non-finite values included.
    #[test]
    fn lane_searches_equal_the_scalar_reference() {
        let variants = lanes::variants();
        for seed in 1..=40u64 {
            let non_finite = seed % 4 == 0;
            for (r, x) in random_rows(seed, 50, non_finite).iter().enumerate() {
                for (t, reference) in [
                    (GgmlType::Q4_K, q4_k as fn(&[f32], &mut [u8])),
                    (GgmlType::Q6_K, q6_k),
                ] {
                    let mut want = vec![0u8; t.bytes_for(x.len()).unwrap()];
                    for (xb, b) in x
                        .chunks_exact(256)
                        .zip(want.chunks_exact_mut(t.block_bytes()))
                    {
                        reference(xb, b);
                    }
                    let mut got = vec![0u8; want.len()];
                    quantize(t, x, &mut got).unwrap();
                    assert!(got == want, "{t}: seed {seed} row {r}: {x:?}");
                    for &(name, q4, q6) in &variants {
                        got.fill(0);
                        (if t == GgmlType::Q4_K { q4 } else { q6 })(x, &mut got);
                        assert!(got == want, "{t} ({name}): seed {seed} row {r}: {x:?}");
                    }
                }
            }
        }
    }

    /// Quantization rates of a random 4096×4096 matrix (uniform, normal-ish rows), the lane
    /// searches against the scalar reference alternately, on one thread and on all: run with
    /// `cargo test --release -p tessera-core --lib quantize_rates -- --ignored --nocapture`.
    #[test]
    #[ignore = "a benchmark: prints weights/s"]
    fn quantize_rates() {
        const ROWS: usize = 4096;
        const COLS: usize = 4096;
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..ROWS * COLS)
            .map(|_| (rng.unit() + rng.unit() + rng.unit()) * 0.02)
            .collect();
        type Each = fn(&[f32], &mut [u8]);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cases: [(GgmlType, &str, Each); 5] = [
            (GgmlType::Q4_K, "scalar", |x, b| {
                x.chunks_exact(256)
                    .zip(b.chunks_exact_mut(Q4_K_BYTES))
                    .for_each(|(x, b)| q4_k(x, b))
            }),
            (GgmlType::Q4_K, "lanes", |x, b| {
                quantize(GgmlType::Q4_K, x, b).unwrap()
            }),
            (GgmlType::Q6_K, "scalar", |x, b| {
                x.chunks_exact(256)
                    .zip(b.chunks_exact_mut(Q6_K_BYTES))
                    .for_each(|(x, b)| q6_k(x, b))
            }),
            (GgmlType::Q6_K, "lanes", |x, b| {
                quantize(GgmlType::Q6_K, x, b).unwrap()
            }),
            (GgmlType::Q8_0, "-", |x, b| {
                quantize(GgmlType::Q8_0, x, b).unwrap()
            }),
        ];
        for n in [1, threads] {
            let mut times = vec![Vec::new(); cases.len()];
            for _ in 0..5 {
                for ((t, _, f), times) in cases.iter().zip(&mut times) {
                    let row_bytes = t.bytes_for(COLS).unwrap();
                    let mut out = vec![0u8; ROWS * row_bytes];
                    let per = ROWS.div_ceil(n);
                    let start = std::time::Instant::now();
                    std::thread::scope(|s| {
                        for (x, o) in x.chunks(per * COLS).zip(out.chunks_mut(per * row_bytes)) {
                            s.spawn(move || {
                                for (x, o) in
                                    x.chunks_exact(COLS).zip(o.chunks_exact_mut(row_bytes))
                                {
                                    f(x, o);
                                }
                            });
                        }
                    });
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            for ((t, which, _), times) in cases.iter().zip(&mut times) {
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                println!(
                    "{t} {which:6} {n} thread(s): {:7.1} M weights/s (median {:.3} s of {})",
                    (ROWS * COLS) as f64 / median / 1e6,
                    median,
                    times.len()
                );
            }
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        let got: Vec<i32> = [0.5f32, 1.5, 2.5, -0.5, -1.5, 2.4999998, -7.6, 4_194_303.0]
            .map(nearest_int)
            .to_vec();
        assert_eq!(got, [0, 2, 2, 0, -2, 2, -8, 4_194_303]);
    }
}
