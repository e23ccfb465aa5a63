//! `--device auto|cpu|cuda[:N]` and `--precision`: which backend runs, decided once and said.
//!
//! `auto` uses CUDA when the libraries and a device are present and otherwise says why, in one
//! line, and runs on the CPU. An explicit `cuda` never falls back: it fails with the reason.

use std::str::FromStr;

use tessera_core::{Error, Result};

use crate::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use crate::cuda::CudaBackend;
use crate::{Backend, Op, Precision, Quantization};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceRequest {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| {
                    Error::input(format!(
                        "unknown device {s:?} (expected auto, cpu, cuda or cuda:N)"
                    ))
                }),
        }
    }
}

impl std::fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A backend chosen at run time.
pub enum AnyBackend {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
}

/// A computation written once, generic over the backend, that [`AnyBackend::run`] calls with
/// whichever backend was opened (Rust closures cannot be generic). Front ends load a model this
/// way and keep it behind a trait object, so no model family needs its own per-device enum.
pub trait BackendFn {
    type Output;
    fn call<B: Backend + 'static>(self, backend: B) -> Self::Output;
}

impl AnyBackend {
    /// Favour this backend's latency where it shares a device with others: on CUDA its work
    /// goes to a stream of the highest priority (`CudaBackend::use_high_priority_stream`); on
    /// the CPU there is nothing to do. Call it before loading anything.
    pub fn prefer_latency(&mut self) -> Result<()> {
        match self {
            AnyBackend::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.use_high_priority_stream(),
        }
    }

    /// Open the requested device. `precision` `None` means the device's default (bf16 on CUDA,
    /// f32 on the CPU). `note` receives the one line that explains an `auto` choice of the CPU.
    pub fn open(
        req: DeviceRequest,
        precision: Option<Precision>,
        note: impl FnMut(&str),
    ) -> Result<Self> {
        Self::open_for(req, precision, Quantization::default(), &[], note)
    }

    /// [`open`](Self::open) for a model that will call `ops`: a device that cannot run one of
    /// them is declined here, before anything loads — `auto` then runs on the CPU and says why,
    /// an explicit `cuda` fails with the reason. `quant.at_load` (`--quantize`) or
    /// `quant.stored`: the block format the model's products will see, so they are asked for
    /// on that format.
    pub fn open_for(
        req: DeviceRequest,
        precision: Option<Precision>,
        quant: Quantization,
        ops: &[Op],
        mut note: impl FnMut(&str),
    ) -> Result<Self> {
        if let Some(q) = quant.at_load.filter(|q| !q.is_quantized()) {
            return Err(Error::input(format!(
                "cannot quantize to {q}: not a block format"
            )));
        }
        let ops: Vec<Op> = ops
            .iter()
            .map(|op| op.with_weights(quant.products()))
            .collect();
        // The CPU computes in f32 unless bf16 is asked for (where the GPU defaults to bf16).
        let cpu = |precision: Option<Precision>| -> Result<AnyBackend> {
            Ok(AnyBackend::Cpu(
                CpuBackend::with_precision(precision.unwrap_or_default()).quantizing(quant),
            ))
        };
        let cuda = |ordinal: usize| -> Result<AnyBackend> {
            let be = open_cuda(ordinal, precision.unwrap_or(Precision::Bf16), quant)?;
            be.supports_all(&ops)?;
            Ok(be)
        };
        match req {
            DeviceRequest::Cpu => cpu(precision),
            DeviceRequest::Cuda(n) => cuda(n),
            DeviceRequest::Auto => match cuda(0) {
                Ok(b) => Ok(b),
                Err(e) => {
                    note(&format!("running on the CPU: {e}"));
                    cpu(precision)
                }
            },
        }
    }

    /// Run `f` with the backend inside.
    pub fn run<F: BackendFn>(self, f: F) -> F::Output {
        match self {
            AnyBackend::Cpu(b) => f.call(b),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => f.call(*b),
        }
    }

    /// Device and precision, one line.
    pub fn describe(&self) -> String {
        match self {
            AnyBackend::Cpu(b) => b.describe(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.describe(),
        }
    }

    /// Which kernels run the convolutions (the VAEs'), for `tessera info`.
    pub fn conv_route(&self) -> String {
        match self {
            AnyBackend::Cpu(_) => {
                "blocks of gathered patches times the weight (the CPU's products)".to_string()
            }
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.conv_route(),
        }
    }

    /// Which kernels run decoding's products of a few rows (the chat models'), for `tessera info`.
    pub fn decode_route(&self) -> String {
        match self {
            AnyBackend::Cpu(_) => "the CPU's products, as for longer inputs".to_string(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.decode_route(),
        }
    }

    /// `Ok` if this backend runs every op of `ops`, else the first refusal, naming the device.
    pub fn supports_all(&self, ops: &[Op]) -> Result<()> {
        let check = |op: &Op| match self {
            AnyBackend::Cpu(b) => b.supports(op),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.supports(op),
        };
        for op in ops {
            if let Err(e) = check(op) {
                return Err(Error::Device(format!(
                    "{} cannot run {op}: {e}",
                    self.describe()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, precision: Precision, quant: Quantization) -> Result<AnyBackend> {
    crate::cuda::open(ordinal, precision).map(|b| AnyBackend::Cuda(Box::new(b.quantizing(quant))))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize, _precision: Precision, _quant: Quantization) -> Result<AnyBackend> {
    Err(Error::Device(
        "this build of Tessera has no CUDA support (built without the `cuda` feature)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!(
            "auto".parse::<DeviceRequest>().unwrap(),
            DeviceRequest::Auto
        );
        assert_eq!(
            "cuda".parse::<DeviceRequest>().unwrap(),
            DeviceRequest::Cuda(0)
        );
        assert_eq!(
            "cuda:3".parse::<DeviceRequest>().unwrap(),
            DeviceRequest::Cuda(3)
        );
        assert!(
            "gpu"
                .parse::<DeviceRequest>()
                .unwrap_err()
                .to_string()
                .contains("auto, cpu, cuda")
        );
    }

    #[test]
    fn cpu_runs_f32_unless_bf16_is_asked_for() {
        let be = AnyBackend::open(DeviceRequest::Cpu, Some(Precision::Bf16), |_| {}).unwrap();
        assert!(be.describe().contains("bf16"), "{}", be.describe());
        let be = AnyBackend::open(DeviceRequest::Cpu, None, |_| {}).unwrap();
        assert!(be.describe().contains("f32"), "{}", be.describe());
    }
}
