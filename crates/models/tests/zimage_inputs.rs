//! Z-Image's answers to bad input: each is a clear error (or, for an over-long prompt, the
//! reference's truncation with a warning), raised before any heavy compute.

use std::path::{Path, PathBuf};

use tessera_backend::cpu::CpuBackend;
use tessera_core::Error;
use tessera_models::text_to_image::Request;
use tessera_models::zimage::text::MAX_PROMPT_TOKENS;
use tessera_models::zimage::{self, BUNDLED, ZImage, ZImageFiles};

fn mini() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/zimage-mini")
}

fn bundled() -> ZImage<CpuBackend> {
    ZImage::load(CpuBackend::new(), &BUNDLED, None).expect("bundled model loads")
}

/// A copy of the miniature's folder to break.
fn copy_mini() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in walk(&mini()) {
        let rel = entry.strip_prefix(mini()).unwrap();
        let to = dir.path().join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, to).unwrap();
    }
    dir
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn small(prompt: &str) -> Request {
    Request {
        width: 32,
        height: 48,
        steps: 2,
        ..Request::new(prompt, zimage::DEFAULTS)
    }
}

#[test]
fn a_size_off_the_grid_names_the_nearest_valid_size() {
    let z = bundled();
    let e = z
        .plan(&Request {
            width: 1000,
            height: 500,
            ..Request::new("x", zimage::DEFAULTS)
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("multiples of 16") && e.contains("1008x496"),
        "{e}"
    );
    let e = z
        .plan(&Request {
            width: 0,
            ..small("x")
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("16x48"), "{e}");
    let e = z
        .plan(&Request {
            width: 16_384,
            ..small("x")
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("larger than the model's 8192x8192"), "{e}");
}

#[test]
fn zero_or_absurd_step_counts_are_refused() {
    let z = bundled();
    for steps in [0, 5000] {
        let e = z
            .plan(&Request {
                steps,
                ..small("x")
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("--steps {steps}")) && e.contains("between 1 and 1000"),
            "{e}"
        );
    }
    let e = z
        .plan(&Request {
            guidance: -1.0,
            ..small("x")
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--guidance -1"), "{e}");
    // Absurd scales overflow the guided velocity: refused before any compute.
    for g in [1e30, f32::NAN, f32::INFINITY, 101.0] {
        let e = z
            .plan(&Request {
                guidance: g,
                ..small("x")
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--guidance") && e.contains("up to 100"),
            "{g}: {e}"
        );
    }
    assert!(
        z.plan(&Request {
            guidance: 100.0,
            ..small("x")
        })
        .is_ok()
    );
}

#[test]
fn a_prompt_past_512_tokens_is_truncated_like_the_reference_with_a_warning() {
    let z = bundled();
    let long = "a red fox in the snow, golden hour, highly detailed photograph ".repeat(60);
    let plan = z.plan(&small(&long)).unwrap();
    assert_eq!(plan.prompts[0].ids.len(), MAX_PROMPT_TOKENS);
    assert!(plan.prompts[0].full_len > MAX_PROMPT_TOKENS);
    assert!(
        plan.warnings.iter().any(|w| w.contains("first 512")),
        "{:?}",
        plan.warnings
    );
    // The cut prompt still generates.
    let mut z = z;
    let image = z.generate(&small(&long), &plan, |_| {}).unwrap();
    assert_eq!(image.pixels.len(), 32 * 48 * 3);
}

#[test]
fn a_missing_component_folder_is_named() {
    let dir = copy_mini();
    std::fs::remove_dir_all(dir.path().join("vae")).unwrap();
    let e = ZImageFiles::dir(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("vae") && e.contains("not found") && e.contains("component"),
        "{e}"
    );
    let empty = tempfile::tempdir().unwrap();
    let e = ZImageFiles::dir(empty.path()).unwrap_err().to_string();
    assert!(e.contains("model_index.json"), "{e}");
}

#[test]
fn a_transformer_that_does_not_match_its_config_names_the_tensor() {
    let dir = copy_mini();
    let cfg = dir.path().join("transformer/config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    // dim 96 with 3 heads keeps head_dim 32 = Σ axes_dims, so only the shapes disagree.
    let text = text
        .replace("\"dim\": 64", "\"dim\": 96")
        .replace("\"n_heads\": 2", "\"n_heads\": 3");
    std::fs::write(&cfg, text).unwrap();
    let files = ZImageFiles::dir(dir.path()).unwrap();
    let e = ZImage::load(CpuBackend::new(), &files, None)
        .err()
        .expect("load fails");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("all_x_embedder.2-1.weight") && e.contains("[96, 64]"),
        "{e}"
    );
}

#[test]
fn a_transformer_file_of_another_model_is_refused() {
    let dir = copy_mini();
    let files = ZImageFiles::dir(dir.path()).unwrap();
    let wrong = dir.path().join("vae/diffusion_pytorch_model.safetensors");
    let e = ZImage::load(CpuBackend::new(), &files, Some(&wrong))
        .err()
        .expect("load fails")
        .to_string();
    assert!(
        e.contains("x_embedder.weight") && e.contains("Z-Image transformer"),
        "{e}"
    );
}

#[test]
fn a_wrong_initial_latent_is_refused_before_compute() {
    let z = bundled();
    let e = z
        .plan(&Request {
            init_latent: Some(vec![0.0; 10]),
            ..small("x")
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("16×6×4 = 384"), "{e}");
}

#[test]
fn a_seed_gives_the_same_image_and_another_seed_another() {
    let mut z = bundled();
    let run = |z: &mut ZImage<CpuBackend>, seed| {
        let req = Request {
            seed,
            ..small("a cat")
        };
        let plan = z.plan(&req).unwrap();
        z.generate(&req, &plan, |_| {}).unwrap().pixels
    };
    let a = run(&mut z, 7);
    assert_eq!(a, run(&mut z, 7));
    assert_ne!(a, run(&mut z, 8));
}

/// `num_images` images in one batch are the images of seeds `seed, seed + 1, …` made one at a
/// time (the batch changes only the order of some sums: within one 8-bit level).
#[test]
fn a_batch_of_images_is_the_seeds_one_at_a_time() {
    let mut z = bundled();
    for guidance in [0.0, 2.0] {
        let req = Request {
            seed: 11,
            num_images: 3,
            guidance,
            ..small("three cats")
        };
        let plan = z.plan(&req).unwrap();
        let batch = z.generate_images(&req, &plan, |_| {}).unwrap();
        assert_eq!(batch.len(), 3);
        for (i, image) in batch.iter().enumerate() {
            let one = Request {
                seed: 11 + i as u64,
                num_images: 1,
                ..req.clone()
            };
            let plan = z.plan(&one).unwrap();
            let single = z.generate(&one, &plan, |_| {}).unwrap();
            let worst = single
                .pixels
                .iter()
                .zip(&image.pixels)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap();
            assert!(
                worst <= 1,
                "guidance {guidance}, image {i}: off by {worst} levels"
            );
        }
        assert_ne!(batch[0].pixels, batch[1].pixels);
    }
}

#[test]
fn image_counts_out_of_range_and_a_latent_for_several_are_refused() {
    let z = bundled();
    for n in [0, 17] {
        let e = z
            .plan(&Request {
                num_images: n,
                ..small("x")
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 to 16 images"), "{e}");
    }
    let e = z
        .plan(&Request {
            num_images: 2,
            init_latent: Some(vec![0.0; 384]),
            ..small("x")
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--num-images 1"), "{e}");
}

/// On a device with too little memory left, a request is refused before any compute with the
/// largest size of its shape that fits — and that size then plans.
#[test]
fn a_size_too_large_for_the_device_names_the_largest_that_fits() {
    // The bundled model's 256×256 request takes about 0.7 GB with the fixed workspaces.
    let budget = 700 << 20;
    let z = ZImage::load(CpuBackend::budgeted(budget), &BUNDLED, None).unwrap();
    let big = Request {
        width: 2048,
        height: 1024,
        ..small("a wide view")
    };
    let e = z.plan(&big).unwrap_err().to_string();
    assert!(e.contains("--size 2048x1024 needs about"), "{e}");
    let fits = e
        .split("that fits is ")
        .nth(1)
        .unwrap_or_else(|| panic!("no size named: {e}"));
    let (w, h) = fits.split_once('x').unwrap();
    let (w, h): (usize, usize) = (w.parse().unwrap(), h.trim().parse().unwrap());
    assert!(w < 2048 && w % 16 == 0 && h % 16 == 0 && w == 2 * h, "{e}");
    let ok = Request {
        width: w,
        height: h,
        ..big.clone()
    };
    z.plan(&ok).unwrap();
    // Several images: the message says so and suggests fewer.
    let two = Request {
        num_images: 2,
        ..big.clone()
    };
    let e = z.plan(&two).unwrap_err().to_string();
    assert!(
        e.contains("× 2 images") && e.contains("fewer --num-images"),
        "{e}"
    );
    // Without a budget (the CPU), nothing is refused for memory.
    bundled().plan(&big).unwrap();
}
