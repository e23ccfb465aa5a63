//! Qwen-Image-2.1's single-stream DiT, `QwenImage21Transformer2DModel` (spec A2–A5), with its
//! prefix K/V cache.
//!
//! Reference: diffusers 0.42.1 `models/transformers/transformer_qwenimage21.py`. Text rows are
//! `txt_in`-projected features (zero-centred RMSNorm, GELU-tanh MLP), image rows `img_in` of
//! their latent tokens. One modulation `[s1 | g1 | s2 | g2]` serves every block; prefix rows
//! take it at `t = 0`, target rows at the step's `t`. A block is
//! `x += tanh(g1)·attn(LN(x)·(1 + s1))`, `x += tanh(g2)·ffn(LN(x)·(1 + s2))` with affine-free
//! LayerNorms, per-head RMSNorm of q and k, interleaved 3-axis RoPE and a block-causal mask.
//!
//! Because the prefix never sees the target and is modulated at `t = 0`, its keys and values
//! are the same at every step. [`QwenImageTransformer::prefill`] runs the prefix once (per
//! prompt) and keeps each layer's post-norm, post-RoPE K and V ([`Prefix`]);
//! [`QwenImageTransformer::step`] then computes only the target rows, attending over
//! `[cached prefix ‖ own]` keys with no mask. [`QwenImageTransformer::forward_full`] runs the
//! whole sequence without a cache, to check it.
//!
//! In a step the target rows of each item (an image's prompt, or its negative prompt under
//! CFG) do every product alone; attention runs over a joint buffer where each item's segment
//! is its prefix's cached K/V followed by its own rows, so the tensor-core kernels apply. The
//! prefix rows' queries there are unused (a few percent of the rows at 1024²).

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Epilogue, Mask, NormKind, QkvLayout, QkvNorm, Residual,
    Role, RopeStyle, RopeTable, RowNorm, Segments, View, ViewMut, block_causal_limits,
};
use tessera_core::{Error, Result, Weights};

use super::config::{T_FREQ_DIM, TransformerConfig};
use super::layout::{Layout, Part, Rope};
use crate::blocks::timestep::{timestep_features, timestep_frequencies};
use crate::blocks::{
    AttentionWeights, AttnNames, MlpNames, MlpWeights, QkvNames, Scratch, ScratchDims,
};
use crate::loader::Loader;

/// `QwenImage21TemporalTimesteps`' `time_factor`: the model's time in `[0, 1]` is scaled to 1000.
const TIME_FACTOR: f32 = 1000.0;

const ATTENTION: AttnNames = AttnNames {
    qkv: QkvNames::Separate {
        q: "attn.to_q.weight",
        k: "attn.to_k.weight",
        v: "attn.to_v.weight",
    },
    o: "attn.to_out.0.weight",
    q_norm: "attn.norm_q.weight",
    k_norm: "attn.norm_k.weight",
};
const MLP: MlpNames = MlpNames {
    gate: "img_mlp.gate_layer.weight",
    up: "img_mlp.proj.weight",
    down: "img_mlp.out.weight",
};

struct Block<B: Backend> {
    attn: AttentionWeights<B>,
    mlp: MlpWeights<B>,
}

pub struct QwenImageTransformer<B: Backend> {
    cfg: TransformerConfig,
    img_in: B::Mat,
    /// `txt_in.text_norm`'s effective scale `w + 1` (the checkpoint stores `w`).
    txt_norm: B::Vector,
    txt_in: B::Mat,
    txt_out: B::Mat,
    t_linear_1: B::Mat,
    t_linear_2: B::Mat,
    modulation: B::Mat,
    norm_out: B::Mat,
    proj_out: B::Mat,
    blocks: Vec<Block<B>>,
    rope: Rope,
    t_freqs: Vec<f32>,
}

/// One prompt's prefix, computed once: per layer the post-norm, post-RoPE keys and the values
/// of its rows, `[rows, dim]` each.
pub struct Prefix<B: Backend> {
    layout: Layout,
    k: Vec<B::Buf>,
    v: Vec<B::Buf>,
}

impl<B: Backend> Prefix<B> {
    /// The sequence the prefix was computed for (its target part gives the image's size).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn rows(&self) -> usize {
        self.layout.prefix_rows()
    }
    /// Layer `l`'s keys and values, `[rows, dim]`.
    pub fn kv(&self, l: usize) -> Option<(&B::Buf, &B::Buf)> {
        Some((self.k.get(l)?, self.v.get(l)?))
    }
    /// Wait until the prefill that made this prefix has run on the device (one value of the last
    /// layer's values read back), so that its time can be told from the next stage's.
    pub fn wait(&self, be: &B) -> Result<()> {
        match self.v.last() {
            Some(v) => be.read_f32(View::new(v, 1, 1)).map(drop),
            None => Ok(()),
        }
    }
}

/// The activations of a generation's steps: one item per denoised latent and prompt branch,
/// each over its own prefix (see the module docs for the joint attention buffer).
pub struct Steps<B: Backend> {
    /// `(prefix index, first row in the joint buffer)` of each item.
    items: Vec<(usize, usize)>,
    prefix_rows: Vec<usize>,
    target: (usize, usize),
    steps: usize,
    /// Raw modulations `[steps, 4·dim]` and final scales `[steps, dim]` of the target rows.
    mods: B::Buf,
    fscale: B::Buf,
    /// RoPE table over every item's target rows, and each item's rows of it.
    rope: RopeTable<B>,
    pos: Vec<B::Buf>,
    segs: Segments<B>,
    /// Key limits of the joint rows: 0 for an item's prefix rows (their outputs are never read,
    /// so the flash kernels skip their query tiles; a full mask did the prefix's attention again
    /// every step, half the step's attention at an edit's size), the whole item for its target.
    limits: B::Buf,
    /// Target rows' residual stream `[items·n, dim]`, latents in and velocities out.
    h: B::Buf,
    latents: B::Buf,
    out: B::Buf,
    /// The blocks' activations, sized for the joint rows `Σ (prefix + n)`: its q|k|v and
    /// attention output are the joint buffers, the rest is used for the target rows only.
    scratch: Scratch<B>,
}

impl<B: Backend> Steps<B> {
    pub fn steps(&self) -> usize {
        self.steps
    }
    pub fn items(&self) -> usize {
        self.items.len()
    }
}

/// Rows of a sequence that share one modulation row `[1, 4·dim]`.
#[derive(Clone, Copy)]
struct Group<'a, B: Backend> {
    start: usize,
    len: usize,
    mods: View<'a, B>,
}

impl<B: Backend> QwenImageTransformer<B> {
    /// Load from the diffusers checkpoint, checking every tensor's shape against `cfg`.
    pub fn load(be: &B, cfg: &TransformerConfig, weights: &Weights) -> Result<Self> {
        let l = Loader::new(be, weights);
        let (d, c) = (cfg.dim(), cfg.context_in_dim);
        let layout = block_layout(cfg);
        let blocks = (0..cfg.num_layers)
            .map(|i| {
                let b = l.pp(format_args!("transformer_blocks.{i}"));
                Ok(Block {
                    attn: AttentionWeights::load(&b, &ATTENTION, layout, d)?,
                    mlp: MlpWeights::load(&b, &MLP, d, cfg.ffn_dim())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let txt_norm: Vec<f32> = l
            .tensor("txt_in.text_norm.weight", &[c])?
            .to_f32()
            .iter()
            .map(|w| w + 1.0)
            .collect();
        Ok(QwenImageTransformer {
            img_in: l.matrix("img_in.weight", d, cfg.in_channels)?,
            txt_norm: be.vector_f32(&txt_norm)?,
            txt_in: l.matrix("txt_in.in_layer.weight", d, c)?,
            txt_out: l.matrix("txt_in.out_layer.weight", d, d)?,
            t_linear_1: l.matrix(
                "time_text_embed.timestep_embedder.linear_1.weight",
                d,
                T_FREQ_DIM,
            )?,
            t_linear_2: l.matrix("time_text_embed.timestep_embedder.linear_2.weight", d, d)?,
            modulation: l.matrix("modulation.1.weight", 4 * d, d)?,
            norm_out: l.matrix("norm_out.linear.weight", d, d)?,
            proj_out: l.matrix("proj_out.weight", cfg.out_channels, d)?,
            blocks,
            rope: Rope::new(cfg.axes_dims),
            t_freqs: timestep_frequencies(),
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// Replace the timestep sinusoid's 128 frequencies (a parity test's way of taking the
    /// reference's own rounding; see [`timestep_frequencies`]).
    pub fn set_timestep_frequencies(&mut self, freqs: Vec<f32>) -> Result<()> {
        if freqs.len() != T_FREQ_DIM / 2 {
            return Err(Error::input(format!(
                "{} timestep frequencies; expected {}",
                freqs.len(),
                T_FREQ_DIM / 2
            )));
        }
        self.t_freqs = freqs;
        Ok(())
    }

    fn scale(&self) -> f32 {
        (self.cfg.head_dim as f32).powf(-0.5)
    }

    fn dims(&self) -> ScratchDims {
        ScratchDims::new(self.cfg.dim(), block_layout(&self.cfg), self.cfg.ffn_dim())
    }

    /// Raw modulations `[n, 4·dim]` and final-layer scales `[n, dim]` at model times `ts`.
    fn modulations(&self, be: &B, ts: &[f32]) -> Result<(B::Buf, B::Buf)> {
        let (d, n, e) = (self.cfg.dim(), ts.len(), Role::Compute);
        let feats: Vec<f32> = ts
            .iter()
            .flat_map(|&t| timestep_features(&self.t_freqs, t, TIME_FACTOR))
            .collect();
        let mut tf = be.alloc(feats.len(), e)?;
        be.write_f32(&mut tf, &feats)?;
        let mut mid = be.alloc(n * d, e)?;
        be.matmul(
            View::new(&tf, n, T_FREQ_DIM),
            &self.t_linear_1,
            ViewMut::new(&mut mid, n, d),
            &Epilogue::default().act(Activation::Silu),
        )?;
        // Both heads read SiLU(temb).
        let mut temb = be.alloc(n * d, e)?;
        be.matmul(
            View::new(&mid, n, d),
            &self.t_linear_2,
            ViewMut::new(&mut temb, n, d),
            &Epilogue::default().act(Activation::Silu),
        )?;
        // Read as f32 by the norms and residual gates, in any precision.
        let (mut mods, mut fscale) = (
            be.alloc(n * 4 * d, Role::Stream)?,
            be.alloc(n * d, Role::Stream)?,
        );
        be.matmul(
            View::new(&temb, n, d),
            &self.modulation,
            ViewMut::new(&mut mods, n, 4 * d),
            &Epilogue::default(),
        )?;
        be.matmul(
            View::new(&temb, n, d),
            &self.norm_out,
            ViewMut::new(&mut fscale, n, d),
            &Epilogue::default(),
        )?;
        Ok((mods, fscale))
    }

    /// The joint input rows of a whole sequence or of its prefix (`with_target`), `[rows, dim]`
    /// in `x`: text parts from `text` (`[text rows, context_in_dim]` features, in order), image
    /// parts from `latents` (`[image rows, in_channels]` packed tokens, in order).
    fn embed_rows(
        &self,
        be: &B,
        layout: &Layout,
        with_target: bool,
        text: View<'_, B>,
        latents: &[f32],
        x: &mut B::Buf,
    ) -> Result<()> {
        let (d, c, ci) = (
            self.cfg.dim(),
            self.cfg.context_in_dim,
            self.cfg.in_channels,
        );
        let parts = if with_target {
            layout.parts()
        } else {
            layout.prefix()
        };
        let rows: usize = parts.iter().map(Part::rows).sum();
        let text_rows: usize = parts
            .iter()
            .map(|p| if let Part::Text(n) = p { *n } else { 0 })
            .sum();
        let image_rows = rows - text_rows;
        if text.rows != text_rows || text.cols != c {
            return Err(Error::input(format!(
                "text features {}×{}; the sequence has {text_rows} text rows of {c}",
                text.rows, text.cols
            )));
        }
        if latents.len() != image_rows * ci {
            return Err(Error::input(format!(
                "{} latent values; the sequence has {image_rows} image rows of {ci} channels",
                latents.len()
            )));
        }
        let e = Role::Compute;
        // Text: zero-centred RMSNorm → in_layer → GELU-tanh → out_layer, all rows at once.
        let mut normed = be.alloc(text_rows * c, e)?;
        be.norm(
            text,
            &RowNorm::rms(&self.txt_norm, self.cfg.eps),
            ViewMut::new(&mut normed, text_rows, c),
        )?;
        let mut mid = be.alloc(text_rows * d, e)?;
        be.matmul(
            View::new(&normed, text_rows, c),
            &self.txt_in,
            ViewMut::new(&mut mid, text_rows, d),
            &Epilogue::default().act(Activation::GeluTanh),
        )?;
        let mut txt = be.alloc(text_rows * d, Role::Stream)?;
        be.matmul(
            View::new(&mid, text_rows, d),
            &self.txt_out,
            ViewMut::new(&mut txt, text_rows, d),
            &Epilogue::default(),
        )?;
        let mut lat = be.alloc(latents.len().max(1), e)?;
        be.write_f32(&mut lat, latents)?;
        let (mut row, mut t_off, mut i_off) = (0, 0, 0);
        for p in parts {
            let n = p.rows();
            let dst = ViewMut::new(x, rows, d).rows(row, n);
            match p {
                Part::Text(_) => {
                    be.cast(View::new(&txt, text_rows, d).rows(t_off, n), dst)?;
                    t_off += n;
                }
                Part::Image { .. } => {
                    be.matmul(
                        View::new(&lat, image_rows, ci).rows(i_off, n),
                        &self.img_in,
                        dst,
                        &Epilogue::default(),
                    )?;
                    i_off += n;
                }
            }
            row += n;
        }
        Ok(())
    }

    /// A RoPE table over `positions` and the identity row map.
    fn rope_table(&self, be: &B, positions: &[[i32; 3]]) -> Result<(RopeTable<B>, B::Buf)> {
        let half = self.cfg.head_dim / 2;
        let angles = self.rope.angles(positions);
        let table =
            RopeTable::from_angles(be, &angles, positions.len(), half, RopeStyle::Interleaved)?;
        let rows: Vec<u32> = (0..positions.len() as u32).collect();
        let mut pos = be.alloc(rows.len(), Role::Index)?;
        be.write_u32(&mut pos, &rows)?;
        Ok((table, pos))
    }

    /// Run every block over the `rows` rows of `x` (a whole sequence or a prefix) in place,
    /// each group of rows with its modulation. `limits`: block-causal key limits per row (else
    /// causal). `store`: keep each layer's K and V there. With `store` and no consumer of the last
    /// layer's output (`skip_last_tail`), the last block stops after its keys and values.
    #[allow(clippy::too_many_arguments)]
    fn run_blocks(
        &self,
        be: &B,
        x: &mut B::Buf,
        rows: usize,
        groups: &[Group<'_, B>],
        limits: Option<&[u32]>,
        rope: (&RopeTable<B>, &B::Buf),
        mut store: Option<&mut Prefix<B>>,
        skip_last_tail: bool,
    ) -> Result<()> {
        let (d, eps) = (self.cfg.dim(), self.cfg.eps);
        let lay = block_layout(&self.cfg);
        let mut s = Scratch::alloc(be, rows, self.dims())?;
        let segs = be.segments(&[rows])?;
        // Self-attention over the rows' own keys, so bf16 runs on the tensor-core flash kernels
        // (they read the limits); over a key range of the same rows it took the key-range kernel.
        let lim_buf = match limits {
            Some(l) => {
                let mut b = be.alloc(l.len(), Role::Index)?;
                be.write_u32(&mut b, l)?;
                Some(b)
            }
            None => None,
        };
        let spec = match &lim_buf {
            Some(b) => AttnSpec::new(lay, self.scale(), Mask::Limits(b)),
            None => AttnSpec::new(lay, self.scale(), Mask::Causal),
        };
        norm_groups(be, x, rows, d, groups, 0, eps, &mut s.a)?;
        let last = self.blocks.len() - 1;
        for (li, b) in self.blocks.iter().enumerate() {
            let (qc, w) = (lay.q_cols(), lay.width());
            be.matmul(
                View::new(&s.a, rows, d),
                &b.attn.qkv,
                ViewMut::new(&mut s.qkv, rows, w),
                &Epilogue::default(),
            )?;
            be.qkv_norm_rope(
                ViewMut::new(&mut s.qkv, rows, w),
                &qk_norm(&b.attn, lay, eps),
                Some(rope),
            )?;
            if let Some(pre) = store.as_mut() {
                let (mut k, mut v) = (
                    be.alloc(rows * qc, Role::Compute)?,
                    be.alloc(rows * qc, Role::Compute)?,
                );
                let all = View::new(&s.qkv, rows, w);
                be.cast(all.cols(qc, qc), ViewMut::new(&mut k, rows, qc))?;
                be.cast(all.cols(2 * qc, qc), ViewMut::new(&mut v, rows, qc))?;
                pre.k.push(k);
                pre.v.push(v);
            }
            if li == last && skip_last_tail {
                break;
            }
            let all = View::new(&s.qkv, rows, w);
            be.attention(
                all.cols(0, qc),
                all.cols(qc, qc),
                all.cols(2 * qc, qc),
                ViewMut::new(&mut s.attn, rows, qc),
                &spec,
                &segs,
            )?;
            be.matmul(
                View::new(&s.attn, rows, qc),
                &b.attn.o,
                ViewMut::new(&mut s.y, rows, d),
                &Epilogue::default(),
            )?;
            residual_groups(be, x, rows, d, groups, 1, Some(2), eps, &mut s)?;
            b.mlp.forward(be, Activation::Silu, rows, &mut s)?;
            let next = (li < last).then_some(0);
            residual_groups(be, x, rows, d, groups, 3, next, eps, &mut s)?;
        }
        Ok(())
    }

    /// Compute the prefix of `layout` once: `text` its text rows' features, `latents` its
    /// condition images' packed tokens (none for text-to-image). See [`Prefix`].
    pub fn prefill(
        &self,
        be: &B,
        layout: &Layout,
        text: View<'_, B>,
        latents: &[f32],
    ) -> Result<Prefix<B>> {
        let d = self.cfg.dim();
        let rows = layout.prefix_rows();
        let mut x = be.alloc(rows * d, Role::Stream)?;
        self.embed_rows(be, layout, false, text, latents, &mut x)?;
        let (mods0, _) = self.modulations(be, &[0.0])?;
        let positions = layout.positions();
        let (table, pos) = self.rope_table(be, &positions[..rows])?;
        let limits = (!layout.prefix_is_text()).then(|| block_causal_limits(&layout.prefix_runs()));
        let mut prefix = Prefix {
            layout: layout.clone(),
            k: Vec::with_capacity(self.blocks.len()),
            v: Vec::with_capacity(self.blocks.len()),
        };
        let groups = [Group {
            start: 0,
            len: rows,
            mods: View::new(&mods0, 1, 4 * d),
        }];
        self.run_blocks(
            be,
            &mut x,
            rows,
            &groups,
            limits.as_deref(),
            (&table, &pos),
            Some(&mut prefix),
            true,
        )?;
        Ok(prefix)
    }

    /// The whole sequence without a cache (the reference's uncached forward), at model time
    /// `t`: the target rows' velocity `[n, out_channels]`. `latents` holds every image part's
    /// tokens in order, the target's last.
    pub fn forward_full(
        &self,
        be: &B,
        layout: &Layout,
        text: View<'_, B>,
        latents: &[f32],
        t: f32,
    ) -> Result<Vec<f32>> {
        let d = self.cfg.dim();
        let rows = layout.rows();
        let (lp, n) = (layout.prefix_rows(), layout.target_rows());
        let mut x = be.alloc(rows * d, Role::Stream)?;
        self.embed_rows(be, layout, true, text, latents, &mut x)?;
        // Row 0: the step's time; row 1: t = 0 for the prefix.
        let (mods, fscale) = self.modulations(be, &[t, 0.0])?;
        let (table, pos) = self.rope_table(be, &layout.positions())?;
        let limits = block_causal_limits(&layout.runs());
        let m = View::new(&mods, 2, 4 * d);
        let groups = [
            Group {
                start: 0,
                len: lp,
                mods: m.rows(1, 1),
            },
            Group {
                start: lp,
                len: n,
                mods: m.rows(0, 1),
            },
        ];
        self.run_blocks(
            be,
            &mut x,
            rows,
            &groups,
            Some(&limits),
            (&table, &pos),
            None,
            false,
        )?;
        let x_t = View::new(&x, rows, d).rows(lp, n);
        self.head(be, x_t, View::new(&fscale, 2, d).rows(0, 1))
    }

    /// The output head on target rows: `(LN(x)·(1 + fscale))·W_projᵀ`, read back.
    fn head(&self, be: &B, x: View<'_, B>, fscale: View<'_, B>) -> Result<Vec<f32>> {
        let (d, n, co) = (self.cfg.dim(), x.rows, self.cfg.out_channels);
        let mut a = be.alloc(n * d, Role::Compute)?;
        be.norm(
            x,
            &RowNorm::plain(NormKind::Layer, self.cfg.eps).modulated(fscale),
            ViewMut::new(&mut a, n, d),
        )?;
        let mut out = be.alloc(n * co, Role::Stream)?;
        be.matmul(
            View::new(&a, n, d),
            &self.proj_out,
            ViewMut::new(&mut out, n, co),
            &Epilogue::default(),
        )?;
        be.read_f32(View::new(&out, n, co))
    }

    /// [`TransformerConfig::step_bytes`] of this transformer's config.
    pub fn step_bytes(
        &self,
        prefix_rows: &[usize],
        hw: (usize, usize),
        steps: usize,
        compute: usize,
    ) -> usize {
        self.cfg.step_bytes(prefix_rows, hw, steps, compute)
    }

    /// [`TransformerConfig::prefix_bytes`] of this transformer's config.
    pub fn prefix_bytes(&self, rows: usize, compute: usize) -> usize {
        self.cfg.prefix_bytes(rows, compute)
    }

    /// Prepare the steps of a generation: item `i` denoises a latent over `prefixes[items[i]]`,
    /// at model times `t_model` (one per step). Every prefix must share its target size.
    pub fn prepare_steps(
        &self,
        be: &B,
        prefixes: &[&Prefix<B>],
        items: &[usize],
        t_model: &[f32],
    ) -> Result<Steps<B>> {
        let d = self.cfg.dim();
        let target = prefixes
            .first()
            .map(|p| p.layout.target())
            .ok_or_else(|| Error::input("a generation needs a prefix"))?;
        if prefixes.iter().any(|p| p.layout.target() != target) {
            return Err(Error::input(
                "the prefixes of one generation differ in image size",
            ));
        }
        if items.is_empty() || items.iter().any(|&i| i >= prefixes.len()) || t_model.is_empty() {
            return Err(Error::input(
                "a generation needs at least one item, each over one of its prefixes, and a step",
            ));
        }
        let n = target.0 * target.1;
        let prefix_rows: Vec<usize> = prefixes.iter().map(|p| p.rows()).collect();
        let mut joint_items = Vec::with_capacity(items.len());
        let mut lens = Vec::with_capacity(items.len());
        let mut limits = Vec::new();
        let mut angles = Vec::with_capacity(items.len() * n * self.rope.pairs());
        let mut off = 0;
        for &p in items {
            joint_items.push((p, off));
            let lp = prefix_rows[p];
            lens.push(lp + n);
            limits.extend(std::iter::repeat_n(0, lp));
            limits.extend(std::iter::repeat_n(
                u32::try_from(lp + n)
                    .map_err(|_| Error::input("a generation of over 2^32 rows"))?,
                n,
            ));
            off += lp + n;
            angles.extend(self.rope.angles(&prefixes[p].layout.positions()[lp..]));
        }
        let joint = off;
        let half = self.cfg.head_dim / 2;
        let rope =
            RopeTable::from_angles(be, &angles, items.len() * n, half, RopeStyle::Interleaved)?;
        let pos = (0..items.len())
            .map(|i| {
                let rows: Vec<u32> = ((i * n) as u32..((i + 1) * n) as u32).collect();
                let mut b = be.alloc(n, Role::Index)?;
                be.write_u32(&mut b, &rows)?;
                Ok(b)
            })
            .collect::<Result<Vec<_>>>()?;
        let (mods, fscale) = self.modulations(be, t_model)?;
        let dims = self.dims();
        let rows = items.len() * n;
        let (s, e) = (Role::Stream, Role::Compute);
        let mut scratch = Scratch::alloc(be, joint, dims)?;
        // The prefix rows' queries are never read, but keep them finite.
        be.write_f32(&mut scratch.qkv, &vec![0.0; joint * dims.qkv])?;
        let mut limits_buf = be.alloc(joint, Role::Index)?;
        be.write_u32(&mut limits_buf, &limits)?;
        Ok(Steps {
            items: joint_items,
            prefix_rows,
            target,
            steps: t_model.len(),
            mods,
            fscale,
            rope,
            pos,
            segs: be.segments(&lens)?,
            limits: limits_buf,
            h: be.alloc(rows * d, s)?,
            latents: be.alloc(rows * self.cfg.in_channels, e)?,
            out: be.alloc(rows * self.cfg.out_channels, s)?,
            scratch,
        })
    }

    /// One denoising step: the velocity `[n, out_channels]` of each item's latent (`[n,
    /// in_channels]` packed tokens) at step `step`.
    pub fn step(
        &self,
        be: &B,
        st: &mut Steps<B>,
        prefixes: &[&Prefix<B>],
        latents: &[&[f32]],
        step: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let (d, eps, ci, co) = (
            self.cfg.dim(),
            self.cfg.eps,
            self.cfg.in_channels,
            self.cfg.out_channels,
        );
        let lay = block_layout(&self.cfg);
        let (qc, w) = (lay.q_cols(), lay.width());
        let n = st.target.0 * st.target.1;
        let rows = st.items.len() * n;
        if latents.len() != st.items.len() || latents.iter().any(|l| l.len() != n * ci) {
            return Err(Error::input(format!(
                "{} latents for {} items of {n}×{ci} values",
                latents.len(),
                st.items.len()
            )));
        }
        if step >= st.steps {
            return Err(Error::input(format!(
                "step {step} of a {}-step preparation",
                st.steps
            )));
        }
        if prefixes.len() != st.prefix_rows.len()
            || prefixes
                .iter()
                .zip(&st.prefix_rows)
                .any(|(p, &r)| p.rows() != r)
        {
            return Err(Error::input(
                "the step's prefixes are not those it was prepared for",
            ));
        }
        let flat: Vec<f32> = latents.iter().flat_map(|l| l.iter().copied()).collect();
        be.write_f32(&mut st.latents, &flat)?;
        be.matmul(
            View::new(&st.latents, rows, ci),
            &self.img_in,
            ViewMut::new(&mut st.h, rows, d),
            &Epilogue::default(),
        )?;
        let mods = View::new(&st.mods, st.steps, 4 * d).rows(step, 1);
        let groups = [Group {
            start: 0,
            len: rows,
            mods,
        }];
        let joint = st.segs.total();
        let Steps {
            items,
            prefix_rows,
            rope,
            pos,
            segs,
            limits,
            h,
            scratch: s,
            ..
        } = st;
        let spec = AttnSpec::new(lay, self.scale(), Mask::Limits(limits));
        norm_groups(be, h, rows, d, &groups, 0, eps, &mut s.a)?;
        let last = self.blocks.len() - 1;
        for (li, b) in self.blocks.iter().enumerate() {
            for (i, &(p, off)) in items.iter().enumerate() {
                let lp = prefix_rows[p];
                let own = ViewMut::new(&mut s.qkv, joint, w).rows(off + lp, n);
                be.matmul(
                    View::new(&s.a, rows, d).rows(i * n, n),
                    &b.attn.qkv,
                    own,
                    &Epilogue::default(),
                )?;
                be.qkv_norm_rope(
                    ViewMut::new(&mut s.qkv, joint, w).rows(off + lp, n),
                    &qk_norm(&b.attn, lay, eps),
                    Some((rope, &pos[i])),
                )?;
                let (ck, cv) = prefixes[p]
                    .kv(li)
                    .ok_or_else(|| Error::backend("qwen-image", "prefix without this layer"))?;
                let cached = ViewMut::new(&mut s.qkv, joint, w).rows(off, lp);
                be.cast(View::new(ck, lp, qc), cached.cols(qc, qc))?;
                let cached = ViewMut::new(&mut s.qkv, joint, w).rows(off, lp);
                be.cast(View::new(cv, lp, qc), cached.cols(2 * qc, qc))?;
            }
            let all = View::new(&s.qkv, joint, w);
            be.attention(
                all.cols(0, qc),
                all.cols(qc, qc),
                all.cols(2 * qc, qc),
                ViewMut::new(&mut s.attn, joint, qc),
                &spec,
                segs,
            )?;
            for (i, &(p, off)) in items.iter().enumerate() {
                be.matmul(
                    View::new(&s.attn, joint, qc).rows(off + prefix_rows[p], n),
                    &b.attn.o,
                    ViewMut::new(&mut s.y, rows, d).rows(i * n, n),
                    &Epilogue::default(),
                )?;
            }
            residual_groups(be, h, rows, d, &groups, 1, Some(2), eps, s)?;
            b.mlp.forward(be, Activation::Silu, rows, s)?;
            let next = (li < last).then_some(0);
            residual_groups(be, h, rows, d, &groups, 3, next, eps, s)?;
        }
        let fscale = View::new(&st.fscale, st.steps, d).rows(step, 1);
        be.norm(
            View::new(&st.h, rows, d),
            &RowNorm::plain(NormKind::Layer, eps).modulated(fscale),
            ViewMut::new(&mut st.scratch.a, rows, d),
        )?;
        be.matmul(
            View::new(&st.scratch.a, rows, d),
            &self.proj_out,
            ViewMut::new(&mut st.out, rows, co),
            &Epilogue::default(),
        )?;
        let all = be.read_f32(View::new(&st.out, rows, co))?;
        Ok(all.chunks_exact(n * co).map(<[f32]>::to_vec).collect())
    }
}

/// Every block's heads: multi-head attention over the model width.
/// The device memory a generation takes, from the config alone: a pipeline that loads the
/// transformer only for its stage (`Residency::Sequential`) checks a request before it loads.
impl TransformerConfig {
    /// Bytes of device memory [`QwenImageTransformer::prepare_steps`] allocates for items over
    /// prefixes of `prefix_rows` rows each and an `(h, w)` target, `compute`-byte compute
    /// elements.
    pub fn step_bytes(
        &self,
        prefix_rows: &[usize],
        (h, w): (usize, usize),
        steps: usize,
        compute: usize,
    ) -> usize {
        let (d, n) = (self.dim(), h * w);
        let items = prefix_rows.len();
        let joint: usize = prefix_rows.iter().map(|p| p + n).sum();
        let dims = ScratchDims::new(self.dim(), block_layout(self), self.ffn_dim());
        let scratch = joint * (2 * dims.width + dims.qkv + dims.attn + 3 * dims.mlp) * compute;
        let stream = items * n * (d + 2 * self.in_channels) * 4;
        let rope = items * n * self.head_dim * 4;
        let mods = steps * 5 * d * 4;
        scratch + stream + rope + mods
    }

    /// Bytes of one prefix's cache: K and V of every layer.
    pub fn prefix_bytes(&self, rows: usize, compute: usize) -> usize {
        2 * self.num_layers * rows * self.dim() * compute
    }
}

fn block_layout(cfg: &TransformerConfig) -> QkvLayout {
    QkvLayout {
        heads_q: cfg.heads,
        heads_kv: cfg.heads,
        head_dim: cfg.head_dim,
    }
}

fn qk_norm<B: Backend>(w: &AttentionWeights<B>, layout: QkvLayout, eps: f32) -> QkvNorm<'_, B> {
    QkvNorm {
        layout,
        qk_norm: true,
        q_weight: Some(&w.q_norm),
        k_weight: Some(&w.k_norm),
        v_norm: false,
        eps,
    }
}

/// `a = LN(x)·(1 + s)` per group, `s` chunk `chunk` of the group's modulation.
#[allow(clippy::too_many_arguments)]
fn norm_groups<B: Backend>(
    be: &B,
    x: &B::Buf,
    rows: usize,
    d: usize,
    groups: &[Group<'_, B>],
    chunk: usize,
    eps: f32,
    a: &mut B::Buf,
) -> Result<()> {
    for g in groups {
        be.norm(
            View::new(x, rows, d).rows(g.start, g.len),
            &RowNorm::plain(NormKind::Layer, eps).modulated(g.mods.cols(chunk * d, d)),
            ViewMut::new(a, rows, d).rows(g.start, g.len),
        )?;
    }
    Ok(())
}

/// `x += tanh(g)·y` per group (`g` chunk `gate`), then the next sub-block's modulated
/// LayerNorm into `s.a` (chunk `next`) when there is one.
#[allow(clippy::too_many_arguments)]
fn residual_groups<B: Backend>(
    be: &B,
    x: &mut B::Buf,
    rows: usize,
    d: usize,
    groups: &[Group<'_, B>],
    gate: usize,
    next: Option<usize>,
    eps: f32,
    s: &mut Scratch<B>,
) -> Result<()> {
    for g in groups {
        let res = Residual::plain().tanh_gated(Some(g.mods.cols(gate * d, d)));
        let after = match next {
            Some(c) => After::Norm(
                RowNorm::plain(NormKind::Layer, eps).modulated(g.mods.cols(c * d, d)),
                ViewMut::new(&mut s.a, rows, d).rows(g.start, g.len),
            ),
            None => After::Nothing,
        };
        be.residual(
            ViewMut::new(x, rows, d).rows(g.start, g.len),
            View::new(&s.y, rows, d).rows(g.start, g.len),
            &res,
            after,
        )?;
    }
    Ok(())
}
