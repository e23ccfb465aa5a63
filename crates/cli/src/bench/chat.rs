//! `tessera bench chat`: LFM2-VL on one loaded model — an image's prompt (preprocessing, then the
//! tower, projector and prefill of its tokens; then the tower and projector alone), a text
//! prefill of N tokens, a follow-up turn after a cached history (`--follow-up`), and decoding at batch
//! sizes B (B conversations stepping together, as the server's continuous batching runs them).
//! Each timing is the median of `--iters` runs after a warm-up, the device synchronised by the
//! logits read back every step. One JSON line per measurement on stdout.

use std::time::{Duration, Instant};

use clap::Args;
use tessera_core::{Error, Result};
use tessera_models::chat_family::CacheShape;
use tessera_models::chat_family::ChatPrompt;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::{self, Chat, ChatEvent, ChatOptions, ChatReply, GenerationParams};
use tessera_runtime::decode::{Control, SamplingParams};
use tessera_runtime::family::Capability;

use crate::device::DeviceArgs;
use crate::model;
use crate::noise::XorShift;
use crate::sampling::SamplingArgs;
use crate::stdout::outln;

#[derive(Args)]
pub struct ChatBench {
    /// Model folder (a full-size checkpoint for meaningful numbers); without it, the bundled
    /// miniature model.
    #[arg(long)]
    model: Option<String>,
    /// Image sizes WIDTHxHEIGHT whose prompts are timed (synthetic images).
    #[arg(long, value_delimiter = ',', default_value = "512x512,1024x768", value_parser = crate::generate::parse_size)]
    images: Vec<(usize, usize)>,
    /// Text prompt lengths (random token ids) whose prefill is timed.
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    prefill: Vec<usize>,
    /// Batch sizes whose decoding is timed.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// Tokens decoded per sequence in the decode runs.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Prompt tokens of each decoding sequence.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Histories (in tokens) after which a follow-up turn is timed: the conversation's first turn
    /// prefills HISTORY tokens and answers one token; the follow-up sends that history, the reply
    /// and 20 new tokens, so its first step prefills the 21 the cache lacks (what a chat client
    /// re-sending a growing conversation costs, without HTTP). None by default.
    #[arg(long = "follow-up", value_delimiter = ',')]
    follow_up: Vec<usize>,
    /// How the decode runs choose tokens: the model's defaults (its generation_config.json,
    /// greedy when it has none, as a server request gets them) with these flags over them.
    /// Greedy runs may pick on the device; the others draw on the host from the logits.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Timed runs of each measurement (after one untimed warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[command(flatten)]
    device: DeviceArgs,
}

/// New tokens a timed follow-up turn adds after its history and the reply.
const FOLLOW_UP_NEW: usize = 20;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The fastest and slowest of `v`.
fn spread(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// A smooth synthetic image with some noise (a photo-like spread of values).
fn image(w: usize, h: usize, rng: &mut XorShift) -> Result<Image> {
    let rgb = (0..w * h * 3)
        .map(|i| {
            let (p, c) = (i / 3, i % 3);
            let (x, y) = (p % w, p / w);
            let base = (x * 255 / w.max(1) + y * 255 / h.max(1) + c * 60) % 256;
            (base as u32 + (rng.next_u64() % 24) as u32).min(255) as u8
        })
        .collect();
    Image::from_rgb8(w, h, rgb)
}

/// A prompt of `n` random ordinary token ids after BOS.
fn text_prompt(n: usize, rng: &mut XorShift) -> ChatPrompt {
    let mut ids = vec![1u32];
    ids.extend((1..n).map(|_| 8 + (rng.next_u64() % 380) as u32));
    ChatPrompt {
        ids,
        ..ChatPrompt::default()
    }
}

/// What [`run_all`] timed: its first step (the prefill) and the rest, the steps after the
/// first, and the replies as they ended.
struct Timed {
    first: Duration,
    rest: Duration,
    steps_after: usize,
    replies: Vec<ChatReply>,
}

/// Begin every prompt, then step until all end.
fn run_all(m: &mut dyn Chat, prompts: Vec<ChatPrompt>, params: &GenerationParams) -> Result<Timed> {
    for (i, p) in prompts.into_iter().enumerate() {
        m.begin(i as u64, p, params)?;
    }
    let mut replies = Vec::new();
    let mut collect = |_, ev: ChatEvent<'_>| {
        if let ChatEvent::Done(r) = ev {
            replies.push(r);
        }
        Control::Continue
    };
    let t0 = Instant::now();
    let mut left = m.step(&mut collect)?;
    let first = t0.elapsed();
    let t1 = Instant::now();
    let mut steps_after = 0;
    while left > 0 {
        left = m.step(&mut collect)?;
        steps_after += 1;
    }
    let rest = t1.elapsed();
    Ok(Timed {
        first,
        rest,
        steps_after,
        replies,
    })
}

pub fn run(b: ChatBench) -> Result<()> {
    if b.iters == 0 || b.new_tokens < 2 {
        return Err(Error::input(
            "--iters must be at least 1 and --new-tokens at least 2",
        ));
    }
    let started = Instant::now();
    let spec = model::open(b.model.as_deref(), Capability::Chat)?;
    let backend = b.device.open_for(&spec)?;
    let longest = b
        .prefill
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(b.prompt_tokens + b.new_tokens)
        .max(b.follow_up.iter().copied().max().unwrap_or(0) + FOLLOW_UP_NEW + 2)
        + 8;
    let slots = b.batch.iter().copied().max().unwrap_or(1).max(1);
    // Every prompt prefilled in the first step, which is what the prefill figures time.
    let options = ChatOptions {
        prefill_chunk: usize::MAX,
        ..ChatOptions::default()
    };
    let mut m = chat::load(
        backend,
        &spec,
        CacheShape {
            slots,
            ctx: longest.max(4096),
        },
        options,
    )?;
    let device = m.describe();
    outln!(
        "{}",
        serde_json::json!({"bench": "chat", "what": "load", "model": spec.label, "device": device, "ms": ms(started.elapsed())})
    )?;
    let greedy = |n| GenerationParams {
        sampling: SamplingParams::default(),
        max_tokens: n,
        stop: Vec::new(),
    };
    let mut rng = XorShift::new(7);
    // An image's prompt: host preprocessing, then the prefill (tower, projector, its tokens).
    for &(w, h) in &b.images {
        let img = image(w, h, &mut rng)?;
        let msgs = [Message::parts(
            "user",
            vec![
                Part::Image,
                Part::Text {
                    text: "Describe this image.".into(),
                },
            ],
        )];
        let (mut prep, mut prefill) = (Vec::new(), Vec::new());
        let mut tokens = 0;
        for it in 0..=b.iters {
            let t = Instant::now();
            let p = m.prompt(&msgs, std::slice::from_ref(&img))?;
            let pt = t.elapsed();
            tokens = p.ids.len();
            let first = run_all(m.as_mut(), vec![p], &greedy(1))?.first;
            m.end(0);
            if it > 0 {
                prep.push(ms(pt));
                prefill.push(ms(first));
            }
        }
        outln!(
            "{}",
            serde_json::json!({"bench": "chat", "what": "image prompt", "image": format!("{w}x{h}"), "prompt_tokens": tokens,
                "preprocess_ms": median(prep), "prefill_ms": median(prefill), "device": device})
        )?;
        // The encoder (tower and projector) alone, waited for: the part of the prefill the
        // image's tokens cost before the language model sees them.
        let p = m.prompt(&msgs, std::slice::from_ref(&img))?;
        let mut enc = Vec::new();
        for it in 0..=b.iters {
            let t = Instant::now();
            m.encode_media(&p)?;
            if it > 0 {
                enc.push(ms(t.elapsed()));
            }
        }
        let (lo, hi) = spread(&enc);
        outln!(
            "{}",
            serde_json::json!({"bench": "chat", "what": "image encoder", "image": format!("{w}x{h}"),
                "ms": median(enc), "min_ms": lo, "max_ms": hi, "device": device})
        )?;
    }
    for &n in &b.prefill {
        let mut times = Vec::new();
        for it in 0..=b.iters {
            let first = run_all(m.as_mut(), vec![text_prompt(n, &mut rng)], &greedy(1))?.first;
            m.end(0);
            if it > 0 {
                times.push(ms(first));
            }
        }
        let t = median(times);
        outln!(
            "{}",
            serde_json::json!({"bench": "chat", "what": "prefill", "tokens": n, "ms": t, "tokens_per_s": n as f64 / t * 1e3, "device": device})
        )?;
    }
    for &history in &b.follow_up {
        let (mut times, mut cached) = (Vec::new(), 0);
        for it in 0..=b.iters {
            let first = text_prompt(history, &mut rng);
            let reply = run_all(m.as_mut(), vec![first.clone()], &greedy(1))?.replies;
            let mut ids = first.ids;
            ids.extend(reply.into_iter().flat_map(|r| r.tokens));
            ids.extend(
                text_prompt(FOLLOW_UP_NEW + 1, &mut rng)
                    .ids
                    .into_iter()
                    .skip(1),
            );
            let follow = ChatPrompt {
                ids,
                ..ChatPrompt::default()
            };
            // The follow-up continues conversation 0's slot, its history cached.
            let timed = run_all(m.as_mut(), vec![follow], &greedy(1))?;
            let took = timed.first;
            cached = timed.replies.first().map_or(0, |r| r.cached_tokens);
            m.end(0);
            if it > 0 {
                times.push(ms(took));
            }
        }
        let (lo, hi) = spread(&times);
        outln!(
            "{}",
            serde_json::json!({"bench": "chat", "what": "follow-up", "history": history, "new_tokens": FOLLOW_UP_NEW,
                "cached_tokens": cached, "ms": median(times), "min_ms": lo, "max_ms": hi, "device": device})
        )?;
    }
    let decoding = GenerationParams {
        sampling: b.sampling.params(m.default_sampling())?,
        ..greedy(b.new_tokens)
    };
    let d = decoding.sampling;
    let sampling_json = serde_json::json!({"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
        "min_p": d.min_p, "repetition_penalty": d.repetition_penalty, "seed": d.seed});
    for &batch in &b.batch {
        let (mut step_ms, mut prefill) = (Vec::new(), Vec::new());
        for it in 0..=b.iters {
            let prompts = (0..batch)
                .map(|_| text_prompt(b.prompt_tokens, &mut rng))
                .collect();
            let Timed {
                first,
                rest,
                steps_after: steps,
                ..
            } = run_all(m.as_mut(), prompts, &decoding)?;
            for c in 0..batch as u64 {
                m.end(c);
            }
            if it > 0 {
                prefill.push(ms(first));
                step_ms.push(ms(rest) / steps.max(1) as f64);
            }
        }
        let s = median(step_ms);
        outln!(
            "{}",
            serde_json::json!({"bench": "chat", "what": "decode", "batch": batch, "prompt_tokens": b.prompt_tokens,
                "new_tokens": b.new_tokens, "sampling": sampling_json, "step_ms": s, "tokens_per_s_per_seq": 1e3 / s, "tokens_per_s": batch as f64 * 1e3 / s,
                "prefill_ms": median(prefill), "device": device})
        )?;
    }
    Ok(())
}
