//! `--device auto|cpu|cuda[:N]` and `--precision`: which backend runs, decided once and said.
//!
//! `auto` uses CUDA when the libraries and a device are present and otherwise says why, in one
//! line, and runs on the CPU. An explicit `cuda` never falls back: it fails with the reason.

use std::str::FromStr;

use tessera_core::{Error, Result};

use crate::Precision;
use crate::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use crate::cuda::CudaBackend;

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

impl AnyBackend {
    /// Open the requested device. `precision` `None` means the device's default (bf16 on CUDA,
    /// f32 on the CPU). `note` receives the one line that explains an `auto` choice of the CPU.
    pub fn open(
        req: DeviceRequest,
        precision: Option<Precision>,
        mut note: impl FnMut(&str),
    ) -> Result<Self> {
        let cpu = |precision: Option<Precision>| -> Result<AnyBackend> {
            if precision == Some(Precision::Bf16) {
                return Err(Error::input(
                    "the CPU backend computes in f32 only: drop --precision bf16 or use --device cuda",
                ));
            }
            Ok(AnyBackend::Cpu(CpuBackend::new()))
        };
        match req {
            DeviceRequest::Cpu => cpu(precision),
            DeviceRequest::Cuda(n) => open_cuda(n, precision.unwrap_or(Precision::Bf16)),
            DeviceRequest::Auto => match open_cuda(0, precision.unwrap_or(Precision::Bf16)) {
                Ok(b) => Ok(b),
                Err(e) => {
                    note(&format!("running on the CPU: {e}"));
                    cpu(precision.filter(|&p| p != Precision::Bf16))
                }
            },
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, precision: Precision) -> Result<AnyBackend> {
    crate::cuda::open(ordinal, precision).map(|b| AnyBackend::Cuda(Box::new(b)))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize, _precision: Precision) -> Result<AnyBackend> {
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
    fn cpu_refuses_bf16() {
        let e = AnyBackend::open(DeviceRequest::Cpu, Some(Precision::Bf16), |_| {})
            .err()
            .unwrap();
        assert!(e.to_string().contains("f32 only"));
    }
}
