//! Checking a downloaded file against the hub's etag: files stored in Git LFS (weights) carry
//! their SHA-256 (`X-Linked-Etag`), plain git files their git blob SHA-1 (`ETag`).

use std::io::Read;
use std::path::Path;

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// How a file was checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    Sha256,
    GitSha1,
    /// The etag is neither hash (a mirror's own etags): only the size was checked.
    SizeOnly,
}

/// Why a file failed its check, for the error message.
#[derive(Debug, PartialEq, Eq)]
pub enum Mismatch {
    Size {
        expected: u64,
        found: u64,
    },
    Hash {
        kind: &'static str,
        expected: String,
        found: String,
    },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::Size { expected, found } => {
                write!(
                    f,
                    "size mismatch: the hub says {expected} bytes, got {found}"
                )
            }
            Mismatch::Hash {
                kind,
                expected,
                found,
            } => write!(
                f,
                "checksum mismatch: expected {kind} {expected}, got {found}"
            ),
        }
    }
}

/// The etag without quotes or a weak-etag prefix, lower-cased.
pub fn clean_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_ascii_lowercase()
}

/// Check `path` against `etag` and `size`; `Ok(how)` when it matches.
pub fn check(path: &Path, etag: &str, size: u64) -> std::io::Result<Result<Checked, Mismatch>> {
    let found = std::fs::metadata(path)?.len();
    if found != size {
        return Ok(Err(Mismatch::Size {
            expected: size,
            found,
        }));
    }
    let etag = clean_etag(etag);
    let hex = etag.chars().all(|c| c.is_ascii_hexdigit());
    let (kind, how, digest) = match etag.len() {
        64 if hex => ("sha256", Checked::Sha256, hash::<Sha256>(path, None)?),
        40 if hex => {
            let header = format!("blob {size}\0");
            (
                "git-sha1",
                Checked::GitSha1,
                hash::<Sha1>(path, Some(header.as_bytes()))?,
            )
        }
        _ => return Ok(Ok(Checked::SizeOnly)),
    };
    if digest == etag {
        Ok(Ok(how))
    } else {
        Ok(Err(Mismatch::Hash {
            kind,
            expected: etag,
            found: digest,
        }))
    }
}

fn hash<D: Digest>(path: &Path, prefix: Option<&[u8]>) -> std::io::Result<String> {
    let mut d = D::new();
    if let Some(p) = prefix {
        d.update(p);
    }
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        d.update(&buf[..n]);
    }
    Ok(d.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_sha256_git_sha1_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello\n").unwrap();
        // `printf 'hello\n' | sha256sum` and `printf 'hello\n' | git hash-object --stdin`.
        let sha256 = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";
        let git = "ce013625030ba8dba906f756967f9e9ca394464a";
        assert_eq!(check(&p, sha256, 6).unwrap(), Ok(Checked::Sha256));
        assert_eq!(
            check(&p, &format!("\"{}\"", git.to_uppercase()), 6).unwrap(),
            Ok(Checked::GitSha1)
        );
        assert_eq!(
            check(&p, "W/\"mirror-1\"", 6).unwrap(),
            Ok(Checked::SizeOnly)
        );
        assert_eq!(
            check(&p, sha256, 7).unwrap(),
            Err(Mismatch::Size {
                expected: 7,
                found: 6
            })
        );
        std::fs::write(&p, b"hellO\n").unwrap();
        let e = check(&p, sha256, 6).unwrap().unwrap_err().to_string();
        assert!(e.contains("sha256") && e.contains(sha256), "{e}");
        assert!(check(&p, git, 6).unwrap().is_err());
    }
}
