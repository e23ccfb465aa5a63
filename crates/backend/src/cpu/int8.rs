//! The fast mode of products on Q8_0, Q4_0 and Q4_K weights: each activation row is rounded to
//! int8 per block of 32 (`d = max|x| / 127`, `q = round(x / d)`, the Q8_0 rounding with `d` kept
//! in f32), and each block's dot product is summed in integers, then scaled by the two blocks'
//! scales and summed in f32 — the technique of llama.cpp's Q8_0 activation path. A Q4_K
//! sub-block of 32 (`ds · q − dm`) pairs with one activation block: `ds · Σ q q_x − dm · Σ q_x`,
//! the activation sums kept with the rounded rows. With AVX2 the block products are
//! `vpmaddubsw`/`vpmaddwd` (for signed weights the sign moved onto the activation, since
//! `vpmaddubsw` takes one unsigned operand); elsewhere a portable loop.
//!
//! Its only roundings besides the f32 sums are the activations' int8 rounding and the weights'
//! own quantization, so it is judged like bf16 against that floor.

use rayon::prelude::*;
use tessera_core::DType;

use super::panels::Out;
use super::quant::QuantMat;

/// Values per block of both operands.
const BLOCK: usize = 32;

/// Weight rows per task: their blocks (at most 64 × 34 bytes per 2048 inputs) stay in L2
/// while the activation rows pass.
const ROWS_PER_TASK: usize = 16;

/// Whether the int8 path runs products on `dtype` weights (the others run exactly).
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_K)
}

/// Whether this CPU runs the AVX2 block products (with FMA and F16C, as every AVX2 CPU has).
pub fn native() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Activation rows rounded to int8 per block: `q` row-major (`k` per row), `d` one scale per
/// block, `s` each block's sum of `q` (what a Q4_K sub-block's min multiplies).
pub struct Rows {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<i32>,
}

/// Round `m` rows of `x` (`k` wide, `k` a multiple of 32, at stride `xs`) to int8 blocks.
pub fn round_rows(x: &[f32], xs: usize, m: usize, k: usize) -> Rows {
    let blocks = k / BLOCK;
    let mut q = vec![0i8; m * k];
    let mut d = vec![0f32; m * blocks];
    let mut sums = vec![0i32; m * blocks];
    for (i, (qr, dr)) in q
        .chunks_exact_mut(k.max(1))
        .zip(d.chunks_exact_mut(blocks.max(1)))
        .enumerate()
    {
        let xr = &x[i * xs..i * xs + k];
        for ((xb, qb), db) in xr
            .chunks_exact(BLOCK)
            .zip(qr.chunks_exact_mut(BLOCK))
            .zip(dr)
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            *db = amax / 127.0;
            let id = if *db == 0.0 { 0.0 } else { 1.0 / *db };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round() as i8;
            }
        }
    }
    for (s, qb) in sums.iter_mut().zip(q.chunks_exact(BLOCK)) {
        *s = qb.iter().map(|&v| i32::from(v)).sum();
    }
    Rows { q, d, s: sums }
}

/// One weight block as 32 signed values and its scale.
fn weight_block(dtype: DType, b: &[u8], out: &mut [i8; BLOCK]) -> f32 {
    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match dtype {
        DType::Q8_0 => {
            for (o, &v) in out.iter_mut().zip(&b[2..]) {
                *o = v as i8;
            }
        }
        _ => {
            let (lo, hi) = out.split_at_mut(BLOCK / 2);
            for ((l, h), &v) in lo.iter_mut().zip(hi).zip(&b[2..]) {
                *l = (v & 0x0f) as i8 - 8;
                *h = (v >> 4) as i8 - 8;
            }
        }
    }
    d
}

/// `Σ_blocks d_w · d_x · Σ q_w q_x` over one weight row (`row`, blocks of `dtype`) and one
/// rounded activation row, portably.
fn dot_plain(dtype: DType, row: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let mut w = [0i8; BLOCK];
    let mut acc = 0f32;
    for ((b, qx), &dx) in row
        .chunks_exact(dtype.block_bytes())
        .zip(q.chunks_exact(BLOCK))
        .zip(d)
    {
        let dw = weight_block(dtype, b, &mut w);
        let s: i32 = w
            .iter()
            .zip(qx)
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum();
        acc += dw * dx * s as f32;
    }
    acc
}

/// As [`dot_plain`] for `R` activation rows at once, with AVX2: each weight block is loaded
/// (and unpacked) once for the `R` rows; 32 products per block and row in two instructions,
/// eight partial sums per lane scaled and accumulated in f32 — even and odd blocks into separate
/// accumulators, so consecutive blocks' multiply-adds do not wait on each other (the same order
/// for every `R`: a row sums alike alone and in a tile). Block scales convert with F16C.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `row` holds `q[r].len() / 32` blocks of `dtype`, each `d[r]`
/// as many scales.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2<const R: usize>(
    dtype: DType,
    row: &[u8],
    q: [&[i8]; R],
    d: [&[f32]; R],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let bb = dtype.block_bytes();
    let nb = row.len() / bb;
    let ones = _mm256_set1_epi16(1);
    let low = _mm_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let q8 = dtype == DType::Q8_0;
    // SAFETY (whole body): block i's bytes are row[i·bb..][..bb], its activations
    // q[r][32·i..][..32] and scale d[r][i], all in bounds for i < nb by the caller's promise.
    let block = |i: usize, acc: &mut [__m256; R]| unsafe {
        let b = row.as_ptr().add(i * bb);
        let dw = f16_bits(u16::from_le_bytes([*b, *b.add(1)]));
        let w = if q8 {
            _mm256_loadu_si256(b.add(2).cast())
        } else {
            let packed = _mm_loadu_si128(b.add(2).cast());
            let lo = _mm_and_si128(packed, low);
            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight)
        };
        let abs_w = _mm256_sign_epi8(w, w);
        for r in 0..R {
            let x = _mm256_loadu_si256(q[r].as_ptr().add(i * BLOCK).cast());
            // |w| · (x with w's sign): the same products, the left operand unsigned.
            let pairs = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            let scale = _mm256_set1_ps(dw * *d[r].get_unchecked(i));
            acc[r] = _mm256_fmadd_ps(scale, sums, acc[r]);
        }
    };
    let mut even = [_mm256_setzero_ps(); R];
    let mut odd = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i + 2 <= nb {
        block(i, &mut even);
        block(i + 1, &mut odd);
        i += 2;
    }
    if i < nb {
        block(i, &mut even);
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])))
}

/// An f16 scale's bits as f32, with F16C's one conversion instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
fn f16_bits(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The sum of a vector's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn hsum(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Q4_K's sub-blocks of a row: `(ds, dm, nibbles, high)` per sub-block of 32, with value
/// `ds · q − dm`, `q` the low (`high` false) or high nibbles of the 32 bytes.
fn q4_k_subs(row: &[u8]) -> impl Iterator<Item = (f32, f32, &[u8], bool)> {
    row.chunks_exact(DType::Q4_K.block_bytes()).flat_map(|b| {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = half::f16::from_le_bytes([b[2], b[3]]).to_f32();
        let (scales, qs) = b[4..].split_at(12);
        (0..8).map(move |j| {
            let (sc, m) = tessera_core::gguf::q4_k_scale_min(scales, j);
            let run = &qs[32 * (j / 2)..][..32];
            (d * f32::from(sc), dmin * f32::from(m), run, j % 2 == 1)
        })
    })
}

/// Q4_K against one rounded activation row, portably: per sub-block
/// `d_x · (ds · Σ q q_x − dm · Σ q_x)`, the sums in integers.
fn dot_q4_k_plain(row: &[u8], q: &[i8], d: &[f32], s: &[i32]) -> f32 {
    let mut acc = 0f32;
    for ((((ds, dm, run, high), qx), &dx), &sx) in
        q4_k_subs(row).zip(q.chunks_exact(BLOCK)).zip(d).zip(s)
    {
        let shift = if high { 4 } else { 0 };
        let dot: i32 = run
            .iter()
            .zip(qx)
            .map(|(&b, &x)| i32::from((b >> shift) & 0x0f) * i32::from(x))
            .sum();
        acc += dx * (ds * dot as f32 - dm * sx as f32);
    }
    acc
}

/// As [`dot_q4_k_plain`] for `R` activation rows at once, with AVX2: per Q4_K block the eight
/// sub-block scales and mins are decoded once, and each 32-byte run of nibbles is loaded once for
/// its two sub-blocks (low nibbles, then high), which accumulate separately (the nibbles are the
/// unsigned operand of `vpmaddubsw` as they are). The same order for every `R`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `row` holds `q[r].len() / 256` Q4_K blocks, each `d[r]` and
/// `s[r]` one entry per 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_avx2<const R: usize>(
    row: &[u8],
    q: [&[i8]; R],
    d: [&[f32]; R],
    s: [&[i32]; R],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let bb = DType::Q4_K.block_bytes();
    let mut even = [_mm256_setzero_ps(); R];
    let mut odd = [_mm256_setzero_ps(); R];
    let mut mins = [0f32; R];
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0f);
    for (k, b) in row.chunks_exact(bb).enumerate() {
        let (dd, dmin) = (
            f16_bits(u16::from_le_bytes([b[0], b[1]])),
            f16_bits(u16::from_le_bytes([b[2], b[3]])),
        );
        let (scales, qs) = b[4..].split_at(12);
        for pair in 0..4 {
            let (j0, j1) = (2 * pair, 2 * pair + 1);
            let (sc0, m0) = tessera_core::gguf::q4_k_scale_min(scales, j0);
            let (sc1, m1) = tessera_core::gguf::q4_k_scale_min(scales, j1);
            let (ds0, dm0) = (dd * f32::from(sc0), dmin * f32::from(m0));
            let (ds1, dm1) = (dd * f32::from(sc1), dmin * f32::from(m1));
            let (i0, i1) = (8 * k + j0, 8 * k + j1);
            // SAFETY: `qs` holds 4 runs of 32 bytes; each `q[r]` 32 values at 32·i0 and 32·i1,
            // each `d[r]`, `s[r]` entries i0 and i1 (the caller's promise).
            unsafe {
                let packed = _mm256_loadu_si256(qs.as_ptr().add(32 * pair).cast());
                let lo = _mm256_and_si256(packed, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                for r in 0..R {
                    let x0 = _mm256_loadu_si256(q[r].as_ptr().add(i0 * BLOCK).cast());
                    let x1 = _mm256_loadu_si256(q[r].as_ptr().add(i1 * BLOCK).cast());
                    let s0 =
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones));
                    let s1 =
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones));
                    let (dx0, dx1) = (*d[r].get_unchecked(i0), *d[r].get_unchecked(i1));
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx0 * ds0), s0, even[r]);
                    odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx1 * ds1), s1, odd[r]);
                    mins[r] += dx0 * (dm0 * *s[r].get_unchecked(i0) as f32)
                        + dx1 * (dm1 * *s[r].get_unchecked(i1) as f32);
                }
            }
        }
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])) - mins[r])
}

/// One rounded activation row: values, block scales, block sums.
type Act<'a> = (&'a [i8], &'a [f32], &'a [i32]);

/// `R` activation rows against one weight row with AVX2, by format.
///
/// # Safety
/// AVX2, FMA and F16C are present; `row` is one weight row of `blocks` blocks of 32 values and each
/// activation row has `blocks` blocks.
#[cfg(target_arch = "x86_64")]
unsafe fn tile<const R: usize>(dtype: DType, row: &[u8], a: [Act<'_>; R]) -> [f32; R] {
    // SAFETY: as the caller promises.
    unsafe {
        if dtype == DType::Q4_K {
            dot_q4_k_avx2(row, a.map(|a| a.0), a.map(|a| a.1), a.map(|a| a.2))
        } else {
            dot_avx2(dtype, row, a.map(|a| a.0), a.map(|a| a.1))
        }
    }
}

/// Activation rows per AVX2 call: each weight block is unpacked once for this many rows.
const ROW_TILE: usize = 4;

/// `dst = alpha · x · wᵀ` (or `+=`) with `x` rounded to int8 blocks, for `m` rows of `x` (`k`
/// at stride `xs`) into `m` rows of `dst` (`n` at stride `ds`). `w` is Q8_0 or Q4_0
/// ([`supports`]) and `k` a multiple of 32. Tasks of weight rows on every thread when `par`.
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
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
    let rows = round_rows(x, xs, m, k);
    let dtype = w.dtype();
    let blocks = k / BLOCK;
    let fast = native();
    let out = Out {
        ptr: dst.as_mut_ptr(),
        stride: ds,
        alpha,
        accumulate,
    };
    let act = |i: usize| {
        let b = i * blocks..(i + 1) * blocks;
        (&rows.q[i * k..(i + 1) * k], &rows.d[b.clone()], &rows.s[b])
    };
    let store = |i: usize, j: usize, s: f32| {
        // SAFETY: row i < m, column j < n of the caller's `dst`; each (i, j) is written by the
        // one task that owns weight row j.
        let o = unsafe { &mut *out.at(i, j) };
        *o = if accumulate {
            *o + alpha * s
        } else {
            alpha * s
        };
    };
    let plain = |row: &[u8], (q, d, s): Act<'_>| {
        if dtype == DType::Q4_K {
            dot_q4_k_plain(row, q, d, s)
        } else {
            dot_plain(dtype, row, q, d)
        }
    };
    let task = |t: usize| {
        for j in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n) {
            let row = w.row(j);
            let mut i = 0;
            #[cfg(target_arch = "x86_64")]
            if fast {
                while i + ROW_TILE <= m {
                    let a: [Act<'_>; ROW_TILE] = std::array::from_fn(|r| act(i + r));
                    // SAFETY: AVX2, FMA and F16C were detected; shapes as `tile` needs.
                    let s = unsafe { tile(dtype, row, a) };
                    for (r, s) in s.into_iter().enumerate() {
                        store(i + r, j, s);
                    }
                    i += ROW_TILE;
                }
                while i < m {
                    // SAFETY: as above.
                    let [s] = unsafe { tile(dtype, row, [act(i)]) };
                    store(i, j, s);
                    i += 1;
                }
            }
            while i < m {
                store(i, j, plain(row, act(i)));
                i += 1;
            }
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fast;
    let tasks = n.div_ceil(ROWS_PER_TASK);
    if par && tasks > 1 && m * n * k >= 1 << 16 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::tests::random_blocks;
    use crate::cpu::testutil::Rng;

    /// The int8 product against its floor: a float64 product on the dequantized weights and the
    /// int8-rounded activations (its only roundings) is what it computes, up to f32 sums; its
    /// distance from the exact float64 product (on the unrounded activations) stays within
    /// 1.5× of the floor's, through the AVX2 kernel where present and the portable one.
    #[test]
    fn int8_products_stay_within_their_rounding_floor() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K] {
            for &(m, k, n) in &[
                (1usize, 32usize, 1usize),
                (3, 256, 70),
                (17, 2048, 33),
                (64, 128, 64),
            ] {
                let k = k.next_multiple_of(dtype.block_size());
                let seed = (m * 7 + k + n) as u64;
                let blocks = random_blocks(dtype, n, k, seed);
                let w = QuantMat::from_blocks(dtype, blocks.clone(), dtype.bytes_for(k).unwrap());
                let mut wf = vec![0f32; n * k];
                tessera_core::dtype::widen_into(dtype, &blocks, &mut wf);
                let x = Rng::new(seed + 1).vec(m * k, 2.0);
                let r = round_rows(&x, k, m, k);
                let mut got = vec![0f32; m * n];
                product(&x, k, m, &w, (n, k), &mut got, n, 0.5, false, true);
                let mut plain = vec![0f32; m * n];
                for i in 0..m {
                    for j in 0..n {
                        let (q, b) = (&r.q[i * k..(i + 1) * k], i * k / 32..(i + 1) * k / 32);
                        let (d, s) = (&r.d[b.clone()], &r.s[b]);
                        plain[i * n + j] = 0.5
                            * if dtype == DType::Q4_K {
                                dot_q4_k_plain(w.row(j), q, d, s)
                            } else {
                                dot_plain(dtype, w.row(j), q, d)
                            };
                    }
                }
                let (mut err, mut floor, mut err_plain) = (0f64, 0f64, 0f64);
                for i in 0..m {
                    for j in 0..n {
                        let (mut exact, mut rounded) = (0f64, 0f64);
                        for t in 0..k {
                            let wv = wf[j * k + t] as f64;
                            exact += x[i * k + t] as f64 * wv;
                            let xr = r.q[i * k + t] as f64 * r.d[i * k / 32 + t / 32] as f64;
                            rounded += xr * wv;
                        }
                        let (exact, rounded) = (0.5 * exact, 0.5 * rounded);
                        err = err.max((got[i * n + j] as f64 - exact).abs());
                        err_plain = err_plain.max((plain[i * n + j] as f64 - exact).abs());
                        floor = floor.max((rounded - exact).abs());
                        // What it computes: the rounded product, up to f32 sums.
                        let tol = 1e-5 * rounded.abs().max(1.0);
                        assert!(
                            (got[i * n + j] as f64 - rounded).abs() <= tol,
                            "{dtype} {m}×{k}×{n}"
                        );
                    }
                }
                assert!(floor > 0.0, "{dtype}: the activations were not rounded");
                assert!(
                    err <= 1.5 * floor,
                    "{dtype} {m}×{k}×{n}: {err:e} vs floor {floor:e}"
                );
                assert!(
                    err_plain <= 1.5 * floor,
                    "{dtype} portable: {err_plain:e} vs floor {floor:e}"
                );
            }
        }
    }

    /// A row's result does not depend on the rows it comes with (tiles of 4 and lone rows sum
    /// alike): what lets batched work equal the same work alone.
    #[test]
    fn int8_products_do_not_depend_on_the_row_count() {
        let (k, n) = (256, 40);
        for dtype in [DType::Q4_0, DType::Q4_K] {
            let w = QuantMat::from_blocks(
                dtype,
                random_blocks(dtype, n, k, 9),
                dtype.bytes_for(k).unwrap(),
            );
            let x = Rng::new(10).vec(17 * k, 1.0);
            let run = |first: usize, m: usize| {
                let mut o = vec![0f32; m * n];
                product(
                    &x[first * k..],
                    k,
                    m,
                    &w,
                    (n, k),
                    &mut o,
                    n,
                    1.0,
                    false,
                    false,
                );
                o
            };
            let all = run(0, 17);
            for (first, m) in [(5, 1), (4, 4), (3, 6), (16, 1)] {
                let alone = run(first, m);
                assert!(
                    alone[..] == all[first * n..(first + m) * n],
                    "{dtype} rows {first}+{m}"
                );
            }
        }
    }

    #[test]
    fn rounding_is_q8_0_with_an_f32_scale() {
        let mut x = [0f32; 64];
        x[0] = -2.54;
        x[1] = 1.0;
        x[2] = -0.3;
        let r = round_rows(&x, 64, 1, 64);
        assert_eq!(r.d, [2.54f32 / 127.0, 0.0]);
        assert_eq!(r.q[..4], [-127, 50, -15, 0]);
        assert!(r.q[32..].iter().all(|&q| q == 0));
    }
}
