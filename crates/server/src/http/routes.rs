//! The handlers.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use super::AppState;
use super::error::ApiError;
use super::types::{
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingValue, EncodingFormat, Health,
    ModelCard, ModelList, Usage,
};
use super::{json, upload};
use crate::embeddings::Job;
use crate::inputs::{self, Context};
use crate::model::{ModelInfo, Served};
use crate::queue::Lane;

/// A request slot, taken once the body has arrived so that admitted requests bound the memory
/// held, and held until the answer; 429 when all are taken. An embedding server has
/// `--max-queue` of them; a chat server `--max-queue` more than the `--max-sequences` it
/// generates at once.
pub(crate) fn take_slot(app: &AppState) -> Result<OwnedSemaphorePermit, ApiError> {
    app.slots.clone().try_acquire_owned().map_err(|_| {
        let l = &app.config.limits;
        match app.model.get() {
            Some(Served::Chat(_)) => ApiError::ChatQueueFull {
                max_queue: l.max_queue,
                max_sequences: l.max_sequences,
            },
            _ => ApiError::QueueFull {
                max_queue: l.max_queue,
            },
        }
    })
}

/// The model, for a request that arrives while the server is ready: 503 while loading or
/// stopping. A request that arrived before shutdown began is finished, body and all.
pub(crate) fn ready(app: &AppState) -> Result<Served, ApiError> {
    if app.stopping.load(Ordering::Relaxed) {
        return Err(ApiError::ShuttingDown);
    }
    Ok(app.model.get().ok_or(ApiError::Loading)?.clone())
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(app): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let info = match ready(&app) {
        Ok(Served::Embed(info)) => info,
        Ok(other) => {
            drain(req, app.config.limits.max_request_bytes).await;
            return Err(other.wrong_route("/v1/embeddings"));
        }
        Err(e) => {
            drain(req, app.config.limits.max_request_bytes).await;
            return Err(e);
        }
    };
    let limit = app.config.limits.request_timeout;
    tokio::time::timeout(limit, embed(app, info, req))
        .await
        .unwrap_or(Err(ApiError::Timeout(limit)))
}

async fn embed(app: AppState, info: Arc<ModelInfo>, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let bytes = upload::receive(&app, req).await?;
    let slot = take_slot(&app)?;
    let body: EmbeddingRequest = json::parse(&bytes)?;
    drop(bytes);
    let prompt_name = prompt_name(&info, &body)?;
    let prefix = inputs::prompt_prefix(&info, prompt_name.as_deref())?;
    let dim = match body.dimensions {
        None => info.dim,
        Some(d) if (1..=info.dim).contains(&d) => d,
        Some(d) => {
            return Err(ApiError::invalid_param(
                "dimensions",
                format!(
                    "dimensions {d} is out of range: this model gives 1 to {}",
                    info.dim
                ),
            ));
        }
    };
    let model = body.model.clone().unwrap_or_else(|| info.name.clone());
    let format = body.encoding_format;

    let checked = {
        let (app, info) = (app.clone(), info.clone());
        tokio::task::spawn_blocking(move || {
            let cx = Context {
                info: &info,
                limits: &app.config.limits,
                allow_file_paths: app.config.allow_file_paths,
                prompt: &prefix,
                image_memory: &app.image_memory,
            };
            inputs::check(&body.input, &cx)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("checking the inputs failed: {e}")))??
    };
    let lane = if checked.images > 0 {
        Lane::Image
    } else {
        Lane::Text
    };
    let (reply, answer) = oneshot::channel();
    app.queue
        .push(Job {
            inputs: checked.inputs,
            tokens: checked.tokens.iter().sum(),
            images: checked.images,
            prompt_name,
            dim,
            lane,
            enqueued: Instant::now(),
            reply,
            span: tracing::Span::current(),
        })
        .map_err(|_| ApiError::ShuttingDown)?;
    let embeddings = answer
        .await
        .map_err(|_| ApiError::Internal("the device worker stopped".into()))??;
    drop(checked.image_memory);
    drop(slot);

    let tokens: usize = embeddings.iter().map(|e| e.tokens).sum();
    app.metrics
        .embedded(lane, tokens, arrived.elapsed().as_secs_f64());
    let data = embeddings
        .into_iter()
        .enumerate()
        .map(|(index, e)| EmbeddingData {
            object: "embedding",
            index,
            embedding: match format {
                EncodingFormat::Float => EmbeddingValue::Float(e.vector),
                EncodingFormat::Base64 => EmbeddingValue::Base64(base64_f32(&e.vector)),
            },
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        object: "list",
        data,
        model,
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
    .into_response())
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

/// The prompt from `prompt_name` or a `model` suffix (`name:prompt`); both must agree.
fn prompt_name(info: &ModelInfo, body: &EmbeddingRequest) -> Result<Option<String>, ApiError> {
    let from_model = info.resolve(body.model.as_deref())?;
    match (from_model, body.prompt_name.as_deref()) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid_param(
            "prompt_name",
            format!("prompt_name {b:?} contradicts the prompt {a:?} in model"),
        )),
        (a, b) => Ok(a.or(b).map(str::to_string)),
    }
}

/// Little-endian float32 bytes in base64, as the openai SDK decodes them.
fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    STANDARD.encode(bytes)
}

/// `GET /v1/models`: the model (an embedding model also with each prompt name), and what it does
/// (`capability`: `embeddings` or `chat`; absent while loading).
pub async fn models(State(app): State<AppState>) -> Json<ModelList> {
    let (ids, capability) = match app.model.get() {
        Some(served) => (served.ids(), Some(served.capability())),
        None => (vec![app.config.served_model_name.clone()], None),
    };
    Json(ModelList {
        object: "list",
        data: ids
            .into_iter()
            .map(|id| ModelCard {
                id,
                object: "model",
                created: app.started,
                owned_by: "tessera",
                capability,
            })
            .collect(),
    })
}

/// `GET /health`: 200 once the model is loaded, 503 before and while stopping.
pub async fn health(State(app): State<AppState>) -> (StatusCode, Json<Health>) {
    let model = app.config.served_model_name.clone();
    match app.model.get() {
        Some(info) if !app.stopping.load(Ordering::Relaxed) => (
            StatusCode::OK,
            Json(Health {
                status: "ready",
                model,
                device: Some(info.device().to_string()),
            }),
        ),
        Some(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "stopping",
                model,
                device: None,
            }),
        ),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "loading",
                model,
                device: None,
            }),
        ),
    }
}

/// `GET /metrics`: Prometheus (OpenMetrics text).
pub async fn metrics(State(app): State<AppState>) -> Result<Response, ApiError> {
    let text = app
        .metrics
        .encode()
        .map_err(|e| ApiError::Internal(format!("encoding metrics: {e}")))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `GET /openapi.json`.
pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::DOCUMENT,
    )
        .into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_string())
}

pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}
