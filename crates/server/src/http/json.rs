//! [`ApiJson`]: a JSON body extractor whose every rejection is an OpenAI-shaped [`ApiError`]
//! (axum's own answers malformed bodies in plain text).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use super::error::ApiError;
use super::routes::drain;

/// How far past the limit an over-limit body is still read (and discarded) so that its sender
/// gets the 413: a client that overshoots by a few times the limit is answered, not reset.
const OVER_LIMIT_DRAIN: usize = 4;

/// The body parsed as `T`, whatever the `Content-Type` (curl's `-d` sends a form type).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(usize::MAX, |l| l.0);
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
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge { limit }
            } else {
                ApiError::invalid(format!("could not read the body: {e}"))
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// The body limit, put into request extensions by the router so the 413 message can state it.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

/// Parse JSON, naming the field at fault for valid JSON of the wrong shape.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => {
                    Err(ApiError::InvalidJson(inner.to_string()))
                }
                Category::Data if path == "." => Err(ApiError::invalid(inner.to_string())),
                Category::Data => Err(ApiError::invalid_param(
                    path.clone(),
                    format!("{path}: {inner}"),
                )),
            }
        }
    }
}
