//! Per-head norms of a packed q|k|v row followed by rotary embeddings, in place.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, rows_mut};
use crate::{QkvNorm, RopeStyle, RopeTable, ViewMut};

/// `(mean(x²) + eps)^-½`, the sum taken in `f64`.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32
}

/// One head's RMSNorm: `out = x · (mean(x²) + eps)^-½ · w` (no `w`: weightless). It rounds the
/// inverse RMS to `f32` and multiplies in `f32`, unlike the row norm of `norm.rs` (which rounds
/// the normalised value once from `f64`); it stays apart so the q/k results keep their bits.
#[inline]
fn norm_into(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    match w {
        Some(w) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * inv * g;
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v * inv;
            }
        }
    }
}

fn check_weight(op: &str, w: Option<&[f32]>, cols: usize) -> Result<()> {
    match w {
        Some(w) if w.len() != cols => Err(Error::backend(
            op,
            format!("weight has {} entries for rows of {cols}", w.len()),
        )),
        _ => Ok(()),
    }
}

/// Rotate one head in place: pairs `(j, j + half)` by the angle of `(cos[j], sin[j])`.
#[inline]
fn rope_split_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = x.split_at_mut(half);
    for j in 0..half {
        let (x1, x2) = (a[j], b[j]);
        a[j] = x1 * cos[j] - x2 * sin[j];
        b[j] = x2 * cos[j] + x1 * sin[j];
    }
}

/// Rotate one head in place: the complex numbers `x[2j] + i·x[2j+1]` times `cos[j] + i·sin[j]`.
#[inline]
fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((p, &c), &s) in x.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * c - b * s;
        p[1] = a * s + b * c;
    }
}

pub(super) fn qkv_norm_rope(
    qkv: ViewMut<'_, CpuBackend>,
    norm: &QkvNorm<'_, CpuBackend>,
    rope: Option<(&RopeTable<CpuBackend>, &[u32])>,
) -> Result<()> {
    let QkvNorm {
        layout,
        qk_norm,
        q_weight,
        k_weight,
        v_norm,
        eps,
    } = *norm;
    let (q_w, k_w) = (q_weight.map(Vec::as_slice), k_weight.map(Vec::as_slice));
    let hd = layout.head_dim;
    if qkv.cols != layout.width() {
        return Err(Error::backend(
            "qkv_norm_rope",
            format!(
                "row of {} columns, layout needs {}",
                qkv.cols,
                layout.width()
            ),
        ));
    }
    check_weight("qkv_norm_rope", q_w, hd)?;
    check_weight("qkv_norm_rope", k_w, hd)?;
    if !qk_norm && (q_w.is_some() || k_w.is_some()) {
        return Err(Error::backend(
            "qkv_norm_rope",
            "q/k norm weights given with the q/k norms off",
        ));
    }
    // Positions per row: one, or an (x, y) pair for the axial 2-D style.
    let table = match rope {
        Some((t, pos)) => {
            let per_row = t.positions_per_row(hd)?;
            let pos = pos
                .get(..per_row * qkv.rows)
                .ok_or_else(|| Error::backend("qkv_norm_rope", "fewer positions than rows"))?;
            if let Some(&p) = pos.iter().max()
                && p as usize >= t.len
            {
                return Err(Error::backend(
                    "qkv_norm_rope",
                    format!("position {p} beyond the rope table ({})", t.len),
                ));
            }
            let data = t.buf.f32();
            let (cos, sin) = data.split_at(t.len * t.half);
            Some((cos, sin, t.half, pos, per_row, t.style))
        }
        None => None,
    };
    let (nq, nkv) = (layout.heads_q, layout.heads_kv);
    rows_mut(qkv).enumerate().for_each_init(
        || vec![0f32; hd],
        |tmp, (r, row)| {
            // (cos, sin) of each axis: one for split-half, (x, y) for axial 2-D.
            let angles = table.map(|(cos, sin, half, pos, per_row, style)| {
                let at = |i: usize| {
                    let p = pos[r * per_row + i] as usize;
                    (
                        &cos[p * half..(p + 1) * half],
                        &sin[p * half..(p + 1) * half],
                    )
                };
                (at(0), (per_row == 2).then(|| at(1)), style)
            });
            for h in 0..nq + 2 * nkv {
                let x = &mut row[h * hd..(h + 1) * hd];
                let (w, rotate) = if h < nq {
                    (q_w, true)
                } else if h < nq + nkv {
                    (k_w, true)
                } else if v_norm {
                    (None, false)
                } else {
                    continue;
                };
                if qk_norm || !rotate {
                    tmp.copy_from_slice(x);
                    norm_into(tmp, w, eps, x);
                }
                match angles {
                    Some(((c, s), None, RopeStyle::Interleaved)) if rotate => {
                        rope_interleaved(x, c, s)
                    }
                    Some(((c, s), None, _)) if rotate => rope_split_half(x, c, s),
                    Some(((cx, sx), Some((cy, sy)), _)) if rotate => {
                        let (a, b) = x.split_at_mut(hd / 2);
                        rope_split_half(a, cx, sx);
                        rope_split_half(b, cy, sy);
                    }
                    _ => {}
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Backend, QkvLayout, QkvNorm, RopeStyle, RopeTable, View, ViewMut};

    fn naive_norm(x: &[f32], w: Option<&[f32]>, eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        x.iter()
            .enumerate()
            .map(|(j, &v)| v as f64 * inv * w.map_or(1.0, |w| w[j] as f64))
            .collect()
    }

    #[test]
    fn axial_2d_rope_rotates_halves_by_x_then_y() {
        let be = cpu();
        // Two heads of 12: each half (6 channels) is three pairs (j, j + 3).
        let layout = QkvLayout {
            heads_q: 2,
            heads_kv: 2,
            head_dim: 12,
        };
        let rows = 3;
        let cols = layout.width();
        let mut rng = Rng::new(17);
        let x = rng.vec(rows * cols, 2.0);
        let (qw, kw) = (rng.vec(12, 1.0), rng.vec(12, 1.0));
        let inv_freq = [1.0f32, 0.3, 0.01];
        let table = RopeTable::new(&be, &inv_freq, 9, RopeStyle::Axial2d).unwrap();
        let positions = [0u32, 0, 5, 2, 8, 7];
        let pos = ids(&be, &positions);
        let mut xb = buf(&be, &x);
        let (qv, kv) = (be.vector_f32(&qw).unwrap(), be.vector_f32(&kw).unwrap());
        be.qkv_norm_rope(
            ViewMut::new(&mut xb, rows, cols),
            &QkvNorm {
                layout,
                qk_norm: true,
                q_weight: Some(&qv),
                k_weight: Some(&kv),
                v_norm: true,
                eps: 1e-6,
            },
            Some((&table, &pos)),
        )
        .unwrap();
        let got = be.read_f32(View::new(&xb, rows, cols)).unwrap();
        for r in 0..rows {
            for h in 0..6 {
                let seg = &x[r * cols + h * 12..r * cols + (h + 1) * 12];
                let w = match h {
                    0 | 1 => Some(qw.as_slice()),
                    2 | 3 => Some(kw.as_slice()),
                    _ => None,
                };
                let n = naive_norm(seg, w, 1e-6);
                let want: Vec<f64> = if h < 4 {
                    (0..12)
                        .map(|j| {
                            let (axis, k) = (j / 6, j % 6);
                            let p = positions[2 * r + axis] as f32;
                            let a = (p * inv_freq[k % 3]) as f64;
                            let base = axis * 6;
                            let rot = if k < 3 {
                                -n[base + k + 3]
                            } else {
                                n[base + k - 3]
                            };
                            n[j] * a.cos() + rot * a.sin()
                        })
                        .collect()
                } else {
                    n
                };
                for j in 0..12 {
                    assert_close(got[r * cols + h * 12 + j], want[j], 1e-5, "axial rope");
                }
            }
        }
        // A split-half table does not fit an axial head, nor positions beyond the table.
        let wrong = RopeTable::new(&be, &inv_freq, 9, RopeStyle::SplitHalf).unwrap();
        let run = |t: &RopeTable<_>, p: &[u32]| {
            let mut xb = buf(&be, &x);
            be.qkv_norm_rope(
                ViewMut::new(&mut xb, 1, cols),
                &QkvNorm {
                    layout,
                    qk_norm: true,
                    q_weight: None,
                    k_weight: None,
                    v_norm: false,
                    eps: 1e-6,
                },
                Some((t, &ids(&be, p))),
            )
        };
        assert!(run(&table, &[0, 9]).is_err());
        assert!(run(&wrong, &[0, 0]).is_err());
    }

    #[test]
    fn interleaved_rope_from_explicit_angles_matches_complex_product() {
        let be = cpu();
        // MHA, 2 heads of 6 (3 complex pairs); q/k normed with weights, v untouched.
        let layout = QkvLayout {
            heads_q: 2,
            heads_kv: 2,
            head_dim: 6,
        };
        let (rows, cols) = (4, layout.width());
        let mut rng = Rng::new(17);
        let x = rng.vec(rows * cols, 2.0);
        let (qw, kw) = (rng.vec(6, 1.0), rng.vec(6, 1.0));
        // Table rows are tokens; positions pick rows out of order.
        let table_rows = 5;
        let angles: Vec<f32> = rng.vec(table_rows * 3, 40.0);
        let table =
            RopeTable::from_angles(&be, &angles, table_rows, 3, RopeStyle::Interleaved).unwrap();
        let positions = [4u32, 0, 2, 2];
        let pos = ids(&be, &positions);
        let mut xb = buf(&be, &x);
        let (qv, kv) = (be.vector_f32(&qw).unwrap(), be.vector_f32(&kw).unwrap());
        be.qkv_norm_rope(
            ViewMut::new(&mut xb, rows, cols),
            &QkvNorm {
                layout,
                qk_norm: true,
                q_weight: Some(&qv),
                k_weight: Some(&kv),
                v_norm: false,
                eps: 1e-5,
            },
            Some((&table, &pos)),
        )
        .unwrap();
        let got = be.read_f32(View::new(&xb, rows, cols)).unwrap();
        for r in 0..rows {
            for h in 0..6 {
                let seg = &x[r * cols + h * 6..r * cols + (h + 1) * 6];
                let want: Vec<f64> = if h < 4 {
                    let w = if h < 2 { &qw } else { &kw };
                    let n = naive_norm(seg, Some(w), 1e-5);
                    (0..6)
                        .map(|j| {
                            let a = angles[positions[r] as usize * 3 + j / 2] as f64;
                            let (re, im) = (n[j & !1], n[j | 1]);
                            if j % 2 == 0 {
                                re * a.cos() - im * a.sin()
                            } else {
                                re * a.sin() + im * a.cos()
                            }
                        })
                        .collect()
                } else {
                    seg.iter().map(|&v| v as f64).collect()
                };
                for j in 0..6 {
                    assert_close(got[r * cols + h * 6 + j], want[j], 1e-5, "interleaved rope");
                }
            }
        }
    }

    #[test]
    fn qkv_norm_rope_matches_naive() {
        let be = cpu();
        let layout = QkvLayout {
            heads_q: 3,
            heads_kv: 1,
            head_dim: 6,
        };
        let rows = 5;
        let cols = layout.width();
        let mut rng = Rng::new(11);
        let x = rng.vec(rows * cols, 2.0);
        let (qw, kw) = (rng.vec(6, 1.0), rng.vec(6, 1.0));
        let inv_freq = [1.0f32, 0.1, 0.01];
        let table = RopeTable::new(&be, &inv_freq, 40, RopeStyle::SplitHalf).unwrap();
        let positions = [0u32, 1, 2, 37, 5];
        let pos = ids(&be, &positions);
        let mut xb = buf(&be, &x);
        let (qv, kv) = (be.vector_f32(&qw).unwrap(), be.vector_f32(&kw).unwrap());
        be.qkv_norm_rope(
            ViewMut::new(&mut xb, rows, cols),
            &QkvNorm {
                layout,
                qk_norm: true,
                q_weight: Some(&qv),
                k_weight: Some(&kv),
                v_norm: true,
                eps: 1e-6,
            },
            Some((&table, &pos)),
        )
        .unwrap();
        let got = be.read_f32(View::new(&xb, rows, cols)).unwrap();
        for r in 0..rows {
            for h in 0..5 {
                let seg = &x[r * cols + h * 6..r * cols + (h + 1) * 6];
                let w = match h {
                    0..=2 => Some(qw.as_slice()),
                    3 => Some(kw.as_slice()),
                    _ => None,
                };
                let n = naive_norm(seg, w, 1e-6);
                let want: Vec<f64> = if h < 4 {
                    let p = positions[r] as f32;
                    (0..6)
                        .map(|j| {
                            let f = inv_freq[j % 3];
                            let a = (p * f) as f64;
                            let rot = if j < 3 { -n[j + 3] } else { n[j - 3] };
                            n[j] * a.cos() + rot * a.sin()
                        })
                        .collect()
                } else {
                    n
                };
                for j in 0..6 {
                    assert_close(got[r * cols + h * 6 + j], want[j], 1e-5, "qkv_norm_rope");
                }
            }
        }
    }

    #[test]
    fn without_qk_norms_q_and_k_are_only_rotated() {
        let be = cpu();
        let layout = QkvLayout {
            heads_q: 2,
            heads_kv: 1,
            head_dim: 4,
        };
        let (rows, cols) = (3, layout.width());
        let x = Rng::new(5).vec(rows * cols, 2.0);
        let inv_freq = [1.0f32, 0.1];
        let table = RopeTable::new(&be, &inv_freq, 8, RopeStyle::SplitHalf).unwrap();
        let positions = [0u32, 3, 7];
        let pos = ids(&be, &positions);
        let mut xb = buf(&be, &x);
        let mut norm = QkvNorm {
            layout,
            qk_norm: false,
            q_weight: None,
            k_weight: None,
            v_norm: false,
            eps: 1e-6,
        };
        be.qkv_norm_rope(
            ViewMut::new(&mut xb, rows, cols),
            &norm,
            Some((&table, &pos)),
        )
        .unwrap();
        let got = be.read_f32(View::new(&xb, rows, cols)).unwrap();
        for r in 0..rows {
            for h in 0..4 {
                let seg = &x[r * cols + h * 4..r * cols + (h + 1) * 4];
                for j in 0..4 {
                    let want = if h < 3 {
                        let a = (positions[r] as f32 * inv_freq[j % 2]) as f64;
                        let rot = if j < 2 { -seg[j + 2] } else { seg[j - 2] } as f64;
                        seg[j] as f64 * a.cos() + rot * a.sin()
                    } else {
                        seg[j] as f64
                    };
                    assert_close(got[r * cols + h * 4 + j], want, 1e-6, "rotate only");
                }
            }
        }
        // Weights with the norms off are a caller's mistake, not silently ignored.
        let w = be.vector_f32(&[1.0; 4]).unwrap();
        norm.q_weight = Some(&w);
        assert!(
            be.qkv_norm_rope(ViewMut::new(&mut xb, rows, cols), &norm, None)
                .is_err()
        );
    }
}
