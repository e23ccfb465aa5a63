//! A Hugging Face hub on loopback with the endpoints Tessera's client uses: the repo listing
//! (`/api/models/{repo}/revision/{rev}`) and file downloads (`/{repo}/resolve/{rev}/{file}`)
//! with `X-Repo-Commit`, the etags the real hub sends (SHA-256 as `X-Linked-Etag` for LFS files,
//! the git blob SHA-1 as `ETag` for the rest) and `Range` requests. It records every request.
#![allow(dead_code)] // each test uses its own part

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// One request as the hub saw it.
#[derive(Clone, Debug)]
pub struct Request {
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

struct File {
    /// What is sent.
    bytes: Vec<u8>,
    /// The etag, from the file's true content.
    etag: String,
    lfs: bool,
}

struct Repo {
    commit: String,
    files: BTreeMap<String, File>,
}

#[derive(Default)]
struct State {
    repos: BTreeMap<String, Repo>,
    requests: Vec<Request>,
}

pub struct FakeHub {
    url: String,
    state: Arc<Mutex<State>>,
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

fn git_sha1_hex(b: &[u8]) -> String {
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", b.len()).as_bytes());
    h.update(b);
    hex(&h.finalize())
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

impl FakeHub {
    pub fn start() -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        FakeHub { url, state }
    }

    /// The `HF_ENDPOINT` to give the client.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Serve `files` as the repo `id` at `commit`; weights (`.safetensors`, `.gguf`, `.bin`)
    /// as LFS files.
    pub fn add_repo(&self, id: &str, commit: &str, files: Vec<(String, Vec<u8>)>) {
        let files = files
            .into_iter()
            .map(|(name, bytes)| {
                let lfs = [".safetensors", ".gguf", ".bin"]
                    .iter()
                    .any(|e| name.ends_with(e));
                let etag = if lfs {
                    sha256_hex(&bytes)
                } else {
                    git_sha1_hex(&bytes)
                };
                (name, File { bytes, etag, lfs })
            })
            .collect();
        self.state.lock().unwrap().repos.insert(
            id.to_string(),
            Repo {
                commit: commit.to_string(),
                files,
            },
        );
    }

    /// Send `file` with one byte changed, under its true etag.
    pub fn corrupt(&self, id: &str, file: &str) {
        let mut st = self.state.lock().unwrap();
        let f = st.repos.get_mut(id).unwrap().files.get_mut(file).unwrap();
        let mid = f.bytes.len() / 2;
        f.bytes[mid] ^= 0x55;
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn serve(conn: TcpStream, state: &Mutex<State>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = Some(v.trim().to_string()),
                "authorization" => auth = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }
    let mut st = state.lock().unwrap();
    st.requests.push(Request {
        path: path.clone(),
        range: range.clone(),
        auth,
    });
    let (status, headers, body) = answer(&st, &path, range.as_deref());
    drop(st);
    let mut out = conn;
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        404 => "Not Found",
        _ => "Range Not Satisfiable",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = out.write_all(head.as_bytes());
    if method != "HEAD" {
        let _ = out.write_all(&body);
    }
    let _ = out.flush();
}

type Answer = (u16, Vec<(String, String)>, Vec<u8>);

fn not_found() -> Answer {
    (
        404,
        vec![],
        b"{\"error\":\"Repository not found\"}".to_vec(),
    )
}

fn answer(st: &State, path: &str, range: Option<&str>) -> Answer {
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((id, rev)) = rest.split_once("/revision/") else {
            return not_found();
        };
        let Some(repo) = st
            .repos
            .get(id)
            .filter(|r| rev == "main" || rev == r.commit)
        else {
            return not_found();
        };
        let siblings: Vec<_> = repo
            .files
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({ "id": id, "sha": repo.commit, "siblings": siblings });
        return (
            200,
            vec![("Content-Type".into(), "application/json".into())],
            body.to_string().into_bytes(),
        );
    }
    // /{owner}/{name}/resolve/{rev}/{file}
    let mut segs = path.trim_start_matches('/').splitn(5, '/');
    let (Some(owner), Some(name), Some("resolve"), Some(rev), Some(file)) = (
        segs.next(),
        segs.next(),
        segs.next(),
        segs.next(),
        segs.next(),
    ) else {
        return not_found();
    };
    let Some(repo) = st
        .repos
        .get(&format!("{owner}/{name}"))
        .filter(|r| rev == "main" || rev == r.commit)
    else {
        return not_found();
    };
    let Some(f) = repo.files.get(file) else {
        return not_found();
    };
    let mut headers = vec![
        ("X-Repo-Commit".to_string(), repo.commit.clone()),
        ("ETag".to_string(), format!("\"{}\"", f.etag)),
    ];
    if f.lfs {
        headers.push(("X-Linked-Etag".into(), format!("\"{}\"", f.etag)));
        headers.push(("X-Linked-Size".into(), f.bytes.len().to_string()));
    }
    let total = f.bytes.len();
    let Some(spec) = range.and_then(|r| r.strip_prefix("bytes=")) else {
        return (200, headers, f.bytes.clone());
    };
    let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
    let start: usize = a.parse().unwrap_or(0);
    let end: usize = b.parse().map_or(total.saturating_sub(1), |e: usize| {
        e.min(total.saturating_sub(1))
    });
    if start >= total || end < start {
        headers.push(("Content-Range".into(), format!("bytes */{total}")));
        return (416, headers, vec![]);
    }
    headers.push((
        "Content-Range".into(),
        format!("bytes {start}-{end}/{total}"),
    ));
    (206, headers, f.bytes[start..=end].to_vec())
}
