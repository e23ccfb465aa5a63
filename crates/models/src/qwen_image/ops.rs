//! The ops a Qwen-Image-2.1 generation calls (text encoder, DiT, VAE), from its configs alone: what a
//! device must run before the model is loaded onto it.

use tessera_backend::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use tessera_backend::{Activation, NormKind, Op, RopeStyle};

use super::pipeline::QwenImageConfigs;

/// Every op of a generation with `cfg`, true CFG included.
pub fn ops(cfg: &QwenImageConfigs) -> Vec<Op> {
    let (te, tr) = (&cfg.text_encoder, &cfg.transformer);
    let residual = |post, gate, after| Op::Residual(ResidualOp { post, gate, after });
    let attention = |head_dim, mask, cached| {
        Op::Attention(AttentionOp {
            head_dim,
            mask,
            cached,
        })
    };
    let layer_norm = NormOp {
        kind: NormKind::Layer,
        weight: false,
        bias: false,
        modulated: true,
        act: None,
    };
    let plain = MatmulOp::default();
    let mut ops = vec![
        // The Qwen3-VL language model: pre-norm layers, causal.
        Op::Embed,
        Op::Norm(NormOp::RMS),
        Op::Matmul(plain),
        Op::QkvNormRope {
            head_dim: te.head_dim,
            rope: Some(RopeStyle::SplitHalf),
            qk_norm: true,
        },
        attention(te.head_dim, MaskKind::Causal, false),
        Op::Gated(Activation::Silu),
        residual(None, false, AfterOp::Norm(NormOp::RMS)),
        residual(None, false, AfterOp::Nothing),
        // The DiT: txt_in (RMSNorm, GELU-tanh), the timestep MLP (SiLU), the blocks (modulated
        // affine-free LayerNorms, tanh gates, interleaved RoPE), the cache copies and the head.
        Op::Matmul(MatmulOp {
            act: Some(Activation::GeluTanh),
            ..plain
        }),
        Op::Matmul(MatmulOp {
            act: Some(Activation::Silu),
            ..plain
        }),
        Op::Cast,
        Op::Norm(layer_norm),
        Op::QkvNormRope {
            head_dim: tr.head_dim,
            rope: Some(RopeStyle::Interleaved),
            qk_norm: true,
        },
        // Prefill: causal text; the step: the target rows over [prefix ‖ own] (per-row key
        // limits: the prefix rows, whose outputs are not read, see no key).
        attention(tr.head_dim, MaskKind::Causal, false),
        attention(tr.head_dim, MaskKind::Limits, false),
        residual(None, true, AfterOp::Norm(layer_norm)),
        residual(None, true, AfterOp::Nothing),
    ];
    ops.extend(super::vae::ops(&cfg.vae));
    ops
}
