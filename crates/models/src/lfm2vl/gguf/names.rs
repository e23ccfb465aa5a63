//! llama.cpp's tensor names for LFM2 (`token_embd`, `blk.N.*`) and for its SigLIP2 projector
//! file (`v.*`, `mm.*`), mapped to the Hugging Face checkpoint's names that `text.rs` and
//! `vision.rs` load, with the two layouts llama.cpp's converter changes: the short
//! convolution's kernel (`[d, 1, k]` stored squeezed as `[d, k]`) and the patch embedding (a
//! linear map over `(py, px, c)` patch vectors, stored as a convolution kernel `[C, c, py, px]`).
//! Q and K are stored as the checkpoint has them (the converter permutes them only for
//! Llama-style rotary layouts, which LFM2's is not).

use tessera_core::GgufAs;

/// The sizes the two re-laid-out tensors are seen with.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub conv_kernel: usize,
    pub vision_hidden: usize,
    /// Elements of one patch vector: channels · patch².
    pub patch_in: usize,
}

const LM: &str = "model.language_model";
const TOWER: &str = "model.vision_tower.vision_model";
const PROJ: &str = "model.multi_modal_projector";

/// The checkpoint name and view of GGUF tensor `name`; `None` for a name LFM2-VL does not read.
pub fn view(name: &str, dims: Dims) -> Option<GgufAs> {
    let (stem, suffix) = name.rsplit_once('.')?;
    if !matches!(suffix, "weight" | "bias") {
        return None;
    }
    let plain = |to: String| {
        Some(GgufAs {
            name: format!("{to}.{suffix}"),
            permute: None,
            shape: None,
        })
    };
    if let Some(rest) = stem.strip_prefix("blk.") {
        let (i, part) = rest.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let layer = format!("{LM}.layers.{i}");
        let to = match part {
            "attn_norm" => "operator_norm",
            "ffn_norm" => "ffn_norm",
            "ffn_gate" => "feed_forward.w1",
            "ffn_down" => "feed_forward.w2",
            "ffn_up" => "feed_forward.w3",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.out_proj",
            "attn_q_norm" => "self_attn.q_layernorm",
            "attn_k_norm" => "self_attn.k_layernorm",
            "shortconv.in_proj" => "conv.in_proj",
            "shortconv.out_proj" => "conv.out_proj",
            "shortconv.conv" if suffix == "weight" => {
                return Some(GgufAs {
                    name: format!("{layer}.conv.conv.weight"),
                    permute: None,
                    shape: Some(vec![dims.hidden, 1, dims.conv_kernel]),
                });
            }
            "shortconv.conv" => "conv.conv",
            _ => return None,
        };
        return plain(format!("{layer}.{to}"));
    }
    if let Some(rest) = stem.strip_prefix("v.blk.") {
        let (i, part) = rest.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let to = match part {
            "ln1" => "layer_norm1",
            "ln2" => "layer_norm2",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_out" => "self_attn.out_proj",
            "ffn_up" => "mlp.fc1",
            "ffn_down" => "mlp.fc2",
            _ => return None,
        };
        return plain(format!("{TOWER}.encoder.layers.{i}.{to}"));
    }
    match stem {
        "token_embd" => plain(format!("{LM}.embed_tokens")),
        // LFM2's last norm (`embedding_norm`): older converters name it after the embedding.
        "token_embd_norm" | "output_norm" => plain(format!("{LM}.embedding_norm")),
        "output" => plain("lm_head".into()),
        "v.patch_embd" if suffix == "weight" => Some(GgufAs {
            name: format!("{TOWER}.embeddings.patch_embedding.weight"),
            // [C, c, py, px] → [C, py, px, c], then each patch vector as one row.
            permute: Some(vec![0, 2, 3, 1]),
            shape: Some(vec![dims.vision_hidden, dims.patch_in]),
        }),
        "v.patch_embd" => plain(format!("{TOWER}.embeddings.patch_embedding")),
        "v.position_embd" => plain(format!("{TOWER}.embeddings.position_embedding")),
        "v.post_ln" => plain(format!("{TOWER}.post_layernorm")),
        "mm.input_norm" => plain(format!("{PROJ}.layer_norm")),
        "mm.1" => plain(format!("{PROJ}.linear_1")),
        "mm.2" => plain(format!("{PROJ}.linear_2")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: Dims = Dims {
        hidden: 8,
        conv_kernel: 3,
        vision_hidden: 4,
        patch_in: 12,
    };

    #[test]
    fn maps_layers_and_relays_the_two_converted_layouts() {
        let n = |s: &str| view(s, DIMS).map(|v| v.name);
        assert_eq!(
            n("blk.2.ffn_gate.weight").as_deref(),
            Some("model.language_model.layers.2.feed_forward.w1.weight")
        );
        assert_eq!(
            n("v.blk.11.ffn_down.bias").as_deref(),
            Some("model.vision_tower.vision_model.encoder.layers.11.mlp.fc2.bias")
        );
        assert_eq!(
            n("mm.input_norm.bias").as_deref(),
            Some("model.multi_modal_projector.layer_norm.bias")
        );
        let conv = view("blk.0.shortconv.conv.weight", DIMS).unwrap();
        assert_eq!((conv.permute, conv.shape), (None, Some(vec![8, 1, 3])));
        let patch = view("v.patch_embd.weight", DIMS).unwrap();
        assert_eq!(patch.permute, Some(vec![0, 2, 3, 1]));
        assert_eq!(patch.shape, Some(vec![4, 12]));
        assert_eq!(n("rope_freqs.weight"), None);
        assert_eq!(n("blk.x.attn_q.weight"), None);
        assert_eq!(n("blk.0.attn_q.scale"), None);
    }
}
