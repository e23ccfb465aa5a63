//! Storage types of checkpoint tensors — floats, ggml's quantized block formats and FP8 — and
//! their widening to `f32`.

use half::{bf16, f16};

use crate::gguf::GgmlType;

/// The storage types Tessera reads: the float types (from safetensors or GGUF), the block
/// formats of GGUF files and of `--quantize`, whose values come in blocks of
/// [`DType::block_size`] elements taking [`DType::block_bytes`] bytes (a float type's block is
/// one element), and FP8 e4m3fn (safetensors' `F8_E4M3`, or `--quantize fp8`): one byte a value,
/// counted with the quantized formats because its values mean something only with the scale
/// beside them (`Tensor::scale`; per row once a backend holds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names, as every GGUF tool prints them
pub enum DType {
    BF16,
    F16,
    F32,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
    F8_E4M3,
}

impl DType {
    /// Bytes per element of a float type; `None` for a block format or FP8 (see
    /// [`DType::bytes_for`]).
    pub fn size(self) -> Option<usize> {
        match self {
            DType::BF16 | DType::F16 => Some(2),
            DType::F32 => Some(4),
            _ => None,
        }
    }

    /// Whether values are stored in quantized blocks (with scales) rather than one by one.
    pub fn is_quantized(self) -> bool {
        self.size().is_none()
    }

    /// The ggml type with this layout (`None` for FP8, which GGUF does not have).
    pub fn ggml(self) -> Option<GgmlType> {
        Some(match self {
            DType::BF16 => GgmlType::BF16,
            DType::F16 => GgmlType::F16,
            DType::F32 => GgmlType::F32,
            DType::Q8_0 => GgmlType::Q8_0,
            DType::Q4_0 => GgmlType::Q4_0,
            DType::Q4_K => GgmlType::Q4_K,
            DType::Q6_K => GgmlType::Q6_K,
            DType::F8_E4M3 => return None,
        })
    }

    /// The storage type of ggml type `t` (every type Tessera decodes has one).
    pub fn from_ggml(t: GgmlType) -> Self {
        match t {
            GgmlType::BF16 => DType::BF16,
            GgmlType::F16 => DType::F16,
            GgmlType::F32 => DType::F32,
            GgmlType::Q8_0 => DType::Q8_0,
            GgmlType::Q4_0 => DType::Q4_0,
            GgmlType::Q4_K => DType::Q4_K,
            GgmlType::Q6_K => DType::Q6_K,
        }
    }

    /// Elements per block (1 for the float types and FP8).
    pub fn block_size(self) -> usize {
        self.ggml().map_or(1, |g| g.block_size())
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.ggml().map_or(1, |g| g.block_bytes())
    }

    /// Bytes that `n` elements take (their scales aside), or `None` when `n` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        match self.ggml() {
            Some(g) => g.bytes_for(n),
            None => Some(n),
        }
    }

    pub(crate) fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F8_E4M3 => Some(DType::F8_E4M3),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_K => "Q4_K",
            DType::Q6_K => "Q6_K",
            DType::F8_E4M3 => "F8_E4M3",
        })
    }
}

/// Widen little-endian raw elements of `dtype` into `out` (same element count).
///
/// Reads byte-wise, so the source need not be aligned (safetensors data offsets are not). Block
/// formats decode whole blocks bit-exactly as llama.cpp's `gguf` package does; `bytes` must then
/// hold exactly `out`'s blocks (the callers slice at block boundaries). FP8 decodes as torch's
/// `float8_e4m3fn → float32`, unscaled (the scale is the tensor's: `Tensor::read_f32_range`).
pub fn widen_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(Some(bytes.len()), dtype.bytes_for(out.len()));
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F8_E4M3 => crate::fp8::decode_into(bytes, 1.0, out),
        DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q6_K => {
            // Sizes are the caller's to check (debug-asserted above); a mismatch reads as NaN.
            let decoded = dtype.ggml().map(|g| g.dequantize(bytes, out));
            if !matches!(decoded, Some(Ok(_))) {
                out.fill(f32::NAN);
            }
        }
    }
}

/// Round `f32` values to bf16 bit patterns (round to nearest even), as weights go to the GPU.
pub fn to_bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_matches_half() {
        let vals = [0.0f32, -1.5, 3.140625, 65504.0, 1e-3];
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let hf: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let f: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = [0f32; 5];
        widen_into(DType::F32, &f, &mut out);
        assert_eq!(out, vals);
        widen_into(DType::BF16, &bf, &mut out);
        for (o, v) in out.iter().zip(vals) {
            assert_eq!(*o, bf16::from_f32(v).to_f32());
        }
        widen_into(DType::F16, &hf, &mut out);
        for (o, v) in out.iter().zip(vals) {
            assert_eq!(*o, f16::from_f32(v).to_f32());
        }
    }
}
