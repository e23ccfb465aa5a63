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
