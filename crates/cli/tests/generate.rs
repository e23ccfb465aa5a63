//! `tessera generate` end to end: the binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::read_png;

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

// ---- bad input found by throwing it at the CLI (issue 19) ---------------------------------

fn bundled_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/assets/zimage-mini")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Set every value of every tensor in a safetensors file to NaN (all bits set).
fn poison(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let nan: &'static [u8] = Box::leak(vec![0xff; t.data().len()].into_boxed_slice());
            let view =
                safetensors::tensor::TensorView::new(t.dtype(), t.shape().to_vec(), nan).unwrap();
            (name, view)
        })
        .collect();
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

#[test]
fn nan_weights_fail_naming_the_stage_instead_of_writing_a_black_png() {
    for (file, stage) in [
        ("text_encoder/model.safetensors", "text encoder features"),
        (
            "transformer/diffusion_pytorch_model.safetensors",
            "denoising step 1 of 2: transformer velocity",
        ),
        (
            "vae/diffusion_pytorch_model.safetensors",
            "VAE decoder output",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        copy_dir(&bundled_dir(), &model);
        poison(&model.join(file));
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let png = out.join("x.png");
        let o = tessera(&[
            "--prompt",
            "x",
            "--size",
            "32x32",
            "--steps",
            "2",
            "--model",
            model.to_str().unwrap(),
            "-o",
            png.to_str().unwrap(),
        ]);
        assert_one_line_error(&o, stage);
        assert!(stderr(&o).contains("not finite"), "{}", stderr(&o));
        assert!(listing(&out).is_empty(), "{file}: {:?}", listing(&out));
    }
}

#[test]
fn absurd_guidance_is_refused_as_the_flag_is_parsed() {
    for g in ["1e30", "NaN", "inf", "-2"] {
        let o = tessera(&["--prompt", "x", &format!("--guidance={g}")]);
        assert_eq!(o.status.code(), Some(2), "{g}: {}", stderr(&o));
        assert!(stderr(&o).contains("--guidance"), "{g}: {}", stderr(&o));
    }
}

/// The quickest generation: 32×32, one step, to `out`.
fn small_run(out: &Path) -> Output {
    tessera(&[
        "--prompt",
        "x",
        "--size",
        "32x32",
        "--steps",
        "1",
        "-o",
        out.to_str().unwrap(),
    ])
}

#[test]
fn out_to_a_fifo_or_through_a_symlink_keeps_what_is_there() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let run = small_run;
    // A FIFO: written through to its reader, and still a FIFO afterwards.
    let fifo = dir.path().join("pipe.png");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let o = run(&fifo);
    assert!(o.status.success(), "{}", stderr(&o));
    // Checked first: a replaced FIFO never gets a writer, and its reader would wait forever.
    let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
    assert!(kind.is_fifo(), "the FIFO was replaced: {kind:?}");
    assert!(reader.join().unwrap().starts_with(b"\x89PNG\r\n\x1a\n"));
    // A symbolic link: the file it points to gets the image, the link stays a link.
    let real = dir.path().join("real.png");
    std::fs::write(&real, b"old").unwrap();
    let link = dir.path().join("link.png");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let o = run(&link);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(read_png(&real).0, 32);
    // A link to nothing: a clear error, and nothing created.
    let dangling = dir.path().join("dangling.png");
    std::os::unix::fs::symlink(dir.path().join("missing.png"), &dangling).unwrap();
    assert_one_line_error(&run(&dangling), "symbolic link");
    assert!(!dir.path().join("missing.png").exists());
    let mut names: Vec<_> = listing(dir.path());
    names.sort();
    assert_eq!(names, vec![dangling, link, fifo, real]);
}

/// Temporary files of ours in `dir`.
fn parts(dir: &Path) -> Vec<PathBuf> {
    listing(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".png.part"))
        .collect()
}

#[test]
fn sigint_and_sigterm_remove_the_temporary_file() {
    for (signal, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("big.png");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["generate", "--prompt", "x", "--size", "2048x2048"])
            .args(["--steps", "50", "-o", out.to_str().unwrap()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while parts(dir.path()).is_empty() {
            assert!(started.elapsed().as_secs() < 30, "no temporary file");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // SAFETY: sending a signal to our own child, which has not been waited for.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(code), "{status:?}");
        assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
    }
}

#[test]
fn leftovers_of_a_killed_run_are_removed_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let make = |name: &str, age: Option<std::time::SystemTime>| {
        let p = d.join(name);
        let f = std::fs::File::create(&p).unwrap();
        if let Some(t) = age {
            f.set_modified(t).unwrap();
        }
        p
    };
    // What a SIGKILLed run leaves: our pattern, an hour old, nobody holding its lock.
    let abandoned = make(".tessera-Ab3dE9.png.part", Some(old));
    // Kept: a name that is not exactly ours, one too young to judge, one a live run holds.
    let other = make(".tessera-notes.png.part", Some(old));
    let young = make(".tessera-Yy1234.png.part", None);
    let held = make(".tessera-Hh5678.png.part", Some(old));
    let lock = std::fs::File::open(&held).unwrap();
    lock.try_lock().unwrap();
    // A link with our name is not a file of ours to remove.
    let link = d.join(".tessera-Ln0000.png.part");
    std::os::unix::fs::symlink(&other, &link).unwrap();

    let out = d.join("x.png");
    let o = small_run(&out);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("left by an interrupted run"),
        "{}",
        stderr(&o)
    );
    let mut left = listing(d);
    left.sort();
    let mut want = vec![other, young, held, link, out];
    want.sort();
    assert_eq!(left, want);
    assert!(!abandoned.exists());
    drop(lock);
}
