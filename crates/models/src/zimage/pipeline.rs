//! The whole text-to-image pipeline (diffusers 0.42.1 `ZImagePipeline.__call__`): prompt →
//! caption features → `N` Euler steps of the DiT from a seeded (or given) latent, with CFG when
//! the guidance is positive → VAE decode → 8-bit RGB.
//!
//! Each component is in a `residency::Slot`: under [`Residency::Sequential`] (`--offload`)
//! it loads when its stage starts and is dropped when the stage ends (the text encoder's
//! output is kept in a buffer of its own for the transformer).

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use tessera_backend::{Backend, Precision, Role, View};
use tessera_core::{Error, Result, Weights, check_finite};

use super::ZImageFiles;
use super::config::{SchedulerConfig, TransformerConfig, VaeConfig, check_model_index};
use super::scheduler::{FlowMatchEuler, Schedule, euler_step, guide};
use super::text::{MAX_PROMPT_TOKENS, PromptIds, PromptTemplate, prompt_ids};
use super::transformer::ZImageTransformer;
use super::vae::VaeDecoder;
use crate::noise;
use crate::qwen3::{BpeTokenizer, Qwen3Config, Qwen3TextModel};
use crate::residency::{self, Residency, Slot};
use crate::text_to_image::{
    Checked, Defaults, Event, Image, LatentLayout, LatentPreview, MAX_IMAGES, Request, fit_affine,
};

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

/// Everything checking a request needs — the tokenizer, the prompt template, the configs and
/// the scheduler — and nothing of the device, so that requests can be checked on other threads
/// while the model runs others (a server checks each request as it arrives). Shared by the
/// model ([`ZImage::planner`]).
pub struct Planner {
    tokenizer: BpeTokenizer,
    /// How a prompt becomes the tokenizer's text: the folder's chat template.
    template: PromptTemplate,
    transformer: TransformerConfig,
    vae: VaeConfig,
    scheduler: FlowMatchEuler,
}

pub struct ZImage<B: Backend> {
    backend: B,
    planner: Arc<Planner>,
    residency: Residency,
    text_encoder: Slot<B, Qwen3TextModel<B>>,
    transformer: Slot<B, ZImageTransformer<B>>,
    vae: Slot<B, VaeDecoder<B>>,
    /// The latent preview map, fitted on first use ([`ZImage::preview`]).
    preview: Option<LatentPreview>,
}

/// Side of the seeded latent the preview map is fitted on: 32² latent pixels are 1,024 samples
/// for the 17 unknowns of each colour (16 channels and a bias), one 256² decode.
const PREVIEW_FIT_SIDE: usize = 32;
/// Seed of that latent.
const PREVIEW_FIT_SEED: u64 = 0x5EED_0FF1;

/// The text encoder's tensors, under `model.` in the published files or at the top level when
/// saved from a bare `Qwen3Model`.
fn text_encoder_root(w: &Weights) -> Weights {
    if w.contains("model.embed_tokens.weight") {
        w.pp("model")
    } else {
        w.clone()
    }
}

impl Planner {
    /// Image sides must be multiples of this (the VAE's 8× times the DiT's 2× patches).
    pub fn size_multiple(&self) -> usize {
        2 * self.vae.scale()
    }

    /// Check a request and tokenise its prompts, all but the device's memory (which
    /// [`ZImage::plan`] adds); nothing heavy runs.
    pub fn plan(&self, req: &Request) -> Result<Plan> {
        if req.edit.is_some() {
            return Err(Error::input(
                "Z-Image makes images from text only; it cannot edit condition images (Qwen-Image-2.1 can)",
            ));
        }
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
        let scale = self.vae.scale();
        let latent_hw = (h / scale, w / scale);
        let cfg = &self.transformer;
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
        let cfg = &self.transformer;
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
}

impl<B: Backend> ZImage<B> {
    /// Load every component. `transformer_file` replaces the transformer's weights with a single
    /// safetensors or GGUF file (diffusers or ComfyUI names; GGUF's block formats and FP8
    /// matrices stay quantized); its shapes must match `transformer/config.json`.
    pub fn load(backend: B, files: &ZImageFiles, transformer_file: Option<&Path>) -> Result<Self> {
        Self::load_as(backend, files, transformer_file, Residency::Resident)
    }

    /// [`load`](Self::load), keeping the components on the device as `residency` says. Every
    /// check runs here either way (configs, vocabulary, template, the weight files opened);
    /// [`Residency::Sequential`] loads each component's weights from its mapped files only when
    /// its stage runs.
    pub fn load_as(
        backend: B,
        files: &ZImageFiles,
        transformer_file: Option<&Path>,
        residency: Residency,
    ) -> Result<Self> {
        let be = &backend;
        let cfg = ZImageConfigs::read(files)?;
        let tokenizer = BpeTokenizer::load(&files.tokenizer)?;
        tokenizer.check_fits(cfg.text_encoder.vocab_size)?;
        let template = PromptTemplate::load(&files.tokenizer)?;
        // hidden_states[-2]: the residual stream after all layers but the last.
        let te_weights = text_encoder_root(&files.text_encoder.weights("model")?);
        let te = cfg.text_encoder.clone();
        let text_encoder = Slot::new(be, residency, "text encoder", te_weights, move |be, w| {
            Qwen3TextModel::load(be, &te, w, te.num_layers - 1)
        })?;
        let tr_weights = match transformer_file {
            Some(p) => Weights::open_any(p)?,
            None => files.transformer.weights("diffusion_pytorch_model")?,
        };
        let tr = cfg.transformer.clone();
        let transformer = Slot::new(be, residency, "transformer", tr_weights, move |be, w| {
            ZImageTransformer::load(be, &tr, w)
        })?;
        let vae = cfg.vae.clone();
        let vae = Slot::new(
            be,
            residency,
            "VAE decoder",
            files.vae.weights("diffusion_pytorch_model")?,
            move |be, w| VaeDecoder::load(be, &vae, w),
        )?;
        Ok(ZImage {
            backend,
            residency,
            planner: Arc::new(Planner {
                tokenizer,
                template,
                transformer: cfg.transformer,
                vae: cfg.vae,
                scheduler: FlowMatchEuler::new(cfg.scheduler),
            }),
            text_encoder,
            transformer,
            vae,
            preview: None,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The transformer, while it is on the device (always, when resident).
    pub fn transformer(&self) -> Result<&ZImageTransformer<B>> {
        self.transformer.resident()
    }
    /// The VAE decoder, while it is on the device (always, when resident).
    pub fn vae(&self) -> Result<&VaeDecoder<B>> {
        self.vae.resident()
    }
    pub fn residency(&self) -> Residency {
        self.residency
    }
    /// The transformer's config (loaded or not).
    pub fn transformer_config(&self) -> &TransformerConfig {
        &self.planner.transformer
    }

    /// The components on the device now, by name: all of them when resident; none between
    /// requests when sequential.
    pub fn resident_components(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.text_encoder.held().is_some() {
            names.push(self.text_encoder.name());
        }
        if self.transformer.held().is_some() {
            names.push(self.transformer.name());
        }
        if self.vae.held().is_some() {
            names.push(self.vae.name());
        }
        names
    }

    /// Drop every component that is loaded for its stage only (all of them, when sequential).
    fn release_all(&mut self) -> Result<()> {
        let be = &self.backend;
        self.text_encoder.release(be)?;
        self.transformer.release(be)?;
        self.vae.release(be)
    }
    pub fn scheduler(&self) -> &FlowMatchEuler {
        &self.planner.scheduler
    }
    pub fn tokenizer(&self) -> &BpeTokenizer {
        &self.planner.tokenizer
    }
    pub fn template(&self) -> &PromptTemplate {
        &self.planner.template
    }

    /// What checks requests, shareable with other threads.
    pub fn planner(&self) -> Arc<Planner> {
        self.planner.clone()
    }

    /// Image sides must be multiples of this (the VAE's 8× times the DiT's 2× patches).
    pub fn size_multiple(&self) -> usize {
        self.planner.size_multiple()
    }

    /// Check a request and tokenise its prompts; nothing heavy runs. Besides
    /// [`Planner::plan`]'s checks, refuses a request whose buffers would not fit in the
    /// device memory left.
    pub fn plan(&self, req: &Request) -> Result<Plan> {
        let plan = self.planner.plan(req)?;
        self.check_memory(req, &plan.prompts, plan.schedule.steps())?;
        Ok(plan)
    }

    /// What a checked request will run, for front ends.
    pub fn summary(&self, req: &Request, plan: &Plan) -> Checked {
        self.planner.summary(req, plan)
    }
    /// Device memory a request takes beyond the weights that stay loaded, in bytes: the largest
    /// of its stages — the denoising loop's buffers (every item of the batch), one image's
    /// decoding — each with its component's weights when they load for it
    /// ([`Residency::Sequential`]; known from their last load, none before the first), plus
    /// the fixed workspaces and the text encoder's passes. The decoder runs after the loop's
    /// buffers are freed, and the backend's pool hands their memory on.
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
        let scale = self.planner.vae.scale();
        let latent_hw = (h / scale, w / scale);
        let items: Vec<usize> = (0..n).flat_map(|_| caps.iter().copied()).collect();
        self.stages_bytes(latent_hw, &items, steps, compute)
    }

    /// [`request_bytes`](Self::request_bytes) of a batch's `items` (caption lengths).
    fn stages_bytes(
        &self,
        latent_hw: (usize, usize),
        items: &[usize],
        steps: usize,
        compute: usize,
    ) -> Result<usize> {
        let p = &self.planner;
        let denoise = p
            .transformer
            .activation_bytes(latent_hw, items, steps, compute)?;
        let decode = p.vae.decode_bytes(latent_hw, compute);
        let encoding = self.text_encoder.bytes_to_load();
        let denoising = self.transformer.bytes_to_load() + denoise;
        let decoding = self.vae.bytes_to_load() + decode;
        Ok(encoding.max(denoising).max(decoding) + FIXED_DEVICE_BYTES)
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
            None => self.residency.no_size_fits().to_string(),
        };
        let beyond = self.residency.need_phrase();
        Err(Error::input(format!(
            "--size {w}x{h}{images} needs about {:.1} GB of device memory {beyond}, and {:.1} GB are free: {hint}{}",
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
        let be = &self.backend;
        self.text_encoder.with(be, |te| {
            let hidden = te.forward(be, &seqs)?;
            let mut out = Vec::with_capacity(seqs.len());
            let mut off = 0;
            for s in &seqs {
                out.push(be.read_f32(hidden.rows(off, s.len()))?);
                off += s.len();
            }
            Ok(out)
        })
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
        mut on: impl FnMut(Event<'_>),
    ) -> Result<Vec<Image>> {
        let mut progress = |_: usize, e: Event<'_>| {
            on(e);
            ControlFlow::Continue(())
        };
        let mut results = self.run(&[(req, plan)], &mut progress);
        let result = results
            .pop()
            .unwrap_or_else(|| Err(Error::input("no image was made")));
        result.map_err(|e| out_of_memory_hint(e, &[req]))
    }

    /// Run several requests, each step of all of them one batch through the transformer:
    /// every image of every request (and its negative prompt under guidance) is an item of the
    /// same forward. Requests must share the size and the σ schedule (steps, shift) to share
    /// forwards; the others run after, one at a time, as does everything when the batch would
    /// not fit the device's memory. Each request gets its own result, and each image is the
    /// one the request makes alone: items do not interact in a forward (bit for bit where the
    /// backend's products do not depend on how many rows they have — the CPU backend made
    /// batch-invariant; a GPU picks its product kernels by shape, so there the last bits may
    /// differ, as with `num_images`).
    ///
    /// `on(i, event)` reports request `i`'s progress; `Break` stops request `i` at the next
    /// step boundary (its result is [`Error::Cancelled`]) while the others go on.
    pub fn generate_batch(
        &mut self,
        reqs: &[Request],
        on: &mut dyn FnMut(usize, Event<'_>) -> ControlFlow<()>,
    ) -> Vec<Result<Vec<Image>>> {
        let mut results: Vec<Option<Result<Vec<Image>>>> = (0..reqs.len()).map(|_| None).collect();
        let mut plans = Vec::with_capacity(reqs.len());
        for (i, req) in reqs.iter().enumerate() {
            match self.plan(req) {
                Ok(p) => plans.push((i, p)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        // The first request that planned leads; the requests of its size and schedule join it
        // while the whole batch fits the device's memory. The others run alone, after.
        let mut group: Vec<usize> = Vec::new();
        let mut alone: Vec<usize> = Vec::new();
        for k in 0..plans.len() {
            let joins = group.first().is_none_or(|&g| {
                let (lead, plan) = (&plans[g].1, &plans[k].1);
                lead.latent_hw == plan.latent_hw && lead.schedule == plan.schedule
            });
            let fits = joins && {
                let members: Vec<(&Request, &Plan)> = group
                    .iter()
                    .chain(std::iter::once(&k))
                    .map(|&m| (&reqs[plans[m].0], &plans[m].1))
                    .collect();
                group.is_empty() || self.batch_fits(&members)
            };
            if fits {
                group.push(k);
            } else {
                alone.push(k);
            }
        }
        let runs: Vec<Vec<usize>> = std::iter::once(group)
            .filter(|g| !g.is_empty())
            .chain(alone.into_iter().map(|k| vec![k]))
            .collect();
        for members in runs {
            let batch: Vec<(&Request, &Plan)> = members
                .iter()
                .map(|&k| (&reqs[plans[k].0], &plans[k].1))
                .collect();
            let index: Vec<usize> = members.iter().map(|&k| plans[k].0).collect();
            let mut progress = |j: usize, e: Event<'_>| on(index[j], e);
            let out = self.run(&batch, &mut progress);
            for (j, r) in out.into_iter().enumerate() {
                let req = batch[j].0;
                results[index[j]] = Some(r.map_err(|e| out_of_memory_hint(e, &[req])));
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::input("the request was not run"))))
            .collect()
    }

    /// Whether the denoising of every request of `batch` together fits the device's memory.
    fn batch_fits(&self, batch: &[(&Request, &Plan)]) -> bool {
        let Ok(Some(available)) = self.backend.memory_available() else {
            return true;
        };
        let compute = match self.backend.precision() {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        };
        let Some(&(_, lead)) = batch.first() else {
            return true;
        };
        let items: Vec<usize> = batch
            .iter()
            .flat_map(|(req, plan)| {
                (0..req.num_images).flat_map(|_| plan.prompts.iter().map(|p| p.ids.len()))
            })
            .collect();
        self.stages_bytes(lead.latent_hw, &items, lead.schedule.steps(), compute)
            .is_ok_and(|need| need <= available)
    }

    /// The preview map of this model's latents ([`LatentPreview`]): fitted on first use by least
    /// squares to the VAE's own decode of a seeded N(0, 1) latent of 32² pixels — the scale of
    /// the sampler's latents from start to end (the VAE's scaling factor normalises clean
    /// latents to unit variance) — each latent pixel's channels against the mean colour of the
    /// 8×8 pixels it decodes to. One 256² decode, once.
    pub fn preview(&mut self) -> Result<LatentPreview> {
        if let Some(p) = &self.preview {
            return Ok(p.clone());
        }
        let cfg = &self.planner.vae;
        let (c, outs, scale) = (cfg.latent_channels, cfg.out_channels, cfg.scale());
        let side = PREVIEW_FIT_SIDE;
        let z = noise::gaussian(PREVIEW_FIT_SEED, c * side * side);
        let be = &self.backend;
        let image = self.vae.get(be)?.decode(be, &z, (side, side), None);
        self.vae.release(be)?;
        let image = image?;
        check_finite("VAE decoder output (fitting the preview map)", &image)?;
        let width = side * scale;
        let samples = side * side;
        let mut inputs = vec![0f32; samples * c];
        let mut targets = vec![0f32; samples * outs];
        let per = (scale * scale) as f32;
        for p in 0..samples {
            for ch in 0..c {
                inputs[p * c + ch] = z[ch * samples + p];
            }
            let (ly, lx) = (p / side, p % side);
            for dy in 0..scale {
                for dx in 0..scale {
                    let px = (ly * scale + dy) * width + lx * scale + dx;
                    for o in 0..outs {
                        targets[p * outs + o] += image[px * outs + o] / per;
                    }
                }
            }
        }
        let (matrix, bias, r2) = fit_affine(&inputs, &targets, c, outs)?;
        let preview = LatentPreview {
            channels: c,
            outputs: outs,
            matrix,
            bias,
            layout: LatentLayout::ChannelsFirst { scale },
            to_unit: (0.5, 0.5),
            r2,
        };
        self.preview = Some(preview.clone());
        Ok(preview)
    }

    /// The denoising loop and the decode of `batch` (requests of one size and schedule; see
    /// [`ZImage::generate_batch`]). A failure of one request (non-finite numbers) or its
    /// cancellation drops it from the batch; a device failure fails them all.
    fn run(
        &mut self,
        batch: &[(&Request, &Plan)],
        on: &mut dyn FnMut(usize, Event<'_>) -> ControlFlow<()>,
    ) -> Vec<Result<Vec<Image>>> {
        let mut results: Vec<Option<Result<Vec<Image>>>> = (0..batch.len()).map(|_| None).collect();
        // A stage that failed leaves its component loaded: release them whatever happened, so
        // the next run starts bare.
        let ran = self.denoise_and_decode(batch, on, &mut results);
        let released = self.release_all();
        if let Err(e) = ran.and(released) {
            for r in results.iter_mut().filter(|r| r.is_none()) {
                *r = Some(Err(share(&e)));
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::input("the request was not run"))))
            .collect()
    }

    /// [`ZImage::run`]'s work: requests that end early (failed, cancelled) and those that
    /// finish get their entry of `results`; an error returned is the whole batch's.
    fn denoise_and_decode(
        &mut self,
        batch: &[(&Request, &Plan)],
        on: &mut dyn FnMut(usize, Event<'_>) -> ControlFlow<()>,
        results: &mut [Option<Result<Vec<Image>>>],
    ) -> Result<()> {
        let Some(&(_, lead)) = batch.first() else {
            return Ok(());
        };
        let be = &self.backend;
        let (latent_hw, schedule) = (lead.latent_hw, &lead.schedule);
        let steps = schedule.steps();
        // Every request's prompts (its prompt, then its negative prompt under CFG) in one pass.
        let seqs: Vec<&[u32]> = batch
            .iter()
            .flat_map(|(_, plan)| plan.prompts.iter().map(|p| p.ids.as_slice()))
            .collect();
        let encoded = self.text_encoder.get(be)?.forward(be, &seqs)?;
        // Loaded for this stage only, the text encoder goes before the transformer comes: its
        // output (its workspace's) is kept in a buffer of its own, the same f32 values.
        let kept;
        let hidden = match self.residency {
            Residency::Resident => encoded,
            Residency::Sequential => {
                let (rows, cols) = (encoded.rows, encoded.cols);
                let values = be.read_f32(encoded)?;
                let mut buf = be.alloc(values.len(), Role::Stream)?;
                be.write_f32(&mut buf, &values)?;
                kept = buf;
                self.text_encoder.release(be)?;
                View::new(&kept, rows, cols)
            }
        };
        let mut caps: Vec<Vec<View<'_, B>>> = Vec::with_capacity(batch.len());
        let mut off = 0;
        for (r, (_, plan)) in batch.iter().enumerate() {
            let start = off;
            let views: Vec<View<'_, B>> = plan
                .prompts
                .iter()
                .map(|p| {
                    let v = hidden.rows(off, p.ids.len());
                    off += p.ids.len();
                    v
                })
                .collect();
            let features = be.read_f32(hidden.rows(start, off - start))?;
            match check_finite("text encoder features", &features) {
                Ok(()) => caps.push(views),
                Err(e) => {
                    results[r] = Some(Err(e));
                    caps.push(Vec::new());
                }
            }
        }
        let (lh, lw) = latent_hw;
        let len = self.planner.transformer.in_channels * lh * lw;
        // Each request's latents, one per image.
        let mut latents: Vec<Vec<Vec<f32>>> = batch
            .iter()
            .map(|(req, _)| match &req.init_latent {
                Some(l) => vec![l.clone()],
                None => (0..req.num_images as u64)
                    .map(|i| noise::gaussian(req.seed.wrapping_add(i), len))
                    .collect(),
            })
            .collect();
        let counts: Vec<usize> = batch.iter().map(|(req, _)| req.num_images).collect();
        let mut live: Vec<usize> = (0..batch.len()).filter(|&r| results[r].is_none()).collect();
        live.retain(|&r| {
            let go = on(r, Event::Encoded).is_continue();
            if !go {
                results[r] = Some(Err(Error::Cancelled("before the first step".into())));
            }
            go
        });
        if live.is_empty() {
            return Ok(());
        }
        let transformer = self.transformer.get(be)?;
        let mut prep = transformer.prepare(
            be,
            &items_of(&live, &caps, &counts),
            latent_hw,
            &schedule.t_model,
            None,
        )?;
        for step in 0..steps {
            let of_items: Vec<&[f32]> = live
                .iter()
                .flat_map(|&r| {
                    let per = caps[r].len();
                    latents[r]
                        .iter()
                        .flat_map(move |l| std::iter::repeat_n(l.as_slice(), per))
                })
                .collect();
            let v = transformer.forward(be, &mut prep, &of_items, step, None)?;
            let at = format!("denoising step {} of {steps}", step + 1);
            let mut first = 0;
            let mut ended = false;
            for &r in &live {
                let (req, per) = (batch[r].0, caps[r].len());
                let n = req.num_images;
                let own = &v[first..first + n * per];
                first += n * per;
                let stepped = latents[r]
                    .iter_mut()
                    .enumerate()
                    .try_for_each(|(i, latent)| {
                        let mut pred = own[i * per].clone();
                        if guided(req) {
                            guide(&mut pred, &own[i * per + 1], req.guidance);
                        }
                        check_finite(&format!("{at}: transformer velocity"), &pred)?;
                        euler_step(latent, &pred, schedule, step);
                        check_finite(&format!("{at}: latent"), latent)
                    });
                if let Err(e) = stepped {
                    results[r] = Some(Err(e));
                    ended = true;
                    continue;
                }
                let event = Event::Step {
                    index: step,
                    steps,
                    v: own,
                    latents: &latents[r],
                };
                if on(r, event).is_break() {
                    results[r] = Some(Err(Error::Cancelled(format!(
                        "after denoising step {} of {steps}",
                        step + 1
                    ))));
                    ended = true;
                }
            }
            if ended {
                live.retain(|&r| results[r].is_none());
                if live.is_empty() {
                    return Ok(());
                }
                if step + 1 < steps {
                    // The remaining items, prepared again (the caption path is per item, so
                    // each keeps its values).
                    drop(prep);
                    prep = transformer.prepare(
                        be,
                        &items_of(&live, &caps, &counts),
                        latent_hw,
                        &schedule.t_model,
                        None,
                    )?;
                }
            }
        }
        // The loop's buffers go before the decoder's are made: the pool reuses their memory.
        drop(prep);
        drop(caps);
        self.transformer.release(be)?;
        let vae = self.vae.get(be)?;
        for &r in &live {
            if on(r, Event::Decoding).is_break() {
                results[r] = Some(Err(Error::Cancelled("before decoding".into())));
                continue;
            }
            let req = batch[r].0;
            let decoded: Result<Vec<Image>> = latents[r]
                .iter()
                .map(|latent| {
                    Ok(Image {
                        channels: 3,
                        width: req.width,
                        height: req.height,
                        pixels: vae.decode_rgb8(be, latent, latent_hw)?,
                    })
                })
                .collect();
            results[r] = Some(decoded);
        }
        Ok(())
    }
}

/// The transformer's items of the requests `live`: for each of its `counts[r]` images, its
/// prompt's caption features, then (CFG) its negative prompt's.
fn items_of<'v, B: Backend>(
    live: &[usize],
    caps: &[Vec<View<'v, B>>],
    counts: &[usize],
) -> Vec<View<'v, B>> {
    live.iter()
        .flat_map(|&r| (0..counts[r]).flat_map(move |_| caps[r].iter().copied()))
        .collect()
}

/// The out-of-memory error of a request, with what to change.
fn out_of_memory_hint(e: Error, reqs: &[&Request]) -> Error {
    match (e, reqs.first()) {
        // The plan's estimate let it start; something else took the memory meanwhile.
        (Error::OutOfMemory(m), Some(req)) if !m.contains(residency::LOADING) => {
            Error::OutOfMemory(format!(
                "{m} while making {} image(s) of {}x{}: try a smaller --size or fewer --num-images",
                req.num_images, req.width, req.height
            ))
        }
        (e, _) => e,
    }
}

/// The same error again, for each request of a batch that one failure stopped (errors are not
/// `Clone`: their sources need not be).
fn share(e: &Error) -> Error {
    match e {
        Error::Input(m) => Error::Input(m.clone()),
        Error::OutOfMemory(m) => Error::OutOfMemory(m.clone()),
        Error::Cancelled(m) => Error::Cancelled(m.clone()),
        Error::Device(m) => Error::Device(m.clone()),
        Error::NonFinite {
            stage,
            count,
            len,
            first,
        } => Error::NonFinite {
            stage: stage.clone(),
            count: *count,
            len: *len,
            first: *first,
        },
        Error::Backend { op, message } => Error::Backend {
            op: op.clone(),
            message: message.clone(),
        },
        other => Error::backend("image generation", other),
    }
}
