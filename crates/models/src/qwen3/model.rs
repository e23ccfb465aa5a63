//! The Qwen3 decoder stack, run to a chosen depth.
//!
//! Pipelines that condition on an intermediate hidden state (`hidden_states[k]` in transformers:
//! the residual stream after `k` layers, before the final norm) load and run only the first `k`
//! layers. Sequences are packed back to back with causal attention inside each, which gives each
//! real token exactly what the reference computes for the right-padded, masked batch.

use tessera_backend::{
    Activation, AttnSpec, Backend, QkvLayout, Residual, Role, RopeStyle, RopeTable, RowNorm, View,
    ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::Qwen3Config;
use crate::blocks::{GatedMlp, SelfAttention};
use crate::egemma2::text::default_inv_freq;

struct Layer<B: Backend> {
    /// `q_proj | k_proj | v_proj` stacked.
    qkv: B::Mat,
    q_norm: B::Vector,
    k_norm: B::Vector,
    o: B::Mat,
    input_norm: B::Vector,
    post_attn_norm: B::Vector,
    /// `gate_proj | up_proj` stacked.
    gate_up: B::Mat,
    down: B::Mat,
}

/// Activations for a pass of up to `rows` tokens, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    ids: B::Buf,
    pos: B::Buf,
    /// Residual stream `[T, hidden]`.
    h: B::Buf,
    /// Normed input of the current sub-block `[T, hidden]`.
    a: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    y: B::Buf,
    gu: B::Buf,
    g: B::Buf,
}

pub struct Qwen3TextModel<B: Backend> {
    cfg: Qwen3Config,
    layout: QkvLayout,
    embed: B::Table,
    layers: Vec<Layer<B>>,
    rope: Option<RopeTable<B>>,
    ws: Option<Workspace<B>>,
}

fn vector<B: Backend>(be: &B, w: &Weights, name: &str, n: usize) -> Result<B::Vector> {
    be.vector(&w.f32(name, &[n])?)
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
        let h = cfg.hidden_size;
        let layout = QkvLayout {
            heads_q: cfg.heads_q,
            heads_kv: cfg.heads_kv,
            head_dim: cfg.head_dim,
        };
        let (qc, kc, im) = (layout.q_cols(), layout.kv_cols(), cfg.intermediate_size);
        let embed = be.table(w, "embed_tokens.weight", [cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(depth);
        for i in 0..depth {
            let lw = w.pp(format!("layers.{i}"));
            let q = lw.f32("self_attn.q_proj.weight", &[qc, h])?;
            let k = lw.f32("self_attn.k_proj.weight", &[kc, h])?;
            let v = lw.f32("self_attn.v_proj.weight", &[kc, h])?;
            let gate = lw.f32("mlp.gate_proj.weight", &[im, h])?;
            let up = lw.f32("mlp.up_proj.weight", &[im, h])?;
            layers.push(Layer {
                qkv: be.matrix(&[(&q, qc), (&k, kc), (&v, kc)], h)?,
                q_norm: vector(be, &lw, "self_attn.q_norm.weight", cfg.head_dim)?,
                k_norm: vector(be, &lw, "self_attn.k_norm.weight", cfg.head_dim)?,
                o: be.matrix(&[(&lw.f32("self_attn.o_proj.weight", &[h, qc])?, h)], qc)?,
                input_norm: vector(be, &lw, "input_layernorm.weight", h)?,
                post_attn_norm: vector(be, &lw, "post_attention_layernorm.weight", h)?,
                gate_up: be.matrix(&[(&gate, im), (&up, im)], h)?,
                down: be.matrix(&[(&lw.f32("mlp.down_proj.weight", &[h, im])?, h)], im)?,
            });
        }
        Ok(Qwen3TextModel {
            cfg: cfg.clone(),
            layout,
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
            let inv = default_inv_freq(self.cfg.rope_theta, self.cfg.head_dim);
            self.rope = Some(RopeTable::new(be, &inv, len, RopeStyle::SplitHalf)?);
        }
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.ws = None;
        let (h, im, width, qc) = (
            self.cfg.hidden_size,
            self.cfg.intermediate_size,
            self.layout.width(),
            self.layout.q_cols(),
        );
        let (s, c) = (Role::Stream, Role::Compute);
        self.ws = Some(Workspace {
            rows,
            ids: be.alloc(rows, Role::Index)?,
            pos: be.alloc(rows, Role::Index)?,
            h: be.alloc(rows * h, s)?,
            a: be.alloc(rows * h, c)?,
            qkv: be.alloc(rows * width, c)?,
            attn: be.alloc(rows * qc, c)?,
            y: be.alloc(rows * h, c)?,
            gu: be.alloc(rows * 2 * im, c)?,
            g: be.alloc(rows * im, c)?,
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
        let (h, eps, t, lay) = (
            self.cfg.hidden_size,
            self.cfg.rms_norm_eps,
            total,
            self.layout,
        );
        let im = self.cfg.intermediate_size;
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
        be.embed(&self.embed, &ws.ids, 1.0, ViewMut::new(&mut ws.h, t, h))?;
        if let Some(l0) = self.layers.first() {
            be.norm(
                View::new(&ws.h, t, h),
                &RowNorm::rms(&l0.input_norm, eps),
                ViewMut::new(&mut ws.a, t, h),
            )?;
        }
        let spec = AttnSpec {
            heads_q: lay.heads_q,
            heads_kv: lay.heads_kv,
            head_dim: lay.head_dim,
            scale: (lay.head_dim as f32).powf(-0.5),
            window: None,
            causal: true,
        };
        for (i, l) in self.layers.iter().enumerate() {
            SelfAttention {
                qkv: &l.qkv,
                o: &l.o,
                layout: lay,
                q_norm: Some(&l.q_norm),
                k_norm: Some(&l.k_norm),
                v_norm: false,
                eps,
                rope: Some((rope, &ws.pos)),
                spec,
            }
            .forward(
                be,
                View::new(&ws.a, t, h),
                &segs,
                &mut ws.qkv,
                &mut ws.attn,
                ViewMut::new(&mut ws.y, t, h),
            )?;
            let post_attn = RowNorm::rms(&l.post_attn_norm, eps);
            be.residual_add(
                ViewMut::new(&mut ws.h, t, h),
                View::new(&ws.y, t, h),
                &Residual::plain(),
                Some((&post_attn, ViewMut::new(&mut ws.a, t, h))),
            )?;
            GatedMlp {
                gate_up: &l.gate_up,
                down: &l.down,
                inner: im,
                act: Activation::Silu,
            }
            .forward(
                be,
                View::new(&ws.a, t, h),
                &mut ws.gu,
                &mut ws.g,
                ViewMut::new(&mut ws.y, t, h),
            )?;
            let next = self
                .layers
                .get(i + 1)
                .map(|n| RowNorm::rms(&n.input_norm, eps));
            be.residual_add(
                ViewMut::new(&mut ws.h, t, h),
                View::new(&ws.y, t, h),
                &Residual::plain(),
                next.as_ref().map(|n| (n, ViewMut::new(&mut ws.a, t, h))),
            )?;
        }
        Ok(View::new(&ws.h, t, h))
    }
}
