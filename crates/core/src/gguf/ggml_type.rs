//! The ggml tensor types Tessera decodes, their block geometry, and dequantization to `f32`.

use std::fmt;

use half::f16;

use super::{k_quants, q4_0, q8_0};
use crate::error::{Error, Result};

/// A tensor's storage type, by its ggml id. Values are stored in blocks of [`Self::block_size`]
/// elements taking [`Self::block_bytes`] bytes (one element per block for the float types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names, as every GGUF tool prints them
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
}

impl GgmlType {
    pub const ALL: [GgmlType; 7] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];

    /// The type with ggml id `id`, or an error message naming the id (and ggml's name for it,
    /// when it is a ggml type Tessera does not decode).
    pub fn from_id(id: u32) -> std::result::Result<Self, String> {
        Self::ALL.into_iter().find(|t| t.id() == id).ok_or_else(|| {
            let supported: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
            let what = match other_type_name(id) {
                Some(name) => format!("ggml type {name} (id {id}) is not supported"),
                None => format!("unknown ggml type id {id}"),
            };
            format!("{what}; Tessera reads {}", supported.join(", "))
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 => q8_0::BLOCK,
            GgmlType::Q4_0 => q4_0::BLOCK,
            GgmlType::Q4_K => k_quants::Q4_K_BLOCK,
            GgmlType::Q6_K => k_quants::Q6_K_BLOCK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => q8_0::BYTES,
            GgmlType::Q4_0 => q4_0::BYTES,
            GgmlType::Q4_K => k_quants::Q4_K_BYTES,
            GgmlType::Q6_K => k_quants::Q6_K_BYTES,
        }
    }

    /// Bytes that `n` elements take, or `None` when `n` is not a whole number of blocks or the
    /// size overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }

    /// Decode whole blocks: `bytes` must hold exactly the blocks of `out.len()` elements.
    ///
    /// Bit-exact with llama.cpp's `gguf` Python package (`gguf.quants.dequantize`): each scale
    /// product is rounded to `f32` in the same order, and no multiply-add is fused.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        if self.bytes_for(out.len()) != Some(bytes.len()) {
            return Err(Error::input(format!(
                "{self}: {} bytes do not hold {} elements (blocks of {} elements in {} bytes)",
                bytes.len(),
                out.len(),
                self.block_size(),
                self.block_bytes()
            )));
        }
        match self {
            GgmlType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                    *o = f32::from_le_bytes(*b);
                }
            }
            GgmlType::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *o = f16::from_le_bytes(*b).to_f32();
                }
            }
            // The top half of an f32, kept bit for bit (NaN payloads included), as ggml does.
            GgmlType::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
                }
            }
            GgmlType::Q8_0 => q8_0::dequantize(bytes, out),
            GgmlType::Q4_0 => q4_0::dequantize(bytes, out),
            GgmlType::Q4_K => k_quants::dequantize_q4_k(bytes, out),
            GgmlType::Q6_K => k_quants::dequantize_q6_k(bytes, out),
        }
        Ok(())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// ggml's names for the types Tessera does not decode, so an error can say what a file holds.
fn other_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        13 => "Q5_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_others_are_named() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Ok(t));
        }
        let e = GgmlType::from_id(13).unwrap_err();
        assert!(e.contains("Q5_K (id 13) is not supported"), "{e}");
        let e = GgmlType::from_id(1000).unwrap_err();
        assert!(e.starts_with("unknown ggml type id 1000"), "{e}");
    }

    #[test]
    fn sizes_must_be_whole_blocks() {
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::F32.bytes_for(usize::MAX), None);
        let mut out = [0f32; 32];
        assert!(GgmlType::Q8_0.dequantize(&[0; 33], &mut out).is_err());
    }
}
