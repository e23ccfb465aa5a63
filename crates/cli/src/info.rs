//! `tessera info`: what a model is and what it will run on.

use clap::Args;
use tessera_core::Result;
use tessera_models::egemma2::{AnyEmbeddingGemma2, config::LayerType};

use crate::device::DeviceArgs;
use crate::model::ModelChoice;

#[derive(Args)]
pub struct InfoArgs {
    /// Model folder or Hugging Face repo id in the local cache (default: the bundled miniature model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let choice = ModelChoice::egemma2(args.model.as_deref())?;
    let weights = choice.files.weights("model")?;
    let model = AnyEmbeddingGemma2::load(args.device.open()?, choice.files.clone())?;
    let t = &model.config().text;
    let n_full = t
        .layers
        .iter()
        .filter(|l| l.kind == LayerType::Full)
        .count();
    let prompts: Vec<&str> = model.prompts().names().collect();
    println!("model:       {}", choice.label);
    println!("location:    {}", model.files().location());
    println!("type:        EmbeddingGemma 2 (embedding_gemma2), text encoder");
    println!(
        "weights:     {} parameters, {} ({:.1} MB)",
        weights.total_params(),
        weights
            .main_dtype()
            .map_or("mixed".to_string(), |d| d.to_string()),
        weights.total_bytes() as f64 / 1e6
    );
    println!(
        "text:        {} layers ({} sliding, window ±{}; {} full), width {}, {} heads, vocab {}",
        t.layers.len(),
        t.layers.len() - n_full,
        t.sliding_window,
        n_full,
        t.hidden_size,
        t.num_heads,
        t.vocab_size
    );
    println!(
        "embedding:   {} dims (Matryoshka: any smaller --dim, re-normalised)",
        t.embedding_dim
    );
    println!(
        "max tokens:  {} positions (no truncation unless --max-tokens)",
        t.max_positions
    );
    let vision = match (&model.config().vision, model.default_image_budget()) {
        (Some(v), Some(b)) => format!(
            "{} layers, width {}, {}×{} patches pooled {}×{}; default image budget {b} soft tokens",
            v.num_layers,
            v.hidden_size,
            v.patch_size,
            v.patch_size,
            v.pooling_kernel_size,
            v.pooling_kernel_size
        ),
        _ => "no (text only)".to_string(),
    };
    println!("vision:      {vision}");
    println!(
        "prompts:     {}",
        if prompts.is_empty() {
            "none".to_string()
        } else {
            prompts.join(", ")
        }
    );
    println!("runs on:     {}", model.describe());
    choice.note_if_bundled();
    Ok(())
}
