//! Launch planning for the flash-attention kernel: how many chunks each query tile's keys are
//! split into when the tiles alone would leave the GPU partly idle (one long sequence: W2, a
//! single image), and the fixed workspace those chunks are combined from.

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

use super::{CudaBackend, Elem, addr, attention_operands, cfg, drv, f, i, kernels, window_arg};
use crate::{AttnSpec, Backend, Role, Segments, View, ViewMut};

/// Which attention kernel a bf16 launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// `flash_bf16_d{D}` (mma.sync): every GPU from sm_80, every head width.
    Mma,
    /// `flash_wgmma_d{D}` (Hopper's warpgroup MMA): sm_90a, head widths in
    /// `kernels::WGMMA_HEAD_DIMS`. The default wherever it applies.
    Wgmma,
}

/// Choices a test or benchmark fixes for one launch; `None` leaves it to the op.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlashChoice {
    /// Key chunks per tile (1..=`MAX_KV_SPLITS`).
    pub splits: Option<usize>,
    pub kernel: Option<FlashKernel>,
}

/// Most key chunks per tile.
pub const MAX_KV_SPLITS: usize = 8;

/// The split-key workspace in f32 elements (128 MiB), allocated once on first use so that the
/// address captured into CUDA graphs never changes; a split that would not fit is not made.
pub const PART_ELEMS: usize = 32 << 20;

/// What one chunk costs beyond its key blocks, in key blocks: loading its query tile, writing
/// its f32 partial output, and the combine pass reading it back. Fitted to the H200 sweep of
/// `tessera bench attention` (run 11: W2's full layers are fastest at 3–4 chunks).
const CHUNK_OVERHEAD_BLOCKS: usize = 4;

/// Key chunks per tile for a launch of `ctas` blocks on `slots` resident-block slots
/// (multiprocessors × blocks each), when a tile sees at most `keys` keys, walked `bn` at a time.
///
/// A launch that fits in one wave is not split: its blocks already share the multiprocessors
/// (run 11: W2's sliding layers, 140 blocks on 264 slots, were slowest split). Otherwise time
/// is modelled as whole waves of chunk work: `⌈ctas·s / slots⌉ · (⌈blocks / s⌉ + overhead)`,
/// which splits a launch whose last wave is nearly empty (W2's full layers: 280 blocks on 264
/// slots) and leaves short sequences (a few key blocks each) whole.
pub fn kv_splits(ctas: usize, slots: usize, keys: usize, bn: usize) -> usize {
    if ctas <= slots || slots == 0 {
        return 1;
    }
    let blocks = keys.div_ceil(bn.max(1)).max(1);
    let cost = |s: usize| (ctas * s).div_ceil(slots) * (blocks.div_ceil(s) + CHUNK_OVERHEAD_BLOCKS);
    (1..=MAX_KV_SPLITS.min(blocks))
        .min_by_key(|&s| cost(s))
        .unwrap_or(1)
}

/// Workspace elements a split launch needs: per chunk, a `[rows][heads][head_dim]` output and a
/// `[rows][heads]` log2-sum-exp.
pub fn part_elems(splits: usize, rows: usize, heads: usize, head_dim: usize) -> usize {
    splits * rows * heads * (head_dim + 1)
}

impl CudaBackend {
    /// bf16 attention on the tensor cores over the query tiles of `segs` — `flash_wgmma_d{D}` on
    /// Hopper where it exists, else `flash_bf16_d{D}` — with the keys split into chunks and
    /// `flash_combine` after it when that fills the GPU better. `force` fixes either choice
    /// (tests, benchmarks); returns the chunk count used.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec,
        segs: &Segments<Self>,
        force: FlashChoice,
    ) -> Result<usize> {
        let hd = spec.head_dim;
        let total = segs.total();
        spec.check(&q, &k, &v, &out, total)?;
        for view in [&q, &k, &v] {
            if view.buf.elem != Elem::Bf16
                || !view.offset.is_multiple_of(8)
                || !view.stride.is_multiple_of(8)
            {
                return Err(Error::backend(
                    "attention",
                    "bf16 attention needs bf16 operands at 16-byte-aligned rows",
                ));
            }
        }
        if out.buf.elem != Elem::Bf16 {
            return Err(Error::backend(
                "attention",
                "bf16 attention writes a bf16 output",
            ));
        }
        if !kernels::FLASH_HEAD_DIMS.contains(&hd) {
            return Err(Error::backend(
                "attention",
                format!(
                    "head_dim {hd} has no tensor-core kernel (supported: {:?})",
                    kernels::FLASH_HEAD_DIMS
                ),
            ));
        }
        let hopper = kernels::wgmma_applies(&self.arch, hd);
        let kernel = match force.kernel {
            Some(FlashKernel::Wgmma) if !hopper => {
                return Err(Error::backend(
                    "attention",
                    format!(
                        "the wgmma kernel needs sm_90a and head_dim in {:?} (here {}, head_dim {hd})",
                        kernels::WGMMA_HEAD_DIMS,
                        self.arch
                    ),
                ));
            }
            Some(k) => k,
            None if hopper => FlashKernel::Wgmma,
            None => FlashKernel::Mma,
        };
        let (name, fc) = match kernel {
            FlashKernel::Mma => (kernels::flash_name(hd), kernels::flash_config(hd)),
            FlashKernel::Wgmma => (kernels::wgmma_name(hd), kernels::wgmma_config(hd)),
        };
        let splits = match force.splits {
            Some(s) => s.clamp(1, MAX_KV_SPLITS),
            None => {
                let per_sm = self
                    .kernels
                    .get(&name)?
                    .occupancy_max_active_blocks_per_multiprocessor(
                        fc.threads,
                        fc.smem as usize,
                        None,
                    )
                    .map_err(drv("occupancy"))? as usize;
                // The most keys one tile walks: its segment, or its rows plus the window each side.
                let keys = match spec.window {
                    Some(w) => segs.max_len().min(kernels::QUERY_TILE + 2 * w),
                    None => segs.max_len(),
                };
                let ctas = segs.tiles * spec.heads_q * fc.splits as usize;
                kv_splits(ctas, per_sm * self.sm_count as usize, keys, fc.bn)
            }
        };
        let part = if splits > 1 && part_elems(splits, total, spec.heads_q, hd) <= PART_ELEMS {
            Some(self.flash_workspace()?)
        } else {
            None
        };
        let splits = if part.is_some() { splits } else { 1 };
        let mut args = attention_operands(&q, &k, &v, &out)?.to_vec();
        let op = args[6];
        args.extend([
            addr(&segs.dev, segs.max_segs + 1),
            i((spec.heads_q / spec.heads_kv) as i64),
            f(spec.scale * std::f32::consts::LOG2_E),
            i(window_arg(spec)),
            i(spec.causal as i64),
            part.unwrap_or(0),
            i(total as i64),
            i(splits as i64),
        ]);
        let config = LaunchConfig {
            grid_dim: (
                segs.tiles as u32,
                spec.heads_q as u32,
                fc.splits * splits as u32,
            ),
            block_dim: (fc.threads, 1, 1),
            shared_mem_bytes: fc.smem,
        };
        self.timed("attention", || self.launch(&name, config, &args))?;
        if let Some(part) = part {
            let warps = (total * spec.heads_q) as u32;
            let args = [
                part,
                op,
                i(out.stride as i64),
                i(total as i64),
                i(spec.heads_q as i64),
                i(hd as i64),
                i(splits as i64),
            ];
            self.timed("attention", || {
                self.launch("flash_combine", cfg((warps.div_ceil(8), 1), 256, 0), &args)
            })?;
        }
        Ok(splits)
    }

    /// The bf16 attention op with its kernel and/or key-chunk count fixed, for tests and
    /// benchmarks of each path; returns the chunk count used (1 when the split would not fit the
    /// workspace).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with(
        &self,
        q: View<'_, Self>,
        k: View<'_, Self>,
        v: View<'_, Self>,
        out: ViewMut<'_, Self>,
        spec: &AttnSpec,
        segs: &Segments<Self>,
        choice: FlashChoice,
    ) -> Result<usize> {
        self.flash(q, k, v, out, spec, segs, choice)
    }

    /// Address of the split-key workspace, allocated on first use and never moved.
    fn flash_workspace(&self) -> Result<u64> {
        let mut part = self
            .flash_part
            .lock()
            .map_err(|_| Error::backend("attention", "workspace lock poisoned"))?;
        if part.is_none() {
            *part = Some(self.alloc(PART_ELEMS, Role::Stream)?);
        }
        Ok(part.as_ref().map_or(0, |p| p.ptr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_machine_is_not_split() {
        // W3: 256 documents × 4 tiles × 4 heads on 132 SMs × 2, 256 keys each.
        assert_eq!(kv_splits(4096, 264, 256, 32), 1);
        // A mixed-image pass's text encoder: 540 blocks of 274-token sequences.
        assert_eq!(kv_splits(540, 264, 274, 32), 1);
    }

    #[test]
    fn one_wave_is_not_split() {
        // W1: 17 tokens.
        assert_eq!(kv_splits(4, 264, 17, 32), 1);
        // W2's sliding layers: 35 tiles × 4 heads on 264 slots.
        assert_eq!(kv_splits(140, 264, 1088, 32), 1);
        // One 2,394-patch image: 38 tiles × 12 heads on 132 SMs × 4.
        assert_eq!(kv_splits(456, 528, 2394, 64), 1);
        assert_eq!(kv_splits(0, 264, 4096, 32), 1);
    }

    #[test]
    fn a_nearly_empty_last_wave_is_split() {
        // W2's full layers: 35 tiles × 4 heads × 2 CTAs per tile = 280 blocks on 264 slots
        // (two waves, the second nearly empty), 69 key blocks each.
        assert_eq!(kv_splits(280, 264, 2208, 32), 3);
        // Never more chunks than key blocks.
        assert!(kv_splits(300, 264, 64, 32) <= 2);
    }

    #[test]
    fn workspace_holds_the_w2_split() {
        assert!(part_elems(4, 2208, 4, 512) <= PART_ELEMS);
    }
}
