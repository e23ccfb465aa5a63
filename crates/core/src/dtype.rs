//! Element types of checkpoint tensors and their widening to `f32`.

use half::{bf16, f16};

/// The tensor element types Tessera reads from checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    pub(crate) fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::F32 => Some(DType::F32),
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
        })
    }
}

/// Widen little-endian raw elements of `dtype` into `out` (same element count).
///
/// Reads byte-wise, so the source need not be aligned (safetensors data offsets are not).
pub fn widen_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * dtype.size());
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
