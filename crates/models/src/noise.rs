//! The initial latent drawn from a seed.
//!
//! The generator is ours and fixed, so a seed gives the same latent on every machine, build and
//! backend (the latent is drawn on the host): SplitMix64 (Steele, Lea & Flood 2014; state
//! advanced by `0x9E3779B97F4A7C15`) yields 64-bit words; each word's top 53 bits make a uniform
//! `u ∈ (0, 1]`; consecutive pairs `(u₁, u₂)` become two standard normals by Box–Muller in `f64`,
//! `√(−2 ln u₁)·(cos 2πu₂, sin 2πu₂)`, rounded to `f32` and written in order over the
//! latent in its family's layout (Z-Image `[channels, h, w]`, Qwen-Image packed `[tokens, channels]`). It is not torch's `randn` stream: a diffusers image for the same
//! seed differs (use `--init-latent` to feed diffusers' latent instead).

/// SplitMix64.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`.
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// `len` standard-normal `f32` values for `seed`.
pub fn gaussian(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    let mut out = Vec::with_capacity(len + 1);
    while out.len() < len {
        let (u1, u2) = (rng.uniform(), rng.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values_and_normal_statistics() {
        // First outputs of SplitMix64 seeded with 0 (published test vector).
        let mut r = SplitMix64(0);
        assert_eq!(r.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next(), 0x6E78_9E6A_A1B9_65F4);
        let z = gaussian(42, 100_001);
        assert_eq!(z.len(), 100_001);
        assert_eq!(z, gaussian(42, 100_001), "same seed, same latent");
        assert_ne!(z[..8], gaussian(43, 8)[..], "another seed, another latent");
        let n = z.len() as f64;
        let mean = z.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = z.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "mean {mean}, var {var}"
        );
    }
}
