//! Condition images as Qwen-Image-2.1's text encoder (Qwen3-VL) reads them (spec A6):
//!
//! - [`processor`]: the image processor (smart resize, normalisation, merge-ordered patch rows);
//! - [`config`]: the tower's settings (`vision_config`);
//! - [`grid`]: per-grid host tables (resampled position rows, 2-D rotary angles);
//! - [`tower`]: the vision tower with its patch merger and DeepStack mergers, and [`ops`], the
//!   ops it calls;
//! - [`prompt`]: the edit template, each image's run of pad tokens and the multimodal RoPE
//!   positions of the prompt.

pub mod config;
pub mod grid;
mod ops;
pub mod processor;
pub mod prompt;
pub mod tower;

pub use config::VisionConfig;
pub use ops::ops;
pub use processor::{ImageProcessorConfig, VisionImage, smart_resize};
pub use prompt::{EditPrompt, ImageSpan, edit_template, mrope_positions};
pub use tower::{VisionFeatures, VisionTower};
