//! Embedding models as front ends use them: EmbeddingGemma 2 on whichever device was opened,
//! behind one trait object ([`Embed`]), with the pass packing, out-of-memory splitting and
//! host/device overlap of [`crate::packing`].

use rayon::prelude::*;
use tessera_backend::{AnyBackend, Backend, BackendFn};
use tessera_core::{Error, Result};
use tessera_models::ModelFiles;
use tessera_models::egemma2::{
    EmbeddingGemma2, Prepared, Prompts, TextOptions, checked_l2_normalize, matryoshka,
};
use tessera_models::imageproc::{Image, ImageBudget, ImageLimits, PatchSpec};
use tessera_models::input::Input;
use tessera_models::tokenize::TextTokenizer;

use crate::packing::{Cost, run_packed};

/// One embedding and how many tokens produced it.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub vector: Vec<f32>,
    pub tokens: usize,
}

/// How much one packed pass holds: large enough to fill the device, small enough to bound
/// activations. An input larger than that gets a pass of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassBudget {
    /// Token rows through the text encoder.
    pub tokens: usize,
    /// Image patches through the vision tower (one 1120-budget image has up to 10,080).
    pub patches: usize,
}

impl Default for PassBudget {
    fn default() -> Self {
        PassBudget {
            tokens: 8192,
            patches: 16_384,
        }
    }
}

/// Inputs prepared (resized, patched) in parallel at a time: a long list never holds every
/// image's patches at once.
const PREPARE_CHUNK: usize = 64;

/// An embedding model on its device. Front ends hold a `Box<dyn Embed>` (see [`load`]).
pub trait Embed: Send {
    /// Device and precision, one line.
    fn describe(&self) -> String;
    /// The full embedding width.
    fn dim(&self) -> usize;
    fn prompts(&self) -> &Prompts;
    /// The model's tokenizer, for counting tokens at the edge.
    fn tokenizer(&self) -> &TextTokenizer;
    fn supports_images(&self) -> bool;
    /// The soft-token budget of the model's processor config, if images work.
    fn default_image_budget(&self) -> Option<ImageBudget>;
    fn patch_spec(&self) -> Option<PatchSpec>;
    /// What an image must satisfy at `budget`, checked from its header before decoding; `None`
    /// for a text-only model.
    fn image_limits(&self, budget: ImageBudget) -> Option<ImageLimits>;
    /// Check a requested Matryoshka size before any work is done.
    fn check_dim(&self, dim: Option<usize>) -> Result<usize>;
    /// The prompt prefix `opts` asks for (validating the name).
    fn prompt_prefix(&self, opts: &TextOptions) -> Result<String>;
    fn tokenize(&self, text: &str, opts: &TextOptions) -> Result<Vec<u32>>;
    /// The token ids `input` becomes, media placeholder rows included.
    fn input_ids(&self, input: &Input, opts: &TextOptions, budget: ImageBudget)
    -> Result<Vec<u32>>;
    fn pass_budget(&self) -> PassBudget;
    fn set_pass_budget(&mut self, budget: PassBudget);

    /// Embed token-id sequences (full-width, L2-normalised), in passes of at most
    /// `pass_budget().tokens` rows; `progress` gets the number finished after each pass.
    fn embed_ids(
        &mut self,
        seqs: &[Vec<u32>],
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<f32>>>;

    /// Embed texts: tokenize with `opts`, run, cut to `dim` (Matryoshka, re-normalised).
    fn embed_texts(
        &mut self,
        texts: &[&str],
        opts: &TextOptions,
        dim: Option<usize>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Embedding>>;

    /// Embed inputs of texts and images, packed into passes; images resized for `budget` soft
    /// tokens. Text-only inputs embed exactly as their concatenated text does.
    fn embed_inputs(
        &mut self,
        inputs: &[Input],
        opts: &TextOptions,
        budget: ImageBudget,
        dim: Option<usize>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Embedding>>;

    /// The vision tower's soft tokens for each image (for inspection and tests).
    fn soft_tokens(&mut self, images: &[Image], budget: ImageBudget) -> Result<Vec<Vec<f32>>>;
}

/// EmbeddingGemma 2 with the budget its passes are packed to.
pub struct Egemma2<B: Backend> {
    pub model: EmbeddingGemma2<B>,
    pub budget: PassBudget,
}

impl<B: Backend> Egemma2<B> {
    pub fn new(model: EmbeddingGemma2<B>) -> Self {
        Egemma2 {
            model,
            budget: PassBudget::default(),
        }
    }

    /// Load from `files` onto `backend`.
    pub fn load(backend: B, files: ModelFiles) -> Result<Self> {
        Ok(Self::new(EmbeddingGemma2::load(backend, files)?))
    }
}

/// Name an input's error by its position when there are several.
fn numbered(what: &str, i: usize, n: usize, e: Error) -> Error {
    match e {
        Error::Input(m) if n > 1 => Error::Input(format!("{what} {}: {m}", i + 1)),
        other => other,
    }
}

impl<B: Backend> Embed for Egemma2<B> {
    fn describe(&self) -> String {
        self.model.backend().describe()
    }
    fn dim(&self) -> usize {
        self.model.dim()
    }
    fn prompts(&self) -> &Prompts {
        self.model.prompts()
    }
    fn tokenizer(&self) -> &TextTokenizer {
        self.model.tokenizer()
    }
    fn supports_images(&self) -> bool {
        self.model.supports_images()
    }
    fn default_image_budget(&self) -> Option<ImageBudget> {
        self.model.default_image_budget()
    }
    fn patch_spec(&self) -> Option<PatchSpec> {
        self.model.patch_spec()
    }
    fn image_limits(&self, budget: ImageBudget) -> Option<ImageLimits> {
        self.model.image_limits(budget)
    }
    fn check_dim(&self, dim: Option<usize>) -> Result<usize> {
        self.model.check_dim(dim)
    }
    fn prompt_prefix(&self, opts: &TextOptions) -> Result<String> {
        self.model.prompt_prefix(opts).map(str::to_string)
    }
    fn tokenize(&self, text: &str, opts: &TextOptions) -> Result<Vec<u32>> {
        self.model.tokenize(text, opts)
    }
    fn input_ids(
        &self,
        input: &Input,
        opts: &TextOptions,
        budget: ImageBudget,
    ) -> Result<Vec<u32>> {
        self.model.input_ids(input, opts, budget)
    }
    fn pass_budget(&self) -> PassBudget {
        self.budget
    }
    fn set_pass_budget(&mut self, budget: PassBudget) {
        self.budget = PassBudget {
            tokens: budget.tokens.max(1),
            patches: budget.patches.max(1),
        };
    }

    fn embed_ids(
        &mut self,
        seqs: &[Vec<u32>],
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        let budget = Cost {
            rows: self.budget.tokens,
            media: 0,
        };
        let (_, mut passes) = self.model.split();
        let mut out = Vec::with_capacity(seqs.len());
        run_packed(
            std::iter::once(Ok(seqs.iter().map(Vec::as_slice).collect::<Vec<_>>())),
            budget,
            |s: &&[u32]| Cost {
                rows: s.len(),
                media: 0,
            },
            |batch| passes.run_ids(batch),
            |batch, vectors| {
                for v in vectors {
                    out.push(checked_l2_normalize(v)?);
                }
                progress(batch.len());
                Ok(())
            },
        )?;
        Ok(out)
    }

    fn embed_texts(
        &mut self,
        texts: &[&str],
        opts: &TextOptions,
        dim: Option<usize>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Embedding>> {
        let dim = self.check_dim(dim)?;
        let ids = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                self.tokenize(t, opts)
                    .map_err(|e| numbered("text", i, texts.len(), e))
            })
            .collect::<Result<Vec<_>>>()?;
        let vectors = self.embed_ids(&ids, progress)?;
        Ok(vectors
            .into_iter()
            .zip(&ids)
            .map(|(v, ids)| Embedding {
                vector: matryoshka(v, dim),
                tokens: ids.len(),
            })
            .collect())
    }

    fn embed_inputs(
        &mut self,
        inputs: &[Input],
        opts: &TextOptions,
        budget: ImageBudget,
        dim: Option<usize>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Embedding>> {
        let dim = self.check_dim(dim)?;
        self.model.prompt_prefix(opts)?;
        let pass = Cost {
            rows: self.budget.tokens,
            media: self.budget.patches,
        };
        let (preparer, mut passes) = self.model.split();
        // Decoding is the caller's; resizing and patching run on all cores, a chunk at a time,
        // the next chunk while this one's passes run.
        let n = inputs.len();
        let chunks = inputs.chunks(PREPARE_CHUNK).enumerate().map(|(c, chunk)| {
            chunk
                .par_iter()
                .enumerate()
                .map(|(j, input)| {
                    preparer
                        .prepare(input, opts, budget)
                        .map_err(|e| numbered("input", c * PREPARE_CHUNK + j, n, e))
                })
                .collect::<Result<Vec<_>>>()
        });
        let mut out = Vec::with_capacity(n);
        run_packed(
            chunks,
            pass,
            |p: &Prepared| Cost {
                rows: p.tokens(),
                media: p.patches(),
            },
            |batch| passes.run(batch),
            |batch, vectors| {
                for (v, p) in vectors.into_iter().zip(batch) {
                    out.push(Embedding {
                        vector: matryoshka(checked_l2_normalize(v)?, dim),
                        tokens: p.tokens(),
                    });
                }
                progress(batch.len());
                Ok(())
            },
        )?;
        Ok(out)
    }

    fn soft_tokens(&mut self, images: &[Image], budget: ImageBudget) -> Result<Vec<Vec<f32>>> {
        self.model.soft_tokens(images, budget)
    }
}

/// Load an embedding model from `files` onto whichever device `backend` is.
pub fn load(backend: AnyBackend, files: ModelFiles) -> Result<Box<dyn Embed>> {
    struct Load(ModelFiles);
    impl BackendFn for Load {
        type Output = Result<Box<dyn Embed>>;
        fn call<B: Backend + 'static>(self, backend: B) -> Self::Output {
            Ok(Box::new(Egemma2::load(backend, self.0)?))
        }
    }
    backend.run(Load(files))
}
