//! Receiving a request's body before the request is admitted.
//!
//! A request takes a queue slot only once its whole body is here, so clients that send headers
//! and then go quiet cannot fill the queue. While a body arrives it holds an upload place: at
//! most `--max-uploads-per-client` per client address and `--max-queue` in all (429 beyond
//! them), for at most `--body-timeout` (408 beyond it).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Request};
use axum::http::header;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::AppState;
use super::error::{ApiError, RETRY_AFTER_SECS};

/// How far past the limit an over-limit body is still read (and discarded) so that its sender
/// gets the 413: a client that overshoots by a few times the limit is answered, not reset.
const OVER_LIMIT_DRAIN: usize = 4;

/// Bodies arriving now: by client address, and in all.
pub struct Uploads {
    per_client: Mutex<HashMap<Option<IpAddr>, usize>>,
    max_per_client: usize,
    max_total: usize,
    total: Arc<Semaphore>,
}

/// One body arriving; its place is given back when this is dropped.
struct Place<'a> {
    uploads: &'a Uploads,
    client: Option<IpAddr>,
    _total: OwnedSemaphorePermit,
}

impl Uploads {
    pub fn new(max_per_client: usize, max_total: usize) -> Self {
        Uploads {
            per_client: Mutex::new(HashMap::new()),
            max_per_client,
            max_total,
            total: Arc::new(Semaphore::new(max_total)),
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Option<IpAddr>, usize>> {
        self.per_client.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn enter(&self, client: Option<IpAddr>) -> Result<Place<'_>, ApiError> {
        let mut counts = self.counts();
        let n = counts.entry(client).or_insert(0);
        if *n >= self.max_per_client {
            return Err(ApiError::TooManyUploads(format!(
                "this client already has {} requests whose bodies are still arriving (--max-uploads-per-client): retry after {RETRY_AFTER_SECS} s",
                self.max_per_client
            )));
        }
        let total = self.total.clone().try_acquire_owned().map_err(|_| {
            ApiError::TooManyUploads(format!(
                "the server is receiving its limit of {} request bodies at once (--max-queue): retry after {RETRY_AFTER_SECS} s",
                self.max_total
            ))
        })?;
        *n += 1;
        Ok(Place {
            uploads: self,
            client,
            _total: total,
        })
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut counts = self.uploads.counts();
        if let Some(n) = counts.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

/// Whether a `Content-Type` is JSON: `application/json` or a `+json` type, any parameters.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The whole body of a JSON request: 415 unless its `Content-Type` is JSON (the types a web page
/// can post across origins without asking are not), 413 over `--max-request-mb`, 429 when its
/// client or the server has too many bodies arriving, 408 past `--body-timeout`.
pub async fn receive(app: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let content_type = content_type(&req);
    if !content_type.as_deref().is_some_and(is_json) {
        drain(req, app.config.limits.max_request_bytes).await;
        return Err(ApiError::UnsupportedMediaType(match content_type {
            Some(t) => format!("{t:?}"),
            None => "none".into(),
        }));
    }
    receive_body(app, req).await
}

/// The whole body of a `multipart/form-data` request (`/v1/images/edits`, as OpenAI takes it)
/// and its boundary, under the limits of [`receive`]. A form is what a web page can post across
/// origins without asking first, so a form sent with an `Origin` header (browsers send one on
/// such posts) is refused unless `--allow-origin` lets that origin in; clients outside a browser
/// send none.
pub async fn receive_form(app: &AppState, req: Request) -> Result<(Bytes, String), ApiError> {
    let limit = app.config.limits.max_request_bytes;
    let content_type = content_type(&req);
    let Some(boundary) = content_type
        .as_deref()
        .and_then(|t| multer::parse_boundary(t).ok())
    else {
        drain(req, limit).await;
        return Err(ApiError::Form(format!(
            "the body must be multipart/form-data with a boundary (Content-Type: multipart/form-data; boundary=…), not {}",
            content_type.map_or("none".into(), |t| format!("{t:?}"))
        )));
    };
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let allowed = &app.config.allow_origins;
        let ok = allowed
            .iter()
            .any(|a| a == "*" || a.as_bytes() == origin.as_bytes());
        if !ok {
            let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
            drain(req, limit).await;
            return Err(ApiError::Form(format!(
                "a form posted by the web page at {origin:?} is refused: a page may post forms to this server only from an origin --allow-origin names"
            )));
        }
    }
    Ok((receive_body(app, req).await?, boundary))
}

fn content_type(req: &Request) -> Option<String> {
    req.headers()
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// The body, whatever its type: 413 over `--max-request-mb`, 429 when its client or the server
/// has too many bodies arriving, 408 past `--body-timeout`.
async fn receive_body(app: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let limits = &app.config.limits;
    let limit = limits.max_request_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if let Some(len) = declared.filter(|&len| len > limit) {
        // Refused before reading, like a full queue or a wrong key: read what the client is
        // sending, so it sees the answer instead of a connection reset mid-upload.
        drain(req, len.min(limit.saturating_mul(OVER_LIMIT_DRAIN))).await;
        return Err(ApiError::BodyTooLarge { limit });
    }
    let client = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let _place = match app.uploads.enter(client) {
        Ok(place) => place,
        Err(e) => {
            // Refused before reading, as an over-limit body is: read what the client is still
            // sending (holding no upload place), so it gets the 429 and not a connection reset
            // mid-upload — one image request of a 32-request burst saw the reset (CI, 2026-12-07).
            drain(req, limit).await;
            return Err(e);
        }
    };
    let read = axum::body::to_bytes(req.into_body(), limit);
    match tokio::time::timeout(limits.body_timeout, read).await {
        Err(_) => Err(ApiError::BodyTimeout(limits.body_timeout)),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if over {
                ApiError::BodyTooLarge { limit }
            } else {
                ApiError::invalid(format!("could not read the body: {e}"))
            })
        }
    }
}

/// Read and discard the body of a request refused before its body was read (at most `limit`
/// bytes, a frame at a time, for at most a few seconds). Closing a connection with unread data
/// makes the kernel reset it, and the client would see a broken connection instead of our answer.
pub async fn drain(req: Request, limit: usize) {
    let mut body = req.into_body();
    let mut read = 0usize;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while let Some(Ok(frame)) = body.frame().await {
            read += frame.data_ref().map_or(0, |d| d.len());
            if read > limit {
                break;
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        for t in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.api+json",
        ] {
            assert!(is_json(t), "{t}");
        }
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "text/json+x",
        ] {
            assert!(!is_json(t), "{t}");
        }
    }

    #[test]
    fn places_are_counted_per_client_and_given_back() {
        let uploads = Uploads::new(2, 3);
        let (a, b) = (Some(IpAddr::from([127, 0, 0, 2])), None);
        let a1 = uploads.enter(a).unwrap();
        let _a2 = uploads.enter(a).unwrap();
        assert!(matches!(uploads.enter(a), Err(ApiError::TooManyUploads(_))));
        let _b1 = uploads.enter(b).unwrap();
        // Three in all.
        let e = uploads.enter(b).err().unwrap().to_string();
        assert!(e.contains("limit of 3"), "{e}");
        drop(a1);
        assert!(uploads.enter(a).is_ok());
        assert_eq!(uploads.counts().get(&a), Some(&1));
    }
}
