//! Q8_0: blocks of 32 values, an f16 scale `d` then 32 signed bytes `q`; value = `q * d`.

use super::f16_at;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 2 + BLOCK;

/// Decode whole blocks; the caller has checked that `bytes` holds exactly `out`'s blocks.
pub(super) fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .as_chunks::<BYTES>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<BLOCK>().0)
    {
        let d = f16_at([b[0], b[1]]);
        for (o, &q) in o.iter_mut().zip(&b[2..]) {
            *o = f32::from(q as i8) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_signed_bytes_times_the_scale() {
        let mut block = [0u8; BYTES];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        block[2] = 0x80; // -128
        block[3] = 0x7f;
        block[33] = 0xff; // -1
        let mut out = [1f32; BLOCK];
        dequantize(&block, &mut out);
        assert_eq!((out[0], out[1], out[2], out[31]), (-64.0, 63.5, 0.0, -0.5));
    }
}
