//! Condition images as Qwen-Image-2.1's text encoder (Qwen3-VL) reads them (spec A6):
//!
//! - [`processor`]: the image processor (smart resize, normalisation, merge-ordered patch rows);
//! - [`prompt`]: the edit template, each image's run of pad tokens and the multimodal RoPE
//!   positions of the prompt.

pub mod processor;
pub mod prompt;

pub use processor::{ImageProcessorConfig, VisionImage, smart_resize};
pub use prompt::{EditPrompt, ImageSpan, edit_template, mrope_positions};
