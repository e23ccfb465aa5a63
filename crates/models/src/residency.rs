//! Which of a pipeline's components stay on the device between uses ([`Residency`]), and the
//! slot each component lives in (`Slot`): the loaded component, or the way to load it again
//! from its (memory-mapped) files when its stage comes.
//!
//! A text-to-image pipeline runs its parts one after another (text encoder, transformer, VAE
//! decoder), so holding only the part that runs lowers the peak of device memory from their
//! sum to the largest of them with its activations, at the cost of reading each part's weights
//! again for every request (the backend re-applies its `--quantize` as they load).

use std::fmt;

use tessera_backend::Backend;
use tessera_core::{Error, Result};

/// Whether a pipeline's components stay on the device between uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Residency {
    /// Every component loads once, at load time, and stays on the device: the fastest for
    /// repeated requests (a server, a bench).
    #[default]
    Resident,
    /// Each component is loaded when its stage runs and dropped (its device memory freed)
    /// before the next stage's component loads: the text encoder, then the transformer, then
    /// the VAE decoder (`--offload`).
    Sequential,
}

impl fmt::Display for Residency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Residency::Resident => "all components resident",
            Residency::Sequential => "components loaded one at a time (--offload)",
        })
    }
}

impl Residency {
    /// What a line about a run or a model adds for it: nothing when resident (the default),
    /// `"; components loaded one at a time (--offload)"` when sequential.
    pub fn suffix(self) -> String {
        match self {
            Residency::Resident => String::new(),
            Residency::Sequential => format!("; {self}"),
        }
    }

    /// What a request's memory estimate counts: the buffers beside every resident weight, or
    /// the largest stage with its component's weights.
    pub(crate) fn need_phrase(self) -> &'static str {
        match self {
            Residency::Resident => "beyond the model's weights",
            Residency::Sequential => "for its largest stage",
        }
    }

    /// What to do when no image size fits the device.
    pub(crate) fn no_size_fits(self) -> &'static str {
        match self {
            Residency::Resident => {
                "no size fits; free device memory, keep one component on the device at a time (`tessera generate --offload`) or use --device cpu"
            }
            Residency::Sequential => {
                "no size fits beside the largest component's weights; store them in 4.5 bits a weight with --quantize q4_k, free device memory or use --device cpu"
            }
        }
    }
}

/// How a slot loads its component onto the backend again.
type LoadFn<B, T> = Box<dyn Fn(&B) -> Result<T> + Send + Sync>;

/// One component of a pipeline: held while it is loaded, loaded again on demand.
pub(crate) struct Slot<B: Backend, T> {
    /// What the component is (`"transformer"`), for [`Slot::name`] and errors.
    name: &'static str,
    residency: Residency,
    held: Option<T>,
    /// The component's opened (memory-mapped) weights and how it is built from them; kept only
    /// where it loads again.
    load: Option<LoadFn<B, T>>,
    /// Device bytes the component took at its last load, where the backend budgets memory: what
    /// a request checked before the component loads must leave room for.
    bytes: Option<usize>,
}

impl<B: Backend, T> Slot<B, T> {
    /// A slot whose component `build` makes from its opened `weights` (the files are opened,
    /// and so checked, before the slot is made): built at once when [`Residency::Resident`] (a
    /// checkpoint that does not match fails here, as it always did, and the weights' mapping
    /// is dropped after), else at each use, from the mapping the slot keeps.
    pub fn new<W: Send + Sync + 'static>(
        be: &B,
        residency: Residency,
        name: &'static str,
        weights: W,
        build: impl Fn(&B, &W) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Self> {
        let (held, load): (_, Option<LoadFn<B, T>>) = match residency {
            Residency::Resident => {
                let built = build(be, &weights).map_err(|e| loading(name, residency, e))?;
                (Some(built), None)
            }
            Residency::Sequential => (None, Some(Box::new(move |be| build(be, &weights)))),
        };
        Ok(Slot {
            name,
            residency,
            held,
            load,
            bytes: None,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The component, loaded first if it is not held.
    pub fn get(&mut self, be: &B) -> Result<&mut T> {
        if self.held.is_none() {
            let load = self.load.as_ref().ok_or_else(|| {
                Error::input(format!(
                    "the {} was dropped and cannot load again",
                    self.name
                ))
            })?;
            let before = be.memory_available()?;
            let loaded = match load(be) {
                Ok(loaded) => loaded,
                Err(e) => {
                    // What loaded before the failure is dropped: its memory goes back too.
                    be.release_unused_memory()?;
                    return Err(loading(self.name, self.residency, e));
                }
            };
            if let (Some(before), Some(after)) = (before, be.memory_available()?) {
                self.bytes = Some(before.saturating_sub(after));
            }
            self.held = Some(loaded);
        }
        self.held
            .as_mut()
            .ok_or_else(|| Error::input(format!("the {} did not load", self.name)))
    }

    /// `pass` on the component (loaded first if need be), then the component released for the
    /// next stage whether or not the pass worked: a failed one must not leave it loaded. The
    /// pass's error comes first.
    pub fn with<R>(&mut self, be: &B, pass: impl FnOnce(&mut T) -> Result<R>) -> Result<R> {
        let out = self.get(be).and_then(pass);
        let released = self.release(be);
        let out = out?;
        released?;
        Ok(out)
    }

    /// The component if it is held (always, when resident).
    pub fn held(&self) -> Option<&T> {
        self.held.as_ref()
    }

    /// The held component, or an error saying it is loaded only for its stage.
    pub fn resident(&self) -> Result<&T> {
        self.held.as_ref().ok_or_else(|| {
            Error::input(format!(
                "the {} is not resident: the model loads its components one at a time (--offload)",
                self.name
            ))
        })
    }

    /// Drop the component when it is loaded only for its stage, and hand the memory it freed
    /// back to the device for the next stage's; a resident one stays.
    pub fn release(&mut self, be: &B) -> Result<()> {
        if self.residency == Residency::Sequential && self.held.take().is_some() {
            be.release_unused_memory()?;
        }
        Ok(())
    }

    /// Device bytes a stage must find free for this component before it loads: none when it
    /// is held (its memory is taken already) or where the backend does not budget memory; its
    /// size at its last load otherwise (0 before its first).
    pub fn bytes_to_load(&self) -> usize {
        match self.held {
            Some(_) => 0,
            None => self.bytes.unwrap_or(0),
        }
    }
}

/// What an out-of-memory error while a component loads says, after the allocation that failed:
/// a pipeline's own hints (a smaller size) do not apply to it.
pub(crate) const LOADING: &str = "while loading the";

/// `e`, when the device ran out of memory loading the component `name`, with what lowers the
/// weights' memory.
fn loading(name: &str, residency: Residency, e: Error) -> Error {
    let hint = match residency {
        Residency::Resident => {
            "`tessera generate --offload` keeps one component on the device at a time, and --quantize q4_k stores the matrices in 4.5 bits a weight instead of bf16's 16"
        }
        Residency::Sequential => {
            "this component alone does not fit: --quantize q4_k stores the matrices in 4.5 bits a weight instead of bf16's 16"
        }
    };
    match e {
        Error::OutOfMemory(m) => Error::OutOfMemory(format!("{m} {LOADING} {name}: {hint}")),
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tessera_backend::cpu::CpuBackend;

    use super::*;

    /// A component that counts how many of it are alive and how often one was built.
    struct Part {
        live: Arc<AtomicUsize>,
    }

    impl Drop for Part {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn slot(residency: Residency) -> (Slot<CpuBackend, Part>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let (live, built) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (l, b) = (live.clone(), built.clone());
        let be = CpuBackend::new();
        let slot = Slot::new(&be, residency, "part", (), move |_, ()| {
            l.fetch_add(1, Ordering::SeqCst);
            b.fetch_add(1, Ordering::SeqCst);
            Ok(Part { live: l.clone() })
        })
        .unwrap();
        (slot, live, built)
    }

    /// Sequential: nothing is built at load, `get` builds, `release` really drops it (its memory
    /// is gone), and the next `get` builds it again.
    #[test]
    fn a_sequential_slot_builds_for_each_use_and_drops_after() {
        let be = CpuBackend::new();
        let (mut s, live, built) = slot(Residency::Sequential);
        assert_eq!(
            (live.load(Ordering::SeqCst), built.load(Ordering::SeqCst)),
            (0, 0)
        );
        assert!(s.held().is_none() && s.resident().is_err());
        s.get(&be).unwrap();
        s.get(&be).unwrap();
        assert_eq!(
            (live.load(Ordering::SeqCst), built.load(Ordering::SeqCst)),
            (1, 1)
        );
        s.release(&be).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 0);
        assert!(s.held().is_none());
        s.get(&be).unwrap();
        assert_eq!(
            (live.load(Ordering::SeqCst), built.load(Ordering::SeqCst)),
            (1, 2)
        );
    }

    /// Resident: built once at load and never dropped by `release`.
    #[test]
    fn a_resident_slot_builds_once_and_keeps_it() {
        let be = CpuBackend::new();
        let (mut s, live, built) = slot(Residency::Resident);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        s.release(&be).unwrap();
        s.get(&be).unwrap();
        assert!(s.resident().is_ok());
        assert_eq!(
            (live.load(Ordering::SeqCst), built.load(Ordering::SeqCst)),
            (1, 1)
        );
        // The CPU budgets no memory: nothing to leave room for.
        assert_eq!(s.bytes_to_load(), 0);
    }

    /// Running out of device memory while a component loads names it and what lowers its
    /// memory; other errors pass as they are.
    #[test]
    fn out_of_memory_at_load_says_what_to_do() {
        let e = loading(
            "transformer",
            Residency::Resident,
            Error::OutOfMemory("512.0 MB for a Compute buffer".into()),
        );
        let m = e.to_string();
        assert!(matches!(e, Error::OutOfMemory(_)), "{m}");
        for needle in ["transformer", "--offload", "--quantize q4_k", LOADING] {
            assert!(m.contains(needle), "{needle:?} not in {m:?}");
        }
        let m = loading(
            "VAE decoder",
            Residency::Sequential,
            Error::OutOfMemory("x".into()),
        );
        assert!(m.to_string().contains("--quantize q4_k"), "{m}");
        assert!(!m.to_string().contains("--offload"), "{m}");
        let e = loading(
            "transformer",
            Residency::Resident,
            Error::input("bad shape"),
        );
        assert_eq!(e.to_string(), "bad shape");
    }
}
