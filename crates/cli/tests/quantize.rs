//! `--quantize` end to end: the bundled EmbeddingGemma 2 miniature quantized to Q8_0 at load
//! gives the embeddings that the plain f32 model gives on a checkpoint whose product weights
//! were replaced by their dequantized values (written here from the quantized blocks), and
//! `tessera info --quantize` reports the smaller weights.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tessera_core::fp8;
use tessera_core::gguf::{GgmlType, quantize};

mod common;
use common::{embedding_lines, read_png};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn mini() -> PathBuf {
    root().join("crates/models/assets/egemma2-mini")
}

fn tessera(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .env_remove("TESSERA_MODEL")
        .env("TESSERA_DEVICE", "cpu")
        .env("HF_HUB_CACHE", root().join("target/no-hf-cache"))
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn embeddings(model: &Path, quantize: Option<&str>) -> Vec<Vec<f64>> {
    let mut args = vec!["embed", "--model", model.to_str().unwrap()];
    for t in [
        "a short sentence",
        "and another, rather longer one, with some punctuation!",
    ] {
        args.extend(["--text", t]);
    }
    if let Some(q) = quantize {
        args.extend(["--quantize", q]);
    }
    embedding_lines(&tessera(&args).stdout)
}

fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

/// Q8_0's round trip of a row.
fn q8_0_round_trip(x: &[f32]) -> Vec<f32> {
    let mut blocks = vec![0u8; GgmlType::Q8_0.bytes_for(x.len()).unwrap()];
    quantize(GgmlType::Q8_0, x, &mut blocks).unwrap();
    let mut y = vec![0f32; x.len()];
    GgmlType::Q8_0.dequantize(&blocks, &mut y).unwrap();
    y
}

/// FP8's round trip of a row: codes with the row's scale (checked against torch's rounding by
/// crates/core/tests/fp8.rs), decoded times the scale in f32.
fn fp8_round_trip(x: &[f32]) -> Vec<f32> {
    let s = fp8::row_scale(x).unwrap();
    let mut codes = vec![0u8; x.len()];
    fp8::quantize_row(x, s, &mut codes);
    codes.iter().map(|&c| fp8::to_f32(c) * s).collect()
}

/// The miniature's folder with every product weight — a 2-D tensor whose rows are whole blocks
/// of `block` values, but not the token table, which is read by row — replaced, row by row, by
/// `round_trip` of it.
fn dequantized_copy(dir: &Path, block: usize, round_trip: fn(&[f32]) -> Vec<f32>) {
    for entry in std::fs::read_dir(mini()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let bytes = std::fs::read(mini().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut replaced = 0;
    for (name, t) in st.tensors() {
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        let mut data = t.data().to_vec();
        let product =
            matches!(t.shape(), [_, c] if c % block == 0) && !name.ends_with("embed_tokens.weight");
        if product {
            let x: Vec<f32> = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let y: Vec<f32> = x.chunks(t.shape()[1]).flat_map(round_trip).collect();
            data = y.iter().flat_map(|v| v.to_le_bytes()).collect();
            replaced += 1;
        }
        out.push((name, t.shape().to_vec(), data));
    }
    assert!(replaced > 20, "only {replaced} product weights");
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(n, s, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn q8_0_at_load_equals_the_f32_model_on_the_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    dequantized_copy(dir.path(), 32, q8_0_round_trip);
    let quantized = embeddings(&mini(), Some("q8_0"));
    let reference = embeddings(dir.path(), None);
    let d = max_diff(&quantized, &reference);
    assert!(
        d <= 1e-5,
        "Q8_0 at load vs f32 on the dequantized weights: {d:e}"
    );
    // Quantizing did change the model: the plain f32 run is further off.
    let plain = embeddings(&mini(), None);
    let moved = max_diff(&quantized, &plain);
    assert!(
        moved > 1e-4,
        "Q8_0 did not change the embeddings ({moved:e})"
    );
}

/// `--quantize fp8` (a scale per row) is the f32 model on the weights' FP8 round trip: within
/// 1e-5 of it, where FP8's rounding itself moves the embeddings by more than 1e-4 (and by more
/// than Q8_0's does: three mantissa bits against Q8_0's seven bits of magnitude per block).
#[test]
fn fp8_at_load_equals_the_f32_model_on_the_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    dequantized_copy(dir.path(), 1, fp8_round_trip);
    let quantized = embeddings(&mini(), Some("fp8"));
    let reference = embeddings(dir.path(), None);
    let d = max_diff(&quantized, &reference);
    assert!(
        d <= 1e-5,
        "FP8 at load vs f32 on the dequantized weights: {d:e}"
    );
    let plain = embeddings(&mini(), None);
    let moved = max_diff(&quantized, &plain);
    let q8 = max_diff(&embeddings(&mini(), Some("q8_0")), &plain);
    assert!(
        moved > 1e-4 && moved > q8,
        "FP8 moved the embeddings by {moved:e}, Q8_0 by {q8:e}"
    );
    let out = tessera(&[
        "info",
        "--model",
        mini().to_str().unwrap(),
        "--quantize",
        "fp8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("with --quantize fp8 (product weights in F8_E4M3 with an f32 scale per row"),
        "{text}"
    );
    assert!(text.contains("F8_E4M3 weights quantized at load"), "{text}");
}

#[test]
fn info_reports_the_quantized_size_and_describe_says_so() {
    let dir = mini();
    let out = tessera(&[
        "info",
        "--model",
        dir.to_str().unwrap(),
        "--quantize",
        "q4_0",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("with --quantize q4_0"), "{text}");
    assert!(text.contains("Q4_0 weights quantized at load"), "{text}");
}

#[test]
fn int8_activations_run_close_to_the_exact_mode_and_need_quantized_weights() {
    let model = mini();
    let m = model.to_str().unwrap();
    let exact = embeddings(&model, Some("q8_0"));
    let out = tessera(&[
        "embed",
        "--model",
        m,
        "--quantize",
        "q8_0",
        "--precision",
        "int8",
        "--text",
        "a short sentence",
        "--text",
        "and another, rather longer one, with some punctuation!",
    ]);
    let int8: Vec<Vec<f64>> = embedding_lines(&out.stdout);
    // Unit vectors: their cosine is their dot product.
    for (a, b) in int8.iter().zip(&exact) {
        let cos: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        assert!(cos > 0.999, "int8 vs exact Q8_0: cosine {cos}");
    }
    assert!(
        max_diff(&int8, &exact) > 0.0,
        "int8 activations changed nothing"
    );
    let out = tessera(&[
        "info",
        "--model",
        m,
        "--quantize",
        "q8_0",
        "--precision",
        "int8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("int8 activations"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["embed", "--model", m, "--precision", "int8", "--text", "x"])
        .env("TESSERA_DEVICE", "cpu")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--quantize"), "{err}");
}

/// `--quantize q6_k --precision int8` end to end. The Z-Image miniature's timestep MLP
/// (256 → 1024 → 64) is its one pair of matrices whose rows are whole Q6_K blocks, so the image
/// goes through the Q6_K int8 kernel: it differs from the exact Q6_K run's (the int8 path ran),
/// by less than the exact Q6_K run's differs from f32's (the activations' 8-bit rounding moves it
/// less than the weights' 6-bit one: about 3.5× less at the seeds tried, 1–4 and 7); `info` says
/// so.
#[test]
fn q6_k_with_int8_activations_moves_an_image_less_than_q6_k_itself() {
    let pixels = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("out.png");
        let mut args = vec!["generate", "--model", "bundled:zimage", "--prompt", "x"];
        args.extend(["--size", "32x32", "--steps", "2", "--seed", "7"]);
        args.extend(["-o", png.to_str().unwrap()]);
        args.extend(extra);
        tessera(&args);
        read_png(&png).2
    };
    let mean_diff = |a: &[u8], b: &[u8]| {
        assert_eq!(a.len(), b.len());
        let sum: u64 = a
            .iter()
            .zip(b)
            .map(|(&p, &q)| u64::from(p.abs_diff(q)))
            .sum();
        sum as f64 / a.len() as f64
    };
    let f32 = pixels(&[]);
    let exact = pixels(&["--quantize", "q6_k"]);
    let int8 = pixels(&["--quantize", "q6_k", "--precision", "int8"]);
    let (by_int8, by_q6_k) = (mean_diff(&int8, &exact), mean_diff(&exact, &f32));
    assert!(
        by_int8 > 0.0 && by_int8 < by_q6_k,
        "int8 moved the image by {by_int8}, Q6_K by {by_q6_k}"
    );
    let out = tessera(&[
        "info",
        "--model",
        "bundled:zimage",
        "--quantize",
        "q6_k",
        "--precision",
        "int8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Q6_K weights quantized at load, products with int8 activations"),
        "{text}"
    );
}

/// `generate --transformer` with each family's file from `tests/fixtures/<folder>` writes a PNG.
fn generate_with_transformer_files(folder: &str, files: [&str; 2]) {
    let qwen = root().join("crates/models/assets/qwen-image-mini");
    for (model, file) in [(None, files[0]), (Some(&qwen), files[1])] {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("out.png");
        let path = root().join("tests/fixtures").join(folder).join(file);
        let mut args = vec!["generate", "--transformer", path.to_str().unwrap()];
        if let Some(m) = model {
            args.extend(["--model", m.to_str().unwrap()]);
        }
        args.extend(["--prompt", "x", "--size", "32x32", "--steps", "2"]);
        args.extend(["-o", png.to_str().unwrap()]);
        tessera(&args);
        assert!(std::fs::metadata(&png).unwrap().len() > 0, "{file}");
    }
}

#[test]
fn generate_takes_a_gguf_transformer() {
    generate_with_transformer_files(
        "transformer_gguf",
        ["zimage_q8_0.gguf", "qwen_image_q8_0.gguf"],
    );
}

#[test]
fn generate_takes_a_scaled_fp8_transformer() {
    generate_with_transformer_files(
        "transformer_fp8",
        [
            "zimage_fp8_scaled.safetensors",
            "qwen_image_fp8_scaled.safetensors",
        ],
    );
}

/// `--quantize fp8` runs both text-to-image families (every matrix of text encoder, DiT and VAE
/// in FP8 with row scales), and `info` counts their weights so.
#[test]
fn generate_quantizes_to_fp8_at_load() {
    for model in ["bundled:zimage", "bundled:qwen-image"] {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("out.png");
        tessera(&[
            "generate",
            "--model",
            model,
            "--quantize",
            "fp8",
            "--prompt",
            "x",
            "--size",
            "32x32",
            "--steps",
            "2",
            "-o",
            png.to_str().unwrap(),
        ]);
        assert!(std::fs::metadata(&png).unwrap().len() > 0, "{model}");
        let out = tessera(&["info", "--model", model, "--quantize", "fp8"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("with --quantize fp8") && text.contains("F8_E4M3 weights quantized"),
            "{text}"
        );
    }
}

#[test]
fn int8_runs_on_a_gguf_transformer_without_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("out.png");
    let gguf = root().join("tests/fixtures/transformer_gguf/zimage_q8_0.gguf");
    tessera(&[
        "generate",
        "--transformer",
        gguf.to_str().unwrap(),
        "--precision",
        "int8",
        "--prompt",
        "x",
        "--size",
        "32x32",
        "--steps",
        "1",
        "-o",
        png.to_str().unwrap(),
    ]);
    assert!(std::fs::metadata(&png).unwrap().len() > 0);
}
