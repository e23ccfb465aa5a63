//! `/v1/chat/completions` on the device side: the loaded chat model, the queue where admitted
//! requests wait for a cache slot, and the step loop of the device worker.
//!
//! **Admission.** A request's prompt is built before it is queued — template, tokens, image
//! tiles ([`crate::chat_inputs`], off the async threads) — so the device's thread only runs the
//! model, and a bad request is a 400 before it waits for anything. Requests then wait in the
//! [`ChatQueue`] in arrival order; the HTTP side bounds them (`--max-queue` waiting beyond the
//! `--max-sequences` being generated; 429 past that), so the queue never grows unbounded.
//!
//! **The step loop** ([`drive`]): one device thread owns the `Box<dyn Chat>` and loops:
//! 1. sequences whose client is gone (disconnected, timed out) are cancelled, freeing their slots;
//! 2. waiting requests are taken, as many as there are free cache slots — without blocking while
//!    sequences run, blocking while none does — and begun (their prefill joins the next step);
//! 3. one step runs every sequence at once (continuous batching: new prompts' prefills beside
//!    one token of each decoding sequence);
//! 4. each sequence's events go to its request's channel; a send that fails (the client went
//!    away) stops that sequence.
//!
//! Each HTTP request is its own conversation: once its reply ends, its conversation is ended
//! and its cache slot is free for the next request, which continues what the slot holds when
//! its prompt starts with it (the scheduler's prefix cache: a client re-sending a growing
//! conversation prefills only the new turn). A panic in the model fails the sequences of
//! that step (500) and the worker goes on.

use std::collections::{HashMap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tessera_core::{Error, Result};
use tessera_models::chat_family::{CacheShape, ChatPrompt, ChatPrompter};
use tessera_runtime::chat::{Chat, ChatEvent, ChatReply, ConversationId, GenerationParams};
use tessera_runtime::decode::{Control, Finish, SamplingParams};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::UnboundedSender;

use crate::config::Limits;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::queue::Closed;
use crate::worker::{Load, panic_message};

/// Opens the device and loads a chat model (any family: the front end builds this, as a rule
/// around `tessera_runtime::chat::load`) with a cache of the given shape, on the worker's
/// thread.
pub type ChatLoader = Box<dyn FnOnce(CacheShape) -> Result<Box<dyn Chat>> + Send>;

/// What the HTTP side knows about the loaded chat model.
pub struct ChatInfo {
    /// The id in `model` fields and `/v1/models`.
    pub name: String,
    /// Builds prompts (template, tokens, media) exactly as the model's own does.
    pub prompter: Arc<dyn ChatPrompter>,
    /// The most tokens of one conversation (prompt and reply).
    pub context: usize,
    /// Replies generated at once.
    pub slots: usize,
    /// The checkpoint's sampling (`generation_config.json`), for fields a request leaves out.
    pub sampling: SamplingParams,
    /// Device and precision, one line.
    pub device: String,
}

/// What the worker tells a request, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(ChatReply),
    Failed(ApiError),
}

/// One chat request's work.
pub struct Job {
    pub prompt: ChatPrompt,
    pub params: GenerationParams,
    pub events: UnboundedSender<Event>,
    /// When the request arrived (time to first token) and when it was queued.
    pub arrived: Instant,
    pub enqueued: Instant,
    /// The request's span, so the worker's logs for it carry its fields.
    pub span: tracing::Span,
    /// Its place in the queue's budget (`--max-queue`), given back when its reply begins.
    pub waiting: Option<OwnedSemaphorePermit>,
}

/// Requests admitted and waiting for a cache slot, in arrival order.
pub struct ChatQueue {
    waiting: Mutex<Waiting>,
    ready: Condvar,
    metrics: Arc<Metrics>,
    /// The served model's name, for the depth metrics.
    model: String,
}

#[derive(Default)]
struct Waiting {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl ChatQueue {
    pub fn new(metrics: Arc<Metrics>, model: &str) -> Self {
        ChatQueue {
            waiting: Mutex::new(Waiting::default()),
            ready: Condvar::new(),
            metrics,
            model: model.to_string(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        // Every change under this lock is one push, drain or flag: a poisoned lock is consistent.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, job: Job) -> Result<(), Closed> {
        let mut w = self.lock();
        if w.closed {
            return Err(Closed);
        }
        w.jobs.push_back(job);
        self.metrics.chat_queue_depth(&self.model, w.jobs.len());
        drop(w);
        self.ready.notify_one();
        Ok(())
    }

    /// Stop taking requests; the worker finishes what waits and runs, then stops.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Up to `max` waiting requests whose clients are still there, oldest first. With `wait`,
    /// blocks until one arrives, and gives `None` once the queue is closed and empty; without,
    /// gives what there is at once (possibly nothing).
    pub fn take(&self, max: usize, wait: bool) -> Option<Vec<Job>> {
        let mut w = self.lock();
        loop {
            // Clients gone while waiting (timed out, disconnected) get no device time.
            w.jobs.retain(|j| !j.events.is_closed());
            if !wait || !w.jobs.is_empty() {
                let n = max.min(w.jobs.len());
                let jobs: Vec<Job> = w.jobs.drain(..n).collect();
                self.metrics.chat_queue_depth(&self.model, w.jobs.len());
                return Some(jobs);
            }
            if w.closed {
                self.metrics.chat_queue_depth(&self.model, 0);
                return None;
            }
            w = self.ready.wait(w).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The worker's load step: `loader` with the cache shape of `limits`, then what the HTTP side
/// needs under the served `name`.
pub fn load(name: String, loader: ChatLoader, limits: &Limits) -> Load<Box<dyn Chat>, ChatInfo> {
    let cache = CacheShape {
        slots: limits.max_sequences,
        ctx: limits.context,
    };
    Box::new(move || {
        let chat = loader(cache)?;
        let info = ChatInfo {
            name,
            prompter: chat.prompter(),
            context: chat.context_len(),
            slots: chat.slots(),
            sampling: chat.default_sampling(),
            device: chat.describe(),
        };
        Ok((chat, info))
    })
}

/// A running sequence's request.
struct Seq {
    events: UnboundedSender<Event>,
    arrived: Instant,
    /// When its first text was sent (the time to the first token, unless its end comes first).
    first: Option<Instant>,
    prompt_tokens: usize,
    span: tracing::Span,
}

/// The step loop (see the module's documentation); returns once the queue is closed and every
/// request has been answered.
pub fn drive(mut chat: Box<dyn Chat>, queue: Arc<ChatQueue>, metrics: Arc<Metrics>) {
    let slots = chat.slots();
    let mut running: HashMap<ConversationId, Seq> = HashMap::new();
    let mut next: ConversationId = 0;
    loop {
        running.retain(|&conv, s| {
            let gone = s.events.is_closed();
            if gone {
                tracing::debug!(parent: &s.span, "client gone: reply cancelled");
                chat.cancel(conv);
                let secs = s.arrived.elapsed().as_secs_f64();
                metrics.chat_reply("cancelled", s.prompt_tokens, 0, None, secs);
            }
            !gone
        });
        // Before waiting for work: with nothing left running the wait may be long, and the
        // gauge must not keep counting the replies just cancelled.
        metrics.chat_running(running.len());
        let free = slots.saturating_sub(running.len());
        let Some(jobs) = queue.take(free, running.is_empty()) else {
            break;
        };
        for job in jobs {
            let Job {
                prompt,
                params,
                events,
                arrived,
                enqueued,
                span,
                waiting,
            } = job;
            drop(waiting);
            metrics.chat_waited(enqueued.elapsed().as_secs_f64());
            next += 1;
            let conv = next;
            let prompt_tokens = prompt.ids.len();
            let begun = catch_unwind(AssertUnwindSafe(|| chat.begin(conv, prompt, &params)))
                .unwrap_or_else(|p| Err(Error::backend("chat", panic_message(&p))));
            match begun {
                Ok(()) => {
                    let seq = Seq {
                        events,
                        arrived,
                        first: None,
                        prompt_tokens,
                        span,
                    };
                    running.insert(conv, seq);
                }
                Err(e) => {
                    tracing::debug!(parent: &span, error = %e, "the reply could not begin");
                    let secs = arrived.elapsed().as_secs_f64();
                    metrics.chat_reply("failed", prompt_tokens, 0, None, secs);
                    let _ = events.send(Event::Failed(api_error(&e)));
                }
            }
        }
        metrics.chat_running(running.len());
        if running.is_empty() {
            continue;
        }
        let sequences = running.len();
        let started = Instant::now();
        let mut ended = Vec::new();
        let mut finals = Vec::new();
        let stepped = catch_unwind(AssertUnwindSafe(|| {
            chat.step(&mut |conv, ev| {
                route(&mut running, &mut ended, &mut finals, &metrics, conv, ev)
            })
        }));
        metrics.chat_step(sequences, started.elapsed().as_secs_f64());
        match stepped {
            Ok(Ok(_)) => {}
            // Every sequence of the step has been told through its events.
            Ok(Err(e)) => tracing::error!(error = %e, sequences, "a chat step failed"),
            Err(p) => {
                let message = panic_message(&p);
                tracing::error!(sequences, "{message}");
                for (conv, s) in running.drain() {
                    chat.cancel(conv);
                    let secs = s.arrived.elapsed().as_secs_f64();
                    metrics.chat_reply("failed", s.prompt_tokens, 0, None, secs);
                    let _ = s
                        .events
                        .send(Event::Failed(ApiError::Internal(message.clone())));
                }
            }
        }
        // Each request is its own conversation: its cache is not needed after its reply.
        for conv in ended {
            chat.end(conv);
        }
        metrics.chat_running(running.len());
        // The step's ends go out once every metric of the step is recorded, so that a client
        // reading `/metrics` after its answer sees its reply, the step and the running count.
        for (events, event) in finals {
            let _ = events.send(event);
        }
    }
    metrics.chat_running(0);
}

/// One step's event for `conv`: into the metrics, and text to its request at once; a reply's
/// end goes into `finals`, sent after the step (see [`drive`]).
fn route(
    running: &mut HashMap<ConversationId, Seq>,
    ended: &mut Vec<ConversationId>,
    finals: &mut Vec<(UnboundedSender<Event>, Event)>,
    metrics: &Metrics,
    conv: ConversationId,
    ev: ChatEvent<'_>,
) -> Control {
    match ev {
        ChatEvent::Text(text) => {
            let Some(s) = running.get_mut(&conv) else {
                return Control::Stop;
            };
            if s.first.is_none() {
                s.first = Some(Instant::now());
                metrics.chat_first_token(s.arrived.elapsed().as_secs_f64());
            }
            match s.events.send(Event::Text(text.to_string())) {
                Ok(()) => Control::Continue,
                // The client went away: stop generating for it.
                Err(_) => Control::Stop,
            }
        }
        ChatEvent::Done(reply) => {
            ended.push(conv);
            let Some(s) = running.remove(&conv) else {
                return Control::Continue;
            };
            // A reply whose tokens made no text before its end (one token that is part of a
            // character, or an end token first) had its first token in this step.
            if s.first.is_none() {
                metrics.chat_first_token(s.arrived.elapsed().as_secs_f64());
            }
            let rate = s.first.filter(|_| reply.completion_tokens > 1).map(|f| {
                (reply.completion_tokens - 1) as f64 / f.elapsed().as_secs_f64().max(1e-9)
            });
            let finish = if s.events.is_closed() {
                "cancelled"
            } else {
                finish_reason(reply.finish)
            };
            metrics.chat_cached_tokens(reply.cached_tokens);
            metrics.chat_reply(
                finish,
                reply.prompt_tokens,
                reply.completion_tokens,
                rate,
                s.arrived.elapsed().as_secs_f64(),
            );
            finals.push((s.events, Event::Done(reply)));
            Control::Continue
        }
        ChatEvent::Failed(e) => {
            ended.push(conv);
            if let Some(s) = running.remove(&conv) {
                tracing::debug!(parent: &s.span, error = %e, "the reply failed on the device");
                let secs = s.arrived.elapsed().as_secs_f64();
                metrics.chat_reply("failed", s.prompt_tokens, 0, None, secs);
                finals.push((s.events, Event::Failed(api_error(e))));
            }
            Control::Continue
        }
    }
}

/// OpenAI's `finish_reason`: `stop` for an end of turn or a stop string, `length` for the token
/// limit or a full context.
pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        Finish::Eos | Finish::Stopped => "stop",
    }
}

/// A model error as the client sees it: its own fault (400), too large for the device (413), or
/// ours (500).
fn api_error(e: &Error) -> ApiError {
    match e {
        Error::Input(m) => ApiError::invalid(m.clone()),
        Error::OutOfMemory(_) => ApiError::InputTooLarge(e.to_string()),
        _ => ApiError::Internal(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::unbounded_channel;

    fn job(prompt_len: usize) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = unbounded_channel();
        let job = Job {
            prompt: ChatPrompt {
                ids: vec![1; prompt_len],
                ..ChatPrompt::default()
            },
            params: GenerationParams {
                sampling: SamplingParams::default(),
                max_tokens: 1,
                stop: Vec::new(),
            },
            events: tx,
            arrived: Instant::now(),
            enqueued: Instant::now(),
            span: tracing::Span::none(),
            waiting: None,
        };
        (job, rx)
    }

    #[test]
    fn the_queue_gives_at_most_the_free_slots_in_order_and_skips_the_gone() {
        let q = ChatQueue::new(Arc::new(Metrics::new()), "m");
        let (a, _ra) = job(1);
        let (gone, rg) = job(2);
        let (b, _rb) = job(3);
        let (c, _rc) = job(4);
        for j in [a, gone, b, c] {
            q.push(j).unwrap();
        }
        drop(rg);
        let lens = |jobs: Vec<Job>| jobs.iter().map(|j| j.prompt.ids.len()).collect::<Vec<_>>();
        assert_eq!(lens(q.take(0, false).unwrap()), Vec::<usize>::new());
        assert_eq!(lens(q.take(2, false).unwrap()), vec![1, 3]);
        assert_eq!(lens(q.take(8, true).unwrap()), vec![4]);
        assert_eq!(lens(q.take(8, false).unwrap()), Vec::<usize>::new());
        q.close();
        assert!(q.take(8, true).is_none());
        assert!(q.push(job(1).0).is_err());
    }

    /// A reply that ends before any of its text (one token, part of a character) still counts
    /// its time to the first token, once; one that sent text counts it at that text alone.
    #[test]
    fn a_reply_without_text_counts_its_first_token_at_its_end() {
        let metrics = Metrics::new();
        let count = |m: &Metrics| {
            let text = m.encode().unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix("tessera_chat_time_to_first_token_seconds_count "))
                .map(|v| v.trim().to_string())
        };
        let reply = || ChatReply {
            text: String::new(),
            tokens: vec![7],
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: 1,
            finish: Finish::Length,
        };
        let mut running = HashMap::new();
        let (mut ended, mut finals) = (Vec::new(), Vec::new());
        let (tx, _rx) = unbounded_channel();
        let seq = |events| Seq {
            events,
            arrived: Instant::now(),
            first: None,
            prompt_tokens: 3,
            span: tracing::Span::none(),
        };
        for (conv, events) in [
            (1, vec![ChatEvent::Done(reply())]),
            (2, vec![ChatEvent::Text("a"), ChatEvent::Done(reply())]),
        ] {
            running.insert(conv, seq(tx.clone()));
            for ev in events {
                route(&mut running, &mut ended, &mut finals, &metrics, conv, ev);
            }
            assert_eq!(count(&metrics), Some(conv.to_string()), "reply {conv}");
        }
    }

    /// A model whose replies never produce text nor end: only the client's going away ends them.
    struct Silent {
        running: Vec<ConversationId>,
    }

    impl Chat for Silent {
        fn describe(&self) -> String {
            "silent".into()
        }
        fn default_sampling(&self) -> SamplingParams {
            SamplingParams::default()
        }
        fn context_len(&self) -> usize {
            64
        }
        fn slots(&self) -> usize {
            2
        }
        fn conversations(&self) -> usize {
            self.running.len()
        }
        fn prompter(&self) -> Arc<dyn ChatPrompter> {
            unreachable!("the step loop builds no prompts")
        }
        fn begin(
            &mut self,
            conv: ConversationId,
            _: ChatPrompt,
            _: &GenerationParams,
        ) -> Result<()> {
            self.running.push(conv);
            Ok(())
        }
        fn step(
            &mut self,
            _: &mut dyn FnMut(ConversationId, ChatEvent<'_>) -> Control,
        ) -> Result<usize> {
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(self.running.len())
        }
        fn cancel(&mut self, conv: ConversationId) {
            self.running.retain(|&c| c != conv);
        }
        fn end(&mut self, conv: ConversationId) {
            self.cancel(conv);
        }
        fn encode_media(&mut self, _: &ChatPrompt) -> Result<()> {
            unreachable!("the step loop encodes no media alone")
        }
    }

    fn running_gauge(metrics: &Metrics) -> String {
        let text = metrics.encode().unwrap();
        text.lines()
            .find(|l| l.starts_with("tessera_chat_running "))
            .unwrap_or("none")
            .to_string()
    }

    /// Before: a reply cancelled when its client went away left `tessera_chat_running` at 1
    /// until the next request arrived (64 cut streams left it at 6 for as long as the server
    /// stayed idle).
    #[test]
    fn the_running_gauge_drops_when_a_cancelled_reply_leaves() {
        let metrics = Arc::new(Metrics::new());
        let queue = Arc::new(ChatQueue::new(metrics.clone(), "m"));
        let worker = {
            let (q, m) = (queue.clone(), metrics.clone());
            std::thread::spawn(move || {
                drive(
                    Box::new(Silent {
                        running: Vec::new(),
                    }),
                    q,
                    m,
                )
            })
        };
        let wait_for = |want: &str| {
            let started = Instant::now();
            while running_gauge(&metrics) != want {
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(5),
                    "{} after 5 s, expected {want}",
                    running_gauge(&metrics)
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let (j, events) = job(3);
        queue.push(j).unwrap();
        wait_for("tessera_chat_running 1");
        drop(events);
        wait_for("tessera_chat_running 0");
        queue.close();
        worker.join().unwrap();
    }

    #[test]
    fn finish_reasons() {
        assert_eq!(finish_reason(Finish::Eos), "stop");
        assert_eq!(finish_reason(Finish::Stopped), "stop");
        assert_eq!(finish_reason(Finish::Length), "length");
    }
}
