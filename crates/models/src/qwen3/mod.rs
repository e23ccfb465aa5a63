//! Qwen3 text models (`transformers.Qwen3Model`), reusable by any pipeline that conditions on a
//! Qwen3 hidden state (Z-Image's caption encoder is Qwen3-4B read at `hidden_states[-2]`).
//!
//! Reference: transformers 5.25.0 `models/qwen3/modeling_qwen3.py`: pre-norm decoder layers with
//! GQA attention (per-head RMSNorm of q and k before split-half RoPE), SwiGLU MLP, RMSNorm with a
//! plain weight, no biases.

pub mod config;
pub mod model;
pub mod tokenizer;

pub use config::Qwen3Config;
pub use model::Qwen3TextModel;
pub use tokenizer::BpeTokenizer;
