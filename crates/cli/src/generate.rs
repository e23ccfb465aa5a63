//! `tessera generate`: text to image with Z-Image-Turbo (or the base Z-Image) or Qwen-Image-2.1,
//! or an edit of condition images (`--image`, Qwen-Image-2.1), written as a PNG whose text chunks record the prompt, seed, steps, size and model (or as a JPEG
//! or WebP, as `--out`'s extension says; those carry no text).
//!
//! Everything that can be refused is refused before the model runs: the output file is created
//! (as a hidden temporary file next to it, renamed into place at the end, so a failed run leaves
//! nothing half-written; a device or a FIFO is written through instead of replaced), the initial
//! latent is read and the request is checked. SIGINT and SIGTERM remove the temporary file; a
//! run killed beyond that (SIGKILL) leaves one that the next run in that folder removes.

mod npy;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tessera_backend::AnyBackend;
use tessera_core::{Error, Result};
use tessera_models::Residency;
use tessera_models::imageproc::open_rgba;
use tessera_models::qwen_image::condition::OUTPUT_RESOLUTION;
use tessera_models::text_to_image::{Edit, Event, Image, MAX_EDIT_IMAGES, Request};
use tessera_runtime::image::GenerateImage;
use tessera_runtime::{Capability, ModelSpec, image};

use crate::device::DeviceArgs;
use crate::model;

/// Generate an image from a prompt with Z-Image or Qwen-Image-2.1.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Z-Image-Turbo wants the defaults (8 steps, no guidance). The base Z-Image \
model wants about --steps 50 --guidance 4. Qwen-Image-2.1 wants its defaults (40 steps). \
Without --seed a seed is drawn at random and printed; --seed N makes the same image again. The \
initial latent is drawn from the seed with Tessera's own generator (SplitMix64 + Box-Muller, the \
same on every machine); it is not torch's randn, so to reproduce a diffusers image pass its latent \
with --init-latent."
)]
pub struct GenerateArgs {
    /// A Z-Image or Qwen-Image-2.1 folder in the diffusers layout (model_index.json + component
    /// folders) or a Hugging Face repo id, downloaded on first use. Without it, the bundled
    /// miniature Z-Image runs (`bundled:qwen-image` names the other): random weights, for
    /// checking an install.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Transformer weights from one .safetensors or .gguf file (ComfyUI or diffusers tensor names;
    /// a GGUF's Q8_0/Q4_0/Q4_K/Q6_K matrices and FP8 (float8_e4m3fn, optionally with ComfyUI's
    /// scale_weight) matrices stay quantized, on the CPU and on CUDA) instead of the model folder's
    /// transformer/ weights; its shapes must match transformer/config.json.
    #[arg(long, value_name = "FILE")]
    pub transformer: Option<PathBuf>,
    /// What to draw (may be empty, as in diffusers).
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// What to steer away from (used only with --guidance > 0; default "").
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// Image size WIDTHxHEIGHT in pixels (Z-Image: multiples of 16; Qwen-Image-2.1: of 32).
    /// Default: the model's (1024x1024).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<(usize, usize)>,
    /// Denoising steps (transformer forwards). Default: the model's (Z-Image-Turbo 8,
    /// Qwen-Image-2.1 40).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Classifier-free guidance scale. Z-Image: CFG runs above 0. Qwen-Image-2.1: true CFG runs
    /// above 1 and only with --negative-prompt. Default: the model's (no guidance).
    #[arg(long, visible_alias = "cfg-scale", value_parser = parse_guidance)]
    pub guidance: Option<f32>,
    /// Seed of the initial latent. Default: drawn at random, printed and recorded in the PNG.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Where to write the image, in the format its extension names: .png (with the prompt, seed
    /// and settings as text chunks), .jpg/.jpeg (quality 95, over white: JPEG has no alpha) or
    /// .webp (lossless). With --num-images above 1, image i goes to STEM-i.EXT (seed + i).
    #[arg(long, short, default_value = "image.png")]
    pub out: PathBuf,
    /// Images to make from the prompt, seeds --seed, --seed + 1, …, denoised together as one
    /// batch (which shares the per-request work; at 1024² on a GPU the products are already at
    /// full speed for one image, so a batch is barely faster per image there).
    #[arg(long, short = 'n', default_value_t = 1)]
    pub num_images: usize,
    /// Start from this latent instead of the seeded one: a float32 .npy array in the shape the
    /// diffusers pipeline's `latents=` takes, e.g. Z-Image [1, 16, HEIGHT/8, WIDTH/8],
    /// Qwen-Image-2.1 [1, HEIGHT/16 · WIDTH/16, 64] (the leading 1 may be left out).
    #[arg(long, value_name = "FILE")]
    pub init_latent: Option<PathBuf>,
    /// Edit instead of drawing from text alone: a condition image (PNG, JPEG, WebP, GIF or BMP;
    /// transparency is kept), repeated for up to 10 images in the order the prompt refers to
    /// them ("image 1", "image 2", …). Qwen-Image-2.1 only. Without --size the output takes the
    /// last image's aspect at about --output-resolution² pixels.
    #[arg(long = "image", value_name = "FILE")]
    pub images: Vec<PathBuf>,
    /// With --image: condition images are resized to about this many pixels squared, keeping
    /// their aspect (and so is the output without --size). Default 1024.
    #[arg(long, value_name = "PIXELS")]
    pub output_resolution: Option<usize>,
    /// For models that make RGBA images (Qwen-Image-2.1): keep the alpha channel
    /// (`transparent`, an RGBA PNG or WebP) or composite over white (`white`, RGB; always so
    /// for JPEG).
    #[arg(long, value_enum, default_value_t = Background::Transparent)]
    pub background: Background,
    #[command(flatten)]
    pub offload: Offload,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `--offload`, shared by `tessera generate` and `tessera bench generate` (the server keeps every
/// component resident).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Offload {
    /// Keep only the running component on the device: the text encoder, the transformer and the
    /// VAE decoder (and an edit's vision tower and VAE encoder, beside the text encoder) are
    /// each read from their files when their stage runs and dropped after it, so the peak of
    /// device memory is the largest component with its activations instead of all of them
    /// (with --quantize q4_k too: Qwen-Image-2.1 for cards of about 12 GB). Every image re-reads
    /// the weights: the same time for one image from the command line, slower for repeated
    /// runs. The image is the same.
    #[arg(long)]
    pub offload: bool,
}

impl Offload {
    pub fn residency(self) -> Residency {
        if self.offload {
            Residency::Sequential
        } else {
            Residency::Resident
        }
    }
}

/// What happens to an RGBA image's alpha channel.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Background {
    /// Keep it: an RGBA PNG, straight (not premultiplied) alpha as the pipeline returns it.
    Transparent,
    /// Composite over opaque white: an RGB PNG.
    White,
}

/// The file format of an output, from its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    Jpeg,
    WebP,
}

impl Format {
    /// The format `path`'s extension names: `.png` (or none, e.g. `/dev/stdout`), `.jpg`/`.jpeg`
    /// or `.webp`, in any case; any other extension is refused rather than written as a PNG under
    /// a name that says otherwise.
    pub fn of(path: &Path) -> Result<Self> {
        let Some(ext) = path.extension() else {
            return Ok(Format::Png);
        };
        match ext.to_string_lossy().to_ascii_lowercase().as_str() {
            "png" => Ok(Format::Png),
            "jpg" | "jpeg" => Ok(Format::Jpeg),
            "webp" => Ok(Format::WebP),
            other => Err(Error::input(format!(
                "--out {}: cannot write .{other} images; name a .png, .jpg, .jpeg or .webp file",
                path.display()
            ))),
        }
    }
}

/// JPEG quality: visually lossless for generated images, a fifth of the PNG's size.
const JPEG_QUALITY: u8 = 95;

/// `WIDTHxHEIGHT`.
pub(crate) fn parse_size(s: &str) -> std::result::Result<(usize, usize), String> {
    let (w, h) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?}: expected WIDTHxHEIGHT, e.g. 1024x1024"))?;
    let n = |v: &str| {
        v.trim()
            .parse::<usize>()
            .map_err(|_| format!("{s:?}: {v:?} is not a whole number"))
    };
    Ok((n(w)?, n(h)?))
}

/// How temporary files are named: `.tessera-XXXXXX.png.part` beside the output (`XXXXXX`
/// random letters and digits). A later run removes leftovers of this pattern (see
/// [`remove_leftovers`]).
const TMP_PREFIX: &str = ".tessera-";
const TMP_SUFFIX: &str = ".png.part";
const TMP_RANDOM: usize = 6;
/// A leftover younger than this is never removed: its run may not have locked it yet.
const LEFTOVER_AGE: Duration = Duration::from_secs(60);

/// The temporary files a signal must remove (one per image), each held from its creation until
/// it is renamed into place; the signal thread takes the lock, so a rename and a removal never
/// interleave.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn pending() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    PENDING.lock().unwrap_or_else(|p| p.into_inner())
}

/// The output, claimed before any work.
struct Output {
    /// As the user gave it, for messages.
    path: PathBuf,
    target: Target,
}

enum Target {
    /// A regular file or a new path: the PNG goes to a temporary file in the same folder,
    /// renamed over `dest` at the end, so a failed or interrupted run leaves nothing
    /// half-written. The file is locked while this run owns it.
    Atomic {
        dest: PathBuf,
        tmp: tempfile::NamedTempFile,
    },
    /// Anything else (a device such as /dev/null, a FIFO): written through, as `embed -o`
    /// writes, so that it stays what it is instead of being replaced by a regular file.
    Through(std::fs::File),
}

impl Output {
    fn claim(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Err(Error::input(format!(
                "--out {}: is a folder; give a file name",
                path.display()
            )));
        }
        let meta = match std::fs::symlink_metadata(path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(path, e)),
        };
        let dest = match &meta {
            // A symbolic link: the file it points to is replaced, the link stays.
            Some(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).map_err(|e| {
                let why = format!(
                    "a symbolic link that cannot be followed ({e}); give the file's own path"
                );
                Error::io(path, std::io::Error::new(e.kind(), why))
            })?,
            _ => path.to_path_buf(),
        };
        let regular_or_new = match std::fs::metadata(&dest) {
            Ok(m) => m.is_file(),
            Err(_) => meta.is_none(),
        };
        let target = if regular_or_new {
            Target::Atomic {
                tmp: temporary_beside(path, &dest)?,
                dest,
            }
        } else {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&dest)
                .map_err(|e| Error::io(path, e))?;
            Target::Through(file)
        };
        Ok(Output {
            path: path.to_path_buf(),
            target,
        })
    }

    fn write(self, image: &Image, text: &[(&str, String)], format: Format) -> Result<()> {
        let path = &self.path;
        let io = |e: String| Error::io(path, std::io::Error::other(e));
        let file: &std::fs::File = match &self.target {
            Target::Atomic { tmp, .. } => tmp.as_file(),
            Target::Through(f) => f,
        };
        let mut out = std::io::BufWriter::new(file);
        match format {
            Format::Png => encode_png(&mut out, image, text).map_err(|e| io(e.to_string()))?,
            Format::Jpeg | Format::WebP => {
                encode_other(&mut out, image, format).map_err(|e| io(e.to_string()))?
            }
        }
        std::io::Write::flush(&mut out).map_err(|e| Error::io(path, e))?;
        drop(out);
        if let Target::Atomic { dest, tmp } = self.target {
            let mut pending = pending();
            let tmp_path = tmp.path().to_path_buf();
            tmp.persist(&dest).map_err(|e| Error::io(path, e.error))?;
            pending.retain(|p| *p != tmp_path);
        }
        Ok(())
    }
}

/// `image` as an 8-bit RGB or RGBA PNG with `text` as UTF-8 (iTXt) chunks, into `out`.
pub fn encode_png(
    out: impl std::io::Write,
    image: &Image,
    text: &[(&str, String)],
) -> std::result::Result<(), png::EncodingError> {
    let mut enc = png::Encoder::new(out, image.width as u32, image.height as u32);
    enc.set_color(if image.has_alpha() {
        png::ColorType::Rgba
    } else {
        png::ColorType::Rgb
    });
    enc.set_depth(png::BitDepth::Eight);
    // fdeflate's PNG-tuned mode: a 1024² image in milliseconds (the default level took ~100 ms,
    // as long as a GPU generation's decode), files a little larger.
    enc.set_compression(png::Compression::Fast);
    for (k, v) in text {
        // iTXt holds UTF-8 (tEXt is Latin-1 only, and prompts are often not).
        enc.add_itxt_chunk(k.to_string(), v.clone())?;
    }
    let mut w = enc.write_header()?;
    w.write_image_data(&image.pixels)?;
    w.finish()
}

/// `image` as a JPEG (RGB: an alpha channel is composited over white first) or a lossless WebP
/// into `out`; neither carries the PNG's text chunks.
fn encode_other(
    out: impl std::io::Write,
    image: &Image,
    format: Format,
) -> std::result::Result<(), ::image::ImageError> {
    use ::image::ExtendedColorType;
    use ::image::codecs::{jpeg::JpegEncoder, webp::WebPEncoder};
    let (w, h) = (image.width as u32, image.height as u32);
    match format {
        Format::Jpeg => {
            let rgb = image.over_white();
            JpegEncoder::new_with_quality(out, JPEG_QUALITY).encode(
                &rgb.pixels,
                w,
                h,
                ExtendedColorType::Rgb8,
            )
        }
        _ => {
            let color = if image.has_alpha() {
                ExtendedColorType::Rgba8
            } else {
                ExtendedColorType::Rgb8
            };
            WebPEncoder::new_lossless(out).encode(&image.pixels, w, h, color)
        }
    }
}

/// A locked temporary file in `dest`'s folder, registered for removal on SIGINT/SIGTERM;
/// leftovers of killed runs found there are removed first.
fn temporary_beside(path: &Path, dest: &Path) -> Result<tempfile::NamedTempFile> {
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut builder = tempfile::Builder::new();
    builder
        .prefix(TMP_PREFIX)
        .suffix(TMP_SUFFIX)
        .rand_bytes(TMP_RANDOM);
    // A normal file once renamed (the umask applies), not the 0600 of temporary files.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let mut pending = pending();
    let tmp = builder.tempfile_in(&parent).map_err(|e| {
        let cause = match e.kind() {
            std::io::ErrorKind::NotFound => "no such folder".to_string(),
            std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
            other => other.to_string(),
        };
        let why = format!("cannot create a file in {}: {cause}", parent.display());
        Error::io(path, std::io::Error::new(e.kind(), why))
    })?;
    // Held until this process ends, however it ends: a later run that can take the lock
    // knows the file is abandoned. Where the file system has no locks, no later run can take
    // one either, and nothing is removed: failing here would gain nothing.
    let _ = tmp.as_file().try_lock();
    pending.push(tmp.path().to_path_buf());
    drop(pending);
    remove_leftovers(&parent, tmp.path());
    Ok(tmp)
}

/// Whether `name` is one of our temporary files: `.tessera-` + 6 letters or digits + `.png.part`.
fn is_temporary_name(name: &str) -> bool {
    name.strip_prefix(TMP_PREFIX)
        .and_then(|r| r.strip_suffix(TMP_SUFFIX))
        .is_some_and(|r| r.len() == TMP_RANDOM && r.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// Remove the temporary files that runs killed beyond cleaning up (SIGKILL, a power cut) left in
/// `dir`. Only files of our own name pattern are touched, only regular files owned by the same
/// user as `ours`, at least [`LEFTOVER_AGE`] old, and only when no process holds their lock (a
/// run in progress always does). Failures are ignored: this is tidying, not the job.
fn remove_leftovers(dir: &Path, ours: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    #[cfg(unix)]
    let owner = {
        use std::os::unix::fs::MetadataExt;
        match std::fs::metadata(ours) {
            Ok(m) => m.uid(),
            Err(_) => return,
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path == ours || !name.to_str().is_some_and(is_temporary_name) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        #[cfg(unix)]
        if std::os::unix::fs::MetadataExt::uid(&meta) != owner {
            continue;
        }
        let old = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= LEFTOVER_AGE);
        if !meta.is_file() || !old {
            continue;
        }
        let abandoned = std::fs::File::open(&path).is_ok_and(|f| f.try_lock().is_ok());
        if abandoned && std::fs::remove_file(&path).is_ok() {
            eprintln!(
                "note: removed {}, left by an interrupted run",
                path.display()
            );
        }
    }
}

/// On SIGINT or SIGTERM, remove the pending temporary file and exit (130 or 143, as a shell
/// reports a process killed by the signal).
fn remove_on_signal() -> Result<()> {
    let failed = |e: std::io::Error| Error::io("<signal handler>", e);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(failed)?;
    let signal = {
        let _in_runtime = rt.enter();
        crate::signals::interrupted().map_err(failed)?
    };
    std::thread::Builder::new()
        .name("tessera-signals".into())
        .spawn(move || {
            let code = rt.block_on(signal);
            for p in pending().iter() {
                let _ = std::fs::remove_file(p);
            }
            std::process::exit(code);
        })
        .map_err(failed)?;
    Ok(())
}

/// A one-line warning when the denoiser alone would keep the CPU busy for an hour or more, at
/// an optimistic 50 GFLOP/s per core. The VAE comes on top, so the real time is longer.
fn cpu_time_warning(
    (width, height): (usize, usize),
    steps: usize,
    flops: f64,
    cores: usize,
) -> Option<String> {
    cpu_hours(flops, cores).map(|hours| {
        format!(
            "a {width}x{height} image in {steps} steps is about {:.0} TFLOP for the denoiser alone: on {cores} CPU cores that is {hours:.1} hours or more",
            flops / 1e12
        )
    })
}

/// Hours of `flops` on `cores` cores, when they come to one or more.
fn cpu_hours(flops: f64, cores: usize) -> Option<f64> {
    const FLOPS_PER_CORE: f64 = 50e9;
    let hours = flops / (FLOPS_PER_CORE * cores.max(1) as f64) / 3600.0;
    (hours >= 1.0).then_some(hours)
}

/// The largest guidance scale accepted. Useful scales are single digits; far beyond this the
/// guided velocity is noise amplified (and near `f32::MAX` it overflows to infinity).
const MAX_GUIDANCE: f32 = 100.0;

/// `--guidance`: a number from 0 to [`MAX_GUIDANCE`], checked as the flag is parsed (the
/// model checks its own rule later).
fn parse_guidance(s: &str) -> std::result::Result<f32, String> {
    let g: f32 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if g.is_finite() && (0.0..=MAX_GUIDANCE).contains(&g) {
        Ok(g)
    } else {
        Err(format!(
            "{g}: use a scale from 0 to {MAX_GUIDANCE} (0 or 1 means no guidance)"
        ))
    }
}

/// A seed for a run without `--seed`: 32 bits, short enough to read back and type.
fn random_seed() -> Result<u64> {
    getrandom::u32().map(u64::from).map_err(|e| {
        Error::input(format!(
            "could not draw a random seed ({e}); give one with --seed"
        ))
    })
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let started = Instant::now();
    let format = Format::of(&args.out)?;
    let seed = match args.seed {
        Some(s) => s,
        None => random_seed()?,
    };
    remove_on_signal()?;
    let paths = output_paths(&args.out, args.num_images);
    let outs = paths
        .iter()
        .map(|p| Output::claim(p))
        .collect::<Result<Vec<_>>>()?;
    // The header now (a wrong file fails before the model loads), the data once its shape is
    // the one the model wants.
    let init = args
        .init_latent
        .as_deref()
        .map(npy::Npy::open)
        .transpose()?;
    let edit = condition_images(&args.images, args.output_resolution)?;
    let spec = spec_for(
        model::open(args.model.as_deref(), Capability::GenerateImage)?,
        edit.as_ref(),
    )?;
    if spec.is_bundled() {
        let which = match &args.model {
            None => "no --model given: using the bundled miniature",
            Some(_) => "the bundled miniature",
        };
        eprintln!(
            "note: {which} {} (random weights: the image is structured noise, for checking an install)",
            spec.family.name()
        );
    }
    let stored = match &args.transformer {
        Some(p) => stored_block_format(p)?,
        None => None,
    };
    let backend = args.device.open_for_stored(&spec, stored)?;
    let on_cpu = matches!(backend, AnyBackend::Cpu(_));
    let label = spec.label.clone();
    let residency = args.offload.residency();
    let mut model = image::open_as(backend, &spec, args.transformer.as_deref(), residency)?;
    let defaults = model.defaults();
    let (width, height) = output_size(model.as_ref(), args.size, edit.as_ref())?;
    let mut req = Request {
        negative_prompt: args.negative_prompt.clone(),
        width,
        height,
        steps: args.steps.unwrap_or(defaults.steps),
        guidance: args.guidance.unwrap_or(defaults.guidance),
        seed,
        num_images: args.num_images,
        edit,
        ..Request::new(args.prompt.clone(), defaults)
    };
    if let Some(npy) = init {
        let shape = npy.shape().to_vec();
        let want = model.latent_shape(width, height);
        let batch_of_one = shape.len() == want.len() + 1 && shape[0] == 1 && shape[1..] == want;
        if shape != want && !batch_of_one {
            let dims: Vec<String> = want.iter().map(usize::to_string).collect();
            return Err(Error::input(format!(
                "--init-latent has shape {shape:?}; a {width}x{height} image needs [1, {}]",
                dims.join(", ")
            )));
        }
        req.init_latent = Some(npy.read()?);
    }
    let checked = model.check(&req)?;
    for w in &checked.warnings {
        eprintln!("warning: {w}");
    }
    if on_cpu {
        let cores = rayon::current_num_threads();
        if let Some(w) = cpu_time_warning(
            (width, height),
            checked.steps,
            checked.denoiser_flops,
            cores,
        ) {
            eprintln!("warning: {w}");
        }
    }

    let mut progress = Progress::new(checked.steps)?;
    let images = model.generate(&req, &mut |e| {
        progress.event(e);
        ControlFlow::Continue(())
    })?;
    let stages = progress.finish();

    let mut text = vec![
        ("prompt", args.prompt.clone()),
        ("size", format!("{width}x{height}")),
        ("steps", req.steps.to_string()),
        ("guidance", req.guidance.to_string()),
        ("model", label),
        ("software", format!("tessera {}", env!("CARGO_PKG_VERSION"))),
    ];
    if !args.images.is_empty() {
        let names: Vec<String> = args
            .images
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        text.push(("images", names.join("\n")));
    }
    if checked.guided {
        text.push((
            "negative_prompt",
            args.negative_prompt.clone().unwrap_or_default(),
        ));
    }
    for (i, (out, image)) in outs.into_iter().zip(&images).enumerate() {
        let mut text = text.clone();
        match &args.init_latent {
            Some(p) => text.push(("init_latent", p.display().to_string())),
            None => text.push(("seed", seed.wrapping_add(i as u64).to_string())),
        }
        let image = match args.background {
            Background::White => image.over_white(),
            Background::Transparent => image.clone(),
        };
        out.write(&image, &text, format)?;
    }
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let seeded = match (&args.init_latent, args.num_images) {
        (Some(_), _) => String::new(),
        (None, 1) => format!(", seed {seed}"),
        (None, n) => format!(", seeds {seed}..{}", seed.wrapping_add(n as u64 - 1)),
    };
    let residency = residency.suffix();
    eprintln!(
        "wrote {} ({width}x{height}, {} steps{seeded}) in {:.1} s ({stages}){residency}",
        shown.join(", "),
        req.steps,
        started.elapsed().as_secs_f64()
    );
    if args.seed.is_none() && args.init_latent.is_none() {
        eprintln!("note: the seed was drawn at random; --seed {seed} makes the same image again");
    }
    Ok(())
}

/// The edit `--image` asks for, its images read and decoded before the model loads; `None`
/// without `--image`. `tessera bench generate --image` reads its images here too.
pub(crate) fn condition_images(
    paths: &[PathBuf],
    output_resolution: Option<usize>,
) -> Result<Option<Edit>> {
    if paths.is_empty() {
        if output_resolution.is_some() {
            eprintln!("warning: --output-resolution applies to edits (--image) only; ignored");
        }
        return Ok(None);
    }
    if paths.len() > MAX_EDIT_IMAGES {
        return Err(Error::input(format!(
            "--image given {} times: an edit takes at most {MAX_EDIT_IMAGES} condition images",
            paths.len()
        )));
    }
    let images = paths
        .iter()
        .map(|p| open_rgba(p).map_err(|e| Error::input(format!("--image {e}"))))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(Edit {
        images: images.into(),
        output_resolution: output_resolution.unwrap_or(OUTPUT_RESOLUTION),
    }))
}

/// The model spec for a run with or without an edit: editing adds the vision tower's and the
/// VAE encoder's ops, so a device that lacks them declines before loading.
pub(crate) fn spec_for(spec: ModelSpec, edit: Option<&Edit>) -> Result<ModelSpec> {
    match edit {
        Some(_) => spec.for_editing(),
        None => Ok(spec),
    }
}

/// The output size of a run: `--size`, else an edit's (the last condition image's aspect), else
/// the model's default; an edit is refused here by a model that cannot edit on its device.
pub(crate) fn output_size(
    model: &dyn GenerateImage,
    size: Option<(usize, usize)>,
    edit: Option<&Edit>,
) -> Result<(usize, usize)> {
    if edit.is_some() {
        model.can_edit()?;
    }
    match (size, edit) {
        (Some(size), _) => Ok(size),
        (None, Some(e)) => model.edit_size(e),
        (None, None) => Ok(model.defaults().size),
    }
}

/// The progress of one generation on stderr: the prompt encoding, a bar of denoising steps with
/// elapsed time and ETA that keeps ticking within a long step, then the VAE decode as its own
/// stage. indicatif draws nothing when stderr is not a terminal; the stage times are kept for
/// the summary line either way.
struct Progress {
    bar: ProgressBar,
    started: Instant,
    /// When the current stage (or step) began.
    last: Instant,
    encode: Duration,
    denoise: Duration,
}

/// How often a bar redraws by itself, so that its clock moves within a step of many seconds.
const TICK: Duration = Duration::from_millis(200);

impl Progress {
    fn new(steps: usize) -> Result<Self> {
        let bar = ProgressBar::new(steps as u64)
            .with_style(Self::style("{spinner} {msg} [{elapsed_precise}]")?);
        bar.set_message("encoding the prompt");
        bar.enable_steady_tick(TICK);
        let now = Instant::now();
        Ok(Progress {
            bar,
            started: now,
            last: now,
            encode: Duration::ZERO,
            denoise: Duration::ZERO,
        })
    }

    fn style(template: &str) -> Result<ProgressStyle> {
        Ok(ProgressStyle::with_template(template)
            .map_err(|e| Error::input(e.to_string()))?
            .progress_chars("=> "))
    }

    fn event(&mut self, e: Event<'_>) {
        match e {
            Event::Encoded => {
                self.encode = self.started.elapsed();
                if let Ok(style) = Self::style(
                    "denoising [{bar:30}] {pos}/{len} steps [{elapsed_precise}, ETA {eta}] {prefix}",
                ) {
                    self.bar.set_style(style);
                }
                self.bar.reset_elapsed();
                self.last = Instant::now();
            }
            Event::Step { .. } => {
                let ms = self.last.elapsed().as_secs_f64() * 1e3;
                self.bar.set_prefix(format!("{ms:.0} ms/step"));
                self.bar.inc(1);
                self.last = Instant::now();
            }
            Event::Decoding => {
                self.denoise = self.started.elapsed() - self.encode;
                if let Ok(style) = Self::style("{spinner} decoding (VAE) [{elapsed_precise}]") {
                    self.bar.set_style(style);
                }
                self.bar.reset_elapsed();
                // Drawn now, not at the next tick: a short decode would otherwise never show.
                self.bar.tick();
                self.last = Instant::now();
            }
            // The encoding's parts: the summary line gives the encoding as one stage.
            Event::Stage(_) => {}
        }
    }

    /// Clear the bar and say how long each stage took.
    fn finish(self) -> String {
        self.bar.finish_and_clear();
        let decode = self.started.elapsed() - self.encode - self.denoise;
        format!(
            "encode {:.1} s, denoise {:.1} s, decode {:.1} s",
            self.encode.as_secs_f64(),
            self.denoise.as_secs_f64(),
            decode.as_secs_f64()
        )
    }
}

/// Where `n` images go: `out` itself for one, `STEM-i.EXT` beside it for several.
fn output_paths(out: &Path, n: usize) -> Vec<PathBuf> {
    if n <= 1 {
        return vec![out.to_path_buf()];
    }
    let stem = out
        .file_stem()
        .map_or_else(|| "image".to_string(), |s| s.to_string_lossy().into_owned());
    let ext = out
        .extension()
        .map_or_else(|| "png".to_string(), |e| e.to_string_lossy().into_owned());
    (0..n)
        .map(|i| out.with_file_name(format!("{stem}-{i}.{ext}")))
        .collect()
}

/// The quantized format of a transformer file's weights (the first quantized tensor's), read
/// from its header, so a device without products on it declines before loading: a GGUF's block
/// format, or FP8 in a safetensors file; `None` for float weights.
fn stored_block_format(path: &std::path::Path) -> Result<Option<tessera_core::DType>> {
    if !path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let w = tessera_core::Weights::open_file(path)?;
        let fp8 = w
            .names()
            .into_iter()
            .any(|n| w.tensor(n).is_ok_and(|t| t.dtype.is_quantized()));
        return Ok(fp8.then_some(tessera_core::DType::F8_E4M3));
    }
    let g = tessera_core::gguf::Gguf::open(path)?;
    Ok(g.tensors()
        .map(|t| tessera_core::DType::from_ggml(t.ggml_type))
        .find(|d| d.is_quantized()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transformer file's quantized format is read from its header: FP8 in a scaled
    /// safetensors file, Q8_0 in a GGUF, none in a bf16 file.
    #[test]
    fn the_stored_format_of_a_transformer_file() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for (file, want) in [
            (
                "transformer_fp8/zimage_fp8_scaled.safetensors",
                Some(tessera_core::DType::F8_E4M3),
            ),
            (
                "transformer_gguf/zimage_q8_0.gguf",
                Some(tessera_core::DType::Q8_0),
            ),
            ("zimage/comfy_transformer.safetensors", None),
        ] {
            assert_eq!(
                stored_block_format(&fixtures.join(file)).unwrap(),
                want,
                "{file}"
            );
        }
    }

    #[test]
    fn sizes_parse_as_width_by_height() {
        assert_eq!(parse_size("1280x720"), Ok((1280, 720)));
        assert_eq!(parse_size("64X48"), Ok((64, 48)));
        assert!(parse_size("1024").unwrap_err().contains("WIDTHxHEIGHT"));
        assert!(
            parse_size("axb")
                .unwrap_err()
                .contains("not a whole number")
        );
    }

    #[test]
    fn guidance_is_checked_as_it_is_parsed() {
        assert_eq!(parse_guidance("4"), Ok(4.0));
        for bad in ["1e30", "NaN", "inf", "-1", "x"] {
            assert!(parse_guidance(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_format_follows_the_extension_and_others_are_refused() {
        for (name, want) in [
            ("a.png", Format::Png),
            ("a.PNG", Format::Png),
            ("a.jpg", Format::Jpeg),
            ("a.JPEG", Format::Jpeg),
            ("a.webp", Format::WebP),
            ("/dev/null", Format::Png),
        ] {
            assert_eq!(Format::of(Path::new(name)).unwrap(), want, "{name}");
        }
        for bad in ["a.gif", "a.png.txt", "a.tiff"] {
            let e = Format::of(Path::new(bad)).unwrap_err().to_string();
            assert!(e.contains(".png, .jpg, .jpeg or .webp"), "{bad}: {e}");
        }
    }

    #[test]
    fn temporary_names_are_recognised_exactly() {
        assert!(is_temporary_name(".tessera-a1B2c3.png.part"));
        for other in [
            ".tessera-a1B2c3.png",
            ".tessera-a1B2c.png.part",
            ".tessera-a1B2c3d.png.part",
            ".tessera-a1B/c3.png.part",
            "tessera-a1B2c3.png.part",
            "x.png",
        ] {
            assert!(!is_temporary_name(other), "{other}");
        }
    }

    #[test]
    fn a_cpu_run_of_hours_is_announced() {
        // 440 TFLOP (Z-Image-Turbo at 1024², 8 steps) on 2 cores: over an hour.
        assert!(cpu_hours(440e12, 2).is_some_and(|h| h > 1.0));
        assert!(cpu_hours(440e12 / 16.0, 64).is_none());
        assert!(
            cpu_time_warning((1024, 1024), 8, 440e12, 2).is_some_and(|w| w.contains("440 TFLOP"))
        );
    }
}
