//! Sub-blocks shared by the transformer models (EmbeddingGemma 2's text and vision towers,
//! Qwen3, the Z-Image DiT), each written once against the backend ops.

use tessera_backend::{Activation, Backend, Epilogue, View, ViewMut};
use tessera_core::Result;

/// The gated MLP: `y = (act(x · W_gateᵀ) ⊙ (x · W_upᵀ)) · W_downᵀ`, with gate and up stacked in
/// one `[2·inner, d]` matrix so a single GEMM computes both.
pub struct GatedMlp<'a, B: Backend> {
    pub gate_up: &'a B::Mat,
    pub down: &'a B::Mat,
    pub inner: usize,
    pub act: Activation,
}

impl<B: Backend> GatedMlp<'_, B> {
    /// `y = mlp(x)` for `x` `[rows, d]`; `gu` (`rows · 2·inner`) and `g` (`rows · inner`) are
    /// scratch buffers from the caller's workspace.
    pub fn forward(
        &self,
        be: &B,
        x: View<'_, B>,
        gu: &mut B::Buf,
        g: &mut B::Buf,
        y: ViewMut<'_, B>,
    ) -> Result<()> {
        let (rows, im) = (x.rows, self.inner);
        be.matmul(
            x,
            self.gate_up,
            ViewMut::new(gu, rows, 2 * im),
            Epilogue::default(),
        )?;
        let both = View::new(gu, rows, 2 * im);
        be.gated(
            both.cols(0, im),
            both.cols(im, im),
            ViewMut::new(g, rows, im),
            self.act,
        )?;
        be.matmul(View::new(g, rows, im), self.down, y, Epilogue::default())
    }
}
