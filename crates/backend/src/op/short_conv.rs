//! LFM2's short convolution: a gated, causal, depthwise convolution over packed sequences, each
//! continuing from a rolling state of its last `kernel − 1` inputs.

use tessera_core::{Error, Result};

use crate::{Backend, Segments, View, ViewMut};

/// `out[t] = c[t] ⊙ (bias + Σ_j w_j ⊙ u[t − kernel + 1 + j])` with `u = b ⊙ x`, for rows
/// `[b | c | x]` (each `channels` wide) packed in segments.
///
/// Each segment is one sequence's new rows. The `kernel − 1` inputs before its first row come
/// from the sequence's state slot (zeros for a sequence that held no tokens), and the slot keeps
/// the last `kernel − 1` values of `u` afterwards, so prefilling a prompt and then feeding its
/// tokens one by one computes the same outputs.
pub struct ShortConv<'a, B: Backend> {
    pub channels: usize,
    pub kernel: usize,
    /// `[channels · kernel]`: channel `c`'s taps at `c·kernel ..`, oldest input first (the
    /// checkpoint's `[channels, 1, kernel]`).
    pub weight: &'a B::Vector,
    pub bias: Option<&'a B::Vector>,
    /// Two `u32` per segment: its state slot and the tokens its sequence held before this call.
    pub seqs: &'a B::Buf,
}

/// A sequence's place in [`ShortConv::seqs`]: its state slot and how many tokens it held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSeq {
    pub slot: u32,
    pub held: u32,
}

impl ConvSeq {
    /// The `u32` pairs [`ShortConv::seqs`] holds for `seqs`.
    pub fn pack(seqs: &[ConvSeq]) -> Vec<u32> {
        seqs.iter().flat_map(|s| [s.slot, s.held]).collect()
    }
}

impl<B: Backend> ShortConv<'_, B> {
    /// Floats of one state slot: `kernel − 1` rows of `channels`.
    pub fn slot_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }

    /// Every backend's shape check: `bcx` `[rows, 3·channels]` and `out` `[rows, channels]` with
    /// `rows` the segments' total, a kernel of at least 2 taps, and `state` holding whole slots.
    pub fn check(
        &self,
        bcx: &View<'_, B>,
        out: &ViewMut<'_, B>,
        segs: &Segments<B>,
        state_len: usize,
    ) -> Result<()> {
        let c = self.channels;
        let ok = self.kernel >= 2
            && c > 0
            && bcx.cols == 3 * c
            && out.cols == c
            && bcx.rows == segs.total()
            && out.rows == bcx.rows
            && state_len.is_multiple_of(self.slot_len());
        if ok {
            return Ok(());
        }
        Err(Error::backend(
            "short_conv",
            format!(
                "b|c|x {}×{} into {}×{} for {c} channels, kernel {}, {} rows in segments, state of {state_len}",
                bcx.rows,
                bcx.cols,
                out.rows,
                out.cols,
                self.kernel,
                segs.total()
            ),
        ))
    }
}
