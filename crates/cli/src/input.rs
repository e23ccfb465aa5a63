//! Texts from `--text` and `--text-file`, image paths from `--image-file`.
//!
//! A text file holds one text per line; a `.jsonl`/`.ndjson` file holds one JSON value per line,
//! either a string or an object with a `"text"` field. `-` reads standard input (plain lines).
//! Every problem names the file and line.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use tessera_core::{Error, Result};

/// The longest line accepted in a text file: one text (far past any model's context).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// The most bytes read from a text file or an image list.
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// The longest line of an image list: one path.
const MAX_PATH_BYTES: usize = 64 << 10;

pub fn read_text_file(path: &Path) -> Result<Vec<String>> {
    let json_lines = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "ndjson")
    );
    let name = path.display();
    let mut texts = Vec::new();
    for_each_line(path, MAX_LINE_BYTES, |n, raw| {
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
        Ok(())
    })?;
    Ok(texts)
}

/// An image list: one path per line (relative paths as given, from the working directory).
pub fn read_path_list(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.display();
    let mut paths = Vec::new();
    for_each_line(path, MAX_PATH_BYTES, |n, raw| {
        let line = std::str::from_utf8(raw)
            .map_err(|e| Error::input(format!("{name}: line {n} is not valid UTF-8 ({e})")))?;
        if line.trim().is_empty() {
            return Err(Error::input(format!(
                "{name}: line {n} is empty (one image path per line)"
            )));
        }
        paths.push(line.into());
        Ok(())
    })?;
    Ok(paths)
}

/// Call `f` with each line's number (from 1) and bytes (without `\n` or `\r\n`), reading the
/// file (`-`: standard input) as a stream: a line longer than `max_line` bytes or a file over
/// [`MAX_FILE_BYTES`] is refused as soon as it is seen, so `/dev/zero` fails at once.
fn for_each_line(
    path: &Path,
    max_line: usize,
    mut f: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let stdin = path == Path::new("-");
    let name = if stdin {
        "<stdin>".into()
    } else {
        path.display().to_string()
    };
    let source: Box<dyn BufRead> = if stdin {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut source = source.take(MAX_FILE_BYTES + 1);
    let mut buf = Vec::new();
    for n in 1.. {
        buf.clear();
        // Room for the longest line, its `\r\n`, and one byte to tell it is longer.
        (&mut source)
            .take(max_line as u64 + 3)
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::io(&name, e))?;
        if buf.is_empty() {
            break;
        }
        if source.limit() == 0 {
            return Err(Error::input(format!(
                "{name}: more than {} MiB; split it into smaller files",
                MAX_FILE_BYTES >> 20
            )));
        }
        let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.len() > max_line {
            return Err(Error::input(format!(
                "{name}: line {n} is longer than {} (the limit of one line){}",
                size(max_line),
                if buf.contains(&0) {
                    "; it holds NUL bytes, so this is not a text file"
                } else {
                    ""
                }
            )));
        }
        f(n, line)?;
    }
    Ok(())
}

fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
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
    fn long_lines_and_endless_files_fail_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        let mut text = "a".repeat(MAX_LINE_BYTES);
        text.push_str("\r\nok\n");
        std::fs::write(&p, &text).unwrap();
        assert_eq!(
            read_text_file(&p).unwrap().len(),
            2,
            "a line at the limit is fine"
        );
        text.insert(0, 'b');
        std::fs::write(&p, &text).unwrap();
        let e = read_text_file(&p).unwrap_err().to_string();
        assert!(e.contains("line 1 is longer than 1 MiB"), "{e}");
        let started = std::time::Instant::now();
        let e = read_text_file(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero: line 1 is longer than 1 MiB") && e.contains("NUL"),
            "{e}"
        );
        assert!(started.elapsed().as_secs() < 5);
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
