//! The handlers.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::extract::{Path, Request, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use super::AppState;
use super::access::Access;
use super::error::ApiError;
use super::json;
use super::types::{
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingValue, EncodingFormat, Health,
    ModelCard, ModelHealth, ModelList, Usage,
};
use super::upload::{self, drain};
use crate::embeddings::{Job, ModelInfo};
use crate::inputs::{self, Context};
use crate::model::{ModelQueue, ModelSlot, Route, Served};
use crate::queue::Lane;

/// A request let in: its body, its model (loaded) and a request slot of that model, held until
/// the answer.
pub(crate) struct Admitted {
    pub bytes: axum::body::Bytes,
    pub model: Arc<ModelSlot>,
    pub served: Served,
    pub slot: OwnedSemaphorePermit,
    /// The request's access log record (its model is set).
    pub access: Access,
}

/// Refuse a request that arrives while the server stops (503), receive the body (within
/// `--body-timeout`, a few bodies per client at a time), find the model its `model` field names
/// for `route` (404 unknown, 400 a model of another route), check that the model is loaded
/// (503), and take one of the model's request slots (429 when all are taken). The body is parsed in full only after that, so the
/// slots bound the memory that parsed requests hold.
pub(crate) async fn admit(
    app: &AppState,
    req: Request,
    route: Route,
) -> Result<Admitted, ApiError> {
    // A request that arrived before shutdown began is finished, body and all.
    if app.stopping.load(Ordering::Relaxed) {
        drain(req, app.config.limits.max_request_bytes).await;
        return Err(ApiError::ShuttingDown);
    }
    let access = Access::of(&req);
    let bytes = upload::receive(app, req).await?;
    let name = model_field(&bytes);
    admit_received(app, bytes, name.as_deref(), route, access)
}

/// The rest of [`admit`] for a body already received (and, for a form, parsed far enough to
/// know its `model`): find the model, check it is loaded, take a slot.
pub(crate) fn admit_received(
    app: &AppState,
    bytes: axum::body::Bytes,
    name: Option<&str>,
    route: Route,
    access: Access,
) -> Result<Admitted, ApiError> {
    let model = app.models.route(name, route)?;
    access.model(&model.name);
    let served = model.served.get().ok_or(ApiError::Loading)?.clone();
    let slot = take_slot(app, &model)?;
    Ok(Admitted {
        bytes,
        model,
        served,
        slot,
        access,
    })
}

/// The `model` field of a JSON body, when it is a string (anything else is reported by the full
/// parse that follows).
fn model_field(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        #[serde(default)]
        model: Option<serde_json::Value>,
    }
    match serde_json::from_slice::<ModelOnly>(bytes) {
        Ok(ModelOnly {
            model: Some(serde_json::Value::String(m)),
        }) => Some(m),
        _ => None,
    }
}

/// One of `model`'s request slots; 429 when all are taken.
fn take_slot(app: &AppState, model: &ModelSlot) -> Result<OwnedSemaphorePermit, ApiError> {
    model.slots.clone().try_acquire_owned().map_err(|_| {
        let l = &app.config.limits;
        match model.route {
            Route::Chat => ApiError::ChatQueueFull {
                max_queue: l.max_queue,
                max_sequences: l.max_sequences,
            },
            Route::Embeddings | Route::Images => ApiError::QueueFull {
                max_queue: l.max_queue,
            },
        }
    })
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(app): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let limit = app.config.limits.request_timeout;
    tokio::time::timeout(limit, embed(app, req))
        .await
        .unwrap_or(Err(ApiError::Timeout(limit)))
}

async fn embed(app: AppState, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let Admitted {
        bytes,
        model: slot_model,
        served,
        slot,
        access,
    } = admit(&app, req, Route::Embeddings).await?;
    let (Served::Embed(info), ModelQueue::Embed(queue)) = (served, &slot_model.queue) else {
        return Err(ApiError::Internal(format!(
            "{} is not an embedding model",
            slot_model.name
        )));
    };
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
    queue
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
    access.tokens(tokens, None);
    if checked.images > 0 {
        access.images(checked.images);
    }
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

/// `GET /v1/models`: every model (an embedding model also with each prompt name, once loaded),
/// and what it does (`capability`: `embeddings`, `chat` or `images`).
pub async fn models(State(app): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: cards(&app),
    })
}

/// `GET /v1/models/{model}`: one of the ids `/v1/models` lists (OpenAI's "retrieve model"); 404
/// `model_not_found` for any other. The id may hold `/` (a served name such as `org/model`).
pub async fn model(
    State(app): State<AppState>,
    Path(id): Path<String>,
    req: Request,
) -> Result<Json<ModelCard>, ApiError> {
    let card = cards(&app).into_iter().find(|c| c.id == id);
    if let Some(card) = &card {
        Access::of(&req).model(&card.id);
    }
    card.map(Json).ok_or_else(|| {
        ApiError::ModelNotFound(format!(
            "the model {id:?} is not served here; this server serves {}",
            app.models.listing()
        ))
    })
}

/// The card of every id a client may send as `model`.
fn cards(app: &AppState) -> Vec<ModelCard> {
    app.models
        .0
        .iter()
        .flat_map(|m| {
            let ids = m
                .served
                .get()
                .map_or_else(|| vec![m.name.clone()], Served::ids);
            let capability = m.route.capability();
            ids.into_iter().map(move |id| ModelCard {
                id,
                object: "model",
                created: app.started,
                owned_by: "tessera",
                capability: Some(capability),
            })
        })
        .collect()
}

/// `GET /health`: 200 once every model is loaded, 503 before and while stopping; each model's
/// state in `models`.
pub async fn health(State(app): State<AppState>) -> (StatusCode, Json<Health>) {
    let models: Vec<ModelHealth> = app
        .models
        .0
        .iter()
        .map(|m| ModelHealth {
            id: m.name.clone(),
            capability: m.route.capability(),
            status: if m.served.get().is_some() {
                "ready"
            } else {
                "loading"
            },
            device: m.served.get().map(|s| s.device().to_string()),
        })
        .collect();
    let first = models.first();
    let model = first.map_or_else(String::new, |m| m.id.clone());
    let device = first.and_then(|m| m.device.clone());
    let (code, status) = if !app.models.all_loaded() {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    } else if app.stopping.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "stopping")
    } else {
        (StatusCode::OK, "ready")
    };
    let ready = code == StatusCode::OK;
    (
        code,
        Json(Health {
            status,
            model,
            device: device.filter(|_| ready),
            models,
        }),
    )
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
