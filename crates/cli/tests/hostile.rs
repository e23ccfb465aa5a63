//! Hostile input, round two (issue 26): prompts, chat templates, file paths, latents and cache
//! sizes that used to exhaust memory or wedge a process. Each case runs the `tessera` binary as
//! a process of its own and checks its answer, its wall time and its peak resident memory
//! (`VmHWM` of `/proc/PID/status`, read while it runs), with limits well below what each case
//! cost before its fix (quoted beside it).

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod common;
use common::{MIB, Run, Server, free_port, measured};

/// A copy of a bundled miniature's folder (`crates/models/assets/NAME`) to edit.
fn bundled_copy(name: &str, into: &Path) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/assets")
        .join(name);
    let to = into.join(name);
    copy_dir(&from, &to);
    to
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Doubles a string forty times: 2 TiB if nothing stops it.
const DOUBLING: &str = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";
/// Ten billion loop turns.
const LOOPING: &str =
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";

// ---- chat templates: untrusted, run on a budget ----------------------------------------------

/// `tessera chat` on `model` for one short turn, measured.
fn one_turn(model: &Path) -> Run {
    let args = [
        "chat",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
    ];
    measured(&args, Some(b""), Duration::from_secs(60))
}

#[test]
fn a_chat_template_that_doubles_a_string_fails_naming_it_in_bounded_memory() {
    // Before: "memory allocation of 2147483664 bytes failed", SIGABRT.
    let dir = tempfile::tempdir().unwrap();
    let model = bundled_copy("lfm2vl-mini", dir.path());
    std::fs::write(model.join("chat_template.jinja"), DOUBLING).unwrap();
    let run = one_turn(&model);
    run.assert_errs_with(&["chat_template.jinja", "budget"]);
    run.assert_within(Duration::from_secs(15), 400);
}

#[test]
fn a_looping_template_in_tokenizer_config_fails_in_time() {
    // Before: two nested range(100000) loops never finished.
    let dir = tempfile::tempdir().unwrap();
    let model = bundled_copy("lfm2vl-mini", dir.path());
    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    let config_path = model.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["chat_template"] = serde_json::Value::String(LOOPING.into());
    std::fs::write(&config_path, config.to_string()).unwrap();
    let run = one_turn(&model);
    run.assert_errs_with(&["tokenizer_config.json", "budget"]);
    run.assert_within(Duration::from_secs(15), 400);
}

#[test]
fn a_looping_z_image_template_fails_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let model = bundled_copy("zimage-mini", dir.path());
    std::fs::write(model.join("tokenizer/chat_template.jinja"), LOOPING).unwrap();
    let out = dir.path().join("out.png");
    let run = measured(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "a red fox",
            "--out",
            out.to_str().unwrap(),
        ],
        Some(b""),
        Duration::from_secs(60),
    );
    run.assert_errs_with(&["chat_template.jinja", "budget"]);
    run.assert_within(Duration::from_secs(15), 400);
    assert!(!out.exists());
}

// ---- prompt sizes ------------------------------------------------------------------------------

#[test]
fn an_over_long_chat_line_is_skipped_in_bounded_memory_and_the_session_goes_on() {
    // Before: one 10 MiB line cost 1.97 GB (and an invalid UTF-8 line ended the session, rc 1).
    let mut input = vec![b'a'; 10 << 20];
    input.extend_from_slice(b"\n\xff\xfe not UTF-8\nhi\n");
    let run = measured(
        &["chat", "--max-tokens", "2"],
        Some(&input),
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{:?}: {}", run.status, run.stderr);
    for needle in [
        "line 1 is longer than",
        "line 2 is not valid UTF-8",
        "prompt tokens",
    ] {
        assert!(
            run.stderr.contains(needle),
            "stderr lacks {needle:?}: {}",
            run.stderr
        );
    }
    run.assert_within(Duration::from_secs(30), 300);
}

// ---- --init-latent: the header first, then only the bytes it needs ----------------------------

/// A `.npy` header (format 1.0) for float32 data of `shape`.
fn npy_header(shape: &str) -> Vec<u8> {
    let mut h = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out
}

#[test]
fn init_latents_are_refused_from_their_header_and_size_in_both_families() {
    let dir = tempfile::tempdir().unwrap();
    // 3 GiB of (sparse) data behind a valid header.
    let huge = dir.path().join("huge.npy");
    std::fs::write(&huge, npy_header("(1, 16, 64, 64)")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&huge)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    let out = dir.path().join("out.png");
    for model in ["bundled:zimage", "bundled:qwen-image"] {
        for (latent, needle) in [
            // Before: grew to 8.4 GB and ended "out of memory".
            ("/dev/zero", "not a float32 .npy array: missing the"),
            // Before: 3.1 GB read before the size error.
            (
                huge.to_str().unwrap(),
                "data bytes for shape [1, 16, 64, 64]",
            ),
        ] {
            let run = measured(
                &[
                    "generate",
                    "--model",
                    model,
                    "--prompt",
                    "x",
                    "--init-latent",
                    latent,
                    "--out",
                    out.to_str().unwrap(),
                ],
                Some(b""),
                Duration::from_secs(60),
            );
            run.assert_errs_with(&[needle]);
            run.assert_within(Duration::from_secs(10), 300);
        }
    }
}

// ---- the server, as a process of its own: `common::Server` ------------------------------------

#[test]
fn a_cache_larger_than_memory_is_refused_at_start_with_a_message() {
    // Before: "memory allocation of 524288000000 bytes failed", SIGABRT.
    let port = free_port().to_string();
    let run = measured(
        &[
            "serve",
            "--port",
            &port,
            "--model",
            "bundled:lfm2vl",
            "--max-sequences",
            "1000000",
        ],
        Some(b""),
        Duration::from_secs(60),
    );
    run.assert_errs_with(&["1000000 sequences", "--max-sequences"]);
    run.assert_within(Duration::from_secs(30), 300);
}

#[test]
fn a_long_chat_message_is_refused_before_it_is_tokenised() {
    let server = Server::start(&["--model", "bundled:lfm2vl"]);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let baseline = server.memory("VmRSS");
    let started = Instant::now();
    // Before: 3.1 GB and several seconds, then 400 "the prompt has 16777229 tokens".
    let long = "a".repeat(16 << 20);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": long}], "max_tokens": 1}),
    );
    let took = started.elapsed();
    let grew = server.memory("VmHWM").saturating_sub(baseline);
    eprintln!(
        "16 MiB message: {status} in {took:?}, peak grew by {} MiB",
        grew / MIB
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("characters") && body.contains("\"param\":\"messages\""),
        "{body}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    // The body itself (16 MiB, parsed into a string) is most of what remains.
    assert!(grew < 200 * MIB, "peak memory grew by {} MiB", grew / MIB);
}

/// A file that starts as a PNG and is `len` bytes long (sparse: it takes no disk).
fn padded_png(path: &Path, len: u64) {
    let mut png = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut png),
        &[0u8; 16 * 16 * 3],
        16,
        16,
        image::ExtendedColorType::Rgb8,
    )
    .unwrap();
    std::fs::write(path, &png).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn image_path_input(path: &Path) -> serde_json::Value {
    serde_json::json!({"input": [{"type": "image_url", "image_url": {"url": path.to_str().unwrap()}}]})
}

#[test]
fn file_paths_name_regular_files_sized_before_they_are_read_and_never_wedge_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.png");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let big = dir.path().join("big.png");
    padded_png(&big, 2 << 30);

    let mut server = Server::start(&[
        "--allow-file-paths",
        "--max-image-memory-mb",
        "64",
        "--request-timeout",
        "5",
    ]);
    let (status, body) = server.post("/v1/embeddings", &serde_json::json!({"input": "warm up"}));
    assert_eq!(status, 200, "{body}");
    let baseline = server.memory("VmRSS");

    // Before: 504 at --request-timeout, and a thread blocked for good on the FIFO.
    let started = Instant::now();
    let (status, body) = server.post("/v1/embeddings", &image_path_input(&fifo));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a regular file"), "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    // Before: 746 MiB read per request before the 400.
    let started = Instant::now();
    let (status, body) = server.post("/v1/embeddings", &image_path_input(&big));
    assert_eq!(status, 413, "{body}");
    assert!(
        body.contains("big.png") && body.contains("2048 MiB"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let grew = server.memory("VmHWM").saturating_sub(baseline);
    assert!(grew < 64 * MIB, "peak memory grew by {} MiB", grew / MIB);

    // Before: SIGTERM logged "stopped" and the process kept running.
    let took = server.terminate(Duration::from_secs(10));
    assert!(took.is_some(), "still running 10 s after SIGTERM");
}

#[test]
fn shutdown_ends_within_its_deadline_whatever_a_connection_is_doing() {
    let mut server = Server::start(&["--body-timeout", "120", "--shutdown-timeout", "1"]);
    // A body that starts and never finishes: the request is in flight until --body-timeout.
    let mut slow = TcpStream::connect(server.addr).unwrap();
    slow.write_all(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"input\": ",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Before: the graceful shutdown waited for that request, here 120 s.
    let took = server.terminate(Duration::from_secs(10));
    eprintln!("stopped in {took:?}");
    let took = took.expect("still running 10 s after SIGTERM with --shutdown-timeout 1");
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(slow);
}
