//! What the CUDA backend runs ([`Backend::supports`]): the one place that decides, asked by
//! models before they load and by every op on entry.
//!
//! Every op has a kernel; what is declined is products on weights in a format with no CUDA
//! product (all of GGUF's Q8_0, Q4_0, Q4_K, Q6_K run, as does FP8), products on FP8 weights under
//! bf16 off Hopper, the erf GELU outside a product epilogue, and head widths no attention kernel
//! takes. Each message says so.
//!
//! [`Backend::supports`]: crate::Backend::supports

use tessera_core::{Error, Result};

use super::CudaBackend;
use super::attention::{CACHED_HEAD_DIMS, FLASH_HEAD_DIMS, ROWS_MAX_HEAD_DIM, self_kernel};
use crate::op::{AttentionOp, MaskKind, MatmulOp, NormOp};
use crate::{Activation, Backend, Op, Precision};

/// Why an op is declined (`what` names the missing feature; the caller names the op and the
/// device).
fn not_yet(what: &str) -> Error {
    Error::Device(format!("{what} not implemented on CUDA yet"))
}

impl CudaBackend {
    pub(super) fn check(&self, op: &Op) -> Result<()> {
        match op {
            Op::Matmul(MatmulOp {
                quantized: Some(tessera_core::DType::F8_E4M3),
                ..
            }) => self.fp8_supported(),
            // GGUF blocks as stored, decoded in the products (blocks.rs), in both precisions;
            // exact, so not what `--precision int8` asks for.
            Op::Matmul(MatmulOp {
                quantized: Some(q), ..
            }) if super::blocks::FORMATS.contains(q) => {
                if self.int8_products {
                    return Err(Error::Device(format!(
                        "products on {q} weights with int8 activations (--precision int8) are \
                         the CPU's mode; CUDA's are exact: run with --precision bf16 or f32, or \
                         on the CPU (--device cpu)"
                    )));
                }
                Ok(())
            }
            Op::Matmul(MatmulOp {
                quantized: Some(q), ..
            }) => Err(Error::Device(format!(
                "products on {q} weights are not implemented on CUDA (it runs {:?} and F8_E4M3): \
                 run on the CPU (--device cpu) or without --quantize",
                super::blocks::FORMATS
            ))),
            Op::Embed
            | Op::Cast
            | Op::Matmul(_)
            | Op::Residual(_)
            | Op::SegmentMean
            | Op::AddPositions2d
            | Op::AvgPool2d
            | Op::ScatterRows
            | Op::DupUp
            | Op::AvgDown
            | Op::ShortConv { .. }
            | Op::ArgmaxRows => Ok(()),
            // The erf GELU is only a product epilogue so far (LFM2-VL's projector).
            Op::Gated(Activation::Gelu)
            | Op::Norm(NormOp {
                act: Some(Activation::Gelu),
                ..
            })
            | Op::GroupNorm {
                act: Some(Activation::Gelu),
            }
            | Op::Conv2d {
                act: Some(Activation::Gelu),
                ..
            } => Err(not_yet("the erf GELU outside a product epilogue is")),
            Op::Gated(_) | Op::Norm(_) | Op::GroupNorm { .. } | Op::Conv2d { .. } => Ok(()),
            Op::QkvNormRope { head_dim, .. } => {
                if *head_dim == 0 || !head_dim.is_multiple_of(2) || *head_dim > 512 {
                    return Err(Error::Device(
                        "the q/k/v norm kernels take even head widths up to 512".into(),
                    ));
                }
                Ok(())
            }
            Op::Attention(a) => self.attention_supported(a),
        }
    }

    /// FP8 products: cuBLASLt's FP8 GEMMs under bf16 (sm_90a); under f32, the exact mode, the
    /// weights are decoded to f32 at upload and the products are the dense f32 ones.
    fn fp8_supported(&self) -> Result<()> {
        if self.precision == Precision::F32 || self.has_fp8() {
            return Ok(());
        }
        Err(Error::Device(format!(
            "products on FP8 (F8_E4M3) weights run on Hopper (sm_90a) under bf16, and this device \
             is {}: run with --precision f32 (the weights decoded to f32), on the CPU \
             (--device cpu), or with a bf16 file / without --quantize fp8",
            self.arch
        )))
    }

    /// [`check`](Self::check) on an op's entry: a refusal names the op and the device.
    pub(super) fn enter(&self, op: &Op) -> Result<()> {
        self.check(op)
            .map_err(|e| Error::Device(format!("{op} on {}: {e}", self.describe())))
    }

    fn attention_supported(&self, a: &AttentionOp) -> Result<()> {
        // Key ranges take their own kernel, in both precisions and under every mask.
        if a.cached {
            if CACHED_HEAD_DIMS.contains(&a.head_dim) {
                return Ok(());
            }
            return Err(Error::Device(format!(
                "no attention kernel over cached key ranges for head_dim {} (have {CACHED_HEAD_DIMS:?})",
                a.head_dim
            )));
        }
        // Widths without a tensor-core kernel (bf16) or beyond the row kernel (f32) run on the
        // key-range kernel or (bf16, any width up to 512) the row kernel, slower; per-row key
        // limits run wherever the mask-free op does (`TESSERA_FLASH_LIMITS=0`: bf16 limits on
        // those two kernels).
        if self_kernel(self.precision, a.head_dim, a.mask == MaskKind::Limits).is_some() {
            return Ok(());
        }
        Err(Error::Device(match self.precision {
            Precision::Bf16 => format!(
                "no bf16 attention kernel for head_dim {} (have {FLASH_HEAD_DIMS:?} on the tensor cores, and any width up to {ROWS_MAX_HEAD_DIM} without)",
                a.head_dim
            ),
            Precision::F32 => format!(
                "no f32 attention kernel for head_dim {} (have up to {ROWS_MAX_HEAD_DIM}, and {CACHED_HEAD_DIMS:?})",
                a.head_dim
            ),
        }))
    }
}
