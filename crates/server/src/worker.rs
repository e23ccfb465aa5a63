//! The device worker: one thread that loads a model, owns it, and runs the queue's batches.
//!
//! Generic over what it runs ([`Runner`]): the runner answers each job of a batch itself, so
//! each route decides how a batch maps to model calls (one packed embedding call, retried job by
//! job when it fails). A model whose work is not batches of jobs (chat's continuous batching)
//! brings its own loop ([`spawn_with`]). A panic while loading is caught and reported as a load
//! error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use tessera_core::{Error, Result};
use tokio::sync::oneshot;

use crate::queue::{Batch, Job, Queue};

/// A loaded model and how it answers a batch of its jobs.
pub trait Runner: Send + 'static {
    type Job: Job;
    /// Run `batch` and answer every job in it (an error only for the jobs it concerns).
    fn run(&mut self, batch: Batch<Self::Job>);
}

/// Opens the device and loads the model on the worker's thread: the runner, and what the HTTP
/// side needs to know about the model.
pub type Load<R, I> = Box<dyn FnOnce() -> Result<(R, I)> + Send>;

/// Start the worker of the model served as `model`. The receiver gets the model's metadata once
/// it is loaded (or the load error); the thread ends when the queue is closed and drained.
pub fn spawn<R: Runner, I: Send + 'static>(
    model: &str,
    load: Load<R, I>,
    queue: Arc<Queue<R::Job>>,
) -> std::io::Result<(JoinHandle<()>, oneshot::Receiver<Result<I>>)> {
    spawn_with(model, load, move |mut runner: R| {
        while let Some(batch) = queue.next_batch() {
            runner.run(batch);
        }
    })
}

/// Start a worker that loads with `load`, then hands what it loaded to `drive`, which runs until
/// the server stops (a route whose work is not a queue of batches: chat's step loop).
pub fn spawn_with<R: Send + 'static, I: Send + 'static>(
    model: &str,
    load: Load<R, I>,
    drive: impl FnOnce(R) + Send + 'static,
) -> std::io::Result<(JoinHandle<()>, oneshot::Receiver<Result<I>>)> {
    let (tx, rx) = oneshot::channel();
    let model = model.to_string();
    let handle = std::thread::Builder::new()
        .name("tessera-device".into())
        .spawn(move || {
            let started = Instant::now();
            let loaded = catch_unwind(AssertUnwindSafe(load))
                .unwrap_or_else(|p| Err(Error::backend("load", panic_message(&p))));
            let runner = match loaded {
                Ok((runner, info)) => {
                    tracing::info!(
                        model = %model,
                        seconds = started.elapsed().as_secs_f64(),
                        "model loaded"
                    );
                    if tx.send(Ok(info)).is_err() {
                        return;
                    }
                    runner
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            drive(runner);
            tracing::debug!(model = %model, "device worker stopped");
        })?;
    Ok((handle, rx))
}

/// A panic payload as a message.
pub fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    format!(
        "the model panicked: {}",
        tessera_runtime::pipeline::panic_text(&**p)
    )
}
