//! The Qwen3 decoder stack, run to a chosen depth.
//!
//! Pipelines that condition on an intermediate hidden state (`hidden_states[k]` in transformers:
//! the residual stream after `k` layers, before the final norm) load and run only the first `k`
//! layers. Sequences are packed back to back with causal attention inside each, which gives each
//! real token exactly what the reference computes for the right-padded, masked batch.
//!
//! Qwen3-VL's language model reads images the same way ([`Media`]): their rows replace the
//! embeddings of their pad tokens, DeepStack features are added to those rows after the first
//! layers, and RoPE comes from a table with one row per token (the multimodal positions).

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Mask, QkvLayout, Residual, Role, RopeStyle, RopeTable,
    RowNorm, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::Qwen3Config;
use crate::blocks::rope::inv_freq;
use crate::blocks::{
    HF_ATTENTION, HF_MLP, LayerShape, PreNormLayer, Scratch, ScratchDims, SelfAttention,
};
use crate::loader::Loader;

/// Activations for a pass of up to `rows` tokens, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    ids: B::Buf,
    pos: B::Buf,
    /// Residual stream `[T, hidden]`.
    h: B::Buf,
    scratch: Scratch<B>,
    /// For passes with media: where their rows go, and `[T, hidden]` holding a DeepStack
    /// level's rows at those places, zeros elsewhere.
    media: Option<(B::Buf, B::Buf)>,
}

/// What a pass over a Qwen3-VL prompt with images adds to its tokens (one sequence).
pub struct Media<'a, B: Backend> {
    /// Token indices that take `embeds`' rows instead of their token embeddings, in order.
    pub rows: &'a [u32],
    /// `[rows.len(), hidden]`: the vision tower's merged features.
    pub embeds: View<'a, B>,
    /// `[rows.len(), hidden]` each: added to those rows after layer 0, 1, … (DeepStack).
    pub deepstack: &'a [View<'a, B>],
    /// RoPE angles with one row per token (row `i` for token `i`).
    pub rope: &'a RopeTable<B>,
}

pub struct Qwen3TextModel<B: Backend> {
    cfg: Qwen3Config,
    shape: LayerShape,
    embed: B::Table,
    layers: Vec<PreNormLayer<B>>,
    rope: Option<RopeTable<B>>,
    ws: Option<Workspace<B>>,
}

impl<B: Backend> Qwen3TextModel<B> {
    /// Load the embedding table and the first `depth` decoder layers from `w` (the tensors under
    /// the model's prefix: `model.` in causal-LM checkpoints, none in `Qwen3Model` ones), checking
    /// every shape. The final norm is never loaded: callers read pre-norm hidden states.
    pub fn load(be: &B, cfg: &Qwen3Config, w: &Weights, depth: usize) -> Result<Self> {
        if depth > cfg.num_layers {
            return Err(Error::input(format!(
                "cannot run {depth} layers of a {}-layer Qwen3 model",
                cfg.num_layers
            )));
        }
        let shape = LayerShape {
            layout: QkvLayout {
                heads_q: cfg.heads_q,
                heads_kv: cfg.heads_kv,
                head_dim: cfg.head_dim,
            },
            width: cfg.hidden_size,
            mlp: cfg.intermediate_size,
        };
        let l = Loader::new(be, w);
        let embed = l.table("embed_tokens.weight", &[cfg.vocab_size, cfg.hidden_size])?;
        let layers = (0..depth)
            .map(|i| {
                PreNormLayer::load(
                    &l.pp(format_args!("layers.{i}")),
                    &HF_ATTENTION,
                    &HF_MLP,
                    shape,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Qwen3TextModel {
            cfg: cfg.clone(),
            shape,
            embed,
            layers,
            rope: None,
            ws: None,
        })
    }

    pub fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    /// Number of layers loaded and run.
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    fn ensure(&mut self, be: &B, rows: usize, longest: usize) -> Result<()> {
        if self.rope.as_ref().is_none_or(|t| t.len < longest) {
            let len = longest
                .next_power_of_two()
                .clamp(longest, self.cfg.max_positions.max(longest));
            let inv = inv_freq(self.cfg.rope_theta, self.cfg.head_dim);
            self.rope = Some(RopeTable::new(be, &inv, len, RopeStyle::SplitHalf)?);
        }
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.ws = None;
        let s = self.shape;
        let dims = ScratchDims::new(s.width, s.layout, s.mlp);
        self.ws = Some(Workspace {
            rows,
            ids: be.alloc(rows, Role::Index)?,
            pos: be.alloc(rows, Role::Index)?,
            h: be.alloc(rows * s.width, Role::Stream)?,
            scratch: Scratch::alloc(be, rows, dims)?,
            media: None,
        });
        Ok(())
    }

    /// Run the loaded layers over packed token sequences (each attends causally to itself only)
    /// and return the residual stream after the last of them, `[Σ lens, hidden]`, sequences in
    /// order. The view stays valid until the next call.
    pub fn forward(&mut self, be: &B, seqs: &[&[u32]]) -> Result<View<'_, B>> {
        self.forward_media(be, seqs, None)
    }

    /// [`forward`](Self::forward) over one sequence with images ([`Media`]).
    pub fn forward_with_media(
        &mut self,
        be: &B,
        ids: &[u32],
        media: &Media<'_, B>,
    ) -> Result<View<'_, B>> {
        let (n, d) = (ids.len(), self.shape.width);
        let rows = media.rows.len();
        if media.rows.iter().any(|&r| r as usize >= n)
            || media.embeds.rows != rows
            || media.embeds.cols != d
            || media
                .deepstack
                .iter()
                .any(|v| v.rows != rows || v.cols != d)
        {
            return Err(Error::input(format!(
                "{rows} media rows of width {d} for {n} tokens: the features do not fit the prompt"
            )));
        }
        if media.deepstack.len() > self.layers.len() {
            return Err(Error::input(format!(
                "{} DeepStack levels for {} layers",
                media.deepstack.len(),
                self.layers.len()
            )));
        }
        if media.rope.len < n {
            return Err(Error::input(format!(
                "a RoPE table of {} rows for {n} tokens",
                media.rope.len
            )));
        }
        self.forward_media(be, &[ids], Some(media))
    }

    fn forward_media(
        &mut self,
        be: &B,
        seqs: &[&[u32]],
        media: Option<&Media<'_, B>>,
    ) -> Result<View<'_, B>> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let total: usize = lens.iter().sum();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if lens.is_empty() || lens.contains(&0) {
            return Err(Error::input(
                "the text encoder needs at least one token per sequence",
            ));
        }
        if longest > self.cfg.max_positions {
            return Err(Error::input(format!(
                "{longest} tokens exceed the text encoder's {} positions",
                self.cfg.max_positions
            )));
        }
        if let Some(&bad) = seqs
            .iter()
            .flat_map(|s| s.iter())
            .find(|&&id| id as usize >= self.cfg.vocab_size)
        {
            return Err(Error::input(format!(
                "token id {bad} is outside the text encoder's vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        self.ensure(be, total, longest)?;
        let segs = be.segments(&lens)?;
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        // With media, RoPE table rows are tokens (one sequence).
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        let (d, eps, t) = (self.shape.width, self.cfg.rms_norm_eps, total);
        let rope = match media {
            Some(m) => m.rope,
            None => self
                .rope
                .as_ref()
                .ok_or_else(|| Error::backend("qwen3", "rope table missing"))?,
        };
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("qwen3", "workspace missing"))?;
        if media.is_some() && ws.media.is_none() {
            ws.media = Some((
                be.alloc(ws.rows, Role::Index)?,
                be.alloc(ws.rows * d, Role::Stream)?,
            ));
        }
        be.write_u32(&mut ws.ids, &ids)?;
        be.write_u32(&mut ws.pos, &pos)?;
        let Workspace {
            ids,
            pos,
            h,
            scratch: s,
            media: media_ws,
            ..
        } = ws;
        be.embed(&self.embed, ids, 1.0, ViewMut::new(h, t, d))?;
        let mut media = match (media, media_ws.as_mut()) {
            (Some(m), Some((rows, ds))) => {
                be.write_u32(rows, m.rows)?;
                be.scatter_rows(m.embeds, rows, ViewMut::new(h, t, d))?;
                if !m.deepstack.is_empty() {
                    be.write_f32(ds, &vec![0.0; t * d])?;
                }
                Some((m, &*rows, ds))
            }
            _ => None,
        };
        if let Some(l0) = self.layers.first() {
            be.norm(
                View::new(h, t, d),
                &RowNorm::rms(&l0.input_norm, eps),
                ViewMut::new(&mut s.a, t, d),
            )?;
        }
        let layout = self.shape.layout;
        let scale = (layout.head_dim as f32).powf(-0.5);
        for (i, l) in self.layers.iter().enumerate() {
            let attn = SelfAttention {
                w: &l.attn,
                v_norm: false,
                eps,
                rope: Some((rope, &*pos)),
                spec: AttnSpec::new(layout, scale, Mask::Causal),
            };
            let next = self
                .layers
                .get(i + 1)
                .map(|n| RowNorm::rms(&n.input_norm, eps));
            let deepstack = media
                .as_ref()
                .and_then(|(m, _, _)| m.deepstack.get(i).copied());
            if let (Some(level), Some((_, rows, ds))) = (deepstack, media.as_mut()) {
                // h += the level's rows at the image tokens (zeros elsewhere), then the norm.
                l.forward(be, &attn, Activation::Silu, &segs, t, h, s, None)?;
                be.scatter_rows(level, rows, ViewMut::new(&mut **ds, t, d))?;
                let after = match next {
                    Some(n) => After::Norm(n, ViewMut::new(&mut s.a, t, d)),
                    None => After::Nothing,
                };
                be.residual(
                    ViewMut::new(h, t, d),
                    View::new(&**ds, t, d),
                    &Residual::plain(),
                    after,
                )?;
            } else {
                l.forward(be, &attn, Activation::Silu, &segs, t, h, s, next)?;
            }
        }
        Ok(View::new(h, t, d))
    }
}
