//! The VAEs' ops over channels-last images: `conv2d`, `group_norm`, `dup_up` and `avg_down`.

use tessera_backend::cuda::ConvPath;
use tessera_backend::{Activation, AvgDown, Conv2d, DupUp, GroupNorm, Op, Precision, Role};

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, seed_of};

/// A "same" `kernel × kernel` convolution of a `height × width × cin` image into `cout`
/// channels, plus a bias.
#[derive(Clone, Debug)]
pub struct ConvCase {
    spec: Conv2d,
    cin: usize,
    cout: usize,
    /// The input buffer's role (the VAE reads the f32 stream in some convolutions).
    input: Role,
    /// A forced kernel path (CUDA, bf16); `None`: as the op chooses.
    path: Option<ConvPath>,
    /// Added to an output of this role holding values already (`Conv2d::accumulate`: the VAE
    /// resnets' residual add into the f32 stream); `None`: written to a compute-type output.
    added_to: Option<Role>,
}

pub fn conv2d(height: usize, width: usize, cin: usize, cout: usize, kernel: usize) -> ConvCase {
    ConvCase {
        spec: Conv2d::same(height, width, kernel),
        cin,
        cout,
        input: Role::Compute,
        path: None,
        added_to: None,
    }
}

impl ConvCase {
    /// Reading its input from a buffer of this role.
    pub fn from(self, input: Role) -> Self {
        ConvCase { input, ..self }
    }

    /// Of the image upsampled 2× by nearest neighbour first.
    pub fn upsampled(self) -> Self {
        ConvCase {
            spec: self.spec.upsampled(),
            ..self
        }
    }

    /// At stride 2 over the image padded at the bottom and right (the VAE encoders' down blocks).
    pub fn downsampled(self) -> Self {
        ConvCase {
            spec: self.spec.downsampled(),
            ..self
        }
    }

    /// Added to an output of `role` that holds values already (`out += conv + bias`).
    pub fn added_to(self, role: Role) -> Self {
        ConvCase {
            spec: self.spec.added_to_output(),
            added_to: Some(role),
            ..self
        }
    }

    /// Of `act(input)` (the Wan-style VAEs' `RMS_norm → SiLU → conv`).
    pub fn of(self, act: Activation) -> Self {
        ConvCase {
            spec: self.spec.of_activated(act),
            ..self
        }
    }

    /// This case as the op runs it, then (bf16 only) forced through im2col and, where the
    /// implicit GEMMs take it (a bf16 input, input channels a multiple of 8), through each
    /// (the wgmma ones where the GPU has them; the warp-specialized one for more than 64 output
    /// channels of an input without activation).
    pub fn on_every_path(self) -> Vec<ConvCase> {
        let with = |path| ConvCase {
            path: Some(path),
            ..self.clone()
        };
        let mut all = vec![self.clone(), with(ConvPath::Im2col)];
        if self.input == Role::Compute && self.cin.is_multiple_of(8) {
            all.push(with(ConvPath::Implicit));
            all.push(with(ConvPath::Wgmma));
            if ConvPath::ws_takes(&self.spec, self.cout) {
                all.push(with(ConvPath::Ws));
            }
        }
        all
    }

    /// The case without its forced path: what the inputs and the reference depend on.
    fn base_name(&self) -> String {
        let Conv2d {
            height,
            width,
            kernel,
            upsample,
            downsample,
            act,
            accumulate: _,
        } = self.spec;
        let up = if upsample {
            " upsampled 2×"
        } else if downsample {
            " at stride 2"
        } else {
            ""
        };
        let act = act.map_or(String::new(), |a| format!(" of {a:?}(x)"));
        let added = self
            .added_to
            .map_or(String::new(), |r| format!(", added to a {r:?} output"));
        format!(
            "conv2d {kernel}×{kernel} {}→{}{act} over a {height}×{width} image{up} from {:?}{added}",
            self.cin, self.cout, self.input
        )
    }
}

impl OpCase for ConvCase {
    fn name(&self) -> String {
        match self.path {
            Some(path) => format!("{} — {path:?} kernel", self.base_name()),
            None => self.base_name(),
        }
    }

    fn precisions(&self) -> &'static [Precision] {
        match self.path {
            Some(_) => &[Precision::Bf16],
            None => super::BOTH,
        }
    }

    /// Every path of one case draws the same inputs.
    fn seed(&self) -> u64 {
        seed_of(&self.base_name())
    }

    fn op(&self) -> Op {
        self.spec.op()
    }

    fn supported<B: Device>(&self, be: &B) -> tessera_backend::Result<()> {
        be.supports(&self.op())?;
        self.path.map_or(Ok(()), |p| be.conv_supported(p))
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let ConvCase {
            spec,
            cin,
            cout,
            input,
            path,
            added_to,
        } = *self;
        let (pixels, (oh, ow)) = (spec.height * spec.width, spec.out_size());
        let inner = spec.kernel * spec.kernel * cin;
        let x = Guarded::drawn(be, input, Layout::padded(pixels, cin, 8, 8), rng, 2.0)?;
        let w = rng.vec(cout * inner, 1.0 / (inner as f32).sqrt());
        let w = be.matrix_f32(&[(&w, cout)], inner)?;
        let bias = be.vector_f32(&rng.vec(cout, 0.5))?;
        let at = Layout::padded(oh * ow, cout, 8, 8);
        let mut out = match added_to {
            Some(role) => Guarded::drawn(be, role, at, rng, 2.0)?,
            None => Guarded::empty(be, Role::Compute, at)?,
        };
        be.convolve(x.view(), &w, &bias, &spec, out.view_mut(), path)?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `nn.GroupNorm` of `pixels × channels` in `groups`, then an optional activation.
#[derive(Clone, Debug)]
pub struct GroupNormCase {
    pixels: usize,
    channels: usize,
    spec: GroupNorm,
    /// The input buffer's role (the VAE's first norm of a block reads the f32 stream).
    input: Role,
    /// Rows padded and offset (aligned to four channels) or tightly packed from an odd offset.
    aligned: bool,
}

/// No activation after, eps 1e-6 (the VAE's).
pub fn group_norm(pixels: usize, channels: usize, groups: usize) -> GroupNormCase {
    GroupNormCase {
        pixels,
        channels,
        spec: GroupNorm {
            groups,
            eps: 1e-6,
            act: None,
        },
        input: Role::Compute,
        aligned: true,
    }
}

impl GroupNormCase {
    /// Reading its input from a buffer of this role.
    pub fn from(self, input: Role) -> Self {
        GroupNormCase { input, ..self }
    }

    /// Rows one value past a 4-channel boundary (the one-channel-a-thread kernel).
    pub fn unaligned(self) -> Self {
        GroupNormCase {
            aligned: false,
            ..self
        }
    }

    pub fn then(self, act: Activation) -> Self {
        GroupNormCase {
            spec: GroupNorm {
                act: Some(act),
                ..self.spec
            },
            ..self
        }
    }
}

impl OpCase for GroupNormCase {
    fn name(&self) -> String {
        let GroupNormCase {
            pixels,
            channels,
            input,
            aligned,
            ..
        } = *self;
        let act = self
            .spec
            .act
            .map_or(String::new(), |a| format!(" then {a:?}"));
        let from = if input == Role::Compute {
            String::new()
        } else {
            format!(" from {input:?}")
        };
        let rows = if aligned { "" } else { ", rows off by one" };
        format!(
            "group_norm {pixels}×{channels} in {} groups{act}{from}{rows}",
            self.spec.groups
        )
    }

    fn op(&self) -> Op {
        Op::GroupNorm { act: self.spec.act }
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let GroupNormCase {
            pixels,
            channels,
            input,
            aligned,
            ..
        } = *self;
        // Off-centre values, so the mean matters.
        let x = rng.around(pixels * channels, 1.0, 3.0);
        let at = if aligned {
            Layout::padded(pixels, channels, 8, 8)
        } else {
            Layout::padded(pixels, channels, 1, 1)
        };
        let x = Guarded::new(be, input, at, Some(&x))?;
        let weight = be.vector_f32(&rng.around(channels, 1.0, 0.3))?;
        let bias = be.vector_f32(&rng.vec(channels, 0.5))?;
        let mut out = Guarded::empty(be, Role::Compute, at)?;
        be.group_norm(x.view(), &weight, &bias, &self.spec, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `out += DupUp(x)`: a `height × width × cin` image into `2·height × 2·width × cout`, with
/// `frames` temporal slots of which the last is kept.
#[derive(Clone, Debug)]
pub struct DupUpCase {
    spec: DupUp,
    cin: usize,
    cout: usize,
    /// The input buffer's role (the decoder keeps its block input in the f32 stream).
    input: Role,
}

pub fn dup_up(height: usize, width: usize, cin: usize, cout: usize, frames: usize) -> DupUpCase {
    DupUpCase {
        spec: DupUp {
            height,
            width,
            frames,
        },
        cin,
        cout,
        input: Role::Stream,
    }
}

impl DupUpCase {
    /// Reading its input from a buffer of this role.
    pub fn from(self, input: Role) -> Self {
        DupUpCase { input, ..self }
    }
}

impl OpCase for DupUpCase {
    fn name(&self) -> String {
        let DupUp {
            height,
            width,
            frames,
        } = self.spec;
        format!(
            "dup_up {}→{} over a {height}×{width} image, {frames} frames, from {:?}",
            self.cin, self.cout, self.input
        )
    }

    fn op(&self) -> Op {
        Op::DupUp
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let DupUpCase {
            spec,
            cin,
            cout,
            input,
        } = *self;
        let (oh, ow) = spec.out_size();
        let x = Guarded::drawn(
            be,
            input,
            Layout::padded(spec.height * spec.width, cin, 8, 8),
            rng,
            2.0,
        )?;
        // Added into an f32 stream holding the upsampling convolution's output.
        let mut out = Guarded::drawn(
            be,
            Role::Stream,
            Layout::padded(oh * ow, cout, 8, 8),
            rng,
            1.0,
        )?;
        be.dup_up(x.view(), &spec, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `out += AvgDown(x)`: a `height × width × cin` image into `height/space × width/space × cout`,
/// the image the last of `frames` temporal slots (the others zero).
#[derive(Clone, Debug)]
pub struct AvgDownCase {
    spec: AvgDown,
    cin: usize,
    cout: usize,
}

pub fn avg_down(
    height: usize,
    width: usize,
    cin: usize,
    cout: usize,
    frames: usize,
    space: usize,
) -> AvgDownCase {
    AvgDownCase {
        spec: AvgDown {
            height,
            width,
            frames,
            space,
        },
        cin,
        cout,
    }
}

impl OpCase for AvgDownCase {
    fn name(&self) -> String {
        let AvgDown {
            height,
            width,
            frames,
            space,
        } = self.spec;
        format!(
            "avg_down {}→{} over a {height}×{width} image, {frames} frames, {space}× space",
            self.cin, self.cout
        )
    }

    fn op(&self) -> Op {
        Op::AvgDown
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let AvgDownCase { spec, cin, cout } = *self;
        let (oh, ow) = spec.out_size();
        // The encoder keeps its block input in the f32 stream and adds the shortcut into the
        // downsampling convolution's output there.
        let x = Guarded::drawn(
            be,
            Role::Stream,
            Layout::padded(spec.height * spec.width, cin, 8, 8),
            rng,
            2.0,
        )?;
        let mut out = Guarded::drawn(
            be,
            Role::Stream,
            Layout::padded(oh * ow, cout, 8, 8),
            rng,
            1.0,
        )?;
        be.avg_down(x.view(), &spec, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}
