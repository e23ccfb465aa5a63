//! `TESSERA_PROFILE=1`: GPU milliseconds per op class, printed on stderr after each forward;
//! `TESSERA_PROFILE=kernels`: per class and kernel name (`norm/residual_norm_warp_bf16_bf16`), to
//! see which kernel of a class holds the time.
//!
//! Every op is bracketed by two timing events; at the next host read (the end of a forward) the
//! elapsed times are summed per class. Graph replay is off while profiling, so every kernel is
//! seen. A second line gives the time the stream spent between ops (waiting for the host, or on
//! work no op brackets: allocations' zero fills, copies) and the largest such gaps with the ops
//! around them — where a forward's wall time exceeds its kernels'. A third line splits the stream's
//! time from the end of the previous report to this read's end into the part before the first op
//! (the host's work between forwards, zero fills and uploads), the ops' span, the part after the
//! last op and the read itself (a VAE decode's wall time is all four). It counts from the previous
//! report's end, not its read's: the report itself (an elapsed-time query and two event releases an
//! op, ~5 ms after a DiT step's thousand ops, run g20) is the profiler's time, not the model's. The
//! host's own share of the wait before the first op (when it issued that op) is printed beside it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use tessera_core::{Error, Result};

type Span = (String, CudaEvent, CudaEvent);

pub(super) struct Profiler {
    ctx: Arc<CudaContext>,
    spans: Mutex<Vec<Span>>,
    /// Label spans by kernel name too (`TESSERA_PROFILE=kernels`).
    by_kernel: bool,
    /// Events around the copy of the read being reported ([`Profiler::read_begins`],
    /// [`Profiler::read_ends`]), and the end of the previous report.
    reads: Mutex<Reads>,
}

#[derive(Default)]
struct Reads {
    begin: Option<CudaEvent>,
    end: Option<CudaEvent>,
    /// Recorded when the previous report had finished, its events released.
    resumed: Option<CudaEvent>,
    /// The host's clock then, and when it issued the first op after it: how much of the stream's
    /// wait before that op was the host's own work (the rest: copies and fills on the stream).
    resumed_at: Option<Instant>,
    first_issued_at: Option<Instant>,
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::backend("profiler", e)
}

impl Profiler {
    /// A profiler when `TESSERA_PROFILE` is set to anything but `0` or empty.
    pub fn from_env(ctx: &Arc<CudaContext>) -> Result<Option<Self>> {
        let mode = std::env::var("TESSERA_PROFILE").unwrap_or_default();
        let on = !mode.is_empty() && mode != "0";
        Ok(on.then(|| Profiler {
            ctx: ctx.clone(),
            spans: Mutex::new(Vec::new()),
            by_kernel: mode == "kernels",
            reads: Mutex::new(Reads::default()),
        }))
    }

    /// Time `op` under `class`, and under `kernel` too when it names the kernel the op launches.
    pub fn time(
        &self,
        stream: &CudaStream,
        class: &'static str,
        kernel: Option<&str>,
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if self.spans.lock().map_err(err)?.is_empty() {
            let mut reads = self.reads.lock().map_err(err)?;
            reads.first_issued_at.get_or_insert_with(Instant::now);
        }
        let start = self.event(stream)?;
        op()?;
        let end = self.event(stream)?;
        let label = match kernel.filter(|_| self.by_kernel) {
            Some(kernel) => format!("{class}/{kernel}"),
            None => class.to_string(),
        };
        self.spans.lock().map_err(err)?.push((label, start, end));
        Ok(())
    }

    /// A timing event recorded on `stream` now.
    fn event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        let e = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        e.record(stream).map_err(err)?;
        Ok(e)
    }

    /// Mark the start of a host read's copy on the stream.
    pub fn read_begins(&self, stream: &CudaStream) -> Result<()> {
        let e = self.event(stream)?;
        self.reads.lock().map_err(err)?.begin = Some(e);
        Ok(())
    }

    /// Mark the end of a host read's copy on the stream.
    pub fn read_ends(&self, stream: &CudaStream) -> Result<()> {
        let e = self.event(stream)?;
        self.reads.lock().map_err(err)?.end = Some(e);
        Ok(())
    }

    /// Print and clear the spans recorded since the last report (the stream has been synchronised),
    /// then mark on `stream` where the model's time starts again.
    pub fn report(&self, stream: &CudaStream) -> Result<()> {
        let spans = std::mem::take(&mut *self.spans.lock().map_err(err)?);
        let mut reads = self.reads.lock().map_err(err)?;
        let (begin, end) = (reads.begin.take(), reads.end.take());
        let resumed = reads.resumed.take();
        let host = reads
            .resumed_at
            .take()
            .zip(reads.first_issued_at.take())
            .map(|(a, b)| b.saturating_duration_since(a));
        let printed = self.print(
            &spans,
            begin.as_ref().zip(end.as_ref()),
            resumed.as_ref().map(|r| (r, host)),
        );
        drop((spans, begin, end, resumed));
        reads.resumed = Some(self.event(stream)?);
        reads.resumed_at = Some(Instant::now());
        printed
    }

    /// The three lines of one report: per class, the gaps, and (after a read) the wall time.
    fn print(
        &self,
        spans: &[Span],
        read: Option<(&CudaEvent, &CudaEvent)>,
        resumed: Option<(&CudaEvent, Option<Duration>)>,
    ) -> Result<()> {
        if spans.is_empty() {
            return Ok(());
        }
        let mut by_class: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
        for (label, s, e) in spans {
            let ms = s.elapsed_ms(e).map_err(err)? as f64;
            let entry = by_class.entry(label).or_default();
            entry.0 += ms;
            entry.1 += 1;
        }
        let total: f64 = by_class.values().map(|v| v.0).sum();
        let parts: Vec<String> = by_class
            .iter()
            .map(|(c, (ms, n))| {
                format!(
                    "{c} {ms:.3} ms ({n} ops, {:.0}%)",
                    100.0 * ms / total.max(1e-9)
                )
            })
            .collect();
        eprintln!("profile: {} | total {total:.3} ms", parts.join(" | "));
        // The stream between the end of each op and the start of the next.
        let mut gaps = Vec::with_capacity(spans.len());
        for pair in spans.windows(2) {
            let (before, _, end) = &pair[0];
            let (after, start, _) = &pair[1];
            gaps.push((end.elapsed_ms(start).map_err(err)? as f64, before, after));
        }
        let between: f64 = gaps.iter().map(|g| g.0).sum();
        let (first, last) = (&spans[0].1, &spans[spans.len() - 1].2);
        let span = first.elapsed_ms(last).map_err(err)? as f64;
        gaps.sort_by(|a, b| b.0.total_cmp(&a.0));
        let largest: Vec<String> = gaps
            .iter()
            .take(6)
            .map(|(ms, before, after)| format!("{ms:.3} ms after {before} before {after}"))
            .collect();
        eprintln!(
            "profile gaps: {between:.3} ms between {} ops in a span of {span:.3} ms; largest: {}",
            spans.len(),
            largest.join(" | ")
        );
        if let Some((begin, end)) = read {
            let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(f64::from).map_err(err);
            let before = match resumed {
                Some((p, host)) => format!(
                    "{:.3} ms before the first op (since the previous report; the host issued it \
                     after {}), ",
                    ms(p, first)?,
                    host.map_or("?".into(), |d| format!("{:.3} ms", d.as_secs_f64() * 1e3))
                ),
                None => String::new(),
            };
            eprintln!(
                "profile wall: {before}{span:.3} ms of ops, {:.3} ms after the last op, {:.3} ms \
                 reading back",
                ms(last, begin)?,
                ms(begin, end)?
            );
        }
        Ok(())
    }
}
