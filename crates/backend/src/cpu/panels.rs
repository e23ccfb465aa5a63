//! The CPU's matrix products where the CPU has AVX-512: `C = alpha · A · Bᵀ (+ C)` with `B` (a
//! weight matrix, or attention's keys and values) in [`Panels`] of [`NR`] of its rows, laid out
//! so that a broadcast element of `A` multiplies a whole panel row at once. Tiles of up to
//! [`MR`] rows of `A` against one panel keep `2·MR` accumulators of 16 f32 lanes in registers:
//! no horizontal sums, and each output's sum runs over `k` in the same order whatever the tile
//! (blocks of [`DEPTH_BLOCK`] steps in one lane, the block sums added in order), so a row's
//! result does not depend on the rows it comes with (batch-invariant).
//!
//! The element type is the arithmetic: `f32` (FMA), or a bf16 pair in a `u32` (`vdpbf16ps`,
//! `bf16.rs`), each with a portable tile for CPUs without the instructions.

use std::ops::Range;

use rayon::prelude::*;

use super::aligned::Aligned;

/// Output columns per panel: two 16-lane f32 registers.
pub const NR: usize = 32;

/// Rows of `A` per kernel tile: 2 × 12 accumulators, two panel registers and a broadcast fit
/// AVX-512's 32 registers.
pub const MR: usize = 12;

/// Rows of `A` per parallel task: a task's `A` rows stay in L2 while its panels stream past.
/// (A multiple of the AMX kernel's 32-row steps too: `amx.rs` splits its products by
/// [`for_each_task`] as well.)
pub(super) const CHUNK_ROWS: usize = 16 * MR;

/// Depth steps one tile sums in registers before adding its sums to `C`. Each output is a sum
/// of block sums: summed over all of `k` in one lane, its rounding error grows as `k` does
/// (2.2e-6 RMS relative at k = 12288, 7× the blocked sum's: enough to fail the CUDA-vs-CPU
/// f32 parity bounds of Qwen-Image's DiT); in blocks it stays near f32's rounding. The order still depends only on `k`, never on the tile.
pub(super) const DEPTH_BLOCK: usize = 256;

/// Bytes of panels per parallel task: what stays in L2 while the task's row tiles pass.
const BLOCK_BYTES: usize = 256 << 10;

/// What one depth step of a product multiplies: an `f32`, or a pair of bf16 values.
pub trait Element: Copy + Default + Send + Sync + 'static {
    /// Depth steps for `k` columns.
    fn depth(k: usize) -> usize;

    /// `acc + x ∘ y` in f32: one depth step of one output, as the portable tile sums it.
    fn madd(acc: f32, x: Self, y: Self) -> f32;

    /// Computes one tile, with this CPU's best kernel.
    ///
    /// # Safety
    /// As [`Tile`] says of its fields.
    unsafe fn tile(t: Tile<'_, Self>);

    /// Runs a whole product on a kernel of its own instead of the tiles (bf16 on AMX), where
    /// this CPU has one; `false` leaves it to the tiles.
    ///
    /// # Safety
    /// As [`gemm`]'s.
    unsafe fn product(_a: &Lhs<'_, Self>, _b: PanelView<'_, Self>, _c: Out, _par: bool) -> bool {
        false
    }
}

/// One tile: `c[r][j] = alpha · Σ_q a[r·lda + q] ∘ b[q·NR + j]` (or `+=` when `accumulate`)
/// for `r < h ≤ MR`, `j < cols ≤ NR`, `q < depth`. Whoever makes one promises that `c`
/// addresses `h` rows of `cols` at `ldc`, valid for writes (reads when accumulating) and not
/// aliased, that `a` holds `h` rows at `lda` of `depth` each, and `b` `depth · NR` elements.
#[derive(Clone, Copy)]
pub struct Tile<'a, E> {
    pub a: &'a [E],
    pub lda: usize,
    pub h: usize,
    pub b: &'a [E],
    pub depth: usize,
    pub c: *mut f32,
    pub ldc: usize,
    pub cols: usize,
    pub alpha: f32,
    pub accumulate: bool,
}

/// [`Element::tile`] in plain Rust, for CPUs without the vector instructions: each output's
/// depth steps summed in order with [`Element::madd`].
///
/// # Safety
/// As [`Tile`] says of its fields.
pub(super) unsafe fn tile_plain<E: Element>(t: Tile<'_, E>) {
    for r in 0..t.h {
        let ar = &t.a[r * t.lda..r * t.lda + t.depth];
        for j in 0..t.cols {
            let s = (0..t.depth).fold(0f32, |s, q| E::madd(s, ar[q], t.b[q * NR + j]));
            // SAFETY: row r < h, column j < cols of the tile's C.
            let o = unsafe { &mut *t.c.add(r * t.ldc + j) };
            *o = if t.accumulate {
                *o + t.alpha * s
            } else {
                t.alpha * s
            };
        }
    }
}

/// An [`Element`] attention can take its operands in: keys, values and queries arrive as f32
/// activations and are packed (and, for bf16, rounded) per call.
pub trait Operand: Element {
    /// Whether attention's softmax may sum its probabilities in f32 lanes: where the product
    /// rounds them to bf16 next, far coarser than those sums' rounding.
    const F32_SOFTMAX_SUMS: bool = false;

    /// `n` rows of `k` of `src` (at `stride`) as `B`: attention's keys.
    fn pack_rows(src: &[f32], stride: usize, n: usize, k: usize) -> Panels<Self>;
    /// The transpose of `k` rows of `n` of `src` (at `stride`) as `B`: attention's values.
    fn pack_cols(src: &[f32], stride: usize, k: usize, n: usize) -> Panels<Self>;
    /// `m` rows of `k` of `src` (at `stride`) as `A`: as they are, or converted into `scratch`
    /// (bf16 pairs; in parallel when `par`).
    fn lhs<'a>(
        src: &'a [f32],
        stride: usize,
        shape: (usize, usize),
        scratch: &'a mut Vec<u32>,
        par: bool,
    ) -> Lhs<'a, Self>;

    /// `C = alpha · A · Bᵀ` (or `+=`), over threads when `par`, `A` being `m` rows of `k` of
    /// `src` (at `stride`): [`gemm`] on what [`lhs`](Operand::lhs) makes of them, or a kernel
    /// that converts the rows as it lays them out (bf16 on AMX). Attention's products and the
    /// bf16 weight products both come through here.
    ///
    /// # Safety
    /// As [`gemm`]'s, for that `A`.
    unsafe fn gemm_rows(
        src: &[f32],
        stride: usize,
        (m, k): (usize, usize),
        b: PanelView<'_, Self>,
        c: Out,
        scratch: &mut Vec<u32>,
        par: bool,
    ) {
        // SAFETY: as this function's.
        unsafe { gemm_converted(src, stride, (m, k), b, c, scratch, par) }
    }
}

/// [`Operand::gemm_rows`] through [`Operand::lhs`] and [`gemm`].
///
/// # Safety
/// As [`gemm`]'s, for `m` rows of `k` of `src` at `stride` as `A`.
pub(super) unsafe fn gemm_converted<E: Operand>(
    src: &[f32],
    stride: usize,
    (m, k): (usize, usize),
    b: PanelView<'_, E>,
    c: Out,
    scratch: &mut Vec<u32>,
    par: bool,
) {
    let lhs = E::lhs(src, stride, (m, k), scratch, par);
    // SAFETY: as this function's.
    unsafe { gemm(&lhs, b, c, par) }
}

impl Operand for f32 {
    fn pack_rows(src: &[f32], stride: usize, n: usize, k: usize) -> Panels<f32> {
        Panels::from_rows(n, k, |j, out| {
            out.copy_from_slice(&src[j * stride..j * stride + k])
        })
    }

    fn pack_cols(src: &[f32], stride: usize, k: usize, n: usize) -> Panels<f32> {
        Panels::from_steps(n, k, |i, cols, out| {
            out.copy_from_slice(&src[i * stride..][cols]);
        })
    }

    fn lhs<'a>(
        src: &'a [f32],
        stride: usize,
        (m, _k): (usize, usize),
        _scratch: &'a mut Vec<u32>,
        _par: bool,
    ) -> Lhs<'a, f32> {
        Lhs {
            data: src,
            stride,
            rows: m,
        }
    }
}

/// A matrix `B` (`[n, k]`, used as `A · Bᵀ`) as panels of [`NR`] rows: panel `p` holds, for each
/// depth step in order, its rows' elements, one per row. `n` is padded to whole panels (and a
/// bf16 `k` to even) with zeros.
pub struct Panels<E> {
    /// On a cache line, so that panel rows (128 bytes) never straddle two ([`Aligned`]).
    pub(super) data: Aligned<E>,
    pub(super) n: usize,
    pub(super) k: usize,
}

impl<E: Element> Panels<E> {
    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
    /// Depth steps per panel.
    pub fn depth(&self) -> usize {
        E::depth(self.k)
    }

    /// Pack `n` rows of `k`, `row(j, out)` writing row `j`'s elements into `out` (`depth` long);
    /// panels in parallel.
    pub fn from_rows(n: usize, k: usize, row: impl Fn(usize, &mut [E]) + Sync) -> Self {
        let depth = E::depth(k);
        let mut data = Aligned::zeroed(n.div_ceil(NR) * depth * NR);
        if depth > 0 {
            data.par_chunks_mut(depth * NR).enumerate().for_each_init(
                Vec::new,
                |tmp, (p, panel)| {
                    tmp.resize(depth, E::default());
                    for c in 0..(n - p * NR).min(NR) {
                        row(p * NR + c, tmp);
                        for (q, &x) in tmp.iter().enumerate() {
                            panel[q * NR + c] = x;
                        }
                    }
                },
            );
        }
        Panels { data, n, k }
    }

    /// Pack `B` a depth step at a time: `step(q, cols, out)` writes step `q` of rows `cols`
    /// (at most one panel's) into `out`. The layout a transposed source is read in.
    pub fn from_steps(
        n: usize,
        k: usize,
        mut step: impl FnMut(usize, Range<usize>, &mut [E]),
    ) -> Self {
        let depth = E::depth(k);
        let mut data = Aligned::zeroed(n.div_ceil(NR) * depth * NR);
        for q in 0..depth {
            for (p, first) in (0..n).step_by(NR).enumerate() {
                let cols = first..(first + NR).min(n);
                step(
                    q,
                    cols.clone(),
                    &mut data[(p * depth + q) * NR..][..cols.len()],
                );
            }
        }
        Panels { data, n, k }
    }

    /// Element `q` of row `j`.
    pub(super) fn at(&self, j: usize, q: usize) -> E {
        let (p, c) = (j / NR, j % NR);
        self.data[(p * self.depth() + q) * NR + c]
    }

    /// Rows `rows` of `B` (whole panels: `rows.start` a multiple of [`NR`]) and depth steps
    /// `steps`, as one product's right-hand side.
    pub fn view(&self, rows: Range<usize>, steps: Range<usize>) -> PanelView<'_, E> {
        assert!(
            rows.start.is_multiple_of(NR) && rows.end <= self.n && steps.end <= self.depth(),
            "panel view out of range"
        );
        PanelView {
            data: &self.data[rows.start / NR * self.depth() * NR..],
            stride: self.depth() * NR,
            first: steps.start,
            depth: steps.len(),
            n: rows.len(),
        }
    }

    /// Every row and column.
    pub fn all(&self) -> PanelView<'_, E> {
        self.view(0..self.n, 0..self.depth())
    }
}

/// Part of a [`Panels`]: the right-hand side of one product.
#[derive(Clone, Copy)]
pub struct PanelView<'a, E> {
    pub(super) data: &'a [E],
    /// Elements from one panel to the next.
    pub(super) stride: usize,
    /// The first depth step.
    pub(super) first: usize,
    pub(super) depth: usize,
    /// Rows of `B` (output columns).
    pub(super) n: usize,
}

/// `A`: `rows` rows of depth steps at `stride`.
pub struct Lhs<'a, E> {
    pub data: &'a [E],
    pub stride: usize,
    pub rows: usize,
}

impl<E> Lhs<'_, E> {
    /// Panics unless the rows hold `depth` steps each (the last one may end the data).
    pub(super) fn assert_holds(&self, depth: usize) {
        let m = self.rows;
        assert!(
            m == 0
                || (m == 1 || depth <= self.stride)
                    && (m - 1) * self.stride + depth <= self.data.len(),
            "panel gemm: A too short for its rows"
        );
    }
}

/// Where one product writes: `C` rows at `stride` from `ptr`, `alpha · A·Bᵀ` added to them
/// (`accumulate`) or stored.
#[derive(Clone, Copy)]
pub struct Out {
    pub ptr: *mut f32,
    pub stride: usize,
    pub alpha: f32,
    pub accumulate: bool,
}

impl Out {
    /// Where row `r`, column `col` of `C` is (a method, so closures capture the whole `Out`,
    /// which is `Sync`, rather than its raw pointer).
    pub fn at(&self, r: usize, col: usize) -> *mut f32 {
        self.ptr.wrapping_add(r * self.stride + col)
    }
}

// SAFETY: `Out` is a pointer into a buffer the caller borrows mutably for the whole product;
// tasks write disjoint tiles of it.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `C = alpha · A · Bᵀ` (or `+=`), tiles over threads when `par`.
///
/// # Safety
/// `c.ptr` addresses `a.rows` rows of at least `b`'s row count of columns at `c.stride`, valid
/// for writes (and reads when accumulating), not aliased for the duration.
pub unsafe fn gemm<E: Element>(a: &Lhs<'_, E>, b: PanelView<'_, E>, c: Out, par: bool) {
    // SAFETY: as this function's.
    if unsafe { E::product(a, b, c, par) } {
        return;
    }
    // SAFETY: as this function's.
    unsafe { gemm_tiles(a, b, c, par) }
}

/// [`gemm`] on the [`Element::tile`] kernels, whatever [`Element::product`] would pick.
///
/// # Safety
/// As [`gemm`]'s.
pub(super) unsafe fn gemm_tiles<E: Element>(
    a: &Lhs<'_, E>,
    b: PanelView<'_, E>,
    c: Out,
    par: bool,
) {
    let (m, n) = (a.rows, b.n);
    if m == 0 || n == 0 {
        return;
    }
    a.assert_holds(b.depth);
    let bytes = b.depth * NR * std::mem::size_of::<E>();
    for_each_task(m, n, b.depth, bytes, par, |rows, panels| {
        for p in panels {
            let cols = (n - p * NR).min(NR);
            let panel = &b.data[p * b.stride + b.first * NR..];
            let mut r = rows.start;
            while r < rows.end {
                let h = (rows.end - r).min(MR);
                for q in (0..b.depth).step_by(DEPTH_BLOCK) {
                    // SAFETY: rows r..r+h of A and C, columns p·NR..p·NR+cols of C and the
                    // panel's steps q.. are inside the extents the caller guarantees; tasks
                    // own disjoint (rows, panels) tiles.
                    unsafe {
                        E::tile(Tile {
                            a: &a.data[r * a.stride + q..],
                            lda: a.stride,
                            h,
                            b: &panel[q * NR..],
                            depth: (b.depth - q).min(DEPTH_BLOCK),
                            c: c.at(r, p * NR),
                            ldc: c.stride,
                            cols,
                            alpha: c.alpha,
                            accumulate: c.accumulate || q > 0,
                        })
                    };
                }
                r += h;
            }
        }
    });
}

/// A product of `m` rows of `A` against the `⌈n / NR⌉` panels of `B` (`depth` steps, `bytes`
/// each) split into tasks: row chunks of [`CHUNK_ROWS`] × blocks of panels that stay in L2,
/// `task(rows, panels)` for each, over threads when `par` and the product is large enough.
pub(super) fn for_each_task(
    m: usize,
    n: usize,
    depth: usize,
    bytes: usize,
    par: bool,
    task: impl Fn(Range<usize>, Range<usize>) + Sync,
) {
    let panels = n.div_ceil(NR);
    let per_block = (BLOCK_BYTES / bytes.max(1)).clamp(1, 16);
    let blocks = panels.div_ceil(per_block);
    let chunks = m.div_ceil(CHUNK_ROWS);
    let one = |t: usize| {
        let (bi, ci) = (t % blocks, t / blocks);
        task(
            ci * CHUNK_ROWS..((ci + 1) * CHUNK_ROWS).min(m),
            bi * per_block..((bi + 1) * per_block).min(panels),
        );
    };
    let tasks = blocks * chunks;
    if par && tasks > 1 && m * n * depth >= 1 << 18 {
        (0..tasks).into_par_iter().for_each(one);
    } else {
        (0..tasks).for_each(one);
    }
}

/// Whether this CPU runs the f32 panel kernel (AVX-512F); elsewhere f32 matrices stay row-major
/// for the `gemm` crate.
pub fn f32_native() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Stores one tile's accumulators (`H` rows × two registers) into `C`: `alpha ·` them, added to
/// what is there when `accumulate`, the columns past `cols` untouched.
///
/// `#[inline]` so the tiles of other modules (bf16's) can inline it: called out of line, it
/// takes the accumulators by address, and LLVM then kept them in memory as well as in
/// registers, storing all of them on every step of the tile's loop.
///
/// # Safety
/// As [`Tile`] says of its fields, and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_tile<const H: usize, E>(
    acc: &[[std::arch::x86_64::__m512; 2]; H],
    t: &Tile<'_, E>,
) {
    use std::arch::x86_64::*;
    let (c, ldc, cols, accumulate) = (t.c, t.ldc, t.cols, t.accumulate);
    let scale = _mm512_set1_ps(t.alpha);
    let masks = [lanes(cols), lanes(cols.saturating_sub(16))];
    for (r, acc) in acc.iter().enumerate() {
        for (half, (&v, &mask)) in acc.iter().zip(&masks).enumerate() {
            if mask == 0 {
                continue;
            }
            // SAFETY: row r < H and the masked columns (< cols) are inside the caller's C.
            unsafe { store_lanes(v, c.add(r * ldc + 16 * half), mask, scale, accumulate) };
        }
    }
}

/// The mask of the first `n` of 16 lanes.
#[cfg(target_arch = "x86_64")]
pub(super) fn lanes(n: usize) -> std::arch::x86_64::__mmask16 {
    if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
}

/// `dst[j] = scale · v[j]` (added to `dst[j]` when `accumulate`) for the lanes in `mask`.
///
/// # Safety
/// The masked lanes of `dst` are the caller's to write (and read), and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_lanes(
    v: std::arch::x86_64::__m512,
    dst: *mut f32,
    mask: std::arch::x86_64::__mmask16,
    scale: std::arch::x86_64::__m512,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY: as this function's.
    unsafe {
        let mut y = _mm512_mul_ps(v, scale);
        if accumulate {
            y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, dst));
        }
        _mm512_mask_storeu_ps(dst, mask, y);
    }
}

/// Picks the `const H` instantiation of an AVX-512 tile for `h` rows.
macro_rules! dispatch_rows {
    ($f:ident($t:expr)) => {
        match $t.h {
            1 => $f::<1>($t),
            2 => $f::<2>($t),
            3 => $f::<3>($t),
            4 => $f::<4>($t),
            5 => $f::<5>($t),
            6 => $f::<6>($t),
            7 => $f::<7>($t),
            8 => $f::<8>($t),
            9 => $f::<9>($t),
            10 => $f::<10>($t),
            11 => $f::<11>($t),
            12 => $f::<12>($t),
            h => unreachable!("a tile of {h} rows"),
        }
    };
}
pub(super) use dispatch_rows;

impl Element for f32 {
    fn depth(k: usize) -> usize {
        k
    }

    fn madd(acc: f32, x: f32, y: f32) -> f32 {
        x.mul_add(y, acc)
    }

    unsafe fn tile(t: Tile<'_, f32>) {
        debug_assert!(t.h <= MR && t.cols <= NR && t.b.len() >= t.depth * NR);
        #[cfg(target_arch = "x86_64")]
        if f32_native() {
            // SAFETY: AVX-512F is present; the tile's promises are the caller's.
            unsafe { dispatch_rows!(tile_f32_avx512(t)) };
            return;
        }
        // SAFETY: as this function's.
        unsafe { tile_plain(t) }
    }
}

/// The f32 tile: `H` rows × 32 columns of accumulators, one broadcast element of `A` against
/// the panel's two registers per row and step (FMA).
///
/// # Safety
/// As [`Tile`] says of its fields, `t.h == H`, and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_f32_avx512<const H: usize>(t: Tile<'_, f32>) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; H];
    let (ap, bp, lda) = (t.a.as_ptr(), t.b.as_ptr(), t.lda);
    let ahead = super::prefetch::distance();
    for q in 0..t.depth {
        // A panel step is two lines, read once per tile: the panel streams (see `prefetch`).
        super::prefetch::lines::<2>(bp.wrapping_add(q * NR).cast(), ahead);
        // SAFETY: step q of the panel (32 values at q·NR) and of rows 0..H of A are in bounds.
        unsafe {
            let b0 = _mm512_loadu_ps(bp.add(q * NR));
            let b1 = _mm512_loadu_ps(bp.add(q * NR + 16));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*ap.add(r * lda + q));
                acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
            }
        }
    }
    // SAFETY: as this function's.
    unsafe { store_tile(&acc, &t) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::Rng;

    /// RMS over `m × n` outputs of `(got − f64) / scale`, `scale` each output's
    /// `√Σ (a·b)²`: the size its rounding errors are measured against.
    fn rms_rel_error(a: &[f32], b: &[f32], got: &[f32], m: usize, n: usize, k: usize) -> f64 {
        let mut sum = 0.0;
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|t| a[i * k + t] as f64 * b[j * k + t] as f64);
                let (exact, scale) = terms.fold((0.0, 0.0), |(s, q), x| (s + x, q + x * x));
                sum += ((got[i * n + j] as f64 - exact) / scale.sqrt()).powi(2);
            }
        }
        (sum / (m * n) as f64).sqrt()
    }

    /// At the depth of the largest models' products (Qwen-Image's MLP, k = 12288), summing in
    /// blocks keeps the rounding error near f32's: the whole-`k` single-lane sum the kernel
    /// used before had ~6× this RMS error, enough to fail the CUDA-vs-CPU parity bounds.
    #[test]
    fn long_products_sum_in_blocks() {
        let (m, k, n) = (3, 12288, 64);
        let mut rng = Rng::new(12288);
        let (a, b) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
        let panels =
            Panels::<f32>::from_rows(n, k, |j, out| out.copy_from_slice(&b[j * k..(j + 1) * k]));
        let mut blocked = vec![0f32; m * n];
        let lhs = Lhs {
            data: &a,
            stride: k,
            rows: m,
        };
        let out = Out {
            ptr: blocked.as_mut_ptr(),
            stride: n,
            alpha: 1.0,
            accumulate: false,
        };
        // SAFETY: `blocked` holds m rows of n.
        unsafe { gemm(&lhs, panels.all(), out, true) };
        let mut single = vec![0f32; m * n];
        for p in 0..n / NR {
            let view = panels.all();
            // SAFETY: rows 0..m and columns p·NR..(p+1)·NR of `single` (m × n) are in bounds.
            unsafe {
                tile_plain(Tile {
                    a: &a,
                    lda: k,
                    h: m,
                    b: &view.data[p * view.stride..],
                    depth: k,
                    c: single.as_mut_ptr().add(p * NR),
                    ldc: n,
                    cols: NR,
                    alpha: 1.0,
                    accumulate: false,
                })
            };
        }
        let (e_blocked, e_single) = (
            rms_rel_error(&a, &b, &blocked, m, n, k),
            rms_rel_error(&a, &b, &single, m, n, k),
        );
        eprintln!(
            "k = {k}: RMS relative error blocked {e_blocked:.3e}, single lane {e_single:.3e}"
        );
        // f32's unit roundoff u = 2⁻²⁴: block sums of 256 steps and 48 block additions give an
        // RMS near u·√(256/2 + 48/2)/√3 ≈ 4.3e-7; one lane over all of k gives ~u·√(k/6) ≈ 2.7e-6.
        assert!(
            e_blocked < 6e-7,
            "k = {k}: RMS relative error {e_blocked:.3e} (single lane: {e_single:.3e})"
        );
    }

    /// f32 products at odd sizes against f64, through the AVX-512 tile where present and the
    /// portable one.
    #[test]
    fn f32_products_match_f64_at_odd_sizes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (7, 17, 33),
            (13, 33, 7),
            (17, 512, 2048),
            (33, 4099, 65),
            (200, 64, 97),
        ] {
            let mut rng = Rng::new((m * 7919 + k * 31 + n) as u64);
            let (a, b) = (rng.vec(m * k, 2.0), rng.vec(n * k, 1.0));
            let panels = Panels::<f32>::from_rows(n, k, |j, out| {
                out.copy_from_slice(&b[j * k..(j + 1) * k])
            });
            let ldc = n + 3;
            let mut c = vec![f32::NAN; m * ldc];
            let lhs = Lhs {
                data: &a,
                stride: k,
                rows: m,
            };
            let out = Out {
                ptr: c.as_mut_ptr(),
                stride: ldc,
                alpha: 0.5,
                accumulate: false,
            };
            // SAFETY: c holds m rows of ldc ≥ n.
            unsafe { gemm(&lhs, panels.all(), out, true) };
            let mut plain = vec![0.25f32; m * n];
            for r in (0..m).step_by(MR) {
                let h = (m - r).min(MR);
                for p in 0..n.div_ceil(NR) {
                    let view = panels.all();
                    // SAFETY: rows r..r+h and columns p·NR.. of `plain` (m × n) are in bounds.
                    unsafe {
                        tile_plain(Tile {
                            a: &a[r * k..],
                            lda: k,
                            h,
                            b: &view.data[p * view.stride..],
                            depth: k,
                            c: plain.as_mut_ptr().add(r * n + p * NR),
                            ldc: n,
                            cols: (n - p * NR).min(NR),
                            alpha: 0.5,
                            accumulate: true,
                        })
                    };
                }
            }
            for i in 0..m {
                for j in 0..n {
                    let w: f64 = 0.5
                        * (0..k)
                            .map(|t| a[i * k + t] as f64 * b[j * k + t] as f64)
                            .sum::<f64>();
                    let tol = 1e-6 * (k as f64).sqrt() * 2.0 + 1e-6;
                    let g = c[i * ldc + j] as f64;
                    assert!(
                        (g - w).abs() <= tol * w.abs().max(1.0),
                        "{m}×{k}×{n} [{i},{j}]: {g} vs {w}"
                    );
                    let g = plain[i * n + j] as f64 - 0.25;
                    assert!(
                        (g - w).abs() <= tol * w.abs().max(1.0),
                        "portable {m}×{k}×{n} [{i},{j}]: {g} vs {w}"
                    );
                }
                assert!(
                    c[i * ldc + n..(i + 1) * ldc].iter().all(|x| x.is_nan()),
                    "wrote past column {n}"
                );
            }
        }
    }
}
