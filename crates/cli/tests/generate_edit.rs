//! `tessera generate --image`: editing condition images with the bundled Qwen-Image-2.1, end to
//! end through the binary, against the reference's edit fixture
//! (`tools/fixtures/qwen_image_edit.py`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::read_png_as;

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("generate")
        .args(args)
        .output()
        .expect("tessera runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_image")
}

fn condition(name: &str) -> String {
    fixtures()
        .join(format!("condition/{name}.png"))
        .to_str()
        .unwrap()
        .to_string()
}

/// A float32 .npy of `values` with `shape`.
fn write_npy(path: &Path, shape: &[usize], values: &[f32]) {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}",
        dims.join(", ")
    );
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut file = b"\x93NUMPY\x01\x00".to_vec();
    file.extend((header.len() as u16).to_le_bytes());
    file.extend(header.as_bytes());
    for v in values {
        file.extend(v.to_le_bytes());
    }
    std::fs::write(path, file).unwrap();
}

/// The reference's one-image edit, given its initial latent, comes out of the binary: the
/// output size taken from the condition image, the pixels within one level.
#[test]
fn an_edit_of_one_image_reproduces_the_reference() {
    let bytes = std::fs::read(fixtures().join("edit/expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let latent = st.tensor("one/latents").unwrap();
    assert_eq!(latent.shape(), [40, 8]);
    let values: Vec<f32> = latent
        .data()
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
        .collect();
    let want = st.tensor("one/image").unwrap();
    assert_eq!(want.shape(), [160, 64, 4]);

    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("latent.npy");
    write_npy(&npy, &[1, 40, 8], &values);
    let out = dir.path().join("edit.png");
    let image = condition("tall_37x100");
    let o = tessera(&[
        "--model",
        "bundled:qwen-image",
        "--image",
        &image,
        "--output-resolution",
        "96",
        "--prompt",
        "make the fox blue",
        "--steps",
        "3",
        "--init-latent",
        npy.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (w, h, pixels, text) = read_png_as(&out, png::ColorType::Rgba);
    assert_eq!(
        (w, h),
        (64, 160),
        "the output size is the condition image's"
    );
    assert!(text.get("images") == Some(&image), "{text:?}");
    let off: Vec<i32> = pixels
        .iter()
        .zip(want.data())
        .map(|(&a, &b)| a as i32 - b as i32)
        .filter(|d| *d != 0)
        .collect();
    assert!(
        off.len() <= 8 && off.iter().all(|d| d.abs() == 1),
        "differences {off:?}"
    );
}

/// One `error:` line naming `needle`, a non-zero exit, no panic.
fn assert_one_line_error(o: &Output, needle: &str) {
    assert!(!o.status.success());
    let err = stderr(o);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains(needle), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_edits_get_one_line_before_the_model_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.png");
    let out = out.to_str().unwrap();
    let image = condition("square_64x64");
    // Eleven images: the flag is named, nothing is loaded.
    let mut args = vec!["--model", "bundled:qwen-image", "--prompt", "x", "-o", out];
    for _ in 0..11 {
        args.extend(["--image", image.as_str()]);
    }
    let o = tessera(&args);
    assert_one_line_error(&o, "--image given 11 times");
    assert!(!stderr(&o).contains("note:"), "{}", stderr(&o));
    // Not an image, and a missing file.
    let junk = dir.path().join("junk.png");
    std::fs::write(&junk, b"not an image at all").unwrap();
    let o = tessera(&[
        "--model",
        "bundled:qwen-image",
        "--image",
        junk.to_str().unwrap(),
        "--prompt",
        "x",
        "-o",
        out,
    ]);
    assert_one_line_error(&o, "--image");
    assert!(stderr(&o).contains("junk.png"), "{}", stderr(&o));
    std::fs::remove_file(&junk).unwrap();
    // A model that cannot edit (the bundled Z-Image) is refused, naming what can.
    let o = tessera(&["--image", &image, "--prompt", "x", "-o", out]);
    assert_one_line_error(&o, "Qwen-Image-2.1");
    assert!(stderr(&o).contains("text only"), "{}", stderr(&o));
    // A condition copy too small for the text encoder's image range.
    let o = tessera(&[
        "--model",
        "bundled:qwen-image",
        "--image",
        &image,
        "--output-resolution",
        "32",
        "--prompt",
        "x",
        "--steps",
        "2",
        "-o",
        out,
    ]);
    assert_one_line_error(&o, "condition image 1");
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing is left behind"
    );
}
