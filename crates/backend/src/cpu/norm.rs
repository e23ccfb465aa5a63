//! Row norms (RMS or layer, affine or not, adaLN-modulated or not) and the fused residual step:
//! `h = (h + g ⊙ post(y)) · scale`, then the next sub-block's pre-norm or a copy of `h`.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, rows, rows_mut, slice, vmath};
use crate::view::same_shape;
use crate::{Activation, After, NormKind, Residual, RowNorm, View, ViewMut};

/// A [`RowNorm`] resolved to host slices, with `1 + s` precomputed once per call.
struct Norm<'a> {
    kind: NormKind,
    weight: Option<&'a [f32]>,
    bias: Option<&'a [f32]>,
    eps: f32,
    one_plus_scale: Option<Vec<f32>>,
    act: Option<Activation>,
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

fn check_len(op: &str, what: &str, v: Option<&Vec<f32>>, cols: usize) -> Result<()> {
    match v {
        Some(v) if v.len() != cols => Err(Error::backend(
            op,
            format!("norm {what} of {} for rows of {cols}", v.len()),
        )),
        _ => Ok(()),
    }
}

impl<'a> Norm<'a> {
    fn resolve(op: &str, n: &RowNorm<'a, CpuBackend>, cols: usize) -> Result<Self> {
        check_len(op, "weight", n.weight, cols)?;
        check_len(op, "bias", n.bias, cols)?;
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
            bias: n.bias.map(Vec::as_slice),
            eps: n.eps,
            one_plus_scale,
            act: n.act,
        })
    }

    /// A residual step's norm: as [`Norm::resolve`], without an activation.
    fn resolve_for_residual(op: &str, n: &RowNorm<'a, CpuBackend>, cols: usize) -> Result<Self> {
        if let Some(a) = n.act {
            return Err(Error::backend(
                op,
                format!("a residual step's norm takes no activation ({a:?})"),
            ));
        }
        Self::resolve(op, n, cols)
    }

    /// `out = act((N(x) · w + b) · (1 + s))`: statistics in `f64`, the normalised value rounded
    /// once, then weight, bias and modulation applied in `f32` in the reference's order, then the
    /// activation as the convolutions apply an input activation (the same bits as activating on
    /// read).
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        let n = x.len() as f64;
        let mean = match self.kind {
            NormKind::Rms => 0.0,
            NormKind::Layer => vmath::sum(x) / n,
        };
        let var = vmath::sum_sq(x, mean) / n;
        let inv = 1.0 / (var + self.eps as f64).sqrt();
        let scale = self.one_plus_scale.as_deref();
        vmath::normalize(x, mean, inv, self.weight, self.bias, scale, out);
        if let Some(act) = self.act {
            vmath::activate(out, act);
        }
    }
}

pub(super) fn norm(
    x: View<'_, CpuBackend>,
    n: &RowNorm<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    same_shape("norm", (x.rows, x.cols), (out.rows, out.cols))?;
    let n = Norm::resolve("norm", n, x.cols)?;
    rows_mut(out).zip(rows(x)).for_each(|(o, r)| n.apply(r, o));
    Ok(())
}

pub(super) fn residual(
    h: ViewMut<'_, CpuBackend>,
    y: View<'_, CpuBackend>,
    res: &Residual<'_, CpuBackend>,
    after: After<'_, CpuBackend>,
) -> Result<()> {
    const OP: &str = "residual";
    same_shape(OP, (h.rows, h.cols), (y.rows, y.cols))?;
    let cols = h.cols;
    let post = match &res.post {
        Some(p) if p.scale.is_some() => {
            return Err(Error::backend(OP, "the post-norm cannot be modulated"));
        }
        Some(p) => Some(Norm::resolve_for_residual(OP, p, cols)?),
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
    let scale = res.scale;
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
                    *hv = (*hv + g * b) * scale;
                }
            }
            None => {
                for (hv, &b) in hr.iter_mut().zip(branch) {
                    *hv = (*hv + b) * scale;
                }
            }
        }
    };
    let (next, out) = match after {
        After::Nothing => {
            rows_mut(h)
                .zip(rows(y))
                .for_each_init(Vec::new, |tmp, (hr, yr)| step(hr, yr, tmp));
            return Ok(());
        }
        After::Norm(n, out) => (Some(Norm::resolve_for_residual(OP, &n, cols)?), out),
        After::Copy(out) => (None, out),
    };
    same_shape(OP, (h.rows, h.cols), (out.rows, out.cols))?;
    rows_mut(h)
        .zip(rows(y))
        .zip(rows_mut(out))
        .for_each_init(Vec::new, |tmp, ((hr, yr), o)| {
            step(hr, yr, tmp);
            match &next {
                Some(n) => n.apply(hr, o),
                None => o.copy_from_slice(hr),
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Activation, After, Backend, NormKind, Residual, RowNorm, View, ViewMut};

    /// The definition in f64: `(N(x) · w + b) · (1 + s)`.
    fn naive(
        kind: NormKind,
        x: &[f32],
        w: Option<&[f32]>,
        b: Option<&[f32]>,
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
                ((v as f64 - mean) * inv * w.map_or(1.0, |w| w[j] as f64)
                    + b.map_or(0.0, |b| b[j] as f64))
                    * s.map_or(1.0, |s| 1.0 + s[j] as f64)
            })
            .collect()
    }

    fn rms(x: &[f32], w: Option<&[f32]>, eps: f64) -> Vec<f64> {
        naive(NormKind::Rms, x, w, None, None, eps)
    }

    #[test]
    fn rms_and_layer_norms_with_weights_biases_and_modulation() {
        let be = cpu();
        for &(rows, cols, kind, weighted, biased, modulated) in &[
            (1, 1, NormKind::Rms, true, false, true),
            (3, 7, NormKind::Rms, true, false, false),
            (5, 130, NormKind::Rms, false, false, false),
            (33, 512, NormKind::Rms, true, false, false),
            (7, 45, NormKind::Rms, true, false, true),
            (9, 130, NormKind::Layer, false, false, true),
            (3, 17, NormKind::Layer, true, false, false),
            (4, 33, NormKind::Layer, true, true, false),
            (2, 19, NormKind::Layer, true, true, true),
        ] {
            let mut rng = Rng::new((rows * cols) as u64 + 5);
            // An offset mean makes LayerNorm's centring matter.
            let x: Vec<f32> = rng.vec(rows * cols, 3.0).iter().map(|v| v + 0.7).collect();
            let w = rng.vec(cols, 1.0);
            let b = rng.vec(cols, 0.5);
            // The modulation row sits in the middle of a wider buffer (row 2, columns 3..).
            let mods = rng.vec(4 * (cols + 5), 1.0);
            let mb = buf(&be, &mods);
            let s = &mods[2 * (cols + 5) + 3..2 * (cols + 5) + 3 + cols];
            let xb = buf(&be, &x);
            let (wv, bv) = (be.vector_f32(&w).unwrap(), be.vector_f32(&b).unwrap());
            let mut n = RowNorm::plain(kind, 1e-6);
            n.weight = weighted.then_some(&wv);
            n.bias = biased.then_some(&bv);
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
                    biased.then_some(b.as_slice()),
                    modulated.then_some(s),
                    1e-6,
                );
                for c in 0..cols {
                    assert_close(got[r * cols + c], want[c], 1e-5, "norm");
                }
            }
        }
    }

    /// An activated norm stores the same bits as the norm followed by the activation (what a
    /// convolution with that input activation computed), and a residual step's norms refuse one.
    #[test]
    fn an_activated_norm_is_the_norm_then_the_activation() {
        let be = cpu();
        let (rows, cols) = (5, 144);
        let mut rng = Rng::new(11);
        let x = rng.vec(rows * cols, 3.0);
        let w = be.vector_f32(&rng.vec(cols, 1.0)).unwrap();
        let xb = buf(&be, &x);
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            let n = RowNorm::rms(&w, 1e-24 / cols as f32);
            let mut plain = buf(&be, &vec![0.0; rows * cols]);
            be.norm(
                View::new(&xb, rows, cols),
                &n,
                ViewMut::new(&mut plain, rows, cols),
            )
            .unwrap();
            let mut want = be.read_f32(View::new(&plain, rows, cols)).unwrap();
            super::vmath::activate(&mut want, act);
            let mut o = buf(&be, &vec![0.0; rows * cols]);
            be.norm(
                View::new(&xb, rows, cols),
                &n.activated(act),
                ViewMut::new(&mut o, rows, cols),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, rows, cols)).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{act:?}"
            );
        }
        let (mut h, y) = (buf(&be, &x), buf(&be, &x));
        let err = be
            .residual(
                ViewMut::new(&mut h, rows, cols),
                View::new(&y, rows, cols),
                &Residual::post_norm(RowNorm::rms(&w, 1e-6).activated(Activation::Silu)),
                After::Nothing,
            )
            .unwrap_err();
        assert!(err.to_string().contains("no activation"), "{err}");
    }

    #[test]
    fn scaled_sandwich_residual_then_nothing_norm_or_copy() {
        let be = cpu();
        let (rows, cols) = (7, 45);
        let mut rng = Rng::new(7);
        let h0 = rng.vec(rows * cols, 2.0);
        let y = rng.vec(rows * cols, 2.0);
        let pw = rng.vec(cols, 1.0);
        let nw = rng.vec(cols, 1.0);
        let (pwv, nwv) = (be.vector_f32(&pw).unwrap(), be.vector_f32(&nw).unwrap());
        let yb = buf(&be, &y);
        for mode in 0..3 {
            let mut hb = buf(&be, &h0);
            let mut ob = buf(&be, &vec![0.0; rows * cols]);
            let after = match mode {
                0 => After::Nothing,
                1 => After::Norm(RowNorm::rms(&nwv, 1e-6), ViewMut::new(&mut ob, rows, cols)),
                _ => After::Copy(ViewMut::new(&mut ob, rows, cols)),
            };
            be.residual(
                ViewMut::new(&mut hb, rows, cols),
                View::new(&yb, rows, cols),
                &Residual::post_norm(RowNorm::rms(&pwv, 1e-6)).scaled(0.75),
                after,
            )
            .unwrap();
            let h = be.read_f32(View::new(&hb, rows, cols)).unwrap();
            let o = be.read_f32(View::new(&ob, rows, cols)).unwrap();
            for r in 0..rows {
                let n = rms(&y[r * cols..(r + 1) * cols], Some(&pw), 1e-6);
                let want_h: Vec<f64> = (0..cols)
                    .map(|c| (h0[r * cols + c] as f64 + n[c]) * 0.75)
                    .collect();
                for c in 0..cols {
                    assert_close(h[r * cols + c], want_h[c], 1e-6, "residual h");
                }
                let hf: Vec<f32> = want_h.iter().map(|&v| v as f32).collect();
                let want_o: Vec<f64> = match mode {
                    0 => vec![0.0; cols],
                    1 => rms(&hf, Some(&nw), 1e-6),
                    _ => want_h.clone(),
                };
                for c in 0..cols {
                    assert_close(o[r * cols + c], want_o[c], 1e-5, "residual after");
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
        let (pwv, nwv) = (be.vector_f32(&pw).unwrap(), be.vector_f32(&nw).unwrap());
        let (gb, sb, yb) = (buf(&be, &g), buf(&be, &s), buf(&be, &y));
        for case in 0..3 {
            // 0: plain add, no next; 1: post-norm + gate + modulated next; 2: plain add + next.
            let mut hb = buf(&be, &h0);
            let mut ob = buf(&be, &vec![f32::NAN; rows * cols]);
            let res = if case == 1 {
                Residual::post_norm(RowNorm::rms(&pwv, 1e-5))
                    .tanh_gated(Some(View::new(&gb, 1, cols)))
            } else {
                Residual::plain()
            };
            let after = match case {
                1 => After::Norm(
                    RowNorm::rms(&nwv, 1e-5).modulated(View::new(&sb, 1, cols)),
                    ViewMut::new(&mut ob, rows, cols),
                ),
                2 => After::Norm(RowNorm::rms(&nwv, 1e-5), ViewMut::new(&mut ob, rows, cols)),
                _ => After::Nothing,
            };
            be.residual(
                ViewMut::new(&mut hb, rows, cols),
                View::new(&yb, rows, cols),
                &res,
                after,
            )
            .unwrap();
            let h = be.read_f32(View::new(&hb, rows, cols)).unwrap();
            let o = be.read_f32(View::new(&ob, rows, cols)).unwrap();
            for r in 0..rows {
                let yr = &y[r * cols..(r + 1) * cols];
                let branch: Vec<f64> = if case == 1 {
                    rms(yr, Some(&pw), 1e-5)
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
                            None,
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
        let res = Residual::plain().tanh_gated(Some(View::new(&gb, 1, 2)));
        let err = be
            .residual(
                ViewMut::new(&mut hb, 2, 3),
                View::new(&yb, 2, 3),
                &res,
                After::Nothing,
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("gate is 1×2, expected 1×3"),
            "{err}"
        );
    }
}
