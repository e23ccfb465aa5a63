//! The activations a transformer block works in, shared by every family's workspace.

use tessera_backend::{Backend, QkvLayout, Role};
use tessera_core::Result;

/// Widths of a block's activations (columns per row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchDims {
    /// The model width: normed sub-block inputs and sub-block outputs.
    pub width: usize,
    /// q|k|v of one row (`QkvLayout::width`).
    pub qkv: usize,
    /// The attention output (`QkvLayout::q_cols`).
    pub attn: usize,
    /// The MLP's inner width (gate|up is twice that).
    pub mlp: usize,
}

impl ScratchDims {
    /// The widths of a block of model width `width`, attention `layout` and MLP inner width `mlp`.
    pub fn new(width: usize, layout: QkvLayout, mlp: usize) -> Self {
        ScratchDims {
            width,
            qkv: layout.width(),
            attn: layout.q_cols(),
            mlp,
        }
    }
}

/// A block's activations for up to `rows` rows, in the compute dtype. By convention a sub-block
/// reads its normed input from `a` and writes its output to `y`; `qkv`/`attn` and `gu`/`g` are
/// the attention's and the gated MLP's own.
pub struct Scratch<B: Backend> {
    pub a: B::Buf,
    pub qkv: B::Buf,
    pub attn: B::Buf,
    pub y: B::Buf,
    pub gu: B::Buf,
    pub g: B::Buf,
}

impl<B: Backend> Scratch<B> {
    pub fn alloc(be: &B, rows: usize, dims: ScratchDims) -> Result<Self> {
        let c = Role::Compute;
        Ok(Scratch {
            a: be.alloc(rows * dims.width, c)?,
            qkv: be.alloc(rows * dims.qkv, c)?,
            attn: be.alloc(rows * dims.attn, c)?,
            y: be.alloc(rows * dims.width, c)?,
            gu: be.alloc(rows * 2 * dims.mlp, c)?,
            g: be.alloc(rows * dims.mlp, c)?,
        })
    }
}

/// A number no workspace in this process had before: part of the key of every replayed region
/// (`Backend::run_graph`), so that a region captured over one workspace's buffers is never
/// replayed over another's — also across models sharing one backend.
pub fn workspace_generation() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
