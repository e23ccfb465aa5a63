//! Loading a checkpoint's tensors onto a backend, shared by every family: names under a prefix,
//! shapes checked against the config (a wrong checkpoint fails at load, naming the tensor),
//! stacked matrices (q|k|v, gate|up) in one upload, and `nn.Linear` weight + bias pairs.
//! Tensors go to the backend in their stored dtype; the backend converts them.

use std::fmt::Display;

use tessera_backend::{Backend, Epilogue, Tensor};
use tessera_core::{Error, Result, Weights};

/// A checkpoint seen from one module of a model, with the backend its tensors load onto.
pub struct Loader<'a, B: Backend> {
    be: &'a B,
    root: Weights,
    /// Dotted prefix of the module (`layers.3`), empty at the root.
    prefix: String,
    /// Maps a full name (prefix included) to the checkpoint's name, for checkpoints that name
    /// tensors differently from the reference (Z-Image's original / ComfyUI layout).
    rename: Option<&'a (dyn Fn(&str) -> String + Sync)>,
}

impl<B: Backend> Clone for Loader<'_, B> {
    fn clone(&self) -> Self {
        Loader {
            be: self.be,
            root: self.root.clone(),
            prefix: self.prefix.clone(),
            rename: self.rename,
        }
    }
}

/// An `nn.Linear`: weight `[out, in]` and bias `[out]`.
pub struct Linear<B: Backend> {
    pub w: B::Mat,
    pub b: B::Vector,
}

impl<B: Backend> Linear<B> {
    /// `out = x · wᵀ + b`, as a product's epilogue.
    pub fn epilogue(&self) -> Epilogue<'_, B> {
        Epilogue::bias(&self.b)
    }
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(be: &'a B, weights: &Weights) -> Self {
        Loader {
            be,
            root: weights.clone(),
            prefix: String::new(),
            rename: None,
        }
    }

    /// The same loader, asking the checkpoint for `rename(full name)`.
    pub fn renamed(self, rename: &'a (dyn Fn(&str) -> String + Sync)) -> Self {
        Loader {
            rename: Some(rename),
            ..self
        }
    }

    /// The module `prefix` under this one (`layers.3`, `self_attn`).
    pub fn pp(&self, prefix: impl Display) -> Self {
        Loader {
            prefix: self.full(&prefix.to_string()),
            ..self.clone()
        }
    }

    pub fn backend(&self) -> &'a B {
        self.be
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    fn stored(&self, name: &str) -> String {
        let full = self.full(name);
        match self.rename {
            Some(f) => f(&full),
            None => full,
        }
    }

    /// Whether the checkpoint has `name` (under this prefix).
    pub fn has(&self, name: &str) -> bool {
        self.root.contains(&self.stored(name))
    }

    /// The tensor `name`, which must have exactly `shape`, in its stored dtype.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor<'_>> {
        self.root.get(&self.stored(name), shape)
    }

    /// A parameter vector `[n]`, kept in `f32`.
    pub fn vector(&self, name: &str, n: usize) -> Result<B::Vector> {
        self.be.vector(&self.tensor(name, &[n])?)
    }

    /// A weight matrix `[out, inner]`.
    pub fn matrix(&self, name: &str, out: usize, inner: usize) -> Result<B::Mat> {
        let m = self.be.matrix(&[self.tensor(name, &[out, inner])?])?;
        // The backend holds its own copy now: the mapped pages need not stay resident.
        self.root.release(&self.stored(name));
        Ok(m)
    }

    /// Matrices `[rows_i, inner]` stacked along their rows into one (q|k|v, gate|up), so a
    /// single product computes them all.
    pub fn stacked(&self, parts: &[(&str, usize)], inner: usize) -> Result<B::Mat> {
        let tensors = parts
            .iter()
            .map(|&(name, rows)| self.tensor(name, &[rows, inner]))
            .collect::<Result<Vec<_>>>()?;
        let m = self.be.matrix(&tensors)?;
        drop(tensors);
        for &(name, _) in parts {
            self.root.release(&self.stored(name));
        }
        Ok(m)
    }

    /// Vectors `[n_i]` joined end to end (the biases of stacked matrices).
    pub fn stacked_vector(&self, parts: &[(&str, usize)]) -> Result<B::Vector> {
        let mut values = Vec::with_capacity(parts.iter().map(|p| p.1).sum());
        for &(name, n) in parts {
            values.extend(self.tensor(name, &[n])?.to_f32());
        }
        self.be.vector_f32(&values)
    }

    /// `{name}.weight` `[out, inner]` and `{name}.bias` `[out]` of an `nn.Linear`.
    pub fn linear(&self, name: &str, out: usize, inner: usize) -> Result<Linear<B>> {
        Ok(Linear {
            w: self.matrix(&format!("{name}.weight"), out, inner)?,
            b: self.vector(&format!("{name}.bias"), out)?,
        })
    }

    /// An embedding table of `shape`, read by rows of its last axis (see `Backend::table`).
    pub fn table(&self, name: &str, shape: &[usize]) -> Result<B::Table> {
        self.be.table(&self.root, &self.stored(name), shape)
    }

    /// A one-element tensor (`[1]`) as a number.
    pub fn scalar(&self, name: &str) -> Result<f32> {
        let t = self.tensor(name, &[1])?;
        t.to_f32()
            .first()
            .copied()
            .ok_or_else(|| Error::backend("load", format!("`{}` is empty", t.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_backend::View;
    use tessera_backend::cpu::CpuBackend;

    /// An f32 checkpoint of `tensors`, serialised in memory and left to the test process.
    fn weights(tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> Weights {
        let bufs: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views = tensors.iter().zip(&bufs).map(|((n, s, _), b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (*n, v)
        });
        let file = safetensors::serialize(views, None).unwrap();
        Weights::from_static("<test>", Box::leak(file.into_boxed_slice())).unwrap()
    }

    #[test]
    fn stacks_renames_and_names_the_bad_tensor() {
        let w = weights(&[
            (
                "m.layers.0.q.weight",
                vec![2, 3],
                (0..6).map(|v| v as f32).collect(),
            ),
            ("m.layers.0.k.weight", vec![1, 3], vec![6.0, 7.0, 8.0]),
            (
                "m.layers.0.fused_out.weight",
                vec![3, 1],
                vec![1.0, 2.0, 3.0],
            ),
            ("m.layers.0.fused_out.bias", vec![3], vec![0.5, 0.5, 0.5]),
        ]);
        let be = CpuBackend::new();
        let rename = |n: &str| n.replace(".out.", ".fused_out.");
        let l = Loader::new(&be, &w).pp("m").renamed(&rename).pp("layers.0");
        // q|k stacked into one [3, 3] matrix: the product with the identity reads it back.
        let qk = l.stacked(&[("q.weight", 2), ("k.weight", 1)], 3).unwrap();
        let mut x = be.alloc(9, tessera_backend::Role::Stream).unwrap();
        be.write_f32(&mut x, &[1., 0., 0., 0., 1., 0., 0., 0., 1.])
            .unwrap();
        let mut out = be.alloc(9, tessera_backend::Role::Stream).unwrap();
        be.matmul(
            View::new(&x, 3, 3),
            &qk,
            tessera_backend::ViewMut::new(&mut out, 3, 3),
            &Epilogue::default(),
        )
        .unwrap();
        let got = be.read_f32(View::new(&out, 3, 3)).unwrap();
        // Row r of the result is column r of the stacked matrix.
        assert_eq!(got, [0., 3., 6., 1., 4., 7., 2., 5., 8.]);
        // The renamed linear loads; a wrong shape names the checkpoint's tensor.
        assert!(l.linear("out", 3, 1).is_ok());
        let err = l.matrix("q.weight", 3, 3).err().unwrap().to_string();
        assert!(
            err.contains("m.layers.0.q.weight") && err.contains("[3, 3]"),
            "{err}"
        );
        assert!(l.has("out.bias") && !l.has("v.weight"));
    }
}
