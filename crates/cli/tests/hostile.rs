//! Hostile input, round two (issue 26): prompts, chat templates, file paths, latents and cache
//! sizes that used to exhaust memory or wedge a process. Each case runs the `tessera` binary as
//! a process of its own and checks its answer, its wall time and its peak resident memory
//! (`VmHWM` of `/proc/PID/status`, read while it runs), with limits well below what each case
//! cost before its fix (quoted beside it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_THREADS")
        .env("TESSERA_DEVICE", "cpu")
        .env(
            "HF_HUB_CACHE",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/no-hf-cache"),
        );
    c
}

/// A finished command: what it printed on stderr, how long it took and its peak `VmHWM`.
struct Run {
    status: ExitStatus,
    stderr: String,
    elapsed: Duration,
    peak_rss: u64,
}

impl Run {
    fn assert_within(&self, time: Duration, memory_mib: u64) {
        assert!(
            self.elapsed < time,
            "took {:?}: {}",
            self.elapsed,
            self.stderr
        );
        assert!(
            self.peak_rss < memory_mib * MIB,
            "peak RSS {} MiB (limit {memory_mib} MiB): {}",
            self.peak_rss / MIB,
            self.stderr
        );
    }

    fn assert_fails_with(&self, needles: &[&str]) {
        assert!(!self.status.success(), "expected failure: {}", self.stderr);
        // An error of ours exits 1; an abort (SIGABRT) or a kill is no answer.
        assert_eq!(
            self.status.code(),
            Some(1),
            "{:?}: {}",
            self.status,
            self.stderr
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        for n in needles {
            assert!(
                self.stderr.contains(n),
                "stderr lacks {n:?}: {}",
                self.stderr
            );
        }
    }
}

fn drain(mut from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = from.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Run `tessera args` with `stdin` as its input, killed after `deadline`, sampling `VmHWM`
/// every millisecond (it only grows).
fn measured(args: &[&str], stdin: &[u8], deadline: Duration) -> Run {
    let mut child = tessera()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tessera runs");
    let stderr = drain(child.stderr.take().unwrap());
    let input = stdin.to_vec();
    let mut pipe = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        // The child may stop reading (and close the pipe) early: not an error here.
        let _ = pipe.write_all(&input);
    });
    let pid = child.id();
    let started = Instant::now();
    let mut peak = 0;
    let mut killed = false;
    let status = loop {
        if let Some(hwm) = proc_status(pid, "VmHWM") {
            peak = peak.max(hwm);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if !killed && started.elapsed() > deadline {
            let _ = child.kill();
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = feeder.join();
    let run = Run {
        status,
        stderr: stderr.join().unwrap(),
        elapsed: started.elapsed(),
        peak_rss: peak,
    };
    assert!(!killed, "still running after {deadline:?}: {}", run.stderr);
    eprintln!(
        "tessera {}: {:.2} s, peak RSS {} MiB",
        args.join(" "),
        run.elapsed.as_secs_f64(),
        run.peak_rss / MIB
    );
    run
}

/// A memory line of `/proc/PID/status` in bytes; `None` once the process has exited.
fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

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

#[test]
fn a_chat_template_that_doubles_a_string_fails_naming_it_in_bounded_memory() {
    // Before: "memory allocation of 2147483664 bytes failed", SIGABRT.
    let dir = tempfile::tempdir().unwrap();
    let model = bundled_copy("lfm2vl-mini", dir.path());
    std::fs::write(model.join("chat_template.jinja"), DOUBLING).unwrap();
    let run = measured(
        &[
            "chat",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ],
        b"",
        Duration::from_secs(60),
    );
    run.assert_fails_with(&["chat_template.jinja", "budget"]);
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
    let run = measured(
        &[
            "chat",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ],
        b"",
        Duration::from_secs(60),
    );
    run.assert_fails_with(&["tokenizer_config.json", "budget"]);
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
        b"",
        Duration::from_secs(60),
    );
    run.assert_fails_with(&["chat_template.jinja", "budget"]);
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
        &input,
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
                b"",
                Duration::from_secs(60),
            );
            run.assert_fails_with(&[needle]);
            run.assert_within(Duration::from_secs(10), 300);
        }
    }
}

// ---- the server, as a process of its own ------------------------------------------------------

/// `tessera serve` on a free loopback port, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let port = free_port();
        let child = tessera()
            .args(["serve", "--port", &port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tessera serve runs");
        let server = Server {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        let started = Instant::now();
        while server.get("/health").0 != 200 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn request(&self, head: &str, body: &[u8]) -> (u16, String) {
        let Ok(mut s) = TcpStream::connect(self.addr) else {
            return (0, String::new());
        };
        let sent = s
            .write_all(head.as_bytes())
            .and_then(|()| s.write_all(body));
        let mut raw = Vec::new();
        if sent.is_err() || s.read_to_end(&mut raw).is_err() || raw.len() < 12 {
            return (0, String::new());
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text[9..12].parse().unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, body.to_string())
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.request(
            &format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"),
            b"",
        )
    }

    fn post(&self, path: &str, body: &serde_json::Value) -> (u16, String) {
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.request(&head, body.as_bytes())
    }

    fn memory(&self, field: &str) -> u64 {
        proc_status(self.child.id(), field).unwrap_or_else(|| panic!("no {field}"))
    }

    /// SIGTERM, then the time the process took to end (`None`: still running after `limit`).
    fn terminate(&mut self, limit: Duration) -> Option<Duration> {
        // SAFETY: `kill` with a child's pid and a valid signal number has no memory effects.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(sent, 0);
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.child.try_wait().unwrap().is_some() {
                return Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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
        b"",
        Duration::from_secs(60),
    );
    run.assert_fails_with(&["1000000 sequences", "--max-sequences"]);
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
