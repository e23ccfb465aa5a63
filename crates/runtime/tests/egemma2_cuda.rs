//! EmbeddingGemma 2 on CUDA against the CPU reference and the PyTorch fixtures.
//!
//! Run on a GPU machine: `cargo test -p tessera-runtime --test egemma2_cuda -- --ignored`.
//! The full-size tests need `TESSERA_EG2_FULL` = a folder made by `tools/device/make_eg2_full.py`,
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

use common::floor::{self, Tally, assert_none, floor_from};
use common::{image, root};
use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda;
use tessera_backend::{Backend, Precision};
use tessera_core::Error;
use tessera_models::ModelFiles;
use tessera_models::egemma2::TextOptions;
use tessera_runtime::embed::{Egemma2, Embed};

fn cuda_model(dir: &Path, p: Precision) -> Egemma2<cuda::CudaBackend> {
    let be = cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    Egemma2::load(be, ModelFiles::Dir(dir.to_path_buf())).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn fixtures_match_the_reference_on_cuda() {
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        floor::text_fixtures(p, floor::GPU, |dir| cuda_model(dir, p), &mut failures);
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
    let floor = floor_from(&env_path("TESSERA_EG2_FLOOR"), "", floor::GPU);
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
    let mut failures = Vec::new();
    for p in [Precision::F32, Precision::Bf16] {
        floor::vision_fixtures(p, floor::GPU, |dir| cuda_model(dir, p), &mut failures);
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
