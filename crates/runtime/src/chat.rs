//! Chat models as front ends use them: any [`ChatFamily`] on whichever device was opened,
//! run by the one [`Scheduler`](crate::scheduler::Scheduler) behind one trait object
//! ([`Chat`]): messages with images in, streamed text out.
//!
//! **Continuous batching.** Replies run as *sequences*: [`Chat::begin`] admits one (its prompt
//! is prefilled from the next step on, in chunks of at most [`ChatOptions::prefill_chunk`]
//! tokens), and each [`Chat::step`] runs one forward for every running sequence together —
//! prompt chunks and one token for each decoding sequence — then samples the next token of each
//! sequence whose prompt is in. Sequences join and leave between steps; the cache holds
//! [`Chat::slots`] of them at once. [`Chat::reply`] is one sequence stepped to its end.
//!
//! **Reuse of the cache.** Each sequence belongs to a conversation whose cache slot outlives it.
//! A follow-up turn re-renders the whole conversation; when the tokens its slot holds are a
//! prefix of the new prompt (ending between images), only the rest is prefilled. With
//! [`ChatOptions::prefix_cache`], any request continues the longest prefix any idle slot holds
//! (another conversation's turn, a shared system prompt, the same image), see
//! [`crate::scheduler`]. Either way the reply is the one a fresh conversation gets.

use std::sync::Arc;

use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::{Error, Result};
use tessera_models::ModelFiles;
use tessera_models::chat_family::{ChatPrompt, ChatPrompter};
use tessera_models::chat_template::Message;
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{CacheShape, Lfm2VlChat, Lfm2VlConfig};

use crate::decode::{Control, Finish, SamplingParams};
use crate::scheduler::{self, Scheduler};

/// How the scheduler uses the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatOptions {
    /// Let any request continue the longest prefix an idle slot holds (kept at block
    /// boundaries and image ends); without, a conversation continues only its own slot.
    pub prefix_cache: bool,
    /// The most prompt tokens prefilled in one step; a longer prompt is prefilled over several
    /// steps beside the decoding sequences (an image is never cut).
    pub prefill_chunk: usize,
}

impl ChatOptions {
    /// A server's: requests share what the cache holds (a conversation's earlier turns, a
    /// common system prompt, the same image).
    pub fn serving() -> Self {
        ChatOptions {
            prefix_cache: true,
            ..ChatOptions::default()
        }
    }
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            prefix_cache: false,
            prefill_chunk: 2048,
        }
    }
}

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
    /// Tokens of the whole prompt, and how many of them came from the cache.
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
    /// The reply ended; the sequence is gone (its cache stays).
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
    /// Conversations whose caches fit at once (running or kept between turns).
    fn slots(&self) -> usize;
    /// Conversations holding a cache slot now (running, or kept between turns).
    fn conversations(&self) -> usize;
    /// The model's prompt builder, for front ends that build prompts on other threads.
    fn prompter(&self) -> Arc<dyn ChatPrompter>;
    /// Admit a reply to `prompt` in conversation `conv` (which must not be running); its prompt
    /// is prefilled at the next [`step`](Chat::step). Fails when every slot is taken.
    fn begin(
        &mut self,
        conv: ConversationId,
        prompt: ChatPrompt,
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
    /// Stop a running sequence at once, without a reply, and end its conversation.
    fn cancel(&mut self, conv: ConversationId);
    /// End a conversation: its slot is free (with the prefix cache, what it holds stays there
    /// for other requests until the slot is needed).
    fn end(&mut self, conv: ConversationId);

    /// The most characters of text a conversation can hold: longer text is refused before it
    /// is tokenised, and front ends reading text can stop reading there.
    fn max_prompt_chars(&self) -> usize {
        self.prompter().max_text_chars(self.context_len())
    }

    /// Check a request and build its prompt (template, image tiles, tokens): everything that
    /// can be refused is refused here, a prompt that leaves no room for a reply included.
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<ChatPrompt> {
        let ctx = self.context_len();
        let prompter = self.prompter();
        prompter.check_length(messages, ctx)?;
        let p = prompter.prompt(messages, images)?;
        if p.ids.len() >= ctx {
            return Err(Error::input(format!(
                "the prompt has {} tokens; the context holds {ctx}, so nothing can be generated",
                p.ids.len()
            )));
        }
        Ok(p)
    }

    /// The reply after `prompt`, as the only running sequence, streamed through `on_text`
    /// (which may stop it).
    fn reply(
        &mut self,
        conv: ConversationId,
        prompt: ChatPrompt,
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

/// Load LFM2-VL from `files` onto whichever device `backend` is, with a cache of `cache`, each
/// conversation reusing only its own cache.
pub fn load(
    backend: AnyBackend,
    files: &ModelFiles,
    cfg: &Lfm2VlConfig,
    cache: CacheShape,
) -> Result<Box<dyn Chat>> {
    load_with(backend, files, cfg, cache, ChatOptions::default())
}

/// [`load`] with the scheduler's `options`.
pub fn load_with(
    backend: AnyBackend,
    files: &ModelFiles,
    cfg: &Lfm2VlConfig,
    cache: CacheShape,
    options: ChatOptions,
) -> Result<Box<dyn Chat>> {
    struct Load(ModelFiles, Lfm2VlConfig, CacheShape, ChatOptions);
    impl BackendFn for Load {
        type Output = Result<Box<dyn Chat>>;
        fn call<B: Backend + 'static>(self, be: B) -> Self::Output {
            let Load(files, cfg, cache, options) = self;
            let ctx = cache.ctx.min(cfg.text.max_positions);
            let places = scheduler::places(options, cache.slots, ctx);
            let family = Lfm2VlChat::load(be, &files, &cfg, cache, places)?;
            Ok(Box::new(Scheduler::new(family, options)?))
        }
    }
    backend.run(Load(files.clone(), cfg.clone(), cache, options))
}
