//! The official `openai` Python client against the running server: one text and one image
//! request (crates/server/tests/openai_client.py). The client comes from the virtual
//! environment `tools/test` creates in `target/py`; without it this test fails, it never skips.

mod common;

use std::process::Command;

use common::{Server, config};

#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_embeds_text_and_images() {
    let python = std::env::var_os("TESSERA_TEST_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| common::workspace().join("target/py/bin/python"));
    assert!(
        python.exists(),
        "{} is missing: run ./tools/test, which creates target/py with the openai package \
         (or set TESSERA_TEST_PYTHON to a python that has it)",
        python.display()
    );
    let mut cfg = config();
    cfg.api_key = Some("test-key".into());
    let s = Server::start(cfg).await;
    let script = common::workspace().join("crates/server/tests/openai_client.py");
    let url = s.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([&url, "test-key"])
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("openai client: ok"), "{stdout}");
    s.stop().await.unwrap();
}
