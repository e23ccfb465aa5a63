//! Ops on images: pooling of packed patch grids (vision towers) and the VAEs' convolution,
//! GroupNorm, channel-to-space upsampling shortcut and space-to-channel downsampling shortcut
//! over channels-last images.

use tessera_core::{Error, Result};

use crate::{Activation, Backend};

/// Images packed back to back, each a row-major grid of patches (patch `(x, y)` of image `i` is
/// row `first_i + y·width_i + x`), for per-image pooling.
pub struct Grids<B: Backend> {
    /// Host copy: `(width, height)` of each image in patches.
    pub dims: Vec<(usize, usize)>,
    /// Side of the square pooling window; every width and height is a multiple of it.
    pub kernel: usize,
    /// Device copy: four `u32` per image: first patch row, width, height, first pooled row.
    pub dev: B::Buf,
}

impl<B: Backend> Grids<B> {
    /// `(first patch row, width, height, first pooled row)` of each image.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let k2 = self.kernel * self.kernel;
        self.dims.iter().scan((0, 0), move |(p, o), &(w, h)| {
            let item = (*p, w, h, *o);
            *p += w * h;
            *o += w * h / k2;
            Some(item)
        })
    }
    /// Patch rows in all images.
    pub fn patches(&self) -> usize {
        self.dims.iter().map(|&(w, h)| w * h).sum()
    }
    /// Pooled rows in all images.
    pub fn pooled(&self) -> usize {
        self.patches() / (self.kernel * self.kernel)
    }

    /// Every backend's shape check for `avg_pool2d`: `x` `[patches, cols]` into `out`
    /// `[pooled, cols]`, every grid side a multiple of the kernel.
    pub fn check(&self, x: (usize, usize), out: (usize, usize)) -> Result<()> {
        let k = self.kernel;
        if k == 0
            || x.0 != self.patches()
            || out.0 != self.pooled()
            || out.1 != x.1
            || self
                .dims
                .iter()
                .any(|&(w, h)| !w.is_multiple_of(k) || !h.is_multiple_of(k))
        {
            return Err(Error::backend(
                "avg_pool2d",
                format!(
                    "{}×{} patches into {}×{} for grids {:?} pooled {k}×{k}",
                    x.0, x.1, out.0, out.1, self.dims
                ),
            ));
        }
        Ok(())
    }
}

/// A "same" 2-D convolution (stride 1, zero padding `kernel / 2`) over one channels-last image
/// stored as a `[height · width, channels]` view (row `y · width + x`), or its 2×
/// downsampling form (see `downsample`).
///
/// The weight is a matrix `[out_channels, kernel · kernel · in_channels]` whose columns run over
/// `(ky, kx, c_in)` with `c_in` fastest — PyTorch's `[out, in, kh, kw]` weight transposed to
/// `[out, kh, kw, in]` at load — so that the convolution is an implicit GEMM over the input's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2d {
    /// Input image size in pixels.
    pub height: usize,
    pub width: usize,
    /// Square kernel side: 1 or an odd number.
    pub kernel: usize,
    /// Upsample the input 2× by nearest neighbour first (fused: the upsampled image is never
    /// stored), so the output is `2·height × 2·width`. This is `Upsample2D`'s interpolate + conv.
    pub upsample: bool,
    /// Stride 2 over the input zero-padded by one pixel at the bottom and the right only (no
    /// padding before): output pixel `(y, x)` reads input pixels `(2y + ky, 2x + kx)`. This is
    /// the Wan-style VAE encoders' `ZeroPad2d((0, 1, 0, 1))` + stride-2 3×3 convolution
    /// (`Resample` in `downsample2d` mode). Only with a 3×3 kernel, even sides and no
    /// upsampling; the output is `height/2 × width/2`.
    pub downsample: bool,
    /// An activation applied to every input value as the convolution reads it (fused: the
    /// activated image is never stored); the zero padding stays zero. This is the pre-activation
    /// of VAEs whose norms have no activation of their own (`RMS_norm → SiLU → conv` in Wan-style
    /// decoders). `None`: the input as it is.
    pub act: Option<Activation>,
    /// Add the convolution to what `out` holds, `out += conv(act(x)) + bias`: a VAE resnet's
    /// residual add fused into its second convolution, so the sum is stored once instead of the
    /// convolution's output being stored, read back and added. The sum is `out + (conv + bias)`,
    /// the unfused residual's rounding.
    pub accumulate: bool,
}

impl Conv2d {
    /// A plain "same" `kernel × kernel` convolution of a `height × width` image.
    pub fn same(height: usize, width: usize, kernel: usize) -> Self {
        Conv2d {
            height,
            width,
            kernel,
            upsample: false,
            downsample: false,
            act: None,
            accumulate: false,
        }
    }

    /// The stride-2 downsampling form of this convolution (see `downsample`).
    pub fn downsampled(self) -> Self {
        Conv2d {
            downsample: true,
            ..self
        }
    }

    /// The same convolution of the image upsampled 2× by nearest neighbour.
    pub fn upsampled(self) -> Self {
        Conv2d {
            upsample: true,
            ..self
        }
    }

    /// The same convolution of `act(x)`.
    pub fn of_activated(self, act: Activation) -> Self {
        Conv2d {
            act: Some(act),
            ..self
        }
    }

    /// The same convolution added to what `out` holds (see `accumulate`).
    pub fn added_to_output(self) -> Self {
        Conv2d {
            accumulate: true,
            ..self
        }
    }

    /// Output size in pixels.
    pub fn out_size(&self) -> (usize, usize) {
        if self.downsample {
            return (self.height / 2, self.width / 2);
        }
        let s = if self.upsample { 2 } else { 1 };
        (self.height * s, self.width * s)
    }

    /// Every backend's shape check for `conv2d`: `x` `[height · width, in]`, the weight
    /// `(out, k · k · in)`, a bias of `out`, `out` `[out_h · out_w, out]`, an odd kernel (3 and
    /// even sides, without upsampling, when downsampling).
    pub fn check(
        &self,
        x: (usize, usize),
        w: (usize, usize),
        bias: usize,
        out: (usize, usize),
    ) -> Result<()> {
        let (k, (oh, ow)) = (self.kernel, self.out_size());
        let bad_down = self.downsample
            && (k != 3
                || self.upsample
                || !self.height.is_multiple_of(2)
                || !self.width.is_multiple_of(2));
        if k % 2 == 0
            || bad_down
            || x.0 != self.height * self.width
            || out.0 != oh * ow
            || w != (out.1, k * k * x.1)
            || bias != out.1
        {
            return Err(Error::backend(
                "conv2d",
                format!(
                    "x {}×{} ({}×{} image), weight {}×{} (kernel {k}, odd), bias {bias}, out {}×{} \
                     ({oh}×{ow}){}",
                    x.0,
                    x.1,
                    self.height,
                    self.width,
                    w.0,
                    w.1,
                    out.0,
                    out.1,
                    if self.downsample {
                        "; downsampling takes a 3×3 kernel, even sides and no upsampling"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(())
    }
}

/// `nn.GroupNorm` over one channels-last image `[pixels, channels]`: statistics per group of
/// `channels / groups` consecutive channels over all pixels, then the affine weight and bias,
/// then an optional activation (the VAE's GroupNorm → SiLU pairs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNorm {
    pub groups: usize,
    pub eps: f32,
    pub act: Option<Activation>,
}

/// The 2× upsampling shortcut of Wan-2.2-style residual VAE decoders (diffusers' `DupUp3D` of
/// `autoencoder_kl_wan.py` / `autoencoder_kl_qwenimage21.py` on the first — for an image the
/// only — frame), added into `out`, over one channels-last image.
///
/// The reference repeats every input channel `r = 4 · frames · out_channels / in_channels` times,
/// reads the result as `[out_channels, frames, 2, 2]` (temporal slot, sub-pixel row, sub-pixel
/// column), moves the slots to time and the sub-pixels to space, and of the first chunk keeps
/// only the **last** temporal slot. For an `height × width` input `x` `[h·w, in]` into `out`
/// `[2h · 2w, out]`:
///
/// `out[(2y + sy)·2w + 2x + sx, o] += x[y·w + x, ((o·frames + frames − 1)·4 + 2·sy + sx) / r]`.
///
/// With `in == out` that is a nearest 2× upsampling; with fewer output channels each output
/// channel reads its own input channels (`2o + 1` for `frames = 2, in = 2·out`; `2o + sy` for
/// `frames = 1`). `4 · frames · out` must be a multiple of `in`, and `in ≤ 4 · frames · out`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DupUp {
    /// Input image size in pixels.
    pub height: usize,
    pub width: usize,
    /// The block's temporal factor: 2 where it also upsamples time, else 1.
    pub frames: usize,
}

impl DupUp {
    /// Output size in pixels.
    pub fn out_size(&self) -> (usize, usize) {
        (2 * self.height, 2 * self.width)
    }

    /// The repeat count `r` for `cin` input and `cout` output channels, if they fit.
    pub fn repeats(&self, cin: usize, cout: usize) -> Option<usize> {
        let slots = 4 * self.frames * cout;
        (self.frames > 0 && cin > 0 && slots >= cin && slots.is_multiple_of(cin))
            .then(|| slots / cin)
    }

    /// The input channel output channel `o` of sub-pixel `(sy, sx)` reads, `r` the repeat count.
    pub fn source(&self, r: usize, o: usize, sy: usize, sx: usize) -> usize {
        ((o * self.frames + self.frames - 1) * 4 + 2 * sy + sx) / r
    }

    /// Every backend's shape check for `dup_up`: `x` `[height · width, in]`, `out`
    /// `[2·height · 2·width, out]`, channel counts that fit (see [`repeats`](Self::repeats)).
    /// Returns the repeat count.
    pub fn check(&self, x: (usize, usize), out: (usize, usize)) -> Result<usize> {
        let (oh, ow) = self.out_size();
        match self.repeats(x.1, out.1) {
            Some(r) if x.0 == self.height * self.width && out.0 == oh * ow => Ok(r),
            _ => Err(Error::backend(
                "dup_up",
                format!(
                    "x {}×{} ({}×{} image) into out {}×{} ({oh}×{ow}) with {} frames: 4·frames·out \
                     must be a multiple of in and at least in",
                    x.0, x.1, self.height, self.width, out.0, out.1, self.frames
                ),
            )),
        }
    }
}

/// The 2× space-to-channel shortcut of Wan-2.2-style residual VAE down blocks (diffusers'
/// `AvgDown3D` of `autoencoder_kl_qwenimage21.py` on one frame), added into `out`, over one
/// channels-last image: the mirror of [`DupUp`].
///
/// The reference zero-pads time in front to `frames` slots (so for `frames = 2` the image is
/// the **last** slot and a zero frame the first), folds every `frames × space × space` block of
/// (slot, sub-pixel row, sub-pixel column) into channels — expanded channel
/// `e = c·f + (t·space + sy)·space + sx` with `f = frames · space²` — and averages each group of
/// `g = in · f / out` consecutive expanded channels. For an `height × width` input `x`
/// `[h·w, in]` into `out` `[h/space · w/space, out]`:
///
/// `out[y·(w/space) + x, o] += (1/g) · Σ_{e = o·g}^{o·g + g − 1} v(e)`, where `v(e)` is
/// `x[(space·y + sy)·w + space·x + sx, c]` when `e`'s slot `t` is `frames − 1` and 0 (the
/// padding frame) otherwise.
///
/// `in · frames · space²` must be a multiple of `out` (the reference refuses other widths), and
/// the sides multiples of `space`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgDown {
    /// Input image size in pixels.
    pub height: usize,
    pub width: usize,
    /// The block's temporal factor: 2 where it also downsamples time, else 1.
    pub frames: usize,
    /// The spatial factor: 2 where the block downsamples, 1 for the last block (a channel-group
    /// mean only).
    pub space: usize,
}

impl AvgDown {
    /// Output size in pixels.
    pub fn out_size(&self) -> (usize, usize) {
        let s = self.space.max(1);
        (self.height / s, self.width / s)
    }

    /// Expanded channels per input channel, `frames · space²`.
    pub fn factor(&self) -> usize {
        self.frames * self.space * self.space
    }

    /// The group size `g` for `cin` input and `cout` output channels, if they fit.
    pub fn group(&self, cin: usize, cout: usize) -> Option<usize> {
        let expanded = cin * self.factor();
        (self.frames > 0 && self.space > 0 && cout > 0 && cin > 0 && expanded.is_multiple_of(cout))
            .then(|| expanded / cout)
    }

    /// Where expanded channel `e` reads: `Some((input channel, sy, sx))`, or `None` for the zero
    /// frame.
    pub fn source(&self, e: usize) -> Option<(usize, usize, usize)> {
        let (f, s2) = (self.factor(), self.space * self.space);
        let (c, r) = (e / f, e % f);
        (r / s2 == self.frames - 1).then(|| (c, (r % s2) / self.space, r % self.space))
    }

    /// Every backend's shape check for `avg_down`: `x` `[height · width, in]`, `out`
    /// `[height/space · width/space, out]`, channel counts that fit (see
    /// [`group`](Self::group)), sides that are multiples of `space`. Returns the group size.
    pub fn check(&self, x: (usize, usize), out: (usize, usize)) -> Result<usize> {
        let (oh, ow) = self.out_size();
        let sides = self.space > 0
            && self.height.is_multiple_of(self.space)
            && self.width.is_multiple_of(self.space);
        match self.group(x.1, out.1) {
            Some(g) if sides && x.0 == self.height * self.width && out.0 == oh * ow => Ok(g),
            _ => Err(Error::backend(
                "avg_down",
                format!(
                    "x {}×{} ({}×{} image) into out {}×{} ({oh}×{ow}) with {} frames, space {}: \
                     in·frames·space² must be a multiple of out, the sides multiples of space",
                    x.0, x.1, self.height, self.width, out.0, out.1, self.frames, self.space
                ),
            )),
        }
    }
}
