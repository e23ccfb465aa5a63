//! Prometheus metrics, served as OpenMetrics text on `GET /metrics`.
//!
//! Names carry the `tessera_` prefix: requests by route, status and error code; queue depth per
//! lane; batch sizes in inputs and tokens; tokens embedded; end-to-end, queue-wait and batch
//! latencies as histograms with geometric buckets.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::queue::Lane;

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

type Histograms = Family<LaneLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    queue_depth: Family<LaneLabels, Gauge>,
    batch_inputs: Histograms,
    batch_tokens: Histograms,
    tokens: Counter,
    request_seconds: Histograms,
    queue_seconds: Histograms,
    batch_seconds: Histograms,
}

fn seconds() -> Histogram {
    // 1 ms to about 65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

fn sizes() -> Histogram {
    // 1 to 32,768.
    Histogram::new(exponential_buckets(1.0, 2.0, 16))
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
            batch_inputs: Family::new_with_constructor(sizes),
            batch_tokens: Family::new_with_constructor(sizes),
            tokens: Counter::default(),
            request_seconds: Family::new_with_constructor(seconds),
            queue_seconds: Family::new_with_constructor(seconds),
            batch_seconds: Family::new_with_constructor(seconds),
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
            "Embedding requests from arrival to answer, per lane",
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

    pub fn queue_depth(&self, lane: Lane, depth: usize) {
        self.queue_depth
            .get_or_create(&lanes(lane))
            .set(i64::try_from(depth).unwrap_or(i64::MAX));
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
