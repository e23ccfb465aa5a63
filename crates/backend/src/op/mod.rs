//! The op set: the descriptors each op of [`Backend`](crate::Backend) takes, grouped by family,
//! and [`Op`], an op call reduced to what decides whether a backend can run it.
//!
//! Ops are defined by capability, not by model: one matrix product whose epilogue covers scale,
//! bias, activation, gating and a residual add; one row norm (RMS or layer, with or without
//! weight and bias, with or without modulation); one residual step; one attention over packed
//! query segments and key ranges with a mask.

mod attention;
mod gemm;
mod image;
mod norm;
mod rope;
mod short_conv;

pub use attention::{
    AttnSpec, CacheWrite, KvRanges, Mask, MaskKind, QkvLayout, QkvNorm, Run, Segments,
    block_causal_limits, offsets_of,
};
pub(crate) use gemm::check_product;
pub use gemm::{Activation, Epilogue, Gate};
pub use image::{AvgDown, Conv2d, DupUp, Grids, GroupNorm};
pub use norm::{After, NormKind, Residual, RowNorm, ThenResidual};
pub use rope::{RopeStyle, RopeTable};
pub use short_conv::{ConvSeq, ShortConv};

use crate::Backend;
use tessera_core::DType;

/// An op call as far as a backend's support depends on it.
///
/// Each model family lists the ops its configuration calls, so a device that cannot run one of
/// them declines before the model loads, with the reason ([`Backend::supports`]). Every op also
/// checks its own call through the same `supports` on entry, so what a device promises up front
/// and what it does mid-forward cannot disagree.
///
/// [`Backend::supports`]: crate::Backend::supports
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Embed,
    Cast,
    Matmul(MatmulOp),
    Norm(NormOp),
    Residual(ResidualOp),
    QkvNormRope {
        head_dim: usize,
        rope: Option<RopeStyle>,
        /// q and k are normed (false: rotated only).
        qk_norm: bool,
    },
    Attention(AttentionOp),
    Gated(Activation),
    SegmentMean,
    AddPositions2d,
    AvgPool2d,
    ScatterRows,
    Conv2d {
        kernel: usize,
        upsample: bool,
        /// Stride 2 over the input padded at the bottom and right ([`crate::Conv2d`]).
        downsample: bool,
        /// The activation applied to the input as it is read.
        act: Option<Activation>,
    },
    DupUp,
    AvgDown,
    GroupNorm {
        act: Option<Activation>,
    },
    ShortConv {
        kernel: usize,
        bias: bool,
    },
    ArgmaxRows,
}

/// What a matrix product's epilogue asks for, and the format its weights are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MatmulOp {
    pub bias: bool,
    pub act: Option<Activation>,
    pub gate: Option<GateOp>,
    pub accumulate: bool,
    /// The block format of the weights (`Q8_0`, `Q4_K`, …), or `None` for dense weights in
    /// the backend's compute dtype.
    pub quantized: Option<DType>,
}

impl Op {
    /// The same op with a product's weights in block format `q` (what `--quantize` makes of
    /// every product weight, so a device can decline before loading); other ops unchanged.
    pub fn with_weights(self, q: Option<DType>) -> Op {
        match self {
            Op::Matmul(m) => Op::Matmul(MatmulOp { quantized: q, ..m }),
            op => op,
        }
    }
}

/// A product's gate: one broadcast row or a row per output row, `g` or `tanh(g)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GateOp {
    pub broadcast: bool,
    pub tanh: bool,
}

/// A row norm's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormOp {
    pub kind: NormKind,
    pub weight: bool,
    pub bias: bool,
    pub modulated: bool,
    /// The activation applied to its output ([`RowNorm::act`]).
    pub act: Option<Activation>,
}

impl NormOp {
    /// An RMSNorm with a weight, no bias and no modulation: the pre-norm of most transformers.
    pub const RMS: NormOp = NormOp {
        kind: NormKind::Rms,
        weight: true,
        bias: false,
        modulated: false,
        act: None,
    };
}

/// A residual step's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResidualOp {
    pub post: Option<NormOp>,
    pub gate: bool,
    pub after: AfterOp,
}

/// What a residual step writes besides the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AfterOp {
    Nothing,
    Norm(NormOp),
    Copy,
}

/// An attention call's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionOp {
    pub head_dim: usize,
    pub mask: MaskKind,
    /// Keys from key ranges (a cache) rather than the query rows themselves.
    pub cached: bool,
}

/// Declares [`OpKind`] and its list from one list of names, so the list cannot miss a kind.
macro_rules! op_kinds {
    ($($kind:ident => $name:literal),* $(,)?) => {
        /// The ops of [`Backend`](crate::Backend), one per trait method that computes something.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum OpKind {
            $($kind),*
        }

        impl OpKind {
            /// Every op kind.
            pub const ALL: &'static [OpKind] = &[$(OpKind::$kind),*];

            /// The op's method name.
            pub fn name(self) -> &'static str {
                match self {
                    $(OpKind::$kind => $name),*
                }
            }
        }
    };
}

op_kinds! {
    Embed => "embed",
    Cast => "cast",
    Matmul => "matmul",
    Norm => "norm",
    Residual => "residual",
    QkvNormRope => "qkv_norm_rope",
    Attention => "attention",
    Gated => "gated",
    SegmentMean => "segment_mean",
    AddPositions2d => "add_positions_2d",
    AvgPool2d => "avg_pool2d",
    ScatterRows => "scatter_rows",
    Conv2d => "conv2d",
    DupUp => "dup_up",
    AvgDown => "avg_down",
    GroupNorm => "group_norm",
    ShortConv => "short_conv",
    ArgmaxRows => "argmax_rows",
}

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Embed => OpKind::Embed,
            Op::Cast => OpKind::Cast,
            Op::Matmul(_) => OpKind::Matmul,
            Op::Norm(_) => OpKind::Norm,
            Op::Residual(_) => OpKind::Residual,
            Op::QkvNormRope { .. } => OpKind::QkvNormRope,
            Op::Attention(_) => OpKind::Attention,
            Op::Gated(_) => OpKind::Gated,
            Op::SegmentMean => OpKind::SegmentMean,
            Op::AddPositions2d => OpKind::AddPositions2d,
            Op::AvgPool2d => OpKind::AvgPool2d,
            Op::ScatterRows => OpKind::ScatterRows,
            Op::Conv2d { .. } => OpKind::Conv2d,
            Op::DupUp => OpKind::DupUp,
            Op::AvgDown => OpKind::AvgDown,
            Op::GroupNorm { .. } => OpKind::GroupNorm,
            Op::ShortConv { .. } => OpKind::ShortConv,
            Op::ArgmaxRows => OpKind::ArgmaxRows,
        }
    }
}

impl std::fmt::Display for Op {
    /// The op and the details that matter for support, e.g. `norm (layer, bias, modulated)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.kind().name();
        let norm = |n: &NormOp| {
            let mut s = match n.kind {
                NormKind::Rms => "rms".to_string(),
                NormKind::Layer => "layer".to_string(),
            };
            for (on, what) in [
                (n.weight, "weight"),
                (n.bias, "bias"),
                (n.modulated, "modulated"),
            ] {
                if on {
                    s.push_str(", ");
                    s.push_str(what);
                }
            }
            if let Some(a) = n.act {
                s.push_str(&format!(", then {a:?}"));
            }
            s
        };
        match self {
            Op::Matmul(m) => {
                let mut parts = Vec::new();
                if m.bias {
                    parts.push("bias".to_string());
                }
                if let Some(a) = m.act {
                    parts.push(format!("{a:?}"));
                }
                if let Some(g) = m.gate {
                    parts.push(if g.tanh { "tanh gate" } else { "gate" }.to_string());
                }
                if m.accumulate {
                    parts.push("accumulate".to_string());
                }
                if let Some(q) = m.quantized {
                    parts.push(format!("{q} weights"));
                }
                if parts.is_empty() {
                    write!(f, "{name}")
                } else {
                    write!(f, "{name} ({})", parts.join(", "))
                }
            }
            Op::Norm(n) => write!(f, "{name} ({})", norm(n)),
            Op::Residual(r) => {
                let post = r.post.as_ref().map_or("none".to_string(), norm);
                let after = match &r.after {
                    AfterOp::Nothing => "nothing".to_string(),
                    AfterOp::Norm(n) => format!("norm ({})", norm(n)),
                    AfterOp::Copy => "copy".to_string(),
                };
                let gate = if r.gate { ", tanh gate" } else { "" };
                write!(f, "{name} (post-norm: {post}{gate}; then {after})")
            }
            Op::QkvNormRope {
                head_dim,
                rope,
                qk_norm,
            } => {
                let norm = if *qk_norm { "" } else { ", no q/k norm" };
                write!(f, "{name} (head_dim {head_dim}, rope {rope:?}{norm})")
            }
            Op::Attention(a) => write!(
                f,
                "{name} (head_dim {}, {:?} mask{})",
                a.head_dim,
                a.mask,
                if a.cached { ", key ranges" } else { "" }
            ),
            Op::Gated(a) => write!(f, "{name} ({a:?})"),
            Op::Conv2d {
                kernel,
                upsample,
                downsample,
                act,
            } => write!(
                f,
                "{name} ({kernel}×{kernel}{}{})",
                if *upsample {
                    ", 2× upsampled input"
                } else if *downsample {
                    ", stride 2"
                } else {
                    ""
                },
                act.map_or(String::new(), |a| format!(", of {a:?}(input)"))
            ),
            Op::GroupNorm { act: Some(a) } => write!(f, "{name} (then {a:?})"),
            Op::ShortConv { kernel, bias } => write!(
                f,
                "{name} ({kernel} taps{})",
                if *bias { ", bias" } else { "" }
            ),
            _ => write!(f, "{name}"),
        }
    }
}

impl<B: Backend> Epilogue<'_, B> {
    /// This epilogue as an [`Op`], on dense weights.
    pub fn op(&self) -> Op {
        Op::Matmul(MatmulOp {
            quantized: None,
            bias: self.bias.is_some(),
            act: self.act,
            gate: self.gate.map(|g| GateOp {
                broadcast: g.broadcast(),
                tanh: g.tanh,
            }),
            accumulate: self.accumulate,
        })
    }
}

impl<B: Backend> RowNorm<'_, B> {
    pub fn shape(&self) -> NormOp {
        NormOp {
            kind: self.kind,
            weight: self.weight.is_some(),
            bias: self.bias.is_some(),
            modulated: self.scale.is_some(),
            act: self.act,
        }
    }
}

impl<B: Backend> Residual<'_, B> {
    /// This step followed by `after`, as an [`Op`].
    pub fn op(&self, after: &After<'_, B>) -> Op {
        Op::Residual(ResidualOp {
            post: self.post.as_ref().map(RowNorm::shape),
            gate: self.tanh_gate.is_some(),
            after: match after {
                After::Nothing => AfterOp::Nothing,
                After::Norm(n, _) => AfterOp::Norm(n.shape()),
                After::Copy(_) => AfterOp::Copy,
            },
        })
    }
}

impl crate::Conv2d {
    /// This convolution as an [`Op`].
    pub fn op(&self) -> Op {
        Op::Conv2d {
            kernel: self.kernel,
            upsample: self.upsample,
            downsample: self.downsample,
            act: self.act,
        }
    }
}

impl<B: Backend> ShortConv<'_, B> {
    pub fn op(&self) -> Op {
        Op::ShortConv {
            kernel: self.kernel,
            bias: self.bias.is_some(),
        }
    }
}

impl<B: Backend> AttnSpec<'_, B> {
    pub fn op(&self) -> Op {
        Op::Attention(AttentionOp {
            head_dim: self.head_dim,
            mask: self.mask.kind(),
            cached: self.kv.is_some(),
        })
    }
}
