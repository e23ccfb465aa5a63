//! The LFM2 language model with a per-sequence cache: keys and values of its attention layers,
//! the rolling input state of its convolution layers.
//!
//! Reference: `Lfm2Model` / `Lfm2ForCausalLM` (transformers 5.25.0). Each layer is
//! `h += mixer(RMS_op(h))`, `h += SwiGLU(RMS_ffn(h))`, where the mixer is either
//! - a short convolution: `[b | c | x] = a · W_inᵀ`, `y = c ⊙ conv_k(b ⊙ x)` (causal, depthwise),
//!   then `y · W_outᵀ`; or
//! - grouped-query attention with per-head RMSNorm of q and k and split-half RoPE;
//!
//! then the final RMSNorm (`embedding_norm`) and logits through the tied embedding matrix.
//!
//! Sequences live in cache slots. A call extends any number of them at once — a prompt
//! (prefill) or one sampled token each (decoding), packed back to back — and returns logits of
//! each one's last row. A slot of `ctx` rows per attention layer holds the sequence's keys and
//! values (new rows are scattered in, then each segment attends over its own range, causally);
//! the convolution layers keep the last `kernel − 1` inputs per slot.

use std::collections::HashMap;

use tessera_backend::{
    Activation, After, AttnSpec, Backend, CacheWrite, ConvSeq, Epilogue, KvRanges, Mask, QkvLayout,
    QkvNorm, Residual, Role, RopeStyle, RopeTable, RowNorm, Segments, ShortConv, ThenResidual,
    View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::{LayerKind, TextConfig};
use crate::blocks::rope::inv_freq;
use crate::blocks::{
    AttentionWeights, AttnNames, MlpNames, MlpWeights, QkvNames, Scratch, ScratchDims,
};
use crate::loader::Loader;

const ATTENTION: AttnNames = AttnNames {
    qkv: QkvNames::Separate {
        q: "self_attn.q_proj.weight",
        k: "self_attn.k_proj.weight",
        v: "self_attn.v_proj.weight",
    },
    o: "self_attn.out_proj.weight",
    q_norm: "self_attn.q_layernorm.weight",
    k_norm: "self_attn.k_layernorm.weight",
};
const MLP: MlpNames = MlpNames {
    gate: "feed_forward.w1.weight",
    up: "feed_forward.w3.weight",
    down: "feed_forward.w2.weight",
};

pub use crate::chat_family::CacheShape;

struct Conv<B: Backend> {
    in_proj: B::Mat,
    in_bias: Option<B::Vector>,
    weight: B::Vector,
    bias: Option<B::Vector>,
    out_proj: B::Mat,
    out_bias: Option<B::Vector>,
    /// `[slots, (kernel − 1)·D]`.
    state: B::Buf,
    /// `[places, (kernel − 1)·D]`: states kept at positions the scheduler named, for prefixes
    /// that other requests continue (see [`Lfm2Text::keep_states`]).
    kept: Option<B::Buf>,
}

struct Attn<B: Backend> {
    w: AttentionWeights<B>,
    /// `[rows, kv cols]` each, `rows = slots·ctx`.
    k: B::Buf,
    v: B::Buf,
    rows: usize,
}

enum Mixer<B: Backend> {
    Conv(Conv<B>),
    Attn(Attn<B>),
}

struct Layer<B: Backend> {
    mixer: Mixer<B>,
    mlp: MlpWeights<B>,
    op_norm: B::Vector,
    ffn_norm: B::Vector,
}

/// Activations for up to `rows` packed rows in `segs` segments.
struct Workspace<B: Backend> {
    rows: usize,
    segs: usize,
    /// The packed segments and each one's key range in the cache, refilled per call at fixed
    /// addresses (a decode step replays as a graph).
    seg: Segments<B>,
    kv: KvRanges<B>,
    ids: B::Buf,
    pos: B::Buf,
    /// Cache row of each new row (`slot·ctx + position`).
    cache_rows: B::Buf,
    conv_seqs: B::Buf,
    /// Placeholder rows that media rows replace.
    media_rows: B::Buf,
    h: B::Buf,
    scratch: Scratch<B>,
    bcx: B::Buf,
    cy: B::Buf,
    /// Logits `[rows or segments, vocab]`.
    logits: B::Buf,
    /// One segment of `kernel − 1` rows, and a place entry per kept state, for keeping states
    /// (see [`KeepAt`]).
    keep_seg: Option<Segments<B>>,
    keep_seqs: Vec<B::Buf>,
}

/// A sequence's cache slot and the tokens it holds.
#[derive(Clone, Copy, Debug)]
struct Seq {
    slot: usize,
    held: usize,
}

/// A sequence's state to keep within a call: after the packed row `row` (exclusive), in place
/// `place` of each convolution layer's kept states.
#[derive(Clone, Copy, Debug)]
struct KeepAt {
    row: usize,
    place: usize,
}

/// One part of a call as it runs: its slot, its new tokens and media, the states it keeps.
struct Place<'a, B: Backend> {
    seq: Seq,
    tokens: &'a [u32],
    media: Option<(u32, View<'a, B>)>,
    keep: &'a [(usize, usize)],
}

/// One slot's part of a call (see [`Lfm2Text::extend_slots`]).
pub struct SlotExtend<'a, B: Backend> {
    pub slot: usize,
    /// Tokens the slot holds before the call.
    pub held: usize,
    pub tokens: &'a [u32],
    pub media: Option<(u32, View<'a, B>)>,
    /// `(n, place)`: keep the state after the slot's first `n` tokens in `place`.
    pub keep: &'a [(usize, usize)],
}

/// One sequence's part of a call: the tokens it appends, and optionally rows of embeddings
/// (image tokens) that replace its placeholder tokens in order.
pub struct Extend<'a, B: Backend> {
    pub seq: u64,
    pub tokens: &'a [u32],
    /// The token id whose rows `media` replaces, and the media rows.
    pub media: Option<(u32, View<'a, B>)>,
}

pub struct Lfm2Text<B: Backend> {
    cfg: TextConfig,
    layout: QkvLayout,
    embed: B::Table,
    lm_head: B::Mat,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    rope: RopeTable<B>,
    shape: CacheShape,
    seqs: HashMap<u64, Seq>,
    free: Vec<usize>,
    ws: Option<Workspace<B>>,
    /// Kept states per convolution layer (see [`Lfm2Text::keep_states`]).
    places: usize,
    restore_idx: Option<B::Buf>,
    /// Bumped whenever the workspace is reallocated: part of every replayed region's key.
    generation: u64,
}

fn optional_vector<B: Backend>(
    l: &Loader<'_, B>,
    name: &str,
    n: usize,
    on: bool,
) -> Result<Option<B::Vector>> {
    on.then(|| l.vector(name, n)).transpose()
}

/// Refuse a cache that cannot fit before any of it is allocated (an allocation that fails
/// aborts the process: `--max-sequences 1000000` asked for 500 GB): its bytes against what the
/// device says is available, or on the CPU the host's available memory. Returns the cache's
/// rows (`slots × ctx`).
fn check_cache_fits<B: Backend>(be: &B, cfg: &TextConfig, shape: CacheShape) -> Result<usize> {
    let too_large = |bytes: Option<usize>, available: Option<usize>| {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        Error::input(format!(
            "a cache of {} sequences × {} tokens needs {} of memory{}: use fewer sequences (--max-sequences) or a shorter context (--context)",
            shape.slots,
            shape.ctx,
            bytes.map_or_else(
                || "more bytes than can be counted".into(),
                |b| format!("{:.1} GiB", gib(b))
            ),
            available.map_or_else(String::new, |a| format!(
                " and {:.1} GiB are available",
                gib(a)
            ))
        ))
    };
    let rows = shape
        .slots
        .checked_mul(shape.ctx)
        .ok_or_else(|| too_large(None, None))?;
    let attention = cfg
        .layers
        .iter()
        .filter(|l| matches!(l, LayerKind::Attention))
        .count();
    let convs = cfg.layers.len() - attention;
    let kv_cols = cfg.heads_kv * cfg.head_dim;
    let kv = rows
        .checked_mul(kv_cols)
        .and_then(|n| n.checked_mul(2 * attention))
        .and_then(|n| n.checked_mul(be.element_bytes(Role::Compute)));
    let conv = shape
        .slots
        .checked_mul(cfg.conv_kernel.saturating_sub(1) * cfg.hidden)
        .and_then(|n| n.checked_mul(convs))
        .and_then(|n| n.checked_mul(be.element_bytes(Role::Stream)));
    let bytes = kv
        .zip(conv)
        .and_then(|(a, b)| a.checked_add(b))
        .ok_or_else(|| too_large(None, None))?;
    let available = match be.memory_available()? {
        Some(a) => Some(a),
        None => tessera_backend::host_memory_available(),
    };
    match available {
        Some(a) if bytes > a => Err(too_large(Some(bytes), Some(a))),
        _ => Ok(rows),
    }
}

impl<B: Backend> Lfm2Text<B> {
    /// Load the language model (under `model.language_model.`, or `language_model.model.` in
    /// older files) with a cache of `shape`, checking every tensor's shape.
    pub fn load(be: &B, cfg: &TextConfig, w: &Weights, shape: CacheShape) -> Result<Self> {
        if shape.slots == 0 || shape.ctx == 0 {
            return Err(Error::input(
                "the cache needs at least one slot of one token",
            ));
        }
        let root = Loader::new(be, w);
        let l = if root.has("model.language_model.embedding_norm.weight") {
            root.pp("model.language_model")
        } else {
            root.pp("language_model.model")
        };
        let (d, k) = (cfg.hidden, cfg.conv_kernel);
        let layout = QkvLayout {
            heads_q: cfg.heads_q,
            heads_kv: cfg.heads_kv,
            head_dim: cfg.head_dim,
        };
        let rows = check_cache_fits(be, cfg, shape)?;
        let layers = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                let ll = l.pp(format_args!("layers.{i}"));
                let mixer = match kind {
                    LayerKind::Conv => {
                        let c = ll.pp("conv");
                        let taps = c.tensor("conv.weight", &[d, 1, k])?.to_f32();
                        let mut state = be.alloc(shape.slots * (k - 1) * d, Role::Stream)?;
                        be.write_f32(&mut state, &vec![0.0; shape.slots * (k - 1) * d])?;
                        Mixer::Conv(Conv {
                            in_proj: c.matrix("in_proj.weight", 3 * d, d)?,
                            in_bias: optional_vector(&c, "in_proj.bias", 3 * d, cfg.conv_bias)?,
                            weight: be.vector_f32(&taps)?,
                            bias: optional_vector(&c, "conv.bias", d, cfg.conv_bias)?,
                            out_proj: c.matrix("out_proj.weight", d, d)?,
                            out_bias: optional_vector(&c, "out_proj.bias", d, cfg.conv_bias)?,
                            state,
                            kept: None,
                        })
                    }
                    LayerKind::Attention => Mixer::Attn(Attn {
                        w: AttentionWeights::load(&ll, &ATTENTION, layout, d)?,
                        k: be.alloc(rows * layout.kv_cols(), Role::Compute)?,
                        v: be.alloc(rows * layout.kv_cols(), Role::Compute)?,
                        rows,
                    }),
                };
                Ok(Layer {
                    mixer,
                    mlp: MlpWeights::load(&ll, &MLP, d, cfg.ffn)?,
                    op_norm: ll.vector("operator_norm.weight", d)?,
                    ffn_norm: ll.vector("ffn_norm.weight", d)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let inv = inv_freq(cfg.rope_theta, cfg.head_dim);
        Ok(Lfm2Text {
            cfg: cfg.clone(),
            layout,
            embed: l.table("embed_tokens.weight", &[cfg.vocab, d])?,
            lm_head: l.matrix("embed_tokens.weight", cfg.vocab, d)?,
            layers,
            final_norm: l.vector("embedding_norm.weight", d)?,
            rope: RopeTable::new(be, &inv, shape.ctx, RopeStyle::SplitHalf)?,
            shape,
            seqs: HashMap::new(),
            free: (0..shape.slots).rev().collect(),
            ws: None,
            places: 0,
            restore_idx: None,
            generation: 0,
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    pub fn cache_shape(&self) -> CacheShape {
        self.shape
    }

    /// Tokens `seq` holds (0 for an unknown sequence).
    pub fn held(&self, seq: u64) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.held)
    }

    /// Free `seq`'s slot.
    pub fn release(&mut self, seq: u64) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.free.push(s.slot);
        }
    }

    /// Room for `places` kept convolution states per layer (replacing any kept before), for
    /// the `keep` of [`SlotExtend`] and [`restore`](Self::restore).
    pub fn keep_states(&mut self, be: &B, places: usize) -> Result<()> {
        let len = (self.cfg.conv_kernel - 1) * self.cfg.hidden;
        let convs = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Conv(_)))
            .count();
        // Refused before anything is allocated, as the cache itself is.
        let bytes = places
            .checked_mul(len)
            .and_then(|n| n.checked_mul(convs))
            .and_then(|n| n.checked_mul(be.element_bytes(Role::Stream)));
        let available = match be.memory_available()? {
            Some(a) => Some(a),
            None => tessera_backend::host_memory_available(),
        };
        if bytes.is_none_or(|b| available.is_some_and(|a| b > a)) {
            return Err(Error::input(format!(
                "keeping {places} convolution states for the prefix cache needs {} bytes of memory and {} are available: use fewer sequences (--max-sequences) or a shorter context (--context)",
                bytes.map_or_else(|| "more".into(), |b| b.to_string()),
                available.map_or_else(|| "fewer".into(), |a| a.to_string())
            )));
        }
        for l in &mut self.layers {
            if let Mixer::Conv(cv) = &mut l.mixer {
                cv.kept = None;
                if places > 0 && len > 0 {
                    let mut kept = be.alloc(places * len, Role::Stream)?;
                    be.write_f32(&mut kept, &vec![0.0; places * len])?;
                    cv.kept = Some(kept);
                }
            }
        }
        self.places = places;
        Ok(())
    }

    /// Places for kept states.
    pub fn kept_places(&self) -> usize {
        self.places
    }

    /// The fewest new rows before a position whose state can be kept: the convolution's
    /// `kernel − 1` inputs.
    pub fn keep_window(&self) -> usize {
        self.cfg.conv_kernel.saturating_sub(1).max(1)
    }

    /// Copy the keys and values of slot `from`'s first `n` positions into slot `to`, through a
    /// scratch buffer per layer (source and destination are rows of one buffer). The
    /// convolution states are not copied: the caller restores `to`'s from a place kept at `n`.
    pub fn copy_prefix(&mut self, be: &B, from: usize, to: usize, n: usize) -> Result<()> {
        let (slots, ctx) = (self.shape.slots, self.shape.ctx);
        if from >= slots || to >= slots || from == to || n > ctx {
            return Err(Error::input(format!(
                "copy of {n} positions from slot {from} to slot {to} of {slots} (context {ctx})"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let cols = self.layout.kv_cols();
        let mut tmp = be.alloc(n * cols, Role::Compute)?;
        for l in &mut self.layers {
            if let Mixer::Attn(at) = &mut l.mixer {
                for cache in [&mut at.k, &mut at.v] {
                    // Same element type both ways: `cast` copies the rows exactly.
                    be.cast(
                        View::new(cache, at.rows, cols).rows(from * ctx, n),
                        ViewMut::new(&mut tmp, n, cols),
                    )?;
                    be.cast(
                        View::new(&tmp, n, cols),
                        ViewMut::new(cache, at.rows, cols).rows(to * ctx, n),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Make `slot`'s convolution states the ones kept in `place`.
    pub fn restore(&mut self, be: &B, slot: usize, place: usize) -> Result<()> {
        if slot >= self.shape.slots || place >= self.places {
            return Err(Error::input(format!(
                "slot {slot} of {} or kept state {place} of {}",
                self.shape.slots, self.places
            )));
        }
        let len = (self.cfg.conv_kernel - 1) * self.cfg.hidden;
        if len == 0 {
            return Ok(());
        }
        let idx = match &mut self.restore_idx {
            Some(b) => b,
            None => self.restore_idx.insert(be.alloc(1, Role::Index)?),
        };
        be.write_u32(idx, &[slot as u32])?;
        let (slots, places) = (self.shape.slots, self.places);
        for l in &mut self.layers {
            if let Mixer::Conv(cv) = &mut l.mixer {
                let kept = cv
                    .kept
                    .as_ref()
                    .ok_or_else(|| Error::backend("lfm2", "no kept states"))?;
                be.scatter_rows(
                    View::new(kept, places, len).rows(place, 1),
                    idx,
                    ViewMut::new(&mut cv.state, slots, len),
                )?;
            }
        }
        Ok(())
    }

    /// Append each part's tokens to its slot, which holds `held` tokens (the caller keeps track
    /// of slots; do not mix with [`extend`](Self::extend)), keeping the states each part names,
    /// and return the logits of each part's last row, `[parts, vocab]`.
    pub fn extend_slots(&mut self, be: &B, parts: &[SlotExtend<'_, B>]) -> Result<View<'_, B>> {
        let vocab = self.cfg.vocab;
        self.check_tokens(parts.iter().map(|p| p.tokens))?;
        let window = self.keep_window();
        for (i, p) in parts.iter().enumerate() {
            if p.slot >= self.shape.slots || parts[..i].iter().any(|q| q.slot == p.slot) {
                return Err(Error::input(format!(
                    "slot {} of {}, or a slot twice in one call",
                    p.slot, self.shape.slots
                )));
            }
            if p.held + p.tokens.len() > self.shape.ctx {
                return Err(Error::input(format!(
                    "the sequence would hold {} tokens; the cache holds {} per sequence",
                    p.held + p.tokens.len(),
                    self.shape.ctx
                )));
            }
            if let Some(&(n, place)) = p.keep.iter().find(|&&(n, place)| {
                n < p.held + window || n > p.held + p.tokens.len() || place >= self.places
            }) {
                return Err(Error::input(format!(
                    "a state kept after {n} tokens in place {place} of {} (the slot holds {} and takes {})",
                    self.places,
                    p.held,
                    p.tokens.len()
                )));
            }
        }
        let places: Vec<Place<'_, B>> = parts
            .iter()
            .map(|p| Place {
                seq: Seq {
                    slot: p.slot,
                    held: p.held,
                },
                tokens: p.tokens,
                media: p.media,
                keep: p.keep,
            })
            .collect();
        self.run(be, &places, false)?;
        let ws = self
            .ws
            .as_ref()
            .ok_or_else(|| Error::backend("lfm2", "workspace missing"))?;
        Ok(View::new(&ws.logits, parts.len(), vocab))
    }

    fn check_tokens<'t>(&self, mut tokens: impl Iterator<Item = &'t [u32]>) -> Result<()> {
        let vocab = self.cfg.vocab;
        let mut any = false;
        for t in tokens.by_ref() {
            any = true;
            if t.is_empty() {
                return Err(Error::input("every sequence needs at least one new token"));
            }
            if let Some(&bad) = t.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::input(format!(
                    "token id {bad} is outside the model's vocabulary of {vocab}"
                )));
            }
        }
        if !any {
            return Err(Error::input("every sequence needs at least one new token"));
        }
        Ok(())
    }

    fn ensure(&mut self, be: &B, rows: usize, segs: usize, logit_rows: usize) -> Result<()> {
        if self
            .ws
            .as_ref()
            .is_some_and(|w| w.rows >= rows && w.segs >= segs.max(logit_rows))
        {
            return Ok(());
        }
        self.ws = None;
        let (rows, segs) = (rows.max(1), segs.max(logit_rows).max(1));
        let c = &self.cfg;
        let d = c.hidden;
        let dims = ScratchDims::new(d, self.layout, c.ffn);
        self.generation = crate::blocks::workspace_generation();
        self.ws = Some(Workspace {
            rows,
            segs,
            seg: be.alloc_segments(rows, segs)?,
            kv: be.kv_ranges(&vec![(0, 0); segs])?,
            ids: be.alloc(rows, Role::Index)?,
            pos: be.alloc(rows, Role::Index)?,
            cache_rows: be.alloc(rows, Role::Index)?,
            conv_seqs: be.alloc(2 * segs, Role::Index)?,
            media_rows: be.alloc(rows, Role::Index)?,
            h: be.alloc(rows * d, Role::Stream)?,
            scratch: Scratch::alloc(be, rows, dims)?,
            bcx: be.alloc(rows * 3 * d, Role::Compute)?,
            cy: be.alloc(rows * d, Role::Compute)?,
            logits: be.alloc(segs * c.vocab, Role::Stream)?,
            keep_seg: None,
            keep_seqs: Vec::new(),
        });
        Ok(())
    }

    /// Append each part's tokens to its sequence (a new sequence takes a free slot) and return
    /// the logits of each part's last row, `[parts, vocab]`; with `all_rows`, of every row,
    /// `[Σ tokens, vocab]` (checking a prompt against the reference).
    pub fn extend(
        &mut self,
        be: &B,
        parts: &[Extend<'_, B>],
        all_rows: bool,
    ) -> Result<View<'_, B>> {
        let vocab = self.cfg.vocab;
        self.check_tokens(parts.iter().map(|p| p.tokens))?;
        // Places: existing sequences keep theirs; new ones take free slots.
        let mut seqs = Vec::with_capacity(parts.len());
        let mut taken = Vec::new();
        for p in parts {
            let s = match self.seqs.get(&p.seq) {
                Some(&s) => s,
                None => {
                    if seqs.iter().any(|(id, _): &(u64, Seq)| *id == p.seq) {
                        return Err(Error::input("a sequence appears twice in one call"));
                    }
                    let slot = self.free.pop().ok_or_else(|| {
                        Error::input(format!(
                            "all {} cache slots are in use; finish or release a sequence first",
                            self.shape.slots
                        ))
                    })?;
                    taken.push(slot);
                    Seq { slot, held: 0 }
                }
            };
            if s.held + p.tokens.len() > self.shape.ctx {
                self.free.append(&mut taken);
                return Err(Error::input(format!(
                    "the sequence would hold {} tokens; the cache holds {} per sequence",
                    s.held + p.tokens.len(),
                    self.shape.ctx
                )));
            }
            seqs.push((p.seq, s));
        }
        let places: Vec<Place<'_, B>> = parts
            .iter()
            .zip(&seqs)
            .map(|(p, (_, s))| Place {
                seq: *s,
                tokens: p.tokens,
                media: p.media,
                keep: &[],
            })
            .collect();
        if let Err(e) = self.run(be, &places, all_rows) {
            self.free.extend(taken);
            return Err(e);
        }
        for (p, (id, s)) in parts.iter().zip(&seqs) {
            self.seqs.insert(
                *id,
                Seq {
                    slot: s.slot,
                    held: s.held + p.tokens.len(),
                },
            );
        }
        let n = if all_rows {
            parts.iter().map(|p| p.tokens.len()).sum()
        } else {
            parts.len()
        };
        let ws = self
            .ws
            .as_ref()
            .ok_or_else(|| Error::backend("lfm2", "workspace missing"))?;
        Ok(View::new(&ws.logits, n, vocab))
    }

    fn run(&mut self, be: &B, parts: &[Place<'_, B>], all_rows: bool) -> Result<()> {
        let lens: Vec<usize> = parts.iter().map(|p| p.tokens.len()).collect();
        let n: usize = lens.iter().sum();
        let logit_rows = if all_rows { n } else { parts.len() };
        self.ensure(be, n, parts.len(), logit_rows)?;
        let c = &self.cfg;
        let (d, ctx) = (c.hidden, self.shape.ctx);
        let mut ids = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        let mut cache_rows = Vec::with_capacity(n);
        let mut ranges = Vec::with_capacity(parts.len());
        let mut conv = Vec::with_capacity(parts.len());
        let mut media_rows = Vec::new();
        let mut keep = Vec::new();
        for p in parts {
            let s = p.seq;
            let base = ids.len();
            keep.extend(p.keep.iter().map(|&(at, place)| KeepAt {
                row: base + at - s.held,
                place,
            }));
            ids.extend_from_slice(p.tokens);
            pos.extend((s.held..s.held + p.tokens.len()).map(|x| x as u32));
            cache_rows.extend((s.held..s.held + p.tokens.len()).map(|x| (s.slot * ctx + x) as u32));
            ranges.push((s.slot * ctx, s.held + p.tokens.len()));
            conv.push(ConvSeq {
                slot: s.slot as u32,
                held: s.held as u32,
            });
            if let Some((token, rows)) = &p.media {
                let at: Vec<u32> = p
                    .tokens
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| *t == token)
                    .map(|(i, _)| (base + i) as u32)
                    .collect();
                if at.len() != rows.rows || rows.cols != d {
                    return Err(Error::input(format!(
                        "{} image tokens in the prompt for {} image rows of width {} (model width {d})",
                        at.len(),
                        rows.rows,
                        rows.cols
                    )));
                }
                media_rows.push((at, *rows));
            }
        }
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("lfm2", "workspace missing"))?;
        be.set_segments(&mut ws.seg, &lens)?;
        let flat: Vec<u32> = ranges
            .iter()
            .flat_map(|&(a, n)| [a as u32, n as u32])
            .collect();
        be.write_u32(&mut ws.kv.dev, &flat)?;
        ws.kv.ranges = ranges.iter().map(|&(a, n)| (a as u32, n as u32)).collect();
        be.write_u32(&mut ws.ids, &ids)?;
        be.write_u32(&mut ws.pos, &pos)?;
        be.write_u32(&mut ws.cache_rows, &cache_rows)?;
        be.write_u32(&mut ws.conv_seqs, &ConvSeq::pack(&conv))?;
        be.embed(&self.embed, &ws.ids, 1.0, ViewMut::new(&mut ws.h, n, d))?;
        for (at, rows) in &media_rows {
            be.write_u32(&mut ws.media_rows, at)?;
            be.scatter_rows(*rows, &ws.media_rows, ViewMut::new(&mut ws.h, n, d))?;
        }
        if !keep.is_empty() {
            let window = c.conv_kernel.saturating_sub(1).max(1);
            if ws.keep_seg.is_none() {
                let mut seg = be.alloc_segments(window, 1)?;
                be.set_segments(&mut seg, &[window])?;
                ws.keep_seg = Some(seg);
            }
            while ws.keep_seqs.len() < keep.len() {
                ws.keep_seqs.push(be.alloc(2, Role::Index)?);
            }
            for (k, buf) in keep.iter().zip(&mut ws.keep_seqs) {
                be.write_u32(
                    buf,
                    &ConvSeq::pack(&[ConvSeq {
                        slot: k.place as u32,
                        held: 0,
                    }]),
                )?;
            }
        }
        let pass = Pass {
            rows: n,
            lens: &lens,
            // Prompts that start their sequences attend to their own rows (the flash kernels);
            // a call with a continuing sequence attends over the cache's ranges.
            fresh: parts.iter().all(|p| p.seq.held == 0),
            all_rows,
            keep: &keep,
        };
        let mut body = Body {
            cfg: c,
            layers: &mut self.layers,
            rope: &self.rope,
            final_norm: &self.final_norm,
            lm_head: &self.lm_head,
        };
        // A decode step (one new token per sequence) is the same work every time at the same
        // addresses: one replayable region, which the CUDA backend captures as a graph.
        if lens.iter().all(|&l| l == 1)
            && media_rows.is_empty()
            && keep.is_empty()
            && !pass.fresh
            && !all_rows
        {
            let key = {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                ("lfm2 decode", self.generation, n).hash(&mut h);
                h.finish()
            };
            be.run_graph(key, &mut || body.run(be, ws, &pass))
        } else {
            body.run(be, ws, &pass)
        }
    }
}

/// The new rows of a call: how many, their positions, their rows in the cache, their segments.
struct Rows<'a, B: Backend> {
    n: usize,
    pos: &'a B::Buf,
    cache: &'a B::Buf,
    seg: &'a Segments<B>,
}

/// The shape of one call's forward.
struct Pass<'a> {
    rows: usize,
    lens: &'a [usize],
    fresh: bool,
    all_rows: bool,
    keep: &'a [KeepAt],
}

/// What the layers and the logits read besides the workspace.
struct Body<'a, B: Backend> {
    cfg: &'a TextConfig,
    layers: &'a mut [Layer<B>],
    rope: &'a RopeTable<B>,
    final_norm: &'a B::Vector,
    lm_head: &'a B::Mat,
}

impl<B: Backend> Body<'_, B> {
    /// Every device op after the embedding: the layers, the final norm and the logits.
    fn run(&mut self, be: &B, ws: &mut Workspace<B>, pass: &Pass<'_>) -> Result<()> {
        let c = self.cfg;
        let (d, eps, n) = (c.hidden, c.eps, pass.rows);
        let lay = QkvLayout {
            heads_q: c.heads_q,
            heads_kv: c.heads_kv,
            head_dim: c.head_dim,
        };
        let first = self.layers.first().map_or(self.final_norm, |l| &l.op_norm);
        be.norm(
            View::new(&ws.h, n, d),
            &RowNorm::rms(first, eps),
            ViewMut::new(&mut ws.scratch.a, n, d),
        )?;
        let causal = AttnSpec::new(lay, (lay.head_dim as f32).powf(-0.5), Mask::Causal);
        let n_layers = self.layers.len();
        for i in 0..n_layers {
            let (layer, rest) = self.layers[i..]
                .split_first_mut()
                .ok_or_else(|| Error::backend("lfm2", "layer"))?;
            // Each half ends in `h += y; a = next norm(h)`, handed to its last product.
            let ffn = RowNorm::rms(&layer.ffn_norm, eps);
            match &mut layer.mixer {
                Mixer::Conv(cv) => {
                    conv_mixer(be, cv, c, n, ws, ffn)?;
                    keep_states(be, cv, c, pass.keep, ws)?;
                }
                Mixer::Attn(at) => {
                    let Workspace {
                        scratch,
                        pos,
                        cache_rows,
                        seg,
                        kv,
                        h,
                        ..
                    } = &mut *ws;
                    let spec = if pass.fresh { causal } else { causal.over(kv) };
                    let rows = Rows {
                        n,
                        pos,
                        cache: cache_rows,
                        seg,
                    };
                    let h = ViewMut::new(h, n, d);
                    attn_mixer(be, at, c, self.rope, &spec, &rows, scratch, h, ffn)?
                }
            }
            let next = match rest.first() {
                Some(nx) => RowNorm::rms(&nx.op_norm, eps),
                None => RowNorm::rms(self.final_norm, eps),
            };
            let (h, s) = (&mut ws.h, &mut ws.scratch);
            layer.mlp.forward_residual(
                be,
                Activation::Silu,
                n,
                s,
                ViewMut::new(h, n, d),
                Residual::plain(),
                next,
            )?;
        }
        // Logits of every row, or of each segment's last row.
        let vocab = c.vocab;
        let normed = View::new(&ws.scratch.a, n, d);
        if pass.all_rows || pass.lens.iter().all(|&l| l == 1) {
            be.matmul(
                normed,
                self.lm_head,
                ViewMut::new(&mut ws.logits, n, vocab),
                &Epilogue::default(),
            )
        } else {
            let mut end = 0;
            for (s, &l) in pass.lens.iter().enumerate() {
                end += l;
                be.matmul(
                    normed.rows(end - 1, 1),
                    self.lm_head,
                    ViewMut::new(&mut ws.logits, pass.lens.len(), vocab).rows(s, 1),
                    &Epilogue::default(),
                )?;
            }
            Ok(())
        }
    }
}

/// `h += conv mixer(s.a)`, each segment continuing from its slot's state, then `s.a = ffn(h)`.
fn conv_mixer<B: Backend>(
    be: &B,
    cv: &mut Conv<B>,
    c: &TextConfig,
    n: usize,
    ws: &mut Workspace<B>,
    ffn: RowNorm<'_, B>,
) -> Result<()> {
    let d = c.hidden;
    fn ep<B: Backend>(b: &Option<B::Vector>) -> Epilogue<'_, B> {
        match b {
            Some(b) => Epilogue::bias(b),
            None => Epilogue::default(),
        }
    }
    be.matmul(
        View::new(&ws.scratch.a, n, d),
        &cv.in_proj,
        ViewMut::new(&mut ws.bcx, n, 3 * d),
        &ep(&cv.in_bias),
    )?;
    let op = ShortConv {
        channels: d,
        kernel: c.conv_kernel,
        weight: &cv.weight,
        bias: cv.bias.as_ref(),
        seqs: &ws.conv_seqs,
    };
    be.short_conv(
        View::new(&ws.bcx, n, 3 * d),
        &op,
        &ws.seg,
        &mut cv.state,
        ViewMut::new(&mut ws.cy, n, d),
    )?;
    let s = &mut ws.scratch;
    be.matmul_residual(
        View::new(&ws.cy, n, d),
        &cv.out_proj,
        ViewMut::new(&mut s.y, n, d),
        &ep(&cv.out_bias),
        ThenResidual {
            h: ViewMut::new(&mut ws.h, n, d),
            res: Residual::plain(),
            after: After::Norm(ffn, ViewMut::new(&mut s.a, n, d)),
        },
    )
}

/// Keep the convolution's state after each of `keep`'s rows: its last `kernel − 1` inputs
/// `b ⊙ x`, which a zero-state convolution over those rows leaves in the kept place as the
/// running one left them in the slot (`cy` is free once the mixer's output is projected).
fn keep_states<B: Backend>(
    be: &B,
    cv: &mut Conv<B>,
    c: &TextConfig,
    keep: &[KeepAt],
    ws: &mut Workspace<B>,
) -> Result<()> {
    if keep.is_empty() {
        return Ok(());
    }
    let (d, window) = (c.hidden, c.conv_kernel.saturating_sub(1));
    let (Some(kept), Some(seg)) = (cv.kept.as_mut(), ws.keep_seg.as_ref()) else {
        return Err(Error::backend("lfm2", "no room for kept states"));
    };
    for (k, seqs) in keep.iter().zip(&ws.keep_seqs) {
        let op = ShortConv {
            channels: d,
            kernel: c.conv_kernel,
            weight: &cv.weight,
            bias: cv.bias.as_ref(),
            seqs,
        };
        be.short_conv(
            View::new(&ws.bcx, ws.rows, 3 * d).rows(k.row - window, window),
            &op,
            seg,
            kept,
            ViewMut::new(&mut ws.cy, ws.rows, d).rows(0, window),
        )?;
    }
    Ok(())
}

/// `h += attention mixer(s.a)`: q|k|v, per-head norms and RoPE, the new keys and values into
/// the cache, attention over each segment's cached range, the output projection; then
/// `s.a = ffn(h)`.
#[allow(clippy::too_many_arguments)]
fn attn_mixer<B: Backend>(
    be: &B,
    at: &mut Attn<B>,
    c: &TextConfig,
    rope: &RopeTable<B>,
    spec: &AttnSpec<'_, B>,
    rows: &Rows<'_, B>,
    s: &mut Scratch<B>,
    h: ViewMut<'_, B>,
    ffn: RowNorm<'_, B>,
) -> Result<()> {
    let lay = at.w.layout;
    let n = rows.n;
    let (d, qc, kc, width) = (c.hidden, lay.q_cols(), lay.kv_cols(), lay.width());
    be.matmul(
        View::new(&s.a, n, d),
        &at.w.qkv,
        ViewMut::new(&mut s.qkv, n, width),
        &Epilogue::default(),
    )?;
    let cache_len = at.rows;
    be.qkv_norm_rope_cached(
        ViewMut::new(&mut s.qkv, n, width),
        &QkvNorm {
            layout: lay,
            qk_norm: true,
            q_weight: Some(&at.w.q_norm),
            k_weight: Some(&at.w.k_norm),
            v_norm: false,
            eps: c.eps,
        },
        Some((rope, rows.pos)),
        CacheWrite {
            rows: rows.cache,
            k: ViewMut::new(&mut at.k, cache_len, kc),
            v: ViewMut::new(&mut at.v, cache_len, kc),
        },
    )?;
    let qkv = View::new(&s.qkv, n, width);
    let (k, v) = match spec.kv {
        Some(_) => (
            View::new(&at.k, cache_len, kc),
            View::new(&at.v, cache_len, kc),
        ),
        None => (qkv.cols(qc, kc), qkv.cols(qc + kc, kc)),
    };
    be.attention(
        qkv.cols(0, qc),
        k,
        v,
        ViewMut::new(&mut s.attn, n, qc),
        spec,
        rows.seg,
    )?;
    be.matmul_residual(
        View::new(&s.attn, n, qc),
        &at.w.o,
        ViewMut::new(&mut s.y, n, d),
        &Epilogue::default(),
        ThenResidual {
            h,
            res: Residual::plain(),
            after: After::Norm(ffn, ViewMut::new(&mut s.a, n, d)),
        },
    )
}
