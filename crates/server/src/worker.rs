//! The device worker: one thread that loads the model, owns it, and runs the queue's batches.
//!
//! A batch is one `embed_inputs` call (which packs its inputs into passes). If a merged batch
//! fails, each request in it is run alone, so one bad input fails only its own request. A panic
//! in the model is caught and answered as a 500 for the requests it hit; the worker goes on.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use tessera_core::{Error, Result};
use tessera_models::egemma2::{AnyEmbeddingGemma2, Embedding, Input, TextOptions, matryoshka};
use tessera_models::imageproc::ImageBudget;
use tokio::sync::oneshot;

use crate::config::Limits;
use crate::metrics::Metrics;
use crate::model::ModelInfo;
use crate::queue::{Batch, Job, Queue};

/// Opens the device and loads the model, on the worker's thread.
pub type Loader = Box<dyn FnOnce() -> Result<AnyEmbeddingGemma2> + Send>;

/// Start the worker. The receiver gets the model's metadata once it is loaded (or the load
/// error); the thread ends when the queue is closed and drained.
pub fn spawn(
    name: String,
    loader: Loader,
    queue: Arc<Queue>,
    metrics: Arc<Metrics>,
    limits: &Limits,
) -> std::io::Result<(JoinHandle<()>, oneshot::Receiver<Result<ModelInfo>>)> {
    let (tx, rx) = oneshot::channel();
    let pass_tokens = limits.max_batch_tokens;
    let handle = std::thread::Builder::new()
        .name("tessera-device".into())
        .spawn(move || {
            let started = Instant::now();
            let loaded = catch_unwind(AssertUnwindSafe(loader))
                .unwrap_or_else(|p| Err(Error::backend("load", panic_message(&p))))
                .and_then(|mut model| {
                    model.set_pass_tokens(pass_tokens);
                    let info = ModelInfo::new(name, &model)?;
                    Ok((model, info))
                });
            let mut model = match loaded {
                Ok((model, info)) => {
                    tracing::info!(
                        device = %info.device,
                        seconds = started.elapsed().as_secs_f64(),
                        "model loaded"
                    );
                    let budget = info.image_budget.unwrap_or(ImageBudget::DEFAULT);
                    if tx.send(Ok(info)).is_err() {
                        return;
                    }
                    Worker {
                        model,
                        budget,
                        metrics,
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            while let Some(batch) = queue.next_batch() {
                model.run(batch);
            }
            tracing::debug!("device worker stopped");
        })?;
    Ok((handle, rx))
}

struct Worker {
    model: AnyEmbeddingGemma2,
    budget: ImageBudget,
    metrics: Arc<Metrics>,
}

impl Worker {
    fn run(&mut self, batch: Batch) {
        let started = Instant::now();
        for job in &batch.jobs {
            self.metrics
                .waited(job.lane, started.duration_since(job.enqueued).as_secs_f64());
        }
        let opts = TextOptions {
            prompt_name: batch.prompt_name.clone(),
            ..TextOptions::default()
        };
        let (inputs, tokens, lane) = (batch.inputs(), batch.tokens(), batch.lane);
        let n_jobs = batch.jobs.len();
        let mut jobs = batch.jobs;
        let counts: Vec<usize> = jobs.iter().map(|j| j.inputs.len()).collect();
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

    /// One model call, full-width vectors; a panic or a wrong count turned into an error.
    fn embed(&mut self, inputs: &[Input], opts: &TextOptions) -> Result<Vec<Embedding>> {
        let budget = self.budget;
        let embs = catch_unwind(AssertUnwindSafe(|| {
            self.model.embed_inputs(inputs, opts, budget, None, |_| {})
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

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("the model panicked: {what}")
}
