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
//! are plain rows. Only `decoder.*` tensors are read; the encoder is never needed.

use std::collections::BTreeMap;

use tessera_backend::{
    Activation, AttnSpec, Backend, GroupNorm, Mask, QkvLayout, Role, View, ViewMut,
};
use tessera_core::{Error, Result, Weights};

use super::config::VaeConfig;
use crate::blocks::conv::Conv;
use crate::loader::{Linear, Loader};

const GN_EPS: f32 = 1e-6;

/// GroupNorm weight and bias.
struct Norm<B: Backend> {
    w: B::Vector,
    b: B::Vector,
}

impl<B: Backend> Norm<B> {
    fn load(l: &Loader<'_, B>, name: &str, c: usize) -> Result<Self> {
        Ok(Norm {
            w: l.vector(&format!("{name}.weight"), c)?,
            b: l.vector(&format!("{name}.bias"), c)?,
        })
    }
}

struct Resnet<B: Backend> {
    cin: usize,
    cout: usize,
    norm1: Norm<B>,
    conv1: Conv<B>,
    norm2: Norm<B>,
    conv2: Conv<B>,
    shortcut: Option<Conv<B>>,
}

impl<B: Backend> Resnet<B> {
    fn load(l: &Loader<'_, B>, cin: usize, cout: usize) -> Result<Self> {
        Ok(Resnet {
            cin,
            cout,
            norm1: Norm::load(l, "norm1", cin)?,
            conv1: Conv::load(l, "conv1", cin, cout, 3)?,
            norm2: Norm::load(l, "norm2", cout)?,
            conv2: Conv::load(l, "conv2", cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(Conv::load(l, "conv_shortcut", cin, cout, 1)?)
            } else {
                None
            },
        })
    }
}

/// The mid block's single-head self-attention with its GroupNorm.
struct Attention<B: Backend> {
    c: usize,
    norm: Norm<B>,
    /// `to_q | to_k | to_v` with their biases.
    qkv: Linear<B>,
    out: Linear<B>,
}

impl<B: Backend> Attention<B> {
    fn load(l: &Loader<'_, B>, c: usize) -> Result<Self> {
        let qkv = [("to_q.weight", c), ("to_k.weight", c), ("to_v.weight", c)];
        let bias = [("to_q.bias", c), ("to_k.bias", c), ("to_v.bias", c)];
        Ok(Attention {
            c,
            norm: Norm::load(l, "group_norm", c)?,
            qkv: Linear {
                w: l.stacked(&qkv, c)?,
                b: l.stacked_vector(&bias)?,
            },
            out: l.linear("to_out.0", c, c)?,
        })
    }
}

struct UpBlock<B: Backend> {
    resnets: Vec<Resnet<B>>,
    upsample: Option<Conv<B>>,
}

/// Intermediate images recorded for parity tests (`conv_in`, `mid`, `up0` …), channels-last.
#[derive(Default, Debug)]
pub struct VaeTaps {
    pub values: BTreeMap<String, Vec<f32>>,
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

/// Four activation buffers, rotated as a ResNet needs them (input kept for the skip).
/// The decoder's activations. `x` is the residual stream; `n` and `y` take outputs that are
/// swapped into it (a shortcut's, an upsampling's); GroupNorm outputs (`c`) and the first
/// convolution of a block (`h`) are only ever read by a convolution or the next GroupNorm, so
/// they are in the compute type, which halves their traffic and the columns' reads under bf16.
struct Bufs<B: Backend> {
    x: B::Buf,
    n: B::Buf,
    c: B::Buf,
    h: B::Buf,
    y: B::Buf,
}

impl<B: Backend> VaeDecoder<B> {
    /// Load `decoder.*` from the VAE checkpoint, checking every shape against `cfg`.
    pub fn load(be: &B, cfg: &VaeConfig, weights: &Weights) -> Result<Self> {
        let l = Loader::new(be, weights).pp("decoder");
        let rev: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let top = rev[0];
        let mut up = Vec::with_capacity(rev.len());
        let mut prev = top;
        for (i, &c) in rev.iter().enumerate() {
            let block = l.pp(format_args!("up_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let cin = if j == 0 { prev } else { c };
                    Resnet::load(&block.pp(format_args!("resnets.{j}")), cin, c)
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
                Resnet::load(&mid.pp("resnets.0"), top, top)?,
                Resnet::load(&mid.pp("resnets.1"), top, top)?,
            ],
            mid_attention: if cfg.mid_attention {
                Some(Attention::load(&mid.pp("attentions.0"), top)?)
            } else {
                None
            },
            up,
            norm_out: Norm::load(&l, "conv_norm_out", c0)?,
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
    /// channels-last in ≈[−1, 1], `H = h · scale`.
    pub fn decode(
        &self,
        be: &B,
        latent: &[f32],
        (h, w): (usize, usize),
        mut taps: Option<&mut VaeTaps>,
    ) -> Result<Vec<f32>> {
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
        let n = self.cfg.decode_elems((h, w));
        let (stream, compute) = (|| be.alloc(n, Role::Stream), || be.alloc(n, Role::Compute));
        let mut bufs = Bufs {
            x: stream()?,
            n: stream()?,
            c: compute()?,
            h: compute()?,
            y: stream()?,
        };
        be.write_f32(&mut bufs.n, &z)?;
        let mut hw = (h, w);
        let top = self.conv_in.cout;
        self.conv_in.run(
            be,
            View::new(&bufs.n, h * w, lc),
            hw,
            false,
            None,
            &mut bufs.x,
        )?;
        let mut record = |name: &str, b: &B::Buf, px: usize, ch: usize| -> Result<()> {
            if let Some(t) = taps.as_deref_mut() {
                t.values
                    .insert(name.to_string(), be.read_f32(View::new(b, px, ch))?);
            }
            Ok(())
        };
        record("conv_in", &bufs.x, h * w, top)?;
        self.resnet(be, &self.mid[0], &mut bufs, hw)?;
        if let Some(a) = &self.mid_attention {
            // GEMM and attention operands in the compute type (bf16 under bf16).
            let px = h * w;
            let mut qkv = be.alloc(3 * px * a.c, Role::Compute)?;
            let mut normed = be.alloc(px * a.c, Role::Compute)?;
            self.attention(be, a, &mut bufs.x, (&mut qkv, &mut normed), hw)?;
        }
        self.resnet(be, &self.mid[1], &mut bufs, hw)?;
        record("mid", &bufs.x, h * w, top)?;
        for (i, b) in self.up.iter().enumerate() {
            for r in &b.resnets {
                self.resnet(be, r, &mut bufs, hw)?;
            }
            let ch = b.resnets.last().map_or(top, |r| r.cout);
            if let Some(conv) = &b.upsample {
                conv.run_from_stream(
                    be,
                    View::new(&bufs.x, hw.0 * hw.1, ch),
                    hw,
                    true,
                    &mut bufs.c,
                    &mut bufs.y,
                )?;
                std::mem::swap(&mut bufs.x, &mut bufs.y);
                hw = (hw.0 * 2, hw.1 * 2);
            }
            record(&format!("up{i}"), &bufs.x, hw.0 * hw.1, ch)?;
        }
        let px = hw.0 * hw.1;
        let c0 = c.block_out_channels[0];
        be.group_norm(
            View::new(&bufs.x, px, c0),
            &self.norm_out.w,
            &self.norm_out.b,
            &GroupNorm {
                groups: c.groups,
                eps: GN_EPS,
                act: Some(Activation::Silu),
            },
            ViewMut::new(&mut bufs.c, px, c0),
        )?;
        self.conv_out
            .run(be, View::new(&bufs.c, px, c0), hw, false, None, &mut bufs.y)?;
        be.read_f32(View::new(&bufs.y, px, c.out_channels))
    }

    fn group_norm(
        &self,
        be: &B,
        n: &Norm<B>,
        x: View<'_, B>,
        act: bool,
        out: ViewMut<'_, B>,
    ) -> Result<()> {
        let spec = GroupNorm {
            groups: self.cfg.groups,
            eps: GN_EPS,
            act: act.then_some(Activation::Silu),
        };
        be.group_norm(x, &n.w, &n.b, &spec, out)
    }

    /// `x ← x' + conv2(SiLU(GN₂(conv1(SiLU(GN₁(x))))))`, the add fused into conv2.
    fn resnet(&self, be: &B, r: &Resnet<B>, b: &mut Bufs<B>, hw: (usize, usize)) -> Result<()> {
        let px = hw.0 * hw.1;
        self.group_norm(
            be,
            &r.norm1,
            View::new(&b.x, px, r.cin),
            true,
            ViewMut::new(&mut b.c, px, r.cin),
        )?;
        r.conv1
            .run(be, View::new(&b.c, px, r.cin), hw, false, None, &mut b.h)?;
        self.group_norm(
            be,
            &r.norm2,
            View::new(&b.h, px, r.cout),
            true,
            ViewMut::new(&mut b.c, px, r.cout),
        )?;
        if let Some(sc) = &r.shortcut {
            // conv1's output (`h`) is spent: it holds the stream's bf16 copy.
            sc.run_from_stream(
                be,
                View::new(&b.x, px, r.cin),
                hw,
                false,
                &mut b.h,
                &mut b.n,
            )?;
            std::mem::swap(&mut b.x, &mut b.n);
        }
        // The residual add in the convolution: x' += conv2(…), stored once.
        r.conv2
            .add_to(be, View::new(&b.c, px, r.cout), hw, None, &mut b.x)
    }

    /// `x ← x + to_out(softmax(q kᵀ/√C) v)` over the pixels, q, k, v from `GN(x)`; `qkv`
    /// `[px, 3C]` and `n` `[px, C]` are compute-type buffers.
    fn attention(
        &self,
        be: &B,
        a: &Attention<B>,
        x: &mut B::Buf,
        (qkv_buf, n): (&mut B::Buf, &mut B::Buf),
        hw: (usize, usize),
    ) -> Result<()> {
        let (px, c) = (hw.0 * hw.1, a.c);
        self.group_norm(
            be,
            &a.norm,
            View::new(x, px, c),
            false,
            ViewMut::new(n, px, c),
        )?;
        be.matmul(
            View::new(n, px, c),
            &a.qkv.w,
            ViewMut::new(qkv_buf, px, 3 * c),
            &a.qkv.epilogue(),
        )?;
        let layout = QkvLayout {
            heads_q: 1,
            heads_kv: 1,
            head_dim: c,
        };
        let spec = AttnSpec::new(layout, (c as f32).powf(-0.5), Mask::Full);
        let segs = be.segments(&[px])?;
        let qkv = View::new(qkv_buf, px, 3 * c);
        be.attention(
            qkv.cols(0, c),
            qkv.cols(c, c),
            qkv.cols(2 * c, c),
            ViewMut::new(n, px, c),
            &spec,
            &segs,
        )?;
        // x += to_out(a) + bias, folded into the product.
        be.matmul(
            View::new(n, px, c),
            &a.out.w,
            ViewMut::new(x, px, c),
            &a.out.epilogue().accumulate(),
        )
    }
}

/// The VAE's output `[pixels, 3]` in ≈[−1, 1] as 8-bit RGB, exactly as diffusers'
/// `VaeImageProcessor.postprocess` + `numpy_to_pil` do in `f32`: `clamp(x·0.5 + 0.5, 0, 1)`,
/// then `round(v·255)` with ties to even (NaN as 0, as a cast to `u8` makes it).
///
/// The rounding is the FPU's own: `y + 2²³` for `y` in [0, 255] rounds `y` to an integer with
/// ties to even (the default rounding mode) and leaves it in the low byte of the sum's bits.
/// Unlike `round_ties_even` (a libm call per value) this vectorises: a 1024² image took ~20 ms
/// of host time after the GPU's decode, now ~2 ms.
pub fn to_rgb8(image: &[f32]) -> Vec<u8> {
    const ROUND: f32 = 8_388_608.0; // 2²³
    let mut out = vec![0u8; image.len()];
    for (o, &x) in out.iter_mut().zip(image) {
        // `max`/`min` send NaN to 0 where `clamp` would keep it.
        #[allow(clippy::manual_clamp)]
        let v = (x * 0.5 + 0.5).max(0.0).min(1.0);
        *o = ((v * 255.0 + ROUND).to_bits() & 0xff) as u8;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::to_rgb8;

    #[test]
    fn rounds_exact_ties_to_even_and_clamps() {
        assert_eq!(to_rgb8(&[-3.0, 3.0, 0.0]), [0, 255, 128]);
        // Levels k + ½ whose f32 product v·255 is an exact tie: ties go to the even level.
        let mut ties = 0;
        for k in 64..255u32 {
            let v = ((k as f64 + 0.5) / 255.0) as f32;
            if v * 255.0 != k as f32 + 0.5 {
                continue;
            }
            ties += 1;
            let x = (v - 0.5) * 2.0; // exact for v ≥ ¼, and x·½ + ½ gives v back
            let want = if k % 2 == 0 { k } else { k + 1 };
            assert_eq!(to_rgb8(&[x])[0] as u32, want, "level {k}.5");
        }
        assert!(ties >= 10, "only {ties} exact ties found");
    }

    #[test]
    fn the_vectorised_rounding_equals_round_ties_even_on_every_kind_of_value() {
        let reference = |x: f32| {
            let v = (x * 0.5 + 0.5).clamp(0.0, 1.0);
            (v * 255.0).round_ties_even() as u8
        };
        // A million bit patterns spread over all of f32 (both signs, subnormals, huge values),
        // every value near the image's range, and the specials.
        let mut xs: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
        xs.extend((0..=400_000).map(|i| -1.2 + i as f32 * 6e-6));
        xs.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
        ]);
        let got = to_rgb8(&xs);
        for (&x, &g) in xs.iter().zip(&got) {
            assert_eq!(g, reference(x), "x = {x:e} ({:#010x})", x.to_bits());
        }
    }
}
