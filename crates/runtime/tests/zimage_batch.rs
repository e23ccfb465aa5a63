//! Z-Image behind `GenerateImage` as a server drives it: different requests batched through the
//! same forwards give the bytes each gives alone; a request stopped by its progress callback
//! ends with `Error::Cancelled` and leaves the rest of its batch as they would be; the preview
//! map is fitted to the model's decoder.

use std::ops::ControlFlow;

use tessera_backend::AnyBackend;
use tessera_backend::cpu::CpuBackend;
use tessera_core::Error;
use tessera_models::text_to_image::{Event, Image, Request};
use tessera_models::zimage::{self, BUNDLED};
use tessera_runtime::image::{self, GenerateImage};

/// The bundled miniature on a CPU backend (whose products do not depend on the row count).
fn model() -> Box<dyn GenerateImage> {
    let cpu = CpuBackend::new();
    image::load(AnyBackend::Cpu(cpu), &BUNDLED, None).unwrap()
}

fn req(prompt: &str, seed: u64, n: usize) -> Request {
    Request {
        width: 64,
        height: 48,
        steps: 4,
        seed,
        num_images: n,
        ..Request::new(prompt, zimage::DEFAULTS)
    }
}

fn alone(m: &mut dyn GenerateImage, r: &Request) -> Vec<Image> {
    m.generate(r, &mut |_| ControlFlow::Continue(())).unwrap()
}

/// Three requests — different prompts, seeds, image counts, one under guidance with a negative
/// prompt — and one of another size: the batch gives each request exactly its images alone.
#[test]
fn a_batch_of_different_requests_gives_each_its_own_images() {
    let mut m = model();
    let reqs = vec![
        req("a red fox in the snow", 3, 1),
        req("two cats asleep on a sofa, oil painting", 9, 2),
        Request {
            guidance: 2.5,
            negative_prompt: Some("blurry".into()),
            ..req("a lighthouse", 1, 1)
        },
        Request {
            width: 32,
            ..req("another size", 5, 1)
        },
    ];
    let mut steps = vec![0usize; reqs.len()];
    let batch = m.generate_batch(&reqs, &mut |i, e| {
        if let Event::Step { .. } = e {
            steps[i] += 1;
        }
        ControlFlow::Continue(())
    });
    assert_eq!(steps, vec![4; 4]);
    for (i, (r, got)) in reqs.iter().zip(batch).enumerate() {
        let got = got.unwrap();
        let want = alone(m.as_mut(), r);
        assert_eq!(got.len(), r.num_images);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((g.width, g.height), (r.width, r.height));
            assert!(
                g.pixels == w.pixels,
                "request {i}, image {k}: batched differs from alone"
            );
        }
    }
    // The images differ between requests and seeds (the comparison above is not vacuous).
    let a = alone(m.as_mut(), &reqs[0]);
    let b = alone(m.as_mut(), &req("a red fox in the snow", 4, 1));
    assert_ne!(a[0].pixels, b[0].pixels);
}

/// `Break` from request 0's callback after its second step: it ends cancelled there, and the
/// request batched with it (prepared again without it) still gets exactly its images alone.
#[test]
fn a_cancelled_request_leaves_its_batch_as_it_would_be() {
    let mut m = model();
    let reqs = vec![req("stop me", 2, 1), req("keep going", 7, 2)];
    let mut seen = [Vec::new(), Vec::new()];
    let results = m.generate_batch(&reqs, &mut |i, e| match e {
        Event::Step { index, .. } => {
            seen[i].push(index);
            if i == 0 && index == 1 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        }
        _ => ControlFlow::Continue(()),
    });
    assert_eq!(seen[0], vec![0, 1]);
    assert_eq!(seen[1], vec![0, 1, 2, 3]);
    let mut results = results.into_iter();
    match results.next().unwrap() {
        Err(Error::Cancelled(at)) => assert!(at.contains("step 2 of 4"), "{at}"),
        other => panic!("expected a cancellation, got {other:?}"),
    }
    let kept = results.next().unwrap().unwrap();
    let want = alone(m.as_mut(), &reqs[1]);
    assert!(kept == want, "the remaining request's images changed");

    // One request alone, stopped before its first step.
    let e = m
        .generate(&reqs[0], &mut |e| match e {
            Event::Encoded => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        })
        .unwrap_err();
    assert!(matches!(e, Error::Cancelled(_)), "{e}");
}

/// A request the model refuses fails alone; the others of the batch run.
#[test]
fn a_bad_request_in_a_batch_fails_alone() {
    let mut m = model();
    let reqs = vec![
        req("fine", 1, 1),
        Request {
            width: 50,
            ..req("off the grid", 1, 1)
        },
    ];
    let mut results = m
        .generate_batch(&reqs, &mut |_, _| ControlFlow::Continue(()))
        .into_iter();
    assert_eq!(results.next().unwrap().unwrap().len(), 1);
    let e = results.next().unwrap().unwrap_err().to_string();
    assert!(e.contains("multiples of 16"), "{e}");
}

/// The checker shared with other threads refuses what `check` refuses and accepts the rest.
#[test]
fn the_shared_checker_agrees_with_check() {
    let m = model();
    let checker = m.checker().expect("Z-Image has a checker");
    let good = req("a fox", 0, 2);
    assert_eq!(checker(&good).unwrap(), m.check(&good).unwrap());
    for bad in [
        Request {
            height: 40,
            ..req("x", 0, 1)
        },
        Request {
            steps: 0,
            ..req("x", 0, 1)
        },
        Request {
            guidance: f32::NAN,
            ..req("x", 0, 1)
        },
    ] {
        let (a, b) = (checker(&bad).unwrap_err(), m.check(&bad).unwrap_err());
        assert_eq!(a.to_string(), b.to_string());
    }
}

/// The preview map is a least-squares fit to the model's own decoder: applied to a request's
/// final latent it tracks the decoded image (averaged over each latent pixel's 8×8 block) more
/// closely than the image's mean colour does.
#[test]
fn the_preview_map_tracks_the_decoded_image() {
    let mut m = model();
    let p = m.preview().unwrap().expect("Z-Image has a preview map");
    assert_eq!((p.channels, p.outputs), (16, 3));
    assert!(p.r2 > 0.0 && p.r2 <= 1.0, "{}", p.r2);
    let r = Request {
        width: 128,
        height: 128,
        ..req("a fox", 11, 1)
    };
    let mut last = Vec::new();
    let image = m
        .generate(&r, &mut |e| {
            if let Event::Step { latents, .. } = e {
                last = latents[0].clone();
            }
            ControlFlow::Continue(())
        })
        .unwrap()
        .remove(0);
    let preview = p.image(&last, r.width, r.height).unwrap();
    assert_eq!(
        (preview.width, preview.height, preview.channels),
        (16, 16, 3)
    );
    // The image averaged over each 8×8 block, the preview's resolution.
    let mut blocks = vec![0f64; 16 * 16 * 3];
    for y in 0..128 {
        for x in 0..128 {
            for c in 0..3 {
                blocks[((y / 8) * 16 + x / 8) * 3 + c] +=
                    image.pixels[(y * 128 + x) * 3 + c] as f64 / 64.0;
            }
        }
    }
    let mean: Vec<f64> = (0..3)
        .map(|c| blocks.iter().skip(c).step_by(3).sum::<f64>() / 256.0)
        .collect();
    let err = |pred: &dyn Fn(usize) -> f64| -> f64 {
        blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (b - pred(i)).powi(2))
            .sum::<f64>()
    };
    let by_preview = err(&|i| preview.pixels[i] as f64);
    let by_mean = err(&|i| mean[i % 3]);
    eprintln!(
        "preview fit R² {:.3}; squared error: preview {by_preview:.0}, mean colour {by_mean:.0}",
        p.r2
    );
    assert!(by_preview < by_mean, "{by_preview} ≥ {by_mean}");
}
