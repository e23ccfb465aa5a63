//! Typed kernel launches.
//!
//! Each op family declares its kernels once, beside its `.cu`: an argument struct per C signature
//! ([`kernel_args!`]) and a table of the source's kernels ([`kernel_table!`]), each field one
//! kernel family with its variants ([`Kernel`]: one name; [`ByElem`]: one per element type;
//! [`ByPair`]: one per input/output pair; [`ByDim`]: one per head width; [`ByDimPair`]: one per
//! row count and pair). Every table is resolved when the backend opens, so a missing kernel fails
//! at start-up naming kernel and source; ops pick a field by element type, never by a built name;
//! and a [`Kernel<A>`] launches only with its own `A`, so a wrong argument list does not compile.
//!
//! What rustc cannot see — that a table's names are in its cubin and that each args struct
//! matches its kernel's C parameter list — CI checks from the tables themselves with NVRTC
//! (`tests/nvrtc_compile.rs`: the cubin's names, the C parameter types, the PTX parameter
//! sizes), so neither can drift.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaFunction, CudaModule, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use tessera_core::{Error, Result};

use super::errors::drv;
use super::{CudaBackend, Elem};

/// A kernel parameter's C type, as far as the launch ABI tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (8 bytes).
    Ptr,
    /// `long` (8 bytes).
    I64,
    /// `int` (4 bytes).
    I32,
    /// `float`.
    F32,
    /// A tensor map passed by value (`const __grid_constant__ TmaDesc`: 128 bytes, 64-aligned).
    TensorMap,
}

/// A device address, passed as a pointer parameter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct DevPtr(pub u64);

impl DevPtr {
    pub const NULL: DevPtr = DevPtr(0);
}

// SAFETY: `DevPtr` is `repr(transparent)` over `u64`, the 8 bytes of a device pointer parameter.
unsafe impl DeviceRepr for DevPtr {}

/// One or more consecutive kernel parameters: a scalar (`DevPtr` for a pointer, `i64` for
/// `long`, `i32` for `int`, `f32` for `float`), or a [`kernel_args!`] struct of them.
///
/// # Safety
///
/// `push` pushes exactly the parameters `params` lists, in order, each as a value of that C
/// type's size and representation. [`kernel_args!`] generates both from one field list.
pub unsafe trait KernelArgs {
    /// Append the C parameter types, in order (checked in CI against the kernel's C types and PTX).
    fn params(out: &mut Vec<Param>);
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>);
    /// Append a pointer to each parameter's value, in order: the driver's `kernelParams` array
    /// (for launches made without cudarc's builder, [`CudaBackend::launch`]'s overlapped ones).
    fn param_ptrs(&self, out: &mut Vec<*mut c_void>);
}

macro_rules! scalar_args {
    ($($ty:ty => $param:ident),*) => {$(
        // SAFETY: one value of the parameter's own C type.
        unsafe impl KernelArgs for $ty {
            fn params(out: &mut Vec<Param>) {
                out.push(Param::$param);
            }
            fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
                launch.arg(self);
            }
            fn param_ptrs(&self, out: &mut Vec<*mut c_void>) {
                out.push((self as *const $ty).cast_mut().cast());
            }
        }
    )*};
}
scalar_args!(DevPtr => Ptr, i64 => I64, i32 => I32, f32 => F32, TensorMap => TensorMap);

/// A tensor map for the tensor-memory accelerator, encoded by the driver
/// (`cuTensorMapEncodeTiled`) and passed by value: kernels take it as a
/// `const __grid_constant__ TmaDesc` (kernels/common.cuh).
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub struct TensorMap(pub cudarc::driver::sys::CUtensorMap);

// SAFETY: `TensorMap` is `repr(transparent)` over the driver's `CUtensorMap`, the 128 bytes the
// kernel's `TmaDesc` parameter takes; the launch copies them by value.
unsafe impl DeviceRepr for TensorMap {}

/// The C parameter list of `A`.
pub fn params_of<A: KernelArgs>() -> Vec<Param> {
    let mut params = Vec::new();
    A::params(&mut params);
    params
}

/// A kernel's argument struct: fields in the order of its C parameters, each a scalar of its
/// parameter's type or a struct of several (operands that several kernels take first).
macro_rules! kernel_args {
    ($(#[$doc:meta])* $vis:vis struct $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        $vis struct $name {
            $(pub $field: $ty,)*
        }

        // SAFETY: `params` and `push` follow the same field list, in order, each field
        // `KernelArgs` itself.
        unsafe impl $crate::cuda::launch::KernelArgs for $name {
            fn params(out: &mut Vec<$crate::cuda::launch::Param>) {
                $(<$ty as $crate::cuda::launch::KernelArgs>::params(out);)*
            }
            fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
                $($crate::cuda::launch::KernelArgs::push(&self.$field, launch);)*
            }
            fn param_ptrs(&self, out: &mut Vec<*mut std::ffi::c_void>) {
                $($crate::cuda::launch::KernelArgs::param_ptrs(&self.$field, out);)*
            }
        }
    };
}
pub(super) use kernel_args;

/// One loaded kernel, launched with arguments `A`; its name labels profiler spans and errors.
pub struct Kernel<A> {
    func: CudaFunction,
    name: String,
    _args: PhantomData<fn(&A)>,
}

impl<A> Kernel<A> {
    fn load(module: &Arc<CudaModule>, source: &str, name: String) -> Result<Self> {
        let func = module
            .load_function(&name)
            .map_err(|e| Error::backend(format!("kernel {name} in {source}"), e))?;
        Ok(Kernel {
            func,
            name,
            _args: PhantomData,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn func(&self) -> &CudaFunction {
        &self.func
    }

    /// Let launches of this kernel take `bytes` of dynamic shared memory (more than the 48 KB a
    /// launch gets without asking).
    pub fn allow_shared_memory(&self, bytes: usize) -> Result<()> {
        self.func
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| Error::backend(format!("{}: {bytes} B of shared memory", self.name), e))
    }
}

/// How a table field names and holds its kernels. `Spec` is what the table declares: a name, or a
/// pattern with a `{}` for each element type's tag (`"rms_norm_{}_{}"`).
pub trait Variants: Sized {
    type Args: KernelArgs;
    type Spec: Copy;
    /// Every kernel name, in the order [`Variants::assemble`] takes the loaded kernels.
    fn names(spec: Self::Spec) -> Vec<String>;
    /// The field from the kernels of `names(spec)`, loaded in order.
    fn assemble(spec: Self::Spec, kernels: Vec<Kernel<Self::Args>>) -> Option<Self>;
}

/// The element types kernels are instantiated for, in variant order.
const FLOATS: [Elem; 2] = [Elem::F32, Elem::Bf16];

fn slot(e: Elem) -> Option<usize> {
    FLOATS.iter().position(|&f| f == e)
}

/// `pattern` with each `{}` replaced by the next of `tags`.
fn fill(pattern: &str, tags: &[&str]) -> String {
    tags.iter()
        .fold(pattern.to_string(), |name, tag| name.replacen("{}", tag, 1))
}

fn no_variant(pattern: &str, elems: &[Elem]) -> Error {
    Error::backend(
        "kernel lookup",
        format!("{pattern} has no variant for {elems:?}"),
    )
}

impl<A: KernelArgs> Variants for Kernel<A> {
    type Args = A;
    type Spec = &'static str;
    fn names(name: &'static str) -> Vec<String> {
        vec![name.to_string()]
    }
    fn assemble(_: &'static str, kernels: Vec<Kernel<A>>) -> Option<Self> {
        kernels.into_iter().next()
    }
}

/// One kernel per element type: `{pattern}` with the type's tag (`f32`, `bf16`) for its `{}`.
pub struct ByElem<A> {
    pattern: &'static str,
    kernels: [Kernel<A>; 2],
}

impl<A> ByElem<A> {
    pub fn get(&self, e: Elem) -> Result<&Kernel<A>> {
        slot(e)
            .map(|i| &self.kernels[i])
            .ok_or_else(|| no_variant(self.pattern, &[e]))
    }

    /// Every variant, in element-type order.
    pub fn all(&self) -> impl Iterator<Item = &Kernel<A>> {
        self.kernels.iter()
    }
}

impl<A: KernelArgs> Variants for ByElem<A> {
    type Args = A;
    type Spec = &'static str;
    fn names(pattern: &'static str) -> Vec<String> {
        FLOATS.iter().map(|e| fill(pattern, &[e.tag()])).collect()
    }
    fn assemble(pattern: &'static str, kernels: Vec<Kernel<A>>) -> Option<Self> {
        let kernels = kernels.try_into().ok()?;
        Some(ByElem { pattern, kernels })
    }
}

/// One kernel per (input, output) element type pair: `{pattern}` with both tags.
pub struct ByPair<A> {
    pattern: &'static str,
    kernels: [[Kernel<A>; 2]; 2],
}

impl<A> ByPair<A> {
    pub fn get(&self, a: Elem, b: Elem) -> Result<&Kernel<A>> {
        match (slot(a), slot(b)) {
            (Some(i), Some(j)) => Ok(&self.kernels[i][j]),
            _ => Err(no_variant(self.pattern, &[a, b])),
        }
    }
}

impl<A: KernelArgs> Variants for ByPair<A> {
    type Args = A;
    type Spec = &'static str;
    fn names(pattern: &'static str) -> Vec<String> {
        FLOATS
            .iter()
            .flat_map(|a| {
                FLOATS
                    .iter()
                    .map(move |b| fill(pattern, &[a.tag(), b.tag()]))
            })
            .collect()
    }
    fn assemble(pattern: &'static str, kernels: Vec<Kernel<A>>) -> Option<Self> {
        let [ff, fb, bf, bb]: [Kernel<A>; 4] = kernels.try_into().ok()?;
        Some(ByPair {
            pattern,
            kernels: [[ff, fb], [bf, bb]],
        })
    }
}

/// One kernel per head width: `{pattern}` with the width for its `{}`, for the widths listed.
pub struct ByDim<A> {
    dims: &'static [usize],
    kernels: Vec<Kernel<A>>,
}

impl<A> ByDim<A> {
    pub fn get(&self, d: usize) -> Option<&Kernel<A>> {
        self.iter().find_map(|(w, k)| (w == d).then_some(k))
    }

    pub fn iter(&self) -> impl Iterator<Item = (usize, &Kernel<A>)> {
        self.dims.iter().copied().zip(&self.kernels)
    }
}

impl<A: KernelArgs> Variants for ByDim<A> {
    type Args = A;
    type Spec = (&'static str, &'static [usize]);
    fn names((pattern, dims): Self::Spec) -> Vec<String> {
        dims.iter()
            .map(|d| fill(pattern, &[&d.to_string()]))
            .collect()
    }
    fn assemble((_, dims): Self::Spec, kernels: Vec<Kernel<A>>) -> Option<Self> {
        (kernels.len() == dims.len()).then_some(ByDim { dims, kernels })
    }
}

/// One kernel per row count and (input, output) element type pair: `{pattern}` with the count,
/// then both tags (the block-format products, `qgemv_q4_k_m{}_{}_{}`).
pub struct ByDimPair<A> {
    dims: &'static [usize],
    /// Per row count, the four pairs in [`ByPair`]'s order.
    kernels: Vec<[[Kernel<A>; 2]; 2]>,
}

impl<A> ByDimPair<A> {
    pub fn get(&self, d: usize, a: Elem, b: Elem) -> Option<&Kernel<A>> {
        let at = self.dims.iter().position(|&w| w == d)?;
        Some(&self.kernels[at][slot(a)?][slot(b)?])
    }
}

impl<A: KernelArgs> Variants for ByDimPair<A> {
    type Args = A;
    type Spec = (&'static str, &'static [usize]);
    fn names((pattern, dims): Self::Spec) -> Vec<String> {
        dims.iter()
            .flat_map(|d| {
                let d = d.to_string();
                FLOATS.iter().flat_map(move |a| {
                    let d = d.clone();
                    FLOATS
                        .iter()
                        .map(move |b| fill(pattern, &[&d, a.tag(), b.tag()]))
                })
            })
            .collect()
    }
    fn assemble((_, dims): Self::Spec, kernels: Vec<Kernel<A>>) -> Option<Self> {
        if kernels.len() != 4 * dims.len() {
            return None;
        }
        let mut it = kernels.into_iter();
        let mut out = Vec::with_capacity(dims.len());
        for _ in dims {
            let (ff, fb, bf, bb) = (it.next()?, it.next()?, it.next()?, it.next()?);
            out.push([[ff, fb], [bf, bb]]);
        }
        Some(ByDimPair { dims, kernels: out })
    }
}

/// Load one table field: every kernel it names, from `module`.
pub fn load_field<V: Variants>(spec: V::Spec, module: &Arc<CudaModule>, source: &str) -> Result<V> {
    let kernels = V::names(spec)
        .into_iter()
        .map(|name| Kernel::load(module, source, name))
        .collect::<Result<Vec<_>>>()?;
    V::assemble(spec, kernels)
        .ok_or_else(|| Error::backend("kernel table", format!("{source}: a field's variants")))
}

/// A kernel as its table declares it: name and C parameter list.
#[derive(Clone, Debug)]
pub struct Signature {
    pub name: String,
    pub params: Vec<Param>,
}

/// The kernels of one source file, declared with [`kernel_table!`].
pub trait KernelTable: Sized {
    /// The source file (an entry of `nvrtc::SOURCES`).
    const SOURCE: &'static str;
    /// Every kernel of every field.
    fn signatures() -> Vec<Signature>;
    /// Resolve every kernel in the module compiled from `SOURCE`.
    fn load(module: &Arc<CudaModule>) -> Result<Self>;
}

/// A source's kernel table: `field: Shape<Args> = spec,` per kernel family, where `Shape` is
/// [`Kernel`], [`ByElem`], [`ByPair`] or [`ByDim`] and `spec` its [`Variants::Spec`].
macro_rules! kernel_table {
    (
        $(#[$doc:meta])*
        $vis:vis struct $name:ident from $source:literal {
            $($(#[$fdoc:meta])* $field:ident: $ty:ty = $spec:expr),* $(,)?
        }
    ) => {
        $(#[$doc])*
        $vis struct $name {
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        impl $crate::cuda::launch::KernelTable for $name {
            const SOURCE: &'static str = $source;

            fn signatures() -> Vec<$crate::cuda::launch::Signature> {
                use $crate::cuda::launch::{Signature, Variants, params_of};
                let mut all = Vec::new();
                $(all.extend(<$ty as Variants>::names($spec).into_iter().map(|name| Signature {
                    name,
                    params: params_of::<<$ty as Variants>::Args>(),
                }));)*
                all
            }

            fn load(
                module: &std::sync::Arc<cudarc::driver::CudaModule>,
            ) -> tessera_core::Result<Self> {
                Ok($name {
                    $($field: $crate::cuda::launch::load_field::<$ty>($spec, module, $source)?,)*
                })
            }
        }
    };
}
pub(super) use kernel_table;

impl CudaBackend {
    /// Launch `kernel` with `args` on the backend's stream, timed under the profiler's class
    /// `class`; a grid without blocks launches nothing.
    pub(super) fn launch<A: KernelArgs>(
        &self,
        class: &'static str,
        kernel: &Kernel<A>,
        config: LaunchConfig,
        args: &A,
    ) -> Result<()> {
        if config.grid_dim.0 == 0 || config.grid_dim.1 == 0 {
            return self.timed(class, None, || Ok(()));
        }
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.timed(class, Some(kernel.name()), || {
            if self.overlap_launches {
                return self.launch_overlapped(kernel, &config, args);
            }
            let mut b = self.stream.launch_builder(kernel.func());
            args.push(&mut b);
            // SAFETY: a `Kernel<A>` is resolved only under a name of a table field declared
            // with `A`, and CI checks `A`'s parameter list against that kernel's C parameter
            // types and PTX parameters, so `push` passes each parameter as its own C type and
            // size; `args` outlives the call; every pointer addresses a live buffer whose extent
            // the op checked against the launch's index range.
            unsafe { b.launch(config) }.map_err(drv(kernel.name()))?;
            Ok(())
        })
    }

    /// Turn the fused residual step (`TESSERA_FUSE`'s `residual`, off by default) on or off, for
    /// the tests that check it and for measurements within one process.
    pub fn fuse_residual_steps(&mut self, on: bool) {
        self.fuse.residual = on;
    }

    /// How many kernels this backend has launched itself (not cuBLASLt's products, not graph
    /// replays): a fused op's tests check that it took one launch.
    pub fn kernel_launches(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Launch `kernel` with programmatic stream serialization (Hopper's programmatic dependent
    /// launch): the driver may start it while the kernel before it is still running, and its
    /// blocks wait at their start (`pdl_enter`, kernels/common.cuh) until that kernel has finished
    /// and its writes are visible. The launch latency and the blocks' start-up then overlap the
    /// previous kernel instead of following it: decoding runs ~160 small kernels a token. Stream
    /// captures keep the overlap as programmatic graph edges.
    fn launch_overlapped<A: KernelArgs>(
        &self,
        kernel: &Kernel<A>,
        config: &LaunchConfig,
        args: &A,
    ) -> Result<()> {
        use cudarc::driver::sys;
        let mut params = Vec::with_capacity(24);
        args.param_ptrs(&mut params);
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let launch = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.ctx.bind_to_thread().map_err(drv(kernel.name()))?;
        // SAFETY: as in `launch`: `params` holds one pointer per C parameter of the kernel, each to
        // a live value of that parameter's type and size (`param_ptrs` follows `params`, which CI
        // checks against the kernel), and `args` outlives the call, which copies them; `launch`
        // and `attr` are valid for the call; the stream and function belong to this context. Every
        // kernel waits for its predecessor before touching global memory (`pdl_enter`, checked in
        // CI on the PTX), which is what the attribute requires.
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                kernel.func().cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(drv(kernel.name()))
    }

    /// Run `op` under the profiler's class `class` (and the name of the kernel it launches, if
    /// one) when profiling.
    pub(super) fn timed(
        &self,
        class: &'static str,
        kernel: Option<&str>,
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match &self.profiler {
            Some(p) => p.time(&self.stream, class, kernel, op),
            None => op(),
        }
    }
}

/// A 1-D block of `block` threads on a 2-D grid.
pub fn cfg(grid: (u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

impl CudaBackend {
    /// Launch shape of a grid-stride loop over `n` items: 256-thread blocks, at most sixteen per
    /// multiprocessor (the loop covers the rest), at least one.
    pub(super) fn grid_stride(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, self.sm_count as usize * 16);
        cfg((blocks as u32, 1), 256, 0)
    }
}

/// Every row start of each `(pointer, stride, element size)` is aligned for 4-element accesses,
/// and each f32 vector (null = none) for 16-byte ones: what the 4-wide kernels (row norms, casts,
/// epilogues, DupUp) need.
pub fn vec4_aligned(rows: &[(DevPtr, usize, usize)], vectors: &[DevPtr]) -> bool {
    rows.iter().all(|&(ptr, stride, size)| {
        let align = 4 * size as u64;
        ptr.0.is_multiple_of(align) && ((stride * size) as u64).is_multiple_of(align)
    }) && vectors.iter().all(|v| v.0.is_multiple_of(16))
}

/// Launch shape of the block-per-row kernels: a block of 128 threads per row of up to 1,024
/// columns, else of 256.
pub fn row_blocks(rows: usize, cols: usize, smem: u32) -> LaunchConfig {
    let block = if cols <= 1024 { 128 } else { 256 };
    cfg((rows as u32, 1), block, smem)
}

#[cfg(test)]
mod tests {
    use super::*;

    kernel_args! {
        /// Arguments of no kernel: the names below do not depend on them.
        struct NoArgs { x: DevPtr }
    }

    kernel_args! {
        /// Every parameter type, and a nested struct, as the overlapped launch passes them.
        struct Mixed { first: NoArgs, n: i64, k: i32, scale: f32, map: TensorMap, last: DevPtr }
    }

    /// The overlapped launch hands the driver `param_ptrs`: one pointer per C parameter, in the
    /// order `params` declares (the one CI checks against the kernel), each at its own value.
    #[test]
    fn param_ptrs_point_at_each_parameter_in_order() {
        let args = Mixed {
            first: NoArgs { x: DevPtr(7) },
            n: -3,
            k: 11,
            scale: 0.5,
            map: TensorMap(cudarc::driver::sys::CUtensorMap { opaque: [9; 16] }),
            last: DevPtr(13),
        };
        let mut ptrs = Vec::new();
        args.param_ptrs(&mut ptrs);
        assert_eq!(ptrs.len(), params_of::<Mixed>().len());
        let at = |p: &dyn std::any::Any| p as *const dyn std::any::Any as *const c_void;
        let fields = [
            at(&args.first.x),
            at(&args.n),
            at(&args.k),
            at(&args.scale),
            at(&args.map),
            at(&args.last),
        ];
        assert_eq!(
            ptrs.iter().map(|&p| p as *const c_void).collect::<Vec<_>>(),
            fields
        );
        // SAFETY: each pointer addresses the field of `args` checked above.
        unsafe {
            assert_eq!(*(ptrs[0] as *const u64), 7);
            assert_eq!(*(ptrs[1] as *const i64), -3);
            assert_eq!(*(ptrs[2] as *const i32), 11);
            assert_eq!(*(ptrs[3] as *const f32), 0.5);
            assert_eq!(*(ptrs[5] as *const u64), 13);
        }
    }

    #[test]
    fn names_fill_every_pattern_once() {
        assert_eq!(fill("cast_{}_{}", &["f32", "bf16"]), "cast_f32_bf16");
        assert_eq!(
            <ByPair<NoArgs>>::names("s_{}_{}"),
            ["s_f32_f32", "s_f32_bf16", "s_bf16_f32", "s_bf16_bf16"]
        );
        assert_eq!(
            <ByDim<NoArgs>>::names(("f_d{}", &[16, 64])),
            ["f_d16", "f_d64"]
        );
        assert_eq!(
            <ByDimPair<NoArgs>>::names(("q_m{}_{}_{}", &[1, 16])),
            [
                "q_m1_f32_f32",
                "q_m1_f32_bf16",
                "q_m1_bf16_f32",
                "q_m1_bf16_bf16",
                "q_m16_f32_f32",
                "q_m16_f32_bf16",
                "q_m16_bf16_f32",
                "q_m16_bf16_bf16"
            ]
        );
    }
}
