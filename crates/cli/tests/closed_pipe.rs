//! Every command that prints to stdout ends quietly when its reader has gone
//! (`tessera info | head -1`): no panic, no error line, success.

use std::path::Path;
use std::process::{Command, Stdio};

fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env_remove("TESSERA_MODEL")
        .env("TESSERA_DEVICE", "cpu")
        .env(
            "HF_HUB_CACHE",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/no-hf-cache"),
        );
    c
}

/// Run `args` with stdout a pipe whose reading end is already closed, so that the very first
/// write fails (as `| head -1` does once it has its line), and return stderr.
fn with_closed_stdout(args: &[&str]) -> String {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = tessera()
        .args(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{args:?}: {:?}, stderr: {err}",
        out.status
    );
    for bad in ["panicked", "Broken pipe", "error"] {
        assert!(!err.contains(bad), "{args:?} said {bad:?}: {err}");
    }
    err
}

#[test]
fn info_of_every_bundled_model_ends_quietly_on_a_closed_pipe() {
    for name in ["egemma2", "zimage", "lfm2vl", "qwen-image"] {
        with_closed_stdout(&["info", "--model", &format!("bundled:{name}")]);
    }
    with_closed_stdout(&["info"]);
}

#[test]
fn embed_and_chat_end_quietly_on_a_closed_pipe() {
    with_closed_stdout(&["embed", "--text", "a", "--text", "b"]);
    with_closed_stdout(&["embed", "--text", "a", "--format", "npy"]);
    with_closed_stdout(&["chat", "--prompt", "hi", "--max-tokens", "4"]);
}

#[test]
fn a_bundled_model_named_with_model_is_not_said_to_be_missing() {
    let out = tessera()
        .args(["info", "--model", "bundled:lfm2vl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("no --model given"), "{err}");
    assert!(err.contains("bundled lfm2vl"), "{err}");
    // Without --model it still says so.
    let out = tessera().arg("info").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no --model given"), "{err}");
}
