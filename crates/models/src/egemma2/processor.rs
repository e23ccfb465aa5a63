//! The image half of `processor_config.json` (transformers 5.25 writes the `Gemma4ImageProcessor`
//! settings under `image_processor`). Tessera implements that processor's fixed pipeline
//! (RGB, aspect-preserving bicubic resize, rescale by 1/255, no normalisation); a file asking for
//! anything else is refused by field rather than silently ignored. Without the file, the class
//! defaults apply (the release values: budget 280, patch 16, pooling 3).

use serde::Deserialize;
use tessera_core::{Error, Result};

use super::config::VisionConfig;
use crate::files::ModelFiles;
use crate::imageproc::{ImageBudget, PatchSpec};

#[derive(Deserialize, Default)]
struct RawProcessor {
    image_processor: Option<RawImage>,
}

#[derive(Deserialize, Default)]
struct RawImage {
    max_soft_tokens: Option<usize>,
    patch_size: Option<usize>,
    pooling_kernel_size: Option<usize>,
    do_convert_rgb: Option<bool>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<Vec<f64>>,
    image_std: Option<Vec<f64>>,
    resample: Option<u32>,
}

/// How images become patches for this model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageProcessor {
    /// `max_soft_tokens` of the file: the budget used when the caller gives none.
    pub default_budget: ImageBudget,
    pub spec: PatchSpec,
}

impl ImageProcessor {
    pub fn load(files: &ModelFiles, vision: &VisionConfig) -> Result<Self> {
        let path = files.path("processor_config.json");
        let raw: RawProcessor = match files.read_optional("processor_config.json")? {
            Some(text) => tessera_core::config::parse_json(&path, &text)?,
            None => RawProcessor::default(),
        };
        let ip = raw.image_processor.unwrap_or_default();
        let err = |f: &str, m: String| Error::config(&path, format!("image_processor.{f}"), m);
        let spec = PatchSpec {
            patch: vision.patch_size,
            pool: vision.pooling_kernel_size,
        };
        for (name, value, tower) in [
            ("patch_size", ip.patch_size, spec.patch),
            ("pooling_kernel_size", ip.pooling_kernel_size, spec.pool),
        ] {
            if let Some(v) = value
                && v != tower
            {
                return Err(err(
                    name,
                    format!("{v} differs from the vision tower's {tower} (config.json)"),
                ));
            }
        }
        for (name, value) in [
            ("do_convert_rgb", ip.do_convert_rgb),
            ("do_resize", ip.do_resize),
            ("do_rescale", ip.do_rescale),
        ] {
            if value == Some(false) {
                return Err(err(name, "false is not supported".into()));
            }
        }
        if let Some(f) = ip.rescale_factor
            && (f - 1.0 / 255.0).abs() > 1e-12
        {
            return Err(err(
                "rescale_factor",
                format!("{f} is not supported (only 1/255)"),
            ));
        }
        if let Some(r) = ip.resample
            && r != 3
        {
            return Err(err(
                "resample",
                format!("{r} is not supported (only 3, bicubic)"),
            ));
        }
        // Normalising with mean 0 and std 1 is the identity the release config spells out.
        let identity = ip
            .image_mean
            .as_ref()
            .is_none_or(|m| m.iter().all(|&v| v == 0.0))
            && ip
                .image_std
                .as_ref()
                .is_none_or(|s| s.iter().all(|&v| v == 1.0));
        if ip.do_normalize == Some(true) && !identity {
            return Err(err(
                "do_normalize",
                "normalisation other than mean 0, std 1 is not supported".into(),
            ));
        }
        let default_budget = match ip.max_soft_tokens {
            Some(n) => ImageBudget::new(n).map_err(|e| err("max_soft_tokens", e.to_string()))?,
            None => ImageBudget::DEFAULT,
        };
        Ok(ImageProcessor {
            default_budget,
            spec,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tower() -> VisionConfig {
        VisionConfig {
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 1,
            num_heads: 2,
            kv_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-6,
            rope_theta: 100.0,
            patch_size: 16,
            pooling_kernel_size: 3,
            position_embedding_size: 64,
        }
    }

    fn load(json: &str) -> Result<ImageProcessor> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("processor_config.json"), json).unwrap();
        ImageProcessor::load(&ModelFiles::Dir(dir.path().to_path_buf()), &tower())
    }

    #[test]
    fn release_values_and_defaults() {
        let p = load(r#"{"image_processor": {"max_soft_tokens": 560, "patch_size": 16, "pooling_kernel_size": 3, "do_normalize": false, "image_mean": [0,0,0], "image_std": [1,1,1], "resample": 3, "rescale_factor": 0.00392156862745098}}"#).unwrap();
        assert_eq!(p.default_budget.soft_tokens(), 560);
        assert_eq!(p.spec, PatchSpec { patch: 16, pool: 3 });
        let dir = tempfile::tempdir().unwrap();
        let none = ImageProcessor::load(&ModelFiles::Dir(dir.path().to_path_buf()), &tower());
        assert_eq!(none.unwrap().default_budget, ImageBudget::DEFAULT);
    }

    #[test]
    fn unsupported_settings_name_their_field() {
        for (json, field) in [
            (r#"{"image_processor": {"patch_size": 14}}"#, "patch_size"),
            (r#"{"image_processor": {"resample": 2}}"#, "resample"),
            (
                r#"{"image_processor": {"max_soft_tokens": 100}}"#,
                "max_soft_tokens",
            ),
            (
                r#"{"image_processor": {"do_normalize": true, "image_mean": [0.5, 0.5, 0.5]}}"#,
                "do_normalize",
            ),
            (
                r#"{"image_processor": {"rescale_factor": 0.5}}"#,
                "rescale_factor",
            ),
            (r#"{"image_processor": {"do_resize": false}}"#, "do_resize"),
        ] {
            let e = load(json).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains("processor_config.json"),
                "{field}: {e}"
            );
        }
    }
}
