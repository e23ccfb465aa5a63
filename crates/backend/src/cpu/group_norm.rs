//! `nn.GroupNorm` over a channels-last image `[pixels, channels]`, with the activation that
//! follows it in the VAE fused in. Two passes for the statistics (mean, then the variance around
//! it), both accumulated in `f64` over row blocks in parallel.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, rows, rows_mut, vmath};
use crate::view::same_shape;
use crate::{GroupNorm, View, ViewMut};

/// Per-group sums over all rows of `x` of `f(value, group)`.
fn group_sums(
    x: View<'_, CpuBackend>,
    groups: usize,
    f: impl Fn(f32, usize) -> f64 + Sync,
) -> Vec<f64> {
    let per = x.cols / groups;
    rows(x)
        .fold(
            || vec![0f64; groups],
            |mut acc, r| {
                for (c, &v) in r.iter().enumerate() {
                    let g = c / per;
                    acc[g] += f(v, g);
                }
                acc
            },
        )
        .reduce(
            || vec![0f64; groups],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                a
            },
        )
}

pub(super) fn group_norm(
    x: View<'_, CpuBackend>,
    weight: &[f32],
    bias: &[f32],
    spec: &GroupNorm,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    same_shape("group_norm", (x.rows, x.cols), (out.rows, out.cols))?;
    let (c, g) = (x.cols, spec.groups);
    if g == 0 || c % g != 0 || weight.len() != c || bias.len() != c {
        return Err(Error::backend(
            "group_norm",
            format!(
                "{c} channels in {g} groups with weight {} and bias {}",
                weight.len(),
                bias.len()
            ),
        ));
    }
    if x.rows == 0 {
        return Ok(());
    }
    let n = (x.rows * (c / g)) as f64;
    let mean: Vec<f64> = group_sums(x, g, |v, _| v as f64)
        .into_iter()
        .map(|s| s / n)
        .collect();
    let inv: Vec<f64> = group_sums(x, g, |v, gi| (v as f64 - mean[gi]).powi(2))
        .into_iter()
        .map(|s| 1.0 / (s / n + spec.eps as f64).sqrt())
        .collect();
    let per = c / g;
    rows_mut(out).zip(rows(x)).for_each(|(o, r)| {
        for (ch, (o, &v)) in o.iter_mut().zip(r).enumerate() {
            let gi = ch / per;
            *o = ((v as f64 - mean[gi]) * inv[gi]) as f32 * weight[ch] + bias[ch];
        }
        if let Some(act) = spec.act {
            vmath::activate(o, act);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Activation, Backend, GroupNorm, View, ViewMut};

    #[test]
    fn matches_naive_group_norm_with_and_without_silu() {
        let be = cpu();
        for &(pixels, channels, groups, act) in &[
            (1, 2, 1, None),
            (7, 12, 3, Some(Activation::Silu)),
            (35, 64, 32, None),
            (123, 48, 8, Some(Activation::Silu)),
        ] {
            let mut rng = Rng::new((pixels * channels + groups) as u64);
            // Per-channel offsets so that the group means differ.
            let x: Vec<f32> = rng
                .vec(pixels * channels, 2.0)
                .iter()
                .enumerate()
                .map(|(i, v)| v + (i % channels) as f32 * 0.3)
                .collect();
            let w = rng.vec(channels, 1.0);
            let b = rng.vec(channels, 1.0);
            let xb = buf(&be, &x);
            let (wv, bv) = (be.vector_f32(&w).unwrap(), be.vector_f32(&b).unwrap());
            let mut o = buf(&be, &vec![0.0; pixels * channels]);
            let spec = GroupNorm {
                groups,
                eps: 1e-6,
                act,
            };
            be.group_norm(
                View::new(&xb, pixels, channels),
                &wv,
                &bv,
                &spec,
                ViewMut::new(&mut o, pixels, channels),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, pixels, channels)).unwrap();
            let per = channels / groups;
            for gi in 0..groups {
                let vals: Vec<f64> = (0..pixels)
                    .flat_map(|p| (0..per).map(move |j| (p, gi * per + j)))
                    .map(|(p, ch)| x[p * channels + ch] as f64)
                    .collect();
                let m = vals.iter().sum::<f64>() / vals.len() as f64;
                let var = vals.iter().map(|v| (v - m).powi(2)).sum::<f64>() / vals.len() as f64;
                for p in 0..pixels {
                    for ch in gi * per..(gi + 1) * per {
                        let y = (x[p * channels + ch] as f64 - m) / (var + 1e-6).sqrt()
                            * w[ch] as f64
                            + b[ch] as f64;
                        let want = match act {
                            Some(_) => y / (1.0 + (-y).exp()),
                            None => y,
                        };
                        assert_close(got[p * channels + ch], want, 1e-5, "group_norm");
                    }
                }
            }
        }
    }
}
