//! Launch planning for the tensor-core attention kernels: their launch shapes (mirroring
//! `FlashCfg` in attention.cu and `WgCfg` in attention_sm90.cu), and how many chunks each query
//! tile's keys are split into when the tiles alone would leave the GPU partly idle (one long
//! sequence: W2, a single image), with the fixed workspace those chunks are combined from.

/// Query rows per attention tile: the host lists 64-row tiles that never cross a segment, and
/// both flash kernels take one (or a part of one) per CTA.
pub const QUERY_TILE: usize = 64;

/// Head dims the tensor-core attention kernel is instantiated for (72: the SigLIP2 and Qwen3-VL
/// vision towers, q·kᵀ over columns zero-padded to 80; 768 and 1152: the mid-blocks of
/// Qwen-Image-2.1's VAE encoder and decoder, one head each).
pub const FLASH_HEAD_DIMS: [usize; 9] = [16, 32, 64, 72, 128, 256, 512, 768, 1152];

/// Launch shape of `flash_bf16_d{D}`, mirroring `FlashCfg` in attention.cu.
pub struct FlashConfig {
    /// Dynamic shared memory: query rows, BN key rows each for K and V (each row the head
    /// rounded up to whole 16-column mma steps, plus 8 elements), plus the partial-score buffer
    /// when the head dimension is split across warps.
    pub smem: u32,
    pub threads: u32,
    /// CTAs per 64-row tile (grid z, times the key chunks of a split launch).
    pub splits: u32,
    /// Keys per block of the kernel's walk.
    pub bn: usize,
}

pub fn flash_config(d: usize) -> FlashConfig {
    let (wm, wd, bn) = match d {
        256 => (4, 1, 32),
        512 => (2, 2, 32),
        768 | 1152 => (2, 4, 16),
        _ => (4, 1, 64),
    };
    let bm = 16 * wm;
    let pitch = d.next_multiple_of(16) + 8;
    let tiles = (bm + 2 * bn) * pitch * 2;
    let scores = if wd > 1 { wd * bm * bn * 4 } else { 0 };
    FlashConfig {
        smem: (tiles + scores) as u32,
        threads: (32 * wm * wd) as u32,
        splits: (QUERY_TILE / bm) as u32,
        bn,
    }
}

/// Head dims the Hopper (wgmma) attention kernel is instantiated for.
pub const WGMMA_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];

/// Whether `flash_wgmma_d{D}` exists on `arch` (attention_sm90.cu is built for sm_90a alone).
pub fn wgmma_applies(arch: &str, d: usize) -> bool {
    arch == "sm_90a" && WGMMA_HEAD_DIMS.contains(&d)
}

/// Keys per block of `flash_wgmma_d{D}` (`WgCfg::BN` in attention_sm90.cu).
pub const WGMMA_BN: usize = 64;

/// Launch shape of `flash_wgmma_d{D}`, mirroring `WgCfg` in attention_sm90.cu: a warpgroup per
/// 256 head columns (at least one) on each 64-row tile; shared memory for a 64-row Q tile, one K
/// and one V tile of `WGMMA_BN` rows, the partial scores two warpgroups exchange, and 1 KB to
/// align the tiles to the swizzle's 1,024-byte period.
pub fn wgmma_config(d: usize) -> FlashConfig {
    let groups = d.div_ceil(256);
    let scores = if groups > 1 {
        groups * QUERY_TILE * WGMMA_BN * 4
    } else {
        0
    };
    FlashConfig {
        smem: (1024 + (QUERY_TILE + 2 * WGMMA_BN) * d * 2 + scores) as u32,
        threads: 128 * groups as u32,
        splits: 1,
        bn: WGMMA_BN,
    }
}

/// Head dims the warp-specialized Hopper kernel is instantiated for.
pub const WS_HEAD_DIMS: [usize; 2] = [64, 128];

/// Query rows per tile of `flash_ws_d{D}`: two consumer warpgroups of 64 rows share each key
/// block. The host lists these wide tiles after the 64-row ones; they never cross a segment.
pub const WIDE_TILE: usize = 128;

/// Keys per block of `flash_ws_d{D}` (`WsCfg::BN`): 192 for 64-wide heads, whose per-block
/// work is half a 128-wide head's, so that each consumer turn (and its barriers) carries more
/// products; 128 otherwise.
pub fn ws_bn(d: usize) -> usize {
    if d == 64 { 192 } else { 128 }
}

/// Stages of `flash_ws_d{D}`'s K/V ring (`WsCfg::STAGES`): as many as fit 227 KB.
fn ws_stages(d: usize) -> usize {
    if d == 128 { 3 } else { 4 }
}

/// Whether `flash_ws_d{D}` exists on `arch` (sm_90a alone).
pub fn ws_applies(arch: &str, d: usize) -> bool {
    arch == "sm_90a" && WS_HEAD_DIMS.contains(&d)
}

/// Shortest segment for which the op picks `flash_ws_d{D}` by itself: below it, half of a
/// wide tile's rows would often be padding.
pub const WS_MIN_LEN: usize = 256;

/// Launch shape of `flash_ws_d{D}`, mirroring `WsCfg` in attention_sm90.cu: a producer and two
/// consumer warpgroups; shared memory for the 128-row Q tile, [`ws_stages`] K and V tiles of
/// [`ws_bn`] keys, their mbarriers, and 1 KB to align the tiles to the swizzle's period.
pub fn ws_config(d: usize) -> FlashConfig {
    let (stages, bn) = (ws_stages(d), ws_bn(d));
    let barriers = 8 * (1 + 4 * stages);
    FlashConfig {
        smem: (1024 + (WIDE_TILE + 2 * stages * bn) * d * 2 + barriers) as u32,
        threads: 384,
        splits: 1,
        bn,
    }
}

/// Which attention kernel a bf16 launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// `flash_bf16_d{D}` (mma.sync): every GPU from sm_80, every head width.
    Mma,
    /// `flash_wgmma_d{D}` (Hopper's warpgroup MMA): sm_90a, head widths in
    /// [`WGMMA_HEAD_DIMS`]. The default wherever it applies and `Ws` does not.
    Wgmma,
    /// `flash_ws_d{D}` (warp-specialized, 128-row tiles): sm_90a, head widths in
    /// [`WS_HEAD_DIMS`]. The default there for segments of [`WS_MIN_LEN`] rows or more.
    Ws,
}

/// Choices a test or benchmark fixes for one launch; `None` leaves it to the op.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlashChoice {
    /// Key chunks per tile (1..=`MAX_KV_SPLITS`); over key ranges, per query row
    /// (1..=`MAX_CACHED_SPLITS`).
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
    fn wide_heads_fit_an_a100s_shared_memory() {
        // 1152: 32 query rows and 16-key blocks, 4 warps across the head; one CTA per
        // multiprocessor, under the 163 KB a CTA may take on an A100 (227 KB on Hopper).
        let c = flash_config(1152);
        assert_eq!((c.smem, c.threads, c.splits, c.bn), (156_672, 256, 2, 16));
        assert!(c.smem <= 163 * 1024);
        assert!(part_elems(8, 1000, 1, 1152) <= PART_ELEMS);
        // 768 (the VAE encoder's mid-block): the same shape, 192 columns a warp.
        let c = flash_config(768);
        assert_eq!((c.smem, c.threads, c.splits, c.bn), (107_520, 256, 2, 16));
    }

    #[test]
    fn heads_of_72_pad_their_rows_to_80() {
        // 64 query rows and two 64-key tiles of 88-element rows (80 + 8), four CTAs per
        // multiprocessor as at 64.
        let c = flash_config(72);
        assert_eq!((c.smem, c.threads, c.splits, c.bn), (33_792, 128, 1, 64));
        assert_eq!(flash_config(64).smem, (64 + 128) * 72 * 2);
        assert!(4 * c.smem <= 227 * 1024);
    }

    #[test]
    fn the_warp_specialized_kernel_fits_hoppers_shared_memory() {
        // 64: four stages of 192-key K and V tiles (24 KB each) beside the 16 KB Q tile; 128:
        // three stages of 128-key tiles (32 KB each) beside 32 KB of Q. Both under the 227 KB a
        // CTA may take on sm_90.
        let c = ws_config(64);
        assert_eq!((c.smem, c.threads, c.bn), (214_152, 384, 192));
        let c = ws_config(128);
        assert_eq!((c.smem, c.threads, c.bn), (230_504, 384, 128));
        for d in WS_HEAD_DIMS {
            assert!(ws_config(d).smem <= 227 * 1024, "head {d}");
        }
    }

    #[test]
    fn workspace_holds_the_w2_split() {
        assert!(part_elems(4, 2208, 4, 512) <= PART_ELEMS);
    }
}
