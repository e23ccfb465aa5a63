#!/usr/bin/env python3
"""How close to float64 can a bf16 engine get on LFM2-VL? The bf16 storage floor of the fixtures, per tap.

Runs the transformers 5.25 reference (`Lfm2VlForConditionalGeneration`, float64 models loaded from the saved
bf16 weights of the bundled miniatures, as tools/fixtures/lfm2vl.py builds them) twice: exact, and with values
rounded to bf16 (round to nearest even: `x.to(torch.bfloat16).to(torch.float64)`) exactly where Tessera's CUDA
bf16 mode stores them, every op otherwise in float64. The gap between the two is what the storage alone costs on
these models and inputs: no bf16 engine with that storage does better, so Tessera's bf16 run is judged against
it (as zimage_bf16_floor.py / eg2_bf16_floor.py do for Z-Image / EmbeddingGemma 2).

Storage points (everything not listed stays float64, as Tessera keeps it f32):
  weights         nothing to do: every matrix and the embedding tables are bf16 in the checkpoint; norm
                  weights, biases and conv taps are f32 in Tessera and hold the checkpoint's bf16 values
  GEMM in         every Linear's input: the pixel values entering the patch embedding, LayerNorm / RMSNorm
                  outputs, attention outputs, fc1's GELU output, the projector's LayerNorm output (or,
                  without the norm, the unshuffled values), linear_1+GELU, the conv layer's y = C·conv(B·x),
                  silu(w1)·w3, the final norm output (input of the tied lm_head)
  GEMM out        stored bf16 (bias included): q/k/v projections (tower and LM), every out_proj (tower
                  attention, LM attention, LM conv) before the residual add, the tower's fc2, the LM conv's
                  in_proj [B|C|x], the LM MLP's w1, w3 and w2; not rounded: the patch embedding, fc1 and
                  linear_1 (their bias+GELU is fused, the GELU output is the next GEMM's input), linear_2
                  (the image features) and the lm_head (the logits)
  post-LN         the tower's post-LayerNorm output (what the unshuffle and the projector read)
  q/k/v, P        attention operands as the flash kernel loads them (in the LM: q and k after the q/k RMSNorm
                  and RoPE, computed from the bf16 projections; so the K/V cache is bf16), the unnormalised
                  probabilities P = exp(s − max) rounded before P·V, the row sums exact
  kept f32        the residual streams, the conv state u = B·x, the conv's arithmetic, norms' arithmetic,
                  RoPE, the position-embedding resize, the image features, the logits
Implementation: forward pre-hooks / hooks on the float64 model's Linear and LayerNorm modules and a
replacement for `F.scaled_dot_product_attention` (the reference runs attention through sdpa), all switched by
the global MODE: "ref" (hooks inert, torch's own SDPA: the unmodified reference), "exact" (our attention, no
rounding), "bf16" (rounding on). Before anything is measured the script checks that "ref" reproduces the
fixture's expected tensors (stored f32: equal after the f32 cast on the CPU) and that "exact" agrees with "ref"
to 1e-12 relative, features, prompt logits and step logits alike (the latter against generate()'s, as the
fixture recorded them).

Taps (relative error max|a − b| / max(1, max|b|), a the bf16 run, b the exact run):
  image cases  "<model>.<image>"  (mini.exact270x250, ..., no-ln.tiled400x368: every image of cases.json)
      features       the image features (projector output rows) from get_image_features on the processor's
                     output for that image alone (tiles padded to max_num_patches, as the fixture ran it)
  prompt cases "<case>"  (mini.text, mini.one_image, mini.two_images, no-ln.one_image)
      logits         the prompt forward's logits, all rows (images encoded inside the forward, rounded too)
      step_logits    the logits of the 32 greedy steps, teacher-forced with the fixture's greedy tokens (so
                     both runs see the same tokens: step 0 is the prompt's last row, step i follows the cached
                     decode of greedy[i-1] through the bf16 K/V cache); worst step
Output: tests/fixtures/lfm2vl/bf16_floor.json, exactly {case: {tap: floor}} (floats; no other keys, so it reads
as a map of maps), e.g. {"mini.exact270x250": {"features": 3e-3}, "mini.text": {"logits": ..., "step_logits":
...}, ...}; a table is printed.

Models load with use_kernels=False: transformers 5.25 otherwise insists on the `kernels` package when it sees
none (the GPU machine has none) and, where it is installed, runs the same PyTorch code as its fallback anyway.

Usage (repository root, torch 2.15 / transformers 5.25 / torchvision 0.29.2; ~1 min on 2 CPU cores):
  lfm2vl_bf16_floor.py fixtures [--device cpu|cuda] [--out PATH]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoProcessor, Lfm2VlForConditionalGeneration

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
import lfm2vl as fixtures  # noqa: E402  (the miniatures' folders, prompts, images)

FIX = os.path.join(ROOT, "tests", "fixtures", "lfm2vl")
OUT = os.path.join(FIX, "bf16_floor.json")
MODE = {"now": "ref"}  # "ref" | "exact" | "bf16"
SDPA = F.scaled_dot_product_attention
# Linear outputs stored bf16 (see the docstring); matched on the module name's last component.
ROUNDED_OUT = {"q_proj", "k_proj", "v_proj", "out_proj", "fc2", "in_proj", "w1", "w2", "w3", "post_layernorm"}


def rnd(x):
    return x.to(torch.bfloat16).to(x.dtype) if MODE["now"] == "bf16" else x


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              **kw):
    """SDPA with a flash kernel's storage: q/k/v as loaded, P = exp(s − max) rounded before P·V, row sums exact."""
    if MODE["now"] == "ref":
        return SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)
    assert dropout_p == 0.0 and not kw, kw
    q, k, v = rnd(query), rnd(key), rnd(value)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:  # torch's alignment: top left
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # a fully masked row: zeros, as no NaN
    p = torch.exp(s - mx)
    return (rnd(p) @ v) / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def install(model):
    """Hooks: every Linear's input rounded; the outputs in ROUNDED_OUT rounded. Inert unless MODE is bf16."""
    n_in = n_out = 0
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, a: (rnd(a[0]),) + tuple(a[1:]))
            n_in += 1
        if last in ROUNDED_OUT:
            assert isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)), name
            m.register_forward_hook(lambda m, a, o: rnd(o))
            n_out += 1
    return n_in, n_out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def load(name, device):
    folder = fixtures.MODELS[name]["folder"]
    model = Lfm2VlForConditionalGeneration.from_pretrained(folder, dtype=torch.float64,
                                                           use_kernels=False).to(device).eval()
    assert model.config._attn_implementation == "sdpa"
    proc = AutoProcessor.from_pretrained(folder)
    return model, proc


def image_features(model, proc, img_name, device):
    enc = proc.image_processor(images=[fixtures.load_image(img_name)], return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=enc["pixel_values"].to(device),
                                               spatial_shapes=enc["spatial_shapes"].to(device),
                                               pixel_attention_mask=enc["pixel_attention_mask"].to(device)
                                               ).pooler_output
    return torch.cat(list(feats))


def prompt_inputs(proc, messages, device):
    msgs = [dict(m, content=m["content"] if isinstance(m["content"], str) else
                 [dict(it, image=fixtures.load_image(it["image"])) if it["type"] == "image" else it
                  for it in m["content"]]) for m in messages]
    inputs = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    return {k: v.to(device) for k, v in inputs.items()}


def prompt_run(model, inputs, greedy):
    """Prompt logits (all rows) and the teacher-forced step logits [32, vocab] through the cache."""
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        logits = out.logits[0]
        cache = out.cache
        steps = [logits[-1]]
        dev = logits.device
        for t in greedy[:-1]:
            out = model(input_ids=torch.tensor([[t]], device=dev), cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[0, -1])
    return logits, torch.stack(steps)


def generate_steps(model, inputs, n):
    """The unmodified reference's greedy step logits, as the fixture recorded them (lm_head outputs)."""
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: rows.append(o[0, -1].clone()))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    try:
        with torch.no_grad():
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    finally:
        hook.remove()
    return torch.stack(rows), gen[0, inputs["input_ids"].shape[1]:].tolist()


def check_fixture(got, want, what, device):
    """The unmodified float64 reference against the fixture's f32 values: equal after the f32 cast on the CPU."""
    got32 = got.to(torch.float32).cpu()
    if device == "cpu":
        assert torch.equal(got32, want), (what, (got32 - want).abs().max().item())
    else:  # another device's float64 kernels sum in another order: still far below f32's resolution
        assert rel(got.cpu(), want) < 1e-6, (what, rel(got.cpu(), want))


def fixtures_floor(device):
    meta = json.load(open(os.path.join(FIX, "cases.json")))
    expected = load_file(os.path.join(FIX, "expected.safetensors"))
    F.scaled_dot_product_attention = attention
    floors, checks = {}, {}
    try:
        for name in fixtures.MODELS:
            model, proc = load(name, device)
            install(model)
            for case in meta["images"][name]:
                img = case["image"]
                key = f"{name}.{img}"
                res = {}
                for mode in ("ref", "exact", "bf16"):
                    MODE["now"] = mode
                    res[mode] = image_features(model, proc, img, device)
                check_fixture(res["ref"], expected[case["tensors"]["features"]], key, device)
                checks[key] = rel(res["exact"], res["ref"])
                assert checks[key] < 1e-12, (key, checks[key])
                floors[key] = {"features": rel(res["bf16"], res["exact"])}
                print(f"{key:<26} features {floors[key]['features']:.3e}", flush=True)
            for p in meta["prompts"]:
                if p["model"] != name:
                    continue
                key = p["case"]
                inputs = prompt_inputs(proc, p["messages"], device)
                assert inputs["input_ids"][0].tolist() == p["input_ids"], key
                greedy = p["greedy"]
                MODE["now"] = "ref"
                ref_steps, ref_tokens = generate_steps(model, inputs, len(greedy))
                assert ref_tokens == greedy, key
                with torch.no_grad():
                    ref_logits = model(**inputs).logits[0]
                check_fixture(ref_logits, expected[p["tensors"]["logits"]], key + " logits", device)
                check_fixture(ref_steps, expected[p["tensors"]["step_logits"]], key + " step_logits", device)
                res = {}
                for mode in ("exact", "bf16"):
                    MODE["now"] = mode
                    res[mode] = prompt_run(model, inputs, greedy)
                checks[key] = max(rel(res["exact"][0], ref_logits), rel(res["exact"][1], ref_steps))
                assert checks[key] < 1e-12, (key, checks[key])
                (lb, sb), (le, se) = res["bf16"], res["exact"]
                floors[key] = {"logits": rel(lb, le), "step_logits": max(rel(sb[i], se[i]) for i in range(len(se)))}
                flips = sum(int(sb[i].argmax() != se[i].argmax()) for i in range(len(se)))
                print(f"{key:<26} logits {floors[key]['logits']:.3e}  step_logits {floors[key]['step_logits']:.3e}"
                      f"  (bf16 argmax differs at {flips}/{len(se)} steps)", flush=True)
    finally:
        F.scaled_dot_product_attention = SDPA
        MODE["now"] = "ref"
    print(f"checks: ref == fixture (f32 cast), max |exact − ref| relative {max(checks.values()):.2e}")
    return floors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["fixtures"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.time()
    floors = fixtures_floor(args.device)
    print("\ncase                       tap           floor")
    for case, taps in floors.items():
        for tap, v in taps.items():
            print(f"{case:<26} {tap:<12} {v:.3e}")
    with open(args.out, "w") as f:
        json.dump(floors, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
