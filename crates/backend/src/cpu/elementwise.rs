//! Row gathers, gated activations and per-segment pooling.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, CpuTable, rows, rows_mut, vmath};
use crate::view::same_shape;
use crate::{Activation, View, ViewMut};

pub(super) fn embed(
    table: &CpuTable,
    ids: &[u32],
    scale: f32,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    if out.cols != table.dim || ids.len() < out.rows {
        return Err(Error::backend(
            "embed",
            format!(
                "{} ids into {}×{} for a table of width {}",
                ids.len(),
                out.rows,
                out.cols,
                table.dim
            ),
        ));
    }
    if let Some(&bad) = ids[..out.rows].iter().find(|&&i| i as usize >= table.rows) {
        return Err(Error::backend(
            "embed",
            format!("token id {bad} outside the table of {} rows", table.rows),
        ));
    }
    let t = table.weights.tensor(&table.name)?;
    rows_mut(out).zip(ids.par_iter()).for_each(|(o, &id)| {
        table.read(&t, id as usize * table.dim, o);
        o.iter_mut().for_each(|v| *v *= scale);
    });
    Ok(())
}

pub(super) fn gated(
    gate: View<'_, CpuBackend>,
    up: View<'_, CpuBackend>,
    out: ViewMut<'_, CpuBackend>,
    act: Activation,
    f32_math: bool,
) -> Result<()> {
    same_shape("gated", (gate.rows, gate.cols), (up.rows, up.cols))?;
    same_shape("gated", (gate.rows, gate.cols), (out.rows, out.cols))?;
    let gated = match f32_math {
        true => vmath::gated_f32,
        false => vmath::gated,
    };
    rows_mut(out)
        .zip(rows(gate))
        .zip(rows(up))
        .for_each(|((o, g), u)| gated(g, u, o, act));
    Ok(())
}

pub(super) fn segment_mean(
    x: View<'_, CpuBackend>,
    offsets: &[u32],
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    let n = offsets.len().saturating_sub(1);
    if out.rows != n || out.cols != x.cols || *offsets.last().unwrap_or(&0) as usize != x.rows {
        return Err(Error::backend(
            "segment_mean",
            format!(
                "{n} segments over {} rows into {}×{}",
                x.rows, out.rows, out.cols
            ),
        ));
    }
    rows_mut(out).enumerate().for_each(|(s, o)| {
        let (a, b) = (offsets[s] as usize, offsets[s + 1] as usize);
        let mut acc = vec![0f64; o.len()];
        for r in a..b {
            let row = &super::slice(&x.rows(r, 1))[..x.cols];
            for (acc, &v) in acc.iter_mut().zip(row) {
                *acc += v as f64;
            }
        }
        let inv = 1.0 / (b - a).max(1) as f64;
        for (o, a) in o.iter_mut().zip(acc) {
            *o = (a * inv) as f32;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Activation, Backend, View, ViewMut};

    #[test]
    fn gated_and_segment_mean() {
        let be = cpu();
        let (rows, cols) = (9, 13);
        let mut rng = Rng::new(3);
        let gu = rng.vec(rows * 2 * cols, 3.0);
        let b = buf(&be, &gu);
        let all = View::new(&b, rows, 2 * cols);
        let mut o = buf(&be, &vec![0.0; rows * cols]);
        be.gated(
            all.cols(0, cols),
            all.cols(cols, cols),
            ViewMut::new(&mut o, rows, cols),
            Activation::Silu,
        )
        .unwrap();
        let got = be.read_f32(View::new(&o, rows, cols)).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let g = gu[r * 2 * cols + c] as f64;
                let want = g / (1.0 + (-g).exp()) * gu[r * 2 * cols + cols + c] as f64;
                assert_close(got[r * cols + c], want, 1e-6, "silu gate");
            }
        }
        let segs = be.segments(&[2, 0, 7]).unwrap();
        let mut m = buf(&be, &vec![f32::NAN; 3 * cols]);
        be.segment_mean(
            View::new(&o, rows, cols),
            &segs,
            ViewMut::new(&mut m, 3, cols),
        )
        .unwrap();
        let mean = be.read_f32(View::new(&m, 3, cols)).unwrap();
        for c in 0..cols {
            let a: f64 = (0..2).map(|r| got[r * cols + c] as f64).sum::<f64>() / 2.0;
            let b: f64 = (2..9).map(|r| got[r * cols + c] as f64).sum::<f64>() / 7.0;
            assert_close(mean[c], a, 1e-6, "mean 0");
            assert_eq!(mean[cols + c], 0.0, "empty segment");
            assert_close(mean[2 * cols + c], b, 1e-6, "mean 2");
        }
    }
}
