//! Opening a device: the libraries Tessera loads at run time, the context, its stream and kernels,
//! and what the device is.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use tessera_core::{Error, Result};

use super::CudaBackend;
use super::errors::drv;
use super::gemm::Gemm;
use super::graph::Graphs;
use super::nvrtc;
use super::profile::Profiler;
use super::tables::Kernels;
use crate::Precision;

/// Why CUDA cannot be used here, or `Ok` if the libraries Tessera needs can be loaded.
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only probe whether each shared library can be loaded.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(Error::Device(
            "no NVIDIA driver library (libcuda.so.1) found".into(),
        ));
    }
    nvrtc::check_library()?;
    // SAFETY: as above.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(Error::Device(
            "libcublasLt (CUDA 13) not found: install the CUDA 13 toolkit or the nvidia-cublas wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// Open CUDA device `ordinal` at `precision`: check the libraries, compile or load the kernels,
/// create the cuBLASLt handle. Every failure is an [`Error::Device`] or [`Error::Backend`] with the
/// reason; nothing panics (cudarc's internal panics are caught and reported).
pub fn open(ordinal: usize, precision: Precision) -> Result<CudaBackend> {
    check_libraries()?;
    match std::panic::catch_unwind(|| open_checked(ordinal, precision)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown failure".into());
            Err(Error::Device(format!("CUDA initialisation failed: {msg}")))
        }
    }
}

fn open_checked(ordinal: usize, precision: Precision) -> Result<CudaBackend> {
    let count =
        CudaContext::device_count().map_err(|e| Error::Device(format!("CUDA driver: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::Device(if count == 0 {
            "no CUDA device found".to_string()
        } else {
            format!("no CUDA device {ordinal} (found {count})")
        }));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| Error::Device(format!("CUDA device {ordinal}: {e}")))?;
    // SAFETY: Tessera uses one stream per backend and synchronises explicitly before every host
    // read, so cudarc's per-buffer events are not needed; they would also break graph capture.
    unsafe { ctx.disable_event_tracking() };
    keep_freed_memory(&ctx)?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(drv("compute capability"))?;
    if major < 8 {
        return Err(Error::Device(format!(
            "CUDA device {ordinal} has compute capability {major}.{minor}; Tessera's kernels need 8.0 or newer"
        )));
    }
    let arch = if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    };
    // A non-default stream: the legacy default stream cannot be captured into graphs.
    let stream = ctx.new_stream().map_err(drv("stream"))?;
    let kernels = Kernels::load(&ctx, &arch)?;
    let gemm = Gemm::new(&stream)?;
    let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
    let sm_count = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap_or(1) as u32;
    let profiler = Profiler::from_env(&ctx)?;
    Ok(CudaBackend {
        ctx,
        stream,
        precision,
        kernels,
        gemm,
        graphs: Mutex::new(Graphs::default()),
        launches: Default::default(),
        fuse: super::fusion::Fusions::from_env(),
        flash_part: Mutex::new(None),
        workspaces: Mutex::new(Default::default()),
        staging: Mutex::new(Vec::new()),
        profiler,
        fp8_at_load: false,
        blocks_at_load: None,
        int8_products: false,
        fp8: Mutex::new(None),
        name,
        arch,
        sm_count,
        overlap_launches: major >= 9 && std::env::var("TESSERA_PDL").as_deref() != Ok("0"),
    })
}

impl CudaBackend {
    /// Weights quantized at load as `quant.at_load` asks: FP8 (`--quantize fp8`) uploads float
    /// matrices as e4m3 codes with a scale per row, a GGUF block format (`--quantize q4_k`) as
    /// its blocks, each rounded as the CPU rounds them. Products on block-format weights are
    /// exact here (f32 sums on the decoded weights); `quant.int8` (the CPU's int8 activations)
    /// makes `supports` decline them, so `auto` runs such a model on the CPU as asked.
    pub fn quantizing(self, quant: crate::Quantization) -> Self {
        let at_load = quant.at_load;
        CudaBackend {
            fp8_at_load: at_load == Some(tessera_core::DType::F8_E4M3),
            blocks_at_load: at_load.filter(|q| super::blocks::FORMATS.contains(q)),
            int8_products: quant.int8,
            ..self
        }
    }

    pub fn device_name(&self) -> &str {
        &self.name
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("memory info"))
    }

    /// `cuda:N NAME (ARCH, PRECISION)`, and what `--quantize fp8` does here when given.
    pub fn describe_device(&self) -> String {
        let fp8 = match (self.fp8_at_load, self.precision) {
            (false, _) => "",
            (true, crate::Precision::Bf16) => "; FP8 weights quantized at load, FP8 products",
            (true, crate::Precision::F32) => "; FP8 weights quantized at load, decoded to f32",
        };
        let blocks = self.blocks_at_load.map_or(String::new(), |q| {
            format!("; {q} weights quantized at load, decoded in the products")
        });
        let fp8 = format!("{fp8}{blocks}");
        format!(
            "cuda:{} {} ({}, {}{fp8})",
            self.ctx.ordinal(),
            self.name,
            self.arch,
            self.precision
        )
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    /// Queue this backend's work on a stream of the device's highest priority, so that where
    /// several backends share a GPU (a server's models) this one's thread blocks are dispatched
    /// first as SMs free up: for a latency-sensitive model beside a long-running one. Call it
    /// before loading anything; what the old stream had queued is finished first.
    pub fn use_high_priority_stream(&mut self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("bind the context"))?;
        let (_least, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(drv("stream priorities"))?;
        let stream = self
            .ctx
            .new_stream_with_priority(greatest)
            .map_err(drv("stream"))?;
        // The product workspace was zeroed on the old stream: done before the new one uses it.
        self.stream.synchronize().map_err(drv("synchronize"))?;
        self.stream = stream;
        Ok(())
    }
}

impl CudaBackend {
    /// Free device memory plus what the stream-ordered pool holds unused (it keeps freed memory,
    /// [`keep_freed_memory`]): what this process can still allocate.
    pub(super) fn available_memory(&self) -> Result<usize> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let (free, _) = self.ctx.mem_get_info().map_err(drv("memory info"))?;
        let Some(pool) = default_pool(&self.ctx)? else {
            return Ok(free);
        };
        let reserved = pool_attribute(pool, A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = pool_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(free + reserved.saturating_sub(used) as usize)
    }

    /// Return the pool's unused memory to the device. The pool keeps what is freed
    /// ([`keep_freed_memory`]) and hands it on to allocations it can place there, but memory
    /// held in the pieces of one component's weights need not fit the next component's: a
    /// pipeline that swaps components trims the pool between them, so the peak is the larger
    /// component and not both.
    pub(super) fn trim_pool(&self) -> Result<()> {
        // Frees queued on the stream count as outstanding until the host has seen them done.
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let Some(pool) = default_pool(&self.ctx)? else {
            return Ok(());
        };
        // SAFETY: `pool` is the device's live default pool; trimming releases only memory that
        // backs no outstanding allocation.
        match unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) } {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(Error::Device(format!("CUDA memory pool trim: {e:?}"))),
        }
    }
}

/// The device's default stream-ordered memory pool, where cudarc allocates (`None` where the
/// context has no stream-ordered allocator).
fn default_pool(ctx: &Arc<CudaContext>) -> Result<Option<cudarc::driver::sys::CUmemoryPool>> {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is an out-parameter for the context's own device.
    match unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(Some(pool)),
        e => Err(Error::Device(format!("CUDA default memory pool: {e:?}"))),
    }
}

/// A u64 attribute of `pool`.
fn pool_attribute(
    pool: cudarc::driver::sys::CUmemoryPool,
    attr: cudarc::driver::sys::CUmemPool_attribute,
) -> Result<u64> {
    use cudarc::driver::sys;
    let mut value = 0u64;
    // SAFETY: `pool` is the device's live default pool; the attribute is a u64 written into
    // `value`, which outlives the call.
    match unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(value),
        e => Err(Error::Device(format!("CUDA memory pool {attr:?}: {e:?}"))),
    }
}

/// Keep memory freed by the stream-ordered allocator in the device's pool instead of handing it
/// back to the driver at every synchronisation (the pool's default release threshold is 0). A
/// request's activations (the VAE's alone are 4.3 GB at 1024²) are then re-used by the next
/// request without being mapped again, which took tens of milliseconds per image on the H200;
/// the process keeps its high-water mark, as PyTorch's caching allocator does.
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    use cudarc::driver::sys;
    let Some(pool) = default_pool(ctx)? else {
        return Ok(());
    };
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is the device's live default pool; the attribute is a u64 read from
    // `threshold`, which outlives the call.
    let r = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Error::Device(format!(
            "CUDA memory pool release threshold: {e:?}"
        ))),
    }
}
