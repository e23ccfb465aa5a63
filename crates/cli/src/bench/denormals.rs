//! `tessera bench denormals`: keeps the denormal cliff (issue 32) visible. Intel cores take a
//! microcode assist on every float operation with a denormal operand or result; the CPU backend
//! flushes them on every thread that runs its ops and its softmax makes none
//! (`backend/src/cpu/denormals.rs`), so work on denormal-heavy operands should take as long as
//! the same work on normal ones. Two workloads on the f32 CPU backend, each timed in
//! alternation with its normal twin (median of `--iters` pairs, after one warm-up pair):
//!
//! - `product`: EmbeddingGemma 2's q|k|v product over a document (`--rows` × 2,048 × 512) with
//!   every activation ~1e-39, a denormal; the twin's activations are the same times 1e39;
//! - `attention`: one document's attention whose keys score 88–103 below each query's best key,
//!   so that `e^(s − max)` is a denormal (as a long document's far keys are); the twin's score
//!   0–15 below.
//!
//! One JSON line each with the slowdown (denormal median ÷ normal median), which should be
//! about 1; `--max-slowdown` makes the run fail when one exceeds it. Timings, not tests: they
//! run where a benchmark runs, never in `cargo test`.

use std::time::Instant;

use clap::Args;
use tessera_backend::cpu::{CpuBackend, CpuBuf, denormals};
use tessera_backend::{AttnSpec, Backend, Epilogue, Mask, QkvLayout, Role, View, ViewMut};
use tessera_core::{Error, Result};

use super::{emit, load1};
use crate::noise::XorShift;

#[derive(Args)]
pub struct DenormalBench {
    /// Document length: the product's activation rows and the attention's queries and keys.
    #[arg(long, default_value_t = 2208)]
    rows: usize,
    /// Timed pairs (normal, denormal) of each workload; the medians are compared.
    #[arg(long, default_value_t = 7)]
    iters: usize,
    /// Fail (exit status 1) when a workload's slowdown exceeds this: a check that the cliff
    /// has not come back, e.g. --max-slowdown 1.5.
    #[arg(long)]
    max_slowdown: Option<f64>,
}

/// The product's output and inner widths: EmbeddingGemma 2's q|k|v (sliding layers).
const PRODUCT_NK: (usize, usize) = (2048, 512);
/// The attention's heads: EmbeddingGemma 2's sliding layers (4 query heads on 2 of 256).
const ATTENTION: QkvLayout = QkvLayout {
    heads_q: 4,
    heads_kv: 2,
    head_dim: 256,
};

pub fn run(b: DenormalBench) -> Result<()> {
    if b.rows < 2 || b.iters == 0 {
        return Err(Error::input(format!(
            "--rows {} --iters {}: at least 2 rows and 1 run are needed",
            b.rows, b.iters
        )));
    }
    let be = CpuBackend::new();
    let threads = rayon::current_num_threads();
    let workloads = [
        (
            "product",
            format!("{}x{}x{}", b.rows, PRODUCT_NK.0, PRODUCT_NK.1),
            product(&be, b.rows, b.iters)?,
        ),
        (
            "attention",
            format!(
                "{} tokens, {}/{} heads of {}",
                b.rows, ATTENTION.heads_q, ATTENTION.heads_kv, ATTENTION.head_dim
            ),
            attention(&be, b.rows, b.iters)?,
        ),
    ];
    let mut over = Vec::new();
    for (name, shape, (normal, denormal)) in workloads {
        let slowdown = denormal / normal;
        emit(
            serde_json::json!({"name": "cpu_denormal_slowdown", "workload": name,
            "shape": shape, "normal_ms": normal, "denormal_ms": denormal, "slowdown": slowdown,
            "iters": b.iters, "threads": threads, "flushing": denormals::flushing(),
            "load1": load1()}),
        )?;
        if let Some(max) = b.max_slowdown
            && slowdown > max
        {
            over.push(format!("{name} {slowdown:.2}×"));
        }
    }
    if over.is_empty() {
        return Ok(());
    }
    Err(Error::backend(
        "bench denormals",
        format!(
            "work on denormal operands is slower than on normal ones beyond --max-slowdown {}: {} \
             (are denormals still flushed on every thread? see backend/src/cpu/denormals.rs)",
            b.max_slowdown.unwrap_or_default(),
            over.join(", ")
        ),
    ))
}

/// Median milliseconds of `run(false)` (normal operands) and `run(true)` (denormal ones), run in
/// alternation so that a change in the machine's load falls on both.
fn alternate(iters: usize, mut run: impl FnMut(bool) -> Result<()>) -> Result<(f64, f64)> {
    let mut ms = |denormal: bool| -> Result<f64> {
        let t = Instant::now();
        run(denormal)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    ms(false)?;
    ms(true)?;
    let (mut normal, mut denormal) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for _ in 0..iters {
        normal.push(ms(false)?);
        denormal.push(ms(true)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(normal), median(denormal)))
}

/// Uniform in `[lo, hi)`.
fn uniform(rng: &mut XorShift, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * rng.next_unit()
}

fn buffer(be: &CpuBackend, values: &[f32]) -> Result<CpuBuf> {
    let mut b = be.alloc(values.len(), Role::Compute)?;
    be.write_f32(&mut b, values)?;
    Ok(b)
}

/// The q|k|v product on activations in `±1e-39` (denormals) and in `±1`.
fn product(be: &CpuBackend, m: usize, iters: usize) -> Result<(f64, f64)> {
    let (n, k) = PRODUCT_NK;
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    let w: Vec<f32> = (0..n * k).map(|_| uniform(&mut rng, -1.0, 1.0)).collect();
    let w = be.matrix_f32(&[(&w, n)], k)?;
    let x: Vec<f32> = (0..m * k).map(|_| uniform(&mut rng, -1.0, 1.0)).collect();
    let tiny: Vec<f32> = x.iter().map(|v| v * 1e-39).collect();
    let (x, tiny) = (buffer(be, &x)?, buffer(be, &tiny)?);
    let mut out = be.alloc(m * n, Role::Compute)?;
    alternate(iters, |denormal| {
        be.matmul(
            View::new(if denormal { &tiny } else { &x }, m, k),
            &w,
            ViewMut::new(&mut out, m, n),
            &Epilogue::default(),
        )
    })
}

/// Self-attention over `rows` tokens where each query's best key scores 0 and the others score
/// in `[-103, -88)` (their `e^(s − max)` denormals) or in `[-15, 0)`.
fn attention(be: &CpuBackend, rows: usize, iters: usize) -> Result<(f64, f64)> {
    let QkvLayout {
        heads_q,
        heads_kv,
        head_dim,
    } = ATTENTION;
    let mut rng = XorShift::new(0x2545_F491_4F6C_DD1D);
    // Every query head is (1, 0, …, 0), so a score is its key's first element.
    let mut q = vec![0f32; rows * heads_q * head_dim];
    for head in q.chunks_mut(head_dim) {
        head[0] = 1.0;
    }
    let mut keys = |lo: f32, hi: f32| -> Result<CpuBuf> {
        let mut k: Vec<f32> = (0..rows * heads_kv * head_dim)
            .map(|_| uniform(&mut rng, -1.0, 1.0))
            .collect();
        for (j, head) in k.chunks_mut(head_dim).enumerate() {
            head[0] = if j / heads_kv == 0 {
                0.0
            } else {
                uniform(&mut rng, lo, hi)
            };
        }
        buffer(be, &k)
    };
    let (near, far) = (keys(-15.0, 0.0)?, keys(-103.0, -88.0)?);
    let v: Vec<f32> = (0..rows * heads_kv * head_dim)
        .map(|_| uniform(&mut rng, -1.0, 1.0))
        .collect();
    let (q, v) = (buffer(be, &q)?, buffer(be, &v)?);
    let mut out = be.alloc(rows * heads_q * head_dim, Role::Compute)?;
    let segs = be.segments(&[rows])?;
    let spec = AttnSpec::new(ATTENTION, 1.0, Mask::Full);
    let (qw, kw) = (heads_q * head_dim, heads_kv * head_dim);
    alternate(iters, |denormal| {
        be.attention(
            View::new(&q, rows, qw),
            View::new(if denormal { &far } else { &near }, rows, kw),
            View::new(&v, rows, kw),
            ViewMut::new(&mut out, rows, qw),
            &spec,
            &segs,
        )
    })
}
