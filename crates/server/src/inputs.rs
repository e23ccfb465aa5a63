//! Turning a request's `input` into model inputs, checked before anything is queued.
//!
//! `input` is one of:
//! - a string: one text input;
//! - a part object (`{"type": "text", …}` or `{"type": "image_url", …}`): one input of that part;
//! - an array whose elements are each one input: a string, a part object, or an array of parts
//!   (texts and images combined into **one** embedding, in the order given).
//!
//! An image URL is a `data:` URL with base64 content, bare base64, or — only when the server
//! runs with `--allow-file-paths` — a `file://` URL or a local path. Remote URLs are refused: the
//! server never fetches. Images are checked from their header (format, pixel limit, patch grid,
//! the memory they need), then decoded and preprocessed here, so a bad image is a 400 before it
//! costs device time and image work never holds up the device's thread.

use std::path::Path;

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::Value;
use tessera_models::imageproc::{Header, Image, ImageBudget, ImageLimits};
use tessera_models::input::{Input, Part};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Limits;
use crate::embeddings::ModelInfo;
use crate::error::ApiError;
use crate::http::types::ContentPart;

/// One input before images are read.
type RawInput = Vec<RawPart>;

enum RawPart {
    Text(String),
    Image(String),
}

/// A request's inputs, decoded, preprocessed and counted.
pub struct Checked {
    pub inputs: Vec<Input>,
    /// Tokens per input as counted here (images at their budget's most): the batch budget.
    pub tokens: Vec<usize>,
    pub images: usize,
    /// Image memory reserved against `--max-image-memory-mb`, released with the request.
    pub image_memory: Vec<OwnedSemaphorePermit>,
}

/// What checking needs besides the request: the model, the limits and the switches.
pub struct Context<'a> {
    pub info: &'a ModelInfo,
    pub limits: &'a Limits,
    pub allow_file_paths: bool,
    pub prompt: &'a str,
    pub image_memory: &'a Arc<Semaphore>,
}

/// Parse the shape of `input` (cheap, no decoding): a count check happens before any work.
fn shape(input: &Value, max_inputs: usize) -> Result<Vec<RawInput>, ApiError> {
    let list: Vec<RawInput> = match input {
        Value::String(_) | Value::Object(_) => vec![one(input, "input")?],
        Value::Array(items) => {
            if items.is_empty() {
                return Err(ApiError::invalid_param(
                    "input",
                    "input is an empty array: there is nothing to embed",
                ));
            }
            if items.len() > max_inputs {
                return Err(too_many(items.len(), max_inputs, "inputs"));
            }
            if items.iter().all(Value::is_number) || items.iter().all(is_number_array) {
                return Err(ApiError::invalid_param(
                    "input",
                    "token-id inputs are not supported: send text (LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))",
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| one(v, &format!("input[{i}]")))
                .collect::<Result<_, _>>()?
        }
        other => {
            return Err(ApiError::invalid_param(
                "input",
                format!(
                    "input must be a string, a content part or an array, not {}",
                    kind(other)
                ),
            ));
        }
    };
    let images: usize = list
        .iter()
        .flatten()
        .filter(|p| matches!(p, RawPart::Image(_)))
        .count();
    if images > max_inputs {
        return Err(too_many(images, max_inputs, "images"));
    }
    Ok(list)
}

fn too_many(n: usize, max: usize, what: &str) -> ApiError {
    too_many_in(n, max, what, "input")
}

/// `n` inputs (or images) of the request field `param`, over `--max-inputs`.
pub(crate) fn too_many_in(n: usize, max: usize, what: &str, param: &'static str) -> ApiError {
    ApiError::TooManyInputs {
        message: format!(
            "{n} {what} in one request, more than the server's limit of {max} (--max-inputs)"
        ),
        param,
    }
}

fn is_number_array(v: &Value) -> bool {
    matches!(v, Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_number))
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// One element of `input`: a string, a part, or an array of parts.
fn one(v: &Value, at: &str) -> Result<RawInput, ApiError> {
    match v {
        Value::String(s) => Ok(vec![text(s.clone(), at)?]),
        Value::Object(_) => Ok(vec![part(v, at)?]),
        Value::Array(parts) if parts.is_empty() => Err(ApiError::invalid_param(
            at,
            format!("{at} is an empty array of parts: there is nothing to embed"),
        )),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match p {
                Value::Object(_) => part(p, &format!("{at}[{j}]")),
                other => Err(ApiError::invalid_param(
                    format!("{at}[{j}]"),
                    format!(
                        "{at}[{j}] must be a content part object ({{\"type\": \"text\", …}} or {{\"type\": \"image_url\", …}}), not {}",
                        kind(other)
                    ),
                )),
            })
            .collect(),
        other => Err(ApiError::invalid_param(
            at,
            format!(
                "{at} must be a string, a content part or an array of parts, not {}",
                kind(other)
            ),
        )),
    }
}

fn text(s: String, at: &str) -> Result<RawPart, ApiError> {
    if s.is_empty() {
        return Err(ApiError::invalid_param(
            at,
            format!("{at} is an empty text: there is nothing to embed"),
        ));
    }
    Ok(RawPart::Text(s))
}

fn part(v: &Value, at: &str) -> Result<RawPart, ApiError> {
    let p: ContentPart = serde_json::from_value(v.clone())
        .map_err(|e| ApiError::invalid_param(at, format!("{at}: {e}")))?;
    match p {
        ContentPart::Text { text: t } => text(t, at),
        ContentPart::ImageUrl { image_url } => Ok(RawPart::Image(image_url.url)),
    }
}

/// Check every input and decode its images. Blocking work (decoding, tokenizing, file reads):
/// run it off the async threads.
pub fn check(input: &Value, cx: &Context) -> Result<Checked, ApiError> {
    let raw = shape(input, cx.limits.max_inputs)?;
    let many = raw.len() > 1;
    let name = |i: usize| {
        if many {
            format!("input[{i}]")
        } else {
            "input".to_string()
        }
    };
    let mut out = Checked {
        inputs: Vec::with_capacity(raw.len()),
        tokens: Vec::with_capacity(raw.len()),
        images: 0,
        image_memory: Vec::new(),
    };
    for (i, parts) in raw.into_iter().enumerate() {
        let mut text = String::new();
        let mut n_images = 0;
        let mut input = Input::default();
        for (j, p) in parts.into_iter().enumerate() {
            match p {
                RawPart::Text(t) => {
                    text.push_str(&t);
                    input.parts.push(Part::Text(t));
                }
                RawPart::Image(url) => {
                    let at = format!("{}[{j}]", name(i));
                    let Some(limits) = &cx.info.image_limits else {
                        return Err(ApiError::invalid_param(
                            &at,
                            format!(
                                "{at}: model {:?} has no vision tower: it embeds text only",
                                cx.info.name
                            ),
                        ));
                    };
                    let (image, memory) =
                        read_image(&url, limits, cx).map_err(|e| prefixed(e, &at))?;
                    out.image_memory.push(memory);
                    input.parts.push(Part::Image(image));
                    n_images += 1;
                }
            }
        }
        let tokens = count_tokens(cx, &text, n_images, cx.info.image_budget())
            .map_err(|e| prefixed(e, &name(i)))?;
        if tokens > cx.limits.max_input_tokens {
            return Err(ApiError::invalid_param(
                name(i),
                format!(
                    "{} has {tokens} tokens, more than the server's limit of {} (--max-input-tokens); nothing is truncated",
                    name(i),
                    cx.limits.max_input_tokens
                ),
            ));
        }
        out.images += n_images;
        out.tokens.push(tokens);
        out.inputs.push(input);
    }
    Ok(out)
}

/// Tokens of one input: `<bos>` prompt+text `<eos>` as the model lays it out, each image at
/// its budget's most (`<|image>`, soft tokens, `<image|>`).
fn count_tokens(
    cx: &Context,
    text: &str,
    images: usize,
    budget: Option<ImageBudget>,
) -> Result<usize, ApiError> {
    // Judged by length first: a text longer than `--max-input-tokens` tokens of the longest
    // token cannot fit, and tokenising it would cost about 190 bytes per character.
    let chars = cx.prompt.chars().count() + text.chars().count();
    let max = cx.info.tokenizer.max_chars_for(cx.limits.max_input_tokens);
    if chars > max {
        return Err(ApiError::invalid(format!(
            "the text has {chars} characters, more than {} tokens (--max-input-tokens) can hold ({max}); nothing is truncated",
            cx.limits.max_input_tokens
        )));
    }
    let ids = cx
        .info
        .tokenizer
        .encode_with_bos_eos(&format!("{}{text}", cx.prompt))
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let per_image = budget.map_or(0, |b| b.soft_tokens() + 2);
    Ok(ids.len() + images * per_image)
}

/// Put `at` in front of a message that does not already name its place.
pub(crate) fn prefixed(e: ApiError, at: &str) -> ApiError {
    match e {
        ApiError::InvalidRequest { message, param } => ApiError::InvalidRequest {
            message: format!("{at}: {message}"),
            param: param.or_else(|| Some(at.to_string())),
        },
        ApiError::FilePathsNotAllowed(m) => ApiError::FilePathsNotAllowed(format!("{at}: {m}")),
        other => other,
    }
}

/// Read an image. Its header decides first — the tower's grid, the memory decoding and
/// preprocessing need — and that memory is reserved against `--max-image-memory-mb` before a
/// pixel is decoded. It is then decoded and preprocessed here, off the device's thread, which
/// only runs the model; the reservation keeps what stays (the image and its patches).
fn read_image(
    url: &str,
    limits: &ImageLimits,
    cx: &Context,
) -> Result<(Image, OwnedSemaphorePermit), ApiError> {
    let invalid = |e: tessera_core::Error| ApiError::invalid(e.to_string());
    let bytes = image_bytes(url, cx.allow_file_paths, cx.limits)?;
    let header = Image::header(&bytes).map_err(invalid)?;
    let plan = limits.plan(&header).map_err(invalid)?;
    let mut memory = reserve(&header, plan.peak_bytes, cx.limits, cx.image_memory)?;
    let mut image = Image::decode_with(&bytes, &header).map_err(invalid)?;
    drop(bytes);
    image.prepare(limits.spec, limits.budget).map_err(invalid)?;
    keep(&mut memory, plan.held_bytes);
    Ok((image, memory))
}

/// Give back what a reservation holds beyond `bytes` (what stays once an image is prepared).
pub(crate) fn keep(memory: &mut OwnedSemaphorePermit, bytes: u64) {
    let held = mib(bytes);
    if let Some(extra) = memory.num_permits().checked_sub(held).filter(|&n| n > 0) {
        drop(memory.split(extra));
    }
}

/// Whole MiB, rounded up, at least one.
fn mib(bytes: u64) -> usize {
    usize::try_from(bytes.div_ceil(1 << 20)).map_or(usize::MAX, |m| m.max(1))
}

/// Reserve `bytes` of the image memory budget, or refuse: 413 for an image that could never
/// fit, 429 while other requests hold the memory.
pub(crate) fn reserve(
    header: &Header,
    bytes: u64,
    limits: &Limits,
    image_memory: &Arc<Semaphore>,
) -> Result<OwnedSemaphorePermit, ApiError> {
    let mb = mib(bytes);
    let total = limits.max_image_memory_mb;
    if mb > total {
        return Err(ApiError::InputTooLarge(format!(
            "a {}×{} {} image needs {mb} MiB to decode and preprocess, more than the server's image memory of {total} MiB (--max-image-memory-mb)",
            header.width, header.height, header.format
        )));
    }
    let permits =
        u32::try_from(mb).map_err(|_| ApiError::Internal("image size overflow".into()))?;
    image_memory
        .clone()
        .try_acquire_many_owned(permits)
        .map_err(|_| {
            ApiError::QueueMemory(format!(
                "the server holds its limit of {total} MiB of images (--max-image-memory-mb): retry after {} s",
                crate::error::RETRY_AFTER_SECS
            ))
        })
}

/// Where an image's bytes come from.
enum Source<'a> {
    Data(&'a str),
    Path(&'a str),
}

/// The bytes of an image URL: decoded base64, or a regular file read as an upload is (no larger
/// than a body, within the body's time: [`crate::files`]). Remote URLs are refused; paths only
/// with `allow_paths`.
pub(crate) fn image_bytes(
    url: &str,
    allow_paths: bool,
    limits: &Limits,
) -> Result<Vec<u8>, ApiError> {
    match classify(url)? {
        Source::Data(b64) => STANDARD
            .decode(b64)
            .map_err(|e| ApiError::invalid(format!("the image is not valid base64: {e}"))),
        Source::Path(p) => {
            if !allow_paths {
                return Err(ApiError::FilePathsNotAllowed(
                    "file paths are not accepted: send the image as a data URL or base64, or start the server with --allow-file-paths".into(),
                ));
            }
            crate::files::read_image_file(
                Path::new(p),
                limits.max_request_bytes,
                limits.body_timeout,
            )
        }
    }
}

fn classify(url: &str) -> Result<Source<'_>, ApiError> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest.split_once(',').ok_or_else(|| {
            ApiError::invalid("a data URL needs a comma between its type and its data")
        })?;
        if !meta.ends_with(";base64") {
            return Err(ApiError::invalid(
                "only base64 data URLs are accepted (data:image/png;base64,…)",
            ));
        }
        return Ok(Source::Data(data));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(ApiError::invalid(
            "remote image URLs are not fetched: send the image as a data URL or base64",
        ));
    }
    if let Some(path) = url.strip_prefix("file://") {
        return Ok(Source::Path(path));
    }
    if url.is_empty() {
        return Err(ApiError::invalid("the image URL is empty"));
    }
    // Bare base64 uses only its alphabet in groups of four; a string with a '.' or a path
    // separator that is not base64 is a path; anything else is broken base64.
    let base64ish = url
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
    if base64ish && url.len().is_multiple_of(4) {
        Ok(Source::Data(url))
    } else if url.contains(['/', '\\', '.']) || url.starts_with('~') {
        Ok(Source::Path(url))
    } else {
        Err(ApiError::invalid(
            "the image is neither a data URL nor valid base64",
        ))
    }
}

/// The prefix of a prompt name (empty without one); an unknown name is a 400 naming the known.
pub fn prompt_prefix(info: &ModelInfo, prompt_name: Option<&str>) -> Result<String, ApiError> {
    match prompt_name {
        None => Ok(String::new()),
        Some(name) => info
            .prompts
            .get(name)
            .map(str::to_string)
            .map_err(|e| ApiError::invalid_param("prompt_name", e.to_string())),
    }
}
