//! bf16 for [`Precision::Bf16`](crate::Precision) on the CPU: rounding to bf16 and the bf16
//! element of the panel products (`panels.rs`), a pair of bf16 values per `u32` multiplied with
//! `vdpbf16ps` (AVX512_BF16) where the CPU has it.
//!
//! Each product of two bf16 values is exact in f32, so the only roundings are the inputs' (to
//! bf16, to nearest even) and the f32 sums — the GPU's bf16 rule. CPUs without AVX512_BF16 run
//! the same arithmetic in a portable loop (slowly; the backend's `describe` says so).

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::panels::{
    Element, Lhs, MR, NR, Operand, Out, PanelView, Panels, Tile, gemm_converted, tile_plain,
};

/// Whether this CPU multiplies bf16 in hardware (AVX512_BF16's `vdpbf16ps`).
pub fn native() -> bool {
    static NATIVE: OnceLock<bool> = OnceLock::new();
    *NATIVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN), as bits.
#[inline]
pub(super) fn round(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// The f32 value of bf16 bits.
#[inline]
fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

impl Panels<u32> {
    /// Pack `n` rows of `k` f32 values at `stride` in `src`, rounded to bf16.
    pub fn from_f32_rows(src: &[f32], stride: usize, n: usize, k: usize) -> Self {
        Panels::from_rows(n, k, |j, out| {
            round_row(&src[j * stride..j * stride + k], out)
        })
    }

    /// Pack the transpose of `src` (`k` rows of `n` f32 values at `stride`): `B[j][i] =
    /// src[i][j]`, as `P · V` needs `V`. Rounds to bf16.
    pub fn from_cols(src: &[f32], stride: usize, k: usize, n: usize) -> Self {
        // An odd `k`'s last pair has no odd row: it pairs with zeros.
        let zeros = vec![0f32; n];
        Panels::from_steps(n, k, |q, cols, out| {
            let even = &src[2 * q * stride..][cols.clone()];
            let odd = match 2 * q + 1 < k {
                true => &src[(2 * q + 1) * stride..][cols],
                false => &zeros[cols],
            };
            interleave(even, odd, out);
        })
    }

    /// Row `j` of `B` widened to f32 (`k` long).
    pub fn row_f32(&self, j: usize, out: &mut [f32]) {
        for (q, o) in out[..self.k].chunks_mut(2).enumerate() {
            let pair = self.at(j, q);
            o[0] = widen(pair as u16);
            if let Some(o1) = o.get_mut(1) {
                *o1 = widen((pair >> 16) as u16);
            }
        }
    }
}

/// Round `m` rows of `k` f32 values (at `stride`) to bf16 pairs in `out` (resized to `m` rows of
/// `⌈k/2⌉`), in parallel when `par`; returns the row stride in `u32`s.
pub fn round_rows(
    src: &[f32],
    stride: usize,
    m: usize,
    k: usize,
    out: &mut Vec<u32>,
    par: bool,
) -> usize {
    let pairs = k.div_ceil(2);
    // Every pair is written below: grow the buffer, never clear it.
    if out.len() < m * pairs {
        out.resize(m * pairs, 0);
    }
    let out = &mut out[..m * pairs];
    if pairs == 0 {
        return pairs;
    }
    let one = |(r, o): (usize, &mut [u32])| round_row(&src[r * stride..r * stride + k], o);
    if par && m * k >= 1 << 16 {
        out.par_chunks_mut(pairs).enumerate().for_each(one);
    } else {
        out.chunks_mut(pairs).enumerate().for_each(one);
    }
    pairs
}

/// One row of f32 values to bf16 pairs (`out` is `⌈x.len()/2⌉` long).
pub fn round_row(x: &[f32], out: &mut [u32]) {
    round_row_in_steps(x, out, 16);
}

/// One row of f32 values to bf16 pairs, 16 pairs (32 values) at a time, the `s`-th 16 written
/// at `out[s·step..]`: a row laid out straight into AMX tiles (`step` = a tile's length), or
/// into a plain row (`step` = 16). The last group has `⌈rest/2⌉` pairs; nothing else of `out`
/// is written.
pub fn round_row_in_steps(x: &[f32], out: &mut [u32], step: usize) {
    let groups = x.len().div_ceil(32);
    assert!(
        step >= 16
            && (groups == 0
                || (groups - 1) * step + (x.len() - 32 * (groups - 1)).div_ceil(2) <= out.len()),
        "round_row_in_steps: out too short"
    );
    #[cfg(target_arch = "x86_64")]
    if native() {
        // SAFETY: AVX-512F and AVX512_BF16 are present (`native`); `out` holds every group
        // (asserted).
        unsafe { round_row_avx512(x, out, step) };
        return;
    }
    for (s, vals) in x.chunks(32).enumerate() {
        round_row_plain(vals, &mut out[s * step..][..vals.len().div_ceil(2)]);
    }
}

fn round_row_plain(x: &[f32], out: &mut [u32]) {
    for (o, pair) in out.iter_mut().zip(x.chunks(2)) {
        let hi = pair.get(1).map_or(0, |&v| round(v));
        *o = round(pair[0]) as u32 | (hi as u32) << 16;
    }
}

/// # Safety
/// The CPU has AVX-512F and AVX512_BF16; `out` holds group `s` at `s·step` for every group of
/// 32 values of `x`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_row_avx512(x: &[f32], out: &mut [u32], step: usize) {
    use std::arch::x86_64::*;
    let full = x.len() / 32;
    for i in 0..full {
        // SAFETY: elements 32i..32i+32 of `x` and step·i..step·i+16 of `out` are in bounds.
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(32 * i));
            let hi = _mm512_loadu_ps(x.as_ptr().add(32 * i + 16));
            // Rounds to nearest even and keeps NaN a NaN, as `round` does.
            let b = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                out.as_mut_ptr().add(step * i).cast(),
                std::mem::transmute::<__m512bh, __m512i>(b),
            );
        }
    }
    let rest = &x[32 * full..];
    if !rest.is_empty() {
        round_row_plain(rest, &mut out[step * full..][..rest.len().div_ceil(2)]);
    }
}

/// `out[j] = (even[j], odd[j])` rounded to bf16, as a pair.
fn interleave(even: &[f32], odd: &[f32], out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if native() {
        // SAFETY: AVX-512F and AVX512_BF16 are present (`native`).
        unsafe { interleave_avx512(even, odd, out) };
        return;
    }
    interleave_plain(even, odd, out);
}

fn interleave_plain(even: &[f32], odd: &[f32], out: &mut [u32]) {
    for ((o, &e), &d) in out.iter_mut().zip(even).zip(odd) {
        *o = round(e) as u32 | (round(d) as u32) << 16;
    }
}

/// # Safety
/// The CPU has AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn interleave_avx512(even: &[f32], odd: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let n = out.len().min(even.len()).min(odd.len());
    let mut j = 0;
    while j + 16 <= n {
        // SAFETY: elements j..j+16 of all three slices are in bounds; a `__m256bh` is 16 bf16
        // bits, the same 32 bytes as the integer vector.
        unsafe {
            let e = _mm512_cvtneps_pbh(_mm512_loadu_ps(even.as_ptr().add(j)));
            let d = _mm512_cvtneps_pbh(_mm512_loadu_ps(odd.as_ptr().add(j)));
            let e = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(e));
            let d = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(d));
            let pair = _mm512_or_si512(e, _mm512_slli_epi32::<16>(d));
            _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), pair);
        }
        j += 16;
    }
    interleave_plain(&even[j..n], &odd[j..n], &mut out[j..n]);
}

impl Operand for u32 {
    const F32_SOFTMAX_SUMS: bool = true;

    fn pack_rows(src: &[f32], stride: usize, n: usize, k: usize) -> Panels<u32> {
        Panels::from_f32_rows(src, stride, n, k)
    }

    fn pack_cols(src: &[f32], stride: usize, k: usize, n: usize) -> Panels<u32> {
        Panels::from_cols(src, stride, k, n)
    }

    fn lhs<'a>(
        src: &'a [f32],
        stride: usize,
        (m, k): (usize, usize),
        scratch: &'a mut Vec<u32>,
        par: bool,
    ) -> Lhs<'a, u32> {
        let stride = round_rows(src, stride, m, k, scratch, par);
        Lhs {
            data: scratch,
            stride,
            rows: m,
        }
    }

    /// On AMX, the rows are rounded straight into the tiles.
    unsafe fn gemm_rows(
        src: &[f32],
        stride: usize,
        (m, k): (usize, usize),
        b: PanelView<'_, u32>,
        c: Out,
        scratch: &mut Vec<u32>,
        par: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        if super::amx::enabled() {
            // SAFETY: as this function's; AMX is enabled.
            unsafe { super::amx::gemm_f32(src, stride, m, k, b, c, par) };
            return;
        }
        // SAFETY: as this function's.
        unsafe { gemm_converted(src, stride, (m, k), b, c, scratch, par) }
    }
}

impl Element for u32 {
    fn depth(k: usize) -> usize {
        k.div_ceil(2)
    }

    /// The pair's two products (exact in f32), added in turn.
    fn madd(acc: f32, x: u32, y: u32) -> f32 {
        let lo = widen(x as u16) * widen(y as u16);
        let hi = widen((x >> 16) as u16) * widen((y >> 16) as u16);
        acc + lo + hi
    }

    unsafe fn tile(t: Tile<'_, u32>) {
        debug_assert!(t.h <= MR && t.cols <= NR && t.b.len() >= t.depth * NR);
        #[cfg(target_arch = "x86_64")]
        if native() {
            // SAFETY: the features are present (`native`); the tile's promises are the caller's.
            unsafe { super::panels::dispatch_rows!(tile_avx512(t)) };
            return;
        }
        // SAFETY: as this function's.
        unsafe { tile_plain(t) }
    }

    /// On AMX tiles where the process uses them (`amx::enabled`): every bf16 product, so a
    /// row's result never depends on how many rows came with it.
    unsafe fn product(a: &Lhs<'_, u32>, b: PanelView<'_, u32>, c: Out, par: bool) -> bool {
        #[cfg(target_arch = "x86_64")]
        if super::amx::enabled() {
            // SAFETY: as this function's; AMX is enabled.
            unsafe { super::amx::gemm(a, b, c, par) };
            return true;
        }
        let _ = (a, b, c, par);
        false
    }
}

/// The bf16 tile with `vdpbf16ps`: `H` rows × 32 columns of f32 accumulators, one broadcast
/// pair of `A` against the panel's two registers per row and pair.
///
/// # Safety
/// As [`Tile`] says of its fields, `t.h == H`, and the CPU has AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_avx512<const H: usize>(t: Tile<'_, u32>) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; H];
    let (ap, bp, lda) = (t.a.as_ptr(), t.b.as_ptr(), t.lda);
    let ahead = super::prefetch::distance();
    for q in 0..t.depth {
        // A panel step is two lines, read once per tile: the panel streams (see `prefetch`).
        super::prefetch::lines::<2>(bp.wrapping_add(q * NR).cast(), ahead);
        // SAFETY: pair q of the panel (32 u32s at q·NR) and of rows 0..H of A are in bounds (see
        // `Tile`); `__m512bh` is 32 bf16 bits, the same 64 bytes as the integer vector.
        unsafe {
            let b0 =
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(q * NR).cast()));
            let b1 = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                bp.add(q * NR + 16).cast(),
            ));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *ap.add(r * lda + q) as i32,
                ));
                acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
            }
        }
    }
    // SAFETY: as this function's.
    unsafe { super::panels::store_tile(&acc, &t) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::panels::{Lhs, Out, gemm};
    use crate::cpu::testutil::Rng;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| round(x)).collect()
    }

    /// `alpha · A · Bᵀ` in f64 from the bf16-rounded inputs.
    fn naive(a: &[f32], b: &[f32], m: usize, n: usize, k: usize, alpha: f64) -> Vec<f64> {
        let (a, b) = (bits(a), bits(b));
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = alpha
                    * (0..k)
                        .map(|t| widen(a[i * k + t]) as f64 * widen(b[j * k + t]) as f64)
                        .sum::<f64>();
            }
        }
        c
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        a: &[f32],
        m: usize,
        k: usize,
        b: &Panels<u32>,
        c: &mut [f32],
        ldc: usize,
        alpha: f32,
        acc: bool,
    ) {
        let mut packed = Vec::new();
        let stride = round_rows(a, k, m, k, &mut packed, true);
        let lhs = Lhs {
            data: &packed,
            stride,
            rows: m,
        };
        // SAFETY: `c` holds m rows of ldc ≥ n columns.
        unsafe {
            gemm(
                &lhs,
                b.all(),
                Out {
                    ptr: c.as_mut_ptr(),
                    stride: ldc,
                    alpha,
                    accumulate: acc,
                },
                true,
            )
        };
    }

    #[test]
    fn products_match_f64_of_the_rounded_inputs_at_odd_sizes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (7, 17, 33),
            (13, 33, 7),
            (17, 512, 2048),
            (33, 4099, 65),
            (200, 64, 97),
        ] {
            let mut rng = Rng::new((m * 7919 + k * 31 + n) as u64);
            let (a, b) = (rng.vec(m * k, 2.0), rng.vec(n * k, 1.0));
            let panels = Panels::from_f32_rows(&b, k, n, k);
            let ldc = n + 3;
            let mut c = vec![f32::NAN; m * ldc];
            run(&a, m, k, &panels, &mut c, ldc, 0.5, false);
            let want = naive(&a, &b, m, n, k, 0.5);
            for i in 0..m {
                for j in 0..n {
                    let (g, w) = (c[i * ldc + j], want[i * n + j]);
                    // f32 sums of k exact products: k · 2⁻²⁴ relative to the sum of |terms|.
                    let tol = 1e-6 * (k as f64).sqrt() * 4.0 + 1e-6;
                    assert!(
                        (g as f64 - w).abs() <= tol * w.abs().max(1.0),
                        "{m}×{k}×{n} [{i},{j}]: {g} vs {w}"
                    );
                }
                assert!(
                    c[i * ldc + n..(i + 1) * ldc].iter().all(|x| x.is_nan()),
                    "wrote past column {n}"
                );
            }
            // Accumulating adds to what is there.
            let mut c2: Vec<f32> = (0..m * ldc).map(|i| i as f32 * 0.25).collect();
            run(&a, m, k, &panels, &mut c2, ldc, 1.0, true);
            for i in 0..m {
                for j in 0..n {
                    let w = (i * ldc + j) as f64 * 0.25 + 2.0 * want[i * n + j];
                    let g = c2[i * ldc + j] as f64;
                    assert!(
                        (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                        "accumulate {m}×{k}×{n}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// The portable tile (what CPUs without AVX512_BF16 run) computes the same product.
    #[test]
    fn the_portable_tile_matches_f64_of_the_rounded_inputs() {
        let (m, k, n) = (5, 33, 29);
        let mut rng = Rng::new(11);
        let (a, b) = (rng.vec(m * k, 2.0), rng.vec(n * k, 1.0));
        let panels = Panels::from_f32_rows(&b, k, n, k);
        let mut packed = Vec::new();
        let stride = round_rows(&a, k, m, k, &mut packed, false);
        let mut c = vec![1f32; m * n];
        // SAFETY: `c` holds m rows of n; A has m rows of `stride` pairs; the panel k/2 pairs.
        unsafe {
            tile_plain(Tile {
                a: &packed,
                lda: stride,
                h: m,
                b: &panels.data,
                depth: stride,
                c: c.as_mut_ptr(),
                ldc: n,
                cols: n,
                alpha: 2.0,
                accumulate: true,
            })
        };
        let want = naive(&a, &b, m, n, k, 2.0);
        for (i, (&g, &w)) in c.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - 1.0 - w).abs() <= 1e-5 * w.abs().max(1.0),
                "[{i}]: {g} vs 1 + {w}"
            );
        }
    }

    /// Rows laid out in groups of 16 pairs `step` apart hold the plain row's pairs, group by
    /// group, and leave everything between the groups as it was.
    #[test]
    fn rounding_in_steps_places_each_group_of_pairs() {
        for n in [1usize, 31, 32, 33, 64, 95, 1001] {
            let x = Rng::new(n as u64).vec(n, 3.0);
            let mut plain = vec![0u32; n.div_ceil(2)];
            round_row(&x, &mut plain);
            for step in [16, 40, 256] {
                let groups = n.div_ceil(32);
                let mut out = vec![u32::MAX; groups * step];
                round_row_in_steps(&x, &mut out, step);
                for (i, &v) in out.iter().enumerate() {
                    let (g, j) = (i / step, i % step);
                    let want = plain.get(g * 16 + j).filter(|_| j < 16).copied();
                    assert_eq!(v, want.unwrap_or(u32::MAX), "n {n} step {step} [{i}]");
                }
            }
        }
    }

    /// The hardware kernel and the portable loop agree on every element, NaN and ∞ included.
    #[test]
    fn rounding_keeps_specials_and_matches_the_scalar_rounding() {
        for n in [1usize, 7, 17, 33, 4099] {
            let mut rng = Rng::new(n as u64);
            let mut x = rng.vec(n, 100.0);
            for (i, v) in x.iter_mut().enumerate() {
                match i % 11 {
                    3 => *v = f32::NAN,
                    5 => *v = f32::INFINITY,
                    7 => *v = f32::NEG_INFINITY,
                    9 => *v = 1.0 + f32::EPSILON * 128.0, // a tie: rounds to even
                    _ => {}
                }
            }
            let mut fast = vec![0u32; n.div_ceil(2)];
            let mut plain = vec![0u32; n.div_ceil(2)];
            round_row(&x, &mut fast);
            round_row_plain(&x, &mut plain);
            for (i, (&f, &p)) in fast.iter().zip(&plain).enumerate() {
                for s in [0, 16] {
                    let (f, p) = ((f >> s) as u16, (p >> s) as u16);
                    assert!(
                        f == p || (widen(f).is_nan() && widen(p).is_nan()),
                        "pair {i}: {f:#x} vs {p:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn transposed_packing_and_row_reads_round_trip() {
        for (k, n) in [(1, 1), (7, 17), (37, 45), (33, 4099)] {
            let mut rng = Rng::new((k * n) as u64);
            let mut v = rng.vec(k * n, 3.0);
            for (i, x) in v.iter_mut().enumerate() {
                match i % 13 {
                    2 => *x = f32::NAN,
                    4 => *x = f32::INFINITY,
                    6 => *x = f32::NEG_INFINITY,
                    _ => {}
                }
            }
            let t = Panels::from_cols(&v, n, k, n);
            let mut row = vec![0f32; k];
            for j in 0..n {
                t.row_f32(j, &mut row);
                for (i, &x) in row.iter().enumerate() {
                    let want = widen(round(v[i * n + j]));
                    assert!(
                        x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan()),
                        "{k}×{n} [{i}, {j}]: {x} vs {want}"
                    );
                }
            }
        }
    }

    /// A view of later panels and later column pairs computes that part of the product.
    #[test]
    fn views_select_rows_and_pairs() {
        let (m, k, n) = (5, 40, 100);
        let mut rng = Rng::new(3);
        let (a, b) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
        let panels = Panels::from_f32_rows(&b, k, n, k);
        let mut packed = Vec::new();
        let stride = round_rows(&a, k, m, k, &mut packed, false);
        // Columns 10..30 of A as pairs 5..15, against B rows 32..100.
        let lhs = Lhs {
            data: &packed[5..],
            stride,
            rows: m,
        };
        let mut c = vec![0f32; m * 68];
        // SAFETY: c holds m rows of 68.
        unsafe {
            gemm(
                &lhs,
                panels.view(32..100, 5..15),
                Out {
                    ptr: c.as_mut_ptr(),
                    stride: 68,
                    alpha: 1.0,
                    accumulate: false,
                },
                false,
            )
        };
        let (ab, bb) = (bits(&a), bits(&b));
        for i in 0..m {
            for j in 0..68 {
                let w: f64 = (10..30)
                    .map(|t| widen(ab[i * k + t]) as f64 * widen(bb[(32 + j) * k + t]) as f64)
                    .sum();
                assert!((c[i * 68 + j] as f64 - w).abs() < 1e-5, "[{i},{j}]");
            }
        }
    }
}
