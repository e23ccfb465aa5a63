//! `out = epilogue(x · wᵀ)`: the product (the panel kernels, f32 or bf16, or the `gemm` crate),
//! then bias, activation, gate and accumulation in one pass over the rows.

use std::cell::RefCell;

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::panels::{self, Lhs, Out};
use super::{CpuBackend, CpuBuf, CpuMat, MatStore, int8, quant, rows_mut, slice, vmath};
use crate::op::check_product;
use crate::{Epilogue, View, ViewMut};

/// Products below this many multiply-adds run on one thread: spawning costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 20;

pub(super) fn matmul(
    x: View<'_, CpuBackend>,
    w: &CpuMat,
    mut out: ViewMut<'_, CpuBackend>,
    ep: &Epilogue<'_, CpuBackend>,
) -> Result<()> {
    check_product(&x, (w.out, w.inner), &out)?;
    let (m, n) = (x.rows, w.out);
    if let Some(b) = ep.bias
        && b.len() != n
    {
        return Err(Error::backend(
            "matmul",
            format!("bias of {} for {n} outputs", b.len()),
        ));
    }
    let gate = match &ep.gate {
        Some(g) if g.values.cols != n || (g.values.rows != 1 && g.values.rows != m) => {
            return Err(Error::backend(
                "matmul",
                format!(
                    "gate is {}×{}, expected 1×{n} or {m}×{n}",
                    g.values.rows, g.values.cols
                ),
            ));
        }
        Some(g) => Some((slice(&g.values), g.values.stride, g.broadcast(), g.tanh)),
        None => None,
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    // Only a bare product (possibly accumulated) goes straight into `out`; anything else is
    // computed first and folded in row by row.
    let plain = ep.bias.is_none() && ep.act.is_none() && gate.is_none();
    if plain {
        product(x, w, out.reborrow(), ep.alpha, ep.accumulate);
        return Ok(());
    }
    let bias = ep.bias.map(Vec::as_slice);
    // Per element in this order: `+ bias`, `act`, `· gate`.
    let apply = |r: usize, y: &mut [f32]| {
        if let Some(b) = bias {
            y.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
        }
        if let Some(act) = ep.act {
            vmath::activate(y, act);
        }
        if let Some((g, stride, broadcast, tanh)) = gate {
            let g = &g[if broadcast { 0 } else { r * stride }..];
            for (v, &gv) in y.iter_mut().zip(g) {
                *v *= if tanh { (gv as f64).tanh() as f32 } else { gv };
            }
        }
    };
    if ep.accumulate {
        let mut tmp = CpuBuf::F32(vec![0.0; m * n]);
        product(x, w, ViewMut::new(&mut tmp, m, n), ep.alpha, false);
        let tmp = tmp.f32();
        rows_mut(out)
            .zip(tmp.par_chunks(n))
            .enumerate()
            .for_each_init(Vec::new, |y, (r, (o, t))| {
                y.clear();
                y.extend_from_slice(t);
                apply(r, y);
                o.iter_mut().zip(y.iter()).for_each(|(o, &v)| *o += v);
            });
    } else {
        product(x, w, out.reborrow(), ep.alpha, false);
        rows_mut(out).enumerate().for_each(|(r, o)| apply(r, o));
    }
    Ok(())
}

/// `out = alpha · x · wᵀ`, or `out += …` when `accumulate`, over every thread ([`product_rows`]).
/// Shapes were checked by the caller.
fn product(
    x: View<'_, CpuBackend>,
    w: &CpuMat,
    out: ViewMut<'_, CpuBackend>,
    alpha: f32,
    accumulate: bool,
) {
    let (off, end, stride) = (out.offset, out.end(), out.stride);
    let dst = &mut out.buf.f32_mut()[off..end];
    product_rows(
        slice(&x),
        x.stride,
        x.rows,
        w,
        dst,
        stride,
        alpha,
        accumulate,
        true,
    );
}

/// `dst = alpha · x · wᵀ`, or `dst += …` when `accumulate`, for `m` rows of `x` (at stride `xs`)
/// into `m` rows of `dst` (at stride `ds`), by the kernel the matrix was packed for: the panel
/// kernels (f32, or bf16 with `x` rounded once), else the `gemm` crate. None sums a row's
/// products in an order that depends on the row count. `par`: over every thread, else on this
/// one (the caller is parallel already).
#[allow(clippy::too_many_arguments)]
pub(super) fn product_rows(
    x: &[f32],
    xs: usize,
    m: usize,
    w: &CpuMat,
    dst: &mut [f32],
    ds: usize,
    alpha: f32,
    accumulate: bool,
    par: bool,
) {
    let (k, n) = (w.inner, w.out);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        (m - 1) * ds + n <= dst.len() && (m - 1) * xs + k <= x.len(),
        "product out of bounds: {m} rows of {k} into rows of {n}"
    );
    let out = Out {
        ptr: dst.as_mut_ptr(),
        stride: ds,
        alpha,
        accumulate,
    };
    let data = match &w.store {
        MatStore::F32(data) => data,
        MatStore::F32Panels(w) => {
            let lhs = Lhs {
                data: x,
                stride: xs,
                rows: m,
            };
            // SAFETY: `dst` holds `m` rows of `n` columns at `ds` (asserted) and is borrowed
            // mutably for the call; `lhs` holds `m` rows of `k` at `xs`.
            unsafe { panels::gemm(&lhs, w.all(), out, par) };
            return;
        }
        MatStore::Bf16(w) => {
            // SAFETY: as above; `x` holds `m` rows of `k` at `xs`, the matrix `k` columns.
            let run = |a: &mut Vec<u32>| unsafe {
                <u32 as panels::Operand>::gemm_rows(x, xs, (m, k), w.all(), out, a, par)
            };
            // A product reached again on this thread while the buffer is in use (a rayon
            // worker that picked up other work while it waited) takes a buffer of its own.
            ROUNDED.with(|cell| match cell.try_borrow_mut() {
                Ok(mut a) => run(&mut a),
                Err(_) => run(&mut Vec::new()),
            });
            return;
        }
        MatStore::Quant(q) if q.e4m3_activations() => {
            let xr = quant::round_e4m3(x, xs, m, k);
            quant::product_exact(&xr, k, m, q, (n, k), dst, ds, alpha, accumulate, par);
            return;
        }
        MatStore::Quant(q) if q.int8() => {
            int8::product(x, xs, m, q, (n, k), dst, ds, alpha, accumulate, par);
            return;
        }
        MatStore::Quant(q) => {
            quant::product_exact(x, xs, m, q, (n, k), dst, ds, alpha, accumulate, par);
            return;
        }
        MatStore::Stacked(parts) => {
            let mut col = 0;
            for p in parts {
                product_rows(x, xs, m, p, &mut dst[col..], ds, alpha, accumulate, par);
                col += p.out;
            }
            return;
        }
    };
    if k == 0 {
        if !accumulate {
            for r in dst.chunks_mut(ds) {
                let len = r.len().min(n);
                r[..len].fill(0.0);
            }
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let par = if par && m * n * k >= PARALLEL_MIN_MACS && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `dst` covers rows `0..m` at stride `ds` with `n` columns each, `x` covers `m` rows
    // of `k` at `xs` (asserted), and `data` is `n × k` dense. gemm reads lhs/rhs (and dst when
    // accumulating) and writes dst only within those extents; the borrows are disjoint.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ds as isize,
            accumulate,
            x.as_ptr(),
            1,
            xs as isize,
            data.as_ptr(),
            k as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

thread_local! {
    /// The bf16 copy of a product's rows, kept between products so a forward does not fault in
    /// fresh pages for every one.
    static ROUNDED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{CpuBackend, CpuBuf};
    use super::super::{CpuMat, MatStore};
    use crate::{Activation, Backend, Epilogue, Gate, View, ViewMut};

    /// A block of rows gets the same bits alone and inside a larger product, at either
    /// precision: what lets batched work equal the same work alone.
    #[test]
    fn products_do_not_depend_on_the_row_count() {
        for p in [crate::Precision::F32, crate::Precision::Bf16] {
            row_count_invariance(CpuBackend::with_precision(p));
        }
    }

    fn row_count_invariance(be: CpuBackend) {
        let (k, n) = (200, 300);
        let mut rng = Rng::new(5);
        let w = rng.vec(n * k, 1.0);
        let mat = be.matrix_f32(&[(&w, n)], k).unwrap();
        let rows = rng.vec(400 * k, 1.0);
        let run = |first: usize, m: usize| -> Vec<f32> {
            let x = buf(&be, &rows[first * k..(first + m) * k]);
            let mut o = CpuBuf::F32(vec![0.0; m * n]);
            be.matmul(
                View::new(&x, m, k),
                &mat,
                ViewMut::new(&mut o, m, n),
                &Epilogue::scaled(1.0),
            )
            .unwrap();
            be.read_f32(View::new(&o, m, n)).unwrap()
        };
        // Rows 40..80 alone, then inside products of 120, 96 and 400 rows.
        let alone = run(40, 40);
        for (first, m) in [(0, 120), (40, 96), (0, 400)] {
            let all = run(first, m);
            let at = (40 - first) * n;
            assert!(
                all[at..at + 40 * n] == alone[..],
                "rows 40..80 differ inside a product of {m} rows"
            );
        }
    }

    #[test]
    fn matches_naive_on_odd_sizes_and_strided_views() {
        let be = cpu();
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 7),
            (17, 33, 9),
            // Row counts off the kernel's 12-row tiles and 192-row chunks, output columns off its
            // 32-column panels, parallel.
            (32, 40, 2053),
            (96, 40, 2053),
            (97, 40, 2053),
            (7, 700, 301),
            (64, 48, 130),
            (129, 257, 65),
        ] {
            let mut rng = Rng::new((m * 1000 + k * 10 + n) as u64);
            // x lives in columns 2.. of a wider buffer; out in columns 1.. of another.
            let xw = k + 3;
            let xh = rng.vec(m * xw, 1.0);
            let w = rng.vec(n * k, 1.0);
            let x = buf(&be, &xh);
            // As this CPU packs it, and row-major for the `gemm` crate (CPUs without AVX-512).
            let row_major = CpuMat {
                store: MatStore::F32(w.clone()),
                out: n,
                inner: k,
            };
            for mat in [be.matrix_f32(&[(&w, n)], k).unwrap(), row_major] {
                let ow = n + 2;
                let mut o = buf(&be, &vec![f32::NAN; m * ow]);
                let xv = View::new(&x, m, xw).cols(2, k);
                be.matmul(
                    xv,
                    &mat,
                    ViewMut::new(&mut o, m, ow).cols(1, n),
                    &Epilogue::scaled(0.5),
                )
                .unwrap();
                let got = be.read_f32(View::new(&o, m, ow).cols(1, n)).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|t| xh[i * xw + 2 + t] as f64 * w[j * k + t] as f64)
                            .sum::<f64>()
                            * 0.5;
                        assert_close(got[i * n + j], want, 1e-5, "matmul");
                    }
                }
                // Column 0 of every output row is untouched.
                let all = be.read_f32(View::new(&o, m, ow)).unwrap();
                assert!(all.chunks(ow).all(|r| r[0].is_nan()));
            }
        }
    }

    #[test]
    fn bias_and_activation_match_naive() {
        let be = cpu();
        for &(m, k, n, act) in &[
            (1, 1, 1, None),
            (5, 7, 3, Some(Activation::Silu)),
            (6, 33, 17, Some(Activation::Gelu)),
            (33, 64, 17, None),
            (70, 129, 45, Some(Activation::GeluTanh)),
        ] {
            let mut rng = Rng::new((m * 31 + k * 7 + n) as u64);
            let x = rng.vec(m * k, 2.0);
            let w = rng.vec(n * k, 1.0);
            let b = rng.vec(n, 1.0);
            let xb = buf(&be, &x);
            let mat = be.matrix_f32(&[(&w, n)], k).unwrap();
            let bv = be.vector_f32(&b).unwrap();
            // The output sits in columns 2.. of a wider buffer; columns 0..2 stay untouched.
            let ow = n + 2;
            let mut o = buf(&be, &vec![f32::NAN; m * ow]);
            let mut ep = Epilogue::bias(&bv);
            ep.act = act;
            be.matmul(
                View::new(&xb, m, k),
                &mat,
                ViewMut::new(&mut o, m, ow).cols(2, n),
                &ep,
            )
            .unwrap();
            let all = be.read_f32(View::new(&o, m, ow)).unwrap();
            for i in 0..m {
                assert!(all[i * ow].is_nan() && all[i * ow + 1].is_nan());
                for j in 0..n {
                    let z: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum::<f64>()
                        + b[j] as f64;
                    let want = match act {
                        None => z,
                        Some(Activation::Silu) => z / (1.0 + (-z).exp()),
                        Some(Activation::Gelu) => {
                            0.5 * z * (1.0 + libm::erf(z / std::f64::consts::SQRT_2))
                        }
                        Some(Activation::GeluTanh) => {
                            let c = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * z * (1.0 + (c * (z + 0.044715 * z * z * z)).tanh())
                        }
                    };
                    assert_close(all[i * ow + 2 + j], want, 1e-5, "matmul bias/act");
                }
            }
        }
    }

    #[test]
    fn gated_accumulating_epilogue_matches_naive() {
        let be = cpu();
        // x += tanh(g) ⊙ (a·Wᵀ + b) with a broadcast gate row; a per-row gate without tanh.
        for &(m, k, n, broadcast) in &[(5, 7, 3, true), (33, 64, 17, false), (1, 9, 12, true)] {
            let mut rng = Rng::new((m * 13 + k * 5 + n) as u64);
            let x = rng.vec(m * k, 2.0);
            let w = rng.vec(n * k, 1.0);
            let b = rng.vec(n, 1.0);
            let h = rng.vec(m * n, 3.0);
            let g = rng.vec(if broadcast { n } else { m * n }, 2.0);
            let (xb, gb) = (buf(&be, &x), buf(&be, &g));
            let mat = be.matrix_f32(&[(&w, n)], k).unwrap();
            let bv = be.vector_f32(&b).unwrap();
            let mut o = buf(&be, &h);
            let gate = Gate {
                values: View::new(&gb, if broadcast { 1 } else { m }, n),
                tanh: broadcast,
            };
            be.matmul(
                View::new(&xb, m, k),
                &mat,
                ViewMut::new(&mut o, m, n),
                &Epilogue::bias(&bv).gated(gate).accumulate(),
            )
            .unwrap();
            let got = be.read_f32(View::new(&o, m, n)).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let z: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum::<f64>()
                        + b[j] as f64;
                    let gv = g[if broadcast { j } else { i * n + j }] as f64;
                    let gv = if broadcast { gv.tanh() } else { gv };
                    let want = h[i * n + j] as f64 + gv * z;
                    assert_close(got[i * n + j], want, 1e-5, "gated accumulate");
                }
            }
        }
        // A plain accumulate goes straight through the product: out += 0.5 · x·wᵀ.
        let mut rng = Rng::new(3);
        let (x, w, h) = (rng.vec(6, 1.0), rng.vec(6, 1.0), rng.vec(4, 1.0));
        let xb = buf(&be, &x);
        let mat = be.matrix_f32(&[(&w, 2)], 3).unwrap();
        let mut o = buf(&be, &h);
        be.matmul(
            View::new(&xb, 2, 3),
            &mat,
            ViewMut::new(&mut o, 2, 2),
            &Epilogue::scaled(0.5).accumulate(),
        )
        .unwrap();
        let got = be.read_f32(View::new(&o, 2, 2)).unwrap();
        for i in 0..2 {
            for j in 0..2 {
                let z: f64 = (0..3)
                    .map(|t| x[i * 3 + t] as f64 * w[j * 3 + t] as f64)
                    .sum();
                assert_close(
                    got[i * 2 + j],
                    h[i * 2 + j] as f64 + 0.5 * z,
                    1e-6,
                    "accumulate",
                );
            }
        }
    }
}
