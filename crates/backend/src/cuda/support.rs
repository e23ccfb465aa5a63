//! What the CUDA backend runs ([`Backend::supports`]): the one place that decides, asked by
//! models before they load and by every op on entry.
//!
//! What is declined is what no kernel here computes yet — the image-generation ops (bias,
//! activation, gate and accumulate epilogues, layer norms and modulation, gated residuals,
//! interleaved RoPE, convolutions, GroupNorm) and attention over cached key ranges or per-row
//! key limits; each message says so.
//!
//! [`Backend::supports`]: crate::Backend::supports

use tessera_core::{Error, Result};

use super::CudaBackend;
use super::attention::FLASH_HEAD_DIMS;
use crate::op::{AfterOp, AttentionOp, MaskKind, MatmulOp, NormOp, ResidualOp};
use crate::{Backend, NormKind, Op, Precision, RopeStyle};

/// Why an op is declined (`what` names the missing feature; the caller names the op and the
/// device).
fn not_yet(what: &str) -> Error {
    Error::Device(format!("{what} not implemented on CUDA yet"))
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
            Op::Matmul(_) => Err(not_yet(
                "bias, activation, gate and accumulating epilogues are",
            )),
            Op::Norm(n) if rms_kernel_norm(n) => Ok(()),
            Op::Norm(_) => Err(not_yet("layer norms, norm biases and modulation are")),
            Op::Residual(r) => residual(r).map_err(not_yet),
            Op::QkvNormRope { head_dim, rope } => {
                if *rope == Some(RopeStyle::Interleaved) {
                    return Err(not_yet("interleaved (complex-pair) RoPE is"));
                }
                if *head_dim == 0 || !head_dim.is_multiple_of(2) || *head_dim > 512 {
                    return Err(Error::Device(
                        "the q/k/v norm kernels take even head widths up to 512".into(),
                    ));
                }
                Ok(())
            }
            Op::Attention(a) => self.attention_supported(a),
            Op::Conv2d { .. } => Err(not_yet("convolutions are")),
            Op::GroupNorm { .. } => Err(not_yet("GroupNorm is")),
        }
    }

    /// [`check`](Self::check) on an op's entry: a refusal names the op and the device.
    pub(super) fn enter(&self, op: &Op) -> Result<()> {
        self.check(op)
            .map_err(|e| Error::Device(format!("{op} on {}: {e}", self.describe())))
    }

    fn attention_supported(&self, a: &AttentionOp) -> Result<()> {
        if a.cached {
            return Err(not_yet("attention over cached key ranges is"));
        }
        if a.mask == MaskKind::Limits {
            return Err(not_yet("per-row key limits (block-causal masks) are"));
        }
        match self.precision {
            Precision::Bf16 if !FLASH_HEAD_DIMS.contains(&a.head_dim) => {
                Err(Error::Device(format!(
                    "no tensor-core attention kernel for head_dim {} (have {FLASH_HEAD_DIMS:?})",
                    a.head_dim
                )))
            }
            Precision::F32 if a.head_dim > 512 => Err(Error::Device(
                "the f32 attention kernel takes head_dim ≤ 512".into(),
            )),
            _ => Ok(()),
        }
    }
}

/// The residual kernels: `h = (h + N_post(y)) · scale` with an RMS post-norm (weight optional),
/// then nothing, a copy, or a weighted RMS norm of `h`.
fn residual(r: &ResidualOp) -> std::result::Result<(), &'static str> {
    match r.post {
        Some(p) if rms_kernel_norm(&p) => {}
        Some(_) => return Err("post-norms other than RMS are"),
        None => return Err("residual adds without a post-norm are"),
    }
    if r.gate {
        return Err("gated residuals are");
    }
    match r.after {
        AfterOp::Nothing | AfterOp::Copy => Ok(()),
        AfterOp::Norm(n) if rms_kernel_norm(&n) && n.weight => Ok(()),
        AfterOp::Norm(_) => Err("next norms other than a weighted RMS norm are"),
    }
}
