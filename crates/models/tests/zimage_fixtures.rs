//! Z-Image on the CPU against the reference's golden fixtures (`tools/fixtures/zimage.py`:
//! float64 diffusers 0.42.1 / transformers 5.25 models built from the saved bf16 weights).
//!
//! Errors are reported as `rel = max |got − want| / max |want|` per tensor. Bounds: timestep
//! embedding, modulations, caption/image sequences ≤ 1e-6; RoPE tables max-abs ≤ 2e-6; final
//! scale and every block output up to the last layer ≤ 1e-5; final layer and v ≤ 2e-6 (measured
//! ≤ 9.6e-7); text encoder layers ≤ 1e-6 (measured ≤ 4.0e-7). The VAE and the per-step pipeline
//! bounds are stated at their tests. Each tightened bound is about twice the worst measured (on
//! AVX2 and AVX-512 machines, whose summation orders differ), as README.md states.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::{Backend, Role, View};
use tessera_core::Weights;
use tessera_core::gguf::GgmlType;
use tessera_models::ModelFiles;
use tessera_models::qwen3::BpeTokenizer;
use tessera_models::qwen3::{Qwen3Config, Qwen3TextModel};
use tessera_models::text_to_image::{Event, Request};
use tessera_models::zimage::config::{SchedulerConfig, TransformerConfig, VaeConfig};
use tessera_models::zimage::scheduler::FlowMatchEuler;
use tessera_models::zimage::text::{PromptTemplate, builtin_template, prompt_ids};
use tessera_models::zimage::transformer::{
    Taps, ZImageTransformer, timestep_features, timestep_frequencies,
};
use tessera_models::zimage::vae::{VaeDecoder, VaeTaps};
use tessera_models::zimage::{self, BUNDLED, ZImage, ZImageFiles};

mod common;

use common::{Expected, Worst, max_abs, rel};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn mini() -> PathBuf {
    root().join("crates/models/assets/zimage-mini")
}

// ---- fixture files ----------------------------------------------------------------------------

#[derive(Deserialize)]
struct Cases {
    text: Vec<TextCase>,
    dit: Vec<DitCase>,
    e2e: Vec<E2eCase>,
    schedules: Vec<ScheduleCase>,
}

#[derive(Deserialize)]
struct TextCase {
    name: String,
    prompt: String,
    ids: Vec<u32>,
    untruncated_len: usize,
}

#[derive(Deserialize)]
struct DitCase {
    name: String,
    items: usize,
    latent: String,
    caps: Vec<String>,
    t: f64,
    latent_shape: [usize; 3],
}

#[derive(Deserialize)]
struct E2eCase {
    name: String,
    prompt: String,
    negative_prompt: Option<String>,
    height: usize,
    width: usize,
    steps: usize,
    guidance: f32,
    shift: f64,
    ids_pos: Vec<u32>,
    ids_neg: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct ScheduleCase {
    steps: usize,
    shift: f64,
    sigmas: Vec<f64>,
    timesteps: Vec<f64>,
    t_model: Vec<f64>,
}

fn cases() -> Cases {
    let p = root().join("tests/fixtures/zimage/cases.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("cases.json parses")
}

fn cpu_buf(be: &CpuBackend, v: &[f32]) -> <CpuBackend as Backend>::Buf {
    let mut b = be.alloc(v.len(), Role::Stream).unwrap();
    be.write_f32(&mut b, v).unwrap();
    b
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap()
}

/// The fixture transformer, with the reference's own timestep frequency table (see
/// `timestep_frequencies_are_correctly_rounded` for the one-ulp difference this isolates).
fn load_transformer(
    be: &CpuBackend,
    weights: &Weights,
    ex: &Expected,
) -> ZImageTransformer<CpuBackend> {
    let dir = mini().join("transformer");
    let cfg =
        TransformerConfig::parse(&dir.join("config.json"), &read(&dir, "config.json")).unwrap();
    let mut tr = ZImageTransformer::load(be, &cfg, weights).unwrap();
    tr.set_timestep_frequencies(ex.f32("timestep_freqs"))
        .unwrap();
    tr
}

fn diffusers_weights() -> Weights {
    Weights::open_dir(&mini().join("transformer"), "diffusion_pytorch_model").unwrap()
}

/// Run one DiT case and return its taps.
fn run_dit(
    be: &CpuBackend,
    tr: &ZImageTransformer<CpuBackend>,
    ex: &Expected,
    c: &DitCase,
) -> Taps {
    let caps: Vec<Vec<f32>> = c.caps.iter().map(|n| ex.f32(n)).collect();
    let bufs: Vec<_> = caps.iter().map(|v| cpu_buf(be, v)).collect();
    let views: Vec<View<'_, CpuBackend>> = c
        .caps
        .iter()
        .zip(&bufs)
        .map(|(n, b)| View::new(b, ex.shape(n)[0], ex.shape(n)[1]))
        .collect();
    let [_, h, w] = c.latent_shape;
    let mut taps = Taps::default();
    let mut prep = tr
        .prepare(be, &views, (h, w), &[c.t as f32], Some(&mut taps))
        .unwrap();
    let latent = ex.f32(&c.latent);
    let latents = vec![latent.as_slice(); views.len()];
    tr.forward(be, &mut prep, &latents, 0, Some(&mut taps))
        .unwrap();
    taps
}

// ---- tests ----------------------------------------------------------------------------------

/// Bound per DiT tap (spec §8), and whether it is judged by max-abs instead of rel.
fn dit_bound(tap: &str) -> (f64, bool) {
    match tap {
        "temb" | "cap_seq" | "x_seq" => (1e-6, false),
        t if t.starts_with("mod_") => (1e-6, false),
        "rope_cos" | "rope_sin" => (2e-6, true),
        "final_mod" => (1e-5, false),
        t if t.starts_with("cr")
            || t.starts_with("nr")
            || t == "u_in"
            || t == "l0_out"
            || t == "l1_out" =>
        {
            (1e-5, false)
        }
        "final_out" | "v" => (2e-6, false),
        other => panic!("no bound for tap {other}"),
    }
}

#[test]
fn dit_taps_match_the_reference_block_by_block() {
    let (fx, ex, be) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let tr = load_transformer(&be, &diffusers_weights(), &ex);
    assert!(
        fx.dit.len() >= 5 && fx.dit.iter().any(|c| c.items == 2),
        "fixture DiT cases"
    );
    let mut worst = Worst::default();
    for c in &fx.dit {
        let taps = run_dit(&be, &tr, &ex, c);
        let mut seen = 0;
        for item in 0..c.items {
            let prefix = format!("dit/{}/{item}/", c.name);
            for (name, _) in ex.tensors.range(prefix.clone()..) {
                let Some(tap) = name.strip_prefix(&prefix) else {
                    break;
                };
                let got = taps
                    .values
                    .get(&(tap.to_string(), item))
                    .unwrap_or_else(|| panic!("{}: tap {tap} (item {item}) not recorded", c.name));
                let want = ex.get(name);
                let (bound, abs) = dit_bound(tap);
                let err = if abs {
                    max_abs(got, want)
                } else {
                    rel(got, want)
                };
                worst.check(tap, &format!("{} item {item}", c.name), err, bound);
                seen += 1;
            }
        }
        assert!(
            seen >= 18 * c.items,
            "{}: only {seen} taps compared",
            c.name
        );
    }
    worst.report("dit");
}

#[test]
fn timestep_features_are_the_reference_sinusoid() {
    // cos first, then sin, of τ·f with τ = 1000·t.
    let freqs = timestep_frequencies();
    let f = timestep_features(&freqs, 0.25, 1000.0);
    assert_eq!(f.len(), 256);
    assert_eq!(
        (f[0], f[128]),
        ((250f64).cos() as f32, (250f64).sin() as f32)
    );
    let f0 = timestep_features(&freqs, 0.0, 1000.0);
    assert!(f0[..128].iter().all(|&c| c == 1.0) && f0[128..].iter().all(|&s| s == 0.0));
}

/// Our frequencies are the correctly rounded `exp`; torch's CPU `exp` (Sleef) is within one ulp
/// and differs in a handful of entries. The tap test above uses the reference's table; here the
/// difference it isolates is measured, and the pipeline test runs with our own table.
#[test]
fn timestep_frequencies_are_correctly_rounded_and_within_an_ulp_of_torch() {
    let ex = Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors"));
    let ours = timestep_frequencies();
    let theirs = ex.f32("timestep_freqs");
    let mut differ = 0;
    for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
        let e = (-(10_000f64.ln()) as f32 * i as f32) / 128.0;
        assert_eq!(
            a,
            (e as f64).exp() as f32,
            "entry {i} is the correctly rounded exp"
        );
        let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(ulps <= 1, "entry {i}: {ulps} ulps from torch");
        differ += (ulps == 1) as usize;
    }
    eprintln!("timestep frequencies: {differ} of 128 one ulp from torch's CPU exp");
    assert!(differ <= 8, "{differ} entries differ");
}

#[test]
fn comfyui_sharded_and_f32_transformer_files_give_identical_outputs() {
    let (fx, ex, be) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let c = &fx.dit[2];
    let v = |w: &Weights| {
        run_dit(&be, &load_transformer(&be, w, &ex), &ex, c).values[&("v".to_string(), 0)].clone()
    };
    let reference = v(&diffusers_weights());
    // The single-file ComfyUI layout: prefix, renamed keys, fused qkv, extra norm_final key.
    let comfy =
        Weights::open_file(&root().join("tests/fixtures/zimage/comfy_transformer.safetensors"))
            .unwrap();
    assert_eq!(v(&comfy), reference, "ComfyUI layout");
    // The published Turbo layout: fp32 tensors in shards with an index.
    let dir = tempfile::tempdir().unwrap();
    write_sharded_f32(&diffusers_weights(), dir.path(), 3);
    let sharded = Weights::open_dir(dir.path(), "diffusion_pytorch_model").unwrap();
    assert_eq!(v(&sharded), reference, "sharded fp32 layout");
}

/// A ComfyUI-GGUF transformer (tests/fixtures/transformer_gguf, written by
/// tools/fixtures/transformer_gguf.py with llama.cpp's `gguf` package: Q8_0 matrices, F32 the rest)
/// runs exactly: its velocity equals, within 1e-5, the f32 run of a checkpoint holding every
/// tensor's dequantized values.
#[test]
fn a_q8_0_gguf_transformer_equals_the_f32_run_on_its_dequantized_weights() {
    let (fx, ex, be) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let c = &fx.dit[2];
    let v = |w: &Weights| {
        run_dit(&be, &load_transformer(&be, w, &ex), &ex, c).values[&("v".to_string(), 0)].clone()
    };
    let path = root().join("tests/fixtures/transformer_gguf/zimage_q8_0.gguf");
    let quantized = v(&Weights::open_any(&path).unwrap());
    // The dequantized checkpoint, written from the GGUF decoders' values.
    let g = tessera_core::gguf::Gguf::open(&path).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = g
        .tensors()
        .map(|t| {
            let bytes = t
                .to_f32()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (t.name.to_string(), t.shape(), bytes)
        })
        .collect();
    assert!(
        g.tensors()
            .filter(|t| t.ggml_type == GgmlType::Q8_0)
            .count()
            > 20
    );
    let views = tensors.iter().map(|(n, s, b)| {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
        (n.clone(), v.unwrap())
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dequantized.safetensors");
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let reference = v(&Weights::open_file(&file).unwrap());
    let err = rel(
        &quantized,
        &reference.iter().map(|&x| x as f64).collect::<Vec<_>>(),
    );
    assert!(
        err <= 1e-5,
        "Q8_0 GGUF vs f32 on its dequantized weights: {err:e}"
    );
    // Quantizing changed the transformer: the bf16 ComfyUI file it came from is further off.
    let comfy =
        Weights::open_file(&root().join("tests/fixtures/zimage/comfy_transformer.safetensors"))
            .unwrap();
    let bf16 = v(&comfy).iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert!(rel(&quantized, &bf16) > 1e-4, "Q8_0 changed nothing");
}

/// A ComfyUI scaled FP8 transformer (tests/fixtures/transformer_fp8, written by
/// tools/fixtures/transformer_fp8.py with torch: every matrix `float8_e4m3fn` with a per-tensor
/// `scale_weight`, the rest bf16) runs exactly: its velocity equals, within 1e-5, the float64
/// diffusers run on its dequantized weights (`codes · scale` in f32).
#[test]
fn a_scaled_fp8_transformer_equals_the_reference_on_its_dequantized_weights() {
    let (fx, ex, be) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let c = &fx.dit[2];
    let v = |w: &Weights| {
        run_dit(&be, &load_transformer(&be, w, &ex), &ex, c).values[&("v".to_string(), 0)].clone()
    };
    let path = root().join("tests/fixtures/transformer_fp8/zimage_fp8_scaled.safetensors");
    let w = Weights::open_any(&path).unwrap();
    let fp8 = w
        .names()
        .into_iter()
        .filter(|n| w.tensor(n).unwrap().scale.is_some())
        .count();
    assert!(fp8 > 20, "only {fp8} scaled FP8 matrices");
    let got = v(&w);
    let want =
        Expected::load_from(&root().join("tests/fixtures/transformer_fp8/expected.safetensors"));
    let err = rel(&got, want.get("zimage/v"));
    assert!(
        err <= 1e-5,
        "scaled FP8 vs float64 on its dequantized weights: {err:e}"
    );
    // FP8 changed the transformer: the bf16 ComfyUI file it came from is further off.
    let comfy =
        Weights::open_file(&root().join("tests/fixtures/zimage/comfy_transformer.safetensors"))
            .unwrap();
    let bf16 = v(&comfy).iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert!(rel(&got, &bf16) > 1e-3, "FP8 changed nothing");
    eprintln!("scaled FP8 Z-Image vs float64 reference: {err:.2e}");
}

/// Re-save `w` as `n` fp32 shards with a `.safetensors.index.json`, named like diffusers does.
fn write_sharded_f32(w: &Weights, dir: &Path, n: usize) {
    let names = w.names();
    let mut index = serde_json::Map::new();
    for (s, chunk) in names.chunks(names.len().div_ceil(n)).enumerate() {
        let file = format!("diffusion_pytorch_model-{:05}-of-{n:05}.safetensors", s + 1);
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|name| {
                let t = w.tensor(name).unwrap();
                let bytes = t.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect();
                index.insert(name.to_string(), file.clone().into());
                (name.to_string(), t.shape.clone(), bytes)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                let tv =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap();
                (n.clone(), tv)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
    }
    let json = serde_json::json!({ "metadata": {}, "weight_map": index });
    std::fs::write(
        dir.join("diffusion_pytorch_model.safetensors.index.json"),
        json.to_string(),
    )
    .unwrap();
}

#[test]
fn vae_blocks_match_the_reference() {
    let (ex, be) = (
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let dir = mini().join("vae");
    let cfg = VaeConfig::parse(&dir.join("config.json"), &read(&dir, "config.json")).unwrap();
    let w = Weights::open_dir(&dir, "diffusion_pytorch_model").unwrap();
    let vae = VaeDecoder::load(&be, &cfg, &w).unwrap();
    let z = ex.f32("vae/z");
    let [_, h, w] = ex.shape("vae/z").try_into().unwrap();
    let mut taps = VaeTaps::default();
    let image = vae.decode(&be, &z, (h, w), Some(&mut taps)).unwrap();
    taps.values.insert("sample".into(), image);
    // f32 convolutions over ≤ 288 terms and GroupNorm statistics in f64: the same 1e-5 bound as
    // the DiT's block outputs.
    let mut worst = Worst::default();
    for (name, got) in &taps.values {
        let key = format!("vae/{name}");
        let [c, hh, ww]: [usize; 3] = ex.shape(&key).try_into().unwrap();
        // NCHW (reference) → channels-last (ours).
        let want = ex.get(&key);
        let mut nhwc = vec![0f64; want.len()];
        for ch in 0..c {
            for p in 0..hh * ww {
                nhwc[p * c + ch] = want[ch * hh * ww + p];
            }
        }
        worst.check(name, "vae", rel(got, &nhwc), 1e-5);
    }
    assert_eq!(worst.taps.len(), 7, "conv_in, mid, up0..up3, sample");
    worst.report("vae");
}

#[test]
fn text_encoder_ids_and_layers_match_the_reference() {
    let (fx, ex, be) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
        CpuBackend::new(),
    );
    let files = ZImageFiles::dir(&mini()).unwrap();
    let tok = BpeTokenizer::load(&files.tokenizer).unwrap();
    let template = PromptTemplate::load(&files.tokenizer).unwrap();
    let dir = mini().join("text_encoder");
    let cfg = Qwen3Config::parse(&dir.join("config.json"), &read(&dir, "config.json")).unwrap();
    let w = Weights::open_dir(&dir, "model").unwrap().pp("model");
    let mut worst = Worst::default();
    let mut truncated = 0;
    let mut compared = 0;
    for depth in 1..cfg.num_layers {
        let mut te = Qwen3TextModel::load(&be, &cfg, &w, depth).unwrap();
        for c in &fx.text {
            let ids = prompt_ids(&tok, &template, &c.prompt).unwrap();
            assert_eq!(ids.ids, c.ids, "{}: token ids", c.name);
            assert_eq!(
                ids.full_len, c.untruncated_len,
                "{}: length before truncation",
                c.name
            );
            truncated += ids.truncated() as usize;
            let key = format!("te/{}/h{depth}", c.name);
            if !ex.tensors.contains_key(&key) {
                continue;
            }
            let got = be.read_f32(te.forward(&be, &[&c.ids]).unwrap()).unwrap();
            worst.check(&format!("h{depth}"), &c.name, rel(&got, ex.get(&key)), 1e-6);
            compared += 1;
        }
    }
    assert!(truncated > 0, "the fixture has a prompt past 512 tokens");
    // The generator keeps every depth of "short" and "long", and the last one (the features
    // Z-Image uses) of every other prompt: all of them must have been compared.
    let full = ["short", "long"];
    for name in full {
        assert!(fx.text.iter().any(|c| c.name == name), "no {name:?} prompt");
    }
    let want: usize = fx
        .text
        .iter()
        .map(|c| {
            if full.contains(&c.name.as_str()) {
                cfg.num_layers - 1
            } else {
                1
            }
        })
        .sum();
    assert_eq!(compared, want, "text encoder layers compared");
    // Packed prompts (as CFG encodes them) give each prompt what it gets alone.
    let mut te = Qwen3TextModel::load(&be, &cfg, &w, cfg.num_layers - 1).unwrap();
    let (a, b) = (&fx.text[0].ids, &fx.text[1].ids);
    let packed = be.read_f32(te.forward(&be, &[a, b]).unwrap()).unwrap();
    let alone = be.read_f32(te.forward(&be, &[b]).unwrap()).unwrap();
    assert_eq!(&packed[a.len() * cfg.hidden_size..], &alone[..]);
    worst.report("text");
}

#[test]
fn sigma_schedules_are_bit_identical() {
    let fx = cases();
    assert!(
        fx.schedules.iter().any(|s| s.steps == 8) && fx.schedules.iter().any(|s| s.steps == 50)
    );
    for s in &fx.schedules {
        let got = FlowMatchEuler::new(SchedulerConfig {
            num_train_timesteps: 1000,
            shift: s.shift,
        })
        .schedule(s.steps)
        .unwrap();
        let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
        assert_eq!(got.sigmas, f(&s.sigmas), "σ, {} steps", s.steps);
        assert_eq!(
            got.timesteps,
            f(&s.timesteps),
            "timesteps, {} steps",
            s.steps
        );
        assert_eq!(got.t_model, f(&s.t_model), "t_model, {} steps", s.steps);
    }
}

/// Whole pipeline from the reference's initial latent: per-step transformer outputs and latents,
/// then the 8-bit image.
///
/// Bounds: caption features ≤ 1e-6 (measured ≤ 2.7e-7); v and latents ≤ 1e-5 (measured ≤ 4.3e-6;
/// the f32 latent and Euler update are the reference's own, so errors do not compound over 4–8
/// steps). The image must be
/// identical except for pixels whose reference value `x·255` lies within 0.02 of a rounding tie,
/// which may move by one level: there the 1e-6-level difference between a float64 and an f32
/// decode decides the rounding.
#[test]
fn pipeline_reproduces_the_reference_steps_and_image() {
    let (fx, ex) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
    );
    assert_eq!(fx.e2e.len(), 2);
    let mut z = ZImage::load(CpuBackend::new(), &ZImageFiles::dir(&mini()).unwrap(), None).unwrap();
    let mut worst = Worst::default();
    for c in &fx.e2e {
        let p = format!("e2e/{}/", c.name);
        let req = Request {
            prompt: c.prompt.clone(),
            negative_prompt: c.negative_prompt.clone(),
            width: c.width,
            height: c.height,
            steps: c.steps,
            guidance: c.guidance,
            seed: 0,
            init_latent: Some(ex.f32(&format!("{p}init_latent"))),
            shift: Some(c.shift),
            num_images: 1,
            edit: None,
        };
        let plan = z.plan(&req).unwrap();
        assert_eq!(plan.prompts[0].ids, c.ids_pos, "{}: prompt ids", c.name);
        assert_eq!(
            plan.prompts.get(1).map(|p| &p.ids),
            c.ids_neg.as_ref(),
            "{}: negative ids",
            c.name
        );
        let caps = z.caption_features(&plan.prompts).unwrap();
        worst.check(
            "cap_pos",
            &c.name,
            rel(&caps[0], ex.get(&format!("{p}cap_pos"))),
            1e-6,
        );
        if c.guidance > 0.0 {
            worst.check(
                "cap_neg",
                &c.name,
                rel(&caps[1], ex.get(&format!("{p}cap_neg"))),
                1e-6,
            );
        }
        let mut steps = 0;
        let image = z
            .generate(&req, &plan, |e| {
                if let Event::Step {
                    index, v, latents, ..
                } = e
                {
                    let latent = &latents[0];
                    let case = format!("{} step {index}", c.name);
                    worst.check(
                        "v_pos",
                        &case,
                        rel(&v[0], ex.get(&format!("{p}v{index}_pos"))),
                        1e-5,
                    );
                    if c.guidance > 0.0 {
                        worst.check(
                            "v_neg",
                            &case,
                            rel(&v[1], ex.get(&format!("{p}v{index}_neg"))),
                            1e-5,
                        );
                    }
                    worst.check(
                        "latent",
                        &case,
                        rel(latent, ex.get(&format!("{p}lat{index}"))),
                        1e-5,
                    );
                    steps += 1;
                }
            })
            .unwrap();
        assert_eq!(steps, c.steps);
        assert_image_matches(&c.name, &image.pixels, &ex, &p);
    }
    worst.report("e2e");
}

/// The 8-bit image `got` is the reference's `{prefix}image_u8`, except for channel values whose
/// reference level `x·255` (`{prefix}image_f32`) lies within 0.02 of a rounding tie, which may
/// move by one level.
fn assert_image_matches(name: &str, got: &[u8], ex: &Expected, prefix: &str) {
    let want_u8 = ex.get(&format!("{prefix}image_u8"));
    let want_f = ex.get(&format!("{prefix}image_f32"));
    assert_eq!(got.len(), want_u8.len());
    let (mut exact, mut off_by_one) = (0, 0);
    for ((&g, &w), &f) in got.iter().zip(want_u8).zip(want_f) {
        let d = (g as f64 - w).abs();
        if d == 0.0 {
            exact += 1;
        } else {
            let frac = (f * 255.0).fract();
            assert!(
                d == 1.0 && (frac - 0.5).abs() < 0.02,
                "{name}: pixel {g} vs {w} (reference level {:.4}) differs beyond a rounding tie",
                f * 255.0
            );
            off_by_one += 1;
        }
    }
    eprintln!(
        "e2e {name}: {exact} of {} channel values identical, {off_by_one} one level off at a rounding tie",
        got.len()
    );
}

#[test]
fn the_bundled_model_is_the_fixture_model() {
    let (fx, ex) = (
        cases(),
        Expected::load_from(&root().join("tests/fixtures/zimage/expected.safetensors")),
    );
    let c = &fx.e2e[0];
    let mut z = ZImage::load(CpuBackend::new(), &BUNDLED, None).unwrap();
    let req = Request {
        prompt: c.prompt.clone(),
        width: c.width,
        height: c.height,
        init_latent: Some(ex.f32(&format!("e2e/{}/init_latent", c.name))),
        ..Request::new("", zimage::DEFAULTS)
    };
    let plan = z.plan(&req).unwrap();
    let image = z.generate(&req, &plan, |_| {}).unwrap();
    let want = ex.get(&format!("e2e/{}/image_u8", c.name));
    assert_eq!(image.pixels.len(), want.len(), "bundled model's image size");
    let differ = image
        .pixels
        .iter()
        .zip(want)
        .filter(|(g, w)| (**g as f64 - **w).abs() > 1.0)
        .count();
    assert_eq!(differ, 0, "bundled model's image");
}

// ---- a tokenizer folder that ships its own chat template ------------------------------------

/// `tests/fixtures/zimage/template/case.json`: the miniature with `chat_template.jinja` replaced by
/// one unlike Qwen3's in content and whitespace control.
#[derive(Deserialize)]
struct TemplateCase {
    prompt: String,
    /// What `apply_chat_template(..., tokenize=False)` rendered.
    text: String,
    ids_pos: Vec<u32>,
    height: usize,
    width: usize,
    steps: usize,
    shift: f64,
}

/// The case, its expected tensors, and the miniature's files with the fixture's tokenizer folder
/// (the miniature's tokenizer files and the fixture's template) in the returned temporary folder.
fn template_fixture() -> (TemplateCase, Expected, ZImageFiles, tempfile::TempDir) {
    let fix = root().join("tests/fixtures/zimage/template");
    let case: TemplateCase =
        serde_json::from_str(&std::fs::read_to_string(fix.join("case.json")).unwrap()).unwrap();
    let ex = Expected::load_from(&fix.join("expected.safetensors"));
    let dir = tempfile::tempdir().unwrap();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(mini().join("tokenizer").join(name), dir.path().join(name)).unwrap();
    }
    std::fs::copy(
        fix.join("chat_template.jinja"),
        dir.path().join("chat_template.jinja"),
    )
    .unwrap();
    let files = ZImageFiles {
        tokenizer: ModelFiles::Dir(dir.path().to_path_buf()),
        ..ZImageFiles::dir(&mini()).unwrap()
    };
    (case, ex, files, dir)
}

/// The prompt is what the folder's own template renders (not the built-in Qwen3 format), down to
/// the token ids; a folder whose template is Qwen3's, or that has none, gets the built-in format.
#[test]
fn a_shipped_chat_template_gives_the_reference_text_and_token_ids() {
    let (c, _, files, dir) = template_fixture();
    let template = PromptTemplate::load(&files.tokenizer).unwrap();
    assert!(
        matches!(template, PromptTemplate::Shipped(_)),
        "{template:?}"
    );
    assert_eq!(template.render(&c.prompt).unwrap(), c.text);
    assert_ne!(c.text, builtin_template(&c.prompt));
    let tok = BpeTokenizer::load(&files.tokenizer).unwrap();
    assert_eq!(
        prompt_ids(&tok, &template, &c.prompt).unwrap().ids,
        c.ids_pos
    );

    let own = PromptTemplate::load(&ZImageFiles::dir(&mini()).unwrap().tokenizer).unwrap();
    assert!(matches!(own, PromptTemplate::Shipped(_)));
    assert_eq!(own.render(&c.prompt).unwrap(), builtin_template(&c.prompt));
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
    let none = PromptTemplate::load(&files.tokenizer).unwrap();
    assert!(matches!(none, PromptTemplate::Builtin), "{none:?}");
    assert!(none.describe().contains("no chat template"));
}

/// And the image is the reference's image with that template.
#[test]
fn a_shipped_chat_template_gives_the_reference_image() {
    let (c, ex, files, _dir) = template_fixture();
    let mut z = ZImage::load(CpuBackend::new(), &files, None).unwrap();
    let req = Request {
        width: c.width,
        height: c.height,
        steps: c.steps,
        guidance: 0.0,
        init_latent: Some(ex.f32("init_latent")),
        shift: Some(c.shift),
        ..Request::new(&c.prompt, zimage::DEFAULTS)
    };
    let plan = z.plan(&req).unwrap();
    assert_eq!(plan.prompts[0].ids, c.ids_pos);
    let image = z.generate(&req, &plan, |_| {}).unwrap();
    assert_image_matches("custom_template", &image.pixels, &ex, "");
}
