//! The VAE decoder of Z-Image (the Flux autoencoder as diffusers' `AutoencoderKL`, spec §5).
//!
//! Reference: diffusers 0.42.1 `models/autoencoders/vae.py` (`Decoder`), `unets/unet_2d_blocks.py`
//! (`UNetMidBlock2D`, `UpDecoderBlock2D`), `resnet.py` (`ResnetBlock2D`), `upsampling.py`
//! (`Upsample2D`), `attention_processor.py` (`AttnProcessor2_0`). `conv_in` → mid (ResNet →
//! 1-head self-attention → ResNet) → up blocks (`layers_per_block + 1` ResNets each, all but the
//! last followed by nearest-2× upsampling and a 3×3 conv) → GroupNorm → SiLU → `conv_out`.
//! ResNets are `x' + conv2(SiLU(GN(conv1(SiLU(GN(x))))))` with a 1×1 `conv_shortcut` when the
//! channel count changes. All GroupNorms use `eps = 1e-6`.
//!
//! Images are channels-last `[pixels, channels]` buffers (one image), so the attention's tokens
//! are plain rows. Only `decoder.*` tensors are read; the encoder is never needed. The blocks
//! (resnet, mid attention, GroupNorm) are [`crate::blocks::vae`]'s; this file is their layout.

use tessera_backend::{Backend, Role, View};
use tessera_core::{Error, Result, Weights};

use super::config::VaeConfig;
use crate::blocks::vae::{Conv, MidAttention, VaeBufs, VaeGroupNorm};
use crate::loader::{Linear, Loader};

pub use crate::blocks::vae::{VaeTaps, to_rgb8};

const GN_EPS: f32 = 1e-6;

/// The shared VAE blocks over diffusers' `nn.GroupNorm`.
type Norm<B> = VaeGroupNorm<B>;
type Resnet<B> = crate::blocks::vae::Resnet<B, Norm<B>>;
type Attention<B> = MidAttention<B, Norm<B>>;

/// A GroupNorm of `c` channels with the config's groups.
fn norm<B: Backend>(l: &Loader<'_, B>, name: &str, c: usize, groups: usize) -> Result<Norm<B>> {
    VaeGroupNorm::load(l, name, c, groups, GN_EPS)
}

fn resnet<B: Backend>(
    l: &Loader<'_, B>,
    cin: usize,
    cout: usize,
    groups: usize,
) -> Result<Resnet<B>> {
    Resnet::load(l, cin, cout, |l, name, c| norm(l, name, c, groups))
}

/// The mid block's single-head self-attention: its GroupNorm, `to_q | to_k | to_v` stacked with
/// their biases, `to_out.0`.
fn attention<B: Backend>(l: &Loader<'_, B>, c: usize, groups: usize) -> Result<Attention<B>> {
    let qkv = [("to_q.weight", c), ("to_k.weight", c), ("to_v.weight", c)];
    let bias = [("to_q.bias", c), ("to_k.bias", c), ("to_v.bias", c)];
    Ok(MidAttention {
        c,
        norm: norm(l, "group_norm", c, groups)?,
        qkv: Linear {
            w: l.stacked(&qkv, c)?,
            b: l.stacked_vector(&bias)?,
        },
        out: l.linear("to_out.0", c, c)?,
    })
}

struct UpBlock<B: Backend> {
    resnets: Vec<Resnet<B>>,
    upsample: Option<Conv<B>>,
}

pub struct VaeDecoder<B: Backend> {
    cfg: VaeConfig,
    conv_in: Conv<B>,
    mid: [Resnet<B>; 2],
    mid_attention: Option<Attention<B>>,
    up: Vec<UpBlock<B>>,
    norm_out: Norm<B>,
    conv_out: Conv<B>,
}

impl<B: Backend> VaeDecoder<B> {
    /// Load `decoder.*` from the VAE checkpoint, checking every shape against `cfg`.
    pub fn load(be: &B, cfg: &VaeConfig, weights: &Weights) -> Result<Self> {
        let l = Loader::new(be, weights).pp("decoder");
        let groups = cfg.groups;
        let rev: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let top = rev[0];
        let mut up = Vec::with_capacity(rev.len());
        let mut prev = top;
        for (i, &c) in rev.iter().enumerate() {
            let block = l.pp(format_args!("up_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let cin = if j == 0 { prev } else { c };
                    resnet(&block.pp(format_args!("resnets.{j}")), cin, c, groups)
                })
                .collect::<Result<Vec<_>>>()?;
            let upsample = if i + 1 < rev.len() {
                Some(Conv::load(&block, "upsamplers.0.conv", c, c, 3)?)
            } else {
                None
            };
            up.push(UpBlock { resnets, upsample });
            prev = c;
        }
        let c0 = cfg.block_out_channels[0];
        let mid = l.pp("mid_block");
        Ok(VaeDecoder {
            conv_in: Conv::load(&l, "conv_in", cfg.latent_channels, top, 3)?,
            mid: [
                resnet(&mid.pp("resnets.0"), top, top, groups)?,
                resnet(&mid.pp("resnets.1"), top, top, groups)?,
            ],
            mid_attention: if cfg.mid_attention {
                Some(attention(&mid.pp("attentions.0"), top, groups)?)
            } else {
                None
            },
            up,
            norm_out: norm(&l, "conv_norm_out", c0, groups)?,
            conv_out: Conv::load(&l, "conv_out", c0, cfg.out_channels, 3)?,
            cfg: cfg.clone(),
        })
    }

    /// [`VaeConfig::decode_bytes`] of this decoder's config.
    pub fn activation_bytes(&self, hw: (usize, usize), compute: usize) -> usize {
        self.cfg.decode_bytes(hw, compute)
    }

    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// Decode a sampler latent `[latent_channels, h, w]`: applies `z / scaling_factor +
    /// shift_factor` (as the pipeline does) and returns the image `[H·W, out_channels]`
    /// channels-last in ≈[−1, 1], `H = h · scale`. Taps: `conv_in`, `mid`, `up0` ….
    pub fn decode(
        &self,
        be: &B,
        latent: &[f32],
        hw: (usize, usize),
        taps: Option<&mut VaeTaps>,
    ) -> Result<Vec<f32>> {
        let (bufs, px) = self.run(be, latent, hw, taps)?;
        bufs.image(be, px, self.cfg.out_channels)
    }

    /// [`decode`](Self::decode) as the pipeline's 8-bit pixels ([`VaeBufs::image_rgb8`]).
    pub fn decode_rgb8(&self, be: &B, latent: &[f32], hw: (usize, usize)) -> Result<Vec<u8>> {
        let (bufs, px) = self.run(be, latent, hw, None)?;
        bufs.image_rgb8(be, px, self.cfg.out_channels)
    }

    /// The decoder's passes, leaving the image in `s` of the returned buffers; with its pixels.
    fn run(
        &self,
        be: &B,
        latent: &[f32],
        (h, w): (usize, usize),
        mut taps: Option<&mut VaeTaps>,
    ) -> Result<(VaeBufs<B>, usize)> {
        let c = &self.cfg;
        let lc = c.latent_channels;
        if latent.len() != lc * h * w || h == 0 || w == 0 {
            return Err(Error::input(format!(
                "latent of {} values; expected {lc}×{h}×{w}",
                latent.len()
            )));
        }
        let (sf, shift) = (c.scaling_factor, c.shift_factor);
        let mut z = vec![0f32; lc * h * w];
        for ch in 0..lc {
            for p in 0..h * w {
                z[p * lc + ch] = latent[ch * h * w + p] / sf + shift;
            }
        }
        let mut bufs = VaeBufs::alloc(be, self.cfg.decode_elems((h, w)))?;
        be.write_f32(&mut bufs.k, &z)?;
        let mut hw = (h, w);
        let top = self.conv_in.cout;
        self.conv_in.run(
            be,
            View::new(&bufs.k, h * w, lc),
            hw,
            false,
            None,
            &mut bufs.x,
        )?;
        let mut record = |name: &str, b: &B::Buf, px: usize, ch: usize| {
            taps.as_deref_mut()
                .map_or(Ok(()), |t| t.record(be, name, View::new(b, px, ch)))
        };
        record("conv_in", &bufs.x, h * w, top)?;
        self.mid[0].forward(be, &mut bufs, hw)?;
        if let Some(a) = &self.mid_attention {
            // GEMM and attention operands in the compute type (bf16 under bf16).
            let px = h * w;
            let mut qkv = be.alloc(3 * px * a.c, Role::Compute)?;
            let mut normed = be.alloc(px * a.c, Role::Compute)?;
            a.forward(be, &mut bufs.x, (&mut normed, &mut qkv), hw)?;
        }
        self.mid[1].forward(be, &mut bufs, hw)?;
        record("mid", &bufs.x, h * w, top)?;
        for (i, b) in self.up.iter().enumerate() {
            for r in &b.resnets {
                r.forward(be, &mut bufs, hw)?;
            }
            let ch = b.resnets.last().map_or(top, |r| r.cout);
            if let Some(conv) = &b.upsample {
                conv.run_from_stream(
                    be,
                    View::new(&bufs.x, hw.0 * hw.1, ch),
                    hw,
                    true,
                    &mut bufs.c,
                    &mut bufs.s,
                )?;
                std::mem::swap(&mut bufs.x, &mut bufs.s);
                hw = (hw.0 * 2, hw.1 * 2);
            }
            record(&format!("up{i}"), &bufs.x, hw.0 * hw.1, ch)?;
        }
        let px = hw.0 * hw.1;
        let c0 = c.block_out_channels[0];
        bufs.head(be, &self.norm_out, &self.conv_out, hw, c0)?;
        Ok((bufs, px))
    }
}
