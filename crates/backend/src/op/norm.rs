//! Row normalisations and the residual step that folds a sub-block's output back into the
//! residual stream (with the next sub-block's pre-norm fused after it).

use crate::{Activation, Backend, View, ViewMut};

/// Which statistic a [`RowNorm`] removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormKind {
    /// `x · (mean(x²) + eps)^-½`.
    Rms,
    /// `(x − mean(x)) · (var(x) + eps)^-½`, the biased variance (`nn.LayerNorm`).
    Layer,
}

/// A per-row normalisation with an optional affine weight and bias, an optional adaLN
/// modulation and an optional activation: `act((N(x) · w + b) · (1 + s))`. Statistics are
/// accumulated in at least `f32`.
pub struct RowNorm<'a, B: Backend> {
    pub kind: NormKind,
    /// Per-column weight `[cols]` (`None`: no affine weight).
    pub weight: Option<&'a B::Vector>,
    /// Per-column bias `[cols]` (`None`: none).
    pub bias: Option<&'a B::Vector>,
    pub eps: f32,
    /// One row `[1, cols]` of raw adaLN scales `s`, broadcast over all rows and applied as
    /// `(1 + s)`: the form of DiTs without shift terms. `None`: no modulation.
    pub scale: Option<View<'a, B>>,
    /// Applied to the normalised value before it is stored, where a norm's only reader applies it
    /// anyway (the VAE resnets' `SiLU ∘ norm`): stored once instead of activated on every read.
    /// Only [`Backend::norm`](crate::Backend::norm) takes it; a residual step's norms refuse it.
    pub act: Option<Activation>,
}

impl<B: Backend> Clone for RowNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for RowNorm<'_, B> {}

impl<'a, B: Backend> RowNorm<'a, B> {
    /// RMSNorm with a weight, the most common norm: `x · (mean(x²) + eps)^-½ · w`.
    pub fn rms(weight: &'a B::Vector, eps: f32) -> Self {
        RowNorm {
            kind: NormKind::Rms,
            weight: Some(weight),
            bias: None,
            eps,
            scale: None,
            act: None,
        }
    }

    /// A norm of `kind` without affine parameters.
    pub fn plain(kind: NormKind, eps: f32) -> Self {
        RowNorm {
            kind,
            weight: None,
            bias: None,
            eps,
            scale: None,
            act: None,
        }
    }

    /// `nn.LayerNorm` with its weight and bias.
    pub fn layer(weight: &'a B::Vector, bias: &'a B::Vector, eps: f32) -> Self {
        RowNorm {
            kind: NormKind::Layer,
            weight: Some(weight),
            bias: Some(bias),
            eps,
            scale: None,
            act: None,
        }
    }

    /// The same norm followed by `(1 + scale)`.
    pub fn modulated(self, scale: View<'a, B>) -> Self {
        RowNorm {
            scale: Some(scale),
            ..self
        }
    }

    /// The same norm, modulated when `scale` is given.
    pub fn modulated_by(self, scale: Option<View<'a, B>>) -> Self {
        RowNorm { scale, ..self }
    }

    /// The same norm with `act` applied to its output.
    pub fn activated(self, act: Activation) -> Self {
        RowNorm {
            act: Some(act),
            ..self
        }
    }
}

/// How [`Backend::residual`] folds a branch output `y` into the residual stream `h`:
/// `h = (h + g ⊙ post(y)) · scale`.
pub struct Residual<'a, B: Backend> {
    /// Normalise the branch output first (the "sandwich" post-norm of Gemma and Z-Image blocks);
    /// `None` adds `y` as it is. It cannot be modulated.
    pub post: Option<RowNorm<'a, B>>,
    /// One row `[1, cols]` of raw adaLN gates `g`, broadcast over all rows and applied as
    /// `tanh(g)`. `None`: a gate of 1.
    pub tanh_gate: Option<View<'a, B>>,
    /// Multiplies the updated stream (Gemma 4's per-layer scalar); 1 for most models.
    pub scale: f32,
}

impl<B: Backend> Clone for Residual<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Residual<'_, B> {}

impl<'a, B: Backend> Residual<'a, B> {
    /// `h += y`.
    pub fn plain() -> Self {
        Residual {
            post: None,
            tanh_gate: None,
            scale: 1.0,
        }
    }

    /// `h += post(y)`.
    pub fn post_norm(post: RowNorm<'a, B>) -> Self {
        Residual {
            post: Some(post),
            ..Self::plain()
        }
    }

    /// The same step with its stream scaled by `scale` afterwards.
    pub fn scaled(self, scale: f32) -> Self {
        Residual { scale, ..self }
    }

    /// The same step with the branch gated by `tanh(g)`.
    pub fn tanh_gated(self, gate: Option<View<'a, B>>) -> Self {
        Residual {
            tanh_gate: gate,
            ..self
        }
    }
}

/// The residual step that directly follows a product in a pre-norm block, handed to the product
/// ([`Backend::matmul_residual`]): `h = (h + g ⊙ post(y)) · scale` on
/// the product's rows `y`, then `after` (see [`Backend::residual`]).
pub struct ThenResidual<'a, B: Backend> {
    pub h: ViewMut<'a, B>,
    pub res: Residual<'a, B>,
    pub after: After<'a, B>,
}

/// What [`Backend::residual`] writes besides the updated residual stream.
pub enum After<'a, B: Backend> {
    Nothing,
    /// `out = N(h)`: the next sub-block's (possibly modulated) pre-norm.
    Norm(RowNorm<'a, B>, ViewMut<'a, B>),
    /// `out = h`, in `out`'s element type (the stream as a GEMM input).
    Copy(ViewMut<'a, B>),
}
