//! The EmbeddingGemma 2 vision tower and its projection into the text width (spec §2.2).
//!
//! Reference: `Gemma4VisionModel` (`transformers/models/gemma4/modeling_gemma4.py`) and
//! `EmbeddingGemma2MultimodalEmbedder` (transformers 5.25.0).
//!
//! Patches → linear projection + learned x and y position rows → layers of sandwich-normed
//! bidirectional attention (q/k norms with weights, weightless v norm, axial 2-D RoPE: the first
//! half of each head rotated by the patch column, the second by its row) and a GELU-tanh gated
//! MLP → `k × k` average pooling of each image's grid, × √hidden → weightless RMSNorm → linear
//! to the text width: the soft tokens that replace an image's `<|image|>` rows.
//!
//! Images are packed back to back, each its own attention segment and pooling grid: no padding
//! rows (the reference pads every image to the budget's patch count and masks the padding, so
//! the results are the same).

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Epilogue, QkvLayout, Role, RopeStyle, RopeTable, View,
    ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::VisionConfig;
use super::text::default_inv_freq;
use crate::blocks::{GatedMlp, LayerBuffers, SandwichLayer, SelfAttention};
use crate::imageproc::Patches;

struct Layer<B: Backend> {
    qkv: B::Mat,
    q_norm: B::Vector,
    k_norm: B::Vector,
    o: B::Mat,
    input_norm: B::Vector,
    post_attn_norm: B::Vector,
    pre_ff_norm: B::Vector,
    post_ff_norm: B::Vector,
    gate_up: B::Mat,
    down: B::Mat,
}

/// Activations for up to `rows` patches and `pooled` soft tokens, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    pooled: usize,
    /// Patch pixels `[N, 3·patch²]` as a GEMM input.
    px: B::Buf,
    /// `(x, y)` per patch.
    pos: B::Buf,
    /// Residual stream `[N, D]`.
    h: B::Buf,
    a: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    y: B::Buf,
    gu: B::Buf,
    g: B::Buf,
    /// Pooled and scaled `[S, D]`, normed `[S, D]`, projected soft tokens `[S, H_text]`.
    pooled_h: B::Buf,
    pooled_n: B::Buf,
    soft: B::Buf,
}

pub struct VisionEncoder<B: Backend> {
    cfg: VisionConfig,
    layout: QkvLayout,
    text_hidden: usize,
    patch_proj: B::Mat,
    positions: B::Table,
    layers: Vec<Layer<B>>,
    rope: RopeTable<B>,
    proj: B::Mat,
    ws: Option<Workspace<B>>,
}

fn vector<B: Backend>(be: &B, w: &Weights, name: &str, n: usize) -> Result<B::Vector> {
    be.vector(&w.f32(name, &[n])?)
}

fn matrix<B: Backend>(be: &B, w: &Weights, name: &str, out: usize, inner: usize) -> Result<B::Mat> {
    be.matrix(&[(&w.f32(name, &[out, inner])?, out)], inner)
}

impl<B: Backend> VisionEncoder<B> {
    /// Load `vision_tower.*` (`tower`) and `embed_vision.*` (`embed`), checking every shape.
    pub fn load(
        be: &B,
        cfg: &VisionConfig,
        text_hidden: usize,
        tower: &Weights,
        embed: &Weights,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let layout = QkvLayout {
            heads_q: cfg.num_heads,
            heads_kv: cfg.kv_heads,
            head_dim: cfg.head_dim,
        };
        let (qc, kc, im) = (layout.q_cols(), layout.kv_cols(), cfg.intermediate_size);
        let pe = tower.pp("patch_embedder");
        let patch_in = 3 * cfg.patch_size * cfg.patch_size;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = tower.pp(format!("encoder.layers.{i}"));
            let lin = |name: &str, out: usize, inner: usize| {
                lw.f32(&format!("{name}.linear.weight"), &[out, inner])
            };
            let (q, k, v) = (
                lin("self_attn.q_proj", qc, d)?,
                lin("self_attn.k_proj", kc, d)?,
                lin("self_attn.v_proj", kc, d)?,
            );
            let (gate, up) = (lin("mlp.gate_proj", im, d)?, lin("mlp.up_proj", im, d)?);
            layers.push(Layer {
                qkv: be.matrix(&[(&q, qc), (&k, kc), (&v, kc)], d)?,
                q_norm: vector(be, &lw, "self_attn.q_norm.weight", cfg.head_dim)?,
                k_norm: vector(be, &lw, "self_attn.k_norm.weight", cfg.head_dim)?,
                o: be.matrix(&[(&lin("self_attn.o_proj", d, qc)?, d)], qc)?,
                input_norm: vector(be, &lw, "input_layernorm.weight", d)?,
                post_attn_norm: vector(be, &lw, "post_attention_layernorm.weight", d)?,
                pre_ff_norm: vector(be, &lw, "pre_feedforward_layernorm.weight", d)?,
                post_ff_norm: vector(be, &lw, "post_feedforward_layernorm.weight", d)?,
                gate_up: be.matrix(&[(&gate, im), (&up, im)], d)?,
                down: be.matrix(&[(&lin("mlp.down_proj", d, im)?, d)], im)?,
            });
        }
        // Axial RoPE: head_dim/4 frequencies over head_dim/2 channels per axis, shared by x and y.
        let inv = default_inv_freq(cfg.rope_theta, cfg.head_dim / 2);
        let rope = RopeTable::new(be, &inv, cfg.position_embedding_size, RopeStyle::Axial2d)?;
        Ok(VisionEncoder {
            cfg: cfg.clone(),
            layout,
            text_hidden,
            patch_proj: matrix(be, &pe, "input_proj.weight", d, patch_in)?,
            positions: be.table_nd(
                &pe,
                "position_embedding_table",
                &[2, cfg.position_embedding_size, d],
            )?,
            layers,
            rope,
            proj: matrix(be, embed, "embedding_projection.weight", text_hidden, d)?,
            ws: None,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    fn ensure_workspace(&mut self, be: &B, rows: usize, pooled: usize) -> Result<()> {
        if self
            .ws
            .as_ref()
            .is_some_and(|w| w.rows >= rows && w.pooled >= pooled)
        {
            return Ok(());
        }
        self.ws = None; // free the old one first
        let c = &self.cfg;
        let (d, im, lay) = (c.hidden_size, c.intermediate_size, self.layout);
        let (s, e) = (Role::Stream, Role::Compute);
        self.ws = Some(Workspace {
            rows,
            pooled,
            px: be.alloc(rows * 3 * c.patch_size * c.patch_size, e)?,
            pos: be.alloc(2 * rows, Role::Index)?,
            h: be.alloc(rows * d, s)?,
            a: be.alloc(rows * d, e)?,
            qkv: be.alloc(rows * lay.width(), e)?,
            attn: be.alloc(rows * lay.q_cols(), e)?,
            y: be.alloc(rows * d, e)?,
            gu: be.alloc(rows * 2 * im, e)?,
            g: be.alloc(rows * im, e)?,
            pooled_h: be.alloc(pooled * d, s)?,
            pooled_n: be.alloc(pooled * d, e)?,
            soft: be.alloc(pooled * self.text_hidden, s)?,
        });
        Ok(())
    }

    /// Check that `images` fit this tower, before any work is done.
    pub fn check(&self, images: &[&Patches]) -> Result<()> {
        check_images(&self.cfg, images)
    }

    /// Encode images packed into one pass. Returns their soft tokens `[S, text hidden]` in image
    /// order, `(width/k)·(height/k)` rows per image.
    pub fn forward(&mut self, be: &B, images: &[&Patches]) -> Result<View<'_, B>> {
        self.check(images)?;
        let k = self.cfg.pooling_kernel_size;
        let dims: Vec<(usize, usize)> = images.iter().map(|p| (p.width, p.height)).collect();
        let grids = be.grids(&dims, k)?;
        let lens: Vec<usize> = images.iter().map(|p| p.len()).collect();
        let segs = be.segments(&lens)?;
        let (n, pooled) = (grids.patches(), grids.pooled());
        self.ensure_workspace(be, n, pooled)?;
        let c = &self.cfg;
        let (d, eps, lay, th) = (c.hidden_size, c.rms_norm_eps, self.layout, self.text_hidden);
        let pin = 3 * c.patch_size * c.patch_size;
        let ws = self.ws.as_mut().expect("workspace allocated above");
        let px: Vec<&[u8]> = images.iter().map(|p| p.pixels.as_slice()).collect();
        let pos: Vec<u32> = images
            .iter()
            .flat_map(|p| p.positions().flat_map(|(x, y)| [x, y]))
            .collect();
        be.write_u8_mapped(&mut ws.px, &px, &crate::imageproc::pixel_values())?;
        be.write_u32(&mut ws.pos, &pos)?;

        // h = patches · W_inᵀ + T_x[x] + T_y[y]; a = N_in0(h)
        be.matmul(
            View::new(&ws.px, n, pin),
            &self.patch_proj,
            ViewMut::new(&mut ws.h, n, d),
            Epilogue::default(),
        )?;
        be.add_positions_2d(
            &self.positions,
            c.position_embedding_size,
            &ws.pos,
            ViewMut::new(&mut ws.h, n, d),
        )?;
        if let Some(l0) = self.layers.first() {
            be.rms_norm(
                View::new(&ws.h, n, d),
                Some(&l0.input_norm),
                eps,
                ViewMut::new(&mut ws.a, n, d),
            )?;
        }
        let spec = AttnSpec {
            heads_q: lay.heads_q,
            heads_kv: lay.heads_kv,
            head_dim: lay.head_dim,
            scale: 1.0,
            window: None,
            causal: false,
        };
        let im = c.intermediate_size;
        for (i, l) in self.layers.iter().enumerate() {
            SandwichLayer {
                attn: SelfAttention {
                    qkv: &l.qkv,
                    o: &l.o,
                    layout: lay,
                    q_norm: Some(&l.q_norm),
                    k_norm: Some(&l.k_norm),
                    v_norm: true,
                    eps,
                    rope: Some((&self.rope, &ws.pos)),
                    spec,
                },
                post_attn_norm: &l.post_attn_norm,
                pre_ff_norm: &l.pre_ff_norm,
                mlp: GatedMlp {
                    gate_up: &l.gate_up,
                    down: &l.down,
                    inner: im,
                    act: Activation::GeluTanh,
                },
            }
            .attention_and_mlp(
                be,
                &segs,
                (n, d),
                LayerBuffers {
                    h: &mut ws.h,
                    a: &mut ws.a,
                    y: &mut ws.y,
                    qkv: &mut ws.qkv,
                    attn: &mut ws.attn,
                    gu: &mut ws.gu,
                    g: &mut ws.g,
                },
            )?;
            let after = match self.layers.get(i + 1) {
                Some(next) => After::Norm(&next.input_norm, ViewMut::new(&mut ws.a, n, d)),
                None => After::Nothing,
            };
            be.residual_norm(
                ViewMut::new(&mut ws.h, n, d),
                View::new(&ws.y, n, d),
                Some(&l.post_ff_norm),
                1.0,
                after,
                eps,
            )?;
        }
        // Pool each image's grid k×k and scale by √D (the reference does this in f32), then the
        // embedder: weightless RMSNorm and the projection to the text width.
        be.avg_pool2d(
            View::new(&ws.h, n, d),
            &grids,
            (d as f64).sqrt() as f32,
            ViewMut::new(&mut ws.pooled_h, pooled, d),
        )?;
        be.rms_norm(
            View::new(&ws.pooled_h, pooled, d),
            None,
            eps,
            ViewMut::new(&mut ws.pooled_n, pooled, d),
        )?;
        be.matmul(
            View::new(&ws.pooled_n, pooled, d),
            &self.proj,
            ViewMut::new(&mut ws.soft, pooled, th),
            Epilogue::default(),
        )?;
        Ok(View::new(&ws.soft, pooled, th))
    }
}

/// Check that `images` fit a tower of `c`, before any work is done (without the tower, so that
/// inputs can be checked while it runs).
pub fn check_images(c: &VisionConfig, images: &[&Patches]) -> Result<()> {
    let width = 3 * c.patch_size * c.patch_size;
    for (i, p) in images.iter().enumerate() {
        let side = p.width.max(p.height);
        if p.is_empty() || p.pixels.len() != p.len() * width {
            return Err(Error::input(format!(
                "image {}: {} values for {}×{} patches of {width}",
                i + 1,
                p.pixels.len(),
                p.width,
                p.height
            )));
        }
        if side > c.position_embedding_size {
            return Err(Error::input(format!(
                "image {}: a grid of {}×{} patches exceeds the vision tower's {} positions per \
                 side (position_embedding_size); use a smaller image budget or a less elongated image",
                i + 1,
                p.width,
                p.height,
                c.position_embedding_size
            )));
        }
    }
    Ok(())
}
