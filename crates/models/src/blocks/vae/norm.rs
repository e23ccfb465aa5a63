//! The norms the VAEs put before their convolutions and attention: diffusers' `nn.GroupNorm`
//! (Z-Image) and Wan's `RMS_norm` (Qwen-Image), behind one trait so the resnet and the mid
//! attention are written once.

use tessera_backend::{Activation, Backend, GroupNorm, RowNorm, View, ViewMut};
use tessera_core::Result;

use crate::loader::Loader;

/// A VAE norm over the channels of a channels-last image.
pub trait VaeNorm<B: Backend> {
    /// `out = act(norm(x))`, the activation applied as the norm stores its output.
    fn norm(
        &self,
        be: &B,
        x: View<'_, B>,
        act: Option<Activation>,
        out: ViewMut<'_, B>,
    ) -> Result<()>;
}

/// An `nn.GroupNorm` (weight and bias) with its group count and eps.
pub struct VaeGroupNorm<B: Backend> {
    w: B::Vector,
    b: B::Vector,
    groups: usize,
    eps: f32,
}

impl<B: Backend> VaeGroupNorm<B> {
    /// `{name}.weight` and `{name}.bias`, `[c]` each.
    pub fn load(l: &Loader<'_, B>, name: &str, c: usize, groups: usize, eps: f32) -> Result<Self> {
        Ok(VaeGroupNorm {
            w: l.vector(&format!("{name}.weight"), c)?,
            b: l.vector(&format!("{name}.bias"), c)?,
            groups,
            eps,
        })
    }
}

impl<B: Backend> VaeNorm<B> for VaeGroupNorm<B> {
    fn norm(
        &self,
        be: &B,
        x: View<'_, B>,
        act: Option<Activation>,
        out: ViewMut<'_, B>,
    ) -> Result<()> {
        let spec = GroupNorm {
            groups: self.groups,
            eps: self.eps,
            act,
        };
        be.group_norm(x, &self.w, &self.b, &spec, out)
    }
}

/// The reference's floor on the L2 norm of a pixel's channels (`F.normalize`'s eps).
const NORM_FLOOR: f64 = 1e-12;

/// Wan's `RMS_norm`, `x / max(‖x‖₂, 1e-12) · √C · γ` over each pixel's channels: a row RMS norm
/// with weight γ and `eps = 10⁻²⁴ / C` (the floor squared, over C), which agrees with it to `f32`
/// precision whenever `rms(x) ≫ 10⁻¹²/√C` and gives 0 for an all-zero pixel. No bias. Its
/// activation is stored with it ([`RowNorm::activated`]): each value is activated once rather
/// than on every tap of the convolution that reads it.
pub struct VaeRmsNorm<B: Backend> {
    gamma: B::Vector,
    eps: f32,
}

impl<B: Backend> VaeRmsNorm<B> {
    /// `{name}.gamma`, `[C, 1, 1]` in the attention (`image`), else `[C, 1, 1, 1]`.
    pub fn load(l: &Loader<'_, B>, name: &str, c: usize, image: bool) -> Result<Self> {
        let shape: &[usize] = if image { &[c, 1, 1] } else { &[c, 1, 1, 1] };
        let mut t = l.tensor(&format!("{name}.gamma"), shape)?;
        t.shape = vec![c];
        Ok(VaeRmsNorm {
            gamma: l.backend().vector(&t)?,
            eps: (NORM_FLOOR * NORM_FLOOR / c as f64) as f32,
        })
    }
}

impl<B: Backend> VaeNorm<B> for VaeRmsNorm<B> {
    fn norm(
        &self,
        be: &B,
        x: View<'_, B>,
        act: Option<Activation>,
        out: ViewMut<'_, B>,
    ) -> Result<()> {
        let norm = RowNorm {
            act,
            ..RowNorm::rms(&self.gamma, self.eps)
        };
        be.norm(x, &norm, out)
    }
}
