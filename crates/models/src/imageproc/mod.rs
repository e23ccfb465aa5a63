//! Image input for the vision models: decoding to RGB, the reference's resampler, and patches.
//!
//! Everything here is host work done once per image before a forward pass:
//! - [`decode`]: PNG, JPEG, WebP, GIF (first frame) and BMP to 8-bit RGB, converted the way the
//!   reference processor converts a Pillow image (transparency composited onto white);
//! - [`resize`]: torch's uint8 antialiased bicubic and bilinear resamplers (what torchvision's
//!   `resize` runs), reproduced byte for byte;
//! - [`pil`]: Pillow's Lanczos resize of RGBA (premultiplied, Pillow 13's pass order) and its
//!   paste over white, byte for byte (diffusers' `VaeImageProcessor.resize`);
//! - [`patches`]: the Gemma 4 image processor's target-size rule, soft-token budgets and the
//!   16×16 patches with their (x, y) positions;
//! - [`plan`]: target size, patch grid and memory decided from a file's header, so that an
//!   image the tower cannot take, or one too costly to preprocess, is refused before decoding.

pub mod decode;
pub mod patches;
pub mod pil;
pub mod plan;
pub mod resize;

pub use decode::{Header, Image, MAX_FILE_BYTES, MAX_PIXELS, decode_rgba, open_rgba, read_file};
pub use patches::{
    ImageBudget, PatchSpec, Patches, patchify, pixel_value, pixel_values, preprocess, target_size,
};
pub use plan::{ImageLimits, ImagePlan};
pub use resize::{Filter, resize_aa, resize_bicubic_aa, resize_bilinear_aa};
