//! FP8 e4m3fn (`float8_e4m3fn`, safetensors' `F8_E4M3`): one sign bit, four exponent bits
//! (bias 7), three mantissa bits, no infinities, and NaN at `S.1111.111` only — so the largest
//! finite value is 448.
//!
//! Decoding and rounding follow PyTorch's `float8_e4m3fn` casts bit for bit (both checked on all
//! inputs that matter against fixtures made with torch): NaN decodes to the quiet NaN torch
//! gives, `±0x7FF00000`; rounding is to nearest, ties to even, and torch 2.15's cast saturates:
//! every magnitude past 448, infinities included, becomes ±448, and only NaN becomes the NaN
//! code (with its sign). Scaled checkpoints and `--quantize fp8` keep the values inside ±448
//! with a scale, so saturation only matters for rounding at the top.

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// The f32 bits torch gives an e4m3fn NaN (with the code's sign).
const NAN_BITS: u32 = 0x7FF0_0000;

/// Every code's value, built at compile time.
static TABLE: [f32; 256] = table();

const fn table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = f32::from_bits(decode_bits(c as u8));
        c += 1;
    }
    t
}

/// The f32 bit pattern of code `c`.
const fn decode_bits(c: u8) -> u32 {
    let sign = ((c >> 7) as u32) << 31;
    let exp = ((c >> 3) & 0xF) as u32;
    let man = (c & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        return sign | NAN_BITS;
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // A subnormal, man · 2⁻⁹: normalise the mantissa's leading one into f32's hidden bit.
        let lead = 31 - man.leading_zeros(); // 0..=2
        let frac = (man << (23 - lead)) & 0x7F_FFFF;
        let e = lead + 127 - 9;
        return sign | (e << 23) | frac;
    }
    sign | ((exp + 127 - 7) << 23) | (man << 20)
}

/// The value of e4m3fn code `c`.
#[inline]
pub fn to_f32(c: u8) -> f32 {
    TABLE[c as usize]
}

/// `x` rounded to e4m3fn as torch's cast does: nearest, ties to even; ±448 past 448 (infinities
/// too), the NaN code for NaN.
pub fn from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = f32::from_bits(bits & 0x7FFF_FFFF);
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Below the smallest normal (2⁻⁶): subnormal steps of 2⁻⁹. The product is exact (a
        // power of two), and 8 steps are the smallest normal's code.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let abits = a.to_bits();
    let mut exp = (abits >> 23) as i32 - 127; // -6..=8; 448 = 1.75·2⁸ is never rounded past
    let frac = abits & 0x7F_FFFF;
    let mut man = frac >> 20;
    let rest = frac & 0xF_FFFF;
    if rest > 0x8_0000 || (rest == 0x8_0000 && man & 1 == 1) {
        man += 1;
        if man == 8 {
            man = 0;
            exp += 1;
        }
    }
    sign | (((exp + 7) as u8) << 3) | man as u8
}

/// Decode `codes` into `out` (same length), each value times `scale`.
pub fn decode_into(codes: &[u8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), out.len());
    if scale == 1.0 {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = to_f32(c);
        }
    } else {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = to_f32(c) * scale;
        }
    }
}

/// The scale of one row for [`quantize_row`]: its largest magnitude over 448 (1 for a row of
/// zeros, whose codes are then zeros), or `None` when the row holds a NaN or an infinity.
pub fn row_scale(row: &[f32]) -> Option<f32> {
    let mut amax = 0f32;
    for &v in row {
        if !v.is_finite() {
            return None;
        }
        amax = amax.max(v.abs());
    }
    Some(if amax == 0.0 { 1.0 } else { amax / E4M3_MAX })
}

/// Quantize `row` to e4m3fn codes in `out` with `scale` (`out[i] = fp8(row[i] / scale)`, so
/// `to_f32(out[i]) · scale` approximates `row[i]`), as torch's `(w / scale).to(float8_e4m3fn)`.
pub fn quantize_row(row: &[f32], scale: f32, out: &mut [u8]) {
    debug_assert_eq!(row.len(), out.len());
    for (o, &v) in out.iter_mut().zip(row) {
        *o = from_f32(v / scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code rounds back to itself, and every midpoint between neighbours goes to
    /// the even one (the fixture test checks the same against torch).
    #[test]
    fn codes_round_trip_and_ties_go_to_even() {
        for c in 0u8..=255 {
            let v = to_f32(c);
            if v.is_nan() {
                assert_eq!(c & 0x7F, 0x7F);
                continue;
            }
            assert_eq!(from_f32(v), c, "{c:#04x} = {v}");
        }
        for c in 0u8..0x7E {
            let (lo, hi) = (to_f32(c), to_f32(c + 1));
            let mid = (lo as f64 + hi as f64) / 2.0;
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(from_f32(mid as f32), even, "midpoint of {c:#04x}");
        }
        assert_eq!(from_f32(463.99), 0x7E);
        assert_eq!(from_f32(1e9), 0x7E);
        assert_eq!(from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(from_f32(-f32::NAN), 0xFF);
        assert_eq!(from_f32(-0.0), 0x80);
    }
}
