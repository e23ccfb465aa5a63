//! Qwen-Image-2.1's condition images on the text encoder's side against the reference's golden
//! fixtures (`tools/fixtures/qwen_image_vision.py`: transformers 5.25.0's Qwen3-VL processor on
//! its torchvision backend, diffusers 0.42.1's `_get_qwen_prompt_embeds`, the bundled miniature).
//! Pixel rows and token ids must be identical; float64 taps are matched at `rel` 1e-5
//! (`max |got − want| / max |want|`).

mod common;

use std::path::{Path, PathBuf};

use common::{Expected, rel};
use serde::Deserialize;
use tessera_backend::Backend;
use tessera_backend::cpu::CpuBackend;
use tessera_models::imageproc::Image;
use tessera_models::imageproc::pil::Rgba8;
use tessera_models::qwen_image::BUNDLED;
use tessera_models::qwen_image::condition::Condition;
use tessera_models::qwen_image::text::TextEncoder;
use tessera_models::qwen_image::vision::{
    EditPrompt, ImageProcessorConfig, VisionConfig, VisionTower, edit_template, smart_resize,
};
use tessera_models::qwen3::{BpeTokenizer, Qwen3Config};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_image/vision")
}

#[derive(Deserialize)]
struct Fixture {
    smart_resize: Vec<SmartCase>,
    processor: Vec<ProcCase>,
    prompts: Vec<PromptCase>,
    tower: Vec<TowerCase>,
}

#[derive(Deserialize)]
struct TowerCase {
    name: String,
    images: Vec<String>,
    deepstack: usize,
}

const BOUND: f64 = 1e-5;

#[derive(Deserialize)]
struct SmartCase {
    hw: [usize; 2],
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
    out: Option<[usize; 2]>,
}

#[derive(Deserialize)]
struct ProcCase {
    name: String,
    wh: [usize; 2],
    resized_wh: [usize; 2],
    grid_thw: [usize; 3],
    resized: bool,
    /// For the pipeline's copies: the condition image and output resolution.
    condition: Option<Source>,
}

#[derive(Deserialize)]
struct Source {
    image: String,
    output_resolution: usize,
}

#[derive(Deserialize)]
struct PromptCase {
    name: String,
    prompt: String,
    images: Vec<String>,
    ids: Vec<u32>,
    positions: [Vec<u32>; 3],
    drop_idx: usize,
    rows: usize,
    template: String,
}

fn fixture() -> Fixture {
    let p = dir().join("cases.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap()
}

fn expected() -> Expected {
    Expected::load_from(&dir().join("expected.safetensors"))
}

/// A processor case's input image, as the pipeline hands it to the processor.
fn input(ex: &Expected, case: &str, [w, h]: [usize; 2]) -> Image {
    let name = format!("proc/{case}/rgb");
    assert_eq!(ex.shape(&name), [h, w, 3]);
    let rgb = ex.get(&name).iter().map(|&v| v as u8).collect();
    Image::from_rgb8(w, h, rgb).unwrap()
}

fn processor() -> ImageProcessorConfig {
    ImageProcessorConfig::load(&BUNDLED.processor).unwrap()
}

#[test]
fn smart_resize_matches_transformers() {
    let fx = fixture();
    assert!(fx.smart_resize.iter().any(|c| c.out.is_none()));
    for c in &fx.smart_resize {
        let [h, w] = c.hw;
        let got = smart_resize(h, w, c.factor, c.min_pixels, c.max_pixels);
        match c.out {
            Some([rh, rw]) => assert_eq!(got.unwrap(), (rh, rw), "{h}×{w}"),
            None => assert!(got.is_err(), "{h}×{w} should be refused"),
        }
    }
}

#[test]
fn pixel_rows_match_the_processor_exactly() {
    let fx = fixture();
    let ex = expected();
    let cfg = processor();
    let map = cfg.pixel_map();
    // Both paths: copies passed through, and images the processor resizes.
    assert!(fx.processor.iter().any(|c| c.resized) && fx.processor.iter().any(|c| !c.resized));
    for c in &fx.processor {
        let img = cfg.preprocess(&input(&ex, &c.name, c.wh)).unwrap();
        assert_eq!(img.grid_thw(), c.grid_thw, "{}", c.name);
        let [rw, rh] = c.resized_wh;
        assert_eq!(cfg.target_size(c.wh[0], c.wh[1]).unwrap(), (rw, rh));
        let name = format!("proc/{}/pixel_values", c.name);
        assert_eq!(
            ex.shape(&name),
            [img.patches(), cfg.row_width()],
            "{}",
            c.name
        );
        let want = ex.get(&name);
        let differ = img
            .bytes
            .iter()
            .zip(want)
            .filter(|&(&b, &w)| map[b as usize] as f64 != w)
            .count();
        assert_eq!(differ, 0, "{}: {differ} pixel values differ", c.name);
    }
}

#[test]
fn edit_prompt_ids_and_positions_match_the_pipeline() {
    let fx = fixture();
    let ex = expected();
    let cfg = processor();
    let tok = BpeTokenizer::load(&BUNDLED.processor).unwrap();
    assert!(fx.prompts.iter().any(|p| p.images.len() > 1));
    for p in &fx.prompts {
        let images: Vec<_> = p
            .images
            .iter()
            .map(|n| {
                let c = fx.processor.iter().find(|c| &c.name == n).unwrap();
                cfg.preprocess(&input(&ex, n, c.wh)).unwrap()
            })
            .collect();
        assert_eq!(edit_template(&p.prompt, images.len()), p.template);
        let prompt = EditPrompt::new(&tok, &p.prompt, &images, cfg.merge).unwrap();
        assert_eq!(prompt.ids.ids, p.ids, "{}", p.name);
        assert_eq!(prompt.ids.drop, p.drop_idx, "{}", p.name);
        assert_eq!(prompt.ids.rows(), p.rows, "{}", p.name);
        assert_eq!(prompt.positions(), p.positions, "{}", p.name);
        // The pipeline's mask of pad rows among the features.
        let mask: Vec<bool> = ex
            .get(&format!("te/{}/pad_mask", p.name))
            .iter()
            .map(|&v| v != 0.0)
            .collect();
        let mut ours = vec![false; prompt.ids.rows()];
        for s in &prompt.images {
            for m in &mut ours[s.start - prompt.ids.drop..][..s.tokens()] {
                *m = true;
            }
        }
        assert_eq!(ours, mask, "{}", p.name);
    }
}

#[test]
fn bad_edit_prompts_are_refused() {
    let cfg = processor();
    let tok = BpeTokenizer::load(&BUNDLED.processor).unwrap();
    let img = cfg
        .preprocess(&Image::from_rgb8(64, 64, vec![128; 64 * 64 * 3]).unwrap())
        .unwrap();
    let e = EditPrompt::new(&tok, "x <|image_pad|>", std::slice::from_ref(&img), 2).unwrap_err();
    assert!(e.to_string().contains("<|image_pad|>"), "{e}");
    let eleven = vec![img; 11];
    let e = EditPrompt::new(&tok, "x", &eleven, 2).unwrap_err();
    assert!(e.to_string().contains("11 condition images"), "{e}");
}

fn tower_config() -> VisionConfig {
    let f = &BUNDLED.text_encoder;
    VisionConfig::parse(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap()
}

#[test]
fn vision_tower_and_deepstack_features_match_the_reference() {
    let fx = fixture();
    let ex = expected();
    let cfg = processor();
    let be = CpuBackend::new();
    let vc = tower_config();
    let weights = BUNDLED.text_encoder.weights("model").unwrap();
    let mut tower = VisionTower::load(&be, &vc, &weights).unwrap();
    // One image alone, and two of different grids packed in one pass.
    assert!(fx.tower.iter().any(|t| t.images.len() > 1));
    let mut failures = Vec::new();
    for t in &fx.tower {
        let images: Vec<_> = t
            .images
            .iter()
            .map(|n| {
                let c = fx.processor.iter().find(|c| &c.name == n).unwrap();
                cfg.preprocess(&input(&ex, n, c.wh)).unwrap()
            })
            .collect();
        let n: usize = images.iter().map(|i| i.patches()).sum();
        let feats = tower.forward(&be, &images, &cfg.pixel_map()).unwrap();
        assert_eq!(feats.deepstack.len(), t.deepstack, "{}", t.name);
        let mut taps = vec![("merged".to_string(), be.read_f32(feats.merged).unwrap())];
        for (i, d) in feats.deepstack.iter().enumerate() {
            taps.push((format!("deepstack{i}"), be.read_f32(*d).unwrap()));
        }
        taps.push((
            "last".into(),
            be.read_f32(tower.last_hidden(n).unwrap()).unwrap(),
        ));
        for (tap, got) in taps {
            let name = format!("tower/{}/{tap}", t.name);
            let e = rel(&got, ex.get(&name));
            eprintln!("{name}: rel {e:.2e}");
            if e > BOUND {
                failures.push(format!("{name}: rel {e:.2e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn the_tower_declares_every_op_it_calls() {
    let be = CpuBackend::recording();
    let vc = tower_config();
    let weights = BUNDLED.text_encoder.weights("model").unwrap();
    let mut tower = VisionTower::load(&be, &vc, &weights).unwrap();
    let cfg = processor();
    let img = cfg
        .preprocess(&Image::from_rgb8(64, 96, vec![200; 64 * 96 * 3]).unwrap())
        .unwrap();
    tower.forward(&be, &[img], &cfg.pixel_map()).unwrap();
    let declared = tessera_models::qwen_image::vision::ops(&vc);
    let recorded = be.recorded();
    assert!(!recorded.is_empty());
    let missing: Vec<String> = recorded
        .iter()
        .filter(|op| !declared.contains(op))
        .map(|op| format!("{op}"))
        .collect();
    assert!(missing.is_empty(), "undeclared: {missing:?}");
    let unused: Vec<String> = declared
        .iter()
        .filter(|op| !recorded.contains(op))
        .map(|op| format!("{op}"))
        .collect();
    assert!(unused.is_empty(), "declared but never called: {unused:?}");
}

#[test]
fn images_the_tower_cannot_take_are_refused_before_compute() {
    let be = CpuBackend::new();
    let vc = tower_config();
    let weights = BUNDLED.text_encoder.weights("model").unwrap();
    let mut tower = VisionTower::load(&be, &vc, &weights).unwrap();
    let map = processor().pixel_map();
    // A grid that is not whole merge blocks, and rows of the wrong width.
    let odd = tessera_models::qwen_image::vision::VisionImage {
        grid_h: 3,
        grid_w: 2,
        bytes: vec![0; 6 * vc.row_width()],
    };
    let e = tower.forward(&be, &[odd], &map).err().unwrap().to_string();
    assert!(e.contains("3 patch grid") || e.contains("2×3"), "{e}");
    let short = tessera_models::qwen_image::vision::VisionImage {
        grid_h: 2,
        grid_w: 2,
        bytes: vec![0; 10],
    };
    assert!(tower.forward(&be, &[short], &map).is_err());
    assert!(tower.forward(&be, &[], &map).is_err());
}

#[test]
fn text_features_with_images_match_the_reference() {
    let fx = fixture();
    let ex = expected();
    let cfg = processor();
    let be = CpuBackend::new();
    let tok = BpeTokenizer::load(&BUNDLED.processor).unwrap();
    let f = &BUNDLED.text_encoder;
    let weights = f.weights("model").unwrap();
    let te_cfg =
        Qwen3Config::parse_vl(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    let mut te = TextEncoder::load(&be, &te_cfg, &weights).unwrap();
    let mut tower = VisionTower::load(&be, &tower_config(), &weights).unwrap();
    let mut failures = Vec::new();
    for p in &fx.prompts {
        let images: Vec<_> = p
            .images
            .iter()
            .map(|n| {
                let c = fx.processor.iter().find(|c| &c.name == n).unwrap();
                cfg.preprocess(&input(&ex, n, c.wh)).unwrap()
            })
            .collect();
        let prompt = EditPrompt::new(&tok, &p.prompt, &images, cfg.merge).unwrap();
        let feats = tower.forward(&be, &images, &cfg.pixel_map()).unwrap();
        let got = te.features_with_images(&be, &prompt, &feats).unwrap();
        let name = format!("te/{}/features", p.name);
        assert_eq!(ex.shape(&name), [p.rows, te_cfg.hidden_size], "{name}");
        let e = rel(&got, ex.get(&name));
        eprintln!("{name}: rel {e:.2e}");
        if e > BOUND {
            failures.push(format!("{name}: rel {e:.2e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn features_of_other_images_than_the_prompts_are_refused() {
    let ex = expected();
    let fx = fixture();
    let cfg = processor();
    let be = CpuBackend::new();
    let tok = BpeTokenizer::load(&BUNDLED.processor).unwrap();
    let f = &BUNDLED.text_encoder;
    let weights = f.weights("model").unwrap();
    let te_cfg =
        Qwen3Config::parse_vl(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    let mut te = TextEncoder::load(&be, &te_cfg, &weights).unwrap();
    let mut tower = VisionTower::load(&be, &tower_config(), &weights).unwrap();
    let image = |n: &str| {
        let c = fx.processor.iter().find(|c| c.name == n).unwrap();
        cfg.preprocess(&input(&ex, n, c.wh)).unwrap()
    };
    // The prompt has room for a 10×4 grid's 10 tokens; the tower is given a 6×4 grid (6 tokens).
    let prompt = EditPrompt::new(&tok, "x", &[image("tall@96")], cfg.merge).unwrap();
    let feats = tower
        .forward(&be, &[image("tall@48")], &cfg.pixel_map())
        .unwrap();
    let e = te
        .features_with_images(&be, &prompt, &feats)
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not fit the prompt"), "{e}");
}

#[test]
fn from_the_uploaded_png_to_the_processors_rows() {
    // The condition step (its own fixture) feeds the processor the very bytes the pipeline does.
    let fx = fixture();
    let ex = expected();
    let cfg = processor();
    let map = cfg.pixel_map();
    let dir = dir().join("../condition");
    let mut checked = 0;
    for c in &fx.processor {
        let Some(src) = &c.condition else { continue };
        let png = image::open(dir.join(format!("{}.png", src.image)))
            .unwrap()
            .into_rgba8();
        let (w, h) = png.dimensions();
        let rgba = Rgba8::new(w as usize, h as usize, png.into_raw()).unwrap();
        let cond = Condition::prepare(&rgba, src.output_resolution).unwrap();
        let vl = cond.vl_image().unwrap();
        assert_eq!(vl, input(&ex, &c.name, c.wh), "{}", c.name);
        let img = cfg.preprocess(&vl).unwrap();
        let want = ex.get(&format!("proc/{}/pixel_values", c.name));
        assert!(
            img.bytes
                .iter()
                .zip(want)
                .all(|(&b, &w)| map[b as usize] as f64 == w),
            "{}",
            c.name
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}
