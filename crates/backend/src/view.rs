//! Row-major 2-D windows into backend buffers.

use tessera_core::{Error, Result};

use crate::Backend;

/// A read-only `[rows, cols]` window starting at element `offset`, rows `stride` elements apart.
pub struct View<'a, B: Backend> {
    pub buf: &'a B::Buf,
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl<B: Backend> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for View<'_, B> {}

impl<'a, B: Backend> View<'a, B> {
    /// The first `rows × cols` elements of `buf`, densely packed.
    pub fn new(buf: &'a B::Buf, rows: usize, cols: usize) -> Self {
        View {
            buf,
            offset: 0,
            rows,
            cols,
            stride: cols,
        }
    }

    /// Columns `[start, start + cols)` of every row.
    pub fn cols(self, start: usize, cols: usize) -> Self {
        debug_assert!(start + cols <= self.cols);
        View {
            offset: self.offset + start,
            cols,
            ..self
        }
    }

    /// Rows `[start, start + rows)`.
    pub fn rows(self, start: usize, rows: usize) -> Self {
        debug_assert!(start + rows <= self.rows);
        View {
            offset: self.offset + start * self.stride,
            rows,
            ..self
        }
    }

    /// Index of the last element touched plus one (for bounds checks).
    pub fn end(&self) -> usize {
        if self.rows == 0 {
            self.offset
        } else {
            self.offset + (self.rows - 1) * self.stride + self.cols
        }
    }
}

/// A writable `[rows, cols]` window (see [`View`]).
pub struct ViewMut<'a, B: Backend> {
    pub buf: &'a mut B::Buf,
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl<'a, B: Backend> ViewMut<'a, B> {
    pub fn new(buf: &'a mut B::Buf, rows: usize, cols: usize) -> Self {
        ViewMut {
            buf,
            offset: 0,
            rows,
            cols,
            stride: cols,
        }
    }

    pub fn cols(self, start: usize, cols: usize) -> Self {
        debug_assert!(start + cols <= self.cols);
        ViewMut {
            offset: self.offset + start,
            cols,
            ..self
        }
    }

    pub fn rows(self, start: usize, rows: usize) -> Self {
        debug_assert!(start + rows <= self.rows);
        ViewMut {
            offset: self.offset + start * self.stride,
            rows,
            ..self
        }
    }

    /// Reborrow as read-only.
    pub fn as_view(&self) -> View<'_, B> {
        View {
            buf: self.buf,
            offset: self.offset,
            rows: self.rows,
            cols: self.cols,
            stride: self.stride,
        }
    }

    /// Reborrow mutably for a shorter lifetime.
    pub fn reborrow(&mut self) -> ViewMut<'_, B> {
        ViewMut {
            buf: self.buf,
            offset: self.offset,
            rows: self.rows,
            cols: self.cols,
            stride: self.stride,
        }
    }

    pub fn end(&self) -> usize {
        self.as_view().end()
    }
}

/// Check that two `(rows, cols)` shapes an op pairs up agree.
pub(crate) fn same_shape(op: &str, a: (usize, usize), b: (usize, usize)) -> Result<()> {
    if a != b {
        return Err(Error::backend(
            op,
            format!("shape mismatch: {}×{} vs {}×{}", a.0, a.1, b.0, b.1),
        ));
    }
    Ok(())
}
