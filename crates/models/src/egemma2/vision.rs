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
    Activation, After, AttnSpec, Backend, Epilogue, Mask, NormKind, QkvLayout, Residual, Role,
    RopeStyle, RopeTable, RowNorm, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::VisionConfig;
use crate::blocks::rope::axial_inv_freq;
use crate::blocks::{
    AttnNames, LayerShape, MlpNames, QkvNames, SandwichLayer, Scratch, ScratchDims, SelfAttention,
};
use crate::imageproc::Patches;
use crate::loader::Loader;

/// The vision tower's names: its linears are wrapped (`q_proj.linear.weight`).
const ATTENTION: AttnNames = AttnNames {
    qkv: QkvNames::Separate {
        q: "self_attn.q_proj.linear.weight",
        k: "self_attn.k_proj.linear.weight",
        v: "self_attn.v_proj.linear.weight",
    },
    o: "self_attn.o_proj.linear.weight",
    q_norm: "self_attn.q_norm.weight",
    k_norm: "self_attn.k_norm.weight",
};
const MLP: MlpNames = MlpNames {
    gate: "mlp.gate_proj.linear.weight",
    up: "mlp.up_proj.linear.weight",
    down: "mlp.down_proj.linear.weight",
};

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
    scratch: Scratch<B>,
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
    layers: Vec<SandwichLayer<B>>,
    rope: RopeTable<B>,
    proj: B::Mat,
    ws: Option<Workspace<B>>,
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
        let tl = Loader::new(be, tower);
        let pe = tl.pp("patch_embedder");
        let patch_in = 3 * cfg.patch_size * cfg.patch_size;
        let shape = LayerShape {
            layout,
            width: d,
            mlp: cfg.intermediate_size,
        };
        let layers = (0..cfg.num_layers)
            .map(|i| {
                SandwichLayer::load(
                    &tl.pp(format_args!("encoder.layers.{i}")),
                    &ATTENTION,
                    &MLP,
                    shape,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        // Axial RoPE: head_dim/4 frequencies over head_dim/2 channels per axis, shared by x and y.
        let inv = axial_inv_freq(cfg.rope_theta, cfg.head_dim);
        let rope = RopeTable::new(be, &inv, cfg.position_embedding_size, RopeStyle::Axial2d)?;
        Ok(VisionEncoder {
            cfg: cfg.clone(),
            layout,
            text_hidden,
            patch_proj: pe.matrix("input_proj.weight", d, patch_in)?,
            positions: pe.table(
                "position_embedding_table",
                &[2, cfg.position_embedding_size, d],
            )?,
            layers,
            rope,
            proj: Loader::new(be, embed).matrix("embedding_projection.weight", text_hidden, d)?,
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
        let (d, lay) = (c.hidden_size, self.layout);
        let dims = ScratchDims::new(d, lay, c.intermediate_size);
        let (s, e) = (Role::Stream, Role::Compute);
        self.ws = Some(Workspace {
            rows,
            pooled,
            px: be.alloc(rows * 3 * c.patch_size * c.patch_size, e)?,
            pos: be.alloc(2 * rows, Role::Index)?,
            h: be.alloc(rows * d, s)?,
            scratch: Scratch::alloc(be, rows, dims)?,
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
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("vision tower", "workspace missing after allocation"))?;
        let px: Vec<&[u8]> = images.iter().map(|p| p.pixels.as_slice()).collect();
        let pos: Vec<u32> = images
            .iter()
            .flat_map(|p| p.positions().flat_map(|(x, y)| [x, y]))
            .collect();
        be.write_u8_mapped(&mut ws.px, &px, &crate::imageproc::pixel_values())?;
        be.write_u32(&mut ws.pos, &pos)?;

        let Workspace {
            px: pxb,
            pos: posb,
            h,
            scratch: sc,
            pooled_h,
            pooled_n,
            soft,
            ..
        } = ws;
        // h = patches · W_inᵀ + T_x[x] + T_y[y]; a = N_in0(h)
        be.matmul(
            View::new(pxb, n, pin),
            &self.patch_proj,
            ViewMut::new(h, n, d),
            &Epilogue::default(),
        )?;
        be.add_positions_2d(
            &self.positions,
            c.position_embedding_size,
            posb,
            ViewMut::new(h, n, d),
        )?;
        if let Some(l0) = self.layers.first() {
            be.norm(
                View::new(h, n, d),
                &RowNorm::rms(&l0.input_norm, eps),
                ViewMut::new(&mut sc.a, n, d),
            )?;
        }
        for (i, l) in self.layers.iter().enumerate() {
            let attn = SelfAttention {
                w: &l.attn,
                v_norm: true,
                eps,
                rope: Some((&self.rope, &*posb)),
                spec: AttnSpec::new(lay, 1.0, Mask::Full),
            };
            l.attention_and_mlp(be, &attn, Activation::GeluTanh, &segs, n, h, sc)?;
            let after = match self.layers.get(i + 1) {
                Some(next) => After::Norm(
                    RowNorm::rms(&next.input_norm, eps),
                    ViewMut::new(&mut sc.a, n, d),
                ),
                None => After::Nothing,
            };
            be.residual(
                ViewMut::new(h, n, d),
                View::new(&sc.y, n, d),
                &Residual::post_norm(RowNorm::rms(&l.post_ff_norm, eps)),
                after,
            )?;
        }
        // Pool each image's grid k×k and scale by √D (the reference does this in f32), then the
        // embedder: weightless RMSNorm and the projection to the text width.
        be.avg_pool2d(
            View::new(h, n, d),
            &grids,
            (d as f64).sqrt() as f32,
            ViewMut::new(pooled_h, pooled, d),
        )?;
        be.norm(
            View::new(pooled_h, pooled, d),
            &RowNorm::plain(NormKind::Rms, eps),
            ViewMut::new(pooled_n, pooled, d),
        )?;
        be.matmul(
            View::new(pooled_n, pooled, d),
            &self.proj,
            ViewMut::new(soft, pooled, th),
            &Epilogue::default(),
        )?;
        Ok(View::new(soft, pooled, th))
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
