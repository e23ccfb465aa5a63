//! Text-to-image models as front ends use them: Z-Image on whichever device was opened, behind
//! one trait object ([`GenerateImage`]).

use std::path::{Path, PathBuf};

use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::Result;
use tessera_models::zimage::{Event, Plan, Request, RgbImage, ZImage, ZImageFiles};

/// A text-to-image model on its device. Front ends hold a `Box<dyn GenerateImage>`.
pub trait GenerateImage: Send {
    /// Device and precision, one line.
    fn describe(&self) -> String;
    /// The shape `[channels, height, width]` of the initial latent of a `width × height` image.
    fn latent_shape(&self, width: usize, height: usize) -> [usize; 3];
    /// Check a request and tokenise its prompts: everything that can be refused is refused here.
    fn plan(&self, req: &Request) -> Result<Plan>;
    /// Run a planned request (`req.num_images` images, one batch), reporting progress through
    /// `on`.
    fn generate(
        &mut self,
        req: &Request,
        plan: &Plan,
        on: &mut dyn FnMut(Event<'_>),
    ) -> Result<Vec<RgbImage>>;
}

impl<B: Backend> GenerateImage for ZImage<B> {
    fn describe(&self) -> String {
        self.backend().describe()
    }
    fn latent_shape(&self, width: usize, height: usize) -> [usize; 3] {
        let scale = self.size_multiple() / 2;
        let channels = self.transformer().config().in_channels;
        [channels, height / scale, width / scale]
    }
    fn plan(&self, req: &Request) -> Result<Plan> {
        ZImage::plan(self, req)
    }
    fn generate(
        &mut self,
        req: &Request,
        plan: &Plan,
        on: &mut dyn FnMut(Event<'_>),
    ) -> Result<Vec<RgbImage>> {
        ZImage::generate_images(self, req, plan, on)
    }
}

/// Load Z-Image from `files` onto whichever device `backend` is; `transformer_file` replaces
/// the transformer's weights with one safetensors file (diffusers or ComfyUI names).
pub fn load(
    backend: AnyBackend,
    files: &ZImageFiles,
    transformer_file: Option<&Path>,
) -> Result<Box<dyn GenerateImage>> {
    struct Load(ZImageFiles, Option<PathBuf>);
    impl BackendFn for Load {
        type Output = Result<Box<dyn GenerateImage>>;
        fn call<B: Backend + 'static>(self, backend: B) -> Self::Output {
            Ok(Box::new(ZImage::load(backend, &self.0, self.1.as_deref())?))
        }
    }
    backend.run(Load(files.clone(), transformer_file.map(Path::to_path_buf)))
}
