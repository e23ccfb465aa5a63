//! Attention over packed query segments, blocked so the heavy parts are GEMMs: for each block of
//! query rows and each head, scores against the keys the block can see (its segment's keys, cut
//! to what the mask allows), masked softmax, then probabilities times values.
//!
//! Both products go through the panel kernels ([`attention_panels`]) where the CPU has AVX-512,
//! else through the `gemm` crate. Under bf16 they take bf16 inputs as the GPU's flash kernels
//! do: q, k and v rounded to bf16, scores summed in f32, the unnormalised probabilities rounded
//! to bf16 before `P · V` and the row sums kept in f32.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, panels, slice, vmath};
use crate::{AttnSpec, Mask, Segments, View, ViewMut};

/// Query rows per task: large enough that the keys the `gemm` crate packs on every call serve
/// many rows (256 rather than 64 made a 2,208-token document 4% and an image 7% faster on two
/// cores), small enough to split long inputs across threads and keep a head's scores in cache.
const QUERY_BLOCK: usize = 256;

/// Query rows per task on AMX tiles: one step of the tile kernel (32 rows), so a head's scores
/// and probabilities stay in L2 through the scores' product, the softmax and the rounding into
/// tiles (311 KB at 2,430 keys, where 256 rows took 2.5 MB). An image's attention (2,430 keys,
/// 12 heads of 64) took 63 ms instead of 95 on the 2-core Xeon; the panel kernels on f32 or
/// `vdpbf16ps` measured the same at 32 to 256 rows.
const AMX_QUERY_BLOCK: usize = 32;

struct Task {
    /// Packed query rows `i0..i1` of one segment.
    rows: (usize, usize),
    /// Position of row `i0` among its segment's keys (queries are the sequence's last rows).
    pos0: usize,
    /// The segment's keys: first row in `k`/`v` and count.
    keys: (usize, usize),
    /// Which segment.
    seg: usize,
}

/// Which keys a query sees, by position.
#[derive(Clone, Copy)]
enum Visible<'a> {
    Full,
    Window(usize),
    Causal,
    /// Per packed query row, the number of keys it sees.
    Limits(&'a [u32]),
}

impl Visible<'_> {
    /// The keys `start..end` (of `n`) the query at packed row `i`, at position `pos`, sees: one
    /// run, as every mask here is an interval of keys.
    #[inline]
    fn keys(self, i: usize, pos: usize, n: usize) -> (usize, usize) {
        match self {
            Visible::Full => (0, n),
            Visible::Window(w) => (pos.saturating_sub(w), n.min(pos + w + 1)),
            Visible::Causal => (0, n.min(pos + 1)),
            Visible::Limits(l) => (0, n.min(l[i] as usize)),
        }
    }

    /// The keys `lo..hi` (of `n`) that query rows `i0..i1` at positions `p0..` can see at all.
    fn span(self, (i0, i1): (usize, usize), p0: usize, n: usize) -> (usize, usize) {
        let p1 = p0 + (i1 - i0) - 1;
        match self {
            Visible::Full => (0, n),
            Visible::Window(w) => (p0.saturating_sub(w), n.min(p1 + w + 1)),
            Visible::Causal => (0, n.min(p1 + 1)),
            Visible::Limits(l) => (0, n.min(l[i0..i1].iter().max().map_or(0, |&m| m as usize))),
        }
    }
}

/// A checked call cut into tasks.
struct Plan<'a> {
    visible: Visible<'a>,
    /// Blocks of at most [`QUERY_BLOCK`] (or [`AMX_QUERY_BLOCK`]) query rows of one segment
    /// each, in row order.
    tasks: Vec<Task>,
    /// Each segment's keys: first row in `k`/`v` and count.
    keys: Vec<(usize, usize)>,
}

/// Check the call and cut it into tasks.
fn plan<'a>(
    q: &View<'_, CpuBackend>,
    k: &View<'_, CpuBackend>,
    v: &View<'_, CpuBackend>,
    out: &ViewMut<'_, CpuBackend>,
    spec: &AttnSpec<'a, CpuBackend>,
    segs: &Segments<CpuBackend>,
    query_block: usize,
) -> Result<Plan<'a>> {
    spec.check(q, k, v, out, segs)?;
    let visible = match spec.mask {
        Mask::Full => Visible::Full,
        Mask::Window(w) => Visible::Window(w),
        Mask::Causal => Visible::Causal,
        Mask::Limits(buf) => {
            let l = buf.u32();
            if l.len() < segs.total() {
                return Err(Error::backend(
                    "attention",
                    format!("{} key limits for {} query rows", l.len(), segs.total()),
                ));
            }
            Visible::Limits(l)
        }
    };
    let mut tasks = Vec::new();
    let mut seg_keys = Vec::with_capacity(segs.count());
    for (s, (q0, q1)) in segs.ranges().enumerate() {
        let q_len = q1 - q0;
        let keys = match spec.kv {
            Some(kv) => {
                let (start, n) = kv.ranges[s];
                (start as usize, n as usize)
            }
            None => (q0, q_len),
        };
        seg_keys.push(keys);
        if let Visible::Limits(l) = visible
            && let Some(&bad) = l[q0..q1].iter().find(|&&m| m as usize > keys.1)
        {
            return Err(Error::backend(
                "attention",
                format!("a key limit of {bad} in a segment of {} keys", keys.1),
            ));
        }
        let mut i0 = q0;
        while i0 < q1 {
            let i1 = (i0 + query_block).min(q1);
            tasks.push(Task {
                rows: (i0, i1),
                pos0: keys.1 - q_len + (i0 - q0),
                keys,
                seg: s,
            });
            i0 = i1;
        }
    }
    Ok(Plan {
        visible,
        tasks,
        keys: seg_keys,
    })
}

impl Task {
    /// Mask and exponentiate `scores`, this task's rows against keys `lo..lo + nk` of its
    /// segment: keys a row does not see get 0, the others `e^(s − max)` of the row. Each row's
    /// `1 / Σ` goes into `inv` (0 for a row that sees no key, rather than 0/0); the sums in f32
    /// lanes when `f32_sums` (bf16 mode), else in f64.
    fn exp_rows(
        &self,
        visible: Visible<'_>,
        scores: &mut [f32],
        (lo, nk): (usize, usize),
        inv: &mut Vec<f32>,
        f32_sums: bool,
    ) {
        let (i0, _) = self.rows;
        inv.clear();
        for (r, row) in scores.chunks_mut(nk).enumerate() {
            let (a, b) = visible.keys(i0 + r, self.pos0 + r, self.keys.1);
            let (a, b) = (a.clamp(lo, lo + nk) - lo, b.clamp(lo, lo + nk) - lo);
            let b = b.max(a);
            row[..a].fill(0.0);
            row[b..].fill(0.0);
            let seen = &mut row[a..b];
            let exp = match f32_sums {
                true => vmath::exp_shifted_f32,
                false => vmath::exp_shifted,
            };
            let sum = exp(seen, vmath::max(seen));
            inv.push(if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 });
        }
    }
}

/// Which products attention runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// The `gemm` crate, f32 (CPUs without AVX-512).
    Gemm,
    /// The panel kernels, f32.
    PanelsF32,
    /// The panel kernels with bf16 operands.
    PanelsBf16,
}

impl Kernel {
    /// The kernel for this CPU at `bf16` or f32.
    pub(super) fn for_cpu(bf16: bool) -> Kernel {
        match (bf16, panels::f32_native()) {
            (true, _) => Kernel::PanelsBf16,
            (false, true) => Kernel::PanelsF32,
            (false, false) => Kernel::Gemm,
        }
    }
}

pub(super) fn attention(
    q: View<'_, CpuBackend>,
    k: View<'_, CpuBackend>,
    v: View<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
    spec: &AttnSpec<'_, CpuBackend>,
    segs: &Segments<CpuBackend>,
    kernel: Kernel,
) -> Result<()> {
    let query_block = match kernel {
        Kernel::PanelsBf16 if super::amx::enabled() => AMX_QUERY_BLOCK,
        _ => QUERY_BLOCK,
    };
    let plan = plan(&q, &k, &v, &out, spec, segs, query_block)?;
    match kernel {
        Kernel::PanelsBf16 => attention_panels::<u32>(q, k, v, out, spec, &plan),
        Kernel::PanelsF32 => attention_panels::<f32>(q, k, v, out, spec, &plan),
        Kernel::Gemm => attention_gemm(q, k, v, out, spec, &plan),
    }
}

/// [`attention`] through the `gemm` crate, in f32.
fn attention_gemm(
    q: View<'_, CpuBackend>,
    k: View<'_, CpuBackend>,
    v: View<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
    spec: &AttnSpec<'_, CpuBackend>,
    plan: &Plan<'_>,
) -> Result<()> {
    let (visible, tasks) = (plan.visible, &plan.tasks);
    let hd = spec.head_dim;
    // Hand each task the disjoint run of output rows it writes.
    let (ostride, ocols) = (out.stride, out.cols);
    let out_base = out.offset;
    let out_end = out.end();
    let data = &mut out.buf.f32_mut()[out_base..out_end];
    let mut chunks = Vec::with_capacity(tasks.len());
    let mut rest = data;
    for t in tasks {
        let len = ((t.rows.1 - t.rows.0) * ostride).min(rest.len());
        let (head, tail) = rest.split_at_mut(len);
        chunks.push(head);
        rest = tail;
    }
    let (qs, ks, vs) = (slice(&q), slice(&k), slice(&v));
    let group = spec.heads_q / spec.heads_kv;
    tasks.par_iter().zip(chunks.into_par_iter()).for_each_init(
        Default::default,
        |(scores, inv): &mut (Vec<f32>, Vec<f32>), (t, dst)| {
            let (i0, i1) = t.rows;
            let nq = i1 - i0;
            // Keys of the segment any row of this block sees, as rows of `k`/`v`.
            let (lo, hi) = visible.span(t.rows, t.pos0, t.keys.1);
            let (k0, k1) = (t.keys.0 + lo, t.keys.0 + hi.max(lo));
            let nk = k1 - k0;
            scores.resize(nq * nk, 0.0);
            if nk == 0 {
                // No key is visible to any row of this block: its output is zero, as a softmax
                // over nothing contributes nothing.
                for r in 0..nq {
                    dst[r * ostride..r * ostride + ocols].fill(0.0);
                }
                return;
            }
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
                // Probabilities, normalised before `P · V`.
                t.exp_rows(visible, scores, (lo, nk), inv, false);
                for (row, &s) in scores.chunks_mut(nk).zip(inv.iter()) {
                    vmath::scale(row, s);
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
        },
    );
    Ok(())
}

/// [`attention`] through the panel products, in f32 or with bf16 operands (`E`): each
/// segment's keys and values are packed once per kv head (as the products' right-hand sides),
/// then every (query block, head) pair is a task of its own. The probabilities multiply the
/// values unnormalised (rounded to bf16 under bf16, as the GPU's flash kernels do) and each
/// output row is divided by its f32 sum after.
fn attention_panels<E: panels::Operand>(
    q: View<'_, CpuBackend>,
    k: View<'_, CpuBackend>,
    v: View<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
    spec: &AttnSpec<'_, CpuBackend>,
    plan: &Plan<'_>,
) -> Result<()> {
    use panels::{NR, Out, Panels};
    let (visible, tasks, segments) = (plan.visible, &plan.tasks, &plan.keys);
    let hd = spec.head_dim;
    let (qs, ks, vs) = (slice(&q), slice(&k), slice(&v));
    let group = spec.heads_q / spec.heads_kv;
    // Keys (as `B` of `q · kᵀ`) and values (as `B` of `P · v`, transposed) per segment and kv head.
    let packed: Vec<(Panels<E>, Panels<E>)> = (0..segments.len() * spec.heads_kv)
        .into_par_iter()
        .map(|i| {
            let ((first, n), g) = (segments[i / spec.heads_kv], i % spec.heads_kv);
            let keys = match n {
                0 => E::pack_rows(&[], k.stride, 0, hd),
                _ => E::pack_rows(&ks[first * k.stride + g * hd..], k.stride, n, hd),
            };
            let values = match n {
                0 => E::pack_cols(&[], v.stride, 0, hd),
                _ => E::pack_cols(&vs[first * v.stride + g * hd..], v.stride, n, hd),
            };
            (keys, values)
        })
        .collect();
    let (ostride, ocols) = (out.stride, out.cols);
    let total_rows = out.rows;
    let base = &mut out.buf.f32_mut()[out.offset..];
    assert!(
        total_rows == 0 || (total_rows - 1) * ostride + ocols <= base.len(),
        "attention output out of bounds"
    );
    let dst = Out {
        ptr: base.as_mut_ptr(),
        stride: ostride,
        alpha: 1.0,
        accumulate: false,
    };
    (0..tasks.len() * spec.heads_q)
        .into_par_iter()
        .for_each(|i| {
            let task = |scratch: &mut Scratch| {
                let Scratch {
                    qa,
                    scores,
                    pa,
                    inv,
                } = scratch;
                let (t, h) = (&tasks[i / spec.heads_q], i % spec.heads_q);
                let g = h / group;
                let (i0, i1) = t.rows;
                let nq = i1 - i0;
                let (keys, values) = &packed[t.seg * spec.heads_kv + g];
                let (lo, hi) = visible.span(t.rows, t.pos0, t.keys.1);
                let hi = hi.max(lo);
                let lo = lo / NR * NR;
                let nk = hi - lo;
                let out_head = Out {
                    ptr: dst.at(i0, h * hd),
                    stride: ostride,
                    alpha: 1.0,
                    accumulate: false,
                };
                if nk == 0 {
                    // No key is visible to any row of this block: its output is zero.
                    for r in 0..nq {
                        // SAFETY: row i0 + r < out.rows, columns h·hd..h·hd+hd < ocols (checked by
                        // `plan`); each (task, head) writes its own rows × columns.
                        unsafe {
                            std::slice::from_raw_parts_mut(out_head.ptr.add(r * ostride), hd)
                        }
                        .fill(0.0);
                    }
                    return;
                }
                // scores = scale · q kᵀ over keys lo..hi.
                // Every score is written by the product (no accumulation): no need to clear.
                if scores.len() < nq * nk {
                    scores.resize(nq * nk, 0.0);
                }
                let scores = &mut scores[..nq * nk];
                let sc = Out {
                    ptr: scores.as_mut_ptr(),
                    stride: nk,
                    alpha: spec.scale,
                    accumulate: false,
                };
                let (qrows, key_view) = (
                    &qs[i0 * q.stride + h * hd..],
                    keys.view(lo..hi, 0..E::depth(hd)),
                );
                // SAFETY: `scores` is nq × nk, exclusively ours; `qrows` holds nq rows of hd.
                unsafe { E::gemm_rows(qrows, q.stride, (nq, hd), key_view, sc, qa, false) };
                t.exp_rows(visible, scores, (lo, nk), inv, E::F32_SOFTMAX_SUMS);
                // out = P · v (P unnormalised, in the operand type), then each row divided by
                // its sum; `lo` is even, so its keys start a bf16 pair.
                let steps = E::depth(lo)..E::depth(lo) + E::depth(nk);
                // SAFETY: rows i0..i1, columns h·hd..h·hd+hd of the output are inside it (checked
                // by `plan`) and written by this task alone; `scores` holds nq rows of nk.
                unsafe {
                    E::gemm_rows(
                        scores,
                        nk,
                        (nq, nk),
                        values.view(0..hd, steps),
                        out_head,
                        pa,
                        false,
                    )
                };
                for (r, &s) in inv.iter().enumerate() {
                    // SAFETY: as above.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(out_head.ptr.add(r * ostride), hd)
                    };
                    vmath::scale(row, s);
                }
            };
            // A task reached again on this thread while its buffers are in use takes fresh ones.
            SCRATCH.with(|cell| match cell.try_borrow_mut() {
                Ok(mut s) => task(&mut s),
                Err(_) => task(&mut Scratch::default()),
            })
        });
    Ok(())
}

/// One attention task's buffers, kept per thread between calls: fresh ones for every task
/// cost a page-zeroing pass over megabytes of scores each time (7% of an image's time).
#[derive(Default)]
struct Scratch {
    /// The query rows in bf16 (unused in f32).
    qa: Vec<u32>,
    /// Scores, then unnormalised probabilities.
    scores: Vec<f32>,
    /// The probabilities in bf16 (unused in f32).
    pa: Vec<u32>,
    /// Each row's 1 / Σ probabilities.
    inv: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::Kernel;
    use crate::{
        AttnSpec, Backend, Mask, Precision, QkvLayout, Run, View, ViewMut, block_causal_limits,
    };

    #[derive(Clone, Copy)]
    enum M {
        Full,
        Window(usize),
        Causal,
        /// Block-causal limits from runs, per segment.
        Blocks(&'static [Run]),
    }

    /// One case: segments of `(queries, keys)`; keys ≥ queries, the queries being the last rows.
    struct Case {
        segs: &'static [(usize, usize)],
        /// Keys in ranges of a separate cache buffer (in reverse segment order, with gaps), else
        /// the query rows themselves (then queries == keys).
        cached: bool,
        hq: usize,
        hkv: usize,
        hd: usize,
        mask: M,
    }

    /// Straight from the definition, in f64: query `r` of a segment with `nq` queries over `nk`
    /// keys is at position `nk − nq + r`.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        c: &Case,
        ranges: &[(usize, usize)],
        limits: &[u32],
        scale: f64,
        bf16: bool,
    ) -> Vec<f64> {
        // Under bf16: q, k and v as stored in bf16, the unnormalised probabilities rounded to
        // bf16 before P·V, their sum exact.
        let r = |x: f32| if bf16 { to_bf16(x) } else { x };
        let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            q.iter().map(|&x| r(x)).collect(),
            k.iter().map(|&x| r(x)).collect(),
            v.iter().map(|&x| r(x)).collect(),
        );
        let (hq, hd) = (c.hq, c.hd);
        let (qw, kw) = (hq * hd, c.hkv * hd);
        let group = hq / c.hkv;
        let total: usize = c.segs.iter().map(|s| s.0).sum();
        let mut out = vec![0f64; total * qw];
        let mut i = 0;
        for (&(nq, nk), &(ks, _)) in c.segs.iter().zip(ranges) {
            for r in 0..nq {
                let pos = nk - nq + r;
                for h in 0..hq {
                    let g = h / group;
                    let logits: Vec<(usize, f64)> = (0..nk)
                        .filter(|&j| match c.mask {
                            M::Full => true,
                            M::Window(w) => pos.abs_diff(j) <= w,
                            M::Causal => j <= pos,
                            M::Blocks(_) => j < limits[i] as usize,
                        })
                        .map(|j| {
                            let d: f64 = (0..hd)
                                .map(|t| {
                                    q[i * qw + h * hd + t] as f64
                                        * k[(ks + j) * kw + g * hd + t] as f64
                                })
                                .sum();
                            (ks + j, d * scale)
                        })
                        .collect();
                    let m = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = logits.iter().map(|x| (x.1 - m).exp()).sum();
                    for &(j, l) in &logits {
                        let e = (l - m).exp();
                        let p = if bf16 { to_bf16(e as f32) as f64 } else { e } / z;
                        for t in 0..hd {
                            out[i * qw + h * hd + t] += p * v[j * kw + g * hd + t] as f64;
                        }
                    }
                }
                i += 1;
            }
        }
        out
    }

    fn to_bf16(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    #[test]
    fn packed_and_cached_attention_with_every_mask_matches_naive() {
        for kernel in [Kernel::Gemm, Kernel::PanelsF32, Kernel::PanelsBf16] {
            every_mask_matches_naive(kernel);
        }
    }

    fn every_mask_matches_naive(kernel: Kernel) {
        let be = cpu();
        let bf16 = kernel == Kernel::PanelsBf16;
        let _precision = if bf16 {
            Precision::Bf16
        } else {
            Precision::F32
        };
        const TEXT_THEN_IMAGES: &[Run] = &[Run::Causal(5), Run::Block(12), Run::Block(20)];
        let cases = [
            Case {
                segs: &[(1, 1)],
                cached: false,
                hq: 1,
                hkv: 1,
                hd: 4,
                mask: M::Full,
            },
            // window cuts through segments
            Case {
                segs: &[(5, 5), (70, 70), (3, 3)],
                cached: false,
                hq: 4,
                hkv: 2,
                hd: 8,
                mask: M::Window(3),
            },
            // MQA, window edge at the block size
            Case {
                segs: &[(130, 130), (1, 1), (67, 67)],
                cached: false,
                hq: 4,
                hkv: 1,
                hd: 16,
                mask: M::Window(64),
            },
            // causal, odd head dim
            Case {
                segs: &[(9, 9), (200, 200)],
                cached: false,
                hq: 2,
                hkv: 2,
                hd: 5,
                mask: M::Causal,
            },
            // more rows than a query block (several blocks per segment), windowed and causal
            Case {
                segs: &[(600, 600), (3, 3)],
                cached: false,
                hq: 2,
                hkv: 1,
                hd: 4,
                mask: M::Window(70),
            },
            Case {
                segs: &[(530, 530)],
                cached: false,
                hq: 2,
                hkv: 2,
                hd: 3,
                mask: M::Causal,
            },
            // window 0: each token sees itself
            Case {
                segs: &[(150, 150)],
                cached: false,
                hq: 3,
                hkv: 3,
                hd: 7,
                mask: M::Window(0),
            },
            // block-causal text + images over whole sequences (Qwen-Image prefix prefill)
            Case {
                segs: &[(37, 37), (37, 37)],
                cached: false,
                hq: 2,
                hkv: 1,
                hd: 8,
                mask: M::Blocks(TEXT_THEN_IMAGES),
            },
            // decoding: one new query per sequence against its cache, causal (sees everything)
            Case {
                segs: &[(1, 7), (1, 1), (1, 90)],
                cached: true,
                hq: 4,
                hkv: 2,
                hd: 8,
                mask: M::Causal,
            },
            // prefill after a cached prefix: new rows causal among themselves
            Case {
                segs: &[(20, 33), (70, 70)],
                cached: true,
                hq: 2,
                hkv: 2,
                hd: 6,
                mask: M::Causal,
            },
            // prefill of more rows than a query block after a cached prefix
            Case {
                segs: &[(300, 420)],
                cached: true,
                hq: 2,
                hkv: 1,
                hd: 4,
                mask: M::Causal,
            },
            // a DiT step against a cached prefix: no mask
            Case {
                segs: &[(65, 100)],
                cached: true,
                hq: 2,
                hkv: 1,
                hd: 8,
                mask: M::Full,
            },
            // a sliding window over a cache
            Case {
                segs: &[(3, 40), (10, 12)],
                cached: true,
                hq: 2,
                hkv: 2,
                hd: 4,
                mask: M::Window(5),
            },
        ];
        for (ci, c) in cases.iter().enumerate() {
            let (hq, hkv, hd) = (c.hq, c.hkv, c.hd);
            let layout = QkvLayout {
                heads_q: hq,
                heads_kv: hkv,
                head_dim: hd,
            };
            let (qw, kw) = (layout.q_cols(), layout.kv_cols());
            let total: usize = c.segs.iter().map(|s| s.0).sum();
            let mut rng = Rng::new(100 + ci as u64);
            let q = rng.vec(total * qw, 2.0);
            // Keys: packed like the queries, or in a cache laid out in reverse order with gaps.
            let mut ranges = Vec::new();
            let key_rows = if c.cached {
                let mut at = 3;
                let mut r = vec![(0, 0); c.segs.len()];
                for (s, &(_, nk)) in c.segs.iter().enumerate().rev() {
                    r[s] = (at, nk);
                    at += nk + 2;
                }
                ranges = r;
                at
            } else {
                let mut at = 0;
                for &(nq, nk) in c.segs {
                    assert_eq!(nq, nk);
                    ranges.push((at, nk));
                    at += nk;
                }
                at
            };
            let k = rng.vec(key_rows * kw, 2.0);
            let v = rng.vec(key_rows * kw, 2.0);
            let limits: Vec<u32> = match c.mask {
                M::Blocks(runs) => c
                    .segs
                    .iter()
                    .flat_map(|_| block_causal_limits(runs))
                    .collect(),
                _ => Vec::new(),
            };
            let (qb, kb, vb) = (buf(&be, &q), buf(&be, &k), buf(&be, &v));
            let lb = ids(&be, &limits);
            let lens: Vec<usize> = c.segs.iter().map(|s| s.0).collect();
            let segs = be.segments(&lens).unwrap();
            let kv = be.kv_ranges(&ranges).unwrap();
            let mask = match c.mask {
                M::Full => Mask::Full,
                M::Window(w) => Mask::Window(w),
                M::Causal => Mask::Causal,
                M::Blocks(_) => Mask::Limits(&lb),
            };
            let mut spec = AttnSpec::new(layout, 0.7, mask);
            if c.cached {
                spec = spec.over(&kv);
            }
            let mut o = buf(&be, &vec![f32::NAN; total * qw]);
            super::attention(
                View::new(&qb, total, qw),
                View::new(&kb, key_rows, kw),
                View::new(&vb, key_rows, kw),
                ViewMut::new(&mut o, total, qw),
                &spec,
                &segs,
                kernel,
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, total, qw)).unwrap();
            let want = naive(&q, &k, &v, c, &ranges, &limits, 0.7, bf16);
            // Under bf16 a probability whose f32 and f64 values straddle a bf16 rounding
            // boundary rounds one step apart (2⁻⁸ of it, ≤ 2⁻⁸ · max|v| = 8e-3 in an output):
            // rare, so each element may be off by that much, but the mean error must stay at
            // the f32 level (a missing or extra rounding shows as a mean near 1e-4).
            let mut mean = 0f64;
            for (idx, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let what = format!("attention {kernel:?} case {ci} idx {idx}");
                let e = (g as f64 - w).abs();
                mean += e / got.len() as f64;
                if !(bf16 && g.is_finite() && e <= 8e-3) {
                    assert_close(g, w, 1e-5, &what);
                }
            }
            assert!(
                mean <= 1e-5,
                "attention {kernel:?} case {ci}: mean error {mean:.2e}"
            );
        }
    }

    #[test]
    fn key_ranges_shorter_than_their_queries_are_refused() {
        let be = cpu();
        let layout = QkvLayout {
            heads_q: 1,
            heads_kv: 1,
            head_dim: 2,
        };
        let (qb, kb) = (buf(&be, &[0.0; 8]), buf(&be, &[0.0; 8]));
        let mut o = buf(&be, &[0.0; 8]);
        let segs = be.segments(&[4]).unwrap();
        let kv = be.kv_ranges(&[(0, 3)]).unwrap();
        let err = be
            .attention(
                View::new(&qb, 4, 2),
                View::new(&kb, 4, 2),
                View::new(&kb, 4, 2),
                ViewMut::new(&mut o, 4, 2),
                &AttnSpec::new(layout, 1.0, Mask::Full).over(&kv),
                &segs,
            )
            .unwrap_err();
        assert!(err.to_string().contains("key ranges"), "{err}");
    }
}

/// `cargo test --release -p tessera-backend --lib attention_rate -- --ignored --nocapture`: one
/// EmbeddingGemma 2 image's attention (2,430 patches, 12 heads of 64) in bf16 and f32, median of 7.
#[cfg(test)]
mod rate {
    use super::super::testutil::*;
    use super::Kernel;
    use crate::{AttnSpec, Backend, Mask, QkvLayout, Role, View, ViewMut};
    use std::time::Instant;

    #[test]
    #[ignore = "a measurement: run on a quiet machine"]
    fn attention_rate() {
        let be = cpu();
        let (n, heads, hd) = (2430, 12, 64);
        let w = heads * hd;
        let mut rng = Rng::new(3);
        let mut rand = || {
            buf(
                &be,
                &(0..n * w).map(|_| rng.next_f32() - 0.5).collect::<Vec<_>>(),
            )
        };
        let (q, k, v) = (rand(), rand(), rand());
        let mut out = be.alloc(n * w, Role::Stream).unwrap();
        let segs = be.segments(&[n]).unwrap();
        let layout = QkvLayout {
            heads_q: heads,
            heads_kv: heads,
            head_dim: hd,
        };
        let spec = AttnSpec::new(layout, 0.125, Mask::Full);
        for kernel in [Kernel::PanelsBf16, Kernel::PanelsF32] {
            let mut ms: Vec<f64> = (0..7)
                .map(|_| {
                    let t = Instant::now();
                    super::attention(
                        View::new(&q, n, w),
                        View::new(&k, n, w),
                        View::new(&v, n, w),
                        ViewMut::new(&mut out, n, w),
                        &spec,
                        &segs,
                        kernel,
                    )
                    .unwrap();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            let flops = 4.0 * (n * n * hd * heads) as f64;
            eprintln!(
                "{kernel:?}{}: median {:.1} ms ({:.0} GFLOP/s), {:.1}–{:.1}",
                if kernel == Kernel::PanelsBf16 && super::super::amx::enabled() {
                    " (AMX)"
                } else {
                    ""
                },
                ms[3],
                flops / ms[3] / 1e6,
                ms[0],
                ms[6]
            );
        }
    }
}
