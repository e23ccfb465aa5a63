//! Qwen-Image-2.1's condition-image preparation against the reference's golden fixtures
//! (`tools/fixtures/qwen_image_condition.py`: diffusers 0.42.1's own `calculate_dimensions`,
//! `VaeImageProcessor.resize`/`preprocess` on Pillow 13.0.0, and `_get_qwen_prompt_embeds`'
//! composite over white). Every byte and every float must be identical.

use std::path::{Path, PathBuf};

mod common;

use common::Expected;
use serde::Deserialize;
use tessera_models::imageproc::pil::Rgba8;
use tessera_models::qwen_image::condition::{
    Condition, calculate_dimensions, condition_size, default_output_size,
};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_image/condition")
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
    requests: Vec<Request>,
    dimensions: Vec<Dimensions>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    image: String,
    output_resolution: usize,
    wh: [usize; 2],
    copied: bool,
    vertical_first: bool,
}

#[derive(Deserialize)]
struct Request {
    images: Vec<String>,
    output_resolution: usize,
    output_wh: [usize; 2],
}

#[derive(Deserialize)]
struct Dimensions {
    output_resolution: u64,
    image_wh: [usize; 2],
    wh: [usize; 2],
}

fn fixture() -> Fixture {
    let p = dir().join("cases.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap()
}

/// A test PNG as Pillow opens it (8-bit RGBA).
fn open(name: &str) -> Rgba8 {
    let img = image::open(dir().join(format!("{name}.png")))
        .unwrap()
        .into_rgba8();
    let (w, h) = img.dimensions();
    Rgba8::new(w as usize, h as usize, img.into_raw()).unwrap()
}

fn bytes(ex: &Expected, name: &str) -> Vec<u8> {
    ex.get(name).iter().map(|&v| v as u8).collect()
}

#[test]
fn condition_images_match_the_pipeline_byte_for_byte() {
    let fx = fixture();
    let ex = Expected::load_from(&dir().join("expected.safetensors"));
    // The fixture covers both of Pillow's pass orders, one axis alone, and the untouched copy.
    assert!(fx.cases.iter().any(|c| c.vertical_first));
    assert!(fx.cases.iter().any(|c| !c.vertical_first && !c.copied));
    assert!(fx.cases.iter().any(|c| c.copied));
    let mut vae_checked = 0;
    for c in &fx.cases {
        let src = open(&c.image);
        let cond = Condition::prepare(&src, c.output_resolution).unwrap();
        let [w, h] = c.wh;
        assert_eq!((cond.width(), cond.height()), (w, h), "{}", c.name);
        let resized = format!("{}/resized", c.name);
        assert_eq!(ex.shape(&resized), [h, w, 4]);
        let want = bytes(&ex, &resized);
        let diff = cond
            .rgba
            .data
            .iter()
            .zip(&want)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(diff, 0, "{}: {diff} resized bytes differ", c.name);
        assert_eq!(
            cond.rgb,
            bytes(&ex, &format!("{}/vl", c.name)),
            "{}",
            c.name
        );
        let vae = format!("{}/vae", c.name);
        if ex.tensors.contains_key(&vae) {
            // [4, h, w] in the reference; channels last here.
            let want = ex.get(&vae);
            let got = cond.vae_pixels();
            for (p, px) in got.chunks_exact(4).enumerate() {
                for (ch, &v) in px.iter().enumerate() {
                    assert_eq!(v as f64, want[ch * h * w + p], "{} pixel {p}", c.name);
                }
            }
            vae_checked += 1;
        }
    }
    assert_eq!(vae_checked, 2);
}

#[test]
fn the_output_size_is_the_last_condition_images() {
    let fx = fixture();
    assert!(!fx.requests.is_empty());
    for r in &fx.requests {
        let sizes: Vec<(usize, usize)> = r
            .images
            .iter()
            .map(|n| {
                let img = open(n);
                (img.width, img.height)
            })
            .collect();
        let (w, h) = default_output_size(&sizes, r.output_resolution).unwrap();
        assert_eq!([w, h], r.output_wh, "{:?}", r.images);
    }
}

#[test]
fn calculate_dimensions_rounds_like_python() {
    let fx = fixture();
    for d in &fx.dimensions {
        let [w, h] = d.image_wh;
        let res = d.output_resolution;
        assert_eq!(
            calculate_dimensions(res * res, w as f64 / h as f64),
            (d.wh[0], d.wh[1]),
            "{res}² at {w}:{h}"
        );
        assert_eq!(condition_size(w, h, res as usize), (d.wh[0], d.wh[1]));
    }
    // The fixture's ties: 80² and 112² at ratio 1 put width/32 on 2.5 and 3.5.
    assert_eq!(calculate_dimensions(80 * 80, 1.0), (64, 64));
    assert_eq!(calculate_dimensions(112 * 112, 1.0), (128, 128));
}
