//! The Z-Image diffusion transformer, `ZImageTransformer2DModel` (spec §3).
//!
//! Reference: diffusers 0.42.1 `models/transformers/transformer_z_image.py`. One forward:
//! patchify → `all_x_embedder` → image pad rows := `x_pad_token` → 2 modulated noise-refiner
//! blocks over the image rows → joint `[image | caption]` sequence (the caption already embedded,
//! padded with `cap_pad_token` and refined by 2 unmodulated context-refiner blocks) → 30
//! modulated layers → final LayerNorm · (1 + scale) → linear → unpatchify.
//!
//! Everything that does not depend on the latent is computed once per prompt, size and schedule
//! by [`ZImageTransformer::prepare`]: the caption path, the timestep embeddings and adaLN
//! modulations of every step, the RoPE table and the position ids. Several items (a CFG pair)
//! are packed back to back and attend only within themselves, which equals diffusers' padded,
//! key-masked batch.
//!
//! Two checkpoint layouts load by name: diffusers (`all_x_embedder.2-1.*`, separate
//! `to_q`/`to_k`/`to_v`) and the original / ComfyUI single file (`model.diffusion_model.` prefix,
//! `x_embedder.*`, fused `attention.qkv`), mapped as diffusers'
//! `convert_z_image_transformer_checkpoint_to_diffusers` does.

use std::collections::BTreeMap;

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Mask, NormKind, QkvLayout, Residual, Role, RopeStyle,
    RopeTable, RowNorm, Segments, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::{T_FREQ_DIM, T_MID_DIM, TransformerConfig};
use super::layout::{ItemLayout, patchify, unpatchify};
use crate::blocks::layers::attention_then_mlp;
use crate::blocks::rope::MultiAxis;
pub use crate::blocks::timestep::{timestep_features, timestep_frequencies};
use crate::blocks::{
    AttentionWeights, AttnNames, MlpNames, MlpWeights, QkvNames, Scratch, ScratchDims,
    SelfAttention,
};
use crate::loader::{Linear, Loader};

/// diffusers builds the q/k RMSNorms with a fixed `eps=1e-5`, whatever `norm_eps` says.
const QK_NORM_EPS: f32 = 1e-5;
/// The final LayerNorm (no affine weight).
const FINAL_NORM_EPS: f32 = 1e-6;

/// Intermediate tensors recorded for parity tests, by `(name, item)`; names follow the fixture
/// (`temb`, `mod_nr0`, `rope_cos`, `cap_seq`, `cr1_out`, `x_seq`, `nr0_out`, `u_in`, `l0_out`,
/// `final_out`, …). Recording reads buffers back, so it is for tests and debugging only.
#[derive(Default, Debug)]
pub struct Taps {
    pub values: BTreeMap<(String, usize), Vec<f32>>,
}

impl Taps {
    fn put<B: Backend>(
        taps: &mut Option<&mut Taps>,
        be: &B,
        name: &str,
        item: usize,
        v: View<'_, B>,
    ) -> Result<()> {
        if let Some(t) = taps.as_deref_mut() {
            t.values.insert((name.to_string(), item), be.read_f32(v)?);
        }
        Ok(())
    }
}

/// Where the checkpoint's tensors live and what they are called.
enum Naming {
    Diffusers,
    /// Original / ComfyUI names, under `prefix` (`model.diffusion_model`, or none).
    Original {
        prefix: Option<&'static str>,
    },
}

impl Naming {
    fn detect(w: &Weights) -> Result<Self> {
        if w.contains("all_x_embedder.2-1.weight") {
            Ok(Naming::Diffusers)
        } else if w.contains("model.diffusion_model.x_embedder.weight") {
            Ok(Naming::Original {
                prefix: Some("model.diffusion_model"),
            })
        } else if w.contains("x_embedder.weight") {
            Ok(Naming::Original { prefix: None })
        } else {
            Err(Error::MissingTensor {
                name: "all_x_embedder.2-1.weight (diffusers) or x_embedder.weight (ComfyUI)".into(),
                location: "the transformer checkpoint: is this a Z-Image transformer?".into(),
            })
        }
    }

    /// The weights narrowed to the model's tensors.
    fn root(&self, w: &Weights) -> Weights {
        match self {
            Naming::Original { prefix: Some(p) } => w.pp(p),
            _ => w.clone(),
        }
    }

    /// The checkpoint's name for a diffusers tensor name.
    fn name(&self, diffusers: &str) -> String {
        match self {
            Naming::Diffusers => diffusers.to_string(),
            Naming::Original { .. } => diffusers
                .replace("all_x_embedder.2-1.", "x_embedder.")
                .replace("all_final_layer.2-1.", "final_layer.")
                .replace(".attention.to_out.0.", ".attention.out.")
                .replace(".attention.norm_q.", ".attention.q_norm.")
                .replace(".attention.norm_k.", ".attention.k_norm."),
        }
    }
}

/// The attention and MLP tensors of a block, by diffusers name (the original layout's names are
/// mapped by [`Naming::name`]; its fused `qkv` is read as such).
const ATTENTION: AttnNames = AttnNames {
    qkv: QkvNames::Separate {
        q: "attention.to_q.weight",
        k: "attention.to_k.weight",
        v: "attention.to_v.weight",
    },
    o: "attention.to_out.0.weight",
    q_norm: "attention.norm_q.weight",
    k_norm: "attention.norm_k.weight",
};
const ATTENTION_FUSED: AttnNames = AttnNames {
    qkv: QkvNames::Fused("attention.qkv.weight"),
    ..ATTENTION
};
const MLP: MlpNames = MlpNames {
    gate: "feed_forward.w1.weight",
    up: "feed_forward.w3.weight",
    down: "feed_forward.w2.weight",
};

/// One `ZImageTransformerBlock`: the shared attention and MLP blocks, their sandwich norms and
/// (noise refiner and main layers) the adaLN projection of their modulation.
struct Block<B: Backend> {
    attn: AttentionWeights<B>,
    mlp: MlpWeights<B>,
    attention_norm1: B::Vector,
    attention_norm2: B::Vector,
    ffn_norm1: B::Vector,
    ffn_norm2: B::Vector,
    /// `adaLN_modulation.0` (noise refiner and main layers only).
    adaln: Option<Linear<B>>,
}

impl<B: Backend> Block<B> {
    fn load(
        l: &Loader<'_, B>,
        cfg: &TransformerConfig,
        fused: bool,
        modulated: bool,
    ) -> Result<Self> {
        let d = cfg.dim;
        let layout = block_layout(cfg);
        let names = if fused { &ATTENTION_FUSED } else { &ATTENTION };
        Ok(Block {
            attn: AttentionWeights::load(l, names, layout, d)?,
            mlp: MlpWeights::load(l, &MLP, d, cfg.ffn_dim())?,
            attention_norm1: l.vector("attention_norm1.weight", d)?,
            attention_norm2: l.vector("attention_norm2.weight", d)?,
            ffn_norm1: l.vector("ffn_norm1.weight", d)?,
            ffn_norm2: l.vector("ffn_norm2.weight", d)?,
            adaln: if modulated {
                Some(l.linear("adaLN_modulation.0", 4 * d, cfg.adaln_dim())?)
            } else {
                None
            },
        })
    }
}

/// Every block's heads: multi-head attention over the model width.
/// The device memory a generation takes, from the config alone: a pipeline that loads the
/// transformer only for its stage (`Residency::Sequential`) checks a request before it loads.
impl TransformerConfig {
    /// Bytes of device memory [`ZImageTransformer::prepare`] allocates for items of `cap_lens`
    /// caption tokens over a `latent_hw` latent and `steps` steps, compute-type elements being
    /// `compute` bytes: the per-request working set of the denoising loop.
    pub fn activation_bytes(
        &self,
        latent_hw: (usize, usize),
        cap_lens: &[usize],
        steps: usize,
        compute: usize,
    ) -> Result<usize> {
        let c = self;
        let d = c.dim;
        let items = cap_lens
            .iter()
            .map(|&l| ItemLayout::new(c, latent_hw, l))
            .collect::<Result<Vec<_>>>()?;
        let img_rows: usize = items.iter().map(|i| i.n_img_p).sum();
        let cap_rows: usize = items.iter().map(|i| i.cap_p).sum();
        let seq = img_rows + cap_rows;
        let n_img = items.first().map_or(0, |i| i.n_img);
        let dims = ScratchDims::new(d, block_layout(c), c.ffn_dim());
        let scratch = seq * (2 * dims.width + dims.qkv + dims.attn + 3 * dims.mlp) * compute;
        let stream = (cap_rows + img_rows + seq) * d * 4 + seq * c.patch_dim() * 4;
        let patches = items.len() * n_img * c.patch_dim() * compute;
        let blocks = c.n_refiner_layers + c.n_layers;
        let modulations = (blocks * 4 + 1) * steps * d * 4;
        let rope = 2 * seq * c.head_dim() / 2 * 4;
        Ok(stream + scratch + patches + modulations + rope)
    }
}

fn block_layout(cfg: &TransformerConfig) -> QkvLayout {
    QkvLayout {
        heads_q: cfg.n_heads,
        heads_kv: cfg.n_heads,
        head_dim: cfg.head_dim(),
    }
}

pub struct ZImageTransformer<B: Backend> {
    cfg: TransformerConfig,
    x_embedder: Linear<B>,
    x_pad_token: B::Table,
    cap_pad_token: B::Table,
    cap_norm: B::Vector,
    cap_embedder: Linear<B>,
    t_mlp0: Linear<B>,
    t_mlp2: Linear<B>,
    noise_refiner: Vec<Block<B>>,
    context_refiner: Vec<Block<B>>,
    layers: Vec<Block<B>>,
    final_adaln: Linear<B>,
    final_linear: Linear<B>,
    /// The sinusoid's frequencies ([`timestep_frequencies`] unless replaced).
    t_freqs: Vec<f32>,
}

/// Everything about one generation that does not depend on the latent (see the module docs),
/// and the activations of its steps.
pub struct Prepared<B: Backend> {
    items: Vec<ItemLayout>,
    latent_hw: (usize, usize),
    steps: usize,
    /// Raw adaLN outputs `[steps, 4·dim]` of each noise-refiner block, then each main layer.
    mods: Vec<B::Buf>,
    /// Raw final-layer scales `[steps, dim]`.
    final_scale: B::Buf,
    rope: RopeTable<B>,
    /// Rows of the RoPE table for the image rows, the caption rows and the joint rows.
    pos_img: B::Buf,
    pos_cap: B::Buf,
    pos_joint: B::Buf,
    segs_img: Segments<B>,
    segs_cap: Segments<B>,
    segs_joint: Segments<B>,
    /// Context-refined caption rows of every item `[Σ cap_p, dim]`.
    cap: B::Buf,
    /// Image rows of every item `[Σ n_img_p, dim]`, then the joint sequences `[S, dim]`.
    x: B::Buf,
    u: B::Buf,
    /// Patchified latent `[n_img, patch_dim]` and the final layer's output `[S, patch_dim]`.
    patches: B::Buf,
    out: B::Buf,
    /// Zeros: the row index of the one-row pad-token tables, one per pad row.
    zeros: B::Buf,
    scratch: Scratch<B>,
}

impl<B: Backend> Prepared<B> {
    pub fn items(&self) -> &[ItemLayout] {
        &self.items
    }
    pub fn steps(&self) -> usize {
        self.steps
    }
}

impl<B: Backend> ZImageTransformer<B> {
    /// Load from a checkpoint in either layout, checking every tensor's shape against `cfg`.
    pub fn load(be: &B, cfg: &TransformerConfig, weights: &Weights) -> Result<Self> {
        let naming = Naming::detect(weights)?;
        let fused = matches!(naming, Naming::Original { .. });
        let rename = |n: &str| naming.name(n);
        let l = Loader::new(be, &naming.root(weights)).renamed(&rename);
        let (d, a) = (cfg.dim, cfg.adaln_dim());
        let blocks = |prefix: &str, n: usize, modulated: bool| -> Result<Vec<Block<B>>> {
            (0..n)
                .map(|i| Block::load(&l.pp(format_args!("{prefix}.{i}")), cfg, fused, modulated))
                .collect()
        };
        Ok(ZImageTransformer {
            x_embedder: l.linear("all_x_embedder.2-1", d, cfg.patch_dim())?,
            x_pad_token: l.table("x_pad_token", &[1, d])?,
            cap_pad_token: l.table("cap_pad_token", &[1, d])?,
            cap_norm: l.vector("cap_embedder.0.weight", cfg.cap_feat_dim)?,
            cap_embedder: l.linear("cap_embedder.1", d, cfg.cap_feat_dim)?,
            t_mlp0: l.linear("t_embedder.mlp.0", T_MID_DIM, T_FREQ_DIM)?,
            t_mlp2: l.linear("t_embedder.mlp.2", a, T_MID_DIM)?,
            noise_refiner: blocks("noise_refiner", cfg.n_refiner_layers, true)?,
            context_refiner: blocks("context_refiner", cfg.n_refiner_layers, false)?,
            layers: blocks("layers", cfg.n_layers, true)?,
            final_adaln: l.linear("all_final_layer.2-1.adaLN_modulation.1", d, a)?,
            final_linear: l.linear("all_final_layer.2-1.linear", cfg.patch_dim(), d)?,
            t_freqs: timestep_frequencies(),
            cfg: cfg.clone(),
        })
    }

    /// [`TransformerConfig::activation_bytes`] of this transformer's config.
    pub fn activation_bytes(
        &self,
        latent_hw: (usize, usize),
        cap_lens: &[usize],
        steps: usize,
        compute: usize,
    ) -> Result<usize> {
        self.cfg
            .activation_bytes(latent_hw, cap_lens, steps, compute)
    }

    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// Replace the timestep sinusoid's 128 frequencies (see [`timestep_frequencies`] for why a
    /// parity test wants the reference's own table).
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

    /// Prepare a generation: `caps` are the caption features of each item (`[L_i, cap_feat_dim]`,
    /// real tokens only), `latent_hw` the latent size, `t_model` the transformer time of each step.
    pub fn prepare(
        &self,
        be: &B,
        caps: &[View<'_, B>],
        latent_hw: (usize, usize),
        t_model: &[f32],
        mut taps: Option<&mut Taps>,
    ) -> Result<Prepared<B>> {
        let c = &self.cfg;
        let (d, steps) = (c.dim, t_model.len());
        if caps.is_empty() || steps == 0 {
            return Err(Error::input(
                "a generation needs at least one caption and one step",
            ));
        }
        if let Some(bad) = caps.iter().find(|v| v.cols != c.cap_feat_dim) {
            return Err(Error::input(format!(
                "caption features are {} wide; the transformer expects cap_feat_dim {}",
                bad.cols, c.cap_feat_dim
            )));
        }
        let items = caps
            .iter()
            .map(|v| ItemLayout::new(c, latent_hw, v.rows))
            .collect::<Result<Vec<_>>>()?;
        let seq: usize = items.iter().map(ItemLayout::seq_len).sum();
        let img_rows: usize = items.iter().map(|i| i.n_img_p).sum();
        let cap_rows: usize = items.iter().map(|i| i.cap_p).sum();
        let (s, e) = (Role::Stream, Role::Compute);

        let (mods, final_scale) = self.modulations(be, t_model, items.len(), &mut taps)?;

        // RoPE table over every item's joint rows, and which rows each stage reads.
        let rope_axes = MultiAxis::new(c.rope_theta, &c.axes_dims);
        let (mut pos_img, mut pos_cap) =
            (Vec::with_capacity(img_rows), Vec::with_capacity(cap_rows));
        let mut angles = Vec::with_capacity(seq * c.head_dim() / 2);
        let mut base = 0u32;
        for it in &items {
            angles.extend(rope_axes.angles(&it.positions()));
            pos_img.extend(base..base + it.n_img_p as u32);
            pos_cap.extend(base + it.n_img_p as u32..base + it.seq_len() as u32);
            base += it.seq_len() as u32;
        }
        let half = c.head_dim() / 2;
        let rope = RopeTable::from_angles(be, &angles, seq, half, RopeStyle::Interleaved)?;
        let upload = |v: &[u32]| -> Result<B::Buf> {
            let mut b = be.alloc(v.len(), Role::Index)?;
            be.write_u32(&mut b, v)?;
            Ok(b)
        };
        let joint: Vec<u32> = (0..seq as u32).collect();
        if taps.is_some() {
            let mut off = 0;
            for (i, it) in items.iter().enumerate() {
                let table = View::new(&rope.buf, 2 * seq, half);
                Taps::put(&mut taps, be, "rope_cos", i, table.rows(off, it.seq_len()))?;
                Taps::put(
                    &mut taps,
                    be,
                    "rope_sin",
                    i,
                    table.rows(seq + off, it.seq_len()),
                )?;
                off += it.seq_len();
            }
        }

        let widest_pad = items
            .iter()
            .map(|i| (i.n_img_p - i.n_img).max(i.cap_p - i.cap_len))
            .max()
            .unwrap_or(0);
        let mut prep = Prepared {
            latent_hw,
            steps,
            mods,
            final_scale,
            pos_img: upload(&pos_img)?,
            pos_cap: upload(&pos_cap)?,
            pos_joint: upload(&joint)?,
            segs_img: be.segments(&items.iter().map(|i| i.n_img_p).collect::<Vec<_>>())?,
            segs_cap: be.segments(&items.iter().map(|i| i.cap_p).collect::<Vec<_>>())?,
            segs_joint: be.segments(&items.iter().map(ItemLayout::seq_len).collect::<Vec<_>>())?,
            rope,
            cap: be.alloc(cap_rows * d, s)?,
            x: be.alloc(img_rows * d, s)?,
            u: be.alloc(seq * d, s)?,
            patches: be.alloc(items.len() * items[0].n_img * c.patch_dim(), e)?,
            out: be.alloc(seq * c.patch_dim(), s)?,
            zeros: be.alloc(widest_pad.max(1), Role::Index)?,
            scratch: Scratch::alloc(be, seq, ScratchDims::new(d, block_layout(c), c.ffn_dim()))?,
            items,
        };

        self.caption_path(be, caps, &mut prep, &mut taps)?;
        Ok(prep)
    }

    /// The timestep embedding of every step and, from it, every modulated block's raw adaLN
    /// output `[steps, 4·dim]` (noise refiner, then main layers) and the final layer's raw scale
    /// `[steps, dim]`.
    fn modulations(
        &self,
        be: &B,
        t_model: &[f32],
        items: usize,
        taps: &mut Option<&mut Taps>,
    ) -> Result<(Vec<B::Buf>, B::Buf)> {
        let c = &self.cfg;
        let (d, a, steps, e) = (c.dim, c.adaln_dim(), t_model.len(), Role::Compute);
        let feats: Vec<f32> = t_model
            .iter()
            .flat_map(|&t| timestep_features(&self.t_freqs, t, c.t_scale))
            .collect();
        let mut tf = be.alloc(feats.len(), e)?;
        be.write_f32(&mut tf, &feats)?;
        let mut mid = be.alloc(steps * T_MID_DIM, e)?;
        be.matmul(
            View::new(&tf, steps, T_FREQ_DIM),
            &self.t_mlp0.w,
            ViewMut::new(&mut mid, steps, T_MID_DIM),
            &self.t_mlp0.epilogue().act(Activation::Silu),
        )?;
        let (mut temb, mut temb_silu) = (be.alloc(steps * a, e)?, be.alloc(steps * a, e)?);
        let mid_v = View::new(&mid, steps, T_MID_DIM);
        be.matmul(
            mid_v,
            &self.t_mlp2.w,
            ViewMut::new(&mut temb, steps, a),
            &self.t_mlp2.epilogue(),
        )?;
        // The final layer reads SiLU(temb): the same tiny GEMM with a SiLU epilogue.
        be.matmul(
            mid_v,
            &self.t_mlp2.w,
            ViewMut::new(&mut temb_silu, steps, a),
            &self.t_mlp2.epilogue().act(Activation::Silu),
        )?;
        let mut mods = Vec::with_capacity(self.noise_refiner.len() + self.layers.len());
        for b in self.noise_refiner.iter().chain(&self.layers) {
            let ada = b
                .adaln
                .as_ref()
                .ok_or_else(|| Error::backend("zimage", "modulated block without adaLN"))?;
            // Modulation rows are read as f32 by the norms and residual gates, in any precision.
            let mut m = be.alloc(steps * 4 * d, Role::Stream)?;
            be.matmul(
                View::new(&temb, steps, a),
                &ada.w,
                ViewMut::new(&mut m, steps, 4 * d),
                &ada.epilogue(),
            )?;
            mods.push(m);
        }
        let mut final_scale = be.alloc(steps * d, Role::Stream)?;
        be.matmul(
            View::new(&temb_silu, steps, a),
            &self.final_adaln.w,
            ViewMut::new(&mut final_scale, steps, d),
            &self.final_adaln.epilogue(),
        )?;
        if taps.is_some() {
            for i in 0..items {
                for st in 0..steps {
                    // Items share the step's modulation; taps are per item to match the fixture.
                    let key = |n: &str| {
                        if steps == 1 {
                            n.to_string()
                        } else {
                            format!("{n}@{st}")
                        }
                    };
                    Taps::put(
                        taps,
                        be,
                        &key("temb"),
                        i,
                        View::new(&temb, steps, a).rows(st, 1),
                    )?;
                    for (bi, m) in mods.iter().enumerate() {
                        let name = if bi < self.noise_refiner.len() {
                            format!("mod_nr{bi}")
                        } else {
                            format!("mod_l{}", bi - self.noise_refiner.len())
                        };
                        Taps::put(
                            taps,
                            be,
                            &key(&name),
                            i,
                            View::new(m, steps, 4 * d).rows(st, 1),
                        )?;
                    }
                    Taps::put(
                        taps,
                        be,
                        &key("final_mod"),
                        i,
                        View::new(&final_scale, steps, d).rows(st, 1),
                    )?;
                }
            }
        }

        Ok((mods, final_scale))
    }

    /// The caption rows of every item: RMSNorm → linear, pad rows := `cap_pad_token`, then the
    /// unmodulated context-refiner blocks.
    fn caption_path(
        &self,
        be: &B,
        caps: &[View<'_, B>],
        prep: &mut Prepared<B>,
        taps: &mut Option<&mut Taps>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (d, e) = (c.dim, Role::Compute);
        let cap_rows = prep.segs_cap.total();
        let widest_cap = caps.iter().map(|v| v.rows).max().unwrap_or(0);
        let mut normed = be.alloc(widest_cap * c.cap_feat_dim, e)?;
        let mut off = 0;
        for (i, (v, it)) in caps.iter().zip(&prep.items).enumerate() {
            let normed_v = ViewMut::new(&mut normed, it.cap_len, c.cap_feat_dim);
            be.norm(*v, &RowNorm::rms(&self.cap_norm, c.norm_eps), normed_v)?;
            let rows = ViewMut::new(&mut prep.cap, cap_rows, d).rows(off, it.cap_len);
            be.matmul(
                View::new(&normed, it.cap_len, c.cap_feat_dim),
                &self.cap_embedder.w,
                rows,
                &self.cap_embedder.epilogue(),
            )?;
            let pad = ViewMut::new(&mut prep.cap, cap_rows, d)
                .rows(off + it.cap_len, it.cap_p - it.cap_len);
            be.embed(&self.cap_pad_token, &prep.zeros, 1.0, pad)?;
            Taps::put(
                taps,
                be,
                "cap_seq",
                i,
                View::new(&prep.cap, cap_rows, d).rows(off, it.cap_p),
            )?;
            off += it.cap_p;
        }
        for (bi, b) in self.context_refiner.iter().enumerate() {
            let Prepared {
                cap,
                scratch,
                rope,
                pos_cap,
                segs_cap,
                ..
            } = &mut *prep;
            self.block(be, b, cap, cap_rows, scratch, rope, pos_cap, segs_cap, None)?;
            let mut off = 0;
            for (i, it) in prep.items.iter().enumerate() {
                let v = View::new(&prep.cap, cap_rows, d).rows(off, it.cap_p);
                Taps::put(taps, be, &format!("cr{bi}_out"), i, v)?;
                off += it.cap_p;
            }
        }
        Ok(())
    }

    /// The velocity `v` of every item at `step` for each item's latent `[in_channels, h, w]`
    /// (the sampler's f32 latents; the items of a CFG pair share one), each `[in_channels, h, w]`.
    /// The pipeline steps with `−v`.
    pub fn forward(
        &self,
        be: &B,
        prep: &mut Prepared<B>,
        latents: &[&[f32]],
        step: usize,
        mut taps: Option<&mut Taps>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let (d, pd) = (c.dim, c.patch_dim());
        let (h, w) = prep.latent_hw;
        if latents.len() != prep.items.len() {
            return Err(Error::input(format!(
                "{} latents for {} items",
                latents.len(),
                prep.items.len()
            )));
        }
        if let Some(bad) = latents.iter().find(|l| l.len() != c.in_channels * h * w) {
            return Err(Error::input(format!(
                "latent of {} values; expected {}×{h}×{w}",
                bad.len(),
                c.in_channels
            )));
        }
        if step >= prep.steps {
            return Err(Error::input(format!(
                "step {step} of a {}-step preparation",
                prep.steps
            )));
        }
        let img_rows: usize = prep.items.iter().map(|i| i.n_img_p).sum();
        let seq = prep.segs_joint.total();
        let n_img = prep.items[0].n_img;
        let patches: Vec<f32> = latents
            .iter()
            .flat_map(|l| patchify(l, c.in_channels, (h, w)))
            .collect();
        be.write_f32(&mut prep.patches, &patches)?;
        let mut off = 0;
        for (i, it) in prep.items.iter().enumerate() {
            let x = ViewMut::new(&mut prep.x, img_rows, d);
            be.matmul(
                View::new(&prep.patches, latents.len() * n_img, pd).rows(i * n_img, n_img),
                &self.x_embedder.w,
                x.rows(off, n_img),
                &self.x_embedder.epilogue(),
            )?;
            let pad = ViewMut::new(&mut prep.x, img_rows, d).rows(off + n_img, it.n_img_p - n_img);
            be.embed(&self.x_pad_token, &prep.zeros, 1.0, pad)?;
            Taps::put(
                &mut taps,
                be,
                "x_seq",
                i,
                View::new(&prep.x, img_rows, d).rows(off, it.n_img_p),
            )?;
            off += it.n_img_p;
        }
        let steps = prep.steps;
        for (bi, b) in self.noise_refiner.iter().enumerate() {
            let Prepared {
                x,
                scratch,
                rope,
                pos_img,
                segs_img,
                mods,
                ..
            } = &mut *prep;
            let m = View::new(&mods[bi], steps, 4 * d).rows(step, 1);
            self.block(
                be,
                b,
                x,
                img_rows,
                scratch,
                rope,
                pos_img,
                segs_img,
                Some(m),
            )?;
            let mut off = 0;
            for (i, it) in prep.items.iter().enumerate() {
                let v = View::new(&prep.x, img_rows, d).rows(off, it.n_img_p);
                Taps::put(&mut taps, be, &format!("nr{bi}_out"), i, v)?;
                off += it.n_img_p;
            }
        }
        // Joint sequences [image | caption] per item.
        let (mut xo, mut co, mut uo) = (0, 0, 0);
        let cap_rows = prep.segs_cap.total();
        for (i, it) in prep.items.iter().enumerate() {
            let u = ViewMut::new(&mut prep.u, seq, d);
            be.cast(
                View::new(&prep.x, img_rows, d).rows(xo, it.n_img_p),
                u.rows(uo, it.n_img_p),
            )?;
            let u = ViewMut::new(&mut prep.u, seq, d);
            be.cast(
                View::new(&prep.cap, cap_rows, d).rows(co, it.cap_p),
                u.rows(uo + it.n_img_p, it.cap_p),
            )?;
            Taps::put(
                &mut taps,
                be,
                "u_in",
                i,
                View::new(&prep.u, seq, d).rows(uo, it.seq_len()),
            )?;
            xo += it.n_img_p;
            co += it.cap_p;
            uo += it.seq_len();
        }
        let nr = self.noise_refiner.len();
        for (li, b) in self.layers.iter().enumerate() {
            let Prepared {
                u,
                scratch,
                rope,
                pos_joint,
                segs_joint,
                mods,
                ..
            } = &mut *prep;
            let m = View::new(&mods[nr + li], steps, 4 * d).rows(step, 1);
            self.block(be, b, u, seq, scratch, rope, pos_joint, segs_joint, Some(m))?;
            tap_joint(
                be,
                prep,
                &mut taps,
                &format!("l{li}_out"),
                View::new(&prep.u, seq, d),
            )?;
        }
        // Final layer: LayerNorm (no affine) · (1 + scale) → linear, on every row.
        let fin = RowNorm::plain(NormKind::Layer, FINAL_NORM_EPS)
            .modulated(View::new(&prep.final_scale, steps, d).rows(step, 1));
        be.norm(
            View::new(&prep.u, seq, d),
            &fin,
            ViewMut::new(&mut prep.scratch.a, seq, d),
        )?;
        be.matmul(
            View::new(&prep.scratch.a, seq, d),
            &self.final_linear.w,
            ViewMut::new(&mut prep.out, seq, pd),
            &self.final_linear.epilogue(),
        )?;
        tap_joint(
            be,
            prep,
            &mut taps,
            "final_out",
            View::new(&prep.out, seq, pd),
        )?;
        let mut out = Vec::with_capacity(prep.items.len());
        let mut off = 0;
        for it in &prep.items {
            let rows = be.read_f32(View::new(&prep.out, seq, pd).rows(off, it.n_img))?;
            out.push(unpatchify(&rows, c.in_channels, (h, w)));
            off += it.seq_len();
        }
        if let Some(t) = taps {
            for (i, v) in out.iter().enumerate() {
                t.values.insert(("v".into(), i), v.clone());
            }
        }
        Ok(out)
    }

    /// One `ZImageTransformerBlock` on the `rows` rows of `x` (spec §3.5), in place:
    /// `x += tanh(g_msa)·N₂(attn(N₁(x)·(1+s_msa)))`, `x += tanh(g_mlp)·N₄(ffn(N₃(x)·(1+s_mlp)))`;
    /// without modulation the scales are 0 and the gates 1.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        be: &B,
        b: &Block<B>,
        x: &mut B::Buf,
        rows: usize,
        ws: &mut Scratch<B>,
        rope: &RopeTable<B>,
        pos: &B::Buf,
        segs: &Segments<B>,
        m: Option<View<'_, B>>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (d, eps) = (c.dim, c.norm_eps);
        let chunk = |k: usize| m.map(|m| m.cols(k * d, d));
        be.norm(
            View::new(x, rows, d),
            &RowNorm::rms(&b.attention_norm1, eps).modulated_by(chunk(0)),
            ViewMut::new(&mut ws.a, rows, d),
        )?;
        let attn = SelfAttention {
            w: &b.attn,
            v_norm: false,
            eps: QK_NORM_EPS,
            rope: Some((rope, pos)),
            spec: AttnSpec::new(b.attn.layout, (c.head_dim() as f32).powf(-0.5), Mask::Full),
        };
        let res = Residual::post_norm(RowNorm::rms(&b.attention_norm2, eps)).tanh_gated(chunk(1));
        let mid = RowNorm::rms(&b.ffn_norm1, eps).modulated_by(chunk(2));
        attention_then_mlp(
            be,
            &attn,
            &res,
            mid,
            &b.mlp,
            Activation::Silu,
            segs,
            rows,
            x,
            ws,
        )?;
        be.residual(
            ViewMut::new(x, rows, d),
            View::new(&ws.y, rows, d),
            &Residual::post_norm(RowNorm::rms(&b.ffn_norm2, eps)).tanh_gated(chunk(3)),
            After::Nothing,
        )
    }
}

/// Record a tap over the joint rows of every item.
fn tap_joint<B: Backend>(
    be: &B,
    prep: &Prepared<B>,
    taps: &mut Option<&mut Taps>,
    name: &str,
    v: View<'_, B>,
) -> Result<()> {
    if taps.is_none() {
        return Ok(());
    }
    let mut off = 0;
    for (i, it) in prep.items.iter().enumerate() {
        Taps::put(taps, be, name, i, v.rows(off, it.seq_len()))?;
        off += it.seq_len();
    }
    Ok(())
}
