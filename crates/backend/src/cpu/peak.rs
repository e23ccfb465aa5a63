//! The CPU's arithmetic peak, measured: what `tessera bench peak` reports and the CPU workloads
//! are judged against (issue 18). An FMA loop of independent chains on every thread of the pool,
//! wide enough and long enough that only the FMA units bound it.

use std::time::Instant;

/// Independent accumulator chains per thread: more than FMA latency × FMA ports on current cores.
const CHAINS: usize = 12;

/// Single-precision FLOP/s (an FMA counting two) of every thread of the rayon pool together,
/// from `iters` rounds of [`CHAINS`] vector FMAs per thread, and the vector width it used; `None`
/// on a CPU with neither AVX-512F nor AVX2+FMA.
pub fn fma_flops(iters: usize) -> Option<(f64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        let (lanes, name, run): (usize, &str, fn(usize) -> f32) =
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is present (checked just above).
                (16, "AVX-512", |n| unsafe { fma_loop_avx512(n) })
            } else if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: AVX2 and FMA are present (checked just above).
                (8, "AVX2", |n| unsafe { fma_loop_avx2(n) })
            } else {
                return None;
            };
        let start = Instant::now();
        let sums = rayon::broadcast(|_| run(iters));
        let seconds = start.elapsed().as_secs_f64();
        // Keep the results alive so the loops are not optimised away.
        std::hint::black_box(sums);
        let threads = rayon::current_num_threads();
        let flops = 2.0 * (CHAINS * lanes * iters * threads) as f64;
        Some((flops / seconds, name))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        None
    }
}

/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    let mut total = 0.0;
    for &x in &acc {
        // SAFETY: `lanes` holds the 8 floats stored.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
        total += lanes.iter().sum::<f32>();
    }
    total
}

/// The bf16 peak in FLOP/s (a multiply-add counting two) of every thread of the pool together,
/// from `iters` rounds of [`CHAINS`] `vdpbf16ps` (32 multiply-adds each) per thread; `None`
/// without AVX512_BF16.
pub fn bf16_dot_flops(iters: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if super::bf16::native() {
        let start = Instant::now();
        // SAFETY: AVX-512F and AVX512_BF16 are present (`native`).
        let sums = rayon::broadcast(|_| unsafe { dot_loop_bf16(iters) });
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        let threads = rayon::current_num_threads();
        return Some(2.0 * (CHAINS * 32 * iters * threads) as f64 / seconds);
    }
    let _ = iters;
    None
}

/// Below this many times the f32 FMA's FLOP/s, `vdpbf16ps` does not pay for the activations'
/// rounding to bf16: bf16 products are then no faster than f32 where compute bounds them.
pub const BF16_PAYS: f64 = 1.5;

/// How many times the f32 FMA's FLOP/s `vdpbf16ps` reaches on one thread of this machine,
/// measured once per process (interleaved rounds of a few tenths of a millisecond, the best of
/// each); `None` without AVX512_BF16. About 2 on a Zen 4 (`bench peak`: 459 against 232 GFLOP/s
/// on two cores), about 1 on Intel's Xeons, where `vdpbf16ps` issues at half the FMA's rate
/// (issue 32). What `describe` reports, once per machine rather than per call.
pub fn bf16_dot_vs_fma() -> Option<f64> {
    static RATIO: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    *RATIO.get_or_init(measure_bf16_dot_vs_fma)
}

fn measure_bf16_dot_vs_fma() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if super::bf16::native() {
        const ITERS: usize = 50_000;
        let seconds = |f: &dyn Fn() -> f32| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_secs_f64()
        };
        let (mut fma, mut dot) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            // SAFETY: AVX-512F and AVX512_BF16 are present (`native`).
            fma = fma.min(seconds(&|| unsafe { fma_loop_avx512(ITERS) }));
            // SAFETY: as above.
            dot = dot.min(seconds(&|| unsafe { dot_loop_bf16(ITERS) }));
        }
        // The same number of instructions: 16 multiply-adds per FMA, 32 per `vdpbf16ps`.
        return Some(2.0 * fma / dot);
    }
    None
}

/// # Safety
/// The CPU has AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_loop_bf16(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: 32 bf16 values are the 64 bytes of an f32 vector; any bits are a valid vector.
    let (a, b): (__m512bh, __m512bh) = unsafe {
        (
            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3f80)),
            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3380)),
        )
    };
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, b);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

#[cfg(test)]
mod tests {
    /// Whether this CPU has AVX-512F, or AVX2 and FMA: what [`super::fma_flops`] needs.
    fn has_fma_unit() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            has!("avx512f") || (has!("avx2") && has!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Hardware-dependent: with a vector FMA unit the peak is measured and plausible; without one
    /// there is no figure (the output says which branch ran).
    #[test]
    fn the_fma_peak_is_measured_exactly_where_there_is_a_vector_unit() {
        match super::fma_flops(1_000_000) {
            Some((flops, isa)) => {
                eprintln!("measured branch: {isa}: {:.1} GFLOP/s", flops / 1e9);
                assert!(has_fma_unit(), "{isa} measured without the unit");
                assert!(flops > 1e9, "{isa}: {flops} FLOP/s");
            }
            None => {
                eprintln!("no-unit branch: this CPU has neither AVX-512F nor AVX2+FMA");
                assert!(
                    !has_fma_unit(),
                    "the unit is there but no peak was measured"
                );
            }
        }
    }

    /// Hardware-dependent, as above, for `vdpbf16ps` against the FMA on one thread.
    #[test]
    fn the_bf16_rate_against_the_fma_is_measured_exactly_where_there_is_avx512_bf16() {
        match super::bf16_dot_vs_fma() {
            Some(ratio) => {
                eprintln!("measured branch: vdpbf16ps at {ratio:.2}× the f32 FMA's FLOP/s");
                assert!(super::super::bf16::native(), "measured without AVX512_BF16");
                // One vdpbf16ps does twice an FMA's multiply-adds: between an eighth and 4×
                // the FMA's rate on any core that has it.
                assert!((0.125..=4.0).contains(&ratio), "{ratio}");
                assert_eq!(super::bf16_dot_vs_fma(), Some(ratio), "measured once");
            }
            None => {
                eprintln!("no-unit branch: this CPU has no AVX512_BF16");
                assert!(
                    !super::super::bf16::native(),
                    "AVX512_BF16 is there but no ratio"
                );
            }
        }
    }

    /// Hardware-dependent, as above, for the bf16 dot-product peak (AVX512_BF16).
    #[test]
    fn the_bf16_peak_is_measured_exactly_where_there_is_avx512_bf16() {
        match super::bf16_dot_flops(200_000) {
            Some(flops) => {
                eprintln!("measured branch: AVX512_BF16: {:.1} GFLOP/s", flops / 1e9);
                assert!(super::super::bf16::native(), "measured without AVX512_BF16");
                assert!(flops > 1e9, "{flops} FLOP/s");
            }
            None => {
                eprintln!("no-unit branch: this CPU has no AVX512_BF16");
                assert!(
                    !super::super::bf16::native(),
                    "AVX512_BF16 is there but no peak"
                );
            }
        }
    }
}
