//! The sinusoidal timestep features of diffusion transformers (diffusers'
//! `TimestepEmbedder.timestep_embedding` and Qwen-Image's `QwenImage21TemporalTimesteps`, both
//! 256 wide with the cosine half first), computed as torch computes them in `f32`.

/// Width of the features: 128 frequencies, cosine then sine.
pub const FREQ_DIM: usize = 256;
/// `max_period` of the sinusoid.
const MAX_PERIOD: f64 = 10_000.0;

/// The 128 frequencies of diffusers' `TimestepEmbedder.timestep_embedding`,
/// `f_i = exp(−ln(10⁴) · i / 128)`: the exponent rounded to `f32` in torch's order, the
/// exponential correctly rounded.
///
/// Measured: torch's CPU `exp` (Sleef, ≤ 1 ulp) rounds 3 of these 128 values (i = 13, 44, 119)
/// one ulp the other way. Multiplied by τ ≈ 700 that moves those features by ~2e-5 and the
/// modulations by ~3e-6 relative; parity tests substitute the reference's own table
/// ([`crate::zimage::transformer::ZImageTransformer::set_timestep_frequencies`]) to see the rest of the model at 1e-7.
pub fn timestep_frequencies() -> Vec<f32> {
    let half = FREQ_DIM / 2;
    let k = -(MAX_PERIOD.ln()) as f32;
    (0..half)
        .map(|i| {
            let e = (k * i as f32) / half as f32;
            (e as f64).exp() as f32
        })
        .collect()
}

/// The sinusoidal timestep features `[cos(τ·f) | sin(τ·f)]`, `τ = t_model · t_scale` (cosine
/// first), with `τ·f` rounded to `f32` as torch does.
pub fn timestep_features(freqs: &[f32], t_model: f32, t_scale: f32) -> Vec<f32> {
    let tau = t_model * t_scale;
    let args: Vec<f64> = freqs.iter().map(|&f| (tau * f) as f64).collect();
    args.iter()
        .map(|a| a.cos() as f32)
        .chain(args.iter().map(|a| a.sin() as f32))
        .collect()
}
