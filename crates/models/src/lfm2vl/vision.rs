//! LFM2-VL's image encoder: the SigLIP2 NaFlex vision tower, the 2×2 pixel unshuffle and the
//! projector into the language model's width.
//!
//! Reference: `Siglip2VisionTransformer` and `Lfm2VlModel.get_image_features` /
//! `Lfm2VlMultiModalProjector` (transformers 5.25.0).
//!
//! Patches `[N, 3·p²]` (each in (py, px, c) order) → linear with bias + the learned 16×16
//! position grid resized to the tile's patch grid (antialiased bilinear, computed in f32 as the
//! reference does) → pre-LayerNorm encoder layers (biased q|k|v, bidirectional attention, no
//! RoPE; GELU-tanh MLP) → post-LayerNorm → each 2×2 block of patches side by side (top-left,
//! top-right, bottom-left, bottom-right) → LayerNorm (eps 1e-5, where the checkpoint has it) →
//! linear, erf GELU, linear: one row per image token.
//!
//! Tiles are packed back to back, each its own attention segment: no padding rows.

use std::collections::HashMap;

use tessera_backend::{
    Activation, After, AttnSpec, Backend, Mask, QkvLayout, Residual, Role, RowNorm, Segments, View,
    ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::{Lfm2VlConfig, VisionConfig};
use crate::loader::{Linear, Loader};

/// Grid shapes whose position rows are kept at once (each at most 1,024 rows of the width).
const MAX_GRIDS: usize = 16;

/// One tile's patches: a `grid_w × grid_h` grid, row-major, each patch `3·p²` bytes.
#[derive(Clone, Copy, Debug)]
pub struct TilePatches<'a> {
    pub grid_w: usize,
    pub grid_h: usize,
    pub bytes: &'a [u8],
}

impl TilePatches<'_> {
    pub fn patches(&self) -> usize {
        self.grid_w * self.grid_h
    }
    /// Image tokens after the 2×2 unshuffle.
    pub fn tokens(&self) -> usize {
        self.patches() / 4
    }
}

struct EncoderLayer<B: Backend> {
    ln1: (B::Vector, B::Vector),
    qkv: Linear<B>,
    o: Linear<B>,
    ln2: (B::Vector, B::Vector),
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// Activations for up to `rows` patches, reused while they fit.
struct Workspace<B: Backend> {
    rows: usize,
    /// Part of the key of the replayed pass over these buffers ([`Backend::run_graph`]).
    generation: u64,
    /// Each tile's patch rows, an attention segment (at most one a 2×2 block).
    segs: Segments<B>,
    /// Patch pixels `[N, 3·p²]`.
    px: B::Buf,
    /// Residual stream `[N, C]`.
    h: B::Buf,
    /// Normed sub-block input `[N, C]`, then the post-LayerNorm output.
    a: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    /// Sub-block output `[N, C]`.
    y: B::Buf,
    /// MLP hidden `[N, FFN]`.
    g: B::Buf,
    /// Where each patch row goes in the unshuffled order.
    perm: B::Buf,
    /// Unshuffled `[N/4, 4C]`, its LayerNorm, the projector's hidden `[N/4, P]`.
    un: B::Buf,
    un_n: B::Buf,
    p1: B::Buf,
    /// Image tokens `[N/4, text hidden]`.
    out: B::Buf,
}

pub struct ImageEncoder<B: Backend> {
    cfg: VisionConfig,
    text_hidden: usize,
    projector_hidden: usize,
    patch: Linear<B>,
    /// The learned position grid `[pos_grid², C]`, on the host: each tile's resize is computed
    /// there, as the reference computes it in f32.
    positions: Vec<f32>,
    layers: Vec<EncoderLayer<B>>,
    /// Position rows `[patches, C]` of each grid shape `(gw, gh)` seen, on the device.
    grids: HashMap<(usize, usize), B::Buf>,
    /// Bumped whenever `grids` is emptied: a replayed pass read the rows of buffers then freed.
    grids_epoch: u64,
    post_ln: (B::Vector, B::Vector),
    proj_ln: Option<(B::Vector, B::Vector)>,
    proj1: Linear<B>,
    proj2: Linear<B>,
    ws: Option<Workspace<B>>,
}

fn linear_maybe_bias<B: Backend>(
    l: &Loader<'_, B>,
    name: &str,
    out: usize,
    inner: usize,
    bias: bool,
) -> Result<Linear<B>> {
    if bias {
        l.linear(name, out, inner)
    } else {
        Ok(Linear {
            w: l.matrix(&format!("{name}.weight"), out, inner)?,
            b: l.backend().vector_f32(&vec![0.0; out])?,
        })
    }
}

fn layer_norm<B: Backend>(
    l: &Loader<'_, B>,
    name: &str,
    n: usize,
) -> Result<(B::Vector, B::Vector)> {
    Ok((
        l.vector(&format!("{name}.weight"), n)?,
        l.vector(&format!("{name}.bias"), n)?,
    ))
}

impl<B: Backend> ImageEncoder<B> {
    /// Load the tower (under `model.vision_tower.`, with or without the `vision_model.` level
    /// the published checkpoints have) and `model.multi_modal_projector.`.
    pub fn load(be: &B, cfg: &Lfm2VlConfig, w: &Weights) -> Result<Self> {
        let v = &cfg.vision;
        let c = v.hidden;
        let root = Loader::new(be, w);
        let tower = if root.has("model.vision_tower.vision_model.post_layernorm.weight") {
            root.pp("model.vision_tower.vision_model")
        } else {
            root.pp("model.vision_tower")
        };
        let pin = v.channels * v.patch * v.patch;
        let emb = tower.pp("embeddings");
        let grid2 = v.pos_grid * v.pos_grid;
        let positions = emb
            .tensor("position_embedding.weight", &[grid2, c])?
            .to_f32();
        let layers = (0..v.layers)
            .map(|i| {
                let l = tower.pp(format_args!("encoder.layers.{i}"));
                let a = l.pp("self_attn");
                let qkv = Linear {
                    w: a.stacked(
                        &[
                            ("q_proj.weight", c),
                            ("k_proj.weight", c),
                            ("v_proj.weight", c),
                        ],
                        c,
                    )?,
                    b: a.stacked_vector(&[
                        ("q_proj.bias", c),
                        ("k_proj.bias", c),
                        ("v_proj.bias", c),
                    ])?,
                };
                Ok(EncoderLayer {
                    ln1: layer_norm(&l, "layer_norm1", c)?,
                    qkv,
                    o: a.linear("out_proj", c, c)?,
                    ln2: layer_norm(&l, "layer_norm2", c)?,
                    fc1: l.linear("mlp.fc1", v.intermediate, c)?,
                    fc2: l.linear("mlp.fc2", c, v.intermediate)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let proj = root.pp("model.multi_modal_projector");
        let c4 = 4 * c;
        let (p, th, bias) = (cfg.projector_hidden, cfg.text.hidden, cfg.projector_bias);
        let proj_ln = if cfg.projector_norm {
            Some(layer_norm(&proj, "layer_norm", c4)?)
        } else {
            None
        };
        Ok(ImageEncoder {
            cfg: v.clone(),
            text_hidden: th,
            projector_hidden: p,
            patch: emb.linear("patch_embedding", c, pin)?,
            positions,
            layers,
            grids: HashMap::new(),
            grids_epoch: 0,
            post_ln: layer_norm(&tower, "post_layernorm", c)?,
            proj_ln,
            proj1: linear_maybe_bias(&proj, "linear_1", p, c4, bias)?,
            proj2: linear_maybe_bias(&proj, "linear_2", th, p, bias)?,
            ws: None,
        })
    }

    fn ensure(&mut self, be: &B, rows: usize) -> Result<()> {
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.ws = None;
        let v = &self.cfg;
        let (c, f) = (v.hidden, v.intermediate);
        let (s, e) = (Role::Stream, Role::Compute);
        let t = rows / 4;
        self.ws = Some(Workspace {
            rows,
            generation: crate::blocks::scratch::workspace_generation(),
            segs: be.alloc_segments(rows, (rows / 4).max(1))?,
            px: be.alloc(rows * v.channels * v.patch * v.patch, e)?,
            h: be.alloc(rows * c, s)?,
            a: be.alloc(rows * c, e)?,
            qkv: be.alloc(rows * 3 * c, e)?,
            attn: be.alloc(rows * c, e)?,
            y: be.alloc(rows * c, e)?,
            g: be.alloc(rows * f, e)?,
            perm: be.alloc(rows, Role::Index)?,
            un: be.alloc(rows * c, e)?,
            un_n: be.alloc(rows * c, e)?,
            p1: be.alloc(t * self.projector_hidden, e)?,
            out: be.alloc(t * self.text_hidden, s)?,
        });
        Ok(())
    }

    /// Check tiles against the tower before any work: whole 2×2 blocks, the right patch width.
    pub fn check(&self, tiles: &[TilePatches<'_>]) -> Result<()> {
        let width = self.cfg.channels * self.cfg.patch * self.cfg.patch;
        for (i, t) in tiles.iter().enumerate() {
            if t.patches() == 0
                || !t.grid_w.is_multiple_of(2)
                || !t.grid_h.is_multiple_of(2)
                || t.bytes.len() != t.patches() * width
            {
                return Err(Error::input(format!(
                    "tile {}: {} bytes for a {}×{} patch grid of {width} (sides must be even)",
                    i + 1,
                    t.bytes.len(),
                    t.grid_w,
                    t.grid_h
                )));
            }
        }
        Ok(())
    }

    /// Encode `tiles` in one pass, pixel byte `v` entering as `pixels[v]` (the processor's
    /// rescale and normalisation): their image tokens `[Σ tokens, text hidden]`
    /// (`Role::Stream`), tiles in order, each tile's tokens in raster order of its 2×2 blocks.
    ///
    /// The inputs are uploaded into the workspace first; the device pass itself is one
    /// replayable region keyed by the tiles' grids ([`Backend::run_graph`]): a 512² tile's
    /// ~140 launches were issued slower than the GPU ran them (the host took ~1.8 ms for
    /// ~1.6 ms of kernels, run g27).
    pub fn forward(
        &mut self,
        be: &B,
        tiles: &[TilePatches<'_>],
        pixels: &[f32; 256],
    ) -> Result<View<'_, B>> {
        self.check(tiles)?;
        let lens: Vec<usize> = tiles.iter().map(TilePatches::patches).collect();
        let n: usize = lens.iter().sum();
        self.ensure(be, n)?;
        // Each grid shape's position rows are computed once and kept on the device (a tiled
        // image's tiles share one shape).
        for tile in tiles {
            let key = (tile.grid_w, tile.grid_h);
            if !self.grids.contains_key(&key) {
                if self.grids.len() >= MAX_GRIDS {
                    self.grids.clear();
                    self.grids_epoch += 1;
                }
                let rows = resized_positions(
                    &self.positions,
                    self.cfg.pos_grid,
                    self.cfg.hidden,
                    key.0,
                    key.1,
                );
                let mut buf = be.alloc(rows.len(), Role::Stream)?;
                be.write_f32(&mut buf, &rows)?;
                self.grids.insert(key, buf);
            }
        }
        let perm = unshuffle_rows(tiles);
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| Error::backend("image encoder", "workspace missing after allocation"))?;
        be.set_segments(&mut ws.segs, &lens)?;
        let bytes: Vec<&[u8]> = tiles.iter().map(|t| t.bytes).collect();
        be.write_u8_mapped(&mut ws.px, &bytes, pixels)?;
        be.write_u32(&mut ws.perm, &perm)?;
        let grids: Vec<(usize, usize)> = tiles.iter().map(|t| (t.grid_w, t.grid_h)).collect();
        let key = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ("lfm2 tower", ws.generation, self.grids_epoch, &grids).hash(&mut h);
            h.finish()
        };
        let tower = Tower {
            cfg: &self.cfg,
            patch: &self.patch,
            layers: &self.layers,
            grids: &self.grids,
            post_ln: &self.post_ln,
            proj_ln: self.proj_ln.as_ref(),
            proj1: &self.proj1,
            proj2: &self.proj2,
            projector_hidden: self.projector_hidden,
            text_hidden: self.text_hidden,
        };
        be.run_graph(key, &mut || tower.run(be, ws, &grids, n))?;
        Ok(View::new(&ws.out, n / 4, self.text_hidden))
    }

    /// The post-LayerNorm tower output of the last [`forward`](Self::forward), `[N, C]` (tests).
    pub fn last_hidden(&self, rows: usize) -> Option<View<'_, B>> {
        self.ws
            .as_ref()
            .map(|w| View::new(&w.a, rows, self.cfg.hidden))
    }

    /// The unshuffled rows of the last [`forward`](Self::forward), `[N/4, 4C]` (tests).
    pub fn last_unshuffled(&self, tokens: usize) -> Option<View<'_, B>> {
        self.ws
            .as_ref()
            .map(|w| View::new(&w.un, tokens, 4 * self.cfg.hidden))
    }
}

/// The tower's and projector's weights, borrowed for one device pass.
struct Tower<'a, B: Backend> {
    cfg: &'a VisionConfig,
    patch: &'a Linear<B>,
    layers: &'a [EncoderLayer<B>],
    grids: &'a HashMap<(usize, usize), B::Buf>,
    post_ln: &'a (B::Vector, B::Vector),
    proj_ln: Option<&'a (B::Vector, B::Vector)>,
    proj1: &'a Linear<B>,
    proj2: &'a Linear<B>,
    projector_hidden: usize,
    text_hidden: usize,
}

impl<B: Backend> Tower<'_, B> {
    /// Every device op of a pass over `n` patch rows already in `ws` (pixels, permutation,
    /// segments), tiles of the patch grids `grids` in order: device work only, at fixed
    /// addresses (a replayable region).
    fn run(&self, be: &B, ws: &mut Workspace<B>, grids: &[(usize, usize)], n: usize) -> Result<()> {
        let v = self.cfg;
        let (c, f, eps) = (v.hidden, v.intermediate, v.eps);
        let pin = v.channels * v.patch * v.patch;
        let (p, th, t) = (self.projector_hidden, self.text_hidden, n / 4);
        let mut at = 0;
        for &(gw, gh) in grids {
            let table = self
                .grids
                .get(&(gw, gh))
                .ok_or_else(|| Error::backend("image encoder", "position rows missing"))?;
            let n_t = gw * gh;
            be.cast(
                View::new(table, n_t, c),
                ViewMut::new(&mut ws.h, n, c).rows(at, n_t),
            )?;
            at += n_t;
        }
        // h = positions + patches · Wᵀ + b
        be.matmul(
            View::new(&ws.px, n, pin),
            &self.patch.w,
            ViewMut::new(&mut ws.h, n, c),
            &self.patch.epilogue().accumulate(),
        )?;
        if let Some(l0) = self.layers.first() {
            be.norm(
                View::new(&ws.h, n, c),
                &RowNorm::layer(&l0.ln1.0, &l0.ln1.1, eps),
                ViewMut::new(&mut ws.a, n, c),
            )?;
        }
        let layout = QkvLayout {
            heads_q: v.heads,
            heads_kv: v.heads,
            head_dim: v.head_dim,
        };
        let spec = AttnSpec::new(layout, (v.head_dim as f32).powf(-0.5), Mask::Full);
        for (i, l) in self.layers.iter().enumerate() {
            encoder_layer(be, l, &spec, (n, c, f), eps, ws)?;
            let (w, b) = match self.layers.get(i + 1) {
                Some(next) => (&next.ln1.0, &next.ln1.1),
                None => (&self.post_ln.0, &self.post_ln.1),
            };
            be.residual(
                ViewMut::new(&mut ws.h, n, c),
                View::new(&ws.y, n, c),
                &Residual::plain(),
                After::Norm(RowNorm::layer(w, b, eps), ViewMut::new(&mut ws.a, n, c)),
            )?;
        }
        if self.layers.is_empty() {
            be.norm(
                View::new(&ws.h, n, c),
                &RowNorm::layer(&self.post_ln.0, &self.post_ln.1, eps),
                ViewMut::new(&mut ws.a, n, c),
            )?;
        }
        // The 2×2 unshuffle is a row permutation: [N, C] rows in block order are [N/4, 4C].
        be.scatter_rows(
            View::new(&ws.a, n, c),
            &ws.perm,
            ViewMut::new(&mut ws.un, n, c),
        )?;
        let un = match self.proj_ln {
            Some((w, b)) => {
                be.norm(
                    View::new(&ws.un, t, 4 * c),
                    &RowNorm::layer(w, b, 1e-5),
                    ViewMut::new(&mut ws.un_n, t, 4 * c),
                )?;
                &ws.un_n
            }
            None => &ws.un,
        };
        be.matmul(
            View::new(un, t, 4 * c),
            &self.proj1.w,
            ViewMut::new(&mut ws.p1, t, p),
            &self.proj1.epilogue().act(Activation::Gelu),
        )?;
        be.matmul(
            View::new(&ws.p1, t, p),
            &self.proj2.w,
            ViewMut::new(&mut ws.out, t, th),
            &self.proj2.epilogue(),
        )
    }
}

/// One pre-LayerNorm encoder layer but its final residual: `ws.a` holds `LN1(h)` on entry;
/// `h += attn`, then `ws.y = mlp(LN2(h))`.
fn encoder_layer<B: Backend>(
    be: &B,
    l: &EncoderLayer<B>,
    spec: &AttnSpec<'_, B>,
    (n, c, f): (usize, usize, usize),
    eps: f32,
    ws: &mut Workspace<B>,
) -> Result<()> {
    be.matmul(
        View::new(&ws.a, n, c),
        &l.qkv.w,
        ViewMut::new(&mut ws.qkv, n, 3 * c),
        &l.qkv.epilogue(),
    )?;
    let qkv = View::new(&ws.qkv, n, 3 * c);
    be.attention(
        qkv.cols(0, c),
        qkv.cols(c, c),
        qkv.cols(2 * c, c),
        ViewMut::new(&mut ws.attn, n, c),
        spec,
        &ws.segs,
    )?;
    be.matmul(
        View::new(&ws.attn, n, c),
        &l.o.w,
        ViewMut::new(&mut ws.y, n, c),
        &l.o.epilogue(),
    )?;
    be.residual(
        ViewMut::new(&mut ws.h, n, c),
        View::new(&ws.y, n, c),
        &Residual::plain(),
        After::Norm(
            RowNorm::layer(&l.ln2.0, &l.ln2.1, eps),
            ViewMut::new(&mut ws.a, n, c),
        ),
    )?;
    be.matmul(
        View::new(&ws.a, n, c),
        &l.fc1.w,
        ViewMut::new(&mut ws.g, n, f),
        &l.fc1.epilogue().act(Activation::GeluTanh),
    )?;
    be.matmul(
        View::new(&ws.g, n, f),
        &l.fc2.w,
        ViewMut::new(&mut ws.y, n, c),
        &l.fc2.epilogue(),
    )
}

/// The position rows of a `gw × gh` patch grid, `[gh·gw, C]`, as `Siglip2VisionEmbeddings`
/// computes them: per axis, antialiased bilinear weights in f32 (`F.interpolate(bilinear,
/// align_corners=False, antialias=True)`), their outer product applied to the learned grid.
fn resized_positions(table: &[f32], grid: usize, c: usize, gw: usize, gh: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let rows = axis_weights(grid, gh);
    let cols = axis_weights(grid, gw);
    let mut out = vec![0f32; gw * gh * c];
    out.par_chunks_mut(c).enumerate().for_each_init(
        || vec![0f64; c],
        |acc, (p, o)| {
            let (ry, rx) = (&rows[p / gw], &cols[p % gw]);
            acc.fill(0.0);
            for (i, &wy) in ry.iter().enumerate() {
                for (j, &wx) in rx.iter().enumerate() {
                    let wgt = wy * wx;
                    if wgt == 0.0 {
                        continue;
                    }
                    let src = &table[(i * grid + j) * c..(i * grid + j + 1) * c];
                    for (a, &s) in acc.iter_mut().zip(src) {
                        *a += wgt as f64 * s as f64;
                    }
                }
            }
            for (v, &a) in o.iter_mut().zip(acc.iter()) {
                *v = a as f32;
            }
        },
    );
    out
}

/// The weights over `grid` sources of each of `size` outputs along one axis, in f32 as the
/// reference computes them: triangle of half-width `max(scale, 1)` around `(o + ½)·scale − ½`,
/// normalised to sum 1.
fn axis_weights(grid: usize, size: usize) -> Vec<Vec<f32>> {
    let scale = grid as f32 / size as f32;
    let support = scale.max(1.0);
    (0..size)
        .map(|o| {
            let center = (o as f32 + 0.5) * scale - 0.5;
            let w: Vec<f32> = (0..grid)
                .map(|j| (1.0 - (j as f32 - center).abs() / support).max(0.0))
                .collect();
            let sum: f32 = w.iter().sum();
            w.iter().map(|&x| x / sum).collect()
        })
        .collect()
}

/// For each patch row, its row in the unshuffled order: patch `(x, y)` of a tile goes to token
/// `(y/2)·(w/2) + x/2` of that tile, in the block slot `2·(y mod 2) + (x mod 2)`.
fn unshuffle_rows(tiles: &[TilePatches<'_>]) -> Vec<u32> {
    let mut out = Vec::with_capacity(tiles.iter().map(|t| t.patches()).sum());
    let mut base = 0;
    for t in tiles {
        let half = t.grid_w / 2;
        for y in 0..t.grid_h {
            for x in 0..t.grid_w {
                let token = (y / 2) * half + x / 2;
                out.push((base + 4 * token + 2 * (y % 2) + x % 2) as u32);
            }
        }
        base += t.patches();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_weights_are_plain_bilinear_when_upsampling_and_wider_when_shrinking() {
        let up = axis_weights(16, 32);
        // Output 0 is centred at −0.25: clamped onto source 0.
        assert_eq!(up[0][0], 1.0);
        // Output 1 at 0.25: ¾ of source 0, ¼ of source 1.
        assert!((up[1][0] - 0.75).abs() < 1e-6 && (up[1][1] - 0.25).abs() < 1e-6);
        let down = axis_weights(16, 4);
        // Scale 4: a triangle of half-width 4 around 1.5, 5.5, 9.5, 13.5 reaches 8 sources,
        // 6 at the edges; the weights sum to 1.
        let reach: Vec<usize> = down
            .iter()
            .map(|w| w.iter().filter(|&&x| x > 0.0).count())
            .collect();
        assert_eq!(reach, [6, 8, 8, 6]);
        for w in &down {
            assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        assert_eq!(axis_weights(16, 16)[5][5], 1.0);
    }

    #[test]
    fn unshuffle_puts_each_block_side_by_side() {
        let tiles = [
            TilePatches {
                grid_w: 4,
                grid_h: 2,
                bytes: &[],
            },
            TilePatches {
                grid_w: 2,
                grid_h: 2,
                bytes: &[],
            },
        ];
        // Tile 0: row 0 = patches (0,0) (1,0) (2,0) (3,0), row 1 = (0,1) … (3,1).
        assert_eq!(
            unshuffle_rows(&tiles),
            [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11]
        );
    }
}
