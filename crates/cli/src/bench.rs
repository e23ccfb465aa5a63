//! `tessera bench`: the measurements behind BENCHMARKS.md.
//!
//! `bench embed` runs the EmbeddingGemma 2 workloads on a model folder, on either device:
//! W1 one short query end to end (tokenize → vector), W2 one long document, `batch` N documents
//! of L tokens (`--batch NxL`, random ids framed by `<bos>`/`<eos>`, as the reference script
//! does), W3 8,192 documents of 256 tokens in the engine's best batching, with model FLOPs and
//! utilisation against a ceiling you pass (`--ceiling-tflops`, measured in the same run by
//! `bench gemm` or torch). Every timing reports its first run (a fresh process's first pass), the
//! median, best and worst of `--iters` runs, and the 1-minute load average when it ends.
//! `bench gemm` measures the cuBLASLt bf16 GEMM rate on random data, then the models' own
//! products, LFM2's decoding ones among them (weight TB/s, to set beside the HBM bandwidth;
//! `TESSERA_GEMV=0` times them on cuBLASLt instead of the GEMV kernel). `bench conv` times the
//! VAE decoders' convolutions at a 1024² output on the implicit-GEMM kernel and on im2col. `bench qwen-image-parts`
//! times Qwen-Image-2.1's components one at a time. `bench denormals` checks that the CPU's work
//! on denormal operands is as fast as on normal ones (`bench/denormals.rs`). `bench serve` load-tests
//! `tessera serve` (see `loadtest.rs`). One JSON line per measurement on stdout.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};
use serde::Deserialize;
use tessera_core::{Error, Result};
use tessera_models::egemma2::{self, Input, TextOptions};
use tessera_models::imageproc::{Image, ImageBudget};
use tessera_runtime::embed::{self, Embed, PassBudget};

use crate::device::DeviceArgs;
use crate::noise::XorShift;
use crate::stdout::outln;

mod chat;
mod denormals;
mod generate;
mod qwen_image_parts;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// EmbeddingGemma 2 workloads W1–W3.
    Embed(EmbedBench),
    /// cuBLASLt bf16 GEMM rate on random data (the ceiling for utilisation figures).
    Gemm(GemmBench),
    /// The CPU's peak: FMA and bf16 dot-product loops on every thread, and the f32 and bf16
    /// matrix products at --size and at EmbeddingGemma 2's shapes.
    Peak(PeakBench),
    /// The denormal cliff: the CPU's product and attention on denormal-heavy operands, each
    /// timed against the same work on normal ones (a slowdown near 1 means none).
    ///
    /// As a check, failing when the cliff is back:
    /// tessera bench denormals --max-slowdown 1.5
    Denormals(denormals::DenormalBench),
    /// The CPU's products on quantized weights (Q8_0, Q4_0, Q4_K, Q6_K; exact and with int8
    /// activations) beside the f32 product, on a --size² matrix for each of --rows.
    Quant(QuantBench),
    /// The attention op alone on the EmbeddingGemma 2 shapes.
    Attention(AttentionBench),
    /// The VAE decoders' convolutions at a 1024² output (Z-Image's and Qwen-Image-2.1's), each
    /// on the implicit-GEMM kernel and on im2col + cuBLASLt (bf16, CUDA only).
    Conv(ConvBench),
    /// EmbeddingGemma 2 image embeddings: one image's latency and mixed-size throughput.
    Image(ImageBench),
    /// Text to image, or an edit of condition images (--image), end to end (prompt → PNG bytes)
    /// and by stage on one loaded model.
    ///
    /// On a GPU machine with a full-size folder:
    /// tessera bench generate --model DIR --device cuda --size 1024x1024 --steps 8
    /// tessera bench generate --model DIR --device cuda --precision bf16 --image COND.png
    Generate(generate::GenerateBench),
    /// Qwen-Image-2.1 by component: the text encoder, the DiT's prefill and a cached step over
    /// prefixes of several lengths, and the VAE decoder (synthetic inputs, median of --iters).
    ///
    /// On a GPU machine with a full-size folder:
    /// tessera bench qwen-image-parts --model DIR --device cuda --precision bf16
    QwenImageParts(qwen_image_parts::QwenImagePartsBench),
    /// LFM2-VL: an image's prompt, text prefill and decoding at batch sizes (continuous batching).
    ///
    /// On a GPU machine with a full-size folder:
    /// tessera bench chat --model DIR --device cuda --batch 1,8 --new-tokens 128
    Chat(chat::ChatBench),
    /// Load-test `tessera serve` on loopback: texts/s at 1 and N clients, short-query latency
    /// while images are in flight, and a queue-overflowing burst (429s, bounded memory).
    ///
    /// On a GPU machine with a full-size model:
    /// tessera bench serve --model DIR --device cuda --requests 2000 --clients 1,16 --image-clients 4
    Serve(Box<crate::loadtest::LoadTest>),
    /// Load-test `tessera serve` generating images beside an embedding model: images/s per size
    /// and client count, the latency of embedding requests idle and while generations run, and
    /// a queue-overflowing burst (only 200s and 429s, bounded memory).
    ///
    /// On a GPU machine with full-size models (run twice, the second time with
    /// --server-args --no-image-batching, to compare batching):
    /// tessera bench serve-images --image-model DIR --embed-model DIR --device cuda
    ServeImages(Box<crate::loadtest_images::ImageLoadTest>),
}

#[derive(Args)]
struct AttentionBench {
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct ConvBench {
    /// Timed runs per shape and path (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct ImageBench {
    /// Model folder (a full-size checkpoint for meaningful numbers).
    #[arg(long)]
    model: PathBuf,
    /// The single image timed end to end (decode → vector).
    #[arg(long)]
    image: PathBuf,
    /// Soft-token budget.
    #[arg(long, default_value_t = 280)]
    budget: usize,
    /// Images in the throughput run (random pixels, sizes cycling through a fixed list); 0 times
    /// the single image only.
    #[arg(long, default_value_t = 256)]
    images: usize,
    /// Patch budgets per pass to try for throughput; the best is reported.
    #[arg(long, default_value = "16384,32768,65536")]
    pass_patches: String,
    #[command(flatten)]
    timing: Timing,
    #[command(flatten)]
    device: DeviceArgs,
}

/// How many runs a timing takes; each workload has its own default.
#[derive(Args)]
struct Timing {
    /// Timed runs of each workload (default: 200 for W1, 30 for W2 and the single image, 3 for
    /// batches).
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed runs before them (default: a tenth of the timed runs, at least one).
    #[arg(long)]
    warmup: Option<usize>,
}

impl Timing {
    /// Time `f` with the runs asked for, `iters` when none were.
    fn run(&self, iters: usize, f: impl FnMut() -> Result<()>) -> Result<Times> {
        let n = self.iters.unwrap_or(iters).max(1);
        time_ms(n, self.warmup.unwrap_or((n / 10).max(1)), f)
    }
}

fn parse_batch(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("{s:?}: expected DOCSxTOKENS, e.g. 64x64");
    let (n, l) = s.split_once('x').ok_or_else(bad)?;
    match (n.parse(), l.parse()) {
        (Ok(n), Ok(l)) if n > 0 && l >= 2 => Ok((n, l)),
        _ => Err(bad()),
    }
}

/// Sizes of the mixed-size throughput run: photos, screenshots, a page scan, thumbnails.
pub const MIXED_SIZES: [(usize, usize); 8] = [
    (641, 479),
    (1024, 768),
    (512, 512),
    (800, 600),
    (1280, 720),
    (300, 400),
    (1920, 1080),
    (96, 64),
];

#[derive(Args)]
struct EmbedBench {
    /// Model folder (a full-size checkpoint for meaningful numbers).
    #[arg(long)]
    model: PathBuf,
    /// bench_inputs.json with "short" and "long" texts (from make_eg2_full.py).
    #[arg(long)]
    inputs: PathBuf,
    /// Which workloads, comma-separated: w1, w2, batch, w3.
    #[arg(long, default_value = "w1,w2,w3")]
    workloads: String,
    /// Documents × tokens of the `batch` workload.
    #[arg(long, default_value = "64x64", value_parser = parse_batch)]
    batch: (usize, usize),
    #[command(flatten)]
    timing: Timing,
    /// Documents in W3.
    #[arg(long, default_value_t = 8192)]
    w3_docs: usize,
    /// Pass sizes (tokens) to try for W3; the best is reported.
    #[arg(long, default_value = "16384,32768,65536")]
    w3_pass_tokens: String,
    /// The bf16 GEMM ceiling measured in the same run, for the utilisation figure.
    #[arg(long)]
    ceiling_tflops: Option<f64>,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct GemmBench {
    /// M = N = K of the square product timed.
    #[arg(long, default_value_t = 8192)]
    size: usize,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct PeakBench {
    /// Side of the square f32 product timed on the CPU backend.
    #[arg(long, default_value_t = 2048)]
    size: usize,
}

#[derive(Args)]
struct QuantBench {
    /// Side of the square weight matrix.
    #[arg(long, default_value_t = 2048)]
    size: usize,
    /// Activation rows of each product, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    rows: Vec<usize>,
}

#[derive(Deserialize)]
struct Inputs {
    short: String,
    long: String,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        What::Embed(b) => embed(b),
        What::Gemm(b) => gemm(b),
        What::Peak(b) => peak(b),
        What::Denormals(b) => denormals::run(b),
        What::Quant(b) => quant(b),
        What::Attention(b) => attention(b),
        What::Conv(b) => conv(b),
        What::Image(b) => image(b),
        What::Generate(b) => generate::run(b),
        What::QwenImageParts(b) => qwen_image_parts::run(b),
        What::Chat(b) => chat::run(b),
        What::Serve(b) => crate::loadtest::run(*b),
        What::ServeImages(b) => crate::loadtest_images::run(*b),
    }
}

/// Milliseconds of the runs of one timing.
struct Times {
    /// The very first run, warm-up included: what a fresh process pays.
    first: f64,
    /// The timed runs, sorted.
    runs: Vec<f64>,
}

impl Times {
    fn median(&self) -> f64 {
        self.runs[self.runs.len() / 2]
    }

    /// The figures every timing reports, with the machine's load when it ended.
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"median_ms": self.median(), "best_ms": self.runs[0],
            "worst_ms": self.runs[self.runs.len() - 1], "first_ms": self.first,
            "iters": self.runs.len(), "load1": load1()})
    }
}

/// The 1-minute load average (Linux), to show whether anything else ran.
fn load1() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn time_ms(n: usize, warm: usize, mut f: impl FnMut() -> Result<()>) -> Result<Times> {
    let mut once = || -> Result<f64> {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let first = once()?;
    for _ in 1..warm {
        once()?;
    }
    let mut runs = (0..n).map(|_| once()).collect::<Result<Vec<_>>>()?;
    runs.sort_by(f64::total_cmp);
    Ok(Times { first, runs })
}

/// `json` with the fields of `extra` added.
fn with(mut json: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(a), serde_json::Value::Object(b)) = (json.as_object_mut(), extra) {
        a.extend(b);
    }
    json
}

/// The embedding model in `dir` on the device `device` asks for (declined there if it cannot run
/// the model's ops).
fn load_embedder(
    dir: &std::path::Path,
    device: &DeviceArgs,
) -> Result<(Box<dyn Embed>, egemma2::Config)> {
    let path = dir
        .to_str()
        .ok_or_else(|| Error::input(format!("{}: not a UTF-8 path", dir.display())))?;
    let spec = crate::model::open(Some(path), tessera_runtime::Capability::Embed)?;
    let (files, config) = crate::model::embedding_model(&spec)?;
    let config = config.clone();
    Ok((embed::load(device.open_for(&spec)?, files)?, config))
}

/// `n` documents of `len` random ids in `[3, min(vocab, 250000))`, `<bos>` first and `<eos>`
/// last, as the reference script makes them.
fn random_docs(config: &egemma2::Config, n: usize, len: usize) -> Vec<Vec<u32>> {
    let vocab = config.text.vocab_size as u64;
    let (bos, eos) = (
        config.text.bos_token_id.unwrap_or(2),
        config.text.eos_token_id.unwrap_or(1),
    );
    let mut rng = XorShift::new(0x2545_F491_4F6C_DD1D);
    let mut next = || (3 + rng.next_u64() % (vocab.min(250_000) - 3)) as u32;
    (0..n)
        .map(|_| {
            let mut d: Vec<u32> = (0..len).map(|_| next()).collect();
            d[0] = bos;
            d[len - 1] = eos;
            d
        })
        .collect()
}

fn emit(v: serde_json::Value) -> Result<()> {
    outln!("{v}")
}

fn embed(b: EmbedBench) -> Result<()> {
    let inputs: Inputs = tessera_core::config::read_json(&b.inputs)?;
    let (mut model, config) = load_embedder(&b.model, &b.device)?;
    let device = model.describe();
    let opts = TextOptions::default();
    let wanted: Vec<&str> = b.workloads.split(',').map(str::trim).collect();
    if wanted.contains(&"w1") {
        let tokens = model.tokenize(&inputs.short, &opts)?.len();
        let t = b.timing.run(200, || {
            model
                .embed_texts(&[inputs.short.as_str()], &opts, None, &mut |_| {})
                .map(|_| ())
        })?;
        emit(with(
            t.json(),
            serde_json::json!({"name": "eg2_W1_query", "tokens": tokens, "device": device}),
        ))?;
    }
    if wanted.contains(&"w2") {
        let tokens = model.tokenize(&inputs.long, &opts)?.len();
        let t = b.timing.run(30, || {
            model
                .embed_texts(&[inputs.long.as_str()], &opts, None, &mut |_| {})
                .map(|_| ())
        })?;
        let flops = config.text.forward_flops(&[tokens]);
        emit(with(
            t.json(),
            serde_json::json!({"name": "eg2_W2_doc", "tokens": tokens,
            "tflops": flops / t.median() / 1e9, "device": device}),
        ))?;
    }
    let random_docs = |n: usize, len: usize| random_docs(&config, n, len);
    if wanted.contains(&"batch") {
        let (n, len) = b.batch;
        let docs = random_docs(n, len);
        let flops = config.text.forward_flops(&vec![len; n]);
        let t = b
            .timing
            .run(3, || model.embed_ids(&docs, &mut |_| {}).map(|_| ()))?;
        emit(with(
            t.json(),
            serde_json::json!({"name": "eg2_batch", "docs": n, "tokens_per_doc": len,
            "tflops": flops / t.median() / 1e9, "device": device}),
        ))?;
    }
    if wanted.contains(&"w3") {
        let docs = random_docs(b.w3_docs, 256);
        let lens = vec![256usize; docs.len()];
        let flops = config.text.forward_flops(&lens);
        let mut best: Option<(f64, usize)> = None;
        for pass in b.w3_pass_tokens.split(',') {
            let pass: usize = pass
                .trim()
                .parse()
                .map_err(|_| Error::input(format!("bad pass size {pass:?}")))?;
            model.set_pass_budget(PassBudget {
                tokens: pass,
                ..model.pass_budget()
            });
            let t = b
                .timing
                .run(3, || model.embed_ids(&docs, &mut |_| {}).map(|_| ()))?;
            let med = t.median();
            let docs_per_s = docs.len() as f64 / (med / 1e3);
            emit(
                serde_json::json!({"name": "eg2_W3_docs256", "pass_tokens": pass, "docs": docs.len(), "seconds": med / 1e3,
                "docs_per_s": docs_per_s, "tokens_per_s": docs_per_s * 256.0, "tflops": flops / med / 1e9, "device": device}),
            )?;
            if best.is_none_or(|(r, _)| docs_per_s > r) {
                best = Some((docs_per_s, pass));
            }
        }
        if let Some((rate, pass)) = best {
            let tflops = flops / (docs.len() as f64 / rate) / 1e12;
            emit(
                serde_json::json!({"name": "eg2_W3_best", "pass_tokens": pass, "docs_per_s": rate, "tflops": tflops,
                "mfu": b.ceiling_tflops.map(|c| tflops / c), "ceiling_tflops": b.ceiling_tflops, "device": device}),
            )?;
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn gemm(b: GemmBench) -> Result<()> {
    match b.device.open()? {
        tessera_backend::AnyBackend::Cuda(be) => {
            let tflops = be.bench_gemm(b.size, 20)?;
            emit(
                serde_json::json!({"name": "cublaslt_bf16_gemm", "size": b.size, "tflops": tflops, "device": be.describe_device()}),
            )?;
            // The models' own products: a 17-token query's (weight-bandwidth bound), one
            // 2,394-patch image's vision-tower products (too few output tiles to fill the GPU)
            // and LFM2's decoding steps (weight-bandwidth bound, on the GEMV kernel).
            for (what, (m, n, k)) in MODEL_GEMMS.into_iter().chain(DECODE_GEMMS) {
                let ms = be.bench_gemm_shape((m, n, k), 50, 20)?;
                let weight_bytes = 2.0 * (n * k) as f64;
                emit(
                    serde_json::json!({"name": "gemm_shape", "what": what, "m": m, "n": n, "k": k,
                    "us": ms * 1e3, "tflops": 2.0 * (m * n * k) as f64 / (ms / 1e3) / 1e12,
                    "weight_tb_s": weight_bytes / (ms / 1e3) / 1e12}),
                )?;
            }
            Ok(())
        }
        tessera_backend::AnyBackend::Cpu(_) => Err(Error::input(
            "bench gemm measures the CUDA GEMM ceiling: use --device cuda",
        )),
    }
}

/// `(what, (m, n, k))` of EmbeddingGemma 2's products timed by `bench gemm`.
#[cfg(feature = "cuda")]
const MODEL_GEMMS: [(&str, (usize, usize, usize)); 10] = [
    ("W1 q|k|v sliding", (17, 2048, 512)),
    ("W1 o sliding", (17, 512, 1024)),
    ("W1 gate|up", (17, 4096, 512)),
    ("W1 down", (17, 512, 2048)),
    ("W1 PLE gate", (17, 512, 512)),
    ("W1 PLE projection (all layers)", (17, 12288, 512)),
    ("image q|k|v", (2394, 2304, 768)),
    ("image o", (2394, 768, 768)),
    ("image gate|up", (2394, 6144, 768)),
    ("image down", (2394, 768, 3072)),
];

/// `(what, (m, n, k))` of LFM2-350M's (LFM2-VL-450M's language model) decoding products, for one
/// and for eight streams, timed by `bench gemm`.
#[cfg(feature = "cuda")]
const DECODE_GEMMS: [(&str, (usize, usize, usize)); 12] = [
    ("LFM2 decode 1: conv in_proj", (1, 3072, 1024)),
    ("LFM2 decode 1: conv out_proj", (1, 1024, 1024)),
    ("LFM2 decode 1: q|k|v", (1, 2048, 1024)),
    ("LFM2 decode 1: gate|up", (1, 9216, 1024)),
    ("LFM2 decode 1: down", (1, 1024, 4608)),
    ("LFM2 decode 1: lm head", (1, 65536, 1024)),
    ("LFM2 decode 8: conv in_proj", (8, 3072, 1024)),
    ("LFM2 decode 8: conv out_proj", (8, 1024, 1024)),
    ("LFM2 decode 8: q|k|v", (8, 2048, 1024)),
    ("LFM2 decode 8: gate|up", (8, 9216, 1024)),
    ("LFM2 decode 8: down", (8, 1024, 4608)),
    ("LFM2 decode 16: lm head", (16, 65536, 1024)),
];

/// The CPU's FMA and bf16 dot-product peaks over all threads, and the backend's f32 and bf16
/// products at `size`³ and at EmbeddingGemma 2's shapes (random data, median of 5): the
/// ceilings the CPU workloads are judged against.
fn peak(b: PeakBench) -> Result<()> {
    use tessera_backend::Precision;
    use tessera_backend::cpu::{CpuBackend, bf16, peak};
    let threads = rayon::current_num_threads();
    // About a second on two cores at 200 GFLOP/s.
    match peak::fma_flops(50_000_000 / threads.max(1)) {
        Some((flops, isa)) => emit(serde_json::json!({"name": "cpu_fma_peak", "isa": isa,
            "threads": threads, "gflops": flops / 1e9, "load1": load1()}))?,
        None => emit(serde_json::json!({"name": "cpu_fma_peak", "isa": null,
            "note": "no AVX-512F or AVX2+FMA on this CPU"}))?,
    }
    match peak::bf16_dot_flops(50_000_000 / threads.max(1)) {
        Some(flops) => emit(
            serde_json::json!({"name": "cpu_bf16_dot_peak", "isa": "AVX512_BF16",
            "threads": threads, "gflops": flops / 1e9, "load1": load1()}),
        )?,
        None => emit(serde_json::json!({"name": "cpu_bf16_dot_peak", "isa": null,
            "note": "no AVX512_BF16 on this CPU"}))?,
    }
    let square = ("square", (b.size, b.size, b.size));
    for precision in [Precision::F32, Precision::Bf16] {
        if precision == Precision::Bf16 && !bf16::native() {
            continue;
        }
        let be = CpuBackend::with_precision(precision);
        for &(what, shape) in std::iter::once(&square).chain(&CPU_GEMMS) {
            let gflops = product_rate(&be, shape, 1.0)?;
            let (m, n, k) = shape;
            emit(
                serde_json::json!({"name": "cpu_product", "precision": precision.to_string(),
                "what": what, "m": m, "n": n, "k": k, "threads": threads, "gflops": gflops}),
            )?;
        }
    }
    // The denormal cliff (issue 32): the same product with every activation a denormal
    // (~1e-40), as the far keys' probabilities of a long document's attention are. Intel cores
    // assist on each such operand unless denormals are flushed (`cpu/denormals.rs`); a ratio
    // well above 1 means the cliff is back.
    let be = CpuBackend::new();
    let shape = CPU_GEMMS[2].1;
    let normal = product_rate(&be, shape, 1.0)?;
    let denormal = product_rate(&be, shape, 1e-39)?;
    emit(
        serde_json::json!({"name": "cpu_denormal_ratio", "what": CPU_GEMMS[2].0,
        "gflops_normal": normal, "gflops_denormal": denormal,
        "slowdown": normal / denormal, "threads": threads}),
    )?;
    Ok(())
}

/// The CPU's products on quantized weights beside the f32 product at the same shapes (random
/// weights quantized at load, median of 5 or more): GFLOP/s counted as 2·m·n·k. First, how
/// fast `--quantize` makes each format of a random --size² matrix at load, on one thread and
/// on all.
fn quant(b: QuantBench) -> Result<()> {
    use tessera_backend::Backend;
    use tessera_backend::Quantization;
    use tessera_backend::cpu::{CpuBackend, int8};
    use tessera_core::DType;
    let threads = rayon::current_num_threads();
    let n = b.size;
    let mut rng = XorShift::new(0x2545_F491_4F6C_DD1D);
    let w: Vec<f32> = (0..n * n).map(|_| (rng.next_unit() - 0.5) * 0.05).collect();
    // Made once: only the backend's reading and quantizing of the rows is timed, as at load.
    let w = tessera_core::Tensor::from_f32("random matrix", vec![n, n], &w)?;
    for pool_threads in [1, threads] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(pool_threads)
            .build()
            .map_err(|e| {
                Error::backend("bench", format!("a pool of {pool_threads} threads: {e}"))
            })?;
        for q in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K] {
            let be = CpuBackend::new().quantizing(Quantization {
                at_load: Some(q),
                stored: None,
                int8: false,
            });
            let t =
                pool.install(|| time_ms(5, 1, || be.matrix(std::slice::from_ref(&w)).map(drop)))?;
            emit(with(
                serde_json::json!({"name": "cpu_quantize_at_load", "weights": q.to_string(),
                "n": n, "k": n, "threads": pool_threads,
                "mweights_per_s": (n * n) as f64 / t.median() / 1e3}),
                t.json(),
            ))?;
        }
    }
    for &m in &b.rows {
        let shape = (m, n, n);
        let f32_rate = product_rate(&CpuBackend::new(), shape, 1.0)?;
        emit(
            serde_json::json!({"name": "cpu_quant_product", "weights": "F32", "mode": "f32",
            "m": m, "n": n, "k": n, "threads": threads, "gflops": f32_rate, "vs_f32": 1.0}),
        )?;
        for q in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K] {
            for int8_mode in [false, true] {
                if int8_mode && !int8::supports(q) {
                    continue;
                }
                let be = CpuBackend::new().quantizing(Quantization {
                    at_load: Some(q),
                    stored: None,
                    int8: int8_mode,
                });
                let gflops = product_rate(&be, shape, 1.0)?;
                let mode = if int8_mode {
                    format!("int8 ({})", int8::kernel().name())
                } else {
                    "exact".to_string()
                };
                emit(
                    serde_json::json!({"name": "cpu_quant_product", "weights": q.to_string(),
                    "mode": mode, "m": m, "n": n, "k": n, "threads": threads, "gflops": gflops,
                    "vs_f32": gflops / f32_rate}),
                )?;
            }
        }
    }
    Ok(())
}

/// `(what, (m, n, k))` of EmbeddingGemma 2's CPU workloads timed by `bench peak`.
const CPU_GEMMS: [(&str, (usize, usize, usize)); 6] = [
    ("W1 q|k|v sliding", (17, 2048, 512)),
    ("W1 gate|up", (17, 4096, 512)),
    ("W2 q|k|v", (2208, 2048, 512)),
    ("W2 gate|up", (2208, 4096, 512)),
    ("W2 down", (2208, 512, 2048)),
    ("image gate|up", (2394, 6144, 768)),
];

/// GFLOP/s of the backend's product `(m × k) · (n × k)ᵀ` on random data, the activations
/// times `scale`; median of 5.
fn product_rate(
    be: &tessera_backend::cpu::CpuBackend,
    (m, n, k): (usize, usize, usize),
    scale: f32,
) -> Result<f64> {
    use tessera_backend::{Backend, Epilogue, Role, View, ViewMut};
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    let mut random = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.next_unit() - 0.5).collect() };
    let w = be.matrix_f32(&[(&random(n * k), n)], k)?;
    let mut x = be.alloc(m * k, Role::Compute)?;
    let activations: Vec<f32> = random(m * k).into_iter().map(|v| v * scale).collect();
    be.write_f32(&mut x, &activations)?;
    let mut out = be.alloc(m * n, Role::Compute)?;
    let iters = if m * n * k < 1 << 26 { 50 } else { 5 };
    let t = time_ms(iters, 2, || {
        be.matmul(
            View::new(&x, m, k),
            &w,
            ViewMut::new(&mut out, m, n),
            &Epilogue::default(),
        )
    })?;
    Ok(2.0 * (m * n * k) as f64 / t.median() / 1e6)
}

#[cfg(not(feature = "cuda"))]
fn gemm(_b: GemmBench) -> Result<()> {
    Err(Error::input("this build has no CUDA support"))
}

fn image(b: ImageBench) -> Result<()> {
    let budget: ImageBudget = b.budget.to_string().parse()?;
    let (mut model, _) = load_embedder(&b.model, &b.device)?;
    let device = model.describe();
    let opts = TextOptions::default();
    // One image, end to end in process: read and decode the file, resize, patchify, embed.
    let t = b.timing.run(50, || {
        let img = Image::open(&b.image)?;
        model
            .embed_inputs(&[Input::image(img)], &opts, budget, None, &mut |_| {})
            .map(|_| ())
    })?;
    let tokens = model
        .input_ids(&Input::image(Image::open(&b.image)?), &opts, budget)?
        .len();
    emit(with(
        t.json(),
        serde_json::json!({"name": "eg2_image_single", "file": b.image.display().to_string(),
        "budget": b.budget, "tokens": tokens, "device": device}),
    ))?;
    if b.images == 0 {
        return Ok(());
    }
    // Throughput: decoded images of mixed sizes (preprocessing included in the time).
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    let images: Vec<Image> = (0..b.images)
        .map(|i| {
            let (w, h) = MIXED_SIZES[i % MIXED_SIZES.len()];
            let rgb: Vec<u8> = (0..w * h * 3)
                .map(|_| (rng.next_u64() >> 56) as u8)
                .collect();
            Image::from_rgb8(w, h, rgb)
        })
        .collect::<Result<_>>()?;
    // Decoded images are what a caller hands over: built once, outside the timed region.
    let inputs: Vec<Input> = images.into_iter().map(Input::image).collect();
    let mut best: Option<(f64, usize)> = None;
    for pass in b.pass_patches.split(',') {
        let pass: usize = pass
            .trim()
            .parse()
            .map_err(|_| Error::input(format!("bad pass size {pass:?}")))?;
        model.set_pass_budget(PassBudget {
            patches: pass,
            ..model.pass_budget()
        });
        let t = b.timing.run(3, || {
            model
                .embed_inputs(&inputs, &opts, budget, None, &mut |_| {})
                .map(|_| ())
        })?;
        let rate = inputs.len() as f64 / (t.median() / 1e3);
        emit(
            serde_json::json!({"name": "eg2_images_mixed", "images": inputs.len(), "pass_patches": pass, "images_per_s": rate, "device": device}),
        )?;
        if best.is_none_or(|(r, _)| rate > r) {
            best = Some((rate, pass));
        }
    }
    // The host's share: resizing and patching every image alone, on all cores, as the
    // throughput runs do it (no device work).
    let spec = model
        .patch_spec()
        .ok_or_else(|| Error::input("this model has no vision tower"))?;
    let t = b.timing.run(3, || {
        use rayon::prelude::*;
        inputs
            .par_iter()
            .flat_map_iter(|i| i.images())
            .try_for_each(|img| {
                tessera_models::imageproc::preprocess(img, spec, budget).map(|_| ())
            })
    })?;
    emit(
        serde_json::json!({"name": "eg2_images_preprocess_only", "images": inputs.len(),
        "images_per_s": inputs.len() as f64 / (t.median() / 1e3), "device": "host"}),
    )?;
    if let Some((rate, pass)) = best {
        emit(
            serde_json::json!({"name": "eg2_images_mixed_best", "images": inputs.len(), "pass_patches": pass, "images_per_s": rate, "device": device}),
        )?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn attention(b: AttentionBench) -> Result<()> {
    use tessera_backend::cuda::{self, CudaBackend, FlashChoice, FlashKernel};
    use tessera_backend::{AttnSpec, Backend, Mask, QkvLayout, Role};
    let tessera_backend::AnyBackend::Cuda(be) = b.device.open()? else {
        return Err(Error::input(
            "bench attention times the CUDA kernels: use --device cuda",
        ));
    };
    let spec = |heads_q, heads_kv, head_dim, window: Option<usize>| {
        let layout = QkvLayout {
            heads_q,
            heads_kv,
            head_dim,
        };
        AttnSpec::new(layout, 1.0, window.map_or(Mask::Full, Mask::Window))
    };
    let w3 = vec![256usize; 256];
    // The Qwen-Image edit's prefix at 1024² with one 1024² condition image: causal text, the
    // image's 4,096 latents as one block (each sees the whole block), causal text again.
    let edit = [(40, false), (4096, true), (30, false)];
    let mut limits = Vec::new();
    for (len, block) in edit {
        let start = limits.len() as u32;
        limits.extend((1..=len as u32).map(|i| if block { start + len as u32 } else { start + i }));
    }
    let edit_len = limits.len();
    let mut limit_buf = be.alloc(edit_len, Role::Index)?;
    be.write_u32(&mut limit_buf, &limits)?;
    let edit_spec = AttnSpec::new(
        QkvLayout {
            heads_q: 24,
            heads_kv: 24,
            head_dim: 128,
        },
        1.0,
        Mask::Limits(&limit_buf),
    );
    let shapes: Vec<(&str, Vec<usize>, AttnSpec<'_, CudaBackend>)> = vec![
        (
            "edit prefix 4166x24x128 block-causal",
            vec![edit_len],
            edit_spec,
        ),
        // Qwen3-VL's and SigLIP2's 72-wide heads: a 1024² image's 4,096 patches, 16 heads.
        ("vision 4096x16x72", vec![4096], spec(16, 16, 72, None)),
        ("W2 sliding", vec![2208], spec(4, 2, 256, Some(512))),
        ("W2 full", vec![2208], spec(4, 1, 512, None)),
        ("W3 sliding", w3.clone(), spec(4, 2, 256, Some(512))),
        ("W3 full", w3, spec(4, 1, 512, None)),
        ("image 2394 patches", vec![2394], spec(12, 12, 64, None)),
        // Z-Image's DiT at 1024²: 4,096 image rows and the prompt's, 30 heads of 128.
        ("dit 4224x30x128", vec![4224], spec(30, 30, 128, None)),
        // The head-64 shape: 4,096 rows × 16 heads.
        ("4096x16x64", vec![4096], spec(16, 16, 64, None)),
    ];
    for (name, lens, s) in &shapes {
        let pairs: f64 = lens
            .iter()
            .map(|&n| match s.mask {
                Mask::Window(w) => (0..n)
                    .map(|i| (i.min(w) + (n - 1 - i).min(w) + 1) as f64)
                    .sum(),
                Mask::Limits(_) => limits.iter().map(|&l| l as f64).sum(),
                _ => (n * n) as f64,
            })
            .sum();
        let flops = 4.0 * (s.heads_q * s.head_dim) as f64 * pairs;
        // The op's own choices, then each kernel the GPU has with each fixed chunk count.
        let mut kernels = vec![FlashKernel::Mma];
        if cuda::attention::wgmma_applies(be.arch(), s.head_dim) {
            kernels.push(FlashKernel::Wgmma);
        }
        if cuda::attention::ws_applies(be.arch(), s.head_dim) {
            kernels.push(FlashKernel::Ws);
        }
        let fixed = kernels.iter().flat_map(|&k| {
            [1, 2, 3, 4, 6, 8].map(|n| FlashChoice {
                splits: Some(n),
                kernel: Some(k),
            })
        });
        for choice in std::iter::once(FlashChoice::default()).chain(fixed) {
            let (ms, splits) = be.bench_attention(lens, s, 20, choice)?;
            emit(
                serde_json::json!({"name": "attention", "shape": name, "head_dim": s.head_dim,
                "kernel": choice.kernel.map(|k| format!("{k:?}")), "kv_splits": splits,
                "chosen": choice.splits.is_none(),
                "median_ms": ms, "tflops": flops / (ms / 1e3) / 1e12}),
            )?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn attention(_b: AttentionBench) -> Result<()> {
    Err(Error::input("this build has no CUDA support"))
}

/// One convolution `bench conv` times: (what, input side, cin, cout, kernel, upsampled, SiLU
/// before it).
#[cfg(feature = "cuda")]
type ConvShape = (&'static str, usize, usize, usize, usize, bool, bool);

/// The VAE decoders' convolutions at a 1024² output. Z-Image (Flux-style, 16 latent channels,
/// 8×): conv_in, the 512-wide mid and up blocks at 128² and 256², 256 at 512², 128 at 1024²,
/// the upsamplers, conv_out. Qwen-Image-2.1 (16×, 64 latent channels; its norms apply the SiLU
/// before every resnet convolution, so they read activation-free inputs): 1152 wide at
/// 64²–256², 576 at 256², 288 at 512², 144 at 1024², conv_out into RGBA.
#[cfg(feature = "cuda")]
const CONV_SHAPES: &[ConvShape] = &[
    ("zimage conv_in", 128, 16, 512, 3, false, false),
    ("zimage mid 512@128", 128, 512, 512, 3, false, false),
    (
        "zimage upsample 512@128->256",
        128,
        512,
        512,
        3,
        true,
        false,
    ),
    ("zimage up 512@256", 256, 512, 512, 3, false, false),
    (
        "zimage upsample 512@256->512",
        256,
        512,
        512,
        3,
        true,
        false,
    ),
    ("zimage up 512->256@512", 512, 512, 256, 3, false, false),
    ("zimage up 256@512", 512, 256, 256, 3, false, false),
    (
        "zimage upsample 256@512->1024",
        512,
        256,
        256,
        3,
        true,
        false,
    ),
    ("zimage up 256->128@1024", 1024, 256, 128, 3, false, false),
    ("zimage up 128@1024", 1024, 128, 128, 3, false, false),
    ("zimage conv_out", 1024, 128, 3, 3, false, false),
    ("qwen conv_in", 64, 64, 1152, 3, false, false),
    ("qwen 1152@64", 64, 1152, 1152, 3, false, false),
    ("qwen 1152@128", 128, 1152, 1152, 3, false, false),
    ("qwen 1152@256", 256, 1152, 1152, 3, false, false),
    ("qwen 1152->576@256", 256, 1152, 576, 3, false, false),
    ("qwen 576@256", 256, 576, 576, 3, false, false),
    ("qwen 576->288@512", 512, 576, 288, 3, false, false),
    ("qwen 288@512", 512, 288, 288, 3, false, false),
    ("qwen 288->144@1024", 1024, 288, 144, 3, false, false),
    ("qwen 144@1024", 1024, 144, 144, 3, false, false),
    ("qwen conv_out", 1024, 144, 4, 3, false, false),
];

#[cfg(feature = "cuda")]
fn conv(b: ConvBench) -> Result<()> {
    use tessera_backend::cuda::ConvPath;
    use tessera_backend::{Activation, Backend, Conv2d, Precision};
    let tessera_backend::AnyBackend::Cuda(be) = b.device.open()? else {
        return Err(Error::input(
            "bench conv times the CUDA kernels: use --device cuda",
        ));
    };
    if be.precision() != Precision::Bf16 {
        return Err(Error::input(
            "bench conv times the bf16 kernels: run it under bf16 precision",
        ));
    }
    for &(name, side, cin, cout, k, up, silu) in CONV_SHAPES {
        let mut spec = Conv2d::same(side, side, k);
        if up {
            spec = spec.upsampled();
        }
        if silu {
            spec = spec.of_activated(Activation::Silu);
        }
        let (oh, ow) = spec.out_size();
        let flops = 2.0 * (oh * ow * cout * k * k * cin) as f64;
        for path in [
            ConvPath::Ws,
            ConvPath::Wgmma,
            ConvPath::Implicit,
            ConvPath::Im2col,
        ] {
            let ws_declines = path == ConvPath::Ws && !ConvPath::ws_takes(&spec, cout);
            if ws_declines || be.conv_path_available(path).is_err() {
                continue;
            }
            let ms = be.bench_conv(&spec, (cin, cout), b.iters, path)?;
            emit(
                serde_json::json!({"name": "conv", "shape": name, "side": side, "cin": cin,
                "cout": cout, "kernel": k, "upsampled": up, "silu": silu,
                "path": format!("{path:?}").to_lowercase(), "median_us": ms * 1e3,
                "tflops": flops / (ms / 1e3) / 1e12}),
            )?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn conv(_b: ConvBench) -> Result<()> {
    Err(Error::input("this build has no CUDA support"))
}
