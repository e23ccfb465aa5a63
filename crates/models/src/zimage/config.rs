//! The JSON files of a Z-Image checkpoint in the diffusers layout: `model_index.json`,
//! `transformer/config.json`, `vae/config.json` and `scheduler/scheduler_config.json`.
//!
//! Each parser keeps the fields the pipeline uses, rejects values it does not implement (naming
//! the file and field), and ignores keys that change nothing (`_diffusers_version`, encoder-only
//! VAE fields, …).

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

/// diffusers' `SEQ_MULTI_OF`: image and caption token counts are padded to multiples of this.
pub const SEQ_MULTIPLE: usize = 32;
/// diffusers' `ADALN_EMBED_DIM`: the adaLN input width is `min(dim, 256)`.
const ADALN_EMBED_DIM: usize = 256;
/// Width of the sinusoidal timestep features and of the timestep MLP's hidden layer (fixed in
/// diffusers' `TimestepEmbedder(…, mid_size=1024)`).
pub const T_FREQ_DIM: usize = 256;
pub const T_MID_DIM: usize = 1024;

/// `model_index.json`: which pipeline and component classes the folder holds.
#[derive(Deserialize)]
struct RawIndex {
    #[serde(rename = "_class_name")]
    class_name: String,
}

/// Check that `model_index.json` describes a Z-Image pipeline.
pub fn check_model_index(path: &Path, json: &str) -> Result<()> {
    let raw: RawIndex = tessera_core::config::parse_json(path, json)?;
    if raw.class_name != "ZImagePipeline" {
        return Err(Error::config(
            path,
            "_class_name",
            format!(
                "{:?} is not a Z-Image pipeline (expected \"ZImagePipeline\")",
                raw.class_name
            ),
        ));
    }
    Ok(())
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize)]
struct RawTransformer {
    all_patch_size: Vec<usize>,
    all_f_patch_size: Vec<usize>,
    in_channels: usize,
    dim: usize,
    n_layers: usize,
    n_refiner_layers: usize,
    n_heads: usize,
    /// Ignored by diffusers 0.42.1 (its attention projects k and v with `n_heads` heads), and
    /// therefore by us; shapes are checked at load.
    #[serde(default)]
    #[allow(dead_code)]
    n_kv_heads: Option<usize>,
    norm_eps: f64,
    #[serde(default = "default_true")]
    qk_norm: bool,
    cap_feat_dim: usize,
    #[serde(default)]
    siglip_feat_dim: Option<usize>,
    rope_theta: f64,
    t_scale: f64,
    axes_dims: Vec<usize>,
    axes_lens: Vec<usize>,
}

/// `transformer/config.json` (`ZImageTransformer2DModel`).
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    /// Latent channels (16).
    pub in_channels: usize,
    pub dim: usize,
    pub n_layers: usize,
    pub n_refiner_layers: usize,
    pub n_heads: usize,
    pub norm_eps: f32,
    pub cap_feat_dim: usize,
    pub rope_theta: f64,
    pub t_scale: f32,
    /// RoPE pairs per axis are `axes_dims[a] / 2`; axis 0 is the caption/sequence axis, 1 the
    /// image row, 2 the image column.
    pub axes_dims: [usize; 3],
    pub axes_lens: [usize; 3],
}

/// The patch side (`all_patch_size`) and frame patch (`all_f_patch_size`) diffusers' forward
/// defaults to and the published checkpoints use; the only ones implemented.
pub const PATCH: usize = 2;

impl TransformerConfig {
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawTransformer = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if raw.all_patch_size != [PATCH] || raw.all_f_patch_size != [1] {
            return Err(err(
                "all_patch_size",
                format!(
                    "patch sizes {:?} / frame patch sizes {:?} are not supported (only [2] / [1])",
                    raw.all_patch_size, raw.all_f_patch_size
                ),
            ));
        }
        if !raw.qk_norm {
            return Err(err(
                "qk_norm",
                "false is not supported (every published Z-Image transformer norms q and k)".into(),
            ));
        }
        if raw.siglip_feat_dim.is_some() {
            return Err(err(
                "siglip_feat_dim",
                "the Omni (SigLIP) variant is not supported".into(),
            ));
        }
        if raw.n_heads == 0 || !raw.dim.is_multiple_of(raw.n_heads) {
            return Err(err(
                "n_heads",
                format!("{} does not divide dim {}", raw.n_heads, raw.dim),
            ));
        }
        let head_dim = raw.dim / raw.n_heads;
        let axes: [usize; 3] = raw.axes_dims.as_slice().try_into().map_err(|_| {
            err(
                "axes_dims",
                format!("{} axes; the 3-axis RoPE needs 3", raw.axes_dims.len()),
            )
        })?;
        let lens: [usize; 3] = raw.axes_lens.as_slice().try_into().map_err(|_| {
            err(
                "axes_lens",
                format!("{} axes; the 3-axis RoPE needs 3", raw.axes_lens.len()),
            )
        })?;
        if axes.iter().sum::<usize>() != head_dim || axes.iter().any(|d| d % 2 != 0) {
            return Err(err(
                "axes_dims",
                format!("{axes:?} must be even and sum to the head dimension {head_dim}"),
            ));
        }
        if raw.in_channels == 0 || raw.cap_feat_dim == 0 {
            return Err(err("in_channels", "zero-sized input".into()));
        }
        Ok(TransformerConfig {
            in_channels: raw.in_channels,
            dim: raw.dim,
            n_layers: raw.n_layers,
            n_refiner_layers: raw.n_refiner_layers,
            n_heads: raw.n_heads,
            norm_eps: raw.norm_eps as f32,
            cap_feat_dim: raw.cap_feat_dim,
            rope_theta: raw.rope_theta,
            t_scale: raw.t_scale as f32,
            axes_dims: axes,
            axes_lens: lens,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Input width of the adaLN projections and output width of the timestep MLP.
    pub fn adaln_dim(&self) -> usize {
        self.dim.min(ADALN_EMBED_DIM)
    }

    /// SwiGLU hidden width, `int(dim / 3 * 8)` evaluated in floating point as diffusers does.
    pub fn ffn_dim(&self) -> usize {
        (self.dim as f64 / 3.0 * 8.0) as usize
    }

    /// Features per patch token: `2 · 2 · in_channels`.
    pub fn patch_dim(&self) -> usize {
        PATCH * PATCH * self.in_channels
    }
}

#[derive(Deserialize)]
struct RawVae {
    #[serde(default = "default_out_channels")]
    out_channels: usize,
    up_block_types: Vec<String>,
    block_out_channels: Vec<usize>,
    layers_per_block: usize,
    act_fn: String,
    latent_channels: usize,
    norm_num_groups: usize,
    scaling_factor: f64,
    shift_factor: Option<f64>,
    #[serde(default = "default_true")]
    use_post_quant_conv: bool,
    #[serde(default = "default_true")]
    mid_block_add_attention: bool,
}

fn default_out_channels() -> usize {
    3
}

/// `vae/config.json` (`AutoencoderKL`), decoder side.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    pub out_channels: usize,
    /// Encoder order (smallest first), as in the file; the decoder walks it backwards.
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub latent_channels: usize,
    pub groups: usize,
    pub scaling_factor: f32,
    pub shift_factor: f32,
    pub mid_attention: bool,
}

/// The device memory a decode takes, from the config alone (the decoder's blocks are all
/// sized by it): a pipeline that loads the decoder only for its stage
/// (`Residency::Sequential`) checks a request before it loads.
impl VaeConfig {
    /// Bytes of device memory [`VaeDecoder::decode`](super::vae::VaeDecoder::decode) allocates
    /// for one `(h, w)` latent, compute-type elements being `compute` bytes.
    pub fn decode_bytes(&self, (h, w): (usize, usize), compute: usize) -> usize {
        let top = self.block_out_channels.last().copied().unwrap_or(0);
        let attention = if self.mid_attention {
            4 * h * w * top * compute
        } else {
            0
        };
        self.decode_elems((h, w)) * (3 * 4 + 2 * compute) + attention
    }

    /// The largest activation any stage of a decode holds for an `h × w` latent, in elements:
    /// up block `i` has the widths reversed, its first resnet going from the previous width,
    /// and all but the last upsample 2×.
    pub(super) fn decode_elems(&self, (h, w): (usize, usize)) -> usize {
        let top = self.block_out_channels.last().copied().unwrap_or(0);
        let mut px = h * w;
        let mut most = px * top.max(self.latent_channels);
        let widths: Vec<usize> = self.block_out_channels.iter().rev().copied().collect();
        let mut prev = top;
        for (i, &c) in widths.iter().enumerate() {
            most = most.max(px * prev.max(c));
            if i + 1 < widths.len() {
                px *= 4;
                most = most.max(px * c);
            }
            prev = c;
        }
        most.max(px * self.out_channels)
    }
}

impl VaeConfig {
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawVae = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if raw.act_fn != "silu" {
            return Err(err(
                "act_fn",
                format!("{:?} is not supported (only silu)", raw.act_fn),
            ));
        }
        if raw.block_out_channels.is_empty() {
            return Err(err("block_out_channels", "empty".into()));
        }
        if raw.up_block_types.len() != raw.block_out_channels.len()
            || raw.up_block_types.iter().any(|t| t != "UpDecoderBlock2D")
        {
            return Err(err(
                "up_block_types",
                format!(
                    "{:?}: expected one \"UpDecoderBlock2D\" per block_out_channels entry",
                    raw.up_block_types
                ),
            ));
        }
        if raw.norm_num_groups == 0 {
            return Err(err("norm_num_groups", "must be at least 1".into()));
        }
        if let Some(c) = raw
            .block_out_channels
            .iter()
            .find(|&&c| c % raw.norm_num_groups != 0)
        {
            return Err(err(
                "norm_num_groups",
                format!("{} groups do not divide {c} channels", raw.norm_num_groups),
            ));
        }
        if raw.use_post_quant_conv {
            return Err(err(
                "use_post_quant_conv",
                "true is not supported (the Flux VAE Z-Image uses has none)".into(),
            ));
        }
        let shift = raw.shift_factor.ok_or_else(|| {
            err(
                "shift_factor",
                "missing: the Z-Image pipeline needs it".into(),
            )
        })?;
        if raw.scaling_factor == 0.0 {
            return Err(err("scaling_factor", "must not be zero".into()));
        }
        Ok(VaeConfig {
            out_channels: raw.out_channels,
            block_out_channels: raw.block_out_channels,
            layers_per_block: raw.layers_per_block,
            latent_channels: raw.latent_channels,
            groups: raw.norm_num_groups,
            scaling_factor: raw.scaling_factor as f32,
            shift_factor: shift as f32,
            mid_attention: raw.mid_block_add_attention,
        })
    }

    /// Output pixels per latent pixel along each side (8 for 4 blocks).
    pub fn scale(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }
}

/// `scheduler/scheduler_config.json` (`FlowMatchEulerDiscreteScheduler`, static shift).
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    pub num_train_timesteps: usize,
    pub shift: f64,
}

impl SchedulerConfig {
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw = crate::flow_match::FlowMatchConfig::parse(path, json)?;
        for (on, field) in [
            (raw.use_dynamic_shifting, "use_dynamic_shifting"),
            (raw.shift_terminal.is_some(), "shift_terminal"),
        ] {
            if on {
                return Err(Error::config(
                    path,
                    field,
                    "is set; only the static-shift Euler schedule Z-Image uses is supported",
                ));
            }
        }
        Ok(SchedulerConfig {
            num_train_timesteps: raw.num_train_timesteps,
            shift: raw.shift,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ffn_width_is_reproduced() {
        let mut c = TransformerConfig {
            in_channels: 16,
            dim: 3840,
            n_layers: 30,
            n_refiner_layers: 2,
            n_heads: 30,
            norm_eps: 1e-5,
            cap_feat_dim: 2560,
            rope_theta: 256.0,
            t_scale: 1000.0,
            axes_dims: [32, 48, 48],
            axes_lens: [1536, 512, 512],
        };
        assert_eq!(
            (c.ffn_dim(), c.adaln_dim(), c.head_dim()),
            (10240, 256, 128)
        );
        c.dim = 64;
        assert_eq!((c.ffn_dim(), c.adaln_dim()), (170, 64));
    }

    #[test]
    fn scheduler_rejects_what_it_does_not_implement() {
        let p = Path::new("scheduler/scheduler_config.json");
        let ok = SchedulerConfig::parse(
            p,
            r#"{"num_train_timesteps":1000,"shift":3.0,"use_dynamic_shifting":false}"#,
        )
        .unwrap();
        assert_eq!(ok.shift, 3.0);
        let e = SchedulerConfig::parse(
            p,
            r#"{"num_train_timesteps":1000,"shift":3.0,"use_karras_sigmas":true}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("use_karras_sigmas") && e.contains("scheduler_config.json"),
            "{e}"
        );
    }

    #[test]
    fn transformer_axes_must_sum_to_the_head() {
        let p = Path::new("transformer/config.json");
        let json = r#"{"all_patch_size":[2],"all_f_patch_size":[1],"in_channels":16,"dim":64,"n_layers":1,
            "n_refiner_layers":1,"n_heads":2,"norm_eps":1e-5,"cap_feat_dim":8,"rope_theta":256.0,
            "t_scale":1000.0,"axes_dims":[8,12,14],"axes_lens":[8,8,8]}"#;
        let e = TransformerConfig::parse(p, json).unwrap_err().to_string();
        assert!(e.contains("axes_dims") && e.contains("32"), "{e}");
    }
}
