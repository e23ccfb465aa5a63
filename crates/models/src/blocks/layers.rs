//! Whole transformer layers built from the shared attention and MLP blocks: the pre-norm layer
//! of Qwen-style decoders and the sandwich-normed layer of Gemma 4 models. (The Z-Image DiT block
//! modulates the same blocks and shares [`attention_then_mlp`]; it lives with its model.)

use tessera_backend::{Activation, After, Backend, Residual, RowNorm, Segments, View, ViewMut};
use tessera_core::Result;

use super::{AttentionWeights, AttnNames, MlpNames, MlpWeights, Scratch, SelfAttention};
use crate::loader::Loader;
use tessera_backend::QkvLayout;

/// The shapes of one layer, from the config.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub layout: QkvLayout,
    pub width: usize,
    pub mlp: usize,
}

/// A pre-norm layer (Qwen3, LFM2's attention layers):
/// `h += attn(N_in(h))`, `h += mlp(N_post(h))`.
pub struct PreNormLayer<B: Backend> {
    pub attn: AttentionWeights<B>,
    pub mlp: MlpWeights<B>,
    pub input_norm: B::Vector,
    pub post_attn_norm: B::Vector,
}

impl<B: Backend> PreNormLayer<B> {
    /// Load with transformers' names (`input_layernorm`, `post_attention_layernorm`).
    pub fn load(
        l: &Loader<'_, B>,
        attn: &AttnNames,
        mlp: &MlpNames,
        s: LayerShape,
    ) -> Result<Self> {
        Ok(PreNormLayer {
            attn: AttentionWeights::load(l, attn, s.layout, s.width)?,
            mlp: MlpWeights::load(l, mlp, s.width, s.mlp)?,
            input_norm: l.vector("input_layernorm.weight", s.width)?,
            post_attn_norm: l.vector("post_attention_layernorm.weight", s.width)?,
        })
    }

    /// The layer on `rows` rows of the residual stream `h`, with `s.a = N_in(h)` on entry; on
    /// return `s.a = next(h)` when a next norm is given.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        attn: &SelfAttention<'_, B>,
        act: Activation,
        segs: &Segments<B>,
        rows: usize,
        h: &mut B::Buf,
        s: &mut Scratch<B>,
        next: Option<RowNorm<'_, B>>,
    ) -> Result<()> {
        let d = self.attn.width;
        let mid = RowNorm::rms(&self.post_attn_norm, attn.eps);
        let res = Residual::plain();
        attention_then_mlp(be, attn, &res, mid, &self.mlp, act, segs, rows, h, s)?;
        let after = match next {
            Some(n) => After::Norm(n, ViewMut::new(&mut s.a, rows, d)),
            None => After::Nothing,
        };
        be.residual(
            ViewMut::new(h, rows, d),
            View::new(&s.y, rows, d),
            &res,
            after,
        )
    }
}

/// A Gemma sandwich-normed layer: `h += N_post_attn(attn(N_in(h)))`, then the MLP on
/// `N_pre_ff(h)` whose output the caller folds back with `post_ff_norm` (EmbeddingGemma 2's
/// text tower adds its per-layer inputs after it).
pub struct SandwichLayer<B: Backend> {
    pub attn: AttentionWeights<B>,
    pub mlp: MlpWeights<B>,
    pub input_norm: B::Vector,
    pub post_attn_norm: B::Vector,
    pub pre_ff_norm: B::Vector,
    pub post_ff_norm: B::Vector,
}

impl<B: Backend> SandwichLayer<B> {
    /// Load with transformers' Gemma names (`input_layernorm`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    pub fn load(
        l: &Loader<'_, B>,
        attn: &AttnNames,
        mlp: &MlpNames,
        s: LayerShape,
    ) -> Result<Self> {
        let d = s.width;
        Ok(SandwichLayer {
            attn: AttentionWeights::load(l, attn, s.layout, d)?,
            mlp: MlpWeights::load(l, mlp, d, s.mlp)?,
            input_norm: l.vector("input_layernorm.weight", d)?,
            post_attn_norm: l.vector("post_attention_layernorm.weight", d)?,
            pre_ff_norm: l.vector("pre_feedforward_layernorm.weight", d)?,
            post_ff_norm: l.vector("post_feedforward_layernorm.weight", d)?,
        })
    }

    /// Attention and MLP of `rows` packed rows: `s.a = N_in(h)` on entry, `s.y` = the MLP's
    /// output on return (not yet folded into `h`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_and_mlp(
        &self,
        be: &B,
        attn: &SelfAttention<'_, B>,
        act: Activation,
        segs: &Segments<B>,
        rows: usize,
        h: &mut B::Buf,
        s: &mut Scratch<B>,
    ) -> Result<()> {
        let eps = attn.eps;
        let res = Residual::post_norm(RowNorm::rms(&self.post_attn_norm, eps));
        let mid = RowNorm::rms(&self.pre_ff_norm, eps);
        attention_then_mlp(be, attn, &res, mid, &self.mlp, act, segs, rows, h, s)
    }
}

/// The half of a layer both shapes (and the Z-Image DiT block) share: `y = attn(s.a)`,
/// `h = res(h, y)` with `s.a = mid(h)` fused after it, then `s.y = mlp(s.a)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_then_mlp<B: Backend>(
    be: &B,
    attn: &SelfAttention<'_, B>,
    res: &Residual<'_, B>,
    mid: RowNorm<'_, B>,
    mlp: &MlpWeights<B>,
    act: Activation,
    segs: &Segments<B>,
    rows: usize,
    h: &mut B::Buf,
    s: &mut Scratch<B>,
) -> Result<()> {
    let d = attn.w.width;
    attn.forward(be, segs, rows, s)?;
    be.residual(
        ViewMut::new(h, rows, d),
        View::new(&s.y, rows, d),
        res,
        After::Norm(mid, ViewMut::new(&mut s.a, rows, d)),
    )?;
    mlp.forward(be, act, rows, s)
}
