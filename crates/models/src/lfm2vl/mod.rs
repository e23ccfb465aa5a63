//! LFM2-VL (LiquidAI): a SigLIP2 NaFlex vision tower and projector feeding image tokens into the
//! LFM2 hybrid language model (short convolutions and grouped-query attention).
//!
//! - [`config`]: `config.json`;
//! - [`vision`]: the tower, the 2×2 unshuffle and the projector;
//! - [`text`]: the language model and its per-sequence cache;
//! - [`model`]: both together; [`ops`]: every op they call.

pub mod config;
pub mod model;
pub mod ops;
pub mod text;
pub mod vision;

pub use config::{LayerKind, Lfm2VlConfig, TextConfig, VisionConfig};
pub use model::{Lfm2Vl, Turn};
pub use ops::ops;
pub use text::{CacheShape, Extend, Lfm2Text};
pub use vision::{ImageEncoder, TilePatches};
