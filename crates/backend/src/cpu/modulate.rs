//! Row norms with adaLN modulation and the gated residual step of DiT blocks:
//! `N(x) · w · (1 + s)` and `h += tanh(g) · N_post(y)`, followed by the next pre-norm.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, check_same_shape, rows, rows_mut, slice};
use crate::{NormKind, Residual, RowNorm, View, ViewMut};

/// A [`RowNorm`] resolved to host slices, with `1 + s` precomputed once per call.
struct Norm<'a> {
    kind: NormKind,
    weight: Option<&'a [f32]>,
    eps: f32,
    one_plus_scale: Option<Vec<f32>>,
}

/// Check one broadcast row (`[1, cols]`) and borrow it.
fn broadcast_row<'a>(
    op: &str,
    what: &str,
    v: &View<'a, CpuBackend>,
    cols: usize,
) -> Result<&'a [f32]> {
    if v.rows != 1 || v.cols != cols {
        return Err(Error::backend(
            op,
            format!("{what} is {}×{}, expected 1×{cols}", v.rows, v.cols),
        ));
    }
    Ok(slice(v))
}

impl<'a> Norm<'a> {
    fn resolve(op: &str, n: &RowNorm<'a, CpuBackend>, cols: usize) -> Result<Self> {
        if let Some(w) = n.weight
            && w.len() != cols
        {
            return Err(Error::backend(
                op,
                format!("norm weight of {} for rows of {cols}", w.len()),
            ));
        }
        let one_plus_scale = match &n.scale {
            Some(s) => Some(
                broadcast_row(op, "modulation scale", s, cols)?
                    .iter()
                    .map(|&s| 1.0 + s)
                    .collect(),
            ),
            None => None,
        };
        Ok(Norm {
            kind: n.kind,
            weight: n.weight.map(Vec::as_slice),
            eps: n.eps,
            one_plus_scale,
        })
    }

    /// `out = N(x) · w · (1 + s)`: statistics in `f64`, the normalised value rounded once, then
    /// the weight and the modulation applied in `f32` in the reference's order.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        let n = x.len() as f64;
        let mean = match self.kind {
            NormKind::Rms => 0.0,
            NormKind::Layer => x.iter().map(|&v| v as f64).sum::<f64>() / n,
        };
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + self.eps as f64).sqrt();
        for (j, (o, &v)) in out.iter_mut().zip(x).enumerate() {
            let mut y = ((v as f64 - mean) * inv) as f32;
            if let Some(w) = self.weight {
                y *= w[j];
            }
            if let Some(m) = &self.one_plus_scale {
                y *= m[j];
            }
            *o = y;
        }
    }
}

pub(super) fn norm(
    x: View<'_, CpuBackend>,
    n: &RowNorm<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    check_same_shape("norm", (x.rows, x.cols), (out.rows, out.cols))?;
    let n = Norm::resolve("norm", n, x.cols)?;
    rows_mut(out).zip(rows(x)).for_each(|(o, r)| n.apply(r, o));
    Ok(())
}

pub(super) fn residual_add(
    h: ViewMut<'_, CpuBackend>,
    y: View<'_, CpuBackend>,
    res: &Residual<'_, CpuBackend>,
    next: Option<(&RowNorm<'_, CpuBackend>, ViewMut<'_, CpuBackend>)>,
) -> Result<()> {
    const OP: &str = "residual_add";
    check_same_shape(OP, (h.rows, h.cols), (y.rows, y.cols))?;
    let cols = h.cols;
    let post = match &res.post {
        Some(p) if p.scale.is_some() => {
            return Err(Error::backend(OP, "the post-norm cannot be modulated"));
        }
        Some(p) => Some(Norm::resolve(OP, p, cols)?),
        None => None,
    };
    let gate: Option<Vec<f32>> = match &res.tanh_gate {
        Some(g) => Some(
            broadcast_row(OP, "gate", g, cols)?
                .iter()
                .map(|&g| (g as f64).tanh() as f32)
                .collect(),
        ),
        None => None,
    };
    let step = |hr: &mut [f32], yr: &[f32], tmp: &mut Vec<f32>| {
        let branch: &[f32] = match &post {
            Some(p) => {
                tmp.resize(cols, 0.0);
                p.apply(yr, tmp);
                tmp
            }
            None => yr,
        };
        match &gate {
            Some(g) => {
                for ((hv, &b), &g) in hr.iter_mut().zip(branch).zip(g) {
                    *hv += g * b;
                }
            }
            None => {
                for (hv, &b) in hr.iter_mut().zip(branch) {
                    *hv += b;
                }
            }
        }
    };
    match next {
        None => rows_mut(h)
            .zip(rows(y))
            .for_each_init(Vec::new, |tmp, (hr, yr)| step(hr, yr, tmp)),
        Some((n, out)) => {
            check_same_shape(OP, (h.rows, h.cols), (out.rows, out.cols))?;
            let n = Norm::resolve(OP, n, cols)?;
            rows_mut(h).zip(rows(y)).zip(rows_mut(out)).for_each_init(
                Vec::new,
                |tmp, ((hr, yr), o)| {
                    step(hr, yr, tmp);
                    n.apply(hr, o);
                },
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Backend, NormKind, Residual, RowNorm, View, ViewMut};

    /// The definition in f64: `N(x) · w · (1 + s)`.
    fn naive(
        kind: NormKind,
        x: &[f32],
        w: Option<&[f32]>,
        s: Option<&[f32]>,
        eps: f64,
    ) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = match kind {
            NormKind::Rms => 0.0,
            NormKind::Layer => x.iter().map(|&v| v as f64).sum::<f64>() / n,
        };
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        x.iter()
            .enumerate()
            .map(|(j, &v)| {
                (v as f64 - mean)
                    * inv
                    * w.map_or(1.0, |w| w[j] as f64)
                    * s.map_or(1.0, |s| 1.0 + s[j] as f64)
            })
            .collect()
    }

    #[test]
    fn modulated_rms_and_layer_norms() {
        let be = cpu();
        for &(rows, cols, kind, weighted, modulated) in &[
            (1, 1, NormKind::Rms, true, true),
            (7, 45, NormKind::Rms, true, true),
            (9, 130, NormKind::Layer, false, true),
            (3, 17, NormKind::Layer, true, false),
        ] {
            let mut rng = Rng::new((rows * cols) as u64 + 5);
            // An offset mean makes LayerNorm's centring matter.
            let x: Vec<f32> = rng.vec(rows * cols, 3.0).iter().map(|v| v + 0.7).collect();
            let w = rng.vec(cols, 1.0);
            // The modulation row sits in the middle of a wider buffer (row 2, columns 3..).
            let mods = rng.vec(4 * (cols + 5), 1.0);
            let mb = buf(&be, &mods);
            let s = &mods[2 * (cols + 5) + 3..2 * (cols + 5) + 3 + cols];
            let xb = buf(&be, &x);
            let wv = be.vector(&w).unwrap();
            let mut n = RowNorm {
                kind,
                weight: weighted.then_some(&wv),
                eps: 1e-6,
                scale: None,
            };
            if modulated {
                n = n.modulated(View::new(&mb, 4, cols + 5).rows(2, 1).cols(3, cols));
            }
            let mut o = buf(&be, &vec![0.0; rows * cols]);
            be.norm(
                View::new(&xb, rows, cols),
                &n,
                ViewMut::new(&mut o, rows, cols),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, rows, cols)).unwrap();
            for r in 0..rows {
                let want = naive(
                    kind,
                    &x[r * cols..(r + 1) * cols],
                    weighted.then_some(w.as_slice()),
                    modulated.then_some(s),
                    1e-6,
                );
                for c in 0..cols {
                    assert_close(got[r * cols + c], want[c], 1e-5, "norm");
                }
            }
        }
    }

    #[test]
    fn gated_sandwich_residual_then_modulated_next_norm() {
        let be = cpu();
        let (rows, cols) = (11, 37);
        let mut rng = Rng::new(21);
        let h0 = rng.vec(rows * cols, 2.0);
        let y = rng.vec(rows * cols, 3.0);
        let pw = rng.vec(cols, 1.0);
        let nw = rng.vec(cols, 1.0);
        let g = rng.vec(cols, 2.0);
        let s = rng.vec(cols, 1.0);
        let (pwv, nwv) = (be.vector(&pw).unwrap(), be.vector(&nw).unwrap());
        let (gb, sb, yb) = (buf(&be, &g), buf(&be, &s), buf(&be, &y));
        for case in 0..3 {
            // 0: plain add, no next; 1: post-norm + gate + modulated next; 2: plain add + next.
            let mut hb = buf(&be, &h0);
            let mut ob = buf(&be, &vec![f32::NAN; rows * cols]);
            let res = if case == 1 {
                Residual {
                    post: Some(RowNorm::rms(&pwv, 1e-5)),
                    tanh_gate: Some(View::new(&gb, 1, cols)),
                }
            } else {
                Residual::plain()
            };
            let next_norm = match case {
                1 => Some(RowNorm::rms(&nwv, 1e-5).modulated(View::new(&sb, 1, cols))),
                2 => Some(RowNorm::rms(&nwv, 1e-5)),
                _ => None,
            };
            be.residual_add(
                ViewMut::new(&mut hb, rows, cols),
                View::new(&yb, rows, cols),
                &res,
                next_norm
                    .as_ref()
                    .map(|n| (n, ViewMut::new(&mut ob, rows, cols))),
            )
            .unwrap();
            let h = be.read_f32(View::new(&hb, rows, cols)).unwrap();
            let o = be.read_f32(View::new(&ob, rows, cols)).unwrap();
            for r in 0..rows {
                let yr = &y[r * cols..(r + 1) * cols];
                let branch: Vec<f64> = if case == 1 {
                    naive(NormKind::Rms, yr, Some(&pw), None, 1e-5)
                        .iter()
                        .zip(&g)
                        .map(|(b, &g)| b * (g as f64).tanh())
                        .collect()
                } else {
                    yr.iter().map(|&v| v as f64).collect()
                };
                let want_h: Vec<f64> = (0..cols)
                    .map(|c| h0[r * cols + c] as f64 + branch[c])
                    .collect();
                for c in 0..cols {
                    assert_close(h[r * cols + c], want_h[c], 1e-5, "residual h");
                }
                let hf: Vec<f32> = want_h.iter().map(|&v| v as f32).collect();
                match case {
                    0 => assert!(o[r * cols..(r + 1) * cols].iter().all(|v| v.is_nan())),
                    _ => {
                        let want = naive(
                            NormKind::Rms,
                            &hf,
                            Some(&nw),
                            (case == 1).then_some(s.as_slice()),
                            1e-5,
                        );
                        for c in 0..cols {
                            assert_close(o[r * cols + c], want[c], 1e-5, "next norm");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_a_gate_of_the_wrong_width() {
        let be = cpu();
        let h = vec![0.0; 6];
        let (mut hb, yb, gb) = (buf(&be, &h), buf(&be, &h), buf(&be, &[0.0; 2]));
        let res = Residual {
            post: None,
            tanh_gate: Some(View::new(&gb, 1, 2)),
        };
        let err = be
            .residual_add(
                ViewMut::new(&mut hb, 2, 3),
                View::new(&yb, 2, 3),
                &res,
                None,
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("gate is 1×2, expected 1×3"),
            "{err}"
        );
    }
}
