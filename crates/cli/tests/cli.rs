//! The `tessera` binary end to end: fixture reproduction and every bad input the issue lists.
//! Each bad input must give exactly one line on stderr, a non-zero exit and no panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::embedding_lines;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn mini() -> PathBuf {
    root().join("crates/models/assets/egemma2-mini")
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .env_remove("TESSERA_MODEL")
        // Bad-input tests check for exactly one stderr line; `auto` would add its device note
        // on machines without CUDA (that note has its own test).
        .env("TESSERA_DEVICE", "cpu")
        .env("HF_HUB_CACHE", root().join("target/no-hf-cache"))
        // Never the network: a repo id not cached gives the not-cached error (`pull.rs` tests
        // the download against a fake hub).
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("runs")
}

/// Exit non-zero with exactly one stderr line containing every `needle`.
fn assert_fails_with(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected, got: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
}

/// A copy of the miniature model to damage.
fn copy_mini() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(mini()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    dir
}

#[derive(serde::Deserialize)]
struct Fixture {
    models: std::collections::BTreeMap<String, String>,
    cases: Vec<Case>,
}
#[derive(serde::Deserialize)]
struct Case {
    name: String,
    texts: Vec<String>,
    prompt_name: Option<String>,
    dim: Option<usize>,
    expected: std::collections::BTreeMap<String, Vec<Vec<f64>>>,
}

#[test]
fn embed_reproduces_the_fixture_vectors_from_a_model_folder() {
    let fx: Fixture = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/egemma2/cases.json")).unwrap(),
    )
    .unwrap();
    for name in [
        "sentence",
        "prompt_query",
        "matryoshka_16",
        "packed_mixed_lengths",
    ] {
        let c = fx.cases.iter().find(|c| c.name == name).unwrap();
        for (model, dir) in &fx.models {
            let dir = root().join(dir);
            let mut args = vec!["embed", "--model", dir.to_str().unwrap()];
            for t in &c.texts {
                args.extend(["--text", t]);
            }
            let dim = c.dim.map(|d| d.to_string());
            if let Some(d) = &dim {
                args.extend(["--dim", d]);
            }
            if let Some(p) = &c.prompt_name {
                args.extend(["--prompt-name", p]);
            }
            let out = tessera(&args);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_eq!(lines.len(), c.texts.len());
            for (line, want) in lines.iter().zip(&c.expected[model]) {
                let got: Vec<f64> = line["embedding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                let d = got
                    .iter()
                    .zip(want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0.0, f64::max);
                assert_eq!(got.len(), want.len());
                assert!(d <= 1e-5, "{model}/{name}: {d:e}");
            }
        }
    }
}

#[test]
fn bundled_model_runs_without_model_and_says_so() {
    let out = tessera(&["embed", "--text", "hello"]);
    assert!(out.status.success());
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(line["model"].as_str().unwrap().contains("random weights"));
    assert_eq!(line["embedding"].as_array().unwrap().len(), 48);
    assert!(String::from_utf8_lossy(&out.stderr).contains("bundled"));
}

#[test]
fn npy_output_and_text_file_input() {
    let dir = tempfile::tempdir().unwrap();
    let texts = dir.path().join("in.jsonl");
    std::fs::write(&texts, "\"alpha\"\n{\"text\": \"beta gamma\"}\n").unwrap();
    let npy = dir.path().join("out.npy");
    let out = tessera(&[
        "embed",
        "--text-file",
        texts.to_str().unwrap(),
        "--format",
        "npy",
        "--dim",
        "16",
        "-o",
        npy.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&npy).unwrap();
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert!(
        std::str::from_utf8(&bytes[10..10 + hlen])
            .unwrap()
            .contains("(2, 16)")
    );
    assert_eq!(bytes.len() - 10 - hlen, 2 * 16 * 4);
}

#[test]
fn missing_model_dir() {
    assert_fails_with(
        &tessera(&["embed", "--model", "/no/such/model", "--text", "x"]),
        &["/no/such/model", "no such folder"],
    );
}

#[test]
fn repo_id_not_in_cache_says_where_it_looked() {
    assert_fails_with(
        &tessera(&["embed", "--model", "google/embeddinggemma-2", "--text", "x"]),
        &[
            "models--google--embeddinggemma-2",
            "HF_HUB_OFFLINE",
            "tessera pull google/embeddinggemma-2",
        ],
    );
}

#[test]
fn empty_model_dir() {
    let dir = tempfile::tempdir().unwrap();
    assert_fails_with(
        &tessera(&[
            "embed",
            "--model",
            dir.path().to_str().unwrap(),
            "--text",
            "x",
        ]),
        &["is empty"],
    );
}

#[test]
fn config_without_needed_fields() {
    let dir = copy_mini();
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("hidden_size");
    std::fs::write(&path, cfg.to_string()).unwrap();
    assert_fails_with(
        &tessera(&[
            "embed",
            "--model",
            dir.path().to_str().unwrap(),
            "--text",
            "x",
        ]),
        &["config.json", "hidden_size"],
    );
}

/// Rewrite tensor `name` of a model copy's `model.safetensors` as `edit` makes it from its
/// shape and bytes.
fn rewrite_tensor(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&[usize], &[u8]) -> (Vec<usize>, Vec<u8>),
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let idx = tensors.iter().position(|(n, _)| n == name).unwrap();
    let t = &tensors[idx].1;
    let (shape, data) = edit(t.shape(), t.data());
    let leaked: &'static [u8] = Box::leak(data.into_boxed_slice());
    tensors[idx].1 = safetensors::tensor::TensorView::new(t.dtype(), shape, leaked).unwrap();
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
}

#[test]
fn tensor_of_the_wrong_shape() {
    let dir = copy_mini();
    let name = "language_model.layers.2.mlp.down_proj.weight";
    rewrite_tensor(dir.path(), name, |shape, data| {
        (vec![shape[1], shape[0]], data.to_vec())
    });
    assert_fails_with(
        &tessera(&[
            "embed",
            "--model",
            dir.path().to_str().unwrap(),
            "--text",
            "x",
        ]),
        &[name, "expected shape [64, 96]", "found [96, 64]"],
    );
}

#[test]
fn nan_weights_fail_naming_the_stage_instead_of_writing_nulls() {
    let dir = copy_mini();
    // All bits set is a NaN in every float format.
    let name = "language_model.layers.1.mlp.down_proj.weight";
    rewrite_tensor(dir.path(), name, |shape, data| {
        (shape.to_vec(), vec![0xff; data.len()])
    });
    // Before: exit 0 and `"embedding": [null, …]`.
    let out = tessera(&[
        "embed",
        "--model",
        dir.path().to_str().unwrap(),
        "--text",
        "x",
    ]);
    assert_fails_with(
        &out,
        &[
            "embedding before L2 normalisation",
            "not finite (NaN or infinity",
        ],
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy_mini();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_fails_with(
        &tessera(&[
            "embed",
            "--model",
            dir.path().to_str().unwrap(),
            "--text",
            "x",
        ]),
        &["model.safetensors", "truncated"],
    );
}

#[test]
fn empty_text() {
    assert_fails_with(
        &tessera(&["embed", "--text", "ok", "--text", ""]),
        &["text 2 is empty"],
    );
}

#[test]
fn invalid_utf8_in_text_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.txt");
    std::fs::write(&p, b"fine\nbad \xc3\x28 bytes\n").unwrap();
    assert_fails_with(
        &tessera(&["embed", "--text-file", p.to_str().unwrap()]),
        &["t.txt", "line 2", "UTF-8"],
    );
}

#[test]
fn unknown_prompt_name_lists_the_known_ones() {
    assert_fails_with(
        &tessera(&["embed", "--text", "x", "--prompt-name", "search"]),
        &["\"search\"", "query", "document"],
    );
}

#[test]
fn dim_larger_than_the_model() {
    assert_fails_with(
        &tessera(&["embed", "--text", "x", "--dim", "49"]),
        &["--dim 49", "48"],
    );
}

#[test]
fn unwritable_output_fails_before_compute() {
    assert_fails_with(
        &tessera(&["embed", "--text", "x", "-o", "/no/such/dir/out.jsonl"]),
        &["/no/such/dir/out.jsonl"],
    );
}

#[test]
fn info_describes_the_model() {
    let out = tessera(&["info", "--model", mini().to_str().unwrap()]);
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(
        s.contains("6 layers (5 sliding")
            && s.contains("48 dims")
            && s.contains("runs on:     cpu"),
        "{s}"
    );
}

// ---- images ---------------------------------------------------------------------------------

fn images_dir() -> PathBuf {
    root().join("tests/fixtures/egemma2/images")
}

fn image_path(name: &str) -> String {
    images_dir().join(name).to_str().unwrap().to_string()
}

#[derive(serde::Deserialize)]
struct VisionFixture {
    cases: Vec<VisionCase>,
}
#[derive(serde::Deserialize)]
struct VisionCase {
    name: String,
    parts: Vec<std::collections::BTreeMap<String, String>>,
    expected: std::collections::BTreeMap<String, Vec<f64>>,
}

fn embeddings(out: &Output) -> Vec<Vec<f64>> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    embedding_lines(&out.stdout)
}

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn embed_images_and_combined_inputs_reproduce_the_fixture() {
    let fx: VisionFixture = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/egemma2/vision_cases.json")).unwrap(),
    )
    .unwrap();
    let case = |n: &str| fx.cases.iter().find(|c| c.name == n).unwrap();
    let model = mini();
    let model = model.to_str().unwrap();
    // One input per image, from --image and an --image-file list.
    let singles = ["image_rgb_100x100", "image_anim_64x64", "image_odd_33x47"];
    let files: Vec<String> = singles
        .iter()
        .map(|n| image_path(&case(n).parts[0]["image"]))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("images.txt");
    std::fs::write(&list, format!("{}\n{}\n", files[1], files[2])).unwrap();
    let got = embeddings(&tessera(&[
        "embed",
        "--model",
        model,
        "--image",
        &files[0],
        "--image-file",
        list.to_str().unwrap(),
    ]));
    assert_eq!(got.len(), 3);
    for (g, n) in got.iter().zip(singles) {
        assert!(max_abs(g, &case(n).expected["egemma2-mini"]) <= 1e-5, "{n}");
    }
    // --combine keeps command-line order: image then text, and text then image.
    for (name, args) in [
        (
            "image_then_text",
            ["--image", "rgba_75x57.png", "--text", "the quick brown fox"],
        ),
        (
            "text_then_image",
            [
                "--text",
                "a photo of ",
                "--image",
                "photo_120x160.pillow.png",
            ],
        ),
    ] {
        let mut argv = vec!["embed", "--model", model, "--combine"];
        let paths: Vec<String> = args.iter().map(|a| image_path(a)).collect();
        for (i, a) in args.iter().enumerate() {
            argv.push(if a.ends_with(".png") { &paths[i] } else { a });
        }
        let got = embeddings(&tessera(&argv));
        assert_eq!(got.len(), 1);
        let d = max_abs(&got[0], &case(name).expected["egemma2-mini"]);
        assert!(d <= 1e-5, "{name}: {d:e}");
    }
}

#[test]
fn corrupt_or_truncated_image() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.png");
    let bytes = std::fs::read(images_dir().join("rgb_100x100.png")).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 3]).unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image", p.to_str().unwrap()]),
        &["cut.png", "corrupt or truncated PNG"],
    );
}

#[test]
fn zero_sized_image() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.gif");
    // A GIF whose screen and only frame are 0×0.
    let mut gif = b"GIF89a\0\0\0\0\0\0\0,\0\0\0\0\0\0\0\0\0".to_vec();
    gif.extend(b"\x02\x02\x44\x01\x00;");
    std::fs::write(&p, gif).unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image", p.to_str().unwrap()]),
        &["empty.gif", "zero-sized"],
    );
}

#[test]
fn unsupported_image_format() {
    let dir = tempfile::tempdir().unwrap();
    let tiff = dir.path().join("scan.tif");
    std::fs::write(&tiff, b"II*\0\x08\0\0\0\0\0\0\0").unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image", tiff.to_str().unwrap()]),
        &["scan.tif", "unsupported image format"],
    );
    let text = dir.path().join("notes.png");
    std::fs::write(&text, "just some text").unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image", text.to_str().unwrap()]),
        &["notes.png", "not an image"],
    );
}

#[test]
fn image_over_the_pixel_limit_is_refused_from_its_header() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge.bmp");
    // A 24-bit BMP header claiming 30000 × 30000 pixels, with no pixel data at all.
    let mut b = b"BM".to_vec();
    for v in [70u32, 0, 54, 40] {
        b.extend(v.to_le_bytes());
    }
    b.extend(30000i32.to_le_bytes());
    b.extend(30000i32.to_le_bytes());
    b.extend(1u16.to_le_bytes());
    b.extend(24u16.to_le_bytes());
    b.extend([0u8; 40]);
    std::fs::write(&p, b).unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image", p.to_str().unwrap()]),
        &["huge.bmp", "900000000 pixels", "limit of 89478485"],
    );
}

#[test]
fn image_budget_outside_the_allowed_set() {
    assert_fails_with(
        &tessera(&[
            "embed",
            "--image",
            &image_path("rgb_100x100.png"),
            "--image-budget",
            "100",
        ]),
        &["image budget 100", "70, 140, 280, 560, 1120"],
    );
}

#[test]
fn image_too_elongated_for_the_position_table() {
    assert_fails_with(
        &tessera(&["embed", "--image", &image_path("wide_300x20.png")]),
        &["wide_300x20.png", "position_embedding_size"],
    );
}

#[test]
fn missing_image_and_bad_image_list() {
    assert_fails_with(
        &tessera(&["embed", "--image", "/no/such/photo.jpg"]),
        &["/no/such/photo.jpg"],
    );
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("list.txt");
    std::fs::write(&list, format!("{}\n\n", image_path("rgb_100x100.png"))).unwrap();
    assert_fails_with(
        &tessera(&["embed", "--image-file", list.to_str().unwrap()]),
        &["list.txt", "line 2", "empty"],
    );
}

#[test]
fn images_with_a_text_only_model() {
    let dir = copy_mini();
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["vision_config"] = serde_json::Value::Null;
    std::fs::write(&path, cfg.to_string()).unwrap();
    assert_fails_with(
        &tessera(&[
            "embed",
            "--model",
            dir.path().to_str().unwrap(),
            "--image",
            &image_path("rgb_100x100.png"),
        ]),
        &["no vision tower"],
    );
}

#[test]
fn auto_device_says_why_it_runs_on_the_cpu_in_one_line_or_runs_on_cuda_without_a_note() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["embed", "--text", "hello", "--device", "auto"])
        .env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_DEVICE")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let notes: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("running on the CPU"))
        .collect();
    match cuda_support(&mini()) {
        // CUDA runs the model: no fallback, so no note.
        Ok(device) => {
            println!("CUDA runs EmbeddingGemma 2 here ({device}): checking there is no note");
            assert!(notes.is_empty(), "{err}");
        }
        // Without it, exactly one line that gives the reason `info` gives.
        Err(why) => {
            println!("CUDA cannot run EmbeddingGemma 2 here ({why}): checking the one note");
            assert_eq!(notes, [format!("note: running on the CPU: {why}")], "{err}");
        }
    }
}

#[test]
fn explicit_cuda_runs_where_info_says_it_does_and_is_a_one_line_error_elsewhere() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["embed", "--text", "hello", "--device", "cuda"])
        .env_remove("TESSERA_MODEL")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    match cuda_support(&mini()) {
        Ok(device) => {
            println!("CUDA runs EmbeddingGemma 2 here ({device}): checking the embedding");
            assert!(out.status.success(), "{err}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON output");
            let width = v["embedding"].as_array().map_or(0, Vec::len);
            assert!(width > 0, "no embedding: {v}");
        }
        Err(why) => {
            // No fallback when CUDA was asked for: one line naming what is missing.
            println!("CUDA cannot run EmbeddingGemma 2 here ({why}): checking the error");
            assert!(!out.status.success(), "{err}");
            assert_eq!(
                err.trim_end(),
                format!("error: EmbeddingGemma 2: {why}"),
                "{err}"
            );
        }
    }
}

// ---- families, capabilities and devices -------------------------------------------------------

fn zimage_mini() -> PathBuf {
    root().join("crates/models/assets/zimage-mini")
}

#[test]
fn a_model_for_another_command_is_refused_with_the_command_it_needs() {
    let z = zimage_mini();
    assert_fails_with(
        &tessera(&["embed", "--model", z.to_str().unwrap(), "--text", "x"]),
        &["Z-Image", "text to image", "tessera generate"],
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.png");
    assert_fails_with(
        &tessera(&[
            "generate",
            "--model",
            mini().to_str().unwrap(),
            "--prompt",
            "x",
            "--out",
            out.to_str().unwrap(),
        ]),
        &["EmbeddingGemma 2", "tessera embed"],
    );
    assert!(!out.exists());
}

#[test]
fn info_names_the_family_its_capability_and_what_each_device_runs() {
    for (model, family) in [
        (
            mini(),
            "family:      EmbeddingGemma 2 — embeddings (`tessera embed`)",
        ),
        (
            zimage_mini(),
            "family:      Z-Image — text to image (`tessera generate`)",
        ),
        (
            root().join("crates/models/assets/lfm2vl-mini"),
            "family:      LFM2-VL",
        ),
    ] {
        let out = tessera(&["info", "--model", model.to_str().unwrap()]);
        let s = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{s}");
        assert!(s.contains(family), "{s}");
        assert!(s.contains("cpu:         runs it: cpu"), "{s}");
        // This machine may or may not have CUDA; either way the line says which.
        assert!(
            s.contains("cuda:        runs it: cuda") || s.contains("cuda:        cannot run it: "),
            "{s}"
        );
        // A model with convolutions (the VAE) names the kernels that run them; one without none.
        let has_convs = model == zimage_mini();
        assert_eq!(s.contains("convolutions: "), has_convs, "{s}");
        // A chat model names the kernels that decode; the others do not decode.
        let chats = family.starts_with("family:      LFM2-VL");
        assert_eq!(s.contains("decoding:    "), chats, "{s}");
    }
}

/// What `tessera info` says CUDA device 0 does with `model`: `Ok(describe)` where it runs it,
/// `Err(reason)` where it cannot.
fn cuda_support(model: &Path) -> Result<String, String> {
    let out = tessera(&["info", "--model", model.to_str().unwrap()]);
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{s}");
    let line = s
        .lines()
        .find_map(|l| l.strip_prefix("cuda:"))
        .unwrap_or_else(|| panic!("no cuda: line in\n{s}"))
        .trim();
    if let Some(d) = line.strip_prefix("runs it: ") {
        Ok(d.to_string())
    } else if let Some(why) = line.strip_prefix("cannot run it: ") {
        Err(why.to_string())
    } else {
        panic!("unexpected cuda: line {line:?}")
    }
}

#[test]
fn generate_on_cuda_runs_where_info_says_it_does_and_is_refused_before_loading_elsewhere() {
    // Z-Image runs on CUDA. On a machine whose CUDA cannot run it (no driver, no device: CI),
    // `--device cuda` is refused before anything loads, naming the model and the missing device
    // as `info` does, with nothing written; on a GPU machine the image is made.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.png");
    let z = zimage_mini();
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "generate",
            "--model",
            z.to_str().unwrap(),
            "--device",
            "cuda",
        ])
        .args(["--prompt", "x", "--size", "64x64"])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    match cuda_support(&z) {
        Ok(device) => {
            println!("CUDA runs Z-Image here ({device}): checking that the image is made");
            assert!(o.status.success(), "{err}");
            assert!(out.exists(), "{err}");
        }
        Err(why) => {
            println!("CUDA cannot run Z-Image here ({why}): checking the refusal");
            assert!(!o.status.success(), "{err}");
            assert!(
                why.to_lowercase().contains("cuda") || why.contains("NVIDIA"),
                "the reason does not name the missing device: {why}"
            );
            assert_eq!(err.trim_end(), format!("error: Z-Image: {why}"), "{err}");
            assert!(listing_is_empty(dir.path()), "{err}");
        }
    }
}

fn listing_is_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().next().is_none()
}

/// Run `tessera args`, which must succeed, and parse each line it prints as JSON: its stdout
/// and the lines.
fn json_lines(args: &[&str]) -> (String, Vec<serde_json::Value>) {
    let out = tessera(args);
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = s
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    (s, lines)
}

#[test]
fn bench_denormals_times_both_workloads_and_fails_past_its_bound() {
    let (s, lines) = json_lines(&["bench", "denormals", "--rows", "40", "--iters", "1"]);
    let workloads: Vec<&str> = lines
        .iter()
        .map(|l| l["workload"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(workloads, ["product", "attention"], "{s}");
    for l in &lines {
        let slowdown = l["slowdown"].as_f64().unwrap_or(f64::NAN);
        assert!(slowdown.is_finite() && slowdown > 0.0, "{l}");
        // The bits the backend sets on the thread that ran the ops.
        if cfg!(target_arch = "x86_64") {
            assert_eq!(l["flushing"], true, "{l}");
        }
    }
    // No slowdown is at most 0: the check fails, naming the bound and both workloads.
    let bad = tessera(&[
        "bench",
        "denormals",
        "--rows",
        "40",
        "--iters",
        "1",
        "--max-slowdown",
        "0",
    ]);
    assert_fails_with(&bad, &["--max-slowdown 0", "product", "attention"]);
}

#[test]
fn bench_chat_times_the_image_prompt_its_encoder_alone_prefill_follow_ups_and_decoding() {
    let (s, lines) = json_lines(&[
        "bench",
        "chat",
        "--images",
        "64x48",
        "--prefill",
        "8",
        "--batch",
        "1,2",
        "--new-tokens",
        "2",
        "--follow-up",
        "30,100",
        "--iters",
        "2",
    ]);
    let what: Vec<&str> = lines.iter().map(|l| l["what"].as_str().unwrap()).collect();
    assert_eq!(
        what,
        [
            "load",
            "image prompt",
            "image encoder",
            "prefill",
            "follow-up",
            "follow-up",
            "decode",
            "decode"
        ],
        "{s}"
    );
    // A follow-up prefills only what its history lacks: the whole history came from the cache.
    for (l, history) in lines[4..6].iter().zip([30, 100]) {
        assert_eq!(l["history"], history, "{l}");
        assert_eq!(l["cached_tokens"], history, "{l}");
        assert_eq!(l["new_tokens"], 20, "{l}");
        assert!(l["ms"].as_f64().unwrap() > 0.0, "{l}");
    }
    let prompt = &lines[1];
    assert!(prompt["prompt_tokens"].as_u64().unwrap() > 8, "{prompt}");
    assert!(prompt["preprocess_ms"].as_f64().unwrap() > 0.0, "{prompt}");
    // The encoder alone is part of the prompt's prefill, and its spread brackets its median.
    let enc = &lines[2];
    let (lo, mid, hi) = (
        enc["min_ms"].as_f64().unwrap(),
        enc["ms"].as_f64().unwrap(),
        enc["max_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < lo && lo <= mid && mid <= hi, "{enc}");
    assert_eq!(enc["image"], "64x48");
}

#[test]
fn bench_qwen_image_parts_times_every_component_of_the_bundled_model() {
    let out = tessera(&[
        "bench",
        "qwen-image-parts",
        "--size",
        "64x32",
        "--prompt-tokens",
        "20",
        "--prefix-rows",
        "3,9",
        "--iters",
        "1",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let timed: Vec<&str> = s
        .lines()
        .filter_map(|l| l.strip_prefix("timing "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        timed,
        [
            "text_encoder_20tok_ms",
            "prefill_3rows_ms",
            "step_64x32_prefix3_ms",
            "prefill_9rows_ms",
            "step_64x32_prefix9_ms",
            "vae_decode_64x32_ms",
        ],
        "{s}"
    );
    let bad = tessera(&["bench", "qwen-image-parts", "--prompt-tokens", "5"]);
    assert_fails_with(&bad, &["--prompt-tokens 5"]);
}

/// `bench generate`'s JSON line (the last line of its output), after its human lines.
fn bench_generate(args: &[&str]) -> (Vec<String>, serde_json::Value) {
    let mut all = vec!["bench", "generate", "--steps", "2", "--iters", "1"];
    all.extend_from_slice(args);
    let out = tessera(&all);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = s.lines().map(str::to_string).collect();
    let json = serde_json::from_str(lines.last().expect("a JSON line")).unwrap();
    (lines, json)
}

/// `bench generate --image` times an edit of the bundled Qwen-Image-2.1 by stage: the condition
/// image through the VAE encoder and the vision tower, the text encoder and the prefill of each
/// prompt branch, beside the same bench without the image, which has no such stages and the
/// model's size where the edit takes the condition image's.
#[test]
fn bench_generate_times_an_edit_by_stage() {
    let cond = root().join("tests/fixtures/qwen_image/condition/tall_37x100.png");
    let (lines, edit) = bench_generate(&[
        "--model",
        "bundled:qwen-image",
        "--image",
        cond.to_str().unwrap(),
        "--output-resolution",
        "96",
        "--guidance",
        "4",
        "--negative-prompt",
        "",
    ]);
    let (_, text) = bench_generate(&[
        "--model",
        "bundled:qwen-image",
        "--size",
        "64x64",
        "--guidance",
        "4",
        "--negative-prompt",
        "",
    ]);
    // The edit ran: its output size is the condition image's aspect at the output resolution.
    assert_eq!(edit["size"], "64x160", "{edit}");
    assert_eq!(edit["condition_images"], 1, "{edit}");
    assert_eq!(text["condition_images"], 0, "{text}");
    assert_eq!(
        (edit["branches"].as_u64(), text["branches"].as_u64()),
        (Some(2), Some(2))
    );
    let stages = |j: &serde_json::Value| -> Vec<String> {
        let mut k: Vec<String> = j["stages"].as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let mut want = [
        "plan_ms",
        "vae_encode_ms",
        "vision_ms",
        "text_encoder_ms",
        "prefill_ms",
        "setup_ms",
    ];
    want.sort();
    assert_eq!(stages(&edit), want, "{edit}");
    assert_eq!(
        stages(&text),
        ["plan_ms", "prefill_ms", "setup_ms", "text_encoder_ms"],
        "{text}"
    );
    // Every stage took time, and the stages fit in the encoding they split.
    let sum: f64 = edit["stages"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .inspect(|&ms| assert!(ms > 0.0, "{edit}"))
        .sum();
    let encode = edit["encode_ms"].as_f64().unwrap();
    assert!(sum <= encode * 1.001 + 0.01, "{sum} > {encode}: {edit}");
    assert!(edit["step_ms"].as_f64().unwrap() > 0.0, "{edit}");
    // The human lines: the summary names the edit, the stage line its parts (two branches each).
    assert!(lines[0].contains("edit of 1 image, 64x160"), "{lines:?}");
    let by_stage = lines
        .iter()
        .find(|l| l.starts_with("encode by stage"))
        .unwrap_or_else(|| panic!("{lines:?}"));
    for part in ["vae_encode ", "vision ", "text_encoder ", "(2×)", "setup "] {
        assert!(by_stage.contains(part), "{part}: {by_stage}");
    }

    // Z-Image cannot edit: refused in one line before loading.
    let bad = tessera(&[
        "bench",
        "generate",
        "--image",
        cond.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert_fails_with(&bad, &["--image", "Qwen-Image-2.1"]);
}
