//! The k-quants Q4_K and Q6_K: super-blocks of 256 values in sub-blocks that each carry a small
//! integer scale, itself scaled by the super-block's f16 `d` (llama.cpp's `block_q4_K`,
//! `block_q6_K` in ggml-common.h).

use super::f16_at;

/// Values per super-block (ggml's `QK_K`).
const QK_K: usize = 256;

pub const Q4_K_BLOCK: usize = QK_K;
/// `d`, `dmin` (f16 each), 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles.
pub const Q4_K_BYTES: usize = 2 + 2 + 12 + QK_K / 2;

pub const Q6_K_BLOCK: usize = QK_K;
/// 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit scales, `d` (f16).
pub const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

/// Sub-block `j`'s (scale, min) from Q4_K's 12 packed bytes: eight 6-bit scales and eight 6-bit
/// mins. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` (scale) and `j + 4` (min);
/// sub-blocks 4..8 take their low 4 bits from byte `j + 4` (scale low, min high nibble) and their
/// top 2 bits from the spare top bits of bytes `j - 4` and `j`.
pub fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: eight sub-blocks of 32; value = `(d * scale) * q - (dmin * min)` with `q` a nibble.
/// Each 32-byte run of `qs` serves two consecutive sub-blocks: low nibbles, then high.
pub(super) fn dequantize_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .as_chunks::<Q4_K_BYTES>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<QK_K>().0)
    {
        let d = f16_at([b[0], b[1]]);
        let dmin = f16_at([b[2], b[3]]);
        let (scales, qs) = b[4..].split_at(12);
        for (j, sub) in o.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min(scales, j);
            let ds = d * f32::from(sc);
            let ms = dmin * f32::from(m);
            let shift = 4 * (j % 2);
            let run = &qs[32 * (j / 2)..][..32];
            for (o, &q) in sub.iter_mut().zip(run) {
                *o = ds * f32::from((q >> shift) & 0x0f) - ms;
            }
        }
    }
}

/// Q6_K: sixteen sub-blocks of 16 with signed 8-bit scales; value = `(d * scale) * (q - 32)`
/// with `q` six bits, the low four from `ql` and the top two from `qh`. Each half of 128 values
/// reads 64 bytes of `ql` (low nibbles for values 0..64, high for 64..128) and 32 of `qh` (bit
/// pairs 0, 2, 4, 6 for values 0..32, 32..64, 64..96, 96..128).
pub(super) fn dequantize_q6_k(bytes: &[u8], out: &mut [f32]) {
    let mut codes = [0i8; QK_K];
    for (b, o) in bytes
        .as_chunks::<Q6_K_BYTES>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<QK_K>().0)
    {
        let (scales, d) = q6_k_codes(b, &mut codes);
        let ds: [f32; 16] = std::array::from_fn(|s| d * f32::from(scales[s]));
        for (r, (o, &q)) in o.iter_mut().zip(&codes).enumerate() {
            *o = ds[r / 16] * f32::from(q);
        }
    }
}

/// One Q6_K super-block `b` (its first [`Q6_K_BYTES`] bytes) as its 256 codes `q − 32` in order (into `out`), its
/// 16 signed scales (one per 16 values) and `d`: value `r` is `(d · scales[r / 16]) · out[r]`.
/// Shared by the decoder above and the int8 products, which pair these codes with activations.
pub fn q6_k_codes(b: &[u8], out: &mut [i8; QK_K]) -> ([i8; 16], f32) {
    let (ql, rest) = b.split_at(QK_K / 2);
    let (qh, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    for (h, half) in out.chunks_exact_mut(128).enumerate() {
        let (ql, qh) = (&ql[64 * h..][..64], &qh[32 * h..][..32]);
        // Byte `l` of `ql` and `qh` serves values `l` and `l + 64` (low / high nibble) and
        // `l + 32`, `l + 96` via byte `l + 32` of `ql`.
        for l in 0..32 {
            let (a, c, hb) = (ql[l], ql[l + 32], qh[l]);
            let q = [
                (a & 0x0f) | ((hb & 0x03) << 4),
                (c & 0x0f) | (((hb >> 2) & 0x03) << 4),
                (a >> 4) | (((hb >> 4) & 0x03) << 4),
                (c >> 4) | (((hb >> 6) & 0x03) << 4),
            ];
            for (quarter, q) in q.into_iter().enumerate() {
                half[32 * quarter + l] = q as i8 - 32;
            }
        }
    }
    (
        std::array::from_fn(|j| scales[j] as i8),
        f16_at([d[0], d[1]]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scales_and_mins_unpack_six_bits() {
        // Sub-block 5: scale = low nibble of byte 9 | top bits of byte 1 → 0b11_0101 = 53;
        // min = high nibble of byte 9 | top bits of byte 5 → 0b10_0110 = 38.
        let mut s = [0u8; 12];
        s[9] = 0x65;
        s[1] = 0b1100_0000 | 7; // sub-block 1's scale 7
        s[5] = 0b1000_0000 | 9; // sub-block 1's min 9
        assert_eq!(scale_min(&s, 5), (53, 38));
        assert_eq!(scale_min(&s, 1), (7, 9));
    }

    #[test]
    fn q4_k_high_nibbles_are_the_odd_sub_blocks() {
        let mut b = [0u8; Q4_K_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[4 + 2] = 3; // sub-block 2's scale
        b[4 + 3] = 5; // sub-block 3's scale
        b[4 + 7] = 4; // sub-block 3's min
        b[16 + 32] = 0x92; // first byte of the run of sub-blocks 2 and 3
        let mut out = [0f32; QK_K];
        dequantize_q4_k(&b, &mut out);
        assert_eq!(out[64], 3.0 * 2.0); // low nibble 2, min 0
        assert_eq!(out[96], 5.0 * 9.0 - 0.5 * 4.0); // high nibble 9
    }

    #[test]
    fn q6_k_bits_come_from_the_layout_llama_cpp_writes() {
        let mut b = [0u8; Q6_K_BYTES];
        b[208..].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
        // Value 128 + 97 (second half, r = 97): ql byte 64 + 33, high nibble; qh byte 32 + 1,
        // bits 6..8; scale (128 + 97) / 16 = 14.
        b[64 + 33] = 0xa0; // low 4 bits 10
        b[128 + 32 + 1] = 0b1100_0000; // top 2 bits 3
        b[192 + 14] = (-2i8) as u8;
        b[192 + 10] = 3;
        let mut out = [0f32; QK_K];
        dequantize_q6_k(&b, &mut out);
        assert_eq!(out[225], 0.25 * -2.0 * f32::from((10i16 | (3 << 4)) - 32));
        // r = 33 shares both bytes but reads the low nibble (0) and qh bits 2..4 (0): q = -32.
        assert_eq!(out[128 + 33], 0.25 * 3.0 * -32.0);
    }
}
