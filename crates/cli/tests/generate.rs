//! `tessera generate` end to end: the binary as a user runs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

/// `(width, height, RGB bytes, text chunks)` of a PNG.
fn read_png(path: &Path) -> (u32, u32, Vec<u8>, BTreeMap<String, String>) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let text = reader
        .info()
        .utf8_text
        .iter()
        .map(|c| (c.keyword.clone(), c.get_text().unwrap()))
        .collect();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf, text)
}

/// Entries of a folder, to check nothing is left behind.
fn listing(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

#[test]
fn the_bundled_model_writes_a_png_that_records_its_settings() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fox.png");
    let o = tessera(&[
        "--prompt",
        "a red fox in the snow — 雪",
        "--size",
        "64x48",
        "--steps",
        "2",
        "--seed",
        "42",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("random weights"), "{}", stderr(&o));
    let (w, h, pixels, text) = read_png(&out);
    assert_eq!((w, h, pixels.len()), (64, 48, 64 * 48 * 3));
    assert_eq!(text["prompt"], "a red fox in the snow — 雪");
    assert_eq!(
        (
            text["seed"].as_str(),
            text["steps"].as_str(),
            text["size"].as_str()
        ),
        ("42", "2", "64x48")
    );
    assert!(text["model"].contains("random weights"));
    assert_eq!(
        listing(dir.path()),
        vec![out.clone()],
        "no temporary file left"
    );
    // Same seed, same image.
    let again = dir.path().join("again.png");
    let o = tessera(&[
        "--prompt",
        "a red fox in the snow — 雪",
        "--size",
        "64x48",
        "--steps",
        "2",
        "--seed",
        "42",
        "-o",
        again.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    assert_eq!(read_png(&again).2, pixels);
}

/// The reference's Turbo run, fed its own initial latent through `--init-latent`, gives the
/// reference's pixels (the parity test in tessera-models explains the one tie that may differ).
#[test]
fn an_initial_latent_from_diffusers_reproduces_its_image() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bytes = std::fs::read(root.join("tests/fixtures/zimage/expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let latent = st.tensor("e2e/turbo_48x80/init_latent").unwrap();
    assert_eq!(latent.shape(), [16, 6, 10]);
    let want = st.tensor("e2e/turbo_48x80/image_u8").unwrap();

    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("latent.npy");
    let mut header =
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 16, 6, 10), }".to_string();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut file = b"\x93NUMPY\x01\x00".to_vec();
    file.extend((header.len() as u16).to_le_bytes());
    file.extend(header.as_bytes());
    file.extend(latent.data());
    std::fs::write(&npy, file).unwrap();

    let out = dir.path().join("fox.png");
    let o = tessera(&[
        "--prompt",
        "a red fox in the snow",
        "--size",
        "80x48",
        "--init-latent",
        npy.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (w, h, pixels, text) = read_png(&out);
    assert_eq!((w, h), (80, 48));
    assert!(text.contains_key("init_latent") && !text.contains_key("seed"));
    let off: Vec<i32> = pixels
        .iter()
        .zip(want.data())
        .map(|(&a, &b)| a as i32 - b as i32)
        .filter(|d| *d != 0)
        .collect();
    assert!(
        off.len() <= 2 && off.iter().all(|d| d.abs() == 1),
        "differences {off:?}"
    );

    let wrong = tessera(&[
        "--prompt",
        "x",
        "--size",
        "64x64",
        "--init-latent",
        npy.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(
        stderr(&wrong).contains("[1, 16, 8, 8]"),
        "{}",
        stderr(&wrong)
    );
}

/// One `error:` line, a non-zero exit, nothing written.
fn assert_one_line_error(o: &Output, needle: &str) {
    assert!(!o.status.success());
    let err = stderr(o);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains(needle), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_unwritable_output_fails_before_the_model_is_touched() {
    let o = tessera(&["--prompt", "x", "--out", "/nonexistent-folder/x.png"]);
    assert_one_line_error(&o, "/nonexistent-folder");
    // The model (the bundled one announces itself) was never loaded.
    assert!(!stderr(&o).contains("note:"), "{}", stderr(&o));
    let dir = tempfile::tempdir().unwrap();
    let o = tessera(&["--prompt", "x", "--out", dir.path().to_str().unwrap()]);
    assert_one_line_error(&o, "is a folder");
}

#[test]
fn bad_requests_get_one_line_and_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.png");
    let out = out.to_str().unwrap();
    assert_one_line_error(
        &tessera(&["--prompt", "x", "--size", "100x64", "-o", out]),
        "nearest valid size is 96x64",
    );
    assert_one_line_error(
        &tessera(&["--prompt", "x", "--steps", "0", "-o", out]),
        "--steps 0",
    );
    assert_one_line_error(
        &tessera(&["--prompt", "x", "--steps", "100000", "-o", out]),
        "between 1 and 1000",
    );
    assert_one_line_error(
        &tessera(&[
            "--prompt",
            "x",
            "--model",
            dir.path().to_str().unwrap(),
            "-o",
            out,
        ]),
        "not found",
    );
    let npy = dir.path().join("bad.npy");
    std::fs::write(&npy, b"not numpy").unwrap();
    assert_one_line_error(
        &tessera(&[
            "--prompt",
            "x",
            "--init-latent",
            npy.to_str().unwrap(),
            "-o",
            out,
        ]),
        "not a float32 .npy",
    );
    std::fs::remove_file(&npy).unwrap();
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
}
