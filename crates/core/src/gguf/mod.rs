//! GGUF files (llama.cpp's format): typed metadata, a tensor table, and tensor data in ggml's
//! block formats, read through `mmap` so that tensors are borrowed from the file, not copied.
//!
//! Everything in the file is untrusted. [`Gguf::open`] checks every count, length, dimension and
//! offset against the file's size before using it, and fails with [`Error::Gguf`] naming the file
//! and the key or tensor at fault; once open, every tensor's bytes lie within the file and are a
//! whole number of blocks of its [`GgmlType`]. Versions 2 and 3 (identical when little-endian)
//! are read.

mod ggml_type;
mod k_quants;
mod metadata;
mod parse;
mod q4_0;
mod q8_0;
mod quantize;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use ggml_type::GgmlType;
pub use k_quants::q6_k_codes;
pub use k_quants::scale_min as q4_k_scale_min;
pub use metadata::{Array, Value, ValueType};
use parse::TensorInfo;
pub use quantize::quantize;

use crate::error::{Error, Result};

/// An f16 scale stored little-endian, as every block format keeps its scales. Here, beside the
/// codecs rather than in `ggml_type.rs`, which dispatches to them.
fn f16_at(b: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(b).to_f32()
}

/// An open GGUF file: its metadata and tensor table, parsed and checked, over a read-only map.
pub struct Gguf {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
}

/// A tensor's name, storage type, shape (outermost first) and byte range in its file's map.
pub(crate) struct MappedTensor {
    pub name: String,
    pub dtype: crate::DType,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// One tensor as stored in a GGUF file, borrowed from its map.
#[derive(Clone, Copy)]
pub struct GgufTensor<'a> {
    pub name: &'a str,
    pub ggml_type: GgmlType,
    /// Dimensions in GGUF order: `dims[0]` is the innermost (contiguous) one, ggml's `ne`.
    pub dims: &'a [usize],
    /// The stored blocks.
    pub bytes: &'a [u8],
    pub path: &'a Path,
}

/// Without the bytes: a tensor's debug form should not print megabytes.
impl std::fmt::Debug for GgufTensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTensor")
            .field("name", &self.name)
            .field("ggml_type", &self.ggml_type)
            .field("dims", &self.dims)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl GgufTensor<'_> {
    /// Dimensions outermost first (row-major), as safetensors and [`crate::Tensor`] give them.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// All elements decoded to `f32`.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.numel()];
        self.dequantize_into(&mut out)?;
        Ok(out)
    }

    /// Decode all elements into `out`, which must hold [`Self::numel`].
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        self.ggml_type
            .dequantize(self.bytes, out)
            .map_err(|e| self.error(e.to_string()))
    }

    fn error(&self, message: String) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            message: format!("tensor `{}`: {message}", self.name),
        }
    }
}

impl Gguf {
    /// Map and parse `path`; fails naming the file and the key or tensor at fault.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let map = crate::mapped::map_readonly(path)?;
        let parsed = parse::parse(&map).map_err(|message| Error::Gguf {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(Gguf {
            path: path.to_path_buf(),
            map,
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            keys: parsed.keys,
            tensors: parsed.tensors,
            names: parsed.names,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data: `general.alignment`, or 32.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value under `key`, if the file has one.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.wrong_type(key, v, "string")),
        }
    }

    /// An integer of any stored width, if its value fits a `u32` (converters differ in the width
    /// they write for counts and ids).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "u32")
    }

    /// As [`Self::get_u32`], for `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "u64")
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            Value::F32(v) => Ok(*v),
            v => Err(self.wrong_type(key, v, "f32")),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(v) => Ok(*v),
            v => Err(self.wrong_type(key, v, "bool")),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, v, "array")),
        }
    }

    /// An array of strings (a vocabulary, merges).
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            Array::String(s) => Ok(s),
            a => Err(self.key_error(
                key,
                format!("is an array of {}, expected strings", a.elem_type()),
            )),
        }
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = GgufTensor<'_>> {
        self.tensors.iter().map(|t| self.view(t))
    }

    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>> {
        match self.names.get(name) {
            Some(&i) => Ok(self.view(&self.tensors[i])),
            None => Err(Error::MissingTensor {
                name: name.to_string(),
                location: self.path.display().to_string(),
            }),
        }
    }

    /// The map and every tensor's place in it: what [`crate::Weights::open_gguf`] reads a GGUF
    /// file's tensors through.
    pub(crate) fn into_tensor_map(self) -> (Mmap, Vec<MappedTensor>) {
        let tensors = self
            .tensors
            .into_iter()
            .map(|t| MappedTensor {
                shape: t.dims.iter().rev().copied().collect(),
                dtype: crate::DType::from_ggml(t.ggml_type),
                name: t.name,
                start: t.start,
                end: t.end,
            })
            .collect();
        (self.map, tensors)
    }

    fn view<'a>(&'a self, t: &'a TensorInfo) -> GgufTensor<'a> {
        GgufTensor {
            name: &t.name,
            ggml_type: t.ggml_type,
            dims: &t.dims,
            // In bounds: checked against the file's length at open.
            bytes: &self.map[t.start..t.end],
            path: &self.path,
        }
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| self.key_error(key, "not found".to_string()))
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, want: &str) -> Result<T> {
        let v = self.require(key)?;
        let n = v.as_i128().ok_or_else(|| self.wrong_type(key, v, want))?;
        T::try_from(n).map_err(|_| self.key_error(key, format!("= {n} does not fit in {want}")))
    }

    fn wrong_type(&self, key: &str, v: &Value, want: &str) -> Error {
        self.key_error(key, format!("has type {}, expected {want}", v.value_type()))
    }

    fn key_error(&self, key: &str, message: String) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            message: format!("metadata `{key}` {message}"),
        }
    }
}
