//! Self-attention with fused q|k|v: `y = attention(norm+rope(x · W_qkvᵀ)) · W_oᵀ`.

use tessera_backend::{
    AttnSpec, Backend, Epilogue, QkvLayout, QkvNorm, RopeTable, Segments, View, ViewMut,
};
use tessera_core::Result;

use super::Scratch;
use crate::loader::Loader;

/// Where a checkpoint keeps an attention block's tensors (names under the block's prefix).
#[derive(Clone, Copy, Debug)]
pub struct AttnNames {
    pub qkv: QkvNames,
    pub o: &'static str,
    /// Per-head RMSNorm weights of q and k.
    pub q_norm: &'static str,
    pub k_norm: &'static str,
}

/// q, k and v as three matrices, or one fused `[q|k|v, in]` matrix.
#[derive(Clone, Copy, Debug)]
pub enum QkvNames {
    Separate {
        q: &'static str,
        k: &'static str,
        v: &'static str,
    },
    Fused(&'static str),
}

/// The names transformers uses for Gemma- and Qwen-style decoders.
pub const HF_ATTENTION: AttnNames = AttnNames {
    qkv: QkvNames::Separate {
        q: "self_attn.q_proj.weight",
        k: "self_attn.k_proj.weight",
        v: "self_attn.v_proj.weight",
    },
    o: "self_attn.o_proj.weight",
    q_norm: "self_attn.q_norm.weight",
    k_norm: "self_attn.k_norm.weight",
};

/// An attention block's weights: q|k|v stacked into one matrix, the output projection, and
/// the per-head q and k norm weights.
pub struct AttentionWeights<B: Backend> {
    pub layout: QkvLayout,
    /// Model width (rows of the output projection).
    pub width: usize,
    pub qkv: B::Mat,
    pub o: B::Mat,
    pub q_norm: B::Vector,
    pub k_norm: B::Vector,
}

impl<B: Backend> AttentionWeights<B> {
    /// Load from `names` under `l`, checking every shape against `layout` and `width`.
    pub fn load(
        l: &Loader<'_, B>,
        names: &AttnNames,
        layout: QkvLayout,
        width: usize,
    ) -> Result<Self> {
        let (qc, kc, hd) = (layout.q_cols(), layout.kv_cols(), layout.head_dim);
        let qkv = match names.qkv {
            QkvNames::Separate { q, k, v } => l.stacked(&[(q, qc), (k, kc), (v, kc)], width)?,
            QkvNames::Fused(name) => l.matrix(name, layout.width(), width)?,
        };
        Ok(AttentionWeights {
            layout,
            width,
            qkv,
            o: l.matrix(names.o, width, qc)?,
            q_norm: l.vector(names.q_norm, hd)?,
            k_norm: l.vector(names.k_norm, hd)?,
        })
    }
}

/// One call of an attention block: its weights and what this pass adds (norm epsilon, whether v
/// is normed too, the RoPE table and positions, the attention's mask and keys).
pub struct SelfAttention<'a, B: Backend> {
    pub w: &'a AttentionWeights<B>,
    /// Also RMS-norm every v head, without a weight (Gemma 4).
    pub v_norm: bool,
    pub eps: f32,
    pub rope: Option<(&'a RopeTable<B>, &'a B::Buf)>,
    pub spec: AttnSpec<'a, B>,
}

impl<B: Backend> SelfAttention<'_, B> {
    /// `y = attn(a)` for the `rows` packed rows of `segs` (`s.a` in, `s.y` out).
    pub fn forward(
        &self,
        be: &B,
        segs: &Segments<B>,
        rows: usize,
        s: &mut Scratch<B>,
    ) -> Result<()> {
        let lay = self.w.layout;
        let (qc, kc, width, d) = (lay.q_cols(), lay.kv_cols(), lay.width(), self.w.width);
        be.matmul(
            View::new(&s.a, rows, d),
            &self.w.qkv,
            ViewMut::new(&mut s.qkv, rows, width),
            &Epilogue::default(),
        )?;
        be.qkv_norm_rope(
            ViewMut::new(&mut s.qkv, rows, width),
            &QkvNorm {
                layout: lay,
                qk_norm: true,
                q_weight: Some(&self.w.q_norm),
                k_weight: Some(&self.w.k_norm),
                v_norm: self.v_norm,
                eps: self.eps,
            },
            self.rope,
        )?;
        let all = View::new(&s.qkv, rows, width);
        be.attention(
            all.cols(0, qc),
            all.cols(qc, kc),
            all.cols(qc + kc, kc),
            ViewMut::new(&mut s.attn, rows, qc),
            &self.spec,
            segs,
        )?;
        be.matmul(
            View::new(&s.attn, rows, qc),
            &self.w.o,
            ViewMut::new(&mut s.y, rows, d),
            &Epilogue::default(),
        )
    }
}
