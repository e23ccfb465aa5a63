//! Element-wise math over slices for the hot row ops (the attention softmax, GELU and SiLU),
//! written without branches so LLVM vectorises it, compiled once per instruction set (AVX-512,
//! AVX2, the x86-64 baseline) and chosen at run time, so one binary runs everywhere.
//!
//! Values are computed in f64 lanes with an exponential accurate to a few f64 ulps and rounded
//! to f32 once, as the scalar reference did with the C library's `exp`/`tanh` in f64: results are
//! the correctly rounded f32 values in all but rare ties.

use std::sync::OnceLock;

use crate::Activation;

/// The instruction set the kernels here run with on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

/// What the CPU has that the kernels can use.
#[derive(Clone, Copy, Debug)]
struct Features {
    /// AVX-512F, DQ and VL.
    avx512: bool,
    /// AVX2 and FMA.
    avx2_fma: bool,
}

impl Features {
    fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Features {
                avx512: has!("avx512f") && has!("avx512dq") && has!("avx512vl"),
                avx2_fma: has!("avx2") && has!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features {
            avx512: false,
            avx2_fma: false,
        }
    }

    /// The widest kernels these features run.
    fn best(self) -> Isa {
        if self.avx512 {
            Isa::Avx512
        } else if self.avx2_fma {
            Isa::Avx2
        } else {
            Isa::Baseline
        }
    }
}

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| Features::detect().best())
}

/// Defines `fn $name` that runs `$body` compiled for the best instruction set [`isa`] found.
macro_rules! multiversioned {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            match isa() {
                // SAFETY: `isa()` found these target features on this CPU.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}

/// `e^x` in f64 without branches: `x = n·ln2 + r` with `|r| ≤ ln2/2` (Cody–Waite), `e^r` by its
/// Taylor series to r¹³ (truncation below 1e-17 relative), times `2^n` built in the exponent
/// bits in two halves (so neither leaves the normal range, and results underflow gradually and
/// overflow to `∞` as the C library's do). NaN stays NaN.
#[inline(always)]
fn exp64(x: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let xc = x.clamp(-746.0, 710.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 6_227_020_800.0;
    for c in [
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    let half = (n * 0.5).floor();
    p * pow2(half) * pow2(n - half)
}

/// `2^n` for a whole `n` in −1022..=1023, through the exponent bits: adding 1.5·2^52 leaves `n`
/// in the low mantissa bits.
#[inline(always)]
fn pow2(n: f64) -> f64 {
    const SHIFTER: f64 = 6_755_399_441_055_744.0;
    let bits = (n + SHIFTER).to_bits().wrapping_sub(SHIFTER.to_bits());
    f64::from_bits(bits.wrapping_add(1023) << 52)
}

/// `ln 2` in two parts for the Cody–Waite reduction: the high part's few bits make `n · LN2_HI`
/// exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' degree-6 polynomial for `e^r`, `|r| ≤ ln2/2`: its leading coefficient, then the rest
/// in Horner order (the constant and linear terms are added apart, `p·r² + r + 1`).
const EXP_P0: f32 = 1.987_569_1e-4;
const EXP_P: [f32; 5] = [
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `n = ⌊x·log₂e + ½⌋` for an `x` already clamped to the range its caller handles.
#[inline(always)]
fn exp_exponent(xc: f32) -> f32 {
    (xc * std::f32::consts::LOG2_E + 0.5).floor()
}

/// `e^x` in f32 without branches, for the softmax: Cody–Waite reduction with `ln2` split in two,
/// Cephes' degree-6 polynomial for `e^r` (within 2 f32 ulps of the exact value), `2^n` built in
/// the exponent bits in two halves. NaN stays NaN; above the f32 range it is `∞`, and below
/// [`EXP_MIN`] exactly `0`, never a denormal (see [`EXP_MIN`]).
#[inline(always)]
fn exp32(x: f32) -> f32 {
    // Computed at EXP_MIN for anything below, so no step makes a denormal, then replaced by 0.
    let xc = x.clamp(EXP_MIN, 89.0);
    let n = exp_exponent(xc);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = EXP_P.iter().fold(EXP_P0, |p, &c| p * r + c);
    let y = p * r * r + r + 1.0;
    let half = (n * 0.5).floor();
    let e = y * pow2f(half) * pow2f(n - half);
    if x < EXP_MIN { 0.0 } else { e }
}

/// [`exp32`] for `x ≤ 0` (a softmax's `s − max`) with fused multiply-adds: `n` the nearest whole
/// number to `x·log₂e` (ties to even), the reduction and the polynomial as FMAs, one `2^n` (n ≥
/// −126 here, and every result at or above [`EXP_MIN`] is a normal number, so `y · 2^n` is
/// exact and equals AVX-512's `vscalefps`). About half of [`exp32`]'s vector operations, within
/// 2 f32 ulps as well; the softmax's exponential in both modes ([`exp_shifted`],
/// [`exp_shifted_f32`]), computed to the same bits by the portable loops and the AVX-512 kernel.
/// Positive `x` is clamped to 0 (gives 1); NaN stays NaN; below [`EXP_MIN`] exactly `0`.
#[inline(always)]
fn exp32_nonpositive(x: f32) -> f32 {
    let xc = x.clamp(EXP_MIN, 0.0);
    let n = (xc * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let p = EXP_P.iter().fold(EXP_P0, |p, &c| p.mul_add(r, c));
    let y = (p * r).mul_add(r, r + 1.0);
    let e = y * pow2f(n);
    if x < EXP_MIN { 0.0 } else { e }
}

/// Just above `ln 2⁻¹²⁶ = −87.3365`: below it `e^x` would be a denormal, which [`exp32`] makes
/// exactly `0` instead. A softmax's far tails land there (a long document's attention), and a
/// denormal operand costs a microcode assist per use on Intel cores (`denormals.rs`); this way
/// the probabilities are the same on every machine whether or not its threads flush denormals,
/// as they would be flushed where they do. What is dropped weighs under 1.2e-38 of the row's
/// largest probability.
const EXP_MIN: f32 = -87.33;

/// `2^n` for a whole `n` in −126..=127, through the exponent bits: adding 1.5·2^23 leaves `n` in
/// the low mantissa bits.
#[inline(always)]
fn pow2f(n: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0;
    let bits = (n + SHIFTER).to_bits().wrapping_sub(SHIFTER.to_bits());
    f32::from_bits(bits.wrapping_add(127) << 23)
}

/// `gelu_pytorch_tanh` in f64: `x·(1 + tanh(u))/2 = x / (1 + e^(−2u))`,
/// `u = √(2/π)·(x + 0.044715·x³)`.
#[inline(always)]
fn gelu64(x: f64) -> f64 {
    const C: f64 = 0.797_884_560_802_865_4; // √(2/π)
    let u = C * (x + 0.044715 * x * x * x);
    x / (1.0 + exp64(-2.0 * u))
}

/// The exact (erf) GELU in f64.
#[inline(always)]
fn gelu_erf64(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// `x·σ(x)` in f64.
#[inline(always)]
fn silu64(x: f64) -> f64 {
    x / (1.0 + exp64(-x))
}

/// `act(x)` in f64, rounded to f32.
#[inline(always)]
fn activate1(act: Activation, x: f32) -> f32 {
    let x = x as f64;
    (match act {
        Activation::GeluTanh => gelu64(x),
        Activation::Gelu => gelu_erf64(x),
        Activation::Silu => silu64(x),
    }) as f32
}

/// `act(x)` in f32 lanes through [`exp32`] (within 1e-5 relative of the exact value: e^(−2u)
/// carries its argument's rounding times |2u|), for bf16 mode:
/// its next product rounds the result to bf16 (2⁻⁹ relative) anyway, and sixteen f32 lanes with
/// a degree-6 polynomial take a fraction of the f64 path's time. The erf GELU keeps the f64 path.
#[inline(always)]
fn activate1_f32(act: Activation, x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    match act {
        Activation::GeluTanh => x / (1.0 + exp32(-2.0 * C * (x + 0.044715 * x * x * x))),
        Activation::Gelu => activate1(act, x),
        Activation::Silu => x / (1.0 + exp32(-x)),
    }
}

/// Lanes of the partial sums and maxima (independent accumulators let LLVM vectorise them).
const LANES: usize = 16;

multiversioned! {
    /// The largest element, NaN ignored as `f32::max` ignores it (`-∞` when there is none).
    pub(super) fn max(xs: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a = if x > *a { x } else { *a };
            }
        }
        tail.iter().chain(&acc).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
    }
}

/// `xs[j] = e^(xs[j] − max)` in f32 ([`exp32_nonpositive`]), returning their sum in f64 (16 lanes
/// of partial sums, added in lane order, then the tail): the body of a softmax.
pub(super) fn exp_shifted(xs: &mut [f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: `isa()` found AVX-512F/DQ/VL on this CPU.
        return unsafe { exp_shifted_avx512::<true>(xs, max) };
    }
    exp_shifted_lanes(xs, max)
}

/// [`exp_shifted`] summing in 16 f32 lanes instead, for bf16 mode, whose product rounds the
/// probabilities to bf16 next (2⁻⁹), far coarser than these sums' rounding.
pub(super) fn exp_shifted_f32(xs: &mut [f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: `isa()` found AVX-512F/DQ/VL on this CPU.
        return unsafe { exp_shifted_avx512::<false>(xs, max) };
    }
    exp_shifted_f32_lanes(xs, max)
}

multiversioned! {
    /// [`exp_shifted`] as portable loops (AVX2 and the baseline; LLVM split the f64 sums' lanes
    /// into 8-wide halves and the whole loop with them, so AVX-512 has its own kernel).
    fn exp_shifted_lanes(xs: &mut [f32], max: f32) -> f64 {
        let mut acc = [0f64; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
                *x = exp32_nonpositive(*x - max);
                *a += *x as f64;
            }
        }
        let mut sum: f64 = acc.iter().sum();
        for x in chunks.into_remainder() {
            *x = exp32_nonpositive(*x - max);
            sum += *x as f64;
        }
        sum
    }
}

multiversioned! {
    /// [`exp_shifted_f32`] as portable loops.
    fn exp_shifted_f32_lanes(xs: &mut [f32], max: f32) -> f64 {
        let mut acc = [0f32; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
                *x = exp32_nonpositive(*x - max);
                *a += *x;
            }
        }
        let mut sum: f64 = acc.iter().map(|&a| a as f64).sum();
        for x in chunks.into_remainder() {
            *x = exp32_nonpositive(*x - max);
            sum += *x as f64;
        }
        sum
    }
}

/// [`exp_shifted`] (`F64_SUMS`) or [`exp_shifted_f32`] on AVX-512: the same operations in the
/// same order as the portable loops (so the same bits), sixteen values a register, `2^n` applied
/// by `vscalefps`, and the f64 partial sums in two registers of eight lanes.
///
/// # Safety
/// The CPU has AVX-512F, DQ and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl")]
unsafe fn exp_shifted_avx512<const F64_SUMS: bool>(xs: &mut [f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    const _: () = assert!(LANES == 16);
    let (m, lo, hi) = (
        _mm512_set1_ps(max),
        _mm512_set1_ps(EXP_MIN),
        _mm512_setzero_ps(),
    );
    let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
    let (ln2_hi, ln2_lo) = (_mm512_set1_ps(LN2_HI), _mm512_set1_ps(LN2_LO));
    let (p0, one) = (_mm512_set1_ps(EXP_P0), _mm512_set1_ps(1.0));
    let coef = EXP_P.map(|c| _mm512_set1_ps(c));
    let (mut acc_lo, mut acc_hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    let mut acc32 = _mm512_setzero_ps();
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        // SAFETY: `c` holds 16 values.
        let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
        let x = _mm512_sub_ps(v, m);
        // clamp(EXP_MIN, 0) keeping NaN: vmaxps/vminps return their second operand when either
        // is NaN.
        let xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, log2e),
        );
        let r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, xc));
        let mut p = p0;
        for &k in &coef {
            p = _mm512_fmadd_ps(p, r, k);
        }
        let y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, one));
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
        let e = _mm512_maskz_scalef_ps(!below, y, n);
        // SAFETY: as the load.
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), e) };
        if F64_SUMS {
            acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc_hi = _mm512_add_pd(
                acc_hi,
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(e),
                ))),
            );
        } else {
            acc32 = _mm512_add_ps(acc32, e);
        }
    }
    let mut lanes = [0f64; LANES];
    if F64_SUMS {
        // SAFETY: `lanes` holds 16 f64.
        unsafe {
            _mm512_storeu_pd(lanes.as_mut_ptr(), acc_lo);
            _mm512_storeu_pd(lanes.as_mut_ptr().add(8), acc_hi);
        }
    } else {
        let mut l32 = [0f32; LANES];
        // SAFETY: `l32` holds 16 f32.
        unsafe { _mm512_storeu_ps(l32.as_mut_ptr(), acc32) };
        lanes = l32.map(f64::from);
    }
    let mut sum: f64 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp32_nonpositive(*x - max);
        sum += *x as f64;
    }
    sum
}

multiversioned! {
    /// `xs[j] *= k`.
    pub(super) fn scale(xs: &mut [f32], k: f32) {
        for x in xs {
            *x *= k;
        }
    }
}

multiversioned! {
    /// `xs[j] = act(xs[j])`.
    pub(super) fn activate(xs: &mut [f32], act: Activation) {
        for x in xs {
            *x = activate1(act, *x);
        }
    }
}

multiversioned! {
    /// `out[j] = act(gate[j]) · up[j]` (the activation rounded to f32 before the product).
    pub(super) fn gated(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = activate1(act, g) * u;
        }
    }
}

multiversioned! {
    /// [`gated`] with the activation in f32 ([`activate1_f32`]), for bf16 mode.
    pub(super) fn gated_f32(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = activate1_f32(act, g) * u;
        }
    }
}

multiversioned! {
    /// `Σ (x − mean)²` and, with `mean` = 0, `Σ x²`, in f64 over [`LANES`] partial sums (the row
    /// norms' statistics).
    pub(super) fn sum_sq(xs: &[f32], mean: f64) -> f64 {
        let mut acc = [0f64; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                let d = x as f64 - mean;
                *a += d * d;
            }
        }
        let mut sum: f64 = acc.iter().sum();
        for &x in tail {
            let d = x as f64 - mean;
            sum += d * d;
        }
        sum
    }
}

multiversioned! {
    /// `Σ x` in f64 over [`LANES`] partial sums.
    pub(super) fn sum(xs: &[f32]) -> f64 {
        let mut acc = [0f64; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += x as f64;
            }
        }
        tail.iter().fold(acc.iter().sum(), |s, &x| s + x as f64)
    }
}

multiversioned! {
    /// `out[j] = ((x[j] − mean) · inv)` rounded once to f32, then `· w[j]`, `+ b[j]`, `· m[j]`
    /// in f32 for each of them given, in that order: a row norm after its statistics.
    pub(super) fn normalize(
        x: &[f32],
        mean: f64,
        inv: f64,
        w: Option<&[f32]>,
        b: Option<&[f32]>,
        m: Option<&[f32]>,
        out: &mut [f32],
    ) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = ((v as f64 - mean) * inv) as f32;
        }
        if let Some(w) = w {
            out.iter_mut().zip(w).for_each(|(o, &w)| *o *= w);
        }
        if let Some(b) = b {
            out.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
        }
        if let Some(m) = m {
            out.iter_mut().zip(m).for_each(|(o, &m)| *o *= m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: [usize; 6] = [0, 1, 7, 17, 33, 4_099];

    /// Values spanning the ranges these functions see, with NaN and ±∞ among them.
    fn inputs(n: usize, spread: f32) -> Vec<f32> {
        let mut rng = crate::cpu::testutil::Rng::new(n as u64 + 7);
        let mut v: Vec<f32> = rng.vec(n, spread);
        for (i, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]
            .into_iter()
            .enumerate()
        {
            if n > 8 * (i + 1) {
                v[8 * (i + 1) - 1] = special;
            }
        }
        v
    }

    /// Equal within an f32 ulp.
    fn same(got: f32, want: f32, what: &str) {
        let ok = got == want
            || (got.is_nan() && want.is_nan())
            || (got - want).abs() <= f32::EPSILON * want.abs();
        assert!(ok, "{what}: {got} vs {want}");
    }

    #[test]
    fn exp_matches_the_c_library_across_the_f64_range() {
        for x in [
            -800.0, -745.5, -740.0, -708.5, -708.0, -100.0, -20.5, -1.0, -1e-9, 0.0, 1e-9, 0.5,
            1.0, 10.0, 88.7, 700.0, 709.5, 709.78, 709.8, 710.0, 1e6,
        ] {
            let (got, want) = (exp64(x), x.exp());
            // Relative to the value, or to the smallest normal number where it is subnormal.
            let tol = 1e-14 * want.abs().max(f64::MIN_POSITIVE);
            assert!(
                got == want || (got - want).abs() <= tol,
                "exp({x}) = {got:e}, libm {want:e}"
            );
        }
        assert!(exp64(f64::NAN).is_nan());
        assert_eq!(exp64(f64::INFINITY), f64::INFINITY);
        assert_eq!(exp64(f64::NEG_INFINITY), 0.0);
        // Over the range softmax and the activations use: within a few f64 ulps (the result is
        // then rounded to f32, whose ulp is 6e-8).
        let mut rng = crate::cpu::testutil::Rng::new(3);
        let worst = rng
            .vec(100_000, 80.0)
            .into_iter()
            .map(|x| (exp64(x as f64) / (x as f64).exp() - 1.0).abs())
            .fold(0f64, f64::max);
        assert!(worst <= 1e-15, "worst relative error {worst:e}");
        eprintln!("exp64: worst relative error {worst:e} over ±80");
    }

    #[test]
    fn exp32_nonpositive_is_within_two_f32_ulps_and_never_a_denormal() {
        let mut rng = crate::cpu::testutil::Rng::new(6);
        let mut worst = 0f64;
        for x in rng
            .vec(200_000, 88.0)
            .into_iter()
            .map(|x| -x.abs())
            .chain([-87.33, -87.0, -30.5, -0.3466, -1e-7, 0.0])
        {
            let got = exp32_nonpositive(x);
            if x < EXP_MIN {
                assert_eq!(got, 0.0, "exp({x})");
                continue;
            }
            assert!(got.is_normal(), "exp({x}) = {got:e}");
            let want = (x as f64).exp();
            worst = worst.max((got as f64 - want).abs() / want);
        }
        assert!(
            worst <= 2.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert!(exp32_nonpositive(f32::NAN).is_nan());
        assert_eq!(exp32_nonpositive(f32::NEG_INFINITY), 0.0);
        eprintln!("exp32_nonpositive: worst relative error {worst:e} over [-88, 0]");
    }

    #[test]
    fn exp32_is_within_two_f32_ulps_of_the_exact_value() {
        let mut rng = crate::cpu::testutil::Rng::new(5);
        let mut worst = 0f64;
        for x in rng
            .vec(200_000, 88.0)
            .into_iter()
            .chain([-87.0, -30.5, -1e-7, 0.0, 1e-7, 0.3465, -0.3466, 88.0])
        {
            if x < EXP_MIN {
                // Below the normal range: 0 (see the next test).
                assert_eq!(exp32(x), 0.0, "exp({x})");
                continue;
            }
            let want = (x as f64).exp();
            worst = worst.max((exp32(x) as f64 - want).abs() / want);
        }
        eprintln!("exp32: worst relative error {worst:e} over ±88");
        assert!(
            worst <= 2.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        // Below f32's normal range exactly 0, never a denormal; just above it, normal and as
        // accurate as anywhere.
        for x in [-87.34f32, -87.5, -100.0, -103.0, -105.0, -1e30] {
            assert_eq!(exp32(x).to_bits(), 0, "exp({x})");
        }
        for x in [-87.33f32, -87.2, -86.9] {
            let (got, want) = (exp32(x), (x as f64).exp());
            assert!(got >= f32::MIN_POSITIVE, "exp({x}) = {got:e} is not normal");
            assert!(
                (got as f64 - want).abs() <= 2.0 * f32::EPSILON as f64 * want,
                "exp({x}) = {got:e}, want {want:e}"
            );
        }
        assert_eq!(exp32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp32(89.0), f32::INFINITY);
        assert_eq!(exp32(f32::INFINITY), f32::INFINITY);
        assert!(exp32(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_pieces_match_the_scalar_reference_at_odd_sizes() {
        for n in SIZES {
            let x = inputs(n, 30.0);
            let want_max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            same(max(&x), want_max, &format!("max of {n}"));
            let finite: Vec<f32> = x
                .iter()
                .map(|v| if v.is_finite() { *v } else { -3.0 })
                .collect();
            let m = max(&finite);
            // Each exponential within 2 f32 ulps of e^(x − max); the exact sum of them, in f64.
            let check = |exps: &[f32], what: &str| -> f64 {
                let mut sum = 0f64;
                for (g, &v) in exps.iter().zip(&finite) {
                    let w = ((v - m) as f64).exp();
                    assert!(
                        (*g as f64 - w).abs() <= 2.0 * f32::EPSILON as f64 * w,
                        "{what} e^(x − max), n = {n}: {g} vs {w}"
                    );
                    sum += *g as f64;
                }
                sum
            };
            let mut got = finite.clone();
            let sum = exp_shifted(&mut got, m);
            let want_sum = check(&got, "f64-summing");
            assert!(
                (sum - want_sum).abs() <= 1e-12 * want_sum.max(1.0),
                "sum {sum} vs {want_sum}"
            );
            // The bf16 mode's variant: its own exponentials (FMA steps), their sum within f32
            // rounding.
            let mut fast = finite.clone();
            let fast_sum = exp_shifted_f32(&mut fast, m);
            let fast_want = check(&fast, "f32-summing");
            assert!(
                (fast_sum - fast_want).abs() <= 1e-6 * fast_want.max(1.0),
                "f32 sum {fast_sum} vs {fast_want}"
            );
            let mut nan = vec![1.0, f32::NAN, 2.0];
            exp_shifted(&mut nan, 2.0);
            assert!(nan[1].is_nan() && nan[0] > 0.0);
        }
    }

    /// The AVX-512 softmax kernel gives the portable loops' bits: every exponential and both
    /// kinds of sum, at sizes with and without a tail, through NaN, −∞, the underflow edge and
    /// values above the max.
    #[test]
    fn the_avx512_softmax_exponential_equals_the_portable_loops() {
        if isa() != Isa::Avx512 {
            eprintln!("SKIPPED: this CPU has no AVX-512; only the portable loops ran");
            return;
        }
        let mut rng = crate::cpu::testutil::Rng::new(17);
        for n in [0usize, 1, 15, 16, 17, 33, 100, 2430] {
            let mut x = rng.vec(n, 60.0);
            for (i, v) in x.iter_mut().enumerate() {
                match i % 13 {
                    2 => *v = f32::NAN,
                    4 => *v = f32::NEG_INFINITY,
                    6 => *v = 2.0 + EXP_MIN,
                    8 => *v = 2.0 + EXP_MIN - 1e-5,
                    10 => *v = 2.5,
                    _ => {}
                }
            }
            for f64_sums in [true, false] {
                let (mut fast, mut portable) = (x.clone(), x.clone());
                // SAFETY: AVX-512F/DQ/VL are present (checked above).
                let (a, b) = unsafe {
                    match f64_sums {
                        true => (
                            exp_shifted_avx512::<true>(&mut fast, 2.0),
                            exp_shifted_lanes(&mut portable, 2.0),
                        ),
                        false => (
                            exp_shifted_avx512::<false>(&mut fast, 2.0),
                            exp_shifted_f32_lanes(&mut portable, 2.0),
                        ),
                    }
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&portable), "n {n}, f64 sums {f64_sums}");
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "sum, n {n}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn activations_match_the_f64_formulas_at_odd_sizes() {
        // The sigmoid form with the C library's exp: the tanh form `x·(1 + tanh(u))/2` loses
        // digits to cancellation where GELU is tiny (1.6e-5 relative at x = −6.3, 3.5e-12
        // absolute), which is why the kernels use this one.
        let gelu = |x: f32| {
            let x = x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            (x / (1.0 + (-2.0 * u).exp())) as f32
        };
        let silu = |x: f32| (x as f64 / (1.0 + (-(x as f64)).exp())) as f32;
        // Abramowitz–Stegun 7.1.26 would be too coarse; the reference is erfc's series-free
        // identity through libm's erf checked at known points below.
        let gelu_erf = |x: f32| {
            (0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
        };
        for n in SIZES {
            let x = inputs(n, 8.0);
            let up = inputs(n + 1, 2.0);
            for (act, f) in [
                (Activation::GeluTanh, &gelu as &dyn Fn(f32) -> f32),
                (Activation::Gelu, &gelu_erf),
                (Activation::Silu, &silu),
            ] {
                let mut got = x.clone();
                activate(&mut got, act);
                let mut out = vec![0.0; n];
                gated(&x, &up[..n], &mut out, act);
                for (i, &v) in x.iter().enumerate() {
                    same(got[i], f(v), &format!("{act:?}({v})"));
                    same(out[i], f(v) * up[i], &format!("{act:?}({v})·{}", up[i]));
                }
            }
        }
    }

    /// bf16 mode's f32 activations stay within 1e-5 relative of the f64 formulas (far below the
    /// bf16 rounding their next product applies), specials included.
    #[test]
    fn f32_activations_stay_within_a_few_ulps() {
        let f64_of = |act: Activation, x: f64| match act {
            Activation::GeluTanh => gelu64(x),
            Activation::Gelu => gelu_erf64(x),
            Activation::Silu => silu64(x),
        };
        for n in SIZES {
            let x = inputs(n, 12.0);
            let up = vec![1.0f32; n];
            for act in [Activation::GeluTanh, Activation::Gelu, Activation::Silu] {
                let mut out = vec![0.0; n];
                gated_f32(&x, &up, &mut out, act);
                for (&v, &g) in x.iter().zip(&out) {
                    let w = f64_of(act, v as f64);
                    if w.is_nan() {
                        assert!(g.is_nan(), "{act:?}({v}): {g} vs NaN");
                        continue;
                    }
                    // e^(−2u) carries the rounding of its f32 argument times |2u| (≤ ~30 before
                    // the result underflows): 1e-5 relative at most, against bf16's 2⁻⁹ (or of
                    // 1e-30 where the result underflows towards 0).
                    let tol = 1e-5 * w.abs().max(1e-30);
                    assert!(
                        (g as f64 - w).abs() <= tol || (g.is_infinite() && g as f64 == w),
                        "{act:?}({v}): {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn norm_pieces_match_the_scalar_reference_at_odd_sizes() {
        for n in SIZES {
            let x = inputs(n, 7.0);
            let finite: Vec<f32> = x
                .iter()
                .map(|v| if v.is_finite() { *v } else { 0.5 })
                .collect();
            let want_sum: f64 = finite.iter().map(|&v| v as f64).sum();
            assert!(
                (sum(&finite) - want_sum).abs() <= 1e-12 * want_sum.abs().max(1.0),
                "sum of {n}"
            );
            let mean = want_sum / n as f64;
            let want_sq: f64 = finite.iter().map(|&v| (v as f64 - mean).powi(2)).sum();
            assert!(
                (sum_sq(&finite, mean) - want_sq).abs() <= 1e-12 * want_sq.max(1.0),
                "Σ(x − mean)² of {n}"
            );
            // Specials propagate as in the scalar sums.
            assert_eq!(
                sum(&x).is_nan(),
                x.iter().map(|&v| v as f64).sum::<f64>().is_nan()
            );
            assert_eq!(sum_sq(&x, 0.0).is_nan(), x.iter().any(|v| v.is_nan()));
            let (w, b, m) = (inputs(n + 1, 2.0), inputs(n + 2, 1.0), inputs(n + 3, 1.5));
            let inv = 1.0 / (want_sq / n as f64 + 1e-6).sqrt();
            for opts in 0..8 {
                let w = (opts & 1 != 0).then(|| &w[..n]);
                let b = (opts & 2 != 0).then(|| &b[..n]);
                let m = (opts & 4 != 0).then(|| &m[..n]);
                let mut got = vec![0f32; n];
                normalize(&x, mean, inv, w, b, m, &mut got);
                for (j, &v) in x.iter().enumerate() {
                    let mut y = ((v as f64 - mean) * inv) as f32;
                    if let Some(w) = w {
                        y *= w[j];
                    }
                    if let Some(b) = b {
                        y += b[j];
                    }
                    if let Some(m) = m {
                        y *= m[j];
                    }
                    same(got[j], y, &format!("normalize {n} opts {opts} at {j}"));
                }
            }
        }
    }

    #[test]
    fn scale_multiplies_every_element() {
        for n in SIZES {
            let x = inputs(n, 5.0);
            let mut got = x.clone();
            scale(&mut got, 0.37);
            for (g, v) in got.iter().zip(&x) {
                same(*g, v * 0.37, "scale");
            }
        }
    }

    /// Every branch of the choice, whatever this CPU has.
    #[test]
    fn the_widest_kernels_the_features_allow_are_chosen() {
        let f = |avx512, avx2_fma| Features { avx512, avx2_fma }.best();
        assert_eq!(f(true, true), Isa::Avx512);
        assert_eq!(f(true, false), Isa::Avx512);
        assert_eq!(f(false, true), Isa::Avx2);
        assert_eq!(f(false, false), Isa::Baseline);
    }

    /// Hardware-dependent: which branch it checks depends on this CPU (the output says which).
    #[test]
    fn this_cpu_takes_its_best_kernels_whichever_they_are() {
        let features = Features::detect();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx512 = has!("avx512f") && has!("avx512dq") && has!("avx512vl");
            assert_eq!(features.avx512, avx512);
            assert_eq!(features.avx2_fma, has!("avx2") && has!("fma"));
            let want = if avx512 {
                Isa::Avx512
            } else if has!("avx2") && has!("fma") {
                Isa::Avx2
            } else {
                Isa::Baseline
            };
            assert_eq!(isa(), want, "{features:?}");
        }
        eprintln!("this CPU ({features:?}) checked the {:?} branch", isa());
    }
}
