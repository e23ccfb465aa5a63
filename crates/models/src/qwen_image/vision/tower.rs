//! Qwen3-VL's vision tower (transformers 5.25.0 `Qwen3VLVisionModel`) on the backend's ops.
//!
//! Patch rows `[N, C·T·P·P]` (merge-block order, [`super::processor`]) → the Conv3d patch embed
//! as one product with bias (its kernel equals its stride, so it is a matrix over the flattened
//! row) + the learned position grid resampled to each image's grid ([`super::grid`]) → blocks:
//! `h += proj(attn(rope(qkv(LN1(h)))))`, `h += fc2(gelu_tanh(fc1(LN2(h))))` with biased
//! products, LayerNorms of eps 1e-6, bidirectional attention inside each image and 2-D rotary
//! embeddings on q and k (split-half pairs; the first quarter of the pairs turn with the patch's
//! row, the second with its column; no q/k norms) → the merger: LayerNorm per patch, each merge
//! block's patches side by side (consecutive rows, so `[N, C]` is `[N/4, 4C]` as it lies),
//! `fc2(gelu(fc1(·)))` into the language model's width. After each block the config names, a
//! DeepStack merger reads the stream the same way but normalises the side-by-side rows
//! (`use_postshuffle_norm`); its output is added to the language model's image rows after one of
//! its first layers.

use std::collections::HashMap;

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Mask, QkvLayout, QkvNorm, Residual, Role, RopeStyle,
    RopeTable, RowNorm, Segments, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::VisionConfig;
use super::grid::{position_rows, rope_angles, rope_inv_freq};
use super::processor::VisionImage;
use crate::loader::{Linear, Loader};

/// LayerNorm epsilon of every norm in the tower and its mergers.
const EPS: f32 = 1e-6;
/// Grid shapes whose position rows are kept at once.
const MAX_GRIDS: usize = 16;

struct LayerNorm<B: Backend> {
    w: B::Vector,
    b: B::Vector,
}

impl<B: Backend> LayerNorm<B> {
    fn load(l: &Loader<'_, B>, name: &str, n: usize) -> Result<Self> {
        Ok(LayerNorm {
            w: l.vector(&format!("{name}.weight"), n)?,
            b: l.vector(&format!("{name}.bias"), n)?,
        })
    }

    fn row(&self) -> RowNorm<'_, B> {
        RowNorm::layer(&self.w, &self.b, EPS)
    }
}

struct Block<B: Backend> {
    norm1: LayerNorm<B>,
    qkv: Linear<B>,
    proj: Linear<B>,
    norm2: LayerNorm<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// A patch merger: norm (per patch, or per merged row for DeepStack's), `fc1`, erf GELU, `fc2`.
struct Merger<B: Backend> {
    norm: LayerNorm<B>,
    postshuffle: bool,
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// Activations for up to `rows` patches, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    px: B::Buf,
    /// Rotary table row of each patch.
    pos: B::Buf,
    /// Residual stream `[N, C]`.
    h: B::Buf,
    /// Normed sub-block input `[N, C]`.
    a: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    y: B::Buf,
    /// MLP hidden `[N, F]`.
    g: B::Buf,
    /// A merger's normed rows and hidden `[N/4, 4C]`.
    mn: B::Buf,
    mh: B::Buf,
    /// The merger's output, then each DeepStack merger's, `[N/4, out]` each.
    out: Vec<B::Buf>,
}

/// The tower's outputs of one [`VisionTower::forward`]: views valid until the next call.
pub struct VisionFeatures<'a, B: Backend> {
    /// The merger's rows `[N/4, out_hidden]`, images in order: what replaces the pad tokens.
    pub merged: View<'a, B>,
    /// Each DeepStack merger's rows `[N/4, out_hidden]`, in the config's order.
    pub deepstack: Vec<View<'a, B>>,
}

/// The rotary table of a pass and the grids it was made for.
struct Rotary<B: Backend> {
    grids: Vec<(usize, usize)>,
    table: RopeTable<B>,
}

pub struct VisionTower<B: Backend> {
    cfg: VisionConfig,
    patch: Linear<B>,
    /// The learned position grid `[side², C]`, on the host (resampled there per grid shape).
    positions: Vec<f32>,
    grids: HashMap<(usize, usize), B::Buf>,
    blocks: Vec<Block<B>>,
    merger: Merger<B>,
    deepstack: Vec<Merger<B>>,
    /// Rotary angles, one row per patch of the last pass's grids (rebuilt when they change):
    /// memory in proportion to the images, whatever their aspect.
    rope: Option<Rotary<B>>,
    ws: Option<Workspace<B>>,
}

impl<B: Backend> VisionTower<B> {
    /// Load the tower from the text encoder's checkpoint (`model.visual.`, or `visual.` in
    /// checkpoints saved from `Qwen3VLModel`), checking every shape.
    pub fn load(be: &B, cfg: &VisionConfig, weights: &Weights) -> Result<Self> {
        let root = Loader::new(be, weights);
        let l = ["model.visual", "visual"]
            .into_iter()
            .map(|p| root.pp(p))
            .find(|l| l.has("patch_embed.proj.weight"))
            .ok_or_else(|| Error::MissingTensor {
                name: "model.visual.patch_embed.proj.weight".into(),
                location: "the text encoder checkpoint: it has no vision tower".into(),
            })?;
        let (c, f, p, t) = (cfg.hidden, cfg.intermediate, cfg.patch, cfg.temporal);
        let mut w = l.tensor("patch_embed.proj.weight", &[c, 3, t, p, p])?;
        w.shape = vec![c, cfg.row_width()];
        let patch = Linear {
            w: be.matrix(&[w])?,
            b: l.vector("patch_embed.proj.bias", c)?,
        };
        let side = cfg.pos_side;
        let positions = l.tensor("pos_embed.weight", &[side * side, c])?.to_f32();
        let blocks = (0..cfg.depth)
            .map(|i| {
                let b = l.pp(format_args!("blocks.{i}"));
                Ok(Block {
                    norm1: LayerNorm::load(&b, "norm1", c)?,
                    qkv: b.linear("attn.qkv", 3 * c, c)?,
                    proj: b.linear("attn.proj", c, c)?,
                    norm2: LayerNorm::load(&b, "norm2", c)?,
                    fc1: b.linear("mlp.linear_fc1", f, c)?,
                    fc2: b.linear("mlp.linear_fc2", c, f)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merger = |l: &Loader<'_, B>, postshuffle: bool| -> Result<Merger<B>> {
            let wide = c * cfg.merge_unit();
            Ok(Merger {
                norm: LayerNorm::load(l, "norm", if postshuffle { wide } else { c })?,
                postshuffle,
                fc1: l.linear("linear_fc1", wide, wide)?,
                fc2: l.linear("linear_fc2", cfg.out_hidden, wide)?,
            })
        };
        let deepstack = (0..cfg.deepstack.len())
            .map(|i| merger(&l.pp(format_args!("deepstack_merger_list.{i}")), true))
            .collect::<Result<Vec<_>>>()?;
        Ok(VisionTower {
            cfg: cfg.clone(),
            patch,
            positions,
            grids: HashMap::new(),
            blocks,
            merger: merger(&l.pp("merger"), false)?,
            deepstack,
            rope: None,
            ws: None,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Check images against the tower before any work: whole merge blocks, the right row width.
    pub fn check(&self, images: &[VisionImage]) -> Result<()> {
        let (m, width) = (self.cfg.merge, self.cfg.row_width());
        if images.is_empty() {
            return Err(Error::input("the vision tower needs at least one image"));
        }
        for (i, img) in images.iter().enumerate() {
            if img.patches() == 0
                || !img.grid_h.is_multiple_of(m)
                || !img.grid_w.is_multiple_of(m)
                || img.bytes.len() != img.patches() * width
            {
                return Err(Error::input(format!(
                    "image {}: {} bytes for a {}×{} patch grid of rows of {width} (sides must be \
                     multiples of {m})",
                    i + 1,
                    img.bytes.len(),
                    img.grid_w,
                    img.grid_h
                )));
            }
        }
        Ok(())
    }

    fn ensure(&mut self, be: &B, images: &[VisionImage]) -> Result<()> {
        let cfg = &self.cfg;
        let (c, f, n) = (
            cfg.hidden,
            cfg.intermediate,
            images.iter().map(VisionImage::patches).sum::<usize>(),
        );
        let shapes: Vec<(usize, usize)> = images.iter().map(|i| (i.grid_h, i.grid_w)).collect();
        if self.rope.as_ref().is_none_or(|r| r.grids != shapes) {
            self.rope = None;
            let inv = rope_inv_freq(cfg.rope_theta, cfg.head_dim);
            let angles = rope_angles(&inv, &shapes, cfg.merge);
            let table =
                RopeTable::from_angles(be, &angles, n, 2 * inv.len(), RopeStyle::SplitHalf)?;
            self.rope = Some(Rotary {
                grids: shapes,
                table,
            });
        }
        for img in images {
            let key = (img.grid_h, img.grid_w);
            if !self.grids.contains_key(&key) {
                if self.grids.len() >= MAX_GRIDS {
                    self.grids.clear();
                }
                let rows = position_rows(&self.positions, cfg.pos_side, c, key.0, key.1, cfg.merge);
                let mut buf = be.alloc(rows.len(), Role::Stream)?;
                be.write_f32(&mut buf, &rows)?;
                self.grids.insert(key, buf);
            }
        }
        if self.ws.as_ref().is_some_and(|w| w.rows >= n) {
            return Ok(());
        }
        self.ws = None;
        let (s, e) = (Role::Stream, Role::Compute);
        let tokens = n / cfg.merge_unit();
        self.ws = Some(Workspace {
            rows: n,
            px: be.alloc(n * cfg.row_width(), e)?,
            pos: be.alloc(n, Role::Index)?,
            h: be.alloc(n * c, s)?,
            a: be.alloc(n * c, e)?,
            qkv: be.alloc(n * 3 * c, e)?,
            attn: be.alloc(n * c, e)?,
            y: be.alloc(n * c, e)?,
            g: be.alloc(n * f, e)?,
            mn: be.alloc(n * c, e)?,
            mh: be.alloc(n * c, e)?,
            out: (0..=cfg.deepstack.len())
                .map(|_| be.alloc(tokens * cfg.out_hidden, s))
                .collect::<Result<Vec<_>>>()?,
        });
        Ok(())
    }

    /// Encode `images` in one pass (each its own attention segment), byte `v` of their rows
    /// entering as `pixels[v]` (the processor's normalisation).
    pub fn forward(
        &mut self,
        be: &B,
        images: &[VisionImage],
        pixels: &[f32; 256],
    ) -> Result<VisionFeatures<'_, B>> {
        self.check(images)?;
        self.ensure(be, images)?;
        let cfg = &self.cfg;
        let (c, f, mu) = (cfg.hidden, cfg.intermediate, cfg.merge_unit());
        let lens: Vec<usize> = images.iter().map(VisionImage::patches).collect();
        let n: usize = lens.iter().sum();
        let segs = be.segments(&lens)?;
        let rope = &self
            .rope
            .as_ref()
            .ok_or_else(|| Error::backend("vision tower", "rotary table missing"))?
            .table;
        let pos: Vec<u32> = (0..n as u32).collect();
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("vision tower", "workspace missing after allocation"))?;
        let rows: Vec<&[u8]> = images.iter().map(|i| i.bytes.as_slice()).collect();
        be.write_u8_mapped(&mut ws.px, &rows, pixels)?;
        be.write_u32(&mut ws.pos, &pos)?;
        // h = positions + patches · Wᵀ + b
        let mut at = 0;
        for img in images {
            let table = self
                .grids
                .get(&(img.grid_h, img.grid_w))
                .ok_or_else(|| Error::backend("vision tower", "position rows missing"))?;
            let k = img.patches();
            be.cast(
                View::new(table, k, c),
                ViewMut::new(&mut ws.h, n, c).rows(at, k),
            )?;
            at += k;
        }
        be.matmul(
            View::new(&ws.px, n, cfg.row_width()),
            &self.patch.w,
            ViewMut::new(&mut ws.h, n, c),
            &self.patch.epilogue().accumulate(),
        )?;
        let layout = QkvLayout {
            heads_q: cfg.heads,
            heads_kv: cfg.heads,
            head_dim: cfg.head_dim,
        };
        let spec = AttnSpec::new(layout, (cfg.head_dim as f32).powf(-0.5), Mask::Full);
        if let Some(b0) = self.blocks.first() {
            be.norm(
                View::new(&ws.h, n, c),
                &b0.norm1.row(),
                ViewMut::new(&mut ws.a, n, c),
            )?;
        }
        let mut taken = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            block(be, b, layout, &spec, &segs, rope, (n, c, f), ws)?;
            let after = match self.blocks.get(i + 1) {
                Some(nb) => After::Norm(nb.norm1.row(), ViewMut::new(&mut ws.a, n, c)),
                None => After::Nothing,
            };
            be.residual(
                ViewMut::new(&mut ws.h, n, c),
                View::new(&ws.y, n, c),
                &Residual::plain(),
                after,
            )?;
            if cfg.deepstack.get(taken) == Some(&i) {
                taken += 1;
                merge(
                    be,
                    &self.deepstack[taken - 1],
                    (n, c, mu, cfg.out_hidden),
                    ws,
                    taken,
                )?;
            }
        }
        merge(be, &self.merger, (n, c, mu, cfg.out_hidden), ws, 0)?;
        let t = n / mu;
        let out = cfg.out_hidden;
        let ws = self
            .ws
            .as_ref()
            .ok_or_else(|| Error::backend("vision tower", "workspace missing"))?;
        Ok(VisionFeatures {
            merged: View::new(&ws.out[0], t, out),
            deepstack: ws.out[1..].iter().map(|b| View::new(b, t, out)).collect(),
        })
    }

    /// The stream after the last block, `[N, C]`, of the last [`forward`](Self::forward) (tests).
    pub fn last_hidden(&self, rows: usize) -> Option<View<'_, B>> {
        self.ws
            .as_ref()
            .map(|w| View::new(&w.h, rows, self.cfg.hidden))
    }
}

/// One block but its final residual: `ws.a` holds `LN1(h)` on entry; `h += attn`, then
/// `ws.y = mlp(LN2(h))`.
#[allow(clippy::too_many_arguments)]
fn block<B: Backend>(
    be: &B,
    b: &Block<B>,
    layout: QkvLayout,
    spec: &AttnSpec<'_, B>,
    segs: &Segments<B>,
    rope: &RopeTable<B>,
    (n, c, f): (usize, usize, usize),
    ws: &mut Workspace<B>,
) -> Result<()> {
    be.matmul(
        View::new(&ws.a, n, c),
        &b.qkv.w,
        ViewMut::new(&mut ws.qkv, n, 3 * c),
        &b.qkv.epilogue(),
    )?;
    be.qkv_norm_rope(
        ViewMut::new(&mut ws.qkv, n, 3 * c),
        &QkvNorm {
            layout,
            qk_norm: false,
            q_weight: None,
            k_weight: None,
            v_norm: false,
            eps: EPS,
        },
        Some((rope, &ws.pos)),
    )?;
    let qkv = View::new(&ws.qkv, n, 3 * c);
    be.attention(
        qkv.cols(0, c),
        qkv.cols(c, c),
        qkv.cols(2 * c, c),
        ViewMut::new(&mut ws.attn, n, c),
        spec,
        segs,
    )?;
    be.matmul(
        View::new(&ws.attn, n, c),
        &b.proj.w,
        ViewMut::new(&mut ws.y, n, c),
        &b.proj.epilogue(),
    )?;
    be.residual(
        ViewMut::new(&mut ws.h, n, c),
        View::new(&ws.y, n, c),
        &Residual::plain(),
        After::Norm(b.norm2.row(), ViewMut::new(&mut ws.a, n, c)),
    )?;
    be.matmul(
        View::new(&ws.a, n, c),
        &b.fc1.w,
        ViewMut::new(&mut ws.g, n, f),
        &b.fc1.epilogue().act(Activation::GeluTanh),
    )?;
    be.matmul(
        View::new(&ws.g, n, f),
        &b.fc2.w,
        ViewMut::new(&mut ws.y, n, c),
        &b.fc2.epilogue(),
    )
}

/// A merger over the stream `ws.h` into `ws.out[slot]`.
fn merge<B: Backend>(
    be: &B,
    m: &Merger<B>,
    (n, c, mu, out): (usize, usize, usize, usize),
    ws: &mut Workspace<B>,
    slot: usize,
) -> Result<()> {
    let (t, wide) = (n / mu, c * mu);
    if m.postshuffle {
        be.norm(
            View::new(&ws.h, t, wide),
            &m.norm.row(),
            ViewMut::new(&mut ws.mn, t, wide),
        )?;
    } else {
        be.norm(
            View::new(&ws.h, n, c),
            &m.norm.row(),
            ViewMut::new(&mut ws.mn, n, c),
        )?;
    }
    be.matmul(
        View::new(&ws.mn, t, wide),
        &m.fc1.w,
        ViewMut::new(&mut ws.mh, t, wide),
        &m.fc1.epilogue().act(Activation::Gelu),
    )?;
    be.matmul(
        View::new(&ws.mh, t, wide),
        &m.fc2.w,
        ViewMut::new(&mut ws.out[slot], t, out),
        &m.fc2.epilogue(),
    )
}
