//! Tessera's models, one folder per family, each written once against
//! [`tessera_backend::Backend`] so the CPU reference and the GPU backends share one definition.
//!
//! - [`blocks`]: blocks shared by the transformer families (attention, MLP, layers, RoPE tables);
//! - [`loader`]: loading a checkpoint's tensors onto a backend, for every family;
//! - [`input`]: multimodal inputs (ordered text and image parts);
//! - [`noise`]: the seeded initial latents of the text-to-image families;
//! - [`egemma2`]: EmbeddingGemma 2 text, image and mixed embeddings;
//! - [`imageproc`]: image decoding, the reference's resampler and patches;
//! - [`text_to_image`]: requests, progress and images of every text-to-image family;
//! - [`residency`]: whether a pipeline's components stay on the device or load for their stage
//!   only (`--offload`);
//! - [`zimage`]: Z-Image-Turbo text-to-image;
//! - [`qwen_image`]: Qwen-Image-2.1 text-to-image with its prefix K/V cache;
//! - [`flow_match`]: the FlowMatch Euler scheduler both text-to-image families sample with;
//! - [`qwen3`]: Qwen3 text models (Z-Image's caption encoder, Qwen-Image's Qwen3-VL language model);
//! - [`tokenize`]: `tokenizer.json` tokenisation shared by the text models;
//! - [`chat_family`]: what a chat family gives the runtime's scheduler (prompts, a forward over
//!   its cache slots);
//! - [`chat_template`]: the chat templates tokenizers ship, rendered as transformers renders them;
//! - [`files`]: a model's files, from a folder or compiled into the binary.

pub mod blocks;
pub mod chat_family;
pub mod chat_template;
pub mod egemma2;
pub mod files;
pub mod flow_match;
pub mod generation;
pub mod gguf_folder;
pub mod imageproc;
pub mod input;
pub mod lfm2vl;
pub mod loader;
pub mod noise;
pub mod qwen3;
pub mod qwen_image;
pub mod residency;
pub mod text_to_image;
pub mod tokenize;
pub mod tokenize_pieces;
pub mod zimage;

pub use files::ModelFiles;
pub use residency::Residency;
