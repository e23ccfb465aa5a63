//! Attention over cached key ranges (`attn_cached_{T}_d{D}` in kernels/attention.cu): decoding
//! steps and prompts appended to a cache, in both precisions and under every mask, and how many
//! chunks each query row's keys are split into.
//!
//! Decoding is one query row per sequence, so the work is (row, kv head) pairs — few — times
//! keys — many: the kernel takes a CTA per (query row, block of up to four q heads sharing a kv
//! head, key chunk), and a split launch is combined by `attn_cached_combine_{T}` ("flash
//! decoding"). A prompt appended to a cache runs the same kernel a row at a time, each row walking
//! its own visible keys: correct at any length, but no tensor cores.
//!
//! The chunk count depends only on the launch's rows, heads and the longest range, and the kernel
//! cuts each row's own visible keys into that many chunks, so any count covers every key.
//!
//! Without key ranges the same kernel attends each segment's own rows (the device's segment
//! offsets stand in for the ranges, so nothing is uploaded): f32 self-attention wider than the
//! row kernel's 512 (1152: Qwen-Image-2.1's VAE), and with `TESSERA_FLASH_LIMITS=0` bf16
//! self-attention under per-row key limits (the flash kernels read them otherwise).

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

use super::flash::{PART_ELEMS, part_elems};
use super::{CachedArgs, CachedCombineArgs, Operands, flash_workspace};
use crate::cuda::launch::{DevPtr, cfg};
use crate::cuda::{CudaBackend, Elem};
use crate::{AttnSpec, Mask, Segments, View, ViewMut};

/// Head widths the cached kernel is instantiated for (each a multiple of 4, as its key loads
/// need).
pub const CACHED_HEAD_DIMS: [usize; 10] = [16, 32, 64, 72, 80, 96, 128, 256, 768, 1152];

/// q heads per CTA at `head_dim` (`CachedCfg<D>::HEADS` in attention.cu): a kv head's group of q
/// heads takes ⌈group / heads⌉ CTAs per row and chunk. Four share each key load up to 256-wide
/// heads; wider heads take one, which keeps the CTA's shared memory and accumulators small.
pub fn heads_per_cta(head_dim: usize) -> usize {
    if head_dim > 256 { 1 } else { 4 }
}

/// Threads per CTA (`CACHED_WARPS` warps in attention.cu).
const THREADS: u32 = 128;

/// Most key chunks per query row.
pub const MAX_CACHED_SPLITS: usize = 64;

/// CTAs per multiprocessor a planned split aims for: each has 4 warps, at most 72 registers a
/// thread and 5 KB (64-wide heads) to 20 KB (256) of static shared memory, so that many fit at
/// once, and streaming the keys needs that many warps in flight. (1152-wide heads take more
/// registers, so fewer fit; their launches are self-attention over thousands of rows, which the
/// rows alone fill.)
const CTAS_PER_SM: usize = 8;

/// Keys a planned chunk holds at least: a 32-key block for each of the CTA's warps.
const MIN_CHUNK_KEYS: usize = 128;

/// Key chunks per query row for a launch of `units` CTAs per chunk on `sms` multiprocessors, when
/// the longest key range holds `keys`: enough chunks to give each multiprocessor
/// [`CTAS_PER_SM`] CTAs, but no chunk of fewer than [`MIN_CHUNK_KEYS`] keys of the longest range.
pub fn cached_splits(units: usize, sms: usize, keys: usize) -> usize {
    let fill = (sms * CTAS_PER_SM).div_ceil(units.max(1));
    fill.min(keys.div_ceil(MIN_CHUNK_KEYS))
        .clamp(1, MAX_CACHED_SPLITS)
}

/// The attention op over `spec.kv`, or without key ranges over each segment's own rows, with
/// `force` fixing the key chunks per row (tests); returns the chunk count used (1 when a split
/// would not fit the workspace).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    be: &CudaBackend,
    q: View<'_, CudaBackend>,
    k: View<'_, CudaBackend>,
    v: View<'_, CudaBackend>,
    out: ViewMut<'_, CudaBackend>,
    spec: &AttnSpec<'_, CudaBackend>,
    segs: &Segments<CudaBackend>,
    force: Option<usize>,
) -> Result<usize> {
    spec.check(&q, &k, &v, &out, segs)?;
    let (hd, rows) = (spec.head_dim, segs.total());
    let elem = q.buf.elem;
    let elems = [q.buf.elem, k.buf.elem, v.buf.elem, out.buf.elem];
    if elems.iter().any(|&e| e != elem) {
        return Err(Error::backend(
            "attention",
            format!("over key ranges q, k, v and out must share one element type, not {elems:?}"),
        ));
    }
    let table = &be.kernels.attention;
    let kernel = match elem {
        Elem::F32 => table.cached_f32.get(hd),
        Elem::Bf16 => table.cached_bf16.get(hd),
        Elem::U32 => None,
    }
    .ok_or_else(|| {
        Error::backend(
            "attention",
            format!(
                "no {elem:?} kernel over key ranges for head_dim {hd} (have {CACHED_HEAD_DIMS:?})"
            ),
        )
    })?;
    let (window, causal, limits) = match spec.mask {
        Mask::Full => (-1, 0, DevPtr::NULL),
        Mask::Window(w) => (w.min(i32::MAX as usize) as i32, 0, DevPtr::NULL),
        Mask::Causal => (-1, 1, DevPtr::NULL),
        Mask::Limits(l) => {
            if l.elem != Elem::U32 || l.len < rows {
                return Err(Error::backend(
                    "attention",
                    format!("{} key limits ({:?}) for {rows} query rows", l.len, l.elem),
                ));
            }
            (-1, 0, l.ptr)
        }
    };
    // The longest key range, and the device ranges (null: each segment's own rows).
    let (keys, ranges) = match spec.kv {
        Some(kv) => {
            if kv.dev.elem != Elem::U32 || kv.dev.len < 2 * segs.count() {
                return Err(Error::backend(
                    "attention",
                    format!(
                        "{} key-range entries for {} segments",
                        kv.dev.len / 2,
                        segs.count()
                    ),
                ));
            }
            let keys = kv.ranges.iter().map(|r| r.1 as usize).max().unwrap_or(0);
            (keys, kv.dev.ptr)
        }
        None => (segs.max_len(), DevPtr::NULL),
    };
    let group = spec.heads_q / spec.heads_kv;
    let blocks = spec.heads_kv * group.div_ceil(heads_per_cta(hd));
    if rows > i32::MAX as usize || blocks > u16::MAX as usize || segs.count() > i32::MAX as usize {
        return Err(Error::backend(
            "attention",
            format!("{rows} query rows × {blocks} head blocks exceed the cached kernel's grid"),
        ));
    }
    if rows == 0 {
        return Ok(1);
    }
    let splits = match force {
        Some(s) => s.clamp(1, MAX_CACHED_SPLITS),
        None => cached_splits(rows * blocks, be.sm_count as usize, keys),
    };
    let fits = part_elems(splits, rows, spec.heads_q, hd) <= PART_ELEMS;
    let splits = if splits > 1 && fits { splits } else { 1 };
    let part = if splits > 1 {
        flash_workspace(be)?
    } else {
        DevPtr::NULL
    };
    let args = CachedArgs {
        ops: Operands::of(&q, &k, &v, &out)?,
        offsets: segs.dev.ptr,
        nseg: segs.count() as i32,
        ranges,
        limits,
        hq: spec.heads_q as i32,
        group: group as i32,
        scale_log2: spec.scale * std::f32::consts::LOG2_E,
        window,
        causal,
        part,
    };
    let config = LaunchConfig {
        grid_dim: (rows as u32, blocks as u32, splits as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    be.launch("attention", kernel, config, &args)?;
    if splits > 1 {
        let warps = rows * spec.heads_q;
        let combine = CachedCombineArgs {
            part,
            o: args.ops.o,
            os: args.ops.os,
            rows: rows as i32,
            heads: spec.heads_q as i32,
            d: hd as i32,
            splits: splits as i32,
        };
        be.launch(
            "attention",
            table.cached_combine.get(elem)?,
            cfg((warps.div_ceil(8) as u32, 1), 256, 0),
            &combine,
        )?;
    }
    Ok(splits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_a_batch_splits_long_ranges() {
        // 8 sequences × 8 kv heads on 132 SMs, up to 3,000 keys: 17 chunks of ≥ 177 keys.
        assert_eq!(cached_splits(64, 132, 3000), 17);
        // One sequence, 32k keys: as many chunks as allowed.
        assert_eq!(cached_splits(8, 132, 32768), MAX_CACHED_SPLITS);
    }

    #[test]
    fn short_ranges_and_prompts_are_not_split() {
        // Decoding short sequences: one chunk of at most 128 keys.
        assert_eq!(cached_splits(64, 132, 100), 1);
        // A 2,000-row prompt appended to a cache fills the GPU by rows.
        assert_eq!(cached_splits(2000 * 8, 132, 4000), 1);
        assert_eq!(cached_splits(0, 132, 0), 1);
    }
}
