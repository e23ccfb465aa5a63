//! `config.json` of an LFM2-VL checkpoint (`model_type: "lfm2_vl"`): the SigLIP2 NaFlex vision
//! tower, the projector, and the LFM2 language model, with transformers 5.25's defaults for
//! missing keys and its aliases (`block_ff_dim`, `tie_embedding`, `rope_theta`).
//!
//! The image settings (tile size, token limits, thumbnail) are not here: transformers reads them
//! from `preprocessor_config.json` only (see `processor.rs`).

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

#[derive(Deserialize)]
struct RawVision {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default = "d768")]
    hidden_size: usize,
    #[serde(default = "d3072")]
    intermediate_size: usize,
    #[serde(default = "d12")]
    num_hidden_layers: usize,
    #[serde(default = "d12")]
    num_attention_heads: usize,
    #[serde(default = "d3")]
    num_channels: usize,
    #[serde(default = "d16")]
    patch_size: usize,
    #[serde(default = "d256")]
    num_patches: usize,
    #[serde(default = "eps6")]
    layer_norm_eps: f64,
    #[serde(default = "gelu_tanh")]
    hidden_act: String,
    /// Honoured only where a config sets it (transformers 5.25 runs the whole tower).
    #[serde(default)]
    vision_feature_layer: Option<i64>,
}

#[derive(Deserialize)]
struct RawRope {
    #[serde(default)]
    rope_type: Option<String>,
    rope_theta: f64,
}

#[derive(Deserialize)]
struct RawText {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default = "d65536")]
    vocab_size: usize,
    #[serde(default = "d2560")]
    hidden_size: usize,
    #[serde(default)]
    intermediate_size: Option<usize>,
    /// The original spelling of `intermediate_size`, which wins where both are present.
    #[serde(default)]
    block_ff_dim: Option<usize>,
    #[serde(default = "d32")]
    num_hidden_layers: usize,
    #[serde(default = "d32")]
    num_attention_heads: usize,
    #[serde(default = "d8")]
    num_key_value_heads: usize,
    #[serde(default = "d128000")]
    max_position_embeddings: usize,
    #[serde(default = "eps5")]
    norm_eps: f64,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_parameters: Option<RawRope>,
    #[serde(default)]
    conv_bias: bool,
    #[serde(default = "d3", rename = "conv_L_cache")]
    conv_l_cache: usize,
    #[serde(default = "d256")]
    block_multiple_of: usize,
    /// Missing: 1.0 (the class default); `null`: no multiplier and no rounding.
    #[serde(default = "one")]
    block_ffn_dim_multiplier: Option<f64>,
    #[serde(default = "yes")]
    block_auto_adjust_ff_dim: bool,
    #[serde(default)]
    full_attn_idxs: Option<Vec<usize>>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    bos_token_id: Option<u32>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    model_type: Option<String>,
    vision_config: RawVision,
    text_config: RawText,
    #[serde(default = "d396")]
    image_token_id: u32,
    #[serde(default = "gelu")]
    projector_hidden_act: String,
    #[serde(default = "d2560")]
    projector_hidden_size: usize,
    #[serde(default = "yes")]
    projector_bias: bool,
    #[serde(default = "yes")]
    projector_use_layernorm: bool,
    #[serde(default = "d2")]
    downsample_factor: usize,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    tie_embedding: Option<bool>,
}

macro_rules! defaults {
    ($($name:ident: $t:ty = $v:expr),* $(,)?) => {
        $(fn $name() -> $t { $v })*
    };
}
defaults! {
    d2: usize = 2, d3: usize = 3, d8: usize = 8, d12: usize = 12, d16: usize = 16, d32: usize = 32,
    d256: usize = 256, d768: usize = 768, d2560: usize = 2560, d3072: usize = 3072,
    d65536: usize = 65536, d128000: usize = 128_000, d396: u32 = 396,
    eps5: f64 = 1e-5, eps6: f64 = 1e-6, one: Option<f64> = Some(1.0), yes: bool = true,
    gelu: String = "gelu".into(), gelu_tanh: String = "gelu_pytorch_tanh".into(),
}

/// The SigLIP2 NaFlex vision tower.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub hidden: usize,
    pub intermediate: usize,
    /// Layers run: all of them, or up to `vision_feature_layer` where a config sets it.
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub channels: usize,
    pub patch: usize,
    /// Side of the learned position grid (`√num_patches`).
    pub pos_grid: usize,
    pub eps: f32,
}

/// Which mixer an LFM2 layer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    Conv,
    Attention,
}

/// The LFM2 language model.
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    pub vocab: usize,
    pub hidden: usize,
    /// The FFN width after transformers' auto-adjust rule.
    pub ffn: usize,
    pub layers: Vec<LayerKind>,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub max_positions: usize,
    pub eps: f32,
    pub rope_theta: f64,
    pub conv_bias: bool,
    pub conv_kernel: usize,
    pub bos: Option<u32>,
    pub eos: Vec<u32>,
}

/// The whole model.
#[derive(Clone, Debug, PartialEq)]
pub struct Lfm2VlConfig {
    pub vision: VisionConfig,
    pub text: TextConfig,
    pub image_token: u32,
    pub projector_hidden: usize,
    pub projector_bias: bool,
    pub projector_norm: bool,
    pub downsample: usize,
}

/// The FFN width transformers' `Lfm2MLP` builds from the configured one.
pub fn ffn_width(
    configured: usize,
    auto_adjust: bool,
    mult: Option<f64>,
    multiple: usize,
) -> usize {
    if !auto_adjust {
        return configured;
    }
    let d = 2 * configured / 3;
    match mult {
        Some(m) => ((m * d as f64) as usize).div_ceil(multiple) * multiple,
        None => d,
    }
}

impl Lfm2VlConfig {
    /// Parse `json`, which came from `path` (named in errors).
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: Raw = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if let Some(t) = raw.model_type.as_deref()
            && t != "lfm2_vl"
        {
            return Err(err(
                "model_type",
                format!("{t:?} is not an LFM2-VL model (expected \"lfm2_vl\")"),
            ));
        }
        if raw.projector_hidden_act != "gelu" {
            return Err(err(
                "projector_hidden_act",
                format!(
                    "{:?} is not supported (LFM2-VL uses \"gelu\")",
                    raw.projector_hidden_act
                ),
            ));
        }
        if raw.downsample_factor != 2 {
            return Err(err(
                "downsample_factor",
                format!("{} is not supported (only 2)", raw.downsample_factor),
            ));
        }
        if raw.tie_word_embeddings.or(raw.tie_embedding) == Some(false) {
            return Err(err(
                "tie_word_embeddings",
                "false is not supported: LFM2 reads its logits through the embedding table".into(),
            ));
        }
        let vision = vision_config(&raw.vision_config, &|f, m| {
            err(&format!("vision_config.{f}"), m)
        })?;
        let text = text_config(&raw.text_config, &|f, m| {
            err(&format!("text_config.{f}"), m)
        })?;
        Ok(Lfm2VlConfig {
            vision,
            text,
            image_token: raw.image_token_id,
            projector_hidden: raw.projector_hidden_size,
            projector_bias: raw.projector_bias,
            projector_norm: raw.projector_use_layernorm,
            downsample: raw.downsample_factor,
        })
    }
}

type FieldError<'a> = &'a dyn Fn(&str, String) -> Error;

fn vision_config(v: &RawVision, err: FieldError<'_>) -> Result<VisionConfig> {
    if let Some(t) = v.model_type.as_deref()
        && t != "siglip2_vision_model"
    {
        return Err(err(
            "model_type",
            format!("{t:?} is not a SigLIP2 vision tower"),
        ));
    }
    if v.hidden_act != "gelu_pytorch_tanh" {
        return Err(err(
            "hidden_act",
            format!(
                "{:?} is not supported (SigLIP2 uses gelu_pytorch_tanh)",
                v.hidden_act
            ),
        ));
    }
    if v.num_attention_heads == 0 || !v.hidden_size.is_multiple_of(v.num_attention_heads) {
        return Err(err(
            "num_attention_heads",
            format!(
                "{} does not divide hidden_size {}",
                v.num_attention_heads, v.hidden_size
            ),
        ));
    }
    let grid = v.num_patches.isqrt();
    if grid * grid != v.num_patches || grid == 0 {
        return Err(err(
            "num_patches",
            format!("{} is not a square grid of positions", v.num_patches),
        ));
    }
    let n = v.num_hidden_layers as i64;
    let layers = match v.vision_feature_layer {
        None | Some(-1) => v.num_hidden_layers,
        Some(l) if l < 0 && n + l + 1 > 0 => (n + l + 1) as usize,
        Some(l) if l >= 0 && l < n => l as usize + 1,
        Some(l) => {
            return Err(err(
                "vision_feature_layer",
                format!("{l} is outside a tower of {n} layers"),
            ));
        }
    };
    Ok(VisionConfig {
        hidden: v.hidden_size,
        intermediate: v.intermediate_size,
        layers,
        heads: v.num_attention_heads,
        head_dim: v.hidden_size / v.num_attention_heads,
        channels: v.num_channels,
        patch: v.patch_size,
        pos_grid: grid,
        eps: v.layer_norm_eps as f32,
    })
}

fn text_config(t: &RawText, err: FieldError<'_>) -> Result<TextConfig> {
    if let Some(m) = t.model_type.as_deref()
        && m != "lfm2"
    {
        return Err(err(
            "model_type",
            format!("{m:?} is not an LFM2 language model"),
        ));
    }
    let layers = match (&t.layer_types, &t.full_attn_idxs) {
        (Some(types), _) => types
            .iter()
            .map(|s| match s.as_str() {
                "conv" => Ok(LayerKind::Conv),
                "full_attention" => Ok(LayerKind::Attention),
                other => Err(err(
                    "layer_types",
                    format!("{other:?} is not a layer type of LFM2 (\"conv\", \"full_attention\")"),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Some(idx)) => (0..t.num_hidden_layers)
            .map(|i| {
                if idx.contains(&i) {
                    LayerKind::Attention
                } else {
                    LayerKind::Conv
                }
            })
            .collect(),
        (None, None) => vec![LayerKind::Attention; t.num_hidden_layers],
    };
    if layers.len() != t.num_hidden_layers {
        return Err(err(
            "layer_types",
            format!(
                "{} entries for {} layers",
                layers.len(),
                t.num_hidden_layers
            ),
        ));
    }
    let (hq, hkv) = (t.num_attention_heads, t.num_key_value_heads);
    if hq == 0 || hkv == 0 || !hq.is_multiple_of(hkv) || !t.hidden_size.is_multiple_of(hq) {
        return Err(err(
            "num_key_value_heads",
            format!(
                "{hkv} kv heads for {hq} q heads of a {}-wide model",
                t.hidden_size
            ),
        ));
    }
    let head_dim = t.hidden_size / hq;
    if !head_dim.is_multiple_of(2) {
        return Err(err(
            "num_attention_heads",
            format!("head width {head_dim} is odd"),
        ));
    }
    let rope_theta = match (&t.rope_parameters, t.rope_theta) {
        (Some(p), _) => {
            if let Some(kind) = p.rope_type.as_deref()
                && kind != "default"
            {
                return Err(err(
                    "rope_parameters.rope_type",
                    format!("{kind:?} is not supported (only \"default\")"),
                ));
            }
            p.rope_theta
        }
        (None, Some(theta)) => theta,
        (None, None) => 1e6,
    };
    let configured = t.block_ff_dim.or(t.intermediate_size).unwrap_or(12288);
    if t.conv_l_cache < 2 {
        return Err(err(
            "conv_L_cache",
            format!("{} taps: at least 2 needed", t.conv_l_cache),
        ));
    }
    let eos = match &t.eos_token_id {
        None => vec![2],
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        Some(other) => {
            return Err(err(
                "eos_token_id",
                format!("{other} is not a token id or a list of them"),
            ));
        }
    };
    Ok(TextConfig {
        vocab: t.vocab_size,
        hidden: t.hidden_size,
        ffn: ffn_width(
            configured,
            t.block_auto_adjust_ff_dim,
            t.block_ffn_dim_multiplier,
            t.block_multiple_of.max(1),
        ),
        layers,
        heads_q: hq,
        heads_kv: hkv,
        head_dim,
        max_positions: t.max_position_embeddings,
        eps: t.norm_eps as f32,
        rope_theta,
        conv_bias: t.conv_bias,
        conv_kernel: t.conv_l_cache,
        bos: t.bos_token_id,
        eos,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ffn_width_follows_the_auto_adjust_rule() {
        // LFM2-350M: 6656 → int(2·6656/3) = 4437 → × 1.0 → up to a multiple of 256 = 4608.
        assert_eq!(ffn_width(6656, true, Some(1.0), 256), 4608);
        // LFM2-1.2B: 12288 → 8192.
        assert_eq!(ffn_width(12288, true, Some(1.0), 256), 8192);
        assert_eq!(ffn_width(6656, true, None, 256), 4437);
        assert_eq!(ffn_width(100, false, Some(1.0), 256), 100);
    }

    const MINI: &str = r#"{"model_type":"lfm2_vl","vision_config":{"hidden_size":64,
        "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4},
        "text_config":{"model_type":"lfm2","hidden_size":32,"block_ff_dim":96,"num_hidden_layers":3,
        "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,
        "layer_types":["conv","full_attention","conv"],"eos_token_id":7,"rope_theta":1000000.0},
        "projector_hidden_size":48}"#;

    #[test]
    fn reads_a_mini_config_with_defaults() {
        let c = Lfm2VlConfig::parse(Path::new("config.json"), MINI).unwrap();
        assert_eq!(c.vision.layers, 2);
        assert_eq!(c.vision.head_dim, 16);
        assert_eq!(c.vision.pos_grid, 16);
        assert_eq!(
            c.text.layers,
            [LayerKind::Conv, LayerKind::Attention, LayerKind::Conv]
        );
        assert_eq!(c.text.head_dim, 8);
        assert_eq!(c.text.ffn, 256);
        assert_eq!(c.text.eos, [7]);
        assert!(c.projector_norm && c.projector_bias);
        assert_eq!(c.image_token, 396);
    }

    #[test]
    fn errors_name_the_field() {
        let bad = MINI.replace("\"full_attention\",\"conv\"]", "\"mamba\",\"conv\"]");
        let e = Lfm2VlConfig::parse(Path::new("m/config.json"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("m/config.json") && e.contains("text_config.layer_types"),
            "{e}"
        );
        let bad = MINI.replace(
            "\"num_hidden_layers\":2",
            "\"num_hidden_layers\":2,\"vision_feature_layer\":-5",
        );
        let e = Lfm2VlConfig::parse(Path::new("config.json"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vision_feature_layer"), "{e}");
    }
}
