//! `tessera info`: what a model is (family, capability, shapes, weights) and what each device
//! can run, from its configs and weight headers alone — nothing is loaded.

use clap::Args;
use tessera_core::{DType, Result, Weights};
use tessera_models::egemma2::{self, config::LayerType};
use tessera_models::lfm2vl::LayerKind;
use tessera_models::zimage::text::PromptTemplate;
use tessera_runtime::{Capability, Family, ModelFilesOf, ModelSpec};

use crate::device::{DeviceArgs, Quantize};
use crate::model;
use crate::stdout::outln;

#[derive(Args)]
pub struct InfoArgs {
    /// Model folder or Hugging Face repo id, downloaded on first use (default: the bundled
    /// miniature EmbeddingGemma 2).
    #[arg(long, short = 'm', env = "TESSERA_MODEL")]
    model: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// One component's parameter count, main dtype and size, and under `--quantize` the size its
/// weights take once quantized.
fn weights_line(label: &str, w: &Weights, quantize: Option<Quantize>) -> Result<()> {
    outln!(
        "{label:<12} {} parameters, {} ({:.1} MB)",
        w.total_params(),
        w.main_dtype()
            .map_or("mixed".to_string(), |d| d.to_string()),
        w.total_bytes() as f64 / 1e6
    )?;
    if let Some(arg) = quantize {
        let q = arg.dtype();
        let scales = match q {
            DType::F8_E4M3 => " with an f32 scale per row",
            _ => "",
        };
        outln!(
            "{:<12} {:.1} MB with --quantize {} (product weights in {q}{scales}; tables, norms and biases as stored)",
            "",
            quantized_bytes(w, q)? as f64 / 1e6,
            arg.arg()
        )?;
    }
    Ok(())
}

/// The bytes `w` takes once `--quantize q` has quantized its product weights: the float 2-D
/// tensors whose rows are whole blocks of `q`, less the embedding tables (read by row, kept as
/// stored). A table that is also a tied output head is quantized as a copy beside it, which this
/// does not count.
fn quantized_bytes(w: &Weights, q: DType) -> Result<usize> {
    let table =
        |name: &str| name.ends_with("embed_tokens.weight") || name.contains("position_embedding");
    let mut total = 0;
    for name in w.names() {
        let t = w.tensor(name)?;
        let product = matches!(t.shape[..], [_, cols] if cols % q.block_size() == 0)
            && !t.dtype.is_quantized()
            && !table(name);
        // FP8 keeps an f32 scale per row beside its codes.
        let scales = match (q, &t.shape[..]) {
            (DType::F8_E4M3, [rows, _]) => 4 * rows,
            _ => 0,
        };
        total += match q.bytes_for(t.numel()) {
            Some(b) if product => b + scales,
            _ => t.bytes.len(),
        };
    }
    Ok(total)
}

pub fn run(args: InfoArgs) -> Result<()> {
    crate::pull::ensure_local(args.model.as_deref())?;
    let spec = ModelSpec::open(args.model.as_deref(), Family::EmbeddingGemma2)?;
    let cap = spec.family.capability();
    outln!("model:       {}", spec.label)?;
    outln!("location:    {}", spec.location())?;
    outln!(
        "family:      {} — {} (`{}`)",
        spec.family.name(),
        cap.describe(),
        cap.command()
    )?;
    match &spec.files {
        ModelFilesOf::EmbeddingGemma2(files, config) => {
            egemma2_details(files, config, args.device.quantize)?
        }
        ModelFilesOf::Lfm2Vl(files, c) => {
            let (v, t) = (&c.vision, &c.text);
            let convs = t.layers.iter().filter(|&&k| k == LayerKind::Conv).count();
            outln!(
                "vision:      SigLIP2 NaFlex, {} layers, width {}, {} heads; projector {} → {} → {}{}",
                v.layers,
                v.hidden,
                v.heads,
                4 * v.hidden,
                c.projector_hidden,
                t.hidden,
                if c.projector_norm {
                    " (LayerNorm first)"
                } else {
                    ""
                }
            )?;
            outln!(
                "text:        LFM2, {} layers ({convs} conv, {} attention), width {}, {} heads ({} kv), FFN {}, vocab {}",
                t.layers.len(),
                t.layers.len() - convs,
                t.hidden,
                t.heads_q,
                t.heads_kv,
                t.ffn,
                t.vocab
            )?;
            weights_line("weights:", &files.weights("model")?, args.device.quantize)?;
        }
        ModelFilesOf::ZImage(files, c) => {
            let te = &c.text_encoder;
            let tr = &c.transformer;
            outln!(
                "text:        Qwen3, {} of {} layers run, width {}, {} heads ({} kv), vocab {}",
                te.num_layers - 1,
                te.num_layers,
                te.hidden_size,
                te.heads_q,
                te.heads_kv,
                te.vocab_size
            )?;
            outln!(
                "prompt:      {}",
                PromptTemplate::load(&files.tokenizer)?.describe()
            )?;
            outln!(
                "transformer: {} + {} refiner + {} main layers, width {}, {} heads of {}",
                tr.n_refiner_layers,
                tr.n_refiner_layers,
                tr.n_layers,
                tr.dim,
                tr.n_heads,
                tr.head_dim()
            )?;
            outln!(
                "vae:         {} blocks of {:?} channels, {} latent channels",
                c.vae.block_out_channels.len(),
                c.vae.block_out_channels,
                c.vae.latent_channels
            )?;
            weights_line(
                "weights:",
                &files.transformer.weights("diffusion_pytorch_model")?,
                args.device.quantize,
            )?;
        }
        ModelFilesOf::QwenImage(files, c) => {
            let (te, tr, vae) = (&c.text_encoder, &c.transformer, &c.vae);
            outln!(
                "text:        Qwen3-VL language model, {} layers, width {}, {} heads ({} kv), vocab {}; features before the final norm",
                te.num_layers,
                te.hidden_size,
                te.heads_q,
                te.heads_kv,
                te.vocab_size
            )?;
            outln!(
                "transformer: {} single-stream blocks, width {}, {} heads of {}, FFN {}, RoPE axes {:?}; prefix K/V cached",
                tr.num_layers,
                tr.dim(),
                tr.heads,
                tr.head_dim,
                tr.ffn_dim(),
                tr.axes_dims
            )?;
            outln!(
                "vae:         RGBA, {}× per side, {} latent channels, decoder width {} × {:?}",
                vae.scale(),
                vae.z_dim,
                vae.decoder_base_dim,
                vae.dim_mult
            )?;
            if let Some(s) = &c.index.sample_sigmas {
                outln!("schedule:    the author's σ grid of {} steps", s.len())?;
            }
            weights_line(
                "weights:",
                &files.transformer.weights("diffusion_pytorch_model")?,
                args.device.quantize,
            )?;
        }
    }
    outln!("ops:         {} distinct", spec.ops().len())?;
    for (device, support) in spec.support(args.device.quantization(spec.stored_format())?) {
        match support {
            Ok(d) => outln!("{:<12} runs it: {d}", format!("{device}:"))?,
            Err(e) => outln!("{:<12} cannot run it: {e}", format!("{device}:"))?,
        }
    }
    let backend = args.device.open_for(&spec)?;
    outln!("runs on:     {}", backend.describe())?;
    if spec
        .ops()
        .iter()
        .any(|op| matches!(op, tessera_backend::Op::Conv2d { .. }))
    {
        outln!("convolutions: {}", backend.conv_route())?;
    }
    if spec.family.capability() == Capability::Chat {
        outln!("decoding:    {}", backend.decode_route())?;
    }
    model::note_if_bundled(&spec, args.model.as_deref());
    Ok(())
}

fn egemma2_details(
    files: &tessera_models::ModelFiles,
    config: &egemma2::Config,
    quantize: Option<Quantize>,
) -> Result<()> {
    let t = &config.text;
    let n_full = t
        .layers
        .iter()
        .filter(|l| l.kind == LayerType::Full)
        .count();
    weights_line("weights:", &files.weights("model")?, quantize)?;
    outln!(
        "text:        {} layers ({} sliding, window ±{}; {} full), width {}, {} heads, vocab {}",
        t.layers.len(),
        t.layers.len() - n_full,
        t.sliding_window,
        n_full,
        t.hidden_size,
        t.num_heads,
        t.vocab_size
    )?;
    outln!(
        "embedding:   {} dims (Matryoshka: any smaller --dim, re-normalised)",
        t.embedding_dim
    )?;
    outln!(
        "max tokens:  {} positions (no truncation unless --max-tokens)",
        t.max_positions
    )?;
    let vision = match &config.vision {
        Some(v) => format!(
            "{} layers, width {}, {}×{} patches pooled {}×{}; default image budget {} soft tokens",
            v.num_layers,
            v.hidden_size,
            v.patch_size,
            v.patch_size,
            v.pooling_kernel_size,
            v.pooling_kernel_size,
            egemma2::ImageProcessor::load(files, v)?.default_budget
        ),
        None => "no (text only)".to_string(),
    };
    outln!("vision:      {vision}")?;
    let prompts: Vec<String> = egemma2::Prompts::load(files)?
        .names()
        .map(str::to_string)
        .collect();
    outln!(
        "prompts:     {}",
        if prompts.is_empty() {
            "none".to_string()
        } else {
            prompts.join(", ")
        }
    )?;
    Ok(())
}
