//! EmbeddingGemma 2 on the CPU against the PyTorch reference's golden fixtures
//! (`tools/fixtures/egemma2.py`: float64 transformers 5.25.0), f32 and bf16 weights.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_models::blocks::rope::inv_freq;
use tessera_models::egemma2::TextOptions;
use tessera_runtime::embed::{Egemma2, Embed};

/// Max abs difference allowed on L2-normalised vectors (issue: 1e-5).
const TOL: f64 = 1e-5;

#[derive(Deserialize)]
struct Fixture {
    models: std::collections::BTreeMap<String, String>,
    rope_inv_freq: std::collections::BTreeMap<String, Vec<f32>>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    texts: Vec<String>,
    prompt_name: Option<String>,
    prompt: Option<String>,
    dim: Option<usize>,
    max_tokens: Option<usize>,
    ids: Vec<Vec<u32>>,
    expected: std::collections::BTreeMap<String, Vec<Vec<f64>>>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> Fixture {
    let path = root().join("tests/fixtures/egemma2/cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("cases.json parses")
}

fn max_abs(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "embedding width");
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max)
}

fn load(dir: &str) -> Egemma2<CpuBackend> {
    Egemma2::load(CpuBackend::new(), ModelFiles::Dir(root().join(dir))).expect("model loads")
}

fn opts(c: &Case) -> TextOptions {
    TextOptions {
        prompt_name: c.prompt_name.clone(),
        prompt: c.prompt.clone(),
        max_tokens: c.max_tokens,
    }
}

#[test]
fn every_case_matches_the_reference_on_f32_and_bf16_weights() {
    let fx = fixture();
    assert!(fx.cases.len() >= 15, "fixture has {} cases", fx.cases.len());
    for (model_name, dir) in &fx.models {
        let mut model = load(dir);
        let mut worst = 0f64;
        for c in &fx.cases {
            let texts: Vec<&str> = c.texts.iter().map(String::as_str).collect();
            let o = opts(c);
            for (t, want_ids) in texts.iter().zip(&c.ids) {
                assert_eq!(
                    &model.tokenize(t, &o).unwrap(),
                    want_ids,
                    "{model_name}/{}: token ids",
                    c.name
                );
            }
            let got = model.embed_texts(&texts, &o, c.dim, &mut |_| {}).unwrap();
            for (i, (g, w)) in got.iter().zip(&c.expected[model_name]).enumerate() {
                let d = max_abs(&g.vector, w);
                worst = worst.max(d);
                assert!(
                    d <= TOL,
                    "{model_name}/{} text {i}: max abs diff {d:.3e} > {TOL:.0e}",
                    c.name
                );
                assert_eq!(g.tokens, c.ids[i].len());
            }
        }
        eprintln!(
            "{model_name}: worst max abs diff {worst:.2e} over {} cases",
            fx.cases.len()
        );
    }
}

#[test]
fn packed_members_embed_as_they_do_alone() {
    let fx = fixture();
    let c = fx
        .cases
        .iter()
        .find(|c| c.name == "packed_mixed_lengths")
        .expect("packed case");
    let mut model = load(&fx.models["egemma2-mini"]);
    let packed = model.embed_ids(&c.ids, &mut |_| {}).unwrap();
    let mut passes = 0;
    model.budget.tokens = 1; // one sequence per pass
    let alone = model.embed_ids(&c.ids, &mut |_| passes += 1).unwrap();
    assert_eq!(passes, c.ids.len());
    for (p, a) in packed.iter().zip(&alone) {
        let d = p
            .iter()
            .zip(a)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-6, "packed vs alone: {d:e}");
    }
}

#[test]
fn rope_frequencies_equal_the_reference_bit_for_bit() {
    let fx = fixture();
    let want_sliding = &fx.rope_inv_freq["sliding_attention"];
    let want_full = &fx.rope_inv_freq["full_attention"];
    assert_eq!(&inv_freq(10_000.0, 2 * want_sliding.len()), want_sliding);
    assert_eq!(&inv_freq(1_000_000.0, 2 * want_full.len()), want_full);
}

#[test]
fn bundled_model_is_the_fixture_model() {
    let fx = fixture();
    let c = fx.cases.iter().find(|c| c.name == "sentence").unwrap();
    let mut model = Egemma2::load(CpuBackend::new(), tessera_models::egemma2::BUNDLED).unwrap();
    let texts: Vec<&str> = c.texts.iter().map(String::as_str).collect();
    let got = model
        .embed_texts(&texts, &TextOptions::default(), None, &mut |_| {})
        .unwrap();
    assert!(max_abs(&got[0].vector, &c.expected["egemma2-mini"][0]) <= TOL);
}

#[test]
fn bos_eos_are_added_once_whatever_the_post_processor() {
    // The fixture tokenizer has no post-processor (like Gemma 4's); add one that inserts
    // <bos>/<eos> and check the ids do not change.
    let dir = tempfile::tempdir().unwrap();
    let src = root().join("crates/models/assets/egemma2-mini");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let tok_path = dir.path().join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    tok["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}, "<eos>": {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}}
    });
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    let with_pp =
        Egemma2::load(CpuBackend::new(), ModelFiles::Dir(dir.path().to_path_buf())).unwrap();
    let fx = fixture();
    for c in fx.cases.iter().take(5) {
        assert_eq!(
            with_pp.tokenize(&c.texts[0], &opts(c)).unwrap(),
            c.ids[0],
            "{}",
            c.name
        );
    }
}
