//! `tessera generate`'s familiar flags: short names, `--cfg-scale`, the format from `--out`'s
//! extension, a random seed that is printed and reproduces, and the summary line.

use std::path::Path;
use std::process::{Command, Output};

fn generate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("generate")
        .args(["--size", "32x32", "--steps", "2"])
        .args(args)
        .env_remove("TESSERA_MODEL")
        .env("TESSERA_DEVICE", "cpu")
        .output()
        .expect("tessera runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn rgb(path: &Path) -> image::RgbImage {
    image::open(path).unwrap().to_rgb8()
}

#[test]
fn the_format_follows_the_extension() {
    let dir = tempfile::tempdir().unwrap();
    for (name, magic, format) in [
        ("a.png", &b"\x89PNG"[..], image::ImageFormat::Png),
        ("a.jpg", &b"\xff\xd8\xff"[..], image::ImageFormat::Jpeg),
        ("a.JPEG", &b"\xff\xd8\xff"[..], image::ImageFormat::Jpeg),
        ("a.webp", &b"RIFF"[..], image::ImageFormat::WebP),
    ] {
        let out = dir.path().join(name);
        let o = generate(&["-p", "x", "--seed", "1", "-o", out.to_str().unwrap()]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let bytes = std::fs::read(&out).unwrap();
        assert!(bytes.starts_with(magic), "{name} is not that format");
        assert_eq!(image::guess_format(&bytes).unwrap(), format, "{name}");
        assert_eq!(rgb(&out).dimensions(), (32, 32), "{name}");
    }
    // Lossless WebP holds the PNG's pixels exactly.
    assert_eq!(
        rgb(&dir.path().join("a.webp")),
        rgb(&dir.path().join("a.png"))
    );
}

#[test]
fn an_unknown_extension_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("a.gif");
    let o = generate(&["-p", "x", "-o", out.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(".gif") && err.contains(".png, .jpg"), "{err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "nothing ran first: {err}"
    );
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
}

/// The seed the summary line names.
fn seed_said(err: &str) -> u64 {
    let after = err.split(", seed ").nth(1).expect(err);
    after[..after.find(')').unwrap()].parse().expect(err)
}

fn png_seed(path: &Path) -> String {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let reader = png::Decoder::new(file).read_info().unwrap();
    let chunk = reader.info().utf8_text.iter().find(|c| c.keyword == "seed");
    chunk.expect("a seed chunk").get_text().unwrap()
}

#[test]
fn without_seed_one_is_drawn_printed_recorded_and_reproduces() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a.png"),
        dir.path().join("b.png"),
        dir.path().join("c.png"),
    );
    let o = generate(&["--prompt", "x", "--out", a.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let seed = seed_said(&err);
    assert!(err.contains(&format!("--seed {seed}")), "{err}");
    assert_eq!(png_seed(&a), seed.to_string());
    // Two draws differ (2^-32 chance of a false failure).
    let o = generate(&["--prompt", "x", "--out", b.to_str().unwrap()]);
    assert_ne!(seed_said(&stderr(&o)), seed, "{}", stderr(&o));
    // The printed seed makes the same image; the summary names size, steps, time and file.
    let s = seed.to_string();
    let o = generate(&["--prompt", "x", "--seed", &s, "--out", c.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(rgb(&c), rgb(&a));
    let summary = err.lines().find(|l| l.starts_with("wrote ")).expect(&err);
    for needle in [c.to_str().unwrap(), "32x32", "2 steps", " s ", "decode"] {
        assert!(summary.contains(needle), "{needle:?} not in {summary:?}");
    }
    assert!(!err.contains("drawn at random"), "{err}");
}

#[test]
fn short_flags_and_cfg_scale_are_the_long_ones() {
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("long.png");
    let short = dir.path().join("short.png");
    let o = generate(&[
        "--model",
        "bundled:zimage",
        "--prompt",
        "x",
        "--guidance",
        "3",
        "--num-images",
        "2",
        "--seed",
        "5",
        "--out",
        long.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = generate(&[
        "-m",
        "bundled:zimage",
        "-p",
        "x",
        "--cfg-scale",
        "3",
        "-n",
        "2",
        "--seed",
        "5",
        "-o",
        short.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for i in 0..2 {
        let name = |stem: &str| dir.path().join(format!("{stem}-{i}.png"));
        assert_eq!(rgb(&name("short")), rgb(&name("long")), "image {i}");
    }
    // Guidance made a difference, so the alias was not ignored.
    let unguided = dir.path().join("unguided.png");
    let o = generate(&["-p", "x", "--seed", "5", "-o", unguided.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(rgb(&unguided), rgb(&dir.path().join("long-0.png")));
}

#[test]
fn an_empty_prompt_is_accepted_as_in_diffusers() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["bundled:zimage", "bundled:qwen-image"] {
        let out = dir.path().join("empty.png");
        let o = generate(&[
            "-m",
            model,
            "-p",
            "",
            "--seed",
            "3",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        assert_eq!(rgb(&out).dimensions(), (32, 32));
    }
}

/// `--offload` loads each component for its stage only: the same image as with every component
/// resident (under guidance too), and the summary line says so. The server keeps its models
/// resident and takes no such flag.
#[test]
fn offload_makes_the_same_image_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    for (model, guidance) in [("bundled:zimage", "2"), ("bundled:qwen-image", "4")] {
        let run = |name: &str, extra: &[&str]| {
            let out = dir.path().join(name);
            let mut args = vec![
                "-m",
                model,
                "-p",
                "a fox",
                "--negative-prompt",
                "blurry",
                "--guidance",
                guidance,
                "--seed",
                "9",
                "-o",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            let o = generate(&args);
            let err = stderr(&o);
            assert!(o.status.success(), "{model} {extra:?}: {err}");
            let summary = err.lines().find(|l| l.starts_with("wrote ")).expect(&err);
            (image::open(&out).unwrap().to_rgba8(), summary.to_string())
        };
        let (resident, said) = run("resident.png", &[]);
        assert!(!said.contains("--offload"), "{said}");
        let (offloaded, said) = run("offloaded.png", &["--offload"]);
        assert!(said.contains("--offload"), "{said}");
        assert!(
            offloaded == resident,
            "{model}: --offload changed the image"
        );
    }
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--help"])
        .output()
        .expect("tessera runs");
    assert!(o.status.success());
    assert!(!String::from_utf8_lossy(&o.stdout).contains("--offload"));
}
