//! `/v1/embeddings` on the device side: the queued job and how the worker runs a batch of them.
//!
//! A batch is one `embed_inputs` call (which packs its inputs into passes). If a merged batch
//! fails, each request in it is run alone, so one bad input fails only its own request. A panic
//! in the model is caught and answered as a 500 for the requests it hit; the worker goes on.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use tessera_core::{Error, Result};
use tessera_models::egemma2::{Input, Prompts, TextOptions, matryoshka};
use tessera_models::imageproc::{ImageBudget, ImageLimits};
use tessera_models::tokenize::TextTokenizer;
use tessera_runtime::embed::{Embed, Embedding, PassBudget};
use tokio::sync::oneshot;

use crate::config::Limits;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::queue::{self, Batch, Cost, Lane};
use crate::worker::{Load, Runner, panic_message};

/// The loaded embedding model's metadata, shared read-only with request handlers.
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

/// Opens the device and loads the embedding model, on the worker's thread.
pub type Loader = Box<dyn FnOnce() -> Result<Box<dyn Embed>> + Send>;

/// What the worker sends back for one job: an embedding per input, or why not.
pub type Reply = Result<Vec<Embedding>, Error>;

/// One embeddings request's work.
pub struct Job {
    pub inputs: Vec<Input>,
    /// Tokens over all inputs, as counted at the edge (the batch budget).
    pub tokens: usize,
    pub images: usize,
    /// Jobs merge only with jobs of the same prompt (one prompt per model call).
    pub prompt_name: Option<String>,
    /// Matryoshka size of this job's vectors.
    pub dim: usize,
    pub lane: Lane,
    pub enqueued: Instant,
    pub reply: oneshot::Sender<Reply>,
    /// The request's span, so the worker's logs for it carry its fields.
    pub span: tracing::Span,
}

impl queue::Job for Job {
    fn lane(&self) -> Lane {
        self.lane
    }
    fn cost(&self) -> Cost {
        Cost {
            tokens: self.tokens,
            images: self.images,
        }
    }
    fn joins(&self, head: &Self) -> bool {
        self.prompt_name == head.prompt_name
    }
    fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }
}

/// The embedding model on the worker's thread.
pub struct EmbedRunner {
    model: Box<dyn Embed>,
    budget: ImageBudget,
    metrics: Arc<Metrics>,
}

/// The worker's load step: `loader`, then the pass budget from `limits` and the model's
/// metadata for the HTTP side under the served `name`.
pub fn load(
    name: String,
    loader: Loader,
    limits: &Limits,
    metrics: Arc<Metrics>,
) -> Load<EmbedRunner, ModelInfo> {
    let tokens = limits.max_batch_tokens;
    Box::new(move || {
        let mut model = loader()?;
        let budget = model.pass_budget();
        model.set_pass_budget(PassBudget { tokens, ..budget });
        let info = ModelInfo::new(name, model.as_ref());
        let budget = info.image_budget().unwrap_or(ImageBudget::DEFAULT);
        Ok((
            EmbedRunner {
                model,
                budget,
                metrics,
            },
            info,
        ))
    })
}

impl Runner for EmbedRunner {
    type Job = Job;

    fn run(&mut self, batch: Batch<Job>) {
        let started = Instant::now();
        for job in &batch.jobs {
            self.metrics
                .waited(job.lane, started.duration_since(job.enqueued).as_secs_f64());
        }
        let opts = TextOptions {
            prompt_name: batch.jobs.first().and_then(|j| j.prompt_name.clone()),
            ..TextOptions::default()
        };
        let (lane, tokens) = (batch.lane, batch.cost().tokens);
        let mut jobs = batch.jobs;
        let n_jobs = jobs.len();
        let counts: Vec<usize> = jobs.iter().map(|j| j.inputs.len()).collect();
        let inputs: usize = counts.iter().sum();
        let all: Vec<Input> = jobs
            .iter_mut()
            .flat_map(|j| std::mem::take(&mut j.inputs))
            .collect();
        let result = self.embed(&all, &opts);
        // Recorded before anyone is answered, so a client that reads /metrics after its answer
        // sees its batch.
        self.metrics
            .batch(lane, inputs, tokens, started.elapsed().as_secs_f64());
        match result {
            Ok(mut embs) => {
                for (job, n) in jobs.into_iter().zip(counts) {
                    let rest = embs.split_off(n);
                    answer(job, Ok(std::mem::replace(&mut embs, rest)));
                }
            }
            Err(e) if n_jobs == 1 => {
                if let Some(job) = jobs.pop() {
                    answer(job, Err(e));
                }
            }
            Err(e) => {
                // Someone's input failed the merged call: run each request alone so only the
                // requests at fault get an error.
                tracing::warn!(error = %e, requests = n_jobs, "merged batch failed; running its requests one by one");
                let mut start = 0;
                for (job, n) in jobs.into_iter().zip(counts) {
                    let result = self.embed(&all[start..start + n], &opts);
                    start += n;
                    answer(job, result);
                }
            }
        }
        tracing::debug!(
            lane = lane.label(),
            requests = n_jobs,
            inputs,
            tokens,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "batch done"
        );
    }
}

impl EmbedRunner {
    /// One model call, full-width vectors; a panic or a wrong count turned into an error.
    fn embed(&mut self, inputs: &[Input], opts: &TextOptions) -> Result<Vec<Embedding>> {
        let budget = self.budget;
        let embs = catch_unwind(AssertUnwindSafe(|| {
            self.model
                .embed_inputs(inputs, opts, budget, None, &mut |_| {})
        }))
        .unwrap_or_else(|p| Err(Error::backend("embed", panic_message(&p))))?;
        if embs.len() != inputs.len() {
            return Err(Error::backend(
                "embed",
                format!("{} vectors for {} inputs", embs.len(), inputs.len()),
            ));
        }
        Ok(embs)
    }
}

/// Send a job its vectors, cut to its Matryoshka size.
fn answer(job: Job, result: Result<Vec<Embedding>>) {
    let dim = job.dim;
    let result = result.map(|embs| {
        embs.into_iter()
            .map(|e| Embedding {
                vector: matryoshka(e.vector, dim),
                tokens: e.tokens,
            })
            .collect()
    });
    if let Err(e) = &result {
        tracing::debug!(parent: &job.span, error = %e, "request failed on the device");
    }
    // The client may have gone (timeout, disconnect): nothing to answer then.
    let _ = job.reply.send(result);
}
