//! `/v1/chat/completions` serving LFM2-VL from its GGUF files (`tests/fixtures/lfm2vl_gguf/`, the
//! bundled miniature converted by llama.cpp), checked against the runtime's reply on the same
//! model's Hugging Face folder (with the published image settings the GGUF files imply: the
//! miniature without its own `preprocessor_config.json`).

mod common;

use std::path::{Path, PathBuf};

use common::{CHAT_NAME, Server, config, data_url};
use serde_json::json;
use tessera_backend::AnyBackend;
use tessera_backend::cpu::CpuBackend;
use tessera_models::chat_family::CacheShape;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::{self, ChatOptions, GenerationParams};
use tessera_runtime::decode::{Control, SamplingParams};
use tessera_runtime::{Family, ModelFilesOf, ModelSpec};
use tessera_server::ModelLoader;

const QUESTION: &str = "What is in this image?";

fn image_bytes() -> Vec<u8> {
    std::fs::read(common::workspace().join("tests/fixtures/lfm2vl/images/tiled400x368.png"))
        .unwrap()
}

fn folder(from: PathBuf, keep: impl Fn(&str) -> bool) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if keep(&name) {
            std::fs::copy(&p, d.path().join(name)).unwrap();
        }
    }
    d
}

/// The model in `dir` as `--model DIR` finds it (the same detection for both layouts).
fn open(dir: &Path) -> ModelSpec {
    ModelSpec::open(Some(dir.to_str().unwrap()), Family::Lfm2Vl).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_gguf_folder_is_served_as_the_checkpoint_answers() {
    let gguf = folder(
        common::workspace().join("tests/fixtures/lfm2vl_gguf"),
        |n| ["LFM2-VL-mini-F32.gguf", "mmproj-LFM2-VL-mini-F32.gguf"].contains(&n),
    );
    let hf = folder(
        common::workspace().join("crates/models/assets/lfm2vl-mini"),
        |n| n != "preprocessor_config.json",
    );
    let cfg = config();
    // The reply the runtime gives on the Hugging Face folder, greedy.
    let hf_spec = open(hf.path());
    let cache = CacheShape {
        slots: cfg.limits.max_sequences,
        ctx: cfg.limits.context,
    };
    let mut model = chat::load(
        AnyBackend::Cpu(CpuBackend::new()),
        &hf_spec,
        cache,
        ChatOptions::default(),
    )
    .unwrap();
    let messages = [Message::parts(
        "user",
        vec![
            Part::Image,
            Part::Text {
                text: QUESTION.into(),
            },
        ],
    )];
    let images = [Image::decode(&image_bytes()).unwrap()];
    let prompt = model.prompt(&messages, &images).unwrap();
    let params = GenerationParams {
        sampling: SamplingParams::default(),
        max_tokens: 12,
        stop: Vec::new(),
    };
    let want = model
        .reply(1, prompt, &params, &mut |_| Control::Continue)
        .unwrap();
    assert!(!want.text.is_empty());

    let gguf_spec = open(gguf.path());
    match (&gguf_spec.files, &hf_spec.files) {
        (ModelFilesOf::Lfm2Vl(_, gguf_cfg), ModelFilesOf::Lfm2Vl(_, hf_cfg)) => {
            assert_eq!(gguf_cfg, hf_cfg)
        }
        _ => panic!("both folders hold LFM2-VL"),
    }
    let loader = common::chat_loader(gguf_spec);
    let s = Server::start_with(cfg, ModelLoader::from(loader)).await;
    s.wait_ready().await;
    let body = json!({
        "model": CHAT_NAME,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(&image_bytes())}},
            {"type": "text", "text": QUESTION},
        ]}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let (status, body) = s.chat(body).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], want.text.as_str());
    assert_eq!(body["usage"]["prompt_tokens"], want.prompt_tokens);
    assert_eq!(body["usage"]["completion_tokens"], want.completion_tokens);
    s.stop().await.unwrap();
}
