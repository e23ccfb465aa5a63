//! Turning a `--model` argument into a model folder.
//!
//! Accepted: a path to a folder, or a Hugging Face repo id (`google/embeddinggemma-2`, optionally
//! `:REVISION` or `:QUANT`, see [`RepoSpec`]) found in the local Hugging Face cache. Resolution
//! itself never touches the network: the front ends download a missing repo first
//! ([`crate::hub`]); when a repo id is still not in the cache (offline, or not pulled) the error
//! says which folders were searched and how to fetch the files.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The Hugging Face hub cache folder, following `huggingface_hub`'s rules: `HF_HUB_CACHE`, else
/// `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
pub fn hf_hub_cache() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// The files whose presence marks a model folder: `model_index.json` for a diffusers pipeline,
/// `config.json` for a transformers model.
pub const MODEL_MARKERS: [&str; 2] = ["model_index.json", "config.json"];

/// Whether `HF_HUB_OFFLINE` forbids the network (`1`, `ON`, `YES` or `TRUE`, as
/// `huggingface_hub` reads it).
pub fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_uppercase().as_str(),
            "1" | "ON" | "YES" | "TRUE"
        )
    })
}

/// A Hugging Face model repo as `--model` and `tessera pull` name it: `owner/name`, then
/// optionally `:REVISION` (a branch, tag or commit) or `:QUANT` (a GGUF quantization such as
/// `Q4_K_M`, which picks that file of a repo holding several). The part after the colon is a
/// quantization when it reads like one (`Q`, `IQ` or `TQ` then a digit, or `F16`, `BF16`,
/// `F32`, `MXFP4`); anything else is a revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoSpec {
    pub repo: String,
    pub revision: Option<String>,
    pub quant: Option<String>,
}

impl RepoSpec {
    /// `None` when `spec` is not a repo id (a path, or a malformed name).
    pub fn parse(spec: &str) -> Option<Self> {
        let (repo, tail) = match spec.split_once(':') {
            Some((r, t)) => (r, Some(t)),
            None => (spec, None),
        };
        if !looks_like_repo_id(repo) {
            return None;
        }
        let mut out = RepoSpec {
            repo: repo.to_string(),
            revision: None,
            quant: None,
        };
        match tail {
            None => {}
            Some(t) if looks_like_quant(t) => out.quant = Some(t.to_string()),
            Some(t) if valid_revision(t) => out.revision = Some(t.to_string()),
            Some(_) => return None,
        }
        Some(out)
    }

    /// The revision to fetch: the one named, else `main`.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// The repo's folder in the cache, `models--owner--name`.
    pub fn folder(&self) -> String {
        repo_folder(&self.repo)
    }
}

fn looks_like_quant(s: &str) -> bool {
    let u = s.to_ascii_uppercase();
    if matches!(u.as_str(), "F16" | "BF16" | "F32" | "MXFP4") {
        return true;
    }
    ["IQ", "TQ", "Q"].iter().any(|p| {
        u.strip_prefix(p)
            .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// A branch, tag, commit or `refs/pr/N`: no empty or `..` segment, nothing a path could escape with.
fn valid_revision(s: &str) -> bool {
    !s.is_empty()
        && s.split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

/// True when `spec` looks like `owner/name` rather than a filesystem path.
fn looks_like_repo_id(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let (Some(owner), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    ok(owner) && ok(name)
}

/// Whether folder `p` holds a `*.gguf` file (a model as llama.cpp takes it: its language model
/// and, for a vision model, its `mmproj-*.gguf`).
pub fn holds_gguf(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|entries| {
        entries.filter_map(|e| e.ok()).any(|e| {
            let path = e.path();
            path.is_file()
                && path
                    .extension()
                    .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
        })
    })
}

/// Resolve `spec` to a model folder that contains one of `markers` (`model_index.json` for a
/// diffusers pipeline, `config.json` for a transformers model) or GGUF files.
pub fn resolve_any(spec: &str, markers: &[&str]) -> Result<PathBuf> {
    let marker = format!("{} or a GGUF file", markers.join(" or "));
    let has_marker = |p: &Path| markers.iter().any(|m| p.join(m).is_file()) || holds_gguf(p);
    let path = Path::new(spec);
    if path.exists() {
        if !path.is_dir() {
            return Err(Error::ModelNotFound {
                spec: spec.into(),
                looked: format!("{} is a file; pass the model's folder", path.display()),
            });
        }
        if !has_marker(path) {
            let empty = std::fs::read_dir(path)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
            return Err(Error::ModelNotFound {
                spec: spec.into(),
                looked: if empty {
                    format!("the folder {} is empty", path.display())
                } else {
                    format!("the folder {} has no {marker}", path.display())
                },
            });
        }
        return Ok(path.to_path_buf());
    }
    let Some(repo) = RepoSpec::parse(spec) else {
        return Err(Error::ModelNotFound {
            spec: spec.into(),
            looked: format!("no such folder: {}", path.display()),
        });
    };
    let Some(cache) = hf_hub_cache() else {
        return Err(Error::ModelNotFound {
            spec: spec.into(),
            looked: "no such folder, and no Hugging Face cache location (HF_HUB_CACHE, HF_HOME and HOME are unset)".into(),
        });
    };
    find_in_cache(&cache, &repo, &has_marker).ok_or_else(|| Error::ModelNotFound {
        spec: spec.into(),
        looked: format!(
            "no such folder, and no snapshot with {marker} under {}; {}",
            cache.join(repo.folder()).join("snapshots").display(),
            if hub_offline() {
                format!("HF_HUB_OFFLINE is set, so it is not downloaded: unset it, or run `tessera pull {spec}` where the hub is reachable, or pass a folder")
            } else {
                format!("fetch it with `tessera pull {spec}` or pass a folder")
            }
        ),
    })
}

/// The cached snapshot of `repo` that has one of `markers` or GGUF files, if any (no network).
pub fn cached_snapshot(repo: &RepoSpec, markers: &[&str]) -> Option<PathBuf> {
    let cache = hf_hub_cache()?;
    find_in_cache(&cache, repo, &|p: &Path| {
        markers.iter().any(|m| p.join(m).is_file()) || holds_gguf(p)
    })
}

fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// For a named revision: the snapshot `refs/<revision>` points to, or the snapshot of that
/// commit. Else the snapshot `refs/main` points to if it has a marker, else the most recently
/// modified snapshot that has one.
fn find_in_cache(
    cache: &Path,
    repo: &RepoSpec,
    has_marker: &dyn Fn(&Path) -> bool,
) -> Option<PathBuf> {
    let repo_dir = cache.join(repo.folder());
    let snapshots = repo_dir.join("snapshots");
    let by_ref = std::fs::read_to_string(repo_dir.join("refs").join(repo.revision()))
        .ok()
        .map(|commit| snapshots.join(commit.trim()))
        .filter(|snap| has_marker(snap));
    if let Some(rev) = &repo.revision {
        let by_commit = Some(snapshots.join(rev)).filter(|snap| {
            rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit()) && has_marker(snap)
        });
        return by_ref.or(by_commit);
    }
    if by_ref.is_some() {
        return by_ref;
    }
    std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| has_marker(p))
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_id_shape() {
        assert!(looks_like_repo_id("google/embeddinggemma-2"));
        assert!(!looks_like_repo_id("./model"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("/abs"));
        assert!(!looks_like_repo_id("../x"));
    }

    #[test]
    fn repo_spec_revision_or_quant() {
        let p = |s: &str| RepoSpec::parse(s);
        let r = p("org/name").unwrap();
        assert_eq!((r.revision(), r.quant.as_deref()), ("main", None));
        let r = p("org/name:v1.0").unwrap();
        assert_eq!((r.revision(), r.quant.as_deref()), ("v1.0", None));
        let r = p("org/name:refs/pr/3").unwrap();
        assert_eq!(r.revision(), "refs/pr/3");
        for q in ["Q4_K_M", "q8_0", "IQ2_XS", "BF16", "f16"] {
            let r = p(&format!("org/name-GGUF:{q}")).unwrap();
            assert_eq!((r.revision(), r.quant.as_deref()), ("main", Some(q)));
        }
        assert_eq!(
            p("org/name-GGUF:Q8_0").unwrap().folder(),
            "models--org--name-GGUF"
        );
        for bad in [
            "org/name:",
            "org/name:../x",
            "org/name:a//b",
            "org/name:a b",
            "./x:main",
        ] {
            assert!(p(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn finds_snapshot_from_refs_main() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--google--embeddinggemma-2");
        let snap = repo.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("snapshots").join("old")).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
        let config = |p: &Path| p.join("config.json").is_file();
        let spec = |s: &str| RepoSpec::parse(s).unwrap();
        let found = find_in_cache(cache.path(), &spec("google/embeddinggemma-2"), &config).unwrap();
        assert_eq!(found, snap);
        assert!(find_in_cache(cache.path(), &spec("google/other"), &config).is_none());
        // A named revision takes its ref or its commit's snapshot, never the newest.
        let no_ref = spec("google/embeddinggemma-2:v2");
        assert!(find_in_cache(cache.path(), &no_ref, &config).is_none());
        std::fs::write(repo.join("refs").join("v1"), "abc123").unwrap();
        let tagged = spec("google/embeddinggemma-2:v1");
        assert_eq!(find_in_cache(cache.path(), &tagged, &config), Some(snap));
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let pinned = spec(&format!("google/embeddinggemma-2:{sha}"));
        assert!(find_in_cache(cache.path(), &pinned, &config).is_none());
        let pinned_dir = repo.join("snapshots").join(sha);
        std::fs::create_dir_all(&pinned_dir).unwrap();
        std::fs::write(pinned_dir.join("config.json"), "{}").unwrap();
        assert_eq!(
            find_in_cache(cache.path(), &pinned, &config),
            Some(pinned_dir)
        );
    }

    #[test]
    fn errors_say_where_they_looked() {
        let dir = tempfile::tempdir().unwrap();
        let e = resolve_any(dir.path().to_str().unwrap(), &["config.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("is empty"), "{e}");
        std::fs::write(dir.path().join("x"), "").unwrap();
        let e = resolve_any(dir.path().to_str().unwrap(), &["config.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no config.json or a GGUF file"), "{e}");
        // A folder of GGUF files is a model folder (its files are told apart later).
        std::fs::write(dir.path().join("m-Q8_0.GGUF"), "").unwrap();
        assert_eq!(
            resolve_any(dir.path().to_str().unwrap(), &["config.json"]).unwrap(),
            dir.path()
        );
        let e = resolve_any("/definitely/not/here", &["config.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such folder"), "{e}");
    }
}
