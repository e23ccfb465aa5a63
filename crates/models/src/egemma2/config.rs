//! `config.json` of an EmbeddingGemma 2 checkpoint, as transformers 5.25 writes it.
//!
//! Reference: `transformers/models/embedding_gemma2/configuration_embedding_gemma2.py` and the
//! heterogeneous-config mixin (`transformers/integrations/heterogeneity/configuration_utils.py`).
//! Two facts of that serialisation shape this parser:
//! - per-layer overrides live in `text_config.per_layer_config`, keyed by zero-padded layer
//!   indices (`"05"`, `"11"`), holding only the layers that differ from the global values;
//! - attributes that vary per layer (`head_dim`, `num_key_value_heads`) are then *omitted* from the
//!   global config, so their class defaults (256, 2) apply to the layers without overrides.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_core::{Error, Result};

/// The two attention kinds of the text encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerType {
    /// Bidirectional band: `|i − j| ≤ sliding_window`.
    Sliding,
    Full,
}

impl LayerType {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "sliding_attention" => Some(LayerType::Sliding),
            "full_attention" => Some(LayerType::Full),
            _ => None,
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            LayerType::Sliding => "sliding_attention",
            LayerType::Full => "full_attention",
        }
    }
}

#[derive(Deserialize)]
struct RawRope {
    rope_type: String,
    rope_theta: f64,
}

fn default_head_dim() -> usize {
    256
}
fn default_kv_heads() -> usize {
    2
}

#[derive(Deserialize)]
struct RawText {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default = "default_kv_heads")]
    num_key_value_heads: usize,
    #[serde(default = "default_head_dim")]
    head_dim: usize,
    hidden_activation: String,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_parameters: BTreeMap<String, RawRope>,
    #[serde(default)]
    attention_bias: bool,
    sliding_window: usize,
    layer_types: Vec<String>,
    hidden_size_per_layer_input: usize,
    embedding_dim: usize,
    #[serde(default)]
    per_layer_config: BTreeMap<String, BTreeMap<String, serde_json::Value>>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<u32>,
}

#[derive(Deserialize)]
struct RawAxialRope {
    rope_type: String,
    rope_theta: f64,
}

/// `vision_config` (`Gemma4VisionConfig`); omitted keys take the class defaults, which are the
/// release values (a diff-serialised config leaves them out).
#[derive(Deserialize)]
struct RawVision {
    model_type: Option<String>,
    #[serde(default = "vision_defaults::hidden")]
    hidden_size: usize,
    #[serde(default = "vision_defaults::intermediate")]
    intermediate_size: usize,
    #[serde(default = "vision_defaults::layers")]
    num_hidden_layers: usize,
    #[serde(default = "vision_defaults::heads")]
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_vision_activation")]
    hidden_activation: String,
    #[serde(default = "default_vision_eps")]
    rms_norm_eps: f64,
    rope_parameters: Option<RawAxialRope>,
    #[serde(default = "vision_defaults::pool")]
    pooling_kernel_size: usize,
    #[serde(default = "vision_defaults::patch")]
    patch_size: usize,
    #[serde(default = "vision_defaults::positions")]
    position_embedding_size: usize,
    #[serde(default)]
    use_clipped_linears: bool,
    #[serde(default)]
    standardize: bool,
    #[serde(default)]
    attention_bias: Option<bool>,
}

mod vision_defaults {
    pub fn hidden() -> usize {
        768
    }
    pub fn intermediate() -> usize {
        3072
    }
    pub fn layers() -> usize {
        16
    }
    pub fn heads() -> usize {
        12
    }
    pub fn pool() -> usize {
        3
    }
    pub fn patch() -> usize {
        16
    }
    pub fn positions() -> usize {
        10240
    }
}

fn default_vision_activation() -> String {
    "gelu_pytorch_tanh".into()
}
fn default_vision_eps() -> f64 {
    1e-6
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    text_config: Option<RawText>,
    #[serde(default)]
    vision_config: Option<RawVision>,
    boi_token_id: Option<u32>,
    eoi_token_id: Option<u32>,
    image_token_id: Option<u32>,
    video_token_id: Option<u32>,
    audio_token_id: Option<u32>,
}

/// One text layer's attention shape after per-layer overrides.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub kind: LayerType,
    pub head_dim: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
}

/// RoPE of one layer type.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Head dimension the inverse frequencies are computed for (the first layer of the type,
    /// as the reference does).
    pub head_dim: usize,
}

/// The text encoder's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub max_positions: usize,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    pub ple_dim: usize,
    pub embedding_dim: usize,
    pub layers: Vec<LayerConfig>,
    pub rope_sliding: Option<RopeConfig>,
    pub rope_full: Option<RopeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
}

/// The vision tower's configuration (spec §2.2).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// Axial RoPE base (100 in the release).
    pub rope_theta: f64,
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    /// Rows per axis of the learned position table: the largest patch grid side.
    pub position_embedding_size: usize,
}

/// Token ids that frame an image in the text sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageTokens {
    /// `<|image>`, before the soft tokens.
    pub begin: u32,
    /// `<|image|>`, one per soft token (its rows are overwritten).
    pub placeholder: u32,
    /// `<image|>`, after the soft tokens.
    pub end: u32,
}

/// The composite model's configuration (text and vision; audio is not supported).
#[derive(Clone, Debug)]
pub struct Config {
    pub path: PathBuf,
    pub text: TextConfig,
    pub vision: Option<VisionConfig>,
    /// Present when the config has a vision tower.
    pub image_tokens: Option<ImageTokens>,
    /// Placeholder ids that must never appear in a text-only input.
    pub media_token_ids: Vec<u32>,
}

impl TextConfig {
    /// Model FLOPs of one forward over sequences of `lens` tokens: every GEMM (2 per
    /// multiply-add) plus attention's two products over the visible key pairs. Norms and
    /// elementwise work are not counted (the usual convention for MFU).
    pub fn forward_flops(&self, lens: &[usize]) -> f64 {
        let t: f64 = lens.iter().sum::<usize>() as f64;
        let (h, p) = (self.hidden_size as f64, self.ple_dim as f64);
        let mut flops = 0.0;
        for l in &self.layers {
            let (q, kv, im) = (
                (self.num_heads * l.head_dim) as f64,
                (l.kv_heads * l.head_dim) as f64,
                l.intermediate_size as f64,
            );
            let macs_per_token = h * (q + 2.0 * kv) + q * h + h * 2.0 * im + im * h + 3.0 * h * p;
            flops += 2.0 * t * macs_per_token;
            let window = (l.kind == LayerType::Sliding).then_some(self.sliding_window);
            let pairs: f64 = lens
                .iter()
                .map(|&n| match window {
                    None => (n * n) as f64,
                    Some(w) => (0..n)
                        .map(|i| (i.min(w) + (n - 1 - i).min(w) + 1) as f64)
                        .sum(),
                })
                .sum();
            flops += 4.0 * (self.num_heads * l.head_dim) as f64 * pairs;
        }
        flops + 2.0 * lens.len() as f64 * h * self.embedding_dim as f64
    }

    pub fn rope(&self, kind: LayerType) -> Option<&RopeConfig> {
        match kind {
            LayerType::Sliding => self.rope_sliding.as_ref(),
            LayerType::Full => self.rope_full.as_ref(),
        }
    }
}

impl Config {
    /// `config.json` of a model's files (a folder or the bundled model).
    pub fn read(files: &crate::ModelFiles) -> Result<Self> {
        Self::parse(&files.path("config.json"), &files.read("config.json")?)
    }

    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawConfig = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        match raw.model_type.as_deref() {
            Some("embedding_gemma2") => {}
            Some(other) => {
                return Err(err(
                    "model_type",
                    format!(
                        "{other:?} is not an EmbeddingGemma 2 model (expected \"embedding_gemma2\")"
                    ),
                ));
            }
            None => {
                return Err(err(
                    "model_type",
                    "missing (expected \"embedding_gemma2\")".into(),
                ));
            }
        }
        let t = raw
            .text_config
            .ok_or_else(|| err("text_config", "missing".into()))?;
        if t.hidden_activation != "gelu_pytorch_tanh" {
            return Err(err(
                "text_config.hidden_activation",
                format!(
                    "{:?} is not supported (only gelu_pytorch_tanh)",
                    t.hidden_activation
                ),
            ));
        }
        if t.attention_bias {
            return Err(err(
                "text_config.attention_bias",
                "true is not supported".into(),
            ));
        }
        if t.layer_types.len() != t.num_hidden_layers {
            return Err(err(
                "text_config.layer_types",
                format!(
                    "{} entries for {} layers",
                    t.layer_types.len(),
                    t.num_hidden_layers
                ),
            ));
        }
        // Overrides by layer index; keys are zero-padded strings.
        let mut overrides: BTreeMap<usize, &BTreeMap<String, serde_json::Value>> = BTreeMap::new();
        for (key, o) in &t.per_layer_config {
            let field = format!("text_config.per_layer_config.{key}");
            let idx: usize = key
                .parse()
                .map_err(|_| err(&field, "key is not a layer index".into()))?;
            if idx >= t.num_hidden_layers {
                return Err(err(
                    &field,
                    format!("layer {idx} of {}", t.num_hidden_layers),
                ));
            }
            overrides.insert(idx, o);
        }
        let mut layers = Vec::with_capacity(t.num_hidden_layers);
        for (i, ty) in t.layer_types.iter().enumerate() {
            let kind = LayerType::parse(ty).ok_or_else(|| {
                err(
                    &format!("text_config.layer_types[{i}]"),
                    format!("{ty:?} (expected sliding_attention or full_attention)"),
                )
            })?;
            let mut lc = LayerConfig {
                kind,
                head_dim: t.head_dim,
                kv_heads: t.num_key_value_heads,
                intermediate_size: t.intermediate_size,
            };
            if let Some(o) = overrides.get(&i) {
                for (name, value) in o.iter() {
                    let field = format!("text_config.per_layer_config.{i}.{name}");
                    let as_usize = || {
                        value.as_u64().map(|v| v as usize).ok_or_else(|| {
                            err(&field, format!("{value} is not a positive integer"))
                        })
                    };
                    match name.as_str() {
                        "head_dim" => lc.head_dim = as_usize()?,
                        "num_key_value_heads" => lc.kv_heads = as_usize()?,
                        "intermediate_size" => lc.intermediate_size = as_usize()?,
                        _ => {
                            return Err(err(
                                &field,
                                "this per-layer override is not supported".into(),
                            ));
                        }
                    }
                }
            }
            if lc.kv_heads == 0 || !t.num_attention_heads.is_multiple_of(lc.kv_heads) {
                return Err(err(
                    &format!("text_config (layer {i}) num_key_value_heads"),
                    format!(
                        "{} does not divide num_attention_heads {}",
                        lc.kv_heads, t.num_attention_heads
                    ),
                ));
            }
            if lc.head_dim == 0 || !lc.head_dim.is_multiple_of(2) {
                return Err(err(
                    &format!("text_config (layer {i}) head_dim"),
                    format!("{} must be even and positive", lc.head_dim),
                ));
            }
            layers.push(lc);
        }
        let rope_for = |kind: LayerType| -> Result<Option<RopeConfig>> {
            let Some(first) = layers.iter().find(|l| l.kind == kind) else {
                return Ok(None);
            };
            let field = format!("text_config.rope_parameters.{}", kind.key());
            let r = t
                .rope_parameters
                .get(kind.key())
                .ok_or_else(|| err(&field, "missing".into()))?;
            if r.rope_type != "default" {
                return Err(err(
                    &format!("{field}.rope_type"),
                    format!("{:?} is not supported (only default)", r.rope_type),
                ));
            }
            if let Some(l) = layers
                .iter()
                .find(|l| l.kind == kind && l.head_dim != first.head_dim)
            {
                return Err(err(
                    &field,
                    format!(
                        "layers of one type have head dims {} and {}",
                        first.head_dim, l.head_dim
                    ),
                ));
            }
            Ok(Some(RopeConfig {
                theta: r.rope_theta,
                head_dim: first.head_dim,
            }))
        };
        // The band is |i − j| ≤ sliding_window: 0 would leave each token attending only to itself.
        if t.sliding_window == 0 && layers.iter().any(|l| l.kind == LayerType::Sliding) {
            return Err(err(
                "text_config.sliding_window",
                "0 is not a window (a sliding layer would attend to nothing but its own token); it must be at least 1".into(),
            ));
        }
        let rope_sliding = rope_for(LayerType::Sliding)?;
        let rope_full = rope_for(LayerType::Full)?;
        let eos_token_id = match &t.eos_token_id {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|v| v as u32),
            Some(serde_json::Value::Array(a)) => {
                a.first().and_then(|v| v.as_u64()).map(|v| v as u32)
            }
            Some(other) => {
                return Err(err(
                    "text_config.eos_token_id",
                    format!("{other} is not a token id"),
                ));
            }
        };
        let text = TextConfig {
            vocab_size: t.vocab_size,
            hidden_size: t.hidden_size,
            num_heads: t.num_attention_heads,
            max_positions: t.max_position_embeddings,
            rms_norm_eps: t.rms_norm_eps as f32,
            sliding_window: t.sliding_window,
            ple_dim: t.hidden_size_per_layer_input,
            embedding_dim: t.embedding_dim,
            layers,
            rope_sliding,
            rope_full,
            bos_token_id: t.bos_token_id,
            eos_token_id,
            pad_token_id: t.pad_token_id,
        };
        let media_token_ids = [raw.image_token_id, raw.video_token_id, raw.audio_token_id]
            .into_iter()
            .flatten()
            .collect();
        let vision = raw
            .vision_config
            .map(|v| parse_vision(v, &err))
            .transpose()?;
        let image_tokens = match &vision {
            None => None,
            Some(_) => {
                let id = |v: Option<u32>, field: &str| {
                    v.ok_or_else(|| err(field, "missing (needed with a vision_config)".into()))
                };
                Some(ImageTokens {
                    begin: id(raw.boi_token_id, "boi_token_id")?,
                    placeholder: id(raw.image_token_id, "image_token_id")?,
                    end: id(raw.eoi_token_id, "eoi_token_id")?,
                })
            }
        };
        Ok(Config {
            path: path.to_path_buf(),
            text,
            vision,
            image_tokens,
            media_token_ids,
        })
    }
}

fn parse_vision(v: RawVision, err: &dyn Fn(&str, String) -> Error) -> Result<VisionConfig> {
    let field = |f: &str| format!("vision_config.{f}");
    if let Some(t) = v.model_type.as_deref()
        && t != "gemma4_vision"
    {
        return Err(err(
            &field("model_type"),
            format!("{t:?} is not supported (expected \"gemma4_vision\")"),
        ));
    }
    if v.hidden_activation != "gelu_pytorch_tanh" {
        return Err(err(
            &field("hidden_activation"),
            format!(
                "{:?} is not supported (only gelu_pytorch_tanh)",
                v.hidden_activation
            ),
        ));
    }
    for (name, on) in [
        ("use_clipped_linears", v.use_clipped_linears),
        ("standardize", v.standardize),
        ("attention_bias", v.attention_bias.unwrap_or(false)),
    ] {
        if on {
            return Err(err(&field(name), "true is not supported".into()));
        }
    }
    let rope_theta = match v.rope_parameters {
        None => 100.0,
        Some(r) if r.rope_type == "axial" => r.rope_theta,
        Some(r) => {
            return Err(err(
                &field("rope_parameters.rope_type"),
                format!("{:?} is not supported (only axial)", r.rope_type),
            ));
        }
    };
    // Gemma4VisionConfig's defaults for the keys its serialisation may omit.
    let kv_heads = v.num_key_value_heads.unwrap_or(12);
    let head_dim = v.head_dim.unwrap_or(64);
    if kv_heads == 0 || !v.num_attention_heads.is_multiple_of(kv_heads) {
        return Err(err(
            &field("num_key_value_heads"),
            format!(
                "{kv_heads} does not divide num_attention_heads {}",
                v.num_attention_heads
            ),
        ));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(4) {
        return Err(err(
            &field("head_dim"),
            format!("{head_dim} must be a positive multiple of 4 (axial 2-D RoPE)"),
        ));
    }
    for (name, n) in [
        ("patch_size", v.patch_size),
        ("pooling_kernel_size", v.pooling_kernel_size),
        ("position_embedding_size", v.position_embedding_size),
    ] {
        if n == 0 {
            return Err(err(&field(name), "must be positive".into()));
        }
    }
    Ok(VisionConfig {
        hidden_size: v.hidden_size,
        intermediate_size: v.intermediate_size,
        num_layers: v.num_hidden_layers,
        num_heads: v.num_attention_heads,
        kv_heads,
        head_dim,
        rms_norm_eps: v.rms_norm_eps as f32,
        rope_theta,
        patch_size: v.patch_size,
        pooling_kernel_size: v.pooling_kernel_size,
        position_embedding_size: v.position_embedding_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release_like() -> serde_json::Value {
        serde_json::json!({
            "model_type": "embedding_gemma2",
            "text_config": {
                "vocab_size": 262144, "hidden_size": 512, "intermediate_size": 2048,
                "num_hidden_layers": 12, "num_attention_heads": 4,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262144,
                "rms_norm_eps": 1e-6, "sliding_window": 512, "hidden_size_per_layer_input": 512,
                "embedding_dim": 768,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}
                },
                "layer_types": ["sliding_attention","sliding_attention","sliding_attention","sliding_attention","sliding_attention","full_attention",
                                "sliding_attention","sliding_attention","sliding_attention","sliding_attention","sliding_attention","full_attention"],
                "per_layer_config": {"05": {"head_dim": 512, "num_key_value_heads": 1},
                                     "11": {"head_dim": 512, "num_key_value_heads": 1}},
                "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0
            },
            "image_token_id": 258880, "boi_token_id": 255999, "eoi_token_id": 258882,
            "vision_config": {"model_type": "gemma4_vision", "head_dim": 64,
                              "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
        })
    }

    #[test]
    fn vision_config_defaults_and_refusals() {
        let c = Config::parse(Path::new("config.json"), &release_like().to_string()).unwrap();
        let v = c.vision.unwrap();
        assert_eq!(
            (v.hidden_size, v.num_layers, v.kv_heads, v.patch_size),
            (768, 16, 12, 16)
        );
        assert_eq!(v.position_embedding_size, 10240);
        assert_eq!(c.image_tokens.unwrap().placeholder, 258880);
        for (key, value) in [
            ("use_clipped_linears", serde_json::json!(true)),
            ("standardize", serde_json::json!(true)),
            ("head_dim", serde_json::json!(30)),
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "default", "rope_theta": 1.0}),
            ),
        ] {
            let mut j = release_like();
            j["vision_config"][key] = value;
            let e = Config::parse(Path::new("config.json"), &j.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("vision_config.{key}")), "{key}: {e}");
        }
        let mut j = release_like();
        j.as_object_mut().unwrap().remove("boi_token_id");
        let e = Config::parse(Path::new("config.json"), &j.to_string()).unwrap_err();
        assert!(e.to_string().contains("boi_token_id"), "{e}");
    }

    #[test]
    fn per_layer_overrides_and_omitted_globals() {
        let c = Config::parse(Path::new("config.json"), &release_like().to_string()).unwrap();
        let t = &c.text;
        assert_eq!(
            t.layers[0],
            LayerConfig {
                kind: LayerType::Sliding,
                head_dim: 256,
                kv_heads: 2,
                intermediate_size: 2048
            }
        );
        assert_eq!(
            t.layers[5],
            LayerConfig {
                kind: LayerType::Full,
                head_dim: 512,
                kv_heads: 1,
                intermediate_size: 2048
            }
        );
        assert_eq!(t.layers[11].kind, LayerType::Full);
        assert_eq!(
            t.rope_full,
            Some(RopeConfig {
                theta: 1e6,
                head_dim: 512
            })
        );
        assert_eq!(
            t.rope_sliding,
            Some(RopeConfig {
                theta: 1e4,
                head_dim: 256
            })
        );
        assert_eq!(c.media_token_ids, vec![258880]);
    }

    #[test]
    fn errors_name_the_field() {
        type Edit = Box<dyn Fn(&mut serde_json::Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|v| {
                    v["text_config"]
                        .as_object_mut()
                        .unwrap()
                        .remove("hidden_size");
                }),
                "hidden_size",
            ),
            (
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("text_config");
                }),
                "text_config",
            ),
            (
                Box::new(|v| {
                    v["model_type"] = "bert".into();
                }),
                "model_type",
            ),
            (
                Box::new(|v| {
                    v["text_config"]["layer_types"][3] = "local".into();
                }),
                "layer_types[3]",
            ),
            (
                Box::new(|v| {
                    v["text_config"]["per_layer_config"]["05"]["skip"] = serde_json::json!(["mlp"]);
                }),
                "per_layer_config.5.skip",
            ),
            (
                Box::new(|v| {
                    v["text_config"]["rope_parameters"]
                        .as_object_mut()
                        .unwrap()
                        .remove("full_attention");
                }),
                "rope_parameters.full_attention",
            ),
            (
                Box::new(|v| {
                    v["text_config"]["hidden_size"] = "wide".into();
                }),
                "hidden_size",
            ),
            (
                Box::new(|v| {
                    v["text_config"]["sliding_window"] = 0.into();
                }),
                "text_config.sliding_window",
            ),
        ];
        for (edit, field) in cases {
            let mut v = release_like();
            edit(&mut v);
            let e = Config::parse(Path::new("x/config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(field) && e.contains("x/config.json"),
                "{field}: {e}"
            );
        }
    }
}
