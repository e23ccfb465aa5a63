//! What the dense products ([`super::gemm`]) and the FP8 products ([`super::fp8`]) share of
//! cuBLASLt: status checks, a handle with its workspace, and a plan's descriptor and layouts for
//! the one layout both use — row-major `out[m, n] = x[m, k] · w[n, k]ᵀ` computed column-major as
//! `outᵀ = op(W) · xᵀ` with `op = transpose`, so no operand is copied — with the heuristic's
//! algorithms for it.

use std::sync::Arc;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use tessera_core::{Error, Result};

/// cuBLASLt scratch space; 32 MiB lets the heuristic pick split-K and stream-K kernels.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// `Ok` for success, else an error naming `op` and the status.
pub(super) fn check(op: &str, s: lt::cublasStatus_t) -> Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::backend(format!("cuBLASLt {op}"), format!("{s:?}")))
    }
}

/// A column-major matrix layout of `t` elements.
pub(super) fn layout(
    t: lt::cudaDataType,
    rows: u64,
    cols: u64,
    ld: i64,
) -> Result<lt::cublasLtMatrixLayout_t> {
    let mut l = std::ptr::null_mut();
    // SAFETY: out-parameter only.
    check("layout", unsafe {
        lt::cublasLtMatrixLayoutCreate(&mut l, t, rows, cols, ld)
    })?;
    Ok(l)
}

/// A descriptor attribute from `v`'s bytes.
pub(super) fn set_attr<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `desc` is live; cuBLASLt copies `size_of::<T>()` bytes from `v`, which the callers
    // give as the attribute's own type (i32 for the operations, i8 for fast accumulation, a
    // device pointer for the scales).
    check("desc attribute", unsafe {
        lt::cublasLtMatmulDescSetAttribute(
            desc,
            attr,
            (v as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    })
}

/// A heuristic preference attribute from `v`'s bytes (the status: the caller destroys `pref`
/// whatever it is).
fn set_pref<T>(
    pref: lt::cublasLtMatmulPreference_t,
    attr: lt::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> lt::cublasStatus_t {
    // SAFETY: `pref` is live; cuBLASLt copies `size_of::<T>()` bytes from `v`, which the caller
    // gives as the attribute's own type (u64 for the workspace, u32 for the alignments).
    unsafe {
        lt::cublasLtMatmulPreferenceSetAttribute(
            pref,
            attr,
            (v as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
}

/// A cuBLASLt handle and its workspace, destroyed together.
pub(super) struct Handle {
    pub raw: lt::cublasLtHandle_t,
    _workspace: CudaSlice<u8>,
    /// The workspace's device address ([`WORKSPACE_BYTES`]).
    pub workspace: u64,
}

impl Handle {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-parameter only.
        check("create", unsafe { lt::cublasLtCreate(&mut raw) })?;
        let (_workspace, workspace) = match device_bytes(stream, WORKSPACE_BYTES) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                unsafe { lt::cublasLtDestroy(raw) };
                return Err(e);
            }
        };
        Ok(Handle {
            raw,
            _workspace,
            workspace,
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created in `new` and destroyed once; the owners drop their plans first.
        unsafe { lt::cublasLtDestroy(self.raw) };
    }
}

/// `bytes` zeroed bytes on the device and their address.
pub(super) fn device_bytes(stream: &Arc<CudaStream>, bytes: usize) -> Result<(CudaSlice<u8>, u64)> {
    let mem = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| Error::backend("cuBLASLt buffers", e))?;
    let ptr = mem.device_ptr(stream).0;
    Ok((mem, ptr))
}

/// The byte alignment of a product's operand addresses (A the weight, B the activation rows,
/// D the output, which is also C), at most 256: cuBLASLt's heuristic assumes 256 unless told,
/// and an algorithm it then offers refuses (`NOT_SUPPORTED`) rows that start, say, 14 bytes
/// past a 16-byte boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Alignments {
    pub a: u32,
    pub b: u32,
    pub d: u32,
}

impl Alignments {
    /// The alignments of the addresses `a`, `b` and `d`.
    pub fn of(a: u64, b: u64, d: u64) -> Self {
        let align = |p: u64| 1u32 << p.trailing_zeros().min(8);
        Alignments {
            a: align(a),
            b: align(b),
            d: align(d),
        }
    }
}

/// A product's descriptor (f32 compute and scale type, A transposed, B not) and its A, B and
/// C = D layouts, destroyed together.
pub(super) struct Layouts {
    pub desc: lt::cublasLtMatmulDesc_t,
    pub a: lt::cublasLtMatrixLayout_t,
    pub b: lt::cublasLtMatrixLayout_t,
    pub d: lt::cublasLtMatrixLayout_t,
}

impl Layouts {
    /// `outᵀ [n, m] = Wᵀ · xᵀ`: A is the weight as `[k, n]` of `a` elements (leading dimension
    /// `lda`), B the input as `[k, m]` of `b` (`ldb`), D the output as `[n, m]` of `d` (`ldd`).
    pub fn tn(
        (n, m, k): (u64, u64, u64),
        (a, lda): (lt::cudaDataType, i64),
        (b, ldb): (lt::cudaDataType, i64),
        (d, ldd): (lt::cudaDataType, i64),
    ) -> Result<Self> {
        let mut desc = std::ptr::null_mut();
        // SAFETY: out-parameter only.
        check("desc", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        // Null layouts until made: a failure below drops what exists (cuBLASLt ignores null).
        let mut l = Layouts {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        use lt::cublasLtMatmulDescAttributes_t as A;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?; // CUBLAS_OP_T
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?; // CUBLAS_OP_N
        l.a = layout(a, k, n, lda)?;
        l.b = layout(b, k, m, ldb)?;
        l.d = layout(d, n, m, ldd)?;
        Ok(l)
    }

    /// Up to `wanted` algorithms the heuristic offers for these layouts within the workspace,
    /// best guess first (only those it says are usable); an error naming `what` when none is.
    pub fn algorithms(
        &self,
        handle: &Handle,
        wanted: usize,
        align: Alignments,
        what: &dyn std::fmt::Debug,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>> {
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let mut pref = std::ptr::null_mut();
        // SAFETY: out-parameter only.
        check("preference", unsafe {
            lt::cublasLtMatmulPreferenceCreate(&mut pref)
        })?;
        let ok = lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
        let mut r = set_pref(
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(WORKSPACE_BYTES as u64),
        );
        for (attr, bytes) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.d),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d),
        ] {
            if r == ok {
                r = set_pref(pref, attr, &bytes);
            }
        }
        // SAFETY: plain-old-data structs, filled by the heuristic below before use.
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            (0..wanted).map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut count = 0;
        let heur = if r == ok {
            // SAFETY: all descriptors are live; `wanted` result slots are provided.
            unsafe {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    handle.raw,
                    self.desc,
                    self.a,
                    self.b,
                    self.d,
                    self.d,
                    pref,
                    wanted as i32,
                    results.as_mut_ptr(),
                    &mut count,
                )
            }
        } else {
            r
        };
        // SAFETY: `pref` was created above and is destroyed once.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        check("heuristic", heur)?;
        let algos: Vec<_> = results
            .iter()
            .take(count.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if algos.is_empty() {
            return Err(Error::backend(
                "cuBLASLt heuristic",
                format!("no usable algorithm for {what:?}"),
            ));
        }
        Ok(algos)
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        // SAFETY: each handle was created by cuBLASLt for these layouts and is destroyed once (a
        // null one, from a failed creation, is ignored by cuBLASLt).
        unsafe {
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.d);
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}
