//! `matmul`: `out = ep(x · wᵀ)`, with every epilogue of the op set.

use tessera_backend::op::{GateOp, MatmulOp};
use tessera_backend::{Activation, Epilogue, Gate, Op, Role};

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, stream_rows};

/// `x [m, k] · wᵀ` for `w [n, k]`, times `alpha`, then the epilogue.
#[derive(Clone, Debug)]
pub struct MatmulCase {
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    out: Role,
    bias: bool,
    act: Option<Activation>,
    gate: Option<GateOp>,
    accumulate: bool,
    /// Guard columns left and right of each x row: (8, 8) keeps rows 16-byte aligned in bf16.
    x_pad: (usize, usize),
}

/// A bare product into an f32 output.
pub fn matmul(m: usize, k: usize, n: usize) -> MatmulCase {
    MatmulCase {
        m,
        k,
        n,
        alpha: 1.0,
        out: Role::Stream,
        bias: false,
        act: None,
        gate: None,
        accumulate: false,
        x_pad: (8, 8),
    }
}

impl MatmulCase {
    pub fn alpha(self, alpha: f32) -> Self {
        MatmulCase { alpha, ..self }
    }
    /// Output buffer role (`Stream`: f32; `Compute`: bf16 under bf16).
    pub fn to(self, out: Role) -> Self {
        MatmulCase { out, ..self }
    }
    pub fn bias(self) -> Self {
        MatmulCase { bias: true, ..self }
    }
    pub fn act(self, act: Activation) -> Self {
        MatmulCase {
            act: Some(act),
            ..self
        }
    }
    /// Times one gate row `g`, broadcast over the output rows.
    pub fn gate(self) -> Self {
        self.gated(true, false)
    }
    /// Times `tanh(g)` for one broadcast row `g` (a DiT's adaLN gate).
    pub fn tanh_gate(self) -> Self {
        self.gated(true, true)
    }
    /// Times a gate row per output row.
    pub fn row_gate(self) -> Self {
        self.gated(false, false)
    }
    /// Times `tanh` of a gate row per output row.
    pub fn row_tanh_gate(self) -> Self {
        self.gated(false, true)
    }
    fn gated(self, broadcast: bool, tanh: bool) -> Self {
        MatmulCase {
            gate: Some(GateOp { broadcast, tanh }),
            ..self
        }
    }
    /// x's rows with `left` and `right` guard columns (an odd sum gives an odd row stride, a
    /// left pad that is no multiple of 8 an unaligned first row).
    pub fn x_pad(self, left: usize, right: usize) -> Self {
        MatmulCase {
            x_pad: (left, right),
            ..self
        }
    }
    /// Added to the values the output holds.
    pub fn accumulate(self) -> Self {
        MatmulCase {
            accumulate: true,
            ..self
        }
    }
}

impl OpCase for MatmulCase {
    fn name(&self) -> String {
        let MatmulCase { m, k, n, alpha, .. } = *self;
        let rows = match self.gate {
            Some(g) if !g.broadcast => ", a gate row per output row",
            _ => "",
        };
        let pad = match self.x_pad {
            (8, 8) => String::new(),
            (l, r) => format!(", x row stride {}", l + k + r),
        };
        format!(
            "{} {m}×{k}×{n} α={alpha} → {:?}{rows}{pad}",
            self.op(),
            self.out
        )
    }

    fn op(&self) -> Op {
        Op::Matmul(MatmulOp {
            bias: self.bias,
            act: self.act,
            gate: self.gate,
            accumulate: self.accumulate,
            quantized: None,
        })
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let MatmulCase { m, k, n, .. } = *self;
        // Operands in columns 8.. of wider rows (16-byte-aligned offsets, unless `x_pad` says
        // otherwise) and NaN around.
        let (left, right) = self.x_pad;
        let x = Guarded::drawn(
            be,
            Role::Compute,
            Layout::padded(m, k, left, right),
            rng,
            1.0,
        )?;
        let w = be.matrix_f32(&[(&rng.vec(n * k, 1.0 / (k as f32).sqrt()), n)], k)?;
        let bias = match self.bias {
            true => Some(be.vector_f32(&rng.vec(n, 0.5))?),
            false => None,
        };
        let gate = match self.gate {
            Some(g) => Some(stream_rows(
                be,
                rng,
                if g.broadcast { 1 } else { m },
                n,
                2.0,
            )?),
            None => None,
        };
        let start = self.accumulate.then(|| rng.vec(m * n, 1.0));
        let at = Layout::padded(m, n, 8, 8);
        let mut out = Guarded::new(be, self.out, at, start.as_deref())?;
        let ep = Epilogue {
            alpha: self.alpha,
            bias: bias.as_ref(),
            act: self.act,
            gate: gate.as_ref().zip(self.gate).map(|(g, op)| Gate {
                values: g.view(),
                tanh: op.tanh,
            }),
            accumulate: self.accumulate,
        };
        be.matmul(x.view(), &w, out.view_mut(), &ep)?;
        Ok(vec![out.read(be, "out")?])
    }

    /// At most 64 rows and 1024 outputs: every inner width is still multiplied.
    fn shrunk(&self) -> Self {
        MatmulCase {
            m: self.m.min(64),
            n: self.n.min(1024),
            ..self.clone()
        }
    }
}
