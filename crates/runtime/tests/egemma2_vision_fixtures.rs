//! EmbeddingGemma 2 image and mixed embeddings on the CPU against the PyTorch reference's golden
//! fixtures (`tools/fixtures/egemma2_vision.py`: float64 transformers 5.25.0, token ids from
//! `EmbeddingGemma2Processor`), f32 and bf16 weights.

mod common;

use common::{VisionCase, cpu_model, edited_mini, image, max_abs, vision_fixture};
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_models::blocks::rope::axial_inv_freq;
use tessera_models::egemma2::{Input, Part, TextOptions};
use tessera_models::imageproc::ImageBudget;
use tessera_runtime::embed::{Egemma2, Embed};

/// Max abs difference allowed on L2-normalised vectors: twice the worst measured (1.6e-6 on an
/// AVX-512 machine, 1.4e-6 on AVX2), the figure README.md states (the issue asked for 1e-5).
const TOL: f64 = 3.2e-6;

#[test]
fn every_case_matches_the_reference_alone_and_packed() {
    let fx = vision_fixture();
    assert!(fx.cases.len() >= 15, "{} cases", fx.cases.len());
    assert!(
        fx.cases
            .iter()
            .any(|c| c.parts.iter().filter(|p| p.contains_key("image")).count() == 2)
    );
    let budget = ImageBudget::new(fx.budget).unwrap();
    for (model_name, dir) in &fx.models {
        let mut model = cpu_model(dir);
        assert_eq!(
            model.default_image_budget(),
            Some(budget),
            "processor_config.json"
        );
        let mut worst = 0f64;
        // Alone: one input per call, with its own options.
        for c in &fx.cases {
            let inp = c.input();
            let ids = model.input_ids(&inp, &c.opts(), budget).unwrap();
            assert_eq!(
                ids, c.ids,
                "{model_name}/{}: token ids vs the processor",
                c.name
            );
            let got = model
                .embed_inputs(&[inp], &c.opts(), budget, c.dim, &mut |_| {})
                .unwrap();
            let d = max_abs(&got[0].vector, &c.expected[model_name]);
            worst = worst.max(d);
            assert!(d <= TOL, "{model_name}/{}: max abs diff {d:.3e}", c.name);
            assert_eq!(got[0].tokens, c.ids.len());
        }
        // Packed: every case without a prompt or dim in one call, several per pass.
        let plain: Vec<&VisionCase> = fx
            .cases
            .iter()
            .filter(|c| c.prompt_name.is_none() && c.dim.is_none())
            .collect();
        let inputs: Vec<Input> = plain.iter().map(|c| c.input()).collect();
        let mut passes = 0;
        model.budget.patches = 3000;
        let got = model
            .embed_inputs(&inputs, &TextOptions::default(), budget, None, &mut |_| {
                passes += 1
            })
            .unwrap();
        assert!(passes > 1 && passes < plain.len(), "{passes} passes");
        assert_eq!(got.len(), plain.len(), "{model_name} packed: embeddings");
        for (c, g) in plain.iter().zip(&got) {
            let d = max_abs(&g.vector, &c.expected[model_name]);
            worst = worst.max(d);
            assert!(
                d <= TOL,
                "{model_name}/{} packed: max abs diff {d:.3e}",
                c.name
            );
        }
        eprintln!(
            "{model_name}: worst max abs diff {worst:.2e} over {} cases",
            fx.cases.len()
        );
    }
}

#[test]
fn soft_tokens_of_the_tower_alone_match() {
    let fx = vision_fixture();
    let mut model = cpu_model(&fx.models["egemma2-mini"]);
    let budget = ImageBudget::new(fx.budget).unwrap();
    let got = model
        .soft_tokens(&[image("rgb_100x100.png")], budget)
        .unwrap();
    let want: Vec<f64> = fx.soft_tokens_rgb_100x100.concat();
    let d = max_abs(&got[0], &want);
    // Soft tokens are ~6 in magnitude before the text encoder normalises them.
    assert!(d <= 1e-4, "soft tokens: max abs diff {d:.3e}");
}

#[test]
fn vision_rope_frequencies_equal_the_reference_bit_for_bit() {
    let fx = vision_fixture();
    let got = axial_inv_freq(100.0, 4 * fx.vision_rope_inv_freq.len());
    assert_eq!(got, fx.vision_rope_inv_freq);
}

#[test]
fn text_only_inputs_embed_as_texts_do() {
    let fx = vision_fixture();
    let mut model = cpu_model(&fx.models["egemma2-mini"]);
    let opts = TextOptions {
        prompt_name: Some("query".into()),
        ..TextOptions::default()
    };
    let texts = ["which planet is red", "a b c"];
    let want = model
        .embed_texts(&texts, &opts, Some(16), &mut |_| {})
        .unwrap();
    let inputs: Vec<Input> = texts.iter().map(|t| Input::text(*t)).collect();
    let got = model
        .embed_inputs(&inputs, &opts, ImageBudget::DEFAULT, Some(16), &mut |_| {})
        .unwrap();
    assert_eq!((got.len(), want.len()), (texts.len(), texts.len()));
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.vector, w.vector);
        assert_eq!(g.tokens, w.tokens);
    }
}

#[test]
fn bad_image_inputs_are_refused_with_a_reason() {
    let fx = vision_fixture();
    let mut model = cpu_model(&fx.models["egemma2-mini"]);
    let b70 = ImageBudget::new(70).unwrap();
    let err = |model: &mut Egemma2<CpuBackend>, inputs: &[Input], b| {
        model
            .embed_inputs(inputs, &TextOptions::default(), b, None, &mut |_| {})
            .unwrap_err()
            .to_string()
    };
    // 300×20 at budget 70 becomes 96×6 patches: wider than the tiny tower's 32 positions.
    let e = err(&mut model, &[Input::image(image("wide_300x20.png"))], b70);
    assert!(e.contains("position_embedding_size"), "{e}");
    // The default budget 280 is too large for the tiny tower even for a square image.
    let e = err(
        &mut model,
        &[Input::image(image("rgb_100x100.png"))],
        ImageBudget::DEFAULT,
    );
    assert!(
        e.contains("image budget") || e.contains("position_embedding_size"),
        "{e}"
    );
    // A literal placeholder in a text part would desynchronise images and placeholders.
    let inp = Input {
        parts: vec![
            Part::Text("look: <|image|>".into()),
            Part::Image(image("exact_96x96.png")),
        ],
    };
    let e = err(&mut model, &[Input::text("fine"), inp], b70);
    assert!(e.contains("input 2") && e.contains("<|image|>"), "{e}");
    let e = err(&mut model, &[Input::default()], b70);
    assert!(e.contains("at least one"), "{e}");
    let empty = Input {
        parts: vec![
            Part::Text(String::new()),
            Part::Image(image("exact_96x96.png")),
        ],
    };
    assert!(err(&mut model, &[empty], b70).contains("empty text"));
    let long = TextOptions {
        max_tokens: Some(10),
        ..TextOptions::default()
    };
    let e = model
        .embed_inputs(
            &[Input::image(image("exact_96x96.png"))],
            &long,
            b70,
            None,
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("never truncated"), "{e}");
}

#[test]
fn a_model_without_a_vision_tower_says_so() {
    let dir = edited_mini("config.json", |cfg| {
        cfg["vision_config"] = serde_json::Value::Null
    });
    let mut model =
        Egemma2::load(CpuBackend::new(), ModelFiles::Dir(dir.path().to_path_buf())).unwrap();
    assert!(!model.supports_images());
    let e = model
        .embed_inputs(
            &[Input::image(image("exact_96x96.png"))],
            &TextOptions::default(),
            ImageBudget::DEFAULT,
            None,
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("no vision tower"), "{e}");
}
