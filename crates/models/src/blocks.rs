//! Sub-blocks shared by the transformer models (EmbeddingGemma 2's text and vision towers,
//! Qwen3, the Z-Image DiT), each written once against the backend ops.

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Epilogue, QkvLayout, RopeTable, Segments, View, ViewMut,
};
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

/// Self-attention with fused q|k|v: `y = attention(norm+rope(x · W_qkvᵀ)) · W_oᵀ`, q/k/v
/// normed per head (q and k with weights, v weightless when `v_norm`), RoPE on q and k.
pub struct SelfAttention<'a, B: Backend> {
    pub qkv: &'a B::Mat,
    pub o: &'a B::Mat,
    pub layout: QkvLayout,
    pub q_norm: Option<&'a B::Vector>,
    pub k_norm: Option<&'a B::Vector>,
    pub v_norm: bool,
    pub eps: f32,
    /// The RoPE table and the per-row positions it is indexed by.
    pub rope: Option<(&'a RopeTable<B>, &'a B::Buf)>,
    pub spec: AttnSpec,
}

impl<B: Backend> SelfAttention<'_, B> {
    /// `y = attn(x)` for `x` `[rows, d]` packed into `segs`; `qkv` (`rows · layout.width()`) and
    /// `attn` (`rows · q columns`) are scratch buffers from the caller's workspace.
    pub fn forward(
        &self,
        be: &B,
        x: View<'_, B>,
        segs: &Segments<B>,
        qkv: &mut B::Buf,
        attn: &mut B::Buf,
        y: ViewMut<'_, B>,
    ) -> Result<()> {
        let (rows, lay) = (x.rows, self.layout);
        let (qc, kc, width) = (lay.q_cols(), lay.kv_cols(), lay.width());
        be.matmul(
            x,
            self.qkv,
            ViewMut::new(qkv, rows, width),
            Epilogue::default(),
        )?;
        be.qkv_norm_rope(
            ViewMut::new(qkv, rows, width),
            lay,
            self.q_norm,
            self.k_norm,
            self.v_norm,
            self.eps,
            self.rope,
        )?;
        let all = View::new(qkv, rows, width);
        be.attention(
            all.cols(0, qc),
            all.cols(qc, kc),
            all.cols(qc + kc, kc),
            ViewMut::new(attn, rows, qc),
            &self.spec,
            segs,
        )?;
        be.matmul(View::new(attn, rows, qc), self.o, y, Epilogue::default())
    }
}

/// The buffers one transformer layer works in, each `rows × width` unless noted: the f32
/// residual stream `h`, the normed sub-block input `a`, the sub-block output `y`, and the
/// attention (`qkv`, `attn`) and MLP (`gu`, `g`) scratch sized as those blocks ask.
pub struct LayerBuffers<'w, B: Backend> {
    pub h: &'w mut B::Buf,
    pub a: &'w mut B::Buf,
    pub y: &'w mut B::Buf,
    pub qkv: &'w mut B::Buf,
    pub attn: &'w mut B::Buf,
    pub gu: &'w mut B::Buf,
    pub g: &'w mut B::Buf,
}

/// A Gemma sandwich-normed layer up to its MLP output, shared by EmbeddingGemma 2's text and
/// vision towers: `h += N_post_attn(attn(a))`, `a = N_pre_ff(h)`, `y = mlp(a)`. What folds `y`
/// back into `h` differs between the towers (the text tower's per-layer inputs follow it), so the
/// caller does that step.
pub struct SandwichLayer<'a, B: Backend> {
    pub attn: SelfAttention<'a, B>,
    pub post_attn_norm: &'a B::Vector,
    pub pre_ff_norm: &'a B::Vector,
    pub mlp: GatedMlp<'a, B>,
}

impl<B: Backend> SandwichLayer<'_, B> {
    /// Attention and MLP of `rows` packed rows of `width`; `a` holds the layer's normed input on
    /// entry, `y` the MLP output on return.
    pub fn attention_and_mlp(
        &self,
        be: &B,
        segs: &Segments<B>,
        (rows, width): (usize, usize),
        ws: LayerBuffers<'_, B>,
    ) -> Result<()> {
        self.attn.forward(
            be,
            View::new(ws.a, rows, width),
            segs,
            ws.qkv,
            ws.attn,
            ViewMut::new(ws.y, rows, width),
        )?;
        be.residual_norm(
            ViewMut::new(ws.h, rows, width),
            View::new(ws.y, rows, width),
            Some(self.post_attn_norm),
            1.0,
            After::Norm(self.pre_ff_norm, ViewMut::new(ws.a, rows, width)),
            self.attn.eps,
        )?;
        self.mlp.forward(
            be,
            View::new(ws.a, rows, width),
            ws.gu,
            ws.g,
            ViewMut::new(ws.y, rows, width),
        )
    }
}
