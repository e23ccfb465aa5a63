//! Hostile and careless input where the danger was time or memory: a crafted image at the pixel
//! limit (CLI and server), an endless text file, an absurd thread count. Each case checks the
//! message and measures the child process: its wall time and its peak resident memory, `VmHWM`
//! of `/proc/PID/status`. (`wait4`'s `ru_maxrss` would not do: it counts the memory the child
//! shared with this test process between fork and exec.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;

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

/// A finished command: what it printed, how long it took and the highest `VmHWM` read while it
/// ran (every millisecond; it only grows, so only the last millisecond can be missed).
struct Run {
    status: ExitStatus,
    stderr: String,
    elapsed: Duration,
    peak_rss: u64,
}

impl Run {
    /// Under 10 s and 300 MiB: what a refusal from a header or a first line costs.
    fn assert_quick_and_small(&self) {
        assert!(self.elapsed < Duration::from_secs(10), "{:?}", self.elapsed);
        assert!(
            self.peak_rss < 300 * MIB,
            "peak RSS {} MiB",
            self.peak_rss / MIB
        );
    }

    fn assert_fails_with(&self, needles: &[&str]) {
        assert!(!self.status.success(), "expected failure: {}", self.stderr);
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

/// Run `tessera args`, killed after `deadline`, measuring it with `wait4`.
fn measured(args: &[&str], deadline: Duration) -> Run {
    let mut child = tessera()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tessera runs");
    let stderr = drain(child.stderr.take().unwrap());
    let pid = child.id();
    let started = Instant::now();
    let mut peak = 0;
    let mut killed = false;
    let status = loop {
        // Read before reaping: the count goes with the process.
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

/// A memory line of `/proc/PID/status` (`VmRSS`, `VmHWM`) in bytes; `None` once the process
/// has exited.
fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// An 8-bit grey PNG of 89,478,485 × 1 pixels — exactly Pillow's bomb threshold — holding one
/// row of zeros, which zlib squeezes into about 90 KB.
fn wide_png() -> Vec<u8> {
    const WIDTH: u32 = 89_478_485;
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, WIDTH, 1);
        enc.set_color(png::ColorType::Grayscale);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().unwrap();
        let mut w = writer.stream_writer().unwrap();
        let zeros = vec![0u8; 1 << 20];
        let mut left = WIDTH as usize;
        while left > 0 {
            let n = left.min(zeros.len());
            w.write_all(&zeros[..n]).unwrap();
            left -= n;
        }
        w.finish().unwrap();
        writer.finish().unwrap();
    }
    assert!(out.len() < 200_000, "{} bytes", out.len());
    out
}

/// A large but ordinary image: 6000 × 4000 grey (24 MP decoded, a few KB as a file).
fn large_png() -> Vec<u8> {
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &vec![90u8; 6000 * 4000],
        6000,
        4000,
        image::ExtendedColorType::L8,
    )
    .unwrap();
    out
}

#[test]
fn a_wide_png_at_the_pixel_limit_is_refused_from_its_header_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.png");
    std::fs::write(&path, wide_png()).unwrap();
    let run = measured(
        &["embed", "--image", path.to_str().unwrap()],
        Duration::from_secs(60),
    );
    // Before: 3.8 GB and 16 s in the resize, then this refusal.
    run.assert_fails_with(&[
        "wide.png",
        "89478485×1 image becomes a grid of 210×3 patches",
        "position_embedding_size",
    ]);
    run.assert_quick_and_small();
}

#[test]
fn an_endless_text_file_fails_at_its_first_line_in_bounded_memory() {
    // Before: /dev/zero grew by 1.3 GB every 2 s until the machine ran out.
    let run = measured(
        &["embed", "--text-file", "/dev/zero"],
        Duration::from_secs(20),
    );
    run.assert_fails_with(&["/dev/zero: line 1 is longer than 1 MiB"]);
    run.assert_quick_and_small();
}

#[test]
fn an_absurd_thread_count_is_capped_with_a_warning() {
    // Before: --threads 100000 started threads until it stalled.
    let run = measured(
        &["--threads", "100000", "embed", "--text", "hi"],
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("warning: --threads 100000 is more than 4×"),
        "{}",
        run.stderr
    );
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
}

// ---- the server, as a process of its own -------------------------------------------------

/// `tessera serve` on a free loopback port, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
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

    fn embed(&self, body: &serde_json::Value) -> (u16, String) {
        let body = body.to_string();
        let head = format!(
            "POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.request(&head, body.as_bytes())
    }

    /// A line of `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`).
    fn memory(&self, field: &str) -> u64 {
        proc_status(self.child.id(), field).unwrap_or_else(|| panic!("no {field}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn image_input(png: &[u8]) -> serde_json::Value {
    let url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png)
    );
    serde_json::json!({"input": [{"type": "image_url", "image_url": {"url": url}}]})
}

#[test]
fn the_server_stays_within_its_image_memory_while_clients_send_the_wide_image() {
    const BUDGET_MIB: u64 = 128;
    let server = Server::start(&["--max-image-memory-mb", &BUDGET_MIB.to_string()]);
    let (status, body) = server.embed(&serde_json::json!({"input": "warm up"}));
    assert_eq!(status, 200, "{body}");
    let baseline = server.memory("VmRSS");

    let server = std::sync::Arc::new(server);
    let (wide, large) = (image_input(&wide_png()), image_input(&large_png()));
    let mut clients = Vec::new();
    for i in 0..6 {
        let (server, body) = (
            server.clone(),
            if i % 2 == 0 { &wide } else { &large }.clone(),
        );
        clients.push(std::thread::spawn(move || {
            let started = Instant::now();
            let answer = server.embed(&body);
            (i % 2 == 0, answer, started.elapsed())
        }));
    }
    // Short texts keep being answered while the images are in.
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = Instant::now();
        let (status, body) = server.embed(&serde_json::json!({"input": format!("query {i}")}));
        assert_eq!(status, 200, "{body}");
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(Duration::from_millis(30));
    }
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let grew = server.memory("VmHWM").saturating_sub(baseline);
    eprintln!(
        "server: peak grew by {} MiB (budget {BUDGET_MIB} MiB); slowest text {slowest:?}",
        grew / MIB
    );
    assert!(
        grew < (BUDGET_MIB + 64) * MIB,
        "peak memory grew by {} MiB with a budget of {BUDGET_MIB} MiB",
        grew / MIB
    );
    let mut served = 0;
    for (is_wide, (status, body), took) in answers {
        if is_wide {
            assert!(
                took < Duration::from_secs(5),
                "the wide image took {took:?}"
            );
            // Before: decoded (360 MB) and only then refused as over the budget; under a
            // budget that fits it, resized in 3.8 GB and 15 s, then refused for its grid.
            assert_eq!(status, 400, "{body}");
            assert!(body.contains("position_embedding_size"), "{body}");
        } else {
            // One large image at a time fits the budget; the others wait their turn (429).
            assert!(status == 200 || status == 429, "{status}: {body}");
            served += usize::from(status == 200);
        }
    }
    assert!(served >= 1, "no large image was served");
    assert!(
        slowest < Duration::from_secs(5),
        "a text waited {slowest:?}"
    );
}

/// Where the bundled model's image budget puts a large image: accepted, so the memory measured
/// above is the decoding's and not an early refusal's.
#[test]
fn the_large_image_is_one_the_model_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("large.png");
    std::fs::write(&path, large_png()).unwrap();
    let run = measured(
        &["embed", "--image", path.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{}", run.stderr);
}
