//! The EmbeddingGemma 2 text encoder (spec: `shared/specs/egemma2.md` §1.3).
//!
//! Reference: `EmbeddingGemma2TextModel` in
//! `transformers/models/embedding_gemma2/modeling_embedding_gemma2.py` (transformers 5.25.0).
//!
//! A bidirectional Gemma 4-style stack: embeddings × √hidden; projection-only per-layer inputs
//! (PLE); per layer, sandwich-normed attention (q/k/v RMS-norms, RoPE, unscaled scores, sliding
//! or full), a GELU-tanh gated MLP, the PLE gate, and a per-layer scalar; a final norm; the
//! 768-wide head; mean over every token. Sequences are packed back to back with block-diagonal
//! attention, so a packed member embeds exactly as it does alone.

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Epilogue, Mask, QkvLayout, Residual, Role, RopeStyle,
    RopeTable, RowNorm, Segments, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::{LayerType, TextConfig};
use crate::blocks::rope::inv_freq;
use crate::blocks::{
    HF_ATTENTION, HF_MLP, LayerShape, SandwichLayer, Scratch, ScratchDims, SelfAttention,
};
use crate::loader::Loader;

/// One layer: the shared sandwich-normed layer and this tower's per-layer input (PLE) block.
struct Layer<B: Backend> {
    kind: LayerType,
    block: SandwichLayer<B>,
    ple_gate: B::Mat,
    ple_proj: B::Mat,
    ple_post_norm: B::Vector,
    scalar: f32,
}

/// Activations for a pass of up to `rows` tokens and `segs` sequences, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    max_segs: usize,
    segs: Segments<B>,
    ids: B::Buf,
    pos: B::Buf,
    /// A merged pass's soft tokens `[soft_rows, H]` (f32) and the rows they replace: copied here
    /// before the pass so that its graph always reads the same addresses. Sized by the merges
    /// seen, not by `rows`: a long text-only pass pays nothing for it.
    soft: B::Buf,
    soft_rows: usize,
    at: B::Buf,
    /// Residual stream `[T, H]` (f32).
    h: B::Buf,
    /// Input embeddings as a GEMM input `[T, H]`.
    x0: B::Buf,
    /// The blocks' activations. (`y`, the sub-block outputs before their post-norm, stays in the
    /// compute dtype: f32 there was measured on the H200 to cost 5% of a 256-token batch for no
    /// measurable accuracy.)
    scratch: Scratch<B>,
    /// PLE for all layers at once: raw projection and normed per-layer inputs `[T, L·P]`; then
    /// per layer the gate pre-activation and the gated product `[T, P]`.
    ple_raw: B::Buf,
    ple: B::Buf,
    ple_gate: B::Buf,
    ple_z: B::Buf,
    /// Final-normed rows in f32 `[T, H]`, their per-sequence means, and those as a GEMM input.
    fin: B::Buf,
    pooled: B::Buf,
    pooled_c: B::Buf,
    out: B::Buf,
}

/// Rows to put in place of the embeddings of some packed tokens (media soft tokens over their
/// placeholders): row `i` of `rows` replaces packed row `at[i]`, before the per-layer inputs are
/// computed, unscaled — as the reference's `masked_scatter` does.
pub struct Merge<'a, B: Backend> {
    pub rows: View<'a, B>,
    pub at: &'a [u32],
}

pub struct TextEncoder<B: Backend> {
    cfg: TextConfig,
    embed: B::Table,
    /// The shared PLE projection `[L·P, H]`: every layer's per-layer input in one GEMM.
    ple_proj: B::Mat,
    ple_norm: B::Vector,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    head: B::Mat,
    rope_sliding: Option<RopeTable<B>>,
    rope_full: Option<RopeTable<B>>,
    ws: Option<Workspace<B>>,
    /// Bumped whenever a buffer that device work points at is reallocated (workspace, RoPE
    /// tables): part of the key under which the backend may replay captured work.
    generation: u64,
}

impl<B: Backend> TextEncoder<B> {
    /// Load from the checkpoint tensors under `language_model.`, checking every shape.
    pub fn load(be: &B, cfg: &TextConfig, w: &Weights) -> Result<Self> {
        let h = cfg.hidden_size;
        let p = cfg.ple_dim;
        let n_layers = cfg.layers.len();
        let l = Loader::new(be, w);
        let embed = l.table("embed_tokens.weight", &[cfg.vocab_size, h])?;
        let ple_proj = l.matrix("ple.per_layer_model_projection.weight", n_layers * p, h)?;
        let ple_norm = l.vector("ple.per_layer_projection_norm.weight", p)?;
        let mut layers = Vec::with_capacity(n_layers);
        for (i, lc) in cfg.layers.iter().enumerate() {
            let ll = l.pp(format_args!("layers.{i}"));
            let shape = LayerShape {
                layout: QkvLayout {
                    heads_q: cfg.num_heads,
                    heads_kv: lc.kv_heads,
                    head_dim: lc.head_dim,
                },
                width: h,
                mlp: lc.intermediate_size,
            };
            layers.push(Layer {
                kind: lc.kind,
                block: SandwichLayer::load(&ll, &HF_ATTENTION, &HF_MLP, shape)?,
                ple_gate: ll.matrix("ple_block.per_layer_input_gate.weight", p, h)?,
                ple_proj: ll.matrix("ple_block.per_layer_projection.weight", h, p)?,
                ple_post_norm: ll.vector("ple_block.post_per_layer_input_norm.weight", h)?,
                scalar: ll.scalar("layer_scalar")?,
            });
        }
        let mut encoder = TextEncoder {
            cfg: cfg.clone(),
            embed,
            ple_proj,
            ple_norm,
            layers,
            final_norm: l.vector("norm.weight", h)?,
            head: l.matrix("embedding_projection.weight", cfg.embedding_dim, h)?,
            rope_sliding: None,
            rope_full: None,
            ws: None,
            generation: 0,
        };
        // The first tables (1,024 positions) at load, so the first request does not pay for them.
        encoder.ensure_rope(be, 1)?;
        Ok(encoder)
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// Make the RoPE tables cover positions `0..len`, growing them in powers of two.
    fn ensure_rope(&mut self, be: &B, len: usize) -> Result<()> {
        for kind in [LayerType::Sliding, LayerType::Full] {
            let Some(rc) = self.cfg.rope(kind).cloned() else {
                continue;
            };
            let slot = match kind {
                LayerType::Sliding => &mut self.rope_sliding,
                LayerType::Full => &mut self.rope_full,
            };
            if slot.as_ref().is_none_or(|t| t.len < len) {
                // Grow geometrically, never past the model's positions (forward checked `len`).
                let want = len
                    .next_power_of_two()
                    .max(1024)
                    .min(self.cfg.max_positions)
                    .max(len);
                let inv = inv_freq(rc.theta, rc.head_dim);
                *slot = Some(RopeTable::new(be, &inv, want, RopeStyle::SplitHalf)?);
                self.generation = crate::blocks::workspace_generation();
            }
        }
        Ok(())
    }

    fn ensure_workspace(&mut self, be: &B, rows: usize, segs: usize, soft: usize) -> Result<()> {
        if self
            .ws
            .as_ref()
            .is_some_and(|w| w.rows >= rows && w.max_segs >= segs && w.soft_rows >= soft)
        {
            return Ok(());
        }
        // Keep room for the largest merge seen, so that text passes do not shrink it.
        let soft_rows = self.ws.as_ref().map_or(soft, |w| w.soft_rows.max(soft));
        self.ws = None; // free the old one first
        // Captured graphs hold the old buffers' addresses: never replay one of them again.
        self.generation = crate::blocks::workspace_generation();
        let c = &self.cfg;
        let (h, p) = (c.hidden_size, c.ple_dim);
        let widest = |f: fn(&Layer<B>) -> usize| self.layers.iter().map(f).max().unwrap_or(0);
        let dims = ScratchDims {
            width: h,
            qkv: widest(|l| l.block.attn.layout.width()),
            attn: widest(|l| l.block.attn.layout.q_cols()),
            mlp: widest(|l| l.block.mlp.inner),
        };
        let (s, e) = (Role::Stream, Role::Compute);
        let nl = self.layers.len();
        self.ws = Some(Workspace {
            rows,
            max_segs: segs,
            segs: be.alloc_segments(rows, segs)?,
            ids: be.alloc(rows, Role::Index)?,
            pos: be.alloc(rows, Role::Index)?,
            soft: be.alloc(soft_rows * h, s)?,
            soft_rows,
            at: be.alloc(rows, Role::Index)?,
            h: be.alloc(rows * h, s)?,
            x0: be.alloc(rows * h, e)?,
            scratch: Scratch::alloc(be, rows, dims)?,
            ple_raw: be.alloc(rows * nl * p, e)?,
            ple: be.alloc(rows * nl * p, e)?,
            ple_gate: be.alloc(rows * p, e)?,
            ple_z: be.alloc(rows * p, e)?,
            fin: be.alloc(rows * h, s)?,
            pooled: be.alloc(segs * h, s)?,
            pooled_c: be.alloc(segs * h, e)?,
            out: be.alloc(segs * c.embedding_dim, s)?,
        });
        Ok(())
    }

    /// Embed packed sequences of token ids: for each, the mean over its tokens of the 768-wide
    /// head output (not yet L2-normalised).
    pub fn forward(&mut self, be: &B, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        self.forward_merged(be, seqs, None)
    }

    /// [`forward`](Self::forward) with some token rows replaced by `merge` (the ids at those
    /// rows are not looked up).
    pub fn forward_merged(
        &mut self,
        be: &B,
        seqs: &[&[u32]],
        merge: Option<Merge<'_, B>>,
    ) -> Result<Vec<Vec<f32>>> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let total: usize = lens.iter().sum();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        if lens.contains(&0) {
            return Err(Error::input("cannot embed an empty token sequence"));
        }
        if longest > self.cfg.max_positions {
            return Err(Error::input(format!(
                "input of {longest} tokens exceeds the model's {} positions (max_position_embeddings); pass --max-tokens to truncate",
                self.cfg.max_positions
            )));
        }
        let mut ids: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        if let Some(m) = &merge {
            if m.at.len() != m.rows.rows || m.rows.cols != self.cfg.hidden_size {
                return Err(Error::backend(
                    "text encoder",
                    format!(
                        "{}×{} merged rows for {} places",
                        m.rows.rows,
                        m.rows.cols,
                        m.at.len()
                    ),
                ));
            }
            // Replaced rows are overwritten after the lookup; give them a valid id, as the
            // reference maps placeholders to <pad>.
            for &r in m.at {
                let slot = ids.get_mut(r as usize).ok_or_else(|| {
                    Error::backend("text encoder", format!("merged row {r} beyond {total}"))
                })?;
                *slot = self.cfg.pad_token_id.unwrap_or(0);
            }
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(Error::input(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        self.ensure_rope(be, longest)?;
        let merged = merge.as_ref().map_or(0, |m| m.at.len());
        self.ensure_workspace(be, total, seqs.len(), merged)?;
        let Some(mut ws) = self.ws.take() else {
            return Err(Error::backend(
                "text encoder",
                "workspace missing after allocation",
            ));
        };
        let result = self.run(be, &mut ws, &ids, &lens, merge);
        self.ws = Some(ws);
        result
    }

    /// Upload the batch, run the layers, read the pooled vectors. Every pass is one replayable
    /// region (the backend may capture it as a graph, keyed by the sequence lengths and the
    /// number of merged rows): a merged pass's soft tokens and their row indices are first copied
    /// into the workspace, so the region reads the same buffers from call to call.
    fn run(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        ids: &[u32],
        lens: &[usize],
        merge: Option<Merge<'_, B>>,
    ) -> Result<Vec<Vec<f32>>> {
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        be.set_segments(&mut ws.segs, lens)?;
        be.write_u32(&mut ws.ids, ids)?;
        be.write_u32(&mut ws.pos, &pos)?;
        let merged = match &merge {
            Some(m) => {
                let h = self.cfg.hidden_size;
                be.write_u32(&mut ws.at, m.at)?;
                be.cast(m.rows, ViewMut::new(&mut ws.soft, m.at.len(), h))?;
                m.at.len()
            }
            None => 0,
        };
        let key = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (self.generation, lens, merged).hash(&mut h);
            h.finish()
        };
        let (t, n) = (ids.len(), lens.len());
        be.run_graph(key, &mut || self.layers_and_pool(be, ws, t, n, merged))?;
        let e = self.cfg.embedding_dim;
        let flat = be.read_f32(View::new(&ws.out, n, e))?;
        Ok(flat.chunks(e).map(<[f32]>::to_vec).collect())
    }

    /// Every device op of a forward, on `t` packed tokens of `n` sequences already uploaded.
    /// `merged`: how many rows of `ws.soft` replace the rows of `h` listed in `ws.at` (after the
    /// lookup).
    fn layers_and_pool(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        t: usize,
        n: usize,
        merged: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let (h, p, eps) = (c.hidden_size, c.ple_dim, c.rms_norm_eps);
        let Workspace {
            segs,
            ids,
            pos,
            soft,
            at,
            h: hs,
            x0,
            scratch: s,
            ple_raw,
            ple,
            ple_gate,
            ple_z,
            fin,
            pooled,
            pooled_c,
            out,
            ..
        } = ws;
        // x0 = E[ids] · √H; h = x0; a = N_in0(h)
        be.embed(&self.embed, ids, (h as f32).sqrt(), ViewMut::new(hs, t, h))?;
        if merged > 0 {
            be.scatter_rows(View::new(soft, merged, h), at, ViewMut::new(hs, t, h))?;
        }
        be.cast(View::new(hs, t, h), ViewMut::new(x0, t, h))?;
        if let Some(l0) = self.layers.first() {
            be.norm(
                View::new(hs, t, h),
                &RowNorm::rms(&l0.block.input_norm, eps),
                ViewMut::new(&mut s.a, t, h),
            )?;
        }
        // Per-layer inputs of every layer: P = N(x0 · W_pmpᵀ · H^-½), normed per layer slice.
        let nl = self.layers.len();
        be.matmul(
            View::new(x0, t, h),
            &self.ple_proj,
            ViewMut::new(ple_raw, t, nl * p),
            &Epilogue::scaled((h as f32).powf(-0.5)),
        )?;
        be.norm(
            View::new(ple_raw, t * nl, p),
            &RowNorm::rms(&self.ple_norm, eps),
            ViewMut::new(ple, t * nl, p),
        )?;
        for (i, l) in self.layers.iter().enumerate() {
            let rope = match l.kind {
                LayerType::Sliding => self.rope_sliding.as_ref(),
                LayerType::Full => self.rope_full.as_ref(),
            }
            .ok_or_else(|| Error::backend("text encoder", "rope table missing"))?;
            let mask = match l.kind {
                LayerType::Sliding => Mask::Window(c.sliding_window),
                LayerType::Full => Mask::Full,
            };
            let attn = SelfAttention {
                w: &l.block.attn,
                v_norm: true,
                eps,
                rope: Some((rope, &*pos)),
                spec: AttnSpec::new(l.block.attn.layout, 1.0, mask),
            };
            l.block
                .attention_and_mlp(be, &attn, Activation::GeluTanh, segs, t, hs, s)?;
            be.residual(
                ViewMut::new(hs, t, h),
                View::new(&s.y, t, h),
                &Residual::post_norm(RowNorm::rms(&l.block.post_ff_norm, eps)),
                After::Copy(ViewMut::new(&mut s.a, t, h)),
            )?;
            // This layer's input P_i, gated by gelu(h · W_gateᵀ).
            be.matmul(
                View::new(&s.a, t, h),
                &l.ple_gate,
                ViewMut::new(ple_gate, t, p),
                &Epilogue::default(),
            )?;
            be.gated(
                View::new(ple_gate, t, p),
                View::new(ple, t, nl * p).cols(i * p, p),
                ViewMut::new(ple_z, t, p),
                Activation::GeluTanh,
            )?;
            be.matmul(
                View::new(ple_z, t, p),
                &l.ple_proj,
                ViewMut::new(&mut s.y, t, h),
                &Epilogue::default(),
            )?;
            // h = (h + N(z)) · s, then the next layer's input norm (or the final norm, in f32).
            let after = match self.layers.get(i + 1) {
                Some(next) => After::Norm(
                    RowNorm::rms(&next.block.input_norm, eps),
                    ViewMut::new(&mut s.a, t, h),
                ),
                None => After::Norm(RowNorm::rms(&self.final_norm, eps), ViewMut::new(fin, t, h)),
            };
            be.residual(
                ViewMut::new(hs, t, h),
                View::new(&s.y, t, h),
                &Residual::post_norm(RowNorm::rms(&l.ple_post_norm, eps)).scaled(l.scalar),
                after,
            )?;
        }
        let e = c.embedding_dim;
        // The head is linear and bias-free: mean then project equals project then mean.
        be.segment_mean(View::new(fin, t, h), segs, ViewMut::new(pooled, n, h))?;
        be.cast(View::new(pooled, n, h), ViewMut::new(pooled_c, n, h))?;
        be.matmul(
            View::new(pooled_c, n, h),
            &self.head,
            ViewMut::new(out, n, e),
            &Epilogue::default(),
        )?;
        Ok(())
    }
}
