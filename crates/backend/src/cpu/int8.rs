//! The fast mode of products on Q8_0, Q4_0, Q4_K and Q6_K weights: each activation row is
//! rounded to int8 per block of 32 (`d = max|x| / 127`, `q = round(x / d)`, the Q8_0 rounding with
//! `d` kept in f32), and each block's dot product is summed in integers, then scaled by the two
//! blocks' scales and summed in f32 — the technique of llama.cpp's Q8_0 activation path. A Q4_K
//! sub-block of 32 (`ds · q − dm`) pairs with one activation block: `ds · Σ q q_x − dm · Σ q_x`,
//! the activation sums kept with the rounded rows. A Q6_K block of 32 holds two sub-blocks of 16
//! (`d · sc · (q − 32)`, `sc` an int8 per 16): their integer sums are scaled by `sc` and added
//! in integers (`sc_a · Σ_a + sc_b · Σ_b`, at most 2 · 128 · 32 · 127 · 16 < 2^24 in magnitude:
//! exact in i32 and in its one conversion to f32), so a Q6_K block, like the others, leaves one
//! integer per block of 32 to scale by `d · d_x` in f32 — in the portable and AVX2 kernels; VNNI
//! keeps the two sub-blocks' exact integer sums apart and scales each by `d · sc · d_x` in f32
//! (two FMAs instead of two `vpmulld`: about 5–9% faster at 64–512 rows here).
//!
//! Three kernels ([`Kernel`], the fastest this CPU has picked once by [`kernel`]):
//! - AVX512-VNNI: `vpdpbusd` on 512-bit registers, four blocks per pair of registers
//!   ([`dot_vnni`]); signed weights are offset to unsigned bytes and the offset's share
//!   (`offset · Σ q_x`) is taken back exactly, in the integer sums.
//! - AVX2: `vpmaddubsw`/`vpmaddwd` (for signed weights the sign moved onto the activation, since
//!   `vpmaddubsw` takes one unsigned operand).
//! - elsewhere a portable loop.
//!
//! `TESSERA_INT8_KERNEL=avx2` (or `=portable`) runs a slower kernel than the CPU allows, for A/B
//! measurement; `tessera describe` and `bench quant` name the kernel in use. The x86 kernels
//! ask for the weights a page ahead of their reads ([`super::prefetch`]).
//!
//! Its only roundings besides the f32 sums are the activations' int8 rounding and the weights'
//! own quantization, so it is judged like bf16 against that floor. The integer block sums are
//! exact in every kernel, so the kernels differ only in the order of their f32 sums.

use rayon::prelude::*;
use tessera_core::DType;

use super::panels::Out;
use super::quant::QuantMat;

/// Values per block of both operands.
const BLOCK: usize = 32;

/// Weight rows per task: their blocks (at most 64 × 34 bytes per 2048 inputs, 35 KB in all)
/// stay in L1, or L2 for long rows, while each tile of activation rows passes them all. VNNI
/// prefill's unpacked rows ([`Q4kBlock`], [`Q6kBlock`], [`GroupBlock`]) take 56, 72 and 48 KB per
/// 2048 inputs: L2.
const ROWS_PER_TASK: usize = 16;

/// Whether the int8 path runs products on `dtype` weights (the others run exactly).
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q6_K)
}

/// The block-product kernel of the int8 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `vpdpbusd` on 512-bit registers: AVX512F, AVX512BW and AVX512_VNNI (with AVX2, FMA and
    /// F16C, as every such CPU has).
    Vnni,
    /// `vpmaddubsw`/`vpmaddwd` on 256-bit registers: AVX2, FMA and F16C.
    Avx2,
    /// Integer loops in portable Rust.
    Portable,
}

impl Kernel {
    /// The kernels this CPU runs, fastest first (the portable one always).
    pub fn available() -> Vec<Kernel> {
        let mut all = Vec::with_capacity(3);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                all.push(Kernel::Vnni);
            }
            if avx2 {
                all.push(Kernel::Avx2);
            }
        }
        all.push(Kernel::Portable);
        all
    }

    /// Its name in `describe` and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Vnni => "AVX512-VNNI",
            Kernel::Avx2 => "AVX2",
            Kernel::Portable => "portable",
        }
    }
}

/// The kernel the int8 products run, decided once: the fastest this CPU has, unless
/// `TESSERA_INT8_KERNEL` names a slower one it has (`avx2`, `portable`; for A/B measurement).
/// Any other value, or a kernel this CPU lacks, leaves the fastest.
pub fn kernel() -> Kernel {
    static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        let available = Kernel::available();
        let forced = match std::env::var("TESSERA_INT8_KERNEL").as_deref() {
            Ok("avx2") => Some(Kernel::Avx2),
            Ok("portable") => Some(Kernel::Portable),
            _ => None,
        };
        match forced {
            Some(k) if available.contains(&k) => k,
            _ => available[0],
        }
    })
}

/// Activation rows rounded to int8 per block: `q` row-major (`k` per row), `d` one scale per
/// block, `s` each block's sum of `q` (what a Q4_K sub-block's min multiplies).
pub struct Rows {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<i32>,
}

/// Round `m` rows of `x` (`k` wide, `k` a multiple of 32, at stride `xs`) to int8 blocks, over
/// every thread for a prefill's rows (on one, ~4% of a Q4_K prefill while the other thread
/// waited). Each row alone, so the same bits either way.
pub fn round_rows(x: &[f32], xs: usize, m: usize, k: usize) -> Rows {
    let blocks = k / BLOCK;
    let mut q = vec![0i8; m * k];
    let mut d = vec![0f32; m * blocks];
    let mut sums = vec![0i32; m * blocks];
    // One row: its index, then its values, scales and sums to fill.
    type RowOut<'a> = (usize, ((&'a mut [i8], &'a mut [f32]), &'a mut [i32]));
    let row = |(i, ((qr, dr), sr)): RowOut<'_>| {
        round_row(&x[i * xs..i * xs + k], qr, dr);
        for (s, qb) in sr.iter_mut().zip(qr.chunks_exact(BLOCK)) {
            *s = qb.iter().map(|&v| i32::from(v)).sum();
        }
    };
    let (kc, bc) = (k.max(1), blocks.max(1));
    if m * k >= 1 << 16 {
        q.par_chunks_exact_mut(kc)
            .zip(d.par_chunks_exact_mut(bc))
            .zip(sums.par_chunks_exact_mut(bc))
            .enumerate()
            .for_each(row);
    } else {
        q.chunks_exact_mut(kc)
            .zip(d.chunks_exact_mut(bc))
            .zip(sums.chunks_exact_mut(bc))
            .enumerate()
            .for_each(row);
    }
    Rows { q, d, s: sums }
}

/// One row's blocks of 32 to int8 values `q` and scales `d`. Where the CPU has AVX2 this is
/// compiled for it, so that `round` is `vroundps` inline rather than a call to libm's `roundf`
/// per value (the same results: both round halves away from zero).
fn round_row(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { round_row_avx2(x, q, d) };
        return;
    }
    round_row_body(x, q, d);
}

/// [`round_row`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn round_row_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    round_row_body(x, q, d);
}

#[inline(always)]
fn round_row_body(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((xb, qb), db) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)).zip(d) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        *db = amax / 127.0;
        let id = if *db == 0.0 { 0.0 } else { 1.0 / *db };
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
        }
    }
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
    let ahead = super::prefetch::distance();
    // SAFETY (whole body): block i's bytes are row[i·bb..][..bb], its activations
    // q[r][32·i..][..32] and scale d[r][i], all in bounds for i < nb by the caller's promise.
    let block = |i: usize, acc: &mut [__m256; R]| unsafe {
        let b = row.as_ptr().add(i * bb);
        // Q8_0's 34-byte blocks cross a line every other block, Q4_0's 18 every fourth: one
        // line a block keeps ahead of both.
        super::prefetch::lines::<1>(b, ahead);
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

/// Q6_K's super-block `b` (210 bytes) as its 256 values `q − 32` in order, its 16 scales (one
/// per 16 values) and `d`: the GGUF decoder's own unpacking (`tessera_core::gguf::q6_k_codes`),
/// so the int8 path pairs exactly the decoded weights with the activations.
fn q6_k_block(b: &[u8], out: &mut [i8; 256]) -> ([i8; 16], f32) {
    tessera_core::gguf::q6_k_codes(b, out)
}

/// Q6_K against one rounded activation row, portably: per block of 32 the integer
/// `sc_a · Σ_a (q − 32) q_x + sc_b · Σ_b (q − 32) q_x` over its two sub-blocks of 16, times
/// `d · d_x` in f32.
fn dot_q6_k_plain(row: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let mut w = [0i8; 256];
    let mut acc = 0f32;
    for (b, (qx, dx)) in row
        .chunks_exact(DType::Q6_K.block_bytes())
        .zip(q.chunks_exact(256).zip(d.chunks_exact(8)))
    {
        let (scales, dw) = q6_k_block(b, &mut w);
        for (((wb, xb), sc), &dx) in w
            .chunks_exact(BLOCK)
            .zip(qx.chunks_exact(BLOCK))
            .zip(scales.chunks_exact(2))
            .zip(dx)
        {
            let sub = |r: std::ops::Range<usize>| -> i32 {
                wb[r.clone()]
                    .iter()
                    .zip(&xb[r])
                    .map(|(&a, &b)| i32::from(a) * i32::from(b))
                    .sum()
            };
            let s = i32::from(sc[0]) * sub(0..16) + i32::from(sc[1]) * sub(16..32);
            acc += dw * dx * s as f32;
        }
    }
    acc
}

/// One rounded activation row against one weight row of `dtype`, portably.
fn dot_portable(dtype: DType, row: &[u8], (q, d, s): Act<'_>) -> f32 {
    match dtype {
        DType::Q4_K => dot_q4_k_plain(row, q, d, s),
        DType::Q6_K => dot_q6_k_plain(row, q, d),
        _ => dot_plain(dtype, row, q, d),
    }
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
    let ahead = super::prefetch::distance();
    for (k, b) in row.chunks_exact(bb).enumerate() {
        super::prefetch::lines::<3>(b.as_ptr(), ahead);
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

/// As [`dot_q6_k_plain`] for `R` activation rows at once, with AVX2: each half of a Q6_K block
/// (64 bytes of `ql`, 32 of `qh`) unpacks once for the `R` rows into its four blocks of 32 values
/// `q − 32`; per block and row `vpmaddubsw` (the sign moved onto the activations, as
/// [`dot_avx2`] does) and `vpmaddwd` by the two sub-blocks' scales (eight words of `sc_a`, eight
/// of `sc_b`: a 128-bit lane is one sub-block of 16) leave the block's scaled integer sum in eight
/// lanes, converted and scaled by `d · d_x` in f32 — even and odd blocks in separate
/// accumulators, the same order for every `R`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `row` holds `q[r].len() / 256` Q6_K blocks, each `d[r]` one
/// scale per 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_avx2<const R: usize>(row: &[u8], q: [&[i8]; R], d: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let low = _mm256_set1_epi8(0x0f);
    let top = _mm256_set1_epi8(0x30);
    let offset = _mm256_set1_epi8(32);
    let ahead = super::prefetch::distance();
    for (kb, b) in row.chunks_exact(DType::Q6_K.block_bytes()).enumerate() {
        super::prefetch::lines::<4>(b.as_ptr(), ahead);
        let dw = f16_bits(u16::from_le_bytes([b[208], b[209]]));
        let sc = |j: usize| _mm_set1_epi16(i16::from(b[192 + j] as i8));
        for h in 0..2 {
            // SAFETY: a Q6_K block is 210 bytes: `ql` at 0..128 (this half's 64 at 64·h), `qh`
            // at 128..192 (this half's 32 at 128 + 32·h).
            let (ql0, ql1, qh) = unsafe {
                let p = b.as_ptr();
                (
                    _mm256_loadu_si256(p.add(64 * h).cast()),
                    _mm256_loadu_si256(p.add(64 * h + 32).cast()),
                    _mm256_loadu_si256(p.add(128 + 32 * h).cast()),
                )
            };
            // Quarter t's top two bits are `qh`'s bits 2t, 2t + 1, moved to bits 4, 5 (16-bit
            // shifts: the mask drops what crosses from the neighbouring byte).
            let quarters = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, low),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                    _mm256_and_si256(qh, top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), top),
                ),
            ];
            for (t, q6) in quarters.into_iter().enumerate() {
                let j = 4 * h + t;
                let i = 8 * kb + j;
                let w = _mm256_sub_epi8(q6, offset);
                let abs_w = _mm256_sign_epi8(w, w);
                let scales = _mm256_set_m128i(sc(2 * j + 1), sc(2 * j));
                let acc = &mut acc[t % 2];
                for r in 0..R {
                    // SAFETY: block i's 32 activations and scale are in `q[r]`, `d[r]` (the
                    // caller's promise).
                    let (x, dx) = unsafe {
                        (
                            _mm256_loadu_si256(q[r].as_ptr().add(i * BLOCK).cast()),
                            *d[r].get_unchecked(i),
                        )
                    };
                    // |w| · (x with w's sign): pairs within ±2 · 32 · 127, no saturation.
                    let pairs = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
                    let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scales));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), sums, acc[r]);
                }
            }
        }
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(acc[0][r], acc[1][r])))
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
        match dtype {
            DType::Q4_K => dot_q4_k_avx2(row, a.map(|a| a.0), a.map(|a| a.1), a.map(|a| a.2)),
            DType::Q6_K => dot_q6_k_avx2(row, a.map(|a| a.0), a.map(|a| a.1)),
            _ => dot_avx2(dtype, row, a.map(|a| a.0), a.map(|a| a.1)),
        }
    }
}

/// Blocks of 32 per step of [`dot_vnni`]: their 128 values in two 512-bit registers, their 16
/// lanes of sums (four per block) in one.
const GROUP: usize = 4;

/// What [`dot_vnni`] adds to the weights to make them `vpdpbusd`'s unsigned operand: Q8_0's
/// bytes flip their sign bit (`w + 128`), Q4_0's nibbles are `w + 8` as stored, Q6_K's six bits
/// are `w + 32` as stored; Q4_K's nibbles are unsigned already. A multiple of 4, so the
/// correction `offset · Σ q_x` spreads over a block's four lanes in integers (Q6_K's, per
/// sub-block of 16, sits in one lane: [`Packed::pairs`]).
fn vnni_offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q8_0 => 128,
        DType::Q4_0 => 8,
        DType::Q6_K => 32,
        _ => 0,
    }
}

/// One activation row's group of four blocks as [`dot_vnni`] reads it, in one aligned record of
/// four cache lines: the 128 values as the weights unpack — the four blocks' first 16 values,
/// then their second 16 — and per lane of the group's 16 sums (block `l / 4` for lane `l`) the
/// block scale and the seed `−offset / 4 · Σ q_x` that takes the weights' offset back. Q4_K and
/// Q6_K rows fill two records per block of 256 in a layout of their own ([`Packed::pairs`]).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Record {
    q: [i8; GROUP * BLOCK],
    dx: [f32; 4 * GROUP],
    seed: [i32; 4 * GROUP],
}

/// Rounded activation rows laid out for [`dot_vnni`]: their [`Record`]s, zero-padded to whole
/// groups, those of each tile of [`ROW_TILE`] rows interleaved (group by group, the tile's rows
/// in turn: one pointer walks a tile), then the rows left over one by one; for Q4_K, the values
/// in its own lane layout ([`Packed::pairs`]) and `d · Σ q_x` per row and block (what the
/// sub-blocks' mins multiply).
struct Packed {
    records: Vec<Record>,
    dxs: Vec<f32>,
    groups: usize,
    blocks: usize,
    /// Rows in whole tiles.
    tiled: usize,
}

impl Packed {
    /// Lay out `m` rounded rows of `k` (`k` a multiple of 32) for `dtype` weights.
    fn new(r: &Rows, m: usize, k: usize, dtype: DType) -> Packed {
        let blocks = k / BLOCK;
        let groups = blocks.div_ceil(GROUP);
        let offset = vnni_offset(dtype);
        let q4_k = dtype == DType::Q4_K;
        let zero = Record {
            q: [0; GROUP * BLOCK],
            dx: [0.0; 4 * GROUP],
            seed: [0; 4 * GROUP],
        };
        let mut p = Packed {
            records: vec![zero; m * groups],
            dxs: vec![0.0; if q4_k { m * blocks } else { 0 }],
            groups,
            blocks,
            tiled: m - m % ROW_TILE,
        };
        for i in 0..m {
            if q4_k || dtype == DType::Q6_K {
                p.pairs(r, i, k, offset);
                continue;
            }
            for b in 0..blocks {
                let (g, j) = (b / GROUP, b % GROUP);
                let at = p.at(i, g);
                let rec = &mut p.records[at];
                let src = &r.q[i * k + b * BLOCK..][..BLOCK];
                rec.q[16 * j..][..16].copy_from_slice(&src[..16]);
                rec.q[GROUP * 16 + 16 * j..][..16].copy_from_slice(&src[16..]);
                let (d, s) = (r.d[i * blocks + b], r.s[i * blocks + b]);
                rec.dx[4 * j..][..4].fill(d);
                if dtype == DType::Q6_K {
                    let half = |v: &[i8]| v.iter().map(|&v| i32::from(v)).sum::<i32>();
                    let (a, b) = (half(&src[..16]), half(&src[16..]));
                    rec.seed[4 * j..][..4].copy_from_slice(&[-offset * a, -offset * b, 0, 0]);
                } else {
                    rec.seed[4 * j..][..4].fill(-offset / 4 * s);
                }
            }
        }
        p
    }

    /// Row `i` for Q4_K or Q6_K weights, in the layout of [`Q4kLanes`]: each block's 256 values
    /// in the records of two groups (`2kb`, `2kb + 1`), register `t` (the first record's two
    /// halves, then the second's) holding in lane `2j + e` sub-block `j`'s values
    /// `16e + 4t .. 16e + 4t + 4`; the lane's `d_x` and seed `−offset · Σ q_x` over those 16
    /// values (Q6_K's 32; Q4_K's nibbles need none) in the first record. For Q4_K, `d · Σ q_x`
    /// per sub-block for the mins.
    fn pairs(&mut self, r: &Rows, i: usize, k: usize, offset: i32) {
        let blocks = self.blocks;
        for b in 0..blocks {
            let (kb, j) = (b / 8, b % 8);
            let src = &r.q[i * k + b * BLOCK..][..BLOCK];
            for e in 0..2 {
                for t in 0..4 {
                    let at = self.at(i, 2 * kb + t / 2);
                    let lane = 2 * j + e;
                    self.records[at].q[64 * (t % 2) + 4 * lane..][..4]
                        .copy_from_slice(&src[16 * e + 4 * t..][..4]);
                }
                let at = self.at(i, 2 * kb);
                let half: i32 = src[16 * e..][..16].iter().map(|&v| i32::from(v)).sum();
                self.records[at].dx[2 * j + e] = r.d[i * blocks + b];
                self.records[at].seed[2 * j + e] = -offset * half;
            }
            if let Some(d) = self.dxs.get_mut(i * blocks + b) {
                *d = r.d[i * blocks + b] * r.s[i * blocks + b] as f32;
            }
        }
    }

    /// Where row `i`'s record of group `g` is.
    fn at(&self, i: usize, g: usize) -> usize {
        if i < self.tiled {
            (i / ROW_TILE * self.groups + g) * ROW_TILE + i % ROW_TILE
        } else {
            i * self.groups + g
        }
    }

    /// The records of the tile from row `i`, or of row `i` alone past the tiles (`rows` 1).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn records(&self, i: usize, rows: usize) -> &[Record] {
        &self.records[i * self.groups..(i + rows) * self.groups]
    }

    /// Row `i`'s `d · Σ q_x` per block (empty but for Q4_K).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn dxs(&self, i: usize) -> &[f32] {
        self.dxs
            .get(i * self.blocks..(i + 1) * self.blocks)
            .unwrap_or(&[])
    }
}

/// Q4_K's eight 6-bit scales and eight 6-bit mins as `scale_min` reads them, a byte each
/// (sub-block `j` in byte `j`), four at a time in 32-bit words.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn q4_k_scales_mins(s: &[u8; 12]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let scales = (a & low6, (c & low4) | (((a >> 6) & top2) << 4));
    let mins = (b & low6, ((c >> 4) & low4) | (((b >> 6) & top2) << 4));
    let join = |(lo, hi): (u32, u32)| u64::from(lo) | u64::from(hi) << 32;
    (join(scales), join(mins))
}

/// As [`dot_plain`]/[`dot_q4_k_plain`] for `R` activation rows at once, with AVX512-VNNI, four
/// blocks of 32 per step: the weights unpack once for the `R` rows into two registers (every
/// block's first 16 values, then its second 16, as [`Packed`] lays out the activations), and
/// two `vpdpbusd` leave each block's integer sum in four lanes of one register, seeded with
/// `−offset / 4 · Σ q_x` so the four lanes sum exactly to `Σ q_w q_x` ([`vnni_offset`]). One
/// conversion and one FMA by the lanes' `d_w · d_x` per step and row; one accumulator per row,
/// summed in the same order for every `R`. Q4_K and Q6_K take a layout of their own
/// ([`Q4kLanes`], [`Q6kLanes`]: a block's eight sub-blocks of 32 in two lanes each, one
/// conversion and FMA per block and row); Q4_K's mins (`dm · d_x · Σ q_x`) accumulate in an
/// eight-lane vector per row. The lane tables are constants (`lane_registers!`).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX512F, AVX512BW and AVX512_VNNI; `row` holds whole blocks of
/// `dtype`; `records` holds `R` rows' [`Record`]s of as many blocks of 32, group by group
/// ([`Packed::records`]), and for Q4_K each `dxs[r]` one entry per block of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn dot_vnni<const R: usize>(
    dtype: DType,
    row: &[u8],
    records: &[Record],
    dxs: [&[f32]; R],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); R];
    if dtype == DType::Q6_K {
        let lanes = Q6kLanes::LANES;
        let ahead = super::prefetch::distance();
        for (kb, b) in row.chunks_exact(DType::Q6_K.block_bytes()).enumerate() {
            super::prefetch::lines::<4>(b.as_ptr(), ahead);
            // SAFETY: `b` is one whole Q6_K block; `records` as the caller promises.
            unsafe {
                let (w, dw) = lanes.unpack(b);
                pairs_step(records, kb, &w, dw, true, &mut acc);
            }
        }
        return std::array::from_fn(|r| _mm512_reduce_add_ps(acc[r]));
    }
    if dtype == DType::Q4_K {
        let lanes = Q4kLanes::LANES;
        let mut mins = [_mm256_setzero_ps(); R];
        let ahead = super::prefetch::distance();
        for (kb, b) in row.chunks_exact(DType::Q4_K.block_bytes()).enumerate() {
            super::prefetch::lines::<3>(b.as_ptr(), ahead);
            // SAFETY: `b` is one whole Q4_K block; `records` and `dxs` as the caller promises.
            unsafe {
                let (w, dw, dm) = lanes.unpack(b);
                pairs_step(records, kb, &w, dw, false, &mut acc);
                q4_k_mins(dm, dxs, kb, &mut mins);
            }
        }
        return std::array::from_fn(|r| _mm512_reduce_add_ps(acc[r]) - hsum(mins[r]));
    }
    // SAFETY: as the caller promises (`row` whole blocks of `dtype`, the CPU's features;
    // `records` R records per group, g one of them).
    unsafe {
        for_each_group(dtype, row, |g, wa, wb, dw| {
            vnni_step(records, g, (wa, wb, dw), &mut acc)
        })
    };
    std::array::from_fn(|r| _mm512_reduce_add_ps(acc[r]))
}

/// Every group of four Q8_0 or Q4_0 blocks of `row` unpacked as [`dot_vnni`] takes them (the
/// two weight registers and the lanes' scales), in order, to `f` with its index; where the
/// row's blocks are not a multiple of four, its last blocks beside zero blocks (scale 0, against
/// zero activations). The weights are prefetched a page ahead ([`super::prefetch`]).
///
/// # Safety
/// The CPU has AVX2, F16C, AVX512F and AVX512BW; `row` holds whole blocks of `dtype`, which is
/// Q8_0 or Q4_0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn for_each_group(
    dtype: DType,
    row: &[u8],
    mut f: impl FnMut(
        usize,
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512,
    ),
) {
    use std::arch::x86_64::*;
    let low = _mm512_set1_epi8(0x0f);
    let bb = dtype.block_bytes();
    let q8 = dtype == DType::Q8_0;
    // Each block's scale word, four times: Q8_0's at every 17th word of two 64-byte loads,
    // Q4_0's at every 9th of one.
    let words = |w: [i16; 4]| {
        let mut idx = [0i16; 32];
        for (i, v) in idx[..16].iter_mut().enumerate() {
            *v = w[i / 4];
        }
        // SAFETY: 32 words.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    };
    let (q8_scales, q4_scales) = (words([0, 17, 34, 51]), words([0, 9, 18, 27]));
    let flip = _mm512_set1_epi8(i8::MIN);
    // Four blocks at `p` (Q8_0: 136 bytes, Q4_0: 72) into the two weight registers and the
    // lanes' scales.
    let unpack = |p: *const u8| -> (__m512i, __m512i, __m512) {
        // SAFETY: four whole blocks at `p` (the callers' promise): every load below ends within
        // them.
        unsafe {
            if q8 {
                let b = |i: usize| _mm256_loadu_si256(p.add(i * bb + 2).cast());
                let b01 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(0)), b(1));
                let b23 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(2)), b(3));
                let wa = _mm512_shuffle_i64x2::<0b10_00_10_00>(b01, b23);
                let wb = _mm512_shuffle_i64x2::<0b11_01_11_01>(b01, b23);
                let d = _mm512_permutex2var_epi16(
                    _mm512_loadu_si512(p.cast()),
                    q8_scales,
                    _mm512_loadu_si512(p.add(64).cast()),
                );
                let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(d));
                (_mm512_xor_si512(wa, flip), _mm512_xor_si512(wb, flip), dw)
            } else {
                let b = |i: usize| _mm_loadu_si128(p.add(i * bb + 2).cast());
                let t = _mm512_castsi128_si512(b(0));
                let t = _mm512_inserti32x4::<1>(t, b(1));
                let t = _mm512_inserti32x4::<2>(t, b(2));
                let t = _mm512_inserti32x4::<3>(t, b(3));
                let d = _mm512_permutexvar_epi16(q4_scales, _mm512_loadu_si512(p.cast()));
                let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(d));
                let wa = _mm512_and_si512(t, low);
                let wb = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
                (wa, wb, dw)
            }
        }
    };
    let nb = row.len() / bb;
    let whole = nb / GROUP;
    let ahead = super::prefetch::distance();
    for g in 0..whole {
        // SAFETY: blocks 4g..4g+4 of `row`.
        let p = unsafe { row.as_ptr().add(g * GROUP * bb) };
        // Four blocks: 136 bytes of Q8_0, 72 of Q4_0.
        if q8 {
            super::prefetch::lines::<3>(p, ahead);
        } else {
            super::prefetch::lines::<2>(p, ahead);
        }
        let (wa, wb, dw) = unpack(p);
        f(g, wa, wb, dw);
    }
    let tail = nb - whole * GROUP;
    if tail > 0 {
        // The last blocks beside zero blocks (scale 0, against zero activations).
        let mut four = [0u8; GROUP * 34];
        four[..tail * bb].copy_from_slice(&row[whole * GROUP * bb..]);
        let (wa, wb, dw) = unpack(four.as_ptr());
        f(whole, wa, wb, dw);
    }
}

/// One block of every VNNI kernel: `vpdpbusd` of each weight register with its activation
/// register from `seed`, in order, then `acc + float(Σ) · (dw · dx)`. Decode, prefill's lone
/// rows and its tiles all step through here, so a row's result is the same bits in each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
fn block_step(
    seed: std::arch::x86_64::__m512i,
    w: &[std::arch::x86_64::__m512i],
    x: &[std::arch::x86_64::__m512i],
    dw: std::arch::x86_64::__m512,
    dx: std::arch::x86_64::__m512,
    acc: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), x.len());
    // A `for` loop, not `fold`: LLVM left `fold`'s closure out of line here, a call per block.
    let mut dot = seed;
    for (w, x) in w.iter().zip(x) {
        dot = _mm512_dpbusd_epi32(dot, *w, *x);
    }
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc)
}

/// One group of four blocks of 32 (`wa`, `wb`: every block's first 16 values, then its second
/// 16; `dw` the lanes' weight scales) against `R` activation rows' records of group `g`: two
/// `vpdpbusd` leave each block's integer sum in four lanes, seeded with
/// `−offset / 4 · Σ q_x` so the four lanes sum exactly to `Σ q_w q_x` ([`vnni_offset`]); one
/// conversion and one FMA by the lanes' `d_w · d_x` per row into its accumulator.
///
/// # Safety
/// The CPU has AVX512F and AVX512_VNNI; `records` holds `R` records per group, group by group,
/// and `g` is one of its groups.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn vnni_step<const R: usize>(
    records: &[Record],
    g: usize,
    (wa, wb, dw): (
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512,
    ),
    acc: &mut [std::arch::x86_64::__m512; R],
) {
    use std::arch::x86_64::*;
    for (r, acc) in acc.iter_mut().enumerate() {
        // SAFETY: `records` holds R records per group and g is one of its groups (the caller's
        // promise); each record 128 values, 16 scales and 16 seeds.
        unsafe {
            let rec = records.get_unchecked(g * R + r);
            let x = rec.q.as_ptr();
            *acc = block_step(
                _mm512_loadu_si512(rec.seed.as_ptr().cast()),
                &[wa, wb],
                &[
                    _mm512_loadu_si512(x.cast()),
                    _mm512_loadu_si512(x.add(64).cast()),
                ],
                dw,
                _mm512_loadu_ps(rec.dx.as_ptr()),
                *acc,
            );
        }
    }
}

/// A group of four Q8_0 or Q4_0 blocks unpacked as [`for_each_group`] gives it: the two weight
/// registers and the lanes' scales. 192 bytes for Q4_0's 72 (Q8_0's 136), so made once per
/// task for prefill ([`group_unpack`]), where every tile of rows would otherwise unpack the
/// same weights again.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct GroupBlock {
    w: [[u8; 64]; 2],
    dw: [f32; 16],
}

/// Unpack a Q8_0 or Q4_0 row's groups onto the end of `out`, as [`dot_vnni`] unpacks them.
///
/// # Safety
/// As [`for_each_group`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn group_unpack(dtype: DType, row: &[u8], out: &mut Vec<GroupBlock>) {
    use std::arch::x86_64::*;
    // SAFETY: as the caller promises; each store fills one of the block's arrays.
    unsafe {
        for_each_group(dtype, row, |_, wa, wb, dw| {
            let mut u = GroupBlock {
                w: [[0; 64]; 2],
                dw: [0.0; 16],
            };
            _mm512_storeu_si512(u.w[0].as_mut_ptr().cast(), wa);
            _mm512_storeu_si512(u.w[1].as_mut_ptr().cast(), wb);
            _mm512_storeu_ps(u.dw.as_mut_ptr(), dw);
            out.push(u);
        })
    };
}

/// Registers of sixteen 32-bit lanes made at compile time, lane `l` of register `t` holding the
/// expression: the index and shift registers of [`Q4kLanes`] and [`Q6kLanes`]. Constants, so
/// no kernel builds them at run time whatever LLVM decides to inline into it (tables built by
/// closures stayed out of line, a call per weight row, once `dot_vnni` grew).
#[cfg(target_arch = "x86_64")]
macro_rules! lane_registers {
    ($n:literal, |$l:ident, $t:ident| $e:expr) => {{
        let mut v = [[0i32; 16]; $n];
        let mut $t = 0i32;
        while $t < $n {
            let mut $l = 0i32;
            while $l < 16 {
                v[$t as usize][$l as usize] = $e;
                $l += 1;
            }
            $t += 1;
        }
        // SAFETY: sixteen i32 are one 512-bit register's 64 bytes; every bit pattern is valid.
        unsafe { std::mem::transmute::<[[i32; 16]; $n], [std::arch::x86_64::__m512i; $n]>(v) }
    }};
    (|$l:ident| $e:expr) => {
        lane_registers!(1, |$l, _t| $e)[0]
    };
}

/// Q4_K for [`dot_vnni`]: one block (256 values, eight sub-blocks of 32) in four registers
/// whose lane `2j + e` holds, in register `t`, sub-block `j`'s values `16e + 4t .. 16e + 4t + 4`
/// — so four `vpdpbusd` leave each sub-block's sum in two lanes (its halves), and one
/// conversion, one scale product and one FMA per block and row take the whole block, where
/// four blocks of 32 a register took two of each per four sub-blocks. The index and shift
/// registers that make that layout from the stored nibbles, compile-time constants.
#[cfg(target_arch = "x86_64")]
struct Q4kLanes {
    /// Per register `t`: lane `L = 4i + 2h + e` takes dword `8i + 4e + t` of the 128 bytes of
    /// nibbles (the 32 bytes of sub-blocks `2i`, `2i + 1`: low nibbles `2i`, high `2i + 1`).
    idx: [std::arch::x86_64::__m512i; 4],
    /// Lane `L`'s nibble: `4h` bits down.
    shift: std::arch::x86_64::__m512i,
    /// Sub-block `j`'s scale into lanes `2j`, `2j + 1`.
    spread: std::arch::x86_64::__m512i,
}

#[cfg(target_arch = "x86_64")]
impl Q4kLanes {
    const LANES: Self = Q4kLanes {
        idx: lane_registers!(4, |l, t| 8 * (l / 4) + 4 * (l % 2) + t),
        shift: lane_registers!(|l| 4 * ((l / 2) % 2)),
        spread: lane_registers!(|l| l / 2),
    };

    /// Block `b` (144 bytes) as its four registers, its lanes' `d · sc` and its eight
    /// sub-blocks' `dmin · m`.
    ///
    /// # Safety
    /// The CPU has AVX2, F16C, AVX512F; `b` holds one whole Q4_K block.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    #[inline]
    unsafe fn unpack(
        &self,
        b: &[u8],
    ) -> (
        [std::arch::x86_64::__m512i; 4],
        std::arch::x86_64::__m512,
        std::arch::x86_64::__m256,
    ) {
        use std::arch::x86_64::*;
        let low = _mm512_set1_epi8(0x0f);
        let dd = f16_bits(u16::from_le_bytes([b[0], b[1]]));
        let dmin = f16_bits(u16::from_le_bytes([b[2], b[3]]));
        let mut packed = [0u8; 12];
        packed.copy_from_slice(&b[4..16]);
        let (sc, mn) = q4_k_scales_mins(&packed);
        let bytes = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
        let ds = _mm256_mul_ps(_mm256_set1_ps(dd), bytes(sc));
        let dm = _mm256_mul_ps(_mm256_set1_ps(dmin), bytes(mn));
        // SAFETY: a Q4_K block is 144 bytes, its nibbles at 16..144.
        let (q0, q1) = unsafe {
            (
                _mm512_loadu_si512(b.as_ptr().add(16).cast()),
                _mm512_loadu_si512(b.as_ptr().add(80).cast()),
            )
        };
        let w = self.idx.map(|idx| {
            let v = _mm512_permutex2var_epi32(q0, idx, q1);
            _mm512_and_si512(_mm512_srlv_epi32(v, self.shift), low)
        });
        let dw = _mm512_permutexvar_ps(self.spread, _mm512_castps256_ps512(ds));
        (w, dw, dm)
    }
}

/// Q6_K for [`dot_vnni`], in [`Q4kLanes`]'s layout: register `t`, lane `2j + e` holds
/// sub-block `j`'s values `16e + 4t .. 16e + 4t + 4` — each lane one of Q6_K's sub-blocks of 16,
/// so lane `L`'s scale is the block's scale `L`, and one conversion and FMA per block and row
/// take what took two of each per half block. The six-bit `q` (`w + 32`, unsigned as
/// `vpdpbusd` takes it) from four bits of `ql` and two of `qh`.
#[cfg(target_arch = "x86_64")]
struct Q6kLanes {
    /// Per register: the `ql` dword (of 32) and the `qh` dword (of 16) of each lane.
    low: [std::arch::x86_64::__m512i; 4],
    high: [std::arch::x86_64::__m512i; 4],
    /// Each lane's shift to its nibble of `ql` and its two bits of `qh`.
    low_shift: std::arch::x86_64::__m512i,
    high_shift: std::arch::x86_64::__m512i,
}

#[cfg(target_arch = "x86_64")]
impl Q6kLanes {
    // Lane L: sub-block j = L / 2 (half n = j / 4 of the block, quarter q = j % 4 of it), half
    // e = L % 2 of the sub-block. Value 16e + 4t + i of sub-block j is stored in `ql` byte
    // 64n + 32(q % 2) + 16e + 4t + i (nibble q / 2) and `qh` byte 32n + 16e + 4t + i (bits 2q,
    // 2q + 1).
    const LANES: Self = {
        const fn n(l: i32) -> i32 {
            l / 8
        }
        const fn q(l: i32) -> i32 {
            (l / 2) % 4
        }
        const fn e(l: i32) -> i32 {
            l % 2
        }
        Q6kLanes {
            low: lane_registers!(4, |l, t| 16 * n(l) + 8 * (q(l) % 2) + 4 * e(l) + t),
            high: lane_registers!(4, |l, t| 8 * n(l) + 4 * e(l) + t),
            low_shift: lane_registers!(|l| 4 * (q(l) / 2)),
            high_shift: lane_registers!(|l| 2 * q(l)),
        }
    };

    /// Block `b` (210 bytes) as its four registers and its lanes' `d · sc`.
    ///
    /// # Safety
    /// The CPU has AVX2, F16C, AVX512F and AVX512BW; `b` holds one whole Q6_K block.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    #[inline]
    unsafe fn unpack(
        &self,
        b: &[u8],
    ) -> ([std::arch::x86_64::__m512i; 4], std::arch::x86_64::__m512) {
        use std::arch::x86_64::*;
        let (nibble, two) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x03));
        // SAFETY: a Q6_K block is 210 bytes: `ql` at 0..128, `qh` at 128..192, the 16 scales
        // at 192..208, `d` at 208.
        let (ql0, ql1, qh, sc) = unsafe {
            let p = b.as_ptr();
            (
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
                _mm512_loadu_si512(p.add(128).cast()),
                _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192).cast())),
            )
        };
        let w = std::array::from_fn(|t| {
            let lo = _mm512_permutex2var_epi32(ql0, self.low[t], ql1);
            let lo = _mm512_and_si512(_mm512_srlv_epi32(lo, self.low_shift), nibble);
            let hi = _mm512_permutexvar_epi32(self.high[t], qh);
            let hi = _mm512_and_si512(_mm512_srlv_epi32(hi, self.high_shift), two);
            _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4))
        });
        let d = f16_bits(u16::from_le_bytes([b[208], b[209]]));
        (w, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sc)))
    }
}

/// One Q4_K or Q6_K block (`w`, `dw` from [`Q4kLanes::unpack`], [`Q6kLanes::unpack`]) against
/// `R` activation rows' records of groups `2kb`, `2kb + 1` ([`Packed::pairs`]): four
/// `vpdpbusd` from the lanes' seeds (Q6_K's `−32 · Σ q_x` of each half sub-block) or from zero
/// (Q4_K), then the conversion and one FMA by the lanes' `d_w · d_x` into each row's
/// accumulator.
///
/// # Safety
/// The CPU has AVX512F and AVX512_VNNI; `records` holds `R` records per group, group by group,
/// for at least `2kb + 2` groups.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn pairs_step<const R: usize>(
    records: &[Record],
    kb: usize,
    w: &[std::arch::x86_64::__m512i; 4],
    dw: std::arch::x86_64::__m512,
    seeded: bool,
    acc: &mut [std::arch::x86_64::__m512; R],
) {
    use std::arch::x86_64::*;
    for (r, acc) in acc.iter_mut().enumerate() {
        // SAFETY: as the caller promises of `records`.
        unsafe {
            let (a, b) = (
                records.get_unchecked(2 * kb * R + r),
                records.get_unchecked((2 * kb + 1) * R + r),
            );
            let seed = if seeded {
                _mm512_loadu_si512(a.seed.as_ptr().cast())
            } else {
                _mm512_setzero_si512()
            };
            let x = |rec: &Record, half: usize| {
                _mm512_loadu_si512(rec.q.as_ptr().add(64 * half).cast())
            };
            let xs = [x(a, 0), x(a, 1), x(b, 0), x(b, 1)];
            *acc = block_step(seed, w, &xs, dw, _mm512_loadu_ps(a.dx.as_ptr()), *acc);
        }
    }
}

/// Q4_K block `kb`'s mins for `R` rows: `dm · (d · Σ q_x)` per sub-block into each row's
/// eight lanes.
///
/// # Safety
/// The CPU has AVX2 and FMA; each `dxs[r]` holds at least `8kb + 8` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4_k_mins<const R: usize>(
    dm: std::arch::x86_64::__m256,
    dxs: [&[f32]; R],
    kb: usize,
    mins: &mut [std::arch::x86_64::__m256; R],
) {
    use std::arch::x86_64::*;
    for r in 0..R {
        // SAFETY: as the caller promises.
        let d = unsafe { _mm256_loadu_ps(dxs[r].as_ptr().add(8 * kb)) };
        mins[r] = _mm256_fmadd_ps(dm, d, mins[r]);
    }
}

/// A Q4_K block unpacked as [`dot_vnni`] uses it ([`Q4kLanes::unpack`]): its four weight
/// registers, lane scales `d · sc` and eight sub-blocks' `dmin · m`. 2.7 times the packed
/// block's bytes, so made once per task for prefill ([`q4_k_unpack`]), where every tile of rows
/// would otherwise unpack the same weights again.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Q4kBlock {
    w: [[u8; 64]; 4],
    dw: [f32; 16],
    dm: [f32; 8],
}

/// Unpack a Q4_K row's blocks onto the end of `out`, as [`dot_vnni`] unpacks them.
///
/// # Safety
/// The CPU has AVX2, F16C and AVX512F; `row` holds whole Q4_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn q4_k_unpack(row: &[u8], out: &mut Vec<Q4kBlock>) {
    use std::arch::x86_64::*;
    let lanes = Q4kLanes::LANES;
    let ahead = super::prefetch::distance();
    for b in row.chunks_exact(DType::Q4_K.block_bytes()) {
        super::prefetch::lines::<3>(b.as_ptr(), ahead);
        let mut u = Q4kBlock {
            w: [[0; 64]; 4],
            dw: [0.0; 16],
            dm: [0.0; 8],
        };
        // SAFETY: `b` is one whole Q4_K block; `u`'s arrays hold what is stored.
        unsafe {
            let (w, dw, dm) = lanes.unpack(b);
            for (dst, w) in u.w.iter_mut().zip(w) {
                _mm512_storeu_si512(dst.as_mut_ptr().cast(), w);
            }
            _mm512_storeu_ps(u.dw.as_mut_ptr(), dw);
            _mm256_storeu_ps(u.dm.as_mut_ptr(), dm);
        }
        out.push(u);
    }
}

/// Weight rows per call of the prefill's [`dot_vnni_4x4`]: with [`ROW_TILE`] activation rows,
/// sixteen outputs whose horizontal sums ([`reduce_4x4`]) take a quarter of the instructions of
/// sixteen separate ones. A 4 × 1 call over a 1,024-wide Q4_K row spent ~30% of its time on its
/// sums, its setup and the call.
const WEIGHT_TILE: usize = 4;

/// A weight row's block as prefill unpacks it ([`GroupBlock`], [`Q4kBlock`]), for
/// [`dot_vnni_4x4`]: its weight registers as [`vnni_step`] or [`pairs_step`] take them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
trait Unpacked {
    /// Weight registers of one block, each against half a [`Record`]'s values: two (a group of
    /// four blocks of 32) or four (a Q4_K block, against two records).
    const REGS: usize;
    /// Whether the sums start from the records' seeds (as [`vnni_step`]'s do).
    const SEEDED: bool;
    /// The block's weight registers and its lanes' scales.
    fn registers(&self) -> (&[[u8; 64]], &[f32; 16]);
    /// Q4_K's eight sub-blocks' `dmin · m`, taken off against the rows' `d · Σ q_x`.
    fn mins(&self) -> Option<&[f32; 8]> {
        None
    }
}

impl Unpacked for GroupBlock {
    const REGS: usize = 2;
    const SEEDED: bool = true;
    fn registers(&self) -> (&[[u8; 64]], &[f32; 16]) {
        (&self.w, &self.dw)
    }
}

impl Unpacked for Q6kBlock {
    const REGS: usize = 4;
    const SEEDED: bool = true;
    fn registers(&self) -> (&[[u8; 64]], &[f32; 16]) {
        (&self.w, &self.dw)
    }
}

impl Unpacked for Q4kBlock {
    const REGS: usize = 4;
    const SEEDED: bool = false;
    fn registers(&self) -> (&[[u8; 64]], &[f32; 16]) {
        (&self.w, &self.dw)
    }
    fn mins(&self) -> Option<&[f32; 8]> {
        Some(&self.dm)
    }
}

/// [`dot_vnni`] on one weight row unpacked by [`group_unpack`], [`q4_k_unpack`] or
/// [`q6_k_unpack`]: the same operations in the same order ([`vnni_step`]'s or
/// [`pairs_step`]'s), so the same results, without unpacking.
///
/// # Safety
/// As [`dot_vnni`]'s, `row` one weight row's unpacked blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn dot_unpacked<const R: usize, B: Unpacked>(
    row: &[B],
    records: &[Record],
    dxs: [&[f32]; R],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); R];
    let mut mins = [_mm256_setzero_ps(); R];
    for (kb, u) in row.iter().enumerate() {
        let (regs, dw) = u.registers();
        let base = kb * (B::REGS / 2);
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `records` holds R records per group, group by group, for every block's
            // groups (the caller's promise); `regs` holds B::REGS registers.
            unsafe {
                let rec = |t: usize| records.get_unchecked((base + t / 2) * R + r);
                let seed = if B::SEEDED {
                    _mm512_loadu_si512(rec(0).seed.as_ptr().cast())
                } else {
                    _mm512_setzero_si512()
                };
                let x = activation_registers::<B>(rec);
                let w = weight_registers::<B>(regs);
                *acc = block_step(
                    seed,
                    &w[..B::REGS],
                    &x[..B::REGS],
                    _mm512_loadu_ps(dw.as_ptr()),
                    _mm512_loadu_ps(rec(0).dx.as_ptr()),
                    *acc,
                );
            }
        }
        if let Some(dm) = u.mins() {
            // SAFETY: each `dxs[r]` holds 8 values per block (the caller's promise for Q4_K).
            unsafe { q4_k_mins(_mm256_loadu_ps(dm.as_ptr()), dxs, kb, &mut mins) };
        }
    }
    let has_mins = row.first().and_then(Unpacked::mins).is_some();
    std::array::from_fn(|r| {
        let sum = _mm512_reduce_add_ps(acc[r]);
        if has_mins { sum - hsum(mins[r]) } else { sum }
    })
}

/// An unpacked block's weight registers, the first `B::REGS` of four (the rest zero).
///
/// # Safety
/// The CPU has AVX512F; `regs` holds `B::REGS` registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn weight_registers<B: Unpacked>(regs: &[[u8; 64]]) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    // SAFETY: register t < B::REGS is in `regs` (the caller's promise).
    std::array::from_fn(|t| unsafe {
        if t < B::REGS {
            _mm512_loadu_si512(regs.get_unchecked(t).as_ptr().cast())
        } else {
            _mm512_setzero_si512()
        }
    })
}

/// The activation registers a block of `B` pairs with: register `t` is half `t % 2` of record
/// `rec(t)` (records `t / 2` of the block's groups), the first `B::REGS` of four.
///
/// # Safety
/// The CPU has AVX512F; `rec(t)` is a valid record for each `t < B::REGS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn activation_registers<'a, B: Unpacked>(
    rec: impl Fn(usize) -> &'a Record,
) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    // SAFETY: each record holds 128 values, so either half is one load.
    std::array::from_fn(|t| unsafe {
        if t < B::REGS {
            _mm512_loadu_si512(rec(t).q.as_ptr().add(64 * (t % 2)).cast())
        } else {
            _mm512_setzero_si512()
        }
    })
}

/// [`dot_unpacked`] for [`WEIGHT_TILE`] weight rows at once against [`ROW_TILE`] activation
/// rows: `out[r][w]` is, bit for bit, the `r`-th result of that function on `rows[w]` — each
/// output's accumulators take the same operations in the same order, and [`reduce_4x4`] sums
/// lanes in `_mm512_reduce_add_ps`'s and [`hsum`]'s order.
///
/// # Safety
/// As [`dot_unpacked`]'s, for each row of `rows`, all of one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn dot_vnni_4x4<B: Unpacked>(
    rows: [&[B]; WEIGHT_TILE],
    records: &[Record],
    dxs: [&[f32]; ROW_TILE],
) -> [[f32; WEIGHT_TILE]; ROW_TILE] {
    use std::arch::x86_64::*;
    let blocks = rows[0].len();
    debug_assert!(rows.iter().all(|r| r.len() == blocks));
    let mut acc = [[_mm512_setzero_ps(); ROW_TILE]; WEIGHT_TILE];
    // A block's registers pair with the values of REGS / 2 records, from group `base`.
    let per = B::REGS / 2;
    for kb in 0..blocks {
        let base = kb * per;
        for r in 0..ROW_TILE {
            // SAFETY: `records` holds ROW_TILE records per group, group by group, for every
            // block's groups; every row of `rows` holds `blocks` blocks (the caller's promise).
            unsafe {
                let rec = |t: usize| records.get_unchecked((base + t / 2) * ROW_TILE + r);
                let x = activation_registers::<B>(rec);
                let dx = _mm512_loadu_ps(rec(0).dx.as_ptr());
                let seed = if B::SEEDED {
                    _mm512_loadu_si512(rec(0).seed.as_ptr().cast())
                } else {
                    _mm512_setzero_si512()
                };
                for (w, acc) in acc.iter_mut().enumerate() {
                    let (regs, dw) = rows[w].get_unchecked(kb).registers();
                    let wt = weight_registers::<B>(regs);
                    let dw = _mm512_loadu_ps(dw.as_ptr());
                    acc[r] = block_step(seed, &wt[..B::REGS], &x[..B::REGS], dw, dx, acc[r]);
                }
            }
        }
    }
    let sums = reduce_4x4(std::array::from_fn(|o| acc[o / 4][o % 4]));
    let sums = if rows[0].first().and_then(Unpacked::mins).is_some() {
        let mut mins = [[_mm256_setzero_ps(); ROW_TILE]; WEIGHT_TILE];
        for kb in 0..blocks {
            for (w, mins) in mins.iter_mut().enumerate() {
                // SAFETY: every block of this format has mins; one `d · Σ q_x` per sub-block, 8
                // per block (the caller's promise).
                unsafe {
                    let dm = rows[w].get_unchecked(kb).mins().unwrap_unchecked();
                    q4_k_mins(_mm256_loadu_ps(dm.as_ptr()), dxs, kb, mins);
                }
            }
        }
        // Outputs 2k and 2k + 1 as one register's halves, as `reduce_halves` takes them.
        let pairs = std::array::from_fn(|k| {
            let (a, b) = (
                mins[2 * k / 4][2 * k % 4],
                mins[(2 * k + 1) / 4][(2 * k + 1) % 4],
            );
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(a)),
                _mm256_castps_pd(b),
            ))
        });
        _mm512_sub_ps(sums, reduce_halves(pairs))
    } else {
        sums
    };
    let mut out = [0f32; ROW_TILE * WEIGHT_TILE];
    // SAFETY: `out` holds 16 values.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sums) };
    std::array::from_fn(|r| std::array::from_fn(|w| out[4 * r + w]))
}

/// Sixteen registers' lane sums in one: lane `4r + w` holds the sum of `v[4w + r]`'s sixteen
/// lanes, added pairwise in `_mm512_reduce_add_ps`'s order (lane `i` with `i + 8`, then `i + 4`,
/// `i + 2`, `i + 1`), so each equals that intrinsic's result for its register bit for bit. A
/// butterfly: each level adds two registers' halves into one, 15 additions for the 16 sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce_4x4(v: [std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Lanes i and i + 8: registers 2k and 2k + 1 into the halves of one.
    let halves = std::array::from_fn(|k| {
        let (a, b) = (v[2 * k], v[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    reduce_halves(halves)
}

/// [`reduce_4x4`] from its second level: eight registers, each two outputs' eight partial sums
/// (output `2k` in register `k`'s low half, `2k + 1` in its high half); lanes `i` and `i + 4`,
/// then `i + 2`, `i + 1` — [`hsum`]'s order for an eight-lane register, so the Q4_K mins take it
/// too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce_halves(c: [std::arch::x86_64::__m512; 8]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Lanes i and i + 4: each 128-bit lane one output's four partial sums.
    let quarters: [__m512; 4] = std::array::from_fn(|k| {
        let (a, b) = (c[2 * k], c[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // Lanes i and i + 2 within each 128-bit lane: two outputs' two partial sums a lane.
    let pairs: [__m512; 2] = std::array::from_fn(|k| {
        let (a, b) = (quarters[2 * k], quarters[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    // Lanes i and i + 1.
    let (a, b) = (pairs[0], pairs[1]);
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

/// A Q6_K block unpacked as [`dot_vnni`] uses it ([`Q6kLanes::unpack`]): its four weight
/// registers and lane scales `d · sc`. For prefill, as [`Q4kBlock`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Q6kBlock {
    w: [[u8; 64]; 4],
    dw: [f32; 16],
}

/// Unpack a Q6_K row's blocks onto the end of `out`, as [`dot_vnni`] unpacks them.
///
/// # Safety
/// The CPU has AVX2, F16C, AVX512F and AVX512BW; `row` holds whole Q6_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn q6_k_unpack(row: &[u8], out: &mut Vec<Q6kBlock>) {
    use std::arch::x86_64::*;
    let lanes = Q6kLanes::LANES;
    let ahead = super::prefetch::distance();
    for b in row.chunks_exact(DType::Q6_K.block_bytes()) {
        super::prefetch::lines::<4>(b.as_ptr(), ahead);
        let mut u = Q6kBlock {
            w: [[0; 64]; 4],
            dw: [0.0; 16],
        };
        // SAFETY: `b` is one whole Q6_K block; `u`'s arrays hold what is stored.
        unsafe {
            let (w, dw) = lanes.unpack(b);
            for (dst, w) in u.w.iter_mut().zip(w) {
                _mm512_storeu_si512(dst.as_mut_ptr().cast(), w);
            }
            _mm512_storeu_ps(u.dw.as_mut_ptr(), dw);
        }
        out.push(u);
    }
}

/// A task's weight rows unpacked for prefill, one after another in one allocation (a vector
/// per row cost ~5% of a Q4_K prefill in the allocator: thousands of 64-byte-aligned vectors a
/// product).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct UnpackedRows<T> {
    blocks: Vec<T>,
    rows: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl<T> UnpackedRows<T> {
    fn none() -> Self {
        UnpackedRows {
            blocks: Vec::new(),
            rows: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Row `t` of the task's rows.
    fn row(&self, t: usize) -> &[T] {
        let per = self.blocks.len() / self.rows.max(1);
        &self.blocks[t * per..(t + 1) * per]
    }
}

#[cfg(target_arch = "x86_64")]
impl<B: Unpacked> UnpackedRows<B> {
    /// One tile of [`ROW_TILE`] activation rows (`records`, `dxs`) against every row: four at
    /// a time ([`dot_vnni_4x4`]), then the rest one by one ([`dot_unpacked`]), each result to
    /// `store(r, t, s)` (row `r` of the tile, row `t` of the task).
    ///
    /// # Safety
    /// As [`dot_unpacked`]'s for every row.
    unsafe fn tile(
        &self,
        records: &[Record],
        dxs: [&[f32]; ROW_TILE],
        store: impl Fn(usize, usize, f32),
    ) {
        let quads = self.rows - self.rows % WEIGHT_TILE;
        for t in (0..quads).step_by(WEIGHT_TILE) {
            // SAFETY: as the caller promises, for rows t..t + 4.
            let s = unsafe { dot_vnni_4x4(std::array::from_fn(|w| self.row(t + w)), records, dxs) };
            for (r, s) in s.into_iter().enumerate() {
                for (w, s) in s.into_iter().enumerate() {
                    store(r, t + w, s);
                }
            }
        }
        for t in quads..self.rows {
            // SAFETY: as the caller promises, for row t.
            let s = unsafe { dot_unpacked::<ROW_TILE, B>(self.row(t), records, dxs) };
            for (r, s) in s.into_iter().enumerate() {
                store(r, t, s);
            }
        }
    }
}

/// Weight rows `js` of `w` unpacked by `unpack` ([`q4_k_unpack`], [`q6_k_unpack`],
/// [`group_unpack`]), `per_row` unpacked blocks each.
///
/// # Safety
/// As `unpack`'s: the CPU has its features and `w` is in its format.
#[cfg(target_arch = "x86_64")]
unsafe fn unpack_rows<T>(
    w: &QuantMat,
    js: std::ops::Range<usize>,
    per_row: usize,
    unpack: impl Fn(&[u8], &mut Vec<T>),
) -> UnpackedRows<T> {
    let rows = js.len();
    let mut blocks = Vec::with_capacity(rows * per_row);
    for j in js {
        unpack(w.row(j), &mut blocks);
    }
    debug_assert_eq!(blocks.len(), rows * per_row);
    UnpackedRows { blocks, rows }
}

/// Activation rows per AVX2 or VNNI call: each weight block is unpacked once for this many rows.
const ROW_TILE: usize = 4;

/// `dst = alpha · x · wᵀ` (or `+=`) with `x` rounded to int8 blocks, for `m` rows of `x` (`k`
/// at stride `xs`) into `m` rows of `dst` (`n` at stride `ds`). `w` is Q8_0, Q4_0, Q4_K or Q6_K
/// ([`supports`]) and `k` a multiple of 32 (of 256 for Q4_K and Q6_K). Tasks of weight rows on every
/// thread when `par`. Through [`kernel`]'s kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
    x: &[f32],
    xs: usize,
    m: usize,
    w: &QuantMat,
    nk: (usize, usize),
    dst: &mut [f32],
    ds: usize,
    alpha: f32,
    accumulate: bool,
    par: bool,
) {
    product_on(kernel(), x, xs, m, w, nk, dst, ds, alpha, accumulate, par);
}

/// [`product`] through `kernel`, one this CPU runs ([`Kernel::available`]).
#[allow(clippy::too_many_arguments)]
fn product_on(
    kernel: Kernel,
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
    let packed = (kernel == Kernel::Vnni).then(|| Packed::new(&rows, m, k, dtype));
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
    // Tiles of activation rows outer, the task's weight rows inner: the activations come from
    // L2 once per task rather than once per weight row.
    let task = |t: usize| {
        let js = t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n);
        let mut i = 0;
        #[cfg(target_arch = "x86_64")]
        match (kernel, &packed) {
            (Kernel::Vnni, Some(p)) => {
                // Prefill: the task's weight rows unpacked once for all its tiles.
                let prefill = m >= 2 * ROW_TILE;
                // SAFETY (all three): the CPU has the features (`kernel` is one it runs); `w`'s rows
                // hold whole blocks of `dtype`.
                let unpacked = |format| prefill && dtype == format;
                let q4k = if unpacked(DType::Q4_K) {
                    unsafe { unpack_rows(w, js.clone(), blocks / 8, |r, u| q4_k_unpack(r, u)) }
                } else {
                    UnpackedRows::none()
                };
                let q6k = if unpacked(DType::Q6_K) {
                    unsafe { unpack_rows(w, js.clone(), blocks / 8, |r, u| q6_k_unpack(r, u)) }
                } else {
                    UnpackedRows::none()
                };
                let groups = if unpacked(DType::Q8_0) || unpacked(DType::Q4_0) {
                    unsafe {
                        unpack_rows(w, js.clone(), blocks.div_ceil(GROUP), |r, u| {
                            group_unpack(dtype, r, u)
                        })
                    }
                } else {
                    UnpackedRows::none()
                };
                while i + ROW_TILE <= m {
                    let (recs, dxs) = (
                        p.records(i, ROW_TILE),
                        std::array::from_fn(|r| p.dxs(i + r)),
                    );
                    let put = |r: usize, t: usize, s: f32| store(i + r, js.start + t, s);
                    // SAFETY: the CPU has the features (`kernel` is one it runs); the rows were
                    // packed from `k` values, `w.row(j)` holds `k` values' blocks (and
                    // `q4k`/`q6k`/`groups` those blocks unpacked).
                    unsafe {
                        if !q4k.is_empty() {
                            q4k.tile(recs, dxs, put);
                        } else if !q6k.is_empty() {
                            q6k.tile(recs, dxs, put);
                        } else if !groups.is_empty() {
                            groups.tile(recs, dxs, put);
                        } else {
                            for j in js.clone() {
                                let s = dot_vnni::<ROW_TILE>(dtype, w.row(j), recs, dxs);
                                for (r, s) in s.into_iter().enumerate() {
                                    store(i + r, j, s);
                                }
                            }
                        }
                    }
                    i += ROW_TILE;
                }
                while i < m {
                    for j in js.clone() {
                        // SAFETY: as above.
                        let [s] = unsafe { dot_vnni(dtype, w.row(j), p.records(i, 1), [p.dxs(i)]) };
                        store(i, j, s);
                    }
                    i += 1;
                }
            }
            (Kernel::Avx2, _) => {
                while i + ROW_TILE <= m {
                    let a: [Act<'_>; ROW_TILE] = std::array::from_fn(|r| act(i + r));
                    for j in js.clone() {
                        // SAFETY: AVX2, FMA and F16C were detected; shapes as `tile` needs.
                        let s = unsafe { tile(dtype, w.row(j), a) };
                        for (r, s) in s.into_iter().enumerate() {
                            store(i + r, j, s);
                        }
                    }
                    i += ROW_TILE;
                }
                while i < m {
                    for j in js.clone() {
                        // SAFETY: as above.
                        let [s] = unsafe { tile(dtype, w.row(j), [act(i)]) };
                        store(i, j, s);
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        while i < m {
            for j in js.clone() {
                store(i, j, dot_portable(dtype, w.row(j), act(i)));
            }
            i += 1;
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = &packed;
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
    /// 1.5× of the floor's, through every kernel this CPU runs (AVX512-VNNI, AVX2, portable).
    #[test]
    fn int8_products_stay_within_their_rounding_floor() {
        for kernel in Kernel::available() {
            floor_case(kernel);
        }
    }

    /// Every format with an int8 path.
    const FORMATS: [DType; 4] = [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K];

    fn floor_case(kernel: Kernel) {
        for dtype in FORMATS {
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
                product_on(kernel, &x, k, m, &w, (n, k), &mut got, n, 0.5, false, true);
                let mut plain = vec![0f32; m * n];
                for i in 0..m {
                    for j in 0..n {
                        let (q, b) = (&r.q[i * k..(i + 1) * k], i * k / 32..(i + 1) * k / 32);
                        let (d, s) = (&r.d[b.clone()], &r.s[b]);
                        plain[i * n + j] = 0.5 * dot_portable(dtype, w.row(j), (q, d, s));
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
                            "{} {dtype} {m}×{k}×{n}",
                            kernel.name()
                        );
                    }
                }
                assert!(floor > 0.0, "{dtype}: the activations were not rounded");
                assert!(
                    err <= 1.5 * floor,
                    "{} {dtype} {m}×{k}×{n}: {err:e} vs floor {floor:e}",
                    kernel.name()
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
        // Also a part group of blocks (Q8_0, Q4_0: 224 = 7 blocks) and a last task of 11
        // weight rows (prefill's quads of weight rows, then three alone).
        for (kernel, dtype, (k, n)) in Kernel::available().into_iter().flat_map(|kr| {
            FORMATS.into_iter().flat_map(move |d| {
                let part = (d.block_size() == 32).then_some((224, 43));
                [(256, 40), (256, 43)]
                    .into_iter()
                    .chain(part)
                    .map(move |s| (kr, d, s))
            })
        }) {
            let w = QuantMat::from_blocks(
                dtype,
                random_blocks(dtype, n, k, 9),
                dtype.bytes_for(k).unwrap(),
            );
            let x = Rng::new(10).vec(17 * k, 1.0);
            let run = |first: usize, m: usize| {
                let mut o = vec![0f32; m * n];
                product_on(
                    kernel,
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
            for (first, m) in [(5, 1), (4, 4), (3, 6), (16, 1), (2, 13)] {
                let alone = run(first, m);
                assert!(
                    alone[..] == all[first * n..(first + m) * n],
                    "{} {dtype} k {k} rows {first}+{m}",
                    kernel.name()
                );
            }
        }
    }

    /// `(k, m)` of the kernel comparisons: odd row counts (tiles of 4 and the rows left over)
    /// and odd block counts (VNNI's groups of four blocks and a part group).
    fn odd_shapes(dtype: DType) -> impl Iterator<Item = (usize, usize)> {
        let ks: &[usize] = if dtype.block_size() == 256 {
            &[256, 768, 1280]
        } else {
            &[32, 96, 224, 416, 2080]
        };
        ks.iter()
            .flat_map(|&k| [1, 3, 5, 7, 17].map(move |m| (k, m)))
    }

    /// With block scales of 1 and integer activations whose blocks each hold a ±127 (so
    /// `d_x = 1`), every f32 sum of every kernel is a sum of integers below 2^24 — exact in any
    /// order — so every kernel must return the integer product exactly, with accumulate on and
    /// off: what checks VNNI's layout, weight offsets and their seeds, part groups and Q4_K's
    /// scale decoding bit for bit.
    #[test]
    fn int8_kernels_are_exact_where_the_f32_sums_are() {
        let one = half::f16::from_f32(1.0).to_le_bytes();
        for dtype in FORMATS {
            for (k, m) in odd_shapes(dtype) {
                let n = 11;
                let seed = (k * 31 + m) as u64;
                let mut blocks = random_blocks(dtype, n, k, seed);
                for b in blocks.chunks_exact_mut(dtype.block_bytes()) {
                    match dtype {
                        DType::Q4_K => {
                            b[..2].copy_from_slice(&one);
                            b[2..4].copy_from_slice(&one);
                        }
                        DType::Q6_K => {
                            b[208..].copy_from_slice(&one);
                            // Scales in −8..8 (random bytes' top nibble, signed): the sums
                            // stay below 2^24.
                            for s in &mut b[192..208] {
                                *s = ((*s as i8) >> 4) as u8;
                            }
                        }
                        _ => b[..2].copy_from_slice(&one),
                    }
                }
                let w = QuantMat::from_blocks(dtype, blocks, dtype.bytes_for(k).unwrap());
                let mut rng = Rng::new(seed + 1);
                let x: Vec<f32> = (0..m * k)
                    .map(|t| {
                        let v = rng.next_f32();
                        if t % 32 == 0 {
                            127f32.copysign(v)
                        } else {
                            (3.5 * v).trunc()
                        }
                    })
                    .collect();
                let old: Vec<f32> = rng.vec(m * n, 50.0).iter().map(|v| v.trunc()).collect();
                // The integer product: Σ w x per block, Q4_K's as Σ (sc · q − min) x, Q6_K's
                // as the GGUF decoder's values (with d = 1, the integers sc · (q − 32)).
                let mut decoded = vec![0f32; n * k];
                if dtype == DType::Q6_K {
                    let all: Vec<u8> = (0..n).flat_map(|j| w.row(j).to_vec()).collect();
                    tessera_core::dtype::widen_into(dtype, &all, &mut decoded);
                }
                let exact = |i: usize, j: usize| -> i64 {
                    if dtype == DType::Q6_K {
                        let xi = &x[i * k..(i + 1) * k];
                        return decoded[j * k..(j + 1) * k]
                            .iter()
                            .zip(xi)
                            .map(|(&v, &x)| v as i64 * x as i64)
                            .sum();
                    }
                    let xi = &x[i * k..(i + 1) * k];
                    let row = w.row(j);
                    let mut sum = 0i64;
                    for (b, xb) in row
                        .chunks_exact(dtype.block_bytes())
                        .zip(xi.chunks_exact(dtype.block_size()))
                    {
                        let mut vals = vec![0i64; dtype.block_size()];
                        if dtype == DType::Q4_K {
                            for (sub, v) in vals.chunks_exact_mut(32).enumerate() {
                                let (sc, mn) = tessera_core::gguf::q4_k_scale_min(&b[4..16], sub);
                                let run = &b[16 + 32 * (sub / 2)..][..32];
                                for (v, &byte) in v.iter_mut().zip(run) {
                                    let q = if sub % 2 == 1 { byte >> 4 } else { byte & 15 };
                                    *v = i64::from(sc) * i64::from(q) - i64::from(mn);
                                }
                            }
                        } else {
                            let mut wb = [0i8; BLOCK];
                            weight_block(dtype, b, &mut wb);
                            for (v, &q) in vals.iter_mut().zip(&wb) {
                                *v = i64::from(q);
                            }
                        }
                        sum += vals.iter().zip(xb).map(|(v, &x)| v * x as i64).sum::<i64>();
                    }
                    sum
                };
                for kernel in Kernel::available() {
                    for accumulate in [false, true] {
                        let mut got = old.clone();
                        product_on(
                            kernel,
                            &x,
                            k,
                            m,
                            &w,
                            (n, k),
                            &mut got,
                            n,
                            0.5,
                            accumulate,
                            true,
                        );
                        for i in 0..m {
                            for j in 0..n {
                                let base = if accumulate { old[i * n + j] } else { 0.0 };
                                let want = base + 0.5 * exact(i, j) as f32;
                                assert_eq!(
                                    got[i * n + j],
                                    want,
                                    "{} {dtype} m {m} k {k} accumulate {accumulate} ({i}, {j})",
                                    kernel.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// On random scales the VNNI and AVX2 kernels and the portable loop compute the same integer
    /// block sums and differ only in how the f32 products by the scales are rounded and summed
    /// (lanes of 4 or 8 per block and a tree at the end against block by block). Each is within
    /// `γ_n · A + u · |result|` of the float64 value of those sums (`u = 2^-24`, `γ_n ≈ n·u`),
    /// `n` bounding the roundings on any path — at most `blocks + 12` (a scale product, one per
    /// block or group summed, VNNI's 4-level lane tree, Q4_K's mins, `alpha` and the
    /// accumulation) — and `A` the sum of the magnitudes they round: for VNNI the lanes
    /// `Σ (w + offset) x − offset/4 · Σ x`, so per block
    /// `|d_w d_x| (Σ (|w| + offset) |x| + offset |Σ x|)`, which bounds the portable and AVX2
    /// terms too (AVX2's lanes are `Σ w x` over 4 values); for Q6_K per sub-block of 16
    /// `|d d_x sc| (Σ q |x| + 32 Σ |x|)` with `q = w + 32` (VNNI's seeded lanes and AVX2's
    /// `sc · Σ w x` lanes within it, `|w| ≤ q + 32`). So each kernel and the portable loop agree
    /// within twice that bound; in practice far inside it.
    #[test]
    fn simd_kernels_agree_with_the_portable_loop() {
        let simd: Vec<Kernel> = Kernel::available()
            .into_iter()
            .filter(|&k| k != Kernel::Portable)
            .collect();
        if simd.is_empty() {
            eprintln!("skipped: this CPU has neither AVX512-VNNI nor AVX2");
            return;
        }
        let u = f64::from(f32::EPSILON) / 2.0;
        let alpha = -0.75f32;
        for dtype in FORMATS {
            let off = f64::from(vnni_offset(dtype));
            for (k, m) in odd_shapes(dtype) {
                let n = 13;
                let seed = (k * 17 + m * 3) as u64;
                let blocks = random_blocks(dtype, n, k, seed);
                let w = QuantMat::from_blocks(dtype, blocks, dtype.bytes_for(k).unwrap());
                let x = Rng::new(seed + 1).vec(m * k, 2.0);
                let old = Rng::new(seed + 2).vec(m * n, 4.0);
                let r = round_rows(&x, k, m, k);
                let nb = k / BLOCK;
                // Per (i, j): the float64 value of the integer block sums and the bound's A.
                let exact = |i: usize, j: usize| -> (f64, f64) {
                    let (q, d, s) = (
                        &r.q[i * k..(i + 1) * k],
                        &r.d[i * nb..(i + 1) * nb],
                        &r.s[i * nb..(i + 1) * nb],
                    );
                    let (mut sum, mut mag) = (0f64, 0f64);
                    if dtype == DType::Q6_K {
                        let mut wv = [0i8; 256];
                        for ((b, qx), dx) in w
                            .row(j)
                            .chunks_exact(dtype.block_bytes())
                            .zip(q.chunks_exact(256))
                            .zip(d.chunks_exact(8))
                        {
                            let (scales, dw) = q6_k_block(b, &mut wv);
                            let dw = f64::from(dw);
                            for (((wb, xb), &sc), t) in wv
                                .chunks_exact(16)
                                .zip(qx.chunks_exact(16))
                                .zip(&scales)
                                .zip(0..)
                            {
                                let scale = dw * f64::from(dx[t / 2]) * f64::from(sc);
                                let (mut dot, mut abs) = (0i64, 0i64);
                                for (&a, &x) in wb.iter().zip(xb) {
                                    dot += i64::from(a) * i64::from(x);
                                    abs += (i64::from(a) + 32 + 32) * i64::from(x).abs();
                                }
                                sum += scale * dot as f64;
                                mag += scale.abs() * abs as f64;
                            }
                        }
                    } else if dtype == DType::Q4_K {
                        for ((((ds, dm, run, high), qx), &dx), &sx) in
                            q4_k_subs(w.row(j)).zip(q.chunks_exact(BLOCK)).zip(d).zip(s)
                        {
                            let (ds, dm, dx) = (f64::from(ds), f64::from(dm), f64::from(dx));
                            let (mut dot, mut abs) = (0i64, 0i64);
                            for (&b, &x) in run.iter().zip(qx) {
                                let v = i64::from(if high { b >> 4 } else { b & 15 });
                                dot += v * i64::from(x);
                                abs += v * i64::from(x).abs();
                            }
                            sum += dx * (ds * dot as f64 - dm * f64::from(sx));
                            mag +=
                                dx.abs() * (ds.abs() * abs as f64 + dm.abs() * f64::from(sx.abs()));
                        }
                    } else {
                        let mut wb = [0i8; BLOCK];
                        for ((b, qx), (&dx, &sx)) in w
                            .row(j)
                            .chunks_exact(dtype.block_bytes())
                            .zip(q.chunks_exact(BLOCK))
                            .zip(d.iter().zip(s))
                        {
                            let dw = f64::from(weight_block(dtype, b, &mut wb));
                            let (mut dot, mut abs) = (0i64, 0f64);
                            for (&a, &x) in wb.iter().zip(qx) {
                                dot += i64::from(a) * i64::from(x);
                                abs += (f64::from(a).abs() + off) * f64::from(x).abs();
                            }
                            let scale = dw * f64::from(dx);
                            sum += scale * dot as f64;
                            mag += scale.abs() * (abs + off * f64::from(sx.abs()));
                        }
                    }
                    (sum, mag)
                };
                for accumulate in [false, true] {
                    let run = |kernel| {
                        let mut o = old.clone();
                        product_on(
                            kernel,
                            &x,
                            k,
                            m,
                            &w,
                            (n, k),
                            &mut o,
                            n,
                            alpha,
                            accumulate,
                            true,
                        );
                        o
                    };
                    let plain = run(Kernel::Portable);
                    let steps = (nb + 12) as f64;
                    let gamma = steps * u / (1.0 - steps * u);
                    for &kernel in &simd {
                        let fast = run(kernel);
                        let name = kernel.name();
                        for i in 0..m {
                            for j in 0..n {
                                let (sum, mag) = exact(i, j);
                                let base = if accumulate {
                                    f64::from(old[i * n + j])
                                } else {
                                    0.0
                                };
                                let want = base + f64::from(alpha) * sum;
                                let bound = gamma * f64::from(alpha.abs()) * mag
                                    + u * (base.abs() + f64::from(alpha.abs()) * mag);
                                let at = format!(
                                    "{dtype} m {m} k {k} accumulate {accumulate} ({i}, {j})"
                                );
                                let (v, p) =
                                    (f64::from(fast[i * n + j]), f64::from(plain[i * n + j]));
                                assert!(
                                    (v - want).abs() <= bound,
                                    "{name} {at}: {v} vs {want} ± {bound:e}"
                                );
                                assert!(
                                    (p - want).abs() <= bound,
                                    "portable {at}: {p} vs {want} ± {bound:e}"
                                );
                                assert!((v - p).abs() <= 2.0 * bound, "{name} {at}: {v} vs {p}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn q4_k_scales_decode_as_scale_min_does() {
        let mut rng = Rng::new(5);
        for _ in 0..200 {
            let s: [u8; 12] = std::array::from_fn(|_| ((rng.next_f32() + 1.0) * 128.0) as u8);
            let (sc, mn) = q4_k_scales_mins(&s);
            for j in 0..8 {
                let byte = |v: u64| (v >> (8 * j)) as u8;
                assert_eq!(
                    (byte(sc), byte(mn)),
                    tessera_core::gguf::q4_k_scale_min(&s, j),
                    "{s:?} sub-block {j}"
                );
            }
        }
    }

    /// Q6_K's values as the int8 path unpacks them (`d · sc · (q − 32)`, each value's scale its
    /// sub-block's of 16) are the GGUF decoder's, bit for bit, on random blocks.
    #[test]
    fn q6_k_blocks_unpack_as_the_gguf_decoder_does() {
        let blocks = random_blocks(DType::Q6_K, 5, 256, 12);
        let mut want = vec![0f32; 5 * 256];
        tessera_core::dtype::widen_into(DType::Q6_K, &blocks, &mut want);
        let mut w = [0i8; 256];
        for (b, want) in blocks.chunks_exact(210).zip(want.chunks_exact(256)) {
            let (scales, d) = q6_k_block(b, &mut w);
            for (t, (&q, &v)) in w.iter().zip(want).enumerate() {
                assert_eq!(d * f32::from(scales[t / 16]) * f32::from(q), v, "value {t}");
            }
        }
    }

    /// Q6_K at its extremes — every scale −128, every `q` 0 or 63, every activation 127 — where
    /// the integer sums are largest (a block's `2 · 128 · 32 · 127 · 16`): no kernel saturates
    /// (`vpmaddubsw`'s pairs) or wraps, and every f32 sum is of multiples of 512 below 2^33, so
    /// exact: each kernel returns the integer product exactly (9 rows: tiles of 4 on weights
    /// unpacked once per task, and a lone row unpacking them as it goes).
    #[test]
    fn q6_k_extremes_stay_exact() {
        let (k, n, m) = (512, 3, 9);
        for (bits, w) in [(0x00u8, -32i64), (0xff, 31)] {
            let mut block = [bits; 210];
            block[192..208].fill(0x80);
            block[208..].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            let blocks = block.repeat(n * k / 256);
            let mat = QuantMat::from_blocks(DType::Q6_K, blocks, 2 * 210);
            let x = vec![127f32; m * k];
            let want = (-128 * w * 127 * k as i64) as f32;
            for kernel in Kernel::available() {
                let mut got = vec![0f32; m * n];
                product_on(
                    kernel,
                    &x,
                    k,
                    m,
                    &mat,
                    (n, k),
                    &mut got,
                    n,
                    1.0,
                    false,
                    true,
                );
                assert!(
                    got.iter().all(|&g| g == want),
                    "{} q − 32 = {w}: {got:?}",
                    kernel.name()
                );
            }
        }
    }

    /// The AVX2 build of the rounding (`vroundps`) rounds as the portable one (`roundf`):
    /// halves away from zero, the float just below a half down, on ties and at random.
    #[test]
    fn rounding_is_the_same_compiled_for_avx2() {
        let below_half = 0.5f32.next_down();
        let mut x = vec![127.0f32; 64];
        for (i, v) in x[1..32].iter_mut().enumerate() {
            let t = i as f32 * 4.0 + 0.5;
            *v = [t, -t, t.next_down(), below_half.copysign(-t)][i % 4];
        }
        let mut rng = Rng::new(3);
        x.extend(rng.vec(32 * 64, 3.0));
        let (mut q, mut d) = (vec![0i8; x.len()], vec![0f32; x.len() / 32]);
        round_row(&x, &mut q, &mut d);
        let (mut q0, mut d0) = (q.clone(), d.clone());
        round_row_body(&x, &mut q0, &mut d0);
        assert_eq!(q, q0);
        assert_eq!(d, d0);
        // 0.5, −4.5, 8.5⁻, −0.5⁻, 16.5, −20.5.
        assert_eq!(q[1..7], [1, -5, 8, 0, 17, -21]);
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
