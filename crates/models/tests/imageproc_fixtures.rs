//! Image preprocessing against the reference (`tools/fixtures/egemma2_vision.py`): torchvision's
//! uint8 antialiased bicubic resize byte for byte, the target-size rule at every budget, and the
//! committed images through decode → RGB → resize as transformers 5.25 does them.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_models::imageproc::{
    Image, ImageBudget, PatchSpec, patchify, resize_bicubic_aa, target_size,
};

#[derive(Deserialize)]
struct Fixture {
    patch: usize,
    pool: usize,
    budget: usize,
    resize: Vec<ResizeCase>,
    sizes: Vec<SizeCase>,
    images: Vec<ImageCase>,
    jpeg: Jpeg,
}

#[derive(Deserialize)]
struct Jpeg {
    file: String,
    pillow_decode: String,
}

#[derive(Deserialize)]
struct ResizeCase {
    seed: u64,
    #[serde(rename = "in")]
    input: [usize; 2],
    out: [usize; 2],
    expected: Digest,
}

#[derive(Deserialize)]
struct SizeCase {
    #[serde(rename = "in")]
    input: [usize; 2],
    budget: usize,
    out: Option<[usize; 2]>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct ImageCase {
    file: String,
    decoded: Digest,
    resized: Option<Digest>,
}

#[derive(Deserialize, Debug)]
struct Digest {
    width: usize,
    height: usize,
    fnv1a64: String,
    row_sums: Vec<u64>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> Fixture {
    let path = root().join("tests/fixtures/egemma2/vision_cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("vision_cases.json parses")
}

fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01B3);
    }
    format!("{h:016x}")
}

/// Exact equality, or a message naming the first row that differs.
fn check(img: &Image, want: &Digest, what: &str) -> Result<(), String> {
    if (img.width(), img.height()) != (want.width, want.height) {
        return Err(format!(
            "{what}: {}×{} instead of {}×{}",
            img.width(),
            img.height(),
            want.width,
            want.height
        ));
    }
    if fnv1a64(img.rgb()) == want.fnv1a64 {
        return Ok(());
    }
    let row = img.width() * 3;
    let bad = img
        .rgb()
        .chunks(row)
        .map(|r| r.iter().map(|&v| v as u64).sum::<u64>())
        .zip(&want.row_sums)
        .position(|(a, b)| a != *b);
    Err(format!(
        "{what}: bytes differ from the reference (first differing row sum: {bad:?})"
    ))
}

/// The fixture's seeded noise (see its `noise` field).
fn noise(w: usize, h: usize, seed: u64) -> Image {
    let mut x = seed;
    let mut rgb = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for i in 0..w {
            for _ in 0..3 {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let v = (x >> 56) as u8;
                rgb.push(if (y / 5) % 3 == 0 {
                    if (i / 3) % 2 == 1 { 255 } else { 0 }
                } else {
                    v
                });
            }
        }
    }
    Image::from_rgb8(w, h, rgb).unwrap()
}

#[test]
fn resize_is_byte_exact_against_torchvision() {
    let fx = fixture();
    assert!(fx.resize.len() >= 8);
    let failures: Vec<String> = fx
        .resize
        .iter()
        .filter_map(|c| {
            let img = noise(c.input[0], c.input[1], c.seed);
            let out = resize_bicubic_aa(&img, c.out[0], c.out[1]).unwrap();
            check(&out, &c.expected, &format!("{:?} → {:?}", c.input, c.out)).err()
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn target_sizes_match_the_reference_at_every_budget() {
    let fx = fixture();
    let spec = PatchSpec { patch: 16, pool: 3 };
    for c in &fx.sizes {
        let b = ImageBudget::new(c.budget).unwrap();
        let got = target_size(c.input[0], c.input[1], spec, b);
        match (&c.out, &c.error) {
            (Some(out), None) => assert_eq!(
                got.unwrap(),
                (out[0], out[1]),
                "{:?} @ {}",
                c.input,
                c.budget
            ),
            (None, Some(e)) => assert!(
                got.is_err(),
                "{:?} @ {}: reference says {e}",
                c.input,
                c.budget
            ),
            _ => panic!("malformed size case"),
        }
    }
}

#[test]
fn committed_images_decode_and_resize_as_the_reference() {
    let fx = fixture();
    let spec = PatchSpec {
        patch: fx.patch,
        pool: fx.pool,
    };
    let budget = ImageBudget::new(fx.budget).unwrap();
    let mut failures = Vec::new();
    for c in fx.images.iter().filter(|c| c.file != fx.jpeg.file) {
        let img = Image::open(&root().join("tests/fixtures/egemma2/images").join(&c.file))
            .unwrap_or_else(|e| panic!("{e}"));
        if let Err(e) = check(&img, &c.decoded, &format!("{} decoded", c.file)) {
            failures.push(e);
            continue;
        }
        let Some(want) = &c.resized else { continue };
        let (w, h) = target_size(img.width(), img.height(), spec, budget).unwrap();
        let out = resize_bicubic_aa(&img, w, h).unwrap();
        if let Err(e) = check(&out, want, &format!("{} resized", c.file)) {
            failures.push(e);
        }
        let p = patchify(&out, spec.patch);
        assert_eq!((p.width * spec.patch, p.height * spec.patch), (w, h));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// JPEG is the one format whose decode is not bit-exact: Pillow uses libjpeg-turbo, the `image`
/// crate zune-jpeg, and their IDCT and chroma upsampling round differently. Measured on the
/// fixture photo (4:2:0, quality 90): 26% of values differ, 99.8% of those by 1–2 levels, max 5.
/// This bounds that difference so a decoder regression is caught; the model fixtures use
/// Pillow's decode (saved as PNG) so they test everything after the decoder exactly.
#[test]
fn jpeg_decodes_within_a_few_levels_of_libjpeg_turbo() {
    let fx = fixture();
    let dir = root().join("tests/fixtures/egemma2/images");
    let ours = Image::open(&dir.join(&fx.jpeg.file)).unwrap();
    let pillow = Image::open(&dir.join(&fx.jpeg.pillow_decode)).unwrap();
    assert_eq!(
        (ours.width(), ours.height()),
        (pillow.width(), pillow.height())
    );
    let diffs: Vec<u8> = ours
        .rgb()
        .iter()
        .zip(pillow.rgb())
        .map(|(a, b)| a.abs_diff(*b))
        .collect();
    let max = diffs.iter().copied().max().unwrap_or(0);
    let mean = diffs.iter().map(|&d| d as f64).sum::<f64>() / diffs.len() as f64;
    assert!(max <= 6 && mean < 0.5, "max {max}, mean {mean:.3}");
}
