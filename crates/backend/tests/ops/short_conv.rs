//! LFM2's short convolution: packed segments continuing from (or starting) their state slots.

use tessera_backend::{ConvSeq, Op, Role, ShortConv, View};

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, indices};

#[derive(Clone)]
pub struct ShortConvCase {
    /// `(new rows, tokens held before)` per segment; segment `i` uses slot `slots − 1 − i`.
    segs: Vec<(usize, u32)>,
    channels: usize,
    kernel: usize,
    bias: bool,
}

/// Segments of `(new rows, tokens held before)`, no bias.
pub fn short_conv(segs: &[(usize, u32)], channels: usize, kernel: usize) -> ShortConvCase {
    ShortConvCase {
        segs: segs.to_vec(),
        channels,
        kernel,
        bias: false,
    }
}

impl ShortConvCase {
    pub fn bias(self) -> Self {
        ShortConvCase { bias: true, ..self }
    }
}

impl OpCase for ShortConvCase {
    fn name(&self) -> String {
        format!(
            "short_conv {:?} × {} channels, {} taps{}",
            self.segs,
            self.channels,
            self.kernel,
            if self.bias { ", bias" } else { "" }
        )
    }

    fn op(&self) -> Op {
        Op::ShortConv {
            kernel: self.kernel,
            bias: self.bias,
        }
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let (c, k) = (self.channels, self.kernel);
        let lens: Vec<usize> = self.segs.iter().map(|s| s.0).collect();
        let rows: usize = lens.iter().sum();
        // One spare slot, so that an untouched slot is checked too.
        let slots = self.segs.len() + 1;
        let slot_len = (k - 1) * c;
        let seqs: Vec<ConvSeq> = self
            .segs
            .iter()
            .enumerate()
            .map(|(i, &(_, held))| ConvSeq {
                slot: (slots - 1 - i) as u32,
                held,
            })
            .collect();
        let bcx = Guarded::drawn(
            be,
            Role::Compute,
            Layout::padded(rows, 3 * c, 8, 8),
            rng,
            2.0,
        )?;
        let weight = be.vector_f32(&rng.vec(c * k, 1.0))?;
        let bias = be.vector_f32(&rng.vec(c, 0.5))?;
        let mut state = be.alloc(slots * slot_len, Role::Stream)?;
        be.write_f32(&mut state, &rng.vec(slots * slot_len, 2.0))?;
        let seq_buf = indices(be, &ConvSeq::pack(&seqs))?;
        let segs = be.segments(&lens)?;
        let mut out = Guarded::empty(be, Role::Compute, Layout::padded(rows, c, 8, 8))?;
        let conv = ShortConv {
            channels: c,
            kernel: k,
            weight: &weight,
            bias: self.bias.then_some(&bias),
            seqs: &seq_buf,
        };
        be.short_conv(bcx.view(), &conv, &segs, &mut state, out.view_mut())?;
        let state = be.read_f32(View::new(&state, slots, slot_len))?;
        Ok(vec![
            out.read(be, "out")?,
            Output {
                what: "state",
                values: state,
            },
        ])
    }
}
