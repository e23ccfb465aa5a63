//! `--device` and `--precision`, shared by every command that runs a model.

use clap::Args;
use tessera_backend::{AnyBackend, DeviceRequest, Precision};
use tessera_core::Result;
use tessera_runtime::ModelSpec;

#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Where to run: auto (CUDA if usable and it runs the model's ops, else the CPU, saying why),
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", env = "TESSERA_DEVICE")]
    device: String,
    /// bf16 (bf16 weights and GEMM inputs, f32 accumulation and statistics; the CUDA default)
    /// or f32 (the exact mode; the CPU default).
    #[arg(long, env = "TESSERA_PRECISION")]
    precision: Option<String>,
}

impl DeviceArgs {
    /// The same precision on another device (`cpu`, `cuda`, `cuda:N`, `auto`).
    pub fn with_device(&self, device: &str) -> DeviceArgs {
        DeviceArgs {
            device: device.to_string(),
            precision: self.precision.clone(),
        }
    }

    /// The same choice as command-line arguments, for a child `tessera` process.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--device".to_string(), self.device.clone()];
        if let Some(p) = &self.precision {
            args.extend(["--precision".to_string(), p.clone()]);
        }
        args
    }

    fn parsed(&self) -> Result<(DeviceRequest, Option<Precision>)> {
        let req: DeviceRequest = self.device.parse()?;
        let precision: Option<Precision> = self.precision.as_deref().map(str::parse).transpose()?;
        Ok((req, precision))
    }

    /// Open the backend for `model`: a device that cannot run the model's ops is declined here,
    /// before anything loads (`auto` falls back to the CPU and says why in one line on stderr).
    pub fn open_for(&self, model: &ModelSpec) -> Result<AnyBackend> {
        let (req, precision) = self.parsed()?;
        model.device(req, precision, |note| eprintln!("note: {note}"))
    }

    /// Open the backend with no model in view (benchmarks of single CUDA ops).
    #[cfg(feature = "cuda")]
    pub fn open(&self) -> Result<AnyBackend> {
        let (req, precision) = self.parsed()?;
        AnyBackend::open(req, precision, |note| eprintln!("note: {note}"))
    }
}
