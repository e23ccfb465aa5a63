#!/usr/bin/env python3
"""How close to float64 can a bf16 engine get on Qwen-Image-2.1? The bf16 storage floor, per tap.

Runs the diffusers 0.42.1 `QwenImage21Pipeline` (transformers 5.25 Qwen3-VL text encoder) of the bundled
miniature in float64 twice: exact, and with values rounded to bf16 (round to nearest even) where Tessera's
CUDA bf16 mode stores them, every op still in float64. The gap between the two is what the storage alone
costs on this model and these inputs: no bf16 engine with that storage does better, so Tessera's bf16 run
is judged against it (within 1.5× per tap), as `zimage_bf16_floor.py` does for Z-Image.

Storage points (Tessera's `Role::Compute` buffers, bf16 under `--precision bf16`; everything else f32):
  text encoder  (the Qwen3-VL language model; as zimage_bf16_floor.py treats Z-Image's Qwen3)
                weights (every matrix and the embedding table; norm weights stay); every Linear's input
                (norm outputs, attention output, silu(gate)·up); q/k/v projections (before the q/k norm and
                RoPE), o_proj, gate/up and down outputs; the residual stream f32
  DiT           (crates/models/src/qwen_image/transformer.rs)
                weights: every matrix (the q/k RMSNorm weights and txt_in.text_norm's w + 1 stay)
                timestep: the sinusoid features; SiLU(linear_1(·)) and SiLU(linear_2(·)) (temb), each one
                  rounding of the product with its activation; the modulation and norm_out products f32
                txt_in: the RMSNorm output; GELU-tanh(in_layer(·)) rounded once; out_layer's output f32;
                  img_in's input (the latent tokens) rounded, its output f32 (the stream)
                block: LN(x)·(1 + s1); the q|k|v product; q and k again after the per-head RMSNorm and
                  RoPE (in place in the bf16 buffer; the prefix K/V cache is that bf16 K/V); the attention
                  output; o-proj's output, before the f32 tanh-gated residual add; LN(x)·(1 + s2); the
                  gate and up products; SiLU(gate)·up; the down product
                head: LN(x)·(1 + fscale); proj_out's output f32
  attention     q/k/v as the flash kernel loads them and the unnormalised P = exp(s − max) before P·V, the
                row sums exact (every attention of the three models)
  VAE decoder   (crates/models/src/qwen_image/vae.rs of the qi-vae work tree at 221f55d, whose `Bufs` keep
                `c` and `h` in the compute type, and the CUDA conv2d there, which gathers its im2col columns
                in the weight's type with the input activation applied)
                weights: every convolution kernel and 1×1 product matrix (biases and RMS_norm γ stay)
                every convolution's input, as its im2col columns: bf16(act(x)) — post_quant_conv and
                  conv_in of the f32 latent, the shortcuts and the upsamplers of the f32 stream, and the
                  resnets' SiLU(bf16(RMS_norm(·))) (so those are rounded twice: the norm output in `c`,
                  then the activated column)
                every RMS_norm output (`c`: resnets' norm1/norm2, the mid attention's norm, norm_out)
                the resnets' conv1 output (`h`), rounded twice: the product is written into `h` and the
                  bias added there in place, bf16(bf16(W·cols) + b)
                the mid attention's q|k|v (`h`, bias fused: one rounding), its output (`c`, proj's input);
                  proj's output accumulates into the f32 stream
                f32: the stream, conv2 / shortcut / upsampler / conv_out outputs, the DupUp shortcut
  scheduler     the latents and the Euler step f32, as in the reference (diffusers' step runs in f32)

Two f32 casts inside the reference are lifted so that the exact run is float64 throughout: RoPE's complex
product (`apply_rotary_emb_qwen` casts q and k to f32) and the VAE's nearest upsampling (`x.float()`). Left
as in the reference, in both runs: the RoPE angles, the text encoder's cos/sin and the timestep sinusoid
(computed in f32, as Tessera computes them), and the scheduler's f32 Euler step.

Before anything is measured the script checks that the exact mode (hooks inert, the replacement attention,
the float64 RoPE and upsampling) reproduces the fixture's pipeline cases (tests/fixtures/qwen_image/
expected.safetensors, e2e/fox and e2e/cfg: every step's latent and the float image) to 1e-5 relative, and
after each case that every rounding site fired and that every tap moved.

Cases: (label, prompt, negative, (height, width), steps, guidance = true_cfg_scale); the init latent of
each is a float32 randn of the packed shape [1, (h/16)·(w/16), 8] from its own seed (SEED + case index),
stored flattened as "init_latent" (the pipeline's `latents=` without the batch axis).
Taps, each the worst relative error (max |a − b| / max |b|) over items and steps: "prompt features" (the
text encoder features the pipeline gives the DiT, one item per prompt, the negative included under true
CFG), "velocity" (every step's transformer output per branch, before the CFG combination), "latent"
(after every step), "decoded image" (the VAE decoder's output clamped to [-1, 1], before uint8).

Usage (repository root, with torch 2.15 / transformers 5.25 / diffusers 0.42.1; ~1 min on a CPU):
  qwen_image_bf16_floor.py fixtures     the bundled miniature's cases → tests/fixtures/qwen_image/bf16_floor.json
"""
import collections
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21 as vae_module
from diffusers.models.transformers import transformer_qwenimage21 as dit_module

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
import qwen_image as fixtures  # noqa: E402  (the miniature's loader: a float64 pipeline from the saved files)

FIX = os.path.join(ROOT, "tests", "fixtures", "qwen_image")
OUT = os.path.join(FIX, "bf16_floor.json")
ROUNDING = {"on": False}
WHERE = {"now": None}  # which model is running, for the counts of rounding sites
FIRED = collections.Counter()
SDPA = F.scaled_dot_product_attention
SEED = 20261204

# (label, prompt, negative, (height, width), steps, guidance)
CASES = [
    ("64x96, 4 steps", "a red fox in the snow, golden hour", None, (64, 96), 4, 1.0),
    ("64x64, true CFG 4", "a glass teapot with a transparent background", "", (64, 64), 3, 4.0),
    ("128x64, 2 steps", "a lighthouse", None, (128, 64), 2, 1.0),
]
TAPS = ["prompt features", "velocity", "latent", "decoded image"]


def rnd(x, site=None):
    if not ROUNDING["on"]:
        return x
    if site is not None:
        FIRED[f"{WHERE['now']}: {site}"] += 1
    return x.to(torch.bfloat16).to(x.dtype)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              **kw):
    """SDPA with a flash kernel's storage: q/k/v as loaded, P rounded before P·V, row sums exact."""
    assert dropout_p == 0.0 and not kw, kw
    q, k, v = rnd(query, "attention q/k/v"), rnd(key), rnd(value)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:  # torch's alignment: top left
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (rnd(p, "attention P") @ v) / p.sum(-1, keepdim=True)


def rope_f64(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """`apply_rotary_emb_qwen(use_real=False)` in the input's precision (the reference casts to f32)."""
    assert not use_real
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * freqs_cis.unsqueeze(1).to(xc.dtype)).flatten(3).type_as(x)


def upsample_f64(self, x):
    """`QwenImage21Upsample` without its round trip through f32 (nearest: a copy)."""
    return torch.nn.Upsample.forward(self, x)


def te_out(name):
    return name.rsplit(".", 1)[-1] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def dit_out(name):
    parts = name.split(".")
    return (parts[-1] in {"to_q", "to_k", "to_v"} or parts[-2:] == ["to_out", "0"]
            or (parts[-2:-1] == ["img_mlp"] and parts[-1] in {"gate_layer", "proj", "out"}))


def vae_out(name):
    """1: the attention's q|k|v (bias fused); 2: a resnet's conv1 (product, then bias, each stored)."""
    parts = name.split(".")
    if parts[-1] == "to_qkv":
        return 1
    return 2 if parts[-1] == "conv1" and "resnets" in parts[:-1] else 0


def round_twice(m, a, o):
    b = m.bias.view(1, -1, *([1] * (o.dim() - 2)))
    return rnd(rnd(o - b, "conv1 product") + b)


def install(label, module, rounded_out, norms=()):
    """Round the weights (exact copies kept) and the product boundaries of `module`; inert unless rounding."""
    exact = {n: p.detach().clone() for n, p in module.named_parameters()}
    for child in module.children():  # the VAE runs through decode(), not forward()
        child.register_forward_pre_hook(lambda m, a: WHERE.__setitem__("now", label))
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            m.register_forward_pre_hook(lambda m, a: (rnd(a[0], "GEMM in"),) + tuple(a[1:]))
            how = rounded_out(name)
            if how == 2:
                m.register_forward_hook(round_twice)
            elif how:
                m.register_forward_hook(lambda m, a, o: rnd(o, "GEMM out"))
        if isinstance(m, norms):
            m.register_forward_hook(lambda m, a, o: rnd(o, "norm out"))
    matrices = [n for n, p in exact.items() if n.endswith("weight") and p.dim() >= 2]

    def set_rounding():
        changed = 0
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(rnd(exact[n]) if n in matrices else exact[n])
                changed += int(not torch.equal(p, exact[n]))
        return len(matrices), changed

    return set_rounding


def run(pipe, case, latent):
    """The taps of one generation: prompt features, velocities, latents, the VAE's output."""
    label, prompt, negative, (h, w), steps, guidance = case
    n = latent.shape[1]
    feats, vs, lats, out = [], [], [], {}

    def on_dit(m, args, kwargs, o):
        feats.append(kwargs["encoder_hidden_states"][0])
        vs.append(o[0][0, -n:])

    hooks = [pipe.transformer.register_forward_hook(on_dit, with_kwargs=True),
             pipe.vae.decoder.register_forward_hook(lambda m, a, o: out.__setitem__("image", o[0, :, 0].clamp(-1, 1)))]

    def on_step(p, i, t, kw):
        lats.append(kw["latents"][0].clone())
        return {}

    with torch.no_grad():
        pipe(prompt=prompt, negative_prompt=negative, true_cfg_scale=guidance, height=h, width=w,
             num_inference_steps=steps, latents=latent.clone(), output_type="np", callback_on_step_end=on_step)
    for k in hooks:
        k.remove()
    branches = 2 if guidance > 1 and negative is not None else 1
    assert len(vs) == branches * steps and len(lats) == steps, (len(vs), len(lats))
    return {"prompt features": feats[:branches], "velocity": vs, "latent": lats, "decoded image": [out["image"]]}


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def check_reference(pipe):
    """The exact mode against the fixture's float64 pipeline cases (the unmodified reference)."""
    meta = json.load(open(os.path.join(FIX, "cases.json")))
    expected = load_file(os.path.join(FIX, "expected.safetensors"))
    worst = 0.0
    for c in meta["e2e"]:
        p = f"e2e/{c['name']}/"
        case = (c["name"], c["prompt"], c["negative_prompt"], (c["height"], c["width"]), c["steps"], c["guidance"])
        got = run(pipe, case, expected[p + "latents"][None])
        errs = [rel(l, expected[p + f"latent{i}"]) for i, l in enumerate(got["latent"])]
        image = got["decoded image"][0].permute(1, 2, 0) * 0.5 + 0.5
        errs.append(rel(image, expected[p + "image_f"]))
        worst = max(worst, *errs)
        assert max(errs) < 1e-5, (c["name"], errs)
    print(f"exact mode reproduces the fixture's pipeline cases: worst relative error {worst:.1e}", flush=True)


def fixtures_floor():
    pipe = fixtures.load_pipe()
    te, dit, vae = pipe.text_encoder, pipe.transformer, pipe.vae
    assert te.config.text_config._attn_implementation == "sdpa"
    setters = [install("text encoder", te, te_out), install("DiT", dit, dit_out),
               install("VAE", vae, vae_out, norms=vae_module.QwenImage21RMS_norm)]
    F.scaled_dot_product_attention = attention
    dit_module.apply_rotary_emb_qwen = rope_f64
    vae_module.QwenImage21Upsample.forward = upsample_f64
    check_reference(pipe)
    rows = []
    for idx, case in enumerate(CASES):
        label, prompt, negative, (h, w), steps, guidance = case
        tokens = (h // 16) * (w // 16)
        gen = torch.Generator().manual_seed(SEED + idx)
        latent = torch.randn((1, tokens, 8), generator=gen, dtype=torch.float32)
        ROUNDING["on"] = False
        for s in setters:
            s()
        exact = run(pipe, case, latent)
        ROUNDING["on"] = True
        weights = [s() for s in setters]
        FIRED.clear()
        got = run(pipe, case, latent)
        ROUNDING["on"] = False
        floor = {tap: max(rel(a, b) for a, b in zip(got[tap], exact[tap])) for tap in TAPS}
        sites = [f"{m}: {s}" for m in ("text encoder", "DiT") for s in
                 ("GEMM in", "GEMM out", "attention q/k/v", "attention P")]
        sites += [f"VAE: {s}" for s in ("GEMM in", "GEMM out", "conv1 product", "norm out", "attention q/k/v",
                                        "attention P")]
        assert all(FIRED[s] > 0 for s in sites), dict(FIRED)
        assert all(v > 0 for v in floor.values()), floor
        if idx == 0:
            print("rounding sites fired (first case): " + ", ".join(f"{k} {v}" for k, v in sorted(FIRED.items())))
            print("weights (matrices, changed by rounding): " +
                  ", ".join(f"{m} {w}" for m, w in zip(("text encoder", "DiT", "VAE"), weights)))
        print(f"{label:<18} " + ", ".join(f"{k} {v:.2e}" for k, v in floor.items()), flush=True)
        rows.append({"label": label, "prompt": prompt, "negative_prompt": negative, "height": h, "width": w,
                     "steps": steps, "guidance": guidance, "init_latent": latent[0].flatten().tolist(),
                     "floor": floor})
    F.scaled_dot_product_attention = SDPA
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] != ["fixtures"]:
        sys.exit(__doc__)
    rows = fixtures_floor()
    print(f"\n{'case':<18} " + " ".join(f"{t:>15}" for t in TAPS))
    for r in rows:
        print(f"{r['label']:<18} " + " ".join(f"{r['floor'][t]:>15.2e}" for t in TAPS))
    meta = {"generator": "tools/device/qwen_image_bf16_floor.py fixtures",
            "what": "bf16 storage floor of the bundled miniature per tap (worst relative error)", "cases": rows}
    with open(OUT, "w") as f:
        json.dump(meta, f)
        f.write("\n")
    print(f"wrote {OUT}")
