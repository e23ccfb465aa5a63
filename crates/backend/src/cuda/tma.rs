//! Tensor maps for the tensor-memory accelerator (Hopper's TMA): the driver encodes, on the host,
//! how a kernel's bulk copies address a tensor, so a single thread can move a whole tile into
//! shared memory, swizzled, with no per-thread address arithmetic.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use tessera_core::{Error, Result};

use super::launch::{DevPtr, TensorMap};

/// Columns of one box: 64 bf16 are the 128 bytes the 128-byte swizzle spans.
pub const BOX_COLS: u32 = 64;

/// Encode the map of a bf16 tensor of `dims` (innermost first) with the byte `strides` of every
/// dimension but the innermost, read in boxes of `boxes` elements, swizzled by 128 bytes (the
/// layout the wgmma descriptors read); elements past the tensor arrive as zeros.
fn encode_bf16<const R: usize>(
    base: DevPtr,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
) -> Result<TensorMap> {
    if strides.len() + 1 != R {
        return Err(Error::backend(
            "tensor map",
            format!(
                "a rank-{R} map takes {} strides, not {}",
                R - 1,
                strides.len()
            ),
        ));
    }
    let steps = [1u32; R];
    let mut map = MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: `map` is a writable, suitably aligned CUtensorMap; the dimension, box and step
    // arrays hold the rank's R entries the driver reads and the strides its R − 1; the driver only
    // records `base` (it dereferences nothing on the host), and the kernels read through the map
    // only within the tensor its caller checked against the operand's buffer.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            R as u32,
            base.0 as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    res.result()
        .map_err(|e| Error::backend("cuTensorMapEncodeTiled", e))?;
    // SAFETY: the driver returned success, so it wrote the whole map.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// The map of a bf16 attention operand as the kernels walk it: `heads` heads of `head_dim`
/// columns side by side in rows `row_stride` elements apart, `rows` rows from `base` — a 3-D
/// tensor (head column, row, head) read in boxes of [`BOX_COLS`] columns × `box_rows` rows of one
/// head, swizzled by 128 bytes (the layout the wgmma descriptors read). Rows past `rows` arrive
/// as zeros.
pub fn head_rows_bf16(
    base: DevPtr,
    row_stride: usize,
    rows: usize,
    heads: usize,
    head_dim: usize,
    box_rows: u32,
) -> Result<TensorMap> {
    const ELEM: u64 = 2;
    let bad = |why: &str| Err(Error::backend("tensor map", why.to_string()));
    if !base.0.is_multiple_of(16) || !(row_stride as u64 * ELEM).is_multiple_of(16) {
        return bad("the tensor's base and row stride must be 16-byte aligned");
    }
    if !head_dim.is_multiple_of(BOX_COLS as usize) || box_rows == 0 || box_rows > 256 {
        return bad("heads must be whole boxes of 64 columns, boxes 1 to 256 rows");
    }
    let dims = [head_dim as u64, rows.max(1) as u64, heads.max(1) as u64];
    let strides = [row_stride as u64 * ELEM, head_dim as u64 * ELEM];
    encode_bf16(base, dims, &strides, [BOX_COLS, box_rows, 1])
}

/// The map of a dense bf16 matrix of `rows` rows × `cols` columns (row-major, rows `cols`
/// elements apart) read in boxes of [`BOX_COLS`] columns × `box_rows` rows, swizzled by 128 bytes:
/// the convolution weight's tiles as `conv_ws` loads them. Columns and rows past the matrix arrive
/// as zeros.
pub fn matrix_bf16(base: DevPtr, rows: usize, cols: usize, box_rows: u32) -> Result<TensorMap> {
    const ELEM: u64 = 2;
    let bad = |why: &str| Err(Error::backend("tensor map", why.to_string()));
    if !base.0.is_multiple_of(16) || !(cols as u64 * ELEM).is_multiple_of(16) {
        return bad("the matrix's base and row stride must be 16-byte aligned");
    }
    if box_rows == 0 || box_rows > 256 || rows == 0 || cols == 0 {
        return bad("boxes of 1 to 256 rows over a non-empty matrix");
    }
    let dims = [cols as u64, rows as u64];
    encode_bf16(base, dims, &[cols as u64 * ELEM], [BOX_COLS, box_rows])
}
