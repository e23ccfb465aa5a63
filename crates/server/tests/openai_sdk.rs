//! The official `openai` Python client against the running server: embeddings (one text and one
//! image request, crates/server/tests/openai_client.py), chat (an image question, whole and
//! streamed, crates/server/tests/openai_chat_client.py) and image generation (PNGs of the size
//! asked, n = 2, seeds, streaming, errors: crates/server/tests/openai_images_client.py) and
//! image edits (one and two images, seeds, streaming, errors:
//! crates/server/tests/openai_edits_client.py). The client comes from the virtual
//! environment `tools/test` creates in `target/py`; without it these tests fail, they never skip.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{Server, chat_config, config};
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::GenerationParams;
use tessera_runtime::decode::{Control, SamplingParams};

fn python() -> PathBuf {
    let python = std::env::var_os("TESSERA_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::workspace().join("target/py/bin/python"));
    assert!(
        python.exists(),
        "{} is missing: run ./tools/test, which creates target/py with the openai package \
         (or set TESSERA_TEST_PYTHON to a python that has it)",
        python.display()
    );
    python
}

/// Run `script` with `args`; it must exit 0 and print `openai client: ok`.
async fn run_script(script: &str, args: Vec<String>) {
    let python = python();
    let script = common::workspace().join("crates/server/tests").join(script);
    let out =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).args(args).output())
            .await
            .unwrap()
            .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("openai client: ok"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_embeds_text_and_images() {
    let mut cfg = config();
    cfg.api_key = Some("test-key".into());
    let s = Server::start(cfg).await;
    run_script("openai_client.py", vec![s.url.clone(), "test-key".into()]).await;
    s.stop().await.unwrap();
}

/// The client's `images.generate` against the bundled Z-Image (served beside the bundled
/// embedding model, as a server of several models does).
#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_generates_images() {
    let mut cfg = config();
    cfg.api_key = Some("test-key".into());
    let s = Server::start_models(
        cfg,
        vec![
            tessera_server::ServedModel::new(common::NAME, common::bundled()),
            tessera_server::ServedModel::image(common::IMAGE_NAME, common::image_bundled()),
        ],
    )
    .await;
    s.wait_ready().await;
    let args = vec![s.url.clone(), "test-key".into(), common::IMAGE_NAME.into()];
    run_script("openai_images_client.py", args).await;
    s.stop().await.unwrap();
}

/// The client's `images.edit` against the bundled Qwen-Image-2.1.
#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_edits_images() {
    let mut cfg = config();
    cfg.api_key = Some("test-key".into());
    let s = Server::start_models(
        cfg,
        vec![tessera_server::ServedModel::image(
            "qwen-image-mini",
            common::qwen_image_bundled(),
        )],
    )
    .await;
    s.wait_ready().await;
    let dir = common::workspace().join("tests/fixtures/qwen_image/condition");
    let png = |n: &str| dir.join(n).display().to_string();
    let args = vec![
        s.url.clone(),
        "test-key".into(),
        "qwen-image-mini".into(),
        png("tall_37x100.png"),
        png("wide_203x61.png"),
    ];
    run_script("openai_edits_client.py", args).await;
    s.stop().await.unwrap();
}

/// The client's `chat.completions.create` with an image and a question, greedy: the same text
/// as `tessera_runtime::chat` gives for the same messages, and the usage it counts.
#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_chats_about_an_image() {
    let image = common::workspace().join("tests/fixtures/lfm2vl/images/exact270x250.png");
    let question = "What is in this image?";
    let max_tokens = 24;
    let mut cfg = chat_config();
    cfg.api_key = Some("test-key".into());
    let want = {
        let mut model = common::library_chat(&cfg.limits);
        let messages = vec![Message::parts(
            "user",
            vec![
                Part::Image,
                Part::Text {
                    text: question.into(),
                },
            ],
        )];
        let prompt = model
            .prompt(&messages, &[Image::open(&image).unwrap()])
            .unwrap();
        let params = GenerationParams {
            sampling: SamplingParams::default(),
            max_tokens,
            stop: Vec::new(),
        };
        model
            .reply(1, prompt, &params, &mut |_| Control::Continue)
            .unwrap()
    };
    // The expected reply goes through a file: the miniature's random text may hold any
    // character.
    let dir = tempfile::tempdir().unwrap();
    let expected = dir.path().join("expected.json");
    let finish = match want.finish {
        tessera_runtime::decode::Finish::Length => "length",
        _ => "stop",
    };
    std::fs::write(
        &expected,
        serde_json::to_vec(&serde_json::json!({
            "model": common::CHAT_NAME,
            "image": image,
            "question": question,
            "max_tokens": max_tokens,
            "text": want.text,
            "prompt_tokens": want.prompt_tokens,
            "completion_tokens": want.completion_tokens,
            "finish_reason": finish,
        }))
        .unwrap(),
    )
    .unwrap();
    let s = Server::start_chat(cfg).await;
    let args = vec![
        s.url.clone(),
        "test-key".into(),
        expected.display().to_string(),
    ];
    run_script("openai_chat_client.py", args).await;
    s.stop().await.unwrap();
}
