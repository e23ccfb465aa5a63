//! Turning a `--model` argument into a model folder.
//!
//! Accepted: a path to a folder, or a Hugging Face repo id (`google/embeddinggemma-2`) that is
//! already in the local Hugging Face cache. Tessera never downloads; when a repo id is not in the
//! cache the error says which folders were searched and how to fetch the files.

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

/// Resolve `spec` to a model folder that contains one of `markers` (`model_index.json` for a
/// diffusers pipeline, `config.json` for a transformers model).
pub fn resolve_any(spec: &str, markers: &[&str]) -> Result<PathBuf> {
    let marker = markers.join(" or ");
    let has_marker = |p: &Path| markers.iter().any(|m| p.join(m).is_file());
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
    if !looks_like_repo_id(spec) {
        return Err(Error::ModelNotFound {
            spec: spec.into(),
            looked: format!("no such folder: {}", path.display()),
        });
    }
    let Some(cache) = hf_hub_cache() else {
        return Err(Error::ModelNotFound {
            spec: spec.into(),
            looked: "no such folder, and no Hugging Face cache location (HF_HUB_CACHE, HF_HOME and HOME are unset)".into(),
        });
    };
    find_in_cache(&cache, spec, &has_marker).ok_or_else(|| Error::ModelNotFound {
        spec: spec.into(),
        looked: format!(
            "no such folder, and no snapshot with {marker} under {}; fetch it with `hf download {spec}` or pass a folder",
            cache.join(repo_folder(spec)).join("snapshots").display()
        ),
    })
}

fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// The snapshot `refs/main` points to if it has a marker, else the most recently modified
/// snapshot that has one.
fn find_in_cache(cache: &Path, repo: &str, has_marker: &dyn Fn(&Path) -> bool) -> Option<PathBuf> {
    let repo_dir = cache.join(repo_folder(repo));
    let snapshots = repo_dir.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo_dir.join("refs").join("main")) {
        let snap = snapshots.join(rev.trim());
        if has_marker(&snap) {
            return Some(snap);
        }
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
        let found = find_in_cache(cache.path(), "google/embeddinggemma-2", &config).unwrap();
        assert_eq!(found, snap);
        assert!(find_in_cache(cache.path(), "google/other", &config).is_none());
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
        assert!(e.contains("has no config.json"), "{e}");
        let e = resolve_any("/definitely/not/here", &["config.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such folder"), "{e}");
    }
}
