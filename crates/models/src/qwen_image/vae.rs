//! The VAE decoder of Qwen-Image-2.1 (`AutoencoderKLQwenImage21`, spec A7): a Wan-2.2-style
//! residual decoder specialised to one frame, RGBA out, 2× per up block (16× for the release).
//!
//! Reference: diffusers 0.42.1 `models/autoencoders/autoencoder_kl_qwenimage21.py` and the
//! pipeline's decode (`pipeline_qwenimage21.py`). The decoder takes the DiT's latent tokens
//! `[h·w, z_dim]` (row `y·w + x`, channels last) and
//!
//! 1. de-normalises them, `z · latents_std + latents_mean` per channel (the pipeline's step;
//!    the statistics are the config's, rounded to `f32` as `torch.tensor` makes them);
//! 2. `post_quant_conv` (1×1, z → z), `conv_in` (3×3, z → C₀);
//! 3. the mid block: resnet → single-head self-attention → resnet;
//! 4. `len(dim_mult)` up blocks of `num_res_blocks + 1` resnets each; all but the last then
//!    upsample (nearest 2× + 3×3 conv) and add the `DupUp3D` shortcut of the block's input
//!    ([`tessera_backend::DupUp`]);
//! 5. `norm_out` → SiLU → `conv_out` (3×3, → `out_channels`), clamped to [−1, 1].
//!
//! Blocks, single-frame semantics:
//! - `RMS_norm`: `x / max(‖x‖₂, 1e-12) · √C · γ` over the channels of each pixel — a row RMS norm
//!   (`RowNorm`, weight γ) in channels-last layout, since `x·√C/‖x‖ = x / rms(x)`. The backend's
//!   norm computes `x · (mean(x²) + eps)^-½`; with `eps = 10⁻²⁴ / C` (the reference's floor
//!   `1e-12` on the norm, squared and divided by C) the two agree to `f32` precision whenever
//!   `rms(x) ≫ 10⁻¹²/√C`, and both give 0 for an all-zero pixel (eps 0 would give NaN). None of
//!   this model's norms has a bias.
//! - resnet: `conv2(φ(conv1(φ(x)))) + shortcut(x)`, `φ = SiLU ∘ RMS_norm`, 3×3 same-padding
//!   convolutions, a 1×1 `conv_shortcut` where the channel count changes. The norm applies the
//!   SiLU as it stores its output ([`tessera_backend::RowNorm::activated`]), which only the next convolution reads:
//!   each value is activated once, not once per tap (nine times) in the convolution's loader, and
//!   the convolution reads an activation-free input (on Hopper, the warpgroup-MMA kernel's fast
//!   case). The same bits on the CPU as activating on read.
//! - mid attention: `x + proj(softmax(q kᵀ/√C) v)`, `q|k|v = to_qkv(RMS_norm(x))`, one head of
//!   width C, all pixels (1×1 convolutions are products over the pixel rows).
//! - `DupUp3D` on the first chunk keeps the **last** temporal slot (checked in the reference:
//!   `x[:, :, factor_t − 1:]`); AvgDown/`time_conv` are encoder-side or multi-frame only and never
//!   run here. Nearest 2× in `nearest-exact` mode equals plain nearest for a factor of 2.
//!
//! What the reference showed beyond the spec (A7): the decoder's dims are
//! `decoder_base_dim · [dim_mult[-1]] + decoder_base_dim · reversed(dim_mult)` and every up block
//! but the last has the DupUp shortcut, with a temporal factor of 2 where
//! `reversed(temperal_downsample)` says so. For the release: 1152→1152, 1152→1152 and 1152→576
//! with factor 2, 576→288 with factor 1; the last block (288→144) neither upsamples nor adds a
//! shortcut. The mid attention is one head of 1152. `attn_scales` and `dropout` do not
//! reach the residual decoder. The pipeline's `_unpack_latents` only makes even latent sides (one
//! DiT slot is 2×2 tokens); the decoder itself takes any `h × w`.
//!
//! Only `post_quant_conv.*` and `decoder.*` are read here; the encoder is
//! [`super::vae_encoder`], and the unused `time_conv` weights are ignored. The blocks (norm, resnet,
//! mid attention) are [`crate::blocks::vae`]'s, shared with the encoder and Z-Image; this file
//! holds their layout and order.

use std::path::Path;

use serde::Deserialize;
use tessera_backend::op::{AttentionOp, MaskKind, MatmulOp, NormOp};
use tessera_backend::{Activation, AvgDown, Backend, DupUp, Op, View, ViewMut};
use tessera_core::{Error, Result, Weights};

use crate::blocks::vae::{Conv, MidAttention, VaeBufs, VaeRmsNorm};
use crate::loader::{Linear, Loader};

pub use crate::blocks::vae::VaeTaps;

fn default_base_dim() -> usize {
    96
}
fn default_decoder_base_dim() -> Option<usize> {
    Some(144)
}
fn default_z_dim() -> usize {
    64
}
fn default_dim_mult() -> Vec<usize> {
    vec![1, 2, 4, 8, 8]
}
fn default_res_blocks() -> usize {
    2
}
fn default_temporal() -> Vec<bool> {
    vec![false, true, true, true]
}
fn default_true() -> bool {
    true
}
fn default_rgba() -> usize {
    4
}

/// `vae/config.json` as diffusers reads it: the defaults of `AutoencoderKLQwenImage21.__init__`
/// for keys a file leaves out, except the latent statistics, which must be the checkpoint's.
#[derive(Deserialize)]
struct RawVae {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    #[serde(default = "default_base_dim")]
    base_dim: usize,
    #[serde(default = "default_decoder_base_dim")]
    decoder_base_dim: Option<usize>,
    #[serde(default = "default_z_dim")]
    z_dim: usize,
    #[serde(default = "default_dim_mult")]
    dim_mult: Vec<usize>,
    #[serde(default = "default_res_blocks")]
    num_res_blocks: usize,
    /// Only the non-residual encoder reads it.
    #[serde(default)]
    #[allow(dead_code)]
    attn_scales: Vec<f64>,
    #[serde(default = "default_temporal")]
    temperal_downsample: Vec<bool>,
    /// Training only.
    #[serde(default)]
    #[allow(dead_code)]
    dropout: f64,
    latents_mean: Option<Vec<f64>>,
    latents_std: Option<Vec<f64>>,
    #[serde(default = "default_true")]
    is_residual: bool,
    #[serde(default = "default_rgba")]
    in_channels: usize,
    #[serde(default = "default_rgba")]
    out_channels: usize,
    #[serde(default)]
    patch_size: Option<usize>,
    /// Frames per latent frame; one image is one frame.
    #[serde(default)]
    #[allow(dead_code)]
    scale_factor_temporal: Option<usize>,
    #[serde(default)]
    scale_factor_spatial: Option<usize>,
}

/// `vae/config.json` (`AutoencoderKLQwenImage21`).
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    /// The encoder's width.
    pub base_dim: usize,
    /// The decoder's width (`decoder_base_dim`, or `base_dim` when null).
    pub decoder_base_dim: usize,
    /// Latent channels: the DiT's `in_channels`.
    pub z_dim: usize,
    pub dim_mult: Vec<usize>,
    pub num_res_blocks: usize,
    /// As in the file (encoder order); the decoder reads it reversed.
    pub temperal_downsample: Vec<bool>,
    /// Per-channel statistics of the DiT's latent space, `f32` as the pipeline uses them.
    pub latents_mean: Vec<f32>,
    pub latents_std: Vec<f32>,
    /// Image channels in (encoder) and out (decoder): 4, RGBA.
    pub in_channels: usize,
    pub out_channels: usize,
}

impl VaeConfig {
    /// Parse `json` (read from `path`, named in every error).
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawVae = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if let Some(c) = raw.class_name.as_deref()
            && c != "AutoencoderKLQwenImage21"
        {
            return Err(err(
                "_class_name",
                format!(
                    "{c:?} is not a Qwen-Image-2.1 VAE (expected \"AutoencoderKLQwenImage21\")"
                ),
            ));
        }
        if !raw.is_residual {
            return Err(err(
                "is_residual",
                "false (the Wan-2.1-style decoder) is not supported; Qwen-Image-2.1's is residual"
                    .into(),
            ));
        }
        if raw.patch_size.is_some_and(|p| p != 1) {
            return Err(err(
                "patch_size",
                format!(
                    "{:?} is not supported (only null: Qwen-Image-2.1 does not patchify)",
                    raw.patch_size
                ),
            ));
        }
        let z = raw.z_dim;
        for (v, field) in [
            (z, "z_dim"),
            (raw.base_dim, "base_dim"),
            (raw.in_channels, "in_channels"),
            (raw.out_channels, "out_channels"),
        ] {
            if v == 0 {
                return Err(err(field, "must be at least 1".into()));
            }
        }
        let decoder_base_dim = raw.decoder_base_dim.unwrap_or(raw.base_dim);
        if decoder_base_dim == 0 {
            return Err(err("decoder_base_dim", "must be at least 1".into()));
        }
        if raw.dim_mult.is_empty() || raw.dim_mult.contains(&0) {
            return Err(err(
                "dim_mult",
                format!(
                    "{:?}: expected one or more positive multipliers",
                    raw.dim_mult
                ),
            ));
        }
        let ups = raw.dim_mult.len() - 1;
        if raw.temperal_downsample.len() != ups {
            return Err(err(
                "temperal_downsample",
                format!(
                    "{} entries for {} dim_mult stages (expected {ups}, one per 2× step)",
                    raw.temperal_downsample.len(),
                    raw.dim_mult.len()
                ),
            ));
        }
        if let Some(s) = raw.scale_factor_spatial
            && s != 1 << ups
        {
            return Err(err(
                "scale_factor_spatial",
                format!(
                    "{s}, but {} dim_mult stages upsample {}×",
                    raw.dim_mult.len(),
                    1 << ups
                ),
            ));
        }
        let stats = |v: Option<Vec<f64>>, field: &str| -> Result<Vec<f32>> {
            let v = v.ok_or_else(|| {
                err(
                    field,
                    "missing VAE stats: the pipeline de-normalises the latent with the \
                     checkpoint's latents_mean and latents_std"
                        .into(),
                )
            })?;
            if v.len() != z {
                return Err(err(
                    field,
                    format!("{} values for z_dim {z} (one per latent channel)", v.len()),
                ));
            }
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(err(field, format!("{x} is not a finite number")));
            }
            Ok(v.iter().map(|&x| x as f32).collect())
        };
        let latents_mean = stats(raw.latents_mean, "latents_mean")?;
        let latents_std = stats(raw.latents_std, "latents_std")?;
        let cfg = VaeConfig {
            base_dim: raw.base_dim,
            decoder_base_dim,
            z_dim: z,
            dim_mult: raw.dim_mult,
            num_res_blocks: raw.num_res_blocks,
            temperal_downsample: raw.temperal_downsample,
            latents_mean,
            latents_std,
            in_channels: raw.in_channels,
            out_channels: raw.out_channels,
        };
        for b in cfg.up_blocks() {
            if let Some(f) = b.frames {
                let spec = DupUp {
                    height: 1,
                    width: 1,
                    frames: f,
                };
                if spec.repeats(b.cin, b.cout).is_none() {
                    return Err(err(
                        "dim_mult",
                        format!(
                            "the up block {}→{} channels (temporal factor {f}) cannot carry the \
                             DupUp shortcut: 4·{f}·{} must be a multiple of {} and at least it",
                            b.cin, b.cout, b.cout, b.cin
                        ),
                    ));
                }
            }
        }
        for b in cfg.down_blocks() {
            if b.avg_down(1, 1).group(b.cin, b.cout).is_none() {
                return Err(err(
                    "dim_mult",
                    format!(
                        "the encoder's down block {}→{} channels cannot carry the AvgDown \
                         shortcut: {}·{} must be a multiple of {}",
                        b.cin,
                        b.cout,
                        b.cin,
                        b.avg_down(1, 1).factor(),
                        b.cout
                    ),
                ));
            }
        }
        Ok(cfg)
    }

    /// Output pixels per latent pixel along each side (16 for the release's 5 stages).
    pub fn scale(&self) -> usize {
        1 << (self.dim_mult.len() - 1)
    }

    /// The decoder's widths: `conv_in`'s output, then each up block's.
    fn dims(&self) -> Vec<usize> {
        let d = self.decoder_base_dim;
        let last = self.dim_mult.last().copied().unwrap_or(1);
        std::iter::once(d * last)
            .chain(self.dim_mult.iter().rev().map(|m| d * m))
            .collect()
    }

    /// Each up block's channels in and out and, for those that upsample, its temporal factor.
    pub fn up_blocks(&self) -> Vec<UpBlockShape> {
        let dims = self.dims();
        let n = self.dim_mult.len();
        (0..n)
            .map(|i| UpBlockShape {
                cin: dims[i],
                cout: dims[i + 1],
                frames: (i + 1 < n).then(|| {
                    if self.temperal_downsample[n - 2 - i] {
                        2
                    } else {
                        1
                    }
                }),
            })
            .collect()
    }

    /// The mid block's width (the attention's head width).
    pub fn mid_channels(&self) -> usize {
        self.dims()[0]
    }

    /// The encoder's widths: `conv_in`'s output, then each down block's
    /// (`base_dim · [1] + base_dim · dim_mult`).
    fn encoder_dims(&self) -> Vec<usize> {
        let d = self.base_dim;
        std::iter::once(d)
            .chain(self.dim_mult.iter().map(|m| d * m))
            .collect()
    }

    /// Each encoder down block's channels in and out, whether it halves the image and its
    /// temporal factor (the reference's `temperal_downsample[i]`, never for the last block).
    pub fn down_blocks(&self) -> Vec<DownBlockShape> {
        let dims = self.encoder_dims();
        let n = self.dim_mult.len();
        (0..n)
            .map(|i| {
                let last = i + 1 == n;
                DownBlockShape {
                    cin: dims[i],
                    cout: dims[i + 1],
                    down: !last,
                    frames: if !last && self.temperal_downsample[i] {
                        2
                    } else {
                        1
                    },
                }
            })
            .collect()
    }

    /// The encoder's mid block width (the last down block's).
    pub fn encoder_mid_channels(&self) -> usize {
        self.encoder_dims().last().copied().unwrap_or(self.base_dim)
    }
}

/// The device memory the VAE's passes take, from the config alone (the decoder's and the
/// encoder's blocks are all sized by it): a pipeline that loads them only for their stage
/// (`Residency::Sequential`) checks a request before they load.
impl VaeConfig {
    /// Bytes of device memory [`VaeDecoder::decode`] allocates for one `(h, w)` latent,
    /// compute-type elements being `compute` bytes.
    pub fn decode_bytes(&self, hw: (usize, usize), compute: usize) -> usize {
        self.decode_elems(hw) * (3 * 4 + 2 * compute)
    }

    /// The largest activation any stage of a decode holds for an `h × w` latent, in elements
    /// (the attention's q|k|v included): each up block's resnets go from `cin` to `cout`, its
    /// upsampler keeps `cout`.
    pub(super) fn decode_elems(&self, (h, w): (usize, usize)) -> usize {
        let top = self.mid_channels();
        let mut px = h * w;
        let mut most = px * top.max(self.z_dim).max(3 * top);
        for b in self.up_blocks() {
            most = most.max(px * b.cin.max(b.cout));
            if b.frames.is_some() {
                px *= 4;
                most = most.max(px * b.cout);
            }
        }
        most.max(px * self.out_channels)
    }

    /// Bytes of device memory [`VaeEncoder::encode`](super::vae_encoder::VaeEncoder::encode)
    /// allocates for an `H × W` image, compute-type elements being `compute` bytes.
    pub fn encode_bytes(&self, hw: (usize, usize), compute: usize) -> usize {
        self.encode_elems(hw) * (3 * 4 + 2 * compute)
    }

    /// The largest activation any stage of an encode holds for an `H × W` image, in elements
    /// (the image, the attention's q|k|v and the moments included).
    pub(super) fn encode_elems(&self, (h, w): (usize, usize)) -> usize {
        let mut px = h * w;
        let mut most = px * self.in_channels.max(self.base_dim);
        for b in self.down_blocks() {
            most = most.max(px * b.cin.max(b.cout));
            if b.down {
                px /= 4;
            }
        }
        let top = self.encoder_mid_channels();
        most.max(px * (3 * top).max(2 * self.z_dim))
    }
}

/// One encoder down block's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DownBlockShape {
    pub cin: usize,
    pub cout: usize,
    /// Whether it halves the image (all blocks but the last).
    pub down: bool,
    /// The AvgDown shortcut's temporal factor (2: the image is averaged with a zero frame).
    pub frames: usize,
}

impl DownBlockShape {
    /// The block's AvgDown shortcut over an `h × w` input.
    pub fn avg_down(&self, h: usize, w: usize) -> AvgDown {
        AvgDown {
            height: h,
            width: w,
            frames: self.frames,
            space: if self.down { 2 } else { 1 },
        }
    }
}

/// One decoder up block's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpBlockShape {
    pub cin: usize,
    pub cout: usize,
    /// `Some(temporal factor)` when the block upsamples 2× (and adds the DupUp shortcut).
    pub frames: Option<usize>,
}

/// The ops a decode with `cfg` calls, so a backend can decline before the VAE loads.
pub fn ops(cfg: &VaeConfig) -> Vec<Op> {
    let conv = |kernel, upsample, act| Op::Conv2d {
        kernel,
        upsample,
        downsample: false,
        act,
    };
    let bias = MatmulOp {
        bias: true,
        ..MatmulOp::default()
    };
    let mut ops = vec![
        conv(1, false, None), // post_quant_conv, resnet shortcuts
        conv(3, false, None), // conv_in, resnets, conv_out (their norms apply the SiLU)
        Op::Norm(NormOp::RMS),
        Op::Norm(NormOp {
            act: Some(Activation::Silu),
            ..NormOp::RMS
        }),
        Op::Matmul(bias),
        Op::Matmul(MatmulOp {
            accumulate: true,
            ..bias
        }),
        Op::Attention(AttentionOp {
            head_dim: cfg.mid_channels(),
            mask: MaskKind::Full,
            cached: false,
        }),
    ];
    let blocks = cfg.up_blocks();
    if blocks.iter().any(|b| b.frames.is_some()) {
        ops.extend([conv(3, true, None), Op::DupUp]);
    }
    // A block's first resnet keeping its channels copies its input into the sum first.
    if blocks.iter().any(|b| b.cin == b.cout) {
        ops.push(Op::Cast);
    }
    // The 1×1 shortcuts of channel-changing resnets are `post_quant_conv`'s op.
    ops
}

/// The shared VAE blocks over Wan's `RMS_norm`, as the decoder and the encoder load them.
pub(super) type Norm<B> = VaeRmsNorm<B>;
pub(super) type Resnet<B> = crate::blocks::vae::Resnet<B, Norm<B>>;
pub(super) type Attention<B> = MidAttention<B, Norm<B>>;

/// A resnet's norms are `RMS_norm`s with γ `[C, 1, 1, 1]`.
pub(super) fn resnet<B: Backend>(l: &Loader<'_, B>, cin: usize, cout: usize) -> Result<Resnet<B>> {
    Resnet::load(l, cin, cout, |l, name, c| Norm::load(l, name, c, false))
}

/// The mid block's single-head self-attention: its norm's γ is `[C, 1, 1]`, `to_qkv` and `proj`
/// are 1×1 convolutions (`[out, C, 1, 1]`), run as products over the pixel rows.
pub(super) fn attention<B: Backend>(l: &Loader<'_, B>, c: usize) -> Result<Attention<B>> {
    let linear = |name: &str, out: usize| -> Result<Linear<B>> {
        let mut t = l.tensor(&format!("{name}.weight"), &[out, c, 1, 1])?;
        t.shape = vec![out, c];
        Ok(Linear {
            w: l.backend().matrix(&[t])?,
            b: l.vector(&format!("{name}.bias"), out)?,
        })
    };
    Ok(MidAttention {
        c,
        norm: Norm::load(l, "norm", c, true)?,
        qkv: linear("to_qkv", 3 * c)?,
        out: linear("proj", c)?,
    })
}

struct UpBlock<B: Backend> {
    resnets: Vec<Resnet<B>>,
    /// The upsampler's convolution and the DupUp shortcut's temporal factor.
    upsample: Option<(Conv<B>, usize)>,
}

pub struct VaeDecoder<B: Backend> {
    cfg: VaeConfig,
    post_quant: Conv<B>,
    conv_in: Conv<B>,
    mid: [Resnet<B>; 2],
    attention: Attention<B>,
    up: Vec<UpBlock<B>>,
    norm_out: Norm<B>,
    conv_out: Conv<B>,
    /// Channels into the head (the last up block's).
    head: usize,
}

impl<B: Backend> VaeDecoder<B> {
    /// Load `post_quant_conv.*` and `decoder.*` from the VAE checkpoint, checking every shape
    /// against `cfg`.
    pub fn load(be: &B, cfg: &VaeConfig, weights: &Weights) -> Result<Self> {
        let root = Loader::new(be, weights);
        let l = root.pp("decoder");
        let top = cfg.mid_channels();
        let up = cfg
            .up_blocks()
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let block = l.pp(format_args!("up_blocks.{i}"));
                let resnets = (0..cfg.num_res_blocks + 1)
                    .map(|j| {
                        let cin = if j == 0 { b.cin } else { b.cout };
                        resnet(&block.pp(format_args!("resnets.{j}")), cin, b.cout)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let upsample = match b.frames {
                    Some(f) => Some((
                        Conv::load(&block, "upsampler.resample.1", b.cout, b.cout, 3)?,
                        f,
                    )),
                    None => None,
                };
                Ok(UpBlock { resnets, upsample })
            })
            .collect::<Result<Vec<_>>>()?;
        let c0 = up
            .last()
            .and_then(|b| b.resnets.last())
            .map_or(top, |r| r.cout);
        let mid = l.pp("mid_block");
        Ok(VaeDecoder {
            post_quant: Conv::load(&root, "post_quant_conv", cfg.z_dim, cfg.z_dim, 1)?,
            conv_in: Conv::load(&l, "conv_in", cfg.z_dim, top, 3)?,
            mid: [
                resnet(&mid.pp("resnets.0"), top, top)?,
                resnet(&mid.pp("resnets.1"), top, top)?,
            ],
            attention: attention(&mid.pp("attentions.0"), top)?,
            up,
            norm_out: Norm::load(&l, "norm_out", c0, false)?,
            conv_out: Conv::load(&l, "conv_out", c0, cfg.out_channels, 3)?,
            head: c0,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// [`VaeConfig::decode_bytes`] of this decoder's config.
    pub fn activation_bytes(&self, hw: (usize, usize), compute: usize) -> usize {
        self.cfg.decode_bytes(hw, compute)
    }

    /// Decode the DiT's latent tokens `[h·w, z_dim]` (row `y·w + x`, channels last) into the
    /// image `[H·W, out_channels]`, channels last, clamped to [−1, 1], `H = h · scale`: the
    /// pipeline's de-normalisation `z · std + mean`, then the decoder. Taps: `post_quant`,
    /// `conv_in`, `mid`, `up0` … (after each up block, shortcut included).
    pub fn decode(
        &self,
        be: &B,
        latent: &[f32],
        hw: (usize, usize),
        taps: Option<&mut VaeTaps>,
    ) -> Result<Vec<f32>> {
        let (b, px) = self.run(be, latent, hw, taps)?;
        let mut image = b.image(be, px, self.cfg.out_channels)?;
        for v in &mut image {
            *v = v.clamp(-1.0, 1.0);
        }
        Ok(image)
    }

    /// [`decode`](Self::decode) as the pipeline's 8-bit RGBA pixels ([`VaeBufs::image_rgb8`];
    /// [`to_rgba8`]'s clamp to [−1, 1] is the conversion's own). An infinite value fails its
    /// check here where `decode` would clamp it.
    pub fn decode_rgba8(&self, be: &B, latent: &[f32], hw: (usize, usize)) -> Result<Vec<u8>> {
        let (b, px) = self.run(be, latent, hw, None)?;
        b.image_rgb8(be, px, self.cfg.out_channels)
    }

    /// The decoder's passes, leaving the image in `s` of the returned buffers; with its pixels.
    fn run(
        &self,
        be: &B,
        latent: &[f32],
        (h, w): (usize, usize),
        mut taps: Option<&mut VaeTaps>,
    ) -> Result<(VaeBufs<B>, usize)> {
        let zc = self.cfg.z_dim;
        if latent.len() != zc * h * w || h == 0 || w == 0 {
            return Err(Error::input(format!(
                "latent of {} values; expected {h}×{w} tokens of {zc} channels",
                latent.len()
            )));
        }
        let (mean, std) = (&self.cfg.latents_mean, &self.cfg.latents_std);
        let z: Vec<f32> = latent
            .chunks_exact(zc)
            .flat_map(|t| t.iter().zip(std).zip(mean).map(|((&v, &s), &m)| v * s + m))
            .collect();
        let mut b = VaeBufs::alloc(be, self.cfg.decode_elems((h, w)))?;
        let mut record = |name: &str, buf: &B::Buf, px: usize, ch: usize| {
            taps.as_deref_mut()
                .map_or(Ok(()), |t| t.record(be, name, View::new(buf, px, ch)))
        };
        let mut hw = (h, w);
        let px = h * w;
        be.write_f32(&mut b.k, &z)?;
        self.post_quant
            .run(be, View::new(&b.k, px, zc), hw, false, None, &mut b.s)?;
        record("post_quant", &b.s, px, zc)?;
        let top = self.attention.c;
        self.conv_in
            .run(be, View::new(&b.s, px, zc), hw, false, None, &mut b.x)?;
        record("conv_in", &b.x, px, top)?;

        self.mid[0].forward(be, &mut b, hw)?;
        self.attention
            .forward(be, &mut b.x, (&mut b.c, &mut b.h), hw)?;
        self.mid[1].forward(be, &mut b, hw)?;
        record("mid", &b.x, px, top)?;

        for (i, block) in self.up.iter().enumerate() {
            // The block's input stays in `k` for the shortcut; the first resnet writes `x`.
            std::mem::swap(&mut b.x, &mut b.k);
            let (first, rest) = block
                .resnets
                .split_first()
                .ok_or_else(|| Error::backend("vae", "an up block without resnets"))?;
            first.forward_kept(be, &mut b, hw)?;
            for r in rest {
                r.forward(be, &mut b, hw)?;
            }
            let mut ch = first.cout;
            if let Some((conv, frames)) = &block.upsample {
                let (ih, iw) = hw;
                conv.run_from_stream(
                    be,
                    View::new(&b.x, ih * iw, ch),
                    hw,
                    true,
                    &mut b.c,
                    &mut b.s,
                )?;
                hw = (2 * ih, 2 * iw);
                let spec = DupUp {
                    height: ih,
                    width: iw,
                    frames: *frames,
                };
                be.dup_up(
                    View::new(&b.k, ih * iw, first.cin),
                    &spec,
                    ViewMut::new(&mut b.s, hw.0 * hw.1, conv.cout),
                )?;
                std::mem::swap(&mut b.x, &mut b.s);
                ch = conv.cout;
            }
            record(&format!("up{i}"), &b.x, hw.0 * hw.1, ch)?;
        }

        let px = hw.0 * hw.1;
        b.head(be, &self.norm_out, &self.conv_out, hw, self.head)?;
        Ok((b, px))
    }
}

/// The decoder's image `[pixels, channels]` in [−1, 1] as 8-bit values, exactly as the
/// pipeline's `VaeImageProcessor.postprocess` + `numpy_to_pil` make them: Z-Image's conversion
/// ([`crate::blocks::vae::to_rgb8`], elementwise); four channels stay a straight (not premultiplied) RGBA
/// image.
pub fn to_rgba8(image: &[f32]) -> Vec<u8> {
    crate::blocks::vae::to_rgb8(image)
}
