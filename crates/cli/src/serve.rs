//! `tessera serve`: the OpenAI-compatible server (crate `tessera-server`) for one or several
//! models: embeddings, chat and image generation, as each model's family decides.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tessera_backend::AnyBackend;
use tessera_core::{Error, Result};
use tessera_runtime::chat::{self, ChatOptions};
use tessera_runtime::{Capability, Family, ModelSpec, embed, image};
use tessera_server::{Limits, ModelLoader, Schedule, ServedModel, ServerConfig};

use crate::device::DeviceArgs;
use crate::model;

#[derive(Args)]
pub struct ServeArgs {
    /// Model folder or Hugging Face repo id (downloaded on first use), optionally `=NAME` for
    /// the id clients send as `model` (e.g. `--model ./Z-Image-Turbo=z-image-turbo`). Repeat it to serve
    /// several models in one process; each model's family decides its route: an embedding model
    /// (EmbeddingGemma 2) answers /v1/embeddings, a chat model (LFM2-VL) /v1/chat/completions, a
    /// text-to-image model (Z-Image, Qwen-Image-2.1) /v1/images/generations. `bundled:egemma2`,
    /// `bundled:lfm2vl`, `bundled:zimage` and `bundled:qwen-image` name the bundled miniatures
    /// (random weights, for checking an install); the default is `bundled:egemma2`.
    #[arg(long, short = 'm', env = "TESSERA_MODEL")]
    model: Vec<String>,
    /// The id clients send as `model` when one model is served (default: the folder's or repo's
    /// last name; `egemma2-mini`, `zimage-mini`, … for a bundled model). With
    /// several models, give each its own with `--model PATH=NAME`. For an embedding model,
    /// `ID:PROMPT` then selects a task prompt.
    #[arg(long, env = "TESSERA_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Run the model served as NAME on another device than --device: `NAME=DEVICE` (cpu, cuda,
    /// cuda:N), repeatable.
    #[arg(long, value_name = "NAME=DEVICE")]
    model_device: Vec<String>,
    /// Address to bind. The default answers only this machine; 0.0.0.0 exposes the server to the
    /// network, so set --api-key then.
    #[arg(long, env = "TESSERA_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on.
    #[arg(long, env = "TESSERA_PORT", default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Origins allowed to call the API from a browser (CORS), comma-separated or repeated; `*`
    /// allows any. None by default.
    #[arg(long, env = "TESSERA_ALLOW_ORIGIN", value_delimiter = ',')]
    allow_origin: Vec<String>,
    /// Accept local file paths (and file:// URLs) as images. Off by default: with it, any client
    /// can make the server read any image file it can read.
    #[arg(long, env = "TESSERA_ALLOW_FILE_PATHS")]
    allow_file_paths: bool,
    /// Embeddings: tokens (image soft tokens included) merged into one device batch. Larger
    /// batches raise throughput on a GPU and raise the wait of a request that arrives during one.
    #[arg(long, env = "TESSERA_MAX_BATCH_TOKENS", default_value_t = 8192)]
    max_batch_tokens: usize,
    /// Embeddings: images merged into one device batch: bounds how long a short query waits
    /// behind images.
    #[arg(long, env = "TESSERA_MAX_BATCH_IMAGES", default_value_t = 8)]
    max_batch_images: usize,
    /// Requests admitted at once per model (checked, queued or run; a request is admitted once
    /// its body has arrived), and bodies arriving at once; more get 429 with Retry-After.
    /// Together with --max-request-mb and --max-image-memory-mb it bounds memory. Chat: requests
    /// being prepared (template, tokens, images) or waiting, beyond the --max-sequences being
    /// generated. Images: also bounded by
    /// --max-image-queue-mps.
    #[arg(long, env = "TESSERA_MAX_QUEUE", default_value_t = 64)]
    max_queue: usize,
    /// Seconds a request's body has to arrive once its headers have; slower bodies get 408.
    #[arg(long, env = "TESSERA_BODY_TIMEOUT", default_value_t = 10)]
    body_timeout: u64,
    /// Requests from one client address whose bodies are still arriving; more get 429, so a
    /// client that opens connections and goes quiet cannot crowd others out.
    #[arg(long, env = "TESSERA_MAX_UPLOADS_PER_CLIENT", default_value_t = 8)]
    max_uploads_per_client: usize,
    /// Inputs (and images) in one request (chat: images in one request).
    #[arg(long, env = "TESSERA_MAX_INPUTS", default_value_t = 256)]
    max_inputs: usize,
    /// Embeddings: tokens in one input, images counted at their budget; longer inputs get 400
    /// (nothing is truncated). Long inputs hold the device longer: raise with care.
    #[arg(long, env = "TESSERA_MAX_INPUT_TOKENS", default_value_t = 8192)]
    max_input_tokens: usize,
    /// Largest request body in MiB (base64 images make bodies large).
    #[arg(long, env = "TESSERA_MAX_REQUEST_MB", default_value_t = 32)]
    max_request_mb: usize,
    /// Memory for images, in MiB: what decoding and preprocessing each image will take is
    /// worked out from its header and reserved before it is decoded (a 12-megapixel JPEG needs
    /// about 150 MiB while it is decoded, 36 MiB after); beyond it requests get 429, and an image
    /// that could never fit 413.
    #[arg(long, env = "TESSERA_MAX_IMAGE_MEMORY_MB", default_value_t = 2048)]
    max_image_memory_mb: usize,
    /// Seconds from a request's arrival to its answer before it fails with 504 (a streamed chat
    /// reply: to its first text; the stream then runs to its end). Images: --image-timeout.
    #[arg(long, env = "TESSERA_REQUEST_TIMEOUT", default_value_t = 60)]
    request_timeout: u64,
    /// Chat: replies generated at once, each in its own cache slot (continuous batching: they
    /// share every forward). More slots raise throughput and the device memory the cache takes.
    #[arg(long, env = "TESSERA_MAX_SEQUENCES", default_value_t = 8)]
    max_sequences: usize,
    /// Chat: the most tokens of one conversation (prompt, images and reply); each cache slot is
    /// sized for it. Capped at the model's limit (max_position_embeddings).
    #[arg(long, env = "TESSERA_CONTEXT", default_value_t = 8192)]
    context: usize,
    /// Images: the most pixels of one generated image (width × height); larger sizes get 400.
    #[arg(long, env = "TESSERA_MAX_IMAGE_PIXELS", default_value_t = 2 << 20)]
    max_image_pixels: usize,
    /// Images: the most denoising steps a request may ask for (num_inference_steps).
    #[arg(long, env = "TESSERA_MAX_IMAGE_STEPS", default_value_t = 100)]
    max_image_steps: usize,
    /// Images: the work the requests admitted at once may hold together, in megapixel-steps
    /// (width × height × steps × n / 2^20: a 1024² Turbo image is 8); beyond it requests get 429
    /// with Retry-After, and one that could never fit 413.
    #[arg(long, env = "TESSERA_MAX_IMAGE_QUEUE_MPS", default_value_t = 512)]
    max_image_queue_mps: usize,
    /// Images: the most images denoised together: requests of one size and step count that wait
    /// together run as one batch through the denoiser.
    #[arg(long, env = "TESSERA_MAX_IMAGE_BATCH", default_value_t = 8)]
    max_image_batch: usize,
    /// Images: run one request at a time instead of batching requests that wait together (for
    /// comparison).
    #[arg(long, env = "TESSERA_NO_IMAGE_BATCHING")]
    no_image_batching: bool,
    /// Keep every model's GPU work at the same priority. By default, when an image model is
    /// served, the embedding and chat models queue their work on CUDA streams of the highest
    /// priority, so their short requests are dispatched first while a generation runs.
    #[arg(long, env = "TESSERA_NO_STREAM_PRIORITY")]
    no_stream_priority: bool,
    /// Images: seconds from a request's arrival to its last image before it fails with 504; its
    /// generation stops at the next step.
    #[arg(long, env = "TESSERA_IMAGE_TIMEOUT", default_value_t = 600)]
    image_timeout: u64,
    /// Seconds from SIGTERM or Ctrl-C to the end of the process: requests in flight get this
    /// long to finish; then the server exits whatever they are doing.
    #[arg(long, env = "TESSERA_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    shutdown_timeout: u64,
    /// Embeddings: lanes: text first, images in their own lane (short queries do not wait behind
    /// images); fifo: one lane in arrival order (for comparison).
    #[arg(long, env = "TESSERA_SCHEDULE", value_enum, default_value = "lanes")]
    schedule: ScheduleArg,
    /// Serve /metrics without the API key, for Prometheus scrapers (which carry no token). The
    /// other routes still need it.
    #[arg(long, env = "TESSERA_METRICS_PUBLIC")]
    metrics_public: bool,
    /// Log lines as text or JSON (one object per line, the start-up notes and a failure to
    /// start included): one access line per request at info; RUST_LOG filters (default info).
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum ScheduleArg {
    Lanes,
    Fifo,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let format = args.log_format;
    init_logs(format);
    let served = serve(args);
    if let (Err(e), LogFormat::Json) = (&served, format) {
        // The failure as a log line like every other, not `main`'s plain `error:` line.
        tracing::error!(error = %e, "the server stopped");
        std::process::exit(1);
    }
    served
}

fn serve(args: ServeArgs) -> Result<()> {
    let specs = model_specs(&args.model, args.served_model_name.as_deref())?;
    let config = ServerConfig {
        api_key: args.api_key.clone(),
        allow_origins: args.allow_origin.clone(),
        allow_file_paths: args.allow_file_paths,
        metrics_public: args.metrics_public,
        limits: Limits {
            max_request_bytes: args.max_request_mb.saturating_mul(1 << 20),
            max_inputs: args.max_inputs,
            max_input_tokens: args.max_input_tokens,
            max_queue: args.max_queue,
            body_timeout: Duration::from_secs(args.body_timeout),
            max_uploads_per_client: args.max_uploads_per_client,
            max_image_memory_mb: args.max_image_memory_mb,
            max_batch_tokens: args.max_batch_tokens,
            max_batch_images: args.max_batch_images,
            request_timeout: Duration::from_secs(args.request_timeout),
            max_sequences: args.max_sequences,
            context: args.context,
            max_image_pixels: args.max_image_pixels,
            max_image_steps: args.max_image_steps,
            max_image_queue_mps: args.max_image_queue_mps,
            max_image_batch: args.max_image_batch,
            batch_images: !args.no_image_batching,
            image_timeout: Duration::from_secs(args.image_timeout),
            shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        },
        schedule: match args.schedule {
            ScheduleArg::Lanes => Schedule::Lanes,
            ScheduleArg::Fifo => Schedule::Fifo,
        },
    };
    config.validate()?;
    tessera_server::config::check_names(specs.iter().map(|(n, _)| n.as_str()))?;
    let devices = model_devices(&args.model_device, &specs)?;
    if args.api_key.is_none() && !args.host.is_loopback() {
        tracing::warn!(host = %args.host, "serving beyond this machine without --api-key");
    }
    let prioritise = !args.no_stream_priority
        && specs
            .iter()
            .any(|(_, s)| s.family.capability() == Capability::GenerateImage);
    let mut models = Vec::with_capacity(specs.len());
    for (name, spec) in specs {
        if spec.is_bundled() {
            tracing::warn!(
                model = %name,
                "serving the {} (random weights: for checking an install, not for use)",
                spec.family.bundled_name()
            );
        }
        let device = match devices.iter().find(|(n, _)| *n == name) {
            Some((_, d)) => args.device.with_device(d),
            None => args.device.clone(),
        };
        models.push(ServedModel {
            loader: loader(spec, device, prioritise)?,
            name,
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::backend("tokio", e))?;
    let served = runtime.block_on(async move {
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::input(format!("cannot listen on {addr}: {e}")))?;
        tessera_server::serve(listener, config, models, shutdown_signal())
            .await
            .map_err(|e| match e {
                tessera_server::ServeError::Config(e) => e,
                other => Error::backend("serve", other),
            })
    });
    // `serve` has given up on whatever was still running at its deadline (a blocking read, a
    // long render): do not wait for those threads on the way out.
    runtime.shutdown_timeout(Duration::from_millis(100));
    served
}

/// How `spec` is loaded, on the device `device` opens, on its worker's thread; with
/// `prioritise`, an embedding or chat model's GPU work goes to a high-priority stream (it shares
/// the server with an image model's long generations).
fn loader(spec: ModelSpec, device: DeviceArgs, prioritise: bool) -> Result<ModelLoader> {
    let image_device = device.clone();
    let open = move |spec: &ModelSpec| -> Result<AnyBackend> {
        let mut backend = device.open_for_with(spec, note)?;
        if prioritise {
            backend.prefer_latency()?;
        }
        Ok(backend)
    };
    Ok(match spec.family.capability() {
        Capability::Embed => {
            let files = model::embedding_model(&spec)?.0;
            let loader: tessera_server::Loader = Box::new(move || embed::load(open(&spec)?, files));
            loader.into()
        }
        Capability::Chat => {
            let loader: tessera_server::ChatLoader = Box::new(move |cache| {
                chat::load(open(&spec)?, &spec, cache, ChatOptions::serving())
            });
            loader.into()
        }
        Capability::GenerateImage => ModelLoader::Image(Box::new(move || {
            // Requests batched together give the bytes they give alone on the CPU, whose
            // products do not depend on the row count (on a GPU, within the last bits: its
            // product kernels are chosen by shape).
            let backend = image_device.open_for_with(&spec, note)?;
            image::open(backend, &spec, None)
        })),
    })
}

/// A device note (`auto` falling back to the CPU, and why) as a log line, JSON with the rest.
fn note(text: &str) {
    tracing::info!("{text}");
}

/// Each `--model` (the bundled embedding model when none) with its served name.
fn model_specs(models: &[String], served_name: Option<&str>) -> Result<Vec<(String, ModelSpec)>> {
    if models.len() > 1 && served_name.is_some() {
        return Err(Error::input(
            "--served-model-name names the one model served; with several --model, name each one with --model PATH=NAME",
        ));
    }
    if models.is_empty() {
        let name = served_name.map_or_else(|| default_name(None), str::to_string);
        return Ok(vec![(name, open_model(None)?)]);
    }
    models
        .iter()
        .map(|m| {
            let (path, name) = split_name(m);
            let name = served_name
                .map(str::to_string)
                .or(name)
                .unwrap_or_else(|| default_name(Some(path)));
            Ok((name, open_model(Some(path))?))
        })
        .collect()
}

/// `PATH=NAME` into the path and the name; a value whose part after the last `=` looks like a
/// path (it has a `/`) is a path as a whole.
fn split_name(value: &str) -> (&str, Option<String>) {
    match value.rsplit_once('=') {
        Some((path, name)) if !path.is_empty() && !name.contains('/') => {
            (path, Some(name.to_string()))
        }
        _ => (value, None),
    }
}

/// `--model-device NAME=DEVICE` for served names only.
fn model_devices(
    values: &[String],
    specs: &[(String, ModelSpec)],
) -> Result<Vec<(String, String)>> {
    values
        .iter()
        .map(|v| {
            let (name, device) = v.split_once('=').ok_or_else(|| {
                Error::input(format!(
                    "--model-device {v:?}: expected NAME=DEVICE, e.g. z-image=cuda:1"
                ))
            })?;
            if !specs.iter().any(|(n, _)| n == name) {
                let names: Vec<&str> = specs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(Error::input(format!(
                    "--model-device {v:?}: no model is served as {name:?} (served: {})",
                    names.join(", ")
                )));
            }
            device.parse::<tessera_backend::DeviceRequest>()?;
            Ok((name.to_string(), device.to_string()))
        })
        .collect()
}

/// The model `--model` names: a bundled miniature (`bundled:NAME`), a folder or a repo id
/// (downloaded on first use); the bundled embedding model when absent.
fn open_model(spec: Option<&str>) -> Result<ModelSpec> {
    crate::pull::ensure_local(spec)?;
    ModelSpec::open(spec, Family::EmbeddingGemma2)
}

/// The last component of a folder or repo id; a bundled model's own name.
fn default_name(model: Option<&str>) -> String {
    match model {
        None => "egemma2-mini".into(),
        Some(spec) if spec.starts_with("bundled:") => {
            format!(
                "{}-mini",
                spec.trim_start_matches("bundled:")
                    .trim_end_matches("-mini")
            )
        }
        Some(spec) => Path::new(spec.trim_end_matches('/'))
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or(spec)
            .replace(':', "-"),
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second subscriber (tests calling run twice) is not an error worth stopping for.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    match crate::signals::interrupted() {
        Ok(signal) => {
            signal.await;
        }
        Err(e) => {
            tracing::error!("cannot listen for Ctrl-C and SIGTERM: {e}");
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::default_name;

    #[test]
    fn served_names() {
        assert_eq!(default_name(None), "egemma2-mini");
        assert_eq!(
            default_name(Some("google/embeddinggemma-2")),
            "embeddinggemma-2"
        );
        assert_eq!(default_name(Some("/models/eg2/")), "eg2");
        assert_eq!(default_name(Some("bundled:lfm2vl")), "lfm2vl-mini");
        assert_eq!(default_name(Some("bundled:egemma2-mini")), "egemma2-mini");
    }

    #[test]
    fn the_family_of_the_model_decides_what_is_served() {
        use tessera_runtime::Capability;
        let chat = super::open_model(Some("bundled:lfm2vl")).unwrap();
        assert_eq!(chat.family.capability(), Capability::Chat);
        let embed = super::open_model(None).unwrap();
        assert_eq!(embed.family.capability(), Capability::Embed);
        assert!(super::open_model(Some("bundled:egemma2-mini")).is_ok());
        let image = super::open_model(Some("bundled:zimage")).unwrap();
        assert_eq!(image.family.capability(), Capability::GenerateImage);
        let e = super::open_model(Some("bundled:qwen"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bundled:zimage"), "{e}");
    }

    #[test]
    fn several_models_each_with_a_name() {
        use super::{model_devices, model_specs, split_name};
        assert_eq!(split_name("./z-image=z"), ("./z-image", Some("z".into())));
        assert_eq!(split_name("/a=b/c"), ("/a=b/c", None));
        assert_eq!(split_name("bundled:zimage"), ("bundled:zimage", None));
        let specs = model_specs(
            &["bundled:zimage=painter".into(), "bundled:egemma2".into()],
            None,
        )
        .unwrap();
        let names: Vec<&str> = specs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["painter", "egemma2-mini"]);
        let e = model_specs(
            &["bundled:zimage".into(), "bundled:egemma2".into()],
            Some("x"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("PATH=NAME"), "{e}");
        let one = model_specs(&[], Some("emb")).unwrap();
        assert_eq!(one[0].0, "emb");
        assert!(model_devices(&["painter=cpu".into()], &specs).is_ok());
        let e = model_devices(&["nobody=cpu".into()], &specs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("painter, egemma2-mini"), "{e}");
        assert!(model_devices(&["painter".into()], &specs).is_err());
        assert!(model_devices(&["painter=gpu7".into()], &specs).is_err());
    }
}
