//! `tessera bench serve`: a load test of `tessera serve` on loopback.
//!
//! It starts the server as a child process on a free loopback port (or drives one at `--url`),
//! waits for `/health`, then runs bounded phases (each at most `--requests` requests and
//! `--phase-secs` seconds):
//! 1. `text_cN`: one short text per request from N concurrent clients, for each N in `--clients`;
//! 2. `mixed`: `--image-clients` clients send large images without pause while one client sends
//!    short queries; its p50/p99 is the latency of a short query while images are in flight;
//! 3. `burst`: `--burst` image requests at once, more than `--max-queue` admits: the server must
//!    answer 429 to the excess (not queue it), and its peak RSS growth is reported.
//!
//! One JSON line per phase on stdout (throughput, p50/p99 in ms, status counts, server RSS from
//! /proc), a table on stderr. With `--check` it exits non-zero on any unexpected status or
//! transport error, a burst without 429s, or RSS growth above `--max-rss-growth-mb`. The child
//! is stopped with SIGTERM and must exit cleanly (graceful shutdown).

use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use clap::Args;
use serde_json::json;
use tessera_core::{Error, Result};

use crate::device::DeviceArgs;
use crate::stdout::outln;

#[derive(Args)]
pub struct LoadTest {
    /// Drive a running server instead of starting one (RSS only with --server-pid).
    #[arg(long, env = "TESSERA_LOADTEST_URL")]
    url: Option<String>,
    /// The PID of the server at --url, for its memory figures.
    #[arg(long)]
    server_pid: Option<u32>,
    /// API key of the server at --url.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model folder for the started server (default: the bundled miniature model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<String>,
    /// Requests per phase at most.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Seconds per phase at most.
    #[arg(long, default_value_t = 60)]
    phase_secs: u64,
    /// Concurrent clients of the text phases, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    clients: Vec<usize>,
    /// Clients sending images during the mixed phase.
    #[arg(long, default_value_t = 2)]
    image_clients: usize,
    /// Size of the generated images, WIDTHxHEIGHT (random noise PNG).
    #[arg(long, default_value = "1024x768")]
    image_size: String,
    /// Requests fired at once in the burst phase, more than --max-queue (0 skips it).
    #[arg(long, default_value_t = 128)]
    burst: usize,
    /// Images per burst request.
    #[arg(long, default_value_t = 4)]
    burst_images: usize,
    /// The started server's --max-queue: above the clients of any phase, below --burst.
    #[arg(long, default_value_t = 32)]
    max_queue: usize,
    /// The started server's --schedule (lanes or fifo).
    #[arg(long, default_value = "lanes")]
    schedule: String,
    /// Extra arguments for the started server, e.g. "--max-batch-tokens 16384".
    #[arg(long, allow_hyphen_values = true)]
    server_args: Option<String>,
    /// Seconds to wait for the started server to load its model.
    #[arg(long, default_value_t = 600)]
    load_secs: u64,
    /// Where the started server's log goes (default: a temporary file, shown on failure).
    #[arg(long)]
    server_log: Option<PathBuf>,
    /// Fail on unexpected statuses, a burst without 429s, or RSS growth above the limit.
    #[arg(long)]
    check: bool,
    /// Largest server RSS growth accepted by --check, in MiB (peak against the start).
    #[arg(long, default_value_t = 1024)]
    max_rss_growth_mb: u64,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(args: LoadTest) -> Result<()> {
    let most_clients = args
        .clients
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(1 + args.image_clients);
    if args.url.is_none() && most_clients > args.max_queue {
        return Err(Error::input(format!(
            "--max-queue {} is below the {most_clients} concurrent clients of a phase: they would get 429s",
            args.max_queue
        )));
    }
    if args.burst > 0 && args.url.is_none() && args.burst <= args.max_queue {
        return Err(Error::input(format!(
            "--burst {} does not overflow --max-queue {}",
            args.burst, args.max_queue
        )));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::backend("tokio", e))?;
    runtime.block_on(drive(args))
}

/// The server under test: started here (and stopped at the end) or found at --url.
pub(crate) struct Target {
    url: String,
    pid: Option<u32>,
    child: Option<Child>,
    log: Option<PathBuf>,
    _log_dir: Option<tempfile::TempDir>,
}

impl Target {
    fn start(args: &LoadTest) -> Result<Self> {
        let mut serve = vec![
            "--max-queue".to_string(),
            args.max_queue.to_string(),
            "--schedule".to_string(),
            args.schedule.clone(),
        ];
        serve.extend(args.device.to_args());
        if let Some(m) = &args.model {
            serve.extend(["--model".to_string(), m.clone()]);
        }
        if let Some(extra) = &args.server_args {
            serve.extend(extra.split_whitespace().map(str::to_string));
        }
        Target::spawn(
            args.url.as_deref(),
            args.server_pid,
            &serve,
            args.server_log.as_ref(),
        )
    }

    /// The server at `url` (`pid` for its memory figures), or a `tessera serve` started here on
    /// a free loopback port with `serve` arguments, its log in `log` (a temporary file when
    /// `None`).
    pub(crate) fn spawn(
        url: Option<&str>,
        pid: Option<u32>,
        serve: &[String],
        log: Option<&PathBuf>,
    ) -> Result<Self> {
        if let Some(url) = url {
            return Ok(Target {
                url: url.trim_end_matches('/').to_string(),
                pid,
                child: None,
                log: None,
                _log_dir: None,
            });
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::backend("loadtest", format!("no free loopback port: {e}")))?
            .port();
        let (log, log_dir) = match log {
            Some(p) => (p.clone(), None),
            None => {
                let dir = tempfile::tempdir().map_err(|e| Error::io("<tempdir>", e))?;
                (dir.path().join("server.log"), Some(dir))
            }
        };
        let log_file = std::fs::File::create(&log).map_err(|e| Error::io(&log, e))?;
        let exe = std::env::current_exe().map_err(|e| Error::io("<current exe>", e))?;
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(serve);
        cmd.env_remove("TESSERA_API_KEY")
            .env_remove("TESSERA_MODEL")
            .env("RUST_LOG", "warn,tessera_server=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        let child = cmd
            .spawn()
            .map_err(|e| Error::backend("loadtest", format!("starting the server: {e}")))?;
        Ok(Target {
            url: format!("http://127.0.0.1:{port}"),
            pid: Some(child.id()),
            child: Some(child),
            log: Some(log),
            _log_dir: log_dir,
        })
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.pid
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The server's log, for error messages.
    pub(crate) fn log_tail(&self) -> String {
        let Some(p) = &self.log else {
            return String::new();
        };
        let text = std::fs::read_to_string(p).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("\nserver log ({}):\n{tail}", p.display())
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM, then wait for a clean exit (graceful shutdown).
    pub(crate) fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        if !sent.is_ok_and(|s| s.success()) {
            let _ = child.kill();
            return Err(Error::backend(
                "loadtest",
                "could not send SIGTERM to the server",
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(Error::backend(
                        "loadtest",
                        format!(
                            "the server exited with {status} after SIGTERM{}",
                            self.log_tail()
                        ),
                    ));
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = child.kill();
                    return Err(Error::backend(
                        "loadtest",
                        "the server did not stop within 60 s of SIGTERM",
                    ));
                }
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Resident and peak resident memory of a process, in MiB, from /proc.
pub(crate) fn rss_mb(pid: Option<u32>) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let field = |name: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// What one phase saw.
#[derive(Default)]
pub(crate) struct Stats {
    /// Latency of each answered request, ms.
    pub latencies: Vec<f64>,
    /// Answers by status; `0` counts transport errors.
    pub statuses: BTreeMap<u16, usize>,
    /// A few error messages to show.
    pub samples: Vec<String>,
    pub inputs: usize,
}

impl Stats {
    pub(crate) fn merge(&mut self, other: Stats) {
        self.latencies.extend(other.latencies);
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
        for s in other.samples {
            if self.samples.len() < 3 {
                self.samples.push(s);
            }
        }
        self.inputs += other.inputs;
    }

    pub(crate) fn count(&self, status: u16) -> usize {
        self.statuses.get(&status).copied().unwrap_or(0)
    }

    /// Answers other than 200 and the allowed statuses.
    pub(crate) fn unexpected(&self, allowed: &[u16]) -> usize {
        self.statuses
            .iter()
            .filter(|(s, _)| **s != 200 && !allowed.contains(s))
            .map(|(_, n)| n)
            .sum()
    }

    pub(crate) fn percentile(&self, q: f64) -> Option<f64> {
        let mut v = self.latencies.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        Some(v[i])
    }
}

/// A request body, shared by every request that sends it.
pub(crate) type Body = Arc<dyn Fn(usize) -> reqwest::Body + Send + Sync>;

pub(crate) struct Client {
    pub http: reqwest::Client,
    pub url: String,
    pub key: Option<String>,
    /// The route posted to.
    pub path: &'static str,
}

impl Client {
    /// A client of the server at `url` posting to `path`.
    pub(crate) fn new(url: &str, key: Option<String>, path: &'static str) -> Result<Self> {
        Ok(Client {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(900))
                .pool_max_idle_per_host(256)
                .build()
                .map_err(|e| Error::backend("http client", e))?,
            url: url.to_string(),
            key,
            path,
        })
    }

    async fn post(&self, body: reqwest::Body, inputs: usize) -> Stats {
        let mut stats = Stats::default();
        let mut req = self
            .http
            .post(format!("{}{}", self.url, self.path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = &self.key {
            req = req.bearer_auth(k);
        }
        let started = Instant::now();
        let status = match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let text = resp.text().await.unwrap_or_default();
                if status == 200 {
                    stats.latencies.push(started.elapsed().as_secs_f64() * 1e3);
                    stats.inputs += inputs;
                } else {
                    stats
                        .samples
                        .push(format!("{status}: {}", first_line(&text)));
                }
                status
            }
            Err(e) => {
                stats.samples.push(format!("transport: {e}"));
                0
            }
        };
        stats.statuses.insert(status, 1);
        stats
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").get(..300).unwrap_or(s)
}

/// Clients sending `body` over and over in the background of a measured phase.
pub(crate) struct Load<'a> {
    pub client: &'a Arc<Client>,
    pub clients: usize,
    pub body: Body,
    /// How long they run before the measured phase starts, to get their first requests in.
    pub settle: Duration,
    /// Who they are, for the error if their task fails.
    pub what: &'static str,
}

/// `requests` single-input requests of `body` from one client while `load` runs in the
/// background (stopped once they are done): the foreground phase's and the background's stats
/// and seconds. The foreground ends by `limit`, the background by twice that.
pub(crate) async fn under_load(
    load: Load<'_>,
    client: &Arc<Client>,
    requests: usize,
    body: Body,
    limit: Duration,
) -> Result<((Stats, f64), (Stats, f64))> {
    let stop = Arc::new(AtomicBool::new(false));
    let background = {
        let (bg, stop, bg_body, n) = (load.client.clone(), stop.clone(), load.body, load.clients);
        tokio::spawn(async move {
            phase(
                &bg,
                n,
                usize::MAX,
                Instant::now() + limit * 2,
                1,
                bg_body,
                Some(stop),
            )
            .await
        })
    };
    tokio::time::sleep(load.settle).await;
    let fg = phase(client, 1, requests, Instant::now() + limit, 1, body, None).await;
    stop.store(true, Ordering::Relaxed);
    let bg = background
        .await
        .map_err(|e| Error::backend("loadtest", format!("{}: {e}", load.what)))?;
    Ok((fg, bg))
}

/// `clients` tasks sending `body(i)` until `requests` are sent, the deadline passes or `stop`.
pub(crate) async fn phase(
    client: &Arc<Client>,
    clients: usize,
    requests: usize,
    deadline: Instant,
    inputs_per_request: usize,
    body: Body,
    stop: Option<Arc<AtomicBool>>,
) -> (Stats, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients.max(1))
        .map(|_| {
            let (client, next, body, stop) =
                (client.clone(), next.clone(), body.clone(), stop.clone());
            tokio::spawn(async move {
                let mut stats = Stats::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let stopped = stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed));
                    if i >= requests || Instant::now() >= deadline || stopped {
                        break;
                    }
                    stats.merge(client.post(body(i), inputs_per_request).await);
                }
                stats
            })
        })
        .collect();
    let mut total = Stats::default();
    for t in tasks {
        if let Ok(s) = t.await {
            total.merge(s);
        }
    }
    (total, started.elapsed().as_secs_f64())
}

pub(crate) fn text_body() -> Body {
    Arc::new(|i| {
        let text =
            format!("query {i}: which planet in the solar system has the largest number of moons?");
        reqwest::Body::from(json!({ "input": text }).to_string())
    })
}

/// A noise PNG (incompressible, so decoding costs what a photo costs) as a data URL.
fn image_data_url(width: u32, height: u32, seed: u64) -> Result<String> {
    let mut rng = crate::noise::XorShift::new(seed);
    let pixels: Vec<u8> = (0..width as usize * height as usize * 3)
        .map(|_| (rng.next_u64() >> 24) as u8)
        .collect();
    let img = image::RgbImage::from_raw(width, height, pixels)
        .ok_or_else(|| Error::input("bad image size"))?;
    let mut png = Cursor::new(Vec::new());
    img.write_to(&mut png, image::ImageFormat::Png)
        .map_err(|e| Error::backend("png", e))?;
    Ok(format!(
        "data:image/png;base64,{}",
        STANDARD.encode(png.into_inner())
    ))
}

fn image_body(urls: &[String]) -> Body {
    let parts: Vec<serde_json::Value> = urls
        .iter()
        .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
        .collect();
    let body = bytes_body(json!({ "input": parts }));
    Arc::new(move |_| reqwest::Body::from(body.clone()))
}

fn bytes_body(v: serde_json::Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

fn parse_size(s: &str) -> Result<(u32, u32)> {
    s.split_once('x')
        .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
        .filter(|&(w, h)| w > 0 && h > 0)
        .ok_or_else(|| Error::input(format!("--image-size {s:?}: expected WIDTHxHEIGHT")))
}

pub(crate) struct Report {
    pub lines: Vec<serde_json::Value>,
    pub failures: Vec<String>,
}

impl Report {
    pub(crate) fn phase(
        &mut self,
        name: &str,
        stats: &Stats,
        seconds: f64,
        rss: Option<(f64, f64)>,
        allowed: &[u16],
    ) -> Result<()> {
        self.phase_with(name, stats, seconds, rss, allowed, json!({}))
    }

    /// [`Report::phase`] with `extra` fields in its line.
    pub(crate) fn phase_with(
        &mut self,
        name: &str,
        stats: &Stats,
        seconds: f64,
        rss: Option<(f64, f64)>,
        allowed: &[u16],
        extra: serde_json::Value,
    ) -> Result<()> {
        let unexpected = stats.unexpected(allowed);
        let mut line = json!({
            "phase": name,
            "ok": stats.count(200),
            "rejected_429": stats.count(429),
            "unexpected": unexpected,
            "statuses": stats.statuses,
            "seconds": seconds,
            "requests_per_s": stats.count(200) as f64 / seconds.max(1e-9),
            "inputs_per_s": stats.inputs as f64 / seconds.max(1e-9),
            "p50_ms": stats.percentile(0.50),
            "p95_ms": stats.percentile(0.95),
            "p99_ms": stats.percentile(0.99),
            "max_ms": stats.percentile(1.0),
            "server_rss_mb": rss.map(|r| r.0),
            "server_peak_rss_mb": rss.map(|r| r.1),
            "errors": stats.samples,
        });
        if let (Some(l), Some(e)) = (line.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                l.insert(k.clone(), v.clone());
            }
        }
        outln!("{line}")?;
        if unexpected > 0 {
            self.failures.push(format!(
                "{name}: {unexpected} unexpected answers, e.g. {:?}",
                stats.samples
            ));
        }
        self.lines.push(line);
        Ok(())
    }

    pub(crate) fn table(&self) {
        eprintln!(
            "{:<12} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10}",
            "phase", "ok", "429", "errors", "inputs/s", "p50 ms", "p99 ms", "peak MiB"
        );
        for l in &self.lines {
            let f = |k: &str| l[k].as_f64().map_or("-".to_string(), |v| format!("{v:.1}"));
            let n = |k: &str| l[k].as_u64().unwrap_or(0);
            eprintln!(
                "{:<12} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10}",
                l["phase"].as_str().unwrap_or(""),
                n("ok"),
                n("rejected_429"),
                n("unexpected"),
                f("inputs_per_s"),
                f("p50_ms"),
                f("p99_ms"),
                f("server_peak_rss_mb"),
            );
        }
    }
}

async fn drive(args: LoadTest) -> Result<()> {
    let (w, h) = parse_size(&args.image_size)?;
    let mut target = Target::start(&args)?;
    let client = Arc::new(Client::new(
        &target.url,
        args.api_key.clone(),
        "/v1/embeddings",
    )?);
    wait_ready(&client, &mut target, Duration::from_secs(args.load_secs)).await?;
    let result = phases(&args, &client, &target, (w, h)).await;
    let stopped = target.stop();
    let report = result?;
    report.table();
    stopped?;
    if args.check && !report.failures.is_empty() {
        return Err(Error::backend(
            "loadtest",
            format!("{}{}", report.failures.join("; "), target.log_tail()),
        ));
    }
    Ok(())
}

pub(crate) async fn wait_ready(
    client: &Client,
    target: &mut Target,
    limit: Duration,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = target.exited() {
            return Err(Error::backend(
                "loadtest",
                format!(
                    "the server exited with {status} before it was ready{}",
                    target.log_tail()
                ),
            ));
        }
        let ready = client
            .http
            .get(format!("{}/health", client.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::backend(
                "loadtest",
                format!(
                    "the server was not ready within {limit:?}{}",
                    target.log_tail()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn phases(
    args: &LoadTest,
    client: &Arc<Client>,
    target: &Target,
    (w, h): (u32, u32),
) -> Result<Report> {
    let mut report = Report {
        lines: Vec::new(),
        failures: Vec::new(),
    };
    let limit = Duration::from_secs(args.phase_secs);
    let image = image_data_url(w, h, 7)?;
    // Warm-up: one text and one image, so the first measured requests pay no first-use costs.
    let (warm, _) = phase(client, 1, 1, Instant::now() + limit, 1, text_body(), None).await;
    let (warm_img, _) = phase(
        client,
        1,
        1,
        Instant::now() + limit,
        1,
        image_body(std::slice::from_ref(&image)),
        None,
    )
    .await;
    if warm.count(200) + warm_img.count(200) != 2 {
        let mut samples = warm.samples;
        samples.extend(warm_img.samples);
        return Err(Error::backend(
            "loadtest",
            format!("warm-up failed: {samples:?}"),
        ));
    }
    let rss_start = rss_mb(target.pid);

    for &n in &args.clients {
        let (stats, secs) = phase(
            client,
            n,
            args.requests,
            Instant::now() + limit,
            1,
            text_body(),
            None,
        )
        .await;
        report.phase(&format!("text_c{n}"), &stats, secs, rss_mb(target.pid), &[])?;
    }

    if args.image_clients > 0 {
        let ((text, secs), (imgs, img_secs)) = under_load(
            Load {
                client,
                clients: args.image_clients,
                body: image_body(std::slice::from_ref(&image)),
                settle: Duration::from_millis(200),
                what: "image clients",
            },
            client,
            args.requests,
            text_body(),
            limit,
        )
        .await?;
        report.phase("mixed_text", &text, secs, rss_mb(target.pid), &[])?;
        report.phase("mixed_image", &imgs, img_secs, rss_mb(target.pid), &[])?;
    }

    if args.burst > 0 {
        let urls: Vec<String> = (0..args.burst_images)
            .map(|i| image_data_url(w, h, 100 + i as u64))
            .collect::<Result<_>>()?;
        // Reset the peak (VmHWM) so the burst's own peak is measured (best effort: Linux ≥ 4.0).
        if let Some(pid) = target.pid {
            let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        }
        let before = rss_mb(target.pid);
        let (stats, secs) = phase(
            client,
            args.burst,
            args.burst,
            Instant::now() + limit,
            args.burst_images,
            image_body(&urls),
            None,
        )
        .await;
        let after = rss_mb(target.pid);
        report.phase("burst", &stats, secs, after, &[429])?;
        if stats.count(429) == 0 {
            report.failures.push(format!(
                "burst: {} requests against --max-queue {} got no 429",
                args.burst, args.max_queue
            ));
        }
        if let (Some((start, _)), Some((_, peak))) = (before, after) {
            let growth = peak - start;
            let line = json!({"phase": "memory", "rss_before_burst_mb": start,
                "peak_rss_during_burst_mb": peak, "growth_mb": growth,
                "rss_after_warmup_mb": rss_start.map(|r| r.0)});
            outln!("{line}")?;
            if growth > args.max_rss_growth_mb as f64 {
                report.failures.push(format!(
                    "server peak RSS grew by {growth:.0} MiB during the burst, more than --max-rss-growth-mb {}",
                    args.max_rss_growth_mb
                ));
            }
        } else if args.check {
            report.failures.push(
                "no server memory figures (/proc not readable; give --server-pid with --url)"
                    .into(),
            );
        }
    }
    Ok(report)
}
