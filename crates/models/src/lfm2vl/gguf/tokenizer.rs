//! The tokenizer of a GGUF language model (`tokenizer.ggml.*`) as the `tokenizer.json`,
//! `tokenizer_config.json` and `chat_template.jinja` of the checkpoint it was converted from.
//!
//! GGUF keeps a byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`) as its vocabulary in
//! id order, the merges, a type per token (control and user-defined tokens are the checkpoint's
//! added tokens) and the name of the pre-tokenizer (`tokenizer.ggml.pre`), whose split pattern
//! the file does not hold: [`split_pattern`] gives the published pattern of each name Tessera
//! knows.

use std::collections::HashSet;

use serde_json::{Map, Value, json};
use tessera_core::gguf::Gguf;
use tessera_core::{Error, Result};

use super::config::ints;

/// Most tokens and merges a vocabulary may have (the largest published ones have ~260k).
const MAX_VOCAB: usize = 1 << 21;
/// Longest chat template read (the published ones are a few KiB).
const MAX_TEMPLATE: usize = 1 << 20;

/// GGUF's token types (llama.cpp's `llama_token_type`).
const CONTROL: i128 = 3;
const USER_DEFINED: i128 = 4;

/// GPT-2 style split of the Qwen2 tokenizer (single digits).
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Llama 3 split (digits in runs of up to three), which LFM2's tokenizer uses.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split pattern and the `ignore_merges` setting of pre-tokenizer `pre`.
fn split_pattern(pre: &str) -> Option<(&'static str, bool)> {
    match pre {
        "lfm2" | "llama-bpe" | "llama3" | "llama-v3" => Some((LLAMA3, true)),
        "qwen2" => Some((QWEN2, false)),
        _ => None,
    }
}

/// The tokenizer files made from `g`'s metadata, and what the config needs from them.
pub(super) struct Made {
    pub tokenizer: Value,
    pub tokenizer_config: Value,
    pub chat_template: String,
    pub bos: u32,
    pub eos: u32,
    pub pad: Option<u32>,
    pub image_token: u32,
}

fn error(g: &Gguf, message: String) -> Error {
    Error::Gguf {
        path: g.path().to_path_buf(),
        message,
    }
}

/// The token id under `key`, checked to be in the vocabulary.
fn token_id(g: &Gguf, key: &str, vocab: usize) -> Result<u32> {
    let id = g.get_u32(key)?;
    if id as usize >= vocab {
        return Err(error(
            g,
            format!("metadata `{key}` = {id} is outside the vocabulary of {vocab}"),
        ));
    }
    Ok(id)
}

pub(super) fn make(g: &Gguf) -> Result<Made> {
    let model = g.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(error(
            g,
            format!(
                "metadata `tokenizer.ggml.model` is {model:?}: Tessera reads byte-level BPE (\"gpt2\") tokenizers from GGUF files"
            ),
        ));
    }
    let pre = g.get_str("tokenizer.ggml.pre")?;
    let (pattern, ignore_merges) = split_pattern(pre).ok_or_else(|| {
        error(
            g,
            format!(
                "metadata `tokenizer.ggml.pre` is {pre:?}, a pre-tokenizer Tessera does not know (it knows lfm2, llama-bpe, qwen2)"
            ),
        )
    })?;
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let merges = g.get_str_array("tokenizer.ggml.merges")?;
    if tokens.is_empty() || tokens.len() > MAX_VOCAB || merges.len() > MAX_VOCAB {
        return Err(error(
            g,
            format!(
                "{} tokens and {} merges: a vocabulary has 1 to {MAX_VOCAB}",
                tokens.len(),
                merges.len()
            ),
        ));
    }
    let types = ints(g, "tokenizer.ggml.token_type")?;
    if types.len() != tokens.len() {
        return Err(error(
            g,
            format!(
                "metadata `tokenizer.ggml.token_type` has {} entries for {} tokens",
                types.len(),
                tokens.len()
            ),
        ));
    }
    let n = tokens.len();
    let bos = token_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos = token_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let pad = match g.get("tokenizer.ggml.padding_token_id") {
        Some(_) => Some(token_id(g, "tokenizer.ggml.padding_token_id", n)?),
        None => None,
    };
    // A token spelled twice keeps its first id, as a JSON vocabulary can hold it only once.
    let mut vocab = Map::with_capacity(n);
    for (id, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(json!(id));
    }
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL,
            }));
        }
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| error(g, format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<_>>()?;
    let add_bos = g.get("tokenizer.ggml.add_bos_token").is_some()
        && g.get_bool("tokenizer.ggml.add_bos_token")?;
    let bos_text = &tokens[bos as usize];
    let post = if add_bos {
        json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_text, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos_text, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_text: {"id": bos_text, "ids": [bos], "tokens": [bos_text]}},
        })
    } else {
        Value::Null
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merges,
        },
    });
    let mut tokenizer_config = json!({
        "bos_token": bos_text,
        "eos_token": &tokens[eos as usize],
        "add_bos_token": add_bos,
    });
    if let Some(p) = pad {
        tokenizer_config["pad_token"] = json!(&tokens[p as usize]);
    }
    // The other special tokens a chat template may name, where the file gives them.
    for (key, field) in [
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
        ("tokenizer.ggml.seperator_token_id", "sep_token"),
        ("tokenizer.ggml.cls_token_id", "cls_token"),
        ("tokenizer.ggml.mask_token_id", "mask_token"),
    ] {
        if g.get(key).is_some() {
            tokenizer_config[field] = json!(&tokens[token_id(g, key, n)? as usize]);
        }
    }
    let chat_template = g
        .get("tokenizer.chat_template")
        .map(|_| g.get_str("tokenizer.chat_template"))
        .transpose()?
        .ok_or_else(|| {
            error(
                g,
                "has no `tokenizer.chat_template`: LFM2-VL needs its chat template (convert the model again with a current llama.cpp)".into(),
            )
        })?;
    if chat_template.len() > MAX_TEMPLATE {
        return Err(error(
            g,
            format!(
                "`tokenizer.chat_template` has {} bytes; at most {MAX_TEMPLATE} are read",
                chat_template.len()
            ),
        ));
    }
    let image = super::super::processor::IMAGE_TOKEN;
    let image_token = tokens.iter().position(|t| t == image).ok_or_else(|| {
        error(
            g,
            format!("the vocabulary has no {image:?} token: this is not LFM2-VL's language model"),
        )
    })? as u32;
    // Distinct added tokens only: the tokenizers crate would keep the last of two.
    let mut seen = HashSet::new();
    if let Some(dup) = added
        .iter()
        .filter_map(|a| a["content"].as_str())
        .find(|c| !seen.insert(*c))
    {
        return Err(error(g, format!("the special token {dup:?} appears twice")));
    }
    Ok(Made {
        tokenizer,
        tokenizer_config,
        chat_template: chat_template.to_string(),
        bos,
        eos,
        pad,
        image_token,
    })
}
