//! Qwen-Image-2.1's VAE decoder and σ schedules on the CPU against the reference's golden
//! fixtures (`tools/fixtures/qwen_image_vae.py`: a float64 diffusers 0.42.1
//! `AutoencoderKLQwenImage21` built from the saved bf16 weights, and the pipeline's own
//! `calculate_shift` + `retrieve_timesteps` path).
//!
//! Errors are `rel = max |got − want| / max |want|` per tap. Bound: 1e-5 on every tap (f32
//! convolutions of ≤ 288 terms, norm statistics in f64, one f32 softmax over ≤ 20 keys).

use std::path::Path;

mod common;

use common::{
    Expected, VaeCases, channels_last, max_abs, qwen_image_dir as fixtures,
    qwen_vae_config as config, read, rel,
};
use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_core::Weights;
use tessera_models::qwen_image::scheduler::{SchedulerConfig, schedule};
use tessera_models::qwen_image::vae::{self, VaeConfig, VaeDecoder, VaeTaps, to_rgba8};

fn decoder(be: &CpuBackend) -> VaeDecoder<CpuBackend> {
    let w = Weights::open_dir(&fixtures().join("vae"), "diffusion_pytorch_model").unwrap();
    VaeDecoder::load(be, &config(), &w).unwrap()
}

#[test]
fn the_fixture_config_is_read_whole() {
    let c = config();
    assert_eq!((c.base_dim, c.decoder_base_dim, c.z_dim), (12, 8, 8));
    assert_eq!(c.dim_mult, [1, 1, 2, 4, 4]);
    assert_eq!((c.num_res_blocks, c.in_channels, c.out_channels), (2, 4, 4));
    assert_eq!(c.temperal_downsample, [false, true, true, true]);
    assert_eq!(c.latents_mean[0], -0.2304f32);
    assert_eq!(c.latents_std[7], 0.6955f32);
    assert_eq!((c.scale(), c.mid_channels()), (16, 32));
    // The release's pattern: 2 channel-keeping blocks, then halving with temporal factor 2
    // (last slot) and 1, then a block that neither upsamples nor adds a shortcut.
    let shapes: Vec<_> = c
        .up_blocks()
        .iter()
        .map(|b| (b.cin, b.cout, b.frames))
        .collect();
    assert_eq!(
        shapes,
        [
            (32, 32, Some(2)),
            (32, 32, Some(2)),
            (32, 16, Some(2)),
            (16, 8, Some(1)),
            (8, 8, None)
        ]
    );
}

/// Both latents decode to the reference's taps and image; the 8-bit RGBA image is identical
/// except where the reference's `v·255` lies so close to a rounding tie that the f32 decode's
/// error (measured here) can move it across: there one level either way is allowed, and only a
/// handful of such values may exist.
#[test]
fn decodes_like_the_reference() {
    let (ex, be) = (
        Expected::load_from(&fixtures().join("vae_expected.safetensors")),
        CpuBackend::new(),
    );
    let cases: VaeCases = serde_json::from_str(&read(&fixtures().join("vae_cases.json"))).unwrap();
    assert_eq!(cases.cases.len(), 2);
    let vae = decoder(&be);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for c in &cases.cases {
        let [h, w] = c.latent_hw;
        let name = format!("{}/latent", c.name);
        let (shape, latent) = (ex.shape(&name), ex.get(&name));
        assert_eq!(shape, [h * w, 8]);
        let latent: Vec<f32> = latent.iter().map(|&v| v as f32).collect();
        let mut taps = VaeTaps::default();
        let image = vae.decode(&be, &latent, (h, w), Some(&mut taps)).unwrap();
        let [ih, iw] = c.image_hw;
        assert_eq!(image.len(), ih * iw * 4);
        assert!(image.iter().all(|v| (-1.0..=1.0).contains(v)), "clamped");
        taps.values.insert("sample".into(), image.clone());
        let mut names: Vec<_> = taps.values.keys().cloned().collect();
        names.sort();
        let mut want_names = c.taps.clone();
        want_names.sort();
        assert_eq!(names, want_names, "{}: every tap compared", c.name);
        for (name, got) in &taps.values {
            let want = channels_last(&ex, &format!("{}/{name}", c.name));
            let err = rel(got, &want);
            report.push(format!("{:>10} {name:>10}: rel {err:.2e}", c.name));
            if err.is_nan() || err > 1e-5 {
                failures.push(format!("{} {name}: rel {err:.3e} > 1e-5", c.name));
            }
        }

        // The 8-bit image.
        let sample = channels_last(&ex, &format!("{}/sample", c.name));
        let name = format!("{}/rgba8", c.name);
        let (shape, want_u8) = (ex.shape(&name), ex.get(&name));
        assert_eq!(shape, [ih, iw, 4]);
        let got_u8 = to_rgba8(&image);
        let slack = 127.5 * 2.0 * max_abs(&image, &sample) + 1e-4;
        let mut moved = 0;
        for (i, ((&g, &wu), &x)) in got_u8.iter().zip(want_u8).zip(&sample).enumerate() {
            if g as f64 == wu {
                continue;
            }
            let v = (x * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0;
            let tie = (v - v.floor() - 0.5).abs();
            assert!(
                (g as f64 - wu).abs() == 1.0 && tie <= slack,
                "{}: value {i}: {g} vs reference {wu} (reference v·255 = {v}, {tie:.2e} from a tie, slack {slack:.1e})",
                c.name
            );
            moved += 1;
        }
        assert!(moved <= 4, "{}: {moved} values off by one", c.name);
        report.push(format!(
            "{:>10}      rgba8: {moved} of {} values off by one (slack {slack:.1e})",
            c.name,
            got_u8.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[derive(Deserialize)]
struct Schedules {
    cases: Vec<ScheduleCase>,
}

#[derive(Deserialize)]
struct ScheduleCase {
    steps: usize,
    image_tokens: usize,
    mu: f64,
    sample_sigmas: Option<Vec<f64>>,
    nan: bool,
    sigmas: Option<Vec<f64>>,
    timesteps: Option<Vec<f64>>,
    t_model: Option<Vec<f64>>,
}

#[test]
fn sigma_schedules_are_bit_identical() {
    let p = fixtures().join("scheduler_config.json");
    let cfg = SchedulerConfig::parse(&p, &read(&p)).unwrap();
    assert!(cfg.flow.use_dynamic_shifting);
    assert_eq!(cfg.flow.shift_terminal, Some(0.02));
    let fx: Schedules = serde_json::from_str(&read(&fixtures().join("schedules.json"))).unwrap();
    let (mut plain, mut listed, mut nan) = (0, 0, 0);
    let f32s = |v: &Option<Vec<f64>>| -> Vec<f32> {
        v.as_ref().unwrap().iter().map(|&x| x as f32).collect()
    };
    for c in &fx.cases {
        let what = format!("{} steps, {} tokens", c.steps, c.image_tokens);
        // serde_json's default float parsing may miss the last bit of a 17-digit number; the σ
        // lists below are compared bit for bit after their cast to f32.
        let mu = cfg.mu(c.image_tokens);
        assert!(
            (mu - c.mu).abs() <= 2.0 * f64::EPSILON * c.mu.abs(),
            "μ {mu} vs {}, {what}",
            c.mu
        );
        // The step count asked for is ignored when sample_sigmas are configured.
        let asked = if c.sample_sigmas.is_some() {
            40
        } else {
            c.steps
        };
        let got = schedule(&cfg, asked, c.image_tokens, c.sample_sigmas.as_deref());
        if c.nan {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("shift_terminal"), "{what}: {e}");
            nan += 1;
            continue;
        }
        let got = got.unwrap();
        assert_eq!(got.steps(), c.steps, "{what}");
        assert_eq!(got.sigmas, f32s(&c.sigmas), "σ, {what}");
        assert_eq!(got.timesteps, f32s(&c.timesteps), "timesteps, {what}");
        assert_eq!(got.t_model, f32s(&c.t_model), "t_model, {what}");
        if c.sample_sigmas.is_some() {
            listed += 1;
        } else {
            plain += 1;
        }
    }
    assert_eq!((plain, listed, nan), (6, 2, 1), "cases of each kind");
}

#[test]
fn declares_every_op_it_calls() {
    let be = CpuBackend::recording();
    let vae = decoder(&be);
    vae.decode(&be, &[0.25; 3 * 2 * 8], (3, 2), None).unwrap();
    let declared = vae::ops(vae.config());
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
fn bad_latents_are_refused() {
    let be = CpuBackend::new();
    let vae = decoder(&be);
    let e = vae
        .decode(&be, &[0.0; 8 * 4 * 4 - 1], (4, 4), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4×4 tokens of 8 channels"), "{e}");
    assert!(vae.decode(&be, &[], (0, 4), None).is_err());
    // Activations for a 1024² image of the release would be sized by its largest stage; here
    // 64×64 pixels of 8 channels at the end, and q|k|v in the mid block at the start.
    assert_eq!(vae.activation_bytes((4, 4), 4), 64 * 64 * 8 * 5 * 4);
}

/// The fixture's config with `edit` applied to its JSON.
fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let p = fixtures().join("vae/config.json");
    let mut v: serde_json::Value = serde_json::from_str(&read(&p)).unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn config_errors_name_the_file_and_field() {
    let p = Path::new("some/model/vae/config.json");
    let err = |json: String| VaeConfig::parse(p, &json).unwrap_err().to_string();
    let cases: Vec<(String, &[&str])> = vec![
        (
            edited(|v| {
                v.as_object_mut().unwrap().remove("latents_mean");
            }),
            &["latents_mean", "missing VAE stats"],
        ),
        (
            edited(|v| {
                v.as_object_mut().unwrap().remove("latents_std");
            }),
            &["latents_std", "missing VAE stats"],
        ),
        (
            edited(|v| v["latents_std"] = serde_json::json!([1.0, 2.0])),
            &["latents_std", "2 values for z_dim 8"],
        ),
        (
            edited(|v| v["z_dim"] = serde_json::json!("eight")),
            &["z_dim", "invalid type"],
        ),
        (
            edited(|v| v["temperal_downsample"] = serde_json::json!([true, true])),
            &["temperal_downsample", "2 entries"],
        ),
        (
            edited(|v| v["is_residual"] = serde_json::json!(false)),
            &["is_residual"],
        ),
        (
            edited(|v| v["patch_size"] = serde_json::json!(2)),
            &["patch_size"],
        ),
        (
            edited(|v| v["_class_name"] = serde_json::json!("AutoencoderKLWan")),
            &["_class_name", "AutoencoderKLQwenImage21"],
        ),
        (
            edited(|v| v["dim_mult"] = serde_json::json!([1, 1, 3, 4, 4])),
            &["dim_mult", "DupUp", "24→8"],
        ),
        (
            edited(|v| v["scale_factor_spatial"] = serde_json::json!(8)),
            &["scale_factor_spatial", "16×"],
        ),
    ];
    for (json, words) in cases {
        let e = err(json);
        assert!(e.contains("some/model/vae/config.json"), "{e}");
        for w in words {
            assert!(e.contains(w), "{w:?} not in: {e}");
        }
    }
    // A null decoder width falls back to the encoder's, as diffusers does.
    let c = VaeConfig::parse(
        p,
        &edited(|v| v["decoder_base_dim"] = serde_json::Value::Null),
    );
    assert_eq!(c.unwrap().decoder_base_dim, 12);
}

#[test]
fn a_checkpoint_that_does_not_fit_its_config_names_the_tensor() {
    let be = CpuBackend::new();
    let p = Path::new("vae/config.json");
    let cfg = VaeConfig::parse(
        p,
        &edited(|v| v["decoder_base_dim"] = serde_json::json!(16)),
    )
    .unwrap();
    let w = Weights::open_dir(&fixtures().join("vae"), "diffusion_pytorch_model").unwrap();
    let e = VaeDecoder::load(&be, &cfg, &w).err().unwrap().to_string();
    assert!(
        e.contains("decoder.") && e.contains("expected shape"),
        "{e}"
    );
}
