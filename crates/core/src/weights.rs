//! Safetensors checkpoints: one file, a sharded set with `*.safetensors.index.json`, or bytes
//! compiled into the binary.
//!
//! Files are memory-mapped and their headers validated once at open (a truncated or corrupt file
//! fails here, naming the file). Tensors are looked up by their published names, optionally under
//! a prefix ([`Weights::pp`]), and every typed read checks the shape so that a wrong checkpoint
//! fails at load with the tensor's name rather than mid-forward.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::dtype::{DType, widen_into};
use crate::error::{Error, Result};

enum Bytes {
    Mapped(Mmap),
    Static(&'static [u8]),
    /// Tensors re-laid-out on the host at open (see [`Weights::open_gguf_as`]).
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
            Bytes::Owned(v) => v,
        }
    }
}

/// How [`Weights::open_gguf_as`] shows one GGUF tensor to a loader that asks for another
/// checkpoint's names: under `name`, its stored axes reordered by `permute` (if any), then seen
/// as `shape` (if any: the same elements in the same order, e.g. a `[d, k]` convolution kernel
/// as `[d, 1, k]`).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufAs {
    pub name: String,
    /// `permute[i]` is the stored (outermost-first) axis of axis `i`.
    pub permute: Option<Vec<usize>>,
    pub shape: Option<Vec<usize>>,
}

struct Entry {
    /// The stored dtype, or the name of one Tessera does not read.
    dtype: std::result::Result<DType, String>,
    shape: Vec<usize>,
    /// Absolute byte range within the file.
    start: usize,
    end: usize,
}

struct File1 {
    path: PathBuf,
    bytes: Bytes,
    entries: HashMap<String, Entry>,
}

impl File1 {
    fn parse(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let buf = bytes.as_slice();
        let (header_len, meta) =
            SafeTensors::read_metadata(buf).map_err(|e| Error::Safetensors {
                path: path.clone(),
                message: describe_st_error(&e, buf),
            })?;
        let base = 8 + header_len;
        let entries = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let entry = Entry {
                    dtype: DType::from_safetensors(info.dtype).ok_or(format!("{:?}", info.dtype)),
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                (name, entry)
            })
            .collect();
        Ok(File1 {
            path,
            bytes,
            entries,
        })
    }
}

fn describe_st_error(e: &safetensors::SafeTensorError, buf: &[u8]) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer | E::InvalidHeaderLength | E::HeaderTooSmall => {
            format!(
                "truncated or corrupt ({} bytes do not match the header): {e}",
                buf.len()
            )
        }
        E::TensorInvalidInfo => mismatched_tensor(buf).unwrap_or_else(|| e.to_string()),
        _ => e.to_string(),
    }
}

/// Which tensor's byte range disagrees with its dtype and shape, for the safetensors crate's
/// error that does not say (`TensorInvalidInfo`). The header was already read once (its length
/// is bounded by the crate), so this only runs on a file that failed.
fn mismatched_tensor(buf: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Info {
        dtype: safetensors::Dtype,
        shape: Vec<usize>,
        data_offsets: (usize, usize),
    }
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
    let header = buf.get(8..8usize.checked_add(usize::try_from(n).ok()?)?)?;
    let map: HashMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut names: Vec<&String> = map.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let info: Info = serde_json::from_value(map[name].clone()).ok()?;
        let (a, b) = info.data_offsets;
        let want = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d))
            .map(|bits| bits.div_ceil(8));
        let have = b.checked_sub(a);
        (want != have).then(|| {
            let want = want.map_or("more than the address space".into(), |w| w.to_string());
            let have = have.map_or(format!("a reversed range {a}..{b}"), |h| h.to_string());
            format!(
                "tensor `{name}`: {:?} of shape {:?} takes {want} bytes, but its data offsets \
                 hold {have}",
                info.dtype, info.shape
            )
        })
    })
}

/// A set of safetensors files seen as one name → tensor map, possibly narrowed to a prefix.
#[derive(Clone)]
pub struct Weights {
    files: Arc<Vec<File1>>,
    /// Tensor name → index into `files`.
    index: Arc<HashMap<String, usize>>,
    prefix: String,
    /// Where the weights came from, for error messages.
    location: Arc<str>,
}

/// One tensor as stored: dtype, shape and raw little-endian bytes — borrowed from the
/// checkpoint's memory map, or owned when made on the host (values computed by a model, a
/// re-laid-out convolution weight).
pub struct Tensor<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Cow<'a, [u8]>,
    pub path: &'a Path,
    /// What the stored values are multiplied by: an FP8 tensor's scale stored beside it (see
    /// [`Weights::tensor`]); `None` for everything else.
    pub scale: Option<Scale>,
}

/// The scale of an FP8 tensor's stored values.
#[derive(Clone, Debug, PartialEq)]
pub enum Scale {
    /// One for the whole tensor (ComfyUI's `scale_weight`).
    Tensor(f32),
    /// One per row of a 2-D tensor (fbgemm's and compressed-tensors' per-channel
    /// `weight_scale`, `[rows, 1]`).
    Rows(Vec<f32>),
}

impl Scale {
    /// The scale of row `r`.
    pub fn row(&self, r: usize) -> f32 {
        match self {
            Scale::Tensor(s) => *s,
            Scale::Rows(v) => v[r],
        }
    }
}

impl Tensor<'_> {
    /// A host-made `f32` tensor (copied), `name` for messages.
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Result<Tensor<'static>> {
        let numel: usize = shape.iter().product();
        if numel != values.len() {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                path: PathBuf::from("<host>"),
                expected: shape,
                found: vec![values.len()],
            });
        }
        Ok(Tensor {
            name: name.to_string(),
            dtype: DType::F32,
            shape,
            bytes: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            path: Path::new("<host>"),
            scale: None,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements widened to `f32` (times the scale, if any, rounded to `f32`).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        widen_into(self.dtype, &self.bytes, &mut out);
        self.apply_scale(0, &mut out);
        out
    }

    /// Multiply `out`, elements `[start, start + out.len())`, by their scale.
    fn apply_scale(&self, start: usize, out: &mut [f32]) {
        match &self.scale {
            None => {}
            Some(Scale::Tensor(s)) => out.iter_mut().for_each(|v| *v *= s),
            Some(Scale::Rows(rows)) => {
                // Checked at read: a 2-D tensor with one scale per row.
                let cols = (self.numel() / rows.len().max(1)).max(1);
                for (i, v) in out.iter_mut().enumerate() {
                    *v *= rows[(start + i) / cols];
                }
            }
        }
    }

    /// Widen elements `[start, start + out.len())` (row-major) into `out`; for a block format
    /// both ends must fall on block boundaries (whole rows of a matrix whose width is a whole
    /// number of blocks, as [`Tensor::dims2_blocks`] checks).
    pub fn read_f32_range(&self, start: usize, out: &mut [f32]) {
        let bs = self.dtype.block_size();
        debug_assert!(start.is_multiple_of(bs) && out.len().is_multiple_of(bs));
        let (a, b) = (start / bs, (start + out.len()) / bs);
        let bb = self.dtype.block_bytes();
        widen_into(self.dtype, &self.bytes[a * bb..b * bb], out);
        self.apply_scale(start, out);
    }

    /// A matrix's `(rows, cols)` (as [`Tensor::dims2`]), checking for a block format that each
    /// row is a whole number of blocks and that the bytes hold exactly the rows' blocks: what
    /// reading a row at a time needs. The error names the tensor.
    pub fn dims2_blocks(&self) -> Result<(usize, usize)> {
        let (rows, cols) = self.dims2()?;
        let bs = self.dtype.block_size();
        if !cols.is_multiple_of(bs) {
            return Err(self.format_error(format!(
                "rows of {cols} values are not a whole number of {} blocks of {bs}",
                self.dtype
            )));
        }
        let want = rows.checked_mul(cols).and_then(|n| self.dtype.bytes_for(n));
        if want != Some(self.bytes.len()) {
            return Err(self.format_error(format!(
                "{} bytes of {} do not hold {rows}×{cols} values",
                self.bytes.len(),
                self.dtype
            )));
        }
        Ok((rows, cols))
    }

    fn format_error(&self, message: String) -> Error {
        Error::input(format!(
            "tensor `{}` in {}: {message}",
            self.name,
            self.path.display()
        ))
    }

    /// A 2-D tensor's `(rows, cols)`, or an error naming it.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            _ => Err(Error::ShapeMismatch {
                name: self.name.clone(),
                path: self.path.to_path_buf(),
                expected: vec![0, 0],
                found: self.shape.clone(),
            }),
        }
    }

    /// The same values with rows and columns of a 2-D tensor exchanged, or an axis permutation
    /// of a higher one: `perm[i]` is the source axis of result axis `i`. Kept in the stored dtype.
    pub fn permuted(&self, perm: &[usize]) -> Result<Tensor<'static>> {
        let n = self.shape.len();
        let mut seen = vec![false; n];
        if perm.len() != n
            || perm
                .iter()
                .any(|&p| p >= n || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::ShapeMismatch {
                name: format!("{} (permuted by {perm:?})", self.name),
                path: self.path.to_path_buf(),
                expected: perm.to_vec(),
                found: self.shape.clone(),
            });
        }
        let Some(size) = self.dtype.size() else {
            return Err(self.format_error(format!(
                "{} blocks cannot be permuted (dequantize first)",
                self.dtype
            )));
        };
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        // Row-major strides of the source, in elements.
        let mut strides = vec![1usize; n];
        for i in (0..n.saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.shape[i + 1];
        }
        let mut out = vec![0u8; self.bytes.len()];
        let mut idx = vec![0usize; n];
        for chunk in out.chunks_exact_mut(size) {
            let src: usize = idx.iter().zip(perm).map(|(&i, &p)| i * strides[p]).sum();
            chunk.copy_from_slice(&self.bytes[src * size..(src + 1) * size]);
            for d in (0..n).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(Tensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape,
            bytes: Cow::Owned(out),
            path: Path::new("<host>"),
            scale: self.scale.clone(),
        })
    }
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl Weights {
    /// Open a single `.safetensors` file.
    pub fn open_file(path: &Path) -> Result<Self> {
        let f = map_file(path)?;
        Self::from_files(vec![f], path.display().to_string())
    }

    /// Open the weights of a model folder: `{stem}.safetensors.index.json` (sharded) if present,
    /// else `{stem}.safetensors`. The stem is `model` for transformers checkpoints and
    /// `diffusion_pytorch_model` for diffusers components.
    pub fn open_dir(dir: &Path, stem: &str) -> Result<Self> {
        let index_path = dir.join(format!("{stem}.safetensors.index.json"));
        if index_path.is_file() {
            let index: ShardIndex = crate::config::read_json(&index_path)?;
            let mut shard_names: Vec<&String> = index.weight_map.values().collect();
            shard_names.sort();
            shard_names.dedup();
            let mut files = Vec::with_capacity(shard_names.len());
            for name in shard_names {
                let file = map_file(&dir.join(name))?;
                files.push(file);
            }
            let w = Self::from_files(files, index_path.display().to_string())?;
            // Every tensor the index promises must be in the shard it names.
            for (tensor, shard) in &index.weight_map {
                let Some(&fi) = w.index.get(tensor) else {
                    return Err(Error::MissingTensor {
                        name: tensor.clone(),
                        location: dir.join(shard).display().to_string(),
                    });
                };
                if w.files[fi].path.file_name() != Some(std::ffi::OsStr::new(shard)) {
                    return Err(Error::Safetensors {
                        path: index_path,
                        message: format!("`{tensor}` is listed in {shard} but stored elsewhere"),
                    });
                }
            }
            return Ok(w);
        }
        let single = dir.join(format!("{stem}.safetensors"));
        if single.is_file() {
            return Self::open_file(&single);
        }
        Err(Error::MissingFile {
            path: single,
            hint: format!(" (nor {})", index_path.display()),
        })
    }

    /// Open a GGUF file's tensors (ComfyUI-GGUF and stable-diffusion.cpp transformer files keep
    /// the original tensor names), block formats included: a quantized matrix reaches the
    /// backend as its blocks. Metadata is not read here (see [`crate::gguf::Gguf`]).
    pub fn open_gguf(path: &Path) -> Result<Self> {
        Self::open_gguf_as(&[path], &|_| None)
    }

    /// The tensors of several GGUF files (a language model and its vision projector) under the
    /// names `view` gives them, so that a loader written for another checkpoint's names and
    /// layouts reads them unchanged; a tensor `view` does not know keeps its GGUF name. Tensors
    /// stay in their files (block formats included) unless `view` permutes them: those are
    /// re-laid-out on the host once, a block format decoded to `f32` first (blocks run along
    /// the stored rows, so a permutation cannot keep them).
    pub fn open_gguf_as(paths: &[&Path], view: &dyn Fn(&str) -> Option<GgufAs>) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len() * 2);
        for &path in paths {
            let (map, tensors) = crate::gguf::Gguf::open(path)?.into_tensor_map();
            let bad = |name: &str, message: String| Error::Gguf {
                path: path.to_path_buf(),
                message: format!("tensor `{name}`: {message}"),
            };
            let mut entries = HashMap::new();
            let mut owned = Vec::new();
            let mut owned_entries = HashMap::new();
            for t in tensors {
                let Some(v) = view(&t.name) else {
                    let entry = Entry {
                        dtype: Ok(t.dtype),
                        shape: t.shape,
                        start: t.start,
                        end: t.end,
                    };
                    entries.insert(t.name, entry);
                    continue;
                };
                let (dtype, stored_shape, place) = match &v.permute {
                    None => (t.dtype, t.shape.clone(), None),
                    Some(perm) => {
                        let stored = Tensor {
                            name: t.name.clone(),
                            dtype: t.dtype,
                            shape: t.shape.clone(),
                            bytes: Cow::Borrowed(&map[t.start..t.end]),
                            path,
                            scale: None,
                        };
                        let stored = match t.dtype.size() {
                            Some(_) => stored,
                            None => Tensor::from_f32(&t.name, t.shape.clone(), &stored.to_f32())?,
                        };
                        let p = stored
                            .permuted(perm)
                            .map_err(|e| bad(&t.name, e.to_string()))?;
                        let start = owned.len();
                        owned.extend_from_slice(&p.bytes);
                        (p.dtype, p.shape, Some((start, owned.len())))
                    }
                };
                let shape = v.shape.clone().unwrap_or_else(|| stored_shape.clone());
                if shape.iter().product::<usize>() != stored_shape.iter().product::<usize>() {
                    return Err(bad(
                        &t.name,
                        format!(
                            "shape {stored_shape:?} cannot be seen as {shape:?} (`{}`)",
                            v.name
                        ),
                    ));
                }
                let (target, start, end) = match place {
                    None => (&mut entries, t.start, t.end),
                    Some((a, b)) => (&mut owned_entries, a, b),
                };
                let entry = Entry {
                    dtype: Ok(dtype),
                    shape,
                    start,
                    end,
                };
                if target.insert(v.name.clone(), entry).is_some() {
                    return Err(bad(
                        &t.name,
                        format!("a second tensor would be read as `{}`", v.name),
                    ));
                }
            }
            files.push(File1 {
                path: path.to_path_buf(),
                bytes: Bytes::Mapped(map),
                entries,
            });
            if !owned_entries.is_empty() {
                files.push(File1 {
                    path: path.to_path_buf(),
                    bytes: Bytes::Owned(owned),
                    entries: owned_entries,
                });
            }
        }
        let location: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        Self::from_files(files, location.join(" + "))
    }

    /// A single weights file: GGUF when named `*.gguf`, else safetensors.
    pub fn open_any(path: &Path) -> Result<Self> {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Self::open_gguf(path)
        } else {
            Self::open_file(path)
        }
    }

    /// Weights compiled into the binary (the bundled miniature models).
    pub fn from_static(label: &str, bytes: &'static [u8]) -> Result<Self> {
        let f = File1::parse(PathBuf::from(label), Bytes::Static(bytes))?;
        Self::from_files(vec![f], label.to_string())
    }

    fn from_files(files: Vec<File1>, location: String) -> Result<Self> {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.entries.keys() {
                if let Some(prev) = index.insert(name.clone(), i) {
                    return Err(Error::Safetensors {
                        path: f.path.clone(),
                        message: format!(
                            "tensor `{name}` also appears in {}",
                            files[prev].path.display()
                        ),
                    });
                }
            }
        }
        Ok(Weights {
            files: Arc::new(files),
            index: Arc::new(index),
            prefix: String::new(),
            location: location.into(),
        })
    }

    /// A view of the tensors under `prefix.` (joined with a dot, like the checkpoint names).
    pub fn pp(&self, prefix: impl std::fmt::Display) -> Weights {
        let mut w = self.clone();
        w.prefix = if self.prefix.is_empty() {
            prefix.to_string()
        } else {
            format!("{}.{prefix}", self.prefix)
        };
        w
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(&self.full_name(name))
    }

    /// Every tensor name in the checkpoint (not only under the prefix), sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.index.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Total stored bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.files
            .iter()
            .flat_map(|f| f.entries.values())
            .map(|e| e.end - e.start)
            .sum()
    }

    /// Total element count of all tensors.
    pub fn total_params(&self) -> usize {
        self.files
            .iter()
            .flat_map(|f| f.entries.values())
            .map(|e| e.shape.iter().product::<usize>())
            .sum()
    }

    /// The dtype most tensors are stored in (for `tessera info`).
    pub fn main_dtype(&self) -> Option<DType> {
        let mut bytes_by: HashMap<String, usize> = HashMap::new();
        for e in self.files.iter().flat_map(|f| f.entries.values()) {
            let key = match &e.dtype {
                Ok(d) => d.to_string(),
                Err(other) => other.clone(),
            };
            *bytes_by.entry(key).or_default() += e.end - e.start;
        }
        let (name, _) = bytes_by.into_iter().max_by_key(|(_, b)| *b)?;
        [
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_K,
            DType::Q6_K,
            DType::F8_E4M3,
        ]
        .into_iter()
        .find(|d| d.to_string() == name)
    }

    /// The tensor `name` (under the prefix), any shape. An FP8 tensor `<stem>.weight` comes
    /// with its scale when the checkpoint has one beside it: `<stem>.scale_weight` (ComfyUI's
    /// scaled FP8) or `<stem>.weight_scale` (ComfyUI's newer quantized layout, compressed-tensors,
    /// fbgemm), a float tensor of one element (per tensor) or, for a matrix, of one per row
    /// (`[rows, 1]` or `[rows]`); unscaled otherwise.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>> {
        let full = self.full_name(name);
        let Some(&fi) = self.index.get(&full) else {
            return Err(Error::MissingTensor {
                name: full,
                location: self.location.to_string(),
            });
        };
        let file = &self.files[fi];
        let e = &file.entries[&full];
        let dtype = e.dtype.clone().map_err(|dtype| Error::UnsupportedDtype {
            name: full.clone(),
            path: file.path.clone(),
            dtype,
        })?;
        let scale = match dtype {
            DType::F8_E4M3 => self.fp8_scale(&full, &e.shape)?,
            _ => None,
        };
        Ok(Tensor {
            name: full,
            dtype,
            shape: e.shape.clone(),
            bytes: Cow::Borrowed(&file.bytes.as_slice()[e.start..e.end]),
            path: &file.path,
            scale,
        })
    }

    /// The scale stored beside FP8 tensor `full` (a full checkpoint name) of `shape`, if any:
    /// finite numbers, one or one per row, or an error naming the scale's file and tensor.
    fn fp8_scale(&self, full: &str, shape: &[usize]) -> Result<Option<Scale>> {
        let Some(stem) = full.strip_suffix(".weight") else {
            return Ok(None);
        };
        let names = [
            format!("{stem}.scale_weight"),
            format!("{stem}.weight_scale"),
        ];
        let Some((scale_name, &fi)) = names
            .iter()
            .find_map(|n| self.index.get(n).map(|fi| (n, fi)))
        else {
            return Ok(None);
        };
        let file = &self.files[fi];
        let e = &file.entries[scale_name];
        let bad = |why: String| {
            Error::input(format!(
                "tensor `{scale_name}` in {}, the scale of FP8 tensor `{full}`: {why}",
                file.path.display()
            ))
        };
        let dtype = match &e.dtype {
            Ok(d @ (DType::F32 | DType::BF16 | DType::F16)) => *d,
            Ok(d) => return Err(bad(format!("stored as {d}, not a float"))),
            Err(d) => return Err(bad(format!("stored as {d}, not a float"))),
        };
        let n: usize = e.shape.iter().product();
        let rows = match (shape, &e.shape[..]) {
            (_, _) if n == 1 => None,
            ([r, _], [rr, 1] | [rr]) if r == rr => Some(*r),
            _ => {
                return Err(bad(format!(
                    "shape {:?} for a tensor of shape {shape:?}: one scale, or one per row of a \
                     matrix, is read (per-block FP8 scales are not supported)",
                    e.shape
                )));
            }
        };
        let mut v = vec![0f32; n];
        widen_into(dtype, &file.bytes.as_slice()[e.start..e.end], &mut v);
        if let Some((r, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(bad(format!("{x} (row {r}) is not a finite scale")));
        }
        Ok(Some(match rows {
            None => Scale::Tensor(v[0]),
            Some(_) => Scale::Rows(v),
        }))
    }

    /// Give back this process's resident pages of tensor `name` (the whole pages inside its
    /// bytes) once a backend has made its own copy: the mapped checkpoint's pages count as
    /// the process's memory for as long as they stay mapped in, and a bf16 model on the CPU
    /// would otherwise hold every matrix twice. The bytes stay readable: a later read faults
    /// them in again from the file. A no-op for weights not mapped from a file.
    pub fn release(&self, name: &str) {
        let full = self.full_name(name);
        let Some(&fi) = self.index.get(&full) else {
            return;
        };
        let file = &self.files[fi];
        let (Bytes::Mapped(map), Some(e)) = (&file.bytes, file.entries.get(&full)) else {
            return;
        };
        let page = page_size();
        let (start, end) = (e.start.next_multiple_of(page), e.end / page * page);
        #[cfg(unix)]
        if end > start {
            // SAFETY: a read-only private mapping of a file Tessera never writes: MADV_DONTNEED
            // drops the process's copies of these pages and the next read maps the same bytes
            // in again from the file (or page cache), so every borrow of them stays valid and
            // sees the same values.
            // A failure only means the pages stay resident.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor<'_>> {
        let t = self.tensor(name)?;
        if t.shape != shape {
            return Err(Error::ShapeMismatch {
                name: t.name,
                path: t.path.to_path_buf(),
                expected: shape.to_vec(),
                found: t.shape,
            });
        }
        Ok(t)
    }
}

fn map_file(path: &Path) -> Result<File1> {
    let map = crate::mapped::map_readonly(path)?;
    File1::parse(path.to_path_buf(), Bytes::Mapped(map))
}

/// The virtual memory page size.
fn page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            return n as usize;
        }
    }
    4096
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_st(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let bufs: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .zip(&bufs)
            .map(|((n, s, _), b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// Giving back a tensor's pages keeps its bytes readable and unchanged.
    #[test]
    fn released_tensors_read_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let big: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5).collect();
        write_st(
            &path,
            &[
                ("a", vec![100, 1000], big.clone()),
                ("b", vec![3], vec![1.0, 2.0, 3.0]),
            ],
        );
        let w = Weights::open_file(&path).unwrap();
        assert_eq!(w.tensor("a").unwrap().to_f32(), big);
        w.release("a");
        w.release("b");
        w.release("missing");
        assert_eq!(w.tensor("a").unwrap().to_f32(), big);
        assert_eq!(w.tensor("b").unwrap().to_f32(), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn reads_prefixed_and_checks_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        write_st(
            &p,
            &[("a.b.weight", vec![2, 3], vec![1., 2., 3., 4., 5., 6.])],
        );
        let w = Weights::open_dir(dir.path(), "model").unwrap();
        assert_eq!(
            w.pp("a").pp("b").get("weight", &[2, 3]).unwrap().to_f32()[5],
            6.0
        );
        let err = w
            .pp("a.b")
            .get("weight", &[3, 2])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("a.b.weight") && err.contains("[3, 2]"),
            "{err}"
        );
        let err = w.get("missing", &[1]).err().unwrap().to_string();
        assert!(err.contains("`missing`"), "{err}");
    }

    #[test]
    fn permuting_keeps_the_stored_dtype_and_moves_axes() {
        // [2, 3] → [3, 2]: a transpose.
        let t = Tensor::from_f32("t", vec![2, 3], &[0., 1., 2., 3., 4., 5.]).unwrap();
        let p = t.permuted(&[1, 0]).unwrap();
        assert_eq!(
            (p.shape.clone(), p.to_f32()),
            (vec![3, 2], vec![0., 3., 1., 4., 2., 5.])
        );
        // A conv weight [out, in, kh, kw] → [out, kh, kw, in].
        let w: Vec<f32> = (0..2 * 3 * 2 * 2).map(|v| v as f32).collect();
        let t = Tensor::from_f32("w", vec![2, 3, 2, 2], &w).unwrap();
        let p = t.permuted(&[0, 2, 3, 1]).unwrap();
        let got = p.to_f32();
        for o in 0..2 {
            for i in 0..3 {
                for k in 0..4 {
                    assert_eq!(got[(o * 4 + k) * 3 + i], w[(o * 3 + i) * 4 + k]);
                }
            }
        }
        assert!(t.permuted(&[0, 0, 1, 2]).is_err());
        assert!(Tensor::from_f32("x", vec![4], &[1.0]).is_err());
    }

    /// A tensor whose bytes disagree with its dtype and shape (here FP8 `[2, 3]` given 5 bytes,
    /// the file otherwise consistent) is named, with the file.
    #[test]
    fn a_tensor_of_the_wrong_byte_length_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fp8.safetensors");
        let header = r#"{"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b.weight":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[4,9]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 9]);
        std::fs::write(&p, bytes).unwrap();
        let err = Weights::open_file(&p).err().unwrap().to_string();
        assert!(
            err.contains("fp8.safetensors")
                && err.contains("`b.weight`")
                && err.contains("takes 6 bytes")
                && err.contains("hold 5"),
            "{err}"
        );
    }

    #[test]
    fn truncated_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        write_st(&p, &[("x", vec![4], vec![1., 2., 3., 4.])]);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::File::create(&p)
            .unwrap()
            .write_all(&bytes[..bytes.len() - 3])
            .unwrap();
        let err = Weights::open_file(&p).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");
        assert!(err.contains("model.safetensors"), "{err}");
    }

    #[test]
    fn sharded_index() {
        let dir = tempfile::tempdir().unwrap();
        write_st(
            &dir.path().join("m-1.safetensors"),
            &[("x", vec![1], vec![1.])],
        );
        write_st(
            &dir.path().join("m-2.safetensors"),
            &[("y", vec![1], vec![2.])],
        );
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"metadata":{},"weight_map":{"x":"m-1.safetensors","y":"m-2.safetensors"}}"#,
        )
        .unwrap();
        let w = Weights::open_dir(dir.path(), "model").unwrap();
        assert_eq!(w.get("y", &[1]).unwrap().to_f32(), vec![2.0]);
        assert_eq!(w.names(), vec!["x", "y"]);
    }

    #[test]
    fn missing_dir_names_both_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let err = Weights::open_dir(dir.path(), "model")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("index.json"),
            "{err}"
        );
    }

    /// A GGUF tensor seen under another name: in place and reshaped, or permuted on the host
    /// (a block format decoded first); a view that would give two tensors one name is refused.
    #[test]
    fn gguf_tensors_under_other_names_and_layouts() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        let lm = fixtures.join("lfm2vl_gguf/LFM2-VL-mini-Q8_0.gguf");
        let g = crate::gguf::Gguf::open(&lm).unwrap();
        let view = |n: &str| match n {
            "blk.0.shortconv.conv.weight" => Some(GgufAs {
                name: "conv".into(),
                permute: None,
                shape: Some(vec![128, 1, 3]),
            }),
            "blk.0.ffn_gate.weight" => Some(GgufAs {
                name: "gate_t".into(),
                permute: Some(vec![1, 0]),
                shape: None,
            }),
            _ => None,
        };
        let w = Weights::open_gguf_as(&[&lm], &view).unwrap();
        let conv = w.get("conv", &[128, 1, 3]).unwrap();
        let stored = g.tensor("blk.0.shortconv.conv.weight").unwrap();
        assert_eq!(conv.to_f32(), stored.to_f32().unwrap());
        // Q8_0 [144, 128] decoded and transposed.
        let gate = g.tensor("blk.0.ffn_gate.weight").unwrap().to_f32().unwrap();
        let t = w.get("gate_t", &[128, 144]).unwrap();
        assert_eq!(t.dtype, DType::F32);
        let got = t.to_f32();
        for (r, c) in [(0, 0), (5, 77), (127, 143)] {
            assert_eq!(got[r * 144 + c], gate[c * 128 + r]);
        }
        // Blocks stay blocks under a plain rename; unknown tensors keep their names.
        assert_eq!(w.tensor("blk.0.ffn_up.weight").unwrap().dtype, DType::Q8_0);
        let bad = Weights::open_gguf_as(&[&lm], &|n: &str| {
            n.starts_with("blk.0.ffn_").then(|| GgufAs {
                name: "same".into(),
                permute: None,
                shape: None,
            })
        });
        let e = bad.err().unwrap().to_string();
        assert!(
            e.contains("`same`") && e.contains("LFM2-VL-mini-Q8_0.gguf"),
            "{e}"
        );
        let reshape = Weights::open_gguf_as(&[&lm], &|n: &str| {
            (n == "blk.0.ffn_norm.weight").then(|| GgufAs {
                name: "n".into(),
                permute: None,
                shape: Some(vec![3, 3]),
            })
        });
        let e = reshape.err().unwrap().to_string();
        assert!(e.contains("[128]") && e.contains("[3, 3]"), "{e}");
    }
}
