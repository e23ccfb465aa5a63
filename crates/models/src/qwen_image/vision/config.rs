//! The vision tower's settings: `vision_config` of the text encoder's Qwen3-VL `config.json`
//! (transformers 5.25.0 `Qwen3VLVisionConfig`, its defaults where a key is absent).

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

#[derive(Deserialize)]
struct RawRope {
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_type: Option<String>,
}

#[derive(Deserialize)]
struct RawVision {
    #[serde(default = "d_depth")]
    depth: usize,
    #[serde(default = "d_hidden")]
    hidden_size: usize,
    #[serde(default = "d_act")]
    hidden_act: String,
    #[serde(default = "d_inter")]
    intermediate_size: usize,
    #[serde(default = "d_heads")]
    num_heads: usize,
    #[serde(default = "d_channels")]
    in_channels: usize,
    #[serde(default = "d_patch")]
    patch_size: usize,
    #[serde(default = "d_two")]
    spatial_merge_size: usize,
    #[serde(default = "d_two")]
    temporal_patch_size: usize,
    #[serde(default = "d_out")]
    out_hidden_size: usize,
    #[serde(default = "d_positions")]
    num_position_embeddings: usize,
    #[serde(default = "d_deepstack")]
    deepstack_visual_indexes: Vec<usize>,
    #[serde(default)]
    rope_parameters: Option<RawRope>,
}

fn default_theta() -> f64 {
    10_000.0
}
fn d_depth() -> usize {
    27
}
fn d_hidden() -> usize {
    1152
}
fn d_act() -> String {
    "gelu_pytorch_tanh".into()
}
fn d_inter() -> usize {
    4304
}
fn d_heads() -> usize {
    16
}
fn d_channels() -> usize {
    3
}
fn d_patch() -> usize {
    16
}
fn d_two() -> usize {
    2
}
fn d_out() -> usize {
    3584
}
fn d_positions() -> usize {
    2304
}
fn d_deepstack() -> Vec<usize> {
    vec![8, 16, 24]
}

#[derive(Deserialize)]
struct Outer {
    vision_config: Option<RawVision>,
}

/// Qwen3-VL's vision tower, as far as it is implemented (module docs of
/// [`super::tower`]).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub patch: usize,
    pub temporal: usize,
    pub merge: usize,
    /// The language model's width, which the mergers project to.
    pub out_hidden: usize,
    /// Side of the square learned position grid.
    pub pos_side: usize,
    /// Blocks after which a DeepStack merger reads the stream, in order.
    pub deepstack: Vec<usize>,
    pub rope_theta: f64,
}

impl VisionConfig {
    /// Read `vision_config` from the text encoder's `config.json`, rejecting what is not
    /// implemented by field name.
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let outer: Outer = tessera_core::config::parse_json(path, json)?;
        let r = outer.vision_config.ok_or_else(|| {
            Error::config(
                path,
                "vision_config",
                "missing: this text encoder has no vision tower, so it cannot read condition images",
            )
        })?;
        let err =
            |field: &str, msg: String| Error::config(path, format!("vision_config.{field}"), msg);
        if r.hidden_act != "gelu_pytorch_tanh" {
            return Err(err(
                "hidden_act",
                format!(
                    "{:?} is not implemented (only gelu_pytorch_tanh)",
                    r.hidden_act
                ),
            ));
        }
        if r.in_channels != 3 {
            return Err(err(
                "in_channels",
                format!("{} (only 3, RGB)", r.in_channels),
            ));
        }
        for (name, v, max) in [
            ("depth", r.depth, 256),
            ("hidden_size", r.hidden_size, 1 << 14),
            ("intermediate_size", r.intermediate_size, 1 << 16),
            ("num_heads", r.num_heads, 256),
            ("patch_size", r.patch_size, 64),
            ("spatial_merge_size", r.spatial_merge_size, 8),
            ("temporal_patch_size", r.temporal_patch_size, 8),
            ("out_hidden_size", r.out_hidden_size, 1 << 16),
            (
                "num_position_embeddings",
                r.num_position_embeddings,
                1 << 20,
            ),
        ] {
            if v == 0 || v > max {
                return Err(err(name, format!("{v} is not in 1..={max}")));
            }
        }
        if !r.hidden_size.is_multiple_of(r.num_heads)
            || !(r.hidden_size / r.num_heads).is_multiple_of(4)
        {
            return Err(err(
                "num_heads",
                format!(
                    "{} heads of a {}-wide stream: the head width must be a multiple of 4 (2-D rotary)",
                    r.num_heads, r.hidden_size
                ),
            ));
        }
        let side = r.num_position_embeddings.isqrt();
        if side * side != r.num_position_embeddings {
            return Err(err(
                "num_position_embeddings",
                format!("{} is not a square grid", r.num_position_embeddings),
            ));
        }
        if r.deepstack_visual_indexes.iter().any(|&i| i >= r.depth)
            || !r.deepstack_visual_indexes.is_sorted_by(|a, b| a < b)
        {
            return Err(err(
                "deepstack_visual_indexes",
                format!(
                    "{:?} must be increasing block indexes below the depth {}",
                    r.deepstack_visual_indexes, r.depth
                ),
            ));
        }
        let rope = r.rope_parameters.unwrap_or(RawRope {
            rope_theta: default_theta(),
            rope_type: None,
        });
        if rope.rope_type.as_deref().is_some_and(|t| t != "axial") {
            return Err(err(
                "rope_parameters.rope_type",
                format!("{:?} is not implemented (only axial)", rope.rope_type),
            ));
        }
        if !(rope.rope_theta.is_finite() && rope.rope_theta > 0.0) {
            return Err(err(
                "rope_parameters.rope_theta",
                format!("{} must be positive", rope.rope_theta),
            ));
        }
        Ok(VisionConfig {
            depth: r.depth,
            hidden: r.hidden_size,
            intermediate: r.intermediate_size,
            heads: r.num_heads,
            head_dim: r.hidden_size / r.num_heads,
            patch: r.patch_size,
            temporal: r.temporal_patch_size,
            merge: r.spatial_merge_size,
            out_hidden: r.out_hidden_size,
            pos_side: side,
            deepstack: r.deepstack_visual_indexes,
            rope_theta: rope.rope_theta,
        })
    }

    /// Values per patch row, `C·T·P·P`.
    pub fn row_width(&self) -> usize {
        3 * self.temporal * self.patch * self.patch
    }

    /// Patches merged into one token.
    pub fn merge_unit(&self) -> usize {
        self.merge * self.merge
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINI: &str = include_str!("../../../assets/qwen-image-mini/text_encoder/config.json");

    #[test]
    fn the_miniature_has_a_one_block_tower_with_deepstack() {
        let c = VisionConfig::parse(Path::new("config.json"), MINI).unwrap();
        assert_eq!((c.depth, c.hidden, c.heads, c.head_dim), (1, 32, 2, 16));
        assert_eq!(
            (c.pos_side, c.out_hidden, c.deepstack.clone()),
            (8, 96, vec![0])
        );
        assert_eq!(c.row_width(), 1536);
    }

    #[test]
    fn unimplemented_or_broken_settings_name_their_field() {
        let p = Path::new("config.json");
        let e = VisionConfig::parse(p, &MINI.replace("\"gelu_pytorch_tanh\"", "\"silu\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("vision_config.hidden_act"), "{e}");
        let e = VisionConfig::parse(
            p,
            &MINI.replace(
                "\"num_position_embeddings\": 64",
                "\"num_position_embeddings\": 60",
            ),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("num_position_embeddings"), "{e}");
        let e = VisionConfig::parse(p, "{\"model_type\": \"qwen3_vl\"}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("vision_config"), "{e}");
    }
}
