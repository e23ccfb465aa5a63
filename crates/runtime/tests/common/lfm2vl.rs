//! What the LFM2-VL tests share: the reference's fixtures (`tests/fixtures/lfm2vl/`, from
//! `tools/fixtures/lfm2vl.py`: `cases.json` and `expected.safetensors`), the models and messages
//! each case names, and the error measure.

use std::collections::BTreeMap;

use serde::Deserialize;
use tessera_core::config::parse_json;
use tessera_models::ModelFiles;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{Lfm2VlConfig, TilePatches};
use tessera_runtime::{Family, ModelSpec};

use super::root;

#[derive(Deserialize)]
pub struct Cases {
    pub models: BTreeMap<String, ModelCase>,
    pub images: BTreeMap<String, Vec<ImageCase>>,
    pub prompts: Vec<PromptCase>,
}

#[derive(Deserialize)]
pub struct ModelCase {
    pub folder: String,
}

#[derive(Deserialize)]
pub struct ImageCase {
    pub image: String,
    pub tiles: Vec<TileCase>,
    pub tokens: usize,
}

#[derive(Deserialize)]
pub struct TileCase {
    /// `[height, width]` in patches.
    pub spatial_shape: [usize; 2],
    pub patch_rows: [usize; 2],
}

#[derive(Deserialize)]
pub struct PromptCase {
    pub case: String,
    pub model: String,
    pub messages: Vec<serde_json::Value>,
    pub images: Vec<String>,
    pub input_ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub min_margin: f64,
}

pub fn cases() -> Cases {
    let p = root().join("tests/fixtures/lfm2vl/cases.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    parse_json(&p, &text).unwrap()
}

/// `expected.safetensors`: each tensor's values as f64.
pub struct Expected(BTreeMap<String, Vec<f64>>);

impl Expected {
    pub fn load() -> Self {
        let p = root().join("tests/fixtures/lfm2vl/expected.safetensors");
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let st =
            safetensors::SafeTensors::deserialize(&bytes).expect("expected.safetensors parses");
        Expected(
            st.tensors()
                .into_iter()
                .map(|(name, t)| {
                    let d = t.data();
                    let v: Vec<f64> = match t.dtype() {
                        safetensors::Dtype::F64 => d
                            .chunks_exact(8)
                            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                            .collect(),
                        safetensors::Dtype::F32 => d
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                            .collect(),
                        safetensors::Dtype::U8 => d.iter().map(|&b| b as f64).collect(),
                        other => panic!("{name}: unexpected dtype {other:?}"),
                    };
                    (name, v)
                })
                .collect(),
        )
    }

    pub fn get(&self, name: &str) -> &[f64] {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("fixture tensor {name} missing"))
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// `max |got − want| / max(1, max |want|)`.
pub fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_finite() {
                (g as f64 - w).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
        / scale
}

/// A case's model folder and its config.
pub fn files(c: &Cases, model: &str) -> (ModelFiles, Lfm2VlConfig) {
    let f = ModelFiles::Dir(root().join(&c.models[model].folder));
    let cfg = Lfm2VlConfig::read(&f).unwrap();
    (f, cfg)
}

/// A case's model folder as the runtime detects and reads it, for the chat loader.
pub fn spec(c: &Cases, model: &str) -> ModelSpec {
    let dir = root().join(&c.models[model].folder);
    let dir = dir.to_str().expect("the fixture folder's path is UTF-8");
    ModelSpec::open(Some(dir), Family::Lfm2Vl).unwrap()
}

/// A fixture image by name.
pub fn image(name: &str) -> Image {
    Image::open(&root().join(format!("tests/fixtures/lfm2vl/images/{name}.png"))).unwrap()
}

/// A prompt case's messages as the chat template takes them, and the images they name, in order.
pub fn messages(p: &PromptCase) -> (Vec<Message>, Vec<Image>) {
    let mut images = Vec::new();
    let msgs = p
        .messages
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap();
            match &m["content"] {
                serde_json::Value::String(s) => Message::new(role, s),
                serde_json::Value::Array(items) => Message::parts(
                    role,
                    items
                        .iter()
                        .map(|it| {
                            if it["type"] == "image" {
                                images.push(image(it["image"].as_str().unwrap()));
                                Part::Image
                            } else {
                                Part::Text {
                                    text: it["text"].as_str().unwrap().into(),
                                }
                            }
                        })
                        .collect(),
                ),
                other => panic!("{}: content {other}", p.case),
            }
        })
        .collect();
    (msgs, images)
}

/// Each tile's `(grid_w, grid_h, patch bytes)` from the reference processor's pixels of an
/// image (the miniature's where this model's are not stored: the same processor settings but
/// the thumbnail, which comes last).
pub fn tile_bytes(x: &Expected, model: &str, case: &ImageCase) -> Vec<(usize, usize, Vec<u8>)> {
    let own = format!("{model}.{}.pixels", case.image);
    let name = if x.has(&own) {
        own
    } else {
        format!("mini.{}.pixels", case.image)
    };
    let px: Vec<u8> = x.get(&name).iter().map(|&v| v as u8).collect();
    let width = 3 * 16 * 16;
    case.tiles
        .iter()
        .map(|t| {
            let [a, b] = t.patch_rows;
            let [h, w] = t.spatial_shape;
            assert_eq!(b - a, h * w, "{}: patch rows", case.image);
            (w, h, px[a * width..b * width].to_vec())
        })
        .collect()
}

pub fn as_tiles(owned: &[(usize, usize, Vec<u8>)]) -> Vec<TilePatches<'_>> {
    owned
        .iter()
        .map(|(w, h, b)| TilePatches {
            grid_w: *w,
            grid_h: *h,
            bytes: b,
        })
        .collect()
}

/// The tiles of every image of a prompt case, in order.
pub fn prompt_tiles(c: &Cases, x: &Expected, p: &PromptCase) -> Vec<(usize, usize, Vec<u8>)> {
    p.images
        .iter()
        .flat_map(|name| {
            let case = c.images[&p.model]
                .iter()
                .find(|i| &i.image == name)
                .unwrap_or_else(|| panic!("{}: image {name} not in the fixture", p.case));
            tile_bytes(x, &p.model, case)
        })
        .collect()
}
