"""A full-size random-weight EmbeddingGemma 2 that is conditioned like a trained one, for parity.

`make_eg2_full.py` keeps transformers' initial norm weights (all ones). With q/k RMS-normed per head
and unscaled attention, every logit then has a standard deviation of √head_dim (16 to 23): attention
is nearly argmax and the model is chaotic — PyTorch's own float32 differs from its float64 by 7e-4
and its bf16 reaches cosine 0.80 on that model (measured, BENCHMARKS.md). No engine can meet a
parity bound there. This copy rescales every q_norm and k_norm weight by (3/√head_dim)^½ so logits
have a standard deviation near 3, as in a trained model; everything else is unchanged.
Usage: make_eg2_parity.py SRC_MODEL_DIR DST_MODEL_DIR"""
import json, os, shutil, sys

import torch
from safetensors.torch import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src):
    if f != "model.safetensors":
        shutil.copy(os.path.join(src, f), dst)
cfg = json.load(open(os.path.join(src, "config.json")))
tensors = load_file(os.path.join(src, "model.safetensors"))
changed = 0
for name, t in tensors.items():
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        hd = t.shape[0]
        tensors[name] = (t.float() * (3.0 / hd ** 0.5) ** 0.5).to(t.dtype)
        changed += 1
save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
print(f"rescaled {changed} q/k norm weights into {dst}")
