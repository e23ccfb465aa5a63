//! Helpers shared by the fixture tests: expected tensors from the reference's safetensors files
//! and error measures.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_models::qwen_image::vae::VaeConfig;

/// Expected tensors by name: float64 taps, f32 inputs, uint8 images, all widened to f64.
pub struct Expected {
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Expected {
    pub fn load_from(p: &Path) -> Self {
        let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let st =
            safetensors::SafeTensors::deserialize(&bytes).expect("expected.safetensors parses");
        let mut tensors = BTreeMap::new();
        for (name, t) in st.tensors() {
            let d = t.data();
            let values: Vec<f64> = match t.dtype() {
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
            tensors.insert(name, (t.shape().to_vec(), values));
        }
        Expected { tensors }
    }

    pub fn get(&self, name: &str) -> &[f64] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("fixture tensor {name} missing"))
            .1
    }

    pub fn shape(&self, name: &str) -> &[usize] {
        &self.tensors[name].0
    }

    /// An input tensor, exactly as the reference received it (f32).
    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.get(name).iter().map(|&v| v as f32).collect()
    }
}

/// `max |got − want| / max |want|`.
pub fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    max_abs(got, want) / scale
}

pub fn max_abs(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
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
}

/// Tracks the worst error per tap across cases; failures are collected so that one run shows
/// every tap over its bound.
#[derive(Default)]
pub struct Worst {
    pub taps: BTreeMap<String, (f64, f64)>,
    pub failures: Vec<String>,
}

impl Worst {
    pub fn check(&mut self, what: &str, case: &str, err: f64, bound: f64) {
        // NaN fails too.
        if err.is_nan() || err > bound {
            self.failures
                .push(format!("{case}: {what} error {err:.3e} > {bound:.0e}"));
        }
        let e = self.taps.entry(what.to_string()).or_insert((0.0, bound));
        e.0 = e.0.max(err);
    }
    pub fn report(&self, title: &str) {
        for (k, (e, b)) in &self.taps {
            eprintln!("{title} {k:>12}: worst {e:.2e} (bound {b:.0e})");
        }
        assert!(
            self.failures.is_empty(),
            "{title}:\n{}",
            self.failures.join("\n")
        );
    }
}

/// A text file, or a panic naming it.
pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Qwen-Image-2.1's fixture folder.
pub fn qwen_image_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_image")
}

/// The fixture VAE's configuration (encoder and decoder).
pub fn qwen_vae_config() -> VaeConfig {
    let p = qwen_image_dir().join("vae/config.json");
    VaeConfig::parse(&p, &read(&p)).unwrap()
}

/// A `[C, H, W]` tap as channels-last `[H·W, C]`.
pub fn channels_last(ex: &Expected, name: &str) -> Vec<f64> {
    let (shape, v) = (ex.shape(name), ex.get(name));
    let [c, h, w]: [usize; 3] = shape.try_into().unwrap();
    let mut out = vec![0.0; v.len()];
    for ch in 0..c {
        for p in 0..h * w {
            out[p * c + ch] = v[ch * h * w + p];
        }
    }
    out
}

/// The cases of a Qwen-Image VAE fixture (`vae_cases.json`, `vae_encoder_cases.json`).
#[derive(Deserialize)]
pub struct VaeCases {
    pub cases: Vec<VaeCase>,
}

/// One VAE case: its image and latent sizes and the taps it recorded.
#[derive(Deserialize)]
pub struct VaeCase {
    pub name: String,
    pub latent_hw: [usize; 2],
    pub image_hw: [usize; 2],
    pub taps: Vec<String>,
}
