//! What the streamed routes (chat completions, image generations) share: their answer as a
//! response of server-sent events, and one ready data frame of their bodies.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use http_body_util::Full;

/// `http_body::Frame<Bytes>` polled, named through http-body-util (the server does not depend
/// on http-body itself).
pub type Polled = <http_body_util::combinators::Frame<'static, Full<Bytes>> as Future>::Output;

/// One data frame.
pub fn frame(bytes: Bytes) -> Poll<Polled> {
    // A `Full` of non-empty bytes is ready at once with one data frame.
    let mut full = Full::new(bytes);
    Pin::new(&mut full).poll_frame(&mut Context::from_waker(Waker::noop()))
}

/// `body` as a `text/event-stream` response that nothing on the way should cache or buffer.
pub fn response(
    body: impl HttpBody<Data = Bytes, Error = Infallible> + Send + 'static,
) -> Response {
    let mut response = Body::new(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies that buffer (nginx) would hold the events back.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}
