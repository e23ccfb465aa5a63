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
use tessera_models::chat_family::{CacheShape, ChatFamily, ChatPrompt, ChatPrompter};
use tessera_models::chat_template::Message;
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::Lfm2VlChat;

use crate::decode::{Control, Finish, SamplingParams};
use crate::scheduler::{self, Scheduler};
use crate::{ModelFilesOf, ModelSpec};

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

/// A chat model on its device. Front ends hold a `Box<dyn Chat>` (see [`load`]) and learn
/// everything about the model through it, never through its family's types.
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
    /// Run `prompt`'s media through the family's encoder alone and wait for it (benchmarks:
    /// the vision tower timed by itself); nothing is kept.
    fn encode_media(&mut self, prompt: &ChatPrompt) -> Result<()>;

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

/// Load the chat model `spec` names onto whichever device `backend` is, with a cache of
/// `cache` (its context capped at the model's positions) used as `options` say. The one place
/// that knows the chat families: each builds its [`ChatFamily`] here, and the one
/// [`Scheduler`] runs it.
pub fn load(
    backend: AnyBackend,
    spec: &ModelSpec,
    cache: CacheShape,
    options: ChatOptions,
) -> Result<Box<dyn Chat>> {
    /// The model's files, the refusal should it not chat, the cache and the options.
    struct Load(ModelFilesOf, String, CacheShape, ChatOptions);
    impl BackendFn for Load {
        type Output = Result<Box<dyn Chat>>;
        fn call<B: Backend + 'static>(self, be: B) -> Self::Output {
            let Load(files, not_chat, cache, options) = self;
            match files {
                ModelFilesOf::Lfm2Vl(files, cfg) => {
                    let (cache, places) = sized(cache, cfg.text.max_positions, options);
                    let family = Lfm2VlChat::load(be, &files, &cfg, cache, places)?;
                    scheduled(family, options)
                }
                // Listed rather than `_`, so that a new family must say whether it chats.
                ModelFilesOf::EmbeddingGemma2(..)
                | ModelFilesOf::ZImage(..)
                | ModelFilesOf::QwenImage(..) => Err(Error::input(not_chat)),
            }
        }
    }
    let not_chat = format!(
        "{} is a {} model, not a chat model",
        spec.label,
        spec.family.name()
    );
    backend.run(Load(spec.files.clone(), not_chat, cache, options))
}

/// `cache` with its context capped at the model's `positions`, and the places for the states
/// the scheduler keeps with `options` in a cache of that shape.
fn sized(cache: CacheShape, positions: usize, options: ChatOptions) -> (CacheShape, usize) {
    let ctx = cache.ctx.min(positions);
    let places = scheduler::places(options, cache.slots, ctx);
    (CacheShape { ctx, ..cache }, places)
}

/// `family` run by the scheduler, as front ends hold it.
fn scheduled<F: ChatFamily + 'static>(family: F, options: ChatOptions) -> Result<Box<dyn Chat>> {
    Ok(Box::new(Scheduler::new(family, options)?))
}

#[cfg(test)]
mod tests {
    use tessera_backend::cpu::CpuBackend;

    use super::*;
    use crate::Family;

    fn load_bundled(family: Family, ctx: usize) -> Result<Box<dyn Chat>> {
        let spec = ModelSpec::bundled(family)?;
        let cache = CacheShape { slots: 2, ctx };
        load(
            AnyBackend::Cpu(CpuBackend::new()),
            &spec,
            cache,
            ChatOptions::serving(),
        )
    }

    #[test]
    fn a_model_that_does_not_chat_is_refused_by_name() {
        for family in [Family::EmbeddingGemma2, Family::ZImage, Family::QwenImage] {
            let e = match load_bundled(family, 64) {
                Ok(_) => panic!("{} loaded as a chat model", family.name()),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains(family.bundled_name()) && e.contains("not a chat model"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_context_is_capped_at_the_models_positions() {
        let ModelFilesOf::Lfm2Vl(_, cfg) = ModelSpec::bundled(Family::Lfm2Vl).unwrap().files else {
            panic!("the bundled chat model is LFM2-VL")
        };
        let positions = cfg.text.max_positions;
        let chat = load_bundled(Family::Lfm2Vl, positions + 100).unwrap();
        assert_eq!((chat.context_len(), chat.slots()), (positions, 2));
        let chat = load_bundled(Family::Lfm2Vl, 64).unwrap();
        assert_eq!(chat.context_len(), 64);
    }
}
