//! The ops an EmbeddingGemma 2 forward calls, from its config alone: what a device must run
//! before the model is loaded onto it.

use tessera_backend::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use tessera_backend::{Activation, Op, RopeStyle};

use super::Config;
use super::config::LayerType;

/// Every op a text, image or mixed pass of a model with `config` calls.
pub fn ops(config: &Config) -> Vec<Op> {
    let sandwich = |after| {
        Op::Residual(ResidualOp {
            post: Some(NormOp::RMS),
            gate: false,
            after,
        })
    };
    let mut ops = vec![
        Op::Embed,
        Op::Cast,
        Op::Matmul(MatmulOp::default()),
        Op::Norm(NormOp::RMS),
        Op::Gated(Activation::GeluTanh),
        Op::SegmentMean,
        sandwich(AfterOp::Norm(NormOp::RMS)),
        sandwich(AfterOp::Copy),
    ];
    for l in &config.text.layers {
        ops.push(Op::QkvNormRope {
            head_dim: l.head_dim,
            rope: Some(RopeStyle::SplitHalf),
            qk_norm: true,
        });
        ops.push(Op::Attention(AttentionOp {
            head_dim: l.head_dim,
            mask: match l.kind {
                LayerType::Sliding => MaskKind::Window,
                LayerType::Full => MaskKind::Full,
            },
            cached: false,
        }));
    }
    if let Some(v) = &config.vision {
        ops.extend([
            Op::AddPositions2d,
            Op::AvgPool2d,
            Op::ScatterRows,
            Op::Norm(NormOp {
                weight: false,
                ..NormOp::RMS
            }),
            sandwich(AfterOp::Nothing),
            Op::QkvNormRope {
                head_dim: v.head_dim,
                rope: Some(RopeStyle::Axial2d),
                qk_norm: true,
            },
            Op::Attention(AttentionOp {
                head_dim: v.head_dim,
                mask: MaskKind::Full,
                cached: false,
            }),
        ]);
    }
    let mut unique = Vec::with_capacity(ops.len());
    for op in ops {
        if !unique.contains(&op) {
            unique.push(op);
        }
    }
    unique
}
