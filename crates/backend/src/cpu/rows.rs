//! Row gathers, scatters and pooling (the vision towers' ops): learned 2-D position rows added by
//! index, per-image `k × k` average pooling of packed patch grids, and the row scatter that puts
//! media soft tokens into a text sequence.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, CpuTable, rows, rows_mut};
use crate::{Grids, View, ViewMut};

pub(super) fn add_positions_2d(
    table: &CpuTable,
    axis_rows: usize,
    pos: &[u32],
    x: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    if x.cols != table.dim || 2 * axis_rows > table.rows || pos.len() < 2 * x.rows {
        return Err(Error::backend(
            "add_positions_2d",
            format!(
                "{} positions for {}×{} rows from a table of {}×{} with {axis_rows} rows per axis",
                pos.len() / 2,
                x.rows,
                x.cols,
                table.rows,
                table.dim
            ),
        ));
    }
    if let Some(&p) = pos[..2 * x.rows].iter().find(|&&p| p as usize >= axis_rows) {
        return Err(Error::backend(
            "add_positions_2d",
            format!("position {p} beyond the table's {axis_rows} rows per axis"),
        ));
    }
    let t = table.weights.tensor(&table.name)?;
    let dim = table.dim;
    rows_mut(x).enumerate().for_each_init(
        || (vec![0f32; dim], vec![0f32; dim]),
        |(tx, ty), (r, row)| {
            table.read(&t, pos[2 * r] as usize * dim, tx);
            table.read(&t, (axis_rows + pos[2 * r + 1] as usize) * dim, ty);
            for ((v, a), b) in row.iter_mut().zip(tx.iter()).zip(ty.iter()) {
                *v += a + b;
            }
        },
    );
    Ok(())
}

pub(super) fn avg_pool2d(
    x: View<'_, CpuBackend>,
    grids: &Grids<CpuBackend>,
    scale: f32,
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    let k = grids.kernel;
    grids.check((x.rows, x.cols), (out.rows, out.cols))?;
    // Top-left patch row and grid width of every pooled row.
    let cells: Vec<(usize, usize)> = grids
        .iter()
        .flat_map(|(first, w, h, _)| {
            (0..h / k)
                .flat_map(move |cy| (0..w / k).map(move |cx| (first + cy * k * w + cx * k, w)))
        })
        .collect();
    let xs = super::slice(&x);
    let inv = 1.0 / (k * k) as f64;
    rows_mut(out)
        .zip(cells.par_iter())
        .for_each_init(Vec::new, |acc, (o, &(top_left, w))| {
            acc.clear();
            acc.resize(o.len(), 0f64);
            for dy in 0..k {
                for dx in 0..k {
                    let r = top_left + dy * w + dx;
                    let row = &xs[r * x.stride..r * x.stride + x.cols];
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
            }
            for (o, &a) in o.iter_mut().zip(acc.iter()) {
                *o = (a * inv) as f32 * scale;
            }
        });
    Ok(())
}

pub(super) fn scatter_rows(
    src: View<'_, CpuBackend>,
    at: &[u32],
    dst: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    if src.cols != dst.cols || at.len() < src.rows {
        return Err(Error::backend(
            "scatter_rows",
            format!(
                "{}×{} rows to {} places in {}×{}",
                src.rows,
                src.cols,
                at.len(),
                dst.rows,
                dst.cols
            ),
        ));
    }
    if let Some(&r) = at[..src.rows].iter().find(|&&r| r as usize >= dst.rows) {
        return Err(Error::backend(
            "scatter_rows",
            format!("row {r} outside the {} destination rows", dst.rows),
        ));
    }
    let (stride, cols, base) = (dst.stride, dst.cols, dst.offset);
    let data = dst.buf.f32_mut();
    for (row, &r) in rows(src).collect::<Vec<_>>().into_iter().zip(at) {
        let start = base + r as usize * stride;
        data[start..start + cols].copy_from_slice(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::{Backend, View, ViewMut};

    /// A one-tensor safetensors file `t` (f32) held in memory for the life of the test binary.
    fn weights_with(shape: &[usize], data: &[f32]) -> tessera_core::Weights {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)
                .unwrap();
        let file = safetensors::serialize([("t", view)], None).unwrap();
        tessera_core::Weights::from_static("test", Box::leak(file.into_boxed_slice())).unwrap()
    }

    #[test]
    fn positions_2d_add_an_x_row_and_a_y_row() {
        let be = cpu();
        let (axis, dim, rows) = (5, 3, 4);
        let mut rng = Rng::new(21);
        let t = rng.vec(2 * axis * dim, 1.0);
        let table = be
            .table(&weights_with(&[2, axis, dim], &t), "t", &[2, axis, dim])
            .unwrap();
        let pos = [0u32, 4, 3, 0, 4, 4, 1, 2];
        let x0 = rng.vec(rows * dim, 1.0);
        let mut xb = buf(&be, &x0);
        be.add_positions_2d(
            &table,
            axis,
            &ids(&be, &pos),
            ViewMut::new(&mut xb, rows, dim),
        )
        .unwrap();
        let got = be.read_f32(View::new(&xb, rows, dim)).unwrap();
        for r in 0..rows {
            let (px, py) = (pos[2 * r] as usize, pos[2 * r + 1] as usize);
            for c in 0..dim {
                let want = x0[r * dim + c] as f64
                    + (t[px * dim + c] as f64 + t[(axis + py) * dim + c] as f64);
                assert_close(got[r * dim + c], want, 1e-6, "positions");
            }
        }
        let beyond = be.add_positions_2d(
            &table,
            axis,
            &ids(&be, &[5, 0]),
            ViewMut::new(&mut xb, 1, dim),
        );
        assert!(beyond.is_err());
        assert!(
            be.table(&weights_with(&[2, axis, dim], &t), "t", &[axis, dim])
                .is_err()
        );
    }

    #[test]
    fn pooling_of_packed_grids_matches_naive() {
        let be = cpu();
        let cols = 7;
        // Two images: 6×3 and 3×9 patches, pooled 3×3, and an odd column count.
        let dims = [(6, 3), (3, 9)];
        let grids = be.grids(&dims, 3).unwrap();
        let n: usize = dims.iter().map(|(w, h)| w * h).sum();
        let mut rng = Rng::new(5);
        let x = rng.vec(n * cols, 2.0);
        let xb = buf(&be, &x);
        let pooled = grids.pooled();
        assert_eq!(pooled, 2 + 3);
        let mut o = buf(&be, &vec![f32::NAN; pooled * cols]);
        be.avg_pool2d(
            View::new(&xb, n, cols),
            &grids,
            1.5,
            ViewMut::new(&mut o, pooled, cols),
        )
        .unwrap();
        let got = be.read_f32(View::new(&o, pooled, cols)).unwrap();
        let mut out_row = 0;
        let mut first = 0;
        for &(w, h) in &dims {
            for cy in 0..h / 3 {
                for cx in 0..w / 3 {
                    for c in 0..cols {
                        let mut s = 0f64;
                        for dy in 0..3 {
                            for dx in 0..3 {
                                let r = first + (cy * 3 + dy) * w + cx * 3 + dx;
                                s += x[r * cols + c] as f64;
                            }
                        }
                        assert_close(got[out_row * cols + c], s / 9.0 * 1.5, 1e-6, "pool");
                    }
                    out_row += 1;
                }
            }
            first += w * h;
        }
        assert!(be.grids(&[(4, 3)], 3).is_err(), "4 is not a multiple of 3");
    }

    #[test]
    fn scatter_rows_overwrites_only_the_named_rows() {
        let be = cpu();
        let (rows, cols) = (9, 5);
        let mut rng = Rng::new(9);
        let d0 = rng.vec(rows * cols, 1.0);
        let src = rng.vec(3 * cols, 1.0);
        let at = [7u32, 0, 4];
        let mut db = buf(&be, &d0);
        let sb = buf(&be, &src);
        be.scatter_rows(
            View::new(&sb, 3, cols),
            &ids(&be, &at),
            ViewMut::new(&mut db, rows, cols),
        )
        .unwrap();
        let got = be.read_f32(View::new(&db, rows, cols)).unwrap();
        for r in 0..rows {
            let want = match at.iter().position(|&a| a as usize == r) {
                Some(i) => &src[i * cols..(i + 1) * cols],
                None => &d0[r * cols..(r + 1) * cols],
            };
            assert_eq!(&got[r * cols..(r + 1) * cols], want, "row {r}");
        }
        let bad = be.scatter_rows(
            View::new(&sb, 1, cols),
            &ids(&be, &[9]),
            ViewMut::new(&mut db, rows, cols),
        );
        assert!(bad.is_err());
    }
}
