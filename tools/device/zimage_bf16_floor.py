"""How close to float64 can a bf16 engine get on Z-Image? The bf16 storage floor, per tap.

Runs the diffusers 0.42.1 pipeline (transformers 5.25 Qwen3 text encoder) in float64 twice: exact,
and with values rounded to bf16 where Tessera's CUDA bf16 mode stores them, every op still in
float64. The gap between the two is what the storage alone costs on this model and these inputs:
no bf16 engine with that storage does better, so Tessera's bf16 run is judged against it (within
1.5× per tap, `crates/runtime/tests/zimage_cuda.rs`), as `eg2_bf16_floor.py` does for
EmbeddingGemma 2.

Storage points (Tessera's `Role::Compute` buffers, bf16 under `--precision bf16`):
  weights    every matrix, convolution kernel and embedding table (norm weights and biases stay)
  GEMM in    every Linear and Conv2d input (norm outputs, GroupNorm outputs, im2col columns)
  GEMM out   the outputs stored in bf16 before something other than a product reads them: the
             attention q/k/v (before the q/k norm and RoPE), attention output projections and MLP
             products of the DiT and the text encoder, the VAE resnets' first convolution; not the
             adaLN, embedder, final-layer and VAE outputs kept in f32
  q/k/v, P   attention operands as the flash kernel loads them and the unnormalised probabilities
             before P·V (the row sums exact)
Taps, each the worst relative error (max |a − b| / max |b|) over items and steps, as the CUDA test
measures: caption features (hidden_states[-2] of the prompt rows), every step's velocity and
latent, the VAE's output.

Usage (repository root, with torch 2.15 / transformers 5.25 / diffusers 0.42.1):
  zimage_bf16_floor.py fixtures     the bundled miniature's cases → tests/fixtures/zimage/bf16_floor.json
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
import zimage as fixtures  # noqa: E402  (the miniature's loader: float64 models from the saved files)

OUT = os.path.join(ROOT, "tests", "fixtures", "zimage", "bf16_floor.json")
ROUNDING = {"on": False}
SDPA = F.scaled_dot_product_attention

# The cases of zimage_cuda.rs's floor test: (label, prompt, negative, (height, width), steps, guidance).
CASES = [
    ("64x64, 3 steps", "a red fox in the snow", None, (64, 64), 3, 0.0),
    ("80x48, 2 steps", "a lighthouse", None, (80, 48), 2, 0.0),
    ("64x64, CFG 3.5", "a bowl of ramen", "blurry", (64, 64), 2, 3.5),
]


def rnd(x):
    return x.to(torch.bfloat16).to(x.dtype) if ROUNDING["on"] else x


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              **kw):
    """SDPA with a flash kernel's storage: q/k/v as loaded, P rounded before P·V, row sums exact."""
    q, k, v = rnd(query), rnd(key), rnd(value)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1 + m - n), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (rnd(p) @ v) / p.sum(-1, keepdim=True)


def rounded_out(name):
    """Whether Tessera stores this module's output in bf16 before a non-product reads it."""
    parts = name.split(".")
    dit_or_te = {"to_q", "to_k", "to_v", "w1", "w2", "w3", "q_proj", "k_proj", "v_proj", "o_proj",
                 "gate_proj", "up_proj", "down_proj"}
    if parts[-1] in dit_or_te:
        return True
    if parts[-2:] == ["to_out", "0"] and "decoder" not in parts:
        return True
    return parts[-1] == "conv1" and "resnets" in parts


def install(module):
    """Round weights (kept exact copies) and GEMM boundaries of `module`'s products."""
    exact = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            m.register_forward_pre_hook(lambda m, a: (rnd(a[0]),) + tuple(a[1:]))
            if rounded_out(name):
                m.register_forward_hook(lambda m, a, o: rnd(o))

    def set_rounding():
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(rnd(exact[n]) if exact[n].dim() >= 2 else exact[n])

    return set_rounding


def run(pipe, case, latent):
    """The taps of one generation: caption features, velocities, latents, the VAE's output."""
    label, prompt, negative, (h, w), steps, guidance = case
    vs, lats, out = [], [], {}
    hooks = [pipe.transformer.register_forward_hook(lambda m, a, o: vs.append([x[:, 0] for x in o[0]])),
             pipe.vae.decoder.register_forward_hook(lambda m, a, o: out.__setitem__("image", o))]

    def on_step(p, i, t, kw):
        lats.append(kw["latents"][0].clone())
        return {}

    with torch.no_grad():
        pos, neg = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance > 0, negative_prompt=negative,
                                      device="cpu")
        pipe(prompt=prompt, negative_prompt=negative, height=h, width=w, num_inference_steps=steps,
             guidance_scale=guidance, latents=latent.clone(), output_type="np", callback_on_step_end=on_step)
    for k in hooks:
        k.remove()
    caps = [pos[0]] + ([neg[0]] if guidance > 0 else [])
    return {"caption features": caps, "velocity": [v for step in vs for v in step], "latent": lats,
            "decoded image": [out["image"][0]]}


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def fixtures_floor():
    tok, te, dit, vae, _ = fixtures.load_refs()
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(fixtures.MINI, "scheduler"))
    pipe = ZImagePipeline(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, transformer=dit)
    pipe.set_progress_bar_config(disable=True)
    setters = [install(m) for m in (te, dit, vae)]
    F.scaled_dot_product_attention = attention
    te.config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(20261204)
    rows = []
    for case in CASES:
        h, w = case[3]
        latent = torch.randn((1, 16, h // 8, w // 8), generator=gen, dtype=torch.float32)
        ROUNDING["on"] = False
        for s in setters:
            s()
        exact = run(pipe, case, latent)
        ROUNDING["on"] = True
        for s in setters:
            s()
        got = run(pipe, case, latent)
        floor = {tap: max(rel(a, b) for a, b in zip(got[tap], exact[tap])) for tap in exact}
        print(f"{case[0]:<16} " + ", ".join(f"{k} {v:.2e}" for k, v in floor.items()), flush=True)
        label, prompt, negative, (h, w), steps, guidance = case
        rows.append({"label": label, "prompt": prompt, "negative_prompt": negative, "height": h, "width": w,
                     "steps": steps, "guidance": guidance, "init_latent": latent[0].flatten().tolist(),
                     "floor": floor})
    F.scaled_dot_product_attention = SDPA
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] != ["fixtures"]:
        sys.exit(__doc__)
    rows = fixtures_floor()
    meta = {"generator": "tools/device/zimage_bf16_floor.py fixtures",
            "what": "bf16 storage floor of the bundled miniature per tap (worst relative error)", "cases": rows}
    with open(OUT, "w") as f:
        json.dump(meta, f)
        f.write("\n")
    print(f"wrote {OUT}")
