//! `tessera chat` and `tessera info` on a folder of LFM2-VL's GGUF files (the bundled
//! miniature converted by llama.cpp: `tools/fixtures/lfm2vl_gguf.py`), against the same model's
//! Hugging Face folder. The GGUF files carry the published image settings (llama.cpp applies
//! them to LFM2-VL), so the folder compared against is the miniature without its own
//! `preprocessor_config.json`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::tessera;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gguf_folder() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for n in ["LFM2-VL-mini-F32.gguf", "mmproj-LFM2-VL-mini-F32.gguf"] {
        std::fs::copy(
            root().join("tests/fixtures/lfm2vl_gguf").join(n),
            d.path().join(n),
        )
        .unwrap();
    }
    d
}

fn hf_folder() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(root().join("crates/models/assets/lfm2vl-mini")).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap();
        if name != "preprocessor_config.json" {
            std::fs::copy(&p, d.path().join(name)).unwrap();
        }
    }
    d
}

fn run(args: &[&str]) -> Output {
    let out = tessera().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "tessera {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn chat(model: &Path) -> String {
    let image = root().join("tests/fixtures/lfm2vl/images/tiled400x368.png");
    let out = run(&[
        "chat",
        "--model",
        model.to_str().unwrap(),
        "--image",
        image.to_str().unwrap(),
        "--prompt",
        "What is in this picture?",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    ]);
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn chat_on_the_gguf_folder_answers_as_on_the_checkpoint() {
    let (gguf, hf) = (gguf_folder(), hf_folder());
    let want = chat(hf.path());
    assert!(!want.trim().is_empty(), "the checkpoint answered nothing");
    assert_eq!(chat(gguf.path()), want);
}

#[test]
fn info_on_the_gguf_folder_describes_lfm2vl() {
    let gguf = gguf_folder();
    let out = run(&["info", "--model", gguf.path().to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("LFM2-VL") && text.contains("weights:"),
        "{text}"
    );
}
