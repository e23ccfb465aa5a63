//! `tessera bench generate`: text to image on one loaded model, end to end (prompt → PNG bytes)
//! and by stage, each run timed from the host with the device synchronised at each stage's end
//! (the pipeline reads every step's velocity back).

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use clap::Args;
use tessera_core::{Error, Result};
use tessera_models::text_to_image::{Event, Request};
use tessera_runtime::family::Capability;
use tessera_runtime::image;

use crate::device::DeviceArgs;
use crate::generate::{encode_png, parse_size};
use crate::model;
use crate::stdout::outln;

#[derive(Args)]
pub struct GenerateBench {
    /// Model folder (a full-size checkpoint for meaningful numbers); without it, the bundled
    /// miniature model.
    #[arg(long)]
    model: Option<String>,
    /// Image size WIDTHxHEIGHT (default: the model's, 1024x1024).
    #[arg(long, value_parser = parse_size)]
    size: Option<(usize, usize)>,
    /// Denoising steps (default: the model's).
    #[arg(long)]
    steps: Option<usize>,
    /// The prompt of every run.
    #[arg(
        long,
        default_value = "a lighthouse on a cliff at dusk, dramatic sky, oil painting"
    )]
    prompt: String,
    /// Classifier-free guidance in the model's convention (default: the model's, none).
    #[arg(long)]
    guidance: Option<f32>,
    /// The negative prompt (Qwen-Image-2.1's true CFG needs one).
    #[arg(long)]
    negative_prompt: Option<String>,
    /// Images per run, denoised as one batch.
    #[arg(long, default_value_t = 1)]
    num_images: usize,
    /// Timed runs.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Untimed runs before them (the first compiles kernels and tunes products).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[command(flatten)]
    device: DeviceArgs,
}

/// One run's stage times (decode and png: every image's).
struct Run {
    /// Prompt to PNG bytes.
    total: Duration,
    /// Tokenising, the text encoder and the DiT's per-request setup.
    encode: Duration,
    steps: Vec<Duration>,
    decode: Duration,
    png: Duration,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The median of `runs` by `f`, in milliseconds.
fn median(runs: &[Run], f: impl Fn(&Run) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(b: GenerateBench) -> Result<()> {
    let started = Instant::now();
    let spec = model::open(b.model.as_deref(), Capability::GenerateImage)?;
    let backend = b.device.open_for(&spec)?;
    let mut model = image::open(backend, &spec, None)?;
    let load = started.elapsed();
    let defaults = model.defaults();
    let (width, height) = b.size.unwrap_or(defaults.size);
    let req = Request {
        width,
        height,
        steps: b.steps.unwrap_or(defaults.steps),
        guidance: b.guidance.unwrap_or(defaults.guidance),
        negative_prompt: b.negative_prompt.clone(),
        num_images: b.num_images,
        ..Request::new(b.prompt.clone(), model.defaults())
    };
    let mut once = || -> Result<Run> {
        let t0 = Instant::now();
        model.check(&req)?;
        let mut marks = Vec::with_capacity(req.steps + 2);
        let images = model.generate(&req, &mut |e| {
            if !matches!(e, Event::Decoding) {
                marks.push(t0.elapsed());
            }
            ControlFlow::Continue(())
        })?;
        let decoded = t0.elapsed();
        for image in &images {
            let mut bytes = Vec::new();
            encode_png(&mut bytes, image, &[]).map_err(|e| Error::input(e.to_string()))?;
        }
        let total = t0.elapsed();
        let (encode, step_ends) = marks
            .split_first()
            .ok_or_else(|| Error::input("no progress events"))?;
        let mut prev = *encode;
        let steps = step_ends
            .iter()
            .map(|&t| {
                let d = t - prev;
                prev = t;
                d
            })
            .collect();
        Ok(Run {
            total,
            encode: *encode,
            steps,
            decode: decoded - prev,
            png: total - decoded,
        })
    };
    let first = once()?;
    for _ in 1..b.warmup {
        once()?;
    }
    let runs = (0..b.iters.max(1))
        .map(|_| once())
        .collect::<Result<Vec<_>>>()?;
    let step = median(&runs, |r| {
        let mut s: Vec<f64> = r.steps.iter().map(|&d| ms(d)).collect();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    });
    let json = serde_json::json!({
        "bench": "generate", "model": spec.label, "device": model.describe(),
        "size": format!("{width}x{height}"), "steps": req.steps, "guidance": req.guidance,
        "num_images": b.num_images,
        "images_per_s": b.num_images as f64 / (median(&runs, |r| ms(r.total)) / 1e3),
        "load_s": load.as_secs_f64(), "first_run_ms": ms(first.total),
        "e2e_ms": median(&runs, |r| ms(r.total)), "encode_ms": median(&runs, |r| ms(r.encode)),
        "step_ms": step, "decode_ms": median(&runs, |r| ms(r.decode)),
        "png_ms": median(&runs, |r| ms(r.png)), "iters": runs.len(),
    });
    outln!(
        "{} × {width}x{height}, {} steps on {}: end to end {:.1} ms (encode {:.1}, step {:.1}, decode {:.1}, png {:.1}); load {:.2} s, first run {:.0} ms",
        b.num_images,
        req.steps,
        model.describe(),
        json["e2e_ms"].as_f64().unwrap_or(0.0),
        json["encode_ms"].as_f64().unwrap_or(0.0),
        step,
        json["decode_ms"].as_f64().unwrap_or(0.0),
        json["png_ms"].as_f64().unwrap_or(0.0),
        load.as_secs_f64(),
        ms(first.total)
    )?;
    outln!("{json}")?;
    Ok(())
}
