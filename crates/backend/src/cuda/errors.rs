//! Driver errors as Tessera's errors, for every module that calls the driver.

use cudarc::driver::DriverError;
use cudarc::driver::sys::CUresult;
use tessera_core::Error;

/// A driver error of `op`, as Tessera's error: out-of-memory kept apart, so callers can split work.
pub(super) fn drv(op: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| {
        if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory(op.to_string())
        } else {
            Error::backend(op, e)
        }
    }
}
