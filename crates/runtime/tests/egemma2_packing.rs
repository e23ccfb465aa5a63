//! Many inputs through the runtime's packing: chunks of prepared inputs, several passes per
//! chunk and passes that straddle chunks, all in order and each as it embeds alone.

use tessera_backend::cpu::CpuBackend;
use tessera_models::egemma2::{BUNDLED, Input, Part, TextOptions};
use tessera_models::imageproc::{Image, ImageBudget};
use tessera_runtime::embed::{Egemma2, Embed, Embedding};

/// Inputs prepared in parallel at a time by the runtime (`PREPARE_CHUNK` in `embed.rs`).
const CHUNK: usize = 64;

#[test]
fn inputs_over_several_chunks_embed_in_order_as_they_do_alone() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/egemma2/images");
    let image = |name: &str| Image::open(&dir.join(name)).unwrap();
    let distinct = [
        Input::text("which planet is red"),
        Input::image(image("exact_96x96.png")),
        Input {
            parts: vec![
                Part::Text("look: ".into()),
                Part::Image(image("rgb_100x100.png")),
            ],
        },
        Input::text("the quick brown fox jumps over the lazy dog"),
    ];
    let mut model = Egemma2::load(CpuBackend::new(), BUNDLED).unwrap();
    let (opts, budget) = (TextOptions::default(), ImageBudget::new(70).unwrap());
    let alone: Vec<Embedding> = distinct
        .iter()
        .map(|inp| {
            let mut e = model
                .embed_inputs(std::slice::from_ref(inp), &opts, budget, None, &mut |_| {})
                .unwrap();
            e.remove(0)
        })
        .collect();
    let n = 2 * CHUNK + 5;
    let mut inputs: Vec<Input> = (0..n).map(|i| distinct[i % 4].clone()).collect();
    // Several passes per chunk, and passes that straddle chunks.
    model.budget.tokens = 300;
    let mut done = 0;
    let got = model
        .embed_inputs(&inputs, &opts, budget, None, &mut |k| done += k)
        .unwrap();
    assert_eq!((got.len(), done), (n, n));
    for (i, g) in got.iter().enumerate() {
        let want = &alone[i % 4];
        assert_eq!(g.tokens, want.tokens, "input {i}");
        let d = g
            .vector
            .iter()
            .zip(&want.vector)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-5, "input {i}: max abs diff {d:.3e}");
    }

    // An input of a later chunk that cannot be prepared is named.
    inputs[CHUNK + 3] = Input::default();
    let e = model
        .embed_inputs(&inputs, &opts, budget, None, &mut |_| {})
        .unwrap_err()
        .to_string();
    let want = format!("input {}: an input needs at least one", CHUNK + 4);
    assert!(e.starts_with(&want), "{e}");
}
