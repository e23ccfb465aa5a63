//! `config.json` of a Qwen3 text model, as transformers writes it (5.x puts the RoPE base in
//! `rope_parameters`; older files, like Z-Image's text encoder, have a top-level `rope_theta`).

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

#[derive(Deserialize)]
struct RawRope {
    #[serde(default)]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    /// Qwen3-VL's multimodal RoPE: how the rotated pairs split between the (time, height,
    /// width) position axes. Text-only input puts a token at the same position on all three,
    /// where any split rotates exactly as the 1-D RoPE does.
    #[serde(default)]
    mrope_section: Option<Vec<usize>>,
}

/// transformers' class default when a file omits `head_dim`.
fn default_head_dim() -> usize {
    128
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    #[serde(default = "default_head_dim")]
    head_dim: usize,
    hidden_act: String,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_parameters: Option<RawRope>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    use_sliding_window: bool,
}

/// The shape of a Qwen3 text model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub max_positions: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    /// Qwen3-VL's multimodal RoPE sections (time, height, width pairs), when the file has them.
    pub mrope_section: Option<Vec<usize>>,
}

impl Qwen3Config {
    /// The language model of a Qwen3-VL `config.json` (`model_type` `qwen3_vl`, the model under
    /// `text_config`), as Qwen-Image-2.1's text encoder ships it. Only text-only input is run,
    /// where the multimodal RoPE is the 1-D one.
    pub fn parse_vl(path: &Path, json: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Outer {
            model_type: Option<String>,
            text_config: Option<serde_json::Value>,
        }
        let outer: Outer = tessera_core::config::parse_json(path, json)?;
        if let Some(t) = outer.model_type.as_deref()
            && t != "qwen3_vl"
        {
            return Err(Error::config(
                path,
                "model_type",
                format!(
                    "{t:?} is not a Qwen3-VL model (expected \"qwen3_vl\"): Qwen-Image-2.1's text encoder is Qwen3-VL"
                ),
            ));
        }
        let text = outer
            .text_config
            .ok_or_else(|| Error::config(path, "text_config", "missing"))?;
        Self::parse(path, &text.to_string())
    }

    /// Parse `json`, which came from `path` (named in errors).
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: Raw = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if let Some(t) = raw.model_type.as_deref()
            && t != "qwen3"
            && t != "qwen3_vl_text"
        {
            return Err(err(
                "model_type",
                format!("{t:?} is not a Qwen3 model (expected \"qwen3\")"),
            ));
        }
        if raw.hidden_act != "silu" {
            return Err(err(
                "hidden_act",
                format!("{:?} is not supported (Qwen3 uses silu)", raw.hidden_act),
            ));
        }
        if raw.attention_bias {
            return Err(err("attention_bias", "true is not supported".into()));
        }
        if raw.use_sliding_window {
            return Err(err("use_sliding_window", "true is not supported".into()));
        }
        // transformers 4.x wrote Qwen3-VL's multimodal sections under `rope_scaling`; plain
        // Qwen3 files have it null.
        let scaling: Option<RawRope> = match &raw.rope_scaling {
            Some(v) if !v.is_null() => {
                let r: RawRope = serde_json::from_value(v.clone())
                    .map_err(|e| err("rope_scaling", e.to_string()))?;
                if r.mrope_section.is_none() {
                    return Err(err(
                        "rope_scaling",
                        "only the default RoPE is supported".into(),
                    ));
                }
                Some(r)
            }
            _ => None,
        };
        let params = raw.rope_parameters.as_ref().or(scaling.as_ref());
        if let Some(p) = params {
            if let Some(t) = p.rope_type.as_deref()
                && t != "default"
            {
                return Err(err(
                    "rope_parameters.rope_type",
                    format!("{t:?} is not supported (only \"default\")"),
                ));
            }
            if let Some(sec) = &p.mrope_section
                && sec.iter().sum::<usize>() != raw.head_dim / 2
            {
                return Err(err(
                    "rope_parameters.mrope_section",
                    format!(
                        "{sec:?} does not split the {} rotated pairs of head_dim {}",
                        raw.head_dim / 2,
                        raw.head_dim
                    ),
                ));
            }
        }
        let rope_theta = match (params.and_then(|p| p.rope_theta), raw.rope_theta) {
            (Some(theta), _) | (None, Some(theta)) => theta,
            (None, None) => return Err(err("rope_theta", "missing (nor rope_parameters)".into())),
        };
        let heads_kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if heads_kv == 0 || !raw.num_attention_heads.is_multiple_of(heads_kv) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{heads_kv} does not divide num_attention_heads {}",
                    raw.num_attention_heads
                ),
            ));
        }
        if !raw.head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{} is odd; RoPE needs pairs", raw.head_dim),
            ));
        }
        Ok(Qwen3Config {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            heads_q: raw.num_attention_heads,
            heads_kv,
            head_dim: raw.head_dim,
            max_positions: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta,
            mrope_section: params.and_then(|p| p.mrope_section.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":8,"intermediate_size":16,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":4,
        "hidden_act":"silu","max_position_embeddings":64,"rms_norm_eps":1e-6"#;

    #[test]
    fn reads_both_rope_spellings() {
        let p = Path::new("config.json");
        let old = Qwen3Config::parse(
            p,
            &format!("{BASE},\"rope_theta\":1000000,\"rope_scaling\":null}}"),
        )
        .unwrap();
        let new = Qwen3Config::parse(
            p,
            &format!("{BASE},\"rope_parameters\":{{\"rope_type\":\"default\",\"rope_theta\":1000000.0}}}}"),
        )
        .unwrap();
        assert_eq!(old, new);
        assert_eq!(old.rope_theta, 1e6);
    }

    #[test]
    fn errors_name_the_field() {
        let p = Path::new("te/config.json");
        let e = Qwen3Config::parse(p, &format!("{BASE}}}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("te/config.json") && e.contains("rope_theta"),
            "{e}"
        );
        let e = Qwen3Config::parse(
            p,
            &format!("{BASE},\"rope_theta\":1.0,\"rope_scaling\":{{\"type\":\"yarn\"}}}}"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("rope_scaling"), "{e}");
        let no_vocab = format!(
            "{},\"rope_theta\":1.0}}",
            BASE.replace("\"vocab_size\":10,", "")
        );
        let e = Qwen3Config::parse(p, &no_vocab).unwrap_err().to_string();
        assert!(e.contains("vocab_size"), "{e}");
    }

    #[test]
    fn a_text_encoder_of_another_architecture_is_named() {
        let p = Path::new("text_encoder/config.json");
        let vl = format!(
            "{{\"model_type\":\"qwen3_vl\",\"text_config\":{}}}",
            format!("{BASE},\"rope_parameters\":{{\"rope_type\":\"default\",\"rope_theta\":5e6,\"mrope_section\":[1,1]}}}}")
                .replace("\"model_type\":\"qwen3\"", "\"model_type\":\"qwen3_vl_text\"")
        );
        let c = Qwen3Config::parse_vl(p, &vl).unwrap();
        assert_eq!(c.rope_theta, 5e6);
        // Z-Image's Qwen3 text encoder where Qwen-Image wants Qwen3-VL.
        let e = Qwen3Config::parse_vl(p, &format!("{BASE},\"rope_theta\":1.0}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"qwen3\"") && e.contains("Qwen3-VL"), "{e}");
        // Sections that do not split the rotated pairs.
        let bad = vl.replace("[1,1]", "[1,2]");
        let e = Qwen3Config::parse_vl(p, &bad).unwrap_err().to_string();
        assert!(e.contains("mrope_section"), "{e}");
    }
}
