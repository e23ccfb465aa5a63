//! What the bad-input tests share (`bad_input.rs`, `hostile.rs`): the `tessera` binary as a
//! child process whose time and peak memory are measured, and `tessera serve` on a loopback
//! port spoken to with plain HTTP/1.1; and reading what `tessera embed` prints and the PNGs
//! `tessera generate` writes.
#![allow(dead_code)] // each test file uses its own part

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;

/// The binary under test, on the CPU, with no model or thread count from the environment and
/// a Hugging Face cache that holds nothing and is never filled from the network.
pub fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_THREADS")
        .env("TESSERA_DEVICE", "cpu")
        .env(
            "HF_HUB_CACHE",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/no-hf-cache"),
        )
        .env("HF_HUB_OFFLINE", "1");
    c
}

/// A finished command: what it printed on stderr, how long it took and the highest `VmHWM`
/// read while it ran (every millisecond; it only grows, so only the last millisecond can be
/// missed).
pub struct Run {
    pub status: ExitStatus,
    pub stderr: String,
    pub elapsed: Duration,
    pub peak_rss: u64,
}

impl Run {
    pub fn assert_within(&self, time: Duration, memory_mib: u64) {
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

    /// Failed, without a panic, saying each of `needles`.
    pub fn assert_fails_with(&self, needles: &[&str]) {
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

    /// As [`Run::assert_fails_with`], and by our own error (exit 1): an abort (SIGABRT) or a
    /// kill is no answer.
    pub fn assert_errs_with(&self, needles: &[&str]) {
        self.assert_fails_with(needles);
        assert_eq!(
            self.status.code(),
            Some(1),
            "{:?}: {}",
            self.status,
            self.stderr
        );
    }
}

fn drain(mut from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = from.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Run `tessera args` with `stdin` as its input (none: no input at all), killed after
/// `deadline`, sampling `VmHWM` every millisecond.
pub fn measured(args: &[&str], stdin: Option<&[u8]>, deadline: Duration) -> Run {
    let mut child = tessera()
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tessera runs");
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let feeder = stdin.map(|input| {
        let input = input.to_vec();
        let mut pipe = child.stdin.take().expect("piped stdin");
        std::thread::spawn(move || {
            // The child may stop reading (and close the pipe) early: not an error here.
            let _ = pipe.write_all(&input);
        })
    });
    let pid = child.id();
    let started = Instant::now();
    let mut peak = 0;
    let mut killed = false;
    let status = loop {
        // Read before reaping: the count goes with the process.
        if let Some(hwm) = proc_status(pid, "VmHWM") {
            peak = peak.max(hwm);
        }
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if !killed && started.elapsed() > deadline {
            let _ = child.kill();
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    if let Some(f) = feeder {
        let _ = f.join();
    }
    let run = Run {
        status,
        stderr: stderr.join().expect("stderr"),
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
pub fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `tessera serve` on a free loopback port, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a loopback port")
        .local_addr()
        .expect("its address")
        .port()
}

impl Server {
    /// Started with `args` and ready (`/health` answers 200), within 60 s.
    pub fn start(args: &[&str]) -> Server {
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

    /// One request on its own connection: the status (0 when the connection failed) and body.
    pub fn request(&self, head: &str, body: &[u8]) -> (u16, String) {
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

    pub fn get(&self, path: &str) -> (u16, String) {
        self.request(
            &format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"),
            b"",
        )
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, String) {
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.request(&head, body.as_bytes())
    }

    /// A line of `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`).
    pub fn memory(&self, field: &str) -> u64 {
        proc_status(self.child.id(), field).unwrap_or_else(|| panic!("no {field}"))
    }

    /// SIGTERM, then the time the process took to end (`None`: still running after `limit`).
    pub fn terminate(&mut self, limit: Duration) -> Option<Duration> {
        // SAFETY: `kill` with a child's pid and a valid signal number has no memory effects.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(sent, 0);
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.child.try_wait().expect("wait").is_some() {
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

/// The vectors of `tessera embed`'s JSON lines (its default output), in order.
pub fn embedding_lines(stdout: &[u8]) -> Vec<Vec<f64>> {
    String::from_utf8(stdout.to_vec())
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

/// `(width, height, RGB bytes, text chunks)` of a PNG.
pub fn read_png(path: &Path) -> (u32, u32, Vec<u8>, BTreeMap<String, String>) {
    read_png_as(path, png::ColorType::Rgb)
}

/// `(width, height, pixel bytes, text chunks)` of a PNG whose pixels are `color`.
pub fn read_png_as(
    path: &Path,
    color: png::ColorType,
) -> (u32, u32, Vec<u8>, BTreeMap<String, String>) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let text = reader
        .info()
        .utf8_text
        .iter()
        .map(|c| (c.keyword.clone(), c.get_text().unwrap()))
        .collect();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, color);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf, text)
}
