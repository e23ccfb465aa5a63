//! Q4_0: blocks of 32 values, an f16 scale `d` then 16 bytes of 4-bit `q`; value = `(q - 8) * d`.
//! Byte `j`'s low nibble is element `j`, its high nibble element `j + 16`.

use super::f16_at;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 2 + BLOCK / 2;

/// Decode whole blocks; the caller has checked that `bytes` holds exactly `out`'s blocks.
pub(super) fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .as_chunks::<BYTES>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<BLOCK>().0)
    {
        let d = f16_at([b[0], b[1]]);
        let (lo, hi) = o.split_at_mut(BLOCK / 2);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[2..]) {
            *l = f32::from(i16::from(q & 0x0f) - 8) * d;
            *h = f32::from(i16::from(q >> 4) - 8) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_nibbles_fill_the_first_half() {
        let mut block = [0x88u8; BYTES]; // every q = 8: zero
        block[..2].copy_from_slice(&half::f16::from_f32(2.0).to_le_bytes());
        block[2] = 0xf0; // element 0: q 0, element 16: q 15
        block[17] = 0x19; // element 15: q 9, element 31: q 1
        let mut out = [1f32; BLOCK];
        dequantize(&block, &mut out);
        assert_eq!(
            (out[0], out[16], out[15], out[31]),
            (-16.0, 14.0, 2.0, -14.0)
        );
        assert_eq!(out[1..15], [0.0; 14]);
    }
}
