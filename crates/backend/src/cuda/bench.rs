//! Device-side benchmarks for `tessera bench`: GEMM throughput and the bf16 attention op, timed
//! with events on random operands.

use tessera_core::Result;

use super::CudaBackend;
use super::attention::{self, FlashChoice};
use super::errors::drv;
use super::image::ConvPath;
use crate::{AttnSpec, Backend, Conv2d, Epilogue, Role, View, ViewMut};

/// `len` benchmark operands uniform in [-½, ½) from an xorshift stream at `seed` (advanced).
fn bench_values(seed: &mut u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

impl CudaBackend {
    /// TFLOP/s of a `size³` GEMM (`x · wᵀ`, operands in this backend's compute dtype, random
    /// values), median of `iters` runs timed with events after warm-up.
    pub fn bench_gemm(&self, size: usize, iters: usize) -> Result<f64> {
        let ms = self.bench_gemm_shape((size, size, size), 1, iters)?;
        Ok(2.0 * (size as f64).powi(3) / (ms / 1e3) / 1e12)
    }

    /// Median GPU ms of one `[m, k] · [n, k]ᵀ` product on random data, timed over `reps`
    /// back-to-back launches (so small products are not hidden behind the timing events).
    pub fn bench_gemm_shape(
        &self,
        (m, n, k): (usize, usize, usize),
        reps: usize,
        iters: usize,
    ) -> Result<f64> {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut x = self.alloc(m * k, Role::Compute)?;
        self.write_f32(&mut x, &bench_values(&mut seed, m * k))?;
        let w = self.matrix_f32(&[(&bench_values(&mut seed, n * k), n)], k)?;
        let mut out = self.alloc(m * n, Role::Compute)?;
        let reps = reps.max(1);
        let mut run = || {
            for _ in 0..reps {
                self.matmul(
                    View::new(&x, m, k),
                    &w,
                    ViewMut::new(&mut out, m, n),
                    &Epilogue::default(),
                )?;
            }
            Ok(())
        };
        for _ in 0..3 {
            run()?;
        }
        Ok(self.median_ms(iters, &mut run)? / reps as f64)
    }

    /// Median GPU ms of the bf16 attention op over packed segments of `lens` (random q, k, v),
    /// timed with events after warm-up, and the key-chunk count it used; `choice` fixes the
    /// kernel and/or the count (default: the op's own choices, as in a forward).
    pub fn bench_attention(
        &self,
        lens: &[usize],
        spec: &AttnSpec<'_, Self>,
        iters: usize,
        choice: FlashChoice,
    ) -> Result<(f64, usize)> {
        let total: usize = lens.iter().sum();
        let (qc, kc) = (spec.heads_q * spec.head_dim, spec.heads_kv * spec.head_dim);
        let width = qc + 2 * kc;
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let host: Vec<f32> = bench_values(&mut seed, total * width)
            .into_iter()
            .map(|v| v * 0.25)
            .collect();
        let mut qkv = self.alloc(total * width, Role::Compute)?;
        self.write_f32(&mut qkv, &host)?;
        let mut out = self.alloc(total * qc, Role::Compute)?;
        let segs = self.segments(lens)?;
        let all = View::new(&qkv, total, width);
        let mut run = || {
            attention::flash(
                self,
                all.cols(0, qc),
                all.cols(qc, kc),
                all.cols(qc + kc, kc),
                ViewMut::new(&mut out, total, qc),
                spec,
                &segs,
                choice,
            )
        };
        let mut used = 1;
        for _ in 0..3 {
            used = run()?;
        }
        let ms = self.median_ms(iters, &mut || run().map(|_| ()))?;
        Ok((ms, used))
    }

    /// Median GPU ms of one bf16 convolution `spec` of a `cin`-channel image into `cout`
    /// channels (random image, weight and bias, compute-type input and output) on kernel path
    /// `path`, timed with events after warm-up.
    pub fn bench_conv(
        &self,
        spec: &Conv2d,
        (cin, cout): (usize, usize),
        iters: usize,
        path: ConvPath,
    ) -> Result<f64> {
        let pixels = spec.height * spec.width;
        let (oh, ow) = spec.out_size();
        let inner = spec.kernel * spec.kernel * cin;
        let mut seed = 0x5851_F42D_4C95_7F2Du64;
        let mut x = self.alloc(pixels * cin, Role::Compute)?;
        self.write_f32(&mut x, &bench_values(&mut seed, pixels * cin))?;
        let scale = 1.0 / (inner as f32).sqrt();
        let wv: Vec<f32> = bench_values(&mut seed, cout * inner)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        let w = self.matrix_f32(&[(&wv, cout)], inner)?;
        let bias = self.vector_f32(&bench_values(&mut seed, cout))?;
        let mut out = self.alloc(oh * ow * cout, Role::Compute)?;
        let mut run = || {
            self.conv2d_with(
                View::new(&x, pixels, cin),
                &w,
                &bias,
                spec,
                ViewMut::new(&mut out, oh * ow, cout),
                path,
            )
        };
        for _ in 0..3 {
            run()?;
        }
        self.median_ms(iters, &mut run)
    }

    /// Median GPU milliseconds of `run` over `iters` calls, each bracketed by timing events.
    fn median_ms(&self, iters: usize, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let start = self.ctx.new_event(flags).map_err(drv("event"))?;
            let end = self.ctx.new_event(flags).map_err(drv("event"))?;
            start.record(&self.stream).map_err(drv("event"))?;
            run()?;
            end.record(&self.stream).map_err(drv("event"))?;
            times.push(start.elapsed_ms(&end).map_err(drv("event"))? as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}
