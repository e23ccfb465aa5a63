//! What the CUDA backend runs ([`Backend::supports`]): the one place that decides, asked by
//! models before they load and by every op on entry.
//!
//! What is declined is what no kernel here computes yet — the image-generation ops (bias,
//! activation, gate and accumulate epilogues, layer norms and modulation, gated residuals,
//! interleaved RoPE, convolutions, GroupNorm) and attention over cached key ranges or per-row
//! key limits; each message says so.

use tessera_core::{Error, Result};

use super::CudaBackend;
use super::attention::FLASH_HEAD_DIMS;
use crate::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use crate::{NormKind, Op, Precision, RopeStyle};

fn not_yet(what: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what} is not implemented on CUDA yet"))
}

/// The row norms the RMS kernels compute: RMS, with or without a weight, nothing else.
fn rms_kernel_norm(n: &NormOp) -> bool {
    n.kind == NormKind::Rms && !n.bias && !n.modulated
}

impl CudaBackend {
    pub(super) fn check(&self, op: &Op) -> Result<()> {
        match op {
            Op::Embed
            | Op::Cast
            | Op::Gated(_)
            | Op::SegmentMean
            | Op::AddPositions2d
            | Op::AvgPool2d
            | Op::ScatterRows => Ok(()),
            Op::Matmul(m) if *m == MatmulOp::default() => Ok(()),
            Op::Matmul(_) => Err(not_yet(format!(
                "{op}: products with a bias, activation, gate or accumulating epilogue"
            ))),
            Op::Norm(n) if rms_kernel_norm(n) => Ok(()),
            Op::Norm(_) => Err(not_yet(format!("{op}: layer norms, biases and modulation"))),
            Op::Residual(r) => residual(r).map_err(|why| not_yet(format!("{op}: {why}"))),
            Op::QkvNormRope { head_dim, rope } => {
                if *rope == Some(RopeStyle::Interleaved) {
                    return Err(not_yet("interleaved (complex-pair) RoPE"));
                }
                if *head_dim == 0 || !head_dim.is_multiple_of(2) || *head_dim > 512 {
                    return Err(Error::Device(format!(
                        "{op}: the q/k/v norm kernels take even head widths up to 512"
                    )));
                }
                Ok(())
            }
            Op::Attention(a) => self.attention_supported(a, op),
            Op::Conv2d { .. } | Op::GroupNorm { .. } => Err(not_yet(op)),
        }
    }

    fn attention_supported(&self, a: &AttentionOp, op: &Op) -> Result<()> {
        if a.cached {
            return Err(not_yet(format!("{op}: attention over cached key ranges")));
        }
        if a.mask == MaskKind::Limits {
            return Err(not_yet(format!(
                "{op}: per-row key limits (block-causal masks)"
            )));
        }
        match self.precision {
            Precision::Bf16 if !FLASH_HEAD_DIMS.contains(&a.head_dim) => {
                Err(Error::Device(format!(
                    "{op}: no tensor-core attention kernel for head_dim {} (have {FLASH_HEAD_DIMS:?})",
                    a.head_dim
                )))
            }
            Precision::F32 if a.head_dim > 512 => Err(Error::Device(format!(
                "{op}: the f32 attention kernel takes head_dim ≤ 512"
            ))),
            _ => Ok(()),
        }
    }
}

/// The residual kernels: `h = (h + N_post(y)) · scale` with an RMS post-norm (weight optional),
/// then nothing, a copy, or a weighted RMS norm of `h`.
fn residual(r: &ResidualOp) -> std::result::Result<(), &'static str> {
    match r.post {
        Some(p) if rms_kernel_norm(&p) => {}
        Some(_) => return Err("a post-norm other than RMS"),
        None => return Err("a residual add without a post-norm"),
    }
    if r.gate {
        return Err("gated residuals");
    }
    match r.after {
        AfterOp::Nothing | AfterOp::Copy => Ok(()),
        AfterOp::Norm(n) if rms_kernel_norm(&n) && n.weight => Ok(()),
        AfterOp::Norm(_) => Err("a next norm other than a weighted RMS norm"),
    }
}
