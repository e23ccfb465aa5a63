//! Software prefetch for the kernels that stream weights once per call (decoding: every weight
//! read once per token, from memory or L3). On a 2-core Xeon the hardware's prefetchers alone left
//! those kernels waiting on their loads: LFM2's Q4_0 decode read its weights at ~12 GB/s where the
//! f32 product streamed ~25 on the same cores. Asking for the lines a page ahead of the reads took
//! its Q4_0 and Q4_K decode from ~57 to ~80–90 tokens/s (BENCHMARKS.md, run cpu-lfm2c).
//!
//! `TESSERA_PREFETCH=BYTES` sets the distance (`0` turns it off), for A/B measurement.

/// How many bytes ahead of its reads a streaming kernel asks for more: 4096 unless
/// `TESSERA_PREFETCH` says otherwise. Read once.
pub fn distance() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| {
        std::env::var("TESSERA_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(4096)
    })
}

/// Ask for the `LINES` cache lines from `ahead` bytes past `p` (nothing when `ahead` is 0). Only
/// a hint: a prefetch never faults, so the address may run past the end of what `p` points into.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn lines<const LINES: usize>(p: *const u8, ahead: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if ahead > 0 {
        let p = p.wrapping_add(ahead);
        for l in 0..LINES {
            // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the
            // address; SSE is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l).cast()) };
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_distance_is_a_page_unless_set() {
        // The environment of the test process does not set it (CI does not).
        if std::env::var_os("TESSERA_PREFETCH").is_none() {
            assert_eq!(super::distance(), 4096);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prefetching_past_the_end_of_a_buffer_is_harmless() {
        let v = [1u8; 100];
        super::lines::<4>(v.as_ptr(), 1 << 40);
        super::lines::<4>(v.as_ptr(), 4096);
        assert_eq!(v.iter().map(|&b| u32::from(b)).sum::<u32>(), 100);
    }
}
