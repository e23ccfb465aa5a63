//! CUDA graphs: a shape seen twice is captured and then replayed, one launch for a whole forward.

use std::collections::{HashMap, HashSet};

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use tessera_core::{Error, Result};

use super::CudaBackend;
use super::errors::drv;

/// A replayable graph. CUDA graph executables may be launched from any thread once created.
struct Graph(CudaGraph);
// SAFETY: the executable graph is only launched while holding the `graphs` mutex, on the
// backend's own stream; CUDA permits launching it from any host thread.
unsafe impl Send for Graph {}

/// Graphs ready to replay, by the caller's shape key, and the keys seen once.
#[derive(Default)]
pub(super) struct Graphs {
    ready: HashMap<u64, Graph>,
    seen: HashSet<u64>,
}

/// Graphs kept at most; a workload with ever-new shapes must not grow memory without bound.
const MAX_GRAPHS: usize = 64;

impl CudaBackend {
    /// `work` for shape `key`: run directly the first time, captured the second, replayed after.
    pub(super) fn replay(&self, key: u64, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.profiler.is_some() {
            return work(); // events inside a graph would not time anything
        }
        let mut g = self
            .graphs
            .lock()
            .map_err(|_| Error::backend("graphs", "lock poisoned"))?;
        if let Some(graph) = g.ready.get(&key) {
            return graph.0.launch().map_err(drv("graph launch"));
        }
        // First sight of a shape: run it directly; capture it the second time it comes.
        if g.seen.insert(key) {
            drop(g);
            return work();
        }
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin capture"))?;
        let worked = work();
        let captured = self
            .stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        worked?;
        let graph = captured
            .map_err(drv("graph capture"))?
            .ok_or_else(|| Error::backend("graph capture", "nothing was captured"))?;
        graph.launch().map_err(drv("graph launch"))?;
        if g.ready.len() >= MAX_GRAPHS {
            g.ready.clear();
        }
        g.ready.insert(key, Graph(graph));
        Ok(())
    }
}
