//! Image files named by path (`--allow-file-paths`): what a client may make the server read.
//!
//! A path comes from the network, so it is read as an untrusted upload would be:
//! - only a regular file: a FIFO, a socket or a device (`/dev/zero`, a named pipe no one writes)
//!   is refused from its metadata. The file is opened non-blocking, so even opening a FIFO
//!   never waits for a writer (a blocking open wedged a thread for good per request);
//! - no larger than a request body may be (`--max-request-mb`): the size is checked from the
//!   metadata before a byte is read (a 2 GiB file used to be read, 746 MiB of it, before its
//!   refusal);
//! - within a time limit (`--body-timeout`, the time a body has to arrive), checked between
//!   chunks, and never more than the size the metadata gave (a file that grows is cut there).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::ApiError;

/// Bytes read at a time, between checks of the clock.
const CHUNK: usize = 1 << 20;

/// The bytes of the image file at `path`, at most `max_bytes` of them, read within `timeout`.
pub fn read_image_file(
    path: &Path,
    max_bytes: usize,
    timeout: Duration,
) -> Result<Vec<u8>, ApiError> {
    let started = Instant::now();
    let shown = path.display();
    let file = open_nonblocking(path)
        .map_err(|e| ApiError::invalid(format!("cannot open the image file {shown}: {e}")))?;
    let meta = file
        .metadata()
        .map_err(|e| ApiError::invalid(format!("cannot read the metadata of {shown}: {e}")))?;
    if !meta.is_file() {
        return Err(ApiError::invalid(format!(
            "{shown} is not a regular file (a directory, FIFO, socket or device): only image files are read"
        )));
    }
    let size = meta.len();
    if size > max_bytes as u64 {
        return Err(ApiError::InputTooLarge(format!(
            "the image file {shown} is {} MiB; a file may be at most {} MiB, as a request body may (--max-request-mb)",
            size >> 20,
            max_bytes >> 20
        )));
    }
    // The metadata's size is all that is read, even if the file grows meanwhile.
    let len = usize::try_from(size).unwrap_or(max_bytes);
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| ApiError::QueueMemory(format!("no memory to read {shown} ({len} bytes)")))?;
    let mut file = file.take(size);
    let mut chunk = vec![0u8; CHUNK.min(len.max(1))];
    loop {
        if started.elapsed() > timeout {
            return Err(ApiError::invalid(format!(
                "reading {shown} took longer than {timeout:?} (--body-timeout)"
            )));
        }
        match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // A regular file does not block; anything else is not read.
                return Err(ApiError::invalid(format!(
                    "{shown} is not ready to be read"
                )));
            }
            Err(e) => return Err(ApiError::invalid(format!("reading {shown}: {e}"))),
        }
    }
    Ok(bytes)
}

/// Open for reading without waiting: `O_NONBLOCK`, so a FIFO with no writer opens at once
/// (and is then refused for its type) instead of blocking the thread.
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    options.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: ApiError) -> String {
        e.to_string()
    }

    #[test]
    fn regular_files_are_read_and_everything_else_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("a.png");
        std::fs::write(&small, b"12345").unwrap();
        let t = Duration::from_secs(5);
        assert_eq!(read_image_file(&small, 5, t).unwrap(), b"12345");
        let e = read_image_file(&small, 4, t).unwrap_err();
        assert!(matches!(e, ApiError::InputTooLarge(_)), "{e:?}");
        let e = message(read_image_file(dir.path(), 100, t).unwrap_err());
        assert!(e.contains("not a regular file"), "{e}");
        let e = message(read_image_file(Path::new("/dev/zero"), 100, t).unwrap_err());
        assert!(e.contains("not a regular file"), "{e}");
        #[cfg(unix)]
        {
            let fifo = dir.path().join("pipe.png");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let started = Instant::now();
            let e = message(read_image_file(&fifo, 100, t).unwrap_err());
            assert!(e.contains("not a regular file"), "{e}");
            assert!(started.elapsed() < Duration::from_secs(1));
        }
    }
}
