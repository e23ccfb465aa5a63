//! `norm` and `residual`: row norms (RMS or layer, affine or not, modulated or not) and the fused
//! residual step with the next sub-block's norm after it.

use tessera_backend::op::{AfterOp, NormOp, ResidualOp};
use tessera_backend::{Activation, After, Backend, NormKind, Op, Residual, Role, RowNorm};

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, stream_rows};

/// The shape of a [`RowNorm`]: which statistic, which parameters, and its eps.
#[derive(Clone, Copy, Debug)]
pub struct NormSpec {
    kind: NormKind,
    weight: bool,
    bias: bool,
    modulated: bool,
    act: Option<Activation>,
    eps: f32,
}

/// RMSNorm with a weight, eps 1e-6.
pub fn rms() -> NormSpec {
    NormSpec {
        weight: true,
        ..plain(NormKind::Rms)
    }
}

/// `nn.LayerNorm` with weight and bias, eps 1e-6.
pub fn layer() -> NormSpec {
    NormSpec {
        weight: true,
        bias: true,
        ..plain(NormKind::Layer)
    }
}

/// A norm of `kind` without affine parameters, eps 1e-6.
pub fn plain(kind: NormKind) -> NormSpec {
    NormSpec {
        kind,
        weight: false,
        bias: false,
        modulated: false,
        act: None,
        eps: 1e-6,
    }
}

impl NormSpec {
    pub fn eps(self, eps: f32) -> Self {
        NormSpec { eps, ..self }
    }
    /// Followed by `(1 + s)` for one broadcast row of adaLN scales `s`.
    pub fn modulated(self) -> Self {
        NormSpec {
            modulated: true,
            ..self
        }
    }
    /// Followed by `act` (only a plain norm takes it, not a residual step's).
    pub fn activated(self, act: Activation) -> Self {
        NormSpec {
            act: Some(act),
            ..self
        }
    }
    fn op(&self) -> NormOp {
        NormOp {
            kind: self.kind,
            weight: self.weight,
            bias: self.bias,
            modulated: self.modulated,
            act: self.act,
        }
    }
}

/// A norm's parameters on a backend: weight around 1, bias, modulation row.
struct NormParams<B: Backend> {
    spec: NormSpec,
    weight: Option<B::Vector>,
    bias: Option<B::Vector>,
    scale: Option<Guarded<B>>,
}

impl<B: Backend> NormParams<B> {
    fn new(be: &B, spec: NormSpec, cols: usize, rng: &mut Rng) -> Res<Self> {
        let weight = match spec.weight {
            true => Some(be.vector_f32(&rng.around(cols, 1.0, 0.3))?),
            false => None,
        };
        let bias = match spec.bias {
            true => Some(be.vector_f32(&rng.vec(cols, 0.5))?),
            false => None,
        };
        let scale = match spec.modulated {
            true => Some(stream_rows(be, rng, 1, cols, 0.5)?),
            false => None,
        };
        Ok(NormParams {
            spec,
            weight,
            bias,
            scale,
        })
    }

    fn row_norm(&self) -> RowNorm<'_, B> {
        RowNorm {
            kind: self.spec.kind,
            weight: self.weight.as_ref(),
            bias: self.bias.as_ref(),
            eps: self.spec.eps,
            scale: self.scale.as_ref().map(Guarded::view),
            act: self.spec.act,
        }
    }
}

/// `out = N(x)` over `rows × cols`.
#[derive(Clone, Debug)]
pub struct NormCase {
    rows: usize,
    cols: usize,
    from: Role,
    spec: NormSpec,
}

/// `spec` from a `Compute` buffer into a `Compute` buffer.
pub fn norm(rows: usize, cols: usize, spec: NormSpec) -> NormCase {
    NormCase {
        rows,
        cols,
        from: Role::Compute,
        spec,
    }
}

impl NormCase {
    /// Read `x` from a buffer of this role (`Stream`: the f32 residual stream).
    pub fn from(self, from: Role) -> Self {
        NormCase { from, ..self }
    }
}

impl OpCase for NormCase {
    fn name(&self) -> String {
        let NormCase { rows, cols, .. } = *self;
        let eps = self.spec.eps;
        format!(
            "{} eps {eps:e} {rows}×{cols} {:?} → Compute",
            self.op(),
            self.from
        )
    }

    fn op(&self) -> Op {
        Op::Norm(self.spec.op())
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let NormCase { rows, cols, .. } = *self;
        let x = Guarded::drawn(be, self.from, Layout::padded(rows, cols, 8, 0), rng, 3.0)?;
        let params = NormParams::new(be, self.spec, cols, rng)?;
        let mut out = Guarded::empty(be, Role::Compute, Layout::padded(rows, cols, 0, 8))?;
        be.norm(x.view(), &params.row_norm(), out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// What a residual step writes besides the stream.
#[derive(Clone, Copy, Debug)]
enum Then {
    Nothing,
    Norm(NormSpec),
    Copy,
}

/// `h = (h + g ⊙ post(y)) · scale` over `rows × cols`, then [`Then`].
#[derive(Clone, Debug)]
pub struct ResidualCase {
    rows: usize,
    cols: usize,
    post: Option<NormSpec>,
    gate: bool,
    scale: f32,
    then: Then,
}

/// The sandwich-norm step of Gemma blocks: `h = (h + rms(y) · w) · 0.8`, nothing after.
pub fn residual(rows: usize, cols: usize) -> ResidualCase {
    ResidualCase {
        rows,
        cols,
        post: Some(rms()),
        gate: false,
        scale: 0.8,
        then: Then::Nothing,
    }
}

impl ResidualCase {
    /// `h += y`: no post-norm, scale 1.
    pub fn plain(self) -> Self {
        ResidualCase {
            post: None,
            scale: 1.0,
            ..self
        }
    }
    pub fn post(self, post: NormSpec) -> Self {
        ResidualCase {
            post: Some(post),
            ..self
        }
    }
    /// The updated stream times `scale`.
    pub fn scale(self, scale: f32) -> Self {
        ResidualCase { scale, ..self }
    }
    /// The branch times `tanh(g)` for one broadcast gate row `g`.
    pub fn tanh_gate(self) -> Self {
        ResidualCase { gate: true, ..self }
    }
    /// Then the next sub-block's pre-norm of `h` into a `Compute` buffer.
    pub fn then_norm(self, next: NormSpec) -> Self {
        ResidualCase {
            then: Then::Norm(next),
            ..self
        }
    }
    /// Then a copy of `h` into a `Compute` buffer.
    pub fn then_copy(self) -> Self {
        ResidualCase {
            then: Then::Copy,
            ..self
        }
    }
}

impl ResidualCase {
    /// The norm after the step, if any.
    fn next(&self) -> Option<NormSpec> {
        match self.then {
            Then::Norm(n) => Some(n),
            _ => None,
        }
    }
}

impl OpCase for ResidualCase {
    fn name(&self) -> String {
        let ResidualCase { rows, cols, .. } = *self;
        let eps: Vec<f32> = self
            .post
            .into_iter()
            .chain(self.next())
            .map(|n| n.eps)
            .collect();
        format!(
            "{} eps {eps:?} {rows}×{cols}, scale {}",
            self.op(),
            self.scale
        )
    }

    fn op(&self) -> Op {
        Op::Residual(ResidualOp {
            post: self.post.map(|p| p.op()),
            gate: self.gate,
            after: match self.then {
                Then::Nothing => AfterOp::Nothing,
                Then::Norm(n) => AfterOp::Norm(n.op()),
                Then::Copy => AfterOp::Copy,
            },
        })
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let ResidualCase { rows, cols, .. } = *self;
        let y = Guarded::drawn(
            be,
            Role::Compute,
            Layout::padded(rows, cols, 0, 8),
            rng,
            3.0,
        )?;
        let at = Layout::padded(rows, cols, 8, 8);
        let mut h = Guarded::drawn(be, Role::Stream, at, rng, 2.0)?;
        let post = match self.post {
            Some(p) => Some(NormParams::new(be, p, cols, rng)?),
            None => None,
        };
        let gate = match self.gate {
            true => Some(stream_rows(be, rng, 1, cols, 2.0)?),
            false => None,
        };
        let next = match self.next() {
            Some(n) => Some(NormParams::new(be, n, cols, rng)?),
            None => None,
        };
        let mut out = Guarded::empty(be, Role::Compute, Layout::padded(rows, cols, 8, 0))?;
        let res = Residual {
            post: post.as_ref().map(NormParams::row_norm),
            tanh_gate: gate.as_ref().map(Guarded::view),
            scale: self.scale,
        };
        let after = match (&self.then, &next) {
            (Then::Norm(_), Some(n)) => After::Norm(n.row_norm(), out.view_mut()),
            (Then::Copy, _) => After::Copy(out.view_mut()),
            _ => After::Nothing,
        };
        be.residual(h.view_mut(), y.view(), &res, after)?;
        let mut outputs = vec![h.read(be, "h")?];
        if !matches!(self.then, Then::Nothing) {
            outputs.push(out.read(be, "after")?);
        }
        Ok(outputs)
    }
}
