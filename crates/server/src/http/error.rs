//! One error type for every HTTP answer that is not a success, one status table, and the OpenAI
//! error body `{"error": {"message", "type", "param", "code"}}`.
//!
//! The table (also in the OpenAPI document, kept in sync by a test):
//!
//! | status | code | when |
//! |---|---|---|
//! | 400 | `invalid_json` | the body is not JSON |
//! | 400 | `invalid_request` | wrong types, unknown fields, empty or bad inputs, bad images, prompt names, `dimensions`; bad messages, roles or sampling, what chat does not support (`n` > 1, `tools`, …); a bad prompt, size, `n`, step count or output setting of an image request, a size the model refuses; a model of another route |
//! | 401 | `invalid_api_key` | a missing or wrong `Authorization: Bearer` key |
//! | 403 | `file_paths_not_allowed` | a file path while the server runs without `--allow-file-paths` |
//! | 404 | `model_not_found`, `not_found` | an unknown model, an unknown route |
//! | 405 | `method_not_allowed` | a known route with the wrong method |
//! | 408 | `body_timeout` | the body did not arrive within `--body-timeout` |
//! | 413 | `body_too_large`, `too_many_inputs`, `input_too_large` | a body, input count or input over its limit; an image request costing more than the image queue holds |
//! | 415 | `unsupported_media_type` | a body whose `Content-Type` is not JSON (not a form, for `/v1/images/edits`; or a form a web page posted from an origin not allowed) |
//! | 429 | `queue_full`, `too_many_uploads` | the queue (chat: `--max-sequences` generating and `--max-queue` waiting; images: also its cost budget) or the image memory is full, or the client has `--max-uploads-per-client` bodies still arriving (with `Retry-After`) |
//! | 500 | `internal_error` | the device failed; the message says how |
//! | 503 | `model_loading`, `shutting_down` | not ready yet, or stopping (with `Retry-After`) |
//! | 504 | `timeout` | no answer within `--request-timeout` (images: `--image-timeout`) |

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

pub use crate::error::{ApiError, RETRY_AFTER_SECS};

impl ApiError {
    /// The status table.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_) | ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::FilePathsNotAllowed(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) | ApiError::Form(_) => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            ApiError::BodyTooLarge { .. }
            | ApiError::TooManyInputs { .. }
            | ApiError::InputTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull { .. }
            | ApiError::ChatQueueFull { .. }
            | ApiError::QueueMemory(_)
            | ApiError::TooManyUploads(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Loading | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) | ApiError::ImageTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// OpenAI's `type`: the family of the error.
    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::TooManyInputs { param, .. } => Some(param),
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

#[derive(Serialize)]
struct Detail<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl ApiError {
    /// The OpenAI error body, `{"error": {"message", "type", "param", "code"}}` (also what a
    /// streamed reply sends as its last event when it fails).
    pub fn body(&self) -> impl Serialize + '_ {
        Body {
            error: Detail {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        // Only our own failures are errors: a timeout is worth a warning, and a 503 while loading
        // or stopping is the answer working as meant (the access log line has it at info).
        match self {
            ApiError::Internal(_) => tracing::error!(code = self.code(), "{self}"),
            ApiError::Timeout(_) | ApiError::ImageTimeout(_) => {
                tracing::warn!(code = self.code(), "{self}")
            }
            _ => tracing::debug!(code = self.code(), status = status.as_u16(), "{self}"),
        }
        let mut response = (status, Json(self.body())).into_response();
        if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        }
        // The rest of the body may be left unread, and the connection then closes after this
        // answer: say so, or a client's pool may send its next request into it.
        if matches!(
            self,
            ApiError::BodyTooLarge { .. } | ApiError::BodyTimeout(_) | ApiError::TooManyUploads(_)
        ) {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        // Lets the metrics layer count failures by code without parsing the body.
        response.extensions_mut().insert(ErrorCode(self.code()));
        response
    }
}

/// The `code` of an error response, left in its extensions for the metrics layer.
#[derive(Clone, Copy, Debug)]
pub struct ErrorCode(pub &'static str);
