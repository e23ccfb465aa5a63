//! Each family's declared op list (what a device is asked about before the model loads) covers
//! every op its forward really calls: the bundled models run on a CPU backend that records each
//! op, text, image and mixed passes for EmbeddingGemma 2 and a guided generation for Z-Image.

use tessera_backend::Op;
use tessera_backend::cpu::CpuBackend;
use tessera_models::egemma2::{self, EmbeddingGemma2, Input, Part, TextOptions};
use tessera_models::imageproc::{Image, ImageBudget};
use tessera_models::zimage::{self, BUNDLED, Request, ZImage, ZImageConfigs};

fn assert_declared(family: &str, declared: &[Op], recorded: &[Op]) {
    let missing: Vec<String> = recorded
        .iter()
        .filter(|op| !declared.contains(op))
        .map(|op| format!("{op} ({op:?})"))
        .collect();
    assert!(
        missing.is_empty(),
        "{family} calls ops its op list does not declare:\n{}",
        missing.join("\n")
    );
    assert!(!recorded.is_empty(), "{family}: nothing was recorded");
}

#[test]
fn egemma2_declares_every_op_of_text_image_and_mixed_passes() {
    let be = CpuBackend::recording();
    let mut model = EmbeddingGemma2::load(be.clone(), egemma2::BUNDLED).unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/egemma2/images/rgb_100x100.png");
    let image = Image::open(&dir).unwrap();
    let inputs = [
        Input::text("which planet is red"),
        Input::image(image.clone()),
        Input {
            parts: vec![Part::Text("look: ".into()), Part::Image(image)],
        },
    ];
    let (opts, budget) = (TextOptions::default(), ImageBudget::new(70).unwrap());
    let (preparer, mut passes) = model.split();
    let prepared: Vec<_> = inputs
        .iter()
        .map(|i| preparer.prepare(i, &opts, budget).unwrap())
        .collect();
    for p in prepared.chunks(1).chain([&prepared[..]]) {
        passes.run(p).unwrap();
    }
    assert_declared(
        "EmbeddingGemma 2",
        &egemma2::ops(model.config()),
        &be.recorded(),
    );
}

#[test]
fn zimage_declares_every_op_of_a_guided_generation() {
    let be = CpuBackend::recording();
    let mut model = ZImage::load(be.clone(), &BUNDLED, None).unwrap();
    let req = Request {
        width: 64,
        height: 64,
        steps: 2,
        guidance: 2.0,
        ..Request::new("a red fox")
    };
    let plan = model.plan(&req).unwrap();
    model.generate(&req, &plan, |_| {}).unwrap();
    let cfg = ZImageConfigs::read(&BUNDLED).unwrap();
    assert_declared("Z-Image", &zimage::ops(&cfg), &be.recorded());
}
