//! Qwen-Image-2.1 editing end to end on the CPU against the reference's golden fixtures
//! (`tools/fixtures/qwen_image_edit.py`: float64 diffusers 0.42.1 `QwenImage21Pipeline` with
//! condition images, on the bundled miniature, from the uploaded PNGs of
//! `tools/fixtures/qwen_image_condition.py`).
//!
//! Errors are `rel = max |got − want| / max |want|` per tensor, held to 1e-5 on every tap; the
//! 8-bit image is equal but where the float image straddles a rounding boundary (one level).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_models::imageproc::pil::Rgba8;
use tessera_models::qwen_image::{self, BUNDLED, QwenImage};
use tessera_models::text_to_image::{Edit, Event, Request};

use common::{Expected, Worst, rel};

const BOUND: f64 = 1e-5;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_image")
}

#[derive(Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    images: Vec<String>,
    prompt: String,
    negative_prompt: Option<String>,
    guidance: f32,
    output_resolution: usize,
    steps: usize,
    width: usize,
    height: usize,
    sigmas: Vec<f64>,
}

fn cases() -> Vec<Case> {
    let p = dir().join("edit/cases.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str::<Cases>(&s).unwrap().cases
}

/// A test PNG as an upload decodes.
fn png(name: &str) -> Rgba8 {
    let img = image::open(dir().join(format!("condition/{name}.png")))
        .unwrap()
        .into_rgba8();
    let (w, h) = img.dimensions();
    Rgba8::new(w as usize, h as usize, img.into_raw()).unwrap()
}

fn edit(names: &[String], output_resolution: usize) -> Edit {
    Edit {
        images: names.iter().map(|n| png(n)).collect::<Vec<_>>().into(),
        output_resolution,
    }
}

#[test]
fn edits_reproduce_the_reference_steps_and_image() {
    let ex = Expected::load_from(&dir().join("edit/expected.safetensors"));
    let mut worst = Worst::default();
    let mut m = QwenImage::load(CpuBackend::new(), &BUNDLED).unwrap();
    m.can_edit().unwrap();
    let all = cases();
    assert!(all.iter().any(|c| c.images.len() > 1 && c.guidance > 1.0));
    for c in all {
        let p = format!("{}/", c.name);
        let e = edit(&c.images, c.output_resolution);
        // Without a size the output is the last condition image's, as the reference chose.
        assert_eq!(m.edit_size(&e).unwrap(), (c.width, c.height), "{}", c.name);
        let req = Request {
            negative_prompt: c.negative_prompt.clone(),
            width: c.width,
            height: c.height,
            steps: c.steps,
            guidance: c.guidance,
            init_latent: Some(ex.f32(&format!("{p}latents"))),
            edit: Some(e),
            ..Request::new(c.prompt.clone(), qwen_image::DEFAULTS)
        };
        let plan = m.plan(&req).unwrap();
        let want: Vec<f32> = c.sigmas.iter().map(|&s| s as f32).collect();
        assert_eq!(plan.schedule.sigmas, want, "{}: σ schedule", c.name);
        assert_eq!(plan.guided, c.negative_prompt.is_some() && c.guidance > 1.0);
        let mut last = Vec::new();
        let mut steps = 0;
        let images = m
            .generate_images(&req, &plan, |e| {
                if let Event::Step { index, latents, .. } = e {
                    let want = ex.get(&format!("{p}latent{index}"));
                    worst.check("latent", &c.name, rel(&latents[0], want), BOUND);
                    last = latents[0].clone();
                    steps += 1;
                }
            })
            .unwrap();
        assert_eq!(steps, c.steps);
        let image = m
            .vae()
            .unwrap()
            .decode(m.backend(), &last, plan.latent_hw, None)
            .unwrap();
        let as_unit: Vec<f32> = image
            .iter()
            .map(|&x| (x * 0.5 + 0.5).clamp(0.0, 1.0))
            .collect();
        let want_f = ex.get(&format!("{p}image_f"));
        worst.check("image", &c.name, rel(&as_unit, want_f), BOUND);
        let want = ex.get(&format!("{p}image"));
        let img = &images[0];
        assert_eq!(
            (img.width, img.height, img.channels),
            (c.width, c.height, 4)
        );
        for (i, (&g, &w)) in img.pixels.iter().zip(want).enumerate() {
            if g as f64 == w {
                continue;
            }
            // One level off, and only where the reference's value is within BOUND of the
            // rounding boundary between the two levels.
            let boundary = g.min(w as u8) as f64 + 0.5;
            let theirs = want_f[i] * 255.0;
            assert!(
                (g as f64 - w).abs() == 1.0 && (theirs - boundary).abs() <= BOUND * 255.0,
                "{}: value {i} is {g}, the reference {w} (reference {theirs:.6} / 255)",
                c.name
            );
        }
    }
    worst.report("edit pipeline");
}

#[test]
fn bad_edits_are_refused_before_any_compute() {
    let m = QwenImage::load(CpuBackend::new(), &BUNDLED).unwrap();
    let one = edit(&["tall_37x100".to_string()], 96);
    let req = |e: Edit| Request {
        width: 64,
        height: 64,
        steps: 2,
        edit: Some(e),
        ..Request::new("a fox", qwen_image::DEFAULTS)
    };
    // Eleven images.
    let eleven = Edit {
        images: Arc::from(vec![png("square_64x64"); 11]),
        output_resolution: 64,
    };
    let e = m.plan(&req(eleven)).unwrap_err().to_string();
    assert!(
        e.contains("11 condition images") && e.contains("1 to 10"),
        "{e}"
    );
    // A copy under the text encoder's pixel range (64² for the miniature): 32×32.
    let small = Edit {
        output_resolution: 32,
        ..edit(&["square_64x64".to_string()], 32)
    };
    let e = m.plan(&req(small)).unwrap_err().to_string();
    assert!(
        e.contains("condition image 1") && e.contains("32×32") && e.contains("4096"),
        "{e}"
    );
    // An aspect ratio too extreme for a 32-pixel side.
    let thin = Edit {
        images: Arc::from(vec![Rgba8::new(400, 1, vec![255; 1600]).unwrap()]),
        output_resolution: 64,
    };
    let e = m.plan(&req(thin)).unwrap_err().to_string();
    assert!(
        e.contains("condition image 1") && e.contains("aspect"),
        "{e}"
    );
    // The output resolution out of range.
    let e = m
        .plan(&req(Edit {
            output_resolution: 0,
            ..one.clone()
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("output resolution 0"), "{e}");
    // A good one plans, with the condition rows in its prefix.
    let plan = m.plan(&req(one)).unwrap();
    let edit = plan.edit.as_ref().unwrap();
    assert_eq!(edit.conditions.len(), 1);
    // 64×160 at resolution 96: a 4×10 latent block among the text rows.
    assert_eq!(plan.prefix_rows()[0], plan.prompts[0].rows() - 10 + 40);
}

/// An edit reports its stages before the loop, in order and once per prompt branch under true
/// CFG (text to image reports its own: no VAE encoder, no vision tower; both encode every
/// branch before the first prefill, so the text encoder is done before the transformer is
/// needed), and a `Break` at a stage cancels the request there.
#[test]
fn stages_are_reported_in_order_and_a_break_at_one_cancels() {
    use std::ops::ControlFlow;
    use tessera_core::Error;
    use tessera_models::text_to_image::Stage;

    let mut m = QwenImage::load(CpuBackend::new(), &BUNDLED).unwrap();
    let e = edit(&["square_64x64".to_string()], 64);
    let (width, height) = m.edit_size(&e).unwrap();
    let edit_req = Request {
        negative_prompt: Some(String::new()),
        width,
        height,
        steps: 2,
        guidance: 4.0,
        edit: Some(e),
        ..Request::new("make it blue", qwen_image::DEFAULTS)
    };
    let text_req = Request {
        edit: None,
        ..edit_req.clone()
    };
    let mut seen = |req: &Request| {
        let plan = m.plan(req).unwrap();
        let mut marks = Vec::new();
        m.generate_images(req, &plan, |e| match e {
            Event::Stage(s) => marks.push(s.name()),
            Event::Encoded => marks.push("encoded"),
            _ => {}
        })
        .unwrap();
        marks
    };
    assert_eq!(
        seen(&edit_req),
        [
            "plan",
            "vae_encode",
            "vision",
            "text_encoder",
            "text_encoder",
            "prefill",
            "prefill",
            "encoded"
        ]
    );
    assert_eq!(
        seen(&text_req),
        ["plan", "text_encoder", "prefill", "prefill", "encoded"]
    );

    let plan = m.plan(&edit_req).unwrap();
    let mut steps = 0;
    let err = m
        .generate_images_until(&edit_req, &plan, |e| match e {
            Event::Stage(Stage::Vision) => ControlFlow::Break(()),
            Event::Step { .. } => {
                steps += 1;
                ControlFlow::Continue(())
            }
            _ => ControlFlow::Continue(()),
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::Cancelled(at) if at.contains("vision")),
        "{err}"
    );
    assert_eq!(steps, 0);
}
