//! The HTTP side: routes, request and response shapes, errors, authentication.

pub mod access;
pub mod auth;
pub mod chat;
pub mod edits;
pub mod error;
pub mod images;
pub mod json;
pub mod routes;
pub mod sse;
pub mod types;
pub mod upload;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response;
use axum::routing::{get, post};
use tokio::sync::Semaphore;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use tracing::Level;

use crate::config::ServerConfig;
use crate::metrics::Metrics;
use crate::model::Models;
use error::ErrorCode;
use upload::Uploads;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    /// The served models: each one's route, queue, request slots and, once loaded, metadata.
    pub models: Arc<Models>,
    /// Bodies arriving now, per client and in all.
    pub uploads: Arc<Uploads>,
    /// `--max-image-memory-mb`, in MiB of decoded images.
    pub image_memory: Arc<Semaphore>,
    pub metrics: Arc<Metrics>,
    /// Set when shutdown begins: new requests get 503.
    pub stopping: Arc<AtomicBool>,
    /// Unix time of the start (`created` in `/v1/models`).
    pub started: u64,
}

impl AppState {
    /// Bodies may arrive for as many requests as the models admit together.
    pub fn new(config: ServerConfig, models: Models, metrics: Arc<Metrics>) -> Self {
        let limits = &config.limits;
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let slots: usize = models.0.iter().map(|m| m.slots.available_permits()).sum();
        AppState {
            uploads: Arc::new(Uploads::new(limits.max_uploads_per_client, slots.max(1))),
            image_memory: Arc::new(Semaphore::new(limits.max_image_memory_mb)),
            config: Arc::new(config),
            models: Arc::new(models),
            metrics,
            stopping: Arc::new(AtomicBool::new(false)),
            started,
        }
    }
}

/// The whole API. `/health` is open (and `/metrics` with `--metrics-public`); every other route
/// needs the API key when one is set. Every request gets one access log line ([`access`]).
pub fn router(app: AppState) -> Result<Router, tessera_core::Error> {
    let limit = app.config.limits.max_request_bytes;
    let cors = cors(&app.config.allow_origins)?;
    let protected = Router::new()
        .route("/v1/embeddings", post(routes::embeddings))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/images/generations", post(images::generations))
        .route("/v1/images/edits", post(edits::edits))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{*model}", get(routes::model))
        .route("/openapi.json", get(routes::openapi));
    // Prometheus scrapers carry no token: `--metrics-public` lets them in.
    let (open, protected) = if app.config.metrics_public {
        (
            Router::new().route("/metrics", get(routes::metrics)),
            protected,
        )
    } else {
        (
            Router::new(),
            protected.route("/metrics", get(routes::metrics)),
        )
    };
    let protected = protected.route_layer(from_fn_with_state(app.clone(), auth::require_api_key));
    let router = Router::new()
        .route("/health", get(routes::health))
        .merge(open)
        .merge(protected)
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(from_fn_with_state(app.metrics.clone(), count_requests))
        .layer(axum::middleware::from_fn(access::log))
        // For body extractors; none reads a body today (`upload::receive` enforces the same
        // limit itself), but a route added with `Json<T>` gets the configured limit, not axum's.
        .layer(DefaultBodyLimit::max(limit))
        // The request's span; the access log says how each request ended, so a 5xx (a 503 from
        // /health while loading) is no ERROR line here.
        .layer(TraceLayer::new_for_http().on_failure(DefaultOnFailure::new().level(Level::DEBUG)))
        .with_state(app);
    Ok(match cors {
        Some(cors) => router.layer(cors),
        None => router,
    })
}

/// CORS for `--allow-origin` (`*` for any origin); none when no origin is given.
fn cors(origins: &[String]) -> Result<Option<CorsLayer>, tessera_core::Error> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let list = origins
            .iter()
            .map(|o| {
                HeaderValue::from_str(o).map_err(|_| {
                    tessera_core::Error::input(format!(
                        "--allow-origin {o:?} is not a valid origin"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    ))
}

/// Count every answer by route, status and error code.
async fn count_requests(
    State(metrics): State<Arc<Metrics>>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let route = matched.map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let response = next.run(req).await;
    let code = response.extensions().get::<ErrorCode>().map_or("", |c| c.0);
    metrics.request(&route, response.status().as_u16(), code);
    response
}
