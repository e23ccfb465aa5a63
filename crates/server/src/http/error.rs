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
//! | 415 | `unsupported_media_type` | a body whose `Content-Type` is not JSON |
//! | 429 | `queue_full`, `too_many_uploads` | the queue (chat: `--max-sequences` generating and `--max-queue` waiting; images: also its cost budget) or the image memory is full, or the client has `--max-uploads-per-client` bodies still arriving (with `Retry-After`) |
//! | 500 | `internal_error` | the device failed; the message says how |
//! | 503 | `model_loading`, `shutting_down` | not ready yet, or stopping (with `Retry-After`) |
//! | 504 | `timeout` | no answer within `--request-timeout` (images: `--image-timeout`) |

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Seconds a client is told to wait after a 429 or a 503.
pub const RETRY_AFTER_SECS: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("{message}")]
    InvalidRequest {
        message: String,
        /// The request field at fault, when there is one.
        param: Option<String>,
    },
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    FilePathsNotAllowed(String),
    #[error("{0}")]
    ModelNotFound(String),
    #[error("no route {0}")]
    NotFound(String),
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body did not arrive within {0:?} (--body-timeout)")]
    BodyTimeout(Duration),
    #[error(
        "the request body is larger than the server's limit of {limit} bytes (--max-request-mb)"
    )]
    BodyTooLarge { limit: usize },
    #[error("{message}")]
    TooManyInputs {
        message: String,
        /// `input` (embeddings) or `messages` (chat).
        param: &'static str,
    },
    #[error(
        "the body must be JSON with the header Content-Type: application/json, not {0} (form and text bodies are refused so that a web page cannot post to this server)"
    )]
    UnsupportedMediaType(String),
    #[error("{0}")]
    InputTooLarge(String),
    #[error("the server's queue is full ({max_queue} requests): retry after {RETRY_AFTER_SECS} s")]
    QueueFull { max_queue: usize },
    #[error(
        "the server is busy: {max_sequences} replies being generated (--max-sequences) and {max_queue} waiting (--max-queue): retry after {RETRY_AFTER_SECS} s"
    )]
    ChatQueueFull {
        max_queue: usize,
        max_sequences: usize,
    },
    #[error("{0}")]
    QueueMemory(String),
    #[error("{0}")]
    TooManyUploads(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("the model is still loading: retry after {RETRY_AFTER_SECS} s")]
    Loading,
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("no answer within {0:?} (--request-timeout)")]
    Timeout(Duration),
    #[error("the images were not made within {0:?} (--image-timeout)")]
    ImageTimeout(Duration),
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// The status table.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_) | ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::FilePathsNotAllowed(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
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

    /// The machine-readable `code`, also the label of the failure metric.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::Unauthorized(_) => "invalid_api_key",
            ApiError::FilePathsNotAllowed(_) => "file_paths_not_allowed",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::TooManyUploads(_) => "too_many_uploads",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::TooManyInputs { .. } => "too_many_inputs",
            ApiError::InputTooLarge(_) => "input_too_large",
            ApiError::QueueFull { .. }
            | ApiError::ChatQueueFull { .. }
            | ApiError::QueueMemory(_) => "queue_full",
            ApiError::Internal(_) => "internal_error",
            ApiError::Loading => "model_loading",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Timeout(_) | ApiError::ImageTimeout(_) => "timeout",
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

    /// One of each variant, for the test that keeps the OpenAPI document in sync.
    pub fn examples() -> Vec<ApiError> {
        vec![
            ApiError::InvalidJson(String::new()),
            ApiError::invalid(""),
            ApiError::Unauthorized(""),
            ApiError::FilePathsNotAllowed(String::new()),
            ApiError::ModelNotFound(String::new()),
            ApiError::NotFound(String::new()),
            ApiError::MethodNotAllowed {
                method: String::new(),
                path: String::new(),
            },
            ApiError::BodyTimeout(Duration::ZERO),
            ApiError::UnsupportedMediaType(String::new()),
            ApiError::TooManyUploads(String::new()),
            ApiError::BodyTooLarge { limit: 0 },
            ApiError::TooManyInputs {
                message: String::new(),
                param: "input",
            },
            ApiError::InputTooLarge(String::new()),
            ApiError::QueueFull { max_queue: 0 },
            ApiError::ChatQueueFull {
                max_queue: 0,
                max_sequences: 0,
            },
            ApiError::QueueMemory(String::new()),
            ApiError::Internal(String::new()),
            ApiError::Loading,
            ApiError::ShuttingDown,
            ApiError::Timeout(Duration::ZERO),
            ApiError::ImageTimeout(Duration::ZERO),
        ]
    }
}

/// A model error from the device worker: the user's fault (400), an input too large for the
/// device (413), or ours (500).
impl From<tessera_core::Error> for ApiError {
    fn from(e: tessera_core::Error) -> Self {
        match e {
            tessera_core::Error::Input(m) => ApiError::invalid(m),
            e @ tessera_core::Error::OutOfMemory(_) => ApiError::InputTooLarge(e.to_string()),
            e => ApiError::Internal(e.to_string()),
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
        if status.is_server_error() {
            tracing::error!(code = self.code(), "{self}");
        } else {
            tracing::debug!(code = self.code(), status = status.as_u16(), "{self}");
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
