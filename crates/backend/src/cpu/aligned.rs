//! Buffers whose first element sits on a cache line (64 bytes).
//!
//! The allocator aligns a `Vec<f32>` to 16 bytes at best, so each 64-byte row of an AMX tile
//! (and each 64-byte AVX-512 load) read from one straddles two cache lines. On the Xeons with
//! AMX this matters a great deal: a `tileloadd` of rows split across lines took ~6× as long as
//! one of aligned rows (20 ns against 3.4 ns a tile, measured), enough to make the products'
//! tile loads, not the multiplies, their limit.

use std::ops::{Deref, DerefMut};

/// The alignment every buffer here starts on.
pub const LINE: usize = 64;

/// `len` elements starting on a cache line, over a `Vec` a line longer than they need.
pub struct Aligned<E> {
    buf: Vec<E>,
    start: usize,
    len: usize,
}

impl<E: Clone + Default> Aligned<E> {
    /// `len` default (zero) elements.
    pub fn zeroed(len: usize) -> Self {
        let mut a = Aligned {
            buf: Vec::new(),
            start: 0,
            len: 0,
        };
        a.resize(len);
        a
    }

    /// Makes the buffer `len` elements long, still aligned; what it held before is not kept in
    /// place (callers overwrite it), only its allocation reused where it is large enough.
    pub fn resize(&mut self, len: usize) {
        let size = std::mem::size_of::<E>().max(1);
        let spare = LINE.div_ceil(size);
        if self.buf.len() < len + spare {
            self.buf.resize(len + spare, E::default());
        }
        // The first element at or after the buffer's start that lies on a line (an element's
        // size divides 64 for every type used here; otherwise the start is as close as it gets).
        let misaligned = self.buf.as_ptr() as usize % LINE;
        self.start = match misaligned {
            0 => 0,
            m => ((LINE - m) / size).min(spare),
        };
        self.len = len;
    }
}

impl<E> Deref for Aligned<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<E> DerefMut for Aligned<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_line_at_every_size() {
        let mut a = Aligned::<u32>::zeroed(0);
        for len in [0, 1, 15, 16, 17, 1000, 3, 65_536, 10] {
            a.resize(len);
            assert_eq!(a.len(), len);
            assert_eq!(a.as_ptr() as usize % LINE, 0, "len {len}");
            a.iter_mut().for_each(|x| *x = 7);
        }
        let f = Aligned::<f32>::zeroed(33);
        assert!(f.iter().all(|&x| x == 0.0));
        assert_eq!(f.as_ptr() as usize % LINE, 0);
    }
}
