//! `attention` over packed segments, with every mask, over their own rows or a key/value cache,
//! and (CUDA, bf16) on each flash kernel forced whole and split into key chunks; and
//! `qkv_norm_rope`, the per-head norms and rotary embeddings before it.

use std::iter::once;

use tessera_backend::cuda::attention::{MAX_CACHED_SPLITS, WGMMA_HEAD_DIMS, WS_HEAD_DIMS};
use tessera_backend::cuda::{FlashChoice, FlashKernel};
use tessera_backend::op::{AttentionOp, MaskKind};
use tessera_backend::{
    AttnSpec, Backend, Mask, Op, Precision, QkvLayout, QkvNorm, Role, RopeStyle, RopeTable, Run,
    block_causal_limits,
};

use super::{
    Attend, Device, Guarded, Layout, OpCase, Output, Res, Rng, Tol, indices, patches, seed_of,
};

/// Which keys a query sees (see [`Mask`]); `Limits` holds the runs of each sequence, whose
/// [`block_causal_limits`] give the per-row key counts.
#[derive(Clone, Debug)]
enum MaskSpec {
    Full,
    Window(usize),
    Causal,
    Limits(Vec<Vec<Run>>),
}

/// A cache of `rows` key/value rows; segment `s` reads `ranges[s]` (first row, rows). Rows in no
/// range are NaN, so reading one fails.
#[derive(Clone, Debug)]
struct Cache {
    ranges: Vec<(usize, usize)>,
    rows: usize,
}

/// Attention of query segments of `lens` rows with `heads_q`/`heads_kv` heads of `head_dim`.
#[derive(Clone, Debug)]
pub struct AttentionCase {
    lens: Vec<usize>,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    scale: f32,
    mask: MaskSpec,
    cache: Option<Cache>,
    /// A forced flash kernel and key split (CUDA, bf16); `None`: as the op chooses.
    flash: Option<FlashChoice>,
}

/// Self-attention of each segment over its own rows, every key visible, scale 1.
pub fn attention(
    lens: &[usize],
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
) -> AttentionCase {
    AttentionCase {
        lens: lens.to_vec(),
        heads_q,
        heads_kv,
        head_dim,
        scale: 1.0,
        mask: MaskSpec::Full,
        cache: None,
        flash: None,
    }
}

impl AttentionCase {
    pub fn scale(self, scale: f32) -> Self {
        AttentionCase { scale, ..self }
    }
    /// A bidirectional sliding window of inclusive radius `radius`.
    pub fn window(self, radius: usize) -> Self {
        AttentionCase {
            mask: MaskSpec::Window(radius),
            ..self
        }
    }
    pub fn causal(self) -> Self {
        AttentionCase {
            mask: MaskSpec::Causal,
            ..self
        }
    }
    /// Per-row key limits of block-causal sequences, `runs` per segment (covering its keys).
    pub fn block_causal(self, runs: &[&[Run]]) -> Self {
        AttentionCase {
            mask: MaskSpec::Limits(runs.iter().map(|r| r.to_vec()).collect()),
            ..self
        }
    }
    /// Keys and values from `ranges` of a cache of `rows` rows, one range per segment.
    pub fn cached(self, ranges: &[(usize, usize)], rows: usize) -> Self {
        AttentionCase {
            cache: Some(Cache {
                ranges: ranges.to_vec(),
                rows,
            }),
            ..self
        }
    }

    /// This case as the op runs it, then (bf16 only) on each flash kernel for its head width,
    /// forced whole and split into 2, 3 and 8 key chunks (some of them empty for some tiles).
    /// Over a cache, CUDA has one kernel: it is forced whole and split into 2, 3, 8 and the most
    /// key chunks per query row.
    pub fn on_every_path(self) -> Vec<AttentionCase> {
        let with = |flash| AttentionCase {
            flash: Some(flash),
            ..self.clone()
        };
        if self.cache.is_some() {
            let forced = [1, 2, 3, 8, MAX_CACHED_SPLITS].map(|n| FlashChoice {
                splits: Some(n),
                kernel: None,
            });
            return once(self.clone()).chain(forced.map(with)).collect();
        }
        let mut kernels = vec![FlashKernel::Mma];
        if WGMMA_HEAD_DIMS.contains(&self.head_dim) {
            kernels.push(FlashKernel::Wgmma);
        }
        if WS_HEAD_DIMS.contains(&self.head_dim) {
            kernels.push(FlashKernel::Ws);
        }
        let forced = kernels.into_iter().flat_map(|kernel| {
            [1, 2, 3, 8].map(|n| FlashChoice {
                splits: Some(n),
                kernel: Some(kernel),
            })
        });
        once(self.clone()).chain(forced.map(with)).collect()
    }

    /// The case without its forced path: what the inputs and the reference depend on.
    fn base_name(&self) -> String {
        let mask = match &self.mask {
            MaskSpec::Full => String::new(),
            MaskSpec::Window(w) => format!(" window {w}"),
            MaskSpec::Causal => " causal".into(),
            MaskSpec::Limits(runs) => format!(" block-causal {runs:?}"),
        };
        let keys = match &self.cache {
            Some(c) => format!(" over keys {:?} of a {}-row cache", c.ranges, c.rows),
            None => String::new(),
        };
        let scale = if self.scale == 1.0 {
            String::new()
        } else {
            format!(" scale {}", self.scale)
        };
        format!(
            "attention {:?} {}/{}×{}{mask}{keys}{scale}",
            self.lens, self.heads_q, self.heads_kv, self.head_dim
        )
    }

    /// Keys of segment `s`.
    fn keys(&self, s: usize) -> usize {
        self.cache.as_ref().map_or(self.lens[s], |c| c.ranges[s].1)
    }

    /// The key limit of every packed query row: each sequence's limits over all its keys, of
    /// which the queries are the last rows.
    fn limits(&self, runs: &[Vec<Run>]) -> Res<Vec<u32>> {
        let mut limits = Vec::new();
        for (s, runs) in runs.iter().enumerate() {
            let all = block_causal_limits(runs);
            let (keys, queries) = (self.keys(s), self.lens[s]);
            if all.len() != keys || queries > keys {
                return Err(
                    format!("segment {s}: runs of {} rows for {keys} keys", all.len()).into(),
                );
            }
            limits.extend_from_slice(&all[keys - queries..]);
        }
        Ok(limits)
    }
}

impl OpCase for AttentionCase {
    fn name(&self) -> String {
        let path = match self.flash {
            Some(FlashChoice {
                splits: Some(n),
                kernel: Some(k),
            }) => format!(
                " — {k:?} kernel, {n} key chunk{}",
                if n == 1 { "" } else { "s" }
            ),
            Some(FlashChoice {
                splits: Some(n),
                kernel: None,
            }) => format!(" — {n} key chunk{}", if n == 1 { "" } else { "s" }),
            Some(f) => format!(" — {f:?}"),
            None => String::new(),
        };
        format!("{}{path}", self.base_name())
    }

    fn op(&self) -> Op {
        Op::Attention(AttentionOp {
            head_dim: self.head_dim,
            mask: match self.mask {
                MaskSpec::Full => MaskKind::Full,
                MaskSpec::Window(_) => MaskKind::Window,
                MaskSpec::Causal => MaskKind::Causal,
                MaskSpec::Limits(_) => MaskKind::Limits,
            },
            cached: self.cache.is_some(),
        })
    }

    fn supported<B: Device>(&self, be: &B) -> tessera_backend::Result<()> {
        be.supports(&self.op())?;
        match self.flash {
            Some(f) => be.flash_supported(f, self.head_dim),
            None => Ok(()),
        }
    }

    fn tol(&self, p: Precision) -> Tol {
        Tol::loose(p)
    }

    fn precisions(&self) -> &'static [Precision] {
        match self.flash {
            Some(_) => &[Precision::Bf16],
            None => super::BOTH,
        }
    }

    /// Every path of one case draws the same inputs.
    fn seed(&self) -> u64 {
        seed_of(&self.base_name())
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let (hd, total) = (self.head_dim, self.lens.iter().sum::<usize>());
        let (qc, kc) = (self.heads_q * hd, self.heads_kv * hd);
        // Unit-RMS rows like the normed q/k of the models, scaled so logits reach ±10.
        let range = 1.7 * (1.0 / (hd as f32).sqrt()).sqrt() * 2.0;
        // Capacity beyond the need, as in a reused workspace.
        let mut segs = be.alloc_segments(total + 100, self.lens.len() + 3)?;
        be.set_segments(&mut segs, &self.lens)?;
        let limits = match &self.mask {
            MaskSpec::Limits(runs) => Some(indices(be, &self.limits(runs)?)?),
            _ => None,
        };
        let mask = match (&self.mask, &limits) {
            (MaskSpec::Window(w), _) => Mask::Window(*w),
            (MaskSpec::Causal, _) => Mask::Causal,
            (MaskSpec::Limits(_), Some(l)) => Mask::Limits(l),
            _ => Mask::Full,
        };
        let kv = match &self.cache {
            Some(c) => Some(be.kv_ranges(&c.ranges)?),
            None => None,
        };
        let spec = AttnSpec {
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: hd,
            scale: self.scale,
            mask,
            kv: kv.as_ref(),
        };
        let mut out = Guarded::empty(be, Role::Compute, Layout::padded(total, qc, 8, 0))?;
        match &self.cache {
            None => {
                // Packed q|k|v rows, as the fused q|k|v product writes them.
                let width = qc + 2 * kc;
                let at = Layout::padded(total, width, 8, 8);
                let x = Guarded::drawn(be, Role::Compute, at, rng, range)?;
                let all = x.view();
                let call = Attend {
                    q: all.cols(0, qc),
                    k: all.cols(qc, kc),
                    v: all.cols(qc + kc, kc),
                    out: out.view_mut(),
                    spec: &spec,
                    segs: &segs,
                };
                be.attend(call, self.flash)?;
            }
            Some(cache) => {
                let at = Layout::padded(total, qc, 8, 8);
                let q = Guarded::drawn(be, Role::Compute, at, rng, range)?;
                // k|v rows of the cache: the ranges' rows drawn, the gaps between them NaN.
                let mut kv_rows = vec![f32::NAN; cache.rows * 2 * kc];
                for &(start, n) in &cache.ranges {
                    let rows = &mut kv_rows[start * 2 * kc..(start + n) * 2 * kc];
                    rows.copy_from_slice(&rng.vec(rows.len(), range));
                }
                let at = Layout::padded(cache.rows, 2 * kc, 8, 8);
                let rows = Guarded::new(be, Role::Compute, at, Some(&kv_rows))?;
                let call = Attend {
                    q: q.view(),
                    k: rows.view().cols(0, kc),
                    v: rows.view().cols(kc, kc),
                    out: out.view_mut(),
                    spec: &spec,
                    segs: &segs,
                };
                be.attend(call, self.flash)?;
            }
        }
        Ok(vec![out.read(be, "out")?])
    }

    /// Self-attention segments cut to 64 rows (block-causal runs and caches are small already).
    fn shrunk(&self) -> Self {
        let keep = self.cache.is_some() || matches!(self.mask, MaskSpec::Limits(_));
        AttentionCase {
            lens: match keep {
                true => self.lens.clone(),
                false => self.lens.iter().map(|&l| l.min(64)).collect(),
            },
            ..self.clone()
        }
    }
}

/// Rotary embeddings of a [`QkvCase`] and the rows they imply.
#[derive(Clone, Debug)]
enum Rope {
    /// No rotation; text rows.
    None,
    /// Split-half (`rotate_half`) or interleaved (complex pairs) with base `theta` over text rows.
    Text(RopeStyle, f32),
    /// Axial 2-D with base `theta` over every patch of these `(width, height)` grids.
    Axial(f32, Vec<(usize, usize)>),
    /// Z-Image's three axes (`axes` channels each, base `theta`): `caption` text rows, then a
    /// `(width, height)` image, angles in an explicit table.
    MultiAxis {
        theta: f32,
        axes: [usize; 3],
        caption: usize,
        image: (usize, usize),
    },
}

/// Positions of the text rows: a sequence of 70, another of 13, and the table's far end.
fn text_positions() -> Vec<u32> {
    (0..70u32).chain(0..13).chain([4000, 4095]).collect()
}

/// Rows of text tables.
const TEXT_TABLE: usize = 4096;
/// Rows per axis of axial tables.
const AXIAL_TABLE: usize = 40;

/// `1 / theta^(2j / dim)` for `j < pairs`.
fn inv_freq(theta: f32, dim: usize, pairs: usize) -> Vec<f32> {
    (0..pairs)
        .map(|j| 1.0 / theta.powf(2.0 * j as f32 / dim as f32))
        .collect()
}

/// Per-head RMS norms of packed q|k|v rows, then RoPE on q and k.
#[derive(Clone, Debug)]
pub struct QkvCase {
    layout: QkvLayout,
    qk_norm: bool,
    weights: bool,
    v_norm: bool,
    rope: Rope,
}

/// q and k normed with weights, v without; no rotation.
pub fn qkv(heads_q: usize, heads_kv: usize, head_dim: usize) -> QkvCase {
    QkvCase {
        layout: QkvLayout {
            heads_q,
            heads_kv,
            head_dim,
        },
        qk_norm: true,
        weights: true,
        v_norm: true,
        rope: Rope::None,
    }
}

impl QkvCase {
    pub fn split_half(self, theta: f32) -> Self {
        QkvCase {
            rope: Rope::Text(RopeStyle::SplitHalf, theta),
            ..self
        }
    }
    pub fn interleaved(self, theta: f32) -> Self {
        QkvCase {
            rope: Rope::Text(RopeStyle::Interleaved, theta),
            ..self
        }
    }
    pub fn axial(self, theta: f32, grids: &[(usize, usize)]) -> Self {
        QkvCase {
            rope: Rope::Axial(theta, grids.to_vec()),
            ..self
        }
    }
    pub fn multi_axis(
        self,
        theta: f32,
        axes: [usize; 3],
        caption: usize,
        image: (usize, usize),
    ) -> Self {
        QkvCase {
            rope: Rope::MultiAxis {
                theta,
                axes,
                caption,
                image,
            },
            ..self
        }
    }
    /// q and k normed without weights.
    pub fn weightless(self) -> Self {
        QkvCase {
            weights: false,
            ..self
        }
    }
    /// q and k rotated only, not normed (Qwen3-VL's vision tower).
    pub fn rope_only(self) -> Self {
        QkvCase {
            qk_norm: false,
            weights: false,
            ..self
        }
    }
    /// v left as it is.
    pub fn no_v_norm(self) -> Self {
        QkvCase {
            v_norm: false,
            ..self
        }
    }

    fn style(&self) -> Option<RopeStyle> {
        match self.rope {
            Rope::None => None,
            Rope::Text(style, _) => Some(style),
            Rope::Axial(..) => Some(RopeStyle::Axial2d),
            Rope::MultiAxis { .. } => Some(RopeStyle::Interleaved),
        }
    }

    /// The RoPE table and the positions of every row (one `u32` a row, two for axial).
    fn table<B: Backend>(&self, be: &B) -> Res<(Option<RopeTable<B>>, Vec<u32>)> {
        let hd = self.layout.head_dim;
        Ok(match &self.rope {
            Rope::None => (None, text_positions()),
            &Rope::Text(style, theta) => {
                let t = RopeTable::new(be, &inv_freq(theta, hd, hd / 2), TEXT_TABLE, style)?;
                (Some(t), text_positions())
            }
            Rope::Axial(theta, grids) => {
                let inv = inv_freq(*theta, hd / 2, hd / 4);
                let t = RopeTable::new(be, &inv, AXIAL_TABLE, RopeStyle::Axial2d)?;
                let pos = patches(grids)
                    .flat_map(|(x, y)| [x as u32, y as u32])
                    .collect();
                (Some(t), pos)
            }
            &Rope::MultiAxis {
                theta,
                axes,
                caption,
                image: (w, h),
            } => {
                // Caption row j at (1 + j, 0, 0); image patch (x, y) at (caption + 1, y, x).
                let rows: Vec<[usize; 3]> = (0..caption)
                    .map(|j| [1 + j, 0, 0])
                    .chain((0..h).flat_map(|y| (0..w).map(move |x| [caption + 1, y, x])))
                    .collect();
                let freqs: Vec<(usize, f32)> = axes
                    .iter()
                    .enumerate()
                    .flat_map(|(a, &dim)| {
                        inv_freq(theta, dim, dim / 2)
                            .into_iter()
                            .map(move |f| (a, f))
                    })
                    .collect();
                let angles: Vec<f32> = rows
                    .iter()
                    .flat_map(|p| freqs.iter().map(move |&(a, f)| p[a] as f32 * f))
                    .collect();
                let t = RopeTable::from_angles(
                    be,
                    &angles,
                    rows.len(),
                    freqs.len(),
                    RopeStyle::Interleaved,
                )?;
                (Some(t), (0..rows.len() as u32).collect())
            }
        })
    }
}

impl OpCase for QkvCase {
    fn name(&self) -> String {
        let QkvLayout {
            heads_q,
            heads_kv,
            head_dim,
        } = self.layout;
        let rope = match &self.rope {
            Rope::None => "no rope".into(),
            Rope::Text(style, theta) => format!("{style:?} θ={theta}"),
            Rope::Axial(theta, grids) => format!("Axial2d θ={theta} over grids {grids:?}"),
            Rope::MultiAxis {
                theta,
                axes,
                caption,
                image,
            } => format!(
                "3 axes {axes:?} θ={theta} over {caption} caption rows and a {image:?} image"
            ),
        };
        let w = match (self.qk_norm, self.weights) {
            (false, _) => "q/k not normed",
            (true, true) => "q/k weights",
            (true, false) => "no weights",
        };
        let v = if self.v_norm { "v normed" } else { "v as is" };
        format!("qkv_norm_rope {heads_q}/{heads_kv}×{head_dim} {rope} ({w}, {v})")
    }

    fn op(&self) -> Op {
        Op::QkvNormRope {
            head_dim: self.layout.head_dim,
            rope: self.style(),
            qk_norm: self.qk_norm,
        }
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let (hd, width) = (self.layout.head_dim, self.layout.width());
        let (table, pos) = self.table(be)?;
        let rows = match self.rope {
            Rope::Axial(..) => pos.len() / 2,
            _ => pos.len(),
        };
        let at = Layout::padded(rows, width, 8, 8);
        let mut x = Guarded::drawn(be, Role::Compute, at, rng, 2.0)?;
        let (q_w, k_w) = match self.weights {
            true => (
                Some(be.vector_f32(&rng.around(hd, 1.0, 0.3))?),
                Some(be.vector_f32(&rng.around(hd, 1.0, 0.3))?),
            ),
            false => (None, None),
        };
        let norm = QkvNorm {
            layout: self.layout,
            qk_norm: self.qk_norm,
            q_weight: q_w.as_ref(),
            k_weight: k_w.as_ref(),
            v_norm: self.v_norm,
            eps: 1e-6,
        };
        let pos = indices(be, &pos)?;
        be.qkv_norm_rope(x.view_mut(), &norm, table.as_ref().map(|t| (t, &pos)))?;
        Ok(vec![x.read(be, "qkv")?])
    }
}
