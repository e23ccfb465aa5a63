//! What the model tests share ([`lfm2vl`]: LFM2-VL's; [`text_to_image`]: the image generators'). EmbeddingGemma 2's: the PyTorch reference's fixtures
//! (`tests/fixtures/egemma2/`: `cases.json` from `tools/fixtures/egemma2.py`, `vision_cases.json`
//! from `tools/fixtures/egemma2_vision.py`), the inputs and options each case describes, and the
//! distance of an embedding from the reference.

#![allow(dead_code)] // each test file uses its own subset

pub mod floor;
pub mod lfm2vl;
pub mod text_to_image;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_models::egemma2::{Input, Part, TextOptions};
use tessera_models::imageproc::Image;
use tessera_runtime::embed::Egemma2;

/// The repository root: `TESSERA_ROOT` when the test executable runs from a copied tree (the GPU
/// machine), else the source tree it was built from.
pub fn root() -> PathBuf {
    std::env::var_os("TESSERA_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// The JSON file at `path` under the repository root.
fn read_json<T: DeserializeOwned>(path: &str) -> T {
    let path = root().join(path);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `cases.json`: texts, their token ids and embeddings per model.
#[derive(Deserialize)]
pub struct TextFixture {
    /// Model label → folder under the repository root.
    pub models: BTreeMap<String, String>,
    pub rope_inv_freq: BTreeMap<String, Vec<f32>>,
    pub cases: Vec<TextCase>,
}

#[derive(Deserialize)]
pub struct TextCase {
    pub name: String,
    pub texts: Vec<String>,
    pub prompt_name: Option<String>,
    pub prompt: Option<String>,
    pub dim: Option<usize>,
    pub max_tokens: Option<usize>,
    pub ids: Vec<Vec<u32>>,
    /// Model label → one embedding per text.
    pub expected: BTreeMap<String, Vec<Vec<f64>>>,
}

impl TextCase {
    pub fn texts(&self) -> Vec<&str> {
        self.texts.iter().map(String::as_str).collect()
    }

    pub fn opts(&self) -> TextOptions {
        TextOptions {
            prompt_name: self.prompt_name.clone(),
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
        }
    }
}

pub fn text_fixture() -> TextFixture {
    read_json("tests/fixtures/egemma2/cases.json")
}

/// `vision_cases.json`: inputs of text and image parts, their token ids and embeddings.
#[derive(Deserialize)]
pub struct VisionFixture {
    /// Model label → folder under the repository root.
    pub models: BTreeMap<String, String>,
    /// The processor's soft-token budget the cases were made at.
    pub budget: usize,
    pub soft_tokens_rgb_100x100: Vec<Vec<f64>>,
    pub vision_rope_inv_freq: Vec<f32>,
    pub cases: Vec<VisionCase>,
}

#[derive(Deserialize)]
pub struct VisionCase {
    pub name: String,
    /// Each part `{"text": …}` or `{"image": file name under images/}`.
    pub parts: Vec<BTreeMap<String, String>>,
    pub prompt_name: Option<String>,
    pub dim: Option<usize>,
    pub ids: Vec<u32>,
    /// Model label → the embedding.
    pub expected: BTreeMap<String, Vec<f64>>,
}

impl VisionCase {
    pub fn input(&self) -> Input {
        Input {
            parts: self
                .parts
                .iter()
                .map(|p| match (p.get("text"), p.get("image")) {
                    (Some(t), None) => Part::Text(t.clone()),
                    (None, Some(i)) => Part::Image(image(i)),
                    _ => panic!("{}: malformed part {p:?}", self.name),
                })
                .collect(),
        }
    }

    pub fn opts(&self) -> TextOptions {
        TextOptions {
            prompt_name: self.prompt_name.clone(),
            ..TextOptions::default()
        }
    }
}

pub fn vision_fixture() -> VisionFixture {
    read_json("tests/fixtures/egemma2/vision_cases.json")
}

/// A fixture image by file name.
pub fn image(name: &str) -> Image {
    Image::open(&root().join("tests/fixtures/egemma2/images").join(name))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The model in `dir` (relative to the repository root) on the CPU.
pub fn cpu_model(dir: &str) -> Egemma2<CpuBackend> {
    Egemma2::load(CpuBackend::new(), ModelFiles::Dir(root().join(dir))).expect("model loads")
}

/// A copy of the bundled miniature model whose JSON file `file` was changed by `edit`.
pub fn edited_mini(file: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = root().join("crates/models/assets/egemma2-mini");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join(file);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
    dir
}

/// The largest absolute difference between an embedding and the reference's.
pub fn max_abs(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "embedding width");
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            // A non-finite output is an infinite error (`f64::max` would drop a NaN).
            if g.is_finite() {
                (g as f64 - w).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}
