//! The VAEs' convolution: an `nn.Conv2d`'s weight reordered for the backend's
//! channels-last `conv2d` (see [`tessera_backend::op::Conv2d`]).

use tessera_backend::{Activation, Backend, Conv2d, Precision, View, ViewMut};
use tessera_core::Result;

use crate::loader::Loader;

/// An `nn.Conv2d` (the VAEs') with its weight reordered to the backend's `[out, k·k·in]` layout.
pub struct Conv<B: Backend> {
    pub w: B::Mat,
    pub b: B::Vector,
    pub kernel: usize,
    pub cout: usize,
}

impl<B: Backend> Conv<B> {
    /// `{name}.weight` `[cout, cin, k, k]` and `{name}.bias` `[cout]` of an `nn.Conv2d`.
    pub fn load(
        l: &Loader<'_, B>,
        name: &str,
        cin: usize,
        cout: usize,
        kernel: usize,
    ) -> Result<Self> {
        // [out, in, ky, kx] → [out, ky, kx, in], in the stored dtype.
        let mut t = l
            .tensor(&format!("{name}.weight"), &[cout, cin, kernel, kernel])?
            .permuted(&[0, 2, 3, 1])?;
        t.shape = vec![cout, kernel * kernel * cin];
        Ok(Conv {
            w: l.backend().matrix_unquantized(&[t])?,
            b: l.vector(&format!("{name}.bias"), cout)?,
            kernel,
            cout,
        })
    }

    /// `out = conv(act(x))` for an `hw` image (upsampled 2× first when `upsample`).
    pub fn run(
        &self,
        be: &B,
        x: View<'_, B>,
        hw: (usize, usize),
        upsample: bool,
        act: Option<Activation>,
        out: &mut B::Buf,
    ) -> Result<()> {
        self.apply(be, x, &self.spec(hw, upsample, act), out)
    }

    /// `out += conv(act(x))` (its bias included), over an `hw` image: a resnet's second
    /// convolution and its residual add in one op, the sum stored once.
    pub fn add_to(
        &self,
        be: &B,
        x: View<'_, B>,
        hw: (usize, usize),
        act: Option<Activation>,
        out: &mut B::Buf,
    ) -> Result<()> {
        let spec = self.spec(hw, false, act).added_to_output();
        self.apply(be, x, &spec, out)
    }

    /// This convolution over an `hw` image, upsampled 2× first when `upsample`, of `act(x)`.
    fn spec(&self, hw: (usize, usize), upsample: bool, act: Option<Activation>) -> Conv2d {
        let mut spec = Conv2d::same(hw.0, hw.1, self.kernel);
        if upsample {
            spec = spec.upsampled();
        }
        if let Some(a) = act {
            spec = spec.of_activated(a);
        }
        spec
    }

    fn apply(&self, be: &B, x: View<'_, B>, spec: &Conv2d, out: &mut B::Buf) -> Result<()> {
        let (oh, ow) = spec.out_size();
        be.conv2d(
            x,
            &self.w,
            &self.b,
            spec,
            ViewMut::new(out, oh * ow, self.cout),
        )
    }

    /// `out = conv(x)` of an image held in the f32 stream (the residual stream the upsamplers and
    /// shortcuts read). Under bf16 it is first rounded into `scratch` (a compute buffer of at
    /// least its size): the values every bf16 product takes anyway, now in the bf16 image the
    /// implicit-GEMM convolutions gather (on CUDA they take bf16 images only; run g10 found the
    /// upsamplers on f32 im2col columns, 9 ms of a Z-Image decode).
    pub fn run_from_stream(
        &self,
        be: &B,
        x: View<'_, B>,
        hw: (usize, usize),
        upsample: bool,
        scratch: &mut B::Buf,
        out: &mut B::Buf,
    ) -> Result<()> {
        if be.precision() != Precision::Bf16 {
            return self.run(be, x, hw, upsample, None, out);
        }
        let (rows, cols) = (x.rows, x.cols);
        be.cast(x, ViewMut::new(scratch, rows, cols))?;
        self.run(be, View::new(scratch, rows, cols), hw, upsample, None, out)
    }

    /// `out = conv(x)` at stride 2 over the `hw` image padded by one zero row and column at the
    /// bottom and right (the VAE encoders' downsampler), `hw/2` out.
    pub fn downsample(
        &self,
        be: &B,
        x: View<'_, B>,
        hw: (usize, usize),
        out: &mut B::Buf,
    ) -> Result<()> {
        let spec = Conv2d::same(hw.0, hw.1, self.kernel).downsampled();
        self.apply(be, x, &spec, out)
    }
}
