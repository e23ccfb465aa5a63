//! Blocks shared by the model families, each written once against the backend ops:
//! - [`attention`]: self-attention with fused q|k|v, per-head norms and RoPE;
//! - [`mlp`]: the gated MLP;
//! - [`layers`]: the pre-norm (Qwen-style) and sandwich-normed (Gemma) layers built from them;
//! - [`scratch`]: the activations a block works in;
//! - [`rope`]: RoPE angle tables (1-D, 2-D axial, multi-axis);
//! - [`timestep`]: the sinusoidal timestep features of diffusion transformers;
//! - [`vae`]: the VAEs' convolution, resnet, mid attention and buffers, over GroupNorm or RMS norm.

pub mod attention;
pub mod layers;
pub mod mlp;
pub mod rope;
pub mod scratch;
pub mod timestep;
pub mod vae;

pub use attention::{AttentionWeights, AttnNames, HF_ATTENTION, QkvNames, SelfAttention};
pub use layers::{LayerShape, PreNormLayer, SandwichLayer};
pub use mlp::{HF_MLP, MlpNames, MlpWeights};
pub use scratch::{Scratch, ScratchDims, workspace_generation};
