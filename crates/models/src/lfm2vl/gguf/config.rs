//! `config.json`, `preprocessor_config.json` and `generation_config.json` of an LFM2-VL
//! checkpoint, written from the GGUF files' metadata (`lfm2.*` in the language model's file,
//! `clip.*` in the projector's) and the shapes of their tensors.
//!
//! Every size read from the metadata that a buffer is later sized by is checked against a
//! tensor of the file (the tensor table is bounded by the file's length): a corrupt count fails
//! here, naming the key, instead of asking for an impossible allocation later.

use serde_json::{Value, json};
use tessera_core::gguf::{Array, Gguf};
use tessera_core::{Error, Result};

use super::names::Dims;

/// The metadata value under `key` as integers, one (a scalar) or one per entry (an array).
pub(super) fn ints(g: &Gguf, key: &str) -> Result<Vec<i128>> {
    let bad = || Error::Gguf {
        path: g.path().to_path_buf(),
        message: format!("metadata `{key}` is not an integer or an array of integers"),
    };
    let v = g.get(key).ok_or_else(|| Error::Gguf {
        path: g.path().to_path_buf(),
        message: format!("metadata `{key}` not found"),
    })?;
    if let Some(n) = v.as_i128() {
        return Ok(vec![n]);
    }
    let tessera_core::gguf::Value::Array(a) = v else {
        return Err(bad());
    };
    Ok(match a {
        Array::U8(v) => v.iter().map(|&x| x.into()).collect(),
        Array::I8(v) => v.iter().map(|&x| x.into()).collect(),
        Array::U16(v) => v.iter().map(|&x| x.into()).collect(),
        Array::I16(v) => v.iter().map(|&x| x.into()).collect(),
        Array::U32(v) => v.iter().map(|&x| x.into()).collect(),
        Array::I32(v) => v.iter().map(|&x| x.into()).collect(),
        Array::U64(v) => v.iter().map(|&x| x.into()).collect(),
        Array::I64(v) => v.iter().map(|&x| x.into()).collect(),
        _ => return Err(bad()),
    })
}

/// The shape (outermost first) of tensor `name`.
pub(super) fn shape(g: &Gguf, name: &str) -> Result<Vec<usize>> {
    Ok(g.tensor(name)?.shape())
}

/// The count metadata `key` gives, which must equal what the tensor `tensor` shows.
fn matching(g: &Gguf, key: &str, tensor: &str, seen: usize) -> Result<usize> {
    let value = usize_of(g, key)?;
    if value != seen {
        return Err(Error::Gguf {
            path: g.path().to_path_buf(),
            message: format!(
                "metadata `{key}` = {value}, but tensor `{tensor}` holds {seen}: the file is corrupt"
            ),
        });
    }
    Ok(value)
}

/// The `[rows, width]` of the 2-D tensor `name`.
fn table(g: &Gguf, name: &str) -> Result<[usize; 2]> {
    let s = shape(g, name)?;
    <[usize; 2]>::try_from(&s[..]).map_err(|_| Error::Gguf {
        path: g.path().to_path_buf(),
        message: format!("tensor `{name}` has shape {s:?}, not a table"),
    })
}

fn usize_of(g: &Gguf, key: &str) -> Result<usize> {
    Ok(g.get_u32(key)? as usize)
}

/// Layers `blk.0..n` of a file must each have `{prefix}{i}.{probe}`.
fn layers(g: &Gguf, key: &str, prefix: &str, probe: &str) -> Result<usize> {
    let n = usize_of(g, key)?;
    let last = format!("{prefix}{}.{probe}", n.saturating_sub(1));
    if n == 0 || g.tensor(&last).is_err() {
        return Err(Error::Gguf {
            path: g.path().to_path_buf(),
            message: format!("metadata `{key}` = {n}, but the file has no tensor `{last}`"),
        });
    }
    Ok(n)
}

/// What `config.json` says, and the sizes [`super::names::view`] needs.
pub(super) struct Made {
    pub config: Value,
    pub dims: Dims,
}

/// `config.json` of the pair: the language model from `lm`, the tower and projector from
/// `proj`; `image_token` is the id of `<image>` in the vocabulary.
pub(super) fn config(lm: &Gguf, proj: &Gguf, image_token: u32, bos: u32, eos: u32) -> Result<Made> {
    let a = "lfm2";
    let key = |k: &str| format!("{a}.{k}");
    let [vocab_seen, hidden_seen] = table(lm, "token_embd.weight")?;
    let hidden = matching(
        lm,
        &key("embedding_length"),
        "token_embd.weight",
        hidden_seen,
    )?;
    let vocab = match lm.get(&key("vocab_size")) {
        Some(_) => matching(lm, &key("vocab_size"), "token_embd.weight", vocab_seen)?,
        None => vocab_seen,
    };
    let n_layers = layers(lm, &key("block_count"), "blk.", "attn_norm.weight")?;
    let kv = ints(lm, &key("attention.head_count_kv"))?;
    let kv: Vec<i128> = match kv[..] {
        [one] => vec![one; n_layers],
        _ => kv,
    };
    if kv.len() != n_layers {
        return Err(Error::Gguf {
            path: lm.path().to_path_buf(),
            message: format!(
                "metadata `{}` has {} entries for {n_layers} layers",
                key("attention.head_count_kv"),
                kv.len()
            ),
        });
    }
    // LFM2's converter writes 0 kv heads for a convolution layer.
    let layer_types: Vec<&str> = kv
        .iter()
        .map(|&h| if h > 0 { "full_attention" } else { "conv" })
        .collect();
    let heads_kv = kv.iter().copied().max().unwrap_or(0).max(1);
    let conv_kernel = usize_of(lm, &key("shortconv.l_cache"))?;
    if let Some(i) = layer_types.iter().position(|t| *t == "conv") {
        let name = format!("blk.{i}.shortconv.conv.weight");
        let s = shape(lm, &name)?;
        matching(
            lm,
            &key("shortconv.l_cache"),
            &name,
            s.last().copied().unwrap_or(0),
        )?;
    }
    let gate = shape(lm, "blk.0.ffn_gate.weight")?;
    let ffn = matching(
        lm,
        &key("feed_forward_length"),
        "blk.0.ffn_gate.weight",
        gate.first().copied().unwrap_or(0),
    )?;
    let conv_bias = lm.tensor("blk.0.shortconv.in_proj.bias").is_ok();
    let text = json!({
        "model_type": "lfm2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        // The width as stored: the converter applied the auto-adjust rule already.
        "intermediate_size": ffn,
        "block_auto_adjust_ff_dim": false,
        "num_hidden_layers": n_layers,
        "layer_types": layer_types,
        "num_attention_heads": usize_of(lm, &key("attention.head_count"))?,
        "num_key_value_heads": heads_kv,
        "max_position_embeddings": usize_of(lm, &key("context_length"))?,
        "norm_eps": lm.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        "rope_theta": lm.get_f32(&key("rope.freq_base"))?,
        "conv_bias": conv_bias,
        "conv_L_cache": conv_kernel,
        "bos_token_id": bos,
        "eos_token_id": eos,
    });

    let v = "clip.vision";
    let vkey = |k: &str| format!("{v}.{k}");
    let [positions, vision_seen] = table(proj, "v.position_embd.weight")?;
    let vision_hidden = matching(
        proj,
        &vkey("embedding_length"),
        "v.position_embd.weight",
        vision_seen,
    )?;
    let patch_shape = shape(proj, "v.patch_embd.weight")?;
    let [_, channels, patch, _] = patch_shape[..] else {
        return Err(Error::Gguf {
            path: proj.path().to_path_buf(),
            message: format!(
                "tensor `v.patch_embd.weight` has shape {patch_shape:?}, not a convolution kernel"
            ),
        });
    };
    matching(proj, &vkey("patch_size"), "v.patch_embd.weight", patch)?;
    let up = shape(proj, "v.blk.0.ffn_up.weight")?;
    let vision_ffn = matching(
        proj,
        &vkey("feed_forward_length"),
        "v.blk.0.ffn_up.weight",
        up.first().copied().unwrap_or(0),
    )?;
    let mm1 = shape(proj, "mm.1.weight")?;
    let projector_hidden = mm1.first().copied().unwrap_or(0);
    let vision = json!({
        "model_type": "siglip2_vision_model",
        "hidden_size": vision_hidden,
        "intermediate_size": vision_ffn,
        "num_hidden_layers": layers(proj, &vkey("block_count"), "v.blk.", "ln1.weight")?,
        "num_attention_heads": usize_of(proj, &vkey("attention.head_count"))?,
        "num_channels": channels,
        "patch_size": patch,
        "num_patches": positions,
        "layer_norm_eps": proj.get_f32(&vkey("attention.layer_norm_epsilon"))?,
        "hidden_act": "gelu_pytorch_tanh",
    });
    let config = json!({
        "model_type": "lfm2_vl",
        "image_token_id": image_token,
        "projector_hidden_act": "gelu",
        "projector_hidden_size": projector_hidden,
        "projector_bias": proj.tensor("mm.1.bias").is_ok(),
        "projector_use_layernorm": proj.tensor("mm.input_norm.weight").is_ok(),
        "downsample_factor": scale_factor(proj)?,
        // A separate output matrix means untied logits, which the loader refuses by name.
        "tie_word_embeddings": lm.tensor("output.weight").is_err(),
        "vision_config": vision,
        "text_config": text,
    });
    Ok(Made {
        config,
        dims: Dims {
            hidden,
            conv_kernel,
            vision_hidden,
            patch_in: channels * patch * patch,
        },
    })
}

fn scale_factor(proj: &Gguf) -> Result<usize> {
    let key = "clip.vision.projector.scale_factor";
    Ok(match proj.get(key) {
        Some(_) => usize_of(proj, key)?,
        None => 2,
    })
}

/// `preprocessor_config.json`: the published LFM2-VL image settings (the class defaults, which
/// llama.cpp applies to these files too), with the patch, the merge factor, the normalisation
/// and, where the file has them, the pixel limits from `clip.vision.*`.
pub(super) fn preprocessor(proj: &Gguf) -> Result<Value> {
    let patch = usize_of(proj, "clip.vision.patch_size")?;
    let factor = scale_factor(proj)?;
    let mut cfg = json!({
        "encoder_patch_size": patch,
        "downsample_factor": factor,
    });
    for (key, field) in [
        ("clip.vision.image_mean", "image_mean"),
        ("clip.vision.image_std", "image_std"),
    ] {
        if proj.get(key).is_some() {
            let Array::F32(v) = proj.get_array(key)? else {
                return Err(Error::Gguf {
                    path: proj.path().to_path_buf(),
                    message: format!("metadata `{key}` is not an array of f32"),
                });
            };
            if v.len() != 3 {
                return Err(Error::Gguf {
                    path: proj.path().to_path_buf(),
                    message: format!("metadata `{key}` has {} values, not 3", v.len()),
                });
            }
            cfg[field] = json!(v);
        }
    }
    // A token covers (patch · factor)² pixels.
    let per_token = patch
        .checked_mul(factor)
        .and_then(|s| s.checked_mul(s))
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::Gguf {
            path: proj.path().to_path_buf(),
            message: format!("patch {patch} × merge factor {factor} is not a size"),
        })?;
    for (key, field) in [
        ("clip.vision.image_min_pixels", "min_image_tokens"),
        ("clip.vision.image_max_pixels", "max_image_tokens"),
    ] {
        if proj.get(key).is_some() {
            cfg[field] = json!((proj.get_u32(key)? as usize / per_token).max(1));
        }
    }
    Ok(cfg)
}
