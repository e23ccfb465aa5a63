//! `tessera bench qwen-image-parts`: Qwen-Image-2.1's components one at a time on one loaded
//! model — the text encoder on a fixed-length prompt, the DiT's prefill of a text prefix and one
//! cached step over each prefix length, and the VAE decoder — from synthetic inputs (no
//! tokenizer, no schedule). Each figure is the median of `--iters` runs after one warm-up; every
//! run reads its result back, which waits for the device.
//!
//! On a GPU machine with a full-size folder (`tools/device/make_qwen_image_full.py`):
//! `tessera bench qwen-image-parts --model DIR --device cuda --precision bf16`.

use std::time::Instant;

use clap::Args;
use tessera_backend::{Backend, BackendFn, Role, View};
use tessera_core::{Error, Result};
use tessera_models::qwen_image::layout::Layout;
use tessera_models::qwen_image::text::PromptIds;
use tessera_models::qwen_image::{QwenImage, QwenImageFiles};
use tessera_runtime::family::{Capability, Family, ModelFilesOf, ModelSpec};

use crate::device::DeviceArgs;
use crate::generate::parse_size;
use crate::stdout::outln;

#[derive(Args)]
pub struct QwenImagePartsBench {
    /// A Qwen-Image-2.1 folder (a full-size one for meaningful numbers); without it, the bundled
    /// miniature.
    #[arg(long)]
    model: Option<String>,
    /// Image size WIDTHxHEIGHT the DiT step and the VAE decode are timed at.
    #[arg(long, default_value = "1024x1024", value_parser = parse_size)]
    size: (usize, usize),
    /// Tokens of the prompt timed through the text encoder (system turn included).
    #[arg(long, default_value_t = 100)]
    prompt_tokens: usize,
    /// Text rows of the prefixes the prefill and the cached step are timed over.
    #[arg(long, default_value = "100,1000", value_delimiter = ',')]
    prefix_rows: Vec<usize>,
    /// Timed runs of each component (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(b: QwenImagePartsBench) -> Result<()> {
    let spec = ModelSpec::open(b.model.as_deref(), Family::QwenImage)?
        .expect(Capability::GenerateImage)?;
    let ModelFilesOf::QwenImage(files, _) = &spec.files else {
        return Err(Error::input(format!(
            "{} is {}, not Qwen-Image-2.1",
            spec.label,
            spec.family.name()
        )));
    };
    if b.prompt_tokens <= PROMPT_DROP {
        return Err(Error::input(format!(
            "--prompt-tokens {}: more than the {PROMPT_DROP} tokens of the system turn are needed",
            b.prompt_tokens
        )));
    }
    if b.prefix_rows.contains(&0) {
        return Err(Error::input("--prefix-rows: every prefix needs a row"));
    }
    let device = b.device.open_for(&spec)?;
    let label = spec.label.clone();
    device.run(Parts {
        bench: &b,
        files,
        label,
    })
}

/// Tokens of the system turn the text encoder drops from its features (as the pipeline's).
const PROMPT_DROP: usize = 14;

struct Parts<'a> {
    bench: &'a QwenImagePartsBench,
    files: &'a QwenImageFiles,
    label: String,
}

/// The median of `n` timed runs of `f` after one warm-up, in milliseconds.
fn median_ms(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = (0..n.max(1))
        .map(|_| {
            let t0 = Instant::now();
            f()?;
            Ok(t0.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<Vec<f64>>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// `n` values cycling through `period` evenly spaced levels in [-1, 1] (synthetic activations).
fn ramp(n: usize, period: usize) -> Vec<f32> {
    let half = (period / 2) as f32;
    (0..n)
        .map(|i| ((i % period) as f32 - half) / half)
        .collect()
}

impl BackendFn for Parts<'_> {
    type Output = Result<()>;

    fn call<B: Backend + 'static>(self, be: B) -> Result<()> {
        let b = self.bench;
        let describe = be.describe();
        let mut m = QwenImage::load(be, self.files)?;
        let cfg = m.configs().transformer.clone();
        let scale = m.configs().vae.scale();
        let (width, height) = b.size;
        if width % scale != 0 || height % scale != 0 {
            return Err(Error::input(format!(
                "--size {width}x{height}: each side must be a multiple of {scale}"
            )));
        }
        let (h, w) = (height / scale, width / scale);
        let emit = |what: String, ms: f64| -> Result<()> {
            outln!("timing {what} {ms:.2}")?;
            outln!(
                "{}",
                serde_json::json!({"bench": "qwen-image-parts", "model": self.label,
                    "device": describe, "what": what, "median_ms": ms, "iters": b.iters})
            )
        };

        // Ids 10..410 (fewer in a miniature's vocabulary), as the reference bench's prompt.
        let span = (m.configs().text_encoder.vocab_size.saturating_sub(10)).clamp(1, 400);
        let ids = PromptIds {
            ids: (0..b.prompt_tokens)
                .map(|i| (10 + (i * 7) % span) as u32)
                .collect(),
            drop: PROMPT_DROP,
        };
        let te = median_ms(b.iters, || m.encode(std::slice::from_ref(&ids)).map(drop))?;
        emit(format!("text_encoder_{}tok_ms", b.prompt_tokens), te)?;

        let lat = ramp(h * w * cfg.in_channels, 17);
        for &rows in &b.prefix_rows {
            let feats = ramp(rows * cfg.context_in_dim, 13);
            let be = m.backend();
            let mut buf = be.alloc(feats.len(), Role::Stream)?;
            be.write_f32(&mut buf, &feats)?;
            let layout = Layout::text_to_image(rows, (h, w))?;
            let text = View::new(&buf, rows, cfg.context_in_dim);
            let tr = m.transformer()?;
            let no_kv = || Error::input("the prefill kept no K/V for layer 0");
            let prefill = median_ms(b.iters, || {
                let p = tr.prefill(be, &layout, text, &[])?;
                be.read_f32(View::new(p.kv(0).ok_or_else(no_kv)?.0, 1, 1))
                    .map(drop)
            })?;
            let prefix = tr.prefill(be, &layout, text, &[])?;
            let mut st = tr.prepare_steps(be, &[&prefix], &[0], &[0.5])?;
            let step = median_ms(b.iters, || {
                tr.step(be, &mut st, &[&prefix], &[&lat], 0).map(drop)
            })?;
            emit(format!("prefill_{rows}rows_ms"), prefill)?;
            emit(format!("step_{width}x{height}_prefix{rows}_ms"), step)?;
        }

        let z = ramp(h * w * cfg.in_channels, 11);
        let vae = median_ms(b.iters, || {
            m.vae()?.decode(m.backend(), &z, (h, w), None).map(drop)
        })?;
        emit(format!("vae_decode_{width}x{height}_ms"), vae)?;
        Ok(())
    }
}
