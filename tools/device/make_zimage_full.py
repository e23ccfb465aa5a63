"""A full-size random-weight Z-Image-Turbo folder in the published diffusers layout, for speed
tests and full-size parity (the weights are random; speed does not depend on them).

    python3 make_zimage_full.py OUT_DIR MINI_DIR

OUT_DIR gets model_index.json, transformer/ (ZImageTransformer2DModel, 6.15B, bf16, sharded),
text_encoder/ (Qwen3Model, Qwen3-4B shapes, bf16, sharded), vae/ (AutoencoderKL, Flux-style,
16 latent channels) and scheduler/; tokenizer/ and the scheduler config are copied from MINI_DIR
(Tessera's bundled zimage-mini: a real Qwen2 tokenizer file layout with a smaller vocabulary).
Models are built on the GPU when there is one (about a minute on an H200, mostly writing ~20 GB).
Configs as ../../shared/tools/refbench.py builds them (the published model's shapes)."""
import json, shutil, sys, time
from pathlib import Path

# peft (on the GPU machine) is irrelevant here and imports model classes a trimmed transformers
# wheel leaves out (run a2 failed on it); a None entry makes diffusers treat it as absent.
sys.modules.setdefault("peft", None)

import torch
from diffusers import AutoencoderKL, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

out, mini = Path(sys.argv[1]), Path(sys.argv[2])
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16
t0 = time.time()
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)

tcfg = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
            n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
            rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
with torch.device(dev):
    tr = ZImageTransformer2DModel(**tcfg).to(dt).eval()
tr.save_pretrained(out / "transformer", max_shard_size="5GB")
del tr
print(f"transformer saved ({time.time() - t0:.0f} s)", flush=True)

qcfg = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=40960, tie_word_embeddings=True)
with torch.device(dev):
    te = Qwen3Model(qcfg).to(dt).eval()
te.save_pretrained(out / "text_encoder", max_shard_size="5GB")
del te
print(f"text encoder saved ({time.time() - t0:.0f} s)", flush=True)

with torch.device(dev):
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, norm_num_groups=32, act_fn="silu",
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False, mid_block_add_attention=True).to(dt).eval()
vae.save_pretrained(out / "vae")
print(f"vae saved ({time.time() - t0:.0f} s)", flush=True)

for part in ("tokenizer", "scheduler"):
    shutil.rmtree(out / part, ignore_errors=True)
    shutil.copytree(mini / part, out / part)
shutil.copy(mini / "model_index.json", out / "model_index.json")
print(json.dumps({"dir": str(out), "seconds": round(time.time() - t0, 1)}))
