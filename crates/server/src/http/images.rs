//! `POST /v1/images/generations`: OpenAI's request and answer (images inline as `b64_json`),
//! whole or as server-sent events.
//!
//! The body is received and a request slot of the model taken as for the other routes; the
//! request is checked here — its fields, `--max-image-pixels` and `--max-image-steps`, then the
//! model's own rules through its checker (sizes off its grid, guidance, prompt tokens), off the
//! async threads — and then admitted against the image queue's cost budget
//! (`--max-image-queue-mps`: width × height × steps × n; 429 with `Retry-After` when full, 413
//! for a request that could never fit). The device worker ([`crate::images`]) reports each step
//! and sends the images raw; they are encoded here (PNG, JPEG over white, or lossless WebP) on
//! the blocking pool.
//!
//! A streamed answer is `image_generation.step` events (step, steps, the step's time, the time
//! since arrival), `image_generation.partial_image` previews when asked for, one
//! `image_generation.completed` event per image, then `data: [DONE]`; an error after the first
//! event is one `data: {"error": …}` event before `[DONE]`. `--image-timeout` bounds the whole
//! answer; a client that goes away, or whose time runs out, drops the channel and its
//! generation stops at the next step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::Cursor;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Json;
use axum::body::{Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tessera_models::text_to_image::{Edit, Image, Request as GenRequest};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::AppState;
use super::access::Access;
use super::error::ApiError;
use super::json;
use super::routes::{Admitted, admit};
use super::sse::{self, Polled, frame};
use super::types::{ImageData, ImageRequest, ImageStreamEvent, ImagesResponse};
use crate::chat_inputs::seed;
use crate::config::{COST_UNITS_PER_MPS, Limits};
use crate::images::{Event, ImageInfo, Job, cost_units, model_error};
use crate::model::{ModelQueue, Route, Served};
use std::future::Future;
use tessera_models::imageproc::decode_rgba;
use tessera_models::qwen_image::condition::OUTPUT_RESOLUTION;
use tessera_models::text_to_image::MAX_EDIT_IMAGES;

/// The most images one request makes (OpenAI allows 10 for DALL·E 2; one batch of the DiT).
pub const MAX_N: i64 = 8;
/// The most previews a streamed request asks for (as OpenAI).
pub const MAX_PARTIAL_IMAGES: i64 = 3;
/// The longest prompt, in characters (OpenAI's limit for its image models).
pub const MAX_PROMPT_CHARS: usize = 32_000;

/// How the images are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    /// `quality` 1–100.
    Jpeg {
        quality: u8,
    },
    /// Lossless.
    Webp,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Png => "png",
            Format::Jpeg { .. } => "jpeg",
            Format::Webp => "webp",
        }
    }
}

/// What becomes of an RGBA image's alpha channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Background {
    /// As the model makes it: alpha kept where the format has it.
    Auto,
    /// Composited over white.
    Opaque,
    /// Alpha kept (PNG, WebP).
    Transparent,
}

/// A request's output settings.
#[derive(Clone, Copy, Debug)]
pub struct Output {
    pub format: Format,
    pub background: Background,
}

impl Output {
    /// `image` encoded as asked: JPEG (which has no alpha) and `opaque` composite RGBA over
    /// white; PNG and WebP keep it otherwise.
    pub fn encode(&self, image: &Image) -> Result<Vec<u8>, ApiError> {
        let flat = match (self.format, self.background) {
            (Format::Jpeg { .. }, _) | (_, Background::Opaque) => image.over_white(),
            _ => image.clone(),
        };
        let color = if flat.has_alpha() {
            image::ExtendedColorType::Rgba8
        } else {
            image::ExtendedColorType::Rgb8
        };
        let (w, h) = (flat.width as u32, flat.height as u32);
        let mut out = Cursor::new(Vec::new());
        let written = match self.format {
            Format::Png => image::ImageEncoder::write_image(
                image::codecs::png::PngEncoder::new_with_quality(
                    &mut out,
                    image::codecs::png::CompressionType::Fast,
                    image::codecs::png::FilterType::Adaptive,
                ),
                &flat.pixels,
                w,
                h,
                color,
            ),
            Format::Jpeg { quality } => image::ImageEncoder::write_image(
                image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality),
                &flat.pixels,
                w,
                h,
                color,
            ),
            Format::Webp => image::ImageEncoder::write_image(
                image::codecs::webp::WebPEncoder::new_lossless(&mut out),
                &flat.pixels,
                w,
                h,
                color,
            ),
        };
        written.map_err(|e| {
            ApiError::Internal(format!(
                "encoding a {}x{} image as {}: {e}",
                flat.width,
                flat.height,
                self.format.name()
            ))
        })?;
        Ok(out.into_inner())
    }

    /// What the answer's `background` says of `image`.
    fn background_of(&self, image: &Image) -> &'static str {
        match (self.format, self.background) {
            (Format::Jpeg { .. }, _) | (_, Background::Opaque) => "opaque",
            _ if image.has_alpha() => "transparent",
            _ => "opaque",
        }
    }
}

/// A request checked at the edge: what the worker runs and how the answer is made.
#[derive(Debug)]
pub struct Checked {
    pub request: GenRequest,
    pub output: Output,
    pub stream: bool,
    pub partial_images: usize,
}

/// Check the fields of `body` for `info`'s model under `limits` (everything but the model's own
/// rules, which its checker adds). `edit`: the condition images of `/v1/images/edits`, which
/// give the size when `size` is absent or `auto`.
pub fn check_fields(
    body: ImageRequest,
    info: &ImageInfo,
    limits: &Limits,
    edit: Option<Edit>,
) -> Result<Checked, ApiError> {
    // Every text field is capped before anything tokenises it (a 20 MiB negative prompt cost
    // Z-Image 4.7 GB to tokenise).
    for (field, text) in [
        ("prompt", Some(&body.prompt)),
        ("negative_prompt", body.negative_prompt.as_ref()),
        ("user", body.user.as_ref()),
    ] {
        let chars = text.map_or(0, |t| t.chars().count());
        if chars > MAX_PROMPT_CHARS {
            return Err(invalid(
                field,
                format!("{field} is {chars} characters; at most {MAX_PROMPT_CHARS} are accepted"),
            ));
        }
    }
    let n = body.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(invalid(
            "n",
            format!("n = {n}: make 1 to {MAX_N} images per request"),
        ));
    }
    let (width, height) = match (body.size.as_deref(), &edit) {
        (None | Some("auto"), Some(e)) => {
            let sizer = info.edit.as_ref().map_err(|why| {
                ApiError::invalid_param(
                    "image",
                    format!("the model {:?} cannot edit images: {why}", info.name),
                )
            })?;
            sizer(e).map_err(|e| invalid("image", e.to_string()))?
        }
        (None | Some("auto"), None) => info.defaults.size,
        (Some(s), _) => parse_size(s).ok_or_else(|| {
            invalid(
                "size",
                format!("size {s:?}: expected WIDTHxHEIGHT in pixels, e.g. 1024x1024, or auto"),
            )
        })?,
    };
    let pixels = width.saturating_mul(height);
    if pixels > limits.max_image_pixels {
        return Err(invalid(
            "size",
            format!(
                "size {width}x{height} is {pixels} pixels; this server makes images of at most {} pixels (--max-image-pixels)",
                limits.max_image_pixels
            ),
        ));
    }
    let steps = match body.num_inference_steps {
        None => info.defaults.steps,
        Some(s) if s >= 1 && (s as u64) <= limits.max_image_steps as u64 => s as usize,
        Some(s) => {
            return Err(invalid(
                "num_inference_steps",
                format!(
                    "num_inference_steps = {s}: use 1 to {} (--max-image-steps)",
                    limits.max_image_steps
                ),
            ));
        }
    };
    let guidance = match body.guidance_scale {
        None => info.defaults.guidance,
        Some(g) if g.is_finite() && g.abs() <= f32::MAX as f64 => g as f32,
        Some(g) => {
            return Err(invalid(
                "guidance_scale",
                format!("guidance_scale {g} is not a usable number"),
            ));
        }
    };
    match body.response_format.as_deref() {
        None | Some("b64_json") => {}
        Some("url") => {
            return Err(invalid(
                "response_format",
                "response_format url is not supported: this server returns images inline; use b64_json (the default)",
            ));
        }
        Some(other) => {
            return Err(invalid(
                "response_format",
                format!("response_format {other:?}: use b64_json"),
            ));
        }
    }
    let compression = match body.output_compression {
        None => None,
        Some(c) if (0..=100).contains(&c) => Some(c as u8),
        Some(c) => {
            return Err(invalid(
                "output_compression",
                format!("output_compression {c}: use 0 to 100"),
            ));
        }
    };
    let format = match (body.output_format.as_deref(), compression) {
        (None | Some("png"), None) => Format::Png,
        (None | Some("png"), Some(_)) => {
            return Err(invalid(
                "output_compression",
                "output_compression applies to jpeg (its quality); png is lossless",
            ));
        }
        (Some("jpeg"), c) => Format::Jpeg {
            quality: c.unwrap_or(100).max(1),
        },
        (Some("webp"), None | Some(100)) => Format::Webp,
        (Some("webp"), Some(_)) => {
            return Err(invalid(
                "output_compression",
                "webp images are lossless here: leave output_compression out (or 100), or use jpeg",
            ));
        }
        (Some(other), _) => {
            return Err(invalid(
                "output_format",
                format!("output_format {other:?}: use png, jpeg or webp"),
            ));
        }
    };
    let background = match body.background.as_deref() {
        None | Some("auto") => Background::Auto,
        Some("opaque") => Background::Opaque,
        Some("transparent") if matches!(format, Format::Jpeg { .. }) => {
            return Err(invalid(
                "background",
                "background transparent needs png or webp: jpeg has no alpha channel",
            ));
        }
        Some("transparent") if !info.alpha => {
            return Err(invalid(
                "background",
                format!(
                    "background transparent: the model {:?} makes opaque images (no alpha channel); use auto or opaque, or a model with alpha such as Qwen-Image-2.1",
                    info.name
                ),
            ));
        }
        Some("transparent") => Background::Transparent,
        Some(other) => {
            return Err(invalid(
                "background",
                format!("background {other:?}: use auto, opaque or transparent"),
            ));
        }
    };
    let allowed = |field: &str, v: Option<&str>, set: &[&str]| -> Result<(), ApiError> {
        match v {
            Some(v) if !set.contains(&v) => Err(invalid(
                field,
                format!("{field} {v:?}: use one of {}", set.join(", ")),
            )),
            _ => Ok(()),
        }
    };
    allowed(
        "quality",
        body.quality.as_deref(),
        &["auto", "standard", "hd", "low", "medium", "high"],
    )?;
    allowed("style", body.style.as_deref(), &["vivid", "natural"])?;
    allowed("moderation", body.moderation.as_deref(), &["auto", "low"])?;
    let stream = body.stream.unwrap_or(false);
    let partial_images = match body.partial_images {
        None | Some(0) => 0,
        Some(p) if !(0..=MAX_PARTIAL_IMAGES).contains(&p) => {
            return Err(invalid(
                "partial_images",
                format!("partial_images {p}: use 0 to {MAX_PARTIAL_IMAGES}"),
            ));
        }
        Some(_) if !stream => {
            return Err(invalid(
                "partial_images",
                "partial_images come as server-sent events: set stream to true",
            ));
        }
        Some(_) if !info.previews => {
            return Err(invalid(
                "partial_images",
                format!("the model {:?} has no preview map", info.name),
            ));
        }
        Some(p) => p as usize,
    };
    let request = GenRequest {
        negative_prompt: body.negative_prompt,
        width,
        height,
        steps,
        guidance,
        seed: seed(body.seed.as_ref())?,
        num_images: n as usize,
        edit,
        ..GenRequest::new(body.prompt, info.defaults)
    };
    Ok(Checked {
        request,
        output: Output { format, background },
        stream,
        partial_images,
    })
}

/// A 400 naming the field at fault.
fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

/// `WIDTHxHEIGHT` as two positive numbers.
fn parse_size(s: &str) -> Option<(usize, usize)> {
    let (w, h) = s.split_once(['x', 'X'])?;
    let (w, h) = (w.trim().parse().ok()?, h.trim().parse().ok()?);
    (w > 0 && h > 0).then_some((w, h))
}

/// `POST /v1/images/generations`.
pub async fn generations(State(app): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let limit = app.config.limits.image_timeout;
    respond(limit, start(app, req)).await
}

/// The answer of a generation or an edit once `start`ed, whole or streamed, all within
/// `--image-timeout` (`limit`).
pub(super) async fn respond(
    limit: std::time::Duration,
    start: impl Future<Output = Result<Started, ApiError>>,
) -> Result<Response, ApiError> {
    let deadline = tokio::time::Instant::now() + limit;
    let started = tokio::time::timeout_at(deadline, start)
        .await
        .unwrap_or(Err(ApiError::ImageTimeout(limit)))?;
    if started.checked.stream {
        return Ok(stream(started, deadline, limit));
    }
    tokio::time::timeout_at(deadline, whole(started))
        .await
        .unwrap_or(Err(ApiError::ImageTimeout(limit)))
}

/// What a generation holds until its answer ends: its request slot and its share of the
/// queue's cost budget.
struct Held {
    _slot: OwnedSemaphorePermit,
    _cost: OwnedSemaphorePermit,
}

/// A generation under way: its first event is here.
pub(super) struct Started {
    checked: Checked,
    model: Arc<ImageInfo>,
    created: u64,
    arrived: Instant,
    first: Event,
    events: UnboundedReceiver<Event>,
    held: Held,
    access: Access,
}

/// Receive, check, admit against the cost budget, queue, and wait for the first event.
async fn start(app: AppState, req: Request) -> Result<Started, ApiError> {
    let arrived = Instant::now();
    let admitted = admit(&app, req, Route::Images).await?;
    let body: ImageRequest = json::parse(&admitted.bytes)?;
    enqueue(app, arrived, admitted, body, None).await
}

/// Condition images as uploaded, decoded while the request is checked.
pub(super) struct Upload {
    /// The files, in order.
    pub images: Vec<Bytes>,
    /// Condition images are resized to about this side squared (the model's default when
    /// absent).
    pub output_resolution: Option<usize>,
}

/// Check an admitted request (its fields, the condition images of an edit, the model's rules),
/// admit it against the cost budget, queue it and wait for its first event.
pub(super) async fn enqueue(
    app: AppState,
    arrived: Instant,
    admitted: Admitted,
    body: ImageRequest,
    upload: Option<Upload>,
) -> Result<Started, ApiError> {
    let Admitted {
        bytes,
        model,
        served,
        slot,
        access,
    } = admitted;
    drop(bytes);
    let (Served::Image(info), ModelQueue::Image(queue), Some(budget)) =
        (served, &model.queue, model.cost.as_ref())
    else {
        return Err(ApiError::Internal(format!(
            "{} is not an image generation model",
            model.name
        )));
    };
    let checked = {
        let (app, info) = (app.clone(), info.clone());
        tokio::task::spawn_blocking(move || -> Result<Checked, ApiError> {
            let edit = upload.map(|u| decode_upload(u, &info)).transpose()?;
            let checked = check_fields(body, &info, &app.config.limits, edit)?;
            if let Some(check) = &info.checker {
                check(&checked.request).map_err(model_error)?;
            }
            Ok(checked)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("checking the request failed: {e}")))??
    };
    // The seed goes into the access log line: a fresh one is how the client can reproduce it.
    access.seed(checked.request.seed);
    let cost = cost_units(&checked.request);
    let total = app.config.limits.max_image_queue_mps * COST_UNITS_PER_MPS;
    let mps = |units: usize| units as f64 / COST_UNITS_PER_MPS as f64;
    if cost > total {
        return Err(ApiError::InputTooLarge(format!(
            "this request is {:.1} megapixel-steps of work (width × height × steps × n), more than the server's queue holds ({} megapixel-steps, --max-image-queue-mps): ask for fewer or smaller images or fewer steps",
            mps(cost),
            app.config.limits.max_image_queue_mps
        )));
    }
    let units = u32::try_from(cost).unwrap_or(u32::MAX);
    let cost_permit = budget.clone().try_acquire_many_owned(units).map_err(|_| {
        ApiError::QueueMemory(format!(
            "the image queue is full ({:.1} of {} megapixel-steps of work waiting or running, --max-image-queue-mps; this request needs {:.1}): retry after {} s",
            mps(total.saturating_sub(budget.available_permits())),
            app.config.limits.max_image_queue_mps,
            mps(cost),
            super::error::RETRY_AFTER_SECS
        ))
    })?;
    let (tx, mut events) = unbounded_channel();
    queue
        .push(Job {
            request: checked.request.clone(),
            partial_images: checked.partial_images,
            batching: app.config.limits.batch_images,
            events: tx,
            arrived,
            enqueued: Instant::now(),
            span: tracing::Span::current(),
            metrics: app.metrics.clone(),
            model: model.name.clone(),
        })
        .map_err(|_| ApiError::ShuttingDown)?;
    let first = events.recv().await.ok_or_else(worker_stopped)?;
    if let Event::Failed(e) = first {
        return Err(e);
    }
    Ok(Started {
        checked,
        model: info,
        created: unix_now(),
        arrived,
        first,
        events,
        held: Held {
            _slot: slot,
            _cost: cost_permit,
        },
        access,
    })
}

/// The most pixels of all an edit's condition images together, decoded: 64 megapixels (256 MiB
/// of RGBA). Each is resized to about the output resolution's square anyway.
pub const MAX_EDIT_PIXELS: u64 = 64 << 20;

/// Decode an edit's uploads for `info`'s model: refused when the model cannot edit, for more
/// than [`MAX_EDIT_IMAGES`] images, for a file that is not an image, and past
/// [`MAX_EDIT_PIXELS`] in all (from the headers, before decoding).
fn decode_upload(upload: Upload, info: &ImageInfo) -> Result<Edit, ApiError> {
    if let Err(why) = &info.edit {
        return Err(invalid(
            "image",
            format!("the model {:?} cannot edit images: {why}", info.name),
        ));
    }
    let n = upload.images.len();
    if n == 0 {
        return Err(invalid("image", "an edit needs at least one image"));
    }
    if n > MAX_EDIT_IMAGES {
        return Err(invalid(
            "image",
            format!("{n} images: an edit takes at most {MAX_EDIT_IMAGES}"),
        ));
    }
    let mut pixels = 0u64;
    for (i, bytes) in upload.images.iter().enumerate() {
        let h = tessera_models::imageproc::Image::header(bytes)
            .map_err(|e| invalid("image", format!("image {}: {e}", i + 1)))?;
        pixels += (h.width * h.height) as u64;
        if pixels > MAX_EDIT_PIXELS {
            return Err(invalid(
                "image",
                format!(
                    "the images come to more than {} megapixels (image {} is {}x{}); an edit takes at most that much in all",
                    MAX_EDIT_PIXELS >> 20,
                    i + 1,
                    h.width,
                    h.height
                ),
            ));
        }
    }
    let images = upload
        .images
        .iter()
        .enumerate()
        .map(|(i, b)| decode_rgba(b).map_err(|e| invalid("image", format!("image {}: {e}", i + 1))))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Edit {
        images: images.into(),
        output_resolution: upload.output_resolution.unwrap_or(OUTPUT_RESOLUTION),
    })
}

fn worker_stopped() -> ApiError {
    ApiError::Internal("the device worker stopped".into())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Encode `images` on the blocking pool, in order.
async fn encode_all(output: Output, images: Vec<Image>) -> Result<Vec<Vec<u8>>, ApiError> {
    tokio::task::spawn_blocking(move || images.iter().map(|i| output.encode(i)).collect())
        .await
        .map_err(|e| ApiError::Internal(format!("encoding the images failed: {e}")))?
}

/// The whole answer once the images are made.
async fn whole(mut s: Started) -> Result<Response, ApiError> {
    let mut next = Some(s.first);
    let images = loop {
        let ev = match next.take() {
            Some(ev) => ev,
            None => s.events.recv().await.ok_or_else(worker_stopped)?,
        };
        match ev {
            Event::Step { .. } | Event::Partial { .. } => {}
            Event::Failed(e) => return Err(e),
            Event::Done(images) => break images,
        }
    };
    drop(s.held);
    let output = s.checked.output;
    let background = images.first().map_or("opaque", |i| output.background_of(i));
    let encoded = encode_all(output, images).await?;
    s.access.images(encoded.len());
    let req = &s.checked.request;
    let data = encoded
        .iter()
        .enumerate()
        .map(|(i, bytes)| ImageData {
            b64_json: STANDARD.encode(bytes),
            seed: req.seed.wrapping_add(i as u64),
        })
        .collect();
    tracing::debug!(
        model = %s.model.name,
        ms = s.arrived.elapsed().as_secs_f64() * 1e3,
        "images answered"
    );
    Ok(Json(ImagesResponse {
        created: s.created,
        data,
        output_format: output.format.name(),
        size: format!("{}x{}", req.width, req.height),
        background,
    })
    .into_response())
}

/// The answer as server-sent events.
fn stream(s: Started, deadline: tokio::time::Instant, limit: std::time::Duration) -> Response {
    let body = EventStream {
        first: Some(s.first),
        events: s.events,
        out: VecDeque::new(),
        done: false,
        encoding: None,
        pending: None,
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        limit,
        model: s.model.clone(),
        checked: s.checked,
        created: s.created,
        arrived: s.arrived,
        _held: s.held,
        access: s.access,
    };
    sse::response(body)
}

/// Encoded images on their way from the blocking pool.
type Encoding = tokio::task::JoinHandle<Result<Vec<Vec<u8>>, ApiError>>;

/// A streamed generation's body: each event of the worker becomes one server-sent event, sent
/// as soon as it comes; the images are encoded on the blocking pool before their events.
/// Dropping it (the client went away) drops the channel, which stops the generation.
struct EventStream {
    first: Option<Event>,
    events: UnboundedReceiver<Event>,
    /// Encoded events not yet sent.
    out: VecDeque<Bytes>,
    /// `[DONE]` is queued: nothing more comes.
    done: bool,
    /// The final images being encoded, and their `background`s.
    encoding: Option<Encoding>,
    pending: Option<Vec<&'static str>>,
    /// `--image-timeout`, and when it runs out.
    deadline: Pin<Box<tokio::time::Sleep>>,
    limit: std::time::Duration,
    model: Arc<ImageInfo>,
    checked: Checked,
    created: u64,
    arrived: Instant,
    _held: Held,
    access: Access,
}

/// An event's type: `image_generation.{what}`, or `image_edit.{what}` for an edit (as OpenAI
/// names the edit route's events).
fn kind(checked: &Checked, what: &str) -> &'static str {
    match (checked.request.edit.is_some(), what) {
        (false, "step") => "image_generation.step",
        (false, "partial_image") => "image_generation.partial_image",
        (false, _) => "image_generation.completed",
        (true, "step") => "image_edit.step",
        (true, "partial_image") => "image_edit.partial_image",
        (true, _) => "image_edit.completed",
    }
}

/// One server-sent event: its type as the `event:` line (as OpenAI sends it), the JSON as data.
fn sse(kind: &str, json: &impl serde::Serialize) -> Bytes {
    // Our own types always serialise.
    let json = serde_json::to_string(json).unwrap_or_else(|_| "{}".into());
    Bytes::from(format!("event: {kind}\ndata: {json}\n\n"))
}

impl EventStream {
    fn end(&mut self) {
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }

    fn fail(&mut self, e: ApiError) {
        tracing::warn!(code = e.code(), "a streamed generation failed: {e}");
        let json = serde_json::to_string(&e.body()).unwrap_or_else(|_| "{}".into());
        self.out.push_back(Bytes::from(format!("data: {json}\n\n")));
        self.end();
    }

    fn size(w: usize, h: usize) -> String {
        format!("{w}x{h}")
    }

    fn push(&mut self, ev: Event) {
        let output = self.checked.output;
        match ev {
            Event::Step {
                step,
                steps,
                step_seconds,
                elapsed,
            } => {
                let e = ImageStreamEvent {
                    kind: kind(&self.checked, "step"),
                    step: Some(step),
                    steps: Some(steps),
                    step_ms: Some(step_seconds * 1e3),
                    elapsed_ms: Some(elapsed.as_secs_f64() * 1e3),
                    ..ImageStreamEvent::default()
                };
                self.out.push_back(sse(e.kind, &e));
            }
            Event::Partial {
                index,
                image,
                step,
                preview,
            } => match output.encode(&preview) {
                // A preview is a few hundred pixels: encoded here.
                Ok(bytes) => {
                    let e = ImageStreamEvent {
                        kind: kind(&self.checked, "partial_image"),
                        step: Some(step),
                        b64_json: Some(STANDARD.encode(bytes)),
                        created_at: Some(self.created),
                        output_format: Some(output.format.name()),
                        size: Some(Self::size(preview.width, preview.height)),
                        background: Some(output.background_of(&preview)),
                        quality: Some("auto"),
                        image_index: Some(image),
                        partial_image_index: Some(index),
                        ..ImageStreamEvent::default()
                    };
                    self.out.push_back(sse(e.kind, &e));
                }
                Err(e) => tracing::warn!("a preview could not be encoded: {e}"),
            },
            Event::Done(images) => {
                let backgrounds: Vec<&'static str> =
                    images.iter().map(|i| output.background_of(i)).collect();
                self.pending = Some(backgrounds);
                self.encoding = Some(tokio::task::spawn_blocking(move || {
                    images.iter().map(|i| output.encode(i)).collect()
                }));
            }
            Event::Failed(e) => self.fail(e),
        }
    }

    /// The `image_generation.completed` events of the encoded images, then `[DONE]`.
    fn completed(&mut self, encoded: Vec<Vec<u8>>, backgrounds: &[&'static str]) {
        let output = self.checked.output;
        let req = &self.checked.request;
        let size = Self::size(req.width, req.height);
        for (i, bytes) in encoded.iter().enumerate() {
            let e = ImageStreamEvent {
                kind: kind(&self.checked, "completed"),
                b64_json: Some(STANDARD.encode(bytes)),
                created_at: Some(self.created),
                output_format: Some(output.format.name()),
                size: Some(size.clone()),
                background: backgrounds.get(i).copied(),
                quality: Some("auto"),
                image_index: Some(i),
                seed: Some(req.seed.wrapping_add(i as u64)),
                ..ImageStreamEvent::default()
            };
            self.out.push_back(sse(e.kind, &e));
        }
        self.access.images(encoded.len());
        tracing::debug!(
            model = %self.model.name,
            ms = self.arrived.elapsed().as_secs_f64() * 1e3,
            "streamed images answered"
        );
        self.end();
    }
}

impl HttpBody for EventStream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Polled> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.out.pop_front() {
                return frame(bytes);
            }
            if this.done {
                return Poll::Ready(None);
            }
            if this.deadline.as_mut().poll(cx).is_ready() {
                // Dropping the receiver stops the generation at its next step.
                this.events.close();
                this.encoding = None;
                this.fail(ApiError::ImageTimeout(this.limit));
                continue;
            }
            if let Some(task) = this.encoding.as_mut() {
                let joined = match Pin::new(task).poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(j) => j,
                };
                this.encoding = None;
                let backgrounds = this.pending.take().unwrap_or_default();
                match joined {
                    Ok(Ok(encoded)) => this.completed(encoded, &backgrounds),
                    Ok(Err(e)) => this.fail(e),
                    Err(e) => this.fail(ApiError::Internal(format!(
                        "encoding the images failed: {e}"
                    ))),
                }
                continue;
            }
            let ev = match this.first.take() {
                Some(ev) => ev,
                None => match this.events.poll_recv(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(ev) => ev.unwrap_or_else(|| Event::Failed(worker_stopped())),
                },
            };
            this.push(ev);
        }
    }
}
