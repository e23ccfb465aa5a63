//! What a chat family gives the runtime's scheduler (`tessera_runtime::chat`), which knows no
//! model: prompts as token ids with their media, and a forward over the family's own cache
//! slots. The scheduler decides which sequences run, which slot each uses, how much of a prompt
//! each step prefills, and what the cache keeps between requests; the family only computes.
//!
//! Prompts are built by the family's [`ChatPrompter`], which front ends hold apart from the
//! model: the server builds a request's prompt on the request's own thread (template, tokens,
//! images) while the device runs other replies, and refuses a bad request before it is queued.
//!
//! A family's cache holds [`ChatFamily::slots`] sequences of up to [`ChatFamily::context_len`]
//! tokens. Attention keys and values stay valid at every position a slot holds, so a slot's
//! prefix can be continued by another request; state that only exists at a sequence's end (a
//! convolution's or a recurrence's) is kept at the positions the scheduler names
//! ([`Chunk::keep`]) in numbered places, and put back with [`ChatFamily::restore`].

use std::any::Any;
use std::sync::Arc;

use tessera_core::{Error, Result};

use crate::chat_template::Message;
use crate::generation::SamplingDefaults;
use crate::imageproc::Image;

/// How many sequences a chat model's cache holds at once and how many tokens each may reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub slots: usize,
    pub ctx: usize,
}

/// One media item of a prompt (an image): its placeholder tokens `[start, end)` in the prompt,
/// a digest of its content (so that two prompts with the same placeholder ids but different
/// images never share a cache), the family's prepared input, and the bytes that input holds
/// (a server counts them against its image memory until the reply ends).
#[derive(Clone)]
pub struct Media {
    pub start: usize,
    pub end: usize,
    pub digest: [u8; 32],
    pub input: Arc<dyn Any + Send + Sync>,
    pub bytes: u64,
}

impl std::fmt::Debug for Media {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Media")
            .field("start", &self.start)
            .field("end", &self.end)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// A prompt ready for the scheduler.
#[derive(Clone, Debug, Default)]
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// The rendered conversation, for logs.
    pub text: String,
    /// In order of their spans, which do not overlap.
    pub media: Vec<Media>,
}

impl ChatPrompt {
    /// Whether the first `n` tokens hold whole media only (no span straddles `n`).
    pub fn splits_at(&self, n: usize) -> bool {
        !self.media.iter().any(|m| m.start < n && n < m.end)
    }
}

/// One sequence's part of a forward.
pub struct Chunk<'a> {
    pub slot: usize,
    /// Tokens the slot holds before this chunk: the position of its first token. It is 0 (the
    /// slot starts afresh, whatever it held), the slot's end after the last forward, or the
    /// position of the state last restored into it.
    pub held: usize,
    pub tokens: &'a [u32],
    /// The media whose spans lie in `tokens`, in order.
    pub media: &'a [Media],
    /// `(n, place)`: keep the sequence's state after its first `n` tokens (`held < n ≤ held +
    /// tokens.len()`, `n − held ≥` [`ChatFamily::keep_window`]) in snapshot place `place`.
    pub keep: &'a [(usize, usize)],
}

/// A family's prompts and text: its chat template, tokenizer and media processing, apart from
/// the model so that front ends build prompts on their own threads. Everything in a request
/// that can be refused is refused here, before it waits for the device.
pub trait ChatPrompter: Send + Sync {
    /// Refuse `messages` whose text cannot fit `context` tokens, judged from its length before
    /// anything is rendered or tokenised (cheap: call it before reading any image).
    fn check_length(&self, messages: &[Message], context: usize) -> Result<()>;
    /// The most characters of text that can fit `context` tokens (front ends reading text can
    /// stop reading there).
    fn max_text_chars(&self, context: usize) -> usize;
    /// The bytes preparing an image of `width × height` holds at its peak, from its size alone;
    /// an error where the family refuses that size.
    fn image_peak_bytes(&self, width: usize, height: usize) -> Result<u64>;
    /// Text a message may not contain: the family's placeholders, which only media may put in
    /// a prompt.
    fn reserved_text(&self) -> &[&'static str];
    /// The prompt for `messages`, whose image parts are `images` in order, with the turn that
    /// asks for the reply. Whether it leaves room for a reply is the caller's to judge.
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<ChatPrompt>;
    /// The sampling the checkpoint asks for.
    fn sampling(&self) -> SamplingDefaults;
    /// Generated tokens as text.
    fn detokenize(&self, ids: &[u32]) -> Result<String>;
}

/// A chat model family on its device, as the scheduler drives it.
pub trait ChatFamily: Send {
    /// Device and precision, one line.
    fn describe(&self) -> String;
    /// Sequences the cache holds at once.
    fn slots(&self) -> usize;
    /// The most tokens one sequence may hold.
    fn context_len(&self) -> usize;
    /// Tokens that end a reply.
    fn end_tokens(&self) -> &[u32];
    /// The family's prompt builder (shared: front ends build prompts with it on other threads).
    fn prompter(&self) -> Arc<dyn ChatPrompter>;
    /// Places for kept states ([`Chunk::keep`]); 0 when the family keeps none, so that only a
    /// slot's whole content can be continued.
    fn snapshot_places(&self) -> usize;
    /// The fewest tokens of a chunk before a position whose state can be kept there.
    fn keep_window(&self) -> usize;
    /// Append each chunk's tokens to its slot and return the logits of each chunk's last row,
    /// `[chunks, vocab]` (a slot appears at most once).
    fn forward(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<f32>>;
    /// [`forward`](Self::forward), then each chunk's greedy token ([`greedy`]: the first of its
    /// largest logits, or why there is none), for a step that samples greedily only. The outer
    /// error is the forward's; a chunk's own is its sequence's alone. A family whose logits live
    /// on a device overrides this to pick the tokens there and copy back only them (one `u32`
    /// a sequence instead of a vocabulary of logits); by default the logits come back and the
    /// host picks.
    fn forward_greedy(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<Result<u32>>> {
        let logits = self.forward(chunks)?;
        if chunks.is_empty() || !logits.len().is_multiple_of(chunks.len()) {
            return Err(Error::backend(
                "chat",
                format!("{} logits for {} sequences", logits.len(), chunks.len()),
            ));
        }
        Ok(logits
            .chunks_exact(logits.len() / chunks.len())
            .map(greedy)
            .collect())
    }
    /// Make `slot`'s state the one kept in `place`, so that the slot continues from the
    /// position it was kept at.
    fn restore(&mut self, slot: usize, place: usize) -> Result<()>;
    /// Copy what slot `from` holds for its first `n` tokens (attention keys and values) into
    /// slot `to`, leaving `from` as it is; the scheduler then restores `to`'s state at `n` from
    /// a place kept there. A prefix another slot holds — running or kept for its conversation —
    /// is reused without recomputing it and without taking that slot.
    fn copy_prefix(&mut self, from: usize, to: usize, n: usize) -> Result<()>;
    /// Run `media` through the family's encoder (for LFM2-VL the vision tower and projector)
    /// and wait for the device, keeping nothing: what `tessera bench chat` times as the
    /// encoder alone. A family without one says so.
    fn encode_media(&mut self, media: &[Media]) -> Result<()> {
        let _ = media;
        Err(Error::input(format!(
            "{} encodes no media alone",
            self.describe()
        )))
    }
}

/// Greedy decoding's token: the first of the largest logits (the first `i` whose logit is above
/// every earlier one, from −∞, so 0 when none is above −∞) — the rule of
/// [`Backend::argmax_rows`](tessera_backend::Backend::argmax_rows). A NaN logit is an error
/// ([`nan_logit`]).
pub fn greedy(logits: &[f32]) -> Result<u32> {
    if logits.is_empty() {
        return Err(Error::backend("sampling", "no logits"));
    }
    match tessera_backend::first_argmax(logits) {
        tessera_backend::NAN_ROW => Err(nan_logit(logits)),
        t => Ok(t),
    }
}

/// The error of sampling from `logits`, which hold a NaN: it names the first.
pub fn nan_logit(logits: &[f32]) -> Error {
    let i = logits.iter().position(|v| v.is_nan()).unwrap_or(0);
    Error::backend("sampling", format!("the logit of token {i} is NaN"))
}
