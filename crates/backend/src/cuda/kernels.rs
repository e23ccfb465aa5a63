//! The loaded kernel table: every function of every source is resolved when the backend opens,
//! so a missing or misnamed kernel fails at start-up, not in the middle of a forward.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use tessera_core::{Error, Result};

use super::nvrtc::{self, SOURCES};

const DTYPES: [&str; 2] = ["f32", "bf16"];

/// Query rows per attention tile: the host lists 64-row tiles that never cross a segment, and
/// both flash kernels take one (or a part of one) per CTA.
pub const QUERY_TILE: usize = 64;

/// Head dims the tensor-core attention kernel is instantiated for.
pub const FLASH_HEAD_DIMS: [usize; 6] = [16, 32, 64, 128, 256, 512];

/// Launch shape of `flash_bf16_d{D}`, mirroring `FlashCfg` in attention.cu.
pub struct FlashConfig {
    /// Dynamic shared memory: query rows, BN key rows each for K and V (rows padded by 8
    /// elements), plus the partial-score buffer when the head dimension is split across warps.
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
        _ => (4, 1, 64),
    };
    let bm = 16 * wm;
    let tiles = (bm + 2 * bn) * (d + 8) * 2;
    let scores = if wd > 1 { wd * bm * bn * 4 } else { 0 };
    FlashConfig {
        smem: (tiles + scores) as u32,
        threads: (32 * wm * wd) as u32,
        splits: (QUERY_TILE / bm) as u32,
        bn,
    }
}

/// `flash_bf16_d{D}`: the tensor-core attention kernel for head dim `D`.
pub fn flash_name(d: usize) -> String {
    format!("flash_bf16_d{d}")
}

/// Head dims the Hopper (wgmma) attention kernel is instantiated for.
pub const WGMMA_HEAD_DIMS: [usize; 3] = [64, 256, 512];

/// Whether `flash_wgmma_d{D}` exists on `arch` (attention_sm90.cu is built for sm_90a alone).
pub fn wgmma_applies(arch: &str, d: usize) -> bool {
    arch == "sm_90a" && WGMMA_HEAD_DIMS.contains(&d)
}

/// `flash_wgmma_d{D}`: the Hopper attention kernel for head dim `D`.
pub fn wgmma_name(d: usize) -> String {
    format!("flash_wgmma_d{d}")
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

/// Every kernel name, per source file.
pub fn names(source: &str) -> Vec<String> {
    let pairs = |op: &str| -> Vec<String> {
        DTYPES
            .iter()
            .flat_map(|a| DTYPES.iter().map(move |b| format!("{op}_{a}_{b}")))
            .collect()
    };
    match source {
        "norm.cu" => {
            let mut v = pairs("rms_norm");
            v.extend(pairs("residual_norm"));
            v.extend(pairs("rms_norm_warp"));
            v.extend(pairs("residual_norm_warp"));
            v.extend(DTYPES.iter().map(|d| format!("qkv_norm_rope_{d}")));
            v.extend(DTYPES.iter().map(|d| format!("qkv_norm_rope_axial_{d}")));
            v.extend(DTYPES.iter().map(|d| format!("qkv_norm_rope_vec_{d}")));
            v.extend(DTYPES.iter().map(|d| format!("qkv_norm_rope_axial64_{d}")));
            v
        }
        "elementwise.cu" => {
            let mut v = vec!["embed_f32_f32".to_string(), "embed_bf16_f32".to_string()];
            v.extend(pairs("cast"));
            for act in ["gelu", "silu"] {
                v.extend(DTYPES.iter().map(|d| format!("gated_{act}_{d}")));
                v.extend(DTYPES.iter().map(|d| format!("gated_vec_{act}_{d}")));
            }
            v.extend(DTYPES.iter().map(|d| format!("segment_mean_{d}")));
            v
        }
        "vision.cu" => {
            let mut v = pairs("add_positions_2d");
            v.extend(pairs("avg_pool2d"));
            v.extend(pairs("scatter_rows"));
            v
        }
        "attention.cu" => {
            let mut v: Vec<String> = FLASH_HEAD_DIMS.iter().map(|&d| flash_name(d)).collect();
            v.push("flash_combine".to_string());
            v.push("attn_rows_f32".to_string());
            v
        }
        "attention_sm90.cu" => WGMMA_HEAD_DIMS.iter().map(|&d| wgmma_name(d)).collect(),
        _ => Vec::new(),
    }
}

pub struct Kernels {
    funcs: HashMap<String, CudaFunction>,
}

impl Kernels {
    /// Compile (or load from the cache) every source for `arch` and resolve every function.
    pub fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Self> {
        let mut funcs = HashMap::new();
        for src in SOURCES.iter().filter(|s| s.builds_for(arch)) {
            let cubin = nvrtc::cubin(src, arch)?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| Error::backend(format!("loading {}", src.name), e))?;
            for name in names(src.name) {
                let f = module
                    .load_function(&name)
                    .map_err(|e| Error::backend(format!("kernel {name} in {}", src.name), e))?;
                funcs.insert(name, f);
            }
        }
        let portable = FLASH_HEAD_DIMS
            .iter()
            .map(|&d| (flash_name(d), flash_config(d).smem));
        let hopper = WGMMA_HEAD_DIMS
            .iter()
            .filter(|&&d| wgmma_applies(arch, d))
            .map(|&d| (wgmma_name(d), wgmma_config(d).smem));
        for (name, smem) in portable.chain(hopper) {
            let func = funcs.get(&name).ok_or_else(|| {
                Error::backend("kernel lookup", format!("no kernel named {name}"))
            })?;
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| Error::backend(format!("{name}: {smem} B of shared memory"), e))?;
        }
        Ok(Kernels { funcs })
    }

    pub fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| Error::backend("kernel lookup", format!("no kernel named {name}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name the op dispatch in mod.rs builds is resolved at load (NVRTC's compile test then
    /// checks each resolved name is in its cubin): a misspelt kernel fails here, not on a GPU.
    #[test]
    fn every_dispatched_kernel_is_resolved() {
        let all: Vec<String> = SOURCES.iter().flat_map(|s| names(s.name)).collect();
        let tags = ["f32", "bf16"];
        let mut wanted = vec!["attn_rows_f32".to_string()];
        for a in tags {
            for b in tags {
                for op in [
                    "rms_norm",
                    "residual_norm",
                    "rms_norm_warp",
                    "residual_norm_warp",
                    "cast",
                    "add_positions_2d",
                    "avg_pool2d",
                    "scatter_rows",
                ] {
                    wanted.push(format!("{op}_{a}_{b}"));
                }
            }
            wanted.push(format!("embed_{a}_f32"));
            wanted.push(format!("qkv_norm_rope_{a}"));
            wanted.push(format!("qkv_norm_rope_axial_{a}"));
            wanted.push(format!("qkv_norm_rope_vec_{a}"));
            wanted.push(format!("segment_mean_{a}"));
            for act in ["gelu", "silu"] {
                wanted.push(format!("gated_{act}_{a}"));
                wanted.push(format!("gated_vec_{act}_{a}"));
            }
        }
        for d in FLASH_HEAD_DIMS {
            wanted.push(flash_name(d));
        }
        for d in WGMMA_HEAD_DIMS {
            wanted.push(wgmma_name(d));
        }
        for w in &wanted {
            assert!(
                all.contains(w),
                "{w} is dispatched but not resolved at load"
            );
        }
    }
}
