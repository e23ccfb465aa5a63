//! Deterministic pseudo-random numbers for benchmark and load-test inputs: xorshift64, so every
//! run and every machine feeds the engines the same ids, pixels and values.

/// A xorshift64 generator (13, 7, 17) from a non-zero seed.
pub struct XorShift(u64);

impl XorShift {
    /// A generator from `seed` (a zero seed, which xorshift cannot leave, is made odd).
    pub fn new(seed: u64) -> Self {
        XorShift(seed | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [0, 1): the top 24 bits of the next draw, exact in an `f32`.
    pub fn next_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}
