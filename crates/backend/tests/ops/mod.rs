//! The op-test harness behind `tests/cuda_ops.rs`: seeded inputs, NaN-guarded buffers, the
//! comparison, and the traits every op family's case implements (one module per family).
//!
//! A case draws its inputs from a [`Rng`] seeded by its name, uploads them into buffers whose
//! every element outside the op's views is NaN ([`Guarded`]), runs its op on any [`Device`], and
//! reads back each output after checking that the NaN around it is untouched.

pub mod attention;
pub mod gemm;
pub mod image;
pub mod norm;
pub mod rows;
pub mod short_conv;

use std::panic::{AssertUnwindSafe, catch_unwind};

use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda::attention::{wgmma_applies, ws_applies};
use tessera_backend::cuda::{ConvPath, CudaBackend, FlashChoice, FlashKernel};
use tessera_backend::{
    AttnSpec, Backend, Conv2d, Error, Op, Precision, Role, Segments, View, ViewMut,
};
use tessera_core::{DType, Weights};

/// What a case returns: a tessera error, a harness message, anything with a message.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Both precisions, the runner's default.
pub const BOTH: &[Precision] = &[Precision::F32, Precision::Bf16];

/// xorshift64*: the same sequence on every machine, so a case's seed names its inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in `[-1, 1)`.
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32) * 2.0
            - 1.0
    }

    /// `n` values uniform in `[center − spread, center + spread)`, rounded to bf16 so that both
    /// precisions see the same values.
    pub fn around(&mut self, n: usize, center: f32, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|_| half::bf16::from_f32(center + self.next() * spread).to_f32())
            .collect()
    }

    /// `n` values uniform in `[-scale, scale)`, rounded to bf16.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        self.around(n, 0.0, scale)
    }
}

/// A case's seed: FNV-1a of its name, so the seed is fixed by what the case is.
pub fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Where a `rows × cols` view sits in its buffer: `left` and `right` guard columns in every row,
/// at least a whole guard row before the first row and one after the last.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
    pub offset: usize,
    pub len: usize,
}

impl Layout {
    pub fn padded(rows: usize, cols: usize, left: usize, right: usize) -> Self {
        let stride = left + cols + right;
        // The leading guard is rounded to 128 elements (256 bytes of bf16) so the view starts with
        // the alignment of `left`: kernels that choose a vector path by alignment choose as they
        // would for the same view at the start of its buffer.
        let lead = stride.max(1).next_multiple_of(128);
        Layout {
            rows,
            cols,
            stride,
            offset: lead + left,
            len: lead + (rows + 1) * stride,
        }
    }

    /// Whether element `i` of the buffer lies in the view.
    fn holds(&self, i: usize) -> bool {
        i >= self.offset
            && (i - self.offset) / self.stride < self.rows
            && (i - self.offset) % self.stride < self.cols
    }
}

/// A buffer that is NaN everywhere outside one view.
pub struct Guarded<B: Backend> {
    pub buf: B::Buf,
    pub at: Layout,
}

impl<B: Backend> Guarded<B> {
    /// NaN everywhere, then `values` (`rows × cols`, row-major) into the view; `None` leaves the
    /// view NaN too, so an element the op does not write fails the finiteness check.
    pub fn new(be: &B, role: Role, at: Layout, values: Option<&[f32]>) -> Res<Self> {
        let mut host = vec![f32::NAN; at.len];
        if let Some(v) = values {
            if v.len() != at.rows * at.cols {
                return Err(
                    format!("{} values for a {}×{} view", v.len(), at.rows, at.cols).into(),
                );
            }
            for (r, row) in v.chunks_exact(at.cols.max(1)).enumerate() {
                let start = at.offset + r * at.stride;
                host[start..start + at.cols].copy_from_slice(row);
            }
        }
        let mut buf = be.alloc(at.len, role)?;
        be.write_f32(&mut buf, &host)?;
        Ok(Guarded { buf, at })
    }

    /// The view drawn from `rng` in `[-scale, scale)`.
    pub fn drawn(be: &B, role: Role, at: Layout, rng: &mut Rng, scale: f32) -> Res<Self> {
        Self::new(be, role, at, Some(&rng.vec(at.rows * at.cols, scale)))
    }

    /// The view left NaN, for an op to write.
    pub fn empty(be: &B, role: Role, at: Layout) -> Res<Self> {
        Self::new(be, role, at, None)
    }

    pub fn view(&self) -> View<'_, B> {
        View {
            buf: &self.buf,
            offset: self.at.offset,
            rows: self.at.rows,
            cols: self.at.cols,
            stride: self.at.stride,
        }
    }

    pub fn view_mut(&mut self) -> ViewMut<'_, B> {
        ViewMut {
            buf: &mut self.buf,
            offset: self.at.offset,
            rows: self.at.rows,
            cols: self.at.cols,
            stride: self.at.stride,
        }
    }

    /// The view's values, once every element around it is checked to be NaN still.
    pub fn read(&self, be: &B, what: &'static str) -> Res<Output> {
        let at = self.at;
        let all = be.read_f32(View::new(&self.buf, 1, at.len))?;
        if let Some(i) = (0..at.len).find(|&i| !at.holds(i) && !all[i].is_nan()) {
            let (row, col) = (
                (i as isize - at.offset as isize).div_euclid(at.stride as isize),
                (i as isize - at.offset as isize).rem_euclid(at.stride as isize),
            );
            return Err(format!(
                "{what}: wrote {} outside the {}×{} view, at row {row}, column {col}",
                all[i], at.rows, at.cols
            )
            .into());
        }
        let values = (0..at.rows)
            .flat_map(|r| {
                let start = at.offset + r * at.stride;
                all[start..start + at.cols].iter().copied()
            })
            .collect();
        Ok(Output { what, values })
    }
}

/// f32 rows drawn from `rng` (adaLN gates and scales), with guard columns after them.
pub fn stream_rows<B: Backend>(
    be: &B,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    scale: f32,
) -> Res<Guarded<B>> {
    Guarded::drawn(
        be,
        Role::Stream,
        Layout::padded(rows, cols, 0, 8),
        rng,
        scale,
    )
}

/// An index buffer holding `values`.
pub fn indices<B: Backend>(be: &B, values: &[u32]) -> Res<B::Buf> {
    let mut buf = be.alloc(values.len().max(1), Role::Index)?;
    be.write_u32(&mut buf, values)?;
    Ok(buf)
}

/// Every patch `(x, y)` of packed `(width, height)` grids, row-major within each image.
pub fn patches(grids: &[(usize, usize)]) -> impl Iterator<Item = (usize, usize)> + '_ {
    grids
        .iter()
        .flat_map(|&(w, h)| (0..h).flat_map(move |y| (0..w).map(move |x| (x, y))))
}

/// A checkpoint of one tensor `name` of `shape` stored as `dtype` (BF16 or F32), in memory.
pub fn checkpoint(name: &str, shape: &[usize], dtype: DType, values: &[f32]) -> Res<Weights> {
    let (st, bytes): (_, Vec<u8>) = match dtype {
        DType::BF16 => (
            safetensors::Dtype::BF16,
            values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
        ),
        DType::F32 => (
            safetensors::Dtype::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        other => return Err(format!("checkpoint: {other} tables are not used here").into()),
    };
    let view = safetensors::tensor::TensorView::new(st, shape.to_vec(), &bytes)?;
    let file = safetensors::serialize([(name, view)], None)?;
    // `Weights` reads checkpoints in place (a memory map, or bytes that live as long as the
    // program): a test table of a few hundred KB is left to the process.
    Ok(Weights::from_static(
        name,
        Box::leak(file.into_boxed_slice()),
    )?)
}

/// One output of a case, as read back.
pub struct Output {
    pub what: &'static str,
    pub values: Vec<f32>,
}

/// How far a device's outputs may be from the CPU's: relative max error
/// (`max|a − b| / max|b|`) and NMSE (`Σ(a − b)² / Σb²`).
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rel: f64,
    pub nmse: f64,
}

impl Tol {
    /// Every op but attention.
    pub fn strict(p: Precision) -> Self {
        match p {
            Precision::F32 => Tol {
                rel: 2e-5,
                nmse: 1e-10,
            },
            Precision::Bf16 => Tol {
                rel: 1e-2,
                nmse: 3e-5,
            },
        }
    }

    /// Attention: bf16 re-rounds the probabilities to bf16 for the second product.
    pub fn loose(p: Precision) -> Self {
        match p {
            Precision::F32 => Self::strict(p),
            Precision::Bf16 => Tol {
                rel: 2e-2,
                nmse: 1e-4,
            },
        }
    }
}

/// Errors of one output against its reference.
#[derive(Clone, Copy, Debug, Default)]
pub struct Diff {
    pub rel: f64,
    pub nmse: f64,
}

impl Diff {
    pub fn within(&self, t: Tol) -> bool {
        self.rel <= t.rel && self.nmse <= t.nmse
    }

    pub fn max(self, o: Diff) -> Diff {
        Diff {
            rel: self.rel.max(o.rel),
            nmse: self.nmse.max(o.nmse),
        }
    }
}

/// `got` against `want`; an error when the lengths differ or an element of `got` is not finite.
pub fn measure(got: &[f32], want: &[f32]) -> Result<Diff, String> {
    if got.len() != want.len() {
        return Err(format!("{} values, want {}", got.len(), want.len()));
    }
    if let Some((i, (g, w))) = got
        .iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, _))| !g.is_finite())
    {
        return Err(format!("element {i} is {g} (want {w})"));
    }
    let scale = want.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let (mut max_err, mut se, mut ss) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g as f64 - w as f64).abs();
        max_err = max_err.max(d);
        se += d * d;
        ss += (w as f64) * (w as f64);
    }
    Ok(Diff {
        rel: max_err / scale.max(1e-30),
        nmse: se / ss.max(1e-30),
    })
}

/// Every output against the reference's, within `tol`: the worst errors, or what failed.
pub fn compare(got: &[Output], want: &[Output], tol: Tol) -> Result<Diff, String> {
    if got.len() != want.len() {
        return Err(format!("{} outputs, want {}", got.len(), want.len()));
    }
    let mut worst = Diff::default();
    for (g, w) in got.iter().zip(want) {
        let d = measure(&g.values, &w.values).map_err(|e| format!("{}: {e}", g.what))?;
        if !d.within(tol) {
            return Err(format!(
                "{}: rel max err {:.3e} (≤ {:.0e}), nmse {:.3e} (≤ {:.0e})",
                g.what, d.rel, tol.rel, d.nmse, tol.nmse
            ));
        }
        worst = worst.max(d);
    }
    Ok(worst)
}

/// Run `f`, turning a panic (a failed assertion in a backend, a view out of bounds) into an
/// error, so that one broken case does not hide the others.
pub fn catching<T>(f: impl FnOnce() -> Res<T>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(p) => Err(format!(
            "panicked: {}",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
        )),
    }
}

/// The operands of one attention call.
pub struct Attend<'a, B: Backend> {
    pub q: View<'a, B>,
    pub k: View<'a, B>,
    pub v: View<'a, B>,
    pub out: ViewMut<'a, B>,
    pub spec: &'a AttnSpec<'a, B>,
    pub segs: &'a Segments<B>,
}

/// A backend the table runs on: the op set, plus how a case forces an attention kernel path
/// (CUDA's flash kernels; the CPU has one path and ignores the choice).
pub trait Device: Backend + Sized {
    /// Whether this backend can take the forced path `flash` for heads of `head_dim` (under
    /// every mask of a sequence's own rows, per-row key limits included).
    fn flash_supported(&self, flash: FlashChoice, head_dim: usize) -> tessera_backend::Result<()>;

    /// Whether this device has the forced convolution kernel `path` (the wgmma one: Hopper).
    fn conv_supported(&self, path: ConvPath) -> tessera_backend::Result<()>;

    /// The attention op, or with `flash` the forced path, checked to have split the keys into
    /// as many chunks as asked.
    fn attend(&self, a: Attend<'_, Self>, flash: Option<FlashChoice>) -> Res<()>;

    /// The convolution op, or with `path` that kernel path forced (CUDA; the CPU has one).
    fn convolve(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        bias: &Self::Vector,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
        path: Option<ConvPath>,
    ) -> Res<()>;
}

impl Device for CpuBackend {
    fn flash_supported(&self, _: FlashChoice, _: usize) -> tessera_backend::Result<()> {
        Ok(())
    }

    fn conv_supported(&self, _: ConvPath) -> tessera_backend::Result<()> {
        Ok(())
    }

    fn attend(&self, a: Attend<'_, Self>, _: Option<FlashChoice>) -> Res<()> {
        Ok(self.attention(a.q, a.k, a.v, a.out, a.spec, a.segs)?)
    }

    fn convolve(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        bias: &Self::Vector,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
        _: Option<ConvPath>,
    ) -> Res<()> {
        Ok(self.conv2d(x, w, bias, spec, out)?)
    }
}

impl Device for CudaBackend {
    fn flash_supported(&self, flash: FlashChoice, head_dim: usize) -> tessera_backend::Result<()> {
        if self.precision() != Precision::Bf16 {
            return Err(Error::Device(
                "the flash kernels run under bf16 only".into(),
            ));
        }
        if flash.kernel == Some(FlashKernel::Wgmma) && !wgmma_applies(self.arch(), head_dim) {
            return Err(Error::Device(format!(
                "no wgmma kernel for head_dim {head_dim} on {}",
                self.arch()
            )));
        }
        if flash.kernel == Some(FlashKernel::Ws) && !ws_applies(self.arch(), head_dim) {
            return Err(Error::Device(format!(
                "no warp-specialized kernel for head_dim {head_dim} on {}",
                self.arch()
            )));
        }
        Ok(())
    }

    fn attend(&self, a: Attend<'_, Self>, flash: Option<FlashChoice>) -> Res<()> {
        let Some(choice) = flash else {
            return Ok(self.attention(a.q, a.k, a.v, a.out, a.spec, a.segs)?);
        };
        let used = self.attention_with(a.q, a.k, a.v, a.out, a.spec, a.segs, choice)?;
        match choice.splits {
            Some(n) if n != used => Err(format!(
                "ran {used} key chunks, not {n}: the split did not fit the workspace"
            )
            .into()),
            _ => Ok(()),
        }
    }

    fn conv_supported(&self, path: ConvPath) -> tessera_backend::Result<()> {
        self.conv_path_available(path)
    }

    fn convolve(
        &self,
        x: View<'_, Self>,
        w: &Self::Mat,
        bias: &Self::Vector,
        spec: &Conv2d,
        out: ViewMut<'_, Self>,
        path: Option<ConvPath>,
    ) -> Res<()> {
        match path {
            Some(path) => Ok(self.conv2d_with(x, w, bias, spec, out, path)?),
            None => Ok(self.conv2d(x, w, bias, spec, out)?),
        }
    }
}

/// One case of one op family: its parameters, its op, and how it runs on any backend.
pub trait OpCase: Clone + 'static {
    /// The op and every parameter, e.g. `matmul 17×512×1536 α=0.75 → Compute`.
    fn name(&self) -> String;

    /// The op the case calls, as [`Backend::supports`] is asked about it. The CPU self-check
    /// compares it with what the case really calls.
    fn op(&self) -> Op;

    /// Draw the inputs from `rng`, upload them to `be`, run the op, read every output. The
    /// precision is the backend's own (the CPU's is always f32).
    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>>;

    /// Whether `be` runs this case: its op, and for attention the forced kernel path.
    fn supported<B: Device>(&self, be: &B) -> tessera_backend::Result<()> {
        be.supports(&self.op())
    }

    fn tol(&self, p: Precision) -> Tol {
        Tol::strict(p)
    }

    fn precisions(&self) -> &'static [Precision] {
        BOTH
    }

    /// The seed of the inputs; cases that differ only in the path a device takes share one.
    fn seed(&self) -> u64 {
        seed_of(&self.name())
    }

    /// The same case with fewer rows for the CPU self-check, where a shape is huge; the GPU runs
    /// the case itself.
    fn shrunk(&self) -> Self {
        self.clone()
    }
}

/// The backends a case runs on.
#[derive(Clone, Copy)]
pub enum Dev<'a> {
    Cpu(&'a CpuBackend),
    Cuda(&'a CudaBackend),
}

/// An [`OpCase`] of any family, so that one table holds them all.
pub trait Case {
    fn name(&self) -> String;
    fn op(&self) -> Op;
    fn seed(&self) -> u64;
    fn tol(&self, p: Precision) -> Tol;
    fn precisions(&self) -> &'static [Precision];
    fn supported_on(&self, dev: Dev<'_>) -> tessera_backend::Result<()>;
    /// The case's run from its seed.
    fn run_on(&self, dev: Dev<'_>) -> Res<Vec<Output>>;
    fn shrunk(&self) -> Box<dyn Case>;
}

impl<T: OpCase> Case for T {
    fn name(&self) -> String {
        OpCase::name(self)
    }
    fn op(&self) -> Op {
        OpCase::op(self)
    }
    fn seed(&self) -> u64 {
        OpCase::seed(self)
    }
    fn tol(&self, p: Precision) -> Tol {
        OpCase::tol(self, p)
    }
    fn precisions(&self) -> &'static [Precision] {
        OpCase::precisions(self)
    }
    fn supported_on(&self, dev: Dev<'_>) -> tessera_backend::Result<()> {
        match dev {
            Dev::Cpu(be) => self.supported(be),
            Dev::Cuda(be) => self.supported(be),
        }
    }
    fn run_on(&self, dev: Dev<'_>) -> Res<Vec<Output>> {
        let mut rng = Rng::new(OpCase::seed(self));
        match dev {
            Dev::Cpu(be) => self.run(be, &mut rng),
            Dev::Cuda(be) => self.run(be, &mut rng),
        }
    }
    fn shrunk(&self) -> Box<dyn Case> {
        Box::new(OpCase::shrunk(self))
    }
}

/// The case table as it is written: one `add` per case.
#[derive(Default)]
pub struct Table(pub Vec<Box<dyn Case>>);

impl Table {
    pub fn add(&mut self, case: impl OpCase) {
        self.0.push(Box::new(case));
    }

    /// Cases that one generator derives from one line (attention on every kernel path).
    pub fn add_all<C: OpCase>(&mut self, cases: impl IntoIterator<Item = C>) {
        for c in cases {
            self.add(c);
        }
    }
}
