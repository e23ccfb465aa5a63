//! Why a request failed, in the OpenAI API's terms (its `code`): what the model-facing modules
//! (the device workers, the input checks, the routing by `model`) report. How each becomes an
//! HTTP answer (status, `type`, `param`, the JSON body, `Retry-After`) is [`crate::http::error`]'s.

use std::time::Duration;

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
    /// A form route's body that is not a form, or a form from a web page not let in.
    #[error("{0}")]
    Form(String),
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
            ApiError::UnsupportedMediaType(_) | ApiError::Form(_) => "unsupported_media_type",
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
            ApiError::Form(String::new()),
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
