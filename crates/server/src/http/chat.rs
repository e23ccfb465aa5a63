//! `POST /v1/chat/completions`: the handler, the whole answer and the streamed one.
//!
//! The body is received and a request slot taken as for embeddings; the request is checked and
//! its prompt built off the async threads ([`crate::chat_inputs`]), then queued for the device
//! worker ([`crate::chat`]), whose events come back on a channel. The answer waits for the
//! first event, so a reply that fails before its first text is an HTTP error of its own; after
//! that a streamed reply is server-sent events (`chat.completion.chunk` objects, then
//! `data: [DONE]`), and an error mid-stream is one `data: {"error": …}` event before `[DONE]`.
//!
//! `--request-timeout` bounds the time to the whole answer, or for a streamed one to its first
//! text. A client that goes away (or times out) drops the channel, and the worker stops its
//! reply at the next step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Json;
use axum::body::{Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::AppState;
use super::access::Access;
use super::error::ApiError;
use super::json;
use super::routes::{Admitted, admit};
use super::sse::{self, Polled, frame};
use super::types::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatRequest, ChatUsage, ChunkChoice,
    Delta, PromptTokensDetails,
};
use crate::chat::{Event, Job, finish_reason};
use crate::chat_inputs::{self, random_u64};
use crate::model::{ModelQueue, Route, Served};
use tessera_runtime::chat::ChatReply;

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(app): State<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let limit = app.config.limits.request_timeout;
    let deadline = tokio::time::Instant::now() + limit;
    let started = tokio::time::timeout_at(deadline, start(app, req))
        .await
        .unwrap_or(Err(ApiError::Timeout(limit)))?;
    if started.stream {
        return Ok(stream(started));
    }
    tokio::time::timeout_at(deadline, whole(started))
        .await
        .unwrap_or(Err(ApiError::Timeout(limit)))
}

/// What a reply's answer holds until it ends: the request slot and the image memory.
struct Held {
    _slot: OwnedSemaphorePermit,
    _images: Vec<OwnedSemaphorePermit>,
}

/// A reply under way: its first event is here.
struct Started {
    id: String,
    created: u64,
    model: String,
    stream: bool,
    include_usage: bool,
    first: Event,
    events: UnboundedReceiver<Event>,
    held: Held,
    access: Access,
}

/// Receive, check, build the prompt, queue, and wait for the first event.
async fn start(app: AppState, req: Request) -> Result<Started, ApiError> {
    let arrived = Instant::now();
    let Admitted {
        bytes,
        model,
        served,
        slot,
        access,
    } = admit(&app, req, Route::Chat).await?;
    let (Served::Chat(info), ModelQueue::Chat(queue)) = (served, &model.queue) else {
        return Err(ApiError::Internal(format!(
            "{} is not a chat model",
            model.name
        )));
    };
    // Preparing the prompt counts against the queue's budget, as waiting does.
    let waiting = match &model.waiting {
        Some(w) => Some(w.clone().try_acquire_owned().map_err(|_| {
            let l = &app.config.limits;
            ApiError::ChatQueueFull {
                max_queue: l.max_queue,
                max_sequences: l.max_sequences,
            }
        })?),
        None => None,
    };
    let body: ChatRequest = json::parse(&bytes)?;
    drop(bytes);
    let settings = chat_inputs::settings(&body, &info)?;
    let (messages, images) = chat_inputs::messages(
        body.messages.as_ref(),
        app.config.limits.max_inputs,
        info.prompter.reserved_text(),
    )?;
    drop(body);
    let (prompt, image_memory) = {
        let (app, info) = (app.clone(), info.clone());
        tokio::task::spawn_blocking(move || {
            let cx = chat_inputs::Context {
                info: &info,
                limits: &app.config.limits,
                allow_file_paths: app.config.allow_file_paths,
                image_memory: &app.image_memory,
            };
            chat_inputs::prompt(&messages, &images, &cx)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("building the prompt failed: {e}")))??
    };
    let params = settings.params(prompt.ids.len(), info.context);
    let (tx, mut events) = unbounded_channel();
    queue
        .push(Job {
            prompt,
            params,
            events: tx,
            arrived,
            enqueued: Instant::now(),
            span: tracing::Span::current(),
            waiting,
        })
        .map_err(|_| ApiError::ShuttingDown)?;
    let first = events.recv().await.ok_or_else(worker_stopped)?;
    if let Event::Failed(e) = first {
        return Err(e);
    }
    Ok(Started {
        id: format!("chatcmpl-{:016x}{:016x}", random_u64(), random_u64()),
        created: unix_now(),
        model: info.name.clone(),
        stream: settings.stream,
        include_usage: settings.include_usage,
        first,
        events,
        held: Held {
            _slot: slot,
            _images: image_memory,
        },
        access,
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

fn usage(r: &ChatReply) -> ChatUsage {
    ChatUsage {
        prompt_tokens: r.prompt_tokens,
        completion_tokens: r.completion_tokens,
        total_tokens: r.prompt_tokens + r.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: r.cached_tokens,
        },
    }
}

/// The whole reply as one `chat.completion`.
async fn whole(mut s: Started) -> Result<Response, ApiError> {
    let mut next = Some(s.first);
    loop {
        let ev = match next.take() {
            Some(ev) => ev,
            None => s.events.recv().await.ok_or_else(worker_stopped)?,
        };
        match ev {
            Event::Text(_) => {}
            Event::Failed(e) => return Err(e),
            Event::Done(r) => {
                drop(s.held);
                s.access.tokens(r.prompt_tokens, Some(r.completion_tokens));
                let usage = usage(&r);
                return Ok(Json(ChatCompletion {
                    id: s.id,
                    object: "chat.completion",
                    created: s.created,
                    model: s.model,
                    choices: vec![ChatChoice {
                        index: 0,
                        message: AssistantMessage {
                            role: "assistant",
                            content: r.text,
                        },
                        finish_reason: finish_reason(r.finish),
                        logprobs: None,
                    }],
                    usage,
                })
                .into_response());
            }
        }
    }
}

/// The reply as server-sent events.
fn stream(s: Started) -> Response {
    let mut body = EventStream {
        first: Some(s.first),
        events: s.events,
        out: VecDeque::new(),
        done: false,
        id: s.id,
        created: s.created,
        model: s.model,
        include_usage: s.include_usage,
        _held: s.held,
        access: s.access,
    };
    body.chunk(
        Delta {
            role: Some("assistant"),
            content: Some(String::new()),
        },
        None,
    );
    sse::response(body)
}

/// A streamed reply's body: each event of the worker becomes one `data:` line, sent as soon as
/// it comes (no buffering); dropping it (the client went away) drops the channel.
struct EventStream {
    first: Option<Event>,
    events: UnboundedReceiver<Event>,
    /// Encoded events not yet sent.
    out: VecDeque<Bytes>,
    /// `[DONE]` is queued: nothing more comes.
    done: bool,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    _held: Held,
    access: Access,
}

/// One `data:` line.
fn line(json: &impl serde::Serialize) -> Bytes {
    // Our own types always serialise.
    let json = serde_json::to_string(json).unwrap_or_else(|_| "{}".into());
    Bytes::from(format!("data: {json}\n\n"))
}

impl EventStream {
    fn chunk_of(
        &self,
        choices: Vec<ChunkChoice>,
        usage: Option<Option<ChatUsage>>,
    ) -> ChatChunk<'_> {
        ChatChunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }

    fn chunk(&mut self, delta: Delta, finish_reason: Option<&'static str>) {
        let choice = ChunkChoice {
            index: 0,
            delta,
            finish_reason,
            logprobs: None,
        };
        let bytes = line(&self.chunk_of(vec![choice], self.include_usage.then_some(None)));
        self.out.push_back(bytes);
    }

    fn end(&mut self) {
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }

    fn push(&mut self, ev: Event) {
        match ev {
            Event::Text(t) => self.chunk(
                Delta {
                    role: None,
                    content: Some(t),
                },
                None,
            ),
            Event::Done(r) => {
                self.access
                    .tokens(r.prompt_tokens, Some(r.completion_tokens));
                self.chunk(Delta::default(), Some(finish_reason(r.finish)));
                if self.include_usage {
                    let total = Some(Some(usage(&r)));
                    let bytes = line(&self.chunk_of(Vec::new(), total));
                    self.out.push_back(bytes);
                }
                self.end();
            }
            Event::Failed(e) => {
                tracing::warn!(code = e.code(), "a streamed reply failed: {e}");
                self.out.push_back(line(&e.body()));
                self.end();
            }
        }
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
