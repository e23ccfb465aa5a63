//! The Qwen3 decoder stack, run to a chosen depth.
//!
//! Pipelines that condition on an intermediate hidden state (`hidden_states[k]` in transformers:
//! the residual stream after `k` layers, before the final norm) load and run only the first `k`
//! layers. Sequences are packed back to back with causal attention inside each, which gives each
//! real token exactly what the reference computes for the right-padded, masked batch.

use tessera_backend::{
    Activation, AttnSpec, Backend, Mask, QkvLayout, Role, RopeStyle, RopeTable, RowNorm, View,
    ViewMut,
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
        });
        Ok(())
    }

    /// Run the loaded layers over packed token sequences (each attends causally to itself only)
    /// and return the residual stream after the last of them, `[Σ lens, hidden]`, sequences in
    /// order. The view stays valid until the next call.
    pub fn forward(&mut self, be: &B, seqs: &[&[u32]]) -> Result<View<'_, B>> {
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
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        let (d, eps, t) = (self.shape.width, self.cfg.rms_norm_eps, total);
        let rope = self
            .rope
            .as_ref()
            .ok_or_else(|| Error::backend("qwen3", "rope table missing"))?;
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("qwen3", "workspace missing"))?;
        be.write_u32(&mut ws.ids, &ids)?;
        be.write_u32(&mut ws.pos, &pos)?;
        let Workspace {
            ids,
            pos,
            h,
            scratch: s,
            ..
        } = ws;
        be.embed(&self.embed, ids, 1.0, ViewMut::new(h, t, d))?;
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
            l.forward(be, &attn, Activation::Silu, &segs, t, h, s, next)?;
        }
        Ok(View::new(h, t, d))
    }
}
