//! `out = alpha · x · wᵀ` through the `gemm` crate.

use tessera_core::{Error, Result};

use super::{CpuBackend, CpuMat};
use crate::{Epilogue, View, ViewMut};

/// Products below this many multiply-adds run on one thread: spawning costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 20;

pub(super) fn matmul(
    x: View<'_, CpuBackend>,
    w: &CpuMat,
    out: ViewMut<'_, CpuBackend>,
    ep: Epilogue,
) -> Result<()> {
    let (m, k, n) = (x.rows, x.cols, w.out);
    if k != w.inner || out.rows != m || out.cols != n {
        return Err(Error::backend(
            "matmul",
            format!(
                "x {}×{} · wᵀ ({}×{}) → out {}×{}",
                x.rows, x.cols, w.out, w.inner, out.rows, out.cols
            ),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let xs = super::slice(&x);
    let (out_off, out_end, out_stride) = (out.offset, out.end(), out.stride);
    let dst = &mut out.buf.f32_mut()[out_off..out_end];
    let threads = rayon::current_num_threads();
    let par = if m * n * k >= PARALLEL_MIN_MACS && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    if k == 0 {
        for r in dst.chunks_mut(out_stride) {
            let len = r.len().min(n);
            r[..len].fill(0.0);
        }
        return Ok(());
    }
    // SAFETY: `dst` covers rows `0..m` at stride `out_stride` with `n` columns each, `xs` covers
    // `m` rows of `k` at `x.stride`, and `w.data` is `n × k` dense (checked above). gemm reads
    // lhs/rhs and writes dst only within those extents; the borrows are disjoint.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            out_stride as isize,
            false,
            xs.as_ptr(),
            1,
            x.stride as isize,
            w.data.as_ptr(),
            k as isize,
            1,
            0.0,
            ep.alpha,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Backend, Epilogue, View, ViewMut};

    #[test]
    fn matches_naive_on_odd_sizes_and_strided_views() {
        let be = cpu();
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 7),
            (17, 33, 9),
            (64, 48, 130),
            (129, 257, 65),
        ] {
            let mut rng = Rng::new((m * 1000 + k * 10 + n) as u64);
            // x lives in columns 2.. of a wider buffer; out in columns 1.. of another.
            let xw = k + 3;
            let xh = rng.vec(m * xw, 1.0);
            let w = rng.vec(n * k, 1.0);
            let x = buf(&be, &xh);
            let mat = be.matrix(&[(&w, n)], k).unwrap();
            let ow = n + 2;
            let mut o = buf(&be, &vec![f32::NAN; m * ow]);
            let xv = View::new(&x, m, xw).cols(2, k);
            be.matmul(
                xv,
                &mat,
                ViewMut::new(&mut o, m, ow).cols(1, n),
                Epilogue::scaled(0.5),
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
