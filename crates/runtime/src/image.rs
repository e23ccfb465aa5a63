//! Text-to-image models as front ends use them: each family on whichever device was opened,
//! behind one trait object ([`GenerateImage`]).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::{Error, Result};
use tessera_models::Residency;
use tessera_models::qwen_image::{QwenImage, QwenImageFiles, condition};
use tessera_models::text_to_image::{
    Checked, Defaults, Edit, Event, Image, LatentPreview, Request,
};
use tessera_models::zimage::{self, ZImage, ZImageFiles};

use crate::{ModelFilesOf, ModelSpec};

/// Checks requests for a model from any thread, while the model itself runs others (see
/// [`GenerateImage::checker`]).
pub type Checker = Arc<dyn Fn(&Request) -> Result<Checked> + Send + Sync>;

/// The output size `(width, height)` of an edit that gives none, from its condition images.
pub type EditSizer = Arc<dyn Fn(&Edit) -> Result<(usize, usize)> + Send + Sync>;

/// Progress of one request: `Break` stops it at the next step boundary, and
/// [`GenerateImage::generate`] then returns [`Error::Cancelled`].
pub type Progress<'a> = dyn FnMut(Event<'_>) -> ControlFlow<()> + 'a;

/// Progress of the requests of a batch: `on(i, event)` for request `i`; `Break` stops request
/// `i` alone.
pub type BatchProgress<'a> = dyn FnMut(usize, Event<'_>) -> ControlFlow<()> + 'a;

/// A text-to-image model on its device. Front ends hold a `Box<dyn GenerateImage>`.
pub trait GenerateImage: Send {
    /// Device and precision, one line (and the residency where components load for their
    /// stage only).
    fn describe(&self) -> String;
    /// The family's recommended steps, guidance and size.
    fn defaults(&self) -> Defaults;
    /// The shape of the initial latent of a `width × height` image, as the reference pipeline's
    /// `latents=` argument takes it without the batch axis.
    fn latent_shape(&self, width: usize, height: usize) -> Vec<usize>;
    /// Check a request and tokenise its prompts: everything that can be refused is refused
    /// here, before any compute.
    fn check(&self, req: &Request) -> Result<Checked>;
    /// Run a request (`req.num_images` images, one batch), reporting progress through `on`;
    /// `on` returning `Break` stops it at the next step boundary with [`Error::Cancelled`].
    fn generate(&mut self, req: &Request, on: &mut Progress<'_>) -> Result<Vec<Image>>;

    /// Run several requests, one result each, reporting request `i`'s progress as `on(i, …)`;
    /// `Break` stops that request alone. Families that can put different requests of one size
    /// and schedule through the same denoiser forwards do (Z-Image), each request's images
    /// being those it makes alone; by default they run one after another.
    fn generate_batch(
        &mut self,
        reqs: &[Request],
        on: &mut BatchProgress<'_>,
    ) -> Vec<Result<Vec<Image>>> {
        reqs.iter()
            .enumerate()
            .map(|(i, req)| self.generate(req, &mut |e| on(i, e)))
            .collect()
    }

    /// A checker that needs neither the device nor `&mut self`, for front ends that check
    /// requests while others run (the server); what it accepts, `generate` may still refuse for
    /// the device's memory. `None` (the default): [`check`](Self::check) is the only way.
    fn checker(&self) -> Option<Checker> {
        None
    }

    /// `Ok` if this model edits condition images ([`Request::edit`]) on its device, else why
    /// not. The default: it makes images from text only.
    fn can_edit(&self) -> Result<()> {
        Err(Error::input(
            "this model makes images from text only; it cannot edit images (Qwen-Image-2.1 can)",
        ))
    }

    /// The output size of an edit without an explicit one, from any thread (the server's
    /// request handlers); `None` (the default): the model's default size.
    fn edit_sizer(&self) -> Option<EditSizer> {
        None
    }

    /// The output size `(width, height)` of `edit` when the request gives none (Qwen-Image-2.1:
    /// the last condition image's); the [`can_edit`](Self::can_edit) refusal where it cannot.
    fn edit_size(&self, edit: &Edit) -> Result<(usize, usize)> {
        self.can_edit()?;
        match self.edit_sizer() {
            Some(size) => size(edit),
            None => Ok(self.defaults().size),
        }
    }

    /// Whether the images have an alpha channel (RGBA); `false` (the default): RGB.
    fn has_alpha(&self) -> bool {
        false
    }

    /// The cheap latent → RGB(A) map for previews of [`Event::Step`]'s latents, derived from the
    /// model (fitted to its decoder on first use); `None` (the default) when the family has
    /// none.
    fn preview(&mut self) -> Result<Option<LatentPreview>> {
        Ok(None)
    }
}

impl<B: Backend> GenerateImage for ZImage<B> {
    fn describe(&self) -> String {
        format!("{}{}", self.backend().describe(), self.residency().suffix())
    }
    fn defaults(&self) -> Defaults {
        zimage::DEFAULTS
    }
    fn latent_shape(&self, width: usize, height: usize) -> Vec<usize> {
        let scale = self.size_multiple() / 2;
        let channels = self.transformer_config().in_channels;
        vec![channels, height / scale, width / scale]
    }
    fn check(&self, req: &Request) -> Result<Checked> {
        let plan = ZImage::plan(self, req)?;
        Ok(self.summary(req, &plan))
    }
    fn generate(&mut self, req: &Request, on: &mut Progress<'_>) -> Result<Vec<Image>> {
        let mut results =
            ZImage::generate_batch(self, std::slice::from_ref(req), &mut |_, e| on(e));
        results
            .pop()
            .unwrap_or_else(|| Err(Error::input("no image was made")))
    }
    fn generate_batch(
        &mut self,
        reqs: &[Request],
        on: &mut BatchProgress<'_>,
    ) -> Vec<Result<Vec<Image>>> {
        ZImage::generate_batch(self, reqs, on)
    }
    fn checker(&self) -> Option<Checker> {
        let planner = self.planner();
        Some(Arc::new(move |req: &Request| {
            let plan = planner.plan(req)?;
            Ok(planner.summary(req, &plan))
        }))
    }
    fn preview(&mut self) -> Result<Option<LatentPreview>> {
        ZImage::preview(self).map(Some)
    }
    fn can_edit(&self) -> Result<()> {
        Err(Error::input(
            "Z-Image makes images from text only; it cannot edit images (Qwen-Image-2.1 can)",
        ))
    }
}

impl<B: Backend> GenerateImage for QwenImage<B> {
    fn describe(&self) -> String {
        format!("{}{}", self.backend().describe(), self.residency().suffix())
    }
    fn defaults(&self) -> Defaults {
        QwenImage::defaults(self)
    }
    fn latent_shape(&self, width: usize, height: usize) -> Vec<usize> {
        let channels = self.configs().transformer.in_channels;
        vec![self.latent_len(width, height) / channels, channels]
    }
    fn check(&self, req: &Request) -> Result<Checked> {
        let plan = QwenImage::plan(self, req)?;
        Ok(self.summary(req, &plan))
    }
    fn generate(&mut self, req: &Request, on: &mut Progress<'_>) -> Result<Vec<Image>> {
        let plan = QwenImage::plan(self, req)?;
        QwenImage::generate_images_until(self, req, &plan, on)
    }
    fn can_edit(&self) -> Result<()> {
        QwenImage::can_edit(self)
            .map_err(|why| Error::input(format!("this Qwen-Image-2.1 cannot edit images: {why}")))
    }
    fn edit_sizer(&self) -> Option<EditSizer> {
        Some(Arc::new(|edit: &Edit| {
            let sizes: Vec<(usize, usize)> =
                edit.images.iter().map(|i| (i.width, i.height)).collect();
            condition::default_output_size(&sizes, edit.output_resolution)
                .ok_or_else(|| Error::input("an edit needs at least one condition image"))
        }))
    }
    fn has_alpha(&self) -> bool {
        // The RGBA VAE decoder (Qwen-Image-2.1's layered output).
        true
    }
}

/// Load Qwen-Image-2.1 from `files` onto whichever device `backend` is.
pub fn load_qwen_image(
    backend: AnyBackend,
    files: &QwenImageFiles,
) -> Result<Box<dyn GenerateImage>> {
    load_qwen_image_with(backend, files, None, Residency::Resident)
}

/// [`load_qwen_image`], `transformer_file` (safetensors or GGUF, diffusers names) replacing the
/// folder's transformer weights when given, the components kept on the device as `residency`
/// says.
pub fn load_qwen_image_with(
    backend: AnyBackend,
    files: &QwenImageFiles,
    transformer_file: Option<&Path>,
    residency: Residency,
) -> Result<Box<dyn GenerateImage>> {
    backend.run(Load {
        files: FamilyFiles::QwenImage(files.clone()),
        transformer_file: transformer_file.map(Path::to_path_buf),
        residency,
    })
}

/// Load Z-Image from `files` onto whichever device `backend` is; `transformer_file` replaces
/// the transformer's weights with one safetensors or GGUF file (diffusers or ComfyUI names).
pub fn load(
    backend: AnyBackend,
    files: &ZImageFiles,
    transformer_file: Option<&Path>,
) -> Result<Box<dyn GenerateImage>> {
    load_as(backend, files, transformer_file, Residency::Resident)
}

/// [`load`], the components kept on the device as `residency` says.
pub fn load_as(
    backend: AnyBackend,
    files: &ZImageFiles,
    transformer_file: Option<&Path>,
    residency: Residency,
) -> Result<Box<dyn GenerateImage>> {
    backend.run(Load {
        files: FamilyFiles::ZImage(files.clone()),
        transformer_file: transformer_file.map(Path::to_path_buf),
        residency,
    })
}

/// A text-to-image family's files.
enum FamilyFiles {
    ZImage(ZImageFiles),
    QwenImage(QwenImageFiles),
}

/// Loading one text-to-image model on whichever device the backend is.
struct Load {
    files: FamilyFiles,
    transformer_file: Option<PathBuf>,
    residency: Residency,
}

impl BackendFn for Load {
    type Output = Result<Box<dyn GenerateImage>>;
    fn call<B: Backend + 'static>(self, backend: B) -> Self::Output {
        let file = self.transformer_file.as_deref();
        Ok(match &self.files {
            FamilyFiles::ZImage(f) => Box::new(ZImage::load_as(backend, f, file, self.residency)?),
            FamilyFiles::QwenImage(f) => {
                Box::new(QwenImage::load_as(backend, f, file, self.residency)?)
            }
        })
    }
}

/// Load the text-to-image model `spec` names onto `backend`; `transformer_file` replaces the
/// transformer's weights (one safetensors or GGUF file).
pub fn open(
    backend: AnyBackend,
    spec: &ModelSpec,
    transformer_file: Option<&Path>,
) -> Result<Box<dyn GenerateImage>> {
    open_as(backend, spec, transformer_file, Residency::Resident)
}

/// [`open`], the components kept on the device as `residency` says
/// ([`Residency::Sequential`]: each loaded for its stage only, `--offload`).
pub fn open_as(
    backend: AnyBackend,
    spec: &ModelSpec,
    transformer_file: Option<&Path>,
    residency: Residency,
) -> Result<Box<dyn GenerateImage>> {
    match &spec.files {
        ModelFilesOf::ZImage(files, _) => load_as(backend, files, transformer_file, residency),
        ModelFilesOf::QwenImage(files, _) => {
            load_qwen_image_with(backend, files, transformer_file, residency)
        }
        _ => Err(Error::input(format!(
            "{} is a {} model, not a text-to-image model",
            spec.label,
            spec.family.name()
        ))),
    }
}
