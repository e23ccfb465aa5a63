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
    // A non-finite value on either side is an infinite error (`f64::max` would drop a NaN).
    let num = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| {
            if x.is_finite() && y.is_finite() {
                (x as f64 - y as f64).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max);
    if num.is_infinite() {
        return num;
    }
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
    assert_eq!(a.len(), b.len(), "8-bit image lengths differ");
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
    assert_eq!(a.len(), b.len(), "8-bit image lengths differ");
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

/// Everything one generation exposes, read back as `f32`.
#[derive(Default)]
pub struct Taps {
    /// The text encoder's features per prompt.
    pub features: Vec<Vec<f32>>,
    /// Per step: the velocity of each item.
    pub velocity: Vec<Vec<Vec<f32>>>,
    /// Per step: every image's latent after the update.
    pub latent: Vec<Vec<f32>>,
    /// The decoder's output in floats, every image.
    pub decoded: Vec<f32>,
    /// The 8-bit images.
    pub pixels: Vec<u8>,
}

impl Taps {
    /// Record one pipeline event: each step's velocity and latents, the latest latents kept in
    /// `last` for [`Taps::finish`].
    pub fn record(
        &mut self,
        e: tessera_models::text_to_image::Event<'_>,
        last: &mut Vec<Vec<f32>>,
    ) {
        if let tessera_models::text_to_image::Event::Step { v, latents, .. } = e {
            self.velocity.push(v.to_vec());
            self.latent.push(latents.concat());
            *last = latents.to_vec();
        }
    }

    /// The last latents decoded to floats by `decode`, and the run's 8-bit `images`.
    pub fn finish(
        &mut self,
        last: &[Vec<f32>],
        decode: impl Fn(&[f32]) -> Vec<f32>,
        images: Vec<tessera_models::text_to_image::Image>,
    ) {
        for latent in last {
            self.decoded.extend(decode(latent));
        }
        self.pixels = images.into_iter().flat_map(|i| i.pixels).collect();
    }
}

/// A text-to-image family as the GPU tests drive it.
pub trait Family {
    /// The features tap's name (as in the family's `bf16_floor.json`).
    const FEATURES: &'static str;
    /// One generation of `req` on `be`, every tap recorded.
    fn run<B: tessera_backend::Backend + 'static>(
        &self,
        be: B,
        req: &tessera_models::text_to_image::Request,
    ) -> Taps;
}

/// Each tap's relative error of `got` against `want`, by name (the worst over items and steps).
pub fn errors<F: Family>(got: &Taps, want: &Taps) -> Vec<(&'static str, f64)> {
    let velocity: Vec<_> = got
        .velocity
        .iter()
        .zip(&want.velocity)
        .flat_map(|(a, b)| a.iter().zip(b))
        .collect();
    vec![
        (F::FEATURES, worst(got.features.iter().zip(&want.features))),
        ("velocity", worst(velocity)),
        ("latent", worst(got.latent.iter().zip(&want.latent))),
        ("decoded image", rel(&got.decoded, &want.decoded)),
    ]
}

#[cfg(feature = "cuda")]
pub fn gpu(p: tessera_backend::Precision) -> tessera_backend::cuda::CudaBackend {
    tessera_backend::cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"))
}

/// The CPU, then CUDA in f32 and bf16, with `req`; returns failures: an f32 tap over 1e-5 of the
/// CPU, an f32 8-bit image more than one level off, a bf16 image under `bf16_psnr` dB.
#[cfg(feature = "cuda")]
pub fn compare<F: Family>(
    label: &str,
    family: &F,
    req: &tessera_models::text_to_image::Request,
    bf16_psnr: Option<f64>,
) -> Vec<String> {
    use tessera_backend::Precision;
    let cpu = family.run(tessera_backend::cpu::CpuBackend::new(), req);
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        let got = family.run(gpu(p), req);
        assert_eq!(got.velocity.len(), cpu.velocity.len());
        let db = psnr(&got.pixels, &cpu.pixels);
        let levels = max_level_diff(&got.pixels, &cpu.pixels);
        let taps: Vec<String> = errors::<F>(&got, &cpu)
            .into_iter()
            .map(|(name, e)| {
                if p == Precision::F32 && (e.is_nan() || e > 1e-5) {
                    failures.push(format!("{label} f32: {name} rel {e:.2e} > 1e-5"));
                }
                format!("{name} {e:.2e}")
            })
            .collect();
        println!(
            "{label} {p}: {}; 8-bit image: max diff {levels} levels, PSNR {db:.1} dB vs CPU f32",
            taps.join(", ")
        );
        match p {
            Precision::F32 if levels > 1 => {
                failures.push(format!("{label} f32: 8-bit image off by {levels} levels"))
            }
            Precision::Bf16 if bf16_psnr.is_some_and(|min| db < min) => failures.push(format!(
                "{label} bf16: PSNR {db:.1} dB against the f32 image"
            )),
            _ => {}
        }
    }
    failures
}

/// Every case of `tests/fixtures/{name}/bf16_floor.json` on the CPU and on CUDA in bf16 (the
/// CPU's f32 run stands for the float64 reference: they agree to ~1e-6); returns the taps over
/// [`FLOOR_FACTOR`] × their floor. `request` makes a case's request (its init latent is set here).
#[cfg(feature = "cuda")]
pub fn floor_failures<F: Family>(
    name: &str,
    family: &F,
    request: impl Fn(&FloorCase) -> tessera_models::text_to_image::Request,
) -> Vec<String> {
    let mut failures = Vec::new();
    for c in &floor_cases(name) {
        let req = tessera_models::text_to_image::Request {
            negative_prompt: c.negative_prompt.clone(),
            guidance: c.guidance,
            init_latent: Some(c.init_latent.clone()),
            ..request(c)
        };
        let cpu = family.run(tessera_backend::cpu::CpuBackend::new(), &req);
        let got = family.run(gpu(tessera_backend::Precision::Bf16), &req);
        let rows: Vec<String> = errors::<F>(&got, &cpu)
            .into_iter()
            .map(|(tap, e)| {
                let floor = c.floor[tap];
                if e.is_nan() || e > FLOOR_FACTOR * floor {
                    failures.push(format!(
                        "{} bf16: {tap} {e:.2e} > 1.5 × floor {floor:.2e}",
                        c.label
                    ));
                }
                format!("{tap} {e:.2e} (floor {floor:.2e}, {:.2}×)", e / floor)
            })
            .collect();
        println!("{} bf16: {}", c.label, rows.join(", "));
    }
    failures
}
