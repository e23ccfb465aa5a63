//! Writing embeddings: JSON lines (one object per input) or a NumPy `.npy` matrix.

use std::io::Write;

use tessera_runtime::embed::Embedding;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object per line: index, model, tokens, dim, embedding.
    Jsonl,
    /// A little-endian float32 matrix `[inputs, dim]` in NumPy's .npy format.
    Npy,
}

#[derive(serde::Serialize)]
struct Line<'a> {
    index: usize,
    model: &'a str,
    tokens: usize,
    dim: usize,
    embedding: &'a [f32],
}

pub fn write_jsonl(
    out: &mut dyn Write,
    model: &str,
    embeddings: &[Embedding],
) -> std::io::Result<()> {
    for (index, e) in embeddings.iter().enumerate() {
        let line = Line {
            index,
            model,
            tokens: e.tokens,
            dim: e.vector.len(),
            embedding: &e.vector,
        };
        serde_json::to_writer(&mut *out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// NumPy format version 1.0: magic, header length, a Python-dict header padded with spaces to a
/// multiple of 64 bytes and ended by a newline, then the raw data.
pub fn write_npy(out: &mut dyn Write, embeddings: &[Embedding]) -> std::io::Result<()> {
    let dim = embeddings.first().map_or(0, |e| e.vector.len());
    let header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {dim}), }}",
        embeddings.len()
    );
    let unpadded = 10 + header.len() + 1;
    let pad = unpadded.div_ceil(64) * 64 - unpadded;
    let header = format!("{header}{}\n", " ".repeat(pad));
    let len =
        u16::try_from(header.len()).map_err(|_| std::io::Error::other("npy header too long"))?;
    let mut buf = Vec::with_capacity(10 + header.len() + embeddings.len() * dim * 4);
    buf.extend_from_slice(b"\x93NUMPY\x01\x00");
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(header.as_bytes());
    for e in embeddings {
        for v in &e.vector {
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.write_all(&buf)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_is_aligned_and_data_follows() {
        let e = vec![
            Embedding {
                vector: vec![1.0, -2.0, 0.5],
                tokens: 3
            };
            2
        ];
        let mut buf = Vec::new();
        write_npy(&mut buf, &e).unwrap();
        let hlen = u16::from_le_bytes([buf[8], buf[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&buf[10..10 + hlen]).unwrap();
        assert!(header.contains("'shape': (2, 3)") && header.ends_with('\n'));
        let data: Vec<f32> = buf[10 + hlen..]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(data, vec![1.0, -2.0, 0.5, 1.0, -2.0, 0.5]);
    }
}
