//! Attention over packed segments, blocked so the heavy parts are GEMMs: for each block of query
//! rows and each head, scores against the keys the block can see (its segment, cut to the
//! window), masked softmax, then probabilities times values.

use rayon::prelude::*;
use tessera_core::Result;

use super::{CpuBackend, slice};
use crate::{AttnSpec, View, ViewMut};

/// Query rows per task: large enough for efficient GEMMs, small enough to parallelise short
/// inputs and keep the score block in cache.
const QUERY_BLOCK: usize = 64;

struct Task {
    seg: (usize, usize),
    rows: (usize, usize),
}

fn visible(i: usize, j: usize, spec: &AttnSpec) -> bool {
    spec.window.is_none_or(|w| i.abs_diff(j) <= w) && (!spec.causal || j <= i)
}

pub(super) fn attention(
    q: View<'_, CpuBackend>,
    k: View<'_, CpuBackend>,
    v: View<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
    spec: &AttnSpec,
    offsets: &[u32],
) -> Result<()> {
    let hd = spec.head_dim;
    let total = *offsets.last().unwrap_or(&0) as usize;
    spec.check(&q, &k, &v, &out, total)?;
    let mut tasks = Vec::new();
    for w in offsets.windows(2) {
        let (s0, s1) = (w[0] as usize, w[1] as usize);
        let mut i0 = s0;
        while i0 < s1 {
            let i1 = (i0 + QUERY_BLOCK).min(s1);
            tasks.push(Task {
                seg: (s0, s1),
                rows: (i0, i1),
            });
            i0 = i1;
        }
    }
    // Hand each task the disjoint run of output rows it writes.
    let (ostride, ocols) = (out.stride, out.cols);
    let out_base = out.offset;
    let out_end = out.end();
    let data = &mut out.buf.f32_mut()[out_base..out_end];
    let mut chunks = Vec::with_capacity(tasks.len());
    let mut rest = data;
    for t in &tasks {
        let len = ((t.rows.1 - t.rows.0) * ostride).min(rest.len());
        let (head, tail) = rest.split_at_mut(len);
        chunks.push(head);
        rest = tail;
    }
    let (qs, ks, vs) = (slice(&q), slice(&k), slice(&v));
    let group = spec.heads_q / spec.heads_kv;
    tasks
        .par_iter()
        .zip(chunks.into_par_iter())
        .for_each_init(Vec::new, |scores, (t, dst)| {
            let (i0, i1) = t.rows;
            let nq = i1 - i0;
            let mut k0 = t.seg.0;
            let mut k1 = t.seg.1;
            if let Some(w) = spec.window {
                k0 = k0.max(i0.saturating_sub(w));
                k1 = k1.min(i1 - 1 + w + 1);
            }
            if spec.causal {
                k1 = k1.min(i1);
            }
            let nk = k1 - k0;
            scores.resize(nq * nk, 0.0);
            for h in 0..spec.heads_q {
                let g = h / group;
                // SAFETY: the lhs covers rows i0..i1 (< q.rows) of head h inside `qs`; the rhs
                // covers rows k0..k1 of kv head g inside `ks`; `scores` is nq × nk dense. All
                // extents were checked against the view shapes above.
                unsafe {
                    gemm::gemm(
                        nq,
                        nk,
                        hd,
                        scores.as_mut_ptr(),
                        1,
                        nk as isize,
                        false,
                        qs.as_ptr().add(i0 * q.stride + h * hd),
                        1,
                        q.stride as isize,
                        ks.as_ptr().add(k0 * k.stride + g * hd),
                        k.stride as isize,
                        1,
                        0.0,
                        spec.scale,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                for (r, row) in scores.chunks_mut(nk).enumerate() {
                    let i = i0 + r;
                    let mut max = f32::NEG_INFINITY;
                    for (c, s) in row.iter_mut().enumerate() {
                        if visible(i, k0 + c, spec) {
                            max = max.max(*s);
                        } else {
                            *s = f32::NEG_INFINITY;
                        }
                    }
                    let mut sum = 0f64;
                    for s in row.iter_mut() {
                        *s = if *s == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (*s - max).exp()
                        };
                        sum += *s as f64;
                    }
                    let inv = (1.0 / sum) as f32;
                    row.iter_mut().for_each(|s| *s *= inv);
                }
                // SAFETY: dst holds rows i0..i1 of the output at stride `ostride`, each at least
                // h·hd + hd ≤ ocols wide; the rhs covers rows k0..k1 of kv head g inside `vs`.
                unsafe {
                    debug_assert!(
                        (nq - 1) * ostride + h * hd + hd <= dst.len() && h * hd + hd <= ocols
                    );
                    gemm::gemm(
                        nq,
                        hd,
                        nk,
                        dst.as_mut_ptr().add(h * hd),
                        1,
                        ostride as isize,
                        false,
                        scores.as_ptr(),
                        1,
                        nk as isize,
                        vs.as_ptr().add(k0 * v.stride + g * hd),
                        1,
                        v.stride as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::visible;
    use crate::{AttnSpec, Backend, View, ViewMut};

    /// Straight from the definition, in f64.
    fn naive(
        q: &[f32],
        qw: usize,
        k: &[f32],
        v: &[f32],
        kw: usize,
        spec: &AttnSpec,
        lens: &[usize],
    ) -> Vec<f64> {
        let hd = spec.head_dim;
        let total: usize = lens.iter().sum();
        let mut out = vec![0f64; total * spec.heads_q * hd];
        let group = spec.heads_q / spec.heads_kv;
        let mut s0 = 0;
        for &len in lens {
            for i in s0..s0 + len {
                for h in 0..spec.heads_q {
                    let g = h / group;
                    let mut logits = Vec::new();
                    for j in s0..s0 + len {
                        if visible(i, j, spec) {
                            let d: f64 = (0..hd)
                                .map(|t| {
                                    q[i * qw + h * hd + t] as f64 * k[j * kw + g * hd + t] as f64
                                })
                                .sum();
                            logits.push((j, d * spec.scale as f64));
                        }
                    }
                    let m = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = logits.iter().map(|x| (x.1 - m).exp()).sum();
                    for &(j, l) in &logits {
                        let p = (l - m).exp() / z;
                        for t in 0..hd {
                            out[i * spec.heads_q * hd + h * hd + t] +=
                                p * v[j * kw + g * hd + t] as f64;
                        }
                    }
                }
            }
            s0 += len;
        }
        out
    }

    #[test]
    #[allow(clippy::type_complexity)] // the case table; main rewrites it as a struct
    fn packed_windowed_gqa_matches_naive() {
        let be = cpu();
        struct Case {
            lens: &'static [usize],
            hq: usize,
            hkv: usize,
            hd: usize,
            window: Option<usize>,
            causal: bool,
        }
        let cases = [
            Case {
                lens: &[1],
                hq: 1,
                hkv: 1,
                hd: 4,
                window: None,
                causal: false,
            },
            // window cuts through segments
            Case {
                lens: &[5, 70, 3],
                hq: 4,
                hkv: 2,
                hd: 8,
                window: Some(3),
                causal: false,
            },
            // MQA, window edge at the block size
            Case {
                lens: &[130, 1, 67],
                hq: 4,
                hkv: 1,
                hd: 16,
                window: Some(64),
                causal: false,
            },
            // causal, odd head dim
            Case {
                lens: &[9, 200],
                hq: 2,
                hkv: 2,
                hd: 5,
                window: None,
                causal: true,
            },
            // window 0: each token sees itself
            Case {
                lens: &[150],
                hq: 3,
                hkv: 3,
                hd: 7,
                window: Some(0),
                causal: false,
            },
        ];
        for (ci, c) in cases.iter().enumerate() {
            let Case {
                lens,
                hq,
                hkv,
                hd,
                window,
                causal,
            } = *c;
            let spec = AttnSpec {
                heads_q: hq,
                heads_kv: hkv,
                head_dim: hd,
                scale: 0.7,
                window,
                causal,
            };
            let total: usize = lens.iter().sum();
            let mut rng = Rng::new(100 + ci as u64);
            // q|k|v packed in one buffer, as the models store them.
            let width = (hq + 2 * hkv) * hd;
            let x = rng.vec(total * width, 2.0);
            let xb = buf(&be, &x);
            let all = View::new(&xb, total, width);
            let segs = be.segments(lens).unwrap();
            let mut o = buf(&be, &vec![f32::NAN; total * hq * hd]);
            be.attention(
                all.cols(0, hq * hd),
                all.cols(hq * hd, hkv * hd),
                all.cols((hq + hkv) * hd, hkv * hd),
                ViewMut::new(&mut o, total, hq * hd),
                &spec,
                &segs,
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, total, hq * hd)).unwrap();
            let kv = hkv * hd;
            let k: Vec<f32> = x
                .chunks(width)
                .flat_map(|r| r[hq * hd..hq * hd + kv].to_vec())
                .collect();
            let v: Vec<f32> = x
                .chunks(width)
                .flat_map(|r| r[hq * hd + kv..].to_vec())
                .collect();
            let want = naive(&x, width, &k, &v, kv, &spec, lens);
            for (idx, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert_close(g, w, 1e-5, &format!("attention case {ci} idx {idx}"));
            }
        }
    }
}
