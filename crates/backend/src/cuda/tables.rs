//! Every kernel table, resolved when the backend opens: the one place that names each op
//! family's table. Kept apart from [`super::launch`], whose tools every op family uses, so that
//! the op families and the launch tools do not import each other.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::nvrtc::Ptx;
use tessera_core::{Error, Result};

use super::attention::{self, AttentionKernels, Sm90Kernels};
use super::blocks::BlockKernels;
use super::elementwise::ElementwiseKernels;
use super::fp8::Fp8Kernels;
use super::gemv::GemvKernels;
use super::image::{self, ImageKernels, Sm90ConvKernels};
use super::launch::{KernelTable, Signature};
use super::norm::NormKernels;
use super::nvrtc::{self, SOURCES};
use super::rows::RowsKernels;
use super::short_conv::ShortConvKernels;

/// Every kernel table, resolved when the backend opens.
pub struct Kernels {
    pub norm: NormKernels,
    pub elementwise: ElementwiseKernels,
    pub rows: RowsKernels,
    pub image: ImageKernels,
    /// conv_sm90.cu (the wgmma implicit-GEMM convolution), built for sm_90a alone.
    pub conv_sm90: Option<Sm90ConvKernels>,
    pub short_conv: ShortConvKernels,
    pub gemv: GemvKernels,
    pub attention: AttentionKernels,
    /// attention_sm90.cu, built for sm_90a alone.
    pub sm90: Option<Sm90Kernels>,
    /// fp8.cu (activations to e4m3 for FP8 products), built for sm_90a alone.
    pub fp8: Option<Fp8Kernels>,
    /// blocks.cu (products on GGUF block-format weights).
    pub blocks: BlockKernels,
}

impl Kernels {
    /// Compile (or load from the cache) every source built for `arch` and resolve every table.
    pub fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Self> {
        let kernels = Kernels {
            norm: required(ctx, arch)?,
            elementwise: required(ctx, arch)?,
            rows: required(ctx, arch)?,
            image: required(ctx, arch)?,
            conv_sm90: table(ctx, arch)?,
            short_conv: required(ctx, arch)?,
            gemv: required(ctx, arch)?,
            attention: required(ctx, arch)?,
            sm90: table(ctx, arch)?,
            fp8: table(ctx, arch)?,
            blocks: required(ctx, arch)?,
        };
        attention::reserve_shared_memory(&kernels.attention, kernels.sm90.as_ref())?;
        image::reserve_shared_memory(kernels.conv_sm90.as_ref())?;
        Ok(kernels)
    }
}

/// Table `T`, or `None` where its source is not built for `arch`.
fn table<T: KernelTable>(ctx: &Arc<CudaContext>, arch: &str) -> Result<Option<T>> {
    let src = SOURCES
        .iter()
        .find(|s| s.name == T::SOURCE)
        .ok_or_else(|| Error::backend("kernel table", format!("no source {}", T::SOURCE)))?;
    if !src.builds_for(arch) {
        return Ok(None);
    }
    let module = ctx
        .load_module(Ptx::from_binary(nvrtc::cubin(src, arch)?))
        .map_err(|e| Error::backend(format!("loading {}", src.name), e))?;
    T::load(&module).map(Some)
}

fn required<T: KernelTable>(ctx: &Arc<CudaContext>, arch: &str) -> Result<T> {
    table(ctx, arch)?.ok_or_else(|| {
        Error::backend(
            "kernel table",
            format!("{} is not built for {arch}", T::SOURCE),
        )
    })
}

/// Every table's source and kernels, for the CI checks against NVRTC's output.
pub fn kernel_tables() -> Vec<(&'static str, Vec<Signature>)> {
    fn of<T: KernelTable>() -> (&'static str, Vec<Signature>) {
        (T::SOURCE, T::signatures())
    }
    vec![
        of::<NormKernels>(),
        of::<ElementwiseKernels>(),
        of::<RowsKernels>(),
        of::<ImageKernels>(),
        of::<Sm90ConvKernels>(),
        of::<ShortConvKernels>(),
        of::<GemvKernels>(),
        of::<AttentionKernels>(),
        of::<Sm90Kernels>(),
        of::<Fp8Kernels>(),
        of::<BlockKernels>(),
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// A pattern with too few `{}` would load one kernel for two variants, and one with too many
    /// a name with braces: both show here, before any GPU sees them.
    #[test]
    fn every_table_names_distinct_complete_kernels() {
        let mut seen = HashSet::new();
        for (source, kernels) in kernel_tables() {
            assert!(!kernels.is_empty(), "{source}: empty table");
            for k in kernels {
                assert!(!k.name.contains(['{', '}']), "{source}: {}", k.name);
                assert!(seen.insert(k.name.clone()), "{source}: {} twice", k.name);
            }
        }
    }

    #[test]
    fn every_source_has_one_table() {
        let tables: Vec<&str> = kernel_tables().iter().map(|t| t.0).collect();
        let sources: Vec<&str> = SOURCES.iter().map(|s| s.name).collect();
        assert_eq!(tables, sources);
    }
}
