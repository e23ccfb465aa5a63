//! The VAE encoder of Qwen-Image-2.1 (`AutoencoderKLQwenImage21.encode`, spec A7) as the edit
//! pipeline uses it: a condition image in, its DiT-space latent tokens out.
//!
//! Reference: diffusers 0.42.1 `models/autoencoders/autoencoder_kl_qwenimage21.py`
//! (`QwenImage21Encoder3d` with `is_residual=True`, `quant_conv`) and the pipeline's
//! `_encode_vae_image` + `_pack_latents` (`pipeline_qwenimage21.py`). For an `H × W` image
//! `[H·W, in_channels]` in [−1, 1] (channels last; RGBA for the release):
//!
//! 1. `conv_in` (3×3, → `base_dim`);
//! 2. `len(dim_mult)` down blocks, block `i` from `dims[i]` to `dims[i+1]` channels
//!    (`dims = base_dim · [1] + base_dim · dim_mult`): `num_res_blocks` resnets (the decoder's
//!    blocks, [`crate::blocks::vae`]), then — all but the last block — the downsampler (zero pad one
//!    row and column at the bottom and right, 3×3 convolution at stride 2: the backend's
//!    downsampling `conv2d`), plus the `AvgDown3D` shortcut of the block's input
//!    ([`tessera_backend::AvgDown`], temporal factor 2 where `temperal_downsample[i]`: the image
//!    is averaged with a zero frame). The last block's shortcut folds no space (a mean over
//!    groups of `cin / cout` channels: the identity for the release's 768 → 768);
//! 3. the mid block (resnet → single-head self-attention → resnet), `norm_out` → SiLU →
//!    `conv_out` (3×3, → `2·z_dim`: mean ‖ log-variance), `quant_conv` (1×1);
//! 4. the posterior's mode: the first `z_dim` channels (the pipeline samples with
//!    `sample_mode="argmax"`; the log-variance is never used);
//! 5. the pipeline's normalisation `(z − latents_mean) / latents_std` per channel (the config's
//!    statistics rounded to `f32`, as `torch.tensor` makes them), and `_pack_latents`: the
//!    `h × w` latent as tokens `[h·w, z_dim]`, row `y·w + x` — the channels-last layout itself.
//!
//! What the reference showed beyond the spec: the image sides must be multiples of the VAE's
//! scale (16): `AvgDown3D` reshapes the image into 2×2 cells and fails on an odd side, so the
//! pipeline's sizes (multiples of 32) always fit. `downsample3d`'s `time_conv` runs only from a
//! second chunk of frames on, never for one image. For the release the shortcut groups are 4
//! expanded channels (a 2×2 mean per channel, and with temporal factor 2 every even output
//! channel is zero and every odd one the 2×2 mean of channel `o/2`).
//!
//! Only `encoder.*` and `quant_conv.*` are read.

use tessera_backend::op::{AttentionOp, MaskKind, MatmulOp, NormOp};
use tessera_backend::{Activation, Backend, Op, View, ViewMut};
use tessera_core::{Error, Result, Weights};

use super::vae::{Attention, Norm, Resnet, VaeConfig, attention, resnet};
use crate::blocks::vae::{Conv, VaeBufs};
use crate::loader::Loader;

/// Intermediate images recorded for parity tests: `conv_in`, `down0` … (after each down block,
/// shortcut included), `mid`, `head` (`conv_out`: mean ‖ log-variance), `moments`
/// (`quant_conv`), `mean` (the posterior's mode).
pub use crate::blocks::vae::VaeTaps as EncoderTaps;

/// The ops an encode with `cfg` calls, so a backend can decline before the encoder loads.
pub fn ops(cfg: &VaeConfig) -> Vec<Op> {
    let conv = |kernel, act, downsample| Op::Conv2d {
        kernel,
        upsample: false,
        downsample,
        act,
    };
    let bias = MatmulOp {
        bias: true,
        ..MatmulOp::default()
    };
    let blocks = cfg.down_blocks();
    let mut ops = vec![
        conv(3, None, false), // conv_in, resnets, conv_out (their norms apply the SiLU)
        conv(1, None, false), // quant_conv
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
            head_dim: cfg.encoder_mid_channels(),
            mask: MaskKind::Full,
            cached: false,
        }),
        Op::AvgDown,
    ];
    if blocks.iter().any(|b| b.down) {
        ops.push(conv(3, None, true));
    }
    // A block's first resnet keeping its channels copies its input into the sum first.
    if blocks.iter().any(|b| b.cin == b.cout) {
        ops.push(Op::Cast);
    }
    // The 1×1 shortcuts of channel-changing resnets are `quant_conv`'s op.
    ops
}

struct DownBlock<B: Backend> {
    resnets: Vec<Resnet<B>>,
    /// The downsampler's stride-2 convolution (all blocks but the last).
    downsampler: Option<Conv<B>>,
    cin: usize,
    cout: usize,
    /// The AvgDown shortcut's temporal factor.
    frames: usize,
}

pub struct VaeEncoder<B: Backend> {
    cfg: VaeConfig,
    conv_in: Conv<B>,
    down: Vec<DownBlock<B>>,
    mid: [Resnet<B>; 2],
    attention: Attention<B>,
    norm_out: Norm<B>,
    conv_out: Conv<B>,
    quant: Conv<B>,
    /// The mid block's width.
    top: usize,
}

impl<B: Backend> VaeEncoder<B> {
    /// Load `encoder.*` and `quant_conv.*` from the VAE checkpoint, checking every shape against
    /// `cfg`.
    pub fn load(be: &B, cfg: &VaeConfig, weights: &Weights) -> Result<Self> {
        let root = Loader::new(be, weights);
        let l = root.pp("encoder");
        let shapes = cfg.down_blocks();
        let base = cfg.base_dim;
        let down = shapes
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let block = l.pp(format_args!("down_blocks.{i}"));
                let resnets = (0..cfg.num_res_blocks)
                    .map(|j| {
                        let cin = if j == 0 { b.cin } else { b.cout };
                        resnet(&block.pp(format_args!("resnets.{j}")), cin, b.cout)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let downsampler = if b.down {
                    Some(Conv::load(
                        &block,
                        "downsampler.resample.1",
                        b.cout,
                        b.cout,
                        3,
                    )?)
                } else {
                    None
                };
                Ok(DownBlock {
                    resnets,
                    downsampler,
                    cin: b.cin,
                    cout: b.cout,
                    frames: b.frames,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let top = cfg.encoder_mid_channels();
        let mid = l.pp("mid_block");
        let z2 = 2 * cfg.z_dim;
        Ok(VaeEncoder {
            conv_in: Conv::load(&l, "conv_in", cfg.in_channels, base, 3)?,
            down,
            mid: [
                resnet(&mid.pp("resnets.0"), top, top)?,
                resnet(&mid.pp("resnets.1"), top, top)?,
            ],
            attention: attention(&mid.pp("attentions.0"), top)?,
            norm_out: Norm::load(&l, "norm_out", top, false)?,
            conv_out: Conv::load(&l, "conv_out", top, z2, 3)?,
            quant: Conv::load(&root, "quant_conv", z2, z2, 1)?,
            top,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// [`VaeConfig::encode_bytes`] of this encoder's config.
    pub fn activation_bytes(&self, hw: (usize, usize), compute: usize) -> usize {
        self.cfg.encode_bytes(hw, compute)
    }

    /// Whether an `H × W` image can be encoded: non-empty, both sides multiples of the VAE's
    /// scale (the reference's `AvgDown3D` folds 2×2 cells at every down block).
    pub fn check_size(&self, (h, w): (usize, usize)) -> Result<()> {
        let s = self.cfg.scale();
        if h == 0 || w == 0 || !h.is_multiple_of(s) || !w.is_multiple_of(s) {
            return Err(Error::input(format!(
                "a {w}×{h} image cannot be VAE-encoded: both sides must be positive multiples of \
                 {s}"
            )));
        }
        Ok(())
    }

    /// Encode an `H × W` image `[H·W, in_channels]` (channels last, values in [−1, 1]) into the
    /// pipeline's condition latent: the posterior's mean, normalised
    /// `(z − latents_mean) / latents_std`, as DiT-space tokens `[h·w, z_dim]` (row `y·w + x`,
    /// `h = H / scale`). Returns the tokens and `(h, w)`.
    pub fn encode(
        &self,
        be: &B,
        image: &[f32],
        (ih, iw): (usize, usize),
        mut taps: Option<&mut EncoderTaps>,
    ) -> Result<(Vec<f32>, (usize, usize))> {
        self.check_size((ih, iw))?;
        let cin = self.cfg.in_channels;
        if image.len() != ih * iw * cin {
            return Err(Error::input(format!(
                "image of {} values; expected {ih}×{iw} pixels of {cin} channels",
                image.len()
            )));
        }
        let mut b = VaeBufs::alloc(be, self.cfg.encode_elems((ih, iw)))?;
        let mut record = |name: &str, buf: &B::Buf, px: usize, ch: usize| {
            taps.as_deref_mut()
                .map_or(Ok(()), |t| t.record(be, name, View::new(buf, px, ch)))
        };
        let mut hw = (ih, iw);
        be.write_f32(&mut b.k, image)?;
        self.conv_in
            .run(be, View::new(&b.k, ih * iw, cin), hw, false, None, &mut b.x)?;
        record("conv_in", &b.x, ih * iw, self.conv_in.cout)?;

        for (i, block) in self.down.iter().enumerate() {
            let px = hw.0 * hw.1;
            // The block's input stays in `k` for the shortcut; the first resnet writes `x`.
            std::mem::swap(&mut b.x, &mut b.k);
            let (first, rest) = block
                .resnets
                .split_first()
                .ok_or_else(|| Error::backend("vae", "a down block without resnets"))?;
            first.forward_kept(be, &mut b, hw)?;
            for r in rest {
                r.forward(be, &mut b, hw)?;
            }
            let shape = super::vae::DownBlockShape {
                cin: block.cin,
                cout: block.cout,
                down: block.downsampler.is_some(),
                frames: block.frames,
            };
            let spec = shape.avg_down(hw.0, hw.1);
            if let Some(conv) = &block.downsampler {
                conv.downsample(be, View::new(&b.x, px, block.cout), hw, &mut b.s)?;
                std::mem::swap(&mut b.x, &mut b.s);
                hw = (hw.0 / 2, hw.1 / 2);
            }
            let out_px = hw.0 * hw.1;
            be.avg_down(
                View::new(&b.k, px, block.cin),
                &spec,
                ViewMut::new(&mut b.x, out_px, block.cout),
            )?;
            record(&format!("down{i}"), &b.x, out_px, block.cout)?;
        }

        let (px, top) = (hw.0 * hw.1, self.top);
        self.mid[0].forward(be, &mut b, hw)?;
        self.attention
            .forward(be, &mut b.x, (&mut b.c, &mut b.h), hw)?;
        self.mid[1].forward(be, &mut b, hw)?;
        record("mid", &b.x, px, top)?;

        let z2 = 2 * self.cfg.z_dim;
        b.head(be, &self.norm_out, &self.conv_out, hw, top)?;
        record("head", &b.s, px, z2)?;
        self.quant
            .run(be, View::new(&b.s, px, z2), hw, false, None, &mut b.x)?;
        record("moments", &b.x, px, z2)?;

        let zc = self.cfg.z_dim;
        let mut mean = be.read_f32(View::new(&b.x, px, z2).cols(0, zc))?;
        if let Some(t) = taps {
            t.values.insert("mean".into(), mean.clone());
        }
        let (m, s) = (&self.cfg.latents_mean, &self.cfg.latents_std);
        for token in mean.chunks_exact_mut(zc) {
            for ((v, &m), &s) in token.iter_mut().zip(m).zip(s) {
                *v = (*v - m) / s;
            }
        }
        Ok((mean, hw))
    }
}

/// An 8-bit image `[pixels, channels]` as the VAE's input, exactly as the pipeline's
/// `VaeImageProcessor.preprocess` makes it in `f32`: `v / 255` (numpy, float32), then
/// `2·x − 1` (torch, float32).
pub fn from_rgba8(pixels: &[u8]) -> Vec<f32> {
    pixels
        .iter()
        .map(|&v| 2.0 * (v as f32 / 255.0) - 1.0)
        .collect()
}
