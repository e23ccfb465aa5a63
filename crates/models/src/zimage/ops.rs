//! The ops a Z-Image generation calls (text encoder, DiT, VAE), from its configs alone: what a
//! device must run before the model is loaded onto it.

use tessera_backend::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use tessera_backend::{Activation, NormKind, Op, RopeStyle};

use super::pipeline::ZImageConfigs;

/// Every op of a generation with `cfg`, classifier-free guidance included.
pub fn ops(cfg: &ZImageConfigs) -> Vec<Op> {
    let modulated = NormOp {
        modulated: true,
        ..NormOp::RMS
    };
    let residual = |post, gate, after| Op::Residual(ResidualOp { post, gate, after });
    let bias = MatmulOp {
        bias: true,
        ..MatmulOp::default()
    };
    let attention = |head_dim, mask| {
        Op::Attention(AttentionOp {
            head_dim,
            mask,
            cached: false,
        })
    };
    let (te, tr) = (&cfg.text_encoder, &cfg.transformer);
    let mut ops = vec![
        // The Qwen3 text encoder: pre-norm layers, causal.
        Op::Embed,
        Op::Norm(NormOp::RMS),
        Op::Matmul(MatmulOp::default()),
        Op::QkvNormRope {
            head_dim: te.head_dim,
            rope: Some(RopeStyle::SplitHalf),
            qk_norm: true,
        },
        attention(te.head_dim, MaskKind::Causal),
        Op::Gated(Activation::Silu),
        residual(None, false, AfterOp::Norm(NormOp::RMS)),
        residual(None, false, AfterOp::Nothing),
        // The DiT: embedders and adaLN (linears), modulated and plain sandwich blocks, the final
        // modulated LayerNorm.
        Op::Matmul(bias),
        Op::Matmul(MatmulOp {
            act: Some(Activation::Silu),
            ..bias
        }),
        Op::Cast,
        Op::Norm(modulated),
        Op::Norm(NormOp {
            kind: NormKind::Layer,
            weight: false,
            bias: false,
            modulated: true,
            act: None,
        }),
        Op::QkvNormRope {
            head_dim: tr.head_dim(),
            rope: Some(RopeStyle::Interleaved),
            qk_norm: true,
        },
        attention(tr.head_dim(), MaskKind::Full),
        residual(Some(NormOp::RMS), true, AfterOp::Norm(modulated)),
        residual(Some(NormOp::RMS), true, AfterOp::Nothing),
        residual(Some(NormOp::RMS), false, AfterOp::Norm(NormOp::RMS)),
        residual(Some(NormOp::RMS), false, AfterOp::Nothing),
        // The VAE decoder.
        Op::Conv2d {
            kernel: 3,
            upsample: false,
            downsample: false,
            act: None,
        },
        Op::GroupNorm {
            act: Some(Activation::Silu),
        },
    ];
    let vae = &cfg.vae;
    if vae.block_out_channels.windows(2).any(|w| w[0] != w[1]) {
        ops.push(Op::Conv2d {
            kernel: 1,
            upsample: false,
            downsample: false,
            act: None,
        });
    }
    if vae.block_out_channels.len() > 1 {
        ops.push(Op::Conv2d {
            kernel: 3,
            upsample: true,
            downsample: false,
            act: None,
        });
    }
    if vae.mid_attention {
        let top = vae.block_out_channels.last().copied().unwrap_or(0);
        ops.extend([
            Op::GroupNorm { act: None },
            attention(top, MaskKind::Full),
            Op::Matmul(MatmulOp {
                accumulate: true,
                ..bias
            }),
        ]);
    }
    ops
}
