//! `--device`, `--precision` and `--quantize`, shared by every command that runs a model.

use clap::{Args, ValueEnum};
use tessera_backend::{AnyBackend, DeviceRequest, Precision, Quantization};
use tessera_core::{DType, Error, Result};
use tessera_runtime::ModelSpec;

/// A format to quantize a model's matrices to as it loads (llama.cpp's block types, or FP8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[allow(non_camel_case_types)] // ggml's names; users type them lower-case (q8_0, q4_k)
pub enum Quantize {
    /// 8-bit values in blocks of 32 with an f16 scale (8.5 bits a weight).
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit values in blocks of 32 with an f16 scale (4.5 bits a weight).
    #[value(name = "q4_0")]
    Q4_0,
    /// 4-bit values in super-blocks of 256, a 6-bit scale and min per 32 (4.5 bits a weight).
    #[value(name = "q4_k")]
    Q4_K,
    /// 6-bit values in super-blocks of 256, an 8-bit scale per 16 (6.6 bits a weight).
    #[value(name = "q6_k")]
    Q6_K,
    /// FP8 e4m3fn with an f32 scale per row (8 bits a weight and 32 a row), rounded as torch's
    /// `float8_e4m3fn` cast.
    #[value(name = "fp8")]
    Fp8,
}

impl Quantize {
    pub fn dtype(self) -> DType {
        match self {
            Quantize::Q8_0 => DType::Q8_0,
            Quantize::Q4_0 => DType::Q4_0,
            Quantize::Q4_K => DType::Q4_K,
            Quantize::Q6_K => DType::Q6_K,
            Quantize::Fp8 => DType::F8_E4M3,
        }
    }

    /// The value as typed on the command line.
    pub fn arg(self) -> &'static str {
        match self {
            Quantize::Q8_0 => "q8_0",
            Quantize::Q4_0 => "q4_0",
            Quantize::Q4_K => "q4_k",
            Quantize::Q6_K => "q6_k",
            Quantize::Fp8 => "fp8",
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Where to run: auto (CUDA if usable and it runs the model's ops, else the CPU, saying why),
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", env = "TESSERA_DEVICE")]
    device: String,
    /// bf16 (bf16 weights and GEMM inputs, f32 accumulation and statistics; the CUDA default),
    /// f32 (the exact mode; the CPU default), or int8 with --quantize (the CPU's fast mode:
    /// products on Q8_0/Q4_0/Q4_K/Q6_K weights round their activations to int8 per block of 32 and
    /// sum in integers; everything else f32).
    #[arg(long, env = "TESSERA_PRECISION")]
    precision: Option<String>,
    /// Quantize the model's product weights (its 2-D matrices whose rows are whole blocks;
    /// embedding tables, norms and biases stay as stored) to this format as they load, rounding
    /// as llama.cpp's quantizers do (fp8: as torch's float8_e4m3fn cast, one scale per row); no
    /// file is written. Products then run exactly on the decoded weights (f32 sums; on CUDA too),
    /// or with int8 activations under --precision int8 (q8_0, q4_0, q4_k, q6_k; CPU only).
    #[arg(long, value_enum, env = "TESSERA_QUANTIZE")]
    pub quantize: Option<Quantize>,
}

impl DeviceArgs {
    /// The same precision on another device (`cpu`, `cuda`, `cuda:N`, `auto`).
    pub fn with_device(&self, device: &str) -> DeviceArgs {
        DeviceArgs {
            device: device.to_string(),
            precision: self.precision.clone(),
            quantize: self.quantize,
        }
    }

    /// The same choice as command-line arguments, for a child `tessera` process.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--device".to_string(), self.device.clone()];
        if let Some(p) = &self.precision {
            args.extend(["--precision".to_string(), p.clone()]);
        }
        if let Some(q) = self.quantize {
            args.extend(["--quantize".to_string(), q.arg().to_string()]);
        }
        args
    }

    fn parsed(&self) -> Result<(DeviceRequest, Option<Precision>)> {
        let req: DeviceRequest = self.device.parse()?;
        let precision = match self.precision.as_deref() {
            // int8 changes only the products on quantized weights: f32 otherwise.
            Some("int8") => Some(Precision::F32),
            p => p.map(str::parse).transpose()?,
        };
        Ok((req, precision))
    }

    /// `--quantize`, the block format weights are `stored` in (a GGUF file), and whether
    /// products take int8 activations (`--precision int8`, which needs quantized weights to act
    /// on).
    pub fn quantization(&self, stored: Option<DType>) -> Result<Quantization> {
        let int8 = self.precision.as_deref() == Some("int8");
        if int8 && self.quantize.is_none() && stored.is_none() {
            return Err(Error::input(
                "--precision int8 rounds the activations of products on quantized weights: \
                 use it with --quantize or a quantized GGUF file",
            ));
        }
        Ok(Quantization {
            at_load: self.quantize.map(Quantize::dtype),
            stored,
            int8,
        })
    }

    /// Open the backend for `model`: a device that cannot run the model's ops is declined here,
    /// before anything loads (`auto` falls back to the CPU and says why in one line on stderr).
    pub fn open_for(&self, model: &ModelSpec) -> Result<AnyBackend> {
        self.open_for_stored(model, None)
    }

    /// As [`DeviceArgs::open_for`], with the note going to `note` (the server logs it).
    pub fn open_for_with(&self, model: &ModelSpec, note: impl FnMut(&str)) -> Result<AnyBackend> {
        self.open_model(model, None, note)
    }

    /// [`open_for`](Self::open_for) a model some of whose weights are stored in block format
    /// `stored` (a GGUF transformer file).
    pub fn open_for_stored(&self, model: &ModelSpec, stored: Option<DType>) -> Result<AnyBackend> {
        self.open_model(model, stored, |note| eprintln!("note: {note}"))
    }

    fn open_model(
        &self,
        model: &ModelSpec,
        stored: Option<DType>,
        note: impl FnMut(&str),
    ) -> Result<AnyBackend> {
        let (req, precision) = self.parsed()?;
        // A GGUF model folder says its own stored format.
        let stored = stored.or(model.stored_format());
        model.device(req, precision, self.quantization(stored)?, note)
    }

    /// Open the backend with no model in view (benchmarks of single CUDA ops).
    #[cfg(feature = "cuda")]
    pub fn open(&self) -> Result<AnyBackend> {
        let (req, precision) = self.parsed()?;
        AnyBackend::open(req, precision, |note| eprintln!("note: {note}"))
    }
}
