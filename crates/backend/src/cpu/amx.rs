//! AMX-BF16 (`tdpbf16ps`, Intel Xeon since Sapphire Rapids) for the bf16 panel products: tiles
//! of 16 rows × 16 bf16 pairs of `A` against 16 pairs × 16 columns of a panel, summed into 16 × 16
//! f32 tiles — eight times the multiplies of a `vdpbf16ps` per instruction.
//!
//! The arithmetic is the bf16 rule's (bf16 inputs, each product exact, f32 sums), with each
//! output's whole depth summed in its tile in the hardware's order and added to `C` once. The
//! panel kernels' depth blocks (`panels::DEPTH_BLOCK`) are not kept here: they hold an f32
//! product's rounding near f32's at long depths (2.2e-6 relative at k = 12288 without them),
//! which is far below the 2⁻⁹ that rounding the inputs to bf16 already costs, while storing and
//! adding the tiles after every block cost these products 5–14%. Every row runs the same
//! instructions whatever rows come with it, so a row's result does not depend on its batch.
//! Where AMX is used, it is used for every bf16 product (one row or thousands): the choice is
//! made once per process, never per call, since `vdpbf16ps` and the tiles may round a pair's
//! sum differently.
//!
//! Every buffer the tiles load from starts on a cache line (`aligned.rs`): a tile row split
//! across two lines made each `tileloadd` ~6× slower, and the loads the products' limit.
//!
//! Rust has no stable AMX intrinsics: the tile instructions are inline assembly. The tile
//! registers are invisible to the compiler, which never uses them, so their state carries from
//! one `asm!` block to the next within a task; each task configures the tiles first and releases
//! them last.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::aligned::Aligned;
use super::panels::{CHUNK_ROWS, Lhs, NR, Out, PanelView, for_each_task, lanes, store_lanes};

/// Rows of a tile (the hardware's maximum) and bf16 pairs in a tile row (64 bytes).
const TILE: usize = 16;

/// Rows of `A` per kernel step: two `A` tiles against two panel tiles, four sums.
const STEP_ROWS: usize = 2 * TILE;

// The tasks' row chunks (the panel kernels' split) start on whole steps.
const _: () = assert!(CHUNK_ROWS.is_multiple_of(STEP_ROWS));

/// Whether bf16 products run on AMX tiles in this process: the CPU has AMX-BF16 (and AVX-512F,
/// for the stores), Linux granted the tile state, and `TESSERA_AMX=0` did not turn it off.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("TESSERA_AMX").as_deref() != Ok("0") && available())
}

/// Whether this CPU and kernel can run AMX-BF16 (ignoring `TESSERA_AMX`).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            cpu_has_amx_bf16()
                && std::arch::is_x86_feature_detected!("avx512f")
                && request_tile_state()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only where leaf 0 says it exists.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0
}

/// Linux hands a process the tile registers' state (8 KiB per thread) only on request:
/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once, for every thread of the process.
/// Without it the first tile instruction is killed with SIGILL.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes which state the kernel lets the process
    // use; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// `C = alpha · A · Bᵀ` (or `+=`) on AMX tiles, over threads when `par`: what
/// [`panels::gemm`](super::panels::gemm) runs for bf16 where [`enabled`].
///
/// # Safety
/// As `panels::gemm`'s, and [`enabled`] is true.
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemm(a: &Lhs<'_, u32>, b: PanelView<'_, u32>, c: Out, par: bool) {
    let (m, depth) = (a.rows, b.depth);
    if m == 0 || b.n == 0 {
        return;
    }
    a.assert_holds(depth);
    let fill = |r: usize, dst: &mut [u32], step: usize| {
        let row = &a.data[r * a.stride..][..depth];
        for (s, pairs) in row.chunks(TILE).enumerate() {
            dst[s * step..][..pairs.len()].copy_from_slice(pairs);
        }
    };
    // SAFETY: as this function's; `fill` writes row r's `depth` pairs.
    unsafe { with_tiles(m, fill, b, c, par) }
}

/// [`gemm`] with `A` given as `m` rows of `k` f32 values at `stride`, rounded to bf16 as they are
/// laid out in tiles (one pass over `A` instead of rounding it into rows and then copying those).
///
/// # Safety
/// As [`gemm`]'s, with `x` holding `m` rows of `k` at `stride` and `b` of `k.div_ceil(2)` pairs.
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemm_f32(
    x: &[f32],
    stride: usize,
    m: usize,
    k: usize,
    b: PanelView<'_, u32>,
    c: Out,
    par: bool,
) {
    if m == 0 || b.n == 0 {
        return;
    }
    assert!(
        b.depth == k.div_ceil(2) && (m - 1) * stride + k <= x.len(),
        "amx gemm: A too short for its rows"
    );
    let fill = |r: usize, dst: &mut [u32], step: usize| {
        super::bf16::round_row_in_steps(&x[r * stride..][..k], dst, step);
    };
    // SAFETY: as this function's; `fill` writes row r's pairs.
    unsafe { with_tiles(m, fill, b, c, par) }
}

/// Lays `A` out as tiles ([`Padded::lay_out`]), then runs the product's tasks.
///
/// # Safety
/// As [`gemm`]'s, for an `A` of `m` rows and `b.depth` pairs.
#[cfg(target_arch = "x86_64")]
unsafe fn with_tiles(
    m: usize,
    fill: impl Fn(usize, &mut [u32], usize) + Sync,
    b: PanelView<'_, u32>,
    c: Out,
    par: bool,
) {
    let run = |buf: &mut Aligned<u32>| {
        let padded = Padded::lay_out(m, b.depth, &fill, par, buf);
        // SAFETY: as this function's; `padded` holds every tile of `A`.
        unsafe { run_tasks(&padded, b, c, par) };
    };
    thread_local! {
        static PADDED: std::cell::RefCell<Aligned<u32>> =
            std::cell::RefCell::new(Aligned::zeroed(0));
    }
    // A product reached again on this thread while the buffer is in use (a rayon worker that
    // picked up other work while it waited) takes a buffer of its own.
    PADDED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => run(&mut buf),
        Err(_) => run(&mut Aligned::zeroed(0)),
    });
}

/// `A` as tiles: `tile_rows` rows (fewer than 16 only when `A` has fewer) of 16 pairs each, `steps`
/// tiles along the depth for each 16 rows; `rows` real rows, zeros after them and past the depth.
struct Padded<'a> {
    data: &'a [u32],
    steps: usize,
    rows: usize,
    tile_rows: usize,
}

impl<'a> Padded<'a> {
    /// Lays `m` rows of `A` (`depth` pairs each) out in `buf` as tiles, `fill(r, dst, step)`
    /// writing row `r`'s pairs with pairs `16s..16s + 16` at `dst[s·step..]`.
    ///
    /// `A` is laid out tile by tile (each tile's rows of 16 pairs contiguous, a row of tiles after
    /// another along the depth), its rows padded to whole tiles and its depth to whole tile rows
    /// with zeros: the tiles then load 1 KiB runs that the prefetchers follow, never read past
    /// `A`, and the zeros add nothing to any sum. One row or a few run on tiles of that many rows.
    fn lay_out(
        m: usize,
        depth: usize,
        fill: &(impl Fn(usize, &mut [u32], usize) + Sync),
        par: bool,
        buf: &'a mut Aligned<u32>,
    ) -> Self {
        let tile_rows = m.min(TILE);
        let steps = depth.div_ceil(TILE);
        let tile_len = tile_rows * TILE;
        // Pairs of a row's last tile past the depth, zeroed after `fill` (the whole buffer zeroed
        // first took 3% of an image's attention).
        let tail = steps * TILE - depth;
        buf.resize(m.div_ceil(TILE) * steps * tile_len);
        let lay_out = |(rt, dst): (usize, &mut [u32])| {
            let real = tile_rows.min(m - rt * TILE);
            for i in 0..real {
                fill(rt * TILE + i, &mut dst[i * TILE..], tile_len);
                if tail > 0 {
                    dst[(steps - 1) * tile_len + i * TILE..][TILE - tail..TILE].fill(0);
                }
            }
            // The last row tile's rows past `A`.
            for i in real..tile_rows {
                for s in 0..steps {
                    dst[s * tile_len + i * TILE..][..TILE].fill(0);
                }
            }
        };
        if par && m * depth >= 1 << 16 {
            buf.par_chunks_mut(steps * tile_len)
                .enumerate()
                .for_each(lay_out);
        } else {
            buf.chunks_mut(steps * tile_len)
                .enumerate()
                .for_each(lay_out);
        }
        Padded {
            data: buf,
            steps,
            rows: m,
            tile_rows,
        }
    }

    /// The tile of rows `r..r + 16` (r a multiple of 16) and pairs `q..q + 16` (q likewise).
    fn tile(&self, r: usize, q: usize) -> *const u32 {
        self.data[((r / TILE) * self.steps + q / TILE) * self.tile_rows * TILE..].as_ptr()
    }
}

/// The product's tasks, split as the panel kernels split theirs.
///
/// # Safety
/// As [`gemm`]'s.
#[cfg(target_arch = "x86_64")]
unsafe fn run_tasks(a: &Padded<'_>, b: PanelView<'_, u32>, c: Out, par: bool) {
    let bytes = b.depth * NR * 4;
    for_each_task(a.rows, b.n, b.depth, bytes, par, |rows, panels| {
        // SAFETY: the CPU has AMX-BF16 and AVX-512F and the process holds the tile state
        // (`enabled`, the caller's promise); the task's rows and panels are inside the extents
        // `gemm`'s caller guarantees, and tasks own disjoint tiles of C.
        unsafe { task_tiles(a, b, c, rows, panels) };
    });
}

/// A tile's worth of memory on a cache line: tile rows that straddle two lines load and store
/// several times slower (`aligned.rs`).
#[repr(C, align(64))]
struct Lines<T>(T);

/// The tile configuration (`ldtilecfg`'s 64 bytes): palette 1; tiles 0–3 the sums (`rows` × 16
/// f32), 4–5 `A` (`rows` × 16 pairs), 6–7 the panel (16 pairs × 16 columns).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    fn new(rows: usize) -> Self {
        let mut cfg = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = if t < 6 { rows as u8 } else { TILE as u8 };
        }
        cfg
    }
}

/// One task: for each panel, for each step of up to 32 rows, the whole depth summed in four
/// tiles and added to `C` once.
///
/// Each step's loads are ordered by when their tile is free again (no tile is renamed: a load
/// waits for the products still reading its register): the first `A` tile's last reader was
/// the previous step's second product, the panel's first tile's its third, so they load first
/// and their product starts while the other two load.
///
/// # Safety
/// The CPU has AMX-BF16 and AVX-512F and the process holds the tile state; `rows` and `panels`
/// are inside the product and the caller owns that part of `C`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn task_tiles(
    a: &Padded<'_>,
    b: PanelView<'_, u32>,
    c: Out,
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
) {
    use std::arch::asm;
    let cfg = Config::new(a.tile_rows);
    // SAFETY: `cfg` is a valid palette-1 configuration, 64 bytes, aligned.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
    let depth = b.depth;
    let full = depth / TILE * TILE;
    // The panel's last, partial tile of pairs, padded with zero pairs.
    let mut tail = Lines([0u32; TILE * NR]);
    let tail = &mut tail.0;
    // One sum tile on its way to `C`.
    let mut sums = Lines([0f32; TILE * TILE]);
    let sums = &mut sums.0;
    let a_bytes = TILE * 4;
    let b_bytes = NR * 4;
    // `C = A · Bᵀ` as the sums are: whole tiles go to `C` straight from the tile registers.
    let plain = c.alpha == 1.0 && !c.accumulate;
    for p in panels {
        let cols = (b.n - p * NR).min(NR);
        let panel = &b.data[p * b.stride + b.first * NR..];
        if full < depth {
            tail.fill(0);
            tail[..(depth - full) * NR].copy_from_slice(&panel[full * NR..depth * NR]);
        }
        let mut r = rows.start;
        while r < rows.end {
            let h = (rows.end - r).min(STEP_ROWS);
            let two = h > TILE;
            // SAFETY: zeroing tile registers touches no memory.
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nomem, nostack)
                )
            };
            for q in (0..depth).step_by(TILE) {
                let bp = match q < full {
                    true => panel[q * NR..].as_ptr(),
                    false => tail.as_ptr(),
                };
                // SAFETY: the panel tiles read 16 pair rows of 32 columns from `bp` (inside the
                // panel for q < full, else the padded tail); the `A` tiles read `tile_rows` rows
                // of 16 pairs, the tiles of rows r (and r + 16) and pairs q.
                unsafe {
                    if two {
                        asm!(
                            "tileloadd tmm4, [{a} + {as_}]",
                            "tileloadd tmm6, [{b} + {bs}]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tileloadd tmm7, [{b} + {bs} + 64]",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm5, [{a2} + {as_}]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a = in(reg) a.tile(r, q),
                            a2 = in(reg) a.tile(r + TILE, q),
                            as_ = in(reg) a_bytes,
                            b = in(reg) bp,
                            bs = in(reg) b_bytes,
                            options(nostack, readonly)
                        );
                    } else {
                        asm!(
                            "tileloadd tmm4, [{a} + {as_}]",
                            "tileloadd tmm6, [{b} + {bs}]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tileloadd tmm7, [{b} + {bs} + 64]",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            a = in(reg) a.tile(r, q),
                            as_ = in(reg) a_bytes,
                            b = in(reg) bp,
                            bs = in(reg) b_bytes,
                            options(nostack, readonly)
                        );
                    }
                }
            }
            for t in 0..if two { 4 } else { 2 } {
                let (r0, c0) = (r + (t / 2) * TILE, (t % 2) * TILE);
                let (th, tc) = ((r + h - r0).min(TILE), cols.saturating_sub(c0));
                if tc == 0 {
                    continue;
                }
                if plain && th == TILE && tc >= TILE {
                    // SAFETY: the tile's 16 rows of 16 columns are this task's part of C.
                    unsafe { store_tile(t, c.at(r0, p * NR + c0), c.stride * 4) };
                    continue;
                }
                // SAFETY: `sums` holds 16 rows of 64 bytes; tile t is one of tmm0..3.
                unsafe { store_sums(t, sums) };
                // SAFETY: rows r0..r0+th and columns p·NR+c0..+tc are this task's part of C.
                unsafe { add_to_c(sums, c, r0, p * NR + c0, th, tc.min(TILE), c.accumulate) };
            }
            r += h;
        }
    }
    // SAFETY: releasing the tiles touches no memory and returns them to their init state.
    unsafe { asm!("tilerelease", options(nomem, nostack)) };
}

/// Sum tile `t` (tmm0–3) into 16 rows of 16 f32 at `dst`, `stride` bytes apart.
///
/// # Safety
/// The tiles are configured (by this thread's task) and those 16 × 16 values are the caller's
/// to write.
#[cfg(target_arch = "x86_64")]
unsafe fn store_tile(t: usize, dst: *mut f32, stride: usize) {
    use std::arch::asm;
    let (p, s) = (dst, stride);
    // SAFETY: as this function's; the tile has 16 rows of 64 bytes.
    unsafe {
        match t {
            0 => {
                asm!("tilestored [{p} + {s}], tmm0", p = in(reg) p, s = in(reg) s, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s}], tmm1", p = in(reg) p, s = in(reg) s, options(nostack))
            }
            2 => {
                asm!("tilestored [{p} + {s}], tmm2", p = in(reg) p, s = in(reg) s, options(nostack))
            }
            _ => {
                asm!("tilestored [{p} + {s}], tmm3", p = in(reg) p, s = in(reg) s, options(nostack))
            }
        }
    }
}

/// Sum tile `t` (tmm0–3) into `out`, 64 bytes a row.
///
/// # Safety
/// The tiles are configured (by this thread's task).
#[cfg(target_arch = "x86_64")]
unsafe fn store_sums(t: usize, out: &mut [f32; TILE * TILE]) {
    // SAFETY: as this function's; `out` holds 16 rows of 16 f32, 64 bytes apart.
    unsafe { store_tile(t, out.as_mut_ptr(), TILE * 4) }
}

/// `C[r0 + i][col + j] = alpha · sums[i][j]` (added to what is there when `accumulate`) for
/// `i < rows`, `j < cols ≤ 16`.
///
/// # Safety
/// Those elements of `C` are the caller's to write (and read), and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_to_c(
    sums: &[f32; TILE * TILE],
    c: Out,
    r0: usize,
    col: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let (mask, scale) = (lanes(cols), std::arch::x86_64::_mm512_set1_ps(c.alpha));
    for i in 0..rows {
        // SAFETY: row i of `sums` is 16 f32; the masked columns of C's row are the caller's.
        unsafe {
            let v = std::arch::x86_64::_mm512_loadu_ps(sums.as_ptr().add(i * TILE));
            store_lanes(v, c.at(r0 + i, col), mask, scale, accumulate);
        }
    }
}

/// Whether this machine cannot run the AMX tests, said on stderr so that CI's log shows it.
#[cfg(all(test, target_arch = "x86_64"))]
fn skip_without_amx() -> bool {
    let skip = !available();
    if skip {
        eprintln!("SKIPPED: this CPU (or kernel) has no AMX-BF16; the AMX kernel was not run");
    }
    skip
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::cpu::bf16;
    use crate::cpu::panels::{Panels, gemm_tiles};
    use crate::cpu::testutil::Rng;

    /// The tiles' product against the `vdpbf16ps`/portable tiles' at odd sizes (partial row
    /// tiles, partial pair tiles, partial panels, depth past one block, views), both against f64
    /// of the rounded inputs; one row alone equals the same row in a batch, bit for bit.
    #[test]
    fn amx_products_match_the_panel_tiles_and_are_batch_invariant() {
        if skip_without_amx() {
            return;
        }
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 30, 5),
            (7, 17, 33),
            (16, 64, 32),
            (17, 512, 2048),
            (33, 4099, 65),
            (200, 64, 97),
            (31, 1030, 40),
        ] {
            let mut rng = Rng::new((m * 7919 + k * 31 + n) as u64);
            let (a, bm) = (rng.vec(m * k, 2.0), rng.vec(n * k, 1.0));
            let panels = Panels::from_f32_rows(&bm, k, n, k);
            let mut packed = Vec::new();
            let stride = bf16::round_rows(&a, k, m, k, &mut packed, false);
            let lhs = Lhs {
                data: &packed,
                stride,
                rows: m,
            };
            let ldc = n + 3;
            let start: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32 * 0.25).collect();
            let rounded = |x: f32| half::bf16::from_f32(x).to_f64();
            // Scaled and added to C (through the sum tile), or stored as summed (whole tiles
            // straight from the tile registers).
            for (alpha, accumulate) in [(0.5f32, true), (1.0, false)] {
                let out = |c: &mut Vec<f32>| Out {
                    ptr: c.as_mut_ptr(),
                    stride: ldc,
                    alpha,
                    accumulate,
                };
                let (mut amx, mut tiles) = (start.clone(), start.clone());
                // SAFETY: both buffers hold m rows of ldc ≥ n; AMX is available.
                unsafe {
                    gemm(&lhs, panels.all(), out(&mut amx), true);
                    gemm_tiles(&lhs, panels.all(), out(&mut tiles), true);
                }
                for i in 0..m {
                    for j in 0..n {
                        let w: f64 = if accumulate {
                            start[i * ldc + j] as f64
                        } else {
                            0.0
                        } + alpha as f64
                            * (0..k)
                                .map(|t| rounded(a[i * k + t]) * rounded(bm[j * k + t]))
                                .sum::<f64>();
                        let tol = 1e-6 * (k as f64).sqrt() * 4.0 + 1e-6;
                        for (name, got) in
                            [("amx", amx[i * ldc + j]), ("tiles", tiles[i * ldc + j])]
                        {
                            assert!(
                                (got as f64 - w).abs() <= tol * w.abs().max(1.0),
                                "{name} {m}×{k}×{n} [{i},{j}]: {got} vs {w}"
                            );
                        }
                    }
                    assert_eq!(
                        amx[i * ldc + n..(i + 1) * ldc],
                        start[i * ldc + n..(i + 1) * ldc],
                        "wrote past column {n}"
                    );
                }
                // Each row alone gives the bits it had in the batch.
                for i in [0, m / 2, m - 1] {
                    let lone = Lhs {
                        data: &packed[i * stride..],
                        stride,
                        rows: 1,
                    };
                    let mut row = start[i * ldc..(i + 1) * ldc].to_vec();
                    // SAFETY: `row` holds one row of ldc ≥ n.
                    unsafe { gemm(&lone, panels.all(), out(&mut row), false) };
                    assert_eq!(
                        row.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        amx[i * ldc..(i + 1) * ldc]
                            .iter()
                            .map(|x| x.to_bits())
                            .collect::<Vec<_>>(),
                        "{m}×{k}×{n}: row {i} alone differs from the batch"
                    );
                }
            }
        }
    }

    /// Rounding f32 rows straight into the tiles gives the bits of rounding them into rows first.
    #[test]
    fn amx_products_of_f32_rows_equal_those_of_rounded_rows() {
        if skip_without_amx() {
            return;
        }
        for &(m, k, n) in &[(1, 1, 1), (5, 33, 40), (17, 64, 32), (40, 1001, 70)] {
            let mut rng = Rng::new((m * 31 + k) as u64);
            let (a, bm) = (rng.vec(m * (k + 3), 2.0), rng.vec(n * k, 1.0));
            let panels = Panels::from_f32_rows(&bm, k, n, k);
            let mut packed = Vec::new();
            let stride = bf16::round_rows(&a, k + 3, m, k, &mut packed, false);
            let lhs = Lhs {
                data: &packed,
                stride,
                rows: m,
            };
            let (mut x, mut y) = (vec![0f32; m * n], vec![0f32; m * n]);
            for (buf, f32_rows) in [(&mut x, true), (&mut y, false)] {
                let out = Out {
                    ptr: buf.as_mut_ptr(),
                    stride: n,
                    alpha: 1.0,
                    accumulate: false,
                };
                // SAFETY: each buffer holds m rows of n; `a` m rows of k at k + 3; AMX is there.
                unsafe {
                    match f32_rows {
                        true => gemm_f32(&a, k + 3, m, k, panels.all(), out, true),
                        false => gemm(&lhs, panels.all(), out, true),
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&y), "{m}×{k}×{n}");
        }
    }

    /// A view of later panels and later pairs on the tiles equals the panel tiles' result on it.
    #[test]
    fn amx_views_select_rows_and_pairs() {
        if skip_without_amx() {
            return;
        }
        let (m, k, n) = (40, 600, 100);
        let mut rng = Rng::new(3);
        let (a, bm) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
        let panels = Panels::from_f32_rows(&bm, k, n, k);
        let mut packed = Vec::new();
        let stride = bf16::round_rows(&a, k, m, k, &mut packed, false);
        let lhs = Lhs {
            data: &packed[5..],
            stride,
            rows: m,
        };
        let (mut x, mut y) = (vec![0f32; m * 68], vec![0f32; m * 68]);
        for (buf, amx) in [(&mut x, true), (&mut y, false)] {
            let out = Out {
                ptr: buf.as_mut_ptr(),
                stride: 68,
                alpha: 1.0,
                accumulate: false,
            };
            let view = panels.view(32..100, 5..290);
            // SAFETY: each buffer holds m rows of 68; AMX is available.
            unsafe {
                match amx {
                    true => gemm(&lhs, view, out, false),
                    false => gemm_tiles(&lhs, view, out, false),
                }
            }
        }
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            assert!(
                (p - q).abs() <= 1e-4 * q.abs().max(1.0),
                "[{i}]: {p} vs {q}"
            );
        }
    }
}

/// `cargo test --release -p tessera-backend --lib amx_rate -- --ignored --nocapture`: the tiles'
/// rate on EmbeddingGemma 2's document products (2,208 rows) against the `vdpbf16ps` tiles'.
#[cfg(all(test, target_arch = "x86_64"))]
mod rate {
    use super::*;
    use crate::cpu::bf16;
    use crate::cpu::panels::{Panels, gemm_tiles};
    use crate::cpu::testutil::Rng;
    use std::time::Instant;

    #[test]
    #[ignore = "a measurement: run on a quiet machine"]
    fn amx_rate() {
        if skip_without_amx() {
            return;
        }
        // `SHAPES=2208x768x768,64x768x6144` measures other shapes.
        let shapes: Vec<(usize, usize, usize)> = match std::env::var("SHAPES") {
            Ok(v) => v
                .split(',')
                .map(|t| {
                    let x: Vec<usize> = t.split('x').map(|u| u.parse().expect("m×k×n")).collect();
                    (x[0], x[1], x[2])
                })
                .collect(),
            Err(_) => vec![
                (2208, 768, 768),
                (2208, 768, 6144),
                (2208, 3072, 768),
                (64, 768, 6144),
            ],
        };
        for &(m, k, n) in &shapes {
            let mut rng = Rng::new(1);
            let (a, bm) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
            let panels = Panels::from_f32_rows(&bm, k, n, k);
            let mut packed = Vec::new();
            let stride = bf16::round_rows(&a, k, m, k, &mut packed, true);
            let lhs = Lhs {
                data: &packed,
                stride,
                rows: m,
            };
            let mut c = vec![0f32; m * n];
            let out = Out {
                ptr: c.as_mut_ptr(),
                stride: n,
                alpha: 1.0,
                accumulate: false,
            };
            let time = |amx: bool| {
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = Instant::now();
                    // SAFETY: `c` holds m rows of n.
                    unsafe {
                        match amx {
                            true => gemm(&lhs, panels.all(), out, true),
                            false => gemm_tiles(&lhs, panels.all(), out, true),
                        }
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                2.0 * (m * n * k) as f64 / best / 1e9
            };
            let (x, y) = (time(true), time(false));
            eprintln!(
                "{m}×{k}×{n}: AMX {x:.0} GFLOP/s, vdpbf16ps {y:.0} GFLOP/s ({:.1}×)",
                x / y
            );
        }
    }
}

/// `cargo test --release -p tessera-backend --lib amx_alignment -- --ignored --nocapture`: one
/// task of the tile kernel on operands that start on a cache line against the same operands 16
/// bytes off it, alternating, beside a loop of nothing but `tdpbf16ps` (the unit's rate at that
/// moment: on the build VMs it wanders by 2× from minute to minute).
#[cfg(all(test, target_arch = "x86_64"))]
mod alignment {
    use super::*;
    use crate::cpu::aligned::LINE;
    use crate::cpu::bf16;
    use crate::cpu::panels::Panels;
    use crate::cpu::testutil::Rng;
    use std::arch::asm;
    use std::time::Instant;

    /// `iters` rounds of four `tdpbf16ps` on tiles already loaded: the unit's peak.
    #[target_feature(enable = "avx512f")]
    unsafe fn peak(iters: usize) {
        let cfg = Config::new(TILE);
        let buf = Aligned::<u32>::zeroed(TILE * TILE);
        // SAFETY: a valid configuration; the loads read 16 rows of 64 bytes from `buf`; the
        // products touch no memory; the tiles are released at the end.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
            asm!(
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                "tileloadd tmm4, [{a} + {s}]", "tileloadd tmm5, [{a} + {s}]",
                "tileloadd tmm6, [{a} + {s}]", "tileloadd tmm7, [{a} + {s}]",
                a = in(reg) buf.as_ptr(), s = in(reg) 64usize, options(nostack, readonly)
            );
            for _ in 0..iters {
                asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    options(nomem, nostack)
                );
            }
            asm!("tilerelease", options(nomem, nostack));
        }
    }

    #[test]
    #[ignore = "a measurement: run on a quiet machine"]
    fn amx_alignment() {
        if skip_without_amx() {
            return;
        }
        let (m, k, n) = (192, 768, 160);
        let mut rng = Rng::new(1);
        let (a, bm) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
        let panels = Panels::from_f32_rows(&bm, k, n, k);
        let mut c = vec![0f32; m * n];
        let out = Out {
            ptr: c.as_mut_ptr(),
            stride: n,
            alpha: 1.0,
            accumulate: false,
        };
        let view = panels.all();
        let mut buf = Aligned::zeroed(0);
        let round = |r: usize, dst: &mut [u32], step: usize| {
            bf16::round_row_in_steps(&a[r * k..][..k], dst, step)
        };
        let tiles = Padded::lay_out(m, view.depth, &round, false, &mut buf);
        // The same operands 16 bytes past a line, as a `Vec` from the allocator may be: the
        // copy, and where in it they start.
        let off_line = |src: &[u32]| {
            let mut v = vec![0u32; src.len() + 20];
            let at = (16 - (v.as_ptr() as usize % LINE) / 4) % 16 + 4;
            v[at..at + src.len()].copy_from_slice(src);
            (v, at)
        };
        let ((off_a, at_a), (off_b, at_b)) = (off_line(tiles.data), off_line(view.data));
        let cases = [
            (tiles.data, view),
            (
                &off_a[at_a..at_a + tiles.data.len()],
                PanelView {
                    data: &off_b[at_b..],
                    ..view
                },
            ),
        ];
        let mut rates = [Vec::new(), Vec::new(), Vec::new()];
        let (reps, flop) = (100, 2.0 * (m * n * k) as f64);
        for _ in 0..7 {
            for (v, &(data, b)) in cases.iter().enumerate() {
                let a = Padded { data, ..tiles };
                let t = Instant::now();
                for _ in 0..reps {
                    // SAFETY: `c` holds m rows of n; the CPU has AMX (checked above).
                    unsafe { task_tiles(&a, b, out, 0..m, 0..n.div_ceil(NR)) };
                }
                rates[v].push(reps as f64 * flop / t.elapsed().as_secs_f64() / 1e9);
            }
            let tdps = reps * (m / TILE) * (n / TILE) * tiles.steps;
            let t = Instant::now();
            // SAFETY: the CPU has AMX (checked above).
            unsafe { peak(tdps / 4) };
            rates[2].push(tdps as f64 * 16384.0 / t.elapsed().as_secs_f64() / 1e9);
        }
        for (name, r) in ["on a line", "16 bytes off", "tdpbf16ps alone"]
            .iter()
            .zip(&mut rates)
        {
            r.sort_by(f64::total_cmp);
            eprintln!(
                "{m}×{k}×{n}, {name}: {:.0} GFLOP/s ({:.0}–{:.0})",
                r[3], r[0], r[6]
            );
        }
    }
}
