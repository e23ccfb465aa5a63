//! Prometheus metrics, served as OpenMetrics text on `GET /metrics`.
//!
//! Names carry the `tessera_` prefix: requests by route, status and error code; queue depth per
//! lane; batch sizes in inputs and tokens; tokens embedded; end-to-end, queue-wait and batch
//! latencies as histograms with geometric buckets. Chat adds its own lane (`chat`) to the queue
//! depth, queue-wait and request histograms, and: replies by how they ended, prompt and
//! generated tokens, replies running, time to first token, each reply's decode speed, and each
//! step's sequences and duration. Image generation adds: images generated and requests by how
//! they ended, per model; the duration of each denoising step and the images of each batch, per
//! model; its own lane (`generation`) in the queue-wait and request histograms. Queue depths are
//! kept per model and lane (`model_queue_depth`) and summed per lane (`queue_depth`).

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::config::Lane;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    status: u16,
    /// The error code, empty on success.
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneLabels {
    lane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishLabels {
    /// `stop`, `length`, `cancelled` (the client went away) or `failed`.
    finish: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLaneLabels {
    model: String,
    lane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    model: String,
    /// `done`, `cancelled` (the client went away or its time ran out) or `failed`.
    outcome: &'static str,
}

/// The lane label of chat requests.
const CHAT: LaneLabels = LaneLabels { lane: "chat" };

type Histograms = Family<LaneLabels, Histogram, fn() -> Histogram>;
type ModelHistograms = Family<ModelLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    queue_depth: Family<LaneLabels, Gauge>,
    model_queue_depth: Family<ModelLaneLabels, Gauge>,
    /// Each model's depth per lane, summed into `queue_depth`.
    depths: Mutex<HashMap<(String, &'static str), usize>>,
    images_generated: Family<ModelLabels, Counter>,
    image_requests: Family<OutcomeLabels, Counter>,
    image_step_seconds: ModelHistograms,
    image_batch_images: ModelHistograms,
    batch_inputs: Histograms,
    batch_tokens: Histograms,
    tokens: Counter,
    request_seconds: Histograms,
    queue_seconds: Histograms,
    batch_seconds: Histograms,
    chat_replies: Family<FinishLabels, Counter>,
    chat_prompt_tokens: Counter,
    chat_prefix_cache_hit_tokens: Counter,
    chat_completion_tokens: Counter,
    chat_running: Gauge,
    chat_first_token_seconds: Histogram,
    chat_decode_rate: Histogram,
    chat_step_sequences: Histogram,
    chat_step_seconds: Histogram,
}

fn seconds() -> Histogram {
    // 1 ms to about 65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

fn sizes() -> Histogram {
    // 1 to 32,768.
    Histogram::new(exponential_buckets(1.0, 2.0, 16))
}

fn rates() -> Histogram {
    // 0.25 to about 16,000 per second.
    Histogram::new(exponential_buckets(0.25, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Metrics {
            registry: Registry::with_prefix("tessera"),
            requests: Family::default(),
            queue_depth: Family::default(),
            model_queue_depth: Family::default(),
            depths: Mutex::new(HashMap::new()),
            images_generated: Family::default(),
            image_requests: Family::default(),
            image_step_seconds: Family::new_with_constructor(seconds),
            image_batch_images: Family::new_with_constructor(sizes),
            batch_inputs: Family::new_with_constructor(sizes),
            batch_tokens: Family::new_with_constructor(sizes),
            tokens: Counter::default(),
            request_seconds: Family::new_with_constructor(seconds),
            queue_seconds: Family::new_with_constructor(seconds),
            batch_seconds: Family::new_with_constructor(seconds),
            chat_replies: Family::default(),
            chat_prompt_tokens: Counter::default(),
            chat_prefix_cache_hit_tokens: Counter::default(),
            chat_completion_tokens: Counter::default(),
            chat_running: Gauge::default(),
            chat_first_token_seconds: seconds(),
            chat_decode_rate: rates(),
            chat_step_sequences: sizes(),
            chat_step_seconds: seconds(),
        };
        m.registered()
    }

    /// Register every metric under its name (the families are shared handles).
    fn registered(mut self) -> Self {
        let r = &mut self.registry;
        r.register(
            "requests",
            "HTTP requests by route, status and error code",
            self.requests.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for the device, per lane",
            self.queue_depth.clone(),
        );
        r.register(
            "model_queue_depth",
            "Requests waiting for the device, per model and lane",
            self.model_queue_depth.clone(),
        );
        r.register(
            "images_generated",
            "Images generated, per model",
            self.images_generated.clone(),
        );
        r.register(
            "image_requests",
            "Image generation requests by how they ended (done, cancelled, failed), per model",
            self.image_requests.clone(),
        );
        r.register(
            "image_step_duration_seconds",
            "Device time of one denoising step of a batch, per model",
            self.image_step_seconds.clone(),
        );
        r.register(
            "image_batch_images",
            "Images denoised together in one batch, per model",
            self.image_batch_images.clone(),
        );
        r.register(
            "batch_inputs",
            "Inputs per device batch",
            self.batch_inputs.clone(),
        );
        r.register(
            "batch_tokens",
            "Tokens per device batch (image soft tokens included)",
            self.batch_tokens.clone(),
        );
        r.register("tokens", "Tokens embedded", self.tokens.clone());
        r.register(
            "request_duration_seconds",
            "Requests from arrival to answer (a chat reply's end), per lane",
            self.request_seconds.clone(),
        );
        r.register(
            "queue_duration_seconds",
            "Time a request waited in the queue, per lane",
            self.queue_seconds.clone(),
        );
        r.register(
            "batch_duration_seconds",
            "Device time of one batch, per lane",
            self.batch_seconds.clone(),
        );
        r.register(
            "chat_replies",
            "Chat replies by how they ended: stop (end of turn or a stop string), length, cancelled (the client went away), failed",
            self.chat_replies.clone(),
        );
        r.register(
            "chat_prompt_tokens",
            "Prompt tokens of chat replies (image tokens included)",
            self.chat_prompt_tokens.clone(),
        );
        r.register(
            "chat_prefix_cache_hit_tokens",
            "Prompt tokens of chat replies that came from the prefix cache, not prefilled (the hit rate is this over tessera_chat_prompt_tokens_total)",
            self.chat_prefix_cache_hit_tokens.clone(),
        );
        r.register(
            "chat_completion_tokens",
            "Tokens generated by chat replies",
            self.chat_completion_tokens.clone(),
        );
        r.register(
            "chat_running",
            "Chat replies being generated (cache slots in use)",
            self.chat_running.clone(),
        );
        r.register(
            "chat_time_to_first_token_seconds",
            "Chat requests from arrival to the first token of the reply (its first text, or its end where no text came before)",
            self.chat_first_token_seconds.clone(),
        );
        r.register(
            "chat_decode_tokens_per_second",
            "Decode speed of each chat reply: tokens after the first over the time they took",
            self.chat_decode_rate.clone(),
        );
        r.register(
            "chat_step_sequences",
            "Sequences in one chat step (prefills joining decodes)",
            self.chat_step_sequences.clone(),
        );
        r.register(
            "chat_step_duration_seconds",
            "Device time of one chat step",
            self.chat_step_seconds.clone(),
        );
        self
    }

    pub fn request(&self, route: &str, status: u16, code: &'static str) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_string(),
                status,
                code,
            })
            .inc();
    }

    /// `model`'s queue holds `depth` requests in `lane`.
    pub fn queue_depth(&self, model: &str, lane: Lane, depth: usize) {
        self.depth(model, lane.label(), depth);
    }

    fn depth(&self, model: &str, label: &'static str, depth: usize) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.model_queue_depth
            .get_or_create(&ModelLaneLabels {
                model: model.to_string(),
                lane: label,
            })
            .set(gauge(depth));
        // Every change is one insert and a sum: a poisoned lock is still consistent.
        let mut depths = self.depths.lock().unwrap_or_else(|p| p.into_inner());
        depths.insert((model.to_string(), label), depth);
        let total: usize = depths
            .iter()
            .filter(|((_, l), _)| *l == label)
            .map(|(_, d)| d)
            .sum();
        self.queue_depth
            .get_or_create(&LaneLabels { lane: label })
            .set(gauge(total));
    }

    pub fn batch(&self, lane: Lane, inputs: usize, tokens: usize, seconds: f64) {
        let l = lanes(lane);
        self.batch_inputs.get_or_create(&l).observe(inputs as f64);
        self.batch_tokens.get_or_create(&l).observe(tokens as f64);
        self.batch_seconds.get_or_create(&l).observe(seconds);
    }

    pub fn embedded(&self, lane: Lane, tokens: usize, request_seconds: f64) {
        self.tokens.inc_by(tokens as u64);
        self.request_seconds
            .get_or_create(&lanes(lane))
            .observe(request_seconds);
    }

    pub fn waited(&self, lane: Lane, seconds: f64) {
        self.queue_seconds
            .get_or_create(&lanes(lane))
            .observe(seconds);
    }

    pub fn chat_queue_depth(&self, model: &str, depth: usize) {
        self.depth(model, CHAT.lane, depth);
    }

    pub fn chat_waited(&self, seconds: f64) {
        self.queue_seconds.get_or_create(&CHAT).observe(seconds);
    }

    pub fn chat_running(&self, running: usize) {
        self.chat_running
            .set(i64::try_from(running).unwrap_or(i64::MAX));
    }

    pub fn chat_step(&self, sequences: usize, seconds: f64) {
        self.chat_step_sequences.observe(sequences as f64);
        self.chat_step_seconds.observe(seconds);
    }

    pub fn chat_first_token(&self, seconds: f64) {
        self.chat_first_token_seconds.observe(seconds);
    }

    /// Prompt tokens of a reply that its cache slot already held (not prefilled).
    pub fn chat_cached_tokens(&self, tokens: usize) {
        self.chat_prefix_cache_hit_tokens.inc_by(tokens as u64);
    }

    /// A reply that ended (`finish`: stop, length, cancelled or failed), with its token counts,
    /// its decode speed when it had one, and its time from arrival.
    pub fn chat_reply(
        &self,
        finish: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
        decode_rate: Option<f64>,
        request_seconds: f64,
    ) {
        self.chat_replies
            .get_or_create(&FinishLabels { finish })
            .inc();
        self.chat_prompt_tokens.inc_by(prompt_tokens as u64);
        self.chat_completion_tokens.inc_by(completion_tokens as u64);
        if let Some(r) = decode_rate {
            self.chat_decode_rate.observe(r);
        }
        self.request_seconds
            .get_or_create(&CHAT)
            .observe(request_seconds);
    }

    /// A batch of `images` images began denoising.
    pub fn image_batch(&self, model: &str, images: usize) {
        self.image_batch_images
            .get_or_create(&ModelLabels {
                model: model.to_string(),
            })
            .observe(images as f64);
    }

    /// One denoising step of a batch took `seconds`.
    pub fn image_step(&self, model: &str, seconds: f64) {
        self.image_step_seconds
            .get_or_create(&ModelLabels {
                model: model.to_string(),
            })
            .observe(seconds);
    }

    /// A generation request ended (`outcome`: done, cancelled, failed) with `images` images,
    /// `seconds` after it arrived.
    pub fn image_request(&self, model: &str, outcome: &'static str, images: usize, seconds: f64) {
        self.image_requests
            .get_or_create(&OutcomeLabels {
                model: model.to_string(),
                outcome,
            })
            .inc();
        if images > 0 {
            self.images_generated
                .get_or_create(&ModelLabels {
                    model: model.to_string(),
                })
                .inc_by(images as u64);
        }
        self.request_seconds
            .get_or_create(&lanes(Lane::Generation))
            .observe(seconds);
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

fn lanes(lane: Lane) -> LaneLabels {
    LaneLabels { lane: lane.label() }
}
