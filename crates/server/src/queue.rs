//! The queue between request handlers and the device worker: two lanes, size-aware batches.
//!
//! Admission is bounded before a job gets here (`--max-queue` request slots, the image memory
//! budget), so pushing never blocks and the queue never grows past what was admitted.
//!
//! With [`Schedule::Lanes`], text-only jobs and jobs with images wait in separate lanes. The
//! worker takes text first; while images wait it gives them a turn after [`TEXT_TURNS`] text
//! batches in a row, so images are not starved and a short query waits behind at most one image
//! batch (itself bounded by `--max-batch-images`). With [`Schedule::Fifo`] everything shares one
//! lane in arrival order.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tessera_core::Error;
use tessera_models::egemma2::{Embedding, Input};
use tokio::sync::oneshot;

use crate::config::{Limits, Schedule};
use crate::metrics::Metrics;

/// Text batches served in a row before waiting images get a turn.
pub const TEXT_TURNS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    Text,
    Image,
}

impl Lane {
    pub fn label(self) -> &'static str {
        match self {
            Lane::Text => "text",
            Lane::Image => "image",
        }
    }
}

/// What the worker sends back for one job: an embedding per input, or why not.
pub type Reply = Result<Vec<Embedding>, Error>;

/// One request's work.
pub struct Job {
    pub inputs: Vec<Input>,
    /// Tokens per input, as counted at the edge (the batch budget).
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

/// Jobs the worker runs as one model call.
pub struct Batch {
    pub jobs: Vec<Job>,
    pub lane: Lane,
    pub prompt_name: Option<String>,
}

impl Batch {
    pub fn tokens(&self) -> usize {
        self.jobs.iter().map(|j| j.tokens).sum()
    }
    pub fn inputs(&self) -> usize {
        self.jobs.iter().map(|j| j.inputs.len()).sum()
    }
}

#[derive(Default)]
struct Lanes {
    text: VecDeque<Job>,
    image: VecDeque<Job>,
    /// Text batches taken in a row while images waited.
    text_streak: usize,
    closed: bool,
}

pub struct Queue {
    lanes: Mutex<Lanes>,
    ready: Condvar,
    schedule: Schedule,
    max_tokens: usize,
    max_images: usize,
    metrics: Arc<Metrics>,
}

/// The queue was closed: the server is stopping.
#[derive(Debug)]
pub struct Closed;

impl Queue {
    pub fn new(schedule: Schedule, limits: &Limits, metrics: Arc<Metrics>) -> Self {
        Queue {
            lanes: Mutex::new(Lanes::default()),
            ready: Condvar::new(),
            schedule,
            max_tokens: limits.max_batch_tokens,
            max_images: limits.max_batch_images,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lanes> {
        // A panic while holding this lock cannot leave the deques half-updated (every change is
        // one push or remove), so a poisoned lock is still safe to use.
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, job: Job) -> Result<(), Closed> {
        let mut lanes = self.lock();
        if lanes.closed {
            return Err(Closed);
        }
        let lane = match self.schedule {
            Schedule::Lanes => job.lane,
            Schedule::Fifo => Lane::Text,
        };
        match lane {
            Lane::Text => lanes.text.push_back(job),
            Lane::Image => lanes.image.push_back(job),
        }
        self.update_depth(&lanes);
        drop(lanes);
        self.ready.notify_one();
        Ok(())
    }

    /// Stop taking jobs; the worker finishes what is queued, then [`next_batch`] returns `None`.
    ///
    /// [`next_batch`]: Queue::next_batch
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Wait for the next batch (blocking: the worker thread's call).
    pub fn next_batch(&self) -> Option<Batch> {
        let mut lanes = self.lock();
        loop {
            drop_abandoned(&mut lanes.text);
            drop_abandoned(&mut lanes.image);
            let images_wait = !lanes.image.is_empty();
            let pick = if !lanes.text.is_empty() && (!images_wait || lanes.text_streak < TEXT_TURNS)
            {
                Some(Lane::Text)
            } else if images_wait {
                Some(Lane::Image)
            } else {
                None
            };
            if let Some(lane) = pick {
                lanes.text_streak = match (lane, images_wait) {
                    (Lane::Text, true) => lanes.text_streak + 1,
                    _ => 0,
                };
                let deque = match lane {
                    Lane::Text => &mut lanes.text,
                    Lane::Image => &mut lanes.image,
                };
                let batch = take_batch(deque, self.max_tokens, self.max_images);
                self.update_depth(&lanes);
                return batch;
            }
            if lanes.closed {
                return None;
            }
            lanes = self.ready.wait(lanes).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn update_depth(&self, lanes: &Lanes) {
        self.metrics.queue_depth(Lane::Text, lanes.text.len());
        self.metrics.queue_depth(Lane::Image, lanes.image.len());
    }
}

/// Forget jobs whose client is gone (timed out or disconnected): no device time for them.
fn drop_abandoned(deque: &mut VecDeque<Job>) {
    deque.retain(|j| !j.reply.is_closed());
}

/// The head job and every later job with the same prompt that still fits the budget (a job
/// larger than the budget goes alone). Jobs left behind keep their order.
fn take_batch(deque: &mut VecDeque<Job>, max_tokens: usize, max_images: usize) -> Option<Batch> {
    let head = deque.pop_front()?;
    let (mut tokens, mut images) = (head.tokens, head.images);
    let prompt_name = head.prompt_name.clone();
    let mut jobs = vec![head];
    let mut i = 0;
    while i < deque.len() {
        let j = &deque[i];
        if j.prompt_name == prompt_name
            && tokens + j.tokens <= max_tokens
            && images + j.images <= max_images
        {
            tokens += j.tokens;
            images += j.images;
            if let Some(job) = deque.remove(i) {
                jobs.push(job);
            }
        } else {
            i += 1;
        }
    }
    let lane = if images > 0 { Lane::Image } else { Lane::Text };
    Some(Batch {
        jobs,
        lane,
        prompt_name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(lane: Lane, tokens: usize, prompt: Option<&str>) -> (Job, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let job = Job {
            inputs: vec![Input::text("x")],
            tokens,
            images: usize::from(lane == Lane::Image),
            prompt_name: prompt.map(str::to_string),
            dim: 4,
            lane,
            enqueued: Instant::now(),
            reply: tx,
            span: tracing::Span::none(),
        };
        (job, rx)
    }

    fn queue(schedule: Schedule) -> Queue {
        let limits = Limits {
            max_batch_tokens: 100,
            max_batch_images: 2,
            ..Limits::default()
        };
        Queue::new(schedule, &limits, Arc::new(Metrics::new()))
    }

    #[test]
    fn text_goes_first_and_images_get_a_turn() {
        let q = queue(Schedule::Lanes);
        let mut keep = Vec::new();
        let (j, r) = job(Lane::Image, 10, None);
        q.push(j).unwrap();
        keep.push(r);
        for _ in 0..(TEXT_TURNS + 2) {
            // Each text job fills the token budget, so each is its own batch.
            let (j, r) = job(Lane::Text, 100, None);
            q.push(j).unwrap();
            keep.push(r);
        }
        let lanes: Vec<Lane> = (0..TEXT_TURNS + 3)
            .map(|_| q.next_batch().unwrap().lane)
            .collect();
        let mut want = vec![Lane::Text; TEXT_TURNS];
        want.extend([Lane::Image, Lane::Text, Lane::Text]);
        assert_eq!(lanes, want);
    }

    #[test]
    fn fifo_keeps_arrival_order() {
        let q = queue(Schedule::Fifo);
        let (a, _ra) = job(Lane::Image, 10, None);
        let (b, _rb) = job(Lane::Text, 95, None);
        q.push(a).unwrap();
        q.push(b).unwrap();
        assert_eq!(q.next_batch().unwrap().lane, Lane::Image);
        assert_eq!(q.next_batch().unwrap().lane, Lane::Text);
    }

    #[test]
    fn batches_respect_budgets_and_prompts() {
        let q = queue(Schedule::Lanes);
        let mut keep = Vec::new();
        for (tokens, prompt) in [(40, None), (40, Some("query")), (40, None), (40, None)] {
            let (j, r) = job(Lane::Text, tokens, prompt);
            q.push(j).unwrap();
            keep.push(r);
        }
        let b = q.next_batch().unwrap();
        assert_eq!((b.jobs.len(), b.tokens(), b.prompt_name), (2, 80, None));
        let b = q.next_batch().unwrap();
        assert_eq!(b.prompt_name.as_deref(), Some("query"));
        assert_eq!(q.next_batch().unwrap().jobs.len(), 1);
        // Images: at most two per batch.
        for _ in 0..3 {
            let (j, r) = job(Lane::Image, 1, None);
            q.push(j).unwrap();
            keep.push(r);
        }
        assert_eq!(q.next_batch().unwrap().jobs.len(), 2);
        assert_eq!(q.next_batch().unwrap().jobs.len(), 1);
    }

    #[test]
    fn abandoned_jobs_are_skipped_and_close_ends_the_worker() {
        let q = queue(Schedule::Lanes);
        let (gone, rx) = job(Lane::Text, 1, None);
        drop(rx);
        let (live, _rx) = job(Lane::Text, 1, Some("query"));
        q.push(gone).unwrap();
        q.push(live).unwrap();
        let b = q.next_batch().unwrap();
        assert_eq!(b.prompt_name.as_deref(), Some("query"));
        q.close();
        assert!(q.next_batch().is_none());
        assert!(q.push(job(Lane::Text, 1, None).0).is_err());
    }
}
