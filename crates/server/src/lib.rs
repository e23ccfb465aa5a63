//! `tessera serve`: an OpenAI-compatible server for one model: embeddings (EmbeddingGemma 2,
//! `/v1/embeddings`) or chat (LFM2-VL, `/v1/chat/completions`), as the loader given to [`serve`]
//! decides; the route of the other kind answers 400.
//!
//! Layers, from the socket in:
//! - [`http`]: axum routes, OpenAI-shaped errors, the API key and CORS; `POST /v1/embeddings`
//!   receives the whole body first (JSON only, within `--body-timeout`, a few bodies per client
//!   at a time), then takes a request slot (`--max-queue`, else 429), then checks the inputs and
//!   decodes and preprocesses the images off the async threads ([`inputs`]) before anything is
//!   queued;
//! - [`queue`]: text and image lanes, batches under a token and an image budget, generic over
//!   the job type;
//! - [`worker`]: one thread that loads and owns the model and runs the batches, generic over
//!   what runs them ([`worker::Runner`]);
//! - [`embeddings`]: the embeddings job and its runner, which retries a failed merged batch
//!   request by request;
//! - [`chat_inputs`] and [`chat`]: a chat request checked and its prompt built before it is
//!   queued, then the device worker's step loop with continuous batching (sequences join and
//!   leave between steps, bounded by the cache slots, `--max-sequences`);
//! - [`metrics`]: Prometheus counters and histograms.
//!
//! [`serve`] runs it all on a bound listener, so tests start it on port 0.

pub mod chat;
pub mod chat_inputs;
pub mod config;
pub mod embeddings;
pub mod http;
pub mod inputs;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod queue;
pub mod worker;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

pub use chat::{ChatLoader, ChatModel};
pub use config::{Limits, Schedule, ServerConfig};
pub use embeddings::Loader;

use chat::ChatQueue;
use http::AppState;
use metrics::Metrics;
use model::Served;
use queue::Queue;

/// The model a server loads, which decides what it serves.
pub enum ModelLoader {
    /// An embedding model: `/v1/embeddings`.
    Embed(Loader),
    /// A chat model: `/v1/chat/completions`.
    Chat(ChatLoader),
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

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] tessera_core::Error),
    #[error("loading the model: {0}")]
    Load(tessera_core::Error),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Serve on `listener` until `shutdown` completes, then finish the requests in flight and stop.
///
/// The model is loaded by `loader` on the device worker's thread while the listener already
/// answers (`/health` says `loading`, embeddings get 503). A failed load stops the server and
/// is returned.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: ServerConfig,
    loader: impl Into<ModelLoader>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    config.validate()?;
    let metrics = Arc::new(Metrics::new());
    let queue = Arc::new(Queue::new(config.schedule, &config.limits, metrics.clone()));
    let chat_queue = Arc::new(ChatQueue::new(metrics.clone()));
    let name = config.served_model_name.clone();
    let limits = &config.limits;
    let (spawned, slots) = match loader.into() {
        ModelLoader::Embed(loader) => {
            let load = embeddings::load(name, loader, limits, metrics.clone());
            let load: worker::Load<_, Served> = Box::new(move || {
                load().map(|(runner, info)| (runner, Served::Embed(Arc::new(info))))
            });
            (worker::spawn(load, queue.clone()), limits.max_queue)
        }
        ModelLoader::Chat(loader) => {
            let load = chat::load(name, loader, limits);
            let (q, m) = (chat_queue.clone(), metrics.clone());
            let spawned = worker::spawn_with(load, move |model| chat::drive(model, q, m));
            (
                spawned,
                limits.max_queue.saturating_add(limits.max_sequences),
            )
        }
    };
    let (worker, loaded) = spawned.map_err(|source| ServeError::Io {
        what: "starting the device worker",
        source,
    })?;
    let app = AppState::new(config, queue.clone(), chat_queue.clone(), slots, metrics);
    let router = http::router(app.clone())?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = %app.config.served_model_name, "listening; loading the model");
    }

    let load_error = Arc::new(Mutex::new(None));
    let signal = {
        let (app, load_error) = (app.clone(), load_error.clone());
        async move {
            tokio::pin!(shutdown);
            tokio::select! {
                () = &mut shutdown => {}
                loaded = loaded => match loaded {
                    Ok(Ok(served)) => {
                        tracing::info!(device = %served.device(), capability = served.capability(), "ready");
                        let _ = app.model.set(served);
                        shutdown.await;
                    }
                    Ok(Err(e)) => set(&load_error, e),
                    Err(_) => set(
                        &load_error,
                        tessera_core::Error::backend("load", "the device worker stopped while loading"),
                    ),
                },
            }
            app.stopping.store(true, Ordering::Relaxed);
            tracing::info!("shutting down: finishing the requests in flight");
        }
    };
    // Client addresses: bodies still arriving are limited per client.
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let served = axum::serve(listener, service)
        .with_graceful_shutdown(signal)
        .await;
    queue.close();
    chat_queue.close();
    let joined = tokio::task::spawn_blocking(move || worker.join()).await;
    if !matches!(joined, Ok(Ok(()))) {
        tracing::error!("the device worker panicked");
    }
    served.map_err(|source| ServeError::Io {
        what: "serving HTTP",
        source,
    })?;
    let load_error = load_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    match load_error {
        Some(e) => Err(ServeError::Load(e)),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

fn set(slot: &Mutex<Option<tessera_core::Error>>, e: tessera_core::Error) {
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
}
