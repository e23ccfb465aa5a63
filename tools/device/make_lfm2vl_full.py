#!/usr/bin/env python3
"""A full-size random LFM2-VL-450M in the published Hugging Face layout, for speed tests (not for accuracy).

Shapes are the published LFM2-VL-450M's: SigLIP2-NaFlex tower (hidden 768, FFN 3072, 12 layers, 12 heads, patch
16, 256 position embeddings = a 16x16 grid, gelu_pytorch_tanh, LN eps 1e-6, no head), pixel unshuffle by 2,
projector LayerNorm(3072) -> Linear(3072, 2560) -> GELU -> Linear(2560, 1024) with biases, and the LFM2-350M
decoder: hidden 1024, 16 layers with full attention at indices 2, 5, 8, 10, 12, 14 and the short convolution
(L_cache 3, no bias) elsewhere, 16 q / 8 kv heads (head_dim 64), `block_ff_dim` 6656 with
block_auto_adjust_ff_dim, multiplier 1.0, multiple_of 256 (int(2 * 6656 / 3) = 4437 -> 4608), vocab 65536,
128000 positions, norm eps 1e-5, RoPE theta 1e6, tied embeddings (no lm_head in the file), bos 1, eos 7, pad 0.

Files written to OUT_DIR:
  config.json               published spelling (`torch_dtype`, `rope_theta`, `block_ff_dim` next to
                            `intermediate_size`, `full_attn_idxs` next to `layer_types`, the image keys the
                            reference ignores at the top level), as crates/models/assets/lfm2vl-mini/config.json
  model.safetensors         bf16, published names: model.vision_tower.vision_model.*, model.multi_modal_projector.*,
                            model.language_model.* (~0.9 GB)
  preprocessor_config.json  the published 450M image settings: tile 512, min/max image tokens 64/256, min/max
                            tiles 2/10, use_thumbnail false (spelled out: the class default is true),
                            max_pixels_tolerance 2.0, do_image_splitting true, max_num_patches 1024 (what the
                            processor derives anyway), mean/std 0.5, bilinear; image_processor_type
                            "Lfm2VlImageProcessorFast" (5.25 maps the legacy Fast name to Lfm2VlImageProcessor).
                            transformers 5.25 reads this file (the flat keys of processor_config.json are
                            ignored); the script checks what it loads.
  processor_config.json     published style: the flat image keys + processor_class (ignored by the reference)
  generation_config.json    bos 1, eos 7, pad 0
  tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja
                            copied from crates/models/assets/lfm2vl-mini: the miniature's 512-token byte-level
                            BPE with the special tokens at the real ids (<image> 396, <|im_end|> 7, ...). The real
                            LFM2 tokenizer has 65536 entries; a 512-token tokenizer only ever produces ids < 512,
                            which is fine for speed tests (the model's vocab, embedding and lm_head are full size).

Weights: random, deterministic per --seed (one torch generator, parameters in name order), drawn directly in
bf16: matrices, the depthwise conv taps [1024, 1, 3], the position embeddings and the token embedding rows
N(0, 0.02^2); LayerNorm / RMSNorm weights 1 + 0.02 N(0, 1); biases 0.01 N(0, 1). The model is instantiated on
the meta device only, for the parameter names and shapes (no slow inits). The text is garbage; the speed is the
real model's.

--small keeps every width (and the vocab) but only 2 tower layers and 3 decoder layers (conv, attention, conv),
for a quick CPU check of the files and names.

After writing, the script (unless --no-check) loads OUT_DIR with
`Lfm2VlForConditionalGeneration.from_pretrained(OUT_DIR, dtype=torch.bfloat16)` (use_kernels=False: without the
`kernels` package, as on the GPU machine, 5.25 refuses to load otherwise) (no missing / unexpected keys,
every tensor equal to what was written, FFN width 4608, layer types, tied lm_head) and `AutoProcessor` (the
image settings above), and runs one short bf16 forward over a 512x512 image prompt.

Usage (repository root; < 1 min on 16 cores, ~1 min on 2):
  make_lfm2vl_full.py OUT_DIR [--seed N] [--small] [--no-check]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file
from transformers import Lfm2Config, Lfm2VlConfig, Lfm2VlForConditionalGeneration, Siglip2VisionConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MINI = os.path.join(ROOT, "crates", "models", "assets", "lfm2vl-mini")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

FULL_ATTN = [2, 5, 8, 10, 12, 14]
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
              patch_size=16, num_patches=256, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
              attention_dropout=0.0, vision_use_head=False)
TEXT = dict(vocab_size=65536, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=6656, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
            block_multiple_of=256, conv_L_cache=3, conv_bias=False, max_position_embeddings=128000, norm_eps=1e-5,
            pad_token_id=0, bos_token_id=1, eos_token_id=7, tie_word_embeddings=True)
FFN_WIDTH = 4608
PROJECTOR = dict(projector_hidden_size=2560, projector_hidden_act="gelu", projector_bias=True,
                 projector_use_layernorm=True, downsample_factor=2, image_token_id=396)
# The published image settings (config.json / processor_config.json carry them flat; the reference ignores them
# there and reads preprocessor_config.json).
IMAGE = dict(tile_size=512, min_image_tokens=64, max_image_tokens=256, min_tiles=2, max_tiles=10,
             use_thumbnail=False, max_pixels_tolerance=2.0, do_image_splitting=True, downsample_factor=2,
             encoder_patch_size=16, max_num_patches=1024)
PREPROCESSOR = dict(IMAGE, do_normalize=True, do_rescale=True, do_resize=True, image_mean=[0.5, 0.5, 0.5],
                    image_std=[0.5, 0.5, 0.5], image_processor_type="Lfm2VlImageProcessorFast",
                    processor_class="Lfm2VlProcessor", resample=2, rescale_factor=1 / 255)


# LFM2-VL-1.6B (`--variant 1.6b`): the shape-optimised SigLIP2 NaFlex tower (1152 wide, FFN 4304, 27 layers,
# 16 heads of 72) and LFM2-1.2B (2048 wide, 32 q / 8 kv heads of 64, block_ff_dim 12288 -> FFN 8192); the
# projector as the 450M's (2560, LayerNorm), an assumption the spec marks unverified for the 1.6B.
VARIANTS = {
    "450m": {},
    "1.6b": dict(vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
                 text=dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288),
                 ffn=8192),
}


def use_variant(name):
    global VISION, TEXT, FFN_WIDTH
    v = VARIANTS[name]
    VISION = dict(VISION, **v.get("vision", {}))
    TEXT = dict(TEXT, **v.get("text", {}))
    FFN_WIDTH = v.get("ffn", FFN_WIDTH)


def configs(small):
    vision = dict(VISION, num_hidden_layers=2) if small else VISION
    if small:
        text = dict(TEXT, num_hidden_layers=3)
        types = ["conv", "full_attention", "conv"]
    else:
        text = TEXT
        types = ["full_attention" if i in FULL_ATTN else "conv" for i in range(text["num_hidden_layers"])]
    tc = Lfm2Config(**text, layer_types=types, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    cfg = Lfm2VlConfig(vision_config=Siglip2VisionConfig(**vision).to_dict(), text_config=tc.to_dict(),
                       tie_word_embeddings=True, **PROJECTOR)
    return cfg, types


def published_config(cfg, types):
    """5.25's config.json rewritten in the published spelling (as tools/fixtures/lfm2vl.py writes the mini's)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            conf = json.load(f)
    conf.pop("dtype", None)
    conf["torch_dtype"] = "bfloat16"
    tc = conf["text_config"]
    tc.pop("rope_parameters", None)
    tc.pop("dtype", None)
    tc["rope_theta"] = 1_000_000.0
    tc["block_ff_dim"] = tc["intermediate_size"]
    tc["block_dim"] = tc["hidden_size"]
    tc["conv_dim"] = tc["hidden_size"]
    tc["num_heads"] = tc["num_attention_heads"]
    tc["full_attn_idxs"] = [i for i, t in enumerate(types) if t == "full_attention"]
    tc["torch_dtype"] = "bfloat16"
    conf["vision_config"].pop("dtype", None)
    conf["vision_config"]["torch_dtype"] = "bfloat16"
    conf["vision_feature_layer"] = -1
    conf["use_image_special_tokens"] = True
    conf.update(IMAGE)
    return dict(sorted(conf.items()))


def random_weights(cfg, seed):
    """bf16 tensors under the published names, drawn in name order from one generator (meta model for shapes)."""
    with torch.device("meta"):
        meta = Lfm2VlForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(meta.state_dict().items()):
        if name == "lm_head.weight":
            continue  # tied to model.language_model.embed_tokens.weight
        v = torch.randn(t.shape, generator=gen, dtype=torch.bfloat16)
        leaf = name.rsplit(".", 1)[-1]
        if t.dim() >= 2:
            v.mul_(0.02)
        elif leaf == "weight":  # LayerNorm / RMSNorm
            v.mul_(0.02).add_(1.0)
        else:
            v.mul_(0.01)
        out[name.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1)] = v
    return out, meta


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def check(out_dir, tensors, types, small):
    from PIL import Image
    from transformers import AutoProcessor

    t0 = time.time()
    model, info = Lfm2VlForConditionalGeneration.from_pretrained(out_dir, dtype=torch.bfloat16, use_kernels=False,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd = model.state_dict()
    for k, v in tensors.items():
        k = k.replace("model.vision_tower.vision_model.", "model.vision_tower.", 1)
        assert torch.equal(sd[k], v), k
    assert sd["lm_head.weight"].data_ptr() == sd["model.language_model.embed_tokens.weight"].data_ptr()
    tc = model.config.text_config
    lm = model.model.language_model
    assert list(tc.layer_types) == types, tc.layer_types
    assert lm.layers[0].feed_forward.w1.out_features == FFN_WIDTH
    attn = next(l.self_attn for l in lm.layers if l.is_attention_layer)
    assert attn.head_dim == 64
    assert attn.num_key_value_groups == TEXT["num_attention_heads"] // TEXT["num_key_value_heads"]
    assert model.config.projector_hidden_size == 2560 and model.model.multi_modal_projector.use_layer_norm
    assert model.config.vision_config.num_hidden_layers == (2 if small else VISION["num_hidden_layers"])
    assert tc.rope_parameters["rope_theta"] == 1e6 and tc.max_position_embeddings == 128000
    assert model.dtype == torch.bfloat16
    proc = AutoProcessor.from_pretrained(out_dir)
    ip = proc.image_processor
    got = {k: getattr(ip, k) for k in IMAGE}
    assert got == IMAGE, got
    img = Image.new("RGB", (512, 512), (120, 60, 200))
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is this?"}]}]
    inputs = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    n_img = int((inputs["input_ids"] == 396).sum())
    assert n_img == 256, n_img
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == 65536 and torch.isfinite(logits.float()).all()
    print(f"check: loads with no missing/unexpected keys, tensors equal, FFN {FFN_WIDTH}, layers {types}; processor "
          f"{got}; a 512x512 image -> {n_img} image tokens, prompt of {inputs['input_ids'].shape[1]} tokens, finite "
          f"logits ({time.time() - t0:.1f} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="2 tower layers and 3 decoder layers, full widths")
    ap.add_argument("--no-check", action="store_true", help="skip loading the result back")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="450m", help="which published shape")
    args = ap.parse_args()
    use_variant(args.variant)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.time()
    cfg, types = configs(args.small)
    os.makedirs(args.out_dir, exist_ok=True)
    write_json(os.path.join(args.out_dir, "config.json"), published_config(cfg, types))
    tensors, meta = random_weights(cfg, args.seed)
    assert meta.model.language_model.layers[0].feed_forward.w1.out_features == FFN_WIDTH
    n = sum(v.numel() for v in tensors.values())
    t1 = time.time()
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    t2 = time.time()
    write_json(os.path.join(args.out_dir, "preprocessor_config.json"), dict(sorted(PREPROCESSOR.items())))
    proc_conf = {k: v for k, v in IMAGE.items()}
    proc_conf.update(processor_class="Lfm2VlProcessor", use_image_special_tokens=True)
    write_json(os.path.join(args.out_dir, "processor_config.json"), dict(sorted(proc_conf.items())))
    write_json(os.path.join(args.out_dir, "generation_config.json"),
               {"bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0})
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(MINI, f), os.path.join(args.out_dir, f))
    print(f"wrote {args.out_dir}: {len(tensors)} tensors, {n / 1e6:.1f} M parameters "
          f"({os.path.getsize(os.path.join(args.out_dir, 'model.safetensors')) / 1e9:.2f} GB); "
          f"weights {t1 - t0:.1f} s, save {t2 - t1:.1f} s", flush=True)
    if not args.no_check:
        check(args.out_dir, tensors, types, args.small)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
