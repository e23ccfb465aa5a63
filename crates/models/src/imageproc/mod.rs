//! Image input for the vision models: decoding to RGB, the reference's resampler, and patches.
//!
//! Everything here is host work done once per image before a forward pass:
//! - [`decode`]: PNG, JPEG, WebP, GIF (first frame) and BMP to 8-bit RGB, converted the way the
//!   reference processor converts a Pillow image (transparency composited onto white);
//! - [`resize`]: torch's uint8 antialiased bicubic resampler (what torchvision's `resize` runs),
//!   reproduced byte for byte;
//! - [`patches`]: the Gemma 4 image processor's target-size rule, soft-token budgets and the
//!   16×16 patches with their (x, y) positions.

pub mod decode;
pub mod patches;
pub mod resize;

pub use decode::{Image, MAX_PIXELS};
pub use patches::{
    ImageBudget, PatchSpec, Patches, patchify, pixel_value, pixel_values, preprocess, target_size,
};
pub use resize::resize_bicubic_aa;
