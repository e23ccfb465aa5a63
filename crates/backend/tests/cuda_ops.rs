//! Every CUDA op against the CPU reference op, on random inputs, in both precisions.
//!
//! Run on a GPU machine: `cargo test -p tessera-backend --test cuda_ops -- --ignored`.
//! Inputs are rounded to bf16 first so both backends see identical values. Outputs are compared
//! by relative max error (`max|a−b| / max|b|`) and NMSE; every output buffer is poisoned with NaN
//! outside the written view and checked to stay untouched there (out-of-bounds writes), and
//! every written element must be finite (unwritten outputs stay NaN and fail).
#![cfg(feature = "cuda")]

use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda::{self, CudaBackend, FlashChoice, FlashKernel, attention};
use tessera_backend::{
    Activation, After, AttnSpec, Backend, Epilogue, Precision, QkvLayout, Role, RopeStyle,
    RopeTable, Segments, View, ViewMut,
};

struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32) * 2.0
            - 1.0
    }
    /// Uniform in [-scale, scale), rounded to bf16 so both precisions see the same values.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| half::bf16::from_f32(self.next() * scale).to_f32())
            .collect()
    }
}

fn gpu(p: Precision) -> CudaBackend {
    cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"))
}

/// Tolerance of a precision: (max relative error, NMSE).
fn tol(p: Precision, loose: bool) -> (f64, f64) {
    match (p, loose) {
        (Precision::F32, _) => (2e-5, 1e-10),
        (Precision::Bf16, false) => (1e-2, 3e-5),
        // Attention re-rounds q·kᵀ probabilities to bf16 for the second product.
        (Precision::Bf16, true) => (2e-2, 1e-4),
    }
}

fn compare(what: &str, got: &[f32], want: &[f32], t: (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want
        .iter()
        .fold(0f64, |m, &v| m.max(v.abs() as f64))
        .max(1e-30);
    let (mut max_err, mut se, mut ss) = (0f64, 0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g} (want {w})");
        let d = (g as f64 - w as f64).abs();
        max_err = max_err.max(d);
        se += d * d;
        ss += (w as f64) * (w as f64);
    }
    let rel = max_err / scale;
    let nmse = se / ss.max(1e-30);
    eprintln!("  {what}: rel max err {rel:.2e}, nmse {nmse:.2e}");
    assert!(
        rel <= t.0 && nmse <= t.1,
        "{what}: rel max err {rel:.3e} (≤ {:.0e}), nmse {nmse:.3e} (≤ {:.0e})",
        t.0,
        t.1
    );
}

/// A buffer of `rows × width` filled with NaN, then `data` written into columns
/// `[off, off + cols)` of each row (the rest stays NaN as a guard).
fn padded<B: Backend>(
    be: &B,
    role: Role,
    rows: usize,
    width: usize,
    off: usize,
    cols: usize,
    data: Option<&[f32]>,
) -> B::Buf {
    let mut host = vec![f32::NAN; rows * width];
    if let Some(d) = data {
        for r in 0..rows {
            host[r * width + off..r * width + off + cols]
                .copy_from_slice(&d[r * cols..(r + 1) * cols]);
        }
    }
    let mut b = be.alloc(rows * width, role).unwrap();
    be.write_f32(&mut b, &host).unwrap();
    b
}

/// Read the whole buffer; return the view's values and assert the guard columns are still NaN.
fn take<B: Backend>(
    be: &B,
    buf: &B::Buf,
    rows: usize,
    width: usize,
    off: usize,
    cols: usize,
    what: &str,
) -> Vec<f32> {
    let all = be.read_f32(View::new(buf, rows, width)).unwrap();
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..width {
            let v = all[r * width + c];
            if c >= off && c < off + cols {
                out.push(v);
            } else {
                assert!(
                    v.is_nan(),
                    "{what}: wrote outside the view at row {r}, column {c}"
                );
            }
        }
    }
    out
}

fn ids<B: Backend>(be: &B, v: &[u32]) -> B::Buf {
    let mut b = be.alloc(v.len(), Role::Index).unwrap();
    be.write_u32(&mut b, v).unwrap();
    b
}

// ---- per-op runners, generic over the backend -------------------------------------------

/// `out = alpha · x · wᵀ` for x `[m, k]`, w `[n, k]`.
struct MatmulCase<'a> {
    x: &'a [f32],
    w: &'a [f32],
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
}

fn run_matmul<B: Backend>(be: &B, c: &MatmulCase<'_>, out_role: Role) -> Vec<f32> {
    let MatmulCase {
        x,
        w,
        m,
        k,
        n,
        alpha,
    } = *c;
    // x in columns 8.. of a wider buffer, out in columns 8.. of another (16-byte-aligned offsets).
    let xb = padded(be, Role::Compute, m, k + 16, 8, k, Some(x));
    let mat = be.matrix(&[(w, n)], k).unwrap();
    let mut ob = padded(be, out_role, m, n + 16, 8, n, None);
    be.matmul(
        View::new(&xb, m, k + 16).cols(8, k),
        &mat,
        ViewMut::new(&mut ob, m, n + 16).cols(8, n),
        Epilogue::scaled(alpha),
    )
    .unwrap();
    take(be, &ob, m, n + 16, 8, n, "matmul")
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_matches_cpu() {
    let cpu = CpuBackend::new();
    for p in [Precision::F32, Precision::Bf16] {
        let g = gpu(p);
        for &(m, k, n) in &[
            (1, 512, 2048),
            (17, 512, 1536),
            (333, 768, 3072),
            (2208, 2048, 512),
            (37, 104, 61),
            (4096, 512, 12288),
        ] {
            let mut rng = Rng::new((m * 31 + k * 7 + n) as u64);
            let x = rng.vec(m * k, 1.0);
            let w = rng.vec(n * k, 1.0 / (k as f32).sqrt());
            let case = MatmulCase {
                x: &x,
                w: &w,
                m,
                k,
                n,
                alpha: 0.75,
            };
            let want = run_matmul(&cpu, &case, Role::Stream);
            for role in [Role::Stream, Role::Compute] {
                let got = run_matmul(&g, &case, role);
                compare(
                    &format!("matmul {p} {m}×{k}×{n} → {role:?}"),
                    &got,
                    &want,
                    tol(p, false),
                );
            }
        }
    }
}

/// Inputs of the norm ops: rows of `x` (rms_norm), `y` and `h0` (residual), weights `w`, `w2`.
struct NormCase {
    x: Vec<f32>,
    y: Vec<f32>,
    h0: Vec<f32>,
    w: Vec<f32>,
    w2: Vec<f32>,
    rows: usize,
    cols: usize,
}

fn run_norms<B: Backend>(be: &B, c: &NormCase, mode: usize) -> Vec<Vec<f32>> {
    let (x, y, h0, w, w2) = (&c.x, &c.y, &c.h0, &c.w, &c.w2);
    let (rows, cols) = (c.rows, c.cols);
    let wv = be.vector(w).unwrap();
    let w2v = be.vector(w2).unwrap();
    let xb = padded(be, Role::Compute, rows, cols + 8, 8, cols, Some(x));
    let mut ob = padded(be, Role::Compute, rows, cols + 8, 0, cols, None);
    be.rms_norm(
        View::new(&xb, rows, cols + 8).cols(8, cols),
        Some(&wv),
        1e-6,
        ViewMut::new(&mut ob, rows, cols + 8).cols(0, cols),
    )
    .unwrap();
    let normed = take(be, &ob, rows, cols + 8, 0, cols, "rms_norm");
    let yb = padded(be, Role::Compute, rows, cols, 0, cols, Some(y));
    let mut hb = padded(be, Role::Stream, rows, cols, 0, cols, Some(h0));
    let mut nb = padded(be, Role::Compute, rows, cols + 8, 8, cols, None);
    let after = match mode {
        0 => After::Nothing,
        1 => After::Norm(&w2v, ViewMut::new(&mut nb, rows, cols + 8).cols(8, cols)),
        _ => After::Copy(ViewMut::new(&mut nb, rows, cols + 8).cols(8, cols)),
    };
    be.residual_norm(
        ViewMut::new(&mut hb, rows, cols),
        View::new(&yb, rows, cols),
        Some(&wv),
        0.8,
        after,
        1e-6,
    )
    .unwrap();
    let h = take(be, &hb, rows, cols, 0, cols, "residual h");
    let mut out = vec![normed, h];
    if mode != 0 {
        out.push(take(be, &nb, rows, cols + 8, 8, cols, "residual after"));
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn norms_match_cpu() {
    let cpu = CpuBackend::new();
    for p in [Precision::F32, Precision::Bf16] {
        let g = gpu(p);
        // 512, 768 and 1024 take the warp-per-row kernels (300 rows: a partial last block); the
        // others the block-per-row ones.
        for &(rows, cols) in &[
            (1, 24),
            (7, 512),
            (300, 768),
            (64, 1024),
            (33, 1000),
            (5, 3840),
        ] {
            for mode in 0..3 {
                let mut rng = Rng::new((rows * cols + mode) as u64);
                let (x, y, h0) = (
                    rng.vec(rows * cols, 3.0),
                    rng.vec(rows * cols, 3.0),
                    rng.vec(rows * cols, 2.0),
                );
                let w: Vec<f32> = rng.vec(cols, 0.3).iter().map(|v| 1.0 + v).collect();
                let w2: Vec<f32> = rng.vec(cols, 0.3).iter().map(|v| 1.0 + v).collect();
                let case = NormCase {
                    x,
                    y,
                    h0,
                    w,
                    w2,
                    rows,
                    cols,
                };
                let want = run_norms(&cpu, &case, mode);
                let got = run_norms(&g, &case, mode);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    compare(
                        &format!("norm {p} {rows}×{cols} mode {mode} output {i}"),
                        a,
                        b,
                        tol(p, false),
                    );
                }
            }
        }
    }
}

fn run_qkv<B: Backend>(
    be: &B,
    x: &[f32],
    layout: QkvLayout,
    qw: &[f32],
    kw: &[f32],
    pos: &[u32],
    inv_freq: &[f32],
) -> Vec<f32> {
    let rows = pos.len();
    let width = layout.width();
    let mut xb = padded(be, Role::Compute, rows, width, 0, width, Some(x));
    let table = RopeTable::new(be, inv_freq, 4096, RopeStyle::SplitHalf).unwrap();
    let pb = ids(be, pos);
    let (qv, kv) = (be.vector(qw).unwrap(), be.vector(kw).unwrap());
    be.qkv_norm_rope(
        ViewMut::new(&mut xb, rows, width),
        layout,
        Some(&qv),
        Some(&kv),
        true,
        1e-6,
        Some((&table, &pb)),
    )
    .unwrap();
    take(be, &xb, rows, width, 0, width, "qkv_norm_rope")
}

#[test]
#[ignore = "needs a CUDA device"]
fn qkv_norm_rope_matches_cpu() {
    let cpu = CpuBackend::new();
    for p in [Precision::F32, Precision::Bf16] {
        let g = gpu(p);
        for &(hq, hkv, hd, theta) in &[
            (4, 2, 256, 1e4f32),
            (4, 1, 512, 1e6),
            (12, 12, 64, 100.0),
            (4, 2, 16, 1e4),
            (4, 1, 32, 1e6),
        ] {
            let layout = QkvLayout {
                heads_q: hq,
                heads_kv: hkv,
                head_dim: hd,
            };
            let pos: Vec<u32> = (0..70u32).chain(0..13).chain([4000, 4095]).collect();
            let mut rng = Rng::new(hd as u64 + hq as u64);
            let x = rng.vec(pos.len() * layout.width(), 2.0);
            let qw: Vec<f32> = rng.vec(hd, 0.3).iter().map(|v| 1.0 + v).collect();
            let kw: Vec<f32> = rng.vec(hd, 0.3).iter().map(|v| 1.0 + v).collect();
            let inv: Vec<f32> = (0..hd / 2)
                .map(|j| 1.0 / theta.powf(2.0 * j as f32 / hd as f32))
                .collect();
            let want = run_qkv(&cpu, &x, layout, &qw, &kw, &pos, &inv);
            let got = run_qkv(&g, &x, layout, &qw, &kw, &pos, &inv);
            compare(
                &format!("qkv_norm_rope {p} {hq}/{hkv}×{hd}"),
                &got,
                &want,
                tol(p, false),
            );
        }
    }
}

/// `op` (an attention launch) on `x` (q|k|v rows) in `be`'s buffers; returns the output.
fn run_attention<B: Backend>(
    be: &B,
    x: &[f32],
    lens: &[usize],
    spec: &AttnSpec,
    op: impl FnOnce(View<'_, B>, View<'_, B>, View<'_, B>, ViewMut<'_, B>, &Segments<B>),
) -> Vec<f32> {
    let total: usize = lens.iter().sum();
    let (qc, kc) = (spec.heads_q * spec.head_dim, spec.heads_kv * spec.head_dim);
    let width = qc + 2 * kc;
    let xb = padded(be, Role::Compute, total, width, 0, width, Some(x));
    // Capacity larger than needed, as in a reused workspace.
    let mut segs = be.alloc_segments(total + 100, lens.len() + 3).unwrap();
    be.set_segments(&mut segs, lens).unwrap();
    let mut ob = padded(be, Role::Compute, total, qc + 8, 8, qc, None);
    let all = View::new(&xb, total, width);
    op(
        all.cols(0, qc),
        all.cols(qc, kc),
        all.cols(qc + kc, kc),
        ViewMut::new(&mut ob, total, qc + 8).cols(8, qc),
        &segs,
    );
    take(be, &ob, total, qc + 8, 8, qc, "attention")
}

#[test]
#[ignore = "needs a CUDA device"]
fn attention_matches_cpu() {
    let cpu = CpuBackend::new();
    // (segment lengths, q heads, kv heads, head dim, window, causal)
    type Case = (Vec<usize>, usize, usize, usize, Option<usize>, bool);
    let cases: Vec<Case> = vec![
        (vec![17], 4, 2, 256, Some(512), false), // W1 query, sliding layer
        (vec![17], 4, 1, 512, None, false),      // W1 query, full layer
        (vec![1100], 4, 2, 256, Some(512), false), // window narrower than the sequence
        (vec![700, 1, 300], 4, 1, 512, None, false), // MQA, 512-wide heads, ragged tiles
        (vec![256; 6], 4, 2, 256, Some(512), false), // W3-style packed documents
        (vec![5, 70, 3, 130, 64], 4, 2, 16, Some(3), false), // tiny model: window cuts through segments
        (vec![9, 200, 65], 4, 1, 32, None, false),           // tiny model, full layer
        (vec![2394], 12, 12, 64, None, false),               // vision tower, one 280-budget image
        (vec![300, 129], 12, 12, 64, None, false),           // two images packed
        (vec![77, 150], 2, 2, 128, None, true),              // causal (text encoders of DiTs)
        (vec![64, 63, 65], 4, 2, 64, Some(0), false),        // window 0: each token sees itself
    ];
    for p in [Precision::F32, Precision::Bf16] {
        let g = gpu(p);
        for (ci, (lens, hq, hkv, hd, window, causal)) in cases.iter().enumerate() {
            let spec = AttnSpec {
                heads_q: *hq,
                heads_kv: *hkv,
                head_dim: *hd,
                scale: 1.0,
                window: *window,
                causal: *causal,
            };
            let total: usize = lens.iter().sum();
            let mut rng = Rng::new(1000 + ci as u64);
            // Unit-RMS rows like the normed q/k of the models, scaled so logits reach ±10.
            let x = rng.vec(
                total * (hq + 2 * hkv) * hd,
                1.7 * (1.0 / (*hd as f32).sqrt()).sqrt() * 2.0,
            );
            let want = run_attention(&cpu, &x, lens, &spec, |q, k, v, o, segs| {
                cpu.attention(q, k, v, o, &spec, segs).unwrap()
            });
            let name = format!(
                "attention {p} case {ci} {lens:?} {hq}/{hkv}×{hd} w={window:?} causal={causal}"
            );
            let got = run_attention(&g, &x, lens, &spec, |q, k, v, o, segs| {
                g.attention(q, k, v, o, &spec, segs).unwrap()
            });
            compare(&name, &got, &want, tol(p, true));
            if p == Precision::Bf16 {
                // Each kernel this GPU has for the head width (the portable one always; Hopper's
                // wgmma one where it applies), whole and with the split-key path, including
                // chunks that are empty for some tiles.
                let mut kernels = vec![FlashKernel::Mma];
                if attention::wgmma_applies(g.arch(), *hd) {
                    kernels.push(FlashKernel::Wgmma);
                }
                for kernel in kernels {
                    for n in [1, 2, 3, 8] {
                        let choice = FlashChoice {
                            splits: Some(n),
                            kernel: Some(kernel),
                        };
                        let got = run_attention(&g, &x, lens, &spec, |q, k, v, o, segs| {
                            let used = g.attention_with(q, k, v, o, &spec, segs, choice);
                            assert_eq!(used.unwrap(), n, "the split fits the workspace");
                        });
                        compare(
                            &format!("{name} {kernel:?} kv_splits={n}"),
                            &got,
                            &want,
                            tol(p, true),
                        );
                    }
                }
            }
        }
    }
}

fn run_elementwise<B: Backend>(
    be: &B,
    gu: &[f32],
    table: &tessera_core::Weights,
    ids_v: &[u32],
    rows: usize,
    cols: usize,
    lens: &[usize],
) -> Vec<Vec<f32>> {
    let b = padded(be, Role::Compute, rows, 2 * cols, 0, 2 * cols, Some(gu));
    let all = View::new(&b, rows, 2 * cols);
    let mut out = Vec::new();
    for act in [Activation::GeluTanh, Activation::Silu] {
        let mut ob = padded(be, Role::Compute, rows, cols, 0, cols, None);
        be.gated(
            all.cols(0, cols),
            all.cols(cols, cols),
            ViewMut::new(&mut ob, rows, cols),
            act,
        )
        .unwrap();
        out.push(take(be, &ob, rows, cols, 0, cols, "gated"));
    }
    let mut cb = padded(be, Role::Stream, rows, cols + 8, 8, cols, None);
    be.cast(
        all.cols(cols, cols),
        ViewMut::new(&mut cb, rows, cols + 8).cols(8, cols),
    )
    .unwrap();
    out.push(take(be, &cb, rows, cols + 8, 8, cols, "cast"));
    let segs = be.segments(lens).unwrap();
    let mut mb = padded(be, Role::Stream, lens.len(), cols, 0, cols, None);
    be.segment_mean(
        all.cols(0, cols),
        &segs,
        ViewMut::new(&mut mb, lens.len(), cols),
    )
    .unwrap();
    out.push(take(be, &mb, lens.len(), cols, 0, cols, "segment_mean"));
    let t = be.table(table, "emb", [97, cols]).unwrap();
    let ib = ids(be, ids_v);
    let mut eb = padded(be, Role::Stream, ids_v.len(), cols, 0, cols, None);
    be.embed(&t, &ib, 1.5, ViewMut::new(&mut eb, ids_v.len(), cols))
        .unwrap();
    out.push(take(be, &eb, ids_v.len(), cols, 0, cols, "embed"));
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn elementwise_ops_match_cpu() {
    let cpu = CpuBackend::new();
    let (rows, cols) = (301, 200);
    let mut rng = Rng::new(77);
    let gu = rng.vec(rows * 2 * cols, 4.0);
    // An embedding table stored as bf16 in a safetensors file, as the real checkpoint.
    let dir = std::env::temp_dir().join(format!("tessera-cuda-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let table: Vec<u8> = rng
        .vec(97 * cols, 1.0)
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![97, cols], &table)
            .unwrap();
    let path = dir.join("t.safetensors");
    safetensors::serialize_to_file(vec![("emb".to_string(), view)], None, &path).unwrap();
    let weights = tessera_core::Weights::open_file(&path).unwrap();
    let idv: Vec<u32> = (0..50).map(|i| (i * 13 % 97) as u32).collect();
    let lens = [100, 1, 0, 200];
    let want = run_elementwise(&cpu, &gu, &weights, &idv, rows, cols, &lens);
    for p in [Precision::F32, Precision::Bf16] {
        let got = run_elementwise(&gpu(p), &gu, &weights, &idv, rows, cols, &lens);
        for (name, (a, b)) in ["gated gelu", "gated silu", "cast", "segment_mean", "embed"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            compare(&format!("{name} {p}"), a, b, tol(p, false));
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn replayed_graph_gives_the_direct_result() {
    let g = gpu(Precision::Bf16);
    let (m, k, n) = (64, 512, 256);
    let mut rng = Rng::new(5);
    let x = rng.vec(m * k, 1.0);
    let mat = g.matrix(&[(&rng.vec(n * k, 0.05), n)], k).unwrap();
    let mut xb = g.alloc(m * k, Role::Compute).unwrap();
    let mut ob = g.alloc(m * n, Role::Stream).unwrap();
    let mut results = Vec::new();
    for round in 0..4 {
        // New input values each round, same buffers: a replay must see them.
        let xr: Vec<f32> = x.iter().map(|v| v * (round + 1) as f32).collect();
        g.write_f32(&mut xb, &xr).unwrap();
        g.run_graph(42, &mut || {
            g.matmul(
                View::new(&xb, m, k),
                &mat,
                ViewMut::new(&mut ob, m, n),
                Epilogue::default(),
            )
        })
        .unwrap();
        results.push(g.read_f32(View::new(&ob, m, n)).unwrap());
    }
    for r in 1..4 {
        let scaled: Vec<f32> = results[0].iter().map(|v| v * (r + 1) as f32).collect();
        compare(
            &format!("graph round {r}"),
            &results[r],
            &scaled,
            (1e-2, 1e-4),
        );
    }
}

fn run_vision<B: Backend>(
    be: &B,
    table_w: &tessera_core::Weights,
    dims: &[(usize, usize)],
    x: &[f32],
    qkv: &[f32],
    d: usize,
) -> Vec<Vec<f32>> {
    let n: usize = dims.iter().map(|&(w, h)| w * h).sum();
    let axis = 40;
    let table = be.table_nd(table_w, "pos", &[2, axis, d]).unwrap();
    let pos: Vec<u32> = dims
        .iter()
        .flat_map(|&(w, h)| {
            (0..h).flat_map(move |y| (0..w).flat_map(move |xx| [xx as u32, y as u32]))
        })
        .collect();
    let pb = ids(be, &pos);
    let mut out = Vec::new();
    // Learned 2-D positions added to f32 rows.
    let mut xb = padded(be, Role::Stream, n, d, 0, d, Some(x));
    be.add_positions_2d(&table, axis, &pb, ViewMut::new(&mut xb, n, d))
        .unwrap();
    out.push(take(be, &xb, n, d, 0, d, "add_positions_2d"));
    // 3×3 pooling of every image's grid.
    let grids = be.grids(dims, 3).unwrap();
    let pooled = grids.pooled();
    let mut pb2 = padded(be, Role::Stream, pooled, d + 8, 8, d, None);
    be.avg_pool2d(
        View::new(&xb, n, d),
        &grids,
        1.5,
        ViewMut::new(&mut pb2, pooled, d + 8).cols(8, d),
    )
    .unwrap();
    out.push(take(be, &pb2, pooled, d + 8, 8, d, "avg_pool2d"));
    // Scatter the pooled rows into a longer sequence (every other row, reversed).
    let rows_out = 2 * pooled + 3;
    let at: Vec<u32> = (0..pooled).map(|i| (rows_out - 1 - 2 * i) as u32).collect();
    let atb = ids(be, &at);
    let base: Vec<f32> = (0..rows_out * d).map(|i| (i % 7) as f32).collect();
    let mut sb = padded(be, Role::Stream, rows_out, d, 0, d, Some(&base));
    be.scatter_rows(
        View::new(&pb2, pooled, d + 8).cols(8, d),
        &atb,
        ViewMut::new(&mut sb, rows_out, d),
    )
    .unwrap();
    out.push(take(be, &sb, rows_out, d, 0, d, "scatter_rows"));
    // Axial 2-D RoPE (the vision tower's q/k): 3 heads of 16 (the scalar kernel), then 2 heads
    // of 64 as in EmbeddingGemma 2's tower (the 8-lane kernel).
    for (heads, hd) in [(3, 16), (2, 64)] {
        let layout = QkvLayout {
            heads_q: heads,
            heads_kv: heads,
            head_dim: hd,
        };
        let width = layout.width();
        let inv: Vec<f32> = (0..hd / 4)
            .map(|j| 1.0 / 100f32.powf(2.0 * j as f32 / (hd / 2) as f32))
            .collect();
        let rope = RopeTable::new(be, &inv, axis, RopeStyle::Axial2d).unwrap();
        let mut qb = padded(
            be,
            Role::Compute,
            n,
            width,
            0,
            width,
            Some(&qkv[..n * width]),
        );
        let w: Vec<f32> = (0..hd).map(|j| 1.0 + 0.05 * (j % 16) as f32).collect();
        let wv = be.vector(&w).unwrap();
        be.qkv_norm_rope(
            ViewMut::new(&mut qb, n, width),
            layout,
            Some(&wv),
            Some(&wv),
            true,
            1e-6,
            Some((&rope, &pb)),
        )
        .unwrap();
        out.push(take(be, &qb, n, width, 0, width, "axial rope"));
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn vision_ops_match_cpu() {
    let cpu = CpuBackend::new();
    let d = 72;
    let dims = [(6, 3), (9, 12), (3, 3), (24, 15)];
    let n: usize = dims.iter().map(|&(w, h)| w * h).sum();
    let mut rng = Rng::new(99);
    let x = rng.vec(n * d, 2.0);
    let qkv = rng.vec(n * 6 * 64, 2.0);
    // The position table as an f32 safetensors file `[2, 40, d]`.
    let dir = std::env::temp_dir().join(format!("tessera-cuda-vision-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tbl: Vec<u8> = rng
        .vec(2 * 40 * d, 1.0)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 40, d], &tbl)
        .unwrap();
    let path = dir.join("p.safetensors");
    safetensors::serialize_to_file(vec![("pos".to_string(), view)], None, &path).unwrap();
    let weights = tessera_core::Weights::open_file(&path).unwrap();
    let want = run_vision(&cpu, &weights, &dims, &x, &qkv, d);
    for p in [Precision::F32, Precision::Bf16] {
        let got = run_vision(&gpu(p), &weights, &dims, &x, &qkv, d);
        for (name, (a, b)) in [
            "add_positions_2d",
            "avg_pool2d",
            "scatter_rows",
            "axial rope, heads of 16",
            "axial rope, heads of 64",
        ]
        .iter()
        .zip(got.iter().zip(&want))
        {
            // The position table is rounded to bf16 in bf16 mode.
            compare(&format!("{name} {p}"), a, b, tol(p, false));
        }
    }
}
