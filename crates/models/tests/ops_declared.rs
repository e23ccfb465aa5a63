//! Each family's declared op list (what a device is asked about before the model loads) covers
//! every op its forward really calls: the bundled models run on a CPU backend that records each
//! op, text, image and mixed passes for EmbeddingGemma 2 and a guided generation for Z-Image.

use tessera_backend::Op;
use tessera_backend::cpu::CpuBackend;
use tessera_models::egemma2::{self, EmbeddingGemma2, Input, Part, TextOptions};
use tessera_models::imageproc::{Image, ImageBudget};
use tessera_models::text_to_image::Request;
use tessera_models::zimage::{self, BUNDLED, ZImage, ZImageConfigs};

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
        ..Request::new("a red fox", zimage::DEFAULTS)
    };
    let plan = model.plan(&req).unwrap();
    model.generate(&req, &plan, |_| {}).unwrap();
    let cfg = ZImageConfigs::read(&BUNDLED).unwrap();
    assert_declared("Z-Image", &zimage::ops(&cfg), &be.recorded());
}

#[test]
fn lfm2vl_declares_every_op_of_prefill_with_images_and_decoding() {
    use tessera_models::chat_template::{Message, Part as ChatPart};
    use tessera_models::lfm2vl::{self, CacheShape, Lfm2Vl, Lfm2VlConfig, Prompter, Turn};
    let be = CpuBackend::recording();
    let files = lfm2vl::BUNDLED;
    let cfg = Lfm2VlConfig::read(&files).unwrap();
    let prompter = Prompter::load(&files, &cfg).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/lfm2vl/images/tiled400x368.png");
    let msgs = [Message::parts(
        "user",
        vec![
            ChatPart::Image,
            ChatPart::Text {
                text: "What is this?".into(),
            },
        ],
    )];
    let prompt = prompter
        .build(&msgs, &[Image::open(&path).unwrap()], true)
        .unwrap();
    let tiles = prompt.tiles(0);
    let mut m = Lfm2Vl::load(&be, &files, &cfg, CacheShape { slots: 2, ctx: 512 }).unwrap();
    // A fresh prefill, then a decode step beside a second prefill (the cached path).
    m.extend(
        &be,
        &[Turn {
            seq: 1,
            tokens: &prompt.ids,
            tiles: &tiles,
        }],
        false,
    )
    .unwrap();
    m.extend(
        &be,
        &[
            Turn {
                seq: 1,
                tokens: &[9],
                tiles: &[],
            },
            Turn {
                seq: 2,
                tokens: &[1, 6, 9],
                tiles: &[],
            },
        ],
        false,
    )
    .unwrap();
    assert_declared("LFM2-VL", &lfm2vl::ops(&cfg), &be.recorded());
}

#[test]
fn qwen_image_declares_every_op_of_a_guided_generation() {
    use tessera_models::qwen_image::{self, QwenImage, QwenImageConfigs};
    let be = CpuBackend::recording();
    let mut model = QwenImage::load(be.clone(), &qwen_image::BUNDLED).unwrap();
    let req = Request {
        width: 64,
        height: 32,
        steps: 2,
        guidance: 3.0,
        negative_prompt: Some(String::new()),
        num_images: 2,
        ..Request::new("a red fox", qwen_image::DEFAULTS)
    };
    let plan = model.plan(&req).unwrap();
    model.generate_images(&req, &plan, |_| {}).unwrap();
    let cfg = QwenImageConfigs::read(&qwen_image::BUNDLED).unwrap();
    assert_declared("Qwen-Image-2.1", &qwen_image::ops(&cfg), &be.recorded());
}

#[test]
fn qwen_image_declares_every_op_of_a_guided_edit() {
    use tessera_models::imageproc::pil::Rgba8;
    use tessera_models::qwen_image::{self, QwenImage, QwenImageConfigs, edit};
    use tessera_models::text_to_image::Edit;
    let be = CpuBackend::recording();
    let mut model = QwenImage::load(be.clone(), &qwen_image::BUNDLED).unwrap();
    let px = |w: usize, h: usize| Rgba8::new(w, h, vec![200; w * h * 4]).unwrap();
    let req = Request {
        width: 64,
        height: 64,
        steps: 2,
        guidance: 3.0,
        negative_prompt: Some(String::new()),
        edit: Some(Edit {
            images: vec![px(64, 64), px(96, 64)].into(),
            output_resolution: 64,
        }),
        ..Request::new("a red fox", qwen_image::DEFAULTS)
    };
    let plan = model.plan(&req).unwrap();
    model.generate_images(&req, &plan, |_| {}).unwrap();
    let cfg = QwenImageConfigs::read(&qwen_image::BUNDLED).unwrap();
    let vision = edit::vision_config(&qwen_image::BUNDLED).unwrap();
    let mut declared = qwen_image::ops(&cfg);
    declared.extend(edit::ops(&cfg, &vision));
    assert_declared("Qwen-Image-2.1 editing", &declared, &be.recorded());
}
