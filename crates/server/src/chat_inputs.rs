//! Turning a chat request into the model's prompt and generation settings, checked before
//! anything is queued.
//!
//! - [`settings`]: sampling (the checkpoint's defaults for what the request leaves out), token
//!   limit, stop strings, streaming; the fields OpenAI knows that ask for what this server does
//!   not do (`n` > 1, `tools`, `logprobs`, a JSON `response_format`, frequency or presence
//!   penalties, `logit_bias`) are refused rather than silently ignored.
//! - [`messages`]: the conversation's shape: roles `system` (or `developer`), `user` and
//!   `assistant`; content a string or a list of `text` and `image_url` parts (images in user
//!   messages only). Cheap: no image is read.
//! - [`prompt`]: the images read (the same sources as `/v1/embeddings`: data URLs and bare
//!   base64; paths only with `--allow-file-paths`; remote URLs refused), each planned from its
//!   header and its memory reserved against `--max-image-memory-mb` before it is decoded; then
//!   the prompt built exactly as the model's own `Chat::prompt` builds it. Blocking: run it off
//!   the async threads.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use serde_json::Value;
use tessera_models::chat_family::ChatPrompt;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::GenerationParams;
use tessera_runtime::decode::SamplingParams;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::chat::ChatInfo;
use crate::config::Limits;
use crate::error::ApiError;
use crate::http::types::ChatRequest;
use crate::inputs::{image_bytes, keep, kind, prefixed, reserve, too_many_in};

/// Most stop strings in one request.
pub const MAX_STOPS: usize = 16;
/// The longest stop string, in characters: each is matched against the reply's tail.
pub const MAX_STOP_CHARS: usize = 1000;

/// How a request wants its reply.
#[derive(Debug)]
pub struct Settings {
    pub sampling: SamplingParams,
    /// `None`: until the end of turn or a full context.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

impl Settings {
    /// The generation parameters for a prompt of `prompt_tokens` in a context of `context`.
    pub fn params(&self, prompt_tokens: usize, context: usize) -> GenerationParams {
        GenerationParams {
            sampling: self.sampling,
            max_tokens: self
                .max_tokens
                .unwrap_or(context.saturating_sub(prompt_tokens).max(1)),
            stop: self.stop.clone(),
        }
    }
}

/// Check everything but the messages; cheap.
pub fn settings(body: &ChatRequest, info: &ChatInfo) -> Result<Settings, ApiError> {
    refuse_unsupported(body)?;
    let d = info.sampling;
    let top_k = match body.top_k {
        None => d.top_k,
        Some(k) if (-1..=0).contains(&k) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k {k} is not a count of tokens (0 or -1 keep every token)"),
            ));
        }
    };
    let sampling = SamplingParams {
        temperature: body.temperature.unwrap_or(d.temperature),
        top_k,
        top_p: body.top_p.unwrap_or(d.top_p),
        min_p: body.min_p.unwrap_or(d.min_p),
        repetition_penalty: body.repetition_penalty.unwrap_or(d.repetition_penalty),
        seed: seed(body.seed.as_ref())?,
    };
    sampling.check().map_err(|e| {
        // The message starts with the parameter's name.
        let m = e.to_string();
        let param = m.split(' ').next().unwrap_or("").to_string();
        ApiError::invalid_param(param, m)
    })?;
    let max_tokens = match (body.max_completion_tokens, body.max_tokens) {
        (Some(n), _) => Some(("max_completion_tokens", n)),
        (None, Some(n)) => Some(("max_tokens", n)),
        (None, None) => None,
    };
    let max_tokens = match max_tokens {
        Some((field, 0)) => {
            return Err(ApiError::invalid_param(
                field,
                format!("{field} must be at least 1"),
            ));
        }
        Some((_, n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    Ok(Settings {
        sampling,
        max_tokens,
        stop: stops(body.stop.as_ref())?,
        stream: body.stream.unwrap_or(false),
        include_usage: body
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// OpenAI's fields whose meaning this server cannot give: a 400 naming the field, never a reply
/// that silently lacks what was asked.
fn refuse_unsupported(body: &ChatRequest) -> Result<(), ApiError> {
    let refuse = |field: &str, why: &str| Err(ApiError::invalid_param(field, why));
    if let Some(n) = body.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid_param(
            "n",
            format!(
                "n = {n} is not supported: one choice per request (send n requests, with different seeds)"
            ),
        ));
    }
    for field in ["tools", "functions"] {
        let v = if field == "tools" {
            &body.tools
        } else {
            &body.functions
        };
        if v.as_ref().is_some_and(asks) {
            return refuse(
                field,
                &format!("{field} are not supported: this server does not make tool calls"),
            );
        }
    }
    if body.logprobs == Some(true) {
        return refuse("logprobs", "logprobs are not supported");
    }
    if let Some(f) = &body.response_format {
        let kind = f.get("type").and_then(Value::as_str);
        if !(f.is_null() || kind == Some("text")) {
            return refuse(
                "response_format",
                "only the text response_format is supported (no JSON mode or schema)",
            );
        }
    }
    for (field, v) in [
        ("frequency_penalty", body.frequency_penalty),
        ("presence_penalty", body.presence_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return refuse(
                field,
                &format!("{field} is not supported; repetition_penalty (a Tessera extension) is"),
            );
        }
    }
    if body.logit_bias.as_ref().is_some_and(asks) {
        return refuse("logit_bias", "logit_bias is not supported");
    }
    Ok(())
}

/// Whether an optional field asks for anything: not null, not an empty list or object.
fn asks(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

/// The seed: the request's (an integer from 0 to 2⁶⁴−1, as the CLI's `--seed` takes), or a
/// fresh one. A negative seed is refused rather than wrapped to a huge one.
pub(crate) fn seed(v: Option<&Value>) -> Result<u64, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(random_u64()),
        Some(v) => v.as_u64().ok_or_else(|| {
            let why = if v.as_i64().is_some() {
                "must not be negative"
            } else {
                "must be an integer"
            };
            ApiError::invalid_param(
                "seed",
                format!("seed {why} (0 to 18446744073709551615), not {v}"),
            )
        }),
    }
}

/// 64 random bits (the standard library's per-process random hasher keys, mixed with a count).
pub fn random_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(_)) => vec![v.unwrap_or(&Value::Null)],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop must be a string or an array of strings, not {}",
                    kind(other)
                ),
            ));
        }
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::invalid_param(
            "stop",
            format!("{} stop strings; at most {MAX_STOPS}", list.len()),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, s)| match s {
            Value::String(s) if s.chars().count() > MAX_STOP_CHARS => Err(ApiError::invalid_param(
                format!("stop[{i}]"),
                format!("a stop string is longer than {MAX_STOP_CHARS} characters"),
            )),
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            Value::String(_) => Err(ApiError::invalid_param(
                format!("stop[{i}]"),
                "a stop string is empty",
            )),
            other => Err(ApiError::invalid_param(
                format!("stop[{i}]"),
                format!("stop strings must be strings, not {}", kind(other)),
            )),
        })
        .collect()
}

/// An image part: where it is in the request, and its URL.
#[derive(Debug)]
pub struct ImageRef {
    pub at: String,
    pub url: String,
}

/// The conversation as the chat template takes it, and its images in order (not yet read).
/// `reserved`: text no message may hold (the model's placeholders: [`ChatPrompter::reserved_text`](tessera_models::chat_family::ChatPrompter::reserved_text)).
pub fn messages(
    v: Option<&Value>,
    max_images: usize,
    reserved: &[&str],
) -> Result<(Vec<Message>, Vec<ImageRef>), ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is required: a list of {\"role\": …, \"content\": …} objects",
        ));
    };
    let Value::Array(list) = v else {
        return Err(ApiError::invalid_param(
            "messages",
            format!("messages must be an array of messages, not {}", kind(v)),
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty: there is nothing to answer",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    let mut images = Vec::new();
    for (i, m) in list.iter().enumerate() {
        out.push(message(
            m,
            &format!("messages[{i}]"),
            reserved,
            &mut images,
        )?);
    }
    if images.len() > max_images {
        return Err(too_many_in(images.len(), max_images, "images", "messages"));
    }
    Ok((out, images))
}

fn message(
    m: &Value,
    at: &str,
    reserved: &[&str],
    images: &mut Vec<ImageRef>,
) -> Result<Message, ApiError> {
    let Value::Object(m) = m else {
        return Err(ApiError::invalid_param(
            at,
            format!(
                "{at} must be an object with a role and a content, not {}",
                kind(m)
            ),
        ));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) => r.as_str(),
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                format!("{at}.role"),
                format!("{at}.role is missing (system, user or assistant)"),
            ));
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                format!("{at}.role"),
                format!("{at}.role must be a string, not {}", kind(other)),
            ));
        }
    };
    let role = match role {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" | "function" => {
            return Err(ApiError::invalid_param(
                format!("{at}.role"),
                format!(
                    "{at}.role {role:?}: tool results are not supported (this server does not make tool calls)"
                ),
            ));
        }
        other => {
            return Err(ApiError::invalid_param(
                format!("{at}.role"),
                format!("{at}.role {other:?} is not a role: use system, user or assistant"),
            ));
        }
    };
    if m.get("tool_calls").is_some_and(asks) {
        return Err(ApiError::invalid_param(
            format!("{at}.tool_calls"),
            format!("{at}.tool_calls: tool calls are not supported"),
        ));
    }
    let at_content = format!("{at}.content");
    match m.get("content") {
        Some(Value::String(s)) => Ok(Message::new(role, text(s, &at_content, reserved)?)),
        // An assistant turn that only called tools has no content; without tools, it said "".
        None | Some(Value::Null) if role == "assistant" => Ok(Message::new(role, "")),
        None | Some(Value::Null) => Err(ApiError::invalid_param(
            &at_content,
            format!("{at_content} is missing"),
        )),
        Some(Value::Array(parts)) => {
            let parts = parts
                .iter()
                .enumerate()
                .map(|(j, p)| part(p, role, &format!("{at_content}[{j}]"), reserved, images))
                .collect::<Result<Vec<Part>, ApiError>>()?;
            Ok(Message::parts(role, parts))
        }
        Some(other) => Err(ApiError::invalid_param(
            &at_content,
            format!(
                "{at_content} must be a string or an array of content parts, not {}",
                kind(other)
            ),
        )),
    }
}

/// Text as given, unless it holds one of the model's placeholders (which would stand for an
/// image that is not there).
fn text<'a>(s: &'a str, at: &str, reserved: &[&str]) -> Result<&'a str, ApiError> {
    if let Some(r) = reserved.iter().find(|r| s.contains(**r)) {
        return Err(ApiError::invalid_param(
            at,
            format!(
                "{at} contains {r:?}, the model's image placeholder: send images as image_url parts"
            ),
        ));
    }
    Ok(s)
}

fn part(
    p: &Value,
    role: &str,
    at: &str,
    reserved: &[&str],
    images: &mut Vec<ImageRef>,
) -> Result<Part, ApiError> {
    let Value::Object(o) = p else {
        return Err(ApiError::invalid_param(
            at,
            format!(
                "{at} must be a content part ({{\"type\": \"text\", …}} or {{\"type\": \"image_url\", …}}), not {}",
                kind(p)
            ),
        ));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => match o.get("text") {
            Some(Value::String(s)) => Ok(Part::Text {
                text: text(s, &format!("{at}.text"), reserved)?.to_string(),
            }),
            _ => Err(ApiError::invalid_param(
                format!("{at}.text"),
                format!("{at}: a text part needs a string \"text\""),
            )),
        },
        Some("image_url") => {
            if role != "user" {
                return Err(ApiError::invalid_param(
                    at,
                    format!("{at}: images are accepted in user messages only"),
                ));
            }
            // `{"url": …, "detail": …}` as OpenAI sends it (`detail` has no meaning here), or
            // the URL alone as some clients send it.
            let url = match o.get("image_url") {
                Some(Value::String(u)) => Some(u.as_str()),
                Some(Value::Object(i)) => i.get("url").and_then(Value::as_str),
                _ => None,
            }
            .ok_or_else(|| {
                ApiError::invalid_param(
                    format!("{at}.image_url"),
                    format!("{at}: an image_url part needs \"image_url\": {{\"url\": \"data:image/png;base64,…\"}}"),
                )
            })?;
            images.push(ImageRef {
                at: at.to_string(),
                url: url.to_string(),
            });
            Ok(Part::Image)
        }
        Some(other) => Err(ApiError::invalid_param(
            format!("{at}.type"),
            format!(
                "{at}: content parts of type {other:?} are not supported (text and image_url are)"
            ),
        )),
        None => Err(ApiError::invalid_param(
            format!("{at}.type"),
            format!("{at} has no \"type\" (text or image_url)"),
        )),
    }
}

/// What building a prompt needs besides the request.
pub struct Context<'a> {
    pub info: &'a ChatInfo,
    pub limits: &'a Limits,
    pub allow_file_paths: bool,
    pub image_memory: &'a Arc<Semaphore>,
}

/// A request's prompt, and the image memory it holds until its reply ends (its tiles'
/// patches). Blocking work (decoding, resizing, tokenizing, file reads): run it off the async
/// threads.
pub fn prompt(
    messages: &[Message],
    images: &[ImageRef],
    cx: &Context,
) -> Result<(ChatPrompt, Vec<OwnedSemaphorePermit>), ApiError> {
    // Judged by length before any image is read or any text rendered and tokenised.
    cx.info
        .prompter
        .check_length(messages, cx.info.context)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let mut decoded = Vec::with_capacity(images.len());
    let mut memory = Vec::with_capacity(images.len());
    for im in images {
        let (image, permit) = read_image(&im.url, cx).map_err(|e| prefixed(e, &im.at))?;
        decoded.push(image);
        memory.push(permit);
    }
    let prompt = cx
        .info
        .prompter
        .prompt(messages, &decoded)
        .map_err(ApiError::from)?;
    drop(decoded);
    for (permit, m) in memory.iter_mut().zip(&prompt.media) {
        keep(permit, m.bytes);
    }
    // As the model's own `Chat::prompt` refuses it.
    if prompt.ids.len() >= cx.info.context {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "the prompt has {} tokens; the context holds {} (--context), so nothing can be generated",
                prompt.ids.len(),
                cx.info.context
            ),
        ));
    }
    Ok((prompt, memory))
}

/// Read an image: its header decides first — how the processor will cut it and the memory
/// decoding and cutting take, reserved before a pixel is decoded.
fn read_image(url: &str, cx: &Context) -> Result<(Image, OwnedSemaphorePermit), ApiError> {
    let invalid = |e: tessera_core::Error| ApiError::invalid(e.to_string());
    let bytes = image_bytes(url, cx.allow_file_paths, cx.limits)?;
    let header = Image::header(&bytes).map_err(invalid)?;
    let prepare = cx
        .info
        .prompter
        .image_peak_bytes(header.width, header.height)
        .map_err(invalid)?;
    let rgb = header.width as u64 * header.height as u64 * 3;
    let peak = (header.decode_bytes + rgb).max(rgb + prepare);
    let memory = reserve(&header, peak, cx.limits, cx.image_memory)?;
    let image = Image::decode_with(&bytes, &header).map_err(invalid)?;
    Ok((image, memory))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shape(v: Value) -> Result<(Vec<Message>, Vec<ImageRef>), ApiError> {
        messages(Some(&v), 4, &["<image>"])
    }

    fn param(e: ApiError) -> String {
        match e {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn messages_and_their_parts() {
        let (m, images) = shape(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                {"type": "text", "text": "what is this?"}
            ]},
            {"role": "assistant", "content": null},
        ]))
        .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].images(), 1);
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].at, "messages[1].content[0]");
        for (bad, at) in [
            (
                json!([{"role": "robot", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "tool", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"role": "user"}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": 3}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "audio"}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": "look: <image>"}]),
                "messages[0].content",
            ),
            (json!([]), "messages"),
            (json!("hi"), "messages"),
        ] {
            assert_eq!(param(shape(bad.clone()).unwrap_err()), at, "{bad}");
        }
        let five = json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "a"}}, {"type": "image_url", "image_url": {"url": "a"}},
            {"type": "image_url", "image_url": {"url": "a"}}, {"type": "image_url", "image_url": {"url": "a"}},
            {"type": "image_url", "image_url": {"url": "a"}}
        ]}]);
        assert!(matches!(
            shape(five).unwrap_err(),
            ApiError::TooManyInputs { .. }
        ));
    }

    #[test]
    fn stops_and_seeds() {
        assert_eq!(stops(Some(&json!("x"))).unwrap(), vec!["x"]);
        assert_eq!(stops(Some(&json!(["a", "b"]))).unwrap(), vec!["a", "b"]);
        assert!(stops(Some(&json!([""]))).is_err());
        assert!(stops(Some(&json!(3))).is_err());
        assert_eq!(seed(Some(&json!(7))).unwrap(), 7);
        assert_eq!(seed(Some(&json!(u64::MAX))).unwrap(), u64::MAX);
        assert!(seed(Some(&json!(-1))).is_err());
        assert!(seed(Some(&json!("7"))).is_err());
        assert_ne!(random_u64(), random_u64());
    }
}
