//! EmbeddingGemma 2 on the CPU against the PyTorch reference's golden fixtures
//! (`tools/fixtures/egemma2.py`: float64 transformers 5.25.0), f32 and bf16 weights.

mod common;

use common::{cpu_model, edited_mini, max_abs, text_fixture};
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_models::blocks::rope::inv_freq;
use tessera_models::egemma2::TextOptions;
use tessera_runtime::embed::{Egemma2, Embed};

/// Max abs difference allowed on L2-normalised vectors: twice the worst measured (5.4e-7 on an
/// AVX-512 machine, 4.8e-7 on AVX2), the figure README.md states (the issue asked for 1e-5).
const TOL: f64 = 1.1e-6;

#[test]
fn every_case_matches_the_reference_on_f32_and_bf16_weights() {
    let fx = text_fixture();
    assert!(fx.cases.len() >= 15, "fixture has {} cases", fx.cases.len());
    for (model_name, dir) in &fx.models {
        let mut model = cpu_model(dir);
        let mut worst = 0f64;
        for c in &fx.cases {
            let texts = c.texts();
            let o = c.opts();
            assert_eq!(texts.len(), c.ids.len(), "{model_name}/{}: texts", c.name);
            for (t, want_ids) in texts.iter().zip(&c.ids) {
                assert_eq!(
                    &model.tokenize(t, &o).unwrap(),
                    want_ids,
                    "{model_name}/{}: token ids",
                    c.name
                );
            }
            let got = model.embed_texts(&texts, &o, c.dim, &mut |_| {}).unwrap();
            let want = &c.expected[model_name];
            assert_eq!(got.len(), want.len(), "{model_name}/{}: embeddings", c.name);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
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
    let fx = text_fixture();
    let c = fx
        .cases
        .iter()
        .find(|c| c.name == "packed_mixed_lengths")
        .expect("packed case");
    let mut model = cpu_model(&fx.models["egemma2-mini"]);
    let packed = model.embed_ids(&c.ids, &mut |_| {}).unwrap();
    let mut passes = 0;
    model.budget.tokens = 1; // one sequence per pass
    let alone = model.embed_ids(&c.ids, &mut |_| passes += 1).unwrap();
    assert_eq!(passes, c.ids.len());
    assert_eq!(packed.len(), c.ids.len(), "packed embeddings");
    assert_eq!(alone.len(), c.ids.len(), "embeddings alone");
    for (p, a) in packed.iter().zip(&alone) {
        assert_eq!(p.len(), a.len(), "embedding widths");
        // A non-finite value is an infinite difference (`f32::max` would drop a NaN).
        let d = p
            .iter()
            .zip(a)
            .map(|(x, y)| {
                if x.is_finite() && y.is_finite() {
                    (x - y).abs()
                } else {
                    f32::INFINITY
                }
            })
            .fold(0f32, f32::max);
        assert!(d <= 1e-6, "packed vs alone: {d:e}");
    }
}

#[test]
fn rope_frequencies_equal_the_reference_bit_for_bit() {
    let fx = text_fixture();
    let want_sliding = &fx.rope_inv_freq["sliding_attention"];
    let want_full = &fx.rope_inv_freq["full_attention"];
    assert_eq!(&inv_freq(10_000.0, 2 * want_sliding.len()), want_sliding);
    assert_eq!(&inv_freq(1_000_000.0, 2 * want_full.len()), want_full);
}

#[test]
fn bundled_model_is_the_fixture_model() {
    let fx = text_fixture();
    let c = fx.cases.iter().find(|c| c.name == "sentence").unwrap();
    let mut model = Egemma2::load(CpuBackend::new(), tessera_models::egemma2::BUNDLED).unwrap();
    let got = model
        .embed_texts(&c.texts(), &TextOptions::default(), None, &mut |_| {})
        .unwrap();
    assert!(max_abs(&got[0].vector, &c.expected["egemma2-mini"][0]) <= TOL);
}

#[test]
fn bos_eos_are_added_once_whatever_the_post_processor() {
    // The fixture tokenizer has no post-processor (like Gemma 4's); add one that inserts
    // <bos>/<eos> and check the ids do not change.
    let dir = edited_mini("tokenizer.json", |tok| {
        tok["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}, "<eos>": {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}}
        });
    });
    let with_pp =
        Egemma2::load(CpuBackend::new(), ModelFiles::Dir(dir.path().to_path_buf())).unwrap();
    let fx = text_fixture();
    for c in fx.cases.iter().take(5) {
        assert_eq!(
            with_pp.tokenize(&c.texts[0], &c.opts()).unwrap(),
            c.ids[0],
            "{}",
            c.name
        );
    }
}
