//! The VAEs' residual block: `conv2(φ(conv1(φ(x)))) + shortcut(x)`, `φ = SiLU ∘ norm`, with
//! 3×3 same-padding convolutions and a 1×1 `conv_shortcut` where the channel count changes.

use tessera_backend::{Activation, Backend, View, ViewMut};
use tessera_core::Result;

use super::VaeBufs;
use super::conv::Conv;
use super::norm::VaeNorm;
use crate::loader::Loader;

const SILU: Option<Activation> = Some(Activation::Silu);

/// A resnet (diffusers' `ResnetBlock2D`, Wan's `ResidualBlock`) over the norm `N`.
pub struct Resnet<B: Backend, N> {
    pub cin: usize,
    pub cout: usize,
    norm1: N,
    conv1: Conv<B>,
    norm2: N,
    conv2: Conv<B>,
    shortcut: Option<Conv<B>>,
}

impl<B: Backend, N: VaeNorm<B>> Resnet<B, N> {
    /// `norm1`, `conv1`, `norm2`, `conv2` and, when `cin ≠ cout`, `conv_shortcut`; the family's
    /// `norm` loads a norm by name and width.
    pub fn load(
        l: &Loader<'_, B>,
        cin: usize,
        cout: usize,
        norm: impl Fn(&Loader<'_, B>, &str, usize) -> Result<N>,
    ) -> Result<Self> {
        Ok(Resnet {
            cin,
            cout,
            norm1: norm(l, "norm1", cin)?,
            conv1: Conv::load(l, "conv1", cin, cout, 3)?,
            norm2: norm(l, "norm2", cout)?,
            conv2: Conv::load(l, "conv2", cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(Conv::load(l, "conv_shortcut", cin, cout, 1)?)
            } else {
                None
            },
        })
    }

    /// `x ← shortcut(x) + conv2(φ(conv1(φ(x))))` with the stream staying in `b.x`: the residual
    /// add fused into conv2, the stream read and written once more instead of conv2's output
    /// being stored, read back and added. A channel-changing resnet's shortcut is written to
    /// `b.s` (with `b.h`, spent by then, as the stream's bf16 copy) and swapped into `b.x`.
    pub fn forward(&self, be: &B, b: &mut VaeBufs<B>, hw: (usize, usize)) -> Result<()> {
        let px = hw.0 * hw.1;
        self.first_conv(be, &b.x, (&mut b.c, &mut b.h), hw)?;
        self.second_norm(be, (&mut b.c, &b.h), hw)?;
        if let Some(sc) = &self.shortcut {
            sc.run_from_stream(
                be,
                View::new(&b.x, px, self.cin),
                hw,
                false,
                &mut b.h,
                &mut b.s,
            )?;
            std::mem::swap(&mut b.x, &mut b.s);
        }
        self.conv2
            .add_to(be, View::new(&b.c, px, self.cout), hw, None, &mut b.x)
    }

    /// `b.x = shortcut(b.k) + conv2(φ(conv1(φ(b.k))))`, leaving `b.k` as it was (an up or down
    /// block's first resnet, whose input feeds the block's shortcut too): the shortcut (or a
    /// copy of the input) is written to `b.x` first and conv2 adds itself to it. The sum is
    /// `skip + conv2(…)`, the unfused add's bits (f32 addition commutes).
    pub fn forward_kept(&self, be: &B, b: &mut VaeBufs<B>, hw: (usize, usize)) -> Result<()> {
        let px = hw.0 * hw.1;
        self.first_conv(be, &b.k, (&mut b.c, &mut b.h), hw)?;
        let input = View::new(&b.k, px, self.cin);
        match &self.shortcut {
            // conv1 has read `c`: it takes the stream's bf16 copy now.
            Some(sc) => sc.run_from_stream(be, input, hw, false, &mut b.c, &mut b.x)?,
            None => be.cast(input, ViewMut::new(&mut b.x, px, self.cout))?,
        }
        self.second_norm(be, (&mut b.c, &b.h), hw)?;
        self.conv2
            .add_to(be, View::new(&b.c, px, self.cout), hw, None, &mut b.x)
    }

    /// `h = conv1(φ(x))` (`c` holds φ's output).
    fn first_conv(
        &self,
        be: &B,
        x: &B::Buf,
        (c, h): (&mut B::Buf, &mut B::Buf),
        hw: (usize, usize),
    ) -> Result<()> {
        let px = hw.0 * hw.1;
        self.norm1.norm(
            be,
            View::new(x, px, self.cin),
            SILU,
            ViewMut::new(c, px, self.cin),
        )?;
        self.conv1
            .run(be, View::new(c, px, self.cin), hw, false, None, h)
    }

    /// `c = φ(h)`, conv2's input.
    fn second_norm(
        &self,
        be: &B,
        (c, h): (&mut B::Buf, &B::Buf),
        hw: (usize, usize),
    ) -> Result<()> {
        let px = hw.0 * hw.1;
        self.norm2.norm(
            be,
            View::new(h, px, self.cout),
            SILU,
            ViewMut::new(c, px, self.cout),
        )
    }
}
