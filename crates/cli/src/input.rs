//! Texts from `--text` and `--text-file`, image paths from `--image-file`.
//!
//! A text file holds one text per line; a `.jsonl`/`.ndjson` file holds one JSON value per line,
//! either a string or an object with a `"text"` field. `-` reads standard input (plain lines).
//! Every problem names the file and line.

use std::io::Read;
use std::path::Path;

use tessera_core::{Error, Result};

pub fn read_text_file(path: &Path) -> Result<Vec<String>> {
    let bytes = if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .map_err(|e| Error::io("<stdin>", e))?;
        buf
    } else {
        std::fs::read(path).map_err(|e| Error::io(path, e))?
    };
    let json_lines = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "ndjson")
    );
    let name = path.display();
    let mut texts = Vec::new();
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop(); // the final newline ends the last line, it does not start an empty one
    }
    for (i, raw) in lines.into_iter().enumerate() {
        let n = i + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let line = std::str::from_utf8(raw)
            .map_err(|e| Error::input(format!("{name}: line {n} is not valid UTF-8 ({e})")))?;
        let text = if json_lines {
            parse_json_line(line).map_err(|m| Error::input(format!("{name}: line {n}: {m}")))?
        } else {
            line.to_string()
        };
        if text.is_empty() {
            return Err(Error::input(format!("{name}: line {n} is an empty text")));
        }
        texts.push(text);
    }
    Ok(texts)
}

/// An image list: one path per line (relative paths as given, from the working directory).
pub fn read_path_list(path: &Path) -> Result<Vec<std::path::PathBuf>> {
    let text = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8(text)
        .map_err(|e| Error::input(format!("{}: not valid UTF-8 ({e})", path.display())))?;
    text.lines()
        .enumerate()
        .map(|(i, line)| {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                Err(Error::input(format!(
                    "{}: line {} is empty (one image path per line)",
                    path.display(),
                    i + 1
                )))
            } else {
                Ok(line.into())
            }
        })
        .collect()
}

fn parse_json_line(line: &str) -> std::result::Result<String, String> {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::String(s)) => Ok(s),
        Ok(serde_json::Value::Object(o)) => match o.get("text") {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            _ => Err("expected an object with a string \"text\" field".into()),
        },
        Ok(_) => Err("expected a JSON string or an object with \"text\"".into()),
        Err(e) => Err(format!("invalid JSON ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("t.txt");
        std::fs::write(&plain, "one\r\ntwo\n").unwrap();
        assert_eq!(read_text_file(&plain).unwrap(), vec!["one", "two"]);
        let jl = dir.path().join("t.jsonl");
        std::fs::write(&jl, "\"a\\nb\"\n{\"text\": \"c\", \"id\": 3}\n").unwrap();
        assert_eq!(read_text_file(&jl).unwrap(), vec!["a\nb", "c"]);
        std::fs::write(&jl, "{\"txt\": 1}\n").unwrap();
        assert!(
            read_text_file(&jl)
                .unwrap_err()
                .to_string()
                .contains("line 1")
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, b"ok\n\xff\xfe\n").unwrap();
        let e = read_text_file(&p).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("UTF-8"), "{e}");
        std::fs::write(&p, b"ok\n\nthree\n").unwrap();
        let e = read_text_file(&p).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("empty"), "{e}");
    }
}
