//! The layer between Tessera's models and its front ends (the CLI and the server):
//!
//! - [`family`]: which family a model folder holds, what it does (embed, generate images, chat)
//!   and which devices can run it, decided from its configs before any weight loads;
//! - [`embed`] / [`image`]: a model of each capability behind one trait object, loaded on
//!   whichever device was chosen (no per-family device enums);
//! - [`packing`]: many inputs packed into few device passes, split when a pass runs out of
//!   device memory, prepared on the host while the device runs;
//! - [`chat`]: chat models behind one trait object; [`scheduler`]: the one scheduler that runs
//!   any chat family (admission, cache slots and prefix reuse, prefill chunks beside decoding,
//!   sampling, stops, streaming); [`decode`]: the samplers;
//! - [`text_stream`]: generated tokens to streamed text, with stop strings;
//! - [`pipeline`]: host work overlapped with device work.

pub mod chat;
pub mod decode;
pub mod embed;
pub mod family;
pub mod image;
pub mod packing;
pub mod pipeline;
pub mod scheduler;
pub mod text_stream;

pub use family::{Capability, Family, ModelFilesOf, ModelSpec};
