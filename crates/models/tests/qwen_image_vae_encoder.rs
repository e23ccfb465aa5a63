//! Qwen-Image-2.1's VAE encoder on the CPU against the reference's golden fixtures
//! (`tools/fixtures/qwen_image_vae.py`: a float64 diffusers 0.42.1 `AutoencoderKLQwenImage21`
//! built from the saved bf16 weights, the pipeline's `VaeImageProcessor.preprocess`,
//! `_encode_vae_image` and `_pack_latents`).
//!
//! Errors are `rel = max |got − want| / max |want|` per tap. Bound: 1e-5 on every tap (f32
//! convolutions of ≤ 432 terms, norm statistics in f64, one f32 softmax over ≤ 15 keys).

mod common;

use common::{
    Expected, VaeCases as Cases, channels_last, qwen_image_dir as fixtures,
    qwen_vae_config as config, read, rel,
};
use tessera_backend::cpu::CpuBackend;
use tessera_core::Weights;
use tessera_models::qwen_image::vae::VaeConfig;
use tessera_models::qwen_image::vae_encoder::{self, EncoderTaps, VaeEncoder, from_rgba8};

fn encoder(be: &CpuBackend) -> VaeEncoder<CpuBackend> {
    let w = Weights::open_dir(&fixtures().join("vae"), "diffusion_pytorch_model").unwrap();
    VaeEncoder::load(be, &config(), &w).unwrap()
}

#[test]
fn the_encoder_shapes_follow_the_reference() {
    // base 12, dim_mult [1, 1, 2, 4, 4], temperal_downsample [F, T, T, T]: dims 12, 12, 12,
    // 24, 48, 48; every block but the last halves the image.
    let shapes: Vec<_> = config()
        .down_blocks()
        .iter()
        .map(|b| (b.cin, b.cout, b.down, b.frames))
        .collect();
    assert_eq!(
        shapes,
        [
            (12, 12, true, 1),
            (12, 12, true, 2),
            (12, 24, true, 2),
            (24, 48, true, 2),
            (48, 48, false, 1)
        ]
    );
    assert_eq!(config().encoder_mid_channels(), 48);
}

/// Both images encode to the reference's taps, posterior mean and normalised tokens.
#[test]
fn encodes_like_the_reference() {
    let ex = Expected::load_from(&fixtures().join("vae_encoder_expected.safetensors"));
    let cases: Cases =
        serde_json::from_str(&read(&fixtures().join("vae_encoder_cases.json"))).unwrap();
    assert_eq!(cases.cases.len(), 2);
    let be = CpuBackend::new();
    let vae = encoder(&be);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for c in &cases.cases {
        let [h, w] = c.image_hw;
        let name = format!("{}/rgba8", c.name);
        assert_eq!(ex.shape(&name), [h, w, 4]);
        let rgba: Vec<u8> = ex.get(&name).iter().map(|&v| v as u8).collect();
        let mut taps = EncoderTaps::default();
        let (tokens, hw) = vae
            .encode(&be, &from_rgba8(&rgba), (h, w), Some(&mut taps))
            .unwrap();
        assert_eq!([hw.0, hw.1], c.latent_hw, "{}", c.name);
        let mut names: Vec<_> = taps.values.keys().cloned().collect();
        names.extend(["latent".to_string(), "tokens".to_string()]);
        names.sort();
        let mut want_names = c.taps.clone();
        want_names.sort();
        assert_eq!(names, want_names, "{}: every tap compared", c.name);
        let mut check = |tap: &str, got: &[f32], want: &[f64]| {
            assert_eq!(got.len(), want.len(), "{} {tap}", c.name);
            let err = rel(got, want);
            report.push(format!("{:>10} {tap:>8}: rel {err:.2e}", c.name));
            if err.is_nan() || err > 1e-5 {
                failures.push(format!("{} {tap}: rel {err:.3e} > 1e-5", c.name));
            }
        };
        for (tap, got) in &taps.values {
            check(tap, got, &channels_last(&ex, &format!("{}/{tap}", c.name)));
        }
        check(
            "latent",
            &tokens,
            &channels_last(&ex, &format!("{}/latent", c.name)),
        );
        // `_pack_latents`' tokens are the channels-last latent itself.
        let name = format!("{}/tokens", c.name);
        assert_eq!(ex.shape(&name), [hw.0 * hw.1, 8]);
        check("tokens", &tokens, ex.get(&name));
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn declares_every_op_it_calls() {
    let be = CpuBackend::recording();
    let vae = encoder(&be);
    vae.encode(&be, &[0.25; 32 * 16 * 4], (32, 16), None)
        .unwrap();
    let declared = vae_encoder::ops(vae.config());
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
fn bad_images_are_refused() {
    let be = CpuBackend::new();
    let vae = encoder(&be);
    // A side that is not a multiple of 16, an empty image, and a buffer of the wrong length.
    for (hw, len) in [
        ((24, 16), 24 * 16 * 4),
        ((0, 16), 0),
        ((16, 16), 16 * 16 * 3),
    ] {
        let e = vae
            .encode(&be, &vec![0.0; len], hw, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("image"), "{e}");
    }
}

/// A width the reference's `AvgDown3D` refuses (`in · factor` not a multiple of `out`) is a
/// config error naming the field, before any weight is read.
#[test]
fn an_encoder_width_avg_down_cannot_fold_is_refused() {
    let p = fixtures().join("vae/config.json");
    let mut v: serde_json::Value = serde_json::from_str(&read(&p)).unwrap();
    // Encoder dims 12, 12, 12, 24, 48, 96: the last block (no folding, factor 1) would average
    // 48 channels into 96. The decoder's DupUp shortcuts all fit (64, 64, 32, 16, 8, 8).
    v["dim_mult"] = serde_json::json!([1, 1, 2, 4, 8]);
    let e = VaeConfig::parse(&p, &v.to_string())
        .unwrap_err()
        .to_string();
    for w in ["dim_mult", "AvgDown", "48→96"] {
        assert!(e.contains(w), "{w:?} not in: {e}");
    }
}
