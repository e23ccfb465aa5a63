//! `/v1/images/generations` on the device side: the queued job, and how the worker runs a batch
//! of them.
//!
//! **Batches.** Requests of one model, size and step count that wait together run as one batch
//! (`GenerateImage::generate_batch`): every image of every request goes through the same
//! denoiser forwards, up to `--max-image-batch` images (`--no-image-batching` runs one request
//! at a time). Each request's images are the ones it makes alone.
//!
//! **Progress.** After each denoising step each request's channel gets a step event (its step,
//! the step count, the times); with `partial_images` it also gets previews at evenly spaced
//! steps: the latent through the model's cheap latent → RGB map (`GenerateImage::preview`), one
//! pixel per latent pixel. The images themselves go back raw; the HTTP side encodes them, off
//! the device's thread.
//!
//! **Cancellation.** A request whose client is gone (disconnected, or its `--image-timeout`
//! passed: either drops the channel) is stopped at the next step boundary; the others of its
//! batch go on. A panic in the model fails the batch's requests (500); the worker goes on.

use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_core::{Error, Result};
use tessera_models::text_to_image::{self, Defaults, Image, LatentPreview, Request};
use tessera_runtime::image::{Checker, EditSizer, GenerateImage};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::Limits;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::queue::{self, Batch, Cost, Lane};
use crate::worker::{Load, Runner, panic_message};

/// Opens the device and loads the text-to-image model, on the worker's thread.
pub type ImageLoader = Box<dyn FnOnce() -> Result<Box<dyn GenerateImage>> + Send>;

/// What the HTTP side knows about a loaded text-to-image model.
pub struct ImageInfo {
    /// The id in `model` fields and `/v1/models`.
    pub name: String,
    /// The family's recommended steps, guidance and size.
    pub defaults: Defaults,
    /// Checks requests on the request handlers' side; `None` when the family has no checker
    /// of its own, and the worker then checks each request before it runs.
    pub checker: Option<Checker>,
    /// Whether the model has a preview map (`partial_images` is refused without one).
    pub previews: bool,
    /// Whether the model's images have an alpha channel (`background: "transparent"` is
    /// refused without one).
    pub alpha: bool,
    /// Device and precision, one line.
    pub device: String,
    /// Whether the model edits condition images (`/v1/images/edits`), else why not, and the
    /// output size of an edit that gives none.
    pub edit: Result<EditSizer, String>,
}

/// What the worker tells a request, in order: step events (and previews), then one `Done` or
/// `Failed`.
#[derive(Debug)]
pub enum Event {
    /// Step `step` (from 1) of `steps` is done: it took `step_seconds` (the batch's forward),
    /// `elapsed` after the request arrived.
    Step {
        step: usize,
        steps: usize,
        step_seconds: f64,
        elapsed: Duration,
    },
    /// A preview of image `image` after step `step`, the `index`-th of the request's previews.
    Partial {
        index: usize,
        image: usize,
        step: usize,
        preview: Image,
    },
    /// The request's images, in order (seeds `seed, seed + 1, …`).
    Done(Vec<Image>),
    Failed(ApiError),
}

/// One image generation request's work.
pub struct Job {
    pub request: Request,
    /// Previews to send (0–3), at evenly spaced steps.
    pub partial_images: usize,
    /// Whether it may share forwards with other requests (`--no-image-batching` turns it off).
    pub batching: bool,
    pub events: UnboundedSender<Event>,
    /// When the request arrived and when it was queued.
    pub arrived: Instant,
    pub enqueued: Instant,
    /// The request's span, so the worker's logs for it carry its fields.
    pub span: tracing::Span,
    /// Where a request dropped from the queue is counted, and the model's name.
    pub metrics: Arc<Metrics>,
    pub model: String,
}

impl queue::Job for Job {
    fn lane(&self) -> Lane {
        Lane::Generation
    }
    fn cost(&self) -> Cost {
        Cost {
            tokens: 0,
            images: self.request.num_images,
        }
    }
    fn joins(&self, head: &Self) -> bool {
        let (a, b) = (&self.request, &head.request);
        self.batching
            && head.batching
            && (a.width, a.height, a.steps, a.shift) == (b.width, b.height, b.steps, b.shift)
    }
    fn abandoned(&self) -> bool {
        self.events.is_closed()
    }
    fn dropped(&self) {
        tracing::debug!(parent: &self.span, "client gone: generation cancelled while queued");
        let seconds = self.arrived.elapsed().as_secs_f64();
        self.metrics
            .image_request(&self.model, "cancelled", 0, seconds);
    }
}

/// The CLI's flags a model's messages name, and the request fields they stand for here.
const FIELDS: [(&str, &str); 6] = [
    ("--negative-prompt", "negative_prompt"),
    ("--num-images", "n"),
    ("--guidance", "guidance_scale"),
    ("--steps", "num_inference_steps"),
    ("--size", "size"),
    ("--seed", "seed"),
];

/// A model's refusal of a request as the HTTP side says it: the model's messages name the
/// CLI's flags (`--size`, `--guidance`), a client knows the request's fields (`size`,
/// `guidance_scale`), so the flags become fields and the first one named is the error's
/// `param`.
pub fn model_error(e: Error) -> ApiError {
    let fields = |m: String| {
        FIELDS
            .iter()
            .fold(m, |m, (flag, field)| m.replace(flag, field))
    };
    let message = match e {
        Error::Input(message) => message,
        other => {
            return match ApiError::from(other) {
                ApiError::InputTooLarge(m) => ApiError::InputTooLarge(fields(m)),
                e => e,
            };
        }
    };
    let first = FIELDS
        .iter()
        .filter_map(|&(flag, field)| message.find(flag).map(|at| (at, field)))
        .min_by_key(|&(at, _)| at)
        .map(|(_, field)| field);
    let message = fields(message);
    match first {
        Some(field) => ApiError::invalid_param(field, message),
        None => ApiError::invalid(message),
    }
}

/// The steps (from 1) after which a request of `steps` steps sends its `n` previews: evenly
/// spaced, before the last step (whose image comes whole), at most one per step.
pub fn preview_steps(steps: usize, n: usize) -> Vec<usize> {
    let mut at: Vec<usize> = (1..=n)
        .map(|i| (i * steps).div_ceil(n + 1))
        .filter(|&s| s >= 1 && s < steps)
        .collect();
    at.dedup();
    at
}

/// The text-to-image model on the worker's thread.
pub struct ImageRunner {
    name: String,
    model: Box<dyn GenerateImage>,
    /// Checks requests here when the family has no checker of its own.
    check_here: bool,
    preview: Option<LatentPreview>,
    metrics: Arc<Metrics>,
}

/// The worker's load step: `loader`, the preview map, then what the HTTP side needs under the
/// served `name`.
pub fn load(
    name: String,
    loader: ImageLoader,
    _limits: &Limits,
    metrics: Arc<Metrics>,
) -> Load<ImageRunner, ImageInfo> {
    Box::new(move || {
        let mut model = loader()?;
        let preview = model.preview()?;
        if let Some(p) = &preview {
            tracing::info!(model = %name, r2 = p.r2, "preview map fitted to the decoder");
        }
        let checker = model.checker();
        let info = ImageInfo {
            name: name.clone(),
            defaults: model.defaults(),
            checker: checker.clone(),
            previews: preview.is_some(),
            alpha: model.has_alpha(),
            device: model.describe(),
            edit: edit_support(model.as_ref()),
        };
        Ok((
            ImageRunner {
                name,
                model,
                check_here: checker.is_none(),
                preview,
                metrics,
            },
            info,
        ))
    })
}

/// How `model` takes edits: its sizer, or why it cannot edit (one line).
fn edit_support(model: &dyn GenerateImage) -> Result<EditSizer, String> {
    model.can_edit().map_err(|e| e.to_string())?;
    let defaults = model.defaults();
    Ok(model
        .edit_sizer()
        .unwrap_or_else(|| Arc::new(move |_: &_| Ok(defaults.size))))
}

/// A request of the batch as the worker follows it.
struct Running {
    job: Job,
    /// Steps after which a preview goes out.
    previews: Vec<usize>,
    /// Previews sent so far.
    sent: usize,
}

impl Runner for ImageRunner {
    type Job = Job;

    fn run(&mut self, batch: Batch<Job>) {
        let started = Instant::now();
        let mut jobs: Vec<Running> = Vec::with_capacity(batch.jobs.len());
        for job in batch.jobs {
            self.metrics.waited(
                Lane::Generation,
                started.duration_since(job.enqueued).as_secs_f64(),
            );
            if self.check_here
                && let Err(e) = self.model.check(&job.request)
            {
                self.finish(job, Err(e));
                continue;
            }
            let previews = match &self.preview {
                Some(_) => preview_steps(job.request.steps, job.partial_images),
                None => Vec::new(),
            };
            jobs.push(Running {
                job,
                previews,
                sent: 0,
            });
        }
        if jobs.is_empty() {
            return;
        }
        let images: usize = jobs.iter().map(|r| r.job.request.num_images).sum();
        self.metrics.image_batch(&self.name, images);
        let reqs: Vec<Request> = jobs.iter().map(|r| r.job.request.clone()).collect();
        let ImageRunner {
            name,
            model,
            preview,
            metrics,
            ..
        } = self;
        // Step times: from one step's first report to the next's (the batch's steps run
        // together); the first from the end of the text encoding.
        let mut clock: (Option<usize>, Instant, f64) = (None, started, 0.0);
        let mut on = |i: usize, e: text_to_image::Event<'_>| {
            let Some(r) = jobs.get_mut(i) else {
                return ControlFlow::Break(());
            };
            match e {
                // A request's loop starts (all of a batch at once; one after another where the
                // family runs its requests in turn): its first step is timed from here.
                text_to_image::Event::Encoded => clock = (None, Instant::now(), clock.2),
                text_to_image::Event::Step {
                    index,
                    steps,
                    latents,
                    ..
                } => {
                    if clock.0 != Some(index) {
                        let now = Instant::now();
                        let seconds = now.duration_since(clock.1).as_secs_f64();
                        metrics.image_step(name, seconds);
                        clock = (Some(index), now, seconds);
                    }
                    let step = index + 1;
                    let _ = r.job.events.send(Event::Step {
                        step,
                        steps,
                        step_seconds: clock.2,
                        elapsed: r.job.arrived.elapsed(),
                    });
                    if let Some(p) = preview.as_ref()
                        && r.previews.get(r.sent) == Some(&step)
                    {
                        let (w, h) = (r.job.request.width, r.job.request.height);
                        for (k, latent) in latents.iter().enumerate() {
                            match p.image(latent, w, h) {
                                Ok(img) => {
                                    let _ = r.job.events.send(Event::Partial {
                                        index: r.sent,
                                        image: k,
                                        step,
                                        preview: img,
                                    });
                                }
                                Err(e) => {
                                    tracing::warn!(parent: &r.job.span, error = %e, "no preview")
                                }
                            }
                        }
                        r.sent += 1;
                    }
                }
                text_to_image::Event::Decoding | text_to_image::Event::Stage(_) => {}
            }
            // The client is gone (disconnected, or its time ran out): stop its request.
            if r.job.events.is_closed() {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let results = catch_unwind(AssertUnwindSafe(|| model.generate_batch(&reqs, &mut on)))
            .unwrap_or_else(|p| {
                let message = panic_message(&p);
                (0..reqs.len())
                    .map(|_| Err(Error::backend("generate", &message)))
                    .collect()
            });
        let n = jobs.len();
        let mut results = results.into_iter();
        for r in jobs {
            let result = results.next().unwrap_or_else(|| {
                Err(Error::backend(
                    "generate",
                    format!("{n} requests, fewer results"),
                ))
            });
            self.finish(r.job, result);
        }
        tracing::debug!(
            model = %self.name,
            requests = n,
            images,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "batch done"
        );
    }
}

impl ImageRunner {
    /// Answer `job` and count it.
    fn finish(&self, job: Job, result: Result<Vec<Image>>) {
        let seconds = job.arrived.elapsed().as_secs_f64();
        match result {
            Ok(images) => {
                // Counted before the answer, so a client that reads /metrics after it sees it.
                self.metrics
                    .image_request(&self.name, "done", images.len(), seconds);
                let _ = job.events.send(Event::Done(images));
            }
            Err(Error::Cancelled(at)) => {
                tracing::debug!(parent: &job.span, "client gone: generation cancelled {at}");
                self.metrics
                    .image_request(&self.name, "cancelled", 0, seconds);
            }
            Err(e) => {
                tracing::debug!(parent: &job.span, error = %e, "generation failed");
                self.metrics.image_request(&self.name, "failed", 0, seconds);
                let _ = job.events.send(Event::Failed(model_error(e)));
            }
        }
    }
}

/// What a request costs the image queue, in cost units (`config::COST_UNITS_PER_MPS` per
/// megapixel-step): width × height × steps × images, rounded up, at least one.
pub fn cost_units(req: &Request) -> usize {
    let unit = (1usize << 20) / crate::config::COST_UNITS_PER_MPS;
    let work =
        (req.width as u128) * (req.height as u128) * (req.steps as u128) * (req.num_images as u128);
    usize::try_from(work.div_ceil(unit as u128))
        .unwrap_or(usize::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_are_spread_over_the_steps_before_the_last() {
        assert_eq!(preview_steps(8, 0), Vec::<usize>::new());
        assert_eq!(preview_steps(8, 1), vec![4]);
        assert_eq!(preview_steps(8, 3), vec![2, 4, 6]);
        assert_eq!(preview_steps(9, 2), vec![3, 6]);
        // Fewer steps than previews: one per step, never the last.
        assert_eq!(preview_steps(2, 3), vec![1]);
        assert_eq!(preview_steps(1, 3), Vec::<usize>::new());
    }

    #[test]
    fn cost_is_pixels_steps_and_images() {
        let req = |w, h, steps, n| Request {
            width: w,
            height: h,
            steps,
            num_images: n,
            ..Request::new("x", tessera_models::zimage::DEFAULTS)
        };
        // 1024² × 8 steps = 8 megapixel-steps.
        assert_eq!(cost_units(&req(1024, 1024, 8, 1)), 8 * 16);
        assert_eq!(cost_units(&req(1024, 1024, 8, 2)), 2 * 8 * 16);
        assert_eq!(cost_units(&req(512, 512, 8, 1)), 2 * 16);
        // Tiny requests still cost a unit.
        assert_eq!(cost_units(&req(16, 16, 1, 1)), 1);
    }
}
