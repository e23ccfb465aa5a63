//! `nn.Linear` with bias and an optional activation: the GEMM, then one pass adding the bias
//! and applying the activation.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::elementwise::{gelu_tanh, silu};
use super::{CpuBackend, CpuMat, matmul, rows_mut};
use crate::{Activation, Epilogue, View, ViewMut};

pub(super) fn activation_fn(act: Activation) -> fn(f32) -> f32 {
    match act {
        Activation::GeluTanh => gelu_tanh,
        Activation::Silu => silu,
    }
}

pub(super) fn linear(
    x: View<'_, CpuBackend>,
    w: &CpuMat,
    bias: Option<&[f32]>,
    act: Option<Activation>,
    mut out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    if let Some(b) = bias
        && b.len() != w.out
    {
        return Err(Error::backend(
            "linear",
            format!("bias of {} for {} outputs", b.len(), w.out),
        ));
    }
    matmul::matmul(x, w, out.reborrow(), Epilogue::default())?;
    if bias.is_none() && act.is_none() {
        return Ok(());
    }
    let f = act.map(activation_fn);
    rows_mut(out).for_each(|row| {
        for (j, v) in row.iter_mut().enumerate() {
            let mut y = *v;
            if let Some(b) = bias {
                y += b[j];
            }
            *v = f.map_or(y, |f| f(y));
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Activation, Backend, View, ViewMut};

    #[test]
    fn matches_naive_with_bias_and_activation() {
        let be = cpu();
        for &(m, k, n, act) in &[
            (1, 1, 1, None),
            (5, 7, 3, Some(Activation::Silu)),
            (33, 64, 17, None),
            (70, 129, 45, Some(Activation::GeluTanh)),
        ] {
            let mut rng = Rng::new((m * 31 + k * 7 + n) as u64);
            let x = rng.vec(m * k, 2.0);
            let w = rng.vec(n * k, 1.0);
            let b = rng.vec(n, 1.0);
            let xb = buf(&be, &x);
            let mat = be.matrix(&[(&w, n)], k).unwrap();
            let bv = be.vector(&b).unwrap();
            // The output sits in columns 2.. of a wider buffer; columns 0..2 stay untouched.
            let ow = n + 2;
            let mut o = buf(&be, &vec![f32::NAN; m * ow]);
            be.linear(
                View::new(&xb, m, k),
                &mat,
                Some(&bv),
                act,
                ViewMut::new(&mut o, m, ow).cols(2, n),
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
                        Some(Activation::GeluTanh) => {
                            let c = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * z * (1.0 + (c * (z + 0.044715 * z * z * z)).tanh())
                        }
                    };
                    assert_close(all[i * ow + 2 + j], want, 1e-5, "linear");
                }
            }
        }
    }
}
