//! Chat models as front ends use them: LFM2-VL on whichever device was opened, behind one trait
//! object ([`Chat`]): messages with images in, streamed text out, each conversation keeping its
//! cache between turns.
//!
//! A follow-up turn re-renders the whole conversation with the model's chat template. When the
//! tokens the conversation's cache holds are a prefix of the new prompt, only the rest is
//! prefilled; otherwise (a stop string cut the last reply, the caller edited history) the cache
//! is dropped and the prompt prefilled whole. Nothing is ever reused that the reference would
//! not compute the same way.

use std::collections::HashMap;

use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::{Error, Result};
use tessera_models::ModelFiles;
use tessera_models::chat_template::Message;
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{
    CacheShape, Lfm2Vl, Lfm2VlConfig, Prompt, Prompter, TilePatches, Turn,
};

use crate::decode::{Control, Decoder, Finish, Sampler, SamplingParams, SeqId, generate};
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

/// A chat model on its device. Front ends hold a `Box<dyn Chat>` (see [`load`]).
pub trait Chat: Send {
    /// Device and precision, one line.
    fn describe(&self) -> String;
    /// The sampling the checkpoint's `generation_config.json` asks for (greedy if none).
    fn default_sampling(&self) -> SamplingParams;
    /// The most tokens a conversation may hold.
    fn context_len(&self) -> usize;
    /// Check a request and build its prompt (template, image tiles, tokens): everything that
    /// can be refused is refused here.
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<Prompt>;
    /// The assistant's reply after `prompt`, streamed through `on_text` (which may stop it).
    fn reply(
        &mut self,
        conv: ConversationId,
        prompt: &Prompt,
        params: &GenerationParams,
        on_text: &mut dyn FnMut(&str) -> Control,
    ) -> Result<ChatReply>;
    /// Free a conversation's cache.
    fn end(&mut self, conv: ConversationId);
}

/// LFM2-VL with its prompt builder and the tokens each conversation's cache holds.
struct Lfm2VlChat<B: Backend> {
    be: B,
    model: Lfm2Vl<B>,
    prompter: Prompter,
    defaults: SamplingParams,
    eos: Vec<u32>,
    held: HashMap<ConversationId, Vec<u32>>,
}

/// The model as a [`Decoder`] for one call: the images of the prompt being prefilled ride along
/// with the first forward of their sequence.
struct Stepper<'a, B: Backend> {
    be: &'a B,
    model: &'a mut Lfm2Vl<B>,
    ctx: usize,
    tiles: Option<Vec<TilePatches<'a>>>,
}

impl<B: Backend> Decoder for Stepper<'_, B> {
    fn context_len(&self) -> usize {
        self.ctx
    }
    fn forward(&mut self, batch: &[(SeqId, &[u32])]) -> Result<Vec<Vec<f32>>> {
        let tiles = self.tiles.take().unwrap_or_default();
        let turns: Vec<Turn<'_>> = batch
            .iter()
            .enumerate()
            .map(|(i, &(seq, tokens))| Turn {
                seq: seq.0,
                tokens,
                tiles: if i == 0 { &tiles } else { &[] },
            })
            .collect();
        let logits = self.model.extend(self.be, &turns, false)?;
        let all = self.be.read_f32(logits)?;
        Ok(all.chunks_exact(logits.cols).map(<[f32]>::to_vec).collect())
    }
    fn release(&mut self, seq: SeqId) {
        self.model.text.release(seq.0);
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
        self.model.text.cache_shape().ctx
    }
    fn prompt(&self, messages: &[Message], images: &[Image]) -> Result<Prompt> {
        let p = self.prompter.build(messages, images, true)?;
        if p.ids.len() >= self.context_len() {
            return Err(Error::input(format!(
                "the prompt has {} tokens; the context holds {}, so nothing can be generated",
                p.ids.len(),
                self.context_len()
            )));
        }
        Ok(p)
    }

    fn reply(
        &mut self,
        conv: ConversationId,
        prompt: &Prompt,
        params: &GenerationParams,
        on_text: &mut dyn FnMut(&str) -> Control,
    ) -> Result<ChatReply> {
        let mut sampler = Sampler::new(params.sampling)?;
        // Reuse the cache when it holds a prefix of this prompt that ends between images.
        let held = self.held.remove(&conv).unwrap_or_default();
        let reuse = held.len() < prompt.ids.len()
            && prompt.ids.starts_with(&held)
            && prompt.first_image_after(held.len()).is_some();
        let (held, first_image) = if reuse {
            let first = prompt
                .first_image_after(held.len())
                .unwrap_or(prompt.images.len());
            (held, first)
        } else {
            self.model.text.release(conv);
            (Vec::new(), 0)
        };
        let new = &prompt.ids[held.len()..];
        let tiles = prompt.tiles(first_image);
        let tokenizer = self.prompter.tokenizer();
        let decode = |ids: &[u32]| tokenizer.decode(ids, true);
        let mut stream = TextStream::new(&params.stop);
        let mut text = String::new();
        let mut fail = None;
        let ctx = self.model.text.cache_shape().ctx;
        let mut stepper = Stepper {
            be: &self.be,
            model: &mut self.model,
            ctx,
            tiles: Some(tiles),
        };
        let result = generate(
            &mut stepper,
            SeqId(conv),
            &held,
            new,
            params.max_tokens,
            &self.eos,
            &mut sampler,
            &mut |t| match stream.push(t, &decode) {
                Ok(piece) => {
                    text.push_str(&piece);
                    let go = if piece.is_empty() {
                        Control::Continue
                    } else {
                        on_text(&piece)
                    };
                    if stream.stopped() { Control::Stop } else { go }
                }
                Err(e) => {
                    fail = Some(e);
                    Control::Stop
                }
            },
        );
        let (out, mut finish) = match result {
            Ok(r) => r,
            Err(e) => {
                self.model.text.release(conv);
                return Err(e);
            }
        };
        if let Some(e) = fail {
            self.model.text.release(conv);
            return Err(e);
        }
        let tail = stream.finish(&decode)?;
        if !tail.is_empty() {
            text.push_str(&tail);
            on_text(&tail);
        }
        if stream.stopped() {
            finish = Finish::Stopped;
        }
        // What the cache now holds: everything fed, i.e. all generated tokens but the last.
        let mut now = held.clone();
        now.extend_from_slice(new);
        now.extend_from_slice(&out[..out.len().saturating_sub(1)]);
        debug_assert_eq!(now.len(), self.model.text.held(conv));
        self.held.insert(conv, now);
        Ok(ChatReply {
            text,
            tokens: out.clone(),
            prompt_tokens: prompt.ids.len(),
            cached_tokens: held.len(),
            completion_tokens: out.len(),
            finish,
        })
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
                held: HashMap::new(),
            }))
        }
    }
    backend.run(Load(files.clone(), cfg.clone(), cache))
}
