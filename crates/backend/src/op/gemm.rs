//! The matrix product and what it folds into its output: `out = epilogue(x · wᵀ)`.

use tessera_core::{Error, Result};

use crate::{Backend, View, ViewMut};

/// Element-wise activations (GEMM epilogues, `gated`, GroupNorm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `0.5·x·(1 + erf(x/√2))`, the exact GELU (`gelu` in transformers: LFM2-VL's projector).
    Gelu,
    /// `x·σ(x)`.
    Silu,
}

/// A multiplier folded into a product's output, `g ⊙ y`: the adaLN gates of DiT blocks
/// (`x += tanh(g) ⊙ (a · W_oᵀ)`) and per-element gates.
pub struct Gate<'a, B: Backend> {
    /// `[1, n]`, broadcast over every output row, or `[rows, n]`, one row per output row.
    pub values: View<'a, B>,
    /// Multiply by `tanh(g)` rather than `g`.
    pub tanh: bool,
}

impl<B: Backend> Clone for Gate<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Gate<'_, B> {}

impl<B: Backend> Gate<'_, B> {
    /// Whether the gate is one row broadcast over the output's rows.
    pub fn broadcast(&self) -> bool {
        self.values.rows == 1
    }
}

/// What a matrix product does after `x · wᵀ`, in this order:
/// `y = act(alpha · x·wᵀ + bias)`, then `y = gate ⊙ y`, then `out = y` or, with `accumulate`,
/// `out += y` (a residual add into the output).
pub struct Epilogue<'a, B: Backend> {
    pub alpha: f32,
    /// `[n]`, added to every row.
    pub bias: Option<&'a B::Vector>,
    pub act: Option<Activation>,
    pub gate: Option<Gate<'a, B>>,
    pub accumulate: bool,
}

impl<B: Backend> Clone for Epilogue<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Epilogue<'_, B> {}

impl<B: Backend> Default for Epilogue<'_, B> {
    fn default() -> Self {
        Epilogue {
            alpha: 1.0,
            bias: None,
            act: None,
            gate: None,
            accumulate: false,
        }
    }
}

impl<'a, B: Backend> Epilogue<'a, B> {
    /// `out = alpha · x·wᵀ`.
    pub fn scaled(alpha: f32) -> Self {
        Epilogue {
            alpha,
            ..Self::default()
        }
    }

    /// `out = x·wᵀ + bias` (an `nn.Linear`).
    pub fn bias(bias: &'a B::Vector) -> Self {
        Epilogue {
            bias: Some(bias),
            ..Self::default()
        }
    }

    /// The same, followed by `act`.
    pub fn act(self, act: Activation) -> Self {
        Epilogue {
            act: Some(act),
            ..self
        }
    }

    /// The same, times `gate`.
    pub fn gated(self, gate: Gate<'a, B>) -> Self {
        Epilogue {
            gate: Some(gate),
            ..self
        }
    }

    /// The same, added to what `out` holds.
    pub fn accumulate(self) -> Self {
        Epilogue {
            accumulate: true,
            ..self
        }
    }
}

/// Check the shapes of `out = x · wᵀ` for a weight of `w_out` rows of `w_inner`: both backends'
/// products take `x` `[m, w_inner]` and `out` `[m, w_out]`.
pub(crate) fn check_product<B: Backend>(
    x: &View<'_, B>,
    (w_out, w_inner): (usize, usize),
    out: &ViewMut<'_, B>,
) -> Result<()> {
    if x.cols != w_inner || out.rows != x.rows || out.cols != w_out {
        return Err(Error::backend(
            "matmul",
            format!(
                "x {}×{} · wᵀ ({w_out}×{w_inner}) → out {}×{}",
                x.rows, x.cols, out.rows, out.cols
            ),
        ));
    }
    Ok(())
}
