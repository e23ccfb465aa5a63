//! `Residency::Sequential` (`--offload`) on the bundled miniatures: every component loaded for
//! its stage only makes the same image, bit for bit, as the resident pipeline (text-to-image
//! for both families, with and without guidance, and a Qwen-Image-2.1 edit), and leaves no
//! component on the device after a request.

use tessera_backend::cpu::CpuBackend;
use tessera_models::Residency;
use tessera_models::imageproc::pil::Rgba8;
use tessera_models::qwen_image::{self, QwenImage};
use tessera_models::text_to_image::{Edit, Image, Request};
use tessera_models::zimage::{self, ZImage};

fn zimage(residency: Residency) -> ZImage<CpuBackend> {
    ZImage::load_as(CpuBackend::new(), &zimage::BUNDLED, None, residency).unwrap()
}

fn qwen(residency: Residency) -> QwenImage<CpuBackend> {
    QwenImage::load_as(CpuBackend::new(), &qwen_image::BUNDLED, None, residency).unwrap()
}

fn zimage_images(m: &mut ZImage<CpuBackend>, req: &Request) -> Vec<Image> {
    let plan = m.plan(req).unwrap();
    m.generate_images(req, &plan, |_| {}).unwrap()
}

fn qwen_images(m: &mut QwenImage<CpuBackend>, req: &Request) -> Vec<Image> {
    let plan = m.plan(req).unwrap();
    m.generate_images(req, &plan, |_| {}).unwrap()
}

fn assert_same(got: &[Image], want: &[Image], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: image count");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            (g.width, g.height),
            (w.width, w.height),
            "{what}: image {k}"
        );
        assert!(g.pixels == w.pixels, "{what}: image {k} differs");
    }
}

/// A condition image with structure in both directions and in alpha.
fn condition(w: usize, h: usize) -> Rgba8 {
    let pixels = (0..w * h)
        .flat_map(|i| {
            let (x, y) = (i % w, i / w);
            [
                (x * 255 / w) as u8,
                (y * 255 / h) as u8,
                ((x * y) % 256) as u8,
                if (x / 8 + y / 8) % 2 == 0 { 255 } else { 128 },
            ]
        })
        .collect();
    Rgba8::new(w, h, pixels).unwrap()
}

#[test]
fn resident_keeps_every_component_and_sequential_none() {
    let z = zimage(Residency::Resident);
    assert_eq!(z.resident_components().len(), 3);
    assert!(z.transformer().is_ok() && z.vae().is_ok());
    let z = zimage(Residency::Sequential);
    assert!(z.resident_components().is_empty());
    assert!(z.transformer().is_err());

    let q = qwen(Residency::Resident);
    // Text encoder, transformer, VAE decoder and the editing parts.
    assert_eq!(q.resident_components().len(), 4);
    let q = qwen(Residency::Sequential);
    assert!(q.resident_components().is_empty());
    // What `load` checks up front still holds: the editor's availability is known before any
    // of its weights load.
    q.can_edit().unwrap();
}

#[test]
fn zimage_sequential_makes_the_resident_images() {
    let mut resident = zimage(Residency::Resident);
    let mut sequential = zimage(Residency::Sequential);
    let plain = Request {
        width: 64,
        height: 48,
        steps: 3,
        seed: 7,
        num_images: 2,
        ..Request::new("a red fox in the snow", zimage::DEFAULTS)
    };
    let guided = Request {
        guidance: 2.5,
        negative_prompt: Some("blurry".into()),
        num_images: 1,
        ..plain.clone()
    };
    let mut made = Vec::new();
    for (req, what) in [(&plain, "unguided"), (&guided, "guided")] {
        let want = zimage_images(&mut resident, req);
        let got = zimage_images(&mut sequential, req);
        assert_same(&got, &want, what);
        assert!(
            sequential.resident_components().is_empty(),
            "{what}: {:?} stayed loaded",
            sequential.resident_components()
        );
        assert_eq!(resident.resident_components().len(), 3);
        made.push(got);
    }
    // Guidance changed the image: the guided comparison is not the unguided one again.
    assert_ne!(made[0][0].pixels, made[1][0].pixels);
    // The text encoder alone, as a parity test drives it: loaded and dropped again.
    let plan = sequential.plan(&plain).unwrap();
    let caps = sequential.caption_features(&plan.prompts).unwrap();
    assert_eq!(caps, resident.caption_features(&plan.prompts).unwrap());
    assert!(sequential.resident_components().is_empty());
}

#[test]
fn qwen_image_sequential_makes_the_resident_images() {
    let mut resident = qwen(Residency::Resident);
    let mut sequential = qwen(Residency::Sequential);
    let plain = Request {
        width: 64,
        height: 64,
        steps: 3,
        seed: 11,
        ..Request::new("a lighthouse at dusk", qwen_image::DEFAULTS)
    };
    let guided = Request {
        guidance: 4.0,
        negative_prompt: Some("blurry, low quality".into()),
        ..plain.clone()
    };
    let mut made = Vec::new();
    for (req, what) in [(&plain, "unguided"), (&guided, "true CFG")] {
        let want = qwen_images(&mut resident, req);
        let got = qwen_images(&mut sequential, req);
        assert_same(&got, &want, what);
        assert!(
            sequential.resident_components().is_empty(),
            "{what}: {:?} stayed loaded",
            sequential.resident_components()
        );
        made.push(got);
    }
    assert_ne!(made[0][0].pixels, made[1][0].pixels);
}

#[test]
fn qwen_image_sequential_edits_as_the_resident_model() {
    let mut resident = qwen(Residency::Resident);
    let mut sequential = qwen(Residency::Sequential);
    let edit = Edit {
        images: vec![condition(45, 77), condition(100, 37)].into(),
        output_resolution: 96,
    };
    let (width, height) = sequential.edit_size(&edit).unwrap();
    let req = Request {
        width,
        height,
        steps: 2,
        seed: 3,
        guidance: 4.0,
        negative_prompt: Some("blurry".into()),
        edit: Some(edit),
        ..Request::new("make the sky green", qwen_image::DEFAULTS)
    };
    let want = qwen_images(&mut resident, &req);
    let got = qwen_images(&mut sequential, &req);
    assert_same(&got, &want, "edit");
    assert!(
        sequential.resident_components().is_empty(),
        "{:?} stayed loaded",
        sequential.resident_components()
    );
    assert_eq!(resident.resident_components().len(), 4);
    // Twice: what was dropped loads again and makes the same image.
    let again = qwen_images(&mut sequential, &req);
    assert_same(&again, &want, "edit, second run");
}
