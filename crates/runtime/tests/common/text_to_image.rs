//! What the text-to-image GPU tests share: error measures of taps and 8-bit images, and the bf16
//! storage floors (`tests/fixtures/<family>/bf16_floor.json`, from
//! `tools/device/<family>_bf16_floor.py`).

use std::collections::BTreeMap;

use serde::Deserialize;

/// A bf16 result may be this many times further from the reference than the storage floor.
pub const FLOOR_FACTOR: f64 = 1.5;

/// `max |a − b| / max |b|`.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "tap lengths differ");
    let num = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max);
    let den = b.iter().map(|&y| (y as f64).abs()).fold(0.0, f64::max);
    if den == 0.0 { num } else { num / den }
}

/// The worst [`rel`] over pairs of taps (items, steps).
pub fn worst<'a>(pairs: impl IntoIterator<Item = (&'a Vec<f32>, &'a Vec<f32>)>) -> f64 {
    pairs
        .into_iter()
        .map(|(a, b)| rel(a, b))
        .fold(0.0, f64::max)
}

/// PSNR of 8-bit images in dB.
pub fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (255.0f64.powi(2) / mse).log10()
    }
}

pub fn max_level_diff(a: &[u8], b: &[u8]) -> u8 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x.abs_diff(y))
        .max()
        .unwrap_or(0)
}

/// A case of a `bf16_floor.json`: the float64 reference with only a bf16 engine's storage
/// roundings, per tap, on a family's miniature.
#[derive(Deserialize)]
pub struct FloorCase {
    pub label: String,
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub height: usize,
    pub width: usize,
    pub steps: usize,
    pub guidance: f32,
    pub init_latent: Vec<f32>,
    pub floor: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
struct Floors {
    cases: Vec<FloorCase>,
}

/// The cases of `tests/fixtures/{family}/bf16_floor.json`.
pub fn floor_cases(family: &str) -> Vec<FloorCase> {
    let path = super::root().join(format!("tests/fixtures/{family}/bf16_floor.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let floors: Floors = serde_json::from_str(&text).expect("bf16_floor.json");
    floors.cases
}
