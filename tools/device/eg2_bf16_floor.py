"""How close to float64 can any bf16 (or f16) engine get on a given EmbeddingGemma 2 model?

Runs the PyTorch reference (transformers 5.25, eager) in float64 and again with values rounded
where a reduced-precision engine stores them, still computing every op in float64. What that
costs is a floor set by the model's conditioning, not by any engine's kernels: if the rounding
alone breaks a bound, no engine with that storage meets that bound on that model. The storage
points are every parameter but norm weights and scalars ("weights"), each Linear's input ("GEMM
in") and output ("GEMM out"), q/k/v as the flash kernel loads them, and the unnormalised attention
probabilities P before P·V (the residual stream and everything else stay float64). Variants:
  weights       weights rounded to bf16 (the checkpoint's values as a bf16 engine uploads them;
                exact for a bf16 checkpoint); nothing else
  ideal bf16    weights, GEMM in, GEMM out, q/k/v and P in bf16: Tessera's CUDA bf16 storage
                points, in exact arithmetic
  ideal, f16 attention       as ideal bf16 with q/k/v and P in f16 instead
  bf16 in, f32 out           weights and GEMM in bf16, GEMM out not rounded, q/k/v and P bf16
  bf16 in, f32 out, f16 attention   as the previous with q/k/v and P in f16
  f16 activations            weights rounded to bf16 then f16 (a bf16 checkpoint converted to f16
                             at load); GEMM in, GEMM out, q/k/v and P in f16
  f16 in, f32 out            as f16 activations with GEMM out not rounded
  f16 except MLP down input  as f16 activations, but every down_proj input (gelu(gate)·up, the
                             tensor most at risk of f16 overflow in trained Gemmas) stays bf16
For every variant with f16 activations at a GEMM boundary the largest |value| reaching any
activation rounding point (GEMM in/out, q/k/v, P) is printed too, to show how close f16 comes to
its overflow at 65504.

The "ideal bf16" rows are the floor the CUDA bf16 tests judge Tessera by (within 1.5× of it, in
max abs and in 1 − cosine): tests/fixtures/egemma2/bf16_floor.json for the fixtures (written by
the `fixtures` mode), and the full mode's OUT_JSON for a full-size model, over the same texts
the full-size test embeds (short, long and every batch64 text).

Usage (repository root, .venv-ref or the GPU machine's site):
  eg2_bf16_floor.py fixtures [OUT_JSON]            text and vision fixtures (CPU)
  eg2_bf16_floor.py full MODEL_DIR bench_inputs.json [OUT_JSON]   a full-size model (CUDA if present)
"""
import json
import os
import sys

import numpy as np
import torch
import transformers.models.embedding_gemma2.modeling_embedding_gemma2 as eg2
import transformers.models.gemma4.modeling_gemma4 as gemma4
from safetensors.torch import load_file
from transformers.models.embedding_gemma2 import EmbeddingGemma2Config, EmbeddingGemma2Model

B, H = torch.bfloat16, torch.float16
BH = (B, H)  # bf16, then f16: a bf16 checkpoint converted to f16 at load
# Storage points: w weights; gin / gout every Linear's input / output (down_in, where given, the
# input of every MLP down_proj instead of gin); qkv q/k/v in attention; p the probabilities.
# Each maps to a dtype or a tuple of dtypes applied in turn; absent means kept in float64.
VARIANTS = {
    "weights": dict(w=B),
    "ideal bf16": dict(w=B, gin=B, gout=B, qkv=B, p=B),
    "ideal, f16 attention": dict(w=B, gin=B, gout=B, qkv=H, p=H),
    "bf16 in, f32 out": dict(w=B, gin=B, qkv=B, p=B),
    "bf16 in, f32 out, f16 attention": dict(w=B, gin=B, qkv=H, p=H),
    "f16 activations": dict(w=BH, gin=H, gout=H, qkv=H, p=H),
    "f16 in, f32 out": dict(w=BH, gin=H, qkv=H, p=H),
    "f16 except MLP down input": dict(w=BH, gin=H, gout=H, qkv=H, p=H, down_in=B),
}
ROUND = {}  # the variant being run: where values are rounded, and to what
PEAK = {}  # largest |value| seen at each activation rounding point in the current variant


def rnd(x, where):
    dt = ROUND.get(where)
    if dt is None:
        return x
    if where != "w":
        PEAK[where] = max(PEAK.get(where, 0.0), float(x.detach().abs().max()))
    y = x
    for d in dt if isinstance(dt, tuple) else (dt,):
        y = y.to(d)
    return y.to(x.dtype)


def attention(module, q, k, v, mask, dropout=0.0, scaling=None, softcap=None, **kw):
    """Eager attention with the storage roundings of a flash kernel: q/k/v as stored, the
    unnormalised probabilities rounded before P·V, the row sum kept exact."""
    q, k, v = rnd(q, "qkv"), rnd(k, "qkv"), rnd(v, "qkv")
    k = eg2.repeat_kv(k, module.num_key_value_groups)
    v = eg2.repeat_kv(v, module.num_key_value_groups)
    s = torch.matmul(q, k.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if mask is not None:
        s = s + mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = torch.matmul(rnd(p, "p"), v) / p.sum(-1, keepdim=True)
    return out.transpose(1, 2).contiguous(), None


eg2.eager_attention_forward = attention
gemma4.eager_attention_forward = attention


class Rounded:
    """A float64 model whose parameters and GEMM boundaries are rounded per the current variant."""

    def __init__(self, model):
        self.model = model
        self.exact = {n: p.detach().clone() for n, p in model.named_parameters()}
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                # The vision tower's down_proj is a wrapper whose Linear is down_proj.linear.
                down = "down_proj" in name.split(".")
                mod.register_forward_pre_hook(
                    lambda m, a, down=down: (rnd(a[0], "down_in" if down and "down_in" in ROUND else "gin"),)
                    + tuple(a[1:]))
                mod.register_forward_hook(lambda m, a, o: rnd(o, "gout"))

    def set(self, variant):
        ROUND.clear()
        ROUND.update(VARIANTS.get(variant, {}))
        PEAK.clear()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.exact[n] if "norm" in n or "scalar" in n else rnd(self.exact[n], "w"))


def model_from(config, weights, device):
    torch.set_default_dtype(torch.float64)
    try:
        config._attn_implementation = "eager"
        config.text_config._attn_implementation = "eager"
        if config.vision_config is not None:
            config.vision_config._attn_implementation = "eager"
        with torch.device(device):
            m = EmbeddingGemma2Model(config).eval()
        m.load_state_dict({k: v.to(torch.float64) for k, v in weights.items()}, strict=False)
        return Rounded(m)
    finally:
        torch.set_default_dtype(torch.float32)


def embed(model, ids, kwargs, dim=None):
    dev = next(model.model.parameters()).device
    with torch.no_grad():
        kw = {k: v.to(dev) for k, v in kwargs.items()}
        hs = model.model(input_ids=torch.tensor([ids], device=dev), **kw).last_hidden_state[0]
    e = hs.mean(0)
    e = e / e.norm()
    if dim:
        e = e[:dim] / e[:dim].norm()
    return e.cpu().numpy()


def floor(label, model, inputs):
    """Worst max abs and cosine of each variant against exact float64, over `inputs`
    (a list of (ids, kwargs, dim))."""
    model.set("exact")
    ref = [embed(model, *i) for i in inputs]
    rows = []
    for v in VARIANTS:
        model.set(v)
        out = [embed(model, *i) for i in inputs]
        mx = max(float(np.abs(a - b).max()) for a, b in zip(out, ref))
        cs = min(float(a @ b) for a, b in zip(out, ref))
        rows.append({"model": label, "variant": v, "max_abs": mx, "cosine": cs, "peak_abs": dict(PEAK)})
        print(f"{label:<28} {v:<32} worst max abs {mx:.2e}  worst cosine {cs:.7f}", flush=True)
        if H in (VARIANTS[v].get("gin"), VARIANTS[v].get("gout")):
            print(f"{'':<28} {'':<32} largest |value| rounded: {max(PEAK.values()):.4g} ("
                  + ", ".join(f"{k} {x:.4g}" for k, x in PEAK.items()) + "; f16 max 65504)", flush=True)
    return rows


def fixtures():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
    import egemma2 as base
    import egemma2_vision as vis

    text = json.load(open(os.path.join(base.FIX, "cases.json")))
    vcases = json.load(open(os.path.join(base.FIX, "vision_cases.json")))
    proc, tok = vis.build_processor(base.MINI)
    vinputs = [(*vis.case_inputs(proc, tok, c), c.get("dim")) for c in vcases["cases"]]
    tinputs = [(ids, {}, c.get("dim")) for c in text["cases"] for ids in c["ids"]]
    rows = []
    for name, d in text["models"].items():
        model = model_from(EmbeddingGemma2Config(**base.CFG), load_file(os.path.join(d, "model.safetensors")), "cpu")
        rows += floor(f"{name} text fixtures", model, tinputs)
        rows += floor(f"{name} vision fixtures", model, vinputs)
    return rows


def full(mdir, inputs_path):
    from tokenizers import Tokenizer

    inputs = json.load(open(inputs_path))
    tok = Tokenizer.from_file(os.path.join(mdir, "tokenizer.json"))
    texts = [inputs["short"], inputs["long"]] + inputs["batch64"]
    ids = [[2] + tok.encode(t).ids + [1] for t in texts]  # the file has no post-processor
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = EmbeddingGemma2Config.from_json_file(os.path.join(mdir, "config.json"))
    model = model_from(cfg, load_file(os.path.join(mdir, "model.safetensors")), dev)
    return floor(f"{os.path.basename(mdir.rstrip('/'))} ({[len(i) for i in ids]} tokens)", model,
                 [(i, {}, None) for i in ids])


if __name__ == "__main__":
    if sys.argv[1:2] == ["fixtures"]:
        rows, out = fixtures(), sys.argv[2:3]
    elif sys.argv[1:2] == ["full"] and len(sys.argv) >= 4:
        rows, out = full(sys.argv[2], sys.argv[3]), sys.argv[4:5]
    else:
        sys.exit(__doc__)
    if out:
        json.dump(rows, open(out[0], "w"), indent=1)
