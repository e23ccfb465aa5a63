//! RoPE angle tables of every variant the families use, computed as their references compute
//! them (the backends only apply a table; see `tessera_backend::RopeTable`):
//! - 1-D ([`inv_freq`]): Gemma, Qwen3, LFM2 — `RopeStyle::SplitHalf`;
//! - 2-D axial ([`axial_inv_freq`]): Gemma 4 vision — `RopeStyle::Axial2d`;
//! - multi-axis ([`MultiAxis`]): Z-Image, Qwen-Image — `RopeStyle::Interleaved` from angles;
//! - Qwen3-VL's interleaved multimodal RoPE ([`mrope_interleaved_angles`]) — `RopeStyle::SplitHalf`
//!   from angles, one table row per token.

/// `inv_freq[j] = 1 / θ^(2j/d)` for `j < d/2`, computed as transformers does: the exponent in
/// f32, the power in f32 arithmetic of an f64 base (torch evaluates `base ** f32_tensor` in f32).
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|j| {
            let exponent = (2 * j) as f32 / dim as f32;
            1.0f32 / (theta as f32).powf(exponent)
        })
        .collect()
}

/// Axial 2-D RoPE of heads of `head_dim`: each half of a head rotates by one axis with
/// `head_dim / 4` frequencies, shared by both axes.
pub fn axial_inv_freq(theta: f64, head_dim: usize) -> Vec<f32> {
    inv_freq(theta, head_dim / 2)
}

/// Multi-axis RoPE: a head's rotated pairs are split between axes (Z-Image: frame, height,
/// width), axis `a` with `dims[a] / 2` frequencies `1 / θ^(2i/dims[a])` in f64; a token's angles
/// are its position on each axis times that axis's frequencies, axes concatenated.
#[derive(Clone, Debug)]
pub struct MultiAxis {
    freqs: Vec<Vec<f64>>,
}

impl MultiAxis {
    pub fn new(theta: f64, dims: &[usize]) -> Self {
        MultiAxis {
            freqs: dims
                .iter()
                .map(|&d| {
                    (0..d / 2)
                        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
                        .collect()
                })
                .collect(),
        }
    }

    /// Rotated pairs per head: the sum over axes.
    pub fn pairs(&self) -> usize {
        self.freqs.iter().map(Vec::len).sum()
    }

    /// The angles `[tokens, pairs]` of tokens at `positions` (one position per axis each),
    /// each `pos · f` in f64 rounded once to f32.
    pub fn angles<P: AsRef<[u32]>>(&self, positions: &[P]) -> Vec<f32> {
        let mut out = Vec::with_capacity(positions.len() * self.pairs());
        for p in positions {
            for (&pos, f) in p.as_ref().iter().zip(&self.freqs) {
                out.extend(f.iter().map(|&f| (pos as f64 * f) as f32));
            }
        }
        out
    }
}

/// Qwen3-VL's interleaved multimodal RoPE (transformers 5.25.0
/// `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`): pair `j` turns with the height
/// position when `j mod 3 = 1` and `j < 3·sections[1]`, with the width position when
/// `j mod 3 = 2` and `j < 3·sections[2]`, with the time position otherwise; its angle is that
/// position times `inv_freq[j]` in f32. Returns `[tokens, inv_freq.len()]` for the tokens whose
/// `(t, h, w)` positions are `positions[0][i], positions[1][i], positions[2][i]`.
pub fn mrope_interleaved_angles(
    inv_freq: &[f32],
    sections: [usize; 3],
    positions: &[Vec<u32>; 3],
) -> Vec<f32> {
    let axis: Vec<usize> = (0..inv_freq.len())
        .map(|j| match j % 3 {
            1 if j < 3 * sections[1] => 1,
            2 if j < 3 * sections[2] => 2,
            _ => 0,
        })
        .collect();
    (0..positions[0].len())
        .flat_map(|i| {
            inv_freq
                .iter()
                .zip(&axis)
                .map(move |(&f, &a)| positions[a][i] as f32 * f)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_freq_first_and_last() {
        let f = inv_freq(10_000.0, 256);
        assert_eq!(f.len(), 128);
        assert_eq!(f[0], 1.0);
        assert!((f[127] as f64 - 1.0 / 10_000f64.powf(254.0 / 256.0)).abs() < 1e-9);
        assert_eq!(axial_inv_freq(100.0, 64), inv_freq(100.0, 32));
    }

    #[test]
    fn mrope_interleaves_the_axes_within_their_sections() {
        // Five pairs, sections [1, 2, 2]: pairs 1 and 4 read h, 2 reads w (5 ≥ 3·2 does not
        // exist), 0 and 3 read t.
        let inv = [1.0f32; 5];
        let a = mrope_interleaved_angles(&inv, [1, 2, 2], &[vec![10], vec![20], vec![30]]);
        assert_eq!(a, [10.0, 20.0, 30.0, 10.0, 20.0]);
        // Sections [2, 1, 1]: only pairs 1 and 2 leave the time axis.
        let a = mrope_interleaved_angles(&inv, [2, 1, 1], &[vec![10], vec![20], vec![30]]);
        assert_eq!(a, [10.0, 20.0, 30.0, 10.0, 10.0]);
    }

    #[test]
    fn multi_axis_concatenates_axes() {
        let m = MultiAxis::new(256.0, &[2, 4]);
        assert_eq!(m.pairs(), 3);
        let a = m.angles(&[[3u32, 5]]);
        let want = [3.0, 5.0, 5.0 / 256f64.powf(0.5)];
        for (g, w) in a.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{a:?}");
        }
    }
}
