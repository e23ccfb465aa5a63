//! LFM2's short convolution (kernels/short_conv.cu): the outputs of every (row, channel) from the
//! old state, then each segment's state slot refreshed in place — two launches, so that no thread
//! overwrites a state value another still reads; one where every segment is a single row (a
//! decode step), whose thread per (segment, channel) is the only reader of what it overwrites.

use tessera_core::{Error, Result};

use super::launch::{ByElem, ByPair, DevPtr, cfg, kernel_args, kernel_table};
use super::memory::{ptr_of, ptr_of_mut};
use super::{CudaBackend, CudaBuf, Elem};
use crate::{Segments, ShortConv, View, ViewMut};

kernel_args! {
    /// `short_conv_{bcx}_{out}`: a thread per (row, channel), grid (rows, channel blocks); also
    /// `short_conv_step_{bcx}_{out}`'s (a thread per (one-row segment, channel), `nseg` unused).
    pub(super) struct ShortConvArgs {
        bcx: DevPtr, xs: i64, offsets: DevPtr, nseg: i32, seqs: DevPtr, state: DevPtr, slots: i32,
        weight: DevPtr, bias: DevPtr, channels: i32, kernel: i32, out: DevPtr, os: i64,
    }
}

kernel_args! {
    /// `short_conv_state_{bcx}`: a thread per (segment, channel), grid (segments, channel blocks).
    pub(super) struct ShortConvStateArgs {
        bcx: DevPtr, xs: i64, offsets: DevPtr, seqs: DevPtr, state: DevPtr, slots: i32,
        channels: i32, kernel: i32,
    }
}

kernel_table! {
    /// The kernels of short_conv.cu.
    pub(super) struct ShortConvKernels from "short_conv.cu" {
        conv: ByPair<ShortConvArgs> = "short_conv_{}_{}",
        step: ByPair<ShortConvArgs> = "short_conv_step_{}_{}",
        state: ByElem<ShortConvStateArgs> = "short_conv_state_{}",
    }
}

/// Threads per block; a block covers this many channels of one row (or segment).
const BLOCK: u32 = 128;

pub(super) fn short_conv(
    be: &CudaBackend,
    bcx: View<'_, CudaBackend>,
    conv: &ShortConv<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
    state: &mut CudaBuf,
    out: ViewMut<'_, CudaBackend>,
) -> Result<()> {
    conv.check(&bcx, &out, segs, state.len)?;
    let (c, k) = (conv.channels, conv.kernel);
    let f32_vec = |b: &CudaBuf, n: usize| b.elem == Elem::F32 && b.len == n;
    let ok = state.elem == Elem::F32
        && conv.seqs.elem == Elem::U32
        && conv.seqs.len >= 2 * segs.count()
        && f32_vec(conv.weight, c * k)
        && conv.bias.is_none_or(|b| f32_vec(b, c));
    if !ok {
        return Err(Error::backend(
            "short_conv",
            format!(
                "a {:?} state, {} sequence entries ({:?}) for {} segments, {} {:?} weights and {:?} biases for {c} channels × {k} taps",
                state.elem,
                conv.seqs.len / 2,
                conv.seqs.elem,
                segs.count(),
                conv.weight.len,
                conv.weight.elem,
                conv.bias.map(|b| (b.len, b.elem)),
            ),
        ));
    }
    let slots = state.len / conv.slot_len();
    let too_big = |v: usize| i32::try_from(v).is_err();
    if too_big(slots) || too_big(3 * c) || too_big(segs.count()) {
        return Err(Error::backend(
            "short_conv",
            format!("{slots} slots of {c} channels in {} segments", segs.count()),
        ));
    }
    if segs.count() == 0 {
        return Ok(());
    }
    let blocks = c.div_ceil(BLOCK as usize) as u32;
    let (x, xs) = (ptr_of(&bcx)?, bcx.stride as i64);
    let args = ShortConvArgs {
        bcx: x,
        xs,
        offsets: segs.dev.ptr,
        nseg: segs.count() as i32,
        seqs: conv.seqs.ptr,
        state: state.ptr,
        slots: slots as i32,
        weight: conv.weight.ptr,
        bias: conv.bias.map_or(DevPtr::NULL, |b| b.ptr),
        channels: c as i32,
        kernel: k as i32,
        out: ptr_of_mut(&out)?,
        os: out.stride as i64,
    };
    // A decode step: outputs and state in one launch (grid: segments).
    if be.fuse.conv && segs.offsets.windows(2).all(|w| w[1] == w[0] + 1) {
        return be.launch(
            "conv",
            be.kernels.short_conv.step.get(bcx.buf.elem, out.buf.elem)?,
            cfg((segs.count() as u32, blocks), BLOCK, 0),
            &args,
        );
    }
    // Every output first, from the old state (a launch with no rows launches nothing).
    be.launch(
        "conv",
        be.kernels.short_conv.conv.get(bcx.buf.elem, out.buf.elem)?,
        cfg((bcx.rows as u32, blocks), BLOCK, 0),
        &args,
    )?;
    let args = ShortConvStateArgs {
        bcx: x,
        xs,
        offsets: segs.dev.ptr,
        seqs: conv.seqs.ptr,
        state: state.ptr,
        slots: slots as i32,
        channels: c as i32,
        kernel: k as i32,
    };
    be.launch(
        "conv",
        be.kernels.short_conv.state.get(bcx.buf.elem)?,
        cfg((segs.count() as u32, blocks), BLOCK, 0),
        &args,
    )
}
