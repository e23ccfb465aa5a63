//! Qwen-Image-2.1 on the CPU against the reference's golden fixtures
//! (`tools/fixtures/qwen_image.py`: float64 diffusers 0.42.1 / transformers 5.25 models built from
//! the saved bf16 weights of the bundled miniature).
//!
//! Errors are `rel = max |got − want| / max |want|` per tensor; the f32 CPU path is held to
//! 1e-5 of float64 on every tap.

mod common;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::{Backend, Role, View};
use tessera_models::qwen_image::config::TransformerConfig;
use tessera_models::qwen_image::layout::{Layout, Part};
use tessera_models::qwen_image::text::{TextEncoder, prompt_ids};
use tessera_models::qwen_image::transformer::QwenImageTransformer;
use tessera_models::qwen_image::{self, BUNDLED, QwenImage};
use tessera_models::qwen3::{BpeTokenizer, Qwen3Config};
use tessera_models::text_to_image::{Event, Request};

use common::{Expected, Worst, rel};

const BOUND: f64 = 1e-5;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[derive(Deserialize)]
struct Cases {
    text: Vec<TextCase>,
    dit: Vec<DitCase>,
    e2e: Vec<E2eCase>,
}

#[derive(Deserialize)]
struct E2eCase {
    name: String,
    prompt: String,
    negative_prompt: Option<String>,
    width: usize,
    height: usize,
    steps: usize,
    guidance: f32,
    sigmas: Vec<f64>,
}

#[derive(Deserialize)]
struct TextCase {
    name: String,
    prompt: String,
    ids: Vec<u32>,
    drop_idx: usize,
    rows: usize,
}

#[derive(Deserialize)]
struct DitCase {
    name: String,
    runs: Vec<serde_json::Value>,
    t: f32,
    t2: f32,
}

fn cases() -> Cases {
    let p = root().join("tests/fixtures/qwen_image/cases.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("cases.json parses")
}

fn expected() -> Expected {
    Expected::load_from(&root().join("tests/fixtures/qwen_image/expected.safetensors"))
}

fn transformer(be: &CpuBackend) -> QwenImageTransformer<CpuBackend> {
    let f = &BUNDLED.transformer;
    let cfg =
        TransformerConfig::parse(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    QwenImageTransformer::load(be, &cfg, &f.weights("diffusion_pytorch_model").unwrap()).unwrap()
}

fn buf(be: &CpuBackend, v: &[f32]) -> <CpuBackend as Backend>::Buf {
    let mut b = be.alloc(v.len().max(1), Role::Stream).unwrap();
    be.write_f32(&mut b, v).unwrap();
    b
}

/// The case's layout, and which encoder rows are text (condition slots are not).
fn layout_of(runs: &[serde_json::Value]) -> (Layout, Vec<bool>) {
    let mut parts = Vec::new();
    let mut is_text = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let r = r.as_array().unwrap();
        let n = |k: usize| r[k].as_u64().unwrap() as usize;
        match r[0].as_str().unwrap() {
            "text" => {
                parts.push(Part::Text(n(1)));
                is_text.extend(std::iter::repeat_n(true, n(1)));
            }
            _ => {
                parts.push(Part::Image { h: n(1), w: n(2) });
                if i + 1 < runs.len() {
                    is_text.extend(std::iter::repeat_n(false, n(1) * n(2) / 4));
                }
            }
        }
    }
    (Layout::new(parts).unwrap(), is_text)
}

#[test]
fn dit_prefill_step_and_full_forward_match_the_reference() {
    let be = CpuBackend::new();
    let tr = transformer(&be);
    let d = tr.config().dim();
    let ex = expected();
    let mut worst = Worst::default();
    for c in cases().dit {
        let p = format!("dit/{}/", c.name);
        let (layout, is_text) = layout_of(&c.runs);
        let enc = ex.f32(&format!("{p}encoder_rows"));
        let ctx = tr.config().context_in_dim;
        let text: Vec<f32> = enc
            .chunks_exact(ctx)
            .zip(&is_text)
            .filter(|(_, t)| **t)
            .flat_map(|(r, _)| r.iter().copied())
            .collect();
        let text_buf = buf(&be, &text);
        let text_v = View::new(&text_buf, layout.text_rows(), ctx);
        let latents = ex.f32(&format!("{p}latents"));
        let ci = tr.config().in_channels;
        let n = layout.target_rows();
        let (cond, target) = latents.split_at(latents.len() - n * ci);

        let full = tr
            .forward_full(&be, &layout, text_v, &latents, c.t)
            .unwrap();
        worst.check(
            "full_v",
            &c.name,
            rel(&full, ex.get(&format!("{p}full_v"))),
            BOUND,
        );
        let full2 = tr
            .forward_full(&be, &layout, text_v, &latents, c.t2)
            .unwrap();
        worst.check(
            "full_v2",
            &c.name,
            rel(&full2, ex.get(&format!("{p}full_v2"))),
            BOUND,
        );

        let prefix = tr.prefill(&be, &layout, text_v, cond).unwrap();
        let lp = layout.prefix_rows();
        for l in 0..tr.config().num_layers {
            let (k, v) = prefix.kv(l).unwrap();
            let k = be.read_f32(View::new(k, lp, d)).unwrap();
            let v = be.read_f32(View::new(v, lp, d)).unwrap();
            worst.check(
                "prefix k",
                &c.name,
                rel(&k, ex.get(&format!("{p}k{l}"))),
                BOUND,
            );
            worst.check(
                "prefix v",
                &c.name,
                rel(&v, ex.get(&format!("{p}v{l}"))),
                BOUND,
            );
        }
        let mut st = tr
            .prepare_steps(&be, &[&prefix], &[0], &[c.t2, c.t])
            .unwrap();
        let cached = tr.step(&be, &mut st, &[&prefix], &[target], 0).unwrap();
        worst.check(
            "cached_v",
            &c.name,
            rel(&cached[0], ex.get(&format!("{p}cached_v"))),
            BOUND,
        );
        // The cache and the uncached path agree with each other, too.
        let agree = cached[0]
            .iter()
            .zip(&full2)
            .map(|(a, b)| (a - b).abs() as f64)
            .fold(0.0, f64::max);
        worst.check("cached vs full", &c.name, agree, 1e-5);
        // Step 1 of the same preparation is at t.
        let at_t = tr.step(&be, &mut st, &[&prefix], &[target], 1).unwrap();
        worst.check(
            "cached_v@t",
            &c.name,
            rel(&at_t[0], ex.get(&format!("{p}full_v"))),
            BOUND,
        );
    }
    worst.report("dit");
}

/// A ComfyUI-GGUF transformer (tests/fixtures/transformer_gguf/qwen_image_q8_0.gguf, written by
/// tools/fixtures/transformer_gguf.py with llama.cpp's `gguf` package: Q8_0 matrices, F32 the
/// rest, under ComfyUI's prefix) loads through the pipeline's file loader and runs exactly: its
/// velocity equals, within 1e-5, the f32 run of a checkpoint of its dequantized values.
#[test]
fn a_q8_0_gguf_transformer_equals_the_f32_run_on_its_dequantized_weights() {
    let be = CpuBackend::new();
    let f = &BUNDLED.transformer;
    let cfg =
        TransformerConfig::parse(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    let path = root().join("tests/fixtures/transformer_gguf/qwen_image_q8_0.gguf");
    let g = tessera_core::gguf::Gguf::open(&path).unwrap();
    let q8 = g
        .tensors()
        .filter(|t| t.ggml_type == tessera_core::gguf::GgmlType::Q8_0)
        .count();
    assert!(q8 > 10, "{q8} Q8_0 tensors");
    // The dequantized checkpoint, diffusers names, written from the GGUF decoders' values.
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = g
        .tensors()
        .map(|t| {
            let bytes = t
                .to_f32()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            let name = t.name.strip_prefix("model.diffusion_model.").unwrap();
            (name.to_string(), t.shape(), bytes)
        })
        .collect();
    let views = tensors.iter().map(|(n, s, b)| {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
        (n.clone(), v.unwrap())
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dequantized.safetensors");
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let run = |w: &tessera_core::Weights| first_dit_case_velocity(&be, &cfg, w);
    let gguf = qwen_image::comfy_transformer_weights(&path).unwrap();
    let quantized = run(&gguf);
    let reference = run(&tessera_core::Weights::open_file(&file).unwrap());
    let reference: Vec<f64> = reference.iter().map(|&x| x as f64).collect();
    let err = rel(&quantized, &reference);
    assert!(
        err <= 1e-5,
        "Q8_0 GGUF vs f32 on its dequantized weights: {err:e}"
    );
    let bundled = run(&f.weights("diffusion_pytorch_model").unwrap());
    let bundled: Vec<f64> = bundled.iter().map(|&x| x as f64).collect();
    assert!(rel(&quantized, &bundled) > 1e-4, "Q8_0 changed nothing");
}

/// A ComfyUI scaled FP8 transformer (tests/fixtures/transformer_fp8/qwen_image_fp8_scaled.safetensors,
/// written by tools/fixtures/transformer_fp8.py with torch: every matrix `float8_e4m3fn` with a
/// per-tensor `scale_weight`, the rest bf16, under ComfyUI's prefix) loads through the
/// pipeline's file loader and runs exactly: its no-cache velocity equals, within 1e-5, the
/// float64 diffusers run on its dequantized weights (`codes · scale` in f32).
#[test]
fn a_scaled_fp8_transformer_equals_the_reference_on_its_dequantized_weights() {
    let be = CpuBackend::new();
    let f = &BUNDLED.transformer;
    let cfg =
        TransformerConfig::parse(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    let path = root().join("tests/fixtures/transformer_fp8/qwen_image_fp8_scaled.safetensors");
    let run = |w: &tessera_core::Weights| first_dit_case_velocity(&be, &cfg, w);
    let file = tessera_core::Weights::open_file(&path).unwrap();
    let scaled = file
        .names()
        .into_iter()
        .filter(|n| file.tensor(n).unwrap().scale.is_some())
        .count();
    assert!(scaled > 10, "only {scaled} scaled FP8 matrices");
    let got = run(&qwen_image::comfy_transformer_weights(&path).unwrap());
    let want =
        Expected::load_from(&root().join("tests/fixtures/transformer_fp8/expected.safetensors"));
    let err = rel(&got, want.get("qwen_image/full_v"));
    assert!(
        err <= 1e-5,
        "scaled FP8 vs float64 on its dequantized weights: {err:e}"
    );
    let bundled = run(&f.weights("diffusion_pytorch_model").unwrap());
    let bundled: Vec<f64> = bundled.iter().map(|&x| x as f64).collect();
    assert!(rel(&got, &bundled) > 1e-3, "FP8 changed nothing");
    eprintln!("scaled FP8 Qwen-Image vs float64 reference: {err:.2e}");
}

#[test]
fn a_batch_of_items_steps_like_each_alone() {
    // Two prompts of different lengths, three items (two over the first): the joint attention
    // buffer must keep each item to its own prefix.
    let be = CpuBackend::new();
    let tr = transformer(&be);
    let ctx = tr.config().context_in_dim;
    let ci = tr.config().in_channels;
    let feats = |rows: usize, seed: u32| -> Vec<f32> {
        (0..rows * ctx)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0)
                    - 0.5
            })
            .collect()
    };
    let (ta, tb) = (feats(5, 1), feats(9, 2));
    let (ba, bb) = (buf(&be, &ta), buf(&be, &tb));
    let la = Layout::text_to_image(5, (2, 4)).unwrap();
    let lb = Layout::text_to_image(9, (2, 4)).unwrap();
    let pa = tr.prefill(&be, &la, View::new(&ba, 5, ctx), &[]).unwrap();
    let pb = tr.prefill(&be, &lb, View::new(&bb, 9, ctx), &[]).unwrap();
    let lat: Vec<Vec<f32>> = (0..3)
        .map(|s| feats(8 * ci / ctx + 1, 10 + s)[..8 * ci].to_vec())
        .collect();
    let lats: Vec<&[f32]> = lat.iter().map(Vec::as_slice).collect();
    let mut st = tr
        .prepare_steps(&be, &[&pa, &pb], &[0, 1, 0], &[0.6])
        .unwrap();
    let together = tr.step(&be, &mut st, &[&pa, &pb], &lats, 0).unwrap();
    for (i, (p, l)) in [(&pa, 0usize), (&pb, 1), (&pa, 2)].into_iter().enumerate() {
        let mut one = tr.prepare_steps(&be, &[p], &[0], &[0.6]).unwrap();
        let alone = tr.step(&be, &mut one, &[p], &[lats[l]], 0).unwrap();
        assert_eq!(together[i], alone[0], "item {i}");
    }
}

#[test]
fn text_encoder_ids_and_features_match_the_reference() {
    let be = CpuBackend::new();
    let tok = BpeTokenizer::load(&BUNDLED.processor).unwrap();
    let f = &BUNDLED.text_encoder;
    let cfg =
        Qwen3Config::parse_vl(&f.path("config.json"), &f.read("config.json").unwrap()).unwrap();
    let mut te = TextEncoder::load(&be, &cfg, &f.weights("model").unwrap()).unwrap();
    let ex = expected();
    let mut worst = Worst::default();
    for c in cases().text {
        let ids = prompt_ids(&tok, &c.prompt).unwrap();
        assert_eq!(ids.ids, c.ids, "{}: token ids", c.name);
        assert_eq!((ids.drop, ids.rows()), (c.drop_idx, c.rows), "{}", c.name);
        let feats = te.features(&be, std::slice::from_ref(&ids)).unwrap();
        let want = ex.get(&format!("te/{}/features", c.name));
        worst.check("features", &c.name, rel(&feats[0], want), BOUND);
    }
    worst.report("text encoder");
}

#[test]
fn the_pipeline_reproduces_the_reference_steps_and_image() {
    let ex = expected();
    let mut worst = Worst::default();
    for c in cases().e2e {
        let p = format!("e2e/{}/", c.name);
        let mut m = QwenImage::load(CpuBackend::new(), &BUNDLED).unwrap();
        let req = Request {
            negative_prompt: c.negative_prompt.clone(),
            width: c.width,
            height: c.height,
            steps: c.steps,
            guidance: c.guidance,
            init_latent: Some(ex.f32(&format!("{p}latents"))),
            ..Request::new(c.prompt.clone(), qwen_image::DEFAULTS)
        };
        let plan = m.plan(&req).unwrap();
        // The reference's σ are f32 values written as decimals; serde_json's parse of the
        // decimal may be an ulp off in f64, never in f32.
        let want: Vec<f32> = c.sigmas.iter().map(|&s| s as f32).collect();
        assert_eq!(plan.schedule.sigmas, want, "{}: σ schedule", c.name);
        assert_eq!(plan.guided, c.negative_prompt.is_some() && c.guidance > 1.0);
        let mut last = Vec::new();
        let images = m
            .generate_images(&req, &plan, |e| {
                if let Event::Step { index, latents, .. } = e {
                    let want = ex.get(&format!("{p}latent{index}"));
                    worst.check("latent", &c.name, rel(&latents[0], want), BOUND);
                    last = latents[0].clone();
                }
            })
            .unwrap();
        // The decoded image in floats, as the pipeline's postprocess gives it: x/2 + 1/2.
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
        // 8-bit RGBA: equal, except where the float image (held to BOUND above) and the
        // reference's straddle a rounding boundary: then the level is one off, and it must be
        // the level of our own float value, which is within BOUND of the reference's.
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
            let scaled = want_f[i] * 255.0;
            let ours = as_unit[i] as f64 * 255.0;
            assert!(
                (g as f64 - w).abs() == 1.0
                    && g as f64 == ours.round()
                    && (ours - scaled).abs() <= BOUND * 255.0,
                "{}: value {i} is {g}, the reference {w} (ours {ours:.6} / 255, reference {scaled:.6} / 255)",
                c.name
            );
        }
    }
    worst.report("pipeline");
}

#[test]
fn bad_requests_are_refused_before_any_compute() {
    let m = QwenImage::load(CpuBackend::new(), &BUNDLED).unwrap();
    let req = |f: &dyn Fn(&mut Request)| {
        let mut r = Request {
            width: 64,
            height: 64,
            steps: 2,
            ..Request::new("a fox", qwen_image::DEFAULTS)
        };
        f(&mut r);
        r
    };
    let e = m.plan(&req(&|r| r.width = 48)).unwrap_err().to_string();
    assert!(e.contains("multiples of 32") && e.contains("64x64"), "{e}");
    let e = m.plan(&req(&|r| r.steps = 0)).unwrap_err().to_string();
    assert!(e.contains("step"), "{e}");
    let e = m
        .plan(&req(&|r| r.init_latent = Some(vec![0.0; 3])))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("initial latent") && e.contains("16 tokens × 8 channels"),
        "{e}"
    );
    // Guidance without a negative prompt: CFG is off, and the user is told.
    let plan = m.plan(&req(&|r| r.guidance = 4.0)).unwrap();
    assert!(!plan.guided);
    assert!(
        plan.warnings.iter().any(|w| w.contains("true CFG is off")),
        "{:?}",
        plan.warnings
    );
    // An empty negative prompt counts, and is encoded as " " as the reference encodes an empty
    // prompt (`prompt or " "`): the ids of the fixture's empty-prompt case, and those of " ".
    let negative = |n: &str| {
        m.plan(&req(&|r| {
            r.guidance = 4.0;
            r.negative_prompt = Some(n.to_string());
        }))
        .unwrap()
    };
    let plan = negative("");
    assert!(plan.guided && plan.prompts.len() == 2);
    let reference = cases()
        .text
        .into_iter()
        .find(|c| c.name == "empty")
        .expect("the fixture's empty-prompt case");
    assert_eq!(reference.prompt, "", "the fixture's empty-prompt case");
    assert_eq!(
        (&plan.prompts[1].ids, plan.prompts[1].drop),
        (&reference.ids, reference.drop_idx),
        "the empty negative prompt's ids"
    );
    assert_eq!(plan.prompts[1], negative(" ").prompts[1]);
    assert_ne!(
        plan.prompts[1], plan.prompts[0],
        "the negative prompt is the prompt"
    );
    let empty = m.plan(&req(&|r| r.prompt = String::new())).unwrap();
    let space = m.plan(&req(&|r| r.prompt = " ".into())).unwrap();
    assert_eq!(empty.prompts[0], space.prompts[0]);
}

/// The no-cache velocity of the first DiT fixture case (its text rows and latents) from a
/// transformer loaded from `w`: what the stored-format tests compare between weight files.
fn first_dit_case_velocity(
    be: &CpuBackend,
    cfg: &TransformerConfig,
    w: &tessera_core::Weights,
) -> Vec<f32> {
    let tr = QwenImageTransformer::load(be, cfg, w).unwrap();
    let c = &cases().dit[0];
    let ex = expected();
    let p = format!("dit/{}/", c.name);
    let (layout, is_text) = layout_of(&c.runs);
    let ctx = cfg.context_in_dim;
    let text: Vec<f32> = ex
        .f32(&format!("{p}encoder_rows"))
        .chunks_exact(ctx)
        .zip(&is_text)
        .filter(|(_, t)| **t)
        .flat_map(|(r, _)| r.iter().copied())
        .collect();
    let text_buf = buf(be, &text);
    let text_v = View::new(&text_buf, layout.text_rows(), ctx);
    let latents = ex.f32(&format!("{p}latents"));
    tr.forward_full(be, &layout, text_v, &latents, c.t).unwrap()
}
