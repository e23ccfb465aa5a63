//! The blocks of the VAEs (Z-Image's Flux/SD-style decoder, Qwen-Image's Wan-style decoder and
//! encoder), each written once over a norm ([`VaeNorm`]: GroupNorm or RMS): the convolution,
//! the resnet, the mid attention, the activation buffers they rotate through, the output head
//! and the 8-bit conversion. Each family's `vae.rs` keeps its layout, loading and block order.
//!
//! Images are channels-last `[pixels, channels]` buffers (one image).

pub mod attention;
pub mod conv;
pub mod norm;
pub mod resnet;

use std::collections::BTreeMap;

use tessera_backend::{Activation, Backend, Role, View, ViewMut};
use tessera_core::Result;

pub use attention::MidAttention;
pub use conv::Conv;
pub use norm::{VaeGroupNorm, VaeNorm, VaeRmsNorm};
pub use resnet::Resnet;
pub use tessera_core::pixels::to_rgb8;

/// A VAE pass's activations, each of the same number of elements (the family's largest stage).
/// `x` is the residual stream; `s` takes an output (a shortcut's, an upsampler's, the head's)
/// before it is swapped into `x`; `k` takes the input image and keeps a block's input for its
/// shortcut. `c` (norm outputs) and `h` (a resnet's first convolution) are only read by
/// convolutions, products and the next norm, so they are in the compute type, which halves
/// their traffic under bf16.
pub struct VaeBufs<B: Backend> {
    pub x: B::Buf,
    pub s: B::Buf,
    pub k: B::Buf,
    pub c: B::Buf,
    pub h: B::Buf,
}

impl<B: Backend> VaeBufs<B> {
    /// Three f32-stream and two compute buffers of `elems` elements each, not zero-filled: every
    /// block writes a buffer before it reads it ([`Backend::alloc_scratch`]; the CPU tests fill
    /// them with NaN to show it).
    pub fn alloc(be: &B, elems: usize) -> Result<Self> {
        let (stream, compute) = (
            || be.alloc_scratch(elems, Role::Stream),
            || be.alloc_scratch(elems, Role::Compute),
        );
        Ok(VaeBufs {
            x: stream()?,
            s: stream()?,
            k: stream()?,
            c: compute()?,
            h: compute()?,
        })
    }

    /// The decoded image the head left in `s` (`px` pixels of `ch` channels), as floats.
    pub fn image(&self, be: &B, px: usize, ch: usize) -> Result<Vec<f32>> {
        be.read_f32(View::new(&self.s, px, ch))
    }

    /// The same as the pipelines' 8-bit pixels ([`to_rgb8`]), converted and checked for
    /// non-finite values where the image is ([`Backend::read_rgb8`]: on the GPU, a quarter of the
    /// bytes comes back).
    pub fn image_rgb8(&self, be: &B, px: usize, ch: usize) -> Result<Vec<u8>> {
        be.read_rgb8(View::new(&self.s, px, ch), "VAE decoder output")
    }

    /// `s = conv(SiLU(norm(x)))` of `ch` channels in: a VAE's `norm_out` → SiLU → `conv_out`.
    pub fn head<N: VaeNorm<B>>(
        &mut self,
        be: &B,
        norm: &N,
        conv: &Conv<B>,
        hw: (usize, usize),
        ch: usize,
    ) -> Result<()> {
        let px = hw.0 * hw.1;
        norm.norm(
            be,
            View::new(&self.x, px, ch),
            Some(Activation::Silu),
            ViewMut::new(&mut self.c, px, ch),
        )?;
        conv.run(be, View::new(&self.c, px, ch), hw, false, None, &mut self.s)
    }
}

/// Intermediate images recorded for parity tests, channels-last `[pixels, channels]` by name
/// (each family's `decode`/`encode` lists its names).
#[derive(Default, Debug)]
pub struct VaeTaps {
    pub values: BTreeMap<String, Vec<f32>>,
}

impl VaeTaps {
    /// Record `x` (read back as f32) as `name`.
    pub fn record<B: Backend>(&mut self, be: &B, name: &str, x: View<'_, B>) -> Result<()> {
        self.values.insert(name.to_string(), be.read_f32(x)?);
        Ok(())
    }
}
