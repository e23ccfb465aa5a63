//! The access log: one line per request at info level, written when its answer has been sent
//! (a streamed answer: at its end), with the method, the route, the status, the time from
//! arrival to the last byte, and what the handler recorded on the way: the model that answered,
//! the tokens or images, the seed, the error code.
//!
//! The middleware ([`log`]) gives each request an [`Access`] record in its extensions; handlers
//! fill it in ([`Access::model`], [`Access::tokens`], [`Access::images`]) and the line is
//! written when the response body is dropped, so it holds what only the end of a stream knows.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::error::ErrorCode;

/// What a handler learned about its request, for the access log line. Cloning shares it.
#[derive(Clone, Default)]
pub struct Access(Arc<Mutex<Note>>);

#[derive(Default)]
struct Note {
    model: Option<String>,
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    images: Option<usize>,
    seed: Option<u64>,
}

impl Access {
    /// The record of `req` (a detached one outside the middleware, e.g. in unit tests).
    pub fn of(req: &Request) -> Access {
        req.extensions()
            .get::<Access>()
            .cloned()
            .unwrap_or_default()
    }

    fn note(&self) -> std::sync::MutexGuard<'_, Note> {
        // Each change is one field set: a poisoned lock is consistent.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The served model that answers the request.
    pub fn model(&self, name: &str) {
        self.note().model = Some(name.to_string());
    }

    /// Tokens read and (chat) generated.
    pub fn tokens(&self, prompt: usize, completion: Option<usize>) {
        let mut n = self.note();
        n.prompt_tokens = Some(prompt);
        n.completion_tokens = completion;
    }

    /// Images made.
    pub fn images(&self, n: usize) {
        self.note().images = Some(n);
    }

    /// The seed of an image request (the request's, or the one drawn for it).
    pub fn seed(&self, seed: u64) {
        self.note().seed = Some(seed);
    }
}

/// Give the request its [`Access`] record, run it, and log its line once the answer's body is
/// done (or dropped: the client went away).
pub async fn log(matched: Option<MatchedPath>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let route = match matched {
        Some(m) => m.as_str().to_string(),
        // An unknown path is the client's text: bounded, and escaped so that it stays one line.
        None => req
            .uri()
            .path()
            .chars()
            .take(200)
            .flat_map(char::escape_debug)
            .collect(),
    };
    let access = Access::default();
    req.extensions_mut().insert(access.clone());
    let response = next.run(req).await;
    let line = Line {
        method,
        route,
        status: response.status(),
        code: response.extensions().get::<ErrorCode>().map(|c| c.0),
        started,
        access,
    };
    let (parts, body) = response.into_parts();
    Response::from_parts(
        parts,
        Body::new(Logged {
            inner: body,
            line: Some(line),
            ended: false,
        }),
    )
}

/// The line of one request, written once.
struct Line {
    method: Method,
    route: String,
    status: StatusCode,
    code: Option<&'static str>,
    started: Instant,
    access: Access,
}

impl Line {
    fn write(self, complete: bool) {
        let note = self.access.note();
        tracing::info!(
            method = %self.method,
            route = %self.route,
            status = self.status.as_u16(),
            ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0,
            model = note.model.as_deref().map(tracing::field::display),
            prompt_tokens = note.prompt_tokens,
            completion_tokens = note.completion_tokens,
            images = note.images,
            seed = note.seed,
            code = self.code,
            // Only said when the client left before the whole answer was sent.
            complete = (!complete).then_some(false),
            "request"
        );
    }
}

/// A response body that writes the request's line when it is done or dropped.
struct Logged {
    inner: Body,
    line: Option<Line>,
    ended: bool,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            this.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        if let Some(line) = self.line.take() {
            line.write(self.ended || self.inner.is_end_stream());
        }
    }
}
