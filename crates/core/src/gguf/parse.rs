//! The header, metadata and tensor table of a GGUF file, parsed from untrusted bytes.
//!
//! Every count and length is checked against the bytes that remain before it is used. Entry
//! counts are never used to reserve memory (a multi-gigabyte model file would still allow a huge
//! claimed count): tables grow as entries are parsed, so memory follows the bytes actually read,
//! a small multiple of the metadata's size, and parsing stops at the first bad entry.
//! Errors are messages naming the key or tensor; [`super::Gguf::open`] adds the file.

use std::collections::HashMap;

use super::ggml_type::GgmlType;
use super::metadata::{Array, Value, ValueType};

type Parse<T> = std::result::Result<T, String>;

/// Alignment of tensor data when the file sets no `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are refused (each level recurses).
const MAX_ARRAY_DEPTH: usize = 8;
/// The least a metadata entry takes: an empty key (8), its type (4), a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// The least a tensor-table entry takes: an empty name (8), `n_dims` (4), type (4), offset (8).
const MIN_TENSOR_BYTES: usize = 8 + 4 + 4 + 8;

pub struct Parsed {
    pub version: u32,
    pub alignment: usize,
    pub metadata: Vec<(String, Value)>,
    pub keys: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub names: HashMap<String, usize>,
}

pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// GGUF order: innermost first.
    pub dims: Vec<usize>,
    /// Absolute byte range in the file, checked to lie within it.
    pub start: usize,
    pub end: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Parse<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, the file has {}",
                self.pos,
                self.buf.len()
            ));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Parse<[u8; N]> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Parse<u32> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Parse<u64> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    /// A `u64` count of items of at least `min_size` bytes each, checked to fit in what remains.
    fn count(&mut self, min_size: usize, what: &str, items: &str) -> Parse<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size))
            .is_some_and(|bytes| bytes <= self.remaining());
        if !fits {
            return Err(format!(
                "{what}: {n} {items} cannot fit in the {} bytes that remain of the file (truncated or corrupt)",
                self.remaining()
            ));
        }
        Ok(n as usize)
    }

    /// A GGUF string: a `u64` length, then UTF-8 bytes.
    fn string(&mut self, what: &str) -> Parse<String> {
        let len = self.count(1, what, "string bytes")?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what}: string is not UTF-8"))
    }

    fn bool(&mut self, what: &str) -> Parse<bool> {
        match self.bytes::<1>(what)? {
            [0] => Ok(false),
            [1] => Ok(true),
            [b] => Err(format!("{what}: bool byte {b} is neither 0 nor 1")),
        }
    }

    fn value_type(&mut self, what: &str) -> Parse<ValueType> {
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| format!("{what}: unknown value type {id}"))
    }

    fn value(&mut self, ty: ValueType, what: &str) -> Parse<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.bytes(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.bytes(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.bytes(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.bytes(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.bytes(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.bytes(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.bytes(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.bytes(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.bytes(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.bytes(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array(what, 0)?),
        })
    }

    fn array(&mut self, what: &str, depth: usize) -> Parse<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!(
                "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
            ));
        }
        let ty = self.value_type(what)?;
        let n = self.count(ty.min_size(), what, &format!("{ty} array elements"))?;
        // Fixed-size elements: one bounds check, then a conversion per element.
        macro_rules! le {
            ($variant:ident, $t:ty) => {{
                const N: usize = size_of::<$t>();
                let raw = self.take(n * N, what)?;
                Array::$variant(
                    raw.as_chunks::<N>()
                        .0
                        .iter()
                        .map(|b| <$t>::from_le_bytes(*b))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            ValueType::U8 => le!(U8, u8),
            ValueType::I8 => le!(I8, i8),
            ValueType::U16 => le!(U16, u16),
            ValueType::I16 => le!(I16, i16),
            ValueType::U32 => le!(U32, u32),
            ValueType::I32 => le!(I32, i32),
            ValueType::F32 => le!(F32, f32),
            ValueType::U64 => le!(U64, u64),
            ValueType::I64 => le!(I64, i64),
            ValueType::F64 => le!(F64, f64),
            ValueType::Bool => Array::Bool((0..n).map(|_| self.bool(what)).collect::<Parse<_>>()?),
            ValueType::String => {
                Array::String((0..n).map(|_| self.string(what)).collect::<Parse<_>>()?)
            }
            ValueType::Array => Array::Array(
                (0..n)
                    .map(|_| self.array(what, depth + 1))
                    .collect::<Parse<_>>()?,
            ),
        })
    }
}

pub fn parse(buf: &[u8]) -> Parse<Parsed> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c
        .bytes("the magic")
        .map_err(|_| format!("not a GGUF file: {} bytes is too short", buf.len()))?;
    if &magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file: it starts with {:?}, not \"GGUF\"",
            magic.escape_ascii().to_string()
        ));
    }
    let version = c.u32("the version")?;
    if !matches!(version, 2 | 3) {
        return Err(if matches!(version.swap_bytes(), 2 | 3) {
            "a big-endian GGUF file: Tessera reads little-endian ones".to_string()
        } else {
            format!("GGUF version {version} is not supported (Tessera reads versions 2 and 3)")
        });
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.count(MIN_KV_BYTES, "the metadata count", "metadata entries")?;

    let mut metadata = Vec::new();
    let mut keys = HashMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let what = format!("metadata `{key}`");
        let ty = c.value_type(&what)?;
        let value = c.value(ty, &what)?;
        if keys.insert(key.clone(), metadata.len()).is_some() {
            return Err(format!("{what} appears twice"));
        }
        metadata.push((key, value));
    }

    let alignment = match keys.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(&Value::U32(a)) if a.is_power_of_two() => a as usize,
        Some(v) => {
            return Err(format!(
                "metadata `general.alignment` must be a u32 power of two, not {v:?}"
            ));
        }
    };

    let n_tensors = usize::try_from(n_tensors)
        .ok()
        .filter(|n| {
            n.checked_mul(MIN_TENSOR_BYTES)
                .is_some_and(|b| b <= c.remaining())
        })
        .ok_or_else(|| {
            format!(
                "the tensor count {n_tensors} cannot fit in the {} bytes that remain of the file (truncated or corrupt)",
                c.remaining()
            )
        })?;
    let mut tensors = Vec::new();
    let mut names = HashMap::new();
    let mut offsets = Vec::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name #{i}"))?;
        let what = format!("tensor `{name}`");
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(format!(
                "{what}: {n_dims} dimensions (GGUF allows at most {MAX_DIMS})"
            ));
        }
        let dims = (0..n_dims)
            .map(|_| {
                let d = c.u64(&what)?;
                usize::try_from(d)
                    .ok()
                    .filter(|&d| d <= i64::MAX as usize)
                    .ok_or_else(|| format!("{what}: dimension {d} is too large"))
            })
            .collect::<Parse<Vec<usize>>>()?;
        let numel = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("{what}: dimensions {dims:?} overflow the element count"))?;
        let id = c.u32(&what)?;
        let ggml_type = GgmlType::from_id(id).map_err(|e| format!("{what}: {e}"))?;
        let row = dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(ggml_type.block_size()) {
            return Err(format!(
                "{what}: rows of {row} elements are not whole {ggml_type} blocks of {}",
                ggml_type.block_size()
            ));
        }
        let len = ggml_type.bytes_for(numel).ok_or_else(|| {
            format!("{what}: {numel} {ggml_type} elements overflow the size in bytes")
        })?;
        let offset = c.u64(&what)?;
        if offset % alignment as u64 != 0 {
            return Err(format!(
                "{what}: data offset {offset} is not a multiple of the alignment {alignment}"
            ));
        }
        if names.insert(name.clone(), tensors.len()).is_some() {
            return Err(format!("{what} appears twice"));
        }
        offsets.push((offset, len));
        tensors.push(TensorInfo {
            name,
            ggml_type,
            dims,
            start: 0,
            end: 0,
        });
    }

    // Data starts at the first aligned offset after the table.
    let data_start = (c.pos as u64).next_multiple_of(alignment as u64);
    for (t, (offset, len)) in tensors.iter_mut().zip(offsets) {
        let range = data_start
            .checked_add(offset)
            .and_then(|start| Some((start, start.checked_add(len as u64)?)))
            .filter(|&(_, end)| end <= buf.len() as u64);
        let Some((start, end)) = range else {
            return Err(format!(
                "tensor `{}`: its {len} bytes at data offset {offset} run past the end of the file ({} bytes; truncated?)",
                t.name,
                buf.len()
            ));
        };
        // Both are at most the file's length, so they fit in usize.
        (t.start, t.end) = (start as usize, end as usize);
    }

    Ok(Parsed {
        version,
        alignment,
        metadata,
        keys,
        tensors,
        names,
    })
}
