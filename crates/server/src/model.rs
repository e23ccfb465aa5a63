//! What the HTTP side knows about the models: each served model's place ([`ModelSlot`]: its
//! name, route, queue and admission limits, and once loaded its metadata, [`Served`]), and how a
//! request's `model` field finds one ([`Models::route`]). The device workers keep the models
//! themselves to their threads; requests are checked before they are queued.

use std::sync::{Arc, OnceLock};

use tessera_core::Result;
use tokio::sync::Semaphore;

use crate::chat::{ChatInfo, ChatQueue};
use crate::embeddings::ModelInfo;
use crate::error::ApiError;
use crate::images::ImageInfo;
use crate::queue::Queue;
use crate::{embeddings, images};

/// What a model answers: one route each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Embeddings,
    Chat,
    Images,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Embeddings => "/v1/embeddings",
            Route::Chat => "/v1/chat/completions",
            Route::Images => "/v1/images/generations",
        }
    }

    /// What `/v1/models` says the model does.
    pub fn capability(self) -> &'static str {
        match self {
            Route::Embeddings => "embeddings",
            Route::Chat => "chat",
            Route::Images => "images",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Route::Embeddings => "an embedding model",
            Route::Chat => "a chat model",
            Route::Images => "an image generation model",
        }
    }
}

/// A loaded model's metadata, which decides its route.
#[derive(Clone)]
pub enum Served {
    Embed(Arc<ModelInfo>),
    Chat(Arc<ChatInfo>),
    Image(Arc<ImageInfo>),
}

impl Served {
    pub fn device(&self) -> &str {
        match self {
            Served::Embed(i) => &i.device,
            Served::Chat(i) => &i.device,
            Served::Image(i) => &i.device,
        }
    }

    /// Every id `/v1/models` lists.
    pub fn ids(&self) -> Vec<String> {
        match self {
            Served::Embed(i) => i.ids(),
            Served::Chat(i) => vec![i.name.clone()],
            Served::Image(i) => vec![i.name.clone()],
        }
    }
}

/// Where a model's requests wait for its device worker.
pub enum ModelQueue {
    Embed(Arc<Queue<embeddings::Job>>),
    Chat(Arc<ChatQueue>),
    Image(Arc<Queue<images::Job>>),
}

impl ModelQueue {
    /// Stop taking requests: the worker finishes what is queued, then stops.
    pub fn close(&self) {
        match self {
            ModelQueue::Embed(q) => q.close(),
            ModelQueue::Chat(q) => q.close(),
            ModelQueue::Image(q) => q.close(),
        }
    }
}

/// One served model as the HTTP side sees it.
pub struct ModelSlot {
    /// The id in `model` fields and `/v1/models` (for an embedding model also `id:prompt`).
    pub name: String,
    pub route: Route,
    /// Set once the worker has loaded the model.
    pub served: OnceLock<Served>,
    pub queue: ModelQueue,
    /// Requests admitted at once (taken once the body has arrived and held until the answer;
    /// 429 when all are taken): `--max-queue`, for a chat model `--max-queue` more than the
    /// `--max-sequences` it generates at once.
    pub slots: Arc<Semaphore>,
    /// Image generation: the queue's cost budget in cost units (`--max-image-queue-mps`).
    pub cost: Option<Arc<Semaphore>>,
    /// Chat: requests being prepared (template, tokens, images) or waiting for a cache slot,
    /// `--max-queue` at most (429 beyond). Preparing a prompt costs memory and CPU as waiting
    /// does, so it counts against the same budget; a request gives its place back when the
    /// worker starts its reply.
    pub waiting: Option<Arc<Semaphore>>,
}

/// Every served model, in the order given.
pub struct Models(pub Vec<Arc<ModelSlot>>);

impl Models {
    /// The model a request for `route` names in its `model` field: the one of that name (for
    /// embeddings also `name:prompt`), or without a name the first model of the route. A route
    /// no model serves, or a model of another route, is a 400 that says which models answer
    /// which route; an unknown name (when some model serves the route) a 404.
    pub fn route(&self, model: Option<&str>, route: Route) -> Result<Arc<ModelSlot>, ApiError> {
        if !self.0.iter().any(|m| m.route == route) {
            // Whatever the name, the route is the problem: say what this server answers.
            return Err(ApiError::invalid_param(
                "model",
                format!(
                    "this server has no model for {}; it serves {}",
                    route.path(),
                    self.listing()
                ),
            ));
        }
        let slot = match model {
            None => self.0.iter().find(|m| m.route == route),
            Some(name) => {
                let base = match route {
                    Route::Embeddings => name.split_once(':').map_or(name, |(n, _)| n),
                    Route::Chat | Route::Images => name,
                };
                let found = self.0.iter().find(|m| m.name == name || m.name == base);
                if found.is_none() {
                    return Err(ApiError::ModelNotFound(format!(
                        "the model {name:?} is not served here; this server serves {}",
                        self.listing()
                    )));
                }
                found
            }
        };
        match slot {
            Some(s) if s.route == route => Ok(s.clone()),
            Some(s) => Err(ApiError::invalid_param(
                "model",
                format!(
                    "{:?} is {}: it answers {}, not {}. This server serves {}",
                    s.name,
                    s.route.kind(),
                    s.route.path(),
                    route.path(),
                    self.listing()
                ),
            )),
            None => Err(ApiError::invalid_param(
                "model",
                format!(
                    "this server has no model for {}; it serves {}",
                    route.path(),
                    self.listing()
                ),
            )),
        }
    }

    /// `"a", an embedding model (/v1/embeddings); "b", an image generation model
    /// (/v1/images/generations)`.
    pub fn listing(&self) -> String {
        self.0
            .iter()
            .map(|m| format!("{:?}, {} ({})", m.name, m.route.kind(), m.route.path()))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Whether every model is loaded.
    pub fn all_loaded(&self) -> bool {
        self.0.iter().all(|m| m.served.get().is_some())
    }

    pub fn first(&self) -> Option<&Arc<ModelSlot>> {
        self.0.first()
    }
}
