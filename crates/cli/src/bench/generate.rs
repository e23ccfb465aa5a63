//! `tessera bench generate`: text to image, or an edit of condition images (`--image`), on one
//! loaded model, end to end (prompt → PNG bytes) and by stage, each run timed from the host with
//! the device synchronised at each stage's end (the pipeline reads every step's velocity back,
//! and waits for the device before it reports a stage of its encoding).
//!
//! The encoding (everything before the first step) is split as far as the family reports it
//! ([`Stage`]; Qwen-Image-2.1: plan, VAE encoder, vision tower, text encoder and prefill per prompt
//! branch), the rest of it (the loop's buffers) as `setup`. `plan` counts the check each run
//! makes first, as `tessera generate` does, and the pipeline's own.
//!
//! With `--offload` each run loads every component again for its stage: the stages then time
//! the loads with the work, which is the point of measuring it.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use tessera_core::{Error, Result};
use tessera_models::text_to_image::{Event, Request, Stage};
use tessera_runtime::family::Capability;
use tessera_runtime::image;

use crate::device::DeviceArgs;
use crate::generate::{Offload, condition_images, encode_png, output_size, parse_size, spec_for};
use crate::model;
use crate::stdout::outln;

#[derive(Args)]
pub struct GenerateBench {
    /// Model folder (a full-size checkpoint for meaningful numbers); without it, the bundled
    /// miniature model.
    #[arg(long)]
    model: Option<String>,
    /// Image size WIDTHxHEIGHT (default: the model's, 1024x1024; with --image, the last
    /// condition image's aspect at about --output-resolution² pixels).
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
    /// Time an edit instead: a condition image (PNG, JPEG, WebP, GIF or BMP), repeated for up to
    /// 10 images, as `tessera generate --image` reads them (Qwen-Image-2.1 only).
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    /// With --image: condition images are resized to about this many pixels squared, keeping
    /// their aspect. Default 1024.
    #[arg(long, value_name = "PIXELS")]
    output_resolution: Option<usize>,
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
    offload: Offload,
    #[command(flatten)]
    device: DeviceArgs,
}

/// One run's stage times (decode and png: every image's).
struct Run {
    /// Prompt to PNG bytes.
    total: Duration,
    /// Everything before the first step: tokenising, the text encoder and the DiT's per-request
    /// setup (for an edit also the condition images).
    encode: Duration,
    /// The encoding's stages as the model reported them, in order, each timed from the previous
    /// report (the first from the run's start).
    stages: Vec<(Stage, Duration)>,
    /// The rest of the encoding after the last reported stage (the loop's buffers).
    setup: Duration,
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

/// Every stage kind reported in `runs`, in first-report order.
fn stage_kinds(runs: &[Run]) -> Vec<Stage> {
    let mut kinds: Vec<Stage> = Vec::new();
    for (s, _) in runs.iter().flat_map(|r| &r.stages) {
        if !kinds.contains(s) {
            kinds.push(*s);
        }
    }
    kinds
}

/// A run's total time in `stage` (stages run per prompt branch are summed), in milliseconds.
fn stage_ms(r: &Run, stage: Stage) -> f64 {
    r.stages
        .iter()
        .filter(|(s, _)| *s == stage)
        .map(|(_, d)| ms(*d))
        .sum()
}

pub fn run(b: GenerateBench) -> Result<()> {
    let started = Instant::now();
    let edit = condition_images(&b.images, b.output_resolution)?;
    let spec = spec_for(
        model::open(b.model.as_deref(), Capability::GenerateImage)?,
        edit.as_ref(),
    )?;
    let backend = b.device.open_for(&spec)?;
    let mut model = image::open_as(backend, &spec, None, b.offload.residency())?;
    let load = started.elapsed();
    let defaults = model.defaults();
    let (width, height) = output_size(model.as_ref(), b.size, edit.as_ref())?;
    let conditions = edit.as_ref().map_or(0, |e| e.images.len());
    let req = Request {
        width,
        height,
        steps: b.steps.unwrap_or(defaults.steps),
        guidance: b.guidance.unwrap_or(defaults.guidance),
        negative_prompt: b.negative_prompt.clone(),
        num_images: b.num_images,
        edit,
        ..Request::new(b.prompt.clone(), defaults)
    };
    let mut once = || -> Result<Run> {
        let t0 = Instant::now();
        model.check(&req)?;
        let mut stages = Vec::new();
        let mut encoded = None;
        let mut step_ends = Vec::with_capacity(req.steps);
        let images = model.generate(&req, &mut |e| {
            let now = t0.elapsed();
            match e {
                Event::Stage(s) => stages.push((s, now)),
                Event::Encoded => encoded = Some(now),
                Event::Step { .. } => step_ends.push(now),
                Event::Decoding => {}
            }
            ControlFlow::Continue(())
        })?;
        let decoded = t0.elapsed();
        for image in &images {
            let mut bytes = Vec::new();
            encode_png(&mut bytes, image, &[]).map_err(|e| Error::input(e.to_string()))?;
        }
        let total = t0.elapsed();
        let encode = encoded.ok_or_else(|| Error::input("no progress events"))?;
        // Each mark's time since the one before it.
        let mut prev = Duration::ZERO;
        let mut since = |t: Duration| {
            let d = t.saturating_sub(prev);
            prev = t;
            d
        };
        let stages = stages.into_iter().map(|(s, t)| (s, since(t))).collect();
        let setup = since(encode);
        let steps = step_ends.into_iter().map(&mut since).collect();
        Ok(Run {
            total,
            encode,
            stages,
            setup,
            steps,
            decode: since(decoded),
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
        s.get(s.len() / 2).copied().unwrap_or(0.0)
    });
    let kinds = stage_kinds(&runs);
    let mut stage_json = serde_json::Map::new();
    let mut stage_text = Vec::new();
    for &k in &kinds {
        let t = median(&runs, |r| stage_ms(r, k));
        let n = runs[0].stages.iter().filter(|(s, _)| *s == k).count();
        stage_json.insert(format!("{}_ms", k.name()), t.into());
        stage_text.push(match n {
            1 => format!("{} {t:.1}", k.name()),
            n => format!("{} {t:.1} ({n}×)", k.name()),
        });
    }
    if !kinds.is_empty() {
        let setup = median(&runs, |r| ms(r.setup));
        stage_json.insert("setup_ms".into(), setup.into());
        stage_text.push(format!("setup {setup:.1}"));
    }
    // Prompt branches, as the prefills count them (none where the family reports no stages).
    let branches = runs[0]
        .stages
        .iter()
        .filter(|(s, _)| *s == Stage::Prefill)
        .count();
    let json = serde_json::json!({
        "bench": "generate", "model": spec.label, "device": model.describe(),
        "size": format!("{width}x{height}"), "steps": req.steps, "guidance": req.guidance,
        "num_images": b.num_images, "condition_images": conditions,
        "output_resolution": req.edit.as_ref().map(|e| e.output_resolution),
        "images_per_s": b.num_images as f64 / (median(&runs, |r| ms(r.total)) / 1e3),
        "load_s": load.as_secs_f64(), "first_run_ms": ms(first.total),
        "e2e_ms": median(&runs, |r| ms(r.total)), "encode_ms": median(&runs, |r| ms(r.encode)),
        "stages": stage_json, "branches": (branches > 0).then_some(branches),
        "step_ms": step, "decode_ms": median(&runs, |r| ms(r.decode)),
        "png_ms": median(&runs, |r| ms(r.png)), "iters": runs.len(),
        "offload": b.offload.offload,
    });
    let what = match conditions {
        0 => String::new(),
        1 => " edit of 1 image,".to_string(),
        n => format!(" edit of {n} images,"),
    };
    outln!(
        "{} ×{what} {width}x{height}, {} steps on {}: end to end {:.1} ms (encode {:.1}, step {:.1}, decode {:.1}, png {:.1}); load {:.2} s, first run {:.0} ms",
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
    if !stage_text.is_empty() {
        outln!("encode by stage (ms): {}", stage_text.join(", "))?;
    }
    outln!("{json}")?;
    Ok(())
}
