//! Denormal (subnormal) floats flushed to zero on every thread that runs CPU ops.
//!
//! Intel cores take a microcode assist on every operation with a denormal operand or result,
//! and long attention rows make them: probabilities of far-away keys underflow into the
//! denormal range before they reach zero, and the products then multiply them. On a Xeon that
//! made a 2,208-token document 4.3× slower (issue 32); AMD cores pay little. The MXCSR's
//! flush-to-zero (results) and denormals-are-zero (inputs) bits remove the cliff. They change
//! a result only where a value is below 2⁻¹²⁶ ≈ 1.2e-38, far below the f32 path's tolerances,
//! and they govern the SSE, AVX and AVX-512 units alike (f64 lanes included). The softmax's
//! exponential makes no denormals in the first place (`vmath::exp_shifted`), so attention's
//! probabilities are the same on every machine; the bits cover everything else (products on
//! tiny activations, norms of tiny rows).
//!
//! The bits are per thread, so they are set where the work runs rather than once at start-up
//! (a thread inherits its creator's MXCSR, but a library cannot rely on being first): every
//! op's entry calls [`flush_here`], which sets them on the calling thread and, the first time
//! that thread calls it, on every thread of the rayon pool the op's parallel work runs on (the
//! pool the caller works in, else the global one). rayon's pools keep their threads for their
//! lifetime, so no pool thread can start unflushed later. After the first call on a thread it
//! is one thread-local read.
//!
//! Other architectures are left as they are (no-ops below): aarch64's FPCR.FZ would be the
//! equivalent bit, but no Arm machine here has shown the cliff or could test the bit, and the
//! softmax's tails, the known source, are zero by construction there too.

use std::cell::Cell;

thread_local! {
    /// Set on a thread only together with every thread of its pool (see [`flush_here`]).
    static FLUSHED: Cell<bool> = const { Cell::new(false) };
}

/// Flush denormals on this thread and on every thread of the rayon pool its parallel work
/// runs on.
pub fn flush_here() {
    if FLUSHED.with(Cell::get) {
        // Set here only after the broadcast below reached this thread's pool.
        return;
    }
    // The pool this thread works in, or the global pool from a thread outside any: the pool
    // that rayon's parallel iterators, and so the kernels, use when called from here.
    rayon::broadcast(|_| mark());
    mark();
}

/// Set the bits on this thread and remember it.
fn mark() {
    set_bits();
    FLUSHED.with(|f| f.set(true));
}

/// Whether this thread flushes denormals: on x86-64, both MXCSR bits set.
pub fn flushing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        mxcsr::read() & mxcsr::FTZ_DAZ == mxcsr::FTZ_DAZ
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn set_bits() {
    #[cfg(target_arch = "x86_64")]
    mxcsr::add_ftz_daz();
}

/// The SSE/AVX control and status register, through `stmxcsr`/`ldmxcsr` in inline assembly, as
/// the deprecation notes of `std::arch`'s `_mm_getcsr`/`_mm_setcsr` ask (the same two
/// instructions; `#[allow(deprecated)]` would only hide the note). Either way the compiler keeps
/// assuming the default float environment after the bits change: an expression it folds at
/// compile time keeps a denormal that the same expression run would flush. That can move a
/// value only below 2⁻¹²⁶, which no result depends on, and no memory safety rests on float
/// results. The bits stay set after the op returns: a thread that has called a CPU op flushes
/// denormals from then on, as the pool's threads do.
#[cfg(target_arch = "x86_64")]
mod mxcsr {
    /// Flush-to-zero (bit 15: denormal results become 0) and denormals-are-zero (bit 6:
    /// denormal operands read as 0).
    pub const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

    pub fn read() -> u32 {
        let mut v: u32 = 0;
        // SAFETY: `stmxcsr` stores the 4-byte control register into `v`, a live, aligned u32 on
        // this stack frame; it reads no other memory and changes no state.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut v as *mut u32, options(nostack, preserves_flags));
        }
        v
    }

    /// Add FTZ and DAZ to this thread's register.
    pub fn add_ftz_daz() {
        let v = read() | FTZ_DAZ;
        // SAFETY: `ldmxcsr` loads the control register from `v`, a live u32. `v` is the current
        // value with FTZ and DAZ added (both valid bits on every x86-64 CPU with SSE2, which
        // x86-64 guarantees), so no reserved bit is set (which would fault), no exception is
        // unmasked and the rounding mode is unchanged.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &v as *const u32, options(nostack, readonly, preserves_flags));
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::{AttnSpec, Backend, Epilogue, Mask, QkvLayout, View, ViewMut};

    #[test]
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
    fn a_new_thread_flushes_once_it_runs_an_op() {
        std::thread::spawn(|| {
            flush_here();
            assert!(flushing());
        })
        .join()
        .expect("thread");
    }

    /// `x (m × k) · w (n × k)ᵀ` on `be`.
    fn product(be: &crate::cpu::CpuBackend, x: &[f32], w: &[f32], m: usize, n: usize) -> Vec<f32> {
        let k = x.len() / m;
        let mat = be.matrix_f32(&[(w, n)], k).unwrap();
        let xb = buf(be, x);
        let mut o = buf(be, &vec![f32::NAN; m * n]);
        be.matmul(
            View::new(&xb, m, k),
            &mat,
            ViewMut::new(&mut o, m, n),
            &Epilogue::default(),
        )
        .unwrap();
        be.read_f32(View::new(&o, m, n)).unwrap()
    }

    #[test]
    fn an_op_run_in_another_pool_flushes_every_worker_of_that_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool of 3");
        // The pool's threads start with this test thread's register, which no op has touched.
        let before = pool.broadcast(|_| flushing());
        assert!(before.iter().all(|&f| !f), "already flushing: {before:?}");
        let (m, n, k) = (128, 128, 128); // 2²¹ multiply-adds: a parallel product
        let mut rng = Rng::new(3);
        let (x, w) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
        pool.install(|| product(&cpu(), &x, &w, m, n));
        // MXCSR read back inside a task on each of the pool's workers.
        let after = pool.broadcast(|_| flushing());
        assert!(after.iter().all(|&f| f), "workers after an op: {after:?}");
    }

    #[test]
    fn products_read_denormal_operands_and_make_denormal_results_as_zero() {
        let be = cpu();
        // One product on the calling thread, one split over the pool's threads.
        for (m, n, k) in [(4, 3, 8), (64, 128, 256)] {
            let ones = vec![1.0f32; n * k];
            // Denormal activations (the far keys' probabilities of a long attention row) read
            // as 0: unflushed, each output would be k · 1e-39.
            let denormal = vec![1e-39f32; m * k];
            assert!(denormal[0].is_subnormal());
            let got = product(&be, &denormal, &ones, m, n);
            assert!(got.iter().all(|&v| v == 0.0), "{m}×{n}×{k}: {:e}", got[0]);
            // Normal operands whose products fall below the normal range give 0 too.
            let small = vec![1e-20f32; m * k];
            let tiny_w = vec![1e-20f32; n * k];
            let got = product(&be, &small, &tiny_w, m, n);
            assert!(got.iter().all(|&v| v == 0.0), "{m}×{n}×{k}: {:e}", got[0]);
            // Above it, nothing changes.
            let (a, b) = (vec![1e-15f32; m * k], vec![1e-15f32; n * k]);
            let want = k as f64 * (1e-15f32 as f64).powi(2);
            for v in product(&be, &a, &b, m, n) {
                assert!((v as f64 - want).abs() <= 1e-6 * want, "{v:e} vs {want:e}");
            }
        }
    }

    /// Two keys seen from two queries: scores `0` and `score`, values `[1, 2]` and `[big, 0]`.
    fn two_keys(score: f32, big: f32) -> Vec<f32> {
        let be = cpu();
        let layout = QkvLayout {
            heads_q: 1,
            heads_kv: 1,
            head_dim: 2,
        };
        let q = buf(&be, &[1.0, 0.0, 1.0, 0.0]);
        let k = buf(&be, &[0.0, 0.0, score, 0.0]);
        let v = buf(&be, &[1.0, 2.0, big, 0.0]);
        let mut o = buf(&be, &[f32::NAN; 4]);
        let segs = be.segments(&[2]).unwrap();
        be.attention(
            View::new(&q, 2, 2),
            View::new(&k, 2, 2),
            View::new(&v, 2, 2),
            ViewMut::new(&mut o, 2, 2),
            &AttnSpec::new(layout, 1.0, Mask::Full),
            &segs,
        )
        .unwrap();
        be.read_f32(View::new(&o, 2, 2)).unwrap()
    }

    #[test]
    fn attention_drops_probabilities_below_the_normal_range() {
        // e^−95 ≈ 5.5e-42 is a denormal: its key is dropped, however large its value (1e38 would
        // add 5.5e-4 to the first output otherwise).
        assert_eq!(two_keys(-95.0, 1e38), [1.0, 2.0, 1.0, 2.0]);
        // e^−80 ≈ 1.8e-35 is normal and kept: it adds 1.8e-5 to the first output.
        let p = (-80f64).exp();
        let want = [(1.0 + p * 1e30) / (1.0 + p), 2.0 / (1.0 + p)];
        let got = two_keys(-80.0, 1e30);
        for (i, &g) in got.iter().enumerate() {
            assert_close(g, want[i % 2], 1e-6, &format!("output {i}"));
        }
        assert!(
            got[0] > 1.0 + 1e-5,
            "the normal tail was dropped: {}",
            got[0]
        );
    }
}
