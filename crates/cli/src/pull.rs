//! `tessera pull REPO[:REVISION]`, and the download on first use of a `--model` repo id that is
//! not in the Hugging Face cache: the files the model needs ([`tessera_core::hub`]), a progress
//! bar per file on stderr, the snapshot folder on stdout.

use std::path::Path;

use clap::Args;
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use tessera_core::hub::{Hub, Progress, Pulled};
use tessera_core::model_dir::{self, MODEL_MARKERS, RepoSpec};
use tessera_core::{Error, Result};

#[derive(Args)]
pub struct PullArgs {
    /// `owner/name`, then optionally `:REVISION` (branch, tag or commit) or `:QUANT` (which GGUF
    /// file of a repo holding several: `Q4_K_M`, `Q8_0`, … — default Q4_K_M if there is one, else
    /// the first by name). Honours HF_ENDPOINT, HF_TOKEN, HF_HOME / HF_HUB_CACHE and
    /// HF_HUB_OFFLINE.
    #[arg(value_name = "REPO[:REVISION]")]
    repo: String,
}

pub fn run(args: PullArgs) -> Result<()> {
    let spec = RepoSpec::parse(&args.repo).ok_or_else(|| {
        Error::input(format!(
            "{:?} is not a Hugging Face repo id (owner/name, optionally :REVISION or :QUANT)",
            args.repo
        ))
    })?;
    let pulled = pull(&spec)?;
    println!("{}", pulled.snapshot.display());
    Ok(())
}

/// Download what `spec` needs into the cache, saying what was done on stderr.
fn pull(spec: &RepoSpec) -> Result<Pulled> {
    let hub = Hub::from_env(&spec.repo)?;
    let pulled = hub.pull(spec, &mut Bars::default())?;
    let bytes: u64 = pulled.fetched.iter().map(|(_, n)| n).sum();
    eprintln!(
        "pulled {} at {}: {} files downloaded ({}), {} already cached → {}",
        spec.repo,
        &pulled.commit[..pulled.commit.len().min(12)],
        pulled.fetched.len(),
        HumanBytes(bytes),
        pulled.cached.len(),
        pulled.snapshot.display()
    );
    if !pulled.size_only.is_empty() {
        eprintln!(
            "warning: {} gave no checksum for {}; only the sizes were checked",
            hub.endpoint(),
            pulled.size_only.join(", ")
        );
    }
    Ok(pulled)
}

/// Download the repo `--model` names when it is a repo id not in the cache, unless
/// `HF_HUB_OFFLINE` is set (resolution then says it is not cached). Folders, `bundled:` names
/// and cached repos are left to the model resolution.
pub fn ensure_local(spec: Option<&str>) -> Result<()> {
    let Some(spec) = spec else { return Ok(()) };
    if spec.starts_with("bundled:") || Path::new(spec).exists() {
        return Ok(());
    }
    let Some(repo) = RepoSpec::parse(spec) else {
        return Ok(());
    };
    if model_dir::hub_offline()
        || model_dir::hf_hub_cache().is_none()
        || model_dir::cached_snapshot(&repo, &MODEL_MARKERS).is_some()
    {
        return Ok(());
    }
    eprintln!(
        "{spec} is not in the Hugging Face cache: downloading it (HF_HUB_OFFLINE=1 stops this)"
    );
    // `owner/name` may also have been meant as a folder: say that there is none.
    pull(&repo).map(|_| ()).map_err(|e| match e {
        Error::Hub { repo, message } => Error::Hub {
            repo,
            message: format!("{message} (nor is there a folder {spec})"),
        },
        other => other,
    })
}

/// One progress bar per file; indicatif draws nothing when stderr is not a terminal.
#[derive(Default)]
struct Bars {
    current: Option<(String, ProgressBar)>,
}

impl Progress for Bars {
    fn start(&mut self, file: &str, size: u64) {
        if let Some((f, bar)) = &self.current
            && f == file
        {
            // hf-hub starts again when it resumes a kept part, then counts that part.
            bar.set_length(size);
            bar.set_position(0);
            return;
        }
        let bar = ProgressBar::new(size);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(file.to_string());
        self.current = Some((file.to_string(), bar));
    }

    fn advance(&mut self, bytes: u64) {
        if let Some((_, bar)) = &self.current {
            bar.inc(bytes);
        }
    }

    fn finish(&mut self) {
        if let Some((_, bar)) = &self.current {
            bar.finish();
        }
    }
}
