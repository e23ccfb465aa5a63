//! The Q4_K and Q6_K scale searches run on the sub-blocks of a super-block side by side, one
//! sub-block per SIMD lane: element `i` of every sub-block sits in one `[f32; N]`, and each
//! lane does exactly the scalar search's sequence of `f32` operations on its own sub-block —
//! every sum accumulates in the reference's order, compares and branches become per-lane
//! selects — so the bytes are the one-at-a-time search's for every input (the tests compare
//! them). No sum runs across lanes, which would reorder it and change the chosen scales.
//!
//! The code is portable; on x86-64 it is compiled again for AVX2 and for AVX-512F (picked at
//! run time), where LLVM turns each `[f32; 8]` or `[f32; 16]` step into one instruction. Rust
//! never contracts `a * b + c` into a fused multiply-add, even where the enabled features
//! include FMA (AVX-512F's do), so the rounding stays the reference's.

use std::array::from_fn;

use super::super::k_quants::{Q4_K_BLOCK, Q4_K_BYTES, Q6_K_BLOCK, Q6_K_BYTES};
use super::{nearest_int, q4_k_finish, q6_k_finish};

/// Sub-blocks (lanes) per Q4_K super-block.
const Q4_K_SUBS: usize = Q4_K_BLOCK / 32;
/// Sub-blocks (lanes) per Q6_K super-block.
const Q6_K_SUBS: usize = Q6_K_BLOCK / 16;

/// Q4_K for whole super-blocks `x` into `out` (lengths checked by the caller).
pub(super) fn q4_k(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { q4_k_avx512(x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { q4_k_avx2(x, out) };
    }
    q4_k_blocks(x, out);
}

/// Q6_K for whole super-blocks `x` into `out` (lengths checked by the caller).
pub(super) fn q6_k(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { q6_k_avx512(x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { q6_k_avx2(x, out) };
    }
    q6_k_blocks(x, out);
}

/// [`q4_k_blocks`] compiled for AVX2: one super-block per search measured fastest here (two,
/// 16 lanes in two registers, slower).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_k_avx2(x: &[f32], out: &mut [u8]) {
    q4_k_blocks(x, out);
}

/// [`q6_k_blocks`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q6_k_avx2(x: &[f32], out: &mut [u8]) {
    q6_k_blocks(x, out);
}

/// Q4_K four super-blocks (32 lanes, two registers) at a time, compiled for AVX-512F: more
/// independent chains of sums than one register's 16 lanes, measured faster.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q4_k_avx512(x: &[f32], out: &mut [u8]) {
    q4_k_groups::<{ 4 * Q4_K_SUBS }>(x, out);
}

/// [`q6_k_blocks`] compiled for AVX-512F: its 16 lanes fill one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q6_k_avx512(x: &[f32], out: &mut [u8]) {
    q6_k_blocks(x, out);
}

/// Quantizes whole super-blocks.
#[cfg(test)]
pub(super) type Blocks = fn(&[f32], &mut [u8]);

/// Every Q4_K and Q6_K path this CPU can run, named, for the tests to compare each with the
/// scalar reference (`quantize` takes only the widest).
#[cfg(test)]
pub(super) fn variants() -> Vec<(&'static str, Blocks, Blocks)> {
    let mut v: Vec<(&'static str, Blocks, Blocks)> = vec![("portable", q4_k_blocks, q6_k_blocks)];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        v.push((
            "avx2",
            // SAFETY: listed only where the CPU has AVX2, checked just above.
            |x, o| unsafe { q4_k_avx2(x, o) },
            // SAFETY: as above.
            |x, o| unsafe { q6_k_avx2(x, o) },
        ));
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        v.push((
            "avx512f",
            // SAFETY: listed only where the CPU has AVX-512F, checked just above.
            |x, o| unsafe { q4_k_avx512(x, o) },
            // SAFETY: as above.
            |x, o| unsafe { q6_k_avx512(x, o) },
        ));
    }
    v
}

/// Q4_K one super-block (8 lanes) at a time.
#[inline(always)]
fn q4_k_blocks(x: &[f32], out: &mut [u8]) {
    q4_k_groups::<Q4_K_SUBS>(x, out);
}

/// Q4_K a group of `N / 8` super-blocks per search (`N` lanes), the blocks left over one at a
/// time.
#[inline(always)]
fn q4_k_groups<const N: usize>(x: &[f32], out: &mut [u8]) {
    const { assert!(N.is_multiple_of(Q4_K_SUBS) && N <= 4 * Q4_K_SUBS) };
    let per = N / Q4_K_SUBS;
    let whole = x.len() / Q4_K_BLOCK / per * per;
    let (xg, xr) = x.split_at(whole * Q4_K_BLOCK);
    let (og, or) = out.split_at_mut(whole * Q4_K_BYTES);
    for (xg, og) in xg
        .chunks_exact(per * Q4_K_BLOCK)
        .zip(og.chunks_exact_mut(per * Q4_K_BYTES))
    {
        let mut l = [0u8; Q4_K_BLOCK * 4];
        let (mut scales, mut mins) = ([0f32; N], [0f32; N]);
        let l = &mut l[..per * Q4_K_BLOCK];
        q4_k_search::<N>(xg, l, &mut scales, &mut mins);
        for ((((x, b), l), s), m) in xg
            .as_chunks::<Q4_K_BLOCK>()
            .0
            .iter()
            .zip(og.as_chunks_mut::<Q4_K_BYTES>().0)
            .zip(l.as_chunks_mut::<Q4_K_BLOCK>().0)
            .zip(scales.as_chunks::<Q4_K_SUBS>().0)
            .zip(mins.as_chunks::<Q4_K_SUBS>().0)
        {
            q4_k_finish(x, l, s, m, b);
        }
    }
    for (x, b) in xr
        .as_chunks::<Q4_K_BLOCK>()
        .0
        .iter()
        .zip(or.as_chunks_mut::<Q4_K_BYTES>().0)
    {
        let mut l = [0u8; Q4_K_BLOCK];
        let (mut scales, mut mins) = ([0f32; Q4_K_SUBS], [0f32; Q4_K_SUBS]);
        q4_k_search::<Q4_K_SUBS>(x, &mut l, &mut scales, &mut mins);
        q4_k_finish(x, &mut l, &scales, &mins, b);
    }
}

/// Q6_K one super-block (16 lanes) at a time.
#[inline(always)]
fn q6_k_blocks(x: &[f32], out: &mut [u8]) {
    let blocks = x.as_chunks::<Q6_K_BLOCK>().0;
    for (x, b) in blocks.iter().zip(out.as_chunks_mut::<Q6_K_BYTES>().0) {
        let mut l = [0u8; Q6_K_BLOCK];
        let mut scales = [0f32; Q6_K_SUBS];
        q6_k_search(x, &mut l, &mut scales);
        q6_k_finish(x, &mut l, &scales, b);
    }
}

/// Lanes of `[f32; N]`, one per element of a sub-block of `S`.
type Lanes<const N: usize, const S: usize> = [[f32; N]; S];

/// `x` (`N` sub-blocks of `S` back to back) with element `i` of sub-block `j` at `[i][j]`.
#[inline(always)]
fn transpose<const N: usize, const S: usize>(x: &[f32]) -> Lanes<N, S> {
    let mut t = [[0f32; N]; S];
    for (j, sub) in x.chunks_exact(S).take(N).enumerate() {
        for (i, &v) in sub.iter().enumerate() {
            t[i][j] = v;
        }
    }
    t
}

/// Levels (whole `f32`) back to bytes, sub-block after sub-block, each offset by `offset`.
#[inline(always)]
fn untranspose<const N: usize, const S: usize>(t: &Lanes<N, S>, offset: f32, l: &mut [u8]) {
    for (j, sub) in l.chunks_exact_mut(S).take(N).enumerate() {
        for (i, q) in sub.iter_mut().enumerate() {
            *q = (t[i][j] + offset) as u8;
        }
    }
}

/// The rounded, clamped level of `v` (an `f32` holding a whole number).
#[inline(always)]
fn level(v: f32, lo: i32, hi: i32) -> f32 {
    nearest_int(v).clamp(lo, hi) as f32
}

/// The reference's `make_qkx2_quants` (Q4_K: `nmax` 15, weights the sub-block's RMS plus each
/// |x|) on the `N` sub-blocks of 32 in `x` at once: levels to `l`, scales and negated mins as
/// the scalar search returns them.
#[inline(always)]
fn q4_k_search<const N: usize>(
    x: &[f32],
    l: &mut [u8],
    scales: &mut [f32; N],
    mins: &mut [f32; N],
) {
    debug_assert_eq!((x.len(), l.len()), (32 * N, 32 * N));
    const RMIN: f32 = -1.0;
    const RDELTA: f32 = 0.1;
    const NSTEP: i32 = 20;
    const NMAX: i32 = 15;
    let xt: Lanes<N, 32> = transpose(x);
    let mut sum_x2 = [0f32; N];
    for row in &xt {
        for j in 0..N {
            sum_x2[j] += row[j] * row[j];
        }
    }
    let av_x: [f32; N] = from_fn(|j| (sum_x2[j] / 32.0).sqrt());
    let w: Lanes<N, 32> = from_fn(|i| from_fn(|j| av_x[j] + xt[i][j].abs()));

    let (mut min, mut max) = (xt[0], xt[0]);
    let mut sum_w = w[0];
    let mut sum_x: [f32; N] = from_fn(|j| sum_w[j] * xt[0][j]);
    for (row, wr) in xt.iter().zip(&w).skip(1) {
        for j in 0..N {
            let v = row[j];
            if v < min[j] {
                min[j] = v;
            }
            if v > max[j] {
                max[j] = v;
            }
            sum_w[j] += wr[j];
            sum_x[j] += wr[j] * v;
        }
    }
    for m in &mut min {
        if *m > 0.0 {
            *m = 0.0;
        }
    }
    // A constant sub-block's result, fixed before the search (which its lane runs on garbage).
    let flat: [bool; N] = from_fn(|j| max[j] == min[j]);
    let flat_min = min;

    let iscale: [f32; N] = from_fn(|j| NMAX as f32 / (max[j] - min[j]));
    let mut scale: [f32; N] = from_fn(|j| 1.0 / iscale[j]);
    let mut best_l = [[0f32; N]; 32];
    let mut best_error = [0f32; N];
    for ((row, wr), bl) in xt.iter().zip(&w).zip(&mut best_l) {
        for j in 0..N {
            let q = level(iscale[j] * (row[j] - min[j]), 0, NMAX);
            bl[j] = q;
            let diff = scale[j] * q + min[j] - row[j];
            best_error[j] += wr[j] * (diff * diff);
        }
    }
    let mut aux = [[0f32; N]; 32];
    for is in 0..=NSTEP {
        let num = RMIN + RDELTA * is as f32 + NMAX as f32;
        let iscale: [f32; N] = from_fn(|j| num / (max[j] - min[j]));
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([0f32; N], [0f32; N], [0f32; N]);
        for ((row, wr), a) in xt.iter().zip(&w).zip(&mut aux) {
            for j in 0..N {
                let lf = level(iscale[j] * (row[j] - min[j]), 0, NMAX);
                a[j] = lf;
                let wl = wr[j] * lf;
                sum_l[j] += wl;
                sum_l2[j] += wl * lf;
                sum_xl[j] += wl * row[j];
            }
        }
        let mut this_scale = [0f32; N];
        let mut this_min = [0f32; N];
        let mut fit = [false; N];
        for j in 0..N {
            let d = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j];
            fit[j] = d > 0.0;
            let s = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / d;
            let m = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / d;
            (this_scale[j], this_min[j]) = if m > 0.0 {
                (sum_xl[j] / sum_l2[j], 0.0)
            } else {
                (s, m)
            };
        }
        let mut cur_error = [0f32; N];
        for ((row, wr), a) in xt.iter().zip(&w).zip(&aux) {
            for j in 0..N {
                let diff = this_scale[j] * a[j] + this_min[j] - row[j];
                cur_error[j] += wr[j] * (diff * diff);
            }
        }
        let take: [bool; N] = from_fn(|j| fit[j] && cur_error[j] < best_error[j]);
        for j in 0..N {
            if take[j] {
                best_error[j] = cur_error[j];
                scale[j] = this_scale[j];
                min[j] = this_min[j];
            }
        }
        if take.contains(&true) {
            for (bl, a) in best_l.iter_mut().zip(&aux) {
                for j in 0..N {
                    if take[j] {
                        bl[j] = a[j];
                    }
                }
            }
        }
    }
    for j in 0..N {
        if flat[j] {
            scale[j] = 0.0;
            min[j] = flat_min[j];
            for bl in &mut best_l {
                bl[j] = 0.0;
            }
        }
        scales[j] = scale[j];
        mins[j] = -min[j];
    }
    untranspose(&best_l, 0.0, l);
}

/// The reference's `make_qx_quants` (Q6_K: `nmax` 32, weights `x²`) on the 16 sub-blocks of
/// super-block `x` at once: levels (`+ 32`) to `l`, signed scales to `scales`.
#[inline(always)]
fn q6_k_search(x: &[f32; Q6_K_BLOCK], l: &mut [u8; Q6_K_BLOCK], scales: &mut [f32; Q6_K_SUBS]) {
    const N: usize = Q6_K_SUBS;
    const NMAX: i32 = 32;
    let xt: Lanes<N, 16> = transpose(x);
    let (mut max, mut amax) = ([0f32; N], [0f32; N]);
    for row in &xt {
        for j in 0..N {
            if row[j].abs() > amax[j] {
                amax[j] = row[j].abs();
                max[j] = row[j];
            }
        }
    }
    // `w·x` and `w` for `w = x²`, the same for every trial scale.
    let w: Lanes<N, 16> = from_fn(|i| from_fn(|j| xt[i][j] * xt[i][j]));
    let wx: Lanes<N, 16> = from_fn(|i| from_fn(|j| w[i][j] * xt[i][j]));
    let sums = |iscale: &[f32; N], levels: &mut Lanes<N, 16>| {
        let (mut sumlx, mut suml2) = ([0f32; N], [0f32; N]);
        for (((row, wr), wxr), lv) in xt.iter().zip(&w).zip(&wx).zip(levels) {
            for j in 0..N {
                let lf = level(iscale[j] * row[j], -NMAX, NMAX - 1);
                lv[j] = lf;
                sumlx[j] += wxr[j] * lf;
                suml2[j] += wr[j] * lf * lf;
            }
        }
        (sumlx, suml2)
    };
    let iscale: [f32; N] = from_fn(|j| -(NMAX as f32) / max[j]);
    let mut best_l = [[0f32; N]; 16];
    let (sumlx, suml2) = sums(&iscale, &mut best_l);
    let mut scale: [f32; N] = from_fn(|j| {
        if suml2[j] != 0.0 {
            sumlx[j] / suml2[j]
        } else {
            0.0
        }
    });
    let mut best: [f32; N] = from_fn(|j| scale[j] * sumlx[j]);
    let mut levels = [[0f32; N]; 16];
    for is in (-9..=9).filter(|&is| is != 0) {
        let num = -(NMAX as f32 + 0.1 * is as f32);
        let iscale: [f32; N] = from_fn(|j| num / max[j]);
        let (sumlx, suml2) = sums(&iscale, &mut levels);
        let take: [bool; N] =
            from_fn(|j| suml2[j] > 0.0 && sumlx[j] * sumlx[j] > best[j] * suml2[j]);
        for j in 0..N {
            if take[j] {
                scale[j] = sumlx[j] / suml2[j];
                best[j] = scale[j] * sumlx[j];
            }
        }
        if take.contains(&true) {
            for (bl, lv) in best_l.iter_mut().zip(&levels) {
                for j in 0..N {
                    if take[j] {
                        bl[j] = lv[j];
                    }
                }
            }
        }
    }
    for j in 0..N {
        if amax[j] < 1e-15 {
            scale[j] = 0.0;
            for bl in &mut best_l {
                bl[j] = -(NMAX as f32);
            }
        }
        scales[j] = scale[j];
    }
    untranspose(&best_l, NMAX as f32, l);
}
