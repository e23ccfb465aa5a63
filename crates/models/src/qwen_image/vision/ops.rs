//! The ops the vision tower calls, from its config alone. Part of `qwen_image::edit::ops`, not
//! of `qwen_image::ops`: a device without rotation-only RoPE (`qk_norm: false`) still runs
//! text-to-image, and only editing is refused there.

use tessera_backend::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use tessera_backend::{Activation, NormKind, Op, RopeStyle};

use super::config::VisionConfig;

pub fn ops(cfg: &VisionConfig) -> Vec<Op> {
    let layer = NormOp {
        kind: NormKind::Layer,
        weight: true,
        bias: true,
        modulated: false,
        act: None,
    };
    let bias = MatmulOp {
        bias: true,
        ..MatmulOp::default()
    };
    let residual = |after| {
        Op::Residual(ResidualOp {
            post: None,
            gate: false,
            after,
        })
    };
    let mut ops = vec![
        // Position rows into the stream, then the patch embed added onto them.
        Op::Cast,
        Op::Matmul(MatmulOp {
            accumulate: true,
            ..bias
        }),
        Op::Norm(layer),
        Op::Matmul(bias),
        Op::QkvNormRope {
            head_dim: cfg.head_dim,
            rope: Some(RopeStyle::SplitHalf),
            qk_norm: false,
        },
        Op::Attention(AttentionOp {
            head_dim: cfg.head_dim,
            mask: MaskKind::Full,
            cached: false,
        }),
        residual(AfterOp::Norm(layer)),
        residual(AfterOp::Nothing),
        Op::Matmul(MatmulOp {
            act: Some(Activation::GeluTanh),
            ..bias
        }),
        // The mergers.
        Op::Matmul(MatmulOp {
            act: Some(Activation::Gelu),
            ..bias
        }),
    ];
    ops.dedup();
    ops
}
