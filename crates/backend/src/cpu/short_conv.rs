//! LFM2's short convolution (see [`ShortConv`]): each segment's inputs `u = b ⊙ x` after the
//! `kernel − 1` held in its state slot, taps summed in f64, the slot refreshed afterwards.

use rayon::prelude::*;
use tessera_core::{Error, Result};

use super::{CpuBackend, rows, rows_mut};
use crate::{Segments, ShortConv, View, ViewMut};

pub(super) fn short_conv(
    bcx: View<'_, CpuBackend>,
    conv: &ShortConv<'_, CpuBackend>,
    segs: &Segments<CpuBackend>,
    state: &mut [f32],
    out: ViewMut<'_, CpuBackend>,
) -> Result<()> {
    conv.check(&bcx, &out, segs, state.len())?;
    let (c, k) = (conv.channels, conv.kernel);
    let slot_len = conv.slot_len();
    let slots = state.len() / slot_len;
    let seqs = conv.seqs.u32();
    let w = conv.weight.as_slice();
    let bias = conv.bias.map(|b| b.as_slice());
    if seqs.len() < 2 * segs.count() || w.len() != c * k || bias.is_some_and(|b| b.len() != c) {
        return Err(Error::backend(
            "short_conv",
            format!(
                "{} sequence entries for {} segments, {} weights and {:?} biases for {c} channels × {k} taps",
                seqs.len() / 2,
                segs.count(),
                w.len(),
                bias.map(<[f32]>::len)
            ),
        ));
    }
    let in_rows: Vec<&[f32]> = rows(bcx).collect();
    let mut out_rows: Vec<&mut [f32]> = rows_mut(out).collect();
    for (s, (a, b)) in segs.ranges().enumerate() {
        let (slot, held) = (seqs[2 * s] as usize, seqs[2 * s + 1]);
        if slot >= slots {
            return Err(Error::backend(
                "short_conv",
                format!("state slot {slot} of a state holding {slots}"),
            ));
        }
        let st = &mut state[slot * slot_len..(slot + 1) * slot_len];
        // The inputs this segment reads: the state's k − 1 rows, then its own.
        let mut u = Vec::with_capacity((k - 1 + b - a) * c);
        if held == 0 {
            u.resize((k - 1) * c, 0.0);
        } else {
            u.extend_from_slice(st);
        }
        for row in &in_rows[a..b] {
            u.extend(row[..c].iter().zip(&row[2 * c..]).map(|(&b, &x)| b * x));
        }
        out_rows[a..b]
            .par_iter_mut()
            .zip(in_rows[a..b].par_iter())
            .enumerate()
            .for_each(|(t, (o, row))| {
                for ch in 0..c {
                    let taps = &w[ch * k..(ch + 1) * k];
                    let mut acc = bias.map_or(0.0, |b| b[ch] as f64);
                    for (j, &wj) in taps.iter().enumerate() {
                        acc += wj as f64 * u[(t + j) * c + ch] as f64;
                    }
                    o[ch] = row[c + ch] * acc as f32;
                }
            });
        st.copy_from_slice(&u[u.len() - slot_len..]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{Rng, assert_close, buf, cpu};
    use crate::{Backend, ConvSeq, ShortConv, View, ViewMut};

    /// The convolution over whole sequences from zeros, naively in f64.
    fn naive(bcx: &[f32], c: usize, w: &[f32], bias: &[f32], k: usize) -> Vec<f64> {
        let rows = bcx.len() / (3 * c);
        let u = |t: isize, ch: usize| -> f64 {
            if t < 0 {
                0.0
            } else {
                let r = &bcx[t as usize * 3 * c..];
                r[ch] as f64 * r[2 * c + ch] as f64
            }
        };
        let mut out = vec![0.0; rows * c];
        for t in 0..rows {
            for ch in 0..c {
                let mut acc = bias[ch] as f64;
                for j in 0..k {
                    acc += w[ch * k + j] as f64 * u(t as isize - (k - 1 - j) as isize, ch);
                }
                out[t * c + ch] = bcx[t * 3 * c + c + ch] as f64 * acc;
            }
        }
        out
    }

    #[test]
    fn prefill_then_steps_match_the_whole_sequence() {
        let be = cpu();
        let (c, k) = (7, 3);
        let mut rng = Rng::new(11);
        // Two sequences of 5 and 1 rows, run as a prefill of 3 + 1 rows, then steps.
        let lens = [5usize, 1];
        let data: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n * 3 * c, 2.0)).collect();
        let w = rng.vec(c * k, 1.0);
        let bias = rng.vec(c, 0.5);
        let (wv, bv) = (be.vector_f32(&w).unwrap(), be.vector_f32(&bias).unwrap());
        let mut state = vec![f32::NAN; 3 * (k - 1) * c];
        let mut got: Vec<Vec<f32>> = vec![Vec::new(); 2];
        // Calls: (rows of seq 0, rows of seq 1) fed per call, in slots 2 and 0.
        let plan: [&[(usize, usize, usize)]; 3] =
            [&[(0, 0, 3), (1, 0, 1)], &[(0, 3, 4)], &[(0, 4, 5)]];
        for call in plan {
            let mut rows_in = Vec::new();
            let mut seqs = Vec::new();
            let mut seg_lens = Vec::new();
            for &(s, from, to) in call {
                rows_in.extend_from_slice(&data[s][from * 3 * c..to * 3 * c]);
                seqs.push(ConvSeq {
                    slot: if s == 0 { 2 } else { 0 },
                    held: from as u32,
                });
                seg_lens.push(to - from);
            }
            let n: usize = seg_lens.iter().sum();
            let segs = be.segments(&seg_lens).unwrap();
            let mut sq = be.alloc(2 * seqs.len(), crate::Role::Index).unwrap();
            be.write_u32(&mut sq, &ConvSeq::pack(&seqs)).unwrap();
            let x = buf(&be, &rows_in);
            let mut o = buf(&be, &vec![0.0; n * c]);
            let conv = ShortConv {
                channels: c,
                kernel: k,
                weight: &wv,
                bias: Some(&bv),
                seqs: &sq,
            };
            super::short_conv(
                View::new(&x, n, 3 * c),
                &conv,
                &segs,
                &mut state,
                ViewMut::new(&mut o, n, c),
            )
            .unwrap();
            let vals = be.read_f32(View::new(&o, n, c)).unwrap();
            let mut at = 0;
            for (&(s, _, _), &len) in call.iter().zip(&seg_lens) {
                got[s].extend_from_slice(&vals[at * c..(at + len) * c]);
                at += len;
            }
        }
        for s in 0..2 {
            let want = naive(&data[s], c, &w, &bias, k);
            assert_eq!(got[s].len(), want.len());
            for (g, w) in got[s].iter().zip(&want) {
                assert_close(*g, *w, 1e-6, "short conv");
            }
        }
    }
}
