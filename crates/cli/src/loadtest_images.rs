//! `tessera bench serve-images`: a load test of `tessera serve` generating images, with an
//! embedding model beside the image model.
//!
//! It starts the server as a child process on a free loopback port with both models (or drives
//! one at `--url`), waits for `/health`, then runs bounded phases (each at most `--requests`
//! requests and `--phase-secs` seconds):
//! 1. `gen_WxH_cN`: N concurrent clients, each sending one-image generations of W×H in
//!    `--steps` steps without pause, for each size in `--sizes` and each N in `--clients`:
//!    images/s and the latency of a request (p50/p95/p99);
//! 2. `embed_idle`: `--embed-requests` short embedding requests one after another, nothing else
//!    running: their p50/p95;
//! 3. `embed_during`: the same while `--gen-clients` clients generate without pause at the first
//!    size: the latency of an embedding request while generations run;
//! 4. `burst`: `--burst` generation requests at once from `--burst-clients` connections…
//!    more than the server admits: only 200s and 429s are expected, no transport errors, and the
//!    server's peak RSS growth is reported (and bounded by `--max-rss-growth-mb` with `--check`).
//!
//! One JSON line per phase on stdout, a table on stderr. Batched against one-at-a-time: run it
//! twice, the second time with `--server-args --no-image-batching`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;
use tessera_core::{Error, Result};

use crate::device::DeviceArgs;
use crate::loadtest::{Body, Client, Load, Report, Target, phase, rss_mb, under_load, wait_ready};
use crate::stdout::outln;

#[derive(Args)]
pub struct ImageLoadTest {
    /// Drive a running server instead of starting one (RSS only with --server-pid).
    #[arg(long)]
    url: Option<String>,
    /// The PID of the server at --url, for its memory figures.
    #[arg(long)]
    server_pid: Option<u32>,
    /// API key of the server at --url.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The text-to-image model for the started server (served as `image`).
    #[arg(long, default_value = "bundled:zimage")]
    image_model: String,
    /// The embedding model served beside it (as `embed`); `none` for none (no embedding
    /// phases).
    #[arg(long, default_value = "bundled:egemma2")]
    embed_model: String,
    /// Image sizes, comma-separated WIDTHxHEIGHT.
    #[arg(long, value_delimiter = ',', default_value = "512x512,1024x1024")]
    sizes: Vec<String>,
    /// Denoising steps per image.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Concurrent clients of the generation phases, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    clients: Vec<usize>,
    /// Requests per generation phase at most.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Seconds per phase at most.
    #[arg(long, default_value_t = 120)]
    phase_secs: u64,
    /// Embedding requests of each embedding phase.
    #[arg(long, default_value_t = 100)]
    embed_requests: usize,
    /// Clients generating without pause during `embed_during`.
    #[arg(long, default_value_t = 4)]
    gen_clients: usize,
    /// Generation requests fired at once in the burst phase (0 skips it).
    #[arg(long, default_value_t = 0)]
    burst: usize,
    /// Size of the burst's images.
    #[arg(long, default_value = "64x64")]
    burst_size: String,
    /// The started server's --max-queue (per model).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Extra arguments for the started server, e.g. "--no-image-batching".
    #[arg(long, allow_hyphen_values = true)]
    server_args: Option<String>,
    /// Seconds to wait for the started server to load its models.
    #[arg(long, default_value_t = 900)]
    load_secs: u64,
    /// Where the started server's log goes (default: a temporary file, shown on failure).
    #[arg(long)]
    server_log: Option<std::path::PathBuf>,
    /// Fail on unexpected statuses or transport errors, a burst without 429s, or RSS growth
    /// above the limit.
    #[arg(long)]
    check: bool,
    /// Largest server RSS growth accepted by --check during the burst, in MiB.
    #[arg(long, default_value_t = 1024)]
    max_rss_growth_mb: u64,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The served names of the two models.
const IMAGE: &str = "image";
const EMBED: &str = "embed";

pub fn run(args: ImageLoadTest) -> Result<()> {
    let sizes = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() || args.clients.is_empty() || args.clients.contains(&0) {
        return Err(Error::input(
            "--sizes and --clients need at least one value each, and clients at least 1",
        ));
    }
    parse_size(&args.burst_size)?;
    if args.url.is_none() {
        let most = args
            .clients
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(args.gen_clients);
        if most > args.max_queue {
            return Err(Error::input(format!(
                "--max-queue {} is below the {most} concurrent clients of a phase: they would get 429s",
                args.max_queue
            )));
        }
        if args.burst > 0 && args.burst <= args.max_queue {
            return Err(Error::input(format!(
                "--burst {} does not overflow --max-queue {}",
                args.burst, args.max_queue
            )));
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::backend("tokio", e))?;
    runtime.block_on(drive(args, sizes))
}

fn parse_size(s: &str) -> Result<(usize, usize)> {
    s.trim()
        .split_once(['x', 'X'])
        .and_then(|(w, h)| Some((w.trim().parse().ok()?, h.trim().parse().ok()?)))
        .filter(|&(w, h)| w > 0 && h > 0)
        .ok_or_else(|| Error::input(format!("size {s:?}: expected WIDTHxHEIGHT")))
}

/// One-image generation requests of `size` in `steps` steps, seed `i`.
fn generation_body(model: &str, (w, h): (usize, usize), steps: usize) -> Body {
    let model = model.to_string();
    Arc::new(move |i| {
        reqwest::Body::from(
            json!({"model": model, "prompt": format!("load test image {i}: a lighthouse at dusk"),
                   "size": format!("{w}x{h}"), "num_inference_steps": steps, "seed": i,
                   "response_format": "b64_json"})
            .to_string(),
        )
    })
}

/// Embedding requests of one short text, for the named model.
fn embed_body(model: &str) -> Body {
    let model = model.to_string();
    Arc::new(move |i| {
        reqwest::Body::from(
            json!({"model": model, "input": format!("query {i}: which planet has the most moons?")})
                .to_string(),
        )
    })
}

async fn drive(args: ImageLoadTest, sizes: Vec<(usize, usize)>) -> Result<()> {
    let with_embed = args.embed_model != "none";
    let mut serve = vec![
        "--model".to_string(),
        format!("{}={IMAGE}", args.image_model),
        "--max-queue".to_string(),
        args.max_queue.to_string(),
    ];
    if with_embed {
        serve.extend([
            "--model".to_string(),
            format!("{}={EMBED}", args.embed_model),
        ]);
    }
    let largest = sizes
        .iter()
        .map(|&(w, h)| w * h)
        .max()
        .unwrap_or(0)
        .max(1 << 20);
    serve.extend(["--max-image-pixels".to_string(), largest.to_string()]);
    serve.extend(args.device.to_args());
    if let Some(extra) = &args.server_args {
        serve.extend(extra.split_whitespace().map(str::to_string));
    }
    let mut target = Target::spawn(
        args.url.as_deref(),
        args.server_pid,
        &serve,
        args.server_log.as_ref(),
    )?;
    let key = args.api_key.clone();
    let generator = Arc::new(Client::new(
        target.url(),
        key.clone(),
        "/v1/images/generations",
    )?);
    let emb = Arc::new(Client::new(target.url(), key, "/v1/embeddings")?);
    wait_ready(&generator, &mut target, Duration::from_secs(args.load_secs)).await?;
    let result = phases(&args, &sizes, with_embed, &generator, &emb, &target).await;
    let stopped = target.stop();
    let report = result?;
    table(&report);
    stopped?;
    if args.check && !report.failures.is_empty() {
        return Err(Error::backend(
            "loadtest",
            format!("{}{}", report.failures.join("; "), target.log_tail()),
        ));
    }
    Ok(())
}

/// The table on stderr: images/s and latencies of each phase.
fn table(report: &Report) {
    eprintln!(
        "{:<22} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "phase", "ok", "429", "errors", "images/s", "p50 ms", "p95 ms", "p99 ms", "peak MiB"
    );
    for l in &report.lines {
        let f = |k: &str| l[k].as_f64().map_or("-".to_string(), |v| format!("{v:.1}"));
        let n = |k: &str| l[k].as_u64().unwrap_or(0);
        let images = if l["phase"].as_str().is_some_and(|p| p.starts_with("embed")) {
            "-".to_string()
        } else {
            f("inputs_per_s")
        };
        eprintln!(
            "{:<22} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9}",
            l["phase"].as_str().unwrap_or(""),
            n("ok"),
            n("rejected_429"),
            n("unexpected"),
            images,
            f("p50_ms"),
            f("p95_ms"),
            f("p99_ms"),
            f("server_peak_rss_mb"),
        );
    }
}

async fn phases(
    args: &ImageLoadTest,
    sizes: &[(usize, usize)],
    with_embed: bool,
    generator: &Arc<Client>,
    emb: &Arc<Client>,
    target: &Target,
) -> Result<Report> {
    let mut report = Report {
        lines: Vec::new(),
        failures: Vec::new(),
    };
    let limit = Duration::from_secs(args.phase_secs);
    let pid = target.pid();
    // Warm-up: one image of each size and one embedding, so no measured request pays a first
    // use (kernel compilation, workspaces, graphs).
    for &size in sizes {
        let (warm, _) = phase(
            generator,
            1,
            1,
            Instant::now() + limit * 4,
            1,
            generation_body(IMAGE, size, args.steps),
            None,
        )
        .await;
        if warm.count(200) != 1 {
            return Err(Error::backend(
                "loadtest",
                format!(
                    "warm-up at {}x{} failed: {:?}",
                    size.0, size.1, warm.samples
                ),
            ));
        }
    }
    if with_embed {
        let (warm, _) = phase(
            emb,
            1,
            1,
            Instant::now() + limit,
            1,
            embed_body(EMBED),
            None,
        )
        .await;
        if warm.count(200) != 1 {
            return Err(Error::backend(
                "loadtest",
                format!("embedding warm-up failed: {:?}", warm.samples),
            ));
        }
    }

    for &size in sizes {
        for &n in &args.clients {
            let requests = args.requests.max(n);
            let (stats, secs) = phase(
                generator,
                n,
                requests,
                Instant::now() + limit,
                1,
                generation_body(IMAGE, size, args.steps),
                None,
            )
            .await;
            let name = format!("gen_{}x{}_c{n}", size.0, size.1);
            let extra = json!({"size": format!("{}x{}", size.0, size.1), "clients": n,
                "steps": args.steps, "images_per_s": stats.inputs as f64 / secs.max(1e-9)});
            report.phase_with(&name, &stats, secs, rss_mb(pid), &[], extra)?;
        }
    }

    if with_embed {
        let (idle, secs) = phase(
            emb,
            1,
            args.embed_requests,
            Instant::now() + limit,
            1,
            embed_body(EMBED),
            None,
        )
        .await;
        report.phase("embed_idle", &idle, secs, rss_mb(pid), &[])?;

        let size = sizes[0];
        let ((during, secs), (gens, gen_secs)) = under_load(
            Load {
                client: generator,
                clients: args.gen_clients.max(1),
                body: generation_body(IMAGE, size, args.steps),
                settle: Duration::from_millis(500),
                what: "generating clients",
            },
            emb,
            args.embed_requests,
            embed_body(EMBED),
            limit,
        )
        .await?;
        let sized = format!("{}x{}", size.0, size.1);
        let extra = json!({"gen_clients": args.gen_clients, "size": sized});
        report.phase_with("embed_during", &during, secs, rss_mb(pid), &[], extra)?;
        let extra = json!({"size": sized, "images_per_s": gens.inputs as f64 / gen_secs.max(1e-9)});
        report.phase_with("gen_beside_embed", &gens, gen_secs, rss_mb(pid), &[], extra)?;
    }

    if args.burst > 0 {
        let size = parse_size(&args.burst_size)?;
        // Reset the peak (VmHWM) so the burst's own peak is measured (best effort: Linux ≥ 4.0).
        if let Some(pid) = pid {
            let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        }
        let before = rss_mb(pid);
        let (stats, secs) = phase(
            generator,
            args.burst,
            args.burst,
            Instant::now() + limit,
            1,
            generation_body(IMAGE, size, args.steps),
            None,
        )
        .await;
        let after = rss_mb(pid);
        let extra = json!({"size": args.burst_size, "requests": args.burst});
        report.phase_with("burst", &stats, secs, after, &[429], extra)?;
        if stats.count(429) == 0 {
            report.failures.push(format!(
                "burst: {} requests against --max-queue {} got no 429",
                args.burst, args.max_queue
            ));
        }
        if let (Some((start, _)), Some((_, peak))) = (before, after) {
            let growth = peak - start;
            let line = json!({"phase": "memory", "rss_before_burst_mb": start,
                "peak_rss_during_burst_mb": peak, "growth_mb": growth});
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
