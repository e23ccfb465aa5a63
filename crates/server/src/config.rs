//! What the server is told at start: names, limits, security switches and the scheduling policy.

use std::time::Duration;

use tessera_core::{Error, Result};

/// Everything `tessera serve` decides at start but the models; checked once by
/// [`ServerConfig::validate`].
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Bearer token required on every route but `/health`; `None` leaves the API open.
    pub api_key: Option<String>,
    /// Origins allowed by CORS (`*` for any); empty means no CORS headers.
    pub allow_origins: Vec<String>,
    /// Accept local file paths as image inputs (lets any client read files the server can read).
    pub allow_file_paths: bool,
    /// Serve `/metrics` without the API key (Prometheus scrapers carry no token).
    pub metrics_public: bool,
    pub limits: Limits,
    pub schedule: Schedule,
}

/// Bounds that keep the server's memory and latency finite.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request body accepted, in bytes (413 above it).
    pub max_request_bytes: usize,
    /// Most embeddings (top-level inputs) and most images in one request (413 above it).
    pub max_inputs: usize,
    /// Most tokens in one input, counted before queueing (400 above it; nothing is truncated).
    pub max_input_tokens: usize,
    /// Requests admitted at once, from the arrival of the body to the answer (429 beyond it);
    /// also the most bodies arriving at once.
    pub max_queue: usize,
    /// Time a request's body has to arrive once its headers have (408 beyond it).
    pub body_timeout: Duration,
    /// Requests from one client address whose bodies are still arriving (429 beyond it): a
    /// client that opens connections and goes quiet holds only its own share.
    pub max_uploads_per_client: usize,
    /// Decoded image memory held by admitted requests, in MiB (429 beyond it; 413 for one
    /// request that could never fit).
    pub max_image_memory_mb: usize,
    /// Text tokens (image soft tokens included) merged into one batch for the device.
    pub max_batch_tokens: usize,
    /// Images merged into one batch: bounds how long a short query can wait behind images.
    pub max_batch_images: usize,
    /// Time from the request's arrival to its answer before giving up with 504 (for a streamed
    /// chat reply: to its first text).
    pub request_timeout: Duration,
    /// Chat: replies generated at once (the model's cache slots); `max_queue` more may wait.
    pub max_sequences: usize,
    /// Chat: the most tokens of one conversation (prompt and reply); capped at the model's
    /// limit.
    pub context: usize,
    /// Images: the most pixels of one image, width × height (400 above it).
    pub max_image_pixels: usize,
    /// Images: the most denoising steps a request may ask for (400 above it).
    pub max_image_steps: usize,
    /// Images: what the requests admitted at once may cost together, in megapixel-steps
    /// (width × height × steps × n / 2²⁰; 429 beyond it, 413 for one request that could never
    /// fit). Bounds the queue by the work it holds rather than by its length.
    pub max_image_queue_mps: usize,
    /// Images: the most images put through the denoiser together (a batch of requests of one
    /// size and step count; a request of more images than this runs alone).
    pub max_image_batch: usize,
    /// Images: whether requests of one size and step count that wait together share denoiser
    /// forwards (off: one request at a time, for comparison).
    pub batch_images: bool,
    /// Images: time from a request's arrival to its last image before it fails with 504 and
    /// its generation stops at the next step.
    pub image_timeout: Duration,
    /// Time from a shutdown signal to the process's end: requests in flight get this long to
    /// finish, then the server stops whatever its connections and workers are doing.
    pub shutdown_timeout: Duration,
}

/// Cost units of the image queue per megapixel-step: a unit is 2¹⁶ pixel-steps, so that small
/// requests still count.
pub const COST_UNITS_PER_MPS: usize = 16;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_bytes: 32 << 20,
            max_inputs: 256,
            max_input_tokens: 8192,
            max_queue: 64,
            body_timeout: Duration::from_secs(10),
            max_uploads_per_client: 8,
            max_image_memory_mb: 2048,
            max_batch_tokens: 8192,
            max_batch_images: 8,
            request_timeout: Duration::from_secs(60),
            max_sequences: 8,
            context: 8192,
            max_image_pixels: 2 << 20,
            max_image_steps: 100,
            max_image_queue_mps: 512,
            max_image_batch: 8,
            batch_images: true,
            image_timeout: Duration::from_secs(600),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// How the device worker picks the next batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Text-only requests and requests with images wait in separate lanes; the worker serves
    /// text first and gives images a turn after a few text batches, so a short query waits
    /// behind at most one image batch.
    #[default]
    Lanes,
    /// One lane in arrival order (the baseline the load test compares against).
    Fifo,
}

/// Where a job waits in its model's queue (and the label of its queue and batch metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Embeddings of text only.
    Text,
    /// Embeddings with images.
    Image,
    /// Image generations (a queue of their own, one lane).
    Generation,
}

impl Lane {
    pub fn label(self) -> &'static str {
        match self {
            Lane::Text => "text",
            Lane::Image => "image",
            Lane::Generation => "generation",
        }
    }
}

impl ServerConfig {
    /// Refuse limits that contradict each other, before anything starts.
    pub fn validate(&self) -> Result<()> {
        let l = &self.limits;
        let positive = [
            ("--max-request-mb", l.max_request_bytes),
            ("--max-inputs", l.max_inputs),
            ("--max-queue", l.max_queue),
            ("--max-uploads-per-client", l.max_uploads_per_client),
            ("--max-image-memory-mb", l.max_image_memory_mb),
            ("--max-batch-images", l.max_batch_images),
            ("--max-sequences", l.max_sequences),
            ("--max-image-pixels", l.max_image_pixels),
            ("--max-image-steps", l.max_image_steps),
            ("--max-image-queue-mps", l.max_image_queue_mps),
            ("--max-image-batch", l.max_image_batch),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(Error::input(format!("{flag} must be at least 1")));
        }
        if l.max_input_tokens < 2 {
            return Err(Error::input(
                "--max-input-tokens must be at least 2 (<bos> and <eos>)",
            ));
        }
        if l.max_batch_tokens < l.max_input_tokens {
            return Err(Error::input(format!(
                "--max-batch-tokens {} is smaller than --max-input-tokens {}: an input that is accepted must fit in a batch",
                l.max_batch_tokens, l.max_input_tokens
            )));
        }
        if l.context < 2 {
            return Err(Error::input(
                "--context must be at least 2 tokens (a prompt and a reply)",
            ));
        }
        if l.request_timeout.is_zero() {
            return Err(Error::input("--request-timeout must be at least 1 second"));
        }
        if l.body_timeout.is_zero() {
            return Err(Error::input("--body-timeout must be at least 1 second"));
        }
        if l.image_timeout.is_zero() {
            return Err(Error::input("--image-timeout must be at least 1 second"));
        }
        if l.max_image_queue_mps > usize::MAX / 16 / COST_UNITS_PER_MPS {
            return Err(Error::input(format!(
                "--max-image-queue-mps {} is too large",
                l.max_image_queue_mps
            )));
        }
        if self.api_key.as_deref() == Some("") {
            return Err(Error::input("--api-key must not be empty"));
        }
        Ok(())
    }
}

/// Refuse a served name clients could not use: empty, with ':' (the prompt separator of
/// embedding models), or given twice.
pub fn check_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if name.is_empty() || name.contains(':') || name.chars().any(char::is_whitespace) {
            return Err(Error::input(format!(
                "the served model name {name:?} must be non-empty, without ':' (the prompt separator) and without spaces"
            )));
        }
        if !seen.insert(name) {
            return Err(Error::input(format!(
                "two models are served as {name:?}: give each --model its own name (--model PATH=NAME)"
            )));
        }
    }
    if seen.is_empty() {
        return Err(Error::input("the server needs at least one model"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ServerConfig {
        ServerConfig {
            api_key: None,
            allow_origins: vec![],
            allow_file_paths: false,
            metrics_public: false,
            limits: Limits::default(),
            schedule: Schedule::Lanes,
        }
    }

    #[test]
    fn inconsistent_limits_are_refused() {
        assert!(config().validate().is_ok());
        let mut c = config();
        c.limits.max_queue = 0;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--max-queue")
        );
        let mut c = config();
        c.limits.max_batch_tokens = 100;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--max-batch-tokens 100"), "{e}");
        let mut c = config();
        c.limits.max_image_pixels = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--max-image-pixels"), "{e}");
    }

    #[test]
    fn served_names_must_be_usable_and_distinct() {
        assert!(check_names(["a", "b-2"]).is_ok());
        for bad in [vec!["a:b"], vec![""], vec!["a b"], vec![]] {
            assert!(check_names(bad.clone()).is_err(), "{bad:?}");
        }
        let e = check_names(["m", "m"]).unwrap_err().to_string();
        assert!(e.contains("two models are served as \"m\""), "{e}");
    }
}
