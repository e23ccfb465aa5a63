//! The queue between request handlers and the device worker: two lanes, size-aware batches,
//! generic over the job ([`Job`]: its lane, its cost, which jobs may share a model call), so
//! every route queues the same way.
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

// `Lane` lives beside `Schedule`, so that the metrics can label by lane without the queue.
pub use crate::config::Lane;
use crate::config::{Limits, Schedule};
use crate::metrics::Metrics;

/// Text batches served in a row before waiting images get a turn.
pub const TEXT_TURNS: usize = 4;

/// What a job takes out of a batch's budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    pub tokens: usize,
    pub images: usize,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, c: Cost) -> Cost {
        Cost {
            tokens: self.tokens + c.tokens,
            images: self.images + c.images,
        }
    }
}

impl Cost {
    /// Whether this fits in `budget` on every count.
    fn within(self, budget: Cost) -> bool {
        self.tokens <= budget.tokens && self.images <= budget.images
    }
}

/// A request's work as the queue sees it, whatever the route: its lane, its cost, and with
/// which jobs it may share one model call.
pub trait Job: Send + 'static {
    fn lane(&self) -> Lane;
    fn cost(&self) -> Cost;
    /// Whether this job may join a batch headed by `head` (one prompt per embedding call, one
    /// size per image generation, …).
    fn joins(&self, head: &Self) -> bool;
    /// Whether its client is gone (timed out, disconnected): it gets no device time.
    fn abandoned(&self) -> bool;
    /// Called when the queue drops it as abandoned, before it ran (for the metrics).
    fn dropped(&self) {}
}

/// Jobs the worker runs as one model call.
pub struct Batch<J> {
    pub jobs: Vec<J>,
    pub lane: Lane,
}

impl<J: Job> Batch<J> {
    pub fn cost(&self) -> Cost {
        self.jobs.iter().fold(Cost::default(), |a, j| a + j.cost())
    }
}

struct Lanes<J> {
    text: VecDeque<J>,
    image: VecDeque<J>,
    /// Text batches taken in a row while images waited.
    text_streak: usize,
    closed: bool,
}

impl<J> Default for Lanes<J> {
    fn default() -> Self {
        Lanes {
            text: VecDeque::new(),
            image: VecDeque::new(),
            text_streak: 0,
            closed: false,
        }
    }
}

pub struct Queue<J> {
    lanes: Mutex<Lanes<J>>,
    ready: Condvar,
    schedule: Schedule,
    budget: Cost,
    metrics: Arc<Metrics>,
    /// The served model's name, for the depth metrics.
    model: String,
    /// The lanes whose depth is reported.
    reported: &'static [Lane],
}

/// The queue was closed: the server is stopping.
#[derive(Debug)]
pub struct Closed;

impl<J: Job> Queue<J> {
    pub fn new(schedule: Schedule, limits: &Limits, metrics: Arc<Metrics>) -> Self {
        Queue {
            lanes: Mutex::new(Lanes::default()),
            ready: Condvar::new(),
            schedule,
            budget: Cost {
                tokens: limits.max_batch_tokens,
                images: limits.max_batch_images,
            },
            metrics,
            model: String::new(),
            reported: &[Lane::Text, Lane::Image],
        }
    }

    /// The queue of image generations: one lane, batches of at most `images` images.
    pub fn generations(images: usize, metrics: Arc<Metrics>) -> Self {
        Queue {
            lanes: Mutex::new(Lanes::default()),
            ready: Condvar::new(),
            schedule: Schedule::Lanes,
            budget: Cost { tokens: 0, images },
            metrics,
            model: String::new(),
            reported: &[Lane::Generation],
        }
    }

    /// The served model's name, for the depth metrics.
    pub fn for_model(mut self, name: &str) -> Self {
        self.model = name.to_string();
        self
    }

    fn lock(&self) -> MutexGuard<'_, Lanes<J>> {
        // A panic while holding this lock cannot leave the deques half-updated (every change is
        // one push or remove), so a poisoned lock is still safe to use.
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, job: J) -> Result<(), Closed> {
        let mut lanes = self.lock();
        if lanes.closed {
            return Err(Closed);
        }
        let lane = match self.schedule {
            Schedule::Lanes => job.lane(),
            Schedule::Fifo => Lane::Text,
        };
        match lane {
            Lane::Text => lanes.text.push_back(job),
            Lane::Image | Lane::Generation => lanes.image.push_back(job),
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
    pub fn next_batch(&self) -> Option<Batch<J>> {
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
                    Lane::Image | Lane::Generation => &mut lanes.image,
                };
                let batch = take_batch(deque, self.budget);
                self.update_depth(&lanes);
                return batch;
            }
            if lanes.closed {
                return None;
            }
            lanes = self.ready.wait(lanes).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn update_depth(&self, lanes: &Lanes<J>) {
        for &lane in self.reported {
            let depth = match lane {
                Lane::Text => lanes.text.len(),
                Lane::Image | Lane::Generation => lanes.image.len(),
            };
            self.metrics.queue_depth(&self.model, lane, depth);
        }
    }
}

/// Forget jobs whose client is gone (timed out or disconnected): no device time for them.
fn drop_abandoned<J: Job>(deque: &mut VecDeque<J>) {
    deque.retain(|j| {
        let gone = j.abandoned();
        if gone {
            j.dropped();
        }
        !gone
    });
}

/// The head job and every later job that joins it and still fits the budget (a job larger than
/// the budget goes alone). Jobs left behind keep their order.
fn take_batch<J: Job>(deque: &mut VecDeque<J>, budget: Cost) -> Option<Batch<J>> {
    let head = deque.pop_front()?;
    let mut used = head.cost();
    let mut jobs = vec![head];
    let mut i = 0;
    while i < deque.len() {
        let (j, with) = (&deque[i], used + deque[i].cost());
        if j.joins(&jobs[0]) && with.within(budget) {
            used = with;
            if let Some(job) = deque.remove(i) {
                jobs.push(job);
            }
        } else {
            i += 1;
        }
    }
    let lane = if used.images > 0 {
        Lane::Image
    } else {
        Lane::Text
    };
    Some(Batch { jobs, lane })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job whose client is alive while its `Arc` has a second owner (the test's handle).
    struct T {
        lane: Lane,
        tokens: usize,
        prompt: Option<&'static str>,
        client: Arc<()>,
    }

    impl Job for T {
        fn lane(&self) -> Lane {
            self.lane
        }
        fn cost(&self) -> Cost {
            Cost {
                tokens: self.tokens,
                images: usize::from(self.lane == Lane::Image),
            }
        }
        fn joins(&self, head: &Self) -> bool {
            self.prompt == head.prompt
        }
        fn abandoned(&self) -> bool {
            Arc::strong_count(&self.client) < 2
        }
    }

    fn job(lane: Lane, tokens: usize, prompt: Option<&'static str>) -> (T, Arc<()>) {
        let client = Arc::new(());
        let job = T {
            lane,
            tokens,
            prompt,
            client: client.clone(),
        };
        (job, client)
    }

    fn queue(schedule: Schedule) -> Queue<T> {
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
        assert_eq!(
            (b.jobs.len(), b.cost().tokens, b.jobs[0].prompt),
            (2, 80, None)
        );
        let b = q.next_batch().unwrap();
        assert_eq!(b.jobs[0].prompt, Some("query"));
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
        assert_eq!(b.jobs[0].prompt, Some("query"));
        q.close();
        assert!(q.next_batch().is_none());
        assert!(q.push(job(Lane::Text, 1, None).0).is_err());
    }
}
