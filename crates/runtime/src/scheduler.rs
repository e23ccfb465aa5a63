//! The chat scheduler, which knows no model: it admits replies into a [`ChatFamily`]'s cache
//! slots, packs each step's forward (prompt chunks beside one token of each decoding sequence),
//! samples, checks stops and lengths, streams text, and decides what the cache keeps for later
//! requests. The family only builds prompts and computes (`forward`, `restore`): the split of
//! vLLM's scheduler and worker.
//!
//! **What a slot holds.** Each slot records the tokens its cache holds (with a digest of each
//! image among them), so a new prompt can continue any idle slot whose tokens it starts with.
//! Attention keys and values are valid at every position a slot holds; a hybrid family's
//! convolution state is known at the slot's end, and at the positions the scheduler asked the
//! family to keep it while prefilling: every `block` tokens and at each image's end. A prompt
//! is continued from the longest such position it shares with a slot (and never from inside an
//! image), so the reply is the one a fresh slot gives.
//!
//! **Which slot.** Without the prefix cache ([`ChatOptions::prefix_cache`] off) a conversation
//! continues only its own slot. With it, a new reply takes the idle slot sharing the longest
//! usable prefix with its prompt; failing that, an empty slot, then the slot used least
//! recently (whose content is dropped).

use std::sync::Arc;

use tessera_core::{Error, Result};
use tessera_models::chat_family::{ChatFamily, ChatPrompt, ChatPrompter, Chunk, Media};

use crate::chat::{Chat, ChatEvent, ChatOptions, ChatReply, ConversationId, GenerationParams};
use crate::decode::{Control, Finish, Sampler, SamplingParams};
use crate::text_stream::TextStream;

/// Kept-state places of a slot beyond one per block, for image ends.
const MEDIA_PLACES: usize = 8;

/// Tokens between kept states for a context of `ctx`: at least 64, at most 64 blocks a slot.
fn block(ctx: usize) -> usize {
    ctx.div_ceil(64).max(64)
}

/// Kept-state places a family needs for `options`, `slots` and a context of `ctx`.
pub fn places(options: ChatOptions, slots: usize, ctx: usize) -> usize {
    if options.prefix_cache {
        slots * (ctx.div_ceil(block(ctx)) + MEDIA_PLACES)
    } else {
        0
    }
}

/// What one cache slot holds.
#[derive(Default)]
struct Slot {
    /// The tokens its cache holds, in order.
    ids: Vec<u32>,
    /// `(start, end, digest)` of each image among them.
    media: Vec<(usize, usize, [u8; 32])>,
    /// `(position, place)`: where the family kept the state, ascending.
    kept: Vec<(usize, usize)>,
    /// The conversation running in it or keeping it between turns.
    owner: Option<ConversationId>,
    running: bool,
    /// When it was last used (the scheduler's clock).
    used: u64,
}

impl Slot {
    /// Whether nothing runs in it, no conversation keeps it and it holds nothing.
    fn is_free(&self) -> bool {
        !self.running && self.owner.is_none() && self.ids.is_empty()
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.media.clear();
        self.kept.clear();
    }

    /// Keep only the first `n` tokens (a position where the state is known).
    fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
        self.media.retain(|m| m.1 <= n);
        self.kept.retain(|k| k.0 <= n);
    }

    /// How many leading tokens `prompt` shares with this slot, images compared by digest.
    fn shared(&self, prompt: &ChatPrompt) -> usize {
        let mut n = self
            .ids
            .iter()
            .zip(&prompt.ids)
            .take_while(|(a, b)| a == b)
            .count();
        // An image that differs, or is an image in one and not the other, ends the shared part
        // at its start.
        let held = self.media.iter().map(|&(a, b, d)| (a, b, d));
        let asked = prompt.media.iter().map(|m| (m.start, m.end, m.digest));
        for (a, b, digest) in held.clone().chain(asked.clone()) {
            if a >= n {
                continue;
            }
            let in_slot = held.clone().any(|m| m == (a, b, digest));
            let in_prompt = asked.clone().any(|m| m == (a, b, digest));
            if !(in_slot && in_prompt) {
                n = a;
            }
        }
        n
    }

    /// The longest prefix of `prompt` this slot can continue: a shared position where its state
    /// is known (its end, or a kept one), short of the whole prompt (whose last token must run
    /// to give logits), not inside an image; and the kept place to restore, if any.
    fn usable(&self, prompt: &ChatPrompt) -> (usize, Option<usize>) {
        let shared = self.shared(prompt).min(prompt.ids.len().saturating_sub(1));
        if shared == self.ids.len() && prompt.splits_at(shared) {
            return (shared, None);
        }
        self.kept
            .iter()
            .rev()
            .find(|&&(at, _)| at <= shared && prompt.splits_at(at))
            .map_or((0, None), |&(at, place)| (at, Some(place)))
    }
}

/// Where a new reply runs: its slot, the prompt tokens already there, the kept state to
/// restore at that position, and the slot those tokens are copied from (none: continued in
/// place).
struct Choice {
    slot: usize,
    cached: usize,
    place: Option<usize>,
    from: Option<usize>,
}

/// A reply being generated.
struct Running {
    conv: ConversationId,
    slot: usize,
    prompt: ChatPrompt,
    params: GenerationParams,
    sampler: Sampler,
    stream: TextStream,
    /// Prompt tokens that came from the cache.
    cached: usize,
    /// Prompt tokens in the cache so far.
    prefilled: usize,
    /// The token sampled last, to feed at the next step.
    feed: Option<u32>,
    /// Every token of the sequence, prompt first (what repetition penalties look at).
    history: Vec<u32>,
    out: Vec<u32>,
    text: String,
}

/// What a step's forward gave back.
enum Picked {
    /// Every chunk's logits, `[chunks, vocab]`, for the host to sample.
    Logits(Vec<f32>),
    /// Every chunk's greedy token, or why it has none.
    Tokens(Vec<Result<u32>>),
}

/// A step's work for one running reply.
struct Work {
    /// Index into `running`.
    run: usize,
    held: usize,
    tokens: Vec<u32>,
    media: Vec<Media>,
    keep: Vec<(usize, usize)>,
    /// The prompt's prefill ends with this chunk (or the reply is decoding): sample after it.
    samples: bool,
}

/// Each sampling sequence's next token from its row of `logits` (`[work, vocab]`), drawn in
/// parallel: every sequence has its own sampler, and a draw over a large vocabulary can cost as
/// much as a decode step. `None` for a chunk that samples nothing (or, never expected, a second
/// chunk of one sequence, which the caller then samples itself).
fn draw(running: &mut [Running], work: &[Work], logits: &[f32]) -> Vec<Option<Result<u32>>> {
    use rayon::prelude::*;
    let vocab = logits.len() / work.len().max(1);
    let mut runs: Vec<Option<&mut Running>> = running.iter_mut().map(Some).collect();
    let jobs: Vec<Option<(&[f32], &mut Running)>> = work
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let r = runs.get_mut(w.run)?.take().filter(|_| w.samples)?;
            Some((logits.get(i * vocab..(i + 1) * vocab)?, r))
        })
        .collect();
    jobs.into_par_iter()
        .map(|job| job.map(|(l, r)| r.sampler.sample(l, &r.history)))
        .collect()
}

/// The one chat scheduler over a [`ChatFamily`].
pub struct Scheduler<F: ChatFamily> {
    family: F,
    prompter: Arc<dyn ChatPrompter>,
    options: ChatOptions,
    defaults: SamplingParams,
    slots: Vec<Slot>,
    running: Vec<Running>,
    /// Tokens between kept states, and kept-state places per slot.
    block: usize,
    places_per_slot: usize,
    clock: u64,
}

impl<F: ChatFamily> Scheduler<F> {
    pub fn new(family: F, options: ChatOptions) -> Result<Self> {
        if options.prefill_chunk == 0 {
            return Err(Error::input("the prefill chunk must be at least one token"));
        }
        let prompter = family.prompter();
        let d = prompter.sampling();
        let defaults = SamplingParams {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            repetition_penalty: d.repetition_penalty,
            seed: 0,
        };
        let (slots, ctx) = (family.slots(), family.context_len());
        let places = family.snapshot_places();
        let places_per_slot = if options.prefix_cache {
            places / slots.max(1)
        } else {
            0
        };
        Ok(Scheduler {
            family,
            prompter,
            options,
            defaults,
            slots: (0..slots).map(|_| Slot::default()).collect(),
            running: Vec::new(),
            block: block(ctx),
            places_per_slot,
            clock: 0,
        })
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The slot `conv` will run in and the prefix of `prompt` it starts with (continued in
    /// place, or copied from another slot), or why none can be had.
    fn choose(&self, conv: ConversationId, prompt: &ChatPrompt) -> Result<Choice> {
        let own = self.slots.iter().position(|s| s.owner == Some(conv));
        let idle = |s: &Slot| !s.running;
        let best = if self.options.prefix_cache {
            // The longest usable prefix among idle slots; the conversation's own slot first.
            let mut order: Vec<usize> = own.into_iter().collect();
            order.extend((0..self.slots.len()).filter(|&i| Some(i) != own));
            order
                .into_iter()
                .filter(|&i| idle(&self.slots[i]))
                .map(|i| (i, self.slots[i].usable(prompt)))
                .filter(|(_, (n, _))| *n > 0)
                .max_by_key(|&(i, (n, _))| (n, Some(i) == own))
        } else {
            // Only the conversation's own cache, continued from its end.
            own.map(|i| (i, self.slots[i].usable(prompt)))
                .filter(|(i, (n, place))| {
                    *n > 0 && place.is_none() && *n == self.slots[*i].ids.len()
                })
        };
        let in_place = |(slot, (cached, place)): (usize, (usize, Option<usize>))| Choice {
            slot,
            cached,
            place,
            from: None,
        };
        if let Some(b) = best.filter(|&(i, _)| Some(i) == own) {
            return Ok(in_place(b)); // a conversation's own history: nothing to copy
        }
        if self.options.prefix_cache
            && let Some(copy) = self.copy_choice(prompt, best.map_or(0, |(_, (n, _))| n))
        {
            return Ok(copy);
        }
        if let Some(b) = best {
            return Ok(in_place(b));
        }
        // Without a prefix to continue: the conversation's own slot (without the prefix cache),
        // an empty one, else the one idle the longest gives way.
        let slot = own
            .filter(|&i| idle(&self.slots[i]) && !self.options.prefix_cache)
            .or_else(|| self.slots.iter().position(Slot::is_free))
            .or_else(|| self.least_recent(None));
        match slot {
            Some(i) => Ok(in_place((i, (0, None)))),
            None => Err(Error::input(format!(
                "all {} cache slots are taken by running replies; try again when one has finished",
                self.slots.len()
            ))),
        }
    }

    /// A copy of another slot's prefix into a slot of its own, where that starts `prompt` further
    /// than continuing an idle slot in place (`in_place` tokens), or as far but without taking
    /// a slot someone may come back to: the source may be running, and keeps what it holds.
    /// Only from a kept state (the copy's state at its end is restored from it).
    fn copy_choice(&self, prompt: &ChatPrompt, in_place: usize) -> Option<Choice> {
        let (from, cached, place) = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s.usable(prompt) {
                (n, Some(place)) if n > 0 => Some((i, n, place)),
                _ => None,
            })
            .max_by_key(|&(_, n, _)| n)?;
        let empty = self.slots.iter().position(Slot::is_free);
        let slot = match empty {
            Some(e) if cached >= in_place => e,
            // Otherwise a slot gives way only for a longer prefix than continuing in place.
            _ if cached > in_place => self.least_recent(Some(from))?,
            _ => return None,
        };
        Some(Choice {
            slot,
            cached,
            place: Some(place),
            from: Some(from),
        })
    }

    /// The idle slot used least recently, other than `except`.
    fn least_recent(&self, except: Option<usize>) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|&(i, s)| !s.running && Some(i) != except)
            .min_by_key(|(_, s)| s.used)
            .map(|(i, _)| i)
    }

    /// Free places of `slot` for kept states.
    fn free_place(&self, slot: usize, taken: &[(usize, usize)]) -> Option<usize> {
        let base = slot * self.places_per_slot;
        (base..base + self.places_per_slot)
            .find(|p| !self.slots[slot].kept.iter().chain(taken).any(|k| k.1 == *p))
    }

    /// This step's work: prompt chunks within the step's budget, and each decoding reply's
    /// last token.
    fn plan(&self) -> Vec<Work> {
        let mut budget = self.options.prefill_chunk;
        let window = self.family.keep_window().max(1);
        let mut work = Vec::with_capacity(self.running.len());
        for (run, r) in self.running.iter().enumerate() {
            let held = self.slots[r.slot].ids.len();
            if let Some(t) = r.feed {
                work.push(Work {
                    run,
                    held,
                    tokens: vec![t],
                    media: Vec::new(),
                    keep: Vec::new(),
                    samples: true,
                });
                continue;
            }
            let (from, len) = (r.prefilled, r.prompt.ids.len());
            if budget == 0 {
                continue;
            }
            // Up to the budget, never cutting an image: stop before one that starts inside the
            // chunk, or take the whole of one the chunk starts with.
            let mut to = from.saturating_add(budget).min(len);
            if let Some(m) = r.prompt.media.iter().find(|m| m.start < to && to < m.end) {
                to = if m.start > from { m.start } else { m.end };
            }
            budget = budget.saturating_sub(to - from);
            let media: Vec<Media> = r
                .prompt
                .media
                .iter()
                .filter(|m| m.start >= from && m.end <= to)
                .cloned()
                .collect();
            let mut keep = Vec::new();
            if self.places_per_slot > 0 {
                let ends = media.iter().map(|m| m.end);
                let blocks = (from / self.block + 1..=to / self.block).map(|b| b * self.block);
                let mut at: Vec<usize> = blocks.chain(ends).collect();
                at.sort_unstable();
                at.dedup();
                for p in at {
                    if p < from + window || !r.prompt.splits_at(p) {
                        continue;
                    }
                    match self.free_place(r.slot, &keep) {
                        Some(place) => keep.push((p, place)),
                        None => break,
                    }
                }
            }
            work.push(Work {
                run,
                held,
                tokens: r.prompt.ids[from..to].to_vec(),
                media,
                keep,
                samples: to == len,
            });
        }
        work
    }

    /// End `r` with `finish`: the text its stream still held back, and its reply. Its slot
    /// stays with its conversation.
    fn finish(&mut self, mut r: Running, mut finish: Finish) -> (String, ChatReply) {
        let mut tail = String::new();
        if !r.stream.stopped()
            && let Ok(t) = r
                .stream
                .finish(&|ids: &[u32]| self.prompter.detokenize(ids))
        {
            r.text.push_str(&t);
            tail = t;
        }
        if r.stream.stopped() {
            finish = Finish::Stopped;
        }
        let used = self.tick();
        let slot = &mut self.slots[r.slot];
        slot.running = false;
        slot.used = used;
        let reply = ChatReply {
            text: r.text,
            completion_tokens: r.out.len(),
            tokens: r.out,
            prompt_tokens: r.prompt.ids.len(),
            cached_tokens: r.cached,
            finish,
        };
        (tail, reply)
    }

    /// A reply failed: its slot's content is unknown from here, so the slot is emptied.
    fn drop_slot(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.clear();
        s.running = false;
        s.owner = None;
    }
}

impl<F: ChatFamily> Chat for Scheduler<F> {
    fn describe(&self) -> String {
        self.family.describe()
    }
    fn default_sampling(&self) -> SamplingParams {
        self.defaults
    }
    fn context_len(&self) -> usize {
        self.family.context_len()
    }
    fn slots(&self) -> usize {
        self.slots.len()
    }
    fn conversations(&self) -> usize {
        self.slots.iter().filter(|s| s.owner.is_some()).count()
    }

    fn prompter(&self) -> Arc<dyn ChatPrompter> {
        self.prompter.clone()
    }

    fn begin(
        &mut self,
        conv: ConversationId,
        prompt: ChatPrompt,
        params: &GenerationParams,
    ) -> Result<()> {
        if self.running.iter().any(|r| r.conv == conv) {
            return Err(Error::input(format!(
                "conversation {conv} already has a reply running"
            )));
        }
        if params.max_tokens == 0 {
            return Err(Error::input("max_tokens must be at least 1"));
        }
        if prompt.ids.is_empty() {
            return Err(Error::input("the prompt holds no tokens"));
        }
        let ctx = self.family.context_len();
        if prompt.ids.len() >= ctx {
            return Err(Error::input(format!(
                "the prompt has {} tokens; the context holds {ctx}, so nothing can be generated",
                prompt.ids.len()
            )));
        }
        let sampler = Sampler::new(params.sampling)?;
        let Choice {
            slot,
            cached,
            place,
            from,
        } = self.choose(conv, &prompt)?;
        if let Some(from) = from {
            self.family.copy_prefix(from, slot, cached)?;
            let src = &self.slots[from];
            let (ids, media) = (src.ids[..cached].to_vec(), src.media.clone());
            let s = &mut self.slots[slot];
            s.clear();
            s.ids = ids;
            s.media = media.into_iter().filter(|m| m.1 <= cached).collect();
            // The source's kept states stay its own: their places are in its range.
        }
        if let Some(place) = place {
            self.family.restore(slot, place)?;
        }
        // The conversation moves: it keeps one slot at a time.
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.owner == Some(conv) && i != slot {
                s.owner = None;
                if !self.options.prefix_cache {
                    s.clear();
                }
            }
        }
        let used = self.tick();
        let s = &mut self.slots[slot];
        s.truncate(cached);
        s.owner = Some(conv);
        s.running = true;
        s.used = used;
        self.running.push(Running {
            conv,
            slot,
            history: prompt.ids.clone(),
            prompt,
            params: params.clone(),
            sampler,
            stream: TextStream::new(&params.stop),
            cached,
            prefilled: cached,
            feed: None,
            out: Vec::new(),
            text: String::new(),
        });
        Ok(())
    }

    fn step(
        &mut self,
        on: &mut dyn FnMut(ConversationId, ChatEvent<'_>) -> Control,
    ) -> Result<usize> {
        if self.running.is_empty() {
            return Ok(0);
        }
        let work = self.plan();
        // A step whose every sampled token is the argmax of its logits (greedy, no repetition
        // penalty; nothing else reads the logits) takes the tokens from the family, which may
        // pick them on the device and copy back one id a sequence instead of its logits.
        let greedy = work
            .iter()
            .all(|w| !w.samples || self.running[w.run].sampler.argmax_only());
        let picked = {
            let chunks: Vec<Chunk<'_>> = work
                .iter()
                .map(|w| Chunk {
                    slot: self.running[w.run].slot,
                    held: w.held,
                    tokens: &w.tokens,
                    media: &w.media,
                    keep: &w.keep,
                })
                .collect();
            if greedy {
                self.family.forward_greedy(&chunks).map(Picked::Tokens)
            } else {
                self.family.forward(&chunks).map(Picked::Logits)
            }
        };
        let picked = picked.and_then(|p| {
            let fits = match &p {
                Picked::Logits(l) => !work.is_empty() && l.len() % work.len() == 0,
                Picked::Tokens(t) => t.len() == work.len(),
            };
            if fits {
                Ok(p)
            } else {
                let (n, what) = match &p {
                    Picked::Logits(l) => (l.len(), "logits"),
                    Picked::Tokens(t) => (t.len(), "tokens"),
                };
                Err(Error::backend(
                    "chat",
                    format!("{n} {what} for {} sequences", work.len()),
                ))
            }
        });
        let (logits, tokens) = match picked {
            Ok(Picked::Logits(l)) => (l, Vec::new()),
            Ok(Picked::Tokens(t)) => (Vec::new(), t),
            Err(e) => {
                // The device failed: every running reply ends, its slot emptied.
                for r in std::mem::take(&mut self.running) {
                    self.drop_slot(r.slot);
                    on(r.conv, ChatEvent::Failed(&e));
                }
                return Err(e);
            }
        };
        let mut tokens = if tokens.is_empty() {
            draw(&mut self.running, &work, &logits)
        } else {
            tokens.into_iter().map(Some).collect()
        }
        .into_iter();
        let vocab = logits.len() / work.len();
        let used = self.tick();
        let ctx = self.family.context_len();
        let mut ended = Vec::new();
        for (i, w) in work.iter().enumerate() {
            let token = tokens.next().flatten();
            let r = &mut self.running[w.run];
            let slot = &mut self.slots[r.slot];
            slot.ids.extend_from_slice(&w.tokens);
            slot.media
                .extend(w.media.iter().map(|m| (m.start, m.end, m.digest)));
            slot.kept.extend_from_slice(&w.keep);
            slot.used = used;
            r.feed = None;
            if !w.samples {
                r.prefilled += w.tokens.len();
                continue;
            }
            r.prefilled = r.prompt.ids.len();
            let t = match token.unwrap_or_else(|| {
                let logits = &logits[i * vocab..(i + 1) * vocab];
                r.sampler.sample(logits, &r.history)
            }) {
                Ok(t) => t,
                Err(e) => {
                    ended.push((w.run, Err(e)));
                    continue;
                }
            };
            if self.family.end_tokens().contains(&t) {
                ended.push((w.run, Ok(Finish::Eos)));
                continue;
            }
            r.out.push(t);
            r.history.push(t);
            r.feed = Some(t);
            let piece = match r
                .stream
                .push(t, &|ids: &[u32]| self.prompter.detokenize(ids))
            {
                Ok(p) => p,
                Err(e) => {
                    ended.push((w.run, Err(e)));
                    continue;
                }
            };
            r.text.push_str(&piece);
            let told = if piece.is_empty() {
                Control::Continue
            } else {
                on(r.conv, ChatEvent::Text(&piece))
            };
            if told == Control::Stop || r.stream.stopped() {
                ended.push((w.run, Ok(Finish::Stopped)));
            } else if r.out.len() >= r.params.max_tokens || r.history.len() >= ctx {
                ended.push((w.run, Ok(Finish::Length)));
            }
        }
        // Remove the ended from the back, so that earlier indices stay valid.
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        let mut events = Vec::with_capacity(ended.len());
        for (i, how) in ended {
            let r = self.running.remove(i);
            events.push((r, how));
        }
        events.reverse();
        for (r, how) in events {
            let conv = r.conv;
            match how {
                Ok(finish) => {
                    let (tail, reply) = self.finish(r, finish);
                    if !tail.is_empty() {
                        on(conv, ChatEvent::Text(&tail));
                    }
                    on(conv, ChatEvent::Done(reply));
                }
                Err(e) => {
                    self.drop_slot(r.slot);
                    on(conv, ChatEvent::Failed(&e));
                }
            }
        }
        Ok(self.running.len())
    }

    fn cancel(&mut self, conv: ConversationId) {
        if let Some(i) = self.running.iter().position(|r| r.conv == conv) {
            let r = self.running.remove(i);
            self.slots[r.slot].running = false;
        }
        self.end(conv);
    }

    fn end(&mut self, conv: ConversationId) {
        for s in &mut self.slots {
            if s.owner == Some(conv) && !s.running {
                s.owner = None;
                if !self.options.prefix_cache {
                    s.clear();
                }
            }
        }
    }

    fn encode_media(&mut self, prompt: &ChatPrompt) -> Result<()> {
        self.family.encode_media(&prompt.media)
    }
}

#[cfg(test)]
mod tests {
    use tessera_models::chat_template::Message;
    use tessera_models::generation::SamplingDefaults;
    use tessera_models::imageproc::Image;

    use super::*;

    /// A toy family over 8 tokens whose next token is one more than the sum of every token its
    /// slot holds, mod 8, very confidently: a slot continued from the wrong state answers
    /// differently.
    /// It refuses a chunk whose `held` is not what the slot holds (a slot started afresh aside),
    /// and a restore of a place never kept.
    /// It counts its calls of `forward` and `forward_greedy` (the default, on the host), and
    /// with `nan` set puts a NaN at that token of every row.
    struct Counter {
        slots: Vec<Vec<u32>>,
        kept: Vec<Option<Vec<u32>>>,
        ctx: usize,
        forwards: usize,
        greedy_forwards: usize,
        nan: Option<usize>,
    }

    impl Counter {
        fn new(slots: usize, places: usize, ctx: usize) -> Self {
            Counter {
                slots: vec![Vec::new(); slots],
                kept: vec![None; places],
                ctx,
                forwards: 0,
                greedy_forwards: 0,
                nan: None,
            }
        }

        fn logits(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<f32>> {
            let mut out = Vec::new();
            for c in chunks {
                let s = &mut self.slots[c.slot];
                if c.held == 0 {
                    s.clear();
                }
                if s.len() != c.held {
                    return Err(Error::backend("counter", "held is not what the slot holds"));
                }
                for &(n, place) in c.keep {
                    let mut k = s.clone();
                    k.extend_from_slice(&c.tokens[..n - c.held]);
                    self.kept[place] = Some(k);
                }
                s.extend_from_slice(c.tokens);
                let next = (s.iter().sum::<u32>() + 1) % 8;
                let row = out.len();
                out.extend((0..8).map(|t| if t == next { 10.0 } else { 0.0 }));
                if let Some(t) = self.nan {
                    out[row + t] = f32::NAN;
                }
            }
            Ok(out)
        }
    }

    /// The counter's text: token `t` is the letter `a + t`; prompts come as ids.
    struct Letters;

    impl ChatPrompter for Letters {
        fn check_length(&self, _: &[Message], _: usize) -> Result<()> {
            Ok(())
        }
        fn max_text_chars(&self, context: usize) -> usize {
            context
        }
        fn image_peak_bytes(&self, _: usize, _: usize) -> Result<u64> {
            Err(Error::input("no images"))
        }
        fn reserved_text(&self) -> &[&'static str] {
            &[]
        }
        fn prompt(&self, _: &[Message], _: &[Image]) -> Result<ChatPrompt> {
            Err(Error::input("not used"))
        }
        fn sampling(&self) -> SamplingDefaults {
            SamplingDefaults::GREEDY
        }
        fn detokenize(&self, ids: &[u32]) -> Result<String> {
            Ok(ids.iter().map(|&t| char::from(b'a' + t as u8)).collect())
        }
    }

    impl ChatFamily for Counter {
        fn describe(&self) -> String {
            "counter".into()
        }
        fn slots(&self) -> usize {
            self.slots.len()
        }
        fn context_len(&self) -> usize {
            self.ctx
        }
        fn end_tokens(&self) -> &[u32] {
            &[7]
        }
        fn prompter(&self) -> Arc<dyn ChatPrompter> {
            Arc::new(Letters)
        }
        fn snapshot_places(&self) -> usize {
            self.kept.len()
        }
        fn keep_window(&self) -> usize {
            2
        }
        fn forward(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<f32>> {
            self.forwards += 1;
            self.logits(chunks)
        }
        /// The trait's rule on the host, as a family whose logits live there keeps it.
        fn forward_greedy(&mut self, chunks: &[Chunk<'_>]) -> Result<Vec<Result<u32>>> {
            self.greedy_forwards += 1;
            let logits = self.logits(chunks)?;
            Ok(logits
                .chunks_exact(8)
                .map(tessera_models::chat_family::greedy)
                .collect())
        }
        fn restore(&mut self, slot: usize, place: usize) -> Result<()> {
            let k = self.kept[place]
                .clone()
                .ok_or_else(|| Error::backend("counter", "restore of a place never kept"))?;
            if !self.slots[slot].is_empty() && !k.starts_with(&self.slots[slot]) {
                return Err(Error::backend(
                    "counter",
                    "the slot's keys are another prefix",
                ));
            }
            self.slots[slot] = k;
            Ok(())
        }
        fn copy_prefix(&mut self, from: usize, to: usize, n: usize) -> Result<()> {
            self.slots[to] = self.slots[from][..n].to_vec();
            Ok(())
        }
    }

    fn scheduler(prefix_cache: bool, prefill_chunk: usize) -> Scheduler<Counter> {
        let options = ChatOptions {
            prefix_cache,
            prefill_chunk,
        };
        let (slots, ctx) = (2, 512);
        Scheduler::new(
            Counter::new(slots, places(options, slots, ctx), ctx),
            options,
        )
        .unwrap()
    }

    fn prompt(ids: &[u32]) -> ChatPrompt {
        ChatPrompt {
            ids: ids.to_vec(),
            ..ChatPrompt::default()
        }
    }

    fn reply(
        s: &mut Scheduler<Counter>,
        conv: u64,
        ids: &[u32],
        max: usize,
    ) -> (String, ChatReply) {
        let params = GenerationParams {
            sampling: SamplingParams::default(),
            max_tokens: max,
            stop: Vec::new(),
        };
        let mut streamed = String::new();
        let r = s
            .reply(conv, prompt(ids), &params, &mut |t| {
                streamed.push_str(t);
                Control::Continue
            })
            .unwrap();
        s.end(conv);
        (streamed, r)
    }

    #[test]
    fn greedy_replies_stream_and_stop_at_an_end_token_or_the_limit() {
        let mut s = scheduler(false, 2048);
        // Sums 5 → 6 ("g"), 11 → 4 ("e"), 15 → 0 ("a"), 15 → 0 …: the limit ends it.
        let (streamed, r) = reply(&mut s, 1, &[2, 3], 4);
        assert_eq!(
            (r.tokens.as_slice(), r.finish),
            (&[6, 4, 0, 0][..], Finish::Length)
        );
        assert_eq!((streamed.as_str(), r.text.as_str()), ("geaa", "geaa"));
        // Sum 6 → 7, the end token: nothing generated.
        let (_, r) = reply(&mut s, 1, &[6], 4);
        assert_eq!((r.tokens.len(), r.finish), (0, Finish::Eos));
    }

    /// Prefixes are continued from kept states (every 64 tokens) or a slot's end, chunked or
    /// not, and the replies are those of an empty cache.
    #[test]
    fn prefixes_are_continued_from_kept_states_with_the_same_replies() {
        let a: Vec<u32> = (0..150).map(|i| (i * 5 % 7) as u32).collect();
        let mut b = a[..130].to_vec();
        b.extend([3, 1, 2, 5, 1]);
        for chunk in [2048, 9] {
            let mut fresh = scheduler(false, chunk);
            let want_b = reply(&mut fresh, 1, &b, 6).1;
            let mut s = scheduler(true, chunk);
            let ra = reply(&mut s, 1, &a, 6).1;
            assert_eq!(ra.cached_tokens, 0);
            let rb = reply(&mut s, 2, &b, 6).1;
            assert_eq!((rb.cached_tokens, &rb.tokens), (128, &want_b.tokens));
            // The slot's end: `b` and its reply but the last token.
            let mut c = b.clone();
            c.extend(&rb.tokens);
            c.extend([4, 4]);
            let rc = reply(&mut s, 3, &c, 6).1;
            assert_eq!(rc.cached_tokens, b.len() + rb.tokens.len() - 1);
            assert_eq!(rc.tokens, reply(&mut fresh, 2, &c, 6).1.tokens);
        }
    }

    /// A prompt sharing a prefix with a running reply's slot copies it into a free slot (from
    /// the state kept at a block boundary) instead of prefilling it, and leaves the running
    /// slot whole: its conversation's next turn still continues all of it. The replies are
    /// those of an empty cache.
    #[test]
    fn a_prefix_is_copied_from_a_running_slot() {
        let a: Vec<u32> = (0..150).map(|i| (i * 5 % 7) as u32).collect();
        let mut b = a[..140].to_vec();
        b.extend([3, 1]);
        let mut fresh = scheduler(false, 2048);
        let want_b = reply(&mut fresh, 1, &b, 6).1;
        let params = |max| GenerationParams {
            sampling: SamplingParams::default(),
            max_tokens: max,
            stop: Vec::new(),
        };
        let mut s = scheduler(true, 2048);
        s.begin(1, prompt(&a), &params(3)).unwrap();
        s.step(&mut |_, _| Control::Continue).unwrap(); // `a` prefilled, decoding
        s.begin(2, prompt(&b), &params(6)).unwrap();
        let mut done = Vec::new();
        while !s.running.is_empty() {
            s.step(&mut |conv, ev| {
                if let ChatEvent::Done(r) = ev {
                    done.push((conv, r.clone()));
                }
                Control::Continue
            })
            .unwrap();
        }
        done.sort_by_key(|d| d.0);
        let (ra, rb) = (&done[0].1, &done[1].1);
        assert_eq!((rb.cached_tokens, &rb.tokens), (128, &want_b.tokens));
        assert_eq!(ra.tokens, reply(&mut fresh, 2, &a, 3).1.tokens);
        s.end(1);
        s.end(2);
        let mut c = a.clone();
        c.extend(&ra.tokens);
        c.extend([4, 4]);
        let rc = reply(&mut s, 3, &c, 6).1;
        assert_eq!(rc.cached_tokens, a.len() + ra.tokens.len() - 1);
        assert_eq!(rc.tokens, reply(&mut fresh, 3, &c, 6).1.tokens);
    }

    /// The counter's reply to `ids` by its rule, worked out here: each token is one more than
    /// the sum of every token before it, mod 8, until the end token 7 or `max` tokens.
    fn by_the_rule(ids: &[u32], max: usize) -> Vec<u32> {
        let mut sum: u32 = ids.iter().sum();
        let mut out = Vec::new();
        while out.len() < max {
            let next = (sum + 1) % 8;
            if next == 7 {
                break;
            }
            out.push(next);
            sum += next;
        }
        out
    }

    /// Replies to `prompts` run side by side, each with its `sampling`, as `(tokens, error)`.
    fn batch(
        s: &mut Scheduler<Counter>,
        prompts: &[(&[u32], SamplingParams)],
    ) -> Vec<(Vec<u32>, Option<String>)> {
        for (conv, (ids, sampling)) in prompts.iter().enumerate() {
            let params = GenerationParams {
                sampling: *sampling,
                max_tokens: 6,
                stop: Vec::new(),
            };
            s.begin(conv as u64, prompt(ids), &params).unwrap();
        }
        let mut out = vec![(Vec::new(), None); prompts.len()];
        while !s.running.is_empty() {
            s.step(&mut |conv, ev| {
                match ev {
                    ChatEvent::Done(r) => out[conv as usize].0 = r.tokens.clone(),
                    ChatEvent::Failed(e) => out[conv as usize].1 = Some(e.to_string()),
                    ChatEvent::Text(_) => {}
                }
                Control::Continue
            })
            .unwrap();
        }
        for conv in 0..prompts.len() {
            s.end(conv as u64);
        }
        out
    }

    /// A step whose sampled tokens are all greedy without a repetition penalty takes them from
    /// `forward_greedy`; one sampled sequence (temperature > 0, or a penalty) sends the step
    /// through `forward` and the host's sampler. The replies are the counter's either way (its
    /// next token is 10 logits above the others, so a draw at temperature 0.1 picks it too),
    /// and a NaN logit fails each sequence with the host sampler's message on both paths.
    #[test]
    fn greedy_steps_take_the_tokens_and_sampled_ones_the_logits() {
        let greedy = SamplingParams::default();
        let drawn = SamplingParams {
            temperature: 0.1,
            seed: 5,
            ..greedy
        };
        let penalised = SamplingParams {
            repetition_penalty: 1.1,
            ..greedy
        };
        let (a, b): (&[u32], &[u32]) = (&[2, 3], &[1, 2]);
        let want = vec![(by_the_rule(a, 6), None), (by_the_rule(b, 6), None)];
        assert_eq!(
            (&want[0].0[..], &want[1].0[..]),
            (&[6, 4, 0, 0, 0, 0][..], &[4, 0, 0, 0, 0, 0][..])
        );

        let mut s = scheduler(false, 2048);
        assert_eq!(batch(&mut s, &[(a, greedy), (b, greedy)]), want);
        assert_eq!((s.family.forwards, s.family.greedy_forwards), (0, 6));
        for other in [drawn, penalised] {
            let mut s = scheduler(false, 2048);
            assert_eq!(batch(&mut s, &[(a, greedy), (b, other)]), want);
            assert_eq!((s.family.forwards, s.family.greedy_forwards), (6, 0));
        }

        let nan = Some("sampling: the logit of token 3 is NaN".to_string());
        for other in [greedy, drawn] {
            let mut s = scheduler(false, 2048);
            s.family.nan = Some(3);
            let got = batch(&mut s, &[(a, greedy), (b, other)]);
            assert_eq!(got, vec![(Vec::new(), nan.clone()); 2]);
        }
    }

    /// Sequences sampled in one step (their draws run in parallel) draw what each draws alone:
    /// every sequence keeps its own generator. At temperature 20 the counter's next token is
    /// drawn about one time in five, so the replies are draws, not its greedy answers.
    #[test]
    fn sequences_sampled_together_draw_what_each_draws_alone() {
        let hot = |seed| SamplingParams {
            temperature: 20.0,
            seed,
            ..SamplingParams::default()
        };
        let (a, b): (&[u32], &[u32]) = (&[2, 3], &[1, 2]);
        let together = batch(&mut scheduler(false, 2048), &[(a, hot(5)), (b, hot(6))]);
        let alone_a = batch(&mut scheduler(false, 2048), &[(a, hot(5))]);
        let alone_b = batch(&mut scheduler(false, 2048), &[(b, hot(6))]);
        assert_eq!(together, [alone_a[0].clone(), alone_b[0].clone()]);
        assert_ne!(together[0].0, by_the_rule(a, 6));
        assert_ne!(together[1].0, by_the_rule(b, 6));
    }
}
