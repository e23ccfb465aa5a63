//! `tessera generate`: text to image with Z-Image-Turbo (or the base Z-Image), written as a PNG
//! whose text chunks record the prompt, seed, steps, size and model.
//!
//! Everything that can be refused is refused before the model runs: the output file is created
//! (as a hidden temporary file next to it, renamed into place at the end, so a failed run leaves
//! nothing half-written), the initial latent is read and the request is checked.

mod npy;

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tessera_core::{Error, Result};
use tessera_models::zimage::pipeline::{DEFAULT_GUIDANCE, DEFAULT_STEPS};
use tessera_models::zimage::{Event, Request, RgbImage};
use tessera_runtime::{Capability, image};

use crate::device::DeviceArgs;
use crate::model;

/// Generate an image from a prompt (Z-Image).
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Z-Image-Turbo wants the defaults (8 steps, no guidance). The base Z-Image \
model wants about --steps 50 --guidance 4. The initial latent is drawn from --seed with Tessera's own \
generator (SplitMix64 + Box-Muller, the same on every machine); it is not torch's randn, so to \
reproduce a diffusers image pass its latent with --init-latent."
)]
pub struct GenerateArgs {
    /// A Z-Image folder in the diffusers layout (model_index.json + component folders) or a
    /// Hugging Face repo id in the local cache. Without it, the bundled miniature model runs: random
    /// weights, for checking an install.
    #[arg(long)]
    pub model: Option<String>,
    /// Transformer weights from one .safetensors file (ComfyUI or diffusers tensor names) instead
    /// of the model folder's transformer/ weights; its shapes must match transformer/config.json.
    #[arg(long, value_name = "FILE")]
    pub transformer: Option<PathBuf>,
    /// What to draw.
    #[arg(long)]
    pub prompt: String,
    /// What to steer away from (used only with --guidance > 0; default "").
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// Image size WIDTHxHEIGHT in pixels, each a multiple of 16.
    #[arg(long, default_value = "1024x1024", value_parser = parse_size)]
    pub size: (usize, usize),
    /// Denoising steps (transformer forwards).
    #[arg(long, default_value_t = DEFAULT_STEPS)]
    pub steps: usize,
    /// Classifier-free guidance scale; 0 turns CFG off.
    #[arg(long, default_value_t = DEFAULT_GUIDANCE)]
    pub guidance: f32,
    /// Seed of the initial latent.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write the PNG.
    #[arg(long, short, default_value = "image.png")]
    pub out: PathBuf,
    /// Start from this latent instead of the seeded one: a float32 .npy array of shape
    /// [1, 16, HEIGHT/8, WIDTH/8] (or without the leading 1), e.g. diffusers' `latents`.
    #[arg(long, value_name = "FILE")]
    pub init_latent: Option<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `WIDTHxHEIGHT`.
fn parse_size(s: &str) -> std::result::Result<(usize, usize), String> {
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

/// The output file, claimed before any work: a temporary file in the target folder, persisted
/// under the final name once the image is written.
struct Output {
    path: PathBuf,
    tmp: tempfile::NamedTempFile,
}

impl Output {
    fn claim(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Err(Error::input(format!(
                "--out {}: is a folder; give a file name",
                path.display()
            )));
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut builder = tempfile::Builder::new();
        builder.prefix(".tessera-").suffix(".png.part");
        // A normal file once renamed (the umask applies), not the 0600 of temporary files.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let tmp = builder.tempfile_in(&parent).map_err(|e| {
            let cause = match e.kind() {
                std::io::ErrorKind::NotFound => "no such folder".to_string(),
                std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
                other => other.to_string(),
            };
            let why = format!("cannot create a file in {}: {cause}", parent.display());
            Error::io(path, std::io::Error::new(e.kind(), why))
        })?;
        Ok(Output {
            path: path.to_path_buf(),
            tmp,
        })
    }

    fn write(self, image: &RgbImage, text: &[(&str, String)]) -> Result<()> {
        let io =
            |e: png::EncodingError| Error::io(&self.path, std::io::Error::other(e.to_string()));
        {
            let file = std::io::BufWriter::new(self.tmp.as_file());
            let mut enc = png::Encoder::new(file, image.width as u32, image.height as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            for (k, v) in text {
                // iTXt holds UTF-8 (tEXt is Latin-1 only, and prompts are often not).
                enc.add_itxt_chunk(k.to_string(), v.clone()).map_err(io)?;
            }
            let mut w = enc.write_header().map_err(io)?;
            w.write_image_data(&image.pixels).map_err(io)?;
            w.finish().map_err(io)?;
        }
        self.tmp
            .persist(&self.path)
            .map_err(|e| Error::io(&self.path, e.error))?;
        Ok(())
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let started = Instant::now();
    let out = Output::claim(&args.out)?;
    let init = args.init_latent.as_deref().map(npy::read_f32).transpose()?;
    let spec = model::open(args.model.as_deref(), Capability::GenerateImage)?;
    if spec.is_bundled() {
        eprintln!(
            "note: no --model given: using the bundled miniature Z-Image (random weights: the image is structured noise, for checking an install)"
        );
    }
    let backend = args.device.open_for(&spec)?;
    let label = spec.label.clone();
    let mut model = image::load(
        backend,
        &model::image_files(&spec)?,
        args.transformer.as_deref(),
    )?;
    let (width, height) = args.size;
    let mut req = Request {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        width,
        height,
        steps: args.steps,
        guidance: args.guidance,
        seed: args.seed,
        init_latent: None,
        shift: None,
    };
    if let Some((shape, values)) = init {
        let want = model.latent_shape(width, height);
        let batch_of_one = shape.len() == 4 && shape[0] == 1 && shape[1..] == want;
        if shape != want && !batch_of_one {
            return Err(Error::input(format!(
                "--init-latent has shape {shape:?}; a {width}x{height} image needs [1, {}, {}, {}]",
                want[0], want[1], want[2]
            )));
        }
        req.init_latent = Some(values);
    }
    let plan = model.plan(&req)?;
    for w in &plan.warnings {
        eprintln!("warning: {w}");
    }

    let bar = ProgressBar::new(plan.schedule.steps() as u64).with_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} steps {elapsed_precise}")
            .map_err(|e| Error::input(e.to_string()))?
            .progress_chars("=> "),
    );
    bar.set_message("encoding");
    let image = model.generate(&req, &plan, &mut |e| match e {
        Event::Encoded => bar.set_message("denoising"),
        Event::Step { .. } => bar.inc(1),
        Event::Decoding => bar.set_message("decoding"),
    })?;
    bar.finish_and_clear();

    let mut text = vec![
        ("prompt", args.prompt.clone()),
        ("size", format!("{width}x{height}")),
        ("steps", args.steps.to_string()),
        ("guidance", args.guidance.to_string()),
        ("model", label),
        ("software", format!("tessera {}", env!("CARGO_PKG_VERSION"))),
    ];
    match &args.init_latent {
        Some(p) => text.push(("init_latent", p.display().to_string())),
        None => text.push(("seed", args.seed.to_string())),
    }
    if req.cfg() {
        text.push((
            "negative_prompt",
            args.negative_prompt.clone().unwrap_or_default(),
        ));
    }
    out.write(&image, &text)?;
    eprintln!(
        "wrote {} ({width}x{height}, {} steps) in {:.1} s",
        args.out.display(),
        args.steps,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

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
}
