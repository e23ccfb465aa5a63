//! The gated MLP: `y = (act(x · W_gateᵀ) ⊙ (x · W_upᵀ)) · W_downᵀ`.

use tessera_backend::{
    Activation, After, Backend, Epilogue, Residual, RowNorm, ThenResidual, View, ViewMut,
};
use tessera_core::Result;

use super::Scratch;
use crate::loader::Loader;

/// Where a checkpoint keeps a gated MLP's three matrices.
#[derive(Clone, Copy, Debug)]
pub struct MlpNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

/// The names transformers uses for Gemma- and Qwen-style decoders.
pub const HF_MLP: MlpNames = MlpNames {
    gate: "mlp.gate_proj.weight",
    up: "mlp.up_proj.weight",
    down: "mlp.down_proj.weight",
};

/// A gated MLP's weights, gate and up stacked in one `[2·inner, width]` matrix so a single
/// product computes both.
pub struct MlpWeights<B: Backend> {
    pub width: usize,
    pub inner: usize,
    pub gate_up: B::Mat,
    pub down: B::Mat,
}

impl<B: Backend> MlpWeights<B> {
    pub fn load(l: &Loader<'_, B>, names: &MlpNames, width: usize, inner: usize) -> Result<Self> {
        Ok(MlpWeights {
            width,
            inner,
            gate_up: l.stacked(&[(names.gate, inner), (names.up, inner)], width)?,
            down: l.matrix(names.down, width, inner)?,
        })
    }

    /// `y = mlp(a)` for `rows` rows (`s.a` in, `s.y` out).
    pub fn forward(&self, be: &B, act: Activation, rows: usize, s: &mut Scratch<B>) -> Result<()> {
        self.gated(be, act, rows, s)?;
        be.matmul(
            View::new(&s.g, rows, self.inner),
            &self.down,
            ViewMut::new(&mut s.y, rows, self.width),
            &Epilogue::default(),
        )
    }

    /// The pre-norm block's MLP half for `rows` rows: `h = h + mlp(s.a)` (`res`), then
    /// `s.a = next(h)` — the down product and the residual step handed to the backend together
    /// ([`Backend::matmul_residual`]; `s.y` is scratch).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_residual(
        &self,
        be: &B,
        act: Activation,
        rows: usize,
        s: &mut Scratch<B>,
        h: ViewMut<'_, B>,
        res: Residual<'_, B>,
        next: RowNorm<'_, B>,
    ) -> Result<()> {
        self.gated(be, act, rows, s)?;
        let d = self.width;
        be.matmul_residual(
            View::new(&s.g, rows, self.inner),
            &self.down,
            ViewMut::new(&mut s.y, rows, d),
            &Epilogue::default(),
            ThenResidual {
                h,
                res,
                after: After::Norm(next, ViewMut::new(&mut s.a, rows, d)),
            },
        )
    }

    /// `s.g = act(s.a · W_gateᵀ) ⊙ (s.a · W_upᵀ)` (`s.gu` scratch).
    fn gated(&self, be: &B, act: Activation, rows: usize, s: &mut Scratch<B>) -> Result<()> {
        be.matmul_gated(
            View::new(&s.a, rows, self.width),
            &self.gate_up,
            ViewMut::new(&mut s.gu, rows, 2 * self.inner),
            act,
            ViewMut::new(&mut s.g, rows, self.inner),
        )
    }
}
