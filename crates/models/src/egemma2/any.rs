//! [`AnyEmbeddingGemma2`]: the model on whichever backend [`AnyBackend`] opened, so the CLI and
//! the server pick the device at run time without naming backend types.

use tessera_backend::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use tessera_backend::cuda::CudaBackend;
use tessera_backend::{AnyBackend, Backend};
use tessera_core::Result;

use super::{Config, Embedding, EmbeddingGemma2, Input, Prompts, TextOptions};
use crate::files::ModelFiles;
use crate::imageproc::{Image, ImageBudget, ImageLimits};

pub enum AnyEmbeddingGemma2 {
    Cpu(Box<EmbeddingGemma2<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<EmbeddingGemma2<CudaBackend>>),
}

/// Run `$body` with `$m` bound to the model, whatever its backend.
macro_rules! with_model {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            AnyEmbeddingGemma2::Cpu($m) => $body,
            #[cfg(feature = "cuda")]
            AnyEmbeddingGemma2::Cuda($m) => $body,
        }
    };
}

impl AnyEmbeddingGemma2 {
    pub fn load(backend: AnyBackend, files: ModelFiles) -> Result<Self> {
        Ok(match backend {
            AnyBackend::Cpu(b) => {
                AnyEmbeddingGemma2::Cpu(Box::new(EmbeddingGemma2::load(b, files)?))
            }
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => {
                AnyEmbeddingGemma2::Cuda(Box::new(EmbeddingGemma2::load(*b, files)?))
            }
        })
    }

    /// Device and precision, one line.
    pub fn describe(&self) -> String {
        with_model!(self, m => m.backend().describe())
    }
    pub fn config(&self) -> &Config {
        with_model!(self, m => m.config())
    }
    pub fn prompts(&self) -> &Prompts {
        with_model!(self, m => m.prompts())
    }
    pub fn files(&self) -> &ModelFiles {
        with_model!(self, m => m.files())
    }
    pub fn dim(&self) -> usize {
        with_model!(self, m => m.dim())
    }
    pub fn check_dim(&self, dim: Option<usize>) -> Result<usize> {
        with_model!(self, m => m.check_dim(dim))
    }
    pub fn prompt_prefix<'a>(&'a self, opts: &'a TextOptions) -> Result<&'a str> {
        with_model!(self, m => m.prompt_prefix(opts))
    }
    pub fn tokenize(&self, text: &str, opts: &TextOptions) -> Result<Vec<u32>> {
        with_model!(self, m => m.tokenize(text, opts))
    }
    pub fn set_pass_patches(&mut self, n: usize) {
        with_model!(self, m => m.pass_patches = n.max(1))
    }
    pub fn set_pass_tokens(&mut self, n: usize) {
        with_model!(self, m => m.pass_tokens = n.max(1))
    }
    pub fn embed_ids(
        &mut self,
        seqs: &[Vec<u32>],
        progress: impl FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        with_model!(self, m => m.embed_ids(seqs, progress))
    }
    pub fn embed_texts(
        &mut self,
        texts: &[&str],
        opts: &TextOptions,
        dim: Option<usize>,
        progress: impl FnMut(usize),
    ) -> Result<Vec<Embedding>> {
        with_model!(self, m => m.embed_texts(texts, opts, dim, progress))
    }

    pub fn supports_images(&self) -> bool {
        with_model!(self, m => m.supports_images())
    }
    pub fn default_image_budget(&self) -> Option<ImageBudget> {
        with_model!(self, m => m.default_image_budget())
    }
    pub fn patch_spec(&self) -> Option<crate::imageproc::PatchSpec> {
        with_model!(self, m => m.patch_spec())
    }
    /// What an image must satisfy for this model at `budget`, checked from its header before it
    /// is decoded (no memory bound: set `max_bytes` for one); `None` for a text-only model.
    pub fn image_limits(&self, budget: ImageBudget) -> Option<ImageLimits> {
        let spec = self.patch_spec()?;
        Some(ImageLimits {
            spec,
            budget,
            max_grid_side: self.config().vision.as_ref()?.position_embedding_size,
            max_bytes: u64::MAX,
        })
    }
    pub fn input_ids(
        &self,
        input: &Input,
        opts: &TextOptions,
        budget: ImageBudget,
    ) -> Result<Vec<u32>> {
        with_model!(self, m => m.input_ids(input, opts, budget))
    }
    pub fn soft_tokens(&mut self, images: &[Image], budget: ImageBudget) -> Result<Vec<Vec<f32>>> {
        with_model!(self, m => m.soft_tokens(images, budget))
    }
    pub fn embed_inputs(
        &mut self,
        inputs: &[Input],
        opts: &TextOptions,
        budget: ImageBudget,
        dim: Option<usize>,
        progress: impl FnMut(usize),
    ) -> Result<Vec<Embedding>> {
        with_model!(self, m => m.embed_inputs(inputs, opts, budget, dim, progress))
    }
}
