//! EmbeddingGemma 2 at bf16 judged by its storage floor: the float64 reference keeping only a
//! bf16 engine's storage roundings (`tools/device/eg2_bf16_floor.py`). A bf16 result may be
//! [`FLOOR_FACTOR`] times further from the reference than that floor, in max abs and in
//! 1 − cosine; f32 results are held to max abs ≤ [`F32_MAX_ABS`] and cosine ≥ 0.999999. Also the
//! fixture runs the CPU and CUDA tests share.

use std::path::Path;

use serde::Deserialize;
use tessera_backend::{Backend, Precision};
use tessera_models::egemma2::{Input, TextOptions};
use tessera_models::imageproc::ImageBudget;
use tessera_runtime::embed::{Egemma2, Embed};

use super::{root, text_fixture, vision_fixture};

/// The GPU's bf16 storage points: weights, GEMM inputs and outputs, q/k/v and P in bf16.
pub const GPU: &str = "ideal bf16";
/// The CPU's: weights, GEMM inputs, q/k/v and P in bf16; GEMM outputs stay f32.
pub const CPU: &str = "bf16 in, f32 out";

/// The worst max abs and cosine of the float64 reference with only bf16 storage roundings, over a
/// set of inputs.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct Floor {
    pub max_abs: f64,
    pub cosine: f64,
}

/// The largest max abs difference of an f32 result: twice the worst measured on an H200 (text
/// fixtures 4.0e-7, vision fixtures 1.6e-6, the full-size model against the CPU 1.09e-6;
/// BENCHMARKS.md), the figure README.md states.
pub const F32_MAX_ABS: f64 = 3.2e-6;

/// A bf16 result may be this many times further from the reference than the storage floor.
pub const FLOOR_FACTOR: f64 = 1.5;

/// (largest max abs, smallest cosine) allowed at `p`.
pub fn bounds(p: Precision, floor: Floor) -> (f64, f64) {
    match p {
        Precision::Bf16 => (
            FLOOR_FACTOR * floor.max_abs,
            1.0 - FLOOR_FACTOR * (1.0 - floor.cosine),
        ),
        Precision::F32 => (F32_MAX_ABS, 0.999_999),
    }
}

#[derive(Deserialize)]
struct FloorRow {
    model: String,
    variant: String,
    #[serde(flatten)]
    floor: Floor,
}

/// The floor of `eg2_bf16_floor.py`'s JSON `path` for `variant` (the GPU's storage points are
/// [`GPU`], the CPU's [`CPU`]), of the row whose model label starts with `label` (every row when
/// `label` is empty: a full-size run has one).
pub fn floor_from(path: &Path, label: &str, variant: &str) -> Floor {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (made by tools/device/eg2_bf16_floor.py)",
            path.display()
        )
    });
    let rows: Vec<FloorRow> = serde_json::from_str(&text).unwrap();
    let mut found = rows
        .iter()
        .filter(|r| r.variant == variant && r.model.starts_with(label));
    match (found.next(), found.next()) {
        (Some(r), None) => r.floor,
        _ => panic!(
            "{}: not exactly one {variant:?} row for {label:?}",
            path.display()
        ),
    }
}

/// The committed floor of a fixture set (`tools/device/eg2_bf16_floor.py fixtures`).
pub fn fixture_floor(model: &str, set: &str, variant: &str) -> Floor {
    let path = root().join("tests/fixtures/egemma2/bf16_floor.json");
    floor_from(&path, &format!("{model} {set} fixtures"), variant)
}

/// (max abs diff, cosine) of two vectors.
pub fn diff(a: &[f32], b: &[f64]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut m, mut dot, mut na, mut nb) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let x = x as f64;
        // A non-finite value is an infinite difference (`f64::max` would drop a NaN).
        m = m.max(if x.is_finite() {
            (x - y).abs()
        } else {
            f64::INFINITY
        });
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    (m, dot / (na.sqrt() * nb.sqrt()).max(1e-30))
}

/// The worst error seen over a set of comparisons, and every comparison that broke the bound.
/// Tests compare everything before failing, so a GPU run shows the whole picture at once.
pub struct Tally {
    precision: Precision,
    floor: Floor,
    worst: (f64, f64),
    failures: Vec<String>,
}

impl Tally {
    /// Comparisons at `precision`; bf16 ones judged by the storage floor of the same inputs.
    pub fn new(precision: Precision, floor: Floor) -> Self {
        Self {
            precision,
            floor,
            worst: (0.0, 1.0),
            failures: Vec::new(),
        }
    }

    pub fn check(&mut self, what: &str, got: &[f32], want: &[f64]) {
        let (m, cos) = diff(got, want);
        self.worst.0 = self.worst.0.max(m);
        self.worst.1 = self.worst.1.min(cos);
        let (max_abs, min_cos) = bounds(self.precision, self.floor);
        if !(m <= max_abs && cos >= min_cos) {
            self.failures.push(format!(
                "{what} ({}): max abs {m:.3e} (≤ {max_abs:.2e}), cosine {cos:.7} (≥ {min_cos:.7})",
                self.precision
            ));
        }
    }

    /// Prints the worst error under `label` (with the bf16 floor and the ratio to it) and folds
    /// the failures into `all`.
    pub fn report(self, label: &str, all: &mut Vec<String>) {
        let against_floor = match self.precision {
            Precision::Bf16 => format!(
                "; bf16 floor {:.2e} / {:.8}: ×{:.2} in max abs, ×{:.2} in 1 − cosine",
                self.floor.max_abs,
                self.floor.cosine,
                self.worst.0 / self.floor.max_abs.max(1e-30),
                (1.0 - self.worst.1) / (1.0 - self.floor.cosine).max(1e-30)
            ),
            Precision::F32 => String::new(),
        };
        eprintln!(
            "{label}: worst max abs {:.2e}, worst cosine {:.8}{against_floor}, {} over the bound",
            self.worst.0,
            self.worst.1,
            self.failures.len()
        );
        all.extend(self.failures);
    }
}

/// Fails the test with every comparison that broke its bound.
pub fn assert_none(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} comparisons over the bound:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every text fixture through `load(model folder)` at `p`, bf16 judged by the `variant` floor;
/// the failures are added to `failures`.
pub fn text_fixtures<B: Backend>(
    p: Precision,
    variant: &str,
    load: impl Fn(&Path) -> Egemma2<B>,
    failures: &mut Vec<String>,
) {
    let fx = text_fixture();
    for (name, dir) in &fx.models {
        let mut model = load(&root().join(dir));
        let mut tally = Tally::new(p, fixture_floor(name, "text", variant));
        for c in &fx.cases {
            let got = model
                .embed_texts(&c.texts(), &c.opts(), c.dim, &mut |_| {})
                .unwrap();
            let want = &c.expected[name];
            assert_eq!(got.len(), want.len(), "{name}/{}: embeddings", c.name);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                tally.check(&format!("{name}/{} text {i}", c.name), &g.vector, w);
            }
        }
        let label = format!("fixtures {name} on {}", model.model.backend().describe());
        tally.report(&label, failures);
    }
}

/// Every vision fixture through `load(model folder)` at `p`, alone and (those without a prompt or
/// a Matryoshka size) packed into one call, which must embed as they do alone.
pub fn vision_fixtures<B: Backend>(
    p: Precision,
    variant: &str,
    load: impl Fn(&Path) -> Egemma2<B>,
    failures: &mut Vec<String>,
) {
    let fx = vision_fixture();
    let budget = ImageBudget::new(fx.budget).unwrap();
    let inputs: Vec<Input> = fx.cases.iter().map(|c| c.input()).collect();
    for (name, dir) in &fx.models {
        let mut model = load(&root().join(dir));
        let floor = fixture_floor(name, "vision", variant);
        let mut tally = Tally::new(p, floor);
        let mut packing = Tally::new(p, floor);
        let mut alone = Vec::new();
        for (c, input) in fx.cases.iter().zip(&inputs) {
            let opts = c.opts();
            let got = model
                .embed_inputs(
                    std::slice::from_ref(input),
                    &opts,
                    budget,
                    c.dim,
                    &mut |_| {},
                )
                .unwrap();
            tally.check(
                &format!("{name}/{}", c.name),
                &got[0].vector,
                &c.expected[name],
            );
            alone.push(got[0].vector.clone());
        }
        let plain: Vec<usize> = (0..inputs.len())
            .filter(|&i| fx.cases[i].prompt_name.is_none() && fx.cases[i].dim.is_none())
            .collect();
        assert!(plain.len() >= 5, "too few plain cases to test packing");
        let batch: Vec<Input> = plain.iter().map(|&i| inputs[i].clone()).collect();
        let packed = model
            .embed_inputs(&batch, &TextOptions::default(), budget, None, &mut |_| {})
            .unwrap();
        for (&i, v) in plain.iter().zip(&packed) {
            let want: Vec<f64> = alone[i].iter().map(|&x| x as f64).collect();
            let what = format!("{name}/{} packed", fx.cases[i].name);
            packing.check(&what, &v.vector, &want);
        }
        let label = format!(
            "vision fixtures {name} on {}",
            model.model.backend().describe()
        );
        tally.report(&label, failures);
        packing.report(&format!("{label}, packed vs alone"), failures);
    }
}
