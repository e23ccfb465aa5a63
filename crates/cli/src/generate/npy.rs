//! Reading a float32 `.npy` array (NumPy format 1.0–3.0, C order, little-endian `<f4`): how an
//! initial latent is handed over from Python (`numpy.save("latent.npy", latents.numpy())`).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use tessera_core::{Error, Result};

/// The longest header read. NumPy writes a few dozen bytes (padded to 64); anything longer is
/// not an array we take, and a `/dev/zero` or a huge file fails here at once.
const MAX_HEADER: usize = 64 << 10;

/// A `.npy` file whose header has been read and checked: its shape is known before a byte of
/// its data is read, so the data is read only once the shape is the one wanted, and then only
/// the bytes the shape needs.
#[derive(Debug)]
pub struct Npy {
    path: PathBuf,
    shape: Vec<usize>,
    /// Where the data starts.
    data_at: u64,
    /// Bytes of data the shape needs.
    data_len: usize,
}

impl Npy {
    /// Read and check the header of the `.npy` file at `path` (at most [`MAX_HEADER`] bytes),
    /// and, when the file is a regular one, its size against the shape.
    pub fn open(path: &Path) -> Result<Self> {
        let named =
            |m: String| Error::input(format!("{}: not a float32 .npy array: {m}", path.display()));
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut head = Vec::new();
        (&mut file)
            .take((MAX_HEADER + 12) as u64)
            .read_to_end(&mut head)
            .map_err(|e| Error::io(path, e))?;
        let (shape, data_at) = header(&head).map_err(named)?;
        let data_len = shape
            .iter()
            .try_fold(4usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| named(format!("shape {shape:?} is too large")))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if meta.is_file() {
            let data = meta.len().saturating_sub(data_at as u64);
            if data != data_len as u64 {
                return Err(named(format!(
                    "{data} data bytes for shape {shape:?} ({data_len} expected)"
                )));
            }
        }
        Ok(Npy {
            path: path.to_path_buf(),
            shape,
            data_at: data_at as u64,
            data_len,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values: exactly the bytes the shape needs (a file that holds more or fewer is
    /// refused, having read at most one byte more).
    pub fn read(self) -> Result<Vec<f32>> {
        let path = &self.path;
        let named =
            |m: String| Error::input(format!("{}: not a float32 .npy array: {m}", path.display()));
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        file.seek(SeekFrom::Start(self.data_at))
            .map_err(|e| Error::io(path, e))?;
        let mut data = Vec::new();
        data.try_reserve_exact(self.data_len + 1).map_err(|_| {
            Error::input(format!(
                "{}: no memory for its {} bytes of data",
                path.display(),
                self.data_len
            ))
        })?;
        file.take(self.data_len as u64 + 1)
            .read_to_end(&mut data)
            .map_err(|e| Error::io(path, e))?;
        if data.len() != self.data_len {
            let got = if data.len() > self.data_len {
                "more".to_string()
            } else {
                data.len().to_string()
            };
            return Err(named(format!(
                "{got} data bytes for shape {:?} ({} expected)",
                self.shape, self.data_len
            )));
        }
        Ok(values(&data))
    }
}

fn values(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The shape and the data's offset from the first bytes of a file.
fn header(bytes: &[u8]) -> std::result::Result<(Vec<usize>, usize), String> {
    let rest = bytes
        .strip_prefix(b"\x93NUMPY")
        .ok_or("missing the \\x93NUMPY magic")?;
    let (&major, rest) = rest.split_first().ok_or("truncated header")?;
    let rest = rest.get(1..).ok_or("truncated header")?;
    let (len, rest, preamble) = match major {
        1 => {
            let l = rest.get(..2).ok_or("truncated header")?;
            (u16::from_le_bytes([l[0], l[1]]) as usize, &rest[2..], 10)
        }
        2 | 3 => {
            let l = rest.get(..4).ok_or("truncated header")?;
            (
                u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize,
                &rest[4..],
                12,
            )
        }
        v => return Err(format!("format version {v} is not supported")),
    };
    if len > MAX_HEADER {
        return Err(format!("a header of {len} bytes (at most {MAX_HEADER})"));
    }
    let header = std::str::from_utf8(rest.get(..len).ok_or("truncated header")?)
        .map_err(|_| "header is not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header
            .find(&format!("'{key}':"))
            .ok_or(format!("header has no '{key}'"))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = field("descr")?;
    if !(descr.starts_with("'<f4'") || descr.starts_with("'|f4'")) {
        return Err(format!(
            "dtype {} (expected little-endian float32 '<f4')",
            descr.split(',').next().unwrap_or(descr)
        ));
    }
    if !field("fortran_order")?.starts_with("False") {
        return Err("Fortran order is not supported (save a C-contiguous array)".into());
    }
    let shape_text = field("shape")?;
    let inner = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("malformed shape")?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("malformed shape ({inner})"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((shape, preamble + len))
}

/// `(shape, values)` of a whole `.npy` file in memory (the tests' form).
#[cfg(test)]
fn parse(bytes: &[u8]) -> std::result::Result<(Vec<usize>, Vec<f32>), String> {
    let (shape, at) = header(bytes)?;
    let data = &bytes[at..];
    let n: usize = shape.iter().product();
    if data.len() != n * 4 {
        return Err(format!(
            "{} data bytes for shape {shape:?} ({} expected)",
            data.len(),
            n * 4
        ));
    }
    Ok((shape, values(data)))
}

#[cfg(test)]
mod tests {
    use super::parse;

    fn npy(header: &str, values: &[f32]) -> Vec<u8> {
        let mut h = header.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((h.len() as u16).to_le_bytes());
        out.extend(h.as_bytes());
        out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        out
    }

    #[test]
    fn reads_what_numpy_writes_and_rejects_the_rest() {
        let v = [1.0f32, -2.5, 3.0, 0.25, 5.0, 6.0];
        let ok = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3), }",
            &v,
        );
        assert_eq!(parse(&ok).unwrap(), (vec![1, 2, 3], v.to_vec()));
        let f64s = npy(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (6,), }",
            &v,
        );
        assert!(parse(&f64s).unwrap_err().contains("'<f8'"));
        let short = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }",
            &v,
        );
        assert!(parse(&short).unwrap_err().contains("24 data bytes"));
        assert!(parse(b"PK\x03\x04").unwrap_err().contains("magic"));
    }
}
