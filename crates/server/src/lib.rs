//! `tessera serve`: an OpenAI-compatible server for one or several models at once: embeddings
//! (EmbeddingGemma 2, `/v1/embeddings`), chat (LFM2-VL, `/v1/chat/completions`) and image
//! generation (Z-Image and any `GenerateImage` family, `/v1/images/generations`). Each request is
//! routed by its `model` field to the model of that name; a model of another route answers 400
//! saying which models serve which route.
//!
//! Layers, from the socket in:
//! - [`http`]: axum routes, OpenAI-shaped errors, the API key and CORS, one access log line per
//!   request ([`http::access`]); a request's body is
//!   received whole first (JSON only, within `--body-timeout`, a few bodies per client at a
//!   time), then routed to its model, which must be loaded, then takes one of that model's
//!   request slots (`--max-queue`, else 429); its inputs are checked (images decoded, prompts
//!   built, generation requests checked by the model's own rules) off the async threads before
//!   anything is queued;
//! - [`model`]: the served models as the HTTP side sees them (name, route, queue, limits) and
//!   the routing by `model`;
//! - [`queue`]: lanes and size-aware batches, generic over the job type;
//! - [`worker`]: one thread per model that loads and owns it and runs its batches, generic over
//!   what runs them ([`worker::Runner`]). Models do not wait for each other: each has its own
//!   thread and queue, and on a GPU its own CUDA stream, so a short embedding request runs while
//!   a long generation is under way (the device interleaves their kernels);
//! - [`embeddings`]: the embeddings job and its runner, which retries a failed merged batch
//!   request by request;
//! - [`chat_inputs`] and [`chat`]: a chat request checked and its prompt built before it is
//!   queued, then the device worker's step loop with continuous batching (sequences join and
//!   leave between steps, bounded by the cache slots, `--max-sequences`);
//! - [`images`]: the generation job and its runner: requests of one size and step count that
//!   wait together share denoiser forwards, progress and previews go back after each step, and a
//!   request whose client is gone stops at the next step;
//! - [`metrics`]: Prometheus counters and histograms;
//! - [`error`]: why a request failed, as the model-facing modules report it ([`http::error`]
//!   makes it an answer).
//!
//! [`serve`] runs it all on a bound listener, so tests start it on port 0.

pub mod chat;
pub mod chat_inputs;
pub mod config;
pub mod embeddings;
pub mod error;
pub mod files;
pub mod http;
pub mod images;
pub mod inputs;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod queue;
pub mod worker;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

pub use chat::ChatLoader;
pub use config::{Limits, Schedule, ServerConfig};
pub use embeddings::Loader;
pub use images::ImageLoader;

use chat::ChatQueue;
use config::COST_UNITS_PER_MPS;
use http::AppState;
use metrics::Metrics;
use model::{ModelQueue, ModelSlot, Models, Route, Served};
use queue::Queue;
use tokio::sync::Semaphore;

/// A model a server loads, which decides what it serves.
pub enum ModelLoader {
    /// An embedding model: `/v1/embeddings`.
    Embed(Loader),
    /// A chat model: `/v1/chat/completions`.
    Chat(ChatLoader),
    /// A text-to-image model: `/v1/images/generations`.
    Image(ImageLoader),
}

impl ModelLoader {
    pub fn route(&self) -> Route {
        match self {
            ModelLoader::Embed(_) => Route::Embeddings,
            ModelLoader::Chat(_) => Route::Chat,
            ModelLoader::Image(_) => Route::Images,
        }
    }
}

impl From<Loader> for ModelLoader {
    fn from(l: Loader) -> Self {
        ModelLoader::Embed(l)
    }
}

impl From<ChatLoader> for ModelLoader {
    fn from(l: ChatLoader) -> Self {
        ModelLoader::Chat(l)
    }
}

/// A model to serve under a name (the id clients send as `model`).
pub struct ServedModel {
    pub name: String,
    pub loader: ModelLoader,
}

impl ServedModel {
    pub fn new(name: impl Into<String>, loader: impl Into<ModelLoader>) -> Self {
        ServedModel {
            name: name.into(),
            loader: loader.into(),
        }
    }

    /// A text-to-image model.
    pub fn image(name: impl Into<String>, loader: ImageLoader) -> Self {
        ServedModel {
            name: name.into(),
            loader: ModelLoader::Image(loader),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] tessera_core::Error),
    #[error("loading the model {model:?}: {source}")]
    Load {
        model: String,
        #[source]
        source: tessera_core::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Serve `models` on `listener` until `shutdown` completes, then finish the requests in flight
/// and stop.
///
/// Each model is loaded by its loader on its own device worker's thread, all at once, while the
/// listener already answers (`/health` says `loading` until every model is loaded; a model's
/// requests get 503 until it is). A failed load stops the server and is returned.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: ServerConfig,
    models: Vec<ServedModel>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    config.validate()?;
    config::check_names(models.iter().map(|m| m.name.as_str()))?;
    let metrics = Arc::new(Metrics::new());
    let limits = &config.limits;
    let mut slots = Vec::with_capacity(models.len());
    let mut workers = Vec::with_capacity(models.len());
    let mut loads = Vec::with_capacity(models.len());
    for ServedModel { name, loader } in models {
        let route = loader.route();
        let spawn_failed = |source| ServeError::Io {
            what: "starting a device worker",
            source,
        };
        let (queue, (worker, loaded), admitted, cost) = match loader {
            ModelLoader::Embed(loader) => {
                let queue =
                    Arc::new(Queue::new(config.schedule, limits, metrics.clone()).for_model(&name));
                let load = embeddings::load(name.clone(), loader, limits, metrics.clone());
                let load: worker::Load<_, Served> = Box::new(move || {
                    load().map(|(runner, info)| (runner, Served::Embed(Arc::new(info))))
                });
                let spawned = worker::spawn(&name, load, queue.clone()).map_err(spawn_failed)?;
                (ModelQueue::Embed(queue), spawned, limits.max_queue, None)
            }
            ModelLoader::Chat(loader) => {
                let queue = Arc::new(ChatQueue::new(metrics.clone(), &name));
                let load = chat::load(name.clone(), loader, limits);
                let load: worker::Load<_, Served> = Box::new(move || {
                    load().map(|(chat, info)| (chat, Served::Chat(Arc::new(info))))
                });
                let (q, m) = (queue.clone(), metrics.clone());
                let spawned =
                    worker::spawn_with(&name, load, move |model| chat::drive(model, q, m))
                        .map_err(spawn_failed)?;
                let admitted = limits.max_queue.saturating_add(limits.max_sequences);
                (ModelQueue::Chat(queue), spawned, admitted, None)
            }
            ModelLoader::Image(loader) => {
                let queue = Arc::new(
                    Queue::generations(limits.max_image_batch, metrics.clone()).for_model(&name),
                );
                let load = images::load(name.clone(), loader, limits, metrics.clone());
                let load: worker::Load<_, Served> = Box::new(move || {
                    load().map(|(runner, info)| (runner, Served::Image(Arc::new(info))))
                });
                let spawned = worker::spawn(&name, load, queue.clone()).map_err(spawn_failed)?;
                let budget = limits.max_image_queue_mps * COST_UNITS_PER_MPS;
                (
                    ModelQueue::Image(queue),
                    spawned,
                    limits.max_queue,
                    Some(Arc::new(Semaphore::new(budget))),
                )
            }
        };
        let slot = Arc::new(ModelSlot {
            name,
            route,
            served: OnceLock::new(),
            queue,
            slots: Arc::new(Semaphore::new(admitted)),
            waiting: (route == Route::Chat).then(|| Arc::new(Semaphore::new(limits.max_queue))),
            cost,
        });
        slots.push(slot.clone());
        workers.push((slot.name.clone(), worker));
        loads.push((slot, loaded));
    }
    let app = AppState::new(config, Models(slots), metrics);
    let router = http::router(app.clone())?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, models = %app.models.listing(), "listening; loading the models");
    }

    // Each model is set as soon as it is loaded; the first failure stops the server.
    let (failed, mut failures) = tokio::sync::mpsc::unbounded_channel::<ServeError>();
    for (slot, loaded) in loads {
        let (failed, app) = (failed.clone(), app.clone());
        tokio::spawn(async move {
            let model = slot.name.clone();
            match loaded.await {
                Ok(Ok(served)) => {
                    tracing::info!(model = %model, device = %served.device(), capability = slot.route.capability(), "ready");
                    let _ = slot.served.set(served);
                    if app.models.all_loaded() {
                        tracing::info!("every model is loaded");
                    }
                }
                Ok(Err(source)) => {
                    let _ = failed.send(ServeError::Load { model, source });
                }
                Err(_) => {
                    let _ = failed.send(ServeError::Load {
                        model,
                        source: tessera_core::Error::backend(
                            "load",
                            "the device worker stopped while loading",
                        ),
                    });
                }
            }
        });
    }
    drop(failed);
    let load_error = Arc::new(Mutex::new(None));
    // Set when shutdown begins: the graceful part then has `shutdown_timeout` in all.
    let (began, mut stop_began) = tokio::sync::watch::channel(None::<tokio::time::Instant>);
    let grace = app.config.limits.shutdown_timeout;
    let signal = {
        let (app, load_error) = (app.clone(), load_error.clone());
        async move {
            tokio::select! {
                () = shutdown => {}
                Some(e) = failures.recv() => set(&load_error, e),
            }
            app.stopping.store(true, Ordering::Relaxed);
            let _ = began.send(Some(tokio::time::Instant::now() + grace));
            tracing::info!("shutting down: finishing the requests in flight");
        }
    };
    let stop_at = stop_began.clone();
    // The deadline, once shutdown has begun (never before).
    let deadline = async move {
        let at = loop {
            if let Some(at) = *stop_began.borrow_and_update() {
                break at;
            }
            if stop_began.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::time::sleep_until(at).await;
    };
    tokio::pin!(deadline);
    // Client addresses: bodies still arriving are limited per client.
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let serving = axum::serve(listener, service).with_graceful_shutdown(signal);
    // A connection that never ends (a body trickling in, a reply that streams for hours) must
    // not keep the server from stopping: past the deadline it is dropped.
    let served = tokio::select! {
        served = serving => served,
        () = &mut deadline => {
            tracing::warn!(?grace, "requests still in flight at the shutdown deadline: stopping without them");
            Ok(())
        }
    };
    // What is left of the deadline (a moment at least) for the workers to finish.
    let until = stop_at
        .borrow()
        .unwrap_or_else(|| tokio::time::Instant::now() + grace);
    for m in &app.models.0 {
        m.queue.close();
    }
    for (name, worker) in workers {
        let join = tokio::task::spawn_blocking(move || worker.join());
        // A worker still busy after the deadline (or a moment after it, when the connections
        // ended first) is left behind; the process's exit ends it.
        let limit = until
            .saturating_duration_since(tokio::time::Instant::now())
            .max(std::time::Duration::from_millis(100));
        match tokio::time::timeout(limit, join).await {
            Ok(Ok(Ok(()))) => {}
            Ok(_) => tracing::error!(model = %name, "the device worker panicked"),
            Err(_) => {
                tracing::warn!(model = %name, "the device worker is still busy: stopping without it")
            }
        }
    }
    served.map_err(|source| ServeError::Io {
        what: "serving HTTP",
        source,
    })?;
    let load_error = load_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    match load_error {
        Some(e) => Err(e),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

fn set(slot: &Mutex<Option<ServeError>>, e: ServeError) {
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
}
