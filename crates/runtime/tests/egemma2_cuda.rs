//! EmbeddingGemma 2 on CUDA against the CPU reference and the PyTorch fixtures.
//!
//! Run on a GPU machine: `cargo test -p tessera-runtime --test egemma2_cuda -- --ignored`.
//! The full-size tests need `TESSERA_EG2_FULL` = a folder made by `make_eg2_full.py` (model),
//! `TESSERA_EG2_INPUTS` = its `bench_inputs.json` and `TESSERA_EG2_FLOOR` = the bf16 floor of that
//! model over those inputs (`tools/device/eg2_bf16_floor.py full … OUT_JSON`); without them they
//! fail rather than skip.
//!
//! Bounds on L2-normalised embeddings: f32 — max abs ≤ 1e-4, cosine ≥ 0.999999. bf16 — within
//! 1.5× of the bf16 storage floor of the same inputs (the float64 reference keeping only a bf16
//! engine's storage roundings, the "ideal bf16" variant of `eg2_bf16_floor.py`), in max abs and in
//! 1 − cosine: no bf16 engine can do better than that floor on a given model, so a fixed bound
//! would judge the model's conditioning rather than the engine.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};

use common::{image, root, text_fixture, vision_fixture};
use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda;
use tessera_backend::{Backend, Precision};
use tessera_core::Error;
use tessera_models::ModelFiles;
use tessera_models::egemma2::TextOptions;
use tessera_runtime::embed::{Egemma2, Embed};

/// The worst max abs and cosine of the float64 reference with only bf16 storage roundings, over a
/// set of inputs.
#[derive(Clone, Copy, Debug, Deserialize)]
struct Floor {
    max_abs: f64,
    cosine: f64,
}

/// A bf16 result may be this many times further from the reference than the storage floor.
const FLOOR_FACTOR: f64 = 1.5;

/// (largest max abs, smallest cosine) allowed at `p`.
fn bounds(p: Precision, floor: Floor) -> (f64, f64) {
    match p {
        Precision::Bf16 => (
            FLOOR_FACTOR * floor.max_abs,
            1.0 - FLOOR_FACTOR * (1.0 - floor.cosine),
        ),
        Precision::F32 => (1e-4, 0.999_999),
    }
}

#[derive(Deserialize)]
struct FloorRow {
    model: String,
    variant: String,
    #[serde(flatten)]
    floor: Floor,
}

/// The "ideal bf16" floor of `eg2_bf16_floor.py`'s JSON `path`, of the row whose model label
/// starts with `label` (every row when `label` is empty: a full-size run has one).
fn floor_from(path: &Path, label: &str) -> Floor {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (made by tools/device/eg2_bf16_floor.py)",
            path.display()
        )
    });
    let rows: Vec<FloorRow> = serde_json::from_str(&text).unwrap();
    let mut found = rows
        .iter()
        .filter(|r| r.variant == "ideal bf16" && r.model.starts_with(label));
    match (found.next(), found.next()) {
        (Some(r), None) => r.floor,
        _ => panic!(
            "{}: not exactly one \"ideal bf16\" row for {label:?}",
            path.display()
        ),
    }
}

/// The committed floor of a fixture set (`tools/device/eg2_bf16_floor.py fixtures`).
fn fixture_floor(model: &str, set: &str) -> Floor {
    let path = root().join("tests/fixtures/egemma2/bf16_floor.json");
    floor_from(&path, &format!("{model} {set} fixtures"))
}

fn cuda_model(dir: &Path, p: Precision) -> Egemma2<cuda::CudaBackend> {
    let be = cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    Egemma2::load(be, ModelFiles::Dir(dir.to_path_buf())).unwrap()
}

/// (max abs diff, cosine) of two vectors.
fn diff(a: &[f32], b: &[f64]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut m, mut dot, mut na, mut nb) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let x = x as f64;
        m = m.max((x - y).abs());
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    (m, dot / (na.sqrt() * nb.sqrt()).max(1e-30))
}

/// The worst error seen over a set of comparisons, and every comparison that broke the bound.
/// Tests compare everything before failing, so a GPU run shows the whole picture at once.
struct Tally {
    precision: Precision,
    floor: Floor,
    worst: (f64, f64),
    failures: Vec<String>,
}

impl Tally {
    /// Comparisons at `precision`; bf16 ones judged by the storage floor of the same inputs.
    fn new(precision: Precision, floor: Floor) -> Self {
        Self {
            precision,
            floor,
            worst: (0.0, 1.0),
            failures: Vec::new(),
        }
    }

    fn check(&mut self, what: &str, got: &[f32], want: &[f64]) {
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
    fn report(self, label: &str, all: &mut Vec<String>) {
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
fn assert_none(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} comparisons over the bound:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn fixtures_match_the_reference_on_cuda() {
    let fx = text_fixture();
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        for (name, dir) in &fx.models {
            let mut model = cuda_model(&root().join(dir), p);
            let mut tally = Tally::new(p, fixture_floor(name, "text"));
            for c in &fx.cases {
                let got = model
                    .embed_texts(&c.texts(), &c.opts(), c.dim, &mut |_| {})
                    .unwrap();
                for (i, (g, w)) in got.iter().zip(&c.expected[name]).enumerate() {
                    tally.check(&format!("{name}/{} text {i}", c.name), &g.vector, w);
                }
            }
            let label = format!("fixtures {name} on {}", model.model.backend().describe());
            tally.report(&label, &mut failures);
        }
    }
    assert_none(&failures);
}

#[derive(Deserialize)]
struct BenchInputs {
    short: String,
    long: String,
    batch64: Vec<String>,
}

fn env_path(var: &str) -> PathBuf {
    PathBuf::from(
        std::env::var_os(var).unwrap_or_else(|| panic!("set {var} (see the file's doc comment)")),
    )
}

#[test]
#[ignore = "needs a CUDA device and a full-size model"]
fn full_size_model_matches_the_cpu() {
    let dir = env_path("TESSERA_EG2_FULL");
    let inputs: BenchInputs =
        serde_json::from_str(&std::fs::read_to_string(env_path("TESSERA_EG2_INPUTS")).unwrap())
            .unwrap();
    let opts = TextOptions::default();
    let mut groups: Vec<(&str, Vec<&str>)> = vec![
        ("query", vec![&inputs.short]),
        ("document", vec![&inputs.long]),
    ];
    groups.push((
        "batch64 packed",
        inputs.batch64.iter().map(String::as_str).collect(),
    ));
    let mut cpu = Egemma2::load(CpuBackend::new(), ModelFiles::Dir(dir.clone())).unwrap();
    let want: Vec<Vec<Vec<f64>>> = groups
        .iter()
        .map(|(_, texts)| {
            cpu.embed_texts(texts, &opts, None, &mut |_| {})
                .unwrap()
                .into_iter()
                .map(|e| e.vector.iter().map(|&v| v as f64).collect())
                .collect()
        })
        .collect();
    let floor = floor_from(&env_path("TESSERA_EG2_FLOOR"), "");
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        let mut model = cuda_model(&dir, p);
        let mut tally = Tally::new(p, floor);
        for ((name, texts), want) in groups.iter().zip(&want) {
            // Twice: the second run of a shape replays a captured graph.
            for round in 0..3 {
                let got = model.embed_texts(texts, &opts, None, &mut |_| {}).unwrap();
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let what = format!("full-size {name} text {i} round {round}");
                    tally.check(&what, &g.vector, w);
                }
            }
        }
        let label = format!("full-size model on {}", model.model.backend().describe());
        tally.report(&label, &mut failures);
    }
    assert_none(&failures);
}

#[test]
#[ignore = "needs a CUDA device"]
fn too_long_input_is_refused_as_on_the_cpu() {
    let dir = root().join("crates/models/assets/egemma2-mini");
    let ids = vec![vec![5u32; 600]]; // the mini model has 512 positions
    let mut cpu = Egemma2::load(CpuBackend::new(), ModelFiles::Dir(dir.clone())).unwrap();
    let want = cpu.embed_ids(&ids, &mut |_| {}).unwrap_err().to_string();
    let got = cuda_model(&dir, Precision::Bf16)
        .embed_ids(&ids, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert_eq!(got, want);
    assert!(got.contains("600 tokens") && got.contains("512"), "{got}");
}

#[test]
#[ignore = "needs a CUDA device and a full-size model"]
fn a_batch_too_large_for_the_device_is_split() {
    let dir = env_path("TESSERA_EG2_FULL");
    let mut model = cuda_model(&dir, Precision::Bf16);
    let (free, total) = model.model.backend().memory().unwrap();
    // Activations take ~34 KB per token: ask for a pass well beyond the free memory.
    let docs = (free / 34_000 / 256) * 5 / 4 + 1;
    eprintln!(
        "{docs} documents of 256 tokens; {:.1} of {:.1} GB free",
        free as f64 / 1e9,
        total as f64 / 1e9
    );
    let seqs: Vec<Vec<u32>> = (0..docs)
        .map(|i| {
            (0..256)
                .map(|j| 3 + ((i * 7919 + j * 104_729) % 200_000) as u32)
                .collect()
        })
        .collect();
    model.budget.tokens = docs * 256;
    let mut passes = 0;
    let out = model.embed_ids(&seqs, &mut |_| passes += 1).unwrap();
    assert_eq!(out.len(), docs);
    assert!(passes > 1, "the oversized pass was not split");
    assert!(out.iter().all(|v| v.iter().all(|x| x.is_finite())));
    // A single input that cannot fit is a clear error, not a crash.
    let huge = vec![vec![5u32; free / 34_000 * 2]];
    match model.embed_ids(&huge, &mut |_| {}) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("does not fit"), "{m}"),
        Err(Error::Input(m)) => assert!(m.contains("exceeds"), "{m}"), // beyond max positions first
        other => panic!(
            "expected an out-of-memory error, got {:?}",
            other.map(|v| v.len())
        ),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn vision_fixtures_match_the_reference_on_cuda() {
    use tessera_models::egemma2::Input;
    use tessera_models::imageproc::ImageBudget;
    let fx = vision_fixture();
    let budget = ImageBudget::new(fx.budget).unwrap();
    let inputs: Vec<Input> = fx.cases.iter().map(|c| c.input()).collect();
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        for (name, dir) in &fx.models {
            let mut model = cuda_model(&root().join(dir), p);
            let floor = fixture_floor(name, "vision");
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
            // The cases without a prompt or a Matryoshka size, packed into one call, embed as
            // they do alone.
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
            tally.report(&label, &mut failures);
            packing.report(&format!("{label}, packed vs alone"), &mut failures);
        }
    }
    assert_none(&failures);
}

/// Passes are captured as CUDA graphs the second time a shape comes and replayed after. A replay
/// gives the direct run's result bit for bit: for text passes, also after a larger batch grew the
/// workspace (a graph captured before would read freed buffers), and for merged text + image
/// passes, whose soft tokens are copied into the workspace so that their graph can be replayed.
#[test]
#[ignore = "needs a CUDA device"]
fn replayed_passes_match_direct_ones() {
    use tessera_models::egemma2::{Input, Part};
    use tessera_models::imageproc::ImageBudget;
    let dir = root().join("crates/models/assets/egemma2-mini");
    let merged = [Input {
        parts: vec![
            Part::Text("a photo of".into()),
            Part::Image(image("photo_120x160.jpg")),
        ],
    }];
    for p in [Precision::F32, Precision::Bf16] {
        let mut model = cuda_model(&dir, p);
        let query = vec![(2..19u32).collect::<Vec<_>>()]; // 17 tokens
        let direct = model.embed_ids(&query, &mut |_| {}).unwrap();
        let captured = model.embed_ids(&query, &mut |_| {}).unwrap();
        model
            .embed_ids(&vec![vec![7u32; 300]; 4], &mut |_| {})
            .unwrap();
        let after_growth = model.embed_ids(&query, &mut |_| {}).unwrap();
        let replayed = model.embed_ids(&query, &mut |_| {}).unwrap();
        for (what, got) in [
            ("captured", &captured),
            ("after the workspace grew", &after_growth),
            ("replayed", &replayed),
        ] {
            assert_eq!(got, &direct, "{p}: text pass {what}");
        }
        let opts = TextOptions::default();
        // The fixtures' budget: the mini tower has 32 positions per side.
        let budget = ImageBudget::new(70).unwrap();
        let run = |m: &mut Egemma2<cuda::CudaBackend>| {
            m.embed_inputs(&merged, &opts, budget, None, &mut |_| {})
                .unwrap()[0]
                .vector
                .clone()
        };
        let direct = run(&mut model);
        for what in ["captured", "replayed", "replayed again"] {
            assert_eq!(run(&mut model), direct, "{p}: merged pass {what}");
        }
    }
}
