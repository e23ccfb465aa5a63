//! The JSON files of a Qwen-Image-2.1 checkpoint in the diffusers layout: `model_index.json`
//! and `transformer/config.json` (the text encoder's is [`crate::qwen3::Qwen3Config::parse_vl`],
//! the VAE's and the scheduler's are read by their modules).
//!
//! Each parser keeps the fields the pipeline uses, rejects values it does not implement (naming
//! the file and field) and ignores keys that change nothing.

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

/// Width of the sinusoidal timestep features (`QwenImage21TemporalTimesteps(256)`).
pub const T_FREQ_DIM: usize = 256;
/// RoPE base of every axis (`QwenImage21Rope(theta=10000)`, fixed in diffusers).
pub const ROPE_THETA: f32 = 10_000.0;

#[derive(Deserialize)]
struct RawIndex {
    #[serde(rename = "_class_name")]
    class_name: String,
    #[serde(default)]
    sample_sigmas: Option<Vec<f64>>,
}

/// What `model_index.json` says besides the component classes.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelIndex {
    /// The author's sampling σ grid (its length is the step count), when set.
    pub sample_sigmas: Option<Vec<f64>>,
}

/// Read `model_index.json`, which must describe a Qwen-Image-2.1 pipeline.
pub fn parse_model_index(path: &Path, json: &str) -> Result<ModelIndex> {
    let raw: RawIndex = tessera_core::config::parse_json(path, json)?;
    if raw.class_name != "QwenImage21Pipeline" {
        return Err(Error::config(
            path,
            "_class_name",
            format!(
                "{:?} is not a Qwen-Image-2.1 pipeline (expected \"QwenImage21Pipeline\")",
                raw.class_name
            ),
        ));
    }
    if let Some(s) = &raw.sample_sigmas
        && (s.is_empty() || s.iter().any(|v| !v.is_finite() || *v <= 0.0 || *v > 1.0))
    {
        return Err(Error::config(
            path,
            "sample_sigmas",
            "must be a non-empty list of σ values in (0, 1]",
        ));
    }
    Ok(ModelIndex {
        sample_sigmas: raw.sample_sigmas,
    })
}

fn default_one() -> usize {
    1
}

fn default_true() -> bool {
    true
}

fn default_eps() -> f64 {
    1e-6
}

#[derive(Deserialize)]
struct RawTransformer {
    #[serde(default = "default_one")]
    patch_size: usize,
    in_channels: usize,
    out_channels: Option<usize>,
    num_layers: usize,
    attention_head_dim: usize,
    num_attention_heads: usize,
    context_in_dim: usize,
    mlp_ratio: usize,
    axes_dims_rope: Vec<usize>,
    #[serde(default = "default_eps")]
    eps: f64,
    #[serde(default = "default_true")]
    causal_condition: bool,
}

/// `transformer/config.json` (`QwenImage21Transformer2DModel`).
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub num_layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Width of the text encoder's features.
    pub context_in_dim: usize,
    pub mlp_ratio: usize,
    /// RoPE widths of the frame, height and width axes (summing to `head_dim`).
    pub axes_dims: [usize; 3],
    pub eps: f32,
}

impl TransformerConfig {
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawTransformer = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if raw.patch_size != 1 {
            return Err(err(
                "patch_size",
                format!(
                    "{} is not supported: Qwen-Image-2.1 reads its latents unpatched (1)",
                    raw.patch_size
                ),
            ));
        }
        if !raw.causal_condition {
            return Err(err(
                "causal_condition",
                "false is not supported: the prefix K/V cache needs text rows modulated at t = 0"
                    .into(),
            ));
        }
        let axes: [usize; 3] = raw.axes_dims_rope.clone().try_into().map_err(|_| {
            err(
                "axes_dims_rope",
                format!("{:?}: expected 3 axes", raw.axes_dims_rope),
            )
        })?;
        if axes.iter().sum::<usize>() != raw.attention_head_dim || axes.iter().any(|a| a % 2 == 1) {
            return Err(err(
                "axes_dims_rope",
                format!(
                    "{axes:?} must be even and sum to attention_head_dim {}",
                    raw.attention_head_dim
                ),
            ));
        }
        for (field, v) in [
            ("in_channels", raw.in_channels),
            ("num_layers", raw.num_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("context_in_dim", raw.context_in_dim),
            ("mlp_ratio", raw.mlp_ratio),
        ] {
            if v == 0 {
                return Err(err(field, "must be at least 1".into()));
            }
        }
        Ok(TransformerConfig {
            in_channels: raw.in_channels,
            out_channels: raw.out_channels.unwrap_or(raw.in_channels),
            num_layers: raw.num_layers,
            heads: raw.num_attention_heads,
            head_dim: raw.attention_head_dim,
            context_in_dim: raw.context_in_dim,
            mlp_ratio: raw.mlp_ratio,
            axes_dims: axes,
            eps: raw.eps as f32,
        })
    }

    /// The model width, `heads · head_dim`.
    pub fn dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn ffn_dim(&self) -> usize {
        self.dim() * self.mlp_ratio
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""in_channels":64,"num_layers":32,"attention_head_dim":128,
        "num_attention_heads":32,"context_in_dim":4096,"mlp_ratio":3"#;

    #[test]
    fn reads_the_published_shape_and_refuses_what_it_does_not_run() {
        let p = Path::new("transformer/config.json");
        let c = TransformerConfig::parse(p, &format!("{{{BASE},\"axes_dims_rope\":[16,56,56]}}"))
            .unwrap();
        assert_eq!((c.dim(), c.ffn_dim(), c.out_channels), (4096, 12288, 64));
        let e = TransformerConfig::parse(p, &format!("{{{BASE},\"axes_dims_rope\":[16,56,58]}}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("axes_dims_rope") && e.contains("transformer/config.json"),
            "{e}"
        );
        let e = TransformerConfig::parse(
            p,
            &format!("{{{BASE},\"axes_dims_rope\":[16,56,56],\"patch_size\":2}}"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("patch_size"), "{e}");
        let e = TransformerConfig::parse(
            p,
            &format!("{{{BASE},\"axes_dims_rope\":[16,56,56],\"causal_condition\":false}}"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("causal_condition"), "{e}");
    }

    #[test]
    fn model_index_names_the_pipeline() {
        let p = Path::new("model_index.json");
        let m = parse_model_index(
            p,
            r#"{"_class_name":"QwenImage21Pipeline","sample_sigmas":null}"#,
        )
        .unwrap();
        assert_eq!(m.sample_sigmas, None);
        let e = parse_model_index(p, r#"{"_class_name":"ZImagePipeline"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("QwenImage21Pipeline"), "{e}");
        let e = parse_model_index(
            p,
            r#"{"_class_name":"QwenImage21Pipeline","sample_sigmas":[1.5]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("sample_sigmas"), "{e}");
    }
}
