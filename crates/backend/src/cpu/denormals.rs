//! Denormal (subnormal) floats flushed to zero on every thread that runs CPU ops.
//!
//! Intel cores take a microcode assist on every operation with a denormal operand or result,
//! and long attention rows make them: probabilities of far-away keys underflow into the
//! denormal range before they reach zero, and the products then multiply them. On a Xeon that
//! made a 2,208-token document 4.3× slower (issue 32); AMD cores pay little. The MXCSR's
//! flush-to-zero (results) and denormals-are-zero (inputs) bits remove the cliff. They change
//! a result only where a value is below 2⁻¹²⁶ ≈ 1.2e-38, far below the f32 path's tolerances,
//! and they govern the SSE, AVX and AVX-512 units alike.
//!
//! The bits are per thread. [`flush_here`] sets them on the calling thread (every op's entry
//! calls it; a thread-local flag makes repeated calls free) and, once per process, on every
//! thread of rayon's global pool, whose threads live as long as the process.

use std::cell::Cell;
use std::sync::Once;

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

thread_local! {
    static FLUSHED: Cell<bool> = const { Cell::new(false) };
}

static POOL: Once = Once::new();

/// Flush denormals on this thread and on every thread of the rayon pool.
pub fn flush_here() {
    if !FLUSHED.with(Cell::get) {
        set_bits();
        FLUSHED.with(|f| f.set(true));
    }
    POOL.call_once(|| {
        rayon::broadcast(|_| {
            set_bits();
            FLUSHED.with(|f| f.set(true));
        });
    });
}

/// Whether this thread flushes denormals (both bits set).
pub fn flushing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        mxcsr() & FTZ_DAZ == FTZ_DAZ
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
fn mxcsr() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: `stmxcsr` stores the 4-byte control register into `v`, a live, aligned u32 on
    // this stack frame; it reads no other memory and changes no state.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut v as *mut u32, options(nostack, preserves_flags));
    }
    v
}

fn set_bits() {
    #[cfg(target_arch = "x86_64")]
    {
        let v = mxcsr() | FTZ_DAZ;
        // SAFETY: `ldmxcsr` loads the control register from `v`, a live u32; the value is the
        // current one with FTZ and DAZ added (both valid bits on every x86-64 CPU with SSE2, which
        // x86-64 guarantees), so no reserved bit is set and no exception is unmasked.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &v as *const u32, options(nostack, readonly, preserves_flags));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_pool_thread_and_the_caller_flush_after_the_first_call() {
        flush_here();
        assert!(flushing(), "the calling thread");
        let all = rayon::broadcast(|_| flushing());
        assert!(all.iter().all(|&f| f), "pool threads: {all:?}");
        // A denormal operand now reads as zero and a denormal result is flushed.
        let tiny = std::hint::black_box(f32::from_bits(1));
        assert_eq!(std::hint::black_box(tiny * 1.0), 0.0);
        let small = std::hint::black_box(f32::MIN_POSITIVE);
        assert_eq!(std::hint::black_box(small * 0.5), 0.0);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_new_thread_flushes_once_it_runs_an_op() {
        std::thread::spawn(|| {
            flush_here();
            assert!(flushing());
        })
        .join()
        .expect("thread");
    }
}
