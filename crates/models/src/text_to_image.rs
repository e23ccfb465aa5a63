//! What a front end asks of a text-to-image model and what it gets back, the same for every
//! family (Z-Image, Qwen-Image-2.1): the request, the model's defaults, the checked request's
//! summary, progress events, the 8-bit image, and the cheap latent previews a server streams.

use std::sync::Arc;

use tessera_core::{Error, Result};

use crate::imageproc::pil::Rgba8;

/// The most images one request makes.
pub const MAX_IMAGES: usize = 16;

/// The most condition images one edit takes (Qwen-Image-2.1's limit).
pub const MAX_EDIT_IMAGES: usize = 10;

/// The condition images of an edit request, for families that edit (Qwen-Image-2.1).
#[derive(Clone, Debug)]
pub struct Edit {
    /// Decoded images in prompt order (RGBA; an RGB upload is opaque), shared, not copied, when
    /// a request is cloned.
    pub images: Arc<[Rgba8]>,
    /// Condition images are resized to about this side squared (the reference's
    /// `output_resolution`), keeping their aspect; the output size defaults from it too.
    pub output_resolution: usize,
}

/// A family's recommended settings, which front ends show and start from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Defaults {
    pub steps: usize,
    /// The guidance scale that means "no guidance" or the recommended one.
    pub guidance: f32,
    /// `(width, height)` in pixels.
    pub size: (usize, usize),
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: String,
    /// What to steer away from; how it counts (and whether an absent one turns guidance off) is
    /// the family's rule.
    pub negative_prompt: Option<String>,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    /// The guidance scale, in the family's convention.
    pub guidance: f32,
    pub seed: u64,
    /// A starting latent in the layout the reference pipeline's `latents=` argument takes
    /// (without the batch axis) instead of the seeded one.
    pub init_latent: Option<Vec<f32>>,
    /// Override the scheduler's `shift` (families with a static shift only).
    pub shift: Option<f64>,
    /// Images to make from the prompt, seeds `seed, seed + 1, …`, denoised as one batch.
    pub num_images: usize,
    /// Condition images: an edit instead of text-to-image.
    pub edit: Option<Edit>,
}

impl Request {
    /// A request for `prompt` with a family's defaults, seed 0 and one image.
    pub fn new(prompt: impl Into<String>, defaults: Defaults) -> Self {
        Request {
            prompt: prompt.into(),
            negative_prompt: None,
            width: defaults.size.0,
            height: defaults.size.1,
            steps: defaults.steps,
            guidance: defaults.guidance,
            seed: 0,
            init_latent: None,
            shift: None,
            num_images: 1,
            edit: None,
        }
    }
}

/// A request that a model has checked: what it will run.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// Denoiser forwards per image (steps × 2 under classifier-free guidance).
    pub passes: usize,
    pub steps: usize,
    /// Whether classifier-free guidance runs.
    pub guided: bool,
    /// Floating-point operations of the denoiser over the whole request, for time estimates.
    pub denoiser_flops: f64,
    /// Things the user should know (truncation, ignored options), one line each.
    pub warnings: Vec<String>,
}

/// An 8-bit image, rows top to bottom, `[height, width, channels]`: RGB (3 channels) or
/// straight, not premultiplied, RGBA (4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
    pub pixels: Vec<u8>,
}

impl Image {
    pub fn has_alpha(&self) -> bool {
        self.channels == 4
    }

    /// RGB over an opaque white background: RGBA composited (`c·a + 255·(1 − a)`, rounded),
    /// RGB as it is.
    pub fn over_white(&self) -> Image {
        if !self.has_alpha() {
            return self.clone();
        }
        let pixels = self
            .pixels
            .chunks_exact(4)
            .flat_map(|p| {
                let a = p[3] as u32;
                let mix = move |c: u8| ((c as u32 * a + 255 * (255 - a) + 127) / 255) as u8;
                [mix(p[0]), mix(p[1]), mix(p[2])]
            })
            .collect();
        Image {
            width: self.width,
            height: self.height,
            channels: 3,
            pixels,
        }
    }
}

/// Progress reports while a request runs.
pub enum Event<'a> {
    /// The prompts are encoded; the loop starts.
    Encoded,
    /// Step `index` of `steps` is done: the denoiser's output per item (each image's prompt,
    /// then its negative prompt under guidance) and each image's latent after the update.
    Step {
        index: usize,
        steps: usize,
        v: &'a [Vec<f32>],
        latents: &'a [Vec<f32>],
    },
    /// The VAE is about to run.
    Decoding,
    /// A stage of the work before the loop is done (families that report them: Qwen-Image-2.1),
    /// the device finished behind it, so that a front end can time each stage; stages run per
    /// prompt branch are reported once per branch.
    Stage(Stage),
}

/// The stages a request goes through before its denoising loop, in order, as
/// [`Event::Stage`] reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The request is checked and its host work done: tokenising, and for an edit resizing and
    /// patching the condition images.
    Plan,
    /// An edit's condition images through the VAE encoder.
    VaeEncode,
    /// An edit's condition images through the vision tower.
    Vision,
    /// The text encoder: one branch of an edit (its prompt with the images), every branch at
    /// once for text to image.
    TextEncoder,
    /// The denoiser's prefill of one branch's prefix (text rows and condition latents).
    Prefill,
}

impl Stage {
    /// The stage's name in reports (snake case).
    pub fn name(self) -> &'static str {
        match self {
            Stage::Plan => "plan",
            Stage::VaeEncode => "vae_encode",
            Stage::Vision => "vision",
            Stage::TextEncoder => "text_encoder",
            Stage::Prefill => "prefill",
        }
    }
}

/// How a family lays out its latent, as far as a preview needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatentLayout {
    /// `[channels, height / scale, width / scale]`: one latent pixel covers `scale × scale`
    /// image pixels (Z-Image: 8).
    ChannelsFirst { scale: usize },
}

/// A cheap latent → RGB(A) map for previews while a request denoises: each latent pixel's
/// channels through one affine map `y = M·z + b` into the decoder's output space, then the
/// decoder's 8-bit conversion `round(clamp(y·a + c, 0, 1)·255)`. The preview has one pixel per
/// latent pixel (1/8 of the image's side for Z-Image): it shows composition and colour, not
/// detail.
///
/// The map is fitted to the model's own decoder by least squares ([`fit_affine`]), so it is a
/// property of the checkpoint, not a table of constants.
#[derive(Clone, Debug, PartialEq)]
pub struct LatentPreview {
    /// Latent channels `C`.
    pub channels: usize,
    /// 3 (RGB) or 4 (RGBA).
    pub outputs: usize,
    /// `M`, `[outputs, channels]`.
    pub matrix: Vec<f32>,
    /// `b`, `[outputs]`.
    pub bias: Vec<f32>,
    pub layout: LatentLayout,
    /// `(a, c)` of the 8-bit conversion: `(0.5, 0.5)` for a decoder whose output is in [−1, 1].
    pub to_unit: (f32, f32),
    /// How much of the decoder's output variance the map explains on the data it was fitted
    /// to (R², the worst output channel): 1 is a perfect fit.
    pub r2: f64,
}

impl LatentPreview {
    /// The preview of `latent` (in the family's layout) of a `width × height` request.
    pub fn image(&self, latent: &[f32], width: usize, height: usize) -> Result<Image> {
        let LatentLayout::ChannelsFirst { scale } = self.layout;
        let (w, h) = (width / scale.max(1), height / scale.max(1));
        let (c, o) = (self.channels, self.outputs);
        if latent.len() != c * w * h || self.matrix.len() != o * c || self.bias.len() != o {
            return Err(Error::input(format!(
                "a preview of a {width}x{height} image needs a latent of {c}×{h}×{w} values, not {}",
                latent.len()
            )));
        }
        let (a, off) = self.to_unit;
        let hw = w * h;
        let mut pixels = vec![0u8; hw * o];
        for (p, px) in pixels.chunks_exact_mut(o).enumerate() {
            for (k, out) in px.iter_mut().enumerate() {
                let row = &self.matrix[k * c..(k + 1) * c];
                let y = row
                    .iter()
                    .enumerate()
                    .fold(self.bias[k], |acc, (ch, m)| acc + m * latent[ch * hw + p]);
                *out = ((y * a + off).clamp(0.0, 1.0) * 255.0).round() as u8;
            }
        }
        Ok(Image {
            width: w,
            height: h,
            channels: o,
            pixels,
        })
    }
}

/// Least-squares affine fit `y ≈ M·x + b` over `samples` pairs: `inputs` `[samples, n_in]`,
/// `targets` `[samples, n_out]`, both sample-major. Solved per output through the normal
/// equations in f64 (Gaussian elimination with partial pivoting on the `(n_in + 1)²` system).
/// Returns `M` `[n_out, n_in]`, `b` `[n_out]` and the worst output's R².
pub fn fit_affine(
    inputs: &[f32],
    targets: &[f32],
    n_in: usize,
    n_out: usize,
) -> Result<(Vec<f32>, Vec<f32>, f64)> {
    let samples = inputs.len() / n_in.max(1);
    let k = n_in + 1;
    if n_in == 0 || inputs.len() != samples * n_in || targets.len() != samples * n_out {
        return Err(Error::input(format!(
            "an affine fit needs inputs of [samples, {n_in}] and targets of [samples, {n_out}]; got {} and {} values",
            inputs.len(),
            targets.len()
        )));
    }
    if samples < 2 * k {
        return Err(Error::input(format!(
            "an affine fit of {k} unknowns needs at least {} samples, not {samples}",
            2 * k
        )));
    }
    // Normal equations: G = Xᵀ X and R = Xᵀ Y, X with a column of ones.
    let mut g = vec![0f64; k * k];
    let mut r = vec![0f64; k * n_out];
    let mut x = vec![1f64; k];
    for s in 0..samples {
        for (xi, v) in x.iter_mut().zip(&inputs[s * n_in..(s + 1) * n_in]) {
            *xi = *v as f64;
        }
        for i in 0..k {
            for j in 0..k {
                g[i * k + j] += x[i] * x[j];
            }
            for o in 0..n_out {
                r[i * n_out + o] += x[i] * targets[s * n_out + o] as f64;
            }
        }
    }
    let coef = solve(&mut g, &mut r, k, n_out)?;
    let mut matrix = vec![0f32; n_out * n_in];
    let mut bias = vec![0f32; n_out];
    for o in 0..n_out {
        for i in 0..n_in {
            matrix[o * n_in + i] = coef[i * n_out + o] as f32;
        }
        bias[o] = coef[n_in * n_out + o] as f32;
    }
    // R² per output on the fitted data.
    let mut worst = f64::INFINITY;
    for o in 0..n_out {
        let t = |s: usize| targets[s * n_out + o] as f64;
        let mean = (0..samples).map(t).sum::<f64>() / samples as f64;
        let (mut res, mut tot) = (0f64, 0f64);
        for s in 0..samples {
            let pred = (0..n_in).fold(coef[n_in * n_out + o], |acc, i| {
                acc + coef[i * n_out + o] * inputs[s * n_in + i] as f64
            });
            res += (t(s) - pred).powi(2);
            tot += (t(s) - mean).powi(2);
        }
        let r2 = if tot > 0.0 { 1.0 - res / tot } else { 1.0 };
        worst = worst.min(r2);
    }
    Ok((matrix, bias, worst))
}

/// Solve `G · C = R` for `C` (`G` `k × k`, `R` and `C` `k × m`) by Gaussian elimination with
/// partial pivoting; `G` and `R` are overwritten.
fn solve(g: &mut [f64], r: &mut [f64], k: usize, m: usize) -> Result<Vec<f64>> {
    let scale = g
        .iter()
        .fold(0f64, |a, v| a.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    for col in 0..k {
        let pivot = (col..k)
            .max_by(|&a, &b| g[a * k + col].abs().total_cmp(&g[b * k + col].abs()))
            .unwrap_or(col);
        if g[pivot * k + col].abs() <= scale * 1e-12 {
            return Err(Error::input(
                "the affine fit is singular: the inputs do not span their space",
            ));
        }
        if pivot != col {
            for j in 0..k {
                g.swap(col * k + j, pivot * k + j);
            }
            for j in 0..m {
                r.swap(col * m + j, pivot * m + j);
            }
        }
        for row in col + 1..k {
            let f = g[row * k + col] / g[col * k + col];
            if f == 0.0 {
                continue;
            }
            for j in col..k {
                g[row * k + j] -= f * g[col * k + j];
            }
            for j in 0..m {
                r[row * m + j] -= f * r[col * m + j];
            }
        }
    }
    let mut c = vec![0f64; k * m];
    for row in (0..k).rev() {
        for j in 0..m {
            let tail: f64 = (row + 1..k).map(|i| g[row * k + i] * c[i * m + j]).sum();
            c[row * m + j] = (r[row * m + j] - tail) / g[row * k + row];
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator for the tests (SplitMix64 → uniforms in [−1, 1)).
    fn uniforms(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn an_affine_map_is_recovered_from_its_samples() {
        let (n_in, n_out, samples) = (5, 3, 200);
        let m = uniforms(1, n_out * n_in);
        let b = uniforms(2, n_out);
        let x = uniforms(3, samples * n_in);
        let y: Vec<f32> = (0..samples)
            .flat_map(|s| {
                let (m, b, x) = (&m, &b, &x);
                (0..n_out).map(move |o| {
                    (0..n_in).fold(b[o], |a, i| a + m[o * n_in + i] * x[s * n_in + i])
                })
            })
            .collect();
        let (fm, fb, r2) = fit_affine(&x, &y, n_in, n_out).unwrap();
        let worst = fm
            .iter()
            .zip(&m)
            .chain(fb.iter().zip(&b))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "coefficients off by {worst}");
        assert!(r2 > 1.0 - 1e-9, "{r2}");
        // Noise on the targets: the fit explains less than all of it, still most.
        let noisy: Vec<f32> = y
            .iter()
            .zip(uniforms(4, y.len()))
            .map(|(v, e)| v + 0.05 * e)
            .collect();
        let (_, _, r2) = fit_affine(&x, &noisy, n_in, n_out).unwrap();
        assert!(r2 < 1.0 - 1e-6 && r2 > 0.9, "{r2}");
    }

    #[test]
    fn a_fit_without_enough_samples_or_of_constant_inputs_is_refused() {
        let e = fit_affine(&[0.0; 8], &[0.0; 4], 2, 1).unwrap_err();
        assert!(e.to_string().contains("at least 6 samples"), "{e}");
        let e = fit_affine(&[1.0; 40], &uniforms(5, 20), 2, 1).unwrap_err();
        assert!(e.to_string().contains("singular"), "{e}");
    }

    #[test]
    fn a_preview_maps_each_latent_pixel() {
        // Two channels, 2×1 latent pixels: y_r = z0, y_g = −z1, y_b = 0.5, through (0.5, 0.5).
        let p = LatentPreview {
            channels: 2,
            outputs: 3,
            matrix: vec![1.0, 0.0, 0.0, -1.0, 0.0, 0.0],
            bias: vec![0.0, 0.0, 0.5],
            layout: LatentLayout::ChannelsFirst { scale: 8 },
            to_unit: (0.5, 0.5),
            r2: 1.0,
        };
        // [C, h, w] = [2, 1, 2]: z0 = (1, −1), z1 = (0, 1).
        let img = p.image(&[1.0, -1.0, 0.0, 1.0], 16, 8).unwrap();
        assert_eq!((img.width, img.height, img.channels), (2, 1, 3));
        assert_eq!(img.pixels, [255, 128, 191, 0, 0, 191]);
        assert!(p.image(&[0.0; 3], 16, 8).is_err());
    }

    #[test]
    fn compositing_over_white_keeps_opaque_and_whitens_clear_pixels() {
        let img = Image {
            width: 3,
            height: 1,
            channels: 4,
            pixels: vec![10, 20, 30, 255, 10, 20, 30, 0, 0, 0, 0, 128],
        };
        let rgb = img.over_white();
        assert_eq!(rgb.channels, 3);
        assert_eq!(rgb.pixels, [10, 20, 30, 255, 255, 255, 127, 127, 127]);
    }
}
