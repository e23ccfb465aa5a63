//! Chat models as front ends use them: LFM2-VL on whichever device was opened, behind one trait
//! object ([`Chat`]): messages with images in, streamed text out.
//!
//! **Continuous batching.** Replies run as *sequences*: [`Chat::begin`] admits one (its prompt
//! is prefilled at the next step), and each [`Chat::step`] runs one forward for every running
//! sequence together — new prompts' prefills and one token for each decoding sequence — then
//! samples each one's next token. Sequences join and leave between steps; the cache holds
//! [`Chat::slots`] of them at once. [`Chat::reply`] is one sequence stepped to its end.
//!
//! **Conversations.** Each sequence belongs to a conversation whose cache outlives it. A
//! follow-up turn re-renders the whole conversation with the model's chat template; when the
//! tokens the conversation's cache holds are a prefix of the new prompt (and end between images),
//! only the rest is prefilled; otherwise (a stop string cut the last reply, the caller edited
//! the history) the cache is dropped and the prompt prefilled whole. Either way the reply is the
//! one a fresh conversation gets.

use std::collections::HashMap;

use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::{Error, Result};
use tessera_models::ModelFiles;
use tessera_models::chat_template::Message;
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{CacheShape, Lfm2Vl, Lfm2VlConfig, Prompt, Prompter, Turn};

use crate::decode::{Control, Finish, Sampler, SamplingParams};
use crate::text_stream::TextStream;

/// How to generate a reply.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// The reply ends before the first of these (which is not part of it).
    pub stop: Vec<String>,
}

/// A finished reply.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatReply {
    pub text: String,
    /// The generated tokens (an end token excluded).
    pub tokens: Vec<u32>,
    /// Tokens of the whole prompt, and how many of them came from the conversation's cache.
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: Finish,
}

/// A conversation's handle; each keeps its own cache until [`Chat::end`].
pub type ConversationId = u64;

/// What a step reports for one sequence.
#[derive(Debug)]
pub enum ChatEvent<'a> {
    /// More of the reply's text (never empty); a sequence's pieces add up to its reply's text,
    /// what its stream held back to the end (a possible stop string's start, an incomplete
    /// character at the token limit) coming just before [`ChatEvent::Done`].
    Text(&'a str),
    /// The reply ended; the sequence is gone (its conversation's cache stays).
    Done(ChatReply),
    /// The step failed for this sequence; it is gone and its conversation's cache dropped.
    Failed(&'a Error),
}

/// A chat model on its device. Front ends hold a `Box<dyn Chat>` (see [`load`]).
pub trait Chat: Send {
    /// Device and precision, one line.
    fn describe(&self) -> String;
    /// The sampling the checkpoint's `generation_config.json` asks for (greedy if none).
    fn default_sampling(&self) -> SamplingParams;
    /// The most tokens a conversation may hold.
    fn context_len(&self) -> usize;
    /// The most characters of text a conversation can hold: longer text is refused before it
    /// is tokenised, and front ends reading text can stop reading there.
    fn max_prompt_chars(&self) -> usize;
    /// Conversations whose caches fit at once (running or kept between turns).
    fn slots(&self) -> usize;
    /// Conversations holding a cache now.
    fn conversations(&self) -> usize;
    /// Check a request and build its prompt (template, image tiles, tokens): everything that
    /// can be refused is refused here.
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<Prompt>;
    /// Admit a reply to `prompt` in conversation `conv` (which must not be running); its prompt
    /// is prefilled at the next [`step`](Chat::step). Fails when every slot is taken.
    fn begin(
        &mut self,
        conv: ConversationId,
        prompt: Prompt,
        params: &GenerationParams,
    ) -> Result<()>;
    /// One forward for every running sequence, then one token each; `on` hears each
    /// sequence's text and end, and may stop a sequence (a client gone). Returns how many
    /// sequences are still running. An error here is the device's (every sequence has been
    /// told through `on` and ended).
    fn step(
        &mut self,
        on: &mut dyn FnMut(ConversationId, ChatEvent<'_>) -> Control,
    ) -> Result<usize>;
    /// Stop a running sequence at once, without a reply, and free its conversation's cache.
    fn cancel(&mut self, conv: ConversationId);
    /// Free a conversation's cache.
    fn end(&mut self, conv: ConversationId);

    /// The reply after `prompt`, as the only running sequence, streamed through `on_text`
    /// (which may stop it).
    fn reply(
        &mut self,
        conv: ConversationId,
        prompt: Prompt,
        params: &GenerationParams,
        on_text: &mut dyn FnMut(&str) -> Control,
    ) -> Result<ChatReply> {
        self.begin(conv, prompt, params)?;
        let mut done = None;
        let mut failed = None;
        while done.is_none() && failed.is_none() {
            self.step(&mut |_, ev| match ev {
                ChatEvent::Text(t) => on_text(t),
                ChatEvent::Done(r) => {
                    done = Some(r);
                    Control::Continue
                }
                ChatEvent::Failed(e) => {
                    failed = Some(e.to_string());
                    Control::Continue
                }
            })?;
        }
        match (done, failed) {
            (Some(r), _) => Ok(r),
            (None, Some(e)) => Err(Error::backend("chat", e)),
            (None, None) => Err(Error::backend("chat", "the reply ended without an answer")),
        }
    }
}

/// A reply being generated.
struct Running {
    prompt: Prompt,
    params: GenerationParams,
    sampler: Sampler,
    stream: TextStream,
    /// Tokens the cache held when the reply began (its conversation's earlier turns).
    cached: usize,
    /// The first image not yet in the cache; `None` once the prompt is prefilled.
    prefill_from: Option<usize>,
    /// Every token the sequence holds or is about to be fed, prompt first.
    history: Vec<u32>,
    /// Tokens to feed at the next step.
    feed: Vec<u32>,
    out: Vec<u32>,
    text: String,
}

/// LFM2-VL with its prompt builder, the running replies and the tokens each conversation's
/// cache holds.
struct Lfm2VlChat<B: Backend> {
    be: B,
    model: Lfm2Vl<B>,
    prompter: Prompter,
    defaults: SamplingParams,
    eos: Vec<u32>,
    running: Vec<(ConversationId, Running)>,
    /// Tokens each idle conversation's cache holds, and when it was last used.
    held: HashMap<ConversationId, (u64, Vec<u32>)>,
    clock: u64,
}

impl<B: Backend> Lfm2VlChat<B> {
    fn ctx(&self) -> usize {
        self.model.text.cache_shape().ctx
    }

    /// End `conv`'s sequence with `finish`: the text its stream still held back, its reply,
    /// and what its cache now holds (every token fed: all but the last sampled).
    fn finish(
        &mut self,
        conv: ConversationId,
        mut r: Running,
        mut finish: Finish,
    ) -> (String, ChatReply) {
        let decode = |ids: &[u32]| self.prompter.tokenizer().decode(ids, true);
        let mut tail = String::new();
        if !r.stream.stopped()
            && let Ok(t) = r.stream.finish(&decode)
        {
            r.text.push_str(&t);
            tail = t;
        }
        if r.stream.stopped() {
            finish = Finish::Stopped;
        }
        // Sampled tokens not fed back: the last one (and nothing when the step failed).
        let unfed = r.feed.len();
        r.history.truncate(r.history.len() - unfed);
        debug_assert_eq!(r.history.len(), self.model.text.held(conv));
        self.clock += 1;
        self.held.insert(conv, (self.clock, r.history));
        let reply = ChatReply {
            text: r.text,
            tokens: r.out.clone(),
            prompt_tokens: r.prompt.ids.len(),
            cached_tokens: r.cached,
            completion_tokens: r.out.len(),
            finish,
        };
        (tail, reply)
    }
}

impl<B: Backend> Chat for Lfm2VlChat<B> {
    fn describe(&self) -> String {
        self.be.describe()
    }
    fn default_sampling(&self) -> SamplingParams {
        self.defaults
    }
    fn context_len(&self) -> usize {
        self.ctx()
    }
    fn max_prompt_chars(&self) -> usize {
        self.prompter.max_text_chars(self.ctx())
    }
    fn slots(&self) -> usize {
        self.model.text.cache_shape().slots
    }
    fn conversations(&self) -> usize {
        self.running.len() + self.held.len()
    }

    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<Prompt> {
        self.prompter.check_length(messages, self.ctx())?;
        let p = self.prompter.build(messages, images, true)?;
        if p.ids.len() >= self.ctx() {
            return Err(Error::input(format!(
                "the prompt has {} tokens; the context holds {}, so nothing can be generated",
                p.ids.len(),
                self.ctx()
            )));
        }
        Ok(p)
    }

    fn begin(
        &mut self,
        conv: ConversationId,
        prompt: Prompt,
        params: &GenerationParams,
    ) -> Result<()> {
        if self.running.iter().any(|(c, _)| *c == conv) {
            return Err(Error::input(format!(
                "conversation {conv} already has a reply running"
            )));
        }
        if params.max_tokens == 0 {
            return Err(Error::input("max_tokens must be at least 1"));
        }
        let sampler = Sampler::new(params.sampling)?;
        // Reuse the cache when it holds a prefix of this prompt that ends between images.
        let held = self.held.remove(&conv).map(|h| h.1).unwrap_or_default();
        let first = (held.len() < prompt.ids.len() && prompt.ids.starts_with(&held))
            .then(|| prompt.first_image_after(held.len()))
            .flatten();
        let (cached, first) = match first {
            Some(f) => (held.len(), f),
            None => {
                self.model.text.release(conv);
                (0, 0)
            }
        };
        if self.model.text.held(conv) == 0 && self.conversations() >= self.slots() {
            // Make room by dropping the cache of the conversation idle the longest.
            match self.held.iter().min_by_key(|(_, h)| h.0).map(|(c, _)| *c) {
                Some(idle) => self.end(idle),
                None => {
                    self.model.text.release(conv);
                    return Err(Error::input(format!(
                        "all {} cache slots are taken by running replies; try again when one has finished",
                        self.slots()
                    )));
                }
            }
        }
        self.running.push((
            conv,
            Running {
                feed: prompt.ids[cached..].to_vec(),
                history: prompt.ids.clone(),
                prompt,
                params: params.clone(),
                sampler,
                stream: TextStream::new(&params.stop),
                cached,
                prefill_from: Some(first),
                out: Vec::new(),
                text: String::new(),
            },
        ));
        Ok(())
    }

    fn step(
        &mut self,
        on: &mut dyn FnMut(ConversationId, ChatEvent<'_>) -> Control,
    ) -> Result<usize> {
        if self.running.is_empty() {
            return Ok(0);
        }
        let logits = {
            let turns: Vec<Turn<'_>> = self
                .running
                .iter()
                .map(|(conv, r)| Turn {
                    seq: *conv,
                    tokens: &r.feed,
                    tiles: &[],
                })
                .collect();
            let tiles: Vec<_> = self
                .running
                .iter()
                .map(|(_, r)| {
                    r.prefill_from
                        .map(|f| r.prompt.tiles(f))
                        .unwrap_or_default()
                })
                .collect();
            let turns: Vec<Turn<'_>> = turns
                .into_iter()
                .zip(&tiles)
                .map(|(t, tiles)| Turn { tiles, ..t })
                .collect();
            self.model
                .extend(&self.be, &turns, false)
                .and_then(|v| self.be.read_f32(v).map(|all| (all, v.cols)))
        };
        let (all, vocab) = match logits {
            Ok(l) => l,
            Err(e) => {
                // The device failed: every running sequence ends, its cache dropped.
                for (conv, _) in std::mem::take(&mut self.running) {
                    self.model.text.release(conv);
                    on(conv, ChatEvent::Failed(&e));
                }
                return Err(e);
            }
        };
        let ctx = self.ctx();
        let running = std::mem::take(&mut self.running);
        for ((conv, mut r), logits) in running.into_iter().zip(all.chunks_exact(vocab)) {
            r.prefill_from = None;
            r.feed.clear();
            let finish = match r.sampler.sample(logits, &r.history) {
                Err(e) => {
                    self.model.text.release(conv);
                    on(conv, ChatEvent::Failed(&e));
                    continue;
                }
                Ok(t) if self.eos.contains(&t) => Some(Finish::Eos),
                Ok(t) => {
                    r.out.push(t);
                    r.history.push(t);
                    r.feed.push(t);
                    let decode = |ids: &[u32]| self.prompter.tokenizer().decode(ids, true);
                    let piece = match r.stream.push(t, &decode) {
                        Ok(p) => p,
                        Err(e) => {
                            self.model.text.release(conv);
                            on(conv, ChatEvent::Failed(&e));
                            continue;
                        }
                    };
                    r.text.push_str(&piece);
                    let told = if piece.is_empty() {
                        Control::Continue
                    } else {
                        on(conv, ChatEvent::Text(&piece))
                    };
                    if told == Control::Stop || r.stream.stopped() {
                        Some(Finish::Stopped)
                    } else if r.out.len() >= r.params.max_tokens || r.history.len() >= ctx {
                        Some(Finish::Length)
                    } else {
                        None
                    }
                }
            };
            match finish {
                Some(f) => {
                    let (tail, reply) = self.finish(conv, r, f);
                    if !tail.is_empty() {
                        on(conv, ChatEvent::Text(&tail));
                    }
                    on(conv, ChatEvent::Done(reply));
                }
                None => self.running.push((conv, r)),
            }
        }
        Ok(self.running.len())
    }

    fn cancel(&mut self, conv: ConversationId) {
        self.running.retain(|(c, _)| *c != conv);
        self.end(conv);
    }

    fn end(&mut self, conv: ConversationId) {
        self.held.remove(&conv);
        self.model.text.release(conv);
    }
}

/// Load LFM2-VL from `files` onto whichever device `backend` is, with a cache of `cache`.
pub fn load(
    backend: AnyBackend,
    files: &ModelFiles,
    cfg: &Lfm2VlConfig,
    cache: CacheShape,
) -> Result<Box<dyn Chat>> {
    struct Load(ModelFiles, Lfm2VlConfig, CacheShape);
    impl BackendFn for Load {
        type Output = Result<Box<dyn Chat>>;
        fn call<B: Backend + 'static>(self, be: B) -> Self::Output {
            let (files, cfg, cache) = (self.0, self.1, self.2);
            let ctx = cache.ctx.min(cfg.text.max_positions);
            let cache = CacheShape { ctx, ..cache };
            let prompter = Prompter::load(&files, &cfg)?;
            let d = prompter.generation_defaults();
            let defaults = SamplingParams {
                temperature: d.temperature,
                top_k: d.top_k,
                top_p: d.top_p,
                min_p: d.min_p,
                repetition_penalty: d.repetition_penalty,
                seed: 0,
            };
            let mut eos = cfg.text.eos.clone();
            eos.push(prompter.tokenizer().eos_id);
            eos.sort_unstable();
            eos.dedup();
            let model = Lfm2Vl::load(&be, &files, &cfg, cache)?;
            Ok(Box::new(Lfm2VlChat {
                be,
                model,
                prompter,
                defaults,
                eos,
                running: Vec::new(),
                held: HashMap::new(),
                clock: 0,
            }))
        }
    }
    backend.run(Load(files.clone(), cfg.clone(), cache))
}
