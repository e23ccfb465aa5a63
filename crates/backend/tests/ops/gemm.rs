//! `matmul`: `out = ep(x · wᵀ)`, with every epilogue of the op set, on dense weights, on FP8
//! e4m3 weights (per-tensor or per-row scales) and on GGUF block-format weights (Q8_0, Q4_0,
//! Q4_K, Q6_K; one format, or two stacked parts in two formats as LFM2's Q4_K_M files stack
//! q|k|v). A block-format case's weights are the drawn ones quantized as a GGUF writer does
//! (`tessera_core::gguf::quantize`), and its reference is the CPU's product on those bytes, which
//! decodes them bit-exactly; both precisions are judged by the strict tolerance.
//!
//! FP8 cases under bf16 are judged by their floor: a float64 run that keeps only the roundings a
//! CUDA FP8 product must make — the weights' codes as stored, the activations rounded to e4m3
//! with one scale `amax / 448` for the whole product, and a bf16 output rounded once — against
//! the exact product on the decoded weights (what the CPU reference computes). The device may be
//! at most 1.5× as far from the reference as the floor is (2.25× in NMSE, a squared distance);
//! f32 accumulation order and the epilogue's f32 arithmetic are all it adds.

use std::borrow::Cow;
use std::path::Path;

use tessera_backend::op::{GateOp, MatmulOp};
use tessera_backend::{Activation, Epilogue, Gate, Op, Precision, Role};
use tessera_core::fp8;
use tessera_core::{DType, Scale, Tensor};

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, Tol, measure};

/// How an FP8 case's weights are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8 {
    /// One scale for the tensor (ComfyUI's scaled FP8 files).
    Tensor,
    /// One per row (`--quantize fp8`, per-channel files).
    Rows,
    /// Two stacked parts of a per-tensor file, each with its own scale (gate|up, q|k|v).
    Parts,
}

impl Fp8 {
    /// Rows of the first part (`Parts`): half, so 256 rows split 128|128 (a product per part
    /// on the device) and 1000 split 500|500 (not 16-row parts: one product and the epilogue).
    fn split(n: usize) -> usize {
        n / 2
    }
}

/// How a block-format case stores its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    /// All rows in one format.
    One(DType),
    /// The first `n / 2` rows in one format, the rest in another (stacked parts).
    Parts(DType, DType),
}

impl Blocks {
    /// The format the op names (a stack's first part's, as the backends report it).
    fn first(self) -> DType {
        match self {
            Blocks::One(t) | Blocks::Parts(t, _) => t,
        }
    }

    /// `w [n, k]` quantized to the stored tensors, one per part.
    pub fn tensors(self, w: &[f32], n: usize, k: usize) -> Vec<Tensor<'static>> {
        let tensor = |t: DType, rows: std::ops::Range<usize>| {
            let g = t.ggml().expect("a GGUF block format");
            let row_bytes = t.bytes_for(k).expect("rows of whole blocks");
            let mut bytes = vec![0u8; rows.len() * row_bytes];
            for (r, out) in rows.clone().zip(bytes.chunks_mut(row_bytes)) {
                tessera_core::gguf::quantize(g, &w[r * k..(r + 1) * k], out).expect("quantized");
            }
            Tensor {
                name: format!("{t} case weight"),
                dtype: t,
                shape: vec![rows.len(), k],
                bytes: Cow::Owned(bytes),
                path: Path::new("block case"),
                scale: None,
            }
        };
        match self {
            Blocks::One(t) => vec![tensor(t, 0..n)],
            Blocks::Parts(a, b) => vec![tensor(a, 0..n / 2), tensor(b, n / 2..n)],
        }
    }
}

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
    fp8: Option<Fp8>,
    blocks: Option<Blocks>,
}

/// A case's inputs as drawn from its seed (bf16-rounded), before any upload.
struct Drawn {
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    gate: Option<Vec<f32>>,
    start: Option<Vec<f32>>,
}

/// FP8 weights as the case stores them: codes `[n, k]` and each row's scale.
struct Fp8Weights {
    codes: Vec<u8>,
    scales: Vec<f32>,
}

impl Fp8Weights {
    /// `w` rounded to e4m3 with one scale (`amax / 448` of the tensor) or one per row.
    fn of(w: &[f32], n: usize, k: usize, kind: Fp8) -> Fp8Weights {
        let scale = |rows: &[f32]| fp8::row_scale(rows).expect("finite weights");
        let scales: Vec<f32> = match kind {
            Fp8::Tensor => vec![scale(w); n],
            Fp8::Rows => w.chunks(k).map(scale).collect(),
            Fp8::Parts => {
                let h = Fp8::split(n);
                let (a, b) = w.split_at(h * k);
                let mut s = vec![scale(a); h];
                s.resize(n, scale(b));
                s
            }
        };
        let mut codes = vec![0u8; n * k];
        for ((row, out), &s) in w.chunks(k).zip(codes.chunks_mut(k)).zip(&scales) {
            fp8::quantize_row(row, s, out);
        }
        Fp8Weights { codes, scales }
    }

    /// The stored tensors (one, or the two stacked parts), scaled as a file would give them.
    fn tensors(&self, kind: Fp8, n: usize, k: usize) -> Vec<Tensor<'static>> {
        let tensor = |rows: std::ops::Range<usize>, scale: Scale| Tensor {
            name: "fp8 case weight".into(),
            dtype: DType::F8_E4M3,
            shape: vec![rows.len(), k],
            bytes: Cow::Owned(self.codes[rows.start * k..rows.end * k].to_vec()),
            path: Path::new("fp8 case"),
            scale: Some(scale),
        };
        match kind {
            Fp8::Tensor => vec![tensor(0..n, Scale::Tensor(self.scales[0]))],
            Fp8::Rows => vec![tensor(0..n, Scale::Rows(self.scales.clone()))],
            Fp8::Parts => {
                let h = Fp8::split(n);
                vec![
                    tensor(0..h, Scale::Tensor(self.scales[0])),
                    tensor(h..n, Scale::Tensor(self.scales[n - 1])),
                ]
            }
        }
    }

    /// The weights as decoded: code × row scale in f32, as the CPU decodes them.
    fn decoded(&self, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.codes.len()];
        for ((c, o), &s) in self
            .codes
            .chunks(k)
            .zip(out.chunks_mut(k))
            .zip(&self.scales)
        {
            fp8::decode_into(c, s, o);
        }
        out
    }
}

/// `v` through `act` in float64.
fn act64(act: Option<Activation>, v: f64) -> f64 {
    match act {
        None => v,
        Some(Activation::Silu) => v / (1.0 + (-v).exp()),
        Some(Activation::GeluTanh) => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
        }
        Some(Activation::Gelu) => 0.5 * v * (1.0 + erf64(v / std::f64::consts::SQRT_2)),
    }
}

/// erf to ~1e-7 (Abramowitz–Stegun 7.1.26), ample beside e4m3's 2⁻⁴ steps.
fn erf64(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let y = 1.0
        - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736) * t
            + 0.254_829_592)
            * t
            * (-x * x).exp();
    y.copysign(x)
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
        fp8: None,
        blocks: None,
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
    /// On FP8 e4m3 weights (the drawn weights rounded with `scales`), stored as a file stores
    /// them.
    pub fn fp8(self, scales: Fp8) -> Self {
        MatmulCase {
            fp8: Some(scales),
            ..self
        }
    }

    /// On GGUF block-format weights (the drawn weights quantized), in one format or two
    /// stacked parts.
    pub fn blocks(self, blocks: Blocks) -> Self {
        MatmulCase {
            blocks: Some(blocks),
            ..self
        }
    }

    /// The inputs, drawn in the order every case has drawn them.
    fn draw(&self, rng: &mut Rng) -> Drawn {
        let MatmulCase { m, k, n, .. } = *self;
        let x = rng.vec(m * k, 1.0);
        let w = rng.vec(n * k, 1.0 / (k as f32).sqrt());
        let bias = self.bias.then(|| rng.vec(n, 0.5));
        let gate = self
            .gate
            .map(|g| rng.vec(if g.broadcast { 1 } else { m } * n, 2.0));
        let start = self.accumulate.then(|| rng.vec(m * n, 1.0));
        Drawn {
            x,
            w,
            bias,
            gate,
            start,
        }
    }

    /// `ep(α · x · wᵀ)` in float64 for `w` the decoded weights, `x` the activations as the
    /// product sees them; rounded to bf16 at the end when `bf16_out`.
    fn reference64(&self, d: &Drawn, x: &[f64], w: &[f32], bf16_out: bool) -> Vec<f32> {
        let MatmulCase { m, k, n, .. } = *self;
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|t| x[i * k + t] * w[j * k + t] as f64).sum();
                let mut v = self.alpha as f64 * dot;
                if let Some(b) = &d.bias {
                    v += b[j] as f64;
                }
                v = act64(self.act, v);
                if let (Some(g), Some(op)) = (&d.gate, self.gate) {
                    let gv = g[if op.broadcast { 0 } else { i } * n + j] as f64;
                    v *= if op.tanh { gv.tanh() } else { gv };
                }
                if let Some(s) = &d.start {
                    v += s[i * n + j] as f64;
                }
                out[i * n + j] = if bf16_out {
                    half::bf16::from_f64(v).to_f32()
                } else {
                    v as f32
                };
            }
        }
        out
    }

    /// An FP8 case's bf16 tolerance: 1.5× the floor's distance from the exact product on the
    /// decoded weights (2.25× its NMSE), the floor computed from the case's own inputs.
    fn fp8_floor_tol(&self, kind: Fp8) -> Tol {
        let MatmulCase { n, k, .. } = *self;
        let d = self.draw(&mut Rng::new(OpCase::seed(self)));
        let w = Fp8Weights::of(&d.w, n, k, kind).decoded(k);
        let exact: Vec<f64> = d.x.iter().map(|&v| v as f64).collect();
        // One activation scale for the product, as the device computes it (amax / 448 in f32).
        let s = fp8::row_scale(&d.x).expect("finite activations");
        let rounded: Vec<f64> =
            d.x.iter()
                .map(|&v| fp8::to_f32(fp8::from_f32(v / s)) as f64 * s as f64)
                .collect();
        let bf16_out = self.out == Role::Compute;
        let want = self.reference64(&d, &exact, &w, false);
        let floor = self.reference64(&d, &rounded, &w, bf16_out);
        let f = measure(&floor, &want).expect("finite floor");
        Tol {
            rel: 1.5 * f.rel,
            nmse: 2.25 * f.nmse,
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
        let scales = match self.fp8 {
            Some(Fp8::Tensor) => ", per-tensor scale",
            Some(Fp8::Rows) => ", per-row scales",
            Some(Fp8::Parts) => ", two parts with their own scales",
            None => "",
        };
        let scales = match self.blocks {
            Some(Blocks::Parts(a, b)) => format!("{scales}, parts {a}|{b}"),
            _ => scales.to_string(),
        };
        format!(
            "{} {m}×{k}×{n} α={alpha} → {:?}{rows}{pad}{scales}",
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
            quantized: self
                .fp8
                .map(|_| DType::F8_E4M3)
                .or(self.blocks.map(Blocks::first)),
        })
    }

    fn tol(&self, p: Precision) -> Tol {
        match (self.fp8, p) {
            (Some(kind), Precision::Bf16) => self.fp8_floor_tol(kind),
            _ => Tol::strict(p),
        }
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let MatmulCase { m, k, n, .. } = *self;
        let d = self.draw(rng);
        // Operands in columns 8.. of wider rows (16-byte-aligned offsets, unless `x_pad` says
        // otherwise) and NaN around.
        let (left, right) = self.x_pad;
        let x = Guarded::new(
            be,
            Role::Compute,
            Layout::padded(m, k, left, right),
            Some(&d.x),
        )?;
        let w = match (self.fp8, self.blocks) {
            (Some(kind), _) => be.matrix(&Fp8Weights::of(&d.w, n, k, kind).tensors(kind, n, k))?,
            (None, Some(b)) => be.matrix(&b.tensors(&d.w, n, k))?,
            (None, None) => be.matrix_f32(&[(&d.w, n)], k)?,
        };
        let bias = match &d.bias {
            Some(b) => Some(be.vector_f32(b)?),
            None => None,
        };
        // f32 rows (adaLN gates), with guard columns after them.
        let gate = match (&d.gate, self.gate) {
            (Some(g), Some(op)) => {
                let rows = if op.broadcast { 1 } else { m };
                let at = Layout::padded(rows, n, 0, 8);
                Some(Guarded::new(be, Role::Stream, at, Some(g))?)
            }
            _ => None,
        };
        let at = Layout::padded(m, n, 8, 8);
        let mut out = Guarded::new(be, self.out, at, d.start.as_deref())?;
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
