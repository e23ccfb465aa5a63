//! The whole text-to-image pipeline (diffusers 0.42.1 `ZImagePipeline.__call__`): prompt →
//! caption features → `N` Euler steps of the DiT from a seeded (or given) latent, with CFG when
//! the guidance is positive → VAE decode → 8-bit RGB.

use std::path::Path;

use tessera_backend::{Backend, Precision, View};
use tessera_core::{Error, Result, Weights, check_finite};

use super::ZImageFiles;
use super::config::{SchedulerConfig, TransformerConfig, VaeConfig, check_model_index};
use super::scheduler::{FlowMatchEuler, Schedule, euler_step, guide};
use super::text::{MAX_PROMPT_TOKENS, PromptIds, PromptTemplate, prompt_ids};
use super::transformer::ZImageTransformer;
use super::vae::{VaeDecoder, to_rgb8};
use crate::noise;
use crate::qwen3::{BpeTokenizer, Qwen3Config, Qwen3TextModel};
use crate::text_to_image::{Checked, Defaults, Event, Image, MAX_IMAGES, Request};

/// Z-Image-Turbo's defaults (spec §1). The base model wants about 50 steps and guidance 4.
pub const DEFAULTS: Defaults = Defaults {
    steps: 8,
    guidance: 0.0,
    size: (1024, 1024),
};
/// The largest guidance scale accepted. Useful scales are single digits; far beyond this the
/// guided velocity is noise amplified (and near `f32::MAX` it overflows to infinity).
pub const MAX_GUIDANCE: f32 = 100.0;

/// Refuse a guidance scale that is not a number from 0 to [`MAX_GUIDANCE`].
pub fn check_guidance(g: f32) -> Result<()> {
    if g.is_finite() && (0.0..=MAX_GUIDANCE).contains(&g) {
        return Ok(());
    }
    Err(Error::input(format!(
        "--guidance {g}: use 0 (no CFG, Turbo) or a positive scale up to {MAX_GUIDANCE} (about 4 for the base model)"
    )))
}

/// Device memory a request needs besides its own buffers: the backend's fixed workspaces
/// (product, im2col columns, split-key attention: 448 MiB) and the text encoder's passes.
const FIXED_DEVICE_BYTES: usize = 640 << 20;

/// Whether classifier-free guidance runs: when the guidance is positive (diffusers' rule for
/// Z-Image; the negative prompt defaults to `""`).
pub fn guided(req: &Request) -> bool {
    req.guidance > 0.0
}

/// A checked request: everything that can be refused is refused here, before any compute.
#[derive(Clone, Debug)]
pub struct Plan {
    pub latent_hw: (usize, usize),
    pub schedule: Schedule,
    /// The prompt's ids, then the negative prompt's when CFG runs.
    pub prompts: Vec<PromptIds>,
    /// Things the user should know (truncation, ignored options), one line each.
    pub warnings: Vec<String>,
}

/// The configs of a Z-Image folder's components, read and checked against each other before
/// any weight loads (so a device can also be chosen for them first).
#[derive(Clone, Debug)]
pub struct ZImageConfigs {
    pub text_encoder: Qwen3Config,
    pub transformer: TransformerConfig,
    pub vae: VaeConfig,
    pub scheduler: SchedulerConfig,
}

impl ZImageConfigs {
    pub fn read(files: &ZImageFiles) -> Result<Self> {
        check_model_index(
            &files.root.path("model_index.json"),
            &files.root.read("model_index.json")?,
        )?;
        let te_path = files.text_encoder.path("config.json");
        let te = Qwen3Config::parse(&te_path, &files.text_encoder.read("config.json")?)?;
        if te.num_layers == 0 {
            return Err(Error::config(
                te_path,
                "num_hidden_layers",
                "must be at least 1",
            ));
        }
        let tr_path = files.transformer.path("config.json");
        let tr = TransformerConfig::parse(&tr_path, &files.transformer.read("config.json")?)?;
        if tr.cap_feat_dim != te.hidden_size {
            return Err(Error::config(
                tr_path,
                "cap_feat_dim",
                format!(
                    "{} does not match the text encoder's hidden_size {}",
                    tr.cap_feat_dim, te.hidden_size
                ),
            ));
        }
        let vae_path = files.vae.path("config.json");
        let vae = VaeConfig::parse(&vae_path, &files.vae.read("config.json")?)?;
        if vae.latent_channels != tr.in_channels {
            return Err(Error::config(
                vae_path,
                "latent_channels",
                format!(
                    "{} does not match the transformer's in_channels {}",
                    vae.latent_channels, tr.in_channels
                ),
            ));
        }
        let sched_path = files.scheduler.path("scheduler_config.json");
        let scheduler =
            SchedulerConfig::parse(&sched_path, &files.scheduler.read("scheduler_config.json")?)?;
        Ok(ZImageConfigs {
            text_encoder: te,
            transformer: tr,
            vae,
            scheduler,
        })
    }
}

pub struct ZImage<B: Backend> {
    backend: B,
    tokenizer: BpeTokenizer,
    /// How a prompt becomes the tokenizer's text: the folder's chat template.
    template: PromptTemplate,
    text_encoder: Qwen3TextModel<B>,
    transformer: ZImageTransformer<B>,
    vae: VaeDecoder<B>,
    scheduler: FlowMatchEuler,
}

/// The text encoder's tensors, under `model.` in the published files or at the top level when
/// saved from a bare `Qwen3Model`.
fn text_encoder_root(w: &Weights) -> Weights {
    if w.contains("model.embed_tokens.weight") {
        w.pp("model")
    } else {
        w.clone()
    }
}

impl<B: Backend> ZImage<B> {
    /// Load every component. `transformer_file` replaces the transformer's weights with a single
    /// safetensors file (diffusers or ComfyUI names); its shapes must match
    /// `transformer/config.json`.
    pub fn load(backend: B, files: &ZImageFiles, transformer_file: Option<&Path>) -> Result<Self> {
        let be = &backend;
        let cfg = ZImageConfigs::read(files)?;
        let tokenizer = BpeTokenizer::load(&files.tokenizer)?;
        if tokenizer.vocab_size() > cfg.text_encoder.vocab_size {
            return Err(Error::config(
                files.tokenizer.path("tokenizer.json"),
                "vocab",
                format!(
                    "{} tokens, more than the text encoder's vocab_size {}",
                    tokenizer.vocab_size(),
                    cfg.text_encoder.vocab_size
                ),
            ));
        }
        let template = PromptTemplate::load(&files.tokenizer)?;
        // hidden_states[-2]: the residual stream after all layers but the last.
        let te_weights = text_encoder_root(&files.text_encoder.weights("model")?);
        let te = &cfg.text_encoder;
        let text_encoder = Qwen3TextModel::load(be, te, &te_weights, te.num_layers - 1)?;
        let tr_weights = match transformer_file {
            Some(p) => Weights::open_file(p)?,
            None => files.transformer.weights("diffusion_pytorch_model")?,
        };
        let transformer = ZImageTransformer::load(be, &cfg.transformer, &tr_weights)?;
        let vae = VaeDecoder::load(be, &cfg.vae, &files.vae.weights("diffusion_pytorch_model")?)?;
        Ok(ZImage {
            backend,
            tokenizer,
            template,
            text_encoder,
            transformer,
            vae,
            scheduler: FlowMatchEuler::new(cfg.scheduler),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
    pub fn transformer(&self) -> &ZImageTransformer<B> {
        &self.transformer
    }
    pub fn vae(&self) -> &VaeDecoder<B> {
        &self.vae
    }
    pub fn scheduler(&self) -> &FlowMatchEuler {
        &self.scheduler
    }
    pub fn tokenizer(&self) -> &BpeTokenizer {
        &self.tokenizer
    }
    pub fn template(&self) -> &PromptTemplate {
        &self.template
    }

    /// Image sides must be multiples of this (the VAE's 8× times the DiT's 2× patches).
    pub fn size_multiple(&self) -> usize {
        2 * self.vae.config().scale()
    }

    /// Check a request and tokenise its prompts; nothing heavy runs.
    pub fn plan(&self, req: &Request) -> Result<Plan> {
        let m = self.size_multiple();
        let (w, h) = (req.width, req.height);
        if w == 0 || h == 0 || w % m != 0 || h % m != 0 {
            let near = |v: usize| ((v + m / 2) / m).max(1) * m;
            return Err(Error::input(format!(
                "--size {w}x{h}: width and height must be positive multiples of {m}; the nearest valid size is {}x{}",
                near(w),
                near(h)
            )));
        }
        check_guidance(req.guidance)?;
        let scale = self.vae.config().scale();
        let latent_hw = (h / scale, w / scale);
        let cfg = self.transformer.config();
        let [_, rows, cols] = cfg.axes_lens;
        let (max_h, max_w) = (rows * m, cols * m);
        if h > max_h || w > max_w {
            return Err(Error::input(format!(
                "--size {w}x{h} is larger than the model's {max_w}x{max_h} position tables"
            )));
        }
        let mut scheduler = self.scheduler.clone();
        if let Some(shift) = req.shift {
            if !(shift.is_finite() && shift > 0.0) {
                return Err(Error::input(format!(
                    "shift {shift} must be a positive number"
                )));
            }
            scheduler.config.shift = shift;
        }
        let schedule = scheduler.schedule(req.steps)?;
        if !(1..=MAX_IMAGES).contains(&req.num_images) {
            return Err(Error::input(format!(
                "--num-images {}: make 1 to {MAX_IMAGES} images per request",
                req.num_images
            )));
        }
        if req.init_latent.is_some() && req.num_images > 1 {
            return Err(Error::input(
                "an initial latent starts one image: --init-latent needs --num-images 1",
            ));
        }
        if let Some(l) = &req.init_latent {
            let want = cfg.in_channels * latent_hw.0 * latent_hw.1;
            if l.len() != want {
                return Err(Error::input(format!(
                    "the initial latent has {} values; a {w}x{h} image needs {}×{}×{} = {want}",
                    l.len(),
                    cfg.in_channels,
                    latent_hw.0,
                    latent_hw.1
                )));
            }
        }
        let mut warnings = Vec::new();
        let ids = |prompt: &str| prompt_ids(&self.tokenizer, &self.template, prompt);
        let mut prompts = vec![ids(&req.prompt)?];
        if guided(req) {
            prompts.push(ids(req.negative_prompt.as_deref().unwrap_or(""))?);
        } else if req.negative_prompt.is_some() {
            warnings.push(
                "the negative prompt is ignored without guidance (--guidance > 0 turns CFG on)"
                    .into(),
            );
        }
        self.check_memory(req, &prompts, schedule.steps())?;
        for (p, what) in prompts.iter().zip(["prompt", "negative prompt"]) {
            if p.truncated() {
                warnings.push(format!(
                    "the {what} is {} tokens with its chat template; only the first {MAX_PROMPT_TOKENS} are used, as in the reference",
                    p.full_len
                ));
            }
        }
        Ok(Plan {
            latent_hw,
            schedule,
            prompts,
            warnings,
        })
    }

    /// What a checked request will run, for front ends.
    pub fn summary(&self, req: &Request, plan: &Plan) -> Checked {
        let guided = guided(req);
        let steps = plan.schedule.steps();
        let passes = steps * if guided { 2 } else { 1 };
        // Matmuls: 24·dim² per token and layer (the FFN is 8/3·dim wide); attention 4·tokens·dim.
        let cfg = self.transformer.config();
        let (lh, lw) = plan.latent_hw;
        let tokens = (lh * lw / 4) as f64;
        let (dim, layers) = (cfg.dim as f64, (cfg.n_layers + cfg.n_refiner_layers) as f64);
        let per_pass = layers * tokens * (24.0 * dim * dim + 4.0 * tokens * dim);
        Checked {
            passes,
            steps,
            guided,
            denoiser_flops: per_pass * (passes * req.num_images) as f64,
            warnings: plan.warnings.clone(),
        }
    }

    /// Device memory a request takes beyond the weights, in bytes: the larger of the denoising
    /// loop's buffers (every item of the batch) and one image's decoding, plus the fixed
    /// workspaces and the text encoder's passes. The decoder runs after the loop's buffers are
    /// freed, and the backend's pool hands their memory on.
    fn request_bytes(
        &self,
        (w, h): (usize, usize),
        n: usize,
        caps: &[usize],
        steps: usize,
    ) -> Result<usize> {
        let compute = match self.backend.precision() {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        };
        let scale = self.vae.config().scale();
        let latent_hw = (h / scale, w / scale);
        let items: Vec<usize> = (0..n).flat_map(|_| caps.iter().copied()).collect();
        let denoise = self
            .transformer
            .activation_bytes(latent_hw, &items, steps, compute)?;
        let decode = self.vae.activation_bytes(latent_hw, compute);
        Ok(denoise.max(decode) + FIXED_DEVICE_BYTES)
    }

    /// Refuse, before any compute, a request whose buffers would not fit in the device memory
    /// left after loading, naming the largest size of the same shape that fits.
    fn check_memory(&self, req: &Request, prompts: &[PromptIds], steps: usize) -> Result<()> {
        let Some(available) = self.backend.memory_available()? else {
            return Ok(());
        };
        let caps: Vec<usize> = prompts.iter().map(|p| p.ids.len()).collect();
        let n = req.num_images;
        let fits = |w: usize, h: usize| -> Result<bool> {
            Ok(self.request_bytes((w, h), n, &caps, steps)? <= available)
        };
        let (w, h) = (req.width, req.height);
        let need = self.request_bytes((w, h), n, &caps, steps)?;
        if need <= available {
            return Ok(());
        }
        let m = self.size_multiple();
        let mut largest = None;
        for side in (1..=w / m).rev() {
            let w2 = side * m;
            let h2 = ((h * w2) as f64 / (w * m) as f64).round().max(1.0) as usize * m;
            if fits(w2, h2)? {
                largest = Some((w2, h2));
                break;
            }
        }
        let images = if n > 1 {
            format!(" × {n} images")
        } else {
            String::new()
        };
        let gb = |b: usize| b as f64 / 1e9;
        let hint = match largest {
            Some((w2, h2)) => format!("the largest size of this shape that fits is {w2}x{h2}"),
            None => "no size fits; free device memory or use --device cpu".to_string(),
        };
        Err(Error::input(format!(
            "--size {w}x{h}{images} needs about {:.1} GB of device memory beyond the model's weights, and {:.1} GB are free: {hint}{}",
            gb(need),
            gb(available),
            if n > 1 {
                " (or fewer --num-images)"
            } else {
                ""
            }
        )))
    }

    /// Caption features of each prompt's ids (`[L, hidden]` each, `hidden_states[-2]`).
    pub fn caption_features(&mut self, prompts: &[PromptIds]) -> Result<Vec<Vec<f32>>> {
        let seqs: Vec<&[u32]> = prompts.iter().map(|p| p.ids.as_slice()).collect();
        let hidden = self.text_encoder.forward(&self.backend, &seqs)?;
        let mut out = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for s in &seqs {
            out.push(self.backend.read_f32(hidden.rows(off, s.len()))?);
            off += s.len();
        }
        Ok(out)
    }

    /// Run a planned request of one image.
    pub fn generate(
        &mut self,
        req: &Request,
        plan: &Plan,
        on: impl FnMut(Event<'_>),
    ) -> Result<Image> {
        if req.num_images != 1 {
            return Err(Error::input(format!(
                "generate makes one image; {} were asked for (use generate_images)",
                req.num_images
            )));
        }
        let mut images = self.generate_images(req, plan, on)?;
        images
            .pop()
            .ok_or_else(|| Error::input("no image was made"))
    }

    /// Run a planned request: `req.num_images` images, seeds `seed, seed + 1, …`, each step one
    /// batch through the transformer (with CFG, each image's conditional and unconditional
    /// passes are items of the same batch).
    pub fn generate_images(
        &mut self,
        req: &Request,
        plan: &Plan,
        on: impl FnMut(Event<'_>),
    ) -> Result<Vec<Image>> {
        self.run(req, plan, on).map_err(|e| match e {
            // The plan's estimate let it start; something else took the memory meanwhile.
            Error::OutOfMemory(m) => Error::OutOfMemory(format!(
                "{m} while making {} image(s) of {}x{}: try a smaller --size or fewer --num-images",
                req.num_images, req.width, req.height
            )),
            e => e,
        })
    }

    fn run(
        &mut self,
        req: &Request,
        plan: &Plan,
        mut on: impl FnMut(Event<'_>),
    ) -> Result<Vec<Image>> {
        let be = &self.backend;
        let seqs: Vec<&[u32]> = plan.prompts.iter().map(|p| p.ids.as_slice()).collect();
        let hidden = self.text_encoder.forward(be, &seqs)?;
        let mut caps: Vec<View<'_, B>> = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for s in &seqs {
            caps.push(hidden.rows(off, s.len()));
            off += s.len();
        }
        check_finite("text encoder features", &be.read_f32(hidden.rows(0, off))?)?;
        // Items: each image's prompt, then (CFG) its negative prompt.
        let per = caps.len();
        let n = req.num_images;
        let items: Vec<View<'_, B>> = (0..n).flat_map(|_| caps.iter().copied()).collect();
        let schedule = &plan.schedule;
        let mut prep =
            self.transformer
                .prepare(be, &items, plan.latent_hw, &schedule.t_model, None)?;
        on(Event::Encoded);
        let (lh, lw) = plan.latent_hw;
        let len = self.transformer.config().in_channels * lh * lw;
        let mut latents: Vec<Vec<f32>> = match &req.init_latent {
            Some(l) => vec![l.clone()],
            None => (0..n as u64)
                .map(|i| noise::gaussian(req.seed.wrapping_add(i), len))
                .collect(),
        };
        for step in 0..schedule.steps() {
            let of_items: Vec<&[f32]> = (0..n * per).map(|i| latents[i / per].as_slice()).collect();
            let v = self
                .transformer
                .forward(be, &mut prep, &of_items, step, None)?;
            let at = format!("denoising step {} of {}", step + 1, schedule.steps());
            for (i, latent) in latents.iter_mut().enumerate() {
                let mut pred = v[i * per].clone();
                if guided(req) {
                    guide(&mut pred, &v[i * per + 1], req.guidance);
                }
                check_finite(&format!("{at}: transformer velocity"), &pred)?;
                euler_step(latent, &pred, schedule, step);
                check_finite(&format!("{at}: latent"), latent)?;
            }
            on(Event::Step {
                index: step,
                steps: schedule.steps(),
                v: &v,
                latents: &latents,
            });
        }
        // The loop's buffers go before the decoder's are made: the pool reuses their memory.
        drop(prep);
        on(Event::Decoding);
        latents
            .iter()
            .map(|latent| {
                let image = self.vae.decode(be, latent, plan.latent_hw, None)?;
                check_finite("VAE decoder output", &image)?;
                Ok(Image {
                    channels: 3,
                    width: req.width,
                    height: req.height,
                    pixels: to_rgb8(&image),
                })
            })
            .collect()
    }
}
