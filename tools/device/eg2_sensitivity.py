"""How sensitive is a full-size random-weight EmbeddingGemma 2 to rounding?

Runs the PyTorch reference (transformers 5.25, eager attention) in float64, float32 and bf16 on the
GPU, and Tessera (CPU f32, CUDA f32, CUDA bf16) on the same texts, then prints max-abs difference
and cosine of every embedding against float64. If float32 PyTorch itself is far from float64,
differences between two f32 engines of that size are a property of the model, not a bug.
Usage: eg2_sensitivity.py MODEL_DIR bench_inputs.json TESSERA_BIN OUT_JSON"""
import json, subprocess, sys, tempfile

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers.models.embedding_gemma2 import EmbeddingGemma2Config, EmbeddingGemma2Model

mdir, inputs_path, tessera, out_path = sys.argv[1:5]
inputs = json.load(open(inputs_path))
texts = [inputs["short"], inputs["long"]] + inputs["batch64"][:6]
tok = Tokenizer.from_file(f"{mdir}/tokenizer.json")
ids = []
for t in texts:
    e = tok.encode(t).ids
    if e[0] != 2: e = [2] + e
    if e[-1] != 1: e = e + [1]
    ids.append(e)
weights = load_file(f"{mdir}/model.safetensors")


def torch_embed(dtype):
    torch.set_default_dtype(dtype if dtype != torch.bfloat16 else torch.float32)
    cfg = EmbeddingGemma2Config.from_json_file(f"{mdir}/config.json")
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    with torch.device("cuda"):
        m = EmbeddingGemma2Model(cfg)
    m = m.to(dtype).eval()
    m.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    out = []
    with torch.no_grad():
        for i in ids:
            h = m.language_model(input_ids=torch.tensor([i], device="cuda")).last_hidden_state[0].double()
            e = h.mean(0)
            out.append((e / e.norm()).cpu().numpy())
    torch.set_default_dtype(torch.float32)
    del m
    torch.cuda.empty_cache()
    return out


def tessera_embed(device, precision):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for t in texts:
            f.write(json.dumps(t) + "\n")
    cmd = [tessera, "embed", "--model", mdir, "--text-file", f.name, "--device", device]
    if precision:
        cmd += ["--precision", precision]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return [np.array(json.loads(l)["embedding"], dtype=np.float64) for l in r.stdout.splitlines()]


runs = {"torch f64": torch_embed(torch.float64), "torch f32": torch_embed(torch.float32),
        "torch bf16": torch_embed(torch.bfloat16), "tessera cpu f32": tessera_embed("cpu", None),
        "tessera cuda f32": tessera_embed("cuda", "f32"), "tessera cuda bf16": tessera_embed("cuda", "bf16")}
ref = runs["torch f64"]
rows = []
print(f"{'run':<20} {'vs':<16} {'worst max abs':>14} {'worst cosine':>14}   (texts: {[len(i) for i in ids]} tokens)")
for base_name, base in [("torch f64", ref), ("tessera cpu f32", runs["tessera cpu f32"])]:
    for name, vecs in runs.items():
        if name == base_name or (base_name != "torch f64" and not name.startswith("tessera cuda")):
            continue
        mx = max(float(np.abs(a - b).max()) for a, b in zip(vecs, base))
        cs = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(vecs, base))
        rows.append({"run": name, "vs": base_name, "max_abs": mx, "cosine": cs})
        print(f"{name:<20} {base_name:<16} {mx:>14.3e} {cs:>14.8f}")
json.dump(rows, open(out_path, "w"), indent=1)
