//! Helpers for the CPU op tests: seeded inputs and tolerant comparisons.

use super::{CpuBackend, CpuBuf};
use crate::Backend;

pub fn cpu() -> CpuBackend {
    CpuBackend::new()
}

pub fn buf(be: &CpuBackend, v: &[f32]) -> CpuBuf {
    let mut b = be.alloc(v.len(), crate::Role::Stream).unwrap();
    be.write_f32(&mut b, v).unwrap();
    b
}

pub fn ids(be: &CpuBackend, v: &[u32]) -> CpuBuf {
    let mut b = be.alloc(v.len(), crate::Role::Index).unwrap();
    be.write_u32(&mut b, v).unwrap();
    b
}

/// xorshift64*: deterministic, seed printed by the failing assertion's message.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        v as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// Uniform in `[-scale, scale)`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

/// `|got − want| ≤ tol · max(1, |want|)`.
pub fn assert_close(got: f32, want: f64, tol: f64, what: &str) {
    assert!(
        got.is_finite() && (got as f64 - want).abs() <= tol * want.abs().max(1.0),
        "{what}: got {got}, want {want}"
    );
}
