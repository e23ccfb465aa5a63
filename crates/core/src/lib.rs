//! Tessera core: what every model and backend shares and nothing device-specific.
//!
//! - [`error`]: the one error type, whose variants name the file, tensor or field at fault;
//! - [`dtype`]: element types of checkpoint tensors and their conversion to `f32`;
//! - [`weights`]: safetensors checkpoints (single, sharded, or embedded in the binary), read
//!   through `mmap`, with shape checks by tensor name;
//! - [`gguf`]: GGUF files (llama.cpp's format) through `mmap`: typed metadata, the tensor table,
//!   and ggml's block formats (Q8_0, Q4_0, Q4_K, Q6_K, F32/F16/BF16) decoded to `f32`;
//! - [`fp8`]: FP8 e4m3fn codes to and from `f32`, as torch's `float8_e4m3fn` casts;
//! - [`config`]: reading JSON configs with errors that name the file and field;
//! - [`model_dir`]: turning `--model` (a folder or a Hugging Face repo id) into a folder;
//! - [`pixels`]: a VAE's output in [−1, 1] as 8-bit pixel values;
//! - [`hub`]: downloading the files a model needs from the Hugging Face hub into its cache.

pub mod config;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod gguf;
pub mod hub;
mod mapped;
pub mod model_dir;
pub mod pixels;
pub mod weights;

pub use dtype::DType;
pub use error::{Error, Result, check_finite};
pub use weights::{GgufAs, Scale, Tensor, Weights};
