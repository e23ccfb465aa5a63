//! Downloading a model from the Hugging Face hub into the local cache that [`crate::model_dir`]
//! reads (`models--owner--name/{blobs,snapshots,refs}`), as `huggingface_hub` lays it out.
//!
//! The HTTP is `hf-hub`'s blocking client (ureq with rustls: no OpenSSL to build against): the
//! repo listing (`/api/models/{repo}/revision/{rev}`), each file's metadata (etag, commit, size),
//! the download into `blobs/<etag>.part` continued with a `Range` request when a part is left
//! from an interrupted run, the snapshot link and `refs/<revision>`. What it does not do is
//! done here: it never checks what it downloaded, so [`verify`] compares each file with its
//! etag (SHA-256 for LFS files, the git blob SHA-1 for the rest) and deletes it on a mismatch;
//! it has no rule for which files a model needs ([`select`]); and it reads only `HF_HOME` and
//! `HF_ENDPOINT`, so the cache folder, `HF_TOKEN` and `HF_HUB_OFFLINE` are read here.
//! hf-hub 1.x is not used: it always builds the Xet storage client and an async HTTP stack,
//! many times this build on a 2-core CI machine.

pub mod select;
pub mod verify;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};
use crate::model_dir::{MODEL_MARKERS, RepoSpec, hf_hub_cache, hub_offline};

/// The hub used when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The most a JSON file read to plan a download (`model_index.json`, a shard index) may hold.
const MAX_PLAN_FILE: u64 = 64 << 20;

/// Told about each file as it downloads (a progress bar per file in the CLI).
pub trait Progress {
    /// A file starts; called again for the same file when a kept part is resumed, after which
    /// `advance` first counts the part already there.
    fn start(&mut self, file: &str, size: u64);
    fn advance(&mut self, bytes: u64);
    fn finish(&mut self);
}

/// No progress reports.
pub struct Silent;

impl Progress for Silent {
    fn start(&mut self, _: &str, _: u64) {}
    fn advance(&mut self, _: u64) {}
    fn finish(&mut self) {}
}

/// What a pull did.
#[derive(Debug)]
pub struct Pulled {
    /// The snapshot folder: what `--model` resolves the repo to.
    pub snapshot: PathBuf,
    pub commit: String,
    /// Files downloaded now, with their sizes.
    pub fetched: Vec<(String, u64)>,
    /// Files already in the snapshot.
    pub cached: Vec<String>,
    /// Files whose etag was no hash (a mirror's), checked by size only.
    pub size_only: Vec<String>,
}

/// The hub as the environment names it: `HF_ENDPOINT`, `HF_TOKEN` (else the token file of
/// `HF_TOKEN_PATH` or `HF_HOME`), and the cache folder of [`hf_hub_cache`].
pub struct Hub {
    endpoint: String,
    cache: PathBuf,
    api: Api,
}

fn env(key: &str) -> Option<String> {
    std::env::var(key)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `HF_TOKEN`, else the first line of `HF_TOKEN_PATH`, `HF_HOME/token` or
/// `~/.cache/huggingface/token` (where `hf auth login` writes it).
fn token() -> Option<String> {
    if let Some(t) = env("HF_TOKEN") {
        return Some(t);
    }
    let path = env("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| {
        env("HF_HOME")
            .map(PathBuf::from)
            .or_else(|| env("HOME").map(|h| Path::new(&h).join(".cache").join("huggingface")))
            .map(|h| h.join("token"))
    })?;
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| line.to_string())
}

impl Hub {
    /// The hub and cache the environment names. Fails when `HF_HUB_OFFLINE` is set or no cache
    /// folder can be found.
    pub fn from_env(repo: &str) -> Result<Self> {
        let err = |message: &str| Error::Hub {
            repo: repo.to_string(),
            message: message.to_string(),
        };
        if hub_offline() {
            return Err(err(
                "HF_HUB_OFFLINE is set, so nothing is downloaded: unset it to pull",
            ));
        }
        let cache = hf_hub_cache().ok_or_else(|| {
            err("no Hugging Face cache location (HF_HUB_CACHE, HF_HOME and HOME are unset)")
        })?;
        let endpoint = env("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let api = ApiBuilder::from_cache(Cache::new(cache.clone()))
            .with_endpoint(endpoint.clone())
            .with_token(token())
            .with_progress(false)
            .with_retries(2)
            .with_user_agent("tessera", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| err(&e.to_string()))?;
        Ok(Hub {
            endpoint,
            cache,
            api,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn cache(&self) -> &Path {
        &self.cache
    }

    /// Download the files of `spec` that Tessera needs ([`select`]) into the cache, skipping
    /// those already in the snapshot; each is checked against its etag. The root marker files
    /// (`config.json`, `model_index.json`) are linked last, so an interrupted pull never looks
    /// complete to [`crate::model_dir`].
    pub fn pull(&self, spec: &RepoSpec, progress: &mut dyn Progress) -> Result<Pulled> {
        let repo = self.api.repo(Repo::with_revision(
            spec.repo.clone(),
            RepoType::Model,
            spec.revision().to_string(),
        ));
        let info = repo
            .info()
            .map_err(|e| self.error(spec, None, &e, "listing the repo"))?;
        let commit = info.sha.trim().to_string();
        if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(self.fail(spec, format!("the hub gave the commit {commit:?}")));
        }
        let mut files = Vec::with_capacity(info.siblings.len());
        for s in info.siblings {
            if !safe_path(&s.rfilename) {
                return Err(self.fail(
                    spec,
                    format!(
                        "the repo lists the file {:?}, which is not a safe relative path",
                        s.rfilename
                    ),
                ));
            }
            files.push(s.rfilename);
        }
        let repo_dir = self.cache.join(spec.folder());
        let mut run = Run {
            hub: self,
            spec,
            repo: &repo,
            commit: &commit,
            snapshot: repo_dir.join("snapshots").join(&commit),
            blobs: repo_dir.join("blobs"),
            done: HashSet::new(),
            hidden: Vec::new(),
            pulled: Pulled {
                snapshot: repo_dir.join("snapshots").join(&commit),
                commit: commit.clone(),
                fetched: Vec::new(),
                cached: Vec::new(),
                size_only: Vec::new(),
            },
        };
        let mut plan = select::plan(&spec.repo, &files, spec.quant.as_deref(), &mut |f| {
            run.fetch(f, progress)?;
            run.read_plan_file(f)
        })?;
        // Root markers last: the snapshot is complete once they appear.
        plan.sort_by_key(|f| MODEL_MARKERS.contains(&f.as_str()));
        for f in &plan {
            run.fetch(f, progress)?;
        }
        run.unhide()?;
        if spec.revision.as_deref() == Some(commit.as_str()) {
            // hf-hub writes `refs/<revision>` even for a commit; the cache keeps refs for names.
            let _ = std::fs::remove_file(repo_dir.join("refs").join(&commit));
        }
        Ok(run.pulled)
    }

    fn fail(&self, spec: &RepoSpec, message: String) -> Error {
        Error::Hub {
            repo: spec.repo.clone(),
            message,
        }
    }

    /// An hf-hub error as one line that says what to do about it.
    fn error(&self, spec: &RepoSpec, file: Option<&str>, e: &ApiError, doing: &str) -> Error {
        let what = match file {
            Some(f) => format!("{f}: "),
            None => String::new(),
        };
        let rev = spec.revision();
        let message = match e {
            ApiError::RequestError(inner) => match inner.as_ref() {
                ureq::Error::StatusCode(401 | 403) => format!(
                    "{what}access denied by {} (the repo is gated or private): set HF_TOKEN to a token that may read it",
                    self.endpoint
                ),
                ureq::Error::StatusCode(404) => format!(
                    "{what}not found on {} at revision {rev}: check the repo id and revision",
                    self.endpoint
                ),
                ureq::Error::StatusCode(code) => {
                    format!(
                        "{what}{doing} failed: {} answered HTTP {code}",
                        self.endpoint
                    )
                }
                other => format!(
                    "{what}{doing} failed: {other} (is {} reachable? HF_HUB_OFFLINE=1 uses the cache alone)",
                    self.endpoint
                ),
            },
            other => format!("{what}{doing} failed: {other}"),
        };
        self.fail(spec, message)
    }
}

/// One pull's state.
struct Run<'a> {
    hub: &'a Hub,
    spec: &'a RepoSpec,
    repo: &'a ApiRepo,
    commit: &'a str,
    snapshot: PathBuf,
    blobs: PathBuf,
    /// Files fetched or found this run.
    done: HashSet<String>,
    /// Root markers fetched to plan, moved aside until the end.
    hidden: Vec<String>,
    pulled: Pulled,
}

impl Run<'_> {
    /// Download `file` into the snapshot unless it is there, and check it.
    fn fetch(&mut self, file: &str, progress: &mut dyn Progress) -> Result<()> {
        if !self.done.insert(file.to_string()) {
            return Ok(());
        }
        let dest = self.snapshot.join(file);
        if dest.is_file() {
            self.pulled.cached.push(file.to_string());
            return Ok(());
        }
        if dest.is_symlink() {
            // A link whose blob is gone: hf-hub would not replace it.
            std::fs::remove_file(&dest).map_err(|e| Error::io(&dest, e))?;
        }
        let hub = self.hub;
        let url = self.repo.url(file);
        let meta = hub
            .api
            .metadata(&url)
            .map_err(|e| hub.error(self.spec, Some(file), &e, "asking for the file"))?;
        if meta.commit_hash() != self.commit {
            return Err(hub.fail(
                self.spec,
                format!(
                    "{file}: the revision moved from commit {} to {} during the pull: run it again",
                    self.commit,
                    meta.commit_hash()
                ),
            ));
        }
        let etag = verify::clean_etag(meta.etag());
        if !safe_path(&etag) || etag.contains('/') {
            return Err(hub.fail(self.spec, format!("{file}: the hub gave the etag {etag:?}")));
        }
        let size = meta.size() as u64;
        let blob = self.blobs.join(&etag);
        let part = blob.with_extension("part");
        // A part longer than the file cannot be resumed (hf-hub refuses it): start over.
        if std::fs::metadata(&part).is_ok_and(|m| m.len() > size) {
            std::fs::remove_file(&part).map_err(|e| Error::io(&part, e))?;
        }
        let bridge = Bridge {
            inner: progress,
            file,
        };
        let got = self
            .repo
            .download_with_progress(file, bridge)
            .map_err(|e| hub.error(self.spec, Some(file), &e, "downloading"))?;
        let _ = std::fs::remove_file(blob.with_extension("lock"));
        let checked = verify::check(&blob, &etag, size).map_err(|e| Error::io(&blob, e))?;
        match checked {
            Ok(verify::Checked::SizeOnly) => self.pulled.size_only.push(file.to_string()),
            Ok(_) => {}
            Err(mismatch) => {
                let _ = std::fs::remove_file(&blob);
                let _ = std::fs::remove_file(&got);
                return Err(hub.fail(
                    self.spec,
                    format!("{file}: {mismatch}; the download was deleted"),
                ));
            }
        }
        if got != dest {
            return Err(hub.fail(
                self.spec,
                format!(
                    "{file}: landed in {} instead of {}",
                    got.display(),
                    dest.display()
                ),
            ));
        }
        self.pulled.fetched.push((file.to_string(), size));
        Ok(())
    }

    /// The text of a file `select` reads; a root marker fetched now is moved aside after.
    fn read_plan_file(&mut self, file: &str) -> Result<String> {
        let path = self.snapshot.join(file);
        let len = std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, e))?
            .len();
        if len > MAX_PLAN_FILE {
            return Err(self.hub.fail(
                self.spec,
                format!("{file} is {len} bytes, more than a model's index can need"),
            ));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let fetched_now = self.pulled.fetched.iter().any(|(f, _)| f == file);
        if fetched_now && MODEL_MARKERS.contains(&file) {
            let aside = self.snapshot.join(format!("{file}.incomplete"));
            std::fs::rename(&path, &aside).map_err(|e| Error::io(&path, e))?;
            self.hidden.push(file.to_string());
        }
        Ok(text)
    }

    /// Put the markers moved aside back; drop any left by an interrupted run.
    fn unhide(&mut self) -> Result<()> {
        for m in MODEL_MARKERS {
            let aside = self.snapshot.join(format!("{m}.incomplete"));
            if self.hidden.iter().any(|h| h == m) {
                let path = self.snapshot.join(m);
                std::fs::rename(&aside, &path).map_err(|e| Error::io(&aside, e))?;
            } else if aside.exists() || aside.is_symlink() {
                let _ = std::fs::remove_file(&aside);
            }
        }
        Ok(())
    }
}

/// A relative path of plain segments: nothing that could leave the snapshot folder.
fn safe_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\\')
        && !p.contains('\0')
        && p.split('/').all(|s| !s.is_empty() && s != "." && s != "..")
}

/// hf-hub's progress calls, passed to ours with the repo's file name.
struct Bridge<'a> {
    inner: &'a mut dyn Progress,
    file: &'a str,
}

impl hf_hub::api::Progress for Bridge<'_> {
    fn init(&mut self, size: usize, _: &str) {
        self.inner.start(self.file, size as u64);
    }
    fn update(&mut self, bytes: usize) {
        self.inner.advance(bytes as u64);
    }
    fn finish(&mut self) {
        self.inner.finish();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn safe_paths() {
        for ok in ["config.json", "vae/config.json", "a.b/c-d_e"] {
            assert!(super::safe_path(ok), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "a\\b", "./a"] {
            assert!(!super::safe_path(bad), "{bad}");
        }
    }
}
