"""A full-size random-weight Qwen-Image-2.1 folder in the published diffusers layout, for speed
tests and full-size parity (the weights are random; speed does not depend on them).

    python3 make_qwen_image_full.py OUT_DIR MINI_DIR [--vision-depth N]

OUT_DIR gets model_index.json, transformer/ (QwenImage21Transformer2DModel, 7.1B, bf16, sharded),
text_encoder/ (Qwen3VLForConditionalGeneration with the Qwen3-VL-8B language model, bf16,
sharded), vae/ (AutoencoderKLQwenImage21, the class defaults: 64 latent channels) and
scheduler/; processor/ (tokenizer and chat template) and the scheduler config are copied from
MINI_DIR (Tessera's bundled qwen-image-mini: the real file layout with a smaller vocabulary).
Shapes as ../../shared/tools/refbench_qi21_lfm2vl.py builds them (the published model's). The
vision tower, which text-to-image never runs, has --vision-depth layers (default 1 instead of
27) to save writing 1.1 GB; its tensor names are the published ones. At the published depth of 27
its DeepStack mergers tap blocks 8, 16 and 24 as the published config's do (block 0 below that
depth). The special tokens' ids in the text encoder's config are those of MINI's tokenizer (the
one copied into processor/), so that an edit's image pads are where the encoder looks for them
(the published ids, 151652…151656, are not in the miniature's vocabulary). Weights are N(0, 0.02)
with unit norm scales, as the reference bench initialises them, so activations stay in range.
Models are built on the GPU when there is one."""
import argparse, json, shutil, sys, time
from pathlib import Path

# peft (on the GPU machine) is irrelevant here and imports model classes a trimmed transformers
# wheel leaves out; a None entry makes diffusers and transformers treat it as absent.
sys.modules.setdefault("peft", None)

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("mini")
ap.add_argument("--vision-depth", type=int, default=1)
ap.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on a CPU")
a = ap.parse_args()
out, mini = Path(a.out), Path(a.mini)
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16
t0 = time.time()
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)


@torch.no_grad()
def init(module):
    """N(0, 0.02) for matrices and embeddings, 1 for norm scales (0 for zero-centred ones)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.normal_(0, 0.02)
        elif name.endswith("text_norm.weight") or name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)
    return module


dit_cfg = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
               num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
               causal_condition=True)
text_cfg = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rms_norm_eps=1e-6, hidden_act="silu",
                rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                     mrope_interleaved=True))
vae_cfg = {}
if a.tiny:
    dit_cfg.update(num_layers=1, num_attention_heads=1, context_in_dim=256)
    # 3 layers: the published tower's 3 DeepStack levels feed the first 3 (--vision-depth 27).
    text_cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=1)
    vae_cfg = dict(base_dim=16, decoder_base_dim=16, dim_mult=[1, 2, 2, 2, 2])
with torch.device(dev):
    tr = init(QwenImage21Transformer2DModel(**dit_cfg)).to(dt).eval()
tr.save_pretrained(out / "transformer", max_shard_size="5GB")
del tr
print(f"transformer saved ({time.time() - t0:.0f} s)", flush=True)

# The ids of the tokenizer copied from MINI: the text encoder finds the condition images' rows by them.
added = {t["content"]: t["id"] for t in json.loads((mini / "processor" / "tokenizer.json").read_text())["added_tokens"]}
special = {k: added[k] for k in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
# The published tower taps blocks 8, 16 and 24 (of 27) for DeepStack; shallower test towers tap block 0.
deepstack = [8, 16, 24] if a.vision_depth >= 27 else [0]
te_cfg = Qwen3VLConfig(
    text_config=text_cfg,
    vision_config=dict(depth=a.vision_depth, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       out_hidden_size=text_cfg["hidden_size"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       num_position_embeddings=2304, deepstack_visual_indexes=deepstack, hidden_act="gelu_pytorch_tanh"),
    image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
    vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
    tie_word_embeddings=False)
with torch.device(dev):
    te = init(Qwen3VLForConditionalGeneration(te_cfg)).to(dt).eval()
te.save_pretrained(out / "text_encoder", max_shard_size="5GB")
del te
print(f"text encoder saved ({time.time() - t0:.0f} s)", flush=True)

with torch.device(dev):
    vae = init(AutoencoderKLQwenImage21(**vae_cfg)).to(dt).eval()
vae.save_pretrained(out / "vae")
del vae
print(f"vae saved ({time.time() - t0:.0f} s)", flush=True)

for part in ("processor", "scheduler"):
    shutil.rmtree(out / part, ignore_errors=True)
    shutil.copytree(mini / part, out / part)
shutil.copy(mini / "model_index.json", out / "model_index.json")
print(json.dumps({"dir": str(out), "seconds": round(time.time() - t0, 1)}))
