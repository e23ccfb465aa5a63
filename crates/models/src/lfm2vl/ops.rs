//! Every op an LFM2-VL forward calls, so a device that cannot run one declines before loading.

use tessera_backend::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use tessera_backend::{Activation, NormKind, Op, RopeStyle};

use super::config::{LayerKind, Lfm2VlConfig};

pub fn ops(c: &Lfm2VlConfig) -> Vec<Op> {
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
    let mut ops = vec![
        // Vision tower.
        Op::Cast,
        Op::Matmul(MatmulOp {
            accumulate: true,
            ..bias
        }),
        Op::Norm(layer),
        Op::Matmul(bias),
        Op::Matmul(MatmulOp {
            act: Some(Activation::GeluTanh),
            ..bias
        }),
        Op::Attention(AttentionOp {
            head_dim: c.vision.head_dim,
            mask: MaskKind::Full,
            cached: false,
        }),
        Op::Residual(ResidualOp {
            post: None,
            gate: false,
            after: AfterOp::Norm(layer),
        }),
        Op::ScatterRows,
        // Projector.
        Op::Matmul(MatmulOp {
            act: Some(Activation::Gelu),
            bias: c.projector_bias,
            ..MatmulOp::default()
        }),
        Op::Matmul(MatmulOp {
            bias: c.projector_bias,
            ..MatmulOp::default()
        }),
        // Language model.
        Op::Embed,
        Op::Norm(NormOp::RMS),
        Op::Matmul(MatmulOp::default()),
        Op::Residual(ResidualOp {
            post: None,
            gate: false,
            after: AfterOp::Norm(NormOp::RMS),
        }),
        Op::Gated(Activation::Silu),
        // Greedy decoding's tokens (the chat scheduler).
        Op::ArgmaxRows,
    ];
    if c.projector_norm {
        ops.push(Op::Norm(layer));
    }
    let t = &c.text;
    if t.layers.contains(&LayerKind::Conv) {
        ops.push(Op::ShortConv {
            kernel: t.conv_kernel,
            bias: t.conv_bias,
        });
        if t.conv_bias {
            ops.push(Op::Matmul(bias));
        }
    }
    if t.layers.contains(&LayerKind::Attention) {
        ops.push(Op::QkvNormRope {
            head_dim: t.head_dim,
            rope: Some(RopeStyle::SplitHalf),
            qk_norm: true,
        });
        for cached in [false, true] {
            ops.push(Op::Attention(AttentionOp {
                head_dim: t.head_dim,
                mask: MaskKind::Causal,
                cached,
            }));
        }
    }
    ops.sort_by_key(|o| format!("{o:?}"));
    ops.dedup();
    ops
}
