//! The JSON shapes of the API (OpenAI's `/v1/embeddings` and `/v1/models`, plus `prompt_name`).

use serde::{Deserialize, Serialize};

/// `POST /v1/embeddings`. Unknown fields are refused so a typo is not silently ignored; OpenAI's
/// `user` is accepted and unused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    /// A string, an array of strings, parts or arrays of parts (see [`crate::inputs`]); kept as
    /// JSON here so each problem is reported with its position.
    pub input: serde_json::Value,
    /// The served model's id, optionally with `:PROMPT_NAME`.
    #[serde(default)]
    pub model: Option<String>,
    /// Matryoshka size: the first `dimensions` coordinates, L2-normalised again.
    #[serde(default)]
    pub dimensions: Option<usize>,
    #[serde(default)]
    pub encoding_format: EncodingFormat,
    /// A task prompt from the model's `config_sentence_transformers.json`.
    #[serde(default)]
    pub prompt_name: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// A JSON array of numbers.
    #[default]
    Float,
    /// The little-endian float32 bytes in base64 (what the openai SDK asks for by default).
    Base64,
}

/// One part of a multimodal input, as in OpenAI's content arrays.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentPart {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageUrl {
    /// A `data:` URL, bare base64, or (with `--allow-file-paths`) a `file://` URL or path.
    pub url: String,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingResponse {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: Usage,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingValue,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum EmbeddingValue {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    pub owned_by: &'static str,
}

/// `GET /health`.
#[derive(Debug, Serialize)]
pub struct Health {
    /// `ready` or `loading`.
    pub status: &'static str,
    pub model: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}
