//! Reading a float32 `.npy` array (NumPy format 1.0–3.0, C order, little-endian `<f4`): how an
//! initial latent is handed over from Python (`numpy.save("latent.npy", latents.numpy())`).

use std::path::Path;

use tessera_core::{Error, Result};

/// `(shape, values)` of the `.npy` file at `path`.
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse(&bytes)
        .map_err(|m| Error::input(format!("{}: not a float32 .npy array: {m}", path.display())))
}

fn parse(bytes: &[u8]) -> std::result::Result<(Vec<usize>, Vec<f32>), String> {
    let rest = bytes
        .strip_prefix(b"\x93NUMPY")
        .ok_or("missing the \\x93NUMPY magic")?;
    let (&major, rest) = rest.split_first().ok_or("truncated header")?;
    let rest = rest.get(1..).ok_or("truncated header")?;
    let (len, rest) = match major {
        1 => {
            let l = rest.get(..2).ok_or("truncated header")?;
            (u16::from_le_bytes([l[0], l[1]]) as usize, &rest[2..])
        }
        2 | 3 => {
            let l = rest.get(..4).ok_or("truncated header")?;
            (
                u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize,
                &rest[4..],
            )
        }
        v => return Err(format!("format version {v} is not supported")),
    };
    let header = std::str::from_utf8(rest.get(..len).ok_or("truncated header")?)
        .map_err(|_| "header is not text")?;
    let data = &rest[len..];
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
    let n: usize = shape.iter().product();
    if data.len() != n * 4 {
        return Err(format!(
            "{} data bytes for shape {shape:?} ({} expected)",
            data.len(),
            n * 4
        ));
    }
    let values = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((shape, values))
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
