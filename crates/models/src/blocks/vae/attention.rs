//! The VAEs' mid-block self-attention: one head as wide as the image's channels, over all its
//! pixels (the tokens are the channels-last rows).

use tessera_backend::{AttnSpec, Backend, Mask, QkvLayout, View, ViewMut};
use tessera_core::Result;

use super::norm::VaeNorm;
use crate::loader::Linear;

/// `x + out(softmax(q kᵀ/√C) v)`, `q|k|v = qkv(norm(x))`. Each family loads its products from
/// its own layout (diffusers' `to_q`/`to_k`/`to_v` + `to_out.0`, Wan's 1×1 `to_qkv` + `proj`).
pub struct MidAttention<B: Backend, N> {
    /// The channels: the head's width.
    pub c: usize,
    pub norm: N,
    /// `q | k | v` with their biases, `[3C, C]`.
    pub qkv: Linear<B>,
    pub out: Linear<B>,
}

impl<B: Backend, N: VaeNorm<B>> MidAttention<B, N> {
    /// `x ← x + out(softmax(q kᵀ/√C) v)` over the pixels of the `hw` image in the f32 stream
    /// `x`; `n` (`[px, C]`) and `qkv` (`[px, 3C]`) are compute-type scratch: the products' and
    /// the attention's operands.
    pub fn forward(
        &self,
        be: &B,
        x: &mut B::Buf,
        (n, qkv_buf): (&mut B::Buf, &mut B::Buf),
        hw: (usize, usize),
    ) -> Result<()> {
        let (px, c) = (hw.0 * hw.1, self.c);
        self.norm
            .norm(be, View::new(&*x, px, c), None, ViewMut::new(n, px, c))?;
        be.matmul(
            View::new(&*n, px, c),
            &self.qkv.w,
            ViewMut::new(qkv_buf, px, 3 * c),
            &self.qkv.epilogue(),
        )?;
        let layout = QkvLayout {
            heads_q: 1,
            heads_kv: 1,
            head_dim: c,
        };
        let spec = AttnSpec::new(layout, (c as f32).powf(-0.5), Mask::Full);
        let segs = be.segments(&[px])?;
        let qkv = View::new(&*qkv_buf, px, 3 * c);
        be.attention(
            qkv.cols(0, c),
            qkv.cols(c, c),
            qkv.cols(2 * c, c),
            ViewMut::new(n, px, c),
            &spec,
            &segs,
        )?;
        // x += out(a) + bias, folded into the product.
        be.matmul(
            View::new(&*n, px, c),
            &self.out.w,
            ViewMut::new(x, px, c),
            &self.out.epilogue().accumulate(),
        )
    }
}
