//! `tessera embed`: texts and images → EmbeddingGemma 2 vectors.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgMatches, Args};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tessera_core::{Error, Result};
use tessera_models::egemma2::{Input, Part, TextOptions};
use tessera_models::imageproc::{Image, ImageBudget, ImageLimits};

use crate::device::DeviceArgs;

use crate::input::{read_path_list, read_text_file};
use tessera_runtime::Capability;
use tessera_runtime::embed::{self, Embed, Embedding};

use crate::model;
use crate::output::{Format, write_jsonl, write_npy};
use crate::stdout;

#[derive(Args)]
pub struct EmbedArgs {
    /// Model folder or Hugging Face repo id, downloaded on first use (default: the bundled
    /// miniature model).
    #[arg(long, short = 'm', env = "TESSERA_MODEL")]
    model: Option<String>,
    /// A text to embed (repeatable).
    #[arg(long = "text", value_name = "TEXT")]
    texts: Vec<String>,
    /// A file of texts: one per line, or JSON lines (.jsonl: strings or {"text": ...}); `-` = stdin.
    #[arg(long, value_name = "FILE")]
    text_file: Option<PathBuf>,
    /// An image to embed: PNG, JPEG, WebP, GIF (first frame) or BMP (repeatable).
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// A file of image paths, one per line.
    #[arg(long, value_name = "FILE")]
    image_file: Option<PathBuf>,
    /// Embed every --text and --image together as one input, in command-line order.
    #[arg(long, conflicts_with_all = ["text_file", "image_file"])]
    combine: bool,
    /// Soft tokens per image: 70, 140, 280, 560 or 1120 (default: the model's processor_config.json, 280 for the release).
    #[arg(long, value_name = "N")]
    image_budget: Option<String>,
    /// A task prompt from the model's config_sentence_transformers.json (e.g. query, document).
    #[arg(long, conflicts_with = "prompt")]
    prompt_name: Option<String>,
    /// A literal prefix put before every text instead of a named prompt.
    #[arg(long)]
    prompt: Option<String>,
    /// Matryoshka size: keep the first DIM coordinates and re-normalise (768, 512, 256, 128, …).
    #[arg(long)]
    dim: Option<usize>,
    /// Keep the first N−1 tokens and <eos> of longer inputs (default: no truncation, as the reference).
    #[arg(long, value_name = "N")]
    max_tokens: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value = "jsonl")]
    format: Format,
    /// Write here instead of standard output.
    #[arg(long, short = 'o', value_name = "FILE")]
    out: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Images decoded per call, so a long image list never holds more than this many in memory.
const IMAGES_PER_CALL: usize = 32;

pub fn run(args: EmbedArgs, matches: Option<&ArgMatches>) -> Result<()> {
    let mut texts = args.texts.clone();
    if let Some(path) = &args.text_file {
        texts.extend(read_text_file(path)?);
    }
    let mut images = args.images.clone();
    if let Some(path) = &args.image_file {
        images.extend(read_path_list(path)?);
    }
    if texts.is_empty() && images.is_empty() {
        return Err(Error::input(
            "nothing to embed: give --text, --text-file, --image and/or --image-file",
        ));
    }
    if let Some(i) = texts.iter().position(String::is_empty) {
        return Err(Error::input(format!(
            "text {} is empty: there is nothing to embed",
            i + 1
        )));
    }
    let budget = args
        .image_budget
        .as_deref()
        .map(str::parse::<ImageBudget>)
        .transpose()?;
    // Open the output before any compute, so an unwritable path fails fast.
    let mut sink: Box<dyn Write> = match &args.out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| Error::io(p, e))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let spec = model::open(args.model.as_deref(), Capability::Embed)?;
    let mut model = embed::load(
        args.device.open_for(&spec)?,
        model::embedding_model(&spec)?.0,
    )?;
    let opts = TextOptions {
        prompt_name: args.prompt_name.clone(),
        prompt: args.prompt.clone(),
        max_tokens: args.max_tokens,
    };
    model.check_dim(args.dim)?;
    model.prompt_prefix(&opts)?;
    let budget = match (images.is_empty(), budget.or(model.default_image_budget())) {
        (true, b) => b.unwrap_or(ImageBudget::DEFAULT),
        (false, Some(b)) => b,
        (false, None) => {
            return Err(Error::input(format!(
                "{} has no vision tower: it embeds text only",
                spec.label
            )));
        }
    };

    let count = if args.combine {
        1
    } else {
        texts.len() + images.len()
    };
    let what = if images.is_empty() { "texts" } else { "inputs" };
    let bar = ProgressBar::with_draw_target(Some(count as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} embedding {{pos}}/{{len}} {what} [{{elapsed_precise}}, {{per_sec}}]"
        ))
        .map_err(|e| Error::input(e.to_string()))?,
    );
    if count > 1 {
        bar.enable_steady_tick(Duration::from_millis(200));
    }
    let mut tick = |n: usize| bar.inc(n as u64);
    // Images are checked from their headers against the tower before they are decoded.
    let limits = model.image_limits(budget);
    let embeddings = if args.combine {
        let parts = combined_parts(&args, matches, limits.as_ref())?;
        model.embed_inputs(&[Input { parts }], &opts, budget, args.dim, &mut tick)?
    } else {
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let mut all = model.embed_texts(&refs, &opts, args.dim, &mut tick)?;
        all.extend(embed_images(
            model.as_mut(),
            &images,
            limits.as_ref(),
            &opts,
            budget,
            args.dim,
            &mut tick,
        )?);
        all
    };
    bar.finish_and_clear();

    let write_err = |e: std::io::Error| match &args.out {
        Some(p) => Error::io(p, e),
        None => stdout::error(e),
    };
    match args.format {
        Format::Jsonl => write_jsonl(&mut sink, &spec.label, &embeddings),
        Format::Npy => write_npy(&mut sink, &embeddings),
    }
    .map_err(write_err)?;
    model::note_if_bundled(&spec, args.model.as_deref());
    Ok(())
}

/// One input per image, decoded a chunk at a time.
fn embed_images(
    model: &mut dyn Embed,
    paths: &[PathBuf],
    limits: Option<&ImageLimits>,
    opts: &TextOptions,
    budget: ImageBudget,
    dim: Option<usize>,
    tick: &mut dyn FnMut(usize),
) -> Result<Vec<Embedding>> {
    let mut out = Vec::with_capacity(paths.len());
    for chunk in paths.chunks(IMAGES_PER_CALL) {
        let inputs = chunk
            .iter()
            .map(|p| open_image(p, limits).map(Input::image))
            .collect::<Result<Vec<_>>>()?;
        let got = match model.embed_inputs(&inputs, opts, budget, dim, tick) {
            Ok(got) => got,
            // Name the file at fault rather than its place in the chunk.
            Err(Error::Input(m)) => {
                for (p, input) in chunk.iter().zip(&inputs) {
                    if let Err(e) = model.input_ids(input, opts, budget) {
                        return Err(Error::input(format!("{}: {e}", p.display())));
                    }
                }
                return Err(Error::Input(m));
            }
            Err(e) => return Err(e),
        };
        out.extend(got);
    }
    Ok(out)
}

/// `--text` and `--image` values as parts, in the order they appear on the command line.
fn combined_parts(
    args: &EmbedArgs,
    matches: Option<&ArgMatches>,
    limits: Option<&ImageLimits>,
) -> Result<Vec<Part>> {
    let index = |id: &str| -> Vec<usize> {
        matches
            .and_then(|m| m.indices_of(id))
            .map(|i| i.collect())
            .unwrap_or_default()
    };
    let mut order: Vec<(usize, Part)> = Vec::new();
    let (ti, ii) = (index("texts"), index("images"));
    for (i, t) in args.texts.iter().enumerate() {
        order.push((ti.get(i).copied().unwrap_or(0), Part::Text(t.clone())));
    }
    for (i, p) in args.images.iter().enumerate() {
        let at = ii.get(i).copied().unwrap_or(usize::MAX);
        order.push((at, Part::Image(open_image(p, limits)?)));
    }
    order.sort_by_key(|(i, _)| *i);
    Ok(order.into_iter().map(|(_, p)| p).collect())
}

/// Open an image, refusing from its header one the model's tower cannot take (`limits`: `None`
/// for a text-only model, which refuses images later with its own message).
fn open_image(path: &std::path::Path, limits: Option<&ImageLimits>) -> Result<Image> {
    match limits {
        Some(l) => l.open(path),
        None => Image::open(path),
    }
}
