//! The JSON shapes of the API (OpenAI's `/v1/embeddings`, `/v1/chat/completions`,
//! `/v1/images/generations` and `/v1/models`, plus Tessera's extensions: `prompt_name`; `top_k`,
//! `min_p` and `repetition_penalty`; `seed`, `num_inference_steps`, `guidance_scale` and
//! `negative_prompt`).

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
    /// What the model does here: `embeddings`, `chat` or `images` (a Tessera extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capability: Option<&'static str>,
}

/// `POST /v1/chat/completions`. Unknown fields are ignored, as OpenAI ignores them; fields kept
/// as JSON are checked by [`crate::chat_inputs`], which names the place of each problem, and
/// fields OpenAI knows that ask for what this server does not do (`n` > 1, `tools`, …) are
/// refused there rather than ignored.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation: `[{"role", "content"}]`, content a string or a list of parts.
    #[serde(default)]
    pub messages: Option<serde_json::Value>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// OpenAI's newer name for `max_tokens`; wins when both are given.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Extension: keep the `top_k` most likely tokens (0 or -1: all).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Extension: drop tokens less likely than `min_p` times the most likely one.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Extension: transformers' repetition penalty (1: off).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// An integer; negative values are taken as their two's complement.
    #[serde(default)]
    pub seed: Option<serde_json::Value>,
    /// A string or a list of strings.
    #[serde(default)]
    pub stop: Option<serde_json::Value>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    // OpenAI's fields that this server cannot honour: refused when they ask for something.
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    #[serde(default)]
    pub functions: Option<serde_json::Value>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and `"usage": null` in every other chunk).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: ChatUsage,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    /// `stop` (end of turn or a stop string) or `length`.
    pub finish_reason: &'static str,
    pub logprobs: Option<()>,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct ChatUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt's tokens: how many came from the prefix cache (a slot that
/// already held them) rather than being prefilled.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// One server-sent event of a streamed reply.
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then `null` but in the last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<ChatUsage>>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<()>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// `GET /health`.
#[derive(Debug, Serialize)]
pub struct Health {
    /// `ready` (every model loaded), `loading` or `stopping`.
    pub status: &'static str,
    /// The first model's id.
    pub model: String,
    /// The first model's device, once ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Every model.
    pub models: Vec<ModelHealth>,
}

/// One model in `GET /health`.
#[derive(Debug, Serialize)]
pub struct ModelHealth {
    pub id: String,
    /// `embeddings`, `chat` or `images`.
    pub capability: &'static str,
    /// `ready` or `loading`.
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// `POST /v1/images/generations`, OpenAI's fields and Tessera's extensions (`seed`,
/// `num_inference_steps`, `guidance_scale`, `negative_prompt`). Unknown fields are refused so a
/// typo is not silently ignored; numbers are taken as they come and range-checked by
/// [`crate::http::images`], which names the field at fault.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRequest {
    pub prompt: String,
    #[serde(default)]
    pub model: Option<String>,
    /// Images to make, 1 to 8.
    #[serde(default)]
    pub n: Option<i64>,
    /// `WIDTHxHEIGHT` or `auto` (the model's default).
    #[serde(default)]
    pub size: Option<String>,
    /// `b64_json` (the only one: images come inline).
    #[serde(default)]
    pub response_format: Option<String>,
    /// `png` (default), `jpeg` or `webp`.
    #[serde(default)]
    pub output_format: Option<String>,
    /// JPEG quality, 0–100 (default 100).
    #[serde(default)]
    pub output_compression: Option<i64>,
    /// `auto` (as the model makes it), `opaque` (over white) or `transparent` (keep alpha).
    #[serde(default)]
    pub background: Option<String>,
    /// OpenAI's; accepted for compatibility, no effect (the steps decide).
    #[serde(default)]
    pub quality: Option<String>,
    /// OpenAI's (DALL·E 3); accepted for compatibility, no effect.
    #[serde(default)]
    pub style: Option<String>,
    /// OpenAI's; accepted for compatibility, no effect.
    #[serde(default)]
    pub moderation: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// Server-sent events: each step, previews, then the images.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Previews in the stream, 0–3.
    #[serde(default)]
    pub partial_images: Option<i64>,
    /// Extension: the seed of the first image (the others `seed + 1, …`), 0 to 2⁶⁴−1. A fresh
    /// random one when absent (as diffusers without a generator), returned with each image.
    #[serde(default)]
    pub seed: Option<serde_json::Value>,
    /// Extension: denoising steps (the model's default when absent).
    #[serde(default)]
    pub num_inference_steps: Option<i64>,
    /// Extension: the guidance scale, in the model's convention.
    #[serde(default)]
    pub guidance_scale: Option<f64>,
    /// Extension: what to steer away from (used under guidance).
    #[serde(default)]
    pub negative_prompt: Option<String>,
}

/// The answer of `POST /v1/images/generations`.
#[derive(Debug, Serialize)]
pub struct ImagesResponse {
    pub created: u64,
    pub data: Vec<ImageData>,
    pub output_format: &'static str,
    /// `WIDTHxHEIGHT`.
    pub size: String,
    /// `opaque` or `transparent`.
    pub background: &'static str,
}

#[derive(Debug, Serialize)]
pub struct ImageData {
    pub b64_json: String,
    /// The seed this image was made from (extension): the request's, or the fresh one drawn when
    /// it gave none, so any image can be made again. It sits in each item rather than at the
    /// top level because the items of one request have seeds `seed, seed + 1, …`; OpenAI's
    /// clients keep unknown fields of an item (the Python SDK's models allow extra fields).
    pub seed: u64,
}

/// One server-sent event of a streamed generation (`type` says which).
#[derive(Debug, Default, Serialize)]
pub struct ImageStreamEvent {
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Steps: the step done (from 1), the step count, the step's device time and the time
    /// since the request arrived, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub elapsed_ms: Option<f64>,
    /// Previews and images.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b64_json: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_format: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub background: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quality: Option<&'static str>,
    /// Which of the request's images (extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_index: Option<usize>,
    /// Previews: the how-manieth of the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partial_image_index: Option<usize>,
    /// Images: the seed (extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}
