//! What a front end asks of a text-to-image model and what it gets back, the same for every
//! family (Z-Image, Qwen-Image-2.1): the request, the model's defaults, the checked request's
//! summary, progress events and the 8-bit image.

/// The most images one request makes.
pub const MAX_IMAGES: usize = 16;

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
