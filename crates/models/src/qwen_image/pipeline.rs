//! The whole text-to-image pipeline (diffusers 0.42.1 `QwenImage21Pipeline.__call__`, spec A8):
//! prompt → Qwen3-VL features → the prefix of each prompt (and of the negative prompt under
//! true CFG) computed once → `N` Euler steps of the target rows from a seeded (or given) latent
//! → VAE decode → straight 8-bit RGBA.
//!
//! True CFG runs when the guidance is above 1 **and** a negative prompt is given (an empty one
//! counts: it is encoded as `" "`); `v = v_neg + g·(v_pos − v_neg)`, each branch over its own
//! prefix and RoPE table. Sizes are multiples of 32 pixels: the VAE's 16× and the 2×2 latent
//! groups of the prompt's image slots (diffusers floors other sizes silently; we refuse them).
//!
//! With condition images ([`Request::edit`]) the prefix is each branch's edit sequence
//! ([`super::edit`]): the images' VAE latents as blocks among the text rows of the prompt
//! encoded with the images; the target, its schedule and the steps are text-to-image's.
//!
//! Before the loop each stage is reported as [`Event::Stage`] once the device has finished it
//! (plan; for an edit the VAE encoder and the vision tower; then per branch the text encoder and
//! the prefill), so a bench can time them apart. Waiting for the device there costs one small
//! read-back per stage, a few tens of microseconds against a loop of seconds.
//!
//! The seeded latent is Tessera's own generator (SplitMix64 + Box–Muller, as for Z-Image), not
//! torch's `randn`; to reproduce a diffusers image, pass its packed latent as `init_latent`.
//!
//! Each component (text encoder, transformer, VAE decoder, the editing parts) is in a
//! `residency::Slot`: under [`Residency::Sequential`] (`--offload`) it loads when its stage
//! starts and is dropped when the stage ends, so no two of the text encoder, the transformer
//! and the decoder are on the device at once.

use std::ops::ControlFlow;
use std::path::Path;

use tessera_backend::{Backend, Precision, View};
use tessera_core::{Error, Result, Weights, check_finite};

use super::QwenImageFiles;
use super::condition;
use super::config::{ModelIndex, TransformerConfig, parse_model_index};
use super::edit::{self, EditPlan, Editor};
use super::layout::Layout;
use super::scheduler::{self, SchedulerConfig};
use super::text::{PromptIds, TextEncoder, prompt_ids};
use super::transformer::{Prefix, QwenImageTransformer};
use super::vae::{VaeConfig, VaeDecoder};
use super::vision::ImageProcessorConfig;
use crate::flow_match::{Schedule, euler_step};
use crate::noise;
use crate::qwen3::{BpeTokenizer, Qwen3Config};
use crate::residency::{self, Residency, Slot};
use crate::text_to_image::{Checked, Defaults, Edit, Event, Image, MAX_IMAGES, Request, Stage};

/// Progress of one request, as [`QwenImage::generate_images_until`] takes it.
type Report<'r> = dyn FnMut(Event<'_>) -> ControlFlow<()> + 'r;

/// Report `stage` done; `Break` cancels the request before its first step.
fn report(on: &mut Report<'_>, stage: Stage) -> Result<()> {
    match on(Event::Stage(stage)) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(()) => Err(Error::Cancelled(format!(
            "before the first step (after the {} stage)",
            stage.name()
        ))),
    }
}

/// Device memory a request needs besides its own buffers: the backend's fixed workspaces and
/// the text encoder's passes.
const FIXED_DEVICE_BYTES: usize = 768 << 20;

/// The configs of a Qwen-Image-2.1 folder's components, read and checked against each other
/// before any weight loads.
#[derive(Clone, Debug)]
pub struct QwenImageConfigs {
    pub index: ModelIndex,
    pub text_encoder: Qwen3Config,
    pub transformer: TransformerConfig,
    pub vae: VaeConfig,
    pub scheduler: SchedulerConfig,
}

impl QwenImageConfigs {
    pub fn read(files: &QwenImageFiles) -> Result<Self> {
        let index = parse_model_index(
            &files.root.path("model_index.json"),
            &files.root.read("model_index.json")?,
        )?;
        let te_path = files.text_encoder.path("config.json");
        let te = Qwen3Config::parse_vl(&te_path, &files.text_encoder.read("config.json")?)?;
        let tr_path = files.transformer.path("config.json");
        let tr = TransformerConfig::parse(&tr_path, &files.transformer.read("config.json")?)?;
        if tr.context_in_dim != te.hidden_size {
            return Err(Error::config(
                tr_path,
                "context_in_dim",
                format!(
                    "{} does not match the text encoder's hidden_size {}",
                    tr.context_in_dim, te.hidden_size
                ),
            ));
        }
        let vae_path = files.vae.path("config.json");
        let vae = VaeConfig::parse(&vae_path, &files.vae.read("config.json")?)?;
        if vae.z_dim != tr.in_channels || tr.out_channels != tr.in_channels {
            return Err(Error::config(
                vae_path,
                "z_dim",
                format!(
                    "{} does not match the transformer's in/out channels {}/{}",
                    vae.z_dim, tr.in_channels, tr.out_channels
                ),
            ));
        }
        let sched_path = files.scheduler.path("scheduler_config.json");
        let scheduler =
            SchedulerConfig::parse(&sched_path, &files.scheduler.read("scheduler_config.json")?)?;
        Ok(QwenImageConfigs {
            index,
            text_encoder: te,
            transformer: tr,
            vae,
            scheduler,
        })
    }
}

/// A checked request: everything that can be refused is refused here, before any compute.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The target in latent tokens.
    pub latent_hw: (usize, usize),
    pub schedule: Schedule,
    /// The prompt's ids, then the negative prompt's under true CFG.
    pub prompts: Vec<PromptIds>,
    pub guided: bool,
    pub warnings: Vec<String>,
    /// The condition images and each branch's sequence of an edit.
    pub edit: Option<EditPlan>,
}

impl Plan {
    /// Rows of each branch's prefix.
    pub fn prefix_rows(&self) -> Vec<usize> {
        match &self.edit {
            Some(e) => e.layouts.iter().map(Layout::prefix_rows).collect(),
            None => self.prompts.iter().map(PromptIds::rows).collect(),
        }
    }
}

pub struct QwenImage<B: Backend> {
    backend: B,
    tokenizer: BpeTokenizer,
    residency: Residency,
    text_encoder: Slot<B, TextEncoder<B>>,
    transformer: Slot<B, QwenImageTransformer<B>>,
    vae: Slot<B, VaeDecoder<B>>,
    /// What editing needs, or why this model cannot edit on this device.
    editor: std::result::Result<Editing<B>, String>,
    configs: QwenImageConfigs,
}

/// What editing adds: the image processor's settings (planning an edit needs no device) and the
/// vision tower with the VAE encoder.
struct Editing<B: Backend> {
    processor: ImageProcessorConfig,
    parts: Slot<B, Editor<B>>,
}

/// The editing parts when the device runs their ops and the folder has them, else why not.
fn load_editor<B: Backend>(
    be: &B,
    files: &QwenImageFiles,
    configs: &QwenImageConfigs,
    residency: Residency,
) -> std::result::Result<Editing<B>, String> {
    let vision = edit::vision_config(files)
        .map_err(|e| format!("its text encoder has no usable vision tower ({e})"))?;
    for op in edit::ops(configs, &vision) {
        be.supports(&op).map_err(|e| {
            format!(
                "{} cannot run {op}: {e}; edit with --device cpu",
                be.describe()
            )
        })?;
    }
    let loading = |e: Error| format!("loading its editing parts: {e}");
    let processor = ImageProcessorConfig::load(&files.processor).map_err(loading)?;
    let weights = (
        files.text_encoder.weights("model").map_err(loading)?,
        files
            .vae
            .weights("diffusion_pytorch_model")
            .map_err(loading)?,
    );
    let vae = configs.vae.clone();
    let parts = Slot::new(
        be,
        residency,
        "vision tower and VAE encoder",
        weights,
        move |be, (te, vw)| Editor::load(be, &vision, &vae, te, vw),
    )
    .map_err(loading)?;
    Ok(Editing { processor, parts })
}

/// A single transformer file (safetensors or GGUF) seen with the diffusers names: ComfyUI's files
/// keep them under `model.diffusion_model.`.
pub fn comfy_transformer_weights(path: &Path) -> Result<Weights> {
    Ok(comfy_root(Weights::open_any(path)?))
}

fn comfy_root(w: Weights) -> Weights {
    const PREFIX: &str = "model.diffusion_model";
    // A scaled FP8 file may mark itself with `scaled_fp8` outside the prefix.
    if w.names()
        .iter()
        .filter(|&&n| n != "scaled_fp8")
        .all(|n| n.starts_with("model.diffusion_model."))
    {
        w.pp(PREFIX)
    } else {
        w
    }
}

impl<B: Backend> QwenImage<B> {
    pub fn load(backend: B, files: &QwenImageFiles) -> Result<Self> {
        Self::load_with(backend, files, None)
    }

    /// [`load`](Self::load), the transformer's weights from `transformer_file` when given: one
    /// safetensors or GGUF file (ComfyUI-GGUF / stable-diffusion.cpp) with the diffusers tensor
    /// names, under ComfyUI's `model.diffusion_model.` prefix or none; a GGUF's block-format
    /// matrices, and a safetensors file's FP8 ones (with their `scale_weight`), stay quantized.
    pub fn load_with(
        backend: B,
        files: &QwenImageFiles,
        transformer_file: Option<&Path>,
    ) -> Result<Self> {
        Self::load_as(backend, files, transformer_file, Residency::Resident)
    }

    /// [`load_with`](Self::load_with), keeping the components on the device as `residency`
    /// says. Every check runs here either way (configs, vocabulary, the ops, the editor's
    /// availability, the weight files opened); [`Residency::Sequential`] loads each component's
    /// weights from its mapped files only when its stage runs.
    pub fn load_as(
        backend: B,
        files: &QwenImageFiles,
        transformer_file: Option<&Path>,
        residency: Residency,
    ) -> Result<Self> {
        let be = &backend;
        let configs = QwenImageConfigs::read(files)?;
        let tokenizer = BpeTokenizer::load(&files.processor)?;
        tokenizer.check_fits(configs.text_encoder.vocab_size)?;
        let cfg = configs.text_encoder.clone();
        let text_encoder = Slot::new(
            be,
            residency,
            "text encoder",
            files.text_encoder.weights("model")?,
            move |be, w| TextEncoder::load(be, &cfg, w),
        )?;
        let tr_weights = match transformer_file {
            Some(p) => comfy_transformer_weights(p)?,
            None => files.transformer.weights("diffusion_pytorch_model")?,
        };
        let cfg = configs.transformer.clone();
        let transformer = Slot::new(be, residency, "transformer", tr_weights, move |be, w| {
            QwenImageTransformer::load(be, &cfg, w)
        })?;
        let cfg = configs.vae.clone();
        let vae = Slot::new(
            be,
            residency,
            "VAE decoder",
            files.vae.weights("diffusion_pytorch_model")?,
            move |be, w| VaeDecoder::load(be, &cfg, w),
        )?;
        let editor = load_editor(be, files, &configs, residency);
        Ok(QwenImage {
            backend,
            tokenizer,
            residency,
            text_encoder,
            transformer,
            vae,
            editor,
            configs,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The transformer, while it is on the device (always, when resident).
    pub fn transformer(&self) -> Result<&QwenImageTransformer<B>> {
        self.transformer.resident()
    }
    /// The VAE decoder, while it is on the device (always, when resident).
    pub fn vae(&self) -> Result<&VaeDecoder<B>> {
        self.vae.resident()
    }
    pub fn configs(&self) -> &QwenImageConfigs {
        &self.configs
    }
    pub fn residency(&self) -> Residency {
        self.residency
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
        if let Ok(e) = &self.editor
            && e.parts.held().is_some()
        {
            names.push(e.parts.name());
        }
        names
    }

    /// Drop every component that is loaded for its stage only (all of them, when sequential).
    fn release_all(&mut self) -> Result<()> {
        let be = &self.backend;
        self.text_encoder.release(be)?;
        self.transformer.release(be)?;
        self.vae.release(be)?;
        if let Ok(e) = &mut self.editor {
            e.parts.release(be)?;
        }
        Ok(())
    }

    /// `Ok` if this model edits images on its device, else why not (one line).
    pub fn can_edit(&self) -> std::result::Result<(), &str> {
        self.editor.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// The output size `(width, height)` of `edit` without an explicit one: the last condition
    /// image's (the reference's default).
    pub fn edit_size(&self, edit: &Edit) -> Result<(usize, usize)> {
        self.editor_or_refusal()?;
        let sizes: Vec<(usize, usize)> = edit.images.iter().map(|i| (i.width, i.height)).collect();
        condition::default_output_size(&sizes, edit.output_resolution)
            .ok_or_else(|| Error::input("an edit needs at least one condition image"))
    }

    fn editor_or_refusal(&self) -> Result<&Editing<B>> {
        self.editor
            .as_ref()
            .map_err(|why| Error::input(format!("this Qwen-Image-2.1 cannot edit images: {why}")))
    }

    /// The pipeline's defaults, with the step count of the author's σ grid when the folder
    /// sets one.
    pub fn defaults(&self) -> Defaults {
        Defaults {
            steps: self
                .configs
                .index
                .sample_sigmas
                .as_ref()
                .map_or(super::DEFAULTS.steps, Vec::len),
            ..super::DEFAULTS
        }
    }

    /// Image sides must be multiples of this: the VAE's factor times the 2×2 latent groups.
    pub fn size_multiple(&self) -> usize {
        2 * self.configs.vae.scale()
    }

    /// The initial latent's length for a `width × height` image: packed `[tokens, channels]`.
    pub fn latent_len(&self, width: usize, height: usize) -> usize {
        let s = self.configs.vae.scale();
        (width / s) * (height / s) * self.configs.transformer.in_channels
    }

    /// Check a request and tokenise its prompts; nothing heavy runs.
    pub fn plan(&self, req: &Request) -> Result<Plan> {
        let m = self.size_multiple();
        let (w, h) = (req.width, req.height);
        if w == 0 || h == 0 || w % m != 0 || h % m != 0 {
            let near = |v: usize| ((v + m / 2) / m).max(1) * m;
            return Err(Error::input(format!(
                "--size {w}x{h}: Qwen-Image-2.1 makes images whose sides are positive multiples of {m}; the nearest valid size is {}x{}",
                near(w),
                near(h)
            )));
        }
        // Far above single digits the guided velocity is noise amplified: 1e30 made noise and
        // 3.4e38 overflowed the VAE, so the bound is Z-Image's.
        let max = crate::zimage::pipeline::MAX_GUIDANCE;
        if !(req.guidance.is_finite() && (0.0..=max).contains(&req.guidance)) {
            return Err(Error::input(format!(
                "--guidance {}: use a scale from 1 (no guidance) to {max}",
                req.guidance
            )));
        }
        if !(1..=MAX_IMAGES).contains(&req.num_images) {
            return Err(Error::input(format!(
                "--num-images {}: make 1 to {MAX_IMAGES} images per request",
                req.num_images
            )));
        }
        if req.shift.is_some() {
            return Err(Error::input(
                "Qwen-Image-2.1 shifts its schedule by the image size; a fixed shift does not apply",
            ));
        }
        let scale = self.configs.vae.scale();
        let latent_hw = (h / scale, w / scale);
        let tokens = latent_hw.0 * latent_hw.1;
        let mut warnings = Vec::new();
        let sample = self.configs.index.sample_sigmas.as_deref();
        if let Some(s) = sample
            && s.len() != req.steps
        {
            warnings.push(format!(
                "this model's σ grid (model_index.json sample_sigmas) has {} steps; --steps {} is ignored, as in the reference",
                s.len(),
                req.steps
            ));
        }
        let schedule = scheduler::schedule(&self.configs.scheduler, req.steps, tokens, sample)?;
        if let Some(l) = &req.init_latent {
            if req.num_images > 1 {
                return Err(Error::input(
                    "an initial latent starts one image: --init-latent needs --num-images 1",
                ));
            }
            let want = self.latent_len(w, h);
            if l.len() != want {
                return Err(Error::input(format!(
                    "the initial latent has {} values; a {w}x{h} image needs {tokens} tokens × {} channels = {want}",
                    l.len(),
                    self.configs.transformer.in_channels
                )));
            }
        }
        let guided = req.guidance > 1.0 && req.negative_prompt.is_some();
        if req.guidance > 1.0 && !guided {
            warnings.push(format!(
                "--guidance {} has no effect without a negative prompt: true CFG is off (give --negative-prompt; an empty one counts)",
                req.guidance
            ));
        } else if req.negative_prompt.is_some() && !guided {
            warnings.push(
                "the negative prompt is ignored: true CFG runs only with --guidance above 1".into(),
            );
        }
        let mut texts = vec![req.prompt.as_str()];
        if guided {
            texts.push(req.negative_prompt.as_deref().unwrap_or_default());
        }
        let edit = match &req.edit {
            None => None,
            Some(e) => {
                let editor = self.editor_or_refusal()?;
                Some(EditPlan::new(
                    e,
                    &texts,
                    &self.tokenizer,
                    &editor.processor,
                    scale,
                    latent_hw,
                )?)
            }
        };
        let prompts = match &edit {
            Some(e) => e.prompts.iter().map(|p| p.ids.clone()).collect(),
            None => texts
                .iter()
                .map(|t| prompt_ids(&self.tokenizer, t))
                .collect::<Result<Vec<_>>>()?,
        };
        let max = self.configs.text_encoder.max_positions;
        if let Some(p) = prompts.iter().find(|p| p.ids.len() > max) {
            return Err(Error::input(format!(
                "the prompt is {} tokens with its template; the text encoder takes at most {max}",
                p.ids.len()
            )));
        }
        let plan = Plan {
            latent_hw,
            schedule,
            prompts,
            guided,
            warnings,
            edit,
        };
        self.check_memory(req, &plan)?;
        Ok(plan)
    }

    /// What a planned request will run, for front ends.
    pub fn summary(&self, req: &Request, plan: &Plan) -> Checked {
        let steps = plan.schedule.steps();
        let passes = steps * if plan.guided { 2 } else { 1 };
        let c = &self.configs.transformer;
        let n = (plan.latent_hw.0 * plan.latent_hw.1) as f64;
        let lp = plan.prefix_rows()[0] as f64;
        let d = c.dim() as f64;
        // Per target row and layer: q|k|v|o (4·d²) and the SwiGLU (3·d·ffn) products, and the
        // attention over prefix + target keys.
        let per_pass = c.num_layers as f64
            * n
            * (2.0 * (4.0 * d * d + 3.0 * d * c.ffn_dim() as f64) + 4.0 * (lp + n) * d);
        Checked {
            passes,
            steps,
            guided: plan.guided,
            denoiser_flops: per_pass * (passes * req.num_images) as f64,
            warnings: plan.warnings.clone(),
        }
    }

    /// Device memory a request takes beyond the weights that stay loaded, in bytes: its largest
    /// stage's buffers, with that stage's weights when they load for it
    /// ([`Residency::Sequential`]; known from their last load, none before the first).
    fn request_bytes(&self, req: &Request, plan: &Plan, (w, h): (usize, usize)) -> usize {
        let compute = match self.backend.precision() {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        };
        let c = &self.configs;
        let scale = c.vae.scale();
        let hw = (h / scale, w / scale);
        let rows = plan.prefix_rows();
        let items: Vec<usize> = (0..req.num_images)
            .flat_map(|_| rows.iter().copied())
            .collect();
        let tr = &c.transformer;
        let prefixes: usize = rows.iter().map(|&r| tr.prefix_bytes(r, compute)).sum();
        let steps = tr.step_bytes(&items, hw, plan.schedule.steps(), compute) + prefixes;
        let decode = c.vae.decode_bytes(hw, compute);
        // An edit encodes its condition images one at a time before the prefixes exist, with
        // the text encoder and the editing parts loaded.
        let (encode, editor) = match (&plan.edit, &self.editor) {
            (Some(e), Ok(ed)) => (
                e.conditions
                    .iter()
                    .map(|c| {
                        self.configs
                            .vae
                            .encode_bytes((c.height(), c.width()), compute)
                    })
                    .max()
                    .unwrap_or(0),
                ed.parts.bytes_to_load(),
            ),
            _ => (0, 0),
        };
        let encoding = self.text_encoder.bytes_to_load() + editor + encode;
        let denoising = self.transformer.bytes_to_load() + steps;
        let decoding = self.vae.bytes_to_load() + decode;
        encoding.max(denoising).max(decoding) + FIXED_DEVICE_BYTES
    }

    /// Refuse, before any compute, a request whose buffers would not fit in the device memory
    /// left after loading, naming the largest size of the same shape that fits.
    fn check_memory(&self, req: &Request, plan: &Plan) -> Result<()> {
        let Some(available) = self.backend.memory_available()? else {
            return Ok(());
        };
        let (w, h) = (req.width, req.height);
        let need = self.request_bytes(req, plan, (w, h));
        if need <= available {
            return Ok(());
        }
        let m = self.size_multiple();
        let largest = (1..=w / m).rev().find_map(|side| {
            let w2 = side * m;
            let h2 = ((h * w2) as f64 / (w * m) as f64).round().max(1.0) as usize * m;
            (self.request_bytes(req, plan, (w2, h2)) <= available).then_some((w2, h2))
        });
        let gb = |b: usize| b as f64 / 1e9;
        let hint = match largest {
            Some((w2, h2)) => format!("the largest size of this shape that fits is {w2}x{h2}"),
            None => self.residency.no_size_fits().to_string(),
        };
        let beyond = self.residency.need_phrase();
        Err(Error::input(format!(
            "--size {w}x{h}{} needs about {:.1} GB of device memory {beyond}, and {:.1} GB are free: {hint}",
            if req.num_images > 1 {
                format!(" × {} images", req.num_images)
            } else {
                String::new()
            },
            gb(need),
            gb(available)
        )))
    }

    /// The text encoder's features of each planned prompt, `[rows, hidden]` each.
    pub fn prompt_features(&mut self, plan: &Plan) -> Result<Vec<Vec<f32>>> {
        self.encode(&plan.prompts)
    }

    /// The text encoder's features of `prompts`, `[rows, hidden]` each (the text encoder is
    /// dropped after, unless resident).
    pub fn encode(&mut self, prompts: &[PromptIds]) -> Result<Vec<Vec<f32>>> {
        let be = &self.backend;
        self.text_encoder.with(be, |te| te.features(be, prompts))
    }

    /// Run a planned request: `req.num_images` images, seeds `seed, seed + 1, …`, every step one
    /// batch through the DiT (under true CFG each image's two branches are items of it).
    pub fn generate_images(
        &mut self,
        req: &Request,
        plan: &Plan,
        mut on: impl FnMut(Event<'_>),
    ) -> Result<Vec<Image>> {
        self.generate_images_until(req, plan, |e| {
            on(e);
            ControlFlow::Continue(())
        })
    }

    /// [`QwenImage::generate_images`], stopped at the next step boundary when `on` returns
    /// `Break` (the result is then [`Error::Cancelled`]): a server's request whose client left.
    pub fn generate_images_until(
        &mut self,
        req: &Request,
        plan: &Plan,
        on: impl FnMut(Event<'_>) -> ControlFlow<()>,
    ) -> Result<Vec<Image>> {
        let made = self.run(req, plan, on);
        // A stage that failed leaves its component loaded: the next request starts bare.
        let released = self.release_all();
        let made = made.and_then(|images| released.map(|()| images));
        made.map_err(|e| match e {
            Error::OutOfMemory(m) if !m.contains(residency::LOADING) => Error::OutOfMemory(format!(
                "{m} while making {} image(s) of {}x{}: try a smaller --size or fewer --num-images",
                req.num_images, req.width, req.height
            )),
            e => e,
        })
    }

    /// Text-to-image: each branch's prompt features, prefilled.
    fn text_prefixes(&mut self, plan: &Plan, on: &mut Report<'_>) -> Result<Vec<Prefix<B>>> {
        let feats = self.prompt_features(plan)?;
        report(on, Stage::TextEncoder)?;
        let be = &self.backend;
        let transformer = self.transformer.get(be)?;
        let ctx = self.configs.transformer.context_in_dim;
        let mut prefixes = Vec::with_capacity(feats.len());
        for (f, p) in feats.iter().zip(&plan.prompts) {
            check_finite("text encoder features", f)?;
            let layout = Layout::text_to_image(p.rows(), plan.latent_hw)?;
            let mut buf = be.alloc(f.len(), tessera_backend::Role::Stream)?;
            be.write_f32(&mut buf, f)?;
            let prefix = transformer.prefill(be, &layout, View::new(&buf, p.rows(), ctx), &[])?;
            prefix.wait(be)?;
            report(on, Stage::Prefill)?;
            prefixes.push(prefix);
        }
        Ok(prefixes)
    }

    /// An edit: the condition images' latents (once), the tower's rows (once), each branch's
    /// features with the images, then each branch's text rows and the latents prefilled as its
    /// sequence. Each stage is reported as the device finishes it. The features of every
    /// branch come before the first prefill, so the text encoder and the editing parts are done
    /// before the transformer is needed.
    fn edit_prefixes(&mut self, e: &EditPlan, on: &mut Report<'_>) -> Result<Vec<Prefix<B>>> {
        let be = &self.backend;
        let editing = self.editor.as_mut().map_err(|why| {
            Error::input(format!("this Qwen-Image-2.1 cannot edit images: {why}"))
        })?;
        let editor = editing.parts.get(be)?;
        let mut latents = Vec::new();
        for (i, c) in e.conditions.iter().enumerate() {
            let (tokens, _) =
                editor
                    .encoder
                    .encode(be, &c.vae_pixels(), (c.height(), c.width()), None)?;
            check_finite(&format!("condition image {}: VAE latents", i + 1), &tokens)?;
            latents.extend_from_slice(&tokens);
        }
        report(on, Stage::VaeEncode)?;
        let map = editing.processor.pixel_map();
        let vision = editor.tower.forward(be, &e.vision, &map)?;
        // Read one row back: the tower has run before its stage is reported.
        be.read_f32(vision.merged.rows(0, 1))?;
        report(on, Stage::Vision)?;
        let (ctx, hidden) = (
            self.configs.transformer.context_in_dim,
            self.configs.text_encoder.hidden_size,
        );
        let text_encoder = self.text_encoder.get(be)?;
        let mut texts = Vec::with_capacity(e.prompts.len());
        for p in &e.prompts {
            let f = text_encoder.features_with_images(be, p, &vision)?;
            check_finite("text encoder features", &f)?;
            report(on, Stage::TextEncoder)?;
            texts.push(edit::text_rows(p, &f, hidden));
        }
        drop(vision);
        self.text_encoder.release(be)?;
        editing.parts.release(be)?;
        let transformer = self.transformer.get(be)?;
        let mut prefixes = Vec::with_capacity(e.prompts.len());
        for (text, layout) in texts.iter().zip(&e.layouts) {
            let rows = layout.text_rows();
            let mut buf = be.alloc(text.len().max(1), tessera_backend::Role::Stream)?;
            be.write_f32(&mut buf, text)?;
            let prefix = transformer.prefill(be, layout, View::new(&buf, rows, ctx), &latents)?;
            prefix.wait(be)?;
            report(on, Stage::Prefill)?;
            prefixes.push(prefix);
        }
        Ok(prefixes)
    }

    fn run(
        &mut self,
        req: &Request,
        plan: &Plan,
        mut on: impl FnMut(Event<'_>) -> ControlFlow<()>,
    ) -> Result<Vec<Image>> {
        report(&mut on, Stage::Plan)?;
        let prefixes = match &plan.edit {
            Some(e) => self.edit_prefixes(e, &mut on)?,
            None => self.text_prefixes(plan, &mut on)?,
        };
        let len = self.latent_len(req.width, req.height);
        let be = &self.backend;
        let transformer = self.transformer.get(be)?;
        let per = prefixes.len();
        let n = req.num_images;
        let items: Vec<usize> = (0..n).flat_map(|_| 0..per).collect();
        let refs: Vec<&Prefix<B>> = prefixes.iter().collect();
        let schedule = &plan.schedule;
        let mut steps = transformer.prepare_steps(be, &refs, &items, &schedule.t_model)?;
        if on(Event::Encoded).is_break() {
            return Err(Error::Cancelled("before the first step".into()));
        }
        let mut latents: Vec<Vec<f32>> = match &req.init_latent {
            Some(l) => vec![l.clone()],
            None => (0..n as u64)
                .map(|i| noise::gaussian(req.seed.wrapping_add(i), len))
                .collect(),
        };
        for step in 0..schedule.steps() {
            let of_items: Vec<&[f32]> = (0..n * per).map(|i| latents[i / per].as_slice()).collect();
            let v = transformer.step(be, &mut steps, &refs, &of_items, step)?;
            let at = format!("denoising step {} of {}", step + 1, schedule.steps());
            for (i, latent) in latents.iter_mut().enumerate() {
                let mut pred = v[i * per].clone();
                if plan.guided {
                    // v_neg + g·(v_pos − v_neg), in the reference's order.
                    for (p, &neg) in pred.iter_mut().zip(&v[i * per + 1]) {
                        *p = neg + req.guidance * (*p - neg);
                    }
                }
                check_finite(&format!("{at}: transformer velocity"), &pred)?;
                euler_step(latent, &pred, schedule, step);
                check_finite(&format!("{at}: latent"), latent)?;
            }
            let stop = on(Event::Step {
                index: step,
                steps: schedule.steps(),
                v: &v,
                latents: &latents,
            });
            if stop.is_break() {
                return Err(Error::Cancelled(format!(
                    "after denoising step {} of {}",
                    step + 1,
                    schedule.steps()
                )));
            }
        }
        // The loop's buffers go before the decoder's are made: the pool reuses their memory.
        drop(steps);
        drop(refs);
        drop(prefixes);
        self.transformer.release(be)?;
        if on(Event::Decoding).is_break() {
            return Err(Error::Cancelled("before decoding".into()));
        }
        let vae = self.vae.get(be)?;
        latents
            .iter()
            .map(|latent| {
                Ok(Image {
                    width: req.width,
                    height: req.height,
                    channels: 4,
                    pixels: vae.decode_rgba8(be, latent, plan.latent_hw)?,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(names: &[&str]) -> Weights {
        let data = 1f32.to_le_bytes();
        let views = names.iter().map(|&n| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data);
            (n, v.unwrap())
        });
        let file = safetensors::serialize(views, None).unwrap();
        Weights::from_static("<test>", Box::leak(file.into_boxed_slice())).unwrap()
    }

    /// ComfyUI's prefix is seen through, also beside a scaled FP8 file's `scaled_fp8` marker at
    /// the root; a file with other names outside it is left as it is.
    #[test]
    fn comfy_files_are_read_under_their_prefix() {
        let w = comfy_root(weights(&[
            "model.diffusion_model.img_in.weight",
            "scaled_fp8",
        ]));
        assert!(w.contains("img_in.weight"));
        let w = comfy_root(weights(&["model.diffusion_model.img_in.weight"]));
        assert!(w.contains("img_in.weight"));
        let w = comfy_root(weights(&["img_in.weight", "scaled_fp8"]));
        assert!(w.contains("img_in.weight"));
    }
}
