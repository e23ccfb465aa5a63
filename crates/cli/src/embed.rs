//! `tessera embed`: texts → EmbeddingGemma 2 vectors.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tessera_core::{Error, Result};
use tessera_models::egemma2::{AnyEmbeddingGemma2, TextOptions};

use crate::device::DeviceArgs;

use crate::input::read_text_file;
use crate::model::ModelChoice;
use crate::output::{Format, write_jsonl, write_npy};

#[derive(Args)]
pub struct EmbedArgs {
    /// Model folder or Hugging Face repo id in the local cache (default: the bundled miniature model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<String>,
    /// A text to embed (repeatable).
    #[arg(long = "text", value_name = "TEXT")]
    texts: Vec<String>,
    /// A file of texts: one per line, or JSON lines (.jsonl: strings or {"text": ...}); `-` = stdin.
    #[arg(long, value_name = "FILE")]
    text_file: Option<PathBuf>,
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

pub fn run(args: EmbedArgs) -> Result<()> {
    let mut texts = args.texts;
    if let Some(path) = &args.text_file {
        texts.extend(read_text_file(path)?);
    }
    if texts.is_empty() {
        return Err(Error::input(
            "nothing to embed: give --text and/or --text-file",
        ));
    }
    if let Some(i) = texts.iter().position(String::is_empty) {
        return Err(Error::input(format!(
            "text {} is empty: there is nothing to embed",
            i + 1
        )));
    }
    // Open the output before any compute, so an unwritable path fails fast.
    let mut sink: Box<dyn Write> = match &args.out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| Error::io(p, e))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let choice = ModelChoice::egemma2(args.model.as_deref())?;
    let mut model = AnyEmbeddingGemma2::load(args.device.open()?, choice.files.clone())?;
    let opts = TextOptions {
        prompt_name: args.prompt_name,
        prompt: args.prompt,
        max_tokens: args.max_tokens,
    };
    model.check_dim(args.dim)?;
    model.prompt_prefix(&opts)?;

    let bar = ProgressBar::with_draw_target(Some(texts.len() as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} embedding {pos}/{len} texts [{elapsed_precise}, {per_sec}]",
        )
        .map_err(|e| Error::input(e.to_string()))?,
    );
    if texts.len() > 1 {
        bar.enable_steady_tick(Duration::from_millis(200));
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embeddings = model.embed_texts(&refs, &opts, args.dim, |n| bar.inc(n as u64))?;
    bar.finish_and_clear();

    let write_err =
        |e: std::io::Error| Error::io(args.out.clone().unwrap_or_else(|| "<stdout>".into()), e);
    match args.format {
        Format::Jsonl => write_jsonl(&mut sink, &choice.label, &embeddings).map_err(write_err)?,
        Format::Npy => write_npy(&mut sink, &embeddings)?,
    }
    choice.note_if_bundled();
    Ok(())
}
