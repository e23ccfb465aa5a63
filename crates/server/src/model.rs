//! What the HTTP side knows about the loaded model ([`Served`]: an embedding model's
//! [`ModelInfo`] or a chat model's [`ChatInfo`]), so requests are checked before they are queued
//! while the device worker keeps the model itself to its thread.

use std::sync::Arc;

use tessera_core::Result;
use tessera_models::egemma2::Prompts;
use tessera_models::imageproc::{ImageBudget, ImageLimits};
use tessera_models::tokenize::TextTokenizer;
use tessera_runtime::embed::Embed;

use crate::chat::ChatInfo;
use crate::http::error::ApiError;

/// The model a server serves, which decides its routes: `/v1/embeddings` or
/// `/v1/chat/completions`.
#[derive(Clone)]
pub enum Served {
    Embed(Arc<ModelInfo>),
    Chat(Arc<ChatInfo>),
}

impl Served {
    pub fn name(&self) -> &str {
        match self {
            Served::Embed(i) => &i.name,
            Served::Chat(i) => &i.name,
        }
    }

    pub fn device(&self) -> &str {
        match self {
            Served::Embed(i) => &i.device,
            Served::Chat(i) => &i.device,
        }
    }

    /// What it does, as `/v1/models` says: `embeddings` or `chat`.
    pub fn capability(&self) -> &'static str {
        match self {
            Served::Embed(_) => "embeddings",
            Served::Chat(_) => "chat",
        }
    }

    /// Every id `/v1/models` lists.
    pub fn ids(&self) -> Vec<String> {
        match self {
            Served::Embed(i) => i.ids(),
            Served::Chat(i) => vec![i.name.clone()],
        }
    }

    /// The answer of a route for the other kind of model: a 400 that says what is served and
    /// which route serves it.
    pub fn wrong_route(&self, route: &str) -> ApiError {
        let (what, other) = match self {
            Served::Embed(_) => ("an embedding model", "/v1/embeddings"),
            Served::Chat(_) => ("a chat model", "/v1/chat/completions"),
        };
        ApiError::invalid_param(
            "model",
            format!(
                "this server serves {:?}, {what}: it answers {other}, not {route}",
                self.name()
            ),
        )
    }
}

/// The loaded model's metadata, shared read-only with request handlers.
pub struct ModelInfo {
    /// The id in `model` fields and `/v1/models`.
    pub name: String,
    /// Full embedding width (the largest `dimensions`).
    pub dim: usize,
    pub prompts: Prompts,
    /// A copy of the model's tokenizer: counts tokens at the edge (limits, batch budgets).
    pub tokenizer: TextTokenizer,
    /// What an image must satisfy at the soft-token budget of `processor_config.json`, checked
    /// from its header before decoding; `None` for text-only checkpoints.
    pub image_limits: Option<ImageLimits>,
    /// Device and precision, one line.
    pub device: String,
}

impl ModelInfo {
    pub fn new(name: String, model: &dyn Embed) -> Self {
        ModelInfo {
            name,
            dim: model.dim(),
            prompts: model.prompts().clone(),
            tokenizer: model.tokenizer().clone(),
            image_limits: model
                .default_image_budget()
                .and_then(|b| model.image_limits(b)),
            device: model.describe(),
        }
    }

    /// Soft tokens per image; `None` for text-only checkpoints.
    pub fn image_budget(&self) -> Option<ImageBudget> {
        self.image_limits.as_ref().map(|l| l.budget)
    }

    /// Split a `model` field into the served name and a prompt name: `name` or `name:prompt`.
    /// `None` (no `model` field) means the served model without a prompt.
    pub fn resolve<'a>(&self, model: Option<&'a str>) -> Result<Option<&'a str>, ApiError> {
        let Some(model) = model else { return Ok(None) };
        if model == self.name {
            return Ok(None);
        }
        match model.split_once(':') {
            Some((name, prompt)) if name == self.name => Ok(Some(prompt)),
            _ => Err(ApiError::ModelNotFound(format!(
                "the model {model:?} is not served here; this server serves {:?} (append :PROMPT for a task prompt, e.g. {:?})",
                self.name,
                self.example_prompted_name()
            ))),
        }
    }

    /// Every id `/v1/models` lists: the model, then one per prompt name.
    pub fn ids(&self) -> Vec<String> {
        std::iter::once(self.name.clone())
            .chain(self.prompts.names().map(|p| format!("{}:{p}", self.name)))
            .collect()
    }

    fn example_prompted_name(&self) -> String {
        let prompt = self.prompts.names().next().unwrap_or("query");
        format!("{}:{prompt}", self.name)
    }
}
